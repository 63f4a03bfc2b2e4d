"""A profiled training step, read out: its phases, FLOPs, the profiler's cost and its memory,
each held against its prediction, in the sentences notebook 06 prints.

Separate from the measuring (``capture``, ``trace``, ``memory_timeline``): this module only
reads their results, so a notebook cell is the measurement and one ``print(x.describe())``.
Every verdict here is chosen by the numbers it is given (``labkit.verdict`` where two measured
samples are compared, ``judge_prediction`` where one predicted value meets repeated
measurements), never written in advance.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from labkit import formulas, verdict
from labkit.jobs import procs
from labkit.op_kinds import ATTENTION, MATMUL, is_matmul, kind_of
from labkit.profiling.capture import Overhead, counted_flops, judge_prediction, net_bytes
from labkit.profiling.memory_timeline import ForwardRise, MemoryTimeline
from labkit.profiling.phases import PHASES
from labkit.profiling.trace import Trace

MiB = 2**20

_GPU_TIER = (
    "This tier shows GPU profiles for real: kernels on CUDA streams, device memory from the "
    "caching allocator's history, NVTX ranges through torch.cuda.nvtx, and Nsight Systems and "
    "Nsight Compute where they are installed. Section 4's job runs one rank per GPU over NCCL "
    "when there are enough GPUs, else on CPU ranks over gloo.")  # fmt: skip
_CPU_TIER = (
    "This tier profiles everything on host threads and host memory, for real: the PyTorch "
    "profiler's CPU operators, gloo's communication threads, the CPU allocator's memory events. "
    "It cannot show GPU kernels, CUDA streams, device memory or host-device synchronisation, and "
    "Nsight Systems and Nsight Compute need a GPU: their cells print the exact command and why "
    "it did not run. No GPU figure is invented: the GPU evidence here is recorded elsewhere and "
    "labelled so (a GPU's step time in section 1, a public trace of a 128-GPU job in section "
    "4).")  # fmt: skip


def tier_note(on_gpu: bool) -> str:
    """What profiling can show on this tier (a GPU, or host threads only), and what it cannot."""
    return _GPU_TIER if on_gpu else _CPU_TIER


def run_folder() -> Path:
    """A new folder name for this run's traces and reports: LABKIT_HOME/profiling/<time>."""
    return procs.labkit_home() / "profiling" / time.strftime("%Y%m%d-%H%M%S")


# --- section 1: the phases and the FLOPs -----------------------------------------------------

# Matmuls and attention (SDPA's fused kernel), by labkit.op_kinds: the work that compilation
# leaves to library kernels
CORE_KINDS = (MATMUL, ATTENTION)


@dataclass(frozen=True)
class PhaseSplit:
    """A profiled step's phases per step (seconds, measured) and the FLOP model's two claims
    held against them: backward ≈ 2 × forward (against the steps' own spread of the ratio), and
    matmuls and attention hold the time (more than half of it)."""

    phase_s: Mapping[str, Sequence[float]]
    step_ms: float
    """Median ``ProfilerStep`` range, ms."""
    core_share: float
    """Self time of matmuls and attention over the steps' wall time."""

    @property
    def ratios(self) -> list[float]:
        """backward / forward time, one per step."""
        return [b / f for b, f in zip(self.phase_s["backward"], self.phase_s["forward"],
                                      strict=True)]  # fmt: skip

    @property
    def bwd_fwd(self) -> float:
        return statistics.median(self.ratios)

    @property
    def optimizer_share(self) -> float:
        return statistics.median(self.phase_s["optimizer"]) / (self.step_ms / 1e3)

    def describe(self) -> str:
        lines = []
        for name, values in self.phase_s.items():
            lines.append(f"  {name:<10} median {statistics.median(values) * 1e3:7.2f} ms per "
                         f"step (min {min(values) * 1e3:.2f}, max {max(values) * 1e3:.2f}; "
                         "measured)")  # fmt: skip
        ratios, bwd_fwd, core = self.ratios, self.bwd_fwd, self.core_share
        lines.append(f"measured under the profiler: backward / forward = {bwd_fwd:.2f} (median "
                     f"of {len(ratios)} steps, {min(ratios):.2f} to {max(ratios):.2f}); "
                     "predicted 2.0 from FLOPs")  # fmt: skip
        lines.append(f"measured: matmuls (aten::addmm, mm, bmm) and attention (SDPA) take "
                     f"{core:.0%} of the steps' wall time; the optimizer phase takes "
                     f"{self.optimizer_share:.0%} of a {self.step_ms:.1f} ms step")  # fmt: skip
        # Each clause is chosen by what this run measured: the ratio against 2 by the steps'
        # own spread (their lowest and highest ratio, printed above), the share against half.
        lo, hi = min(ratios), max(ratios)
        consistent = lo <= 2 <= hi
        if consistent:
            ratio = (f"2.0 lies within the steps' own spread ({lo:.2f} to {hi:.2f}): the split is "
                     "consistent with the FLOP ratio. ")  # fmt: skip
        else:
            side, edge = ("above", f"lowest {lo:.2f}") if lo > 2 else ("below", f"highest {hi:.2f}")
            ratio = (f"Every step's ratio lies {side} 2.0 ({edge}): the split differs from the FLOP "
                     "ratio by more than the steps' own spread. ")  # fmt: skip
        if core > 0.5:
            share = (f"Matmuls and attention hold more than half of the time ({core:.0%}), as a "
                     "FLOP model assumes.")  # fmt: skip
        else:
            share = (f"{'But m' if consistent else 'M'}atmuls and attention hold only {core:.0%} "
                     f"of the time: the other {1 - core:.0%} is work a FLOP count does not "
                     "describe (other operators, and the time between them)"
                     + (", so a ratio near 2 does not show here that the FLOPs set the split."
                        if consistent else "."))  # fmt: skip
        lines.append(ratio + share)
        return "\n".join(lines)


