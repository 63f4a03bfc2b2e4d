"""A training run's throughput and MFU, and where one step's time goes under the compute roof.

Notebook 01's section 4 in words: tokens/s over the timed steps × FLOPs per token (predicted,
:func:`labkit.formulas.flops_per_token`) is the achieved FLOP/s, and MFU divides it by a
*published* peak (:func:`labkit.hardware.peak_flops`), or is refused when none is known. The
step's phases are then timed and set against the roof at this machine's measured matmul
ceiling (:mod:`labkit.roofline`), and the profiler says where the rest of the time went
(:func:`labkit.profiling.attribute_step`).

Separate from ``train`` (which records the run) and ``roofline`` (which measures ceilings)
because it puts the two side by side and chooses the sentences with :mod:`labkit.verdict`,
which sits above both. The results carry ``describe()``: the text a notebook prints.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from torch import nn

from labkit import formulas, hardware, profiling, verdict
from labkit.config import ModelConfig
from labkit.roofline import Ceiling
from labkit.timing import Timer
from labkit.train import DTYPES, Batch, History, autocast

__all__ = ["StepRoof", "Throughput", "figures_table", "flops_text", "of_run", "pct", "step_roof"]

CONVENTIONS = ("full", "causal")


def flops_text(v: float) -> str:
    """FLOP/s with its unit: TFLOP/s from 10¹², else GFLOP/s."""
    return f"{v / 1e12:.1f} TFLOP/s" if v >= 1e12 else f"{v / 1e9:.2f} GFLOP/s"


def pct(x: float) -> str:
    """A share in %: two significant figures below 10%, so that 0.3% does not print as 0%."""
    return f"{100 * x:.2g}%" if x < 0.0995 else f"{x:.0%}"


def figures_table(rows: list[tuple[str, str, str]]) -> str:
    """A summary of figures as text, one per line: name, value, and how it was obtained."""
    return "\n".join(f"{name:<38}{value:>28}   {how}" for name, value, how in rows)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return hardware.cpu_info().model_name


@dataclass(frozen=True)
class Throughput:
    """A recorded run's throughput (measured), FLOPs per token (predicted) and MFU."""

    history: History
    n_flop: int
    """Parameters the FLOP count uses: the position table excluded (a lookup, no FLOPs)."""
    flops_per_token_by: dict[str, float]
    """FLOPs per token by attention convention: "full" (all s×s scores), "causal" (half)."""
    skip: int
    """Warm-up steps left out of the throughput."""
    tokens_per_step: int
    device_type: str
    peak: hardware.Peak

    @property
    def flops_per_token(self) -> float:
        """nanoGPT's convention (all s×s scores), used unless another is named."""
        return self.flops_per_token_by["full"]

    @property
    def tokens_per_s(self) -> float:
        return self.history.tokens_per_s(skip=self.skip)

    @property
    def iteration_tokens_per_s(self) -> float:
        return self.history.iteration_tokens_per_s(skip=self.skip)

    @property
    def achieved(self) -> float:
        """Model FLOP/s: tokens/s × FLOPs per token."""
        return self.tokens_per_s * self.flops_per_token

    @property
    def data_share(self) -> float:
        """The share of the iteration time spent waiting for the batches."""
        h, s = self.history, self.skip
        return sum(h.data_seconds[s:]) / sum(h.iteration_seconds[s:])

    @property
    def mean_step_s(self) -> float:
        """The mean steady step the throughput used."""
        return self.tokens_per_step / self.tokens_per_s

    def mfu_text(self) -> str:
        """MFU, or N/A when no published peak is known."""
        if not self.peak.known:
            return "N/A (no published peak)"
        return f"{self.achieved / self.peak.flops_per_s:.1%}"

    def describe(self) -> str:
        fpt, cuda = self.flops_per_token_by, self.device_type == "cuda"
        lines = [
            f"predicted: {fpt['full'] / 1e6:.3f} MFLOP per token (6N + 12·L·h·s, all s×s "
            f"scores), {fpt['causal'] / 1e6:.3f} (6N + 6·L·h·s, the causal half); "
            f"N = {self.n_flop:,} (position table excluded)",
            f"measured:  {self.tokens_per_s:,.0f} tokens/s over the timed steps -> "
            f"{flops_text(self.achieved)} of model work, over",
            "           " + verdict.summarize(self.history.seconds[self.skip:],
                                              "training steps").line(),
        ]
        drawn = ("the batches drawn and pinned one step ahead on a helper thread" if cuda
                 else "the batches drawn")
        lines.append(f"measured:  {self.iteration_tokens_per_s:,.0f} tokens/s over whole "
                     f"iterations ({drawn}, then the step); waiting for the batches took "
                     f"{self.data_share:.1%} of the iteration time")
        if cuda:
            # https://docs.pytorch.org/tutorials/intermediate/pinmem_nonblock.html
            lines.append("           train.train pins the next step's batches while this step "
                         "runs, as a DataLoader's pin_memory\n           thread does, so the "
                         "wait above is what pinning did not hide; the non_blocking copy from\n"
                         "           pinned memory is queued on the GPU's stream (PyTorch "
                         "tutorial on pin_memory and non_blocking).")
        lines.append(str(self.peak))
        if self.peak.known:
            lines.append(str(verdict.share(
                self.achieved, self.peak.flops_per_s, part_name="MFU: training's model FLOP/s",
                whole_name=f"the published {self.peak.dtype} peak", fmt=flops_text,
                if_over="this device's peak is not the one in the table, or the FLOP count is "
                        "wrong")))  # fmt: skip
            mfus = {c: formulas.mfu(self.tokens_per_s, f, self.peak.flops_per_s)
                    for c, f in fpt.items()}
            lines.append(f"MFU by convention: {mfus['full']:.1%} counting all s×s scores "
                         f"(nanoGPT, PaLM), {mfus['causal']:.1%} counting the causal half: the "
                         f"same run, {mfus['full'] / mfus['causal']:.3f}x apart")
        else:
            lines.append("MFU: not computed, because no published peak is known for this "
                         "device (see above).")
        return "\n".join(lines)

    def describe_warmup(self) -> str:
        """Why the first ``skip`` steps are left out: step 1 against the steady median."""
        h, skip = self.history, self.skip
        steady = statistics.median(h.seconds[skip:])
        head = ", ".join(f"{s * 1e3:.1f}" for s in h.seconds[:5])
        first_ratio = h.seconds[0] / steady
        all_in = h.tokens_per_s(skip=0)
        lines = [
            f"measured step times: steps 1-5: {head} ms; steady median (steps {skip + 1}-"
            f"{len(h.seconds)}): {steady * 1e3:.1f} ms",
            f"step 1 took {first_ratio:.1f}x the steady median; counting the first {skip} steps "
            f"too would give {all_in:,.0f} tokens/s instead of {self.tokens_per_s:,.0f} "
            f"({all_in / self.tokens_per_s:.3f}x)",
        ]
        if first_ratio >= 1.5:
            lines.append("The first step's one-off costs stand out here (1.5x the steady median "
                         "or more); leaving the warm-up out keeps them out of the steady-state "
                         "figure.")
        else:
            lines.append("The first step's one-off costs do not stand out here (under 1.5x the "
                         "steady median): on this device they are small next to the noise of "
                         "the steady steps.")
        return "\n".join(lines)

    def describe_ceiling(self, ceiling: Ceiling) -> str:
        """The run's model FLOP/s as a share of a measured matmul ceiling (not MFU)."""
        return "\n".join([
            f"measured ceiling: {ceiling}",
            str(verdict.share(self.achieved, ceiling.value, part_name="training's model FLOP/s",
                              whole_name="the measured matmul ceiling", fmt=flops_text,
                              if_over="the ceiling measurement was disturbed (other work held "
                                      "the cores while it ran)")),
            "(measured / measured: not MFU)",
        ])


