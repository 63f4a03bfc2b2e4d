"""Full and selective activation recomputation (labkit.batching.recomputation.apply_ac).

Parity with no recomputation, the bytes each mode holds for the backward against the
prediction (exact on a CPU in float32), and the 1F1B in-flight arithmetic. One process, no
launch.
"""

import copy
import dataclasses

import pytest
import torch

from labkit import formulas, memory
from labkit.batching import recomputation as ck
from labkit.config import ModelConfig, preset
from labkit.model import GPT

CPU = torch.device("cpu")


def _model(**changes) -> GPT:
    torch.manual_seed(0)
    return GPT(dataclasses.replace(preset("smoke").model, **changes))


def _batch(cfg: ModelConfig, micro_batch: int = 4):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _with(model: GPT, mode: str) -> GPT:
    model = copy.deepcopy(model)
    ck.apply_ac(model, mode)
    return model


def _loss_and_grads(model: GPT, batch):
    model.train()
    torch.manual_seed(123)  # the same dropout masks for every mode
    loss = model(*batch)[1]
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout0.1"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_loss_and_gradients_match_no_recompute_to_the_bit(mode, dropout):
    base = _model(dropout=dropout)
    batch = _batch(base.cfg)
    loss0, grads0 = _loss_and_grads(base, batch)
    loss1, grads1 = _loss_and_grads(_with(base, mode), batch)
    # The recompute runs the same ops on the same inputs with the RNG state restored, and the
    # selective policy hands back the very matmul outputs of the forward: bitwise equal on a CPU.
    assert torch.equal(loss0, loss1)
    for g0, g1 in zip(grads0, grads1, strict=True):
        assert torch.equal(g0, g1)


def test_selective_really_recomputes_the_elementwise_ops():
    # Parity alone would pass if the wrapper did nothing: count the ops the backward reruns.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    def backward_ops(mode):
        model = _with(_model(), mode)
        loss = model(*_batch(model.cfg))[1]
        with Count() as c:
            loss.backward()
        return c.ops

    aten = torch.ops.aten
    none, sel, full = (backward_ops(m) for m in ("none", "selective", "full"))
    n_layer = _model().cfg.n_layer
    # each block's forward ops rerun in the backward: its two LayerNorms and GELU
    assert none.count(aten.native_layer_norm.default) == 0
    assert sel.count(aten.native_layer_norm.default) == 2 * n_layer
    assert full.count(aten.native_layer_norm.default) == 2 * n_layer
    # ... but under the selective policy no matmul is redone; under full, every one but the
    # block's last (q, k, v, attention proj, MLP fc): checkpoint's early stop ends the rerun
    # once the last tensor the backward needs is rebuilt, and nothing needs the MLP's output.
    assert sel.count(aten.addmm.default) == none.count(aten.addmm.default)
    assert full.count(aten.addmm.default) == none.count(aten.addmm.default) + 5 * n_layer
    assert sel.count(aten._scaled_dot_product_flash_attention_for_cpu.default) == 0
    assert full.count(aten._scaled_dot_product_flash_attention_for_cpu.default) == n_layer


@pytest.mark.parametrize("changes", [{}, {"n_layer": 3, "n_head": 2, "d_model": 32,
                                          "seq_len": 16, "tie_weights": False}],
                         ids=["smoke", "untied-odd"])  # fmt: skip
@pytest.mark.parametrize("micro_batch", [1, 4])
def test_held_bytes_match_the_prediction_exactly(changes, micro_batch):
    base = _model(**changes)
    batch = _batch(base.cfg, micro_batch)
    held = {m: ck.measure_held_bytes(_with(base, m), batch) for m in ck.AC_MODES}
    assert held["none"] > held["selective"] > held["full"]
    for mode in ck.AC_MODES:
        predicted = ck.predict_recompute(base.cfg, micro_batch, mode)
        assert held[mode] == predicted.held_bytes, mode
        assert held["none"] - held[mode] == predicted.saving_bytes, mode


def test_no_recompute_held_bytes_are_what_autograd_saves():
    # Without recompute the live-bytes count and the saved-tensor hooks agree (less the token
    # ids, allocated before the forward, plus the loss scalar): the two methods measure alike.
    model = _model()
    batch = _batch(model.cfg)
    saved = memory.saved_activation_bytes(model, batch, device=CPU)
    x, y = batch
    assert ck.measure_held_bytes(model, batch) == saved - x.nbytes - y.nbytes + 4


