"""A multi-rank job's traces in one view: per rank, per kind of GPU work, and the straggler.

Section 4 of notebook 06 measures a job this machine ran; this module reads any job's traces
the same way, a real GPU job included, and puts the figures a reader asks first in three
tables and a sentence:

* per rank (:func:`summarize_job`): the step, compute, communication, the share of it hidden
  behind compute, and the GPU's idle time (:func:`labkit.profiling.overlap.rank_times` and
  :func:`~labkit.profiling.overlap.gpu_split`);
* the communication itself: the process group's collectives by operation (``nccl:all_reduce``,
  ``nccl:all_to_all``, ...) and the NCCL kernels that ran them, per step;
* the straggler question: is one of these ranks the one the others wait for
  (:func:`~labkit.profiling.overlap.find_straggler`, step by step), and when none is while
  they all wait, what that says when the traces hold only some of the job's ranks.

Every figure is measured from the traces; nothing here is modelled. Display only: no plotting.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from labkit.profiling.nsys_reports import short_kernel_name
from labkit.profiling.overlap import (
    GpuSplit,
    RankTimes,
    Straggler,
    find_straggler,
    gpu_split,
    gpu_work,
    kernel_kind,
    rank_steps,
    rank_times,
)
from labkit.profiling.trace import COLLECTIVE, Trace, TraceError

WAITING = 0.10
"""Ranks "wait" when exposed communication (not hidden behind compute) takes more than this
share of their step: more than a tenth of the step goes to the network alone."""

@dataclass(frozen=True)
class KernelGroup:
    """Kernels of one name on one rank, per recorded step."""

    name: str
    calls_per_step: float
    ms_per_step: float


@dataclass(frozen=True)
class JobSummary:
    """One job's traces, read rank by rank (see the module docstring)."""

    traces: tuple[Trace, ...]
    times: tuple[RankTimes, ...]
    splits: tuple[GpuSplit | None, ...]  # None on a CPU trace: no GPU time to split
    collectives: tuple[Counter, ...]  # per rank: operation -> calls per step
    comm_kernels: tuple[tuple[KernelGroup, ...], ...]  # per rank, longest first
    straggler: Straggler | None

    @property
    def world_size(self) -> int | None:
        sizes = {t.world_size for t in self.traces} - {None}
        return sizes.pop() if len(sizes) == 1 else None

    def rank_table(self) -> str:
        """Per rank: step, compute, communication (hidden share, exposed) and GPU idle, ms."""
        head = (f"{'rank':>5} {'steps':>5} {'step ms':>8} {'compute':>8} {'comm':>8} "
                f"{'hidden':>7} {'exposed':>8} {'GPU idle':>9}")  # fmt: skip
        rows = [head]
        for t, s in zip(self.times, self.splits, strict=True):
            idle = f"{s.idle_s * 1e3:7.1f}ms" if s is not None else f"{'(CPU)':>9}"
            rows.append(f"{t.rank!s:>5} {t.steps:>5} {t.step_s * 1e3:8.1f} {t.compute_s * 1e3:8.1f} "
                        f"{t.comm_s * 1e3:8.1f} {t.hidden_fraction:7.0%} "
                        f"{t.exposed_s * 1e3:8.1f} {idle}")  # fmt: skip
        return "\n".join(rows)

    def comm_table(self, top: int = 4) -> str:
        """Per rank: the collectives the process group called and the kernels that ran them."""
        lines = []
        for t, ops, kernels in zip(self.times, self.collectives, self.comm_kernels, strict=True):
            called = ", ".join(f"{op} ×{n:g}" for op, n in ops.most_common()) or "none recorded"
            lines.append(f"rank {t.rank}: collectives per step: {called}")
            for k in kernels[:top]:
                lines.append(f"    {k.calls_per_step:5.1f} kernels, {k.ms_per_step:7.1f} ms a step"
                             f"  {k.name}")  # fmt: skip
            if len(kernels) > top:
                rest = sum(k.ms_per_step for k in kernels[top:])
                lines.append(f"    ... {len(kernels) - top} more kinds, {rest:.1f} ms a step")
            if not kernels:
                lines.append("    no communication kernels (a CPU trace, or no NCCL work)")
        return "\n".join(lines)

    def where_time_goes(self) -> str:
        """The GPU's step split three ways (median over the ranks), and which loss is larger:
        no kernel at all (the GPU waited for its CPU) or communication left exposed."""
        splits = [s for s in self.splits if s is not None]
        if not splits:
            return "These are CPU traces: there is no GPU time to split (rank_table has the threads')."
        med = lambda f: statistics.median(f(s) for s in splits)  # noqa: E731
        span, compute, alone, idle = (med(lambda s: s.span_s), med(lambda s: s.compute_s),
                                      med(lambda s: s.other_s), med(lambda s: s.idle_s))  # fmt: skip
        pct = lambda x: f"{x / span:.0%}" if span else "n/a"  # noqa: E731
        head = (f"Median over {len(splits)} rank{'s' if len(splits) > 1 else ''}, of a GPU span "
                f"of {span * 1e3:.1f} ms a step: compute {compute * 1e3:.1f} ms ({pct(compute)}), "
                f"communication or copies with no compute beside them {alone * 1e3:.1f} ms "
                f"({pct(alone)}), idle {idle * 1e3:.1f} ms ({pct(idle)}).")  # fmt: skip
        if idle > alone:
            return (f"{head} The larger loss is idle time: no kernel ran at all, so the GPU "
                    "waited for its CPU (launches, data, host work, a synchronisation), which "
                    "faster communication would not recover.")  # fmt: skip
        return (f"{head} The larger loss is communication with nothing to hide it: overlap "
                "(earlier or bucketed collectives) or fewer bytes would recover it.")  # fmt: skip

    def straggler_verdict(self) -> str:
        """Whether one of these ranks is the one the others wait for, chosen by measurement."""
        if self.straggler is not None:
            return self.straggler.describe() + "."
        if len(self.times) < 2:
            return ("One rank's trace: a straggler is a rank the others wait for, so the "
                    "question needs two or more ranks' traces of the same steps.")
        own = [t.own_s for t in self.times]
        spread = (max(own) - min(own)) / statistics.median(own) if min(own) > 0 else 0.0
        share = [t.exposed_s / t.step_s if t.step_s > 0 else 0.0 for t in self.times]
        waits = f"{min(share):.0%}–{max(share):.0%}" if len(share) > 1 else f"{share[0]:.0%}"
        here, size = len(self.times), self.world_size
        missing = size is not None and size > here
        first = (f"No rank here is a straggler: their own work (step minus exposed "
                 f"communication) differs by {spread:.0%} at most, and a straggler must stand "
                 "out step after step.")  # fmt: skip
        if min(share) > WAITING and missing:
            return (f"{first} Yet every one of them waits in exposed communication ({waits} of "
                    f"its step). These traces hold {here} of the job's {size} ranks: the rank "
                    "they wait for, if one, is among the other "
                    f"{size - here}, or the network itself is slow. Naming it takes every "
                    "rank's trace (or at least the slowest ranks', by step time).")  # fmt: skip
        if min(share) > WAITING:
            return (f"{first} Every rank waits in exposed communication ({waits} of its step), "
                    "and all the job's ranks are here: the time is the collectives' own "
                    "(message sizes, bandwidth, algorithm), not a late rank.")  # fmt: skip
        return (f"{first} Exposed communication takes {waits} of a step: little waiting to "
                "explain.")  # fmt: skip


