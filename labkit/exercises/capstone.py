"""Notebook 07's exercise (the capstone), checked in the kernel.

* ``07.diagnose``: ``diagnose(run) -> (faults found, changes)``: from the evidence of the
  learner's slow job (a :class:`labkit.capstone.CapstoneRun`), the ids of the faults it
  carries, and the changes to its settings that remove them. The check compares the diagnosis
  with the seed's answer key, then re-runs the job with the changes, for real: it names any
  fault still present, and catches a change that trains a different model (the losses differ
  from the job with the right settings), that slows the job, or that no named fault needs.
  The learner's function sees what the learner sees: the run's measurements, not its faults
  or settings (:meth:`labkit.capstone.CapstoneRun.public`).

The job the check uses is the one :func:`labkit.capstone.given_job` ran last in this kernel,
so the check needs that cell to have run first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from labkit.capstone import BY_ID, FIXES, CapstoneRun, Settings, last_given, rerun
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


def _differences(s: Settings) -> list[str]:
    right = Settings()
    return [f"{f.name}={getattr(s, f.name)!r} (right: {getattr(right, f.name)!r})"
            for f in dataclasses.fields(s) if getattr(s, f.name) != getattr(right, f.name)]  # fmt: skip


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
    reference=reference_diagnose,
    time_limit_s=300.0,
)
def _verify_diagnose(diagnose: Any) -> str:
    from labkit.launch import ProgressLines

    fn = _require_callable(diagnose, "diagnose(run) -> (faults found, changes)")
    run = last_given()
    if run is None:
        raise ExerciseFailed("no capstone job has run in this kernel yet: run the cell that "
                             "calls capstone.given_job(seed) first, then this check")  # fmt: skip
    found, changes = _answer(call(fn, run.public()))  # the learner sees measurements only
    try:
        fixed = rerun(run, changes, observers=[ProgressLines("07.diagnose: your changes")])
    except ValueError as err:
        raise ExerciseFailed(f"your changes cannot run: {err}") from None
    planted = set(run.faults)
    left = [BY_ID[f] for f in fixed.faults]
    if left:
        raise ExerciseFailed(
            f"the job re-run with your changes {changes} still carries "
            f"{len(left)} fault(s): " + "; ".join(f"{f.id} ({f.title}: its evidence is {f.evidence})"
                                                    for f in left))  # fmt: skip
    if found != planted:
        missed, wrong = sorted(planted - found), sorted(found - planted)
        raise ExerciseFailed(
            "your changes remove every fault, but the diagnosis does not match them"
            + (f"; not named, though your changes fixed them: {missed}" if missed else "")
            + (f"; named, but not in this job: {wrong} (read their evidence again)" if wrong else ""))  # fmt: skip
    # The right job, split into the learner's micro-batches if theirs is a fair split (the
    # same kernels and summation order, so the losses compare to rounding on any device).
    cores, ranks = fixed.ranks[0]["cores"], len(fixed.ranks)
    fair: dict[str, Any] = {"threads_per_rank": max(1, cores // ranks)}
    if (Settings().global_batch // ranks) % fixed.settings.micro_batch == 0:
        fair["micro_batch"] = fixed.settings.micro_batch
    right_settings = dataclasses.replace(Settings(), **fair)
    same = fixed.settings in (right_settings, dataclasses.replace(right_settings, threads_per_rank=None))
    right = fixed if same else rerun(run, dataclasses.asdict(right_settings),
                                     observers=[ProgressLines("07.diagnose: the right settings")])  # fmt: skip
    gap = max(abs(a - b) for a, b in zip(fixed.losses, right.losses, strict=True))
    if gap > LOSS_TOLERANCE:
        raise ExerciseFailed(
            f"the job is fixed but trains a different model: its losses differ from the job "
            f"with the right settings by up to {gap:.3g} (same training: under {LOSS_TOLERANCE:g}). "
            f"Settings that differ: {', '.join(_differences(fixed.settings)) or 'none'}")  # fmt: skip
    if fixed.tokens_per_s < SLOWER_THAN_RIGHT * right.tokens_per_s:
        raise ExerciseFailed(
            f"the fixed job ran {fixed.tokens_per_s:,.0f} tokens/s, below "
            f"{SLOWER_THAN_RIGHT:.0%} of the {right.tokens_per_s:,.0f} of the job with the right "
            f"settings (measured one after the other): one of your changes costs speed. "
            f"Settings that differ: {', '.join(_differences(fixed.settings)) or 'none'}")  # fmt: skip
    named = {name for f in found for name in FIXES[f]}
    stray = sorted(set(changes) - named)
    if stray:
        raise ExerciseFailed(
            f"your changes to {stray} fix none of the faults you named ({sorted(found)}): every "
            f"change needs a diagnosis behind it (capstone.FIXES says which settings fix which "
            f"fault)")  # fmt: skip
    return (f"diagnose named the job's {len(planted)} planted faults ({', '.join(sorted(planted))}) "
            f"and its changes removed them: {run.tokens_per_s:,.0f} → {fixed.tokens_per_s:,.0f} "
            f"tokens/s ({fixed.tokens_per_s / run.tokens_per_s:.2f}×, measured), the same losses "
            f"as the job with the right settings (largest difference {gap:.1e})")  # fmt: skip
