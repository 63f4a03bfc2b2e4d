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
* ``06.bottleneck``: ``diagnose(trace) -> (phase, cause)``: a rank's longest phase and what
  took its time ("loading", "waiting for another rank" or "compute"), read from which thread
  was busy inside it, against :func:`labkit.profiling.overlap.diagnose` on traces built in
  torch.profiler's layout for a CPU rank over gloo (no job runs), among them two with the
  same longest phase and different causes.

Each check runs the learner's code on small, fixed inputs (a second or two on a laptop CPU)
and names the usual mistake behind a wrong answer without printing the code that fixes it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import numbers
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from labkit.config import ModelConfig
from labkit.course.exercises import ExerciseFailed, call, exercise, short_repr
from labkit.course.exercises.learner_code import require_callable
from labkit.model import GPT
from labkit.profiling import overlap
from labkit.profiling.capture import profile_steps
from labkit.profiling.overlap import CAUSES
from labkit.profiling.phases import PHASES
from labkit.profiling.trace import Span, Trace, load_trace

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
        "the model returns (logits, loss); the course's autocast is train.autocast, given the "
        "batch's device and dtype (with float32 it is off), entered around the model call "
        "only, inside the forward range; backward is the loss's own backward method, outside "
        "the autocast; the optimizer part calls the optimizer's step, then its zero_grad with "
        "set_to_none=True, so that the gradients are gone, not zeros. Return the loss",
        "recipe: in words (the code is yours): four phase ranges one after the other, each a "
        "with block on phase and the phase's name; 'data' takes the batch from next_batch; "
        "'forward' enters the course's autocast, for the batch's device and dtype, in the same "
        "with statement as its range, and keeps the loss the model returns; 'backward' "
        "backpropagates that loss; 'optimizer' steps and then clears the gradients, setting "
        "them to None; after the last block, return the loss",
    ),
    reference=reference_annotated_step,
)
def _verify_annotate(annotated_step: Any) -> str:
    fn = require_callable(annotated_step, "annotated_step(model, optimizer, next_batch, dtype) -> loss")
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
        "it ends. Then the overlap of two merged lists is a sum over every pair of intervals, "
        "one from each list, of the time the two share: from the later of their starts to the "
        "earlier of their ends, or nothing when that is negative. With no communication, "
        "return 0.0",
        "recipe: merge the compute intervals and, separately, the communication intervals "
        "(sort by start, then grow the last merged interval or open a new one); the "
        "communication total is the sum of the merged communication intervals' lengths; the "
        "hidden time is the sum, over every pair of one merged compute interval and one merged "
        "communication interval, of the time the two share (later start to earlier end, "
        "nothing if negative); return the hidden time divided by the total, and 0.0 when the "
        "total is zero",
    ),
    reference=overlap.hidden_fraction,
)
def _verify_hidden_fraction(hidden_fraction: Any) -> str:
    fn = require_callable(hidden_fraction, "hidden_fraction(compute, comm) -> float")
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
# The check reads traces it builds, in the layout torch.profiler writes for a CPU rank over
# gloo (checked against notebook 06's own dp_profile traces): ProfilerStep#N and the phase
# ranges on the training thread, its operators (cpu_op) inside them, a short c10d:: operator
# where the training thread hands a collective to gloo, and gloo's gloo:<op> range for the
# collective on a thread of its own (pt_gloo_runloop), open until every rank has taken part.
# Every case's answer is known from how it was built; the library's diagnose agrees on each
# (tests), and its figures are the evidence the messages quote.

MAIN_TID = 9001
GLOO_TIDS = {"gloo1": 9002, "gloo2": 9003}
STEPS = 4
LOADER_RANGE = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"

# A phase: (name, milliseconds, pieces); a piece: (where, name, start, end) with start and end
# as shares of the phase. where: "op" (a cpu_op on the training thread), "range" (a
# user_annotation on it), "gloo1"/"gloo2" (a collective's range on one of gloo's threads).
Piece = tuple[str, str, float, float]
PhaseSpec = tuple[str, float, list[Piece]]


def _ops(a: float, b: float, names: tuple[str, ...], ms: float) -> list[Piece]:
    """Operators back to back on the training thread from share ``a`` to ``b``, ~1 ms each."""
    k = max(1, round((b - a) * ms))
    return [("op", names[i % len(names)], a + (b - a) * i / k, a + (b - a) * (i + 1) / k)
            for i in range(k)]  # fmt: skip


def _loading(ms: float) -> PhaseSpec:  # the training thread loads; Python between operators
    return ("data", ms, [("range", LOADER_RANGE, 0.0, 1.0),
                         *_ops(0.0, 0.7, ("aten::randint", "aten::stack", "aten::copy_"), ms)])


