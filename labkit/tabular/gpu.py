"""The GPU tier's code paths: what notebook 08 runs where ``labkit.hardware`` reports CUDA GPUs.

    p = plan(hardware.gpu_info(), rmm_pool_size="2GB", protocol="tcp")
    print(p.describe())                      # what runs here, what is missing, what cannot
    with cluster.local_workers(p.workers, device="cuda", cuda_kwargs=p.cuda_kwargs) as w: ...

* **One worker per GPU**: ``dask_cuda.LocalCUDACluster`` starts one worker process per GPU named
  in ``CUDA_VISIBLE_DEVICES`` and pins each to its own GPU (https://docs.rapids.ai/api/dask-cuda/
  stable/quickstart/). MIG instances are named by their ``MIG-…`` UUIDs the same way.
* **The RMM pool** (``rmm_pool_size``): each worker reserves one large block of GPU memory up front
  and serves allocations from it, instead of a ``cudaMalloc``/``cudaFree`` pair each (RAPIDS
  Memory Manager, https://docs.rapids.ai/api/rmm/stable/). :func:`rmm_allocation_times` times
  both on one worker, with resources of its own, so the worker's pool is left as it was.
* **UCX** (``protocol="ucx"``): Dask's transfers between workers over NVLink or InfiniBand instead
  of TCP through host memory. Dask-CUDA prefers automatic configuration, the protocol alone, and
  keeps the ``enable_nvlink``/``enable_infiniband`` flags for transport-specific benchmarking
  (https://docs.rapids.ai/api/dask-cuda/stable/examples/ucx/); it needs the UCXX backend,
  ``distributed-ucxx``, which the ``rapids`` extra installs (CUDA 12 wheels).
* **XGBoost on GPUs**: the same ``xgboost.dask.train`` with ``device="cuda"``; the histograms are
  all-reduced by NCCL (https://xgboost.readthedocs.io/en/stable/gpu/index.html).
* **cuML's multi-GPU estimators**: ``cuml.dask`` (KMeans, random forest...), one process per GPU
  as everywhere here (https://docs.rapids.ai/api/cuml/stable/api/#multi-node-multi-gpu-algorithms).
* **MIG**: see :data:`MIG_LIMITS`.

Each function takes its GPU packages as they import, so tests run every path with fakes; none is
run on the CPU tier, and no GPU figure is ever made up: the course has no GPU recording of this
notebook yet (:data:`RECORDED` is empty), and the CPU tier says so.
"""

from __future__ import annotations

import importlib
import importlib.util
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from labkit import verdict
from labkit.tabular.cluster import RAPIDS_INSTALL, MissingExtra
from labkit.validate import one_of, whole

RAPIDS_MODULES = ("dask_cuda", "rmm", "cuml", "cupy")
"""The GPU stack the ``rapids`` extra installs (pyproject.toml), by import name."""
UCX_MODULE = "distributed_ucxx"
"""Dask's UCX backend (``distributed-ucxx``): needed only with ``protocol="ucx"``."""
PROTOCOLS = ("tcp", "ucx")
RECORDED: dict[str, Any] = {}
"""GPU figures recorded for this notebook (none yet: a GPU run fills them, labelled)."""
MIG_LIMITS = (
    "a MIG instance is a GPU of its own to Dask: one worker per instance, named by its MIG UUID "
    "in CUDA_VISIBLE_DEVICES; RAPIDS supports clusters of identical instances only "
    "(https://docs.rapids.ai/deployment/stable/guides/mig)",
    "MIG instances cannot use CUDA IPC, so NVLink and NVSwitch are unavailable between them: "
    "their transfers (UCX, NCCL) go through host memory "
    "(https://docs.rapids.ai/deployment/stable/guides/mig)",
    "each instance has its own slice of memory and compute; instances on one GPU share no memory "
    "and cannot be pooled into one larger device (NVIDIA MIG User Guide, 'Concepts', "
    "https://docs.nvidia.com/datacenter/tesla/mig-user-guide/)",
    "NVML's utilisation query is not supported on MIG-enabled GPUs (nvmlDeviceGetUtilizationRates, "
    "https://docs.nvidia.com/deploy/nvml-api/): watch each instance's activity with DCGM's "
    "profiling metrics (DCGM_FI_PROF_GR_ENGINE_ACTIVE, DCGM_FI_PROF_SM_ACTIVE) per GPU instance, "
    "and its memory with NVML (NVIDIA MIG User Guide, 'Monitoring MIG Devices')",
)


