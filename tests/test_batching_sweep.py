"""labkit.batching.sweep: throughput and memory against micro-batch size."""

import dataclasses

import pytest
import torch

from labkit import config, formulas, hardware
from labkit.batching import finder, sweep, sweep_report, trials
from labkit.model import GPT

SMOKE = config.preset("smoke")


def smoke_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(SMOKE.model)


def test_sweep_measures_every_size_beside_the_prediction():
    model = smoke_gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = sweep.throughput_sweep(model, [4, 1], train_cfg=SMOKE.train, rounds=2)
    assert [r.micro_batch for r in result.rows] == [1, 4]  # sorted
    per_token = formulas.flops_per_token(model.num_params(exclude_position_embedding=True),
                                         2, 64, 64)
    memory = finder.predict_max_batch(SMOKE.model, 2**62, dropout_mask_bytes=4)
    for r in result.rows:
        assert r.grad_accum == 1 and r.tokens == r.micro_batch * 64
        assert len(r.seconds) == 2 and all(s > 0 for s in r.seconds)
        assert r.tokens_per_s == r.tokens / r.median_s
        assert r.flops == per_token * r.tokens
        assert r.predicted_peak_bytes == memory.peak_bytes(r.micro_batch)
        # the same step the finder runs, counted the same way
        assert r.peak_bytes == trials.measure_step_peak(model, r.micro_batch, seq_len=64,
                                                        train_cfg=SMOKE.train)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # untouched
    assert result.row(4) is result.rows[1]
    with pytest.raises(KeyError, match="not measured"):
        result.row(8)


def test_no_mfu_without_a_published_peak():
    result = sweep.throughput_sweep(smoke_gpt(), [2], rounds=1, warmup=0)
    assert result.device == "cpu"
    assert not result.peak.known  # no CPU has a peak in labkit.hardware
    assert result.mfu(result.rows[0]) is None
    assert "MFU n/a" in str(result) and "n/a" in str(result).splitlines()[2]


def test_accumulation_points_count_all_their_tokens():
    model = smoke_gpt()
    result = sweep.measure_steps(model, [(8, 1), (2, 4)], rounds=1, warmup=0)
    big, accumulated = result.row(8), result.row(2, 4)
    assert big.tokens == accumulated.tokens == 8 * 64
    assert accumulated.peak_bytes == trials.measure_step_peak(model, 2, seq_len=64, grad_accum=4)
    assert accumulated.peak_bytes < big.peak_bytes


def _synthetic(times: dict[int, float]) -> sweep.Sweep:
    rows = tuple(
        sweep.SweepRow(micro_batch=b, grad_accum=1, tokens=b * 10, seconds=(t,), peak_bytes=0,
                       predicted_peak_bytes=0.0, flops=1.0)
        for b, t in times.items()
    )
    return sweep.Sweep(rows=rows, device="cpu", device_name="test", dtype="float32", seq_len=10,
                       flops_per_token=1.0, peak=hardware.peak_flops("no such device"), rounds=1,
                       method="synthetic")


def test_saturation_is_the_smallest_batch_within_the_fraction_of_the_best():
    # tokens/s: 10, 40, 72, 76, 80 (best), 70
    s = _synthetic({1: 1.0, 2: 0.5, 4: 40 / 72, 8: 80 / 76, 16: 2.0, 32: 320 / 70})
    assert s.best.micro_batch == 16
    assert s.saturation(0.9).micro_batch == 4  # 72 >= 0.9 * 80
    assert s.saturation(0.95).micro_batch == 8
    assert s.saturation(1.0).micro_batch == 16
    with pytest.raises(ValueError, match="fraction=0 is not allowed"):
        s.saturation(0)


def test_overhead_fit_recovers_an_exact_affine_step_time():
    t0, t1 = 0.004, 0.0005
    s = _synthetic({b: t0 + b * t1 for b in (1, 2, 4, 8, 16)})
    fit = s.overhead_fit()
    assert fit.fixed_s == pytest.approx(t0) and fit.per_sequence_s == pytest.approx(t1)
    assert fit.half_batch == pytest.approx(8.0)
    assert fit.tokens_per_s(8) == pytest.approx(fit.ceiling_tokens_per_s / 2)
    with pytest.raises(ValueError, match="at least two"):
        _synthetic({4: 1.0}).overhead_fit()


@pytest.mark.parametrize("bad", [[], [0], [-1], [2.0], [True], ["4"], [(2, 0)], [(1, 2, 3)],
                                 [4, 4], "1248"])
def test_refuses_bad_points_naming_what_is_allowed(bad):
    with pytest.raises(ValueError, match=r"is not allowed|repeats"):
        sweep.measure_steps(smoke_gpt(), bad)


def test_refuses_a_sequence_beyond_the_context_and_a_model_without_config():
    with pytest.raises(ValueError, match=r"seq_len=65 .*context"):
        sweep.throughput_sweep(smoke_gpt(), [1], seq_len=65)
    with pytest.raises(ValueError, match="give a labkit GPT"):
        sweep.throughput_sweep(torch.nn.Linear(2, 2), [1])
    with pytest.raises(ValueError, match="measure_steps"):
        sweep.throughput_sweep(smoke_gpt(), [(2, 4)])


def test_sweep_keeps_the_models_dtype_choice():
    cfg = dataclasses.replace(SMOKE.train, grad_clip=None)
    result = sweep.throughput_sweep(smoke_gpt(), [1], train_cfg=cfg, rounds=1, warmup=0,
                                    dtype="bfloat16")
    assert result.dtype == "bfloat16" and result.rows[0].peak_bytes > 0


