"""Every worker's typed config: a misspelt or bad field is refused by name before anything
starts, and a config reaches the ranks as the same dataclass (labkit.jobs.spec)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
import re
from pathlib import Path

import pytest

from labkit import workers
from labkit.config import ModelConfig
from labkit.jobs import launch
from labkit.jobs.spec import WorkerConfig
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


def _worker_configs() -> list[type[WorkerConfig]]:
    """Every worker's config class: those of the modules labkit.workers holds."""
    for info in pkgutil.iter_modules(workers.__path__):
        importlib.import_module(f"labkit.workers.{info.name}")
    found, todo = [], list(WorkerConfig.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.startswith("labkit.workers.") and cls.WORKER:
            found.append(cls)
    return sorted(found, key=lambda c: c.__name__)


REQUIRED = {"AllReduceSizesConfig": {"sizes": (1024, 4096)}, "DPTrainConfig": {"strategies": ("ddp",)}}
"""The fields a config has no default for."""


@pytest.mark.parametrize("config", _worker_configs(), ids=lambda c: c.__name__)
def test_a_list_given_for_a_tuple_field_becomes_a_tuple(config):
    # Built from Python as from JSON: equal configs compare equal, and a frozen config holds
    # no list that could change under it (WorkerConfig.__post_init__, for every subclass).
    required = REQUIRED.get(config.__name__, {})
    default = config(**required)
    tuples = {f.name: list(getattr(default, f.name)) for f in dataclasses.fields(config)
              if isinstance(getattr(default, f.name), tuple) and getattr(default, f.name)}
    built = config(**{**required, **tuples})
    assert built == default
    assert all(isinstance(getattr(built, name), tuple) for name in tuples)


def test_a_model_dict_becomes_a_model_config_over_the_workers_default():
    cfg = tp_train.TPTrainConfig(model={"n_layer": 3})
    assert cfg.model == ModelConfig(**{**tp_train.DEFAULT_MODEL, "n_layer": 3})
    assert tp_train.TPTrainConfig.from_dict(cfg.to_dict()) == cfg  # through the job folder's JSON
    assert tp_train.TPTrainConfig(model=cfg.model) == cfg
    with pytest.raises(InvalidValue, match=r"model: ModelConfig has no field\(s\) \['n_layers'\]"):
        tp_train.TPTrainConfig(model={"n_layers": 3})
    with pytest.raises(InvalidValue, match="model=3 is not allowed: a ModelConfig"):
        pp_train.PPTrainConfig(model=3)


def test_a_config_reaches_the_rank_as_the_same_dataclass():
    # A real 1-rank gloo job: the worker reads MultinodeConfig.from_dict(ctx.config) and uses
    # its fields (lr and seed shape the params; numel the all-reduce).
    cfg = multinode.MultinodeConfig(seed=3, batch=4, numel=16, lr=0.05)
    res = multinode.run(cfg, nproc=1, timeout_s=120, stream=False, device="cpu")
    got = res.rank(0)
    assert got["allreduce"] == 1.0 and got["world_size"] == 1
    expected = multinode.reference_params(1, seed=cfg.seed, batch=cfg.batch, lr=cfg.lr)
    assert got["params"] == pytest.approx(expected.tolist(), abs=1e-6)


def test_launch_takes_a_config_alone():
    # One way to launch a worker: run(config). A labkit worker by name, or a config keyword, is
    # refused.
    with pytest.raises(ValueError, match=r"launch it as run\(TPTrainConfig\(\.\.\.\)\)"):
        launch.run("labkit.workers.tp_train", nproc=1)
    with pytest.raises(TypeError, match="config"):
        launch.run(allreduce.AllReduceConfig(), config={"numel": 4}, nproc=1)  # type: ignore[call-arg]


def test_a_dp_config_is_checked_by_its_dp_settings_when_built():
    # One implementation of the data-parallel rules (labkit.parallel.dp_config.DPSettings, the
    # config's base), run when the config is built for what holds on any world size.
    with pytest.raises(ValueError, match="strategies='zero2' is not allowed"):
        dp_train.DPTrainConfig(strategies=("ddp", "zero2"))
    with pytest.raises(ValueError, match=r"freeze='nope' is not allowed"):
        dp_train.DPTrainConfig(strategies=("ddp",), freeze=("nope",))
    # What the launch decides is resolved for it: the micro-batch, the backend, AUTO's dtype.
    cfg = dp_train.DPTrainConfig(strategies=["fsdp2"], mesh=[2], global_batch=8,
                                 train={"dtype": "bfloat16"})  # fmt: skip
    job = cfg.resolve(2)
    assert (job.train.micro_batch, job.backend, job.fsdp_mixed_precision) == (4, "gloo", "bf16")
    assert type(job).from_dict(job.to_dict()) == job  # a rank's reported config, read back


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
    by_name = re.compile(r"launch\.run\(\s*[\"']labkit\.workers\.|\.run\(\s*(\{|dict\()")
    found = []
    for path in sorted(SOLUTIONS.glob("*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            if cell["cell_type"] == "code" and by_name.search(source):
                found.append(f"{path.name} cell {i}")
    assert found == []
