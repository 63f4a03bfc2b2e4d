"""Time all-reduce, all-gather and reduce-scatter over message sizes, as NCCL-tests does.

    collectives.run(collectives.CollectivesConfig(sizes=(8, 1024, 2**20)), nproc=2)

Config (:class:`CollectivesConfig`, every field optional):
    sizes       message sizes S in bytes (default: powers of 4 from 8 B to 32 MiB); each is
                rounded down to a multiple of 4 x world_size (whole float32 elements per rank)
    collectives any of "all_reduce", "all_gather", "reduce_scatter" (default: all three)
    repeats     timed runs per size after warm-up (default 10); warmup (default 3)

S follows NCCL-tests (doc/PERFORMANCE.md): the tensor reduced (all-reduce), the gathered
result (all-gather), the full input (reduce-scatter). For each (collective, S) rank 0 reports
the slowest rank's median time t (the slowest rank sets the pace), then

    algbw = S / t
    busbw = algbw x factor    (all-reduce 2(n-1)/n; all-gather, reduce-scatter (n-1)/n)

busbw is comparable with a link's peak bandwidth whatever n is. On the CPU tier the link is
gloo over TCP loopback: the numbers describe this machine's memory copies and kernel
network stack, not a GPU interconnect, and every row says so. gloo also runs reduce_scatter
as an all-reduce plus a local chunk (pytorch #118911): that row is labelled "emulated".
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as tdist

from labkit import formulas, validate
from labkit.jobs import runtime
from labkit.jobs.spec import WorkerConfig
from labkit.parallel import comm
from labkit.workers.job_config import counts

if TYPE_CHECKING:
    from labkit.jobs import launch

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
DEFAULT_SIZES = tuple(8 * 4**k for k in range(12))  # 8 B, 32 B, ..., 32 MiB


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectivesConfig(WorkerConfig):
    """Collectives timed over message sizes."""

    WORKER: ClassVar[str] = "labkit.workers.collectives"
    sizes: tuple[int, ...] = DEFAULT_SIZES
    """Message sizes S in bytes (default: powers of 4 from 8 B to 32 MiB)."""
    collectives: tuple[str, ...] = COLLECTIVES
    """Which of COLLECTIVES to time, in this order."""
    repeats: int = 10
    """Timed runs per size after warm-up."""
    warmup: int = 3
    """Untimed runs per size first."""

    def __post_init__(self) -> None:
        super().__post_init__()
        counts("sizes", self.sizes, why="message sizes in bytes")
        for kind in self.collectives:
            validate.one_of("collectives", kind, COLLECTIVES)
        validate.whole("repeats", self.repeats, low=1)
        validate.whole("warmup", self.warmup, low=0)


def run(config: CollectivesConfig, *, nproc: int = 2, **launch_options: Any) -> launch.JobResult:
    """Launch ``config`` on ``nproc`` ranks; ``launch_options`` go to ``launch.run``."""
    from labkit.jobs import launch  # the caller's side: a rank never imports the launcher
    return launch.run(config, nproc=nproc, **launch_options)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # NCCL calls return before the GPU finishes


def slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds``: the slowest rank sets the pace."""
    # On the collective's device: NCCL refuses CPU tensors.
    t = torch.tensor([seconds], dtype=torch.float64, device=runtime.collective_device())
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return float(t.item())


def element_count(size_bytes: int, world_size: int) -> int:
    """float32 elements in a message of ``size_bytes``, a multiple of ``world_size`` (>= n)."""
    return max(world_size, (size_bytes // 4) // world_size * world_size)


def _one(kind: str, numel: int, n: int, device: torch.device):
    """A zero-argument function that runs collective ``kind`` once on a message of ``numel``."""
    if kind == "all_reduce":
        buf = torch.zeros(numel, device=device)  # zeros stay zeros: no overflow over repeats
        return lambda: comm.all_reduce(buf, None)
    if kind == "all_gather":
        out, inp = torch.empty(numel, device=device), torch.zeros(numel // n, device=device)
        return lambda: comm.all_gather(out, inp, None)
    out, inp = torch.empty(numel // n, device=device), torch.zeros(numel, device=device)
    return lambda: comm.reduce_scatter(out, inp, None)


def _check(n: int, rank: int, device: torch.device) -> None:
    """Each collective gives the known answer once before any timing (a wrong fast op is
    worthless)."""
    x = torch.full((2 * n,), float(rank + 1), device=device)
    comm.all_reduce(x, None)
    total = n * (n + 1) / 2
    assert torch.all(x == total), f"all_reduce gave {x.tolist()}, expected {total}"
    out = torch.empty(2 * n, device=device)
    comm.all_gather(out, torch.full((2,), float(rank), device=device), None)
    want = torch.arange(n, device=device, dtype=out.dtype).repeat_interleave(2)
    assert torch.equal(out, want), f"all_gather gave {out.tolist()}, expected {want.tolist()}"
    piece = torch.empty(2, device=device)
    comm.reduce_scatter(piece, torch.arange(2 * n, device=device, dtype=torch.float32), None)
    want = torch.arange(2 * rank, 2 * rank + 2, device=device, dtype=torch.float32) * n
    assert torch.equal(piece, want), f"reduce_scatter gave {piece.tolist()}, want {want.tolist()}"


@runtime.entrypoint
def main(ctx: runtime.Context) -> dict[str, Any]:
    cfg = CollectivesConfig.from_dict(ctx.config)
    sizes, kinds, repeats, warmup = cfg.sizes, cfg.collectives, cfg.repeats, cfg.warmup
    n, device = ctx.world_size, ctx.device
    with ctx.phase("check"):
        _check(n, ctx.rank, device)

    link = "gloo over TCP loopback (CPU)" if ctx.backend == "gloo" else f"{ctx.backend} (GPU)"
    rows = []
    total = len(kinds) * len(sizes)
    for kind in kinds:
        for size in sizes:
            numel = element_count(size, n)
            run = _one(kind, numel, n, device)
            times = []
            for i in range(warmup + repeats):
                _sync(device)
                t0 = time.perf_counter()
                with ctx.phase(kind):
                    run()
                _sync(device)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            # The slowest rank sets the pace: take the max over ranks of each rank's median.
            median_s = slowest(statistics.median(times))
            msg = numel * 4
            factor = formulas.bus_bandwidth_factor(kind, n)
            emulated = ctx.backend == "gloo" and kind in comm.GLOO_EMULATED
            rows.append(
                {
                    "collective": kind,
                    "size_bytes": msg,
                    "median_s": median_s,
                    "algbw_GBps": formulas.algbw(msg, median_s) / 1e9,
                    "busbw_GBps": formulas.busbw(msg, median_s, kind, n) / 1e9,
                    "busbw_factor": factor,
                    "emulated": emulated,
                    "link": link + (" (reduce_scatter emulated by all-reduce)" if emulated else ""),
                }
            )
            ctx.heartbeat(step=len(rows), total=total)
    ctx.print0(f"{len(rows)} measurements, {n} ranks, {link}")
    return {
        "rank": ctx.rank,
        "world_size": n,
        "backend": ctx.backend,
        "device": str(device),
        "link": link,
        "repeats": repeats,
        "method": "median of repeats per rank, max over ranks; NCCL-tests algbw/busbw",
        "rows": rows if ctx.rank == 0 else [],
    }


if __name__ == "__main__":
    main()
