"""Checkpoints that survive a crash: written atomically, loaded only when complete.

    from labkit import checkpoint
    state = checkpoint.load_latest(root, model, optimizer)    # None: start from scratch
    start = state.step if state else 0
    for step in range(start, steps):
        ...train one step...
        if (step + 1) % every == 0:
            checkpoint.save(root, step + 1, model, optimizer, extra={"data_position": step + 1})

Model and optimizer state go through ``torch.distributed.checkpoint`` (DCP): every rank calls
``save`` and ``load`` together, each rank writes a share of the tensors (DCP gives each
replicated tensor to one rank, balancing the bytes) and reads what it needs, and a sharded
model (FSDP2's DTensors) is saved shard by shard. The model's DDP wrapper, if any, is seen
through (``get_state_dict`` names parameters without ``module.``).

What DCP does not know goes into one small file per rank, ``rank{r}.pt``: the step, the
caller's ``extra`` (the data position) and the random-number generators' states. A file per
rank, not a DCP key, because these values differ from rank to rank (each rank's dropout
stream is its own) and DCP treats a plain tensor that every rank saves under one key as
replicated: it keeps one rank's copy (``dedup_save_plans``), and the others' would be lost.

Layout under ``root``::

    step000000012/          a complete checkpoint: the only kind ever loaded
        .metadata           DCP's index of the tensors
        __0_0.distcp ...    DCP's data, one file per rank that wrote some
        rank0.pt rank1.pt   per-rank state: step, extra, RNG
        manifest.json       written last: step, world size, the model's parameter names,
                            shapes and dtypes, bytes, seconds
    .tmp-step000000014/     a checkpoint being written (or one whose writer died)

Atomic: every rank writes into the temporary folder; after a barrier (every rank done), rank 0
writes the manifest and renames the folder to its final name, one ``rename``, which POSIX
makes atomic. A reader therefore sees a whole checkpoint or none, and a job killed at any
moment leaves at worst a ``.tmp-`` folder that is never loaded. All ranks must see the same
``root``: on several machines, a shared file system.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from labkit import formulas

MANIFEST = "manifest.json"
MAX_LINES = 8  # differences named in a CheckpointMismatch; the rest are counted
FORMAT = 1  # bumped when the layout changes; another format is a mismatch, not a crash
_FINAL = re.compile(r"^step(\d{9})$")
_TMP_PREFIX = ".tmp-"

METADATA_BYTES_PER_TENSOR = 300
"""Modelled: DCP's ``.metadata`` holds, per tensor, its name, shape, dtype and where its bytes
are; pickled, about 270 B a tensor for labkit's GPT under torch 2.13 (38,621 B for 145)."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be completed: raised on every rank, and nothing was published."""


class CheckpointMismatch(ValueError):
    """A complete checkpoint that this job cannot load: another model shape, world size,
    optimizer or format. Raised before torch reads any tensor; the message names what differs
    and the way out."""


# --- what a checkpoint is made of --------------------------------------------------------------


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


# --- the on-disk checkpoints ---------------------------------------------------------------------


def final_dir(root: Path | str, step: int) -> Path:
    return Path(root) / f"step{step:09d}"


def tmp_dir(root: Path | str, step: int) -> Path:
    return Path(root) / f"{_TMP_PREFIX}step{step:09d}"


def read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        obj = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def scan(root: Path | str) -> tuple[list[tuple[int, Path, dict]], list[str]]:
    """(complete checkpoints as (step, folder, manifest), oldest first; why each other folder
    under ``root`` is not one). Complete: a final name, a manifest that parses and names the
    same step, DCP's index and a file for each rank."""
    root = Path(root)
    good, skipped = [], []
    if not root.is_dir():
        return good, skipped
    for d in sorted(root.iterdir()):
        if not d.is_dir():
            continue
        if d.name.startswith(_TMP_PREFIX):
            skipped.append(f"{d.name}: partial (its writer never finished: no rename)")
            continue
        m = _FINAL.match(d.name)
        if not m:
            continue
        manifest = read_manifest(d)
        if manifest is None:
            why = "torn manifest" if (d / MANIFEST).exists() else "no manifest"
            skipped.append(f"{d.name}: partial ({why})")
            continue
        if manifest.get("step") != int(m.group(1)):
            skipped.append(f"{d.name}: its manifest says step {manifest.get('step')!r}")
            continue
        world = manifest.get("world_size")
        missing = [f"rank{r}.pt" for r in range(world if isinstance(world, int) else 0)
                   if not (d / f"rank{r}.pt").exists()]  # fmt: skip
        if not (d / ".metadata").exists():
            missing.insert(0, ".metadata")
        if missing:
            skipped.append(f"{d.name}: partial (missing {', '.join(missing)})")
            continue
        good.append((manifest["step"], d, manifest))
    good.sort(key=lambda t: t[0])
    return good, skipped


