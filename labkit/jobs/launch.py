"""Run a multi-process job from a notebook cell, and never leave a process behind.

    from labkit.jobs import launch
    res = launch.run("labkit.workers.allreduce", nproc=2, config={"numel": 2**20})
    res.ranks          # [rank 0's result dict, rank 1's result dict]

``run`` starts ``python -m torch.distributed.run`` (torchrun) as a subprocess on an importable
worker module (see ``labkit.jobs.runtime``) and supervises it from the calling thread:

- bad input fails before anything starts (unknown module, more ranks than GPUs, ...);
- each rank's output appears under the cell with a "[rank0]" prefix, bounded to ``tail_lines``
  lines; full per-rank logs stay in the job directory;
- per-rank results come back as dicts (``JobResult.ranks``);
- a failure raises ``JobFailed`` naming the rank, its exception and traceback;
- a hang raises ``JobTimeout`` naming the rank that fell behind, from per-rank heartbeats
  (torchrun's own report names the *victim*, the rank whose collective timed out first);
- on error, timeout or interrupt the whole process tree is ended, SIGTERM then SIGKILL;
- a kernel killed outright (Jupyter restart) still takes its job down: torchrun runs under a
  small supervisor (``labkit.jobs.spawn --supervise``) that gets a parent-death signal, keeps every
  process of the job as its descendant (a child subreaper) and SIGKILLs whatever is left after
  a few seconds, however the ranks' children treat SIGTERM; a registry of job PIDs lets the
  next ``run`` (or ``cleanup()``) end anything that still escaped.

Why a subprocess and not ``mp.spawn`` or an in-process launcher: functions defined in a
notebook cannot be pickled into spawned workers (pytorch #20375), fork breaks once the kernel
touched CUDA (accelerate #908), and torch's in-process ``elastic_launch`` leaves its signal
handlers installed in the kernel. A subprocess keeps the kernel clean.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import html
import importlib.util
import json
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
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from labkit.config import parse_json_object
from labkit.errors import LabkitError
from labkit.jobs import diagnosis, procs, runtime

# Re-exported: part of launch's API.
from labkit.jobs.diagnosis import diagnose_hang as diagnose_hang
from labkit.jobs.diagnosis import rank_log_path as rank_log_path
from labkit.jobs.diagnosis import traceback_excerpt as traceback_excerpt
from labkit.jobs.nodes import Nodes, endpoint_problem, is_torchrun_agent, rank_range
from labkit.jobs.procs import cleanup as cleanup
from labkit.jobs.procs import labkit_home as labkit_home
from labkit.jobs.spec import WorkerConfig, worker_of
from labkit.validate import is_finite, shown, whole

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
RANK_PREFIX = "[rank${rank}] "  # torchrun substitutes ${rank}
_RANK_LINE = re.compile(r"^\[rank(\d+)\] ?")
# torchrun's agent (c10d's socket.cpp) when it cannot get a local port for its rendezvous.
_NO_PORT = re.compile(
    r"errno: (?:98|99) - (Address already in use|Cannot assign requested address)"
)
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl")


# --- results and errors -----------------------------------------------------------------------


@dataclass
class JobResult:
    """What a job left behind.

    Attributes:
        ranks: per-rank result dicts, ordered by rank ({} for a rank that wrote none).
        wall_s: seconds from start to the end of the last process.
        log_dir: the job directory: job.json, rank{r}.json, agent.log, torchrun/ (per-rank logs).
        status: "ok", "failed", "timeout" or "interrupted".
        returncode: torchrun's exit status (negative: killed by that signal).
        agent_pid, worker_pids: the processes the job ran, all ended by now. ``agent_pid`` is
            labkit's supervisor around torchrun's agent (labkit/jobs/spawn.py); ``worker_pids``
            the ranks and the processes they started, as far as the launcher saw them (its
            scan of the tree runs once a second, so a child that lived less may be missing);
            torchrun's agent itself is in neither.
        nodes: the multi-node layout it ran under (None: this machine alone). Then ``nproc``
            counts this node's ranks, ``world_size`` the whole job's, and ``ranks`` holds
            results only for this node's ranks (``local_ranks``); other nodes keep theirs.
        node_rank: this machine's node rank (0 on one machine).
        restarts: how many times torchrun restarted the ranks (``max_restarts``).
    """

    module: str
    job_id: str
    nproc: int
    backend: str
    device: str
    ranks: list[dict[str, Any]]
    wall_s: float
    log_dir: Path
    status: str
    returncode: int | None
    config: dict[str, Any] = field(default_factory=dict)
    agent_pid: int | None = None
    worker_pids: list[int] = field(default_factory=list)
    nodes: Nodes | None = None
    node_rank: int | None = 0
    restarts: int = 0

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def local_ranks(self) -> list[int]:
        """The ranks that ran on this machine (all of them, on one machine)."""
        if self.nodes is None:
            return list(range(self.nproc))
        return [] if self.node_rank is None else list(rank_range(self.node_rank, self.nproc))

    def rank(self, r: int) -> dict[str, Any]:
        """Rank ``r``'s result dict."""
        if not 0 <= r < self.world_size:
            raise IndexError(f"rank {r} out of range: this job had ranks 0..{self.world_size - 1}")
        if r not in self.local_ranks:
            raise IndexError(
                f"rank {r} ran on node {r // self.nproc}, not on this one (node "
                f"{self.node_rank}, ranks {self.local_ranks}): its result is in that node's "
                "job folder"
            )
        return self.ranks[r]

    @property
    def result(self) -> dict[str, Any]:
        """The lowest rank's result (rank 0's on one machine), for jobs where every rank
        reports the same thing."""
        if not self.local_ranks:
            raise IndexError("no rank of this job ran on this node")
        return self.rank(self.local_ranks[0])

    def log(self, r: int, stream: str = "stdout") -> str:
        """Full text of rank ``r``'s stdout (or ``stream="stderr"``) log, "" if none."""
        path = rank_log_path(self.log_dir, r, stream)
        return path.read_text(errors="replace") if path else ""

    def _summary(self) -> str:
        where = (f"node {self.node_rank} of {self.nodes.count}, {self.nproc} of "
                 f"{self.world_size} ranks" if self.nodes else f"{self.nproc} ranks")  # fmt: skip
        again = f", {self.restarts} restart(s)" if self.restarts else ""
        return (
            f"{self.module}: {self.status}, {where}, {self.backend}/{self.device},"
            f" {self.wall_s:.1f} s{again}, logs in {self.log_dir}"
        )

    def _rows(self) -> list[tuple[int, dict[str, Any]]]:
        """(rank, result) of the ranks that ran here."""
        return [(r, self.ranks[r]) for r in self.local_ranks if r < len(self.ranks)]

    def _split_keys(self) -> tuple[dict[str, Any], list[str]]:
        """Scalar keys whose value every rank shares (shown once), and the per-rank ones."""
        results = [res for _, res in self._rows()]
        keys: list[str] = []
        for res in results:
            keys += [k for k, v in res.items() if k not in keys and k != "rank" and _is_scalar(v)]
        common: dict[str, Any] = {}
        if len(results) > 1 and all(results):
            for k in keys:
                values = [res.get(k) for res in results]
                if all(k in res and v == values[0] for res, v in zip(results, values, strict=True)):
                    common[k] = values[0]
        return common, [k for k in keys if k not in common][:12]  # a table, not a dump

    def __repr__(self) -> str:
        common, cols = self._split_keys()
        rows = [["rank", *cols]]
        rows += [[str(r), *(_fmt(res.get(c)) for c in cols)] for r, res in self._rows()]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        table = "\n".join(
            "  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in rows
        )
        shared = ", ".join(f"{k}={_fmt(v)}" for k, v in common.items())
        return (
            f"JobResult({self._summary()})\n" + (f"all ranks: {shared}\n" if shared else "") + table
        )

    def _repr_html_(self) -> str:
        common, cols = self._split_keys()
        esc = html.escape
        head = "".join(f"<th>{esc(c)}</th>" for c in ["rank", *cols])
        body = "".join(
            "<tr>"
            + f"<td>{r}</td>"
            + "".join(f"<td>{esc(_fmt(res.get(c)))}</td>" for c in cols)
            + "</tr>"
            for r, res in self._rows()
        )
        shared = ", ".join(f"{esc(k)}={esc(_fmt(v))}" for k, v in common.items())
        return (
            f"<div><b>{esc(self.module)}</b> {esc(self._summary().split(': ', 1)[1])}"
            + (f"<br>all ranks: {shared}" if shared else "")
            + f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
        )


