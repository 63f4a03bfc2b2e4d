"""What hardware is this, what can it show truthfully, and what is its peak?

Four jobs, kept apart:

1. Detection (``cpu_info``, ``gpu_info``, ``nvml_status``, ``tier``): explicit function calls.
   Importing this module touches no GPU, starts no thread and writes no file.
2. A sourced table of published peaks (``PEAK_TABLE``, ``MEMORY_TABLE``) and a conservative
   lookup (``peak_flops``): a device name that is not recognised exactly gets *no* peak, with the
   reason, never a guess. (torchtitan's ``get_peak_flops`` falls back to the A100 figure for an
   unknown GPU, and nanoGPT hard-codes it: an H100 then shows an MFU above 100%.)
3. A measured ceiling (``measured_matmul_flops``): the best ``torch.matmul`` reaches on this
   device at the shapes a workload uses, labelled as measured. On a CPU this is the only honest
   "peak" the course has.
4. What a device runs (``autocast_dtype_for``, ``sdpa_backend``): the autocast dtype a GPU's
   compute capability calls for (bf16 from 8.0, Ampere; fp16 with a GradScaler on a T4 or
   V100), and which attention kernel ``F.scaled_dot_product_attention`` picks for a shape,
   found by running it (the activation-memory prediction assumes a fused one).

    from labkit import hardware
    print(hardware.peak_flops("Tesla T4", "fp16"))        # 65 TFLOP/s, with the datasheet URL
    print(hardware.autocast_dtype_for((7, 5)).dtype)      # float16
"""

from __future__ import annotations

import contextlib
import html
import os
import platform
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from labkit import timing
from labkit.validate import whole

# ----------------------------------------------------------------------------------------------
# CPU


# Flags worth reporting for training on a CPU: bf16 is only fast with AVX512-BF16 or AMX.
CPU_FLAGS_OF_INTEREST = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "amx_fp16",
)


@dataclass(frozen=True)
class CpuInfo:
    """The host CPU. Core counts are None where they cannot be read (N/A, not 0)."""

    model_name: str
    architecture: str  # platform.machine(): "x86_64", "aarch64", ...
    logical_cores: int | None  # os.cpu_count(): hardware threads in the machine
    physical_cores: int | None  # psutil.cpu_count(logical=False)
    usable_cores: int | None  # CPUs this process may run on (containers often restrict it)
    flags: tuple[str, ...]  # the CPU_FLAGS_OF_INTEREST this CPU has (Linux only)

    def has(self, flag: str) -> bool:
        return flag in self.flags

    def __str__(self) -> str:
        flags = ", ".join(self.flags) if self.flags else "none of interest reported"
        return (
            f"{self.model_name} ({self.architecture}): {self.usable_cores} usable of "
            f"{self.logical_cores} logical cores, {self.physical_cores} physical; flags: {flags}"
        )


def _parse_cpuinfo(text: str) -> tuple[str | None, set[str]]:
    """Model name and flag set from the text of /proc/cpuinfo (first processor wins)."""
    model, flags = None, set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:  # "Features" on Arm
            flags = set(value.split())
    return model, flags


def cpu_info(cpuinfo_path: str = "/proc/cpuinfo") -> CpuInfo:
    """Describe the host CPU (reads ``cpuinfo_path`` on Linux; falls back to ``platform``)."""
    model, flags = None, set()
    try:
        with open(cpuinfo_path, encoding="utf-8", errors="replace") as f:
            model, flags = _parse_cpuinfo(f.read())
    except OSError:
        pass  # not Linux, or no procfs: keep the fallbacks below
    model = model or platform.processor() or platform.machine() or "unknown CPU"

    physical = None
    try:
        import psutil

        physical = psutil.cpu_count(logical=False)
    except ImportError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return CpuInfo(
        model_name=model,
        architecture=platform.machine() or "unknown",
        logical_cores=os.cpu_count(),
        physical_cores=physical,
        usable_cores=usable,
        flags=tuple(f for f in CPU_FLAGS_OF_INTEREST if f in flags),
    )


# ----------------------------------------------------------------------------------------------
# NVML (nvidia-ml-py, imported as ``pynvml``)


def limit_cpu_threads(n: int = 1) -> str:
    """Run this process's PyTorch CPU kernels on ``n`` threads; returns the sentence to print.

    By default PyTorch splits each CPU kernel over one thread per core, and the threads meet at
    a barrier at the end of it. On a machine where other processes also want those cores, a
    thread that has lost its core holds all the others at the barrier, and the small kernels of
    a small model slow down by far more than the share of the machine they lost (measured on
    this course's 2-core machine beside two busy processes: a training step of the smoke GPT at
    micro-batch 8 took 1 s on two threads, 42 ms on one). torchrun sets ``OMP_NUM_THREADS=1``
    for every rank by default "to avoid your system being overloaded" (torch/distributed/run.py)
    for the same reason. Call it once, at the top of a notebook, before timing anything.
    """
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= (os.cpu_count() or 1):
        raise ValueError(f"n={n!r} is not allowed: a whole number of threads from 1 to "
                         f"{os.cpu_count() or 1} (this machine's logical CPUs)")  # fmt: skip
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return (f"PyTorch CPU threads: {n} (was {before}), so that other work on this machine "
            f"slows these measurements by its share of the cores, not by stalling every kernel")


def _load_nvml() -> Any | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


# What each NVML error usually means for a learner, and what to do about it.
_NVML_ERROR_HINTS = {
    "NVMLError_LibraryNotFound": "NVML library not found: no NVIDIA driver on this machine "
    "(libnvidia-ml.so is missing), so there is no GPU to measure",
    "NVMLError_DriverNotLoaded": "NVIDIA driver not loaded: the kernel module is not running "
    "(check `nvidia-smi`; a reboot or `modprobe nvidia` may be needed)",
    "NVMLError_LibRmVersionMismatch": "NVML library and kernel driver versions differ: the "
    "driver was upgraded without a reboot; reboot or reload the nvidia module",
    "NVMLError_NoPermission": "no permission to talk to the NVIDIA driver (check the "
    "permissions of /dev/nvidia*)",
    "NVMLError_FunctionNotFound": "this NVML library lacks a function labkit needs: the "
    "driver is older than nvidia-ml-py expects",
}


class NvmlStatus(NamedTuple):
    """Whether NVML (GPU telemetry) works here, and why not when it does not."""

    ok: bool
    message: str


def nvml_status(nvml: Any | None = None) -> NvmlStatus:
    """Try ``nvmlInit()`` and say what happened, in words a learner can act on.

    Args:
        nvml: an NVML module for tests; default ``pynvml`` from nvidia-ml-py.
    """
    nvml = _load_nvml() if nvml is None else nvml
    if nvml is None:
        return NvmlStatus(
            False, "nvidia-ml-py is not installed (pip install nvidia-ml-py): no GPU telemetry"
        )
    try:
        nvml.nvmlInit()
    except Exception as e:  # NVML raises one subclass of NVMLError per error code
        hint = _NVML_ERROR_HINTS.get(type(e).__name__)
        return NvmlStatus(False, hint or f"nvmlInit failed: {type(e).__name__}: {e}")
    try:
        count = nvml.nvmlDeviceGetCount()
        driver = _nvml_str(nvml.nvmlSystemGetDriverVersion())
        return NvmlStatus(True, f"NVML works: driver {driver}, {count} GPU(s) visible to NVML")
    except Exception as e:
        return NvmlStatus(False, f"NVML initialised but a query failed: {type(e).__name__}: {e}")
    finally:
        _nvml_shutdown(nvml)


