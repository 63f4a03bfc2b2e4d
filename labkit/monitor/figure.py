"""The monitor's figure: one panel per metric, a line per source, step ticks and a step panel.

Apart from the Monitor (:mod:`labkit.monitor.watch`) because drawing is its own job with its
own cost: a live frame must stay cheap on two busy cores, so :class:`MonitorPlot` makes a figure's
artists once and then only moves their data over a saved picture of the axes (blitting), with
a fixed layout instead of matplotlib's layout solver. :func:`build_figure` draws the same
figure once, in full, for a finished run.

Figures are drawn with matplotlib's object API on the Agg canvas and returned as PNG bytes,
never through ``pyplot``: pyplot figures left open would be shown a second time by the
inline backend at the end of the cell. matplotlib is imported only when a figure is drawn.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from labkit.metrics import METRICS, Sample
from labkit.monitor.records import PartEvent, StepEvent, series, sources_of

MAX_TICKS = 300  # step tick marks drawn per rank; more would be a solid bar anyway


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


def figure_shape(samples: Sequence[Sample], steps: Sequence[StepEvent], metrics: Sequence[str],
           title: str, recording: bool) -> _Shape:  # fmt: skip
    return _Shape(tuple(metrics), tuple(tuple(sources_of(samples, m)) for m in metrics),
                  tuple(sorted({e.rank for e in steps})), title.count("\n") + 1,
                  recording)  # fmt: skip


class MonitorPlot:
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
    plot = MonitorPlot(figure_shape(samples, steps, metrics, title, recording))
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

