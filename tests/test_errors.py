"""Every exception class labkit defines is a LabkitError, and no two share a name.

A learner (or a notebook's ``except``) can then catch every refusal labkit makes with one
class, and a traceback's class name says which one it was. The test imports every module of
the package, as ``tests/test_packaging.py`` does, so a new exception class anywhere is held to
this the day it is added.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

from labkit import errors
from labkit.errors import LabkitError
from labkit.jobs import launch
from labkit.jobs.checkpoint import CheckpointMismatch
from labkit.metrics import replay

ROOT = Path(__file__).resolve().parents[1]

# Not errors, so not LabkitErrors: a warning (issued, not raised) and the private control flow
# that must pass through a learner's ``except Exception`` (BaseException, never Exception).
NOT_ERRORS = (Warning,)


def _modules() -> list[str]:
    return sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / "labkit").rglob("*.py")
        if p.stem != "__main__"
    )


def _defined_exceptions() -> dict[str, type[BaseException]]:
    """Every exception class a labkit module defines (not imports), by its dotted name."""
    found: dict[str, type[BaseException]] = {}
    for name in _modules():
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == name:
                found[f"{name}.{obj.__qualname__}"] = obj
    return found


EXCEPTIONS = _defined_exceptions()
PUBLIC = {
    dotted: cls for dotted, cls in EXCEPTIONS.items()
    if not cls.__name__.startswith("_") and issubclass(cls, Exception)
    and not issubclass(cls, NOT_ERRORS)
}  # fmt: skip


def test_the_search_finds_the_package_s_exceptions():
    # a search that found nothing would pass the tests below vacuously
    assert "labkit.jobs.launch.JobFailed" in PUBLIC and "labkit.jobs.checkpoint.folders.CheckpointMismatch" in PUBLIC
    assert "labkit.validate.InvalidValue" in PUBLIC
    assert len(PUBLIC) >= 35, sorted(PUBLIC)


@pytest.mark.parametrize("dotted", sorted(PUBLIC))
def test_every_public_exception_is_a_labkit_error(dotted):
    cls = PUBLIC[dotted]
    assert issubclass(cls, LabkitError), (
        f"{dotted} is not a labkit.errors.LabkitError: add LabkitError to its bases, after "
        f"its builtin base ({cls.__mro__[1].__name__}), so that `except LabkitError` catches it")


def test_no_two_public_exception_classes_share_a_name():
    by_name: dict[str, list[str]] = {}
    for dotted, cls in PUBLIC.items():
        by_name.setdefault(cls.__name__, []).append(dotted)
    shared = {name: where for name, where in by_name.items() if len(where) > 1}
    assert not shared, f"exception classes with one name in several places: {shared}"


def test_the_builtin_bases_still_catch_them():
    # callers wrote `except ValueError` / `except RuntimeError` before LabkitError existed
    assert issubclass(CheckpointMismatch, ValueError) and issubclass(launch.JobFailed, RuntimeError)
    with pytest.raises(ValueError):
        raise replay.ReplayError("x")


def test_the_old_name_of_replay_error_still_imports():
    from labkit.metrics import TraceError

    assert TraceError is replay.ReplayError


def test_private_control_flow_is_not_caught_as_an_error():
    # a time limit must pass through a learner's `except Exception`, so it is no LabkitError
    from labkit.course.exercises import TimeLimitReached

    assert not issubclass(TimeLimitReached, Exception)
    assert not issubclass(TimeLimitReached, LabkitError)


def test_a_labkit_error_is_an_exception():
    assert issubclass(errors.LabkitError, Exception)
    assert not issubclass(Exception, errors.LabkitError)


def test_the_cpu_budget_error_stays_a_torch_out_of_memory_error():
    # the finder, and a learner's `except torch.OutOfMemoryError`, treat it as an OOM
    torch = pytest.importorskip("torch")
    from labkit.batching.trials import BudgetExceeded

    e = BudgetExceeded(3 * 2**20, 5 * 2**20, 6 * 2**20)
    assert isinstance(e, torch.OutOfMemoryError) and isinstance(e, LabkitError)
    assert BudgetExceeded.__mro__.index(torch.OutOfMemoryError) < BudgetExceeded.__mro__.index(LabkitError)
