"""Mixed-precision training recipes: what each keeps per parameter, predicted and measured.

A recipe says in which dtype each per-parameter tensor of training lives: the parameters the
model computes with, their gradients, an fp32 master copy the optimizer steps (or none), an
fp32 gradient buffer (or none), the optimizer's state, and whether ``torch.autocast`` runs the
matmuls in 16 bits. Two functions answer "how many bytes per parameter?":

* :func:`predicted_bytes_per_param`: arithmetic on the recipe (pure, no torch);
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

import copy
import gc
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from labkit.formulas import OPTIMIZER_STATES, dtype_bytes, dtype_name
from labkit.memory import optimizer_state_tensors, storage_bytes
from labkit.precision import checked_autocast
from labkit.train import DTYPES, Batch

RECIPE_DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a recipe's tensors may have (canonical names; fp32/bf16/fp16 are accepted)."""

OPTIMIZERS = ("adamw", "sgd", "sgd_momentum")

PERSISTENT = ("parameters", "gradients", "master", "grad_buffer", "optimizer_state")
"""The categories of persistent model state, in the order tables show them."""


def _dtype(field: str, value: object, allowed: tuple[str, ...] = RECIPE_DTYPES) -> str:
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
        param = _dtype("param_dtype", self.param_dtype)
        put("param_dtype", param)
        grad = param if self.grad_dtype is None else _dtype("grad_dtype", self.grad_dtype)
        if grad != param:
            raise ValueError(
                f"grad_dtype={self.grad_dtype!r} with param_dtype={param!r} is not allowed: "
                "autograd makes param.grad in the parameter's dtype (torch refuses a .grad of "
                "another dtype); a float32 gradient for 16-bit parameters is a separate buffer: "
                "set grad_buffer_dtype='float32' (with a master copy)"
            )
        put("grad_dtype", grad)
        if self.master_dtype is not None:
            put("master_dtype", _dtype("master_dtype", self.master_dtype, ("float32",)))
            if param == "float32":
                raise ValueError(
                    "master_dtype='float32' with param_dtype='float32' is not allowed: the "
                    "parameters already are float32; a master copy is for 16-bit parameters"
                )
        if self.grad_buffer_dtype is not None:
            put("grad_buffer_dtype",
                _dtype("grad_buffer_dtype", self.grad_buffer_dtype, ("float32",)))  # fmt: skip
            if self.master_dtype is None:
                raise ValueError(
                    "grad_buffer_dtype needs master_dtype='float32': the float32 gradient "
                    "buffer is what the optimizer's step on the master copy reads"
                )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r} is not allowed: use one of "
                             f"{', '.join(map(repr, OPTIMIZERS))}")  # fmt: skip
        stepped = self.master_dtype or param
        state = stepped if self.state_dtype is None else _dtype("state_dtype", self.state_dtype)
        if state != stepped:
            raise ValueError(
                f"state_dtype={self.state_dtype!r} is not allowed here: torch.optim creates its "
                f"state like the tensor it steps (zeros_like), here {stepped!r} (the "
                f"{'master copy' if self.master_dtype else 'parameters'}); leave state_dtype "
                "out or give that dtype"
            )
        put("state_dtype", state)
        if self.autocast is not None:
            put("autocast", _dtype("autocast", self.autocast, ("bfloat16", "float16")))
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


# ----------------------------------------------------------------------------------------------
# Predicted


def predicted_breakdown(recipe: Recipe) -> dict[str, int]:
    """Bytes per parameter of each persistent category (:data:`PERSISTENT`) of ``recipe``."""
    return {
        "parameters": dtype_bytes(recipe.param_dtype),
        "gradients": dtype_bytes(recipe.grad_dtype),
        "master": dtype_bytes(recipe.master_dtype) if recipe.master_dtype else 0,
        "grad_buffer": dtype_bytes(recipe.grad_buffer_dtype) if recipe.grad_buffer_dtype else 0,
        "optimizer_state": OPTIMIZER_STATES[recipe.optimizer] * dtype_bytes(recipe.state_dtype),
    }


