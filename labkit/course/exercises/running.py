"""The check runner: run the learner's answer under a time limit, print one line, never stop Run All.

:func:`check` (in the kernel) and :func:`check_in_workers` (a file checked on several ranks)
run :func:`verify` with the kernel watched (:mod:`.time_limits`, :mod:`.leftovers`), turn
a learner's ``sys.exit`` or time-out into a failed check, and report with
:func:`~.feedback.report`. :func:`verify` itself prints nothing and raises, so the same
checks run inside worker processes.
"""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from labkit.course.exercises.feedback import report
from labkit.course.exercises.learner_code import (
    incomplete,
    is_learners_file,
    is_stub,
    learner_frame,
)
from labkit.course.exercises.leftovers import KernelWatch, Leftovers
from labkit.course.exercises.registry import (
    MODULES,
    Exercise,
    ExerciseError,
    ExerciseFailed,
    ExerciseIncomplete,
    get,
)
from labkit.course.exercises.time_limits import TimeLimitReached, time_limit

# --------------------------------------------------------------------------- checking


def verify(exercise_id: str, answer: Any) -> str:
    """Run the check; return what was verified, or raise (never prints; usable in workers)."""
    __tracebackhide__ = True  # pytest and IPython hide this frame: the message is the point
    ex = get(exercise_id)
    if is_stub(answer):
        raise incomplete(exercise_id)
    try:
        return ex.verify(answer)
    except ExerciseFailed as err:
        if err.exercise_id is None:
            err.exercise_id = ex.id
            err.args = (f"Exercise {ex.id} ({ex.title}) failed: {err.args[0] if err.args else ''}",)
        raise
    except ExerciseIncomplete:
        raise
    except NotImplementedError:
        raise incomplete(exercise_id) from None



def check(exercise_id: str, answer: Any) -> Any:
    """Verify ``answer``, print one line, and return what later cells should use.

    Where later cells depend on the exercise (it has a reference answer), returns ``answer``
    when it passes, else the reference; otherwise returns None (so a cell that ends in a check
    displays nothing more). Never raises for an unfinished or
    wrong answer, so "Run All" reaches the end of the notebook; :func:`verify` raises.
    """
    __tracebackhide__ = True
    ex = get(exercise_id)
    outcome, _, note = _run_in_kernel(ex, lambda: (verify(exercise_id, answer), ""))
    passed = _report_with(exercise_id, outcome, note)
    if ex.withheld:
        return answer if passed else None
    return None if ex.reference is None else answer if passed else ex.reference


def _run_in_kernel(
    ex: Exercise, run: Callable[[], tuple[str, str]]
) -> tuple[str | ExerciseError, str, str]:
    """Run a check's ``run()`` (it returns what was verified and where) in the kernel, as the
    learner's code must be run there: under the exercise's time limit, with the processes
    it starts watched. Returns (the outcome for :func:`report`, where, a note on the processes
    the learner's code left running, which are stopped: "" if none).

    A ``SystemExit`` (``sys.exit(1)`` in the learner's code), a ``KeyboardInterrupt`` the
    code raised itself, or another ``BaseException`` of the learner's becomes a failed check:
    the kernel goes on. A real interrupt (■, the SIGINT the kernel gets) still interrupts, and
    a check's own error (a bad argument, a job that could not start) goes on up; either way
    the processes the learner's code started are stopped first, and the note printed.
    """
    __tracebackhide__ = True
    watch = KernelWatch()
    caught: tuple[str | ExerciseError, str, bool] | None = None  # None: an error goes on up
    note = ""
    try:
        caught = _caught(ex, run, watch)
    finally:
        if caught is None or not caught[2]:  # not stopped at the time limit already
            note = watch.stop_leftovers().note()
            if caught is None and note:  # no report follows to print it
                print(note)
    outcome, where, _ = caught
    return outcome, where, note


def _caught(
    ex: Exercise, run: Callable[[], tuple[str, str]], watch: KernelWatch
) -> tuple[str | ExerciseError, str, bool]:
    """``run()``'s (outcome, where), or the failed check the learner's code's way out of it
    makes, and whether the processes it started were stopped already (at the time limit: the
    outcome names them). A real interrupt and a check's own error are raised."""
    __tracebackhide__ = True
    try:
        with time_limit(ex.time_limit_s), watch.interrupts():
            outcome, where = run()
        return outcome, where, False
    except ExerciseError as err:
        return err, "", False
    except TimeLimitReached as stop:
        return _timed_out(ex, stop, watch.stop_leftovers()), "", True
    except KeyboardInterrupt as err:
        # A real interrupt (■) went through our handler, or was held back by labkit code
        # (launch's cleanup) and raised there; the learner's own `raise` is in its code.
        if watch.interrupted or not _raised_in_learners_code(err):
            raise
        return _exited(err, "raised KeyboardInterrupt itself"), "", False
    except Exception:  # a check's own error (a bad argument, a job that could not start)
        raise
    except BaseException as err:  # SystemExit and kin, from the learner's code: reported
        return _exited(err), "", False


def _raised_in_learners_code(err: BaseException) -> bool:
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and is_learners_file(frames[-1].filename)


def _report_with(exercise_id: str, outcome: str | ExerciseError, note: str, where: str = "") -> bool:
    """:func:`report`, then ``note`` (printed even when ``LABKIT_EXPECT_SOLVED`` makes the
    report raise: the processes it names were stopped either way)."""
    try:
        return report(exercise_id, outcome, where=where)
    finally:
        if note:
            print(note)


def _exited(err: BaseException, did: str = "") -> ExerciseFailed:
    """A failed check for a learner's code that tried to leave instead of returning."""
    if isinstance(err, SystemExit):
        code = "" if err.code is None else repr(err.code)
        did = f"called sys.exit({code})"
    did = did or f"raised {type(err).__name__}{': ' + str(err) if str(err) else ''}"
    return ExerciseFailed(
        f"your code {did}{learner_frame(err)}: a function must return its answer (or raise an "
        "error), not exit the process or interrupt it. The check caught it, and the kernel "
        "goes on."
    )


def _timed_out(ex: Exercise, stop: TimeLimitReached, left: Leftovers) -> ExerciseFailed:
    return ExerciseFailed(
        f"your code did not finish within {ex.time_limit_s:g} s, the check's time limit, so "
        f"the check stopped it{learner_frame(stop, ' while it ran')}. A loop whose condition "
        f"never changes? {left.after_stop()}"
    )



def check_in_workers(exercise_id: str, path: str | Path, **options: Any) -> None:
    """Check the learner's file ``path`` (a ``%%writefile`` cell wrote it) on several ranks.

    The exercise's notebook module does the work (``verify_file``); this prints one line as
    :func:`check` does and never raises for the learner's mistakes. Later cells run labkit's
    own implementation whatever the outcome (a job cannot import a notebook's answer).
    """
    __tracebackhide__ = True
    ex = get(exercise_id)
    module = importlib.import_module(MODULES[ex.notebook])
    verify_file = getattr(module, "verify_file", None)
    if verify_file is None:
        raise ValueError(f"exercise_id={exercise_id!r} is checked in the kernel: use ex.check")
    # The kernel imports the learner's file (to spot a stub) before the job starts: a
    # top-level loop there would hang the cell, a top-level sys.exit end it. The job's own
    # time is its timeout_s.
    outcome, where, note = _run_in_kernel(ex, lambda: verify_file(exercise_id, path, **options))
    _report_with(exercise_id, outcome, note, where)
