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
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from labkit.data import get_batch
from labkit.validate import number, positive, refuse, whole  # one rule for every labkit argument

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
        if not 0 < number("confidence", confidence) < 1:
            raise refuse("confidence", confidence, "a number in (0, 1)")
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


# ----------------------------------------------------------------------------------------------
# Notebook 05, sections 5 to 7: learning-rate runs at batch B and 4B, the noise scale measured
# at two points in training, time to a given loss, weak scaling; their figures (matplotlib
# imported only when drawing).

SPIKE = 0.1
"""Nats: a rise of the smoothed training loss above its lowest value so far larger than this is
a transient divergence, not noise of the moving average."""


def smoothed(values: Sequence[float], window: int) -> list[float]:
    """The trailing moving average of ``values`` over ``window`` points (fewer at the start)."""
    return [statistics.fmean(values[max(0, i - window + 1): i + 1]) for i in range(len(values))]


def largest_rise(loss: Sequence[float]) -> float:
    """How far the training loss, smoothed over a tenth of the run, rose above its lowest value
    so far: the spike measure."""
    sm = smoothed(loss, max(1, len(loss) // 10))
    return max(v - min(sm[: j + 1]) for j, v in enumerate(sm))


@dataclass(frozen=True)
class LrRuns:
    """Training runs from the same initial weights on the same tokens: label -> (batch, steps,
    scaling rule), each for every seed, with its history and final validation loss."""

    runs: dict[str, tuple[int, int, str]]
    lr: dict[str, float]
    seeds: tuple[int, ...]
    histories: dict[tuple[str, int], Any]
    final_val: dict[tuple[str, int], float]
    val_batches: list[Batch]
    trained: Any
    """The first run's model at its first seed, trained (section 6 measures its noise scale)."""

    @property
    def mean_val(self) -> dict[str, float]:
        return {label: statistics.fmean(self.final_val[label, s] for s in self.seeds) for label in self.runs}

    def describe(self) -> str:
        """One line per run: its batch, steps, rate and final validation loss per seed (the
        lines :func:`lr_runs` prints as each run ends)."""
        return "\n".join(_run_line(label, b, steps, self.lr[label],
                                   [self.final_val[label, s] for s in self.seeds], self.seeds)
                         for label, (b, steps, _) in self.runs.items())  # fmt: skip

    def describe_outcome(self) -> str:
        """Each run's spikes, the lag of the unscaled 4B run and what each scaled rate won back,
        and whether the seeds resolve the differences (labels as notebook 05's)."""
        lines = []
        for label in self.runs:
            rises = [largest_rise(self.histories[label, s].loss) for s in self.seeds]
            lines.append(f"measured: {label:<18} largest rise of the smoothed loss above its minimum "
                         "so far: " + ", ".join(f"{r:.3f}" for r in rises) + " nats"
                         + (f" (spiked: above {SPIKE} in {sum(r > SPIKE for r in rises)} of "
                            f"{len(rises)} runs)" if any(r > SPIKE for r in rises) else ""))  # fmt: skip
        mean_val = self.mean_val
        lag = mean_val["4B, η₀"] - mean_val["B, η₀"]
        lines.append(f"measured: at 4B with the rate unchanged the final loss is {lag:+.4f} against batch B")
        for label in ("4B, 4η₀ (linear)", "4B, 2η₀ (sqrt)"):
            gained = mean_val["4B, η₀"] - mean_val[label]
            share = f", {gained / lag:.0%} of the lag recovered" if lag > 0 and gained > 0 else ""
            lines.append(f"measured: {label}: {mean_val[label]:.4f}, {'better' if gained > 0 else 'worse'} "
                         f"than the unscaled rate by {abs(gained):.4f}{share}")  # fmt: skip
        if len(self.seeds) > 1:
            spread = max(abs(self.final_val[label, a] - self.final_val[label, b]) for label in self.runs
                         for a in self.seeds for b in self.seeds)  # fmt: skip
            gaps = sorted(abs(mean_val[a] - mean_val[b]) for a in self.runs for b in self.runs if a < b)
            lines.append(f"seed-to-seed spread of one setting: up to {spread:.4f}; differences between "
                         f"settings smaller than that are not resolved by {len(self.seeds)} seeds "
                         f"({sum(g > spread for g in gaps)} of {len(gaps)} differences are larger)")  # fmt: skip
        else:
            lines.append("one seed per setting: how far a rerun would move each loss is not measured "
                         "at this size, so small differences between settings are not resolved (the "
                         "lab size runs two seeds)")  # fmt: skip
        return "\n".join(lines)


def _run_line(label: str, b: int, steps: int, lr: float, losses: Sequence[float],
              seeds: Sequence[int]) -> str:
    return (f"{label:<18} batch {b:>4} × {steps:>4} steps, lr {lr:.2e}: final validation loss "
            + ", ".join(f"{v:.4f}" for v in losses)
            + f"  (seed{'s' if len(losses) > 1 else ''} {', '.join(map(str, seeds))}; measured)")


def lr_runs(cfg: Any, runs: dict[str, tuple[int, int, str]], *, base_lr: float, base_batch: int,
            seeds: Sequence[int], train_data: torch.Tensor, val_data: torch.Tensor,
            device: Any = "cpu", dtype: str = "float32",
            progress: Callable[[str], Any] | None = print) -> LrRuns:  # fmt: skip
    """Train labkit's GPT (``cfg``: a RunConfig) once per run and seed: label -> (batch, steps,
    rule), the rate :func:`scaled_lr` of ``base_lr`` at ``base_batch``, a warm-up over the first
    tenth of the steps, then held; each evaluated on the same 256 held-out sequences.

    ``progress`` gets each run's line (:meth:`LrRuns.describe`'s) as soon as its seeds are done:
    these runs take minutes at lab size, and a silent cell looks hung. None: quiet."""
    from labkit import train  # layer 2
    from labkit.model import GPT

    device = torch.device(device)  # train.train takes a device, not its name

    val_batches = [get_batch(val_data, 16, cfg.model.seq_len, torch.Generator().manual_seed(100 + i))
                   for i in range(16)]  # the same 256 held-out sequences for every run  # fmt: skip
    histories, final_val, lrs, trained = {}, {}, {}, None
    for label, (b, steps, rule) in runs.items():
        lrs[label] = lr = scaled_lr(base_lr, base_batch, b, rule)
        for seed in seeds:
            torch.manual_seed(seed)
            model = GPT(cfg.model)
            run_cfg = cfg.replace(micro_batch=b, steps=steps, lr=lr, warmup_steps=max(1, steps // 10),
                                  min_lr=None, eval_every=0, seed=seed, dtype=dtype)  # fmt: skip
            histories[label, seed] = train.train(model, run_cfg, train_data, device=device)
            final_val[label, seed] = train.evaluate(model, val_batches, device=device, dtype=dtype)
            if trained is None:
                trained = model
        if progress is not None:
            progress(_run_line(label, b, steps, lr, [final_val[label, s] for s in seeds], seeds))
    return LrRuns(runs=dict(runs), lr=lrs, seeds=tuple(seeds), histories=histories,
                  final_val=final_val, val_batches=val_batches, trained=trained)  # fmt: skip


def plot_lr_runs(result: LrRuns, ax: Any = None) -> Any:
    """Training loss (moving average) against tokens seen, one colour per run (faint: later
    seeds), each run's final validation loss as a dot."""
    import matplotlib.pyplot as plt  # here, so that importing labkit stays light

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.8))
    first = result.seeds[0]
    for i, label in enumerate(result.runs):
        for seed in result.seeds:
            h = result.histories[label, seed]
            seen = [sum(h.tokens[: j + 1]) for j in range(len(h.tokens))]
            ax.plot(seen, smoothed(h.loss, max(1, len(h.loss) // 10)), c=f"C{i}",
                    alpha=0.9 if seed == first else 0.4, label=label if seed == first else None)  # fmt: skip
            ax.plot(seen[-1], result.final_val[label, seed], "o", c=f"C{i}")
    ax.set(xlabel="tokens seen", ylabel="training loss (moving average; ● final validation)",
           title="the same tokens at batch B and 4B (measured)")  # fmt: skip
    ax.legend(fontsize=8)
    return ax


@dataclass(frozen=True)
class NoiseScaleStudy:
    """B_simple measured at several points in training from pairs of batches ``b_small`` and
    ``b_big`` (:func:`estimate_noise_scale`), each with eq. A.1's prediction at ``b_mid`` held
    against the mean squared norm measured there, and the learner's estimate beside labkit's."""

    batches: tuple[int, int, int]
    repeats: int
    seq_len: int
    norms: dict[str, dict[int, list[float]]]
    scales: dict[str, NoiseScale]
    yours: dict[str, float]
    whose: str

    def describe(self) -> str:
        b_small, b_mid, b_big = self.batches
        lines = []
        for when, est in self.scales.items():
            lo, hi = est.interval()
            lines.append(f"{when}: B_simple = {est.b_simple:.2f} sequences ({est.b_simple * self.seq_len:,.0f} "
                         f"tokens), 90% bootstrap interval {lo:.2f} to {hi:.2f} (measured, {self.repeats} "
                         f"pairs of batches {b_small} and {b_big}); {self.whose} function: "
                         f"{self.yours[when]:.2f}")  # fmt: skip
            # eq. A.1 predicts the mean squared norm at a third batch size from the two-size estimate
            p_lo, p_hi = est.expected_sq_norm_interval(b_mid)
            measured_mid = statistics.fmean(self.norms[when][b_mid])
            se_mid = statistics.stdev(self.norms[when][b_mid]) / math.sqrt(self.repeats)
            agree = p_lo - 2 * se_mid <= measured_mid <= p_hi + 2 * se_mid
            lines.append(f"    eq. A.1 at B = {b_mid}: predicted E|G_B|² {est.expected_sq_norm(b_mid):.4g} "
                         f"(90% interval {p_lo:.4g} to {p_hi:.4g}), measured {measured_mid:.4g} ± "
                         f"{se_mid:.2g} (standard error): "
                         + ("consistent" if agree else
                            "NOT consistent: the straight line in 1/B does not hold here"))  # fmt: skip
        early, late = list(self.scales.values())[:2]
        early_hi, late_lo = early.interval()[1], late.interval()[0]
        if late.b_simple > early.b_simple and late_lo > early_hi:
            lines.append(f"\nmeasured: the noise scale rose from {early.b_simple:.2f} to "
                         f"{late.b_simple:.2f} sequences, and the 90% intervals do not overlap")  # fmt: skip
        elif late.b_simple > early.b_simple:
            lines.append(f"\nmeasured: the estimate rose from {early.b_simple:.2f} to {late.b_simple:.2f} "
                         f"sequences, but the intervals overlap: {self.repeats} pairs do not resolve "
                         "the change")  # fmt: skip
        else:
            lines.append(f"\nmeasured: the estimate did not rise ({early.b_simple:.2f} → "
                         f"{late.b_simple:.2f}); with {self.repeats} pairs the intervals above say "
                         "how much that means")  # fmt: skip
        return "\n".join(lines)


def noise_scale_study(models: dict[str, nn.Module], data: torch.Tensor, *, seq_len: int,
                      batches: tuple[int, int, int], repeats: int, yours: Any = None,
                      whose: str = "labkit's") -> NoiseScaleStudy:  # fmt: skip
    """For each of ``models`` (when -> model), ``repeats`` squared gradient norms
    (:func:`gradient_sq_norms`) at each batch size of ``batches`` = (small, mid, big), batch
    size b drawn with a generator seeded b; B_simple from the small and big ones, and ``yours``
    (the learner's ``noise_scale(sq_small, sq_big, b_small, b_big)``) on the same numbers."""
    b_small, _, b_big = batches
    norms, scales, mine = {}, {}, {}
    for when, model in models.items():
        norms[when] = {}
        for b in batches:
            g = torch.Generator().manual_seed(b)
            norms[when][b] = gradient_sq_norms(model, (get_batch(data, b, seq_len, g) for _ in range(repeats)))
        scales[when] = estimate_noise_scale(norms[when][b_small], norms[when][b_big], b_small, b_big)
        fn = yours if yours is not None else (lambda *a: estimate_noise_scale(*a).b_simple)
        mine[when] = fn(norms[when][b_small], norms[when][b_big], b_small, b_big)
    return NoiseScaleStudy(batches=tuple(batches), repeats=repeats, seq_len=seq_len, norms=norms,
                           scales=scales, yours=mine, whose=whose)  # fmt: skip


def plot_noise_scale(study: NoiseScaleStudy, axes: Any = None) -> Any:
    """Eq. A.1 per point in training: the mean squared norm (± standard error) against 1/B at
    the three batch sizes, and the line |G|² + tr(Σ)/B from the two ends."""
    import matplotlib.pyplot as plt  # here, so that importing labkit stays light

    if axes is None:
        fig, axes = plt.subplots(1, len(study.scales), figsize=(10, 3.4))
    for i, (ax, (when, est)) in enumerate(zip(axes, study.scales.items(), strict=True)):
        means = [statistics.fmean(study.norms[when][b]) for b in study.batches]
        errors = [statistics.stdev(study.norms[when][b]) / math.sqrt(study.repeats) for b in study.batches]
        ax.errorbar([1 / b for b in study.batches], means, yerr=errors, fmt="o", c=f"C{i}",
                    label="measured mean ± standard error")  # fmt: skip
        line = [k / 100 / study.batches[0] for k in range(101)]
        ax.plot(line, [est.g2 + est.trace_sigma * x for x in line], "--", c="grey",
                label="|G|² + tr(Σ)/B, from the two ends")  # fmt: skip
        ax.set(xlabel="1 / batch size", ylabel="E |G_B|²", title=when, xlim=(0, None), ylim=(0, None))
        ax.legend(fontsize=7)
    fig = axes[0].figure
    fig.suptitle("eq. A.1: a straight line in 1/B, intercept |G|², slope tr(Σ)", fontsize=10)
    fig.tight_layout()
    return axes


def describe_time_to_loss(sweep: Any, b_noise: float, *, base_batch: int) -> str:
    """Each swept micro-batch's steps and tokens to a given loss relative to their least
    (eq. 2.11, B_crit taken as ``b_noise``), its measured tokens/s and its time to the loss,
    steps × measured seconds per step, relative to the fastest; then where the noise scale and
    the saturation batch fall, and what the model says of section 5's runs at ``base_batch`` and
    4× it. An unresolved noise scale says so."""
    if not (math.isfinite(b_noise) and b_noise > 0):
        return (f"the noise scale after training is not resolved ({b_noise}): its |G|² estimate is "
                "not positive. Raise noise_repeats (more pairs) to resolve it.")  # fmt: skip
    rows, saturated = sweep.rows, sweep.saturation()
    time_to_loss = {r.micro_batch: steps_and_examples(r.micro_batch, b_noise)[0] * r.median_s
                    for r in rows}  # S/S_min × seconds per step  # fmt: skip
    fastest = min(time_to_loss, key=time_to_loss.get)
    lines = [f"{'batch':>6}{'steps / least':>15}{'tokens / least':>16}{'tokens/s (measured)':>21}"
             f"{'time to a loss':>16}"]  # fmt: skip
    for r in rows:
        steps_x, tokens_x = steps_and_examples(r.micro_batch, b_noise)
        lines.append(f"{r.micro_batch:>6}{steps_x:>15.2f}{tokens_x:>16.2f}{r.tokens_per_s:>21,.0f}"
                     f"{time_to_loss[r.micro_batch] / time_to_loss[fastest]:>15.2f}×")  # fmt: skip
    lines.append("(time to a loss relative to the fastest batch, modelled: steps × measured seconds per step)")
    past = [r.micro_batch for r in rows if r.micro_batch > b_noise]
    lines += ["", f"the noise scale after training is {b_noise:.1f} sequences (measured): {len(past)} of the "
              f"{len(rows)} swept batches lie above it",
              f"throughput saturates at {saturated.micro_batch} (measured); the fastest batch to a given "
              f"loss is {fastest} (modelled from both): "
              + ("the same batch" if fastest == saturated.micro_batch else
                 "a smaller one: past the noise scale, extra throughput is spent on extra tokens"
                 if fastest < saturated.micro_batch else "a larger one")]  # fmt: skip
    _, e_b = steps_and_examples(base_batch, b_noise)
    _, e_4b = steps_and_examples(4 * base_batch, b_noise)
    lines.append(f"section 5's runs (modelled, eq. 2.11 with B_crit taken as this B_simple): batch "
                 f"{base_batch} needs {e_b:.2f}× and batch {4 * base_batch} {e_4b:.2f}× the least tokens for a "
                 f"given loss, so the model predicts the 4B runs would need {e_4b / e_b:.2f}× the "
                 "tokens of the B run to reach its loss (an SGD model applied to AdamW: an estimate)")  # fmt: skip
    return "\n".join(lines)


def describe_weak_scaling(per_rank: int, b_noise: float,
                          ranks: Sequence[int] = (1, 2, 8, 64, 512)) -> str:  # fmt: skip
    """Weak scaling, modelled with eq. 2.11: each rank keeps ``per_rank`` sequences per step
    (micro-batch × accumulation) and the ranks grow; steps and tokens relative to their least
    against the noise scale ``b_noise``. An unresolved noise scale says so."""
    if not (math.isfinite(b_noise) and b_noise > 0):
        return (f"no weak-scaling table: the noise scale after training is not resolved ({b_noise}), "
                "see section 6. Raise noise_repeats (more pairs) to resolve it.")  # fmt: skip
    lines = [f"weak scaling from {per_rank} sequences per rank per step, against the noise scale after "
             f"training ({b_noise:.1f} sequences, section 6; modelled with eq. 2.11):"]  # fmt: skip
    for n in ranks:
        s, e = steps_and_examples(per_rank * n, b_noise)
        lines.append(f"  {n:>4} ranks: global batch {per_rank * n:>6}, steps {s:5.2f} × least, "
                     f"tokens {e:7.2f} × least")  # fmt: skip
    return "\n".join(lines)