def test_check_prediction_chooses_its_sentence_from_the_numbers():
    tight = [0.100, 0.101, 0.099, 0.100, 0.102, 0.098, 0.100]  # median 0.100, narrow notch
    agree = sweep_report.check_prediction(0.105, tight, name="8 × 4")
    assert agree.outcome == "agree" and "agrees within ±20%" in agree.sentence
    assert agree.off == pytest.approx(0.100 / 0.105 - 1)
    slower = sweep_report.check_prediction(0.070, tight, name="8 × 4")  # measured 43% above
    assert slower.outcome == "above" and "slower than predicted" in slower.sentence
    faster = sweep_report.check_prediction(0.150, tight, name="8 × 4")  # measured 33% below
    assert faster.outcome == "below" and "faster than predicted" in faster.sentence
    wide = [0.05, 0.10, 0.15, 0.08, 0.12, 0.20, 0.06]  # the notch straddles the band's edge
    assert sweep_report.check_prediction(0.1, wide, name="x").outcome == "noisy"
    assert sweep_report.check_prediction(0.1, tight[:3], name="x").outcome == "noisy"  # too few runs
    assert sweep_report.check_prediction(0.09, tight, name="x", tolerance=0.05).outcome == "above"
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="predicted"):
            sweep_report.check_prediction(bad, tight, name="x")
    with pytest.raises(ValueError, match="tolerance"):
        sweep_report.check_prediction(0.1, tight, name="x", tolerance=1.5)


# --- batch sizes around multiples of 8: the sizes, the GEMM timing, the verdict on fixed numbers


def test_alignment_batches_and_their_refusals():
    assert sweep.alignment_batches([8, 16]) == [6, 7, 8, 9, 10, 14, 15, 16, 17, 18]
    assert sweep.alignment_batches([8], spread=1) == [7, 8, 9]
    for bad in ([], [12], [0], [True]):
        with pytest.raises(ValueError, match=r"centers|multiple"):
            sweep.alignment_batches(bad)
    with pytest.raises(ValueError, match="spread"):
        sweep.alignment_batches([8], spread=8)


def test_largest_gemm_is_the_head_or_the_mlp():
    assert sweep.largest_gemm(SMOKE.model) == ("output head", 64, 256)  # 256 = 4 × 64: a tie
    assert sweep.largest_gemm(config.preset("gpu").model) == ("MLP first layer", 512, 2048)


def test_time_gemm_batches_times_every_size():
    r = sweep.time_gemm_batches([3, 8], seq_len=5, k=4, n=6, rounds=3, min_sample_s=1e-4)
    assert sorted(r.seconds) == [3, 8] and all(len(v) == 3 for v in r.seconds.values())
    assert all(s > 0 for v in r.seconds.values() for s in v)
    assert r.per_sample(8) == [s / 8 for s in r.seconds[8]]
    assert r.dtype == "float32" and r.device == "cpu" and min(r.inner.values()) >= 1
    with pytest.raises(ValueError, match="seq_len"):
        sweep.time_gemm_batches([8], seq_len=0, k=4, n=6)


def _samples(median: float, spread: float = 0.01) -> list[float]:
    """Seven per-sample times around ``median``, a middle half ``spread`` (a fraction) wide."""
    return [median * (1 + spread * f) for f in (-1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0)]


def test_alignment_verdict_multiples_faster():
    times = {b: _samples(1.0) for b in (6, 7, 9, 10, 14, 15, 17, 18)}
    times[8], times[16] = _samples(0.8), _samples(0.8)  # 20% faster per sequence
    v = sweep.alignment_verdict(times)
    assert v.per_center == {8: "faster", 16: "faster"} and v.outcome == "faster"
    assert v.sentence.startswith("measured: the multiples of 8 (b = 8, b = 16) run faster")
    assert set(v.comparisons) == {(8, b) for b in (6, 7, 9, 10)} | {(16, b) for b in (14, 15, 17, 18)}


def test_alignment_verdict_flat_is_not_faster():
    times = {b: _samples(1.0 + 0.001 * b) for b in sweep.alignment_batches([8, 16])}
    v = sweep.alignment_verdict(times)
    assert v.outcome == "not faster"
    assert v.sentence == ("measured: no multiple of 8 (b = 8, b = 16) runs faster per sequence "
                          "than its neighbours by more than 10%, beyond the spread")
    # slower than its neighbours is "not faster" too
    times[8] = _samples(1.3)
    assert sweep.alignment_verdict(times).per_center[8] == "not faster"


def test_alignment_verdict_partly_noisy_and_mixed():
    times = {b: _samples(1.0) for b in sweep.alignment_batches([8, 16])}
    times[8] = _samples(0.8)
    times[10] = _samples(0.8)  # ties with the multiple: faster than some neighbours only
    times[16] = _samples(1.0, spread=0.6)  # a middle half 60% wide: no verdict
    v = sweep.alignment_verdict(times)
    assert v.per_center == {8: "partly", 16: "unclear"} and v.outcome == "unclear"
    assert "faster than some neighbours, not all, at b = 8" in v.sentence
    assert "too noisy to tell (rerun, or run it alone) at b = 16" in v.sentence
    times[16] = _samples(0.8)
    times[10] = _samples(1.0)
    times[8] = _samples(1.0)
    v = sweep.alignment_verdict(times)
    assert v.per_center == {8: "not faster", 16: "faster"} and v.outcome == "mixed"
    assert v.sentence == ("measured: faster per sequence than each neighbour, beyond the spread, "
                          "at b = 16; no faster than its neighbours (by more than the tolerance) "
                          "at b = 8")


def test_alignment_verdict_needs_a_multiple_with_neighbours():
    with pytest.raises(ValueError, match="nothing to judge"):
        sweep.alignment_verdict({6: _samples(1.0), 7: _samples(1.0)})
