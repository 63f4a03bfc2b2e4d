"""labkit.verdict on synthetic samples: each rule decides the cases it exists for, and breaking
any rule makes a case below fail (``test_breaking_a_rule_is_caught``)."""

from __future__ import annotations

import math
import random

import pytest

from labkit import timing, verdict

MS = 1e-3


def ms(*values: float) -> list[float]:
    return [v * MS for v in values]


def spaced(center: float, n: int, step: float = 0.1) -> list[float]:
    """n evenly spaced values in ms around ``center`` (a quiet machine)."""
    return ms(*(center + step * (i - (n - 1) / 2) for i in range(n)))


# name: (a, b, expected outcome, the faster one's name when "faster")
SCENARIOS = {
    # far apart, tight: a clear winner, whichever is passed first
    "separated": (spaced(10, 11), spaced(15, 11), "faster", "A"),
    "separated, reversed": (spaced(15, 11), spaced(10, 11), "faster", "B"),
    # one repeat lost its core for half a second: medians and quartiles barely move
    "one slow outlier": (spaced(10, 10) + ms(500), spaced(15, 11), "faster", "A"),
    # the same timing twice
    "identical": (spaced(10, 11), spaced(10, 11)[::-1], "agree", None),
    # clearly distinct, but by 5%: inside the 10% tolerance, so "agree", not "faster"
    "apart but within tolerance": (spaced(10, 11), spaced(10.5, 11), "agree", None),
    # equal medians, but runs all over the place: nothing can be said
    "equal medians, wide spread": (ms(5, 10, 15, 20, 25) * 3, ms(6, 10, 14, 21, 24) * 3, "noisy",
                                   None),
    # medians 12% apart, middle halves overlapping
    "overlapping": (ms(9, 9.5, 10, 10.5, 11), ms(10.2, 10.7, 11.2, 11.7, 12.2), "noisy", None),
    # the same two distributions, nine times the runs: the medians' intervals shrink as 1/√n
    "overlapping, many runs": (ms(9, 9.5, 10, 10.5, 11) * 9, ms(10.2, 10.7, 11.2, 11.7, 12.2) * 9,
                               "faster", "A"),
    # far apart, but three runs each cannot bound a median's noise
    "too few runs": (spaced(10, 3), spaced(20, 3), "noisy", None),
}


def run_scenarios() -> dict[str, verdict.Comparison]:
    return {name: verdict.compare_times(a, b) for name, (a, b, _, _) in SCENARIOS.items()}


@pytest.mark.parametrize("name", SCENARIOS)
def test_each_scenario_gets_its_verdict(name):
    a, b, outcome, faster = SCENARIOS[name]
    result = verdict.compare_times(a, b)
    assert result.outcome == outcome, result
    if outcome == "faster":
        assert result.faster.name == faster
        assert result.difference == pytest.approx(result.slower.median - result.faster.median)
        assert result.difference > 0
    assert verdict.contradictions(str(result)) == []


def test_the_three_sentences_and_the_fixed_form():
    faster = verdict.compare_times(spaced(10, 11), spaced(15, 11), names=("bucketed", "naive"))
    assert str(faster).splitlines() == [
        "bucketed  median 10.000 ms, middle half 9.750 ms to 10.250 ms, 11 runs",
        "naive     median 15.000 ms, middle half 14.750 ms to 15.250 ms, 11 runs",
        "verdict: bucketed is faster than naive by 5.000 ms (33.3%)",
    ]
    agree = verdict.compare_times(spaced(10, 11), spaced(10, 11), names=("no sync", "synced"))
    assert agree.sentence == "verdict: no sync and synced agree within 10%"
    noisy = verdict.compare_times(ms(9, 9.5, 10, 10.5, 11), ms(10.2, 10.7, 11.2, 11.7, 12.2))
    assert noisy.sentence.startswith(
        "verdict: too noisy to tell on this machine right now: rerun, or run it alone (")


