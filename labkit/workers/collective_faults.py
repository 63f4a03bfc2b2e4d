"""Three classic collective bugs, planted one at a time on rank 1 of a 2-rank job.

    collective_faults.run(CollectiveFaultsConfig(fault="desync"), nproc=2, pg_timeout_s=3,
                          timeout_s=60, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})

Every rank runs ``steps`` training-like steps; each step issues two collectives, as a data-
parallel step with logging does:

    all_reduce(grads)         the gradient sync, ``numel`` float32 values
    all_gather(loss)          every rank's loss, one float32 each, for the log line

Config (:class:`CollectiveFaultsConfig`, in the torch-free
:mod:`labkit.workers.collective_faults_config`): ``fault`` plants one bug at step ``fault_step`` (default 2) on rank ``fault_rank``
(default 1); the other ranks run the healthy program:

    "none"    nothing: the healthy job, for comparison
    "desync"  the faulty rank skips that step's all_reduce (a data-dependent ``if`` around a
              collective, say): its next collective is the all_gather while the others are
              still in the all_reduce. The ranks' sequences of collectives no longer match
    "shape"   the faulty rank all-reduces a tensor of another shape (``numel`` + 1 values: a
              bucket that held one parameter more on that rank)
    "hang"    the faulty rank sleeps outside any collective (a stuck data loader, a deadlock
              in Python) while the others wait for it in the all_reduce

What catches each one is the lesson, not this module: gloo's own checks, the process-group
timeout (``pg_timeout_s``), ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (which wraps the process group
and compares every collective's op, shapes and dtypes across ranks before running it), the
flight recorder (with ``TORCH_FR_BUFFER_SIZE`` and ``TORCH_FR_DUMP_TEMP_FILE`` set, a gloo rank
whose collective fails dumps its buffer; NCCL's watchdog dumps on a timeout by itself), and the
launcher's heartbeats (each collective here runs in ``ctx.phase``).

Every rank writes its result (rank, pid, the fault, the collectives it *plans* to issue) before
it misbehaves, so a test can find its processes and a notebook can show the plan.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as tdist

from labkit.jobs import runtime
from labkit.workers.collective_faults_config import FAULTS as FAULTS
from labkit.workers.collective_faults_config import CollectiveFaultsConfig as CollectiveFaultsConfig
from labkit.workers.collective_faults_config import planned as planned

if TYPE_CHECKING:
    from labkit.jobs import launch

_FOREVER_S = 3600.0


def run(config: CollectiveFaultsConfig, *, nproc: int = 2, **launch_options: Any) -> launch.JobResult:
    """Launch ``config`` on ``nproc`` ranks (refused first if it cannot plant its bug there);
    ``launch_options`` go to ``launch.run``."""
    from labkit.jobs import launch  # the caller's side: a rank never imports the launcher
    config.check_ranks(nproc)
    return launch.run(config, nproc=nproc, **launch_options)


@runtime.entrypoint
def main(ctx: runtime.Context) -> dict[str, Any]:
    cfg = CollectiveFaultsConfig.from_dict(ctx.config)
    cfg.check_ranks(ctx.world_size)
    fault = cfg.fault
    device = runtime.collective_device()  # NCCL takes GPU tensors, gloo CPU ones
    result = {"rank": ctx.rank, "pid": os.getpid(), "fault": fault, "backend": ctx.backend,
              "debug": os.environ.get("TORCH_DISTRIBUTED_DEBUG", "OFF"),
              "plan": planned(cfg, ctx.rank)}  # fmt: skip
    ctx.write_result(result)  # before anything can go wrong
    try:
        return _steps(ctx, cfg, result, device)
    except Exception:
        _dump_flight_recorder(ctx)
        raise


def _dump_flight_recorder(ctx: runtime.Context) -> None:
    """On gloo, write this rank's flight-recorder buffer where NCCL's watchdog would write its
    own (``TORCH_FR_DUMP_TEMP_FILE`` + rank), when the recorder is on: torch dumps NCCL's on a
    timeout by itself (``TORCH_NCCL_DUMP_ON_TIMEOUT``), gloo's only when asked."""
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
    size = os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")
    if ctx.backend != "gloo" or not prefix or not size or size == "0":
        return
    from torch._C._distributed_c10d import _dump_fr_trace  # torch's own dump, a pickle

    with open(f"{prefix}{ctx.rank}", "wb") as f:
        f.write(_dump_fr_trace(includeCollectives=True, includeStackTraces=False, onlyActive=False))


def _steps(ctx: runtime.Context, cfg: CollectiveFaultsConfig, result: dict[str, Any],
           device: torch.device) -> dict[str, Any]:  # fmt: skip
    fault, steps, numel = cfg.fault, cfg.steps, cfg.numel
    losses = []
    for step in range(1, steps + 1):
        ctx.heartbeat(step=step, total=steps, phase="compute")
        faulty = ctx.rank == cfg.fault_rank and step == cfg.fault_step
        if step == cfg.fault_step and fault != "none":
            # When this rank reached the bug's step: the earliest rank's time is when the bug
            # could first be seen (a wait that times out begins after it), for the time to
            # detection.
            ctx.write_result({**result, "fault_at": time.time(), "steps_done": step - 1})
        grads = torch.full((numel,), float(ctx.rank + 1), device=device)
        if faulty and fault == "hang":
            time.sleep(_FOREVER_S)  # outside any collective: the others wait for us
        if faulty and fault == "shape":
            grads = torch.ones(numel + 1, device=device)
        if not (faulty and fault == "desync"):
            with ctx.phase("all_reduce grads"):
                tdist.all_reduce(grads)
                _wait(device)
        loss = torch.tensor([10.0 * step + ctx.rank], device=device)
        gathered = [torch.empty_like(loss) for _ in range(ctx.world_size)]
        with ctx.phase("all_gather loss"):
            tdist.all_gather(gathered, loss)
            _wait(device)
        losses.append([t.item() for t in gathered])
        result.update(steps_done=step, grad0=grads[0].item(), losses=losses)
    return result


def _wait(device: torch.device) -> None:
    """NCCL returns from a collective once its kernel is queued: wait for it inside the phase,
    so a rank stuck in a collective is seen (heartbeat) as waiting in it, not in the next step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