def _nvml_str(value: Any) -> str:
    # older nvidia-ml-py versions return bytes
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_shutdown(nvml: Any) -> None:
    # shutting down is best effort; the query result is what matters
    with contextlib.suppress(Exception):
        nvml.nvmlShutdown()


def _nvml_field(query: Callable[[], Any]) -> Any | None:
    """One NVML query; any NVML failure becomes None (shown as N/A, never as 0)."""
    try:
        return query()
    except Exception:
        return None


# ----------------------------------------------------------------------------------------------
# GPUs


@dataclass(frozen=True)
class GpuInfo:
    """One GPU. Fields an API could not report are None."""

    index: int  # torch's index when source == "torch.cuda", NVML's (nvidia-smi's) when "nvml"
    name: str  # as the driver reports it, e.g. "NVIDIA H100 80GB HBM3"
    memory_bytes: int | None
    compute_capability: tuple[int, int] | None
    uuid: str | None  # "GPU-…" as nvidia-smi prints it: the stable key across APIs
    source: str  # "torch.cuda" or "nvml"

    def __str__(self) -> str:
        mem = f"{self.memory_bytes / 2**30:.1f} GiB" if self.memory_bytes else "memory N/A"
        cc = self.compute_capability
        cc = f"compute capability {cc[0]}.{cc[1]}" if cc else "compute capability N/A"
        return f"GPU {self.index}: {self.name}, {mem}, {cc} (via {self.source})"


def _normalise_uuid(uuid: Any) -> str | None:
    if uuid is None:
        return None
    text = _nvml_str(uuid)
    # torch prints the bare UUID; NVML and nvidia-smi prefix it with "GPU-" (or "MIG-")
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


# ----------------------------------------------------------------------------------------------
# CUDA_VISIBLE_DEVICES -> NVML: the one place that maps the GPUs a process may use to NVML's


_FROM_ENV: Any = object()  # visible_gpus' default: read CUDA_VISIBLE_DEVICES


class VisibleGpu(NamedTuple):
    """One GPU a process may use, as NVML knows it."""

    index: int  # NVML's index: nvidia-smi's numbering (PCI bus order), not CUDA's
    handle: Any  # the NVML handle of the whole GPU
    uuid: str  # "GPU-…"
    mig: str | None = None  # the "MIG-…" UUID when the entry named a MIG instance of this GPU


def parse_visible_devices(
    spec: str, uuids: Sequence[str], mig_parent: Callable[[str], int | None] | None = None
) -> tuple[list[int], list[str]]:
    """NVML indices of the GPUs a ``CUDA_VISIBLE_DEVICES`` value selects, in CUDA order.

    ``uuids`` are the NVML UUIDs by NVML index. Entries may be integers, (prefixes of) GPU
    UUIDs with or without ``GPU-``, or ``MIG-`` UUIDs, as CUDA accepts; an empty value selects
    no GPU. ``mig_parent`` maps a MIG UUID to the NVML index of its GPU (None: unknown); without
    it a MIG entry is not resolved. Like CUDA, parsing stops at the first entry that names no
    GPU. Returns (indices, notes): notes explain entries that were not used.

    Why UUIDs matter: NVML numbers GPUs by PCI bus ID and recommends looking devices up by
    PCI ID or UUID (NVML API reference, ``nvmlDeviceGetHandleByIndex``,
    https://docs.nvidia.com/deploy/nvml-api/group__nvmlDeviceQueries.html); CUDA numbers them
    fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (CUDA C++ Programming Guide,
    "CUDA Environment Variables"). The two orders agree on machines whose GPUs are all the
    same model; for an exact match pass UUIDs.
    """
    indices: list[int] = []
    notes: list[str] = []
    for raw in spec.split(","):
        token = raw.strip()
        if not token:
            break
        if token.lstrip("-").isdigit():
            i = int(token)
            if not 0 <= i < len(uuids):
                notes.append(f"CUDA_VISIBLE_DEVICES entry {token!r}: no such GPU; CUDA ignores "
                             "it and every entry after it")  # fmt: skip
                break
        elif token.startswith("MIG-"):
            parent = mig_parent(token) if mig_parent is not None else None
            if parent is None:
                notes.append(f"CUDA_VISIBLE_DEVICES entry {token!r}: a MIG instance NVML could "
                             "not place on a GPU here; not used")  # fmt: skip
                break
            notes.append(f"CUDA_VISIBLE_DEVICES entry {token!r}: a MIG instance of GPU {parent}"
                         " (nvidia-smi's index): NVML's readings and process list are the whole "
                         "GPU's")  # fmt: skip
            i = parent
        else:
            want = token if token.startswith("GPU-") else f"GPU-{token}"
            found = [k for k, u in enumerate(uuids) if u.startswith(want)]
            if len(found) != 1:
                notes.append(f"CUDA_VISIBLE_DEVICES entry {token!r}: matches {len(found)} GPUs"
                             " by UUID; CUDA ignores it and every entry after it")  # fmt: skip
                break
            i = found[0]
        if i not in indices:
            indices.append(i)
    return indices, notes


def _mig_parent(nvml: Any, uuids: Sequence[str]) -> Callable[[str], int | None]:
    def parent(mig_uuid: str) -> int | None:
        try:
            mig = nvml.nvmlDeviceGetHandleByUUID(mig_uuid)
            gpu = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
            uuid = _normalise_uuid(nvml.nvmlDeviceGetUUID(gpu))
        except Exception:  # an old driver, no such instance, a test double without MIG
            return None
        return uuids.index(uuid) if uuid in uuids else None

    return parent


def visible_gpus(nvml: Any, spec: str | None = _FROM_ENV) -> tuple[list[VisibleGpu], list[str]]:
    """The GPUs a process may use, as NVML handles, in CUDA's order; and notes on entries of
    ``CUDA_VISIBLE_DEVICES`` that were not used.

    NVML ignores ``CUDA_VISIBLE_DEVICES``: it enumerates every GPU on the machine, so whatever
    names or samples a GPU through NVML must go through this mapping to stay on the GPUs the
    learner was given. ``nvml`` must be initialised (``nvmlInit``) by the caller. ``spec``:
    a ``CUDA_VISIBLE_DEVICES`` value; default: this process's, and all GPUs when it is unset;
    an empty value is no GPU, as in CUDA.
    """
    if spec is _FROM_ENV:
        spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = int(nvml.nvmlDeviceGetCount())
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    uuids = [_normalise_uuid(nvml.nvmlDeviceGetUUID(h)) or "" for h in handles]
    if spec is None:
        return [VisibleGpu(i, handles[i], uuids[i]) for i in range(count)], []
    parent = _mig_parent(nvml, uuids)
    indices, notes = parse_visible_devices(spec, uuids, parent)
    mig_of: dict[int, str] = {}
    for token in (t.strip() for t in spec.split(",")):
        if token.startswith("MIG-") and (i := parent(token)) is not None:
            mig_of.setdefault(i, token)
    return [VisibleGpu(i, handles[i], uuids[i], mig_of.get(i)) for i in indices], notes


def _gpus_from_torch(cuda: Any) -> list[GpuInfo]:
    gpus = []
    for i in range(cuda.device_count()):
        props = cuda.get_device_properties(i)
        gpus.append(
            GpuInfo(
                index=i,
                name=str(props.name),
                memory_bytes=int(props.total_memory),
                compute_capability=(int(props.major), int(props.minor)),
                uuid=_normalise_uuid(getattr(props, "uuid", None)),
                source="torch.cuda",
            )
        )
    return gpus


