"""Notebook 03d's presentation, moved into labkit: each describe() prints what the notebook's
cell printed before (the strings below are the notebook's smoke-size output where the input is
deterministic), and each plot draws its panels."""

from __future__ import annotations

import types

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from labkit import collective_debug as cd
from labkit import planner
from labkit.batching import recomputation, recompute_lab
from labkit.config import ModelConfig
from labkit.model import GPT
from labkit.parallel import schedules as sch
from labkit.workers import pp_compose

SMOKE = ModelConfig(seq_len=32, n_layer=4, n_head=4, d_model=64)


@pytest.fixture(scope="module")
def lab():
    threads = torch.get_num_threads()
    ac = recompute_lab.open_lab(SMOKE, 4, tier="cpu")
    torch.manual_seed(0)
    base = GPT(SMOKE)
    models = {}
    for mode in recomputation.AC_MODES:
        models[mode] = GPT(SMOKE)
        models[mode].load_state_dict(base.state_dict())
        recomputation.apply_ac(models[mode], mode)
    yield ac, models, recompute_lab.predict_modes(SMOKE, 4)
    torch.set_num_threads(threads)


def test_open_lab_says_the_threads_and_the_batch(lab):
    ac = lab[0]
    assert ac.describe().splitlines()[1] == "4 blocks, micro-batch 4 x 32 tokens, float32, on cpu"
    assert ac.describe().startswith("PyTorch CPU threads: 1 (was ")
    assert ac.batch[0].shape == (4, 32) and torch.equal(ac.batch[1], torch.roll(ac.batch[0], -1, dims=1))


def test_predicted_modes_print_the_notebooks_table(lab):
    assert lab[2].describe() == (
        "mode          per block   whole model  saved vs none  FLOPs per step   (all predicted)\n"
        "none          0.504 MiB      2.20 MiB            0%          1.000x\n"
        "selective     0.346 MiB      1.57 MiB           29%          1.009x\n"
        "full          0.031 MiB      0.31 MiB           86%          1.211x\n\n"
        "GPT-3 175B by the paper's formula s·b·h·(34 + 5as/h), s=2048, h=12288, a=96 (predicted): "
        "2,736 MiB per layer and sequence; selective keeps 34·sbh (70% less), full 2·sbh (98.2% less)")


def test_held_bytes_meet_the_prediction_to_the_byte(lab):
    ac, models, pred = lab
    held = recompute_lab.measure_modes(models, ac, pred)
    lines = held.describe().splitlines()
    assert lines[1] == "none              2.204 MiB    2.204 MiB                   +0 B"
    assert lines[3] == "full              0.314 MiB    0.314 MiB                   +0 B"
    assert lines[4].startswith("selective: gradients against none's (measured): largest difference 0.0e+00")
    assert lines[4].endswith(": bitwise equal") and held["none"] == pred["none"].held_bytes


def test_stage_memory_prints_the_1f1b_table(lab):
    ac, models, pred = lab
    text = recompute_lab.measure_stage_memory(models, ac, pred, stages=4, micro_batches=8).describe()
    lines = text.splitlines()
    assert lines[0] == ("4 stages of 1 block(s), 8 micro-batches of 4: activation MiB per stage "
                        "(predicted; the embeddings and the head left out)")
    assert lines[2] == "0               4        2.14        1.51        0.25"
    assert lines[6] == "GPipe           8        4.28        3.02        0.50"
    assert lines[7] == ("stage 0, none     : after each forward 0.54, 1.07, 1.61, 2.14 MiB (measured), "
                        "predicted 2.14 MiB: equal to the byte")


def test_recompute_times_say_where_the_flops_factor_lands():
    times = recompute_lab.RecomputeTimes(
        times={"none": [1.0] * 5, "selective": [1.2] * 5, "full": [1.3, 1.3, 1.3, 1.3, 1.3]},
        flops_factor={"none": 1.0, "selective": 1.009, "full": 1.3}, peak_bytes={})
    lines = times.describe().splitlines()
    assert lines[0] == ""
    assert lines[1] == ("selective: step time 1.20x none's (middle half 1.20x to 1.20x, measured); "
                        "FLOPs 1.009x (predicted), below that middle half")
    assert ("full: step time 1.30x none's (middle half 1.30x to 1.30x, measured); "
            "FLOPs 1.300x (predicted), inside that middle half") in lines
    assert "verdict: none is faster than selective by 200.000 ms (16.7%)" in lines


