"""Timing that owns synchronisation, warm-up and repeats.

GPU work is asynchronous: a CUDA kernel launch returns to Python long before the kernel
finishes, so ``time.perf_counter()`` around a GPU call measures the launch, not the work
(PyTorch "CUDA semantics: asynchronous execution"). Every timer here therefore
synchronises the device before it reads the clock, and on CUDA it times with CUDA events,
which are recorded in the stream and so bracket exactly the queued work.

The first calls of anything are slow (allocator growth, kernel selection, lazy
initialisation), so :func:`benchmark` runs warm-up calls that it does not count and
reports the median and spread of the repeats that follow, with the device and versions it
ran on and the method it used.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from labkit.tables import html_table
from labkit.validate import whole


def as_device(device: torch.device | str) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def synchronize(device: torch.device | str) -> None:
    """Wait until all work queued on ``device`` has finished (a no-op on CPU).

    CPU operators in PyTorch run synchronously in the calling thread, so there is nothing
    to wait for; on CUDA this blocks until the device's streams are idle.
    """
    device = as_device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":  # pragma: no cover - no Apple GPU in CI
        torch.mps.synchronize()


def versions() -> dict[str, str]:
    """Software versions a timing depends on."""
    v = {"python": platform.python_version(), "torch": torch.__version__}
    if torch.version.cuda:
        v["cuda"] = torch.version.cuda
    return v


@dataclass(frozen=True)
class TimingResult:
    """Seconds per call of one timed function. ``samples_s`` are the counted repeats."""

    name: str
    samples_s: tuple[float, ...]
    device: str
    method: str
    warmup: int
    versions: dict[str, str] = field(default_factory=versions)

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def min_s(self) -> float:
        return min(self.samples_s)

    @property
    def max_s(self) -> float:
        return max(self.samples_s)

    @property
    def spread(self) -> float:
        """(max - min) / median: how much the repeats disagree, as a fraction."""
        return (self.max_s - self.min_s) / self.median_s if self.median_s > 0 else 0.0

    @property
    def quartiles_s(self) -> tuple[float, float]:
        """(first, third) quartile of the repeats: the middle half of them lies in between.

        Unlike min and max, one repeat slowed by another process on a shared machine moves
        them little. Linear interpolation between order statistics (``statistics.quantiles``
        with ``method="inclusive"``, numpy's default); one repeat gives (it, it).
        """
        return quartiles(self.samples_s)

    @property
    def iqr_s(self) -> float:
        """The interquartile range, third quartile minus first: the middle half's width."""
        q1, q3 = self.quartiles_s
        return q3 - q1

    def to_dict(self) -> dict:
        return {
            "name": self.name, "median_s": self.median_s, "min_s": self.min_s,
            "max_s": self.max_s, "repeats": len(self.samples_s), "warmup": self.warmup,
            "device": self.device, "method": self.method, "versions": self.versions,
        }

    def __str__(self) -> str:
        return (f"{self.name}: median {format_seconds(self.median_s)} "
                f"(min {format_seconds(self.min_s)}, max {format_seconds(self.max_s)}, "
                f"n={len(self.samples_s)}) on {self.device}, {self.method}")

    def _repr_html_(self) -> str:
        return table([self])._repr_html_()


def format_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} µs"


@dataclass(frozen=True)
class Table:
    """Timing results side by side; renders as an HTML table in a notebook."""

    results: Sequence[TimingResult]

    def _rows(self) -> list[list[str]]:
        return [[r.name, format_seconds(r.median_s), f"{100 * r.spread:.1f}%",
                 str(len(r.samples_s)), r.device, r.method] for r in self.results]

    _HEAD = ("what", "median", "spread", "repeats", "device", "method")

    def __str__(self) -> str:
        rows = [list(self._HEAD), *self._rows()]
        widths = [max(len(row[i]) for row in rows) for i in range(len(self._HEAD))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
                         for row in rows)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return html_table(self._HEAD, self._rows())


def table(results: Sequence[TimingResult]) -> Table:
    return Table(tuple(results))