def _gpus_from_nvml(nvml: Any | None) -> list[GpuInfo]:
    if nvml is None:
        return []
    try:
        nvml.nvmlInit()
    except Exception:
        return []  # no driver: no GPUs; nvml_status() explains why
    try:
        gpus = []
        for i, handle, _, _ in visible_gpus(nvml)[0]:  # NVML ignores CUDA_VISIBLE_DEVICES
            memory = _nvml_field(lambda h=handle: nvml.nvmlDeviceGetMemoryInfo(h).total)
            cc = _nvml_field(lambda h=handle: nvml.nvmlDeviceGetCudaComputeCapability(h))
            gpus.append(
                GpuInfo(
                    index=i,
                    name=_nvml_str(nvml.nvmlDeviceGetName(handle)),
                    memory_bytes=int(memory) if memory is not None else None,
                    compute_capability=(int(cc[0]), int(cc[1])) if cc is not None else None,
                    uuid=_normalise_uuid(_nvml_field(lambda h=handle: nvml.nvmlDeviceGetUUID(h))),
                    source="nvml",
                )
            )
        return gpus
    except Exception:
        return []
    finally:
        _nvml_shutdown(nvml)


def gpu_info(*, cuda: Any | None = None, nvml: Any | None = None) -> list[GpuInfo]:
    """The GPUs this process can see; [] on a machine without any.

    Uses ``torch.cuda`` when it is available, so indices match ``torch.device("cuda", i)``
    (and respect ``CUDA_VISIBLE_DEVICES``). This initialises CUDA in the calling process.
    Otherwise asks NVML, which also sees GPUs a CPU-only torch build cannot use: only those
    ``CUDA_VISIBLE_DEVICES`` leaves visible (``visible_gpus``), in its order, each with NVML's
    index (nvidia-smi's); match devices across the two sources by ``uuid``, not index.

    Args:
        cuda: a stand-in for ``torch.cuda`` (tests).
        nvml: a stand-in for the ``pynvml`` module (tests).
    """
    cuda = torch.cuda if cuda is None else cuda
    if cuda.is_available():
        return _gpus_from_torch(cuda)
    return _gpus_from_nvml(_load_nvml() if nvml is None else nvml)


# ----------------------------------------------------------------------------------------------
# Tiers: what this machine can show truthfully, each with what it cannot.

TIERS = ("cpu", "single-gpu", "multi-gpu")

_TIER_CAN = {
    "cpu": (
        "correctness: every parallel strategy checked against a single-process reference",
        "communication volume (bytes per rank) and schedules (pipeline timelines)",
        "memory accounting: parameters, gradients, optimizer state, activations",
        "relative costs on this host: CPU timings, CPU autocast (bf16/fp16), process metrics",
    ),
    "single-gpu": (
        "real GPU speed, memory and utilisation (NVML)",
        "precision effects on tensor cores: fp32, tf32, bf16, fp16",
        "profiling with torch.profiler, NVTX and Nsight",
        "multi-process correctness over gloo, as on the CPU tier",
    ),
    "multi-gpu": (
        "real scaling across GPUs: one process per GPU over NCCL",
        "real communication cost and interconnect effects (NVLink, PCIe)",
        "everything the single-GPU tier shows",
    ),
}

_TIER_CANNOT = {
    "cpu": (
        "GPU speed, GPU memory or utilisation: on this tier they are modelled from the "
        "published figures in labkit.hardware's PEAK_TABLE and MEMORY_TABLE (each row cites its "
        "NVIDIA datasheet), never measured",
        "MFU against a GPU peak (CPUs have no published peak in labkit's table)",
        "NCCL or interconnect behaviour: gloo over loopback is not representative",
    ),
    "single-gpu": ("multi-GPU scaling and communication cost: NCCL needs one GPU per rank",),
    "multi-gpu": ("multi-node effects: every rank runs on this one host",),
}