def mismatches(manifest: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
               world_size: int) -> list[str]:  # fmt: skip
    """What differs between a checkpoint's manifest and this job, one line each ([] if none)."""
    out = []
    if manifest.get("format") != FORMAT:
        out.append(f"checkpoint format {manifest.get('format')!r}, this labkit reads {FORMAT}")
        return out
    if manifest.get("world_size") != world_size:
        out.append(f"saved by {manifest.get('world_size')} ranks, this job has {world_size}")
    if manifest.get("optimizer") != optimizer_kind(optimizer):
        out.append(f"saved with optimizer {manifest.get('optimizer')}, this job uses "
                   f"{optimizer_kind(optimizer)}")  # fmt: skip
    saved = {name: (tuple(shape), dtype) for name, shape, dtype in manifest.get("signature", [])}
    mine = {name: (tuple(shape), dtype) for name, shape, dtype in signature(model)}
    for name in [n for n in saved if n in mine]:
        (s_shape, s_dtype), (m_shape, m_dtype) = saved[name], mine[name]
        if s_shape != m_shape:
            out.append(f"{name}: saved {s_shape}, this model {m_shape}")
        elif s_dtype != m_dtype:
            out.append(f"{name}: saved {s_dtype}, this model {m_dtype}")
    only_saved = [n for n in saved if n not in mine]
    only_mine = [n for n in mine if n not in saved]
    for names, where in ((only_saved, "only in the checkpoint"), (only_mine, "only in this model")):
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            out.append(f"{where}: {', '.join(names[:3])}{more}")
    return out


# --- save and load -------------------------------------------------------------------------------


@dataclass
class Saved:
    """One checkpoint written: where, how big, how long (measured) and the prediction."""

    path: str
    step: int
    bytes: int  # measured: the folder's files
    seconds: float  # measured on rank 0: from entering save to the rename
    predicted: dict[str, Any] = field(default_factory=dict)  # predict_bytes of this model
    write_bytes_per_s: float | None = None  # measured by write_bandwidth in root
    predicted_s: float | None = None  # predicted bytes / that bandwidth: disk time only
    pruned: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Loaded:
    """The checkpoint ``load_latest`` restored: its step, this rank's ``extra``, its manifest."""

    path: str
    step: int
    extra: dict[str, Any]
    manifest: dict[str, Any]
    seconds: float  # measured: choosing, checking and reading it


_BANDWIDTH: dict[str, float] = {}  # root -> measured bytes/s (one probe per root and process)


def _world() -> tuple[int, int]:
    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank(), tdist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if tdist.is_available() and tdist.is_initialized():
        tdist.barrier()


def _from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (a pickled broadcast; the object itself without a group)."""
    if not (tdist.is_available() and tdist.is_initialized()):
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's generator
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@contextlib.contextmanager
def _quiet() -> Any:
    """DCP warns that it "assumes the intent is to save in a single process" even when told
    so (``no_dist=True``): a process without a process group is that, on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def _say(log: Callable[[str], None] | None, text: str) -> None:
    if log is not None and _world()[0] == 0:
        log(f"labkit.checkpoint: {text}")


