"""Trace loading, the per-rank timeline, overlap and straggler arithmetic, the timeline plot,
``profile_steps``/``profiler_overhead`` and the HTA wrapper, on traces recorded here.

Every trace read below is recorded in this file by ``torch.profiler`` (CPU, one thread):

- ``phased``: a tiny MLP trained through ``profile_steps`` with the four phases marked;
- ``overlap``: a real gloo all-reduce between two ranks that live in this process (two
  ``ProcessGroupGloo`` objects on one ``HashStore``, the second rank on a Python thread that
  arrives late). Rank 0's all-reduce runs on gloo's own thread (its ``gloo:all_reduce`` range),
  so the trace holds a real collective thread: once while the main thread computes (hidden),
  once while it blocks in ``wait()`` (exposed). A 1-rank default process group adds a
  ``c10d::allreduce_`` operator on the main thread (time inside a collective call).

Only ``find_straggler``'s rule is checked on hand-made ``RankTimes`` values: the rule is
arithmetic on those values, and exact thresholds need exact inputs that no recording gives.
The interval functions are checked against a brute-force reference on an integer grid.
"""

from __future__ import annotations

import datetime
import gzip
import itertools
import math
import random
import threading
import time
import warnings

import matplotlib
import pytest
import torch
import torch.distributed as tdist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from labkit.profiling import (
    MODES,
    HtaReport,
    Overhead,
    RankTimes,
    TraceError,
    find_straggler,
    hidden_fraction,
    hta_report,
    judge_prediction,
    load_trace,
    load_traces,
    phase,
    plot_trace,
    profile_steps,
    profiler_overhead,
    rank_steps,
    rank_times,
)
from labkit.profiling.hta import ANALYSES
from labkit.profiling.overlap import COMM, compute_and_comm, intersect, length, subtract, union
from labkit.profiling.phases import COMMUNICATION, PHASES

matplotlib.use("Agg")

ACTIVE = 3


# --- interval arithmetic against a brute-force grid -------------------------------------------

GRID = 60  # endpoints are integers in [0, GRID]: each unit cell [k, k+1) is in or out, exactly


def _cells(intervals) -> set[int]:
    """The unit cells covered by ``intervals`` (the brute-force reference)."""
    return {k for a, b in intervals for k in range(GRID) if a <= k and k + 1 <= b}


def _random_intervals(rng: random.Random) -> list[tuple[float, float]]:
    out = []
    for _ in range(rng.randint(0, 6)):
        a = rng.randint(0, GRID)
        b = rng.randint(0, GRID) if rng.random() < 0.1 else min(GRID, a + rng.randint(0, 15))
        out.append((float(a), float(b)))  # some empty (b == a) or reversed (b < a): no time
    return out


def _canonical(intervals) -> None:
    """Sorted, each of positive length, neither overlapping nor touching the next."""
    for a, b in intervals:
        assert a < b
    for (_, b), (c, _) in itertools.pairwise(intervals):
        assert b < c


def test_interval_functions_match_a_brute_force_grid():
    rng = random.Random(1234)
    for _ in range(600):
        a, b = _random_intervals(rng), _random_intervals(rng)
        ca, cb = _cells(a), _cells(b)
        for got, want in ((union(a), ca), (intersect(a, b), ca & cb), (subtract(a, b), ca - cb)):
            _canonical(got)
            assert _cells(got) == want, (a, b, got)
        assert length(a) == len(ca)
        assert length(intersect(a, b)) + length(subtract(a, b)) == len(ca)


