"""Collective bugs planted on rank 1 (labkit.workers.collective_faults) and what reports them.

Unit tests read torch 2.13's own messages (copied from real runs) with labkit.jobs.diagnosis; one
slow test runs four real 2-rank jobs side by side (labkit.collective_debug.run_trials): each
ends within its timeout, its error names the bug's kind and the right rank, and no process of
any job is left.
"""

from __future__ import annotations

import contextlib
import os
import time

import psutil
import pytest

from labkit import collective_debug as cd
from labkit.jobs import diagnosis, runtime
from labkit.workers import collective_faults as cf

# Rank 0's exception in a real desync under TORCH_DISTRIBUTED_DEBUG=DETAIL (torch 2.13, gloo).
DESYNC = (
    "Detected mismatch between collectives on ranks. Rank 0 is running collective: "
    "CollectiveFingerPrint(SequenceNumber=2, OpType=ALLREDUCE, TensorShape=[1024], "
    "TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu, "
    "layout=Strided (default), requires_grad=false (default), pinned_memory=false (default), "
    "memory_format=(nullopt))), but Rank 1 is running collective: CollectiveFingerPrint("
    "SequenceNumber=2, OpType=ALLGATHER, TensorShape=[1], TensorDtypes=Float, TensorDeviceTypes="
    "TensorOptions(dtype=float (default), device=cpu, layout=Strided (default), requires_grad="
    "false (default), pinned_memory=false (default), memory_format=(nullopt))).Collectives "
    "differ in the following aspects:   Op type: ALLREDUCEvs ALLGATHER  Tensor Tensor shapes: "
    "1024vs 1"
)


# --- reading DETAIL's messages -------------------------------------------------------------------


def test_detail_mismatch_is_read_into_both_ranks_fingerprints():
    m = diagnosis.collective_mismatch("RuntimeError: " + DESYNC)
    assert m.this == diagnosis.Fingerprint(0, 2, "ALLREDUCE", (1024,), "Float", "cpu")
    assert m.other == diagnosis.Fingerprint(1, 2, "ALLGATHER", (1,), "Float", "cpu")
    assert m.aspects == ("op type", "tensor shapes")
    assert str(m) == ("rank 0 ran ALLREDUCE [1024] Float, rank 1 ran ALLGATHER [1] Float "
                      "(sequence number 2 on both): they differ in op type and tensor shapes")  # fmt: skip


def test_mismatch_of_a_collective_without_tensors_and_of_shapes_alone():
    barrier = ("Detected mismatch between collectives on ranks. Rank 1 is running collective: "
               "CollectiveFingerPrint(SequenceNumber=5OpType=BARRIER), but Rank 0 is running "
               "collective: CollectiveFingerPrint(SequenceNumber=5, OpType=ALLREDUCE, TensorShape="
               "[2, 3], TensorDtypes=Half, TensorDeviceTypes=TensorOptions(device=cuda)).Collectives"
               " differ in the following aspects:   Op type: BARRIERvs ALLREDUCE")  # fmt: skip
    m = diagnosis.collective_mismatch(barrier)
    assert m.this == diagnosis.Fingerprint(1, 5, "BARRIER")
    assert m.other.shape == (2, 3) and m.other.dtypes == "Half" and m.other.device == "cuda"
    assert str(m).startswith("rank 1 ran BARRIER, rank 0 ran ALLREDUCE [2, 3] Half")
    shape = DESYNC.replace("ALLGATHER, TensorShape=[1]", "ALLREDUCE, TensorShape=[1025]")
    assert diagnosis.collective_mismatch(shape).other.shape == (1025,)


def test_other_text_is_no_mismatch():
    assert diagnosis.collective_mismatch("Timed out waiting 3000ms for recv operation") is None
    assert diagnosis.collective_mismatch("Detected mismatch between collectives on ranks.") is None


