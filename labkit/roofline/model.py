"""The roofline model: ceilings, the bound under them, and kernels placed on it.

The roofline model (Williams, Waterman and Patterson, "Roofline: an insightful visual
performance model for multicore architectures", CACM 52(4), 2009; jax-ml/scaling-book
``roofline.md``) bounds how fast a kernel can run by two ceilings of the device:

    attainable FLOP/s = min(peak FLOP/s, I × memory bandwidth),   I = FLOPs / bytes moved

I is the kernel's arithmetic intensity. Below the ridge point I* = peak / bandwidth a kernel
is memory-bound (more FLOP/s needs fewer bytes per FLOP); above it, compute-bound.

This module is the arithmetic and the records, and measures nothing: a :class:`Ceiling` says
where its number came from, a :class:`Roofline` accepts only ceilings measured on one device
(``labkit.roofline.ceilings`` measures them), and :meth:`Roofline.place` turns a kernel's
modelled FLOPs and bytes (:func:`matmul_traffic`) and its measured time into a :class:`Point`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit import dtypes, formulas
from labkit.roofline.precisions import precision_name
from labkit.validate import number, one_of, positive, whole

FLOPS = "FLOP/s"
BYTES = "B/s"


@dataclass(frozen=True)
class Ceiling:
    """One roof: a FLOP/s or bytes/s limit of a device, with where it came from.

    ``kind`` is "measured" (on ``device`` at ``when``, by ``method``) or "published" (a
    datasheet figure; ``method`` is then its source). Only measured ceilings make a
    :class:`Roofline`; published ones are drawn beside it for comparison.
    """

    value: float  # FLOP/s when unit is FLOPS, bytes/s when unit is BYTES
    unit: str  # FLOPS or BYTES
    precision: str | None  # the precision of a compute ceiling; None for bandwidth
    device_name: str  # "NVIDIA H200", "AMD EPYC", ...
    kind: str  # "measured" or "published"
    method: str  # how it was measured, or the published figure's source
    device: str | None = None  # "cpu", "cuda:0": where a measured ceiling was measured
    when: str | None = None  # UTC, ISO 8601: when a measured ceiling was measured

    def __post_init__(self) -> None:
        positive("value", self.value, why=f"a ceiling, in {self.unit}")
        one_of("unit", self.unit, (FLOPS, BYTES))
        one_of("kind", self.kind, ("measured", "published"))
        if self.kind == "measured" and not (self.device and self.when):
            raise ValueError("a measured ceiling needs device and when (where and when it was "
                             "measured): measure it with measure_compute_ceiling or "
                             "measure_bandwidth_ceiling")  # fmt: skip
        if (self.unit == FLOPS) != (self.precision is not None):
            raise ValueError(f"precision={self.precision!r} with unit={self.unit!r}: a compute "
                             "ceiling names its precision, a bandwidth ceiling has none")  # fmt: skip
        if self.precision is not None:
            object.__setattr__(self, "precision", precision_name(self.precision))

    @property
    def provenance(self) -> str:
        if self.kind == "measured":
            return f"measured on {self.device_name} ({self.device}) at {self.when}: {self.method}"
        return f"published for {self.device_name}: {self.method}"

    def __str__(self) -> str:
        what = f"{self.precision} compute" if self.precision else "memory bandwidth"
        return f"{what} {format_rate(self.value, self.unit)} ({self.provenance})"


def format_rate(value: float, unit: str) -> str:
    """1.23e12 FLOP/s -> "1.23 TFLOP/s"; 4.8e12 B/s -> "4.8 TB/s" (decimal prefixes)."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def arithmetic_intensity(flops: float, bytes_moved: float) -> float:
    """FLOPs per byte moved to or from memory: where a kernel sits on the roofline's x-axis."""
    number("flops", flops, low=0)
    positive("bytes_moved", bytes_moved, why="every kernel reads or writes something")
    return flops / bytes_moved


