"""Notebook 07's check: the diagnosis against the seed's key, then the job re-run with the
learner's changes. The logic runs on stand-in runs (no job launched); one test runs it all
for real on a 2-rank job."""

from __future__ import annotations

import dataclasses

import pytest
from exercise_cells import assert_check_passes, assert_stub_is_not_done, run_cell

from labkit import capstone
from labkit import exercises as ex
from labkit.capstone import settings as st
from labkit.exercises import capstone as excap

SOLUTION = """
def diagnose(run):
    \"\"\"(the fault ids `run`'s evidence shows, the setting changes that remove them).\"\"\"
    # BEGIN SOLUTION
    e = run.evidence()
    found, changes = set(), {}
    if e["threads_total"] > e["cores"]:  # threads fighting over the cores
        found.add("oversubscribed_threads")
        changes["threads_per_rank"] = max(1, e["cores"] // len(e["forward_s"]))
    if e["data_share"] > 0.1:  # prepared data costs a few per cent of a step
        found.add("slow_loader")
        changes["prepare_data"] = "once"
    # A straggler's delay is in its forward in (nearly) every step, and the others wait as
    # long in backward; threads fighting over cores slow a rank in some steps, not all.
    fwd, bwd, steps = e["forward_s"], e["backward_s"], e["forward_steps_s"]
    slow = max(range(len(fwd)), key=fwd.__getitem__)

    def slower_in_most_steps(r):  # rank `slow`'s forward 50 ms longer than r's, 4 steps of 5
        gaps = sorted(a - b for a, b in zip(steps[slow], steps[r], strict=True))
        return gaps[len(gaps) // 5] > 0.05

    if any(slower_in_most_steps(r) and bwd[r] - bwd[slow] > 0.025
           for r in range(len(fwd)) if r != slow):
        found.add("straggler")
        changes["straggler_delay_s"] = 0.0
    if e["grad_accum"] >= 8:  # a rank's share cut into 8 or more micro-batches
        found.add("tiny_micro_batch")
        changes["micro_batch"] = e["micro_batch"] * e["grad_accum"] // 2
    if e["allreduce_calls_before_last_micro_batch"] > 0:  # no no_sync
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
    # END SOLUTION
answer = diagnose
"""
PLANTED = ("slow_loader", "straggler", "no_set_epoch")


def fake_run(settings: st.Settings, *, tokens_per_s: float = 1000.0,
             losses: tuple[float, ...] = (3.0, 2.9)) -> capstone.CapstoneRun:  # fmt: skip
    """A stand-in for a run of ``settings``: its faults read from the settings, its numbers
    given (2 ranks on 2 cores, the CPU tier)."""
    faults = st.faults_in(settings, tier="cpu", cores=2, nproc=2)
    rank = {"tokens_per_s": tokens_per_s, "losses": list(losses), "world_size": 2, "cores": 2}
    return capstone.CapstoneRun(faults, [rank, rank], 1.0, settings=settings, tier="cpu",
                                seed=10)  # fmt: skip


