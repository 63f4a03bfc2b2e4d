"""labkit.jobs.launch: real torchrun jobs on CPU/gloo, including the ways they go wrong.

Every multi-process test checks that no process of its job survives. Processes are found by
their environment (LABKIT_JOB_DIR names the job), which catches workers the launcher never
recorded and a worker's own children too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import psutil
import pytest

from labkit.jobs import (
    diagnosis,
    launch,
    observers,
    outcome,
    preflight,
    procs,
    runtime,
    spawn,
    spec,
)
from labkit.jobs.supervisor import Echo, Supervisor
from labkit.workers._faults import FaultsConfig as Faults
from labkit.workers.allreduce import AllReduceConfig

REPO = Path(__file__).resolve().parents[1]
FAULTS = Faults.WORKER


# --- helpers -------------------------------------------------------------------------------------


def job_processes(job_dir: Path | str) -> list[psutil.Process]:
    """Live (non-zombie) processes started for the job in ``job_dir``."""
    found = []
    for p in psutil.process_iter(["environ", "status"]):
        try:
            env = p.info["environ"] or {}
        except (psutil.Error, OSError):
            continue
        if env.get(runtime.JOB_DIR_ENV) == str(job_dir) and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p)
    return found


def assert_no_survivors(job_dir: Path | str, pids: list[int] = (), wait_s: float = 0.0) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        alive = [p.pid for p in job_processes(job_dir)]
        alive += [pid for pid in pids if pid not in alive and _alive(pid)]
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    assert not alive, f"processes of job {job_dir} still running: {alive}"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private LABKIT_HOME: job dirs and the registry of this test only. Afterwards, any
    process still running with it is killed, and the test fails."""
    path = tmp_path / "home"
    monkeypatch.setenv("LABKIT_HOME", str(path))
    yield path
    strays = []
    for p in psutil.process_iter(["environ"]):
        with contextlib.suppress(psutil.Error, OSError):
            env = p.info["environ"] or {}
            if env.get("LABKIT_HOME") == str(path) and p.pid != os.getpid() and _alive(p.pid):
                strays.append(p)
                p.kill()
    assert not strays, f"test left processes running: {[p.pid for p in strays]}"


