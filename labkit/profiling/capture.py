"""Run training steps under ``torch.profiler``, and measure what profiling costs.

    from labkit.profiling import profile_steps, profiler_overhead
    run = profile_steps(step, wait=1, warmup=1, active=3, trace_dir="traces/")
    print(run.table(sort_by="self_cpu_time_total", row_limit=10))
    run.traces                         # [Path("traces/cycle0.json")]: one per active window

``step(i)`` runs training step ``i`` (its phases marked with :func:`labkit.profiling.phase`).
The profiler's schedule decides which steps are recorded (torch.profiler.schedule,
https://pytorch.org/docs/stable/profiler.html): ``wait`` steps run unrecorded, ``warmup`` steps
are recorded and thrown away (the first steps after the profiler starts carry its own setup
cost, so their timings are skewed), ``active`` steps are kept; the cycle repeats ``repeat``
times. When an active window closes, the trace is exported: that is when the file appears.

:func:`profiler_overhead` answers "what does looking cost?": it times the same step with the
profiler off, on, on with ``with_stack``, and on with ``profile_memory`` (and ``record_shapes``),
the settings interleaved
block by block so that a machine that slows down mid-run slows every setting alike.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from labkit import data, train, verdict
from labkit.config import RunConfig
from labkit.model import GPT
from labkit.timing import benchmark, synchronize
from labkit.validate import whole

Step = Callable[[int], Any]

KINETO_QUIET = "6"


def quiet_kineto() -> str:
    """Stop libkineto (the profiler's C++ core) printing a line at every profiler start and stop.

    torch 2.13's kineto logs ``USDT: ... profiler_start`` / ``profiler_stop`` at its level 5
    (``ILoggerObserver.h``: VERBOSE 0 ... ERROR 4, USDT 5), above ERROR, so only
    ``KINETO_LOG_LEVEL`` >= 6 silences them; that also hides kineto's own error lines, so it is
    a choice for a notebook's readability, made by calling this, never at import. Read when the
    profiler first starts, so calling it before then is enough. Leaves a value the user set.
    Returns the level in force."""
    return os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)


# why active=0 is refused, in its message
_NO_ACTIVE_STEP = "with active=0 the profiler never records a step, and no trace is written"


def activities(device: torch.device | str = "cpu") -> list[ProfilerActivity]:
    """CPU always; CUDA too when the steps run on a GPU."""
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])


@dataclass
class ProfiledRun:
    """What :func:`profile_steps` recorded: the profiler (its tables) and the trace files."""

    prof: profile
    traces: list[Path]
    steps_run: int
    settings: dict[str, Any] = field(default_factory=dict)

    def table(self, sort_by: str = "self_cpu_time_total", row_limit: int = 12,
              group_by_input_shape: bool = False) -> str:
        """``key_averages().table(...)``: operators totalled over the recorded steps."""
        if group_by_input_shape and not self.settings.get("record_shapes"):
            raise ValueError("group_by_input_shape needs record_shapes=True when profiling")
        averages = self.prof.key_averages(group_by_input_shape=group_by_input_shape)
        return averages.table(sort_by=sort_by, row_limit=row_limit)


def profile_steps(
    step: Step,
    *,
    wait: int = 1,
    warmup: int = 1,
    active: int = 3,
    repeat: int = 1,
    trace_dir: str | Path,
    device: torch.device | str = "cpu",
    record_shapes: bool = True,
    profile_memory: bool = False,
    with_stack: bool = False,
    with_flops: bool = False,
) -> ProfiledRun:
    """Run ``(wait + warmup + active) × repeat`` steps under the profiler; export each window.

    ``with_flops`` has the profiler count each operator's FLOPs from its input shapes
    (``key_averages()``'s ``flops``), with torch's formulas for a few operators only:
    ``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``, ``conv2d``, ``mul`` and ``add`` (torch 2.13,
    ``torch/csrc/profiler/util.cpp``, "List of supported operators"); a fused attention
    operator (``scaled_dot_product_attention``) counts none. See :func:`counted_flops`.

    Raises:
        ValueError: a schedule that would record nothing (active < 1, repeat < 1), before
            any step runs.
        RuntimeError: a window closed but its trace file is missing (never a partial run).
    """
    wait, warmup = whole("wait", wait, low=0), whole("warmup", warmup, low=0)
    active = whole("active", active, low=1, why=_NO_ACTIVE_STEP)
    repeat = whole("repeat", repeat, low=1)
    trace_dir = Path(trace_dir)
    trace_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def export(prof: profile) -> None:
        out = trace_dir / f"cycle{len(written)}.json"
        tmp = out.with_suffix(".part")  # a reader never sees a half-written file
        prof.export_chrome_trace(str(tmp))
        tmp.replace(out)
        written.append(out)

    n = (wait + warmup + active) * repeat
    sched = schedule(wait=wait, warmup=warmup, active=active, repeat=repeat)
    settings = {"wait": wait, "warmup": warmup, "active": active, "repeat": repeat,
                "record_shapes": record_shapes, "profile_memory": profile_memory,
                "with_stack": with_stack, "with_flops": with_flops}  # fmt: skip
    with profile(activities=activities(device), schedule=sched, on_trace_ready=export,
                 record_shapes=record_shapes, profile_memory=profile_memory,
                 with_stack=with_stack, with_flops=with_flops) as prof:  # fmt: skip
        for i in range(n):
            step(i)
            prof.step()
    if len(written) != repeat or not all(p.exists() for p in written):
        raise RuntimeError(f"expected {repeat} trace(s) in {trace_dir}, found {len(written)}")
    return ProfiledRun(prof, written, n, settings)


def counted_flops(averages: Any, steps: int) -> dict[str, float]:
    """FLOPs per step by operator, as the profiler counted them (``with_flops=True``).

    ``averages`` is ``prof.key_averages()`` over ``steps`` recorded steps; operators the
    profiler has no formula for are left out (they are not zero-FLOP operators: the profiler
    does not know). Raises ValueError when nothing was counted: the profile ran without
    ``with_flops``."""
    whole("steps", steps, low=1)
    counted = {e.key: e.flops / steps for e in averages if getattr(e, "flops", 0)}
    if not counted:
        raise ValueError("no operator carries a FLOP count: profile with with_flops=True "
                         "(profile_steps(..., with_flops=True))")  # fmt: skip
    return counted


MEMORY_COLUMNS = {"cpu": "cpu_memory_usage", "cuda": "device_memory_usage"}
"""``key_averages()``'s memory column per device type (``profile_memory=True``): bytes
allocated minus bytes freed while the operator or range ran, its children included (the
``self_`` columns leave the children out; torch 2.13, ``torch/autograd/profiler.py``: each
memory record inside an event's interval adds its signed size)."""


def net_bytes(averages: Any, names: Sequence[str], steps: int,
              device: torch.device | str = "cpu") -> dict[str, float]:  # fmt: skip
    """Net bytes allocated per step inside each named range or operator (allocations minus
    frees, children included), from ``key_averages()`` of a ``profile_memory=True`` recording
    of ``steps`` steps; a name that was not recorded is left out."""
    whole("steps", steps, low=1)
    column = MEMORY_COLUMNS["cuda" if torch.device(device).type == "cuda" else "cpu"]
    rows = {e.key: e for e in averages}
    return {n: getattr(rows[n], column) / steps for n in names if n in rows}


# --- the cost of looking --------------------------------------------------------------------


def judge_prediction(predicted: float, samples: Sequence[float], *, tolerance: float = 0.25,
                     min_runs: int = 5) -> str:  # fmt: skip
    """Hold one predicted value against repeated measurements of it: ``"agree"`` when the
    measured median's notch (median ± 1.57·IQR/√n, ``labkit.verdict``) lies within
    ``tolerance`` of the prediction, ``"above"`` or ``"below"`` when the notch lies wholly
    outside that band, ``"noisy"`` otherwise or with fewer than ``min_runs`` samples."""
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance={tolerance!r} is not allowed: a fraction in (0, 1)")
    summary = verdict.summarize(samples, "measured")
    if summary.n < min_runs or predicted <= 0:
        return "noisy"
    lo, hi = summary.interval
    band = predicted * (1 - tolerance), predicted * (1 + tolerance)
    if band[0] <= lo and hi <= band[1]:
        return "agree"
    if hi < band[0]:
        return "below"
    if lo > band[1]:
        return "above"
    return "noisy"

MODES: dict[str, dict[str, bool] | None] = {
    "off": None,
    "on": {},
    "on + with_stack": {"with_stack": True},
    # profile_memory needs record_shapes for its memory tables, so the two come together here
    "on + memory + shapes": {"profile_memory": True, "record_shapes": True},
}
"""Profiler settings compared by :func:`profiler_overhead` (None: no profiler)."""


@dataclass
class Overhead:
    """Step times per profiler setting (seconds, measured) and the one-off cost of stopping."""

    step_s: dict[str, list[float]]
    stop_s: dict[str, list[float]]
    device: str
    method: str
    block: int = 0
    """Steps kept per block (one block per setting and round), in ``step_s`` in round order."""

    def median(self, mode: str) -> float:
        values = sorted(self.step_s[mode])
        return values[len(values) // 2]

    def slowdown(self, mode: str) -> float:
        """Median step time with ``mode`` over the median with the profiler off."""
        return self.median(mode) / self.median("off")

    def per_round(self, mode: str) -> list[float]:
        """The overhead of ``mode`` in each round, seconds per step: the median step of its
        block minus the median step of the same round's block with the profiler off. Rounds
        interleave the settings, so a busy moment of the machine falls on both sides of each
        difference; the spread of these values is the spread of the overhead itself."""
        k = self.block
        if k < 1:
            raise ValueError("this Overhead does not record its block size: measure it with "
                             "profiler_overhead")  # fmt: skip
        on, off = self.step_s[mode], self.step_s["off"]
        return [statistics.median(on[i:i + k]) - statistics.median(off[i:i + k])
                for i in range(0, min(len(on), len(off)), k)]  # fmt: skip


def profiler_overhead(
    step: Step,
    *,
    modes: Sequence[str] = tuple(MODES),
    rounds: int = 4,
    steps_per_block: int = 3,
    device: torch.device | str = "cpu",
) -> Overhead:
    """Time ``step`` under each profiler setting in ``modes``, interleaved over ``rounds``.

    Each round runs every mode once (in reverse order on odd rounds): a block of
    ``steps_per_block`` steps inside one profiler session; the first step of a block is not
    kept (the profiler's start-up lands there). ``stop_s`` is the time to leave the
    profiler and build its table (``key_averages``), measured in the first round: paid once
    per session, not per step.
    """
    unknown = [m for m in modes if m not in MODES]
    if unknown or "off" not in modes:
        raise ValueError(f"modes={list(modes)!r}: include 'off' and choose from {list(MODES)}")
    whole("rounds", rounds, low=1)
    whole("steps_per_block", steps_per_block, low=2)
    step_s: dict[str, list[float]] = {m: [] for m in modes}
    stop_s: dict[str, list[float]] = {m: [] for m in modes}
    i = 0
    for r in range(rounds):
        for mode in (modes if r % 2 == 0 else list(reversed(modes))):
            settings = MODES[mode]
            ctx = (contextlib.nullcontext() if settings is None
                   else profile(activities=activities(device), **settings))  # fmt: skip
            ctx.__enter__()
            try:
                for k in range(steps_per_block):
                    t0 = time.perf_counter()
                    step(i)
                    synchronize(device)
                    if k:
                        step_s[mode].append(time.perf_counter() - t0)
                    i += 1
            finally:
                t0 = time.perf_counter()
                ctx.__exit__(None, None, None)
                if settings is not None and r == 0:
                    # what a learner does next: build the table. About a second each here, so
                    # once per setting: it is paid once per session, not per step.
                    ctx.key_averages()
                    stop_s[mode].append(time.perf_counter() - t0)
    return Overhead(step_s, stop_s, str(device),
                    f"{rounds} rounds × {steps_per_block - 1} kept steps per setting, interleaved; "
                    "wall time per step (time.perf_counter, synchronised)",
                    block=steps_per_block - 1)


@dataclass(frozen=True)
class CpuRankStep:
    """A step of the model CPU ranks run, timed on this process's CPU with no profiler."""

    step_s: float
    n_layer: int
    nproc: int

    def describe(self) -> str:
        return (f"One GPU and {self.nproc} ranks: the ranks run on the CPU over gloo, with the "
                f"CPU tier's {self.n_layer}-layer model (measured: {self.step_s * 1e3:.1f} ms per "
                "step on the CPU, profiler off); the GPU preset's step would take minutes on a "
                "CPU rank")  # fmt: skip


def time_cpu_step(step: Callable[..., Any], preset: RunConfig, shard: torch.Tensor, *,
                  nproc: int, steps: int = 6) -> CpuRankStep:
    """Median wall time of ``step(model, optimizer, next_batch, "float32")`` on the CPU with
    ``preset``'s model, as the CPU ranks will run it: ``labkit.timing.benchmark``, the first of
    ``steps`` a warm-up, the rest timed one by one."""
    steps = whole("steps", steps, low=2)
    model = GPT(preset.model)
    opt = train.make_optimizer(model, preset.train)
    gen = torch.Generator().manual_seed(0)
    micro, seq_len = preset.train.micro_batch, preset.model.seq_len

    def one_step() -> None:
        step(model, opt, lambda: data.get_batch(shard, micro, seq_len, gen, "cpu"),
             "float32")  # what the CPU ranks train in

    timed = benchmark(one_step, device="cpu", warmup=1, repeats=steps - 1, name="CPU rank step")
    return CpuRankStep(timed.median_s, preset.model.n_layer, nproc)
