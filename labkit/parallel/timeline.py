"""Per-rank timelines of a pipeline step: record them, measure the bubble, draw the Gantt chart.

An event is a plain dict, the same for measured and simulated timelines:

    {"rank": 1, "mb": 3, "kind": "F", "start_s": 0.0123, "end_s": 0.0151}

``kind`` is "F" (forward of one micro-batch on that rank's stage) or "B" (its backward);
times are seconds from a start that every rank shares (``common_t0``).

The bubble of rank r is the part of the pipeline step in which r computes nothing:

    bubble_r = 1 − busy_r / step,   step = last end − first start over *all* ranks

With equal stages and free communication this is GPipe's (p−1)/(m+p−1) on every rank
(``labkit.formulas.bubble_fraction``). Measured, it also contains what the formula leaves out:
sending and receiving, the loss, copies, and stages of unequal cost.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as tdist

from labkit.jobs.runtime import collective_device

Event = dict[str, Any]


def common_t0(clock: Callable[[], float] = time.perf_counter, group: Any = None) -> float:
    """A start time every rank agrees on: rank 0's clock reading, broadcast after a barrier.

    ``time.perf_counter`` is CLOCK_MONOTONIC on Linux, one clock for every process of a host,
    so events of ranks on one machine line up. Ranks on several hosts should pass
    ``clock=time.time`` (wall clocks synchronised by NTP, to about a millisecond).
    """
    tdist.barrier(group=group)
    # float64: µs resolution over days. On the collective's device: an NCCL group has no CPU
    # backend, so a CPU tensor would fail there.
    t0 = torch.tensor([clock()], dtype=torch.float64, device=collective_device(group))
    tdist.broadcast(t0, src=0, group=group)
    return float(t0.item())


class Timeline:
    """Collects one rank's events. ``clock`` is injectable so tests need no sleeping."""

    def __init__(
        self, rank: int, t0: float = 0.0, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.rank, self.t0, self.clock = rank, t0, clock
        self.events: list[Event] = []

    def now(self) -> float:
        """Seconds since the shared start."""
        return self.clock() - self.t0

    def add(self, kind: str, mb: int, start_s: float, end_s: float) -> None:
        if kind not in ("F", "B"):
            raise ValueError(f"kind={kind!r}: use 'F' (forward) or 'B' (backward)")
        self.events.append(
            {"rank": self.rank, "mb": int(mb), "kind": kind, "start_s": start_s, "end_s": end_s}
        )

    @contextlib.contextmanager
    def span(self, kind: str, mb: int) -> Iterator[None]:
        """Record the enclosed block as one event."""
        start = self.now()
        yield
        self.add(kind, mb, start, self.now())

    def clear(self) -> None:
        self.events.clear()


def bubble_from_events(events: Iterable[Event]) -> dict[int, dict[str, float]]:
    """Per-rank busy time, idle time and bubble fraction of one pipeline step.

    Returns {rank: {"busy_s", "idle_s", "step_s", "bubble"}}, where ``step_s`` is the span of
    the whole step over all ranks (first start to last end) and ``bubble = idle_s / step_s``.
    Compare with ``formulas.bubble_fraction(p, m)``; ``idle_s / busy_s`` compares with
    ``formulas.bubble_overhead(p, m)``.
    """
    events = list(events)
    if not events:
        raise ValueError("events is empty: record at least one forward or backward")
    start = min(e["start_s"] for e in events)
    step = max(e["end_s"] for e in events) - start
    if step <= 0:
        raise ValueError("events span no time (every end equals its start)")
    out: dict[int, dict[str, float]] = {}
    for rank in sorted({e["rank"] for e in events}):
        busy = sum(e["end_s"] - e["start_s"] for e in events if e["rank"] == rank)
        out[rank] = {
            "busy_s": busy,
            "idle_s": step - busy,
            "step_s": step,
            "bubble": (step - busy) / step,
        }
    return out


def mean_bubble(events: Iterable[Event]) -> float:
    """The bubble fraction averaged over ranks."""
    per_rank = bubble_from_events(events)
    return sum(r["bubble"] for r in per_rank.values()) / len(per_rank)


def plot_timeline(
    events: Iterable[Event], ax: Any = None, *, title: str | None = None, unit: str = "ms"
) -> Any:
    """Draw a Gantt chart: one row per rank, forwards light, backwards dark, labelled by mb.

    White space in a row is that rank's bubble. ``unit``: "s", "ms" or "us" for measured
    timestamps (in seconds), or "forward" for a modelled schedule whose clock counts units of
    one forward (``schedules.simulate``). Returns the matplotlib Axes. matplotlib is
    imported here, not at module import, so recording events needs no plotting library.
    """
    import matplotlib.pyplot as plt  # lazy: importing labkit must stay cheap

    scale = {"s": 1.0, "ms": 1e3, "us": 1e6, "forward": 1.0}.get(unit)
    if scale is None:
        raise ValueError(f"unit={unit!r}: use 's', 'ms', 'us' or 'forward'")
    events = list(events)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 + 0.5 * len({e["rank"] for e in events})))
    # F forward, B whole backward; I and W: the backward split in two (zero-bubble schedules)
    colors = {"F": "#7fb3e6", "B": "#1f5f99", "I": "#1f5f99", "W": "#e69f00"}
    for e in events:
        left, width = e["start_s"] * scale, (e["end_s"] - e["start_s"]) * scale
        ax.barh(
            e["rank"],
            width,
            left=left,
            height=0.8,
            color=colors[e["kind"]],
            edgecolor="white",
            linewidth=0.5,
        )
        ax.text(
            left + width / 2,
            e["rank"],
            f"{e['kind']}{e['mb']}",
            ha="center",
            va="center",
            fontsize=7,
            color="white" if e["kind"] in ("B", "I") else "black",
        )
    ranks = sorted({e["rank"] for e in events})
    ax.set_yticks(ranks, [f"stage {r}" for r in ranks])
    ax.invert_yaxis()  # stage 0 on top, as in the GPipe and Megatron figures
    ax.set_xlabel("time (units of one forward)" if unit == "forward" else f"time ({unit})")
    if title:
        ax.set_title(title)
    return ax
