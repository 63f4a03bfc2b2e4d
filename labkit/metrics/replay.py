"""Recordings of real GPU runs, and their replay on machines without a GPU.

A learner on a laptop should still see what a GPU does during training, but never numbers
made up to look like a GPU. So the only GPU data shown without a GPU is a *recording* made on
real hardware by ``Recorder`` from the NVML backend, and every replayed sample (and the
backend's ``describe()``) says "recording of <hardware> on <date>".

Trace format: JSON Lines, UTF-8. The first line is the header, every later line a sample or a
step event::

    {"format": "labkit-metrics-trace", "version": 1, "metadata": {
        "hardware": "1× NVIDIA H200", "driver": "570.86.15", "cuda": "12.8",
        "torch": "2.13.0+cu128", "date": "2026-01-31T14:02:11+00:00",
        "recorded_by": "...", "period_s": 1.0, "notes": "...", "gpus": [...]}}
    {"t": 0.0, "source": "gpu0", "values": {"gpu_util_pct": 98.0, "power_w": 612.5}, "status": "ok"}
    {"t": 0.42, "rank": 0, "step": 1}

``t`` is seconds since the recording started; ``values`` use the names and units of
``labkit.metrics.base.METRICS`` and ``null`` for N/A. Lines with ``step`` are the training
loop's step events (optional), so a replay shows the same step marks as the live run did.
Sample lines are in time order, and so are each rank's step lines; the two kinds may
interleave out of order by a few milliseconds (they are written from two threads).
``hardware``, ``driver`` and ``date`` are required: a trace without them is rejected, so a
hand-made file cannot pass as a recording by accident. Recording (``labkit.monitor.Monitor``
does this for you with ``record_to=``; ``python -m labkit record-trace`` records notebook 01's
training run):

    nv = NvmlBackend()
    with Recorder("h200-train.jsonl", nv, notes="notebook 01, preset gpu") as rec, \\
         Sampler(nv, period_s=1.0, on_sample=rec.write):
        launch.run(...)

Recordings that ship with labkit live in ``labkit/metrics/traces/``; ``shipped_traces()``
lists them.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from labkit.errors import LabkitError
from labkit.metrics.base import METRICS, Backend, Clock, Sample
from labkit.validate import positive, whole

FORMAT = "labkit-metrics-trace"
VERSION = 1
REQUIRED = ("hardware", "driver", "date")  # what makes a trace a recording of real hardware
OPTIONAL = ("cuda", "torch", "recorded_by", "period_s", "notes", "gpus", "describe")
SHIPPED_DIR = Path(__file__).parent / "traces"  # recordings that ship with labkit


class ReplayError(ValueError, LabkitError):
    """A metrics recording that is not valid; the message names the file and line.

    Not :class:`labkit.profiling.TraceError`, which is about profiler traces."""


TraceError = ReplayError
"""The old name of :class:`ReplayError` (two classes were once both called ``TraceError``);
kept so that code catching ``labkit.metrics.TraceError`` still works."""


@dataclass(frozen=True)
class RecordedStep:
    """A step event in a recording: ``rank`` reached ``step`` at ``time_s``."""

    rank: int
    step: int
    time_s: float


@dataclass
class Trace:
    """A loaded recording: its metadata, samples and step events (``time_s`` = seconds since
    the recording started)."""

    metadata: dict[str, Any]
    samples: list[Sample] = field(default_factory=list)
    steps: list[RecordedStep] = field(default_factory=list)

    @property
    def label(self) -> str:
        """The words "recording of <hardware> on <date>", shown beside every replayed number."""
        date = str(self.metadata["date"])[:10]  # the day is what a reader needs
        return f"recording of {self.metadata['hardware']} on {date}"

    @property
    def duration_s(self) -> float:
        return self.samples[-1].time_s if self.samples else 0.0


def shipped_traces() -> list[Path]:
    """The recordings that ship with labkit (``labkit/metrics/traces/*.jsonl``), by name."""
    return sorted(SHIPPED_DIR.glob("*.jsonl"))


def check_metadata(meta: Any, where: str = "trace") -> dict[str, Any]:
    """Validate a trace header's metadata; raise ReplayError naming what is missing."""
    if not isinstance(meta, dict):
        raise ReplayError(f"{where}: metadata must be a JSON object, got {type(meta).__name__}")
    missing = [k for k in REQUIRED if not (isinstance(meta.get(k), str) and meta[k].strip())]
    if missing:
        raise ReplayError(f"{where}: metadata lacks {', '.join(missing)}: a trace must say on "
                         "which hardware, with which driver and on which date it was recorded "
                         "(write traces with labkit.metrics.Recorder on a real GPU)")  # fmt: skip
    try:
        dt.datetime.fromisoformat(meta["date"])
    except ValueError:
        raise ReplayError(f"{where}: metadata date={meta['date']!r} is not an ISO 8601 date "
                         "(e.g. '2026-01-31' or '2026-01-31T14:02:11+00:00')") from None  # fmt: skip
    unknown = sorted(set(meta) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise ReplayError(f"{where}: unknown metadata keys {unknown}; allowed: "
                         f"{list(REQUIRED + OPTIONAL)}")  # fmt: skip
    return meta


def _check_time(t: Any, where: str) -> float:
    if isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0:
        raise ReplayError(f"{where}: t={t!r}: need seconds since the recording started, >= 0")
    return float(t)


def _parse_step(obj: dict[str, Any], where: str) -> RecordedStep:
    if set(obj) != {"t", "rank", "step"}:
        raise ReplayError(f"{where}: a step line has exactly 't', 'rank' and 'step'")
    rank, step = obj["rank"], obj["step"]
    for name, v in (("rank", rank), ("step", step)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ReplayError(f"{where}: {name}={v!r}: need an integer >= 0")
    return RecordedStep(rank, step, _check_time(obj["t"], where))


def _parse_sample(obj: Any, where: str, label: str) -> Sample:
    if not isinstance(obj, dict) or not {"t", "source", "values"} <= set(obj):
        raise ReplayError(f"{where}: a sample needs 't', 'source' and 'values' (a step event "
                         "needs 't', 'rank' and 'step')")  # fmt: skip
    t, source, values = _check_time(obj["t"], where), obj["source"], obj["values"]
    if not isinstance(source, str) or not isinstance(values, dict):
        raise ReplayError(f"{where}: 'source' must be a string and 'values' an object")
    for name, value in values.items():
        if name not in METRICS or METRICS[name].backend != "nvml":
            raise ReplayError(f"{where}: unknown GPU metric {name!r}; known: "
                             f"{[m for m, d in METRICS.items() if d.backend == 'nvml']}")  # fmt: skip
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ReplayError(f"{where}: {name}={value!r}: need a number or null (N/A)")
    status = obj.get("status", "ok")
    return Sample(t, source, dict(values), str(status), kind="replay", label=label)


def _text(raw: bytes, path: Path) -> str:
    """``raw`` decoded as UTF-8, or a ReplayError that says what the file is instead."""
    if raw.startswith(b"\x1f\x8b"):  # gzip's magic number (RFC 1952, section 2.3.1)
        raise ReplayError(f"{path}: gzip-compressed; a trace is plain UTF-8 JSON Lines: "
                         f"decompress it first (gunzip {path})")  # fmt: skip
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ReplayError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                         f"{column}); a trace is UTF-8 JSON Lines written by "
                         "labkit.metrics.Recorder (see labkit.metrics.replay)") from None  # fmt: skip


def _json(line: str, where: str) -> Any:
    """One JSON value. Python's json reads NaN, Infinity and -Infinity, which JSON itself has
    not (RFC 8259, section 6) and a reading never is: refused, naming the line."""

    def refuse(constant: str) -> Any:
        raise ReplayError(f"{where}: {constant} is not a JSON number: a trace holds finite "
                         "numbers, and null where a reading is N/A")  # fmt: skip

    def finite(text: str) -> float:  # 1e999 is valid JSON, but float() makes it inf
        value = float(text)
        if not math.isfinite(value):
            raise ReplayError(f"{where}: {text} overflows a float: a trace holds finite "
                             "numbers, and null where a reading is N/A")  # fmt: skip
        return value

    return json.loads(line, parse_constant=refuse, parse_float=finite)


def load_trace(path: str | Path) -> Trace:
    """Read and validate a trace file (see the module docstring for the format)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ReplayError(f"{path}: cannot read the trace ({e.strerror})") from None
    lines = _text(raw, path).splitlines()
    if not lines:
        raise ReplayError(f"{path}: empty file; a trace starts with a header line")
    try:
        header = _json(lines[0], f"{path}:1")
    except json.JSONDecodeError as e:
        raise ReplayError(f"{path}:1: header is not JSON ({e.msg})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ReplayError(f"{path}:1: not a {FORMAT} file (the header needs "
                         f"\"format\": \"{FORMAT}\")")  # fmt: skip
    if header.get("version") != VERSION:
        raise ReplayError(f"{path}:1: trace version {header.get('version')!r}; this labkit "
                         f"reads version {VERSION}")  # fmt: skip
    trace = Trace(check_metadata(header.get("metadata"), f"{path}:1"))
    last = 0.0  # of the samples
    last_step: dict[int, float] = {}  # of each rank's step events
    for n, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            obj = _json(line, f"{path}:{n}")
        except json.JSONDecodeError as e:
            raise ReplayError(f"{path}:{n}: not JSON ({e.msg})") from None
        if isinstance(obj, dict) and "step" in obj:
            e = _parse_step(obj, f"{path}:{n}")
            if e.time_s < last_step.get(e.rank, 0.0):
                raise ReplayError(f"{path}:{n}: rank {e.rank}'s step at t={e.time_s} goes back in "
                                 f"time (previous {last_step[e.rank]})")  # fmt: skip
            last_step[e.rank] = e.time_s
            trace.steps.append(e)
            continue
        s = _parse_sample(obj, f"{path}:{n}", trace.label)
        if s.time_s < last:
            raise ReplayError(f"{path}:{n}: t={s.time_s} goes back in time (previous {last})")
        last = s.time_s
        trace.samples.append(s)
    return trace


class Recorder:
    """Writes NVML samples to a trace file, with the hardware, driver and date they came from.

    Use ``write`` as a Sampler's ``on_sample`` callback and ``step`` for the training loop's
    step events; both may be called from different threads. Only samples of an NVML backend
    are accepted: a recording is, by definition, of real GPU readings.

    Args:
        path: the .jsonl file to write (overwritten).
        backend: the ``NvmlBackend`` the samples come from (opened here if it is not yet).
        recorded_by: who recorded it (free text, optional).
        notes: what ran (worker, preset, batch size...), to show with the replay.
        period_s: the sampling period used, for the reader.
        t0: the time (on the samples' clock) that becomes t = 0; default: the first sample
            or step written. Anything stamped earlier is written at t = 0.
    """

    def __init__(self, path: str | Path, backend: Backend, *, recorded_by: str = "",
                 notes: str = "", period_s: float | None = None,
                 t0: float | None = None) -> None:  # fmt: skip
        if getattr(backend, "kind", None) != "nvml":
            raise ValueError(f"Recorder needs an NVML backend (real GPU readings); got a "
                             f"{getattr(backend, 'kind', type(backend).__name__)!r} backend")  # fmt: skip
        self.path, self.backend = Path(path), backend
        self.recorded_by, self.notes, self.period_s = recorded_by, notes, period_s
        self._file: IO[str] | None = None
        self._t0 = t0
        self._lock = threading.Lock()  # the sampler thread writes samples, the loop steps
        self._closed = False
        self.written = 0  # sample lines written
        self.steps_written = 0

    def metadata(self) -> dict[str, Any]:
        """The header's metadata, read from the open backend."""
        info = getattr(self.backend, "info", {}) or {}
        meta: dict[str, Any] = {
            "hardware": getattr(self.backend, "hardware", ""),
            "driver": info.get("driver") or "",
            "cuda": info.get("cuda_driver"),
            "torch": _torch_version(),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "recorded_by": self.recorded_by,
            "period_s": self.period_s,
            "notes": self.notes,
            "gpus": info.get("gpus", []),
            "describe": self.backend.describe(),
        }
        return check_metadata(meta, "Recorder")

    def open(self) -> None:
        if self._file is not None:
            return
        if self._closed:
            raise RuntimeError(f"Recorder for {self.path} is closed: use a new Recorder")
        self.backend.open()
        header = {"format": FORMAT, "version": VERSION, "metadata": self.metadata()}
        self._file = self.path.open("w", encoding="utf-8")
        self._file.write(json.dumps(header) + "\n")
        self._file.flush()

    def write(self, samples: Iterable[Sample]) -> None:
        """Append samples (one sampler tick, or any list); flushed so a crash keeps them."""
        samples = list(samples)
        for s in samples:  # check all first: a refused tick writes nothing
            if s.kind != "nvml":
                raise ValueError(f"Recorder.write: sample of kind {s.kind!r} from "
                                 f"{s.source!r}; only NVML samples are recorded")  # fmt: skip
        with self._lock:
            for s in samples:
                self._line({"t": self._rel(s.time_s), "source": s.source,
                            "values": dict(s.values), "status": s.status})  # fmt: skip
                self.written += 1
            self._flush()

    def step(self, step: int, time_s: float, *, rank: int = 0) -> None:
        """Append a step event: ``rank`` reached ``step`` at ``time_s`` (the samples' clock)."""
        step = whole("step", step, low=0, why="Recorder.step's step number")
        with self._lock:
            self._line({"t": self._rel(time_s), "rank": int(rank), "step": step})
            self.steps_written += 1
            self._flush()

    def _rel(self, time_s: float) -> float:
        if self._t0 is None:
            self._t0 = time_s
        return round(max(0.0, time_s - self._t0), 6)

    def _line(self, row: dict[str, Any]) -> None:
        if self._closed:  # reopening would overwrite the recording
            raise RuntimeError(f"Recorder for {self.path} is closed: nothing more is written")
        if self._file is None:
            self.open()
        assert self._file is not None
        self._file.write(json.dumps(row) + "\n")

    def _flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> Recorder:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _torch_version() -> str | None:
    with contextlib.suppress(ImportError):
        import torch  # lazy: recording needs it only for the metadata

        return str(torch.__version__)
    return None


class ReplayBackend(Backend):
    """Plays a recorded trace as if it were live, labelled as a recording everywhere.

    Args:
        path: a trace written by ``Recorder``.
        realtime: True: each ``sample(now)`` returns what was recorded up to the time elapsed
            since ``open()`` (times ``speed``), stamped on the live clock. False (headless,
            tests, notebooks under CI): each call returns the next recorded tick, stamped
            with its recorded time.
        speed: playback speed in real time (2.0 = twice as fast).
        clock: seconds; the live clock for realtime playback.
    """

    kind = "replay"

    def __init__(self, path: str | Path, *, realtime: bool = True, speed: float = 1.0,
                 clock: Clock = time.monotonic) -> None:  # fmt: skip
        super().__init__(clock)
        positive("speed", speed, why="1.0 = real time")
        self.path, self.realtime, self.speed = Path(path), realtime, float(speed)
        self.trace: Trace | None = None
        self._next = 0  # index of the next sample to play
        self._t_open = 0.0
        self._played_until = -1.0  # recorded time of the last sample played
        self._shift, self._scale = 0.0, 1.0  # recorded time -> the times samples are given

    def open(self) -> None:
        if self.trace is not None:
            return
        self.trace = load_trace(self.path)
        self._next, self._played_until = 0, -1.0
        self._t_open = self.clock()
        self._shift, self._scale = (self._t_open, 1.0 / self.speed) if self.realtime else (0.0, 1.0)
        self.status = {"backend": self.trace.label}

    def close(self) -> None:
        self.trace = None

    @property
    def finished(self) -> bool:
        """True once every recorded sample has been played."""
        return self.trace is not None and self._next >= len(self.trace.samples)

    def describe(self) -> str:
        if self.trace is None:
            return f"Replay of {self.path.name} (not opened)"
        meta = self.trace.metadata
        cuda = f", CUDA {meta['cuda']}" if meta.get("cuda") else ""
        return (f"Replay, {self.trace.label} (driver {meta['driver']}{cuda}): "
                f"{len(self.trace.samples)} samples over {self.trace.duration_s:.0f} s; "
                "recorded, not live")  # fmt: skip

    def sample(self, now: float | None = None) -> list[Sample]:
        if self.trace is None:
            raise RuntimeError("ReplayBackend.sample() before open(): call open() or use `with`")
        samples = self.trace.samples
        if self._next >= len(samples):
            return []
        if self.realtime:
            elapsed = (self._now(now) - self._t_open) * self.speed
            end = self._next
            while end < len(samples) and samples[end].time_s <= elapsed:
                end += 1
        else:  # the next tick: every sample recorded at the next time stamp
            t = samples[self._next].time_s
            end = self._next
            while end < len(samples) and samples[end].time_s == t:
                end += 1
        shift, scale = self._shift, self._scale
        out = [Sample(shift + s.time_s * scale, s.source, s.values, s.status, "replay", s.label)
               for s in samples[self._next:end]]  # fmt: skip
        if end > self._next:
            self._played_until = samples[end - 1].time_s
        self._next = end
        return out

    def steps(self) -> list[RecordedStep]:
        """The recording's step events up to the last sample played (all of them once the
        replay is finished), on the same clock as the samples ``sample()`` returned."""
        if self.trace is None:
            return []
        until = math.inf if self.finished else self._played_until
        return [RecordedStep(e.rank, e.step, self._shift + e.time_s * self._scale)
                for e in self.trace.steps if e.time_s <= until]  # fmt: skip
