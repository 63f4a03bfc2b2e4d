"""Notebook 05's ``05.batch_plan``, the decision: how each rank runs a global batch.

``plan_batch(target, ranks, fits, tokens_per_s, b_noise) -> (micro, k, worth_it)``: the
measured micro-batches that fit and make the target, the fastest within the sweep's noise, of
those the fewest passes; and whether the global batch is worth it (McCandlish et al.'s eq.
2.11: at most twice the least tokens; None where the noise scale is not resolved). This module
holds the rule (:func:`reference_plan_batch`), other machines' measurements where each usual
mistake gives a plan of its own (:data:`PLAN_CASES`) and the diagnosis of a wrong plan;
:mod:`.plan_run` checks the learner's plan and runs it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from labkit.batching import sweep
from labkit.course.exercises import ExerciseFailed, short_repr
from labkit.course.exercises.learner_code import require_int

# --------------------------------------------------------------------------- 05.batch_plan

FLAT = sweep.SATURATION
"""Measured tokens/s at or above this fraction of the fastest candidate count as "as fast": the
sweep's medians move by about 10% between runs on a shared machine (``sweep.SATURATION``)."""


@dataclass(frozen=True)
class PlanInputs:
    """What a batch plan is decided from: a target global batch and one machine's measurements."""

    target: int
    """The global batch a recipe asks for: sequences per optimiser step, all ranks together."""
    ranks: int
    """Data-parallel ranks, each with its own device (and memory)."""
    fits: int
    """The largest micro-batch one rank's memory holds: the finder's, for one pass."""
    tokens_per_s: dict[int, float]
    """Measured tokens/s of a training step at each micro-batch size (the sweep's medians)."""
    b_noise: float
    """The measured gradient noise scale B_simple in sequences; nan, inf or <= 0 where the
    measurement did not resolve it."""
    what: str = "this notebook's measurements"

    def args(self) -> tuple[int, int, int, dict[int, float], float]:
        """The learner's arguments, in order (a fresh dict of the sweep: the function may
        change it)."""
        return self.target, self.ranks, self.fits, dict(self.tokens_per_s), self.b_noise

    def describe(self) -> str:
        sweep_text = ", ".join(f"{b}: {t:,.0f}" for b, t in sorted(self.tokens_per_s.items()))
        return (f"target {self.target} sequences per step on {self.ranks} rank"
                f"{'s' * (self.ranks > 1)}, fits {self.fits}, tokens/s {{{sweep_text}}}, "
                f"b_noise {self.b_noise:.3g}")  # fmt: skip


def noise_resolved(b_noise: float) -> bool:
    return isinstance(b_noise, numbers.Real) and math.isfinite(b_noise) and b_noise > 0


def plan_candidates(target: int, ranks: int, fits: int, tokens_per_s: dict[int, float]) -> list[int]:
    """Measured micro-batches that fit one rank and divide its share of the target."""
    share = target // ranks
    return sorted(b for b in tokens_per_s if 1 <= b <= fits and share % b == 0)


def reference_plan_batch(target: int, ranks: int, fits: int, tokens_per_s: dict[int, float],
                         b_noise: float) -> tuple[int, int, bool | None]:  # fmt: skip
    """(micro-batch, accumulation steps, worth it) for ``target`` sequences per optimiser step.

    Every split of one global batch gives the same gradient, so the split is chosen for speed
    alone: among the measured micro-batches that fit a rank and divide its share, those within
    the sweep's noise (:data:`FLAT`) of the fastest are as fast, and of those the one with the
    fewest accumulation steps (each pass pays the fixed per-pass costs). The target is worth it
    when it needs at most twice the least tokens to a given loss, 1 + B/B_noise <= 2
    (McCandlish et al. 2018, eq. 2.11): None where the noise scale is not resolved.
    """
    if target % ranks:
        raise ValueError(f"target={target} is not a multiple of ranks={ranks}: every rank "
                         f"runs the same number of sequences per step")  # fmt: skip
    candidates = plan_candidates(target, ranks, fits, tokens_per_s)
    if not candidates:
        raise ValueError(f"no measured micro-batch in {sorted(tokens_per_s)} fits {fits} and "
                         f"divides each rank's {target // ranks} sequences")  # fmt: skip
    best = max(tokens_per_s[b] for b in candidates)
    micro = max(b for b in candidates if tokens_per_s[b] >= FLAT * best)
    worth = (target <= b_noise) if noise_resolved(b_noise) else None
    return micro, target // ranks // micro, worth


