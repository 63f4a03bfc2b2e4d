"""Exercise checks at their edges (issue 31): a learner's collective that only some ranks call,
child processes the learner's code leaves in the kernel, and code that exits instead of
returning.

A collective only rank 0 calls leaves rank 1 elsewhere: gloo then pairs the lone call with
whatever rank 1 calls next, or both wait until the process group's timeout, and each rank's
error ("Timed out waiting", "Application timeout caused pair closure", "Connection closed by
peer") is an echo that names neither the collective nor the rank. The check jobs' ranks keep a
ledger of their collectives (``labkit.jobs.diagnosis.CollectiveLedger``); the check compares them.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import psutil
import pytest
import torch
import torch.distributed as tdist

from labkit.course import exercises as ex
from labkit.course.exercises import data_parallel as exdp
from labkit.course.exercises import leftovers
from labkit.course.exercises import registry as exercise_registry
from labkit.course.exercises.data_parallel import check_tools as dp_check_tools
from labkit.course.exercises.data_parallel import runner as dp_runner
from labkit.jobs import diagnosis, launch

ROOT = Path(__file__).resolve().parents[1]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _child_pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture
def one_second_limit(monkeypatch):
    """01.adam_bytes with a 1 s time limit (its check calls the answer a few times)."""
    monkeypatch.setitem(exercise_registry._REGISTRY, "01.adam_bytes",
                        dataclasses.replace(ex.get("01.adam_bytes"), time_limit_s=1.0))  # fmt: skip


@pytest.fixture
def started():
    """PIDs a test's learner code started; any still running at the end is stopped (a failing
    test must not leave processes behind)."""
    pids: list[int] = []
    yield pids
    for pid in _child_pids_alive(pids):
        os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------- 1: collectives apart


def _write_ledger(folder: Path, rank: int, entries: list[dict]) -> None:
    path = diagnosis.ledger_path(folder, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))


def _learner_call(n: int, line: int, op: str = "all_reduce") -> dict:
    return {"n": n, "op": op, "file": "/home/me/.cache/labkit/exercises/02/dp_overlap.py",
            "line": line, "func": "_on_grad_ready", "code": "dist.all_reduce(p.grad)",
            "yours": True}  # fmt: skip


def _check_call(n: int, op: str = "all_gather_object") -> dict:
    return {"n": n, "op": op, "file": dp_check_tools.__file__, "line": 55, "func": "agree_on_problem",
            "code": "tdist.all_gather_object(found, problem)", "yours": False}  # fmt: skip


def _job_result(tmp_path: Path) -> launch.JobResult:
    return launch.JobResult(module="labkit.course.exercises.data_parallel.worker", job_id="j", nproc=2,
                            backend="gloo", device="cpu", ranks=[{}, {}], wall_s=42.0,
                            log_dir=tmp_path, status="failed", returncode=1)  # fmt: skip


def test_pair_closure_is_an_echo_of_the_other_ranks_timeout():
    assert diagnosis.is_echo("RuntimeError: [../gloo/transport/tcp/pair.cc:598] Application "
                             "timeout caused pair closure")  # fmt: skip


def test_a_collective_only_rank_0_called_is_named_from_the_ledgers_not_the_echo(tmp_path):
    """The issue's case as the notebook met it: 'the check job failed on rank 0: RuntimeError:
    Application timeout caused pair closure', and nothing said that rank 1 never called rank
    0's all-reduce."""
    shared = [_check_call(1, "broadcast"), _check_call(2, "all_reduce")]
    _write_ledger(tmp_path, 0, [*shared, _learner_call(3, 15), {"end": "raised"}])
    _write_ledger(tmp_path, 1, [*shared, _check_call(3), {"end": "raised"}])
    failed = launch.JobFailed(
        "labkit.course.exercises.data_parallel.worker failed on rank 0", result=_job_result(tmp_path), rank=0,
        exc_type="RuntimeError", kind="raised",
        exc_message="[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:598] Application "
                    "timeout caused pair closure",
    )  # fmt: skip
    text = ex.explain_job_error(failed, {})
    assert text.startswith(
        "the ranks' collectives went apart: rank 0 called dist.all_reduce at dp_overlap.py, "
        "line 15, in _on_grad_ready (`dist.all_reduce(p.grad)`), its 3rd collective, and rank "
        "1 never called it: its 3rd was the check's own dist.all_gather_object"), text
    assert "Every rank must call the same collectives in the same order" in text
    assert "pair closure" not in text and f"Logs: {tmp_path}" in text


