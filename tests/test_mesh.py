"""Device meshes without launching: validation, each rank's groups, the per-dimension bytes.

The group tables are worked by hand from the row-major layout (last dimension fastest); the
byte and memory formulas on the smoke-size GPT with the sums written out. The 4-rank run
that checks them against torch's DeviceMesh and counted collectives is tests/test_mesh_parity.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist

from labkit.config import ModelConfig
from labkit.parallel import compose, mesh
from labkit.workers import mesh_train

CFG = ModelConfig(seq_len=32, n_layer=2, n_head=4, d_model=64)  # vocab 256, tied head


# --- validation: ValueError naming the constraint and the fix -----------------------------------


def test_sizes_must_multiply_to_the_world_size():
    with pytest.raises(ValueError, match=r"2 × 3 = 6 cells but the job has world_size=4.*launch 6"):
        mesh.validate_mesh({"dp": 2, "tp": 3}, 4)
    assert mesh.validate_mesh({"dp": 2, "tp": 2}, 4).shape == (2, 2)


def test_names_must_be_unique_and_non_empty_and_sizes_positive():
    with pytest.raises(ValueError, match=r"\['dp'\] appear more than once"):
        mesh.validate_mesh([("dp", 2), ("dp", 2)], 4)
    with pytest.raises(ValueError, match="non-empty string"):
        mesh.validate_mesh({"": 4}, 4)
    with pytest.raises(ValueError, match=r"size=0 is not allowed: a positive integer \(of mesh dimension 'tp'\)"):
        mesh.validate_mesh({"dp": 4, "tp": 0}, 4)
    with pytest.raises(ValueError, match="no dimensions"):
        mesh.validate_mesh({}, 4)
    with pytest.raises(ValueError, match="dict of named dimensions"):
        mesh.validate_mesh(4, 4)


def test_tp_must_divide_the_heads_when_the_model_is_given():
    three_heads = ModelConfig(seq_len=32, n_layer=2, n_head=3, d_model=48)
    with pytest.raises(
        ValueError, match=r"mesh dimension 'tp': tp=2 does not divide n_head=3.*\[1, 3\]"
    ):
        mesh.validate_mesh({"dp": 2, "tp": 2}, 4, model_cfg=three_heads)
    mesh.validate_mesh({"dp": 2, "tp": 2}, 4)  # without the model there is nothing to divide
    mesh.validate_mesh({"dp": 4, "tp": 1}, 4, model_cfg=three_heads)


def test_the_worker_validates_before_any_group_exists():
    with pytest.raises(ValueError, match=r"batch_size=6 does not divide among the 4"):
        mesh_train.validate({"batch_size": 6}, 4)
    with pytest.raises(ValueError, match=r"fsdp_tp_mesh=\{'dp': 2, 'sp': 2\}: fsdp_tp needs"):
        mesh_train.validate({"fsdp_tp_mesh": {"dp": 2, "sp": 2}}, 4)
    with pytest.raises(ValueError, match=r"world_size=2"):
        mesh_train.validate({}, 2)
    with pytest.raises(ValueError, match=r"group_meshes=.*labels are not"):
        mesh_train.validate({"group_meshes": {"hsdp": {"x": 4}}}, 4)
    with pytest.raises(ValueError, match=r"x=2 has 2 = 2 cells"):
        mesh_train.validate({"group_meshes": {"flat": {"x": 2}}}, 4)
    job = mesh_train.validate({"group_meshes": {"flat": {"x": 4}}, "parts": ["groups"]}, 4)
    assert job["group_meshes"]["flat"].shape == (4,)


def test_compositions_refuse_a_mesh_with_other_names():
    class Fake:
        mesh_dim_names = ("replicate", "shard")

    with pytest.raises(
        ValueError, match=r"apply_fsdp_tp needs a 2-D mesh with dimensions \('dp', 'tp'\)"
    ):
        compose.apply_fsdp_tp(torch.nn.Linear(2, 2), Fake())


# --- which ranks form each group ---------------------------------------------------------------


def test_group_ranks_on_a_2x2_mesh():
    #         tp=0 tp=1
    # dp=0  [  0,   1 ]
    # dp=1  [  2,   3 ]
    spec = {"dp": 2, "tp": 2}
    table = {0: ([0, 2], [0, 1]), 1: ([1, 3], [0, 1]), 2: ([0, 2], [2, 3]), 3: ([1, 3], [2, 3])}
    for rank, (dp, tp) in table.items():
        assert mesh.group_ranks(spec, "dp", rank) == dp
        assert mesh.group_ranks(mesh.as_spec(spec), "tp", rank) == tp
    assert mesh.all_groups(spec, "dp") == [[0, 2], [1, 3]]
    assert mesh.all_groups(spec, "tp") == [[0, 1], [2, 3]]


def test_group_ranks_on_a_2x3_mesh():
    #         tp=0 tp=1 tp=2
    # dp=0  [  0,   1,   2 ]
    # dp=1  [  3,   4,   5 ]
    spec = {"dp": 2, "tp": 3}
    assert mesh.group_ranks(spec, "tp", 4) == [3, 4, 5]
    assert mesh.group_ranks(spec, "dp", 4) == [1, 4]
    assert mesh.group_ranks(spec, "dp", 2) == [2, 5]
    assert mesh.all_groups(spec, "dp") == [[0, 3], [1, 4], [2, 5]]
    assert mesh.all_groups(spec, "tp") == [[0, 1, 2], [3, 4, 5]]
    # Swapping the order swaps who is neighbour: tp outermost puts 0 and 2 in one tp group.
    assert mesh.group_ranks({"tp": 3, "dp": 2}, "tp", 0) == [0, 2, 4]
    with pytest.raises(ValueError, match=r"no dimension 'pp'"):
        mesh.group_ranks(spec, "pp", 0)
    with pytest.raises(ValueError, match=r"rank=6 is not allowed: an integer from 0 to 5"):
        mesh.group_ranks(spec, "dp", 6)


def test_data_index_follows_the_data_parallel_dimensions():
    spec = {"dp": 2, "tp": 2}
    assert [mesh_train.data_index(spec, "fsdp_tp", r) for r in range(4)] == [
        (0, 2),
        (0, 2),
        (1, 2),
        (1, 2),
    ]
    hsdp = {"replicate": 2, "shard": 2}
    assert [mesh_train.data_index(hsdp, "hsdp", r)[0] for r in range(4)] == [0, 1, 2, 3]


# --- bytes per dimension and memory per rank: worked cases ----------------------------------------


def test_fsdp_tp_bytes_per_dimension_worked_case():
    got = mesh.predict_comm(CFG, {"dp": 2, "tp": 2}, "fsdp_tp", micro_batch=4)
    # tp: 4 all-reduces per layer of a (b, s, h) fp32 activation = 8 x 4*32*64*4 bytes.
    assert got["tp"]["message_bytes"] == {"all_reduce": 8 * 32768}
    assert got["tp"]["sent_per_rank"] == 2 * 1 / 2 * 8 * 32768  # ring: 2(n-1)/n S
    # dp: root = V*h + s*h + 2h = 16384 + 2048 + 128; a block on one TP rank keeps
    # (12h^2 + 7h)/2 + 6h = 24800 + 384. Blocks gathered twice (forward, backward), root once.
    root, block = 18560, 25184
    assert got["dp"]["message_bytes"] == {
        "all_gather": 4 * (root + 2 * 2 * block),
        "reduce_scatter": 4 * (root + 2 * block),
    }
    assert got["dp"]["calls"] == {"all_gather": 5, "reduce_scatter": 3}
    assert got["dp"]["sent_per_rank"] == (477184 + 275712) / 2


def test_hsdp_bytes_per_dimension_worked_case():
    got = mesh.predict_comm(CFG, {"replicate": 2, "shard": 2}, "hsdp", micro_batch=2)
    root, block = 18560, 49984  # a whole block: 12h^2 + 13h
    total = root + 2 * block  # 118528 parameters
    assert got["shard"]["message_bytes"] == {"all_gather": 4 * (root + 4 * block),
                                             "reduce_scatter": 4 * total}  # fmt: skip
    # Across replicas only the shard's gradient: half the model.
    assert got["replicate"]["message_bytes"] == {"all_reduce": 4 * total // 2}
    assert got["replicate"]["sent_per_rank"] == 4 * total // 2
    with pytest.raises(ValueError, match="composition='pp'"):
        mesh.predict_comm(CFG, {"dp": 4}, "pp", micro_batch=1)


def test_memory_per_rank_worked_case():
    tp = mesh.predict_memory(CFG, {"dp": 2, "tp": 2}, "fsdp_tp")
    # TP rank: replicated 18560 + 6h per layer... = tp_params_per_rank(cfg, 2); dp halves it.
    assert tp["parameters"] == 4 * (18560 + 2 * 25184) / 2
    assert tp["total"] == 16 * (18560 + 2 * 25184) / 2
    hsdp = mesh.predict_memory(CFG, {"replicate": 2, "shard": 2}, "hsdp")
    assert hsdp["optimizer_state"] == 8 * 118528 / 2


# --- counting bytes by process group, in a 1-rank group -------------------------------------------


@pytest.fixture(scope="module")
def world():
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    yield tdist.group.WORLD
    tdist.destroy_process_group()


def test_mesh_spy_files_each_collective_under_its_group(world):
    spy = mesh.MeshSpy({world.group_name: "dp"})
    with spy:
        tdist.all_reduce(torch.ones(10))
        out = torch.empty(6)
        (getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor)(
            out, torch.ones(6)
        )
    assert spy.counts == {"dp": {"all_reduce": {"calls": 1, "message_bytes": 40},
                                 "all_gather": {"calls": 1, "message_bytes": 24}}}  # fmt: skip
    assert spy.summary({"dp": 1})["dp"]["sent_per_rank"] == 0  # one rank sends nothing
    other = mesh.MeshSpy({})
    with other:
        tdist.all_reduce(torch.ones(2))
    assert list(other.counts) == [f"group {world.group_name}"]  # unnamed, never dropped


# --- data-parallel strategies take their group from a named dimension -----------------------------


def test_dp_config_accepts_one_named_dimension_and_explains_two():
    from labkit.parallel.dp_config import DPSettings

    def settings(mesh):
        return DPSettings(strategies=("naive", "fsdp2"), mesh=mesh,
                          model={"seq_len": 16, "n_layer": 1, "n_head": 2, "d_model": 16})  # fmt: skip

    assert settings({"dp": 2}).resolve(2).mesh == {"dp": 2}
    assert settings([["dp", 2]]).mesh == {"dp": 2}  # JSON's pairs: one shape, a dict
    assert settings([2]).resolve(2).mesh == [2]  # as before
    with pytest.raises(ValueError, match=r"mesh=\[1, 2\].*needs names"):
        settings([1, 2])  # refused when built: no world makes it right
    with pytest.raises(ValueError, match=r"2 = 2 cells but the job has world_size=4"):
        settings({"dp": 2}).resolve(4)
    with pytest.raises(ValueError, match=r"labkit.parallel.compose.*mesh_train"):
        settings({"replicate": 2, "shard": 2})


def test_strategies_communicate_in_the_named_dimensions_group(world):
    from torch.distributed.device_mesh import init_device_mesh

    from labkit.model import GPT
    from labkit.parallel.dp_naive import NaiveDP
    from labkit.parallel.fsdp import FSDP2

    dm = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    group = dm["dp"].get_group()
    model = GPT(ModelConfig(seq_len=8, n_layer=1, n_head=2, d_model=16))
    strategy = NaiveDP(1, group=group)
    strategy.wrap(model)
    spy = mesh.MeshSpy({group.group_name: "dp"})
    with spy:
        _, loss = model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
        loss.backward()
    n_params = len([p for p in model.parameters() if p.requires_grad])
    assert spy.counts["dp"]["all_reduce"]["calls"] == n_params  # every one on the dp group
    fsdp = FSDP2(1, mesh=dm, mesh_dim="dp")
    assert fsdp.mesh.mesh_dim_names == ("dp",)
