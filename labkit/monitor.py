"""Live plots of a job's hardware metrics under the notebook cell, and one static figure after.

    from labkit.jobs import launch
    from labkit.monitor import Monitor

    mon = Monitor(period_s=1.0)
    res = launch.run("labkit.workers.allreduce", nproc=2, observers=[mon])
    mon.summary()                  # mean / max of each metric per GPU (or per rank on CPU)

    with Monitor(period_s=0.5) as mon:                 # single-process code in the kernel
        history = train(model, cfg, data, on_step=mon.on_step)

    with Monitor(backend=ReplayBackend("h200.jsonl", realtime=False)):
        pass                                           # a recording made on a real GPU

    with Monitor(backend="nvml", record_to="h200.jsonl") as mon:   # make such a recording
        history = train(model, cfg, data, on_step=mon.on_step)

What it shows: one panel per metric with one line per source (``gpu0``, ``gpu1``... on the GPU
tiers; ``rank0``, ``rank1``... and ``host`` on the CPU tier), each rank's step events as short
tick marks in its colour along the top of every panel, and a bottom panel of step against time
per rank (a rank that falls behind shows as a lagging line). The title carries the backend's
own description: the GPUs read through NVML, "CPU only ...; no NVIDIA GPU found: <reason>", or
"recording of <hardware> on <date>" for a replayed trace, and the step of the slowest rank out
of the job's total; a worker that runs several things one after another (notebook 02's
strategies) names the one running (``ctx.heartbeat(part=...)``), and each part's start is a
dotted line across the panels. Nothing is ever invented: a value the device did not report
(N/A) is a gap in the line, never a zero (``labkit.metrics.base``), and a panel whose ranks
have not started yet says "waiting for ranks", not N/A.

Who drives the sampling, and why:

- **As a launcher observer** (``launch.run(..., observers=[mon])``) the notebook cell blocks in
  ``run`` until the job ends, which starves anything scheduled on the kernel's event loop
  (ipykernel runs a cell on the thread that serves that loop, so callbacks wait for the cell
  to return). So no thread and no asyncio task: the launcher's own
  supervision loop calls ``on_tick`` every ~0.25 s, and that samples (``Sampler.poll_due``),
  reads each rank's step from its heartbeat, and redraws.
- **As a context manager** nothing else loops, so the sampler's own thread samples the kernel
  process ("rank0") or the GPUs, and redraws from there. ``mon.on_step`` (the signature of
  ``labkit.train.train``'s ``on_step``) records step events.

Either way the sampler is stopped when the job ends or the block exits, on success, error,
timeout or interrupt.

Live or headless. Live (a person watching JupyterLab): the figure under the cell is redrawn
through a display handle with each new sample, as long as drawing takes at most
``RENDER_SHARE`` of one core (the ranks being measured need the rest), and its final update is
the final figure; if the cell's output was cleared meanwhile (``clear_output()``, which takes
the live figure with it), the final figure is displayed afresh instead. A live frame redraws
only the lines over a saved picture of the axes, whose limits grow in steps (see ``_Plot``):
a few hundredths of a second of CPU per frame.
Headless (papermill, nbval, a script): no updates at all, then exactly one static figure. nbval
ignores display updates and papermill has no person watching, so redrawing there only costs
time. Either way the cell ends with one figure and one summary table. ``live`` defaults to
``live_default()``: the environment variable ``LABKIT_LIVE_PLOTS`` (``1``, ``0`` or ``auto``)
decides if set; under ``auto`` a Jupyter kernel is live unless the process that started it is
a headless executor (papermill, pytest/nbval, nbconvert, nbclient). A wrong guess is harmless
for the saved notebook: nbclient applies display updates in place, so a live monitor under
papermill also leaves exactly one figure.

Figures are drawn with matplotlib's object API on the Agg canvas and shown as PNG bytes, never
through ``pyplot``: pyplot figures left open would be shown a second time by the inline
backend at the end of the cell. matplotlib is imported only when a figure is drawn.
"""

from __future__ import annotations

import html
import io
import math
import os
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.metrics import (
    METRICS,
    Backend,
    CpuBackend,
    NvmlBackend,
    Recorder,
    ReplayBackend,
    Sample,
    Sampler,
    auto_backend,
    clamp_period,
)
from labkit.metrics.base import Clock

LIVE_ENV = "LABKIT_LIVE_PLOTS"  # "1": live plots, "0": headless, "auto" (default): guess
# Live frames: one per new sample, but at most RENDER_SHARE of one core's time spent drawing
# them, counted in CPU time (a frame costs ~0.2 s of CPU here). On a busy machine a frame's
# wall time is mostly other processes' turns on the cores; budgeting wall time kept frames
# ~9 s apart on two loaded cores, behind the text printed under the same cell.
RENDER_SHARE = 0.2
MAX_TICKS = 300  # step tick marks drawn per rank; more would be a solid bar anyway
# Processes that run notebooks with nobody watching; the kernel's parent tells (see module doc).
HEADLESS_EXECUTORS = ("papermill", "pytest", "nbval", "nbconvert", "nbclient", "jupyter-execute")

# Panels shown by default, per backend kind. On the GPU tiers: is a kernel running, how full
# is memory, how hard is the board working, and, on Hopper and newer, how busy the SMs and
# tensor cores really are (gpu_util_pct alone over-states it: see METRICS). On the CPU tier:
# each rank's CPU and memory, and the whole host (ranks compete for its cores).
DEFAULT_METRICS: dict[str, tuple[str, ...]] = {
    "nvml": ("gpu_util_pct", "sm_active_pct", "tensor_active_pct", "mem_used_gib", "power_w"),
    "replay": ("gpu_util_pct", "sm_active_pct", "tensor_active_pct", "mem_used_gib", "power_w"),
    "cpu": ("cpu_pct", "rss_gib", "host_cpu_pct"),
}
# Default panels dropped when the device never reports them (pre-Hopper GPUs have no GPM):
# an empty panel would only take room. A metric the caller asked for is always drawn.
OPTIONAL_METRICS = frozenset({"sm_active_pct", "tensor_active_pct"})

Bundle = dict[str, Any]  # a MIME bundle: {"image/png": bytes, "text/plain": str, ...}


# --- what the monitor records ------------------------------------------------------------------


@dataclass(frozen=True)
class StepEvent:
    """Rank ``rank`` reached step ``step`` at ``time_s`` (seconds on the sampler's clock).

    From a launched job the step comes from the rank's heartbeat file, read every ~0.25 s:
    steps shorter than that are thinned (only the latest one of each tick is seen), and the
    time is the heartbeat's own time stamp, so it is exact for the steps that are seen.
    """

    rank: int
    step: int
    time_s: float


