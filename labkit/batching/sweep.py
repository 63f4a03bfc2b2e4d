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

Shapes (:func:`time_gemm_batches`, :func:`alignment_verdict`): the model's largest GEMM timed at
batch sizes one apart around multiples of 8, and a verdict, chosen by the spread, on whether the
multiples run faster per sequence than their neighbours (NVIDIA's tensor-core alignment rule).

The alignment study (:func:`alignment_study`) and the shape trade (:func:`shape_trade`) measure
and return results that describe themselves. What notebook 05 reads from a sweep against its
prediction (:func:`~labkit.batching.sweep_report.read_sweep`, ``check_prediction``, the figures)
is in :mod:`labkit.batching.sweep_report`, which imports this module: never the reverse.
"""

from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from labkit import formulas, hardware, timing, train, verdict
from labkit.batching import finder, trials
from labkit.config import ModelConfig, TrainConfig
from labkit.validate import InvalidValue, refuse, whole

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
        try:
            if len(pair) != 2:
                raise InvalidValue(f"{len(pair)} numbers")
            out.append((whole("micro_batch", pair[0], low=1), whole("grad_accum", pair[1], low=1)))
        except InvalidValue:  # one message for the point, with the example
            raise ValueError(f"{v!r} is not allowed: a micro-batch size and an accumulation "
                             f"count must be positive integers, {example}") from None  # fmt: skip
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
    seq_len = formulas.max_batch.checked_seq_len(cfg, seq_len)
    dtype = trials.checked_dtype(dtype)
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
# Shapes: batch sizes one apart around multiples of 8, timed, and a verdict on the multiples.
#
# NVIDIA, *Matrix Multiplication Background User's Guide*, §2.2 "Tensor Core Requirements":
# cuBLAS uses tensor cores most efficiently when M, N and K are multiples of 16 bytes (8 fp16 or
# bf16 elements); §3.1-3.2: tile and wave quantization. In a transformer the batch enters every
# linear layer's GEMM as M = b·s tokens, so a sequence length s that is a multiple of 8 aligns
# every b, and an odd s aligns exactly the b that are multiples of 8.

ALIGNMENT = 8
"""Elements per 16 bytes of fp16/bf16: the multiple NVIDIA's guide asks of GEMM dimensions."""

ALIGNMENT_TOLERANCE = verdict.DEFAULT_TOLERANCE
"""Per-sample times within 10% count as "agree" in :func:`alignment_verdict`, as everywhere in
:mod:`labkit.verdict`: on the course's shared 2-core host the medians of one GEMM at
neighbouring sizes moved by 2-5% from run to run, so a 5% band mostly read "too noisy". An
effect smaller than the tolerance is reported as none, and the sentence says so."""


def alignment_batches(centers: Sequence[int], *, spread: int = 2,
                      multiple: int = ALIGNMENT) -> list[int]:  # fmt: skip
    """The batch sizes c − spread … c + spread around each center c (a multiple of
    ``multiple``), each once, in increasing order."""
    spread = whole("spread", spread, low=1, high=multiple - 1)
    if not centers:
        raise ValueError("centers is empty: give multiples of the alignment, e.g. [8, 16]")
    for c in centers:
        if whole("centers", c, low=multiple) % multiple:
            raise refuse("centers", c, f"a positive multiple of {multiple}")
    return sorted({int(c) + d for c in centers for d in range(-spread, spread + 1)})


def largest_gemm(cfg: ModelConfig) -> tuple[str, int, int]:
    """(name, K, N) of the GPT's largest GEMM per token: the MLP's first layer (d × 4d) or the
    output head (d × vocab), whichever has more columns (the head on a tie)."""
    d = cfg.d_model
    return ("output head", d, cfg.vocab_size) if cfg.vocab_size >= 4 * d else \
        ("MLP first layer", d, 4 * d)  # fmt: skip


@dataclass(frozen=True)
class AlignmentSweep:
    """Seconds of one GEMM at the step's shapes, M = b·seq_len, per batch size b."""

    seconds: dict[int, tuple[float, ...]]
    """b -> seconds of one GEMM call, one sample per round (each the median of ``inner``
    calls)."""
    seq_len: int
    k: int
    n: int
    dtype: str
    device: str
    inner: dict[int, int]
    """Calls per sample, per b (so that a sample lasts about ``min_sample_s``)."""

    def per_sample(self, b: int) -> list[float]:
        """Seconds per sequence of the batch: each sample divided by b."""
        return [s / b for s in self.seconds[b]]

    def verdict(self, *, tolerance: float = ALIGNMENT_TOLERANCE) -> AlignmentVerdict:
        return alignment_verdict({b: self.per_sample(b) for b in self.seconds},
                                 tolerance=tolerance)  # fmt: skip


def time_gemm_batches(
    batches: Sequence[int],
    *,
    seq_len: int,
    k: int,
    n: int,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    rounds: int = 7,
    warmup: int = 1,
    min_sample_s: float = 2e-3,
    max_inner: int = 100,
) -> AlignmentSweep:
    """Time ``(b·seq_len × k) @ (k × n)`` in ``dtype`` on ``device`` for every b in ``batches``.

    The sizes take turns round by round (``labkit.timing.alternate``); each sample is the
    median of enough calls, each timed on its own (``labkit.timing.Timer``: CUDA events, or a
    synchronised clock), to last about ``min_sample_s`` together (at most ``max_inner``): a
    moment the machine's scheduler takes the core then spoils one call, not the sample.
    """
    sizes = [b for b, _ in _points(list(batches))]
    for name, v in (("seq_len", seq_len), ("k", k), ("n", n)):
        whole(name, v, low=1)
    device = torch.device(device)
    dt = train.DTYPES[trials.checked_dtype(dtype)]
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(k, n, generator=g).to(device=device, dtype=dt)
    timer = timing.Timer(device)

    def call_s(a: torch.Tensor) -> float:
        with timer:
            torch.mm(a, weight)
        return timer.elapsed_s

    inner: dict[int, int] = {}
    fns = {}
    for b in sizes:
        a = torch.randn(b * seq_len, k, generator=g).to(device=device, dtype=dt)
        fastest = min(call_s(a) for _ in range(3))  # warms the kernel, and calibrates
        inner[b] = min(max_inner, max(1, math.ceil(min_sample_s / max(fastest, 1e-7))))

        def sample(a=a, reps=inner[b]) -> float:
            return statistics.median(call_s(a) for _ in range(reps))

        fns[str(b)] = sample
    times = timing.alternate(fns, rounds=rounds, warmup=warmup)
    return AlignmentSweep(seconds={b: tuple(times[str(b)]) for b in sizes}, seq_len=int(seq_len),
                          k=int(k), n=int(n), dtype=str(dt).removeprefix("torch."),
                          device=str(device), inner=inner)  # fmt: skip


_CENTER_KINDS = {
    "faster": "faster per sequence than each neighbour, beyond the spread,",
    "not faster": "no faster than its neighbours (by more than the tolerance)",
    "partly": "faster than some neighbours, not all,",
    "unclear": "too noisy to tell (rerun, or run it alone)",
}


@dataclass(frozen=True)
class AlignmentVerdict:
    """Whether batch sizes that are multiples of ``multiple`` run faster per sample than their
    neighbours one and two away, beyond the spread.

    Per center c: ``"faster"`` when c's per-sample time beats every neighbour's
    (``verdict.compare_times``: medians' intervals apart); ``"not faster"`` when no neighbour
    is clearly slower (each agrees within the tolerance, or is faster); ``"unclear"`` when a
    comparison is too noisy; ``"partly"`` otherwise (faster than some neighbours, not all).
    """

    multiple: int
    per_center: dict[int, str]
    comparisons: dict[tuple[int, int], verdict.Comparison]
    """(center, neighbour) -> their per-sample times compared."""
    tolerance: float = ALIGNMENT_TOLERANCE

    @property
    def outcome(self) -> str:
        """"faster" or "not faster" when every center is that; else "unclear" when some center
        is, else "mixed"."""
        kinds = set(self.per_center.values())
        if len(kinds) == 1 and kinds <= {"faster", "not faster"}:
            return kinds.pop()
        return "unclear" if "unclear" in kinds else "mixed"

    @property
    def sentence(self) -> str:
        m = self.multiple
        at = {kind: ", ".join(f"b = {c}" for c, k in self.per_center.items() if k == kind)
              for kind in _CENTER_KINDS}  # fmt: skip
        if self.outcome == "faster":
            return (f"measured: the multiples of {m} ({at['faster']}) run faster per sequence "
                    "than each neighbour one and two away, beyond the spread")
        if self.outcome == "not faster":
            return (f"measured: no multiple of {m} ({at['not faster']}) runs faster per "
                    f"sequence than its neighbours by more than {self.tolerance:.0%}, beyond the "
                    "spread")
        return "measured: " + "; ".join(f"{text} at {at[kind]}"
                                        for kind, text in _CENTER_KINDS.items() if at[kind])

    def __str__(self) -> str:
        return self.sentence


def alignment_verdict(per_sample: dict[int, Sequence[float]], *, multiple: int = ALIGNMENT,
                      tolerance: float = ALIGNMENT_TOLERANCE) -> AlignmentVerdict:  # fmt: skip
    """Judge per-sample times (b -> seconds per sequence, repeated) at each multiple of
    ``multiple`` present against its neighbours b ± 1, ± 2 present. Pure: measures nothing."""
    centers = sorted(b for b in per_sample if b % multiple == 0)
    per_center: dict[int, str] = {}
    comparisons: dict[tuple[int, int], verdict.Comparison] = {}
    for c in centers:
        near = [b for b in sorted(per_sample) if b != c and abs(b - c) < multiple // 2]
        if not near:
            continue
        kinds = []
        for b in near:
            cmp = verdict.compare_times(per_sample[c], per_sample[b], names=(f"b={c}", f"b={b}"),
                                        tolerance=tolerance)  # fmt: skip
            comparisons[c, b] = cmp
            if cmp.outcome == "faster":
                kinds.append("faster" if cmp.faster is cmp.a else "slower")
            else:
                kinds.append(cmp.outcome)  # "agree" or "noisy"
        if all(k == "faster" for k in kinds):
            per_center[c] = "faster"
        elif all(k in ("agree", "slower") for k in kinds):
            per_center[c] = "not faster"
        elif "noisy" in kinds:
            per_center[c] = "unclear"
        else:
            per_center[c] = "partly"
    if not per_center:
        raise ValueError(f"no multiple of {multiple} with a neighbour within {multiple // 2 - 1} "
                         f"in the batch sizes {sorted(per_sample)}: nothing to judge")  # fmt: skip
    return AlignmentVerdict(multiple=multiple, per_center=per_center, comparisons=comparisons,
                            tolerance=tolerance)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# The alignment study and the shape trade: measured here, each a result with ``describe()``.


@dataclass(frozen=True)
class AlignmentStudy:
    """The model's largest GEMM timed at batch sizes one apart around multiples of 8, at one or
    more sequence lengths, with the verdict of each (measured)."""

    gemm: tuple[str, int, int]
    """(name, K, N) of :func:`largest_gemm`."""
    centers: tuple[int, ...]
    batches: tuple[int, ...]
    results: dict[int, AlignmentSweep]
    """seq_len -> the timings."""
    dtype: str
    device_name: str
    on_gpu: bool

    def median_us(self, s: int, b: int) -> float:
        """µs per sequence at seq_len ``s`` and batch ``b``: the median of the rounds."""
        return statistics.median(self.results[s].per_sample(b)) * 1e6

    def describe(self) -> str:
        name, k, n = self.gemm
        lines = [f"the {name}: (b·s × {k}) @ ({k} × {n}) in {self.dtype} on "
                 f"{self.device_name[:40]}, b = 8k-2 … 8k+2 around {list(self.centers)}"]  # fmt: skip
        for s, result in self.results.items():
            step = ALIGNMENT // math.gcd(s, ALIGNMENT)  # b·s is a multiple of 8 iff step divides b
            which = "every b" if step == 1 else f"b a multiple of {step}, and no other"
            lines += ["", f"s = {s}: M = b·{s} is a multiple of 8 for {which}; µs per sequence, "
                      f"median of {len(result.seconds[self.batches[0]])} rounds (measured):"]  # fmt: skip
            for c in self.centers:
                lines.append("  " + "   ".join(f"b={b}: {self.median_us(s, b):.2f}"
                                               for b in self.batches if abs(b - c) <= 2))  # fmt: skip
            lines.append(f"  {result.verdict()}")
        if not self.on_gpu:
            lines += ["", "expected on a GPU, not measured here: at the odd s the multiples of 8 "
                      "run faster per sequence than their neighbours (tensor cores, NVIDIA's "
                      "guide §2.2); at s a multiple of 8 no b is special for alignment, and any "
                      "saw-tooth comes from tile and wave counts (§3.1-3.2)"]  # fmt: skip
        return "\n".join(lines)


def alignment_study(cfg: ModelConfig, centers: Sequence[int], *, seq_lens: Sequence[int],
                    dtype: str = "float32", device: str | torch.device = "cpu",
                    device_name: str = "", rounds: int = 11,
                    min_sample_s: float = 2e-3) -> AlignmentStudy:  # fmt: skip
    """Time the largest GEMM of ``cfg`` (:func:`time_gemm_batches`) at the batches of
    :func:`alignment_batches` around ``centers``, once per sequence length in ``seq_lens``."""
    gemm = largest_gemm(cfg)
    batches = alignment_batches(centers)
    results = {s: time_gemm_batches(batches, seq_len=s, k=gemm[1], n=gemm[2], dtype=dtype,
                                    device=device, rounds=rounds, min_sample_s=min_sample_s)
               for s in seq_lens}  # fmt: skip
    return AlignmentStudy(gemm=gemm, centers=tuple(centers), batches=tuple(batches),
                          results=results, dtype=dtype, device_name=device_name,
                          on_gpu=torch.device(device).type == "cuda")  # fmt: skip


@dataclass(frozen=True)
class ShapeTrade:
    """The same tokens per step in several shapes (s, b): FLOPs per token and the step's peak,
    predicted (``formulas.flops_per_token``; ``memory.predicted_step_peak``, tensor by tensor),
    then tokens/s (the shapes taking turns step by step) and the peak, measured, with a verdict
    on the shortest sequences against the longest."""

    shapes: tuple[tuple[int, int], ...]
    flops_per_token: dict[tuple[int, int], float]
    predicted_peak: dict[tuple[int, int], int]
    times: dict[str, list[float]]
    peak: dict[tuple[int, int], int]

    @staticmethod
    def name(s: int, b: int) -> str:
        return f"s={s}, b={b}"

    def describe(self) -> str:
        lines = [f"s = {s:>4}, b = {b:>3}: predicted {self.flops_per_token[s, b] / 1e6:.3f} MFLOP per "
                 f"token, peak {self.predicted_peak[s, b] / 2**20:.2f} MiB" for s, b in self.shapes]  # fmt: skip
        lines += [f"s = {s:>4}, b = {b:>3}: measured "
                  f"{s * b / statistics.median(self.times[self.name(s, b)]):>9,.0f} tokens/s, "
                  f"peak {self.peak[s, b] / 2**20:.2f} MiB" for s, b in self.shapes]  # fmt: skip
        (s_long, b_long), (s_short, b_short) = self.shapes[0], self.shapes[-1]
        lines.append(str(verdict.compare_times(self.times[self.name(s_short, b_short)],
                                               self.times[self.name(s_long, b_long)],
                                               names=(self.name(s_short, b_short),
                                                      self.name(s_long, b_long)))))  # fmt: skip
        return "\n".join(lines)


def shape_trade(template: nn.Module, shapes: Sequence[tuple[int, int]], *, n_flop: int,
                train_cfg: TrainConfig, data: torch.Tensor, device: str | torch.device = "cpu",
                dtype: str = "float32", rounds: int = 5) -> ShapeTrade:  # fmt: skip
    """Predict, then time (``timing.alternate``, one warm-up round, a real batch per shape drawn
    with a generator seeded s) and measure (``trials.measure_step_peak``) a training step of a
    copy of ``template`` at each (s, b) of ``shapes``, the first the longest sequences."""
    from labkit import memory  # layer 3
    from labkit.data import get_batch  # layer 1, only when a shape trade is asked for

    cfg = template.cfg
    device = torch.device(device)
    fpt = {(s, b): formulas.flops_per_token(n_flop, cfg.n_layer, cfg.d_model, s) for s, b in shapes}
    predicted = {(s, b): memory.predicted_step_peak(cfg, b, dtype=dtype, seq_len=s).bytes
                 for s, b in shapes}  # fmt: skip
    batches = {(s, b): get_batch(data, b, s, torch.Generator().manual_seed(s)) for s, b in shapes}

    def stepper(s: int, b: int) -> Any:
        work = copy.deepcopy(template).to(device)
        optimizer, scaler = train.make_optimizer(work, train_cfg), train.make_scaler(device, dtype)

        def step() -> float:
            return train.train_step(work, optimizer, [batches[s, b]], device=device, dtype=dtype,
                                    scaler=scaler, grad_clip=train_cfg.grad_clip).seconds  # fmt: skip
        return step

    times = timing.alternate({ShapeTrade.name(s, b): stepper(s, b) for s, b in shapes},
                             rounds=rounds, warmup=1)  # fmt: skip
    peak = {(s, b): trials.measure_step_peak(template, b, seq_len=s, dtype=dtype, train_cfg=train_cfg,
                                             device=device) for s, b in shapes}  # fmt: skip
    return ShapeTrade(shapes=tuple(shapes), flops_per_token=fpt, predicted_peak=predicted,
                      times=times, peak=peak)  # fmt: skip

