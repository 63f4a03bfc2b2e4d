"""Telling what went wrong in a job: which rank caused it, how it ended, who merely followed.

A multi-process job rarely fails alone. When one rank dies, its peers fail a moment later in
the collective they were waiting in ("Connection closed by peer"), and torchrun then ends the
rest with SIGTERM. Every rank's failure is real, but only one is the cause; the others are its
consequences. Blaming a consequence teaches the wrong lesson, so this module sorts the
evidence a job leaves behind:

- ``error.json`` per rank, written by torch's ``@record`` when a rank raises a Python
  exception (its type, message, traceback and time);
- torchrun's agent log (``agent.log`` in the job directory): each failed rank's exit code, and
  the processes the agent itself sent SIGTERM when the job was being shut down;
- labkit's heartbeats (``labkit.jobs.runtime``): the step and phase each rank was in, and whether it
  was waiting in a collective.

:func:`failure_report` ranks the failures (:data:`CAUSE_ORDER`) and words the root cause and
its consequences. The launcher (:mod:`labkit.jobs.launch`) turns it into ``JobFailed``.

What the report draws on lives in modules of its own, each re-exported here under the name
notebooks and tests use (``diagnosis.is_echo``, ``diagnosis.CollectiveLedger``...):

- :mod:`labkit.jobs.diagnosis.evidence`: each rank's log, and which messages are echoes (:func:`is_echo`);
- :mod:`labkit.jobs.diagnosis.tracebacks`: a traceback or a stderr shortened (:func:`traceback_excerpt`),
  a stack dump read (:func:`where_stuck`);
- :mod:`labkit.jobs.diagnosis.hangs`: the rank holding a stalled job up (:func:`diagnose_hang`);
- :mod:`labkit.jobs.diagnosis.fingerprints`: ``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s mismatch report read
  (:func:`collective_mismatch`);
- :mod:`labkit.jobs.diagnosis.collective_ledger`: each rank's ledger of collectives
  (:class:`CollectiveLedger`) and the collective one rank called and another never did
  (:func:`collectives_apart`).
"""

from __future__ import annotations

import contextlib
import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from labkit.jobs import runtime
from labkit.jobs.diagnosis.collective_ledger import LEDGER_COLLECTIVES as LEDGER_COLLECTIVES
from labkit.jobs.diagnosis.collective_ledger import LEDGER_DIR as LEDGER_DIR
from labkit.jobs.diagnosis.collective_ledger import CollectiveLedger as CollectiveLedger
from labkit.jobs.diagnosis.collective_ledger import CollectivesApart as CollectivesApart
from labkit.jobs.diagnosis.collective_ledger import RankLedger as RankLedger
from labkit.jobs.diagnosis.collective_ledger import collectives_apart as collectives_apart
from labkit.jobs.diagnosis.collective_ledger import describe_call as describe_call
from labkit.jobs.diagnosis.collective_ledger import ledger_path as ledger_path
from labkit.jobs.diagnosis.collective_ledger import read_ledgers as read_ledgers
from labkit.jobs.diagnosis.evidence import is_echo as is_echo
from labkit.jobs.diagnosis.evidence import is_peer_gone as is_peer_gone
from labkit.jobs.diagnosis.evidence import is_wait_timeout, rank_list, tail
from labkit.jobs.diagnosis.evidence import rank_log_path as rank_log_path
from labkit.jobs.diagnosis.fingerprints import CollectiveMismatch as CollectiveMismatch
from labkit.jobs.diagnosis.fingerprints import Fingerprint as Fingerprint
from labkit.jobs.diagnosis.fingerprints import collective_mismatch as collective_mismatch
from labkit.jobs.diagnosis.fingerprints import odd_ones_out as odd_ones_out
from labkit.jobs.diagnosis.hangs import at_step
from labkit.jobs.diagnosis.hangs import desync_line as desync_line
from labkit.jobs.diagnosis.hangs import diagnose_hang as diagnose_hang
from labkit.jobs.diagnosis.hangs import read_stacks as read_stacks
from labkit.jobs.diagnosis.hangs import waiting_apart as waiting_apart
from labkit.jobs.diagnosis.tracebacks import EXCERPT_TAIL as EXCERPT_TAIL
from labkit.jobs.diagnosis.tracebacks import one_line
from labkit.jobs.diagnosis.tracebacks import stderr_excerpt as stderr_excerpt
from labkit.jobs.diagnosis.tracebacks import traceback_excerpt as traceback_excerpt
from labkit.jobs.diagnosis.tracebacks import where_stuck as where_stuck

