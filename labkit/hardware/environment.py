"""The software and hardware this kernel runs on, in the few lines a notebook prints first.

Python's and torch's versions (and whether torch was built for CUDA), the CPU, whether NVML
works, and each GPU: what notebook 00 shows before it decides the tier. Apart from the
detection modules (``cpu``, ``nvml``, ``gpus``) because it only gathers and tells what they
found; ``labkit doctor`` gives the full verdicts.

    from labkit import hardware
    print(hardware.environment().describe())
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

import torch

from labkit.hardware.cpu import CpuInfo, cpu_info
from labkit.hardware.gpus import GpuInfo, gpu_info
from labkit.hardware.nvml import NvmlStatus, nvml_status


@dataclass(frozen=True)
class Environment:
    """What :func:`environment` found."""

    python_version: str
    """``platform.python_version()``, e.g. "3.11.7"."""
    torch_version: str
    """``torch.__version__``, e.g. "2.13.0+cpu"."""
    cuda_version: str | None
    """The CUDA version torch was built for (``torch.version.cuda``); None: a CPU-only build."""
    cpu: CpuInfo
    nvml: NvmlStatus
    gpus: tuple[GpuInfo, ...]

    def describe(self) -> str:
        build = f"CUDA {self.cuda_version}" if self.cuda_version else "CPU-only build"
        lines = [f"Python {self.python_version}, torch {self.torch_version} ({build})",
                 str(self.cpu),
                 f"NVML (the NVIDIA driver's monitoring library): "
                 f"{'ok' if self.nvml.ok else 'unavailable'}: {self.nvml.message}"]  # fmt: skip
        return "\n".join(lines + [str(gpu) for gpu in self.gpus])


def environment() -> Environment:
    """Python, torch, the CPU, NVML and the GPUs here, detected now."""
    return Environment(python_version=platform.python_version(), torch_version=torch.__version__,
                       cuda_version=torch.version.cuda, cpu=cpu_info(), nvml=nvml_status(),
                       gpus=tuple(gpu_info()))  # fmt: skip
