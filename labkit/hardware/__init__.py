"""What hardware is this, what can it show truthfully, and what is its peak?

One module per concern; the names notebooks and tests use are re-exported here, so notebooks
write ``hardware.peak_flops(...)`` (the rest import from their module):

    cpu            the host CPU (``cpu_info``) and PyTorch's CPU threads (``limit_cpu_threads``)
    host           memory this process can still take: MemAvailable or a cgroup's limit
    nvml           NVML plumbing, once: loading, sessions, "field or N/A", ``nvml_status``
    devices        ``CUDA_VISIBLE_DEVICES`` (and MIG) mapped onto NVML's GPUs (``visible_gpus``)
    gpus           the GPUs this process can see (``gpu_info``), from torch.cuda or NVML
    tier           the course's tier here and what it can and cannot show (``describe_tier``)
    peaks          the sourced tables (``PEAK_TABLE``, ``MEMORY_TABLE``, ``LINK_TABLE``) and
                   their conservative lookups (``peak_flops``): an unknown device gets no guess
    capabilities   what a device runs: the autocast dtype (``autocast_dtype_for``) and the SDPA
                   kernel a shape gets (``sdpa_backend``)
    environment    Python, torch, CPU, NVML and GPUs in the lines a notebook prints first
                   (``environment().describe()``)
    ceilings       a measured ceiling (``measured_matmul_flops``): on a CPU the only honest peak
    doctor         is this machine ready for the course? (``python -m labkit doctor``): a
                   folder of its own (the report, the shared probe, the GPU checks, the host
                   checks); not imported here

Detection (``cpu_info``, ``gpu_info``, ``nvml_status``, ``tier``) happens on call: importing
this package touches no GPU, initialises neither CUDA nor NVML, starts no thread and writes no
file.

    from labkit import hardware
    print(hardware.peak_flops("Tesla T4", "fp16"))        # 65 TFLOP/s, with the datasheet URL
    print(hardware.autocast_dtype_for((7, 5)).dtype)      # float16
"""

from __future__ import annotations

from labkit.hardware.capabilities import autocast_dtype_for as autocast_dtype_for
from labkit.hardware.capabilities import default_autocast_dtype as default_autocast_dtype
from labkit.hardware.capabilities import sdpa_backend as sdpa_backend
from labkit.hardware.ceilings import measured_matmul_flops as measured_matmul_flops
from labkit.hardware.cpu import CPU_FLAGS_OF_INTEREST as CPU_FLAGS_OF_INTEREST
from labkit.hardware.cpu import CpuInfo as CpuInfo
from labkit.hardware.cpu import cpu_info as cpu_info
from labkit.hardware.cpu import limit_cpu_threads as limit_cpu_threads
from labkit.hardware.devices import parse_visible_devices as parse_visible_devices
from labkit.hardware.devices import visible_gpus as visible_gpus
from labkit.hardware.environment import environment as environment
from labkit.hardware.gpus import GpuInfo as GpuInfo
from labkit.hardware.gpus import gpu_info as gpu_info
from labkit.hardware.nvml import NvmlStatus as NvmlStatus
from labkit.hardware.nvml import nvml_status as nvml_status
from labkit.hardware.peaks import LINK_TABLE as LINK_TABLE
from labkit.hardware.peaks import MEMORY_TABLE as MEMORY_TABLE
from labkit.hardware.peaks import PEAK_TABLE as PEAK_TABLE
from labkit.hardware.peaks import Peak as Peak
from labkit.hardware.peaks import link_bandwidth as link_bandwidth
from labkit.hardware.peaks import match_device as match_device
from labkit.hardware.peaks import memory_spec as memory_spec
from labkit.hardware.peaks import peak_flops as peak_flops
from labkit.hardware.tier import describe_tier as describe_tier
from labkit.hardware.tier import tier as tier
