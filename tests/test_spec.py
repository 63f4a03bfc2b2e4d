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
    assert preflight.worker_and_config(Demo(), None) == ("labkit.workers.allreduce", Demo().to_dict())
    assert preflight.worker_and_config("labkit.workers.allreduce", Demo())[1] == Demo().to_dict()
    assert preflight.worker_and_config("labkit.workers.x", None) == ("labkit.workers.x", {})
    with pytest.raises(ValueError, match="leave config out"):
        preflight.worker_and_config(Demo(), {"a": 1})
    with pytest.raises(ValueError, match=r"for labkit\.workers\.allreduce, not for labkit\.workers\.x"):
        preflight.worker_and_config("labkit.workers.x", Demo())
    with pytest.raises(ValueError, match="module=3"):
        preflight.worker_and_config(3, None)


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
