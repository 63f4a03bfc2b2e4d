"""The roofline of *this* machine: measured ceilings, and measured kernels placed under them.

The roofline model (Williams, Waterman and Patterson, "Roofline: an insightful visual
performance model for multicore architectures", CACM 52(4), 2009; jax-ml/scaling-book
``roofline.md``) bounds how fast a kernel can run by two ceilings of the device:

    attainable FLOP/s = min(peak FLOP/s, I × memory bandwidth),   I = FLOPs / bytes moved

I is the kernel's arithmetic intensity. Below the ridge point I* = peak / bandwidth a kernel
is memory-bound (more FLOP/s needs fewer bytes per FLOP); above it, compute-bound.

Every roof here is **measured** on the device at hand: the best FLOP/s of a large matmul
(:func:`measure_compute_ceiling`) and the best bytes/s of a large device copy
(:func:`measure_bandwidth_ceiling`), each carrying where and when it was measured. A
:class:`Roofline` refuses anything else: a datasheet figure is a reference drawn beside the
roof (:func:`published_ceilings`, only for a GPU ``labkit.hardware`` recognises), never the
roof, and an unknown device gets no guessed peak at all. A kernel's time is measured; its
FLOPs and bytes are *modelled* (counted from its shapes, :func:`matmul_traffic`), and the
figure says which is which.

Also here, for comparing precisions: matmul throughput over sizes per precision
(:func:`matmul_sweep`, with tf32 on CUDA only), and what a CPU's feature flags say about its
bf16 and fp16 arithmetic (:func:`cpu_precision_support`), so that a ratio measured on a CPU
is read as what it is: a property of that CPU, not a GPU speedup.

Importing this module measures nothing, touches no GPU and imports no plotting library.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, NamedTuple

import torch

from labkit import formulas, hardware, timing, train

# ----------------------------------------------------------------------------------------------
# Precisions

PRECISIONS = ("float32", "tf32", "bfloat16", "float16")
"""What a matmul here can run in. tf32 is not a storage dtype: it is how NVIDIA tensor cores
(Ampere and later) multiply float32 tensors when PyTorch allows it (see :func:`tf32_matmuls`)."""

_ALIASES = {
    "fp32": "float32", "float": "float32", "float32": "float32",
    "tf32": "tf32", "tfloat32": "tf32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "half": "float16", "float16": "float16",
}  # fmt: skip

_STORAGE = {"float32": torch.float32, "tf32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}  # fmt: skip

FLOPS = "FLOP/s"
BYTES = "B/s"


def precision_name(precision: str | torch.dtype) -> str:
    """The canonical name of a precision: "float32", "tf32", "bfloat16" or "float16".

    Accepts a ``torch.dtype`` or a name or alias ("fp32", "bf16", "fp16", "half", "tf32").
    """
    if not isinstance(precision, (str, torch.dtype)):
        raise ValueError(f"precision={precision!r} is not allowed: give a torch.dtype or one of "
                         f"{', '.join(PRECISIONS)} (aliases fp32, bf16, fp16, half)")  # fmt: skip
    key = str(precision).removeprefix("torch.").lower()
    if key not in _ALIASES:
        raise ValueError(f"precision={precision!r} is not allowed: use one of "
                         f"{', '.join(PRECISIONS)} (aliases fp32, bf16, fp16, half)")  # fmt: skip
    return _ALIASES[key]


def _device(device: str | torch.device) -> torch.device:
    # train.resolve_device refuses "cuda" on a machine without one, naming the fix.
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device={device!r} is not allowed: 'cpu', 'cuda', 'cuda:N', 'auto' "
                         "or a torch.device")  # fmt: skip
    return train.resolve_device(str(device))


def _check_precision_on(name: str, dev: torch.device) -> None:
    if name == "tf32" and dev.type != "cuda":
        raise ValueError(
            f"precision='tf32' is not allowed on device {str(dev)!r}: TF32 is a mode of NVIDIA "
            "tensor cores (Ampere and later) for float32 matmuls, so it exists only on CUDA; "
            "on this device measure 'float32', 'bfloat16' or 'float16'"
        )


@contextlib.contextmanager
def tf32_matmuls(enabled: bool = True) -> Iterator[None]:
    """Inside the block, CUDA float32 matmuls may (``enabled``) or may not use TF32; the
    caller's setting is restored afterwards, also when the block raises.

    PyTorch leaves TF32 off for matmuls by default since 1.12; the switches are
    ``torch.backends.cuda.matmul.allow_tf32`` and ``torch.set_float32_matmul_precision``
    ("highest": off, "high": TF32). PyTorch 2.9 added ``torch.backends.cuda.matmul
    .fp32_precision`` ("ieee" or "tf32"), and reading the old switches after code has set the
    new one raises a RuntimeError (PyTorch docs, CUDA semantics, "TensorFloat-32 (TF32) on
    Ampere (and later) devices"). So this sets the old switches ("high" or "highest"), which
    keeps both APIs readable, unless the caller already uses the new one: then it sets and
    restores that one. Setting either needs no GPU, and changes nothing off CUDA.
    """
    matmul = torch.backends.cuda.matmul
    new_api = hasattr(matmul, "fp32_precision")
    saved_new = matmul.fp32_precision if new_api else None
    try:
        saved = matmul.allow_tf32, torch.get_float32_matmul_precision()
    except RuntimeError:  # the caller set fp32_precision: stay with the new switch
        matmul.fp32_precision = "tf32" if enabled else "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = saved_new
        return
    # The precision setter sets allow_tf32 with it, so the two old switches agree inside.
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    try:
        yield
    finally:
        matmul.allow_tf32 = saved[0]
        # the precision setter also sets allow_tf32, consistently with itself: so it goes last
        torch.set_float32_matmul_precision(saved[1])
        if new_api and matmul.fp32_precision != saved_new:
            matmul.fp32_precision = saved_new  # the old setters write "ieee" where it was "none"


def _matmul_mode(name: str, dev: torch.device) -> contextlib.AbstractContextManager:
    # On CUDA "float32" means IEEE float32 even if the caller has TF32 switched on: a float32
    # ceiling measured with TF32 would be a tf32 ceiling under the wrong name.
    return tf32_matmuls(name == "tf32") if dev.type == "cuda" else contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------
# Ceilings


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, Real) and math.isfinite(value)


def device_name(device: str | torch.device) -> str:
    """What the device is called: the GPU's name from the driver, or the CPU's model name."""
    dev = _device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return hardware.cpu_info().model_name


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
        v = self.value
        if not (_finite(v) and v > 0):
            raise ValueError(f"value={v!r} is not allowed: a ceiling is a positive finite "
                             f"number of {self.unit}")  # fmt: skip
        if self.unit not in (FLOPS, BYTES):
            raise ValueError(f"unit={self.unit!r} is not allowed: {FLOPS!r} or {BYTES!r}")
        if self.kind not in ("measured", "published"):
            raise ValueError(f"kind={self.kind!r} is not allowed: 'measured' or 'published'")
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
        return f"{what} {_rate(self.value, self.unit)} ({self.provenance})"


def _rate(value: float, unit: str) -> str:
    """1.23e12 FLOP/s -> "1.23 TFLOP/s"; 4.8e12 B/s -> "4.8 TB/s" (decimal prefixes)."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value <= 0:
        raise ValueError(f"{name}={value!r} is not allowed: a positive integer")
    return int(value)


def _non_negative_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
        raise ValueError(f"{name}={value!r} is not allowed: zero or a positive integer")
    return int(value)


# Square sizes the compute ceiling tries, by device type, each twice the last.
_COMPUTE_SIZES = {"cpu": (64, 128, 256, 512, 1024, 2048),
                  "cuda": (1024, 2048, 4096, 8192, 16384)}  # fmt: skip


def _budgeted_sizes(dev: torch.device, dtype: torch.dtype, calls: int,
                    budget_s: float) -> list[int]:  # fmt: skip
    """The sizes of the ladder whose ``calls`` matmuls each should take ≤ ``budget_s`` in all.

    Climbs the ladder timing one call per size (after an untimed one), and stops before a
    size whose calls would pass the budget, predicting its time as 8× the last size's (n³
    FLOPs, and a larger matmul is no less efficient than a smaller one). Why several sizes
    rather than the largest: the largest is not always the fastest. bf16 on a CPU without
    bf16 instructions ran at 3 GFLOP/s at n=128 and 1.3 GFLOP/s at n=512 on a 2-core AMD
    EPYC, while its fp32 matmuls reached ~170 GFLOP/s at n=1024.
    """
    ladder = _COMPUTE_SIZES["cuda" if dev.type == "cuda" else "cpu"]
    gen = torch.Generator(device=dev).manual_seed(0)
    timer = timing.Timer(dev)
    sizes: list[int] = []
    spent = last = 0.0  # seconds of one call of every size chosen so far; of the last one
    for n in ladder:
        if sizes and calls * (spent + 8 * last) > budget_s:
            break
        a = torch.randn(n, n, generator=gen, device=dev).to(dtype)
        torch.matmul(a, a)  # the first call selects a kernel and grows the allocator
        with timer:
            torch.matmul(a, a)
        last = timer.elapsed_s
        spent += last
        sizes.append(n)
    return sizes


def measure_compute_ceiling(
    device: str | torch.device = "cpu",
    precision: str | torch.dtype = "float32",
    *,
    n: int | None = None,
    repeats: int = 5,
    warmup: int = 2,
    budget_s: float = 0.5,
) -> Ceiling:
    """The compute roof: the most FLOP/s an n×n ``torch.matmul`` reaches here.

    Uses :func:`labkit.hardware.measured_matmul_flops` (``labkit.timing.Timer``: CUDA events
    on a GPU, so queued kernels are counted; the **best** call of the best size, after
    ``warmup``, since other processes only ever slow a call down). ``n=None`` tries every
    size of a doubling ladder (64 to 2048 on a CPU, 1024 to 16384 on a GPU) up to the largest
    whose calls fit in about ``budget_s`` seconds; ``n`` measures that one size. "tf32" (CUDA
    only) enables TF32 for the measurement; "float32" on CUDA is measured with TF32 off,
    whatever the caller's setting.
    """
    dev = _device(device)
    name = precision_name(precision)
    _check_precision_on(name, dev)
    repeats = _positive_int("repeats", repeats)
    warmup = _non_negative_int("warmup", warmup)
    if not (_finite(budget_s) and budget_s > 0):
        raise ValueError(f"budget_s={budget_s!r} is not allowed: a positive number of seconds")
    with _matmul_mode(name, dev):
        if n is None:
            sizes = _budgeted_sizes(dev, _STORAGE[name], repeats + warmup, budget_s)
        else:
            sizes = [_positive_int("n", n)]
        m = hardware.measured_matmul_flops(dtype=_STORAGE[name], device=dev, repeats=repeats,
                                           warmup=warmup, shapes=[(k, k, k) for k in sizes])
    return Ceiling(
        value=m.value, unit=FLOPS, precision=name, device_name=device_name(dev),
        kind="measured", device=str(dev), when=_utc_now(),
        method=(f"{m.method.removeprefix('measured: ')}, {m.threads} threads"
                + (", TF32 on" if name == "tf32" else "")),
    )  # fmt: skip


# Buffers far larger than any cache, so the copy streams from and to memory: CPU last-level
# caches are tens of MiB; an H100's L2 is 50 MB (NVIDIA H100 Tensor Core GPU Architecture).
_COPY_BYTES = {"cpu": 256 * 2**20, "cuda": 2**30}


def measure_bandwidth_ceiling(
    device: str | torch.device = "cpu",
    *,
    n_bytes: int | None = None,
    repeats: int = 5,
    warmup: int = 2,
) -> Ceiling:
    """The memory roof: the most bytes/s one large device-to-device copy reaches here.

    ``dst.copy_(src)`` of ``n_bytes`` (default 256 MiB on a CPU, 1 GiB on a GPU). Bytes
    counted per copy: **read + write, 2 × n_bytes**, the convention of STREAM's "Copy" (McCalpin,
    STREAM benchmark FAQ). A CPU with write-allocate caches also reads each destination line
    before writing it, so its memory really moves up to 3 × n_bytes: the ceiling counts only
    the traffic a kernel asks for, as a kernel's byte count on the roofline does. Best of
    ``repeats`` copies after ``warmup`` (which also maps the destination's pages).
    """
    dev = _device(device)
    if n_bytes is None:
        n_bytes = _COPY_BYTES["cuda" if dev.type == "cuda" else "cpu"]
    n_bytes = _positive_int("n_bytes", n_bytes)
    repeats = _positive_int("repeats", repeats)
    warmup = _non_negative_int("warmup", warmup)
    # ones, not empty: untouched pages may all map one shared zero page, which sits in cache
    src = torch.ones(n_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(warmup):
        dst.copy_(src)
    timing.synchronize(dev)
    timer = timing.Timer(dev)
    samples = []
    for _ in range(repeats):
        with timer:
            dst.copy_(src)
        samples.append(timer.elapsed_s)
    best = min(samples)
    if best <= 0:
        raise RuntimeError(f"a {n_bytes}-byte copy timed as {best} s: the timer is too coarse; "
                           "use a larger n_bytes")  # fmt: skip
    method = (f"copy of {n_bytes / 2**20:.0f} MiB, read + write counted "
              f"(2 × {n_bytes} bytes), best of {repeats} after {warmup} warm-up, "
              f"{torch.get_num_threads()} threads, {timer.method}")  # fmt: skip
    return Ceiling(value=2 * n_bytes / best, unit=BYTES, precision=None,
                   device_name=device_name(dev), kind="measured", device=str(dev),
                   when=_utc_now(), method=method)  # fmt: skip


class Published(NamedTuple):
    """Datasheet ceilings found for a device, and why the others are missing."""

    ceilings: tuple[Ceiling, ...]
    reasons: tuple[str, ...]


def published_ceilings(
    device_name: str, precisions: Sequence[str | torch.dtype] = ("bfloat16",)
) -> Published:
    """The published peaks of ``device_name`` (from ``labkit.hardware``'s sourced tables), as
    reference lines for a roofline; none for a device the tables do not recognise exactly."""
    found, reasons = [], []
    for p in precisions:
        name = precision_name(p)
        peak = hardware.peak_flops(device_name, name)
        if peak.known:
            found.append(Ceiling(value=peak.flops_per_s, unit=FLOPS, precision=name,
                                 device_name=device_name, kind="published",
                                 method=f"dense peak, {peak.source}"))  # fmt: skip
        else:
            reasons.append(f"{name}: {peak.reason}")
    memory = hardware.memory_spec(device_name)
    if memory is not None:
        found.append(Ceiling(value=memory.bandwidth_bytes_per_s, unit=BYTES, precision=None,
                             device_name=device_name, kind="published",
                             method=f"memory bandwidth, {memory.source}"))  # fmt: skip
    else:
        reasons.append(f"memory bandwidth: no published figure for {device_name!r} in "
                       "labkit.hardware.MEMORY_TABLE")  # fmt: skip
    return Published(tuple(found), tuple(reasons))


# ----------------------------------------------------------------------------------------------
# The roofline


def arithmetic_intensity(flops: float, bytes_moved: float) -> float:
    """FLOPs per byte moved to or from memory: where a kernel sits on the roofline's x-axis."""
    if not (_finite(flops) and flops >= 0):
        raise ValueError(f"flops={flops!r} is not allowed: zero or a positive finite count")
    if not (_finite(bytes_moved) and bytes_moved > 0):
        raise ValueError(f"bytes_moved={bytes_moved!r} is not allowed: a positive finite count "
                         "(every kernel reads or writes something)")  # fmt: skip
    return flops / bytes_moved


def matmul_traffic(m: int, k: int, n: int, precision: str | torch.dtype) -> tuple[int, int]:
    """Modelled (FLOPs, bytes) of an (m×k) @ (k×n) matmul: 2·m·k·n FLOPs (a multiply and an
    add per term), and the least traffic possible: each input read once, the output written
    once, (m·k + k·n + m·n) elements. Tiling that re-reads inputs moves more; caches less."""
    m, k, n = (_positive_int(a, v) for a, v in (("m", m), ("k", k), ("n", n)))
    size = _STORAGE[precision_name(precision)].itemsize
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
                f"{_rate(self.achieved_flops_per_s, FLOPS)} = {100 * self.fraction_of_roof:.0f}% "
                f"of the {_rate(self.attainable_flops_per_s, FLOPS)} attainable "
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

    Build it with :func:`measure_roofline`, or from :func:`measure_compute_ceiling` and
    :func:`measure_bandwidth_ceiling`.
    """

    compute: tuple[Ceiling, ...]
    bandwidth: Ceiling

    def __post_init__(self) -> None:
        compute = self.compute
        if isinstance(compute, Ceiling):
            compute = (compute,)
        if compute is None or not isinstance(compute, (tuple, list)) or not compute:
            raise _no_measured(f"compute={self.compute!r} holds no compute ceiling",
                               "measure one with measure_compute_ceiling(device, precision)")
        if self.bandwidth is None:
            raise _no_measured("bandwidth=None: no memory-bandwidth ceiling",
                               "measure one with measure_bandwidth_ceiling(device)")
        compute = tuple(compute)
        for c, field_name, unit in [*((c, "compute", FLOPS) for c in compute),
                                    (self.bandwidth, "bandwidth", BYTES)]:  # fmt: skip
            if not isinstance(c, Ceiling) or c.unit != unit:
                raise ValueError(f"{field_name} must hold Ceiling objects in {unit}, got {c!r}")
            if c.kind != "measured":
                raise _no_measured(f"{field_name} holds a {c.kind} ceiling ({c.provenance})",
                                   f"measure the {field_name} ceiling on this device")
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
        if not (_finite(seconds) and seconds > 0):
            raise ValueError(f"seconds={seconds!r} is not allowed: the kernel's measured time, "
                             "a positive finite number of seconds")  # fmt: skip
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


def measure_roofline(
    device: str | torch.device = "cpu",
    precisions: Sequence[str | torch.dtype] = ("float32",),
    *,
    n_bytes: int | None = None,
    budget_s: float = 0.5,
) -> Roofline:
    """Measure this device's bandwidth ceiling and a compute ceiling per precision."""
    if isinstance(precisions, (str, torch.dtype)) or not precisions:
        raise ValueError(f"precisions={precisions!r} is not allowed: a non-empty sequence, "
                         "e.g. ('float32', 'bfloat16')")  # fmt: skip
    bandwidth = measure_bandwidth_ceiling(device, n_bytes=n_bytes)
    compute = tuple(measure_compute_ceiling(device, p, budget_s=budget_s) for p in precisions)
    return Roofline(compute=compute, bandwidth=bandwidth)


# ----------------------------------------------------------------------------------------------
# The figure


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
                          label=f"{c.precision} roof: {_rate(c.value, FLOPS)} (measured)")  # fmt: skip
        ax.plot([ridge], [c.value], "o", color=line.get_color(), markersize=7)
        near = _near_before(ridge_xy, i)
        ax.annotate(f"ridge {ridge:.3g} FLOP/B", (ridge, c.value), textcoords="offset points",
                    xytext=(6, -14 - 10 * near), fontsize=8, color=line.get_color())  # fmt: skip
    ax.plot([], [], " ", label=f"memory slope: {_rate(bw.value, BYTES)} (measured copy, "
                               "read + write)")  # fmt: skip
    for c in published:
        if c.unit == FLOPS:
            ax.axhline(c.value, linestyle="--", color="grey", linewidth=1,
                       label=f"{c.precision} {_rate(c.value, FLOPS)} (datasheet, not measured)")
        else:
            ax.plot(x, x * c.value, linestyle="--", color="grey", linewidth=1,
                    label=f"memory {_rate(c.value, BYTES)} (datasheet, not measured)")
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


# ----------------------------------------------------------------------------------------------
# Precisions compared: matmul throughput over sizes, and what a CPU supports


@dataclass(frozen=True)
class CpuPrecisionSupport:
    """What a CPU's feature flags say about bf16 and fp16 arithmetic.

    ``bfloat16``/``float16`` are True when the CPU has instructions that compute in that
    format, False when it has none (the format is then converted to fp32 to compute, so it
    runs slower than fp32), None when labkit does not interpret this architecture's flags.
    """

    cpu: str
    architecture: str
    flags: tuple[str, ...]
    bfloat16: bool | None
    float16: bool | None
    notes: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.cpu} ({self.architecture}): " + "; ".join(self.notes)


