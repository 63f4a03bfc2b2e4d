"""Notebook 05's ``05.noise_scale``: the simple noise scale B_simple from gradient norms.

``noise_scale(sq_small, sq_big, b_small, b_big) -> float``: B_simple from paired squared
gradient norms (McCandlish et al. 2018, arXiv 1812.06162, appendix A.1), against
:func:`labkit.batching.noise.estimate_noise_scale`, on known values and on norms measured on a
small GPT; a wrong value is matched against the usual mistakes (ratios of means swapped for
means of ratios, the batch sizes exchanged).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch

from labkit.batching import noise
from labkit.batching.noise import Batch
from labkit.course.exercises import ExerciseFailed, call, exercise, short_repr
from labkit.course.exercises.batch_size.accumulation import ACCUM_CFG
from labkit.course.exercises.learner_code import callable_name, require_callable

# --------------------------------------------------------------------------- the reference
# What later cells use while the learner's answer is not done or wrong.


def reference_noise_scale(sq_small: Sequence[float], sq_big: Sequence[float], b_small: int,
                          b_big: int) -> float:  # fmt: skip
    """B_simple = tr(Sigma)/|G|^2, each averaged over the measurements before dividing."""
    return noise.estimate_noise_scale(sq_small, sq_big, b_small, b_big).b_simple



# --------------------------------------------------------------------------- 05.noise_scale

NOISE_KNOWN = (
    # Around |G|^2 = 1, tr(Sigma) = 64 (B_simple 64): E|G_B|^2 = 1 + 64/B is 17 at B=4 and 3 at
    # B=32; each measurement is off by noise, so the per-pair estimates differ.
    ("four measurements whose pair estimates differ", 4, 32,
     (15.0, 19.0, 14.0, 18.0), (3.4, 3.0, 3.1, 2.9)),
)  # fmt: skip
NOISE_REAL_B = (2, 16)
NOISE_REAL_PAIRS = 4


@functools.cache
def _real_noise_case() -> tuple[str, int, int, tuple[float, ...], tuple[float, ...]]:
    """Squared gradient norms of a small GPT at initialisation, measured now (milliseconds)."""
    from labkit.model import GPT

    torch.manual_seed(0)
    model = GPT(ACCUM_CFG)
    g = torch.Generator().manual_seed(2)
    bs, bb = NOISE_REAL_B

    def batch(b: int) -> Batch:
        # a rule to learn (the next token is this one plus 1): on random targets the true
        # gradient is near 0 and a few pairs cannot resolve it (the estimate of |G|^2 is <= 0)
        x = torch.randint(0, ACCUM_CFG.vocab_size, (b, ACCUM_CFG.seq_len), generator=g)
        return x, (x + 1) % ACCUM_CFG.vocab_size

    small, big = [], []
    for _ in range(NOISE_REAL_PAIRS):
        small += noise.gradient_sq_norms(model, [batch(bs)])
        big += noise.gradient_sq_norms(model, [batch(bb)])
    return ("squared gradient norms of a small GPT at initialisation, measured now", bs, bb,
            tuple(small), tuple(big))  # fmt: skip


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def noise_mistakes(small: Sequence[float], big: Sequence[float], bs: int,
                   bb: int) -> dict[str, float]:  # fmt: skip
    """The value each usual mistake gives, keyed by what the check says about it."""
    g2 = [(bb * gb - bs * gs) / (bb - bs) for gs, gb in zip(small, big, strict=True)]
    tr = [(gs - gb) / (1 / bs - 1 / bb) for gs, gb in zip(small, big, strict=True)]
    # b_small and b_big swapped (or the two lists): each formula with the other batch's size
    g2_swapped = [(bs * gb - bb * gs) / (bs - bb) for gs, gb in zip(small, big, strict=True)]
    tr_swapped = [(gs - gb) / (1 / bb - 1 / bs) for gs, gb in zip(small, big, strict=True)]
    mistakes = {
        "you averaged the ratio of each pair. One pair's |G|² estimate is noisy (it can be near "
        "0, or negative), and the mean of ratios of noisy numbers is biased: average the |G|² "
        "estimates and the tr(Σ) estimates over all pairs first, then divide once":
            _mean([t / g for t, g in zip(tr, g2, strict=True)]),
        "b_small and b_big are swapped (or the two lists are): the small batch's gradient is "
        "the noisier, so its squared norm is the larger one, and it goes with b_small":
            _mean(tr_swapped) / _mean(g2_swapped),
        "you used |G_big|² as |G|²: a batch of b_big still carries noise tr(Σ)/b_big. Combine "
        "both sizes into the unbiased estimate of |G|²": _mean(tr) / _mean(big),
        "tr(Σ) is missing its denominator: |G_small|² − |G_big|² estimates "
        "tr(Σ)·(1/b_small − 1/b_big), so divide by that":
            _mean([gs - gb for gs, gb in zip(small, big, strict=True)]) / _mean(g2),
        "|G|² is missing its denominator: b_big·|G_big|² − b_small·|G_small|² estimates "
        "|G|²·(b_big − b_small), so divide by that":
            _mean(tr) / _mean([bb * gb - bs * gs for gs, gb in zip(small, big, strict=True)]),
        "that is |G|²/tr(Σ), upside down: B_simple = tr(Σ)/|G|², the batch at which the noise "
        "equals the signal": _mean(g2) / _mean(tr),
        "you used only the first measurement: one pair is noisy; average over all of them":
            tr[0] / g2[0],
    }  # fmt: skip
    return mistakes


@exercise(
    "05.noise_scale",
    "The gradient noise scale B_simple from two batch sizes",
    hints=(
        "a batch gradient's squared norm is signal plus noise: on average the true gradient's "
        "squared norm plus the per-example noise divided by the batch size. Two batch sizes "
        "give two equations in those two unknowns; B_simple is noise over signal",
        "solve the two equations for one measurement pair. For |G|², eliminate the noise: "
        "weight each squared norm by its batch size and divide by the difference of the sizes. "
        "For tr(Σ), eliminate the signal: the difference of the squared norms over the "
        "difference of 1/B",
        "one pair's estimates are noisy and can even be negative, and a ratio of noisy numbers "
        "is biased: average the |G|² estimates and the tr(Σ) estimates over all pairs first, "
        "then divide once. Return a Python float",
        "recipe: take the measurements pair by pair, the small batch's squared norm with the "
        "big batch's of the same index, and write eq. A.1 once for each of the two sizes. To "
        "eliminate the noise and keep the signal |G|², multiply each squared norm by its own "
        "batch size, take the small batch's product from the big batch's, and divide by the "
        "big size less the small size. To eliminate the signal and keep the noise, the trace "
        "of Σ, take the big batch's squared norm from the small batch's and divide by the "
        "reciprocal of the small size less the reciprocal of the big size. Average the signal "
        "estimates over all pairs, average the noise estimates over all pairs, and return the "
        "noise average divided by the signal average, as a Python float",
    ),
    reference=reference_noise_scale,
)
def _verify_noise_scale(noise_scale: Any) -> str:
    fn = require_callable(noise_scale, "noise_scale(sq_small, sq_big, b_small, b_big) -> float")
    cases = [*NOISE_KNOWN, _real_noise_case()]
    for what, bs, bb, small, big in cases:
        got = call(fn, list(small), list(big), bs, bb)
        if isinstance(got, noise.NoiseScale):
            raise ExerciseFailed(
                f"{callable_name(fn)} returned a NoiseScale (labkit's whole estimate); return the float "
                f"B_simple itself (its b_simple)"
            )
        if isinstance(got, (torch.Tensor, bool)) or not isinstance(got, numbers.Real):
            raise ExerciseFailed(
                f"{callable_name(fn)}(...) returned {type(got).__name__} {short_repr(got)}; return a "
                f"Python float (float(x), or x.item() for a one-element tensor)"
            )
        expected = reference_noise_scale(small, big, bs, bb)
        if math.isclose(float(got), expected, rel_tol=1e-9):
            continue
        why = next((w for w, v in noise_mistakes(small, big, bs, bb).items()
                    if math.isclose(float(got), v, rel_tol=1e-9)),
                   "estimate |G|² and tr(Σ) for each pair, average each, then divide")  # fmt: skip
        raise ExerciseFailed(
            f"on {what} (b_small={bs}, b_big={bb}, {len(small)} pairs) expected B_simple = "
            f"{expected:.6g} (labkit.batching.noise.estimate_noise_scale), got {float(got):.6g}: "
            f"{why}"
        )
    _, bs, bb, small, big = cases[-1]
    return (f"noise_scale agrees with labkit.batching.noise.estimate_noise_scale on "
            f"{len(cases)} sets of measurements, among them real gradients of a small GPT "
            f"(B_simple = {reference_noise_scale(small, big, bs, bb):.3g} sequences)")  # fmt: skip
