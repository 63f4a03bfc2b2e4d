"""Key GPU figures recorded on real hardware, shipped so that every learner can see them.

A learner on the CPU tier never sees a GPU, yet the figures only a GPU can show (the step
time of the gpu preset, tokens/s, MFU, bf16 against fp32) are what the course is about. So
labkit ships *recordings*: step times measured on a named GPU on a named day, with the torch
and CUDA versions and the conditions of the run, and the notebooks print them beside this
machine's own measurement, always labelled ("recorded on 1× NVIDIA H200, 2026-12-04, torch
2.11.0+cu130: ..."). Never a number made up to look like a GPU's: a recording is built by
``python -m labkit recordings build`` from the result files a GPU run of the benchmarks
writes (``labkit.recordings.build``), and it keeps every timed sample, so the loader can
recompute each summary and refuse a file whose numbers were edited by hand.

Format: one JSON object per file, UTF-8, in ``labkit/recordings/`` (``shipped()`` lists them)::

    {"format": "labkit-gpu-recording", "version": 1,
     "hardware": "1× NVIDIA H200", "gpu": "NVIDIA H200", "gpu_count": 1,
     "date": "2026-12-04", "torch": "2.11.0+cu130", "cuda": "13.0",
     "conditions": "scripts/gpu_check.sh on a lent H200 ...",
     "recorded_by": "python -m labkit recordings build ...",
     "sources": ["precision-lab-nvidia-h200.json (precision, 2026-12-04T11:56:31+00:00)"],
     "figures": [{"name": "precision/lab/bfloat16", "benchmark": "precision",
                  "what": "seconds per optimizer step, labkit.train.train_step",
                  "unit": "s per optimizer step", "preset": "lab", "dtype": "bfloat16",
                  "timed": "...how, in words...", "source": "precision-lab-nvidia-h200.json",
                  "tokens_per_step": 2048, "flops_per_token": null,
                  "peak_flops_per_s": null, "peak_source": null,
                  "n": 30, "median": 0.0124, "q1": 0.0112, "q3": 0.0135,
                  "min": 0.0106, "max": 0.0137, "samples": [0.0112, ...]}]}

``hardware``, ``date`` and ``torch`` are required: without them a number cannot be told
apart from a guess. Seconds are the only measured unit; tokens/s and MFU are derived from the
median step time in one place (``Figure.tokens_per_s``, ``Figure.mfu``), the way the
benchmarks and notebook 01 derive them. Display (``labkit.recordings.show``) is kept apart
from this format and from collection (``labkit.recordings.build``). Profiler traces of the
course's step on a GPU are ``labkit.recordings.profiles``; traces of other people's real
multi-GPU jobs, public and not recorded by this course, are fetched on request and checked by
``labkit.recordings.public``. Nothing here runs at import.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from labkit._moved import submodules_on_demand
from labkit.errors import LabkitError
from labkit.timing import format_seconds, quartiles

__getattr__ = submodules_on_demand(__name__)  # recordings.show: imported when first named

FORMAT = "labkit-gpu-recording"
VERSION = 1
REQUIRED = ("hardware", "date", "torch")  # what makes a file a recording of real hardware
OPTIONAL = ("gpu", "gpu_count", "cuda", "conditions", "recorded_by", "sources")
SHIPPED_DIR = Path(__file__).parent  # recordings that ship with labkit: *.json here
# A summary is recomputed from the samples on load; a float written by json round-trips
# exactly, so anything beyond rounding in the last bits means the file was edited.
REL_TOL = 1e-9


class RecordingError(ValueError, LabkitError):
    """A file that is not a valid recording; the message names the file and what is wrong."""


@dataclass(frozen=True)
class Figure:
    """One timed quantity of a recording: every sample, its summary and how it was timed.

    The samples are seconds per ``unit`` (per optimizer step, or per block of steps);
    ``median``, ``q1``, ``q3`` (linear interpolation, ``labkit.timing.quartiles``), ``min`` and
    ``max`` summarise them, and ``n`` counts them.
    """

    name: str  # "<benchmark>/<preset>/<dtype or variant>", unique in a recording
    benchmark: str  # the benchmark that timed it (benchmarks/bench_<name>.py)
    what: str  # what one sample is, in words
    unit: str  # "s per optimizer step", "s per block of 108 optimizer steps"
    preset: str  # the labkit.config preset that ran
    dtype: str  # the autocast dtype of the run
    timed: str  # how: the timer, warm-up, rounds, order
    source: str  # the benchmark result file it was built from
    n: int
    median: float
    q1: float
    q3: float
    min: float
    max: float
    samples: tuple[float, ...]
    tokens_per_step: int | None = None  # None where a sample is not one optimizer step
    flops_per_token: float | None = None  # 6N + 12·L·h·s, as the benchmark counted it
    peak_flops_per_s: float | None = None  # the published peak the benchmark divided by
    peak_source: str | None = None

    @property
    def kind(self) -> str:
        """The dtype, and the variant where the name has one: "bfloat16, with_sampler"."""
        variant = self.name.rsplit("/", 1)[-1]
        return self.dtype if variant == self.dtype else f"{self.dtype}, {variant}"

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per step ÷ the median step time (bench_gpu_throughput's definition)."""
        return None if self.tokens_per_step is None else self.tokens_per_step / self.median

    @property
    def mfu(self) -> float | None:
        """Model FLOP/s at the median step ÷ the published peak; None without both."""
        tps = self.tokens_per_s
        if tps is None or self.flops_per_token is None or not self.peak_flops_per_s:
            return None
        return tps * self.flops_per_token / self.peak_flops_per_s

    def describe(self) -> str:
        """``preset 'gpu', bfloat16: median 29.797 ms per optimizer step (middle half ...,
        30 samples); 549,859 tokens/s at the median step; MFU 9.9% of the published
        bfloat16 peak, 989 TFLOP/s``."""
        per = self.unit.removeprefix("s ")
        text = (f"preset {self.preset!r}, {self.kind}: median {format_seconds(self.median)} "
                f"{per} (middle half {format_seconds(self.q1)} to {format_seconds(self.q3)}, "
                f"{self.n} samples)")  # fmt: skip
        if self.tokens_per_s is not None:
            text += f"; {self.tokens_per_s:,.0f} tokens/s at the median step"
        if self.mfu is not None:
            text += (f"; MFU {self.mfu:.1%} of the published {self.dtype} peak, "
                     f"{self.peak_flops_per_s / 1e12:,.0f} TFLOP/s")  # fmt: skip
        return text


