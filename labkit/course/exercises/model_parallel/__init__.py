"""Exercise checks for notebook 03 (model parallelism), run in the kernel and inside worker ranks.

Parallel code is only proven by running it in parallel, so two of these exercises run the
learner's code inside real ranks, and a third (a pure function) is also executed there, as
the schedule of a real pipeline; a fourth, a decision (``03.choose_m``), is checked in the
kernel and its answer runs as a real pipeline. A worker process cannot import code that exists
only in a notebook kernel (pytorch #20375), so the learner writes each answer to a file with
``%%writefile``, as in notebook 02 (``labkit.course.exercises.data_parallel``)::

    ex_dir = ex.workspace("03")               # labkit_home()/exercises/03
    %%writefile {ex_dir}/mp_fg.py
    ...
    ex.check_in_workers("03.f_and_g", ex_dir / "mp_fg.py")
    # ✓ 03.f_and_g: every rank's shards are right for world sizes 2, 3, 4; your ...

``check_in_workers`` (through :func:`verify_file`) imports the file in the kernel and runs the exercise's registered check
(``labkit.course.exercises.verify``): first what can be checked here (a stub is reported at once, an
order of operations is compared action by action, a shard is checked for every rank of 2, 3
and 4), then a launch of ``labkit.course.exercises.model_parallel.worker`` on 2 ranks, each of which imports the
same file and runs the rank-side check (``rank_check``). A rank's verdict comes back as the
notebook's ``ExerciseIncomplete`` or ``ExerciseFailed``, naming the rank.

Exercises (``EXERCISES``: id -> the names the learner's file defines):

* ``03.one_f_one_b``: the 1F1B order of one stage, ``one_f_one_b(p, m, stage)``; in the
  workers, the learner's order drives a real 2-stage pipeline (``labkit.parallel.pipeline``)
  whose loss and gradients must equal GPipe's.
* ``03.f_and_g``: Megatron's f and g as ``torch.autograd.Function`` classes ``Enter`` and
  ``Leave``, and ``TensorParallelMLP(mlp, rank, world_size)``, an ``nn.Module`` holding one
  rank's shards of a ``labkit.model.MLP`` (fc column-parallel, proj row-parallel) whose forward
  is f, fc, GELU, proj, g, then proj's bias once. In the kernel every rank's shards are checked
  for 2, 3 and 4 ranks; in the workers the f and g carry a bare MLP of the check's own, then
  the learner's module's output, input gradient (the same on every rank) and shard gradients
  are checked against the unsplit MLP.
* ``03.column_parallel``: ``column_parallel_linear(x, linear, rank, world_size)``, one rank's
  output features of ``linear(x)``; in the workers each rank's shard, its gradient, and the
  all-gathered shards are checked against ``nn.Linear``.
* ``03.choose_m``: a decision from measurements, checked in the kernel:
  ``choose_m(steps_s, p, candidates)``, the number of 1F1B micro-batches with the shortest step,
  from the steps measured at a few m (a model of the bubble's m + p − 1 slots and a fixed cost
  per micro-batch, fitted to them). Checked on pipelines where each usual mistake (the fastest
  measured m, the most micro-batches, one micro-batch) picks an m of its own; the notebook then
  runs the choice for real with :func:`run_m_plan`, 1F1B at it and its neighbours, and
  :func:`judge_m_plan` says with ``labkit.verdict`` whether a neighbour ran faster.

Importing this module registers the exercises and has no other effect. Each exercise's check
lives in a module of its own (:mod:`.pipeline_order`, :mod:`.f_and_g`,
:mod:`.column_parallel`, :mod:`.choose_m`), the machinery that runs a learner's file in
ranks in :mod:`.rank_checks` (shared with 03b and 03c); this module ties them to the notebook
(:data:`EXERCISES`, :func:`verify_file`, :func:`rank_check`) and re-exports the names the
notebook and the tests use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Importing each exercise's module registers its exercise.
from labkit.course.exercises import rank_checks
from labkit.course.exercises.model_parallel import column_parallel as mp_column_parallel
from labkit.course.exercises.model_parallel import f_and_g as mp_f_and_g
from labkit.course.exercises.model_parallel import pipeline_order as mp_pipeline_order
from labkit.course.exercises.model_parallel.choose_m import M_CASES as M_CASES
from labkit.course.exercises.model_parallel.choose_m import fit_m_model as fit_m_model
from labkit.course.exercises.model_parallel.choose_m import judge_m_plan as judge_m_plan
from labkit.course.exercises.model_parallel.choose_m import predicted_step as predicted_step
from labkit.course.exercises.model_parallel.choose_m import reference_choose_m as reference_choose_m
from labkit.course.exercises.model_parallel.choose_m import run_m_plan as run_m_plan
from labkit.course.exercises.model_parallel.column_parallel import (
    column_diagnosis as column_diagnosis,
)
from labkit.course.exercises.model_parallel.f_and_g import TP_WORLD_SIZES as TP_WORLD_SIZES
from labkit.course.exercises.model_parallel.f_and_g import reference_shards as reference_shards
from labkit.course.exercises.model_parallel.f_and_g import shard_diagnosis as shard_diagnosis
from labkit.course.exercises.model_parallel.f_and_g import tp_mlp_case as tp_mlp_case
from labkit.course.exercises.model_parallel.f_and_g import tp_mlp_diagnosis as tp_mlp_diagnosis
from labkit.course.exercises.model_parallel.pipeline_order import order_diagnosis as order_diagnosis
from labkit.course.exercises.rank_checks import NPROC as NPROC
from labkit.course.exercises.rank_checks import WORKER as WORKER
from labkit.course.exercises.rank_checks import CasesConfig as CasesConfig
from labkit.course.exercises.rank_checks import answer_spec as answer_spec
from labkit.course.exercises.rank_checks import load_file as load_file
from labkit.course.exercises.rank_checks import raise_for_results as raise_for_results

EXERCISES: dict[str, tuple[str, ...]] = {
    "03.one_f_one_b": ("one_f_one_b",),
    "03.f_and_g": ("Enter", "Leave", "TensorParallelMLP"),
    "03.column_parallel": ("column_parallel_linear",),
}
"""Exercise id -> the names the learner's file must define (the answer, in this order)."""

