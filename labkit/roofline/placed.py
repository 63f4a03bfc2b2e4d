"""Kernels placed on this machine's roofline, and what their places say (notebook 04, section 7).

The sweep's smallest and largest matmul in each precision go on that precision's roof; a
memory-bound kernel, the elementwise product ``c = a * b`` (1 FLOP per element for 3 elements
moved) on arrays well beyond the caches, is timed in fp32 and bf16 and placed on the fp32 roof.
Apart from :mod:`labkit.roofline.plot` because it measures (the elementwise kernel) and chooses
sentences (a point above its roof, the datasheet comparison); the plot only draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from labkit import timing
from labkit.roofline.ceilings import Published, published_ceilings
from labkit.roofline.model import BYTES, Ceiling, Point, Roofline
from labkit.roofline.precisions import storage_dtype
from labkit.roofline.sweep import MatmulSweep


@dataclass(frozen=True)
class PlacedKernels:
    """Measured kernels on a measured roofline, the elementwise product's best times, and the
    datasheet's ceilings where the device is a GPU labkit's tables know."""

    roof: Roofline
    points: tuple[Point, ...]
    n_elem: int
    mul_s: dict[str, float]
    """Best of 5 seconds of the elementwise product, per precision (float32, bfloat16)."""
    published: Published | None

    @property
    def published_ceilings(self) -> tuple[Ceiling, ...]:
        """The datasheet's ceilings to draw beside the roofs (none when not looked up)."""
        return self.published.ceilings if self.published else ()

    def describe(self) -> str:
        """Each point's intensity, bound and share of its roof; a warning for points above
        their roof; the roofs against the datasheet; the elementwise product's two times."""
        lines = [f"{point.name:<36} intensity {point.intensity:7.1f} FLOP/B, {point.bound}-bound, "
                 f"{point.fraction_of_roof:.0%} of the {point.precision} roof (measured / "
                 "attainable)" for point in self.points]
        under = sorted({"memory" if point.bound == "memory" else f"{point.precision} compute"
                        for point in self.points if point.fraction_of_roof > 1.05})
        if under:
            lines.append(
                f"A point above 105% of its roof ({', '.join(under)}): that roof, or the point's "
                "own time, was measured at a busy moment of a shared machine; rerun this cell "
                "before reading the figure. A roof is meant to be the best rate this machine "
                "reaches for that kind of kernel: a point well above it says the roof, not the "
                "kernel, is off.")
        if self.published is not None:  # this GPU against its datasheet, precision by precision
            roof = self.roof
            for pub in self.published.ceilings:
                got = roof.bandwidth if pub.unit == BYTES else next(
                    (c for c in roof.compute if c.precision == pub.precision), None)
                if got is not None:
                    lines.append(f"{pub.precision or 'memory bandwidth'}: measured {got.value:.3g} "
                                 f"{pub.unit}, {got.value / pub.value:.0%} of the published "
                                 f"{pub.value:.3g} ({pub.method})")
            lines.extend(f"no published figure: {reason}" for reason in self.published.reasons)
        mul = self.mul_s
        lines.append(
            f"elementwise a*b of {self.n_elem:,} values, best of 5 (measured): fp32 "
            f"{mul['float32'] * 1e3:.2f} ms, bf16 {mul['bfloat16'] * 1e3:.2f} ms: bf16 moves half "
            f"the bytes and took {mul['bfloat16'] / mul['float32']:.2f}× fp32's time (predicted "
            "0.5 where bandwidth is the limit)")
        return "\n".join(lines)


def place_kernels(roof: Roofline, sweep: MatmulSweep, precisions: Sequence[str],
                  device: torch.device, *, n_elem: int, published: bool = False) -> PlacedKernels:
    """Place the sweep's smallest and largest matmul per precision on ``roof``, time the
    elementwise product on ``n_elem`` values in fp32 and bf16 (best of 5), and place it on the
    fp32 roof: the 16-bit compute roofs are matmuls', and an elementwise op never comes near any
    compute roof. ``published``: look up the datasheet's ceilings for ``roof``'s device."""
    sizes = sorted({r.n for r in sweep.rows})
    points = []
    for p in precisions:
        for n in (sizes[0], sizes[-1]):
            row = sweep.row(p, n)
            points.append(roof.place(f"{p} n={n} (vs {p} roof)", row.flops, row.bytes, row.best_s,
                                     precision=p))
    mul_s = {}
    for p in ("float32", "bfloat16"):
        a, b, c = (torch.randn(n_elem, device=device, dtype=storage_dtype(p)) for _ in range(3))
        # into a preallocated c: a fresh output would add the cost of first touching its pages
        mul_s[p] = min(timing.benchmark(lambda a=a, b=b, c=c: torch.mul(a, b, out=c),
                                        device=device, repeats=5).samples_s)
        points.append(roof.place(f"a*b {p} (vs float32 roof)", n_elem,
                                 3 * n_elem * a.element_size(), mul_s[p], precision="float32"))
        del a, b, c
    found = published_ceilings(roof.device_name, precisions) if published else None
    return PlacedKernels(roof, tuple(points), n_elem, mul_s, found)