def matmul_traffic(m: int, k: int, n: int, precision: str | torch.dtype) -> tuple[int, int]:
    """Modelled (FLOPs, bytes) of an (m×k) @ (k×n) matmul: 2·m·k·n FLOPs (a multiply and an
    add per term), and the least traffic possible: each input read once, the output written
    once, (m·k + k·n + m·n) elements. Tiling that re-reads inputs moves more; caches less."""
    m, k, n = (whole(a, v, low=1) for a, v in (("m", m), ("k", k), ("n", n)))
    size = dtypes.lookup(precision_name(precision)).bytes  # tf32: 4, held in float32 tensors
    return 2 * m * k * n, (m * k + k * n + m * n) * size


@dataclass(frozen=True)
class Point:
    """A measured kernel placed on a roofline."""

    name: str
    flops: float  # modelled: counted from the kernel's shapes
    bytes: float  # modelled: counted from the kernel's shapes
    seconds: float  # measured
    precision: str  # whose compute roof bounds it
    intensity: float  # FLOPs per byte
    achieved_flops_per_s: float  # flops / seconds
    attainable_flops_per_s: float  # the roof above this intensity
    ridge_intensity: float  # the roof's ridge point, FLOPs per byte

    @property
    def bound(self) -> str:
        """What limits a kernel at this intensity: "memory" left of the ridge, else "compute"."""
        return "memory" if self.intensity < self.ridge_intensity else "compute"

    @property
    def fraction_of_roof(self) -> float:
        """Achieved ÷ attainable. Above 1 means the model's bytes were not all from memory
        (caches served some), or the roof was measured under heavier load than the kernel,
        or at shapes that run slower than the kernel's."""
        return self.achieved_flops_per_s / self.attainable_flops_per_s

    def __str__(self) -> str:
        return (f"{self.name}: I = {self.intensity:.3g} FLOP/B, "
                f"{format_rate(self.achieved_flops_per_s, FLOPS)} = {100 * self.fraction_of_roof:.0f}% "
                f"of the {format_rate(self.attainable_flops_per_s, FLOPS)} attainable "
                f"({self.bound}-bound; ridge at {self.ridge_intensity:.3g} FLOP/B)")  # fmt: skip


def _no_measured(what: str, fix: str) -> ValueError:
    return ValueError(
        f"{what}: a Roofline is drawn only from ceilings measured on this machine; {fix}. "
        "labkit never puts a guessed peak on a roofline; a datasheet figure of a GPU that "
        "labkit.hardware recognises can be drawn beside it (published_ceilings, then "
        "plot_roofline(..., published=...))"
    )


