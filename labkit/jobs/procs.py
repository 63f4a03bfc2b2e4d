"""Processes of launched jobs: ending a process tree, and the registry of running jobs.

Kept apart from :mod:`labkit.jobs.launch` because it is the part that must work even when the
launcher itself did not survive: ``cleanup()`` reads the records a killed kernel left behind
and ends what is still running, checking each PID's start time so a recycled PID is never hit.
``prune_runs()`` keeps the job directories (logs and results) from piling up, sparing those of
jobs the registry says are still running.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import tempfile
import time
import warnings
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

import psutil

from labkit.jobs import spec
from labkit.validate import whole

GRACE_S = 2.0  # after SIGTERM, how long processes get before SIGKILL
# Job directories kept by default. A learner launches a few dozen jobs in one pass over the
# notebooks (every exercise check is a job): 50 keeps the logs of the latest session or two to
# look back at, while a job directory is small (logs and JSON), so disk is no concern;
# the point is only that the folder stops growing. LABKIT_KEEP_RUNS changes it.
KEEP_RUNS = 50
KEEP_RUNS_ENV = "LABKIT_KEEP_RUNS"
# A job directory exists a moment before its registry record does (``launch.run`` writes the
# spec, then starts torchrun, then registers the job); one this young that still has its tmp/
# folder is taken for a job that is starting. Milliseconds are needed, a minute is ample.
STARTING_GRACE_S = 60.0


def labkit_home() -> Path:
    """labkit's cache folder: $LABKIT_HOME, else $XDG_CACHE_HOME/labkit or ~/.cache/labkit.

    Where that folder can be neither used nor made (a read-only or missing home, as a hosted
    notebook may have), a folder of this user's in the temporary directory instead: said once,
    and put in LABKIT_HOME so that the jobs this process launches use it too, silently.
    """
    if os.environ.get("LABKIT_HOME"):
        return Path(os.environ["LABKIT_HOME"])
    try:
        home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "labkit"
    except RuntimeError:  # no HOME, and no password-file entry to find one in
        return _temporary_home("there is no home folder")
    if _usable(home):
        return home
    return _temporary_home(f"{home} can be neither written nor made (a read-only home?)")


def _usable(folder: Path) -> bool:
    """Whether ``folder`` can be written, or made: it, or its nearest existing parent, is a
    folder this process may write in (probed without making anything)."""
    for path in (folder, *folder.parents):
        if path.exists():
            return path.is_dir() and os.access(path, os.W_OK | os.X_OK)
    return False


def _temporary_home(why: str) -> Path:
    folder = Path(tempfile.gettempdir()) / f"labkit-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        ours = not folder.is_symlink() and folder.stat().st_uid == os.getuid()
    except OSError:
        ours = False
    if not ours:  # a shared temporary folder where another user took the name first
        folder = Path(tempfile.mkdtemp(prefix="labkit-"))
    os.environ["LABKIT_HOME"] = str(folder)
    warnings.warn(f"labkit: {why}: job logs and exercise files go to {folder} instead "
                  "(set LABKIT_HOME to choose the folder)", stacklevel=3)
    return folder


def registry_dir() -> Path:
    return labkit_home() / "jobs"


def default_runs_dir() -> Path:
    """Where ``launch.run`` puts job directories when the caller gives no ``log_dir``."""
    return labkit_home() / "runs"


def record(p: psutil.Process) -> dict[str, Any]:
    return {"pid": p.pid, "create_time": p.create_time()}


def find(rec: dict[str, Any] | None) -> psutil.Process | None:
    """The live process a record names; None if it is gone or its PID now names another one."""
    if not rec:
        return None
    try:
        p = psutil.Process(int(rec["pid"]))
        # A PID is reused after its process dies; the start time tells them apart.
        if abs(p.create_time() - float(rec["create_time"])) > 0.01:
            return None
        return p if alive(p) else None
    except (psutil.Error, KeyError, ValueError, TypeError):
        return None


def _same(rec: Any, other: dict[str, Any]) -> bool:
    """Whether process record ``rec`` names the process ``other`` records."""
    try:
        return int(rec["pid"]) == other["pid"] and abs(
            float(rec["create_time"]) - other["create_time"]
        ) <= 0.01
    except (TypeError, KeyError, ValueError):
        return False


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def carrying(name: str, value: str) -> list[psutil.Process]:
    """Live processes of this user whose environment has ``name=value``.

    A process inherits its parent's environment, so this finds a job's processes wherever
    they ended up in the process tree (orphans adopted by PID 1 included). Other users'
    processes cannot be read and are not looked at.
    """
    me = os.getuid()
    found = []
    for p in psutil.process_iter(["uids"]):
        try:
            if p.info["uids"] is None or p.info["uids"].real != me or p.pid == os.getpid():
                continue
            if p.environ().get(name) == value and alive(p):
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def end_tree(procs: Iterable[psutil.Process], grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM ``procs`` and all their descendants, then SIGKILL what is left after ``grace_s``.

    SIGTERM first because torchrun stops its workers on it in well under a second; SIGKILL
    because a worker may ignore SIGTERM (the agent would wait 30 s for it).
    """

    def live_tree(roots: Iterable[psutil.Process]) -> dict[int, psutil.Process]:
        found: dict[int, psutil.Process] = {}
        for p in roots:
            if alive(p):
                found[p.pid] = p
                with contextlib.suppress(psutil.Error):
                    found.update({c.pid: c for c in p.children(recursive=True) if alive(c)})
        return found

    targets = live_tree(procs)
    ended = sorted(targets)
    for p in targets.values():
        with contextlib.suppress(psutil.Error):
            p.terminate()
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in targets.values()):
        time.sleep(0.05)
    # Children may have been born during the grace period: walk the tree again.
    survivors = live_tree(targets.values())
    for p in survivors.values():
        with contextlib.suppress(psutil.Error):
            p.kill()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(alive(p) for p in survivors.values()):
        time.sleep(0.05)
    return sorted(set(ended) | set(survivors))