def _comm_kernels(trace: Trace) -> tuple[KernelGroup, ...]:
    n = len(trace.steps)
    calls: Counter = Counter()
    us: Counter = Counter()
    for s in gpu_work(trace)[0]:
        if kernel_kind(s) == "communication":
            name = short_kernel_name(s.name)
            calls[name] += 1
            us[name] += s.dur_us
    return tuple(sorted((KernelGroup(k, calls[k] / n, us[k] / n / 1e3) for k in calls),
                        key=lambda g: -g.ms_per_step))  # fmt: skip


def _collectives(trace: Trace) -> Counter:
    lo, hi = trace.window_us
    ops: Counter = Counter()
    for s in trace.spans(cat="user_annotation", name=COLLECTIVE):
        if lo <= s.start_us < hi:
            ops[s.name] += 1  # "nccl:all_to_all": the backend and the operation
    return Counter({op: c / len(trace.steps) for op, c in ops.items()})


def summarize_job(traces: Sequence[Trace], *, threshold: float = 0.3) -> JobSummary:
    """Read each rank's trace of one job (``load_traces``) into a :class:`JobSummary`.

    ``threshold`` is :func:`find_straggler`'s; with two or more ranks the straggler must also
    stand out in most recorded steps, one step at a time."""
    if not traces:
        raise TraceError("no traces to summarize: give the traces of one job (load_traces)")
    times = tuple(rank_times(t) for t in traces)
    splits = tuple(gpu_split(t) if t.on_gpu else None for t in traces)
    straggler = None
    if len(traces) > 1:  # step by step where the ranks recorded as many steps
        same = len({len(t.steps) for t in traces}) == 1
        per_step = [rank_steps(t) for t in traces] if same else None
        straggler = find_straggler(times, threshold, per_step=per_step)
    return JobSummary(
        traces=tuple(traces),
        times=times,
        splits=splits,
        collectives=tuple(_collectives(t) for t in traces),
        comm_kernels=tuple(_comm_kernels(t) for t in traces),
        straggler=straggler,
    )