class Recorder:
    """An observer that remembers what it was told."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.end_result = None
        self.max_step = None

    def on_start(self, job):
        self.calls.append("start")

    def on_tick(self, job):
        self.calls.append("tick")
        step, _ = job.progress()
        if step is not None:
            self.max_step = step

    def on_end(self, job, result):
        self.calls.append("end")
        self.end_result = result


class Broken:
    def on_tick(self, job):
        raise RuntimeError("plot bug")


# --- bad input fails before anything starts ------------------------------------------------------


@pytest.fixture
def no_spawn(home, monkeypatch):
    def refuse(self):
        raise AssertionError("run() started a job for bad input")

    monkeypatch.setattr(Supervisor, "start", refuse)
    return home


@pytest.mark.parametrize(
    ("job", "kwargs", "match"),
    [
        ("labkit.workers.no_such_worker", {}, "no module named 'labkit.workers.no_such_worker'.*importable"),
        ("no_such_package.worker", {}, "no module named 'no_such_package.worker'"),
        ("labkit.workers.allreduce", {}, r"takes its settings typed; launch it as run\(AllReduceConfig"),
        (3, {}, "need a worker's config"),
        (AllReduceConfig(), {"nproc": 0}, "nproc=0"),
        (AllReduceConfig(), {"timeout_s": 0}, "timeout_s=0"),
        (AllReduceConfig(), {"device": "tpu"}, "device='tpu'"),
        (AllReduceConfig(), {"env": {"X": 1}}, "env takes a dict of str to str"),
        (AllReduceConfig(), {"timeout_s": True}, "timeout_s=True"),
        (AllReduceConfig(), {"timeout_s": float("inf")}, "timeout_s=inf"),
        (AllReduceConfig(), {"pg_timeout_s": float("nan")}, "pg_timeout_s=nan"),
        (
            AllReduceConfig(), {"nproc": 10_000},
            r"nproc=10000 CPU ranks on \d+ cores?: at most \d+ .*oversubscribe=True",
        ),
    ],
)
def test_bad_input_fails_before_spawning(no_spawn, job, kwargs, match):
    with pytest.raises(ValueError, match=match):
        launch.run(job, **kwargs)
    assert not (no_spawn / "runs").exists(), "no job directory may be created for bad input"


def test_the_config_keyword_is_gone(no_spawn):
    """One way to give a worker its settings: its typed config, first and alone."""
    with pytest.raises(TypeError, match="config"):
        launch.run(Faults.WORKER, config={"mode": "ok"})  # type: ignore[call-arg]


def test_gpu_checks_use_the_visible_gpu_count(no_spawn, monkeypatch):
    monkeypatch.setattr(launch, "visible_gpu_count", lambda: 1)
    with pytest.raises(ValueError, match=r"more ranks \(2\) than GPUs \(1\).*device='cpu'"):
        launch.run(AllReduceConfig(), nproc=2, device="cuda")
    with pytest.raises(ValueError, match=r"more ranks \(2\) than GPUs \(1\)"):
        launch.run(AllReduceConfig(), nproc=2, backend="nccl")
    monkeypatch.setattr(launch, "visible_gpu_count", lambda: 0)
    with pytest.raises(ValueError, match="device='cuda' but no CUDA GPU"):
        launch.run(AllReduceConfig(), nproc=1, device="cuda")
    with pytest.raises(ValueError, match="backend='nccl' but no CUDA GPU"):
        launch.run(AllReduceConfig(), nproc=1, backend="nccl")


def test_resolve_backend():
    assert launch.resolve_backend(2, gpu_count=0) == ("gloo", "cpu")
    assert launch.resolve_backend(2, gpu_count=2) == ("nccl", "cuda")
    # Two ranks on a one-GPU machine (the notebooks' default there): CPU ranks, said aloud.
    assert launch.resolve_backend(2, gpu_count=1) == ("gloo", "cpu")
    assert "2 ranks but 1 GPU visible" in launch.fallback_note(2, "cpu", 1)
    assert launch.fallback_note(2, "cpu", 0) is None  # a CPU machine: nothing to explain
    assert launch.fallback_note(2, "cuda", 2) is None
    assert launch.resolve_backend(2, "cpu", gpu_count=8) == ("gloo", "cpu")
    assert launch.resolve_backend(1, "cuda", "gloo", gpu_count=1) == ("gloo", "cuda")
    with pytest.raises(ValueError, match=r"more ranks \(4\) than GPUs \(2\)"):
        launch.resolve_backend(4, "cuda", gpu_count=2)
    with pytest.raises(ValueError, match="backend='nccl' needs GPUs"):
        launch.resolve_backend(2, "cpu", "nccl", gpu_count=2)


# --- pure pieces: hang diagnosis, bounded output -------------------------------------------------


def beat(step, phase="train", in_collective=False, t=100.0):
    return {"step": step, "total": 10, "phase": phase, "in_collective": in_collective, "time": t}


def test_diagnose_blames_the_rank_outside_the_collective_not_the_victim():
    # Same step everywhere: only "in a collective or not" tells the culprit from its victims.
    beats = {
        0: beat(5, "all_reduce", True, t=90.0),
        1: beat(5, "compute", t=91.0),
        2: beat(5, "all_reduce", True, t=90.0),
    }
    hung, lines = launch.diagnose_hang(beats, 3, now=100.0)
    assert hung == [1]
    assert (
        "rank 0: waiting in collective 'all_reduce' at step 5/10 (last heartbeat 10.0 s ago)"
        in lines
    )
    assert "not in a collective" in lines[1]


def test_diagnose_other_cases():
    # A rank that never wrote a heartbeat is named first.
    assert launch.diagnose_hang({0: beat(1)}, 2, now=100.0)[0] == [1]
    # Nobody in a collective: the lowest step is behind.
    assert launch.diagnose_hang({0: beat(7), 1: beat(3), 2: beat(3)}, 3, now=100.0)[0] == [1, 2]
    # Everyone at the same point: no rank to blame, rather than a guess.
    assert (
        launch.diagnose_hang({0: beat(3, "a", True), 1: beat(3, "a", True)}, 2, now=100.0)[0] == []
    )
    # A finished rank is never blamed.
    assert launch.diagnose_hang({0: beat(9, "done"), 1: beat(2)}, 2, now=100.0)[0] == [1]


# Tracebacks as a failing rank leaves them (paths shortened): what torch's @record writes in
# error.json, and what the rank prints to its stderr log. Test data, written for these tests.
SITE = "/venv/lib/python3.11/site-packages"
LABKIT = str(Path(runtime.__file__).parents[1])  # labkit/
RECORDED = f"""Traceback (most recent call last):
  File "{SITE}/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper
    return f(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^
  File "{LABKIT}/jobs/runtime.py", line 232, in main
    _run(fn)
  File "{LABKIT}/jobs/runtime.py", line 273, in _run
    result = fn(ctx)
             ^^^^^^^
  File "{LABKIT}/workers/allreduce.py", line 52, in main
    raise RuntimeError(f"rank {{ctx.rank}} fails on purpose (config fail_rank={{fail_rank}})")
RuntimeError: rank 1 fails on purpose (config fail_rank=1)
"""
DEEP = f"""Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "<frozen runpy>", line 88, in _run_code
  File "/home/me/lab/my_worker.py", line 40, in <module>
    main()
  File "{SITE}/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper
    return f(*args, **kwargs)
  File "{LABKIT}/jobs/runtime.py", line 273, in _run
    result = fn(ctx)
  File "/home/me/lab/my_worker.py", line 31, in main
    loss = model(x)
  File "{SITE}/torch/nn/modules/module.py", line 1775, in _wrapped_call_impl
    return self._call_impl(*args, **kwargs)
  File "{SITE}/torch/nn/modules/module.py", line 1786, in _call_impl
    return forward_call(*args, **kwargs)
  File "{LABKIT}/model.py", line 88, in forward
    return self.head(x)
  File "{SITE}/torch/nn/modules/linear.py", line 125, in forward
    return F.linear(input, self.weight, self.bias)
RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x64 and 32x256)
"""


def test_the_failure_excerpt_keeps_the_error_and_the_frames_that_matter():
    text = launch.traceback_excerpt(RECORDED)
    lines = text.splitlines()
    assert lines[-1] == "RuntimeError: rank 1 fails on purpose (config fail_rank=1)"
    assert 'raise RuntimeError(f"rank {ctx.rank} fails on purpose' in text
    assert "allreduce.py\", line 52, in main" in text
    # The launcher's frames are the same in every failure: counted, not shown.
    assert "elastic" not in text and "runtime.py" not in text
    assert "3 frames of the launcher (torchrun, labkit.jobs.runtime) left out" in text

    text = launch.traceback_excerpt(DEEP)
    assert "runpy" not in text and "elastic" not in text and "runtime.py" not in text
    assert "my_worker.py\", line 31, in main" in text and "loss = model(x)" in text
    assert "model.py\", line 88, in forward" in text  # labkit code the worker called
    # torch's own frames between two frames of code: one line; where it raised: kept.
    assert "module.py" not in text and "… 2 frames in torch" in text
    assert "linear.py\", line 125, in forward" in text
    assert text.splitlines()[-1].startswith("RuntimeError: mat1 and mat2 shapes")
    # Not a traceback (a rank killed by a signal leaves a log tail): the last lines, as is.
    tail = "\n".join(f"line {i}" for i in range(20))
    assert launch.traceback_excerpt(tail).splitlines() == [f"line {i}" for i in range(12, 20)]


def test_echo_bounds_live_output_and_shows_the_tail(tmp_path):
    out: list[str] = []
    echo = Echo(3, tmp_path, write=out.append)
    for i in range(10):
        echo.line(f"l{i}")
    echo.finish()
    assert out[:3] == ["l0", "l1", "l2"]
    assert out[3] == f"… more output in {tmp_path}"
    assert "4 lines skipped" in out[4]
    assert out[5:] == ["l7", "l8", "l9"]
    out.clear()
    quiet = Echo(3, tmp_path, quiet=True, write=out.append)
    quiet.line("x")
    quiet.finish()
    assert out == []


# --- the exec wrapper ------------------------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_spawn_wrapper_arms_the_parent_death_signal_and_keeps_its_pid():
    probe = (
        "import os; from labkit.jobs import spawn; "
        "print(spawn.get_parent_death_signal(), os.environ['LABKIT_AGENT_PID'] == str(os.getpid()))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "labkit.jobs.spawn",
        "SIGTERM",
        str(os.getpid()),
        "--",
        sys.executable,
        "-c",
        probe,
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(int(signal.SIGTERM)), "True"]
    assert spawn.get_parent_death_signal() == 0, "the wrapper must not arm the test process"


def test_spawn_wrapper_refuses_when_its_parent_is_already_gone(tmp_path):
    marker = tmp_path / "ran"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "labkit.jobs.spawn",
        "SIGTERM",
        "1",
        "--",  # 1 is not our parent
        sys.executable,
        "-c",
        f"open({str(marker)!r}, 'w')",
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "exited before the job started" in out.stderr
    assert not marker.exists()


# --- the registry ----------------------------------------------------------------------------------


def test_cleanup_ends_jobs_whose_owner_died_and_spares_live_ones(home):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    spared = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        rec = procs.record
        reg = home / "jobs"
        me = psutil.Process()
        # Owner "dead": our PID with another start time, as if the PID had been recycled.
        dead_owner = {"pid": me.pid, "create_time": me.create_time() - 1000.0}
        runtime.write_json_atomic(
            reg / "dead.json",
            {
                "job_id": "dead",
                "module": "m",
                "owner": dead_owner,
                "agent": rec(psutil.Process(sleeper.pid)),
                "workers": [],
            },
        )
        runtime.write_json_atomic(
            reg / "live.json",
            {
                "job_id": "live",
                "module": "m",
                "owner": rec(me),
                "agent": None,
                "workers": [rec(psutil.Process(spared.pid))],
            },
        )
        report = launch.cleanup()
        assert report == [{"job_id": "dead", "module": "m", "pids": [sleeper.pid]}]
        assert sleeper.wait(timeout=10) == -signal.SIGTERM
        assert spared.poll() is None, "a job whose launcher is alive must be left alone"
        assert not (reg / "dead.json").exists() and (reg / "live.json").exists()
    finally:
        for p in (sleeper, spared):
            p.kill()
            p.wait()


# --- real jobs ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_allreduce_job_returns_per_rank_results_and_logs(home, capsys):
    rec = Recorder()
    res = launch.run(
        AllReduceConfig(numel=1000, repeats=3),
        nproc=2,
        observers=[rec, Broken()],
        timeout_s=120,
    )
    out = capsys.readouterr().out

    assert (res.status, res.returncode, res.backend, res.device, res.nproc) == (
        "ok",
        0,
        "gloo",
        "cpu",
        2,
    )
    assert [r["rank"] for r in res.ranks] == [0, 1]
    for r in res.ranks:
        assert r["value"] == 3.0 and r["world_size"] == 2 and r["message_bytes"] == 4000
        assert r["median_s"] > 0 and r["busbw_GBps"] == pytest.approx(
            r["algbw_GBps"]
        )  # 2(n-1)/n = 1
    assert res.result is res.ranks[0] and res.rank(1) is res.ranks[1]
    # Rank-prefixed live output, and full logs per rank on disk.
    assert "[rank0] all-reduce of 2 ranks: every element = 3" in out
    assert "all-reduce of 2 ranks" in res.log(0) and "[rank" not in res.log(0)
    assert launch.rank_log_path(res.log_dir, 1, "stderr") is not None
    assert "JobResult(labkit.workers.allreduce: ok" in repr(res) and "<table>" in res._repr_html_()
    # Observers: start, ticks, end with the result; a broken one is dropped, not fatal.
    assert rec.calls[0] == "start" and "tick" in rec.calls and rec.calls[-1] == "end"
    assert rec.end_result is res and rec.max_step is not None
    assert "Broken.on_tick raised RuntimeError('plot bug'); dropped" in out
    # Bookkeeping: registry record removed, torchrun's temp folder gone, no process left.
    assert not list((home / "jobs").glob("*.json"))
    assert not (res.log_dir / "tmp").exists()
    assert len(res.worker_pids) == 2
    assert_no_survivors(res.log_dir, [res.agent_pid, *res.worker_pids])


@pytest.mark.slow
def test_failing_rank_is_named_with_its_exception(home, capsys):
    with pytest.raises(launch.JobFailed) as info:
        launch.run(Faults(mode="raise", fail_rank=1), nproc=2, timeout_s=120)
    err = info.value
    # Under the cell, each rank's traceback appears once it is complete, as an excerpt, the
    # one that began first (rank 1's, the cause) first.
    out = capsys.readouterr().out
    assert "[rank1] ValueError: injected failure on rank 1" in out
    assert re.search(r"\[rank1\]   … \d+ frames of the launcher \(torchrun, labkit.jobs.runtime\)", out)
    assert "runpy" not in out and "[rank1]:" not in out
    assert out.index("[rank1] Traceback") < out.index("[rank0] Traceback")
    assert isinstance(err, RuntimeError)
    assert (err.rank, err.exc_type, err.exc_message) == (
        1,
        "ValueError",
        "injected failure on rank 1",
    )
    msg = str(err)
    assert "failed on rank 1: ValueError: injected failure on rank 1" in msg
    assert 'raise ValueError(f"injected failure' in msg, "the raising line belongs in the message"
    assert msg.count("ValueError: injected failure on rank 1") == 2  # summary, and the excerpt
    assert "elastic" not in msg and "runpy" not in msg, "the launcher's frames are noise"
    stderr_log = launch.rank_log_path(err.result.log_dir, 1, "stderr")
    assert f"full traceback: {stderr_log}" in msg
    assert "Traceback (most recent call last)" in stderr_log.read_text()
    assert str(err.result.log_dir) in msg
    assert err.result.status == "failed" and err.result.ranks[1]["rank"] == 1  # partial results
    assert_no_survivors(err.result.log_dir, [err.result.agent_pid, *err.result.worker_pids])


@pytest.mark.slow
def test_hung_rank_is_named_not_its_victim(home):
    """Rank 1 sleeps outside any collective; rank 0 waits in all_reduce. torchrun would blame
    rank 0 (its collective times out first); the heartbeats must blame rank 1."""
    with pytest.raises(launch.JobTimeout) as info:
        launch.run(
            Faults(mode="hang", hang_rank=1, spawn_child=True),
            nproc=2,
            heartbeat_timeout_s=2,
            timeout_s=120,
            stream=False,
        )
    err = info.value
    assert err.ranks == [1] and err.rank == 1
    msg = str(err)
    assert "heartbeat_timeout_s=2" in msg and "likely hung: rank 1" in msg
    assert "rank 0: waiting in collective 'all_reduce' at step 2/3" in msg
    assert "rank 1: at step 1/3 in phase 'compute', not in a collective" in msg
    # Where each rank was, from its own stack dump: the code line, and the torch call it is in.
    assert err.where[1].startswith("_faults.py, line ") and "`time.sleep(_FOREVER_S)" in err.where[1]
    assert "`tdist.all_reduce(" in err.where[0] and err.where[0].endswith("inside all_reduce (torch)")
    assert f"    stuck at {err.where[1]}" in msg
    child = err.result.ranks[0]["child_pid"]  # a worker's own child must be ended too
    assert_no_survivors(err.result.log_dir, [err.result.agent_pid, *err.result.worker_pids, child])


@pytest.mark.slow
def test_collective_timeout_blames_the_hung_rank_too(home):
    """With a short process-group timeout, rank 0's all_reduce raises first: the root cause is
    rank 0 (what torchrun reports), but the message must point at rank 1, which hung."""
    with pytest.raises(launch.JobFailed) as info:
        launch.run(
            Faults(mode="hang"), nproc=2, pg_timeout_s=2, timeout_s=120, stream=False
        )
    err = info.value
    assert err.rank == 0 and err.hung_ranks == [1]
    assert "rank 0 failed waiting in collective 'all_reduce'; likely hung: rank 1" in str(err)
    assert_no_survivors(err.result.log_dir, [err.result.agent_pid, *err.result.worker_pids])


@pytest.mark.slow
def test_outer_timeout_kills_workers_that_ignore_sigterm(home):
    t0 = time.monotonic()
    with pytest.raises(launch.JobTimeout, match=r"timed out after .* \(timeout_s=8\)") as info:
        launch.run(
            Faults(mode="hang", ignore_sigterm=True),
            nproc=2,
            timeout_s=8,
            stream=False,
        )
    res = info.value.result
    assert res.status == "timeout"
    # SIGTERM is ignored; SIGKILL after the grace period must still end everything promptly
    # (torchrun alone would wait 30 s). Generous bound: this is not a speed test.
    assert time.monotonic() - t0 < 8 + 25
    assert_no_survivors(res.log_dir, [res.agent_pid, *res.worker_pids])


@pytest.mark.slow
def test_keyboard_interrupt_ends_the_job_and_is_reraised(home, capsys):
    class Interrupter:
        def on_tick(self, job):
            if len(job.heartbeats) == job.nproc:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        launch.run(
            Faults(mode="hang"), nproc=2, observers=[Interrupter()], timeout_s=120
        )
    out = capsys.readouterr().out
    assert "labkit: interrupted; ended" in out
    (job_dir,) = (home / "runs").iterdir()
    assert_no_survivors(job_dir)
    assert not list((home / "jobs").glob("*.json"))


@pytest.mark.slow
def test_killed_launcher_leaves_no_orphans(home):
    """SIGKILL to the launching process (a Jupyter kernel restart) must take the job down:
    the agent's and the workers' parent-death signals do it, without any cleanup code."""
    code = (
        "from labkit.jobs import launch; from labkit.workers._faults import FaultsConfig; "
        "launch.run(FaultsConfig(mode='hang'), nproc=2, timeout_s=300)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "LABKIT_HOME": str(home)}
    owner = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        record = None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # wait until both workers are registered
            found = list((home / "jobs").glob("*.json"))
            record = json.loads(found[0].read_text()) if found else None
            if record and len(record["workers"]) >= 2:
                break
            time.sleep(0.2)
        assert record and len(record["workers"]) >= 2, "the job never got going"
        pids = [record["agent"]["pid"], *(w["pid"] for w in record["workers"])]
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=10)
        assert_no_survivors(record["job_dir"], pids, wait_s=15)
    except BaseException:
        owner.kill()
        owner.wait()
        launch.cleanup()  # the owner is dead: end whatever the failure left running
        raise
    # The stale record is the registry's job: cleanup() finds nothing left to end and drops it.
    assert launch.cleanup() == []
    assert not list((home / "jobs").glob("*.json"))


@pytest.mark.slow
def test_two_jobs_at_once_do_not_collide(home):
    """No fixed port: two concurrent jobs each get their own rendezvous port."""
    results: dict[int, object] = {}

    def job(i: int) -> None:
        try:
            results[i] = launch.run(
                Faults(mode="ok"), nproc=2, stream=False, timeout_s=120
            )
        except Exception as e:
            results[i] = e

    threads = [threading.Thread(target=job, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    for i in range(2):
        res = results[i]
        assert isinstance(res, launch.JobResult), res
        assert [r["sum"] for r in res.ranks] == [2.0, 2.0]
    assert results[0].log_dir != results[1].log_dir


@pytest.mark.slow
def test_rank_pids_are_known_before_the_first_heartbeat(home):
    """A monitor must see the ranks while they still import torch, before any heartbeat."""
    seen: list[tuple[dict, dict]] = []

    class Watcher:
        def on_tick(self, job):
            seen.append((dict(job.heartbeats), job.rank_pids()))

    result = launch.run(Faults(mode="ok", steps=2), nproc=2, timeout_s=60,
                        stream=False, observers=[Watcher()])
    early = [pids for beats, pids in seen if not beats and len(pids) == 2]
    assert early, "no tick saw both ranks' PIDs before their heartbeats"
    assert early[-1] == {r: result.rank(r)["pid"] for r in (0, 1)}


def test_progress_lines_speak_at_start_every_few_seconds_and_at_the_end(tmp_path):
    lines: list[str] = []
    obs = launch.ProgressLines("DDP on 2 ranks", every_s=3.0, write=lines.append)
    job = launch.Job(job_id="j", module="m", nproc=2, backend="gloo", device="cpu", config={},
                     job_dir=tmp_path, started=100.0)  # fmt: skip
    clock = [100.0]
    with mock.patch.object(observers.time, "monotonic", lambda: clock[0]):
        obs.on_start(job)
        for t in (1.0, 2.9, 3.1, 4.0, 6.2):
            clock[0] = 100.0 + t
            if t >= 4.0:
                job.heartbeats = {0: {"step": 5, "total": 12}, 1: {"step": 4, "total": 12}}
            obs.on_tick(job)
        clock[0] = 107.0
        obs.on_end(job, SimpleNamespace(status="ok"))
    assert lines == [
        "DDP on 2 ranks: starting 2 ranks",
        "DDP on 2 ranks:   3 s, starting up (importing torch, joining the process group)",
        "DDP on 2 ranks:   6 s, step 4 of 12",  # the slowest rank's step
        "DDP on 2 ranks: done in 7 s",
    ]
    with pytest.raises(ValueError, match="every_s=0"):
        launch.ProgressLines("x", every_s=0)


# --- a rank that dies without a Python exception is the cause, not its survivors ---------------


def _assert_dead_rank_is_the_cause(err: launch.JobFailed, how: str) -> str:
    """Rank 1 died; rank 0 ended after it, and the message must say so. Which comes first is
    a race: usually gloo notices the closed connection and rank 0's all_reduce raises, but on
    a loaded machine torchrun's agent can see rank 1's exit and stop rank 0 first (1 CI run of
    about 20 here). Either is what happened, and either names rank 1 as the cause."""
    msg = str(err)
    assert err.rank == 1, msg
    assert msg.startswith(f"{FAULTS} failed on rank 1: {how}"), msg
    assert err.consequences == [0], msg
    assert re.search(r"rank 0: (failed in collective 'all_reduce' (because rank 1 was gone|"
                     r"waiting for rank 1)|stopped by torchrun \(SIG\w+\) once rank 1 had "
                     r"failed)", msg), msg
    assert "likely hung" not in msg, "a dead rank is not a hung one"
    assert msg.index("what followed from rank 1's failure") > msg.index("failed on rank 1")
    assert_no_survivors(err.result.log_dir, [err.result.agent_pid, *err.result.worker_pids])
    return msg


@pytest.mark.slow
def test_a_rank_that_exits_is_the_cause_not_its_survivor(home):
    with pytest.raises(launch.JobFailed) as info:
        launch.run(Faults(mode="exit", code=3), nproc=2, stream=False,
                   timeout_s=120)  # fmt: skip
    assert info.value.exitcode == 3 and info.value.exc_type == ""
    _assert_dead_rank_is_the_cause(
        info.value, "the process exited with code 3 without raising an exception"
    )


@pytest.mark.slow
def test_a_killed_rank_is_named_with_its_signal_and_what_it_usually_means(home):
    with pytest.raises(launch.JobFailed) as info:
        launch.run(Faults(mode="kill"), nproc=2, stream=False, timeout_s=120)
    assert info.value.exitcode == -9
    msg = _assert_dead_rank_is_the_cause(info.value, "the process was killed by SIGKILL")
    assert "most often the out-of-memory killer" in msg and "`dmesg`" in msg


@contextlib.contextmanager
def memory_cgroup(limit_mb: int):
    """A fresh memory cgroup limited to ``limit_mb`` MiB (v1 or v2), or None where this machine
    does not let us make one (not root, no writable cgroup file system)."""
    name = f"labkit-test-{os.getpid()}-{time.monotonic_ns()}"
    made = None
    for base, limits in (
        (Path("/sys/fs/cgroup/memory"), ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")),
        (Path("/sys/fs/cgroup"), ("memory.max", "memory.swap.max")),
    ):
        path = base / name
        try:
            if limits[0] == "memory.max" and "memory" not in (
                base / "cgroup.subtree_control"
            ).read_text().split():
                continue  # v2 without the memory controller delegated here
            path.mkdir()
        except OSError:
            continue
        try:
            (path / limits[0]).write_text(str(limit_mb << 20))
            with contextlib.suppress(OSError):  # no swap accounting: there is no swap to use
                (path / limits[1]).write_text(str(limit_mb << 20) if "memsw" in limits[1] else "0")
            made = path
            break
        except OSError:
            path.rmdir()
    try:
        yield made
    finally:
        if made is not None:
            deadline = time.monotonic() + 10
            while True:  # a cgroup can be removed once its last process has been reaped
                try:
                    made.rmdir()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)


def _oom_kills(cgroup: Path) -> int | None:
    for name, key in (("memory.oom_control", "oom_kill"), ("memory.events", "oom_kill")):
        with contextlib.suppress(OSError):
            for line in (cgroup / name).read_text().splitlines():
                if line.startswith(key + " "):
                    return int(line.split()[1])
    return None


@pytest.mark.slow
def test_out_of_memory_inside_a_real_memory_limit_is_named(home):
    """A rank outgrows a real memory limit. In a cgroup the kernel's OOM killer ends it with
    SIGKILL; under RLIMIT_AS (where this machine allows no cgroup) the allocation fails and
    torch raises. Either way the message must name rank 1 and say it ran out of memory."""
    with memory_cgroup(256) as cgroup:
        limit = {"cgroup": str(cgroup)} if cgroup else {"rlimit_as_mb": 256}
        with pytest.raises(launch.JobFailed) as info:
            launch.run(Faults(mode="oom", chunk_mb=32, **limit), nproc=2, stream=False,
                       timeout_s=120)  # fmt: skip
        err = info.value
        if cgroup:
            assert _oom_kills(cgroup) in (None, 1), "the kernel's OOM killer did not act"
            assert err.exitcode == -9
            msg = _assert_dead_rank_is_the_cause(err, "the process was killed by SIGKILL")
            assert "most often the out-of-memory killer" in msg
        else:
            msg = _assert_dead_rank_is_the_cause(err, "RuntimeError: ")
            assert "can't allocate memory" in msg and "rank 1 ran out of memory" in msg


# --- interrupts --------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_second_interrupt_does_not_cut_the_cleanup_short(home, capsys, monkeypatch):
    """A learner presses ■ twice. The ranks ignore SIGTERM, so ending them takes the grace
    period; two more SIGINTs arrive meanwhile, as a real ■ delivers them (a signal to this
    process, default handler). When run() raises, no process of the job may be left."""
    assert threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGINT)
    ending = threading.Event()
    real_end_tree = procs.end_tree

    def end_tree(*args, **kwargs):
        ending.set()
        try:
            return real_end_tree(*args, **kwargs)
        finally:
            ending.clear()

    monkeypatch.setattr(procs, "end_tree", end_tree)

    def press_again() -> None:
        ending.wait(60)
        for _ in range(2):
            time.sleep(0.3)
            if ending.is_set():  # never after run() is over: pytest itself would get it
                os.kill(os.getpid(), signal.SIGINT)

    class Interrupter:
        def on_tick(self, job):
            if len(job.heartbeats) == job.nproc:
                threading.Thread(target=press_again, daemon=True).start()
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        launch.run(Faults(mode="hang", ignore_sigterm=True), nproc=2,
                   observers=[Interrupter()], timeout_s=120)  # fmt: skip
    out = capsys.readouterr().out
    (job_dir,) = (home / "runs").iterdir()
    assert_no_survivors(job_dir)  # at once: run() returned only once they were gone
    assert "labkit: still ending the processes of job" in out
    assert "labkit: interrupted; ended" in out
    assert signal.getsignal(signal.SIGINT) is before, "the kernel's own handler is back"
    assert not list((home / "jobs").glob("*.json"))


def test_the_next_launch_ends_a_job_this_process_no_longer_supervises(home):
    """A job whose ending was cut short (launched from a thread, where no signal can be held
    off) belongs to a live launcher, so cleanup() alone spares it; the next run() must not."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        me = psutil.Process()
        runtime.write_json_atomic(
            home / "jobs" / "cut-short.json",
            {"job_id": "cut-short", "module": "m", "owner": procs.record(me),
             "agent": procs.record(psutil.Process(sleeper.pid)), "workers": []},
        )  # fmt: skip
        assert procs.cleanup() == [] and sleeper.poll() is None
        assert procs.cleanup(supervised={"cut-short"}) == [] and sleeper.poll() is None
        report = procs.cleanup(supervised=set())
        assert report == [{"job_id": "cut-short", "module": "m", "pids": [sleeper.pid]}]
        assert sleeper.wait(timeout=10) == -signal.SIGTERM
    finally:
        sleeper.kill()
        sleeper.wait()