def phase_split(trace: Trace, averages: Any, *, on_gpu: bool) -> PhaseSplit:
    """Read a recorded step's phases from ``trace`` and the share of matmuls and attention from
    the profiler's ``averages`` (``prof.key_averages()``)."""
    phase_s = trace.phase_seconds(PHASES)
    step_wall_us = sum(s.dur_us for s in trace.steps)
    # Share of the steps' wall time (not of the summed self time: on a GPU that sum leaves out
    # the idle gaps between kernels, which are exactly what launch overhead costs).
    core = sum((e.self_device_time_total if on_gpu else e.self_cpu_time_total)
               for e in averages if kind_of(e.key) in CORE_KINDS) / step_wall_us  # fmt: skip
    step_ms = statistics.median(s.dur_us for s in trace.steps) / 1e3
    return PhaseSplit({n: list(phase_s[n]) for n in PHASES}, step_ms, core)


@dataclass(frozen=True)
class FlopCheck:
    """The profiler's own FLOP count per step (``with_flops``) against two predictions: 6 per
    linear weight per token for the matmuls, and the step's formula 6N + 12·L·d·s per token."""

    flops_by_op: Mapping[str, float]
    n_linear: int
    """Weights of the model's ``nn.Linear`` layers (no biases)."""
    n_flop: int
    """N of the formula: parameters without the position embedding."""
    tokens: int
    per_token: float
    attention: float
    """12·L·d·s per token × tokens: the attention FLOPs no operator reports."""

    @property
    def counted_mm(self) -> float:
        """The counted FLOPs of the matmuls (``labkit.op_kinds.is_matmul``)."""
        return sum(v for k, v in self.flops_by_op.items() if is_matmul(k))

    @property
    def predicted_mm(self) -> int:
        return 6 * self.n_linear * self.tokens

    def describe(self) -> str:
        counted, predicted = self.counted_mm, self.predicted_mm
        formula = self.per_token * self.tokens
        lines = ["counted by the profiler per step (with_flops, measured shapes): "
                 + ", ".join(f"{k} {v / 1e6:,.1f} MFLOP" for k, v in sorted(self.flops_by_op.items())),
                 f"predicted: matmuls 6 × {self.n_linear:,} linear weights × {self.tokens} tokens "
                 f"= {predicted / 1e6:,.3f} MFLOP; counted {counted / 1e6:,.3f} MFLOP "
                 f"(counted / predicted = {counted / predicted:.4f})"]  # fmt: skip
        if counted == predicted:
            lines.append("verdict: equal, to the FLOP: the profiler's matmul count is 6 per "
                         "weight per token.")  # fmt: skip
        else:
            lines.append(f"verdict: they differ by {abs(counted - predicted) / predicted:.2%}: "
                         "some matmul ran outside the linear layers (or autocast changed the "
                         "calls): read the table's KFLOPs column by shape (group_by_input_shape) "
                         "to find which.")  # fmt: skip
        others = self.n_flop - self.n_linear
        lines.append(
            f"against the formula of cell 5 ({formula / 1e6:,.1f} MFLOP per step) the profiler "
            f"counted {sum(self.flops_by_op.values()) / formula:.0%}: it leaves out attention's "
            f"12·L·d·s ({self.attention / 1e6:,.1f} MFLOP, {self.attention / formula:.0%}) and "
            f"the {others:,} bias and layer-norm parameters' 6 per token "
            f"({6 * others * self.tokens / 1e6:,.1f} MFLOP); its elementwise add is "
            f"{self.flops_by_op.get('aten::add', 0) / 1e6:,.2f} MFLOP. An MFU computed from "
            "with_flops understates the work by the attention share, which grows with the "
            "sequence length.")
        return "\n".join(lines)


