"""The GPU path of the trace analysis, on synthetic GPU traces (``tests/gpu_traces.py``).

What a GPU trace holds that a CPU one does not: kernels that run after the step that launched
them has closed (the CPU runs ahead), kernels queued before the profiler's window, NCCL
kernels and ``nccl:*`` ranges, the 2021 profiler's category names. Each test computes what it
expects from the intervals the builder placed. Real GPU traces are read by
``test_gpu_traces_real.py`` where they are present; HTA itself runs here on the synthetic
ones, so labkit and HTA are held to the same steps on every machine.
"""

from __future__ import annotations

import json
import math

import pytest
from gpu_traces import build

from labkit.profiling import (
    TraceError,
    hta_report,
    hta_side_by_side,
    load_trace,
    load_traces,
    plot_trace,
    rank_steps,
    rank_times,
)
from labkit.profiling.hta import ANALYSES
from labkit.profiling.overlap import gpu_split, gpu_work, intersect, length, union

US = 1e-6


def test_kernels_count_in_the_step_that_launched_them(tmp_path):
    # 8 kernels of 150 µs a 1000 µs step: the GPU falls behind, and the last step's kernels
    # run after its ProfilerStep range has closed
    built = build(steps=3, kernels=8, kernel_us=150.0, step_us=1000.0)
    lo, hi = built.window
    assert any(b > hi for _, b in built.compute), "the trace must have the CPU run ahead"
    t = load_trace(built.write(tmp_path / "rank0.json"))
    r = rank_times(t)
    assert r.steps == 3 and t.on_gpu
    assert r.compute_s == pytest.approx(length(built.compute) / 3 * US, rel=1e-9)
    assert r.comm_s == pytest.approx(length(built.comm) / 3 * US, rel=1e-9)
    hidden = length(intersect(built.compute, built.comm))
    assert r.hidden_s == pytest.approx(hidden / 3 * US, rel=1e-9) and 0 < hidden
    # the step is the period at which the steps' work finishes, not the window over 3: that
    # would add the GPU's lag behind the CPU once
    e = built.step_ends
    assert r.step_s == pytest.approx((e[2] - e[0]) / 2 * US, rel=1e-9)
    assert r.step_s < (e[2] - lo) / 3 * US
    assert "launched in the recorded steps" in r.source


def test_one_step_lasts_from_its_start_to_its_last_kernels_end(tmp_path):
    built = build(steps=1, kernel_us=150.0)
    r = rank_times(load_trace(built.write(tmp_path / "rank0.json")))
    assert r.step_s == pytest.approx((built.step_ends[0] - built.window[0]) * US, rel=1e-9)


def test_launches_on_other_threads_and_through_the_driver_count(tmp_path):
    built = build()
    runtime = [e for e in built.events if e["cat"] == "cuda_runtime"]
    runtime[0]["cat"], runtime[0]["name"] = "cuda_driver", "cuLaunchKernel"  # CUDA graphs, Triton
    runtime[1]["tid"] = 4343  # autograd's backward thread launches too
    r = rank_times(load_trace(built.write(tmp_path / "rank0.json")))
    assert r.compute_s == pytest.approx(length(built.compute) / 3 * US, rel=1e-9)


def test_a_launch_outside_the_steps_is_not_theirs(tmp_path):
    built = build(steps=2)
    lo, hi = built.window
    runtime = [e for e in built.events if e["cat"] == "cuda_runtime"]
    runtime[0]["ts"] = lo - 50  # before the first step (HTA would count it)
    runtime[-1]["ts"] = hi + 50  # after the last one
    t = load_trace(built.write(tmp_path / "rank0.json"))
    work, earlier = gpu_work(t)
    assert len(work) == len(built.compute) + len(built.comm) - 2 and earlier == 0


def test_kernel_kinds_follow_htas_classes():
    from labkit.profiling.overlap import kernel_kind
    from labkit.profiling.trace import Span

    def kind(name, cat="kernel"):
        return kernel_kind(Span(name, cat, 0, 1, 0, 7))

    assert kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "compute"
    assert kind("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*)") == "communication"
    assert kind("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy") == "memory"
    assert kind("Memset (Device)", "gpu_memset") == "memory"
    assert kind("void cub::DeviceSegmentedReduceSync<float>") == "other"  # HTA: neither


