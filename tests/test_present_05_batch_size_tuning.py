"""Notebook 05's presentation, moved into labkit.batching: what each describe() prints for given
measurements, and that each figure draws what it names."""

from types import SimpleNamespace

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from labkit import batching, config
from labkit.batching import (
    accumulation,
    finder,
    lab,
    lamb,
    noise,
    ranks,
    recomputation,
    sweep,
    sweep_report,
)
from labkit.batching.trials import Trial

CFG = config.preset("smoke").model  # vocabulary 256, s 64, 2 layers, d 64
MiB = 2**20


def row(b, seconds, peak, k=1):
    return sweep.SweepRow(micro_batch=b, grad_accum=k, tokens=b * k * 64, seconds=tuple(seconds),
                          peak_bytes=peak, predicted_peak_bytes=peak * 0.8, flops=1e6 * b * k * 64)


def fake_sweep(rows):
    peak = SimpleNamespace(known=False, reason="no published peak for CPUs", flops_per_s=None)
    return sweep.Sweep(rows=tuple(rows), device="cpu", device_name="Test CPU", dtype="float32",
                       seq_len=64, flops_per_token=1e6, peak=peak, rounds=5, method="test")


SWEEP = fake_sweep([row(1, [2e-3, 2.1e-3, 2.2e-3, 2.0e-3, 2.1e-3], 2 * MiB),
                    row(2, [3e-3, 3.1e-3, 3.2e-3, 3.0e-3, 3.1e-3], 3 * MiB),
                    row(4, [5e-3, 5.1e-3, 5.2e-3, 5.0e-3, 5.1e-3], 5 * MiB)])


def memory_model():
    return finder.predict_max_batch(CFG, 2**62, dtype="float32", seq_len=64, dropout_mask_bytes=4)


def history(loss):
    return SimpleNamespace(loss=list(loss), tokens=[256] * len(loss), steps=list(range(1, len(loss) + 1)))


def test_the_package_names_its_submodules_lazily():
    assert batching.sweep is sweep and batching.ranks is ranks
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        batching.nope  # noqa: B018


def test_lab_describes_the_fallback_the_tier_and_the_threads():
    got = lab.Lab(size="lab", asked="gpu", device=torch.device("cpu"), tier="Tier: cpu",
                  threads="PyTorch CPU threads: 1")
    assert got.describe() == (
        "size='gpu' needs a CUDA GPU (none found): running the 'lab' sizes instead\n\nTier: cpu\n\n"
        + lab.CPU_SHOWS + "\nPyTorch CPU threads: 1")
    assert got.dtype_for(config.preset("smoke")) == "float32"
    with pytest.raises(ValueError):
        lab.open_lab("huge")


def test_step_prediction_prints_flops_and_the_memory_model():
    pred = sweep_report.step_prediction(CFG, 116480, [1, 2], dtype="float32", seq_len=64)
    assert pred.describe() == (
        "predicted: 0.80 MFLOP per token (6N + 12·L·h·s, N = 116,480)\n"
        "predicted: model states 1.84 MiB at any batch, + 0.563 MiB per sequence (activations "
        "0.501, logits' log-softmax 0.062)\n"
        "  micro-batch    1: predicted peak     2.40 MiB\n"
        "  micro-batch    2: predicted peak     2.97 MiB")