def test_hidden_fraction_edge_cases():
    assert hidden_fraction([(0, 10)], []) == 0.0  # nothing sent: nothing to hide
    assert hidden_fraction([], [(0, 10)]) == 0.0
    assert hidden_fraction([(0, 10)], [(2, 5)]) == 1.0  # fully under compute
    # Two concurrent all-reduces (two buckets, two threads) take their shared time once: a
    # sum of per-interval overlaps over the union would give 8/6 here.
    assert hidden_fraction([(0, 10)], [(1, 5), (3, 7)]) == 1.0
    # Half-covered overlapping comm: union 6, hidden 2. Summing overlaps gives 4/6 (over the
    # union) or 4/8 (over the summed lengths): both wrong.
    assert hidden_fraction([(2, 4)], [(0, 4), (2, 6)]) == pytest.approx(1 / 3)
    # Overlapping compute intervals count once too (not 2 × 5 of 10).
    assert hidden_fraction([(0, 5), (0, 5)], [(0, 10)]) == 0.5
    assert hidden_fraction([(0, 5)], [(5, 10)]) == 0.0  # touching is not overlapping


# --- find_straggler's rule (hand-made RankTimes: see the module docstring) -------------------


def _times(rank: int, own_s: float, exposed_s: float) -> RankTimes:
    return RankTimes(rank=rank, steps=2, step_s=own_s + exposed_s, compute_s=own_s / 2,
                     comm_s=exposed_s + 0.125, hidden_s=0.125, exposed_s=exposed_s,
                     source="test")  # fmt: skip


def test_find_straggler_needs_two_ranks():
    with pytest.raises(TraceError, match="two or more ranks"):
        find_straggler([])
    with pytest.raises(TraceError, match="got 1"):
        find_straggler([_times(0, 1.0, 0.0)])


def test_find_straggler_rule():
    # rank 2 works 1.0 s a step, the others 0.5 s and wait 0.5 s for it
    times = [_times(0, 0.5, 0.5), _times(1, 0.5, 0.5), _times(2, 1.0, 0.0), _times(3, 0.5, 0.5)]
    s = find_straggler(times)
    assert (s.rank, s.own_s, s.others_own_s, s.others_exposed_s) == (2, 1.0, 0.5, 0.5)
    assert "rank 2 is the straggler" in s.describe()
    # the median of the others (0.5), not their mean (0.625)
    times = [_times(0, 0.5, 0.5), _times(1, 0.875, 0.125), _times(2, 1.0, 0.0), _times(3, 0.5, 0.5)]
    assert (find_straggler(times).others_own_s, find_straggler(times).others_exposed_s) == (0.5, 0.5)
    # exactly at the threshold is not a straggler; just above it is
    assert find_straggler([_times(0, 0.5, 0.25), _times(1, 0.5 * 1.25, 0.0)], threshold=0.25) is None
    assert find_straggler([_times(0, 0.5, 0.25), _times(1, 0.5 * 1.25 + 1e-3, 0.0)],
                          threshold=0.25).rank == 1  # fmt: skip
    # the default threshold (0.3) is wide: 20% more own work is noise, not a straggler
    assert find_straggler([_times(0, 0.5, 0.1), _times(1, 0.6, 0.0)]) is None
    # a rank with more own work that the others did not wait for is not the straggler
    assert find_straggler([_times(0, 0.5, 0.25), _times(1, 1.0, 0.25)]) is None
    assert find_straggler([_times(0, 0.5, 0.25), _times(1, 1.0, 0.5)]) is None
    assert find_straggler([_times(0, 0.5, 0.5), _times(1, 0.5, 0.5)]) is None