def predicted_bytes_per_param(recipe: Recipe) -> int:
    """Persistent model-state bytes per parameter: parameters + gradients + master copy +
    gradient buffer + optimizer state. Activations and step-transient tensors are not counted."""
    return sum(predicted_breakdown(recipe).values())


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


# ----------------------------------------------------------------------------------------------
# Measured


@dataclass(frozen=True)
class RecipeMeasurement:
    """Bytes of every tensor category of one real training step under a recipe."""

    recipe: Recipe
    n_params: int
    matmul_weight_params: int
    parameters: int
    gradients: int
    """``param.grad`` right after the last backward (where a buffer exists, just before being
    added into it: the moment both exist)."""
    master: int
    grad_buffer: int
    optimizer_state: int
    """State tensors after the step (the scalar ``step`` counters are left out)."""
    autocast_copies: int
    """Transient: saved-for-backward tensors equal to a parameter cast to the autocast dtype."""
    master_step_grads: int
    """Transient: the fp32 ``.grad`` tensors made for the master step without a buffer."""
    activations: int
    """Transient: every other tensor autograd saved for backward (largest micro-batch)."""
    device: str

    @property
    def persistent(self) -> dict[str, int]:
        """Bytes of each persistent category, in :data:`PERSISTENT` order."""
        return {k: getattr(self, k) for k in PERSISTENT}

    @property
    def bytes_per_param(self) -> float:
        """Persistent model-state bytes per parameter."""
        return sum(self.persistent.values()) / self.n_params

    def per_param(self) -> dict[str, float]:
        """Bytes per parameter of each persistent category, then the transient ones: autocast
        copies per *matmul-weight* parameter, the rest per parameter."""
        out = {k: v / self.n_params for k, v in self.persistent.items()}
        out["total (persistent)"] = self.bytes_per_param
        out["autocast copies per matmul weight"] = (
            self.autocast_copies / self.matmul_weight_params if self.matmul_weight_params else 0.0
        )
        out["master-step fp32 grads (transient)"] = self.master_step_grads / self.n_params
        return out

    def as_row(self) -> dict[str, object]:
        """One table row: recipe name, predicted and measured bytes per parameter."""
        return {"recipe": self.recipe.name,
                "predicted": predicted_bytes_per_param(self.recipe),
                **{k: round(v, 3) for k, v in self.per_param().items()}}  # fmt: skip


def _split_saved(saved: list[torch.Tensor], params: list[torch.Tensor],
                 autocast: str | None) -> tuple[int, int]:  # fmt: skip
    """(bytes of autocast weight copies, bytes of other saved tensors), each storage once.

    A saved tensor is a weight copy when it equals a parameter cast to the autocast dtype (as
    saved for a matmul's backward it is often the transposed view ``w.t()``). Saved tensors that
    are parameters themselves cost nothing extra and are skipped.
    """
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    low = DTYPES[autocast] if autocast else None
    casts: dict[int, list[torch.Tensor]] = {}  # numel -> params cast to the autocast dtype
    if low is not None:
        for p in params:
            casts.setdefault(p.numel(), []).append(p.detach().to(low))
    copies: dict[int, int] = {}
    others: dict[int, int] = {}
    for t in saved:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in param_ptrs or ptr in copies or ptr in others:
            continue
        views = (t, t.t()) if t.dim() == 2 else (t,)
        is_copy = t.dtype == low and any(
            v.shape == c.shape and torch.equal(v, c)
            for c in casts.get(t.numel(), ())
            for v in views
        )
        (copies if is_copy else others)[ptr] = storage.nbytes()
    return sum(copies.values()), sum(others.values())


