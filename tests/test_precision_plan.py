"""labkit.recipes' plan inputs and runner: Recipe.loss_scaler, Situation, train_recipe, and
notebook 04's run_plan verdict (chosen by the measured bytes and losses)."""

from __future__ import annotations

import math

import pytest
import torch

from labkit import config, recipes
from labkit.course.exercises import mixed_precision as exmp
from labkit.model import GPT


@pytest.fixture(scope="module")
def smoke_gpt():
    torch.manual_seed(0)
    return GPT(config.preset("smoke").model)


@pytest.fixture(scope="module")
def batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 256, (2, 16), generator=g),
             torch.randint(0, 256, (2, 16), generator=g)) for _ in range(2)]  # fmt: skip


def test_loss_scaler_is_for_fp16_only_and_compute_dtype_is_what_the_matmuls_run_in():
    assert recipes.PLAN_CANDIDATES["amp_fp16"].loss_scaler
    assert not recipes.PLAN_CANDIDATES["amp_fp16_no_scaler"].loss_scaler
    with pytest.raises(ValueError, match="need none"):
        recipes.Recipe("x", autocast="bf16", loss_scaler=True)
    with pytest.raises(ValueError, match="True or False"):
        recipes.Recipe("x", autocast="fp16", loss_scaler=1)
    assert recipes.Recipe("f", param_dtype="fp16", master_dtype="fp32", loss_scaler=True).loss_scaler
    got = {n: (r.compute_dtype, r.steps_fp32_weights) for n, r in recipes.PLAN_CANDIDATES.items()}
    assert got == {"fp32_adamw": ("float32", True), "amp_bf16": ("bfloat16", True),
                   "bf16_master": ("bfloat16", True), "bf16_master_fp32_grads": ("bfloat16", True),
                   "pure_bf16": ("bfloat16", False), "amp_fp16_no_scaler": ("float16", True),
                   "amp_fp16": ("float16", True)}  # fmt: skip
    assert set(recipes.RECIPES.items()) <= set(recipes.PLAN_CANDIDATES.items())


def test_situation_refuses_what_a_plan_cannot_use():
    base = exmp.PLAN_CASES[0]
    fields = {"what": "x", "n_params": 10, "budget_bytes": 1e3, "autocast_dtypes": ("float16",),
              "step_s": {"float32": 1.0, "float16": 0.5},
              "activation_bytes": base.activation_bytes, "candidates": base.candidates}  # fmt: skip
    assert "not run" in recipes.Situation(**fields).table()  # bf16 rows: this device has none
    with pytest.raises(ValueError, match="no time for"):
        recipes.Situation(**{**fields, "step_s": {"float32": 1.0}})
    with pytest.raises(ValueError, match="activation_bytes has no entry"):
        recipes.Situation(**{**fields, "activation_bytes": {}})
    with pytest.raises(ValueError, match="16-bit dtypes only"):
        recipes.Situation(**{**fields, "autocast_dtypes": ("float32",)})


def test_train_recipe_trains_holds_what_the_plan_counts_at_most_and_leaves_the_model(
        smoke_gpt, batches):  # fmt: skip
    before = [p.detach().clone() for p in smoke_gpt.parameters()]
    runs = {n: recipes.train_recipe(recipes.PLAN_CANDIDATES[n], smoke_gpt, batches, steps=4,
                                    lr=1e-3)
            for n in ("fp32_adamw", "amp_bf16", "bf16_master_fp32_grads", "amp_fp16")}  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(before, smoke_gpt.parameters(), strict=True))
    n = sum(p.numel() for p in smoke_gpt.parameters())
    for name, r in runs.items():
        assert len(r.losses) == 4 and all(math.isfinite(v) for v in r.losses)
        assert r.losses[-1] < r.losses[0], name  # it trains
        m = recipes.measure_recipe(r.recipe, smoke_gpt, batches[:1])
        states = recipes.predicted_bytes_per_param(r.recipe) * n
        # at least the model states; at most states and activations counted as alive at once
        assert states <= r.peak_bytes <= states + m.activations + m.autocast_copies, name
    assert runs["amp_fp16"].skipped == 0 and runs["fp32_adamw"].cuda_peak_bytes is None
    # the same weights and batches: 16-bit recipes end close to fp32
    assert abs(runs["amp_bf16"].losses[-1] - runs["fp32_adamw"].losses[-1]) < 0.05
    with pytest.raises(ValueError, match="at least one"):
        recipes.train_recipe(recipes.RECIPES["fp32_adamw"], smoke_gpt, batches, steps=0)


def test_run_plan_says_whether_the_plan_held_from_the_measurements(smoke_gpt, batches, capsys):
    ms = {n: recipes.measure_recipe(r, smoke_gpt, batches[:1])
          for n, r in recipes.PLAN_CANDIDATES.items()}  # fmt: skip

    def situation(budget):
        return recipes.Situation(
            what="test", n_params=sum(p.numel() for p in smoke_gpt.parameters()),
            budget_bytes=budget, autocast_dtypes=("bfloat16", "float16"),
            step_s={"float32": 1.0, "bfloat16": 0.5, "float16": 0.6},
            activation_bytes={n: m.activations + m.autocast_copies for n, m in ms.items()},
            candidates=dict(recipes.PLAN_CANDIDATES))  # fmt: skip

    roomy = situation(1e9)
    said = exmp.run_plan("bf16_master", roomy, smoke_gpt, batches, device="cpu", steps=3,
                         lr=1e-3, tolerance=0.05)  # fmt: skip
    assert said.startswith("the plan held: 'bf16_master'") and "within the tolerance" in said
    assert "measured: bf16_master" in capsys.readouterr().out
    tight = situation(1e5)  # below what any recipe holds
    said = exmp.run_plan("bf16_master", tight, smoke_gpt, batches, device="cpu", steps=3,
                         lr=1e-3, tolerance=0.05)  # fmt: skip
    assert said.startswith("the plan did not hold") and "over the" in said
    said = exmp.run_plan("bf16_master", roomy, smoke_gpt, batches, device="cpu", steps=3,
                         lr=1e-3, tolerance=0.0)  # fmt: skip
    assert "beyond the tolerance" in said or "+0.0000" in said
    assert "nothing to run" in exmp.run_plan(None, roomy, smoke_gpt, batches, device="cpu",
                                             steps=3, lr=1e-3, tolerance=0.05)  # fmt: skip
