"""The processes the learner's code starts in the kernel and leaves running: named and stopped.

A check notes the kernel's child processes before the learner's code runs (:class:`KernelWatch`)
and stops those it left behind afterwards, saying so (:class:`Leftovers`). Apart because it is
process bookkeeping (psutil, signals), which the check runner only calls.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# --------------------------------------------------------------------------- what code leaves

GRACE_S = 2.0
"""How long a process the learner's code left gets to end after SIGTERM, before SIGKILL."""
SETTLE_S = 0.25
"""How long a new child process gets to end by itself before it counts as left running (a
data loader's workers shut down as its iterator goes)."""
_INFRASTRUCTURE = ("multiprocessing.resource_tracker", "multiprocessing.forkserver",
                   "_inductor/compile_worker", "_inductor.compile_worker")  # fmt: skip
"""Processes a library starts once per kernel and keeps on purpose (torch.compile's pool of
compile workers, multiprocessing's helpers): started during a check, they are not the
learner's to stop."""


@dataclass
class Leftovers:
    """The processes the learner's code started in the kernel and left running, as a check
    found and stopped them, and those that would not stop: {pid: command line} each."""

    stopped: dict[int, str]
    unstoppable: dict[int, str]

    def note(self) -> str:
        """The line a check that ended by itself adds: "" when nothing was left running."""
        if not (self.stopped or self.unstoppable):
            return ""
        text = "  Your code left " + self._named(" running, which the check stopped") + (
            ". A function must wait for the processes it starts (or stop them) before it "
            "returns: they go on running in the kernel otherwise.")  # fmt: skip
        return text + self._unstoppable()

    def after_stop(self) -> str:
        """The sentence a check stopped at its time limit ends with: whether anything else
        needs stopping (only when all is stopped is it said that nothing does)."""
        if not (self.stopped or self.unstoppable):
            return "(Nothing else needs stopping: the notebook can go on.)"
        named = self._named(", which the check stopped too")
        if not self.unstoppable:
            return f"It had started {named}. Nothing else needs stopping: the notebook can go on."
        return f"It had started {named}.{self._unstoppable()}"

    def _named(self, stopped: str) -> str:
        """"2 processes <stopped>: pid 1 (`a`), pid 2 (`b`)", and those that would not stop."""
        parts = []
        for which, how in ((self.stopped, stopped), (self.unstoppable, " that would not stop")):
            if which:
                listed = ", ".join(f"pid {pid} (`{command}`)" for pid, command in which.items())
                parts.append(f"{len(which)} process{'es' * (len(which) > 1)}{how}: {listed}")
        return "; and ".join(parts)

    def _unstoppable(self) -> str:
        if not self.unstoppable:
            return ""
        pids = " ".join(map(str, self.unstoppable))
        return (f" Stop {'them' if len(self.unstoppable) > 1 else 'it'} from a terminal "
                f"(kill -9 {pids}) or restart the kernel.")  # fmt: skip


class KernelWatch:
    """What a check needs to know of the kernel around the learner's code: the child
    processes it had before (so that the new ones can be named and stopped after) and
    whether a SIGINT (■) arrived while the code ran."""

    def __init__(self) -> None:
        self.before = {_key(p) for p in _children()}
        self.interrupted = False

    @contextlib.contextmanager
    def interrupts(self) -> Iterator[None]:
        """Note a real SIGINT, then let the kernel's own handler raise KeyboardInterrupt: a
        KeyboardInterrupt without one is the learner's code's own doing. Signals reach only
        the main thread; elsewhere nothing is noted."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.getsignal(signal.SIGINT)

        def interrupted(signum: int, frame: Any) -> None:
            self.interrupted = True
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt

        signal.signal(signal.SIGINT, interrupted)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def stop_leftovers(self) -> Leftovers:
        """Stop the child processes (and theirs) that appeared since: SIGTERM, then SIGKILL
        after :data:`GRACE_S`. Those still there after that are named as unstoppable; those
        stopped are left for their owner to reap."""
        from labkit.jobs import procs  # lazy: importing exercises stays cheap

        new = [p for p in _children() if _key(p) not in self.before and not _infrastructure(p)]
        new = _still_running(new, SETTLE_S)  # those that end by themselves are not left over
        if not new:
            return Leftovers({}, {})
        named = {p.pid: _command(p) for p in new}  # before they go
        procs.end_tree(new, grace_s=GRACE_S)
        # Never reaped here (no waitpid): a process is its owner's to reap. A Popen or a
        # multiprocessing.Process whose child this reaped would read exit code 0 for a killed
        # process, or is_alive() True for ever, and could later signal a reused PID.
        left = {p.pid for p in new if procs.alive(p)}
        return Leftovers({pid: c for pid, c in named.items() if pid not in left},
                         {pid: c for pid, c in named.items() if pid in left})  # fmt: skip


def _still_running(found: list[Any], within_s: float) -> list[Any]:
    """Those of ``found`` still running after up to ``within_s`` seconds (a zombie has ended).

    Polled, not waited for: ``psutil.wait_procs`` would reap this process's own children, and
    their exit status is their owner's (a learner's ``Popen``) to read."""
    from labkit.jobs import procs

    deadline = time.monotonic() + within_s
    while True:
        running = [p for p in found if procs.alive(p)]
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(0.02)


def _children() -> list[Any]:
    """This process's live descendants (psutil processes)."""
    import psutil

    from labkit.jobs import procs

    with contextlib.suppress(psutil.Error):
        return [p for p in psutil.Process().children(recursive=True) if procs.alive(p)]
    return []


def _key(p: Any) -> tuple[int, float]:
    """A process by PID and start time: a PID reused by a later process is another one."""
    import psutil

    with contextlib.suppress(psutil.Error):
        return p.pid, p.create_time()
    return p.pid, 0.0


def _cmdline(p: Any) -> str:
    import psutil

    with contextlib.suppress(psutil.Error):
        return " ".join(p.cmdline()) or p.name()
    return "?"


def _command(p: Any) -> str:
    """A process's command line, shortened to 80 characters for a message."""
    command = _cmdline(p)
    return command if len(command) <= 80 else command[:79] + "…"


def _infrastructure(p: Any) -> bool:
    return any(marker in _cmdline(p) for marker in _INFRASTRUCTURE)