def test_the_sweep_read_against_its_prediction():
    pred = sweep_report.step_prediction(CFG, 116480, [1, 2, 4], dtype="float32", seq_len=64)
    reading = sweep_report.read_sweep(SWEEP, pred, CFG)
    assert reading.saturated.micro_batch == 4 and reading.slope == MiB
    assert reading.describe() == "\n".join([
        "Test CPU (cpu), float32, seq_len 64; tokens/s and peak bytes measured, FLOPs and "
        "'predicted' modelled",
        "micro-batch × accum    tokens/s  median step   GFLOP/s    MFU  peak MiB  predicted",
        "          1       1      30,476     2.100 ms     30.48    n/a      2.00       1.60",
        "          2       1      41,290     3.100 ms     41.29    n/a      3.00       2.40",
        "          4       1      50,196     5.100 ms     50.20    n/a      5.00       4.00",
        "MFU n/a: no published peak for CPUs", "",
        "modelled (fitted to the medians): t(b) = 1.10 ms + b × 1.000 ms; half of the ceiling "
        "(64,000 tokens/s) at b = 1.1",
        "measured: throughput saturates at micro-batch 4 (the smallest within 90% of the best, "
        "50,196 tokens/s at 4)",
        "seconds per token, the smallest batch against the saturation batch (measured):",
        "b=1  median 32.8 µs, middle half 31.2 µs to 32.8 µs, 5 runs",
        "b=4  median 19.9 µs, middle half 19.5 µs to 19.9 µs, 5 runs",
        "verdict: b=4 is faster than b=1 by 12.9 µs (39.3%)", "",
        "per sequence: measured 1.000 MiB; predicted 0.563 MiB, + the omissions below = 0.785 MiB",
        "  0.188 MiB  3 more s×V float32 tensors at the head (logits, their gradient, the loss's)",
        "  0.031 MiB  inputs of the final LayerNorm and of the output head",
        "  0.002 MiB  LayerNorm means and rstds (2L + 1 LayerNorms)"])
    axes = sweep_report.plot_sweep(reading)
    assert axes[0].get_xlabel() == "micro-batch (sequences)" and axes[1].get_ylabel() == "MiB"
    assert len(axes[1].get_lines()) == 3  # measured, predicted, model states


def test_the_alignment_study_and_the_shape_trade_print_their_tables():
    batches = tuple(sweep.alignment_batches([8]))
    timed = sweep.AlignmentSweep(seconds={b: (b * 1e-5,) * 3 for b in batches}, seq_len=63, k=64,
                                 n=256, dtype="float32", device="cpu", inner={})
    study = sweep.AlignmentStudy(gemm=("output head", 64, 256), centers=(8,), batches=batches,
                                 results={63: timed}, dtype="float32", device_name="Test CPU",
                                 on_gpu=False)
    assert study.describe().split("\n")[:4] == [
        "the output head: (b·s × 64) @ (64 × 256) in float32 on Test CPU, b = 8k-2 … 8k+2 around [8]",
        "",
        "s = 63: M = b·63 is a multiple of 8 for b a multiple of 8, and no other; µs per sequence, "
        "median of 3 rounds (measured):",
        "  b=6: 10.00   b=7: 10.00   b=8: 10.00   b=9: 10.00   b=10: 10.00"]
    assert study.describe().endswith("and any saw-tooth comes from tile and wave counts (§3.1-3.2)")
    assert len(sweep_report.plot_alignment(study).get_lines()) == 3  # the points, the group, the ring
    trade = sweep.ShapeTrade(
        shapes=((64, 8), (16, 32)), flops_per_token={(64, 8): 0.797e6, (16, 32): 0.723e6},
        predicted_peak={(64, 8): 7.67 * MiB, (16, 32): 7.67 * MiB},
        times={"s=64, b=8": [8e-3] * 6, "s=16, b=32": [10e-3] * 6},
        peak={(64, 8): 7.67 * MiB, (16, 32): 7.67 * MiB})
    assert trade.describe() == "\n".join([
        "s =   64, b =   8: predicted 0.797 MFLOP per token, peak 7.67 MiB",
        "s =   16, b =  32: predicted 0.723 MFLOP per token, peak 7.67 MiB",
        "s =   64, b =   8: measured    64,000 tokens/s, peak 7.67 MiB",
        "s =   16, b =  32: measured    51,200 tokens/s, peak 7.67 MiB",
        "s=16, b=32  median 10.000 ms, middle half 10.000 ms to 10.000 ms, 6 runs",
        "s=64, b=8   median 8.000 ms, middle half 8.000 ms to 8.000 ms, 6 runs",
        "verdict: s=64, b=8 is faster than s=16, b=32 by 2.000 ms (20.0%)"])