# --- the evidence ------------------------------------------------------------------------------

# torchrun's agent, when a worker fails (torch/distributed/elastic/multiprocessing/api.py and
# errors/__init__.py): one "failed (exitcode: ...)" line for the first failure it sees, a
# "Sending process PID closing signal SIGTERM" line per worker it stops, and the
# ChildFailedError summary with one "rank/exitcode (pid)" entry per failed rank.
_AGENT_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_AGENT_STOPS = re.compile(r"Sending process (\d+) closing signal (SIG\w+)")
_SUMMARY_ENTRY = re.compile(
    r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)"
)

_OUT_OF_MEMORY = re.compile(
    r"out of memory|can't allocate memory|Cannot allocate memory|MemoryError|OutOfMemoryError",
    re.IGNORECASE,
)


@dataclass
class RankEnd:
    """How one rank of a failed job ended, as far as the evidence tells.

    Attributes:
        rank: the rank.
        exitcode: its exit status from torchrun's report (negative: killed by that signal);
            None if torchrun did not report it (it exited cleanly, or the agent died first).
        pid: its process ID, where known.
        exc_type, exc_message, traceback: its Python exception, from ``error.json``.
        raised_at: when it raised (``time.time()``), from ``error.json``.
        heartbeat: its last labkit heartbeat ({} if none).
        stopped_by_agent: it died of a signal torchrun sent it while shutting the job down.
    """

    rank: int
    exitcode: int | None = None
    pid: int | None = None
    exc_type: str = ""
    exc_message: str = ""
    traceback: str = ""
    raised_at: float | None = None
    heartbeat: dict = field(default_factory=dict)
    stopped_by_agent: bool = False
    stderr: str = ""  # what it wrote last to stderr (where no error.json tells more)
    exit_known: bool = False  # torchrun's list of failures was read: absent from it means 0
    ended_unreported: bool = False  # gone before torchrun stopped the rest, which never reported

    @property
    def raised(self) -> bool:
        return bool(self.exc_type or self.exc_message)

    @property
    def in_collective(self) -> bool:
        return bool(self.heartbeat.get("in_collective"))

    @property
    def signal_name(self) -> str | None:
        """"SIGKILL" for a rank killed by a signal, else None."""
        if self.exitcode is None or self.exitcode >= 0:
            return None
        return signal_name(self.exitcode)

    @property
    def kind(self) -> str:
        """What the evidence says, most telling first (see :data:`CAUSE_ORDER`)."""
        if self.raised:
            if is_peer_gone(self.exc_message):
                return "peer gone"
            return "waited" if is_wait_timeout(self.exc_message) else "raised"
        if self.exitcode not in (None, 0):
            if not self.stopped_by_agent and is_wait_timeout(self.stderr):
                # NCCL's watchdog ends a rank whose collective timed out (SIGABRT, no Python
                # exception; TORCH_NCCL_ASYNC_ERROR_HANDLING=3): it waited for another rank.
                return "waited"
            return "stopped" if self.stopped_by_agent else "died"
        if self.ended_unreported:
            return "died"
        if (self.exitcode is None and self.exit_known and self.heartbeat
                and self.heartbeat.get("phase") != "done"):  # fmt: skip
            # Not in torchrun's list of failures, so it exited with status 0: before finishing.
            return "left early"
        return "unknown"

    @property
    def echo(self) -> bool:
        """Its failure followed from another rank's (see :data:`ECHOES`)."""
        return self.kind in ECHOES


CAUSE_ORDER = ("raised", "died", "left early", "waited", "peer gone", "stopped", "unknown")
"""How likely each kind of ending is to be the root cause, most likely first.

A Python exception is the rank's own failure. A rank that died without one (an exit code, a
signal: the out-of-memory killer) comes next: nobody else makes a process exit; and so does a
rank that exited cleanly before it had finished (``sys.exit(0)`` in the middle of the work).
The rest are echoes: a collective that timed out waiting for a peer stuck elsewhere,
"Connection closed by peer" and its kin, a rank torchrun stopped during shutdown."""

ECHOES = ("waited", "peer gone", "stopped")


def signal_name(exitcode: int) -> str:
    """"SIGKILL" for an exit status of -9 (torchrun's convention for a killed process)."""
    with contextlib.suppress(ValueError):
        return signal.Signals(-exitcode).name
    return f"signal {-exitcode}"


