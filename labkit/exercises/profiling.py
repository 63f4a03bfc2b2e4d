"""Notebook 06's exercises (profiling), checked in the kernel.

* ``06.annotate``: ``annotated_step(model, optimizer, next_batch, dtype) -> loss``: one
  training step whose four phases (data, forward, backward, optimizer) the profiler finds as
  ranges, in order, each holding its own work, with the forward (and only the forward) under
  autocast to ``dtype``, as ``labkit.train.train_step`` runs it. Checked by profiling three
  bf16 steps of it on the CPU, reading the exported trace with
  :func:`labkit.profiling.load_trace`, and watching the dtype each linear layer computes in.
* ``06.hidden_fraction``: ``hidden_fraction(compute, comm) -> float``: the share of
  communication time that overlaps compute, from two lists of (start, end) intervals, against
  :func:`labkit.profiling.overlap.hidden_fraction` on cases built to catch double counting.
* ``06.bottleneck``: name the phase that dominates a planted slow run's trace, and give a
  data-loader setting that fixes it; the check runs the fix and measures it beside the slow
  loader (:mod:`labkit.profiling.bottlenecks`).

Each check runs the learner's code on small, fixed inputs (a second or two on a laptop CPU)
and names the usual mistake behind a wrong answer without printing the code that fixes it.
"""

from __future__ import annotations

import functools
import itertools
import math
import numbers
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from labkit.config import ModelConfig
from labkit.exercises import ExerciseFailed, _require_callable, call, exercise, short_repr
from labkit.model import GPT
from labkit.profiling import overlap
from labkit.profiling.capture import profile_steps
from labkit.profiling.phases import PHASES
from labkit.profiling.trace import Span, load_trace

# --------------------------------------------------------------------------- references


def reference_annotated_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                             dtype: str = "float32") -> torch.Tensor:
    """The library's own step (``labkit.profiling.bottlenecks.annotated_step``)."""
    from labkit.profiling.bottlenecks import annotated_step  # imported when checked, not before

    return annotated_step(model, optimizer, next_batch, dtype)


# --------------------------------------------------------------------------- 06.annotate

ANNOTATE_CFG = ModelConfig(vocab_size=256, seq_len=16, n_layer=1, n_head=2, d_model=32)
ANNOTATE_ACTIVE = 3
# The profiled steps ask for bf16, which CPU autocast runs on any CPU (slowly without bf16
# units, which a model this small does not notice); one more step asks for float32.
ANNOTATE_DTYPE = "bfloat16"
BATCH_MARK = "labkit.next_batch"  # a range inside next_batch: where the data work happens
# What each phase must contain, recognised by operator names in the trace.
SIGNATURES: dict[str, tuple[str, Callable[[str], bool]]] = {
    "data": ("the call to next_batch()", lambda n: n == BATCH_MARK),
    "forward": ("the model's forward operators (aten::linear, ...)",
                lambda n: n in ("aten::linear", "aten::addmm", "aten::mm")),
    "backward": ("the autograd operators (…Backward0)", lambda n: "Backward" in n),
    "optimizer": ("optimizer.step()", lambda n: n.startswith("Optimizer.step")),
}


