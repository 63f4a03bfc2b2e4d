"""Training-step throughput and memory against micro-batch size, predicted and measured.

A training step costs a fixed part (launching kernels, Python, the optimiser step over every
parameter: none of it grows with the batch) plus a part proportional to the tokens. Tokens per
second therefore rise with the micro-batch while the fixed part is being amortised, and level
off once the device's arithmetic is busy: from there a larger batch only costs memory. Memory
per step is affine in the batch: model states (fixed) plus activations (per sequence).

:func:`throughput_sweep` measures both over a list of micro-batch sizes, beside the model's
prediction:

* **time**: every micro-batch size trains its own copy of the model (same weights, own AdamW),
  and the sizes take turns step by step (``labkit.timing.alternate``), so a busy moment of a
  shared machine falls on all of them rather than on whichever ran during it;
* **memory**: one more step per size under :func:`labkit.batching.trials.measure_step_peak`,
  the peak of live tensor bytes (the same count the finder enforces a budget on);
* **predicted**: FLOPs from ``formulas.flops_per_token`` (6N + 12·L·h·s, nanoGPT's convention
  with N excluding the position table), peak bytes from the finder's memory model
  (:func:`labkit.batching.finder.predict_max_batch`);
* **MFU** only where ``labkit.hardware`` has a published peak for the device and dtype: an
  unknown device (every CPU) gets none, never a guess.
"""

from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import torch
from torch import nn

from labkit import formulas, hardware, timing, train, verdict
from labkit.batching import finder, trials
from labkit.config import ModelConfig, TrainConfig

SATURATION = 0.9
"""A batch "saturates" throughput when it reaches this fraction of the best tokens/s measured."""


@dataclass(frozen=True)
class SweepRow:
    """One micro-batch size: its measured step times and peak bytes, and the model's figures."""

    micro_batch: int
    grad_accum: int
    """Micro-batches accumulated per optimiser step."""
    tokens: int
    """Tokens per optimiser step: micro_batch × grad_accum × seq_len."""
    seconds: tuple[float, ...]
    """Measured seconds of each timed step (``labkit.train.train_step``'s synchronised timer)."""
    peak_bytes: int
    """Measured: the most live tensor bytes during one step (model copy, AdamW state, batch,
    activations, gradients, temporaries)."""
    predicted_peak_bytes: float
    """Modelled: the finder's memory model (model states + activations + logits) at this batch."""
    flops: float
    """Modelled: training FLOPs of one step (forward + backward), flops_per_token × tokens."""

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_s(self) -> float:
        """Measured: tokens / median step seconds."""
        return self.tokens / self.median_s

    @property
    def flops_per_s(self) -> float:
        """Achieved model FLOP/s: modelled FLOPs over measured seconds."""
        return self.flops / self.median_s

    @property
    def seconds_per_token(self) -> tuple[float, ...]:
        """Each timed step's seconds per token: comparable across micro-batch sizes."""
        return tuple(s / self.tokens for s in self.seconds)


@dataclass(frozen=True)
class StepModel:
    """Step seconds t(b) = fixed_s + b × per_sequence_s, fitted to measurements (modelled).

    tokens/s = b·s / t(b) rises towards s / per_sequence_s, and reaches half of it at
    b = fixed_s / per_sequence_s: the batch at which the fixed part is amortised by half.
    """

    fixed_s: float
    per_sequence_s: float
    seq_len: int

    def seconds(self, micro_batch: float) -> float:
        return self.fixed_s + micro_batch * self.per_sequence_s

    def tokens_per_s(self, micro_batch: float) -> float:
        return micro_batch * self.seq_len / self.seconds(micro_batch)

    @property
    def ceiling_tokens_per_s(self) -> float:
        """The limit of tokens/s as the batch grows, if the per-sequence cost stayed constant."""
        return self.seq_len / self.per_sequence_s

    @property
    def half_batch(self) -> float:
        """The micro-batch at which the model reaches half its ceiling: fixed / per-sequence."""
        return self.fixed_s / self.per_sequence_s


