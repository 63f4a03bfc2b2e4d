import copy
import dataclasses

import pytest
import torch
from torch import nn

from labkit.batching import finder, recomputation, trials
from labkit.batching.recomputation import (
    CheckpointedBlock,
    apply_checkpointing,
    predict_checkpointing,
)
from labkit.batching.trials import LiveTensorBytes
from labkit.config import preset
from labkit.memory import measure_training_memory
from labkit.model import GPT

CPU = torch.device("cpu")


def _smoke_model(**changes) -> GPT:
    torch.manual_seed(0)
    return GPT(dataclasses.replace(preset("smoke").model, **changes))


def _batch(model: GPT, micro_batch: int = 8):
    g = torch.Generator().manual_seed(1)
    cfg = model.cfg
    x = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _loss_and_grads(model: GPT, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.train()
    torch.manual_seed(123)  # the same dropout masks for both models
    _, loss = model(*batch)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("dropout", [None, 0.1], ids=["configured", "dropout0.1"])
@pytest.mark.parametrize("every", [1, 2])
def test_loss_and_gradients_match_without_checkpointing(every, dropout):
    base = _smoke_model() if dropout is None else _smoke_model(dropout=dropout)
    wrapped = copy.deepcopy(base)
    apply_checkpointing(wrapped, every=every)
    batch = _batch(base)
    loss0, grads0 = _loss_and_grads(base, batch)
    loss1, grads1 = _loss_and_grads(wrapped, batch)
    # Checkpointing recomputes the same ops on the same inputs (and, with dropout, restores the
    # RNG state first), so on a CPU the results agree to the bit (measured: torch 2.13).
    assert torch.equal(loss0, loss1)
    for g0, g1 in zip(grads0, grads1, strict=True):
        assert torch.equal(g0, g1)


def test_dropout_masks_differ_between_seeds():
    # The dropout comparison above can only fail if dropout really changes the loss.
    model = _smoke_model(dropout=0.1)
    batch = _batch(model)
    torch.manual_seed(1)
    a = model(*batch)[1]
    torch.manual_seed(2)
    b = model(*batch)[1]
    assert not torch.equal(a, b)


def _activation_bytes(every: int | None, dtype: str = "float32", micro_batch: int = 8) -> int:
    model = _smoke_model()
    if every is not None:
        apply_checkpointing(model, every=every)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return measure_training_memory(
        model, opt, _batch(model, micro_batch), device=CPU, dtype=dtype
    ).activations


def test_checkpointing_saves_fewer_tensors_for_backward():
    none, every_other, every_block = (_activation_bytes(e) for e in (None, 2, 1))
    assert every_block < every_other < none


def test_returns_wrapped_names_and_wraps_in_place():
    model = _smoke_model(n_layer=5)
    assert apply_checkpointing(model, every=2) == ["blocks.0", "blocks.2", "blocks.4"]
    kinds = [isinstance(b, CheckpointedBlock) for b in model.blocks]
    assert kinds == [True, False, True, False, True]
    assert apply_checkpointing(_smoke_model(), every=1) == ["blocks.0", "blocks.1"]


def test_state_dict_keys_unchanged_and_load_both_ways():
    plain = _smoke_model()
    wrapped = _smoke_model()
    keys_before = list(wrapped.state_dict())
    apply_checkpointing(wrapped)
    assert list(wrapped.state_dict()) == keys_before
    other = GPT(plain.cfg)  # different weights
    other.load_state_dict(wrapped.state_dict())  # wrapped -> plain
    for a, b in zip(other.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(a, b)
    wrapped_too = GPT(plain.cfg)
    apply_checkpointing(wrapped_too)
    wrapped_too.load_state_dict(plain.state_dict())  # plain -> wrapped
    for a, b in zip(wrapped_too.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_refuses_bad_every(every):
    with pytest.raises(ValueError, match="a positive integer"):
        apply_checkpointing(_smoke_model(), every=every)


def test_refuses_model_without_blocks():
    with pytest.raises(ValueError, match="no `blocks`"):
        apply_checkpointing(nn.Linear(2, 2))


def test_refuses_wrapping_twice():
    model = _smoke_model()
    apply_checkpointing(model, every=2)
    with pytest.raises(ValueError, match="already checkpointed"):
        apply_checkpointing(model)


# bfloat16: the GPU preset's autocast (notebook 05 at size gpu), run here by CPU autocast,
# which follows the same op lists for these layers (formulas.activation_bytes_per_layer)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("every", [1, 2])
def test_predicted_saving_matches_the_measured_saved_bytes(every, dtype):
    # The formula counts the inside of each block; the measured difference with and without
    # checkpointing is exactly that, less the block inputs kept, plus LayerNorm's mean and rstd
    # (2 LayerNorms x 2 float32 values per token), which the formula leaves out. Under
    # autocast the inside includes the block's 16-bit weight copies.
    model = _smoke_model()
    cfg, (x, _) = model.cfg, _batch(model)
    b = x.shape[0]
    predicted = predict_checkpointing(cfg, b, every, dtype=dtype)
    measured = _activation_bytes(None, dtype) - _activation_bytes(every, dtype)
    layer_norm_stats = 2 * 2 * 4 * cfg.seq_len * b
    assert measured == predicted.saving_bytes + predicted.checkpointed * layer_norm_stats


def test_per_sequence_saving_under_autocast_is_the_difference_of_two_batches():
    """Notebook 05 turns the saving into bytes per sequence. Under autocast the weight copies
    do not grow with the batch, so one sequence's prediction is not a per-sequence figure."""
    cfg = _smoke_model().cfg
    one, two = (predict_checkpointing(cfg, b, 1, dtype="bfloat16") for b in (1, 2))
    per_sequence = two.saving_bytes - one.saving_bytes
    assert one.saving_bytes - per_sequence == cfg.n_layer * 12 * cfg.d_model**2 * 2
    saving = {b: _activation_bytes(None, "bfloat16", b) - _activation_bytes(1, "bfloat16", b)
              for b in (4, 8)}  # fmt: skip
    layer_norm_stats = 2 * 2 * 4 * cfg.seq_len * cfg.n_layer  # per sequence
    assert saving[8] - saving[4] == 4 * (per_sequence + layer_norm_stats)
    assert predict_checkpointing(cfg, 2, 1, dtype="float32").saving_bytes == 2 * (
        predict_checkpointing(cfg, 1, 1, dtype="float32").saving_bytes
    )  # float32: no fixed part


def test_prediction_counts_blocks_and_refuses_bad_input():
    cfg = _smoke_model(n_layer=5).cfg
    assert predict_checkpointing(cfg, 4, None).checkpointed == 0
    assert predict_checkpointing(cfg, 4, 2).checkpointed == 3
    none, every = predict_checkpointing(cfg, 4, None), predict_checkpointing(cfg, 4, 1)
    assert none.recompute_bytes == 0 and every.recompute_bytes == every.per_layer_bytes
    assert every.saved_bytes == 5 * every.input_bytes
    with pytest.raises(ValueError, match="every=0 is not allowed"):
        predict_checkpointing(cfg, 4, 0)
    with pytest.raises(ValueError, match="context"):
        predict_checkpointing(cfg, 4, 1, seq_len=cfg.seq_len + 1)
    with pytest.raises(ValueError, match="micro_batch"):
        predict_checkpointing(cfg, 0, 1)
    with pytest.raises(ValueError, match="dtype='fp16' is not allowed"):
        predict_checkpointing(cfg, 4, 1, dtype="fp16")


def test_segment_checkpoint_bytes_by_hand():
    # 16 layers of 10 bytes, inputs of 1 byte
    assert recomputation.segment_checkpoint_bytes(16, 10, 1, None) == 160
    assert recomputation.segment_checkpoint_bytes(16, 10, 1, 16) == 16 + 10  # every block
    assert recomputation.segment_checkpoint_bytes(16, 10, 1, 4) == 4 + 4 * 10  # √n segments
    assert recomputation.segment_checkpoint_bytes(10, 10, 1, 3) == 3 + 4 * 10  # ⌈10/3⌉ = 4
    with pytest.raises(ValueError, match="segments"):
        recomputation.segment_checkpoint_bytes(4, 10, 1, 5)
    with pytest.raises(ValueError, match="per_layer_bytes"):
        recomputation.segment_checkpoint_bytes(4, -1, 1, 2)


# ----------------------------------------------------------------------------------------------
# The peak of a checkpointed step, tensor by tensor, against the live bytes of a real step.


class _LiveAtMoments(LiveTensorBytes):
    """Live tensor bytes right after each op a predicted moment names: log_softmax's backward,
    the MLP output projection's weight-gradient matmul (an (h, 4h) mm), GELU's backward."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.d_model = d_model
        self.at: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        aten, h = torch.ops.aten, self.d_model
        if func in (aten._log_softmax_backward_data.default, aten.gelu_backward.default) or (
                func is aten.mm.default and tuple(out.shape) == (h, 4 * h)):
            self.at.append(self.current)
        return out


@pytest.mark.parametrize("name", ["smoke", "lab"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checkpointed_step_moments_match_a_real_step_to_the_byte(name, dtype):
    cfg = preset(name)
    torch.manual_seed(0)
    model = GPT(cfg.model)
    apply_checkpointing(model, every=1)
    for b in (2, 9):
        step = trials._Trials(model, seq_len=cfg.model.seq_len, dtype=dtype, train_cfg=cfg.train,
                              device=CPU)
        with _LiveAtMoments(cfg.model.d_model) as counter:
            step._step(b, 1)
        moments = recomputation.checkpointed_step_moments(cfg.model, b, dtype=dtype)
        assert len(moments) == 1 + 2 * cfg.model.n_layer
        assert counter.at == [m.bytes for m in moments], (name, dtype, b)
        peak = recomputation.predicted_checkpointed_step_peak(cfg.model, b, dtype=dtype)
        assert peak.bytes == counter.peak == max(counter.at)
        # and the finder's own trial step measures the same peak
        assert trials.measure_step_peak(model, b, seq_len=cfg.model.seq_len, dtype=dtype,
                                        train_cfg=cfg.train) == peak.bytes


def test_checkpointed_peak_is_below_the_plain_one_and_grows_with_the_batch():
    from labkit import memory

    cfg = preset("smoke").model
    peaks = [recomputation.predicted_checkpointed_step_peak(cfg, b).bytes for b in (4, 8, 16)]
    assert peaks[0] < peaks[1] < peaks[2]
    for b in (4, 16):
        assert (recomputation.predicted_checkpointed_step_peak(cfg, b).bytes
                < memory.predicted_step_peak(cfg, b).bytes)
    with pytest.raises(ValueError, match="dropout"):
        recomputation.checkpointed_step_moments(dataclasses.replace(cfg, dropout=0.1), 4)


def test_tensorwise_checkpointed_prediction_meets_the_batch_real_steps_find():
    """Formulas alone against the finder's real trial steps on a checkpointed model."""
    smoke = preset("smoke")
    model = _smoke_model()
    apply_checkpointing(model, every=1)
    found = finder.find_max_batch(model, 16 * 2**20, train_cfg=smoke.train)
    predicted = finder.predict_max_batch_tensorwise(smoke.model, 16 * 2**20, checkpointed=True)
    assert predicted == found.found
    assert predicted > finder.predict_max_batch_tensorwise(smoke.model, 16 * 2**20)