def _is_scalar(v: Any) -> bool:
    return isinstance(v, (int, float, str, bool)) or v is None


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


class LaunchError(RuntimeError, LabkitError):
    """The machine cannot run the job now (no free network port, a full or unwritable disk);
    the message names the cause and the fix. Nothing of the job is left running."""


class JobError(RuntimeError, LabkitError):
    """A job that did not finish cleanly; ``.result`` holds what it left behind."""

    def __init__(self, message: str, *, result: JobResult) -> None:
        super().__init__(message)
        self.result = result


class JobFailed(JobError):
    """A rank raised or died. ``.rank`` is the root cause (None if it cannot be told), with
    ``.exc_type``/``.exc_message``/``.traceback`` if it raised, ``.exitcode`` if it died (-9:
    SIGKILL); ``.consequences`` are the ranks that failed because of it."""

    def __init__(
        self,
        message: str,
        *,
        result: JobResult,
        rank: int | None,
        exc_type: str = "",
        exc_message: str = "",
        traceback: str = "",
        hung_ranks: Sequence[int] = (),
        exitcode: int | None = None,
        consequences: Sequence[int] = (),
        kind: str = "",
    ) -> None:
        super().__init__(message, result=result)
        self.rank, self.exc_type, self.exc_message = rank, exc_type, exc_message
        self.traceback, self.hung_ranks = traceback, list(hung_ranks)
        self.exitcode = exitcode  # the root cause's exit status (negative: killed by a signal)
        self.consequences = list(consequences)  # ranks whose failure followed from it
        self.kind = kind  # how the cause ended: diagnosis.CAUSE_ORDER ("raised", "died", ...)


class JobTimeout(JobError):
    """The job ran out of time. ``.ranks``: the ranks that fell behind (likely hung);
    ``.where``: where each rank was when it was stopped, from its own stack dump."""

    def __init__(
        self,
        message: str,
        *,
        result: JobResult,
        ranks: Sequence[int],
        heartbeats: dict[int, dict],
        where: dict[int, str] | None = None,
    ) -> None:
        super().__init__(message, result=result)
        self.ranks = list(ranks)
        self.rank = self.ranks[0] if self.ranks else None
        self.heartbeats = heartbeats
        self.where = dict(where or {})  # rank -> "file, line N, in f: `code`" where it was stuck


# --- the running job, as observers see it ---------------------------------------------------


@dataclass
class Job:
    """A running job. Observers get it in ``on_start(job)``, ``on_tick(job)`` and
    ``on_end(job, result)`` (each method optional); ``on_tick`` comes every ~0.25 s from the
    launcher's own loop, so a live plot can redraw there while the cell blocks."""

    job_id: str
    module: str
    nproc: int
    backend: str
    device: str
    config: dict[str, Any]
    job_dir: Path
    started: float = field(default_factory=time.monotonic)  # time.monotonic() at start
    agent_pid: int | None = None
    heartbeats: dict[int, dict] = field(default_factory=dict)  # latest, by rank
    checked_at: float | None = None  # time.time() of the last supervision tick
    nodes: Nodes | None = None  # the multi-node layout; None: this machine alone
    # This machine's node rank: 0 alone, given for a static rendezvous, and under c10d learned
    # from the first rank that shows up (torchrun numbers ranks node by node).
    node_rank: int | None = 0
    max_restarts: int = 0

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    @property
    def world_size(self) -> int:
        """The most ranks the whole job can have (every node's ``nproc``)."""
        return self.nproc * (self.nodes.max_nodes if self.nodes else 1)

    @property
    def local_ranks(self) -> list[int]:
        """The global ranks on this machine; [] while a c10d job has not told us its place."""
        return [] if self.node_rank is None else list(rank_range(self.node_rank, self.nproc))

    def ranks_here(self) -> list[int]:
        """The ranks to look for in this machine's job folder: ours once known, else any."""
        return self.local_ranks or list(range(self.world_size))

    def label(self, rank: int) -> str:
        """How rank ``rank``'s lines are prefixed under the cell: its node too, on several."""
        return f"[node{rank // self.nproc} rank{rank}]" if self.nodes else f"[rank{rank}]"

    def saw_rank(self, rank: int) -> None:
        """A rank of ours showed up: under c10d that tells which node we are."""
        if self.node_rank is None and 0 <= rank < self.world_size:
            self.node_rank = rank // self.nproc

    def rank_pids(self) -> dict[int, int]:
        """{rank: pid} of the workers, as soon as they exist.

        Heartbeats name a rank's PID once its process group is up; before that (a worker spends
        seconds importing torch) the agent's children are found directly, each carrying its
        ``RANK`` in its environment, so a monitor sees the ranks from their first second.
        """
        pids = {r: b["pid"] for r, b in self.heartbeats.items() if isinstance(b.get("pid"), int)}
        if len(pids) < self.nproc and self.agent_pid is not None:
            for child in _ranks_under(self.agent_pid):
                with contextlib.suppress(psutil.Error, KeyError, ValueError):
                    rank = int(child.environ()["RANK"])
                    pids.setdefault(rank, child.pid)
                    self.saw_rank(rank)
        return pids

    def progress(self) -> tuple[int | None, int | None]:
        """(step of the slowest rank, total steps) from heartbeats; None where not reported."""
        steps = [b.get("step") for b in self.heartbeats.values()]
        totals = [b["total"] for b in self.heartbeats.values() if b.get("total")]
        if len(steps) < self.nproc or any(s is None for s in steps):
            return None, (max(totals) if totals else None)
        return min(steps), (max(totals) if totals else None)  # type: ignore[type-var]


