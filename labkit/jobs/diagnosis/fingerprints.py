"""Collectives that do not match across ranks, as ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` reports
them: each rank's fingerprint of the collective it was about to run, and the odd one out.

With DETAIL, torch compares every collective across the ranks before running it and raises a
700-character line when they differ. Reading it back into two :class:`Fingerprint` objects,
and finding the rank a majority disagrees with, is one job of its own: the failure report
(:mod:`labkit.jobs.diagnosis`) says it short, and ``labkit.collective_debug`` shows it beside
what the other debugging tools say.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

# TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the process group (c10d's ProcessGroupWrapper, torch/csrc/
# distributed/c10d/ProcessGroupWrapper.cpp): before each collective the ranks all-gather its
# fingerprint and each raises "Detected mismatch between collectives on ranks. Rank 0 is running
# collective: CollectiveFingerPrint(SequenceNumber=2, OpType=ALLREDUCE, TensorShape=[1024],
# TensorDtypes=Float, TensorDeviceTypes=...), but Rank 1 is running collective: ...
# .Collectives differ in the following aspects: ..." (the wording of torch 2.13). A collective
# without tensors (a barrier) prints "SequenceNumber=2OpType=BARRIER".
_FINGERPRINT = re.compile(
    r"Rank (?P<rank>\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(?P<seq>\d+),?"
    r" ?OpType=(?P<op>\w+)(?:, TensorShape=\[(?P<shape>[^\]]*)\], TensorDtypes=(?P<dtypes>.*?), "
    r"TensorDeviceTypes=(?P<devices>.*?device=(?P<device>\w+))?)?"
)
_ASPECTS = {"Sequence number": "sequence number", "Op type": "op type",
            "Tensor shapes": "tensor shapes", "Tensor dtypes": "dtypes",
            "Tensor devices": "devices"}  # fmt: skip


@dataclass(frozen=True)
class Fingerprint:
    """What one rank was about to run, as DETAIL's check printed it: the collective (``op``, in
    c10d's names: ALLREDUCE, ALLGATHER, BROADCAST, BARRIER...), its sequence number in that
    rank's group (``seq``, from 0: the third collective is 2), the first input tensor's shape
    (None: a collective without tensors), the input dtypes and the device type."""

    rank: int
    seq: int
    op: str
    shape: tuple[int, ...] | None = None
    dtypes: str = ""
    device: str = ""

    @property
    def key(self) -> tuple:
        """What must agree across ranks for the collective to run."""
        return self.op, self.shape, self.dtypes, self.device

    def __str__(self) -> str:
        if self.shape is None:
            return f"rank {self.rank} ran {self.op}"
        shape = ", ".join(map(str, self.shape))
        return f"rank {self.rank} ran {self.op} [{shape}] {self.dtypes}".rstrip()


@dataclass(frozen=True)
class CollectiveMismatch:
    """DETAIL's mismatch report from one rank: its own fingerprint (``this``), the first other
    rank's that differs (``other``), and the aspects torch says differ."""

    this: Fingerprint
    other: Fingerprint
    aspects: tuple[str, ...]

    def __str__(self) -> str:
        # c10d's sequence number counts a group's collectives from 0
        seq = (f"sequence number {self.this.seq} on both" if self.this.seq == self.other.seq else
               f"sequence numbers {self.this.seq} and {self.other.seq}")  # fmt: skip
        differ = " and ".join(self.aspects) or "an aspect torch did not name"
        return f"{self.this}, {self.other} ({seq}): they differ in {differ}"


def collective_mismatch(text: str) -> CollectiveMismatch | None:
    """The mismatch ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` reported in ``text`` (an exception
    message, a rank's log), or None if there is none."""
    start = text.find("Detected mismatch between collectives on ranks")
    if start < 0:
        return None
    found = []
    for m in _FINGERPRINT.finditer(text, start):
        shape = m["shape"]
        found.append(Fingerprint(
            int(m["rank"]), int(m["seq"]), m["op"],
            None if shape is None else tuple(int(s) for s in shape.split(",") if s.strip()),
            (m["dtypes"] or "").strip(), m["device"] or "",
        ))  # fmt: skip
        if len(found) == 2:
            break
    if len(found) < 2:
        return None
    _, _, tail = text[start:].partition("differ in the following aspects:")
    aspects = tuple(name for key, name in _ASPECTS.items() if key in tail)
    return CollectiveMismatch(found[0], found[1], aspects)


def odd_ones_out(prints: Sequence[Fingerprint], nproc: int) -> list[int]:
    """The ranks whose collective differs from what a strict majority of all ``nproc`` ranks
    run, from the fingerprints seen (several reports may name the same rank); [] when no
    majority is known (two ranks that disagree: either may be the wrong one)."""
    by_rank = {f.rank: f.key for f in prints}
    counts: dict[tuple, int] = {}
    for key in by_rank.values():
        counts[key] = counts.get(key, 0) + 1
    if not counts:
        return []
    key, n = max(counts.items(), key=lambda kv: kv[1])
    if 2 * n <= nproc:
        return []
    return sorted(r for r, k in by_rank.items() if k != key)