def flop_check(averages: Any, model: torch.nn.Module, *, tokens: int, steps: int) -> FlopCheck:
    """The profiler's FLOP columns (``averages`` of ``steps`` recorded steps, ``tokens`` per
    step) beside the counts ``model``'s shapes predict."""
    cfg = model.cfg
    n_flop = model.num_params(exclude_position_embedding=True)
    n_linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    per_token = formulas.flops_per_token(n_flop, cfg.n_layer, cfg.d_model, cfg.seq_len)
    attention = 12 * cfg.n_layer * cfg.d_model * cfg.seq_len * tokens
    return FlopCheck(counted_flops(averages, steps=steps), n_linear, n_flop, tokens, per_token,
                     attention)


# --- section 2: the cost of looking ----------------------------------------------------------

# What each outcome of judge_prediction means for the overhead predicted from a per-operator rate
_RATE_VERDICTS = {
    "negative": "verdict: the profiled blocks ran no slower than the unprofiled ones, which the "
                "profiler cannot cause: the machine's noise is larger than the overhead here; "
                "rerun on a quieter machine.",
    "agree": "verdict: the measured overhead lies within 50% of the prediction: the cost follows "
             "the operators, not the FLOPs.",
    "above": "verdict: the wide model paid more than the operator count predicts: part of the "
             "overhead grows with the work (or the machine was busier during its rounds).",
    "below": "verdict: the wide model paid less than the operator count predicts: the rate "
             "measured above was inflated by noise, or part of its cost hides here.",
    "noisy": "verdict: too noisy to tell on this machine right now: the overhead's spread is "
             "wider than the tolerance (or the rate above could not be measured).",
}  # fmt: skip


@dataclass(frozen=True)
class OverheadRate:
    """An overhead predicted from a per-operator rate, held against the overhead measured on
    another model (``judge_prediction``, 50% tolerance)."""

    rate_s: float
    ops_per_step: float
    measured_s: Sequence[float]
    """Overhead per round (``Overhead.per_round("on")``), seconds per step."""
    model_note: str

    @property
    def predicted_s(self) -> float:
        return self.rate_s * self.ops_per_step

    @property
    def outcome(self) -> str:
        """judge_prediction's word, or "negative" when the median overhead is not positive."""
        if statistics.median(self.measured_s) <= 0:  # a profiled block faster than a plain one
            return "negative"
        return judge_prediction(self.predicted_s, self.measured_s, tolerance=0.5)

    def describe(self) -> str:
        return "\n".join([
            self.model_note,
            f"predicted overhead: {self.rate_s * 1e6:.1f} µs × {self.ops_per_step:,.0f} operators"
            f" = {self.predicted_s * 1e3:.2f} ms per step",
            verdict.summarize(self.measured_s, "measured overhead, per round").line(),
            _RATE_VERDICTS[self.outcome]])  # fmt: skip