def test_a_rank_that_reported_a_mistake_and_left_comes_first(tmp_path):
    """Ranks that parted at the check's own collective: the rank that stopped there found a
    mistake, and its report is the cause; the other rank's wait follows."""
    _write_ledger(tmp_path, 0, [_learner_call(1, 15), _check_call(2)])
    _write_ledger(tmp_path, 1, [_learner_call(1, 15), {"end": "returned"}])
    failed = launch.JobFailed("w failed on rank 0", result=_job_result(tmp_path), rank=0,
                              exc_type="RuntimeError", kind="waited",
                              exc_message="Timed out waiting 15000ms for recv")  # fmt: skip
    reports = {1: "on rank 1: wte.weight was never all-reduced"}
    text = ex.explain_job_error(failed, reports)
    assert text.startswith("on rank 1: wte.weight was never all-reduced. Then rank 0 waited in "
                           "the check's own dist.all_gather_object (check_tools.py, line 55, "
                           "in agree_on_problem), which rank 1 never called."), text  # fmt: skip


def test_ledgers_that_agree_leave_the_other_evidence_in_charge(tmp_path):
    """A rank that died is the cause, whatever the ledgers; agreeing ledgers say nothing."""
    calls = [_check_call(1, "broadcast"), _learner_call(2, 15)]
    _write_ledger(tmp_path, 0, calls)
    _write_ledger(tmp_path, 1, calls)
    died = launch.JobFailed("w failed on rank 1", result=_job_result(tmp_path), rank=1,
                            exitcode=-9, kind="died",
                            exc_message="the process was killed by SIGKILL")  # fmt: skip
    assert ex.explain_job_error(died, {}).startswith("the check job failed on rank 1: the "
                                                     "process was killed by SIGKILL")  # fmt: skip
    assert ex.ranks_apart(_job_result(tmp_path), {}) is None


def test_a_call_the_other_rank_made_only_later_is_told_apart_from_one_it_never_made():
    """f and g where g's all-reduce runs on rank 0 only: rank 0's g pairs with rank 1's f.
    The call rank 1 never made is g's, although f's came first on rank 1."""
    g = {**_learner_call(1, 33), "func": "forward"}
    f = {**_learner_call(1, 20), "func": "backward"}
    apart = diagnosis.collectives_apart({
        0: diagnosis.RankLedger(0, [g, {**f, "n": 2}]),
        1: diagnosis.RankLedger(1, [f], {"end": "returned"}),
    })  # fmt: skip
    assert apart is not None and (apart.rank, apart.other, apart.position) == (0, 1, 1)
    assert apart.call["line"] == 33 and not apart.later and apart.yours
    text = apart.describe("the check's own")
    assert "rank 0 called dist.all_reduce at dp_overlap.py, line 33, in forward" in text
    assert "rank 1 never called it: its 1st was dist.all_reduce at dp_overlap.py, line 20" in text


def test_collectives_on_a_group_are_compared_only_between_its_members():
    world = _check_call(1, "barrier")
    pair01 = {**_learner_call(2, 7), "group": [0, 1]}
    pair23 = {**_learner_call(2, 9), "group": [2, 3]}
    ledgers = {r: diagnosis.RankLedger(r, [world, pair01 if r < 2 else pair23]) for r in range(4)}
    assert diagnosis.collectives_apart(ledgers) is None
    ledgers[3] = diagnosis.RankLedger(3, [world])  # rank 3 skipped its group's all-reduce
    apart = diagnosis.collectives_apart(ledgers)
    assert apart is not None and (apart.rank, apart.other) == (2, 3), apart


