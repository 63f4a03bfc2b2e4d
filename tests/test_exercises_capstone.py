"""Notebook 07's check: it re-runs the job with the learner's changes and grades what they do,
never naming a fault the learner did not find. The logic runs on stand-in runs (no job
launched); the cheats are tried against it, and one test runs it all for real on a 2-rank job."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
from exercise_cells import assert_stub_is_not_done, run_cell

from labkit.course import capstone
from labkit.course import exercises as ex
from labkit.course.capstone import attempts, keys
from labkit.course.capstone import settings as st
from labkit.course.exercises import capstone as excap
from labkit.jobs import runtime

NOTEBOOK = Path(__file__).resolve().parents[1] / "solutions" / "07_capstone.ipynb"


def solution_cell() -> str:
    """Notebook 07's own `diagnose` cell (solutions/), up to the check, with the imports its
    setup cell gives it: the tests run the notebook's answer, not a copy of it."""
    cells = {c["id"]: c["source"] for c in json.loads(NOTEBOOK.read_text())["cells"]}
    source = "".join(cells["nb07-10"])
    body = source[: source.index("\ndiagnose = ex.check(")]
    setup = ("import math\nimport statistics\n\n"
             "from labkit.course.capstone.evidence import OUTSIDE, median\n\n\n")  # fmt: skip
    return setup + body.rstrip() + "\n\n\nanswer = diagnose\n"


SOLUTION = solution_cell()
PLANTED = capstone.EXAMPLE_FAULTS  # slow_loader, straggler, no_set_epoch
FAULT_ID = re.compile(r"\b(" + "|".join(capstone.BY_ID) + r")\b")


def names_a_fault(text: str) -> list[str]:
    """The fault ids in ``text`` as words of their own (a setting such as straggler_delay_s
    is not the fault straggler)."""
    return FAULT_ID.findall(text)


