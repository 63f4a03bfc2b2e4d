"""labkit.recipes: predicted bytes per parameter, and one real step measuring the same."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from labkit import config, formulas, recipes
from labkit.model import GPT

PREDICTED = {  # bytes per parameter of persistent model state, from the sources each cites
    "fp32_adamw": 16,  # Playbook: 4 + 4 + 8
    "amp_bf16": 16,  # fp32 everything; the bf16 weight copies are transient
    "bf16_master": 16,  # ZeRO: 2 + 2 + K, K = 12
    "bf16_master_fp32_grads": 20,  # Playbook: 2 + 2 + 12 + 4
    "pure_bf16": 8,  # 2 + 2 + 2 + 2
}


@pytest.fixture(scope="module")
def smoke_gpt():
    torch.manual_seed(0)
    return GPT(config.preset("smoke").model)


@pytest.fixture(scope="module")
def batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 256, (2, 16), generator=g),
             torch.randint(0, 256, (2, 16), generator=g)) for _ in range(2)]  # fmt: skip


def test_predicted_bytes_per_param_of_every_recipe():
    assert {
        n: recipes.predicted_bytes_per_param(r) for n, r in recipes.RECIPES.items()
    } == PREDICTED
    assert recipes.predicted_breakdown(recipes.RECIPES["bf16_master_fp32_grads"]) == {
        "parameters": 2, "gradients": 2, "master": 4, "grad_buffer": 4, "optimizer_state": 8}  # fmt: skip
    copies = {n: recipes.autocast_copy_bytes_per_param(r) for n, r in recipes.RECIPES.items()}
    assert copies == {"fp32_adamw": 0, "amp_bf16": 2, "bf16_master": 0,
                      "bf16_master_fp32_grads": 0, "pure_bf16": 0}  # fmt: skip


def test_the_predictions_agree_with_the_published_conventions():
    conv = formulas.bytes_per_param
    r = recipes.RECIPES
    assert recipes.predicted_bytes_per_param(r["fp32_adamw"]) == conv("fp32_adam")
    assert recipes.predicted_bytes_per_param(r["bf16_master"]) == conv("mixed_adam_zero")
    assert (recipes.predicted_bytes_per_param(r["bf16_master_fp32_grads"])
            == conv("mixed_adam_fp32_grad_accum"))  # fmt: skip
    # ml-engineering's 18: AMP's 16 plus the 16-bit weight copy
    amp = r["amp_bf16"]
    assert (recipes.predicted_bytes_per_param(amp) + recipes.autocast_copy_bytes_per_param(amp)
            == conv("ml_engineering"))  # fmt: skip
    # and formulas.memory_breakdown, the general formula, gives the same totals
    for recipe in r.values():
        mb = formulas.memory_breakdown(
            1, param_dtype=recipe.param_dtype, grad_dtype=recipe.grad_dtype,
            optimizer=recipe.optimizer, optimizer_state_dtype=recipe.state_dtype,
            master_weights_dtype=recipe.master_dtype)  # fmt: skip
        buffer = recipes.predicted_breakdown(recipe)["grad_buffer"]
        assert mb.total + buffer == recipes.predicted_bytes_per_param(recipe), recipe.name


@pytest.mark.parametrize("name", sorted(recipes.RECIPES))
def test_one_measured_step_equals_the_prediction_per_category(name, smoke_gpt, batches):
    recipe = recipes.RECIPES[name]
    m = recipes.measure_recipe(recipe, smoke_gpt, batches, "cpu")
    n = smoke_gpt.num_params()
    assert m.n_params == n
    predicted = recipes.predicted_breakdown(recipe)
    assert m.persistent == {k: v * n for k, v in predicted.items()}
    assert m.bytes_per_param == PREDICTED[name]
    # transient tensors, measured apart
    assert m.master_step_grads == (4 * n if name == "bf16_master" else 0)
    assert m.activations > 0


def test_autocast_weight_copies_are_counted_from_what_autograd_saves(smoke_gpt, batches):
    cfg = smoke_gpt.cfg
    h, L, V = cfg.d_model, cfg.n_layer, cfg.vocab_size
    matmul = L * 12 * h * h + V * h  # q, k, v, proj, fc, mlp proj per block; the tied head
    assert recipes.matmul_weight_params(smoke_gpt) == matmul
    amp = recipes.measure_recipe(recipes.RECIPES["amp_bf16"], smoke_gpt, batches)
    assert amp.autocast_copies == 2 * matmul  # one bf16 copy per weight, per forward
    assert amp.per_param()["autocast copies per matmul weight"] == 2.0
    assert 1.8 < amp.autocast_copies / amp.n_params < 2.0  # biases, LayerNorms, wpe: no copy
    fp32 = recipes.measure_recipe(recipes.RECIPES["fp32_adamw"], smoke_gpt, batches)
    assert fp32.autocast_copies == 0


def test_copies_are_measured_not_predicted():
    class RawMatmul(nn.Module):  # a weight that is no nn.Linear: the prediction knows nothing
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))
            self.emb = nn.Embedding(16, 8)

        def forward(self, x, y):
            h = self.emb(x) @ self.w  # autocast copies w for the matmul
            h = h @ self.w  # used twice: autocast's cast cache makes one copy
            return h, nn.functional.cross_entropy(h.flatten(0, 1).float(), y.flatten() % 8)

    model = RawMatmul()
    x = torch.randint(0, 16, (2, 4))
    m = recipes.measure_recipe(recipes.RECIPES["amp_bf16"], model, [(x, x)])
    assert recipes.matmul_weight_params(model) == 0
    assert m.autocast_copies == 8 * 8 * 2


def test_measuring_leaves_the_model_alone(smoke_gpt, batches):
    before = {k: v.clone() for k, v in smoke_gpt.state_dict().items()}
    recipes.measure_recipe(recipes.RECIPES["bf16_master"], smoke_gpt, batches)
    after = smoke_gpt.state_dict()
    assert all(torch.equal(before[k], after[k]) and after[k].dtype == torch.float32 for k in before)
    assert all(p.grad is None for p in smoke_gpt.parameters())


def test_measure_rejects_empty_batches(smoke_gpt):
    with pytest.raises(ValueError, match="batches is empty"):
        recipes.measure_recipe(recipes.RECIPES["fp32_adamw"], smoke_gpt, [])


def test_recipes_canonicalise_their_dtypes_and_fill_in_what_torch_makes():
    r = recipes.Recipe("x", param_dtype="bf16", master_dtype="fp32")
    assert (r.param_dtype, r.grad_dtype, r.master_dtype, r.state_dtype) == (
        "bfloat16", "bfloat16", "float32", "float32")  # fmt: skip
    assert recipes.Recipe("y", param_dtype=torch.float16).state_dtype == "float16"
    assert recipes.Recipe("z", autocast="bf16").autocast == "bfloat16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.param_dtype = "float32"
    assert hash(r) == hash(recipes.Recipe("x", param_dtype="bfloat16", master_dtype="float32"))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"param_dtype": "fp8"},
            r"param_dtype='fp8' is not allowed: use one of 'float32', "
            r"'bfloat16', 'float16'",
        ),
        ({"param_dtype": "int8"}, r"param_dtype='int8' is not allowed"),
        (
            {"optimizer": "adam"},
            r"optimizer='adam' is not allowed: use one of 'adamw', 'sgd', "
            r"'sgd_momentum'",
        ),
        (
            {"param_dtype": "bf16", "grad_dtype": "fp32"},
            r"autograd makes param\.grad in the "
            r"parameter's dtype.*grad_buffer_dtype",
        ),
        ({"master_dtype": "fp32"}, "the parameters already are float32"),
        (
            {"param_dtype": "bf16", "master_dtype": "bf16"},
            r"master_dtype='bf16' is not allowed: "
            r"use one of 'float32'",
        ),
        ({"param_dtype": "bf16", "grad_buffer_dtype": "fp32"}, "needs master_dtype='float32'"),
        (
            {"param_dtype": "bf16", "state_dtype": "fp32"},
            r"state like the tensor it steps.*"
            r"'bfloat16' \(the parameters\)",
        ),
        ({"param_dtype": "bf16", "autocast": "bf16"}, "autocast is for float32 parameters"),
        (
            {"autocast": "fp32"},
            r"autocast='fp32' is not allowed: use one of 'bfloat16', "
            r"'float16'",
        ),
        ({"name": " "}, "give the recipe a name"),
    ],
)
def test_a_recipe_that_cannot_be_is_refused_with_what_is_allowed(fields, message):
    with pytest.raises(ValueError, match=message):
        recipes.Recipe(**{"name": "r", **fields})
