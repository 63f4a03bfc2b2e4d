"""A data-parallel job's traces, read out: per rank and step, the overlap bound, the straggler,
naive against DDP, and HTA's operator counts beside labkit's, in notebook 06's sentences.

Separate from the measuring (``overlap``, ``hta``): this module reads their results and
chooses each sentence from the numbers (``labkit.verdict``, ``judge_prediction``), so a
notebook cell is the job, the traces and one ``print(x.describe())``.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from labkit import verdict
from labkit.profiling.capture import judge_prediction
from labkit.profiling.hta import TraceDiffResult
from labkit.profiling.overlap import RankTimes, Straggler, find_straggler, rank_steps, rank_times
from labkit.profiling.trace import Trace

MiB = 2**20


@dataclass(frozen=True)
class DpPrediction:
    """What data parallelism should send and can hide: the ring all-reduce's bytes per rank and
    the bucket model's bound on the hidden share (all buckets but the last)."""

    nproc: int
    grad_bytes: int
    sent_bytes: float
    bucket_cap_mb: float
    buckets: int

    @property
    def bound(self) -> float:
        """The most of DDP's communication the backward can hide: the last bucket, ready only
        when the backward ends, stays exposed."""
        return (self.buckets - 1) / self.buckets

    def describe(self) -> str:
        return (f"predicted: gradients {self.grad_bytes / MiB:.2f} MiB; ring all-reduce sends "
                f"{self.sent_bytes / MiB:.2f} MiB per rank per step on {self.nproc} ranks\n"
                f"predicted: naive hides 0% of its communication; ddp with {self.bucket_cap_mb} "
                f"MB buckets ({self.buckets} of them) can hide at most about {self.bound:.0%}")


_WAIT_VERDICTS = {
    "agree": "verdict: within 30% of the planted delay: rank 0 waited for rank 1.",
    "below": "verdict: less than the planted delay: part of rank 1's sleep was hidden (rank 0 "
             "was still busy) or rank 0 was slowed too, so it waited less.",
    "above": "verdict: more than the planted delay: rank 0 waited for more than the sleep "
             "(the machine was busier during the slowed run).",
    "noisy": "verdict: too noisy to tell on this machine right now (or too few steps).",
}  # fmt: skip

_GLOO_NOTE = (
    "On CPU ranks a collective's time is the life of gloo's work item (the task gloo queues for "
    "one collective and runs on a thread of its own): it includes waiting for the other rank, as "
    "an NCCL kernel's time does on a GPU, so it is much longer than moving the bytes over "
    "loopback would take.")  # fmt: skip


@dataclass(frozen=True)
class StragglerReport:
    """Each run's straggler (or none), and rank 0's extra wait in the slowed run against the
    planted delay."""

    found: Mapping[str, Straggler | None]
    slowed: str
    delay_ms: float
    extra_wait_s: Sequence[float]
    steps_ms: tuple[float, float]
    """Median step of naive and ddp (median over ranks of the per-rank mean), ms."""

    @property
    def named(self) -> Straggler | None:
        """The straggler named in the slowed run."""
        return self.found[self.slowed]

    def describe(self) -> str:
        lines = []
        for name, found in self.found.items():
            lines.append(f"{name:<20} " + (found.describe() if found else
                         "no rank stands out step after step: within 30% of the others' own work"))
            if found and name != self.slowed:
                lines.append(f"{'':<20} no delay was planted in this run: a rank named here is "
                             "the machine's noise (one rank losing its core for several steps), "
                             "not a straggler")  # fmt: skip
        waited = statistics.median(self.extra_wait_s)
        judged = judge_prediction(self.delay_ms / 1e3, self.extra_wait_s, tolerance=0.3)
        # (a signed change, not "grew by": at smoke size and on a busy machine it can be < 0)
        lines += ["", f"predicted: rank 0 waits about the planted {self.delay_ms} ms more per "
                  f"step; measured: its exposed communication changed {waited * 1e3:+.1f} ms "
                  "(median of its steps in the slowed run, against plain ddp's median)",
                  verdict.summarize(self.extra_wait_s, "rank 0's extra wait, per step").line(),
                  _WAIT_VERDICTS[judged],
                  f"measured: naive step {self.steps_ms[0]:.1f} ms, ddp step "
                  f"{self.steps_ms[1]:.1f} ms (median over ranks of the per-rank mean)"]
        return "\n".join(lines)


@dataclass(frozen=True)
class StrategyComparison:
    """Naive all-reduce against DDP's buckets: throughput, the measured verdict on step times,
    the all-reduces counted per step and the communication hidden."""

    tokens_per_s: tuple[float, float]
    exposed_s: tuple[float, float]
    comm_s: tuple[float, float]
    hidden_ddp_s: float
    steps: tuple[Sequence[float], Sequence[float]]
    messages: Mapping[str, float]
    """All-reduces per step in rank 0's trace, per run."""
    n_tensors: int

    def describe(self) -> str:
        naive, ddp = self.tokens_per_s
        return "\n".join([
            f"measured: naive {naive:,.0f} tokens/s, ddp {ddp:,.0f} tokens/s ({ddp / naive:.2f}×), "
            f"exposed communication per step: naive {self.exposed_s[0] * 1e3:.1f} ms, ddp "
            f"{self.exposed_s[1] * 1e3:.1f} ms",
            str(verdict.compare_times(*self.steps, names=("naive all-reduce", "ddp buckets"))),
            f"counted in rank 0's traces: {self.messages['naive']:.0f} all-reduces per step in "
            f"naive (one per gradient tensor: {self.n_tensors} tensors), "
            f"{self.messages['ddp']:.0f} in ddp (one per bucket)",
            f"measured: communication per step {self.comm_s[0] * 1e3:.1f} → "
            f"{self.comm_s[1] * 1e3:.1f} ms, of which {self.hidden_ddp_s * 1e3:.1f} ms hidden "
            "under the backward pass in ddp (overlap)"])  # fmt: skip


