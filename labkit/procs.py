"""Processes of launched jobs: ending a process tree, and the registry of running jobs.

Kept apart from :mod:`labkit.launch` because it is the part that must work even when the
launcher itself did not survive: ``cleanup()`` reads the records a killed kernel left behind
and ends what is still running, checking each PID's start time so a recycled PID is never hit.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil

from labkit import dist

GRACE_S = 2.0  # after SIGTERM, how long processes get before SIGKILL


def labkit_home() -> Path:
    """labkit's cache folder: $LABKIT_HOME, else $XDG_CACHE_HOME/labkit or ~/.cache/labkit."""
    if os.environ.get("LABKIT_HOME"):
        return Path(os.environ["LABKIT_HOME"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "labkit"


def registry_dir() -> Path:
    return labkit_home() / "jobs"


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


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


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


def cleanup() -> list[dict[str, Any]]:
    """End the processes of jobs whose launching process has died; return what was ended.

    Each ``run`` registers its job (owner, agent and worker PIDs with their start times) in
    ``labkit_home()/jobs`` and removes the record when done. A record left behind means the
    launcher was killed (e.g. a Jupyter kernel restart); the parent-death signals usually
    took the job down already, this catches the rest. ``run`` calls it before each job.

    Returns one dict per job with processes ended: {"job_id", "module", "pids"}.
    """
    report = []
    for path in sorted(registry_dir().glob("*.json")):
        rec = dist.read_json(path)
        if rec is None or find(rec.get("owner")) is not None:
            continue  # unreadable, or its launcher is alive and in charge
        procs = [p for p in map(find, [rec.get("agent"), *rec.get("workers", [])]) if p]
        pids = end_tree(procs) if procs else []
        path.unlink(missing_ok=True)
        if pids:
            report.append({"job_id": rec.get("job_id"), "module": rec.get("module"), "pids": pids})
    return report
