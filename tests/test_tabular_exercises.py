"""Notebook 08's exercise checks: they pass on the solutions, say "not done" on the stubs, and
name each usual mistake (plausible wrong answers below)."""

from __future__ import annotations

import pytest
from exercise_cells import assert_check_passes, assert_stub_is_not_done

from labkit.course import exercises as ex

# The solution cells of notebook 08, less their ex.check lines (same source, same stub).
SOLUTIONS = {
    "08.round_bytes": '''
def round_bytes(features: int, max_bin: int, max_depth: int, workers: int) -> float:
    """Bytes all workers put on the wire in one boosting round (a full tree, continuous features)."""
    # BEGIN SOLUTION
    histogram = features * max_bin * 2 * 8  # a gradient and a hessian, float64, per bin
    message = histogram * 2 ** (max_depth - 1)  # root + one child per split, to depth d - 1
    return 0.0 if workers == 1 else (2 * workers - 1) * message  # XGBoost's ring
    # END SOLUTION
answer = round_bytes
''',
    "08.matrix_bytes": '''
def matrix_bytes(rows: int, features: int, max_bin: int, quantile: bool) -> int:
    """Bytes a QuantileDMatrix (quantile=True) or a DMatrix holds once hist trained on it."""
    # BEGIN SOLUTION
    index = 1 if max_bin <= 256 else (2 if max_bin <= 65536 else 4)  # bytes per bin number
    quantised = 2 * rows * features * index + (rows + 1) * 8  # row and column layouts, offsets
    values = rows * features * 8 + (rows + 1) * 8  # CSR: (uint32 index, float32 value), offsets
    return quantised if quantile else quantised + values
    # END SOLUTION
answer = matrix_bytes
''',
}


def test_the_catalogue_of_notebook_08():
    assert [e.id for e in ex.catalogue("08")] == ["08.matrix_bytes", "08.round_bytes"]
    assert all(e.reference is not None for e in ex.catalogue("08"))


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_solution_passes(exercise_id, capsys):
    assert_check_passes(exercise_id, SOLUTIONS[exercise_id], capsys)


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_stub_is_not_done(exercise_id, capsys):
    secrets = {"08.round_bytes": ("2 * workers - 1", "2 ** (max_depth - 1)"),
               "08.matrix_bytes": ("2 * rows * features", "quantised + values")}[exercise_id]  # fmt: skip
    assert_stub_is_not_done(exercise_id, SOLUTIONS[exercise_id], capsys, secrets=secrets)


def _fails(exercise_id, fn, match):
    with pytest.raises(ex.ExerciseFailed, match=match):
        ex.verify(exercise_id, fn)


@pytest.mark.parametrize(("wrong", "named"), [
    (lambda f, b, d, w: 0.0 if w == 1 else (2 * w - 1) * f * b * 8 * 2 ** (d - 1), "hessian"),
    (lambda f, b, d, w: 0.0 if w == 1 else (2 * w - 1) * f * b * 16 * (2**d - 1), "subtraction trick"),
    (lambda f, b, d, w: 0.0 if w == 1 else (2 * w - 1) * f * b * 16 * 2**d, "leaves"),
    (lambda f, b, d, w: 2 * (w - 1) * f * b * 16 * 2 ** (d - 1), "textbook ring"),
    (lambda f, b, d, w: 0.0 if w == 1 else (2 * w - 1) / w * f * b * 16 * 2 ** (d - 1), "one worker's share"),
    (lambda f, b, d, w: f * b * 16 * 2 ** (d - 1), "message one worker puts into"),
    (lambda f, b, d, w: (2 * w - 1) * f * b * 16 * 2 ** (d - 1), "nothing on the wire"),
])  # fmt: skip
def test_round_bytes_names_each_mistake(wrong, named):
    _fails("08.round_bytes", wrong, named)


def _matrix(index_of=lambda b: 1 if b <= 256 else 2, layouts=2, offsets=True, values=True,
            quantised=True):
    def fn(rows, features, max_bin, quantile):
        q = layouts * rows * features * index_of(max_bin) + ((rows + 1) * 8 if offsets else 0)
        v = rows * features * 8 + (rows + 1) * 8
        if quantile:
            return q
        return (q if quantised else 0) + (v if values else 0)
    return fn


@pytest.mark.parametrize(("wrong", "named"), [
    (_matrix(layouts=1), "column layout"),
    (_matrix(offsets=False), "row layout needs an 8-byte offset per row"),
    ((lambda r, f, b, q: 2 * r * f * (1 if b <= 256 else 2) + 2 * (r + 1) * 8
      + (0 if q else r * f * 8 + (r + 1) * 8)), "counted twice"),
    (_matrix(index_of=lambda b: 4), "not a float32"),
    (_matrix(index_of=lambda b: 2 if b <= 256 else 4), "one size too large"),
    (_matrix(values=False), "keeps its stored values"),
    (_matrix(quantised=False), "also holds the quantised copy"),
])  # fmt: skip
def test_matrix_bytes_names_each_mistake(wrong, named):
    _fails("08.matrix_bytes", wrong, named)


def test_the_reveal_waits_for_the_learners_answer(capsys):
    from labkit.course.exercises import data_science

    ex.check("08.round_bytes", lambda f, b, d, w: 0.0)  # wrong: the reference is used
    assert "appears here once your answer passes" in data_science.reveal("08.round_bytes")
    ex.check("08.round_bytes", data_science.reference_round_bytes)
    assert "(2w-1)" in data_science.reveal("08.round_bytes")