def _make_optimizer(name: str, tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(tensors, lr=1e-3)
    return torch.optim.SGD(tensors, lr=1e-3, momentum=0.9 if name == "sgd_momentum" else 0.0)


def measure_recipe(
    recipe: Recipe,
    model: nn.Module,
    batches: Sequence[Batch],
    device: str | torch.device = "cpu",
) -> RecipeMeasurement:
    """Run ONE real training step of ``recipe`` on a copy of ``model`` and count the bytes.

    The step: the copy is cast to ``param_dtype``; a forward and backward pass per micro-batch
    in ``batches`` (under autocast where the recipe has it; each loss divided by their number);
    with a gradient buffer, each micro-batch's 16-bit gradients are added into it; the optimizer
    steps the master copy (its ``.grad`` is the buffer, or the gradients cast to fp32) or else
    the parameters; the master copy is copied back into the parameters. ``model`` itself is
    left as it was. No loss scaling: it changes no memory.

    Every number is read from the real tensors (``untyped_storage().nbytes()``, each storage
    once), none is filled in from :func:`predicted_breakdown`.
    """
    if not batches:
        raise ValueError("batches is empty: pass one (x, y) pair per micro-batch")
    device = torch.device(device)
    model = copy.deepcopy(model).to(device=device, dtype=DTYPES[recipe.param_dtype]).train()
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no parameter that requires grad: nothing to train")
    master = [p.detach().to(DTYPES[recipe.master_dtype]).requires_grad_()
              for p in params] if recipe.master_dtype else []  # fmt: skip
    buffers = [torch.zeros_like(m) for m in master] if recipe.grad_buffer_dtype else []
    optimizer = _make_optimizer(recipe.optimizer, master or params)

    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)  # only looked at (and let go) before this micro-batch's backward
        return t

    copies = activations = gradients = 0
    for x, y in batches:
        context = checked_autocast(device.type, recipe.autocast or "fp32")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context:
            _, loss = model(x.to(device), y.to(device))
        c, a = _split_saved(saved, params, recipe.autocast)
        copies, activations = max(copies, c), max(activations, a)
        saved.clear()
        (loss / len(batches)).backward()
        gradients = max(gradients, storage_bytes(p.grad for p in params))
        if buffers:
            for b, p in zip(buffers, params, strict=True):
                b.add_(p.grad)  # fp32 accumulation of the 16-bit gradient
                p.grad = None
    master_step_grads = 0
    if master:
        for m, p, b in zip(master, params, buffers or [None] * len(master), strict=True):
            m.grad = b if b is not None else p.grad.to(m.dtype)
        if not buffers:
            master_step_grads = storage_bytes(m.grad for m in master)
    optimizer.step()
    if master:
        with torch.no_grad():
            for p, m in zip(params, master, strict=True):
                p.copy_(m)  # the updated master, rounded back into the 16-bit parameters
    return RecipeMeasurement(
        recipe=recipe,
        n_params=sum(p.numel() for p in params),
        matmul_weight_params=matmul_weight_params(model),
        parameters=storage_bytes(params),
        gradients=gradients,
        master=storage_bytes(master),
        grad_buffer=storage_bytes(buffers),
        optimizer_state=storage_bytes(optimizer_state_tensors(optimizer)),
        autocast_copies=copies,
        master_step_grads=master_step_grads,
        activations=activations,
        device=str(device),
    )


# ----------------------------------------------------------------------------------------------
# An independent implementation: FSDP2's MixedPrecisionPolicy, counted from what torch holds

FSDP2_PARTS = ("parameters", "gradients", "optimizer_state", "other")
"""What :func:`measure_fsdp2` counts after the step: the sharded parameters the optimizer steps,
their gradients, the optimizer's state, and every other tensor storage that appeared during the
run and is still alive (a master copy or a buffer FSDP2 kept would land there)."""


def _live_storages() -> dict[int, tuple[torch.UntypedStorage, torch.dtype]]:
    """Every tensor storage that Python's garbage collector can see, by address (bytes > 0),
    with the dtype of the first tensor seen on it.

    ``gc.get_objects`` lists every object the collector tracks, and tensors are tracked; a
    DTensor is skipped (its local tensor is an object of its own and is counted instead), and
    so is a tensor whose storage cannot be read (a FakeTensor that torch.compile left alive).
    """
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    from torch.distributed.tensor import DTensor

    unreal = (DTensor, FakeTensor, FunctionalTensor)  # no storage of their own to count
    found: dict[int, tuple[torch.UntypedStorage, torch.dtype]] = {}
    counted: dict[type, bool] = {}  # per type, not per object: the walk sees ~10^5 objects
    for o in gc.get_objects():
        kind = type(o)  # type(), not isinstance: some torch objects warn when asked __class__
        take = counted.get(kind)
        if take is None:
            take = counted[kind] = issubclass(kind, torch.Tensor) and not issubclass(kind, unreal)
        if not take or o.is_meta or o.is_sparse or o.is_nested:
            continue
        try:
            storage = o.untyped_storage()
            if storage.nbytes():
                found.setdefault(storage.data_ptr(), (storage, o.dtype))
        except (RuntimeError, NotImplementedError):
            # a tensor with no real storage behind it (a FakeTensor left by torch.compile in
            # this process, a wrapper subclass): it holds no memory to count
            continue
    return found