def save(
    root: Path | str,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    extra: dict[str, Any] | None = None,
    keep: int = 2,
    log: Callable[[str], None] | None = print,
) -> Saved:
    """Write checkpoint ``step`` under ``root``, atomically; keep the newest ``keep``.

    Every rank of the job must call it (DCP's save is collective). ``extra``: this rank's
    picklable values to get back from ``load_latest`` (the data position). Returns what was
    written, the same on every rank.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep={keep!r}: keep at least the newest checkpoint (an integer >= 1)")
    root = Path(root)
    rank, world = _world()
    started = time.perf_counter()
    tmp, final = tmp_dir(root, step), final_dir(root, step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"{_TMP_PREFIX}*"):  # a crashed writer's leftovers
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()  # the folder exists for everyone

    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _quiet():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp),
                 no_dist=not tdist.is_initialized())  # fmt: skip
    own = {"step": step, "rank": rank, "world_size": world, "extra": extra or {},
           "rng": _rng_state()}  # fmt: skip
    with open(tmp / f"rank{rank}.pt", "wb") as f:
        torch.save(own, f)
        f.flush()
        os.fsync(f.fileno())
    _barrier()  # every rank's share is on disk

    info: Saved | str | None = None
    if rank == 0:
        # Every rank wrote under "the same" root; on several machines that holds only on a
        # file system they share. Each node's own disk would leave rank 0 a partial folder.
        missing = [r for r in range(world) if not (tmp / f"rank{r}.pt").is_file()]
        if missing:
            info = (f"checkpoint step {step} is incomplete: the files of rank(s) {missing} are not "
                    f"in {tmp}. Every rank must write under the same root, so on several "
                    "machines the root must be on a file system every node sees (a shared "
                    "one), not each node's own disk; nothing was published")  # fmt: skip
        else:
            info = _publish(root, tmp, final, step, model, optimizer, world, started, keep)
    info = _from_rank0(info)  # also the barrier that makes the checkpoint visible to all
    if isinstance(info, str):
        raise CheckpointError(info)
    assert info is not None
    _say(log, f"saved step {step} to {info.path}: {info.bytes / 1e6:.2f} MB in "
              f"{info.seconds:.3f} s (measured)")  # fmt: skip
    return info


def _publish(root: Path, tmp: Path, final: Path, step: int, model: nn.Module,
             optimizer: torch.optim.Optimizer, world: int, started: float, keep: int) -> Saved:  # fmt: skip
    """Rank 0, once every rank has written: manifest, rename, prune."""
    nbytes = sum(p.stat().st_size for p in tmp.iterdir() if p.is_file())
    seconds = time.perf_counter() - started
    manifest = {
        "format": FORMAT,
        "step": step,
        "world_size": world,
        "optimizer": optimizer_kind(optimizer),
        "signature": signature(model),
        "bytes": nbytes,
        "seconds": seconds,
        "time": time.time(),
        "torch": torch.__version__,
    }
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():  # the same step saved before (a restart went back past it)
        old = root / f"{_TMP_PREFIX}old-{final.name}"
        os.rename(final, old)
        shutil.rmtree(old, ignore_errors=True)
    _rename(tmp, final)
    _fsync_dir(root)  # the rename itself survives a power cut
    seconds = time.perf_counter() - started
    complete, _ = scan(root)
    pruned = []
    for _, folder, _ in complete[:-keep]:
        shutil.rmtree(folder, ignore_errors=True)
        pruned.append(folder.name)

    counts = count(model, optimizer)
    predicted = predict_bytes(
        counts["n_params"],
        n_tensors=counts["n_tensors"],
        aliased_params=counts["aliased_params"],
        n_trainable=counts["n_trainable"],
        weight_dtype=counts["weight_dtype"],
        optimizer=counts["optimizer"],
        state_dtype=counts["state_dtype"],
    )
    key = str(root.resolve())
    if key not in _BANDWIDTH:
        _BANDWIDTH[key] = write_bandwidth(root, max(1 << 20, min(predicted["bytes"], 64 << 20)))
    bw = _BANDWIDTH[key]
    return Saved(path=str(final), step=step, bytes=nbytes, seconds=seconds, predicted=predicted,
                 write_bytes_per_s=bw, predicted_s=predicted["bytes"] / bw, pruned=pruned)  # fmt: skip


def _rename(tmp: Path, final: Path) -> None:
    """The commit point: before it no checkpoint exists, after it a complete one does."""
    os.rename(tmp, final)


def load_latest(
    root: Path | str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    restore_rng: bool = True,
    log: Callable[[str], None] | None = print,
) -> Loaded | None:
    """Load the newest complete checkpoint under ``root`` into ``model`` and ``optimizer``.

    Every rank must call it. Returns None when there is none (partial ones are skipped, and
    the log says so). Raises ``CheckpointMismatch``, on every rank and before any tensor is
    read, when the newest complete one was saved from another model shape, world size or
    optimizer. ``restore_rng``: put back this rank's random-number generators as they were.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    root = Path(root)
    rank, world = _world()
    started = time.perf_counter()
    choice: dict[str, Any] = {}
    if rank == 0:  # one rank chooses, so every rank loads the same checkpoint
        complete, skipped = scan(root)
        for line in skipped:
            _say(log, f"skipped {root / line}")
        if complete:
            step, folder, manifest = complete[-1]
            problems = mismatches(manifest, model, optimizer, world)
            choice = {"step": step, "path": str(folder), "manifest": manifest}
            if problems:
                shown = problems[:MAX_LINES] + (
                    [f"... and {len(problems) - MAX_LINES} more"]
                    if len(problems) > MAX_LINES
                    else []
                )
                choice["error"] = (
                    f"checkpoint {folder} does not fit this job:\n"
                    + "".join(f"  {p}\n" for p in shown)
                    + "Point the job at another checkpoint folder, or delete this one "
                    f"(rm -r {folder}) to start from scratch."
                )
    choice = _from_rank0(choice)
    if "error" in choice:
        raise CheckpointMismatch(choice["error"])
    if not choice:
        _say(log, f"no complete checkpoint in {root}: starting from scratch")
        return None
    folder = Path(choice["path"])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _quiet():
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder),
                 no_dist=not tdist.is_initialized())  # fmt: skip
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    own = torch.load(folder / f"rank{rank}.pt", weights_only=False)
    if restore_rng:
        _set_rng_state(own["rng"])
    _say(log, f"resumed from {folder} (step {choice['step']})")
    return Loaded(path=str(folder), step=int(choice["step"]), extra=own["extra"],
                  manifest=choice["manifest"], seconds=time.perf_counter() - started)  # fmt: skip