def _ranks_under(agent_pid: int) -> list[psutil.Process]:
    """The rank processes of the job whose ``agent_pid`` we started: torchrun's children.

    ``agent_pid`` is labkit's supervisor (``labkit.jobs.spawn --supervise``) with torchrun as its
    child; where the supervisor cannot run (not Linux) it execs into torchrun itself. Only
    torchrun's direct children are ranks: a rank's own child inherits RANK too, and the
    supervisor, a child subreaper, adopts the children of a rank that died, so beside
    torchrun it may have such orphans as children, each claiming its dead parent's rank.
    """
    with contextlib.suppress(psutil.Error):
        top = psutil.Process(agent_pid)
        if "labkit.jobs.spawn" not in top.cmdline()[:3]:  # torchrun itself
            return top.children()
        return [rank for agent in top.children() if is_torchrun_agent(agent)
                for rank in agent.children()]  # fmt: skip
    return []


class ProgressLines:
    """An observer that prints a line when a job starts, every ``every_s`` seconds while it
    runs, and when it ends: for jobs launched with ``stream=False`` (or a monitor-less cell),
    so a cell never sits silent for long. ``launch.run(..., observers=[ProgressLines("DDP")])``.

    ``write`` is ``print`` by default (kept under nbval and papermill); tests inject their own.
    """

    def __init__(self, label: str, every_s: float = 3.0, write: Callable[[str], None] = print):
        if not every_s > 0:
            raise ValueError(f"every_s={shown(every_s)}: give a number of seconds > 0")
        self.label, self.every_s, self.write = label, every_s, write
        self.said_at = 0.0

    def on_start(self, job: Job) -> None:
        self.said_at = 0.0
        self.write(f"{self.label}: starting {job.nproc} rank{'s' if job.nproc != 1 else ''}")

    def on_tick(self, job: Job) -> None:
        elapsed = job.elapsed_s
        if elapsed - self.said_at < self.every_s:
            return
        self.said_at = elapsed
        step, total = job.progress()
        if step is None:
            doing = "starting up (importing torch, joining the process group)"
        else:
            doing = f"step {step}" + (f" of {total}" if total else "")
        self.write(f"{self.label}: {elapsed:3.0f} s, {doing}")

    def on_end(self, job: Job, result: Any) -> None:
        status = getattr(result, "status", "ok")
        self.write(f"{self.label}: {'done' if status == 'ok' else status} in {job.elapsed_s:.0f} s")


def _notify(observers: list[Any], method: str, *args: Any) -> None:
    """Call ``method`` on each observer that has it; a broken observer is dropped, not fatal."""
    for obs in list(observers):
        fn = getattr(obs, method, None)
        if fn is None:
            continue
        try:
            fn(*args)
        except Exception as e:  # a plot bug must not leave a job running unsupervised
            print(f"labkit: observer {type(obs).__name__}.{method} raised {e!r}; dropped")
            observers.remove(obs)


# --- input checks (nothing is started before these pass) --------------------------------------


def visible_gpu_count() -> int:
    """CUDA GPUs this process may use (honours CUDA_VISIBLE_DEVICES), without creating a
    CUDA context in the kernel: ``torch.cuda.device_count`` asks NVML when it can."""
    return torch.cuda.device_count()


def resolve_backend(
    nproc: int, device: str = "auto", backend: str = "auto", *, gpu_count: int
) -> tuple[str, str]:
    """Pick (backend, device type) for ``nproc`` ranks on a machine with ``gpu_count`` GPUs.

    NCCL needs one GPU per rank. With ``device="auto"``, ranks that cannot each have their
    own GPU (none visible, or fewer GPUs than ranks: two ranks on a one-GPU machine) use gloo
    on the CPU; ``fallback_note`` says so to the learner. Raises ValueError for a combination
    the machine cannot run (``device="cuda"`` or ``backend="nccl"`` without enough GPUs).
    """
    if device not in DEVICES:
        raise ValueError(f"device={shown(device)}: use one of {DEVICES}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={shown(backend)}: use one of {BACKENDS}")
    if device == "cpu":
        if backend == "nccl":
            raise ValueError("backend='nccl' needs GPUs, but device='cpu': use backend='gloo'")
        return "gloo", "cpu"
    if gpu_count == 0:
        if device == "cuda" or backend == "nccl":
            what = "device='cuda'" if device == "cuda" else "backend='nccl'"
            raise ValueError(f"{what} but no CUDA GPU is visible: use device='cpu' (gloo)")
        return "gloo", "cpu"
    if nproc > gpu_count:
        if device == "auto" and backend != "nccl":
            return "gloo", "cpu"  # every rank on a GPU of its own, or none: see fallback_note
        raise ValueError(
            f"more ranks ({nproc}) than GPUs ({gpu_count}): use nproc<={gpu_count}"
            " or device='cpu' (gloo)"
        )
    return ("gloo" if backend == "gloo" else "nccl"), "cuda"