def _torch_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _reachable_tensors(roots: Sequence[object]) -> list[tuple[torch.Tensor, bool]]:
    """The tensors reachable from ``roots`` through Python references (``gc.get_referents``):
    attributes, containers, bound methods and partials; not through functions, classes or
    modules (whose globals reach everything). A tensor's ``.grad`` and a DTensor's local tensor
    are followed too. Each comes with whether it was reached as the ``.grad`` of a plain
    (unsharded) tensor."""
    import types

    from torch.distributed.tensor import DTensor

    opaque = (types.FunctionType, types.BuiltinFunctionType, types.ModuleType, types.CodeType,
              types.FrameType, type, str, bytes, int, float)  # fmt: skip
    seen: set[int] = set()
    tensors: list[tuple[torch.Tensor, bool]] = []
    stack: list[tuple[object, bool]] = [(r, False) for r in roots]
    while stack:
        o, is_grad = stack.pop()
        if id(o) in seen or isinstance(o, opaque):
            continue
        seen.add(id(o))
        if issubclass(type(o), torch.Tensor):
            sharded = issubclass(type(o), DTensor)
            if sharded:
                stack.append((o._local_tensor, is_grad))
            else:
                tensors.append((o, is_grad))
            if o.grad is not None:
                stack.append((o.grad, not sharded))
        stack.extend((r, False) for r in gc.get_referents(o))
    return tensors


@dataclass(frozen=True)
class FSDP2Measurement:
    """One real training step under FSDP2 (``fully_shard`` with a ``MixedPrecisionPolicy``),
    counted from the tensors torch holds, not from a :class:`Recipe`."""

    param_dtype: str
    reduce_dtype: str
    world_size: int
    n_local: int
    """Elements of this rank's shards of the parameters (all of them at world size 1)."""
    persistent: dict[str, int]
    """Bytes alive on this rank after the step, by :data:`FSDP2_PARTS`."""
    dtypes: dict[str, tuple[str, ...]]
    """The dtypes seen in each part."""
    step_counters: int
    """Bytes of the optimizer's scalar step counters (per tensor, not per parameter)."""
    gathered_params: int
    """At the moment of the step when the model held the most ``param_dtype`` bytes (forward or
    backward, looked at between units): the bytes of the unsharded parameters FSDP2 had
    all-gathered, its transient 16-bit copies."""
    gathered_grads: int
    """At that moment, the bytes of the gradients autograd had made on those unsharded
    parameters and FSDP2 had not yet reduce-scattered."""
    gathered_where: str
    """Where in the step that moment was."""
    unsharded_grad_dtypes: tuple[str, ...]
    """The dtypes of the gradients autograd left on the unsharded parameters in the backward."""

    @property
    def bytes_per_param(self) -> float:
        """Persistent bytes per parameter of this rank's shard (step counters excluded)."""
        return sum(self.persistent.values()) / self.n_local

    def per_param(self) -> dict[str, float]:
        """Bytes per parameter of each part, then the transient peak."""
        out = {k: v / self.n_local for k, v in self.persistent.items()}
        out["total (persistent)"] = self.bytes_per_param
        out[f"{self.param_dtype} gathered params at peak (transient)"] = (
            self.gathered_params / self.n_local
        )
        out["their gradients at peak (transient)"] = self.gathered_grads / self.n_local
        return out


