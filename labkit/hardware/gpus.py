"""The GPUs this process can see: name, memory, compute capability and UUID of each.

Apart from the tier and the tables because it is detection, an explicit call: ``gpu_info``
asks ``torch.cuda`` when it can (which initialises CUDA in the calling process), else NVML
(through :mod:`labkit.hardware.devices`, so ``CUDA_VISIBLE_DEVICES`` still holds). Importing
it touches no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from labkit.hardware.devices import normalise_uuid, visible_gpus
from labkit.hardware.nvml import field_or_na, load_nvml, nvml_session, nvml_text


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
                uuid=normalise_uuid(getattr(props, "uuid", None)),
                source="torch.cuda",
            )
        )
    return gpus


def _gpus_from_nvml(nvml: Any | None) -> list[GpuInfo]:
    if nvml is None:
        return []
    try:
        with nvml_session(nvml):
            gpus = []
            for i, handle, _, _ in visible_gpus(nvml)[0]:  # NVML ignores CUDA_VISIBLE_DEVICES
                memory = field_or_na(lambda h=handle: nvml.nvmlDeviceGetMemoryInfo(h).total)
                cc = field_or_na(lambda h=handle: nvml.nvmlDeviceGetCudaComputeCapability(h))
                uuid = field_or_na(lambda h=handle: nvml.nvmlDeviceGetUUID(h))
                gpus.append(GpuInfo(
                    index=i,
                    name=nvml_text(nvml.nvmlDeviceGetName(handle)),
                    memory_bytes=int(memory) if memory is not None else None,
                    compute_capability=(int(cc[0]), int(cc[1])) if cc is not None else None,
                    uuid=normalise_uuid(uuid),
                    source="nvml",
                ))  # fmt: skip
            return gpus
    except Exception:  # no driver (nvmlInit failed) or a GPU that will not answer: no GPUs;
        return []  # nvml_status() explains why


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
    return _gpus_from_nvml(load_nvml() if nvml is None else nvml)

