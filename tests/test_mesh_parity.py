"""FSDP2 × tensor parallelism and HSDP on a 2 × 2 mesh of 4 gloo ranks equal one process.

One launch (``labkit.workers.mesh_train``, all three parts) checks: every rank's process
groups read from torch's DeviceMesh against ``mesh.group_ranks``; both compositions'
losses, first-step gradients and parameters after 3 AdamW steps against the single-process
GPT on the same global batches (tolerances as tests/test_tp_parity.py: the collectives only
sum in another order; parameters looser because Adam divides near-zero gradients by their
RMS); the bytes counted on each mesh dimension against ``mesh.predict_comm``; the bytes of
parameters, gradients and optimizer state each rank holds against ``mesh.predict_memory``.
"""

from __future__ import annotations

import pytest
import torch
from one_process import assert_saved_state_matches, train_one_process

from labkit import data
from labkit.config import ModelConfig
from labkit.jobs import launch
from labkit.model import GPT
from labkit.parallel import mesh
from labkit.workers import mesh_train

N, B, STEPS, SEED = 4, 8, 3, 0
CFG = ModelConfig(**mesh_train.DEFAULT_MODEL)
PARTS = ("fsdp_tp", "hsdp")
EXTRA = {"a": 2, "b": 1, "c": 2}  # a 3-D mesh with a size-1 dimension, for the groups only


@pytest.fixture(scope="module")
def job():
    return launch.run(
        mesh_train.MeshTrainConfig(batch_size=B, steps=STEPS, seed=SEED, grad_clip=1.0,
                                   group_meshes={"three_d": EXTRA}),
        nproc=N,
        timeout_s=240,
        stream=False,
    )


@pytest.fixture(scope="module")
def reference():
    """The single-process GPT on each whole global batch, same clip and AdamW, one thread as
    each rank has."""
    return train_one_process(CFG, data.fixed_batches(CFG.seq_len, B, STEPS, SEED), seed=SEED,
                             micro_batch=B, threads=1)  # fmt: skip


@pytest.mark.slow
def test_every_rank_sees_the_groups_group_ranks_predicts(job):
    for r in range(N):
        got = job.ranks[r]["groups"]
        for part, spec in {**mesh_train.MESHES, "three_d": EXTRA}.items():
            for dim in spec:
                assert got[part][dim] == mesh.group_ranks(spec, dim, r), (part, dim, r)


@pytest.mark.slow
@pytest.mark.parametrize("part", PARTS)
def test_composition_equals_single_process_after_k_steps(job, reference, part, tmp_path):
    ref_losses = reference[0]
    for r in range(N):
        assert job.ranks[r][part]["losses"] == pytest.approx(ref_losses, abs=1e-5)
    torch.manual_seed(SEED)
    initial_fc = dict(GPT(CFG).named_parameters())["blocks.0.mlp.fc.weight"]
    assert_saved_state_matches(torch.load(job.log_dir / f"mesh_{part}_params.pt"), reference, initial_fc)


@pytest.mark.slow
@pytest.mark.parametrize("part", PARTS)
def test_bytes_per_dimension_and_memory_per_rank_match_the_formulas(job, part):
    spec = mesh_train.MESHES[part]
    predicted = mesh.predict_comm(CFG, spec, part, B // (N if part == "hsdp" else 2))
    full = 16 * sum(p.numel() for p in GPT(CFG).parameters())  # fp32 param + grad + m + v
    for r in range(N):
        res = job.ranks[r][part]
        assert res["bytes_unknown_ops"] == []
        assert set(res["bytes"]) == set(spec)  # every collective filed under a named dim
        for dim in spec:
            counted, want = res["bytes"][dim], predicted[dim]
            assert counted["message_bytes"] == want["message_bytes"], (part, dim)
            assert counted["calls"] == want["calls"], (part, dim)
            assert counted["sent_per_rank"] == pytest.approx(want["sent_per_rank"])
        mem, want = res["memory"], mesh.predict_memory(CFG, spec, part)
        for key in ("parameters", "gradients", "optimizer_state", "total"):
            assert mem[key] == want[key], (part, key)
        assert mem["total"] <= full / 2  # each rank: at most half the model's state (shard=2)
