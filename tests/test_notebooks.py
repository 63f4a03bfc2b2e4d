"""Every notebook runs as a test.

* ``solutions/`` (the complete notebooks) run top to bottom at smoke size under papermill,
  here, and under nbval (lax), which pytest collects from ``solutions/`` itself (see
  ``[tool.pytest.ini_options]``).
* A deliberately bad parameter must stop a notebook early with an error that names it.
* ``notebooks/`` (the learners' copies) are generated from ``solutions/`` (checked in
  ``test_nbgen.py``); run as they are, they stop at the first exercise with its hint.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import papermill as pm
import pytest

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
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
    assert [p.name[:2] for p in SOLUTIONS][:2] == ["00", "01"]


@pytest.mark.slow
@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_solution_runs_at_smoke_size_and_states_its_tier(path, tmp_path):
    nb = execute(path, tmp_path / path.name, size="smoke")
    text = outputs_text(nb)
    assert "Tier: cpu" in text or "Tier: single-gpu" in text or "Tier: multi-gpu" in text
    # every exercise check in a solution passes
    n_checks = sum(cell.source.count("ex.check(") + cell.source.count("check_in_workers(")
                   for cell in nb.cells if cell.cell_type == "code")
    assert text.count("✓") >= n_checks


@pytest.mark.slow
@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_bad_size_parameter_fails_early_naming_it(path, tmp_path):
    with pytest.raises(pm.PapermillExecutionError) as err:
        execute(path, tmp_path / path.name, size="huge")
    assert err.value.ename == "ValueError"
    assert "size='huge' is not allowed" in err.value.evalue
    assert "smoke" in err.value.evalue  # and says what is allowed


@pytest.mark.slow
def test_learner_notebook_stops_at_the_first_exercise_with_its_hint(tmp_path):
    learner = ROOT / "notebooks" / "01_single_gpu_training.ipynb"
    with pytest.raises(pm.PapermillExecutionError) as err:
        execute(learner, tmp_path / learner.name, size="smoke")
    assert err.value.ename == "ExerciseIncomplete"
    assert "Exercise 01.param_count is not done yet" in err.value.evalue
    assert "tied to the token embedding" in err.value.evalue  # the hint


def test_notebooks_have_a_parameters_cell_reading_the_environment():
    for path in SOLUTIONS:
        nb = nbformat.read(path, as_version=4)
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{path.name}: exactly one cell tagged 'parameters'"
        assert 'os.environ.get("LABKIT_SIZE", "lab")' in tagged[0].source, path.name