def fallback_note(nproc: int, device: str, gpu_count: int) -> str | None:
    """What to tell the learner when ``device="auto"`` put ranks on the CPU despite a GPU."""
    if device != "cpu" or gpu_count == 0:
        return None
    return (f"labkit: {nproc} ranks but {gpu_count} GPU{'s' if gpu_count > 1 else ''} visible: "
            "the ranks run on the CPU over gloo (NCCL needs a GPU per rank); the collectives "
            "and the algorithm are the real ones, the timings are the CPU's")  # fmt: skip


def _module_roots(module: str) -> list[str]:
    """Check workers can import ``module``; return sys.path entries they need for it.

    The kernel may import it thanks to a ``sys.path`` edit (``sys.path.insert(0, "..")``) that
    a fresh process would not repeat, so the roots go into the workers' PYTHONPATH.
    """
    if not isinstance(module, str) or not re.fullmatch(r"[A-Za-z_][\w.]*", module):
        raise ValueError(
            f"module={shown(module)}: pass a dotted module name like 'labkit.workers.allreduce'"
        )
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or module == "__main__":
        raise ValueError(
            f"no module named {module!r}: workers must be importable modules (a "
            "function defined in a notebook cannot be imported by worker processes);"
            " put it in a .py file on sys.path and pass its dotted name"
        )
    roots = []
    for name in (module.partition(".")[0], __name__.partition(".")[0]):
        top = importlib.util.find_spec(name)
        locations = list(top.submodule_search_locations or []) if top else []
        if top and not locations and top.origin:
            locations = [top.origin]
        for loc in locations:
            root = str(Path(loc).resolve().parent)
            # site-packages is on every interpreter's path already; putting it on PYTHONPATH
            # would move it ahead of the standard library.
            if root not in roots and not root.endswith(("site-packages", "dist-packages")):
                roots.append(root)
    return roots


def _worker_and_config(module: Any, config: Any) -> tuple[str, dict[str, Any]]:
    """run()'s first two arguments as (worker module, config dict): ``run(SomeConfig(...))``,
    ``run(module, config=SomeConfig(...))`` or ``run(module,
    config={...})``."""
    if isinstance(module, WorkerConfig):
        if config is not None:
            raise ValueError(f"run({type(module).__name__}(...), config=...): the config is the "
                             "first argument already; leave config out")  # fmt: skip
        return worker_of(module), module.to_dict()
    if not isinstance(module, str):
        raise ValueError(f"module={shown(module)}: need a worker's config (a WorkerConfig) or "
                         "a dotted module name such as 'labkit.workers.allreduce'")  # fmt: skip
    if isinstance(config, WorkerConfig):
        if worker_of(config) != module:
            raise ValueError(f"config is a {type(config).__name__}, for {worker_of(config)}, "
                             f"not for {module}: pass run({type(config).__name__}(...)) alone")
        return module, config.to_dict()
    return module, {} if config is None else config


