"""The supervisor of a running job: torchrun started, watched, and ended with all it started.

One :class:`Supervisor` per job, driven from the calling thread (a notebook cell blocks in
``launch.run`` while it works): it starts torchrun's agent under labkit's own supervisor
process (``labkit.jobs.spawn --supervise``), pumps the agent's output under the cell (rank
lines through :class:`Echo`, bounded; tracebacks shown as an excerpt), reads the ranks'
heartbeats every ``TICK_S``, ends the job for time, and at the end ends every process the job
started, with Ctrl-C held off meanwhile (``interrupts_deferred``). What it saw (status, exit
code, the agent's output) is what ``launch.run`` words as the result or the error. Kept apart
from the checks before a job (``labkit.jobs.preflight``) and from the wording of its end
(``labkit.jobs.outcome``): this is the only part that owns processes.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from labkit.jobs import diagnosis, procs, spec
from labkit.jobs.nodes import is_torchrun_agent
from labkit.jobs.observers import Job, notify
from labkit.jobs.outcome import JobResult
from labkit.jobs.preflight import DISK_FULL, disk_error, no_port_message

TICK_S = 0.25  # supervision period: heartbeats, timeouts, observers' on_tick
TREE_SCAN_S = 1.0  # how often to record the agent's descendants (a /proc walk)
# Passed to torchrun as TORCH_ELASTIC_SHUTDOWN_TIMEOUT: how long the agent itself waits for
# workers after SIGTERM before SIGKILL (default 30 s). Matters when our process is gone and the
# agent got its parent-death SIGTERM.
AGENT_SHUTDOWN_S = 3
# How long labkit's supervisor around torchrun (labkit.jobs.spawn --supervise) lets the agent shut
# down in order once our process is gone, before it SIGKILLs everything under it: the agent's
# own grace for the ranks, plus time for the agent to exit.
SUPERVISOR_GRACE_S = AGENT_SHUTDOWN_S + 2
_RANK_LINE = re.compile(r"^\[rank(\d+)\] ?")
# torchrun's agent (c10d's socket.cpp) when it cannot get a local port for its rendezvous.
_NO_PORT = re.compile(
    r"errno: (?:98|99) - (Address already in use|Cannot assign requested address)"
)

SUPERVISED: set[str] = set()  # ids of the jobs this process is supervising right now


@contextlib.contextmanager
def interrupts_deferred(job_id: str) -> Iterator[None]:
    """Hold off Ctrl-C (Jupyter's ■) while a job's processes are being ended.

    A learner who presses ■ twice would otherwise cut the cleanup short, and the job would
    run on in the background. An interrupt that arrives meanwhile is announced, and raised as
    ``KeyboardInterrupt`` once the job is gone (unless one is already on its way). Signal
    handlers belong to the main thread: elsewhere (a job launched from a thread) nothing is
    deferred, and the next ``run`` ends what was left (``procs.cleanup(supervised=...)``).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        if not caught:
            print(f"labkit: still ending the processes of job {job_id}; one moment")
        caught.append(signum)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught and sys.exc_info()[0] is None:
        raise KeyboardInterrupt


class Echo:
    """Print rank lines as they come, at most ``limit`` of them live; at the end, the last
    lines of those held back. Uses ``print``: under nbval and papermill only what the kernel
    itself prints is kept (raw writes to its file descriptors are lost)."""

    def __init__(
        self,
        limit: int | None,
        job_dir: Path,
        quiet: bool = False,
        write: Callable[[str], None] = print,
    ) -> None:
        self.limit, self.job_dir, self.quiet, self.write = limit, job_dir, quiet, write
        self.shown = 0
        self.held = 0
        self.tail: deque[str] = deque(maxlen=max(limit or 0, 1))

    def line(self, text: str) -> None:
        if self.quiet:
            return
        if self.limit is None or self.shown < self.limit:
            self.write(text)
            self.shown += 1
            return
        if self.held == 0:
            self.write(f"… more output in {self.job_dir}")
        self.held += 1
        self.tail.append(text)

    def finish(self) -> None:
        if self.quiet or self.held == 0:
            return
        skipped = self.held - len(self.tail)
        if skipped:
            self.write(
                f"… {skipped} lines skipped (all in {self.job_dir}); the last {len(self.tail)}:"
            )
        for text in self.tail:
            self.write(text)


def supervised(command: list[str]) -> list[str]:
    """``command`` under labkit's supervisor (labkit/jobs/spawn.py): it gets SIGTERM when this
    process dies (a Jupyter kernel restart included), and nothing it started, down to a rank's
    child that ignores SIGTERM, outlives it by more than ``SUPERVISOR_GRACE_S`` and a second."""
    return [sys.executable, "-m", "labkit.jobs.spawn", "SIGTERM", str(os.getpid()),
            f"--supervise={SUPERVISOR_GRACE_S}", "--", *command]  # fmt: skip


class Supervisor:
    """Starts torchrun, pumps its output, watches heartbeats and ends the process tree."""

    def __init__(
        self,
        job: Job,
        roots: list[str],
        extra_env: dict[str, str],
        *,
        observers: list[Any],
        echo: Echo,
    ) -> None:
        self.job, self.roots, self.extra_env = job, roots, extra_env
        self.observers, self.echo = observers, echo
        self.proc: subprocess.Popen | None = None
        self.agent: psutil.Process | None = None
        self.workers: dict[int, psutil.Process] = {}  # pid -> process (create time checked)
        # torchrun's agent itself, under labkit's supervisor (self.agent); not a worker
        self.torchrun: dict[int, psutil.Process] = {}
        self.status = "running"
        self.timeout_reason = ""
        self.returncode: int | None = None
        self.ended_at: float | None = None
        self._seqs: dict[int, Any] = {}
        self._last_progress = time.monotonic()
        self._last_scan = 0.0
        self._milestone = 0
        self._log = None
        self._exit_seen: float | None = None
        self._tracebacks: dict[int, list[str]] = {}  # rank -> lines of a traceback being printed
        self.agent_problem: str | None = None  # a failure of torchrun's agent, worded
        # torchrun's output, also kept here: the diagnosis needs it even when agent.log could
        # not be written (a full disk). Its failure summary comes last.
        self.agent_lines: deque[str] = deque(maxlen=20_000)

    def supervise(self, timeout_s: float, heartbeat_timeout_s: float | None) -> JobResult:
        """Run the job from start to end; whatever happens, end every process it started.

        Returns what it left behind, with ``status`` saying how it ended ("ok", "failed",
        "timeout"); an interrupt is re-raised, once the job is gone. Observers get ``on_end``
        in every case.
        """
        job = self.job
        SUPERVISED.add(job.job_id)
        try:
            self.start()
            self.wait(timeout_s, heartbeat_timeout_s)
        except KeyboardInterrupt:
            self.status = "interrupted"
            raise
        except OSError as e:
            self.status = "failed"
            if e.errno in DISK_FULL:  # the disk filled up under the job's own files
                raise disk_error(job.job_dir, e) from e
            raise
        finally:
            with interrupts_deferred(job.job_id):
                ended = self.stop()
                SUPERVISED.discard(job.job_id)
                if self.status == "interrupted":
                    print(f"labkit: interrupted; ended {len(ended)} process(es) of job {job.job_id}")
                result = self.result()
                notify(self.observers, "on_end", job, result)
        return result

    # -- start ---------------------------------------------------------------------------

    def _command(self) -> list[str]:
        job = self.job
        # Alone: c10d rendezvous on port 0, so the OS picks a free port and jobs never collide.
        # torch 2.13's torchrun does the same for a one-node job given no port
        # (torch/distributed/run.py, pytorch PR #175699); passing it explicitly keeps it so on
        # older torch, whose default was a static rendezvous on port 29500 (pytorch #73320).
        # An explicit --master-port still selects that static, colliding one. Several nodes
        # must all know the port: the caller's Nodes carries it.
        where = job.nodes.torchrun_args() if job.nodes else [
            "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", f"--rdzv-id={job.job_id}",
            "--nnodes=1",
        ]  # fmt: skip
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *where,
            f"--nproc-per-node={job.nproc}",
            # Default 0: restarting a rank that broke for a reason that is still there repeats
            # the failure. labkit.jobs.checkpoint's workers resume where they stopped, which makes
            # a restart worth it (the store each attempt needs: _env).
            f"--max-restarts={job.max_restarts}",
            "--monitor-interval=0.1",
            f"--log-dir={job.job_dir / 'torchrun'}",
            "--tee=3",  # each rank's stdout+stderr to its own file *and* to us, whole lines
            "-m",
            job.module,
        ]
        return supervised(torchrun)

    def _env(self) -> dict[str, str]:
        job = self.job
        env = dict(os.environ)
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)  # a launcher inside a worker must not leak its own rank
        if job.device == "cpu":
            # CPU ranks never touch a GPU, even where one is visible (two ranks on a one-GPU
            # machine). Some torch code checks torch.cuda.is_available() and not the tensor's
            # device: torch 2.11's PowerSGD hook then calls torch.cuda.synchronize on a CPU
            # tensor's device and fails ("Expected a cuda device, but got: cpu", seen on an H200).
            env["CUDA_VISIBLE_DEVICES"] = ""
        env.update(self.extra_env)
        env.update(
            {
                spec.JOB_DIR_ENV: str(job.job_dir),
                "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": spec.RANK_PREFIX,
                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(AGENT_SHUTDOWN_S),
                "PYTHONUNBUFFERED": "1",  # the agent's lines reach us as they happen
                # torchrun leaves a folder in the temp dir per launch: keep it in the job dir.
                "TMPDIR": str(job.job_dir / "tmp"),
            }
        )
        if job.max_restarts:
            # Each attempt's ranks get a rendezvous store of their own. torch 2.13's torchrun
            # otherwise hands every attempt the agent's store without an attempt prefix, and a
            # restarted rank can read a dead peer's address from the attempt before, then fail
            # with "Gloo connectFullMesh failed ... Connection refused" (NCCL alike; pytorch
            # #135712): 3 of 6 restarts here without it, 8 of 8 with it.
            env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        # ...but torch.compile's cache would then be lost with each job: give it a home.
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(procs.labkit_home() / "inductor"))
        alone = job.nodes is None or job.nodes.on_loopback
        if job.backend == "gloo" and alone and "lo" in {name for _, name in _interfaces()}:
            # gloo binds to the address the hostname resolves to; one machine needs loopback.
            # Real nodes must not: the others could not reach us (set GLOO_SOCKET_IFNAME or
            # NCCL_SOCKET_IFNAME to the interface between the nodes, e.g. through env=).
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env["PYTHONPATH"] = os.pathsep.join([*self.roots, *filter(None, [env.get("PYTHONPATH")])])
        return env

    def start(self) -> None:
        self._log = open(self.job.job_dir / "agent.log", "w")  # noqa: SIM115 (closed in stop)
        # Popen from this (the calling) thread: the parent-death signal is tied to the thread
        # that forked, and this one lives until the job is over.
        self.proc = subprocess.Popen(
            self._command(),
            env=self._env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            # Own session: Jupyter's interrupt (SIGINT to the kernel's process group) reaches
            # only the kernel, whose KeyboardInterrupt handler ends the job in order.
            start_new_session=True,
        )
        self.job.started = time.monotonic()
        self.job.agent_pid = self.proc.pid
        with contextlib.suppress(psutil.NoSuchProcess):
            self.agent = psutil.Process(self.proc.pid)
        self._save_record()
        notify(self.observers, "on_start", self.job)

    # -- supervise -----------------------------------------------------------------------

    def wait(self, timeout_s: float, heartbeat_timeout_s: float | None) -> None:
        """Pump output until torchrun exits or time runs out; sets ``status``."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        pending, eof, next_tick = b"", False, 0.0
        while True:
            if not eof:
                ready, _, _ = select.select([fd], [], [], TICK_S)
                if ready:
                    chunk = os.read(fd, 1 << 16)
                    eof = not chunk
                    *lines, pending = (pending + chunk).split(b"\n")
                    for raw in lines:
                        self._on_line(raw.decode(errors="replace"))
            else:
                time.sleep(TICK_S)
            if self.proc.poll() is not None and (eof or self._drained()):
                if pending:
                    self._on_line(pending.decode(errors="replace"))
                self.returncode = self.proc.returncode
                self.status = "ok" if self.returncode == 0 else "failed"
                return
            if self.agent_problem:
                self.status = "failed"
                return
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + TICK_S
                if self._tick(now, timeout_s, heartbeat_timeout_s):
                    self.status = "timeout"
                    self._ask_where()
                    return

    def _ask_where(self, wait_s: float = 1.0) -> None:
        """Ask each rank that has started where it is (``spec.STACK_SIGNAL``), before the job
        is ended for time; wait up to ``wait_s`` for the answers."""
        asked = []
        for rank, beat in self.job.heartbeats.items():
            proc = self.workers.get(beat.get("pid"))  # a PID this job started, still the same
            if proc is not None and procs.alive(proc):
                with contextlib.suppress(psutil.Error):
                    proc.send_signal(spec.STACK_SIGNAL)
                    asked.append(spec.stack_path(self.job.job_dir, rank))
        deadline = time.monotonic() + wait_s
        while asked and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                asked = [p for p in asked if p.stat().st_size == 0]
            time.sleep(0.05)
        time.sleep(0.05)  # a dump is written in one go, but give its last lines a moment

    def _drained(self) -> bool:
        # torchrun exited but something still holds the pipe: give it a second, not forever.
        if self._exit_seen is None:
            self._exit_seen = time.monotonic()
        return time.monotonic() - self._exit_seen > 1.0

    def _on_line(self, text: str) -> None:
        assert self._log is not None
        self.agent_lines.append(text)
        self._log.write(text + "\n")
        # Only rank lines go under the cell; the agent's own chatter (banners, its failure
        # traceback) stays in agent.log: JobFailed reports the root cause more clearly.
        if self.agent_problem is None and (found := _NO_PORT.search(text)):
            # The agent's rendezvous or a rank's gloo found no free port: torch would retry
            # for a minute (and, with ports nearly gone, end in a timeout that names no cause).
            self.agent_problem = no_port_message(found.group(1))
        m = _RANK_LINE.match(text)
        if not m:
            return
        rank, rest = int(m.group(1)), text[m.end() :]
        self.job.saw_rank(rank)
        # Several machines: say which node each line comes from (torchrun numbers ranks node by
        # node; its prefix template knows only ranks).
        label = self.job.label(rank)
        # torch's excepthook prefixes each line of a rank's uncaught traceback with "[rankN]:".
        # A traceback is held until it is complete, then shown as an excerpt: the frames that
        # start every worker and torch's internals are noise under a learner's cell.
        dup = f"[rank{rank}]:"
        held = self._tracebacks.get(rank)
        if rest.startswith(dup):
            body = rest[len(dup) :].removeprefix(" ")
            if held is not None or body.startswith("Traceback (most recent call last)"):
                self._tracebacks.setdefault(rank, []).append(body)
                return
            rest = body
        elif held is not None:
            self._flush_traceback(rank)
        self.echo.line(f"{label} {rest}")

    def _flush_traceback(self, rank: int) -> None:
        lines = self._tracebacks.pop(rank, [])
        label = self.job.label(rank)
        for line in diagnosis.traceback_excerpt("\n".join(lines)).splitlines():
            self.echo.line(f"{label} {line}")

    def _tick(self, now: float, timeout_s: float, heartbeat_timeout_s: float | None) -> bool:
        """One supervision step; True when the job must be ended for time."""
        job = self.job
        job.heartbeats = spec.read_heartbeats(job.job_dir, job.ranks_here())
        for rank, beat in job.heartbeats.items():
            job.saw_rank(rank)
            if self._seqs.get(rank) != beat.get("seq"):
                self._seqs[rank] = beat.get("seq")
                self._last_progress = now
            self._record_worker(beat.get("pid"))
        if now - self._last_scan >= TREE_SCAN_S:
            self._last_scan = now
            self._scan_tree()
        self._show_progress()
        notify(self.observers, "on_tick", job)

        job.checked_at = time.time()
        if now - job.started >= timeout_s:
            self.timeout_reason = (
                f"timed out after {now - job.started:.1f} s (timeout_s={timeout_s})"
            )
            return True
        running = [b for b in job.heartbeats.values() if b.get("phase") != "done"]
        if (
            heartbeat_timeout_s is not None
            and len(job.heartbeats) == job.nproc
            and running
            and now - self._last_progress >= heartbeat_timeout_s
        ):
            self.timeout_reason = (
                f"no heartbeat changed for {now - self._last_progress:.1f} s "
                f"(heartbeat_timeout_s={heartbeat_timeout_s})"
            )
            return True
        return False

    def _show_progress(self) -> None:
        """A line at each quarter of the slowest rank's steps: sparse enough for saved output."""
        step, total = self.job.progress()
        if self.echo.quiet or step is None or not total:
            return
        quarter = min(4, 4 * step // total)
        if quarter > self._milestone:
            self._milestone = quarter
            print(f"[progress] step {step}/{total} (slowest rank), {self.job.elapsed_s:.1f} s")

    # -- process bookkeeping -----------------------------------------------------------------

    def _record_worker(self, pid: Any) -> None:
        if not isinstance(pid, int) or pid in self.workers:
            return
        with contextlib.suppress(psutil.Error):
            self.workers[pid] = psutil.Process(pid)
            self._save_record()

    def _scan_tree(self) -> None:
        if self.agent is None:
            return
        with contextlib.suppress(psutil.Error):
            new = [p for p in self.agent.children(recursive=True)
                   if p.pid not in self.workers and p.pid not in self.torchrun]  # fmt: skip
            for p in new:
                with contextlib.suppress(psutil.Error):
                    agent = p.ppid() == self.agent.pid and is_torchrun_agent(p)
                    (self.torchrun if agent else self.workers)[p.pid] = p
            if new:
                self._save_record()

    def _save_record(self) -> None:
        tree = [self.agent, *self.torchrun.values(), *self.workers.values()] if self.agent else []
        spec.write_json_atomic(
            procs.registry_dir() / f"{self.job.job_id}.json",
            {
                "job_id": self.job.job_id,
                "module": self.job.module,
                "job_dir": str(self.job.job_dir),
                "owner": procs.record(psutil.Process()),
                "agent": procs.record(self.agent) if self.agent else None,
                "workers": [procs.record(p) for p in tree[1:]],
            },
        )

    def stop(self) -> list[int]:
        """End every process of the job still alive; idempotent. Returns the PIDs it ended.

        Besides the agent's tree, any process carrying this job's ``LABKIT_JOB_DIR`` is ended:
        a child a worker started just before the job finished is orphaned (adopted by PID 1)
        the moment its parent exits, out of the agent's tree, but it inherited the variable.
        """
        ended: list[int] = []
        if self.proc is not None:
            if self.proc.poll() is None:
                self._scan_tree()
            known = [p for p in [self.agent, *self.torchrun.values(), *self.workers.values()] if p]
            ended = procs.end_tree(known + procs.carrying(spec.JOB_DIR_ENV, str(self.job.job_dir)))
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)  # reap the agent: no zombie left in the kernel
            if self.returncode is None:
                self.returncode = self.proc.returncode
            if self.proc.stdout:
                self.proc.stdout.close()
        if self.ended_at is None:
            self.ended_at = time.monotonic()
            for rank in list(self._tracebacks):  # in the order they began
                self._flush_traceback(rank)
            self.echo.finish()
        if self._log:
            with contextlib.suppress(OSError):  # a full disk must not stop the tidying below
                self._log.close()
        with contextlib.suppress(OSError):
            (procs.registry_dir() / f"{self.job.job_id}.json").unlink(missing_ok=True)
        shutil.rmtree(self.job.job_dir / "tmp", ignore_errors=True)
        return ended

    def result(self) -> JobResult:
        job = self.job
        beats = spec.read_heartbeats(job.job_dir, job.ranks_here())
        # An elastic job may have started with fewer nodes than it admits: the ranks say.
        world = max((b["world"] for b in beats.values() if isinstance(b.get("world"), int)),
                    default=job.world_size)  # fmt: skip
        ranks = [spec.read_json(spec.result_path(job.job_dir, r)) or {} for r in range(world)]
        restarts = max((b.get("restart", 0) for b in beats.values()), default=0)
        return JobResult(
            module=job.module,
            job_id=job.job_id,
            nproc=job.nproc,
            backend=job.backend,
            device=job.device,
            ranks=ranks,
            wall_s=(self.ended_at or time.monotonic()) - job.started,
            log_dir=job.job_dir,
            status=self.status,
            returncode=self.returncode,
            config=job.config,
            agent_pid=job.agent_pid,
            worker_pids=sorted(self.workers),
            nodes=job.nodes,
            node_rank=job.node_rank,
            restarts=restarts if isinstance(restarts, int) else 0,
        )


def _interfaces() -> list[tuple[int, str]]:
    try:
        return socket.if_nameindex()
    except (OSError, AttributeError):
        return []

