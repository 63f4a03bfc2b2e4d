import math

import pytest
import torch

from labkit import config, data, train
from labkit.batching import lamb
from labkit.model import GPT


def test_trust_ratio_is_weight_norm_over_update_norm_and_one_where_a_norm_is_zero():
    assert float(lamb.trust_ratio(3.0, 4.0)) == pytest.approx(0.75)
    assert float(lamb.trust_ratio(0.0, 4.0)) == 1.0  # a zero-initialised bias
    assert float(lamb.trust_ratio(3.0, 0.0)) == 1.0  # no update: no division by zero
    # the paper's bounded φ(z) = min(max(z, lo), hi)
    assert float(lamb.trust_ratio(3.0, 4.0, clamp=(0.0, 2.0))) == pytest.approx(0.5)
    assert float(lamb.trust_ratio(0.5, 4.0, clamp=(1.0, 10.0))) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="clamp"):
        lamb.trust_ratio(1.0, 1.0, clamp=(2.0, 1.0))


def _one_step(w, g, **kw):
    p = torch.nn.Parameter(torch.tensor(w))
    opt = lamb.LAMB([p], **kw)
    p.grad = torch.tensor(g)
    opt.step()
    return p.detach(), opt


def test_first_lamb_step_matches_a_hand_computation():
    # Step 1: bias-corrected m̂ = g and v̂ = g², so r = g / (|g| + ε) = sign(g) = (1, -1).
    lr, eps = 0.1, 1e-12
    w, _ = _one_step([[3.0, 4.0]], [[1.0, -2.0]], lr=lr, eps=eps)
    ratio = 5.0 / math.sqrt(2.0)  # ‖w‖ = 5, ‖r‖ = √2
    assert w.flatten().tolist() == pytest.approx([3.0 - lr * ratio, 4.0 + lr * ratio], rel=1e-6)
    # with weight decay λ = 0.5 the update is u = r + λw = (2.5, 1), ‖u‖ = √7.25
    w, opt = _one_step([[3.0, 4.0]], [[1.0, -2.0]], lr=lr, eps=eps, weight_decay=0.5)
    ratio = 5.0 / math.sqrt(7.25)
    assert w.flatten().tolist() == pytest.approx([3.0 - lr * ratio * 2.5, 4.0 - lr * ratio * 1.0],
                                                 rel=1e-6)
    assert lamb.trust_ratios(opt) == pytest.approx([ratio])
    # adapt=False: Adam's plain step, each element moved by lr·sign(g)
    w, opt = _one_step([[3.0, 4.0]], [[1.0, -2.0]], lr=lr, eps=eps, adapt=False)
    assert w.flatten().tolist() == pytest.approx([2.9, 4.1], rel=1e-6)
    assert lamb.trust_ratios(opt) == []


def test_second_lamb_step_matches_a_hand_computation():
    b1, b2, lr, eps = 0.9, 0.99, 0.01, 1e-8
    w0, g1, g2 = [1.0, -2.0, 2.0], [0.5, 0.1, -0.3], [-0.2, 0.4, 0.1]
    p = torch.nn.Parameter(torch.tensor(w0, dtype=torch.float64))
    opt = lamb.LAMB([p], lr=lr, betas=(b1, b2), eps=eps)
    w, m, v = list(w0), [0.0] * 3, [0.0] * 3
    for t, g in enumerate((g1, g2), start=1):
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g, strict=True)]
        v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v, g, strict=True)]
        r = [(mi / (1 - b1**t)) / (math.sqrt(vi / (1 - b2**t)) + eps)
             for mi, vi in zip(m, v, strict=True)]
        ratio = math.sqrt(sum(x * x for x in w)) / math.sqrt(sum(x * x for x in r))
        w = [wi - lr * ratio * ri for wi, ri in zip(w, r, strict=True)]
    assert p.detach().tolist() == pytest.approx(w, rel=1e-12)


def test_an_adapted_tensor_moves_by_lr_times_its_norm_whatever_its_scale():
    """The layer-wise property: with φ the identity and no weight decay, one step moves a
    tensor by exactly η‖w‖, so scaling the weights scales the step (Adam's step would not)."""
    g = torch.tensor([[0.3, -1.0], [2.0, 0.1]])
    for scale in (0.01, 1.0, 100.0):
        w0 = scale * torch.tensor([[1.0, 2.0], [-3.0, 0.5]])
        w, _ = _one_step(w0.tolist(), g.tolist(), lr=0.05)
        assert float((w - w0).norm() / w0.norm()) == pytest.approx(0.05, rel=1e-5)


def test_make_lamb_adapts_and_decays_matrices_only():
    cfg = config.preset("smoke")
    model = GPT(cfg.model)
    opt = lamb.make_lamb(model, cfg.train, lr=0.01)
    adapted, plain = opt.param_groups
    assert adapted["adapt"] and adapted["weight_decay"] == cfg.train.weight_decay
    assert not plain["adapt"] and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in adapted["params"])
    assert all(p.dim() == 1 for p in plain["params"])
    assert len(adapted["params"]) + len(plain["params"]) == len(list(model.parameters()))
    assert opt.param_groups[0]["lr"] == 0.01


def test_train_with_adamw_reproduces_train_train_step_for_step():
    cfg = config.preset("smoke").replace(steps=6, micro_batch=4, warmup_steps=2, eval_every=0)
    splits = data.load_splits()
    torch.manual_seed(0)
    reference = train.train(GPT(cfg.model), cfg, splits.train, device=torch.device("cpu"))
    torch.manual_seed(0)
    model = GPT(cfg.model)
    mine = lamb.train_with(model, train.make_optimizer(model, cfg.train), cfg, splits.train,
                           device=torch.device("cpu"))
    assert mine.loss == reference.loss
    assert mine.lr == reference.lr
    torch.manual_seed(0)
    model = GPT(cfg.model)
    other = lamb.train_with(model, lamb.make_lamb(model, cfg.train), cfg, splits.train,
                            device=torch.device("cpu"))
    assert other.loss[0] == reference.loss[0]  # the same first batch and weights
    assert other.loss[1:] != reference.loss[1:]  # then the optimizer differs