def _check_inputs(
    nproc: int,
    config: Any,
    timeout_s: float,
    tail_lines: int | None,
    env: Any,
    heartbeat_timeout_s: float | None,
    pg_timeout_s: float,
) -> str:
    """Validate run()'s arguments; return the config as JSON."""
    nproc = whole("nproc", nproc, low=1, why="processes to start")
    if not isinstance(config, dict):
        raise ValueError(f"config must be a dict or None, got {type(config).__name__}")
    try:
        config_json = json.dumps(config)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"config is not JSON-serialisable ({e}): workers get it as JSON, so "
            "use numbers, strings, bools, None, lists and dicts"
        ) from None
    for name, value in (
        ("timeout_s", timeout_s),
        ("pg_timeout_s", pg_timeout_s),
        ("heartbeat_timeout_s", heartbeat_timeout_s),
    ):
        if value is not None and not (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and is_finite(value)
            and value > 0
        ):
            raise ValueError(
                f"{name}={shown(value)}: need a finite number of seconds > 0, e.g. 120"
            )
    if tail_lines is not None and (not isinstance(tail_lines, int) or tail_lines < 0):
        raise ValueError(f"tail_lines={shown(tail_lines)}: need an integer >= 0, or None for all")
    if env is not None and not (
        isinstance(env, Mapping)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        raise ValueError(
            f"env={shown(env)}: env takes a dict of str to str, each extra environment "
            "variable's name to its value, e.g. env={'OMP_NUM_THREADS': '1'} (values are "
            "strings too: '1', not 1)"
        )
    return config_json


# --- the launcher -------------------------------------------------------------------------------


def run(
    module: str | WorkerConfig,
    *,
    nproc: int = 2,
    config: dict[str, Any] | WorkerConfig | None = None,
    timeout_s: float = 300,
    device: str = "auto",
    backend: str = "auto",
    log_dir: str | Path | None = None,
    stream: bool = True,
    tail_lines: int | None = 30,
    env: dict[str, str] | None = None,
    heartbeat_timeout_s: float | None = None,
    pg_timeout_s: float = runtime.DEFAULT_PG_TIMEOUT_S,
    observers: Sequence[Any] = (),
    oversubscribe: bool = False,
    nodes: Nodes | None = None,
    max_restarts: int = 0,
) -> JobResult:
    """Run worker ``module`` on ``nproc`` processes and return their results.

    Args:
        module: the worker's typed config (a ``labkit.jobs.spec.WorkerConfig``, which names
            its module), or the dotted name of an importable worker module (see
            ``labkit.jobs.runtime``).
        nproc: number of processes (ranks).
        config: with a module name, the JSON-serialisable dict (or ``WorkerConfig``) handed
            to every rank as ``ctx.config``; leave it out when ``module`` is a config.
        timeout_s: wall-clock limit for the whole job, seconds.
        device: "auto" (CUDA if every rank can have its own GPU, else CPU), "cpu" or "cuda".
        backend: "auto" (nccl on CUDA, gloo on CPU), "gloo" or "nccl".
        log_dir: parent folder for the job directory (default: ``labkit_home()/runs``, where
            the oldest finished job directories are deleted before each launch so at most
            ``$LABKIT_KEEP_RUNS`` (default 50) remain; see ``procs.prune_runs``).
        stream: print rank-prefixed output while the job runs.
        tail_lines: at most this many lines are printed live, and the last lines of the rest
            at the end (None: print all). The logs on disk are always complete.
        env: extra environment variables for the workers.
        heartbeat_timeout_s: end the job when no rank's heartbeat changed for this long,
            counted once every rank has started (None: only ``timeout_s`` applies).
        pg_timeout_s: process-group timeout inside the workers, seconds: a collective that
            waits longer raises there.
        observers: objects with optional ``on_start(job)``, ``on_tick(job)``,
            ``on_end(job, result)`` methods (live plots).
        oversubscribe: allow more than ``MAX_RANKS_PER_CORE`` CPU ranks per core.
        nodes: run as one node of a job across machines (``labkit.jobs.nodes.Nodes``: node count,
            rendezvous endpoint and id, optionally this node's rank); call ``run`` with the
            same arguments on every node. ``nproc`` is then the ranks on *this* node, the
            output says which node each rank is on, and the result holds this node's ranks.
            None (default): every rank on this machine.
        max_restarts: how many times torchrun may restart all ranks after one fails (its
            ``--max-restarts``). A worker that resumes from a checkpoint makes a restart worth
            it (``labkit.jobs.checkpoint``); without one, a restart repeats the work, or the failure.
            Default 0: a failure ends the job and is reported at once.

    Raises:
        ValueError: bad arguments or a bad ``$LABKIT_KEEP_RUNS``; nothing was started.
        LaunchError: the machine cannot run it now (no free port, a full disk, a rendezvous
            endpoint whose port another program holds or whose host cannot be reached);
            nothing was started, or what was is ended.
        JobFailed: a rank raised or died; names the rank, the exception and the logs.
        JobTimeout: out of time; names the rank(s) that fell behind.
        KeyboardInterrupt: re-raised after every process of the job has been ended.
    """
    module, config = _worker_and_config(module, config)
    config_json = _check_inputs(
        nproc, config, timeout_s, tail_lines, env, heartbeat_timeout_s, pg_timeout_s
    )
    if nodes is not None and not isinstance(nodes, Nodes):
        raise ValueError(
            f"nodes={shown(nodes)}: need a labkit.jobs.nodes.Nodes(count, endpoint=..., rdzv_id=...), "
            "or None for a job on this machine alone"
        )
    max_restarts = whole("max_restarts", max_restarts, low=0, why="0: no restart")
    gpu_count = visible_gpu_count()
    asked = device
    backend, device = resolve_backend(nproc, device, backend, gpu_count=gpu_count)
    roots = _module_roots(module)
    crowded = check_cpu_ranks(nproc, device, oversubscribe=oversubscribe)
    note = fallback_note(nproc, device, gpu_count) if asked == "auto" else None
    for line in (note, crowded):
        if line and stream:
            print(line)
    _check_free_port()

    for ended in cleanup(supervised=_SUPERVISED):
        print(
            f"labkit: ended {len(ended['pids'])} leftover process(es) of job {ended['job_id']}"
            " (nothing supervised it any more)"
        )
    # After cleanup(): a leftover job of a killed kernel may still hold the rendezvous port,
    # and is gone now; looked at before, it would be refused as a stranger (static) or taken
    # for another agent hosting the rendezvous (c10d).
    if nodes is not None and (problem := endpoint_problem(nodes)) is not None:
        raise LaunchError(problem)
    if not log_dir:  # a folder the caller chose is the caller's to tidy
        # After cleanup(), so jobs it just ended count as finished. The new job is one of the
        # folders kept, hence keep - 1. A bad $LABKIT_KEEP_RUNS raises ValueError before
        # anything starts; a disk problem only costs the tidying, never the launch.
        keep = max(procs.keep_runs() - 1, 0)
        try:
            procs.prune_runs(keep)
        except OSError as e:
            print(f"labkit: could not delete old job folders ({e}); launching anyway")

    job_id = f"{module.rsplit('.', 1)[-1]}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    spec = {
        "job_id": job_id,
        "module": module,
        "nproc": nproc,
        "backend": backend,
        "device": device,
        "pg_timeout_s": float(pg_timeout_s),
        "config": json.loads(config_json),
        "nodes": dataclasses.asdict(nodes) if nodes else None,
        "max_restarts": max_restarts,
    }
    job_dir = _make_job_dir(Path(log_dir or procs.default_runs_dir()).resolve(), spec,
                            may_prune=not log_dir)  # fmt: skip
    job = Job(job_id, module, nproc, backend, device, config, job_dir, nodes=nodes,
              node_rank=(nodes.node_rank if nodes else 0), max_restarts=max_restarts)  # fmt: skip
    sup = _Supervisor(
        job,
        roots,
        env or {},
        observers=list(observers),
        echo=_Echo(tail_lines if stream else 0, job_dir, quiet=not stream),
    )
    _SUPERVISED.add(job_id)
    try:
        sup.start()
        sup.wait(timeout_s, heartbeat_timeout_s)
    except KeyboardInterrupt:
        sup.status = "interrupted"
        raise
    except OSError as e:
        sup.status = "failed"
        if e.errno in _DISK_FULL:  # the disk filled up under the job's own files
            raise _disk_error(job_dir, e) from e
        raise
    finally:
        with _interrupts_deferred(job_id):
            ended = sup.stop()
            _SUPERVISED.discard(job_id)
            if sup.status == "interrupted":
                print(f"labkit: interrupted; ended {len(ended)} process(es) of job {job_id}")
            result = sup.result()
            _notify(sup.observers, "on_end", job, result)
    if sup.status == "timeout":
        raise _timeout_error(job, result, sup.timeout_reason, ranks_started=bool(sup.workers))
    if sup.agent_problem:
        raise LaunchError(f"{job.module} could not run: {sup.agent_problem}\nlogs in {job_dir}")
    if sup.status == "failed":
        agent_log = "\n".join(sup.agent_lines)
        if (full := _disk_full(job_dir)) is not None:  # every later write would fail too
            raise _disk_error(job_dir, full)
        raise _failure_error(job, result, agent_log)
    beats = runtime.read_heartbeats(job_dir, job.ranks_here())
    if missing := [r for r in job.local_ranks or range(nproc) if r not in beats]:
        raise _no_worker_error(job, result, missing)
    return result


# --- the machine: cores, a port, disk ---------------------------------------------------------

