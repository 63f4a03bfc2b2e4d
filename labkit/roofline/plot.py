"""The roofline drawn: measured roofs, their ridge points, kernels placed under them.

Display only: :func:`plot_roofline` draws a ``Roofline`` and the ``Point``s placed on it
(``labkit.roofline.model``), measuring nothing, and says on the figure what was measured and
what modelled. matplotlib is imported when a figure is drawn, not before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from labkit.roofline.model import BYTES, FLOPS, Ceiling, Point, Roofline, format_rate


def _near_before(xy: Sequence[tuple[float, float]], i: int) -> int:
    """How many of the positions before ``xy[i]`` lie within a factor 1.5 of it on both log
    axes: its label moves down one line for each, so labels of near-coincident marks (one
    kernel in two precisions, two precisions' ridges) do not print over each other."""
    x, y = xy[i]
    return sum(1 for u, v in xy[:i] if max(u / x, x / u) < 1.5 and max(v / y, y / v) < 1.5)


def plot_roofline(roofline: Roofline, points: Sequence[Point] = (), ax: Any = None, *,
                  published: Sequence[Ceiling] = ()) -> Any:  # fmt: skip
    """Draw the roofline on log-log axes: each measured roof (solid), its ridge point marked,
    each kernel as a labelled square, datasheet ``published`` ceilings dashed. A caption says
    what was measured and what modelled. Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt  # lazy: importing labkit must stay cheap
    import numpy as np

    if not isinstance(roofline, Roofline):
        raise ValueError(f"roofline must be a Roofline (measure_roofline(device)), got "
                         f"{type(roofline).__name__}")  # fmt: skip
    points = list(points)
    if not all(isinstance(p, Point) for p in points):
        raise ValueError("points must be Point objects: make them with roofline.place(...)")
    if not all(isinstance(c, Ceiling) and c.kind == "published" for c in published):
        raise ValueError("published must hold published Ceilings (published_ceilings(name))")
    others = sorted({c.device_name for c in published} - {roofline.device_name})
    if others:
        raise ValueError(f"published holds figures for {others}, but the roofline is of "
                         f"{roofline.device_name!r}: a datasheet is compared with its own "
                         f"device; use published_ceilings({roofline.device_name!r})")  # fmt: skip
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 5))

    ridges = [roofline.ridge_intensity(p) for p in roofline.precisions]
    xs = ridges + [p.intensity for p in points]
    x = np.logspace(math.log10(min(xs) / 16), math.log10(max(xs) * 16), 200)
    bw = roofline.bandwidth
    ridge_xy = [(r, c.value) for r, c in zip(ridges, roofline.compute, strict=True)]
    for i, (c, ridge) in enumerate(zip(roofline.compute, ridges, strict=True)):
        (line,) = ax.plot(x, np.minimum(c.value, x * bw.value), linewidth=2,
                          label=f"{c.precision} roof: {format_rate(c.value, FLOPS)} (measured)")  # fmt: skip
        ax.plot([ridge], [c.value], "o", color=line.get_color(), markersize=7)
        near = _near_before(ridge_xy, i)
        ax.annotate(f"ridge {ridge:.3g} FLOP/B", (ridge, c.value), textcoords="offset points",
                    xytext=(6, -14 - 10 * near), fontsize=8, color=line.get_color())  # fmt: skip
    ax.plot([], [], " ", label=f"memory slope: {format_rate(bw.value, BYTES)} (measured copy, "
                               "read + write)")  # fmt: skip
    for c in published:
        if c.unit == FLOPS:
            ax.axhline(
                c.value,
                linestyle="--",
                color="grey",
                linewidth=1,
                label=f"{c.precision} {format_rate(c.value, FLOPS)} (datasheet, not measured)",
            )
        else:
            ax.plot(
                x,
                x * c.value,
                linestyle="--",
                color="grey",
                linewidth=1,
                label=f"memory {format_rate(c.value, BYTES)} (datasheet, not measured)",
            )
    for i, p in enumerate(points):
        ax.plot([p.intensity], [p.achieved_flops_per_s], "s", color="black", markersize=5)
        near = _near_before([(q.intensity, q.achieved_flops_per_s) for q in points], i)
        ax.annotate(p.name, (p.intensity, p.achieved_flops_per_s), textcoords="offset points",
                    xytext=(5, 4 - 10 * near), fontsize=8)  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    top = max([c.value for c in (*roofline.compute, *published) if c.unit == FLOPS]
              + [p.achieved_flops_per_s for p in points])  # fmt: skip
    bottom = min([x[0] * bw.value] + [p.achieved_flops_per_s for p in points])
    ax.set_ylim(bottom / 2, top * 30)  # room above the roofs for the legend
    ax.set_xlim(x[0], x[-1])
    ax.set_xlabel("arithmetic intensity (FLOPs per byte moved)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(f"Roofline of {roofline.device_name} ({roofline.device})")
    caption = f"roofs measured on this {roofline.device} at {bw.when}"
    if points:
        caption += "; points: time measured, FLOPs and bytes modelled (counted from shapes)"
    ax.text(0.01, 0.01, caption, transform=ax.transAxes, fontsize=7, va="bottom",
            color="dimgrey")  # fmt: skip
    ax.legend(fontsize=8, loc="upper left")
    return ax


def plot_sweep(sweep: Any, ax: Any = None) -> Any:
    """A :class:`~labkit.roofline.MatmulSweep`: median GFLOP/s against n, one line per precision,
    on log-log axes. Returns the Axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.4))
    sizes = sorted({r.n for r in sweep.rows})
    precisions = list(dict.fromkeys(r.precision for r in sweep.rows))
    for i, p in enumerate(precisions):
        ax.plot(sizes, [sweep.row(p, n).median_flops_per_s / 1e9 for n in sizes], "o-", c=f"C{i}",
                label=p)
    ax.set(xscale="log", yscale="log", xlabel="n (n×n @ n×n)",
           ylabel="GFLOP/s (median, measured)",
           title=f"matmul rate per precision, {sweep.device_name}")
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.legend(fontsize=8)
    return ax