def test_the_interval_is_the_notch_of_a_box_plot():
    s = verdict.summarize([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (s.median, s.q1, s.q3, s.n) == (3.0, 2.0, 4.0, 5)
    half = 1.57 * 2.0 / math.sqrt(5)
    assert s.interval == pytest.approx((3.0 - half, 3.0 + half))


def test_timing_results_are_compared_under_their_own_names():
    fast = timing.TimingResult("matmul", tuple(spaced(1, 9)), "cpu", "sync", 1)
    slow = timing.TimingResult("matmul (no sync)", tuple(spaced(2, 9)), "cpu", "no sync", 0)
    result = verdict.compare_times(slow, fast)
    assert result.outcome == "faster" and result.faster.name == "matmul"
    with pytest.raises(ValueError, match="name them apart"):
        verdict.compare_times(fast, fast)


def test_a_smaller_tolerance_turns_agree_into_faster():
    a, b = spaced(10, 11), spaced(10.5, 11)
    assert verdict.compare_times(a, b).outcome == "agree"
    tight = verdict.compare_times(a, b, tolerance=0.02)
    assert tight.outcome == "faster" and tight.sentence.endswith("by 500.0 µs (4.8%)")


@pytest.mark.parametrize("kwargs", [{"tolerance": 0}, {"tolerance": 1.5}, {"min_runs": 1}])
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ValueError):
        verdict.compare_times(spaced(1, 5), spaced(2, 5), **kwargs)


@pytest.mark.parametrize("samples", [[], [1.0, float("nan")], [float("inf")]])
def test_samples_must_be_finite_measurements(samples):
    with pytest.raises(ValueError):
        verdict.summarize(samples, "x")


def test_no_sample_ever_prints_a_verdict_its_numbers_contradict():
    """Random samples shaped like timings on a busy machine (log-normal, with bursts of
    load): whatever the outcome, the printed sentence agrees with the printed numbers, and
    no amount is negative."""
    rng = random.Random(9)
    outcomes = set()
    for _ in range(600):
        def sample(center, n):
            burst = rng.random() < 0.3
            return [center * math.exp(rng.gauss(0, rng.choice([0.01, 0.1, 0.5])))
                    * (rng.choice([1, 1, 1, 5]) if burst else 1) for _ in range(n)]

        center = 10 ** rng.uniform(-6, 0)
        a = sample(center, rng.randint(1, 30))
        b = sample(center * rng.choice([1, 1.02, 1.2, 3]), rng.randint(1, 30))
        result = verdict.compare_times(a, b)
        outcomes.add(result.outcome)
        assert result.difference >= 0
        assert "by -" not in str(result)
        assert verdict.contradictions(str(result)) == [], str(result)
    assert outcomes == {"faster", "agree", "noisy"}  # the samples exercised every rule


# --- breaking a rule --------------------------------------------------------------------------


def _no_min_runs(a, b, tol, min_runs):
    return _decide(a, b, tol, 2)


def _faster_by_medians(a, b, tol, min_runs):  # no intervals: any difference is "faster"
    outcome, reason = _decide(a, b, tol, min_runs)
    if outcome == "noisy" and a.median != b.median and min(a.n, b.n) >= min_runs:
        return "faster", "medians differ"
    return outcome, reason


def _agree_by_medians(a, b, tol, min_runs):  # ignores the spread when saying "agree"
    if abs(a.median - b.median) <= tol * max(a.median, b.median):
        return "agree", "medians close"
    return _decide(a, b, tol, min_runs)


def _faster_before_agree(a, b, tol, min_runs):  # rules 2 and 3 swapped
    (lo_a, hi_a), (lo_b, hi_b) = a.interval, b.interval
    if min(a.n, b.n) >= min_runs and (hi_a < lo_b or hi_b < lo_a):
        return "faster", "apart"
    return _decide(a, b, tol, min_runs)


_decide = verdict._decide
BROKEN = {
    "rule 1 (too few runs) dropped": ("decide", _no_min_runs),
    "rule 3 without intervals": ("decide", _faster_by_medians),
    "rule 2 without intervals": ("decide", _agree_by_medians),
    "rules 2 and 3 swapped": ("decide", _faster_before_agree),
    # the interval without √n: more runs would never sharpen a verdict
    "interval without sqrt(n)": ("notch", lambda s: (s.median - 1.57 * (s.q3 - s.q1),
                                                     s.median + 1.57 * (s.q3 - s.q1))),
    # the full range instead of the middle half: one slow run would blur everything
    "range instead of quartiles": ("summary", None),
}


@pytest.mark.parametrize("broken", BROKEN)
def test_breaking_a_rule_is_caught(broken, monkeypatch):
    kind, replacement = BROKEN[broken]
    if kind == "decide":
        monkeypatch.setattr(verdict, "_decide", replacement)
    elif kind == "notch":
        monkeypatch.setattr(verdict.Summary, "interval", property(replacement))
    else:
        real = verdict.summarize

        def by_range(samples, name=None):
            s = real(samples, name)
            values = sorted(samples)
            return verdict.Summary(s.name, s.n, s.median, values[0], values[-1])

        monkeypatch.setattr(verdict, "summarize", by_range)
    wrong = {name: result.outcome for name, result in run_scenarios().items()
             if result.outcome != SCENARIOS[name][2]}
    assert wrong, f"breaking '{broken}' went unnoticed"


@pytest.mark.parametrize("broken", ["rule 3 without intervals", "rule 2 without intervals"])
def test_the_reader_catches_a_claim_the_numbers_do_not_support(broken, monkeypatch):
    monkeypatch.setattr(verdict, "_decide", BROKEN[broken][1])
    flagged = [problem for result in run_scenarios().values()
               for problem in verdict.contradictions(str(result))]
    assert flagged, f"'{broken}' printed claims that contradictions() did not flag"


# --- shares of a whole ------------------------------------------------------------------------


def gflops(v: float) -> str:
    return f"{v / 1e9:.2f} GFLOP/s"


def test_a_share_is_at_most_100_percent():
    ok = verdict.share(1.2e9, 2.7e9, part_name="training", whole_name="the measured ceiling",
                       fmt=gflops)
    assert ok.plausible and ok.fraction == pytest.approx(1.2 / 2.7)
    assert str(ok) == ("verdict: training is 44% of the measured ceiling "
                       "(1.20 GFLOP/s of 2.70 GFLOP/s)")
    assert verdict.share(2.7e9, 2.7e9, part_name="t", whole_name="w").sentence.startswith(
        "verdict: t is 100% of w")


def test_a_part_above_its_whole_says_a_measurement_was_disturbed():
    over = verdict.share(3.9e9, 2.7e9, part_name="training", whole_name="the measured ceiling",
                         fmt=gflops, if_over="the ceiling measurement was disturbed")
    assert not over.plausible and over.fraction is None
    assert "%" not in str(over)
    assert "the ceiling measurement was disturbed" in str(over)
    assert verdict.TOO_NOISY in str(over)
    assert verdict.contradictions(str(over)) == []


@pytest.mark.parametrize(("part", "whole"), [(-1.0, 2.0), (1.0, 0.0), (float("nan"), 1.0)])
def test_a_share_needs_a_positive_whole_and_a_measured_part(part, whole):
    with pytest.raises(ValueError):
        verdict.share(part, whole, part_name="p", whole_name="w")


# --- reading printed output back --------------------------------------------------------------


def test_the_issues_contradictions_are_flagged():
    """The sentences a learner saw on two busy cores (issue 9), each caught."""
    old_nb02 = ("measured in section 2: naive sent 52 messages per step, bucketed 4, for the same "
                "bytes; bucketed's step was -42.2 ms shorter")
    old_nb01 = "training reached 144% of the measured matmul ceiling (measured / measured, not MFU)"
    assert len(verdict.contradictions(old_nb02)) == 1
    assert len(verdict.contradictions(old_nb01)) == 1
    assert verdict.contradictions("training reached 44% of the measured matmul ceiling") == []


def test_a_verdict_whose_numbers_say_otherwise_is_flagged():
    a = "A  median 10.000 ms, middle half 9.750 ms to 10.250 ms, 11 runs"
    b = "B  median 15.000 ms, middle half 14.750 ms to 15.250 ms, 11 runs"
    wide = "B  median 10.100 ms, middle half 5.000 ms to 20.000 ms, 11 runs"
    assert verdict.contradictions(f"{a}\n{b}\nverdict: A is faster than B by 5.000 ms (33.3%)") == []
    cases = {
        "wrong winner": f"{a}\n{b}\nverdict: B is faster than A by 5.000 ms (33.3%)",
        "wrong amount": f"{a}\n{b}\nverdict: A is faster than B by 2.000 ms (13.3%)",
        "wrong percent": f"{a}\n{b}\nverdict: A is faster than B by 5.000 ms (50.0%)",
        "negative": f"{a}\n{b}\nverdict: A is faster than B by -5.000 ms (33.3%)",
        "overlap": f"{a}\n{wide}\nverdict: A is faster than B by 0.100 ms (1.0%)",
        "agree, far apart": f"{a}\n{b}\nverdict: A and B agree within 10%",
        "agree, wide": f"{a}\n{wide}\nverdict: A and B agree within 10%",
        "no numbers": "verdict: A and B agree within 10%",
        "share over 100%": "verdict: training is 144% of the ceiling",
        "part above whole": "verdict: training is 90% of the ceiling (3.0 GFLOP/s of 2.0 GFLOP/s)",
    }
    for case, text in cases.items():
        assert verdict.contradictions(text), case