def measure_fsdp2(
    model: nn.Module,
    batches: Sequence[Batch],
    *,
    param_dtype: str = "bfloat16",
    reduce_dtype: str = "float32",
    units: Sequence[str] = ("blocks",),
) -> FSDP2Measurement:
    """Train a copy of ``model`` for ONE real step with FSDP2 on the CPU and count what it holds.

    The copy's submodules in each ``ModuleList`` attribute named in ``units`` (a GPT's blocks)
    and then the copy itself get ``fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype,
    reduce_dtype))``, as the FSDP2 tutorial wraps a transformer; AdamW steps the sharded
    parameters; one forward and backward per micro-batch in ``batches``. Runs in the current
    process group if there is one (gloo, CPU tensors), else in a one-rank gloo group made for
    this call and destroyed after it.

    Nothing here comes from a recipe. After the step, every tensor storage alive that was not
    alive before the copy was made (``gc.get_objects``, each storage once) is counted, and put in
    :data:`FSDP2_PARTS` by which object holds it: the model's parameters (their local shards),
    those parameters' ``.grad``, the optimizer's state, or none of these ("other"). During the
    forward (before each unit) and the backward (when each unit's input gradient is ready), the
    tensors of ``param_dtype`` reachable from the model are added up (:func:`_reachable_tensors`).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    if not batches:
        raise ValueError("batches is empty: pass one (x, y) pair per micro-batch")
    low, reduce = DTYPES[_dtype("param_dtype", param_dtype)], \
        DTYPES[_dtype("reduce_dtype", reduce_dtype)]  # fmt: skip
    own_group = not dist.is_initialized()
    before = _live_storages()  # held until the count: no address is reused meanwhile
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        world = dist.get_world_size()
        mesh = init_device_mesh("cpu", (world,))
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=reduce)
        model = copy.deepcopy(model).to(device="cpu", dtype=torch.float32).train()
        wrapped: list[nn.Module] = []
        for name in units:
            for unit in getattr(model, name):
                fully_shard(unit, mesh=mesh, mp_policy=policy)
                wrapped.append(unit)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        peak: list = [0, 0, "before any unit"]
        grad_dtypes: set[str] = set()

        def look(where: str) -> None:
            held = _reachable_tensors([model])
            grad_dtypes.update(_torch_name(t.dtype) for t, is_grad in held if is_grad)
            params_b = storage_bytes(t for t, is_grad in held if t.dtype == low and not is_grad)
            grads_b = storage_bytes(t for t, is_grad in held if t.dtype == low and is_grad)
            if params_b + grads_b > sum(peak[:2]):
                peak[:] = [params_b, grads_b, where]

        def pre_forward(i: int):
            def hook(module: nn.Module, args: tuple) -> None:
                look(f"forward, entering unit {i}")
                if args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                    args[0].register_hook(lambda g: look(f"backward, unit {i} done"))

            return hook

        handles = [u.register_forward_pre_hook(pre_forward(i)) for i, u in enumerate(wrapped)]
        for x, y in batches:
            _, loss = model(x, y)
            (loss / len(batches)).backward()
            del loss, _
        for h in handles:
            h.remove()
        optimizer.step()

        params = list(model.parameters())
        local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        grads = [g.to_local() if isinstance(g, DTensor) else g
                 for g in (p.grad for p in params) if g is not None]  # fmt: skip
        states = [v.to_local() if isinstance(v, DTensor) else v
                  for s in optimizer.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor)]  # fmt: skip
        owner: dict[int, str] = {}
        for part, tensors in (("parameters", local), ("gradients", grads),
                              ("optimizer_state", [t for t in states if t.dim() > 0])):  # fmt: skip
            for t in tensors:
                owner.setdefault(t.untyped_storage().data_ptr(), part)
        counters = {t.untyped_storage().data_ptr() for t in states if t.dim() == 0}
        persistent = dict.fromkeys(FSDP2_PARTS, 0)
        dtypes: dict[str, set[str]] = {part: set() for part in FSDP2_PARTS}
        step_counters = 0
        for ptr, (storage, dtype) in _live_storages().items():
            if ptr in before:
                continue
            if ptr in counters:
                step_counters += storage.nbytes()
                continue
            part = owner.get(ptr, "other")
            persistent[part] += storage.nbytes()
            dtypes[part].add(dtype)
        return FSDP2Measurement(
            param_dtype=dtype_name(low), reduce_dtype=dtype_name(reduce), world_size=world,
            n_local=sum(t.numel() for t in local), persistent=persistent,
            dtypes={k: tuple(sorted(map(_torch_name, v))) for k, v in dtypes.items()},
            step_counters=step_counters, gathered_params=peak[0], gathered_grads=peak[1],
            gathered_where=peak[2],
            unsharded_grad_dtypes=tuple(sorted(grad_dtypes)))  # fmt: skip
    finally:
        del before
        if own_group:
            dist.destroy_process_group()


@dataclass(frozen=True)
class FSDP2Comparison:
    """An FSDP2 measurement held against one recipe's prediction, part by part.

    The recipe's master copy and gradient buffer are compared with the measurement's "other"
    (FSDP2 keeps neither as such: a copy it kept would be counted there). A part agrees when its
    bytes per parameter are within ``tolerance`` and, where it holds bytes, its dtypes are the
    recipe's.
    """

    recipe: Recipe
    measured: dict[str, float]
    """Bytes per parameter by :data:`FSDP2_PARTS`."""
    measured_dtypes: dict[str, tuple[str, ...]]
    predicted: dict[str, float]
    """The recipe's bytes per parameter by :data:`FSDP2_PARTS` ("other": master + buffer)."""
    predicted_dtypes: dict[str, tuple[str, ...]]
    tolerance: float

    @property
    def differing(self) -> list[str]:
        """The parts whose bytes or dtypes differ."""
        out = []
        for part in FSDP2_PARTS:
            m, p = self.measured[part], self.predicted[part]
            dtypes_differ = m > self.tolerance and p > 0 and \
                set(self.measured_dtypes[part]) != set(self.predicted_dtypes[part])  # fmt: skip
            if abs(m - p) > self.tolerance or dtypes_differ:
                out.append(part)
        return out

    @property
    def totals_agree(self) -> bool:
        return abs(sum(self.measured.values()) - sum(self.predicted.values())) <= self.tolerance

    def _part(self, part: str) -> str:
        def dt(names: tuple[str, ...]) -> str:
            return "/".join(_SHORT.get(n, n) for n in names) or "none"

        m, p = self.measured[part], self.predicted[part]
        held = f"{m:.2f}" + (f" {dt(self.measured_dtypes[part])}" if m > self.tolerance else "")
        want = f"{p:g}" + (f" {dt(self.predicted_dtypes[part])}" if p else "")
        return f"{part} {held} against {want}"

    def sentence(self) -> str:
        """The verdict, chosen by the comparison."""
        m, p = sum(self.measured.values()), sum(self.predicted.values())
        name = self.recipe.name
        if not self.differing:
            return (
                f"FSDP2 holds what {name} predicts, part by part: {m:.2f} bytes per parameter "
                f"against {p:g}, every part within {self.tolerance:g} B and in the "
                "predicted dtype."
            )
        parts = "; ".join(self._part(k) for k in self.differing)
        if self.totals_agree:
            return (
                f"The totals agree ({m:.2f} against {name}'s {p:g} bytes per parameter), "
                f"the parts do not: {parts}."
            )
        return f"FSDP2 holds {m:.2f} bytes per parameter where {name} predicts {p:g}: {parts}."