def test_the_odd_one_out_needs_a_majority():
    fp = diagnosis.Fingerprint
    a, b = ("ALLREDUCE", (4,)), ("ALLREDUCE", (5,))
    two = [fp(0, 1, *a), fp(1, 1, *b)]
    assert diagnosis.odd_ones_out(two, 2) == []  # either rank may be the wrong one
    three = [fp(0, 1, *a), fp(2, 1, *b), fp(1, 1, *a), fp(2, 1, *b)]
    assert diagnosis.odd_ones_out(three, 3) == [2]
    assert diagnosis.odd_ones_out([fp(0, 1, *a), fp(1, 1, *b)], 4) == []  # 2 of 4 seen: unknown


def test_ranks_waiting_in_different_collectives_are_a_desync():
    def beat(phase, step, coll=True):
        return {"phase": phase, "step": step, "total": 3, "in_collective": coll}

    apart = diagnosis.waiting_apart({0: beat("all_reduce grads", 2), 1: beat("all_gather loss", 2)})
    assert sorted(apart) == [0, 1]
    line = diagnosis.desync_line(apart)
    assert "rank 0 in 'all_reduce grads' at step 2/3, rank 1 in 'all_gather loss'" in line
    assert "desync" in line and "TORCH_DISTRIBUTED_DEBUG=DETAIL" in line
    assert diagnosis.waiting_apart({0: beat("ar", 2), 1: beat("ar", 2)}) == {}  # same place
    assert diagnosis.waiting_apart({0: beat("ar", 2), 1: beat("compute", 2, False)}) == {}  # a hang
    assert diagnosis.waiting_apart({0: beat("ar", 2), 1: beat("ar", 3)}) != {}  # a step apart


def test_detail_monitored_barrier_timeout_is_a_wait_for_another_rank():
    end = diagnosis.RankEnd(0, exc_type="RuntimeError",
                            exc_message="[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 3000 ms")  # fmt: skip
    assert end.kind == "waited" and end.echo
    # NCCL's watchdog aborts a rank whose collective timed out: no exception, its stderr says.
    nccl = diagnosis.RankEnd(0, exitcode=-6, stderr="[rank0]:[E1204] Watchdog caught collective "
                             "operation timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE) ran for "
                             "10000 milliseconds before timing out.")  # fmt: skip
    assert nccl.kind == "waited"
    assert (
        diagnosis.RankEnd(0, exitcode=-6, stderr="Is there a distributed collective mismatch").kind
        == "died"
    )


# --- the worker's plan and its checks ------------------------------------------------------------


def test_plans_show_where_the_ranks_part():
    healthy = cf.planned({"fault": "none", "steps": 2, "numel": 8}, 1)
    assert healthy == ["step 1: all_reduce [8]", "step 1: all_gather [1]",
                       "step 2: all_reduce [8]", "step 2: all_gather [1]"]  # fmt: skip
    desync = cf.planned({"fault": "desync", "steps": 2, "numel": 8}, 1)
    assert desync == [*healthy[:2], "step 2: all_gather [1]"]
    assert cf.planned({"fault": "desync", "steps": 2, "numel": 8}, 0) == healthy  # rank 0 is fine
    assert cf.planned({"fault": "shape", "steps": 2, "numel": 8}, 1)[2] == "step 2: all_reduce [9]"
    assert cf.planned({"fault": "hang", "steps": 3, "numel": 8}, 1)[-1].startswith(
        "step 2: (sleeps"
    )


def test_the_first_divergence_of_the_plans_is_the_prediction():
    cfg = {"fault": "desync", "steps": 3, "numel": 8}
    i, where = cd.first_divergence({r: cf.planned(cfg, r) for r in (0, 1)})
    assert i == 2 and where == {0: "step 2: all_reduce [8]", 1: "step 2: all_gather [1]"}
    assert cd.first_divergence({0: ["a", "b"], 1: ["a"]}) == (1, {0: "b", 1: "(none: finished)"})
    assert cd.first_divergence({r: cf.planned({"fault": "none"}, r) for r in (0, 1)}) is None
    assert cd.plan_key(where[0]) == ("ALLREDUCE", (8,)) and cd.plan_key(where[1]) == (
        "ALLGATHER",
        (1,),
    )
    assert cd.plan_key("step 2: (sleeps, outside any collective)") is None


