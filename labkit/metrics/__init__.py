"""Live hardware metrics for a running job: collection only (plots live elsewhere).

    from labkit.metrics import Sampler, auto_backend
    backend = auto_backend(pids_fn)          # NVML if a GPU is there, else CPU (says why)
    with Sampler(backend, period_s=1.0) as sampler:
        ...                                  # run the job
    sampler.series("gpu0", "power_w")        # (times, watts), None where N/A

Backends (``base.Backend``): ``NvmlBackend`` (per-GPU readings from the NVIDIA driver),
``CpuBackend`` (per-rank process trees and the host, from psutil) and ``ReplayBackend``
(a recording made on real hardware by ``Recorder``, labelled as such). Every metric, with
its unit, meaning, window and nvidia-smi equivalent, is in ``METRICS`` (``metric_table()``
prints it). Importing this package starts nothing and loads no driver library.

Its modules:

    base               what every metrics backend shares: the metric table, the Sample record, the
                       interface
    cpu                CPU backend: each rank's process tree and the host, from psutil
    net                bytes on the wire: a network interface's traffic counters, read around a job
    nvml               NVML backend: what the NVIDIA driver reports about each GPU the job uses
    replay             recordings of real GPU runs, and their replay on machines without a GPU
    sampler            sampling a backend on a schedule: in a thread, or driven by the caller's own
                       loop
"""

from labkit.metrics.base import (
    METRICS,
    Backend,
    BackendUnavailable,
    Sample,
    metric_table,
)
from labkit.metrics.cpu import CpuBackend
from labkit.metrics.nvml import NvmlBackend, parse_visible_devices
from labkit.metrics.replay import (
    Recorder,
    ReplayBackend,
    ReplayError,
    TraceError,
    load_trace,
    shipped_traces,
)
from labkit.metrics.sampler import (
    MIN_PERIOD_S,
    Sampler,
    auto_backend,
    clamp_period,
)

__all__ = [
    "METRICS",
    "MIN_PERIOD_S",
    "Backend",
    "BackendUnavailable",
    "CpuBackend",
    "NvmlBackend",
    "Recorder",
    "ReplayBackend",
    "ReplayError",
    "Sample",
    "Sampler",
    "TraceError",
    "auto_backend",
    "clamp_period",
    "load_trace",
    "metric_table",
    "parse_visible_devices",
    "shipped_traces",
]
