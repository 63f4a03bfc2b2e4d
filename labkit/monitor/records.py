"""What a monitor records and what it reports: step and part events, series, the summary table.

Apart from the figure (:mod:`labkit.monitor.figure`) and the Monitor
(:mod:`labkit.monitor.watch`) because these are pure functions of samples: no drawing, no
clock, no display, so a notebook check or a test reads the numbers without matplotlib. A
reading the device did not report (N/A) stays N/A here: a NaN in a series, counted apart in
the summary, never a zero (``labkit.metrics.base``).
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from labkit.metrics import METRICS, Sample
from labkit.tables import html_table

# Panels shown by default, per backend kind. On the GPU tiers: is a kernel running, how full
# is memory, how hard is the board working, and, on Hopper and newer, how busy the SMs and
# tensor cores really are (gpu_util_pct alone over-states it: see METRICS). On the CPU tier:
# each rank's CPU and memory, and the whole host (ranks compete for its cores).
DEFAULT_METRICS: dict[str, tuple[str, ...]] = {
    "nvml": ("gpu_util_pct", "sm_active_pct", "tensor_active_pct", "mem_used_gib", "power_w"),
    "replay": ("gpu_util_pct", "sm_active_pct", "tensor_active_pct", "mem_used_gib", "power_w"),
    "cpu": ("cpu_pct", "rss_gib", "host_cpu_pct"),
}
# Default panels dropped when the device never reports them (pre-Hopper GPUs have no GPM):
# an empty panel would only take room. A metric the caller asked for is always drawn.
OPTIONAL_METRICS = frozenset({"sm_active_pct", "tensor_active_pct"})


@dataclass(frozen=True)
class StepEvent:
    """Rank ``rank`` reached step ``step`` at ``time_s`` (seconds on the sampler's clock).

    From a launched job the step comes from the rank's heartbeat file, read every ~0.25 s:
    steps shorter than that are thinned (only the latest one of each tick is seen), and the
    time is the heartbeat's own time stamp, so it is exact for the steps that are seen.
    """

    rank: int
    step: int
    time_s: float


@dataclass(frozen=True)
class PartEvent:
    """The job began ``part`` at ``time_s`` (seconds on the sampler's clock).

    A worker that does several things one after another names the one running in its
    heartbeat (``ctx.heartbeat(part="ddp (3/8)")``, see ``labkit.jobs.runtime``). The time is that of
    the first heartbeat naming it that the monitor read, so it can be up to one heartbeat and
    one supervision tick (~0.25 s) late.
    """

    part: str
    time_s: float


@dataclass(frozen=True)
class SummaryRow:
    """One metric of one source over the run. ``mean``/``max`` are None when every reading
    was N/A; ``n`` counts the readings with a value, ``n_na`` those without."""

    source: str
    metric: str
    unit: str
    mean: float | None
    max: float | None
    n: int
    n_na: int


@dataclass
class Summary:
    """The table shown under the final figure; also handy in tests and notebook checks.

    Attributes:
        describe: the backend's one-line description (hardware, or why there is no GPU, or
            the recording it replays).
        status: how the run ended: "ok", the job's status ("failed", "timeout",
            "interrupted"), or "error: <exception>" for a ``with`` block that raised.
        duration_s: seconds from the first to the last sample.
        n_samples: samples recorded (all sources).
        last_step: rank -> the last step seen.
        rows: one per (source, metric) drawn.
    """

    describe: str
    status: str
    duration_s: float
    n_samples: int
    last_step: dict[int, int] = field(default_factory=dict)
    rows: list[SummaryRow] = field(default_factory=list)

    def row(self, source: str, metric: str) -> SummaryRow:
        for r in self.rows:
            if r.source == source and r.metric == metric:
                return r
        have = sorted({(r.source, r.metric) for r in self.rows})
        raise KeyError(f"no row for source={source!r}, metric={metric!r}; have {have}")

    @property
    def sources(self) -> list[str]:
        return list(dict.fromkeys(r.source for r in self.rows))

    def _header(self) -> list[str]:
        steps = ", ".join(f"rank{r} step {s}" for r, s in sorted(self.last_step.items()))
        return [
            self.describe,
            f"{self.status}; {self.n_samples} samples over {self.duration_s:.1f} s"
            + (f"; last steps: {steps}" if steps else ""),
        ]

    _HEAD = ("source", "metric", "unit", "mean", "max", "samples", "N/A")

    def _cells(self) -> list[list[str]]:
        return [
            [r.source, r.metric, r.unit, _num(r.mean), _num(r.max), str(r.n), str(r.n_na)]
            for r in self.rows
        ]

    def __str__(self) -> str:
        rows = [list(self._HEAD), *self._cells()]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        table = ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
        return "\n".join([*self._header(), *table])

    def _repr_html_(self) -> str:
        top = "<br>".join(html.escape(s) for s in self._header())
        table = html_table(self._HEAD, self._cells())
        return f"<div class='labkit-monitor-summary'>{top}{table}</div>"


def _num(v: float | None) -> str:
    return "N/A" if v is None else f"{v:.3g}"


# --- pure helpers: series, summary, figure ------------------------------------------------------


def series(
    samples: Iterable[Sample], source: str, metric: str, t0: float = 0.0
) -> tuple[list[float], list[float]]:
    """(seconds since ``t0``, values) of one metric of one source, ready for ``plot``.

    N/A (``None``) becomes NaN, which matplotlib draws as a gap: a missing reading must not
    look like a zero. Samples where the metric was not read at all (absent key, e.g. a rank
    that exited) are left out.
    """
    xs, ys = [], []
    for s in samples:
        if s.source == source and metric in s.values:
            v = s.values[metric]
            xs.append(s.time_s - t0)
            ys.append(math.nan if v is None else float(v))
    return xs, ys


def sources_of(samples: Iterable[Sample], metric: str) -> list[str]:
    """Sources that reported ``metric`` at least once, in a stable, readable order."""
    found = {s.source for s in samples if metric in s.values}
    return sorted(found, key=_source_order)


def _source_order(source: str) -> tuple[int, str, int, str]:
    # gpu0 < gpu1 < gpu0/rank1 < rank0 < rank1 < rank10 < host: numbers compare as numbers.
    head, _, tail = source.partition("/")
    kind = head.rstrip("0123456789")
    num = head[len(kind) :]
    order = {"gpu": 0, "rank": 2, "host": 3}.get(kind, 4) + (1 if tail else 0)
    return order, kind, int(num) if num else -1, tail


def metrics_to_show(
    samples: Sequence[Sample], kind: str, requested: Sequence[str] | None
) -> list[str]:
    """The panels to draw: the caller's list, or the backend kind's default set minus the
    optional metrics this device never reported."""
    if requested is not None:
        return list(requested)
    shown = []
    for m in DEFAULT_METRICS.get(kind, DEFAULT_METRICS["nvml"]):
        seen = any(s.values.get(m) is not None for s in samples)
        if m not in OPTIONAL_METRICS or seen:
            shown.append(m)
    return shown


def summarize(
    samples: Sequence[Sample],
    metrics: Sequence[str],
    *,
    describe: str,
    status: str,
    last_step: Mapping[int, int] | None = None,
) -> Summary:
    """Mean and max of each shown metric per source, with N/A readings counted apart."""
    rows = []
    for metric in metrics:
        unit = METRICS[metric].unit if metric in METRICS else ""
        for source in sources_of(samples, metric):
            _, ys = series(samples, source, metric)
            vals = [y for y in ys if not math.isnan(y)]
            rows.append(SummaryRow(
                source, metric, unit,
                mean=sum(vals) / len(vals) if vals else None,
                max=max(vals) if vals else None,
                n=len(vals), n_na=len(ys) - len(vals),
            ))  # fmt: skip
    times = [s.time_s for s in samples]
    return Summary(
        describe=describe,
        status=status,
        duration_s=(max(times) - min(times)) if times else 0.0,
        n_samples=len(samples),
        last_step=dict(last_step or {}),
        rows=rows,
    )