def test_find_straggler_asks_for_the_same_rank_step_after_step():
    # means: rank 1 works 0.9 s a step against 0.5 s, and rank 0 waits; step by step either a
    # planted delay (rank 1 slow in every step) or noise (rank 1 very slow in one step of 5)
    means = [_times(0, 0.5, 0.4), _times(1, 0.9, 0.0)]
    planted = [[_times(0, 0.5, 0.4)] * 5, [_times(1, 0.9, 0.0)] * 5]
    noise = [[_times(0, 0.5, 0.4)] * 5,
             [_times(1, 0.5, 0.0)] * 4 + [_times(1, 2.5, 0.0)]]  # the same mean, one bad step
    s = find_straggler(means, per_step=planted)
    assert (s.rank, s.steps_slower, s.steps) == (1, 5, 5) and "in 5 of 5 steps" in s.describe()
    assert find_straggler(means) is not None  # the means alone name the noise ...
    assert find_straggler(means, per_step=noise) is None  # ... step by step it is not one rank
    # 4 steps of 5 is enough by default, 3 is not
    four = [[_times(0, 0.5, 0.4)] * 5, [_times(1, 0.5, 0.0)] + [_times(1, 1.0, 0.0)] * 4]
    three = [[_times(0, 0.5, 0.4)] * 5, [_times(1, 0.5, 0.0)] * 2 + [_times(1, 1.2, 0.0)] * 3]
    assert find_straggler(means, per_step=four).steps_slower == 4
    assert find_straggler(means, per_step=three) is None
    assert find_straggler(means, per_step=three, most=0.6).steps_slower == 3
    with pytest.raises(ValueError, match="one list of steps per rank"):
        find_straggler(means, per_step=[planted[0]])
    with pytest.raises(ValueError, match="most="):
        find_straggler(means, per_step=planted, most=0)

# --- a phased training loop recorded through profile_steps ----------------------------------


