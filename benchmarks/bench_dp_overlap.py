"""Naive vs overlapped vs bucketed data parallelism, side by side, and a bucket-size sweep
set against the α–β model.

    python -m benchmarks.bench_dp_overlap                   # 2 gloo ranks, lab-size GPT
    python -m benchmarks.bench_dp_overlap --size smoke --rounds 6
    python -m benchmarks.bench_dp_overlap --record          # save to benchmarks/results/

The job is ``labkit.course.exercises.data_parallel.bench`` (its docstring says what is timed and modelled), run
here on labkit's reference answers to notebook 02's exercises; notebook 02 runs the same job
on the learner's own classes. The variants alternate within each round and the result is a
ratio of medians (see benchmarks/README.md). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from labkit.course.exercises.data_parallel import bench as dp_bench
from labkit.course.exercises.data_parallel.bench import CAP_FRACTIONS

NAME = "dp_overlap"
TARGET = 1.0  # overlapped DDP's step ÷ naive's: not slower (a report; nothing asserts it)
__all__ = ["CAP_FRACTIONS", "main", "run"]


def run(size: str, rounds: int, warmup: int, device: str, timeout_s: float) -> dict[str, Any]:
    from benchmarks import _common

    r0 = dp_bench.run(size=size, rounds=rounds, warmup=warmup, device=device,
                      timeout_s=timeout_s)  # fmt: skip
    samples = r0["samples_s"]
    cmp = _common.comparison(samples, "overlap", "naive", TARGET,
                             "median step (forward, backward, gradient sync) of overlapped "
                             "DDP ÷ naive DDP, 2 ranks")  # fmt: skip
    median = r0["median_s"]
    best_pred = min(r0["predicted_step_s"].values())
    best_meas = min(median.values())
    sweep = [{**row, "measured_vs_best": row["measured_s"] / best_meas,
              "predicted_vs_best": row["predicted_s"] / best_pred} for row in r0["sweep"]]
    return _common.make_record(
        NAME,
        device=device,
        params={"size": size, "rounds": rounds, "warmup": warmup, "nproc": 2,
                "cap_fractions": list(CAP_FRACTIONS)},
        samples_s=samples,
        **cmp,
        ratios={f"{k}/naive": median[k] / median["naive"] for k in samples if k != "naive"},
        sweep=sweep,
        model={k: r0[k] for k in ("forward_s", "backward_s", "alpha_s", "beta_bytes_per_s",
                                  "allreduce_s", "grad_bytes", "n_params")},
    )


def main(argv: list[str] | None = None) -> int:
    from benchmarks import _common

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="lab", choices=["smoke", "lab", "gpu"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--record", action="store_true", help="save into benchmarks/results/")
    parser.add_argument("--out", help="write the JSON record to this file")
    args = parser.parse_args(argv)
    record = run(args.size, args.rounds, args.warmup, args.device, args.timeout_s)
    m = record["model"]
    print(dp_bench.report({**m, "sweep": record["sweep"]}, args.device))
    print(f"overlap/naive = {record['ratio']:.2f} (ratio of medians; paired "
          f"{record['paired_ratio']:.2f})")
    _common.emit(record, name=f"{NAME}-{args.size}", out=args.out, record_it=args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
