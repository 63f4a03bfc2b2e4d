"""Notebook 03d, section 1: the three recompute modes predicted, measured and timed side by side.

:mod:`labkit.batching.recomputation` holds the ideas (``apply_ac``, ``predict_recompute``,
``measure_held_bytes``, ``one_f_one_b_in_flight``); this module holds the section's
measurements of them across the modes, each a result with ``describe()`` (the table the
notebook prints) and the section's figure (:func:`plot_recompute`). Apart from
``recomputation`` because that file is the teaching code; what is here is presentation.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from labkit.batching import recomputation
from labkit.config import ModelConfig

# --- the setup: device, one CPU thread, a batch -------------------------------------------------


@dataclass(frozen=True)
class RecomputeLab:
    """Where section 1 runs: its device, the threads to restore at its end, one micro-batch."""

    cfg: ModelConfig
    micro_batch: int
    device: torch.device
    threads: int
    """torch's CPU threads before the section (:meth:`restore_threads` puts them back)."""
    batch: tuple[torch.Tensor, torch.Tensor]
    """(tokens, targets) on ``device``; seed 7."""
    limited: str | None = None
    """The sentence of ``hardware.limit_cpu_threads(1)``, on a CPU; None on a GPU."""

    def restore_threads(self) -> None:
        torch.set_num_threads(self.threads)

    def describe(self) -> str:
        line = (f"{self.cfg.n_layer} blocks, micro-batch {self.micro_batch} x {self.cfg.seq_len} "
                f"tokens, float32, on {self.device.type}")  # fmt: skip
        return line if self.limited is None else f"{self.limited}\n{line}"


def open_lab(cfg: ModelConfig, micro_batch: int, *, tier: str) -> RecomputeLab:
    """A GPU when the tier has one, else the CPU on one thread (restored by
    ``restore_threads``); the micro-batch of random tokens (seed 7) every measurement uses."""
    from labkit import hardware  # layer 1

    device = torch.device("cuda") if tier != "cpu" and torch.cuda.is_available() else torch.device("cpu")
    threads = torch.get_num_threads()
    limited = hardware.limit_cpu_threads(1) if device.type == "cpu" else None
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len), generator=g)
    batch = (x.to(device), torch.roll(x, -1, dims=1).to(device))
    return RecomputeLab(cfg, micro_batch, device, threads, batch, limited)


# --- predicted ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecomputePredictions:
    """``predict_recompute`` for every mode (``self[mode]``), and the paper's formula for GPT-3
    175B beside it (s = 2048, h = 12288, a = 96, 16-bit, dropout, s×s stored)."""

    micro_batch: int
    modes: dict[str, recomputation.RecomputePrediction]
    paper: dict[str, float]
    paper_shape: tuple[int, int, int] = (2048, 12288, 96)

    def __getitem__(self, mode: str) -> recomputation.RecomputePrediction:
        return self.modes[mode]

    def describe(self) -> str:
        none = self.modes["none"].held_bytes
        lines = [f"{'mode':<10}{'per block':>13}{'whole model':>14}{'saved vs none':>15}"
                 f"{'FLOPs per step':>16}   (all predicted)"]  # fmt: skip
        for m, p in self.modes.items():
            lines.append(f"{m:<10}{p.per_layer_bytes / 2**20:>9.3f} MiB{p.held_bytes / 2**20:>10.2f} MiB"
                         f"{p.saving_bytes / none:>14.0%}{p.flops_factor:>15.3f}x")  # fmt: skip
        s, h, a = self.paper_shape
        paper = self.paper
        lines += ["", f"GPT-3 175B by the paper's formula s·b·h·(34 + 5as/h), s={s}, h={h}, a={a} "
                  f"(predicted): {paper['none'] / 2**20:,.0f} MiB per layer and sequence; "
                  f"selective keeps 34·sbh ({1 - paper['selective'] / paper['none']:.0%} less), "
                  f"full 2·sbh ({1 - paper['full'] / paper['none']:.1%} less)"]  # fmt: skip
        return "\n".join(lines)


