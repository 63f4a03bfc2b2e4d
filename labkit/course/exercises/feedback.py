"""What a learner reads: the one line a check prints, the hints in steps, whose answer ran.

:func:`report` prints ✓, ○ (not done yet, with the first hint) or ✗ (with the diagnosis) and
remembers the outcome for :func:`whose`; :func:`hint` gives one more hint per call. The
kernel's record of hints shown and checks passed lives here, with the only code that reads it.
Apart from the runner (:mod:`.running`) so that the wording can be read in one place.
"""

from __future__ import annotations

import os

from labkit.course.exercises.registry import ExerciseError, ExerciseIncomplete, NotSolved, get
from labkit.validate import whole

EXPECT_SOLVED = "LABKIT_EXPECT_SOLVED"
"""Environment variable: "1" makes every check that does not pass raise :class:`NotSolved`
after printing its line, so Run All stops there. For complete notebooks (the tests run
``solutions/`` with it; an instructor checking their own solutions can too); a learner's copy
runs without it, and its unfinished exercises only print their line."""



_HINTS_SHOWN: dict[str, int] = {}  # id -> how many hints this kernel has shown
_PASSED: dict[str, bool] = {}  # id -> did its last check in this kernel pass



# --------------------------------------------------------------------------- hints


def hint(exercise_id: str, level: int | None = None) -> None:
    """Print the next hint for ``exercise_id`` (or hint number ``level``, 1-based).

    The first hint is conceptual; each call shows one more; the last is the recipe.
    """
    hints = get(exercise_id).hints
    if level is None:  # the next one: "not done yet" already showed the first
        level = min(_HINTS_SHOWN.get(exercise_id, 0) + 1, len(hints))
    level = whole("level", level, low=1, high=len(hints),
                  why=f"{exercise_id} has hints 1 to {len(hints)}")  # fmt: skip
    _HINTS_SHOWN[exercise_id] = max(level, _HINTS_SHOWN.get(exercise_id, 0))
    last = level == len(hints)
    more = (
        "this is the last hint: the recipe"
        if last
        else f'ex.hint("{exercise_id}") again for hint {level + 1}'
    )
    print(f"Hint {level} of {len(hints)} for {exercise_id}: {hints[level - 1]}\n({more})")



def as_sentence(text: str) -> str:
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
        said = as_sentence(f"{outcome} ({where})" if where else outcome)
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
        print(f"○ {exercise_id} ({ex.title}) is not done yet. Hint: {as_sentence(ex.hints[0])} "
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



def whose(exercise_id: str) -> str:
    """"your answer" if the exercise's last check in this kernel passed, else "the reference
    answer": a later cell that uses the result says which it ran on."""
    get(exercise_id)
    return "your answer" if _PASSED.get(exercise_id) else "the reference answer"
