"""How large a batch should be: global-batch arithmetic, learning-rate scaling rules, and the
gradient noise scale measured from real gradients.

Global batch (Hugging Face, "The Ultra-Scale Playbook", gbs = mbs x grad_acc x dp): one optimiser
step averages the gradient of ``micro_batch x grad_accum x ranks`` sequences, whatever mix of the
three produces them (labkit.train.train_step divides each micro-batch loss by the number of
micro-batches to make it so).

Learning rate against batch, three rules (:func:`scaled_lr`), for a batch k = B/B_0 times the
batch B_0 at which the rate lr_0 was tuned:

* ``"linear"``: lr = k lr_0. Goyal et al. 2017, "Accurate, Large Minibatch SGD", arXiv 1706.02677,
  §2.1 "Linear Scaling Rule: when the minibatch size is multiplied by k, multiply the learning
  rate by k", for SGD with momentum; §2.2 adds the *gradual warm-up* it needs: start at lr_0 and
  rise by a constant amount each iteration to k lr_0 after 5 epochs (ResNet-50 on ImageNet, up to
  8k images a batch). McCandlish et al. 2018 (below), eq. 2.6, explain the rule for plain SGD:
  the best step eps_opt(B) = eps_max / (1 + B_noise/B) grows linearly in B while B << B_noise and
  stops growing beyond it.
* ``"sqrt"``: lr = sqrt(k) lr_0. Malladi, Lyu, Panigrahi & Arora 2022, "On the SDEs and Scaling
  Rules for Adaptive Gradient Algorithms" (NeurIPS 2022, arXiv 2205.10287) derive it for RMSprop
  and Adam from their SDE approximations. Their full rule changes more than the rate: with the
  batch times k, also 1 - beta1 and 1 - beta2 times k, and Adam's epsilon divided by sqrt(k).
  :func:`scaled_lr` returns the rate only; the other three are the caller's to set.
* ``"none"``: lr = lr_0, the control.

The gradient noise scale. McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of
Large-Batch Training", arXiv 1812.06162. G is the true gradient (mean over examples), Sigma the
covariance of one example's gradient. A batch of B independent examples has mean G and covariance
Sigma/B (eq. 2.2), so B_simple = tr(Sigma)/|G|^2 (eq. 2.9) is the batch at which the noise in the
batch gradient, E|G_B - G|^2 = tr(Sigma)/B, equals the signal |G|^2 (eq. 2.10). It is the
simplified form of B_noise = tr(H Sigma)/(G^T H G) (eq. 2.8), equal to it when the Hessian H is a
multiple of the identity. Their model then predicts the steps S and examples E needed to reach a
given loss at batch B trade off as S/S_min - 1 = (E/E_min - 1)^-1 (eq. 2.11), the critical batch
B_crit = E_min/S_min (eq. 2.12) being the balance point: at B = B_crit a run takes 2 S_min steps
and 2 E_min examples; far below it more steps buy few examples back, far above it more examples
buy few steps. Their model predicts B_crit ~ B_noise (§2.3); §3 compares measured B_crit with
B_simple task by task. Read B_simple as an order-of-magnitude guide to where the trade-off
turns, not a setting.

Appendix A.1 measures B_simple from squared norms of batch gradients at two sizes. Since
E|G_B|^2 = |G|^2 + tr(Sigma)/B (eq. A.1), the unbiased estimates (eq. A.2) are

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

Their ratio is *not* unbiased (a single |G|^2 estimate can be near zero, or negative), so each is
averaged over many measurements first and only the averages are divided (the paper uses
exponential moving averages): :func:`estimate_noise_scale`.

Shapes and names below: B a batch size in sequences (the examples the estimator counts; tokens
within a sequence are not independent, so the unit is a sequence of T tokens: multiply by T for
tokens), T seq_len, P the number of parameters.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from labkit.data import get_batch
from labkit.validate import positive, whole  # one rule for every labkit argument

RULES = ("none", "linear", "sqrt")
"""The learning-rate scaling rules :func:`scaled_lr` knows."""

Batch = tuple[torch.Tensor, torch.Tensor]


# ----------------------------------------------------------------------------------------------
# Global-batch arithmetic


def global_batch(micro_batch: int, grad_accum: int, ranks: int = 1) -> int:
    """Sequences averaged by one optimiser step: micro_batch x grad_accum x ranks."""
    return (
        whole("micro_batch", micro_batch, low=1)
        * whole("grad_accum", grad_accum, low=1)
        * whole("ranks", ranks, low=1)
    )


def accumulation_steps(global_batch: int, micro_batch: int, ranks: int = 1) -> int:
    """The grad_accum that makes ``global_batch`` from ``micro_batch`` on each of ``ranks``.

    Refuses a global batch that micro_batch x ranks does not divide, naming the global batches
    that would work and the micro-batches that would.
    """
    total = whole("global_batch", global_batch, low=1)
    micro = whole("micro_batch", micro_batch, low=1)
    n = whole("ranks", ranks, low=1)
    per_pass = micro * n  # sequences one micro-batch step covers across all ranks
    if total % per_pass:
        fix = (
            f"use a global_batch that is a multiple of micro_batch x ranks = {per_pass} "
            f"({per_pass}, {2 * per_pass}, {3 * per_pass}, ...)"
        )
        if total % n == 0:
            divisors = [d for d in range(1, total // n + 1) if (total // n) % d == 0]
            fix += f", or a micro_batch in {divisors}"
        else:
            fix += f" (global_batch={total} is not even a multiple of ranks={n})"
        raise ValueError(
            f"global_batch={total} is not a whole number of micro-batches: "
            f"micro_batch={micro} x ranks={n} = {per_pass} does not divide it; {fix}"
        )
    return total // per_pass


# ----------------------------------------------------------------------------------------------
# Learning-rate scaling rules


def scaled_lr(base_lr: float, base_batch: int, batch: int, rule: str) -> float:
    """The learning rate for ``batch`` given ``base_lr`` tuned at ``base_batch``.

    ``rule``: "none" (lr unchanged), "linear" (times k = batch/base_batch, Goyal et al. 2017
    §2.1, with a warm-up, §2.2) or "sqrt" (times sqrt(k), Malladi et al. 2022, for Adam-style
    optimisers; their rule also rescales the betas and epsilon: see the module docstring).
    """
    if rule not in RULES:
        raise ValueError(f"rule={rule!r} is not a scaling rule: use one of {RULES}")
    lr = positive("base_lr", base_lr)
    k = whole("batch", batch, low=1) / whole("base_batch", base_batch, low=1)
    if rule == "linear":
        return lr * k
    if rule == "sqrt":
        return lr * math.sqrt(k)
    return lr


# ----------------------------------------------------------------------------------------------
# The gradient noise scale (McCandlish et al. 2018, appendix A.1)


@dataclass(frozen=True)
class NoiseScale:
    """An estimate of the gradient noise scale from ``n`` paired measurements."""

    b_small: int
    """The small batch (sequences)."""
    b_big: int
    """The big batch (sequences)."""
    g2: float
    """Mean of the unbiased estimates of |G|^2, the true gradient's squared norm."""
    trace_sigma: float
    """Mean of the unbiased estimates of tr(Sigma), one example's gradient variance summed over
    parameters."""
    b_simple: float
    """trace_sigma / g2, in sequences: the ratio of the means (eq. 2.9 estimated as in A.1).
    nan when g2 <= 0: the measurements did not resolve the signal (more repeats, or a larger
    b_big)."""
    n: int
    """Number of paired measurements averaged."""
    g2_each: tuple[float, ...]
    """The |G|^2 estimate of each measurement (noisy; may be negative)."""
    trace_sigma_each: tuple[float, ...]
    """The tr(Sigma) estimate of each measurement (noisy; may be negative)."""

    def interval(self, confidence: float = 0.9, resamples: int = 1000,
                 seed: int = 0) -> tuple[float, float]:  # fmt: skip
        """A bootstrap interval for ``b_simple``: the measurements resampled with replacement,
        the ratio of means taken each time (percentile method; Efron and Tibshirani 1993,
        "An Introduction to the Bootstrap", ch. 13). A resample whose |G|^2 mean is <= 0 has
        no finite ratio and counts as +inf: an interval reaching inf says the signal is not
        resolved."""
        return self._bootstrap(lambda g2, tr: tr / g2 if g2 > 0 else math.inf,
                               confidence, resamples, seed)  # fmt: skip

    def expected_sq_norm(self, batch: int) -> float:
        """E|G_B|^2 = |G|^2 + tr(Sigma)/B (eq. A.1) at another batch size, from the estimates."""
        return self.g2 + self.trace_sigma / whole("batch", batch, low=1)

    def expected_sq_norm_interval(self, batch: int, confidence: float = 0.9,
                                  resamples: int = 1000, seed: int = 0) -> tuple[float, float]:  # fmt: skip
        """A bootstrap interval for :meth:`expected_sq_norm`, as :meth:`interval`."""
        b = whole("batch", batch, low=1)
        return self._bootstrap(lambda g2, tr: g2 + tr / b, confidence, resamples, seed)

    def _bootstrap(self, statistic: Any, confidence: float, resamples: int,
                   seed: int) -> tuple[float, float]:  # fmt: skip
        if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) \
                or not 0 < confidence < 1:  # fmt: skip
            raise ValueError(f"confidence={confidence!r} is not allowed: a number in (0, 1)")
        n_resamples = whole("resamples", resamples, low=1)
        rng = random.Random(seed)
        pairs = list(zip(self.g2_each, self.trace_sigma_each, strict=True))
        values = []
        for _ in range(n_resamples):
            pick = rng.choices(pairs, k=len(pairs))
            values.append(statistic(math.fsum(g for g, _ in pick) / len(pick),
                                    math.fsum(t for _, t in pick) / len(pick)))  # fmt: skip
        values.sort()
        tail = (1 - confidence) / 2
        lo = values[min(len(values) - 1, int(tail * len(values)))]
        hi = values[min(len(values) - 1, math.ceil((1 - tail) * len(values)) - 1)]
        return lo, hi


