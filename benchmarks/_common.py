"""What every benchmark here shares: alternation, medians, and the JSON record.

Why alternate. Two things timed one after the other ("all of A, then all of B") are timed
under different conditions: CPU frequency and thermals drift, another process wakes up, the
allocator's caches fill. Interleaving them (A B, B A, A B, ...) exposes both to the same
drift, and swapping which one goes first each round cancels any advantage of going first
(a warm cache left behind by the other). The comparison is then a ratio of medians: a median
ignores the occasional slow sample (a page fault, a context switch) that a mean would
smear over the whole result.

Records are plain JSON, one file per benchmark and machine, so results from different
machines sit side by side in ``benchmarks/results/``. A record names the machine by its
hardware (CPU model, cores, GPU), never by its hostname.
"""

from __future__ import annotations

import datetime
import json
import re
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import labkit
from labkit import hardware, timing
from labkit.timing import alternate  # noqa: F401  (benchmarks call _common.alternate)

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# Keys every record has; comparison benchmarks add COMPARISON_KEYS.
RECORD_KEYS = ("benchmark", "date", "machine", "versions", "device", "params", "samples_s")
COMPARISON_KEYS = ("ratio", "median_s", "target", "within_target", "what")


# --- measuring ----------------------------------------------------------------------------------


def timed(fn: Callable[[], object], device: torch.device | str = "cpu") -> Callable[[], float]:
    """Wrap ``fn`` so each call returns its wall time in seconds, device synchronised.

    Uses :class:`labkit.timing.Timer`: on CUDA it brackets the call with CUDA events, so
    queued GPU work is counted, not only its launch.
    """
    timer = timing.Timer(device)

    def run() -> float:
        with timer:
            fn()
        return timer.elapsed_s

    return run


def summary(samples: Sequence[float]) -> dict[str, float | int]:
    """Median, quartiles, min, max and count of ``samples`` (seconds)."""
    if not samples:
        raise ValueError("samples is empty: nothing to summarise")
    xs = sorted(samples)
    if len(xs) >= 2:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    else:
        q1 = q3 = xs[0]
    return {
        "median": statistics.median(xs),
        "q1": q1,
        "q3": q3,
        "min": xs[0],
        "max": xs[-1],
        "n": len(xs),
    }


def ratio_of_medians(samples: Mapping[str, Sequence[float]], num: str, den: str) -> float:
    """median(samples[num]) / median(samples[den]): above 1 means ``num`` is slower."""
    d = statistics.median(samples[den])
    if d <= 0:
        raise ValueError(f"median of {den!r} is {d}: cannot divide by it")
    return statistics.median(samples[num]) / d


def paired_ratio(samples: Mapping[str, Sequence[float]], num: str, den: str) -> float:
    """Median over rounds of num_i / den_i: each pair ran back to back, under the same load.

    A second view of the same samples. When the machine's load changes during a run (a
    neighbour starts a job), whole rounds get slower for both sides alike; a per-round
    ratio cancels that, where the ratio of medians only averages it out.
    """
    pairs = list(zip(samples[num], samples[den], strict=True))
    if not pairs or any(d <= 0 for _, d in pairs):
        raise ValueError(f"{den!r} needs positive samples, one per round of {num!r}")
    return statistics.median(n / d for n, d in pairs)


