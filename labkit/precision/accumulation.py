"""Accumulation error: a running sum kept in a narrow format stops growing once the increment is
less than half the gap between neighbours at the total (notebook 04, section 1).

Apart from the formats because it measures: the sums are done in torch, addition by addition,
and held against :func:`labkit.precision.sum_stall_point`'s prediction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from labkit.precision.formats import dtype_of, sum_stall_point


@dataclass(frozen=True)
class RunningSums:
    """The running total after each addition, per case (label → list of totals)."""

    increment: float
    traces: Mapping[str, list[float]]
    formats: Mapping[str, str]
    """Per label, the format the total was kept in (the accumulator's)."""

    def describe(self) -> str:
        """Per case: the measured sum, where it stalled (if it did) and the predicted stall."""
        lines = []
        for label, trace in self.traces.items():
            stall = sum_stall_point(self.increment, self.formats[label])
            stalled = next((i + 1 for i in range(1, len(trace)) if trace[i] == trace[i - 1]), None)
            where = (f"stalled at {trace[-1]:g} after {stalled} additions" if stalled
                     else "never stalled")
            lines.append(f"{label:<29} measured sum {trace[-1]:<10.6g} {where:<34} "
                         f"predicted stall: {stall:g}")
        return "\n".join(lines)


def running_sums(increment: float, n_adds: int,
                 cases: Sequence[tuple[str, str]]) -> RunningSums:
    """Add ``increment`` ``n_adds`` times, once per case (value format, accumulator format)."""
    traces, formats = {}, {}
    for value_fmt, acc_fmt in cases:
        x = torch.tensor(increment, dtype=dtype_of(value_fmt))
        total = torch.zeros((), dtype=dtype_of(acc_fmt))
        trace = []
        for _ in range(n_adds):
            total = total + x.to(total.dtype)
            trace.append(total.item())
        label = value_fmt if value_fmt == acc_fmt else f"{value_fmt} values, {acc_fmt} accumulator"
        traces[label], formats[label] = trace, acc_fmt
    return RunningSums(increment, traces, formats)


def plot_running_sums(result: RunningSums, ax: Any = None) -> Any:
    """Each case's running total against the number of additions, and the exact sum."""
    import matplotlib.pyplot as plt  # here, so that importing labkit stays light

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.2))
    n_adds = max(len(t) for t in result.traces.values())
    for label, trace in result.traces.items():
        ax.plot(range(1, len(trace) + 1), trace, label=f"{label} (measured)")
    ax.plot([0, n_adds], [0, n_adds * result.increment], ":", c="grey", label="exact")
    ax.set(xlabel=f"additions of {result.increment:g}", ylabel="running sum",
           title="the same sum in four precisions")
    ax.legend(fontsize=8)
    return ax
