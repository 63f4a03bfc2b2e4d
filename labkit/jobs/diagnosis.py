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
its consequences; :func:`diagnose_hang` names the rank holding up a stalled job;
:func:`collectives_apart` compares the ranks' ledgers of collectives (kept by a worker with
:class:`CollectiveLedger`) and names the collective one rank called and another never did;
:func:`traceback_excerpt` keeps the lines of a traceback that matter. The launcher
(:mod:`labkit.jobs.launch`) turns these into ``JobFailed`` and ``JobTimeout``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import linecache
import os
import re
import signal
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from labkit.jobs import runtime

# --- the evidence ------------------------------------------------------------------------------


def rank_log_path(job_dir: Path, rank: int, stream: str = "stdout") -> Path | None:
    """Rank ``rank``'s log file written by torchrun (``--log-dir``), or None."""
    if stream not in ("stdout", "stderr"):
        raise ValueError(f"stream={stream!r}: use 'stdout' or 'stderr'")
    found = sorted(Path(job_dir).glob(f"torchrun/*/attempt_*/{rank}/{stream}.log"))
    return found[-1] if found else None


def _tail(path: Path | None, n: int) -> str:
    if path is None:
        return ""
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").rstrip().splitlines()[-n:])
    return ""


# torchrun's agent, when a worker fails (torch/distributed/elastic/multiprocessing/api.py and
# errors/__init__.py): one "failed (exitcode: ...)" line for the first failure it sees, a
# "Sending process PID closing signal SIGTERM" line per worker it stops, and the
# ChildFailedError summary with one "rank/exitcode (pid)" entry per failed rank.
_AGENT_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_AGENT_STOPS = re.compile(r"Sending process (\d+) closing signal (SIG\w+)")
_SUMMARY_ENTRY = re.compile(
    r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)"
)
# A rank that saw its peer vanish fails with one of these (gloo's TCP transport, NCCL's
# "remote process exited", a closed TCPStore socket). Its failure is a consequence.
_PEER_GONE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited"
    r"|failed to recv, got 0 bytes|Socket closed|peer .* (?:died|crashed)",
    re.IGNORECASE,
)


def is_peer_gone(text: str) -> bool:
    """Whether an error message says a peer rank vanished ("Connection closed by peer"...):
    the failure of a rank that was waiting for another, not its own."""
    return bool(_PEER_GONE.search(text))


# A rank whose collective timed out waited for a peer that never came (gloo's "Timed out
# waiting ... for recv", NCCL's watchdog): usually the echo of a peer stuck elsewhere.
# TORCH_DISTRIBUTED_DEBUG=DETAIL runs a monitored barrier before each collective: a rank that
# never arrives is named there ("[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 3000 ms").
# gloo closes a pair when the peer's own wait timed out first: this side then reads
# "Application timeout caused pair closure" (gloo/transport/tcp/pair.cc), as much an echo.
_WAIT_TIMEOUT = re.compile(
    r"Timed out waiting|Watchdog caught collective operation timeout|Socket Timeout"
    r"|failed to pass monitoredBarrier|Application timeout caused pair closure",
    re.IGNORECASE,
)


def is_echo(text: str) -> bool:
    """Whether an error message is the echo of another rank's trouble: its peer vanished, or a
    collective timed out waiting for a peer."""
    return is_peer_gone(text) or bool(_WAIT_TIMEOUT.search(text))


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
            return "waited" if _WAIT_TIMEOUT.search(self.exc_message) else "raised"
        if self.exitcode not in (None, 0):
            if not self.stopped_by_agent and _WAIT_TIMEOUT.search(self.stderr):
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


def _rank_list(ranks: int | Sequence[int]) -> list[int]:
    """Ranks given as a count n (ranks 0..n-1, one machine) or as the ranks a node holds."""
    return list(range(ranks)) if isinstance(ranks, int) else list(ranks)


