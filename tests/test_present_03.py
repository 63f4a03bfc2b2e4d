"""Notebook 03's read-outs, moved into labkit (issue 32: a notebook cell shows the idea): the
pipeline job's results (labkit.workers.pp_train), the tensor-parallel job's (tp_train), the
ideal schedules (parallel.schedules), the TP prediction (parallel.tensor) and the link costs
(formulas.link_costs). Each test gives measured inputs and asserts what describe() prints.
Pure inputs: nothing here launches a job."""

from __future__ import annotations

from types import SimpleNamespace

import matplotlib
import pytest

from labkit import formulas
from labkit.config import ModelConfig
from labkit.parallel import schedules, tensor
from labkit.workers import pp_train, tp_train

matplotlib.use("Agg")

TINY = ModelConfig(vocab_size=256, seq_len=8, n_layer=2, n_head=2, d_model=16)


def job(ranks, device="cpu", backend="gloo"):
    return SimpleNamespace(rank=lambda r: ranks[r], world_size=len(ranks), device=device,
                           backend=backend)


def ev(rank, mb, kind, start_ms, end_ms):
    return {"rank": rank, "mb": mb, "kind": kind, "start_s": start_ms / 1e3, "end_s": end_ms / 1e3}


NAIVE = [ev(0, 0, "F", 0, 4), ev(1, 0, "F", 5, 10), ev(1, 0, "B", 10, 15), ev(0, 0, "B", 16, 20)]


class Sample:
    def __init__(self, source, time_s, **values):
        self.source, self.time_s, self.values = source, time_s, values

    def get(self, key):
        return self.values.get(key)


def test_naive_split_gives_each_ranks_idle_share_and_what_the_cpu_monitor_saw():
    cpu = SimpleNamespace(kind="cpu", period_s=0.25, samples=[
        Sample("rank0", 0.0, cpu_pct=5.0), Sample("rank1", 0.0, cpu_pct=90.0),
        Sample("rank0", 0.25, cpu_pct=50.0), Sample("rank1", 0.25, cpu_pct=60.0),
        Sample("rank0", 0.5, cpu_pct=3.0), Sample("host", 0.5, cpu_pct=3.0)])
    split = pp_train.NaiveSplit.from_job(job([{"events": {"naive/1": NAIVE}}] * 2), 0.5, cpu)
    assert split.describe().splitlines() == [
        "measured: rank 0 busy 8.0 ms of a 20.0 ms step -> idle 60% (predicted 50%)",
        "measured: rank 1 busy 10.0 ms of a 20.0 ms step -> idle 50% (predicted 50%)",
        "monitor (measured): in 1 of 2 samples one rank used < 10% of a core while the other "
        "used > 40%; a step took 20 ms, a sample spans 0.25 s"]
    assert split.measured == pytest.approx(0.55)
    assert pp_train.plot_naive_split(split).get_title() == "naive split, one step (measured)"


def test_naive_split_on_gpus_reports_utilisation_and_why_it_hides_the_turns():
    nvml = SimpleNamespace(kind="nvml", period_s=1.0, samples=[
        Sample("gpu0", 0.0, gpu_util_pct=100.0), Sample("gpu0", 1.0, gpu_util_pct=90.0),
        Sample("gpu1", 0.0, gpu_util_pct=99.0)])
    split = pp_train.NaiveSplit.from_job(job([{"events": {"naive/1": NAIVE}}] * 2), 0.5, nvml)
    assert split.describe().splitlines()[-1].startswith(
        "monitor (measured, nvml): mean GPU utilisation gpu0 95%, gpu1 99%; a GPU waiting in ")
    alone = pp_train.NaiveSplit.from_job(job([{"events": {"naive/1": NAIVE}}] * 2), 0.5)
    assert len(alone.describe().splitlines()) == 2  # no monitor, no monitor line


def _act(peak_in_flight, predicted_in_flight, peak_bytes, per_mb):
    return {"peak_in_flight": peak_in_flight, "predicted_in_flight": predicted_in_flight,
            "peak_bytes": peak_bytes, "bytes_per_microbatch": per_mb}


