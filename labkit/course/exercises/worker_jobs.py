"""Checks whose code runs on several ranks: their files, and what a broken check job means.

A notebook's ``%%writefile`` cells write to :func:`workspace`; a check job that failed or
hung is worded by :func:`explain_job_error`, from the ranks' own reports, their ledgers of
collectives (:func:`collective_ledger`, :func:`ranks_apart`) and their stack dumps. Apart
because it reads jobs (``labkit.jobs``), which the in-kernel checks never touch.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path
from typing import Any

from labkit.course.exercises.feedback import as_sentence
from labkit.course.exercises.learner_code import is_learners_file


def workspace(notebook: str) -> Path:
    """The folder a notebook's ``%%writefile`` cells write the learner's files to.

    ``labkit_home()/exercises/<notebook>`` (created if missing), outside the repository, so
    running the notebooks (in CI too) leaves no files beside them.
    """
    from labkit.jobs.procs import labkit_home  # the launcher's cache folder; loaded on first use

    path = labkit_home() / "exercises" / notebook
    path.mkdir(parents=True, exist_ok=True)
    return path


def explain_job_error(err: Exception, reports: dict[int, str]) -> str:
    """Word a worker check's job that did not finish (``launch.JobFailed``/``JobTimeout``).

    ``reports``: the messages of ranks whose own check found a mistake before the job broke
    (they are saved in the ranks' results). Such a report is the most telling thing there is
    ("it was never all-reduced"): it comes first, and the other rank's failure, usually a
    consequence (a collective the reporting rank never joined), follows in one line. A timeout
    says where each rank was stuck, from the ranks' own stack dumps.
    """
    from labkit.jobs import diagnosis, launch  # lazy: importing exercises stays cheap

    logs = f"Logs: {err.result.log_dir}" if isinstance(err, launch.JobError) else ""
    # A rank whose check saw its peer vanish reports a consequence, not the learner's mistake.
    telling = {r: m for r, m in reports.items() if not diagnosis.is_echo(m)}
    died = isinstance(err, launch.JobFailed) and err.kind in ("died", "left early")
    stuck = isinstance(err, launch.JobTimeout) and any("(torch)" not in w for w in err.where.values())
    # Ranks whose collectives went apart (one called a collective another never did) wait
    # until the process group's timeout and fail with echoes, or with gloo's complaint about
    # a message of another size: their ledgers name the call. Any other error is its own.
    own_error = (isinstance(err, launch.JobFailed) and err.kind == "raised"
                 and not _COMMUNICATION.search(f"{err.exc_type} {err.exc_message}"))  # fmt: skip
    apart = None
    if isinstance(err, launch.JobError) and not (died or stuck or own_error):
        apart = ranks_apart(err.result, reports)
    if apart is not None:
        return f"{apart} {logs}".strip()
    if telling and not died and not stuck:
        rank = min(telling)
        then = ""
        if isinstance(err, launch.JobFailed) and err.rank is not None and err.rank != rank:
            then = (f" Then rank {err.rank} failed, waiting in a collective that rank {rank} "
                    "never called: every rank must call the same collectives in the same order.")  # fmt: skip
        elif isinstance(err, launch.JobTimeout):
            then = " Then the other rank hung, waiting in a collective this rank never called."
        return f"{as_sentence(telling[rank])}{then} {logs}".strip()
    if isinstance(err, launch.JobTimeout):
        where = "; ".join(f"rank {r} was at {w}" for r, w in sorted(err.where.items()))
        waiting = [r for r, w in err.where.items() if "(torch)" in w]
        running = [r for r in err.where if r not in waiting]
        finished = [r for r, b in err.heartbeats.items() if b.get("phase") == "done"]
        if finished:
            where += ("; " if where else "") + f"rank {', '.join(map(str, finished))} had finished"
        if waiting and running:
            likely = (f"rank {', '.join(map(str, sorted(waiting)))} waited in a torch call (a "
                      f"collective?) that rank {', '.join(map(str, sorted(running)))} never "
                      "reached")  # fmt: skip
        elif running:
            likely = "your code never returned: a loop whose condition never changes?"
        else:
            likely = ("every rank waited in a collective: do they call the same collectives "
                      "in the same order?")  # fmt: skip
        reason = str(err).splitlines()[0].split(" ", 1)[-1].split(";")[0]  # "timed out after…"
        return (f"the check did not finish ({reason}): {as_sentence(likely)} "
                f"{as_sentence(where) + ' ' if where else ''}{logs}")  # fmt: skip
    if isinstance(err, launch.JobFailed):
        what = f"{err.exc_type}: {err.exc_message}" if err.exc_type else err.exc_message
        frame = _last_code_frame(err.traceback)
        on = f"on rank {err.rank}" if err.rank is not None else "before any rank ran"
        return f"the check job failed {on}: {as_sentence(what + frame)} {logs}"
    return f"{err}"


_COMMUNICATION = re.compile(r"gloo|NCCL|c10d|ProcessGroup|DistBackendError|DistNetworkError")
"""An error raised by the collectives' machinery, not by the check's or the learner's code."""

SAME_ORDER = ("Every rank must call the same collectives in the same order: a collective in a "
              "branch only some ranks take (under if rank == 0:, say) leaves the others "
              "waiting, or gloo pairs it with a different call of theirs.")
"""The rule a check whose ranks' collectives went apart ends with."""


def ranks_apart(result: Any, reports: dict[int, str]) -> str | None:
    """What a check job's ranks' ledgers of collectives (:func:`collective_ledger`) say when
    they differ, as one message; None when they agree or none was kept.

    ``result``: the job's ``launch.JobResult``; ``reports``: the ranks' own reports of what
    went wrong ({rank: message}). Where the ranks parted at a collective the learner's code
    called, that is the cause, and it comes alone (a rank's report of values that a mismatched
    collective gave is a consequence). Where they parted at the check's own collective, a
    rank's report of a mistake comes first: its check stopped there and never called it.
    """
    from labkit.jobs import diagnosis  # lazy: importing exercises stays cheap

    apart = diagnosis.collectives_apart(diagnosis.read_ledgers(result.log_dir, result.local_ranks))
    if apart is None:
        return None
    telling = {r: m for r, m in reports.items() if not diagnosis.is_echo(m)}
    own = "the check's own"
    if apart.instead is None and apart.other_end is None:  # the other rank never got there
        return _never_reached(apart, diagnosis.read_stacks(result.log_dir, result.local_ranks))
    if telling and not apart.yours:
        first = min(telling)
        return (f"{as_sentence(telling[first])} Then rank {apart.rank} waited in "
                f"{diagnosis.describe_call(apart.call, own)}, which rank {apart.other} never "
                f"called. {SAME_ORDER}")  # fmt: skip
    return f"the ranks' collectives went apart: {as_sentence(apart.describe(own))} {SAME_ORDER}"


def _never_reached(apart: Any, stacks: dict[int, str]) -> str:
    """A rank waited in a collective another rank was still on its way to when the wait
    timed out: where that rank was (its stack, dumped when the wait failed) is the cause."""
    from labkit.jobs import diagnosis

    call = diagnosis.describe_call(apart.call, "the check's own")
    where = stacks.get(apart.other)
    said = f"rank {apart.other} was at {where}" if where else (
        f"rank {apart.other} was still running code that calls none")  # fmt: skip
    loop = " A loop whose condition never changes?" if where and "(torch)" not in where else ""
    return (f"the check did not finish: rank {apart.rank} waited in {call}, which rank "
            f"{apart.other} never reached: {said}.{loop}")  # fmt: skip


def collective_ledger(ctx: Any) -> contextlib.AbstractContextManager[Any]:
    """In a check job's rank (``ctx``: its ``labkit.jobs.runtime.Context``): record the collectives the
    rank calls in the job folder while the block runs, for :func:`ranks_apart`. When one of
    them fails waiting, the other ranks are asked for their stacks first (their code may be
    in a loop that never reaches the collective)."""
    if ctx.job_dir is None:  # run without the launcher: nobody reads a ledger
        return contextlib.nullcontext()
    from labkit.jobs import diagnosis

    path = diagnosis.ledger_path(ctx.job_dir, ctx.rank)
    return diagnosis.CollectiveLedger(path, on_echo=lambda: _ask_peers_where(ctx)).recording()


def _ask_peers_where(ctx: Any) -> None:
    """Have this machine's other ranks of the job dump their stacks (``runtime.STACK_SIGNAL``)
    to the job folder, as the launcher does for a job that timed out."""
    import psutil

    from labkit.jobs import runtime

    for rank, beat in runtime.read_heartbeats(ctx.job_dir, range(ctx.world_size)).items():
        pid = beat.get("pid")
        if rank == ctx.rank or not isinstance(pid, int):
            continue
        # only a sibling under the same torchrun agent: never a recycled PID of another program
        with contextlib.suppress(psutil.Error, OSError):
            if psutil.Process(pid).ppid() == os.getppid():
                os.kill(pid, runtime.STACK_SIGNAL)
    time.sleep(STACK_WAIT_S)


STACK_WAIT_S = 0.3
"""How long a rank whose collective failed gives the others' stack dumps (faulthandler writes
them from the signal handler, at once) before it raises and the job ends them."""


def _last_code_frame(tb: str) -> str:
    """" (at file.py, line N: code)" for the innermost frame of a traceback outside labkit and
    the installed packages: the learner's line that raised."""
    frames = re.findall(r'  File "([^"]+)", line (\d+), in [^\n]*\n(?:    ([^\n]*)\n)?', tb + "\n")
    mine = [f for f in frames if is_learners_file(f[0])]
    if not mine:
        return ""
    path, line, code = mine[-1]
    return f" (at {Path(path).name}, line {line}: {code.strip()})"
