"""Worker side of a labkit job: process-group setup, heartbeats and results.

A worker is an importable module that torchrun runs on every rank:

    from labkit.jobs import runtime

    @runtime.entrypoint
    def main(ctx: runtime.Context) -> None:
        x = torch.ones(4, device=ctx.device) * (ctx.rank + 1)
        with ctx.phase("all_reduce"):            # "waiting in a collective", for hang reports
            torch.distributed.all_reduce(x)
        ctx.write_result({"value": x[0].item()})

    if __name__ == "__main__":
        main()

``labkit.jobs.launch.run(MyConfig(...), nproc=2)`` starts it (a ``labkit.jobs.spec.WorkerConfig``
that names the module; a module of your own without one: ``run("my.module")``, its settings
through ``env=``). Collectives, barriers and the rest are plain ``torch.distributed``: this
module only does what every worker needs around them.

The launcher and the workers talk through files in the job directory (path in the
``LABKIT_JOB_DIR`` environment variable); ``labkit.jobs.spec`` holds that layout and its JSON
helpers, which need no torch (the launcher's side and ``slurm`` use them too); they are
re-exported here, where a worker looks for them.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import functools
import json
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from labkit.jobs.spawn import AGENT_PID_ENV, set_parent_death_signal

# The job folder's layout, in labkit.jobs.spec (no torch there); part of this module's API.
from labkit.jobs.spec import JOB_DIR_ENV as JOB_DIR_ENV
from labkit.jobs.spec import SPEC_FILE as SPEC_FILE
from labkit.jobs.spec import STACK_SIGNAL as STACK_SIGNAL
from labkit.jobs.spec import heartbeat_path as heartbeat_path
from labkit.jobs.spec import read_heartbeats as read_heartbeats
from labkit.jobs.spec import read_json as read_json
from labkit.jobs.spec import result_path as result_path
from labkit.jobs.spec import stack_path as stack_path
from labkit.jobs.spec import write_json_atomic as write_json_atomic

# torch's defaults are 10 min (NCCL) and 30 min (gloo) (torch.distributed.constants): a hung
# collective would stall a notebook cell that long. One minute is ample for lab-sized jobs.
DEFAULT_PG_TIMEOUT_S = 60.0


# --- the context a worker function receives -------------------------------------------------


@dataclass
class Context:
    """What a worker needs to know about its place in the job.

    Attributes:
        rank: global rank, 0..world_size-1.
        local_rank: rank on this machine; on one machine equal to ``rank``.
        world_size: number of processes in the job.
        backend: "nccl" (one GPU per rank) or "gloo".
        device: ``cuda:<local_rank>`` for nccl and for a gloo job launched with
            ``device="cuda"``, else ``cpu``. Tensors made only for a collective (a timestamp,
            a median) belong on ``collective_device()`` instead.
        config: the job's config as a dict (``WorkerConfig.to_dict``): a worker reads its
            dataclass back with ``XConfig.from_dict(ctx.config)``.
        job_dir: the job directory, or None when run without the launcher.
        node_rank: the machine's place in a job of several (torchrun's ``GROUP_RANK``: 0 on
            one machine). torchrun numbers ranks node by node, so rank = node_rank *
            ranks per node + local_rank.
    """

    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: torch.device
    config: dict[str, Any] = field(default_factory=dict)
    job_dir: Path | None = None
    node_rank: int = 0
    _beat: dict[str, Any] = field(default_factory=dict, repr=False)

    def print0(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only (the launcher prefixes each line with its rank anyway)."""
        if self.rank == 0:
            print(*args, flush=True, **kwargs)

    def heartbeat(
        self,
        step: int | None = None,
        total: int | None = None,
        phase: str | None = None,
        part: str | None = None,
    ) -> None:
        """Tell the launcher this rank is alive and how far it got.

        Call it once per training step (``ctx.heartbeat(step=i, total=steps)``): the launcher
        shows progress from it and, when a job hangs, names the rank that fell behind. Count
        ``step`` and ``total`` over the whole job, so that "step 12/12" means the job is done.
        A job that does several things one after another names the one running in ``part``
        (e.g. "ddp (3/8)"): the live monitor shows it in its title and marks where each part
        began (the heartbeat keeps every part's name and start time in ``parts``). Arguments left as None keep their previous value. Costs one small file write
        (~0.1 ms).
        """
        if step is not None:
            self._beat["step"] = int(step)
        if total is not None:
            self._beat["total"] = int(total)
        if phase is not None:
            self._beat["phase"] = phase
            self._beat["in_collective"] = False
        if part is not None and part != self._beat.get("part"):
            self._beat["part"] = part
            # Every part begun, with its start: a reader that polls the file now and then
            # (the launcher, every ~0.25 s) still sees a part shorter than that.
            self._beat.setdefault("parts", []).append([part, time.time()])
        self._write_heartbeat()

    @contextlib.contextmanager
    def phase(self, name: str, collective: bool = True) -> Iterator[None]:
        """Mark a region, by default as "waiting in a collective".

        A rank blocked in ``all_reduce`` is usually a *victim*: it waits for a rank that never
        arrives. Marking collectives lets the launcher tell the two apart (torchrun's own
        "Root Cause" names the victim, whose collective timed out first).
        """
        before = (self._beat.get("phase"), self._beat.get("in_collective", False))
        self._beat["phase"], self._beat["in_collective"] = name, collective
        self._write_heartbeat()
        # No try/finally: if the collective raises, the last heartbeat must still say where.
        yield
        self._beat["phase"], self._beat["in_collective"] = before
        self._write_heartbeat()

    def write_result(self, result: dict[str, Any]) -> None:
        """Save this rank's result; the launcher returns it in ``JobResult.ranks[rank]``.

        ``result`` must be JSON-serialisable (numbers, strings, lists, dicts): convert tensors
        with ``.item()`` or ``.tolist()`` first. Calling it again replaces the earlier result.
        """
        try:
            json.dumps(result)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"write_result needs a JSON-serialisable dict ({e}); convert tensors with "
                ".item() or .tolist()"
            ) from None
        if self.job_dir is None:  # run without the launcher: the log is the only place
            print(f"[labkit result rank {self.rank}] {json.dumps(result)}", flush=True)
            return
        write_json_atomic(result_path(self.job_dir, self.rank), result)

    def _write_heartbeat(self) -> None:
        if self.job_dir is None:
            return
        beat = self._beat
        beat["seq"] = beat.get("seq", 0) + 1  # the launcher watches this to see progress
        beat["time"] = time.time()
        write_json_atomic(heartbeat_path(self.job_dir, self.rank), beat)