@pytest.fixture
def given(monkeypatch):
    """The learner's job carries PLANTED; a re-run is a stand-in run of its new settings, as
    fast as the right job unless it oversubscribes, with other losses if it changes the
    recipe. Returns the list of settings re-run."""
    job = fake_run(st.given(PLANTED, cores=2), tokens_per_s=300.0)
    reruns: list[st.Settings] = []

    def rerun(run, changes, **kwargs):
        s = st.apply(run.settings, changes)
        st.worker_config(s, tier="cpu", cores=2, nproc=2)  # refuses what the job would
        reruns.append(s)
        slow = "oversubscribed_threads" in st.faults_in(s, tier="cpu", cores=2, nproc=2)
        other = s.global_batch != 32 or s.sampler != "distributed"
        return fake_run(s, tokens_per_s=150.0 if slow else 1000.0,
                        losses=(3.0, 2.5) if other else (3.0, 2.9))  # fmt: skip

    monkeypatch.setattr(excap, "last_given", lambda: job)
    monkeypatch.setattr(excap, "rerun", rerun)
    evidence = {
        "data_share": 0.3, "grad_accum": 2, "micro_batch": 8, "allreduce_calls_per_step": 1,
        "allreduce_calls_before_last_micro_batch": 0,
        "forward_s": [0.007, 0.107], "backward_s": [0.11, 0.013], "threads_total": 2,
        "forward_steps_s": [[0.007] * 7, [0.107] * 7],
        "cores": 2, "first_epoch_overlap": 0.0, "epochs_seen": 2, "epoch_repeats": True,
        "dtype": "float32", "host_syncs_per_step": 0}  # fmt: skip
    monkeypatch.setattr(capstone.CapstoneRun, "evidence", lambda self: evidence)
    return reruns


def test_the_notebook_07_exercise_is_registered():
    assert [e.id for e in ex.catalogue("07")] == ["07.diagnose"]
    hints = ex.get("07.diagnose").hints
    assert 3 <= len(hints) <= 4 and hints[-1].startswith("recipe:")


def test_check_passes_on_the_solution_and_on_the_reference(given, capsys):
    assert_check_passes("07.diagnose", SOLUTION, capsys)
    assert given[0] == st.Settings()  # the right settings: no second run needed


def test_the_stub_is_not_done_and_gives_nothing_away(given, capsys):
    assert_stub_is_not_done("07.diagnose", SOLUTION, capsys,
                            secrets=("data_share", "prepare_data", "set_epoch"))  # fmt: skip


def answer(found, changes):
    return lambda run: (set(found), dict(changes))


RIGHT = {"prepare_data": "once", "straggler_delay_s": 0.0, "set_epoch": True}


@pytest.mark.parametrize("wrong, message", [
    (answer(PLANTED, {"prepare_data": "once", "set_epoch": True}),
     r"still carries 1 fault\(s\): straggler \(a straggler rank: its evidence is per-rank"),
    (answer(PLANTED, {}), r"still carries 3 fault\(s\): slow_loader .*straggler .*no_set_epoch"),
    (answer(("slow_loader", "straggler"), RIGHT),
     r"not named, though your changes fixed them: \['no_set_epoch'\]"),
    (answer((*PLANTED, "tiny_micro_batch"), RIGHT),
     r"named, but not in this job: \['tiny_micro_batch'\]"),
    (answer(PLANTED, {**RIGHT, "global_batch": 64}),
     r"trains a different model: .*global_batch=64 \(right: 32\)"),
    (answer(PLANTED, {**RIGHT, "threads_per_rank": 4}),
     r"still carries 1 fault\(s\): oversubscribed_threads"),
    (answer(PLANTED, {**RIGHT, "micro_batch": 5}),
     r"cannot run: micro_batch=5 does not divide a rank's share .* use one of \[1, 2, 4, 8, 16\]"),
    (answer(PLANTED, {**RIGHT, "workers": 2}), r"not settings of the job"),
    (answer(PLANTED, {**RIGHT, "no_sync": "yes"}), r"no_sync='yes' is not allowed: give a bool"),
    (lambda run: {"slow_loader"}, r"return \(a set of fault ids, a dict of setting changes\)"),
    (lambda run: ("slow_loader", {}), r"should be a set of fault ids"),
    (lambda run: ({"gremlins"}, {}), r"\['gremlins'\] are not faults of the catalogue"),
    (lambda run: (set(PLANTED), [("prepare_data", "once")]), r"should be a dict of setting"),
])  # fmt: skip
def test_each_mistake_is_named(given, wrong, message):
    with pytest.raises(ex.ExerciseFailed, match=message):
        ex.verify("07.diagnose", wrong)


