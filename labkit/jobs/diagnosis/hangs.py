"""A stalled job: which rank holds it up, and where each rank is stuck.

A rank waiting in a collective is a victim: it waits for a peer. The heartbeats each rank writes
(:mod:`labkit.jobs.runtime`: its step, its phase, whether it is in a collective) name the rank
that is *not* waiting, or show every rank waiting in a different collective (a desync); the
stack dump a rank writes on ``runtime.STACK_SIGNAL`` says which line it is on. The launcher
(:mod:`labkit.jobs.launch`) words a ``JobTimeout`` from these; the failure report
(:mod:`labkit.jobs.diagnosis`) uses them when the root cause is a rank that failed waiting.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from pathlib import Path

from labkit.jobs import runtime
from labkit.jobs.diagnosis.evidence import rank_list
from labkit.jobs.diagnosis.tracebacks import where_stuck


def _ago(beat: dict, now: float) -> str:
    t = beat.get("time")
    return f"{now - t:.1f} s ago" if isinstance(t, (int, float)) else "at an unknown time"

def at_step(beat: dict) -> str:
    """"at step 3/10" (or "before its first step") for a rank's heartbeat."""
    step, total = beat.get("step"), beat.get("total")
    return (
        "before its first step"
        if step is None
        else f"at step {step}" + (f"/{total}" if total else "")
    )


def diagnose_hang(
    heartbeats: dict[int, dict],
    nproc: int | Sequence[int],
    now: float | None = None,
    where: dict[int, str] | None = None,
) -> tuple[list[int], list[str]]:
    """Name the ranks that most likely hold a stalled job up, from their last heartbeats.

    A rank waiting in a collective is a victim: it waits for a peer. So a rank that is *not*
    in a collective while others are is the likely culprit; among several, the one with the
    lowest step. Ranks that never wrote a heartbeat (stuck importing or before setup) come
    first. ``now`` (``time.time()`` by default) dates the heartbeats. Returns (likely hung
    ranks, one explanatory line per rank, followed by where the rank was if ``where`` (from
    :func:`read_stacks`) says).
    """
    now = time.time() if now is None else now
    where = where or {}
    ranks = rank_list(nproc)
    lines = []
    for r in ranks:
        beat = heartbeats.get(r)
        if beat is None:
            lines.append(f"rank {r}: no heartbeat (never reached setup: slow or stuck start)")
        elif beat.get("phase") == "done":
            lines.append(f"rank {r}: finished")
        elif beat.get("in_collective"):
            lines.append(
                f"rank {r}: waiting in collective '{beat.get('phase')}' {at_step(beat)} "
                f"(last heartbeat {_ago(beat, now)})"
            )
        else:
            lines.append(
                f"rank {r}: {at_step(beat)} in phase '{beat.get('phase')}', not in a "
                f"collective (last heartbeat {_ago(beat, now)})"
            )
    lines = [line + (f"\n    stuck at {where[r]}" if r in where else "")
             for r, line in zip(ranks, lines, strict=True)]  # fmt: skip
    missing = [r for r in ranks if r not in heartbeats]
    if missing:
        return missing, lines
    active = {r: b for r, b in heartbeats.items() if b.get("phase") != "done"}
    outside = {r: b for r, b in active.items() if not b.get("in_collective")}
    # Some ranks wait in a collective for the others: those others are the suspects.
    pool = outside if outside and len(outside) < len(active) else active
    if not pool:
        return [], lines

    def step_of(r: int) -> int:
        s = pool[r].get("step")
        return -1 if s is None else int(s)

    lowest = min(step_of(r) for r in pool)
    behind = sorted(r for r in pool if step_of(r) == lowest)
    if pool is active and len(behind) == len(active) == len(heartbeats):
        return [], lines  # nobody is behind anybody: no rank to blame
    return behind, lines


def read_stacks(job_dir: Path, nproc: int | Sequence[int]) -> dict[int, str]:
    """{rank: where it is} for the ranks that wrote a stack dump (``runtime.STACK_SIGNAL``)."""
    found = {}
    for rank in rank_list(nproc):
        with contextlib.suppress(OSError):
            where = where_stuck(runtime.stack_path(job_dir, rank).read_text(errors="replace"))
            if where:
                found[rank] = where
    return found


def waiting_apart(heartbeats: dict[int, dict]) -> dict[int, dict]:
    """{rank: heartbeat} when every unfinished rank waits in a collective, not all in the same
    one (by phase name and step): the ranks' sequences of collectives no longer match. Else {}."""
    active = {r: b for r, b in heartbeats.items() if b.get("phase") != "done"}
    if len(active) < 2 or not all(b.get("in_collective") for b in active.values()):
        return {}
    where = {(b.get("phase"), b.get("step")) for b in active.values()}
    return dict(sorted(active.items())) if len(where) > 1 else {}


def desync_line(apart: dict[int, dict]) -> str:
    """One line for ranks :func:`waiting_apart`."""
    each = ", ".join(f"rank {r} in '{b.get('phase')}' {at_step(b)}" for r, b in apart.items())
    return (f"the ranks were waiting in different collectives ({each}): their sequences of "
            "collectives no longer match (a desync: a rank skipped or added one). Run again with "
            "TORCH_DISTRIBUTED_DEBUG=DETAIL to have each collective compared across ranks")  # fmt: skip