@dataclass(frozen=True)
class TierInfo:
    """The tier this machine runs the course in, for printing at the top of each notebook."""

    tier: str
    gpus: tuple[GpuInfo, ...]
    can_show: tuple[str, ...]
    cannot_show: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())

    def __repr__(self) -> str:
        return str(self)

    def __str__(self) -> str:
        lines = [f"Tier: {self.tier}"]
        lines += [f"  {g}" for g in self.gpus]
        lines.append("Can show truthfully:")
        lines += [f"  - {s}" for s in self.can_show]
        lines.append("Cannot show here:")
        lines += [f"  - {s}" for s in self.cannot_show]
        lines += [f"Note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        def items(xs: tuple[Any, ...]) -> str:
            return "".join(f"<li>{html.escape(str(x))}</li>" for x in xs)

        parts = [f"<p><b>Tier: {html.escape(self.tier)}</b></p>"]
        if self.gpus:
            parts.append(f"<ul>{items(self.gpus)}</ul>")
        parts.append(f"<p>Can show truthfully:</p><ul>{items(self.can_show)}</ul>")
        parts.append(f"<p>Cannot show here:</p><ul>{items(self.cannot_show)}</ul>")
        if self.notes:
            parts.append(f"<p>Notes:</p><ul>{items(self.notes)}</ul>")
        return "<div class='labkit-tier'>" + "".join(parts) + "</div>"


def tier(*, cuda: Any | None = None) -> str:
    """ "cpu", "single-gpu" or "multi-gpu": how many CUDA GPUs torch can use in this process."""
    cuda = torch.cuda if cuda is None else cuda
    n = cuda.device_count() if cuda.is_available() else 0
    return TIERS[min(n, 2)]


def describe_tier(*, cuda: Any | None = None, nvml: Any | None = None) -> TierInfo:
    """The tier with what it can and cannot show, plus notes on anything surprising."""
    cuda = torch.cuda if cuda is None else cuda
    name = tier(cuda=cuda)
    gpus = tuple(gpu_info(cuda=cuda, nvml=nvml))
    notes = []
    if name == "cpu" and gpus:
        # NVML sees GPUs that torch cannot use: almost always a CPU-only torch build
        notes.append(
            f"NVML sees {len(gpus)} GPU(s) but torch {torch.__version__} cannot use them: "
            "install a CUDA build of torch to run the GPU tiers"
        )
    return TierInfo(
        tier=name,
        gpus=gpus,
        can_show=_TIER_CAN[name],
        cannot_show=_TIER_CANNOT[name],
        notes=tuple(notes),
    )


# ----------------------------------------------------------------------------------------------
# Published peaks.
#
# Dense numbers only (no 2:4 structured sparsity). From Ampere on, NVIDIA's datasheets print
# tensor-core figures "with sparsity", twice the dense rate, and say so in a footnote. Where a
# sheet prints both (A10, L40S, GH200) the dense figure is taken as printed; where it prints
# only the sparse one (H100, H200, L4) it is halved here and the row says so. Volta and Turing
# have no sparsity support, so their figures are dense as printed. Values are per GPU, at boost
# clock: sustained matmuls reach less, which is why MFU rarely passes ~60%.
#
# bf16 and tf32 tensor cores arrived with Ampere (compute capability 8.0; NVIDIA A100 whitepaper,
# https://images.nvidia.com/aem-dam/en-zz/Solutions/data-center/nvidia-ampere-architecture-whitepaper.pdf):
# a T4 (7.5) or V100 (7.0) has no row for them, and the lookup says why. Their "float16" row is
# the datasheet's tensor-core figure (fp16 inputs, fp32 accumulation).

# Pinned to a commit: torchtitan moves its files between releases.
_TORCHTITAN = ("https://github.com/pytorch/torchtitan/blob/b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/"
               "torchtitan/tools/utils.py#L141")
_ALSO_TORCHTITAN = f"; the same bf16 figure in torchtitan's get_peak_flops, {_TORCHTITAN}"
_A100_SOURCE = (
    "NVIDIA A100 datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/"
    "pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (same rates for SXM4 and PCIe, 40 GB "
    "and 80 GB)"
)
_H100_SOURCE = (
    "NVIDIA H100 datasheet, https://resources.nvidia.com/en-us-tensor-core/"
    "nvidia-tensor-core-gpu-datasheet (tensor-core figures printed with sparsity, halved here)"
)
_H100_NVL_SOURCE = (
    f"torchtitan get_peak_flops, {_TORCHTITAN} (H100 NVL, from "
    "https://www.nvidia.com/en-us/data-center/h100/: 1,671 TFLOP/s with sparsity, halved)"
)
_H200_SOURCE = (
    "NVIDIA H200 page, https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM; tensor-core "
    "figures printed with sparsity, halved here)"
)
_GH200_SOURCE = (
    "NVIDIA GH200 Grace Hopper Superchip datasheet, https://resources.nvidia.com/"
    "en-us-data-center-overview-mc/en-us-data-center-overview/grace-hopper-superchip-datasheet-"
    "partner (prints dense and sparse; dense taken as printed, the same for the 96 GB HBM3 and "
    "144 GB HBM3e versions)"
)
_T4_SOURCE = (
    "NVIDIA T4 datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
    "tesla-t4/t4-tensor-core-datasheet-951643.pdf (Turing: no sparsity, figures dense)"
)
_V100_SOURCE = (
    "NVIDIA V100 datasheet, https://images.nvidia.com/content/technologies/volta/pdf/"
    "volta-v100-datasheet-update-us-1165301-r5.pdf (Volta: no sparsity, figures dense)"
)
_A10_SOURCE = (
    "NVIDIA A10 datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/"
    "pdf/a10-datasheet.pdf (prints dense and sparse; dense taken as printed)"
)
_L4_SOURCE = (
    "NVIDIA L4 datasheet, https://resources.nvidia.com/en-us-data-center-overview/"
    "l4-gpu-datasheet (tensor-core figures printed with sparsity only, halved here)"
)
_L40S_SOURCE = (
    "NVIDIA L40S datasheet, https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413 "
    "(prints dense and sparse; dense taken as printed, although the sheet's sparse 733 is not "
    "quite twice its dense 362.05)"
)


@dataclass(frozen=True)
class PeakRow:
    """One published dense peak: ``device`` (as labkit names it) × ``dtype``."""

    device: str
    dtype: str  # "bfloat16", "float16", "tfloat32" (tensor cores on fp32 data), "float32"
    flops_per_s: float
    source: str


PEAK_TABLE: tuple[PeakRow, ...] = (
    # Volta (compute capability 7.0): SXM2 and PCIe boards differ in clocks and so in peaks.
    PeakRow("V100 SXM2", "float16", 125e12, _V100_SOURCE + " (tensor performance)"),
    PeakRow("V100 SXM2", "float32", 15.7e12, _V100_SOURCE + " (single precision)"),
    PeakRow("V100 PCIe", "float16", 112e12, _V100_SOURCE + " (tensor performance)"),
    PeakRow("V100 PCIe", "float32", 14e12, _V100_SOURCE + " (single precision)"),
    # Turing (7.5)
    PeakRow("T4", "float16", 65e12, _T4_SOURCE + " (mixed precision FP16/FP32)"),
    PeakRow("T4", "float32", 8.1e12, _T4_SOURCE + " (single precision)"),
    # Ampere (8.0 for A100, 8.6 for A10)
    PeakRow("A100", "bfloat16", 312e12, _A100_SOURCE + _ALSO_TORCHTITAN),
    PeakRow("A100", "float16", 312e12, _A100_SOURCE),
    PeakRow("A100", "tfloat32", 156e12, _A100_SOURCE + "; llm.c llmc/mfu.h TF_32"),
    PeakRow("A100", "float32", 19.5e12, _A100_SOURCE + " (non-tensor-core)"),
    PeakRow("A10", "bfloat16", 125e12, _A10_SOURCE + " (250 with sparsity)"),
    PeakRow("A10", "float16", 125e12, _A10_SOURCE + " (250 with sparsity)"),
    PeakRow("A10", "tfloat32", 62.5e12, _A10_SOURCE + " (125 with sparsity)"),
    PeakRow("A10", "float32", 31.2e12, _A10_SOURCE + " (non-tensor-core)"),
    # Ada Lovelace (8.9)
    PeakRow("L4", "bfloat16", 121e12, _L4_SOURCE + " (242 with sparsity)"),
    PeakRow("L4", "float16", 121e12, _L4_SOURCE + " (242 with sparsity)"),
    PeakRow("L4", "tfloat32", 60e12, _L4_SOURCE + " (120 with sparsity)"),
    PeakRow("L4", "float32", 30.3e12, _L4_SOURCE + " (non-tensor-core)"),
    PeakRow("L40S", "bfloat16", 362.05e12,
            _L40S_SOURCE + " (733 with sparsity)" + _ALSO_TORCHTITAN),
    PeakRow("L40S", "float16", 362.05e12, _L40S_SOURCE + " (733 with sparsity)"),
    PeakRow("L40S", "tfloat32", 183e12, _L40S_SOURCE + " (366 with sparsity)"),
    PeakRow("L40S", "float32", 91.6e12, _L40S_SOURCE + " (non-tensor-core)"),
    # Hopper (9.0)
    PeakRow("H100 SXM", "bfloat16", 989e12, _H100_SOURCE + " (1,979 with sparsity)" + _ALSO_TORCHTITAN),
    PeakRow("H100 SXM", "float16", 989e12, _H100_SOURCE + " (1,979 with sparsity)"),
    PeakRow("H100 SXM", "tfloat32", 494.5e12, _H100_SOURCE + " (989 with sparsity)"),
    PeakRow("H100 SXM", "float32", 67e12, _H100_SOURCE + " (non-tensor-core)"),
    PeakRow("H100 PCIe", "bfloat16", 756e12, _H100_SOURCE + " (1,513 with sparsity)" + _ALSO_TORCHTITAN),
    PeakRow("H100 PCIe", "float16", 756e12, _H100_SOURCE + " (1,513 with sparsity)"),
    PeakRow("H100 PCIe", "tfloat32", 378e12, _H100_SOURCE + " (756 with sparsity)"),
    PeakRow("H100 PCIe", "float32", 51e12, _H100_SOURCE + " (non-tensor-core)"),
    PeakRow("H100 NVL", "bfloat16", 835e12, _H100_NVL_SOURCE),
    PeakRow("H100 NVL", "float16", 835e12, _H100_NVL_SOURCE),
    PeakRow("H200 SXM", "bfloat16", 989e12, _H200_SOURCE + " (1,979 with sparsity)" + _ALSO_TORCHTITAN),
    PeakRow("H200 SXM", "float16", 989e12, _H200_SOURCE + " (1,979 with sparsity)"),
    PeakRow("H200 SXM", "tfloat32", 494.5e12, _H200_SOURCE + " (989 with sparsity)"),
    PeakRow("H200 SXM", "float32", 67e12, _H200_SOURCE + " (non-tensor-core)"),
    PeakRow("GH200", "bfloat16", 990e12, _GH200_SOURCE + " (1,979 with sparsity)"),
    PeakRow("GH200", "float16", 990e12, _GH200_SOURCE + " (1,979 with sparsity)"),
    PeakRow("GH200", "tfloat32", 494e12, _GH200_SOURCE + " (989 with sparsity)"),
    PeakRow("GH200", "float32", 67e12, _GH200_SOURCE + " (non-tensor-core)"),
    # Not listed, because no source here gives them: H100 NVL fp32/tf32; the A10G (below); the
    # V100S, V100 SXM3/FHHL, L40 and H200 NVL (different clocks, so not the rows above); any
    # consumer or workstation GPU. A missing row means "no MFU", which is the honest answer.
)

# Devices the lookup recognises but gives no peak, with the reason it says instead.
_NO_PEAK_REASONS = {
    "A10G": (
        "the A10G is an AWS-only board (EC2 G5): NVIDIA publishes no datasheet for it and "
        "neither AWS nor NVIDIA publishes its tensor-core peak; it is not the A10 "
        "(125 TFLOP/s bf16), whose figures do not apply, so no peak is assumed"
    ),
}

# Compute capability of the families whose datasheets predate bf16/tf32 tensor cores
# (https://developer.nvidia.com/cuda-gpus).
_PRE_AMPERE = {"V100 SXM2": (7, 0), "V100 PCIe": (7, 0), "T4": (7, 5)}


@dataclass(frozen=True)
class MemoryRow:
    """Published memory size and bandwidth of one board."""

    device: str
    memory_gb: float  # as marketed (decimal GB); the driver reports a little less, in bytes
    bandwidth_bytes_per_s: float
    source: str


MEMORY_TABLE: tuple[MemoryRow, ...] = (
    MemoryRow("V100 SXM2 16GB", 16, 900e9, _V100_SOURCE),
    MemoryRow("V100 SXM2 32GB", 32, 900e9, _V100_SOURCE),
    MemoryRow("V100 PCIe 16GB", 16, 900e9, _V100_SOURCE),
    MemoryRow("V100 PCIe 32GB", 32, 900e9, _V100_SOURCE),
    MemoryRow("T4 16GB", 16, 300e9, _T4_SOURCE),
    MemoryRow("A100 SXM4 40GB", 40, 1555e9, _A100_SOURCE),
    MemoryRow("A100 PCIe 40GB", 40, 1555e9, _A100_SOURCE),
    MemoryRow("A100 SXM4 80GB", 80, 2039e9, _A100_SOURCE),
    MemoryRow("A100 PCIe 80GB", 80, 1935e9, _A100_SOURCE),
    MemoryRow("A10 24GB", 24, 600e9, _A10_SOURCE),
    MemoryRow("L4 24GB", 24, 300e9, _L4_SOURCE),
    MemoryRow("L40S 48GB", 48, 864e9, _L40S_SOURCE),
    MemoryRow("H100 SXM 80GB", 80, 3.35e12, _H100_SOURCE),
    MemoryRow("H100 PCIe 80GB", 80, 2.0e12, _H100_SOURCE),
    MemoryRow("H200 SXM 141GB", 141, 4.8e12, _H200_SOURCE),
    MemoryRow("GH200 96GB HBM3", 96, 4.0e12, _GH200_SOURCE),
    MemoryRow("GH200 144GB HBM3e", 144, 4.9e12, _GH200_SOURCE),
)

# Tensor-core "dtype" names for lookups. tf32 is not a storage dtype: it is how tensor cores
# multiply float32 data when torch.backends.cuda.matmul.allow_tf32 (or
# torch.set_float32_matmul_precision("high")) allows it. PyTorch's default since 1.12 is off,
# so a plain fp32 model on an A100 should be compared with the "float32" row.
_PEAK_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float16": "float16",
    "tf32": "tfloat32",
    "tfloat32": "tfloat32",
    "fp32": "float32",
    "float": "float32",
    "float32": "float32",
}