class Tiny:
    """A two-layer MLP and its AdamW; ``step(i)`` is one step with its four phases marked."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.calls: list[int] = []

    def step(self, i: int) -> None:
        self.calls.append(i)
        with phase("data"):
            x = torch.randn(64, 32)
        with phase("forward"):
            loss = self.model(x).square().mean()
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def phased(tmp_path_factory):
    """(ProfiledRun, Tiny): wait=1, warmup=1, active=ACTIVE steps through profile_steps."""
    torch.set_num_threads(1)
    tiny = Tiny()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "Profiler clears events at the end of each cycle"
        run = profile_steps(tiny.step, wait=1, warmup=1, active=ACTIVE,
                            trace_dir=tmp_path_factory.mktemp("phased"))  # fmt: skip
    return run, tiny


def test_profile_steps_records_the_active_steps_with_their_phases(phased):
    run, tiny = phased
    assert tiny.calls == [0, 1, 2, 3, 4] and run.steps_run == 5
    assert [p.name for p in run.traces] == ["cycle0.json"]
    t = load_trace(run.traces[0])
    assert len(t.steps) == ACTIVE
    # the profiler numbers every step; the recorded ones follow the wait and warmup steps
    assert [s.name for s in t.steps] == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]
    assert {s.tid for s in t.steps} == {t.main_tid}
    assert t.thread_names()[t.main_tid] == "training loop (main thread)"
    assert t.window_us == (t.steps[0].start_us, t.steps[-1].end_us)
    phases = t.spans(cat="user_annotation", tid=t.main_tid)
    for step in t.steps:
        inside = [s for s in phases if s.name in PHASES
                  and step.start_us <= s.start_us and s.end_us <= step.end_us]  # fmt: skip
        assert [s.name for s in inside] == list(PHASES)  # each once, in time order
        for before, after in itertools.pairwise(inside):
            assert before.end_us <= after.start_us
    seconds = t.phase_seconds([*PHASES, "absent"])
    assert seconds["absent"] == [0.0] * ACTIVE
    for name in PHASES:
        want = [sum(s.dur_us for s in phases if s.name == name
                    and step.start_us <= s.start_us < step.end_us) / 1e6 for step in t.steps]  # fmt: skip
        assert seconds[name] == pytest.approx(want) and all(v > 0 for v in want)
    assert "aten::addmm" in run.table(row_limit=50)
    assert "[[64, 32]" in run.table(row_limit=50, group_by_input_shape=True)


def test_profile_steps_refuses_a_schedule_that_records_nothing(tmp_path):
    tiny = Tiny()
    for bad in ({"active": 0}, {"repeat": 0}, {"wait": -1}, {"active": True}):
        with pytest.raises(ValueError, match="is not allowed") as e:
            profile_steps(tiny.step, trace_dir=tmp_path / "t", **bad)
        assert next(iter(bad)) in str(e.value)
    with pytest.raises(ValueError, match="active=0 the profiler never records a step"):
        profile_steps(tiny.step, active=0, trace_dir=tmp_path / "t")
    assert tiny.calls == []  # refused before any step ran
    assert not (tmp_path / "t").exists()


def test_gzipped_trace_loads_the_same(phased, tmp_path):
    path = phased[0].traces[0]
    gz = tmp_path / "rank0.json.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    plain, packed = load_trace(path), load_trace(gz)
    assert packed.steps == plain.steps and len(packed.all_spans) == len(plain.all_spans)


def test_truncated_trace_is_refused_as_truncated(phased, tmp_path):
    raw = phased[0].traces[0].read_bytes()
    cut = tmp_path / "cut.json"
    # Wherever the writer stopped (inside a string, a number, between events), the message
    # says truncated, not "not a trace".
    for k in range(1, 40):
        cut.write_bytes(raw[: len(raw) * k // 40])
        with pytest.raises(TraceError, match="truncated"):
            load_trace(cut)
    packed = gzip.compress(raw)
    cut_gz = tmp_path / "cut.json.gz"
    cut_gz.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(TraceError, match="truncated"):
        load_trace(cut_gz)


def test_missing_empty_and_foreign_files_are_refused(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "rank0.json")
    with pytest.raises(TraceError, match="is a folder"):
        load_trace(tmp_path)
    cases = {
        "dict.json": (b'{"a": 1}', "not a trace"),
        "text.json": (b"hello, not JSON", "not a trace"),
        "broken.json": (b'{"traceEvents": [} trailing', "not a trace"),
        "binary.json": (b"\xff\xfe\x00\x81 binary", "not a trace"),
        "empty.json": (b"  \n", "is empty"),
        "none.json": (b'{"traceEvents": []}', "no recorded operators"),
    }
    for name, (raw, message) in cases.items():
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(TraceError, match=message):
            load_trace(tmp_path / name)
    with pytest.raises(TraceError, match="no trace files given"):
        load_traces([])


def test_a_trace_without_profiler_steps_has_no_window(tmp_path):
    a = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # no schedule: no ProfilerStep#N
        for _ in range(3):
            a @ a
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    t = load_trace(tmp_path / "t.json")
    assert t.steps == [] and t.main_tid == t.spans(name="aten::mm")[0].tid  # the busiest thread
    with pytest.raises(TraceError, match="no ProfilerStep ranges"):
        rank_times(t)


# --- a real collective thread: two gloo ranks in this process -------------------------------

LATE_S = 0.005  # how late the second rank joins each all-reduce


@pytest.fixture(scope="module")
def overlap(tmp_path_factory):
    """The trace of two steps in which rank 0's all-reduce is once hidden, once exposed."""
    assert not tdist.is_initialized(), "another test left a default process group"
    torch.set_num_threads(1)
    store = tdist.HashStore()
    pair: list = [None, None]

    def join(r: int) -> None:  # both ranks must construct together: gloo connects them
        pair[r] = tdist.ProcessGroupGloo(store, r, 2, datetime.timedelta(seconds=60))

    starters = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in starters:
        t.start()
    for t in starters:
        t.join()
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    x0, x1 = torch.ones(4096), torch.ones(4096)
    a = torch.randn(128, 128)

    def late_peer() -> None:
        time.sleep(LATE_S)
        pair[1].allreduce([x1]).wait()

    def step(i: int) -> None:
        with phase("forward"):  # rank 0 computes while its all-reduce waits for the peer
            peer = threading.Thread(target=late_peer)
            peer.start()
            work = pair[0].allreduce([x0])
            while not work.is_completed():
                a @ a
            work.wait()
            peer.join()
        with phase(COMMUNICATION):  # rank 0 blocks in wait() until the peer arrives
            peer = threading.Thread(target=late_peer)
            peer.start()
            pair[0].allreduce([x0]).wait()
            peer.join()
            # c10d operators on this thread; all_gather runs aten ops inside its own
            tdist.all_gather([torch.empty(8)], torch.ones(8))

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run = profile_steps(step, wait=1, warmup=1, active=2,
                                trace_dir=tmp_path_factory.mktemp("overlap"))  # fmt: skip
    finally:
        tdist.destroy_process_group()
        pair.clear()
    # a real collective: two all-reduces of ones per step, 4 steps, doubles 8 times
    assert torch.equal(x0, torch.full((4096,), 256.0)) and torch.equal(x1, x0)
    return load_trace(run.traces[0])


