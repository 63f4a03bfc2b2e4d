"""Memory over time during real training steps: what rises in the forward, falls in the backward.

    from labkit.profiling import phase
    from labkit.profiling.memory_timeline import record_memory_timeline, plot_memory_timeline

    def step():
        with phase("forward"):
            loss = model(x, y)[1]
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            opt.step(); opt.zero_grad(set_to_none=True)

    tl = record_memory_timeline(step, steps=2, device="cpu", model=model, optimizer=opt)
    plot_memory_timeline(tl)      # stacked categories, phases shaded, y in MiB
    tl.rise("forward")            # bytes at the forward's end minus at its start

Where the numbers come from (each named in the result's ``method``, ``kind`` and notes):

* **Total, CPU** (*measured*, host memory): the PyTorch profiler with ``profile_memory=True``
  reports every CPU-allocator allocation and free as a ``[memory]`` instant event in the Chrome
  trace, with the allocator's running ``"Total Allocated"``. On the CPU that counter starts at
  zero when the profiler starts (*seen*, torch 2.13): blocks allocated before (the parameters,
  the optimizer state) are invisible, and their frees are dropped with the warning "Memory block
  of unknown size was allocated before the profiling started". So the total here is that counter
  plus a **counted** baseline: the storage bytes of the parameters, gradients and optimizer
  state alive when recording starts (when you pass ``model``/``optimizer``; else 0, and the
  result says so).
* **Total, CUDA** (*measured*, device memory): ``torch.cuda.memory._record_memory_history``
  records every alloc/free of the CUDA caching allocator; ``torch.cuda.memory._snapshot()``
  returns them as ``device_traces`` (action, addr, size, time_us) beside the blocks live at
  the snapshot. The level before the first event is worked back from those live blocks, the
  way https://pytorch.org/memory_viz does. The snapshot is also saved as a pickle to drop into
  that viewer (https://pytorch.org/docs/stable/torch_cuda_memory.html).
* **Categories** (*measured*, both devices): torch's own memory profiler
  (``torch.profiler._memory_profiler``, behind ``profile.export_memory_timeline``) follows each
  tensor through the recorded ops and labels its bytes parameter, optimizer state, input,
  temporary, activation, gradient or autograd detail. Tensors alive before profiling started
  are sized from their recorded shapes. It works on the CPU in torch 2.13 (*seen*; on CUDA it
  is asked for ``device="cuda:0"``, which torch documents as its default). torch marks
  ``export_memory_timeline`` deprecated in favour of the CUDA snapshot, so when it fails or is
  gone the timeline carries no categories and ``categories_note`` says why.

Phases come from the ``record_function`` ranges named "data", "forward", "backward",
"optimizer" (and "communication") that the caller's step opens (:func:`labkit.profiling.phase`
opens them), read from the same Chrome trace, so they share the clock of the memory events.
"""

from __future__ import annotations

import bisect
import dataclasses
import html
import inspect
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from labkit.memory import optimizer_state_tensors, storage_bytes
from labkit.profiling.capture import activities
from labkit.profiling.phases import COMMUNICATION, PHASES

HOST_KIND = "host memory (CPU allocator, measured by torch.profiler)"
DEVICE_KIND = "device memory (CUDA caching allocator)"

# The Chrome trace's "Device Type" in [memory] events is c10::DeviceType: 0 CPU, 1 CUDA.
_DEVICE_TYPE = {"cpu": 0, "cuda": 1}

# torch.profiler._memory_profiler.Category, in the order export_memory_timeline writes its
# columns (_CATEGORY_TO_INDEX), None last as "unknown". Read from torch when it is there.
_TORCH_CATEGORY_ORDER = ("parameter", "optimizer_state", "input", "temporary", "activation",
                         "gradient", "autograd_detail", "unknown")
# Stacked bottom to top: what lives all step long first, what comes and goes on top.
CATEGORY_ORDER: tuple[str, ...] = ("parameter", "optimizer_state", "gradient", "activation",
                                   "autograd_detail", "input", "temporary", "unknown")