def test_the_ledger_records_each_collective_once_with_the_line_that_called_it(tmp_path):
    """In one process (a 1-rank group): all_gather_object calls all_gather inside, which is
    one entry; the caller is this file's line; the block's end is written."""
    original = tdist.all_reduce
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        ledger = diagnosis.CollectiveLedger(diagnosis.ledger_path(tmp_path, 0))
        with ledger.recording():
            assert tdist.all_reduce is not original
            tdist.all_reduce(torch.ones(2))  # line A
            found = [None]
            tdist.all_gather_object(found, "x")
        assert tdist.all_reduce is original  # torch's own again
    finally:
        tdist.destroy_process_group()
    [read] = diagnosis.read_ledgers(tmp_path, 1).values()
    assert [c["op"] for c in read.calls] == ["all_reduce", "all_gather_object"]
    assert read.calls[0]["file"] == __file__ and read.calls[0]["yours"]
    assert read.calls[0]["code"] == "tdist.all_reduce(torch.ones(2))  # line A"
    assert read.end == {"end": "returned"}


def _mp_fg_rank0_only() -> str:
    nb = nbformat.read(ROOT / "solutions" / "03_model_parallelism.ipynb", as_version=4)
    [cell] = [c.source for c in nb.cells
              if c.cell_type == "code" and c.source.startswith("%%writefile") and "mp_fg.py" in c.source.split("\n")[0]]  # fmt: skip
    source = cell.split("\n", 1)[1]
    lone = "        x = x.clone()\n        dist.all_reduce(x)\n"
    assert lone in source
    return source.replace(lone, "        x = x.clone()\n        if dist.get_rank() == 0:\n"
                                "            dist.all_reduce(x)\n")  # fmt: skip


@pytest.mark.slow
def test_a_data_parallel_all_reduce_on_rank_0_only_names_the_rank_that_never_called_it(
    tmp_path, monkeypatch
):
    """2 real gloo ranks; the learner's hook all-reduces on rank 0 only. Before: 'the check
    job failed on rank 0: RuntimeError: ... Timed out waiting 30000ms for recv' after ~34 s."""
    monkeypatch.setattr(dp_runner, "PG_TIMEOUT_S", 5.0)  # the mismatch is certain: no need to wait
    path = tmp_path / "dp_rank0.py"
    path.write_text(textwrap.dedent("""
        import torch.distributed as dist

        class OverlapDDP:
            def __init__(self, model, world_size):
                self.world_size = world_size
                for t in [*model.parameters(), *model.buffers()]:
                    dist.broadcast(t.data, src=0)
                self.handles = []
                for p in model.parameters():
                    if p.requires_grad:
                        p.register_post_accumulate_grad_hook(self._on_grad_ready)

            def _on_grad_ready(self, p):
                if dist.get_rank() == 0:
                    self.handles.append((p, dist.all_reduce(p.grad, async_op=True)))

            def finish_gradient_sync(self):
                for p, h in self.handles:
                    h.wait()
                    p.grad /= self.world_size
                self.handles.clear()
        """))  # fmt: skip
    with pytest.raises(ex.ExerciseFailed) as info:
        exdp.verify_file("02.allreduce_grads", path, timeout_s=60)
    message = str(info.value)
    assert "rank 0 called dist.all_reduce at dp_rank0.py, line 16, in _on_grad_ready" in message, message
    assert "and rank 1 never called it" in message
    assert "Timed out waiting" not in message and "pair closure" not in message


