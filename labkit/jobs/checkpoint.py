"""Checkpoints that survive a crash: written atomically, loaded only when complete.

    from labkit.jobs import checkpoint
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
                            shapes and dtypes, every other file's bytes, seconds
    .tmp-step000000014/     a checkpoint being written (or one whose writer died)
    .replaced-step000000012/  the old step 12 while a save replaces it (a restart that went
                            back past it); removed once the new one is in place

Atomic: every rank writes into the temporary folder; after a barrier (every rank done), rank 0
writes the manifest and renames the folder to its final name, one ``rename``, which POSIX
makes atomic. A reader therefore sees a whole checkpoint or none, and a job killed at any
moment leaves at worst a ``.tmp-`` folder that is never loaded. Replacing a step renames the
old folder aside first and removes it only after the new one is in place, so a crash between
the two leaves the old one, which the next ``load_latest`` or ``save`` puts back. All ranks
must see the same ``root``: on several machines, a shared file system.

Damage is named, never loaded and never fatal while an older checkpoint is whole: a checkpoint
whose files are cut short (the manifest records their sizes), whose manifest holds odd fields,
or that torch cannot read is skipped with a ``CheckpointWarning`` for the previous complete one.
A save that fails (a full disk) raises one ``CheckpointError`` on every rank, removes its
temporary folder and leaves the previous checkpoints as they were.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import shlex
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from labkit import formulas, validate
from labkit.errors import LabkitError
from labkit.validate import whole

MANIFEST = "manifest.json"
MAX_LINES = 8  # differences named in a CheckpointMismatch; the rest are counted
FORMAT = 1  # bumped when the layout changes; another format is a mismatch, not a crash
MAX_STEP = 10**9 - 1  # the largest step a folder name holds: "step" + 9 digits
_STEP_WHY = ("a checkpoint's folder is named step + 9 digits, which is how load_latest finds it "
             "again; pass the number of optimizer steps done so far, step + 1 in a loop over "
             "range(steps)")  # fmt: skip
_FINAL = re.compile(r"^step(\d{9})$")
_TMP_PREFIX = ".tmp-"
_ASIDE_PREFIX = ".replaced-"  # an existing step's folder while a save replaces it
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_NEARLY_FULL_BYTES = 1 << 20  # less free than this after a failed write: the disk is full

METADATA_BYTES_PER_TENSOR = 300
"""Modelled: DCP's ``.metadata`` holds, per tensor, its name, shape, dtype and where its bytes
are; pickled, about 270 B a tensor for labkit's GPT under torch 2.13 (38,621 B for 145)."""


class CheckpointError(RuntimeError, LabkitError):
    """A checkpoint could not be saved (nothing was published, its temporary folder is gone) or
    none of the complete ones could be loaded (each damaged one is named). Raised on every rank;
    an ``Exception``, unlike torch's ``CheckpointException``."""


class CheckpointMismatch(ValueError, LabkitError):
    """A complete checkpoint that this job cannot load: another model shape, world size,
    optimizer or format. Raised before torch reads any tensor; the message names what differs
    and the way out."""


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped for an older complete one; the message names the folder
    and the damage."""


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


def _is_count(x: Any, least: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= least


def _is_signature(x: Any) -> bool:
    return isinstance(x, list) and all(
        isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and isinstance(e[2], str)
        and isinstance(e[1], list) and all(_is_count(d) for d in e[1])
        for e in x
    )  # fmt: skip


def _is_sizes(x: Any) -> bool:
    return isinstance(x, dict) and all(isinstance(k, str) and _is_count(v) for k, v in x.items())


def _is_step(x: Any) -> bool:
    return _is_count(x) and x <= MAX_STEP


# field: (accepts it, what it must be, required). "files" came later: older manifests lack it.
_FIELDS: dict[str, tuple[Callable[[Any], bool], str, bool]] = {
    "step": (_is_step, f"a whole number from 0 to {MAX_STEP:,}", True),
    "world_size": (lambda v: _is_count(v, 1), "a whole number >= 1", True),
    "optimizer": (lambda v: isinstance(v, str), "a name such as 'adamw'", True),
    "signature": (_is_signature, "a list of [name, shape, dtype]", True),
    "files": (_is_sizes, "a map of file name to bytes", False),
}


def _manifest_problem(manifest: dict[str, Any]) -> str | None:
    """Why ``manifest`` cannot be trusted (a field missing or of the wrong type), or None.
    A manifest of another format is left to ``mismatches``, which names the format."""
    fmt = manifest.get("format")
    if not _is_count(fmt):
        return f"{MANIFEST} field 'format' is {_typed(fmt)}, expected a whole number"
    if fmt != FORMAT:
        return None
    for key, (ok, expected, required) in _FIELDS.items():
        if key not in manifest:
            if required:
                return f"{MANIFEST} field {key!r} is missing"
        elif not ok(manifest[key]):
            return f"{MANIFEST} field {key!r} is {_typed(manifest[key])}, expected {expected}"
    return None


def _typed(value: Any) -> str:
    """A manifest's value and its type: "'1' (str)" where a number belongs."""
    return f"{validate.shown(value)} ({type(value).__name__})"