def collective_device(group: Any = None) -> torch.device:
    """The device a tensor must live on for a collective on ``group`` (default: the world).

    A process group made by ``init_process_group("nccl")`` has a CUDA backend only: a CPU
    tensor fails with "No backend type associated with device type cpu". So NCCL gets this
    rank's current GPU (``entrypoint`` made it ``cuda:<local_rank>``) and gloo the CPU, which
    gloo serves for every collective, also in a job whose ``ctx.device`` is a GPU.
    """
    if tdist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def require_gpu_backend(backend: str, device_type: str, needs: str) -> None:
    """Refuse a gloo job on GPUs for a worker whose collectives gloo cannot do on GPU tensors.

    gloo moves CUDA tensors for all_reduce and broadcast only (torch's backend table); a job
    that ``needs`` anything else would fail mid-run with a message that names neither.
    """
    if backend == "gloo" and device_type == "cuda":
        raise ValueError(f"backend='gloo' with device='cuda': {needs}, which gloo does not do on "
                         "GPU tensors: launch with backend='nccl' (a GPU per rank) or "
                         "device='cpu'")  # fmt: skip


# --- setup and teardown ----------------------------------------------------------------------


def entrypoint(fn: Callable[[Context], dict[str, Any] | None]) -> Callable[[], None]:
    """Turn ``fn(ctx)`` into a worker ``main()`` that sets up and tears down the process group.

    Setup: parent-death signal, ``init_process_group`` with a short timeout, the GPU for nccl.
    If ``fn`` returns a dict it is saved as this rank's result (same as ``ctx.write_result``).
    Errors propagate through torch's ``@record``, which writes an error file the launcher
    reads to report the failing rank's exception and traceback.
    """

    @functools.wraps(fn)
    def main() -> None:
        _run(fn)

    # torch's @record: without it torchrun reports "error_file: <N/A>" and no traceback
    return record(main, error_handler=_AtomicErrorFile())


class _AtomicErrorFile(ErrorHandler):
    """torch's error handler, writing the error file whole or not at all.

    torch's own writes the file in place (``open(file, "w")`` then ``json.dump``), while
    torchrun's agent polls for it: an agent that reads it half-written fails to parse it and
    dies (a ``JSONDecodeError`` in ``ProcessFailure``), with no report and no restart. Seen
    when a peer's death made this rank raise while the agent was already collecting the
    failure. Written under a temporary name and renamed (atomic on POSIX), the agent sees the
    file complete or not at all. The content is torch's (``ErrorHandler.record_exception``).
    """

    def record_exception(self, e: BaseException) -> None:
        file = self._get_error_file_path()
        if not file:
            super().record_exception(e)
            return
        data = {
            "message": {
                "message": f"{type(e).__name__}: {e}",
                "extraInfo": {
                    "py_callstack": traceback.format_exc(),
                    "timestamp": str(int(time.time())),
                },
            }
        }
        tmp = f"{file}.{os.getpid()}.tmp"
        with open(tmp, "w") as fp:
            json.dump(data, fp)
        os.replace(tmp, file)


