"""A test double of the ``pynvml`` module, for driving ``NvmlBackend`` on a machine without a GPU.

It answers the NVML calls the backend makes, from values a test sets on ``FakeGpu`` objects,
and can fail the way real drivers do: library missing at init, a field not supported, a GPU
lost mid-run, a library/driver version mismatch. Error classes and constants come from the
real ``pynvml`` (pure Python: importing it loads no library), so the backend is tested against
the same exception types it meets on real hardware.

Nothing here is shown to learners: these numbers exist only inside tests.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml as _real

# The GPM metric ids the backend asks for.
SM_UTIL = _real.NVML_GPM_METRIC_SM_UTIL
SM_OCCUPANCY = _real.NVML_GPM_METRIC_SM_OCCUPANCY
TENSOR = _real.NVML_GPM_METRIC_ANY_TENSOR_UTIL


@dataclass(eq=False)
class FakeGpu:
    """One fake GPU; tests change its fields between samples.

    ``unsupported`` holds NVML function names (e.g. "nvmlDeviceGetPowerUsage") that raise
    NotSupported; ``errors`` maps a function name to an error code raised once, then cleared;
    ``lost = True`` makes every call raise GpuIsLost; ``gpm = None`` means a pre-Hopper GPU.
    """

    name: str = "NVIDIA H200"
    uuid: str = "GPU-00000000-1111-2222-3333-444444444444"
    util: tuple[int, int] = (97, 41)  # (gpu %, memory %)
    mem_used: int = 40 * 2**30  # bytes
    mem_total: int = 141 * 2**30  # bytes
    power_mw: int = 612_500
    energy_mj: int = 5_000_000  # cumulative since "driver load"
    temp_c: int = 61
    sm_clock_mhz: int = 1980
    pcie_kbs: tuple[int, int] = (2_000_000, 8_000_000)  # (tx, rx) KB/s
    nvlink_links: int = 18
    nvlink_kib: tuple[int, int] = (0, 0)  # cumulative (tx, rx) KiB over all links
    gpm: dict[int, float] | None = field(
        default_factory=lambda: {SM_UTIL: 85.0, SM_OCCUPANCY: 40.0, TENSOR: 62.5}
    )
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, bytes)
    unsupported: set[str] = field(default_factory=set)
    errors: dict[str, int] = field(default_factory=dict)
    lost: bool = False
    index: int = -1  # set by FakeNvml


@dataclass(eq=False)
class _GpmBuffer:
    gpu: FakeGpu | None = None
    freed: bool = False


class _GpmMetricsGet:
    """Python stand-in for pynvml.c_nvmlGpmMetricsGet_t (same attribute names)."""

    def __init__(self) -> None:
        self.version = 0
        self.numMetrics = 0
        self.sample1: _GpmBuffer | None = None
        self.sample2: _GpmBuffer | None = None
        self.metrics = [SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(8)]


class FakeNvml:
    """Stands in for the ``pynvml`` module: pass it as ``NvmlBackend(nvml=FakeNvml(...))``.

    Attributes a test reads: ``calls`` (Counter of (function name, GPU index)),
    ``inits`` / ``shutdowns`` (to check they balance), ``live_gpm_buffers``.
    """

    c_nvmlGpmMetricsGet_t = _GpmMetricsGet

    def __init__(self, gpus: list[FakeGpu] | None = None, *, init_error: int | None = None,
                 driver: str = "570.86.15", cuda: int = 12080) -> None:  # fmt: skip
        self.gpus = gpus if gpus is not None else [FakeGpu()]
        for i, g in enumerate(self.gpus):
            g.index = i
        self.init_error, self.driver, self.cuda = init_error, driver, cuda
        self.fail_code: int | None = None  # every device call raises this (driver broke)
        self.calls: Counter[tuple[str, int]] = Counter()
        self.inits = self.shutdowns = 0
        self.buffers: list[_GpmBuffer] = []

    def __getattr__(self, name: str) -> Any:
        # Constants (NVML_*) and error classes (NVMLError*) are the real module's.
        if name.startswith(("NVML_", "NVMLError")):
            return getattr(_real, name)
        raise AttributeError(f"FakeNvml has no {name!r}: add it to tests/fake_nvml.py")

    @property
    def initialized(self) -> bool:
        return self.inits > self.shutdowns

    @property
    def live_gpm_buffers(self) -> int:
        return sum(not b.freed for b in self.buffers)

    def fail_all(self, code: int) -> None:
        """From now on every device call raises ``code`` (e.g. a driver updated mid-run)."""
        self.fail_code = code

    @staticmethod
    def error(code: int) -> Exception:
        return _real.NVMLError(code)  # the real subclass, e.g. NVMLError_GpuIsLost

    # -- library -----------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.error(self.init_error)
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self._check_init()
        self.shutdowns += 1

    def _check_init(self) -> None:
        if not self.initialized:
            raise self.error(_real.NVML_ERROR_UNINITIALIZED)

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check_init()
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._check_init()
        return self.cuda

    def nvmlDeviceGetCount(self) -> int:
        self._check_init()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeGpu:
        self._check_init()
        return self.gpus[i]

    # -- devices -----------------------------------------------------------------------------

    def _dev(self, fn: str, gpu: FakeGpu) -> FakeGpu:
        """Bookkeeping and failure injection shared by every device call."""
        self._check_init()
        self.calls[(fn, gpu.index)] += 1
        if self.fail_code is not None:
            raise self.error(self.fail_code)
        if gpu.lost:
            raise self.error(_real.NVML_ERROR_GPU_IS_LOST)
        if fn in gpu.errors:
            raise self.error(gpu.errors.pop(fn))
        if fn in gpu.unsupported:
            raise self.error(_real.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def nvmlDeviceGetName(self, h: FakeGpu) -> str:
        return self._dev("nvmlDeviceGetName", h).name

    def nvmlDeviceGetUUID(self, h: FakeGpu) -> str:
        return self._dev("nvmlDeviceGetUUID", h).uuid

    def nvmlDeviceGetUtilizationRates(self, h: FakeGpu) -> Any:
        g = self._dev("nvmlDeviceGetUtilizationRates", h)
        return SimpleNamespace(gpu=g.util[0], memory=g.util[1])

    def nvmlDeviceGetMemoryInfo(self, h: FakeGpu) -> Any:
        g = self._dev("nvmlDeviceGetMemoryInfo", h)
        return SimpleNamespace(used=g.mem_used, total=g.mem_total, free=g.mem_total - g.mem_used)

    def nvmlDeviceGetPowerUsage(self, h: FakeGpu) -> int:
        return self._dev("nvmlDeviceGetPowerUsage", h).power_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, h: FakeGpu) -> int:
        return self._dev("nvmlDeviceGetTotalEnergyConsumption", h).energy_mj

    def nvmlDeviceGetTemperature(self, h: FakeGpu, sensor: int) -> int:
        assert sensor == _real.NVML_TEMPERATURE_GPU
        return self._dev("nvmlDeviceGetTemperature", h).temp_c

    def nvmlDeviceGetClockInfo(self, h: FakeGpu, clock: int) -> int:
        assert clock == _real.NVML_CLOCK_SM
        return self._dev("nvmlDeviceGetClockInfo", h).sm_clock_mhz

    def nvmlDeviceGetPcieThroughput(self, h: FakeGpu, counter: int) -> int:
        g = self._dev("nvmlDeviceGetPcieThroughput", h)
        return g.pcie_kbs[0 if counter == _real.NVML_PCIE_UTIL_TX_BYTES else 1]

    def nvmlDeviceGetFieldValues(self, h: FakeGpu, field_ids: list[Any]) -> list[Any]:
        g = self._dev("nvmlDeviceGetFieldValues", h)
        out = []
        for fid in field_ids:
            fid, scope = fid if isinstance(fid, tuple) else (fid, 0)
            value = SimpleNamespace(uiVal=0, ullVal=0)
            ret, vtype = _real.NVML_SUCCESS, _real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            if fid == _real.NVML_FI_DEV_NVLINK_LINK_COUNT:
                vtype, value.uiVal = _real.NVML_VALUE_TYPE_UNSIGNED_INT, g.nvlink_links
            elif fid == _real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX and g.nvlink_links:
                value.ullVal = g.nvlink_kib[0]
            elif fid == _real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX and g.nvlink_links:
                value.ullVal = g.nvlink_kib[1]
            else:
                ret = _real.NVML_ERROR_NOT_SUPPORTED
            out.append(SimpleNamespace(fieldId=fid, scopeId=scope, nvmlReturn=ret,
                                       valueType=vtype, value=value))  # fmt: skip
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, h: FakeGpu) -> list[Any]:
        g = self._dev("nvmlDeviceGetComputeRunningProcesses", h)
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in g.processes]

    # -- GPM (Hopper and newer) --------------------------------------------------------------

    def nvmlGpmQueryDeviceSupport(self, h: FakeGpu) -> Any:
        g = self._dev("nvmlGpmQueryDeviceSupport", h)
        return SimpleNamespace(version=1, isSupportedDevice=int(g.gpm is not None))

    def nvmlGpmSampleAlloc(self) -> _GpmBuffer:
        self._check_init()
        buf = _GpmBuffer()
        self.buffers.append(buf)
        return buf

    def nvmlGpmSampleFree(self, buf: _GpmBuffer) -> None:
        self._check_init()
        assert not buf.freed, "GPM buffer freed twice"
        buf.freed = True

    def nvmlGpmSampleGet(self, h: FakeGpu, buf: _GpmBuffer) -> _GpmBuffer:
        g = self._dev("nvmlGpmSampleGet", h)
        assert g.gpm is not None, "GPM sample on a GPU that does not support it"
        assert not buf.freed, "GPM sample into a freed buffer"
        buf.gpu = g
        return buf

    def nvmlGpmMetricsGet(self, mg: _GpmMetricsGet) -> _GpmMetricsGet:
        self._check_init()
        s1, s2 = mg.sample1, mg.sample2
        assert mg.version == _real.NVML_GPM_METRICS_GET_VERSION
        assert s1 is not None and s2 is not None and s1 is not s2, "GPM needs two samples"
        assert s1.gpu is s2.gpu and s2.gpu is not None, "GPM samples of different GPUs"
        gpm = s2.gpu.gpm or {}
        for m in mg.metrics[: mg.numMetrics]:
            if m.metricId in gpm:
                m.value, m.nvmlReturn = gpm[m.metricId], _real.NVML_SUCCESS
            else:
                m.nvmlReturn = _real.NVML_ERROR_NOT_SUPPORTED
        return mg