def steps_and_examples(batch: float, b_noise: float) -> tuple[float, float]:
    """McCandlish et al.'s trade-off at batch B for a noise scale B_noise (eq. 2.11 with 2.12).

    Returns (S/S_min, E/E_min): the optimiser steps and the examples needed to reach a given
    loss, as multiples of their least possible values, S/S_min = 1 + B_noise/B and
    E/E_min = 1 + B/B_noise. Both are 2 at B = B_noise; a batch 10x smaller needs 11x the least
    steps, one 10x larger 11x the least examples. Modelled, with B_crit taken as B_noise.
    """
    b = positive("batch", batch)
    noise = positive("b_noise", b_noise)
    return 1 + noise / b, 1 + b / noise


def _sq_norms(name: str, values: Iterable[Any]) -> list[float]:
    out = [float(v) for v in values]
    for i, v in enumerate(out):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{name}[{i}]={v!r}: a squared norm must be finite and >= 0")
    return out


def estimate_noise_scale(
    sq_norms_small: Sequence[float],
    sq_norms_big: Sequence[float],
    b_small: int,
    b_big: int,
) -> NoiseScale:
    """B_simple from paired squared gradient norms |G_small|^2, |G_big|^2 (eq. A.2).

    ``sq_norms_small[i]`` and ``sq_norms_big[i]`` are the squared L2 norms of the mean-loss
    gradient of a batch of ``b_small`` and of ``b_big`` sequences (measurement i). Each
    measurement gives an unbiased |G|^2 and tr(Sigma); both are averaged over the measurements
    *before* dividing, since the ratio of one pair is biased.
    """
    small = _sq_norms("sq_norms_small", sq_norms_small)
    big = _sq_norms("sq_norms_big", sq_norms_big)
    bs = whole("b_small", b_small, low=1)
    bb = whole("b_big", b_big, low=1)
    if bs >= bb:
        raise ValueError(f"b_small={bs} must be smaller than b_big={bb}: pass b_small < b_big")
    if not small:
        raise ValueError("no measurements: pass at least one pair of squared norms")
    if len(small) != len(big):
        raise ValueError(
            f"{len(small)} small-batch norms but {len(big)} big-batch norms: "
            "pass one of each per measurement"
        )
    # eq. A.2, one measurement at a time (units: squared gradient norm; tr(Sigma) is per example)
    g2_each = tuple((bb * gb - bs * gs) / (bb - bs) for gs, gb in zip(small, big, strict=True))
    tr_each = tuple((gs - gb) / (1 / bs - 1 / bb) for gs, gb in zip(small, big, strict=True))
    g2 = math.fsum(g2_each) / len(g2_each)
    trace_sigma = math.fsum(tr_each) / len(tr_each)
    b_simple = trace_sigma / g2 if g2 > 0 else math.nan
    return NoiseScale(bs, bb, g2, trace_sigma, b_simple, len(small), g2_each, tr_each)


