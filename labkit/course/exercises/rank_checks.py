"""Checks that run the learner's file inside real ranks (notebooks 03, 03b and 03c).

A worker process cannot import code that exists only in a notebook kernel (pytorch #20375), so
the learner writes each answer to a file with ``%%writefile``: :func:`verify_file` imports
it in the kernel (:func:`load_file`, :func:`answer_from_file`) and runs the exercise's
registered check, whose last step, :func:`run_in_workers`, launches
``labkit.course.exercises.model_parallel.worker`` on a few ranks. Each rank imports the same file
(:func:`resolve`) and reports through :func:`run_rank_check`; :func:`raise_for_results`
turns the ranks' reports into one sentence or one error naming the rank.

Apart from any one notebook's checks because three notebooks share it, and the one place these
checks launch a job (tests replace :func:`run_in_workers` here to check the kernel side alone).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import torch

from labkit import validate
from labkit.course.exercises import (
    ExerciseFailed,
    ExerciseIncomplete,
    explain_job_error,
    get,
    incomplete,
    learner_frame,
    ranks_apart,
    time_limit_paused,
    verify,
)
from labkit.course.exercises.learner_code import callable_name
from labkit.jobs.diagnosis import is_echo
from labkit.jobs.spec import WorkerConfig

WORKER = "labkit.course.exercises.model_parallel.worker"
CASE_KEYS = ("exercise", "path", "module", "names")
"""What a case names (:func:`answer_spec` builds one): the exercise, and where its answer is."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CasesConfig(WorkerConfig):
    """What one launch of ``WORKER`` checks: exercise cases, one after the other, in one job."""

    WORKER: ClassVar[str] = WORKER
    cases: tuple[dict[str, Any], ...]
    """Each a dict of ``CASE_KEYS`` (see :func:`answer_spec`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.cases, tuple) or not self.cases:
            raise validate.refuse("cases", self.cases, "a list of exercise cases (see answer_spec)")
        for case in self.cases:
            if not isinstance(case, dict) or sorted(case) != sorted(CASE_KEYS):
                raise validate.refuse("cases", case, f"each case a dict of {list(CASE_KEYS)}")


NPROC = 2  # ranks the worker-run checks use
DEVICE = "cpu"  # gloo ranks: every machine has them, and the checks are about correctness
LAUNCH_TIMEOUT_S = 90.0  # start-up takes seconds; only a hung rank gets near it
PG_TIMEOUT_S = 15.0  # a learner's unmatched collective fails after this, not after 30 minutes
# (the checks' collectives move kB between ranks started together: see data_parallel's)



# --------------------------------------------------------------------------- learner files


def load_file(path: str | Path, name: str | None = None) -> ModuleType:
    """Import the Python file at ``path`` afresh as module ``name`` (default: the file's stem).

    The module is (re)placed in ``sys.modules``, so a class or function it defines knows its
    module and file, and a cell that rewrote the file gets the new code. No bytecode cache is
    written: a file rewritten within the same second could otherwise load stale bytecode.
    """
    path = Path(path)
    name = name or path.stem
    if path.suffix != ".py" or not path.is_file():
        raise FileNotFoundError(
            f"{path} is not an existing .py file: run the %%writefile cell that writes it first"
        )
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    before, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        sys.dont_write_bytecode = before
    return module


def answer_from_file(
    exercise_id: str, path: str | Path, exercises: Mapping[str, tuple[str, ...]]
) -> Any:
    """The learner's answer to ``exercise_id``: the objects ``exercises`` (the notebook's
    ``EXERCISES``) names, from ``path`` (one object, or a tuple of them)."""
    if exercise_id not in exercises:
        raise ValueError(f"exercise_id={exercise_id!r}: use one of {sorted(exercises)}")
    module = load_file(path)
    missing = [n for n in exercises[exercise_id] if not hasattr(module, n)]
    if missing:
        raise ExerciseFailed(
            f"{path} defines no {', '.join(missing)}: keep the names the exercise cell uses"
        )
    objs = tuple(getattr(module, n) for n in exercises[exercise_id])
    return objs[0] if len(objs) == 1 else objs


def verify_file(
    exercise_id: str, path: str | Path, exercises: Mapping[str, tuple[str, ...]],
    nproc: int = NPROC,
) -> tuple[str, str]:
    """Check the learner's file ``path`` for ``exercise_id``, in the kernel and on ``nproc`` ranks.

    Returns (what was verified, where) or raises ``ExerciseIncomplete`` (still the stub) or
    ``ExerciseFailed`` (what was expected, what came back, the likely mistake, which rank).
    Notebooks call it through :func:`labkit.course.exercises.check_in_workers`.
    """
    __tracebackhide__ = True
    if exercise_id not in exercises:
        raise ValueError(f"exercise_id={exercise_id!r}: use one of {sorted(exercises)}")
    try:
        answer = answer_from_file(exercise_id, path, exercises)
    except ExerciseFailed as err:
        err.args = (f"Exercise {exercise_id} ({get(exercise_id).title}) failed: {err}",)
        err.exercise_id = exercise_id
        raise
    except Exception as err:  # the file does not import: a learner's mistake, reported
        raise ExerciseFailed(
            f"importing {path} raised {type(err).__name__}: {err}{learner_frame(err)}"
        ) from err
    return verify(exercise_id, answer), f"checked in the kernel and on {nproc} ranks"


def _source_file(obj: Any, what: str) -> tuple[str, str, str]:
    """(module name, file path, qualified name) of a learner's class or function.

    Workers import the answer by these, so it must come from a file, not from a notebook cell.
    """
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    path = getattr(module, "__file__", None)
    if module is None or not path or module.__name__ == "__main__":
        raise ExerciseFailed(
            f"{what} was defined in the notebook itself, so worker processes cannot import it; "
            "write it with the %%writefile cell and check the file with ex.check_in_workers"
        )
    return module.__name__, str(path), obj.__qualname__


def answer_spec(exercise_id: str, objs: Sequence[Any]) -> dict[str, Any]:
    """The JSON the worker gets to find the learner's objects: {exercise, path, module, names}."""
    specs = [_source_file(o, callable_name(o)) for o in objs]
    modules = {(m, p) for m, p, _ in specs}
    if len(modules) != 1:
        raise ExerciseFailed(
            f"the objects come from several modules {sorted(m for m, _ in modules)}: "
            "define them in one %%writefile cell"
        )
    module, path = next(iter(modules))
    return {"exercise": exercise_id, "module": module, "path": path,
            "names": [q for _, _, q in specs]}  # fmt: skip


