"""Exercises: one registry, graded hints, and checks that never stop a learner's Run All.

A learner finishes an exercise, then runs its check::

    from labkit.course import exercises as ex
    count_params = ex.check("01.param_count", count_params)
    # ✓ 01.param_count: count_params(cfg) equals the parameters of labkit.model.GPT(cfg) ...

:func:`check` prints one line and returns what later cells should use:

- ``✓`` and the learner's own answer when it is right (later cells then run on it, and say so);
- ``○ … not done yet`` while the code is still the stub :mod:`labkit.course.nbgen` generated: the
  first, conceptual hint and how to ask for more; it returns the exercise's reference answer,
  so "Run All" carries on and the learner still sees the whole lab;
- ``✗`` and a diagnosis for a wrong answer (what was expected, what came back, the usual mistake
  behind that value, never the code), and again the reference.

The learner's code runs in the kernel under a time limit (:func:`time_limit`); a
``sys.exit`` in it fails the check instead of ending the cell, and a process it started and
left running is named and stopped (:class:`Leftovers`).

Hints come in steps (:func:`hint`): the first is conceptual, each call gives one more, the last
is the recipe. A stub's own message carries no hint at all, so nothing is given away by
running a cell.

Exercises whose code must run on several ranks (notebooks 02, 03, 03b and 03c) are written to a
file by a ``%%writefile`` cell and checked with :func:`check_in_workers`, which reports the same
way.

The registry is data: each :class:`Exercise` has an id, a title, its hints, a ``verify``
function (takes the learner's answer, raises :class:`ExerciseFailed` or returns a sentence
saying what it verified) and optionally the reference answer. Each notebook's checks live in
their own module of this package (:data:`MODULES`), imported on first need: importing this
package stays cheap and has no side effects. :func:`verify` prints nothing and raises, so the
same checks also run inside worker processes.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import numbers
import os
import re
import signal
import sysconfig
import textwrap
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labkit import ids
from labkit.errors import LabkitError

MODULES: dict[str, str] = {
    "00": "labkit.course.exercises.first_job",
    "01": "labkit.course.exercises.single_gpu",
    "02": "labkit.course.exercises.data_parallel",
    "03": "labkit.course.exercises.model_parallel",
    "04": "labkit.course.exercises.mixed_precision",
    "05": "labkit.course.exercises.batch_size",
    "06": "labkit.course.exercises.profiling",
    "03b": "labkit.course.exercises.composing",
    "02b": "labkit.course.exercises.resilience",
    "03c": "labkit.course.exercises.sequences_experts",
    "03d": "labkit.course.exercises.planning",
    "07": "labkit.course.exercises.capstone",
}
"""Notebook -> the module that registers its exercises."""

TIME_LIMIT_S_DEFAULT = 60.0
"""How long an in-kernel check may run the learner's code: the checks themselves take well
under a second, so only code that never returns reaches it, even on a busy laptop."""

_STDLIB = sysconfig.get_paths()["stdlib"]
_PACKAGE = str(Path(__file__).resolve().parents[2]) + os.sep  # labkit/

EXPECT_SOLVED = "LABKIT_EXPECT_SOLVED"
"""Environment variable: "1" makes every check that does not pass raise :class:`NotSolved`
after printing its line, so Run All stops there. For complete notebooks (the tests run
``solutions/`` with it; an instructor checking their own solutions can too); a learner's copy
runs without it, and its unfinished exercises only print their line."""

STUB_MESSAGE = "exercise not done yet: replace this line with your code"
"""What the stubs :mod:`labkit.course.nbgen` generates raise: deliberately no hint, no answer."""

# --------------------------------------------------------------------------- the registry


class ExerciseError(LabkitError):
    """Base of the two ways a check can end without a ✓."""

    exercise_id: str | None = None


class ExerciseIncomplete(ExerciseError, NotImplementedError):
    """The learner's code is still the generated stub (it raises ``NotImplementedError``)."""


class ExerciseFailed(ExerciseError, AssertionError):
    """The learner's code ran and gave a wrong answer; the message says what is wrong."""


class NotSolved(AssertionError, LabkitError):
    """With ``LABKIT_EXPECT_SOLVED=1``: a check did not pass in a notebook that must be complete."""


