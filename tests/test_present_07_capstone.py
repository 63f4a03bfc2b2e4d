"""Notebook 07's presentation, moved out of its cells into the capstone's modules: each function
prints what the cell printed before, for a given input (faults.describe_catalogue and
describe_left_out, handout.describe_handout, prediction.Prediction / JobAgainstPrediction /
Reconcile / describe_summary / predict, trials.plot_fixes)."""

from __future__ import annotations

import dataclasses

import matplotlib
import pytest

from labkit.course import capstone
from labkit.course.capstone import faults

matplotlib.use("Agg")

CODE = "cpu-584704297-kjipto6m"


def run(steps_s, tokens_per_s, *, code=CODE, losses=None):
    """A learner's view of a run (no faults, no settings) whose ranks report ``steps_s`` and
    ``tokens_per_s``: all that the presentation reads."""
    ranks = [{"step_s": list(steps_s), "tokens_per_s": tokens_per_s}]
    return capstone.CapstoneRun((), ranks, 1.0, settings=None, tier="cpu", size="smoke", code=code)


PREDICTION = capstone.Prediction(steps_s=(0.016,) * 10, nproc=2, micro_batches=2, micro_batch=8,
                                 seq_len=64, global_batch=32, dtype="float32", device="cpu")  # fmt: skip


def test_the_catalogue_lists_each_suspect_of_the_tier_with_symptom_and_where():
    text = capstone.describe_catalogue("cpu")
    assert text.splitlines()[:4] == [
        "slow_loader  (speed, subtlety 1): data loading on the critical path",
        "    symptom: low device utilisation; every step starts with a wait",
        "    look at: each step's data phase against its compute (notebook 06's phase split), "
        "and what one item of the dataset costs (the loader facts)",
        "tiny_micro_batch  (speed, subtlety 1): a micro-batch far below what fits"]
    assert text.count("    symptom: ") == len(capstone.available("cpu")) == 12
    assert "fp32_on_gpu" not in text and "straggler  (speed" in text
    assert "straggler" not in capstone.describe_catalogue("single-gpu")


def test_the_catalogue_says_where_a_fault_costs_little_here(monkeypatch):
    small = dataclasses.replace(faults.BY_ID["slow_loader"], small_here="the corpus is tiny")
    monkeypatch.setattr(faults, "FAULTS", (small,))
    assert capstone.describe_catalogue("cpu").splitlines()[-1] == "    in this job: the corpus is tiny"


def test_what_a_tier_leaves_out_is_named_with_why():
    lines = capstone.describe_left_out("cpu").splitlines()
    assert lines[0] == "Not planted on the cpu tier (no signature here):"
    assert len(lines) == 1 + 6
    assert lines[-1] == ("  NCCL told not to use peer-to-peer: only ranks on two or more GPUs "
                         "talk over NCCL")  # fmt: skip
    assert capstone.describe_left_out("multi-gpu") == ""


def test_the_handout_names_the_code_the_tier_and_one_gpus_cpu_ranks():
    text = capstone.describe_handout(CODE, nproc=2, device="cpu", tier="cpu", size="smoke", gpus=1)
    blocks = text.split("\n\n")
    assert blocks[0] == (
        f"Your job: {CODE}, 2 ranks on cpu (cpu tier), size 'smoke'.\nKeep the code to run the "
        "same job again. Your instructor holds its answer key; without one, `python -m labkit "
        "capstone reveal --give-up` opens it, and your record says so.")
    assert blocks[1].startswith("Not planted on the cpu tier (no signature here):\n")
    assert blocks[2] == ("One GPU and 2 ranks: the job's ranks run on the CPU over gloo (NCCL "
                         "needs a GPU per rank), so the GPU-only faults are not planted.")  # fmt: skip
    assert len(capstone.describe_handout(CODE, nproc=2, device="cpu", tier="cpu", size="smoke",
                                         gpus=0).split("\n\n")) == 2  # fmt: skip
    gpu = capstone.describe_handout(CODE, nproc=2, device="cuda", tier="multi-gpu", size="lab")
    assert gpu.startswith(f"Your job: {CODE}, 2 ranks on cuda (multi-gpu tier), size 'lab'.")
    assert "\n\n" not in gpu  # the multi-gpu tier leaves nothing out


def test_the_prediction_is_tokens_per_step_over_one_ranks_median_step():
    assert PREDICTION.tokens_per_step == 2048 and PREDICTION.tokens_per_s == pytest.approx(128000)
    assert PREDICTION.describe() == (
        "measured here: one rank's step (2 micro-batches of 8 × 64 tokens, forward, backward, "
        "AdamW, float32 on cpu) takes 16.0 ms (median of 10)\n"
        "predicted: a healthy job on 2 ranks runs about 128,000 tokens/s (2,048 tokens per "
        "step), all-reduce not counted")