def _run(schedule, m, loss, step_s, bubble, act):
    return {"schedule": schedule, "m": m, "loss": loss, "step_s": step_s, "bubble_mean": bubble,
            "bubble_formula": formulas.bubble_fraction(2, m), "activations": act}


def _terms(stage):
    return formulas.predicted_stage_activations(TINY, 2, blocks=1, first=stage == 0,
                                                last=stage == 1)


def sweep_job(device="cpu", extra_stage1=0):
    exact = [sum(_terms(s).values()) for s in (0, 1)]
    exact[1] += extra_stage1
    ranks = []
    for rank in (0, 1):
        mb = exact[rank]
        ranks.append({"bounds": [[0, 1], [1, 2]], "events": {"gpipe/2": NAIVE, "1f1b/2": NAIVE},
                      "runs": [_run("gpipe", 1, 5.5, 0.050, 0.55, _act(1, 1, mb, mb)),
                               _run("gpipe", 2, 5.5, 0.040, 0.40, _act(2, 2, 2 * mb, mb)),
                               _run("1f1b", 1, 5.5, 0.052, 0.56, _act(1, 1, mb, mb)),
                               _run("1f1b", 2, 5.500001, 0.041, 0.375,
                                    _act(2 - rank, 2 - rank, (2 - rank) * mb, mb))]})
    return job(ranks, device)


def test_sweep_prints_the_table_and_the_loss_spread():
    sweep = pp_train.Sweep.from_job(sweep_job())
    text = sweep.describe().splitlines()
    assert text[0] == "    schedule   m     loss  step ms  bubble (measured)  (p−1)/(m+p−1)"
    assert text[2] == "       gpipe   2   5.5000     40.0               0.40           0.33"
    assert text[-2:] == ["", "measured: the losses of every schedule and m differ by at most 1.0e-06"]
    assert sweep.loss_spread == pytest.approx(1e-6)
    assert sweep.p == 2 and sweep.bounds == [(0, 1), (1, 2)]


def test_bubbles_hold_each_m_against_the_formula_and_warn_about_the_gpu_probe():
    assert pp_train.Sweep.from_job(sweep_job()).bubbles("1f1b").describe().splitlines() == [
        "1F1B m = 1: measured 0.56 vs predicted 0.50 (gap +0.06)",
        "1F1B m = 2: measured 0.38 vs predicted 0.33 (gap +0.04)"]
    on_gpu = pp_train.Sweep.from_job(sweep_job("cuda:0")).bubbles("gpipe").describe()
    assert on_gpu.startswith("GPU ranks: every F/B mark synchronised the whole device")
    assert on_gpu.splitlines()[1] == "GPipe m = 1: measured 0.55 vs predicted 0.50 (gap +0.05)"


def test_plots_of_a_sweep_name_their_axes():
    sweep = pp_train.Sweep.from_job(sweep_job())
    ax1, ax2 = pp_train.plot_bubbles(sweep, schedules=("gpipe", "1f1b"))
    assert (ax1.get_ylabel(), ax2.get_ylabel()) == ("idle share of the step", "idle time / busy time")
    assert ax1.get_title() == "bubble, p = 2"
    titles = [ax.get_title() for ax in pp_train.plot_schedules(sweep, 2)]
    assert titles == ["gpipe, p = 2, m = 2 (measured)", "1f1b, p = 2, m = 2 (measured)"]