@dataclass(frozen=True)
class Sweep:
    """A throughput and memory sweep over micro-batch sizes on one device."""

    rows: tuple[SweepRow, ...]
    device: str
    device_name: str
    dtype: str
    seq_len: int
    flops_per_token: float
    peak: hardware.Peak
    """The published peak for MFU, or the reason there is none (``peak.known``)."""
    rounds: int
    method: str

    def row(self, micro_batch: int, grad_accum: int = 1) -> SweepRow:
        for r in self.rows:
            if (r.micro_batch, r.grad_accum) == (micro_batch, grad_accum):
                return r
        raise KeyError(f"(micro_batch, grad_accum)={(micro_batch, grad_accum)} was not "
                       f"measured: the sweep has {[(r.micro_batch, r.grad_accum) for r in self.rows]}")  # fmt: skip

    @property
    def best(self) -> SweepRow:
        """The row with the most tokens/s (measured)."""
        return max(self.rows, key=lambda r: r.tokens_per_s)

    def saturation(self, fraction: float = SATURATION) -> SweepRow:
        """The smallest micro-batch whose tokens/s reach ``fraction`` of the best measured."""
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction={fraction!r} is not allowed: a number in (0, 1]")
        target = fraction * self.best.tokens_per_s
        return min((r for r in self.rows if r.tokens_per_s >= target),
                   key=lambda r: r.micro_batch)  # fmt: skip

    def overhead_fit(self) -> StepModel:
        """Fit t(b) = fixed + b × per_sequence to the median step times (grad_accum 1 rows).

        Least squares on relative errors (each point weighted by 1/t²), so the small batches,
        whose times are mostly the fixed part, count as much as the large ones.
        """
        pts = [(r.micro_batch, r.median_s) for r in self.rows if r.grad_accum == 1]
        if len({b for b, _ in pts}) < 2:
            raise ValueError("the fit needs at least two micro-batch sizes (grad_accum 1)")
        # minimise sum(((t - a - c·b) / t)²): normal equations of a 2-parameter linear fit
        w = [1 / t**2 for _, t in pts]
        b = [float(bi) for bi, _ in pts]
        t = [ti for _, ti in pts]
        sw = math.fsum(w)
        sb = math.fsum(wi * bi for wi, bi in zip(w, b, strict=True))
        sbb = math.fsum(wi * bi * bi for wi, bi in zip(w, b, strict=True))
        st = math.fsum(wi * ti for wi, ti in zip(w, t, strict=True))
        sbt = math.fsum(wi * bi * ti for wi, bi, ti in zip(w, b, t, strict=True))
        det = sw * sbb - sb * sb
        fixed = (st * sbb - sb * sbt) / det
        per_sequence = (sw * sbt - sb * st) / det
        return StepModel(fixed_s=fixed, per_sequence_s=per_sequence, seq_len=self.seq_len)

    def mfu(self, row: SweepRow) -> float | None:
        """Model FLOPs utilisation of ``row``, or None where no published peak is known."""
        if not self.peak.known:
            return None
        return formulas.mfu(row.tokens_per_s, self.flops_per_token, self.peak.flops_per_s)

    def __str__(self) -> str:
        head = (f"{'micro-batch':>11}{'× accum':>8}{'tokens/s':>12}{'median step':>13}{'GFLOP/s':>10}"
                f"{'MFU':>7}{'peak MiB':>10}{'predicted':>11}")  # fmt: skip
        lines = [f"{self.device_name} ({self.device}), {self.dtype}, seq_len {self.seq_len}; "
                 f"tokens/s and peak bytes measured, FLOPs and 'predicted' modelled", head]  # fmt: skip
        for r in self.rows:
            mfu = self.mfu(r)
            lines.append(
                f"{r.micro_batch:>11}{r.grad_accum:>8}{r.tokens_per_s:>12,.0f}"
                f"{timing.format_seconds(r.median_s):>13}{r.flops_per_s / 1e9:>10.2f}"
                f"{'n/a' if mfu is None else f'{mfu:.1%}':>7}"
                f"{r.peak_bytes / 2**20:>10.2f}{r.predicted_peak_bytes / 2**20:>11.2f}"
            )
        if not self.peak.known:
            lines.append(f"MFU n/a: {self.peak.reason}")
        return "\n".join(lines)


