"""Notebook 03's decision exercise, 03.choose_m: the solution passes, the stub is "not done",
each usual mistake is named without the answer, and the run's verdict follows the measured
steps (noise included)."""

from __future__ import annotations

import pytest
from exercise_cells import assert_check_passes, assert_stub_is_not_done

from labkit import verdict
from labkit.course import exercises as ex
from labkit.course.exercises import model_parallel as exmp

# The notebook's solution cell, less its ex.check line and what follows it.
SOLUTION = """
def choose_m(steps_s: dict[int, float], p: int, candidates: list[int]) -> int:
    \"\"\"The m among `candidates` whose 1F1B step is shortest, predicted from `steps_s`.\"\"\"
    # BEGIN SOLUTION
    # step(m) = (m + p − 1)·(T/m + c): the bubble formula's slots, each one micro-batch's share
    # of the compute T plus a fixed cost c per micro-batch; linear in T and c, so least squares
    rows = [((m + p - 1) / m, m + p - 1, t) for m, t in steps_s.items()]
    saa, sab, sbb = (sum(r[i] * r[j] for r in rows) for i, j in ((0, 0), (0, 1), (1, 1)))
    sat, sbt = (sum(r[i] * r[2] for r in rows) for i in (0, 1))
    det = saa * sbb - sab * sab
    T, c = (sat * sbb - sbt * sab) / det, (saa * sbt - sab * sat) / det
    return min(candidates, key=lambda m: (m + p - 1) * (T / m + c))
    # END SOLUTION
answer = choose_m
"""


def test_the_notebook_cell_is_the_one_tested():
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).parents[1] / "solutions" / "03_model_parallelism.ipynb").read_text())
    sources = ["".join(c["source"]) for c in nb["cells"]]  # a cell's source: a str or its lines
    cell = next(s for s in sources if "def choose_m(" in s)
    body = SOLUTION.strip().removesuffix("answer = choose_m").strip()
    assert body in cell


def test_solution_passes(capsys):
    assert_check_passes("03.choose_m", SOLUTION, capsys)


def test_stub_is_not_done(capsys):
    assert_stub_is_not_done("03.choose_m", SOLUTION, capsys,
                            secrets=("T / m + c", "det", "m + p - 1"))  # fmt: skip


def two_points(steps_s, p, candidates):
    # another right answer: T and c from the smallest and largest measured m alone
    (m1, t1), (m2, t2) = min(steps_s.items()), max(steps_s.items())
    a1, b1, a2, b2 = (m1 + p - 1) / m1, m1 + p - 1, (m2 + p - 1) / m2, m2 + p - 1
    det = a1 * b2 - a2 * b1
    T, c = (t1 * b2 - t2 * b1) / det, (a1 * t2 - a2 * t1) / det
    return min(candidates, key=lambda m: (m + p - 1) * (T / m + c))


def fastest_measured(steps_s, p, candidates):
    return min(steps_s, key=steps_s.get)


def most(steps_s, p, candidates):
    return max(candidates)


def fewest(steps_s, p, candidates):
    return min(candidates)


def not_a_candidate(steps_s, p, candidates):
    return 3


def hard_coded_4(steps_s, p, candidates):
    return 4  # right for the notebook's lab pipeline on one CPU, not elsewhere


def hard_coded_8(steps_s, p, candidates):
    return 8


def test_two_points_fit_passes_too():
    assert "picks the fastest" in ex.verify("03.choose_m", two_points)


@pytest.mark.parametrize(
    ("wrong", "says"),
    [
        (fastest_measured, "fastest m that was measured"),
        (most, "the most micro-batches"),
        (fewest, "one micro-batch"),
        (not_a_candidate, "choose one of the candidates"),
        (hard_coded_4, "slower than a larger candidate"),
        (hard_coded_8, "slower than a smaller candidate"),
    ],
    ids=lambda v: getattr(v, "__name__", "message"),
)
def test_each_usual_mistake_is_named_without_the_answer(wrong, says):
    with pytest.raises(ex.ExerciseFailed, match=says) as failed:
        ex.verify("03.choose_m", wrong)
    said = str(failed.value)
    steps, p, candidates, _what = next(c for c in exmp.M_CASES if c[3] in said)
    right = exmp.reference_choose_m(steps, p, candidates)
    assert f"m = {right}" not in said and f"m = {right}:" not in said


def test_a_float_or_a_non_function_is_reported():
    with pytest.raises(ex.ExerciseFailed, match="return one of the candidates, an int"):
        ex.verify("03.choose_m", lambda s, p, c: 4.0)
    with pytest.raises(ex.ExerciseFailed, match="pass the function itself"):
        ex.verify("03.choose_m", 4)


def test_the_fit_recovers_the_model_and_the_cases_separate_the_mistakes():
    steps = {m: exmp.predicted_step(m, 2, 0.136, 0.0047) for m in (1, 2, 4, 8)}
    T, c = exmp.fit_m_model(steps, 2)
    assert T == pytest.approx(0.136) and c == pytest.approx(0.0047)
    with pytest.raises(ValueError, match="two or more m"):
        exmp.fit_m_model({4: 0.2}, 2)
    for wrong in (fastest_measured, most, fewest, hard_coded_4, hard_coded_8):
        assert any(wrong(s, p, c) != exmp.reference_choose_m(s, p, c) for s, p, c, _ in exmp.M_CASES)


def _steps(median_s, n=7, spread=0.02):
    return [median_s * (1 + spread * ((i % 5) - 2) / 2) for i in range(n)]


@pytest.mark.parametrize(
    ("steps", "says"),
    [
        ({2: _steps(0.22), 4: _steps(0.19), 8: _steps(0.20)}, "the plan held"),
        ({2: _steps(0.22), 4: _steps(0.19), 8: _steps(0.15)}, "the plan missed: m = 8 ran faster"),
        ({2: _steps(0.22), 4: [0.1, 0.3, 0.15, 0.25, 0.12, 0.28, 0.2], 8: _steps(0.20)},
         "too noisy to tell"),
    ],
    ids=["held", "missed", "noisy"],
)
def test_the_run_verdict_follows_the_measured_steps(steps, says):
    text = exmp.judge_m_plan(4, steps)
    assert says in text.splitlines()[-1]
    assert verdict.contradictions(text) == []


def test_a_choice_that_is_not_a_candidate_runs_nothing():
    assert "nothing run" in exmp.run_m_plan(3, [1, 2, 4], {"seq_len": 8}, 4)


@pytest.mark.slow
def test_a_chosen_m_runs_for_real_beside_its_neighbours():
    model = {"seq_len": 16, "n_layer": 2, "n_head": 2, "d_model": 32}
    text = exmp.run_m_plan(2, [1, 2, 4, 8], model, 8)
    lines = text.splitlines()
    assert lines[0].startswith("ran 1F1B on 2 ranks (gloo), batch 8, m = 1, 2, 4: 5 timed steps")
    assert sum(line.startswith("verdict: ") for line in lines) == 2
    assert lines[-1].startswith(("the plan held", "the plan missed", "no neighbour ran clearly"))