def _sizes_problem(folder: Path, sizes: dict[str, int]) -> str | None:
    """Which file of a published checkpoint differs from the size its manifest recorded."""
    for name, recorded in sizes.items():
        try:
            actual = (folder / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual < recorded:
            return f"{name} is truncated: {actual:,} of {recorded:,} bytes"
        if actual != recorded:
            return f"{name} has {actual:,} bytes, its manifest recorded {recorded:,}"
    return None


def _examine(folder: Path, step: int) -> tuple[str, Any]:
    """("complete", manifest), ("partial", why) for a folder its writer never finished, or
    ("damaged", why) for a published one that cannot be trusted."""
    manifest = read_manifest(folder)
    if manifest is None:
        return "partial", "torn manifest" if (folder / MANIFEST).exists() else "no manifest"
    problem = _manifest_problem(manifest)
    if problem:
        return "damaged", problem
    if manifest.get("format") == FORMAT and manifest["step"] != step:
        return "damaged", (f"{MANIFEST} field 'step' is {manifest['step']}, but the folder is "
                           f"named for step {step}")  # fmt: skip
    world = manifest.get("world_size")
    missing = [f"rank{r}.pt" for r in range(world if _is_count(world) else 0)
               if not (folder / f"rank{r}.pt").exists()]  # fmt: skip
    if not (folder / ".metadata").exists():
        missing.insert(0, ".metadata")
    if missing:
        return "partial", f"missing {', '.join(missing)}"
    if isinstance(manifest.get("files"), dict):
        problem = _sizes_problem(folder, manifest["files"])
        if problem:
            return "damaged", problem
    return "complete", manifest


@dataclass
class _Survey:
    """What ``root`` holds: complete checkpoints (step, folder, manifest), oldest first; a line
    for each folder that is not one (partial: its writer never finished); (folder, why) for
    each published one that is damaged."""

    complete: list[tuple[int, Path, dict]] = field(default_factory=list)
    partial: list[str] = field(default_factory=list)
    damaged: list[tuple[Path, str]] = field(default_factory=list)


def _survey(root: Path) -> _Survey:
    out = _Survey()
    if not root.is_dir():
        return out
    for d in sorted(root.iterdir()):
        if not d.is_dir():
            continue
        if d.name.startswith(_TMP_PREFIX):
            out.partial.append(f"{d.name}: partial (its writer never finished: no rename)")
            continue
        aside = d.name.startswith(_ASIDE_PREFIX)
        m = _FINAL.match(d.name.removeprefix(_ASIDE_PREFIX))
        if not m:
            continue
        if aside and (root / m.group(0)).is_dir():
            out.partial.append(f"{d.name}: the old {m.group(0)}, replaced by a save that was "
                               "interrupted before removing it (the next save removes it)")  # fmt: skip
            continue
        kind, what = _examine(d, int(m.group(1)))
        if kind == "partial":
            out.partial.append(f"{d.name}: partial ({what})")
        elif kind == "damaged":
            out.damaged.append((d, what))
        else:
            out.complete.append((int(m.group(1)), d, what))
    out.complete.sort(key=lambda t: t[0])
    return out


def scan(root: Path | str) -> tuple[list[tuple[int, Path, dict]], list[str]]:
    """(complete checkpoints as (step, folder, manifest), oldest first; why each other folder
    under ``root`` is not one). Complete: a final name, a manifest whose fields are well formed
    and name the same step, DCP's index, a file for each rank, and each file of the size the
    manifest recorded. A step's old folder left by an interrupted replace counts as that step
    while the step's own folder is missing."""
    found = _survey(Path(root))
    return found.complete, found.partial + [f"{d.name}: damaged ({why})" for d, why in found.damaged]


def mismatches(manifest: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
               world_size: int) -> list[str]:  # fmt: skip
    """What differs between a checkpoint's manifest and this job, one line each ([] if none)."""
    out = []
    if manifest.get("format") != FORMAT:
        out.append(f"checkpoint format {manifest.get('format')!r}, this labkit reads {FORMAT}")
        return out
    problem = _manifest_problem(manifest)
    if problem:
        return [problem]
    if manifest["world_size"] != world_size:
        out.append(f"saved by {manifest['world_size']} ranks, this job has {world_size}")
    if manifest["optimizer"] != optimizer_kind(optimizer):
        out.append(f"saved with optimizer {manifest['optimizer']}, this job uses "
                   f"{optimizer_kind(optimizer)}")  # fmt: skip
    saved = {name: (tuple(shape), dtype) for name, shape, dtype in manifest["signature"]}
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
    write_bytes_per_s: float | None = None  # measured by write_bandwidth in root; None: see notes
    predicted_s: float | None = None  # predicted bytes / that bandwidth: disk time only
    pruned: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what was not measured, and why

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


def _from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (a pickled broadcast; the object itself without a group)."""
    if not (tdist.is_available() and tdist.is_initialized()):
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def _from_all(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank: how the ranks agree that a step worked
    everywhere (also a barrier). A failure on one rank alone would otherwise leave the others
    waiting in the next collective until its timeout."""
    if not (tdist.is_available() and tdist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, obj)
    return out


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


_DCP_FALLBACK_LOGS = ("Global metadata is not found", "Rank local metadata is not found")


def _not_a_metadata_fallback(record: Any) -> bool:
    return not str(record.msg).startswith(_DCP_FALLBACK_LOGS)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it "assumes the intent is to save in a single process" even when told
    so (``no_dist=True``): a process without a process group is that, on purpose. Its loader
    also logs two tracebacks on the root logger when it cannot read ``.metadata``
    (``state_dict_loader.py``, ``local_step``); labkit names that damage itself."""
    import logging

    root_log = logging.getLogger()
    root_log.addFilter(_not_a_metadata_fallback)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
            yield
    finally:
        root_log.removeFilter(_not_a_metadata_fallback)


def _say(log: Callable[[str], None] | None, text: str) -> None:
    if log is not None and _world()[0] == 0:
        log(f"labkit.jobs.checkpoint: {text}")


def _first_line(exc: BaseException) -> str:
    """``Type: first sentence`` of an error, for a one-line message. torch's C++ checks start
    "[enforce fail at inline_container.cc:672] . unexpected pos ...", and its weights-only
    loader follows its first sentence with advice that does not apply here."""
    text = str(exc).strip().splitlines()
    line = re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", text[0]) if text else ""
    line = line.split(". ")[0]
    line = line if len(line) <= 160 else line[:157] + "..."
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what it was raised from or during: inside ``torch.save``'s zip writer an
    ENOSPC from ``write`` becomes "unexpected pos ... vs ..." with the OSError as its context."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _is_disk_full(exc: BaseException) -> bool:
    return any(isinstance(e, OSError) and e.errno in _DISK_FULL for e in _causes(exc))


def _free_bytes(path: Path) -> int | None:
    for p in (path, *path.parents):
        with contextlib.suppress(OSError):
            return shutil.disk_usage(p).free
    return None


# --- saving: three steps, each agreed by every rank --------------------------------------------


class _NotingFileSystem:
    """torch's local file system for DCP's writer, noting every OSError a write raises. DCP
    passes a rank's failure to the others as a pickled copy without its cause, and inside
    ``torch.save`` an ENOSPC turns into "unexpected pos": this keeps the ENOSPC on its rank."""

    def __init__(self) -> None:
        from torch.distributed.checkpoint.filesystem import FileSystem

        self._fs = FileSystem()
        self.errors: list[OSError] = []

    def __getattr__(self, name: str) -> Any:  # everything else as torch's own
        return getattr(self._fs, name)

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        try:
            with self._fs.create_stream(path, mode) as stream:
                write = stream.write

                def noted_write(data: Any) -> Any:
                    try:
                        return write(data)
                    except OSError as e:
                        self.errors.append(e)
                        raise

                stream.write = noted_write
                yield stream
        except OSError as e:  # fsync and close meet a full disk too
            self.errors.append(e)
            raise


def _fault(rank: int, exc: BaseException, also: list[OSError] | None = None) -> dict[str, Any]:
    """What went wrong on this rank, as plain data every rank can be sent."""
    full = _is_disk_full(exc) or any(_is_disk_full(e) for e in also or [])
    return {"rank": rank, "error": _first_line(exc), "full": full}


def _save_failed(root: Path, tmp: Path, step: int, faults: list[dict[str, Any]]) -> str:
    """The one message every rank raises when checkpoint ``step`` could not be written."""
    many = _world()[1] > 1  # name the ranks only where there are several
    ranks = sorted({f["rank"] for f in faults})
    who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}, " if many else ""
    free = _free_bytes(root)
    full = any(f["full"] for f in faults) or (free is not None and free < _NEARLY_FULL_BYTES)
    complete = _survey(root).complete
    kept = (f"the newest complete checkpoint, {complete[-1][1]}, is untouched" if complete
            else "there is no earlier complete checkpoint")  # fmt: skip
    done = f"Nothing was published and its temporary folder was removed; {kept}."
    if full:
        room = f"{free / 2**20:.1f} MiB free" if free is not None else "free space unknown"
        return (f"no space left on the disk holding {root}: checkpoint step {step} could not be "
                f"written ({who}{room}). {done} Free space on that disk (other files there, or "
                "hold fewer checkpoints with keep=1), or save to a folder on a disk with room.")  # fmt: skip
    errors = "; ".join((f"rank {f['rank']}: " if many else "") + f["error"] for f in faults)
    fix = next((f["fix"] for f in faults if f.get("fix")),
               "Check that the folder is writable and its disk healthy, then save again.")  # fmt: skip
    return f"checkpoint step {step} could not be written to {tmp} ({errors}). {done} {fix}"


def _write_own(path: Path, own: dict[str, Any]) -> None:
    """This rank's file: step, extra, RNG states, on disk before the manifest names it."""
    with open(path, "wb") as f:
        torch.save(own, f)
        f.flush()
        os.fsync(f.fileno())


def _recover(root: Path) -> list[str]:
    """Finish what a save interrupted while replacing a step left (rank 0): put the old folder
    back where the new one never arrived, remove it where the new one did. One line each."""
    notes = []
    for aside in sorted(root.glob(f"{_ASIDE_PREFIX}step*")):
        final = root / aside.name.removeprefix(_ASIDE_PREFIX)
        if not (aside.is_dir() and _FINAL.match(final.name)):
            continue
        if final.is_dir():
            shutil.rmtree(aside, ignore_errors=True)
            notes.append(f"removed {aside.name}: the old {final.name}, replaced by a save that "
                         "was interrupted before removing it")  # fmt: skip
        elif _put_back(aside, final):
            notes.append(f"put {final.name} back from {aside.name}: a save was interrupted "
                         "while replacing it")  # fmt: skip
    return notes


def _put_back(aside: Path, final: Path) -> bool:
    try:
        os.rename(aside, final)
    except OSError:  # a read-only folder: scan still finds the old step in its aside name
        return False
    _fsync_dir(final.parent)
    return True


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

    Every rank of the job must call it (DCP's save is collective). ``step``: a whole number
    from 0 to ``MAX_STEP``. ``extra``: this rank's picklable values to get back from
    ``load_latest`` (the data position). Returns what was written, the same on every rank.
    Raises ``CheckpointError`` on every rank if any rank could not write its share (a full
    disk is named as such); then nothing is published, the temporary folder is removed and the
    previous checkpoints are untouched. What is no failed write goes up as it is: an interrupt
    stays a ``KeyboardInterrupt``, and an error torch raises outside its writers (a process
    group that broke under it) keeps its type and message.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    step = whole("step", step, low=0, high=MAX_STEP, why=_STEP_WHY)
    keep = whole("keep", keep, low=1, why="keep at least the newest checkpoint")
    root = Path(root)
    rank, world = _world()
    started = time.perf_counter()
    tmp, final = tmp_dir(root, step), final_dir(root, step)

    # 1. Rank 0 makes the temporary folder; every rank learns whether it could.
    faults: list[dict[str, Any]] = []
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for note in _recover(root):
                _say(log, note)
            for stale in root.glob(f"{_TMP_PREFIX}*"):  # a crashed writer's leftovers
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        except OSError as e:
            faults.append(_fault(rank, e))
    _raise_if_failed(root, tmp, step, faults)

    # 2. Every rank writes its share and its own file; every rank learns whether all could.
    model_sd, optim_sd = get_state_dict(model, optimizer)
    fs = _NotingFileSystem()
    writer = dcp.FileSystemWriter(str(tmp))
    writer.fs = fs  # type: ignore[assignment]  # torch's FileSystem, noting write errors
    faults = []
    own = {"step": step, "rank": rank, "world_size": world, "extra": extra or {},
           "rng": _rng_state()}  # fmt: skip
    # Any other error of dcp.save's (a process group that broke under it) goes up as it is:
    # it is no failed write, and another collective on a broken group would only hang.
    try:
        with _quiet():
            dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=writer,
                     no_dist=not tdist.is_initialized())  # fmt: skip
    except CheckpointException as e:  # DCP's collective failure: every rank has the same
        _raise_if_not_a_write_error(e, tmp)
        mine = e.failures.get(rank)
        if mine is not None:
            faults.append(_fault(rank, mine[0], fs.errors))
    else:
        faults = _own_file_faults(tmp / f"rank{rank}.pt", own, rank)
    _raise_if_failed(root, tmp, step, faults)

    # 3. Rank 0 publishes: manifest, rename, prune.
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
            try:
                info = _publish(root, tmp, final, step, model, optimizer, world, started, keep)
            except OSError as e:  # writing the manifest on a full disk
                info = _save_failed(root, tmp, step, [_fault(rank, e)])
                shutil.rmtree(tmp, ignore_errors=True)
    info = _from_rank0(info)  # also the barrier that makes the checkpoint visible to all
    if isinstance(info, str):
        raise CheckpointError(info)
    assert info is not None
    _say(log, f"saved step {step} to {info.path}: {info.bytes / 1e6:.2f} MB in "
              f"{info.seconds:.3f} s (measured)")  # fmt: skip
    for note in info.notes:
        _say(log, note)
    return info


def _own_file_faults(path: Path, own: dict[str, Any], rank: int) -> list[dict[str, Any]]:
    """Write this rank's own file; what went wrong, as :func:`_fault`s ([] if nothing)."""
    try:
        _write_own(path, own)
    except OSError as e:  # a full disk
        return [_fault(rank, e)]
    except Exception as e:  # an extra that does not pickle
        return [{**_fault(rank, e), "fix": "Pass an extra of plain values (numbers, strings, "
                 f"lists, dicts, tensors): it is pickled into {path.name}."}]  # fmt: skip
    return []


def _raise_if_not_a_write_error(e: BaseException, tmp: Path) -> None:
    """Raise, as it is, an interrupt (or a SystemExit, or too little memory) that DCP caught
    on any rank: it is no failed write, as :func:`load_latest` does not take one for damage.
    Every rank has the same failures, so every rank raises it; rank 0 first removes the
    temporary folder (no rank writes to it any more: DCP's failure was collective)."""
    for exc, _ in getattr(e, "failures", {}).values():
        if not isinstance(exc, Exception) or isinstance(exc, MemoryError | torch.OutOfMemoryError):
            if _world()[0] == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise exc from None  # not chained to DCP's wrapper: its text repeats the trace


def _raise_if_failed(root: Path, tmp: Path, step: int, faults: list[dict[str, Any]]) -> None:
    """Gather every rank's faults (a barrier); if any, rank 0 removes the temporary folder and
    every rank raises the same ``CheckpointError``."""
    everyone = [f for per_rank in _from_all(faults) for f in per_rank]
    if not everyone:
        return
    message = _save_failed(root, tmp, step, everyone)  # before the folder goes: its free space
    if _world()[0] == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    raise CheckpointError(message)


def _publish(root: Path, tmp: Path, final: Path, step: int, model: nn.Module,
             optimizer: torch.optim.Optimizer, world: int, started: float, keep: int) -> Saved:  # fmt: skip
    """Rank 0, once every rank has written: manifest, rename, prune."""
    sizes = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    nbytes = sum(sizes.values())
    seconds = time.perf_counter() - started
    manifest = {
        "format": FORMAT,
        "step": step,
        "world_size": world,
        "optimizer": optimizer_kind(optimizer),
        "signature": signature(model),
        "files": sizes,  # what load_latest checks: a file cut short is damage, found early
        "bytes": nbytes,
        "seconds": seconds,
        "time": time.time(),
        "torch": torch.__version__,
    }
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    _install(root, tmp, final)
    seconds = time.perf_counter() - started
    complete = _survey(root).complete
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
    bw, note = _write_speed(root, max(1 << 20, min(predicted["bytes"], 64 << 20)))
    return Saved(path=str(final), step=step, bytes=nbytes, seconds=seconds, predicted=predicted,
                 write_bytes_per_s=bw, predicted_s=predicted["bytes"] / bw if bw else None,
                 pruned=pruned, notes=[note] if note else [])  # fmt: skip


def _install(root: Path, tmp: Path, final: Path) -> None:
    """Put the finished ``tmp`` at ``final``. Where ``final`` exists (a restart went back past
    that step), the old one is renamed aside first and removed only after the new one is in
    place: at every moment one complete copy of the step is on disk under a name that
    ``_recover`` and ``scan`` know."""
    aside = final.with_name(_ASIDE_PREFIX + final.name)
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)  # an older leftover; final is the newer copy
        os.rename(final, aside)
    try:
        _rename(tmp, final)
    except OSError:
        if aside.exists():
            _put_back(aside, final)
        raise
    _fsync_dir(root)  # the rename itself survives a power cut
    if aside.exists():
        _discard(aside)