# torch's own palette for the same categories (_CATEGORY_TO_COLORS), so a learner who opens
# export_memory_timeline's HTML sees the same colours; but input is brown here, not black, so
# that the measured total's black line stays visible over it.
CATEGORY_COLORS: dict[str, str] = {
    "parameter": "darkgreen", "optimizer_state": "goldenrod", "input": "peru",
    "temporary": "mediumpurple", "activation": "red", "gradient": "mediumblue",
    "autograd_detail": "royalblue", "unknown": "grey",
}  # fmt: skip
PHASE_COLORS: dict[str, str] = {"data": "tab:gray", "forward": "tab:orange",
                                "backward": "tab:blue", "optimizer": "tab:green",
                                COMMUNICATION: "tab:purple"}

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class PhaseSpan:
    """One ``record_function`` range of the step, in seconds since the recording started."""

    name: str
    start_s: float
    end_s: float
    index: int
    """Which occurrence of this name (0 for the first step's, 1 for the second's...)."""


@dataclasses.dataclass(frozen=True)
class CategorySeries:
    """Bytes per category over time, from torch's memory profiler (measured).

    ``bytes[c][i]`` is the live bytes of category ``c`` from ``times_s[i]`` until the next time.
    """

    times_s: tuple[float, ...]
    bytes: dict[str, tuple[int, ...]]
    method: str

    def at(self, category: str, t_s: float) -> int:
        if category not in self.bytes:
            raise KeyError(f"category {category!r} not recorded; these were: {sorted(self.bytes)}")
        return self.bytes[category][_index_at(self.times_s, t_s)]

    def total_at(self, t_s: float) -> int:
        i = _index_at(self.times_s, t_s)
        return sum(v[i] for v in self.bytes.values())


@dataclasses.dataclass(frozen=True)
class MemoryTimeline:
    """Allocated bytes over a few training steps, with the step's phases and, where torch
    can tell, the bytes of each category. Every series is measured; ``baseline_bytes`` is
    counted (see ``baseline_method``)."""

    times_s: tuple[float, ...]
    """Seconds since the recording started; the series is a step function (value holds until
    the next time)."""
    total_bytes: tuple[int, ...]
    phases: tuple[PhaseSpan, ...]
    kind: str
    """``HOST_KIND`` (CPU) or ``DEVICE_KIND`` (CUDA): which memory these bytes are."""
    method: str
    device: str
    baseline_bytes: int = 0
    baseline_method: str = ""
    categories: CategorySeries | None = None
    categories_note: str = ""
    """Why ``categories`` is None, when it is."""
    snapshot_path: str | None = None
    """The pickled CUDA snapshot, for https://pytorch.org/memory_viz (CUDA only)."""
    notes: tuple[str, ...] = dataclasses.field(default=())
    averages: Any = dataclasses.field(default=None, compare=False, repr=False)
    """The recording's ``key_averages()`` (``profile_memory=True``: its memory columns), over
    ``recorded_steps`` steps; None where the timeline was built from saved events."""
    recorded_steps: int = 0

    def __post_init__(self) -> None:
        if len(self.times_s) != len(self.total_bytes) or not self.times_s:
            raise ValueError(f"times_s ({len(self.times_s)}) and total_bytes "
                             f"({len(self.total_bytes)}) must be equally long and not empty")

    @property
    def is_host(self) -> bool:
        return self.kind == HOST_KIND

    @property
    def peak_bytes(self) -> int:
        return max(self.total_bytes)

    @property
    def peak_time_s(self) -> float:
        return self.times_s[self.total_bytes.index(self.peak_bytes)]

    def at(self, t_s: float) -> int:
        """Total bytes allocated at ``t_s`` (after every event up to and including ``t_s``)."""
        return self.total_bytes[_index_at(self.times_s, t_s)]

    def phase(self, name: str, index: int = 0) -> PhaseSpan:
        """The ``index``-th span called ``name`` (0: the first recorded step's)."""
        for span in self.phases:
            if span.name == name and span.index == index:
                return span
        have = sorted({(s.name, s.index) for s in self.phases})
        raise KeyError(f"no phase {name!r} #{index} in this timeline; recorded: {have}. Mark "
                       f"it in the step with labkit.profiling.phase({name!r}) or "
                       f"torch.profiler.record_function({name!r})")

    def rise(self, name: str, index: int = 0) -> int:
        """Bytes at the end of phase ``name`` minus at its start (negative: it fell)."""
        span = self.phase(name, index)
        return self.at(span.end_s) - self.at(span.start_s)

    def summary(self) -> str:
        lines = [f"{self.kind} on {self.device}: peak {self.peak_bytes / MiB:,.2f} MiB at "
                 f"{self.peak_time_s * 1e3:,.2f} ms (measured: {self.method})"]
        if self.baseline_method:
            lines.append(f"baseline {self.baseline_bytes / MiB:,.2f} MiB ({self.baseline_method})")
        for span in self.phases:
            if span.index == 0:
                lines.append(f"  {span.name:<13} {self.rise(span.name) / MiB:+,.3f} MiB "
                             f"over {(span.end_s - span.start_s) * 1e3:,.2f} ms")
        if self.categories is None:
            lines.append(f"no categories: {self.categories_note}")
        lines.extend(self.notes)
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return "<pre>" + html.escape(self.summary()) + "</pre>"