def test_the_limit_the_found_batch_and_two_searches():
    assert finder.agreement(25, 18) == "+7 (+39%): too high: the step holds memory this count leaves out"
    assert finder.agreement(18, 18) == "+0 (+0%): agrees within ±1"
    assert finder.agreement(10, 18, step="the checkpointed step") == (
        "-8 (-44%): too low: this count holds memory the step has already freed at its peak")
    limit = finder.limit_prediction(CFG, device="cpu", slope=0.786 * MiB, cpu_budget_mib=16)
    assert limit.describe() == "\n".join([
        "limit: a budget of 16 MiB of live tensor bytes (chosen, not a device limit)",
        "predicted (the memory model, where the finder starts): 25 (model states 1.84 MiB + "
        "0.563 MiB per sequence)",
        "predicted (every tensor alive at the step's peak, the omissions included: "
        "memory.predicted_step_peak): 18",
        "calibrated with section 1's measured 0.786 MiB per sequence: 18 (not a test here: the "
        "slope was counted by the same live-tensor counter that enforces the budget)"])
    found = finder.MaxBatchResult(
        predicted=25, found=18, budget_bytes=16 * MiB, kind="CPU budget", limit="a budget",
        method="m", device="cpu", dtype="float32", seq_len=64, max_batch=4096, capped=False,
        trials=(Trial(25, False, 17 * MiB, 0.1, "start"), Trial(12, True, 11 * MiB, 0.1, "halve"),
                Trial(18, True, 16 * MiB - 1, 0.1, "bisect")))
    assert finder.describe_found(found, limit) == "\n".join([
        "largest micro-batch: predicted 25, found 18, seq_len 64, float32; 3 trials, 1 recovered "
        "from; limit: a budget",
        "predicted 25 by the memory model, found 18: +7 (+39%): too high: the step holds memory "
        "this count leaves out",
        "predicted 18 by every tensor at the peak, found 18: +0 (+0%): agrees within ±1",
        "calibrated 18: +0"])
    assert len(finder.plot_trials(found, limit).get_lines()) == 9  # 3 trials, 2 keys, 2 lines, 2 rules
    assert finder.describe_two_searches(18, found, whose="your answer") == (
        "the search in largest_batch (your answer) found 18; the finder found 18")
    assert finder.describe_two_searches(17, found, whose="your answer").split("\n")[1].startswith(
        "they differ by 1 (5.6%): near the limit a real allocator's edge is not sharp")


def test_accumulation_cost_prints_its_table_checks_and_verdict():
    steps = fake_sweep([row(32, [33e-3] * 5, 26 * MiB), row(8, [9e-3] * 5, 8 * MiB),
                        row(2, [3e-3] * 5, 3 * MiB),
                        row(8, [34e-3, 33e-3, 35e-3, 34e-3, 34e-3], 8 * MiB + 1, k=4),
                        row(2, [58e-3, 57e-3, 59e-3, 58e-3, 58e-3], 3 * MiB + 1, k=16)])
    cost = accumulation.AccumulationCost(global_batch=32, micro_sizes=(8, 2), steps=steps,
                                         update_s=(1e-3,) * 11, memory_model=memory_model(),
                                         omitted_per_sequence=231936, gradient_bytes=4 * 120576)
    assert cost.describe() == "\n".join([
        "measured: the update (clip + AdamW step + zero_grad) takes 1.00 ms (median of 11)",
        "global batch 32 per optimiser step, split three ways:",
        " micro × k  step (measured)  (predicted)  peak MiB (measured)  (predicted)  (+ omissions)",
        "    32 × 1          33.0 ms                             26.00        19.87          26.95",
        "     8 × 4          34.0 ms      33.0 ms                 8.00         6.81           8.58",
        "    2 × 16          58.0 ms      33.0 ms                 3.00         3.43           3.87",
        "8 × 4: predicted 33.000 ms, measured median 34.000 ms (interval 34.000 ms to 34.000 ms, "
        "5 runs), +3%: agrees within ±20%",
        "2 × 16: predicted 33.000 ms, measured median 58.000 ms (interval 58.000 ms to 58.000 ms, "
        "5 runs), +76%: slower than predicted, beyond ±20%: it pays a cost the model leaves out",
        "measured: 2 of 3 peaks between the memory model and the model + omissions",
        "2 × 16  median 58.000 ms, middle half 58.000 ms to 58.000 ms, 5 runs",
        "32 × 1  median 33.000 ms, middle half 33.000 ms to 33.000 ms, 5 runs",
        "verdict: 32 × 1 is faster than 2 × 16 by 25.000 ms (43.1%)",
        "measured: 2 × 16 holds 12% of the one-pass peak",
        "implied by 8 × 4: 0.67 ms paid once per step, not per micro-batch (the update alone: "
        "1.00 ms, measured)",
        "implied by 2 × 16: -0.67 ms paid once per step, not per micro-batch (the update alone: "
        "1.00 ms, measured)"])


