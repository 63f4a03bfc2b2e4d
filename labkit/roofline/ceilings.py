"""The ceilings of *this* machine, measured: the compute roof and the memory roof.

Every roof is measured on the device at hand: the best FLOP/s of a large matmul
(:func:`measure_compute_ceiling`) and the best bytes/s of a large device copy
(:func:`measure_bandwidth_ceiling`), each a :class:`~labkit.roofline.model.Ceiling` carrying
where and when it was measured; :func:`measure_roofline` measures both into a ``Roofline``. A
datasheet figure is only ever a reference drawn beside the roof (:func:`published_ceilings`,
for a GPU ``labkit.hardware`` recognises), never the roof, and an unknown device gets no
guessed peak at all.

Times come from ``labkit.timing.Timer`` (CUDA events on a GPU, so queued kernels count).
Nothing is measured until a function here is called.
"""

from __future__ import annotations

import datetime
import statistics
from collections.abc import Sequence
from typing import NamedTuple

import torch

from labkit import hardware, timing, train
from labkit.roofline.model import (
    BYTES,
    FLOPS,
    Ceiling,
    Roofline,
)
from labkit.roofline.precisions import (
    check_precision_on,
    matmul_mode,
    precision_name,
    storage_dtype,
)
from labkit.validate import positive, whole


def as_device(device: str | torch.device) -> torch.device:
    # train.resolve_device refuses "cuda" on a machine without one, naming the fix.
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device={device!r} is not allowed: 'cpu', 'cuda', 'cuda:N', 'auto' "
                         "or a torch.device")  # fmt: skip
    return train.resolve_device(str(device))


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


def device_name(device: str | torch.device) -> str:
    """What the device is called: the GPU's name from the driver, or the CPU's model name."""
    dev = as_device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return hardware.cpu_info().model_name


# Square sizes the compute ceiling tries, by device type, each twice the last.
_COMPUTE_SIZES = {"cpu": (64, 128, 256, 512, 1024, 2048),
                  "cuda": (1024, 2048, 4096, 8192, 16384)}  # fmt: skip


def _budgeted_sizes(dev: torch.device, dtype: torch.dtype, calls: int,
                    budget_s: float, *, probes: int = 3, min_sizes: int = 3) -> list[int]:  # fmt: skip
    """The sizes of the ladder whose ``calls`` matmuls each should take ≤ ``budget_s`` in all.

    Climbs the ladder timing ``probes`` calls per size (after an untimed one) and keeps their
    median, then stops before a size whose calls would pass the budget, predicting its time as
    8× the last size's median (n³ FLOPs, and a larger matmul is no less efficient than a
    smaller one). The first ``min_sizes`` sizes are always tried. Why a median and a floor:
    deciding from one timed call let one slow call on a shared machine stop the ladder at
    n=64, and the fp32 roof became a tiny matrix's rate (65 GFLOP/s where n=512 reached 166,
    on a shared 2-core AMD EPYC; review finding N04-3). Why several sizes rather than the
    largest: the largest is not always the fastest. bf16 on a CPU without bf16 instructions
    ran at 3 GFLOP/s at n=128 and 1.3 GFLOP/s at n=512 on a 2-core AMD EPYC, while its fp32
    matmuls reached ~170 GFLOP/s at n=1024.
    """
    ladder = _COMPUTE_SIZES["cuda" if dev.type == "cuda" else "cpu"]
    gen = torch.Generator(device=dev).manual_seed(0)
    timer = timing.Timer(dev)
    sizes: list[int] = []
    spent = last = 0.0  # seconds of one call of every size chosen so far; of the last one
    for n in ladder:
        if len(sizes) >= min_sizes and calls * (spent + 8 * last) > budget_s:
            break
        a = torch.randn(n, n, generator=gen, device=dev).to(dtype)
        torch.matmul(a, a)  # the first call selects a kernel and grows the allocator
        samples = []
        for _ in range(probes):
            with timer:
                torch.matmul(a, a)
            samples.append(timer.elapsed_s)
        last = statistics.median(samples)
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
    dev = as_device(device)
    name = precision_name(precision)
    check_precision_on(name, dev)
    repeats = whole("repeats", repeats, low=1)
    warmup = whole("warmup", warmup, low=0)
    positive("budget_s", budget_s, why="seconds")
    with matmul_mode(name, dev):
        if n is None:
            sizes = _budgeted_sizes(dev, storage_dtype(name), repeats + warmup, budget_s)
        else:
            sizes = [whole("n", n, low=1)]
        m = hardware.measured_matmul_flops(
            dtype=storage_dtype(name),
            device=dev,
            repeats=repeats,
            warmup=warmup,
            shapes=[(k, k, k) for k in sizes],
        )
    return Ceiling(
        value=m.value, unit=FLOPS, precision=name, device_name=device_name(dev),
        kind="measured", device=str(dev), when=utc_now(),
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
    dev = as_device(device)
    if n_bytes is None:
        n_bytes = _COPY_BYTES["cuda" if dev.type == "cuda" else "cpu"]
    n_bytes = whole("n_bytes", n_bytes, low=1)
    repeats = whole("repeats", repeats, low=1)
    warmup = whole("warmup", warmup, low=0)
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
                   when=utc_now(), method=method)  # fmt: skip


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
