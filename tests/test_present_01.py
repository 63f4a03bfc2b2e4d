"""Notebook 01's presentation, moved into labkit: each function prints what the notebook's cell
printed before, for a given input (issue 32: a notebook cell shows the idea)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import matplotlib
import pytest
import torch

from labkit import config, hardware, memory, throughput, timing, train
from labkit.batching import trials
from labkit.config import ModelConfig, TrainConfig
from labkit.model import GPT
from labkit.monitor import busy
from labkit.recordings import replay
from labkit.roofline import FLOPS, Ceiling

matplotlib.use("Agg")

CPU = torch.device("cpu")
TINY = ModelConfig(vocab_size=256, seq_len=16, n_layer=1, n_head=2, d_model=16)


def history(seconds=(0.2, 0.1, 0.1, 0.1, 0.1), tokens=100):
    h = train.History()
    for i, s in enumerate(seconds, start=1):
        stats = train.StepStats(loss=5.0 - i, seconds=s, tokens=tokens)
        h.record(i, stats, lr=1e-3 * i, data_s=0.01, iteration_s=s + 0.01)
    return h


def test_override_keeps_none_and_brings_min_lr_to_a_tenth():
    cfg = config.override(config.preset("smoke"), steps=7, lr=2e-3, warmup_steps=None)
    assert (cfg.train.steps, cfg.train.lr, cfg.train.min_lr) == (7, 2e-3, 2e-3 / 10)
    assert cfg.train.warmup_steps == config.preset("smoke").train.warmup_steps


def _comparison(outcome, fast_name="no sync", fast=1e-6, slow=1e-3):
    f, s = SimpleNamespace(name=fast_name, median=fast), SimpleNamespace(name="x", median=slow)
    return SimpleNamespace(outcome=outcome, faster=f, slower=s)


def test_explain_sync_chooses_by_outcome_and_device():
    assert timing.explain_sync(_comparison("faster"), "cuda") == (
        "On this GPU the synchronised time is 1000x the unsynchronised one: without a sync you "
        "time the launch, not the work.")
    assert "did not clearly differ" in timing.explain_sync(_comparison("noisy"), "cuda")
    agree = timing.explain_sync(_comparison("agree"), "cpu")
    assert agree.startswith("On a CPU, PyTorch runs each operator to completion")
    assert agree.endswith("while the synchronised one is the matmul itself.")
    other = timing.explain_sync(_comparison("faster"), "cpu")
    assert other.startswith("On a CPU both timers measure the same completed work")


def test_plots_of_a_history_name_their_axes():
    ax = train.plot_history(history(), title="t")
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == (
        "optimizer step", "cross-entropy (nats)", "t")
    assert math.isclose(ax.lines[2].get_ydata()[0], math.log(256))
    ax = train.plot_step_times(history(), skip=1)
    assert (ax.get_ylabel(), ax.get_yscale(), ax.get_title()) == ("ms", "log", "recorded step times")


def test_small_formatters():
    assert throughput.flops_text(2.5e12) == "2.5 TFLOP/s"
    assert throughput.flops_text(3.21e9) == "3.21 GFLOP/s"
    assert (throughput.pct(0.003), throughput.pct(0.5)) == ("0.3%", "50%")
    assert throughput.figures_table([("a", "1", "measured")]) == f"{'a':<38}{'1':>28}   measured"


def _run(peak_name="no such device", device_type="cpu"):
    fpt = {"full": 1e6, "causal": 0.9e6}
    peak = hardware.peak_flops(peak_name, torch.float32)
    return throughput.Throughput(history=history(), n_flop=1000, flops_per_token_by=fpt, skip=1,
                                 tokens_per_step=100, device_type=device_type, peak=peak)


def test_throughput_describe_without_a_peak():
    run = _run()
    text = run.describe().splitlines()
    assert text[0] == ("predicted: 1.000 MFLOP per token (6N + 12·L·h·s, all s×s scores), 0.900 "
                       "(6N + 6·L·h·s, the causal half); N = 1,000 (position table excluded)")
    assert text[1] == "measured:  1,000 tokens/s over the timed steps -> 1.00 GFLOP/s of model work, over"
    assert text[3].startswith("measured:  909 tokens/s over whole iterations (the batches drawn, "
                              "then the step); waiting for the batches took 9.1%")
    assert text[-1] == ("MFU: not computed, because no published peak is known for this device "
                        "(see above).")
    assert run.mfu_text() == "N/A (no published peak)"
    assert math.isclose(run.mean_step_s, 0.1)


def test_throughput_describe_with_a_peak_gives_mfu_by_convention():
    run = _run("NVIDIA H100 80GB HBM3", device_type="cuda")
    text = run.describe()
    assert "pinned one step ahead" in text and "MFU by convention:" in text
    assert "1.111x apart" in text


def test_describe_warmup_and_ceiling():
    lines = _run().describe_warmup().splitlines()
    assert lines[0] == ("measured step times: steps 1-5: 200.0, 100.0, 100.0, 100.0, 100.0 ms; "
                        "steady median (steps 2-5): 100.0 ms")
    assert lines[1].startswith("step 1 took 2.0x the steady median")
    assert lines[2].startswith("The first step's one-off costs stand out here")
    ceiling = Ceiling(2e9, FLOPS, "float32", "cpu", "measured", "m", device="cpu", when="now")
    text = _run().describe_ceiling(ceiling).splitlines()
    assert text[1].endswith("training's model FLOP/s is 50% of the measured matmul ceiling "
                            "(1.00 GFLOP/s of 2.00 GFLOP/s)")
    assert text[2] == "(measured / measured: not MFU)"


def test_step_roof_measures_and_describes_a_real_step():
    torch.manual_seed(0)
    model = GPT(TINY)
    batch = (torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long))
    ceiling = Ceiling(1e9, FLOPS, "float32", "cpu", "measured", "m", device="cpu", when="now")
    roof = throughput.step_roof(model, train.make_optimizer(model, TrainConfig()), batch,
                                run=_run(), ceiling=ceiling, device=CPU, dtype="float32",
                                rounds=2, profiled_steps=1)
    assert math.isclose(roof.roof_s["forward"], 100e6 / 3 / 1e9)
    text = roof.describe()
    assert text.startswith(f"{'phase':<11}{'predicted (roof)':>17}")
    assert "optimizer   " in text and "not modelled" in text and "Furthest from its roof" in text


def test_memory_anatomy_closes_on_a_tiny_gpt():
    torch.manual_seed(0)
    model = GPT(TINY)
    batch = (torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long))
    result = memory.anatomy(model, train.make_optimizer(model, TrainConfig()), batch, device=CPU)
    assert result.model_states_match
    lines = result.describe().splitlines()
    assert lines[0].startswith("measured: SDPA runs its ")
    assert lines[-5].split()[:2] == ["part", "predicted"]
    assert lines[-4].split()[0] == "parameters" and lines[-4].endswith("+0")
    assert result.describe_activations().startswith(
        "optimizer state before the first step(): 0 bytes (AdamW creates its moments lazily)")
    rec = result.describe_reconciliation().splitlines()
    assert rec[-1].startswith("Closed to the byte") == (result.activation_gap == 0)
    ax = memory.plot_anatomy(result)
    assert ax.get_xlabel() == "MiB" and len(ax.patches) == 8


def test_describe_live_bytes_table_and_growth():
    rows = [memory.PhaseBytes(1, "forward", 2**20, 0, 0, 2**20),
            memory.PhaseBytes(2, "forward", 2**20, 0, 8, 2**20)]
    lines = memory.describe_live_bytes(rows, optimizer_state=8, n_params=1).splitlines()
    assert lines[1] == f"{1:<5}{'forward':<16}{1:>10.3f}{0:>10.3f}{0:>11.3f}{1:>13.3f}{2:>11.3f}"
    assert lines[-1] == ("after the forward: step 2 holds 8 B more than step 1; the AdamW moments "
                         "are 8 B (8 B × 1 parameters)")


def test_peak_check_sentences():
    peak = memory.StepPeak(tensors={"a": (1000,), "b": (24,)}, moment="the end")
    closed = memory.PeakCheck(peak, 1024, cuda=False, sdpa_backend="math").describe().splitlines()
    assert closed[0] == "predicted: the peak of one training step is at the end"
    assert "difference: +0 B (+0.00%)" in closed
    assert closed[-3].startswith("Closed to the byte") and closed[-2] == ""
    assert closed[-1] == ("On a GPU the allocator would count 1,536 B (predicted: each tensor "
                          "rounded up to a 512-byte block, +512 B), and reserve more: it takes "
                          "memory from the driver in 2 MiB and 20 MiB segments and keeps freed "
                          "blocks cached.")
    gpu = memory.PeakCheck(peak, 1546, cuda=True, sdpa_backend="flash", reserved=2**21)
    assert gpu.gap == 10 and "Within 0.7%, above the prediction" in gpu.describe()
    assert "reserved (measured, whole process): 2.00 MiB" in gpu.describe()
    low = memory.PeakCheck(peak, 1000, cuda=False, sdpa_backend="math").describe()
    assert "Not closed: fewer bytes were alive than predicted" in low


def test_activation_sweep_is_linear_in_batch():
    torch.manual_seed(0)
    s = TINY.seq_len
    sweep = memory.activation_sweep(GPT(TINY), [(1, s), (2, s), (4, s), (2, s // 4), (2, s // 2)],
                                    device=CPU)
    text = sweep.describe()
    assert "the second is 2.000x the first" in text
    assert text.endswith("Every point closed to the byte." if sweep.closed else "differences).")


def test_training_trace_text_with_and_without_a_recording():
    none = replay.TrainingTrace("cpu", ())
    text = none.describe()
    assert text.startswith("What to look for in an NVML trace of a training run on a GPU "
                           "(expected on a GPU, not measured here):\n* gpu_util_pct")
    assert "No NVML trace of this training run ships" in text
    none.replay(title="t")  # nothing to replay: nothing happens
    gpu = replay.TrainingTrace("cuda", ("x.jsonl",)).describe()
    assert gpu.splitlines()[0] == ("What to look for in section 2's monitor, which read this GPU "
                                   "through NVML, and in the recording replayed below:")
    assert replay.training_trace("cpu").device_type == "cpu"


def test_busy_vs_useful_on_the_cpu():
    name, (call, flops) = busy.idle_workload(CPU)
    assert (name, flops) == ("tiny element-wise ops", 8)
    samples = [SimpleNamespace(source="rank0", time_s=t, values={"cpu_pct": v})
               for t, v in ((1.0, 50.0), (1.5, 100.0))]
    fake = SimpleNamespace(samples=samples, part=lambda name: None)
    result = busy.busy_vs_useful(fake, {name: (call, flops), "big": (lambda: None, 100)},
                                 device=CPU, phase_s=0.01)
    assert result.n_sm is None and set(result.phases) == {name, "big"}
    fixed = busy.BusyVsUseful(phases={"idle": (1.0, 2.0, 0.0), "big": (5.0, 6.0, 1e9)},
                              monitor=fake, device_type="cpu")
    lines = fixed.describe().splitlines()
    assert lines[1].startswith(f"{'idle':<24}{0:>18,.0f}   75%")
    assert lines[2].startswith(f"{'big':<24}{1e9:>18,.0f}   N/A")
    assert lines[3] == ("measured: the idle did no floating-point work at all; the big "
                        "1,000,000,000 FLOP/s")


def test_measured_step_peak_on_a_cpu_is_the_live_tensor_peak():
    model = GPT(TINY)
    got = trials.measured_step_peak(model, 2, device="cpu", seq_len=16)
    assert got == trials.measure_step_peak(model, 2, seq_len=16)


@pytest.mark.parametrize("fn", [throughput.of_run])
def test_of_run_looks_up_the_peak(fn):
    run = fn(history(), TINY, n_flop=1000, skip=1, tokens_per_step=100, device=CPU,
             dtype="float32")
    assert run.flops_per_token == run.flops_per_token_by["full"] > run.flops_per_token_by["causal"]
    assert run.device_type == "cpu" and run.tokens_per_step == 100
