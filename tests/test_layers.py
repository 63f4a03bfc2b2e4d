"""labkit's dependencies point one way: a module imports only from layers below its own.

The layers are the map in ``labkit/__init__.py`` (the first thing a newcomer reads), parsed
here, not a second copy of it. A unit is a top-level module, a folder named as a whole
(``parallel``), or one module of a folder whose modules sit on different layers
(``jobs.launch``); a module belongs to the most specific unit that names it. An import of
another unit (at module level or inside a function: a lazy import is still a dependency) must
go to a strictly lower layer, so the rule holds inside ``jobs/``, ``hardware/`` and ``course/``
as well as between folders. A new module gets a row in the map, and an import that would point
upward (say, a worker importing the exercise checks) fails here, naming the edge.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "labkit"
ROW = re.compile(r"^ {4}(-?\d+(?:\.\d+)?) {1,}([\w.]+) {2,}\S", re.M)
"""A row of the map: ``    3    jobs.launch           one way to run a job...``. A layer may be
a decimal (``2.5``): a module slotted between two layers without renumbering the rest."""


def read_layers(package: Path = PACKAGE) -> dict[str, float]:
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    return {unit: float(layer) for layer, unit in ROW.findall(doc)}


LAYERS = read_layers()


def dotted(path: Path, package: Path | None = None) -> str:
    """``labkit/jobs/launch.py`` → ``jobs.launch``; a folder's ``__init__.py`` → the folder."""
    parts = path.relative_to(package or PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(name: str, layers: dict[str, float] | None = None) -> str | None:
    """The most specific unit of the map that holds the module ``name`` (dotted, under labkit)."""
    layers = LAYERS if layers is None else layers
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in layers:
            return ".".join(parts[:n])
    return None


def labkit_imports(path: Path, package: Path | None = None) -> set[str]:
    """The labkit modules ``path`` imports, anywhere in the file, as dotted names under labkit
    (``from labkit.jobs import launch`` imports ``jobs.launch``; ``from labkit.jobs.launch
    import run`` too)."""
    package = package or PACKAGE

    def module_or_parent(name: str) -> str:
        rel = Path(*name.split("."))
        if (package / rel).with_suffix(".py").exists() or (package / rel / "__init__.py").exists():
            return name
        return name.rpartition(".")[0]

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "labkit" or node.module.startswith("labkit."):
                base = node.module.removeprefix("labkit").lstrip(".")
                for alias in node.names:
                    name = f"{base}.{alias.name}" if base else alias.name
                    found.add(module_or_parent(name) if base else name)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("labkit.") for a in node.names if a.name.startswith("labkit.")}
    return {f for f in found if f}


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


def _is_empty_folder_init(path: Path) -> bool:
    """A folder's ``__init__.py`` that only documents it (``jobs/``): it needs no row."""
    return path.name == "__init__.py" and not labkit_imports(path) and unit_of(dotted(path)) is None


def test_the_map_has_rows():
    assert len(LAYERS) > 30 and LAYERS["errors"] == min(LAYERS.values())
    assert LAYERS["__main__"] == max(LAYERS.values())


def test_every_module_has_a_layer():
    missing = sorted(dotted(p) for p in SOURCES if unit_of(dotted(p)) is None and not _is_empty_folder_init(p))
    assert not missing, (f"give {missing} a row in the map in labkit/__init__.py (where it sits "
                         "is a design choice)")


def test_every_row_names_a_module_that_exists():
    def exists(unit: str) -> bool:
        rel = PACKAGE / Path(*unit.split("."))
        return rel.with_suffix(".py").exists() or (rel / "__init__.py").exists()
    assert sorted(u for u in LAYERS if not exists(u)) == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    me = unit_of(dotted(path))
    mine = LAYERS.get(me, -99) if me else -99
    upward = sorted({
        unit for unit in (unit_of(name) for name in labkit_imports(path))
        if unit is not None and unit != me and LAYERS[unit] >= mine
    })  # fmt: skip
    assert not upward, (
        f"labkit/{path.relative_to(PACKAGE)} ({me}, layer {mine:g}) imports "
        + ", ".join(f"{u} (layer {LAYERS[u]:g})" for u in upward)
        + ": a lower layer must not depend on a higher one; move the shared piece down"
    )


def test_the_rule_catches_an_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / "labkit"
    (fake / "workers").mkdir(parents=True)
    (fake / "course" / "exercises").mkdir(parents=True)
    (fake / "course" / "exercises" / "data_parallel.py").write_text("")
    bad = fake / "workers" / "bad.py"
    bad.write_text("def f():\n    from labkit.course.exercises import data_parallel\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert labkit_imports(bad, fake) == {"course.exercises.data_parallel"}
    with pytest.raises(AssertionError, match=r"imports course\.exercises \(layer 6\)"):
        test_imports_point_down(bad)


def test_the_rule_holds_inside_a_folder(tmp_path, monkeypatch):
    """jobs.runtime (layer 1) importing jobs.launch (layer 3): same folder, still upward."""
    fake = tmp_path / "labkit"
    (fake / "jobs").mkdir(parents=True)
    (fake / "jobs" / "launch.py").write_text("")
    bad = fake / "jobs" / "runtime.py"
    bad.write_text("from labkit.jobs.launch import run\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    with pytest.raises(AssertionError, match=r"imports jobs\.launch \(layer 3\)"):
        test_imports_point_down(bad)
