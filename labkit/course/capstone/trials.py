"""One fix at a time: each suspected fault's fix tried on top of those kept, measured, judged.

    fixes = capstone.one_at_a_time(job, found, changes, diagnose)
    print(fixes.table())           # fault, tokens/s before and after, kept?, the evidence why
    fixes.current.tokens_per_s     # the job with every kept fix, measured

A fix earns its place by a measurement: the re-run's steps against the previous run's, a
verdict from both samples (:func:`labkit.verdict.compare_times`), so a busy machine says "too
noisy to tell" rather than inventing a gain. A fix that measurably slows the job goes; one that
measurably speeds it up stays; when the speed cannot tell, the fix stays if the fault's evidence
is gone from the re-run (``diagnose`` no longer finds it). A fix for a correctness fault is
judged by what it corrects, not by the speed. Faults are tried in :data:`~labkit.course.capstone.FIXES`
order: first what makes every other measurement erratic, then the costs, then correctness.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from labkit import verdict
from labkit.course.capstone.faults import BY_ID
from labkit.course.capstone.job import CapstoneRun, rerun
from labkit.course.capstone.settings import FIXES


def steps(run: CapstoneRun) -> list[float]:
    """One rank's step seconds after the first (every rank waits for the slowest)."""
    return run.ranks[0]["step_s"][1:] or run.ranks[0]["step_s"]


@dataclass(frozen=True)
class Trial:
    """One fix tried: the run before it, the run with it, whether it stays, and why."""

    fault: str
    change: dict[str, Any]
    before: CapstoneRun
    after: CapstoneRun
    kept: bool
    why: str


@dataclass
class FixSequence:
    """The trials of one diagnosis, in order, and the job with every kept fix."""

    job: CapstoneRun
    trials: list[Trial] = field(default_factory=list)
    kept: dict[str, Any] = field(default_factory=dict)

    @property
    def current(self) -> CapstoneRun:
        """The last run whose fix was kept (the baseline if none was)."""
        return next((t.after for t in reversed(self.trials) if t.kept), self.job)

    def table(self) -> str:
        lines = [f"{'fault suspected':<24}{'tokens/s before':>16}{'after':>10}  kept?  "
                 "evidence for the verdict"]  # fmt: skip
        for t in self.trials:
            lines.append(f"{t.fault:<24}{t.before.tokens_per_s:>16,.0f}{t.after.tokens_per_s:>10,.0f}"
                         f"  {'yes' if t.kept else 'no ':<5}  {t.why}")  # fmt: skip
        now = self.current
        lines.append(f"\nmeasured: {self.job.tokens_per_s:,.0f} → {now.tokens_per_s:,.0f} tokens/s "
                     f"({now.tokens_per_s / self.job.tokens_per_s:.2f}× in all) with the fixes "
                     f"kept: {self.kept}")  # fmt: skip
        return "\n".join(lines)


def plot_fixes(fixes: FixSequence, prediction: Any, *, title: str | None = None, ax: Any = None):
    """Every trial of ``fixes``, kept or not, beside the baseline, as tokens/s from its median
    step; the bars span its steps' middle half (one rank's steps: every rank waits for the
    slowest); blue kept, red not. The dashed line is ``prediction``'s tokens/s
    (:class:`labkit.course.capstone.Prediction`: one rank's step). Returns the figure."""
    import statistics

    import matplotlib.pyplot as plt

    per_step = prediction.tokens_per_step

    def tps(s: list[float]) -> float:
        return per_step / statistics.median(s)

    runs = [("baseline", fixes.job, True)] + [(f"{'+' if t.kept else '✗'} {t.fault}", t.after, t.kept)
                                              for t in fixes.trials]  # fmt: skip
    if ax is None:
        fig, ax = plt.subplots(figsize=(7.5, 3.4))
    else:
        fig = ax.figure
    for i, (_, run, keep) in enumerate(runs):
        s = sorted(run.ranks[0]["step_s"][1:])
        q1, q3 = s[len(s) // 4], s[(3 * len(s)) // 4]
        ax.bar(i, tps(s), color="#bbbbbb" if i == 0 else ("#3182bd" if keep else "#fcae91"),
               yerr=[[tps(s) - per_step / q3], [per_step / q1 - tps(s)]], capsize=3)  # fmt: skip
    ax.axhline(prediction.tokens_per_s, ls="--", c="C3", label="predicted (one rank's step, section 2)")
    ax.set_xticks(range(len(runs)), [label for label, _, _ in runs], rotation=15, fontsize=8)
    job = f"job {fixes.job.code}" if fixes.job.code else "the job"
    ax.set(ylabel="tokens/s (measured)",
           title=title or f"{job}: each fix on top of those kept (blue kept, red not)")  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _judge(fault: str, before: CapstoneRun, after: CapstoneRun, gone: bool) -> tuple[bool, str]:
    cmp = verdict.compare_times(steps(after), steps(before), names=("after", "before"))
    said = cmp.sentence.removeprefix(verdict.PREFIX)
    if BY_ID[fault].kind == "correctness":  # judged by what it corrects, not the speed
        e0, e1 = before.evidence(), after.evidence()
        return gone, (f"(speed not the point) correctness: "
                      f"{'its evidence is gone' if gone else 'its evidence remains'}; final loss "
                      f"{before.losses[-1]:.3f} → {after.losses[-1]:.3f}, gradient norm at the "
                      f"last step {e0.grad_norm[0][-1]:.2f} → {e1.grad_norm[0][-1]:.2f}")  # fmt: skip
    if cmp.outcome == "faster":  # measurably faster stays, measurably slower goes
        return cmp.faster.name == "after", said
    # no gain measured, or too noisy to tell: the fix stays if its signature went
    return gone, f"{'its evidence is gone' if gone else 'its evidence remains'}; speed: {said}"


def one_at_a_time(job: CapstoneRun, found: set[str], changes: Mapping[str, Any],
                  diagnose: Callable[[CapstoneRun], tuple[set[str], dict[str, Any]]], *,
                  progress: bool = True) -> FixSequence:  # fmt: skip
    """Try the fix of each fault in ``found`` (its settings from ``changes``) on ``job``, one at a
    time on top of those kept, each re-run for real and judged (module docstring)."""
    from labkit.jobs.launch import ProgressLines

    seq = FixSequence(job)
    for fault in [f for f in FIXES if f in found]:
        change = {name: changes[name] for name in FIXES[fault] if name in changes}
        before = seq.current
        after = rerun(job, {**seq.kept, **change},
                      observers=[ProgressLines(fault)] if progress else [])  # fmt: skip
        gone = fault not in diagnose(after)[0]  # the diagnosis reads the re-run's evidence
        keep, why = _judge(fault, before, after, gone)
        if fault == "slow_loader":  # the fix moves the work before training: say what it costs
            why += f"; preparing the data once took {after.ranks[0]['loader']['prepare_s']:.1f} s before step 1"
        seq.trials.append(Trial(fault, change, before, after, keep, why))
        if keep:
            seq.kept.update(change)
    return seq
