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
HTA is imported only when called.
"""

from __future__ import annotations

import contextlib
import io
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ANALYSES: dict[str, str] = {
    "temporal_breakdown": "get_temporal_breakdown",
    "comm_comp_overlap": "get_comm_comp_overlap",
    "idle_time": "get_idle_time_breakdown",
    "kernel_breakdown": "get_gpu_kernel_breakdown",
}
"""Our name -> HTA's ``TraceAnalysis`` method (each called with ``visualize=False``)."""


@dataclass
class HtaReport:
    """Each analysis's result, or the reason it produced nothing."""

    trace_dir: Path
    results: dict[str, Any] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    available: bool = True

    def describe(self) -> str:
        if not self.available:
            return self.failures.get("import", "HTA is not available")
        lines = []
        for name in ANALYSES:
            if name in self.results:
                lines.append(f"  {name}: ok")
            else:
                lines.append(f"  {name}: nothing ({self.failures[name]})")
        return f"Holistic Trace Analysis on {self.trace_dir}:\n" + "\n".join(lines)


def _empty_or_nan(value: Any) -> str | None:
    """Why ``value`` holds no answer (an empty table, only NaN), or None when it does."""
    frames = value if isinstance(value, tuple) else (value,)
    for frame in frames:
        if hasattr(frame, "empty"):
            if frame.empty:
                return "an empty table: no GPU kernels in these traces"
            numeric = frame.select_dtypes("number")
            if not numeric.empty and numeric.drop(columns=["rank"], errors="ignore").isna().all().all():
                return "only NaN: HTA divides by GPU kernel time, and there is none"
        elif isinstance(value, float) and math.isnan(value):
            return "NaN"
    return None


def hta_report(trace_dir: str | Path, *, analyses: dict[str, str] = ANALYSES,
               loader: Callable[[str], Any] | None = None) -> HtaReport:
    """Run HTA's analyses on the traces in ``trace_dir``; never raises for HTA's own failures."""
    trace_dir = Path(trace_dir)
    if not trace_dir.is_dir():
        raise FileNotFoundError(f"{trace_dir}: no such folder; give the folder of one job's traces")
    report = HtaReport(trace_dir)
    if loader is None:
        try:
            from hta.trace_analysis import TraceAnalysis
        except ImportError as e:
            report.available = False
            report.failures["import"] = (f"HTA is not installed ({e}): pip install "
                                         "holistictraceanalysis")  # fmt: skip
            return report

        def loader(path: str) -> Any:
            return TraceAnalysis(trace_dir=path)

    sink = io.StringIO()  # HTA prints its parsing progress; keep the cell readable
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            analyzer = loader(str(trace_dir))
        except Exception as e:
            report.available = False
            report.failures["import"] = f"HTA could not load the traces: {type(e).__name__}: {e}"
            return report
        for name, method in analyses.items():
            try:
                value = getattr(analyzer, method)(visualize=False)
            except Exception as e:
                report.failures[name] = f"raised {type(e).__name__}: {str(e)[:120]}"
                continue
            why = _empty_or_nan(value)
            if why:
                report.failures[name] = why
            else:
                report.results[name] = value
    return report