def of_run(history: History, model_cfg: ModelConfig, *, n_flop: int, skip: int,
           tokens_per_step: int, device: torch.device, dtype: str) -> Throughput:
    """The throughput of a recorded run; the peak looked up for ``device`` in ``dtype``."""
    fpt = {convention: formulas.flops_per_token(
        n_params=n_flop, n_layer=model_cfg.n_layer, d_model=model_cfg.d_model,
        seq_len=model_cfg.seq_len, attention=convention) for convention in CONVENTIONS}
    peak = hardware.peak_flops(_device_name(device), DTYPES[dtype])
    return Throughput(history=history, n_flop=n_flop, flops_per_token_by=fpt, skip=skip,
                      tokens_per_step=tokens_per_step, device_type=device.type, peak=peak)


PHASES = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class StepRoof:
    """One step's phases: predicted at the compute roof, measured, and profiled."""

    run: Throughput
    ceiling: Ceiling
    roof_s: dict[str, float]
    """Predicted seconds of the forward and backward at the ceiling (optimizer not modelled)."""
    measured_s: dict[str, float]
    """Measured seconds of each phase: the best of the rounds after the first."""
    where: profiling.Attribution

    @property
    def step_flops(self) -> float:
        return self.run.flops_per_token * self.run.tokens_per_step

    @property
    def roof_step_s(self) -> float:
        return sum(self.roof_s.values())

    @property
    def at_roof(self) -> float:
        """The share of the mean steady step the model's FLOPs would fill at the ceiling."""
        return self.roof_step_s / self.run.mean_step_s

    def describe(self) -> str:
        m, roof, run = self.measured_s, self.roof_s, self.run
        phase_sum = sum(m.values())
        lines = [f"{'phase':<11}{'predicted (roof)':>17}{'measured (best of 3)':>22}"
                 f"{'share of time':>15}"]
        for phase in PHASES:
            roof_text = (f"{roof[phase] * 1e3:>14.3f} ms" if phase in roof
                         else f"{'not modelled':>17}")
            lines.append(f"{phase:<11}{roof_text}{m[phase] * 1e3:>19.3f} ms"
                         f"{m[phase] / phase_sum:>15.0%}")
        lines.append(f"{'step':<11}{self.roof_step_s * 1e3:>14.3f} ms{phase_sum * 1e3:>19.3f} ms"
                     f"   (mean steady step of the training run: {run.mean_step_s * 1e3:.3f} ms, "
                     "measured)")
        lines.append(f"\nAt the measured matmul rate the model's FLOPs would fill "
                     f"{pct(self.at_roof)} of the step; the rest ran below that rate. Where it "
                     "went, measured by the profiler on the same step:")
        lines.append(self.where.table())
        # The linear layers' FLOPs (6 per weight per token, the head included; attention's two
        # matmuls run inside SDPA, counted there) over the time the matmul operators took.
        matmul_rate = 6 * run.n_flop * run.tokens_per_step / self.where.seconds["matmul"]
        lines.append(str(verdict.share(
            matmul_rate, self.ceiling.value, part_name="the matmul operators' FLOP/s",
            whole_name="the ceiling measured for these shapes", fmt=flops_text,
            if_over="the ceiling was measured while this machine was busier")))
        lines.append(f"the matmul operators took {pct(self.where.share('matmul'))} of the "
                     "profiled step; the rest is time the compute roof does not count")
        slowest = max(("forward", "backward"), key=lambda p: m[p] / roof[p])
        lines.append(f"measured/predicted: forward {m['forward'] / roof['forward']:.1f}x, "
                     f"backward {m['backward'] / roof['backward']:.1f}x the roof; the optimizer "
                     f"{pct(m['optimizer'] / phase_sum)} of the phases' time, not modelled "
                     "(memory-bound: bytes moved ÷ bandwidth). "
                     f"Furthest from its roof: the {slowest}.")
        if run.peak.known:
            # MFU = (ceiling / peak) × (roof step / measured step), exactly: F / (peak · t_step).
            lines.append(f"MFU {run.achieved / run.peak.flops_per_s:.1%} = "
                         f"{pct(self.ceiling.value / run.peak.flops_per_s)} (these matmul "
                         f"shapes' ceiling against the published peak) × {pct(self.at_roof)} "
                         "(the step's time that the FLOPs would fill at that ceiling)")
        elif run.device_type == "cpu":
            reference = hardware.peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16)
            if reference.known:
                f = self.step_flops
                lines.append(
                    f"\nmodelled, not measured: this step's {f:.3g} FLOPs at the published "
                    f"bf16 peak of an {reference.matched} ({flops_text(reference.flops_per_s)}) "
                    f"would take {f / reference.flops_per_s * 1e6:.2f} µs: a compute-only "
                    "lower bound, which counts no memory traffic, no kernel launches and no "
                    "optimizer (this CPU's measured step is "
                    f"{run.mean_step_s * reference.flops_per_s / f:,.0f}x longer). How close a "
                    "GPU would come is not measured here.")
        return "\n".join(lines)


