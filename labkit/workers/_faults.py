"""Misbehaving workers for the launcher's tests (not course material).

Config ``mode`` picks the behaviour:
    "ok"     every rank heartbeats ``steps`` steps, prints ``lines`` lines, writes a result
    "raise"  rank ``fail_rank`` raises ValueError; the others wait in an all_reduce
    "exit"   rank ``fail_rank`` ends with ``os._exit(code)`` (no Python exception); the others wait
             in an all_reduce
    "kill"   rank ``fail_rank`` sends itself ``signal`` (default SIGKILL); the others wait
    "oom"    rank ``fail_rank`` allocates ``chunk_mb`` MiB at a time until its memory limit stops
             it: a cgroup's (``cgroup``: a memory cgroup folder it joins; the kernel's OOM
             killer then SIGKILLs it) or RLIMIT_AS (``rlimit_as_mb`` MiB above the address
             space it already has; an allocation then fails and torch raises)
    "sysexit"  rank ``fail_rank`` calls ``sys.exit(code)`` mid-work (``code`` 0, an int or a
             message); the others wait in an all_reduce
    "mismatch" every rank all-reduces a tensor of a different size: gloo's own check fails
             and aborts the process (SIGABRT), as a learner's mismatched collectives do
    "fill"   rank ``fail_rank`` writes zeros into the job directory until the disk is full
    "hang"   rank ``hang_rank`` sleeps forever outside any collective after step 1; the others
             reach step 2 and wait in an all_reduce for it (a hung rank and its victims)
Options for "hang": ``ignore_sigterm`` (every rank ignores SIGTERM, so only SIGKILL ends it),
``spawn_child`` (rank 0 starts a sleeping child process, to check the whole tree is ended).
Every rank writes its result (rank, pid, child_pid) *before* misbehaving, so a test can find
the processes it must check.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as tdist

from labkit.jobs import runtime

_FOREVER_S = 3600.0


@runtime.entrypoint
def main(ctx: runtime.Context) -> None:
    cfg = ctx.config
    mode = cfg.get("mode", "ok")
    result = {"rank": ctx.rank, "pid": os.getpid(), "world_size": ctx.world_size, "mode": mode}
    if cfg.get("ignore_sigterm"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if cfg.get("spawn_child") and ctx.rank == 0:
        child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({_FOREVER_S})"])
        result["child_pid"] = child.pid
    ctx.write_result(result)

    if mode == "ok":
        steps = int(cfg.get("steps", 3))
        for i in range(steps):
            ctx.heartbeat(step=i + 1, total=steps)
        for i in range(int(cfg.get("lines", 1))):
            print(f"line {i} from rank {ctx.rank}", flush=True)
        x = torch.ones(1, device=runtime.collective_device())  # NCCL refuses CPU tensors
        with ctx.phase("all_reduce"):
            tdist.all_reduce(x)
        ctx.write_result({**result, "sum": x.item()})
    elif mode == "raise":
        if ctx.rank == int(cfg.get("fail_rank", 1)):
            raise ValueError(f"injected failure on rank {ctx.rank}")
        with ctx.phase("all_reduce"):
            # waits for the failed rank until killed
            tdist.all_reduce(torch.ones(1, device=runtime.collective_device()))
    elif mode in ("exit", "kill", "oom"):
        if ctx.rank == int(cfg.get("fail_rank", 1)):
            _die(mode, cfg)
        with ctx.phase("all_reduce"):
            tdist.all_reduce(torch.ones(1, device=runtime.collective_device()))
    elif mode == "sysexit":
        if ctx.rank == int(cfg.get("fail_rank", 1)):
            time.sleep(0.5)
            sys.exit(cfg.get("code", 0))
        with ctx.phase("all_reduce"):
            tdist.all_reduce(torch.ones(1, device=runtime.collective_device()))
    elif mode == "mismatch":
        with ctx.phase("all_reduce"):
            tdist.all_reduce(torch.ones(1 + 2047 * ctx.rank, device=runtime.collective_device()))
    elif mode == "fill":
        if ctx.rank == int(cfg.get("fail_rank", 0)):
            with open(ctx.job_dir / "filler", "wb") as f:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        with ctx.phase("all_reduce"):
            tdist.all_reduce(torch.ones(1, device=runtime.collective_device()))
    elif mode == "hang":
        ctx.heartbeat(step=1, total=3, phase="compute")
        if ctx.rank == int(cfg.get("hang_rank", 1)):
            time.sleep(_FOREVER_S)  # hung outside any collective
        ctx.heartbeat(step=2)
        with ctx.phase("all_reduce"):
            # the victim: waits for the hung rank
            tdist.all_reduce(torch.ones(1, device=runtime.collective_device()))
    else:
        raise ValueError(f"unknown mode {mode!r}: use 'ok', 'raise', 'exit', 'kill', 'oom', 'sysexit', 'mismatch', 'fill' or 'hang'")


def _die(mode: str, cfg: dict) -> None:
    """End this rank without a Python exception, the way ``mode`` says."""
    time.sleep(float(cfg.get("delay_s", 0.5)))  # let the others enter their all_reduce
    if mode == "exit":
        os._exit(int(cfg.get("code", 3)))
    if mode == "kill":
        os.kill(os.getpid(), getattr(signal, cfg.get("signal", "SIGKILL")))
    if cfg.get("cgroup"):  # the kernel's OOM killer ends us when the cgroup's limit is reached
        with open(os.path.join(cfg["cgroup"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    if cfg.get("rlimit_as_mb"):  # allocations past the limit fail: torch raises, no kill
        import resource

        with open("/proc/self/status") as f:
            vm_kib = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
        limit = (vm_kib << 10) + (int(cfg["rlimit_as_mb"]) << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    hoard = []
    while True:  # touch every page, so the memory is really used
        hoard.append(torch.ones(int(cfg.get("chunk_mb", 64)) << 18))


if __name__ == "__main__":
    main()