def _points(values: Sequence[Any]) -> list[tuple[int, int]]:
    """(micro_batch, grad_accum) pairs from sizes or pairs, checked, in the order given."""
    example = "e.g. [1, 2, 4, 8] or [(32, 1), (8, 4)] as (micro_batch, grad_accum)"
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise ValueError(f"{values!r} is not allowed: give a non-empty list of micro-batch "
                         f"sizes or (micro_batch, grad_accum) pairs, {example}")  # fmt: skip
    out = []
    for v in values:
        pair = tuple(v) if isinstance(v, (tuple, list)) else (v, 1)
        if len(pair) != 2 or any(isinstance(n, bool) or not isinstance(n, Integral) or n < 1
                                 for n in pair):  # fmt: skip
            raise ValueError(f"{v!r} is not allowed: a micro-batch size and an accumulation "
                             f"count must be positive integers, {example}")  # fmt: skip
        out.append((int(pair[0]), int(pair[1])))
    if len(set(out)) != len(out):
        raise ValueError(f"{out} repeats a point: give each (micro_batch, grad_accum) once")
    return out


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return hardware.cpu_info().model_name or "CPU"


def throughput_sweep(
    model: nn.Module, micro_batches: Sequence[int], **kwargs: Any
) -> Sweep:
    """Measure tokens/s and peak bytes of a training step at each of ``micro_batches``.

    Keyword arguments as :func:`measure_steps`; the sizes are measured in increasing order.
    """
    points = _points(micro_batches)
    if any(k != 1 for _, k in points):
        raise ValueError("throughput_sweep takes micro-batch sizes; for accumulation give "
                         "(micro_batch, grad_accum) pairs to measure_steps")  # fmt: skip
    return measure_steps(model, sorted(points), **kwargs)


