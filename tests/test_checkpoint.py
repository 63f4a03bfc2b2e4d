"""labkit.jobs.checkpoint in one process: sizes predicted and measured, round trips, mismatches,
partial checkpoints, pruning and the atomic rename. The 2-rank job that checkpoints, loses a
rank and resumes is in test_resilient_train.py; damaged checkpoints, a full disk and a crash
while a step is replaced are in test_checkpoint_faults.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from labkit import formulas
from labkit.config import ModelConfig, TrainConfig
from labkit.jobs import checkpoint
from labkit.jobs.checkpoint import saving as checkpoint_save
from labkit.model import GPT
from labkit.train import make_optimizer

SMALL = {"seq_len": 16, "n_layer": 2, "n_head": 2, "d_model": 32, "dropout": 0.1}


def trained(model_cfg=SMALL, steps=2, seed=0):
    """A GPT and its AdamW after ``steps`` real steps (so the optimizer has state)."""
    torch.manual_seed(seed)
    model = GPT(ModelConfig(**model_cfg))
    opt = make_optimizer(model, TrainConfig())
    for _ in range(steps):
        x = torch.randint(0, 256, (2, model_cfg["seq_len"]))
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def fresh(model_cfg=SMALL, seed=1):
    torch.manual_seed(seed)
    model = GPT(ModelConfig(**model_cfg))
    return model, make_optimizer(model, TrainConfig())


class Log(list):
    def __call__(self, text):
        self.append(text)


# --- formulas ------------------------------------------------------------------------------------


def test_bytes_per_param_counts_weights_and_optimizer_state_not_gradients():
    assert formulas.checkpoint_bytes_per_param() == 12  # fp32 AdamW: 4 + 2 x 4
    assert formulas.checkpoint_bytes_per_param("bf16", "adamw") == 10  # bf16 weights, fp32 m, v
    assert formulas.checkpoint_bytes_per_param("float32", "sgd_momentum") == 8
    assert formulas.checkpoint_bytes_per_param("float32", "sgd") == 4
    with pytest.raises(ValueError, match="optimizer='lion' is not allowed: one of"):
        formulas.checkpoint_bytes_per_param("float32", "lion")


def test_checkpoint_bytes_adds_aliases_frozen_parameters_and_per_tensor_overhead():
    assert formulas.checkpoint_bytes(1000) == 12_000
    # 100 frozen: weights only; 50 aliased (a tied head): its weights twice, its state once
    assert formulas.checkpoint_bytes(1000, n_trainable=900, aliased_params=50) == 4 * 1050 + 8 * 900
    assert formulas.checkpoint_bytes(1000, n_tensors=3, bytes_per_tensor=100.0) == 12_300
    with pytest.raises(ValueError, match="n_params"):
        formulas.checkpoint_bytes(-1)


# --- size and time, predicted and measured -----------------------------------------------------


def test_predicted_bytes_match_a_real_checkpoint(tmp_path):
    model, opt = trained()
    saved = checkpoint.save(tmp_path, 2, model, opt, log=None)
    files = sum(p.stat().st_size for p in (tmp_path / "step000000002").iterdir())
    assert saved.bytes == files - (tmp_path / "step000000002" / checkpoint.MANIFEST).stat().st_size
    counts = checkpoint.count(model, opt)
    assert counts["aliased_params"] == 256 * 32  # the tied head, saved under both names
    pred = checkpoint.predict_bytes(counts["n_params"], n_tensors=counts["n_tensors"],
                                    aliased_params=counts["aliased_params"])  # fmt: skip
    assert pred == saved.predicted
    assert pred["bytes_per_param"] == 12
    assert abs(pred["bytes"] - saved.bytes) / saved.bytes < 0.05, (pred, saved.bytes)
    # The per-tensor term matters at this size: 12 B/param alone is more than 10% short.
    assert (saved.bytes - pred["payload_bytes"]) / saved.bytes > 0.10
    assert saved.write_bytes_per_s > 0 and saved.predicted_s == pytest.approx(
        pred["bytes"] / saved.write_bytes_per_s
    )
    assert saved.seconds > 0


def test_the_write_probe_leaves_nothing_behind(tmp_path):
    assert checkpoint.write_bandwidth(tmp_path, 1 << 20) > 0
    assert list(tmp_path.iterdir()) == []


# --- round trip ----------------------------------------------------------------------------------


def test_load_restores_weights_optimizer_rng_and_extra_bitwise(tmp_path):
    model, opt = trained()
    torch.manual_seed(123)
    checkpoint.save(tmp_path, 2, model, opt, extra={"data_position": 2}, log=None)
    expected_draw = torch.rand(4)  # what the RNG gives right after the save
    other, other_opt = fresh()
    log = Log()
    state = checkpoint.load_latest(tmp_path, other, other_opt, log=log)
    assert state.step == 2 and state.extra == {"data_position": 2}
    assert torch.equal(torch.rand(4), expected_draw)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    mine, theirs = opt.state_dict()["state"], other_opt.state_dict()["state"]
    for i in mine:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(mine[i][key], theirs[i][key]), (i, key)
    assert any("resumed from" in line for line in log)


def test_an_empty_folder_means_start_from_scratch(tmp_path):
    model, opt = fresh()
    log = Log()
    assert checkpoint.load_latest(tmp_path / "none", model, opt, log=log) is None
    assert "starting from scratch" in log[-1]


# --- mismatches: named, before torch reads anything -------------------------------------------


def test_another_model_shape_is_named_with_the_fix_before_torch_loads(tmp_path, monkeypatch):
    model, opt = trained()
    checkpoint.save(tmp_path, 2, model, opt, log=None)
    import torch.distributed.checkpoint as dcp

    def no_load(*a, **k):
        raise AssertionError("torch was asked to load a checkpoint that does not fit")

    monkeypatch.setattr(dcp, "load", no_load)
    bigger, big_opt = fresh({**SMALL, "d_model": 64})
    with pytest.raises(checkpoint.CheckpointMismatch) as err:
        checkpoint.load_latest(tmp_path, bigger, big_opt, log=None)
    msg = str(err.value)
    assert "blocks.0.attn.q.weight: saved (32, 32), this model (64, 64)" in msg
    assert "more" in msg  # every block differs: the rest are counted, not listed
    assert "another checkpoint folder" in msg and "rm -r" in msg
    deeper, deep_opt = fresh({**SMALL, "n_layer": 3})
    with pytest.raises(checkpoint.CheckpointMismatch, match=r"only in this model: blocks\.2\."):
        checkpoint.load_latest(tmp_path, deeper, deep_opt, log=None)


def test_another_world_size_is_named(tmp_path):
    model, opt = trained()
    saved = checkpoint.save(tmp_path, 2, model, opt, log=None)
    folder = tmp_path / "step000000002"
    manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
    manifest["world_size"] = 2  # as a 2-rank job writes it (a real one: test_resilient_train)
    (folder / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    shutil.copy(folder / "rank0.pt", folder / "rank1.pt")
    with pytest.raises(checkpoint.CheckpointMismatch, match="saved by 2 ranks, this job has 1"):
        checkpoint.load_latest(tmp_path, *fresh(), log=None)
    assert saved.step == 2


# --- partial checkpoints are never loaded -----------------------------------------------------


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A folder with complete checkpoints of steps 1 and 2; step 1's weights."""
    root = tmp_path_factory.mktemp("two")
    model, opt = trained(steps=1)
    checkpoint.save(root, 1, model, opt, log=None)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    model, opt = trained(steps=2)
    checkpoint.save(root, 2, model, opt, log=None)
    return root, first