@pytest.mark.parametrize(("cfg", "world", "says"), [
    ({"fault": "deadlock"}, 2, "fault='deadlock' is not allowed: one of 'none'"),
    ({"fault": "shape", "steps": 0}, 2, "steps=0"),
    ({"fault": "shape", "steps": 2, "fault_step": 3}, 2, "at most steps"),
    ({"fault": "shape", "fault_rank": 2}, 2, "fault_rank < nproc"),
    ({"fault": "shape"}, 1, "nproc=1 is not allowed: an integer >= 2"),
    ({"fault": "shape", "faultrank": 0}, 2, r"has no field\(s\) \['faultrank'\]"),
])  # fmt: skip
def test_bad_config_is_refused_naming_the_fix(cfg, world, says):
    with pytest.raises(ValueError, match=says):
        cf.CollectiveFaultsConfig.from_dict(cfg).check_ranks(world)


def test_run_refuses_a_config_that_cannot_plant_its_bug_before_any_launch(monkeypatch):
    from labkit.jobs import launch

    monkeypatch.setattr(launch, "run", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ValueError, match="fault_rank < nproc"):
        cf.run(cf.CollectiveFaultsConfig(fault="shape", fault_rank=3), nproc=2)


def test_bad_trials_are_refused_before_any_launch():
    with pytest.raises(ValueError, match="use one of"):
        cd.Trial("deadlock")
    with pytest.raises(ValueError, match="trials is empty"):
        cd.run_trials([])
    with pytest.raises(ValueError, match="must be < timeout_s"):
        cd.run_trials([cd.Trial("hang")], pg_timeout_s=30, timeout_s=10)


def test_report_lines_keep_what_a_killed_rank_said_and_drop_tracebacks():
    msg = "\n".join([
        f"{cd.WORKER} failed on rank 0: the process was killed by SIGABRT: ...",
        "what rank 0 wrote to stderr last:",
        "  what():  [enforce fail at pair.cc:456] Is there a distributed collective mismatch",
        "full stderr: /x/stderr.log",
        "  Traceback (most recent call last):",
        "logs in /x",
    ])  # fmt: skip

    class Err(Exception):
        pass

    o = cd.Outcome(cd.Trial("shape"), Err(msg), None, None, 1.0)
    assert cd.report_lines(o) == [
        "failed on rank 0: the process was killed by SIGABRT: ...",
        "what rank 0 wrote to stderr last:",
        "  what():  [enforce fail at pair.cc:456] Is there a distributed collective mismatch",
    ]


def test_no_flight_recorder_dump_is_said_plainly(tmp_path):
    assert cd.read_flight_recorder(tmp_path).startswith(f"no flight-recorder dump in {tmp_path}")


def _dump(path, entries):
    import pickle

    path.write_bytes(pickle.dumps({"version": "2.10", "entries": entries}))


def _fr(seq, name, size):
    return {"collective_seq_id": seq, "profiling_name": f"gloo:{name}", "input_sizes": [[size]],
            "state": "scheduled", "is_p2p": False}  # fmt: skip


def test_flight_recorder_dumps_show_where_the_ranks_part(tmp_path):
    _dump(
        tmp_path / "rank_0",
        [_fr(2, "all_gather", 1), _fr(1, "all_reduce", 8), _fr(3, "all_reduce", 8)],
    )
    _dump(
        tmp_path / "rank_1",
        [_fr(1, "all_reduce", 8), _fr(2, "all_gather", 1), _fr(3, "all_gather", 1)],
    )
    (tmp_path / "rank_2").write_bytes(b"half a pickle")  # not evidence: skipped
    assert [e["collective_seq_id"] for e in cd.read_dumps(tmp_path)[0]] == [1, 2, 3]
    lines = cd.flight_recorder_summary(tmp_path, 2, last=2)
    assert lines[0] == "rank 0: #2 all_gather [1] (scheduled); #3 all_reduce [8] (scheduled)"
    assert lines[-1] == ("first disagreement at collective #3: rank 0: #3 all_reduce [8] "
                         "(scheduled), rank 1: #3 all_gather [1] (scheduled)")  # fmt: skip
    (tmp_path / "rank_1").unlink()
    lines = cd.flight_recorder_summary(tmp_path, 2)
    assert lines[1].startswith("rank 1: no dump") and len(lines) == 2


