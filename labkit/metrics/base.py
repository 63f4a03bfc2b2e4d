"""What every metrics backend shares: the metric table, the ``Sample`` record, the interface.

Collection is kept apart from display (as nvitop does): a backend only *reads* numbers and
hands back ``Sample`` records; plots and tables live elsewhere and read ``METRICS`` for units
and meanings.

Two rules hold for every backend:

- **N/A is not zero.** A value the device does not report, or a read that failed, is ``None``
  (``NA``). A plot shows a gap, a table shows "N/A". Writing 0 instead would tell a learner
  that the GPU drew no power or moved no bytes, which is false.
- **Absent is not N/A.** Some fields are read less often than every tick (process lists,
  PCIe, see the table). On ticks where a field was not read, its key is missing from
  ``Sample.values``; ``None`` means it *was* asked for and is not available.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from labkit.errors import LabkitError

NA = None  # the N/A marker in Sample.values: "not available", never a number
KINDS = ("nvml", "cpu", "replay")
GIB = 1024**3  # bytes per GiB: memory is reported in GiB, as torch.cuda reports bytes / 2**30

Clock = Callable[[], float]  # returns seconds; time.monotonic by default, a fake in tests


@dataclass(frozen=True)
class Metric:
    """One documented metric.

    Attributes:
        name: key in ``Sample.values``; the unit is in the name's suffix (``_pct``, ``_gib``).
        unit: unit of the value.
        scope: what one value describes: "gpu", "gpu process", "rank" or "host".
        backend: which backend reads it ("nvml" or "cpu"; "replay" plays recorded NVML ones).
        description: what the number means, and what it does *not* mean.
        window: the time the value covers (an instant, NVML's own sampling window, or the
            time since the previous sample).
        source: the library call it comes from.
        nvidia_smi: the nvidia-smi field or command that shows the same number ("—" if none).
    """

    name: str
    unit: str
    scope: str
    backend: str
    description: str
    window: str
    source: str
    nvidia_smi: str


# The one table of every metric the backends produce. Sources: NVML API reference
# (docs.nvidia.com/deploy/nvml-api), `nvidia-smi --help-query-gpu`, `nvidia-smi dmon -h`,
# psutil docs (psutil.readthedocs.io).
_TABLE = (
    Metric("gpu_util_pct", "%", "gpu", "nvml",
           "Percent of the window in which at least one kernel was running on the GPU. One "
           "tiny kernel at a time counts as 100 %: this is not how busy the SMs are (see "
           "sm_active_pct) and '100 % utilisation' can coexist with ~20 % MFU.",
           "NVML's own sample period, 1/6 s to 1 s depending on the product",
           "nvmlDeviceGetUtilizationRates().gpu", "utilization.gpu; dmon column 'sm'"),
    Metric("mem_util_pct", "%", "gpu", "nvml",
           "Percent of the window in which device memory was being read or written. Not the "
           "share of memory in use (that is mem_used_gib) and not bandwidth used.",
           "NVML's own sample period, 1/6 s to 1 s depending on the product",
           "nvmlDeviceGetUtilizationRates().memory", "utilization.memory; dmon column 'mem'"),
    Metric("mem_used_gib", "GiB", "gpu", "nvml",
           "Device memory allocated by all processes plus the driver's reservation. Larger "
           "than torch.cuda.memory_allocated: it includes PyTorch's cache and CUDA contexts.",
           "instant", "nvmlDeviceGetMemoryInfo().used (bytes)", "memory.used (MiB)"),
    Metric("mem_total_gib", "GiB", "gpu", "nvml",
           "Device memory as the driver reports it, in GiB (datasheets count GB of 10^9 "
           "bytes, so their figure looks larger).",
           "instant", "nvmlDeviceGetMemoryInfo().total (bytes)", "memory.total (MiB)"),
    Metric("power_w", "W", "gpu", "nvml",
           "Board power draw. On Ampere and newer boards, except the A100 (GA100), NVML "
           "returns a one-second average, so a short burst shows up smoothed; on the A100 "
           "and older boards it is the instantaneous draw (NVML API reference, "
           "nvmlDeviceGetPowerUsage: "
           "https://docs.nvidia.com/deploy/nvml-api/group__nvmlDeviceQueries.html).",
           "1 s average on Ampere and newer except GA100 (A100); instant on GA100 and older",
           "nvmlDeviceGetPowerUsage (mW)", "power.draw (newer drivers: power.draw.average)"),
    Metric("energy_j", "J", "gpu", "nvml",
           "Energy the board used since the backend was opened (the run): the difference of "
           "the driver's cumulative counter. Volta and newer.",
           "since open()",
           "nvmlDeviceGetTotalEnergyConsumption (mJ since the driver loaded), difference",
           "— (no query field known to us; integrate power.draw)"),
    Metric("temp_c", "°C", "gpu", "nvml",
           "GPU die temperature. Clocks drop when it nears the slowdown threshold.",
           "instant", "nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)",
           "temperature.gpu; dmon column 'gtemp'"),
    Metric("sm_clock_mhz", "MHz", "gpu", "nvml",
           "Current SM clock. Falls below its maximum under power or thermal limits, which "
           "lowers the FLOP/s the GPU can reach.",
           "instant", "nvmlDeviceGetClockInfo(NVML_CLOCK_SM)", "clocks.sm"),
    Metric("pcie_tx_gbs", "GB/s", "gpu", "nvml",
           "PCIe traffic sent by the GPU (e.g. device-to-host copies). NVML reports KB/s; "
           "we divide by 1e6. Read every `pcie_every` samples: each read blocks ~20 ms.",
           "NVML's own 20 ms window", "nvmlDeviceGetPcieThroughput(NVML_PCIE_UTIL_TX_BYTES)",
           "dmon -s t, column 'txpci' (MB/s)"),
    Metric("pcie_rx_gbs", "GB/s", "gpu", "nvml",
           "PCIe traffic received by the GPU (e.g. host-to-device copies of batches).",
           "NVML's own 20 ms window", "nvmlDeviceGetPcieThroughput(NVML_PCIE_UTIL_RX_BYTES)",
           "dmon -s t, column 'rxpci' (MB/s)"),
    Metric("nvlink_tx_gbs", "GB/s", "gpu", "nvml",
           "NVLink data (payload, no protocol overhead) sent, summed over all links: the "
           "difference of a cumulative counter divided by the time between samples. N/A on "
           "GPUs without NVLink.",
           "time since the previous sample",
           "nvmlDeviceGetFieldValues(NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, all links) (KiB)",
           "nvidia-smi nvlink -gt d (cumulative counters)"),
    Metric("nvlink_rx_gbs", "GB/s", "gpu", "nvml",
           "NVLink data received, summed over all links, as nvlink_tx_gbs.",
           "time since the previous sample",
           "nvmlDeviceGetFieldValues(NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, all links) (KiB)",
           "nvidia-smi nvlink -gt d (cumulative counters)"),
    Metric("sm_active_pct", "%", "gpu", "nvml",
           "Percent of SMs busy, averaged over the window (DCGM's 'SM activity'). DCGM's "
           "guidance: >= 80 % is necessary but not sufficient for good use; < 50 % likely "
           "ineffective. Hopper and newer (NVML GPM); N/A elsewhere.",
           "time since the previous sample", "nvmlGpmMetricsGet(NVML_GPM_METRIC_SM_UTIL)",
           "dmon --gpm-metrics 2 (Hopper and newer)"),
    Metric("sm_occupancy_pct", "%", "gpu", "nvml",
           "Resident warps as a percent of the SMs' maximum, averaged over the window. "
           "Hopper and newer (NVML GPM); N/A elsewhere.",
           "time since the previous sample", "nvmlGpmMetricsGet(NVML_GPM_METRIC_SM_OCCUPANCY)",
           "dmon --gpm-metrics 3 (Hopper and newer)"),
    Metric("tensor_active_pct", "%", "gpu", "nvml",
           "Percent of time the SMs issued any tensor-core instruction: near 0 means the "
           "matmuls are not on tensor cores (e.g. fp32 without TF32). Hopper and newer "
           "(NVML GPM); N/A elsewhere.",
           "time since the previous sample",
           "nvmlGpmMetricsGet(NVML_GPM_METRIC_ANY_TENSOR_UTIL)",
           "dmon --gpm-metrics 5 (Hopper and newer)"),
    Metric("proc_mem_gib", "GiB", "gpu process", "nvml",
           "Device memory used by one of the job's processes (its CUDA context plus what its "
           "allocator holds). Read every `process_every` samples: the query holds the driver "
           "lock for milliseconds. N/A where the driver hides it (e.g. some containers).",
           "instant", "nvmlDeviceGetComputeRunningProcesses()[i].usedGpuMemory (bytes)",
           "--query-compute-apps=pid,used_memory"),
    Metric("cpu_pct", "% of one core", "rank", "cpu",
           "CPU time used by the rank's process and its children, as a percent of one core "
           "(two busy cores = 200 %). N/A on the first sample of a process: psutil needs two "
           "readings to form a rate.",
           "time since the previous sample", "psutil.Process.cpu_percent, summed over the tree",
           "— (top's %CPU)"),
    Metric("rss_gib", "GiB", "rank", "cpu",
           "Resident memory of the rank's process and its children, summed. Pages shared "
           "between processes (e.g. torch's libraries) count once per process, so the sum "
           "over-states the physical memory used.",
           "instant", "psutil.Process.memory_info().rss, summed over the tree", "— (top's RES)"),
    Metric("host_cpu_pct", "% of all cores", "host", "cpu",
           "Busy time of all CPU cores together (100 % = every core busy).",
           "time since the previous sample", "psutil.cpu_times (differences)", "— (top, mpstat)"),
    Metric("host_mem_used_gib", "GiB", "host", "cpu",
           "Host memory in use: total minus what the OS could give a new process.",
           "instant", "psutil.virtual_memory(): total - available", "— (free)"),
    Metric("host_mem_total_gib", "GiB", "host", "cpu",
           "Installed host memory.", "instant", "psutil.virtual_memory().total", "— (free)"),
)  # fmt: skip

METRICS: dict[str, Metric] = {m.name: m for m in _TABLE}


def metric_table(backend: str | None = None) -> str:
    """The metric table as Markdown (all metrics, or one backend's), for notebooks and docs."""
    rows = ["| metric | unit | meaning | window | nvidia-smi |", "| --- | --- | --- | --- | --- |"]
    for m in METRICS.values():
        if backend is None or m.backend == backend:
            rows.append(
                f"| `{m.name}` | {m.unit} | {m.description} | {m.window} | {m.nvidia_smi} |"
            )
    return "\n".join(rows)


@dataclass(frozen=True)
class Sample:
    """One reading of one source at one time.

    Attributes:
        time_s: when it was read, in seconds of the sampler's clock (``time.monotonic`` by
            default: only differences between samples are meaningful).
        source: what was read: "gpu0" (the job's CUDA device 0), "gpu0/rank1" (rank 1's
            process on it), "rank1" (rank 1's process tree on the CPU), "host".
        values: metric name (see ``METRICS``) -> value in the metric's unit, or ``None`` for
            N/A. A key left out was not read at this tick.
        status: "ok"; "lost" (GPU fell off the bus: no further reads); "failed: ..." (the
            device or backend stopped answering); "exited" (a rank's process is gone).
        kind: the backend that produced it ("nvml", "cpu" or "replay").
        label: "" for live data; for replays "recording of <hardware> on <date>", which a
            display must show next to the numbers.
    """

    time_s: float
    source: str
    values: Mapping[str, float | None] = field(default_factory=dict)
    status: str = "ok"
    kind: str = "nvml"
    label: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Sample.kind={self.kind!r}: use one of {KINDS}")

    def get(self, name: str) -> float | None:
        """The value of metric ``name``; None when N/A or not read at this tick."""
        return self.values.get(name)

    def to_dict(self) -> dict[str, Any]:
        return {"time_s": self.time_s, "source": self.source, "values": dict(self.values),
                "status": self.status, "kind": self.kind, "label": self.label}  # fmt: skip


class BackendUnavailable(RuntimeError, LabkitError):
    """A backend cannot run on this machine; the message says why and what to do."""


class Backend(abc.ABC):
    """The interface every metrics backend implements.

    Lifecycle: ``open()`` (may raise ``BackendUnavailable``), then ``sample()`` any number of
    times, then ``close()``. ``open`` and ``close`` are idempotent, and a closed backend can be
    opened again. Constructing a backend starts nothing and touches no library.

    ``status`` maps a device ("gpu0"), a field ("gpu0.power_w") or the backend itself
    ("backend") to a human-readable state; it lists only what is *not* plainly fine, plus one
    entry per device.
    """

    kind: str = ""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self.status: dict[str, str] = {}

    @abc.abstractmethod
    def open(self) -> None:
        """Prepare to sample (load libraries, find devices, prime counters)."""

    @abc.abstractmethod
    def sample(self, now: float | None = None) -> list[Sample]:
        """Read every source once; ``now`` (default: ``self.clock()``) stamps the samples.

        Never raises for a device or field problem: those become N/A values or a sample
        status. Raising is reserved for programming errors, which the sampler catches.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release what ``open`` acquired."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for the display: what is measured, on what hardware, or why not."""

    def _now(self, now: float | None) -> float:
        return self.clock() if now is None else now

    def __enter__(self) -> Backend:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {self.describe()}>"
