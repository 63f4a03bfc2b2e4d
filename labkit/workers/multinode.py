"""A job of several machines in miniature: where each rank runs, one all-reduce, one DDP step.

    launch.run(MultinodeConfig(), nproc=1,
               nodes=launch.Nodes(2, endpoint="head-node:29400", rdzv_id="demo"))

The same module runs on one machine (``nproc`` ranks), on several under torchrun's c10d
rendezvous, and under SLURM (``labkit.jobs.slurm``). Every rank reports:

    node_rank, local_rank, host   where it ran (torchrun's GROUP_RANK and LOCAL_RANK)
    allreduce       the sum of every rank's ``rank + 1``: expected n(n+1)/2 on every rank
    allreduce_s     how long that one all-reduce of ``numel`` float32 values took, seconds
    params          the model's parameters after one DDP step, flattened (a few dozen numbers)
    checksum        their sum, to compare ranks at a glance

Every rank draws its own batch from a generator seeded with ``seed + rank``, so the step's
gradient is the mean over all ranks' batches. DDP's all-reduce averages the ranks' gradients,
so one SGD step here equals one step of a single process on all the batches at once:
``reference_params`` computes that, and a test holds every rank's ``params`` against it.

Config: :class:`MultinodeConfig`, every field optional.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from labkit import validate
from labkit.jobs import runtime
from labkit.jobs.spec import WorkerConfig

if TYPE_CHECKING:
    from labkit.jobs import launch

IN, HIDDEN = 8, 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class MultinodeConfig(WorkerConfig):
    """One all-reduce and one DDP step, on one machine or several."""

    WORKER: ClassVar[str] = "labkit.workers.multinode"
    seed: int = 0
    """Seeds the model and, with the rank added, each rank's batch."""
    batch: int = 8
    """Rows per rank in the DDP step."""
    numel: int = 2**16
    """Elements in the timed all-reduce."""
    lr: float = 0.1
    """The SGD step's learning rate."""
    hold_s: float = 0
    """After the step every rank but rank 0 waits this long before a last barrier, where rank 0
    already waits: a job with a node to pull the plug on (0: no wait, no barrier)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        validate.whole("seed", self.seed, low=0)
        validate.whole("batch", self.batch, low=1)
        validate.whole("numel", self.numel, low=1)
        validate.positive("lr", self.lr)
        validate.number("hold_s", self.hold_s, low=0)


def run(config: MultinodeConfig, *, nproc: int = 2, **launch_options: Any) -> launch.JobResult:
    """Launch ``config`` on ``nproc`` ranks (per node, with ``nodes=``); ``launch_options`` go to
    ``launch.run``."""
    from labkit.jobs import launch  # the caller's side: a rank never imports the launcher
    return launch.run(config, nproc=nproc, **launch_options)


def make_model(seed: int) -> nn.Module:
    """The same tiny MLP on every rank (DDP also broadcasts rank 0's weights at wrap time)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def make_batch(seed: int, rank: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch: (x [rows, IN], y [rows, 1]), from its own seeded generator."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(rows, IN, generator=g), torch.randn(rows, 1, generator=g)


def sgd_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float) -> None:
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


def reference_params(
    world_size: int, *, seed: int = 0, batch: int = 8, lr: float = 0.1
) -> torch.Tensor:
    """One process, one step on every rank's batch at once: what DDP's step must reproduce."""
    model = make_model(seed)
    xs, ys = zip(*(make_batch(seed, r, batch) for r in range(world_size)), strict=True)
    sgd_step(model, torch.cat(xs), torch.cat(ys), lr)
    return flat_params(model)


@runtime.entrypoint
def main(ctx: runtime.Context) -> dict:
    cfg = MultinodeConfig.from_dict(ctx.config)
    seed, batch, lr, numel = cfg.seed, cfg.batch, cfg.lr, cfg.numel
    host = socket.gethostname()
    ctx.print0(f"{ctx.world_size} ranks on {int(os.environ.get('GROUP_WORLD_SIZE', 1))} node(s)")
    print(f"rank {ctx.rank} is local rank {ctx.local_rank} of node {ctx.node_rank} ({host})",
          flush=True)  # fmt: skip

    x = torch.full((numel,), float(ctx.rank + 1), device=ctx.device)
    with ctx.phase("all_reduce"):
        tdist.barrier()
        start = time.perf_counter()
        tdist.all_reduce(x)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        allreduce_s = time.perf_counter() - start

    model = make_model(seed).to(ctx.device)
    ids = [ctx.local_rank] if ctx.device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids)
    xb, yb = (t.to(ctx.device) for t in make_batch(seed, ctx.rank, batch))
    with ctx.phase("ddp_step"):
        sgd_step(ddp, xb, yb, lr)  # backward all-reduces the gradients across every node
    params = flat_params(model)
    if hold := cfg.hold_s:
        if ctx.rank > 0:
            ctx.heartbeat(phase="hold")
            time.sleep(hold)
        with ctx.phase("last_barrier"):
            tdist.barrier()
    ctx.heartbeat(step=1, total=1)
    return {
        "node_rank": ctx.node_rank,
        "local_rank": ctx.local_rank,
        "host": host,
        "world_size": ctx.world_size,
        "allreduce": x[0].item(),
        "allreduce_expected": ctx.world_size * (ctx.world_size + 1) / 2,
        "allreduce_s": allreduce_s,
        "params": params.tolist(),
        "checksum": params.sum().item(),
    }


if __name__ == "__main__":
    main()