MAX_RANKS_PER_CORE = 4
"""CPU ranks per core allowed without ``oversubscribe=True``: two or four ranks on a two-core
laptop are a lesson in contention; ten thousand are a fork bomb."""


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity mask: a container's or taskset's limit)."""
    with contextlib.suppress(AttributeError, OSError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_cpu_ranks(nproc: int, device: str, *, oversubscribe: bool = False) -> str | None:
    """Refuse more CPU ranks than the cores can carry; return a note when ranks share cores.

    Each rank is a whole Python process with torch loaded (a few hundred MB) and a gloo
    connection to every other rank. GPU jobs are bounded by the GPU count already
    (``resolve_backend``).
    """
    if device != "cpu":
        return None
    cores = usable_cpus()
    limit = MAX_RANKS_PER_CORE * cores
    if nproc > limit and not oversubscribe:
        raise ValueError(
            f"nproc={nproc} CPU ranks on {cores} core{'s' if cores != 1 else ''}: at most "
            f"{limit} ({MAX_RANKS_PER_CORE} per core) are started without oversubscribe=True. "
            "Each rank is a process with torch loaded; this many would exhaust the machine. "
            f"Use nproc<={limit}, or pass oversubscribe=True if you mean it"
        )
    if nproc > cores:
        return (
            f"labkit: {nproc} ranks share {cores} CPU core{'s' if cores != 1 else ''}: they take "
            "turns, so the timings show contention, not what more hardware would give"
        )
    return None


def _check_free_port() -> None:
    """torchrun's rendezvous and gloo each need a local TCP port. With none free, torchrun
    retries for a minute and then fails with errno 99 in its own log; this says so at once."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
    except OSError as e:
        raise LaunchError(_no_port_message(e.strerror or str(e))) from None


def _no_port_message(error: str) -> str:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = f.read().split()
        span = f" ({low} to {high}, in /proc/sys/net/ipv4/ip_local_port_range)"
    except (OSError, ValueError):
        span = ""
    return (
        f"no free local network port ({error}): torchrun's rendezvous and gloo each need "
        f"one, and every port of this machine's ephemeral range{span} is taken. See who holds "
        "them with `ss -tanp` (`ss -s` counts them); end that program, or wait a minute for "
        "closed connections to leave TIME_WAIT, then run the cell again"
    )


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _make_job_dir(parent: Path, spec: dict[str, Any], *, may_prune: bool) -> Path:
    """Create the job's folder and spec, and its entry in the registry of running jobs.

    On a full disk, the finished job folders under the default runs folder (old logs) are
    deleted to make room, once; if that is not enough, ``LaunchError`` names the path and the
    ways out.
    """
    job_dir = parent / spec["job_id"]
    for attempt in (1, 2):
        try:
            (job_dir / "tmp").mkdir(parents=True, exist_ok=True)
            runtime.write_json_atomic(job_dir / runtime.SPEC_FILE, spec)
            procs.registry_dir().mkdir(parents=True, exist_ok=True)
            return job_dir
        except OSError as e:
            shutil.rmtree(job_dir, ignore_errors=True)
            if e.errno in _DISK_FULL and may_prune and attempt == 1:
                freed = procs.prune_runs(0)
                if freed:
                    print(f"labkit: the disk holding {parent} is full; deleted {len(freed)} "
                          "old job folder(s) (their logs) to make room")  # fmt: skip
                    continue
            raise _disk_error(parent, e) from e
    raise AssertionError("unreachable")


LOW_SPACE_BYTES = 16 << 20
"""Less free space than this under a job that failed counts as a full disk: its own tidying
(torchrun's temp folder) frees a few pages after the fact, and a rank or torchrun that could
not write its files fails in ways that do not say why (an empty error file, say)."""


def _disk_full(path: Path) -> OSError | None:
    """An ENOSPC error if the disk under ``path`` is full or nearly so, else None."""
    probe = path / f".space-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"\0" * 4096)
        if shutil.disk_usage(path).free < LOW_SPACE_BYTES:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    except OSError as e:
        if e.errno in _DISK_FULL:
            return e
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None


def _disk_error(path: Path, e: OSError) -> LaunchError:
    """The error for a job whose files could not be written under ``path``."""
    where = Path(e.filename) if e.filename else path
    if e.errno in _DISK_FULL:
        try:
            free = f", {shutil.disk_usage(path if path.exists() else path.parent).free / 2**20:.1f} MiB free"
        except OSError:
            free = ""
        return LaunchError(
            f"the disk holding {where} is full ({e.strerror}{free}): labkit writes each "
            "job's logs and results there. Free space on it, delete the old job folders with "
            "`python -m labkit cleanup --runs 0`, or point LABKIT_HOME at a folder on another "
            "disk (e.g. `export LABKIT_HOME=/path/with/space`, then restart the kernel)"
        )
    return LaunchError(
        f"cannot write the job's files under {where} ({e.strerror or e}): labkit keeps each "
        "job's logs there. Make that folder writable for you, or point LABKIT_HOME at one "
        "that is (`export LABKIT_HOME=$HOME/labkit-cache`, then restart the kernel); "
        "`python -m labkit doctor` checks it"
    )


_SUPERVISED: set[str] = set()  # ids of the jobs this process is supervising right now


@contextlib.contextmanager
def _interrupts_deferred(job_id: str) -> Iterator[None]:
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


class _Echo:
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


def _supervised(command: list[str]) -> list[str]:
    """``command`` under labkit's supervisor (labkit/jobs/spawn.py): it gets SIGTERM when this
    process dies (a Jupyter kernel restart included), and nothing it started, down to a rank's
    child that ignores SIGTERM, outlives it by more than ``SUPERVISOR_GRACE_S`` and a second."""
    return [sys.executable, "-m", "labkit.jobs.spawn", "SIGTERM", str(os.getpid()),
            f"--supervise={SUPERVISOR_GRACE_S}", "--", *command]  # fmt: skip