def _peak_dtype(dtype: Any) -> str:
    if not isinstance(dtype, (str, torch.dtype)):
        raise ValueError(
            f"dtype must be a torch.dtype or a string such as 'bf16' or 'tf32'; got {dtype!r}"
        )
    name = str(dtype).removeprefix("torch.").lower()
    return _PEAK_DTYPE_ALIASES.get(name, name)


class DeviceMatch(NamedTuple):
    """How a reported device name maps onto the tables: a ``family`` (PEAK_TABLE) and a
    ``board`` (MEMORY_TABLE), each None when not identified, with the ``reason``."""

    family: str | None
    board: str | None
    reason: str | None


_CPU_NAME = re.compile(r"\b(cpu|xeon|epyc|ryzen|opteron|processor|graviton|neoverse)\b", re.I)
_MIG_PROFILE = re.compile(r"^\d+G\.\d+GB$")  # e.g. "1g.10gb" in a MIG device name

# Tokens each model may carry. Anything else in the name means a variant this table does not
# know (A100X, V100-SXM3, an L40S vGPU profile "L40S-48Q", H100 NVL in an H200 name, …), and
# then no peak is assumed. Whole tokens only: "A10" never matches "A100" or "A10G", "L4" never
# "L40S", "H200" never "GH200".
_ALLOWED_TOKENS = {
    "V100": {"V100", "SXM2", "PCIE", "16GB", "32GB"},
    "T4": {"T4"},
    "A10": {"A10"},
    "A10G": {"A10G"},
    "A100": {"A100", "SXM", "SXM4", "PCIE", "40GB", "80GB"},
    "L4": {"L4"},
    "L40S": {"L40S"},
    "H100": {"H100", "SXM", "SXM5", "HBM3", "PCIE", "NVL", "80GB"},
    "H200": {"H200", "SXM", "SXM5", "HBM3E", "141GB"},
    "GH200": {"GH200", "480GB", "144G", "144GB", "HBM3", "HBM3E"},
}
# Models with one board: (family in PEAK_TABLE, board in MEMORY_TABLE or None).
_SINGLE_BOARD = {
    "T4": ("T4", "T4 16GB"),
    "A10": ("A10", "A10 24GB"),
    "A10G": ("A10G", None),  # no public bandwidth figure from AWS or NVIDIA
    "L4": ("L4", "L4 24GB"),
    "L40S": ("L40S", "L40S 48GB"),
}