class _PrecisionWatch:
    """Which dtypes the model's linear layers computed in, and whether autocast was on while
    the backward ran, seen through hooks (the trace does not say)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.linear_out: set[torch.dtype] = set()
        self.backward_autocast: list[bool] = []
        self._handles = [m.register_forward_hook(self._forward) for m in model.modules()
                         if isinstance(m, torch.nn.Linear)]  # fmt: skip
        # A gradient hook runs inside the backward; on a CPU autograd runs it on the calling
        # thread, with the autocast state the thread had when backward() was called.
        weight = next(model.parameters())
        self._handles.append(weight.register_hook(self._backward))

    def _forward(self, _module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        self.linear_out.add(output.dtype)

    def _backward(self, _grad: torch.Tensor) -> None:
        self.backward_autocast.append(torch.is_autocast_enabled("cpu"))

    def clear(self) -> None:
        self.linear_out.clear()
        self.backward_autocast.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _annotate_trace(fn: Callable[..., Any]) -> tuple[list[Span], list[Span], GPT, list[torch.Tensor],
                                                     str | None]:  # fmt: skip
    """Profile ``fn``'s bf16 steps, then run one float32 step; the last item is what the
    precision hooks found wrong (None when nothing)."""
    torch.manual_seed(0)
    model = GPT(ANNOTATE_CFG)
    # No weight decay: with it, AdamW moves the weights even when every gradient is zero, and a
    # step that clears the gradients before optimizer.step() would look as if it trained.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    gen = torch.Generator().manual_seed(0)

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.profiler.record_function(BATCH_MARK):
            x = torch.randint(0, 256, (4, ANNOTATE_CFG.seq_len + 1), generator=gen)
            return x[:, :-1], x[:, 1:]

    watch = _PrecisionWatch(model)
    try:
        with tempfile.TemporaryDirectory(prefix="labkit-06-annotate-") as tmp:
            run = profile_steps(lambda _: call(fn, model, opt, next_batch, ANNOTATE_DTYPE),
                                wait=0, warmup=1, active=ANNOTATE_ACTIVE, trace_dir=tmp,
                                record_shapes=False)  # fmt: skip
            trace = load_trace(run.traces[0])
            steps = trace.steps
            spans = [s for s in trace.spans(tid=trace.main_tid)
                     if s.cat in ("user_annotation", "cpu_op")]  # fmt: skip
        precision = _precision_failure(watch, want=ANNOTATE_DTYPE)
        watch.clear()
        call(fn, model, opt, next_batch, "float32")
        precision = precision or _precision_failure(watch, want="float32")
    finally:
        watch.remove()
    return steps, spans, model, before, precision


def _precision_failure(watch: _PrecisionWatch, *, want: str) -> str | None:
    wanted = getattr(torch, want)
    wrong = sorted(str(d).removeprefix("torch.") for d in watch.linear_out - {wanted})
    if wrong:
        if want == "float32":
            return (f"given dtype='float32', the linear layers still computed in {wrong}: "
                    f"float32 means autocast off (labkit.train.autocast(device, 'float32') is "
                    f"a context that does nothing)")  # fmt: skip
        return (f"given dtype={want!r}, the linear layers computed in {wrong}: the forward "
                f"pass (the model's call, which computes the loss too) must run under "
                f"autocast to dtype, as train.train_step does")  # fmt: skip
    if any(watch.backward_autocast):
        return (f"given dtype={want!r}, loss.backward() ran while autocast was on: autocast "
                f"wraps the forward pass and the loss only. The backward's operators already "
                f"run in the dtype autocast chose for their forward ones (PyTorch AMP docs: "
                f"backward passes under autocast are not recommended)")  # fmt: skip
    return None


def _within(span: Span, outer: Span) -> bool:
    return span.start_us >= outer.start_us and span.end_us <= outer.end_us


def _annotate_failure(steps: list[Span], spans: list[Span]) -> str | None:
    if len(steps) != ANNOTATE_ACTIVE:
        return (f"the profiler recorded {len(steps)} steps, not {ANNOTATE_ACTIVE}: does "
                f"annotated_step return normally each time?")  # fmt: skip
    for k, step in enumerate(steps, 1):
        inside = [s for s in spans if _within(s, step) and s is not step]
        ranges = {name: [s for s in inside if s.cat == "user_annotation" and s.name == name]
                  for name in PHASES}  # fmt: skip
        named = sorted({s.name for s in inside if s.cat == "user_annotation"
                        and not s.name.startswith(("Optimizer.", "labkit.", "ProfilerStep"))})  # fmt: skip
        for name in PHASES:
            if not ranges[name]:
                other = [n for n in named if n not in PHASES]
                seen = f" (ranges found: {other})" if other else ""
                return (f"step {k}: no range called {name!r}{seen}. The check looks for exactly "
                        f"the names {list(PHASES)}, each opened with phase(name)")  # fmt: skip
            if len(ranges[name]) > 1:
                return (f"step {k}: {len(ranges[name])} ranges called {name!r}; open each phase "
                        f"once per step")  # fmt: skip
        order = sorted(PHASES, key=lambda n: ranges[n][0].start_us)
        if order != list(PHASES):
            return f"step {k}: the ranges run in the order {order}; a step runs {list(PHASES)}"
        for a, b in itertools.pairwise(PHASES):
            if ranges[a][0].end_us > ranges[b][0].start_us:
                return (f"step {k}: {a!r} is still open when {b!r} starts: the phases should "
                        f"follow each other, not nest")  # fmt: skip
        for name, (what, matches) in SIGNATURES.items():
            home = ranges[name][0]
            found = [s for s in inside if s.name != name and matches(s.name)]
            if not found:
                return f"step {k}: {what} belongs in {name!r}, but it never ran"
            if not any(_within(s, home) for s in found):
                where = [n for n in PHASES if any(_within(s, ranges[n][0]) for s in found)]
                elsewhere = f" it ran inside {where[0]!r}" if where else " it ran outside every phase"
                return f"step {k}: {what} belongs in {name!r}, but{elsewhere}"
    return None


@exercise(
    "06.annotate",
    "Annotate a training step so that the profiler sees its four phases",
    hints=(
        "a profiler shows operators; only you know which of them belong to loading data, the "
        "forward pass, the backward pass or the optimizer. A named range around each part of "
        "the step makes the trace say so, and the same name appears in every step",
        "a step is four parts in order: get a batch, compute the loss, backpropagate, update the "
        "weights. Put each inside its own `with phase(name):` block, one after the other, with "
        "the names 'data', 'forward', 'backward', 'optimizer'. The step runs in precision "
        "`dtype` the way train.train_step does: autocast around the forward pass and the loss, "
        "and nothing else",
        "the model returns (logits, loss); train.autocast(x.device, dtype) is the course's "
        "autocast (float32: off), entered around the model call inside the forward range; "
        "backward is loss.backward(), outside it; the optimizer part is optimizer.step() and "
        "then optimizer.zero_grad(set_to_none=True). Return the loss",
        "recipe: in words (the code is yours), four `with phase(name):` blocks one after the "
        "other; 'data' takes the batch from next_batch(); 'forward' enters "
        "train.autocast(x.device, dtype) in the same `with` statement and keeps the model's "
        "loss; 'backward' backpropagates that loss; 'optimizer' steps and then clears the "
        "gradients with set_to_none=True; after the last block, return the loss",
    ),
    reference=reference_annotated_step,
)
def _verify_annotate(annotated_step: Any) -> str:
    fn = _require_callable(annotated_step, "annotated_step(model, optimizer, next_batch, dtype) -> loss")
    steps, spans, model, before, precision = _annotate_trace(fn)
    failure = _annotate_failure(steps, spans) or precision
    if failure:
        raise ExerciseFailed(failure)
    if all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True)):
        raise ExerciseFailed("the ranges are right but the weights never changed: the step must "
                             "still train, and optimizer.step() needs the gradients backward "
                             "left (clear them after the step, not before)")  # fmt: skip
    grads = [p.grad for p in model.parameters() if p.grad is not None and bool(p.grad.abs().max() > 0)]
    if grads:
        raise ExerciseFailed("after the step the gradients are still there: zero them after "
                             "optimizer.step() (optimizer.zero_grad(set_to_none=True)), or the "
                             "next step adds onto them")  # fmt: skip
    return (f"the profiler found data, forward, backward and optimizer in each of "
            f"{ANNOTATE_ACTIVE} recorded steps, in order, each holding its own operators "
            f"(next_batch, aten::linear, the …Backward0 nodes, Optimizer.step); the linear "
            f"layers computed in {ANNOTATE_DTYPE} when asked for it and in float32 when asked "
            f"for float32, and the backward ran outside autocast")  # fmt: skip


# --------------------------------------------------------------------------- 06.hidden_fraction

Intervals = list[tuple[float, float]]


def _hidden_cases() -> list[tuple[str, Intervals, Intervals]]:
    cases: list[tuple[str, Intervals, Intervals]] = [
        ("communication entirely under compute", [(0, 100)], [(10, 30), (50, 60)]),
        ("communication after compute ends (nothing hidden)", [(0, 50)], [(50, 80)]),
        ("half of one all-reduce under compute", [(0, 10)], [(5, 15)]),
        ("two buckets all-reduced at once on two threads, partly under compute",
         [(0, 25)], [(10, 40), (20, 50)]),
        ("nested operators on the training thread (a parent and its child)",
         [(0, 40), (20, 35)], [(30, 60)]),
        ("no communication at all", [(0, 10)], []),
        ("compute in several pieces around the communication",
         [(0, 10), (20, 30), (40, 50)], [(5, 45)]),
    ]  # fmt: skip
    rng = random.Random(6)
    for k in range(6):
        compute = [(s := rng.randint(0, 900), s + rng.randint(1, 120)) for _ in range(rng.randint(3, 12))]
        comm = [(s := rng.randint(0, 900), s + rng.randint(1, 80)) for _ in range(rng.randint(1, 8))]
        cases.append((f"random case {k + 1} (overlapping intervals in both lists)", compute, comm))
    return cases


@functools.cache
def _hidden_expected() -> list[float]:
    return [overlap.hidden_fraction(c, m) for _, c, m in _hidden_cases()]


def _hidden_hint(got: float, want: float, compute: Intervals, comm: Intervals) -> str:
    if math.isclose(got, 1.0 - want, rel_tol=1e-9, abs_tol=1e-12):
        return (": that is the exposed share (communication with no compute beside it); return "
                "the hidden share")  # fmt: skip
    summed = sum(b - a for a, b in comm)
    if summed:
        naive = sum(max(0.0, min(b, d) - max(a, c)) for a, b in comm for c, d in compute) / summed
        if math.isclose(got, naive, rel_tol=1e-9, abs_tol=1e-12):
            return (": that is what summing the overlap of every (compute, communication) pair "
                    "gives, which counts time twice where intervals overlap each other. Merge "
                    "each list into non-overlapping intervals first")  # fmt: skip
    if got > 1:
        return (": a fraction of the communication time cannot exceed 1 (divide by the total "
                "communication time, and count time covered twice once)")  # fmt: skip
    return ""


@exercise(
    "06.hidden_fraction",
    "Measure how much of a rank's communication is hidden behind compute",
    hints=(
        "communication is hidden while some compute runs at the same time on that rank, and "
        "exposed while nothing else does: the step waits for the network. The answer is the "
        "hidden time divided by all the communication time",
        "both lists may overlap themselves: an operator and its children, or two buckets sent "
        "at once on two threads. Time covered twice must count once, so first merge each list "
        "into sorted, non-overlapping intervals",
        "merge: sort by start; extend the last merged interval while the next one starts before "
        "it ends. Then the overlap of two merged lists is the sum over pairs of "
        "max(0, min(end1, end2) - max(start1, start2)). With no communication, return 0.0",
        "recipe: m_comp, m_comm = merge(compute), merge(comm); total = sum(e - s for s, e in "
        "m_comm); hidden = sum(max(0, min(e1, e2) - max(s1, s2)) for s1, e1 in m_comp for s2, e2 "
        "in m_comm); return hidden / total if total else 0.0",
    ),
    reference=overlap.hidden_fraction,
)
def _verify_hidden_fraction(hidden_fraction: Any) -> str:
    fn = _require_callable(hidden_fraction, "hidden_fraction(compute, comm) -> float")
    cases = _hidden_cases()
    for (what, compute, comm), want in zip(cases, _hidden_expected(), strict=True):
        got = call(fn, list(compute), list(comm))
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if isinstance(got, bool) or not isinstance(got, numbers.Real):
            raise ExerciseFailed(f"hidden_fraction returned {short_repr(got)} for {what}; return "
                                 f"a float between 0 and 1")  # fmt: skip
        if not math.isclose(float(got), want, rel_tol=1e-6, abs_tol=1e-9):
            raise ExerciseFailed(
                f"{what}: compute={compute[:4]}{'…' if len(compute) > 4 else ''}, comm="
                f"{comm[:4]}{'…' if len(comm) > 4 else ''} gave {float(got):.4f}, expected "
                f"{want:.4f}{_hidden_hint(float(got), want, compute, comm)}"
            )
    return (f"hidden_fraction matches labkit's on {len(cases)} cases, among them nested "
            f"operators, two threads sending at once and no communication at all")



# --------------------------------------------------------------------------- 06.bottleneck

BOTTLENECK_CFG = ModelConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=2, d_model=64)
BOTTLENECK_BATCH = 8
BOTTLENECK_STEPS = 6
BOTTLENECK_SHRINK = 0.5
BOTTLENECK_TRIES = 5  # traces recorded, each with more loading, until 'data' is slowest
"""The learner's settings must cut the data wait per step to at most this share of the
num_workers=0 loader's, measured side by side (a worker that keeps up cuts it to near 0)."""