def test_a_change_that_costs_speed_is_caught(monkeypatch):
    """Too few threads removes oversubscription but runs slower than the right job (stand-in
    numbers: one thread per rank on 4 cores against a fair two)."""
    def run_of(settings, tokens_per_s):
        faults = st.faults_in(settings, tier="cpu", cores=4, nproc=2)
        rank = {"tokens_per_s": tokens_per_s, "losses": [3.0, 2.9], "world_size": 2, "cores": 4}
        return capstone.CapstoneRun(faults, [rank, rank], 1.0, settings=settings, seed=3)

    job = run_of(st.given(["oversubscribed_threads"], cores=4), 300.0)
    monkeypatch.setattr(excap, "last_given", lambda: job)
    monkeypatch.setattr(excap, "rerun", lambda run, changes, **kw: run_of(
        st.apply(run.settings, changes),
        200.0 if st.apply(run.settings, changes).threads_per_rank == 1 else 1000.0))
    with pytest.raises(ex.ExerciseFailed, match=r"one of your changes costs speed\. Settings "
                                                r"that differ: threads_per_rank=1 \(right: None\)"):
        ex.verify("07.diagnose", answer(["oversubscribed_threads"], {"threads_per_rank": 1}))
    ex.verify("07.diagnose", answer(["oversubscribed_threads"], {"threads_per_rank": 2}))


def test_a_change_no_named_fault_needs_is_refused(given):
    with pytest.raises(ex.ExerciseFailed, match=r"your changes to \['micro_batch'\] fix none of "
                                                r"the faults you named"):
        ex.verify("07.diagnose", answer(PLANTED, {**RIGHT, "micro_batch": 4}))


def test_the_learners_function_sees_measurements_not_the_key(given):
    seen = []
    ex.verify("07.diagnose", lambda run: seen.append(run) or (set(PLANTED), dict(RIGHT)))
    assert seen[0].faults == () and seen[0].settings is None


def test_without_a_job_the_check_says_which_cell_to_run(monkeypatch):
    monkeypatch.setattr(excap, "last_given", lambda: None)
    with pytest.raises(ex.ExerciseFailed, match=r"calls capstone.given_job\(seed\) first"):
        ex.verify("07.diagnose", excap.reference_diagnose)


def test_settings_round_trip_every_plan():
    """A seed's given settings carry exactly its planted faults, on every tier, and the
    right settings carry none."""
    for tier in ("cpu", "single-gpu", "multi-gpu"):
        for seed in range(100):
            planted = capstone.plan(seed, tier)
            s = st.given(planted, cores=2)
            assert st.faults_in(s, tier=tier, cores=2, nproc=2) == planted
        assert st.faults_in(st.Settings(), tier=tier, cores=2, nproc=2) == ()
    with pytest.raises(ValueError, match="dtype='fp8' is not allowed"):
        dataclasses.replace(st.Settings(), dtype="fp8")


@pytest.mark.slow
def test_the_check_runs_the_real_job_and_passes_the_solution_only(capsys):
    """For real: seed 10's job on 2 gloo ranks (slow loader, straggler, no set_epoch); the
    solution passes with a measured speed-up; a diagnosis that leaves the straggler fails."""
    run = capstone.given_job(10)
    assert run.faults == () and run.settings is None and "seed 10" in repr(run)  # key hidden
    assert set(capstone.last_given().faults) == set(PLANTED)
    found, _ = excap.reference_diagnose(run)
    assert found == set(PLANTED), run.evidence_text()
    mine = run_cell(SOLUTION)
    assert ex.check("07.diagnose", mine) is mine
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("✓ 07.diagnose: ") and "tokens/s" in lines[-1]
    assert all(line.startswith("07.diagnose: your changes") for line in lines[:-1])  # progress
    with pytest.raises(ex.ExerciseFailed, match=r"still carries 1 fault\(s\): straggler"):
        ex.verify("07.diagnose", answer(PLANTED, {"prepare_data": "once", "set_epoch": True}))