_X86 = ("x86_64", "amd64", "i386", "i686")

# Flag names as Linux prints them in /proc/cpuinfo (arch/x86/include/asm/cpufeatures.h);
# the instructions from Intel's Architecture Instruction Set Extensions Programming Reference.
_BF16_FLAGS = {
    "avx512_bf16": "AVX512-BF16 (VDPBF16PS: bf16 pairs multiplied, summed in fp32)",
    "amx_bf16": "AMX-BF16 (TDPBF16PS: bf16 tile matrix multiplies)",
}
_FP16_FLAGS = {
    "avx512_fp16": "AVX512-FP16 (fp16 vector arithmetic)",
    "amx_fp16": "AMX-FP16 (TDPFP16PS: fp16 tile matrix multiplies)",
}


def cpu_precision_support(cpu: hardware.CpuInfo | None = None) -> CpuPrecisionSupport:
    """Read bf16 and fp16 support from the CPU's flags (``labkit.hardware.cpu_info``)."""
    cpu = hardware.cpu_info() if cpu is None else cpu
    if cpu.architecture.lower() not in _X86:
        note = (f"labkit does not interpret {cpu.architecture} feature flags: bf16 and fp16 "
                "support N/A (on Arm, look for bf16 among the Features in /proc/cpuinfo)")
        return CpuPrecisionSupport(cpu.model_name, cpu.architecture, cpu.flags, None, None,
                                   (note,))  # fmt: skip
    notes = []
    support = {}
    for fmt, table in (("bf16", _BF16_FLAGS), ("fp16", _FP16_FLAGS)):
        have = [desc for flag, desc in table.items() if cpu.has(flag)]
        support[fmt] = bool(have)
        if have:
            notes.append(f"{fmt} arithmetic in hardware: {', '.join(have)}")
        else:
            notes.append(f"no {fmt} arithmetic instructions (none of {', '.join(table)}): "
                         f"{fmt} values are converted to fp32 to compute, so {fmt} matmuls "
                         "are expected to run slower than fp32 here")  # fmt: skip
    return CpuPrecisionSupport(cpu.model_name, cpu.architecture, cpu.flags, support["bf16"],
                               support["fp16"], tuple(notes))  # fmt: skip


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
    dev = _device(device)
    if isinstance(precisions, (str, torch.dtype)) or not precisions:
        raise ValueError(f"precisions={precisions!r} is not allowed: a non-empty sequence, "
                         "e.g. ('float32', 'bfloat16', 'float16')")  # fmt: skip
    names = [precision_name(p) for p in precisions]
    if len(set(names)) != len(names):
        raise ValueError(f"precisions={list(precisions)!r} names one precision twice")
    for name in names:
        _check_precision_on(name, dev)
    if sizes is None:
        sizes = _SWEEP_SIZES["cuda" if dev.type == "cuda" else "cpu"]
    if isinstance(sizes, Integral) or not sizes:
        raise ValueError(f"sizes={sizes!r} is not allowed: a non-empty sequence of positive "
                         "integers, e.g. (128, 256, 512)")  # fmt: skip
    sizes = [_positive_int("sizes[i]", n) for n in sizes]
    repeats = _positive_int("repeats", repeats)
    warmup = _non_negative_int("warmup", warmup)

    # A private generator leaves the learner's global RNG (and seeds) untouched.
    gen = torch.Generator(device=dev).manual_seed(0)
    cases = []
    for name in names:
        for n in sizes:
            a = torch.randn(n, n, generator=gen, device=dev).to(_STORAGE[name])
            b = torch.randn(n, n, generator=gen, device=dev).to(_STORAGE[name])
            cases.append((name, n, a, b))
    timer = timing.Timer(dev)
    for name, _, a, b in cases:
        with _matmul_mode(name, dev):
            for _ in range(warmup):
                torch.matmul(a, b)
    timing.synchronize(dev)
    samples: dict[tuple[str, int], list[float]] = {(c[0], c[1]): [] for c in cases}
    for r in range(repeats):
        for name, n, a, b in cases[::-1] if r % 2 else cases:
            with _matmul_mode(name, dev), timer:
                torch.matmul(a, b)
            samples[name, n].append(timer.elapsed_s)
    rows = tuple(SweepRow(name, n, tuple(samples[name, n])) for name, n, _, _ in cases)
    method = (f"measured: {repeats} alternated rounds after {warmup} warm-up, "
              f"{torch.get_num_threads()} threads, {timer.method}")  # fmt: skip
    return MatmulSweep(
        rows=rows, device=str(dev), device_name=device_name(dev), when=_utc_now(),
        method=method, cpu_support=None if dev.type == "cuda" else cpu_precision_support(),
    )  # fmt: skip