@dataclass(frozen=True)
class DpRuns:
    """Each run of a data-parallel job, per rank (``rank_times``) and per step
    (``rank_steps``), measured from the ranks' traces."""

    traces: Mapping[str, Sequence[Trace]]
    times: Mapping[str, Sequence[RankTimes]]
    backend: str
    device: str
    buckets: int
    """The bucket model's count for ddp (predicted)."""

    @property
    def ddp_calls(self) -> float:
        """All-reduces per step on rank 0 of the ddp run (gloo:… or nccl:all_reduce)."""
        ddp0 = self.traces["ddp"][0]
        return ddp0.per_step(ddp0.collective_calls("all_reduce"))

    def step_s(self, name: str) -> float:
        """Median over ranks of run ``name``'s per-rank mean step, seconds."""
        return statistics.median(t.step_s for t in self.times[name])

    def describe(self) -> str:
        lines = ["", f"per rank and step (measured from each rank's trace; {self.backend} on "
                 f"{self.device}):"]
        for name, times in self.times.items():
            lines.append(f"--- {name}")
            lines += ["  " + t.describe() for t in times]
        lines += ["", f"measured: ddp ran {self.ddp_calls:.0f} all-reduces per step on rank 0 (one "
                  f"per bucket; predicted {self.buckets})"]
        if self.device == "cpu":
            lines.append(_GLOO_NOTE)
        return "\n".join(lines)

    def describe_bound(self, bound: float) -> str:
        """ddp's hidden share on each rank against the bucket model's ``bound``."""
        hidden = [t.hidden_fraction for t in self.times["ddp"]]
        lines = ["", f"predicted: ddp hides at most about {bound:.0%}; measured "
                 f"{', '.join(f'{h:.0%}' for h in hidden)} (ranks 0, 1, ...)"]
        if all(h <= bound + 0.05 for h in hidden):
            lines.append("verdict: inside the bound on every rank: the last bucket's all-reduce, "
                         "ready only when the backward ends, stays exposed.")
        else:
            lines.append("verdict: above the bound on some rank: more was hidden than the bucket "
                         "model allows. On CPU ranks the collective's range also covers waiting "
                         "for the other rank while this one still computes, which the model "
                         "does not count.")  # fmt: skip
        return "\n".join(lines)

    def stragglers(self, *, slowed: str, plain: str = "ddp", delay_ms: float) -> StragglerReport:
        """A straggler must stand out step after step (4 steps of 5), not only on average; and
        rank 0 of ``slowed`` should wait about ``delay_ms`` more per step than in ``plain``."""
        steps = {name: [rank_steps(t) for t in traces] for name, traces in self.traces.items()}
        found = {name: find_straggler(times, per_step=steps[name])
                 for name, times in self.times.items()}  # fmt: skip
        plain_wait = statistics.median(s.exposed_s for s in steps[plain][0])
        extra = [s.exposed_s - plain_wait for s in steps[slowed][0]]
        return StragglerReport(found, slowed, delay_ms, extra,
                               (self.step_s("naive") * 1e3, self.step_s("ddp") * 1e3))

    def compare(self, ranks: Sequence[Mapping[str, Any]], *, tokens_per_rank_step: int,
                active: int, n_tensors: int) -> StrategyComparison:
        """naive against ddp: ``ranks`` are the job's per-rank results (``step_s`` per run,
        the last ``active`` steps profiled)."""
        nproc = len(self.times["naive"])
        tps = tuple(tokens_per_rank_step * nproc / self.step_s(n) for n in ("naive", "ddp"))

        def med(name: str, field: str) -> float:
            return statistics.median(getattr(t, field) for t in self.times[name])

        steps = tuple([s for r in ranks for s in r["step_s"][n][-active:]] for n in ("naive", "ddp"))
        messages = {name: traces[0].per_step(traces[0].collective_calls("all_reduce"))
                    for name, traces in self.traces.items()}  # fmt: skip
        return StrategyComparison(
            tps, (med("naive", "exposed_s"), med("ddp", "exposed_s")),
            (med("naive", "comm_s"), med("ddp", "comm_s")), med("ddp", "hidden_s"), steps,
            messages, n_tensors)  # fmt: skip


def dp_runs(traces: Mapping[str, Sequence[Trace]], *, backend: str, device: str,
            buckets: int) -> DpRuns:
    """Measure each run's ranks (``rank_times``) from ``traces`` (run name → one per rank)."""
    times = {name: [rank_times(t) for t in ts] for name, ts in traces.items()}
    return DpRuns(traces, times, backend, device, buckets)


def describe_diff_counts(diff: TraceDiffResult, *, predicted: tuple[int, int],
                         counted: tuple[float, float], backend: str) -> str:
    """HTA TraceDiff's all-reduces per step (naive → ddp) beside the prediction and labkit's
    count; "" when TraceDiff produced nothing (its describe() says why)."""
    if diff.table is None:
        return ""
    got = diff.per_step(f"{backend}:all_reduce")
    comm = diff.per_step("communication")
    same = got == predicted == counted
    return "\n".join([
        "", f"all-reduces per step, naive → ddp: predicted {predicted[0]} → {predicted[1]}; HTA "
        f"counted {got[0]:g} → {got[1]:g}; labkit counted {counted[0]:g} → {counted[1]:g}",
        "verdict: " + ("HTA's counts equal the prediction and labkit's." if same else
                       "the counts differ: read the rows above for the operator that moved."),
        f"the naive strategy's 'communication' range per step: {comm[0]:g} → {comm[1]:g}"])