_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def compare_fsdp2(measurement: FSDP2Measurement, recipe: Recipe, *,
                  tolerance: float = 0.05) -> FSDP2Comparison:  # fmt: skip
    """Hold ``measurement`` against ``recipe``'s predicted bytes per parameter, part by part.

    ``tolerance`` (bytes per parameter) absorbs the few small tensors a process group and a
    device mesh allocate ("other"); every other part is an exact count.
    """
    if tolerance < 0:
        raise ValueError(f"tolerance={tolerance!r} is not allowed: give bytes per parameter >= 0")
    b = predicted_breakdown(recipe)
    predicted = {"parameters": b["parameters"], "gradients": b["gradients"],
                 "optimizer_state": b["optimizer_state"],
                 "other": b["master"] + b["grad_buffer"]}  # fmt: skip
    extra = tuple(sorted({d for d in (recipe.master_dtype, recipe.grad_buffer_dtype) if d}))
    predicted_dtypes = {"parameters": (recipe.param_dtype,), "gradients": (recipe.grad_dtype,),
                        "optimizer_state": (recipe.state_dtype,) if b["optimizer_state"] else (),
                        "other": extra}  # fmt: skip
    measured = {k: v / measurement.n_local for k, v in measurement.persistent.items()}
    return FSDP2Comparison(recipe=recipe, measured=measured,
                           measured_dtypes=dict(measurement.dtypes), predicted=predicted,
                           predicted_dtypes=predicted_dtypes, tolerance=tolerance)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Choosing a recipe: what a plan decides from, and a few real steps to check it