def _clip(spans, window) -> list[tuple[float, float]]:
    lo, hi = window
    return [(max(s.start_us, lo), min(s.end_us, hi)) for s in spans if s.end_us > lo and s.start_us < hi]


def test_a_collective_thread_is_found(overlap):
    t = overlap
    assert t.rank == 0 and len(t.steps) == 2
    gloo = t.spans(name="gloo:all_reduce")
    assert gloo and t.main_tid not in {s.tid for s in gloo}
    names = {t.thread_names()[s.tid] for s in gloo}
    tids = {s.tid for s in gloo}
    assert names == {f"gloo worker thread {k} (collectives)" for k in range(1, len(tids) + 1)}


def test_rank_times_on_a_hidden_and_an_exposed_all_reduce(overlap):
    t = overlap
    r = rank_times(t)
    n = len(t.steps)
    assert r.steps == n == 2 and r.rank == 0
    lo, hi = t.window_us
    assert r.step_s == pytest.approx((hi - lo) / n / 1e6)
    assert 0 < r.hidden_s <= min(r.compute_s, r.comm_s)
    assert r.exposed_s > 0 and r.exposed_s == pytest.approx(r.comm_s - r.hidden_s)
    assert 0 < r.hidden_fraction < 1
    assert r.compute_s < r.step_s and r.own_s == pytest.approx(r.step_s - r.exposed_s)
    # the hidden time is the forward's all-reduce, the exposed time the communication phase's
    compute, comm = compute_and_comm(t)
    main = t.spans(cat="user_annotation", tid=t.main_tid)
    fwd = intersect(comm, _clip([s for s in main if s.name == "forward"], (lo, hi)))
    blocked = intersect(comm, _clip([s for s in main if s.name == COMMUNICATION], (lo, hi)))
    assert length(fwd) > 0 and length(blocked) > 0
    assert length(intersect(fwd, compute)) > 0.5 * length(fwd)
    assert length(subtract(blocked, compute)) > 0.5 * length(blocked)
    assert r.describe().startswith("rank 0: step")



def test_rank_steps_split_the_trace_at_its_steps(overlap):
    t = overlap
    whole, steps = rank_times(t), rank_steps(t)
    assert [s.steps for s in steps] == [1, 1] and {s.rank for s in steps} == {0}
    assert [s.step_s for s in steps] == pytest.approx([x.dur_us / 1e6 for x in t.steps])
    n = len(steps)
    for field in ("compute_s", "comm_s", "hidden_s", "exposed_s"):  # the steps add up
        assert sum(getattr(s, field) for s in steps) / n == pytest.approx(
            getattr(whole, field), rel=1e-6, abs=1e-9), field
    # each step holds its own all-reduces: one hidden in the forward, one exposed after it
    assert all(s.hidden_s > 0 and s.exposed_s > 0 for s in steps)

def test_compute_excludes_time_inside_a_collective_call(overlap):
    t = overlap
    compute, comm = compute_and_comm(t)
    ops = t.spans(tid=t.main_tid)
    calls = [s for s in ops if s.cat == "cpu_op" and s.name.startswith("c10d::")]
    assert {s.name for s in calls} >= {"c10d::allgather_"}
    nested = [s for s in ops for c in calls if s.cat == "cpu_op" and not COMM.search(s.name)
              and c.start_us <= s.start_us and s.end_us <= c.end_us]  # fmt: skip
    assert nested, "all_gather ran no aten op inside its c10d call: the check below is empty"
    inside = _clip(calls, t.window_us)
    assert length(intersect(compute, inside)) == 0  # waiting in (or copying for) a collective
    assert length(subtract(inside, comm)) == 0  # ... is communication