def missing(modules: Sequence[str] = RAPIDS_MODULES) -> list[str]:
    """The GPU packages that cannot be imported here."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def require(module: str) -> Any:
    """Import ``module`` or raise :class:`MissingExtra` naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingExtra(f"{module} is not installed ({err}): the GPU tier of notebook 08 needs "
                           f"the RAPIDS stack, `{RAPIDS_INSTALL}`") from None  # fmt: skip


@dataclass(frozen=True)
class GpuPlan:
    """What the GPU tier runs on this machine, or why it does not."""

    gpus: tuple[Any, ...]
    """``labkit.hardware.GpuInfo`` of each visible GPU (empty on the CPU tier)."""
    rmm_pool_size: str | None
    protocol: str
    absent: tuple[str, ...] = field(default=())
    """GPU packages missing here."""

    @property
    def workers(self) -> int:
        return len(self.gpus)

    @property
    def runs(self) -> bool:
        """True when the GPU paths can run: GPUs and every package present."""
        return bool(self.gpus) and not self.absent

    @property
    def mig(self) -> bool:
        return any("MIG" in str(getattr(g, "name", "")) or str(getattr(g, "uuid", "") or "")
                   .startswith("MIG-") for g in self.gpus)  # fmt: skip

    @property
    def cuda_kwargs(self) -> dict[str, Any]:
        """``LocalCUDACluster``'s arguments: the GPUs by UUID (stable across tools, and the only
        name a MIG instance has), the pool, the protocol."""
        names = [str(g.uuid) if getattr(g, "uuid", None) else str(g.index) for g in self.gpus]
        kwargs: dict[str, Any] = {"CUDA_VISIBLE_DEVICES": ",".join(names),
                                  "protocol": self.protocol}  # fmt: skip
        if self.rmm_pool_size:
            kwargs["rmm_pool_size"] = self.rmm_pool_size
        # UCX: the protocol alone, and UCX picks the transports (Dask-CUDA's automatic
        # configuration); the enable_* flags are for benchmarking one transport
        return kwargs

    def xgboost_params(self) -> dict[str, Any]:
        return {"device": "cuda" if self.gpus else "cpu", "tree_method": "hist"}

    def describe(self) -> str:
        if not self.gpus:
            return ("CPU tier: no CUDA GPU here, so none of the GPU paths runs. It cannot show the "
                    "GPU's speed, the RMM pool's effect, UCX against TCP, NCCL's all-reduce, the "
                    "GPU's matrix memory (one ELLPACK page, predicted in section 4) or cuML; "
                    "the prose and the code below say what each does. No GPU run of this notebook "
                    "has been recorded yet, so no GPU figure is shown.")
        lines = [f"GPU tier: {self.workers} GPU(s) -> {self.workers} Dask worker(s), one per GPU"]
        lines += [f"  {g}" for g in self.gpus]
        lines.append(f"  LocalCUDACluster({', '.join(f'{k}={v!r}' for k, v in self.cuda_kwargs.items())})")
        if self.mig:
            lines += ["  MIG instances:"] + [f"    - {limit}" for limit in MIG_LIMITS]
        if self.absent:
            lines.append(f"  missing: {', '.join(self.absent)}: install them with "
                         f"`{RAPIDS_INSTALL}`; until then the GPU cells say so and skip")
        return "\n".join(lines)


