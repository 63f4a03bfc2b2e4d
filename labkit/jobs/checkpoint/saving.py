"""Saving a checkpoint atomically: every rank writes its share into a temporary folder, the ranks
agree that all of it is on disk, and rank 0 publishes it with one rename.

Three steps, each ended by the ranks agreeing (:mod:`labkit.jobs.checkpoint.ranks`): rank 0
makes the temporary folder; every rank writes its share of the tensors (DCP) and its own file
(step, extra, random state); rank 0 writes the manifest, renames the folder to its final name
and prunes old ones. A failure on any rank (a full disk) raises one ``CheckpointError`` on every
rank, removes the temporary folder and leaves the published checkpoints as they were. Which
folders hold a checkpoint, and the errors, are :mod:`labkit.jobs.checkpoint.folders`'s.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from labkit.jobs.checkpoint.costs import (
    count,
    optimizer_kind,
    predict_bytes,
    signature,
    write_bandwidth,
)
from labkit.jobs.checkpoint.folders import (
    ASIDE_PREFIX,
    FORMAT,
    MANIFEST,
    MAX_STEP,
    TMP_PREFIX,
    CheckpointError,
    final_dir,
    first_line,
    fsync_dir,
    put_back,
    recover,
    survey,
    tmp_dir,
)
from labkit.jobs.checkpoint.ranks import from_all, from_rank0, quiet_dcp, rank_and_world, say
from labkit.validate import whole

_STEP_WHY = ("a checkpoint's folder is named step + 9 digits, which is how load_latest finds it "
             "again; pass the number of optimizer steps done so far, step + 1 in a loop over "
             "range(steps)")  # fmt: skip
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_NEARLY_FULL_BYTES = 1 << 20  # less free than this after a failed write: the disk is full


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


_BANDWIDTH: dict[str, float] = {}  # root -> measured bytes/s (one probe per root and process)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's generator
    return state


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


def _fault(rank: int, exc: BaseException, root: Path,
           also: list[OSError] | None = None) -> dict[str, Any]:  # fmt: skip
    """What went wrong on this rank, as plain data every rank can be sent. The free space is
    measured here, on the rank that failed and before its temporary folder goes: the disk that
    filled is this rank's, and every rank's message must tell the same."""
    full = _is_disk_full(exc) or any(_is_disk_full(e) for e in also or [])
    return {"rank": rank, "error": first_line(exc), "full": full, "free": _free_bytes(root)}


def _save_failed(root: Path, tmp: Path, step: int, faults: list[dict[str, Any]]) -> str:
    """The message every rank raises when checkpoint ``step`` could not be written: built on
    each rank from the same faults (every rank's, gathered), naming that rank's own ``root``
    and ``tmp``."""
    many = rank_and_world()[1] > 1  # name the ranks only where there are several
    ranks = sorted({f["rank"] for f in faults})
    who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}, " if many else ""
    measured = [f["free"] for f in faults if f.get("free") is not None]
    free = min(measured) if measured else None  # the fullest of the failing ranks' disks
    full = any(f["full"] for f in faults) or (free is not None and free < _NEARLY_FULL_BYTES)
    complete = survey(root).complete
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
    rank, world = rank_and_world()
    started = time.perf_counter()
    tmp, final = tmp_dir(root, step), final_dir(root, step)

    # 1. Rank 0 makes the temporary folder; every rank learns whether it could.
    faults: list[dict[str, Any]] = []
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for note in recover(root):
                say(log, note)
            for stale in root.glob(f"{TMP_PREFIX}*"):  # a crashed writer's leftovers
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        except OSError as e:
            faults.append(_fault(rank, e, root))
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
        with quiet_dcp():
            dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=writer,
                     no_dist=not tdist.is_initialized())  # fmt: skip
    except CheckpointException as e:  # DCP's collective failure: every rank has the same
        _raise_if_not_a_write_error(e, tmp)
        mine = e.failures.get(rank)
        if mine is not None:
            faults.append(_fault(rank, mine[0], root, fs.errors))
    else:
        faults = _own_file_faults(root, tmp / f"rank{rank}.pt", own, rank)
    _raise_if_failed(root, tmp, step, faults)

    # 3. Rank 0 publishes: manifest, rename, prune.
    info: Saved | str | list[dict[str, Any]] | None = None
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
                info = [_fault(rank, e, root)]
                shutil.rmtree(tmp, ignore_errors=True)
    info = from_rank0(info)  # also the barrier that makes the checkpoint visible to all
    if isinstance(info, list):  # rank 0's fault: each rank words it, naming its own folder
        info = _save_failed(root, tmp, step, info)
    if isinstance(info, str):
        raise CheckpointError(info)
    assert info is not None
    say(log, f"saved step {step} to {info.path}: {info.bytes / 1e6:.2f} MB in "
             f"{info.seconds:.3f} s (measured)")  # fmt: skip
    for note in info.notes:
        say(log, note)
    return info


def _own_file_faults(root: Path, path: Path, own: dict[str, Any],
                     rank: int) -> list[dict[str, Any]]:  # fmt: skip
    """Write this rank's own file; what went wrong, as :func:`_fault`s ([] if nothing)."""
    try:
        _write_own(path, own)
    except OSError as e:  # a full disk
        return [_fault(rank, e, root)]
    except Exception as e:  # an extra that does not pickle
        return [{**_fault(rank, e, root), "fix": "Pass an extra of plain values (numbers, strings, "
                 f"lists, dicts, tensors): it is pickled into {path.name}."}]  # fmt: skip
    return []


def _raise_if_not_a_write_error(e: BaseException, tmp: Path) -> None:
    """Raise, as it is, an interrupt (or a SystemExit, or too little memory) that DCP caught
    on any rank: it is no failed write, as :func:`load_latest` does not take one for damage.
    Every rank has the same failures, so every rank raises it; rank 0 first removes the
    temporary folder (no rank writes to it any more: DCP's failure was collective)."""
    for exc, _ in getattr(e, "failures", {}).values():
        if not isinstance(exc, Exception) or isinstance(exc, MemoryError | torch.OutOfMemoryError):
            if rank_and_world()[0] == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise exc from None  # not chained to DCP's wrapper: its text repeats the trace


def _raise_if_failed(root: Path, tmp: Path, step: int, faults: list[dict[str, Any]]) -> None:
    """Gather every rank's faults (a barrier); if any, rank 0 removes the temporary folder and
    every rank raises a ``CheckpointError`` worded from them all."""
    everyone = [f for per_rank in from_all(faults) for f in per_rank]
    if not everyone:
        return
    message = _save_failed(root, tmp, step, everyone)
    if rank_and_world()[0] == 0:
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
    complete = survey(root).complete
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
    ``recover`` and ``scan`` know."""
    aside = final.with_name(ASIDE_PREFIX + final.name)
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)  # an older leftover; final is the newer copy
        os.rename(final, aside)
    try:
        _rename(tmp, final)
    except OSError:
        if aside.exists():
            put_back(aside, final)
        raise
    fsync_dir(root)  # the rename itself survives a power cut
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
