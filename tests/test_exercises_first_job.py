"""Notebook 00's exercise check: it passes on the solution, says "not done" on the stub, and
names each usual mistake."""

from __future__ import annotations

import pytest
from exercise_cells import assert_check_passes, assert_stub_is_not_done

from labkit import exercises as ex
from labkit.exercises import first_job

# The solution cell of notebook 00, less its ex.check line (same source, so the same stub).
SOLUTIONS = {
    "00.ring_bytes": """
def ring_bytes_sent(numel: int, n_ranks: int, bytes_per_element: int = 4) -> float:
    \"\"\"Bytes one rank sends in a ring all-reduce of numel elements over n_ranks ranks.\"\"\"
    # BEGIN SOLUTION
    chunk = numel * bytes_per_element / n_ranks  # the message cut into one chunk per rank
    steps = 2 * (n_ranks - 1)  # reduce-scatter, then all-gather: p - 1 steps each
    return steps * chunk
    # END SOLUTION
answer = ring_bytes_sent
""",
}


def test_the_catalogue_of_notebook_00():
    assert [e.id for e in ex.catalogue("00")] == sorted(SOLUTIONS)
    assert all(e.reference is not None for e in ex.catalogue("00"))


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_solution_passes(exercise_id, capsys):
    assert_check_passes(exercise_id, SOLUTIONS[exercise_id], capsys)


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_stub_is_not_done(exercise_id, capsys):
    assert_stub_is_not_done(exercise_id, SOLUTIONS[exercise_id], capsys,
                            secrets=("2 * (n_ranks - 1)", "steps * chunk"))  # fmt: skip


def whole_message(numel, n_ranks, bytes_per_element=4):
    return numel * bytes_per_element


@pytest.mark.parametrize(
    ("wrong", "says"),
    [
        (whole_message, "right on 2 ranks only"),
        (lambda numel, p, e=4: 2 * numel * e, "whole message twice"),
        (lambda numel, p, e=4: (p - 1) / p * numel * e, "reduce-scatter alone"),
        (lambda numel, p, e=4: 2 * (p - 1) * numel * e, "whole message twice"),  # 2 ranks: 2S
        (lambda numel, p, e=4: 2 * (p - 1) / p * numel, "counts elements, not bytes"),
        (lambda numel, p, e=4: 2 * (p - 1) / p * numel * 4, "passes bytes_per_element=2"),
        (lambda numel, p, e=4: 2 * (p - 1) * numel * e if p > 2 else numel * e,
         "what all p ranks send together"),
        (lambda numel, p, e=4: 2 * (p - 1) * numel * e + 1, "count per phase"),
    ],
    ids=["whole", "twice", "half-phase", "whole-per-step", "elements", "fixed-4-bytes",
         "all-ranks", "other"],
)
def test_each_usual_mistake_is_named(wrong, says):
    with pytest.raises(ex.ExerciseFailed, match=says):
        ex.verify("00.ring_bytes", wrong)


def test_a_failure_names_the_case_and_the_learners_value_but_not_the_target():
    # 3 ranks, 3000 float32 elements: the target is 2·2/3·12000 = 8000 bytes; whole_message
    # returns 12000. The message must carry the case and 12,000, never 8,000.
    with pytest.raises(ex.ExerciseFailed) as failed:
        ex.verify("00.ring_bytes", whole_message)
    said = str(failed.value)
    assert "whole_message(3000, 3, 4)" in said and "12,000" in said
    assert "8,000" not in said and "8000" not in said


def test_the_whole_message_passes_two_ranks_and_fails_three():
    # the point of the cases: on the notebook's 2 ranks S is right, so the check cannot stop there
    assert whole_message(2**16, 2) == first_job.reference_ring_bytes_sent(2**16, 2)
    with pytest.raises(ex.ExerciseFailed, match=r"ring_bytes_sent|whole_message\(3000, 3, 4\)"):
        ex.verify("00.ring_bytes", whole_message)


def test_answers_that_are_not_numbers_or_raise_are_reported():
    with pytest.raises(ex.ExerciseFailed, match="return a number of bytes"):
        ex.verify("00.ring_bytes", lambda numel, p, e=4: "1024")
    with pytest.raises(ex.ExerciseFailed, match="ZeroDivisionError"):
        ex.verify("00.ring_bytes", lambda numel, p, e=4: numel / 0)
    with pytest.raises(ex.ExerciseFailed, match="pass the function itself"):
        ex.verify("00.ring_bytes", 42)
