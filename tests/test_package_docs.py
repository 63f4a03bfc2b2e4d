"""The words that describe the package stay true: every module a doc names exists, and the
package map in ``labkit/__init__.py`` names every unit, in the order of its layers.

Docs go stale quietly (a module moves, a map forgets the new one); these tests make a stale
name fail, naming the file and the name."""

from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path

import pytest
from test_layers import PACKAGE, ROW

ROOT = PACKAGE.parent
LISTING = re.compile(r"^ {4}(\w+) {2,}\S", re.M)  # "    name      what it is" in a docstring
DOTTED = re.compile(r"\blabkit(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"\blabkit/(?:[\w-]+/)*[\w-]+\.py\b")
RANGE_NAME = re.compile(r"""(?:record_function\(|_MARK = )["'](labkit\.[\w.]+)["']""")
"""A profiler range named ``labkit.something`` (``record_function``): a label, not a module."""


def docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


def listed(path: Path) -> list[str]:
    return LISTING.findall(docstring(path))


def test_the_package_map_lists_each_unit_once_in_layer_order():
    """The map's rows (``test_layers`` holds each module to one) go up the layers, once each;
    its folder list names the folders that exist."""
    doc = docstring(PACKAGE / "__init__.py")
    rows = [(float(layer), unit) for layer, unit in ROW.findall(doc)]
    units = [u for _, u in rows]
    assert len(units) == len(set(units)), "a unit is listed twice"
    assert [layer for layer, _ in rows] == sorted(layer for layer, _ in rows), "rows out of layer order"
    folders = set(re.findall(r"^ {4}(\w+)/ ", doc, re.M))
    real = {p.parent.name for p in PACKAGE.glob("*/__init__.py")} - {"data"}
    assert folders == real, f"the tree in labkit/__init__.py: {sorted(folders ^ real)}"


FOLDERS = sorted(str(p.parent.relative_to(PACKAGE)) for p in PACKAGE.rglob("*/__init__.py"))


@pytest.mark.parametrize("package", FOLDERS)
def test_a_folder_map_lists_exactly_its_modules(package):
    """A folder whose ``__init__.py`` is a map (a docstring and re-exports, no code of its own)
    lists every module it holds, and only those ("    name   what it does"): a newcomer reads
    the folder there. A folder whose ``__init__.py`` is itself a module's code is skipped."""
    here = PACKAGE / package
    tree = ast.parse((here / "__init__.py").read_text(encoding="utf-8"))
    if any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in tree.body):
        pytest.skip(f"labkit/{package}/__init__.py is a module's code (its tables are not maps)")
    modules = {p.stem for p in here.glob("*.py") if p.stem != "__init__"}
    modules |= {p.name for p in here.iterdir() if (p / "__init__.py").exists()}
    names = set(listed(here / "__init__.py"))
    assert sorted(names - modules) == [], f"labkit/{package}/__init__.py names modules that do not exist"
    assert sorted(modules - names) == [], f"labkit/{package}/__init__.py leaves these out"


def _texts() -> list[tuple[str, str]]:
    """(where, text) of every doc that can name a module: labkit's sources, README, docs/,
    the solutions' cells, tests excluded (they name modules on purpose to import them)."""
    out = [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8"))
           for p in sorted(PACKAGE.rglob("*.py"))]  # fmt: skip
    out += [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8"))
            for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))] if p.exists()]  # fmt: skip
    out += [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8"))
            for p in sorted((PACKAGE / "course" / "quizbank").glob("*.json"))]  # explanations cite files
    for nb in sorted((ROOT / "solutions").glob("*.ipynb")):
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        out += [(f"{nb.name} cell {i}", "".join(c["source"])) for i, c in enumerate(cells)]
    return out


def resolves(dotted: str) -> bool:
    """``labkit.a.b.c``: each part a module of the one before, or an attribute of it."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        name = ".".join(parts[:i])
        if hasattr(obj, "__path__") and importlib.util.find_spec(name) is not None:
            obj = importlib.import_module(name)
        elif hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            return False
    return True


def test_every_labkit_name_in_the_docs_exists():
    """``labkit.x.y`` (a module, or a function or class in one) and ``labkit/x/y.py``, wherever
    the course's text names them."""
    stale, texts = [], _texts()
    ranges = {name for _, text in texts for name in RANGE_NAME.findall(text)}
    for where, text in texts:
        for dotted in sorted(set(DOTTED.findall(text)) - ranges):
            if not resolves(dotted.rstrip(".")):
                stale.append(f"{where}: {dotted}")
        stale += [f"{where}: {p}" for p in sorted(set(PATH.findall(text))) if not (ROOT / p).exists()]
    assert not stale, "names of things that do not exist:\n" + "\n".join(stale)


MOVING = re.compile(r"https://github\.com/pytorch/torchtitan/(?:blob|tree)/(?![0-9a-f]{9,40}/)[^\s)\"'>`]+")


def test_links_into_a_fast_moving_repository_are_pinned_to_a_commit():
    """torchtitan moves its files between releases (``docs/performance.md`` became
    ``benchmarks/…`` in 2025; ``models/llama3/infra/parallelize.py`` went in the config refactor
    of February 2026): a link to ``blob/main`` turns into a 404, a link to a commit does not."""
    unpinned = [f"{where}: {url}" for where, text in _texts() for url in MOVING.findall(text)]
    assert not unpinned, "pin these to a commit (blob/<sha>/path):\n" + "\n".join(unpinned)


def test_the_readme_module_table_matches_the_tree():
    """README's table of labkit (first column) names every top-level module and folder once,
    folders with a trailing slash, and nothing that does not exist."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text[text.index("| where | what |"):]
    table = table[: table.index("\n\n")]
    named = [n for row in table.splitlines()[2:] for n in re.findall(r"`([\w/]+)`", row.split(" | ")[0])]
    real = {p.stem for p in PACKAGE.glob("*.py") if p.stem not in {"__init__", "_moved"}}
    real |= {p.parent.name + "/" for p in PACKAGE.glob("*/__init__.py")}
    assert len(named) == len(set(named)), "a unit is named twice in the README's table"
    assert sorted(set(named) - real) == [], "README's table names what labkit does not have"
    assert sorted(real - set(named)) == [], "README's table leaves these out"