PLAN_CANDIDATES: dict[str, Recipe] = {
    **RECIPES,
    "amp_fp16_no_scaler": Recipe(
        "amp_fp16_no_scaler", autocast="float16",
        description="PyTorch AMP in fp16, without a loss scaler",
        source="PyTorch AMP docs: fp16 autocast is meant to be used with GradScaler"),
    "amp_fp16": Recipe(
        "amp_fp16", autocast="float16", loss_scaler=True,
        description="PyTorch AMP in fp16 with a GradScaler (dynamic loss scaling)",
        source="PyTorch AMP docs, 'Automatic Mixed Precision examples'"),
}  # fmt: skip
"""The recipes a precision plan chooses among: :data:`RECIPES` and the two fp16 AMP variants."""


@dataclass(frozen=True)
class Situation:
    """What a precision plan decides from: one model on one device, and what was measured.

    A recipe *fits* when its model states (bytes per parameter × ``n_params``) and its
    activations (``activation_bytes``) together are at most ``budget_bytes``. Speed is that of
    the recipe's compute dtype (``step_s[recipe.compute_dtype]``): the step timed per precision.
    """

    what: str
    """Which model on which device, and where the numbers come from (measured or constructed)."""
    n_params: int
    budget_bytes: float
    """The memory the training step may fill."""
    autocast_dtypes: tuple[str, ...]
    """The 16-bit dtypes this device computes in ("bfloat16", "float16"); float32 always runs."""
    step_s: dict[str, float]
    """Seconds of one training step by compute dtype; only dtypes the device runs."""
    activation_bytes: dict[str, float]
    """Recipe name -> bytes autograd keeps for the backward at the micro-batch (autocast's
    16-bit weight copies included)."""
    candidates: dict[str, Recipe]
    """The recipes to choose among, by name."""

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("candidates is empty: give the recipes to choose among")
        missing = [n for n in self.candidates if n not in self.activation_bytes]
        if missing:
            raise ValueError(f"activation_bytes has no entry for {missing}")
        bad = [d for d in self.autocast_dtypes if d not in ("bfloat16", "float16")]
        if bad or "float32" not in self.step_s:
            raise ValueError(f"autocast_dtypes={self.autocast_dtypes!r}, step_s keys "
                             f"{sorted(self.step_s)}: 16-bit dtypes only, and float32 timed")  # fmt: skip
        untimed = [d for d in self.autocast_dtypes if d not in self.step_s]
        if untimed:
            raise ValueError(f"step_s has no time for {untimed}, which the device runs")

    def table(self) -> str:
        """The candidates as the plan sees them (no verdict: that is the plan's job)."""
        lines = [f"{self.what}: {self.n_params:,} parameters, budget {self.budget_bytes / 2**20:,.2f} "
                 f"MiB; 16-bit dtypes this device runs: {', '.join(self.autocast_dtypes) or 'none'}",
                 f"  {'recipe':<24}{'compute':<10}{'scaler':<8}{'fp32 weights':<14}"
                 f"{'activations':>14}{'step':>10}"]  # fmt: skip
        for name, r in self.candidates.items():
            s = self.step_s.get(r.compute_dtype)
            lines.append(f"  {name:<24}{r.compute_dtype:<10}{'yes' if r.loss_scaler else 'no':<8}"
                         f"{'yes' if r.steps_fp32_weights else 'no':<14}"
                         f"{self.activation_bytes[name] / 2**20:>10.2f} MiB"
                         f"{'not run' if s is None else f'{s * 1e3:.1f} ms':>10}")  # fmt: skip
        return "\n".join(lines)