def plan(gpus: Sequence[Any], *, rmm_pool_size: str | None = "1GB", protocol: str = "tcp",
         absent: Sequence[str] | None = None) -> GpuPlan:
    """The GPU tier's plan for ``gpus`` (``labkit.hardware.gpu_info()``)."""
    one_of("protocol", protocol, PROTOCOLS)
    wanted = RAPIDS_MODULES + ((UCX_MODULE,) if protocol == "ucx" else ())
    return GpuPlan(gpus=tuple(gpus), rmm_pool_size=rmm_pool_size, protocol=protocol,
                   absent=tuple(missing(wanted) if absent is None else absent))  # fmt: skip


@dataclass(frozen=True)
class AllocationTimes:
    """Seconds per allocate-and-free of one buffer size, without and with an RMM pool, measured
    on one worker: one sample per batch of calls."""

    nbytes: int
    worker: str
    plain_s: list[float]
    pool_s: list[float]

    @property
    def comparison(self) -> verdict.Comparison:
        return verdict.compare_times(self.plain_s, self.pool_s, names=("cudaMalloc", "RMM pool"))

    def describe(self) -> str:
        return (f"{self.nbytes / 2**20:.0f} MiB buffers, allocate and free, on worker {self.worker}"
                f" (measured, seconds per call):\n{self.comparison}")


def allocation_samples(nbytes: int, repeats: int, batches: int, pool_bytes: int, *,
                       rmm: Any = None) -> dict[str, list[float]]:
    """Run where the GPU is (a worker): seconds per allocate-and-free of ``nbytes``, one sample
    per batch of ``repeats`` calls, through a plain ``cudaMalloc`` resource and through a pool
    on top of it. Both resources are this function's own (``rmm.mr``), so the process's current
    resource (the worker's ``rmm_pool_size`` pool) is not touched."""
    rmm = rmm or require("rmm")
    plain = rmm.mr.CudaMemoryResource()
    pool = rmm.mr.PoolMemoryResource(plain, initial_pool_size=pool_bytes)
    out: dict[str, list[float]] = {}
    for name, mr in (("plain", plain), ("pool", pool)):
        mr.deallocate(mr.allocate(nbytes), nbytes)  # the first call sets the resource up: untimed
        out[name] = []
        for _ in range(batches):
            start = time.perf_counter()
            for _ in range(repeats):
                mr.deallocate(mr.allocate(nbytes), nbytes)
            out[name].append((time.perf_counter() - start) / repeats)
    return out


def rmm_allocation_times(workers: Any, nbytes: int, repeats: int = 50, batches: int = 7, *,
                         pool_bytes: int | None = None, rmm: Any = None) -> AllocationTimes:
    """Time allocations with and without a pool on the first worker of ``workers`` (its GPU,
    its process: ``client.run(..., workers=[address])``), not in this notebook's kernel, which
    would otherwise create a CUDA context on that worker's GPU. ``rmm``: the module, sent to
    the worker (tests send a fake); None imports it there."""
    whole("nbytes", nbytes, low=1)
    whole("repeats", repeats, low=1)
    whole("batches", batches, low=1)
    address = workers.addresses[0]
    got = workers.client.run(allocation_samples, nbytes, repeats, batches,
                             pool_bytes or 4 * nbytes, rmm=rmm, workers=[address])[address]  # fmt: skip
    return AllocationTimes(nbytes=nbytes, worker=address, plain_s=got["plain"], pool_s=got["pool"])


def cuml_kmeans(client: Any, x: Any, k: int, *, kmeans_cls: Any = None,
                to_device: Any = None) -> Any:
    """cuML's multi-GPU KMeans on the Dask array ``x`` (one partition per GPU worker). cuML's
    Dask estimators take CuPy- or cuDF-backed collections: each NumPy partition is copied to
    its worker's GPU first (``to_device``, CuPy's ``asarray`` by default), where it lies."""
    whole("k", k, low=1)
    kmeans_cls = kmeans_cls or require("cuml.dask.cluster").KMeans
    to_device = to_device or require("cupy").asarray
    model = kmeans_cls(n_clusters=k, client=client)
    return model.fit(x.map_blocks(to_device, dtype=x.dtype))