def test_activation_memory_reconciles_to_the_byte_or_names_what_is_unexplained():
    held = pp_train.ActivationMemory.from_sweep(pp_train.Sweep.from_job(sweep_job()), TINY,
                                                m=2, batch_size=4)
    text = held.describe().splitlines()
    mb0 = sum(_terms(0).values())
    assert text[0] == (f"     gpipe stage 0: holds 2 of m = 2 micro-batches (as predicted: 2); "
                       f"peak {2 * mb0 / 2**20:.2f} MiB measured vs {2 * mb0 / 2**20:.2f} MiB "
                       "predicted")
    assert text[4:6] == ["", "one micro-batch (2 sequences), per stage:"]
    layers = _terms(0)["transformer layers (flash attention)"]
    assert text[6] == (f"  stage 0: predicted (formula, 1 layer) {layers:,} B; measured {mb0:,} B; "
                       f"gap {mb0 - layers:+,} B")
    assert "    left out of the formula: token and position ids: 192 B" in text
    assert text.count("    formula + the terms it leaves out = measured, to the byte") == 2
    assert held.held == {("gpipe", 0): 2, ("gpipe", 1): 2, ("1f1b", 0): 2, ("1f1b", 1): 1}

    off = pp_train.ActivationMemory.from_sweep(pp_train.Sweep.from_job(sweep_job(extra_stage1=64)),
                                               TINY, m=2, batch_size=4)
    measured1 = sum(_terms(1).values()) + 64
    assert off.describe().splitlines()[-1] == (
        f"    still unexplained: +64 B ({64 / measured1:+.2%} of the measured bytes)")
    ax = pp_train.plot_activation_memory(off)
    assert (ax.get_ylabel(), ax.get_title()) == ("MiB", "peak activation memory per stage, m = 2")


def test_closing_note_gives_both_bubble_conventions_and_the_bytes_held():
    sweep = pp_train.Sweep.from_job(sweep_job())
    naive = pp_train.NaiveSplit.from_job(job([{"events": {"naive/1": NAIVE}}] * 2), 0.5)
    held = pp_train.ActivationMemory.from_sweep(sweep, TINY, m=2, batch_size=4,
                                                schedules=("1f1b",))
    text = pp_train.describe_closing(naive, sweep.bubbles("1f1b"), held).splitlines()
    assert text[:3] == [
        "naive split: bubble measured 0.55, predicted 0.50",
        "1F1B m =  1: bubble measured 0.56, predicted 0.50; overhead measured 1.27, predicted 1.00",
        "1F1B m =  2: bubble measured 0.38, predicted 0.33; overhead measured 0.60, predicted 0.50"]
    assert text[3] == ("micro-batches held at m = 2: {('1f1b', 0): 2, ('1f1b', 1): 1} "
                       "(predicted GPipe 2, 1F1B p − stage)")
    assert text[4].startswith("1f1b stage 0: peak activations measured ")
    assert text[4].endswith(" B (formula + the terms it leaves out)")


def test_ideal_runs_match_the_formula_and_hold_what_the_order_says():
    gpipe, one_f = (schedules.ideal_run(n, 4, 8) for n in ("gpipe", "1f1b"))
    assert gpipe.describe() == ("gpipe: modelled bubble 0.2727; formula (p−1)/(m+p−1) = 0.2727; "
                                "peak micro-batches held by stage 0: 8")
    assert one_f.describe().endswith("peak micro-batches held by stage 0: 4")
    titles = [ax.get_title() for ax in schedules.plot_ideal_runs([gpipe, one_f])]
    assert titles[1] == "1f1b, p = 4, m = 8 (modelled, ideal clock)"


def test_tp_prediction_prints_parameters_and_bytes_per_step():
    predicted = tensor.predict_tp(TINY, 2, 4)
    assert predicted.describe().splitlines() == [
        f"predicted: {predicted.params_per_rank:,} parameters per rank "
        f"({4 * predicted.params_per_rank / 2**20:.2f} MiB fp32) vs {predicted.params_single:,} "
        f"on one device: {predicted.params_per_rank / predicted.params_single:.0%}",
        "predicted: 8 all-reduces per step (4 per layer × 2 layers), 2 KiB each (b·s·h·4 bytes), "
        "0.02 MiB per step; each rank sends 0.02 MiB (ring, 2(n−1)/n)"]
    assert (predicted.calls, predicted.bytes_per_call) == (8, 4 * 8 * 16 * 4)
    assert predicted.params_per_rank == tensor.tp_params_per_rank(TINY, 2)


def _tp_job(dtensor_losses=(5.5, 5.25), dtensor_collectives=None):
    predicted = tensor.predict_tp(TINY, 2, 4)
    per_call = predicted.bytes_per_call
    counts = {"forward": {"all_reduce": 4}, "backward": {"all_reduce": 4}}
    ours = {"losses": [5.5, 5.25], "param_bytes": 4 * predicted.params_per_rank,
            "param_bytes_single_process": 4 * predicted.params_single, "step_s": 0.02,
            "comm_per_step": [{"forward_calls": 4, "backward_calls": 4,
                               "forward_bytes": 4 * per_call, "backward_bytes": 4 * per_call}],
            "collectives": counts}
    dtensor = {"losses": list(dtensor_losses), "param_bytes": 4 * predicted.params_per_rank,
               "step_s": 0.03, "collectives": dtensor_collectives or counts}
    return job([{"gpt": ours, "dtensor": dtensor}]), predicted


