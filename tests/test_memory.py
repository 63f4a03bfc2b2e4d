import dataclasses

import pytest
import torch

from labkit import memory, train
from labkit.config import ModelConfig, TrainConfig
from labkit.model import GPT

CPU = torch.device("cpu")
CFG = ModelConfig(seq_len=32, n_layer=2, n_head=2, d_model=32)


def batch(b, seed=0):
    x = torch.randint(0, CFG.vocab_size, (b, CFG.seq_len), generator=torch.Generator().manual_seed(seed))
    return x, torch.roll(x, -1, 1)


def measure(b):
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = train.make_optimizer(model, TrainConfig())
    return model, memory.measure_training_memory(model, opt, batch(b), device=CPU)


def test_fp32_adamw_states_are_4_4_8_bytes_per_parameter():
    model, m = measure(2)
    n = model.num_params()
    assert (m.parameters, m.gradients, m.optimizer_state) == (4 * n, 4 * n, 8 * n)
    # AdamW allocates its moments lazily, at the first step() (so OOM can first hit at step 2).
    assert m.optimizer_state_before_first_step == 0
    assert m.cuda_peak is None and "tensor accounting" in m.method


def test_activations_grow_linearly_with_the_batch():
    # a·b + c: c is what does not depend on the batch (the position ids, a scalar or two).
    a1, a2, a4 = (measure(b)[1].activations for b in (1, 2, 4))
    assert a1 > 0
    assert a4 - a2 == 2 * (a2 - a1)
    assert 0 <= 2 * a1 - a2 < 0.01 * a1


def test_views_share_one_storage():
    t = torch.zeros(10)
    assert memory.storage_bytes([t, t[:5], t.view(2, 5)]) == 40


def test_predicted_activations_equal_the_measured_bytes():
    # Every term: the blocks (Korthikanti, generalised) and what that formula leaves out.
    for dtype in ("float32", "bfloat16"):
        torch.manual_seed(0)
        model = GPT(CFG)
        opt = train.make_optimizer(model, TrainConfig())
        m = memory.measure_training_memory(model, opt, batch(3), device=CPU, dtype=dtype)
        predicted = memory.predicted_activations(CFG, 3, dtype=dtype)
        assert sum(predicted.values()) == m.activations, dtype
        assert "log-softmax output" in predicted and "logits" not in " ".join(predicted)
    # a shorter input, math SDPA (the s×s matrix stored)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        model = GPT(CFG)
        x = torch.randint(0, 256, (2, 16))  # targets in their own storage, as get_batch's are
        m = memory.measure_training_memory(model, train.make_optimizer(model, TrainConfig()),
                                           (x, torch.roll(x, -1, 1)), device=CPU)
    assert m.activations == sum(memory.predicted_activations(
        CFG, 2, seq_len=16, attention="materialized").values())


def test_predicted_activations_refuse_dropout():
    with pytest.raises(ValueError, match="dropout"):
        memory.predicted_activations(dataclasses.replace(CFG, dropout=0.1), 2)


def test_optimizer_state_first_lives_beside_the_second_forward():
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = train.make_optimizer(model, TrainConfig())
    rows = memory.live_bytes_over_steps(model, opt, [batch(2, 0), batch(2, 1)], device=CPU)
    assert [(r.step, r.phase) for r in rows] == [
        (s, p) for s in (1, 2) for p in ("start", "forward", "backward", "optimizer step")]
    at = {(r.step, r.phase): r for r in rows}
    n = model.num_params()
    assert at[1, "forward"].optimizer_state == 0 and at[1, "backward"].optimizer_state == 0
    assert at[1, "optimizer step"].optimizer_state == 8 * n  # AdamW's m and v, fp32
    assert at[2, "start"].optimizer_state == 8 * n
    assert at[2, "forward"].total - at[1, "forward"].total == 8 * n
    assert at[1, "forward"].activations > 0 and at[1, "backward"].activations == 0
    assert at[1, "backward"].gradients == 4 * n and at[2, "start"].gradients == 0
    assert all(r.cuda_allocated is None and r.cuda_step_peak is None for r in rows)


