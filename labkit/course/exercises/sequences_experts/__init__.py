"""Exercise checks for notebook 03c (long sequences and many experts), in the kernel and in ranks.

As in notebooks 03 and 03b (:mod:`labkit.course.exercises.model_parallel`; the machinery they
share is :mod:`labkit.course.exercises.rank_checks`), the learner writes each answer to a file
with ``%%writefile`` and checks it with ``ex.check_in_workers``: first what the kernel can check
(the ring loop on simulated rings), then a launch of ``labkit.course.exercises.model_parallel.worker``,
whose ranks import the same file and run the rank-side check (:func:`rank_check`).

Exercises (``EXERCISES``: id -> the names the learner's file defines):

* ``03c.ring_loop``: ``ring_loop(q, k, v, ring, *, causal) -> (out, lse)``, one rank's loop of
  ring attention: which rank's K/V block is in hand at each step, which blocks a causal mask
  hides entirely (skipped, still passed on), the running (output, log-sum-exp) merged with
  labkit's ``merge``. The reference is labkit's own
  :func:`labkit.parallel.context.ring_attention_blocks`. Checked in the kernel on every rank of
  simulated rings of 1 to 4 ranks, causal and not, against SDPA over the whole sequence, with
  each hop checked and ``block_attention`` and ``merge`` traced, so that a mistake is named
  (a hidden block merged, a block merged twice, a wasted block, a stale log-sum-exp); then on
  a real 2-rank ring (:class:`labkit.parallel.context.P2PRing`).
* ``03c.moe_dispatch``: ``dispatch(x, dest, group=None) -> (received, recv_counts)``, the
  all-to-all that sends each token to the rank holding its expert. Checked in 2 ranks: the
  tokens each rank receives and their order, the counts, and the bytes the collectives moved
  (counted by a dispatch mode that sees every collective): one all-to-all of the tokens, not
  a gather of all of them.
* ``03c.sequence_plan`` (in the kernel, ``ex.check``): ``plan_sequence(seq_len, budget_bytes,
  measured)``, which of section 1's layouts ("tp", "sp_keep_gathered", "sp") to run a longer
  sequence with, from their measured saved activations and traffic, or "cp" when none fits.
  Checked on what the notebook measures for its model at two sizes
  (:func:`.sequence_plan.sequence_measurements`) in seven cases; a learner whose answers all
  follow one usual wrong rule (``WRONG_RULES``) gets that rule named. The
  notebook then runs the three layouts at the new length for real.

Importing this module registers the exercises and has no other effect. Each exercise's check
lives in a module of its own (:mod:`.ring_loop`, :mod:`.moe_dispatch`,
:mod:`.sequence_plan`); this module ties them to the notebook (:data:`EXERCISES`,
:func:`verify_file`, :func:`rank_check`) and re-exports the names the tests use.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Importing each exercise's module registers its exercise.
from labkit.course.exercises import rank_checks
from labkit.course.exercises.sequences_experts import moe_dispatch as se_moe_dispatch
from labkit.course.exercises.sequences_experts import ring_loop as se_ring_loop
from labkit.course.exercises.sequences_experts.sequence_plan import SEQ_ANSWERS as SEQ_ANSWERS
from labkit.course.exercises.sequences_experts.sequence_plan import (
    reference_plan_sequence as reference_plan_sequence,
)

EXERCISES: dict[str, tuple[str, ...]] = {
    "03c.ring_loop": ("ring_loop",),
    "03c.moe_dispatch": ("dispatch",),
}
"""Exercise id -> the names the learner's file must define."""
NPROC = {"03c.ring_loop": se_ring_loop.NPROC, "03c.moe_dispatch": se_moe_dispatch.NPROC}
"""Ranks each exercise's rank-side check runs on."""
RANK_CHECKS: dict[str, Callable[..., str]] = {**se_ring_loop.RANK_CHECKS,
                                              **se_moe_dispatch.RANK_CHECKS}  # fmt: skip
"""Exercise id -> its rank-side check, ``check(ctx, *the learner's objects) -> sentence``."""


def verify_file(exercise_id: str, path: str | Path) -> tuple[str, str]:
    """Check the learner's file ``path`` for ``exercise_id``, in the kernel and in ranks (what
    ``ex.check_in_workers`` calls)."""
    __tracebackhide__ = True
    return rank_checks.verify_file(exercise_id, path, EXERCISES, nproc=NPROC.get(exercise_id, 2))


def rank_check(exercise_id: str, objs: Sequence[Any], ctx: Any) -> dict[str, Any]:
    """Inside a worker rank: run ``exercise_id``'s rank-side check, reported, never raised."""
    return rank_checks.run_rank_check(exercise_id, RANK_CHECKS, objs, ctx)