@dataclasses.dataclass(frozen=True)
class ForwardRise:
    """How much memory the forward pass added, beside what a model or count expected."""

    measured_bytes: int
    """Total at the end of the forward minus at its start (measured by the allocator)."""
    activation_bytes: int | None
    """The profiler's "activation" category over the same span (measured), if categorised."""
    expected_bytes: int | None = None
    expected_label: str = ""
    """Where ``expected_bytes`` comes from, e.g. "modelled: formulas.activation_bytes" or
    "counted: memory.measure_training_memory (tensors saved for backward)"."""

    @property
    def ratio(self) -> float | None:
        """measured / expected; the forward also keeps its output and the loss, and frees
        temporaries, so expect a little above 1 rather than exactly 1."""
        if not self.expected_bytes:
            return None
        return self.measured_bytes / self.expected_bytes


def forward_rise(tl: MemoryTimeline, *, index: int = 0, expected_bytes: int | None = None,
                 expected_label: str = "") -> ForwardRise:
    """The forward's rise in ``tl`` (measured), beside ``expected_bytes`` (label it)."""
    if expected_bytes is not None and not expected_label:
        raise ValueError("say where expected_bytes comes from: expected_label='modelled: ...' "
                         "or 'counted: ...'")
    span = tl.phase("forward", index)
    act = None
    if tl.categories is not None and "activation" in tl.categories.bytes:
        act = (tl.categories.at("activation", span.end_s)
               - tl.categories.at("activation", span.start_s))
    return ForwardRise(tl.rise("forward", index), act, expected_bytes, expected_label)


# --- parsing ------------------------------------------------------------------------------


def _index_at(times: Sequence[float], t: float) -> int:
    """Index of the last sample at or before ``t`` (the first sample if ``t`` is earlier)."""
    return max(bisect.bisect_right(times, t) - 1, 0)


def _trace_events(trace: Any) -> list[dict[str, Any]]:
    if isinstance(trace, Mapping):
        if "traceEvents" not in trace:
            raise ValueError("this dict is not a Chrome trace (no 'traceEvents'); pass "
                             "json.load(f)['traceEvents'] of a file written by "
                             "prof.export_chrome_trace(path)")
        trace = trace["traceEvents"]
    if isinstance(trace, (str, bytes)) or not isinstance(trace, Iterable):
        raise TypeError(f"trace events must be a list of dicts, got {type(trace).__name__}; "
                        "pass json.load(f)['traceEvents']")
    events = list(trace)
    if not events:
        raise ValueError("no trace events: the trace is empty. Record a step inside "
                         "torch.profiler.profile(..., profile_memory=True) and export it with "
                         "prof.export_chrome_trace(path)")
    for i, e in enumerate(events):
        if not isinstance(e, Mapping):
            raise TypeError(f"trace event #{i} is a {type(e).__name__}, not a dict; pass "
                            "json.load(f)['traceEvents']")
    return events


def _device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type not in _DEVICE_TYPE:
        raise ValueError(f"device={device!r}: this timeline knows 'cpu' and 'cuda' memory")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return dev