def test_kernels_queued_before_the_window_are_left_out(tmp_path):
    built = build(earlier=3)
    t = load_trace(built.write(tmp_path / "rank0.json"))
    work, earlier = gpu_work(t)
    assert earlier == 3 and len(work) == len(built.compute) + len(built.comm)
    r = rank_times(t)
    assert r.compute_s == pytest.approx(length(built.compute) / 3 * US, rel=1e-9)
    assert "3 queued before the first step left out" in r.source


def test_a_trace_without_launch_records_is_read_by_time_inside_the_steps(tmp_path):
    built = build()
    built.events[:] = [e for e in built.events if e["cat"] != "cuda_runtime"]
    t = load_trace(built.write(tmp_path / "rank0.json"))
    r = rank_times(t)
    inside = intersect(built.compute, [built.window])
    assert r.compute_s == pytest.approx(length(inside) / 3 * US, rel=1e-9)
    assert r.step_s == pytest.approx((built.window[1] - built.window[0]) / 3 * US)
    assert "no launch records" in r.source


def test_all_reduces_are_counted_whichever_backend_ran_them(tmp_path):
    built = build(steps=4)
    t = load_trace(built.write(tmp_path / "nccl.json"))
    calls = t.collective_calls("all_reduce")
    assert len(calls) == built.all_reduces == 4 and t.per_step(calls) == 1.0
    assert t.collective_calls("all_gather") == []
    for e in built.events:  # the same job on CPU ranks: gloo names its ranges gloo:*
        e["name"] = e["name"].replace("nccl:", "gloo:")
    t = load_trace(built.write(tmp_path / "gloo.json"))
    assert t.per_step(t.collective_calls("all_reduce")) == 1.0



def test_kinetos_gpu_projections_of_ranges_are_not_counted_as_work(tmp_path):
    # Kineto repeats ProfilerStep#N, forward and nccl:all_reduce on the streams their kernels
    # ran on (gpu_user_annotation); they span the gaps between kernels, so counting them as
    # kernels would fill the GPU's idle time and double the all-reduces
    built = build(steps=4, kernel_us=60.0, all_reduce_us=300.0)
    projected = [e for e in built.events if e["cat"] == "gpu_user_annotation"]
    assert {e["name"] for e in projected} >= {"ProfilerStep#10", "forward", "nccl:all_reduce"}
    t = load_trace(built.write(tmp_path / "with.json"))
    bare = load_trace(build(steps=4, kernel_us=60.0, all_reduce_us=300.0,
                            gpu_annotations=False).write(tmp_path / "without.json"))  # fmt: skip
    n = 4
    r, g = rank_times(t), gpu_split(t)
    assert r == rank_times(bare)
    assert r.compute_s == pytest.approx(length(built.compute) / n * US, rel=1e-9)
    assert r.comm_s == pytest.approx(length(built.comm) / n * US, rel=1e-9)
    hidden = length(intersect(built.compute, built.comm))
    assert 0 < hidden < length(built.comm)  # neither all hidden nor all exposed
    assert r.hidden_fraction == pytest.approx(hidden / length(built.comm), rel=1e-9)
    assert g.idle_s > 0 and g == gpu_split(bare)
    assert len(t.steps) == n  # the projected ProfilerStep ranges are not steps
    assert len(t.collective_calls("all_reduce")) == built.all_reduces == n


def test_rank_steps_on_a_gpu_trace_hold_each_steps_kernels(tmp_path):
    built = build(steps=3, kernels=8, kernel_us=150.0, step_us=1000.0)
    t = load_trace(built.write(tmp_path / "rank0.json"))
    steps, whole = rank_steps(t), rank_times(t)
    assert len(steps) == 3 and all(s.steps == 1 for s in steps)
    # compute kernels run one after another on one stream: each step's add up to the whole
    assert sum(s.compute_s for s in steps) / 3 == pytest.approx(whole.compute_s, rel=1e-9)
    assert sum(s.comm_s for s in steps) / 3 == pytest.approx(whole.comm_s, rel=1e-9)
    per_step = [length(built.compute[8 * k:8 * (k + 1)]) * US for k in range(3)]
    assert [s.compute_s for s in steps] == pytest.approx(per_step, rel=1e-9)
    e = built.step_ends  # each step ends with its last kernel; the first starts at its range
    assert [s.step_s for s in steps] == pytest.approx(
        [(e[0] - built.window[0]) * US, (e[1] - e[0]) * US, (e[2] - e[1]) * US], rel=1e-9)

