import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from labkit.course import exercises as ex
from labkit.course import nbgen

REPO = Path(__file__).resolve().parents[1]

SOLUTION_CODE = """\
import math

def count_params(cfg):
    \"\"\"Parameters of the GPT.\"\"\"
    # BEGIN SOLUTION
    h = cfg.d_model
    return cfg.vocab_size * h + cfg.n_layer * (12 * h * h + 13 * h) + 2 * h
    # END SOLUTION

class Timer:
    def stop(self):
        if True:
            # BEGIN SOLUTION
            self.end = 1
            # END SOLUTION
        return self.end

# BEGIN SOLUTION
x = math.pi
# END SOLUTION
print(x)"""

STUB_CODE = """\
import math

def count_params(cfg):
    \"\"\"Parameters of the GPT.\"\"\"
    raise NotImplementedError("exercise not done yet: replace this line with your code")

class Timer:
    def stop(self):
        if True:
            raise NotImplementedError("exercise not done yet: replace this line with your code")
        return self.end

raise NotImplementedError("exercise not done yet: replace this line with your code")
print(x)"""


def solution_notebook() -> nbformat.NotebookNode:
    nb = new_notebook(
        metadata={
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}
        }
    )
    code = new_code_cell(
        SOLUTION_CODE,
        id="code-1",
        execution_count=7,
        metadata={"tags": ["exercise"], "execution": {"iopub.status.busy": "x"}},
    )
    code.outputs = [new_output("stream", name="stdout", text="3.14\n")]
    nb.cells = [
        new_markdown_cell(
            "# Title\n\nWhy?\n<!-- BEGIN SOLUTION -->\nBecause.\n<!-- END SOLUTION -->\nDone.",
            id="md-1",
        ),
        code,
        new_code_cell("# no markers here\ny = 2", id="code-2", execution_count=8),
    ]
    nb.metadata["widgets"] = {"state": {}}
    return nb


def write(path: Path, nb: nbformat.NotebookNode) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(nbformat.writes(nb), encoding="utf-8")
    return path


def test_code_regions_become_stubs_at_their_indentation_that_give_nothing_away():
    out = nbgen.generate(solution_notebook(), name="x.ipynb")
    assert out.cells[1].source == STUB_CODE
    namespace: dict = {}
    with pytest.raises(NotImplementedError, match=r"^exercise not done yet: replace this line"):
        exec(compile(out.cells[1].source, "stub", "exec"), namespace)


def test_a_hint_inside_a_region_is_refused_because_the_stub_would_carry_it():
    nb = new_notebook(cells=[new_code_cell(
        "def f():\n    # BEGIN SOLUTION\n    # HINT: return 42\n    return 42\n    # END SOLUTION",
        id="c")])  # fmt: skip
    with pytest.raises(nbgen.MarkerError, match=r"'# HINT:' on line 3: a stub carries no hint"):
        nbgen.generate(nb, name="x.ipynb")


def test_generated_notebooks_carry_the_kernels_whole_language_info():
    # With only {"name": "python"}, JupyterLab rewrites the field as the kernel starts and
    # the notebook shows as modified before anything ran.
    out = nbgen.generate(solution_notebook())
    assert out.metadata["language_info"] == nbgen.LANGUAGE_INFO
    assert set(nbgen.LANGUAGE_INFO) >= {"codemirror_mode", "mimetype", "pygments_lexer", "version"}
    for path in sorted((REPO / "solutions").glob(nbgen.NOTEBOOK_GLOB)):  # instructors open these
        assert json.loads(path.read_text())["metadata"]["language_info"] == nbgen.LANGUAGE_INFO


def test_markdown_answer_regions_are_replaced():
    out = nbgen.generate(solution_notebook())
    assert out.cells[0].source == "# Title\n\nWhy?\n*Your answer here.*\nDone."


def test_outputs_and_run_metadata_are_cleared_and_the_rest_kept():
    sol = solution_notebook()
    out = nbgen.generate(sol)
    assert [c.id for c in out.cells] == ["md-1", "code-1", "code-2"]
    assert all(
        c.outputs == [] and c.execution_count is None for c in out.cells if c.cell_type == "code"
    )
    assert out.cells[1].metadata == {"tags": ["exercise"]}
    assert out.metadata["kernelspec"]["name"] == "python3" and "widgets" not in out.metadata
    assert out.cells[2].source == sol.cells[2].source
    # the input notebook is not modified
    assert sol.cells[1].outputs and sol.cells[1].execution_count == 7


def test_output_is_deterministic_and_formatted_like_jupyter(tmp_path):
    src = write(tmp_path / "solutions" / "01_demo.ipynb", solution_notebook())
    first = nbgen.generated_text(src)
    assert first == nbgen.generated_text(src)
    assert first.endswith("}\n") and first.startswith('{\n "cells": [\n  {\n')
    json.loads(first)  # valid JSON


