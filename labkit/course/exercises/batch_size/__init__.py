"""Notebook 05's exercises (batch-size tuning), checked in the kernel.

* ``05.accumulation``: ``accumulate(model, batch, k)``: k micro-batches whose backward passes
  leave the whole batch's gradient in ``.grad``, against one backward over the batch
  (:func:`labkit.batching.accumulation.accumulated_gradients` with k=1).
* ``05.max_batch``: ``largest_batch(trial, recover, start, max_batch) -> int``: the largest
  batch that fits, by doubling and bisection with recovery after each failure, run on simulated
  memory limits and then on real training steps of a small GPT under a CPU memory budget
  (:class:`labkit.batching.trials.BudgetedCPU`), against
  :func:`labkit.batching.finder.search_max_batch`.
* ``05.noise_scale``: ``noise_scale(sq_small, sq_big, b_small, b_big) -> float``: B_simple from
  paired squared gradient norms (McCandlish et al. 2018, arXiv 1812.06162, appendix A.1), against
  :func:`labkit.batching.noise.estimate_noise_scale`.
* ``05.batch_plan``: ``plan_batch(target, ranks, fits, tokens_per_s, b_noise) -> (micro, k,
  worth_it)``: a decision from measurements, how each rank runs a global batch (the measured
  micro-batches that fit and make the target, the fastest within the sweep's noise, of those
  the fewest passes) and whether the global batch is worth it (McCandlish et al.'s eq. 2.11:
  at most twice the least tokens; None where the noise scale is not resolved). Checked on other
  machines' measurements (:data:`PLAN_CASES`, where each usual mistake gives a plan of its own)
  and on the notebook's (:func:`measured_here`); then the plan runs for real
  (:func:`.plan_run.run_plan`): one step under the notebook's memory limit, and its step time against one
  other split with :func:`labkit.verdict.compare_times`, which never fails a right plan.

Each check runs the learner's code on small, fixed inputs (about a second on a laptop CPU),
compares it with labkit's tested implementation, and names the usual mistake behind a wrong
answer without printing the code that would fix it.

Each exercise's check lives in a module of its own (:mod:`.accumulation`,
:mod:`.max_batch`, :mod:`.noise_scale`, and :mod:`.batch_plan` with
:mod:`.plan_run`); this module imports them, which registers the exercises, and re-exports
the names the notebook and the tests use.

Its modules:

    accumulation       notebook 05's 05.accumulation: gradient accumulation over k micro-batches
    batch_plan         notebook 05's 05.batch_plan, the decision: how each rank runs a global batch
    max_batch          notebook 05's 05.max_batch: the largest batch that fits, by doubling and
                       bisection
    noise_scale        notebook 05's 05.noise_scale: the simple noise scale B_simple from gradient
                       norms
    plan_run           notebook 05's 05.batch_plan, checked and run: the plan on the notebook's own
                       machine
"""

from __future__ import annotations

from labkit.course.exercises.batch_size.accumulation import ACCUM_KS as ACCUM_KS
from labkit.course.exercises.batch_size.batch_plan import PLAN_CASES as PLAN_CASES
from labkit.course.exercises.batch_size.batch_plan import PlanInputs as PlanInputs
from labkit.course.exercises.batch_size.batch_plan import (
    reference_plan_batch as reference_plan_batch,
)
from labkit.course.exercises.batch_size.max_batch import REAL_BETWEEN as REAL_BETWEEN
from labkit.course.exercises.batch_size.max_batch import REAL_CFG as REAL_CFG
from labkit.course.exercises.batch_size.max_batch import SEARCH_CASES as SEARCH_CASES
from labkit.course.exercises.batch_size.max_batch import (
    reference_largest_batch as reference_largest_batch,
)
from labkit.course.exercises.batch_size.max_batch import trial_bound as trial_bound
from labkit.course.exercises.batch_size.noise_scale import NOISE_KNOWN as NOISE_KNOWN
from labkit.course.exercises.batch_size.noise_scale import noise_mistakes as noise_mistakes
from labkit.course.exercises.batch_size.noise_scale import (
    reference_noise_scale as reference_noise_scale,
)
from labkit.course.exercises.batch_size.plan_run import PlanRun as PlanRun
from labkit.course.exercises.batch_size.plan_run import forget_here as forget_here
from labkit.course.exercises.batch_size.plan_run import measured_here as measured_here
