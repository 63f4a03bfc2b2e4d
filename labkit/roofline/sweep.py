"""Matmul throughput per precision and size: fp32, tf32, bf16 and fp16 compared.

:func:`matmul_sweep` times n×n @ n×n matmuls in each precision, in alternated rounds so that
drift of the machine's load falls on all precisions alike. tf32 runs on CUDA only, with the
caller's TF32 setting restored afterwards. A :class:`MatmulSweep` holds the measured times and
says, when printed, whose ratios they are: on a CPU, that CPU's, never a GPU speedup.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

import torch

from labkit import timing
from labkit.roofline.ceilings import as_device, device_name, utc_now
from labkit.roofline.cpu import CpuPrecisionSupport, cpu_precision_support
from labkit.roofline.model import matmul_traffic
from labkit.roofline.precisions import (
    check_precision_on,
    matmul_mode,
    precision_name,
    storage_dtype,
)
from labkit.validate import whole


@dataclass(frozen=True)
class SweepRow:
    """The timed calls of one n×n @ n×n matmul in one precision."""

    precision: str
    n: int
    samples_s: tuple[float, ...]  # measured, one per round

    @property
    def flops(self) -> int:
        return matmul_traffic(self.n, self.n, self.n, self.precision)[0]

    @property
    def bytes(self) -> int:
        """Modelled least traffic (:func:`matmul_traffic`)."""
        return matmul_traffic(self.n, self.n, self.n, self.precision)[1]

    @property
    def best_s(self) -> float:
        return min(self.samples_s)

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def median_flops_per_s(self) -> float:
        return self.flops / self.median_s

    @property
    def best_flops_per_s(self) -> float:
        return self.flops / self.best_s


@dataclass(frozen=True)
class MatmulSweep:
    """Matmul throughput per precision and size on one device, timed in alternated rounds."""

    rows: tuple[SweepRow, ...]
    device: str
    device_name: str
    when: str
    method: str
    cpu_support: CpuPrecisionSupport | None  # on a CPU: what its flags say; None on a GPU

    def row(self, precision: str | torch.dtype, n: int) -> SweepRow:
        name = precision_name(precision)
        for r in self.rows:
            if (r.precision, r.n) == (name, n):
                return r
        raise ValueError(f"no row for precision={name!r}, n={n!r}: measured "
                         f"{sorted({(r.precision, r.n) for r in self.rows})}")  # fmt: skip

    def speed_ratio(self, precision: str | torch.dtype, n: int,
                    baseline: str | torch.dtype = "float32") -> float:  # fmt: skip
        """Throughput of ``precision`` ÷ throughput of ``baseline`` at size n (ratio of median
        times, baseline over precision): above 1 is faster than the baseline, below 1 slower.
        On a CPU this is a ratio of that CPU, never a GPU speedup."""
        return self.row(baseline, n).median_s / self.row(precision, n).median_s

    @property
    def ratio_label(self) -> str:
        if self.device.startswith("cuda"):
            return f"measured on {self.device_name}"
        return (f"measured on this CPU ({self.device_name}): a property of this CPU, not a GPU "
                "speedup")  # fmt: skip

    def __str__(self) -> str:
        precisions = list(dict.fromkeys(r.precision for r in self.rows))
        has_base = "float32" in precisions
        head = f"{'precision':<10}{'n':>7}{'median':>12}{'GFLOP/s':>11}"
        head += f"{'× float32 speed':>17}" if has_base else ""
        lines = [f"matmul n×n @ n×n, {self.method}", head]
        for r in self.rows:
            line = (f"{r.precision:<10}{r.n:>7}{timing.format_seconds(r.median_s):>12}"
                    f"{r.median_flops_per_s / 1e9:>11.3g}")  # fmt: skip
            if has_base:
                line += f"{self.speed_ratio(r.precision, r.n):>17.3g}"
            lines.append(line)
        lines.append(f"Ratios {self.ratio_label}.")
        if self.cpu_support is not None:
            lines.append(f"CPU support: {self.cpu_support}")
        return "\n".join(lines)


_SWEEP_SIZES = {"cpu": (64, 128, 256, 512), "cuda": (512, 1024, 2048, 4096, 8192)}


def matmul_sweep(
    device: str | torch.device = "cpu",
    precisions: Sequence[str | torch.dtype] = ("float32", "bfloat16", "float16"),
    sizes: Sequence[int] | None = None,
    *,
    repeats: int = 3,
    warmup: int = 1,
) -> MatmulSweep:
    """Time n×n @ n×n matmuls for each precision and size on ``device``.

    Every (precision, size) call gets ``warmup`` untimed calls; then each of ``repeats``
    rounds times one call of each, in an order reversed every other round, so that drift of
    the machine's load falls on all precisions alike and ratios compare like with like.
    "tf32" is refused off CUDA; on CUDA "float32" runs with TF32 off and "tf32" with it on,
    and the caller's setting is restored. Default sizes: 64–512 on a CPU, 512–8192 on a GPU.
    """
    dev = as_device(device)
    if isinstance(precisions, (str, torch.dtype)) or not precisions:
        raise ValueError(f"precisions={precisions!r} is not allowed: a non-empty sequence, "
                         "e.g. ('float32', 'bfloat16', 'float16')")  # fmt: skip
    names = [precision_name(p) for p in precisions]
    if len(set(names)) != len(names):
        raise ValueError(f"precisions={list(precisions)!r} names one precision twice")
    for name in names:
        check_precision_on(name, dev)
    if sizes is None:
        sizes = _SWEEP_SIZES["cuda" if dev.type == "cuda" else "cpu"]
    if isinstance(sizes, Integral) or not sizes:
        raise ValueError(f"sizes={sizes!r} is not allowed: a non-empty sequence of positive "
                         "integers, e.g. (128, 256, 512)")  # fmt: skip
    sizes = [whole("sizes[i]", n, low=1) for n in sizes]
    repeats = whole("repeats", repeats, low=1)
    warmup = whole("warmup", warmup, low=0)

    # A private generator leaves the learner's global RNG (and seeds) untouched.
    gen = torch.Generator(device=dev).manual_seed(0)
    cases = []
    for name in names:
        for n in sizes:
            a = torch.randn(n, n, generator=gen, device=dev).to(storage_dtype(name))
            b = torch.randn(n, n, generator=gen, device=dev).to(storage_dtype(name))
            cases.append((name, n, a, b))
    timer = timing.Timer(dev)
    for name, _, a, b in cases:
        with matmul_mode(name, dev):
            for _ in range(warmup):
                torch.matmul(a, b)
    timing.synchronize(dev)
    samples: dict[tuple[str, int], list[float]] = {(c[0], c[1]): [] for c in cases}
    for r in range(repeats):
        for name, n, a, b in cases[::-1] if r % 2 else cases:
            with matmul_mode(name, dev), timer:
                torch.matmul(a, b)
            samples[name, n].append(timer.elapsed_s)
    rows = tuple(SweepRow(name, n, tuple(samples[name, n])) for name, n, _, _ in cases)
    method = (f"measured: {repeats} alternated rounds after {warmup} warm-up, "
              f"{torch.get_num_threads()} threads, {timer.method}")  # fmt: skip
    return MatmulSweep(
        rows=rows, device=str(dev), device_name=device_name(dev), when=utc_now(),
        method=method, cpu_support=None if dev.type == "cuda" else cpu_precision_support(),
    )  # fmt: skip