def test_checkpointing_memory_time_batch_and_levers():
    plan = {n: recomputation.predict_checkpointing(CFG, 8, e, dtype="float32", dropout_mask_bytes=4)
            for n, e in (("none", None), ("every block", 1))}
    memory = recomputation.CheckpointingMemory(
        micro_batch=8, dtype="float32", saved={"none": 4 * MiB, "every block": MiB},
        step_peak={"none": 8 * MiB, "every block": 5 * MiB}, plan=plan)
    assert memory.describe() == "\n".join([
        "micro-batch 8, float32: bytes saved for the backward pass",
        "checkpointing       blocks  kept less than none: predicted  measured   step peak (measured)",
        "none                     0                        0.00 MiB  0.00 MiB               8.00 MiB",
        "every block              2                        3.76 MiB  3.00 MiB               5.00 MiB"])
    time = recomputation.CheckpointingTime(times={"none": [10e-3] * 6, "every block": [13e-3] * 6},
                                           factor={"none": 1.0, "every block": 1.29})
    assert time.describe() == "\n".join([
        "none                step    10.0 ms: 1.00 × none (measured), 1.00 × (predicted from FLOPs)",
        "every block         step    13.0 ms: 1.30 × none (measured), 1.29 × (predicted from FLOPs)",
        "every block  median 13.000 ms, middle half 13.000 ms to 13.000 ms, 6 runs",
        "none         median 10.000 ms, middle half 10.000 ms to 10.000 ms, 6 runs",
        "verdict: none is faster than every block by 3.000 ms (23.1%)"])
    assert recomputation.describe_checkpointed_peak(CFG, 35, 18, dtype="float32", seq_len=64) == "\n".join([
        "predicted (every tensor at the checkpointed step's peak): 35 sequences instead of 18 "
        "without checkpointing (1.94 ×); at that batch the step peaks in block 1's GELU backward, "
        "the block rebuilt, the largest terms:",
        "      2.19 MiB  logits (kept by train_step's forward result)",
        "      2.19 MiB  rebuilt: GELU input (fc output)",
        "      2.19 MiB  MLP backward: gradient of the GELU output",
        "      2.19 MiB  MLP backward: GELU's input gradient"])
    assert recomputation.describe_checkpointed_found(
        SimpleNamespace(found=18), SimpleNamespace(found=35, trials=(1,) * 7, failures=1), 35) == (
        "measured: the largest micro-batch 18 without checkpointing, 35 with every block "
        "checkpointed (1.94 ×; 7 trials, 1 recovered from)\n"
        "predicted 35, found 35: +0 (+0%): agrees within ±1")
    assert recomputation.describe_memory_levers(CFG, 120576, 8) == "\n".join([
        "float32 AdamW (this lab)       16 bytes per parameter on the device (modelled)",
        "8-bit AdamW states             10 bytes per parameter on the device (modelled)",
        "states offloaded to the CPU     8 bytes per parameter on the device (modelled)", "",
        "activations of the blocks at micro-batch 8 (modelled; a block keeps 2.00 MiB, its input "
        "0.125 MiB):",
        " layers       none  every block  √n segments",
        "      2    4.0 MiB      2.3 MiB      4.1 MiB  (1 segment)",
        "     16   32.1 MiB      4.0 MiB      8.5 MiB  (4 segments)",
        "     64  128.2 MiB     10.0 MiB     17.0 MiB  (8 segments)",
        "    256  513.0 MiB     34.0 MiB     34.1 MiB  (16 segments)",
        "   1024 2052.0 MiB    130.0 MiB     68.1 MiB  (32 segments)"])