def _idle_data(ms: float) -> PhaseSpec:  # a sleep or a file read: no operator, no collective
    return ("data", ms, _ops(0.0, 0.05, ("aten::randint", "aten::index"), ms))


def _broadcast_data(ms: float) -> PhaseSpec:  # the batch broadcast from another rank
    return ("data", ms, [*_ops(0.0, 0.05, ("aten::empty",), ms),
                         ("op", "c10d::broadcast_", 0.05, 0.06),
                         ("gloo1", "gloo:broadcast", 0.05, 0.95),
                         *_ops(0.95, 1.0, ("aten::to", "aten::copy_"), ms)])


def _forward(ms: float) -> PhaseSpec:
    return ("forward", ms, _ops(0.0, 0.9, ("aten::linear", "aten::addmm", "aten::gelu"), ms))


def _backward(ms: float, *, ddp: bool = True) -> PhaseSpec:
    """Autograd on the training thread; with DDP, three buckets all-reduced on gloo's threads
    while it goes on (the last one ready when it ends: a little exposed)."""
    pieces = _ops(0.0, 0.9 if ddp else 0.95, ("MmBackward0", "aten::mm", "aten::sum"), ms)
    if ddp:
        pieces += [("op", "c10d::allreduce_", 0.3, 0.302), ("gloo1", "gloo:all_reduce", 0.3, 0.5),
                   ("op", "c10d::allreduce_", 0.6, 0.602), ("gloo2", "gloo:all_reduce", 0.6, 0.8),
                   ("op", "c10d::allreduce_", 0.85, 0.852), ("gloo1", "gloo:all_reduce", 0.85, 0.98)]
    return ("backward", ms, pieces)


def _waiting_backward(ms: float) -> PhaseSpec:
    """A rank whose peer is late: its first buckets go out early, then it sits until the peer
    joins, with nothing left to compute."""
    return ("backward", ms, [*_ops(0.0, 0.25, ("MmBackward0", "aten::mm"), ms),
                             ("op", "c10d::allreduce_", 0.2, 0.202),
                             ("gloo1", "gloo:all_reduce", 0.2, 0.97),
                             ("op", "c10d::allreduce_", 0.22, 0.222),
                             ("gloo2", "gloo:all_reduce", 0.22, 0.96),
                             *_ops(0.97, 1.0, ("aten::copy_",), ms)])


def _naive_communication(ms: float) -> PhaseSpec:  # every gradient all-reduced after backward
    pieces: list[Piece] = []
    for i in range(4):
        a = 0.02 + 0.2375 * i
        pieces += [("op", "c10d::allreduce_", a, a + 0.002),
                   ("gloo1", "gloo:all_reduce", a, a + 0.2375)]
    return ("communication", ms, pieces)


def _optimizer(ms: float) -> PhaseSpec:
    return ("optimizer", ms, [("range", "Optimizer.step#AdamW.step", 0.0, 0.9),
                              *_ops(0.0, 0.8, ("aten::_foreach_mul_", "aten::_foreach_add_"), ms)])


@dataclasses.dataclass(frozen=True)
class BottleneckCase:
    key: str
    what: str  # said in messages: "the trace of ..."
    want: tuple[str, str]
    phases: tuple[PhaseSpec, ...]
    distributed: bool = True


def bottleneck_cases() -> list[BottleneckCase]:
    """The traces the check reads, in the order it reads them (each catches a mistake first)."""
    wait, comp = CAUSES[1], CAUSES[2]  # "waiting for another rank", "compute"
    return [
        BottleneckCase("R", "a DDP rank whose backward computes while its all-reduces run "
                       "beside it", ("backward", comp),
                       (_loading(1), _forward(12), _backward(40), _optimizer(3))),
        BottleneckCase("T", "a DDP rank whose peer is late to the all-reduce",
                       ("backward", wait),
                       (_loading(1), _forward(10), _waiting_backward(60), _optimizer(3))),
        BottleneckCase("S", "one process (no other rank) whose data phase runs no operator "
                       "(a sleep, a file read)", ("data", "loading"),
                       (_idle_data(40), _forward(8), _backward(20, ddp=False), _optimizer(3)),
                       distributed=False),
        BottleneckCase("U", "naive data parallelism with a slow loader (its all-reduce in a "
                       "'communication' phase after backward)", ("data", "loading"),
                       (_loading(40), _forward(6), _backward(12, ddp=False),
                        _naive_communication(38), _optimizer(2))),
        BottleneckCase("P", "a DDP rank whose training thread loads each batch itself",
                       ("data", "loading"),
                       (_loading(40), _forward(12), _backward(30), _optimizer(4))),
        BottleneckCase("Q", "a DDP rank with the same phase times whose data phase waits for "
                       "its batch to be broadcast from another rank", ("data", wait),
                       (_broadcast_data(40), _forward(12), _backward(30), _optimizer(4))),
    ]  # fmt: skip


