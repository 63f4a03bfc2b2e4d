"""Draw exported traces as a timeline: one row per thread (per CUDA stream on a GPU), per rank.

    from labkit.profiling import load_traces, plot_trace
    plot_trace(load_traces(paths), steps=slice(0, 1))

Read from the trace files themselves, so the picture is what Perfetto would show, reduced to
what a step is made of: the phase ranges (``record_function``: data, forward, backward,
optimizer, communication) as coloured bars, the collectives on their own threads in red, and
the few operators that took the most time as thin grey bars under the phases. matplotlib is
imported only when drawing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from labkit.profiling.overlap import COMM, gpu_work
from labkit.profiling.phases import COMMUNICATION
from labkit.profiling.trace import GPU_WORK, Span, Trace

PHASE_COLOURS = {
    "data": "#8c6d31",
    "forward": "#3182bd",
    "backward": "#e6550d",
    "optimizer": "#31a354",
    COMMUNICATION: "#d62728",
}
COMM_COLOUR = "#d62728"
OP_COLOUR = "#9e9e9e"


def _window(trace: Trace, steps: slice | None) -> tuple[float, float]:
    chosen = trace.steps[steps] if steps is not None else trace.steps
    if not chosen:
        return trace.window_us
    return chosen[0].start_us, max(s.end_us for s in chosen)


def _launched_in(trace: Trace, window: tuple[float, float]) -> tuple[set[int], float]:
    """The GPU work (by ``id``) that the steps in ``window`` launched, and when the last of it
    ended: on a GPU the steps' kernels run on after their CPU ranges close (the CPU runs
    ahead), and kernels at the window's start may belong to the step before it."""
    if not (trace.on_gpu and trace.records_launches):
        return set(), window[1]
    mine, _ = gpu_work(trace, window)
    return {id(s) for s in mine}, max([window[1], *(s.end_us for s in mine)])


def top_ops(trace: Trace, window: tuple[float, float], k: int) -> list[str]:
    """The ``k`` operator names with the most time on the training thread in ``window``."""
    total: dict[str, float] = defaultdict(float)
    for s in trace.spans(cat="cpu_op", tid=trace.main_tid):
        if s.start_us >= window[0] and s.end_us <= window[1] and not COMM.search(s.name):
            total[s.name] += s.dur_us
    # an operator's time includes its children: the top-level ones (aten::linear, not aten::mm)
    return sorted(total, key=total.__getitem__, reverse=True)[:k]


def _short(name: str, width: int = 26) -> str:
    """An operator's name for a legend: without ``aten::``, cut to ``width`` characters."""
    name = name.removeprefix("aten::")
    return name if len(name) <= width else name[: width - 1] + "…"


def plot_trace(
    traces: Trace | Sequence[Trace],
    *,
    steps: slice | None = None,
    top: int = 4,
    ax: Any = None,
    title: str | None = None,
) -> Any:
    """A Gantt chart of ``traces`` (one per rank) over the chosen recorded ``steps``.

    Times are in ms from the start of each trace's first chosen step, so ranks line up by
    step, not by clock (their clocks agree only roughly). On a GPU trace the kernels shown are
    those the chosen steps launched, to the last one's end. Returns the Axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    traces = [traces] if isinstance(traces, Trace) else list(traces)
    rows: list[tuple[str, list[tuple[Span, str, float]]]] = []
    op_names: set[str] = set()
    for r, trace in enumerate(traces):
        lo, cpu_hi = _window(trace, steps)
        launched, hi = _launched_in(trace, (lo, cpu_hi))
        rank = trace.rank if trace.rank is not None else r
        prefix = f"rank {rank}: " if len(traces) > 1 else ""
        names = trace.thread_names()
        keep = set(top_ops(trace, (lo, cpu_hi), top))
        op_names |= keep
        by_tid: dict[Any, list[tuple[Span, str, float]]] = defaultdict(list)
        for s in trace.all_spans:
            on_gpu = s.cat in (*GPU_WORK, "gpu_user_annotation")
            # the CPU's rows end with the chosen steps; the GPU's run on to their last kernel
            if s.end_us <= lo or s.start_us >= (hi if on_gpu else cpu_hi) or s.cat == "Trace":
                continue
            if launched and s.cat in GPU_WORK and id(s) not in launched:
                continue  # another step's kernel
            if s.cat in ("user_annotation", "gpu_user_annotation") and s.name in PHASE_COLOURS:
                by_tid[s.tid].append((s, PHASE_COLOURS[s.name], lo))
            elif COMM.search(s.name) and s.cat in ("user_annotation", "kernel", "cpu_op"):
                by_tid[s.tid].append((s, COMM_COLOUR, lo))
            elif s.name in keep or s.cat == "kernel":
                by_tid[s.tid].append((s, OP_COLOUR, lo))
        for tid in sorted(by_tid, key=lambda t: (t != trace.main_tid, str(t))):
            rows.append((prefix + names.get(tid, f"thread {tid}"), by_tid[tid]))
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.55 * len(rows) + 1.4))
    for y, (_, bars) in enumerate(rows):
        for s, colour, lo in bars:
            thin = colour == OP_COLOUR
            ax.broken_barh([((s.start_us - lo) / 1e3, s.dur_us / 1e3)],
                           (y - (0.15 if thin else 0.35), 0.3 if thin else 0.7),
                           facecolors=colour, alpha=0.55 if thin else 0.9, linewidth=0)  # fmt: skip
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms from the start of the first step shown, per rank (measured, from the "
                  "exported trace)")
    drawn = {colour for _, bars in rows for _, colour, _ in bars}
    legend = [Patch(color=c, label=n) for n, c in PHASE_COLOURS.items() if c in drawn]
    if COMM_COLOUR in drawn and COMMUNICATION not in [p.get_label() for p in legend]:
        legend.append(Patch(color=COMM_COLOUR, label=COMMUNICATION))
    if OP_COLOUR in drawn:
        short = sorted({_short(n) for n in op_names})
        legend.append(Patch(color=OP_COLOUR, alpha=0.55,
                            label=f"top {top} operators:\n" + "\n".join(short)))
    # beside the axes, not under them: below, it covered the x-axis label
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=1,
              fontsize=8, frameon=False)  # fmt: skip
    if title:
        ax.set_title(title)
    return ax
