"""Let the measurement choose the sentence: verdicts on noisy measurements.

A workshop server is shared. Two timings taken a minute apart on it can differ by half
because of someone else's job, and a fixed sentence printed under them ("both agree",
"buckets pay off") is then contradicted by the numbers above it. The functions here look at
repeated measurements and pick one of a few sentences, the last of which is always
available:

* ``compare_times(a, b)``: "A is faster than B by x", "A and B agree within p%", or
  "too noisy to tell on this machine right now: rerun, or run it alone";
* ``share(part, whole)``: "part is p% of whole", never more than 100%: a part measured above
  its whole (a throughput above its ceiling) says that one of the two measurements was
  disturbed.

The rule for comparing (``compare_times``) uses the median of each sample and the
uncertainty of that median estimated from the spread of the middle half of the runs, the
"notch" of a notched box plot: median ± 1.57·IQR/√n (McGill, Tukey and Larsen, "Variations
of Box Plots", The American Statistician 32(1), 1978; R's ``boxplot.stats`` uses the same
constant). When the two intervals do not overlap, that is strong evidence, roughly at the 95%
level, that the medians differ. Medians and quartiles, not means and standard deviations,
because timings on a busy machine have a long tail: a run that lost its core for a while
moves the mean and the standard deviation a lot and the median and quartiles little.

The decision, for timings ``a`` and ``b`` and a tolerance ``tol`` (10% by default):

1. fewer than ``min_runs`` runs on either side: too noisy to tell (too few runs);
2. both intervals lie within ``tol`` of the larger median: they **agree within tol**, since
   any real difference is smaller than that;
3. otherwise, if the intervals do not overlap: the one with the smaller median is
   **faster**, by the difference of the medians;
4. otherwise: **too noisy to tell**.

Every verdict prints in one fixed form, so a reader (or a test) can hold the sentence against
the numbers printed with it::

    naive step     median 160.2 ms, middle half 150.1 ms to 170.3 ms, 11 runs
    bucketed step  median 148.0 ms, middle half 140.2 ms to 151.0 ms, 11 runs
    verdict: bucketed step is faster than naive step by 12.2 ms (7.6%)

Pure functions of their inputs: nothing here measures anything.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from labkit.timing import TimingResult, format_seconds, quartiles

NOTCH = 1.57  # McGill, Tukey and Larsen (1978): median ± 1.57·IQR/√n
DEFAULT_TOLERANCE = 0.10  # differences below 10% count as "agree"
MIN_RUNS = 5  # fewer runs than this cannot bound the noise of a median
TOO_NOISY = "too noisy to tell on this machine right now: rerun, or run it alone"
PREFIX = "verdict: "  # every verdict line starts with this

Outcome = Literal["faster", "agree", "noisy"]


@dataclass(frozen=True)
class Summary:
    """What a verdict needs of repeated measurements: median, quartiles and their number."""

    name: str
    n: int
    median: float
    q1: float
    q3: float

    @property
    def interval(self) -> tuple[float, float]:
        """The notch: where the true median likely lies, median ± 1.57·IQR/√n."""
        half = NOTCH * (self.q3 - self.q1) / math.sqrt(self.n)
        return self.median - half, self.median + half

    def line(self, width: int = 0, fmt: Callable[[float], str] = format_seconds) -> str:
        """``name  median M, middle half Q1 to Q3, n runs`` (the fixed form tests parse)."""
        return (f"{self.name:<{width}}  median {fmt(self.median)}, middle half "
                f"{fmt(self.q1)} to {fmt(self.q3)}, {self.n} runs")


def summarize(samples: TimingResult | Sequence[float], name: str | None = None) -> Summary:
    """The median and quartiles of ``samples`` (a TimingResult's repeats or plain numbers)."""
    if isinstance(samples, TimingResult):
        name = name or samples.name
        values = list(samples.samples_s)
    else:
        values = [float(v) for v in samples]
    if not values:
        raise ValueError(f"samples of {name!r} are empty: a verdict needs measurements")
    if any(not math.isfinite(v) for v in values):
        raise ValueError(f"samples of {name!r} hold a value that is not finite: {values}")
    q1, q3 = quartiles(values)
    return Summary(name=name or "sample", n=len(values), median=statistics.median(values),
                   q1=q1, q3=q3)


@dataclass(frozen=True)
class Comparison:
    """Two timings compared: the outcome, why, and the sentence it chooses."""

    a: Summary
    b: Summary
    outcome: Outcome
    tolerance: float
    reason: str

    @property
    def faster(self) -> Summary:
        """The one with the smaller median (``a`` on a tie)."""
        return self.a if self.a.median <= self.b.median else self.b

    @property
    def slower(self) -> Summary:
        return self.b if self.faster is self.a else self.a

    @property
    def difference(self) -> float:
        """Slower median minus faster median: never negative."""
        return self.slower.median - self.faster.median

    @property
    def sentence(self) -> str:
        if self.outcome == "faster":
            return (f"{PREFIX}{self.faster.name} is faster than {self.slower.name} by "
                    f"{format_seconds(self.difference)} "
                    f"({100 * self.difference / self.slower.median:.1f}%)")
        if self.outcome == "agree":
            return (f"{PREFIX}{self.a.name} and {self.b.name} agree within "
                    f"{100 * self.tolerance:g}%")
        return f"{PREFIX}{TOO_NOISY} ({self.reason})"

    def __str__(self) -> str:
        width = max(len(self.a.name), len(self.b.name))
        return "\n".join([self.a.line(width), self.b.line(width), self.sentence])


def compare_times(
    a: TimingResult | Sequence[float],
    b: TimingResult | Sequence[float],
    *,
    names: tuple[str, str] | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    min_runs: int = MIN_RUNS,
) -> Comparison:
    """Compare two samples of seconds (repeats of A and of B) by the rule in the module doc.

    ``names`` overrides the samples' names (a TimingResult's ``name``, else "A" and "B").
    """
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance={tolerance!r} is not allowed: a fraction in (0, 1)")
    if min_runs < 2:
        raise ValueError(f"min_runs={min_runs!r} is not allowed: 2 or more")
    name_a, name_b = names or (None, None)
    sa = summarize(a, name_a or (None if isinstance(a, TimingResult) else "A"))
    sb = summarize(b, name_b or (None if isinstance(b, TimingResult) else "B"))
    if sa.name == sb.name:
        raise ValueError(f"both samples are called {sa.name!r}: name them apart")
    outcome, reason = _decide(sa, sb, tolerance, min_runs)
    return Comparison(sa, sb, outcome, tolerance, reason)


def _decide(a: Summary, b: Summary, tolerance: float, min_runs: int) -> tuple[Outcome, str]:
    if min(a.n, b.n) < min_runs:
        return "noisy", f"{min(a.n, b.n)} runs, fewer than the {min_runs} a verdict needs"
    (lo_a, hi_a), (lo_b, hi_b) = a.interval, b.interval
    scale = max(a.median, b.median)
    if max(hi_a, hi_b) - min(lo_a, lo_b) <= tolerance * scale:
        return "agree", "both medians' intervals lie within the tolerance"
    if hi_a < lo_b or hi_b < lo_a:
        return "faster", "the medians' intervals do not overlap"
    return "noisy", "the medians' intervals overlap and are wider than the tolerance"


@dataclass(frozen=True)
class Share:
    """``part`` as a share of ``whole`` (a throughput of its ceiling, a cost of its step)."""

    part: float
    whole: float
    part_name: str
    whole_name: str
    fmt: Callable[[float], str]
    if_over: str  # what an implausible pair means, e.g. "the ceiling measurement was disturbed"

    @property
    def plausible(self) -> bool:
        """A part cannot exceed its whole: if it does, a measurement was disturbed."""
        return self.part <= self.whole

    @property
    def fraction(self) -> float | None:
        """part / whole when that is plausible, else None (never a share above 100%)."""
        return self.part / self.whole if self.plausible else None

    @property
    def sentence(self) -> str:
        if self.fraction is not None:
            return (f"{PREFIX}{self.part_name} is {100 * self.fraction:.0f}% of "
                    f"{self.whole_name} ({self.fmt(self.part)} of {self.fmt(self.whole)})")
        return (f"{PREFIX}{self.part_name} ({self.fmt(self.part)}) came out above "
                f"{self.whole_name} ({self.fmt(self.whole)}), which it cannot be: "
                f"{self.if_over}, so no share is given; {TOO_NOISY}")

    def __str__(self) -> str:
        return self.sentence


def share(
    part: float,
    whole: float,
    *,
    part_name: str,
    whole_name: str,
    fmt: Callable[[float], str] = lambda v: f"{v:.4g}",
    if_over: str = "one of the two measurements was disturbed",
) -> Share:
    """``part`` as a share of ``whole``, or, when ``part`` came out larger, ``if_over``: the
    statement that a measurement was disturbed. ``fmt`` prints a value with its unit."""
    if not (math.isfinite(part) and math.isfinite(whole)) or part < 0 or whole <= 0:
        raise ValueError(f"part={part!r}, whole={whole!r}: need finite numbers, part >= 0 "
                         "and whole > 0")
    return Share(part, whole, part_name, whole_name, fmt, if_over)


@dataclass(frozen=True)
class Ranking:
    """A predicted order (fastest first) held against repeated measurements of each entry."""

    predicted: tuple[str, ...]
    summaries: tuple[Summary, ...]  # in predicted order
    pairs: tuple[Comparison, ...]  # every pair (earlier, later) of the predicted order

    @property
    def measured(self) -> tuple[str, ...]:
        """The names ordered by measured median, fastest first."""
        return tuple(s.name for s in sorted(self.summaries, key=lambda s: s.median))

    @property
    def swapped(self) -> list[tuple[str, str]]:
        """(predicted faster, measured faster) for each pair measured apart in the other order."""
        return [(c.a.name, c.b.name) for c in self.pairs
                if c.outcome == "faster" and c.faster is c.b]

    @property
    def unresolved(self) -> list[Comparison]:
        """The pairs the measurements cannot order: within the tolerance, or too noisy."""
        return [c for c in self.pairs if c.outcome != "faster"]

    @property
    def sentence(self) -> str:
        order = " < ".join(self.predicted)
        if self.swapped:
            which = "; ".join(f"{b} measured faster than {a}" for a, b in self.swapped)
            return (f"{PREFIX}the measured ranking differs from the predicted one ({order}): "
                    f"{which}, their medians' intervals apart")
        if not self.unresolved:
            return (f"{PREFIX}the measured ranking is the predicted one, {order}: every pair "
                    "apart beyond its spread")
        which = "; ".join(f"{c.a.name} and {c.b.name} "
                          + ("within " + f"{100 * c.tolerance:g}%" if c.outcome == "agree"
                             else "too noisy to order") for c in self.unresolved)
        return (f"{PREFIX}no pair is measured against the predicted ranking ({order}), but not "
                f"every pair is told apart: {which}")

    def __str__(self) -> str:
        width = max(len(s.name) for s in self.summaries)
        return "\n".join([*(s.line(width) for s in self.summaries), self.sentence])


def compare_ranking(
    predicted: Sequence[str],
    measured: dict[str, Sequence[float]],
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    min_runs: int = MIN_RUNS,
) -> Ranking:
    """Hold a predicted order (names, fastest first) against repeated timings of each name.

    Every pair is compared by ``compare_times``' rule: a pair counts as ordered only when its
    medians' intervals are apart; "swapped" when they are apart the other way round.
    """
    names = list(predicted)
    if len(names) < 2 or len(set(names)) != len(names):
        raise ValueError(f"predicted={predicted!r}: need two or more distinct names")
    missing = [n for n in names if n not in measured]
    if missing:
        raise ValueError(f"no measurements for {missing}: time every predicted entry")
    summaries = tuple(summarize(measured[n], n) for n in names)
    pairs = tuple(compare_times(measured[a], measured[b], names=(a, b), tolerance=tolerance,
                                min_runs=min_runs)
                  for i, a in enumerate(names) for b in names[i + 1:])
    return Ranking(tuple(names), summaries, pairs)


# --- reading verdicts back: does a printed sentence agree with the numbers printed with it? ---

_NUM = r"-?\d+(?:\.\d+)?"
_TIME = rf"{_NUM} (?:s|ms|µs)"
_SUMMARY = re.compile(
    rf"^(?P<name>.+?)\s{{2,}}median (?P<median>{_TIME}), middle half (?P<q1>{_TIME}) to "
    rf"(?P<q3>{_TIME}), (?P<n>\d+) runs$"
)
_FASTER = re.compile(
    rf"^{PREFIX}(?P<fast>.+) is faster than (?P<slow>.+) by (?P<amount>{_TIME}) "
    rf"\((?P<pct>{_NUM})%\)$"
)
_AGREE = re.compile(rf"^{PREFIX}(?P<a>.+) and (?P<b>.+) agree within (?P<tol>{_NUM})%$")
_SHARE = re.compile(rf"^{PREFIX}(?P<part>.+) is (?P<pct>{_NUM})% of (?P<whole>.+?)"
                    rf"(?: \((?P<pv>{_NUM})(?P<pu>[^()]*) of (?P<wv>{_NUM})(?P<wu>[^()]*)\))?$")
# Free text that no measurement can make true: a negative amount "shorter", "faster", ...
_NEGATIVE = re.compile(r"\bby -\s?\d|(?:^|\s)-\s?\d[\d.,]*\s*(?:µs|ms|s|%)?\s+"
                       r"(?:shorter|faster|longer|slower|saved|less|more)\b")
# ... and a share of a ceiling above 100%.
_OVER_CEILING = re.compile(rf"({_NUM})% of\b[^\n]*\bceiling")
_UNIT_S = {"s": 1.0, "ms": 1e-3, "µs": 1e-6}


def _seconds(text: str) -> tuple[float, float]:
    """A time printed by ``format_seconds``: (seconds, half a unit of its last digit)."""
    number, unit = text.split(" ")
    decimals = len(number.partition(".")[2])
    return float(number) * _UNIT_S[unit], 0.5 * 10**-decimals * _UNIT_S[unit]


def _digit(text: str) -> float:
    """Half a unit of the last printed digit of a plain number."""
    return 0.5 * 10 ** -len(text.partition(".")[2])


@dataclass(frozen=True)
class _Printed:
    """A Summary as printed, with how much rounding each printed number may hide."""

    name: str
    n: int
    median: float
    q1: float
    q3: float
    slack: float  # bound on the rounding error of the median and of the interval ends

    @property
    def interval(self) -> tuple[float, float]:
        half = NOTCH * (self.q3 - self.q1) / math.sqrt(self.n)
        return self.median - half, self.median + half


def _printed_summary(line: str) -> _Printed | None:
    m = _SUMMARY.match(line)
    if m is None:
        return None
    (med, rm), (q1, r1), (q3, r3) = (_seconds(m[k]) for k in ("median", "q1", "q3"))
    n = int(m["n"])
    return _Printed(m["name"].strip(), n, med, q1, q3,
                    slack=rm + NOTCH * (r1 + r3) / math.sqrt(max(n, 1)))


def contradictions(text: str) -> list[str]:
    """Every place in ``text`` (a notebook's printed output) where a sentence contradicts the
    numbers printed with it, one message each; empty when there is none.

    It re-derives each claim from the printed numbers alone, independently of
    ``compare_times``: "faster" needs the faster median below the slower one, by the printed
    amount, with the medians' intervals apart; "agree within p%" needs both intervals within
    p% of the larger median; a share needs at most 100%. It also flags free text no
    measurement can make true: a negative amount "shorter" (or faster, saved, ...) and a
    share of a ceiling above 100%.
    """
    lines = [line.strip() for line in text.splitlines()]
    found = []
    for i, line in enumerate(lines):
        if _NEGATIVE.search(line):
            found.append(f"a negative amount: {line!r}")
        for pct in _OVER_CEILING.findall(line):
            if float(pct) > 100:
                found.append(f"{pct}% of a ceiling: {line!r}")
        if not line.startswith(PREFIX):
            continue
        before = {s.name: s for s in map(_printed_summary, lines[max(0, i - 2):i]) if s}
        found += [f"{problem}: {line!r}" for problem in _check_verdict(line, before)]
    return found


def _check_verdict(line: str, before: dict[str, _Printed]) -> list[str]:
    if m := _FASTER.match(line):
        fast, slow = before.get(m["fast"]), before.get(m["slow"])
        if fast is None or slow is None:
            return ["'faster' without both samples' numbers printed just above it"]
        amount, r_amount = _seconds(m["amount"])
        slack = fast.slack + slow.slack
        problems = []
        if amount <= 0 or fast.median >= slow.median + slack:
            problems.append("'faster' but its median is not the smaller one")
        if abs(amount - (slow.median - fast.median)) > slack + r_amount:
            problems.append("the amount is not the difference of the printed medians")
        if abs(float(m["pct"]) - 100 * amount / slow.median) > _digit(m["pct"]) + 100 * (
                slack + r_amount) / slow.median:
            problems.append("the percentage is not the amount over the slower median")
        if fast.interval[1] > slow.interval[0] + 2 * slack:
            problems.append("'faster' but the medians' intervals overlap")
        if min(fast.n, slow.n) < 2:
            problems.append("'faster' from a single run")
        return problems
    if m := _AGREE.match(line):
        a, b = before.get(m["a"]), before.get(m["b"])
        if a is None or b is None:
            return ["'agree' without both samples' numbers printed just above it"]
        tol = float(m["tol"]) / 100
        scale = max(a.median, b.median)
        band = max(a.interval[1], b.interval[1]) - min(a.interval[0], b.interval[0])
        if band > tol * scale + 2 * (a.slack + b.slack) or min(a.n, b.n) < 2:
            return [f"'agree within {m['tol']}%' but the printed medians and their "
                    "intervals span more than that"]
        return []
    if m := _SHARE.match(line):
        pct = float(m["pct"])
        if not 0 <= pct <= 100:
            return [f"a share of {m['pct']}%: a part cannot be more than its whole"]
        if m["pv"] is not None and m["pu"] == m["wu"]:
            part, whole = float(m["pv"]), float(m["wv"])
            if part > whole + _digit(m["pv"]) + _digit(m["wv"]):
                return ["the printed part is larger than the printed whole"]
        return []
    return []