def test_time_modes_and_the_plot(lab, capsys):
    ac, models, pred = lab
    from labkit import config

    times = recompute_lab.time_modes(models, ac, pred, config.preset("smoke").train, rounds=2)
    assert capsys.readouterr().out == "timing 2 rounds (and 1 warm-up) of one step per mode, taking turns: w 1 2\n"
    assert {m: len(t) for m, t in times.times.items()} == {"none": 2, "selective": 2, "full": 2}
    assert times.peak_bytes == {} and times.flops_factor["full"] == pred["full"].flops_factor
    held = recompute_lab.measure_modes(models, ac, pred)
    ax = recompute_lab.plot_recompute(pred, held, times)
    assert "(cpu, micro-batch 4)" in ax.get_title() and len(ax.get_legend().texts) == 7


def test_bubble_formulas_print_the_notebooks_prediction():
    f = sch.bubble_formulas(2, 4, n_layer=4)
    assert f["interleaved_1f1b"] == 0.125 and f["interleaved_zb"] is None
    assert f.describe() == (
        "p = 2 ranks, m = 4 micro-batches, 4 blocks: v = 1 -> 2 stages of 2 blocks, v = 2 -> 4 "
        "stages of 1 block\npredicted bubble overhead (idle / busy; equal stages, free "
        "communication): 1F1B (p-1)/m = 0.250; interleaved (p-1)/(v m) = 0.125; ZB-V 0 (needs m "
        ">= 2p-1 = 3); ZB-H1 (not run) at T_F = T_I = T_W a third of 1F1B, 0.083")


def _sch_result(over_1f1b, over_int, same=True):
    order = {0: [["F", 0, 0], ["F", 0, 1], ["B", 0, 0], ["B", 0, 1]],
             1: [["F", 1, 0], ["B", 1, 0], ["F", 1, 1], ["B", 1, 1]]}

    def run(over, stages):
        return {"stages": stages, "loss_error": 1e-7, "grad_error": 2e-8, "overhead": over[0],
                "overhead_samples": over, "op_s": {"F": 0.001, "B": 0.002},
                "step_s_samples": [0.01 * (1 + o) for o in over], "events": []}
    return {"runs": {"1f1b": run(over_1f1b, [[0], [1]]), "interleaved_1f1b": run(over_int, [[0, 2], [1, 3]])},
            "orders": {"interleaved_1f1b": order if same else {0: order[1], 1: order[0]}},
            "recorded": {"1f1b": {"order": order, "same_every_step": True},
                         "interleaved_1f1b": {"order": order, "same_every_step": same}}}


def test_schedule_runs_table_and_the_replay_against_the_formula():
    res = sch.reconcile_runs(_sch_result([2.0, 2.5], [3.0, 3.5]), sch.bubble_formulas(2, 2, n_layer=4), repeats=2)
    lines = res.describe().splitlines()
    assert lines[0] == "" and lines[1].startswith("schedule          stages/rank      |loss diff|")
    assert lines[2] == ("1f1b              [[0], [1]]           1.0e-07     2.0e-08           2.00 (2.00..2.50) "
                        "   0.500     0.500  above in every step")
    assert lines[4] == "(measured: median of 2 steps, mean over ranks)"
    assert lines[5] == "median op times measured (ms): 1f1b B 2.00, F 1.00; interleaved_1f1b B 2.00, F 1.00"
    assert lines[6].startswith("1f1b: the order torch ran, replayed (modelled) 0.500 vs formula 0.500: it lands")
    assert lines[-1] == "order run = torch's plan (pipeline_order): interleaved_1f1b"
    other = sch.reconcile_runs(_sch_result([2.0], [3.0], same=False), sch.bubble_formulas(2, 2, n_layer=4), repeats=1)
    assert other.describe().splitlines()[-1] == ("order run = torch's plan (pipeline_order): none; interleaved_1f1b "
                                                 "ran another order than planned; interleaved_1f1b changed order "
                                                 "between steps")


def test_interleaving_verdict_follows_the_overhead_ranges():
    above = sch.reconcile_runs(_sch_result([1.0, 1.2], [3.0, 3.5]), sch.bubble_formulas(2, 2, n_layer=4), repeats=2)
    assert above.interleaving().describe().splitlines()[-1] == (
        "bubble overhead: interleaved above 1F1B in every step (1F1B 1.00..1.20, interleaved 3.00..3.50 over 2 "
        "steps (measured)): its extra messages and per-action costs outweighed its shorter fill here")
    below = sch.reconcile_runs(_sch_result([3.0, 3.5], [1.0, 1.2]), sch.bubble_formulas(2, 2, n_layer=4), repeats=2)
    assert below.interleaving().describe().endswith("the reduction shows here")
    assert sch.InterleavingVerdict(None, None).describe().startswith("(1F1B and interleaved 1F1B were not both run")
    ax = sch.plot_schedule_runs(below)
    assert ax.shape == (1, 2)