def match_device(device_name: str) -> DeviceMatch:
    """Map a torch/NVML device name to a row of the tables, conservatively.

    Names as drivers report them (llm.c llmc/mfu.h lists several): "Tesla V100-SXM2-16GB",
    "Tesla V100-PCIE-32GB", "Tesla T4", "NVIDIA A10", "NVIDIA A10G", "NVIDIA A100-SXM4-80GB",
    "NVIDIA A100-PCIE-40GB", "NVIDIA L4", "NVIDIA L40S", "NVIDIA H100 80GB HBM3" (the SXM5
    board), "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA GH200 480GB" (the
    96 GB HBM3 superchip; "480GB" is its CPU memory), "NVIDIA GH200 144G HBM3e".

    The name is split into tokens ("NVIDIA A100-SXM4-80GB" → A100, SXM4, 80GB). Exactly one
    known model token must be present and every other token must be one that model is known to
    carry; the form factor must be unambiguous where it changes the peak (V100 SXM2 125, PCIe
    112 TFLOP/s fp16; H100 SXM 989, PCIe 756, NVL 835 bf16). So "NVIDIA A100X" and
    "Tesla V100S-PCIE-32GB" match nothing, "NVIDIA H100" alone is ambiguous, and a MIG slice
    (a fraction of the GPU's SMs) has no peak.
    """
    if not isinstance(device_name, str) or not device_name.strip():
        raise ValueError(f"device_name must be a non-empty string; got {device_name!r}")
    name = device_name.strip()
    if name.lower() == "cpu" or _CPU_NAME.search(name):
        return DeviceMatch(
            None,
            None,
            f"no published peak for CPUs in this table ({name!r}): MFU is not "
            "computed; measured_matmul_flops() gives a measured ceiling instead",
        )
    tokens = [t for t in re.split(r"[\s\-_]+", name.upper()) if t and t not in ("NVIDIA", "TESLA")]
    if "MIG" in tokens or any(_MIG_PROFILE.match(t) for t in tokens):
        return DeviceMatch(
            None,
            None,
            f"{name!r} is a MIG slice with a fraction of the GPU's SMs: no published "
            "peak, MFU is not computed",
        )
    models = [t for t in tokens if t in _ALLOWED_TOKENS]

    def no_peak(why: str = "") -> DeviceMatch:
        return DeviceMatch(None, None, f"no peak known for {name!r}{why}: MFU is not computed")

    if len(models) != 1:
        return no_peak()
    model = models[0]
    extra = [t for t in tokens if t not in _ALLOWED_TOKENS[model]]
    if extra:
        return no_peak(f" (unrecognised variant {' '.join(extra)!r} of the {model})")
    toks = set(tokens)

    if model in _SINGLE_BOARD:
        family, board = _SINGLE_BOARD[model]
        return DeviceMatch(family, board, None)

    if model == "V100":
        forms = {f for f, mark in (("SXM2", "SXM2"), ("PCIe", "PCIE")) if mark in toks}
        if len(forms) != 1:
            return no_peak(
                " (the name does not tell V100 SXM2, 125 TFLOP/s fp16, from PCIe, 112)"
            )
        form = forms.pop()
        size = "32GB" if "32GB" in toks else ("16GB" if "16GB" in toks else None)
        return DeviceMatch(f"V100 {form}", f"V100 {form} {size}" if size else None, None)

    if model == "A100":
        # Same compute rates for every A100 board; memory differs by form factor and size.
        form = "PCIe" if "PCIE" in toks else ("SXM4" if toks & {"SXM", "SXM4"} else None)
        size = "80GB" if "80GB" in toks else ("40GB" if "40GB" in toks else None)
        board = f"A100 {form} {size}" if form and size else None
        return DeviceMatch("A100", board, None)

    if model == "H100":
        forms = {
            f
            for f, marks in (("SXM", {"SXM", "SXM5", "HBM3"}), ("PCIe", {"PCIE"}), ("NVL", {"NVL"}))
            if toks & marks
        }
        if len(forms) != 1:
            return no_peak(
                " (the name does not tell H100 SXM, 989 TFLOP/s bf16, from PCIe, 756, or NVL, 835)"
            )
        form = forms.pop()
        board = None
        if form == "SXM" and "80GB" in toks:  # "NVIDIA H100 80GB HBM3" is the SXM5 board
            board = "H100 SXM 80GB"
        elif form == "PCIe":  # the datasheet's only H100 PCIe has 80 GB
            board = "H100 PCIe 80GB"
        return DeviceMatch(f"H100 {form}", board, None)

    if model == "GH200":
        # One compute column in the datasheet for both memory versions; the board follows the
        # name: "480GB" (its LPDDR5X) is the 96 GB HBM3 version, "144G HBM3e" the other.
        hbm3e = bool(toks & {"144G", "144GB", "HBM3E"})
        hbm3 = "480GB" in toks or "HBM3" in toks
        board = None
        if hbm3e and not hbm3:
            board = "GH200 144GB HBM3e"
        elif hbm3 and not hbm3e:
            board = "GH200 96GB HBM3"
        return DeviceMatch("GH200", board, None)

    # H200: torch and NVML name the SXM part plain "NVIDIA H200"; "H200 NVL" (lower clocks)
    # carries NVL and is rejected above as an unrecognised variant.
    return DeviceMatch("H200 SXM", "H200 SXM 141GB", None)


@dataclass(frozen=True)
class Peak:
    """Result of a peak lookup: a sourced value, or None and the reason there is none."""

    device_name: str  # the name asked about
    dtype: str
    flops_per_s: float | None
    source: str | None
    matched: str | None  # the PEAK_TABLE device it matched
    reason: str | None  # why flops_per_s is None

    @property
    def known(self) -> bool:
        return self.flops_per_s is not None

    def __str__(self) -> str:
        if self.flops_per_s is None:
            return f"peak {self.dtype}: N/A ({self.reason})"
        return (
            f"peak {self.dtype} on {self.matched}: {self.flops_per_s / 1e12:g} TFLOP/s "
            f"(published, dense; {self.source})"
        )


def peak_flops(device_name: str, dtype: Any = torch.bfloat16) -> Peak:
    """Published dense peak FLOP/s of ``device_name`` in ``dtype``, or None with the reason.

    ``device_name`` is what ``torch.cuda.get_device_name()`` or NVML reports ("NVIDIA H100 80GB
    HBM3", "NVIDIA A100-SXM4-80GB", …); see ``match_device`` for the matching rules. ``dtype`` is
    a torch dtype or "bf16" / "fp16" / "tf32" / "fp32": the precision the matmuls run in (fp32
    data on tensor cores is "tf32" only when TF32 is enabled).
    """
    dt = _peak_dtype(dtype)
    match = match_device(device_name)
    if match.family is None:
        return Peak(device_name, dt, None, None, None, match.reason)
    for row in PEAK_TABLE:
        if row.device == match.family and row.dtype == dt:
            return Peak(device_name, dt, row.flops_per_s, row.source, row.device, None)
    why = f"no published {dt} peak for {match.family} in this table"
    if match.family in _NO_PEAK_REASONS:
        why = _NO_PEAK_REASONS[match.family]
    elif match.family in _PRE_AMPERE and dt in ("bfloat16", "tfloat32"):
        major, minor = _PRE_AMPERE[match.family]
        short = {"bfloat16": "bf16", "tfloat32": "tf32"}[dt]
        why = (f"the {match.family} (compute capability {major}.{minor}) has no {short} tensor "
               f"cores: they arrived with compute capability 8.0 (Ampere), so a {short} run "
               f"there is emulated without them and has no published peak")
    return Peak(device_name, dt, None, None, match.family, f"{why}: MFU is not computed")


def memory_spec(device_name: str) -> MemoryRow | None:
    """Published memory size and bandwidth for ``device_name``, or None when not identified."""
    board = match_device(device_name).board
    return next((row for row in MEMORY_TABLE if row.device == board), None)


# ----------------------------------------------------------------------------------------------
# Published interconnect bandwidths, per GPU and per direction (a link carries as much each way at
# once). Vendors print NVLink and PCIe as both directions added together; the rows halve them and
# say so. Network rates are line rates in bits per second, divided by 8. Peaks: what a collective
# reaches is less (scaling-book gpus.md: about 370 of NVLink 4's 450 GB/s each way), which
# nccl-tests reports as busbw.

_H100_PAGE = "NVIDIA H100 page, https://www.nvidia.com/en-us/data-center/h100/"


@dataclass(frozen=True)
class LinkRow:
    """One published link bandwidth: bytes per second each way, per GPU."""

    name: str
    bytes_per_s: float
    source: str


