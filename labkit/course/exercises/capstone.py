"""Notebook 07's exercise (the capstone), checked in the kernel.

* ``07.diagnose``: ``diagnose(run) -> (faults found, changes)``: from the evidence of the
  learner's slow job (a :class:`labkit.course.capstone.CapstoneRun`), the ids of the faults it
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
  counts as an attempt in the learner's record (:mod:`labkit.course.capstone.attempts`), and its line
  shows the count.

The learner's function sees what the learner sees: the run's measurements and job code, not
its faults or settings (:meth:`labkit.course.capstone.CapstoneRun.public`). The job the check uses is
the one :func:`labkit.course.capstone.given_job` ran last in this kernel, so the check needs that cell
to have run first. Its reference is withheld (``withheld=True``): a learner's copy whose
``diagnose`` is not done shows no diagnosis; the cells after it wait for the learner's own.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping
from typing import Any

from labkit import verdict
from labkit.course.capstone import (
    BY_ID,
    FIXES,
    CapstoneRun,
    Settings,
    attempts,
    faults_in,
    last_given,
    rerun,
)
from labkit.course.capstone import settings as st
from labkit.course.capstone.evidence import OUTSIDE, Evidence, median
from labkit.course.capstone.job import settings_after
from labkit.course.capstone.trials import steps
from labkit.course.exercises import ExerciseFailed, call, exercise, short_repr
from labkit.course.exercises.learner_code import require_callable

LOSS_TOLERANCE = 1e-4
"""The same training gives the same losses to rounding whatever its micro-batch split
(measured: under 1e-5 on the CPU tier); a different recipe or different data does not."""
SLOWER_THAN_RIGHT = 0.6
"""A fixed job must reach this share of the tokens/s of the job with the right settings,
measured one after the other (a busy machine varies by tens of per cent; a wrong thread count
costs more than 2x, measured)."""


def lagging_rank(e: Evidence) -> tuple[int, int, float, int] | None:
    """(slow rank, a rank that waits for it, the forward gap in ms exceeded in 4 steps of 5,
    in how many steps the slow rank's forward is the longer) when one rank's forward is longer
    than another's by more than half that other's forward in at least 4 steps of 5, and the
    other waits for it in backward (its backward longer by half that gap); else None. Noise
    comes and goes between identical ranks, a slow rank does not: measured at lab size, the gap
    exceeded in 4 steps of 5 is -0.1 ms between healthy ranks (0.0 on 2 busy cores) and 15.3 ms
    with the planted 15 ms (13.3 on busy cores)."""
    fwd, bwd = e.phase_ms("forward"), e.phase_ms("backward")
    slow = max(range(e.world_size), key=lambda r: median(fwd[r]))
    for r in range(e.world_size):
        if r == slow:
            continue
        gaps = sorted(a - b for a, b in zip(fwd[slow][1:], fwd[r][1:], strict=True))
        floor = gaps[len(gaps) // 5]  # 4 steps of 5 have a gap at least this long
        if floor > median(fwd[r]) / 2 and median(bwd[r]) - median(bwd[slow]) > floor / 2:
            return slow, r, floor, sum(g > 0 for g in gaps)
    return None


def reference_diagnose(run: CapstoneRun) -> tuple[set[str], dict[str, Any]]:
    """The faults ``run``'s evidence shows, and the changes that remove them: one hypothesis at
    a time, each decided by a measurement against what a healthy job of this model shows."""
    e = run.evidence()
    f = e.facts()
    found: set[str] = set()
    changes: dict[str, Any] = {}

    def fault(name: str, **fix: Any) -> None:
        found.add(name)
        changes.update(fix)

    # The machine first: threads fighting over the cores make every other number erratic.
    if f["threads"] * e.world_size > e.cores:  # threads fighting over the cores
        fault("oversubscribed_threads", threads_per_rank=max(1, e.cores // e.world_size))
    # Time: where each step goes, per rank.
    data, step = e.phase_ms("data"), e.phase_ms("step")
    if max(median(d) / median(s) for d, s in zip(data, step, strict=True)) > 0.1:
        fault("slow_loader", prepare_data="once")  # prepared data costs under 1% of a step here
    # A straggler's delay is in its forward in (nearly) every step while the others wait as
    # long in backward's all-reduce; a busy machine slows a rank in some steps only, and rank
    # 0's checkpoint in a few, outside the phases.
    if lagging_rank(e) is not None:
        fault("straggler", straggler_delay_s=0.0)
    ops = e.ops_by_phase(0)  # the profiler trace's operators, per phase, per step
    if ops["backward"]["aten::isnan"] > 0:  # autograd checking every output: anomaly mode
        fault("anomaly_mode", anomaly_detection=False)
    if ops[OUTSIDE]["aten::linear"] > 0:  # a forward pass that is not training's
        fault("eval_every_step", eval_every_steps=0)
    if ops["backward"]["aten::linear"] > 0:  # backward re-running the forward's layers
        fault("needless_recompute", activation_checkpointing=False)
    # Batch and communication: micro-batches, and what each one's backward sends.
    if f["grad_accum"] >= 8:  # a rank's share cut into 8 or more pieces
        fault("tiny_micro_batch", micro_batch=f["micro_batch"] * f["grad_accum"] // 2)
    calls = e.allreduce_calls[0]
    k = len(calls[0])
    if any(median([s[j] for s in calls]) > 0 for j in range(k - 1)):  # no no_sync
        fault("sync_every_micro_batch", no_sync=True)
    # DDP's default cap is 25 MiB a bucket, plus a first bucket of 1 MiB when left unset:
    buckets = math.ceil(f["model"]["gradient_bytes"] / (25 * 2**20)) + 1
    if median([s[-1] for s in calls]) > buckets:  # many small messages, not a few large
        fault("small_buckets", bucket_cap_mb=25.0)
    # On a GPU: precision, host syncs, the optimizer's kernels, copies, alignment, NCCL.
    if run.tier != "cpu":
        if "float" in e.matmul_dtypes(0):  # the forward's matmuls in fp32, not bf16
            fault("fp32_on_gpu", dtype="bfloat16")
        if median(e.host_syncs_in("forward")[0]) >= f["grad_accum"]:  # a wait per micro-batch
            fault("host_sync", loss_item_every_micro_batch=False)
        if not any(op.startswith(("aten::_foreach", "aten::_fused")) for op in ops["optimizer"]):
            fault("unfused_optimizer", optimizer="default")  # one kernel set per tensor
        if any("HtoD (Pageable" in kind for kind in e.gpu_copies(0)):
            fault("unpinned_copies", pin_memory=True)
        if f["model"]["vocab_size"] % 64:
            fault("misaligned_vocab", vocab_multiple=64)
        if any(e.facts(r)["env"].get("NCCL_P2P_DISABLE") == "1" for r in range(e.world_size)):
            fault("nccl_p2p_disabled", nccl_p2p=True)
    # Correctness: what the ranks trained on, and how the gradient behaves.
    first = [set(epochs[0]) for epochs in e.samples]
    if e.world_size > 1 and len(first[0] & first[-1]) > len(first[0]) / 2:  # the same samples
        fault("no_sampler", sampler="distributed", set_epoch=True)
    elif all(len(ep) > 1 and ep[1] == ep[0][: len(ep[1])] for ep in e.samples):
        fault("no_set_epoch", set_epoch=True)  # epoch 2 repeats epoch 1's order
    norms = e.grad_norm[0]
    if statistics.median(norms[-3:]) > 2 * statistics.median(norms[:3]):
        fault("no_zero_grad", zero_grad=True)  # gradients adding up across steps
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


def _signs(e: Evidence, h: Evidence, tier: str) -> dict[str, str]:
    """Each catalogue fault whose measurement in ``e`` still looks wrong against the healthy
    job's ``h``, with that measurement as a sentence (which never names the fault)."""
    f = e.facts()
    said: dict[str, str] = {}

    def share(x: Evidence, phase: str) -> float:
        return max(median(p) / median(s) for p, s in zip(x.phase_ms(phase), x.phase_ms("step"), strict=True))

    if share(e, "data") > max(0.1, 2 * share(h, "data")):
        said["slow_loader"] = (f"the data phase is {share(e, 'data'):.0%} of the step (the "
                               f"healthy job's: {share(h, 'data'):.0%})")  # fmt: skip
    lag = lagging_rank(e)
    if lag is not None:
        slow, r, floor, n = lag
        fwd = e.phase_ms("forward")
        said["straggler"] = (f"rank {slow}'s forward is longer than rank {r}'s in {n} of "
                             f"{len(fwd[r]) - 1} steps, by {floor:.1f} ms or more in 4 of 5 "
                             f"(medians {median(fwd[slow]):.1f} and {median(fwd[r]):.1f} ms), and "
                             f"rank {r} waits in backward")  # fmt: skip
    if share(e, "other") > max(0.05, 3 * share(h, "other")):
        said["eval_every_step"] = (f"{share(e, 'other'):.0%} of each step is spent outside its "
                                   f"labelled phases (the healthy job: {share(h, 'other'):.0%})")  # fmt: skip
    ops = e.ops_by_phase(0)
    if ops["backward"]["aten::linear"] > 0:
        said["needless_recompute"] = "backward runs the forward's layers again (the trace's operators)"
    if ops["backward"]["aten::isnan"] > 0:
        said["anomaly_mode"] = (f"backward checks its outputs for NaN "
                                f"({ops['backward']['aten::isnan']:g} aten::isnan per step)")  # fmt: skip
    calls = e.allreduce_calls[0]
    early = sum(median([s[j] for s in calls]) for j in range(len(calls[0]) - 1))
    if early > 0:
        said["sync_every_micro_batch"] = f"{early:g} all-reduce call(s) per step before its last micro-batch"
    last, last_h = median([s[-1] for s in calls]), median([s[-1] for s in h.allreduce_calls[0]])
    if last > last_h + 1:
        said["small_buckets"] = (f"{last:g} all-reduce calls in the last micro-batch's backward "
                                 f"(the healthy job: {last_h:g}) for the same "
                                 f"{f['model']['gradient_bytes']:,} bytes")  # fmt: skip
    if f["grad_accum"] >= 8:
        said["tiny_micro_batch"] = (f"each rank's share of the batch is cut into {f['grad_accum']} "
                                    f"micro-batches of {f['micro_batch']}")  # fmt: skip
    if f["threads"] * e.world_size > e.cores:
        said["oversubscribed_threads"] = f"{f['threads'] * e.world_size} PyTorch threads on {e.cores} cores"
    first = [set(epochs[0]) for epochs in e.samples]
    overlap = len(first[0] & first[-1]) / max(1, len(first[0]))
    if e.world_size > 1 and overlap > 0:
        said["no_sampler"] = f"the ranks share {overlap:.0%} of their first epoch's samples"
    if all(len(ep) > 1 and ep[1] == ep[0][: len(ep[1])] for ep in e.samples):
        said["no_set_epoch"] = "epoch 2 repeats epoch 1's order on every rank"
    norms, norms_h = e.grad_norm[0], h.grad_norm[0]
    if statistics.median(norms[-3:]) > 2 * statistics.median(norms[:3]):
        said["no_zero_grad"] = (f"the gradient norm grows from {norms[0]:.2f} to {norms[-1]:.2f} "
                                f"over the run (the healthy job's: {norms_h[0]:.2f} to "
                                f"{norms_h[-1]:.2f})")  # fmt: skip
    if tier != "cpu":
        if "float" in e.matmul_dtypes(0):
            said["fp32_on_gpu"] = "the forward's matmuls run in float32 (the trace's input types)"
        if median(e.host_syncs_in("forward")[0]) >= f["grad_accum"]:
            said["host_sync"] = f"{median(e.host_syncs_in('forward')[0]):g} host sync(s) per step in forward"
        opt, opt_h = (median(x.phase_ms("optimizer")[0]) for x in (e, h))
        if not any(op.startswith(("aten::_foreach", "aten::_fused")) for op in ops["optimizer"]):
            said["unfused_optimizer"] = (f"the optimizer phase runs no foreach or fused operator "
                                         f"({opt:.1f} ms; the healthy job's {opt_h:.1f} ms)")  # fmt: skip
        if any("HtoD (Pageable" in kind for kind in e.gpu_copies(0)):
            said["unpinned_copies"] = "the batches are copied to the GPU from pageable memory"
        if f["model"]["vocab_size"] % 64:
            said["misaligned_vocab"] = f"the output layer has {f['model']['vocab_size']} rows"
        if any(e.facts(r)["env"].get("NCCL_P2P_DISABLE") == "1" for r in range(e.world_size)):
            said["nccl_p2p_disabled"] = "the ranks' environment holds NCCL_P2P_DISABLE=1"
    return said


def _looks_wrong(fixed: CapstoneRun, healthy: CapstoneRun, gap: float,
                 named: set[str]) -> list[str]:  # fmt: skip
    """What still looks wrong in ``fixed`` against ``healthy``, as measurements, never names:
    the outcome (speed against the healthy job, with a verdict on the samples; the losses)
    always, and a fault's own measurement only for the faults the learner ``named`` (their fix
    did not take). Every measurement of every fault would be the key, one line per fault."""
    said = []
    if fixed.tokens_per_s < SLOWER_THAN_RIGHT * healthy.tokens_per_s:
        cmp = verdict.compare_times(steps(fixed), steps(healthy),
                                    names=("your job's step", "the healthy job's step"))  # fmt: skip
        said.append(f"step time {healthy.tokens_per_s / fixed.tokens_per_s:.1f}× the healthy "
                    f"job's ({cmp.sentence.removeprefix(verdict.PREFIX)})")  # fmt: skip
    if gap > LOSS_TOLERANCE:
        said.append(f"the losses differ from the healthy job's by up to {gap:.3g} (the same "
                    f"training: under {LOSS_TOLERANCE:g})")  # fmt: skip
    signs = _signs(fixed.evidence(), healthy.evidence(), fixed.tier)
    mine = [line for fault, line in signs.items() if fault in named]
    if mine:
        said.append("for the faults you named, still: " + "; ".join(mine))
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
        "the method first: take the suspects of section 1 one at a time, in the order of "
        "capstone.FIXES; for each, find the measurement its `where` names in run.evidence() "
        "and decide from the number against what a healthy job shows (section 2's prediction, "
        "the other rank, a formula of notebooks 01-06), not from a guess. Return the ids you "
        "found and, for each, a dict of changes to capstone.Settings (its docstrings say what "
        "each field does); change nothing you did not diagnose, and keep global_batch",
        "time first: the data phase's share of the step; one rank's forward long in nearly "
        "every step while the other waits as long in its backward (noise comes and goes, a slow "
        "rank does not); time outside the phases. Then the trace: ops_by_phase shows operators "
        "where they do not belong (a forward outside the phases, the forward's layers inside "
        "backward, NaN checks inside backward)",
        "then the machine, the batch and the messages: threads × ranks against cores; how many "
        "micro-batches a rank's share is cut into; all-reduce calls before the last "
        "micro-batch, and how many in the last against the gradient's size and DDP's 25 MB "
        "buckets. Then correctness: the samples the ranks share, whether epoch 2 repeats epoch "
        "1, whether the gradient norm settles or grows. On GPUs: the matmuls' dtypes, host "
        "syncs in forward, the optimizer phase's operators, the host-to-device copies, the "
        "vocabulary's size, NCCL's environment",
        "recipe: read the run's evidence once (its facts and rank 0's operators per phase). "
        "For each id of capstone.FIXES, in order: compute the one number its 'where' names in this job (a "
        "share of the step, a count per step, one rank against the other, an overlap of two "
        "sets); compute what a healthy job shows for it (section 2's prediction, the other "
        "rank, or the rule the notebook that teaches it gives); name the fault only where the "
        "two differ by more than the run's own spread. For its change, read the field's "
        "docstring in capstone.Settings: it says what the healthy job uses, and which other "
        "remedy works when there are cores to spare",
    ),
    withheld=True,  # a reference diagnosis run on the learner's job would print its key
    time_limit_s=300.0,
)
def _verify_diagnose(diagnose: Any) -> str:
    from labkit.jobs.launch import ProgressLines

    fn = require_callable(diagnose, "diagnose(run) -> (faults found, changes)")
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
    # is a fair split and not itself too small (the same kernels and summation order, so the
    # losses compare to rounding on any device). A fix that restores it exactly is judged on
    # its own run.
    cores, ranks, tier = fixed.ranks[0]["cores"], len(fixed.ranks), run.tier
    fair: dict[str, Any] = {"threads_per_rank": max(1, cores // ranks)}
    share = Settings().global_batch // ranks
    if share % after.micro_batch == 0 and "tiny_micro_batch" not in faults_in(
            dataclasses.replace(Settings(), micro_batch=after.micro_batch), tier=tier, cores=cores,
            nproc=ranks):  # a fair split, not the tiny one: the healthy job is not slowed by it
        fair["micro_batch"] = after.micro_batch
    if after.vocab_size % 64 == 0:  # any aligned padding is right; the model's size follows it
        fair["vocab_multiple"] = after.vocab_multiple
    right = dataclasses.replace(Settings(), **fair)
    same = after in (right, dataclasses.replace(right, threads_per_rank=None))
    healthy = fixed if same else rerun(run, dataclasses.asdict(right),
                                       observers=[ProgressLines("07.diagnose: the healthy job")])  # fmt: skip
    gap = max(abs(a - b) for a, b in zip(fixed.losses, healthy.losses, strict=True))
    left = faults_in(after, tier=tier, cores=cores, nproc=ranks)
    slow = fixed.tokens_per_s < SLOWER_THAN_RIGHT * healthy.tokens_per_s
    if left or gap > LOSS_TOLERANCE or slow:
        wrong = _looks_wrong(fixed, healthy, gap, found)
        raise fail(
            f"the job re-run with your changes {changes} is not healthy yet: "
            + ("; ".join(wrong) if wrong else
               "its speed and losses are within what this run can tell from the healthy job's, "
               "and yet it still differs from it (a fault that costs little at this size, or a "
               "busy machine hiding a slow rank): read the evidence again")
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
    cmp = verdict.compare_times(steps(fixed), steps(run), names=("fixed step", "given step"))
    record = attempts.load(run.code) if run.code else {}
    said = (f"attempt {n}: your {len(changes)} change(s) made the job healthy: "
            f"{run.tokens_per_s:,.0f} → {fixed.tokens_per_s:,.0f} tokens/s "
            f"({fixed.tokens_per_s / run.tokens_per_s:.2f}×, measured; "
            f"{cmp.sentence.removeprefix(verdict.PREFIX)}), the healthy job "
            f"{healthy.tokens_per_s:,.0f} tokens/s, the same losses (largest difference {gap:.1e})"
            + (f"; you had opened this job's key ({record['gave_up']})" if record.get("gave_up") else ""))  # fmt: skip
    _record(run, True, said)
    return said