def build_trace(case: BottleneckCase, folder: Path, rank: int = 0) -> Trace:
    """Write ``case`` as a Chrome trace of :data:`STEPS` identical steps and load it."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": MAIN_TID, "tid": 0, "args": {"name": "python"}},
        {"ph": "M", "name": "thread_name", "pid": MAIN_TID, "tid": MAIN_TID,
         "args": {"name": f"thread {MAIN_TID} (python)"}},
    ]  # fmt: skip
    if case.distributed:
        events += [{"ph": "M", "name": "thread_name", "pid": MAIN_TID, "tid": tid,
                    "args": {"name": f"thread {tid} (pt_gloo_runloop)"}}
                   for tid in GLOO_TIDS.values()]  # fmt: skip

    def span(cat: str, name: str, ts: float, dur: float, tid: int) -> None:
        events.append({"ph": "X", "cat": cat, "name": name, "pid": MAIN_TID, "tid": tid,
                       "ts": round(ts, 3), "dur": round(dur, 3), "args": {}})  # fmt: skip

    t = 1_000_000.0
    for k in range(STEPS):
        start = t
        t += 20.0
        for name, ms, pieces in case.phases:
            us = ms * 1e3
            span("user_annotation", name, t, us, MAIN_TID)
            for where, what, a, b in pieces:
                if where == "op":
                    span("cpu_op", what, t + a * us, (b - a) * us, MAIN_TID)
                elif where == "range":
                    span("user_annotation", what, t + a * us, (b - a) * us, MAIN_TID)
                else:
                    span("user_annotation", what, t + a * us, (b - a) * us, GLOO_TIDS[where])
            t += us + 10.0
        t += 10.0
        span("user_annotation", f"ProfilerStep#{k + 2}", start, t - start, MAIN_TID)
        t += 5.0
    meta: dict[str, Any] = {"schemaVersion": 1, "deviceProperties": [], "displayTimeUnit": "ms"}
    if case.distributed:
        meta["distributedInfo"] = {"backend": "gloo", "rank": rank, "world_size": 2}
    path = folder / f"case-{case.key}.json"
    path.write_text(json.dumps({**meta, "traceEvents": events}))
    return load_trace(path)


def reference_diagnose(trace: Any) -> tuple[str, str]:
    """(the longest phase, its cause): :func:`labkit.profiling.overlap.diagnose`."""
    found = overlap.diagnose(trace)
    return found.phase, found.cause


def _whole_exposed(trace: Trace) -> float:
    times = overlap.rank_times(trace)
    return times.exposed_s / times.step_s


def _cause_hint(case: BottleneckCase, got: str, trace: Trace, found: overlap.Diagnosis) -> str:
    """The usual mistake behind answering ``got`` on ``case`` (empty: none known)."""
    busy, wait, phase = f"{found.busy_share:.0%}", f"{found.waiting_share:.0%}", found.phase
    known = {
        ("R", "loading"): (
            f"'loading' for a {phase!r} phase in which the training thread computed {busy} of "
            f"the time: a cause fixed in advance, the same for every trace, cannot tell a data "
            f"stall from a wait or from compute. Read it from what the threads did inside the "
            f"phase"),
        ("R", "waiting for another rank"): (
            f"the training thread computed {busy} of {phase!r}; the all-reduces ran on gloo's "
            f"threads at the same time, hidden under that compute (only {wait} of the phase "
            f"was communication with no compute beside it). A collective somewhere in the "
            f"trace is not a wait: only exposed communication is"),
        ("T", "compute"): (
            f"the training thread computed only {busy} of {phase!r} and sat in its all-reduce, "
            f"with nothing to compute, for {wait}, while gloo's thread held the collective "
            f"open for the late peer. 'compute' is what the phase's name alone gives, and what "
            f"counting gloo's threads' busy time as the training thread's gives: gloo's ranges "
            f"are communication; compute is the training thread's own operators"),
        ("S", "waiting for another rank"): (
            f"the training thread ran no operator for {1 - found.busy_share:.0%} of {phase!r}, "
            f"and no collective ran at all (one process, no gloo thread): an idle training "
            f"thread is not waiting for another rank (a sleep, a file read or Python with no "
            f"operators is the loading itself). Waiting means sitting in a collective: "
            f"communication with no compute beside it"),
        ("U", "waiting for another rank"): (
            f"inside {phase!r} the training thread loaded and no collective ran ({wait} of it "
            f"exposed communication); the exposed all-reduce ({_whole_exposed(trace):.0%} of "
            f"the step) is in the 'communication' phase. Measure inside the longest phase's "
            f"own ranges, not over the whole trace"),
        ("Q", "loading"): (
            f"the training thread sat in a broadcast for {wait} of {phase!r} while gloo's "
            f"thread held it open: waiting for another rank. Over the whole trace the exposed "
            f"communication is only {_whole_exposed(trace):.0%} of the step, less than the "
            f"compute: a whole-trace measure hides a wait gathered in one phase. Measure "
            f"inside the phase's own ranges"),
    }  # fmt: skip
    return known.get((case.key, got), "")


def _evidence(found: overlap.Diagnosis) -> str:
    times = ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in found.seconds.items())
    return (f"median phase times per step: {times}; inside {found.phase!r} the training thread "
            f"computed {found.busy_share:.0%} of the time and sat in a collective with nothing "
            f"to compute {found.waiting_share:.0%}")


@exercise(
    "06.bottleneck",
    "Name the longest phase of a rank's trace and what took its time",
    hints=(
        "the longest phase says where a step's time went, not why. On a rank of a "
        "data-parallel job a phase's time is either the rank's own work (loading a batch, "
        "computing) or time it sat in a collective, waiting for the other ranks, while gloo's "
        "thread held the collective open. Two traces with the same longest phase can have "
        "different causes: read what the training thread did inside that phase",
        "communication that runs while the training thread computes is hidden and costs the "
        "step nothing; only exposed communication, with no compute of the training thread "
        "beside it, is waiting. profiling.compute_and_comm gives both as lists of (start, end) "
        "intervals, compute being the training thread's own operators only, and "
        "labkit.profiling.overlap has union, intersect, subtract and length for them",
        "measure inside the longest phase, not over the whole trace: its ranges are the "
        "user_annotation spans with its name on trace.main_tid. When exposed communication "
        "fills more than half of them, the rank was 'waiting for another rank'; otherwise the "
        "time is its own: 'loading' in the data phase, 'compute' in the others. A training "
        "thread idle outside any collective (a sleep, a file read) is not waiting",
        "recipe: in words (the code is yours): pick the phase whose median time per step is "
        "largest; gather its ranges on the training thread as intervals; take compute and "
        "communication for the whole trace and remove compute from communication, which "
        "leaves the exposed part; measure how much of the phase's intervals that exposed part "
        "covers; more than half of the phase's length means waiting for another rank, "
        "anything less means loading for the data phase and compute for the others; return "
        "the phase and the cause as a pair",
    ),
    reference=reference_diagnose,
)
def _verify_bottleneck(diagnose: Any) -> str:
    fn = require_callable(diagnose, "diagnose(trace) -> (phase, cause)")
    cases = bottleneck_cases()
    with tempfile.TemporaryDirectory(prefix="labkit-06-bottleneck-") as tmp:
        for case in cases:
            trace = build_trace(case, Path(tmp))
            got = call(fn, trace)
            if not (isinstance(got, (tuple, list)) and len(got) == 2
                    and all(isinstance(g, str) for g in got)):  # fmt: skip
                raise ExerciseFailed(f"diagnose returned {short_repr(got)} for the trace of "
                                     f"{case.what}; return a pair of strings (phase, cause)")  # fmt: skip
            phase_name, cause = got
            found = overlap.diagnose(trace)
            if phase_name != case.want[0]:
                raise ExerciseFailed(f"on the trace of {case.what}, diagnose named the phase "
                                     f"{phase_name!r}, but the longest is {case.want[0]!r} "
                                     f"({_evidence(found)}): take the largest median time per "
                                     f"step among {list(PHASES)}")  # fmt: skip
            if cause not in CAUSES:
                raise ExerciseFailed(f"diagnose gave the cause {cause!r}; say one of "
                                     f"{list(CAUSES)}, exactly")  # fmt: skip
            if cause != case.want[1]:
                hint = _cause_hint(case, cause, trace, found)
                raise ExerciseFailed(f"on the trace of {case.what}, diagnose said "
                                     f"({phase_name!r}, {cause!r}); expected "
                                     f"{case.want!r}: " + (hint or _evidence(found)))  # fmt: skip
    return (f"diagnose names the longest phase and its cause on {len(cases)} traces, among "
            f"them two with 'data' longest and the same phase times, the training thread "
            f"loading in one and sitting in a broadcast in the other; a backward that computes "
            f"beside hidden all-reduces, one that waits for a late peer, an idle data phase "
            f"with no collective, and an exposed all-reduce outside the longest phase")