@pytest.mark.slow
def test_a_tensor_parallel_g_on_rank_0_only_names_its_all_reduce(tmp_path, capsys):
    """2 real gloo ranks; g's all-reduce runs on rank 0 only, so gloo pairs it with rank 1's
    f. Before: 'on rank 0 of 2: your code raised RuntimeError: ... Connection closed by peer'."""
    path = tmp_path / "mp_fg.py"
    path.write_text(_mp_fg_rank0_only())
    ex.check_in_workers("03.f_and_g", path)
    out = capsys.readouterr().out
    assert out.startswith("✗ 03.f_and_g"), out
    assert "rank 0 called dist.all_reduce at mp_fg.py, line 33, in forward" in out, out
    assert "rank 1 never called it" in out and "Connection closed" not in out


# --------------------------------------------------------------------------- 2: processes left


def test_a_process_the_learners_code_leaves_is_named_and_stopped(started, capsys):
    reference = ex.get("01.adam_bytes").reference

    def adamw_state_bytes(n_params):
        started.append(subprocess.Popen(SLEEPER).pid)
        return reference(n_params)

    assert ex.check("01.adam_bytes", adamw_state_bytes) is adamw_state_bytes
    out = capsys.readouterr().out
    assert out.startswith("✓ 01.adam_bytes"), out
    assert started and _child_pids_alive(started) == []
    assert f"Your code left {len(started)} process" in out and "which the check stopped" in out
    assert all(f"pid {pid} (`{' '.join(SLEEPER)}`)" in out for pid in started), out


def test_processes_the_kernel_had_before_the_check_are_left_alone(started, capsys):
    started.append(subprocess.Popen(SLEEPER).pid)
    ex.check("01.adam_bytes", ex.get("01.adam_bytes").reference)
    assert _child_pids_alive(started) == started
    assert "process" not in capsys.readouterr().out


def test_a_check_stopped_at_its_limit_stops_the_process_too_even_one_ignoring_sigterm(
    one_second_limit, started, monkeypatch, capsys
):
    """Before: 'Nothing else needs stopping' while the child ran on."""
    monkeypatch.setattr(leftovers, "GRACE_S", 0.5)
    stubborn = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                "signal.SIG_IGN); print(flush=True); time.sleep(60)"]  # fmt: skip

    def adamw_state_bytes(n_params):
        child = subprocess.Popen(stubborn, stdout=subprocess.PIPE)
        child.stdout.readline()  # SIGTERM is ignored from here on
        started.append(child.pid)
        while True:
            pass

    ex.check("01.adam_bytes", adamw_state_bytes)
    out = capsys.readouterr().out
    assert "did not finish within 1 s" in out, out
    assert f"It had started 1 process, which the check stopped too: pid {started[0]}" in out
    assert "Nothing else needs stopping: the notebook can go on." in out
    assert _child_pids_alive(started) == []


def test_a_check_that_fails_with_its_own_error_still_stops_the_learners_processes(
    started, monkeypatch, tmp_path, capsys
):
    """The learner's file started a process when the kernel imported it, then the check's job
    could not start (a LaunchError, the caller's to see). Before: the error went up, and the
    process ran on, unmentioned."""
    module = importlib.import_module(ex.MODULES["03"])

    def verify_file(exercise_id, path, **options):
        started.append(subprocess.Popen(SLEEPER).pid)  # what importing the learner's file did
        raise launch.LaunchError("no free port for the job's rendezvous: try again")

    monkeypatch.setattr(module, "verify_file", verify_file)
    with pytest.raises(launch.LaunchError, match="no free port"):
        ex.check_in_workers("03.one_f_one_b", tmp_path / "mp_order.py")
    assert started and _child_pids_alive(started) == []
    out = capsys.readouterr().out
    assert (f"Your code left 1 process running, which the check stopped: pid {started[0]} "
            f"(`{' '.join(SLEEPER)}`)") in out, out  # fmt: skip


