"""Build recordings from the result files a GPU run of the benchmarks writes.

    python -m labkit recordings build benchmarks/results/*-nvidia-*.json --out labkit/recordings/
    python -m labkit recordings show                      # what ships, as the notebooks label it

A GPU run (``scripts/gpu_check.sh``, or ``python -m benchmarks.bench_<name> --record``) writes
one JSON record per benchmark, with every timed sample, the machine, the versions and the
conditions (format: ``benchmarks/README.md``). ``build`` groups the records by GPU, day and
torch/CUDA version, one recording per group, and computes each figure's median and spread
from the samples with ``labkit.recordings.summary``: no number is copied by hand, and a record
whose own median disagrees with its samples is refused. Benchmarks with nothing a learner
needs (CPU-only ones) are skipped and named.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labkit import recordings as rec

RecordSource = tuple[str, dict[str, Any]]  # (file name, the benchmark record)


@dataclass(frozen=True)
class Built:
    """What ``build`` made: the recordings, and the files it skipped with the reason."""

    recordings: tuple[rec.Recording, ...]
    skipped: tuple[tuple[str, str], ...]


def _params(record: dict[str, Any], where: str, *keys: str) -> list[Any]:
    params = record.get("params") or {}
    missing = [k for k in keys if k not in params]
    if missing:
        raise rec.RecordingError(f"{where}: params lack {missing}")
    return [params[k] for k in keys]


def _samples(record: dict[str, Any], where: str, key: str) -> list[float]:
    samples = (record.get("samples_s") or {}).get(key)
    if not isinstance(samples, list) or not samples:
        raise rec.RecordingError(f"{where}: samples_s[{key!r}] is missing or empty")
    return samples


def _precision(record: dict[str, Any], where: str) -> list[dict[str, Any]]:
    size, rounds, warmup, order, timer, tokens, matmul = _params(
        record, where, "size", "rounds", "warmup", "order", "timer", "tokens_per_step",
        "float32_matmul_precision")
    dtypes = list(record["samples_s"])
    return [{"name": f"precision/{size}/{dtype}", "preset": size, "dtype": dtype,
             "what": f"seconds per optimizer step, labkit.train.train_step under {dtype}"
                     + (" autocast" if dtype != "float32" else ""),
             "unit": "s per optimizer step", "tokens_per_step": tokens,
             "timed": f"{timer}; {rounds} rounds after {warmup} warm-up rounds, "
                      f"{', '.join(dtypes)} taking turns step by step ({order}); float32 "
                      f"matmul precision {matmul!r}; batches already on the GPU",
             "samples": _samples(record, where, dtype),
             "check_median": (record.get("median_s") or {}).get(dtype)}
            for dtype in dtypes]  # fmt: skip


def _train_step(record: dict[str, Any], where: str) -> list[dict[str, Any]]:
    size, dtype, rounds, warmup, order, mb, accum, seq = _params(
        record, where, "size", "dtype", "rounds", "warmup", "order", "micro_batch",
        "grad_accum", "seq_len")
    return [{"name": f"train_step/{size}/{dtype}", "preset": size, "dtype": dtype,
             "what": "seconds per optimizer step, labkit.train.train_step",
             "unit": "s per optimizer step", "tokens_per_step": mb * accum * seq,
             "timed": f"labkit.timing.Timer (CUDA events) around each step; {rounds} rounds "
                      f"after {warmup} warm-up rounds, taking turns with a plain PyTorch loop "
                      f"doing the same work ({order}); batches already on the GPU",
             "samples": _samples(record, where, "labkit"),
             "check_median": (record.get("median_s") or {}).get("labkit")}]  # fmt: skip


def _gpu_throughput(record: dict[str, Any], where: str) -> list[dict[str, Any]]:
    dtype, warmup, steps = _params(record, where, "dtype", "warmup", "steps")
    figures = []
    for size in record["samples_s"]:
        result = (record.get("results") or {}).get(size)
        if not isinstance(result, dict):
            raise rec.RecordingError(f"{where}: results[{size!r}] is missing")
        figures.append({
            "name": f"gpu_throughput/{size}/{dtype}", "preset": size, "dtype": dtype,
            "what": "seconds per optimizer step, labkit.train.train_step",
            "unit": "s per optimizer step", "tokens_per_step": result["tokens_per_step"],
            "flops_per_token": result.get("flops_per_token"),
            "peak_flops_per_s": result.get("peak_flops_per_s"),
            "peak_source": result.get("peak_source"),
            "timed": f"train_step's own synchronised step time (StepStats.seconds); {steps} "
                     f"steps after {warmup} warm-up steps, the presets one after the other; "
                     "batches already on the GPU",
            "samples": _samples(record, where, size),
            "check_median": result.get("median_step_s")})  # fmt: skip
    return figures


def _sampler(record: dict[str, Any], where: str) -> list[dict[str, Any]]:
    size, dtype, period_s, block, rounds, warmup, order = _params(
        record, where, "size", "dtype", "period_s", "steps_per_block", "rounds", "warmup",
        "order")
    return [{"name": f"sampler/{size}/{key}", "preset": size, "dtype": dtype,
             "what": f"seconds per block of {block} training steps, "
                     + ("with" if key == "with_sampler" else "without")
                     + f" labkit's metrics sampler reading NVML every {period_s:g} s",
             "unit": f"s per block of {block} optimizer steps",
             "timed": f"{rounds} rounds after {warmup} warm-up, with and without the sampler "
                      f"taking turns ({order})",
             "samples": _samples(record, where, key),
             "check_median": (record.get("median_s") or {}).get(key)}
            for key in record["samples_s"]]  # fmt: skip


# The benchmarks whose figures a learner needs; others (launch, dp_overlap: CPU ranks) skip.
EXTRACTORS: dict[str, Callable[[dict[str, Any], str], list[dict[str, Any]]]] = {
    "precision": _precision,
    "train_step": _train_step,
    "gpu_throughput": _gpu_throughput,
    "sampler": _sampler,
}


def figure_from(spec: dict[str, Any], source: str) -> rec.Figure:
    """A Figure from an extractor's spec: the summary computed from the samples, and checked
    against the median the benchmark itself printed (they must be the same samples)."""
    samples = [float(s) for s in spec.pop("samples")]
    check = spec.pop("check_median", None)
    stats = rec.summary(samples)
    if check is not None and not math.isclose(stats["median"], check, rel_tol=rec.REL_TOL):
        raise rec.RecordingError(f"{source}: {spec['name']}: the record's median {check!r} is not "
                                 f"the median of its samples ({stats['median']!r})")  # fmt: skip
    return rec.Figure(**spec, source=source, samples=tuple(samples), **stats)


def _machine_key(record: dict[str, Any], where: str) -> tuple[str, int, str, str, str | None]:
    machine, versions = record.get("machine") or {}, record.get("versions") or {}
    gpu = machine.get("gpu")
    if record.get("device") != "cuda" or not gpu:
        raise rec.RecordingError(f"{where}: a CPU run (device {record.get('device')!r}); a "
                                 "recording holds figures measured on a GPU")  # fmt: skip
    if not versions.get("torch") or not record.get("date"):
        raise rec.RecordingError(f"{where}: the record lacks its date or torch version")
    return gpu, int(machine.get("gpu_count") or 1), str(record["date"])[:10], \
        versions["torch"], versions.get("cuda")


def file_name(recording: rec.Recording) -> str:
    """``nvidia-h200-2026-12-04.json`` (``2x-...`` for a run on two GPUs)."""
    slug = re.sub(r"[^a-z0-9]+", "-", (recording.gpu or recording.hardware).lower()).strip("-")
    count = f"{recording.gpu_count}x-" if (recording.gpu_count or 1) > 1 else ""
    return f"{count}{slug}-{recording.date[:10]}.json"


def build(sources: Sequence[RecordSource]) -> Built:
    """Recordings from benchmark records, one per (GPU, count, day, torch, CUDA)."""
    groups: dict[tuple, list[tuple[str, dict[str, Any]]]] = {}
    skipped = []
    for name, record in sources:
        if not isinstance(record, dict) or "benchmark" not in record or "samples_s" not in record:
            raise rec.RecordingError(f"{name}: not a benchmark result (it needs 'benchmark' and "
                                     "'samples_s': see benchmarks/README.md)")  # fmt: skip
        if record["benchmark"] not in EXTRACTORS:
            skipped.append((name, f"benchmark {record['benchmark']!r} has no figure a "
                                  f"recording keeps (kept: {', '.join(EXTRACTORS)})"))  # fmt: skip
            continue
        groups.setdefault(_machine_key(record, name), []).append((name, record))
    built = []
    for (gpu, count, day, torch_version, cuda), members in sorted(groups.items()):
        figures = [figure_from({**spec, "benchmark": record["benchmark"]}, name)
                   for name, record in members
                   for spec in EXTRACTORS[record["benchmark"]](record, name)]  # fmt: skip
        conditions = list(dict.fromkeys(r.get("conditions") or "" for _, r in members))
        names = [name for name, _ in members]
        recording = rec.Recording(
            hardware=f"{count}× {gpu}", date=day, torch=torch_version, cuda=cuda, gpu=gpu,
            gpu_count=count, figures=tuple(figures),
            conditions=" / ".join(c for c in conditions if c),
            recorded_by=f"`python -m labkit recordings build` from {', '.join(names)}",
            sources=tuple(f"{name} ({r['benchmark']}, {r['date']})" for name, r in members))
        built.append(rec.from_json(recording.to_json(), f"built from {', '.join(names)}"))
    return Built(tuple(built), tuple(skipped))


def build_files(paths: Sequence[str | Path], out_dir: str | Path) -> Built:
    """Read benchmark result files, build recordings, write each to ``out_dir``."""
    sources = []
    for p in map(Path, paths):
        try:
            sources.append((p.name, json.loads(p.read_text(encoding="utf-8"))))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise rec.RecordingError(f"{p}: cannot read a benchmark result ({e})") from None
    built = build(sources)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for recording in built.recordings:
        path = out / file_name(recording)
        path.write_text(json.dumps(recording.to_json(), indent=1, ensure_ascii=False) + "\n",
                        encoding="utf-8")
        rec.load(path)  # read back: what was written is a valid recording
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="labkit recordings",
                                     description="Key GPU figures recorded on real hardware.")
    sub = parser.add_subparsers(dest="action", required=True)
    b = sub.add_parser("build", help="build recordings from a GPU run's benchmark results")
    b.add_argument("results", nargs="+", type=Path, help="benchmark result files (.json)")
    b.add_argument("--out", type=Path, default=rec.SHIPPED_DIR,
                   help=f"folder to write recordings to (default {rec.SHIPPED_DIR})")
    s = sub.add_parser("show", help="describe recordings (default: those that ship)")
    s.add_argument("files", nargs="*", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.action == "show":
            found = [rec.load(p) for p in (args.files or rec.shipped())]
            print("\n\n".join(r.describe() for r in found) or "no recording ships")
            return 0
        built = build_files(args.results, args.out)
    except rec.RecordingError as e:
        print(f"labkit recordings: {e}")
        return 1
    for name, why in built.skipped:
        print(f"skipped {name}: {why}")
    for r in built.recordings:
        print(f"wrote {Path(args.out) / file_name(r)}: {r.label()}, {len(r.figures)} figures")
    return 0 if built.recordings else 1
