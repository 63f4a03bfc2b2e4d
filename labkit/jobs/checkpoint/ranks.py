"""How the ranks of a checkpointing job act together: who they are, rank 0's choice sent to every
rank, every rank's outcome gathered, and rank 0 alone speaking.

A checkpoint is written and read by every rank at once, and a failure on one rank alone would
leave the others waiting in the next collective until its timeout. So every step of a save or a
load ends with the ranks agreeing (:func:`from_all`, :func:`from_rank0`), and each works
without a process group too (one process, a notebook): then the rank is 0 of 1 and agreeing is
a no-op. Saving (:mod:`labkit.jobs.checkpoint.saving`), loading
(:mod:`labkit.jobs.checkpoint.loading`) and the damage checks share these, and :func:`quiet_dcp`,
which hushes what DCP says about running without a process group or over a damaged index.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as tdist


def rank_and_world() -> tuple[int, int]:
    """(this rank, the number of ranks); (0, 1) without a process group."""
    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank(), tdist.get_world_size()
    return 0, 1


def from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (a pickled broadcast; the object itself without a group)."""
    if not (tdist.is_available() and tdist.is_initialized()):
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def from_all(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank: how the ranks agree that a step worked
    everywhere (also a barrier). A failure on one rank alone would otherwise leave the others
    waiting in the next collective until its timeout."""
    if not (tdist.is_available() and tdist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, obj)
    return out


def say(log: Callable[[str], None] | None, text: str) -> None:
    """``log`` a line on rank 0 only (every rank would say the same)."""
    if log is not None and rank_and_world()[0] == 0:
        log(f"labkit.jobs.checkpoint: {text}")


# --- DCP's chatter -----------------------------------------------------------------------------

_DCP_FALLBACK_LOGS = ("Global metadata is not found", "Rank local metadata is not found")


def _not_a_metadata_fallback(record: Any) -> bool:
    return not str(record.msg).startswith(_DCP_FALLBACK_LOGS)


@contextlib.contextmanager
def quiet_dcp() -> Iterator[None]:
    """DCP warns that it "assumes the intent is to save in a single process" even when told
    so (``no_dist=True``): a process without a process group is that, on purpose. Its loader
    also logs two tracebacks on the root logger when it cannot read ``.metadata``
    (``state_dict_loader.py``, ``local_step``); labkit names that damage itself."""
    root_log = logging.getLogger()
    root_log.addFilter(_not_a_metadata_fallback)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
            yield
    finally:
        root_log.removeFilter(_not_a_metadata_fallback)