def read_rank_ends(
    job_dir: Path, nproc: int | Sequence[int], agent_log: str | None = None
) -> dict[int, RankEnd]:
    """Every rank's ending, from the job directory's ``error.json`` files, torchrun's agent log
    (``agent_log``, the text, if the launcher kept it; else ``agent.log``) and the heartbeats."""
    job_dir = Path(job_dir)
    ranks = _rank_list(nproc)
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
            end.stderr = _tail(log, 200)
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


# --- wording ----------------------------------------------------------------------------------

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
            f"exited with status 0 before it had finished (last seen {_where(beat)} in phase "
            f"'{beat.get('phase')}'): sys.exit(0) or os._exit(0) in the middle of its work?"
        )
    if end.ended_unreported:
        return (f"ended before torchrun stopped the other ranks (last seen {_where(end.heartbeat)} "
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


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


# gloo and c10d put their C++ source location first: "[/path/pair.cc:553] Connection closed..."
_SOURCE_LOCATION = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


def _other_failure(end: RankEnd, cause: RankEnd) -> str:
    if end.kind == "stopped":
        return f"rank {end.rank}: stopped by torchrun ({end.signal_name}) once rank {cause.rank} had failed"
    where = f" in collective '{end.heartbeat.get('phase')}'" if end.in_collective else ""
    if end.raised:
        text = _SOURCE_LOCATION.sub("", end.exc_message)
        what = _one_line(f"{end.exc_type}: {text}" if end.exc_type else text)
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
    elif not cause.raised and (said := stderr_excerpt(cause.stderr or _tail(log, 200))):
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


def stderr_excerpt(text: str) -> str:
    """The telling part of a rank's stderr when it died without a Python exception.

    Native code that aborts (a failed gloo check, a segfault) prints its message, then Python's
    faulthandler dumps every thread and lists the extension modules: the message is what
    matters, and of the dump, the line of code the rank was on. Otherwise, the last lines.
    """
    lines = text.rstrip().splitlines()
    fatal = next((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")), None)
    if fatal is None:
        return "\n".join(lines[-EXCERPT_TAIL:])
    said = [line for line in lines[max(fatal - EXCERPT_TAIL, 0) : fatal + 1] if line.strip()]
    where = where_stuck("\n".join(lines[fatal:]))
    return "\n".join([*said, *([f"it was at {where}"] if where else [])])


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


# --- collectives that do not match across ranks ------------------------------------------------

# TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the process group (c10d's ProcessGroupWrapper, torch/csrc/
# distributed/c10d/ProcessGroupWrapper.cpp): before each collective the ranks all-gather its
# fingerprint and each raises "Detected mismatch between collectives on ranks. Rank 0 is running
# collective: CollectiveFingerPrint(SequenceNumber=2, OpType=ALLREDUCE, TensorShape=[1024],
# TensorDtypes=Float, TensorDeviceTypes=...), but Rank 1 is running collective: ...
# .Collectives differ in the following aspects: ..." (the wording of torch 2.13). A collective
# without tensors (a barrier) prints "SequenceNumber=2OpType=BARRIER".
_FINGERPRINT = re.compile(
    r"Rank (?P<rank>\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(?P<seq>\d+),?"
    r" ?OpType=(?P<op>\w+)(?:, TensorShape=\[(?P<shape>[^\]]*)\], TensorDtypes=(?P<dtypes>.*?), "
    r"TensorDeviceTypes=(?P<devices>.*?device=(?P<device>\w+))?)?"
)
_ASPECTS = {"Sequence number": "sequence number", "Op type": "op type",
            "Tensor shapes": "tensor shapes", "Tensor dtypes": "dtypes",
            "Tensor devices": "devices"}  # fmt: skip


@dataclass(frozen=True)
class Fingerprint:
    """What one rank was about to run, as DETAIL's check printed it: the collective (``op``, in
    c10d's names: ALLREDUCE, ALLGATHER, BROADCAST, BARRIER...), its sequence number in that
    rank's group (``seq``, from 0: the third collective is 2), the first input tensor's shape
    (None: a collective without tensors), the input dtypes and the device type."""

    rank: int
    seq: int
    op: str
    shape: tuple[int, ...] | None = None
    dtypes: str = ""
    device: str = ""

    @property
    def key(self) -> tuple:
        """What must agree across ranks for the collective to run."""
        return self.op, self.shape, self.dtypes, self.device

    def __str__(self) -> str:
        if self.shape is None:
            return f"rank {self.rank} ran {self.op}"
        shape = ", ".join(map(str, self.shape))
        return f"rank {self.rank} ran {self.op} [{shape}] {self.dtypes}".rstrip()


@dataclass(frozen=True)
class CollectiveMismatch:
    """DETAIL's mismatch report from one rank: its own fingerprint (``this``), the first other
    rank's that differs (``other``), and the aspects torch says differ."""

    this: Fingerprint
    other: Fingerprint
    aspects: tuple[str, ...]

    def __str__(self) -> str:
        # c10d's sequence number counts a group's collectives from 0
        seq = (f"sequence number {self.this.seq} on both" if self.this.seq == self.other.seq else
               f"sequence numbers {self.this.seq} and {self.other.seq}")  # fmt: skip
        differ = " and ".join(self.aspects) or "an aspect torch did not name"
        return f"{self.this}, {self.other} ({seq}): they differ in {differ}"


def collective_mismatch(text: str) -> CollectiveMismatch | None:
    """The mismatch ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` reported in ``text`` (an exception
    message, a rank's log), or None if there is none."""
    start = text.find("Detected mismatch between collectives on ranks")
    if start < 0:
        return None
    found = []
    for m in _FINGERPRINT.finditer(text, start):
        shape = m["shape"]
        found.append(Fingerprint(
            int(m["rank"]), int(m["seq"]), m["op"],
            None if shape is None else tuple(int(s) for s in shape.split(",") if s.strip()),
            (m["dtypes"] or "").strip(), m["device"] or "",
        ))  # fmt: skip
        if len(found) == 2:
            break
    if len(found) < 2:
        return None
    _, _, tail = text[start:].partition("differ in the following aspects:")
    aspects = tuple(name for key, name in _ASPECTS.items() if key in tail)
    return CollectiveMismatch(found[0], found[1], aspects)


def odd_ones_out(prints: Sequence[Fingerprint], nproc: int) -> list[int]:
    """The ranks whose collective differs from what a strict majority of all ``nproc`` ranks
    run, from the fingerprints seen (several reports may name the same rank); [] when no
    majority is known (two ranks that disagree: either may be the wrong one)."""
    by_rank = {f.rank: f.key for f in prints}
    counts: dict[tuple, int] = {}
    for key in by_rank.values():
        counts[key] = counts.get(key, 0) + 1
    if not counts:
        return []
    key, n = max(counts.items(), key=lambda kv: kv[1])
    if 2 * n <= nproc:
        return []
    return sorted(r for r, k in by_rank.items() if k != key)


def waiting_apart(heartbeats: dict[int, dict]) -> dict[int, dict]:
    """{rank: heartbeat} when every unfinished rank waits in a collective, not all in the same
    one (by phase name and step): the ranks' sequences of collectives no longer match. Else {}."""
    active = {r: b for r, b in heartbeats.items() if b.get("phase") != "done"}
    if len(active) < 2 or not all(b.get("in_collective") for b in active.values()):
        return {}
    where = {(b.get("phase"), b.get("step")) for b in active.values()}
    return dict(sorted(active.items())) if len(where) > 1 else {}


def desync_line(apart: dict[int, dict]) -> str:
    """One line for ranks :func:`waiting_apart`."""
    each = ", ".join(f"rank {r} in '{b.get('phase')}' {_where(b)}" for r, b in apart.items())
    return (f"the ranks were waiting in different collectives ({each}): their sequences of "
            "collectives no longer match (a desync: a rank skipped or added one). Run again with "
            "TORCH_DISTRIBUTED_DEBUG=DETAIL to have each collective compared across ranks")  # fmt: skip


# --- the collectives each rank called ----------------------------------------------------------

# Every rank must call the same collectives in the same order. When one does not (a collective
# under `if rank == 0:`), gloo pairs the lone call with whatever the other rank calls next, or
# waits until the process group's timeout; then every rank's error is an echo ("Timed out
# waiting", "Connection closed by peer", "Application timeout caused pair closure") that names
# neither the collective nor the rank that skipped it. A ledger that each rank keeps, one JSON
# line per collective written as it is called (so a rank killed later still leaves it), says
# both: compared across ranks, the first entry where two ranks differ is the call one of them
# never made.

LEDGER_DIR = "collectives"
"""The folder of a job's ledgers: ``<job_dir>/collectives/rank<r>.jsonl``."""

LEDGER_COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter",
    "barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list",
    "gather_object", "scatter_object_list",
)  # fmt: skip
"""What a ledger records, by its name in ``torch.distributed``: calls every rank of the group
makes. Point-to-point ``send``/``recv`` pair two ranks, each its own way, and are left out."""


def ledger_path(job_dir: Path, rank: int) -> Path:
    """Rank ``rank``'s ledger of collectives in the job folder ``job_dir``."""
    return Path(job_dir) / LEDGER_DIR / f"rank{rank}.jsonl"


class CollectiveLedger:
    """Records, while :meth:`recording`, every collective this process calls through
    ``torch.distributed`` (:data:`LEDGER_COLLECTIVES`): its name, its number in this rank's
    sequence, the process group's ranks (when not the default group) and where it was called.

    "Where" is the innermost frame of code outside labkit and the installed packages (the
    worker's or a learner's file: ``"yours": true``), else the innermost of labkit's own. A
    collective that calls another (``all_gather_object`` calls ``all_gather``) is one entry.
    The block's end is the last line: ``{"end": "returned"}`` or ``{"end": "raised", ...}``.

    ``on_echo()``, if given, is called once, when a recorded collective first fails with an
    echo (:func:`is_echo`: it timed out waiting, its peer went): the moment to ask the other
    ranks where they are, before the job ends them.
    """

    def __init__(self, path: Path, on_echo: Callable[[], None] | None = None) -> None:
        self.path = Path(path)
        self.count = 0
        self._depth = 0
        self._file: TextIO | None = None
        self._on_echo = on_echo

    @contextlib.contextmanager
    def recording(self) -> Iterator[CollectiveLedger]:
        import torch.distributed as tdist
        import torch.distributed.distributed_c10d as c10d

        # labkit's own calls go through torch.distributed; c10d's own (all_gather_object's
        # all_gather) through its module globals: both are wrapped, the inner call not counted.
        saved = [(module, name, getattr(module, name)) for module in (tdist, c10d)
                 for name in LEDGER_COLLECTIVES if hasattr(module, name)]  # fmt: skip
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        for module, name, fn in saved:
            setattr(module, name, self._wrap(name, fn))
        try:
            yield self
        except BaseException as err:
            self._write({"end": "raised", "error": _one_line(f"{type(err).__name__}: {err}")})
            raise
        else:
            self._write({"end": "returned"})
        finally:
            for module, name, fn in saved:
                setattr(module, name, fn)
            if self._file is not None:
                self._file.close()
                self._file = None

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self.count += 1
            entry = {"n": self.count, "op": name, **_called_from(sys._getframe(1))}
            group = _group_ranks(args, kwargs)
            if group is not None:
                entry["group"] = group
            self._write(entry)
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            except Exception as err:
                if self._on_echo is not None and is_echo(str(err)):
                    on_echo, self._on_echo = self._on_echo, None
                    with contextlib.suppress(Exception):  # evidence only: never mask the error
                        on_echo()
                raise
            finally:
                self._depth -= 1

        return recorded

    def _write(self, entry: dict[str, Any]) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError, ValueError):  # a full disk must not fail the job
                self._file.write(json.dumps(entry) + "\n")


def _called_from(frame: Any) -> dict[str, Any]:
    """{"file", "line", "func", "code", "yours"} of the frame that called a collective."""
    own = None
    while frame is not None:
        path = frame.f_code.co_filename
        if not _in_library(path) and path != __file__:
            if not path.startswith(_LABKIT):
                return {**_frame_fields(frame), "yours": True}
            own = own or frame
        frame = frame.f_back
    return {**_frame_fields(own), "yours": False} if own is not None else {"yours": False}


def _frame_fields(frame: Any) -> dict[str, Any]:
    path, line = frame.f_code.co_filename, frame.f_lineno
    return {"file": path, "line": line, "func": frame.f_code.co_name,
            "code": linecache.getline(path, line).strip()}  # fmt: skip


def _group_ranks(args: Sequence[Any], kwargs: dict[str, Any]) -> list[int] | None:
    """The ranks of the process group a collective was called on; None for the default one."""
    import torch.distributed as tdist

    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, tdist.ProcessGroup)), None)
    if group is None or group is tdist.GroupMember.WORLD:
        return None
    with contextlib.suppress(Exception):  # a group this rank is not in: no ranks to tell
        return list(tdist.get_process_group_ranks(group))
    return None