# --- describing the machine ---------------------------------------------------------------------


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def machine(device: torch.device | str | None = None) -> dict[str, Any]:
    """The hardware a result was measured on, without the hostname.

    ``gpu`` is the name of the CUDA device ``device`` (or of GPU 0 when ``device`` is None or
    the CPU and a GPU exists), else None.
    """
    cpu = hardware.cpu_info()
    info: dict[str, Any] = {
        "cpu": cpu.model_name,
        "architecture": cpu.architecture,
        "cores": cpu.usable_cores,
        "logical_cores": cpu.logical_cores,
        "cpu_flags": list(cpu.flags),
        "gpu": None,
        "gpu_count": 0,
    }
    if torch.cuda.is_available():
        dev = torch.device(device) if device is not None else torch.device("cpu")
        index = (dev.index or 0) if dev.type == "cuda" else 0
        info["gpu"] = torch.cuda.get_device_name(index)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def versions() -> dict[str, str]:
    """Python, torch, CUDA and NCCL (where present) and labkit versions."""
    v = dict(timing.versions())
    v["labkit"] = labkit.__version__
    if torch.cuda.is_available():
        nccl = getattr(torch.cuda, "nccl", None)
        if nccl is not None:
            try:
                ver = nccl.version()
                v["nccl"] = ".".join(map(str, ver)) if isinstance(ver, tuple) else str(ver)
            except Exception:  # an NCCL-less CUDA build: leave it out rather than guess
                pass
    return v


def machine_tag(info: Mapping[str, Any]) -> str:
    """Short file-name tag for a machine: "cpu", or the GPU's name ("nvidia-h200")."""
    return _slug(info["gpu"]) if info.get("gpu") else "cpu"


# --- the record ---------------------------------------------------------------------------------


def utc_now() -> str:
    """Now, UTC, ISO 8601 to the second: "2025-01-31T12:00:00+00:00"."""
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


def make_record(
    benchmark: str,
    *,
    device: str,
    params: Mapping[str, Any],
    samples_s: Mapping[str, Sequence[float]],
    **extra: Any,
) -> dict[str, Any]:
    """A JSON-ready record with the keys in :data:`RECORD_KEYS` plus ``extra``."""
    return {
        "benchmark": benchmark,
        "date": utc_now(),
        "machine": machine(device),
        "versions": versions(),
        "device": device,
        "params": dict(params),
        "samples_s": {k: [float(x) for x in v] for k, v in samples_s.items()},
        **extra,
    }


def comparison(
    samples: Mapping[str, Sequence[float]], num: str, den: str, target: float, what: str
) -> dict[str, Any]:
    """The fields a comparison benchmark adds: ratio num/den of medians against ``target``."""
    ratio = ratio_of_medians(samples, num, den)
    return {
        "what": what,
        "ratio": ratio,
        "paired_ratio": paired_ratio(samples, num, den),
        "target": target,
        "within_target": ratio <= target,
        "median_s": {k: statistics.median(v) for k, v in samples.items()},
        "stats_s": {k: summary(v) for k, v in samples.items()},
    }


def check_record(record: Mapping[str, Any]) -> None:
    """Raise ValueError naming the first missing or malformed field of a record."""
    for key in RECORD_KEYS:
        if key not in record:
            raise ValueError(f"record lacks {key!r}; a record needs {RECORD_KEYS}")
    datetime.datetime.fromisoformat(record["date"])
    if not isinstance(record["samples_s"], Mapping) or not all(
        isinstance(v, list) and v and all(isinstance(x, float) for x in v)
        for v in record["samples_s"].values()
    ):
        raise ValueError("samples_s must map each name to a non-empty list of seconds (floats)")
    if "ratio" in record:
        for key in COMPARISON_KEYS:
            if key not in record:
                raise ValueError(f"comparison record lacks {key!r}; it needs {COMPARISON_KEYS}")


def record_path(name: str, record: Mapping[str, Any], results_dir: Path = RESULTS_DIR) -> Path:
    """Where ``--record`` saves it: results/<name>-<machine tag>.json."""
    return Path(results_dir) / f"{name}-{machine_tag(record['machine'])}.json"


def emit(
    record: dict[str, Any], *, name: str, out: str | Path | None, record_it: bool
) -> Path | None:
    """Save ``record`` to ``out``, or to results/ with ``record_it``, else print it."""
    check_record(record)
    text = json.dumps(record, indent=2, allow_nan=False) + "\n"
    path = Path(out) if out else (record_path(name, record) if record_it else None)
    if path is None:
        sys.stdout.write(text)
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"record written to {path}")
    return path