def predict_modes(cfg: ModelConfig, micro_batch: int) -> RecomputePredictions:
    """Every mode of ``recomputation.AC_MODES`` predicted for ``cfg``, and the paper's GPT-3."""
    s, h, a = 2048, 12288, 96  # GPT-3 175B, the paper's example
    return RecomputePredictions(
        micro_batch=micro_batch,
        modes={m: recomputation.predict_recompute(cfg, micro_batch, m) for m in recomputation.AC_MODES},
        paper={m: recomputation.paper_bytes_per_layer(s, 1, h, a, m) for m in recomputation.AC_MODES},
        paper_shape=(s, h, a))  # fmt: skip


# --- measured: held bytes and gradients ---------------------------------------------------------


def _gradient_verdict(worst: float, scale: float) -> str:
    if worst == 0:
        return "bitwise equal"
    return "equal to rounding" if worst <= 1e-5 * scale else "NOT equal: the recompute changed the result"


@dataclass(frozen=True)
class HeldBytes:
    """Bytes each mode's forward left for its backward (measured), against the prediction,
    and each mode's gradients against none's (largest absolute difference)."""

    held: dict[str, int]
    predicted: dict[str, float]
    worst_grad_diff: dict[str, float]
    """Per mode other than none: the largest |gradient - none's gradient|."""
    grad_scale: float
    """The largest |gradient| of none's."""
    device_type: str

    def __getitem__(self, mode: str) -> int:
        return self.held[mode]

    def describe(self) -> str:
        lines = [f"{'mode':<10}{'held: predicted':>17}{'measured':>13}{'measured - predicted':>23}"]
        for m, held in self.held.items():
            want = self.predicted[m]
            lines.append(f"{m:<10}{want / 2**20:>13.3f} MiB{held / 2**20:>9.3f} MiB{held - want:>+21,} B")
        if self.device_type == "cuda":
            lines.append("(per block, the CUDA attention kernel's int64 random-number seed and "
                         "offset, 16 B, which the prediction leaves out)")  # fmt: skip
        for m, worst in self.worst_grad_diff.items():
            lines.append(f"{m}: gradients against none's (measured): largest difference {worst:.1e} "
                         f"of values up to {self.grad_scale:.1e}: "
                         + _gradient_verdict(worst, self.grad_scale))  # fmt: skip
        return "\n".join(lines)


def measure_modes(models: Mapping[str, nn.Module], lab: RecomputeLab,
                  predicted: RecomputePredictions) -> HeldBytes:  # fmt: skip
    """``recomputation.measure_held_bytes`` on a copy of each mode's model (then its backward),
    and each mode's gradients held against none's."""
    held, grads = {}, {}
    for m, model in models.items():
        work = copy.deepcopy(model).to(lab.device)
        held[m] = recomputation.measure_held_bytes(work, lab.batch)  # then runs the backward
        grads[m] = [p.grad for p in work.parameters()]
    scale = max(r.abs().max().item() for r in grads["none"])
    worst = {m: max((g - r).abs().max().item() for g, r in zip(grads[m], grads["none"], strict=True))
             for m in grads if m != "none"}  # fmt: skip
    return HeldBytes(held=held, predicted={m: predicted[m].held_bytes for m in held},
                     worst_grad_diff=worst, grad_scale=scale, device_type=lab.device.type)  # fmt: skip


# --- measured: step time ------------------------------------------------------------------------