@dataclass
class RankLedger:
    """One rank's ledger as read back: its collectives in order, and how the block ended
    (None: the rank was stopped before it ended, or never started one)."""

    rank: int
    calls: list[dict[str, Any]]
    end: dict[str, Any] | None = None


def read_ledgers(job_dir: Path, nproc: int | Sequence[int]) -> dict[int, RankLedger]:
    """{rank: its ledger} for the ranks of ``job_dir`` that kept one (a line cut short by a
    kill is skipped)."""
    found = {}
    for rank in _rank_list(nproc):
        try:
            lines = ledger_path(job_dir, rank).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        ledger = RankLedger(rank, [])
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and "end" in entry:
                ledger.end = entry
            elif isinstance(entry, dict) and "op" in entry:
                ledger.calls.append(entry)
        found[rank] = ledger
    return found


def _shared(ledger: RankLedger, a: int, b: int) -> list[dict[str, Any]]:
    """The calls of ``ledger`` on groups both ranks ``a`` and ``b`` belong to, in order."""
    return [c for c in ledger.calls if c.get("group") is None or {a, b} <= set(c["group"])]


def _same(c: dict[str, Any], d: dict[str, Any]) -> bool:
    return all(c.get(key) == d.get(key) for key in ("op", "file", "line"))


@dataclass(frozen=True)
class CollectivesApart:
    """Where two ranks' sequences of collectives first differ: ``rank`` called ``call`` as its
    collective number ``position`` (counted in the sequence they share), which ``other`` did
    not call there. ``instead``: what ``other`` called there (None: nothing more);
    ``other_end``: how ``other``'s block ended (None: it was stopped first); ``later``:
    ``other`` did call the same collective, further on."""

    rank: int
    call: dict[str, Any]
    other: int
    instead: dict[str, Any] | None
    other_end: dict[str, Any] | None
    later: bool
    position: int

    @property
    def yours(self) -> bool:
        """Whether either call at the split was made by code outside labkit (a learner's)."""
        return bool(self.call.get("yours") or (self.instead or {}).get("yours"))

    def describe(self, own: str = "labkit's own") -> str:
        """The sentence: which rank called which collective, where, that the other rank
        never called. ``own`` names labkit's calls ("the check's own")."""
        nth = _ordinal(self.position)
        head = f"rank {self.rank} called {describe_call(self.call, own)}, its {nth} collective"
        if self.instead is not None:
            there = f"its {nth} was {describe_call(self.instead, own)}"
            if self.later:
                return (f"{head}, but rank {self.other} did not call it there: {there}, and it "
                        "called the other only later")  # fmt: skip
            return f"{head}, and rank {self.other} never called it: {there}"
        end = self.other_end or {}
        if end.get("end") == "returned":
            why = (f"it had finished after {self.position - 1} collectives, the same as rank "
                   f"{self.rank}'s")  # fmt: skip
        elif end.get("end") == "raised":
            why = f"it had stopped with {end.get('error', 'an error')}"
        else:
            why = "it was still elsewhere when the job ended"
        return f"{head}, and rank {self.other} never called it: {why}"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def describe_call(call: dict[str, Any], own: str = "labkit's own") -> str:
    """"dist.all_reduce at file.py, line 15, in f (`code`)" for a ledger entry; a call of
    labkit's own is named as ``own``'s."""
    name = f"dist.{call.get('op', '?')}"
    if not call.get("file"):
        return name
    where = f"{os.path.basename(call['file'])}, line {call.get('line')}, in {call.get('func')}"
    if not call.get("yours"):
        return f"{own} {name} ({where})"
    code = call.get("code")
    return f"{name} at {where}" + (f" (`{code}`)" if code else "")