# --- the machine: cores, ports, disk ---------------------------------------------------------


def test_cpu_ranks_are_bounded_by_the_cores_unless_oversubscribed(monkeypatch):
    monkeypatch.setattr(preflight, "usable_cpus", lambda: 2)  # where check_cpu_ranks looks
    assert launch.check_cpu_ranks(2, "cpu") is None
    assert "4 ranks share 2 CPU cores" in launch.check_cpu_ranks(4, "cpu")
    assert launch.check_cpu_ranks(8, "cpu") is not None  # 4 per core: still allowed
    with pytest.raises(ValueError, match="nproc=9 CPU ranks on 2 cores: at most 8"):
        launch.check_cpu_ranks(9, "cpu")
    assert "9 ranks share" in launch.check_cpu_ranks(9, "cpu", oversubscribe=True)
    assert launch.check_cpu_ranks(10_000, "cuda") is None  # GPUs bound those (resolve_backend)


_HOLD_EVERY_PORT = """
import socket, sys
from labkit.jobs import launch
from labkit.workers._faults import FaultsConfig as Faults
low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
held = []
for port in range(low, high + 1):  # take every port of the (narrowed) ephemeral range
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    held.append(s)
try:
    launch.run(Faults(mode="ok"), nproc=2, timeout_s=120)
except launch.LaunchError as e:
    print("LaunchError:", e)
"""