def summary(samples: Sequence[float]) -> dict[str, float | int]:
    """``n``, ``median``, ``q1``, ``q3``, ``min``, ``max`` of ``samples``: the one place a
    recording's summary is computed (by the builder) and checked (by the loader)."""
    values = [float(v) for v in samples]
    if not values:
        raise ValueError("no samples: a figure is a summary of measurements")
    q1, q3 = quartiles(values)
    return {"n": len(values), "median": statistics.median(values), "q1": q1, "q3": q3,
            "min": min(values), "max": max(values)}


@dataclass(frozen=True)
class Recording:
    """A loaded recording: where, when and with what it was measured, and its figures."""

    hardware: str  # "1× NVIDIA H200"
    date: str  # the day, ISO 8601 ("2026-12-04")
    torch: str
    figures: tuple[Figure, ...]
    gpu: str | None = None
    gpu_count: int | None = None
    cuda: str | None = None
    conditions: str = ""
    recorded_by: str = ""
    sources: tuple[str, ...] = ()
    path: Path | None = None  # the file it was loaded from

    def label(self) -> str:
        """The words shown beside every recorded number, first of all its hardware."""
        cuda = f", CUDA {self.cuda}" if self.cuda else ""
        return f"recorded on {self.hardware}, {self.date[:10]}, torch {self.torch}{cuda}"

    def figure(self, benchmark: str, preset: str, dtype: str | None = None) -> Figure | None:
        """The first figure of ``benchmark`` at ``preset`` (and ``dtype``), or None."""
        for f in self.figures:
            if (f.benchmark, f.preset) == (benchmark, preset) and dtype in (None, f.dtype):
                return f
        return None

    def describe(self) -> str:
        """The label, the conditions, and one line per figure."""
        lines = [f"{self.label()}:"]
        lines += [f"  {f.benchmark}, {f.describe()}" for f in self.figures]
        if self.conditions:
            lines.append(f"  conditions: {self.conditions}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The file's content (``load`` reads it back to an equal Recording)."""
        out: dict[str, Any] = {"format": FORMAT, "version": VERSION}
        for f in fields(self):
            if f.name not in ("figures", "path"):
                value = getattr(self, f.name)
                out[f.name] = list(value) if isinstance(value, tuple) else value
        out["figures"] = [{**asdict(f), "samples": list(f.samples)} for f in self.figures]
        return out


def shipped() -> list[Path]:
    """The recordings that ship with labkit (``labkit/recordings/*.json``), by name."""
    return sorted(SHIPPED_DIR.glob("*.json"))


def load_shipped() -> list[Recording]:
    """Every shipped recording, loaded and checked."""
    return [load(p) for p in shipped()]


def _text_field(obj: dict[str, Any], key: str, where: str, *, required: bool = True) -> str | None:
    value = obj.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        raise RecordingError(f"{where}: {key!r} must be a non-empty string, got {value!r}")
    return value


def _number(obj: dict[str, Any], key: str, where: str, *, optional: bool = False) -> float | None:
    value = obj.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RecordingError(f"{where}: {key}={value!r}: need a finite number")
    return value


def _figure(obj: Any, where: str) -> Figure:
    if not isinstance(obj, dict):
        raise RecordingError(f"{where}: a figure is a JSON object, got {type(obj).__name__}")
    known = {f.name for f in fields(Figure)}
    unknown = sorted(set(obj) - known)
    if unknown:
        raise RecordingError(f"{where}: unknown figure keys {unknown}; allowed: {sorted(known)}")
    text = {k: _text_field(obj, k, where)
            for k in ("name", "benchmark", "what", "unit", "preset", "dtype", "timed", "source")}  # fmt: skip
    where = f"{where} ({text['name']})"
    samples = obj.get("samples")
    if not isinstance(samples, list) or not samples:
        raise RecordingError(f"{where}: 'samples' must be a non-empty list of the timed seconds")
    for i, s in enumerate(samples):
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
            raise RecordingError(f"{where}: samples[{i}]={s!r}: need seconds, a number > 0")
    recomputed = summary(samples)
    for key, value in recomputed.items():
        stored = _number(obj, key, where)
        if not math.isclose(stored, value, rel_tol=REL_TOL):
            raise RecordingError(f"{where}: {key}={stored!r}, but its samples give {value!r}: "
                                 "a recording's numbers come from its samples; build it again "
                                 "with `python -m labkit recordings build`")  # fmt: skip
    tokens = obj.get("tokens_per_step")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0):
        raise RecordingError(f"{where}: tokens_per_step={tokens!r}: need a whole number > 0")
    stats = {k: float(recomputed[k]) for k in ("median", "q1", "q3", "min", "max")}
    return Figure(**text, n=int(recomputed["n"]), **stats,
                  samples=tuple(float(s) for s in samples), tokens_per_step=tokens,
                  flops_per_token=_number(obj, "flops_per_token", where, optional=True),
                  peak_flops_per_s=_number(obj, "peak_flops_per_s", where, optional=True),
                  peak_source=_text_field(obj, "peak_source", where, required=False))