def collectives_apart(ledgers: dict[int, RankLedger]) -> CollectivesApart | None:
    """The first place where two ranks' ledgers differ, or None if they all agree.

    Each pair of ranks is compared on the collectives of groups both are in. Of the pairs that
    differ, the one that differs earliest is reported. At that place, the call named as never
    made is the one the other rank never made anywhere, then a learner's over labkit's: the
    other rank's own call there is most often the check carrying on without it.
    """
    best: tuple[int, CollectivesApart] | None = None
    ranks = sorted(ledgers)
    for i, a in enumerate(ranks):
        for b in ranks[i + 1:]:
            la, lb = _shared(ledgers[a], a, b), _shared(ledgers[b], a, b)
            pairs = enumerate(zip(la, lb, strict=False))
            k = next((k for k, (c, d) in pairs if not _same(c, d)), min(len(la), len(lb)))
            if k == len(la) == len(lb):
                continue
            found = _apart_at(k, (a, la, ledgers[a].end), (b, lb, ledgers[b].end))
            if best is None or k < best[0]:
                best = (k, found)
    return best[1] if best else None


def _apart_at(
    k: int,
    side_a: tuple[int, list[dict[str, Any]], dict[str, Any] | None],
    side_b: tuple[int, list[dict[str, Any]], dict[str, Any] | None],
) -> CollectivesApart:
    options = []
    for (r, mine, _), (o, theirs, end) in ((side_a, side_b), (side_b, side_a)):
        if k >= len(mine):
            continue
        call = mine[k]
        later = any(_same(call, d) for d in theirs[k + 1:])
        instead = theirs[k] if k < len(theirs) else None
        # never made anywhere first, then a learner's call, then the lower rank
        options.append(((later, not call.get("yours"), r),
                        CollectivesApart(r, call, o, instead, end, later, k + 1)))  # fmt: skip
    return min(options, key=lambda o: o[0])[1]