class _Supervisor:
    """Starts torchrun, pumps its output, watches heartbeats and ends the process tree."""

    def __init__(
        self,
        job: Job,
        roots: list[str],
        extra_env: dict[str, str],
        *,
        observers: list[Any],
        echo: _Echo,
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
        return _supervised(torchrun)

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
                runtime.JOB_DIR_ENV: str(job.job_dir),
                "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": RANK_PREFIX,
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
        _notify(self.observers, "on_start", self.job)

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
        """Ask each rank that has started where it is (``runtime.STACK_SIGNAL``), before the job
        is ended for time; wait up to ``wait_s`` for the answers."""
        asked = []
        for rank, beat in self.job.heartbeats.items():
            proc = self.workers.get(beat.get("pid"))  # a PID this job started, still the same
            if proc is not None and procs.alive(proc):
                with contextlib.suppress(psutil.Error):
                    proc.send_signal(runtime.STACK_SIGNAL)
                    asked.append(runtime.stack_path(self.job.job_dir, rank))
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
            self.agent_problem = _no_port_message(found.group(1))
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
        job.heartbeats = runtime.read_heartbeats(job.job_dir, job.ranks_here())
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
        _notify(self.observers, "on_tick", job)

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
        runtime.write_json_atomic(
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
            ended = procs.end_tree(known + procs.carrying(runtime.JOB_DIR_ENV, str(self.job.job_dir)))
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
        beats = runtime.read_heartbeats(job.job_dir, job.ranks_here())
        # An elastic job may have started with fewer nodes than it admits: the ranks say.
        world = max((b["world"] for b in beats.values() if isinstance(b.get("world"), int)),
                    default=job.world_size)  # fmt: skip
        ranks = [runtime.read_json(runtime.result_path(job.job_dir, r)) or {} for r in range(world)]
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


# --- telling what went wrong (the wording lives in labkit.jobs.diagnosis) -------------------------


def _timeout_error(
    job: Job, result: JobResult, reason: str, *, ranks_started: bool = True
) -> JobTimeout:
    """The error for a job ended for time; diagnosed from the heartbeats at that moment."""
    beats = job.heartbeats
    if not ranks_started and not beats:  # no rank to blame: torchrun never got that far
        agent = diagnosis.agent_excerpt(job.job_dir)
        waiting = (
            f"torchrun's agent was still waiting at the rendezvous {job.nodes.endpoint} for "
            f"{job.nodes.min_nodes} node(s) when time ran out. Is the same command (same "
            f"endpoint, rdzv_id={job.nodes.rdzv_id!r}) running on every node, and can this one "
            "reach the endpoint (a firewall, the wrong interface)?"
            if job.nodes else
            "torchrun's agent was still setting the job up (its rendezvous) when time ran out."
        )  # fmt: skip
        msg = "\n".join([
            f"{job.module} {reason}; no rank ever started: {waiting} Its last lines:",
            *(f"  {s}" for s in agent.splitlines()),
            f"job ended; logs in {job.job_dir}",
        ])  # fmt: skip
        return JobTimeout(msg, result=result, ranks=[], heartbeats=beats)
    ours = job.local_ranks or list(range(job.nproc))
    where = diagnosis.read_stacks(job.job_dir, ours)
    hung, lines = diagnose_hang(beats, ours, now=job.checked_at, where=where)
    if hung:
        verdict = f"likely hung: rank {', '.join(map(str, hung))}"
    else:
        verdict = "no single rank is behind (every rank at the same point)"
    msg = "\n".join(
        [
            f"{job.module} {reason}; {verdict}",
            *(f"  {s}" for s in lines),
            f"job ended; logs in {job.job_dir}",
        ]
    )
    return JobTimeout(msg, result=result, ranks=hung, heartbeats=beats, where=where)


def _failure_error(job: Job, result: JobResult, agent_log: str | None = None) -> JobFailed:
    ours = job.local_ranks or list(range(job.nproc))
    report = diagnosis.failure_report(job.job_dir, ours, result.returncode, agent_log)
    cause = report.cause
    if cause is None:  # torchrun's agent failed, no rank
        said = report.headline
    else:
        said = cause.exc_message if cause.raised else f"the process {diagnosis.how_it_ended(cause)}"
    elsewhere = []
    if job.nodes:  # this node sees only its own ranks
        elsewhere.append(
            f"this is node {job.node_rank if job.node_rank is not None else '?'} (ranks "
            f"{ours[0]}..{ours[-1]}); a failure that began on another node is in that node's logs"
        )
    return JobFailed(
        "\n".join(
            [f"{job.module} {report.headline}", *report.lines, *elsewhere, f"logs in {job.job_dir}"]
        ),
        result=result,
        rank=report.rank,
        exc_type=cause.exc_type if cause else "",
        exc_message=said,
        traceback=cause.traceback if cause else "",
        hung_ranks=report.hung_ranks,
        exitcode=cause.exitcode if cause else result.returncode,
        consequences=[e.rank for e in report.consequences],
        kind=cause.kind if cause else "agent",
    )


def _no_worker_error(job: Job, result: JobResult, missing: list[int]) -> JobFailed:
    """Every process exited cleanly, but ``missing`` ranks never ran the worker function."""
    which = "no rank" if len(missing) == job.nproc else f"rank {', '.join(map(str, missing))}"
    return JobFailed(
        f"{job.module}: {which} ran a worker function: the processes exited cleanly without "
        "setting up (no heartbeat, no result). torchrun runs `python -m "
        f"{job.module}`, so the module must call its worker function itself: is that function "
        "decorated with @runtime.entrypoint, and does the module end with `if __name__ == "
        '"__main__": main()`?\n'
        f"logs in {job.job_dir}",
        result=result,
        rank=missing[0],
        exc_message="no worker function ran",
    )


# --- several nodes from a terminal, and a rehearsal of them on one machine --------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m labkit launch MODULE ...``: the command a learner runs on each node."""
    import argparse

    p = argparse.ArgumentParser(
        prog="labkit launch",
        description="Run a labkit worker module on this machine's ranks, alone or as one node "
        "of a job across machines (the same command on every node).",
    )
    p.add_argument("module", help="worker module, e.g. labkit.workers.multinode")
    p.add_argument("--nproc", type=int, default=1, help="ranks on this node (default 1)")
    p.add_argument("--nodes", help="number of nodes, or MIN:MAX for an elastic job")
    p.add_argument("--endpoint", help="HOST:PORT of the rendezvous (with --nodes)")
    p.add_argument("--rdzv-id", default="labkit", help="the job's name, the same on every node")
    p.add_argument("--node-rank", type=int, help="this node's rank: a static rendezvous")
    p.add_argument("--config", default="{}", help="the worker's config, as JSON")
    p.add_argument("--timeout", type=float, default=300, help="seconds for the whole job")
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--device", default="auto", choices=DEVICES)
    p.add_argument("--json", metavar="FILE", help="also write this node's results to FILE")
    args = p.parse_args(argv)
    try:
        config = parse_json_object(args.config, "--config")  # says it takes JSON, with an example
        nodes = None
        if args.nodes or args.endpoint:
            if not (args.nodes and args.endpoint):
                raise ValueError("--nodes and --endpoint go together: both, or neither")
            nodes = Nodes(args.nodes, args.endpoint, args.rdzv_id, args.node_rank)
        res = run(args.module, nproc=args.nproc, config=config, nodes=nodes,
                  timeout_s=args.timeout, max_restarts=args.max_restarts,
                  device=args.device)  # fmt: skip
    except (ValueError, LaunchError) as e:
        print(f"labkit launch: {e}", file=sys.stderr)
        return 2
    except JobError as e:
        print(str(e), file=sys.stderr)
        res, code = e.result, 1
    else:
        print(repr(res))
        code = 0
    if args.json:
        runtime.write_json_atomic(Path(args.json), _node_record(res))
    return code


def _node_record(res: JobResult) -> dict[str, Any]:
    return {
        "status": res.status,
        "node_rank": res.node_rank,
        "world_size": res.world_size,
        "results": {str(r): res.ranks[r] for r in res.local_ranks if r < len(res.ranks)},
        "wall_s": res.wall_s,
        "log_dir": str(res.log_dir),
    }


@dataclass
class Rehearsal:
    """A job of several "nodes" run on this one machine: what each node's agent reported.

    ``nodes[k]`` is node k's record: status, results by rank, wall time, log folder (and for
    the nodes run in the background, ``agent_log``, what their agent printed). ``here`` is the
    node this kernel ran (its ranks' output appeared under the cell).
    """

    nodes: list[dict[str, Any]]
    here: JobResult
    command: str  # what each node of a real cluster would run

    def output(self, node: int) -> list[str]:
        """The rank lines node ``node``'s agent printed ([] for the node this kernel ran:
        its lines appeared under the cell)."""
        path = self.nodes[node].get("agent_log")
        if not path:
            return []
        text = Path(path).read_text(errors="replace")
        return [line for line in text.splitlines() if line.startswith("[node")]

    def results(self) -> dict[int, dict[str, Any]]:
        """Every rank's result, from every node: {rank: result}."""
        out: dict[int, dict[str, Any]] = {}
        for node in self.nodes:
            out.update({int(r): res for r, res in node["results"].items()})
        return dict(sorted(out.items()))


def rehearse_nodes(
    module: str,
    *,
    nodes: int = 2,
    nproc: int = 1,
    config: dict[str, Any] | None = None,
    timeout_s: float = 120,
    **run_kwargs: Any,
) -> Rehearsal:
    """Run ``module`` as ``nodes`` nodes of ``nproc`` ranks, every node an agent on this machine.

    This kernel runs one node through ``run`` (its ranks stream under the cell); each other
    node is ``python -m labkit launch ... --nodes N --endpoint 127.0.0.1:PORT`` in a
    subprocess, the command a real node would run, tied to this process (it dies with the
    kernel) and ended with the job. They meet through a c10d rendezvous on a port free on
    this machine at the moment it was picked (another program could take it first: then the
    launch fails with a message, and running it again picks another).

    GPUs: every agent numbers its ranks' GPUs from 0 (``LOCAL_RANK``), so with a GPU for every
    rank of every node each agent is shown only its own slice (``CUDA_VISIBLE_DEVICES``), as
    on separate machines; with fewer, every rank runs on the CPU over gloo.
    """
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 2:
        raise ValueError(f"nodes={shown(nodes)}: a rehearsal of several nodes needs 2 or more")
    gpus = visible_gpu_count()
    device = run_kwargs.pop("device", "auto")
    if device == "auto":
        device = "cuda" if gpus >= nodes * nproc else "cpu"
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    visible = visible or [str(i) for i in range(gpus)]
    slices = [",".join(visible[k * nproc:(k + 1) * nproc]) for k in range(nodes)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rdzv_id = f"rehearsal-{uuid.uuid4().hex[:8]}"
    layout = Nodes(nodes, endpoint=f"127.0.0.1:{port}", rdzv_id=rdzv_id)
    out_dir = procs.labkit_home() / "rehearsals" / layout.rdzv_id
    out_dir.mkdir(parents=True, exist_ok=True)
    config_json = json.dumps(config or {})
    others = []
    for k in range(1, nodes):
        cmd = _supervised([
            sys.executable, "-m", "labkit", "launch", module, f"--nproc={nproc}",
            f"--nodes={nodes}", f"--endpoint={layout.endpoint}", f"--rdzv-id={layout.rdzv_id}",
            f"--config={config_json}", f"--timeout={timeout_s}", f"--device={device}",
            f"--json={out_dir / f'agent{k}.json'}",
        ])  # fmt: skip
        env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": slices[k]} if device == "cuda" else {})}
        log = open(out_dir / f"agent{k}.log", "w")  # noqa: SIM115 (closed below)
        others.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        stdin=subprocess.DEVNULL, start_new_session=True), log))  # fmt: skip
    mine = {"CUDA_VISIBLE_DEVICES": slices[0]} if device == "cuda" else {}
    try:
        here = run(module, nproc=nproc, config=config, nodes=layout, timeout_s=timeout_s,
                   device=device, env={**(run_kwargs.pop("env", None) or {}), **mine},
                   **run_kwargs)  # fmt: skip
    finally:
        deadline = time.monotonic() + 15  # the others end with the job; give them a moment
        for proc, log in others:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                procs.end_tree([psutil.Process(proc.pid)])
                proc.wait(timeout=5)
            log.close()
    records = {here.node_rank: _node_record(here)}
    for k in range(1, nodes):
        rec = runtime.read_json(out_dir / f"agent{k}.json")
        if rec is None:
            tail = (out_dir / f"agent{k}.log").read_text(errors="replace")[-2000:]
            raise LaunchError(f"the rehearsal's other agent {k} left no result; its output:\n{tail}")
        rec["agent_log"] = str(out_dir / f"agent{k}.log")  # what that agent printed
        records[rec["node_rank"]] = rec
    return Rehearsal([records[k] for k in sorted(records)], here, layout.command(module, nproc))