def stand_in_rank(rank: int, settings: st.Settings, faults: tuple[str, ...], *,
                  tokens_per_s: float, losses: tuple[float, ...], cores: int) -> dict:
    """What a rank of a job with ``settings`` reports (the worker's fields), its numbers made
    up to show ``faults`` as a real run does (test_capstone.py measures the real ones)."""
    steps, share = 8, 16
    k = share // settings.micro_batch
    step = 32 * 64 / tokens_per_s
    data = step * (0.3 if "slow_loader" in faults else 0.01)
    other = step * (0.3 if "eval_every_step" in faults else 0.01)
    rest = step - data - other - 0.05 * step  # forward and backward, 1:2 (1:3 recomputing)
    fwd = rest / (4 if "needless_recompute" in faults else 3)
    bwd = rest - fwd
    if "straggler" in faults:  # half the last rank's forward is the delay, which rank 0 waits
        lag = fwd / 2          # out in backward (measured: 21 ms of forward against 6)
        fwd, bwd = (fwd, bwd) if rank == 1 else (fwd - lag, bwd + lag)
    early = 1 if "sync_every_micro_batch" in faults else 0
    last = 14 if "small_buckets" in faults else 1
    order = list(range(64)) if rank == 0 or "no_sampler" in faults else list(range(64, 128))
    again = order if "no_set_epoch" in faults or "no_sampler" in faults else order[::-1]
    norms = [0.6 * (i + 1) for i in range(steps)] if "no_zero_grad" in faults else [0.6] * steps
    return {
        "rank": rank, "world_size": 2, "device": "cpu", "backend": "gloo", "cores": cores,
        "tokens_per_s": tokens_per_s, "losses": list(losses), "val_losses": [(steps, 4.6)],
        "step_s": [step * (1 + 0.001 * i) for i in range(steps)], "data_s": [data] * steps,
        "forward_s": [fwd] * steps, "backward_s": [bwd] * steps,
        "optimizer_s": [0.05 * step] * steps,
        "allreduce_calls": [[early] * (k - 1) + [last]] * steps,
        "allreduce_bytes": [[early * 500_000] * (k - 1) + [500_000]] * steps,
        "grad_norm": norms, "memory_mb": [330.0] * steps,
        "host_syncs": [{"forward": 0, "backward": 0}] * steps,
        "threads": settings.threads_per_rank or max(1, cores // 2), "env": {},
        "runtime": {"grad_enabled": True},
        "loader": {"dataset": "Prepared", "item_ms": 0.002, "prepare_s": 0.12}, "optimizer": {"class": "AdamW"},
        "model": {"vocab_size": 320, "gradient_bytes": 500_000, "tensors": 36, "parameters": 125_000},
        "global_batch": 32, "micro_batch": settings.micro_batch, "grad_accum": k,
        "indices": [order, again], "trace": None, "stand_in_faults": faults,
    }  # fmt: skip


def fake_run(settings: st.Settings, *, tokens_per_s: float = 1000.0,
             losses: tuple[float, ...] = (3.0, 2.9), cores: int = 2) -> capstone.CapstoneRun:  # fmt: skip
    """A stand-in for a run of ``settings``: its faults read from the settings, its numbers
    given (2 ranks on ``cores`` cores, the CPU tier); its evidence shows its faults."""
    faults = st.faults_in(settings, tier="cpu", cores=cores, nproc=2)
    ranks = [stand_in_rank(r, settings, faults, tokens_per_s=tokens_per_s, losses=losses,
                           cores=cores) for r in range(2)]  # fmt: skip
    return capstone.CapstoneRun(faults, ranks, 1.0, settings=settings, tier="cpu", seed=10)


def stand_in_ops(self, rank=0):
    """The traced operators per phase of a stand-in run (no trace file): a forward outside the
    phases under eval_every_step, forward layers in backward under needless_recompute."""
    from collections import Counter

    from labkit.course.capstone.evidence import OUTSIDE, PHASES

    f = self.ranks[rank]["stand_in_faults"]
    ops = {p: Counter() for p in (*PHASES, OUTSIDE)}
    ops["forward"]["aten::linear"] = 24
    ops["backward"]["aten::linear"] = 24 if "needless_recompute" in f else 0
    ops["backward"]["aten::isnan"] = 264 if "anomaly_mode" in f else 0
    ops[OUTSIDE]["aten::linear"] = 48 if "eval_every_step" in f else 0
    return ops


@pytest.fixture(autouse=True)
def _stand_in_traces(monkeypatch):
    """Stand-in runs have no trace files: their operators come from stand_in_ops."""
    from labkit.course.capstone.evidence import Evidence

    real = Evidence.ops_by_phase

    def ops_by_phase(self, rank=0):
        if "stand_in_faults" in self.ranks[rank]:
            return stand_in_ops(self, rank)
        return real(self, rank)

    monkeypatch.setattr(Evidence, "ops_by_phase", ops_by_phase)


@pytest.fixture
def given(monkeypatch):
    """The learner's job carries PLANTED; a re-run is a stand-in run of its new settings, as
    fast as the right job unless it keeps a speed fault, with other losses if it changes the
    recipe or the data. Returns the list of settings re-run."""
    job = fake_run(st.given(PLANTED, cores=2), tokens_per_s=300.0)
    reruns: list[st.Settings] = []

    def rerun(run, changes, **kwargs):
        s = st.apply(run.settings, changes)
        st.worker_config(s, tier="cpu", cores=2, nproc=2)  # refuses what the job would
        reruns.append(s)
        left = st.faults_in(s, tier="cpu", cores=2, nproc=2)
        slow = any(capstone.BY_ID[f].kind == "speed" for f in left)
        other = s.global_batch != 32 or s.sampler != "distributed" or not s.set_epoch
        return fake_run(s, tokens_per_s=150.0 if slow else 1000.0,
                        losses=(3.0, 2.5) if other else (3.0, 2.9))  # fmt: skip

    monkeypatch.setattr(excap, "last_given", lambda: job)
    monkeypatch.setattr(excap, "rerun", rerun)
    return reruns


def test_the_notebook_07_exercise_is_registered_and_withholds_its_reference():
    assert [e.id for e in ex.catalogue("07")] == ["07.diagnose"]
    exercise = ex.get("07.diagnose")
    assert 3 <= len(exercise.hints) <= 4 and exercise.hints[-1].startswith("recipe:")
    assert exercise.withheld and exercise.reference is None  # nothing to print the key with
    # The recipe is a method, not the key's table: no fault id, no setting's value.
    recipe = exercise.hints[-1]
    assert not names_a_fault(recipe)
    assert not any(f"{name}=" in recipe for name in st.Settings.__dataclass_fields__)


def test_check_passes_on_the_solution_and_on_the_reference(given, capsys):
    mine = run_cell(SOLUTION)
    assert ex.check("07.diagnose", mine) is mine
    out = capsys.readouterr().out
    assert out.startswith("✓ 07.diagnose: attempt 1: ") and out.count("\n") == 1
    assert "tokens/s" in out and not names_a_fault(out)
    assert given[0] == st.Settings()  # the right settings: no second run needed
    ex.verify("07.diagnose", excap.reference_diagnose)


def test_the_stub_is_not_done_gives_nothing_away_and_later_cells_wait(given, capsys):
    assert_stub_is_not_done("07.diagnose", SOLUTION, capsys,
                            secrets=("prepare_data", "set_epoch", "anomaly_detection"))  # fmt: skip
    stub = run_cell(__import__("exercise_cells").stub_of(SOLUTION))
    assert ex.check("07.diagnose", stub) is None
    assert "Later cells wait for your answer" in capsys.readouterr().out


def answer(found, changes):
    return lambda run: (set(found), dict(changes))


RIGHT = {"prepare_data": "once", "straggler_delay_s": 0.0, "set_epoch": True}


@pytest.mark.parametrize("wrong, message", [
    (answer(PLANTED, {"prepare_data": "once", "set_epoch": True, "straggler_delay_s": 0.1}),
     r"not healthy yet: step time 6\.7× the healthy job's .*rank 1's forward is longer than "
     r"rank 0's in 7 of 7 steps, by 2116\.3 ms or more in 4 of 5 .*and rank 0 waits in backward"),
    (answer(PLANTED, {"prepare_data": "per_item", "set_epoch": False, "straggler_delay_s": 0.1}),
     r"not healthy yet: step time .*the losses differ from the healthy job's by up to 0\.4.*"
     r"for the faults you named, still: the data phase is 30% of the step .*epoch 2 repeats"),
    (answer(("slow_loader", "straggler"), RIGHT), r"your changes to \['set_epoch'\] fix none of the "
                                                   r"faults you named"),
    (answer((*PLANTED, "tiny_micro_batch"), RIGHT),
     r"1 of the faults you named come with no change of the settings"),
    (answer((*PLANTED, "tiny_micro_batch"), {**RIGHT, "micro_batch": 8}),
     r"the job is healthy with your changes, but at least one fault you named is fixed by "
     r"changes that change nothing"),
    (answer(PLANTED, {**RIGHT, "threads_per_rank": 4}), r"your changes to \['threads_per_rank'\]"),
    (answer((*PLANTED, "oversubscribed_threads"), {**RIGHT, "threads_per_rank": 4}),
     r"not healthy yet: step time .*8 PyTorch threads on 2 cores"),
    (answer((*PLANTED, "tiny_micro_batch"), {**RIGHT, "micro_batch": 5}),
     r"cannot run: micro_batch=5 does not divide a rank's share .* use one of \[1, 2, 4, 8, 16\]"),
    (answer(PLANTED, {**RIGHT, "workers": 2}), r"your changes to \['workers'\] fix none"),
    (answer(PLANTED, {**RIGHT, "no_sync": "yes"}), r"your changes to \['no_sync'\] fix none"),
    (answer((*PLANTED, "sync_every_micro_batch"), {**RIGHT, "no_sync": "yes"}),
     r"no_sync='yes' is not allowed: give a bool"),
    (lambda run: {"slow_loader"}, r"return \(a set of fault ids, a dict of setting changes\)"),
    (lambda run: ("slow_loader", {}), r"should be a set of fault ids"),
    (lambda run: ({"gremlins"}, {}), r"\['gremlins'\] are not faults of the catalogue"),
    (lambda run: (set(PLANTED), [("prepare_data", "once")]), r"should be a dict of setting"),
])  # fmt: skip
def test_each_mistake_is_named_by_its_measurements(given, wrong, message):
    with pytest.raises(ex.ExerciseFailed, match=message) as info:
        ex.verify("07.diagnose", wrong)
    said = str(info.value)
    if "attempt" in said:  # past the answer's shape (answered with the catalogue's examples)
        assert not names_a_fault(said.split("with your changes")[0]), said


def test_a_change_that_costs_speed_is_caught(monkeypatch):
    """Too few threads removes oversubscription but runs slower than the right job (stand-in
    numbers: one thread per rank on 4 cores against a fair two)."""
    def run_of(settings, tokens_per_s):
        return fake_run(settings, tokens_per_s=tokens_per_s, cores=4)

    job = run_of(st.given(["oversubscribed_threads"], cores=4), 300.0)
    monkeypatch.setattr(excap, "last_given", lambda: job)
    monkeypatch.setattr(excap, "rerun", lambda run, changes, **kw: run_of(
        st.apply(run.settings, changes),
        200.0 if st.apply(run.settings, changes).threads_per_rank == 1 else 1000.0))
    with pytest.raises(ex.ExerciseFailed, match=r"not healthy yet: step time 5\.0× the healthy "
                                                r"job's \(the healthy job's step is faster"):
        ex.verify("07.diagnose", answer(["oversubscribed_threads"], {"threads_per_rank": 1}))
    ex.verify("07.diagnose", answer(["oversubscribed_threads"], {"threads_per_rank": 2}))


# --------------------------------------------------------------------------- cheats


def _plan_from_the_seed(run):
    return set(capstone.plan(run.seed, run.tier)), {}


def _plan_with_a_key_of_ones_own(run):
    return set(capstone.plan(run.seed, run.tier, keys.load())), {}


def _last_given(run):
    whole = capstone.last_given()
    found = set(whole.faults) | set(run.faults)
    changes = dataclasses.asdict(whole.settings) if whole.settings else {}
    return found, changes


def _every_fault(run):
    return {f.id for f in capstone.available(run.tier)}, {}


def _every_fault_and_every_right_setting(run):
    right = st.Settings()
    return ({f.id for f in capstone.available(run.tier)},
            {name: getattr(right, name) for f in capstone.available(run.tier)
             for name in capstone.FIXES[f.id]})  # fmt: skip


@pytest.mark.parametrize("cheat", [_plan_from_the_seed, _plan_with_a_key_of_ones_own, _last_given,
                                   _every_fault, _every_fault_and_every_right_setting])  # fmt: skip
def test_a_cheat_earns_no_pass_and_learns_no_fault(given, cheat):
    """Calling the planner (no key, or no key file), reading last_given, naming the whole
    catalogue (with or without resetting every setting it can fix): no pass, and nothing in
    the feedback names a fault."""
    with pytest.raises(ex.ExerciseFailed) as info:
        ex.verify("07.diagnose", cheat)
    assert not names_a_fault(str(info.value)), str(info.value)


def test_the_learners_function_sees_measurements_not_the_key(given):
    seen = []
    ex.verify("07.diagnose", lambda run: seen.append(run) or (set(PLANTED), dict(RIGHT)))
    assert seen[0].faults == () and seen[0].settings is None


def test_attempts_are_counted_and_a_give_up_shows(given, monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    job = excap.last_given()
    job.code = capstone.example_code("cpu")
    with pytest.raises(ex.ExerciseFailed, match="attempt 1: "):
        ex.verify("07.diagnose", _every_fault)
    attempts.give_up(job.code)
    said = ex.verify("07.diagnose", excap.reference_diagnose)
    assert said.startswith("attempt 2: ") and "you had opened this job's key" in said
    record = json.loads(attempts.path(job.code).read_text())
    assert [a["passed"] for a in record["attempts"]] == [False, True] and record["gave_up"]


def test_without_a_job_the_check_says_which_cell_to_run(monkeypatch):
    monkeypatch.setattr(excap, "last_given", lambda: None)
    with pytest.raises(ex.ExerciseFailed, match=r"calls capstone.given_job\(job_code\) first"):
        ex.verify("07.diagnose", excap.reference_diagnose)


def test_settings_round_trip_every_plan():
    """A plan's given settings carry exactly its planted faults, on every tier, and the
    right settings carry none."""
    key = keys.one_off()
    for tier in ("cpu", "single-gpu", "multi-gpu"):
        nproc = 1 if tier == "single-gpu" else 2
        for level in capstone.LEVELS:
            for seed in range(100):
                planted = capstone.plan(seed, tier, key, level)
                s = st.given(planted, cores=2)
                assert st.faults_in(s, tier=tier, cores=2, nproc=nproc) == planted
        assert st.faults_in(st.Settings(), tier=tier, cores=2, nproc=nproc) == ()
    with pytest.raises(ValueError, match="dtype='fp8' is not allowed"):
        dataclasses.replace(st.Settings(), dtype="fp8")


@pytest.mark.slow
def test_the_check_runs_the_real_job_and_passes_the_solution_only(capsys, monkeypatch, tmp_path):
    """For real: the example job on 2 gloo ranks (slow loader, straggler, no set_epoch). What
    the learner can reach holds no fault: the run, last_given, the job's files; the solution
    passes with a measured speed-up; a diagnosis read off all of that fails without a name."""
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    run = capstone.given_job(capstone.example_code("cpu"))
    assert run.faults == () and run.settings is None and "seed 10" in repr(run)  # key hidden
    assert capstone.last_given().faults == () and capstone.last_given().settings is None
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == runtime.SPEC_FILE for p in files)  # the launcher's job spec is there...
    words = set(capstone.BY_ID) | {"per_item", "straggler_s", "set_epoch"}
    for p in files:  # ...and no file the job wrote names a fault or a wrong setting
        text = p.read_text(errors="replace")
        assert not [w for w in words if re.search(rf"\b{w}\b", text)], p
    found, _ = excap.reference_diagnose(run)
    assert found == set(PLANTED), run.evidence_text()
    mine = run_cell(SOLUTION)
    assert ex.check("07.diagnose", mine) is mine
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("✓ 07.diagnose: attempt 1: ") and "tokens/s" in lines[-1]
    assert all(line.startswith("07.diagnose: your changes") for line in lines[:-1])  # progress
    assert not names_a_fault(lines[-1])

    def reads_everything(run):  # the run, last_given, every file under labkit_home
        seen = repr(run) + repr(capstone.last_given().faults) + repr(capstone.last_given().settings)
        seen += "".join(p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file())
        return {f for f in capstone.BY_ID if re.search(rf"\b{f}\b", seen)}, {}

    with pytest.raises(ex.ExerciseFailed, match=r"attempt 2: .*not healthy yet: step time") as info:
        ex.verify("07.diagnose", reads_everything)
    assert not names_a_fault(str(info.value)), str(info.value)


def test_a_change_that_cannot_run_is_refused_and_the_attempt_kept(given, monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    job = excap.last_given()
    job.code = capstone.example_code("cpu")

    def bad(run):  # a diagnosis whose change is not a value the job takes
        return {"slow_loader"}, {"prepare_data": "never"}

    with pytest.raises(ex.ExerciseFailed, match="attempt 1: your changes cannot run: ") as err:
        ex.verify("07.diagnose", bad)
    assert "prepare_data" in str(err.value) and not given  # refused before any re-run
    record = json.loads(attempts.path(job.code).read_text())
    assert [a["passed"] for a in record["attempts"]] == [False]
    assert "cannot run" in record["attempts"][0]["said"]


CPU_FAULTS = [f.id for f in capstone.available("cpu")]


@pytest.mark.parametrize("fault", CPU_FAULTS)
def test_a_fault_not_named_is_told_by_the_outcome_alone(fault, monkeypatch):
    """A job carrying one fault, answered with nothing found: the check says how far the
    outcome is from healthy (speed, losses), names no fault, and gives no fault's own
    measurement (one line per fault would spell out the key)."""
    job = fake_run(st.given([fault], cores=2), tokens_per_s=300.0)

    def rerun(run, changes, **kwargs):
        s = st.apply(run.settings, changes)
        left = st.faults_in(s, tier="cpu", cores=2, nproc=2)
        slow = any(capstone.BY_ID[f].kind == "speed" for f in left)
        other = s.sampler != "distributed" or not s.set_epoch or not s.zero_grad
        return fake_run(s, tokens_per_s=150.0 if slow else 1000.0,
                        losses=(3.0, 2.5) if other else (3.0, 2.9))  # fmt: skip

    monkeypatch.setattr(excap, "last_given", lambda: job)
    monkeypatch.setattr(excap, "rerun", rerun)
    with pytest.raises(ex.ExerciseFailed, match="not healthy yet: ") as info:
        ex.verify("07.diagnose", lambda run: (set(), {}))
    said = str(info.value)
    assert "step time" in said or "the losses differ" in said, said  # the outcome, coarse
    assert "for the faults you named" not in said, said  # no fault's own measurement: the key
    assert not names_a_fault(said.split("with your changes")[1]), said
    assert excap.reference_diagnose(job)[0] == {fault}


def _two_ranks(fwd: list[list[float]], bwd: list[list[float]]):
    """Evidence of two ranks with these forward and backward ms per step (data and optimizer
    nothing, the step their sum)."""
    from labkit.course.capstone.evidence import Evidence

    def rank(f, b):
        n = len(f)
        return {"step_s": [(x + y) / 1e3 for x, y in zip(f, b, strict=True)], "data_s": [0.0] * n,
                "forward_s": [x / 1e3 for x in f], "backward_s": [y / 1e3 for y in b],
                "optimizer_s": [0.0] * n}  # fmt: skip

    return Evidence("cpu", [rank(fwd[0], bwd[0]), rank(fwd[1], bwd[1])])


def _busy(n: int, seed: int, delay_ms: float = 0.0):
    """Two ranks of a 6 ms forward on a busy machine: in one step of 8 after the first, each
    rank loses 10-30 ms (more than the planted delay), and the other waits for it in backward;
    rank 1 also loses ``delay_ms`` in every forward, which rank 0 waits out."""
    import random

    rng = random.Random(seed)
    fwd, bwd = [[6.0] * n, [6.0 + delay_ms] * n], [[12.0 + delay_ms] * n, [12.0] * n]
    hits = rng.sample(range(1, n), 2 * max(1, (n - 1) // 8))
    for i, step in enumerate(hits):
        hit, spike = i % 2, rng.uniform(10, 30)
        fwd[hit][step] += spike
        bwd[1 - hit][step] += spike
    return _two_ranks(fwd, bwd)


@pytest.mark.parametrize("seed", range(10))
def test_a_slow_rank_is_told_from_noise_and_one_slow_step(seed):
    """N07-5's decoys: noise on a busy machine slows either rank in some steps by more than
    the planted delay, and a healthy job has one slow step of its own; neither is a straggler.
    A delay in nearly every step is, down to a third of the forward, at the lab size (15
    steps) and the smoke size (8)."""
    for n in (15, 8):
        assert excap.lagging_rank(_busy(n, seed)) is None
        for delay in (15.0, 4.0):
            slow, waits, floor, slower = excap.lagging_rank(_busy(n, seed, delay))
            assert (slow, waits) == (1, 0) and floor >= delay and slower >= n - 1 - n // 8
    one_off = _two_ranks([[6.0] * 8, [6.0] * 4 + [40.0] + [6.0] * 3],
                         [[12.0] * 4 + [46.0] + [12.0] * 3, [12.0] * 8])  # fmt: skip
    assert excap.lagging_rank(one_off) is None


def test_fixes_one_at_a_time_keep_what_a_measurement_supports(monkeypatch):
    """Notebook 07's section 5 (capstone.one_at_a_time) on stand-in runs: each fix re-run on
    top of those kept, in FIXES order; a measurably faster fix stays, a measurably slower one
    goes, a correctness fix stays when its evidence is gone; the table says why."""
    from labkit.course.capstone import trials

    job = fake_run(st.given(["slow_loader", "straggler", "no_set_epoch"], cores=2), tokens_per_s=300.0)

    def rerun(run, changes, **kwargs):
        s = st.apply(run.settings, changes)
        left = st.faults_in(s, tier="cpu", cores=2, nproc=2)
        speed = {"slow_loader": 2.0, "straggler": 3.0}  # what each fault costs, as a factor
        tps = 1000.0 / math.prod(speed.get(f, 1.0) for f in left)
        if s.threads_per_rank == 4:  # a "fix" that makes the job slower
            tps /= 4
        return fake_run(s, tokens_per_s=tps, losses=(3.0, 2.9 if s.set_epoch else 2.5))

    monkeypatch.setattr(trials, "rerun", rerun)
    found = {"straggler", "slow_loader", "no_set_epoch", "oversubscribed_threads"}
    changes = {"straggler_delay_s": 0.0, "prepare_data": "once", "set_epoch": True,
               "threads_per_rank": 4}  # fmt: skip
    seq = capstone.one_at_a_time(job, found, changes, excap.reference_diagnose, progress=False)
    assert [t.fault for t in seq.trials] == ["oversubscribed_threads", "slow_loader", "straggler",
                                             "no_set_epoch"]  # fmt: skip
    assert [t.kept for t in seq.trials] == [False, True, True, True]
    assert seq.kept == {"prepare_data": "once", "straggler_delay_s": 0.0, "set_epoch": True}
    assert seq.current.tokens_per_s == pytest.approx(1000.0)
    assert seq.trials[1].before is job and seq.trials[2].before is seq.trials[1].after
    table = seq.table()
    assert "before is faster than after" in table and "its evidence is gone" in table
    assert "3.33× in all" in table


def test_the_evidence_picture_stacks_each_ranks_phases_and_draws_every_step():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = fake_run(st.given(["straggler"], cores=2), tokens_per_s=300.0)
    fig = run.evidence().plot()
    left, right = fig.axes
    heights = [[p.get_height() for p in c.patches] for c in left.containers]  # one per bar
    assert len(heights) == 2 * 5  # 2 ranks × (4 phases + other)
    tops = [sum(h[0] for h in heights[r * 5:(r + 1) * 5]) for r in range(2)]
    assert tops == pytest.approx([1e3 * 32 * 64 / 300.0] * 2, rel=0.01)  # the step, stacked
    assert len(right.lines) == 2 and len(right.lines[0].get_xdata()) == 8
    plt.close(fig)


def synthetic_gpu_trace(path, *, dtype: str, optimizer_op: str, h2d: str,
                        anomaly: bool = False) -> str:  # fmt: skip
    """A one-step Kineto-style trace (synthetic: the layout torch.profiler writes on a CUDA
    machine, every number made up) with the capstone's phases, a forward matmul of ``dtype``,
    an optimizer op, a host-to-device copy of kind ``h2d``, the loss's device-to-host read, and
    autograd's NaN check in backward (anomaly mode on a GPU syncs there, not in forward)."""
    def x(name, cat, ts, dur, tid=1, pid=1, **args):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid,
                "tid": tid, "args": args}  # fmt: skip

    events = [
        x("ProfilerStep#0", "user_annotation", 0, 1000),
        x("data", "user_annotation", 1, 50), x("aten::to", "cpu_op", 2, 10),
        x("forward", "user_annotation", 60, 300),
        x("aten::linear", "cpu_op", 61, 100), x("aten::addmm", "cpu_op", 62, 90,
                                                **{"Input type": [dtype, dtype, dtype]}),
        x("backward", "user_annotation", 400, 400), x("aten::mm", "cpu_op", 401, 100),
        *([x("aten::isnan", "cpu_op", 520, 5)] if anomaly else []),
        x("optimizer", "user_annotation", 850, 100), x(optimizer_op, "cpu_op", 851, 50),
        x(f"Memcpy HtoD ({h2d} -> Device)", "gpu_memcpy", 5, 3, tid=7, pid=0),
        x("Memcpy DtoH (Device -> Pageable)", "gpu_memcpy", 990, 2, tid=7, pid=0),
    ]  # fmt: skip
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


@pytest.mark.parametrize("faulty", [False, True])
def test_the_gpu_signatures_on_synthetic_gpu_evidence(tmp_path, faulty):
    """The GPU branch of the reference diagnosis, on a synthetic GPU trace and made-up rank
    reports (no GPU here; the real GPU test is in test_capstone.py): a healthy GPU job shows
    nothing (its loss read back to pageable memory is no unpinned batch), and one with every
    GPU fault shows each, by dtype, host syncs, optimizer ops, copies, vocabulary and NCCL."""
    trace = synthetic_gpu_trace(
        tmp_path / "rank0.json", dtype="float" if faulty else "c10::BFloat16",
        optimizer_op="aten::add_" if faulty else "aten::_foreach_add_",
        h2d="Pageable" if faulty else "Pinned", anomaly=faulty)  # fmt: skip
    run = fake_run(st.Settings())
    run.tier = "multi-gpu"
    for r in run.ranks:
        del r["stand_in_faults"]  # this one's operators come from the trace
        r.update(trace=trace, env={"NCCL_P2P_DISABLE": "1"} if faulty else {},
                 # anomaly mode's NaN checks sync in backward; a .item() per micro-batch in forward
                 host_syncs=[{"forward": 2 if faulty else 0, "backward": 300 if faulty else 0}] * 8,
                 model={**r["model"], "vocab_size": 257 if faulty else 320})  # fmt: skip
    assert run.evidence().matmul_dtypes(0) == {"float" if faulty else "c10::BFloat16": 1}
    found, changes = excap.reference_diagnose(run)
    gpu = {f.id for f in capstone.FAULTS if "cpu" not in f.tiers}
    assert found == (gpu | {"anomaly_mode"} if faulty else set()), found
    if faulty:
        assert st.faults_in(st.apply(st.given(gpu | {"anomaly_mode"}, cores=2), changes),
                            tier="multi-gpu", cores=2, nproc=2) == ()  # fmt: skip
