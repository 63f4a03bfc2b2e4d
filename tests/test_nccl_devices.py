"""Code paths that run only on NCCL or CUDA, checked on the CPU: which device gets the tensors.

A process group made by ``init_process_group("nccl")`` has no CPU backend: a CPU tensor in
one of its collectives fails ("No backend type associated with device type cpu"). CI has no
GPU, so these tests check the choice of device instead. ``runtime.collective_device`` must name
the GPU on NCCL; every tensor built only for a collective must be on the device it names,
which a spy here sets to ``meta`` (neither the CPU nor a GPU, and it needs no data); model
work must be on ``ctx.device``, which a test sets to ``meta`` too; and CUDA timing must
synchronise before each clock read.
"""

from __future__ import annotations

import inspect
import os
import time
import types

import pytest
import torch
import torch.distributed as tdist

from labkit import timing
from labkit.config import ModelConfig, TrainConfig
from labkit.jobs import runtime
from labkit.model import GPT
from labkit.parallel import timeline
from labkit.workers import _faults, collectives, pp_train, tp_train

META = torch.device("meta")
CFG = ModelConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=4, d_model=32)


class _Sent(Exception):
    """Raised by a spy collective once it has seen the tensor: nothing after it can run."""


def _spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[torch.device]:
    """Replace ``torch.distributed.<name>`` by a spy that records its tensor's device."""
    seen: list[torch.device] = []

    def spy(tensor: torch.Tensor, *args: object, **kwargs: object) -> None:
        seen.append(tensor.device)
        raise _Sent

    monkeypatch.setattr(tdist, name, spy)
    return seen


def _ctx(device: torch.device, world_size: int = 1, **config: object) -> runtime.Context:
    return runtime.Context(0, 0, world_size, "nccl", device, dict(config), job_dir=None)


@pytest.fixture(scope="module")
def group():
    """A 1-rank gloo process group in this process (HashStore: no port, no process)."""
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    yield
    tdist.destroy_process_group()


# --- the helper -----------------------------------------------------------------------------


def test_collective_device_is_the_current_gpu_on_nccl(monkeypatch):
    groups = []
    monkeypatch.setattr(tdist, "get_backend", lambda group=None: groups.append(group) or "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert runtime.collective_device("g") == torch.device("cuda", 1)
    assert groups == ["g"]


def test_collective_device_is_the_cpu_on_gloo(group):
    assert runtime.collective_device() == torch.device("cpu")


# --- tensors built only for a collective ------------------------------------------------------


def test_common_t0_broadcasts_on_the_collective_device(monkeypatch):
    monkeypatch.setattr(tdist, "barrier", lambda group=None: None)
    # raising=False: against code without the helper, the assertion below names the bug.
    monkeypatch.setattr(timeline, "collective_device", lambda group=None: META, raising=False)
    seen = _spy(monkeypatch, "broadcast")
    with pytest.raises(_Sent):
        timeline.common_t0(clock=lambda: 12.5)
    assert seen == [META]  # the old code broadcast a CPU tensor: NCCL fails at step 1


def test_slowest_all_reduces_on_the_collective_device(group, monkeypatch):
    assert collectives.slowest(0.25) == 0.25  # a real 1-rank all-reduce on gloo
    monkeypatch.setattr(runtime, "collective_device", lambda group=None: META)
    seen = _spy(monkeypatch, "all_reduce")
    with pytest.raises(_Sent):
        collectives.slowest(0.25)
    assert seen == [META]


@pytest.mark.parametrize("mode", ["ok", "raise", "hang"])
def test_fault_worker_all_reduces_on_the_collective_device(monkeypatch, capsys, mode):
    monkeypatch.setattr(runtime, "collective_device", lambda group=None: META, raising=False)
    seen = _spy(monkeypatch, "all_reduce")
    worker = inspect.unwrap(_faults.main)  # the function under @entrypoint: no process group
    # Rank 0 is neither the failing nor the hung rank: it reaches the all-reduce.
    with pytest.raises(_Sent):
        worker(_ctx(torch.device("cpu"), world_size=2, mode=mode, steps=0, lines=0))
    assert seen == [META]


# --- model work on ctx.device ---------------------------------------------------------------


def test_unit_times_puts_the_model_on_the_device_of_its_input():
    model = GPT(CFG)
    times = pp_train.unit_times(model, torch.zeros(2, CFG.seq_len, dtype=torch.long), META)
    assert len(times) == CFG.n_layer + 2  # embeddings, each block, head
    # The old worker moved only the input: a CPU model and a CUDA input fail on a GPU.
    assert {p.device for p in model.parameters()} == {META}


def test_linear_part_computes_on_ctx_device():
    out = tp_train._linear_part(_ctx(META), seed=0)
    assert set(out) >= {"col_out", "col_input_grad", "row_out", "row_weight_grad"}
    # The old code left layers and inputs on the CPU: NCCL's all-reduce in f and g fails.
    assert {k: v.device for k, v in out.items()} == dict.fromkeys(out, META)


def test_tp_step_time_synchronises_before_every_clock_read(group, monkeypatch):
    log: list[object] = []
    monkeypatch.setattr(timing, "synchronize", lambda device: log.append(("sync", device)))
    real = time.perf_counter
    clock = types.SimpleNamespace(perf_counter=lambda: log.append("clock") or real())
    monkeypatch.setattr(tp_train, "time", clock)  # tp_train's clock only
    torch.manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (2, 2, CFG.seq_len))  # (x or y, B, T)
    batches = [(tokens[0], tokens[1])] * 2
    cpu = torch.device("cpu")
    run = tp_train._train(
        GPT(CFG), batches, TrainConfig(micro_batch=2, steps=2), _ctx(cpu), counter=None
    )
    assert len(run["losses"]) == 2
    # Two reads per step, two more around the first step's gather; each right after a sync
    # (on CUDA an unsynchronised read times the kernel launches, not the step).
    assert log == [("sync", cpu), "clock"] * 6


