"""Notebook 07's exercise (the capstone), checked in the kernel.

* ``07.diagnose``: ``diagnose(run) -> (faults found, changes)``: from the evidence of the
  learner's slow job (a :class:`labkit.capstone.CapstoneRun`), the ids of the faults it
  carries, and the changes to its settings that remove them. The check grades what the changes
  do, never the names alone: it re-runs the job with the changes, for real, and holds it
  against the healthy job (the right settings): the speed, with a verdict on the step samples,
  and the losses. While the job is not healthy it says which *measurements* still look wrong
  (the step time against the healthy job's, the data phase's share, one rank's long forward,
  all-reduces before the last micro-batch, threads against cores, the samples the ranks share,
  the losses), never which faults are left or which named ones the job does not carry: that
  would be the key. A named fault must come with changes of its own settings
  (``capstone.FIXES``), a change must serve a named fault, and a fault named but fixed by
  changes that change nothing in this job fails the check (without saying which). Every check
  counts as an attempt in the learner's record (:mod:`labkit.capstone.attempts`), and its line
  shows the count.

The learner's function sees what the learner sees: the run's measurements and job code, not
its faults or settings (:meth:`labkit.capstone.CapstoneRun.public`). The job the check uses is
the one :func:`labkit.capstone.given_job` ran last in this kernel, so the check needs that cell
to have run first. Its reference is withheld (``withheld=True``): a learner's copy whose
``diagnose`` is not done shows no diagnosis; the cells after it wait for the learner's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from labkit import verdict
from labkit.capstone import (
    BY_ID,
    FIXES,
    CapstoneRun,
    Settings,
    attempts,
    faults_in,
    last_given,
    rerun,
)
from labkit.capstone import settings as st
from labkit.capstone.job import settings_after
from labkit.exercises import ExerciseFailed, _require_callable, call, exercise, short_repr

LOSS_TOLERANCE = 1e-4
"""The same training gives the same losses to rounding whatever its micro-batch split
(measured: under 1e-5 on the CPU tier); a different recipe or different data does not."""
SLOWER_THAN_RIGHT = 0.6
"""A fixed job must reach this share of the tokens/s of the job with the right settings,
measured one after the other (a busy machine varies by tens of per cent; a wrong thread count
costs more than 2x, measured)."""


def reference_diagnose(run: CapstoneRun) -> tuple[set[str], dict[str, Any]]:
    """The faults ``run``'s evidence shows, and the changes that remove them."""
    e = run.evidence()
    found: set[str] = set()
    changes: dict[str, Any] = {}
    if e["threads_total"] > e["cores"]:  # threads fighting over the cores
        found.add("oversubscribed_threads")
        changes["threads_per_rank"] = max(1, e["cores"] // len(e["forward_s"]))
    if e["data_share"] > 0.1:  # prepared data costs a few per cent of a step
        found.add("slow_loader")
        changes["prepare_data"] = "once"
    # A straggler: one rank's forward holds a delay the others spend waiting in backward's
    # all-reduce; both must show, so noise on one rank alone is not a straggler.
    # A planted delay is there in every step; threads fighting over cores slow a rank in
    # some steps and not others: so in at least 4 steps of 5 (per-step forward times).
    fwd, bwd, steps = e["forward_s"], e["backward_s"], e["forward_steps_s"]
    slow = max(range(len(fwd)), key=fwd.__getitem__)

    def slower_in_most_steps(r):  # rank `slow`'s forward 50 ms longer than r's, 4 steps of 5
        gaps = sorted(a - b for a, b in zip(steps[slow], steps[r], strict=True))
        return gaps[len(gaps) // 5] > 0.05

    if any(slower_in_most_steps(r) and bwd[r] - bwd[slow] > 0.025
           for r in range(len(fwd)) if r != slow):  # fmt: skip
        found.add("straggler")
        changes["straggler_delay_s"] = 0.0
    if e["grad_accum"] >= 8:  # a rank's share cut into 8 or more micro-batches
        found.add("tiny_micro_batch")
        changes["micro_batch"] = e["micro_batch"] * e["grad_accum"] // 2
    if e["allreduce_calls_before_last_micro_batch"] > 0:  # no no_sync: every micro-batch syncs
        found.add("sync_every_micro_batch")
        changes["no_sync"] = True
    if run.tier != "cpu" and e["dtype"] == "float32":
        found.add("fp32_on_gpu")
        changes["dtype"] = "bfloat16"
    if run.tier != "cpu" and e["host_syncs_per_step"] >= e["grad_accum"]:
        found.add("host_sync")  # a wait for the GPU in every micro-batch
        changes["loss_item_every_micro_batch"] = False
    if e["first_epoch_overlap"] > 0.5:  # the ranks trained on the same samples
        found.add("no_sampler")
        changes.update(sampler="distributed", set_epoch=True)
    elif e["epochs_seen"] > 1 and e["epoch_repeats"]:
        found.add("no_set_epoch")
        changes["set_epoch"] = True
    return found, changes


def _answer(result: Any) -> tuple[set[str], dict[str, Any]]:
    shape = "(a set of fault ids, a dict of setting changes)"
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ExerciseFailed(f"diagnose(run) returned {short_repr(result)}; return {shape}, "
                             "e.g. ({'slow_loader'}, {'prepare_data': 'once'})")  # fmt: skip
    found, changes = result
    if isinstance(found, str) or not all(isinstance(f, str) for f in found):
        raise ExerciseFailed(f"the faults found, {short_repr(found)}, should be a set of fault "
                             f"ids such as {{'slow_loader'}}; the catalogue holds {sorted(BY_ID)}")  # fmt: skip
    unknown = sorted(set(found) - set(BY_ID))
    if unknown:
        raise ExerciseFailed(f"{unknown} are not faults of the catalogue: it holds "
                             f"{sorted(BY_ID)} (capstone.FAULTS, with each one's evidence)")  # fmt: skip
    if not isinstance(changes, Mapping):
        raise ExerciseFailed(f"the changes, {short_repr(changes)}, should be a dict of setting → "
                             "value, e.g. {'prepare_data': 'once'}")  # fmt: skip
    return set(found), dict(changes)


def _steps(run: CapstoneRun) -> list[float]:
    return run.ranks[0]["step_s"][1:] or run.ranks[0]["step_s"]  # every rank waits for the slowest


def _looks_wrong(fixed: CapstoneRun, healthy: CapstoneRun, gap: float) -> list[str]:
    """The measurements of ``fixed`` that still look wrong against ``healthy``, each as what
    was measured (never a fault's name)."""
    said = []
    if fixed.tokens_per_s < SLOWER_THAN_RIGHT * healthy.tokens_per_s:
        cmp = verdict.compare_times(_steps(fixed), _steps(healthy),
                                    names=("your job's step", "the healthy job's step"))  # fmt: skip
        said.append(f"step time {healthy.tokens_per_s / fixed.tokens_per_s:.1f}× the healthy "
                    f"job's ({cmp.sentence.removeprefix(verdict.PREFIX)})")  # fmt: skip
    e, h = fixed.evidence(), healthy.evidence()
    if e["data_share"] > max(0.1, 2 * h["data_share"]):
        said.append(f"the data phase is {e['data_share']:.0%} of the step (the healthy job's: "
                    f"{h['data_share']:.0%})")  # fmt: skip
    fwd = e["forward_s"]
    if max(fwd) - min(fwd) > 0.05:
        said.append(f"one rank's forward takes {(max(fwd) - min(fwd)) * 1e3:.0f} ms longer than "
                    "another's (median per step)")  # fmt: skip
    if e["allreduce_calls_before_last_micro_batch"] > 0:
        said.append(f"{e['allreduce_calls_before_last_micro_batch']:g} all-reduce call(s) per step "
                    "before its last micro-batch")  # fmt: skip
    if e["grad_accum"] >= 8:
        said.append(f"each rank's share of the batch is cut into {e['grad_accum']} micro-batches "
                    f"of {e['micro_batch']}")  # fmt: skip
    if e["threads_total"] > e["cores"]:
        said.append(f"{e['threads_total']} PyTorch threads on {e['cores']} cores")
    if e["first_epoch_overlap"] > 0:
        said.append(f"the ranks share {e['first_epoch_overlap']:.0%} of their first epoch's samples")
    if e["epochs_seen"] > 1 and e["epoch_repeats"]:
        said.append("epoch 2 repeats epoch 1's order on every rank")
    if fixed.tier != "cpu" and e["dtype"] == "float32":
        said.append("the step computes in float32")
    if fixed.tier != "cpu" and e["host_syncs_per_step"] >= e["grad_accum"]:
        said.append(f"{e['host_syncs_per_step']:g} host sync(s) per step")
    if gap > LOSS_TOLERANCE:
        said.append(f"the losses differ from the healthy job's by up to {gap:.3g} (the same "
                    f"training: under {LOSS_TOLERANCE:g})")  # fmt: skip
    return said


_UNRECORDED: list[int] = []  # attempts at a job without a code (a job built from faults)


def _attempt(run: CapstoneRun) -> int:
    if run.code is None:
        return len(_UNRECORDED) + 1
    return len(attempts.load(run.code)["attempts"]) + 1


def _record(run: CapstoneRun, passed: bool, said: str) -> None:
    if run.code is None:
        _UNRECORDED.append(passed)
    else:
        attempts.add(run.code, passed, said)


@exercise(
    "07.diagnose",
    "Diagnose the slow job from its evidence, and fix it",
    hints=(
        "work through the suspects one at a time, as the worked example does: for each fault "
        "of capstone.FAULTS, its `evidence` says which measurement shows it. Read that number "
        "in run.evidence() and decide from the number, not from a guess",
        "each fault has a signature you can test with a threshold against what a healthy job "
        "shows: threads against cores; the share of the step spent waiting for data; one "
        "rank's forward long in nearly every step while the other waits as long in its "
        "backward (noise comes and goes, a slow rank does not); how many pieces "
        "a rank's share is cut into; all-reduces before a step's last micro-batch; the samples "
        "the ranks share; whether epoch 2 repeats epoch 1; on GPUs the dtype and host syncs",
        "each fix is one or two settings of capstone.Settings (its docstrings say which fault "
        "sets each): return them as a dict of changes, and change nothing you did not "
        "diagnose. Keep global_batch as it is: it is part of the training recipe",
        "recipe: e = run.evidence(); threads_total > cores → 'oversubscribed_threads', "
        "threads_per_rank=cores//ranks; data_share > 0.1 → 'slow_loader', prepare_data='once'; "
        "a rank whose forward is 50 ms longer than another's in 4 steps of 5 "
        "(forward_steps_s) while that one's backward is 25 ms longer → 'straggler', "
        "straggler_delay_s=0; grad_accum >= 8 → "
        "'tiny_micro_batch', micro_batch=micro_batch*grad_accum//2; "
        "allreduce_calls_before_last_micro_batch > 0 → 'sync_every_micro_batch', no_sync=True; "
        "on a GPU dtype float32 → 'fp32_on_gpu', dtype='bfloat16', and host_syncs_per_step >= "
        "grad_accum → 'host_sync', loss_item_every_micro_batch=False; first_epoch_overlap > "
        "0.5 → 'no_sampler', sampler='distributed', set_epoch=True; else epoch_repeats → "
        "'no_set_epoch', set_epoch=True",
    ),
    withheld=True,  # a reference diagnosis run on the learner's job would print its key
    time_limit_s=300.0,
)
def _verify_diagnose(diagnose: Any) -> str:
    from labkit.launch import ProgressLines

    fn = _require_callable(diagnose, "diagnose(run) -> (faults found, changes)")
    run = last_given()
    if run is None:
        raise ExerciseFailed("no capstone job has run in this kernel yet: run the cell that "
                             "calls capstone.given_job(job_code) first, then this check")  # fmt: skip
    found, changes = _answer(call(fn, run.public()))  # the learner sees measurements only
    n = _attempt(run)

    def fail(text: str) -> ExerciseFailed:
        said = f"attempt {n}: {text}"
        _record(run, False, said)
        return ExerciseFailed(said)

    # The answer's own consistency: its names against its changes (nothing of the key).
    stray = sorted(set(changes) - {name for f in found for name in FIXES[f]})
    if stray:
        raise fail(f"your changes to {stray} fix none of the faults you named: every change "
                   "needs a diagnosis behind it (capstone.FIXES says which settings fix which "
                   "fault)")  # fmt: skip
    bare = [f for f in found if not set(FIXES[f]) & set(changes)]
    if bare:
        raise fail(f"{len(bare)} of the faults you named come with no change of the settings "
                   "that fix them (capstone.FIXES): a diagnosis counts by what its changes do")  # fmt: skip
    try:
        after = settings_after(run, changes)
        fixed = rerun(run, changes, observers=[ProgressLines("07.diagnose: your changes")])
    except ValueError as err:
        raise fail(f"your changes cannot run: {err}") from None
    # The healthy job: the right settings, split into the learner's micro-batches if theirs
    # is a fair split (the same kernels and summation order, so the losses compare to
    # rounding on any device). A fix that restores it exactly is judged on its own run.
    cores, ranks, tier = fixed.ranks[0]["cores"], len(fixed.ranks), run.tier
    fair: dict[str, Any] = {"threads_per_rank": max(1, cores // ranks)}
    if (Settings().global_batch // ranks) % after.micro_batch == 0:
        fair["micro_batch"] = after.micro_batch
    right = dataclasses.replace(Settings(), **fair)
    same = after in (right, dataclasses.replace(right, threads_per_rank=None))
    healthy = fixed if same else rerun(run, dataclasses.asdict(right),
                                       observers=[ProgressLines("07.diagnose: the healthy job")])  # fmt: skip
    gap = max(abs(a - b) for a, b in zip(fixed.losses, healthy.losses, strict=True))
    left = faults_in(after, tier=tier, cores=cores, nproc=ranks)
    slow = fixed.tokens_per_s < SLOWER_THAN_RIGHT * healthy.tokens_per_s
    if left or gap > LOSS_TOLERANCE or slow:
        wrong = _looks_wrong(fixed, healthy, gap)
        raise fail(
            f"the job re-run with your changes {changes} is not healthy yet: "
            + ("; ".join(wrong) if wrong else
               "it still differs from the healthy job in a way this run's measurements did not "
               "show (a busy machine can hide a slow rank): read the evidence again, or rerun")
            + f". The healthy job runs {healthy.tokens_per_s:,.0f} tokens/s; yours "
              f"{fixed.tokens_per_s:,.0f}")  # fmt: skip
    # Names whose changes change nothing in this job: the job is healthy, the diagnosis not.
    given = settings_after(run, {})
    carried = set(faults_in(given, tier=tier, cores=cores, nproc=ranks))

    def removes(f: str) -> bool:
        own = st.apply(given, {k: changes[k] for k in FIXES[f] if k in changes})
        return bool(carried - set(faults_in(own, tier=tier, cores=cores, nproc=ranks)))

    if not all(removes(f) for f in found):
        raise fail("the job is healthy with your changes, but at least one fault you named is "
                   "fixed by changes that change nothing in this job: name only what a "
                   "measurement shows (the check does not say which: that would be the key)")  # fmt: skip
    cmp = verdict.compare_times(_steps(fixed), _steps(run), names=("fixed step", "given step"))
    record = attempts.load(run.code) if run.code else {}
    said = (f"attempt {n}: your {len(changes)} change(s) made the job healthy: "
            f"{run.tokens_per_s:,.0f} → {fixed.tokens_per_s:,.0f} tokens/s "
            f"({fixed.tokens_per_s / run.tokens_per_s:.2f}×, measured; "
            f"{cmp.sentence.removeprefix(verdict.PREFIX)}), the healthy job "
            f"{healthy.tokens_per_s:,.0f} tokens/s, the same losses (largest difference {gap:.1e})"
            + (f"; you had opened this job's key ({record['gave_up']})" if record.get("gave_up") else ""))  # fmt: skip
    _record(run, True, said)
    return said
