"""Notebook 05, section 1, read and shown: a predicted time held against measured ones (one of
three sentences), the step predicted, the sweep read against it, and the figures of the sweep
and of the alignment study (matplotlib imported only when drawing).

:mod:`labkit.batching.sweep` measures (the throughput and memory sweep, the GEMM timed around
multiples of 8, the shape trade) and returns its results; this module takes those results and
measures nothing. The dependency runs one way: this module imports ``sweep``, never the reverse.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from labkit import formulas, verdict
from labkit.batching import finder
from labkit.batching.sweep import SATURATION, AlignmentStudy, StepModel, Sweep, SweepRow
from labkit.config import ModelConfig
from labkit.timing import format_seconds

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
        head = (f"{self.name}: predicted {format_seconds(self.predicted)}, measured "
                f"median {format_seconds(self.measured)} (interval "
                f"{format_seconds(lo)} to {format_seconds(hi)}, {self.n} runs), "
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


# ----------------------------------------------------------------------------------------------
# The step predicted, the sweep read against it, the alignment study, the shape trade.


def omitted_bytes_per_sequence(cfg: ModelConfig, seq_len: int | None = None) -> dict[str, int]:
    """The terms ``finder.OMISSIONS`` names that grow with the batch, in bytes per sequence
    (float32), by what they are: the head's three more s×V tensors, the inputs of the final
    LayerNorm and of the head, and every LayerNorm's mean and rstd."""
    s = cfg.seq_len if seq_len is None else seq_len
    V, h, L = cfg.vocab_size, cfg.d_model, cfg.n_layer
    return {"3 more s×V float32 tensors at the head (logits, their gradient, the loss's)": 3 * s * V * 4,
            "inputs of the final LayerNorm and of the output head": 2 * s * h * 4,
            "LayerNorm means and rstds (2L + 1 LayerNorms)": (2 * L + 1) * 8 * s}  # fmt: skip


@dataclass(frozen=True)
class StepPrediction:
    """A training step predicted from the formulas: FLOPs per token and the memory model."""

    n_flop: int
    """Parameters counted for FLOPs (the position table excluded)."""
    flops_per_token: float
    memory: finder.BatchPrediction
    micro_batches: tuple[int, ...]

    def describe(self) -> str:
        m = self.memory
        lines = [f"predicted: {self.flops_per_token / 1e6:.2f} MFLOP per token (6N + 12·L·h·s, "
                 f"N = {self.n_flop:,})",
                 f"predicted: model states {m.model_state_bytes / 2**20:.2f} MiB at any batch, "
                 f"+ {m.bytes_per_sequence / 2**20:.3f} MiB per sequence "
                 f"(activations {m.activation_bytes_per_sequence / 2**20:.3f}, "
                 f"logits' log-softmax {m.logits_bytes_per_sequence / 2**20:.3f})"]  # fmt: skip
        lines += [f"  micro-batch {b:>4}: predicted peak {m.peak_bytes(b) / 2**20:8.2f} MiB"
                  for b in self.micro_batches]  # fmt: skip
        return "\n".join(lines)


def step_prediction(cfg: ModelConfig, n_flop: int, micro_batches: Sequence[int], *,
                    dtype: str = "float32", seq_len: int | None = None,
                    dropout_mask_bytes: int = 4) -> StepPrediction:  # fmt: skip
    """FLOPs per token (``formulas.flops_per_token``) and the finder's memory model
    (``finder.predict_max_batch``, no limit) for ``cfg`` at each of ``micro_batches``."""
    s = cfg.seq_len if seq_len is None else seq_len
    flops = formulas.flops_per_token(n_flop, cfg.n_layer, cfg.d_model, s)
    memory = finder.predict_max_batch(cfg, 2**62, dtype=dtype, seq_len=s,
                                      dropout_mask_bytes=dropout_mask_bytes)  # fmt: skip
    return StepPrediction(n_flop=n_flop, flops_per_token=flops, memory=memory,
                          micro_batches=tuple(micro_batches))  # fmt: skip


@dataclass(frozen=True)
class SweepReading:
    """A sweep read against its prediction: the fitted t₀ + b·t₁, the saturation batch, the
    seconds per token at the smallest batch against the saturation batch (a verdict), and the
    memory slope per sequence, measured between the two largest sizes, against the memory model
    and against the model plus the omissions counted per sequence."""

    sweep: Sweep
    prediction: StepPrediction
    omitted: dict[str, int]

    @property
    def fit(self) -> StepModel:
        return self.sweep.overhead_fit()

    @property
    def saturated(self) -> SweepRow:
        return self.sweep.saturation()

    @property
    def slope(self) -> float:
        """Measured bytes per sequence between the two largest micro-batches."""
        lower, upper = self.sweep.rows[-2], self.sweep.rows[-1]
        return (upper.peak_bytes - lower.peak_bytes) / (upper.micro_batch - lower.micro_batch)

    def comparison(self) -> verdict.Comparison:
        small, sat = self.sweep.rows[0], self.saturated
        return verdict.compare_times(small.seconds_per_token, sat.seconds_per_token,
                                     names=(f"b={small.micro_batch}", f"b={sat.micro_batch}"))  # fmt: skip

    def describe(self) -> str:
        fit, sat, best, per_seq = self.fit, self.saturated, self.sweep.best, self.prediction.memory.bytes_per_sequence
        lines = [str(self.sweep), "",
                 f"modelled (fitted to the medians): t(b) = {fit.fixed_s * 1e3:.2f} ms + "
                 f"b × {fit.per_sequence_s * 1e3:.3f} ms; half of the ceiling "
                 f"({fit.ceiling_tokens_per_s:,.0f} tokens/s) at b = {fit.half_batch:.1f}",
                 f"measured: throughput saturates at micro-batch {sat.micro_batch} "
                 f"(the smallest within {SATURATION:.0%} of the best, "
                 f"{best.tokens_per_s:,.0f} tokens/s at {best.micro_batch})",
                 "seconds per token, the smallest batch against the saturation batch (measured):",
                 str(self.comparison()), "",
                 f"per sequence: measured {self.slope / 2**20:.3f} MiB; predicted "
                 f"{per_seq / 2**20:.3f} MiB, + the omissions below = "
                 f"{(per_seq + sum(self.omitted.values())) / 2**20:.3f} MiB"]  # fmt: skip
        lines += [f"  {n / 2**20:.3f} MiB  {what}" for what, n in self.omitted.items()]
        return "\n".join(lines)