def test_saved_activation_bytes_grow_linearly_with_b_and_quadratically_with_s_under_math_sdpa():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(0)
    model = GPT(CFG)
    before = [p.detach().clone() for p in model.parameters()]

    def saved(b, s):
        x = torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(b * s))
        with sdpa_kernel(SDPBackend.MATH):
            return memory.saved_activation_bytes(model, (x, torch.roll(x, -1, 1)), device=CPU)

    for b, s in ((1, 8), (2, 8), (2, 16), (2, 32), (4, 32)):
        assert saved(b, s) == sum(memory.predicted_activations(
            CFG, b, seq_len=s, attention="materialized").values())
    # a·b + c in the batch; in s, the quadratic coefficient is L·a·b·4 (fp32 s×s scores)
    assert saved(4, 16) - saved(2, 16) == 2 * (saved(2, 16) - saved(1, 16))
    c = 4  # the loss's total_weight scalar: the only term that grows with neither
    gamma = (saved(2, 32) - 2 * saved(2, 16) + c) / (2 * 16**2)
    assert gamma == CFG.n_layer * CFG.n_head * 2 * 4
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_live_bytes_over_steps_read_the_cuda_allocator():
    cuda = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = GPT(CFG).to(cuda)
    opt = train.make_optimizer(model, TrainConfig())
    rows = memory.live_bytes_over_steps(model, opt, [batch(2, 0), batch(2, 1)], device=cuda,
                                        dtype="bfloat16")
    assert all(r.cuda_allocated is not None for r in rows)
    peaks = [r.cuda_step_peak for r in rows if r.phase == "optimizer step"]
    assert len(peaks) == 2 and all(p is not None and p > 0 for p in peaks)
    at = {(r.step, r.phase): r for r in rows}
    n = model.num_params()
    assert at[1, "forward"].optimizer_state == 0 and at[2, "forward"].optimizer_state == 8 * n


# --- the peak of a whole step: predicted tensor by tensor, measured as live tensor bytes --------

SMOKE = ModelConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=2, d_model=64)  # the preset


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_predicted_step_peak_is_the_measured_live_byte_peak_to_the_byte(dtype):
    """The finder's trial step (a steady-state train_step, AdamW's moments present), counted by
    LiveTensorBytes, peaks at the loss's backward with exactly the predicted tensors alive."""
    from labkit.batching import trials

    torch.manual_seed(0)
    model = GPT(SMOKE)
    for b in (2, 8):
        measured = trials.measure_step_peak(model, b, seq_len=SMOKE.seq_len, dtype=dtype)
        predicted = memory.predicted_step_peak(SMOKE, b, dtype=dtype)
        assert predicted.bytes == measured, (b, predicted.as_dict())
    p = memory.predicted_step_peak(SMOKE, 8, dtype=dtype)
    terms = p.as_dict()
    assert terms["parameters"] == 4 * model.num_params()
    assert terms["optimizer state (AdamW exp_avg, exp_avg_sq)"] == 8 * model.num_params()
    # every saved activation but the loss's 4-byte total_weight, released by nll_loss's backward
    saved = sum(v for k, v in terms.items() if k.startswith("saved:"))
    assert saved + terms["token ids, targets and position ids"] == sum(
        memory.predicted_activations(SMOKE, 8, dtype=dtype).values()) - 4


def test_cuda_block_bytes_rounds_up_to_512_byte_blocks():
    assert [memory.cuda_block_bytes(n) for n in (0, 1, 4, 511, 512, 513, 1024, 1025)] == [
        0, 512, 512, 512, 512, 1024, 1024, 1536]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="nbytes="):
            memory.cuda_block_bytes(bad)


def test_cuda_prediction_rounds_each_tensor_not_the_total():
    p = memory.predicted_step_peak(SMOKE, 8)
    # the smoke GPT's 64-float vectors (256 B) each take a 512 B block, in the parameters and in
    # both AdamW moments: per block ln_1's 2, the q, k, v and proj biases, ln_2's 2 and the MLP's
    # output bias (9), times 2 layers, plus ln_f's 2 (the MLP's 4h bias is 1,024 B: no rounding)
    vectors = 9 * 2 + 2
    assert p.as_dict(cuda=True)["parameters"] - p.as_dict()["parameters"] == vectors * 256
    assert p.cuda_bytes - p.bytes == 3 * vectors * 256 + 2 * 508  # + the loss's two scalars
    assert p.cuda_bytes == sum(p.as_dict(cuda=True).values())
