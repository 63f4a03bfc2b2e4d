"""A 2-rank gloo job loses a rank to SIGKILL, torchrun restarts it, and it resumes from its
last complete checkpoint: the weights it ends with equal, bit for bit, those of the same job
run without the failure."""

from __future__ import annotations

import contextlib
import os

import psutil
import pytest
import torch

from labkit.config import ModelConfig, TrainConfig
from labkit.jobs import checkpoint
from labkit.model import GPT
from labkit.train import make_optimizer
from labkit.workers import resilient_train as rt
from tests.test_launch import assert_no_survivors

# Small enough for two cores: 6 steps, a checkpoint every 2, rank 1 dies after 3.
CONFIG = {"steps": 6, "every": 2, "kill_rank": 1, "kill_at_step": 3}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """(the job with the planted kill, the same job without it), in a private LABKIT_HOME;
    afterwards no process that carries that home may be running."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LABKIT_HOME", str(home))
        killed = rt.run(rt.ResilientTrainConfig(**CONFIG), nproc=2, max_restarts=1, device="cpu",
                        timeout_s=120, stream=False)  # fmt: skip
        plain = rt.run(rt.ResilientTrainConfig(steps=CONFIG["steps"], every=CONFIG["every"]), nproc=2,
                       max_restarts=1, device="cpu", timeout_s=120, stream=False)  # fmt: skip
    yield killed, plain
    strays = []
    for p in psutil.process_iter(["environ"]):
        with contextlib.suppress(psutil.Error, OSError):
            if (p.info["environ"] or {}).get("LABKIT_HOME") == str(home) and p.pid != os.getpid():
                strays.append(p.pid)
                p.kill()
    assert not strays, f"processes left running: {strays}"


def test_the_resumed_job_ends_with_the_uninterrupted_jobs_weights_bitwise(jobs):
    killed, plain = jobs
    a, b = torch.load(killed.result["final_params"]), torch.load(plain.result["final_params"])
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert killed.result["checksum"] == plain.result["checksum"]
    assert {r["checksum"] for r in killed.ranks} == {killed.result["checksum"]}  # both ranks


def test_the_kill_cost_one_restart_and_the_predicted_steps(jobs):
    killed, plain = jobs
    res = killed.result
    assert killed.restarts == 1 and res["attempts"] == 2
    assert plain.restarts == 0 and plain.result["attempts"] == 1
    assert res["killed"]["rank"] == 1 and res["killed"]["step"] == 3
    assert res["resumed_from_step"] == 2
    assert res["lost_steps"] == res["lost_steps_predicted"] == rt.predicted_lost_steps(3, 2) == 1
    # measured on one clock; only their order is asserted
    assert 0 < res["kill_to_restart_s"] < res["kill_to_pg_up_s"] < res["kill_to_first_step_s"]
    for job in jobs:
        assert_no_survivors(job.log_dir, [job.agent_pid, *job.worker_pids], wait_s=5)


def test_the_loss_curve_continues_where_the_checkpoint_left_it(jobs):
    killed, plain = jobs
    rows = rt.read_jsonl(killed.result["losses_file"])
    first = [r for r in rows if r["attempt"] == 1]
    second = [r for r in rows if r["attempt"] == 2]
    assert [r["step"] for r in first] == [1, 2, 3]  # the kill came after step 3
    assert [r["step"] for r in second] == [3, 4, 5, 6]  # step 3 lost, trained again
    assert second[0]["loss"] == first[2]["loss"]  # ... to the same loss, bit for bit
    reference = [r["loss"] for r in rt.read_jsonl(plain.result["losses_file"])]
    assert [r["loss"] for r in first[:2] + second] == reference
    events = rt.read_jsonl(killed.result["events_file"])
    assert [e["rank"] for e in events if e["event"] == "kill"] == [1]
    assert {(e["rank"], e["attempt"]) for e in events if e["event"] == "first_step"} == {
        (0, 1),
        (1, 1),
        (0, 2),
        (1, 2),
    }


def test_checkpoint_size_and_time_are_measured_beside_the_prediction(jobs):
    saved = jobs[0].result["checkpoint"]
    assert saved["step"] == 6
    assert abs(saved["predicted"]["bytes"] - saved["bytes"]) / saved["bytes"] < 0.05
    assert saved["seconds"] > 0 and saved["predicted_s"] > 0
    assert saved["pruned"] == ["step000000002"]  # keep=2: steps 4 and 6 remain


def test_a_checkpoint_of_two_ranks_refuses_a_job_of_one(jobs):
    root = jobs[0].result["checkpoint_dir"]
    model = GPT(ModelConfig(**rt.DEFAULTS["model"]))
    with pytest.raises(checkpoint.CheckpointMismatch, match="saved by 2 ranks, this job has 1"):
        checkpoint.load_latest(root, model, make_optimizer(model, TrainConfig()), log=None)


def test_a_checkpoint_of_two_ranks_reshards_into_one_process(jobs):
    # DCP's resharding on load (notebook 02b): both ranks wrote a share, one process reads both,
    # and gets the job's final weights bitwise (the last checkpoint follows the last step)
    killed = jobs[0].result
    newest = checkpoint.scan(killed["checkpoint_dir"])[0][-1][1]
    files = checkpoint.shares(newest)
    assert sorted(files) == ["__0_0.distcp", "__1_0.distcp"] and all(files.values())
    model = GPT(ModelConfig(**rt.DEFAULTS["model"]))
    opt = make_optimizer(model, TrainConfig())
    got = checkpoint.load_resharded(newest, model, opt, log=None)
    assert (got["saved_by"], got["loaded_by"]) == (2, 1)
    final = torch.load(killed["final_params"])
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n].detach(), final[n]) for n in final)
    assert len(opt.state) == len(list(model.parameters()))  # AdamW's moments came too
    wider = GPT(ModelConfig(**{**rt.DEFAULTS["model"], "d_model": 2 * rt.DEFAULTS["model"].get("d_model", 64)}))
    with pytest.raises(checkpoint.CheckpointMismatch, match=r"saved .*this model"):
        checkpoint.load_resharded(newest, wider, make_optimizer(wider, TrainConfig()), log=None)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"kill_rank": 1}, "go together"),
        ({"kill_rank": 2, "kill_at_step": 3}, "kill_rank=2"),
        ({"kill_rank": 0, "kill_at_step": 12}, "kill_at_step=12"),
        ({"global_batch": 3}, "does not split over 2"),
        ({"every": 0}, "every=0"),
        ({"step": 4}, r"ResilientTrainConfig has no field\(s\) \['step'\]"),
    ],
)
def test_bad_configs_are_refused_before_anything_starts(config, match):
    with pytest.raises(ValueError, match=match):
        rt.run(rt.ResilientTrainConfig.from_dict(config), nproc=2)


def test_run_takes_only_the_typed_config():
    with pytest.raises(ValueError, match=r"config=\{'steps': 6\} is not allowed: a ResilientTrainConfig"):
        rt.run({"steps": 6}, nproc=2)


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_restartable_job_gets_a_fresh_rendezvous_store_per_attempt(restarts, tmp_path):
    """Without it torchrun 2.13 hands the restarted ranks the dead attempt's store, and about
    half the restarts fail in gloo's connectFullMesh (pytorch #135712): the launcher sets it
    for every job that may restart, and only for those."""
    from labkit.jobs.observers import Job
    from labkit.jobs.supervisor import Echo, Supervisor

    job = Job("j", rt.MODULE, 2, "gloo", "cpu", {}, tmp_path, max_restarts=restarts)
    env = Supervisor(job, [], {}, observers=[], echo=Echo(0, tmp_path, quiet=True))._env()
    assert env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == ("1" if restarts else None)
    # the SLURM script of a restartable job says the same to torchrun on every node
    from labkit.jobs import slurm

    assert ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in slurm.SlurmJob(max_restarts=restarts).render()
            ) == bool(restarts)  # fmt: skip
