"""Model-state bytes: a dtype's storage size, parameters, gradients, optimizer state, ZeRO.

What training holds per parameter whatever the batch (activations are :mod:`.activations`):
the bytes-per-parameter conventions of the literature, each under its own name, PyTorch's own
count (:func:`memory_breakdown`) and ZeRO's sharding of it. Separate from the activations
because these grow with the parameters, not with the tokens. Sources: see :mod:`labkit.formulas`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from labkit import dtypes
from labkit.validate import number, one_of, positive, whole

# ----------------------------------------------------------------------------------------------
# Storage size of a dtype.

# Bytes per element of the storage dtypes, from the one table of names (labkit.dtypes). tf32 is
# missing on purpose: it is a tensor-core compute mode for float32 tensors, which are still
# stored in 4 bytes.
DTYPE_BYTES: dict[str, int] = {f.name: f.bytes for f in dtypes.FORMATS if f.storage}


def dtype_name(dtype: Any) -> str:
    """Canonical name of a dtype given as a string ("bf16", "float32") or a ``torch.dtype``.

    ``torch.float32`` prints as "torch.float32", so this works without importing torch.
    """
    found = dtypes.find(dtype)
    if found is None or not found.storage:
        raise ValueError(
            f"dtype must be one of {', '.join(sorted(DTYPE_BYTES))} (or an alias such as "
            f"'bf16', 'fp16', 'fp32'); got {dtype!r}{dtypes.why_not(dtype, storage_only=True)}"
        )
    return found.name


def dtype_bytes(dtype: Any) -> int:
    """Bytes one element of ``dtype`` occupies in memory (float32: 4, bfloat16: 2, ...)."""
    return DTYPE_BYTES[dtype_name(dtype)]


# ----------------------------------------------------------------------------------------------
# Model-state memory: parameters, gradients, optimizer state.


@dataclass(frozen=True)
class BytesPerParamConvention:
    """One published way of counting training memory per parameter (activations excluded)."""

    name: str
    bytes_per_param: int
    parts: tuple[tuple[str, int], ...]  # (what is counted, bytes per parameter)
    source: str


# The same training setup is counted differently in different sources; each gets its own name.
BYTES_PER_PARAM_CONVENTIONS: dict[str, BytesPerParamConvention] = {
    c.name: c
    for c in (
        BytesPerParamConvention(
            "fp32_adam",
            16,
            (("fp32 parameters", 4), ("fp32 gradients", 4), ("Adam m and v in fp32", 8)),
            "Playbook, memory section: full fp32 training with Adam",
        ),
        BytesPerParamConvention(
            "mixed_adam_zero",
            16,
            (
                ("16-bit parameters", 2),
                ("16-bit gradients", 2),
                ("K = 12: fp32 master parameters, Adam m and v", 12),
            ),
            "ZeRO paper (arXiv 1910.02054) section 3.1: 2Ψ + 2Ψ + KΨ with K = 12",
        ),
        BytesPerParamConvention(
            "mixed_adam_fp32_grad_accum",
            20,
            (
                ("16-bit parameters", 2),
                ("16-bit gradients", 2),
                ("fp32 master parameters, Adam m and v", 12),
                ("fp32 gradient accumulation buffer", 4),
            ),
            "Playbook, memory section: mixed precision with fp32 gradient accumulation",
        ),
        BytesPerParamConvention(
            "ml_engineering",
            18,
            (
                ("fp32 and 16-bit copies of the weights", 6),
                ("AdamW states", 8),
                ("fp32 gradients", 4),
            ),
            "stas00/ml-engineering, training/performance/README.md: 'mixed precision with "
            "AdamW requires 18 bytes per model parameter'",
        ),
        BytesPerParamConvention(
            "scaling_book",
            10,
            (("bf16 parameters", 2), ("Adam moments in fp32", 8)),
            "jax-ml/scaling-book, training.md section 5: bf16 parameters + fp32 Adam moments; "
            "gradients not counted",
        ),
    )
}


def bytes_per_param(convention: str) -> int:
    """Training-state bytes per parameter under a named convention (activations excluded).

    ==============================  =====  ==========================================================
    convention                      bytes  what is counted
    ==============================  =====  ==========================================================
    ``fp32_adam``                   16     4 params + 4 grads + 8 Adam (m, v) — Playbook
    ``mixed_adam_zero``             16     2 params + 2 grads + 12 (fp32 master, m, v) — ZeRO, K=12
    ``mixed_adam_fp32_grad_accum``  20     the above + 4 for an fp32 gradient buffer — Playbook
    ``ml_engineering``              18     6 weights (fp32 + 16-bit) + 8 AdamW + 4 fp32 grads
    ``scaling_book``                10     2 bf16 params + 8 fp32 Adam moments; no gradients
    ==============================  =====  ==========================================================

    The details and the source of each are in ``BYTES_PER_PARAM_CONVENTIONS``.
    """
    one_of("convention", convention, tuple(BYTES_PER_PARAM_CONVENTIONS))
    return BYTES_PER_PARAM_CONVENTIONS[convention].bytes_per_param


def model_state_bytes(n_params: float, convention: str) -> float:
    """Bytes of parameters + gradients + optimizer state: ``n_params × bytes_per_param(convention)``."""
    positive("n_params", n_params)
    return n_params * bytes_per_param(convention)


# Number of per-parameter state tensors each optimizer keeps (PyTorch's implementations).
OPTIMIZER_STATES: dict[str, int] = {
    "adamw": 2,  # exp_avg (m) and exp_avg_sq (v)
    "adam": 2,
    "sgd": 0,  # plain SGD keeps nothing
    "sgd_momentum": 1,  # momentum_buffer
}


@dataclass(frozen=True)
class MemoryBreakdown:
    """Predicted model-state memory in bytes, split the way ``torch.cuda.memory`` tools show it."""

    n_params: float
    parameters: float
    gradients: float
    optimizer_state: float
    master_weights: float = 0.0

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state + self.master_weights

    @property
    def bytes_per_param(self) -> float:
        return self.total / self.n_params

    def as_dict(self) -> dict[str, float]:
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer_state": self.optimizer_state,
            "master_weights": self.master_weights,
            "total": self.total,
        }


def memory_breakdown(
    n_params: float,
    *,
    param_dtype: Any = "float32",
    grad_dtype: Any = None,
    optimizer: str = "adamw",
    optimizer_state_dtype: Any = None,
    master_weights_dtype: Any = None,
) -> MemoryBreakdown:
    """Bytes of parameters, gradients and optimizer state for ``n_params`` parameters.

    Defaults follow PyTorch: gradients have the parameter's dtype, and ``torch.optim.AdamW``
    creates its two moments with ``zeros_like(param)``, i.e. in the parameter's dtype. So the
    default (fp32 params, AdamW) is 4 + 4 + 8 = 16 bytes/param, the Playbook's fp32 figure.

    Mixed precision with fp32 master weights (ZeRO's setup) is
    ``param_dtype="bf16", master_weights_dtype="float32", optimizer_state_dtype="float32"``:
    2 + 2 + 4 + 8 = 16 bytes/param.

    Not counted: activations (see ``activation_bytes``), AdamW's per-tensor ``step`` scalars,
    allocator caching and fragmentation, CUDA context. The optimizer state only exists after the
    first ``optimizer.step()`` (PyTorch allocates it lazily), so measure after step 1.

    Args:
        n_params: number of trainable parameters.
        param_dtype: dtype of the parameters the model computes with.
        grad_dtype: dtype of ``param.grad``; default the parameter's dtype.
        optimizer: "adamw" | "adam" (2 states) | "sgd_momentum" (1) | "sgd" (0).
        optimizer_state_dtype: dtype of each state; default the parameter's dtype.
        master_weights_dtype: dtype of a separate master copy of the weights, or None for none.
    """
    positive("n_params", n_params)
    one_of("optimizer", optimizer, tuple(OPTIMIZER_STATES))
    p_bytes = dtype_bytes(param_dtype)
    g_bytes = dtype_bytes(grad_dtype) if grad_dtype is not None else p_bytes
    s_bytes = dtype_bytes(optimizer_state_dtype) if optimizer_state_dtype is not None else p_bytes
    m_bytes = dtype_bytes(master_weights_dtype) if master_weights_dtype is not None else 0
    return MemoryBreakdown(
        n_params=n_params,
        parameters=n_params * p_bytes,
        gradients=n_params * g_bytes,
        optimizer_state=n_params * s_bytes * OPTIMIZER_STATES[optimizer],
        master_weights=n_params * m_bytes,
    )



class PrecisionRecipe(Protocol):
    """Where each per-parameter tensor of a training recipe lives, by dtype name: what
    :func:`predicted_breakdown` reads (``labkit.recipes.Recipe`` has it; a protocol because
    the recipe sits above the formulas)."""

    param_dtype: str
    grad_dtype: str | None
    master_dtype: str | None
    grad_buffer_dtype: str | None
    optimizer: str
    state_dtype: str | None


def predicted_breakdown(recipe: PrecisionRecipe) -> dict[str, int]:
    """Bytes per parameter of each persistent category (``labkit.recipes.PERSISTENT``) of
    ``recipe``: its parameters, gradients, master copy, gradient buffer and optimizer state."""
    return {
        "parameters": dtype_bytes(recipe.param_dtype),
        "gradients": dtype_bytes(recipe.grad_dtype),
        "master": dtype_bytes(recipe.master_dtype) if recipe.master_dtype else 0,
        "grad_buffer": dtype_bytes(recipe.grad_buffer_dtype) if recipe.grad_buffer_dtype else 0,
        "optimizer_state": OPTIMIZER_STATES[recipe.optimizer] * dtype_bytes(recipe.state_dtype),
    }


def predicted_bytes_per_param(recipe: PrecisionRecipe) -> int:
    """Persistent model-state bytes per parameter: parameters + gradients + master copy +
    gradient buffer + optimizer state. Activations and step-transient tensors are not counted."""
    return sum(predicted_breakdown(recipe).values())

# ----------------------------------------------------------------------------------------------
# ZeRO.

ZERO_STAGES = (0, 1, 2, 3)


def zero_memory_per_rank(
    n_params: float,
    stage: int,
    n_ranks: int,
    *,
    k: float = 12,
    param_bytes: float = 2,
    grad_bytes: float = 2,
) -> float:
    """Model-state bytes per data-parallel rank under ZeRO stage 0-3 (ZeRO paper, sections 5.1-5.3).

    With Ψ = n_params, N_d = n_ranks, K = optimizer bytes per parameter (12 for mixed-precision
    Adam: fp32 master weights, m and v)::

        stage 0 (plain DP)      (2 + 2 + K)·Ψ
        stage 1 (P_os)          2Ψ + 2Ψ + K·Ψ/N_d
        stage 2 (P_os+g)        2Ψ + (2 + K)·Ψ/N_d
        stage 3 (P_os+g+p)      (2 + 2 + K)·Ψ/N_d

    (the 2s are ``param_bytes`` and ``grad_bytes``). Activations, temporary buffers and the
    parameters a stage-3 rank gathers for the layer it is computing are not included.
    ZeRO's Figure 1 (Ψ = 7.5B, N_d = 64, K = 12): 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.
    """
    psi = positive("n_params", n_params)
    one_of("stage", stage, ZERO_STAGES)
    n = whole("n_ranks", n_ranks, low=1)
    k = number("k", k, low=0)
    pb = number("param_bytes", param_bytes, low=0)
    gb = number("grad_bytes", grad_bytes, low=0)
    if stage == 0:
        return (pb + gb + k) * psi
    if stage == 1:
        return (pb + gb) * psi + k * psi / n
    if stage == 2:
        return pb * psi + (gb + k) * psi / n
    return (pb + gb + k) * psi / n