@dataclass(frozen=True)
class RecomputeTimes:
    """Each mode's step time, timed taking turns (measured), per round against none's in the
    same round, beside the FLOPs factor (predicted); on CUDA each mode's peak memory."""

    times: dict[str, list[float]]
    flops_factor: dict[str, float]
    peak_bytes: dict[str, int]
    """CUDA's max_memory_allocated over one step per mode; empty on a CPU."""

    def ratio(self, mode: str) -> tuple[float, float, float]:
        """(median, first quartile, third quartile) of the per-round time over none's."""
        from labkit import timing  # layer 0

        r = [t / t0 for t, t0 in zip(self.times[mode], self.times["none"], strict=True)]
        return (statistics.median(r), *timing.quartiles(r))

    def describe(self) -> str:
        from labkit import verdict  # layer 3

        lines = []
        for m in ("selective", "full"):
            f, (med, lo, hi) = self.flops_factor[m], self.ratio(m)
            where = "inside" if lo <= f <= hi else "below" if f < lo else "above"
            lines += ["", f"{m}: step time {med:.2f}x none's (middle half {lo:.2f}x to {hi:.2f}x, "
                      f"measured); FLOPs {f:.3f}x (predicted), {where} that middle half",
                      str(verdict.compare_times(self.times[m], self.times["none"], names=(m, "none")))]
        return "\n".join(lines)


def time_modes(models: Mapping[str, nn.Module], lab: RecomputeLab, predicted: RecomputePredictions,
               train_cfg: Any, *, rounds: int) -> RecomputeTimes:  # fmt: skip
    """One training step per mode, taking turns (``timing.alternate``, one warm-up round), with
    progress printed as it goes; on CUDA first each mode's peak memory over one step."""
    from labkit import timing, train  # layers 0 and 2

    def stepper(model: nn.Module) -> Any:
        work = copy.deepcopy(model).to(lab.device)
        opt = train.make_optimizer(work, train_cfg)
        return lambda: train.train_step(work, opt, [lab.batch], device=lab.device).seconds

    peak = {}
    if lab.device.type == "cuda":  # the allocator's view of a whole step, per mode
        for m, model in models.items():
            step = stepper(model)
            step()
            torch.cuda.reset_peak_memory_stats()
            step()
            peak[m] = torch.cuda.max_memory_allocated()
        print("peak CUDA memory of a step (measured): "
              + ", ".join(f"{m} {v / 2**20:.1f} MiB" for m, v in peak.items()))
    print(f"timing {rounds} rounds (and 1 warm-up) of one step per mode, taking turns:", end="")
    times = timing.alternate({m: stepper(model) for m, model in models.items()}, rounds=rounds,
                             warmup=1, on_round=lambda r, got: print(f" {r + 1 if r >= 0 else 'w'}",
                                                                      end="", flush=True))  # fmt: skip
    print()
    return RecomputeTimes(times=times, peak_bytes=peak,
                          flops_factor={m: predicted[m].flops_factor for m in times})  # fmt: skip


def plot_recompute(predicted: RecomputePredictions, held: HeldBytes, times: RecomputeTimes,
                   ax: Any = None) -> Any:  # fmt: skip
    """Memory saved against compute added per mode: predicted (FLOPs, bytes) as circles,
    measured (step time with its middle half, bytes) as crosses. Returns the Axes."""
    import matplotlib.pyplot as plt  # lazy: importing labkit must stay cheap

    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 4))
    for m, color in zip(recomputation.AC_MODES, ("tab:gray", "tab:blue", "tab:red"), strict=True):
        p = predicted[m]
        med, lo, hi = times.ratio(m) if m != "none" else (1.0, 1.0, 1.0)
        ax.scatter(100 * (p.flops_factor - 1), p.saving_bytes / 2**20, s=90, facecolors="none",
                   edgecolors=color, label=f"{m}: predicted (FLOPs, bytes)")
        ax.errorbar(100 * (med - 1), (held["none"] - held[m]) / 2**20, fmt="x", color=color,
                    ms=9, xerr=[[100 * (med - lo)], [100 * (hi - med)]],
                    label=f"{m}: measured (step time, bytes)")
    ax.axhline(held["none"] / 2**20, ls=":", color="k", lw=0.8, label="all of none's held bytes")
    ax.set(xlabel="compute added: FLOPs predicted, step time measured (% over none)",
           ylabel="activation memory saved (MiB)",
           title=f"Recompute: memory saved vs time added ({held.device_type}, micro-batch "
                 f"{predicted.micro_batch})")
    ax.legend(fontsize=7, loc="center right")
    plt.tight_layout()
    return ax