@dataclass(frozen=True)
class PartEvent:
    """The job began ``part`` at ``time_s`` (seconds on the sampler's clock).

    A worker that does several things one after another names the one running in its
    heartbeat (``ctx.heartbeat(part="ddp (3/8)")``, see ``labkit.jobs.runtime``). The time is that of
    the first heartbeat naming it that the monitor read, so it can be up to one heartbeat and
    one supervision tick (~0.25 s) late.
    """

    part: str
    time_s: float


@dataclass(frozen=True)
class SummaryRow:
    """One metric of one source over the run. ``mean``/``max`` are None when every reading
    was N/A; ``n`` counts the readings with a value, ``n_na`` those without."""

    source: str
    metric: str
    unit: str
    mean: float | None
    max: float | None
    n: int
    n_na: int


@dataclass
class Summary:
    """The table shown under the final figure; also handy in tests and notebook checks.

    Attributes:
        describe: the backend's one-line description (hardware, or why there is no GPU, or
            the recording it replays).
        status: how the run ended: "ok", the job's status ("failed", "timeout",
            "interrupted"), or "error: <exception>" for a ``with`` block that raised.
        duration_s: seconds from the first to the last sample.
        n_samples: samples recorded (all sources).
        last_step: rank -> the last step seen.
        rows: one per (source, metric) drawn.
    """

    describe: str
    status: str
    duration_s: float
    n_samples: int
    last_step: dict[int, int] = field(default_factory=dict)
    rows: list[SummaryRow] = field(default_factory=list)

    def row(self, source: str, metric: str) -> SummaryRow:
        for r in self.rows:
            if r.source == source and r.metric == metric:
                return r
        have = sorted({(r.source, r.metric) for r in self.rows})
        raise KeyError(f"no row for source={source!r}, metric={metric!r}; have {have}")

    @property
    def sources(self) -> list[str]:
        return list(dict.fromkeys(r.source for r in self.rows))

    def _header(self) -> list[str]:
        steps = ", ".join(f"rank{r} step {s}" for r, s in sorted(self.last_step.items()))
        return [
            self.describe,
            f"{self.status}; {self.n_samples} samples over {self.duration_s:.1f} s"
            + (f"; last steps: {steps}" if steps else ""),
        ]

    def _cells(self) -> list[list[str]]:
        return [
            [r.source, r.metric, r.unit, _num(r.mean), _num(r.max), str(r.n), str(r.n_na)]
            for r in self.rows
        ]

    def __str__(self) -> str:
        rows = [["source", "metric", "unit", "mean", "max", "samples", "N/A"], *self._cells()]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        table = ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
        return "\n".join([*self._header(), *table])

    def _repr_html_(self) -> str:
        esc = html.escape
        head = "".join(
            f"<th>{h}</th>" for h in ("source", "metric", "unit", "mean", "max", "samples", "N/A")
        )
        body = "".join(
            "<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in self._cells()
        )
        top = "<br>".join(esc(s) for s in self._header())
        return (f"<div class='labkit-monitor-summary'>{top}<table><thead><tr>{head}</tr></thead>"
                f"<tbody>{body}</tbody></table></div>")


def _num(v: float | None) -> str:
    return "N/A" if v is None else f"{v:.3g}"


# --- pure helpers: series, summary, figure ------------------------------------------------------


def series(
    samples: Iterable[Sample], source: str, metric: str, t0: float = 0.0
) -> tuple[list[float], list[float]]:
    """(seconds since ``t0``, values) of one metric of one source, ready for ``plot``.

    N/A (``None``) becomes NaN, which matplotlib draws as a gap: a missing reading must not
    look like a zero. Samples where the metric was not read at all (absent key, e.g. a rank
    that exited) are left out.
    """
    xs, ys = [], []
    for s in samples:
        if s.source == source and metric in s.values:
            v = s.values[metric]
            xs.append(s.time_s - t0)
            ys.append(math.nan if v is None else float(v))
    return xs, ys


def sources_of(samples: Iterable[Sample], metric: str) -> list[str]:
    """Sources that reported ``metric`` at least once, in a stable, readable order."""
    found = {s.source for s in samples if metric in s.values}
    return sorted(found, key=_source_order)


def _source_order(source: str) -> tuple[int, str, int, str]:
    # gpu0 < gpu1 < gpu0/rank1 < rank0 < rank1 < rank10 < host: numbers compare as numbers.
    head, _, tail = source.partition("/")
    kind = head.rstrip("0123456789")
    num = head[len(kind) :]
    order = {"gpu": 0, "rank": 2, "host": 3}.get(kind, 4) + (1 if tail else 0)
    return order, kind, int(num) if num else -1, tail


def metrics_to_show(
    samples: Sequence[Sample], kind: str, requested: Sequence[str] | None
) -> list[str]:
    """The panels to draw: the caller's list, or the backend kind's default set minus the
    optional metrics this device never reported."""
    if requested is not None:
        return list(requested)
    shown = []
    for m in DEFAULT_METRICS.get(kind, DEFAULT_METRICS["nvml"]):
        seen = any(s.values.get(m) is not None for s in samples)
        if m not in OPTIONAL_METRICS or seen:
            shown.append(m)
    return shown


def summarize(
    samples: Sequence[Sample],
    metrics: Sequence[str],
    *,
    describe: str,
    status: str,
    last_step: Mapping[int, int] | None = None,
) -> Summary:
    """Mean and max of each shown metric per source, with N/A readings counted apart."""
    rows = []
    for metric in metrics:
        unit = METRICS[metric].unit if metric in METRICS else ""
        for source in sources_of(samples, metric):
            _, ys = series(samples, source, metric)
            vals = [y for y in ys if not math.isnan(y)]
            rows.append(SummaryRow(
                source, metric, unit,
                mean=sum(vals) / len(vals) if vals else None,
                max=max(vals) if vals else None,
                n=len(vals), n_na=len(ys) - len(vals),
            ))  # fmt: skip
    times = [s.time_s for s in samples]
    return Summary(
        describe=describe,
        status=status,
        duration_s=(max(times) - min(times)) if times else 0.0,
        n_samples=len(samples),
        last_step=dict(last_step or {}),
        rows=rows,
    )


def _color(index: int) -> str:
    # matplotlib's default cycle (tab10), so rank r has the same colour in every panel.
    tab10 = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
             "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")  # fmt: skip
    return tab10[index % len(tab10)]


def _source_style(source: str) -> dict[str, Any]:
    if source == "host":
        return {"color": "black", "linestyle": ":"}
    head, _, tail = source.partition("/")
    digits = "".join(ch for ch in (tail or head) if ch.isdigit())
    style: dict[str, Any] = {"color": _color(int(digits)) if digits else "grey"}
    if tail:  # "gpu0/rank1": a process on a GPU, drawn dashed beside the GPU itself
        style["linestyle"] = "--"
    return style


