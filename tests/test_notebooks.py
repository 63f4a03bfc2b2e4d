"""Every notebook runs as a test.

* ``solutions/`` (the complete notebooks) run top to bottom at smoke size under nbval (lax),
  which pytest collects from ``solutions/`` itself (see ``[tool.pytest.ini_options]``), with
  ``LABKIT_EXPECT_SOLVED=1`` (``tests/conftest.py``): every exercise check must pass there, or
  its cell fails.
* A deliberately bad parameter must stop a notebook early with an error that names it.
* ``notebooks/`` (the learners' copies) are generated from ``solutions/``, stored outputs
  included (checked in ``test_nbgen.py``); run as they are, top to bottom, here under
  papermill, they reach the last cell, each unfinished exercise reporting itself in one line,
  state their tier, and print no verdict their numbers contradict (the measuring cells are
  the solutions' own). Each notebook runs twice in CI: once complete (nbval), once as a
  learner's copy (papermill). It used to run four times, then three: the third, the complete
  notebook again under papermill, checked nothing these two runs do not.
* With ``LABKIT_EXECUTED_DIR`` set (CI does), each learner's copy that passes is also saved
  there, stamped with its run, for ``./course book --executed`` to render unexecuted again.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import nbformat
import papermill as pm
import pytest

from labkit import ids, verdict
from labkit.course import book
from labkit.course import exercises as ex

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob(ids.NOTEBOOK_GLOB))
TIMEOUT_S = 300  # per cell: a hung cell fails the test instead of stalling CI


def execute(path: Path, out: Path, **parameters):
    return pm.execute_notebook(
        str(path), str(out), parameters=parameters, cwd=str(path.parent), kernel_name="python3",
        execution_timeout=TIMEOUT_S, progress_bar=False, log_output=False,
    )


def outputs_text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", ""))
            parts.append(out.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def test_there_are_notebooks():
    assert [ids.notebook_id(p) for p in SOLUTIONS][:2] == ["00", "01"]


@pytest.mark.slow
def test_bad_size_parameter_fails_early_naming_it(tmp_path):
    # One notebook run for real (a kernel start costs seconds, seven cost half a minute of
    # CI); that every notebook validates first is checked statically just below.
    path = SOLUTIONS[0]
    with pytest.raises(pm.PapermillExecutionError) as err:
        execute(path, tmp_path / path.name, size="huge")
    assert err.value.ename == "ValueError"
    assert "size='huge' is not allowed" in err.value.evalue
    assert "smoke" in err.value.evalue  # and says what is allowed


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_every_notebook_validates_its_size_before_doing_anything(path):
    """The cell after the parameters does nothing but imports before config.preset(size), so
    a bad size fails there, as the live run above shows for one notebook, before any work."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    at = next(i for i, c in enumerate(code) if "parameters" in c.metadata.get("tags", []))
    body = ast.parse(code[at + 1].source).body
    first = next(n for n in body if not isinstance(n, (ast.Import, ast.ImportFrom)))
    call = first.value if isinstance(first, (ast.Expr, ast.Assign)) else None
    assert isinstance(call, ast.Call) and ast.unparse(call) == "config.preset(size)", (
        f"{path.name}: the cell after the parameters must call config.preset(size) before "
        f"anything but imports; it starts with {ast.unparse(first)!r}"
    )


LEARNER_COPIES = sorted((ROOT / "notebooks").glob(ids.NOTEBOOK_GLOB))


# 01 and 02 print the verdicts that depend most on noisy timings: their learner copies run
# beside a CPU load in tests/test_verdicts_under_load.py, which makes the same checks.
UNDER_LOAD = ("01_single_gpu_training", "02_data_parallelism")


def check_learner_run(path: Path, nb) -> str:
    """Run All on a fresh learner's copy: nothing stopped it (papermill raises on any error),
    the last cell ran, every exercise said "not done yet" in one line, the tier was stated and
    no verdict contradicts its numbers. Returns the printed text."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code[-1].execution_count is not None and code[-1].outputs, "the last cell ran"
    text = outputs_text(nb)
    exercises = ex.catalogue(ids.notebook_id(path))
    calls = sum(c.source.count("ex.check(") + c.source.count("ex.check_in_workers(") for c in code)
    assert calls == len(exercises)
    for e in exercises:
        lines = [line for line in text.splitlines() if line.startswith(f"○ {e.id} (")]
        assert len(lines) == 1 and "not done yet" in lines[0] and e.hints[0] in lines[0], e.id
        # neither passed nor failed: not done (other ✓ lines, such as doctor's, are fine)
        assert f"✓ {e.id}:" not in text and f"✗ {e.id} (" not in text, e.id
    # (no cell raised: papermill would have; nb00 prints a failing rank's traceback on purpose)
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    assert "Tier: cpu" in text or "Tier: single-gpu" in text or "Tier: multi-gpu" in text
    # no printed verdict contradicts the numbers printed with it
    assert verdict.contradictions(text) == []
    if os.environ.get("LABKIT_EXECUTED_DIR"):  # CI's book renders this run: no second execution
        book.keep(nb, Path(os.environ["LABKIT_EXECUTED_DIR"]) / path.name)
    return text


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in LEARNER_COPIES if p.stem not in UNDER_LOAD],
                         ids=lambda p: p.stem)  # fmt: skip
def test_learner_copy_runs_to_the_last_cell_with_every_exercise_reported_not_done(path, tmp_path):
    check_learner_run(path, execute(path, tmp_path / path.name, size="smoke"))


def test_notebooks_have_a_parameters_cell_reading_the_environment():
    for path in SOLUTIONS:
        nb = nbformat.read(path, as_version=4)
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{path.name}: exactly one cell tagged 'parameters'"
        assert 'os.environ.get("LABKIT_SIZE", "lab")' in tagged[0].source, path.name