def test_topology_says_plainly_when_there_is_no_nvidia_smi(monkeypatch):
    monkeypatch.setattr(cd.shutil, "which", lambda name: None)
    assert "nvidia-smi is not installed" in cd.nvidia_topology()


# --- real jobs -----------------------------------------------------------------------------------


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private LABKIT_HOME; afterwards any process still carrying it fails the test."""
    path = tmp_path / "home"
    monkeypatch.setenv("LABKIT_HOME", str(path))
    yield path
    strays = []
    for p in psutil.process_iter(["environ"]):
        with contextlib.suppress(psutil.Error, OSError):
            env = p.info["environ"] or {}
            mine = env.get("LABKIT_HOME") == str(path) and p.pid != os.getpid()
            if mine and p.status() != psutil.STATUS_ZOMBIE:
                strays.append(p.pid)
                p.kill()
    assert not strays, f"test left processes running: {strays}"


def _job_processes(job_dir) -> list[int]:
    found = []
    for p in psutil.process_iter(["environ", "status"]):
        with contextlib.suppress(psutil.Error, OSError):
            env = p.info["environ"] or {}
            if (
                env.get(runtime.JOB_DIR_ENV) == str(job_dir)
                and p.info["status"] != psutil.STATUS_ZOMBIE
            ):
                found.append(p.pid)
    return found


@pytest.mark.slow
def test_each_bug_is_reported_by_kind_and_rank_and_leaves_no_process(home):
    trials = [cd.Trial("desync"), cd.Trial("desync", detail=True),
              cd.Trial("shape", detail=True), cd.Trial("hang")]  # fmt: skip
    pg_timeout_s = 3.0
    t0 = time.monotonic()
    desync, desync_detail, shape_detail, hang = cd.run_trials(
        trials, pg_timeout_s=pg_timeout_s, timeout_s=120, write=lambda s: None, flight_recorder=True
    )
    for o in (desync, desync_detail, shape_detail, hang):
        assert o.error is not None and o.result.status == "failed", o.trial
        # Ended by the bug, within the launcher's limit (not by it): a bound, not a speed test.
        assert o.report_s is not None and o.wall_s < 120, o.trial
        assert not _job_processes(o.result.log_dir), o.trial
        pids = [o.result.agent_pid, *o.result.worker_pids]
        assert not [p for p in pids if psutil.pid_exists(p) and
                    psutil.Process(p).status() != psutil.STATUS_ZOMBIE], o.trial  # fmt: skip
    assert time.monotonic() - t0 < 120

    # Without DETAIL a desync is a timeout: the two ranks wait in different collectives, and
    # whichever rank's wait expires first is the root cause; the heartbeats say desync.
    assert desync.ended_by.startswith("the collective timeout") and desync.mismatch is None
    assert "their sequences of collectives no longer match (a desync" in desync.message
    assert (
        "rank 0 in 'all_reduce grads' at step 2/3, rank 1 in 'all_gather loss' at step 2/3"
        in desync.message
    )

    # Each rank's flight recorder, dumped as its collective failed, shows where they parted.
    said = cd.flight_recorder_summary(desync.extra["fr_dir"], 2)
    assert said[-1] == ("first disagreement at collective #3: rank 0: #3 all_reduce [1024] "
                        "(scheduled), rank 1: #3 all_gather [1] (scheduled)"), said  # fmt: skip
    said = cd.flight_recorder_summary(hang.extra["fr_dir"], 2)
    assert said[0].startswith("rank 0: ") and said[0].endswith("#3 all_reduce [1024] (scheduled)")
    assert said[1].startswith("rank 1: no dump"), said

    # DETAIL compares fingerprints before the collective runs: rank 1's is the odd one.
    m = desync_detail.mismatch
    assert desync_detail.ended_by == "DETAIL's fingerprint check"
    assert {m.this.rank, m.other.rank} == {0, 1}
    by_rank = {f.rank: f for f in (m.this, m.other)}
    assert (by_rank[1].op, by_rank[1].shape) == ("ALLGATHER", (1,))
    assert (by_rank[0].op, by_rank[0].shape) == ("ALLREDUCE", (1024,))
    assert (
        "collectives do not match across ranks (TORCH_DISTRIBUTED_DEBUG=DETAIL)"
        in desync_detail.message
    )
    assert "cannot tell which rank is wrong" in desync_detail.message  # two ranks, no majority

    m = shape_detail.mismatch
    by_rank = {f.rank: f for f in (m.this, m.other)}
    assert by_rank[1].shape == (1025,) and by_rank[0].shape == (1024,)
    assert m.aspects == ("tensor shapes",)

    # The hung rank is named, not its victim: rank 0's all_reduce timed out waiting for rank 1.
    assert hang.rank == 0 and hang.hung == [1], hang.message
    assert "likely hung: rank 1 (not in a collective)" in hang.message
    assert hang.detect_s >= pg_timeout_s * 0.9  # it took the timeout to notice
    assert desync.detect_s >= pg_timeout_s * 0.9 and desync_detail.detect_s is not None


def test_brief_flight_recorder_summary_keeps_only_where_the_ranks_part(tmp_path):
    _dump(tmp_path / "rank_0", [_fr(1, "all_reduce", 8), _fr(2, "all_reduce", 8)])
    _dump(tmp_path / "rank_1", [_fr(1, "all_reduce", 8), _fr(2, "all_gather", 1)])
    assert cd.flight_recorder_summary(tmp_path, 2, brief=True) == [
        "first disagreement at collective #2: rank 0: #2 all_reduce [8] (scheduled), "
        "rank 1: #2 all_gather [1] (scheduled)"]
    # agreeing dumps: brief changes nothing (each rank's entries stay)
    _dump(tmp_path / "rank_1", [_fr(1, "all_reduce", 8), _fr(2, "all_reduce", 8)])
    assert cd.flight_recorder_summary(tmp_path, 2, brief=True) == cd.flight_recorder_summary(tmp_path, 2)
    # a rank without a dump: said in one short line, the other rank's last entry kept
    (tmp_path / "rank_1").unlink()
    assert cd.flight_recorder_summary(tmp_path, 2, last=1, brief=True) == [
        "rank 0: #2 all_reduce [8] (scheduled)",
        "rank 1: no dump (it never raised: stuck elsewhere, or killed first)"]


def test_nccl_report_shows_each_ranks_last_collective_lines(tmp_path):
    class Result:
        nproc = 2

        def log(self, r, stream="stdout"):
            if stream == "stderr":
                return ""
            return "\n".join(f"host:{r}:{r} [{r}] NCCL INFO AllReduce: opCount {i} count 1024"
                             for i in range(5)) + "\nother line"  # fmt: skip

    class Err(Exception):
        pass

    o = cd.Outcome(cd.Trial("desync"), Err(f"{cd.WORKER} failed on rank 0: timed out"), Result(),
                   None, 1.0, {"fr_dir": str(tmp_path)})  # fmt: skip
    lines = cd.nccl_report(o, last=2)
    assert lines[0].startswith("--- desync, DETAIL off over NCCL: ended by")
    at = lines.index("  rank 1: NCCL_DEBUG=INFO's last collective lines:")
    assert [x.split("opCount ")[1] for x in lines[at + 1:at + 3]] == ["3 count 1024", "4 count 1024"]
    assert any("no dump" in x for x in lines) and any("no flight-recorder dump" in x for x in lines)
