"""NVML backend: what the NVIDIA driver reports about each GPU the job uses.

    from labkit.metrics import NvmlBackend
    with NvmlBackend() as nv:          # raises BackendUnavailable on a machine without a driver
        print(nv.describe())           # "NVML: 1 GPU (NVIDIA H200), driver 570.86.15, CUDA 12.8"
        for s in nv.sample():
            print(s.source, s.values)  # "gpu0" {"gpu_util_pct": 97.0, "power_w": 611.2, ...}

Every metric is documented in ``labkit.metrics.base.METRICS``. How failures are handled, the
way mature tools (nvitop, gpustat) do it:

- a field the device does not support (``NotSupported``, ``FunctionNotFound``,
  ``NoPermission``) is N/A (``None``) from then on, and is not queried again;
- a GPU that falls off the bus (``GpuIsLost``, ``ResetRequired``) is marked "lost": its
  samples carry that status, no values, and it is never queried again;
- a driver that changes under us (``LibRmVersionMismatch``, ``DriverNotLoaded``,
  ``Uninitialized`` mid-run) marks the device "failed", likewise;
- any other error (``Timeout``, ``Unknown``) makes that field N/A for one sample only;
- at ``open()``, a missing library, an unloaded driver or a library/driver mismatch raise
  ``BackendUnavailable`` with the reason, so ``auto_backend`` can fall back to the CPU.

None of this ever raises into the job: the sampler runs beside it, not inside it.

Costs (MangoHud PR #2104, https://github.com/flightlessmango/MangoHud/pull/2104; NVML API
reference, https://docs.nvidia.com/deploy/nvml-api/group__nvmlDeviceQueries.html):
utilisation and memory take microseconds; the process list takes milliseconds and holds the
driver lock; ``nvmlDeviceGetPcieThroughput`` counts bytes over a 20 ms interval, so it blocks
~20 ms. So the cheap fields are read every sample, PCIe every ``pcie_every`` samples and
process lists every ``process_every`` samples.

``pynvml`` (from the ``nvidia-ml-py`` package; the package named ``pynvml`` is deprecated) is
imported inside ``open()``: importing this module loads nothing.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import psutil

from labkit.metrics.base import GIB, Backend, BackendUnavailable, Clock, Sample
from labkit.validate import whole

PidsFn = Callable[[], Mapping[int, int]]  # returns {rank: pid} of the job's processes

ALL_LINKS = 0xFFFFFFFF  # NVLink throughput fields: scopeId UINT_MAX sums over every link
_GPM = (  # our name -> NVML GPM metric id name (Hopper and newer)
    ("sm_active_pct", "NVML_GPM_METRIC_SM_UTIL"),
    ("sm_occupancy_pct", "NVML_GPM_METRIC_SM_OCCUPANCY"),
    ("tensor_active_pct", "NVML_GPM_METRIC_ANY_TENSOR_UTIL"),
)
_NVLINK = ("nvlink_tx_gbs", "nvlink_rx_gbs")
# NVML's notes on nvmlGpmMetricsGet ask for the two samples to lie further apart than the GPM
# counters' own refresh interval; the first tick comes right after open(). A shorter window
# yields an error or noise, so a tick sooner than this after the last GPM sample skips GPM.
GPM_MIN_WINDOW_S = 0.1
_PCIE = ("pcie_tx_gbs", "pcie_rx_gbs")

# NVML error codes sorted by what they mean for us.
_NOT_AVAILABLE = {  # permanent: the field is N/A on this device
    "NVML_ERROR_NOT_SUPPORTED": "N/A: not supported by this GPU or driver",
    "NVML_ERROR_FUNCTION_NOT_FOUND": "N/A: this driver is too old for the query",
    "NVML_ERROR_NO_PERMISSION": "N/A: no permission to read it",
}
_DEVICE_LOST = ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_RESET_REQUIRED")
_DEVICE_FAILED = (  # the library or driver under us broke: stop asking this device
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH",
    "NVML_ERROR_DRIVER_NOT_LOADED",
    "NVML_ERROR_UNINITIALIZED",
)


class _DeviceGone(Exception):
    """Internal: this device must not be queried again; ``state`` says why."""

    def __init__(self, state: str) -> None:
        super().__init__(state)
        self.state = state


@dataclass
class _Gpu:
    label: str  # "gpu{k}": k is the CUDA ordinal the job sees (cuda:k)
    index: int  # NVML index (PCI bus order)
    uuid: str
    name: str
    handle: Any
    mem_total_gib: float | None = None
    unsupported: dict[str, str] = field(default_factory=dict)  # field -> reason
    state: str = "ok"  # "ok", "lost: ..." or "failed: ..."
    energy0_mj: float | None = None  # counter at open(): energy_j is the difference
    nvlink_prev: tuple[float, float, float] | None = None  # (time_s, tx KiB, rx KiB)
    gpm_bufs: list[Any] = field(default_factory=list)  # [previous, next] GPM sample buffers
    gpm_time: float = 0.0  # clock time of the sample in gpm_bufs[0]: where the window opens


def _plumbing() -> ModuleType:
    """:mod:`labkit.hardware.nvml`, the NVML plumbing every NVML reader in labkit shares
    (loading, shutdown, decoding, what a failed nvmlInit means), imported on first use:
    labkit.hardware imports torch, which loads pynvml, and importing this module loads nothing."""
    from labkit.hardware import nvml

    return nvml


def _code_name(nv: Any, err: Exception) -> str:
    """The NVML_ERROR_* name of an NVMLError (pynvml's or a test double's), for the codes this
    module acts on; others by their class name (e.g. "NVMLError_Timeout")."""
    value = getattr(err, "value", None)
    for name in (*_NOT_AVAILABLE, *_DEVICE_LOST, *_DEVICE_FAILED):
        if getattr(nv, name, None) == value:
            return name
    return type(err).__name__


def parse_visible_devices(spec: str, uuids: Sequence[str]) -> tuple[list[int], list[str]]:
    """``labkit.hardware.parse_visible_devices``: the one mapping of ``CUDA_VISIBLE_DEVICES``
    to NVML indices (imported on call: labkit.hardware imports torch, which loads pynvml)."""
    from labkit.hardware.devices import parse_visible_devices

    return parse_visible_devices(spec, uuids)


class NvmlBackend(Backend):
    """Per-GPU metrics from NVML, for the GPUs the job can see.

    Args:
        pids_fn: returns {rank: pid} of the job's processes (called every ``process_every``
            samples; PIDs may appear as the job starts). Their GPU memory is reported as
            "gpu{k}/rank{r}". None: report every compute process, as "gpu{k}/pid{pid}".
        devices: which GPUs: a ``CUDA_VISIBLE_DEVICES``-style string, or a list of NVML
            indices and/or UUIDs. Default: this process's ``CUDA_VISIBLE_DEVICES``, or all
            GPUs. Pass the *job's* value when it differs from the notebook's.
        pcie_every: read PCIe throughput every this many samples (each read blocks ~20 ms).
        process_every: read the per-process memory every this many samples.
        gpm: read SM and tensor-core activity on GPUs that support NVML GPM (Hopper+).
        clock: seconds; stamps samples and times the NVLink counter differences.
        nvml: the NVML module to use (a test double); default ``pynvml``, imported at open.
    """

    kind = "nvml"

    def __init__(self, pids_fn: PidsFn | None = None, *,
                 devices: str | Sequence[int | str] | None = None, pcie_every: int = 5,
                 process_every: int = 5, gpm: bool = True, clock: Clock = time.monotonic,
                 nvml: Any = None) -> None:  # fmt: skip
        super().__init__(clock)
        for name, every in (("pcie_every", pcie_every), ("process_every", process_every)):
            whole(name, every, low=1, why="samples between reads")
        self.pids_fn, self.devices = pids_fn, devices
        self.pcie_every, self.process_every, self.gpm = pcie_every, process_every, gpm
        self._nv = nvml
        self._open = False
        self._gpus: list[_Gpu] = []
        self._ticks = 0
        self.reason = ""  # why open() failed, if it did
        self.info: dict[str, Any] = {}  # driver, cuda_driver, gpus: filled by open()

    # -- open / close -----------------------------------------------------------------------

    def _module(self) -> Any:
        if self._nv is None:
            self._nv = _plumbing().load_nvml()
            if self._nv is None:
                raise BackendUnavailable(
                    "the NVML bindings are not installed: pip install nvidia-ml-py")  # fmt: skip
        return self._nv

    def open(self) -> None:
        if self._open:
            return
        nv = self._module()
        try:
            nv.nvmlInit()
        except nv.NVMLError as e:
            hint = _plumbing().init_error_hint(e)
            self.reason = hint or f"nvmlInit failed: {e} ({_code_name(nv, e)})"
            raise BackendUnavailable(f"NVML unavailable: {self.reason}") from None
        try:
            self._gpus = self._find_gpus(nv)
            self.info = self._system_info(nv)
        except nv.NVMLError as e:
            _plumbing().shutdown_nvml(nv)
            self.reason = f"NVML failed while listing GPUs: {e} ({_code_name(nv, e)})"
            raise BackendUnavailable(f"NVML unavailable: {self.reason}") from None
        except BaseException:  # BackendUnavailable, a bad `devices` entry: init must not leak
            _plumbing().shutdown_nvml(nv)
            raise
        self.reason = ""
        self._ticks = 0
        self._open = True

    def _find_gpus(self, nv: Any) -> list[_Gpu]:
        count = nv.nvmlDeviceGetCount()
        if count == 0:
            self.reason = "the NVIDIA driver is loaded but reports no GPU"
            raise BackendUnavailable(f"NVML unavailable: {self.reason}")
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        uuids = [_plumbing().nvml_text(nv.nvmlDeviceGetUUID(h)) for h in handles]
        spec = os.environ.get("CUDA_VISIBLE_DEVICES") if self.devices is None else self.devices
        self.status = {}
        if spec is None or isinstance(spec, str):  # NVML ignores CUDA_VISIBLE_DEVICES: map it
            from labkit.hardware.devices import visible_gpus  # lazy, as _plumbing() says

            visible, notes = visible_gpus(nv, spec)
            indices = [g.index for g in visible]
            if spec is not None:
                self._warn_order(nv, spec, handles, indices, notes)
            if notes:
                self.status["devices"] = "; ".join(notes)
        else:
            indices = []
            for d in spec:
                found, _ = parse_visible_devices(str(d), uuids)
                if not found:
                    raise ValueError(f"devices entry {d!r}: no GPU with that NVML index or UUID "
                                     f"(this machine has {count}: {uuids})")  # fmt: skip
                indices += [i for i in found if i not in indices]
        if not indices:
            self.reason = f"no GPU selected (CUDA_VISIBLE_DEVICES={spec!r})"
            raise BackendUnavailable(f"NVML unavailable: {self.reason}")
        return [
            self._open_gpu(nv, f"gpu{k}", i, handles[i], uuids[i]) for k, i in enumerate(indices)
        ]

    def _warn_order(self, nv: Any, spec: str, handles: list[Any], indices: list[int],
                    notes: list[str]) -> None:  # fmt: skip
        """Integer entries name GPUs in CUDA's order; warn where that may not be NVML's."""
        if os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID" or len(handles) < 2:
            return
        if not any(t.strip().isdigit() for t in spec.split(",")):
            return
        if len({_plumbing().nvml_text(nv.nvmlDeviceGetName(h)) for h in handles}) > 1:
            notes.append("GPUs of different models and CUDA_DEVICE_ORDER is not PCI_BUS_ID: "
                         "integer CUDA_VISIBLE_DEVICES entries may name other GPUs in NVML; "
                         "pass UUIDs to be sure")  # fmt: skip

    def _open_gpu(self, nv: Any, label: str, index: int, handle: Any, uuid: str) -> _Gpu:
        gpu = _Gpu(label, index, uuid, _plumbing().nvml_text(nv.nvmlDeviceGetName(handle)), handle)
        self.status[label] = "ok"
        try:
            mem = self._query(gpu, ("mem_total_gib",), nv.nvmlDeviceGetMemoryInfo)
            gpu.mem_total_gib = None if mem is None else mem.total / GIB
            gpu.energy0_mj = self._query(gpu, ("energy_j",), nv.nvmlDeviceGetTotalEnergyConsumption)
            self._open_nvlink(nv, gpu)
            self._open_gpm(nv, gpu)
        except _DeviceGone as e:  # lost while opening: it shows as lost, the others still work
            self._mark_gone(gpu, e.state)
        return gpu

    def _open_nvlink(self, nv: Any, gpu: _Gpu) -> None:
        """NVLink counters are read only where the GPU has at least one link."""
        res = self._query(gpu, _NVLINK, nv.nvmlDeviceGetFieldValues,
                          [nv.NVML_FI_DEV_NVLINK_LINK_COUNT])  # fmt: skip
        if res is None:
            return
        fv = res[0]
        if fv.nvmlReturn != nv.NVML_SUCCESS or _field_number(nv, fv) == 0:
            self._mark_na(gpu, _NVLINK, "N/A: this GPU has no NVLink")

    def _open_gpm(self, nv: Any, gpu: _Gpu) -> None:
        names = tuple(n for n, _ in _GPM)
        if not self.gpm:
            self._mark_na(gpu, names, "N/A: GPM reads switched off (gpm=False)")
            return
        try:
            supported = bool(nv.nvmlGpmQueryDeviceSupport(gpu.handle).isSupportedDevice)
        except (nv.NVMLError, AttributeError):  # old driver, or bindings without GPM
            supported = False
        if not supported:
            self._mark_na(gpu, names, "N/A: needs NVML GPM (Hopper or newer GPU and driver)")
            return
        try:
            gpu.gpm_bufs = [nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()]
            nv.nvmlGpmSampleGet(gpu.handle, gpu.gpm_bufs[0])  # start of the first window
            gpu.gpm_time = self.clock()
        except nv.NVMLError as e:
            self._free_gpm(nv, gpu)
            self._mark_na(gpu, names, f"N/A: GPM sampling failed at open ({e})")

    def _system_info(self, nv: Any) -> dict[str, Any]:
        lib = _plumbing()
        driver = lib.field_or_na(nv.nvmlSystemGetDriverVersion)
        # a lambda, so that bindings without the function (AttributeError) are N/A too
        cuda = lib.field_or_na(lambda: nv.nvmlSystemGetCudaDriverVersion())
        info: dict[str, Any] = {
            "driver": None if driver is None else lib.nvml_text(driver),
            "cuda_driver": None if cuda is None else lib.cuda_driver_text(int(cuda)),
        }
        info["gpus"] = [{"label": g.label, "nvml_index": g.index, "uuid": g.uuid, "name": g.name,
                         "mem_total_gib": g.mem_total_gib} for g in self._gpus]  # fmt: skip
        return info

    def close(self) -> None:
        if not self._open:
            return
        nv = self._nv
        for gpu in self._gpus:
            self._free_gpm(nv, gpu)
        _plumbing().shutdown_nvml(nv)
        self._open = False

    @staticmethod
    def _free_gpm(nv: Any, gpu: _Gpu) -> None:
        for buf in gpu.gpm_bufs:
            with contextlib.suppress(Exception):  # freeing on a lost GPU may fail: nothing to do
                nv.nvmlGpmSampleFree(buf)
        gpu.gpm_bufs = []

    # -- describe ---------------------------------------------------------------------------

    @property
    def hardware(self) -> str:
        """e.g. "1× NVIDIA H200" or "2× NVIDIA A100-SXM4-80GB" ("" before open)."""
        names = [g.name for g in self._gpus]
        return ", ".join(f"{names.count(n)}× {n}" for n in dict.fromkeys(names))

    def describe(self) -> str:
        if self.reason:
            return f"NVML unavailable: {self.reason}"
        if not self._open:
            return "NVML (not opened)"
        n = len(self._gpus)
        names = self.hardware if len({g.name for g in self._gpus}) > 1 else self._gpus[0].name
        text = f"NVML: {n} GPU{'s' if n > 1 else ''} ({names})"
        text += f", driver {self.info.get('driver') or 'unknown'}"
        if self.info.get("cuda_driver"):
            text += f", CUDA {self.info['cuda_driver']}"
        gone = [f"{g.label} {g.state}" for g in self._gpus if g.state != "ok"]
        return text + (f" [{'; '.join(gone)}]" if gone else "")

    # -- sampling ---------------------------------------------------------------------------

    def sample(self, now: float | None = None) -> list[Sample]:
        if not self._open:
            raise RuntimeError("NvmlBackend.sample() before open(): call open() or use `with`")
        now = self._now(now)
        read_pcie = self._ticks % self.pcie_every == 0
        read_procs = self._ticks % self.process_every == 0
        self._ticks += 1
        job = self._job_pids() if read_procs else {}
        out: list[Sample] = []
        for gpu in self._gpus:
            if gpu.state == "ok":
                try:
                    values = self._read_gpu(gpu, now, read_pcie)
                    procs = self._read_procs(gpu, now, job) if read_procs else []
                    out.append(Sample(now, gpu.label, values))
                    out += procs
                    continue
                except _DeviceGone as e:
                    self._mark_gone(gpu, e.state)
            out.append(Sample(now, gpu.label, {}, status=gpu.state))
        return out

    def _read_gpu(self, gpu: _Gpu, now: float, read_pcie: bool) -> dict[str, float | None]:
        nv = self._nv
        v: dict[str, float | None] = {}
        util = self._query(gpu, ("gpu_util_pct", "mem_util_pct"), nv.nvmlDeviceGetUtilizationRates)
        v["gpu_util_pct"] = None if util is None else float(util.gpu)
        v["mem_util_pct"] = None if util is None else float(util.memory)
        mem = self._query(gpu, ("mem_used_gib",), nv.nvmlDeviceGetMemoryInfo)
        v["mem_used_gib"] = None if mem is None else mem.used / GIB
        v["mem_total_gib"] = gpu.mem_total_gib
        # What nvmlDeviceGetPowerUsage returns depends on the chip (NVML API reference,
        # https://docs.nvidia.com/deploy/nvml-api/group__nvmlDeviceQueries.html): "On Ampere
        # (except GA100) or newer GPUs, the API returns power averaged over 1 sec interval. On
        # GA100 and older architectures, instantaneous power is returned." So an A100 (GA100)
        # or V100 gives an instant reading, an A10, L4 or H100 a 1 s average; the field values
        # NVML_FI_DEV_POWER_AVERAGE / NVML_FI_DEV_POWER_INSTANT ask for one or the other.
        power = self._query(gpu, ("power_w",), nv.nvmlDeviceGetPowerUsage)
        v["power_w"] = None if power is None else power / 1000  # mW -> W
        energy = None
        if gpu.energy0_mj is not None:
            energy = self._query(gpu, ("energy_j",), nv.nvmlDeviceGetTotalEnergyConsumption)
        v["energy_j"] = None if energy is None else (energy - gpu.energy0_mj) / 1000  # mJ -> J
        temp = self._query(gpu, ("temp_c",), nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU)
        v["temp_c"] = None if temp is None else float(temp)
        clock = self._query(gpu, ("sm_clock_mhz",), nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM)
        v["sm_clock_mhz"] = None if clock is None else float(clock)
        if read_pcie:
            for name, counter in zip(_PCIE, (nv.NVML_PCIE_UTIL_TX_BYTES, nv.NVML_PCIE_UTIL_RX_BYTES),
                                     strict=True):  # fmt: skip
                kbs = self._query(gpu, (name,), nv.nvmlDeviceGetPcieThroughput, counter)
                v[name] = None if kbs is None else kbs / 1e6  # KB/s -> GB/s
        v.update(self._read_nvlink(gpu, now))
        v.update(self._read_gpm(gpu))
        return v

    def _read_nvlink(self, gpu: _Gpu, now: float) -> dict[str, float | None]:
        nv = self._nv
        if _NVLINK[0] in gpu.unsupported:
            return dict.fromkeys(_NVLINK)
        ids = [(nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS),
               (nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS)]  # fmt: skip
        res = self._query(gpu, _NVLINK, nv.nvmlDeviceGetFieldValues, ids)
        if res is None:
            return dict.fromkeys(_NVLINK)
        bad = [fv.nvmlReturn for fv in res if fv.nvmlReturn != nv.NVML_SUCCESS]
        if bad:
            self._on_error(gpu, _NVLINK, nv.NVMLError(bad[0]))
            return dict.fromkeys(_NVLINK)
        tx, rx = (float(_field_number(nv, fv)) for fv in res)
        prev, gpu.nvlink_prev = gpu.nvlink_prev, (now, tx, rx)
        if prev is None or now <= prev[0]:
            return {}  # the first reading only sets the baseline: no rate yet
        dt = now - prev[0]
        out: dict[str, float | None] = {}
        for name, new, old in ((_NVLINK[0], tx, prev[1]), (_NVLINK[1], rx, prev[2])):
            # A counter that went backwards was reset (driver reload): no rate this time.
            out[name] = (new - old) * 1024 / dt / 1e9 if new >= old else None  # KiB -> GB/s
        return out

    def _read_gpm(self, gpu: _Gpu) -> dict[str, float | None]:
        nv = self._nv
        names = tuple(n for n, _ in _GPM)
        if not gpu.gpm_bufs:
            return dict.fromkeys(names)
        # The window is real time on the backend's clock, whatever stamp the caller passed.
        t = self.clock()
        if t - gpu.gpm_time < GPM_MIN_WINDOW_S:
            return {}  # too soon after the last GPM sample: not read this tick (absent, not N/A)
        prev, cur = gpu.gpm_bufs
        if self._query(gpu, names, nv.nvmlGpmSampleGet, cur) is None:
            return dict.fromkeys(names)
        mg = nv.c_nvmlGpmMetricsGet_t()
        mg.version = nv.NVML_GPM_METRICS_GET_VERSION
        mg.numMetrics = len(_GPM)
        mg.sample1, mg.sample2 = prev, cur
        for i, (_, metric) in enumerate(_GPM):
            mg.metrics[i].metricId = getattr(nv, metric)
        try:
            nv.nvmlGpmMetricsGet(mg)
        except nv.NVMLError as e:
            self._on_error(gpu, names, e)
            return dict.fromkeys(names)
        gpu.gpm_bufs, gpu.gpm_time = [cur, prev], t  # this sample opens the next window
        out: dict[str, float | None] = {}
        for i, name in enumerate(names):
            m = mg.metrics[i]
            out[name] = float(m.value) if m.nvmlReturn == nv.NVML_SUCCESS else None
        return out

    def _job_pids(self) -> dict[int, int] | None:
        """{pid: rank} for the job's processes and their children; None: report all."""
        if self.pids_fn is None:
            return None
        try:
            ranks = dict(self.pids_fn())
        except Exception as e:  # a broken callback must not stop the GPU readings
            self.status["pids_fn"] = f"error: {e!r}"
            return {}
        self.status.pop("pids_fn", None)
        found: dict[int, int] = {}
        for rank, pid in ranks.items():
            found[pid] = rank
            with contextlib.suppress(psutil.Error, ValueError):
                found.update({c.pid: rank for c in psutil.Process(pid).children(recursive=True)})
        return found

    def _read_procs(self, gpu: _Gpu, now: float, job: dict[int, int] | None) -> list[Sample]:
        procs = self._query(gpu, ("proc_mem_gib",), self._nv.nvmlDeviceGetComputeRunningProcesses)
        if procs is None:
            return []
        used: dict[str, float | None] = {}
        for p in procs:
            if job is None:
                source = f"{gpu.label}/pid{p.pid}"
            elif p.pid in job:
                source = f"{gpu.label}/rank{job[p.pid]}"
            else:
                continue  # another user's or another job's process
            mem = None if p.usedGpuMemory is None else p.usedGpuMemory / GIB
            old = used.get(source, 0.0)
            # A rank with several processes on the GPU: sum them; one N/A makes the sum N/A.
            used[source] = None if mem is None or old is None else old + mem
        key = f"{gpu.label}.proc_mem_gib"
        if job and procs and not used:
            # Inside a container NVML may list processes by the host's PIDs, which never match
            # ours: say so rather than let the per-rank lines vanish without a word.
            self.status[key] = (f"NVML lists {len(procs)} compute process(es) on this GPU, none "
                                "with a PID of this job (in a container, NVML may report the "
                                "host's PIDs): no per-rank memory")  # fmt: skip
        else:
            self.status.pop(key, None)
        return [Sample(now, s, {"proc_mem_gib": m}) for s, m in used.items()]

    # -- errors -----------------------------------------------------------------------------

    def _query(self, gpu: _Gpu, fields: tuple[str, ...], fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(gpu.handle, *args)``, or None when any of ``fields`` is N/A or the call fails."""
        if any(f in gpu.unsupported for f in fields):
            return None
        try:
            result = fn(gpu.handle, *args)
        except self._nv.NVMLError as e:
            self._on_error(gpu, fields, e)
            return None
        for f in fields:  # a transient error has passed
            self.status.pop(f"{gpu.label}.{f}", None)
        return result

    def _on_error(self, gpu: _Gpu, fields: tuple[str, ...], err: Exception) -> None:
        code = _code_name(self._nv, err)
        if code in _NOT_AVAILABLE:
            self._mark_na(gpu, fields, _NOT_AVAILABLE[code])
        elif code in _DEVICE_LOST:
            raise _DeviceGone(f"lost: {err} ({code}); no further readings from this GPU")
        elif code in _DEVICE_FAILED:
            raise _DeviceGone(f"failed: {err} ({code}); no further readings from this GPU")
        else:  # Timeout, Unknown, ...: N/A this time, asked again next sample
            for f in fields:
                self.status[f"{gpu.label}.{f}"] = f"error: {err} ({code}); will retry"

    def _mark_na(self, gpu: _Gpu, fields: tuple[str, ...], reason: str) -> None:
        for f in fields:
            gpu.unsupported[f] = reason
            self.status[f"{gpu.label}.{f}"] = reason

    def _mark_gone(self, gpu: _Gpu, state: str) -> None:
        gpu.state = state
        self.status[gpu.label] = state
        self._free_gpm(self._nv, gpu)


def _field_number(nv: Any, fv: Any) -> float:
    """The number in an nvmlFieldValue_t, read through the member its valueType names."""
    member = {
        nv.NVML_VALUE_TYPE_DOUBLE: "dVal",
        nv.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
        nv.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
        nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
        nv.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
        nv.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    }.get(fv.valueType, "ullVal")
    return getattr(fv.value, member)