# Fixed layout, in inches. matplotlib's constrained layout measured every text on every frame
# (~0.7 s of a ~1 s frame on two busy cores); a stack of panels needs no solver.
LEFT_IN, RIGHT_IN, BOTTOM_IN = 0.85, 0.2, 0.5  # y labels and ticks; x label and ticks
PANEL_IN, GAP_IN = 1.4, 0.15  # height of a panel, and between panels
TITLE_LINE_IN, TOP_IN = 0.17, 0.14  # per line of the title (9 pt), and above it
WAITING_SAMPLE = "waiting for the first sample"
WAITING_RANKS = "waiting for ranks"
NOT_REPORTED = "N/A: not reported by this device"
ENDED_FIRST = "no sample: the run ended first"


def _scope(source: str) -> str:
    """The ``Metric.scope`` of a sample's source: "gpu0" -> "gpu", "gpu0/rank1" -> "gpu
    process", "rank1" -> "rank", "host" -> "host"."""
    if "/" in source:
        return "gpu process"
    return source.rstrip("0123456789") if source != "host" else "host"


def empty_panel_note(
    samples: Sequence[Sample], metric: str, kind: str, waiting: str | None
) -> str:
    """What a panel without a line says, so that N/A is never shown for "not yet".

    N/A when the device does not report ``metric`` (another backend's metric, or sources of its
    scope were sampled without it); ``waiting`` while the run goes on and no source of its
    scope has been sampled yet (ranks spend seconds importing torch); ``ENDED_FIRST`` when the
    run ended before any was (``waiting`` is None once the run is over).
    """
    spec = METRICS.get(metric)
    produced_by = "nvml" if kind == "replay" else kind
    if spec is not None and kind and spec.backend != produced_by:
        return NOT_REPORTED
    scope = spec.scope if spec is not None else None
    if any(_scope(s.source) == scope and s.status == "ok" for s in samples):
        return NOT_REPORTED  # its sources were read, without this metric
    return waiting if waiting is not None else ENDED_FIRST


@dataclass(frozen=True)
class _Shape:
    """What fixes a figure's artists; a frame with the same shape only moves their data."""

    metrics: tuple[str, ...]
    sources: tuple[tuple[str, ...], ...]  # per metric
    ranks: tuple[int, ...]  # ranks with step events: the step panel, and ticks per panel
    title_lines: int
    recording: bool


def _shape(samples: Sequence[Sample], steps: Sequence[StepEvent], metrics: Sequence[str],
           title: str, recording: bool) -> _Shape:  # fmt: skip
    return _Shape(tuple(metrics), tuple(tuple(sources_of(samples, m)) for m in metrics),
                  tuple(sorted({e.rank for e in steps})), title.count("\n") + 1,
                  recording)  # fmt: skip