def test_cells_without_ids_get_the_same_ids_every_time(tmp_path):
    raw = json.loads(nbformat.writes(solution_notebook()))
    for cell in raw["cells"]:
        del cell["id"]
    src = tmp_path / "solutions" / "01_demo.ipynb"
    src.parent.mkdir()
    src.write_text(json.dumps(raw), encoding="utf-8")
    a, b = nbgen.generated_text(src), nbgen.generated_text(src)
    assert a == b
    ids = [c["id"] for c in json.loads(a)["cells"]]
    assert len(set(ids)) == 3


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        ("x = 1\n# BEGIN SOLUTION\ny = 2", "on line 2 has no matching '# END SOLUTION'"),
        ("x = 1\n    # END SOLUTION", "on line 2 has no '# BEGIN SOLUTION' before it"),
        (
            "# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION",
            "on line 2 is inside the region opened on line 1",
        ),
        ("x = (1,\n# BEGIN SOLUTION\n2)\n# END SOLUTION", "no longer valid Python"),
    ],
)
def test_bad_code_markers_name_notebook_cell_and_line(source, problem):
    nb = new_notebook(cells=[new_code_cell("ok = 1", id="a"), new_code_cell(source, id="b")])
    with pytest.raises(nbgen.MarkerError, match=r"^solutions/02_x\.ipynb, cell 1 \(code\): ") as e:
        nbgen.generate(nb, name="solutions/02_x.ipynb")
    assert problem in str(e.value)


def test_bad_markdown_markers_are_reported():
    nb = new_notebook(cells=[new_markdown_cell("<!-- BEGIN SOLUTION -->\nanswer", id="m")])
    with pytest.raises(nbgen.MarkerError, match=r"cell 0 \(markdown\).*no matching"):
        nbgen.generate(nb, name="n.ipynb")


def test_magics_do_not_count_as_invalid_python():
    nb = new_notebook(
        cells=[
            new_code_cell(
                "%matplotlib inline\nx = 1\n# BEGIN SOLUTION\ny = 2\n# END SOLUTION\n!echo hi",
                id="c",
            )
        ]
    )
    out = nbgen.generate(nb)
    assert (
            f'raise NotImplementedError("{ex.STUB_MESSAGE}")'
        in out.cells[0].source
    )


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "labkit.course.nbgen", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )


def test_main_writes_then_check_detects_drift_orphans_and_outputs(tmp_path):
    src, dst = tmp_path / "solutions", tmp_path / "notebooks"
    sol = solution_notebook()
    write(src / "01_demo.ipynb", nbgen.strip_outputs(sol))
    assert nbgen.main(["--src", str(src), "--dst", str(dst)]) == 0
    generated = (dst / "01_demo.ipynb").read_bytes()
    assert b"BEGIN SOLUTION" not in generated and b"NotImplementedError" in generated
    assert nbgen.main(["--src", str(src), "--dst", str(dst), "--check"]) == 0

    # A hand edit of the learner's notebook is drift.
    (dst / "01_demo.ipynb").write_bytes(generated.replace(b"Done.", b"Edited."))
    report = nbgen.sync(src, dst, check=True)
    assert report.stale == (dst / "01_demo.ipynb",) and not report.ok
    # --check writes nothing
    assert b"Edited." in (dst / "01_demo.ipynb").read_bytes()
    nbgen.sync(src, dst)
    assert (dst / "01_demo.ipynb").read_bytes() == generated

    # A learner's notebook without a solution, and a solution saved with outputs.
    write(dst / "09_old.ipynb", new_notebook())
    write(src / "01_demo.ipynb", sol)
    report = nbgen.sync(src, dst, check=True)
    assert report.orphans == (dst / "09_old.ipynb",)
    assert report.with_outputs == (src / "01_demo.ipynb",)
    assert report.stale == ()  # outputs do not reach the generated notebook


def test_strip_clears_solution_outputs_in_place(tmp_path):
    src, dst = tmp_path / "solutions", tmp_path / "notebooks"
    write(src / "01_demo.ipynb", solution_notebook())
    assert nbgen.main(["--src", str(src), "--dst", str(dst), "--strip"]) == 0
    stripped = nbgen.read_notebook(src / "01_demo.ipynb")
    assert not nbgen.has_outputs(stripped)
    assert stripped.cells[1].source == SOLUTION_CODE  # solution code untouched
    assert nbgen.sync(src, dst, check=True).ok


def test_cli_check_exit_codes_and_messages(tmp_path):
    src = tmp_path / "solutions"
    write(src / "01_demo.ipynb", nbgen.strip_outputs(solution_notebook()))
    stale = run_cli("--check", cwd=tmp_path)
    assert stale.returncode == 1
    assert "stale: notebooks/01_demo.ipynb" in stale.stdout and "--strip" in stale.stderr
    assert run_cli(cwd=tmp_path).returncode == 0
    ok = run_cli("--check", cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    missing = run_cli("--check", "--src", "nowhere", cwd=tmp_path)
    assert missing.returncode == 2 and "'nowhere' does not exist" in missing.stderr


def test_repository_notebooks_match_their_solutions():
    solutions = sorted((REPO / "solutions").glob(nbgen.NOTEBOOK_GLOB))
    if not solutions:
        pytest.skip("solutions/ has no notebooks yet")
    result = run_cli("--check", cwd=REPO)
    assert result.returncode == 0, (
        f"{result.stdout}{result.stderr}\nrun `python -m labkit.course.nbgen --strip` from the "
        "repository root and commit solutions/ and notebooks/"
    )
