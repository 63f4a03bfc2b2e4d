"""The evidence a job leaves, found and first sorted: which ranks a job folder holds, each rank's
torchrun log, and which error messages are the echo of another rank's trouble.

A rank that fails while waiting for a peer ("Connection closed by peer", a collective that timed
out) did not cause the failure; it followed it. Telling the two kinds of message apart is the
first step of every diagnosis in ``labkit.jobs``: the failure report
(:mod:`labkit.jobs.diagnosis`), the ledger of collectives that calls back on the first echo
(:mod:`labkit.jobs.diagnosis.collective_ledger`) and the exercise checks that report a rank's own error
before its peers'. It is a module of its own so that each of them can import it without the
others.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from pathlib import Path


def rank_list(ranks: int | Sequence[int]) -> list[int]:
    """Ranks given as a count n (ranks 0..n-1, one machine) or as the ranks a node holds."""
    return list(range(ranks)) if isinstance(ranks, int) else list(ranks)


def rank_log_path(job_dir: Path, rank: int, stream: str = "stdout") -> Path | None:
    """Rank ``rank``'s log file written by torchrun (``--log-dir``), or None."""
    if stream not in ("stdout", "stderr"):
        raise ValueError(f"stream={stream!r}: use 'stdout' or 'stderr'")
    found = sorted(Path(job_dir).glob(f"torchrun/*/attempt_*/{rank}/{stream}.log"))
    return found[-1] if found else None


def tail(path: Path | None, n: int) -> str:
    """The last ``n`` lines of a log ("" where there is none or it cannot be read)."""
    if path is None:
        return ""
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").rstrip().splitlines()[-n:])
    return ""


# A rank that saw its peer vanish fails with one of these (gloo's TCP transport, NCCL's
# "remote process exited", a closed TCPStore socket). Its failure is a consequence.
_PEER_GONE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited"
    r"|failed to recv, got 0 bytes|Socket closed|peer .* (?:died|crashed)",
    re.IGNORECASE,
)


def is_peer_gone(text: str) -> bool:
    """Whether an error message says a peer rank vanished ("Connection closed by peer"...):
    the failure of a rank that was waiting for another, not its own."""
    return bool(_PEER_GONE.search(text))


# A rank whose collective timed out waited for a peer that never came (gloo's "Timed out
# waiting ... for recv", NCCL's watchdog): usually the echo of a peer stuck elsewhere.
# TORCH_DISTRIBUTED_DEBUG=DETAIL runs a monitored barrier before each collective: a rank that
# never arrives is named there ("[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 3000 ms").
# gloo closes a pair when the peer's own wait timed out first: this side then reads
# "Application timeout caused pair closure" (gloo/transport/tcp/pair.cc), as much an echo.
_WAIT_TIMEOUT = re.compile(
    r"Timed out waiting|Watchdog caught collective operation timeout|Socket Timeout"
    r"|failed to pass monitoredBarrier|Application timeout caused pair closure",
    re.IGNORECASE,
)


def is_wait_timeout(text: str) -> bool:
    """Whether an error message says a collective timed out waiting for a peer (or DETAIL's
    monitored barrier named a rank that never arrived)."""
    return bool(_WAIT_TIMEOUT.search(text))


def is_echo(text: str) -> bool:
    """Whether an error message is the echo of another rank's trouble: its peer vanished, or a
    collective timed out waiting for a peer."""
    return is_peer_gone(text) or is_wait_timeout(text)