def _rename(tmp: Path, final: Path) -> None:
    """The commit point: before it no checkpoint exists, after it a complete one does."""
    os.rename(tmp, final)


def _discard(aside: Path) -> None:
    """Remove a step's old copy, once its new one is in place."""
    shutil.rmtree(aside, ignore_errors=True)


def _write_speed(root: Path, nbytes: int) -> tuple[float | None, str | None]:
    """(bytes/s of this disk, None), measured once per root; or (None, why not). Never fails a
    save: the checkpoint is published before this runs. A disk with too little room is not
    probed at all (filling a shared disk to the brim, even for a moment, fails others' writes)."""
    key = str(root.resolve())
    if key in _BANDWIDTH:
        return _BANDWIDTH[key], None
    free = _free_bytes(root)
    if free is not None and free < 2 * nbytes:
        return None, (f"write speed not measured: {free / 2**20:.1f} MiB free on the disk holding "
                      f"{root}, too little for a {nbytes / 2**20:.0f} MiB probe (the checkpoint "
                      "itself is saved)")  # fmt: skip
    try:
        _BANDWIDTH[key] = write_bandwidth(root, nbytes)
    except OSError as e:
        return None, (f"write speed not measured: the probe could not write in {root} "
                      f"({e.strerror or e}); the checkpoint itself is saved")  # fmt: skip
    return _BANDWIDTH[key], None