def read_sweep(result: Sweep, prediction: StepPrediction, cfg: ModelConfig) -> SweepReading:
    """:class:`SweepReading` of ``result``, with the omissions of ``cfg`` at the sweep's seq_len."""
    return SweepReading(sweep=result, prediction=prediction,
                        omitted=omitted_bytes_per_sequence(cfg, result.seq_len))  # fmt: skip


def plot_sweep(reading: SweepReading, axes: Any = None) -> Any:
    """Tokens/s (every timed step, the median, the fitted line, the saturation batch; MFU on a
    second axis where a peak is published) and the peak memory per step, measured beside the
    memory model. ``axes``: two matplotlib axes, or None for a new figure. Returns the axes."""
    import matplotlib.pyplot as plt  # here, so that importing labkit stays light

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    ax_t, ax_m = axes
    result, fit, saturated = reading.sweep, reading.fit, reading.saturated
    memory_model, flops_per_token = reading.prediction.memory, reading.prediction.flops_per_token
    sizes = [r.micro_batch for r in result.rows]
    ax_t.plot(sizes, [r.tokens_per_s for r in result.rows], "o-", label="measured (median)")
    for r in result.rows:  # every timed step, to show the spread
        ax_t.plot([r.micro_batch] * len(r.seconds), [r.tokens / s for s in r.seconds], ".",
                  c="C0", alpha=0.3)  # fmt: skip
    fine = [2 ** (k / 8) for k in range(0, 8 * int(math.log2(sizes[-1])) + 1)]
    ax_t.plot(fine, [fit.tokens_per_s(b) for b in fine], "--", c="grey",
              label="t₀ + b·t₁ fitted (modelled)")  # fmt: skip
    ax_t.axvline(saturated.micro_batch, c="C2", ls=":",
                 label=f"saturation (b={saturated.micro_batch})")  # fmt: skip
    ax_t.set(xscale="log", xlabel="micro-batch (sequences)", ylabel="tokens/s",
             title=f"throughput, {result.device_name[:40]}")  # fmt: skip
    ax_t.set_xticks(sizes, [str(b) for b in sizes])
    ax_t.legend(fontsize=8)
    if result.peak.known:  # MFU on a second axis: the same curve in units of the peak
        ax_mfu = ax_t.secondary_yaxis("right", functions=(
            lambda v: v * flops_per_token / result.peak.flops_per_s,
            lambda m: m * result.peak.flops_per_s / flops_per_token))  # fmt: skip
        ax_mfu.set_ylabel("MFU")
    ax_m.plot(sizes, [r.peak_bytes / 2**20 for r in result.rows], "o-", label="measured peak")
    ax_m.plot(sizes, [r.predicted_peak_bytes / 2**20 for r in result.rows], "s--",
              label="predicted (memory model)")  # fmt: skip
    ax_m.axhline(memory_model.model_state_bytes / 2**20, c="grey", lw=0.8,
                 label="model states (predicted)")  # fmt: skip
    ax_m.set(xlabel="micro-batch (sequences)", ylabel="MiB",
             title="memory per training step (linear axes: a straight line)")  # fmt: skip
    ax_m.legend(fontsize=8)
    ax_t.figure.tight_layout()
    return axes


def plot_alignment(study: AlignmentStudy, ax: Any = None) -> Any:
    """µs per sequence against b, one line per group of five, the multiples of 8 ringed."""
    import matplotlib.pyplot as plt  # here, so that importing labkit stays light

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3))
    batches = list(study.batches)
    for i, s in enumerate(study.results):
        med = [study.median_us(s, b) for b in batches]
        ax.plot(batches, med, ".", c=f"C{i}", label=f"s = {s}")
        for c in study.centers:  # one line per group of five, the multiple of 8 ringed
            group = [j for j, b in enumerate(batches) if abs(b - c) <= 2]
            ax.plot([batches[j] for j in group], [med[j] for j in group], "-", c=f"C{i}", lw=0.8)
            ax.plot(c, med[batches.index(c)], "o", mfc="none", c=f"C{i}", ms=9)
    ax.set(xscale="log", xlabel="micro-batch b (sequences)", ylabel="µs per sequence",
           title=f"the {study.gemm[0]} GEMM per sequence, b one apart (measured; rings: "
                 "multiples of 8)")  # fmt: skip
    ax.set_xticks(list(study.centers), [str(c) for c in study.centers])
    ax.legend(fontsize=8)
    return ax
