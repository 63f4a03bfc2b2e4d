"""labkit.batching.accumulation: k accumulated micro-batches give the gradient of one batch k
times larger when each loss is divided by k, and k times that gradient when it is not.

The train_step counterpart (same updated weights) is tests/test_train.py::
test_gradient_accumulation_equals_one_large_batch."""

import dataclasses

import pytest
import torch

from labkit import config
from labkit.batching import accumulation
from labkit.model import GPT

B = 8
FP32_REL_TOL = 1e-5  # float32 (eps 1.2e-7) summed in a different order: measured <= 4e-7


@pytest.fixture(scope="module")
def model_and_batch():
    cfg = config.preset("smoke").model
    cfg = dataclasses.replace(cfg, dropout=0.0)
    assert cfg.dropout == 0.0  # deterministic forward: parity is then only rounding
    torch.manual_seed(0)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (B, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (B, cfg.seq_len), generator=g)
    return model, (x, y)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_divided_losses_match_one_big_batch(model_and_batch, k):
    model, batch = model_and_batch
    p = accumulation.gradient_parity(model, batch, k)
    assert p.max_rel < FP32_REL_TOL
    assert p.norm_ratio == pytest.approx(1.0, abs=1e-5)
    assert "parity error" in p.summary()
    # the key biases get no gradient (softmax is shift-invariant): the only tensors left out
    k_biases = tuple(n for n, _ in model.named_parameters() if n.endswith("attn.k.bias"))
    assert k_biases and p.zero_gradient == k_biases


@pytest.mark.parametrize("k", [2, 4, 8])
def test_undivided_losses_are_k_times_too_large(model_and_batch, k):
    model, batch = model_and_batch
    p = accumulation.gradient_parity(model, batch, k, divide=False)
    assert p.norm_ratio == pytest.approx(k, rel=1e-4)
    assert p.max_rel == pytest.approx(k - 1, rel=1e-4)  # g_acc = k g: |k g - g| / |g| = k - 1
    assert "times too large" in p.summary()


def test_k_that_does_not_divide_the_batch_is_refused(model_and_batch):
    model, batch = model_and_batch
    with pytest.raises(ValueError, match=r"k=3 .* use k in \[1, 2, 4, 8\]"):
        accumulation.accumulated_gradients(model, batch, 3)
    with pytest.raises(ValueError, match="positive integer"):
        accumulation.accumulated_gradients(model, batch, 0)


def test_callers_model_is_untouched(model_and_batch):
    model, batch = model_and_batch
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = accumulation.accumulated_gradients(model, batch, 4)
    assert set(grads) == set(before)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert any(g.abs().sum() > 0 for g in grads.values())  # real gradients came back


def test_predict_accumulated_seconds_is_k_single_steps_less_the_skipped_updates():
    from labkit.batching import accumulation

    # by hand: 4 single steps of 10 ms pay 4 updates of 2 ms; accumulated pays 1: 40 - 3·2
    assert accumulation.predict_accumulated_seconds(0.010, 0.002, 4) == pytest.approx(0.034)
    assert accumulation.predict_accumulated_seconds(0.010, 0.002, 1) == pytest.approx(0.010)
    with pytest.raises(ValueError, match="part of the step"):
        accumulation.predict_accumulated_seconds(0.001, 0.002, 4)
    with pytest.raises(ValueError, match="update_s"):
        accumulation.predict_accumulated_seconds(0.010, float("nan"), 4)
    with pytest.raises(ValueError, match="k"):
        accumulation.predict_accumulated_seconds(0.010, 0.002, 0)


def test_measure_update_seconds_times_the_update_and_leaves_the_template_alone():
    from labkit import config
    from labkit.batching import accumulation
    from labkit.model import GPT

    smoke = config.preset("smoke")
    torch.manual_seed(0)
    model = GPT(smoke.model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seconds = accumulation.measure_update_seconds(model, train_cfg=smoke.train, rounds=3)
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