def _phase_spans_us(events: list[dict[str, Any]],
                    names: Iterable[str]) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of the ``user_annotation`` spans called one of ``names``."""
    wanted = set(names)
    raw = []
    for i, e in enumerate(events):
        if e.get("cat") == "user_annotation" and e.get("ph") == "X" and e.get("name") in wanted:
            try:
                raw.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]))
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"trace event #{i} ({e.get('name')!r}) lacks a numeric ts/dur "
                                 f"({err!r}); is this a Chrome trace from torch.profiler?") from None
    return sorted(raw)


def _spans(raw: list[tuple[float, float, str]], t0_us: float) -> tuple[PhaseSpan, ...]:
    seen: dict[str, int] = {}
    spans = []
    for start, end, name in raw:
        spans.append(PhaseSpan(name, (start - t0_us) / 1e6, (end - t0_us) / 1e6, seen.get(name, 0)))
        seen[name] = seen.get(name, 0) + 1
    return tuple(spans)


def phases_from_trace_events(trace: Any, *, names: Iterable[str] = (*PHASES, COMMUNICATION),
                             t0_us: float | None = None) -> tuple[PhaseSpan, ...]:
    """The ``user_annotation`` spans called one of ``names``, in seconds since ``t0_us``
    (default: the first span's start), in order of start."""
    raw = _phase_spans_us(_trace_events(trace), names)
    if t0_us is None:
        t0_us = raw[0][0] if raw else 0.0
    return _spans(raw, t0_us)


def _memory_events(events: list[dict[str, Any]],
                   dev: torch.device) -> list[tuple[float, int, int]]:
    """(ts µs, Total Allocated, Bytes) of the [memory] events of ``dev``, in time order."""
    want_type = _DEVICE_TYPE[dev.type]
    out: list[tuple[float, int, int]] = []
    seen_types: set[tuple[Any, Any]] = set()
    for i, e in enumerate(events):
        if e.get("name") != "[memory]" or e.get("ph") != "i":
            continue
        args = e.get("args")
        if not isinstance(args, Mapping):
            raise ValueError(f"[memory] event #{i} has no args dict; is this a Chrome trace "
                             "from torch.profiler with profile_memory=True?")
        missing = [k for k in ("Total Allocated", "Device Type") if k not in args]
        if missing or "ts" not in e:
            raise ValueError(f"[memory] event #{i} lacks {missing or ['ts']}; expected the "
                             "fields torch.profiler writes (ts, args: Bytes, Total Allocated, "
                             "Device Type, Device Id, Addr)")
        seen_types.add((args["Device Type"], args.get("Device Id")))
        if args["Device Type"] != want_type:
            continue
        if dev.type == "cuda" and args.get("Device Id", dev.index) != dev.index:
            continue
        out.append((float(e["ts"]), int(args["Total Allocated"]), int(args.get("Bytes", 0))))
    if not out:
        where = (f"memory events were seen for (Device Type, Device Id) {sorted(seen_types)} "
                 "(0 = CPU, 1 = CUDA)" if seen_types else
                 "the trace has no [memory] events at all")
        raise ValueError(f"no [memory] events for {dev}: {where}. Profile with "
                         "torch.profiler.profile(..., profile_memory=True) and run the steps "
                         f"on {dev}")
    out.sort(key=lambda p: p[0])  # events of several threads come interleaved
    return out


def timeline_from_trace_events(
    trace: Any,
    *,
    device: str | torch.device = "cpu",
    baseline_bytes: int = 0,
    baseline_method: str = "",
    phase_names: Iterable[str] = (*PHASES, COMMUNICATION),
) -> MemoryTimeline:
    """The uncategorised timeline of a Chrome trace's ``[memory]`` events (measured).

    ``trace`` is ``json.load(f)["traceEvents"]`` (or the whole loaded dict) of a trace that
    ``torch.profiler.profile(profile_memory=True)`` exported. Its ``[memory]`` instant events
    carry the allocator's running "Total Allocated". On the CPU that count starts at 0 when the
    profiler starts (*seen*), so add ``baseline_bytes`` for what was alive before (say the
    counted bytes of parameters and optimizer state) and say how in ``baseline_method``. On
    CUDA it is the caching allocator's absolute allocated bytes: leave the baseline at 0.
    """
    events = _trace_events(trace)
    return _from_trace(events, _device(device), baseline_bytes, baseline_method, phase_names)[0]


def _from_trace(events: list[dict[str, Any]], dev: torch.device, baseline_bytes: int,
                baseline_method: str, phase_names: Iterable[str]) -> tuple[MemoryTimeline, float]:
    """The timeline, and the trace time (µs) its t = 0 stands for."""
    if baseline_bytes < 0:
        raise ValueError(f"baseline_bytes={baseline_bytes}: give bytes alive before profiling (>= 0)")
    if baseline_bytes and not baseline_method:
        raise ValueError("say how baseline_bytes was obtained, e.g. baseline_method='counted: "
                         "storage bytes of parameters and optimizer state at start'")
    raw = _phase_spans_us(events, phase_names)
    mem = _memory_events(events, dev)
    t0 = min([mem[0][0]] + [start for start, _, _ in raw])
    is_cpu = dev.type == "cpu"
    # A first point at t = 0 holds the level before the first event: the baseline on the CPU
    # (the counter starts at 0 there); on CUDA the first event's total minus its own bytes.
    start_level = baseline_bytes if is_cpu else mem[0][1] - mem[0][2]
    times = [0.0] + [(ts - t0) / 1e6 for ts, _, _ in mem]
    totals = [start_level] + [baseline_bytes + total for _, total, _ in mem]
    method = ("torch.profiler profile_memory=True: [memory] events' Total Allocated, " +
              ("counted from 0 when the profiler started" if is_cpu else
               "the CUDA caching allocator's allocated bytes"))
    tl = MemoryTimeline(
        times_s=tuple(times), total_bytes=tuple(totals), phases=_spans(raw, t0),
        kind=HOST_KIND if is_cpu else DEVICE_KIND, method=method, device=str(dev),
        baseline_bytes=baseline_bytes,
        baseline_method=baseline_method or ("none: blocks allocated before the profiler "
                                            "started are not in this total" if is_cpu else ""),
        categories_note="not categorised: built from [memory] events alone",
    )
    return tl, t0


def timeline_from_snapshot(
    snapshot: Mapping[str, Any],
    *,
    device_index: int = 0,
    phases: tuple[PhaseSpan, ...] = (),
    t0_us: float | None = None,
) -> MemoryTimeline:
    """Total allocated bytes over time from a CUDA memory snapshot (measured).

    ``snapshot`` is ``torch.cuda.memory._snapshot()`` (or a loaded ``_dump_snapshot`` pickle)
    taken with ``_record_memory_history`` on. Its ``device_traces[device_index]`` lists the
    caching allocator's actions; "alloc" adds ``size`` bytes, "free_completed" removes them
    (https://pytorch.org/docs/stable/torch_cuda_memory.html; the TraceEntry format is in the
    docstring of ``torch.cuda.memory._snapshot``). Sizes are the requested bytes, before the
    allocator rounds them up. The history is a ring buffer of ``max_entries``: so the level
    is worked back from the blocks live at the snapshot (its ``segments``), which is right for
    whatever window the buffer kept. Times are ``time_us`` relative to ``t0_us`` (default: the
    first event); ``phases`` must already be on that clock.
    """
    if not isinstance(snapshot, Mapping) or "device_traces" not in snapshot:
        raise ValueError("not a CUDA memory snapshot (no 'device_traces'): pass "
                         "torch.cuda.memory._snapshot() taken while _record_memory_history "
                         "was on, or pickle.load of a _dump_snapshot file")
    traces = snapshot["device_traces"]
    if device_index >= len(traces):
        raise ValueError(f"device_index={device_index}, but the snapshot has traces for "
                         f"{len(traces)} device(s)")
    entries = [e for e in traces[device_index] if e.get("action") in ("alloc", "free_completed")]
    if not entries:
        raise ValueError(f"the snapshot has no alloc/free events on cuda:{device_index}: turn on "
                         "torch.cuda.memory._record_memory_history() before the steps and take "
                         "the snapshot before turning it off")
    for i, e in enumerate(entries):
        if "time_us" not in e or "size" not in e:
            raise ValueError(f"trace entry #{i} ({e.get('action')}) lacks time_us/size; this "
                             "torch's snapshot format is not one this function knows")
    entries.sort(key=lambda e: e["time_us"])  # stable: same-µs actions keep their order
    live_end = sum(
        b.get("requested_size", b["size"])
        for seg in snapshot.get("segments", ())
        if seg.get("device", device_index) == device_index
        for b in seg.get("blocks", ())
        if b.get("state") not in (None, "inactive")
    )
    sizes: dict[int, int] = {}
    deltas = []
    for e in entries:
        if e["action"] == "alloc":
            sizes[e["addr"]] = e["size"]
            deltas.append(int(e["size"]))
        else:  # a free: take the size its alloc had, when the alloc is in the window
            deltas.append(-int(sizes.pop(e["addr"], e["size"])))
    start = live_end - sum(deltas)
    t0 = float(entries[0]["time_us"]) if t0_us is None else t0_us
    times, totals, level = [(float(entries[0]["time_us"]) - t0) / 1e6], [start], start
    for e, d in zip(entries, deltas, strict=True):
        level += d
        times.append((float(e["time_us"]) - t0) / 1e6)
        totals.append(level)
    notes = ()
    if start < 0:
        notes = ("the start level came out negative: the snapshot's live blocks and its "
                 "history disagree (was the snapshot taken after recording stopped?)",)
    return MemoryTimeline(
        times_s=tuple(times), total_bytes=tuple(totals), phases=phases, kind=DEVICE_KIND,
        method="torch.cuda.memory._record_memory_history + _snapshot(): alloc/free_completed "
               "of the caching allocator (requested bytes); the start level worked back from "
               "the blocks live at the snapshot",
        device=f"cuda:{device_index}", notes=notes, baseline_bytes=max(start, 0),
        baseline_method="measured: bytes of the blocks live at the snapshot, less the recorded "
                        "history (what was allocated before recording began)",
        categories_note="not categorised: a snapshot holds no categories",
    )


# --- recording ----------------------------------------------------------------------------


def _categories(prof: Any, dev: torch.device, base_us: float | None, t0_us: float,
                first_memory_us: float, path: str) -> tuple[CategorySeries | None, str]:
    """torch's categorised memory timeline for ``dev``, on the Chrome trace's clock."""
    try:
        from torch.profiler import _memory_profiler as mp

        order = tuple("unknown" if c is None else c.name.lower() for c in mp._CATEGORY_TO_INDEX)
        with warnings.catch_warnings():
            # deprecated in favour of the CUDA snapshot, which has no CPU counterpart
            warnings.simplefilter("ignore", FutureWarning)
            prof.export_memory_timeline(path, device=str(dev))
        with open(path) as f:
            times_us, sizes = json.load(f)
    except Exception as err:  # private machinery: any failure means "no categories", said why
        return None, (f"torch.profiler's categorised memory timeline failed on {dev} "
                      f"({type(err).__name__}: {err}); the total is still measured")
    if not times_us:
        return None, f"torch.profiler's memory timeline had no events on {dev}"
    width = len(sizes[0])
    if width == len(order) + 1:  # export_memory_timeline writes a leading 0 column
        sizes = [row[1:] for row in sizes]
    elif width != len(order):
        return None, (f"torch.profiler's memory timeline has {width} columns, expected "
                      f"{len(order)} categories: a format this labkit does not know")
    # Its times are µs of the same clock as the trace's, offset by baseTimeNanoseconds
    # (*seen*: they equal the [memory] events' ts + baseTimeNanoseconds/1000). Without that
    # field, its first time is the device's first allocation, the first [memory] event.
    if base_us is None:
        base_us = times_us[0] - first_memory_us
    times_s = tuple((t - base_us - t0_us) / 1e6 for t in times_us)
    by_cat = {c: tuple(int(row[j]) for row in sizes) for j, c in enumerate(order)}
    by_cat = {c: by_cat[c] for c in CATEGORY_ORDER if c in by_cat and any(by_cat[c])}
    return CategorySeries(
        times_s, by_cat,
        method="torch.profiler._memory_profiler (export_memory_timeline): each tensor "
               "labelled by data flow; tensors alive before profiling sized from recorded shapes",
    ), ""


def _counted_baseline(model: torch.nn.Module | None,
                      optimizer: torch.optim.Optimizer | None) -> tuple[int, str]:
    if model is None and optimizer is None:
        return 0, ("none: pass model= and optimizer= to add the bytes of the parameters, "
                   "gradients and optimizer state alive before the profiler started")
    tensors: list[torch.Tensor] = []
    parts = []
    if model is not None:
        params = list(model.parameters())
        tensors += params + [p.grad for p in params if p.grad is not None]
        parts.append("parameters, gradients")
    if optimizer is not None:
        tensors += optimizer_state_tensors(optimizer)
        parts.append("optimizer state")
    return storage_bytes(tensors), (f"counted: storage bytes of the {' and '.join(parts)} alive "
                                    "when recording started (labkit.memory.storage_bytes)")


def _record_history(max_entries: int) -> None:
    kwargs: dict[str, Any] = {"max_entries": max_entries}
    if "clear_history" in inspect.signature(torch.cuda.memory._record_memory_history).parameters:
        kwargs["clear_history"] = True  # older history would only widen the window
    torch.cuda.memory._record_memory_history(**kwargs)


def record_memory_timeline(
    step_fn: Callable[[], Any],
    *,
    steps: int = 2,
    warmup: int = 1,
    device: str | torch.device = "cpu",
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    snapshot_path: str | os.PathLike[str] | None = None,
    max_entries: int = 200_000,
) -> MemoryTimeline:
    """Run ``step_fn`` ``warmup`` times unrecorded, then ``steps`` times recorded; return the
    memory timeline of the recorded steps.

    ``step_fn`` runs one real training step and marks its phases with
    ``labkit.profiling.phase("forward")`` (or ``torch.profiler.record_function``). Warm-up
    lets lazily created state (Adam's moments) exist before recording, so the picture is a
    steady step. On CPU: the profiler's ``[memory]`` events plus a counted baseline from
    ``model``/``optimizer``. On CUDA: the allocator's recorded history (saved to
    ``snapshot_path`` for https://pytorch.org/memory_viz when given). Both: categories from
    torch's memory profiler when it works. Profiling with stacks slows the steps several
    times: record a few small steps, not a run.
    """
    from torch.profiler import profile

    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps}, warmup={warmup}: record at least one step")
    if not callable(step_fn):
        raise TypeError("step_fn must be a callable running one training step")
    dev = _device(device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError(f"device={device!r} but this torch sees no CUDA GPU; use device='cpu' "
                           "for a host-memory timeline")
    for _ in range(warmup):
        step_fn()
    # On CUDA the allocator's history is the total; its baseline is in the snapshot itself.
    baseline, baseline_method = (0, "") if cuda else _counted_baseline(model, optimizer)
    snapshot = None
    if cuda:
        torch.cuda.synchronize(dev)
    # record_shapes and with_stack are what torch's memory profiler needs to categorise
    # (profile._memory_profile checks for both).
    with profile(activities=activities(dev), profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        if cuda:
            _record_history(max_entries)
        try:
            for _ in range(steps):
                step_fn()
            if cuda:
                torch.cuda.synchronize(dev)
                snapshot = torch.cuda.memory._snapshot()
        finally:
            if cuda:
                torch.cuda.memory._record_memory_history(enabled=None)
    if snapshot is not None and snapshot_path is not None:
        import pickle

        # what torch.cuda.memory._dump_snapshot writes, from the snapshot already taken
        with open(snapshot_path, "wb") as f:
            pickle.dump(snapshot, f)

    with tempfile.TemporaryDirectory(prefix="labkit-memtl-") as tmp:
        trace_path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace_path)
        with open(trace_path) as f:
            trace = json.load(f)
        events = trace["traceEvents"]
        base_ns = trace.get("baseTimeNanoseconds")
        base_us = None if base_ns is None else float(base_ns) / 1e3
        tl, t0_us = _from_trace(events, dev, baseline, baseline_method, (*PHASES, COMMUNICATION))
        first_memory_us = t0_us + tl.times_s[1] * 1e6  # times_s[0] is the start level at t0
        cats, note = _categories(prof, dev, base_us, t0_us, first_memory_us,
                                 os.path.join(tmp, "mt.json"))

    kw: dict[str, Any] = {}
    if snapshot is not None and base_us is not None:
        # time_us in the snapshot and the trace's ts + baseTimeNanoseconds are both µs of the
        # profiler's Unix-time clock (c10 ApproximateClockToUnixTimeConverter).
        snap = timeline_from_snapshot(snapshot, device_index=dev.index or 0, phases=tl.phases,
                                      t0_us=base_us + t0_us)
        kw = {"times_s": snap.times_s, "total_bytes": snap.total_bytes, "method": snap.method,
              "notes": snap.notes, "snapshot_path": None if snapshot_path is None
              else os.fspath(snapshot_path)}
    elif cuda:
        kw = {"notes": ("no snapshot history on the trace's clock: the total is the profiler's "
                        "[memory] events instead",)}
    return dataclasses.replace(tl, **kw, categories=cats, categories_note=note,
                               averages=prof.key_averages(), recorded_steps=steps)


# --- drawing ------------------------------------------------------------------------------


def plot_memory_timeline(tl: MemoryTimeline, ax: Any = None, *, title: str | None = None) -> Any:
    """Draw ``tl``: stacked categories (when there are), the measured total as a line, the
    phases shaded and named, the peak marked; y in MiB, x in ms. Returns the Axes.

    On the CPU the line can sit a little below the stack's top: the profiler's categories
    size every tensor alive before recording (the batch too), the counted baseline only the
    model states. The "input" category (the training text) is drawn hatched above the stack,
    labelled as outside the total."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 4.5))
    x_ms = [t * 1e3 for t in tl.times_s]
    x_end = x_ms[-1]
    if tl.categories is not None and tl.categories.bytes:
        cx = [t * 1e3 for t in tl.categories.times_s]
        # "input" (the training text the batches are cut from, allocated before recording)
        # is not in the measured total: drawn hatched on top of the stack, not inside it
        names = [c for c in tl.categories.bytes if c != "input"]
        ax.stackplot(cx, *[[b / MiB for b in tl.categories.bytes[c]] for c in names],
                     labels=[c.replace("_", " ") for c in names],
                     colors=[CATEGORY_COLORS.get(c, "grey") for c in names],
                     alpha=0.75, step="post")
        if "input" in tl.categories.bytes:
            top = [sum(tl.categories.bytes[c][k] for c in names) / MiB for k in range(len(cx))]
            extra = [t + b / MiB for t, b in zip(top, tl.categories.bytes["input"], strict=True)]
            ax.fill_between(cx, top, extra, step="post", facecolor="none", hatch="///",
                            edgecolor=CATEGORY_COLORS.get("input", "grey"), linewidth=0,
                            label="input (not in the total: allocated before recording)")
        x_end = max(x_end, cx[-1])
    ax.step(x_ms, [b / MiB for b in tl.total_bytes], where="post", color="black",
            linewidth=1.2, label="total (measured" + (", + counted baseline)" if
                                                       tl.baseline_bytes else ")"))
    for span in tl.phases:
        ax.axvspan(span.start_s * 1e3, span.end_s * 1e3, color=PHASE_COLORS.get(span.name, "grey"),
                   alpha=0.12, linewidth=0)
        narrow = (span.end_s - span.start_s) * 1e3 < 0.08 * x_end  # upright names would collide
        ax.text((span.start_s + span.end_s) / 2 * 1e3, 0.98, span.name, ha="center", va="top",
                fontsize=7 if narrow else 8, rotation=90 if narrow else 0,
                transform=ax.get_xaxis_transform())
    ax.plot([tl.peak_time_s * 1e3], [tl.peak_bytes / MiB], "v", color="crimson",
            label=f"peak {tl.peak_bytes / MiB:,.2f} MiB")
    ax.set_xlim(0, x_end if x_end > 0 else 1)
    ax.set_ylim(0, max(tl.peak_bytes / MiB * 1.25, 1e-3))
    ax.set_xlabel("time since recording started (ms)")
    ax.set_ylabel("allocated (MiB)")
    n = sum(1 for span in tl.phases if span.name == "forward")
    which = "Host memory (CPU)" if tl.is_host else f"Device memory ({tl.device})"
    how = tl.kind.split("(", 1)[-1].rstrip(")")
    ax.set_title(title or f"{which} over {n} training step{'s' * (n != 1)} ({how})",
                 fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return ax
