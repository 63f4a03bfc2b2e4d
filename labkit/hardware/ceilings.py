"""A measured ceiling: the most FLOP/s ``torch.matmul`` reaches on this device at the shapes a
workload uses, labelled as measured.

Apart from the published peaks (:mod:`labkit.hardware.peaks`) because it is a measurement of
this machine, not a datasheet figure; on a CPU, which has no published peak, it is the only
honest "peak" the course has.

    from labkit import hardware
    print(hardware.measured_matmul_flops(n=512))          # GFLOP/s, measured, best of 10
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from labkit import timing
from labkit.validate import whole

Shape = tuple[int, int, int]  # (m, k, n): an (m×k) @ (k×n) product, 2·m·k·n FLOPs


@dataclass(frozen=True)
class MeasuredFlops:
    """A FLOP/s ceiling measured on this machine (not a published peak): the best that
    ``torch.matmul`` reached over the shapes measured."""

    value: float  # FLOP/s: 2·m·k·n / best_s, for the fastest shape
    dtype: str
    shape: Shape  # the shape that reached ``value``
    device: str
    repeats: int  # timed calls per shape
    best_s: float  # the fastest call of ``shape``, seconds
    median_s: float  # the median call of ``shape``, seconds: how far a typical call was
    threads: int  # torch.get_num_threads() during the measurement
    method: str
    per_shape: tuple[tuple[Shape, float], ...] = ()  # (shape, best FLOP/s) for every shape

    def __str__(self) -> str:
        return f"{self.value / 1e9:.1f} GFLOP/s ({self.method}, {self.dtype}, {self.device})"


def _shape_text(shape: Shape) -> str:
    m, k, n = shape
    return f"{m}×{k} @ {k}×{n}"


def measured_matmul_flops(
    dtype: torch.dtype = torch.float32,
    n: int = 1024,
    device: str | torch.device = "cpu",
    repeats: int = 10,
    warmup: int = 2,
    shapes: Sequence[Shape] | None = None,
) -> MeasuredFlops:
    """Measure the most FLOP/s ``torch.matmul`` reaches here: a ceiling for a workload.

    ``shapes`` are the (m, k, n) products to try, (m×k) @ (k×n), 2·m·k·n FLOPs each: pass the
    shapes your workload multiplies, since small matrices reach less than large ones and a
    ceiling measured on other sizes is no ceiling for them. Without ``shapes``, one n×n
    square. Each shape gets ``warmup`` untimed calls; then ``repeats`` rounds time one call
    of every shape in turn, so a burst of load on a shared machine does not fall on one shape
    only. The ceiling is the **best** call of the best shape: another process can only make a
    call slower, never faster, so the fastest run is the one closest to what the hardware can
    do (Python's ``timeit`` documentation: "the lowest value gives a lower bound for how fast
    your machine can run the given code snippet"). On CUDA each timing is synchronised
    (``timing.Timer``), since kernels launch asynchronously. A CPU has no published peak in
    PEAK_TABLE, so on a CPU this is the only honest "peak" the course has.
    """
    if shapes is None:
        n = whole("n", n, low=1)
        shapes = [(n, n, n)]
    shapes = [tuple(s) for s in shapes]
    if not shapes or any(len(s) != 3 for s in shapes):
        raise ValueError(f"shapes must be (m, k, n) triples of positive integers, got {shapes!r}")
    shapes = [tuple(whole(f"shapes[{i}]", d, low=1) for d in s) for i, s in enumerate(shapes)]
    repeats = whole("repeats", repeats, low=1)
    warmup = whole("warmup", warmup, low=0)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    dev = torch.device(device)

    # A private generator leaves the global RNG (and so the learner's seeds) untouched.
    gen = torch.Generator(device=dev).manual_seed(0)
    calls = []
    for m, k, n_ in shapes:
        a = torch.randn(m, k, generator=gen, device=dev, dtype=torch.float32).to(dtype)
        b = torch.randn(k, n_, generator=gen, device=dev, dtype=torch.float32).to(dtype)
        calls.append(lambda a=a, b=b: torch.matmul(a, b))
    for call in calls:
        for _ in range(warmup):
            call()
    timing.synchronize(dev)
    samples: list[list[float]] = [[] for _ in shapes]
    timer = timing.Timer(dev)
    for _ in range(repeats):
        for call, times in zip(calls, samples, strict=True):
            with timer:
                call()
            times.append(timer.elapsed_s)
    per_shape = []
    for shape, times in zip(shapes, samples, strict=True):
        best = min(times)
        if best <= 0:
            raise RuntimeError(f"matmul {_shape_text(shape)} timed as {best} s: the timer is "
                               "too coarse; use larger shapes")
        per_shape.append((shape, 2 * shape[0] * shape[1] * shape[2] / best))
    i = max(range(len(shapes)), key=lambda j: per_shape[j][1])
    shape, times = shapes[i], samples[i]
    what = (f"{len(shapes)} shapes, fastest {_shape_text(shape)}" if len(shapes) > 1
            else _shape_text(shape))
    return MeasuredFlops(
        value=per_shape[i][1],
        dtype=str(dtype).removeprefix("torch."),
        shape=shape,
        device=str(dev),
        repeats=repeats,
        best_s=min(times),
        median_s=statistics.median(times),
        threads=torch.get_num_threads(),
        method=f"measured: torch.matmul, {what}, best of {repeats} after {warmup} warm-up",
        per_shape=tuple(per_shape),
    )