def test_tp_run_prints_what_it_counted_and_checks_it():
    run = tp_train.TPRun.from_job(*_tp_job())
    run.check()
    text = run.describe().splitlines()
    assert text[0] == "losses, ours:    [5.5, 5.25]"
    assert text[3] == "counted:  4 all-reduces forward + 4 backward, 0.02 MiB per step; predicted 8 and 0.02 MiB"
    assert text[4:7] == ["CommDebugMode, first step (ours): all_reduce 4 forward + 4 backward",
                         "CommDebugMode, first step (DTensor): all_reduce 4 forward + 4 backward",
                         "-> the same collectives, call for call (checked)"]
    assert text[-1] == "measured: 20.0 ms per step (ours), 30.0 ms (DTensor), on gloo/cpu"
    assert tp_train.describe_closing(run).splitlines() == [
        "CommDebugMode (ours): {'all_reduce': 4} forward, {'all_reduce': 4} backward",
        "CommDebugMode (DTensor): {'all_reduce': 4} forward, {'all_reduce': 4} backward",
        "tensor parallel: 8 all-reduces and 16,384 bytes per step counted; formula 8 and 16,384"]


def test_tp_run_check_fails_on_other_collectives_or_losses():
    other = {"forward": {"all_reduce": 4}, "backward": {"all_reduce": 8}}
    run = tp_train.TPRun.from_job(*_tp_job(dtensor_collectives=other))
    with pytest.raises(AssertionError, match="section 5's table"):
        run.check()
    assert "-> the same collectives, call for call: NOT the same" in run.describe()
    with pytest.raises(AssertionError, match="same split, same sums"):
        tp_train.TPRun.from_job(*_tp_job(dtensor_losses=(5.5, 5.3))).check()


def test_tp_comm_cost_prices_a_step_and_lets_the_verdict_choose():
    run = tp_train.TPRun.from_job(*_tp_job())
    ar = job([{"median_s": 0.001, "busbw_GBps": 0.5}])
    text = tp_train.TPCommCost.from_job(ar, run).describe().splitlines()
    assert text[0] == "measured here: one all-reduce of 2 KiB takes 1.00 ms over gloo (busbw 0.50 GB/s)"
    assert text[1] == ("so the 8 all-reduces of a tensor-parallel step cost about 8.0 ms (measured "
                       "all-reduce time × counted calls)")
    assert text[2] == ("verdict: the tensor-parallel all-reduces' time is 40% of a measured step "
                       "of ours (8.0 ms of 20.0 ms)")
    slow = job([{"median_s": 0.01, "busbw_GBps": 0.05}])
    over = tp_train.TPCommCost.from_job(slow, run).describe().splitlines()[2]
    assert "the all-reduce was timed at a busier moment than the steps" in over


def test_link_costs_print_the_modelled_table():
    costs = formulas.link_costs(4096, 4096, 1, 8, 989e12, {"NVLink 4 (H100 SXM)": 450e9,
                                                           "100 GbE": 12.5e9})
    text = costs.describe().splitlines()
    assert text[:4] == [
        "modelled, per layer and micro-batch (h = 4096, s = 4096, b = 1, bf16):",
        "                          compute ms  TP 8 comm ms  TP/compute  PP comm ms",
        "     NVLink 4 (H100 SXM)        0.73          0.52         0.7        0.15",
        "                 100 GbE        0.73         18.79        25.8        5.37"]
    assert text[4] == ("data parallel over NVLink 4 (H100 SXM): ≥ 1,923 tokens per rank per "
                       "micro-batch to hide the gradient all-reduce behind the last backward "
                       "(modelled)")
    with pytest.raises(ValueError, match="links"):
        formulas.link_costs(4096, 4096, 1, 8, 989e12, {"none": 0.0})
