"""labkit.jobs.runtime: the worker-side context, its on-disk protocol, and a worker run end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labkit.jobs import runtime

REPO = Path(__file__).resolve().parents[1]


def make_ctx(job_dir: Path | None, rank: int = 0) -> runtime.Context:
    return runtime.Context(
        rank=rank,
        local_rank=rank,
        world_size=2,
        backend="gloo",
        device=torch.device("cpu"),
        config={"k": 1},
        job_dir=job_dir,
    )


def test_heartbeat_records_progress_and_keeps_unset_fields(tmp_path):
    ctx = make_ctx(tmp_path, rank=1)
    ctx.heartbeat(step=3, total=10, phase="train")
    ctx.heartbeat(step=4)  # total and phase are kept
    beat = runtime.read_json(runtime.heartbeat_path(tmp_path, 1))
    assert beat["step"] == 4 and beat["total"] == 10 and beat["phase"] == "train"
    assert beat["in_collective"] is False
    assert beat["seq"] == 2, "each heartbeat must bump seq: the launcher watches it for progress"
    assert runtime.read_heartbeats(tmp_path, 2) == {1: beat}
    # a node of a multi-node job holds ranks that do not start at 0
    assert runtime.read_heartbeats(tmp_path, [1, 5]) == {1: beat}
    assert runtime.read_heartbeats(tmp_path, [2, 3]) == {}
    assert not list(tmp_path.rglob("*.tmp")), "atomic writes must not leave temp files"


def test_phase_marks_a_collective_and_restores_the_previous_phase(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.heartbeat(step=1, phase="train")
    with ctx.phase("all_reduce"):
        inside = runtime.read_json(runtime.heartbeat_path(tmp_path, 0))
    after = runtime.read_json(runtime.heartbeat_path(tmp_path, 0))
    assert (inside["phase"], inside["in_collective"]) == ("all_reduce", True)
    assert (after["phase"], after["in_collective"]) == ("train", False)
    with ctx.phase("data", collective=False):
        assert runtime.read_json(runtime.heartbeat_path(tmp_path, 0))["in_collective"] is False


def test_write_result_saves_json_and_rejects_tensors(tmp_path):
    ctx = make_ctx(tmp_path, rank=1)
    ctx.write_result({"loss": 1.5, "steps": [1, 2]})
    assert json.loads(runtime.result_path(tmp_path, 1).read_text()) == {"loss": 1.5, "steps": [1, 2]}
    with pytest.raises(TypeError, match=r"\.item\(\)"):
        ctx.write_result({"loss": torch.tensor(1.5)})


def test_without_a_job_dir_results_go_to_the_log(capsys):
    ctx = make_ctx(None)
    ctx.heartbeat(step=1)  # no job dir: a no-op, not an error
    ctx.write_result({"x": 1})
    assert '[labkit result rank 0] {"x": 1}' in capsys.readouterr().out


def test_print0_prints_on_rank_0_only(capsys):
    make_ctx(None, rank=1).print0("from one")
    make_ctx(None, rank=0).print0("from zero")
    out = capsys.readouterr().out
    assert "from zero" in out and "from one" not in out


def test_read_json_tolerates_missing_and_broken_files(tmp_path):
    assert runtime.read_json(tmp_path / "missing.json") is None
    (tmp_path / "broken.json").write_text('{"half":')
    assert runtime.read_json(tmp_path / "broken.json") is None


@pytest.mark.slow
def test_a_worker_runs_as_a_single_process_without_torchrun(tmp_path):
    """``python -m <worker>`` works alone (world size 1): handy for debugging a worker."""
    runtime.write_json_atomic(
        tmp_path / runtime.SPEC_FILE, {"backend": "gloo", "config": {"mode": "ok", "steps": 2}}
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(REPO), **{runtime.JOB_DIR_ENV: str(tmp_path)})
    proc = subprocess.run(
        [sys.executable, "-m", "labkit.workers._faults"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result = runtime.read_json(runtime.result_path(tmp_path, 0))
    assert result["world_size"] == 1 and result["sum"] == 1.0 and result["mode"] == "ok"
    beat = runtime.read_json(runtime.heartbeat_path(tmp_path, 0))
    assert beat["phase"] == "done" and beat["step"] == 2 and beat["pid"] == result["pid"]


def test_the_error_file_is_torchs_written_whole(tmp_path, monkeypatch):
    """torchrun's agent reads a failed rank's error file while polling: written in place it
    can be read half-written (the agent then dies with a JSONDecodeError and restarts nothing).
    Ours is renamed into place, with torch's content."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    ours, torchs = tmp_path / "ours.json", tmp_path / "torchs.json"
    try:
        raise ValueError("boom")
    except ValueError as e:
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(ours))
        runtime._AtomicErrorFile().record_exception(e)
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(torchs))
        ErrorHandler().record_exception(e)
    a, b = (json.loads(p.read_text())["message"] for p in (ours, torchs))
    assert a["message"] == b["message"] == "ValueError: boom"
    assert a["extraInfo"]["py_callstack"] == b["extraInfo"]["py_callstack"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours.json", "torchs.json"]
