"""Time limits for the learner's code run in the kernel: a loop that never ends fails its check.

A SIGALRM timer (:func:`time_limit`) raises :class:`TimeLimitReached` in the learner's loop;
:func:`time_limit_paused` hands the clock to a job of worker processes, which has its own.
Apart because it is signal handling, with its own global state, unrelated to what is checked.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

# --------------------------------------------------------------------------- time limits



class TimeLimitReached(BaseException):
    """Raised inside the learner's code when a check's time is up. A BaseException, like
    KeyboardInterrupt, so that ``except Exception`` in the learner's code (or in :func:`call`)
    does not swallow it."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`TimeLimitReached` in this thread if the block runs longer than ``seconds``.

    A real-time timer (SIGALRM, ``signal.setitimer``) interrupts a Python loop at its next
    bytecode; a long C call (one big matmul) finishes first. Signals reach only the main
    thread, where Jupyter runs cells; elsewhere the block runs without a limit. A timer that
    was already set (pytest-timeout's, say) is put back afterwards with the time it has left,
    and if it would fire first, it keeps its own handler and ours is not set.
    """
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return
    outer_left, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    if 0 < outer_left <= seconds:
        yield  # the outer timer fires first anyway
        return
    global _TIMES_UP
    _TIMES_UP = 0
    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, _time_is_up)
    signal.setitimer(signal.ITIMER_REAL, seconds, RETRY_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_left > 0:
            left = outer_left - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(left, 0.001), outer_interval)


def _time_is_up(signum: int, frame: Any) -> None:
    # The timer repeats (every RETRY_S): code with a bare `except:` swallows one raise, and a
    # loop around it would otherwise run forever. If the first did not stop it, say why once.
    global _TIMES_UP
    _TIMES_UP += 1
    if _TIMES_UP == 2:
        print("labkit: the check's time limit is reached and your code caught the stop (a bare "
              "`except:`?); trying again every second. If it never ends, press ■, or restart "
              "the kernel")  # fmt: skip
    raise TimeLimitReached("the check's time limit")


_TIMES_UP = 0
RETRY_S = 1.0  # after the time limit, raise again this often until the code gives way


@contextlib.contextmanager
def time_limit_paused() -> Iterator[None]:
    """Stop the clock of an enclosing :func:`time_limit` for the block: a check that launches a
    job of worker processes gives it the job's own time limit instead (``launch.run``'s
    ``timeout_s``, which also ends the processes)."""
    if signal.getsignal(signal.SIGALRM) is not _time_is_up:
        yield
        return
    remaining, interval = signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, max(remaining, 0.001), interval)