# --- a stalled job ----------------------------------------------------------------------------


def _ago(beat: dict, now: float) -> str:
    t = beat.get("time")
    return f"{now - t:.1f} s ago" if isinstance(t, (int, float)) else "at an unknown time"


def _where(beat: dict) -> str:
    step, total = beat.get("step"), beat.get("total")
    return (
        "before its first step"
        if step is None
        else f"at step {step}" + (f"/{total}" if total else "")
    )


def diagnose_hang(
    heartbeats: dict[int, dict],
    nproc: int | Sequence[int],
    now: float | None = None,
    where: dict[int, str] | None = None,
) -> tuple[list[int], list[str]]:
    """Name the ranks that most likely hold a stalled job up, from their last heartbeats.

    A rank waiting in a collective is a victim: it waits for a peer. So a rank that is *not*
    in a collective while others are is the likely culprit; among several, the one with the
    lowest step. Ranks that never wrote a heartbeat (stuck importing or before setup) come
    first. ``now`` (``time.time()`` by default) dates the heartbeats. Returns (likely hung
    ranks, one explanatory line per rank, followed by where the rank was if ``where`` (from
    :func:`read_stacks`) says).
    """
    now = time.time() if now is None else now
    where = where or {}
    ranks = _rank_list(nproc)
    lines = []
    for r in ranks:
        beat = heartbeats.get(r)
        if beat is None:
            lines.append(f"rank {r}: no heartbeat (never reached setup: slow or stuck start)")
        elif beat.get("phase") == "done":
            lines.append(f"rank {r}: finished")
        elif beat.get("in_collective"):
            lines.append(
                f"rank {r}: waiting in collective '{beat.get('phase')}' {_where(beat)} "
                f"(last heartbeat {_ago(beat, now)})"
            )
        else:
            lines.append(
                f"rank {r}: {_where(beat)} in phase '{beat.get('phase')}', not in a "
                f"collective (last heartbeat {_ago(beat, now)})"
            )
    lines = [line + (f"\n    stuck at {where[r]}" if r in where else "")
             for r, line in zip(ranks, lines, strict=True)]  # fmt: skip
    missing = [r for r in ranks if r not in heartbeats]
    if missing:
        return missing, lines
    active = {r: b for r, b in heartbeats.items() if b.get("phase") != "done"}
    outside = {r: b for r, b in active.items() if not b.get("in_collective")}
    # Some ranks wait in a collective for the others: those others are the suspects.
    pool = outside if outside and len(outside) < len(active) else active
    if not pool:
        return [], lines

    def step_of(r: int) -> int:
        s = pool[r].get("step")
        return -1 if s is None else int(s)

    lowest = min(step_of(r) for r in pool)
    behind = sorted(r for r in pool if step_of(r) == lowest)
    if pool is active and len(behind) == len(active) == len(heartbeats):
        return [], lines  # nobody is behind anybody: no rank to blame
    return behind, lines