# --- resharding on load, and asynchronous saves --------------------------------------------------


def shares(folder: Path | str) -> dict[str, int]:
    """DCP's data files in a checkpoint folder and their bytes: one ``__R_0.distcp`` per rank
    that wrote a share (measured on disk)."""
    return {p.name: p.stat().st_size for p in sorted(Path(folder).glob("*.distcp"))}


def load_resharded(folder: Path | str, model: nn.Module, optimizer: torch.optim.Optimizer,
                   *, log: Callable[[str], None] | None = print) -> dict[str, Any]:  # fmt: skip
    """Load the model and optimizer state of the complete checkpoint ``folder`` into this job,
    whatever number of ranks saved it or runs now: DCP's resharding on load.

    DCP's ``.metadata`` records every tensor's global shape and where each saved piece of it
    lies; ``dcp.load`` asks for the pieces this rank's tensors need (its whole tensor here, its
    own shard under FSDP2) and reads them from whichever rank's file holds them
    (``torch/distributed/checkpoint/default_planner.py``, ``create_default_local_load_plan``).
    What does not reshard is labkit's per-rank file (``rank{r}.pt``: step, data position, random
    state), so this loads none of it and restores no RNG: a job resumed on another number of
    ranks must re-derive those (a global data position, generators seeded from (seed, step,
    rank)). The model's shape and the optimizer must still match (``CheckpointMismatch``).
    Returns the manifest, the files read and the seconds it took (measured).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    folder = Path(folder)
    started = time.perf_counter()
    manifest = read_manifest(folder)
    if manifest is None or not (folder / ".metadata").exists():
        raise CheckpointMismatch(f"{folder} is not a complete checkpoint (no manifest or no "
                                 "DCP index): load only folders that scan() lists")  # fmt: skip
    _, world = _world()
    problems = [p for p in mismatches(manifest, model, optimizer, world)
                if not p.startswith("saved by ")]  # the world size is what may differ  # fmt: skip
    if problems:
        raise CheckpointMismatch(f"checkpoint {folder} does not fit this job:\n"
                                 + "".join(f"  {p}\n" for p in problems[:MAX_LINES]))  # fmt: skip
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _quiet():
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder),
                 no_dist=not tdist.is_initialized())  # fmt: skip
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    seconds = time.perf_counter() - started
    _say(log, f"loaded {folder} (saved by {manifest.get('world_size')} ranks) into {world} "
              f"rank(s) in {seconds:.3f} s (measured)")  # fmt: skip
    return {"manifest": manifest, "files": shares(folder), "saved_by": manifest.get("world_size"),
            "loaded_by": world, "seconds": seconds}  # fmt: skip


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

    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r}: give a whole number of rounds >= 1")
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
        with _quiet():
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