def resolve(spec: dict[str, Any]) -> list[Any]:
    """Inside a worker: import the learner's file and return the objects ``spec`` names."""
    module = load_file(spec["path"], spec["module"])
    objs = []
    for qualname in spec["names"]:
        obj: Any = module
        for part in qualname.split("."):
            obj = getattr(obj, part)
        objs.append(obj)
    return objs


# --------------------------------------------------------------------------- running in ranks


def run_in_workers(exercise_id: str, objs: Sequence[Any], nproc: int = NPROC) -> str:
    """Launch ``WORKER`` (:class:`CasesConfig`) on ``nproc`` ranks to check ``objs`` there.

    Returns the ranks' sentence; raises ``ExerciseIncomplete`` or ``ExerciseFailed`` as the
    ranks report, naming the first rank that failed. The one place these checks launch a job
    (tests replace it to check the kernel side alone).
    """
    from labkit.jobs import launch  # lazy: importing this module must stay cheap

    spec = answer_spec(exercise_id, objs)
    try:
        with time_limit_paused():  # the job has its own limit, and ends its processes
            job = launch.run(CasesConfig(cases=(spec,)), nproc=nproc, device=DEVICE,
                             timeout_s=LAUNCH_TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S,
                             stream=False)  # fmt: skip
    except (launch.JobFailed, launch.JobTimeout) as err:
        raise ExerciseFailed(explain_job_error(err, _reports(err.result.ranks, nproc))) from None
    reports = _reports(job.ranks, nproc)
    if any(is_echo(m) for m in reports.values()):  # a rank saw its peer go, or timed out
        apart = ranks_apart(job, reports)
        if apart is not None:
            raise ExerciseFailed(apart)
    return raise_for_results(exercise_id, [r["cases"][0] for r in job.ranks])


def _reports(ranks: Sequence[dict[str, Any]], nproc: int) -> dict[int, str]:
    """{rank: its report} for the ranks whose check failed."""
    return {
        r: f"on rank {r} of {nproc}: {res['cases'][0]['message']}"
        for r, res in enumerate(ranks)
        if res.get("cases") and res["cases"][0].get("status") == "failed"
    }


def raise_for_results(exercise_id: str, per_rank: Sequence[dict[str, Any]]) -> str:
    """Turn each rank's {"status", "message"} into a sentence, or the first rank's error."""
    for rank, res in enumerate(per_rank):
        if res.get("exercise") != exercise_id:
            raise RuntimeError(f"rank {rank} checked {res.get('exercise')!r}, not {exercise_id!r}")
        err: ExerciseIncomplete | ExerciseFailed | None = None
        if res["status"] == "incomplete":
            err = ExerciseIncomplete(res["message"])
        elif res["status"] != "ok":
            err = ExerciseFailed(f"on rank {rank} of {len(per_rank)}: {res['message']}")
        if err is not None:
            err.exercise_id = exercise_id
            raise err
    return per_rank[0]["message"]


def run_rank_check(
    exercise_id: str, checks: dict[str, Callable[..., str]], objs: Sequence[Any], ctx: Any
) -> dict[str, Any]:
    """Run ``checks[exercise_id](ctx, *objs)`` and turn its outcome into the rank's report:
    {"exercise", "status": "ok" | "incomplete" | "failed", "message"}. Every notebook whose
    checks run in ranks (03, 03b, 03c) reports through here."""
    if exercise_id not in checks:
        raise ValueError(f"exercise={exercise_id!r}: no rank-side check; use one of {list(checks)}")
    out = {"exercise": exercise_id}
    try:
        return {**out, "status": "ok", "message": checks[exercise_id](ctx, *objs)}
    except ExerciseFailed as err:
        return {**out, "status": "failed", "message": str(err)}
    except NotImplementedError:
        return {**out, "status": "incomplete",
                "message": str(incomplete(exercise_id))}  # fmt: skip
    except Exception as err:  # the learner's code raised: report it, with where
        import traceback

        where = traceback.format_exc(limit=-3).strip()
        return {**out, "status": "failed",
                "message": f"your code raised {type(err).__name__}: {err}\n{where}"}  # fmt: skip


def tensors_close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-9) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=tol, rtol=tol)
