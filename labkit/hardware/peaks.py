"""Published hardware figures, each row with its source: dense peak FLOP/s (``PEAK_TABLE``),
memory size and bandwidth (``MEMORY_TABLE``), interconnect bandwidth (``LINK_TABLE``); and the
conservative lookups into them (``match_device``, ``peak_flops``, ``memory_spec``,
``link_bandwidth``).

Apart from detection because these are data, not readings of this machine: a device name that
is not recognised exactly gets *no* peak, with the reason, never a guess. (torchtitan's
``get_peak_flops`` falls back to the A100 figure for an unknown GPU, and nanoGPT hard-codes it:
an H100 then shows an MFU above 100%.) A measured ceiling is :mod:`labkit.hardware.ceilings`.

    from labkit import hardware
    print(hardware.peak_flops("Tesla T4", "fp16"))        # 65 TFLOP/s, with the datasheet URL
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

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

