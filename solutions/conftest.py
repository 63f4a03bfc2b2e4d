"""pytest set-up for the complete notebooks, which nbval runs from this folder.

Every exercise check in a complete notebook must pass: with ``LABKIT_EXPECT_SOLVED=1`` a check
that does not pass raises after printing its line, so the cell fails. nbval starts each
notebook's kernel as its first cell is set up, with this process's environment, so setting
the variable here reaches the kernel. ``tests/conftest.py`` removes it again for the tests.
"""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    from labkit.course.exercises import EXPECT_SOLVED

    os.environ[EXPECT_SOLVED] = "1"


def _same_code_as_learner_copy(path) -> bool:
    """The learner's copy runs exactly this notebook's code: it has no exercise to stub out."""
    import json
    from pathlib import Path

    learner = Path(path).parents[1] / "notebooks" / Path(path).name
    try:
        cells = [json.loads(p.read_text(encoding="utf-8"))["cells"] for p in (Path(path), learner)]
    except (OSError, ValueError, KeyError):
        return False
    code = [["".join(c["source"]) for c in nb if c["cell_type"] == "code"] for nb in cells]
    return code[0] == code[1]


def pytest_collection_modifyitems(config, items):
    """A notebook with no exercise has a learner's copy identical in code (nbgen copies it
    cell for cell), which tests/test_notebooks.py runs under papermill with more checks (Run
    All to the end, the tier stated, no verdict contradicting its numbers). Running it here
    as well would execute the same code a second time and check less: skipped, with the
    reason. A notebook with exercises runs in both places: here every check must pass."""
    seen: dict[str, bool] = {}
    for item in items:
        path = str(item.fspath)
        if not path.endswith(".ipynb") or "/solutions/" not in path.replace("\\", "/"):
            continue
        if path not in seen:
            seen[path] = _same_code_as_learner_copy(path)
        if seen[path]:
            item.add_marker(pytest.mark.skip(
                reason="no exercise: its learner's copy is the same code, run by "
                       "tests/test_notebooks.py"))  # fmt: skip
