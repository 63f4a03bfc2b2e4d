"""Exercises: one registry, graded hints, and checks that never stop a learner's Run All.

A learner finishes an exercise, then runs its check::

    from labkit.course import exercises as ex
    count_params = ex.check("01.param_count", count_params)
    # ✓ 01.param_count: count_params(cfg) equals the parameters of labkit.model.GPT(cfg) ...

:func:`check` prints one line and returns what later cells should use:

- ``✓`` and the learner's own answer when it is right (later cells then run on it, and say so);
- ``○ … not done yet`` while the code is still the stub :mod:`labkit.course.nbgen` generated: the
  first, conceptual hint and how to ask for more; it returns the exercise's reference answer,
  so "Run All" carries on and the learner still sees the whole lab;
- ``✗`` and a diagnosis for a wrong answer (what was expected, what came back, the usual mistake
  behind that value, never the code), and again the reference.

The learner's code runs in the kernel under a time limit (:func:`time_limit`); a
``sys.exit`` in it fails the check instead of ending the cell, and a process it started and
left running is named and stopped (:class:`Leftovers`).

Hints come in steps (:func:`hint`): the first is conceptual, each call gives one more, the last
is the recipe. A stub's own message carries no hint at all, so nothing is given away by
running a cell.

Exercises whose code must run on several ranks (notebooks 02, 03, 03b and 03c) are written to a
file by a ``%%writefile`` cell and checked with :func:`check_in_workers`, which reports the same
way.

The registry is data: each :class:`.registry.Exercise` has an id, a title, its hints, a ``verify``
function (takes the learner's answer, raises :class:`ExerciseFailed` or returns a sentence
saying what it verified) and optionally the reference answer. Each notebook's checks live in
their own module of this package (:data:`MODULES`), imported on first need: importing this
package stays cheap and has no side effects. :func:`verify` prints nothing and raises, so the
same checks also run inside worker processes.

The machinery, one concern a module (this package re-exports what notebooks and checks use as
``ex.<name>``):

- :mod:`.registry`: the exercises, their ids and hints, the errors a check ends with;
- :mod:`.learner_code`: the learner's code as a check sees it (a stub?, called safely, its line);
- :mod:`.feedback`: the line a check prints, the hints in steps, whose answer later cells use;
- :mod:`.running`: the check runner (:func:`check`, :func:`verify`, :func:`check_in_workers`);
- :mod:`.time_limits`: the time limit on the learner's code in the kernel;
- :mod:`.leftovers`: the processes the learner's code left running, named and stopped;
- :mod:`.worker_jobs`: files checked on several ranks, and what a broken check job means;
- :mod:`.rank_checks`: the learner's file imported and checked inside worker ranks (03, 03b, 03c).

Its modules:

    batch_size         notebook 05's exercises (batch-size tuning), checked in the kernel
    capstone           notebook 07's exercise (the capstone), checked in the kernel
    composing          exercise checks for notebook 03b (composing parallelisms), in the kernel and
                       in real ranks
    data_science       notebook 08's exercises (multi-GPU training for data science), in the kernel
    data_parallel      exercise checks for notebook 02 (data parallelism): three run inside worker
                       processes, one decision in the kernel
    feedback           what a learner reads: the one line a check prints, the hints in steps, whose
                       answer ran
    first_job          exercise checks for notebook 00 (setup and a first job), run in the kernel
    learner_code       the learner's code as a check sees it: still a stub or not, called safely,
                       its lines named
    leftovers          the processes the learner's code starts in the kernel and leaves running:
                       named and stopped
    mixed_precision    notebook 04's exercises (mixed precision), checked in the kernel
    model_parallel     exercise checks for notebook 03 (model parallelism), run in the kernel and
                       inside worker ranks
    planning           exercise checks for notebook 03d (schedules, debugging, planning), run in the
                       kernel
    profiling          notebook 06's exercises (profiling), checked in the kernel
    rank_checks        checks that run the learner's file inside real ranks (notebooks 03, 03b and
                       03c)
    registry           the exercise registry: what exercises exist, their hints, and how each is
                       verified
    resilience         exercise checks for notebook 02b (beyond one machine), run in the kernel
    running            the check runner: run the learner's answer under a time limit, print one
                       line, never stop Run All
    sequences_experts  exercise checks for notebook 03c (long sequences and many experts), in the
                       kernel and in ranks
    single_gpu         exercise checks for notebook 01 (single-GPU training), run in the kernel
    time_limits        time limits for the learner's code run in the kernel: a loop that never ends
                       fails its check
    worker_jobs        checks whose code runs on several ranks: their files, and what a broken check
                       job means
"""

from __future__ import annotations

from labkit._moved import submodules_on_demand
from labkit.course.exercises.feedback import EXPECT_SOLVED as EXPECT_SOLVED
from labkit.course.exercises.feedback import hint as hint
from labkit.course.exercises.feedback import whose as whose
from labkit.course.exercises.feedback import without_failed_prefix as without_failed_prefix
from labkit.course.exercises.learner_code import STUB_MESSAGE as STUB_MESSAGE
from labkit.course.exercises.learner_code import call as call
from labkit.course.exercises.learner_code import incomplete as incomplete
from labkit.course.exercises.learner_code import is_stub as is_stub
from labkit.course.exercises.learner_code import learner_frame as learner_frame
from labkit.course.exercises.learner_code import short_repr as short_repr
from labkit.course.exercises.leftovers import Leftovers as Leftovers
from labkit.course.exercises.registry import MODULES as MODULES
from labkit.course.exercises.registry import ExerciseError as ExerciseError
from labkit.course.exercises.registry import ExerciseFailed as ExerciseFailed
from labkit.course.exercises.registry import ExerciseIncomplete as ExerciseIncomplete
from labkit.course.exercises.registry import NotSolved as NotSolved
from labkit.course.exercises.registry import catalogue as catalogue
from labkit.course.exercises.registry import exercise as exercise
from labkit.course.exercises.registry import get as get
from labkit.course.exercises.running import check as check
from labkit.course.exercises.running import check_in_workers as check_in_workers
from labkit.course.exercises.running import verify as verify
from labkit.course.exercises.time_limits import TimeLimitReached as TimeLimitReached
from labkit.course.exercises.time_limits import time_limit as time_limit
from labkit.course.exercises.time_limits import time_limit_paused as time_limit_paused
from labkit.course.exercises.worker_jobs import collective_ledger as collective_ledger
from labkit.course.exercises.worker_jobs import explain_job_error as explain_job_error
from labkit.course.exercises.worker_jobs import ranks_apart as ranks_apart
from labkit.course.exercises.worker_jobs import workspace as workspace

# ex.first_job, a notebook's checks: imported when first named, as the registry does on first need
__getattr__ = submodules_on_demand(__name__)