RUNS = {"B, η₀": (4, 20, "none"), "4B, η₀": (16, 5, "none"), "4B, 4η₀ (linear)": (16, 5, "linear"),
        "4B, 2η₀ (sqrt)": (16, 5, "sqrt")}
LR = {"B, η₀": 1e-3, "4B, η₀": 1e-3, "4B, 4η₀ (linear)": 4e-3, "4B, 2η₀ (sqrt)": 2e-3}
HIST = {"B, η₀": [5.0 - 0.1 * i for i in range(20)], "4B, η₀": [5, 4.9, 4.8, 4.7, 4.6],
        "4B, 4η₀ (linear)": [5, 4, 5, 4, 3], "4B, 2η₀ (sqrt)": [5, 4.5, 4.2, 4.0, 3.9]}
FINAL = {"B, η₀": 3.0, "4B, η₀": 3.6, "4B, 4η₀ (linear)": 3.3, "4B, 2η₀ (sqrt)": 3.2}


def lr_runs(seeds):
    return noise.LrRuns(runs=RUNS, lr=LR, seeds=seeds, val_batches=[], trained=None,
                        histories={(k, s): history(v) for k, v in HIST.items() for s in seeds},
                        final_val={(k, s): v + 0.05 * s for k, v in FINAL.items() for s in seeds})


def test_learning_rate_runs_their_spikes_and_lamb():
    assert noise.smoothed([1, 2, 3, 4], 2) == [1.0, 1.5, 2.5, 3.5]
    assert noise.largest_rise([3, 2, 1, 2, 3, 1, 1, 1, 1, 1]) == 2.0
    one = lr_runs((0,))
    assert one.describe().split("\n")[2] == (
        "4B, 4η₀ (linear)   batch   16 ×    5 steps, lr 4.00e-03: final validation loss 3.3000  "
        "(seed 0; measured)")
    assert one.describe_outcome().split("\n")[2:] == [
        "measured: 4B, 4η₀ (linear)   largest rise of the smoothed loss above its minimum so far: "
        "1.000 nats (spiked: above 0.1 in 1 of 1 runs)",
        "measured: 4B, 2η₀ (sqrt)     largest rise of the smoothed loss above its minimum so far: "
        "0.000 nats",
        "measured: at 4B with the rate unchanged the final loss is +0.6000 against batch B",
        "measured: 4B, 4η₀ (linear): 3.3000, better than the unscaled rate by 0.3000, 50% of the "
        "lag recovered",
        "measured: 4B, 2η₀ (sqrt): 3.2000, better than the unscaled rate by 0.4000, 67% of the lag "
        "recovered",
        "one seed per setting: how far a rerun would move each loss is not measured at this size, "
        "so small differences between settings are not resolved (the lab size runs two seeds)"]
    assert lr_runs((0, 1)).describe_outcome().split("\n")[-1] == (
        "seed-to-seed spread of one setting: up to 0.0500; differences between settings smaller "
        "than that are not resolved by 2 seeds (6 of 6 differences are larger)")
    assert len(noise.plot_lr_runs(one).get_lines()) == 8  # a curve and a dot per run
    compared = lamb.LambComparison(
        batch=16, lr=4e-3, seeds=(0,), ratio={0: 0.0625}, finals={"AdamW": [3.3], "LAMB": [5.0]},
        histories={"AdamW": {0: history([5, 4, 5, 4, 3])}, "LAMB": {0: history([5, 4.9, 4.8, 4.7, 4.6])}})
    assert compared.spikes == {"AdamW": 1, "LAMB": 0}
    assert compared.describe().split("\n")[1:] == [
        "measured: AdamW final validation loss 3.300; largest rise 1.000 nats; spiked (> 0.1) in 1 of 1 runs",
        "measured: LAMB  final validation loss 5.000; largest rise 0.000 nats; spiked (> 0.1) in 0 of 1 runs",
        "stability: as predicted. AdamW spiked in 1 run(s), LAMB in 0",
        "final loss: LAMB +1.700 against AdamW, one seed: how far a rerun would move it is not "
        "measured at this size (the lab size runs two)",
        "measured: LAMB's median trust ratio at the last step 0.062: each matrix moved η·‖w‖ a "
        "step, 16× less than a step of η·u without the ratio would have moved it"]
    assert len(lamb.plot_lamb(compared).get_lines()) == 2