def _run(fn: Callable[[Context], dict[str, Any] | None]) -> None:
    _arm_parent_death_signal()
    _fill_single_process_env()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    job_dir = Path(os.environ[JOB_DIR_ENV]) if os.environ.get(JOB_DIR_ENV) else None
    spec = (read_json(job_dir / SPEC_FILE) or {}) if job_dir else {}
    backend = spec.get("backend") or _default_backend(world_size)
    # The spec's device counts too: launch.resolve_backend gives ("gloo", "cuda") for
    # backend="gloo" on GPUs, and that job must compute on its GPU, as JobResult.device says.
    # gloo takes CUDA tensors for all_reduce and broadcast (torch's backend table lists no
    # more); send/recv, for one, need CPU tensors, so such a job cannot run a pipeline.
    on_gpu = backend == "nccl" or spec.get("device") == "cuda"
    device = torch.device(f"cuda:{local_rank}" if on_gpu else "cpu")

    node_rank = int(os.environ.get("GROUP_RANK", "0"))
    ctx = Context(rank, local_rank, world_size, backend, device, spec.get("config", {}), job_dir,
                  node_rank)  # fmt: skip
    ctx._beat.update(
        rank=rank,
        node=node_rank,
        world=world_size,
        # torchrun's count of restarts so far: a rank restarted after a failure says so
        restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        pid=os.getpid(),
        host=socket.gethostname(),
        step=None,
        total=None,
        phase="setup",
        in_collective=False,
    )
    if job_dir is not None:  # before the first beat: a rank that has beaten can be asked
        _arm_stack_dump(stack_path(job_dir, rank))
    ctx._write_heartbeat()  # first beat: the launcher records our PID from it

    if device.type == "cuda":  # also the GPU NCCL and collective_device() use
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=float(spec.get("pg_timeout_s", DEFAULT_PG_TIMEOUT_S)))
    # device_id binds the NCCL communicator to our GPU at once (no "guessing device" warning);
    # gloo has no communicator to bind.
    extra = {"device_id": device} if backend == "nccl" else {}
    tdist.init_process_group(backend, timeout=timeout, **extra)
    ctx.heartbeat(phase="run")
    try:
        result = fn(ctx)
        if result is not None:
            ctx.write_result(result)
    except BaseException as exc:
        ctx._beat["failed"] = True  # keep phase/in_collective: where it failed matters
        if isinstance(exc, SystemExit):  # torch's @record does not report it: we do
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            where = f"{os.path.basename(frame.filename)}, line {frame.lineno}: {(frame.line or '').strip()}"
            ctx._beat["exit"] = {"code": repr(exc.code), "where": where}
        ctx._write_heartbeat()
        raise
    ctx.heartbeat(phase="done")
    tdist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # gloo sometimes aborts a rank ("terminate called without an active exception") while
    # the interpreter shuts down after destroy_process_group, and torchrun then reports a
    # finished job as failed. Our results are on disk: skip interpreter teardown.
    os._exit(0)


def _arm_parent_death_signal() -> None:
    """Die with the torchrun agent: SIGKILL to the agent leaves its workers running otherwise."""
    set_parent_death_signal(signal.SIGKILL)
    agent = os.environ.get(AGENT_PID_ENV)
    # Importing torch took seconds; if the agent died meanwhile no signal will come.
    if agent and os.getppid() != int(agent):
        print(f"labkit.jobs.runtime: torchrun agent {agent} is gone; exiting", file=sys.stderr)
        os._exit(1)


_STACK_FILE: Any = None  # kept open for faulthandler, which writes to its descriptor


def _arm_stack_dump(path: Path) -> None:
    """On ``STACK_SIGNAL``, write every thread's Python stack to ``path``. faulthandler does it
    from C, so it works while the rank is stuck in a C call (a collective, a sleep) or in a
    Python loop that never yields."""
    global _STACK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    _STACK_FILE = open(path, "w")  # noqa: SIM115 (open for the life of the process)
    faulthandler.register(STACK_SIGNAL, file=_STACK_FILE, all_threads=True)


def _fill_single_process_env() -> None:
    """Let ``python -m some.worker`` run as a 1-process job without torchrun (for debugging)."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:  # ask the OS for a free port: never hard-code one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _default_backend(world_size: int) -> str:
    """Without a job spec: NCCL when every local rank can have its own GPU, else gloo."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local else "gloo"
