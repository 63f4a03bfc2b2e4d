"""Holistic Trace Analysis on a job's traces, and a plain account of what it could not do.

    from labkit.profiling import hta_report
    report = hta_report(trace_dir)      # a folder with one trace per rank
    report.results["comm_comp_overlap"] # a DataFrame, where HTA produced one
    print(report.describe())            # each analysis: what it gave, or why it gave nothing

HTA (pytorch/HolisticTraceAnalysis, https://hta.readthedocs.io) reads the per-rank traces of a
distributed PyTorch job and reports, per rank, how GPU time splits into compute,
communication, memory copies and idle ("temporal breakdown"), how much communication
overlaps compute, kernel statistics and more. It is built on the GPU kernel events: a trace
recorded on CPU only (gloo) has none, and there its analyses raise or come back empty or NaN
(measured on torch 2.13 CPU traces with HTA 0.5.0: temporal breakdown raises IndexError, the
overlap is NaN, the kernel tables are empty). This module runs each analysis and records the
outcome as it happened; labkit's own ``overlap`` measures the CPU case from the threads.

Two of HTA's defaults would make it measure something other than labkit, so they are set here
(HTA 0.5.0, ``hta/trace_analysis.py`` and ``hta/common/trace_parser.py``):

* ``include_last_profiler_step=False`` drops the kernels the last ProfilerStep launched:
  HTA would read one step fewer than the trace holds. Here every recorded step is read.
* Timestamps with sub-microsecond digits are rounded inward to whole microseconds (a start
  up, an end down; pytorch/pytorch#122425), which shortens every short kernel: 2% of the
  compute time on a real two-rank NCCL trace. ``exact_times=True`` (the default) turns that
  off (``HTA_DISABLE_NS_ROUNDING``) for the load, so both read the same times.

HTA is imported only when called.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.profiling.overlap import gpu_split, kernel_kind, rank_times
from labkit.profiling.trace import GPU_WORK, Trace, TraceError, load_traces

ANALYSES: dict[str, str] = {
    "temporal_breakdown": "get_temporal_breakdown",
    "comm_comp_overlap": "get_comm_comp_overlap",
    "idle_time": "get_idle_time_breakdown",
    "kernel_breakdown": "get_gpu_kernel_breakdown",
}
"""Our name -> HTA's ``TraceAnalysis`` method (each called with ``visualize=False``)."""

RANKED = {"idle_time"}
"""Analyses that read rank 0 unless told which ranks to read (a folder may not hold rank 0)."""

HTA_MISSING = ("Holistic Trace Analysis is not installed ({error}). It is an optional part of "
               "labkit: `pip install holistictraceanalysis==0.5.0` (the tested version), or "
               "`pip install -e '.[traces]'` in the course's folder; `./course setup` installs it. "
               "labkit's own figures above do not need it.")  # fmt: skip
"""What every HTA analysis says when HTA cannot be imported (pyproject's ``traces`` extra)."""


@dataclass
class HtaReport:
    """Each analysis's result, or the reason it produced nothing."""

    trace_dir: Path
    results: dict[str, Any] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    available: bool = True
    no_kernels: bool = False
    """The traces hold no GPU kernels (a CPU job): the one reason behind every failure."""

    def describe(self) -> str:
        if not self.available:
            return self.failures.get("import", "HTA is not available")
        lines = []
        for name in ANALYSES:
            if name in self.results:
                lines.append(f"  {name}: ok")
            else:
                lines.append(f"  {name}: nothing ({self.failures[name]})")
        head = f"Holistic Trace Analysis on {self.trace_dir}:"
        if self.no_kernels:
            head += (" these traces hold no GPU kernels (recorded on CPU ranks), and HTA reads "
                     "only kernels")  # fmt: skip
            head += ", so each analysis gave nothing:" if not self.results else ":"
        return head + "\n" + "\n".join(lines)