class _Plot:
    """One monitor figure: its panels, lines and ranks made once, then updated in place.

    ``live``: a frame under a running cell. Its axis limits only grow, in steps of "nice"
    numbers, so that most frames change nothing but the data; those frames redraw only the
    moving artists (lines, step ticks, part marks, title) over a saved picture of the rest
    (blitting: matplotlib.org/stable/users/explain/animations/blitting.html). On two busy
    cores a frame then costs a few hundredths of a second of CPU instead of ~0.3 s (a full
    draw) or ~1 s (a new figure laid out by the constrained-layout solver), which is what
    kept live frames seconds apart. Not live: one figure drawn in full, fitted to the data.
    """

    def __init__(self, shape: _Shape, *, live: bool = False, dpi: int = 80) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure  # lazy: importing labkit.monitor loads none

        self.shape, self.live = shape, live
        n = max(1, len(shape.metrics) + (1 if shape.ranks else 0))
        height = (BOTTOM_IN + n * PANEL_IN + (n - 1) * GAP_IN + TOP_IN
                  + shape.title_lines * TITLE_LINE_IN)  # fmt: skip
        width = 9.0
        self.fig = fig = Figure(figsize=(width, height), dpi=dpi)
        self.canvas = FigureCanvasAgg(fig)
        fig.subplots_adjust(left=LEFT_IN / width, right=1 - RIGHT_IN / width,
                            bottom=BOTTOM_IN / height,
                            top=1 - (TOP_IN + shape.title_lines * TITLE_LINE_IN) / height,
                            hspace=GAP_IN / PANEL_IN)  # fmt: skip
        self.axes = list(fig.subplots(n, 1, sharex=True, squeeze=False)[:, 0])
        # Animated artists are left out of a full draw and drawn on top of it, each frame.
        moving = {"animated": live}
        self.lines: list[dict[str, Any]] = []  # per metric panel: source -> Line2D
        self.notes: list[Any] = []  # per metric panel: the note of an empty panel
        self.ticks: list[dict[int, Any]] = []  # per metric panel: rank -> LineCollection
        for ax, metric, sources in zip(self.axes, shape.metrics, shape.sources, strict=False):
            lines = {}
            for source in sources:
                (lines[source],) = ax.plot([], [], marker=".", markersize=3, linewidth=1.2,
                                           label=source, **_source_style(source), **moving)  # fmt: skip
            self.lines.append(lines)
            self.notes.append(ax.text(0.5, 0.5, "", ha="center", va="center", color="grey",
                                      transform=ax.transAxes))  # fmt: skip
            # Each rank's steps as short ticks along the top edge, in the rank's colour.
            self.ticks.append({r: ax.vlines([], 0.9, 1.0, transform=ax.get_xaxis_transform(),
                                            colors=_color(r), linewidth=0.8, alpha=0.7,
                                            **moving)
                               for r in shape.ranks})  # fmt: skip
            unit = METRICS[metric].unit if metric in METRICS else ""
            ax.set_ylabel(f"{metric}\n({unit})" if unit else metric, fontsize=8)
            if len(lines) > 1:
                ax.legend(fontsize=7, loc="upper left", ncol=min(len(lines), 6), framealpha=0.6)
        self.step_lines: dict[int, Any] = {}
        if shape.ranks:
            ax = self.axes[len(shape.metrics)]
            for rank in shape.ranks:
                (self.step_lines[rank],) = ax.plot([], [], marker=".", markersize=3,
                                                   linewidth=1.0, color=_color(rank),
                                                   label=f"rank{rank}", drawstyle="steps-post",
                                                   **moving)  # fmt: skip
            ax.set_ylabel("step", fontsize=8)
            # Lower right: the step lines climb from the lower left, and the part names
            # hang from the top.
            ax.legend(fontsize=7, loc="lower right", ncol=min(len(shape.ranks), 6),
                      framealpha=0.6)  # fmt: skip
        for ax in self.axes:
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.25)
            if shape.recording:  # beside the title's "recording of <hardware> on <date>"
                ax.text(0.995, 0.04, "recording", ha="right", va="bottom", fontsize=7,
                        color="#b22222", transform=ax.transAxes)  # fmt: skip
        self.axes[-1].set_xlabel("seconds since start", fontsize=8)
        self.title = fig.suptitle("", fontsize=9, y=1 - TOP_IN / 2 / height, va="top", **moving)
        self.parts: list[PartEvent] = []  # parts marked so far
        self.part_marks: list[Any] = []  # their lines and names
        self._background: Any = None  # the last full draw, without the animated artists
        self._background_key: tuple | None = None  # what that draw showed besides them
        self._limits_set = False  # a live figure's limits then only grow
        self.full_draws = 0  # frames drawn in full (the others redrew only what moved)

    def update(
        self,
        samples: Sequence[Sample],
        steps: Sequence[StepEvent],
        parts: Sequence[PartEvent],
        *,
        title: str,
        t0: float,
        kind: str,
        waiting: str | None,
    ) -> None:
        """Show these samples, steps and parts: move the lines, rescale the axes."""
        xs_seen: list[float] = []
        by_rank: dict[int, list[StepEvent]] = {}
        for e in steps:
            by_rank.setdefault(e.rank, []).append(e)
        for i, metric in enumerate(self.shape.metrics):
            top = 0.0
            for source, line in self.lines[i].items():
                xs, ys = series(samples, source, metric, t0)
                line.set_data(xs, ys)
                xs_seen += xs[:1] + xs[-1:]
                top = max([top, *(y for y in ys if not math.isnan(y))])
            empty = not self.lines[i]
            self.notes[i].set_text(empty_panel_note(samples, metric, kind, waiting) if empty
                                   else "")  # fmt: skip
            for rank, ticks in self.ticks[i].items():
                ticks.set_segments([[(e.time_s - t0, 0.9), (e.time_s - t0, 1.0)]
                                    for e in by_rank.get(rank, [])[-MAX_TICKS:]])  # fmt: skip
            # Every metric here is >= 0, and an axis cropped to the data exaggerates small
            # changes; the headroom keeps lines clear of the step ticks along the top.
            self._set_top(self.axes[i], top * 1.15 if top > 0 else 1.0)
        top_step = 0
        for rank, line in self.step_lines.items():
            events = by_rank.get(rank, [])
            line.set_data([e.time_s - t0 for e in events], [e.step for e in events])
            xs_seen += [e.time_s - t0 for e in events[:1] + events[-1:]]
            top_step = max([top_step, *(e.step for e in events)])
        if self.step_lines:
            self._set_top(self.axes[len(self.shape.metrics)], max(top_step, 1) * 1.1)
        self._mark_parts(parts, t0)
        xs_seen += [p.time_s - t0 for p in self.parts]
        self._set_x(xs_seen)
        self.title.set_text(title)
        self._limits_set = True

    def _set_top(self, ax: Any, top: float) -> None:
        if self.live:  # grows only, in nice steps: most frames keep the same axes
            top = _nice_ceil(top)
            if self._limits_set:
                top = max(top, ax.get_ylim()[1])
        ax.set_ylim(0, top)

    def _set_x(self, xs: Sequence[float]) -> None:
        lo, hi = (min(xs), max(xs)) if xs else (0.0, 1.0)
        if self.live:  # from the first point to a nice span beyond the last, growing only
            span = _nice_ceil(max(hi - lo, 1.0) * 1.02)
            if self._limits_set:
                span = max(span, self.axes[0].get_xlim()[1] - lo)
            hi = lo + span
        pad = 0.02 * (hi - lo) if hi > lo else 0.5
        self.axes[0].set_xlim(lo - pad, hi if self.live else hi + pad)  # shared by all panels

    def _mark_parts(self, parts: Sequence[PartEvent], t0: float) -> None:
        """A dotted line across every panel where each part began, named on the step panel
        (or the last panel): e.g. where each data-parallel strategy starts in notebook 02."""
        for part in parts[len(self.parts) :]:
            x = part.time_s - t0
            for ax in self.axes:
                self.part_marks.append(ax.axvline(x, color="0.55", linestyle=":",
                                                  linewidth=0.9, animated=self.live))  # fmt: skip
            ax = self.axes[-1]
            self.part_marks.append(ax.annotate(
                part.part, (x, 0.97), xycoords=ax.get_xaxis_transform(), xytext=(2, 0),
                textcoords="offset points", rotation=90, ha="left", va="top", fontsize=6.5,
                color="0.3", animated=self.live,
                bbox={"facecolor": "white", "alpha": 0.75, "edgecolor": "none", "pad": 0.5},
            ))  # the box keeps the name readable where the step line runs behind it
            self.parts.append(part)

    def png(self) -> bytes:
        """The figure as PNG bytes; a live frame redraws only what moved since the last one."""
        if not self.live:
            return figure_png(self.fig, dpi=int(self.fig.dpi))
        key = (self.axes[0].get_xlim(), tuple(ax.get_ylim() for ax in self.axes),
               tuple(t.get_text() for t in self.notes))  # fmt: skip
        if key != self._background_key:
            self.canvas.draw()  # everything but the animated artists
            self.full_draws += 1
            self._background = self.canvas.copy_from_bbox(self.fig.bbox)
            self._background_key = key
        else:
            self.canvas.restore_region(self._background)
        for artist in self._moving():
            self.fig.draw_artist(artist)
        return _png_of_canvas(self.canvas)

    def _moving(self) -> list[Any]:
        ticks = [t for per_rank in self.ticks for t in per_rank.values()]
        lines = [ln for per_source in self.lines for ln in per_source.values()]
        return [*self.part_marks, *ticks, *lines, *self.step_lines.values(), self.title]


_NICE = (1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0)


def _nice_ceil(v: float) -> float:
    """The smallest of 1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8 times a power of ten that is >= v:
    a live axis grows by at most a third at a time, and rarely."""
    if not v > 0 or math.isinf(v):
        return 1.0
    scale = 10.0 ** math.floor(math.log10(v))
    return next(m * scale for m in _NICE if m * scale >= v * (1 - 1e-12))


