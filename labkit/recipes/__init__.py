"""Mixed-precision training recipes: what each keeps per parameter, predicted and measured.

A recipe says in which dtype each per-parameter tensor of training lives: the parameters the
model computes with, their gradients, an fp32 master copy the optimizer steps (or none), an
fp32 gradient buffer (or none), the optimizer's state, and whether ``torch.autocast`` runs the
matmuls in 16 bits. Two functions answer "how many bytes per parameter?":

* :func:`predicted_bytes_per_param`: arithmetic on the recipe (pure, no torch; it lives in
  :mod:`labkit.formulas` with the other predictions and is re-exported here);
* :func:`measure_recipe`: one real training step on a copy of a model, then the storage bytes
  of the real tensors, counted by category (each storage once). It builds the master copy, the
  buffer and the parameters' dtype from the recipe's fields, so its agreement with the
  prediction is a consistency check;
* :func:`measure_fsdp2` and :func:`compare_fsdp2`: the independent check, one real step of
  PyTorch's FSDP2 (``fully_shard`` with a ``MixedPrecisionPolicy``) on the CPU, every live
  tensor storage counted by what holds it, then held against a recipe part by part.

Persistent model states (they live from step to step) are one thing; tensors that exist only
during a step are another, and are counted apart:

* autocast's 16-bit copies of the matmul weights: made in the forward pass, saved by autograd
  for the backward pass, freed after it. Caught with ``torch.autograd.graph.saved_tensors_hooks``
  and recognised as copies because they equal a parameter cast to the autocast dtype.
  :func:`autocast_copy_bytes_per_param` predicts them per matmul-weight parameter.
* the fp32 gradients a master-copy recipe without a gradient buffer makes for the optimizer
  step (``main_param.grad = model_param.grad.float()``, as Megatron-LM's
  ``Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads`` does in
  megatron/core/optimizer/optimizer.py), freed after it.

By concern, one module each (what notebooks and tests use is re-exported here: ``recipes.<name>``)::

    recipe    the Recipe (a dtype per per-parameter tensor, validated) and RECIPES
    measured  one real step under a recipe, its tensors counted by category
    fsdp2     the independent check: FSDP2's MixedPrecisionPolicy, counted from what torch holds
    choosing  what a precision plan decides from (Situation), and a few real steps of the choice
    held      the dtypes an autocast step leaves, and its activations per dtype, predicted and measured

Recipes (:data:`RECIPES`) and where their counts come from:
    [Playbook]  Hugging Face, "The Ultra-Scale Playbook", memory section: fp32 AdamW
                4 + 4 + 8 = 16; bf16 with an fp32 gradient buffer 2 + 2 + 12 + 4 = 20.
    [ZeRO]      Rajbhandari et al. 2019, arXiv 1910.02054, section 3.1: mixed precision with
                Adam keeps 2Ψ + 2Ψ + KΨ bytes, K = 12 (fp32 master, momentum, variance).
    [ml-eng]    stas00/ml-engineering, training/performance/README.md, "Anatomy of Model's
                Memory Usage": mixed precision with AdamW 18 bytes per parameter = 6 for the
                weights ("a model in fp32 and one in fp16/bf16") + 8 AdamW + 4 fp32 gradients.
    [AMP]       PyTorch docs, "Automatic Mixed Precision package - torch.amp": autocast over
                float32 parameters; matmuls run in the low-precision dtype.
    [autocast]  pytorch/pytorch, aten/src/ATen/autocast_mode.h (``cached_cast``): within an
                autocast region, the cast of a float32 leaf that requires grad is cached, so
                each weight is copied once per forward however often it is used.
    [optim]     pytorch/pytorch, torch/optim/adamw.py and sgd.py: the state is created with
                ``zeros_like(param)`` / ``clone(grad)``, i.e. in the dtype of the tensor stepped.
    [FSDP2]     pytorch/pytorch 2.13, torch/distributed/fsdp/_fully_shard/: _fsdp_api.py
                (MixedPrecisionPolicy), _fsdp_init.py (_get_device_from_mesh: a CPU mesh runs on
                the CPU), _fsdp_param.py (all_gather_inputs cast to param_dtype),
                _fsdp_collectives.py (foreach_reduce casts the reduced gradient to orig_dtype).
"""

from __future__ import annotations

from labkit.formulas.state_bytes import predicted_breakdown, predicted_bytes_per_param
from labkit.recipes.choosing import (
    PLAN_CANDIDATES,
    Situation,
    train_recipe,
)
from labkit.recipes.fsdp2 import (
    FSDP2Measurement,
    compare_fsdp2,
    describe_fsdp2,
    measure_fsdp2,
)
from labkit.recipes.held import (
    AutocastActivations,
    autocast_activations,
    step_dtypes,
)
from labkit.recipes.measured import (
    RecipeMeasurement,
    describe_measured,
    measure_recipe,
    plot_measured,
)
from labkit.recipes.recipe import (
    PERSISTENT,
    RECIPES,
    Recipe,
    autocast_copy_bytes_per_param,
    matmul_weight_params,
)

__all__ = [
    "PERSISTENT",
    "PLAN_CANDIDATES",
    "RECIPES",
    "AutocastActivations",
    "FSDP2Measurement",
    "Recipe",
    "RecipeMeasurement",
    "Situation",
    "autocast_activations",
    "autocast_copy_bytes_per_param",
    "compare_fsdp2",
    "describe_fsdp2",
    "describe_measured",
    "matmul_weight_params",
    "measure_fsdp2",
    "measure_recipe",
    "plot_measured",
    "predicted_breakdown",
    "predicted_bytes_per_param",
    "step_dtypes",
    "train_recipe",
]
