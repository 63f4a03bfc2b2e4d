"""What a checkpoint is made of and what it costs: the model's entries, its bytes predicted
before one is written, the disk's write speed, and how long a save stops training, measured.

The prediction (``formulas.checkpoint_bytes`` plus the file format's allowance per tensor) is
checked against what :func:`labkit.jobs.checkpoint.saving` measures, and notebook 02b compares a
synchronous save with an asynchronous one (:func:`time_save_modes`). None of it writes a
checkpoint that a job resumes from; the signature it reads is what a checkpoint's manifest
records and what a loading job must match (:mod:`labkit.jobs.checkpoint.folders`).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from labkit import formulas
from labkit.jobs.checkpoint.ranks import quiet_dcp
from labkit.validate import whole

METADATA_BYTES_PER_TENSOR = 300
"""Modelled: DCP's ``.metadata`` holds, per tensor, its name, shape, dtype and where its bytes
are; pickled, about 270 B a tensor for labkit's GPT under torch 2.13 (38,621 B for 145)."""


def signature(model: nn.Module) -> list[list[Any]]:
    """[name, shape, dtype] of every entry of the model's state dict, DDP's ``module.`` removed:
    what a checkpoint must match to load into ``model``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    out = []
    for name, t in get_model_state_dict(model).items():
        if isinstance(t, torch.Tensor):
            out.append([name, list(t.shape), str(t.dtype).removeprefix("torch.")])
    return out


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's name in ``formulas.OPTIMIZER_STATES`` ("adamw", "sgd_momentum", ...)."""
    name = type(optimizer).__name__.lower()
    if name == "sgd":
        momentum = any(g.get("momentum", 0) for g in optimizer.param_groups)
        return "sgd_momentum" if momentum else "sgd"
    return name