def _flat_sweep(rates: dict[int, float]) -> dict[int, float]:
    return {b: float(t) for b, t in rates.items()}


PLAN_CASES = (
    PlanInputs(512, 1, 96, _flat_sweep({8: 40e3, 16: 70e3, 32: 105e3, 64: 130e3, 128: 142e3}),
               2000.0, "a GPU whose throughput still rises where its memory ends"),
    PlanInputs(128, 1, 200, _flat_sweep({1: 21e3, 2: 26e3, 4: 48e3, 8: 49e3, 16: 59e3,
                                         32: 57e3, 64: 58e3, 128: 50e3}),
               11.2, "a CPU whose throughput is flat from 16 on and falls at 128"),
    PlanInputs(96, 2, 40, _flat_sweep({3: 30e3, 6: 52e3, 12: 60e3, 24: 63e3, 48: 64e3}),
               70.0, "two ranks, a sweep of multiples of 3"),
    PlanInputs(1024, 4, 80, _flat_sweep({16: 100e3, 32: 118e3, 64: 112e3}),
               100.0, "four ranks whose fastest median is not the largest of the flat ones"),
    PlanInputs(64, 1, 20, _flat_sweep({1: 20e3, 2: 30e3, 4: 45e3, 8: 50e3, 16: 52e3, 32: 53e3}),
               math.nan, "a noise scale that was not resolved (nan)"),
    PlanInputs(48, 1, 40, _flat_sweep({4: 30e3, 8: 40e3, 16: 44e3, 32: 45e3}),
               -3.5, "a negative noise-scale estimate, and a fast size that does not divide"),
)  # fmt: skip
"""Other machines' measurements: each usual mistake gives a plan of its own in at least one
(tests/test_exercises_batch_size.py holds them apart)."""


def plan_answer(got: Any, shown: str) -> tuple[int, int, bool | None]:
    """The learner's plan as (micro, k, worth), or a failure naming what came back."""
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        n = len(got) if isinstance(got, (tuple, list)) else None
        more = (" (did you leave out worth_it?)" if n == 2 else "")
        raise ExerciseFailed(f"{shown} returned {short_repr(got)}; return three things, "
                             f"(micro_batch, accumulation_steps, worth_it){more}")  # fmt: skip
    micro = require_int(got[0], f"{shown}[0] (the micro-batch)")
    k = require_int(got[1], f"{shown}[1] (the accumulation steps)")
    worth = got[2]
    if worth is not None and not isinstance(worth, bool):
        raise ExerciseFailed(f"{shown} returned worth_it={short_repr(worth)} "
                             f"({type(worth).__name__}); return True, False, or None where the "
                             f"measurements cannot say (bool(...) makes a Python bool)")  # fmt: skip
    return micro, k, worth


def _worth_rule(answers: dict[int, tuple[PlanInputs, tuple[int, int, bool | None]]],
                rule: Callable[[PlanInputs, tuple[int, int, bool | None]], float]) -> bool:
    """Whether every worth_it the learner gave on a resolved noise scale is ``rule``'s number
    held against the noise scale (one case alone cannot tell the share from the micro-batch)."""
    resolved = [(c, got) for c, got in answers.values() if noise_resolved(c.b_noise)]
    return bool(resolved) and all(got[2] == (rule(c, got) <= c.b_noise) for c, got in resolved)


