"""Notebook 06's read-outs (labkit.profiling.step_report, dp_report, fix_report and
labkit.recordings.evidence): what each describe() prints for given measurements, and which
sentence the numbers choose. Pure inputs: nothing here profiles or launches anything."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from labkit import config
from labkit.model import GPT
from labkit.profiling import bottlenecks, capture, dp_report, fix_report, step_report
from labkit.profiling.bottlenecks import BeforeAfter, Measured
from labkit.profiling.capture import Overhead
from labkit.profiling.overlap import RankTimes
from labkit.recordings import evidence

MiB = 2**20


def test_tier_note_names_what_each_tier_cannot_show():
    assert "cannot show GPU kernels" in step_report.tier_note(False)
    assert step_report.tier_note(True).startswith("This tier shows GPU profiles for real")


def _split(fwd, bwd, core):
    n = len(fwd)
    return step_report.PhaseSplit({"data": [0.0002] * n, "forward": fwd, "backward": bwd,
                                   "optimizer": [0.0015] * n}, 11.0, core)


def test_phase_split_describes_phases_and_chooses_the_ratio_sentence():
    text = _split([0.003, 0.003, 0.003], [0.0055, 0.0052, 0.0063], 0.46).describe().splitlines()
    assert text[1] == "  forward    median    3.00 ms per step (min 3.00, max 3.00; measured)"
    assert text[4] == ("measured under the profiler: backward / forward = 1.83 (median of 3 steps, "
                       "1.73 to 2.10); predicted 2.0 from FLOPs")
    assert "optimizer phase takes 14% of a 11.0 ms step" in text[5]
    assert text[6] == ("2.0 lies within the steps' own spread (1.73 to 2.10): the split is consistent "
                       "with the FLOP ratio. But matmuls and attention hold only 46% of the time: "
                       "the other 54% is work a FLOP count does not describe (other operators, and "
                       "the time between them), so a ratio near 2 does not show here that the FLOPs "
                       "set the split.")


@pytest.mark.parametrize(("bwd", "core", "sentence"), [
    ([0.0012, 0.009, 0.0015], 0.7,
     "2.0 lies within the steps' own spread (0.40 to 3.00): the split is consistent with the FLOP "
     "ratio. Matmuls and attention hold more than half of the time (70%), as a FLOP model assumes."),
    ([0.0075, 0.0072, 0.008], 0.7,
     "Every step's ratio lies above 2.0 (lowest 2.40): the split differs from the FLOP ratio by "
     "more than the steps' own spread. Matmuls and attention hold more than half of the time "
     "(70%), as a FLOP model assumes."),
    ([0.0045, 0.0042, 0.005], 0.5,  # half is not more than half
     "Every step's ratio lies below 2.0 (highest 1.67): the split differs from the FLOP ratio by "
     "more than the steps' own spread. Matmuls and attention hold only 50% of the time: the other "
     "50% is work a FLOP count does not describe (other operators, and the time between them)."),
])  # fmt: skip
def test_phase_split_every_clause_is_chosen_by_a_measured_number(bwd, core, sentence):
    assert _split([0.003] * 3, bwd, core).describe().splitlines()[-1] == sentence


def test_flop_check_equal_counts_and_the_formula_share():
    model = GPT(config.preset("smoke").model)
    n_linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    tokens = 512
    counted = {"aten::mm": 4 * n_linear * tokens, "aten::addmm": 2 * n_linear * tokens,
               "aten::add": 250_000.0}
    check = step_report.FlopCheck(counted, n_linear, model.num_params(exclude_position_embedding=True),
                                  tokens, 1e6, 50_331_648)
    lines = check.describe().splitlines()
    assert lines[0] == ("counted by the profiler per step (with_flops, measured shapes): aten::add "
                        "0.2 MFLOP, aten::addmm 117.4 MFLOP, aten::mm 234.9 MFLOP")
    assert lines[2] == ("verdict: equal, to the FLOP: the profiler's matmul count is 6 per weight "
                        "per token.")
    off = step_report.FlopCheck({"aten::mm": 6 * n_linear * tokens * 1.1}, n_linear, n_linear,
                                tokens, 1e6, 0)
    assert off.describe().splitlines()[2].startswith("verdict: they differ by 10.00%")


def test_flop_check_counts_the_matmuls_op_kinds_names():
    # the FLOP columns with_flops fills (torch 2.13): four matmuls, conv2d, mul and add
    counted = {"aten::mm": 1.0, "aten::addmm": 2.0, "aten::bmm": 4.0, "aten::baddbmm": 8.0,
               "aten::conv2d": 16.0, "aten::mul": 32.0, "aten::add": 64.0}
    assert step_report.FlopCheck(counted, 1, 1, 1, 1.0, 0).counted_mm == 15.0


def _overhead(off, on):
    return Overhead({"off": off, "on": on}, {"off": [], "on": [0.5]}, "cpu", "a method",
                    block=3)


def test_overhead_report_table_rate_and_noisy_verdict():
    off, on = [0.010] * 9, [0.012] * 9
    report = step_report.judge_overhead(_overhead(off, on), ops_per_step=2000, step_ms=11.0)
    lines = report.describe().splitlines()
    assert lines[0] == ""
    assert lines[2] == "off                       10.00 ms     1.00×                               "
    assert lines[3] == "on                        12.00 ms     1.20×        1.0 µs           500 ms"
    assert lines[-1] == ("So recording costs about 1.0 µs per operator here: the rate tested on a "
                         "second model below.")
    noisy = step_report.judge_overhead(_overhead([0.01, 0.02, 0.01, 0.03, 0.01], [0.02, 0.01, 0.03,
                                                                                  0.01, 0.02]),
                                       ops_per_step=10, step_ms=1.0)
    assert noisy.describe().endswith("Rerun the cell on a quieter machine.")


def test_overhead_rate_verdicts():
    model = GPT(config.preset("smoke").model)
    wide = _overhead([0.02] * 15, [0.022] * 15)
    report = step_report.judge_overhead(_overhead([0.01] * 9, [0.012] * 9), ops_per_step=2000,
                                        step_ms=11.0)
    rate = report.predict(wide, ops_per_step=2000, model=model)
    lines = rate.describe().splitlines()
    assert lines[0].startswith("wide model: d_model 64, 120,576 parameters; 2,000 CPU operators")
    assert lines[1] == "predicted overhead: 1.0 µs × 2,000 operators = 2.00 ms per step"
    assert lines[-1].startswith("verdict: the measured overhead lies within 50% of the prediction")
    negative = step_report.OverheadRate(1e-6, 10, [-0.001] * 5, "m")
    assert negative.describe().endswith("rerun on a quieter machine.")
    assert negative.outcome == "negative"


def test_memory_prediction_and_net_bytes():
    pred = step_report.MemoryPrediction(int(1.38 * MiB), int(0.46 * MiB), int(0.5625 * MiB), 0, 8,
                                        "float32")
    assert pred.describe().splitlines()[1] == ("predicted: the forward adds 4.50 MiB in float32 "
                                               "(0.562 MiB per sequence × 8)")
    net = step_report.NetBytesCheck({"data": 8192, "forward": 5.4 * MiB, "backward": -4 * MiB},
                                    {"data": 8192, "forward": 4.5 * MiB, "optimizer": -MiB},
                                    "CPU Mem", 2, [("aten::mm", 3.3 * MiB, 27)])
    lines = net.describe().splitlines()
    assert lines[1] == "  data          +0.008 MiB   predicted    +0.008 MiB: equal, to the byte"
    assert lines[2].endswith("within 25% (measured / predicted = 1.20)")
    assert lines[3].endswith("(no prediction: it frees the activations and adds the gradients)")
    assert lines[4] == "  optimizer  not recorded"
    assert lines[-1].endswith("aten::mm 3.30 MiB in 27 calls")


def test_dp_prediction_and_cpu_step():
    pred = dp_report.DpPrediction(2, int(0.46 * MiB), 0.46 * MiB, 0.05, 7)
    assert pred.describe().splitlines()[1] == ("predicted: naive hides 0% of its communication; "
                                               "ddp with 0.05 MB buckets (7 of them) can hide at "
                                               "most about 86%")
    assert capture.CpuRankStep(0.0123, 2, 2).describe().startswith(
        "One GPU and 2 ranks: the ranks run on the CPU over gloo, with the CPU tier's 2-layer "
        "model (measured: 12.3 ms per step")


def test_the_cpu_rank_step_is_timed_by_the_benchmark_first_step_a_warm_up(monkeypatch):
    # capture measures (timing.benchmark: one warm-up, then steps - 1 repeats); the report
    # module only describes the result
    seen = {}

    def fake_benchmark(fn, **kw):
        seen.update(kw)
        for _ in range(kw["warmup"] + kw["repeats"]):
            fn()
        return SimpleNamespace(median_s=0.02)

    calls = []
    monkeypatch.setattr(capture, "benchmark", fake_benchmark)
    preset = config.preset("smoke")
    shard = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    step = capture.time_cpu_step(lambda model, opt, batch, dtype: calls.append(batch()[0].shape),
                                 preset, shard, nproc=2)  # fmt: skip
    assert (seen["warmup"], seen["repeats"], seen["device"]) == (1, 5, "cpu")
    assert len(calls) == 6 and step == capture.CpuRankStep(0.02, preset.model.n_layer, 2)
    assert "time_cpu_step" not in vars(dp_report)


def _rt(rank, step, comm, hidden):
    return RankTimes(rank, 3, step, 0.01, comm, hidden, comm - hidden, "test")


class _Trace:
    rank = 0

    def collective_calls(self, op):
        return [op] * 21

    def per_step(self, spans):
        return len(spans) / 3


def test_dp_runs_describe_bound_and_comparison():
    traces = {"naive": [_Trace()], "ddp": [_Trace()]}
    times = {"naive": [_rt(0, 0.06, 0.04, 0.0)], "ddp": [_rt(0, 0.02, 0.014, 0.004)]}
    runs = dp_report.DpRuns(traces, times, "gloo", "cpu", 7)
    lines = runs.describe().splitlines()
    assert lines[1] == "per rank and step (measured from each rank's trace; gloo on cpu):"
    assert lines[-2] == ("measured: ddp ran 7 all-reduces per step on rank 0 (one per bucket; "
                         "predicted 7)")
    assert lines[-1].startswith("On CPU ranks a collective's time is the life of gloo's work item")
    assert runs.describe_bound(0.86).splitlines()[2].startswith("verdict: inside the bound")
    assert runs.describe_bound(0.2).splitlines()[2].startswith("verdict: above the bound")
    ranks = [{"step_s": {"naive": [0.06] * 6, "ddp": [0.02] * 6}}]
    cmp = runs.compare(ranks, tokens_per_rank_step=512, active=6, n_tensors=36)
    text = cmp.describe().splitlines()
    assert text[0] == ("measured: naive 8,533 tokens/s, ddp 25,600 tokens/s (3.00×), exposed "
                       "communication per step: naive 40.0 ms, ddp 10.0 ms")
    assert text[3] == "verdict: ddp buckets is faster than naive all-reduce by 40.000 ms (66.7%)"
    assert text[-1] == ("measured: communication per step 40.0 → 14.0 ms, of which 4.0 ms hidden "
                        "under the backward pass in ddp (overlap)")


def test_straggler_report_sentences():
    report = dp_report.StragglerReport({"ddp": None, "ddp, rank 1 slowed": None},
                                       "ddp, rank 1 slowed", 18, [0.018] * 5, (66.1, 21.0))
    lines = report.describe().splitlines()
    assert lines[0] == ("ddp                  no rank stands out step after step: within 30% of "
                        "the others' own work")
    assert lines[3].startswith("predicted: rank 0 waits about the planted 18 ms more per step; "
                               "measured: its exposed communication changed +18.0 ms")
    assert lines[5] == "verdict: within 30% of the planted delay: rank 0 waited for rank 1."
    assert lines[6] == ("measured: naive step 66.1 ms, ddp step 21.0 ms (median over ranks of "
                        "the per-rank mean)")
    assert report.named is None


def test_diff_counts():
    diff = SimpleNamespace(table=object(), per_step=lambda name: {
        "gloo:all_reduce": (36.0, 7.0), "communication": (1.0, 0.0)}[name])
    text = dp_report.describe_diff_counts(diff, predicted=(36, 7), counted=(36.0, 7.0),
                                          backend="gloo").splitlines()
    assert text[1] == ("all-reduces per step, naive → ddp: predicted 36 → 7; HTA counted 36 → 7; "
                       "labkit counted 36 → 7")
    assert text[2] == "verdict: HTA's counts equal the prediction and labkit's."
    wrong = dp_report.describe_diff_counts(diff, predicted=(36, 8), counted=(36.0, 7.0),
                                           backend="gloo")
    assert "the counts differ" in wrong
    assert dp_report.describe_diff_counts(SimpleNamespace(table=None), predicted=(1, 1),
                                          counted=(1, 1), backend="gloo") == ""


def _measured(name, step, data):
    return Measured(name, tuple(step), 512, "cpu", "test", data_s=tuple(data))


def test_predict_loading_reads_what_time_batch_loading_measured():
    ds = bottlenecks.TokenizingDataset(seq_len=16, passes=2, n_items=12)
    ticks = iter(range(100))
    timed = bottlenecks.time_batch_loading(ds, batch_size=4, batches=3, clock=lambda: next(ticks))
    assert timed.samples_s == (1, 1, 1) and timed.warmup == 0  # three batches, each its own items
    pred = fix_report.predict_loading(ds, batch_size=4, compute_s=0.01)
    assert (pred.compute_s, pred.passes) == (0.01, 2) and pred.load_s > 0
    assert "time" not in vars(fix_report)  # no clock of its own


def test_loading_prediction_and_fix():
    pred = fix_report.LoadingPrediction(0.0084, 0.0089, 248)
    assert pred.describe().splitlines()[1] == ("predicted: num_workers=0 → 17.3 ms per step; one "
                                               "worker keeping up → 8.9 ms")
    before = _measured("num_workers=0", [0.017] * 8, [0.009] * 8)
    after = _measured("num_workers=1", [0.009] * 8, [0.0005] * 8)
    fix = pred.against(BeforeAfter(bottleneck="data loading", before=before, after=after,
                                   variants=(before, after), note="a note"))
    text = fix.describe()
    assert "The fix made the steps 1.89× faster: the worker loads the next batches" in text
    assert text.endswith("The fixed loader reached the predicted floor: one worker kept up.")


def test_compile_bound_skipped():
    bound = fix_report.judge_compile(0.46, None, size="smoke")
    assert bound.prediction() == ("predicted: at most 2.2× faster (1 / 46%, the share of matmuls "
                                  "and attention, section 1)")
    assert bound.describe().startswith("skipped at size='smoke': a cold torch.compile")


def test_public_job_not_found_says_how(monkeypatch):
    monkeypatch.setattr(evidence.public, "find_or_fetch",
                        lambda key, allow_fetch: (None, "not here: fetch it"))
    job = evidence.public_job(allow_fetch=False)
    assert job.describe() == "not here: fetch it"
    assert job.traces == ()