# --- where a stuck rank is ---------------------------------------------------------------------

# faulthandler's dump: a header per thread, then its frames, most recent call first.
_DUMP_THREAD = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-f]+", re.MULTILINE)
_DUMP_FRAME = re.compile(r'^\s+File "(?P<path>[^"]*)", line (?P<line>\d+) in (?P<func>.+)$',
                         re.MULTILINE)  # fmt: skip


def where_stuck(dump: str) -> str | None:
    """"_faults.py, line 73, in main: `time.sleep(...)`" from a rank's faulthandler dump.

    The thread running the worker (the one with labkit.jobs.runtime's frame in it, else the first) is
    read from its innermost frame out: the first frame of code (not the standard library's or
    an installed package's) is where the rank is; a library call it is inside is named too.
    """
    threads = [t for t in _DUMP_THREAD.split(dump) if _DUMP_FRAME.search(t)]
    if not threads:
        return None
    main = next((t for t in threads if runtime.__file__ in t), threads[0])
    frames = list(_DUMP_FRAME.finditer(main))
    inside = [f for f in frames if _in_library(f["path"])]
    for f in frames:
        if _in_library(f["path"]):
            continue
        source = linecache.getline(f["path"], int(f["line"])).strip()
        where = f"{os.path.basename(f['path'])}, line {f['line']}, in {f['func']}"
        where += f": `{source}`" if source else ""
        if frames[0] is not f and inside and inside[0] is frames[0]:
            where += f", inside {frames[0]['func']} ({_library_name([frames[0]['path']])})"
        return where
    return None