@dataclass(frozen=True)
class _Contents:
    """What the traces hold, per rank: the facts that explain an empty answer."""

    ranks: list[int]
    kernels: dict[int, int]  # rank -> kernels, copies and memsets recorded
    comm_kernels: dict[int, int]  # rank -> NCCL kernels among them

    @classmethod
    def of(cls, traces: list[Trace]) -> _Contents:
        kernels, comm = {}, {}
        for k, t in enumerate(traces):
            rank = t.rank if t.rank is not None else k
            work = t.spans(cat=GPU_WORK)
            kernels[rank] = len(work)
            comm[rank] = sum(1 for s in work if kernel_kind(s) == "communication")
        return cls(sorted(kernels), kernels, comm)

    def why_empty(self, name: str) -> str:
        """Why analysis ``name`` gave an empty table or NaN on these traces."""
        if name == "comm_comp_overlap" and not any(self.comm_kernels.values()):
            total = sum(self.kernels.values())
            return (f"no communication kernels among the {total:,} recorded on rank(s) "
                    f"{self.ranks}: nothing to overlap (HTA divides by communication time, "
                    "which is 0)")  # fmt: skip
        return "HTA computed nothing for these traces"


def _hta_error(error: Exception) -> str:
    """A failure message that says what went wrong, even when HTA's exception says nothing."""
    text = str(error).strip()[:160] or "HTA gave no message"
    return f"raised {type(error).__name__}: {text}"


def _empty_or_nan(value: Any) -> str | None:
    """What ``value`` is when it holds no answer (an empty table, only NaN), or None."""
    if isinstance(value, float):
        return "NaN" if math.isnan(value) else None
    frames = value if isinstance(value, tuple) else (value,)
    for frame in frames:
        if hasattr(frame, "empty"):
            if frame.empty:
                return "an empty table"
            numeric = frame.select_dtypes("number")
            if not numeric.empty and numeric.drop(columns=["rank"], errors="ignore").isna().all().all():
                return "only NaN"
    return None


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def hta_report(trace_dir: str | Path, *, analyses: dict[str, str] = ANALYSES,
               loader: Callable[[str], Any] | None = None,
               exact_times: bool = True) -> HtaReport:
    """Run HTA's analyses on the traces in ``trace_dir``; never raises for HTA's own failures.

    Every recorded step is read (HTA's default drops the last); with ``exact_times`` HTA keeps
    the traces' sub-microsecond times (see the module docstring). ``loader`` stands in for
    ``hta.trace_analysis.TraceAnalysis`` in tests."""
    trace_dir = Path(trace_dir)
    if not trace_dir.is_dir():
        raise FileNotFoundError(f"{trace_dir}: no such folder; give the folder of one job's traces")
    report = HtaReport(trace_dir)
    refused = ""
    try:  # labkit reads the same files: the ranks to ask about, and why an answer is empty
        contents: _Contents | None = _Contents.of(load_traces(trace_dir))
    except TraceError as e:
        contents = None  # HTA may still read what labkit refuses; its own failure is reported
        refused = f"; labkit refuses them too: {e}"
    report.no_kernels = contents is not None and not any(contents.kernels.values())
    if loader is None:
        try:
            from hta.trace_analysis import TraceAnalysis
        except ImportError as e:
            report.available = False
            report.failures["import"] = HTA_MISSING.format(error=e)
            return report

        def loader(path: str) -> Any:
            return TraceAnalysis(trace_dir=path, include_last_profiler_step=True)

    sink = io.StringIO()  # HTA prints its parsing progress; keep the cell readable
    exact = {"HTA_DISABLE_NS_ROUNDING": "1"} if exact_times else {}
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), \
            warnings.catch_warnings(), _env(**exact):
        warnings.simplefilter("ignore")
        try:
            analyzer = loader(str(trace_dir))
        except Exception as e:
            report.available = False
            report.failures["import"] = (f"HTA could not load the traces: "
                                         f"{type(e).__name__}: {e}{refused}")  # fmt: skip
            return report
        for name, method in analyses.items():
            kwargs: dict[str, Any] = {"visualize": False}
            if name in RANKED and contents is not None:
                kwargs["ranks"] = contents.ranks
            try:
                value = getattr(analyzer, method)(**kwargs)
            except Exception as e:
                report.failures[name] = _hta_error(e)
                continue
            empty = _empty_or_nan(value)
            if empty:
                report.failures[name] = (f"{empty}: {contents.why_empty(name)}"
                                         if contents is not None and not report.no_kernels
                                         else empty)  # fmt: skip
            else:
                report.results[name] = value
    return report


