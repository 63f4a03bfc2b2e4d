"""labkit.recipes.measure_fsdp2 / compare_fsdp2: FSDP2's mixed precision counted from what torch
holds after one real step (a one-rank gloo group on the CPU), and the verdict against a recipe."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from labkit import config, recipes
from labkit.model import GPT


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return GPT(config.preset("smoke").model)  # two blocks: one is gathered while the other is not


@pytest.fixture(scope="module")
def batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 256, (2, 16), generator=g),
             torch.randint(0, 256, (2, 16), generator=g))]  # fmt: skip


@pytest.fixture(scope="module")
def bf16(gpt, batches):
    return recipes.measure_fsdp2(gpt, batches)


def test_fsdp2_keeps_fp32_shards_grads_and_moments(gpt, bf16):
    n = sum(p.numel() for p in gpt.parameters())
    assert bf16.world_size == 1 and bf16.n_local == n
    assert bf16.persistent["parameters"] == 4 * n
    assert bf16.persistent["gradients"] == 4 * n
    assert bf16.persistent["optimizer_state"] == 8 * n
    assert bf16.persistent["other"] < 0.01 * n  # no master copy or buffer beside the shards
    assert bf16.dtypes["parameters"] == bf16.dtypes["gradients"] == ("float32",)
    assert bf16.dtypes["optimizer_state"] == ("float32",)
    assert bf16.step_counters > 0
    assert not dist.is_initialized()  # the one-rank group made for the call is gone


def test_fsdp2_bf16_copies_are_transient_and_partial(gpt, bf16):
    n = bf16.n_local
    assert bf16.unsharded_grad_dtypes == ("bfloat16",)
    # one block gathered beside the root module's parameters: some, not all, of a bf16 copy
    assert 0 < bf16.gathered_params < 2 * n
    assert bf16.gathered_grads > 0
    assert bf16.gathered_where.startswith(("forward", "backward"))


def test_fsdp2_param_dtype_is_what_the_backward_computes_in(gpt, batches):
    fp16 = recipes.measure_fsdp2(gpt, batches, param_dtype="fp16")
    assert fp16.param_dtype == "float16" and fp16.unsharded_grad_dtypes == ("float16",)
    assert fp16.dtypes["gradients"] == ("float32",)  # cast back to the parameters' dtype


def test_an_extra_tensor_kept_by_the_model_lands_in_other(gpt, batches):
    extra = GPT(config.preset("smoke").model)
    extra.load_state_dict(gpt.state_dict())
    extra.register_buffer("copy", torch.zeros(10_000))
    m = recipes.measure_fsdp2(extra, batches)
    assert m.persistent["other"] >= 40_000 and "float32" in m.dtypes["other"]
    assert "other" in recipes.compare_fsdp2(m, recipes.RECIPES["amp_bf16"]).differing


def _measurement(**persistent_per_param: float) -> recipes.FSDP2Measurement:
    n = 1000
    parts = {"parameters": 4, "gradients": 4, "optimizer_state": 8, "other": 0,
             **persistent_per_param}  # fmt: skip
    return recipes.FSDP2Measurement(
        param_dtype="bfloat16", reduce_dtype="float32", world_size=1, n_local=n,
        persistent={k: int(v * n) for k, v in parts.items()},
        dtypes={"parameters": ("float32",), "gradients": ("float32",),
                "optimizer_state": ("float32",), "other": ("float32",) if parts["other"] else ()},
        step_counters=40, gathered_params=500, gathered_grads=300, gathered_where="backward",
        unsharded_grad_dtypes=("bfloat16",))  # fmt: skip


def test_verdict_agrees_part_by_part_with_amp_bf16():
    c = recipes.compare_fsdp2(_measurement(), recipes.RECIPES["amp_bf16"])
    assert c.differing == [] and c.totals_agree
    assert c.sentence().startswith("FSDP2 holds what amp_bf16 predicts, part by part")


def test_verdict_same_total_other_parts_against_bf16_master():
    c = recipes.compare_fsdp2(_measurement(), recipes.RECIPES["bf16_master"])
    assert c.totals_agree and c.differing == ["parameters", "gradients", "other"]
    s = c.sentence()
    assert s.startswith("The totals agree") and "parameters 4.00 fp32 against 2 bf16" in s
    assert "other 0.00 against 4 fp32" in s


def test_verdict_names_an_extra_master_copy_and_the_total():
    c = recipes.compare_fsdp2(_measurement(other=4), recipes.RECIPES["amp_bf16"])
    assert not c.totals_agree and c.differing == ["other"]
    assert c.sentence() == ("FSDP2 holds 20.00 bytes per parameter where amp_bf16 predicts 16: "
                            "other 4.00 fp32 against 0.")  # fmt: skip
    # within the tolerance, a few bytes of bookkeeping are not a difference
    assert recipes.compare_fsdp2(_measurement(other=0.01), recipes.RECIPES["amp_bf16"]).differing == []


def test_verdict_sees_a_dtype_difference_at_equal_bytes():
    m = _measurement()
    m.dtypes["parameters"] = ("bfloat16",)  # 4 bytes of bf16 per parameter: two copies, say
    c = recipes.compare_fsdp2(m, recipes.RECIPES["amp_bf16"])
    assert c.differing == ["parameters"]


def test_compare_refuses_a_negative_tolerance():
    with pytest.raises(ValueError, match="tolerance"):
        recipes.compare_fsdp2(_measurement(), recipes.RECIPES["amp_bf16"], tolerance=-1)