@dataclass(frozen=True)
class Exercise:
    """One exercise: what it is, its hints in steps, how to verify an answer."""

    id: str
    """``"NN.name"``: NN is the notebook (``"01"``), name says what is built."""
    title: str
    """Short description, e.g. "Count a GPT's parameters by formula"."""
    hints: tuple[str, ...]
    """From conceptual (first, shown with "not done yet") to the recipe (last, on request)."""
    verify: Callable[[Any], str]
    """Takes the learner's answer; raises :class:`ExerciseFailed` or returns what it verified."""
    reference: Any = None
    """The answer later cells use while the learner's is not done or wrong (None: later cells
    do not depend on this exercise, labkit's own implementation runs there)."""
    time_limit_s: float = TIME_LIMIT_S_DEFAULT
    """How long its check may run the learner's code (:func:`time_limit`)."""
    withheld: bool = False
    """True: later cells depend on the exercise but wait for the learner's own answer, since
    its reference would give something away (notebook 07's would be its key): :func:`check`
    returns None until the learner's passes."""

    def __post_init__(self) -> None:
        if not self.hints or not all(isinstance(h, str) and h.strip() for h in self.hints):
            raise ValueError(f"exercise {self.id!r}: give at least one non-empty hint")

    @property
    def notebook(self) -> str:
        return self.id.split(".", 1)[0]


_REGISTRY: dict[str, Exercise] = {}
_HINTS_SHOWN: dict[str, int] = {}  # id -> how many hints this kernel has shown
_PASSED: dict[str, bool] = {}  # id -> did its last check in this kernel pass


def exercise(
    id: str,
    title: str,
    hints: tuple[str, ...] | list[str],
    reference: Any = None,
    time_limit_s: float = TIME_LIMIT_S_DEFAULT,
    withheld: bool = False,
) -> Callable[[Callable[[Any], str]], Callable[[Any], str]]:
    """Register the decorated function as the ``verify`` of exercise ``id``."""
    notebook, _, name = id.partition(".")
    if not (re.fullmatch(ids.NOTEBOOK_ID, notebook) and name.isidentifier()):
        raise ValueError(f"exercise id={id!r} is not allowed: use 'NN.name', e.g. '01.param_count'")
    if id in _REGISTRY:
        raise ValueError(f"exercise id={id!r} is already registered")

    def register(fn: Callable[[Any], str]) -> Callable[[Any], str]:
        _REGISTRY[id] = Exercise(id=id, title=title, hints=tuple(hints), verify=fn,
                                 reference=reference, time_limit_s=time_limit_s,
                                 withheld=withheld)  # fmt: skip
        return fn

    return register


def _load(notebook: str) -> None:
    if notebook in MODULES:
        importlib.import_module(MODULES[notebook])


def get(exercise_id: str) -> Exercise:
    """The registered exercise called ``exercise_id`` (its notebook's module loads on need)."""
    if not isinstance(exercise_id, str):
        raise TypeError(
            f"exercise_id={exercise_id!r} is not a string: give the exercise's id as a string, e.g. ex.check(\"01.param_count\", count_params) "
            "(ex.catalogue() lists them)"
        )
    if exercise_id not in _REGISTRY:
        _load(exercise_id.split(".", 1)[0])
    try:
        return _REGISTRY[exercise_id]
    except KeyError:
        known = [e.id for e in catalogue()]
        raise ValueError(f"exercise_id={exercise_id!r} is not an exercise; known: {known}") from None


def catalogue(notebook: str | None = None) -> list[Exercise]:
    """All exercises (of one notebook, e.g. ``"01"``), in id order."""
    for nb in [notebook] if notebook else MODULES:
        _load(nb)
    return [e for _, e in sorted(_REGISTRY.items()) if notebook in (None, e.notebook)]


# --------------------------------------------------------------------------- hints


def hint(exercise_id: str, level: int | None = None) -> None:
    """Print the next hint for ``exercise_id`` (or hint number ``level``, 1-based).

    The first hint is conceptual; each call shows one more; the last is the recipe.
    """
    hints = get(exercise_id).hints
    if level is None:  # the next one: "not done yet" already showed the first
        level = min(_HINTS_SHOWN.get(exercise_id, 0) + 1, len(hints))
    if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= len(hints):
        raise ValueError(f"level={level!r} is not allowed: {exercise_id} has hints 1 to {len(hints)}")
    _HINTS_SHOWN[exercise_id] = max(level, _HINTS_SHOWN.get(exercise_id, 0))
    last = level == len(hints)
    more = (
        "this is the last hint: the recipe"
        if last
        else f'ex.hint("{exercise_id}") again for hint {level + 1}'
    )
    print(f"Hint {level} of {len(hints)} for {exercise_id}: {hints[level - 1]}\n({more})")