# --- loading: the newest checkpoint that reads whole ---------------------------------------------


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
    the log says so). A damaged one (a file cut short or unreadable, a manifest with odd
    fields) is skipped with a ``CheckpointWarning`` for the previous complete one; if every
    complete one is damaged, ``CheckpointError`` names each and the fix. Raises
    ``CheckpointMismatch``, on every rank and before any tensor is read, when the checkpoint
    to load was saved from another model shape, world size or optimizer. ``restore_rng``: put
    back this rank's random-number generators as they were.
    """
    root = Path(root)
    rank, _ = _world()
    started = time.perf_counter()
    plan: dict[str, Any] = {}
    if rank == 0:  # one rank chooses, so every rank tries the same checkpoints in one order
        plan = _plan_load(root, model, optimizer, log)
    plan = _from_rank0(plan)
    damaged: list[tuple[str, str]] = list(plan["damaged"])
    read_some = False  # torch wrote part of a damaged checkpoint into the model
    for choice in plan["candidates"]:  # newest first
        if "error" in choice:
            raise CheckpointMismatch(choice["error"])
        folder = Path(choice["path"])
        own, why, touched = _load_one(folder, choice["step"], model, optimizer)
        read_some |= touched
        if own is None:
            _warn_damaged(folder, why)
            damaged.append((str(folder), why))
            continue
        if restore_rng:
            _set_rng_state(own["rng"])
        _say(log, f"resumed from {folder} (step {choice['step']})")
        return Loaded(path=str(folder), step=int(choice["step"]), extra=own["extra"],
                      manifest=choice["manifest"], seconds=time.perf_counter() - started)  # fmt: skip
    if damaged:
        raise CheckpointError(_all_damaged(root, damaged, read_some))
    _say(log, f"no complete checkpoint in {root}: starting from scratch")
    return None


def _plan_load(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
               log: Callable[[str], None] | None) -> dict[str, Any]:  # fmt: skip
    """Rank 0: the complete checkpoints to try, newest first, up to the first that does not
    fit this job (it carries the error); the damaged ones the scan found, each warned about."""
    if root.is_dir():
        for note in _recover(root):
            _say(log, note)
    found = _survey(root)
    for line in found.partial:
        _say(log, f"skipped {root / line}")
    for folder, why in found.damaged:
        _warn_damaged(folder, why, stacklevel=4)
    _, world = _world()
    candidates = []
    for step, folder, manifest in reversed(found.complete):
        candidates.append({"step": step, "path": str(folder), "manifest": manifest})
        problems = mismatches(manifest, model, optimizer, world)
        if problems:
            shown = problems[:MAX_LINES] + (
                [f"... and {len(problems) - MAX_LINES} more"] if len(problems) > MAX_LINES else []
            )
            candidates[-1]["error"] = (
                f"checkpoint {folder} does not fit this job:\n"
                + "".join(f"  {p}\n" for p in shown)
                + "Point the job at another checkpoint folder, or delete this one "
                f"(rm -r {shlex.quote(str(folder))}) to start from scratch."
            )
            break
    return {"candidates": candidates, "damaged": [(str(f), why) for f, why in found.damaged]}


def _load_one(folder: Path, step: int, model: nn.Module,
              optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any] | None, str, bool]:  # fmt: skip
    """Read checkpoint ``folder`` into ``model`` and ``optimizer`` on every rank: (this rank's
    own state, "", True), or (None, why it is damaged, whether torch wrote part of it into the
    model). The ranks agree: one rank's unreadable file fails the checkpoint for all."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank, _ = _world()
    own, why = _read_own(folder, rank, step)
    problems = [p for p in _from_all(why) if p]  # read before any tensor is touched
    if problems:
        return None, "; ".join(problems), False
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        with _quiet():
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder),
                     no_dist=not tdist.is_initialized())  # fmt: skip
    except CheckpointException as e:  # collective: every rank has it
        return None, _unreadable(folder, e), True
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return own, "", True


