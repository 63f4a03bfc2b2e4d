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
import statistics
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from labkit.batching.noise import Batch, accumulation_steps
from labkit.formulas.step_time import predict_accumulated_seconds as predict_accumulated_seconds
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


# ----------------------------------------------------------------------------------------------
# Notebook 05, section 3: one global batch split three ways, its time and memory against the
# predictions.


@dataclass(frozen=True)
class AccumulationCost:
    """One global batch run as one pass and as accumulated micro-batches (measured, the splits
    taking turns step by step), with the update timed alone; each split's time predicted as k
    single steps less the k - 1 updates it skips, its peak by the memory model (plus 4 bytes per
    parameter of held gradients when k > 1) and by the model plus the omissions."""

    global_batch: int
    micro_sizes: tuple[int, ...]
    steps: Any
    """The :class:`labkit.batching.sweep.Sweep` of every (micro-batch, k) point."""
    update_s: tuple[float, ...]
    memory_model: Any
    """The finder's :class:`BatchPrediction` (any limit: only ``peak_bytes`` is read)."""
    omitted_per_sequence: float
    gradient_bytes: int

    @property
    def update(self) -> float:
        return statistics.median(self.update_s)

    def row(self, b: int) -> Any:
        return self.steps.row(b, self.global_batch // b)

    def checks(self) -> list[Any]:
        from labkit.batching import sweep_report

        out = []
        for b in self.micro_sizes:
            r = self.row(b)
            p = predict_accumulated_seconds(self.steps.row(b, 1).median_s, self.update, r.grad_accum)
            out.append(sweep_report.check_prediction(p, r.seconds, name=f"{b} × {r.grad_accum}"))
        return out

    def describe(self) -> str:
        from labkit import verdict

        u, gb = self.update, self.global_batch
        lines = [f"measured: the update (clip + AdamW step + zero_grad) takes {u * 1e3:.2f} ms "
                 f"(median of {len(self.update_s)})",
                 f"global batch {gb} per optimiser step, split three ways:",
                 f"{'micro × k':>10}{'step (measured)':>17}{'(predicted)':>13}"
                 f"{'peak MiB (measured)':>21}{'(predicted)':>13}{'(+ omissions)':>15}"]  # fmt: skip
        inside = 0
        checks = iter(self.checks())
        for b in (gb, *self.micro_sizes):
            r = self.row(b)
            m_pred = self.memory_model.peak_bytes(b) + (self.gradient_bytes if r.grad_accum > 1 else 0)
            m_full = m_pred + b * self.omitted_per_sequence
            inside += m_pred <= r.peak_bytes <= m_full
            t_pred = f"{next(checks).predicted * 1e3:.1f} ms" if r.grad_accum > 1 else ""
            lines.append(f"{f'{b} × {r.grad_accum}':>10}{r.median_s * 1e3:>14.1f} ms{t_pred:>13}"
                         f"{r.peak_bytes / 2**20:>21.2f}{m_pred / 2**20:>13.2f}{m_full / 2**20:>15.2f}")  # fmt: skip
        lines += [str(check) for check in self.checks()]
        lines.append(f"measured: {inside} of 3 peaks between the memory model and the model + omissions")
        one, finest = self.row(gb), self.row(self.micro_sizes[-1])
        lines.append(str(verdict.compare_times(finest.seconds, one.seconds,
                                               names=(f"{finest.micro_batch} × {finest.grad_accum}",
                                                      f"{one.micro_batch} × 1"))))  # fmt: skip
        lines.append(f"measured: {finest.micro_batch} × {finest.grad_accum} holds "
                     f"{finest.peak_bytes / one.peak_bytes:.0%} of the one-pass peak")
        # the same relation read backwards: what each split says a step pays once, against u
        for b in self.micro_sizes:
            k = gb // b
            t_once = (k * self.steps.row(b, 1).median_s - self.row(b).median_s) / (k - 1)
            lines.append(f"implied by {b} × {k}: {t_once * 1e3:.2f} ms paid once per step, not per "
                         f"micro-batch (the update alone: {u * 1e3:.2f} ms, measured)")  # fmt: skip
        return "\n".join(lines)


def measure_accumulation(template: nn.Module, global_batch: int, micro_sizes: tuple[int, ...], *,
                         memory_model: Any, omitted_per_sequence: float, train_cfg: Any = None,
                         device: torch.device | str = "cpu", dtype: str = "float32",
                         rounds: int = 5, data: torch.Tensor | None = None) -> AccumulationCost:  # fmt: skip
    """Time ``global_batch`` as one pass, as single steps of each of ``micro_sizes`` and as
    those accumulated to the global batch (``sweep.measure_steps``, taking turns), then the
    update alone (:func:`measure_update_seconds`, 2·rounds + 1 samples)."""
    from labkit.batching import sweep

    points = [(global_batch, 1), *((b, 1) for b in micro_sizes),
              *((b, global_batch // b) for b in micro_sizes)]  # fmt: skip
    steps = sweep.measure_steps(template, points, train_cfg=train_cfg, device=device, dtype=dtype,
                                rounds=rounds, data=data)  # fmt: skip
    update_s = measure_update_seconds(template, train_cfg=train_cfg, device=device,
                                      rounds=2 * rounds + 1)  # fmt: skip
    return AccumulationCost(global_batch=global_batch, micro_sizes=tuple(micro_sizes),
                            steps=steps, update_s=tuple(update_s), memory_model=memory_model,
                            omitted_per_sequence=omitted_per_sequence,
                            gradient_bytes=4 * template.num_params())  # fmt: skip
