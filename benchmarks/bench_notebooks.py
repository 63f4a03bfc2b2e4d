"""How long each notebook takes, top to bottom, as a learner runs it: the README's run times.

    python -m benchmarks.bench_notebooks                       # smoke and lab, every notebook
    python -m benchmarks.bench_notebooks --sizes lab --rounds 2 --record

Each notebook in ``solutions/`` (the complete ones: every exercise check runs too, so this is
the longest a learner's copy takes) is executed in a fresh kernel by ``labkit.course.timings`` (the
one place that runs them; ``python -m labkit timings`` is the same run for an instructor), with
the ``size`` parameter injected as papermill does, and timed from the call to its return: kernel
start, imports, every cell, the launched jobs. The record also keeps each section's run time and
the sampled peak memory of the kernel's process tree. Rounds alternate the order of the notebooks, so
a neighbour's burst of load does not always land on the same one. The record keeps every
sample and the machine's load average before and after (a workshop server is busy, and the
same notebook on the same machine took 55 s and 73 s in two runs), and
``tests/test_benchmarks.py`` checks that the README's run-time column says what the record
measured. Nothing here is a pass or fail: it is a report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from benchmarks import _common
from labkit import ids
from labkit.course import timings

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob(ids.NOTEBOOK_GLOB))


def key(size: str, path: Path) -> str:
    """The record's name for one notebook at one size: "lab/01_single_gpu_training"."""
    return timings.key(size, path.stem)


def measure(sizes: list[str], rounds: int, notebooks: list[Path],
            timings_out: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """Every notebook at every size through ``labkit.course.timings`` (the one place that runs them):
    total times, per-section times and sampled peak memory, and the load average around it."""
    load = {"before": list(os.getloadavg())}
    results = timings.run_many(notebooks, sizes, rounds=rounds)
    load["after"] = list(os.getloadavg())
    if timings_out is not None:
        for p in timings.write(results, timings_out, sizes):
            print(f"wrote {p}")
    return {**timings.to_record_fields(results), "load_average_1_5_15_min": load}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["smoke", "lab"],
                        choices=["smoke", "lab", "gpu"], help="sizes to run (default: smoke lab)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each notebook per size")
    parser.add_argument("--only", nargs="*", default=None,
                        help="notebook numbers to run, e.g. 00 02 (default: all); with "
                             "--record, merged into the recorded file")
    parser.add_argument("--record", action="store_true",
                        help="write benchmarks/results/notebooks-<machine>.json")
    parser.add_argument("--out", type=Path, help="write the record to this file")
    parser.add_argument("--timings-out", type=Path,
                        help="also write labkit timings' JSON and Markdown table to this folder")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give 1 or more")
    notebooks = [p for p in SOLUTIONS if args.only is None or ids.notebook_id(p) in args.only]
    if not notebooks:
        parser.error(f"--only {args.only}: no such notebook in solutions/")

    measured = measure(args.sizes, args.rounds, notebooks, args.timings_out)
    record = _common.make_record(
        "notebooks", device="cpu",
        params={"sizes": args.sizes, "rounds": args.rounds, "notebooks": [p.stem for p in notebooks],
                "how": "labkit.course.timings: nbclient with the size parameter injected as papermill does, "
                       "fresh kernel per run, solutions/ (every check included)"},
        samples_s=measured["samples_s"],
    )  # fmt: skip
    for extra in ("load_average_1_5_15_min", "summary", "peak_rss_bytes", "sections", "memory_note"):
        record[extra] = measured[extra]
    for name, s in record["summary"].items():
        print(f"{name:<34} median {s['median_s']:6.1f} s  (min {s['min_s']:.1f}, "
              f"max {s['max_s']:.1f})")  # fmt: skip
    if args.record and args.only is not None:
        record = merge_into_recorded(record)
    _common.emit(record, name="notebooks", out=args.out, record_it=args.record)
    return 0


def merge_into_recorded(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` (some notebooks) merged into the recorded one, which keeps the others'
    samples: each notebook's samples carry the date they were measured on."""
    path = _common.record_path("notebooks", record)
    if not path.exists():
        return record
    old = json.loads(path.read_text())
    if old["params"]["sizes"] != record["params"]["sizes"]:
        raise SystemExit(f"--only --record: the recorded sizes {old['params']['sizes']} differ "
                         f"from these {record['params']['sizes']}: record every notebook again")  # fmt: skip
    dates = old.get("measured_on") or {k: old["date"] for k in old["samples_s"]}
    for k in record["samples_s"]:
        dates[k] = record["date"]
    merged = {**old, "samples_s": {**old["samples_s"], **record["samples_s"]},
              "summary": {**old["summary"], **record["summary"]}, "measured_on": dates}
    for extra in ("peak_rss_bytes", "sections"):  # absent from records before labkit.course.timings
        merged[extra] = {**old.get(extra, {}), **record.get(extra, {})}
    merged["params"] = {**old["params"], "notebooks": sorted(
        set(old["params"]["notebooks"]) | set(record["params"]["notebooks"]))}
    return merged


if __name__ == "__main__":
    sys.exit(main())