def read_stacks(job_dir: Path, nproc: int | Sequence[int]) -> dict[int, str]:
    """{rank: where it is} for the ranks that wrote a stack dump (``runtime.STACK_SIGNAL``)."""
    found = {}
    for rank in _rank_list(nproc):
        with contextlib.suppress(OSError):
            where = where_stuck(runtime.stack_path(job_dir, rank).read_text(errors="replace"))
            if where:
                found[rank] = where
    return found


# --- a traceback, shortened -------------------------------------------------------------------

_FRAME = re.compile(r'^  File "(?P<path>[^"]*)", line \d+, in (?P<func>.*)$')
# Frames that start every worker, whatever it does: ``python -m`` (runpy, importlib), the
# worker module's `if __name__ == "__main__": main()`, torchrun's @record wrapper, and
# labkit.jobs.runtime's entry point. The same in every failure: counted, not shown.
_LAUNCHER_FILES = ("<frozen runpy>", "/runpy.py", "<frozen importlib", "/importlib/",
                   "/torch/distributed/elastic/", "/torch/distributed/run.py")  # fmt: skip
_STDLIB = sysconfig.get_paths()["stdlib"]
_LABKIT = os.path.dirname(os.path.dirname(runtime.__file__)) + os.sep  # labkit/
EXCERPT_TAIL = 8  # lines kept of a failure's text that is not a Python traceback


