"""The roofline of *this* machine: measured ceilings, and measured kernels placed under them.

The roofline model (Williams, Waterman and Patterson, CACM 52(4), 2009; jax-ml/scaling-book
``roofline.md``) bounds a kernel's speed by two ceilings of the device:

    attainable FLOP/s = min(peak FLOP/s, I × memory bandwidth),   I = FLOPs / bytes moved

Every roof here is **measured** on the device at hand, and a :class:`Roofline` refuses
anything else; a datasheet figure is drawn beside the roof, never as it. A kernel's time is
measured; its FLOPs and bytes are *modelled* (counted from its shapes), and the figure says
which is which. Also here, for comparing precisions: matmul throughput per precision and size
(with tf32 on CUDA only), and what a CPU's flags say about its bf16 and fp16 arithmetic.

Measurement apart from display, one short module each:

    precisions  the four precisions a matmul runs in; the TF32 switch (tf32_matmuls)
    model       Ceiling, Roofline, Point, attainable, arithmetic_intensity, matmul_traffic:
                the arithmetic, no measuring
    ceilings    measure_compute_ceiling, measure_bandwidth_ceiling, measure_roofline, and
                published_ceilings (datasheet references)
    sweep       matmul_sweep: fp32, tf32, bf16, fp16 matmuls timed over sizes
    cpu         cpu_precision_support: a CPU's bf16/fp16 instructions, from its flags
    plot        plot_roofline, plot_sweep: the figures (matplotlib imported only when drawing)
    placed      place_kernels: the sweep's matmuls and an elementwise kernel on the roof, told

What notebooks and tests call is importable from here: ``from labkit import roofline;
roofline.measure_roofline("cpu")``. Importing this package measures nothing, touches no GPU
and imports no plotting library.
"""

from __future__ import annotations

from labkit.roofline.ceilings import (
    device_name,
    measure_bandwidth_ceiling,
    measure_compute_ceiling,
    measure_roofline,
    published_ceilings,
)
from labkit.roofline.cpu import cpu_precision_support
from labkit.roofline.model import (
    BYTES,
    FLOPS,
    Ceiling,
    Point,
    Roofline,
    arithmetic_intensity,
    attainable,
    matmul_traffic,
)
from labkit.roofline.placed import place_kernels
from labkit.roofline.plot import plot_roofline, plot_sweep
from labkit.roofline.precisions import PRECISIONS, precision_name, tf32_matmuls
from labkit.roofline.sweep import MatmulSweep, SweepRow, matmul_sweep

__all__ = [
    "BYTES",
    "FLOPS",
    "PRECISIONS",
    "Ceiling",
    "MatmulSweep",
    "Point",
    "Roofline",
    "SweepRow",
    "arithmetic_intensity",
    "attainable",
    "cpu_precision_support",
    "device_name",
    "matmul_sweep",
    "matmul_traffic",
    "measure_bandwidth_ceiling",
    "measure_compute_ceiling",
    "measure_roofline",
    "place_kernels",
    "plot_roofline",
    "plot_sweep",
    "precision_name",
    "published_ceilings",
    "tf32_matmuls",
]