def test_the_job_against_the_prediction_says_how_far_and_the_verdict():
    slow = run([0.2] + [0.064 + 0.001 * i for i in range(7)], 32000)
    lines = PREDICTION.against(slow).describe().splitlines()
    assert lines[0] == ("measured: 32,000 tokens/s against 128,000 predicted (median steps; 4.0× "
                        "slower than expected). Spread:")  # fmt: skip
    assert lines[1].startswith("your job's step  median 67.000 ms")
    assert lines[3] == "verdict: predicted step is faster than your job's step by 51.000 ms (76.1%)"
    fast = run([0.2] + [0.008] * 7, 256000)
    assert "(median steps; 2.0× faster than expected)" in PREDICTION.against(fast).describe()


def test_the_reconcile_tells_a_fault_left_and_the_predictions_own_gap():
    fixed = run([0.1] + [0.040 + 0.001 * i for i in range(7)], 50000)
    healthy = run([0.1] + [0.022 + 0.0001 * i for i in range(7)], 90000)
    lines = capstone.Reconcile(fixed, healthy, PREDICTION).describe().splitlines()
    assert lines[0] == ("measured: the fixed job 50,000 tokens/s; the healthy job (the right "
                        "settings, run just now) 90,000; predicted 128,000")  # fmt: skip
    assert lines[3].startswith("verdict: healthy job's step is faster than fixed job's step")
    assert lines[4].startswith("A fault is still there, or a change costs time: ")
    assert lines[7].startswith("verdict: predicted step is faster than healthy job's step")
    assert lines[8].startswith("The healthy job itself is 1.4× slower than predicted: that gap "
                               "is the prediction's, not a fault's.")  # fmt: skip
    same = run([0.1] + [0.016 + 0.0001 * i for i in range(7)], 128000)
    lines = capstone.Reconcile(same, same, PREDICTION).describe().splitlines()
    assert lines[3] == "verdict: fixed job's step and healthy job's step agree within 10%"
    assert lines[4].startswith("No fault is left that speed shows")
    assert lines[8].startswith("The healthy job runs as predicted (within 20%)")
    noisy = run([0.1, 0.01, 0.05, 0.02, 0.09, 0.015, 0.07, 0.03], 60000)
    lines = capstone.Reconcile(noisy, same, PREDICTION).describe().splitlines()
    assert lines[4].startswith("Too noisy to tell the fixed job from the healthy one")


def trials():
    job = run([0.1] + [0.075] * 7, 27000)
    better = run([0.1] + [0.04] * 7, 51000)
    worse = run([0.1] + [0.05] * 7, 41000)
    seq = capstone.FixSequence(job)
    seq.trials += [capstone.Trial("tiny_micro_batch", {"micro_batch": 8}, job, better, True,
                                  "after is faster"),
                   capstone.Trial("slow_loader", {"prepare_data": "once"}, better, worse, False,
                                  "before is faster")]  # fmt: skip
    return seq


def test_the_summary_gives_each_trial_and_the_fixed_job():
    assert capstone.describe_summary(trials(), PREDICTION).splitlines() == [
        f"job {CODE}, cpu tier, size 'smoke', 1 ranks",
        "  predicted healthy job (one rank's step, measured in this kernel): 128,000 tokens/s",
        "  baseline (measured): 27,000 tokens/s",
        "  tiny_micro_batch: 27,000 → 51,000 tokens/s, kept: yes (after is faster)",
        "  slow_loader: 51,000 → 41,000 tokens/s, kept: no (before is faster)",
        "  fixed (measured): 51,000 tokens/s, 1.89× the baseline"]
    waiting = capstone.describe_summary(capstone.FixSequence(trials().job), PREDICTION, solved=False)
    assert waiting.splitlines()[-1] == "  fixed: waits for your diagnose (07.diagnose)"


def test_the_fixes_plot_draws_a_bar_per_run_and_the_prediction():
    import matplotlib.pyplot as plt

    fig = capstone.plot_fixes(trials(), PREDICTION)
    ax = fig.axes[0]
    heights = [round(b.get_height()) for b in ax.patches]
    assert heights == [round(2048 / 0.075), round(2048 / 0.04), round(2048 / 0.05)]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["baseline", "+ tiny_micro_batch",
                                                            "✗ slow_loader"]  # fmt: skip
    assert ax.get_title() == f"job {CODE}: each fix on top of those kept (blue kept, red not)"
    assert ax.get_ylabel() == "tokens/s (measured)"
    assert ax.lines[-1].get_ydata()[0] == pytest.approx(128000)  # the dashed prediction
    plt.close(fig)


def test_predict_times_one_ranks_share_at_the_right_settings():
    p = capstone.predict(2, "cpu", repeats=3, warmup=1)
    assert (p.nproc, p.micro_batches, p.micro_batch, p.seq_len, p.global_batch) == (2, 2, 8, 64, 32)
    assert (p.dtype, p.device, len(p.steps_s)) == ("float32", "cpu", 2)
    assert all(s > 0 for s in p.steps_s)
    with pytest.raises(ValueError, match="warmup=3 is not allowed"):
        capstone.predict(2, "cpu", repeats=3, warmup=3)
