"""The collectives each rank called, recorded as it calls them and compared across ranks.

Every rank must call the same collectives in the same order. When one does not, every rank's
error is an echo that names neither the collective nor the rank that skipped it; a ledger kept
by each rank (:class:`CollectiveLedger`), compared afterwards (:func:`collectives_apart`), says
both. The worker side (recording, by wrapping ``torch.distributed``) and the reading side live
together because they share one file format; both are apart from the failure report
(:mod:`labkit.jobs.diagnosis`), which needs neither.
"""

from __future__ import annotations

import contextlib
import functools
import json
import linecache
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from labkit.jobs.diagnosis.evidence import is_echo, rank_list
from labkit.jobs.diagnosis.tracebacks import PACKAGE_DIR, in_library, one_line

# Every rank must call the same collectives in the same order. When one does not (a collective
# under `if rank == 0:`), gloo pairs the lone call with whatever the other rank calls next, or
# waits until the process group's timeout; then every rank's error is an echo ("Timed out
# waiting", "Connection closed by peer", "Application timeout caused pair closure") that names
# neither the collective nor the rank that skipped it. A ledger that each rank keeps, one JSON
# line per collective written as it is called (so a rank killed later still leaves it), says
# both: compared across ranks, the first entry where two ranks differ is the call one of them
# never made.

LEDGER_DIR = "collectives"
"""The folder of a job's ledgers: ``<job_dir>/collectives/rank<r>.jsonl``."""

LEDGER_COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter",
    "barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list",
    "gather_object", "scatter_object_list",
)  # fmt: skip
"""What a ledger records, by its name in ``torch.distributed``: calls every rank of the group
makes. Point-to-point ``send``/``recv`` pair two ranks, each its own way, and are left out."""


def ledger_path(job_dir: Path, rank: int) -> Path:
    """Rank ``rank``'s ledger of collectives in the job folder ``job_dir``."""
    return Path(job_dir) / LEDGER_DIR / f"rank{rank}.jsonl"


class CollectiveLedger:
    """Records, while :meth:`recording`, every collective this process calls through
    ``torch.distributed`` (:data:`LEDGER_COLLECTIVES`): its name, its number in this rank's
    sequence, the process group's ranks (when not the default group) and where it was called.

    "Where" is the innermost frame of code outside labkit and the installed packages (the
    worker's or a learner's file: ``"yours": true``), else the innermost of labkit's own. A
    collective that calls another (``all_gather_object`` calls ``all_gather``) is one entry.
    The block's end is the last line: ``{"end": "returned"}`` or ``{"end": "raised", ...}``.

    ``on_echo()``, if given, is called once, when a recorded collective first fails with an
    echo (:func:`is_echo`: it timed out waiting, its peer went): the moment to ask the other
    ranks where they are, before the job ends them.
    """

    def __init__(self, path: Path, on_echo: Callable[[], None] | None = None) -> None:
        self.path = Path(path)
        self.count = 0
        self._depth = 0
        self._file: TextIO | None = None
        self._on_echo = on_echo

    @contextlib.contextmanager
    def recording(self) -> Iterator[CollectiveLedger]:
        import torch.distributed as tdist
        import torch.distributed.distributed_c10d as c10d

        # labkit's own calls go through torch.distributed; c10d's own (all_gather_object's
        # all_gather) through its module globals: both are wrapped, the inner call not counted.
        saved = [(module, name, getattr(module, name)) for module in (tdist, c10d)
                 for name in LEDGER_COLLECTIVES if hasattr(module, name)]  # fmt: skip
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        for module, name, fn in saved:
            setattr(module, name, self._wrap(name, fn))
        try:
            yield self
        except BaseException as err:
            self._write({"end": "raised", "error": one_line(f"{type(err).__name__}: {err}")})
            raise
        else:
            self._write({"end": "returned"})
        finally:
            for module, name, fn in saved:
                setattr(module, name, fn)
            if self._file is not None:
                self._file.close()
                self._file = None

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self.count += 1
            entry = {"n": self.count, "op": name, **_called_from(sys._getframe(1))}
            group = _group_ranks(args, kwargs)
            if group is not None:
                entry["group"] = group
            self._write(entry)
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            except Exception as err:
                if self._on_echo is not None and is_echo(str(err)):
                    on_echo, self._on_echo = self._on_echo, None
                    with contextlib.suppress(Exception):  # evidence only: never mask the error
                        on_echo()
                raise
            finally:
                self._depth -= 1

        return recorded

    def _write(self, entry: dict[str, Any]) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError, ValueError):  # a full disk must not fail the job
                self._file.write(json.dumps(entry) + "\n")


def _called_from(frame: Any) -> dict[str, Any]:
    """{"file", "line", "func", "code", "yours"} of the frame that called a collective."""
    own = None
    while frame is not None:
        path = frame.f_code.co_filename
        if not in_library(path) and path != __file__:
            if not path.startswith(PACKAGE_DIR):
                return {**_frame_fields(frame), "yours": True}
            own = own or frame
        frame = frame.f_back
    return {**_frame_fields(own), "yours": False} if own is not None else {"yours": False}


def _frame_fields(frame: Any) -> dict[str, Any]:
    path, line = frame.f_code.co_filename, frame.f_lineno
    return {"file": path, "line": line, "func": frame.f_code.co_name,
            "code": linecache.getline(path, line).strip()}  # fmt: skip


def _group_ranks(args: Sequence[Any], kwargs: dict[str, Any]) -> list[int] | None:
    """The ranks of the process group a collective was called on; None for the default one."""
    import torch.distributed as tdist

    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, tdist.ProcessGroup)), None)
    if group is None or group is tdist.GroupMember.WORLD:
        return None
    with contextlib.suppress(Exception):  # a group this rank is not in: no ranks to tell
        return list(tdist.get_process_group_ranks(group))
    return None


