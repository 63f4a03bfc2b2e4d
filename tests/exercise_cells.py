"""Shared checks for a notebook's exercise cells: each test module keeps its cells' solution
sources (exactly as in the notebook) in a SOLUTIONS dict and runs these on every one."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from nbformat.v4 import new_code_cell, new_notebook

from labkit.course import exercises as ex
from labkit.course import nbgen


def run_cell(source: str):
    """Execute a cell's source; it ends with ``answer = <the learner's function>``."""
    namespace: dict = {}
    exec(compile(source, "<cell>", "exec"), namespace)
    return namespace["answer"]


def stub_of(source: str) -> str:
    """The learner copy's version of the cell (nbgen removes the solution)."""
    return nbgen.generate(new_notebook(cells=[new_code_cell(source, id="c")])).cells[0].source


def assert_check_passes(exercise_id: str, source: str, capsys: pytest.CaptureFixture) -> None:
    """The solution passes with one ✓ line, and the registered reference passes too."""
    mine = run_cell(source)
    assert ex.check(exercise_id, mine) is mine
    out = capsys.readouterr().out
    assert out.startswith(f"✓ {exercise_id}: ") and out.count("\n") == 1
    ex.verify(exercise_id, ex.get(exercise_id).reference)


def assert_stub_is_not_done(exercise_id: str, source: str, capsys: pytest.CaptureFixture,
                            *, secrets: Iterable[str] = ()) -> None:  # fmt: skip
    """The stub raises NotImplementedError, shows none of ``secrets`` (code of the solution),
    is reported "not done" with the first hint, and later cells get the reference."""
    stub = stub_of(source)
    assert f'raise NotImplementedError("{ex.STUB_MESSAGE}")' in stub
    assert "BEGIN SOLUTION" not in stub
    assert not [s for s in secrets if s in stub]
    with pytest.raises(ex.ExerciseIncomplete):
        ex.verify(exercise_id, run_cell(stub))
    # a stub whose source cannot be read still says "not done" (the NotImplementedError path)
    with pytest.raises(ex.ExerciseIncomplete):
        ex.verify(exercise_id, lambda *a: (_ for _ in ()).throw(NotImplementedError("x")))
    assert ex.check(exercise_id, run_cell(stub)) is ex.get(exercise_id).reference
    out = capsys.readouterr().out
    assert out.startswith(f"○ {exercise_id} (") and ex.get(exercise_id).hints[0] in out