def read_rank_ends(
    job_dir: Path, nproc: int | Sequence[int], agent_log: str | None = None
) -> dict[int, RankEnd]:
    """Every rank's ending, from the job directory's ``error.json`` files, torchrun's agent log
    (``agent_log``, the text, if the launcher kept it; else ``agent.log``) and the heartbeats."""
    job_dir = Path(job_dir)
    ranks = rank_list(nproc)
    beats = runtime.read_heartbeats(job_dir, ranks)
    ends = {r: RankEnd(r, heartbeat=beats.get(r, {})) for r in ranks}
    if agent_log is None:
        try:
            agent_log = (job_dir / "agent.log").read_text(errors="replace")
        except OSError:
            agent_log = ""
    sent: dict[int, set[str]] = {}  # pid -> the signals torchrun sent it while shutting down
    for pid, sig in _AGENT_STOPS.findall(agent_log):
        sent.setdefault(int(pid), set()).add(sig)
    reports = _SUMMARY_ENTRY.findall(agent_log) + [
        (rank, code, pid) for code, rank, pid in _AGENT_FAILED.findall(agent_log)
    ]
    for end in ends.values():  # torchrun listed the failures: a rank not among them exited 0
        end.exit_known = bool(reports)
    if not reports and sent:
        _infer_without_report(ends, sent)
    for rank, code, pid in reports:
        end = ends.get(int(rank))
        if end is not None:
            end.exitcode, end.pid = int(code), int(pid)
            # Stopped by torchrun only if it died of the very signal torchrun sent: a rank the
            # OOM killer ended (SIGKILL) may also have been sent SIGTERM, too late.
            end.stopped_by_agent = end.signal_name in sent.get(int(pid), set())
    for r, end in ends.items():
        if end.pid is None and isinstance(end.heartbeat.get("pid"), int):
            end.pid = end.heartbeat["pid"]
        for path in sorted(job_dir.glob(f"torchrun/*/attempt_*/{r}/error.json")):
            err = (runtime.read_json(path) or {}).get("message", {})
            if isinstance(err, str):  # older torch wrote a plain string
                err = {"message": err, "extraInfo": {}}
            if not isinstance(err, dict):
                continue
            text = str(err.get("message", ""))
            exc_type, _, exc_msg = text.partition(": ")
            if not re.fullmatch(r"[\w.]+", exc_type):
                exc_type, exc_msg = "", text
            extra = err.get("extraInfo") or {}
            end.exc_type, end.exc_message = exc_type, exc_msg or text
            end.traceback = str(extra.get("py_callstack", ""))
            try:
                end.raised_at = float(extra.get("timestamp"))
            except (TypeError, ValueError):
                end.raised_at = path.stat().st_mtime
        if not end.raised and end.exitcode not in (None, 0):
            log = rank_log_path(job_dir, r, "stderr")
            end.stderr = tail(log, 200)
            _read_uncaught(end)
    return ends


def _infer_without_report(ends: dict[int, RankEnd], sent: dict[int, set[str]]) -> None:
    """torchrun stopped some ranks but never listed the failures: its agent died first.

    Seen when a rank that the agent had just sent SIGTERM was still writing its error.json:
    the agent read the half-written file, failed to parse it and exited ("Failed to parse
    reply file"). The ranks it sent a closing signal to were stopped by it; a rank it did not
    signal, and that had not finished, was already gone: the one whose end set the shutdown
    off.
    """
    for end in ends.values():
        pid = end.heartbeat.get("pid")
        if pid in sent:
            end.pid, end.stopped_by_agent = pid, True
            end.exitcode = -int(signal.Signals[sorted(sent[pid])[0]])
        elif end.heartbeat and end.heartbeat.get("phase") != "done":
            end.ended_unreported = True


_EXCEPTION_LINE = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)?): ?(?P<msg>.*)$")


def _read_uncaught(end: RankEnd) -> None:
    """A rank that raised where torch's ``@record`` could not see it (while its module was
    imported, or ``sys.exit`` with a message) leaves the traceback in its stderr: read it."""
    beat_exit = end.heartbeat.get("exit")
    if isinstance(beat_exit, dict):  # labkit.jobs.runtime saw sys.exit(...) and said where
        end.exc_type = "SystemExit"
        end.exc_message = f"sys.exit({beat_exit.get('code')}) called at {beat_exit.get('where')}"
        return
    text = end.stderr.rstrip()
    start = text.rfind("Traceback (most recent call last):")
    if start < 0:
        return
    block = text[start:].splitlines()
    last = block[-1] if block else ""
    m = _EXCEPTION_LINE.match(last)
    if m and not last.startswith(" "):
        end.exc_type, end.exc_message = m["type"], m["msg"]
        end.traceback = "\n".join(block)


