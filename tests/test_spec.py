"""labkit.jobs.spec: a worker's typed config, through JSON and back, and launch.run taking it."""

from __future__ import annotations

import dataclasses
import json
from typing import ClassVar

import pytest

from labkit.errors import LabkitError
from labkit.jobs import preflight, spec


@dataclasses.dataclass(frozen=True)
class Inner:
    width: int = 4
    names: tuple[str, ...] = ("a",)


@dataclasses.dataclass(frozen=True)
class Demo(spec.WorkerConfig):
    WORKER: ClassVar[str] = "labkit.workers.allreduce"
    sizes: tuple[int, ...] = (1, 2)
    pair: tuple[int, float] = (1, 2.5)
    inner: Inner = Inner()
    maybe: tuple[int, ...] | None = None
    table: dict[str, list[int]] = dataclasses.field(default_factory=dict)


def test_a_config_survives_json_with_its_types():
    cfg = Demo(sizes=(8, 16), inner=Inner(2, ("x", "y")), maybe=(3,), table={"k": [1]})
    back = Demo.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg and isinstance(back.sizes, tuple) and isinstance(back.inner, Inner)


def test_a_misspelt_field_is_refused_by_name():
    with pytest.raises(LabkitError, match=r"no field\(s\) \['size'\].*'sizes'"):
        Demo.from_dict({"size": [1]})


def test_a_config_without_a_worker_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Orphan(spec.WorkerConfig):
        n: int = 1

    with pytest.raises(LabkitError, match="names no worker module"):
        spec.worker_of(Orphan())


def test_run_reads_the_module_from_the_config():
    assert preflight.worker_and_config(Demo()) == ("labkit.workers.allreduce", Demo().to_dict(),
                                                   json.dumps(Demo().to_dict()))  # fmt: skip
    # A module of one's own by name: the one escape hatch, with no config.
    assert preflight.worker_and_config("my_tests.worker") == ("my_tests.worker", {}, "{}")
    # A labkit worker by name is refused, naming its config class.
    with pytest.raises(ValueError, match=r"launch it as run\(AllReduceConfig\(\.\.\.\)\)"):
        preflight.worker_and_config("labkit.workers.allreduce")
    with pytest.raises(ValueError, match="need a worker's config"):
        preflight.worker_and_config(3)


def test_a_field_that_json_cannot_hold_is_refused_by_the_launch():
    @dataclasses.dataclass(frozen=True)
    class Odd(spec.WorkerConfig):
        WORKER: ClassVar[str] = "my_tests.worker"
        thing: object = None

    with pytest.raises(ValueError, match="Odd is not JSON-serialisable"):
        preflight.worker_and_config(Odd(thing=object()))


def test_a_worker_module_names_its_config_class():
    from labkit.workers.capstone_config import CapstoneConfig
    from labkit.workers.multinode import MultinodeConfig

    assert preflight.config_class("labkit.workers.multinode") is MultinodeConfig
    assert preflight.config_class("labkit.workers.capstone_train") is CapstoneConfig  # imported there
    assert preflight.config_class("labkit.workers.no_such_worker") is None
    assert preflight.config_class("labkit.formulas") is None  # a module, but no worker


def test_the_spec_module_imports_no_torch():
    import subprocess
    import sys

    # nor do the modules that read the job folder through it: the registry and the sbatch script
    code = "import sys, labkit.jobs.spec, labkit.jobs.procs, labkit.jobs.slurm; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_the_job_folder_has_one_layout_which_runtime_re_exports():
    from labkit.jobs import runtime  # a rank looks for it there

    for name in ("JOB_DIR_ENV", "SPEC_FILE", "STACK_SIGNAL", "result_path", "heartbeat_path",
                 "stack_path", "write_json_atomic", "read_json", "read_heartbeats"):  # fmt: skip
        assert getattr(runtime, name) is getattr(spec, name), name