def test_predicted_divergences_print_the_notebooks_prediction():
    p = cd.predict_divergences({"steps": 3, "numel": 1024})
    assert p.describe().splitlines() == [
        "the healthy plan: step 1: all_reduce [1024] | step 1: all_gather [1] | step 2: all_reduce [1024] | "
        "step 2: all_gather [1]",
        "predicted, desync: the ranks part at collective #3: rank 0: step 2: all_reduce [1024]; rank 1: "
        "step 2: all_gather [1]",
        "predicted, shape: the ranks part at collective #3: rank 0: step 2: all_reduce [1024]; rank 1: "
        "step 2: all_reduce [1025]",
        "predicted, hang: the ranks part at collective #3: rank 0: step 2: all_reduce [1024]; rank 1: "
        "step 2: (sleeps, outside any collective)"]


def _outcome(fault, detail, **kw):
    base = {"trial": cd.Trial(fault, detail=detail), "mismatch": None, "rank": 0, "hung": [],
            "detect_s": None, "report_s": 4.0, "ended_by": "process-group timeout",
            "message": "headline\nthe job ended\n  a traceback line", "headline": "headline"}
    return types.SimpleNamespace(**{**base, **kw})


def test_reconcile_holds_each_report_against_the_prediction():
    p = cd.predict_divergences({"steps": 3, "numel": 1024})
    fp = types.SimpleNamespace
    desync = _outcome("desync", True, detect_s=0.001, ended_by="DETAIL mismatch",
                      mismatch=fp(this=fp(rank=0, op="ALLREDUCE", shape=(1024,)),
                                  other=fp(rank=1, op="ALLGATHER", shape=(1,))))
    hang = _outcome("hang", False, hung=[1], detect_s=3.0)
    early = _outcome("desync", False, detect_s=1.0)
    killed = _outcome("shape", False)
    assert cd.reconcile([desync, hang, early, killed], p, pg_timeout_s=3).describe().splitlines() == [
        "desync, DETAIL on: DETAIL saw {0: ('ALLREDUCE', (1024,)), 1: ('ALLGATHER', (1,))}, predicted "
        "{0: ('ALLREDUCE', (1024,)), 1: ('ALLGATHER', (1,))}: agree; first error 0.00 s after the bug "
        "(measured): before the 3 s timeout would have expired",
        "hang, DETAIL off: root cause rank 0 (the victim, whose wait expired), hung [1], predicted hung [1]: "
        "agree; first error 3.0 s after the bug (measured), timeout 3 s: as predicted",
        "desync, DETAIL off: first error 1.0 s after the bug (measured), timeout 3 s: SOONER than the "
        "timeout: read why",
        "shape, DETAIL off: no rank raised (they were killed); reported 4.0 s after the bug (measured)"]


def test_describe_reports_indents_the_launchers_words():
    text = cd.describe_reports([_outcome("desync", True)], limit=4)
    assert text.splitlines() == ["--- desync, DETAIL on: ended by process-group timeout", "    headline",
                                 "    the job ended"]


def test_nccl_expected_names_the_gpus_and_the_timeout():
    assert cd.describe_nccl_expected(0, 10) == (
        "0 GPU(s) here: NCCL needs one GPU per rank, so its run is not shown. Expected on two or more "
        "GPUs, not measured here: the desync's INFO lines share an opCount but name AllReduce on rank 0 "
        "and AllGather on rank 1, the watchdog ends both jobs after 10 s, and fr_trace names the first "
        "collective the ranks disagree on.")


@pytest.fixture(scope="module")
def published():
    cases = planner.published_cases(mfu=0.5)
    return cases, {c.name: planner.plan(c.model, c.cluster, c.workload, c.search) for c in cases}


def test_describe_published_prints_the_cases_and_the_tp_verdict(published):
    lines = planner.describe_published(*published, mfu=0.5).splitlines()
    assert lines[:2] == ["assumed: compute runs at MFU 50% of the published dense bf16 peak (an assumption, "
                         "not a measurement)", ""]
    assert lines[4] == "     1  DP1024×TP8       b=1, ZeRO-3                        69.3 GB       12 s  45.6%"
    assert lines[-2:] == ["every published layout and the planner's top two keep TP at one node's GPUs",
                          "the planner's first choice for Llama 3 405B, 8,192 H100: no pipeline, ZeRO-3 over "
                          "1,024 replicas"]
    axes = planner.plot_layouts(published[1], [published[0][0], published[0][2]])
    assert [ax.get_title() for ax in axes] == ["Llama 3 405B, 8,192 H100: 114 layouts", "GPT 1T, 3,072 A100: 76 layouts"]


