"""``dp_train.run`` resolves the backend the caller asked for and refuses what cannot run,
before any process starts. No processes here: the launcher is stubbed out."""

from __future__ import annotations

import pytest

from labkit import launch
from labkit.workers import dp_train

CONFIG = {
    "strategies": ["ddp", "zero1", "fsdp2"],
    "model": {"seq_len": 16, "n_layer": 2, "n_head": 2, "d_model": 32},
    "mesh": [2],
}


@pytest.fixture
def no_spawn(tmp_path, monkeypatch):
    """A private LABKIT_HOME, and a launcher that fails the test if a job would start."""
    home = tmp_path / "home"
    monkeypatch.setenv("LABKIT_HOME", str(home))

    def refuse(self):
        raise AssertionError("dp_train.run started a job it should have refused")

    monkeypatch.setattr(launch._Supervisor, "start", refuse)
    return home


def test_gloo_on_gpus_is_refused_before_anything_starts(no_spawn, monkeypatch):
    # Two GPUs visible: device="auto" puts the ranks on CUDA, where gloo cannot reduce-scatter
    # (ZeRO-1, FSDP2). The old run() resolved "auto" whatever the caller passed and launched.
    monkeypatch.setattr(launch, "visible_gpu_count", lambda: 2)
    with pytest.raises(ValueError, match=r"backend='gloo' with device='cuda'.*device='cpu'"):
        dp_train.run(CONFIG, nproc=2, backend="gloo")
    with pytest.raises(ValueError, match=r"backend='gloo' with device='cuda'"):
        dp_train.run(CONFIG, nproc=2, device="cuda", backend="gloo")
    assert not (no_spawn / "runs").exists(), "no job directory may be created"


def test_the_callers_backend_reaches_the_launcher(monkeypatch):
    calls = []
    monkeypatch.setattr(launch, "run", lambda module, **kw: calls.append((module, kw)))
    monkeypatch.setattr(launch, "visible_gpu_count", lambda: 2)
    dp_train.run(CONFIG, nproc=2, backend="nccl")
    dp_train.run(CONFIG, nproc=2, device="cpu", backend="gloo")  # CPU ranks: gloo is right
    got = [(kw["backend"], kw["device"]) for _, kw in calls]
    assert got == [("nccl", "cuda"), ("gloo", "cpu")]
    assert {module for module, _ in calls} == {dp_train.MODULE}
    monkeypatch.setattr(launch, "visible_gpu_count", lambda: 0)
    with pytest.raises(ValueError, match="backend='nccl' but no CUDA GPU"):
        dp_train.run(CONFIG, nproc=2, backend="nccl")
    assert len(calls) == 2
