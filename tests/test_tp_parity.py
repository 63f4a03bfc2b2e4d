"""Tensor parallelism on 2 gloo ranks equals the single-process layers and GPT.

One launch covers the column- and row-parallel linear layers, the whole GPT trained k AdamW
steps through ``apply_tensor_parallel``, and the same through DTensor; the references are
computed here. Tolerances (fp32; the all-reduce only sums in another order):

* linear outputs and gradients: atol 1e-6;
* GPT first-step gradients: atol 1e-6, rtol 1e-4; losses of all 3 steps: 1e-5;
* GPT parameters after 3 AdamW steps: atol 1e-4. Looser on purpose: Adam divides each
  gradient by its running RMS, so rounding noise in a gradient that is ~0 becomes an update
  of a sizeable fraction of lr. The key bias is such a parameter: softmax ignores a constant
  added to every score of a query, so its exact gradient is 0. Measured max |diff| here:
  ~2e-5, for DTensor's implementation as for ours.
"""

from __future__ import annotations

import pytest
import torch
from one_process import assert_saved_state_matches, train_one_process

from labkit import data
from labkit.config import ModelConfig
from labkit.jobs import launch
from labkit.model import GPT
from labkit.parallel import tensor
from labkit.workers import tp_train

N = 2
B, STEPS, SEED = 4, 3, 0
CFG = ModelConfig(**tp_train.DEFAULT_MODEL)


@pytest.fixture(scope="module")
def job():
    return launch.run(
        tp_train.TPTrainConfig(batch_size=B, steps=STEPS, seed=SEED, grad_clip=1.0),
        nproc=N,
        timeout_s=180,
        stream=False,
    )


@pytest.fixture(scope="module")
def reference():
    """The single-process GPT trained on the same batches, with the same clip and AdamW."""
    return train_one_process(CFG, data.fixed_batches(CFG.seq_len, B, STEPS, SEED), seed=SEED,
                             micro_batch=B)  # fmt: skip


@pytest.mark.slow
def test_column_and_row_parallel_linear_equal_nn_linear(job):
    lin, x, grad_out = tp_train.linear_case(SEED)
    x = x.clone().requires_grad_()
    y = lin(x)
    y.backward(grad_out)
    out_f, in_f = lin.out_features, lin.in_features
    for r in range(N):
        got = torch.load(job.log_dir / f"tp_linear_rank{r}.pt")
        rows = slice(r * out_f // N, (r + 1) * out_f // N)
        cols = slice(r * in_f // N, (r + 1) * in_f // N)
        close = dict(atol=1e-6, rtol=1e-5)
        # Column-parallel: this rank's output columns, its weight rows; f makes the input
        # gradient whole.
        torch.testing.assert_close(got["col_out"], y.detach()[..., rows], **close)
        torch.testing.assert_close(got["col_weight_grad"], lin.weight.grad[rows], **close)
        torch.testing.assert_close(got["col_bias_grad"], lin.bias.grad[rows], **close)
        torch.testing.assert_close(got["col_input_grad"], x.grad, **close)
        # Row-parallel: the whole output after g, its weight columns, its input slice.
        torch.testing.assert_close(got["row_out"], y.detach(), **close)
        torch.testing.assert_close(got["row_weight_grad"], lin.weight.grad[:, cols], **close)
        torch.testing.assert_close(got["row_bias_grad"], lin.bias.grad, **close)
        torch.testing.assert_close(got["row_input_grad"], x.grad[..., cols], **close)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["gpt", "dtensor"])
def test_tensor_parallel_gpt_equals_single_process_after_k_steps(job, reference, impl):
    ref_losses = reference[0]
    for r in range(N):
        assert job.ranks[r][impl]["losses"] == pytest.approx(ref_losses, abs=1e-5)
    torch.manual_seed(SEED)
    initial_fc = dict(GPT(CFG).named_parameters())["blocks.0.mlp.fc.weight"]
    assert_saved_state_matches(torch.load(job.log_dir / f"tp_{impl}_params.pt"), reference, initial_fc)


@pytest.mark.slow
def test_allreduce_count_bytes_and_parameter_memory_match_the_formulas(job):
    formula = tensor.tp_allreduce_bytes_per_step(CFG, B)
    per_call = B * CFG.seq_len * CFG.d_model * 4
    assert formula == {
        "calls": 4 * CFG.n_layer,
        "message_bytes": 4 * CFG.n_layer * per_call,
        "bytes_per_call": per_call,
    }
    expected = tensor.tp_params_per_rank(CFG, N) * 4
    for r in range(N):
        gpt = job.ranks[r]["gpt"]
        for step in gpt["comm_per_step"]:  # 2 per layer in each pass, of one (b, s, h) each
            assert step["forward_calls"] == step["backward_calls"] == 2 * CFG.n_layer
            assert step["forward_bytes"] + step["backward_bytes"] == formula["message_bytes"]
        assert gpt["param_bytes"] == gpt["param_bytes_formula"] == expected
        assert job.ranks[r]["dtensor"]["param_bytes"] == expected
        assert gpt["param_bytes"] < gpt["param_bytes_single_process"]


@pytest.mark.slow
def test_dtensor_plan_issues_the_same_collectives_as_ours(job):
    """CommDebugMode, one counter for both, in the first step: 2 all-reduces per layer in
    each pass for ours (g after attention and MLP; f before each) and for DTensor's plan.
    Without the PrepareModuleInput on the attention, q, k and v would each all-reduce their
    input gradient: 3 + 1 per layer in the backward (8 here, not 4)."""
    per_pass = {"all_reduce": 2 * CFG.n_layer}
    for r in range(N):
        ours = job.ranks[r]["gpt"]["collectives"]
        theirs = job.ranks[r]["dtensor"]["collectives"]
        assert ours == {"forward": per_pass, "backward": per_pass}
        assert theirs == ours
        # CommDebugMode's count of ours agrees with f and g's own counter.
        step = job.ranks[r]["gpt"]["comm_per_step"][0]
        assert ours["forward"]["all_reduce"] == step["forward_calls"]
        assert ours["backward"]["all_reduce"] == step["backward_calls"]