def count(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What ``predict_bytes`` needs, read from the model and optimizer: parameters (each
    counted once), parameters the state dict names twice (a tied embedding), tensors saved."""
    params = list(model.parameters())  # de-duplicated: a tied weight appears once
    n_params = sum(p.numel() for p in params)
    entries = signature(model)
    n_entries = sum(_numel(shape) for _, shape, _ in entries)
    states = formulas.OPTIMIZER_STATES.get(optimizer_kind(optimizer), 0)
    trainable = [p for p in params if p.requires_grad]
    # AdamW keeps a scalar "step" tensor per parameter besides m and v
    per_param = states + (1 if optimizer_kind(optimizer) in ("adam", "adamw") else 0)
    return {
        "n_params": n_params,
        "n_trainable": sum(p.numel() for p in trainable),
        "aliased_params": n_entries - n_params,
        "n_tensors": len(entries) + per_param * len(trainable),
        "optimizer": optimizer_kind(optimizer),
        "weight_dtype": entries[0][2] if entries else "float32",
        "state_dtype": _state_dtype(optimizer) or (entries[0][2] if entries else "float32"),
    }


def _state_dtype(optimizer: torch.optim.Optimizer) -> str | None:
    """The dtype of the optimizer's per-parameter states (m, v, momentum), as it keeps them:
    PyTorch's optimizers use the parameter's dtype. None before the first step."""
    for state in optimizer.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                return str(t.dtype).removeprefix("torch.")
    return None


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def tensor_overhead_bytes() -> int:
    """Measured: bytes DCP's file format adds to each tensor it writes. torch 2.13's
    ``FileSystemWriter`` writes every tensor with ``torch.save`` (a small zip archive: a
    pickle, a byte-order record, headers), so the overhead is that of ``torch.save`` on a
    one-element tensor, less its 4 bytes of data: about 1.6 kB."""
    buf = io.BytesIO()
    torch.save(torch.zeros(1), buf)
    return len(buf.getvalue()) - 4


def predict_bytes(
    n_params: int,
    *,
    n_tensors: int = 0,
    aliased_params: int = 0,
    weight_dtype: Any = "float32",
    optimizer: str = "adamw",
    state_dtype: Any = "float32",
    n_trainable: int | None = None,
    per_tensor_bytes: float | None = None,
) -> dict[str, Any]:
    """Predicted bytes of a checkpoint: weights and optimizer state per parameter, plus a
    per-tensor allowance for the file format.

    Not in :mod:`labkit.formulas` (whose ``checkpoint_bytes`` it uses): the per-tensor
    allowance is measured on this machine (``tensor_overhead_bytes``).

    fp32 AdamW: 4 B of weights + 8 B of moments (m and v) = 12 B per parameter; gradients are
    not saved. ``formulas.checkpoint_bytes`` does the arithmetic; this adds what the file
    format costs per tensor (``tensor_overhead_bytes``, measured, plus
    ``METADATA_BYTES_PER_TENSOR``, modelled) unless ``per_tensor_bytes`` is given.
    ``count(model, optimizer)`` gives every other argument for a real model.
    """
    if per_tensor_bytes is None:
        per_tensor_bytes = tensor_overhead_bytes() + METADATA_BYTES_PER_TENSOR
    per_param = formulas.checkpoint_bytes_per_param(weight_dtype, optimizer, state_dtype)
    total = formulas.checkpoint_bytes(
        n_params,
        weight_dtype=weight_dtype,
        optimizer=optimizer,
        state_dtype=state_dtype,
        n_trainable=n_trainable,
        aliased_params=aliased_params,
        n_tensors=n_tensors,
        bytes_per_tensor=per_tensor_bytes,
    )
    return {
        "bytes": round(total),
        "bytes_per_param": per_param,
        "payload_bytes": round(total - n_tensors * per_tensor_bytes),
        "per_tensor_bytes": per_tensor_bytes,
        "method": f"predicted: {per_param} B/param ({optimizer}, {formulas.dtype_name(weight_dtype)} "
        f"weights) + {per_tensor_bytes:.0f} B per tensor for the file format",
    }


def write_bandwidth(folder: Path | str, nbytes: int = 8 << 20) -> float:
    """Measured bytes/s of one fsync'd write of ``nbytes`` into ``folder`` (the file removed
    afterwards): the disk speed a checkpoint there can expect, since DCP fsyncs its files
    too. Size it like the checkpoint: small writes are slower per byte (latency dominates)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / f".write-probe-{os.getpid()}"
    data = os.urandom(min(nbytes, 1 << 20)) * max(1, nbytes // (1 << 20))
    try:
        start = time.perf_counter()
        with open(probe, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        seconds = time.perf_counter() - start
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return len(data) / max(seconds, 1e-9)


# --- how long a save stops training, synchronous and asynchronous ------------------------------


def time_save_modes(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path | str, *,
                    rounds: int = 5, threads: int | None = 1) -> dict[str, Any]:  # fmt: skip
    """Measure, side by side, how long a synchronous ``dcp.save`` and an asynchronous
    ``dcp.async_save`` of the same state stop the caller, in this process (no process group).

    ``async_save`` (torch 2.13, ``torch/distributed/checkpoint/state_dict_saver.py``) first
    *stages* the state dict, a copy into CPU memory (its ``DefaultStager``), and returns a
    ``Future`` while a background thread writes the copy (``AsyncCheckpointerType.THREAD``,
    the default); training may change the weights as soon as it returns. Each round saves once
    each way, in alternating order, into fresh folders under ``folder`` (removed after). The
    staging buffers are kept from one save to the next, as a training loop keeps them (one
    ``DefaultStager``, without pinned memory: a CPU state needs none). ``threads``: torch's
    CPU threads while timing, 1 as in a torchrun rank (``OMP_NUM_THREADS=1``); on a busy
    machine more threads make each small copy wait for its thread pool. None: as they are.
    Returns per-round seconds: ``sync_s``, ``async_blocking_s`` (until ``async_save``
    returned: what training waits for), ``async_total_s`` (until the write finished), and the
    bytes one save wrote.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rounds = whole("rounds", rounds, low=1)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    no_dist = not tdist.is_initialized()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    out: dict[str, Any] = {"sync_s": [], "async_blocking_s": [], "async_total_s": [], "bytes": 0}

    def sync(path: Path) -> None:
        start = time.perf_counter()
        dcp.save(state, checkpoint_id=str(path), no_dist=no_dist)
        out["sync_s"].append(time.perf_counter() - start)

    def asynchronous(path: Path) -> None:
        start = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(path), no_dist=no_dist,
                                async_stager=stager)  # fmt: skip
        out["async_blocking_s"].append(time.perf_counter() - start)
        future.result()
        out["async_total_s"].append(time.perf_counter() - start)

    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=False))  # fmt: skip
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with quiet_dcp():
            for r in range(rounds + 1):  # round 0 warms up both paths (imports, thread pool)
                order = (sync, asynchronous) if r % 2 else (asynchronous, sync)
                for i, fn in enumerate(order):
                    path = folder / f".round{r}-{i}"
                    fn(path)
                    out["bytes"] = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
                    shutil.rmtree(path, ignore_errors=True)
                if r == 0:
                    out["sync_s"].clear()
                    out["async_blocking_s"].clear()
                    out["async_total_s"].clear()
    finally:
        torch.set_num_threads(before)
        stager.close()
    return out