def cleanup(supervised: Collection[str] | None = None) -> list[dict[str, Any]]:
    """End the processes of jobs nobody supervises any more; return what was ended.

    Each ``run`` registers its job (owner, agent and worker PIDs with their start times) in
    ``labkit_home()/jobs`` and removes the record when done. A record left behind means the
    launcher was killed (e.g. a Jupyter kernel restart); the parent-death signals usually
    took the job down already, this catches the rest. ``run`` calls it before each job.

    ``supervised``: the job ids this process is supervising right now. Given, a job this very
    process launched but no longer supervises (its ending was cut short) is ended too;
    without it, every job whose launcher lives is left alone.

    Returns one dict per job with processes ended: {"job_id", "module", "pids"}. Temporary
    files of records whose writer died mid-write (``remove_stale_tmp``) are deleted too.
    """
    me = record(psutil.Process())
    report = []
    remove_stale_tmp(registry_dir())
    for path in sorted(registry_dir().glob("*.json")):
        rec = spec.read_json(path)
        if rec is None:
            continue  # unreadable: not ours to judge
        owner = find(rec.get("owner"))
        abandoned = (
            supervised is not None
            and owner is not None
            and _same(rec.get("owner"), me)
            and rec.get("job_id") not in supervised
        )
        if owner is not None and not abandoned:
            continue  # its launcher is alive and in charge
        procs = [p for p in map(find, [rec.get("agent"), *rec.get("workers", [])]) if p]
        pids = end_tree(procs) if procs else []
        path.unlink(missing_ok=True)
        if pids:
            report.append({"job_id": rec.get("job_id"), "module": rec.get("module"), "pids": pids})
    return report


# ``spec.write_json_atomic`` writes ``.<name>.<pid>.tmp`` next to the file, then renames it.
_TMP_NAME = re.compile(r"\.(?P<name>.+)\.(?P<pid>\d+)\.tmp")


def remove_stale_tmp(folder: Path) -> list[Path]:
    """Delete the temporary files in ``folder`` that ``spec.write_json_atomic`` left behind
    (a writer killed between writing and renaming: a kernel restart, a full disk before the
    writer removed its own); return them.

    A file is stale when the process named in it is gone, or started after the file was last
    written (its PID was reused). A live writer's file is never touched.
    """
    removed = []
    with contextlib.suppress(OSError):
        for path in folder.iterdir():
            m = _TMP_NAME.fullmatch(path.name)
            if not m:
                continue
            try:
                written = path.lstat().st_mtime
                try:
                    writer = psutil.Process(int(m["pid"]))
                    stale = not alive(writer) or writer.create_time() > written + 0.01
                except psutil.NoSuchProcess:
                    stale = True
                if stale:
                    path.unlink()
                    removed.append(path)
            except (OSError, psutil.Error):
                continue  # vanished meanwhile, or not ours to delete
    return removed


# --- old job directories ---------------------------------------------------------------------


def keep_runs() -> int:
    """How many finished job directories to keep: ``$LABKIT_KEEP_RUNS``, else ``KEEP_RUNS``.

    Raises ValueError for a value that is not a whole number >= 0: a typo in the variable must
    not silently mean "keep everything" or "keep nothing".
    """
    raw = os.environ.get(KEEP_RUNS_ENV, "").strip()
    if not raw:  # unset or empty: the default, as for LABKIT_HOME
        return KEEP_RUNS
    try:
        keep = int(raw)
    except ValueError:
        keep = -1
    if keep < 0:
        raise ValueError(
            f"{KEEP_RUNS_ENV}={raw!r} is not a number of job folders to keep: set it to a whole "
            f"number >= 0 (0 keeps none of the finished ones), or unset it for the default "
            f"{KEEP_RUNS}"
        )
    return keep


