"""The tier this machine runs the course in ("cpu", "single-gpu", "multi-gpu"), with what each
can show truthfully and what it cannot.

Apart from detection because it is the course's reading of it: the sentences each notebook
prints at its top, so that a learner on a laptop knows which figures are measured here and
which are modelled from the published tables.

    from labkit import hardware
    hardware.describe_tier()              # the tier, its GPUs, and what it can and cannot show
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

import torch

from labkit.hardware.capabilities import BF16_MIN_CAPABILITY
from labkit.hardware.gpus import GpuInfo, gpu_info

TIERS = ("cpu", "single-gpu", "multi-gpu")

_PRECISION = "precision effects on tensor cores: fp32, tf32, bf16, fp16"
_PRECISION_BEFORE_BF16 = "precision effects on tensor cores: fp32 and fp16 (bf16 only emulated)"

_TIER_CAN = {
    "cpu": (
        "correctness: every parallel strategy checked against a single-process reference",
        "communication volume (bytes per rank) and schedules (pipeline timelines)",
        "memory accounting: parameters, gradients, optimizer state, activations",
        "relative costs on this host: CPU timings, CPU autocast (bf16/fp16), process metrics",
    ),
    "single-gpu": (
        "real GPU speed, memory and utilisation (NVML)",
        _PRECISION,
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
    can, cannot = _TIER_CAN[name], _TIER_CANNOT[name]
    before_bf16 = sorted({g.compute_capability for g in gpus if g.compute_capability
                          and g.compute_capability < BF16_MIN_CAPABILITY})  # fmt: skip
    if name != "cpu" and before_bf16:
        # A T4 (7.5) or V100 (7.0): fp16 tensor cores only; bf16 and tf32 would be emulated.
        major, minor = before_bf16[0]
        can = tuple(_PRECISION_BEFORE_BF16 if s == _PRECISION else s for s in can)
        cannot = (*cannot, f"bf16 or tf32 on tensor cores: compute capability {major}.{minor} "
                           "has none (they arrived with 8.0); notebooks train in fp16 with a loss "
                           "scaler here and say so")  # fmt: skip
    return TierInfo(tier=name, gpus=gpus, can_show=can, cannot_show=cannot, notes=tuple(notes))