def test_load_traces_refuses_two_traces_of_one_rank(overlap):
    with pytest.raises(TraceError, match="same rank"):
        load_traces([overlap.path, overlap.path])
    assert [t.rank for t in load_traces([overlap.path])] == [0]


# --- the timeline plot --------------------------------------------------------------------


def test_plot_trace_draws_one_row_per_thread(overlap):
    import matplotlib.pyplot as plt

    t = overlap
    lo, hi = t.window_us
    # the training loop, and every thread that ran a collective in the window
    threads = {t.main_tid} | {s.tid for s in t.all_spans if COMM.search(s.name)
                              and s.end_us > lo and s.start_us < hi}  # fmt: skip
    ax = plot_trace(t)
    labels = [tick.get_text() for tick in ax.get_yticklabels()]
    assert len(labels) == len(threads) >= 2 and len(set(labels)) == len(labels)
    assert labels[0] == "training loop (main thread)"
    ax2 = plot_trace([t, t], steps=slice(0, 1), title="two ranks")
    labels2 = [tick.get_text() for tick in ax2.get_yticklabels()]
    assert len(labels2) <= 2 * len(threads) and all(lab.startswith("rank 0: ") for lab in labels2)
    assert labels2[0] == "rank 0: training loop (main thread)" and ax2.get_title() == "two ranks"
    # the legend sits beside the axes (below them it covered the x-axis label), and names the
    # operators without their aten:: prefix
    ax.figure.canvas.draw()
    legend = ax.get_legend()
    box = legend.get_window_extent()
    assert box.x0 >= ax.get_window_extent().x1
    ops = [t.get_text() for t in legend.get_texts() if t.get_text().startswith("top ")]
    assert ops and "aten::" not in ops[0]
    plt.close("all")


# --- the cost of looking ------------------------------------------------------------------


def test_profiler_overhead_counts_and_keys():
    calls: list[int] = []
    a = torch.randn(32, 32)

    def step(i: int) -> None:
        calls.append(i)
        a @ a

    o = profiler_overhead(step, modes=("off", "on"), rounds=2, steps_per_block=3)
    assert calls == list(range(2 * 2 * 3))  # every block ran, none twice
    assert set(o.step_s) == set(o.stop_s) == {"off", "on"}
    assert [len(o.step_s[m]) for m in ("off", "on")] == [4, 4]  # the first step of a block dropped
    assert o.stop_s["off"] == [] and len(o.stop_s["on"]) == 1  # the stop is timed in round 1
    assert all(v > 0 for v in o.step_s["off"] + o.step_s["on"] + o.stop_s["on"])
    assert o.slowdown("off") == 1.0 and o.device == "cpu"
    assert set(MODES) >= {"off", "on"} and MODES["off"] is None



def test_overhead_per_round_is_each_rounds_difference_of_medians():
    # 2 rounds × 3 kept steps: round 1 off 10/11/12 ms, on 13/14/90 ms (one slow step)
    o = Overhead({"off": [0.010, 0.011, 0.012, 0.020, 0.021, 0.022],
                  "on": [0.013, 0.014, 0.090, 0.021, 0.022, 0.023]}, {}, "cpu", "test", block=3)
    assert o.per_round("on") == pytest.approx([0.003, 0.001])
    with pytest.raises(ValueError, match="block size"):
        Overhead({"off": [1.0], "on": [1.0]}, {}, "cpu", "test").per_round("on")