# fmt: off
LINK_TABLE: tuple[LinkRow, ...] = (
    LinkRow("NVLink 4", 450e9, f"{_H100_PAGE} (H100 SXM: NVLink 900 GB/s, both directions "
            "together; the H200 page prints the same 900 GB/s); jax-ml/scaling-book gpus.md: "
            "450 GB/s each way per GPU"),
    LinkRow("NVLink 3", 300e9, f"{_A100_SOURCE}: NVLink 600 GB/s per A100 SXM4, both "
            "directions together"),
    LinkRow("PCIe 5.0 x16", 64e9, f"{_H100_PAGE} (PCIe Gen5 128 GB/s, both directions "
            "together); PCI-SIG PCIe 5.0 specification, 32 GT/s per lane"),
    LinkRow("PCIe 4.0 x16", 32e9, f"{_A100_SOURCE}: PCIe Gen4 64 GB/s, both directions "
            "together; PCI-SIG PCIe 4.0 specification, 16 GT/s per lane"),
    LinkRow("InfiniBand NDR 400 Gb/s", 50e9, "jax-ml/scaling-book gpus.md (H100 nodes: 400 Gb/s "
            "InfiniBand per GPU); Llama Team 2024, arXiv 2407.21783, section 3.3.1 (\"400 Gbps "
            "interconnects between GPUs\"); 400e9 bit/s / 8"),
    LinkRow("RoCE 400 Gb/s", 50e9, "Llama Team 2024, arXiv 2407.21783, section 3.3.1, "
            "\"Network\": Llama 3 405B trained on RDMA over Converged Ethernet (Arista 7800 and "
            "Minipack2 switches), the smaller models on InfiniBand; \"400 Gbps interconnects "
            "between GPUs\"; 400e9 bit/s / 8"),
    LinkRow("InfiniBand HDR 200 Gb/s", 25e9, "Narayanan et al. 2021, arXiv 2104.04473, "
            "section 5 (Selene: eight 200 Gbps HDR InfiniBand HCAs per node of eight A100s, one "
            "per GPU); 200e9 bit/s / 8"),
    LinkRow("100 GbE", 12.5e9, "IEEE 802.3 100 Gb/s Ethernet: 100e9 bit/s line rate / 8"),
)
# fmt: on


def link_bandwidth(name: str) -> LinkRow:
    """The LINK_TABLE row called ``name``; an unknown link gets no guessed bandwidth."""
    for row in LINK_TABLE:
        if row.name == name:
            return row
    raise ValueError(f"link {name!r} is not in labkit.hardware.LINK_TABLE, so it has no "
                     f"published bandwidth here: use one of {[r.name for r in LINK_TABLE]}, or "
                     "measure the link and pass that figure as measured")  # fmt: skip


# ----------------------------------------------------------------------------------------------
# What this GPU runs: the default autocast dtype, and the attention kernel SDPA picks.

BF16_MIN_CAPABILITY = (8, 0)
"""bf16 (and tf32) tensor cores arrived with Ampere, compute capability 8.0 (NVIDIA A100
whitepaper; https://developer.nvidia.com/cuda-gpus lists each GPU's capability). A T4 (7.5) or
V100 (7.0) accepts bf16 tensors, but ``torch.cuda.is_bf16_supported()`` only says so because
it can *emulate* them (``including_emulation=True``, torch/cuda/__init__.py): the matmuls run
without tensor cores."""
TENSOR_CORE_MIN_CAPABILITY = (7, 0)
"""fp16 tensor cores arrived with Volta, compute capability 7.0 (NVIDIA V100 datasheet)."""


class AutocastChoice(NamedTuple):
    """The autocast dtype a run should use on a device, and why.

    ``dtype`` is a ``TrainConfig.dtype`` value ("bfloat16", "float16" or "float32": autocast
    off). ``scaler`` says whether a loss scaler (``torch.amp.GradScaler``) must go with it:
    float16 only, since its 5 exponent bits flush small gradients to zero (Micikevicius et al.
    2018, arXiv 1710.03740) while bfloat16 keeps float32's 8.
    """

    dtype: str
    scaler: bool
    reason: str


def _check_capability(capability: Any) -> tuple[int, int] | None:
    if capability is None:
        return None
    ok = (isinstance(capability, (tuple, list)) and len(capability) == 2
          and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in capability))
    if not ok:
        raise ValueError(
            f"capability={capability!r} is not a compute capability: pass (major, minor) as "
            "torch.cuda.get_device_capability(device) returns it, e.g. (8, 0), or None for a "
            "machine without a CUDA GPU"
        )
    return int(capability[0]), int(capability[1])


def autocast_dtype_for(
    capability: tuple[int, int] | None, requested: str | None = None
) -> AutocastChoice:
    """The autocast dtype to train in on a GPU of this compute capability (a pure function).

    ``capability`` is ``torch.cuda.get_device_capability(device)``, or None for no CUDA GPU.
    ``requested`` is what a config asked for ("bfloat16", "float16", "float32"); None asks for
    the default. The rule, from the hardware (see ``BF16_MIN_CAPABILITY``):

    * 8.0 and newer (A100, A10, L4, L40S, H100, H200, GH200): bfloat16, no loss scaling;
    * 7.0 to 7.5 (V100, T4): float16 with a GradScaler. A request for bfloat16 becomes float16
      with the reason: bf16 there is emulated without tensor cores (slower than fp16, and with
      no published peak to compute MFU against);
    * older GPUs have no tensor cores: float32 by default;
    * no CUDA GPU (None): float32 by default (the CPU presets); a request is kept, since CPU
      autocast runs bf16 and fp16 (``labkit.precision.checked_autocast`` refuses what it cannot).

    float32 and float16 requests are always kept; a float16 run gets ``scaler=True``.

    >>> autocast_dtype_for((7, 5)).dtype, autocast_dtype_for((9, 0)).dtype
    ('float16', 'bfloat16')
    """
    cc = _check_capability(capability)
    allowed = ("bfloat16", "float16", "float32")
    if requested is not None and requested not in allowed:
        raise ValueError(f"requested={requested!r} is not an autocast dtype labkit trains in: "
                         f"one of {', '.join(map(repr, allowed))}, or None for the default")  # fmt: skip
    where = "no CUDA GPU" if cc is None else f"compute capability {cc[0]}.{cc[1]}"
    if requested == "float32":
        return AutocastChoice("float32", False, f"float32 requested ({where}): autocast off")
    if requested == "float16":
        return AutocastChoice("float16", True, f"float16 requested ({where}): with a "
                              "GradScaler, since fp16's range flushes small gradients to zero")  # fmt: skip
    if cc is None:
        if requested == "bfloat16":
            return AutocastChoice("bfloat16", False, "bfloat16 requested on the CPU: CPU "
                                  "autocast runs it (fast only with AVX512-BF16 or AMX, see "
                                  "cpu_info().flags)")  # fmt: skip
        return AutocastChoice("float32", False, "no CUDA GPU: float32, autocast off (the CPU "
                              "presets' default)")  # fmt: skip
    if cc >= BF16_MIN_CAPABILITY:
        return AutocastChoice("bfloat16", False, f"{where} (Ampere or newer) has bf16 tensor "
                              "cores; bf16 keeps fp32's exponent range, so no loss scaling")  # fmt: skip
    if cc >= TENSOR_CORE_MIN_CAPABILITY:
        asked = "bfloat16 requested, but " if requested == "bfloat16" else ""
        return AutocastChoice("float16", True, f"{asked}{where} has fp16 tensor cores and no "
                              "bf16 ones (bf16 arrived with 8.0, Ampere; here it is emulated "
                              "without tensor cores): float16 with a GradScaler")  # fmt: skip
    if requested == "bfloat16":
        return AutocastChoice("float32", False, f"bfloat16 requested, but {where} has neither "
                              "bf16 support nor tensor cores: float32")  # fmt: skip
    return AutocastChoice("float32", False, f"{where} has no tensor cores (they arrived with "
                          "7.0, Volta): float32")  # fmt: skip


