"""All-reduce one tensor across ranks: check the sum, then time it.

    labkit.launch.run("labkit.workers.allreduce", nproc=2, config={"numel": 2**20})

Config (all optional):
    numel    elements in the float32 tensor each rank contributes (default 2**20 = 4 MiB)
    repeats  timed all-reduces after warm-up (default 10)
    warmup   untimed all-reduces first: connection setup and caches (default 3)
    fail_rank  this rank fails before the all-reduce, to show what a failing rank looks like
    fail_how   how it fails: "raise" (default: a Python exception) or "kill" (it sends itself
               SIGKILL, the signal Linux's out-of-memory killer sends: no code runs after it)

Each rank fills its tensor with ``rank + 1``; after a sum all-reduce every element must equal
1 + 2 + ... + n = n(n+1)/2 on every rank. The timing follows NCCL-tests (doc/PERFORMANCE.md):

    algbw = message bytes / time                  (what the caller sees)
    busbw = algbw * 2(n-1)/n                      (what each link carries in a ring all-reduce,
                                                   comparable across n with the hardware peak)
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import time

import torch
import torch.distributed as tdist

from labkit import dist, formulas


def _sync(device: torch.device) -> None:
    # CUDA collectives are asynchronous: without this we would time the launch, not the work.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dist.entrypoint
def main(ctx: dist.Context) -> dict:
    numel = int(ctx.config.get("numel", 2**20))
    repeats = int(ctx.config.get("repeats", 10))
    warmup = int(ctx.config.get("warmup", 3))
    if numel < 1 or repeats < 1 or warmup < 0:
        raise ValueError(
            f"config numel={numel}, repeats={repeats}, warmup={warmup}: need "
            "numel >= 1, repeats >= 1, warmup >= 0"
        )
    n = ctx.world_size

    fail_rank, fail_how = ctx.config.get("fail_rank"), ctx.config.get("fail_how", "raise")
    if fail_how not in ("raise", "kill"):
        raise ValueError(f"config fail_how={fail_how!r}: use 'raise' or 'kill'")
    if fail_rank == ctx.rank and fail_how == "kill":
        time.sleep(0.5)  # let the other ranks reach the all-reduce, where they wait for us
        os.kill(os.getpid(), signal.SIGKILL)
    if fail_rank == ctx.rank:
        raise RuntimeError(f"rank {ctx.rank} fails on purpose (config fail_rank={fail_rank})")

    # 1. Correctness: every rank must end with the same, known sum.
    x = torch.full((numel,), float(ctx.rank + 1), dtype=torch.float32, device=ctx.device)
    with ctx.phase("all_reduce"):
        tdist.all_reduce(x, op=tdist.ReduceOp.SUM)
    expected = n * (n + 1) / 2
    value = x[0].item()
    if not torch.all(x == expected):
        raise AssertionError(f"rank {ctx.rank}: all-reduce gave {value}, expected {expected}")
    ctx.print0(f"all-reduce of {n} ranks: every element = {value:g} (expected {expected:g})")

    # 2. Timing. A zero buffer stays zero under repeated sums, so values never overflow.
    buf = torch.zeros(numel, dtype=torch.float32, device=ctx.device)
    times_s = []
    for i in range(warmup + repeats):
        _sync(ctx.device)
        t0 = time.perf_counter()
        with ctx.phase("all_reduce"):
            tdist.all_reduce(buf)
        _sync(ctx.device)
        if i >= warmup:
            times_s.append(time.perf_counter() - t0)
        ctx.heartbeat(step=i + 1, total=warmup + repeats)

    median_s = statistics.median(times_s)
    msg_bytes = numel * x.element_size()
    algbw = formulas.algbw(msg_bytes, median_s)  # bytes/s
    busbw = algbw * formulas.bus_bandwidth_factor("all_reduce", n)
    ctx.print0(
        f"{msg_bytes / 2**20:.3g} MiB all-reduce: median {median_s * 1e3:.3g} ms, "
        f"busbw {busbw / 1e9:.3g} GB/s ({ctx.backend}, {ctx.device.type})"
    )
    return {
        "rank": ctx.rank,
        "world_size": n,
        "backend": ctx.backend,
        "device": str(ctx.device),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "value": value,
        "expected": expected,
        "bytes_per_element": x.element_size(),
        "message_bytes": msg_bytes,
        "repeats": len(times_s),
        "median_s": median_s,
        "min_s": min(times_s),
        "algbw_GBps": algbw / 1e9,
        "busbw_GBps": busbw / 1e9,
    }


if __name__ == "__main__":
    main()
