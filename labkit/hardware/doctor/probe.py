"""What the doctor's checks share: a ``Probe`` of this machine's facts (is CUDA usable? does
NVML work? which GPUs?), each read once, lazily; the versions installed and pinned; and the
fixes several checks give.

Apart from the checks because several of them need the same facts, and reading NVML or
``torch.cuda`` once per report is both faster and consistent. The probe also takes stand-ins
for ``torch.cuda`` and ``pynvml``, which is how the tests drive every check without a GPU.
"""

from __future__ import annotations

import importlib.metadata
import re
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from labkit import hardware
from labkit.hardware.nvml import load_nvml, nvml_session
from labkit.validate import positive, whole

# Fixes shared by several checks.
FIX_REQUIREMENTS = "run `./course setup` (installs the tested pins from requirements.txt)"
FIX_CUDA_TORCH = (
    "install a CUDA build of torch: `TORCH_INDEX_URL=<PyTorch wheel index for your CUDA "
    "version> ./course setup` (README, 'GPU machines'); on a GPU image that has one, "
    "`LABKIT_KEEP_TORCH=1 ./course setup` keeps it"
)


class Probe:
    """Facts about this machine, each read once, on first use.

    Args:
        cuda: a stand-in for ``torch.cuda`` (tests).
        nvml: a stand-in for the ``pynvml`` module (tests); default: nvidia-ml-py if installed.
        allreduce: run the 2-process all-reduce job (False: report it as skipped).
        nproc: ranks in that job (>= 2).
        timeout_s: wall-clock limit of that job, seconds.
    """

    def __init__(
        self,
        *,
        cuda: Any | None = None,
        nvml: Any | None = None,
        allreduce: bool = True,
        nproc: int = 2,
        timeout_s: float = 120,
    ) -> None:
        nproc = whole("nproc", nproc, low=2, why="ranks in the all-reduce")
        timeout_s = positive("timeout_s", timeout_s, why="seconds")
        self.cuda = torch.cuda if cuda is None else cuda
        self._nvml_arg = nvml
        self.allreduce, self.nproc, self.timeout_s = allreduce, nproc, timeout_s

    @cached_property
    def nvml(self) -> Any | None:
        """The NVML module, or None when nvidia-ml-py is not installed."""
        return load_nvml() if self._nvml_arg is None else self._nvml_arg

    @cached_property
    def nvml_error(self) -> str | None:
        """None when NVML works; else "not-installed" or the NVML error's class name."""
        if self.nvml is None:
            return "not-installed"
        try:
            with nvml_session(self.nvml) as nv:
                nv.nvmlDeviceGetCount()
        except Exception as e:  # one NVMLError subclass per error code
            return type(e).__name__
        return None

    @cached_property
    def nvml_gpu_count(self) -> int:
        """GPUs the driver sees (0 when NVML does not work), whether torch can use them or not."""
        if self.nvml_error is not None:
            return 0
        with nvml_session(self.nvml) as nv:
            return int(nv.nvmlDeviceGetCount())

    @cached_property
    def cuda_available(self) -> bool:
        return bool(self.cuda.is_available())

    @cached_property
    def gpus(self) -> list[hardware.GpuInfo]:
        """torch's GPUs when CUDA is usable, else the ones NVML sees (see hardware.gpu_info)."""
        return hardware.gpu_info(cuda=self.cuda, nvml=self.nvml)

    @cached_property
    def usable_gpu_count(self) -> int:
        return int(self.cuda.device_count()) if self.cuda_available else 0


def version_tuple(version: str) -> tuple[int, ...]:
    """(major, minor[, patch]) from "2.13.0+cu128", "4.6.6", "2.9.0a0+git1234"; () if none."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return tuple(int(g) for g in m.groups() if g is not None) if m else ()


def dist_version(name: str) -> str | None:
    """The installed version of the distribution ``name``, or None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def repo_root() -> Path:
    """The course repository: the folder that holds labkit/ (and requirements.txt)."""
    return Path(__file__).resolve().parents[3]


def tested_pin(package: str, requirements: Path | None = None) -> str | None:
    """The version requirements.txt pins ``package`` to (``package==X``), or None.

    requirements.txt sits beside the labkit folder in the course repo; an installed copy of
    labkit has none, and then there is no pin to compare with.
    """
    path = requirements or repo_root() / "requirements.txt"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return None
    m = re.search(rf"^\s*{re.escape(package)}\s*==\s*([^\s;#]+)", text, re.M | re.I)
    return m.group(1) if m else None
