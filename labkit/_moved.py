"""Old import paths of modules that moved into subsystem folders, kept working.

labkit's modules once sat in one flat namespace; they now live in folders that show the
subsystems (``jobs/``, ``hardware/``, ``course/``). A learner's older copy of a notebook, or a
script, may still write ``from labkit import launch`` or ``import labkit.exercises.data_parallel``.
Those names resolve to the moved module itself (the same object, so a monkeypatch or an
``isinstance`` check sees one class, not a copy). New code uses the new paths; a test holds the
repository to that.

:func:`install` adds one finder to ``sys.meta_path``. It answers only for the names in
:data:`MOVED` and imports nothing until such a name is asked for.

A folder that imports none of its modules up front (so that importing one never pulls in the
others) can still be used as one name: :func:`submodules_on_demand` is its ``__getattr__``, so
``from labkit import workers`` and then ``workers.pp_train.run(...)`` imports ``pp_train`` where
it is first named.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType

MOVED: dict[str, str] = {
    "labkit.launch": "labkit.jobs.launch",
    "labkit.procs": "labkit.jobs.procs",
    "labkit.diagnosis": "labkit.jobs.diagnosis",
    "labkit.nodes": "labkit.jobs.nodes",
    "labkit.slurm": "labkit.jobs.slurm",
    "labkit.checkpoint": "labkit.jobs.checkpoint",
    "labkit._spawn": "labkit.jobs.spawn",
    "labkit.dist": "labkit.jobs.runtime",  # read beside `torch.distributed as dist`, it misled
    "labkit.doctor": "labkit.hardware.doctor",
    "labkit.quiz": "labkit.course.quiz",
    "labkit.exam": "labkit.course.exam",
    "labkit.sealed": "labkit.course.sealed",
    "labkit.record": "labkit.course.record",
    "labkit.nbgen": "labkit.course.nbgen",
    "labkit.timings": "labkit.course.timings",  # beside `timing` (timers), it misled
    "labkit.capstone": "labkit.course.capstone",
    "labkit.exercises": "labkit.course.exercises",
    "labkit.batching.checkpointing": "labkit.batching.recomputation",  # not DCP's checkpoints
    # an exercise's own folder, its checks and workers together
    "labkit.exercises.dp_bench": "labkit.course.exercises.data_parallel.bench",
    "labkit.exercises.dp_worker": "labkit.course.exercises.data_parallel.worker",
    "labkit.exercises.mp_worker": "labkit.course.exercises.model_parallel.worker",
}
"""Old dotted name → where the module lives now. A package's submodules follow it."""


def new_name(old: str) -> str | None:
    """Where ``old`` lives now (``labkit.exercises.dp_worker`` → ``labkit.course.exercises.
    data_parallel.worker``), or None when it did not move."""
    for prefix in sorted(MOVED, key=len, reverse=True):  # the most specific entry wins
        if old == prefix or old.startswith(prefix + "."):
            return MOVED[prefix] + old[len(prefix):]
    return None


class _Finder:
    """A meta path finder and loader for the old names. Duck-typed, as the import system
    allows: subclassing importlib.abc's classes would import importlib.resources and pathlib
    with every ``import labkit`` (6.5 ms a process, measured by benchmarks/bench_commits.py)."""

    def find_spec(self, fullname, path=None, target=None):
        if new_name(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec) -> ModuleType:
        module = importlib.import_module(new_name(spec.name))
        sys.modules[spec.name] = module
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module under its new name has run already."""


_FINDER = _Finder()


def install() -> None:
    """Put the finder first in ``sys.meta_path`` (once): before the path finder, which would
    otherwise load a second copy of a moved package's submodule under the old name."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def submodules_on_demand(package: str) -> Callable[[str], ModuleType]:
    """A package's module ``__getattr__`` (PEP 562): ``package.name`` imports the submodule
    ``name`` the first time it is named. Nothing is imported before; a name that is not a
    submodule stays an AttributeError. In the folder's ``__init__.py``::

        __getattr__ = submodules_on_demand(__name__)
    """

    def __getattr__(name: str) -> ModuleType:
        if not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