def reference_diagnose(trace: Any) -> tuple[str, dict[str, Any]]:
    """(the phase with the largest median time per step, loader settings that fix 'data')."""
    seconds = trace.phase_seconds(PHASES)
    worst = max(seconds, key=lambda name: statistics.median(seconds[name]))
    return worst, ({"num_workers": 1, "prefetch_factor": 4, "persistent_workers": True}
                   if worst == "data" else {})  # fmt: skip


def _loader_trace(dataset: Any, tmp: Path, name: str) -> Any:
    """A trace of a few annotated steps of a tiny GPT fed from ``dataset`` (num_workers=0)."""
    from labkit.profiling import bottlenecks

    torch.manual_seed(0)
    model = GPT(BOTTLENECK_CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    slow = bottlenecks.loader_variants("cpu")[0]
    loader = bottlenecks.make_loader(dataset, slow, batch_size=BOTTLENECK_BATCH)
    with bottlenecks.BatchStream(loader) as stream:
        run = profile_steps(lambda _: reference_annotated_step(model, opt, lambda: next(stream)),
                            wait=0, warmup=1, active=3, trace_dir=tmp / name, record_shapes=False)  # fmt: skip
    return load_trace(run.traces[0])


def _data_wait(settings: dict[str, Any], dataset: Any) -> tuple[float, float, float]:
    """(median data wait per step with num_workers=0, with the learner's settings, the step).

    The steps here leave the host idle, as it is while a GPU computes: the main process sleeps
    for twice the time one batch takes to load (measured first, with num_workers=0). A loader
    worker then has a core even on a 2-core machine beside other work, so what is measured is
    whether the settings load ahead, not how busy the machine is (a real CPU step competes with
    the worker for cores: beside a busy neighbour, CI measured 764 ms of 961 still waited).
    When the first runs leave the answer in doubt, as many again are pooled in.
    """
    waits: dict[str, list[float]] = {"slow": [], "fixed": []}
    _measure_waits({}, dataset, waits["slow"], step_s=0.0)
    step_s = 2 * statistics.median(waits["slow"])
    for _ in range(2):
        _measure_waits(settings, dataset, waits["fixed"], step_s)
        _measure_waits({}, dataset, waits["slow"], step_s)
        if statistics.median(waits["fixed"]) <= BOTTLENECK_SHRINK * statistics.median(waits["slow"]):
            break
    return statistics.median(waits["slow"]), statistics.median(waits["fixed"]), step_s


def _measure_waits(settings: dict[str, Any], dataset: Any, into: list[float],
                   step_s: float) -> None:  # fmt: skip
    """Waits for each batch of a loader built with ``settings``, a host-idle step between."""
    from torch.utils.data import DataLoader

    from labkit.profiling import bottlenecks

    try:
        loader = DataLoader(dataset, batch_size=BOTTLENECK_BATCH, shuffle=False, **settings)
    except (TypeError, ValueError) as e:
        raise ExerciseFailed(f"DataLoader(dataset, batch_size=…, **{settings!r}) raised "
                             f"{type(e).__name__}: {e}") from e  # fmt: skip
    with bottlenecks.BatchStream(loader) as stream:
        for i in range(2 + BOTTLENECK_STEPS):  # 2 warm-up batches: the workers start
            t0 = time.perf_counter()
            next(stream)
            if i >= 2:
                into.append(time.perf_counter() - t0)
            time.sleep(step_s)  # the step: the host waits, as for a GPU


def _bottleneck_failure(fn: Callable[..., Any]) -> str:
    from labkit.profiling import bottlenecks

    # Loading a batch is made to cost 1.5 training steps of the tiny model (measured now, on
    # this machine), so that 'data' is the slowest phase of the trace even when a busy machine
    # slows the compute; the fix is measured with host-idle steps of twice the loading time
    # (_data_wait), so one worker can still hide all of it there.
    torch.manual_seed(0)
    model = GPT(BOTTLENECK_CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (BOTTLENECK_BATCH, BOTTLENECK_CFG.seq_len))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        reference_annotated_step(model, opt, lambda: (x, x))
        times.append(time.perf_counter() - t0)
    passes = bottlenecks.calibrate_passes(1.5 * statistics.median(times[1:]),
                                          batch_size=BOTTLENECK_BATCH, seq_len=BOTTLENECK_CFG.seq_len)
    fast_ds = bottlenecks.TokenizingDataset(seq_len=BOTTLENECK_CFG.seq_len, passes=1, n_items=48)
    with tempfile.TemporaryDirectory(prefix="labkit-06-bottleneck-") as tmp:
        # The planted bottleneck must show in its trace, or a right answer gets blamed: under
        # the profiler the compute phases run slower than calibrated, more so beside another
        # busy process. So load more per batch and record again until 'data' is the slowest.
        for attempt in range(BOTTLENECK_TRIES):
            slow_ds = bottlenecks.TokenizingDataset(seq_len=BOTTLENECK_CFG.seq_len, passes=passes,
                                                    n_items=48)  # fmt: skip
            slow_trace = _loader_trace(slow_ds, Path(tmp), f"slow{attempt}")
            medians = {n: statistics.median(v) for n, v in slow_trace.phase_seconds(PHASES).items()}
            if reference_diagnose(slow_trace)[0] == "data":
                break
            # at most three times the work per try (the fix is measured on host-idle steps of
            # twice the loading time, whatever it is)
            grow = 1.25 * max(medians.values()) / max(medians["data"], 1e-9)
            passes = math.ceil(passes * min(3.0, grow))
        else:
            raise ExerciseFailed(f"in {BOTTLENECK_TRIES} recorded traces the planted slow loader "
                                 "never was the slowest phase: this machine is busy with other "
                                 "work (not your code's doing); run the cell again when it is "
                                 "idle")  # fmt: skip
        traces = {"slowed by loading": slow_trace,
                  "not slowed by loading": _loader_trace(fast_ds, Path(tmp), "fast")}  # fmt: skip
        answers = {}
        for what, trace in traces.items():
            want, _ = reference_diagnose(trace)
            got = call(fn, trace)
            if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], str)
                    and isinstance(got[1], dict)):  # fmt: skip
                raise ExerciseFailed(f"diagnose returned {short_repr(got)}; return a pair "
                                     f"(phase name, dict of DataLoader settings)")  # fmt: skip
            if got[0] != want:
                medians = {n: f"{statistics.median(v) * 1e3:.1f} ms"
                           for n, v in trace.phase_seconds(PHASES).items()}  # fmt: skip
                raise ExerciseFailed(f"on the trace {what}, diagnose named {got[0]!r}, but its "
                                     f"median phase times per step are {medians}: name the "
                                     f"largest, read from the trace, not fixed in advance")  # fmt: skip
            answers[what] = got
    settings = answers["slowed by loading"][1]
    if not settings.get("num_workers"):
        raise ExerciseFailed(f"the settings {settings!r} keep num_workers=0: the training "
                             f"process still tokenises every batch itself between steps")  # fmt: skip
    slow, fixed, step_s = _data_wait(settings, slow_ds)
    if fixed > BOTTLENECK_SHRINK * slow:
        raise ExerciseFailed(f"with {settings!r} a step still waited {fixed * 1e3:.1f} ms for "
                             f"data (median; {slow * 1e3:.1f} ms with num_workers=0, measured "
                             f"side by side, with steps of {step_s * 1e3:.0f} ms that leave the "
                             f"host idle): the loading is not done ahead of the steps")  # fmt: skip
    return (f"diagnose names the slowest phase of two recorded traces ('data', then "
            f"{answers['not slowed by loading'][0]!r}), and its settings {settings!r} cut the "
            f"data wait per step from {slow * 1e3:.1f} ms to {fixed * 1e3:.1f} ms (median, "
            f"measured side by side with steps of {step_s * 1e3:.0f} ms that leave the host "
            f"idle, as a GPU step does)")


@exercise(
    "06.bottleneck",
    "Diagnose a planted bottleneck from its trace, and fix it",
    hints=(
        "a trace annotated with phases tells you where each step's time went: the phase with "
        "the most time per step is the first suspect. Read it from the numbers, since a "
        "different run can have a different culprit",
        "trace.phase_seconds(profiling.PHASES) gives, per phase, the seconds in each recorded "
        "step; take the median per phase and the phase with the largest one",
        "when 'data' dominates, the training process is doing the loading itself between "
        "steps. DataLoader worker processes (num_workers >= 1) load the next batches while the "
        "current step computes; prefetch_factor sets how many batches each worker keeps ready",
        "recipe: seconds = trace.phase_seconds(profiling.PHASES); worst = max(seconds, key=lambda "
        "n: statistics.median(seconds[n])); return worst, ({'num_workers': 1, "
        "'prefetch_factor': 4, 'persistent_workers': True} if worst == 'data' else {})",
    ),
    reference=reference_diagnose,
    time_limit_s=120.0,
)
def _verify_bottleneck(diagnose: Any) -> str:
    fn = _require_callable(diagnose, "diagnose(trace) -> (phase, settings)")
    return _bottleneck_failure(fn)
