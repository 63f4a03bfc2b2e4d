"""A folder used as one name: ``from labkit import workers``, then ``workers.pp_train`` imports
that worker where it is first named, and importing the folder imports none of them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from labkit import _moved

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package ``lazypkg`` with one submodule, ``part``, that counts its imports."""
    (tmp_path / "lazypkg").mkdir()
    (tmp_path / "lazypkg" / "__init__.py").write_text(
        "from labkit._moved import submodules_on_demand\n"
        "__getattr__ = submodules_on_demand(__name__)\n")
    (tmp_path / "lazypkg" / "part.py").write_text("import builtins\nbuiltins.lazypkg_loads += 1\nVALUE = 7\n")
    monkeypatch.setattr("builtins.lazypkg_loads", 0, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield __import__("lazypkg")
    for name in ("lazypkg", "lazypkg.part"):
        sys.modules.pop(name, None)


def test_a_submodule_is_imported_when_first_named_and_once(package):
    import builtins

    assert builtins.lazypkg_loads == 0
    assert package.part.VALUE == 7
    assert package.part is sys.modules["lazypkg.part"]
    assert package.part.VALUE == 7 and builtins.lazypkg_loads == 1


def test_a_name_that_is_no_submodule_stays_an_attribute_error(package):
    with pytest.raises(AttributeError, match="module 'lazypkg' has no attribute 'nothing'"):
        package.nothing  # noqa: B018
    assert not hasattr(package, "__wrapped__")  # dunders are never looked up as modules


def test_the_course_folders_import_their_modules_where_named():
    code = ("import sys\nfrom labkit import parallel, workers\nfrom labkit.course import exercises as ex\n"
            "before = {'labkit.workers.pp_train', 'labkit.parallel.pipeline', "
            "'labkit.course.exercises.first_job', 'torch'} & set(sys.modules)\n"
            "assert workers.pp_train.PPTrainConfig and parallel.pipeline and ex.first_job\n"
            "print(sorted(before))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stderr
    assert _moved.submodules_on_demand("labkit.monitor")("busy").__name__ == "labkit.monitor.busy"