def side_by_side(report: HtaReport, traces: Sequence[Trace]) -> str:
    """labkit's figures and HTA's, per rank, on the same traces: the overlap of communication
    with compute, the compute time and the idle time per step; and whether they agree.

    On CPU traces HTA has nothing to read (no kernels): the text says so, and which figure of
    labkit's stands in for HTA's."""
    if not any(t.on_gpu for t in traces):
        return ("No GPU kernels, so nothing of HTA's to set beside labkit's figures: on CPU "
                "ranks labkit.profiling.overlap measures the overlap from the threads instead. "
                "On GPU traces this puts, per rank, HTA's overlap, compute and idle time beside "
                "labkit's.")  # fmt: skip
    if not report.available:
        return f"HTA did not run: {report.describe()}"
    overlap = report.results.get("comm_comp_overlap")
    breakdown = report.results.get("temporal_breakdown")
    overlap = overlap.set_index("rank") if overlap is not None else None
    breakdown = breakdown.set_index("rank") if breakdown is not None else None
    lines = [f"{'rank':>4}  {'overlap labkit':>14} {'HTA':>8}  {'compute ms/step labkit':>22} "
             f"{'HTA':>8}  {'idle ms/step labkit':>19} {'HTA':>8}"]  # fmt: skip
    gaps: list[float] = []  # relative differences, one per figure HTA gave; NaN if it gave NaN
    for t in traces:
        r, g = rank_times(t), gpu_split(t)
        ov = compute = idle = math.nan
        if overlap is not None and t.rank in overlap.index:
            ov = float(overlap.loc[t.rank, "comp_comm_overlap_pctg"])
            if r.comm_s:
                gaps.append(abs(ov - 100 * r.hidden_fraction) / 100)
        if breakdown is not None and t.rank in breakdown.index:
            compute = float(breakdown.loc[t.rank, "compute_time(us)"]) / r.steps / 1e3
            idle = float(breakdown.loc[t.rank, "idle_time(us)"]) / r.steps / 1e3
            gaps += [abs(compute - r.compute_s * 1e3) / max(r.compute_s * 1e3, 1e-9),
                     abs(idle - g.idle_s * 1e3) / max(g.span_s * 1e3, 1e-9)]  # fmt: skip
        ours_ov = f"{100 * r.hidden_fraction:.2f}%" if r.comm_s else "no comm"
        lines.append(f"{t.rank!s:>4}  {ours_ov:>14} {_pct(ov):>8}  {r.compute_s * 1e3:>22.2f} "
                     f"{compute:>8.2f}  {g.idle_s * 1e3:>19.2f} {idle:>8.2f}")  # fmt: skip
    if not gaps:
        verdict = "HTA produced nothing to compare with: see its report above for why."
    elif all(gap <= 1e-4 for gap in gaps):  # a NaN fails this too
        verdict = (f"They agree to within 0.01% on all {len(gaps)} figures HTA gave: the same "
                   "steps, the same kernels.")  # fmt: skip
    else:
        worst = max((gap for gap in gaps if not math.isnan(gap)), default=math.nan)
        why = ("HTA keeps every kernel of a trace with fewer than two steps, and counts launches "
               "before the first step; labkit counts only the steps' own"
               if any(len(t.steps) < 2 for t in traces) else
               "HTA counts kernels launched before the first step, which labkit leaves out, "
               "and (unless told otherwise) drops the last step and rounds times to whole µs")  # fmt: skip
        verdict = (f"They differ, by up to {_pct(100 * worst)} of a figure"
                   f"{' (and HTA gave NaN for some)' if any(map(math.isnan, gaps)) else ''}: "
                   f"{why}.")  # fmt: skip
    return "\n".join([*lines, verdict])


def _pct(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}%"


# --- before and after: HTA's TraceDiff ---------------------------------------------------------