def root_cause(ends: dict[int, RankEnd]) -> RankEnd | None:
    """The rank whose ending most likely caused the others (:data:`CAUSE_ORDER`; among equals,
    the one that raised first, then the lowest rank). None if no rank failed."""
    failed = [e for e in ends.values() if e.kind != "unknown"]
    if not failed:
        return None

    def order(e: RankEnd) -> tuple[int, float, int]:
        return CAUSE_ORDER.index(e.kind), e.raised_at or float("inf"), e.rank

    return min(failed, key=order)


# --- wording -----------------------------------------------------------------------------------

# What a signal usually means when it ends a training process, for the learner who sees it.
_SIGNAL_MEANING = {
    "SIGKILL": "on Linux that is most often the out-of-memory killer; `dmesg` says so if it was "
    "('Out of memory: Killed process <pid>'): then make the batch, the sequence or the model "
    "smaller, or run fewer ranks",
    "SIGSEGV": "a segmentation fault in native code (torch, a C extension or a driver); its "
    "stderr log may show where",
    "SIGABRT": "native code called abort(), usually a failed C++ check; its stderr log says which",
    "SIGBUS": "a bad memory access; in PyTorch jobs most often a full /dev/shm (shared memory "
    "for tensors passed between processes)",
    "SIGTERM": "something outside the job asked it to stop (another program, a user, a "
    "scheduler's time limit)",
    "SIGINT": "an interrupt (Ctrl-C) reached it",
}


def how_it_ended(end: RankEnd) -> str:
    """"was killed by SIGKILL: on Linux ..." / "exited with code 3 without a Python exception"."""
    if end.kind == "left early":
        beat = end.heartbeat
        if isinstance(beat.get("exit"), dict):
            return (f"called sys.exit({beat['exit'].get('code')}) at {beat['exit'].get('where')} "
                    "before it had finished")  # fmt: skip
        return (
            f"exited with status 0 before it had finished (last seen {at_step(beat)} in phase "
            f"'{beat.get('phase')}'): sys.exit(0) or os._exit(0) in the middle of its work?"
        )
    if end.ended_unreported:
        return (f"ended before torchrun stopped the other ranks (last seen {at_step(end.heartbeat)} "
                f"in phase '{end.heartbeat.get('phase')}'); torchrun's agent failed before it "
                "reported the exit status, so how it ended is not known: its stderr log may say")
    sig = end.signal_name
    if sig is not None:
        meaning = _SIGNAL_MEANING.get(sig)
        return f"was killed by {sig}" + (f": {meaning}" if meaning else "")
    return (
        f"exited with code {end.exitcode} without raising an exception (sys.exit, os._exit, or "
        "an exit from native code)"
    )


# gloo and c10d put their C++ source location first: "[/path/pair.cc:553] Connection closed..."
_SOURCE_LOCATION = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


def _other_failure(end: RankEnd, cause: RankEnd) -> str:
    if end.kind == "stopped":
        return f"rank {end.rank}: stopped by torchrun ({end.signal_name}) once rank {cause.rank} had failed"
    where = f" in collective '{end.heartbeat.get('phase')}'" if end.in_collective else ""
    if end.raised:
        text = _SOURCE_LOCATION.sub("", end.exc_message)
        what = one_line(f"{end.exc_type}: {text}" if end.exc_type else text)
        why = {"peer gone": f" because rank {cause.rank} was gone",
               "waited": f" waiting for rank {cause.rank}"}.get(end.kind, "")  # fmt: skip
        return f"rank {end.rank}: failed{where}{why} ({what})"
    return f"rank {end.rank}: {how_it_ended(end)}"


@dataclass
class FailureReport:
    """The root cause of a failed job and what followed from it, worded for the learner."""

    rank: int | None
    headline: str  # "failed on rank 1: ..." (the job's module is prefixed by the launcher)
    lines: list[str]  # the rest of the message
    cause: RankEnd | None
    hung_ranks: list[int]
    consequences: list[RankEnd] = field(default_factory=list)


