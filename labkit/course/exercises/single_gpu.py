"""Exercise checks for notebook 01 (single-GPU training), run in the kernel.

* ``01.param_count``  ``count_params(cfg) -> int``: a GPT's parameters from its config alone;
* ``01.timed``        ``timed(fn, device) -> float``: the device time of one call, checked on a
  simulated asynchronous device (a virtual clock; nothing sleeps, nothing needs a GPU);
* ``01.adam_bytes``   ``adamw_state_bytes(n_params) -> int``: bytes of fp32 AdamW model states;
* ``01.batch_plan``   ``plan_batch(peaks, budget) -> int``: a decision from measurements, the
  largest micro-batch whose step peak fits ``budget`` bytes, from the peaks measured at two or
  more batch sizes. Checked on sets of peaks where each usual mistake (scaling the whole peak
  with the batch, a measured peak taken for the fixed part, rounding up, a measured batch)
  gives a batch of its own; the notebook then runs the plan for real with
  :func:`run_batch_plan`, the planned batch and one sequence more, and says whether it held.

Each registers with :func:`labkit.course.exercises.exercise`; importing this module does nothing else.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import numbers
import threading
import time
import timeit
from collections.abc import Callable, Iterator
from typing import Any

from labkit.config import ModelConfig
from labkit.course.exercises import ExerciseFailed, call, exercise
from labkit.course.exercises.learner_code import callable_name, require_callable, require_int

# --------------------------------------------------------------------------- references
# What later cells use while the learner's answer is not done or wrong (only exercises that
# later cells depend on have one). It calls labkit's tested formula; the exercise is to write
# it from first principles.


def reference_adamw_state_bytes(n_params: int) -> int:
    from labkit import formulas

    return int(formulas.memory_breakdown(n_params, param_dtype="float32", optimizer="adamw").total)


# --------------------------------------------------------------------------- 01.param_count

# Three shapes that differ in every dimension (and with vocab_size != seq_len, so the two
# embedding tables cannot be confused). Small: building them takes milliseconds.
PARAM_COUNT_CONFIGS = (
    ModelConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=2, d_model=64),
    ModelConfig(vocab_size=100, seq_len=32, n_layer=3, n_head=4, d_model=48),
    ModelConfig(vocab_size=512, seq_len=128, n_layer=1, n_head=1, d_model=32),
)


def _gpt_breakdown(cfg: ModelConfig) -> dict[str, int]:
    """Count labkit.model.GPT(cfg)'s parameters, in total and by kind (for diagnosing errors).

    ``model.parameters()`` yields a shared tensor once, so the tied lm_head is counted once.
    """
    import torch.nn as nn

    from labkit.model import GPT  # lazy: only this check needs a model

    model = GPT(cfg)
    kinds = {"total": 0, "linear_bias": 0, "layernorm": 0, "position": 0, "token": 0}
    seen: set[int] = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            kinds["total"] += p.numel()
            if isinstance(module, nn.LayerNorm):
                kinds["layernorm"] += p.numel()
            elif module is model.wpe:  # by identity: seq_len may equal vocab_size
                kinds["position"] += p.numel()
            elif module is model.wte:
                kinds["token"] += p.numel()
            elif name == "bias":
                kinds["linear_bias"] += p.numel()
    assert kinds["total"] == sum(p.numel() for p in model.parameters())
    return kinds


def _param_count_diagnosis(cfg: ModelConfig, kinds: dict[str, int], got: int) -> str:
    """Name the usual mistake that gives exactly ``got``, if one does."""
    h, L, V = cfg.d_model, cfg.n_layer, cfg.vocab_size
    expected = kinds["total"]
    mistakes = [
        (
            V * h,
            "you counted the output head separately, but lm_head.weight is tied to the "
            "token embedding (one tensor, counted once)",
        ),
        (
            -kinds["linear_bias"],
            "you left out the biases of the Linear layers (one per output feature of "
            "each)",
        ),
        (-kinds["linear_bias"] - kinds["layernorm"], "you left out all biases and LayerNorms"),
        (
            -kinds["layernorm"],
            "you left out the LayerNorms (weight and bias, 2h each: two per block and one final)",
        ),
        (-2 * h, "you left out the final LayerNorm (2h)"),
        (-kinds["position"], "you left out the learned position embedding (seq_len × d_model)"),
        (-kinds["token"], "you left out the token embedding (vocab_size × d_model)"),
        (
            -13 * h * L,
            "per block you counted the 12h² weights but not the 13h biases and "
            "LayerNorm parameters",
        ),
    ]
    for delta, why in mistakes:
        if delta and got == expected + delta:
            return why
    return "compare your terms with the model's modules: print(model) lists every layer"


@exercise(
    "01.param_count",
    "Count a GPT's parameters by formula",
    hints=(
        "every weight matrix, bias vector, LayerNorm and embedding table of the model is a "
        "parameter tensor; count each kind from the config and add them up",
        "outside the blocks there are two embedding tables (one row per vocabulary entry, one "
        "per position) and one final LayerNorm; the output head reuses the token table, so it "
        "adds nothing. print(GPT(cfg)) lists every layer",
        "inside one block of width h: four h×h attention projections, an MLP from h to 4h and "
        "back, a bias on every Linear, and two LayerNorms with a gain and a bias each",
        "recipe: add up, from the config alone: the token table (vocab_size rows of d_model) "
        "and the position table (seq_len rows of d_model); for each of the n_layer blocks, the "
        "entries of its four attention matrices and its two MLP matrices (rows times columns "
        "each), one bias entry per output feature of each of those six Linear layers, and a "
        "gain and a bias of d_model entries for each of its two LayerNorms; then the final "
        "LayerNorm's gain and bias; nothing for the output head, which is the token table",
    ),
)
def _verify_param_count(count_params: Any) -> str:
    fn = require_callable(count_params, "count_params(cfg: ModelConfig) -> int")
    for cfg in PARAM_COUNT_CONFIGS:
        got = require_int(call(fn, cfg), f"{callable_name(fn)}(cfg)")
        kinds = _gpt_breakdown(cfg)
        if got != kinds["total"]:
            raise ExerciseFailed(
                f"for {cfg} expected {kinds['total']:,} parameters (sum of p.numel() over "
                f"labkit.model.GPT(cfg).parameters()), got {got:,} "
                f"(off by {got - kinds['total']:+,}). Likely: "
                + _param_count_diagnosis(cfg, kinds, got)
            )
    return (
        f"count_params(cfg) equals the parameters of labkit.model.GPT(cfg) for "
        f"{len(PARAM_COUNT_CONFIGS)} configurations (tied head counted once)"
    )


class _FakeAccelerator:
    """A device that runs work asynchronously on a virtual clock (no sleeping, deterministic).

    ``launch(seconds)`` returns at once, as a CUDA kernel launch does; the work finishes
    ``seconds`` later on the device's queue. ``synchronize()`` makes the host wait until the
    queue is empty: only then does the clock show the work as done.
    """

    LAUNCH_S = 1e-6  # host-side cost of a launch

    def __init__(self) -> None:
        self.now = 1000.0  # perf_counter's origin is arbitrary; start away from zero
        self.busy_until = self.now
        self.events: list[str] = []
        self.sync_devices: list[object] = []
        self._owner = threading.get_ident()

    def launch(self, seconds: float) -> None:
        self.events.append("fn")
        self.now += self.LAUNCH_S
        self.busy_until = max(self.busy_until, self.now) + seconds

    def synchronize(self, device: object = None) -> None:
        self.events.append("sync")
        self.sync_devices.append(device)
        self.now = max(self.now, self.busy_until)

    def clock(self, real: Callable[[], float], scale: float = 1.0) -> Callable[[], float]:
        """A stand-in for the clock ``real``; other threads keep the real one."""

        def read() -> Any:
            if threading.get_ident() != self._owner:
                return real()
            self.events.append("clock")
            value = self.now * scale
            return int(value) if scale != 1.0 else value

        return read


_CLOCKS = ("perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns")


@contextlib.contextmanager
def _patched(fake: _FakeAccelerator, learner_globals: dict[str, Any]) -> Iterator[None]:
    """Route clocks and synchronize() (every name the learner may call) to ``fake``."""
    import torch

    timing = importlib.import_module("labkit.timing")
    swaps: dict[int, Any] = {}  # id(real object) -> replacement
    targets: list[tuple[Any, str]] = []
    for name in _CLOCKS:
        real = getattr(time, name)
        swaps[id(real)] = fake.clock(real, 1e9 if name.endswith("_ns") else 1.0)
        targets.append((time, name))
    swaps[id(timeit.default_timer)] = swaps[id(time.perf_counter)]
    targets.append((timeit, "default_timer"))
    for module in (timing, torch.cuda):
        swaps[id(module.synchronize)] = fake.synchronize
        targets.append((module, "synchronize"))
    # `from time import perf_counter` or `from labkit.timing import synchronize` in a notebook
    # binds the real function to a global name: swap those names too.
    originals = [(obj, name, getattr(obj, name)) for obj, name in targets]
    global_swaps = {k: v for k, v in learner_globals.items() if id(v) in swaps}
    try:
        for obj, name, real in originals:
            setattr(obj, name, swaps[id(real)])
        for name, real in global_swaps.items():
            learner_globals[name] = swaps[id(real)]
        yield
    finally:
        for obj, name, real in originals:
            setattr(obj, name, real)
        learner_globals.update(global_swaps)


TIMED_WORK_S = 0.005  # virtual duration of the operation being timed
TIMED_EARLIER_S = 0.020  # work already queued when timed() is called (from earlier cells)


@exercise(
    "01.timed",
    "Time an asynchronous operation correctly",
    hints=(
        "a GPU call returns to Python when the work is queued, not when it is done: what must "
        "be true before you read the clock at the end, and at the start?",
        "labkit.timing.synchronize(device) waits until the device has finished everything "
        "queued so far, including work earlier cells left running",
        "recipe: first make the device finish everything already queued, then read a clock "
        "that counts seconds; call fn once; make the device finish the work fn queued, then "
        "read the same clock again; return the time that passed between the two readings, in "
        "seconds",
    ),
)
def _verify_timed(timed: Any) -> str:
    import torch

    fn = require_callable(timed, "timed(fn, device) -> float")
    fake = _FakeAccelerator()
    device = torch.device("cuda", 0)  # a device object only: nothing touches CUDA
    fake.launch(TIMED_EARLIER_S)  # a previous cell's work, still running
    fake.events.clear()
    with _patched(fake, getattr(fn, "__globals__", {})):
        result = call(fn, lambda: fake.launch(TIMED_WORK_S), device)

    events = fake.events
    work_ms, earlier_ms = TIMED_WORK_S * 1e3, TIMED_EARLIER_S * 1e3
    if "fn" not in events:
        raise ExerciseFailed("timed() never called fn(); call it once between the clock reads")
    if events.count("clock") < 2:
        raise ExerciseFailed(
            "the check saw fewer than two clock reads, so it cannot tell what you timed; read "
            "time.perf_counter() before and after the operation (torch.cuda.Event timing works "
            "on a real GPU, but this check simulates the device through the clock)"
        )
    if isinstance(result, bool) or not isinstance(result, numbers.Real):
        raise ExerciseFailed(
            f"timed() returned {type(result).__name__} {result!r}; return the "
            "elapsed time in seconds as a float"
        )
    result = float(result)
    last_fn = len(events) - 1 - events[::-1].index("fn")
    last_clock = len(events) - 1 - events[::-1].index("clock")
    if "sync" not in events[last_fn:last_clock]:
        raise ExerciseFailed(
            f"timed() returned {result * 1e3:.3f} ms, but the operation takes {work_ms:g} ms on "
            "the device: you read the clock when fn() returned, which is when the work was "
            "*queued*, not when it finished (GPU execution is asynchronous). Call "
            "labkit.timing.synchronize(device) after fn() and before reading the end time"
        )
    if any(d is not None and str(d) != str(device) for d in fake.sync_devices):
        raise ExerciseFailed(
            f"synchronize() was called with {fake.sync_devices}; pass it the "
            f"device you were given ({device})"
        )
    if math.isclose(result, TIMED_WORK_S, rel_tol=0.01):
        return (
            f"timed() waits for the device before reading the clock (measured the "
            f"{work_ms:g} ms of simulated device work, not the launch)"
        )
    if "sync" not in events[: events.index("clock")]:
        raise ExerciseFailed(
            f"timed() returned {result * 1e3:.3f} ms for {work_ms:g} ms of work: it also counted "
            f"{earlier_ms:g} ms of work queued before it started. Call "
            "labkit.timing.synchronize(device) before reading the start time too"
        )
    raise ExerciseFailed(
        f"timed() returned {result:.6g} s but the operation took {TIMED_WORK_S:g} s; return "
        "end - start in seconds (perf_counter() is in seconds; divide by the number of calls "
        "if you call fn() more than once)"
    )


ADAM_BYTES_CASES = (1, 3, 124_000_000, 7_000_000_000)

# Bytes per parameter that the usual mistakes give, and what each one left out or added.
_ADAM_MISTAKES = {
    4: "that is the fp32 weights alone; what do backward and the optimizer add beside them?",
    8: "too few: you counted two kinds of fp32 tensor per parameter; training keeps more",
    12: "one kind of fp32 tensor per parameter is missing (count AdamW's state again)",
    2: "that is 16-bit weights; this exercise is fp32 training (4 bytes per number)",
}
"""Bytes per parameter that the usual mistakes give, and what each one suggests checking. The
messages diagnose without stating the answer (the bits-for-bytes mistake is caught apart)."""


@exercise(
    "01.adam_bytes",
    "Bytes of model state for fp32 AdamW training",
    hints=(
        "list the fp32 numbers that exist for each parameter while training: the weight "
        "itself, what backward adds, what the optimizer keeps",
        "what does backward leave beside each parameter, and which state does AdamW keep per "
        "parameter (the algorithm box of torch.optim.AdamW's documentation lists it)? How "
        "many bytes is one fp32 number?",
        "recipe: list the fp32 tensors that live beside each parameter through training (the "
        "weight, its gradient, and each moment AdamW keeps); count them, multiply the count by "
        "the bytes of one fp32 number, and that by n_params; return a whole number",
    ),
    reference=reference_adamw_state_bytes,
)
def _verify_adam_bytes(adamw_state_bytes: Any) -> str:
    fn = require_callable(adamw_state_bytes, "adamw_state_bytes(n_params: int) -> int")
    for n in ADAM_BYTES_CASES:
        got = require_int(call(fn, n), f"{callable_name(fn)}({n})")
        expected = 16 * n  # 4 (weights) + 4 (grads) + 4 + 4 (exp_avg, exp_avg_sq): Playbook
        if got != expected:
            per_param = got / n
            if got == 8 * expected:
                why = "that is bits; divide by 8 for bytes"
            elif per_param == round(per_param) and round(per_param) in _ADAM_MISTAKES:
                why = _ADAM_MISTAKES[round(per_param)]
            else:
                why = ("that is not the model states of fp32 AdamW training: list the fp32 "
                       "numbers kept per parameter again")  # fmt: skip
            raise ExerciseFailed(
                f"adamw_state_bytes({n:,}) returned {got:,} bytes, {per_param:g} per "
                f"parameter: {why}"
            )
    return (
        "adamw_state_bytes(n) = 16·n bytes (fp32 weights, gradients, exp_avg, exp_avg_sq) "
        f"for {len(ADAM_BYTES_CASES)} sizes up to {max(ADAM_BYTES_CASES):,} parameters"
    )


# --------------------------------------------------------------------------- 01.batch_plan


def reference_plan_batch(peaks: dict[int, int], budget: int) -> int:
    """What later cells use while the learner's answer is not done or wrong: the line through
    the measured peaks (least squares), then the largest batch whose predicted peak fits."""
    fixed, per_seq = _peak_line(peaks)
    if per_seq <= 0:
        raise ValueError(f"peaks={peaks!r}: the peak does not grow with the batch")
    # a hair of slack: an exact fit of the budget must not fall to rounding of the line's floats
    return max(0, math.floor((budget - fixed) / per_seq + 1e-9))


def _peak_line(peaks: dict[int, int]) -> tuple[float, float]:
    """(bytes that do not grow with the batch, bytes per sequence): least squares through the
    measured (batch, peak) points."""
    bs, ps = list(peaks), [float(v) for v in peaks.values()]
    mb, mp = sum(bs) / len(bs), sum(ps) / len(ps)
    per_seq = (sum((b - mb) * (p - mp) for b, p in zip(bs, ps, strict=True))
               / sum((b - mb) ** 2 for b in bs))  # fmt: skip
    return mp - per_seq * mb, per_seq


def _line(fixed: float, per_seq: float, batches: tuple[int, ...]) -> dict[int, int]:
    return {b: int(fixed + per_seq * b) for b in batches}


# (measured peaks by batch, budget, what the case stands for). Built so that each usual
# mistake gives a batch of its own: a large fixed part (parameters and AdamW's moments of a
# bigger model), three measured points, a budget nothing fits. No budget is met exactly by a
# whole batch: a least-squares line in floats may land a hair below it, and floor a batch
# lower, through no fault of the plan.
BATCH_PLAN_CASES = (
    (_line(10_110_984, 4_869_120, (16, 32)), 3 * 88_016_904,
     "the lab preset's step on a CPU (peaks measured at 16 and 32 sequences)"),
    (_line(200_000_000, 1_000_000, (4, 8)), 300_500_000,
     "a step whose parameters and optimizer state outweigh its activations"),
    (_line(50_000_000, 3_000_000, (2, 4, 8)), 50_000_000 + 3_000_000 * 10 + 900_000,
     "three measured points"),
    (_line(60_000_000, 2_500_000, (2, 6)), 60_000_000 + 2_500_000 * 7 + 1_250_000,
     "a budget that falls between two batch sizes"),
    (_line(100_000_000, 10_000_000, (1, 2)), 105_000_000,
     "a budget that not even one sequence fits"),
)


def _plan_diagnosis(peaks: dict[int, int], budget: int, got: int) -> str:
    """Name the usual mistake that gives exactly ``got``, or say what the batch does."""
    fixed, per_seq = _peak_line(peaks)
    right = reference_plan_batch(peaks, budget)
    exact = (budget - fixed) / per_seq
    small, large = min(peaks), max(peaks)
    if right == 0 and got >= 1:
        return ("not even one sequence fits: the part of the peak that does not grow with the "
                "batch already takes most of the budget, and one sequence more goes over it; "
                "return 0 when no batch fits")  # fmt: skip
    if got < 0:
        return "a batch cannot be negative: when no batch fits, return 0"
    proportional = {math.floor(budget * b / peaks[b]) for b in peaks}
    if got in proportional:
        return ("that scales the whole measured peak with the batch, as if every byte of it "
                "belonged to the sequences: part of the peak (the parameters, AdamW's moments) "
                "stays the same whatever the batch, so each extra sequence costs less than "
                "the peak divided by the batch")  # fmt: skip
    as_fixed = {math.floor((budget - peaks[b]) / per_seq) for b in peaks}
    if got in as_fixed:
        return ("that treats a measured peak itself as the part that does not grow, and adds "
                "sequences on top of it: that peak already holds its own sequences")
    if got == right + 1 and got in (math.ceil(exact), round(exact)):
        return (f"rounded up: the predicted peak of {got} sequences is over the budget; the "
                "largest batch that fits is the last whole one below the exact point")
    if got in peaks and got < right:
        return ("that is one of the measured batch sizes; the plan must predict the batches "
                "between and beyond them too")
    if got == right - 1:
        return (f"a batch of {got + 1} fits too (its predicted peak is at most the budget, "
                "which a batch may fill exactly): the largest one that fits is asked for")
    if got > right:
        over = fixed + per_seq * got - budget
        return (f"the peak predicted for {got} sequences exceeds the budget by {over:,.0f} B: "
                "predict each batch's peak from the measured ones, then keep the largest "
                "batch that fits")
    return (f"batches larger than {got} fit too: predict each batch's peak from the measured "
            f"ones (from {small} to {large} sequences here), then keep the largest that fits")


@exercise(
    "01.batch_plan",
    "Plan the largest batch that fits a memory budget, from measured step peaks",
    hints=(
        "the peak of a training step has a part that grows with the batch (what each sequence "
        "keeps: activations, logits and their gradients, token ids) and a part that does not "
        "(parameters, AdamW's moments); two measured peaks are enough to tell the two apart",
        "the measured points lie on a straight line in the batch: its slope is what one more "
        "sequence costs, and where it meets batch 0 is the part that does not grow. With more "
        "than two points, fit the line through all of them",
        "then ask, for each batch size, whether its predicted peak is at most the budget; the "
        "answer is the last whole batch that passes, which can be 0",
        "recipe: find the bytes per extra sequence from the differences between the measured "
        "peaks; subtract that many bytes per sequence from a measured peak to get the part "
        "that does not grow; take what the budget leaves after that part, divide it by the "
        "bytes per sequence, and round down to a whole batch, never below zero",
    ),
    reference=reference_plan_batch,
)
def _verify_batch_plan(plan_batch: Any) -> str:
    fn = require_callable(plan_batch, "plan_batch(peaks: dict[int, int], budget: int) -> int")
    for peaks, budget, what in BATCH_PLAN_CASES:
        shown = f"{callable_name(fn)}({peaks}, {budget:,})"
        got = require_int(call(fn, dict(peaks), budget), shown)
        if got != reference_plan_batch(peaks, budget):
            raise ExerciseFailed(f"for {what}, {shown} returned a batch of {got}: "
                                 f"{_plan_diagnosis(peaks, budget, got)}")  # fmt: skip
    return (f"{callable_name(fn)} picks the largest batch under the budget on {len(BATCH_PLAN_CASES)} "
            "sets of measured peaks (a large fixed part, three points, nothing that fits); "
            "below, your plan runs for real")


def run_batch_plan(batch: int, budget: int, measure: Callable[[int], int]) -> str:
    """Run the planned ``batch`` and one sequence more for real (``measure(b)``: the measured
    peak bytes of one training step at batch b) and return what happened, chosen by the
    measured peaks against ``budget``: the plan held, its batch did not fit, or a larger one
    fits too. Prints the measurements."""
    tried = [b for b in (batch, batch + 1) if b >= 1]
    got = {b: measure(b) for b in tried}
    for b, peak in got.items():
        side = "fits" if peak <= budget else "over"
        print(f"measured: batch {b:>4}: peak {peak:>14,} B, {side} the budget of {budget:,} B "
              f"by {abs(budget - peak):,} B")  # fmt: skip
    if batch < 0:
        return f"the plan is a batch of {batch}, which cannot run"
    if batch >= 1 and got[batch] > budget:
        return (f"the plan did not hold: a batch of {batch} does not fit (measured). Either the "
                "plan went past the line through the measured peaks, or the step does not grow "
                "on a straight line here (its peak can fall at another moment of the step for "
                "other batch sizes)")  # fmt: skip
    if got[batch + 1] <= budget:
        return (f"the plan left room: a batch of {batch + 1} fits too (measured). A plan that "
                "scales the whole peak with the batch, or counts bytes that are not alive at "
                "the peak, asks for less than fits")  # fmt: skip
    return (f"the plan held: a batch of {batch} fits and {batch + 1} does not (measured)"
            if batch else "the plan held: not even one sequence fits (measured)")