def test_noise_scale_study_time_to_loss_and_weak_scaling():
    small, mid, big = [10.0, 12.0, 11.0, 9.0], [6.0, 6.5, 5.5, 6.2], [2.0, 2.5, 2.2, 1.9]
    est = noise.estimate_noise_scale(small, big, 2, 16)
    norms = {2: small, 4: mid, 16: big}
    study = noise.NoiseScaleStudy(batches=(2, 4, 16), repeats=4, seq_len=64,
                                  norms={"early": norms, "late": norms},
                                  scales={"early": est, "late": est},
                                  yours={"early": 1.5, "late": 1.5}, whose="your answer")
    assert study.describe().split("\n")[:2] == [
        "early: B_simple = 19.94 sequences (1,276 tokens), 90% bootstrap interval 18.86 to 21.33 "
        "(measured, 4 pairs of batches 2 and 16); your answer function: 1.50",
        "    eq. A.1 at B = 4: predicted E|G_B|² 5.729 (90% interval 5.186 to 6.271), measured "
        "6.05 ± 0.21 (standard error): consistent"]
    assert study.describe().endswith(
        "\n\nmeasured: the estimate did not rise (19.94 → 19.94); with 4 pairs the intervals above "
        "say how much that means")
    axes = noise.plot_noise_scale(study)
    assert [ax.get_title() for ax in axes] == ["early", "late"]
    assert noise.describe_time_to_loss(SWEEP, 2.0, base_batch=1).split("\n")[1:4] == [
        "     1           3.00            1.50               30,476           1.02×",
        "     2           2.00            2.00               41,290           1.00×",
        "     4           1.50            3.00               50,196           1.23×"]
    assert noise.describe_time_to_loss(SWEEP, -1.0, base_batch=1).startswith(
        "the noise scale after training is not resolved (-1.0)")
    assert noise.describe_weak_scaling(8, 7.79).split("\n")[-1] == (
        "   512 ranks: global batch   4096, steps  1.00 × least, tokens  526.80 × least")
    assert noise.describe_weak_scaling(8, float("nan")).startswith(
        "no weak-scaling table: the noise scale after training is not resolved (nan)")


def test_a_ddp_job_planned_and_read():
    results = {r: {"world_size": 2, "backend": "gloo", "config": {}, "runs": {"ddp": {
        "sequences_per_rank_step": [8, 8, 8, 8], "sequences_per_step": [16, 16, 16, 16],
        "step_s": [0.5, 0.02, 0.022, 0.024], "loss": [5.0, 4.9, 4.8, 4.7],
        "bytes": {"last_step": {"all_reduce": {"calls": 1}}, "sent_per_rank_last_step": 0.46 * MiB},
        "bytes_predicted_sent_per_rank": 0.46 * MiB}}} for r in range(2)}
    job = SimpleNamespace(rank=lambda r: results[r])
    plan = ranks.DdpPlan(nproc=2, device="cpu", micro_batch=4, grad_accum=2, model=CFG,
                         config={"global_batch": 16})
    assert plan.describe() == ("predicted: global batch = 4 × 2 × 2 ranks = 16 sequences per step; "
                               "1 all-reduce of every gradient per step")
    lines = ranks.read_ddp_job(job, plan, reference_loss=[5.0, 4.9, 4.8, 4.7000005]).describe().split("\n")
    assert lines == [
        "measured: 2 ranks (gloo) consumed rank 0 8, rank 1 8 sequences per step, 16 to 16 "
        "together: the predicted global batch in all 4 steps",
        "measured: 46,545 tokens/s over the job, 23,273 per rank",
        "DDP steps  median 22.000 ms, middle half 21.000 ms to 23.000 ms, 3 runs",
        "measured: 1 collective call(s) in the last step, 0.460 MiB sent per rank (predicted "
        "0.460 MiB: one ring all-reduce)",
        "measured: losses of 2 ranks vs one process on the whole global batch differ by at most "
        "5.0e-07 over 4 steps"]
    assert ranks.read_ddp_job(job, plan).describe().endswith(
        "(the single-process reference would train the GPU-sized model on this CPU: skipped "
        "here; notebook 02 checks DDP's parity with it)")
    cpu = ranks.ddp_plan(2, config.preset("smoke"), model_preset="smoke", steps=4)
    if cpu.device == "cpu":
        assert (cpu.micro_batch, cpu.global_batch, cpu.config["train"]["dtype"]) == (4, 16, "float32")