# --------------------------------------------------------------------------- stubs


def _body_raises_not_implemented(fn: Any) -> bool | None:
    """Whether ``fn``'s body has a top-level ``raise NotImplementedError``; None if unknown."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    node = tree.body[0] if tree.body else None
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    for stmt in node.body:
        if isinstance(stmt, ast.Raise) and stmt.exc is not None:
            exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
            if isinstance(exc, ast.Name) and exc.id == "NotImplementedError":
                return True
    return False


def is_stub(answer: Any) -> bool:
    """True if ``answer`` (a function, a class, or a tuple of them) still has a generated stub.

    Read from the source, so a check can say "not done yet" without running the learner's code
    (in a worker job, or where running it needs a process group). A function whose source
    cannot be read counts as done: its check will run it.
    """
    if isinstance(answer, tuple):
        return any(is_stub(a) for a in answer)
    if str(getattr(answer, "__module__", "")).split(".")[0] in ("torch", "labkit"):
        return False  # library code (torch.autograd.Function.forward raises by design)
    if inspect.isclass(answer):
        return any(is_stub(v.__func__ if isinstance(v, staticmethod | classmethod) else v)
                   for v in vars(answer).values() if inspect.isfunction(v)
                   or isinstance(v, staticmethod | classmethod))  # fmt: skip
    if inspect.isfunction(answer) or inspect.ismethod(answer):
        return bool(_body_raises_not_implemented(inspect.unwrap(answer)))
    return False


def incomplete(exercise_id: str) -> ExerciseIncomplete:
    """The error for a stub: "not done yet" and the first hint."""
    err = ExerciseIncomplete(f"Exercise {exercise_id} is not done yet: {get(exercise_id).hints[0]}")
    err.exercise_id = exercise_id
    return err


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


def _sentence(text: str) -> str:
    return text if text.endswith((".", "?", "!")) else text + "."


def report(exercise_id: str, outcome: str | ExerciseError, *, where: str = "") -> bool:
    """Print the one line a check ends with; True if the exercise passed.

    ``outcome``: the sentence :func:`verify` returned, or the error it raised; ``where``: where
    the check ran, if not in the kernel ("checked in 2 worker processes").
    """
    ex = get(exercise_id)
    passed = isinstance(outcome, str)
    _PASSED[exercise_id] = passed
    depends = ex.reference is not None or ex.withheld
    if passed:
        said = _sentence(f"{outcome} ({where})" if where else outcome)
        print(f"✓ {exercise_id}: {said}" + (" Later cells use your answer." if depends else ""))
        return True
    later = (
        "Later cells wait for your answer."
        if ex.withheld
        else "Later cells use the reference answer meanwhile."
        if depends
        else "The rest of the lab does not depend on it."
    )
    if isinstance(outcome, ExerciseIncomplete):
        _HINTS_SHOWN[exercise_id] = max(1, _HINTS_SHOWN.get(exercise_id, 0))
        print(f"○ {exercise_id} ({ex.title}) is not done yet. Hint: {_sentence(ex.hints[0])} "
              f'More help: ex.hint("{exercise_id}"). {later}')  # fmt: skip
    else:
        text = without_failed_prefix(exercise_id, str(outcome))
        print(f"✗ {exercise_id} ({ex.title}): {text}\n  {later} "
              f'Stuck? ex.hint("{exercise_id}").')  # fmt: skip
    if os.environ.get(EXPECT_SOLVED) == "1":
        # the check's own words go into the error: a test log shows tracebacks, not prints
        raise NotSolved(f"{exercise_id} did not pass, and {EXPECT_SOLVED}=1 says this notebook "
                        f"must be complete (its solution cell is missing or wrong). The check "
                        f"said: {without_failed_prefix(exercise_id, str(outcome))}")  # fmt: skip
    return False


def without_failed_prefix(exercise_id: str, text: str) -> str:
    """``text`` without the "Exercise <id> (<title>) failed: " that :func:`verify` (or a
    worker's report) put in front of it: the line a check prints says it once."""
    title = get(exercise_id).title
    for prefix in (f"Exercise {exercise_id} ({title}) failed: ", f"Exercise {exercise_id} failed: "):
        text = text.removeprefix(prefix)
    return text


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
    watch = _KernelWatch()
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
    ex: Exercise, run: Callable[[], tuple[str, str]], watch: _KernelWatch
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
    return bool(frames) and _is_learners(frames[-1].filename)


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


def whose(exercise_id: str) -> str:
    """"your answer" if the exercise's last check in this kernel passed, else "the reference
    answer": a later cell that uses the result says which it ran on."""
    get(exercise_id)
    return "your answer" if _PASSED.get(exercise_id) else "the reference answer"


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
        return f"{_sentence(telling[rank])}{then} {logs}".strip()
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
        return (f"the check did not finish ({reason}): {_sentence(likely)} "
                f"{_sentence(where) + ' ' if where else ''}{logs}")  # fmt: skip
    if isinstance(err, launch.JobFailed):
        what = f"{err.exc_type}: {err.exc_message}" if err.exc_type else err.exc_message
        frame = _last_code_frame(err.traceback)
        on = f"on rank {err.rank}" if err.rank is not None else "before any rank ran"
        return f"the check job failed {on}: {_sentence(what + frame)} {logs}"
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
        return (f"{_sentence(telling[first])} Then rank {apart.rank} waited in "
                f"{diagnosis.describe_call(apart.call, own)}, which rank {apart.other} never "
                f"called. {SAME_ORDER}")  # fmt: skip
    return f"the ranks' collectives went apart: {_sentence(apart.describe(own))} {SAME_ORDER}"


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
    mine = [f for f in frames if _is_learners(f[0])]
    if not mine:
        return ""
    path, line, code = mine[-1]
    return f" (at {Path(path).name}, line {line}: {code.strip()})"


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


class _KernelWatch:
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


# --------------------------------------------------------------------------- helpers for checks


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call the learner's ``fn``; any error but the stub's becomes an :class:`ExerciseFailed`.

    The message names the call, the error and the learner's own line that raised it (frames
    inside labkit and torch are left out): the check prints it instead of a traceback.
    ``NotImplementedError`` passes through, so :func:`verify` reports the exercise as not done.
    """
    __tracebackhide__ = True
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise
    except Exception as err:
        shown = ", ".join([*map(short_repr, args),
                           *(f"{k}={short_repr(v)}" for k, v in kwargs.items())])  # fmt: skip
        raise ExerciseFailed(
            f"{_name(fn)}({shown}) raised {type(err).__name__}: {err}{learner_frame(err)}"
        ) from err


def short_repr(value: Any, limit: int = 160) -> str:
    """A one-line repr for messages: a model or a tensor by its kind and shape, never the
    30-line printout ``repr`` gives of a module."""
    try:
        import torch  # only to recognise modules and tensors: already loaded by any check
    except ImportError:  # pragma: no cover
        torch = None  # type: ignore[assignment]
    if torch is not None and isinstance(value, torch.nn.Module):
        return f"<{type(value).__name__} model>"
    if torch is not None and isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}>"
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _is_learners(path: str) -> bool:
    """Whether a traceback frame's file is the learner's code: not labkit's, not an installed
    package's (torch...), not the standard library's (a regex's or a sleep's frames)."""
    if any(part in path for part in ("/torch/", "-packages/", "<frozen")):
        return False
    # labkit's own files, by where the package is: the learner's files live in a folder
    # called labkit too (labkit_home()/exercises/NN), which a substring test would skip.
    return not (path.startswith(_STDLIB) or path.startswith(_PACKAGE))


def learner_frame(err: BaseException, prefix: str = "") -> str:
    """" (at <file>, line N: <code>)" for the last frame outside labkit and torch, or ""."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if _is_learners(f.filename)]
    if not frames:
        return ""
    f = frames[-1]
    return f"{prefix} (at {Path(f.filename).name}, line {f.lineno}: {(f.line or '').strip()})"


def _name(fn: object) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _require_callable(answer: object, signature: str) -> Callable[..., Any]:
    if not callable(answer):
        raise ExerciseFailed(
            f"expected the function {signature}, got {type(answer).__name__} "
            f"{answer!r}; pass the function itself, without calling it"
        )
    return answer


def _require_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ExerciseFailed(
            f"{what} returned {type(value).__name__} {value!r}; return an int (counts are whole "
            "numbers: use // instead of /, and int(...) on tensors)"
        )
    return int(value)