RANK_CHECKS: dict[str, Callable[..., str]] = {
    **mp_pipeline_order.RANK_CHECKS,
    **mp_f_and_g.RANK_CHECKS,
    **mp_column_parallel.RANK_CHECKS,
}
"""Exercise id -> its rank-side check, ``check(ctx, *the learner's objects) -> sentence``."""


def answer_from_file(exercise_id: str, path: str | Path) -> Any:
    """The learner's answer to notebook 03's ``exercise_id``, from the file ``path``."""
    return rank_checks.answer_from_file(exercise_id, path, EXERCISES)


def verify_file(exercise_id: str, path: str | Path, nproc: int = NPROC) -> tuple[str, str]:
    """Check the learner's file ``path`` for notebook 03's ``exercise_id``, in the kernel and on
    ``nproc`` ranks (:func:`labkit.course.exercises.rank_checks.verify_file`). Notebooks call it
    through :func:`labkit.course.exercises.check_in_workers`."""
    __tracebackhide__ = True
    return rank_checks.verify_file(exercise_id, path, EXERCISES, nproc)


def rank_check(exercise_id: str, objs: Sequence[Any], ctx: Any) -> dict[str, Any]:
    """Run ``exercise_id``'s rank-side check; never raises for the learner's mistakes.

    Returns {"exercise", "status": "ok" | "incomplete" | "failed", "message"}: every rank
    reports, so the notebook can say which rank saw what.
    """
    return rank_checks.run_rank_check(exercise_id, RANK_CHECKS, objs, ctx)
