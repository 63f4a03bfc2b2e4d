"""Time all-reduces of a few message sizes, taking turns, and keep every sample.

    labkit.jobs.launch.run("labkit.workers.allreduce_sizes", nproc=2,
                      config={"sizes": [2**18, 2**20, 2**23], "rounds": 15})

Config:
    sizes    message sizes in bytes (each rounded down to whole float32 elements, at least one
             per rank)
    rounds   timed rounds (default 15); each round all-reduces every size once, in turn, so a
             burst of other work on a shared machine falls on every size, not on whichever
             happened to be running
    warmup   untimed rounds first (default 2): connection setup, buffers

Returns on every rank ``sizes`` (the bytes timed) and ``samples_s`` (one list of seconds per
size, in the same order): each rank's own wall time of each all-reduce, synchronised on a GPU.
Where :mod:`labkit.workers.collectives` reports a median per size, this keeps the samples, for a
verdict with spread (``labkit.verdict.compare_times``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as tdist

from labkit.jobs import runtime


@runtime.entrypoint
def main(ctx: runtime.Context) -> dict[str, Any]:
    sizes = [int(s) for s in ctx.config.get("sizes", [])]
    rounds, warmup = int(ctx.config.get("rounds", 15)), int(ctx.config.get("warmup", 2))
    if not sizes or any(s < 1 for s in sizes) or rounds < 1 or warmup < 0:
        raise ValueError(f"config sizes={sizes}, rounds={rounds}, warmup={warmup}: need at least "
                         "one size >= 1 byte, rounds >= 1, warmup >= 0")  # fmt: skip
    n = ctx.world_size
    numels = [max(n, s // 4) for s in sizes]
    bufs = [torch.zeros(k, dtype=torch.float32, device=ctx.device) for k in numels]
    samples: list[list[float]] = [[] for _ in sizes]
    for i in range(warmup + rounds):
        for buf, into in zip(bufs, samples, strict=True):
            _sync(ctx.device)
            t0 = time.perf_counter()
            with ctx.phase("all_reduce"):
                tdist.all_reduce(buf)  # zeros stay zeros: no overflow over the rounds
            _sync(ctx.device)
            if i >= warmup:
                into.append(time.perf_counter() - t0)
        ctx.heartbeat(step=i + 1, total=warmup + rounds)
    return {"rank": ctx.rank, "backend": ctx.backend, "device": str(ctx.device),
            "sizes": [4 * k for k in numels], "samples_s": samples}  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # NCCL calls return before the GPU finishes


if __name__ == "__main__":
    main()