@dataclass
class TraceDiffResult:
    """HTA's ``TraceDiff.compare_traces`` on two runs' traces, per recorded step; or why not.

    ``table`` (a DataFrame indexed by operator or kernel name) holds, for each side, the calls
    per step and the microseconds per step (HTA's counts and total durations over every
    recorded step it read, divided by that side's number of steps), and their differences."""

    labels: tuple[str, str]
    steps: tuple[int, int] = (0, 0)
    table: Any = None
    failure: str = ""

    def per_step(self, name: str) -> tuple[float, float]:
        """Calls of ``name`` per step: (control, test); 0 where a side has none."""
        if self.table is None:
            raise ValueError(f"TraceDiff produced nothing: {self.failure}")
        if name not in self.table.index:
            return 0.0, 0.0
        row = self.table.loc[name]
        a, b = self.labels
        return float(row[f"{a} calls/step"]), float(row[f"{b} calls/step"])

    def describe(self, top: int = 6) -> str:
        if self.table is None:
            return f"HTA TraceDiff: nothing ({self.failure})"
        a, b = self.labels
        t = self.table
        lines = [f"HTA TraceDiff, {a} → {b} (rank 0; {self.steps[0]} and {self.steps[1]} recorded "
                 "steps; per step):"]  # fmt: skip
        moved = t[t["Δ calls/step"] != 0].sort_values("Δ calls/step", key=abs, ascending=False)
        lines.append(f"  {'calls changed':<44}{a:>10}{b:>10}")
        for name, row in moved.head(top).iterrows():
            lines.append(f"  {str(name)[:43]:<44}{row[f'{a} calls/step']:>10.1f}"
                         f"{row[f'{b} calls/step']:>10.1f}")  # fmt: skip
        slower = t.sort_values("Δ µs/step", key=abs, ascending=False)
        lines.append(f"  {'time changed most (µs per step)':<44}{a:>10}{b:>10}")
        for name, row in slower.head(top).iterrows():
            lines.append(f"  {str(name)[:43]:<44}{row[f'{a} µs/step']:>10.0f}"
                         f"{row[f'{b} µs/step']:>10.0f}")  # fmt: skip
        return "\n".join(lines)


def trace_diff(control_dir: str | Path, test_dir: str | Path, *,
               labels: tuple[str, str] = ("before", "after"), rank: int = 0,
               device: str = "cpu") -> TraceDiffResult:  # fmt: skip
    """Compare one rank's operators (``device="cpu"``), kernels (``"gpu"``) or both (``"all"``)
    in two runs' trace folders with HTA's ``TraceDiff`` (HTA 0.5.0, ``hta/trace_diff.py``),
    over every recorded step of each, with exact times. Never raises for HTA's own failures:
    the result says what went wrong."""
    if device not in ("cpu", "gpu", "all"):
        raise ValueError(f"device={device!r} is not allowed: 'cpu', 'gpu' or 'all'")
    if len(labels) != 2 or labels[0] == labels[1]:
        raise ValueError(f"labels={labels!r}: give two different names")
    for folder in (control_dir, test_dir):
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"{folder}: no such folder; give the folder of one run's traces")
    result = TraceDiffResult(labels=tuple(labels))  # type: ignore[arg-type]
    try:
        from hta.trace_diff import DeviceType, LabeledTrace, TraceDiff
    except ImportError as e:
        result.failure = HTA_MISSING.format(error=e)
        return result
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), \
            warnings.catch_warnings(), _env(HTA_DISABLE_NS_ROUNDING="1"):
        warnings.simplefilter("ignore")
        try:
            a = LabeledTrace(labels[0], trace_dir=str(control_dir))
            b = LabeledTrace(labels[1], trace_dir=str(test_dir))
            steps = (len(a.iterations()), len(b.iterations()))
            df = TraceDiff.compare_traces(a, b, control_rank=rank, test_rank=rank,
                                          control_iteration=a.iterations(),
                                          test_iteration=b.iterations(),
                                          device_type=getattr(DeviceType, device.upper()))  # fmt: skip
        except Exception as e:
            result.failure = _hta_error(e)
            return result
    if not all(steps):
        result.failure = f"a side has no recorded steps (ProfilerStep ranges): {steps}"
        return result
    import pandas as pd

    x, y = labels
    # one row for the steps themselves: HTA keys them by name, ProfilerStep#N, one row per N
    is_step = df.index.to_series().str.match(r"^ProfilerStep#\d+$")
    if is_step.any():
        steps_row = df[is_step].select_dtypes("number").sum().to_frame("ProfilerStep (the steps)").T
        df = pd.concat([df[~is_step], steps_row])
    table = pd.DataFrame({
        f"{x} calls/step": df[f"{x}_counts"] / steps[0],
        f"{y} calls/step": df[f"{y}_counts"] / steps[1],
        f"{x} µs/step": df[f"{x}_total_duration"] / steps[0],
        f"{y} µs/step": df[f"{y}_total_duration"] / steps[1],
    })
    table["Δ calls/step"] = table[f"{y} calls/step"] - table[f"{x} calls/step"]
    table["Δ µs/step"] = table[f"{y} µs/step"] - table[f"{x} µs/step"]
    result.steps, result.table = steps, table
    return result