@pytest.mark.parametrize("damage", ["no manifest", "torn manifest", "missing rank file", "tmp"])
def test_a_partial_checkpoint_is_skipped_and_the_log_says_so(tmp_path, two_checkpoints, damage):
    root = tmp_path / "ck"
    shutil.copytree(two_checkpoints[0], root)
    newest = root / "step000000002"
    if damage == "no manifest":
        (newest / checkpoint.MANIFEST).unlink()
    elif damage == "torn manifest":
        text = (newest / checkpoint.MANIFEST).read_text()
        (newest / checkpoint.MANIFEST).write_text(text[: len(text) // 2])
    elif damage == "missing rank file":
        (newest / "rank0.pt").unlink()
    else:  # a writer that died before its rename
        newest.rename(checkpoint.tmp_dir(root, 2))
    log = Log()
    other, other_opt = fresh()
    state = checkpoint.load_latest(root, other, other_opt, log=log)
    assert state.step == 1  # the older, complete one
    for name, t in other.state_dict().items():
        assert torch.equal(t, two_checkpoints[1][name]), name
    skipped = [line for line in log if "skipped" in line]
    assert len(skipped) == 1 and "partial" in skipped[0], log


def test_a_crash_between_the_write_and_the_rename_leaves_no_loadable_checkpoint(tmp_path,
                                                                                  monkeypatch):  # fmt: skip
    def crash(tmp, final):
        raise RuntimeError("killed before the rename")

    monkeypatch.setattr(checkpoint_save, "_rename", crash)
    model, opt = trained()
    with pytest.raises(RuntimeError, match="before the rename"):
        checkpoint.save(tmp_path, 2, model, opt, log=None)
    tmp = checkpoint.tmp_dir(tmp_path, 2)
    assert (tmp / ".metadata").exists() and (tmp / checkpoint.MANIFEST).exists()  # all written
    assert checkpoint.scan(tmp_path)[0] == []
    log = Log()
    assert checkpoint.load_latest(tmp_path, *fresh(), log=log) is None
    assert any(".tmp-step000000002: partial" in line for line in log)
    monkeypatch.undo()  # the next save tidies the leftover away
    checkpoint.save(tmp_path, 3, model, opt, log=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step000000003"]


def test_keep_prunes_to_the_newest(tmp_path):
    model, opt = trained(steps=1)
    pruned = []
    for step in range(1, 5):
        pruned += checkpoint.save(tmp_path, step, model, opt, keep=2, log=None).pruned
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step000000003", "step000000004"]
    assert pruned == ["step000000001", "step000000002"]
    with pytest.raises(ValueError, match="keep=0"):
        checkpoint.save(tmp_path, 5, model, opt, keep=0, log=None)


def test_the_prediction_follows_the_dtypes_and_optimizer_the_job_really_uses(tmp_path):
    torch.manual_seed(0)
    model = GPT(ModelConfig(**SMALL)).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randint(0, 256, (2, SMALL["seq_len"]))
    model(x, x)[1].backward()
    opt.step()
    counts = checkpoint.count(model, opt)
    assert (counts["optimizer"], counts["weight_dtype"], counts["state_dtype"]) == (
        "sgd_momentum",
        "bfloat16",
        "bfloat16",
    )
    saved = checkpoint.save(tmp_path, 1, model, opt, log=None)
    assert saved.predicted["bytes_per_param"] == 4  # 2 B of weight + 2 B of momentum


def test_a_rank_whose_files_are_elsewhere_fails_the_save_and_publishes_nothing(tmp_path, monkeypatch):
    """On several machines with each node's own disk, rank 1's files land on its node: rank 0
    must not publish a checkpoint that lacks them (a restart would find it partial and start
    from scratch). Faked here: a world of 2 in which only rank 0 writes."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    monkeypatch.setattr(checkpoint_save, "rank_and_world", lambda: (0, 2))
    with pytest.raises(checkpoint.CheckpointError, match=r"rank\(s\) \[1\].*file system every node sees"):
        checkpoint.save(tmp_path, 2, model, opt, log=None)
    complete, _ = checkpoint.scan(tmp_path)
    assert complete == []  # nothing published


def test_a_job_across_nodes_must_name_a_shared_checkpoint_folder():
    from labkit.workers import resilient_train as rt

    rt.ResilientTrainConfig().check_shared_root(1)  # one machine: its job folder will do
    rt.ResilientTrainConfig(checkpoint_dir="/shared/ckpt").check_shared_root(2)
    with pytest.raises(ValueError, match=r"spans 2 agents.*checkpoint_dir"):
        rt.ResilientTrainConfig().check_shared_root(2)


# --- resharding and asynchronous saves ------------------------------------------------------------


def test_load_resharded_reads_dcp_state_but_no_per_rank_state(tmp_path):
    model, opt = trained()
    saved = checkpoint.save(tmp_path, 2, model, opt, extra={"data_position": 2}, log=None)
    other, other_opt = fresh()
    torch.manual_seed(5)
    draw = torch.rand(3)
    torch.manual_seed(5)
    got = checkpoint.load_resharded(saved.path, other, other_opt, log=None)
    assert got["saved_by"] == 1 and list(got["files"]) == ["__0_0.distcp"]
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(torch.rand(3), draw)  # the saved generator state was not restored
    with pytest.raises(checkpoint.CheckpointMismatch, match="not a complete checkpoint"):
        checkpoint.load_resharded(tmp_path / "nothing-here", other, other_opt, log=None)


def test_time_save_modes_measures_both_kinds_and_leaves_nothing(tmp_path):
    model, opt = trained()
    threads = torch.get_num_threads()
    out = checkpoint.time_save_modes(model, opt, tmp_path, rounds=2)
    assert torch.get_num_threads() == threads  # restored
    assert len(out["sync_s"]) == len(out["async_blocking_s"]) == len(out["async_total_s"]) == 2
    assert all(b <= t for b, t in zip(out["async_blocking_s"], out["async_total_s"], strict=True))
    assert out["bytes"] > checkpoint.count(model, opt)["n_params"] * 12  # weights + m + v
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="rounds=0"):
        checkpoint.time_save_modes(model, opt, tmp_path, rounds=0)
