"""Read a Chrome trace that ``torch.profiler`` exported, and refuse anything less.

    from labkit.profiling import load_trace
    t = load_trace("traces/rank0.json")
    t.rank, t.steps                       # 0, [Span('ProfilerStep#3', ...), ...]
    t.spans(cat="user_annotation")        # the record_function ranges: data, forward, ...
    t.thread_names()                      # {tid: "main thread", ...}

The format is the Trace Event Format that Perfetto (https://ui.perfetto.dev) and
``chrome://tracing`` read: a JSON object whose ``traceEvents`` list holds complete events
(``"ph": "X"``, start ``ts`` and duration ``dur`` in microseconds), instant events (``"i"``: the
profiler's ``[memory]`` records), flow events and metadata (``"M"``: process and thread names)
(Trace Event Format, https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU).
Kineto adds ``deviceProperties``, ``baseTimeNanoseconds`` and, in a distributed job,
``distributedInfo`` with the rank (pytorch/kineto, ``libkineto/src/output_json.cpp``).

Event categories this course reads (``cat``):

    user_annotation      a record_function range, and the profiler's ProfilerStep#N per step
    cpu_op               an operator run on a CPU thread (aten::mm, c10d::allreduce_, ...)
    gpu_user_annotation  a record_function range projected onto a CUDA stream
    kernel, gpu_memcpy   work on a CUDA stream (GPU traces only)
    cuda_runtime         cudaLaunchKernel and friends, on the CPU thread that called them

Traces written by the profiler of 2021 (torch 1.8–1.10, Kineto before its categories were
renamed) say ``Operator``, ``Kernel``, ``Runtime``, ``Memcpy``, ``Memset`` and ``Python``, and
mark each step as an ``Operator`` named ``ProfilerStep#N``; :func:`load_trace` renames those
categories to today's (the same mapping as the TensorBoard profiler plugin, pytorch/kineto
``tb_plugin/torch_tb_profiler/profiler/trace.py``), so every analysis reads both.

On a GPU trace each kernel, copy and memset carries ``args.correlation``, the id of the
``cudaLaunchKernel`` (``cuda_runtime``) or ``cuLaunchKernel`` (``cuda_driver``) call that queued
it: :meth:`Trace.launch_of` follows it back, so work is counted in the step that *launched* it,
not the step during which it happened to run (the CPU runs ahead of the GPU).

The profiler writes the file in one go when its active window ends, so a file that does not
parse is a trace whose writer was stopped (a rank that died mid-export) or not a trace: both
raise :class:`TraceError` naming which, never a partial trace.
"""

from __future__ import annotations

import functools
import gzip
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.errors import LabkitError

STEP = re.compile(r"^ProfilerStep#(\d+)$")

LEGACY_CATEGORIES = {
    "Operator": "cpu_op",
    "Kernel": "kernel",
    "Runtime": "cuda_runtime",
    "Memcpy": "gpu_memcpy",
    "Memset": "gpu_memset",
    "Python": "python_function",
}
"""The 2021 profiler's category names -> today's."""

GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
"""Categories of work that ran on a CUDA stream."""

LAUNCH = ("cuda_runtime", "cuda_driver")
"""Categories of the CPU-side calls that queue GPU work (they carry its correlation id)."""

COLLECTIVE = re.compile(r"^(gloo|nccl):(\w+)$")
"""A process group's range for one collective: ``gloo:all_reduce`` on CPU ranks,
``nccl:all_reduce`` on GPU ranks (``user_annotation`` on the thread that called it)."""


class TraceError(ValueError, LabkitError):
    """A trace file that cannot be used: missing, truncated, not a trace, or empty."""


@dataclass(frozen=True)
class Span:
    """One complete event: ``name`` on thread ``tid`` from ``start_us`` for ``dur_us``."""

    name: str
    cat: str
    start_us: float
    dur_us: float
    pid: int | str
    tid: int | str
    args: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclass
class Trace:
    """The events of one exported trace, with the questions every analysis asks of them."""

    path: Path
    events: list[dict[str, Any]]
    meta: dict[str, Any]
    all_spans: list[Span]
    schema: str = "current"
    """``"2021"`` when the file used the 2021 profiler's category names (renamed on loading)."""

    @property
    def rank(self) -> int | None:
        """The rank that wrote it (``distributedInfo``), None outside a process group."""
        info = self.meta.get("distributedInfo") or {}
        return info.get("rank")

    @property
    def world_size(self) -> int | None:
        """The job's number of ranks (``distributedInfo``), None when not recorded."""
        info = self.meta.get("distributedInfo") or {}
        return info.get("world_size")

    @property
    def gpu_names(self) -> list[str]:
        """The GPUs the profiler saw (``deviceProperties``), in device order."""
        return [str(d.get("name")) for d in self.meta.get("deviceProperties") or []
                if isinstance(d, dict) and d.get("name")]  # fmt: skip

    @property
    def on_gpu(self) -> bool:
        """Whether it holds work that ran on a CUDA stream (kernels or copies)."""
        return any(s.cat in GPU_WORK for s in self.all_spans)

    @functools.cached_property
    def _launches(self) -> dict[Any, Span]:
        found: dict[Any, Span] = {}
        for s in self.all_spans:
            if s.cat in LAUNCH and "correlation" in s.args:
                other = found.setdefault(s.args["correlation"], s)
                if other is not s:
                    raise TraceError(
                        f"{self.path}: correlation id {s.args['correlation']} belongs to two "
                        f"launches ({other.name} on pid {other.pid}, {s.name} on pid {s.pid}), "
                        "so its kernel cannot be placed: a file that merges two processes' "
                        "traces? Give each process's own trace"
                    )
        return found

    def launch_of(self, work: Span) -> Span | None:
        """The CPU call that queued ``work`` (a kernel, copy or memset), or None when the trace
        did not record it: it was launched before the profiler's window opened."""
        return self._launches.get(work.args.get("correlation"))

    @property
    def records_launches(self) -> bool:
        """Whether kernels can be followed back to their launch (correlation ids recorded)."""
        return bool(self._launches)

    def collective_calls(self, op: str = "all_reduce") -> list[Span]:
        """Each call of collective ``op`` made by the process group, whichever backend ran it:
        ``gloo:all_reduce`` on CPU ranks, ``nccl:all_reduce`` on GPU ranks."""
        return [s for s in self.spans(cat="user_annotation", name=COLLECTIVE)
                if COLLECTIVE.match(s.name).group(2) == op]  # fmt: skip

    def per_step(self, spans: Iterable[Span]) -> float:
        """How many of ``spans`` start inside the recorded steps, per step."""
        lo, hi = self.window_us
        return sum(1 for s in spans if lo <= s.start_us < hi) / len(self.steps)

    def spans(self, *, cat: str | Iterable[str] | None = None, name: str | re.Pattern | None = None,
              tid: int | str | None = None) -> list[Span]:
        """Complete events filtered by category, exact name or name pattern, and thread."""
        cats = {cat} if isinstance(cat, str) else set(cat) if cat is not None else None
        out = []
        for s in self.all_spans:
            if cats is not None and s.cat not in cats:
                continue
            if tid is not None and s.tid != tid:
                continue
            if isinstance(name, str) and s.name != name:
                continue
            if isinstance(name, re.Pattern) and not name.search(s.name):
                continue
            out.append(s)
        return out

    @functools.cached_property
    def steps(self) -> list[Span]:
        """The profiler's ``ProfilerStep#N`` ranges, one per recorded step, in time order.

        Today's profiler writes them as ``user_annotation``; the 2021 one as an operator."""
        found: dict[str, Span] = {}
        for s in self.spans(cat=("user_annotation", "cpu_op"), name=STEP):
            other = found.setdefault(s.name, s)
            if (other.start_us, other.dur_us) != (s.start_us, s.dur_us):
                raise TraceError(
                    f"{self.path}: two {s.name} ranges, at {other.start_us:.0f} and "
                    f"{s.start_us:.0f} µs: a file that merges two profiler sessions or two "
                    "processes? Give each one's own trace"
                )
        return sorted(found.values(), key=lambda s: s.start_us)

    @property
    def main_tid(self) -> int | str:
        """The thread that ran the training loop: the one carrying the ProfilerStep ranges."""
        steps = self.steps
        if steps:
            return steps[0].tid
        ops = self.spans(cat="cpu_op")
        if not ops:
            raise TraceError(f"{self.path}: no CPU operators recorded, so no main thread")
        return _busiest(ops)

    @property
    def window_us(self) -> tuple[float, float]:
        """From the start of the first recorded step to the end of the last."""
        steps = self.steps
        if not steps:
            raise TraceError(
                f"{self.path}: no ProfilerStep ranges, so no steps to measure per step. The "
                "profiler marks a step each time the loop calls prof.step() inside a "
                "schedule's active window: this trace was recorded without a schedule, or "
                "the loop never called prof.step(), or the window never opened (active=0, or "
                "fewer steps than wait + warmup). To measure the whole recording as one "
                "step: rank_times(trace, whole_trace=True)"
            )
        return steps[0].start_us, max(s.end_us for s in steps)

    def as_one_step(self) -> Trace:
        """This trace with its whole recording marked as one step (``ProfilerStep#0``), for a
        trace recorded without a schedule: per-step figures are then the whole recording's."""
        host = [s for s in self.all_spans
                if s.cat not in (*GPU_WORK, "gpu_user_annotation", "Trace")]  # fmt: skip
        if not host:
            raise TraceError(f"{self.path}: no CPU events, so no span to measure as a step")
        lo, hi = min(s.start_us for s in host), max(s.end_us for s in host)
        step = Span("ProfilerStep#0", "user_annotation", lo, hi - lo, host[0].pid, _busiest(host))
        spans = sorted([*self.all_spans, step], key=lambda s: (s.start_us, -s.dur_us))
        return Trace(self.path, self.events, self.meta, spans, self.schema)

    def phase_seconds(self, names: Iterable[str]) -> dict[str, list[float]]:
        """Seconds in each named range (on the training thread), per recorded step.

        A step without the range gets 0; a range opened twice in a step counts twice."""
        names = list(names)
        steps = self.steps
        out: dict[str, list[float]] = {n: [0.0] * len(steps) for n in names}
        main = self.main_tid
        for s in self.spans(cat="user_annotation", tid=main):
            if s.name not in out:
                continue
            for k, step in enumerate(steps):
                if step.start_us <= s.start_us < step.end_us:
                    out[s.name][k] += s.dur_us / 1e6
                    break
        return out

    def thread_names(self) -> dict[int | str, str]:
        """A readable label per thread: the training loop, communication threads, streams."""
        named: dict[int | str, str] = {}
        for e in self.events:
            if e.get("ph") == "M" and e.get("name") == "thread_name":
                named[e.get("tid")] = str((e.get("args") or {}).get("name", e.get("tid")))
        main = self.main_tid if self.all_spans else None
        labels: dict[int | str, str] = {}
        workers: dict[str, int] = {}
        for s in self.all_spans:
            if s.tid in labels or s.cat == "Trace":
                continue
            if s.tid == main:
                labels[s.tid] = "training loop (main thread)"
            elif s.cat in ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"):
                labels[s.tid] = f"CUDA stream {s.args.get('stream', s.tid)}"
            elif match := COLLECTIVE.match(s.name):
                lib = match.group(1)
                workers[lib] = workers.get(lib, 0) + 1
                labels[s.tid] = f"{lib} worker thread {workers[lib]} (collectives)"
            elif s.name.startswith("autograd::engine"):
                labels[s.tid] = f"autograd thread {s.tid}"
            else:
                labels[s.tid] = named.get(s.tid) or f"thread {s.tid}"
        return labels


