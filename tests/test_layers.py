"""labkit's dependencies point one way: a module imports only from layers below its own.

Each top-level module or subpackage of labkit has a layer here; an import of another labkit
unit (at module level or inside a function: a lazy import is still a dependency) must go to a
strictly lower layer. The table is the house plan: a new module gets a row, and an import that
would point upward (say, a worker importing the exercise checks) fails this test, naming the
edge, instead of quietly tangling the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "labkit"

LAYERS: dict[str, int] = {
    # LabkitError, the base of every labkit exception: below everything that raises one
    "errors": -2,
    # one validation style for arguments ("name=value is not allowed: ..."), over errors only
    "validate": -1,
    # the names of number formats, below everything that takes a dtype: no labkit imports
    "dtypes": -1,
    # where a machine sits in a job of several (torchrun's multi-node flags): no labkit imports
    "nodes": -1,
    # how notebooks, exercises and quiz questions are named: no labkit imports
    "ids": -1,
    # foundations: no labkit imports but errors and validate (and ids, for quiz)
    "config": 0, "timing": 0, "formulas": 0, "_spawn": 0, "quiz": 0,
    "sealed": 0,  # opaque text for a job spec (the capstone's settings): no labkit imports
    # facts about the machine, the data, the model, the worker side of a job
    "hardware": 1, "data": 1, "dist": 1, "model": 1,
    # training, processes, metric collection
    "train": 2, "procs": 2, "metrics": 2, "diagnosis": 2,
    "planner": 2,  # parallel layouts for a model and a cluster, ranked from the formulas
    "slurm": 2,  # the sbatch script for a job on a SLURM cluster: no labkit imports
    # measuring memory, launching jobs, judging measurements
    "memory": 3, "launch": 3, "verdict": 3, "precision": 3, "roofline": 3,
    "exam": 3,  # mock exams over the quiz banks, results kept under labkit_home()
    "checkpoint": 3,  # atomic DCP checkpoints that a restarted job resumes from
    # parallel strategies; live plots
    "parallel": 4, "monitor": 4, "batching": 4,
    "recipes": 4,  # mixed-precision recipes, measured with memory and precision
    "fp8": 4,  # fp8 cast numerics and torchao fp8 training, over precision
    "profiling": 4,  # traces, phases, memory timelines, Nsight commands, planted bottlenecks
    "collective_debug": 4,  # planted collective bugs run for real, and what each tool reports
    # the jobs notebooks launch
    "workers": 5,
    # notebook 07's planted faults: the catalogue, the seeds, the job's runner, its evidence
    # (read with the profiling tools)
    "capstone": 5,
    # what real GPUs measured, shipped for learners without one: figures and profiles, their
    # loaders and displays, and the recorder of notebook 06's step (over profiling and train)
    "recordings": 5,
    # what notebooks and instructors call
    "exercises": 6, "record": 6, "doctor": 6,
    # tools over all of it
    "nbgen": 7,
    "timings": 7,  # each notebook's run time per section and peak memory, for instructors
    # the command line
    "__main__": 8,
}  # fmt: skip


def unit_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def labkit_imports(path: Path) -> set[str]:
    """The labkit units ``path`` imports, anywhere in the file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "labkit":
                found |= {alias.name for alias in node.names}
            elif node.module.startswith("labkit."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("labkit.")}
    return found


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


def test_every_unit_has_a_layer():
    units = {unit_of(p) for p in SOURCES}
    missing = sorted(units - set(LAYERS))
    assert not missing, f"give {missing} a layer in tests/test_layers.py (where it sits is a design choice)"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    me = unit_of(path)
    upward = sorted(
        other for other in labkit_imports(path) - {me}
        if other in LAYERS and LAYERS[other] >= LAYERS.get(me, -1)
    )  # fmt: skip
    assert not upward, (
        f"labkit/{path.relative_to(PACKAGE)} (layer {LAYERS.get(me)}) imports "
        + ", ".join(f"{u} (layer {LAYERS[u]})" for u in upward)
        + ": a lower layer must not depend on a higher one; move the shared piece down"
    )


def test_the_rule_catches_an_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / "labkit"
    (fake / "workers").mkdir(parents=True)
    bad = fake / "workers" / "bad.py"
    bad.write_text("def f():\n    from labkit.exercises import data_parallel\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    with pytest.raises(AssertionError, match=r"imports exercises \(layer 6\)"):
        test_imports_point_down(bad)