def prune_runs(keep: int | None = None, runs_dir: Path | None = None) -> list[Path]:
    """Delete the oldest finished job directories so that at most ``keep`` of them remain.

    Every ``launch.run`` leaves a job directory behind (its logs and results, for looking back
    at a run); without pruning they pile up forever. ``launch.run`` calls this before each
    launch, and ``python -m labkit cleanup --runs N`` on demand.

    Args:
        keep: how many finished job directories to keep, newest first (None:
            ``keep_runs()``, i.e. ``$LABKIT_KEEP_RUNS`` or ``KEEP_RUNS``); 0 deletes them all.
        runs_dir: the folder to prune (default: ``default_runs_dir()``).

    Only directories holding a job spec (``spec.SPEC_FILE``) count as job directories: any
    other file or folder there, and symlinks, are never touched. Age is the directory's mtime,
    not its name (a name's time stamp is local time, which jumps with time zones and clock
    changes). The directory of a job that is still running is never deleted, nor counted
    against ``keep``: see ``_running_job_ids``. A directory that vanishes or cannot be deleted
    is skipped silently, so two kernels pruning at once cannot fail each other's launches.

    Returns the directories deleted, oldest first.

    Raises:
        ValueError: ``keep`` is not a whole number >= 0, or ``$LABKIT_KEEP_RUNS`` is bad.
    """
    if keep is None:
        keep = keep_runs()
    else:
        keep = whole("keep", keep, low=0, why="job folders to keep; 0 deletes every finished one")
    folder = Path(runs_dir) if runs_dir is not None else default_runs_dir()
    try:
        entries = list(folder.iterdir())
    except FileNotFoundError:
        return []  # no job has run yet
    running = _running_job_ids()
    now = time.time()
    finished: list[tuple[float, str, Path]] = []
    for path in entries:
        try:
            st = path.lstat()
            if not stat.S_ISDIR(st.st_mode) or not (path / spec.SPEC_FILE).is_file():
                continue  # not a job directory (lstat: a symlink is not followed)
            if path.name in running:
                continue
            if now - st.st_mtime < STARTING_GRACE_S and (path / "tmp").is_dir():
                continue  # a job starting right now, not yet in the registry
        except OSError:
            continue  # vanished or unreadable: not ours to judge now
        finished.append((st.st_mtime, path.name, path))
    finished.sort()  # oldest first; the name only breaks ties
    doomed = [path for _, _, path in finished[: max(len(finished) - keep, 0)]]
    return [path for path in doomed if _remove_job_dir(path)]


def _running_job_ids() -> set[str]:
    """Names of the job directories whose jobs may still be running, from the registry.

    ``launch.run`` records each job in ``registry_dir()`` (the launching process, torchrun's
    agent and the workers, each PID with its start time) and removes the record when the job
    ends. So a job is running while its record exists and any process it names is alive; a
    record whose processes are all gone was left by a killed launcher (``cleanup`` drops it).
    A record that cannot be read or makes no sense counts as running: we cannot tell, and
    keeping a log folder one launch too long costs nothing. Names, not paths, are compared
    (a job id is also its directory's name, and has random hex in it), which errs on the side
    of keeping.
    """
    running: set[str] = set()
    for path in registry_dir().glob("*.json"):
        rec = spec.read_json(path)
        try:
            if rec is not None:
                named = [rec.get("owner"), rec.get("agent"), *(rec.get("workers") or [])]
                if all(find(r) is None for r in named):
                    continue  # every process of this job is gone: it has finished
                if rec.get("job_id"):
                    running.add(str(rec["job_id"]))
                if rec.get("job_dir"):
                    running.add(Path(rec["job_dir"]).name)
        except (TypeError, ValueError, AttributeError):
            pass  # a malformed record: unsure, so the job counts as running
        running.add(path.stem)  # the record is named after its job id
    return running


def _remove_job_dir(path: Path) -> bool:
    """Delete one job directory; True if it is gone, False if it (or part of it) stayed.

    The spec file goes last: if something inside cannot be deleted (a file owned by another
    user, a folder another process is writing to), the directory still looks like a job
    directory, and the next prune tries it again instead of leaving a half-deleted folder that
    no prune would recognise. A directory that vanishes mid-way (another kernel pruned it
    first) is not reported as deleted here.
    """
    try:
        for child in path.iterdir():
            if child.name == spec.SPEC_FILE:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
        (path / spec.SPEC_FILE).unlink()
        path.rmdir()
    except OSError:
        return False
    return True