@dataclass
class RankLedger:
    """One rank's ledger as read back: its collectives in order, and how the block ended
    (None: the rank was stopped before it ended, or never started one)."""

    rank: int
    calls: list[dict[str, Any]]
    end: dict[str, Any] | None = None


def read_ledgers(job_dir: Path, nproc: int | Sequence[int]) -> dict[int, RankLedger]:
    """{rank: its ledger} for the ranks of ``job_dir`` that kept one (a line cut short by a
    kill is skipped)."""
    found = {}
    for rank in rank_list(nproc):
        try:
            lines = ledger_path(job_dir, rank).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        ledger = RankLedger(rank, [])
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and "end" in entry:
                ledger.end = entry
            elif isinstance(entry, dict) and "op" in entry:
                ledger.calls.append(entry)
        found[rank] = ledger
    return found


def _shared(ledger: RankLedger, a: int, b: int) -> list[dict[str, Any]]:
    """The calls of ``ledger`` on groups both ranks ``a`` and ``b`` belong to, in order."""
    return [c for c in ledger.calls if c.get("group") is None or {a, b} <= set(c["group"])]


def _same(c: dict[str, Any], d: dict[str, Any]) -> bool:
    return all(c.get(key) == d.get(key) for key in ("op", "file", "line"))


@dataclass(frozen=True)
class CollectivesApart:
    """Where two ranks' sequences of collectives first differ: ``rank`` called ``call`` as its
    collective number ``position`` (counted in the sequence they share), which ``other`` did
    not call there. ``instead``: what ``other`` called there (None: nothing more);
    ``other_end``: how ``other``'s block ended (None: it was stopped first); ``later``:
    ``other`` did call the same collective, further on."""

    rank: int
    call: dict[str, Any]
    other: int
    instead: dict[str, Any] | None
    other_end: dict[str, Any] | None
    later: bool
    position: int

    @property
    def yours(self) -> bool:
        """Whether either call at the split was made by code outside labkit (a learner's)."""
        return bool(self.call.get("yours") or (self.instead or {}).get("yours"))

    def describe(self, own: str = "labkit's own") -> str:
        """The sentence: which rank called which collective, where, that the other rank
        never called. ``own`` names labkit's calls ("the check's own")."""
        nth = _ordinal(self.position)
        head = f"rank {self.rank} called {describe_call(self.call, own)}, its {nth} collective"
        if self.instead is not None:
            there = f"its {nth} was {describe_call(self.instead, own)}"
            if self.later:
                return (f"{head}, but rank {self.other} did not call it there: {there}, and it "
                        "called the other only later")  # fmt: skip
            return f"{head}, and rank {self.other} never called it: {there}"
        end = self.other_end or {}
        if end.get("end") == "returned":
            why = (f"it had finished after {self.position - 1} collectives, the same as rank "
                   f"{self.rank}'s")  # fmt: skip
        elif end.get("end") == "raised":
            why = f"it had stopped with {end.get('error', 'an error')}"
        else:
            why = "it was still elsewhere when the job ended"
        return f"{head}, and rank {self.other} never called it: {why}"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def describe_call(call: dict[str, Any], own: str = "labkit's own") -> str:
    """"dist.all_reduce at file.py, line 15, in f (`code`)" for a ledger entry; a call of
    labkit's own is named as ``own``'s."""
    name = f"dist.{call.get('op', '?')}"
    if not call.get("file"):
        return name
    where = f"{os.path.basename(call['file'])}, line {call.get('line')}, in {call.get('func')}"
    if not call.get("yours"):
        return f"{own} {name} ({where})"
    code = call.get("code")
    return f"{name} at {where}" + (f" (`{code}`)" if code else "")


def collectives_apart(ledgers: dict[int, RankLedger]) -> CollectivesApart | None:
    """The first place where two ranks' ledgers differ, or None if they all agree.

    Each pair of ranks is compared on the collectives of groups both are in. Of the pairs that
    differ, the one that differs earliest is reported. At that place, the call named as never
    made is the one the other rank never made anywhere, then a learner's over labkit's: the
    other rank's own call there is most often the check carrying on without it.
    """
    best: tuple[int, CollectivesApart] | None = None
    ranks = sorted(ledgers)
    for i, a in enumerate(ranks):
        for b in ranks[i + 1:]:
            la, lb = _shared(ledgers[a], a, b), _shared(ledgers[b], a, b)
            pairs = enumerate(zip(la, lb, strict=False))
            k = next((k for k, (c, d) in pairs if not _same(c, d)), min(len(la), len(lb)))
            if k == len(la) == len(lb):
                continue
            found = _apart_at(k, (a, la, ledgers[a].end), (b, lb, ledgers[b].end))
            if best is None or k < best[0]:
                best = (k, found)
    return best[1] if best else None


def _apart_at(
    k: int,
    side_a: tuple[int, list[dict[str, Any]], dict[str, Any] | None],
    side_b: tuple[int, list[dict[str, Any]], dict[str, Any] | None],
) -> CollectivesApart:
    options = []
    for (r, mine, _), (o, theirs, end) in ((side_a, side_b), (side_b, side_a)):
        if k >= len(mine):
            continue
        call = mine[k]
        later = any(_same(call, d) for d in theirs[k + 1:])
        instead = theirs[k] if k < len(theirs) else None
        # never made anywhere first, then a learner's call, then the lower rank
        options.append(((later, not call.get("yours"), r),
                        CollectivesApart(r, call, o, instead, end, later, k + 1)))  # fmt: skip
    return min(options, key=lambda o: o[0])[1]