def test_describe_sensitivity_and_choices(published):
    cases = published[0]
    sweeps = {c.name: planner.sensitivity(c.model, c.cluster, c.workload, c.search, c.shape) for c in cases[:1]}
    assert planner.describe_sensitivity(cases[:1], sweeps).splitlines() == [
        "Llama 3 405B, 8,192 H100 (published DP64×TP8×PP16): the first choice changes with the assumptions "
        "(4 different layouts); the published layout ranks first in 1 of 6 settings", "",
        "Llama 3 405B: with ZeRO's traffic hidden and all 80 GB usable the first choice is DP1024×TP8 "
        "(11.98 s); charged in full it is DP64×TP8×PP16 (18.19 s), the published layout. The answer turns "
        "on an assumption no formula here can measure: on real GPUs, time the two."]

    def choose(preds, memory_bytes, usable):
        fits = [p for p in preds if p.memory["total"] <= usable * memory_bytes]
        return min(fits, key=lambda p: p.step_s) if fits else None

    lines = planner.describe_choices(cases[0], choose).splitlines()
    assert lines[2] == "hidden         100%  DP1024×TP8     b=1, ZeRO-3   69.3 GB  11.98 s  10% slower"
    assert lines[5] == "charged        100%  DP64×TP8×PP16  b=1, ZeRO-2   76.4 GB  18.19 s  is the pick"
    assert planner.describe_choices(cases[0], lambda *a: None).splitlines()[2] == "hidden         100%  nothing fits"


def test_link_fit_and_the_dp_sync_check():
    probe = {"probe_small_bytes": 1000, "probe_small_s": 1e-4, "probe_big_bytes": 1_001_000,
             "probe_big_s": 1.1e-3, "busbw_GBps": 2.0}
    link = planner.fit_link(probe, "gloo")
    assert link.describe() == "measured (gloo): α = 99 µs per message, β = 1.00 GB/s (link probe, one ring step)"
    bad = planner.fit_link({**probe, "probe_big_s": 1e-5}, "gloo")
    assert bad.describe().startswith("no α–β fit (") and bad.describe().endswith("β = 2.00 GB/s (link probe, one ring step)")
    spec = planner.ModelSpec.from_model_config(SMOKE)
    fast = planner.DPSyncCheck(grad_bytes=4 * 2**20, nproc=4, predicted_s=0.01, median_s=0.012, min_s=0.009, repeats=10)
    assert fast.describe().splitlines() == [
        "", "DP4 gradient sync, 4.00 MiB: predicted 10.00 ms (planner, α–β), measured median 12.00 ms, fastest "
        "9.00 ms (10 all-reduces): 1.20 × the prediction",
        "the median is within 1.5× of the prediction either way: the measured link accounts for the all-reduce, "
        "so the planner's DP all-reduce term holds here (one term; the ranking of whole layouts is timed next)"]
    slow = planner.check_dp_sync(spec, link, {"median_s": 1.0, "min_s": 1.0, "repeats": 3}, 4)
    assert slow.grad_bytes == 4 * spec.params and slow.describe().splitlines()[-1].startswith("even the fastest took")


def test_describe_bytes_heads_the_table():
    mach = planner.this_machine(SMOKE, global_batch=8, nproc=4, matmul_flops_per_s=1e10, link_bytes_per_s=1e9)
    text = planner.describe_bytes(planner.plan(*mach))
    assert text.splitlines()[:2] == ["", "MiB each rank sends per step, and the step (modelled from counts, not "
                                     "timed; fp32, 8 sequences, micro-batch 1; FSDP: ZeRO-3, one micro-batch)"]
    assert text.splitlines()[2] == "layout       DP MiB   TP MiB   PP MiB   CP MiB  DP MiB FSDP        step"


def test_layout_runs_table_losses_and_ranking():
    runs = {"DP4": {"microbatches": 2, "step_s": 0.02, "losses": [5.0, 4.9], "step_s_samples": [0.02] * 5},
            "PP4": {"microbatches": 8, "step_s": 0.08, "losses": [5.0, 4.9], "step_s_samples": [0.08] * 5}}
    res = pp_compose.layout_runs({"layouts": runs, "reference_loss": 5.0}, {"PP4": 0.008, "DP4": 0.004}, repeats=5)
    lines = res.describe().splitlines()
    assert res.order == ["DP4", "PP4"]
    assert lines[:4] == ["", "layout     m per replica  predicted  measured median  ratio",
                         "DP4                    2     4.0 ms          20.0 ms   5.0x",
                         "PP4                    8     8.0 ms          80.0 ms  10.0x"]
    assert lines[4] == ("losses: first step 5.00000 (one process 5.00000); the layouts differ by at most "
                        "0.0e+00 over 2 steps: float32 rounding, the same training")
    assert lines[6] == "" and lines[7].startswith("DP4")
    off = pp_compose.layout_runs({"layouts": runs, "reference_loss": 5.1}, {"PP4": 0.008, "DP4": 0.004}, repeats=5)
    assert "MORE than float32 rounding" in off.describe()