def measure_steps(
    model: nn.Module,
    points: Sequence[int | tuple[int, int]],
    *,
    train_cfg: TrainConfig | None = None,
    device: str | torch.device = "cpu",
    dtype: str = "float32",
    seq_len: int | None = None,
    rounds: int = 5,
    warmup: int = 1,
    data: torch.Tensor | None = None,
) -> Sweep:
    """Measure seconds and peak bytes of an optimiser step at each (micro_batch, grad_accum).

    ``model`` is a template (a ``labkit.model.GPT``, never modified). A bare int in ``points``
    means grad_accum 1. ``data``: a 1-D tensor of token ids to draw batches from
    (``labkit.data.get_batch``); random token ids without it (the step's cost does not depend on
    which tokens). ``rounds`` timed steps per point after ``warmup`` untimed ones, the points
    taking turns.
    """
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"model={type(model).__name__} is not allowed: give a labkit GPT "
                         f"(it carries the ModelConfig the predictions need)")  # fmt: skip
    pairs = _points(points)
    seq_len = finder._seq_len(cfg, seq_len)
    dtype = finder._dtype(dtype)
    device = train.resolve_device(str(device))
    train_cfg = train_cfg if train_cfg is not None else TrainConfig()

    n_flop = model.num_params(exclude_position_embedding=True)  # nanoGPT's N for MFU
    per_token = formulas.flops_per_token(n_flop, cfg.n_layer, cfg.d_model, seq_len, "full")
    # the memory model at any batch: a budget large enough that only peak_bytes(b) is used
    prediction = finder.predict_max_batch(cfg, 2**62, dtype=dtype, seq_len=seq_len,
                                          dropout_mask_bytes=4 if device.type == "cpu" else 1)  # fmt: skip
    g = torch.Generator().manual_seed(train_cfg.seed)

    def batch_of(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        if data is not None:
            from labkit.data import get_batch  # layer 1, only when real data is asked for

            return get_batch(data, b, seq_len, g)
        x = torch.randint(0, cfg.vocab_size, (b, seq_len), generator=g)
        return x, torch.randint(0, cfg.vocab_size, (b, seq_len), generator=g)

    steppers = {}
    for b, k in pairs:
        work = copy.deepcopy(model).to(device).train()
        optimizer = train.make_optimizer(work, train_cfg)
        scaler = train.make_scaler(device, dtype)
        batches = [batch_of(b) for _ in range(k)]

        def step(work=work, optimizer=optimizer, scaler=scaler, batches=batches) -> float:
            return train.train_step(work, optimizer, batches, device=device, dtype=dtype,
                                    scaler=scaler, grad_clip=train_cfg.grad_clip).seconds  # fmt: skip

        steppers[f"{b}x{k}"] = step
    times = timing.alternate(steppers, rounds=rounds, warmup=warmup)
    del steppers  # the copies and their optimizers go before the memory steps

    rows = []
    for b, k in pairs:
        peak = trials.measure_step_peak(model, b, grad_accum=k, seq_len=seq_len, dtype=dtype,
                                        train_cfg=train_cfg, device=device)  # fmt: skip
        rows.append(SweepRow(micro_batch=b, grad_accum=k, tokens=b * k * seq_len,
                             seconds=tuple(times[f"{b}x{k}"]), peak_bytes=peak,
                             predicted_peak_bytes=prediction.peak_bytes(b),
                             flops=per_token * b * k * seq_len))  # fmt: skip
    name = _device_name(device)
    return Sweep(
        rows=tuple(rows), device=str(device), device_name=name, dtype=dtype, seq_len=seq_len,
        flops_per_token=per_token, peak=hardware.peak_flops(name, train.DTYPES[dtype]),
        rounds=rounds,
        method=("train_step seconds, points alternated step by step (labkit.timing.alternate); "
                "peak = live tensor bytes of one more step (labkit.batching.trials)"),
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# A predicted time against a measured one: the sentence is chosen by the numbers.

PREDICTION_TOLERANCE = 0.20
"""How far (as a fraction of the prediction) a measured median may sit from a modelled step time
and still "agree": the affine model t₀ + b·t₁ is fitted to one sweep on a shared machine, and
its medians move by about this much between sections of one run (measured on the course's
2-core CI host)."""


@dataclass(frozen=True)
class PredictionCheck:
    """A predicted value against repeated measurements of it: one of three verdicts.

    ``measured`` is the median of the samples, ``interval`` its notch (median ± 1.57·IQR/√n,
    as :mod:`labkit.verdict`), ``band`` the prediction ± ``tolerance``. The outcome:

    * ``"agree"``: the whole interval lies inside the band;
    * ``"above"`` / ``"below"``: the whole interval lies outside the band, on that side;
    * ``"noisy"``: the interval straddles an edge of the band (or too few samples).
    """

    name: str
    predicted: float
    measured: float
    interval: tuple[float, float]
    n: int
    tolerance: float
    outcome: str

    @property
    def band(self) -> tuple[float, float]:
        return self.predicted * (1 - self.tolerance), self.predicted * (1 + self.tolerance)

    @property
    def off(self) -> float:
        """(measured - predicted) / predicted."""
        return self.measured / self.predicted - 1

    @property
    def sentence(self) -> str:
        lo, hi = self.interval
        head = (f"{self.name}: predicted {timing.format_seconds(self.predicted)}, measured "
                f"median {timing.format_seconds(self.measured)} (interval "
                f"{timing.format_seconds(lo)} to {timing.format_seconds(hi)}, {self.n} runs), "
                f"{self.off:+.0%}: ")  # fmt: skip
        tol = f"±{self.tolerance:.0%}"
        if self.outcome == "agree":
            return head + f"agrees within {tol}"
        if self.outcome in ("above", "below"):
            if self.outcome == "above":
                return head + f"slower than predicted, beyond {tol}: it pays a cost the model leaves out"
            return head + f"faster than predicted, beyond {tol}: it pays less than the model counts"
        return head + f"too noisy to tell against {tol}: rerun, or run it alone"

    def __str__(self) -> str:
        return self.sentence


def check_prediction(predicted: float, samples: Sequence[float], *, name: str,
                     tolerance: float = PREDICTION_TOLERANCE,
                     min_runs: int = 5) -> PredictionCheck:  # fmt: skip
    """Hold a predicted time (seconds) against repeated measurements of it (seconds each)."""
    if not (isinstance(predicted, (int, float)) and math.isfinite(predicted) and predicted > 0):
        raise ValueError(f"predicted={predicted!r} is not allowed: a positive finite number of "
                         "seconds")  # fmt: skip
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance={tolerance!r} is not allowed: a fraction in (0, 1)")
    summary = verdict.summarize(samples, name)
    lo, hi = summary.interval
    b_lo, b_hi = predicted * (1 - tolerance), predicted * (1 + tolerance)
    if summary.n < min_runs:
        outcome = "noisy"
    elif b_lo <= lo and hi <= b_hi:
        outcome = "agree"
    elif lo > b_hi:
        outcome = "above"
    elif hi < b_lo:
        outcome = "below"
    else:
        outcome = "noisy"
    return PredictionCheck(name=name, predicted=float(predicted), measured=summary.median,
                           interval=(lo, hi), n=summary.n, tolerance=tolerance,
                           outcome=outcome)  # fmt: skip