@dataclass(frozen=True)
class RecipeRun:
    """A few real training steps of one recipe: its losses and the bytes it held."""

    recipe: Recipe
    losses: list[float]
    """Training loss of each step (true scale, as computed in the forward)."""
    skipped: int
    """Steps the loss scaler skipped (an inf or NaN gradient); 0 without a scaler."""
    peak_bytes: int
    """Most bytes held at the end of any phase (forward, backward, optimizer step), by tensor
    accounting: parameters, gradients, master copy, buffer, optimizer state and the tensors
    saved for backward, each storage once. The backward's own transient peak is not seen."""
    cuda_peak_bytes: int | None = None
    """On CUDA: ``torch.cuda.max_memory_allocated`` over the run, minus what was allocated before."""


def train_recipe(
    recipe: Recipe,
    model: nn.Module,
    batches: Sequence[Batch],
    *,
    device: str | torch.device = "cpu",
    steps: int = 8,
    lr: float = 1e-3,
) -> RecipeRun:
    """Train a copy of ``model`` for ``steps`` real steps under ``recipe`` (one micro-batch per
    step, ``batches`` cycled) and return its losses and the bytes it held.

    Each step as :func:`measure_recipe` does it (parameters cast to ``param_dtype``, autocast
    where the recipe has it, the master copy stepped and copied back, the fp32 buffer), with
    AdamW or SGD at a constant ``lr``, and a ``torch.amp.GradScaler`` where
    ``recipe.loss_scaler`` (it unscales the gradients the optimizer steps, skips a step with an
    inf or NaN gradient and adapts its scale). ``model`` itself is left as it was.
    """
    if not batches or steps < 1:
        raise ValueError(f"steps={steps!r} with {len(batches)} batches: give at least one of each")
    device = torch.device(device)
    model = copy.deepcopy(model).to(device=device, dtype=DTYPES[recipe.param_dtype]).train()
    params = [p for p in model.parameters() if p.requires_grad]
    master = [p.detach().to(DTYPES[recipe.master_dtype]).requires_grad_()
              for p in params] if recipe.master_dtype else []  # fmt: skip
    buffers = [torch.zeros_like(m) for m in master] if recipe.grad_buffer_dtype else []
    optimizer = _make_optimizer(recipe.optimizer, master or params)
    for group in optimizer.param_groups:
        group["lr"] = lr
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**16) if recipe.loss_scaler else None
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in param_ptrs:
            saved.append(t)
        return t

    def held() -> int:
        grads = [t.grad for t in (*params, *master) if t.grad is not None]
        return storage_bytes([*params, *grads, *master, *buffers, *saved,
                              *optimizer_state_tensors(optimizer)])  # fmt: skip

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device) if cuda else 0
    losses: list[float] = []
    peak = skipped = 0
    for step in range(steps):
        x, y = (t.to(device) for t in batches[step % len(batches)])
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                checked_autocast(device.type, recipe.autocast or "fp32"):  # fmt: skip
            _, loss = model(x, y)
        peak = max(peak, held())
        saved.clear()
        (scaler.scale(loss) if scaler is not None else loss).backward()
        losses.append(float(loss.detach()))
        peak = max(peak, held())  # the 16-bit gradients beside the buffer, before the add
        if buffers:
            for b, p in zip(buffers, params, strict=True):
                b.add_(p.grad.to(b.dtype))
                p.grad = None
        if master:
            for m, p, b in zip(master, params, buffers or [None] * len(master), strict=True):
                m.grad = b if b is not None else p.grad.to(m.dtype)
        peak = max(peak, held())
        if scaler is not None:
            before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            skipped += scaler.get_scale() < before
        else:
            optimizer.step()
        peak = max(peak, held())
        if master:
            with torch.no_grad():
                for p, m in zip(params, master, strict=True):
                    p.copy_(m)
        for t in (*params, *master):
            t.grad = None
        for b in buffers:
            b.zero_()
    cuda_peak = torch.cuda.max_memory_allocated(device) - start if cuda else None
    return RecipeRun(recipe=recipe, losses=losses, skipped=skipped, peak_bytes=peak,
                     cuda_peak_bytes=cuda_peak)  # fmt: skip