def test_the_2021_schema_reads_like_todays(tmp_path):
    today = load_trace(build().write(tmp_path / "today.json"))
    old = load_trace(build(schema="2021").write(tmp_path / "old.json"))
    assert old.schema == "2021" and today.schema == "current"
    assert [s.name for s in old.steps] == [s.name for s in today.steps] == [
        "ProfilerStep#10", "ProfilerStep#11", "ProfilerStep#12"]
    assert rank_times(old) == rank_times(today)


def test_a_trace_without_profiler_steps_is_refused_for_the_true_reason(tmp_path):
    built = build(profiler_steps=False)
    t = load_trace(built.write(tmp_path / "rank0.json"))
    with pytest.raises(TraceError, match="no ProfilerStep ranges") as e:
        rank_times(t)
    assert "without a schedule" in str(e.value) and "whole_trace=True" in str(e.value)
    whole = rank_times(t, whole_trace=True)
    assert whole.steps == 1
    assert whole.compute_s == pytest.approx(length(built.compute) * US, rel=1e-9)


def test_gpu_split_matches_the_placed_intervals(tmp_path):
    built = build(copy_us=40.0)
    t = load_trace(built.write(tmp_path / "rank0.json"))
    g = gpu_split(t)
    every = union(built.compute + built.comm + built.memory)
    span = every[-1][1] - every[0][0]
    assert g.span_s == pytest.approx(span / 3 * US, rel=1e-9)
    assert g.idle_s == pytest.approx((span - length(every)) / 3 * US, rel=1e-9)
    assert g.compute_s == pytest.approx(length(built.compute) / 3 * US, rel=1e-9)
    assert g.other_s == pytest.approx((length(every) - length(built.compute)) / 3 * US, rel=1e-9)
    assert g.memory_s == pytest.approx(length(built.memory) / 3 * US, rel=1e-9) and g.memory_s > 0
    assert "idle" in g.describe()


def test_gpu_split_refuses_a_cpu_trace(tmp_path):
    built = build()
    built.events[:] = [e for e in built.events if e["cat"] != "kernel"]
    t = load_trace(built.write(tmp_path / "cpu.json"))
    with pytest.raises(TraceError, match="CPU-only trace"):
        gpu_split(t)


# --- a job's folder, as a user brings it --------------------------------------------------


def test_a_folder_of_ranks_loads_in_rank_order(tmp_path):
    build(rank=1).write(tmp_path / "rank1.pt.trace.json.gz", gz=True)
    build(rank=0).write(tmp_path / "rank0.pt.trace.json")
    (tmp_path / "notes.txt").write_text("not a trace, and not read")
    traces = load_traces(tmp_path)
    assert [t.rank for t in traces] == [0, 1] and all(t.world_size == 2 for t in traces)
    assert [t.path for t in load_traces(tmp_path, ranks=2)] == [t.path for t in traces]
    with pytest.raises(TraceError, match="asked for 4 ranks' traces; got 2"):
        load_traces(tmp_path, ranks=4)


@pytest.mark.parametrize("spoil, message", [
    (lambda b: b.events.append({**b.events[0], "ts": b.events[0]["ts"] + 5}),
     "two ProfilerStep#10 ranges"),
    (lambda b: b.events.append({**next(e for e in b.events if e["cat"] == "cuda_runtime"),
                                "pid": 99}), "correlation id 101 belongs to two launches"),
    (lambda b: b.events[1].update(ts=float("nan")), "a time must be a finite number"),
    (lambda b: b.events[1].update(dur=-3), "a duration >= 0"),
    (lambda b: [e.pop("cat") for e in b.events], "none of its events has a category"),
])  # fmt: skip
def test_a_trace_that_cannot_be_read_right_is_refused_with_the_reason(tmp_path, spoil, message):
    built = build()
    spoil(built)
    with pytest.raises(TraceError, match=message):
        rank_times(load_trace(built.write(tmp_path / "rank0.json")))


