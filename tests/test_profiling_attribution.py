"""labkit.profiling.attribution: a real step's time by kind of operator (CPU)."""

from __future__ import annotations

import pytest
import torch

from labkit import config, op_kinds, train
from labkit.model import GPT
from labkit.profiling import attribution as at


@pytest.mark.parametrize("name, kind", [
    ("aten::mm", "matmul"), ("aten::addmm", "matmul"), ("aten::bmm", "matmul"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention (SDPA)"),
    ("aten::_efficient_attention_backward", "attention (SDPA)"),
    ("aten::native_layer_norm_backward", "layer norm"),
    ("aten::_log_softmax_backward_data", "loss (log-softmax, NLL)"),
    ("aten::nll_loss_forward", "loss (log-softmax, NLL)"),
    ("aten::gelu", "other operators"), ("aten::copy_", "other operators"),
])  # fmt: skip
def test_operators_are_sorted_into_kinds(name, kind):
    assert at.kind_of(name) == kind


def test_attribution_sorts_with_the_one_classifier():
    assert at.kind_of is op_kinds.kind_of  # re-exported, not a second list
    assert [op_kinds.is_matmul(n) for n in ("aten::addmv", "aten::_addmm_activation", "aten::baddbmm",
                                            "aten::linear", "aten::matmul", "aten::_scaled_mm")] \
        == [True, True, True, False, False, False]  # composites only call a matmul: counted once


def test_a_real_step_is_attributed_and_the_parts_add_up_to_the_step():
    torch.manual_seed(0)
    cfg = config.preset("smoke")
    model = GPT(cfg.model)
    opt = train.make_optimizer(model, cfg.train)
    x = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.seq_len))

    def step():
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    a = at.attribute_step(step, steps=2)
    assert set(a.seconds) == set(at.ORDER) and a.clock == "CPU self time"
    # every kind this step runs got time; the optimizer's operators (lerp_, sqrt, ...) count
    # as "optimizer", not as "other", because they ran inside optimizer.step()
    for kind in ("matmul", "attention (SDPA)", "layer norm", "loss (log-softmax, NLL)",
                 "optimizer", "other operators"):
        assert a.seconds[kind] > 0, kind
    inside = sum(v for k, v in a.seconds.items() if k != at.OUTSIDE)
    assert inside <= 1.05 * a.step_s  # self times do not double-count nested operators
    assert "matmul" in a.table() and "%" in a.table()
    with pytest.raises(ValueError, match="steps=0"):
        at.attribute_step(step, steps=0)


def test_time_spent_outside_every_operator_is_found_there():
    """A step that sleeps 20 ms in Python between operators: the sleep is in no operator, so
    it must show as "outside any operator", not in "other operators" (the profiler's own
    ProfilerStep range would otherwise hold it)."""
    import time

    a_tensor = torch.ones(64, 64)

    def step():
        a_tensor @ a_tensor
        time.sleep(0.02)
        a_tensor @ a_tensor

    a = at.attribute_step(step, steps=2)
    assert a.seconds[at.OUTSIDE] >= 0.015
    assert a.seconds[at.OTHER] < a.seconds[at.OUTSIDE] and a.seconds["matmul"] > 0