@dataclass(frozen=True)
class OverheadReport:
    """The profiler's cost per setting, as a table (median step, slowdown, per operator, the
    one-off cost of stopping) and the verdicts that say which differences are real."""

    overhead: Overhead
    ops_per_step: float
    step_ms: float
    """Section 1's profiled step, ms (with record_shapes on)."""

    @property
    def cost(self) -> verdict.Comparison:
        """Profiler off against on."""
        return verdict.compare_times(self.overhead.step_s["off"], self.overhead.step_s["on"],
                                     names=("profiler off", "profiler on"))  # fmt: skip

    @property
    def rate_s(self) -> float:
        """Seconds of overhead per operator, plain profiler."""
        return (self.overhead.median("on") - self.overhead.median("off")) / self.ops_per_step

    def table(self) -> str:
        o = self.overhead
        off = o.median("off")
        lines = [f"{'profiler':<22}{'median step':>12}{'slowdown':>10}{'per operator':>14}"
                 f"{'stopping (once)':>17}"]  # fmt: skip
        for mode in o.step_s:
            med = o.median(mode)
            per_op = (med - off) / self.ops_per_step * 1e6
            stop = f"{statistics.median(o.stop_s[mode]) * 1e3:.0f} ms" if o.stop_s[mode] else ""
            lines.append(f"{mode:<22}{med * 1e3:>9.2f} ms{med / off:>9.2f}×"
                         f"{'' if mode == 'off' else f'{per_op:>10.1f} µs':>14}{stop:>17}")
        return "\n".join(lines)

    def describe(self) -> str:
        cost = self.cost
        lines = ["", self.table(), f"(measured: {self.overhead.method})",
                 f"(section 1's step, profiled with record_shapes on, took {self.step_ms:.1f} ms)",
                 str(cost)]  # fmt: skip
        if cost.outcome == "faster" and cost.faster.name == "profiler off":
            lines.append(f"So recording costs about {self.rate_s * 1e6:.1f} µs per operator "
                         "here: the rate tested on a second model below.")  # fmt: skip
        else:
            lines.append("So this run cannot put a number on the overhead per operator: the "
                         "machine's own noise is as large. Rerun the cell on a quieter machine.")
        # the prediction's second half: stacks and memory cost more than the plain profiler
        for extra in ("on + with_stack", "on + memory + shapes"):
            if extra not in self.overhead.step_s:
                continue
            more = verdict.compare_times(self.overhead.step_s["on"], self.overhead.step_s[extra],
                                         names=("profiler on", extra))  # fmt: skip
            lines += ["", str(more), _more_sentence(more, extra)]
        return "\n".join(lines)

    def predict(self, overhead: Overhead, *, ops_per_step: float, model: Any) -> OverheadRate:
        """This run's rate applied to another ``model``'s operator count, against the overhead
        ``overhead`` measured on it (its "off" and "on" settings)."""
        note = (f"wide model: d_model {model.cfg.d_model}, {model.num_params():,} parameters; "
                f"{ops_per_step:,.0f} CPU operators per step (counted), step "
                f"{overhead.median('off') * 1e3:.2f} ms with the profiler off (measured)")
        return OverheadRate(self.rate_s, ops_per_step, overhead.per_round("on"), note)


def _more_sentence(more: verdict.Comparison, extra: str) -> str:
    if more.outcome == "faster" and more.faster.name == "profiler on":
        return f"As predicted: {extra} costs more than the plain profiler."
    if more.outcome == "faster":
        return (f"Not as predicted: {extra} came out faster than the plain profiler, which does "
                "the same recording and more; the machine's noise moved these samples further "
                "than the extra work did. Rerun the cell before trusting either number.")
    if more.outcome == "agree":
        return (f"Not as predicted: {extra} cost no more than the plain profiler at this size, "
                "within 10%; its extra work is too small here to measure.")
    return f"This run cannot tell whether {extra} costs more: rerun on a quieter machine."


def judge_overhead(overhead: Overhead, *, ops_per_step: float, step_ms: float) -> OverheadReport:
    """``overhead`` (``profiler_overhead``) read per operator of a step of ``ops_per_step``."""
    return OverheadReport(overhead, ops_per_step, step_ms)


# --- section 3: memory -----------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPrediction:
    """A step's memory predicted by a memory model: the floor (parameters and AdamW's moments),
    the gradients, and what the forward adds (activations and, in low precision, weight
    copies)."""

    floor_bytes: int
    grad_bytes: int
    per_sequence_bytes: int
    weight_copy_bytes: int
    micro_batch: int
    dtype: str

    @property
    def rise_bytes(self) -> int:
        """What the forward adds: the weight copies and the saved activations."""
        return self.weight_copy_bytes + self.per_sequence_bytes * self.micro_batch

    def describe(self) -> str:
        copies = (f" + {self.weight_copy_bytes / MiB:.2f} MiB of {self.dtype} weight copies"
                  if self.weight_copy_bytes else "")
        return (f"predicted: a floor of {self.floor_bytes / MiB:.2f} MiB (parameters and AdamW's "
                f"moments); gradients add {self.grad_bytes / MiB:.2f} MiB during the backward\n"
                f"predicted: the forward adds {self.rise_bytes / MiB:.2f} MiB in {self.dtype} "
                f"({self.per_sequence_bytes / MiB:.3f} MiB per sequence × {self.micro_batch}"
                f"{copies})")  # fmt: skip

    def against(self, timeline: MemoryTimeline, rise: ForwardRise, *,
                on_gpu: bool) -> MemoryCheck:
        """This prediction beside a recorded ``timeline`` and its forward ``rise``."""
        return MemoryCheck(timeline, rise, self, on_gpu)


def predict_memory(memory_model: Any, model: torch.nn.Module, *, micro_batch: int,
                   dtype: str) -> MemoryPrediction:
    """``memory_model`` (``batching.finder.predict_max_batch``'s: model state, bytes per
    sequence, weight copies) for ``model`` at ``micro_batch``."""
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # the weight copies (fixed_activation_bytes) are zero in float32
    return MemoryPrediction(memory_model.model_state_bytes - grad_bytes, grad_bytes,
                            memory_model.bytes_per_sequence, memory_model.fixed_activation_bytes,
                            micro_batch, dtype)  # fmt: skip


