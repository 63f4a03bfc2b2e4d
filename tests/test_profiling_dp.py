"""The data-parallel profiling worker: its config checks (no launch), and two real 2-rank gloo
jobs on CPU (slow): one profiling a naive, a DDP and a DDP-with-a-slowed-rank run, whose traces
must load and show no overlap for naive and the planted straggler; one whose rank 1 is killed
while profiling, which must fail naming it and leave no trace set presented as complete.

Each launch costs about 12 s on a 2-core machine (two ranks importing torch), so the first
job serves every check on its traces.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import matplotlib
import psutil
import pytest
import torch

from labkit import config
from labkit.jobs import launch
from labkit.model import GPT
from labkit.profiling import (
    find_straggler,
    hta_report,
    load_trace,
    load_traces,
    plot_trace,
    rank_times,
)
from labkit.profiling.hta import ANALYSES
from labkit.profiling.phases import COMMUNICATION, PHASES
from labkit.workers import dp_profile

matplotlib.use("Agg")

ACTIVE = 2
SLOW_RANK = 1
# The planted delay per step. A smoke-size step's own work is 20-45 ms on a busy 2-core
# machine (measured); find_straggler asks for 30% more than the others, so 80 ms more stands
# out unless the others' own work grows past ~250 ms.
SLOW_MS = 80
RUNS = [
    {"name": "naive", "strategy": "naive"},
    {"name": "ddp", "strategy": "ddp"},
    {"name": "ddp, rank 1 slowed", "strategy": "ddp", "slow_ms": SLOW_MS},
]


# --- config checks: refused before anything starts -----------------------------------------


@pytest.fixture
def launches(monkeypatch) -> list:
    """The launches ``dp_profile.run`` asked for (none is started)."""
    calls: list = []
    monkeypatch.setattr(launch, "run", lambda module, **kw: calls.append((module, kw)))
    return calls


@pytest.mark.parametrize(("config", "message"), [
    ({"bogus": 1}, r"DPProfileConfig has no field\(s\) \['bogus'\]"),
    ({"slow_rank": 2, "runs": RUNS}, r"slow_rank=2 is not allowed: an integer from 0 to 1"),
    ({"slow_rank": -1, "runs": RUNS}, r"slow_rank=-1"),
    ({"slow_rank": 1.0, "runs": RUNS}, r"slow_rank=1\.0"),
    ({"runs": [{"name": "x", "strategy": "fsdp"}]}, r"strategy='fsdp' is not allowed: one of 'naive', 'ddp' \(run 'x'\)"),
    ({"runs": [{"name": "x", "strategy": "ddp", "slow_ms": -5}]}, r"slow_ms=-5"),
    ({"runs": [{"name": "x", "strategy": "ddp", "delay": 5}]}, r"exactly 'name', 'strategy'"),
    ({"runs": [{"name": "x", "strategy": "ddp"}] * 2}, r"repeated names"),
    ({"runs": []}, r"a non-empty list"),
    ({"active": 0}, r"active=0 is not allowed.*no active step records nothing"),
    ({"wait": -1}, r"wait=-1"),
    ({"bucket_cap_mb": 0}, r"bucket_cap_mb=0"),
    ({"profiler": "perf"}, r"profiler='perf'"),
    ({"dtype": "float8"}, r"dtype='float8' is not allowed: one of 'bfloat16', 'float16', 'float32'"),
])  # fmt: skip
def test_bad_config_is_refused_before_launch(launches, config, message):
    with pytest.raises(ValueError, match=message):
        dp_profile.run(dp_profile.DPProfileConfig.from_dict(config), nproc=2)
    assert launches == []


def test_run_and_nsys_command_take_only_the_typed_config(launches, tmp_path):
    refused = r"config=\{'active': 2\} is not allowed: a DPProfileConfig"
    with pytest.raises(ValueError, match=refused):
        dp_profile.run({"active": 2}, nproc=2)
    with pytest.raises(ValueError, match=refused):
        dp_profile.nsys_command({"active": 2}, nproc=1, out_dir=tmp_path)
    assert launches == [] and not any(tmp_path.iterdir())


def test_a_good_config_reaches_the_launcher(launches):
    config = dp_profile.DPProfileConfig(active=ACTIVE, runs=RUNS, slow_rank=SLOW_RANK)
    dp_profile.run(config, nproc=2, device="cpu")
    # slow_rank only matters when a run is slowed: out of range with none slowed is accepted
    dp_profile.run(dp_profile.DPProfileConfig(slow_rank=5), nproc=2)
    assert launches == [(config, {"nproc": 2, "device": "cpu"}),
                        (dp_profile.DPProfileConfig(slow_rank=5), {"nproc": 2})]


# --- one real job: naive, DDP, DDP with a slowed rank --------------------------------------


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> launch.JobResult:
    config = dp_profile.DPProfileConfig(active=ACTIVE, runs=RUNS, slow_rank=SLOW_RANK)
    return dp_profile.run(config, nproc=2, device="cpu", log_dir=tmp_path_factory.mktemp("dp_profile"),
                          stream=False, timeout_s=240)  # fmt: skip


def test_the_forward_runs_in_the_jobs_dtype():
    """The worker's forward (what each rank profiles) computes in the config's dtype, so a GPU
    job profiles the step notebook 06's header names; float32 leaves autocast off."""
    torch.manual_seed(0)
    model = GPT(config.smoke().model)
    x = torch.randint(0, config.smoke().model.vocab_size, (2, 8))
    seen: list[torch.dtype] = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    try:
        for dtype in ("bfloat16", "float32"):
            dp_profile.forward(model, x, x, dtype).backward()
    finally:
        hook.remove()
    assert seen == [torch.bfloat16, torch.float32]


