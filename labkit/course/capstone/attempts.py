"""A learner's attempt record for a capstone job: each check counted, and whether the key was
opened (``python -m labkit capstone reveal --give-up``).

One JSON file per job code under ``labkit_home()/capstone/attempts/``::

    {"job": "cpu-1234-d22vgd54", "started": "2025-...", "gave_up": null,
     "attempts": [{"at": "...", "passed": false, "said": "step time 2.9x the healthy job's; ..."}]}

The record holds what the learner was told, never the faults.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def folder() -> Path:
    from labkit.jobs.procs import labkit_home

    return labkit_home() / "capstone" / "attempts"


def path(code: str) -> Path:
    return folder() / f"{code}.json"


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def load(code: str) -> dict[str, Any]:
    """``code``'s record (an empty one if there is none, or if it cannot be read: a record is
    never a reason for a check to fail)."""
    try:
        data = json.loads(path(code).read_text())
        if isinstance(data, dict) and isinstance(data.get("attempts"), list):
            return data
    except (OSError, ValueError):
        pass
    return {"job": code, "started": _now(), "gave_up": None, "attempts": []}


def _save(code: str, data: dict[str, Any]) -> None:
    try:
        folder().mkdir(parents=True, exist_ok=True)
        tmp = path(code).with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path(code))
        (folder() / "last").write_text(code + "\n")
    except OSError as err:
        print(f"labkit: could not keep the capstone attempt record ({err}); going on")


def started(code: str) -> dict[str, Any]:
    """Note that ``code``'s job ran here (it becomes the job ``reveal --give-up`` opens by
    default); its record."""
    data = load(code)
    _save(code, data)
    return data


def add(code: str, passed: bool, said: str) -> int:
    """Record one check of ``code``'s job; the attempt's number (1 for the first)."""
    data = load(code)
    data["attempts"].append({"at": _now(), "passed": passed, "said": said})
    _save(code, data)
    return len(data["attempts"])


def give_up(code: str) -> dict[str, Any]:
    """Record that the learner opened ``code``'s key (the first time counts); its record."""
    data = load(code)
    data["gave_up"] = data.get("gave_up") or _now()
    _save(code, data)
    return data


def last_code() -> str | None:
    """The job code whose job ran last here, or None."""
    try:
        return (folder() / "last").read_text().strip() or None
    except OSError:
        return None