def test_a_process_the_check_stops_is_left_for_its_owner_to_reap(started, capsys):
    """The learner's code keeps its Popens (one a call): once the check has stopped the
    children, each Popen reads how its child really ended. Before: the check reaped it (waitpid), and the Popen read
    returncode 0 for a process killed by SIGTERM."""
    reference = ex.get("01.adam_bytes").reference
    kept: list[subprocess.Popen] = []

    def adamw_state_bytes(n_params):
        kept.append(subprocess.Popen(SLEEPER))
        started.append(kept[-1].pid)
        return reference(n_params)

    ex.check("01.adam_bytes", adamw_state_bytes)
    assert "which the check stopped" in capsys.readouterr().out
    assert kept and [child.wait(timeout=10) for child in kept] == [-signal.SIGTERM] * len(kept)
    assert [child.poll() for child in kept] == [-signal.SIGTERM] * len(kept)


def test_a_process_that_ends_by_itself_during_the_check_keeps_its_exit_code(
    started, monkeypatch, capsys
):
    """A child that ends while the check waits for it to settle is not the check's to reap
    either. Before: psutil.wait_procs reaped it, and its Popen read 0 instead of 3."""
    monkeypatch.setattr(leftovers, "SETTLE_S", 10.0)  # it ends well within: no stop, no note
    reference = ex.get("01.adam_bytes").reference
    kept: list[subprocess.Popen] = []
    brief = [sys.executable, "-c", "import sys, time; time.sleep(1); sys.exit(3)"]

    def adamw_state_bytes(n_params):
        kept.append(subprocess.Popen(brief))
        started.append(kept[-1].pid)
        return reference(n_params)

    ex.check("01.adam_bytes", adamw_state_bytes)
    assert "process" not in capsys.readouterr().out
    assert kept and [child.wait(timeout=10) for child in kept] == [3] * len(kept)


def test_nothing_else_needs_stopping_is_said_only_when_true():
    assert "Nothing else needs stopping" in ex.Leftovers({}, {}).after_stop()
    text = ex.Leftovers({}, {4321: "sleep 100"}).after_stop()
    assert "Nothing else needs stopping" not in text.capitalize()
    assert "1 process that would not stop: pid 4321 (`sleep 100`)" in text
    assert "kill -9 4321" in text and "restart the kernel" in text
    assert ex.Leftovers({}, {}).note() == ""


# --------------------------------------------------------------------------- 3: exits


def test_a_learner_answer_that_calls_sys_exit_fails_the_check_and_the_kernel_goes_on(capsys):
    def adamw_state_bytes(n_params):
        sys.exit(1)

    assert ex.check("01.adam_bytes", adamw_state_bytes) is ex.get("01.adam_bytes").reference
    out = capsys.readouterr().out
    assert out.startswith("✗ 01.adam_bytes"), out
    assert "your code called sys.exit(1) (at test_check_faults.py, line" in out
    assert "a function must return its answer (or raise an error), not exit the process" in out


@pytest.mark.parametrize("raised, said", [
    (KeyboardInterrupt, "raised KeyboardInterrupt itself"),
    (type("Custom", (BaseException,), {}), "raised Custom"),
    (SystemExit, "called sys.exit()"),
])  # fmt: skip
def test_other_base_exceptions_of_the_learners_code_fail_the_check(raised, said, capsys):
    def adamw_state_bytes(n_params):
        raise raised()

    ex.check("01.adam_bytes", adamw_state_bytes)
    out = capsys.readouterr().out
    assert out.startswith("✗ 01.adam_bytes") and f"your code {said}" in out, out


def test_a_real_interrupt_still_interrupts_the_check():
    def adamw_state_bytes(n_params):
        os.kill(os.getpid(), signal.SIGINT)
        raise AssertionError("the interrupt comes first")

    with pytest.raises(KeyboardInterrupt):
        ex.check("01.adam_bytes", adamw_state_bytes)


def test_a_file_whose_top_level_calls_sys_exit_fails_its_worker_check(tmp_path, capsys):
    path = tmp_path / "mp_order.py"
    path.write_text("import sys\nsys.exit(3)\n")
    ex.check_in_workers("03.one_f_one_b", path)
    out = capsys.readouterr().out
    assert out.startswith("✗ 03.one_f_one_b") and "called sys.exit(3)" in out, out
    assert "mp_order.py, line 2" in out
