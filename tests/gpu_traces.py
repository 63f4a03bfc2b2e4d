"""Synthetic GPU profiler traces in Kineto's layout, for the GPU paths of the trace analysis.

No GPU runs here, so the GPU branch of ``labkit.profiling`` is tested on traces built to the
shape ``torch.profiler`` writes on a CUDA machine (pytorch/kineto,
``libkineto/src/output_json.cpp``; the field names checked against real traces of HTA's test
data): ``ProfilerStep#N`` on the training thread, a ``cudaLaunchKernel`` (``cuda_runtime``)
per kernel carrying the kernel's ``correlation`` id, the kernels on CUDA streams (a process
per device, a thread per stream), NCCL kernels on their own stream, the process group's
``nccl:all_reduce`` range, and Kineto's projection of each CPU range onto the streams its
kernels ran on (``gpu_user_annotation``: ``ProfilerStep#N``, ``forward`` and ``nccl:all_reduce``
again, from the first kernel the range launched to the end of the last, as the profiler writes
them on a CUDA machine; pytorch/kineto ``libkineto/src/CuptiActivityProfiler.cpp``,
``GpuUserEventMap``). An analysis must not count those twice: they name work, they are not
work. Every figure a test expects is computed from the intervals the
builder placed, never read back from the code under test. These traces are *synthetic*: a
real GPU trace differs in every number, and the real ones are read by
``tests/test_gpu_traces_real.py`` where they are present.

The GPU runs a step's kernels one after another on one stream, each starting when both its
launch has happened and the previous kernel has ended, so kernels longer than their launches
leave the GPU behind the CPU: the last steps' kernels run after their ProfilerStep has
closed, as in real training.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CPU_PID, MAIN_TID = 4242, 4242
GPU_PID, COMPUTE_STREAM, NCCL_STREAM = 0, 7, 20
LEGACY = {"cpu_op": "Operator", "kernel": "Kernel", "cuda_runtime": "Runtime",
          "gpu_memcpy": "Memcpy", "gpu_memset": "Memset"}  # fmt: skip


@dataclass
class Built:
    """A synthetic trace and the ground truth it was built from (µs)."""

    events: list[dict[str, Any]]
    meta: dict[str, Any]
    window: tuple[float, float]  # first step's start, last step's end
    compute: list[tuple[float, float]] = field(default_factory=list)  # kernels of the steps
    comm: list[tuple[float, float]] = field(default_factory=list)  # NCCL kernels of the steps
    memory: list[tuple[float, float]] = field(default_factory=list)  # copies of the steps
    earlier: list[tuple[float, float]] = field(default_factory=list)  # queued before step 1
    step_ends: list[float] = field(default_factory=list)  # per step: its last work's end
    all_reduces: int = 0

    def write(self, path: Path, *, gz: bool = False) -> Path:
        text = json.dumps({**self.meta, "traceEvents": self.events})
        path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
        return path


def build(*, rank: int = 0, world_size: int = 2, steps: int = 3, step_us: float = 1000.0,
          kernels: int = 8, kernel_us: float = 150.0, launch_us: float = 6.0,
          all_reduce_us: float = 200.0, earlier: int = 0, copy_us: float = 0.0,
          schema: str = "current", profiler_steps: bool = True,
          gpu_annotations: bool = True) -> Built:
    """A ``steps``-step trace of one rank.

    Each step launches ``kernels`` compute kernels of ``kernel_us`` at even intervals over its
    first half, one all-reduce (``all_reduce_us``, on the NCCL stream, launched after half the
    compute kernels: it overlaps the rest) unless ``all_reduce_us`` is 0, and a host-to-device
    copy of ``copy_us`` first when it is not 0. ``earlier`` kernels queued by the step before
    the window run at its start (their launches were not recorded). ``schema="2021"`` writes
    the 2021 profiler's category names, the steps as operators. ``gpu_annotations`` adds the
    ``gpu_user_annotation`` projections of the step, forward and all-reduce ranges."""
    events: list[dict[str, Any]] = []
    meta: dict[str, Any] = {
        "schemaVersion": 1,
        "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85e9}],
        "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world_size},
    }
    t0 = 1_000_000.0
    built = Built(events, meta, (t0, t0 + steps * step_us))
    corr = 100

    def x(name: str, cat: str, ts: float, dur: float, pid: int, tid: int, **args: Any) -> None:
        if schema == "2021":
            cat = LEGACY.get(cat, cat)
        events.append({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts,
                       "dur": dur, "args": args})  # fmt: skip

    gpu_free = {COMPUTE_STREAM: t0, NCCL_STREAM: t0}
    for k in range(earlier):  # queued before the window: only the kernel is in the trace
        start = gpu_free[COMPUTE_STREAM]
        x("void at::native::vectorized_elementwise_kernel<4>(...)", "kernel", start, kernel_us,
          GPU_PID, COMPUTE_STREAM, correlation=corr - 90 + k, stream=COMPUTE_STREAM, device=0)
        built.earlier.append((start, start + kernel_us))
        gpu_free[COMPUTE_STREAM] = start + kernel_us

    def launch(name: str, cat: str, at: float, dur: float, stream: int) -> tuple[float, float]:
        nonlocal corr
        corr += 1
        x("cudaLaunchKernel" if cat == "kernel" else "cudaMemcpyAsync", "cuda_runtime", at,
          launch_us, CPU_PID, MAIN_TID, correlation=corr)
        start = max(at + launch_us, gpu_free[stream])
        x(name, cat, start, dur, GPU_PID, stream, correlation=corr, stream=stream, device=0)
        gpu_free[stream] = start + dur
        built.step_ends[-1] = max(built.step_ends[-1], start + dur)
        return start, start + dur

    def project(name: str, placed: list[tuple[float, float]], stream: int) -> None:
        if gpu_annotations and placed and schema == "current":
            start, end = min(a for a, _ in placed), max(b for _, b in placed)
            # Kineto writes these with the range's "External id" only: no stream or device
            # argument, so HTA (which takes a kernel's stream from args) does not read them
            x(name, "gpu_user_annotation", start, end - start, GPU_PID, stream,
              **{"External id": len(events)})

    for s in range(steps):
        lo = t0 + s * step_us
        built.step_ends.append(lo + step_us)
        first_compute, first_comm = len(built.compute), len(built.comm)
        step_name = f"ProfilerStep#{s + 10}"
        if profiler_steps:
            x(step_name, "cpu_op" if schema == "2021" else "user_annotation", lo, step_us,
              CPU_PID, MAIN_TID)
        x("forward", "user_annotation", lo + 1, step_us / 2, CPU_PID, MAIN_TID)
        x("aten::mm", "cpu_op", lo + 1, step_us / 2, CPU_PID, MAIN_TID)
        at = lo + 2
        if copy_us:
            built.memory.append(launch("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", at,
                                       copy_us, COMPUTE_STREAM))  # fmt: skip
        for k in range(kernels):
            at = lo + 2 + k * (step_us / 2) / kernels
            if k == kernels // 2 and all_reduce_us:
                x("nccl:all_reduce", "user_annotation", at, 20, CPU_PID, MAIN_TID)
                x("c10d::allreduce_", "cpu_op", at, 15, CPU_PID, MAIN_TID)
                built.comm.append(launch("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*)",
                                         "kernel", at + 1, all_reduce_us, NCCL_STREAM))
                built.all_reduces += 1
            built.compute.append(launch("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n(...)", "kernel",
                                        at + 3, kernel_us, COMPUTE_STREAM))
        mine = built.compute[first_compute:]
        project(step_name, mine, COMPUTE_STREAM)
        project("forward", mine, COMPUTE_STREAM)  # the forward range launched them all
        project("nccl:all_reduce", built.comm[first_comm:], NCCL_STREAM)
    return built