@pytest.mark.slow
def test_every_rank_writes_a_trace_per_run(job):
    assert [r["rank"] for r in job.ranks] == [0, 1]
    for run in RUNS:
        paths = dp_profile.trace_paths(job, run["name"])
        traces = load_traces(paths)
        assert [t.rank for t in traces] == [0, 1]
        for t in traces:
            assert len(t.steps) == ACTIVE
            names = {s.name for s in t.spans(cat="user_annotation", tid=t.main_tid)}
            assert names >= set(PHASES)
            assert (COMMUNICATION in names) == (run["strategy"] == "naive")
            assert t.spans(name="gloo:all_reduce"), "no collective thread in the trace"
    with pytest.raises(FileNotFoundError, match="rank 0 wrote no trace for 'fsdp'"):
        dp_profile.trace_paths(job, "fsdp")


@pytest.mark.slow
def test_naive_hides_no_communication(job):
    # naive all-reduces after backward, in its own phase: nothing to overlap with
    for t in load_traces(dp_profile.trace_paths(job, "naive")):
        r = rank_times(t)
        assert r.comm_s > 0 and r.hidden_fraction < 0.05, r.describe()
        assert r.exposed_s == pytest.approx(r.comm_s - r.hidden_s)


@pytest.mark.slow
def test_the_slowed_rank_is_named_the_straggler(job):
    times = [rank_times(t) for t in load_traces(dp_profile.trace_paths(job, RUNS[2]["name"]))]
    s = find_straggler(times)
    assert s is not None and s.rank == SLOW_RANK, [t.describe() for t in times]
    # it works SLOW_MS more a step; the other waits for it in exposed communication
    assert s.own_s - s.others_own_s > 0.5 * SLOW_MS / 1e3
    assert times[1 - SLOW_RANK].exposed_s > times[SLOW_RANK].exposed_s


@pytest.mark.slow
def test_plot_of_two_ranks_labels_each_thread(job):
    import matplotlib.pyplot as plt

    traces = load_traces(dp_profile.trace_paths(job, "ddp"))
    labels = [tick.get_text() for tick in plot_trace(traces, steps=slice(0, 1)).get_yticklabels()]
    assert len(set(labels)) == len(labels)
    assert labels[0] == "rank 0: training loop (main thread)"
    assert "rank 1: training loop (main thread)" in labels
    assert {lab.split(":")[0] for lab in labels} == {"rank 0", "rank 1"}
    plt.close("all")


@pytest.mark.slow
def test_hta_finds_nothing_in_cpu_traces(job):
    """HTA reads GPU kernels: on these gloo CPU traces every analysis raises or is empty/NaN
    (the finding labkit.profiling.hta documents). If one starts working, update that module."""
    pytest.importorskip("hta")
    folder = dp_profile.trace_paths(job, "ddp")[0].parent
    report = hta_report(folder)
    assert report.available, report.failures
    assert report.results == {}, f"HTA now answers on CPU traces: {list(report.results)}"
    assert set(report.failures) == set(ANALYSES) and report.no_kernels


# --- a rank killed while profiling ------------------------------------------------------


class KillRank:
    """A launcher observer that SIGKILLs ``rank`` once its heartbeat reports step ``at_step``:
    the way the out-of-memory killer ends a rank, with no Python code running after it."""

    def __init__(self, rank: int, at_step: int) -> None:
        self.rank, self.at_step = rank, at_step
        self.killed: tuple[int, int] | None = None  # (pid, step it had reported)

    def on_tick(self, job: launch.Job) -> None:
        step = (job.heartbeats.get(self.rank) or {}).get("step") or 0
        if self.killed is None and step >= self.at_step:
            pid = job.rank_pids()[self.rank]
            os.kill(pid, signal.SIGKILL)
            self.killed = (pid, step)


@pytest.mark.slow
def test_a_rank_killed_while_profiling_fails_the_job(tmp_path):
    # wait 1, warmup 1, active 2: the trace is exported at the end of step 4. Rank 1 is slowed
    # 400 ms a step so that the launcher's 0.25 s tick sees it between steps 1 and 3.
    config = dp_profile.DPProfileConfig(runs=[{"name": "slowed", "strategy": "ddp", "slow_ms": 400}],
                                        active=2, slow_rank=1)  # fmt: skip
    killer = KillRank(rank=1, at_step=1)
    with pytest.raises(launch.JobFailed) as e:
        dp_profile.run(config, nproc=2, device="cpu", log_dir=tmp_path, stream=False,
                       timeout_s=120, observers=[killer])  # fmt: skip
    assert killer.killed is not None and 1 <= killer.killed[1] < 4  # killed inside the window
    failed = e.value
    assert failed.rank == 1 and failed.exitcode == -signal.SIGKILL, str(failed)
    # no trace set presented as complete: no rank reported, the killed rank wrote no trace
    assert failed.result.ranks == [{}, {}]
    with pytest.raises(FileNotFoundError, match="rank 0 wrote no trace for 'slowed'"):
        dp_profile.trace_paths(failed.result, "slowed")
    run_dir = Path(failed.result.log_dir) / "traces" / "run0"
    assert not (run_dir / "rank1.json").exists()
    with pytest.raises(Exception, match="no such file"):
        load_trace(run_dir / "rank1.json")
    # the other rank was ended too
    for pid in failed.result.worker_pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
