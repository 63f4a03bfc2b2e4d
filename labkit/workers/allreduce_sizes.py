"""Time all-reduces of a few message sizes, taking turns, and keep every sample.

    allreduce_sizes.run(allreduce_sizes.AllReduceSizesConfig(sizes=(2**18, 2**20, 2**23)), nproc=2)

Config (:class:`AllReduceSizesConfig`):
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

import dataclasses
import time
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as tdist

from labkit import validate
from labkit.jobs import runtime
from labkit.jobs.spec import WorkerConfig
from labkit.workers.job_config import counts

if TYPE_CHECKING:
    from labkit.jobs import launch


@dataclasses.dataclass(frozen=True, kw_only=True)
class AllReduceSizesConfig(WorkerConfig):
    """All-reduces of a few sizes, timed in turns."""

    WORKER: ClassVar[str] = "labkit.workers.allreduce_sizes"
    sizes: tuple[int, ...]
    """Message sizes in bytes, at least one."""
    rounds: int = 15
    """Timed rounds; each all-reduces every size once."""
    warmup: int = 2
    """Untimed rounds first."""

    def __post_init__(self) -> None:
        super().__post_init__()
        counts("sizes", self.sizes, why="message sizes in bytes")
        validate.whole("rounds", self.rounds, low=1)
        validate.whole("warmup", self.warmup, low=0)


def run(config: AllReduceSizesConfig, *, nproc: int = 2, **launch_options: Any) -> launch.JobResult:
    """Launch ``config`` on ``nproc`` ranks; ``launch_options`` go to ``launch.run``."""
    from labkit.jobs import launch  # the caller's side: a rank never imports the launcher
    return launch.run(config, nproc=nproc, **launch_options)


@runtime.entrypoint
def main(ctx: runtime.Context) -> dict[str, Any]:
    cfg = AllReduceSizesConfig.from_dict(ctx.config)
    sizes, rounds, warmup = cfg.sizes, cfg.rounds, cfg.warmup
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
