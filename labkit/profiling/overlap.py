"""Compute against communication in one rank's trace, and the rank the others wait for.

    from labkit.profiling import load_traces, rank_steps, rank_times, find_straggler
    traces = load_traces(paths)
    times = [rank_times(t) for t in traces]
    times[0].hidden_fraction      # share of rank 0's communication that ran under compute
    find_straggler(times)         # Straggler(rank=1, ...) or None
    find_straggler(times, per_step=[rank_steps(t) for t in traces])  # slow step after step
    diagnose(traces[0]).cause     # "waiting for another rank": its longest phase sat in a collective

Definitions (per rank, over the recorded steps, seconds per step):

    compute        time some compute ran: on a GPU trace, computation kernels (not NCCL, not
                   copies) that the recorded steps launched, wherever they ran (``gpu_work``);
                   on a CPU trace, operators on the training thread, minus the time that
                   thread spent inside a collective call (waiting is not computing)
    communication  time some collective ran: NCCL kernels on a GPU; the collective ops on
                   gloo's own threads and the training thread on a CPU (there, the lifetime of
                   the collective's work item: it includes waiting for the other ranks, as an
                   NCCL kernel's time does, and is cut at the optimizer phase)
    hidden         communication ∩ compute: sent while useful work went on
    exposed        communication − compute: the step waited for the network
    hidden fraction = hidden / communication

Each is a *union* of intervals before it is measured: two buckets all-reduced at once on two
threads take the time they overlap once, not twice. This is Holistic Trace Analysis's
"communication computation overlap" (hta.readthedocs.io, ``get_comm_comp_overlap``), which reads
GPU kernels only; on CPU traces (gloo) HTA finds no kernels and returns NaN, so this module
measures the same quantity from the threads.

A straggler: in a synchronous data-parallel step every rank waits in the all-reduce for the
slowest. The slow rank's own work per step (step time minus exposed communication) is the
largest, and the others' exposed communication grows by the difference. The rank named is the
one with the most own work, when it exceeds the median of the others by ``threshold``. Given
each rank's steps one by one (:func:`rank_steps`), it must also do so step after step (in
``most`` of the steps, 4 of 5 by default): a planted delay slows its rank in every step, while
a busy machine slows one rank in some steps and another in others, and their means can still
differ by 2x (measured on 2 shared cores with no delay planted).
"""

from __future__ import annotations

import bisect
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from labkit.profiling.trace import GPU_WORK, Span, Trace, TraceError

Interval = tuple[float, float]

COMM = re.compile(r"^(gloo:|nccl:|c10d::|record_param_comms)|^nccl|nccl.*Kernel", re.IGNORECASE)
"""Names of communication events: gloo's per-collective ranges, NCCL kernels and ranges, the
c10d operators (``c10d::allreduce_``) and the profiler's ``record_param_comms``."""


# --- interval arithmetic ------------------------------------------------------------------


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, non-overlapping intervals covering the same time as ``intervals``."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(intervals: Iterable[Interval]) -> float:
    """Total time covered (overlaps counted once)."""
    return sum(b - a for a, b in union(intervals))


