"""Gradient accumulation, measured: k micro-batches of b sequences give the gradient of one batch
of k*b, provided each micro-batch loss is divided by k.

The loss is a mean over the batch (cross-entropy averaged over B*T tokens), so the big-batch
gradient is the mean of the micro-batch gradients, (1/k) sum_i grad L_i. ``backward()`` *adds*
into ``.grad`` (torch.autograd.backward: "gradients are accumulated in the leaves"), so k
backwards of the undivided losses give sum_i grad L_i: k times too large, as if the learning
rate were k times larger (and clipping thresholds k times smaller). Dividing each loss by k
before its backward fixes it; labkit.train.train_step does exactly this.

Why accumulate at all: activations are kept for one micro-batch at a time, so activation memory
scales with b instead of k*b (labkit.memory's activation term), while parameters, gradients and
optimiser state stay the same; the price is k smaller forward/backward passes per optimiser step,
each less efficient than one large pass on a GPU. Global-batch arithmetic
(micro_batch x grad_accum x ranks) lives in :mod:`labkit.batching.noise`.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from labkit.batching.noise import Batch, accumulation_steps
from labkit.validate import whole


def accumulated_gradients(
    model: nn.Module, batch: Batch, k: int, *, divide: bool = True
) -> dict[str, torch.Tensor]:
    """Parameter gradients of one (x, y) batch of B sequences, accumulated over k micro-batches.

    The batch is split into k micro-batches of B/k (k must divide B); each runs forward and
    backward on a float32 deep copy of ``model``, its loss divided by k when ``divide`` (the
    correct rule) or not (the mistake: gradients k times too large). Returns the gradient of
    every trainable parameter by name (tied weights once, under their first name). The caller's
    model, its parameters and its ``.grad`` are untouched. The copy keeps the model's mode: for
    exact parity the model must have no dropout (or be in eval mode).
    """
    x, y = batch
    size = x.shape[0]
    k = whole("k", k, low=1)
    if size % k:
        allowed = [d for d in range(1, size + 1) if size % d == 0]
        raise ValueError(
            f"k={k} micro-batches do not split a batch of {size} sequences evenly: "
            f"use k in {allowed} (the divisors of {size})"
        )
    micro = size // k
    assert accumulation_steps(size, micro) == k  # the same arithmetic as noise.global_batch

    work = copy.deepcopy(model).float()  # fp32: parity is then limited only by summation order
    work.zero_grad(set_to_none=True)
    device = next(work.parameters()).device
    for xi, yi in zip(x.split(micro), y.split(micro), strict=True):
        _, loss = work(xi.to(device), yi.to(device))
        (loss / k if divide else loss).backward()  # backward() adds into .grad
    return {
        name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in work.named_parameters()  # named_parameters() lists a tied weight once
        if p.requires_grad
    }


@dataclass(frozen=True)
class Parity:
    """Accumulated gradients (k micro-batches) against the gradients of the batch in one pass."""

    k: int
    """Micro-batches accumulated."""
    divide: bool
    """Whether each micro-batch loss was divided by k."""
    max_abs: float
    """Largest absolute difference over all gradient elements."""
    max_rel: float
    """Largest relative difference over parameters: max over tensors of |g_acc - g|_2 / |g|_2
    (normwise: an elementwise ratio would blow up on gradient entries that are nearly zero),
    over the tensors not in ``zero_gradient``."""
    norm_ratio: float
    """|g_acc|_2 / |g|_2 over all parameters: 1 when the losses are divided by k, k when not."""
    zero_gradient: tuple[str, ...]
    """Parameters whose one-batch gradient is zero up to rounding (norm below ZERO_GRADIENT times
    the whole gradient's), left out of ``max_rel``: their ratio would compare rounding noise
    with rounding noise. In the labkit GPT these are the key biases: softmax is unchanged by a
    constant added to every score of a query, and q.b_k is one, so their true gradient is 0."""

    def summary(self) -> str:
        """One line for a notebook: the parity error, or how many times too large."""
        how = "loss / k" if self.divide else "loss not divided"
        if math.isclose(self.norm_ratio, 1.0, rel_tol=1e-3):
            verdict = f"parity error {self.max_rel:.1e} (max relative)"
        else:
            verdict = f"gradients {self.norm_ratio:.3g} times too large"
        return f"k={self.k} ({how}): {verdict}"


ZERO_GRADIENT = 1e-6
"""A tensor whose gradient norm is below this fraction of the whole gradient's counts as zero."""


def gradient_parity(model: nn.Module, batch: Batch, k: int, *, divide: bool = True) -> Parity:
    """Compare k accumulated micro-batches of ``batch`` with the whole batch in one backward."""
    acc = accumulated_gradients(model, batch, k, divide=divide)
    ref = accumulated_gradients(model, batch, 1)
    total = math.sqrt(sum(float(g.double().pow(2).sum()) for g in ref.values()))
    max_abs = max_rel = 0.0
    sq_acc = 0.0
    zero = []
    for name, g in ref.items():
        a, r = acc[name].double(), g.double()  # float64 differences: no rounding of their own
        diff = a - r
        max_abs = max(max_abs, float(diff.abs().max()))
        ref_norm = float(r.norm())
        if ref_norm <= ZERO_GRADIENT * total:
            zero.append(name)
        else:
            max_rel = max(max_rel, float(diff.norm()) / ref_norm)
        sq_acc += float(a.pow(2).sum())
    return Parity(
        k=k,
        divide=divide,
        max_abs=max_abs,
        max_rel=max_rel,
        norm_ratio=math.sqrt(sq_acc) / total if total > 0 else math.nan,
        zero_gradient=tuple(zero),
    )


# ----------------------------------------------------------------------------------------------
# What accumulation costs in time: a point prediction from the step model of notebook 05 §1.


def measure_update_seconds(template: nn.Module, *, train_cfg: Any = None,
                           device: torch.device | str = "cpu", rounds: int = 7,
                           warmup: int = 1) -> list[float]:  # fmt: skip
    """Seconds of what a training step pays once, however many micro-batches it has (measured).

    That is ``labkit.train.train_step``'s tail: gradient clipping, the optimizer step and
    ``zero_grad``, on a copy of ``template`` (never modified) whose AdamW state exists and
    whose ``.grad`` holds random values, refilled outside the timed region before each call.
    ``train_cfg`` (default ``TrainConfig()``) gives the optimizer and the clip threshold.
    """
    from labkit import timing, train  # layers 0 and 2
    from labkit.config import TrainConfig

    cfg = train_cfg if train_cfg is not None else TrainConfig()
    device = train.resolve_device(str(device))
    model = copy.deepcopy(template).to(device).train()
    optimizer = train.make_optimizer(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    noise = [1e-3 * torch.randn(p.shape, generator=g).to(device) for p in params]

    def once() -> float:
        for p, n in zip(params, noise, strict=True):
            p.grad = n.clone()
        with timing.Timer(device) as timer:
            if cfg.grad_clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return timer.elapsed_s

    return timing.alternate({"update": once}, rounds=whole("rounds", rounds, low=1),
                            warmup=warmup)["update"]  # fmt: skip


def predict_accumulated_seconds(single_step_s: float, update_s: float, k: int) -> float:
    """Predicted seconds of one optimiser step that accumulates k micro-batches of b sequences.

    ``single_step_s``: a measured single step at micro-batch b, t(b); ``update_s``: the measured
    once-per-step cost u (:func:`measure_update_seconds`), part of every single step. k single
    steps pay k passes and k updates; the accumulated step pays the same k passes and one
    update::

        t_acc = k·t(b) - (k - 1)·u

    What it assumes: a pass over b sequences costs the same whether its gradients go into
    fresh ``.grad`` tensors or are added to the ones already there.
    """
    for name, v in (("single_step_s", single_step_s), ("update_s", update_s)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{name}={v!r} is not allowed: a finite number of seconds >= 0")
    k = whole("k", k, low=1)
    if update_s > single_step_s:
        raise ValueError(f"update_s={update_s!r} is more than the whole step "
                         f"single_step_s={single_step_s!r}: the update is part of the step")
    return k * single_step_s - (k - 1) * update_s