def _png_of_canvas(canvas: Any) -> bytes:
    """PNG bytes of what the Agg canvas holds now (without drawing it again)."""
    from PIL import Image  # matplotlib depends on Pillow

    width, height = canvas.get_width_height()
    image = Image.frombuffer("RGBA", (width, height), canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
    buf = io.BytesIO()
    image.save(buf, format="png", compress_level=1)  # see figure_png
    return buf.getvalue()


def build_figure(
    samples: Sequence[Sample],
    steps: Sequence[StepEvent],
    metrics: Sequence[str],
    *,
    title: str,
    t0: float = 0.0,
    recording: bool = False,
    parts: Sequence[PartEvent] = (),
    kind: str = "",
    waiting: str | None = WAITING_SAMPLE,
) -> Any:
    """A matplotlib ``Figure`` (not registered with pyplot): one panel per metric, one line per
    source, step ticks per rank on top of every panel, and a step-vs-time panel.

    x is seconds since ``t0``. ``recording`` marks every panel "recording", beside the title's
    "recording of <hardware> on <date>": replayed numbers are never mistaken for live ones.
    ``parts`` are marked where each began. A panel without a line says why
    (``empty_panel_note``: ``kind`` is the backend's, ``waiting`` what to say before its
    sources are sampled, None once the run is over).
    """
    plot = _Plot(_shape(samples, steps, metrics, title, recording))
    plot.update(samples, steps, parts, title=title, t0=t0, kind=kind, waiting=waiting)
    return plot.fig


def figure_png(fig: Any, dpi: int = 80) -> bytes:
    """PNG bytes of ``fig`` through the Agg canvas (no GUI, no pyplot).

    zlib level 1: live frames are encoded often, and at level 6 (the default) the same
    frame is barely smaller.
    """
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, pil_kwargs={"compress_level": 1})
    return buf.getvalue()


# --- live or headless ------------------------------------------------------------------------


def _in_kernel() -> bool:
    """True inside a Jupyter kernel (not a terminal IPython, not plain Python)."""
    if "IPython" not in sys.modules:  # never imported: certainly not in IPython
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _headless_executor() -> str | None:
    """The headless notebook runner that started this kernel, if one did.

    Only the direct parent counts (and its parent when that is a shell wrapper): a JupyterLab
    server started *from* a test still serves a live browser, and must get live plots.
    """
    import psutil

    try:
        proc = psutil.Process().parent()
        for _ in range(2):
            if proc is None:
                return None
            # The program: the executable, its script or `-m` module (later arguments may
            # be paths such as /tmp/pytest-of-.../ that say nothing about the runner).
            program = [os.path.basename(a) for a in proc.cmdline()[:3]]
            for name in HEADLESS_EXECUTORS:
                if any(name in word for word in program):
                    return name
            # A pytest-xdist worker is `python -c <execnet bootstrap>`; it sets
            # PYTEST_XDIST_WORKER after it starts, so only its children's environment has it.
            if (proc.name().startswith("python") and "-c" in proc.cmdline()[1:3]
                    and "PYTEST_XDIST_WORKER" in os.environ):  # fmt: skip
                return "pytest-xdist"
            if proc.name() not in ("sh", "bash", "dash", "zsh"):
                return None
            proc = proc.parent()
    except psutil.Error:
        return None
    return None


def live_default() -> tuple[bool, str]:
    """(live?, why): whether a Monitor redraws under the cell while it runs.

    ``LABKIT_LIVE_PLOTS=1`` or ``0`` decides; unset or ``auto``: live in a Jupyter kernel that
    no headless executor started (see ``HEADLESS_EXECUTORS``), headless everywhere else.
    """
    value = os.environ.get(LIVE_ENV, "auto").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True, f"{LIVE_ENV}={value}"
    if value in ("0", "false", "no", "off"):
        return False, f"{LIVE_ENV}={value}"
    if value not in ("", "auto"):
        raise ValueError(f"{LIVE_ENV}={value!r}: use 1 (live plots), 0 (headless) or auto")
    if not _in_kernel():
        return False, "not in a Jupyter kernel"
    runner = _headless_executor()
    if runner:
        return False, f"kernel started by {runner} (headless)"
    return True, "Jupyter kernel"


def _display(bundle: Bundle, *, display_id: bool = False) -> Any:
    """Show a MIME bundle under the cell; returns a display handle if ``display_id``.

    Outside IPython it prints the bundle's text (a script sees the table and the title).
    Tests replace this function to count what is shown.
    """
    if "IPython" in sys.modules:
        from IPython import get_ipython
        from IPython.display import display

        if get_ipython() is not None:
            return display(bundle, raw=True, display_id=True if display_id else None)
    print(bundle.get("text/plain", ""))
    return None


def _display_publisher() -> Any | None:
    """The kernel's display publisher when it takes message hooks (ipykernel's
    ``ZMQDisplayPublisher.register_hook``), else None. Tests replace this function."""
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython

    publisher = getattr(get_ipython(), "display_pub", None)
    return publisher if hasattr(publisher, "register_hook") else None