@pytest.mark.slow
def test_no_free_port_is_said_at_once(home, tmp_path):
    """Every ephemeral port in use, for real: in a network namespace of its own (root only),
    with the range narrowed to four ports, all held. torchrun alone would retry a minute and
    then blame ranks that never existed."""
    script = tmp_path / "ports.py"
    script.write_text(_HOLD_EVERY_PORT)
    netns = (
        "ip link set lo up && echo '40000 40003' > /proc/sys/net/ipv4/ip_local_port_range && "
        f"{sys.executable} {script}"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "LABKIT_HOME": str(home)}
    proc = subprocess.run(["unshare", "-n", "sh", "-c", netns], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    if proc.returncode != 0 and "unshare" in proc.stderr and "Traceback" not in proc.stderr:
        pytest.skip(f"cannot make a network namespace here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "LaunchError: no free local network port (Address already in use)" in out, out
    assert "40000 to 40003" in out and "`ss -tanp`" in out
    assert not (home / "runs").exists(), "nothing may start without a port"


def test_cpu_ranks_see_no_gpu_and_gpu_ranks_keep_theirs(tmp_path, monkeypatch):
    """Ranks put on the CPU (two ranks, one GPU) get CUDA_VISIBLE_DEVICES="": torch code that
    asks torch.cuda.is_available() instead of the tensor's device (PowerSGD's hook) would
    otherwise reach for the GPU. A worker's own setting wins; GPU jobs keep the parent's."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")

    def env(device, extra):
        job = launch.Job("j", "m", 2, "gloo" if device == "cpu" else "nccl", device, {}, tmp_path)
        return Supervisor(job, [], extra, observers=[], echo=Echo(0, tmp_path))._env()

    assert env("cpu", {})["CUDA_VISIBLE_DEVICES"] == ""
    assert env("cuda", {})["CUDA_VISIBLE_DEVICES"] == "0"
    assert env("cpu", {"CUDA_VISIBLE_DEVICES": "1"})["CUDA_VISIBLE_DEVICES"] == "1"


def test_the_agent_failing_to_get_a_port_ends_the_job_at_once(tmp_path):
    """The port check passed, but the ports were gone by the time torchrun's agent asked:
    its first failed connection ends the job (it would otherwise retry for 60 s)."""
    job = launch.Job("j", "m", 2, "gloo", "cpu", {}, tmp_path)
    sup = Supervisor(job, [], {}, observers=[], echo=Echo(0, tmp_path))
    sup._log = open(tmp_path / "agent.log", "w")  # noqa: SIM115
    sup._on_line("[rank0] hello")
    assert sup.agent_problem is None
    # A rank's gloo, too, when the ports are nearly gone (the agent got one, the ranks not).
    sup._on_line("[rank1] [W1203 socket.cpp:764] [c10d] The client socket has failed to connect "
                 "to 127.0.0.1:47555 (errno: 99 - Cannot assign requested address).")  # fmt: skip
    sup._log.close()
    assert sup.agent_problem.startswith(
        "no free local network port (Cannot assign requested address)"
    )


def test_a_timeout_before_any_rank_started_blames_no_rank(tmp_path):
    (tmp_path / "agent.log").write_text("[E socket.cpp:818] [c10d] rendezvous still waiting\n")
    job = launch.Job("j", "m", 2, "gloo", "cpu", {}, tmp_path)
    result = SimpleNamespace(status="timeout")
    err = outcome.timeout_error(job, result, "timed out after 60.0 s", ranks_started=False)
    msg = str(err)
    assert err.ranks == [] and "likely hung" not in msg and "rank 0" not in msg
    assert "no rank ever started: torchrun's agent was still setting the job up" in msg
    assert "rendezvous still waiting" in msg


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs: a real disk that fills up (mounting needs root; skipped elsewhere)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()[:200]}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(path: Path) -> None:
    """Write zeros to ``path`` until the disk under it is full."""
    with contextlib.suppress(OSError), open(path, "wb") as f:
        while True:
            f.write(b"\0" * 65536)
            f.flush()


@pytest.mark.slow
def test_a_full_disk_is_named_with_its_path_and_ways_out(small_disk, monkeypatch, capsys):
    monkeypatch.setenv("LABKIT_HOME", str(small_disk / "labkit"))
    (small_disk / "labkit").mkdir()
    _fill(small_disk / "someone-elses-file")  # nothing labkit may delete
    for _ in (1, 2):  # and again: a full disk stays full
        with pytest.raises(launch.LaunchError) as info:
            launch.run(Faults(mode="ok"), nproc=2, timeout_s=120)
        msg = str(info.value)
        assert f"the disk holding {small_disk / 'labkit'}" in msg, msg
        assert "No space left on device" in msg
        assert "`python -m labkit cleanup --runs 0`" in msg and "LABKIT_HOME" in msg
    assert not list((small_disk / "labkit" / "runs").glob("*")), "no half-made job folder"


@pytest.mark.slow
def test_a_disk_full_of_old_job_folders_is_tidied_to_make_room(small_disk, monkeypatch, capsys):
    home = small_disk / "labkit"
    monkeypatch.setenv("LABKIT_HOME", str(home))
    olds = [home / "runs" / f"old-{i}" for i in range(3)]
    for old in olds:  # old jobs' folders...
        old.mkdir(parents=True)
        (old / runtime.SPEC_FILE).write_text("{}")
    _fill(olds[0] / "agent.log")  # ...whose logs fill the disk
    res = launch.run(Faults(mode="ok"), nproc=2, timeout_s=120, stream=False)
    assert res.status == "ok" and [r["sum"] for r in res.ranks] == [2.0, 2.0]
    out = capsys.readouterr().out
    assert f"labkit: the disk holding {home / 'runs'} is full; deleted 3 old job folder(s)" in out
    assert sorted(p.name for p in (home / "runs").iterdir()) == [res.job_id]
    assert_no_survivors(res.log_dir, [res.agent_pid, *res.worker_pids])


_UNGUARDED = '''
from labkit.jobs import runtime


@runtime.entrypoint
def main(ctx):
    return {"rank": ctx.rank}

# no `if __name__ == "__main__": main()`: under `python -m`, nothing calls main
'''


@pytest.mark.slow
def test_a_worker_without_its_main_guard_is_an_error_not_an_empty_success(home, tmp_path,
                                                                         monkeypatch):
    (tmp_path / "unguarded_worker.py").write_text(_UNGUARDED)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(launch.JobFailed) as info:
        launch.run("unguarded_worker", nproc=2, timeout_s=120, stream=False)
    msg = str(info.value)
    assert msg.startswith("unguarded_worker: no rank ran a worker function"), msg
    assert "decorated with @runtime.entrypoint" in msg
    assert 'does the module end with `if __name__ == "__main__": main()`?' in msg
    assert info.value.result.status == "ok" and info.value.result.ranks == [{}, {}]


# --- what the audit of these messages found -----------------------------------------------------


@pytest.mark.slow
def test_a_rank_that_calls_sys_exit_is_named_with_the_call_and_its_line(home):
    for code, headline in (
        (0, "the process called sys.exit(0) at _faults.py, line"),
        ("I give up", "SystemExit: sys.exit('I give up') called at _faults.py, line"),
    ):
        with pytest.raises(launch.JobFailed) as info:
            launch.run(Faults(mode="sysexit", code=code), nproc=2, stream=False,
                       timeout_s=120)  # fmt: skip
        msg = str(info.value)
        assert info.value.rank == 1 and f"failed on rank 1: {headline}" in msg, msg
        assert "rank 0: failed in collective 'all_reduce' because rank 1 was gone" in msg
        assert "likely hung" not in msg and "without raising an exception" not in msg


@pytest.mark.slow
def test_mismatched_collectives_show_what_native_code_said_and_the_line(home):
    """gloo's own check fails and aborts the rank (SIGABRT): its message ("Is there a
    distributed collective mismatch") and the line the rank was on must be shown, not the
    tail of Python's thread dump."""
    with pytest.raises(launch.JobFailed) as info:
        launch.run(Faults(mode="mismatch"), nproc=2, stream=False, timeout_s=120)
    msg = str(info.value)
    assert "was killed by SIGABRT" in msg, msg
    assert "collective mismatch" in msg or "doesn't match" in msg
    assert "it was at _faults.py, line" in msg and "inside all_reduce (torch)" in msg
    assert "Extension modules" not in msg
    assert_no_survivors(info.value.result.log_dir)


@pytest.mark.slow
def test_a_child_started_just_before_a_job_ends_is_ended_with_it(home):
    """Rank 0 starts a child and the job finishes at once: the child is orphaned (adopted by
    PID 1) before any tree scan saw it; it carries the job's LABKIT_JOB_DIR all the same."""
    res = launch.run(Faults(mode="ok", spawn_child=True, steps=1), nproc=2,
                     stream=False, timeout_s=120)  # fmt: skip
    child = res.rank(0)["child_pid"]
    assert_no_survivors(res.log_dir, [child])


_RAISES_ON_IMPORT = '''
import no_such_module_anywhere  # noqa: F401
'''


@pytest.mark.slow
def test_a_worker_whose_import_raises_is_named_with_its_exception(home, tmp_path, monkeypatch):
    (tmp_path / "import_fails.py").write_text(_RAISES_ON_IMPORT)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(launch.JobFailed) as info:
        launch.run("import_fails", nproc=2, timeout_s=120, stream=False)
    msg = str(info.value)
    assert "ModuleNotFoundError: No module named 'no_such_module_anywhere'" in msg, msg
    assert "without raising an exception" not in msg


@pytest.mark.slow
def test_a_disk_that_fills_during_a_job_is_named_and_the_job_tidied(small_disk, monkeypatch):
    home = small_disk / "labkit"
    monkeypatch.setenv("LABKIT_HOME", str(home))
    with pytest.raises((launch.JobFailed, launch.LaunchError)) as info:
        launch.run(Faults(mode="fill"), nproc=2, stream=False, timeout_s=120)
    msg = str(info.value)
    assert "No space left on device" in msg and "python -m labkit cleanup --runs 0" in msg, msg
    assert not list((home / "jobs").glob("*.json")), "the registry record is removed"


def _fake_job(tmp_path, ranks: dict[int, dict]) -> Path:
    """A job directory with an error.json per raising rank and torchrun's failure summary."""
    entries = []
    for r, how in ranks.items():
        err = tmp_path / "torchrun" / "x" / "attempt_0" / str(r) / "error.json"
        err.parent.mkdir(parents=True)
        err.write_text(json.dumps({"message": {"message": how["message"], "extraInfo": {
            "py_callstack": "", "timestamp": str(how["t"])}}}))  # fmt: skip
        entries.append(f"  rank      : {r} (local_rank: {r})\n  exitcode  : 1 (pid: {100 + r})")
    (tmp_path / "agent.log").write_text("Failures:\n" + "\n".join(entries) + "\n")
    return tmp_path


def test_independent_failures_are_not_called_consequences(tmp_path):
    job = _fake_job(tmp_path, {
        0: {"message": "ValueError: bad shape on rank 0", "t": 100.0},
        1: {"message": "KeyError: 'w' on rank 1", "t": 100.2},
        2: {"message": "RuntimeError: Connection closed by peer [127.0.0.1]:5", "t": 100.3},
    })  # fmt: skip
    report = diagnosis.failure_report(job, 3, 1)
    text = "\n".join([report.headline, *report.lines])
    assert report.rank == 0 and report.headline.startswith("failed on rank 0: ValueError")
    assert "other ranks that failed on their own:\n  rank 1: failed (KeyError: 'w' on rank 1)" in text
    assert "what followed from rank 0's failure:\n  rank 2: failed because rank 0 was gone" in text
    assert [e.rank for e in report.consequences] == [2]


def test_a_rank_killed_by_sigkill_is_the_cause_even_if_torchrun_also_sent_it_sigterm(tmp_path):
    """The race the OOM test can hit: torchrun saw rank 0's "connection closed" first and sent
    SIGTERM to every rank, rank 1 included, which the OOM killer had already SIGKILLed."""
    err = tmp_path / "torchrun" / "x" / "attempt_0" / "0" / "error.json"
    err.parent.mkdir(parents=True)
    err.write_text(json.dumps({"message": {"message": "RuntimeError: Connection closed by peer",
                                           "extraInfo": {"py_callstack": "", "timestamp": "1"}}}))
    (tmp_path / "agent.log").write_text(
        "Sending process 100 closing signal SIGTERM\nSending process 101 closing signal SIGTERM\n"
        "  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 100)\n"
        "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 101)\n"
    )  # fmt: skip
    report = diagnosis.failure_report(tmp_path, 2, 1)
    assert report.rank == 1 and "killed by SIGKILL" in report.headline
    assert [e.rank for e in report.consequences] == [0]


def test_a_rank_gone_before_an_agent_that_never_reported_is_still_named(tmp_path):
    """The race seen in CI: rank 1 killed itself; torchrun sent rank 0 SIGTERM and read its
    error.json while rank 0 was still writing it, failed to parse it and exited without listing
    the failures. Rank 1, which torchrun never had to stop, is the cause."""
    err = tmp_path / "torchrun" / "x" / "attempt_0" / "0" / "error.json"
    err.parent.mkdir(parents=True)
    err.write_text("")  # half-written: nothing yet
    (tmp_path / "agent.log").write_text(
        "W1203 api.py:1028] Sending process 100 closing signal SIGTERM\n"
        "E1203 errors/__init__.py:132] Failed to parse reply file: " + str(err) + "\n"
        "json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)\n"
    )  # fmt: skip
    for rank, beat in {0: {"pid": 100, "phase": "all_reduce", "in_collective": True},
                       1: {"pid": 101, "phase": "run", "in_collective": False}}.items():
        spec.write_json_atomic(spec.heartbeat_path(tmp_path, rank),
                               {"rank": rank, "time": 1.0, **beat})  # fmt: skip
    report = diagnosis.failure_report(tmp_path, 2, 1)
    assert report.rank == 1, report.headline
    assert "ended before torchrun stopped the other ranks" in report.headline
    assert [e.rank for e in report.consequences] == [0]
    # and where torchrun did report, nothing is inferred: the test above still holds