class Timer:
    """Times one region on ``device``, synchronising so the region's device work is counted.

        with Timer("cuda") as t:
            y = model(x)
        t.elapsed_s

    On CUDA it records CUDA events around the region; elsewhere it reads ``clock``
    (``time.perf_counter`` unless a test injects another) after synchronising.
    """

    def __init__(self, device: torch.device | str = "cpu", *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.device = as_device(device)
        self.clock = clock
        self.elapsed_s = float("nan")
        self._use_events = self.device.type == "cuda"

    @property
    def method(self) -> str:
        return "CUDA events" if self._use_events else "perf_counter after synchronize"

    def __enter__(self) -> Timer:
        if self._use_events:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            synchronize(self.device)
            self._t0 = self.clock()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._use_events:
            self._end.record()
            self._end.synchronize()
            self.elapsed_s = self._start.elapsed_time(self._end) / 1e3  # ms -> s
        else:
            synchronize(self.device)
            self.elapsed_s = self.clock() - self._t0


def benchmark(
    fn: Callable[[], object],
    *,
    device: torch.device | str = "cpu",
    warmup: int = 2,
    repeats: int = 5,
    name: str | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> TimingResult:
    """Call ``fn`` ``warmup`` times uncounted, then time ``repeats`` calls one by one."""
    if warmup < 0:
        raise ValueError(f"warmup={warmup!r} is not allowed: zero or more")
    if repeats < 1:
        raise ValueError(f"repeats={repeats!r} is not allowed: one or more")
    device = as_device(device)
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    timer = Timer(device, clock=clock)
    for _ in range(repeats):
        with timer:
            fn()
        samples.append(timer.elapsed_s)
    return TimingResult(
        name=name or getattr(fn, "__name__", "fn"), samples_s=tuple(samples),
        device=str(device), method=timer.method, warmup=warmup,
    )


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """(first, third) quartile of ``values`` by linear interpolation (``statistics.quantiles``
    with ``method="inclusive"``, numpy's default); one value gives (it, it)."""
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def pooled(results: Sequence[TimingResult], name: str | None = None) -> TimingResult:
    """One result holding the repeats of several results of the same timer.

    Measure two things in alternating rounds (A, B, A, B, ...) and pool each one's rounds:
    a burst of load on a shared machine then falls on both instead of on whichever happened
    to run during it.
    """
    if not results:
        raise ValueError("results is empty: pool at least one TimingResult")
    first = results[0]
    odd = [r.name for r in results if (r.device, r.method) != (first.device, first.method)]
    if odd:
        raise ValueError(f"results {odd} were timed differently from {first.name!r} "
                         f"({first.method} on {first.device}): pool only like with like")
    return TimingResult(
        name=name or first.name,
        samples_s=tuple(s for r in results for s in r.samples_s),
        device=first.device, method=first.method, warmup=first.warmup, versions=first.versions,
    )


def unsynchronized(fn: Callable[[], object], *, device: torch.device | str = "cpu",
                   repeats: int = 5,
                   clock: Callable[[], float] = time.perf_counter) -> TimingResult:
    """The wrong way, kept for teaching: clock reads with no synchronisation.

    On a GPU this measures how long it takes to *queue* the work. Notebook 01 shows it
    side by side with :func:`benchmark` to make asynchronous execution visible.
    """
    samples = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        samples.append(clock() - t0)
    return TimingResult(name=getattr(fn, "__name__", "fn") + " (no sync)",
                        samples_s=tuple(samples), device=str(as_device(device)),
                        method="perf_counter, no synchronize", warmup=0)


def alternate(
    fns: Mapping[str, Callable[[], float]],
    *,
    rounds: int,
    warmup: int = 0,
    swap: bool = True,
    on_round: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, list[float]]:
    """Call each of ``fns`` once per round, interleaved, and collect what each returns.

    Each function returns one sample (seconds). Round r calls them in the given order, or in
    reverse order when ``swap`` is set and r is odd (A B, B A, A B, ...). The first ``warmup``
    rounds are run the same way but not kept.

    Returns:
        {name: [sample of each counted round]}, ``rounds`` samples per name.
    """
    if not fns:
        raise ValueError("fns is empty: pass at least one name -> function")
    rounds = whole("rounds", rounds, low=1)
    warmup = whole("warmup", warmup, low=0)
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + rounds):
        order = names[::-1] if swap and r % 2 else names
        got = {name: float(fns[name]()) for name in order}
        if r >= warmup:
            for name in names:
                samples[name].append(got[name])
        if on_round is not None:
            on_round(r - warmup, got)  # negative index: a warm-up round
    return samples


def explain_sync(comparison: Any, device_type: str) -> str:
    """What a comparison of the unsynchronised timer ("no sync", :func:`unsynchronized`) with
    the synchronised one means on ``device_type``: the sentence the measurement chooses.

    ``comparison`` is a :class:`labkit.verdict.Comparison` (read through its ``outcome``,
    ``faster`` and ``slower``; verdict sits above this module), its first sample named
    "no sync".
    """
    outcome, faster, slower = comparison.outcome, comparison.faster, comparison.slower
    launch_only = outcome == "faster" and faster.name == "no sync"
    if device_type == "cuda" and launch_only:
        ratio = slower.median / faster.median
        return (f"On this GPU the synchronised time is {ratio:.0f}x the unsynchronised one: "
                "without a sync you time the launch, not the work.")
    if device_type == "cuda":
        return ("On this GPU the two timers did not clearly differ, so the matmul is too short "
                "to tell the launch from the work; raise n.")
    if outcome == "agree":
        return ("On a CPU, PyTorch runs each operator to completion before returning, so both "
                "timers measure the same work and agree.\nExpected on a GPU, not measured here: "
                "the unsynchronised number would be the launch overhead alone, microseconds,\n"
                "while the synchronised one is the matmul itself.")
    return ("On a CPU both timers measure the same completed work (PyTorch runs each operator "
            "to completion before returning),\nso any difference here comes from other work on "
            "this machine, not from asynchrony.\nExpected on a GPU, not measured here: the "
            "unsynchronised number would be the launch overhead alone, microseconds.")