def gradient_sq_norms(model: nn.Module, batches: Iterable[Batch]) -> list[float]:
    """|grad of the mean loss|^2 over all trainable parameters, one value per (x, y) batch.

    ``model(x, y)`` must return ``(logits, loss)`` with ``loss`` the mean over the batch (the
    labkit GPT does). Runs without autocast: the weights' dtype (fp32 for labkit's models) and the
    model's current mode (train mode: dropout as in training). The gradient comes from
    ``torch.autograd.grad``, which returns it instead of accumulating into ``.grad``: parameters,
    their ``.grad`` and any optimiser are left exactly as they were.
    """
    params = [p for p in model.parameters() if p.requires_grad]  # shared (tied) weights once
    if not params:
        raise ValueError("the model has no trainable parameters: nothing to take a gradient of")
    device = params[0].device
    norms = []
    for x, y in batches:
        _, loss = model(x.to(device), y.to(device))
        grads = torch.autograd.grad(loss, params, allow_unused=True)  # P values in all
        # float64 sum: P squares of small numbers, accumulated without rounding drift
        total = sum(g.double().pow(2).sum() for g in grads if g is not None)
        norms.append(float(total))
    return norms


def measure_noise_scale(
    model: nn.Module,
    data: torch.Tensor,
    b_small: int,
    b_big: int,
    seq_len: int,
    repeats: int,
    generator: torch.Generator,
) -> NoiseScale:
    """B_simple of ``model`` at its current weights, from ``repeats`` pairs of real batches.

    Each measurement draws an independent batch of ``b_small`` and one of ``b_big`` random
    windows of ``data`` (labkit.data.get_batch with ``generator``) and takes the squared norm of
    each batch's mean-loss gradient (:func:`gradient_sq_norms`). Independent batches keep each
    estimate unbiased (eq. A.1 holds batch by batch); the paper nests the small batch in the big
    one (one rank's share of the data-parallel batch), which costs no extra backward. The result
    is in sequences of ``seq_len`` tokens.
    """
    n = whole("repeats", repeats, low=1)
    bs = whole("b_small", b_small, low=1)
    bb = whole("b_big", b_big, low=1)
    if bs >= bb:
        raise ValueError(f"b_small={bs} must be smaller than b_big={bb}: pass b_small < b_big")
    small, big = [], []
    for _ in range(n):
        small += gradient_sq_norms(model, [get_batch(data, bs, seq_len, generator)])
        big += gradient_sq_norms(model, [get_batch(data, bb, seq_len, generator)])
    return estimate_noise_scale(small, big, bs, bb)