def test_a_folder_that_mixes_jobs_or_holds_junk_is_refused(tmp_path):
    build(rank=0, world_size=2).write(tmp_path / "a.json")
    build(rank=1, world_size=8).write(tmp_path / "b.json")
    with pytest.raises(TraceError, match="jobs of different sizes"):
        load_traces(tmp_path)
    (tmp_path / "b.json").write_text(json.dumps({"metrics": [1, 2]}))
    with pytest.raises(TraceError, match=r"b\.json is not a trace"):
        load_traces(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceError, match="holds no trace files"):
        load_traces(empty)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    build(rank=0).write(mixed / "a.json")
    unnamed = build(rank=1)
    del unnamed.meta["distributedInfo"]
    unnamed.write(mixed / "b.json")
    with pytest.raises(TraceError, match="some traces name their rank"):
        load_traces(mixed)


# --- HTA on the same traces: the same steps, the same figures -------------------------------


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("job")
    # rank 1's kernels are slower; each rank's all-reduce outlasts its step's compute, so
    # part of it is exposed and the overlap is neither 0 nor 1
    built = [build(rank=r, world_size=2, kernel_us=60.0 + 20 * r, all_reduce_us=600.0)
             for r in (0, 1)]
    for r, b in enumerate(built):
        b.write(folder / f"rank{r}.json.gz", gz=True)
    return folder, built


def test_hta_reads_the_same_steps_and_times_as_labkit(job):
    pytest.importorskip("hta")
    folder, _ = job
    report = hta_report(folder)
    assert report.available and set(report.results) == set(ANALYSES), report.describe()
    overlap = report.results["comm_comp_overlap"].set_index("rank")
    breakdown = report.results["temporal_breakdown"].set_index("rank")
    for t in load_traces(sorted(folder.glob("*.json.gz"))):
        r, g = rank_times(t), gpu_split(t)
        # HTA's default drops the last step and rounds times to whole µs: both are off here
        assert 0.1 < r.hidden_fraction < 0.9
        assert overlap.loc[t.rank, "comp_comm_overlap_pctg"] == pytest.approx(
            100 * r.hidden_fraction, abs=0.005)  # HTA rounds it to 2 decimals
        assert breakdown.loc[t.rank, "compute_time(us)"] * US / r.steps == pytest.approx(
            r.compute_s, rel=1e-6)
        assert breakdown.loc[t.rank, "idle_time(us)"] * US / r.steps == pytest.approx(
            g.idle_s, rel=1e-6)


def test_hta_failures_say_what_went_wrong(tmp_path):
    pd = pytest.importorskip("pandas")
    build(rank=3, world_size=4, all_reduce_us=0.0).write(tmp_path / "rank3.json")
    seen = {}

    class Analyzer:  # stands in for HTA: an exception without a message, and a NaN overlap
        def get_temporal_breakdown(self, **kw):
            raise ValueError()

        def get_comm_comp_overlap(self, **kw):
            return pd.DataFrame({"rank": [3], "comp_comm_overlap_pctg": [math.nan]})

        def get_idle_time_breakdown(self, **kw):
            seen.update(kw)
            return pd.DataFrame({"rank": [3], "idle": [1.0]})

        def get_gpu_kernel_breakdown(self, **kw):
            return pd.DataFrame({"kernel": ["gemm"], "time": [1.0]})

    report = hta_report(tmp_path, loader=lambda path: Analyzer())
    assert report.failures["temporal_breakdown"] == "raised ValueError: HTA gave no message"
    why = report.failures["comm_comp_overlap"]
    assert "no communication kernels among the 24 recorded on rank(s) [3]" in why
    assert "no GPU kernel" not in why
    assert seen["ranks"] == [3]  # HTA's idle-time breakdown reads rank 0 unless told
    assert set(report.results) == {"idle_time", "kernel_breakdown"}