# --- 1F1B: what each stage holds ---------------------------------------------------------------


@dataclass(frozen=True)
class StageMemory:
    """Activation bytes per pipeline stage under 1F1B, per mode (predicted: the micro-batches in
    flight × a stage's blocks and its output), and stage 0's measured after each forward."""

    stages: int
    micro_batches: int
    blocks_per_stage: int
    micro_batch: int
    in_flight: list[int]
    per_micro_batch: dict[str, float]
    """Predicted bytes one micro-batch leaves on a stage: its blocks and its output."""
    measured: dict[str, list[int]]
    """Stage 0's live bytes after each of its forwards, per mode."""

    def describe(self) -> str:
        per_mb, mib = self.per_micro_batch, 2**20
        lines = [f"{self.stages} stages of {self.blocks_per_stage} block(s), {self.micro_batches} "
                 f"micro-batches of {self.micro_batch}: activation MiB per stage (predicted; the "
                 "embeddings and the head left out)",
                 f"{'stage':<7}{'in flight':>10}" + "".join(f"{m:>12}" for m in per_mb)]  # fmt: skip
        for i, n in enumerate(self.in_flight):
            lines.append(f"{i:<7}{n:>10}" + "".join(f"{n * per_mb[m] / mib:>12.2f}" for m in per_mb))
        lines.append(f"{'GPipe':<7}{self.micro_batches:>10}"
                     + "".join(f"{self.micro_batches * per_mb[m] / mib:>12.2f}" for m in per_mb))
        for m, held in self.measured.items():
            want = self.in_flight[0] * per_mb[m]
            lines.append(f"stage 0, {m:<9}: after each forward {', '.join(f'{v / mib:.2f}' for v in held)} "
                         f"MiB (measured), predicted {want / mib:.2f} MiB: "
                         + ("equal to the byte" if held[-1] == want else f"{held[-1] - want:+,} B off"))
        return "\n".join(lines)


def measure_stage_memory(models: Mapping[str, nn.Module], lab: RecomputeLab,
                         predicted: RecomputePredictions, *, stages: int,
                         micro_batches: int) -> StageMemory:  # fmt: skip
    """Predict each 1F1B stage's activations (``recomputation.one_f_one_b_in_flight``) and
    measure stage 0's: its blocks run here on as many micro-batches as it holds at once
    (``recomputation.measure_in_flight_bytes``; no pipeline launched)."""
    cfg, b = lab.cfg, lab.micro_batch
    k = cfg.n_layer // stages  # blocks per stage
    in_flight = recomputation.one_f_one_b_in_flight(stages, micro_batches)
    out_bytes = 4 * b * cfg.seq_len * cfg.d_model  # each stage's output, kept too
    per_mb = {m: k * predicted[m].per_layer_bytes + out_bytes for m in recomputation.AC_MODES}
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(b, cfg.seq_len, cfg.d_model, generator=g).to(lab.device)
              for _ in range(in_flight[0])]  # fmt: skip
    measured = {}
    for m, model in models.items():
        stage0 = torch.nn.Sequential(*copy.deepcopy(model).blocks[:k]).to(lab.device)
        measured[m] = recomputation.measure_in_flight_bytes(stage0, inputs)
    return StageMemory(stages=stages, micro_batches=micro_batches, blocks_per_stage=k,
                       micro_batch=b, in_flight=in_flight, per_micro_batch=per_mb,
                       measured=measured)  # fmt: skip