def failure_report(
    job_dir: Path, nproc: int | Sequence[int], returncode: int | None, agent_log: str | None = None
) -> FailureReport:
    """Find and word a failed job's root cause, its consequences and its evidence."""
    ends = read_rank_ends(job_dir, nproc, agent_log)
    cause = root_cause(ends)
    if cause is None:
        return _agent_failure(Path(job_dir), returncode, agent_log)
    lines: list[str] = []
    if cause.raised:
        what = f"{cause.exc_type}: {cause.exc_message}" if cause.exc_type else cause.exc_message
        if "No space left on device" in what or "Disk quota exceeded" in what:
            lines.append(
                f"rank {cause.rank} found the disk full: free space there, delete old job "
                "folders with `python -m labkit cleanup --runs 0`, or point LABKIT_HOME at "
                "another disk"
            )
        if _OUT_OF_MEMORY.search(what):
            lines.append(
                f"rank {cause.rank} ran out of memory: make the batch, the sequence or the model "
                "smaller, or use fewer ranks on this machine"
            )
    else:
        what = f"the process {how_it_ended(cause)}"
    mismatch = collective_mismatch(cause.exc_message) if cause.raised else None
    if mismatch is not None:  # DETAIL's message is one 700-character line: say it short
        what = f"collectives do not match across ranks (TORCH_DISTRIBUTED_DEBUG=DETAIL): {mismatch}"
        others = [m for e in ends.values() if (m := collective_mismatch(e.exc_message))]
        odd = odd_ones_out([f for m in others for f in (m.this, m.other)], len(ends))
        lines.append(
            f"the odd one out: rank {', '.join(map(str, odd))}" if odd else
            f"with {len(ends)} ranks the check cannot tell which rank is wrong (no majority): "
            "compare each with the collective your code should issue there"
        )  # fmt: skip
    headline = f"failed on rank {cause.rank}: {what}"

    hung: list[int] = []
    if cause.kind in ("waited", "peer gone"):
        # It failed waiting for a peer that never came (a process-group timeout, say): the rank
        # that kept it waiting, outside any collective, is the real suspect.
        beats = {r: e.heartbeat for r, e in ends.items() if e.heartbeat}
        hung = [r for r in diagnose_hang(beats, list(ends))[0] if r != cause.rank]
        if hung:
            lines.append(
                f"rank {cause.rank} failed waiting in collective "
                f"'{cause.heartbeat.get('phase')}'; likely hung: rank "
                f"{', '.join(map(str, hung))} (not in a collective)"
            )
        elif apart := waiting_apart(beats):
            lines.append(desync_line(apart))
    log = rank_log_path(job_dir, cause.rank, "stderr")
    if cause.traceback:
        lines.append("  " + "\n  ".join(traceback_excerpt(cause.traceback).splitlines()))
    elif not cause.raised and (said := stderr_excerpt(cause.stderr or tail(log, 200))):
        lines.append(f"what rank {cause.rank} wrote to stderr last:")
        lines.append("  " + "\n  ".join(said.splitlines()))
    if log is not None:
        lines.append(f"full {'traceback' if cause.raised else 'stderr'}: {log}")
    failed = sorted((e for e in ends.values() if e is not cause and e.kind != "unknown"),
                    key=lambda e: e.rank)  # fmt: skip
    echoes = [e for e in failed if e.echo]
    independent = [e for e in failed if not e.echo]
    if independent:  # their own failures, not echoes of this one's
        lines.append("other ranks that failed on their own:")
        lines += [f"  {_other_failure(e, cause)}" for e in independent]
    if echoes:
        lines.append(f"what followed from rank {cause.rank}'s failure:")
        lines += [f"  {_other_failure(e, cause)}" for e in echoes]
    return FailureReport(cause.rank, headline, lines, cause, hung, echoes)


def agent_excerpt(job_dir: Path, agent_log: str | None = None) -> str:
    """The telling lines of torchrun's agent log (``agent_log``, else the job's agent.log): its
    banner left out, a traceback shortened."""
    if agent_log is None:
        try:
            agent_log = (Path(job_dir) / "agent.log").read_text(errors="replace")
        except OSError:
            return ""
    banner = ("*****", "Setting OMP_NUM_THREADS")  # torchrun's standard chatter
    kept = [s for s in agent_log.strip().splitlines() if not s.startswith(banner)]
    return traceback_excerpt("\n".join(kept)) if kept else ""


def _agent_failure(
    job_dir: Path, returncode: int | None, agent_log: str | None = None
) -> FailureReport:
    """No rank failed: torchrun's agent itself did (a bad port, a rendezvous error)."""
    how = (
        f"was killed by {signal_name(returncode)}"
        if returncode is not None and returncode < 0
        else f"exited with code {returncode}"
    )
    excerpt = agent_excerpt(job_dir, agent_log)
    lines = ["  " + "\n  ".join(excerpt.splitlines())] if excerpt else []
    return FailureReport(
        None, f"the torchrun agent {how} before any rank reported an error", lines, None, []
    )

