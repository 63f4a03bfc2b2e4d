"""Naive vs overlapped vs bucketed data parallelism, side by side, and a bucket-size sweep
set against the α–β model.

    python -m benchmarks.bench_dp_overlap                   # 2 gloo ranks, lab-size GPT
    python -m benchmarks.bench_dp_overlap --size smoke --rounds 6
    python -m benchmarks.bench_dp_overlap --record          # save to benchmarks/results/

One 2-rank job (gloo on the CPU, or NCCL with ``--device cuda`` on 2+ GPUs) times one training
step (forward, backward, gradient sync; no optimizer: it is the same for all) of the notebook 02
exercises' reference classes (``labkit.exercises.data_parallel``), each on its own copy of one
``labkit.model.GPT``:

* ``naive``     ``NaiveDDP``: after backward, one blocking all-reduce per gradient;
* ``overlap``   ``OverlapDDP``: one asynchronous all-reduce per gradient, from its hook;
* ``bucketed``  ``BucketedDDP`` at each cap of a sweep (a fraction of the gradient bytes up to
  all of them in one bucket).

The variants run alternately within each round (A B C, C B A, ...) with a barrier before each
step, and the result is a ratio of medians (see benchmarks/README.md). Nothing is asserted.

The model: the same job times all-reduces of a small and a large message (α and β of the α–β
line, ``formulas.alpha_beta_fit``) and the backward pass without any communication; then
``formulas.dp_exposed_comm_s`` predicts each variant's step as forward+backward plus the
communication left exposed after backward. The sweep's *shape* is the prediction to compare:
tiny buckets pay α per message, one bucket hides nothing, the best lies between. On the CPU
tier gloo's threads and the backward pass share the same cores, so "overlap" can slow the
compute it hides behind: the measured ratios say how much.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as tdist

from labkit import dist, formulas

NAME = "dp_overlap"
MODULE = "benchmarks.bench_dp_overlap"
CAP_FRACTIONS = (1 / 64, 1 / 16, 1 / 4, 1.0)  # bucket cap as a fraction of the gradient bytes
TARGET = 1.0  # overlapped DDP's step ÷ naive's: not slower (a report; nothing asserts it)


# --------------------------------------------------------------------------- the worker


def _time_allreduce(numel: int, device: torch.device, repeats: int) -> float:
    t = torch.ones(numel, device=device)
    times = []
    for _ in range(repeats + 2):
        tdist.barrier()
        t0 = time.perf_counter()
        tdist.all_reduce(t)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def _worker(ctx: dist.Context) -> dict[str, Any]:
    from labkit import config
    from labkit.exercises import data_parallel as exdp
    from labkit.model import GPT

    cfg = ctx.config
    preset = config.preset(cfg.get("size", "lab"))
    rounds, warmup = int(cfg.get("rounds", 8)), int(cfg.get("warmup", 2))
    n, device = ctx.world_size, ctx.device
    torch.manual_seed(0)
    base = GPT(preset.model).to(device)
    params = [p for p in base.parameters() if p.requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    g = torch.Generator().manual_seed(1 + ctx.rank)  # each rank its own slice of the batch
    b, s = preset.train.micro_batch, preset.model.seq_len
    tokens = torch.randint(0, preset.model.vocab_size, (b, s + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # 1. α and β of this link: a 1 KiB and a large all-reduce (t = 2(n−1)α + 2(n−1)/n · S/β)
    small, large = 256, max(2**20, grad_bytes // 4)
    t_small = _time_allreduce(small, device, 10)
    t_large = _time_allreduce(large, device, 5)
    a, slope = formulas.alpha_beta_fit(4 * small, t_small, 4 * large, t_large)
    alpha_s = a / (2 * (n - 1))  # per ring step
    beta = slope * 2 * (n - 1) / n  # bytes/s per link, as formulas.ring_allreduce_time wants

    # 2. forward and backward with no communication at all
    plain = copy.deepcopy(base)

    def compute_only() -> tuple[float, float]:
        plain.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        _, loss = plain(x, y)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        return t1 - t0, time.perf_counter() - t1

    for _ in range(warmup):
        compute_only()
    fb = [compute_only() for _ in range(rounds)]
    forward_s = statistics.median(f for f, _ in fb)
    backward_s = statistics.median(bw for _, bw in fb)

    # 3. the variants, each on its own copy (hooks stay on the parameters they were put on)
    caps_mb = [grad_bytes * f / 2**20 for f in CAP_FRACTIONS]
    variants: dict[str, tuple[torch.nn.Module, Any]] = {}
    for name, make in [("naive", lambda m: exdp.NaiveDDP(m, n)),
                       ("overlap", lambda m: exdp.OverlapDDP(m, n)),
                       *[(f"bucketed_{f:g}", lambda m, c=c: exdp.BucketedDDP(m, n, c))
                         for f, c in zip(CAP_FRACTIONS, caps_mb, strict=True)]]:  # fmt: skip
        model = copy.deepcopy(base)
        variants[name] = (model, make(model))

    def step_of(name: str):
        model, ddp = variants[name]

        def run() -> float:
            model.zero_grad(set_to_none=True)
            tdist.barrier()  # both ranks start together; not timed
            sync()
            t0 = time.perf_counter()
            _, loss = model(x, y)
            loss.backward()
            ddp.finish_gradient_sync()
            sync()
            return time.perf_counter() - t0

        return run

    from labkit.timing import alternate

    samples = alternate({name: step_of(name) for name in variants}, rounds=rounds, warmup=warmup)

    # 4. the α–β prediction for each variant's step
    sizes = [p.numel() * p.element_size() for p in reversed(params)]
    predicted = {
        # naive: every gradient after backward, one at a time (no overlap: backward_s = 0)
        "naive": formulas.dp_exposed_comm_s(sizes, 0.0, n, alpha_s, beta),
        "overlap": formulas.dp_exposed_comm_s(sizes, backward_s, n, alpha_s, beta),
    }
    buckets = {}
    for name, (_, ddp) in variants.items():
        if name.startswith("bucketed_"):
            bb = [int(bk["buffer"].numel() * bk["buffer"].element_size()) for bk in ddp.buckets]
            buckets[name] = bb
            predicted[name] = formulas.dp_exposed_comm_s(bb, backward_s, n, alpha_s, beta)
    return {
        "samples_s": samples,
        "forward_s": forward_s,
        "backward_s": backward_s,
        "alpha_s": alpha_s,
        "beta_bytes_per_s": beta,
        "allreduce_s": {"small_bytes": 4 * small, "small": t_small, "large_bytes": 4 * large,
                        "large": t_large},
        "grad_bytes": grad_bytes,
        "n_params": len(params),
        "caps_mb": dict(zip([f"bucketed_{f:g}" for f in CAP_FRACTIONS], caps_mb, strict=True)),
        "buckets_bytes": buckets,
        "predicted_exposed_s": predicted,
        "predicted_step_s": {k: forward_s + backward_s + v for k, v in predicted.items()},
    }


worker = dist.entrypoint(_worker)


# --------------------------------------------------------------------------- the driver


def run(size: str, rounds: int, warmup: int, device: str, timeout_s: float) -> dict[str, Any]:
    from benchmarks import _common
    from labkit import launch

    res = launch.run(MODULE, nproc=2, device=device, stream=False, timeout_s=timeout_s,
                     config={"size": size, "rounds": rounds, "warmup": warmup},
                     env={"OMP_NUM_THREADS": "1"} if device == "cpu" else None)  # fmt: skip
    r0 = res.rank(0)
    samples = r0["samples_s"]
    cmp = _common.comparison(samples, "overlap", "naive", TARGET,
                             "median step (forward, backward, gradient sync) of overlapped "
                             "DDP ÷ naive DDP, 2 ranks")  # fmt: skip
    median = {k: statistics.median(v) for k, v in samples.items()}
    best_pred = min(r0["predicted_step_s"].values())
    best_meas = min(median.values())
    sweep = [
        {"variant": k, "cap_mb": r0["caps_mb"].get(k), "buckets": len(r0["buckets_bytes"][k]) if k in r0["buckets_bytes"]
         else r0["n_params"],
         "measured_s": median[k], "predicted_s": r0["predicted_step_s"][k],
         "measured_vs_naive": median[k] / median["naive"],
         "predicted_vs_naive": r0["predicted_step_s"][k] / r0["predicted_step_s"]["naive"],
         "measured_vs_best": median[k] / best_meas,
         "predicted_vs_best": r0["predicted_step_s"][k] / best_pred}
        for k in samples
    ]  # fmt: skip
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


def print_report(record: dict[str, Any]) -> None:
    m = record["model"]
    print(f"{record['params']['nproc']} ranks on {record['device']}, {m['n_params']} gradient "
          f"tensors, {m['grad_bytes'] / 2**20:.2f} MiB; measured: forward "
          f"{m['forward_s'] * 1e3:.1f} ms, backward {m['backward_s'] * 1e3:.1f} ms, "
          f"α {m['alpha_s'] * 1e6:.0f} µs per ring step, β {m['beta_bytes_per_s'] / 1e9:.2f} GB/s")
    print(f"{'variant':<16}{'buckets':>8}{'measured ms':>13}{'predicted ms':>14}"
          f"{'meas/naive':>12}{'pred/naive':>12}")
    for row in record["sweep"]:
        print(f"{row['variant']:<16}{row['buckets']:>8}{row['measured_s'] * 1e3:>13.1f}"
              f"{row['predicted_s'] * 1e3:>14.1f}{row['measured_vs_naive']:>12.2f}"
              f"{row['predicted_vs_naive']:>12.2f}")
    print(f"overlap/naive = {record['ratio']:.2f} (ratio of medians; paired "
          f"{record['paired_ratio']:.2f})")


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
    print_report(record)
    _common.emit(record, name=f"{NAME}-{args.size}", out=args.out, record_it=args.record)
    return 0


if __name__ == "__main__":
    if os.environ.get(dist.JOB_DIR_ENV):  # started by labkit.launch: this process is a rank
        worker()
    else:
        sys.exit(main())