def step_roof(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, *,
              run: Throughput, ceiling: Ceiling, device: torch.device, dtype: str,
              rounds: int = 4, profiled_steps: int = 3) -> StepRoof:
    """Time each phase of a real step ``rounds`` times (the first warms up and is left out; the
    best of the others counts), predict the forward and backward at ``ceiling`` (a third and
    two thirds of the step's FLOPs), and profile ``profiled_steps`` whole steps."""
    xb, yb = (v.to(device) for v in batch)
    step_flops = run.flops_per_token * run.tokens_per_step
    roof_s = {"forward": step_flops / 3 / ceiling.value,
              "backward": 2 * step_flops / 3 / ceiling.value}
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for _ in range(rounds):
        with Timer(device) as forward_timer, autocast(device, dtype):
            _, loss = model(xb, yb)
        with Timer(device) as backward_timer:
            loss.backward()
        with Timer(device) as optimizer_timer:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for phase, timer in zip(PHASES, (forward_timer, backward_timer, optimizer_timer),
                                strict=True):
            times[phase].append(timer.elapsed_s)
    measured = {phase: min(v[1:]) for phase, v in times.items()}

    def whole_step() -> None:
        with autocast(device, dtype):
            _, loss = model(xb, yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    profiling.quiet_kineto()  # the profiler's C++ core would print a line at every start and stop
    where = profiling.attribute_step(whole_step, device=device, steps=profiled_steps)
    return StepRoof(run=run, ceiling=ceiling, roof_s=roof_s, measured_s=measured, where=where)