class _ClearWatch:
    """Counts ``IPython.display.clear_output()`` calls while a live figure is shown.

    A clear removes every output of the cell, the live figure with them, and the frontend
    forgets their display ids: JupyterLab's ``OutputArea._clear`` empties its display-id map
    (jupyterlab, packages/outputarea/src/widget.ts), nbclient's ``clear_display_id_mapping``
    does the same. Updates of the live handle then change nothing shown, and the final
    figure, sent as one more update, would never appear. ipykernel passes every message a
    thread publishes, ``clear_output`` included, through the hooks that thread registered
    (ipykernel/zmqshell.py), so the cell's thread (where ``launch.run`` and a ``with`` block
    run) sees its clears here. A clear from another thread is not seen.
    """

    def __init__(self, publisher: Any) -> None:
        self.clears = 0
        self._publisher = publisher
        publisher.register_hook(self)

    def __call__(self, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("header", {}).get("msg_type") == "clear_output":
            self.clears += 1
        return msg  # every message is sent on, unchanged

    def close(self) -> None:
        """Unregister (once; from the thread that registered, as the hooks are per thread)."""
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            publisher.unregister_hook(self)


# --- the monitor -------------------------------------------------------------------------------


class Monitor:
    """Samples hardware metrics while a job or a block of code runs, and plots them.

    Args:
        period_s: seconds between samples (>= 0.1; 1 s matches nvidia-smi dmon and NVML's
            own averaging windows).
        backend: None or "auto" (NVML if it sees a GPU, else the CPU with the reason shown),
            "cpu", "nvml", or a ``labkit.metrics`` Backend instance (e.g. a ``ReplayBackend``
            to show a recording). An instance is used as given: a CPU backend built without
            ``pids_fn`` sees only the host.
        metrics: metric names to draw (see ``labkit.metrics.metric_table()``); default: a
            set per backend kind (``DEFAULT_METRICS``).
        live: redraw under the cell while running; None: ``live_default()``.
        title: first line of the figure's title; default: the job's module (or "this
            kernel's process", or "replay").
        redraw_s: at least this many seconds between live redraws; None: a redraw with each
            new sample, as long as drawing takes at most ``RENDER_SHARE`` of one core.
        total_steps: for the ``with`` form, the step count shown as "step k/n".
        record_to: also write every sample and step event to this trace file
            (``labkit.metrics.replay`` format), so the run can be replayed, labelled, where
            there is no GPU. Only NVML readings are recorded: on any other backend the run
            fails to start with a ValueError.
        record_notes: what ran, stored in the recording's metadata.
        clock: seconds, monotonic; stamps samples and step events. A fake in tests.
    """

    def __init__(
        self,
        period_s: float = 1.0,
        *,
        backend: str | Backend | None = None,
        metrics: Sequence[str] | None = None,
        live: bool | None = None,
        title: str | None = None,
        redraw_s: float | None = None,
        total_steps: int | None = None,
        record_to: str | Path | None = None,
        record_notes: str = "",
        clock: Clock = time.monotonic,
    ) -> None:
        named = isinstance(backend, str) and backend in ("auto", "cpu", "nvml")
        if not (backend is None or named or isinstance(backend, Backend)):
            raise ValueError(f"backend={backend!r}: use None, 'auto', 'cpu', 'nvml' or a "
                             "labkit.metrics Backend instance")  # fmt: skip
        if metrics is not None:
            unknown = [m for m in metrics if m not in METRICS]
            if isinstance(metrics, str) or unknown:
                raise ValueError(f"metrics={metrics!r}: pass a list of names from "
                                 f"labkit.metrics.METRICS; unknown: {unknown}")  # fmt: skip
        if redraw_s is not None and (
            isinstance(redraw_s, bool) or not isinstance(redraw_s, (int, float)) or redraw_s < 0
        ):
            raise ValueError(f"redraw_s={redraw_s!r}: need seconds >= 0, or None")
        self.period_s = clamp_period(period_s)  # a bad value fails here, not at the launch
        self.backend_spec, self.metrics = backend, metrics
        self.live = live_default()[0] if live is None else bool(live)
        self.title, self.total_steps = title, total_steps
        self.redraw_s = 0.0 if redraw_s is None else float(redraw_s)
        self.record_to = None if record_to is None else Path(record_to)
        self.record_notes = record_notes
        self.recorder: Recorder | None = None
        self.clock = clock
        self.sampler: Sampler | None = None
        # "idle", "running", then "ok", "failed", "timeout", "interrupted" or "error: <type>"
        self.status = "idle"
        self._steps: list[StepEvent] = []
        self._last_step: dict[int, int] = {}
        self._parts: list[PartEvent] = []
        self._last_part: dict[int, str] = {}  # rank -> the part its last heartbeat named
        self._lock = threading.Lock()  # guards _steps (the sampler thread reads them to draw)
        self._render_lock = threading.Lock()
        self._handle: Any = None
        self._clear_watch: _ClearWatch | None = None  # live runs in a kernel (see the class)
        self._t0 = 0.0
        self._wall_offset = 0.0  # time.time() - clock(): turns heartbeat stamps into our clock
        self._last_draw: float | None = None
        self._drawn: tuple[int, int, int] | None = None  # (samples, steps, parts) drawn last
        self._render_cpu_s = 0.0  # CPU seconds the last live frame took
        self._plot: _Plot | None = None  # the live figure, updated in place
        self._module: str | None = None
        self._progress: Callable[[], tuple[int | None, int | None]] | None = None
        self._in_with = False
        self._described: str | None = None  # describe() kept when the backend is closed
        self.redraws = 0  # live redraws so far (the final figure not counted)

    # -- results ------------------------------------------------------------------------------

    @property
    def samples(self) -> list[Sample]:
        """Every sample of the last run, oldest first."""
        return self.sampler.samples if self.sampler is not None else []

    @property
    def steps(self) -> list[StepEvent]:
        """Every step event seen, in order."""
        with self._lock:
            return list(self._steps)

    @property
    def parts(self) -> list[PartEvent]:
        """Where each named part of the job began (see ``PartEvent``), in order."""
        with self._lock:
            return list(self._parts)

    @property
    def kind(self) -> str:
        """The backend kind: "nvml", "cpu" or "replay" ("" before the first run)."""
        return self.sampler.backend.kind if self.sampler is not None else ""

    def describe(self) -> str:
        """The backend's one-line description (hardware, or why no GPU, or the recording)."""
        if self._described is not None:  # the run is over: as it read while the backend was open
            return self._described
        return self.sampler.describe() if self.sampler is not None else "not started"

    def shown_metrics(self) -> list[str]:
        return metrics_to_show(self.samples, self.kind, self.metrics)

    def summary(self) -> Summary:
        """Mean / max per metric and source, the run's status and each rank's last step."""
        return summarize(self.samples, self.shown_metrics(), describe=self.describe(),
                         status=self.status, last_step=self._last_step)  # fmt: skip

    def figure(self) -> Any:
        """The current figure as a new matplotlib ``Figure`` (``.savefig(path)`` to keep it)."""
        self._sync_replay_steps()
        return build_figure(self.samples, self.steps, self.shown_metrics(), **self._drawing())

    # -- launcher observer (labkit.jobs.launch.run(..., observers=[mon])) --------------------------

    def on_start(self, job: Any) -> None:
        """The launcher started ``job``: sample its ranks' processes (``job.rank_pids()``)."""
        if self._in_with:
            raise RuntimeError("Monitor is already watching a `with` block; use a second "
                               "Monitor for the launched job")  # fmt: skip
        self._module, self._progress = job.module, job.progress
        try:
            self._begin(job.rank_pids, thread=False, job_device=getattr(job, "device", None))
        except BaseException:
            self._stop_sampler()  # the launcher drops us without on_end: leave nothing open
            raise

    def on_tick(self, job: Any) -> None:
        """Every ~0.25 s from the launcher's loop: sample if due, note steps, maybe redraw."""
        try:
            self._note_heartbeats(job.heartbeats)
            if self.sampler is not None:
                self.sampler.poll_due()
            self._maybe_redraw()
        except BaseException:
            # The launcher drops an observer that raises and never calls its on_end: stop now.
            self._stop_sampler()
            raise

    def on_end(self, job: Any, result: Any) -> None:
        """The job is over (any outcome): stop sampling, show the final figure and table."""
        try:
            # The launcher may stop ticking before it read the ranks' last heartbeats (the job
            # exited between two ticks): read them from the job directory once more.
            beats = job.heartbeats
            if getattr(job, "job_dir", None) is not None:
                from labkit.jobs import (
                    runtime,  # the launcher's on-disk protocol; loaded with launch
                )

                beats = runtime.read_heartbeats(job.job_dir, job.nproc) or beats
            self._note_heartbeats(beats)
        finally:
            self._finish(getattr(result, "status", "ok"))

    # -- single-process code in the kernel (`with Monitor() as mon:`) ---------------------------

    def __enter__(self) -> Monitor:
        self._module, self._progress = None, None
        self._in_with = True
        try:
            self._begin(lambda: {0: os.getpid()}, thread=True)
        except BaseException:  # __exit__ will not run: stop the thread here
            self._in_with = False
            self._stop_sampler()
            raise
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self._in_with = False
        if exc_type is None:
            status = "ok"
        elif issubclass(exc_type, KeyboardInterrupt):
            status = "interrupted"
        else:
            status = f"error: {exc_type.__name__}"
        self._finish(status)  # the exception, if any, propagates after this

    def step(self, step: int, *, rank: int = 0, total: int | None = None) -> None:
        """Record that ``rank`` reached ``step`` now (the ``with`` form's step events)."""
        if total is not None:
            self.total_steps = total
        self._add_step(rank, int(step), self.clock())

    def part(self, name: str) -> None:
        """Mark that a named part of the work begins now (the ``with`` form's part marks):
        a dotted line across the panels, named on the step panel, as a job's parts are."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"name={name!r}: give the part a non-empty name")
        with self._lock:
            self._parts.append(PartEvent(name, self.clock()))

    def on_step(self, step: int, stats: Any = None) -> None:
        """``labkit.train.train(..., on_step=mon.on_step)``: one step event per step."""
        self.step(step)

    def chain(self, *callbacks: Callable[[int, Any], Any]) -> Callable[[int, Any], None]:
        """One ``on_step`` callback that records the step here, then calls ``callbacks``:
        ``train(..., on_step=mon.chain(train.Progress(steps)))``."""

        def on_step(step: int, stats: Any = None) -> None:
            self.on_step(step, stats)
            for fn in callbacks:
                fn(step, stats)

        return on_step

    # -- internals ----------------------------------------------------------------------------

    def _make_backend(
        self, pids_fn: Callable[[], dict[int, int]], job_device: str | None = None
    ) -> Backend:
        spec = self.backend_spec
        if isinstance(spec, Backend):
            return spec
        if spec == "cpu":
            return CpuBackend(pids_fn, clock=self.clock)
        if spec == "nvml":
            return NvmlBackend(pids_fn, clock=self.clock)  # opened by the sampler: errors rise
        backend = auto_backend(pids_fn, clock=self.clock)
        if job_device == "cpu" and backend.kind == "nvml":
            # A GPU is here but the job's ranks run on the CPU (more ranks than GPUs): an idle
            # GPU's readings would hide what the ranks do, so show the ranks, and say why.
            note = f"this job's ranks run on the CPU over gloo, not on the {backend.hardware}"
            backend.close()
            return CpuBackend(pids_fn, note=note, clock=self.clock)
        return backend

    def _begin(
        self, pids_fn: Callable[[], dict[int, int]], *, thread: bool, job_device: str | None = None
    ) -> None:
        self._stop_sampler()  # a Monitor reused for a second run starts afresh
        with self._lock:
            self._steps, self._last_step, self._parts, self._last_part = [], {}, [], {}
        self.status, self._handle, self._last_draw, self.redraws = "running", None, None, 0
        self._plot, self._drawn, self._clear_watch = None, None, None
        self._described = None
        backend = self._make_backend(pids_fn, job_device)
        self.sampler = Sampler(backend, self.period_s, clock=self.clock,
                               on_sample=self._on_sample if thread or self.record_to else None)  # fmt: skip
        offline = self._offline_replay()
        self._t0 = 0.0 if offline else self.clock()  # an offline replay keeps recorded times
        self._wall_offset = time.time() - self.clock()
        self.recorder = self._make_recorder(backend)
        # Open first, so a backend that cannot run fails here, before anything is displayed.
        if offline:
            backend.open()  # reads the trace; it is played in full at the end
        elif thread:
            self.sampler.start()
        else:
            self.sampler.poll_once()
        if self.live:  # the sampler thread skips redraws until the handle exists
            publisher = _display_publisher()
            self._clear_watch = _ClearWatch(publisher) if publisher is not None else None
            self._handle = _display(self._text_bundle(f"{self._waiting()}…"), display_id=True)

    def _make_recorder(self, backend: Backend) -> Recorder | None:
        """The Recorder for ``record_to``, opened (so a machine without a GPU fails here)."""
        if self.record_to is None:
            return None
        if backend.kind != "nvml":
            reason = getattr(backend, "reason", "") or backend.describe()
            raise ValueError(f"record_to={str(self.record_to)!r}: a recording holds real GPU "
                             f"readings from NVML, but this monitor reads the {backend.kind!r} "
                             f"backend ({reason}); record on a machine with an NVIDIA GPU, "
                             "or drop record_to")  # fmt: skip
        recorder = Recorder(self.record_to, backend, notes=self.record_notes,
                            period_s=self.period_s, t0=self._t0)  # fmt: skip
        recorder.open()  # opens the backend: no driver raises BackendUnavailable here
        return recorder

    def _on_sample(self, samples: list[Sample]) -> None:
        """Each sampler tick: record it (``record_to``), then maybe redraw (``with`` form)."""
        self._record(lambda recorder: recorder.write(samples))
        if self._in_with:
            self._maybe_redraw()

    def _record(self, write: Callable[[Recorder], None]) -> None:
        """``write(recorder)`` if recording; a failure ends the recording, never the run."""
        recorder = self.recorder
        if recorder is None:
            return
        try:
            write(recorder)
        except (OSError, ValueError, RuntimeError) as e:  # disk full, recorder closed, ...
            warnings.warn(f"labkit monitor: recording to {self.record_to} stopped: {e}",
                          stacklevel=3)  # fmt: skip
            self._close_recorder()

    def _sync_replay_steps(self) -> None:
        """A replay's step events are part of the recording: show those played so far."""
        backend = self.sampler.backend if self.sampler is not None else None
        if not isinstance(backend, ReplayBackend) or backend.trace is None:
            return
        events = [StepEvent(e.rank, e.step, e.time_s) for e in backend.steps()]
        with self._lock:
            self._steps = events
            self._last_step = {e.rank: e.step for e in events}

    def _offline_replay(self) -> bool:
        b = self.sampler.backend if self.sampler is not None else self.backend_spec
        return isinstance(b, ReplayBackend) and not b.realtime

    def _note_heartbeats(self, beats: Mapping[int, Mapping[str, Any]]) -> None:
        for rank, beat in dict(beats).items():
            stamp = beat.get("time")
            t = stamp - self._wall_offset if isinstance(stamp, (int, float)) else self.clock()
            self._note_parts(int(rank), beat, t)
            step = beat.get("step")
            if isinstance(step, int) and self._last_step.get(rank) != step:
                self._add_step(int(rank), step, t)

    def _note_parts(self, rank: int, beat: Mapping[str, Any], t: float) -> None:
        """The part ``rank`` is in, and each part's start (as the first rank read reports it).

        A heartbeat lists every part begun, with its time (``labkit.jobs.runtime``): a part shorter
        than a supervision tick is still marked, where it began. Without that list, the
        part's start is taken as the time of the first heartbeat naming it.
        """
        part = beat.get("part")
        if not isinstance(part, str):
            return
        begun = [(p[0], p[1]) for p in beat.get("parts") or []
                 if isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                 and isinstance(p[1], (int, float))]  # fmt: skip
        with self._lock:
            self._last_part[rank] = part
            known = {p.part for p in self._parts}
            for name, stamp in begun or [(part, t + self._wall_offset)]:
                if name not in known:
                    known.add(name)
                    self._parts.append(PartEvent(name, stamp - self._wall_offset))

    def _add_step(self, rank: int, step: int, t: float) -> None:
        with self._lock:
            self._steps.append(StepEvent(rank, step, t))
            self._last_step[rank] = step
        self._record(lambda recorder: recorder.step(step, t, rank=rank))

    def _stop_sampler(self) -> None:
        try:
            if self.sampler is not None:
                self.sampler.stop()
        finally:
            self._close_recorder()
            if self._clear_watch is not None:  # its count stays readable for _finish
                self._clear_watch.close()

    def _cleared(self) -> bool:
        """True once ``clear_output()`` was called in the cell since the live figure was shown."""
        return self._clear_watch is not None and self._clear_watch.clears > 0

    def _close_recorder(self) -> None:
        recorder, self.recorder = self.recorder, None
        if recorder is not None:
            recorder.close()

    def _finish(self, status: str) -> None:
        """Stop sampling (always), then the final figure and the summary table."""
        try:
            if self.sampler is not None and self._offline_replay():
                self._play_rest()
            self._sync_replay_steps()
            # Closing a backend forgets its hardware (NVML handles, the trace): describe first.
            self._described = self.describe()
        finally:
            self._stop_sampler()
        self.status = status
        with self._render_lock:  # a redraw in the sampler thread may still be finishing
            final = self._figure_bundle()
        if self._handle is not None and not self._cleared():
            self._handle.update(final, raw=True)  # the live figure becomes the final one
        else:
            if self._handle is not None:
                # Cleared: the live figure is gone, and an update of its handle would show
                # nothing (see _ClearWatch), so the final figure is displayed afresh. The
                # handle is blanked first, in case the clear did not reach it (a clear inside
                # an output widget): one figure either way.
                self._handle.update({"text/plain": ""}, raw=True)
            _display(final)
        summary = self.summary()
        _display({"text/plain": str(summary), "text/html": summary._repr_html_()})

    def _play_rest(self) -> None:
        """A replay played tick by tick (``realtime=False``): read every remaining tick."""
        assert self.sampler is not None
        backend = self.sampler.backend
        assert isinstance(backend, ReplayBackend)
        for _ in range(1_000_000):  # bounded: a trace far longer than this is not a lab trace
            self.sampler.poll_once()
            if backend.finished or self.sampler.state == "failed":
                break

    def _maybe_redraw(self) -> None:
        """Redraw the live figure when there is something new to show, at most once per
        ``redraw_s``, and so that drawing takes at most ``RENDER_SHARE`` of one core."""
        if not self.live or self._handle is None or self._cleared():
            return  # after a clear the live figure is gone: drawing it is wasted (_ClearWatch)
        now = self.clock()
        shown = (len(self.samples), len(self.steps), len(self.parts))
        if self._last_draw is not None:
            wait = max(self.redraw_s, self._render_cpu_s / RENDER_SHARE)
            if shown == self._drawn or now - self._last_draw < wait:
                return
        if not self._render_lock.acquire(blocking=False):
            return  # the other thread is drawing: skip this turn
        try:
            # CPU time of this thread, not wall time: on a busy machine a frame's wall time
            # is mostly waiting for a core, and it is our share of the cores that is budgeted.
            started = time.thread_time()
            bundle = self._figure_bundle()
            self._handle.update(bundle, raw=True)
            self._render_cpu_s = time.thread_time() - started
            self._last_draw, self._drawn = now, shown
            self.redraws += 1
        finally:
            self._render_lock.release()

    def _title(self) -> str:
        default = "replay" if self.kind == "replay" else "this kernel's process"
        head = self.title or self._module or default
        step, rank = None, None
        if self._last_step:  # a launched job moves at its slowest rank's pace
            pick = min if self._progress else max
            rank = pick(sorted(self._last_step), key=self._last_step.__getitem__)
            step = self._last_step[rank]
        total = self._progress()[1] if self._progress else self.total_steps
        if step is not None:
            head += f" — step {step}" + (f"/{total}" if total else "")
        # The part the slowest rank is in (before any step: the first rank to name one).
        part = self._last_part.get(rank) if rank is not None else None
        if part is None and self._last_part:
            part = self._last_part[min(self._last_part)]
        if part and self.status == "running":
            head += f" — {part}"
        if self.status != "running":
            head += f" — {self.status}"
        body = textwrap.fill(self.describe(), width=110, break_on_hyphens=False)
        return f"{head}\n{body}"

    def _waiting(self) -> str:
        """What panels say before their sources are sampled: a launched job's ranks take
        seconds to start (importing torch), and "N/A" would say they are never reported."""
        return WAITING_RANKS if self._progress is not None else WAITING_SAMPLE

    def _drawing(self) -> dict[str, Any]:
        """Everything but the data that a figure of this run is drawn with."""
        return {"title": self._title(), "t0": self._t0, "recording": self.kind == "replay",
                "parts": self.parts, "kind": self.kind,
                "waiting": self._waiting() if self.status == "running" else None}  # fmt: skip

    def _figure_bundle(self) -> Bundle:
        """The figure as shown under the cell: the live figure, moved to the latest data (a
        new one only when panels, lines or ranks changed)."""
        self._sync_replay_steps()
        samples, steps, metrics = self.samples, self.steps, self.shown_metrics()
        drawing = self._drawing()
        shape = _shape(samples, steps, metrics, drawing["title"], drawing["recording"])
        live = self.status == "running"  # the final figure is drawn in full, fitted
        if self._plot is None or self._plot.shape != shape or self._plot.live != live:
            self._plot = _Plot(shape, live=live)
        del drawing["recording"]
        self._plot.update(samples, steps, **drawing)
        png = self._plot.png()
        return {"image/png": png, "text/plain": f"<labkit monitor figure: {drawing['title']}>"}

    def _text_bundle(self, text: str) -> Bundle:
        return {"text/plain": f"labkit monitor: {self.describe()}; {text}"}

    def __repr__(self) -> str:
        return (f"<Monitor {self.status}, every {self.period_s} s, {len(self.samples)} samples, "
                f"{'live' if self.live else 'headless'}: {self.describe()}>")  # fmt: skip