def test_judge_prediction_holds_a_value_against_repeated_measurements():
    near = [1.00, 1.02, 0.98, 1.01, 0.99]
    assert judge_prediction(1.0, near) == "agree"
    assert judge_prediction(2.0, near) == "below"  # measured well under the prediction
    assert judge_prediction(0.5, near) == "above"
    assert judge_prediction(1.0, near[:4]) == "noisy"  # too few runs
    assert judge_prediction(1.0, [0.2, 1.8, 0.5, 1.5, 1.0]) == "noisy"  # wider than the band
    assert judge_prediction(1.2, near, tolerance=0.25) == "agree"
    assert judge_prediction(1.4, near, tolerance=0.25) == "below"
    with pytest.raises(ValueError, match="tolerance"):
        judge_prediction(1.0, near, tolerance=1.5)

def test_profiler_overhead_refuses_bad_modes():
    never = lambda i: pytest.fail("ran a step")  # noqa: E731
    for modes in (("on",), ("off", "sideways"), ()):
        with pytest.raises(ValueError, match="include 'off'"):
            profiler_overhead(never, modes=modes)
    with pytest.raises(ValueError, match="rounds=0"):
        profiler_overhead(never, rounds=0)
    with pytest.raises(ValueError, match="steps_per_block=1"):
        profiler_overhead(never, steps_per_block=1)


# --- HTA: the wrapper's bookkeeping, with a fake analyzer ------------------------------------


class FakeAnalyzer:
    """Stands in for HTA's TraceAnalysis: each method returns or raises what it is told."""

    def __init__(self, outcomes: dict) -> None:
        self.outcomes = outcomes
        self.seen: list[tuple[str, dict]] = []

    def __getattr__(self, method: str):
        def analysis(**kwargs):
            self.seen.append((method, kwargs))
            print("HTA prints its progress")  # must not reach the test's output
            outcome = self.outcomes[method]
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        return analysis


def test_hta_report_on_a_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        hta_report(tmp_path / "nowhere")


def test_hta_report_records_every_failure_and_never_raises(tmp_path, capsys):
    pd = pytest.importorskip("pandas")
    outcomes = {
        "get_temporal_breakdown": IndexError("single positional indexer is out-of-bounds"),
        "get_comm_comp_overlap": pd.DataFrame({"rank": [0, 1], "overlap": [math.nan, math.nan]}),
        "get_idle_time_breakdown": (pd.DataFrame(), pd.DataFrame()),
        "get_gpu_kernel_breakdown": math.nan,
    }
    fake = FakeAnalyzer(outcomes)
    report = hta_report(tmp_path, loader=lambda path: fake)
    assert isinstance(report, HtaReport) and report.available
    assert report.results == {} and set(report.failures) == set(ANALYSES)
    assert report.failures["temporal_breakdown"].startswith("raised IndexError")
    assert "only NaN" in report.failures["comm_comp_overlap"]
    assert "empty table" in report.failures["idle_time"]
    assert report.failures["kernel_breakdown"] == "NaN"
    assert [m for m, _ in fake.seen] == list(ANALYSES.values())
    assert all(kw == {"visualize": False} for _, kw in fake.seen)
    assert "HTA prints" not in capsys.readouterr().out
    assert "temporal_breakdown: nothing (raised IndexError" in report.describe()
    # an analysis that answers is kept as a result
    good = pd.DataFrame({"rank": [0], "comp": [0.5]})
    report = hta_report(tmp_path, loader=lambda path: FakeAnalyzer({**outcomes, "get_comm_comp_overlap": good}))
    assert report.results["comm_comp_overlap"] is good and "comm_comp_overlap: ok" in report.describe()


def test_hta_report_when_the_traces_do_not_load(tmp_path):
    def loader(path: str):
        raise ValueError(f"no traces in {path}")

    report = hta_report(tmp_path, loader=loader)
    assert not report.available and report.results == {}
    assert report.failures == {"import": (
        f"HTA could not load the traces: ValueError: no traces in {tmp_path}; labkit refuses "
        f"them too: {tmp_path} holds no trace files (looked for *.json, *.json.gz): the "
        "profiler writes one per rank when its active window ends")}
    assert report.describe() == report.failures["import"]
