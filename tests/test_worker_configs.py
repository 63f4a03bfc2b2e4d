"""Every worker's typed config: a misspelt or bad field is refused by name before anything
starts, and a config reaches the ranks as the same dataclass (labkit.jobs.spec)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from labkit.jobs import launch
from labkit.validate import InvalidValue
from labkit.workers import (
    allreduce,
    capstone_config,
    collective_faults,
    dp_train,
    mesh_train,
    multinode,
    pp_compose,
    pp_train,
    tp_train,
)

SOLUTIONS = Path(__file__).resolve().parents[1] / "solutions"


@pytest.mark.parametrize(("config", "values", "says"), [
    (tp_train.TPTrainConfig, {"stepz": 3}, r"TPTrainConfig has no field\(s\) \['stepz'\]"),
    (tp_train.TPTrainConfig, {"parts": ["gpt", "fsdp"]}, "parts='fsdp' is not allowed: one of"),
    (pp_train.PPTrainConfig, {"microbatches": [2, 0]}, "microbatches=0 is not allowed"),
    (pp_train.PPTrainConfig, {"partition_by": "flops"}, "partition_by='flops' is not allowed"),
    (allreduce.AllReduceConfig, {"numel": 0}, "numel=0 is not allowed: a positive integer"),
    (allreduce.AllReduceConfig, {"fail_how": "exit"}, "fail_how='exit' is not allowed"),
    (collective_faults.CollectiveFaultsConfig, {"fault_step": 4}, "fault_step=4 is not allowed"),
    (mesh_train.MeshTrainConfig, {"step": 3}, r"MeshTrainConfig has no field\(s\) \['step'\]"),
    (mesh_train.MeshTrainConfig, {"batch_size": 6}, "batch_size=6 does not divide among the 4"),
    (dp_train.DPTrainConfig, {"strategies": ["ddp"], "global_batchh": 8},
     r"DPTrainConfig has no field\(s\) \['global_batchh'\]"),
    (pp_compose.PPComposeConfig, {"part": "dp_tp"}, "part='dp_tp' is not allowed"),
])  # fmt: skip
def test_a_bad_field_is_refused_by_name(config, values, says):
    with pytest.raises(InvalidValue, match=says):
        config.from_dict(values)


def test_a_config_round_trips_through_json():
    cfg = pp_train.PPTrainConfig(microbatches=[1, 2], schedules=("gpipe",), model={"n_layer": 2})
    assert cfg.microbatches == (1, 2)
    assert pp_train.PPTrainConfig.from_dict(cfg.to_dict()) == cfg


def test_a_config_reaches_the_rank_as_the_same_dataclass():
    # A real 1-rank gloo job: the worker reads MultinodeConfig.from_dict(ctx.config) and uses
    # its fields (lr and seed shape the params; numel the all-reduce).
    cfg = multinode.MultinodeConfig(seed=3, batch=4, numel=16, lr=0.05)
    res = multinode.run(cfg, nproc=1, timeout_s=120, stream=False, device="cpu")
    got = res.rank(0)
    assert got["allreduce"] == 1.0 and got["world_size"] == 1
    expected = multinode.reference_params(1, seed=cfg.seed, batch=cfg.batch, lr=cfg.lr)
    assert got["params"] == pytest.approx(expected.tolist(), abs=1e-6)


def test_launch_refuses_a_config_of_another_worker():
    with pytest.raises(ValueError, match=r"not for labkit\.workers\.tp_train"):
        launch.run("labkit.workers.tp_train", config=allreduce.AllReduceConfig(), nproc=1)


def test_a_dp_config_is_checked_by_validate_dp_config_when_built():
    # One implementation of the data-parallel rules (labkit.parallel.dp_config), run when the
    # config is built for what holds on any world size.
    with pytest.raises(ValueError, match="strategies='zero2' is not allowed"):
        dp_train.DPTrainConfig(strategies=("ddp", "zero2"))
    with pytest.raises(ValueError, match=r"freeze=\['nope'\] is not allowed"):
        dp_train.DPTrainConfig(strategies=("ddp",), freeze=("nope",))


def test_a_world_size_check_waits_for_the_launch():
    # What only the launch can say (the ranks a mesh needs) is refused by run(), before it starts.
    cfg = mesh_train.MeshTrainConfig()
    with pytest.raises(ValueError, match=r"world_size=2 ranks"):
        mesh_train.run(cfg, nproc=2)
    with pytest.raises(ValueError, match=r"global_batch=6 does not divide by world_size=4"):
        dp_train.run(dp_train.DPTrainConfig(strategies=("ddp",), global_batch=6), nproc=4,
                     device="cpu")  # fmt: skip


def test_the_capstone_config_keeps_its_knobs_sealed():
    cfg = capstone_config.CapstoneConfig.sealing({"prepare_data": "per_item"}, steps=4)
    assert "per_item" not in json.dumps(cfg.to_dict())  # the job spec names no setting
    assert cfg.flat()["prepare_data"] == "per_item" and cfg.flat()["steps"] == 4
    with pytest.raises(ValueError, match=r"config keys \['gremlins'\] are not settings"):
        capstone_config.CapstoneConfig.sealing({"gremlins": 1})


def test_no_solutions_notebook_launches_a_worker_with_a_dict():
    """Workers are launched by their ``run(XConfig(...))``: a launch by module name hands the
    ranks a dict, whose misspelt key only a rank would find."""
    by_name = re.compile(r"launch\.run\(\s*[\"']labkit\.workers\.")
    found = []
    for path in sorted(SOLUTIONS.glob("*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            if cell["cell_type"] == "code" and by_name.search(source):
                found.append(f"{path.name} cell {i}")
    assert found == []