def _starts_worker(path: str, func: str) -> bool:
    return path == runtime.__file__ or func == "<module>" or any(f in path for f in _LAUNCHER_FILES)


def _in_library(path: str) -> bool:
    """The standard library or an installed package (torch...): not code the lab wrote.
    labkit counts as code even where it is installed among the packages."""
    if path.startswith(_LABKIT):
        return False
    return path.startswith(("<", _STDLIB)) or "-packages/" in path


def _library_name(paths: Sequence[str]) -> str:
    names: list[str] = []
    for path in paths:
        _, found, rest = path.partition("-packages/")
        name = rest.split("/", 1)[0].removesuffix(".py") if found else "the standard library"
        if name not in names:
            names.append(name)
    return " and ".join(names)


def traceback_excerpt(text: str) -> str:
    """The lines of a failing rank's traceback that tell what went wrong, for ``JobFailed``.

    Kept: the exception, every frame of code (the worker's, the learner's, labkit's), and the
    frame that raised. Left out: the frames that start every worker (``_LAUNCHER_FILES``),
    counted in one line; and runs of library frames between kept ones (torch's module-call
    machinery, say), one line per run naming the library. Chained exceptions keep their
    "During handling of..." lines. A text without frames (a rank killed by a signal leaves
    only its log) gives its last ``EXCERPT_TAIL`` lines.
    """
    lines = text.rstrip().splitlines()
    # Blocks: a frame ("  File ..." and its more-indented source and caret lines) or a line.
    blocks: list[tuple[re.Match[str] | None, list[str]]] = []
    for line in lines:
        if blocks and blocks[-1][0] is not None and line.startswith("    "):
            blocks[-1][1].append(line)
        else:
            blocks.append((_FRAME.match(line), [line]))
    if not any(m for m, _ in blocks):
        return "\n".join(lines[-EXCERPT_TAIL:])
    out: list[str] = []
    stack: list[tuple[re.Match[str], list[str]]] = []  # the frames of one traceback
    for m, block in [*blocks, (None, [])]:
        if m is not None:
            stack.append((m, block))
            continue
        out += _excerpt_stack(stack)
        stack = []
        out += block
    return "\n".join(out)


def _excerpt_stack(stack: Sequence[tuple[re.Match[str], list[str]]]) -> list[str]:
    """One traceback's frames, outermost first, as ``traceback_excerpt`` shows them."""
    if not stack:
        return []
    start = 0  # the frames that start the worker come first
    while start < len(stack) - 1 and _starts_worker(stack[start][0]["path"], stack[start][0]["func"]):
        start += 1
    out = [f"  … {start} frames of the launcher (torchrun, labkit.jobs.runtime) left out"] if start else []
    hidden: list[str] = []  # paths of a run of library frames not shown
    for k, (m, block) in enumerate(stack[start:], start):
        if _in_library(m["path"]) and k < len(stack) - 1:
            hidden.append(m["path"])
            continue
        if hidden:
            out.append(f"  … {len(hidden)} frame{'s' if len(hidden) > 1 else ''} in "
                       f"{_library_name(hidden)}")  # fmt: skip
            hidden = []
        out += block
    return out