def test_lr_runs_reports_each_run_as_it_ends():
    """Minutes of training at lab size: each run's line is printed when its seeds are done (a
    silent cell looks hung), and the lines are the ones describe() gives afterwards."""
    cfg = config.preset("smoke")
    tokens = torch.randint(0, cfg.model.vocab_size, (4096,))
    said = []
    result = noise.lr_runs(cfg, {"B, η₀": (2, 2, "none"), "4B, η₀": (8, 1, "none")}, base_lr=1e-3,
                           base_batch=2, seeds=(0,), train_data=tokens, val_data=tokens,
                           progress=said.append)  # fmt: skip
    assert said == result.describe().split("\n") and len(said) == 2
    assert said[0].startswith("B, η₀") and "final validation loss" in said[0]


def test_every_batching_module_loads_lazily_by_name():
    from pathlib import Path

    folder = Path(batching.__file__).parent
    assert set(batching.SUBMODULES) == {p.stem for p in folder.glob("*.py")} - {"__init__"}
    assert batching.sweep_report.read_sweep is sweep_report.read_sweep


def test_sweep_measures_and_its_report_only_reads():
    # One way: sweep_report imports sweep; importing sweep loads no report module, and the
    # report module has no clock of its own (the alignment study and the shape trade, which
    # measure, live in sweep).
    import subprocess
    import sys

    code = ("import sys, labkit.batching.sweep; "
            "print('labkit.batching.sweep_report' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    for name in ("alignment_study", "shape_trade", "AlignmentStudy", "ShapeTrade"):
        assert getattr(sweep, name).__module__ == "labkit.batching.sweep", name
    assert not {"timing", "train", "trials"} & set(vars(sweep_report))  # nothing that measures
    # a reading has one home: sweep does not answer for its report's names
    assert not hasattr(sweep, "read_sweep") and not hasattr(sweep, "step_prediction")
    assert sweep.SATURATION == 0.9


def test_the_alignment_sentence_follows_the_sequence_length():
    """M = b·s is a multiple of 8 when b is a multiple of 8 / gcd(s, 8): every b at s = 64,
    even b at s = 100 (the old sentence said 'a multiple of 8, and no other' for any s)."""
    batches = tuple(sweep.alignment_batches([8]))
    results = {s: sweep.AlignmentSweep(seconds={b: (b * 1e-5,) * 3 for b in batches}, seq_len=s,
                                       k=64, n=256, dtype="float32", device="cpu", inner={})
               for s in (64, 100, 63)}  # fmt: skip
    study = sweep.AlignmentStudy(gemm=("output head", 64, 256), centers=(8,), batches=batches,
                                 results=results, dtype="float32", device_name="Test CPU",
                                 on_gpu=False)  # fmt: skip
    text = study.describe()
    assert "M = b·64 is a multiple of 8 for every b;" in text
    assert "M = b·100 is a multiple of 8 for b a multiple of 2, and no other;" in text
    assert "M = b·63 is a multiple of 8 for b a multiple of 8, and no other;" in text