def _read_own(folder: Path, rank: int, step: int) -> tuple[dict[str, Any] | None, str | None]:
    """This rank's file of checkpoint ``folder``, or why it cannot be used."""
    name = f"rank{rank}.pt"
    try:
        own = torch.load(folder / name, weights_only=False)
    except MemoryError:
        raise
    except Exception as e:  # a pickle cut short or overwritten: damage
        return None, f"{name} cannot be read ({_first_line(e)})"
    if not (isinstance(own, dict) and {"step", "extra", "rng"} <= own.keys()):
        return None, f"{name} holds no labkit rank state"
    if own["step"] != step:
        return None, f"{name} is from step {own['step']!r}, not {step}"
    return own, None


def _unreadable(folder: Path, e: BaseException) -> str:
    """Why torch could not read ``folder``'s data, naming the file where it can be told."""
    failures = getattr(e, "failures", {})
    for _, (exc, _) in failures.items():
        if not isinstance(exc, Exception) or isinstance(exc, MemoryError | torch.OutOfMemoryError):
            raise exc  # not damage: an interrupt, or too little memory to load it
    errors = "; ".join(f"rank {r}: {_first_line(exc)}" for r, (exc, _) in sorted(failures.items()))
    culprit = _truncated_share(folder)
    if culprit:
        return f"{culprit} (torch: {errors})"
    names = sorted(shares(folder)) or ["its data files"]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"torch could not read {shown}: {errors}"