def plan_failure(case: PlanInputs, got: tuple[int, int, bool | None],
                  answers: dict[int, tuple[PlanInputs, tuple[int, int, bool | None]]]
                  ) -> str | None:  # fmt: skip
    """What is wrong with the plan ``got`` for ``case``, naming the usual mistake, or None.
    ``answers``: the learner's plan on every case, by position (to tell mistakes apart)."""
    micro, k, worth = got
    T, n, F, tps, bn = case.target, case.ranks, case.fits, case.tokens_per_s, case.b_noise
    right_m, right_k, right_w = reference_plan_batch(*case.args())
    share = T // n
    at = f"for {case.what} ({case.describe()}) you planned {micro} × {k}, worth_it={worth!r}"
    if micro < 1 or k < 1:
        return f"{at}: a micro-batch and a number of accumulation steps are counts, at least 1"
    if micro * k * n != T:
        if n > 1 and micro * k == T:
            return (f"{at}: on {n} ranks that makes {micro * k * n} sequences per optimiser step, "
                    f"{n} times the target. Each rank runs its own micro-batches and the "
                    f"all-reduce averages them all: the global batch is micro-batch × "
                    f"accumulation × ranks, so a rank's share is the target over the ranks")  # fmt: skip
        if share % micro:
            return (f"{at}: each rank's share of {share} sequences is not a whole number of "
                    f"micro-batches of {micro}, so no accumulation count makes the target "
                    f"exactly ({micro} × {k} × {n} = {micro * k * n})")  # fmt: skip
        return (f"{at}: {micro} × {k} × {n} rank{'s' * (n > 1)} = {micro * k * n} sequences per "
                f"optimiser step, not the target {T}")  # fmt: skip
    if micro > F:
        return (f"{at}: a micro-batch of {micro} does not fit: the finder fitted at most {F} in "
                f"one rank's memory. Memory is per rank and per micro-batch: accumulation is "
                f"how a larger batch gets through it")  # fmt: skip
    if micro not in tps:
        return (f"{at}: micro-batch {micro} was never measured (the sweep measured "
                f"{sorted(tps)}): its speed is a guess. Decide among the measured sizes")  # fmt: skip
    candidates = plan_candidates(T, n, F, tps)
    fastest = max(candidates, key=lambda b: tps[b])
    if micro > right_m:  # the largest that fits and divides, measured slower beyond the noise
        return (f"{at}: the sweep measured micro-batch {micro} at {tps[micro]:,.0f} tokens/s, "
                f"{1 - tps[micro] / tps[fastest]:.0%} below {fastest}'s {tps[fastest]:,.0f}, more "
                f"than the sweep's noise ({1 - FLAT:.0%}). The largest micro-batch that fits is "
                f"not the fastest here: the measurements choose, not the memory")  # fmt: skip
    if micro < right_m:
        if tps[micro] >= FLAT * tps[fastest]:
            return (f"{at}: micro-batch {right_m} also fits and divides each rank's share, and "
                    f"the sweep cannot tell it from {micro} (both within {1 - FLAT:.0%} of the "
                    f"fastest, {fastest}: a median that high is luck as much as speed). Every "
                    f"split of one global batch gives the same gradient (section 3), so the "
                    f"{k} accumulation steps buy nothing over {right_k}, and each pass pays the "
                    f"fixed per-pass costs of section 1 again: of splits that are as fast, take "
                    f"the one with the fewest passes")  # fmt: skip
        return (f"{at}: the sweep measured micro-batch {micro} at {tps[micro]:,.0f} tokens/s, "
                f"{1 - tps[micro] / tps[fastest]:.0%} below {fastest}'s: more accumulation "
                f"than needed. Accumulating does not change the gradient (section 3); it only "
                f"cuts the step into more, slower passes. A larger measured micro-batch that "
                f"fits and divides each rank's share runs faster")  # fmt: skip
    if worth is right_w:
        return None
    if right_w is None:
        return (f"{at}: the noise scale was not resolved (b_noise={bn!r}: an estimate of |G|² "
                f"that was not positive gives no finite, positive scale), so the measurements "
                f"cannot say whether the target is worth it: say None, not {worth!r}")  # fmt: skip
    if worth is None:
        return (f"{at}: the noise scale is resolved here ({bn:.3g} sequences), so the "
                f"measurements can decide: say True or False")  # fmt: skip
    if _worth_rule(answers, lambda c, g: g[0]) and worth == (micro <= bn):
        return (f"{at}: you held the micro-batch ({micro}) against the noise scale ({bn:.3g}). "
                f"The optimiser steps once on the average of all {k * n} micro-batches of the "
                f"step: the gradient's noise is that of the global batch of {T}")  # fmt: skip
    if n > 1 and worth == (share <= bn) and (share <= bn) != (T <= bn):
        return (f"{at}: you held each rank's share ({share} sequences) against the noise scale "
                f"({bn:.3g}). The noise scale is about the gradient one optimiser step "
                f"averages, and with data parallelism that is every rank's micro-batches "
                f"together: the global batch of {T}")  # fmt: skip
    return (f"{at}: a global batch of {T} against a noise scale of {bn:.3g} sequences needs "
            f"1 + B/B_noise = {1 + T / bn:.3g} times the least tokens to reach a given loss "
            f"(McCandlish et al. 2018, eq. 2.11): {'at most' if right_w else 'more than'} "
            f"twice, which is where the trade of steps for tokens stops paying (B_crit)")  # fmt: skip