# --- the worker's device ----------------------------------------------------------------------


class _Exited(Exception):
    """Raised by a stand-in for ``os._exit``, which ``runtime._run`` calls when it is done."""


@pytest.mark.parametrize(
    ("backend", "device", "want", "bound"),
    [
        ("gloo", "cuda", "cuda:1", False),  # resolve_backend(1, "cuda", "gloo")
        ("nccl", "cuda", "cuda:1", True),
        ("gloo", "cpu", "cpu", False),
    ],
)
def test_worker_device_follows_the_job_spec(tmp_path, monkeypatch, backend, device, want, bound):
    runtime.write_json_atomic(tmp_path / runtime.SPEC_FILE, {"backend": backend, "device": device})
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", runtime.JOB_DIR_ENV: str(tmp_path)}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    calls: dict[str, object] = {}
    monkeypatch.setattr(runtime, "_arm_parent_death_signal", lambda: None)  # not in pytest
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))
    monkeypatch.setattr(tdist, "init_process_group", lambda b, **kw: calls.update(init=(b, kw)))
    monkeypatch.setattr(tdist, "destroy_process_group", lambda: None)

    def exit_(code: int) -> None:
        raise _Exited(code)

    monkeypatch.setattr(os, "_exit", exit_)
    with pytest.raises(_Exited):
        runtime._run(lambda ctx: calls.update(ctx_device=ctx.device))
    # The old worker looked at the backend alone: a gloo job on GPUs ran on the CPU.
    assert calls["ctx_device"] == torch.device(want)
    assert calls.get("set_device") == (torch.device(want) if want != "cpu" else None)
    init_backend, init_kwargs = calls["init"]
    assert init_backend == backend
    # device_id binds an NCCL communicator; gloo gets none.
    assert init_kwargs.get("device_id") == (torch.device(want) if bound else None)


def test_a_pipeline_refuses_gloo_on_gpus_before_any_work():
    """gloo's send/recv take CPU tensors only: say so at once, not deep inside a schedule."""
    ctx = runtime.Context(0, 0, 2, "gloo", torch.device("cuda", 0), {}, job_dir=None)
    with pytest.raises(ValueError, match=r"backend='nccl'.*or device='cpu'"):
        inspect.unwrap(pp_train.main)(ctx)  # the worker body, without process-group setup