def from_json(obj: Any, where: str = "recording", path: Path | None = None) -> Recording:
    """Validate a recording's JSON object; raise RecordingError naming ``where`` and why."""
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise RecordingError(f"{where}: not a {FORMAT} file (it needs \"format\": \"{FORMAT}\"; "
                             "a benchmark result becomes one through `python -m labkit "
                             "recordings build`)")  # fmt: skip
    if obj.get("version") != VERSION:
        raise RecordingError(f"{where}: version {obj.get('version')!r}; this labkit reads "
                             f"version {VERSION}")  # fmt: skip
    missing = [k for k in REQUIRED if not (isinstance(obj.get(k), str) and obj[k].strip())]
    if missing:
        raise RecordingError(f"{where}: lacks {', '.join(missing)}: a recording must say on which "
                             "hardware, on which date and with which torch it was measured")  # fmt: skip
    try:
        dt.date.fromisoformat(obj["date"][:10])
    except ValueError:
        raise RecordingError(f"{where}: date={obj['date']!r} is not an ISO 8601 date "
                             "(e.g. '2026-12-04')") from None  # fmt: skip
    unknown = sorted(set(obj) - set(REQUIRED) - set(OPTIONAL) - {"format", "version", "figures"})
    if unknown:
        raise RecordingError(f"{where}: unknown keys {unknown}; allowed: "
                             f"{['format', 'version', *REQUIRED, *OPTIONAL, 'figures']}")  # fmt: skip
    raw = obj.get("figures")
    if not isinstance(raw, list) or not raw:
        raise RecordingError(f"{where}: 'figures' must be a non-empty list")
    figures = tuple(_figure(f, f"{where}: figures[{i}]") for i, f in enumerate(raw))
    names = [f.name for f in figures]
    if len(set(names)) != len(names):
        raise RecordingError(f"{where}: figure names repeat: {sorted(names)}")
    count = obj.get("gpu_count")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise RecordingError(f"{where}: gpu_count={count!r}: need a whole number >= 1")
    sources = obj.get("sources") or []
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        raise RecordingError(f"{where}: 'sources' must be a list of strings")
    return Recording(hardware=obj["hardware"], date=obj["date"], torch=obj["torch"],
                     figures=figures, gpu=_text_field(obj, "gpu", where, required=False),
                     gpu_count=count, cuda=_text_field(obj, "cuda", where, required=False),
                     conditions=obj.get("conditions") or "",
                     recorded_by=obj.get("recorded_by") or "", sources=tuple(sources),
                     path=path)  # fmt: skip


def load(path: str | Path) -> Recording:
    """Read and validate a recording file (format: this module's docstring)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise RecordingError(f"{path}: cannot read the recording ({e.strerror})") from None
    except UnicodeDecodeError:
        raise RecordingError(f"{path}: not UTF-8 text; a recording is a JSON file") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise RecordingError(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None
    return from_json(obj, str(path), path)