def test_side_by_side_puts_labkit_and_hta_in_one_table(job):
    pytest.importorskip("hta")
    folder, _ = job
    traces = load_traces(folder)
    text = hta_side_by_side(hta_report(folder), traces)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["rank", "overlap", "labkit"] and len(lines) == 4
    r0 = rank_times(traces[0])
    assert lines[1].split()[1] == f"{100 * r0.hidden_fraction:.2f}%"
    assert lines[1].split()[2] == lines[1].split()[1]  # HTA's figure, the same
    assert lines[-1].startswith("They agree to within 0.01% on all 6 figures HTA gave")


def test_side_by_side_says_when_there_is_nothing_to_compare_or_they_differ(job):
    pd = pytest.importorskip("pandas")
    folder, _ = job
    traces = load_traces(folder)

    class Silent:  # HTA answering nothing at all
        def __getattr__(self, method):
            def analysis(**kw):
                raise RuntimeError("no")
            return analysis

    text = hta_side_by_side(hta_report(folder, loader=lambda p: Silent()), traces)
    assert text.splitlines()[-1] == "HTA produced nothing to compare with: see its report above for why."
    r = rank_times(traces[0])

    class Off(Silent):  # an overlap 3 points off on rank 0, NaN on rank 1
        def get_comm_comp_overlap(self, **kw):
            return pd.DataFrame({"rank": [0, 1], "comp_comm_overlap_pctg": [
                100 * r.hidden_fraction + 3, float("nan")]})

    verdict = hta_side_by_side(hta_report(folder, loader=lambda p: Off()), traces).splitlines()[-1]
    assert verdict.startswith("They differ, by up to 3.00% of a figure (and HTA gave NaN for some)")
    assert "launched before the first step" in verdict


def test_side_by_side_on_cpu_traces_says_what_stands_in_for_hta(tmp_path):
    built = build()
    built.events[:] = [e for e in built.events if e["cat"] not in ("kernel", "gpu_memcpy")]
    cpu = load_trace(built.write(tmp_path / "cpu.json"))
    report = hta_report(tmp_path, loader=lambda p: None)
    assert report.no_kernels and "hold no GPU kernels" in report.describe().splitlines()[0]
    text = hta_side_by_side(report, [cpu])
    assert text.startswith("No GPU kernels, so nothing of HTA's") and "from the threads" in text


def _bars(ax, row: str) -> list[tuple[float, float]]:
    """(left, right) in ms of every bar drawn on the row labelled ``row``."""
    y = [tick.get_text() for tick in ax.get_yticklabels()].index(row)
    out = []
    for coll in ax.collections:
        for path in coll.get_paths():
            xs, ys = path.vertices[:, 0], path.vertices[:, 1]
            if ys.min() < y < ys.max():
                out.append((xs.min(), xs.max()))
    return out


def test_the_timeline_of_a_gpu_step_shows_the_kernels_it_launched(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    built = build(steps=3, kernel_us=150.0, earlier=2)  # the CPU runs ahead; 2 older kernels
    t = load_trace(built.write(tmp_path / "rank0.json"))
    last, first = t.steps[2], t.steps[0]
    last_end = max(b for _, b in built.compute)
    assert last_end > last.end_us  # the last step's kernels end after its range
    stream = _bars(plot_trace(t, steps=slice(2, 3)), "CUDA stream 7")
    assert max(right for _, right in stream) == pytest.approx((last_end - last.start_us) / 1e3)
    ax = plot_trace(t, steps=slice(0, 1))
    main = _bars(ax, "training loop (main thread)")  # the CPU's row ends with its step
    assert max(right for _, right in main) <= (first.end_us - first.start_us) / 1e3 + 1e-9
    stream = _bars(ax, "CUDA stream 7")
    own_first = min(a for a, _ in built.compute)
    assert min(left for left, _ in stream) == pytest.approx((own_first - first.start_us) / 1e3)
    assert own_first > max(b for _, b in built.earlier) - 1e-6  # older kernels ran first, undrawn
    plt.close("all")