@dataclass(frozen=True)
class MemoryCheck:
    """A recorded memory timeline beside the prediction: the floor and the forward's rise."""

    timeline: MemoryTimeline
    rise: ForwardRise
    predicted: MemoryPrediction
    on_gpu: bool

    def describe(self) -> str:
        base = self.timeline.baseline_bytes / MiB
        if self.on_gpu:  # the allocator's count at the step's start: a measurement of the floor
            floor = (f"measured at the start of a step: {base:.2f} MiB allocated (predicted "
                     f"floor {self.predicted.floor_bytes / MiB:.2f} MiB)")
        else:  # on a CPU it is the size of the tensors the prediction sums: a count, not a check
            floor = (f"counted at the start of a step: {base:.2f} MiB in the parameters and "
                     "AdamW's moments (the sizes of the tensors the prediction sums: a count, not "
                     "a check of it)")  # fmt: skip
        return "\n".join([
            self.timeline.summary(), floor,
            f"measured: the forward added {self.rise.measured_bytes / MiB:.2f} MiB; predicted "
            f"{self.predicted.rise_bytes / MiB:.2f} MiB (measured / predicted = "
            f"{self.rise.ratio:.2f})"])  # fmt: skip


@dataclass(frozen=True)
class NetBytesCheck:
    """Net bytes per step by phase, from a ``profile_memory`` recording's memory column
    (measured), against what each phase is predicted to keep; and the operators that
    allocated most themselves."""

    net: Mapping[str, float]
    predicted: Mapping[str, int]
    column: str
    steps: int
    top_ops: Sequence[tuple[str, float, int]]
    """(operator, self-allocated bytes per step, calls per step), largest first."""

    def describe(self) -> str:
        lines = [f"net bytes per step by phase, the {self.column} column of a profile_memory "
                 f"recording of {self.steps} steps (measured) against the prediction:"]
        for name in PHASES:
            got, want = self.net.get(name), self.predicted.get(name)
            if got is None:
                lines.append(f"  {name:<10} not recorded")
                continue
            line = f"  {name:<10} {got / MiB:+9.3f} MiB"
            if want is None:
                lines.append(line + "   (no prediction: it frees the activations and adds the "
                             "gradients)")
                continue
            if got == want:
                judged = "equal, to the byte"
            elif want and 0.75 <= got / want <= 1.25:
                judged = f"within 25% (measured / predicted = {got / want:.2f})"
            else:
                judged = (f"NOT as predicted (measured / predicted = {got / want:.2f})" if want
                          else "differs")
            lines.append(f"{line}   predicted {want / MiB:+9.3f} MiB: {judged}")
        lines += ["", f"operators by the memory they allocated themselves (Self {self.column}, "
                  "per step, measured): " + "; ".join(f"{k} {b / MiB:.2f} MiB in {n} calls"
                                                      for k, b, n in self.top_ops)]
        return "\n".join(lines)


def net_bytes_check(timeline: MemoryTimeline, predicted: MemoryPrediction, model: torch.nn.Module,
                    *, seq_len: int, device: torch.device | str) -> NetBytesCheck:
    """The timeline's memory column per phase against ``predicted``: the batch's two int64
    tensors in ``data``, the forward's rise, the gradients freed in ``optimizer``."""
    on_gpu = torch.device(device).type == "cuda"
    steps = timeline.recorded_steps
    net = net_bytes(timeline.averages, PHASES, steps=steps, device=device)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    batch_bytes = 2 * predicted.micro_batch * seq_len * torch.tensor(0, dtype=torch.int64).element_size()
    want = {"data": batch_bytes, "forward": predicted.rise_bytes, "optimizer": -grad_bytes}
    # operators only: the columns credit an allocation to every event whose interval holds it,
    # by time alone (torch/autograd/profiler.py), so a long Python frame of another thread
    # (with_stack records them) collects the training thread's allocations too
    def self_mem(e: Any) -> int:
        return e.self_device_memory_usage if on_gpu else e.self_cpu_memory_usage

    ops = sorted((e for e in timeline.averages if e.key.startswith("aten::")), key=self_mem,
                 reverse=True)[:5]  # fmt: skip
    top = [(e.key, self_mem(e) / steps, e.count // steps) for e in ops]
    return NetBytesCheck(net, want, "CUDA Mem" if on_gpu else "CPU Mem", steps, top)