def default_autocast_dtype(
    device: str | torch.device | None = None, requested: str | None = None, *,
    cuda: Any | None = None,
) -> AutocastChoice:
    """:func:`autocast_dtype_for` with the capability read from ``device`` (default: CUDA's
    current device if there is one). A CUDA device initialises CUDA; a CPU device does not."""
    cuda = torch.cuda if cuda is None else cuda
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type != "cuda":
        return autocast_dtype_for(None, requested)
    if not cuda.is_available():
        if dev is not None:
            raise ValueError(f"device={str(dev)!r} but torch.cuda.is_available() is False: "
                             "pass device='cpu', or install a CUDA build of torch")  # fmt: skip
        return autocast_dtype_for(None, requested)
    index = dev.index if dev is not None and dev.index is not None else cuda.current_device()
    major, minor = cuda.get_device_capability(index)
    return autocast_dtype_for((int(major), int(minor)), requested)


# The aten ops behind each fused SDPA kernel, as torch 2.13's dispatcher names them. The math
# kernel has no op of its own: it is composite (matmul, softmax, matmul), which is exactly why
# it stores the s×s attention matrix for the backward pass.
SDPA_FUSED_OPS = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_fused_attention_overrideable": "overrideable",
}
_SDPA_DOCS = ("https://docs.pytorch.org/docs/stable/generated/"
              "torch.nn.functional.scaled_dot_product_attention.html")


@dataclass(frozen=True)
class SdpaCheck:
    """Which kernel ``F.scaled_dot_product_attention`` ran for one shape, found by running it.

    ``backend`` is "flash", "efficient", "cudnn", "overrideable" or "math". Every fused kernel
    keeps one float32 log-sum-exp per row instead of the s×s matrix, so the memory prediction
    ``formulas.activation_bytes_per_layer(attention=...)`` takes ``formula_attention``: "flash"
    for a fused kernel, "materialized" for math. ``warning`` is the sentence a notebook prints
    when the prediction's default assumption (a fused kernel) does not hold; None when it does.
    """

    backend: str
    op: str | None  # the aten op observed; None for math, which has none of its own
    device: str
    dtype: str
    seq_len: int
    head_dim: int
    dropout_p: float
    is_causal: bool
    pinned: tuple[str, ...]  # the SDPBackend names the probe was limited to; () if none

    @property
    def materializes_scores(self) -> bool:
        return self.backend == "math"

    @property
    def formula_attention(self) -> str:
        return "materialized" if self.materializes_scores else "flash"

    @property
    def warning(self) -> str | None:
        if not self.materializes_scores:
            return None
        drop = f", dropout {self.dropout_p:g}" if self.dropout_p else ""
        return (
            f"SDPA ran its math kernel here ({self.device}, {self.dtype}, s={self.seq_len}, "
            f"head size {self.head_dim}{drop}): it stores the s×s attention matrix for backward "
            "(a·s²·b values per layer, more with dropout), which a prediction that assumes a "
            "fused kernel (attention='flash') leaves out. Predict with "
            "attention='materialized', or pin the fused kernels with "
            "torch.nn.attention.sdpa_kernel([SDPBackend.FLASH_ATTENTION, "
            "SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]) so that torch raises "
            f"instead of falling back ({_SDPA_DOCS})"
        )

    def __str__(self) -> str:
        kind = ("stores the s×s matrix" if self.materializes_scores
                else "no s×s matrix, one log-sum-exp per row")  # fmt: skip
        pin = f", limited to {', '.join(self.pinned)}" if self.pinned else ""
        return (f"SDPA backend: {self.backend} ({kind}), measured on {self.device}, "
                f"{self.dtype}, s={self.seq_len}, head size {self.head_dim}{pin}")  # fmt: skip


def sdpa_backend(
    *,
    seq_len: int,
    head_dim: int,
    n_head: int = 1,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    is_causal: bool = True,
    dropout_p: float = 0.0,
    requires_grad: bool = True,
    backends: Sequence[Any] | None = None,
) -> SdpaCheck:
    """Which SDPA kernel runs for this shape here: measured by running it once, not guessed.

    One ``F.scaled_dot_product_attention`` call on random (1, n_head, seq_len, head_dim)
    tensors of ``dtype`` on ``device`` runs under a ``TorchDispatchMode`` that records the aten
    ops it reaches; a fused kernel shows up as its own op (``SDPA_FUSED_OPS``), the math kernel
    as none. The choice depends on all of device, dtype, head size, dropout, mask and whether
    gradients are needed (torch's sdp_utils): on CUDA, flash needs fp16/bf16 and compute
    capability 8.0+, the memory-efficient kernel also runs fp32 and older GPUs (but bf16 only
    from 8.0, so bf16 on a T4 falls back to math); on CPU, torch 2.13 runs a flash-style kernel
    unless dropout is on. Pass the shapes and dtype of the real model (under autocast, the
    autocast dtype). ``backends`` (``torch.nn.attention.SDPBackend`` members) limits the probe
    as ``torch.nn.attention.sdpa_kernel`` would; a limit nothing satisfies raises torch's own
    "No available kernel" error, which is how a notebook can *enforce* a fused kernel.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel  # torch.nn.attention: on use only
    from torch.utils._python_dispatch import TorchDispatchMode

    for name, value in (("seq_len", seq_len), ("head_dim", head_dim), ("n_head", n_head)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r} is not allowed: a positive integer")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p={dropout_p!r} is not allowed: a probability in [0, 1)")
    dt = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not a floating-point torch dtype "
                         "(torch.float32, torch.bfloat16, torch.float16)")  # fmt: skip
    pinned = [] if backends is None else list(backends)
    if any(not isinstance(b, SDPBackend) for b in pinned):
        raise ValueError(f"backends={backends!r}: pass torch.nn.attention.SDPBackend members")
    dev = torch.device(device)

    ops: list[str] = []

    class _Record(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Sequence = (),
                               kwargs: dict | None = None) -> Any:  # fmt: skip
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    gen = torch.Generator(device=dev).manual_seed(0)  # leaves the global RNG alone
    q, k, v = (torch.randn(1, n_head, seq_len, head_dim, generator=gen, device=dev, dtype=dt)
               .requires_grad_(requires_grad) for _ in range(3))  # fmt: skip
    limit = sdpa_kernel(pinned) if pinned else contextlib.nullcontext()
    with limit, _Record():
        torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=is_causal, dropout_p=dropout_p
        )
    fused = [op for op in ops if op in SDPA_FUSED_OPS]
    return SdpaCheck(
        backend=SDPA_FUSED_OPS[fused[0]] if fused else "math",
        op=fused[0] if fused else None,
        device=str(dev),
        dtype=str(dt).removeprefix("torch."),
        seq_len=seq_len,
        head_dim=head_dim,
        dropout_p=float(dropout_p),
        is_causal=is_causal,
        pinned=tuple(b.name for b in pinned),
    )


# ----------------------------------------------------------------------------------------------
# Measured ceiling


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
    if not shapes or any(
        len(s) != 3 or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in s)
        for s in shapes
    ):
        raise ValueError(f"shapes must be (m, k, n) triples of positive integers, got {shapes!r}")
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