def _truncated_share(folder: Path) -> str | None:
    """The first ``.distcp`` file shorter than DCP's index says it is, or None."""
    from torch.distributed.checkpoint import FileSystemReader

    ends: dict[str, int] = {}  # file -> where its last tensor ends
    try:
        index = FileSystemReader(str(folder)).read_metadata()
        for info in (index.storage_data or {}).values():
            end = info.offset + info.length
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), end)
    except Exception as e:  # the index itself is damaged
        return f".metadata cannot be read ({_first_line(e)})"
    for name, end in sorted(ends.items()):
        try:
            size = (folder / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if size < end:
            return f"{name} is truncated: {size:,} bytes, its tensors reach byte {end:,}"
    return None


def _warn_damaged(folder: Path | str, why: str, stacklevel: int = 3) -> None:
    """Rank 0 warns; ``stacklevel`` counts the frames up to load_latest's caller (1: here)."""
    if _world()[0] == 0:
        warnings.warn(f"checkpoint {folder} is damaged and was skipped: {why}. Trying the "
                      "previous complete checkpoint; delete this one once you have looked at it "
                      f"(rm -r {shlex.quote(str(folder))}).", CheckpointWarning, stacklevel=stacklevel)  # fmt: skip


def _all_damaged(root: Path, damaged: list[tuple[str, str]], read_some: bool) -> str:
    folders = [folder for folder, _ in sorted(damaged, reverse=True)]  # newest first
    lines = "".join(f"  {folder}: {why}\n" for folder, why in sorted(damaged, reverse=True))
    touched = (" torch had read part of one into the model and optimizer: build them afresh "
               "before training." if read_some else "")  # fmt: skip
    return (f"no checkpoint under {root} can be loaded; every complete one is damaged:\n{lines}"
            f"Nothing was loaded.{touched} Restore an intact copy into {root}, or delete the "
            f"damaged ones to start from scratch (rm -r {' '.join(map(shlex.quote, folders))}).")


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
    rank)). The model's shape and the optimizer must still match (``CheckpointMismatch``); a
    damaged checkpoint raises ``CheckpointError``, naming the damage. Returns the manifest, the files read and the seconds it took (measured).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    folder = Path(folder)
    started = time.perf_counter()
    manifest = read_manifest(folder)
    if manifest is None or not (folder / ".metadata").exists():
        raise CheckpointMismatch(f"{folder} is not a complete checkpoint (no manifest or no "
                                 "DCP index): load only folders that scan() lists")  # fmt: skip
    damage = _manifest_problem(manifest)
    if damage is None and isinstance(manifest.get("files"), dict):
        damage = _sizes_problem(folder, manifest["files"])
    if damage:
        raise CheckpointError(f"checkpoint {folder} is damaged: {damage}. Load another one "
                              "(scan() lists the complete ones), or delete this one "
                              f"(rm -r {shlex.quote(str(folder))}).")  # fmt: skip
    _, world = _world()
    problems = [p for p in mismatches(manifest, model, optimizer, world)
                if not p.startswith("saved by ")]  # the world size is what may differ  # fmt: skip
    if problems:
        raise CheckpointMismatch(f"checkpoint {folder} does not fit this job:\n"
                                 + "".join(f"  {p}\n" for p in problems[:MAX_LINES]))  # fmt: skip
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        with _quiet():
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder),
                     no_dist=not tdist.is_initialized())  # fmt: skip
    except CheckpointException as e:  # a BaseException: never let it reach a notebook
        raise CheckpointError(f"checkpoint {folder} is damaged: {_unreadable(folder, e)}. The "
                              "model and optimizer may hold part of it: build them afresh, and "
                              "load another checkpoint (scan() lists the complete ones).") from None
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