# --- launch-bound or not: HTA's CUDA kernel launch statistics ---------------------------------


@dataclass
class LaunchStats:
    """HTA's ``get_cuda_kernel_launch_stats`` for one rank, summarised; or why it gave nothing.

    Per launch HTA pairs the CPU call (``cudaLaunchKernel``, ``cudaMemcpyAsync``, ...) with the
    GPU work it queued, by correlation id: ``cpu_duration`` (the call), ``gpu_duration`` (the
    kernel) and ``launch_delay`` (from the call's end to the kernel's start, clipped at 0)."""

    rank: int
    table: Any = None
    failure: str = ""

    @property
    def launches(self) -> int:
        return 0 if self.table is None else len(self.table)

    @property
    def shorter_than_launch(self) -> float:
        """Share of the launches whose GPU work took less time than the CPU call that queued
        it: a GPU that finishes kernels faster than the CPU launches them waits for the CPU
        (the launch-bound signature)."""
        if not self.launches:
            return math.nan
        t = self.table
        return float((t["gpu_duration"] < t["cpu_duration"]).mean())

    def describe(self) -> str:
        if not self.launches:
            return f"HTA kernel launch statistics, rank {self.rank}: nothing ({self.failure})"
        t = self.table
        return (f"HTA kernel launch statistics, rank {self.rank}: {self.launches:,} launches; "
                f"median CPU call {t['cpu_duration'].median():.1f} µs, GPU work "
                f"{t['gpu_duration'].median():.1f} µs, launch delay "
                f"{t['launch_delay'].median():.1f} µs; {self.shorter_than_launch:.0%} of the "
                "launches queued work shorter than the call that queued it (measured)")


def launch_stats(trace_dir: str | Path, *, rank: int = 0,
                 loader: Callable[[str], Any] | None = None) -> LaunchStats:  # fmt: skip
    """HTA's CUDA kernel launch statistics for ``rank`` of the traces in ``trace_dir``.

    A trace recorded on CPU only holds no CUDA launches: HTA returns an empty table, and the
    result says so. ``loader`` stands in for ``TraceAnalysis`` in tests."""
    trace_dir = Path(trace_dir)
    if not trace_dir.is_dir():
        raise FileNotFoundError(f"{trace_dir}: no such folder; give the folder of one job's traces")
    result = LaunchStats(rank)
    if loader is None:
        try:
            from hta.trace_analysis import TraceAnalysis
        except ImportError as e:
            result.failure = HTA_MISSING.format(error=e)
            return result

        def loader(path: str) -> Any:
            return TraceAnalysis(trace_dir=path, include_last_profiler_step=True)

    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), \
            warnings.catch_warnings(), _env(HTA_DISABLE_NS_ROUNDING="1"):
        warnings.simplefilter("ignore")
        try:
            found = loader(str(trace_dir)).get_cuda_kernel_launch_stats(ranks=[rank],
                                                                        visualize=False)
        except Exception as e:
            result.failure = _hta_error(e)
            return result
    table = (found or {}).get(rank)
    if table is None or table.empty:
        result.failure = ("an empty table: the traces hold no CUDA launch calls "
                          "(cudaLaunchKernel, cuda_runtime events) paired with GPU work by "
                          "correlation id, which a trace recorded on the CPU does not have")  # fmt: skip
        return result
    result.table = table
    return result
