"""Notebooks 02b's and 03d's exercise checks: they pass on the solutions, say "not done" on the
stubs, and name each usual mistake (plausible wrong answers below)."""

from __future__ import annotations

import math

import pytest
from exercise_cells import assert_check_passes, assert_stub_is_not_done

from labkit import planner
from labkit.course import exercises as ex
from labkit.course.exercises import planning, resilience

# The solution cells of notebooks 02b and 03d, less their ex.check lines (same source, same stub).
SOLUTIONS = {
    "02b.checkpoint_plan": '''
import math


def checkpoint_plan(blocking_s: float, restart_s: float, mtbf_s: float) -> tuple[float, float]:
    """Young's checkpoint interval (s), and the share of the time lost to saves, lost work and restarts."""
    # BEGIN SOLUTION
    tau = math.sqrt(2 * blocking_s * mtbf_s)  # where d/dτ [δ/τ + τ/(2M)] = 0
    waste = blocking_s / tau + (tau / 2 + restart_s) / mtbf_s
    return tau, waste
    # END SOLUTION
answer = checkpoint_plan
''',
    "03d.choose_layout": '''
def choose_layout(predictions, memory_bytes: float, usable_memory: float):
    """The fastest prediction whose memory fits in usable_memory × memory_bytes; None if none does."""
    # BEGIN SOLUTION
    fits = [p for p in predictions if p.memory["total"] <= usable_memory * memory_bytes]
    return min(fits, key=lambda p: p.step_s) if fits else None
    # END SOLUTION
answer = choose_layout
''',
}


def test_the_catalogues_of_notebooks_02b_and_03d():
    assert [e.id for e in ex.catalogue("02b")] == ["02b.checkpoint_plan"]
    assert [e.id for e in ex.catalogue("03d")] == ["03d.choose_layout"]
    assert all(e.reference is not None for e in ex.catalogue("02b") + ex.catalogue("03d"))


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_solution_passes(exercise_id, capsys):
    assert_check_passes(exercise_id, SOLUTIONS[exercise_id], capsys)


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_stub_is_not_done(exercise_id, capsys):
    secrets = {"02b.checkpoint_plan": ("math.sqrt(2", "tau / 2 + restart_s"),
               "03d.choose_layout": ("usable_memory * memory_bytes", "min(fits")}[exercise_id]  # fmt: skip
    assert_stub_is_not_done(exercise_id, SOLUTIONS[exercise_id], capsys, secrets=secrets)


# --- 02b.checkpoint_plan: each plausible mistake gets its own diagnosis ---------------------------


def _young(d, m):
    return math.sqrt(2 * d * m)


@pytest.mark.parametrize(
    ("wrong", "says"),
    [
        (lambda d, r, m: (math.sqrt(d * m), 0.0), "a 2 under the root"),
        (lambda d, r, m: (2 * d * m, 0.0), "without the square root"),
        (lambda d, r, m: (_young(d, m) / 60, 0.0), "minutes"),
        (lambda d, r, m: (_young(d, m) - d, 0.0), "Daly"),
        (lambda d, r, m: (_young(d, m), d / _young(d, m) + _young(d, m) / (2 * m)),
         "restart is missing"),
        (lambda d, r, m: (_young(d, m), d / _young(d, m) + (_young(d, m) + r) / m), "τ/2"),
        (lambda d, r, m: (_young(d, m), 100 * (d / _young(d, m) + (_young(d, m) / 2 + r) / m)),
         "percentage"),
        (lambda d, r, m: (_young(d, m), d / _young(d, m)), "saves only"),
        (lambda d, r, m: _young(d, m), "return two numbers"),
    ],
    ids=["no-2", "no-sqrt", "minutes", "daly", "no-restart", "tau-not-half", "percent",
         "saves-only", "one-number"],
)
def test_each_usual_checkpoint_mistake_is_named(wrong, says):
    with pytest.raises(ex.ExerciseFailed, match=says):
        ex.verify("02b.checkpoint_plan", wrong)


def test_the_checkpoint_failure_does_not_hand_over_the_target():
    with pytest.raises(ex.ExerciseFailed) as failed:
        ex.verify("02b.checkpoint_plan", lambda d, r, m: (math.sqrt(d * m), 0.0))
    said = str(failed.value)
    right = resilience.reference_checkpoint_plan(*resilience.CASES[0])[0]
    assert f"{right:,.6g}" not in said and f"{right:.1f}" not in said


# --- 03d.choose_layout ----------------------------------------------------------------------------


def fastest_of_all(predictions, memory_bytes, usable_memory):
    return min(predictions, key=lambda p: p.step_s)


def planners_own_fits(predictions, memory_bytes, usable_memory):
    # the planner's .fits was computed at 100 % (the check plans at 1.0): the reserve is ignored
    return min((p for p in predictions if p.fits), key=lambda p: p.step_s)


def whole_memory(predictions, memory_bytes, usable_memory):
    return planning.reference_choose_layout(predictions, memory_bytes, 1.0)


def smallest(predictions, memory_bytes, usable_memory):
    fits = [p for p in predictions if p.memory["total"] <= usable_memory * memory_bytes]
    return min(fits, key=lambda p: p.memory["total"])


def reserve_inverted(predictions, memory_bytes, usable_memory):
    fits = [p for p in predictions if p.memory["total"] <= (1 - usable_memory) * memory_bytes]
    return min(fits, key=lambda p: p.step_s) if fits else None


@pytest.mark.parametrize(
    ("wrong", "says"),
    [
        (fastest_of_all, "does not fit at all"),
        (planners_own_fits, "not under the reserve"),
        (whole_memory, "not under the reserve"),
        (smallest, "least memory"),
        (reserve_inverted, "share a layout may fill"),
        (lambda preds, cap, u: min(preds, key=lambda p: p.step_s).step_s, "return one of the predictions"),
    ],
    ids=["ignores-memory", "planner-fits", "whole-memory", "smallest", "inverted", "a-number"],
)
def test_each_usual_layout_mistake_is_named(wrong, says):
    with pytest.raises(ex.ExerciseFailed, match=says):
        ex.verify("03d.choose_layout", wrong)


def test_the_check_covers_a_setting_where_the_reserve_changes_the_answer():
    # without such a setting "ignore the reserve" would pass
    changed = [(u, what) for preds, cap, u, what in planning._cases()
               if planning.reference_choose_layout(preds, cap, u)
               is not planning.reference_choose_layout(preds, cap, 1.0)]  # fmt: skip
    assert changed, "no checked setting where the reserve changes the choice"
    case = planner.published_cases(mfu=0.5)[0]
    assert case.cluster.device.memory_bytes == planning._cases()[0][1]