def _busiest(spans: Iterable[Span]) -> int | str:
    """The thread with the most time in ``spans``: the training loop, where steps are unmarked."""
    busy: dict[int | str, float] = {}
    for s in spans:
        busy[s.tid] = busy.get(s.tid, 0.0) + s.dur_us
    return max(busy, key=busy.__getitem__)


def _read_text(path: Path) -> str:
    if not path.exists():
        raise TraceError(
            f"{path}: no such file. The profiler writes its trace when the active window "
            "ends (on_trace_ready); check the path, and that the job reached that step"
        )
    if path.is_dir():
        raise TraceError(f"{path} is a folder: give one trace file (a .json or .json.gz), or "
                         "load a job's folder with load_traces(folder)")  # fmt: skip
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise TraceError(f"{path}: truncated gzip ({e}); the writer was stopped mid-file") from e
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceError(f"{path} is not a trace: not UTF-8 text ({e})") from e


def load_trace(path: str | Path) -> Trace:
    """Load one Chrome trace written by ``torch.profiler`` (``.json`` or ``.json.gz``).

    Times are read as float64 microseconds. A trace with nanosecond digits and Unix-epoch
    timestamps (about 1.7e15 µs) is resolved to 0.25 µs that way, so a sum over thousands of
    kernels can differ from an exact reading by about 1e-4 of itself (4e-5 measured on a real
    one against HTA's reading).

    Raises:
        TraceError: the file is missing, truncated (it stops before its JSON closes: the
            writer was killed), not a trace (valid JSON without ``traceEvents``), or holds
            no complete events. The message names which, and what usually causes it.
    """
    path = Path(path)
    text = _read_text(path)
    if not text.strip():
        raise TraceError(f"{path} is empty: the process was stopped before it wrote its trace")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        # Cut mid-file, the decoder fails at the end, or at the start of the string or the
        # literal (true/false/null) that the cut left open.
        end = len(text.rstrip())
        cut = (e.pos >= end - 1 or e.msg.startswith("Unterminated string")
               or any(word.startswith(text[e.pos:end]) for word in ("true", "false", "null")))
        if text.lstrip().startswith(("{", "[")) and cut:
            raise TraceError(
                f"{path} is truncated: its JSON stops at byte {len(text)} before it closes. "
                "A rank that died (or was killed) while exporting leaves this; rerun the job"
            ) from e
        raise TraceError(f"{path} is not a trace: not JSON ({e.msg} at byte {e.pos})") from e
    if isinstance(data, list):  # the Trace Event Format also allows a bare array of events
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        keys = sorted(data)[:6] if isinstance(data, dict) else type(data).__name__
        raise TraceError(
            f"{path} is not a trace: a Chrome trace is a JSON object with a 'traceEvents' "
            f"list (this one has {keys}). Export one with prof.export_chrome_trace(path)"
        )
    events = data["traceEvents"]
    spans, legacy = [], False
    for e in events:
        if not (isinstance(e, dict) and e.get("ph") == "X" and "ts" in e and "dur" in e):
            continue
        cat = str(e.get("cat", ""))
        if cat in LEGACY_CATEGORIES:
            cat, legacy = LEGACY_CATEGORIES[cat], True
        try:
            start_us, dur_us = float(e["ts"]), float(e["dur"])
        except (TypeError, ValueError) as err:
            raise TraceError(f"{path} is not a trace: an event's ts/dur is not a number "
                             f"({e.get('name', '?')!r}: {err})") from err  # fmt: skip
        if not (math.isfinite(start_us) and math.isfinite(dur_us)) or dur_us < 0:
            raise TraceError(f"{path} is not a usable trace: event {e.get('name', '?')!r} has "
                             f"ts={e['ts']!r}, dur={e['dur']!r} (a time must be a finite "
                             "number, a duration >= 0)")  # fmt: skip
        spans.append(Span(str(e.get("name", "")), cat, start_us, dur_us, e.get("pid", 0),
                          e.get("tid", 0), e.get("args") or {}))  # fmt: skip
    if spans and not any(s.cat for s in spans):
        raise TraceError(f"{path} is not a torch.profiler trace: none of its events has a "
                         "category ('cat'), which the profiler gives every event")  # fmt: skip
    if not any(s.cat != "Trace" for s in spans):
        raise TraceError(
            f"{path} holds no recorded operators: the profiler was stopped before any step "
            "ran inside its active window"
        )
    meta = {k: v for k, v in data.items() if k != "traceEvents"}
    return Trace(path, events, meta, sorted(spans, key=lambda s: (s.start_us, -s.dur_us)),
                 schema="2021" if legacy else "current")  # fmt: skip


