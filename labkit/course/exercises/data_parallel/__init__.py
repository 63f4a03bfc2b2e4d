"""Exercise checks for notebook 02 (data parallelism): three run inside worker processes, one
decision in the kernel.

The learner writes the real thing, three times: DDP that all-reduces each gradient
asynchronously while backward still runs, the bucketed version of it, and ZeRO-1's sharded
optimizer step. A data-parallel exercise is only checked for real when several ranks run it,
so the learner's code goes into a file (a ``%%writefile`` cell in the notebook) that a worker
imports on every rank. The notebook then calls::

    from labkit.course import exercises as ex
    ex.check_in_workers("02.allreduce_grads", ex_dir / "dp_overlap.py")
    # ✓ 02.allreduce_grads: ... (checked in 2 worker processes)

which reads the file in the kernel (a stub is reported at once) and then launches
``labkit.course.exercises.data_parallel.worker`` on ``nproc`` ranks. Each rank imports the file and runs the
registered check (:func:`labkit.course.exercises.verify`) against what torch's
``DistributedDataParallel`` computes (rank 0's weights, the mean of the ranks' gradients; the
tests compare that reference with torch DDP itself) and ``torch.optim.AdamW``, and
reports ok, not done (the generated stub) or failed with the reason. :func:`verify_file`
turns the ranks' reports into one sentence or one :class:`~labkit.course.exercises.ExerciseIncomplete`
/ :class:`~labkit.course.exercises.ExerciseFailed`, which ``check_in_workers`` prints as one line, as
``exercises.check`` does in the kernel. Notebooks define no function a worker imports (a new
process cannot import a notebook's memory: pytorch #20375).

The checks register themselves with :func:`labkit.course.exercises.exercise` when this module is
imported, and need a process group: in a worker the launcher made one; a test may make a
one-rank group in process (``torch.distributed.init_process_group("gloo",
store=torch.distributed.HashStore(), rank=0, world_size=1)``).

The exercises (the class each file must define, see :data:`EXERCISES`):

* ``02.allreduce_grads``  ``OverlapDDP(model, world_size)``: broadcast rank 0's weights, then
  one ``dist.all_reduce(p.grad, async_op=True)`` per parameter from a
  ``register_post_accumulate_grad_hook``, and ``finish_gradient_sync()`` waits on the handles
  and averages, before the optimizer steps (CS336 assignment 2's ``DDPIndividualParameters``);
* ``02.bucketed_ddp``     ``BucketedDDP(model, world_size, bucket_cap_mb)``: the same with the
  gradients grouped, in reverse order, into flat buckets of at most the cap, one all-reduce per
  bucket started when its last gradient arrives (``labkit.parallel.dp_bucketed``; PyTorch DDP
  paper, Li et al. VLDB 2020, section 3.2);
* ``02.zero1_step``       ``ZeRO1Optimizer(params, make_optimizer, rank, world_size)``: its
  ``shard_bounds`` and ``step`` (reduce-scatter the flat gradient, update this rank's shard
  with the optimizer, all-gather the parameters: ZeRO paper, Rajbhandari et al. 2019, 5.1).

And one decision, checked in the kernel with ``exercises.check`` (no ranks needed):

* ``02.choose_strategy``  ``choose_strategy(measured, budget_bytes) -> str | None``: which of
  DDP, ZeRO-1 and FSDP2 to run in a per-rank memory budget, from the ladder's measured step
  times and model-state bytes per rank (:func:`strategy_measurements`; after a step and
  between micro-batches) beside ZeRO's prediction: the fastest whose measured peak fits, None
  if none does. Checked on the notebook's own measurements (:func:`checking_on`) and on
  :func:`strategy_cases`, where each usual wrong decision (:data:`STRATEGY_MISTAKES`: memory
  ignored, the least memory, the formula's bytes, the after-step bytes only, bytes or budget
  times the ranks, the test inverted or strict, the slowest, the least bad when nothing fits)
  gives answers of its own, so the check can name it. The notebook then runs the choice for
  real and holds its measured peak against the budget (:func:`fit_sentence`).

How a check sees *when* things happened: while the learner's code runs, the collectives of
``torch.distributed`` are replaced by thin wrappers that record each call (kind, bytes,
``async_op``, whether backward was still running, how many gradients were ready) and hand out
handles that record when they are waited on. The learner's code is unchanged; it must call the
collectives as ``dist.<name>`` (``import torch.distributed as dist``), as PyTorch's tutorials do.

The work is split by concern, and this module imports every part (registering the checks)
and re-exports the names notebooks and tests use:

    reference        the check model, each rank's batches, and the reference answers: the
                     library's strategies (labkit.parallel) behind the exercise's interface
    spy              the spy on torch.distributed's collectives: what was called, and when
    check_tools      what the worker-run checks share (the group, agreeing across ranks)
    check_ddp        the checks of 02.allreduce_grads and 02.bucketed_ddp
    check_zero1      the check of 02.zero1_step
    strategy         02.choose_strategy: the measurements, the decision and its check
    runner           reading the learner's file, launching the check job, its verdict
    worker           the worker each rank of a check job runs
    bench            naive, overlapped and bucketed DDP timed side by side
    lab              the notebook's jobs planned, and what they measured told (tables, plots)
    lab_ladder       the lab's sections 2-4: the strategies' losses, bytes and memory
    lab_comm         the lab's sections 5-8: collectives, buckets, scaling, overlap, compression

Importing this module has no side effects beyond the registration: no process group, no
files.
"""

from __future__ import annotations

# The checks register themselves with labkit.course.exercises.exercise when imported.
from labkit.course.exercises.data_parallel import check_ddp, check_zero1  # noqa: F401
from labkit.course.exercises.data_parallel.reference import BUCKET_CAP_MB as BUCKET_CAP_MB
from labkit.course.exercises.data_parallel.reference import STEPS as STEPS
from labkit.course.exercises.data_parallel.reference import BucketedDDP as BucketedDDP
from labkit.course.exercises.data_parallel.reference import CheckLM as CheckLM
from labkit.course.exercises.data_parallel.reference import OverlapDDP as OverlapDDP
from labkit.course.exercises.data_parallel.runner import EXERCISES as EXERCISES
from labkit.course.exercises.data_parallel.runner import PG_TIMEOUT_S as PG_TIMEOUT_S
from labkit.course.exercises.data_parallel.runner import WORKER as WORKER
from labkit.course.exercises.data_parallel.runner import DPChecksConfig as DPChecksConfig
from labkit.course.exercises.data_parallel.runner import run_checks as run_checks
from labkit.course.exercises.data_parallel.runner import summarize as summarize
from labkit.course.exercises.data_parallel.runner import verify_file as verify_file
from labkit.course.exercises.data_parallel.strategy import PSI as PSI
from labkit.course.exercises.data_parallel.strategy import STRATEGY_MISTAKES as STRATEGY_MISTAKES
from labkit.course.exercises.data_parallel.strategy import as_predicted as as_predicted
from labkit.course.exercises.data_parallel.strategy import checking_on as checking_on
from labkit.course.exercises.data_parallel.strategy import (
    describe_measurements as describe_measurements,
)
from labkit.course.exercises.data_parallel.strategy import fit_sentence as fit_sentence
from labkit.course.exercises.data_parallel.strategy import peak_bytes as peak_bytes
from labkit.course.exercises.data_parallel.strategy import (
    reference_choose_strategy as reference_choose_strategy,
)
from labkit.course.exercises.data_parallel.strategy import strategy_cases as strategy_cases
from labkit.course.exercises.data_parallel.strategy import (
    strategy_measurements as strategy_measurements,
)
