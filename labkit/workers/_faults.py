"""Misbehaving workers for the launcher's tests (not course material).

    launch.run(FaultsConfig(mode="hang", ignore_sigterm=True), nproc=2, timeout_s=120)

``FaultsConfig.mode`` picks the behaviour:
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

import dataclasses
import os
import signal
import subprocess
import sys
import time
from typing import ClassVar

import torch
import torch.distributed as tdist

from labkit import validate
from labkit.jobs import runtime
from labkit.jobs.spec import WorkerConfig

_FOREVER_S = 3600.0
MODES = ("ok", "raise", "exit", "kill", "oom", "sysexit", "mismatch", "fill", "hang")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultsConfig(WorkerConfig):
    """How the ranks misbehave (the module docstring says what each mode does)."""

    WORKER: ClassVar[str] = "labkit.workers._faults"
    mode: str = "ok"
    """The behaviour, one of ``MODES``."""
    steps: int = 3
    """"ok": heartbeats each rank writes."""
    lines: int = 1
    """"ok": lines each rank prints."""
    fail_rank: int | None = None
    """The rank that fails (None: rank 1, or rank 0 for "fill")."""
    hang_rank: int = 1
    """"hang": the rank that sleeps outside the collective."""
    code: int | str | None = None
    """"exit": the exit status (None: 3); "sysexit": what ``sys.exit`` gets (None: 0)."""
    signal: str = "SIGKILL"
    """"kill": the signal's name."""
    delay_s: float = 0.5
    """"exit", "kill", "oom": how long the failing rank waits first, so the others are in
    their all_reduce."""
    cgroup: str | None = None
    """"oom": a memory cgroup folder the failing rank joins."""
    rlimit_as_mb: int | None = None
    """"oom": RLIMIT_AS this many MiB above the rank's address space (None: no limit)."""
    chunk_mb: int = 64
    """"oom": MiB allocated at a time."""
    ignore_sigterm: bool = False
    """Every rank ignores SIGTERM: only SIGKILL ends it."""
    spawn_child: bool = False
    """Rank 0 starts a sleeping child process."""

    def __post_init__(self) -> None:
        super().__post_init__()
        validate.one_of("mode", self.mode, MODES)
        validate.whole("steps", self.steps, low=0)
        validate.whole("lines", self.lines, low=0)
        if self.fail_rank is not None:
            validate.whole("fail_rank", self.fail_rank, low=0)
        validate.whole("hang_rank", self.hang_rank, low=0)
        validate.number("delay_s", self.delay_s, low=0)
        if self.rlimit_as_mb is not None:
            validate.whole("rlimit_as_mb", self.rlimit_as_mb, low=1)
        validate.whole("chunk_mb", self.chunk_mb, low=1)
        validate.flag("ignore_sigterm", self.ignore_sigterm)
        validate.flag("spawn_child", self.spawn_child)

    def failing_rank(self) -> int:
        """The rank that fails: ``fail_rank``, or the mode's own (0 for "fill", else 1)."""
        if self.fail_rank is not None:
            return self.fail_rank
        return 0 if self.mode == "fill" else 1


@runtime.entrypoint
def main(ctx: runtime.Context) -> None:
    cfg = FaultsConfig.from_dict(ctx.config)
    mode = cfg.mode
    result = {"rank": ctx.rank, "pid": os.getpid(), "world_size": ctx.world_size, "mode": mode}
    if cfg.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if cfg.spawn_child and ctx.rank == 0:
        child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({_FOREVER_S})"])
        result["child_pid"] = child.pid
    ctx.write_result(result)
    failing = ctx.rank == cfg.failing_rank()

    if mode == "ok":
        for i in range(cfg.steps):
            ctx.heartbeat(step=i + 1, total=cfg.steps)
        for i in range(cfg.lines):
            print(f"line {i} from rank {ctx.rank}", flush=True)
        x = torch.ones(1, device=runtime.collective_device())  # NCCL refuses CPU tensors
        with ctx.phase("all_reduce"):
            tdist.all_reduce(x)
        ctx.write_result({**result, "sum": x.item()})
        return
    if mode == "raise" and failing:
        raise ValueError(f"injected failure on rank {ctx.rank}")
    if mode in ("exit", "kill", "oom") and failing:
        _die(cfg)
    if mode == "sysexit" and failing:
        time.sleep(0.5)
        sys.exit(0 if cfg.code is None else cfg.code)
    if mode == "mismatch":
        with ctx.phase("all_reduce"):
            tdist.all_reduce(torch.ones(1 + 2047 * ctx.rank, device=runtime.collective_device()))
        return
    if mode == "fill" and failing:
        with open(ctx.job_dir / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
    if mode == "hang":
        ctx.heartbeat(step=1, total=3, phase="compute")
        if ctx.rank == cfg.hang_rank:
            time.sleep(_FOREVER_S)  # hung outside any collective
        ctx.heartbeat(step=2)
    with ctx.phase("all_reduce"):
        # the others (the victims) wait here for the failed or hung rank until killed
        tdist.all_reduce(torch.ones(1, device=runtime.collective_device()))


def _die(cfg: FaultsConfig) -> None:
    """End this rank without a Python exception, the way ``cfg.mode`` says."""
    time.sleep(cfg.delay_s)  # let the others enter their all_reduce
    if cfg.mode == "exit":
        os._exit(3 if cfg.code is None else int(cfg.code))
    if cfg.mode == "kill":
        os.kill(os.getpid(), getattr(signal, cfg.signal))
    if cfg.cgroup:  # the kernel's OOM killer ends us when the cgroup's limit is reached
        with open(os.path.join(cfg.cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    if cfg.rlimit_as_mb:  # allocations past the limit fail: torch raises, no kill
        import resource

        with open("/proc/self/status") as f:
            vm_kib = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
        limit = (vm_kib << 10) + (cfg.rlimit_as_mb << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    hoard = []
    while True:  # touch every page, so the memory is really used
        hoard.append(torch.ones(cfg.chunk_mb << 18))


if __name__ == "__main__":
    main()
