"""Notebook 01's decision exercise, 01.batch_plan: the solution passes, the stub is "not done",
each usual mistake is named without the answer, and the real run says whether a plan held."""

from __future__ import annotations

import math

import pytest
from exercise_cells import assert_check_passes, assert_stub_is_not_done

from labkit.config import ModelConfig, TrainConfig
from labkit.course import exercises as ex
from labkit.course.exercises import single_gpu

# The notebook's solution cell, less its ex.check line (same source, so the same stub).
SOLUTION = """
import math


def plan_batch(peaks: dict[int, int], budget: int) -> int:
    \"\"\"The largest batch whose step peak, predicted from `peaks` ({batch: measured bytes}),
    fits in `budget` bytes; 0 if none does.\"\"\"
    # BEGIN SOLUTION
    (b1, p1), *_, (b2, p2) = sorted(peaks.items())
    per_sequence = (p2 - p1) / (b2 - b1)  # what one more sequence adds to the peak
    fixed = p1 - per_sequence * b1  # what does not grow with the batch: the peak at batch 0
    return max(0, math.floor((budget - fixed) / per_sequence))
    # END SOLUTION
answer = plan_batch
"""


def test_solution_passes(capsys):
    assert_check_passes("01.batch_plan", SOLUTION, capsys)


def test_stub_is_not_done(capsys):
    assert_stub_is_not_done("01.batch_plan", SOLUTION, capsys,
                            secrets=("per_sequence", "math.floor", "fixed ="))  # fmt: skip


def _line(peaks):
    (b1, p1), *_, (b2, p2) = sorted(peaks.items())
    k = (p2 - p1) / (b2 - b1)
    return p1 - k * b1, k


def least_squares(peaks, budget):
    # another right answer: a least-squares line through every point
    return single_gpu.reference_plan_batch(peaks, budget)


def proportional(peaks, budget):
    b, p = max(peaks.items())
    return math.floor(budget * b / p)


def measured_peak_as_fixed(peaks, budget):
    _, k = _line(peaks)
    _b, p = min(peaks.items())
    return math.floor((budget - p) / k)


def rounded(peaks, budget):
    fixed, k = _line(peaks)
    return max(0, round((budget - fixed) / k))


def ceiled(peaks, budget):
    fixed, k = _line(peaks)
    return max(0, math.ceil((budget - fixed) / k))


def one_less(peaks, budget):
    fixed, k = _line(peaks)
    return max(0, math.floor((budget - fixed) / k) - 1)


def at_least_one(peaks, budget):
    fixed, k = _line(peaks)
    return max(1, math.floor((budget - fixed) / k))


def largest_measured(peaks, budget):
    return max(b for b, p in peaks.items() if p <= budget) if min(peaks.values()) <= budget else 0


def hard_coded(peaks, budget):
    return 52  # right for the notebook's lab preset only


@pytest.mark.parametrize(
    ("wrong", "says"),
    [
        (proportional, "scales the whole measured peak with the batch"),
        (measured_peak_as_fixed, "treats a measured peak itself as the part that does not grow"),
        (rounded, "rounded up"),
        (ceiled, "rounded up"),
        (one_less, "fits too"),
        (at_least_one, "not even one sequence fits"),
        (largest_measured, "one of the measured batch sizes"),
        (hard_coded, "batches larger than 52 fit too"),
    ],
    ids=lambda v: getattr(v, "__name__", "message"),
)
def test_each_usual_mistake_is_named(wrong, says):
    with pytest.raises(ex.ExerciseFailed, match=says) as failed:
        ex.verify("01.batch_plan", wrong)
    # the diagnosis never carries the answer: no case's right batch appears as a number
    said = str(failed.value)
    case = next(c for c in single_gpu.BATCH_PLAN_CASES
                if f"{c[2]}," in said)  # the case the message names  # fmt: skip
    right = single_gpu.reference_plan_batch(case[0], case[1])
    assert f"batch of {right}:" not in said and f"returned a batch of {right}" not in said


def test_least_squares_through_three_points_passes():
    assert "largest batch" in ex.verify("01.batch_plan", least_squares)


def test_answers_that_are_not_ints_or_raise_are_reported():
    with pytest.raises(ex.ExerciseFailed, match="return an int"):
        ex.verify("01.batch_plan", lambda peaks, budget: 3.0)
    with pytest.raises(ex.ExerciseFailed, match="ZeroDivisionError"):
        ex.verify("01.batch_plan", lambda peaks, budget: budget // 0)
    with pytest.raises(ex.ExerciseFailed, match="pass the function itself"):
        ex.verify("01.batch_plan", 52)


def test_every_case_has_a_batch_of_its_own_for_each_mistake():
    # the cases are what make the diagnoses possible: each mistake fails at least one of them
    for wrong in (proportional, measured_peak_as_fixed, rounded, one_less, at_least_one,
                  largest_measured, hard_coded):
        assert any(wrong(dict(p), b) != single_gpu.reference_plan_batch(p, b)
                   for p, b, _ in single_gpu.BATCH_PLAN_CASES), wrong.__name__


# --------------------------------------------------------------------------- the real run


def fake_measure(fixed, per_seq):
    return lambda b: fixed + per_seq * b


@pytest.mark.parametrize(
    ("planned", "says"),
    [(10, "the plan held: a batch of 10 fits and 11 does not"),
     (11, "the plan did not hold: a batch of 11 does not fit"),
     (8, "the plan left room: a batch of 9 fits too")],
)
def test_the_run_says_what_the_measured_peaks_say(planned, says, capsys):
    measure = fake_measure(1000, 100)  # batch 10 peaks at 2000 B, 11 at 2100 B
    assert single_gpu.run_batch_plan(planned, 2050, measure).startswith(says)
    out = capsys.readouterr().out
    assert f"batch {planned:>4}: peak" in out and "measured" in out


def test_the_run_of_a_plan_of_nothing():
    assert "not even one sequence fits" in single_gpu.run_batch_plan(0, 500, fake_measure(1000, 100))
    assert "a batch of 1 fits too" in single_gpu.run_batch_plan(0, 5000, fake_measure(1000, 100))


def test_a_plan_from_two_real_peaks_holds_on_a_real_step():
    # the notebook's path, on a small model: measured peaks (CPU live tensor bytes) at b and
    # 2b, a budget of three times the first, and the plan run for real
    from labkit.batching import trials
    from labkit.model import GPT

    model = GPT(ModelConfig(vocab_size=256, seq_len=16, n_layer=1, n_head=2, d_model=32))
    train_cfg = TrainConfig(micro_batch=4)

    def measure(b):
        return trials.measure_step_peak(model, b, seq_len=16, train_cfg=train_cfg)

    peaks = {4: measure(4), 8: measure(8)}
    planned = single_gpu.reference_plan_batch(peaks, 3 * peaks[4])
    assert planned > 8
    assert single_gpu.run_batch_plan(planned, 3 * peaks[4], measure).startswith("the plan held")