TRACE_FILES = ("*.json", "*.json.gz")
"""What counts as a trace file in a folder of them (``*.pt.trace.json`` included)."""


def trace_files(folder: str | Path) -> list[Path]:
    """The trace files in ``folder``, sorted by name; refused when there are none."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TraceError(f"{folder}: no such folder; give the folder of one job's traces")
    files = sorted({f for pattern in TRACE_FILES for f in folder.glob(pattern) if f.is_file()})
    if not files:
        raise TraceError(
            f"{folder} holds no trace files (looked for {', '.join(TRACE_FILES)}): the "
            "profiler writes one per rank when its active window ends"
        )
    return files


def load_traces(paths: str | Path | Iterable[str | Path], *,
                ranks: int | None = None) -> list[Trace]:
    """Load one trace per rank, in rank order; every one must load (no partial set).

    ``paths`` is a list of files or one folder holding a job's traces. With ``ranks``, the
    set must hold exactly that many ranks' traces.

    Raises:
        TraceError: a file does not load (see :func:`load_trace`), two files come from one
            rank or from jobs of different sizes, or the count is not ``ranks``.
    """
    if isinstance(paths, (str, Path)):
        paths = trace_files(paths) if Path(paths).is_dir() else [paths]
    traces = [load_trace(p) for p in paths]
    if not traces:
        raise TraceError("no trace files given: a distributed job writes one per rank")
    found = [t.rank for t in traces]
    if None in found and len(traces) > 1 and any(r is not None for r in found):
        unnamed = [str(t.path) for t in traces if t.rank is None]
        raise TraceError(f"some traces name their rank and {unnamed} do not: traces of one "
                         "job all carry distributedInfo; give one job's traces")  # fmt: skip
    if None not in found:
        if len(set(found)) != len(found):
            same = sorted({r for r in found if found.count(r) > 1})
            files = [str(t.path) for t in traces if t.rank in same]
            raise TraceError(f"two traces come from the same rank ({same}): {files}")
        traces.sort(key=lambda t: t.rank)
    sizes = {t.world_size for t in traces} - {None}
    if len(sizes) > 1:
        by_size = {t.path.name: t.world_size for t in traces}
        raise TraceError(f"these traces come from jobs of different sizes ({by_size}): give "
                         "the traces of one job")  # fmt: skip
    if ranks is not None and len(traces) != ranks:
        raise TraceError(
            f"asked for {ranks} ranks' traces; got {len(traces)} (ranks "
            f"{[t.rank for t in traces]}, from {sorted({str(t.path.parent) for t in traces})})"
        )
    return traces
