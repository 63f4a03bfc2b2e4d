"""The running job as an observer sees it, and the observers the launcher calls.

An observer is any object with some of ``on_start(job)``, ``on_tick(job)`` (every ~0.25 s,
from the launcher's own loop) and ``on_end(job, result)``: ``labkit.monitor``'s live plots,
``ProgressLines`` below, a test's recorder. They get a :class:`Job`, a live view of the job's
processes and heartbeats, and never the supervisor itself: what they may read is this class.
Kept apart from the supervisor (``labkit.jobs.supervisor``) so a plot can be written, typed
and tested without starting a job.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from labkit.jobs.nodes import Nodes, is_torchrun_agent, rank_range
from labkit.validate import shown


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
            for child in ranks_under(self.agent_pid):
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


def ranks_under(agent_pid: int) -> list[psutil.Process]:
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


def notify(observers: list[Any], method: str, *args: Any) -> None:
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