@dataclass(frozen=True)
class Roofline:
    """A device's roofline from measured ceilings: one or more compute roofs (one per
    precision) and one memory-bandwidth roof, all measured on the same device.

    Build it with ``labkit.roofline.measure_roofline``, or from ``measure_compute_ceiling`` and
    ``measure_bandwidth_ceiling`` (``labkit.roofline.ceilings``).
    """

    compute: tuple[Ceiling, ...]
    bandwidth: Ceiling

    def __post_init__(self) -> None:
        compute = self.compute
        if isinstance(compute, Ceiling):
            compute = (compute,)
        if compute is None or not isinstance(compute, (tuple, list)) or not compute:
            raise _no_measured(
                f"compute={self.compute!r} holds no compute ceiling",
                "measure one with measure_compute_ceiling(device, precision)",
            )
        if self.bandwidth is None:
            raise _no_measured(
                "bandwidth=None: no memory-bandwidth ceiling",
                "measure one with measure_bandwidth_ceiling(device)",
            )
        compute = tuple(compute)
        for c, field_name, unit in [*((c, "compute", FLOPS) for c in compute),
                                    (self.bandwidth, "bandwidth", BYTES)]:  # fmt: skip
            if not isinstance(c, Ceiling) or c.unit != unit:
                raise ValueError(f"{field_name} must hold Ceiling objects in {unit}, got {c!r}")
            if c.kind != "measured":
                raise _no_measured(
                    f"{field_name} holds a {c.kind} ceiling ({c.provenance})",
                    f"measure the {field_name} ceiling on this device",
                )
        devices = {c.device for c in (*compute, self.bandwidth)}
        if len(devices) != 1:
            raise ValueError(f"the ceilings were measured on different devices {sorted(devices)}: "
                             "a roofline describes one device; measure all on it")  # fmt: skip
        names = [c.precision for c in compute]
        if len(set(names)) != len(names):
            raise ValueError(f"compute has two ceilings for one precision ({names}): keep one")
        object.__setattr__(self, "compute", compute)

    @property
    def device(self) -> str:
        return self.bandwidth.device  # type: ignore[return-value]  # measured: never None

    @property
    def device_name(self) -> str:
        return self.bandwidth.device_name

    @property
    def precisions(self) -> tuple[str, ...]:
        return tuple(c.precision for c in self.compute)  # type: ignore[misc]

    def peak(self, precision: str | torch.dtype | None = None) -> Ceiling:
        """The compute ceiling of ``precision`` (may be omitted when there is only one)."""
        if precision is None:
            if len(self.compute) == 1:
                return self.compute[0]
            raise ValueError(f"precision=None is ambiguous: this roofline has compute ceilings "
                             f"for {', '.join(self.precisions)}; name one")  # fmt: skip
        name = precision_name(precision)
        for c in self.compute:
            if c.precision == name:
                return c
        raise ValueError(f"precision={name!r} has no compute ceiling on this roofline: it has "
                         f"{', '.join(self.precisions)}; measure "
                         f"measure_compute_ceiling({self.device!r}, {name!r}) and add it")  # fmt: skip

    def ridge_intensity(self, precision: str | torch.dtype | None = None) -> float:
        """FLOPs per byte where the memory roof meets the compute roof: peak / bandwidth."""
        return formulas.critical_intensity(self.peak(precision).value, self.bandwidth.value)

    def place(self, kernel_name: str, flops: float, bytes_moved: float, seconds: float, *,
              precision: str | torch.dtype | None = None) -> Point:  # fmt: skip
        """Put a measured kernel on this roofline: ``flops`` and ``bytes_moved`` modelled for
        it (e.g. :func:`matmul_traffic`), ``seconds`` measured; ``precision`` picks the roof."""
        if not isinstance(kernel_name, str) or not kernel_name.strip():
            raise ValueError(f"kernel_name={kernel_name!r} is not allowed: a non-empty label")
        intensity = arithmetic_intensity(flops, bytes_moved)
        if flops == 0:
            raise ValueError("flops=0 is not allowed here: a kernel that does no arithmetic has no "
                             "place on a FLOP/s roofline (log axes); compare its bytes/s with the "
                             "bandwidth ceiling instead")  # fmt: skip
        positive("seconds", seconds, why="the kernel's measured time")
        roof = self.peak(precision)
        return Point(
            name=kernel_name, flops=float(flops), bytes=float(bytes_moved), seconds=float(seconds),
            precision=roof.precision,  # type: ignore[arg-type]  # compute ceilings have one
            intensity=intensity, achieved_flops_per_s=flops / seconds,
            attainable_flops_per_s=attainable(intensity, self, roof.precision),
            ridge_intensity=self.ridge_intensity(roof.precision),
        )  # fmt: skip

    def __str__(self) -> str:
        lines = [f"Roofline of {self.device_name} ({self.device}), measured:"]
        lines += [f"  {c}; ridge at {self.ridge_intensity(c.precision):.3g} FLOP/B"
                  for c in self.compute]  # fmt: skip
        lines.append(f"  {self.bandwidth}")
        return "\n".join(lines)


def attainable(intensity: float, ceilings: Roofline,
               precision: str | torch.dtype | None = None) -> float:  # fmt: skip
    """The roofline bound at ``intensity`` FLOPs/byte: min(peak, intensity × bandwidth)."""
    if not isinstance(ceilings, Roofline):
        raise ValueError(f"ceilings must be a Roofline (measure_roofline(device)), got "
                         f"{type(ceilings).__name__}")  # fmt: skip
    return formulas.roofline_attainable_flops(intensity, ceilings.peak(precision).value,
                                              ceilings.bandwidth.value)  # fmt: skip