def test_saved_tensor_hooks_cannot_see_the_selective_cache():
    # Why measure_held_bytes exists: the selective policy keeps its outputs in the checkpoint's
    # own cache, so hooks on saved tensors count selective as if it were full recompute.
    base = _model()
    batch = _batch(base.cfg)
    hooks = {m: memory.saved_activation_bytes(_with(base, m), batch, device=CPU)
             for m in ("selective", "full")}  # fmt: skip
    assert hooks["selective"] == hooks["full"]
    assert ck.measure_held_bytes(_with(base, "selective"), batch) > ck.measure_held_bytes(
        _with(base, "full"), batch
    )


def test_flops_prediction():
    cfg = preset("smoke").model
    L, h, s = cfg.n_layer, cfg.d_model, cfg.seq_len
    n = formulas.gpt_params(cfg.vocab_size, h, L)
    step = 6 * n + 12 * L * h * s
    none, sel, full = (ck.predict_recompute(cfg, 2, m) for m in ck.AC_MODES)
    assert none.flops_factor == 1
    assert full.flops_factor == pytest.approx(1 + L * (16 * h * h + 4 * h * s) / step)
    assert 1 < sel.flops_factor < 1.02 < full.flops_factor < 4 / 3


def test_paper_formula_gives_its_70_percent_for_gpt3():
    # Korthikanti et al. 2022, GPT-3 175B: s=2048, h=12288, a=96: 5as/h = 80 of 34 + 80.
    none, sel, full = (ck.paper_bytes_per_layer(2048, 1, 12288, 96, m) for m in ck.AC_MODES)
    assert none == 2048 * 12288 * 114 == formulas.activation_bytes_per_layer(2048, 1, 12288, 96)
    assert 1 - sel / none == pytest.approx(80 / 114)  # 70%
    assert full == 2 * 2048 * 12288


def test_one_f_one_b_in_flight():
    assert ck.one_f_one_b_in_flight(4, 8) == [4, 3, 2, 1]
    assert ck.one_f_one_b_in_flight(4, 2) == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="stages"):
        ck.one_f_one_b_in_flight(0, 8)


@pytest.mark.parametrize("mode", ck.AC_MODES)
def test_a_stage_holds_in_flight_times_per_micro_batch(mode):
    model = _with(_model(), mode)
    cfg, b = model.cfg, 2
    stage = torch.nn.Sequential(*model.blocks[:2])
    g = torch.Generator().manual_seed(2)
    inputs = [torch.randn(b, cfg.seq_len, cfg.d_model, generator=g) for _ in range(3)]
    held = ck.measure_in_flight_bytes(stage, inputs)
    per_mb = (
        2 * ck.predict_recompute(cfg, b, mode).per_layer_bytes + 4 * b * cfg.seq_len * cfg.d_model
    )
    assert held == [per_mb, 2 * per_mb, 3 * per_mb]  # blocks' bytes and the output kept


def test_selective_keeps_state_dict_keys():
    model = _model()
    keys = list(model.state_dict())
    assert ck.apply_ac(model, "selective") == [f"blocks.{i}" for i in range(model.cfg.n_layer)]
    assert list(model.state_dict()) == keys
    assert all(b.selective for b in model.blocks)


def test_refuses_bad_input():
    with pytest.raises(ValueError, match="mode='sel' is not allowed"):
        ck.apply_ac(_model(), "sel")
    model = _model()
    ck.apply_ac(model, "selective")
    with pytest.raises(ValueError, match="already checkpointed"):
        ck.apply_ac(model, "full")
    with pytest.raises(ValueError, match="dropout"):
        ck.predict_recompute(_model(dropout=0.1).cfg, 2, "full")
    with pytest.raises(ValueError, match="mode"):
        ck.predict_recompute(preset("smoke").model, 2, "partial")
    with pytest.raises(ValueError, match="inputs is empty"):
        ck.measure_in_flight_bytes(torch.nn.Identity(), [])
    assert ck.apply_ac(_model(), "none") == []


def test_the_selective_policy_keeps_what_op_kinds_calls_matmul_or_attention():
    # One classifier (labkit.op_kinds) decides; the ops it keeps are the ones the policy kept
    # when it listed them by hand: the four matmuls and the fused attention kernels.
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    kept = [aten.mm, aten.addmm, aten.bmm, aten.baddbmm,
            aten._scaled_dot_product_flash_attention_for_cpu,
            aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
            aten._scaled_dot_product_cudnn_attention]  # fmt: skip
    recomputed = [aten.native_layer_norm, aten.gelu, aten.add, aten.view, aten.t,
                  aten.native_dropout, aten._log_softmax]  # fmt: skip
    for packet in kept:
        assert ck.selective_policy(None, packet.default) == CheckpointPolicy.MUST_SAVE, packet
    for packet in recomputed:
        assert ck.selective_policy(None, packet.default) == CheckpointPolicy.PREFER_RECOMPUTE, packet
