"""What a job leaves behind: its results (``JobResult``), or the error that says why not.

``launch.run`` returns a :class:`JobResult` or raises one of the errors here; a caller catches
them from ``labkit.jobs.launch``, which re-exports them. The functions at the end word the
errors for a job that failed or ran out of time, from ``labkit.jobs.diagnosis``'s reading of
its folder: which rank caused it, and what the others did meanwhile. Kept apart from the
supervisor that watches a job, so that a result or an error can be built and read (in tests,
in the course's checks) without one.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.errors import LabkitError
from labkit.jobs import diagnosis
from labkit.jobs.diagnosis import rank_log_path
from labkit.jobs.nodes import Nodes, rank_range
from labkit.jobs.observers import Job
from labkit.tables import html_table

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
        table = html_table(
            ["rank", *cols], [[r, *(_fmt(res.get(c)) for c in cols)] for r, res in self._rows()]
        )
        shared = ", ".join(f"{esc(k)}={esc(_fmt(v))}" for k, v in common.items())
        return (
            f"<div><b>{esc(self.module)}</b> {esc(self._summary().split(': ', 1)[1])}"
            + (f"<br>all ranks: {shared}" if shared else "")
            + f"{table}</div>"
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


# Callers catch these from labkit.jobs.launch, their public home (and theirs before this module
# existed): a traceback names them so, whichever module was imported first.
for _error in (LaunchError, JobError, JobFailed, JobTimeout):
    _error.__module__ = "labkit.jobs.launch"


# --- telling what went wrong (the wording lives in labkit.jobs.diagnosis) -------------------------


def timeout_error(
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
    hung, lines = diagnosis.diagnose_hang(beats, ours, now=job.checked_at, where=where)
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


def failure_error(job: Job, result: JobResult, agent_log: str | None = None) -> JobFailed:
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


def no_worker_error(job: Job, result: JobResult, missing: list[int]) -> JobFailed:
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

