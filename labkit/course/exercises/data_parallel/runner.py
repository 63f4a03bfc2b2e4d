"""Running notebook 02's worker-run checks: the learner's file read in the kernel (a stub is
reported at once), a job of ``nproc`` ranks launched on ``labkit.course.exercises.data_parallel.worker``,
and the ranks' reports turned into one sentence or one exercise error.

Separate from the checks: it knows the exercises only by id and class name (:data:`EXERCISES`)
and the verdicts only as reports.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from labkit import validate
from labkit.course.exercises import (
    ExerciseError,
    ExerciseFailed,
    ExerciseIncomplete,
    explain_job_error,
    incomplete,
    is_stub,
    ranks_apart,
    time_limit_paused,
    verify,
    without_failed_prefix,
)
from labkit.jobs import diagnosis
from labkit.jobs.spec import WorkerConfig

WORKER = "labkit.course.exercises.data_parallel.worker"

EXERCISES: dict[str, str] = {
    "02.allreduce_grads": "OverlapDDP",
    "02.bucketed_ddp": "BucketedDDP",
    "02.zero1_step": "ZeRO1Optimizer",
}
"""Exercise id -> the class the learner's file must define."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPChecksConfig(WorkerConfig):
    """What one launch of ``WORKER`` checks: exercises, against one learner's file."""

    WORKER: ClassVar[str] = WORKER
    exercises: tuple[str, ...]
    """Ids from :data:`EXERCISES`."""
    module_dir: str
    """The folder that holds the learner's file."""
    module: str = "dp_exercises"
    """The learner's module name: the file is ``<module_dir>/<module>.py``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.exercises, tuple) or not self.exercises:
            raise validate.refuse("exercises", self.exercises, f"a list of ids from {sorted(EXERCISES)}")
        for exercise_id in self.exercises:
            validate.one_of("exercises", exercise_id, tuple(EXERCISES))
        for name in ("module_dir", "module"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise validate.refuse(name, getattr(self, name), "a non-empty string")

PG_TIMEOUT_S = 15.0
"""The check job's process-group timeout: how long a rank waits in a collective another rank
never calls before it fails (gloo's default is 30 minutes). A check's collectives move a few
kB between ranks that started together, and the longest gap between two of them (a first use
of a module, on a busy 2-core machine) is a few seconds: 15 s leaves room for that and still
names the mismatch (:func:`labkit.course.exercises.ranks_apart`) in about 25 s from the launch."""


# --------------------------------------------------------------------------- running checks


def load_learner_module(module: str, module_dir: str | Path) -> Any:
    """Import the learner's ``<module_dir>/<module>.py`` fresh (a changed file is re-read)."""
    path = Path(module_dir) / f"{module}.py"
    if not path.is_file():
        raise ExerciseFailed(
            f"{path} does not exist: run the %%writefile cell that writes it first"
        )
    if str(module_dir) not in sys.path:
        sys.path.insert(0, str(module_dir))
    sys.modules.pop(module, None)
    importlib.invalidate_caches()
    try:
        return importlib.import_module(module)
    except SyntaxError as err:
        raise ExerciseFailed(
            f"{path} is not valid Python: {err.msg} (line {err.lineno}); fix the cell that "
            "writes it"
        ) from None
    except Exception as err:
        raise ExerciseFailed(f"importing {path} raised {type(err).__name__}: {err}") from err


def run_checks(
    exercise_ids: Sequence[str], module: str, module_dir: str | Path
) -> list[dict[str, str]]:
    """Import the learner's module and run each exercise's check on this rank.

    Returns one ``{"id", "status", "message"}`` per exercise; status is "ok", "incomplete"
    (the stub) or "failed". Never raises for a wrong answer: every rank finishes and reports.
    """
    for exercise_id in exercise_ids:
        _function_name(exercise_id)
    results = []
    try:
        learner = load_learner_module(module, module_dir)
    except ExerciseFailed as err:
        return [{"id": i, "status": "failed", "message": str(err)} for i in exercise_ids]
    for exercise_id in exercise_ids:
        name = _function_name(exercise_id)
        try:
            answer = getattr(learner, name, None)
            if answer is None:
                raise ExerciseFailed(
                    f"{learner.__file__} defines no {name}(); the cell that writes it must "
                    f"define it"
                )
            message = verify(exercise_id, answer)
            results.append({"id": exercise_id, "status": "ok", "message": message})
        except ExerciseIncomplete as err:
            results.append({"id": exercise_id, "status": "incomplete", "message": str(err)})
        except ExerciseFailed as err:
            text = str(err)
            if not text.startswith("Exercise "):
                text = f"Exercise {exercise_id} failed: {text}"
            results.append({"id": exercise_id, "status": "failed", "message": text})
    return results


def _function_name(exercise_id: str) -> str:
    try:
        return EXERCISES[exercise_id]
    except KeyError:
        raise ValueError(
            f"exercise_id={exercise_id!r} is not a worker-checked exercise: use one of "
            f"{sorted(EXERCISES)}"
        ) from None


def summarize(exercise_id: str, ranks: Sequence[dict[str, Any]]) -> str:
    """What every rank's report on ``exercise_id`` verified, if all are ok; else raise the first
    problem (a failure before a stub), naming the rank."""
    __tracebackhide__ = True
    n = len(ranks)
    reports = []
    for r, res in enumerate(ranks):
        mine = [x for x in res.get("results", []) if x.get("id") == exercise_id]
        if not mine:
            raise _failed(
                exercise_id,
                f"rank {r} of {n} reported nothing: it ended before its check was done (a "
                "sys.exit or os._exit in your code?)",
            )
        reports.append((r, mine[0]))
    for status, kind in (("failed", ExerciseFailed), ("incomplete", ExerciseIncomplete)):
        bad = [(r, x) for r, x in reports if x["status"] == status]
        # A rank that saw its peer vanish reports a consequence: the other's report comes first.
        bad.sort(key=lambda rx: diagnosis.is_echo(rx[1]["message"]))
        if bad:
            first, message = bad[0][0], bad[0][1]["message"]  # a rank's message names its rank
            followed = [r for r, x in bad[1:] if diagnosis.is_echo(x["message"])]
            if followed and not diagnosis.is_echo(message):
                message = message.rstrip(".") + "." + (
                    f" Rank {', '.join(map(str, followed))} then failed in a collective that rank "
                    f"{first} never called: every rank must call the same collectives in the "
                    "same order."
                )
            err = kind(message)
            err.exercise_id = exercise_id
            raise err
    return reports[0][1]["message"]


def verify_file(
    exercise_id: str,
    path: str | Path,
    *,
    nproc: int = 2,
    device: str = "cpu",
    timeout_s: float = 90,
) -> tuple[str, str]:
    """Run exercise ``exercise_id``'s check on ``nproc`` ranks against the learner's file.

    ``path``: the file the notebook's ``%%writefile`` cell wrote (it must define the function
    the exercise names, see :data:`EXERCISES`). Returns (what was verified, where it ran) or
    raises :class:`ExerciseIncomplete` (still the stub: found by reading the file in the
    kernel, without launching anything) or :class:`ExerciseFailed` (the reason, and the rank
    that found it). ``device="cpu"`` runs gloo ranks, which every machine can.
    Notebooks call it through :func:`labkit.course.exercises.check_in_workers`.
    """
    __tracebackhide__ = True
    from labkit.jobs import launch

    name = _function_name(exercise_id)
    path = Path(path).resolve()
    if path.suffix != ".py":
        raise ValueError(f"path={str(path)!r}: the learner's file must end in .py")
    learner = load_learner_module(path.stem, path.parent)
    if is_stub(getattr(learner, name, None)):
        raise incomplete(exercise_id)
    config = DPChecksConfig(exercises=(exercise_id,), module=path.stem, module_dir=str(path.parent))
    try:
        # A rank stuck in a collective that another rank never called fails after
        # PG_TIMEOUT_S, not after gloo's 30 minutes.
        with time_limit_paused():  # the job has its own limit, and ends its processes
            res = launch.run(config, nproc=nproc, device=device,
                             timeout_s=timeout_s, stream=False, pg_timeout_s=PG_TIMEOUT_S)  # fmt: skip
    except (launch.JobTimeout, launch.JobFailed) as err:
        reports = _reports(exercise_id, err.result.ranks)
        raise _failed(exercise_id, explain_job_error(err, reports)) from None
    reports = _reports(exercise_id, res.ranks)
    if any(diagnosis.is_echo(m) for m in reports.values()):  # a rank saw its peer go or time out
        apart = ranks_apart(res, reports)
        if apart is not None:
            raise _failed(exercise_id, apart)
    return summarize(exercise_id, res.ranks), f"checked in {nproc} worker processes"


def _reports(exercise_id: str, ranks: Sequence[dict[str, Any]]) -> dict[int, str]:
    """{rank: its report} for the ranks whose check of ``exercise_id`` did not pass."""
    return {
        r: without_failed_prefix(exercise_id, x["message"])
        for r, res in enumerate(ranks)
        for x in res.get("results", [])
        if x.get("id") == exercise_id and x.get("status") != "ok"
    }


def _failed(exercise_id: str, message: str) -> ExerciseError:
    err = ExerciseFailed(f"Exercise {exercise_id} failed: {message}")
    err.exercise_id = exercise_id
    return err