def intersect(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The time covered by both ``a`` and ``b``."""
    ua, ub = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(ua) and j < len(ub):
        start, end = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        if start < end:
            out.append((start, end))
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The time covered by ``a`` and not by ``b``."""
    ua = union(a)
    cut = intersect(ua, b)
    out: list[Interval] = []
    k = 0
    for start, end in ua:
        cur = start
        while k < len(cut) and cut[k][1] <= end:
            if cut[k][0] > cur:
                out.append((cur, cut[k][0]))
            cur = max(cur, cut[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def hidden_fraction(compute: Iterable[Interval], comm: Iterable[Interval]) -> float:
    """Share of the communication time that overlaps compute (0 when nothing was sent)."""
    comm = union(comm)
    total = length(comm)
    return length(intersect(compute, comm)) / total if total else 0.0


# --- one rank's trace ---------------------------------------------------------------------


def _clip(spans: Iterable[Span], window: Interval) -> list[Interval]:
    lo, hi = window
    return [(max(s.start_us, lo), min(s.end_us, hi)) for s in spans if s.end_us > lo and s.start_us < hi]


MEMORY = re.compile(r"^(Memcpy|Memset|dma)")
"""Copies and fills on a CUDA stream (HTA's memory kernels, ``hta/utils/utils.py``)."""


def kernel_kind(work: Span) -> str:
    """``"communication"``, ``"memory"``, ``"compute"`` or ``"other"``, as Holistic Trace
    Analysis classifies GPU work (``hta/utils/utils.py``, ``get_kernel_type``): NCCL kernels,
    copies and fills, everything else, and the synchronisation kernels that are neither."""
    if work.cat != "kernel" or MEMORY.search(work.name):
        return "memory"
    if COMM.search(work.name):
        return "communication"
    return "other" if "Memcpy" in work.name or "Sync" in work.name else "compute"


def gpu_work(trace: Trace, window: Interval | None = None) -> tuple[list[Span], int]:
    """The GPU work that the steps in ``window`` launched (default: every recorded step), and
    how many recorded kernels were launched before the recording began.

    Work belongs to the step whose CPU side *launched* it (its ``cudaLaunchKernel``, on any
    thread), not to the step during which it ran: the CPU queues kernels ahead of the GPU, so
    in real training the last steps' kernels run after their ProfilerStep range has closed,
    and kernels that run at the start of the window were queued by a step before it. Holistic
    Trace Analysis selects kernels by their launch too (``hta/common/trace.py``,
    ``_filter_irrelevant_gpu_kernels``), with two differences: it has no lower bound (a launch
    recorded before the first step counts), and with fewer than two steps it keeps every
    kernel. Kernels whose launch the trace did not record were queued before it began and are
    left out (the second value counts them). A trace without launch records (hand-made, or
    stripped of its ``cuda_runtime`` events) falls back to the kernels that overlap the window;
    :func:`gpu_intervals` then keeps only their time inside it.
    """
    lo, hi = trace.window_us if window is None else window
    work = trace.spans(cat=GPU_WORK)
    if not trace.records_launches:
        return [s for s in work if s.end_us > lo and s.start_us < hi], 0
    mine, earlier = [], 0
    for s in work:
        launch = trace.launch_of(s)
        if launch is None:
            earlier += 1
        elif lo <= launch.start_us <= hi:
            mine.append(s)
    return mine, earlier


@dataclass(frozen=True)
class GpuIntervals:
    """The recorded steps' GPU work as unions of intervals (µs), by kind (:func:`kernel_kind`)."""

    by_kind: dict[str, list[Interval]]
    every: list[Interval]  # all of it, whatever the kind
    step_ends: list[float]  # per recorded step, when the last work it launched ended
    earlier: int  # kernels launched before the recording began, left out

    def kind(self, name: str) -> list[Interval]:
        return self.by_kind.get(name, [])


def gpu_intervals(trace: Trace) -> GpuIntervals:
    """Group the work of :func:`gpu_work` by kind, and find where each step's work ended."""
    window = trace.window_us
    work, earlier = gpu_work(trace)
    grouped: dict[str, list[Interval]] = {}
    for s in work:
        grouped.setdefault(kernel_kind(s), []).append((s.start_us, s.end_us))
    steps = trace.steps
    ends = [s.end_us for s in steps]
    if trace.records_launches:
        by_kind = {k: union(v) for k, v in grouped.items()}
        starts = [s.start_us for s in steps]
        for s in work:  # the step whose range holds the launch; its work ends with the last
            k = bisect.bisect_right(starts, trace.launch_of(s).start_us) - 1
            if k >= 0:
                ends[k] = max(ends[k], s.end_us)
    else:  # attributed by time: only their time inside the steps counts
        by_kind = {k: intersect(v, [window]) for k, v in grouped.items()}
    every = union(iv for ivs in by_kind.values() for iv in ivs)
    return GpuIntervals(by_kind, every, ends, earlier)


def compute_and_comm(trace: Trace) -> tuple[list[Interval], list[Interval]]:
    """(compute, communication) intervals in µs of the recorded steps, each a union.

    On a GPU trace: the kernels the steps launched (:func:`gpu_intervals`), whole, including the
    time they ran after the last step's range closed. On a CPU trace: the threads' work, cut to
    the steps' window (a CPU thread cannot run ahead of itself)."""
    window = trace.window_us
    if trace.on_gpu:
        gpu = gpu_intervals(trace)
        return gpu.kind("compute"), gpu.kind("communication")
    main = trace.main_tid
    ops = trace.spans(cat="cpu_op")
    comm_spans = [s for s in trace.all_spans if s.cat in ("cpu_op", "user_annotation")
                  and COMM.search(s.name)]  # fmt: skip
    waiting = _clip([s for s in comm_spans if s.tid == main], window)
    compute = subtract(_clip([s for s in ops if s.tid == main and not COMM.search(s.name)], window),
                       waiting)  # fmt: skip
    # A gloo thread closes its range a little after the work completed and the training thread
    # went on: a collective's range can reach into the optimizer step (which DDP cannot start
    # before every bucket is reduced) and on into the next step. That tail is bookkeeping, not
    # communication: cut it at the optimizer phase.
    optimizer = _clip(trace.spans(cat="user_annotation", name="optimizer", tid=main), window)
    return compute, subtract(_clip(comm_spans, window), optimizer)


@dataclass(frozen=True)
class RankTimes:
    """One rank's measured step, in seconds per step (see the module docstring)."""

    rank: int | None
    steps: int
    step_s: float
    compute_s: float
    comm_s: float
    hidden_s: float
    exposed_s: float
    source: str

    @property
    def hidden_fraction(self) -> float:
        return self.hidden_s / self.comm_s if self.comm_s else 0.0

    @property
    def own_s(self) -> float:
        """Step time not spent waiting for communication: the work only this rank's pace sets."""
        return self.step_s - self.exposed_s

    def describe(self) -> str:
        return (
            f"rank {self.rank}: step {self.step_s * 1e3:.1f} ms, compute {self.compute_s * 1e3:.1f}"
            f" ms, communication {self.comm_s * 1e3:.1f} ms of which hidden "
            f"{self.hidden_s * 1e3:.1f} ms ({self.hidden_fraction:.0%}), exposed "
            f"{self.exposed_s * 1e3:.1f} ms (measured, {self.source})"
        )


def rank_times(trace: Trace, *, whole_trace: bool = False) -> RankTimes:
    """Measure compute, communication and their overlap in ``trace``, per recorded step.

    Times per step are totals over the recorded steps divided by their number. The step
    itself: on a CPU trace, the recorded steps' window divided by their number; on a GPU trace,
    the steady-state period at which the steps' work finishes, the time between the end of the
    first step's last kernel and the end of the last step's, divided by the steps between them
    (one step: from its start to its last kernel's end). Dividing the whole window instead
    would add the GPU's lag behind the CPU once, spread over a few steps: 15% too long a step
    on a real 5-step trace. ``whole_trace=True`` measures a trace recorded without a schedule
    (no ProfilerStep ranges) as one step spanning the whole recording."""
    if whole_trace and not trace.steps:
        trace = trace.as_one_step()
    lo, hi = trace.window_us  # raises the explanatory TraceError when no step was recorded
    n = len(trace.steps)
    if trace.on_gpu:
        gpu = gpu_intervals(trace)
        compute, comm = gpu.kind("compute"), gpu.kind("communication")
        ends = gpu.step_ends
        step_us = (ends[-1] - ends[0]) / (n - 1) if n > 1 else ends[0] - lo
        if trace.records_launches:
            source = "CUDA kernels launched in the recorded steps"
            if gpu.earlier:
                source += f"; {gpu.earlier} queued before the first step left out"
        else:
            source = "CUDA kernels inside the recorded steps (the trace has no launch records)"
    else:
        compute, comm = compute_and_comm(trace)
        step_us = (hi - lo) / n
        source = "CPU threads: training loop and collective threads"
    hidden = length(intersect(compute, comm))
    total_comm = length(comm)
    return RankTimes(
        rank=trace.rank,
        steps=n,
        step_s=step_us / 1e6,
        compute_s=length(compute) / n / 1e6,
        comm_s=total_comm / n / 1e6,
        hidden_s=hidden / n / 1e6,
        exposed_s=(total_comm - hidden) / n / 1e6,
        source=source,
    )


def rank_steps(trace: Trace) -> list[RankTimes]:
    """:func:`rank_times` for each recorded step on its own (``steps`` = 1 in each), in order.

    On a CPU trace each step is its ``ProfilerStep`` range, and its compute and communication
    are the trace's (:func:`compute_and_comm`) inside that range. On a GPU trace a step holds
    the work it launched (:func:`gpu_work`) and lasts from the end of the previous step's last
    kernel to the end of its own (the first step: from its start)."""
    steps = trace.steps
    trace.window_us  # noqa: B018 (raises the explanatory TraceError when no step was recorded)
    out: list[RankTimes] = []
    if trace.on_gpu:
        ends = gpu_intervals(trace).step_ends
        source = "CUDA kernels launched in this step"
        for k, step in enumerate(steps):
            work, _ = gpu_work(trace, (step.start_us, step.end_us))
            if not trace.records_launches:  # attributed by time: only their time inside it
                work_iv = {kind: intersect([(s.start_us, s.end_us) for s in work
                                            if kernel_kind(s) == kind],
                                           [(step.start_us, step.end_us)])
                           for kind in ("compute", "communication")}  # fmt: skip
            else:
                work_iv = {kind: union((s.start_us, s.end_us) for s in work
                                       if kernel_kind(s) == kind)
                           for kind in ("compute", "communication")}  # fmt: skip
            begin = ends[k - 1] if k else step.start_us
            out.append(_times(trace.rank, (ends[k] - begin), work_iv["compute"],
                              work_iv["communication"], source))  # fmt: skip
        return out
    compute, comm = compute_and_comm(trace)
    for step in steps:
        window = [(step.start_us, step.end_us)]
        out.append(_times(trace.rank, step.dur_us, intersect(compute, window),
                          intersect(comm, window), "CPU threads, one step"))  # fmt: skip
    return out


def _times(rank: int | None, step_us: float, compute: list[Interval], comm: list[Interval],
           source: str) -> RankTimes:  # fmt: skip
    hidden, total = length(intersect(compute, comm)), length(comm)
    return RankTimes(rank=rank, steps=1, step_s=step_us / 1e6, compute_s=length(compute) / 1e6,
                     comm_s=total / 1e6, hidden_s=hidden / 1e6, exposed_s=(total - hidden) / 1e6,
                     source=source)  # fmt: skip


@dataclass(frozen=True)
class GpuSplit:
    """How one rank's GPU spent the recorded steps, in seconds per step, by kind of kernel:
    Holistic Trace Analysis's "temporal breakdown" (``get_temporal_breakdown``), measured
    over the kernels the steps launched.

    span       from the first kernel's start to the last one's end
    idle       no kernel of any kind running (the GPU waited for the CPU, or for nothing)
    compute    some computation kernel running (not NCCL, not a copy or fill)
    other      kernels running, none of them computation: communication or copies alone
    """

    rank: int | None
    steps: int
    span_s: float
    idle_s: float
    compute_s: float
    other_s: float
    comm_s: float
    memory_s: float

    def describe(self) -> str:
        pct = lambda x: f"{x / self.span_s:.0%}" if self.span_s else "n/a"  # noqa: E731
        return (f"rank {self.rank}: GPU busy span {self.span_s * 1e3:.1f} ms a step: compute "
                f"{self.compute_s * 1e3:.1f} ms ({pct(self.compute_s)}), communication or "
                f"copies alone {self.other_s * 1e3:.1f} ms ({pct(self.other_s)}), idle "
                f"{self.idle_s * 1e3:.1f} ms ({pct(self.idle_s)}) (measured, CUDA kernels)")


def gpu_split(trace: Trace) -> GpuSplit:
    """Split the GPU time of ``trace``'s recorded steps by kind of kernel (see GpuSplit)."""
    if not trace.on_gpu:
        raise TraceError(f"{trace.path}: no kernels, copies or memsets: a CPU-only trace has "
                         "no GPU time to split (rank_times measures its threads)")  # fmt: skip
    gpu = gpu_intervals(trace)
    if not gpu.every:
        raise TraceError(f"{trace.path}: the recorded steps launched no GPU work")
    n = len(trace.steps)
    span = gpu.every[-1][1] - gpu.every[0][0]
    busy, busy_compute = length(gpu.every), length(gpu.kind("compute"))
    per = 1 / n / 1e6
    return GpuSplit(rank=trace.rank, steps=n, span_s=span * per, idle_s=(span - busy) * per,
                    compute_s=busy_compute * per, other_s=(busy - busy_compute) * per,
                    comm_s=length(gpu.kind("communication")) * per,
                    memory_s=length(gpu.kind("memory")) * per)  # fmt: skip


@dataclass(frozen=True)
class Straggler:
    """The rank the others waited for, and the evidence."""

    rank: int | None
    own_s: float
    others_own_s: float
    others_exposed_s: float
    steps_slower: int | None = None
    """In how many of the recorded steps it was the slow one (None: steps not given)."""
    steps: int | None = None

    def describe(self) -> str:
        every = (f", in {self.steps_slower} of {self.steps} steps" if self.steps is not None
                 else "")  # fmt: skip
        return (
            f"rank {self.rank} is the straggler: its own work takes {self.own_s * 1e3:.1f} ms a "
            f"step against {self.others_own_s * 1e3:.1f} ms on the other ranks (median{every}), "
            f"which wait {self.others_exposed_s * 1e3:.1f} ms a step in exposed communication "
            "(measured)"
        )


def find_straggler(times: Sequence[RankTimes], threshold: float = 0.3, *,
                   per_step: Sequence[Sequence[RankTimes]] | None = None,
                   most: float = 0.8) -> Straggler | None:  # fmt: skip
    """The rank whose own work exceeds the median of the others' by ``threshold``, and whose
    exposed communication is below theirs (they waited for it), or None.

    The threshold is wide because a busy machine moves a rank's own time by 10–20% from run
    to run on its own (measured on 2 cores): a smaller one names stragglers that are noise.
    ``per_step`` (each rank's :func:`rank_steps`, in the order of ``times``) also asks that the
    rank's own work exceed the others' median by ``threshold`` in at least ``most`` of the
    steps, one step at a time: noise slows a rank in some steps, a straggler in all."""
    if len(times) < 2:
        raise TraceError(f"a straggler needs two or more ranks' traces; got {len(times)}")
    if not 0 < most <= 1:
        raise ValueError(f"most={most!r} is not allowed: a share of the steps in (0, 1]")
    slow = max(times, key=lambda t: t.own_s)
    others = [t for t in times if t is not slow]
    typical = statistics.median(t.own_s for t in others)
    waited = statistics.median(t.exposed_s for t in others)
    if slow.own_s <= typical * (1 + threshold) or waited <= slow.exposed_s:
        return None
    if per_step is None:
        return Straggler(slow.rank, slow.own_s, typical, waited)
    if len(per_step) != len(times) or len({len(s) for s in per_step}) != 1:
        raise ValueError(f"per_step must hold one list of steps per rank, all as long: got "
                         f"{[len(s) for s in per_step]} for {len(times)} ranks")  # fmt: skip
    k = times.index(slow)
    n = len(per_step[0])
    slower = sum(1 for j in range(n)
                 if per_step[k][j].own_s > (1 + threshold) * statistics.median(
                     per_step[r][j].own_s for r in range(len(times)) if r != k))  # fmt: skip
    if slower < most * n:
        return None
    return Straggler(slow.rank, slow.own_s, typical, waited, slower, n)


# --- what the longest phase spent its time on ------------------------------------------------

CAUSES: tuple[str, ...] = ("loading", "waiting for another rank", "compute")
"""What :func:`diagnose` can say took a phase's time."""

WAITING_SHARE = 0.5
"""A phase is waiting for another rank when exposed communication fills more than this share
of it: more of the phase went to sitting in a collective than to anything else the training
thread did."""


def phase_window(trace: Trace, name: str) -> list[Interval]:
    """The time the training thread spent inside the range ``name`` in the recorded steps."""
    return union(_clip(trace.spans(cat="user_annotation", name=name, tid=trace.main_tid),
                       trace.window_us))  # fmt: skip


@dataclass(frozen=True)
class Diagnosis:
    """The longest phase of a rank's step and what took its time (see :func:`diagnose`)."""

    rank: int | None
    phase: str
    cause: str
    seconds: dict[str, float]  # median per step of each phase
    busy_share: float  # share of the phase the training thread computed
    waiting_share: float  # share of the phase in exposed communication

    def describe(self) -> str:
        times = ", ".join(f"{n} {s * 1e3:.1f}" for n, s in self.seconds.items())
        who = f"rank {self.rank}" if self.rank is not None else "one process"
        return (f"{who}: longest phase {self.phase!r} ({times} ms, medians per step); "
                f"inside it the training thread computed {self.busy_share:.0%} of the time and "
                f"sat in a collective with nothing to compute {self.waiting_share:.0%}: "
                f"{self.cause} (measured)")


def diagnose(trace: Trace, phases: Sequence[str] | None = None) -> Diagnosis:
    """The phase with the largest median time per step, and what took its time.

    Inside that phase's ranges (:func:`phase_window`) it measures the training thread's compute
    and the exposed communication (communication minus that compute, :func:`compute_and_comm`):
    where exposed communication fills more than :data:`WAITING_SHARE` of the phase, the rank
    was "waiting for another rank" (on a CPU rank, gloo's work item includes the wait for the
    others); otherwise the phase's time is the rank's own, "loading" in the data phase and
    "compute" in the others. A collective elsewhere in the step, or one hidden under compute,
    does not make a phase a wait; nor does an idle training thread outside any collective (a
    sleep, a file read, Python with no operators), which stays the phase's own work.

    On a GPU trace the phases are CPU ranges while compute and communication are kernels,
    which run behind the CPU: the rule is made for CPU ranks (gloo), where both are threads.
    """
    from labkit.profiling.phases import PHASES  # phases imports torch: only when asked

    names = list(PHASES if phases is None else phases)
    per_step = trace.phase_seconds(names)
    seconds = {n: statistics.median(v) if v else 0.0 for n, v in per_step.items()}
    if not any(seconds.values()):
        raise TraceError(f"{trace.path}: none of the phases {names} was recorded on the "
                         "training thread: annotate the step with phase(name)")  # fmt: skip
    worst = max(names, key=seconds.__getitem__)
    window = phase_window(trace, worst)
    total = length(window)
    compute, comm = compute_and_comm(trace)
    busy = length(intersect(compute, window))
    waiting = length(intersect(subtract(comm, compute), window))
    if total and waiting > WAITING_SHARE * total:
        cause = CAUSES[1]
    else:
        cause = CAUSES[0] if worst == "data" else CAUSES[2]
    return Diagnosis(rank=trace.rank, phase=worst, cause=cause, seconds=seconds,
                     busy_share=busy / total if total else 0.0,
                     waiting_share=waiting / total if total else 0.0)  # fmt: skip
