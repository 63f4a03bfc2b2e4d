"""A training recipe: in which dtype each per-parameter tensor lives (:class:`Recipe`, validated
when built) and the recipes the course compares (:data:`RECIPES`).

The recipe is the vocabulary every other module of :mod:`labkit.recipes` speaks; the bytes it
implies are closed forms in :mod:`labkit.formulas` (``predicted_breakdown``), and what a real
step holds is :mod:`labkit.recipes.measured`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from labkit.formulas import (
    dtype_bytes,
    dtype_name,
)

RECIPE_DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a recipe's tensors may have (canonical names; fp32/bf16/fp16 are accepted)."""

OPTIMIZERS = ("adamw", "sgd", "sgd_momentum")

PERSISTENT = ("parameters", "gradients", "master", "grad_buffer", "optimizer_state")
"""The categories of persistent model state, in the order tables show them."""


def recipe_dtype(field: str, value: object, allowed: tuple[str, ...] = RECIPE_DTYPES) -> str:
    try:
        name = dtype_name(value)
    except ValueError:
        name = None
    if name not in allowed:
        raise ValueError(
            f"{field}={value!r} is not allowed: use one of {', '.join(map(repr, allowed))} "
            "(or fp32, bf16, fp16)"
        )
    return name


@dataclass(frozen=True)
class Recipe:
    """Where each per-parameter tensor of one training recipe lives. Validated when built.

    Dtypes are given by name ("bf16" or "bfloat16") and stored canonical ("bfloat16").
    ``grad_dtype`` and ``state_dtype`` default to what PyTorch makes (the dtype of the
    parameter, and of the tensor the optimizer steps); a different value is refused, with why.
    """

    name: str
    param_dtype: str = "float32"
    """What the model's parameters are stored in (and the backward pass computes with)."""
    grad_dtype: str | None = None
    """``param.grad``: autograd makes it in the parameter's dtype."""
    master_dtype: str | None = None
    """A float32 master copy of the parameters that the optimizer steps, or None."""
    grad_buffer_dtype: str | None = None
    """A float32 buffer the 16-bit gradients are added into (Megatron-LM's ``main_grad``), which
    the master step reads; or None."""
    optimizer: str = "adamw"
    """"adamw" (two moments), "sgd_momentum" (one buffer) or "sgd" (no state)."""
    state_dtype: str | None = None
    """The optimizer's state tensors: the dtype of what it steps (master copy, else params)."""
    autocast: str | None = None
    """``torch.autocast`` dtype for the forward pass ("bfloat16", "float16"), or None."""
    description: str = ""
    source: str = ""
    loss_scaler: bool = False
    """Whether a dynamic loss scaler (``torch.amp.GradScaler``) multiplies the loss: what fp16
    needs; bf16 and fp32, with fp32's exponent range, need none (and are refused one)."""

    @property
    def compute_dtype(self) -> str:
        """The dtype the matmuls run in: the autocast dtype, else the parameters' dtype."""
        return self.autocast or self.param_dtype

    @property
    def steps_fp32_weights(self) -> bool:
        """True if the optimizer steps float32 weights (fp32 parameters, or an fp32 master copy):
        no update is lost to a 16-bit weight's spacing."""
        return self.param_dtype == "float32" or self.master_dtype == "float32"

    def __post_init__(self) -> None:
        def put(field: str, value: object) -> None:
            object.__setattr__(self, field, value)

        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"name={self.name!r} is not allowed: give the recipe a name")
        param = recipe_dtype("param_dtype", self.param_dtype)
        put("param_dtype", param)
        grad = param if self.grad_dtype is None else recipe_dtype("grad_dtype", self.grad_dtype)
        if grad != param:
            raise ValueError(
                f"grad_dtype={self.grad_dtype!r} with param_dtype={param!r} is not allowed: "
                "autograd makes param.grad in the parameter's dtype (torch refuses a .grad of "
                "another dtype); a float32 gradient for 16-bit parameters is a separate buffer: "
                "set grad_buffer_dtype='float32' (with a master copy)"
            )
        put("grad_dtype", grad)
        if self.master_dtype is not None:
            put("master_dtype", recipe_dtype("master_dtype", self.master_dtype, ("float32",)))
            if param == "float32":
                raise ValueError(
                    "master_dtype='float32' with param_dtype='float32' is not allowed: the "
                    "parameters already are float32; a master copy is for 16-bit parameters"
                )
        if self.grad_buffer_dtype is not None:
            put("grad_buffer_dtype",
                recipe_dtype("grad_buffer_dtype", self.grad_buffer_dtype, ("float32",)))  # fmt: skip
            if self.master_dtype is None:
                raise ValueError(
                    "grad_buffer_dtype needs master_dtype='float32': the float32 gradient "
                    "buffer is what the optimizer's step on the master copy reads"
                )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r} is not allowed: use one of "
                             f"{', '.join(map(repr, OPTIMIZERS))}")  # fmt: skip
        stepped = self.master_dtype or param
        state = stepped if self.state_dtype is None else recipe_dtype("state_dtype", self.state_dtype)
        if state != stepped:
            raise ValueError(
                f"state_dtype={self.state_dtype!r} is not allowed here: torch.optim creates its "
                f"state like the tensor it steps (zeros_like), here {stepped!r} (the "
                f"{'master copy' if self.master_dtype else 'parameters'}); leave state_dtype "
                "out or give that dtype"
            )
        put("state_dtype", state)
        if self.autocast is not None:
            put("autocast", recipe_dtype("autocast", self.autocast, ("bfloat16", "float16")))
            if param != "float32":
                raise ValueError(
                    f"autocast={self.autocast!r} with param_dtype={param!r} is not allowed: "
                    "autocast is for float32 parameters (PyTorch AMP); 16-bit parameters "
                    "already compute in 16 bits, so leave autocast=None"
                )
        if not isinstance(self.loss_scaler, bool):
            raise ValueError(f"loss_scaler={self.loss_scaler!r} is not allowed: True or False")
        if self.loss_scaler and (self.autocast or param) != "float16":
            raise ValueError(
                f"loss_scaler=True with compute dtype {self.autocast or param!r} is not allowed: "
                "a loss scaler lifts gradients out of fp16's narrow range; bf16 and fp32 have "
                "fp32's 8 exponent bits and need none"
            )


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "fp32_adamw",
            description="everything in fp32: parameters, gradients, AdamW's two moments",
            source="Playbook, memory section: 4 + 4 + 8 = 16 bytes per parameter",
        ),
        Recipe(
            "amp_bf16",
            autocast="bfloat16",
            description="PyTorch AMP: fp32 parameters, gradients and AdamW state; autocast runs "
            "the matmuls in bf16 on 16-bit weight copies kept from forward to backward",
            source="PyTorch AMP docs (torch.autocast); the 2 bytes of the weight copy are what "
            "stas00/ml-engineering's 18 (= 6 + 8 + 4) counts beyond 16",
        ),
        Recipe(
            "bf16_master",
            param_dtype="bfloat16",
            master_dtype="float32",
            description="Megatron/ZeRO style: bf16 parameters and gradients, AdamW steps an "
            "fp32 master copy with fp32 moments, then copies it back to the bf16 parameters",
            source="ZeRO (arXiv 1910.02054) section 3.1: 2Ψ + 2Ψ + KΨ, K = 12",
        ),
        Recipe(
            "bf16_master_fp32_grads",
            param_dtype="bfloat16",
            master_dtype="float32",
            grad_buffer_dtype="float32",
            description="as bf16_master, and each bf16 gradient is added into an fp32 buffer "
            "(accumulation over micro-batches in fp32) that the master step reads",
            source="Playbook, memory section: 2 + 2 + 12 + 4 = 20 bytes per parameter",
        ),
        Recipe(
            "pure_bf16",
            param_dtype="bfloat16",
            description="everything in bf16, no master copy: AdamW's moments are bf16 too; an "
            "update smaller than half a bf16 spacing (eps 2**-7) of its weight is lost",
            source="torch/optim/adamw.py: the moments are zeros_like(param); 2 + 2 + 4 = 8",
        ),
    )
}
"""The course's recipes, by name."""


def autocast_copy_bytes_per_param(recipe: Recipe) -> int:
    """Bytes of autocast's 16-bit weight copy per parameter of a *matmul weight* (an
    ``nn.Linear`` weight, a tied output head included), kept from forward to backward.

    Transient: not a model state. Biases and LayerNorm parameters are cast too where a matmul
    uses them, but autograd does not save them; an embedding table used only for lookups is not
    cast. So over a whole model this is a little less than the 2 that [ml-eng] counts.
    """
    return dtype_bytes(recipe.autocast) if recipe.autocast else 0


def matmul_weight_params(model: nn.Module) -> int:
    """Parameters of ``model`` that are ``nn.Linear`` weights (a tied tensor counted once)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear):
            seen[id(module.weight)] = module.weight.numel()
    return sum(seen.values())
