"""Resuming from a checkpoint: the newest complete one that reads whole, or one saved by another
number of ranks, resharded.

Rank 0 surveys the root and chooses; every rank tries the same checkpoints in the same order
and they agree on each: a damaged one (a file cut short, a rank's file unreadable) is skipped
with a ``CheckpointWarning`` for the previous complete one, and a complete one that does not
fit this job is refused with a ``CheckpointMismatch`` before any tensor is read. What counts as
complete, damaged or mismatched is :mod:`labkit.jobs.checkpoint.folders`'s; writing them is
:mod:`labkit.jobs.checkpoint.saving`'s.
"""

from __future__ import annotations

import shlex
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from labkit.jobs.checkpoint.folders import (
    CheckpointError,
    CheckpointMismatch,
    CheckpointWarning,
    first_line,
    manifest_problem,
    mismatches,
    read_manifest,
    recover,
    shares,
    sizes_problem,
    survey,
    unreadable,
)
from labkit.jobs.checkpoint.ranks import from_all, from_rank0, quiet_dcp, rank_and_world, say

MAX_LINES = 8  # differences named in a CheckpointMismatch; the rest are counted


@dataclass
class Loaded:
    """The checkpoint ``load_latest`` restored: its step, this rank's ``extra``, its manifest."""

    path: str
    step: int
    extra: dict[str, Any]
    manifest: dict[str, Any]
    seconds: float  # measured: choosing, checking and reading it


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --- the newest checkpoint that reads whole ----------------------------------------------------


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
    rank, _ = rank_and_world()
    started = time.perf_counter()
    plan: dict[str, Any] = {}
    if rank == 0:  # one rank chooses, so every rank tries the same checkpoints in one order
        plan = _plan_load(root, model, optimizer, log)
    plan = from_rank0(plan)
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
        say(log, f"resumed from {folder} (step {choice['step']})")
        return Loaded(path=str(folder), step=int(choice["step"]), extra=own["extra"],
                      manifest=choice["manifest"], seconds=time.perf_counter() - started)  # fmt: skip
    if damaged:
        raise CheckpointError(_all_damaged(root, damaged, read_some))
    say(log, f"no complete checkpoint in {root}: starting from scratch")
    return None


def _plan_load(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
               log: Callable[[str], None] | None) -> dict[str, Any]:  # fmt: skip
    """Rank 0: the complete checkpoints to try, newest first, up to the first that does not
    fit this job (it carries the error); the damaged ones the scan found, each warned about."""
    if root.is_dir():
        for note in recover(root):
            say(log, note)
    found = survey(root)
    for line in found.partial:
        say(log, f"skipped {root / line}")
    for folder, why in found.damaged:
        _warn_damaged(folder, why, stacklevel=4)
    _, world = rank_and_world()
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

    rank, _ = rank_and_world()
    own, why = _read_own(folder, rank, step)
    problems = [p for p in from_all(why) if p]  # read before any tensor is touched
    if problems:
        return None, "; ".join(problems), False
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        with quiet_dcp():
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder),
                     no_dist=not tdist.is_initialized())  # fmt: skip
    except CheckpointException as e:  # collective: every rank has it
        return None, unreadable(folder, e), True
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
        return None, f"{name} cannot be read ({first_line(e)})"
    if not (isinstance(own, dict) and {"step", "extra", "rng"} <= own.keys()):
        return None, f"{name} holds no labkit rank state"
    if own["step"] != step:
        return None, f"{name} is from step {own['step']!r}, not {step}"
    return own, None



def _warn_damaged(folder: Path | str, why: str, stacklevel: int = 3) -> None:
    """Rank 0 warns; ``stacklevel`` counts the frames up to load_latest's caller (1: here)."""
    if rank_and_world()[0] == 0:
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


# --- resharding on load ------------------------------------------------------------------------


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
    damage = manifest_problem(manifest)
    if damage is None and isinstance(manifest.get("files"), dict):
        damage = sizes_problem(folder, manifest["files"])
    if damage:
        raise CheckpointError(f"checkpoint {folder} is damaged: {damage}. Load another one "
                              "(scan() lists the complete ones), or delete this one "
                              f"(rm -r {shlex.quote(str(folder))}).")  # fmt: skip
    _, world = rank_and_world()
    problems = [p for p in mismatches(manifest, model, optimizer, world)
                if not p.startswith("saved by ")]  # the world size is what may differ  # fmt: skip
    if problems:
        raise CheckpointMismatch(f"checkpoint {folder} does not fit this job:\n"
                                 + "".join(f"  {p}\n" for p in problems[:MAX_LINES]))  # fmt: skip
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        with quiet_dcp():
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder),
                     no_dist=not tdist.is_initialized())  # fmt: skip
    except CheckpointException as e:  # a BaseException: never let it reach a notebook
        raise CheckpointError(f"checkpoint {folder} is damaged: {unreadable(folder, e)}. The "
                              "model and optimizer may hold part of it: build them afresh, and "
                              "load another checkpoint (scan() lists the complete ones).") from None
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    seconds = time.perf_counter() - started
    say(log, f"loaded {folder} (saved by {manifest.get('world_size')} ranks) into {world} "
             f"rank(s) in {seconds:.3f} s (measured)")  # fmt: skip
    return {"manifest": manifest, "files": shares(folder), "saved_by": manifest.get("world_size"),
            "loaded_by": world, "seconds": seconds}  # fmt: skip

