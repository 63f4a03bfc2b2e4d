"""The checkpoints on disk: their layout, which folders hold one that can be trusted, and the
errors that refuse the rest.

A folder is loaded only when it is complete (final name, manifest, DCP's index, a file per
rank) and sound: its manifest's fields well formed, its files of the sizes the manifest
recorded, torch able to read them. Anything else is partial (its writer never finished) or
damaged, and named as such, never loaded; a complete one saved by another model, world size or
optimizer is a :class:`CheckpointMismatch`, named before any tensor is read. Saving
(:mod:`labkit.jobs.checkpoint.saving`) and loading (:mod:`labkit.jobs.checkpoint.loading`) both
survey a root this way, and both finish what an interrupted replace left (:func:`recover`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from labkit import validate
from labkit.errors import LabkitError
from labkit.jobs.checkpoint.costs import optimizer_kind, signature

MANIFEST = "manifest.json"
FORMAT = 1  # bumped when the layout changes; another format is a mismatch, not a crash
MAX_STEP = 10**9 - 1  # the largest step a folder name holds: "step" + 9 digits
FINAL_NAME = re.compile(r"^step(\d{9})$")  # a published checkpoint's folder
TMP_PREFIX = ".tmp-"  # a checkpoint being written, or one whose writer died
ASIDE_PREFIX = ".replaced-"  # an existing step's folder while a save replaces it


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


# --- the layout --------------------------------------------------------------------------------


def final_dir(root: Path | str, step: int) -> Path:
    return Path(root) / f"step{step:09d}"


def tmp_dir(root: Path | str, step: int) -> Path:
    return Path(root) / f"{TMP_PREFIX}step{step:09d}"


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


def manifest_problem(manifest: dict[str, Any]) -> str | None:
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


def sizes_problem(folder: Path, sizes: dict[str, int]) -> str | None:
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
    problem = manifest_problem(manifest)
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
        problem = sizes_problem(folder, manifest["files"])
        if problem:
            return "damaged", problem
    return "complete", manifest


@dataclass
class Survey:
    """What ``root`` holds: complete checkpoints (step, folder, manifest), oldest first; a line
    for each folder that is not one (partial: its writer never finished); (folder, why) for
    each published one that is damaged."""

    complete: list[tuple[int, Path, dict]] = field(default_factory=list)
    partial: list[str] = field(default_factory=list)
    damaged: list[tuple[Path, str]] = field(default_factory=list)


def survey(root: Path) -> Survey:
    """Every folder under ``root`` sorted into complete, partial and damaged (see :func:`scan`)."""
    out = Survey()
    if not root.is_dir():
        return out
    for d in sorted(root.iterdir()):
        if not d.is_dir():
            continue
        if d.name.startswith(TMP_PREFIX):
            out.partial.append(f"{d.name}: partial (its writer never finished: no rename)")
            continue
        aside = d.name.startswith(ASIDE_PREFIX)
        m = FINAL_NAME.match(d.name.removeprefix(ASIDE_PREFIX))
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
    found = survey(Path(root))
    return found.complete, found.partial + [f"{d.name}: damaged ({why})" for d, why in found.damaged]


def mismatches(manifest: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
               world_size: int) -> list[str]:  # fmt: skip
    """What differs between a checkpoint's manifest and this job, one line each ([] if none)."""
    out = []
    if manifest.get("format") != FORMAT:
        out.append(f"checkpoint format {manifest.get('format')!r}, this labkit reads {FORMAT}")
        return out
    problem = manifest_problem(manifest)
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

# --- an interrupted replace, finished ----------------------------------------------------------


def fsync_dir(path: Path) -> None:
    """Make a rename or removal in ``path`` survive a power cut (best effort)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def recover(root: Path) -> list[str]:
    """Finish what a save interrupted while replacing a step left (rank 0): put the old folder
    back where the new one never arrived, remove it where the new one did. One line each."""
    notes = []
    for aside in sorted(root.glob(f"{ASIDE_PREFIX}step*")):
        final = root / aside.name.removeprefix(ASIDE_PREFIX)
        if not (aside.is_dir() and FINAL_NAME.match(final.name)):
            continue
        if final.is_dir():
            shutil.rmtree(aside, ignore_errors=True)
            notes.append(f"removed {aside.name}: the old {final.name}, replaced by a save that "
                         "was interrupted before removing it")  # fmt: skip
        elif put_back(aside, final):
            notes.append(f"put {final.name} back from {aside.name}: a save was interrupted "
                         "while replacing it")  # fmt: skip
    return notes


def put_back(aside: Path, final: Path) -> bool:
    """Rename a step's old copy back to its own name; False where the folder is read-only."""
    try:
        os.rename(aside, final)
    except OSError:  # a read-only folder: scan still finds the old step in its aside name
        return False
    fsync_dir(final.parent)
    return True


# --- what torch could not read -----------------------------------------------------------------


def first_line(exc: BaseException) -> str:
    """``Type: first sentence`` of an error, for a one-line message. torch's C++ checks start
    "[enforce fail at inline_container.cc:672] . unexpected pos ...", and its weights-only
    loader follows its first sentence with advice that does not apply here."""
    text = str(exc).strip().splitlines()
    line = re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", text[0]) if text else ""
    line = line.split(". ")[0]
    line = line if len(line) <= 160 else line[:157] + "..."
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def shares(folder: Path | str) -> dict[str, int]:
    """DCP's data files in a checkpoint folder and their bytes: one ``__R_0.distcp`` per rank
    that wrote a share (measured on disk)."""
    return {p.name: p.stat().st_size for p in sorted(Path(folder).glob("*.distcp"))}


def unreadable(folder: Path, e: BaseException) -> str:
    """Why torch could not read ``folder``'s data, naming the file where it can be told."""
    failures = getattr(e, "failures", {})
    for _, (exc, _) in failures.items():
        if not isinstance(exc, Exception) or isinstance(exc, MemoryError | torch.OutOfMemoryError):
            raise exc  # not damage: an interrupt, or too little memory to load it
    errors = "; ".join(f"rank {r}: {first_line(exc)}" for r, (exc, _) in sorted(failures.items()))
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
        return f".metadata cannot be read ({first_line(e)})"
    for name, end in sorted(ends.items()):
        try:
            size = (folder / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if size < end:
            return f"{name} is truncated: {size:,} bytes, its tensors reach byte {end:,}"
    return None

