"""A notebook's code cells show the idea: the few calls a section is about, not its presentation.

Tables, verdict sentences and figures live in labkit (``describe()`` and ``plot_*`` beside the
result they show), so a learner reads a cell as the experiment itself. Measured here, on the
complete notebooks, per notebook:

- the median code cell has at most 10 non-blank lines;
- no code cell has more than 30, except exercise cells (``# BEGIN SOLUTION``: the learner's);
- the labkit names a notebook imports (``from labkit import a, b`` is two) stay at about 8. Where
  a notebook needs more (each name a module whose calls a section teaches, or a worker it
  launches), its allowance is written below with the reason, so that the count cannot grow
  unnoticed.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from labkit import ids

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob(ids.NOTEBOOK_GLOB))
MEDIAN_LINES = 10
MAX_LINES = 30
NAMES = 8
NAMES_ALLOWED = {
    # notebook: (names, why more than NAMES)
    "01": (15, "the single-GPU lab teaches nine top-level modules (config, data, formulas, hardware, "
               "memory, throughput, timing, train, verdict) and the model, then shows the monitor, "
               "the recordings and the batch finder's trial step"),
    "02b": (11, "three sections, each with its own part of jobs/ (launch, slurm, checkpoint), one "
                "worker each; the resilient job's worker and its reading keep short names"),
    "03": (9, "the launcher's progress lines and the monitor beside the strategies (parallel) and "
              "the jobs that run them (workers)"),
    "03d": (11, "four sections: recomputation (batching), schedules, collective debugging, the "
                "planner, with the GPT, the launcher and the workers they run"),
    "04": (13, "precision, recipes, fp8 and the roofline taught; a step's profile "
               "(profiling.precision_report) and the GPU recordings shown"),
    "06": (15, "profiling's tools, the batch finder, the DP job, the recorded GPU evidence and the "
               "roofline; the two exercises import their own tools (phase, overlap), as their "
               "hints name them"),
}  # fmt: skip
IMPORT = re.compile(r"^\s*from (labkit[\w.]*) import ([^\n#]+)|^\s*import (labkit[\w.]*)", re.M)


def code_cells(path: Path) -> list[str]:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def lines(source: str) -> int:
    return sum(1 for line in source.splitlines() if line.strip())


def labkit_names(sources: list[str]) -> set[str]:
    names = set()
    for source in sources:
        for module, imported, plain in IMPORT.findall(source):
            if plain:
                names.add(plain)
            for part in imported.strip("() ").split(","):
                if part.strip():
                    names.add(f"{module}.{part.split(' as ')[0].strip()}")
    return names


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: ids.notebook_id(p))
def test_cells_are_short(path):
    sizes = {i: lines(s) for i, s in enumerate(code_cells(path)) if "# BEGIN SOLUTION" not in s}
    median = statistics.median(sizes.values())
    long = {i: n for i, n in sizes.items() if n > MAX_LINES}
    assert median <= MEDIAN_LINES, f"{path.name}: the median code cell has {median} lines"
    assert not long, f"{path.name}: code cells over {MAX_LINES} lines (cell index: lines): {long}"


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: ids.notebook_id(p))
def test_a_notebook_imports_few_labkit_names(path):
    allowed, _ = NAMES_ALLOWED.get(ids.notebook_id(path), (NAMES, ""))
    names = labkit_names(code_cells(path))
    assert len(names) <= allowed, (
        f"{path.name} imports {len(names)} labkit names, {allowed} allowed: {sorted(names)}")


def test_the_allowances_are_not_slack():
    """An allowance above what its notebook needs would let the count grow unseen."""
    by_id = {ids.notebook_id(p): len(labkit_names(code_cells(p))) for p in SOLUTIONS}
    slack = {nb: (n, by_id[nb]) for nb, (n, _) in NAMES_ALLOWED.items() if by_id.get(nb) != n}
    assert not slack, f"allowance (written, needed): {slack}"


def test_the_measure_counts_what_it_says():
    assert lines("a = 1\n\n  # why\nb = 2\n") == 3
    assert labkit_names(["from labkit import a, b as c\nimport labkit.x\nfrom os import y"]) == {
        "labkit.a", "labkit.b", "labkit.x"}
