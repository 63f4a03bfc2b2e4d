"""The host CPU: what it is, how many cores this process may use, and how many threads PyTorch
gives a kernel.

Apart from the GPU modules because a CPU is always there: ``cpu_info`` reads /proc/cpuinfo (or
``platform``) and never touches a GPU, and the course's CPU tier rests on it.

    from labkit import hardware
    print(hardware.cpu_info())            # model, usable/logical/physical cores, bf16 flags
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch

from labkit.validate import whole

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
    n = whole("n", n, low=1, high=os.cpu_count() or 1,
              why="threads, at most this machine's logical CPUs")
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return (f"PyTorch CPU threads: {n} (was {before}), so that other work on this machine "
            f"slows these measurements by its share of the cores, not by stalling every kernel")

