"""Notebook 05's setup: the device, the tier, and what this tier shows of batch-size tuning.

:func:`open_lab` validates the size, picks the device, describes the tier and, on a CPU, limits
PyTorch to one thread (see :func:`labkit.hardware.limit_cpu_threads`: on a shared machine,
multi-threaded CPU kernels stall each other at every barrier, and timings would measure the
neighbours). :meth:`Lab.describe` is what the notebook prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from labkit import config, hardware, train

GPU_SHOWS = ("This tier shows real GPU numbers: throughput and MFU against the published peak, "
             "a finder that hits real CUDA out-of-memory errors and recovers, and the allocator "
             "checked back at its baseline after each failure.")  # fmt: skip
CPU_SHOWS = ("This tier shows every effect for real, at CPU scale: tokens/s against batch size, "
             "memory counted from real tensors, accumulation and checkpointing, learning-rate and "
             "noise-scale runs, and a 2-rank job over gloo. A CPU has no device memory to run out "
             "of, so section 2's finder runs against a budget you set (not a device limit), and no "
             "CPU has a published peak, so there is no MFU here. GPU figures are never invented.")  # fmt: skip


@dataclass(frozen=True)
class Lab:
    """Where notebook 05 runs: its size, device and tier."""

    size: str
    """The size the lab runs at ("lab" where "gpu" was asked for and no GPU was found)."""
    asked: str
    """The size asked for."""
    device: torch.device
    tier: Any
    """:func:`labkit.hardware.describe_tier`'s answer."""
    threads: str | None
    """On a CPU, the sentence :func:`labkit.hardware.limit_cpu_threads` returned."""

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def dtype_for(self, cfg: config.RunConfig) -> str:
        """The step's dtype: CPU autocast is slow without bf16 units, so float32 on a CPU; on a
        GPU the preset's autocast dtype (fp16 before compute capability 8.0)."""
        if not self.on_gpu:
            return "float32"
        return hardware.default_autocast_dtype("cuda", cfg.train.dtype).dtype

    def describe(self) -> str:
        lines = []
        if self.size != self.asked:
            lines += [f"size={self.asked!r} needs a CUDA GPU (none found): running the "
                      f"{self.size!r} sizes instead", ""]  # fmt: skip
        lines += [str(self.tier), "", GPU_SHOWS if self.on_gpu else CPU_SHOWS]
        if self.threads is not None:
            lines.append(self.threads)
        return "\n".join(lines)


def open_lab(size: str, *, threads: int = 1) -> Lab:
    """Validate ``size``, pick the device, describe the tier; on a CPU run on ``threads``."""
    config.preset(size)  # validates `size` before anything runs
    device = train.resolve_device("auto")
    on_gpu = device.type == "cuda"
    runs = "lab" if size == "gpu" and not on_gpu else size
    tier = hardware.describe_tier()
    limited = None if on_gpu else str(hardware.limit_cpu_threads(threads))
    return Lab(size=runs, asked=size, device=device, tier=tier, threads=limited)
