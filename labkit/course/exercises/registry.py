"""The exercise registry: what exercises exist, their hints, and how each is verified.

Each notebook's checks register their exercises here with :func:`exercise` when their module
(:data:`MODULES`) is imported, which :func:`get` and :func:`catalogue` do on first need: so
importing the package stays cheap. Apart from the check runner (:mod:`.running`) because the
registry is data, read by the runner, the hints, :mod:`labkit.course.nbgen` and the tests alike;
the errors a check ends with live here too, as every other module of the package raises them.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
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
    "08": "labkit.course.exercises.data_science",
}
"""Notebook -> the module that registers its exercises."""

TIME_LIMIT_S_DEFAULT = 60.0
"""How long an in-kernel check may run the learner's code: the checks themselves take well
under a second, so only code that never returns reaches it, even on a busy laptop."""



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
