"""Closed-form estimates the course predicts before it measures.

Every number a notebook prints as "predicted" or "modelled" comes from a function in this file,
so each one states its formula, its units, the convention it follows and where the formula comes
from. Where the literature uses more than one convention (bytes per parameter, pipeline bubble),
each convention gets its own name and none is "the" answer.

Pure Python: no torch, no I/O, no state. Units are in the names or the docstrings: bytes, FLOPs
(floating-point operations, a count), FLOP/s (a rate), seconds.

Notation (Korthikanti et al. 2022, arXiv 2205.05198; the Ultra-Scale Playbook):
    N  parameters           L  layers              h  hidden size (d_model)
    a  attention heads      s  sequence length     b  micro-batch size (sequences)
    V  vocabulary size      p  pipeline stages     m  micro-batches per step
    v  interleaved chunks   n  ranks               C  peak FLOP/s     W  link bandwidth (bytes/s)

Sources cited below:
    [nanoGPT]      karpathy/nanoGPT, model.py (GPT.get_num_params, GPT.estimate_mfu) and
                   transformer_sizing.ipynb.
    [PaLM]         Chowdhery et al. 2022, "PaLM", arXiv 2204.02311, Appendix B (model FLOPs, MFU).
    [llm.c]        karpathy/llm.c, train_gpt2.cu (adds 6·L·h·s per token, "the attention
                   matmul", to 6N with N including the position table).
    [Kaplan]       Kaplan et al. 2020, "Scaling Laws for Neural Language Models", arXiv 2001.08361.
    [Playbook]     Hugging Face, "The Ultra-Scale Playbook" (memory section; appendix A3).
    [ZeRO]         Rajbhandari et al. 2019, arXiv 1910.02054 (section 3, Figure 1).
    [ml-eng]       stas00/ml-engineering, training/performance/README.md
                   ("Anatomy of Model's Memory Usage").
    [scaling-book] jax-ml/scaling-book, training.md (section 5) and gpus.md, roofline.md.
    [Korthikanti]  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
                   Models", arXiv 2205.05198, section 4.1.
    [NCCL-tests]   NVIDIA/nccl-tests, doc/PERFORMANCE.md.
    [GPipe]        Huang et al. 2019, arXiv 1811.06965, section 2.3.
    [Narayanan]    Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
                   Clusters Using Megatron-LM", arXiv 2104.04473, section 2.2.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from labkit import dtypes
from labkit.validate import number, one_of, positive, whole

# ----------------------------------------------------------------------------------------------
# Storage size of a dtype.

# Bytes per element of the storage dtypes, from the one table of names (labkit.dtypes). tf32 is
# missing on purpose: it is a tensor-core compute mode for float32 tensors, which are still
# stored in 4 bytes.
DTYPE_BYTES: dict[str, int] = {f.name: f.bytes for f in dtypes.FORMATS if f.storage}

# Every other accepted spelling of those dtypes, lower case, mapped to the canonical name.
_DTYPE_ALIASES: dict[str, str] = {
    s: f.name for f in dtypes.FORMATS if f.storage for s in f.spellings if s != f.name
}


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


# ----------------------------------------------------------------------------------------------
# Activation memory.

ATTENTION_KINDS = ("materialized", "flash")


def activation_bytes_per_layer(
    seq_len: int,
    micro_batch: int,
    d_model: int,
    n_head: int,
    *,
    bytes_per_element: int = 2,
    dropout: bool = True,
    dropout_mask_bytes: int = 1,
    attention: str = "materialized",
    autocast: bool = False,
) -> float:
    """Bytes one transformer layer keeps for the backward pass (no recomputation).

    With the defaults this is Korthikanti et al. 2022 (arXiv 2205.05198, section 4.1)::

        s·b·h·(34 + 5·a·s/h)  bytes  =  34·s·b·h  +  5·a·s²·b

    for 16-bit activations (2 bytes), 1-byte dropout masks and a GPT block with a 4h MLP.
    Where the numbers come from, with e = bytes_per_element and k = dropout_mask_bytes
    (the paper's e = 2, k = 1)::

        attention   e·sbh   input of the q/k/v projections (shared by all three)
                  3·e·sbh   Q, K and V (kept for QKᵀ and for softmax·V)
                    e·sbh   input of the output projection
                    k·sbh   dropout mask after the output projection
                    e·as²b  softmax output                     ┐
                    k·as²b  attention-dropout mask             ├ the "5·as²b" term
                    e·as²b  attention-dropout output           ┘
        MLP         e·sbh   input of the first linear
                  4·e·sbh   GeLU input (the 4h-wide first-linear output)
                  4·e·sbh   GeLU output, input of the second linear
                    k·sbh   dropout mask
        LayerNorm 2·e·sbh   the inputs of the two LayerNorms

    Generalised: ``s·b·h·(16e + 2k) + a·s²·b·(2e + k)``; without dropout ``s·b·h·16e + a·s²·b·e``.

    ``attention="flash"`` models a fused kernel (FlashAttention, PyTorch's flash SDPA on CUDA and
    on CPU) that never stores the s×s matrix: the quadratic term becomes the per-row softmax
    statistic it keeps instead, ``4·a·s·b`` bytes (float32 log-sum-exp). Fused kernels also
    regenerate attention dropout instead of storing a mask.

    What it does not count: what a whole model saves outside its blocks (the ids the
    embeddings keep, the final LayerNorm's input and output, the log-softmax output of the
    loss; the logits themselves are not saved), LayerNorm's per-token mean and rstd
    (2 × 2 × 4·s·b bytes per layer in PyTorch): all of these are
    :func:`activation_bytes_omitted`; nor temporaries that live only inside one op, nor
    allocator overhead. Note also that PyTorch's CPU dropout keeps its
    mask in the activation dtype (k = e), while the fused CUDA dropout keeps 1 byte (k = 1); with
    ``p = 0`` PyTorch stores no mask at all (pass ``dropout=False``).

    Cross-checked with ``torch.autograd.graph.saved_tensors_hooks`` on a GPT-2-style block
    (separate q/k/v Linear, SDPA, GELU; torch 2.13, CPU, fp32): the bytes autograd saved were
    this formula plus the LayerNorm statistics, exactly, for flash and math SDPA, with dropout
    off and on (CPU mask k = 4).

    ``autocast=True`` models PyTorch autocast (AMP) to a 16-bit dtype from float32 parameters,
    the usual way to train in bf16, rather than a model stored in 16 bits. Three terms change
    (with e = bytes_per_element = 2)::

        LayerNorm 2·4·sbh   the residual stream stays float32 (embeddings and parameters are
                            float32; the 16-bit block outputs are added into it) and autocast
                            runs LayerNorm in float32, so its saved inputs take 4 bytes, not e
        q/k/v input 3·e·sbh the float32 LayerNorm output is cast to e bytes by each Linear
                            that reads it; autocast caches casts of parameters only, so
                            separate q, k and v projections (as in ``labkit.model``) each save
                            their own copy (a fused qkv projection saves one)
        weights    12h²·e   the 16-bit copies of the four attention and two MLP weight
                            matrices (autocast's weight cache), saved for the input gradients

    In all ``s·b·h·(16e + 2k + 8) + 12·h²·e`` plus the attention term: 40·sbh + 24h² for bf16
    without dropout, against 32·sbh when everything is stored in 2 bytes. Checked the same way
    (torch 2.13, CPU autocast to bf16, flash SDPA, dropout off): exact, plus the LayerNorm
    statistics. CUDA autocast follows the same rules in PyTorch's AMP op lists (layer_norm in
    float32, linear in the autocast dtype, casts cached for parameters only); not yet measured
    on a GPU.

    Args:
        seq_len: s, tokens per sequence.
        micro_batch: b, sequences per micro-batch.
        d_model: h, hidden size.
        n_head: a, attention heads.
        bytes_per_element: e, bytes per stored activation (2 for bf16/fp16, 4 for fp32).
        dropout: whether dropout layers are active (p > 0 in training mode).
        dropout_mask_bytes: k, bytes per dropout-mask element (1 for a bool mask).
        attention: "materialized" (the paper's count) or "flash".
        autocast: activations from autocast to a 16-bit dtype over float32 parameters and a
            float32 residual stream (needs bytes_per_element < 4; float32 means no autocast).
    """
    s = whole("seq_len", seq_len, low=1)
    b = whole("micro_batch", micro_batch, low=1)
    h = whole("d_model", d_model, low=1)
    a = whole("n_head", n_head, low=1)
    e = whole("bytes_per_element", bytes_per_element, low=1)
    k = whole("dropout_mask_bytes", dropout_mask_bytes, low=1) if dropout else 0
    one_of("attention", attention, ATTENTION_KINDS)
    if autocast and e >= 4:
        raise ValueError(
            f"autocast=True models autocast to a 16-bit dtype (bytes_per_element 2), got "
            f"bytes_per_element={e!r}; for float32 training autocast is off (autocast=False)"
        )

    linear = s * b * h * (16 * e + 2 * k)  # (B, T, C)-shaped tensors and their masks
    if autocast:
        # float32 LayerNorm inputs (+ (4 - e) each, two of them), two more e-byte copies of the
        # q/k/v input (+ 2e), and the e-byte copies of the 12h² weight-matrix elements
        linear += s * b * h * (2 * (4 - e) + 2 * e) + 12 * h * h * e
    if attention == "materialized":
        # (B, nh, T, T): softmax output, and with dropout its mask and its dropped-out copy
        quadratic = a * s * s * b * (2 * e + k if dropout else e)
    else:
        quadratic = 4 * a * s * b  # float32 log-sum-exp per (B, nh, T) row
    return linear + quadratic


def activation_bytes(
    n_layer: int,
    seq_len: int,
    micro_batch: int,
    d_model: int,
    n_head: int,
    **kwargs: Any,
) -> float:
    """Activation bytes of ``n_layer`` identical layers: L × ``activation_bytes_per_layer(...)``.

    Same conventions and the same omissions (what :func:`activation_bytes_omitted` counts) as
    the per-layer function; keyword arguments (``bytes_per_element``, ``dropout``, ``attention``,
    ``autocast``, ...) are passed through to it.
    """
    n = whole("n_layer", n_layer, low=1)
    return n * activation_bytes_per_layer(seq_len, micro_batch, d_model, n_head, **kwargs)


@dataclass(frozen=True)
class OmittedActivations:
    """Bytes a GPT saves for backward that the per-layer formula leaves out, term by term.

    Returned by :func:`activation_bytes_omitted`; ``total`` is what to add to
    :func:`activation_bytes` to predict all of a model's saved activations.
    """

    final_norm_input: float
    """The final LayerNorm's input (the residual stream after the last block)."""
    head_input: float
    """The final LayerNorm's output, saved by the output head's matmul as its input."""
    head_weight_copy: float
    """Under autocast, the 16-bit copy of the (tied) output-head weight, V·h elements."""
    log_probs: float
    """Cross-entropy's log-softmax output, b·s·V elements (its backward reads it)."""
    norm_statistics: float
    """LayerNorm's float32 mean and rstd per token, for the 2L block norms and the final one."""
    token_ids: float
    """int64 token ids (embedding's input, the loss's targets) and position ids."""
    loss_weight: float
    """The loss's float32 ``total_weight`` scalar (``nll_loss`` saves it for its backward)."""

    @property
    def total(self) -> float:
        return sum(self.as_dict().values())

    def as_dict(self) -> dict[str, float]:
        return {
            "final LayerNorm input": self.final_norm_input,
            "output head input (final LayerNorm output)": self.head_input,
            "output head 16-bit weight copy": self.head_weight_copy,
            "log-softmax output": self.log_probs,
            "LayerNorm statistics": self.norm_statistics,
            "token and position ids": self.token_ids,
            "loss total_weight": self.loss_weight,
        }


def activation_bytes_omitted(
    n_layer: int,
    seq_len: int,
    micro_batch: int,
    d_model: int,
    vocab_size: int,
    *,
    bytes_per_element: int = 4,
    autocast: bool = False,
    log_prob_bytes: int = 4,
    learned_positions: bool = True,
) -> OmittedActivations:
    """What a GPT-2-style model saves for backward outside :func:`activation_bytes_per_layer`.

    The per-layer formula counts the inside of each block (Korthikanti et al. 2022). A whole
    model also saves, with e = ``bytes_per_element`` and r = 4 under autocast (the residual
    stream stays float32), else e::

        final LayerNorm input        r·sbh     LayerNorm's backward reads its input
        output head input            e·sbh     the final LayerNorm's output, kept by the matmul
        head weight copy (autocast)  e·V·h     autocast's 16-bit copy of the tied weight
        log-softmax output           4·sbV     cross-entropy = log_softmax + nll_loss; the
                                               backward of log_softmax reads its output
                                               (``log_prob_bytes``: labkit.model casts the
                                               logits to float32 before the loss)
        LayerNorm statistics         (2L+1)·2·4·sb   float32 mean and rstd per token per norm
        token ids                    2·8·sb + 8·s    int64 inputs (embedding's backward), targets
                                               (nll_loss's backward) and positions
        loss total_weight            4         nll_loss's float32 scalar

    The logits themselves are *not* saved: log_softmax keeps its output, not its input, so
    for a small vocabulary the loss costs one b·s·V float32 tensor, not two.

    Measured with ``torch.autograd.graph.saved_tensors_hooks`` on ``labkit.model.GPT`` (torch
    2.13, CPU, dropout off): :func:`activation_bytes` plus this total equals what autograd
    saved, to the byte, in float32 and under bf16 autocast, with flash SDPA
    (``attention="flash"``) and with the math backend (``attention="materialized"``).
    Autograd semantics: https://pytorch.org/docs/stable/notes/autograd.html#saved-tensors
    """
    L = whole("n_layer", n_layer, low=1)
    s = whole("seq_len", seq_len, low=1)
    b = whole("micro_batch", micro_batch, low=1)
    h = whole("d_model", d_model, low=1)
    V = whole("vocab_size", vocab_size, low=1)
    e = whole("bytes_per_element", bytes_per_element, low=1)
    lp = whole("log_prob_bytes", log_prob_bytes, low=1)
    if autocast and e >= 4:
        raise ValueError(
            f"autocast=True models autocast to a 16-bit dtype (bytes_per_element 2), got "
            f"bytes_per_element={e!r}; for float32 training autocast is off (autocast=False)"
        )
    residual = 4 if autocast else e
    return OmittedActivations(
        final_norm_input=residual * s * b * h,
        head_input=e * s * b * h,
        head_weight_copy=e * V * h if autocast else 0,
        log_probs=lp * s * b * V,
        norm_statistics=(2 * L + 1) * 2 * 4 * s * b,
        token_ids=2 * 8 * s * b + (8 * s if learned_positions else 0),
        loss_weight=4,
    )


# ----------------------------------------------------------------------------------------------
# Parameter and FLOP counts.


def gpt_params(
    vocab_size: int,
    d_model: int,
    n_layer: int,
    seq_len: int | None = None,
    *,
    tied: bool = True,
    bias: bool = True,
) -> int:
    """Exact parameter count of a GPT-2-style decoder (MLP width 4h, no GLU).

    Per layer (bias=True): LayerNorm 2h, q/k/v 3h² + 3h (fused or separate: same count),
    output projection h² + h, MLP 4h² + 4h and 4h² + h, LayerNorm 2h: 12h² + 13h. Hence the
    Playbook's formula (memory section) for a tied model without position embeddings::

        h·V + L·(12h² + 13h) + 2h              (2h: the final LayerNorm)

    plus ``s·h`` for learned position embeddings (pass ``seq_len``) and plus ``V·h`` for an
    untied lm_head (no bias). With ``bias=False`` (nanoGPT's default) the Linear biases and
    LayerNorm biases disappear: 12h² + 2h per layer and h for the final LayerNorm.

    labkit.model (biases on, learned positions, tied head) has exactly
    ``V·h + s·h + L·(12h² + 13h) + 2h`` parameters: ``gpt_params(V, h, L, seq_len=s)``.
    """
    V = whole("vocab_size", vocab_size, low=1)
    h = whole("d_model", d_model, low=1)
    L = whole("n_layer", n_layer, low=1)
    per_layer = 12 * h * h + (13 * h if bias else 2 * h)
    final_norm = 2 * h if bias else h
    total = V * h + L * per_layer + final_norm
    if seq_len is not None:
        total += whole("seq_len", seq_len, low=1) * h
    if not tied:
        total += V * h
    return total


FLOP_ATTENTION_CONVENTIONS = ("full", "causal", "none")


def flops_per_token(
    n_params: float,
    n_layer: int,
    d_model: int,
    seq_len: int,
    attention: str = "full",
) -> float:
    """Training FLOPs (forward + backward) per token.

    Each parameter costs 2 FLOPs per token forward (one multiply-add) and 4 backward (gradients
    with respect to inputs and to weights): 6N. Attention's QKᵀ and softmax·V add FLOPs that no
    parameter accounts for; the conventions differ on how to count them::

        "full"    6N + 12·L·h·s   nanoGPT estimate_mfu (12·L·H·Q·T with H·Q = h); PaLM App. B
        "causal"  6N +  6·L·h·s   a causal mask needs only half of the s×s scores (the
                                  term llm.c's train_gpt2.cu adds, without naming why)
        "none"    6N              the attention term ignored (Kaplan et al. 2020's C ≈ 6N)

    Which N? nanoGPT passes ``get_num_params()``, which subtracts the position embeddings (a
    lookup, no FLOPs) but keeps the token embedding, because with tied weights it is also the
    lm_head matmul. State which N you use when you print an MFU.
    """
    N = positive("n_params", n_params)
    L = whole("n_layer", n_layer, low=1)
    h = whole("d_model", d_model, low=1)
    s = whole("seq_len", seq_len, low=1)
    one_of("attention", attention, FLOP_ATTENTION_CONVENTIONS)
    attention_flops = {"full": 12 * L * h * s, "causal": 6 * L * h * s, "none": 0}[attention]
    return 6 * N + attention_flops


def training_flops(n_params: float, tokens: float) -> float:
    """Total training compute C ≈ 6·N·D FLOPs for D tokens (Kaplan et al. 2020, section 2.1).

    Ignores the attention term of ``flops_per_token``; fine when h ≫ s.
    """
    return 6 * positive("n_params", n_params) * positive("tokens", tokens)


def layer_training_flops(b: int, s: int, h: int, attention: str = "full") -> float:
    """FLOPs of one transformer layer's forward and backward for b sequences of s tokens.

    Forward, per layer (Narayanan et al. 2021, arXiv 2104.04473, section 5.1): the q/k/v,
    output-projection and 4h MLP matmuls, 24·b·s·h², plus attention's scores QKᵀ and their
    product with V, 4·b·s²·h. Backward costs twice the forward, so::

        "full"    72·b·s·h² + 12·b·s²·h   = 72·b·s·h²·(1 + s/6h), the paper's eq. (3) per
                                            layer without its recomputation and vocabulary terms
        "causal"  72·b·s·h² +  6·b·s²·h   a kernel that skips the masked half of the scores
        "none"    72·b·s·h²               the matmuls with weights only (6N per token)

    Per token, "full" is :func:`flops_per_token`'s per-layer share (6·12h² + 12·h·s). At
    s = h the attention term adds 1/6 (17 %) to the weight matmuls.
    """
    b = whole("b", b, low=1)
    s = whole("s", s, low=1)
    h = whole("h", h, low=1)
    one_of("attention", attention, FLOP_ATTENTION_CONVENTIONS)
    scores = {"full": 12, "causal": 6, "none": 0}[attention] * b * s**2 * h
    return 72 * b * s * h**2 + scores


def mfu(
    tokens_per_s: float,
    flops_per_token: float,
    peak_flops_per_s: float | None,
    n_devices: int = 1,
) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s ÷ (n_devices × peak FLOP/s).

    ``tokens_per_s`` is the throughput of the whole job (all devices, after gradient
    accumulation), so its model FLOP/s are shared by ``n_devices`` devices. Miscounting
    accumulation steps or world size, or dividing by the wrong peak, are the MFU bugs learners
    hit (nanoGPT #182, #464, #619; nanochat #147).

    MFU counts only the FLOPs the model needs (PaLM App. B); hardware FLOPs utilisation (HFU)
    also counts recomputed work, so with activation checkpointing HFU > MFU. Use the peak of
    the dtype the matmuls really run in (bf16, or tf32 when enabled, else fp32).

    Raises:
        ValueError: if ``peak_flops_per_s`` is None or not positive. An unknown device has no
            peak, and then there is no MFU: report tokens/s instead of guessing.
    """
    if peak_flops_per_s is None:
        raise ValueError(
            "peak_flops_per_s is None: no published peak is known for this device and dtype, "
            "so MFU cannot be computed; report tokens/s (or pass a sourced peak)"
        )
    positive("peak_flops_per_s", peak_flops_per_s)
    number("tokens_per_s", tokens_per_s, low=0)
    positive("flops_per_token", flops_per_token)
    n = whole("n_devices", n_devices, low=1)
    return tokens_per_s * flops_per_token / (n * peak_flops_per_s)


# ----------------------------------------------------------------------------------------------
# Collective communication (NCCL-tests conventions: S = message size in bytes).

# busbw = algbw × factor; the factor makes a measurement comparable with the link's bandwidth
# whatever the number of ranks (NCCL-tests doc/PERFORMANCE.md, "Summary").
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce")


def bus_bandwidth_factor(collective: str, n_ranks: int) -> float:
    """NCCL-tests' algbw → busbw correction factor.

    all_reduce 2(n−1)/n; all_gather, reduce_scatter, all_to_all (n−1)/n; broadcast, reduce 1.
    For all_gather and reduce_scatter, S is the size of the *full* array (n × the per-rank
    piece), as in NCCL-tests.
    """
    one_of("collective", collective, COLLECTIVES)
    n = whole("n_ranks", n_ranks, low=1)
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def algbw(message_bytes: float, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s: S / t (NCCL-tests)."""
    return number("message_bytes", message_bytes, low=0) / positive(
        "seconds", seconds
    )


def busbw(message_bytes: float, seconds: float, collective: str, n_ranks: int) -> float:
    """Bus bandwidth in bytes/s: algbw × ``bus_bandwidth_factor(collective, n_ranks)``."""
    return algbw(message_bytes, seconds) * bus_bandwidth_factor(collective, n_ranks)


def ring_allreduce_bytes_per_rank(message_bytes: float, n_ranks: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of S bytes: 2(n−1)/n × S.

    A reduce-scatter ((n−1)/n × S) followed by an all-gather ((n−1)/n × S). NCCL-tests
    PERFORMANCE.md derives the same 2(n−1)/n for any point-to-point algorithm. 0 when n = 1.
    """
    S = number("message_bytes", message_bytes, low=0)
    n = whole("n_ranks", n_ranks, low=1)
    return 2 * (n - 1) / n * S


# The α–β (latency–bandwidth, "Hockney") model: sending m bytes as one message takes α + m/β,
# with α the fixed cost of a message and β the bandwidth. A ring all-reduce of S bytes over p
# ranks takes 2(p−1) steps, each sending one S/p chunk, so T = 2(p−1)·α + 2(p−1)/p · S/β
# (Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in
# MPICH", IJHPCA 19(1), 2005: https://doi.org/10.1177/1094342005051521). The model leaves
# out the time to add the received chunk into one's own (their γ term) and any overlap of the
# steps; notebook 00 measures how far that goes on the machine at hand.


def alpha_beta_time(message_bytes: float, latency_s: float, bandwidth_bytes_per_s: float,
                    messages: int = 1) -> float:  # fmt: skip
    """Seconds to send ``message_bytes`` in total as ``messages`` messages, one after another:
    ``messages`` × α + bytes / β (the α–β model; α = ``latency_s``, β in bytes/s)."""
    S = number("message_bytes", message_bytes, low=0)
    alpha = number("latency_s", latency_s, low=0)
    beta = positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    k = whole("messages", messages, low=1)
    return k * alpha + S / beta


def alpha_beta_fit(small_bytes: float, small_s: float, big_bytes: float,
                   big_s: float) -> tuple[float, float]:  # fmt: skip
    """(α seconds, β bytes/s) of the α–β line through two timed messages, a small and a big one.

    β is the slope's inverse, (big − small bytes) / (big − small seconds); α is what is left of
    the small message's time, at least 0. Raises ValueError when the big message did not take
    longer than the small one (the times were disturbed, or the sizes are too close to tell).
    """
    m0 = number("small_bytes", small_bytes, low=0)
    t0 = number("small_s", small_s, low=0)
    m1 = positive("big_bytes", big_bytes)
    t1 = positive("big_s", big_s)
    if m1 <= m0 or t1 <= t0:
        raise ValueError(
            f"big_bytes={big_bytes!r} in big_s={big_s!r} vs small_bytes={small_bytes!r} in "
            f"small_s={small_s!r}: the big message must be larger and take longer to fit a line; "
            "time a bigger message, or time both again on a quieter machine"
        )
    beta = (m1 - m0) / (t1 - t0)
    return max(t0 - m0 / beta, 0.0), beta


def ring_allreduce_time(message_bytes: float, n_ranks: int, latency_s: float,
                        bandwidth_bytes_per_s: float) -> float:  # fmt: skip
    """α–β time of a ring all-reduce of S bytes over n ranks: 2(n−1)·α + 2(n−1)/n · S/β.

    The data term is :func:`ring_allreduce_bytes_per_rank` / β: each rank sends and receives
    at once, so a step costs one chunk's time, not two. 0 when n = 1.
    """
    n = whole("n_ranks", n_ranks, low=1)
    if n == 1:
        return 0.0
    return alpha_beta_time(ring_allreduce_bytes_per_rank(message_bytes, n), latency_s,
                           bandwidth_bytes_per_s, messages=2 * (n - 1))  # fmt: skip


def multinode_allreduce_time(message_bytes: float, nodes: int, gpus_per_node: int, *,
                             intra_bytes_per_s: float, inter_bytes_per_s: float,
                             hierarchical: bool = False) -> float:  # fmt: skip
    """Bandwidth time of an all-reduce over ``nodes`` × ``gpus_per_node`` GPUs (latency left out).

    inter_bytes_per_s is what one GPU can send off its node at once (its share of the network
    cards: 50 GB/s for one 400 Gb/s NIC per GPU, as on a DGX H100).

    - flat ring (``hierarchical=False``): one ring through all n = N·G GPUs, node after node.
      Every step moves a chunk on every hop at once, so the step lasts as long as the slowest
      hop: the ring runs at min(intra, inter): 2(n−1)/n · S / min(...).
    - hierarchical (two-level: the 2D-torus all-reduce of Mikami et al. 2018, "Massively
      Distributed SGD: ImageNet/ResNet-50 Training in a Flash", arXiv 1811.05233; Horovod's
      hierarchical all-reduce does the same): reduce-scatter
      inside each node (each GPU ends with S/G summed over its node), all-reduce those S/G
      across the N nodes, one ring per GPU position on its own NIC, then all-gather inside the
      node: 2(G−1)/G · S/intra + 2(N−1)/N · (S/G)/inter. Only 1/G of the bytes cross the
      network per GPU, close to what NCCL's topology-aware rings and trees achieve.
    """
    s = number("message_bytes", message_bytes, low=0)
    n_nodes, g = whole("nodes", nodes, low=1), whole("gpus_per_node", gpus_per_node, low=1)
    intra = positive("intra_bytes_per_s", intra_bytes_per_s)
    inter = positive("inter_bytes_per_s", inter_bytes_per_s)
    if not hierarchical:
        n = n_nodes * g
        link = intra if n_nodes == 1 else inter if g == 1 else min(intra, inter)
        return ring_allreduce_bytes_per_rank(s, n) / link
    inside = 2 * (g - 1) / g * s / intra  # reduce-scatter + all-gather on NVLink
    across = ring_allreduce_bytes_per_rank(s / g, n_nodes) / inter
    return inside + across


def young_checkpoint_interval(save_s: float, mtbf_s: float) -> float:
    """Seconds of training between checkpoints that waste the least time: √(2·δ·M).

    Young, "A first order approximation to the optimum checkpoint interval", Communications of
    the ACM 17(9), 1974. A checkpoint that stops training for δ seconds, taken every τ seconds
    of work, costs δ/τ of the time; a failure (one every M seconds on average, the job's mean
    time between failures) loses on average τ/2 of work since the last one. The sum
    δ/τ + τ/(2M) is least at τ = √(2δM). First order: good while δ ≪ τ ≪ M.
    """
    return math.sqrt(2 * positive("save_s", save_s) * positive("mtbf_s", mtbf_s))


def daly_checkpoint_interval(save_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum checkpoint interval, seconds of work between checkpoints.

    Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
    Future Generation Computer Systems 22(3), 2006 (doi:10.1016/j.future.2004.11.016), eq. 37:
    τ = √(2δM)·[1 + ⅓·√(δ/2M) + ⅑·(δ/2M)] − δ for δ < 2M, else τ = M. It corrects Young's
    √(2δM) (``young_checkpoint_interval``) for the time the saves themselves take, and stays
    valid where δ is not small against M; to first order it is √(2δM) − δ.
    """
    delta = positive("save_s", save_s)
    m = positive("mtbf_s", mtbf_s)
    if delta >= 2 * m:
        return m
    r = delta / (2 * m)
    return math.sqrt(2 * delta * m) * (1 + math.sqrt(r) / 3 + r / 9) - delta


def checkpoint_waste_fraction(interval_s: float, save_s: float, mtbf_s: float,
                              restart_s: float = 0.0) -> float:  # fmt: skip
    """Share of the time lost to checkpoints and failures, to first order (Young 1974):
    δ/τ for writing them, and per failure, every M seconds, τ/2 of lost work plus the restart."""
    tau = positive("interval_s", interval_s)
    delta = number("save_s", save_s, low=0)
    m = positive("mtbf_s", mtbf_s)
    return delta / tau + (tau / 2 + number("restart_s", restart_s, low=0)) / m


def bucket_count(tensor_bytes: Sequence[float], cap_bytes: float) -> int:
    """Buckets a gradient-bucketing scheme like DDP's makes of tensors taken in order.

    Greedy, as ``compute_bucket_assignment_by_size`` in torch's ``reducer.cpp``: a tensor is
    never split, each goes into the open bucket, and the bucket closes as soon as it holds
    ``cap_bytes`` or more. So a tensor larger than the cap fills a bucket alone, and the count
    is at most ceil(total / cap) + (tensors larger than the cap). Pass the tensors in the
    order their gradients become ready (about the reverse of ``model.parameters()``).
    """
    cap = number("cap_bytes", cap_bytes, low=0)
    if cap <= 0:
        raise ValueError(f"cap_bytes={cap_bytes!r} is not allowed: a size in bytes > 0")
    count, open_bytes = 0, 0.0
    for size in tensor_bytes:
        open_bytes += number("tensor_bytes", size, low=0)
        if open_bytes >= cap:
            count, open_bytes = count + 1, 0.0
    return count + (1 if open_bytes > 0 else 0)


def dp_exposed_comm_s(bucket_bytes: Sequence[float], backward_s: float, n_ranks: int,
                      latency_s: float, bandwidth_bytes_per_s: float) -> float:  # fmt: skip
    """Seconds of gradient all-reduce still running after backward ends, when each bucket's
    ring all-reduce starts as soon as the bucket is full (DDP's overlap), in the α–β model.

    ``bucket_bytes``: the buckets in the order they fill (the reverse of the parameters).
    Two assumptions make it a closed form: backward produces gradient bytes at a constant
    rate (its FLOPs are 4N per token, proportional to the parameters of the matmul layers
    behind them), so bucket k is full at ``backward_s`` × (bytes up to and including k) /
    (all bytes); and one all-reduce runs at a time, in the order issued (a process group's
    collectives run in order on one stream or thread), each taking
    :func:`ring_allreduce_time`. Bucket k then ends at max(full_k, end_{k−1}) + T(bucket k)
    and the result is end_last − backward_s.

    Its shape in the bucket size is what a bucket-size sweep measures: one bucket sends
    everything after backward (exposed = T(S) whole); tiny buckets pay the 2(n−1)·α of each
    all-reduce so many times that communication outlasts backward; in between, only about
    the last bucket's time is left exposed (Li et al., "PyTorch Distributed", VLDB 2020,
    section 3.2 and Figure 2: https://arxiv.org/abs/2006.15704). 0 for one rank.
    """
    sizes = [number("bucket_bytes", b, low=0) for b in bucket_bytes]
    backward = number("backward_s", backward_s, low=0)
    n = whole("n_ranks", n_ranks, low=1)
    if not sizes or n == 1:
        return 0.0
    total = sum(sizes)
    end, filled = 0.0, 0.0
    for size in sizes:
        filled += size
        full_at = backward * filled / total if total > 0 else backward
        end = max(full_at, end) + ring_allreduce_time(size, n, latency_s, bandwidth_bytes_per_s)
    return end - backward


def allgather_bytes_per_rank(total_bytes: float, n_ranks: int) -> float:
    """Bytes each rank receives in an all-gather whose *gathered* result is S bytes: (n−1)/n × S."""
    S = number("total_bytes", total_bytes, low=0)
    n = whole("n_ranks", n_ranks, low=1)
    return (n - 1) / n * S


def reduce_scatter_bytes_per_rank(total_bytes: float, n_ranks: int) -> float:
    """Bytes each rank sends in a reduce-scatter of an S-byte input: (n−1)/n × S."""
    S = number("total_bytes", total_bytes, low=0)
    n = whole("n_ranks", n_ranks, low=1)
    return (n - 1) / n * S


# ----------------------------------------------------------------------------------------------
# Pipeline bubble. Two conventions are in use; both are provided, under different names.


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Fraction of a pipeline step that a stage sits idle: (p−1) / (v·m + p−1).

    GPipe's convention (arXiv 1811.06965, section 2.3): the bubble as a share of the whole
    step, ideal work plus bubble. With v = 1 it is (p−1)/(m+p−1); for p = 4, m = 8: 3/11.
    Interleaving v model chunks per stage (Narayanan et al. 2021) shrinks the bubble v times.
    Same value for GPipe and 1F1B schedules, which differ in memory, not in bubble.
    """
    p = whole("p", p, low=1)
    m = whole("m", m, low=1)
    v = whole("v", v, low=1)
    return (p - 1) / (v * m + p - 1)


def bubble_overhead(p: int, m: int, v: int = 1) -> float:
    """Pipeline bubble time relative to the ideal (bubble-free) step time: (p−1) / (v·m).

    Narayanan et al. 2021 (arXiv 2104.04473, section 2.2) call this the "bubble time
    fraction"; the Playbook uses it too. (p−1)/m for GPipe and 1F1B; (p−1)/(v·m) for the
    interleaved schedule with v chunks per stage. For p = 4, m = 8: 3/8, i.e. the step takes
    1.375× the ideal time. Compare ``bubble_fraction``, the share of the actual step.
    """
    p = whole("p", p, low=1)
    m = whole("m", m, low=1)
    v = whole("v", v, low=1)
    return (p - 1) / (v * m)


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


# ----------------------------------------------------------------------------------------------
# Can data-parallel communication hide behind the backward pass?


def dp_overlap_ratio(
    tokens_per_rank: float,
    n_ranks: int,
    peak_flops_per_s: float,
    bandwidth_bytes_per_s: float,
    *,
    grad_bytes: float = 2,
) -> float:
    """t_comm / t_compute for data parallelism; ≤ 1 means the all-reduce can hide behind compute.

    Backward compute on one rank: 4·N FLOPs per token (the backward share of 6N), so
    ``t_compute = 4·N·tokens_per_rank / C``. Ring all-reduce of the gradients
    (``grad_bytes``·N bytes): ``t_comm = 2·(n−1)/n · grad_bytes·N / W``. N cancels::

        t_comm / t_compute = (grad_bytes / (2·tokens_per_rank)) · ((n−1)/n) · (C/W)

    With bf16 gradients (grad_bytes = 2) the condition is tokens_per_rank ≥ ((n−1)/n)·C/W: the
    scaling-book's "per-GPU token batch > C/W", about 2,200 tokens in an H100 node
    (990e12 / 450e9; gpus.md, "Data Parallelism").

    ``tokens_per_rank`` is the tokens whose backward the all-reduce can hide behind: all of a
    rank's tokens per step without gradient accumulation, but only the *last micro-batch's*
    under ``no_sync`` accumulation (the earlier ones finish before the all-reduce can start),
    which is :func:`dp_exposed_comm_fraction`'s condition.

    The Playbook (appendix A3) prints the ratio as (N / (2·tokens))·((n−1)/n)·(C/W). That
    expression is not dimensionless (N/tokens is a pure number but C/W is FLOPs per byte); its
    own derivation divides one bucket's all-reduce time by the whole model's backward time.
    Counting all N gradients, N cancels as above. Assumes perfect overlap, peak FLOP/s and peak
    bandwidth; real overlap is worse.
    """
    tokens = positive("tokens_per_rank", tokens_per_rank)
    n = whole("n_ranks", n_ranks, low=1)
    C = positive("peak_flops_per_s", peak_flops_per_s)
    W = positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    gb = positive("grad_bytes", grad_bytes)
    return (gb / (2 * tokens)) * ((n - 1) / n) * (C / W)


def dp_min_tokens_per_rank(
    n_ranks: int,
    peak_flops_per_s: float,
    bandwidth_bytes_per_s: float,
    *,
    grad_bytes: float = 2,
) -> float:
    """Smallest tokens per rank whose backward can hide the gradient all-reduce
    (``dp_overlap_ratio`` ≤ 1): per step without accumulation, per *micro-batch* with it, since
    only the last micro-batch's backward overlaps the all-reduce (:func:`dp_exposed_comm_fraction`).

    ``(grad_bytes/2) · ((n−1)/n) · C/W``; 0 for a single rank (nothing to communicate).
    """
    n = whole("n_ranks", n_ranks, low=1)
    C = positive("peak_flops_per_s", peak_flops_per_s)
    W = positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    gb = positive("grad_bytes", grad_bytes)
    return (gb / 2) * ((n - 1) / n) * (C / W)


def dp_exposed_comm_fraction(
    tokens_per_micro_batch: float,
    grad_accum: int,
    n_ranks: int,
    peak_flops_per_s: float,
    bandwidth_bytes_per_s: float,
    *,
    grad_bytes: float = 2,
) -> float:
    """Share of a data-parallel step spent waiting for the gradient all-reduce, with accumulation.

    Under ``no_sync`` the first ``grad_accum − 1`` micro-batches keep their gradients local;
    the single all-reduce runs during the *last* micro-batch's backward (PyTorch DDP's reducer
    fires its buckets as that backward produces them: Li et al. 2020, arXiv 2006.15704), so it
    can hide only behind that backward. The overlap condition is therefore
    ``dp_overlap_ratio(tokens_per_micro_batch, ...)`` ≤ 1: tokens per *micro-batch*, not per
    step. With r that ratio and t_b the last backward (4·N·tokens/C), the step computes
    ``grad_accum`` forward+backward passes, 1.5·grad_accum·t_b (6N of which 4N backward), and
    waits ``max(0, r − 1)·t_b`` for what the backward could not hide::

        exposed share = max(0, r − 1) / (1.5·grad_accum + max(0, r − 1))

    Accumulation amortises the exposed all-reduce over more compute (the share falls like
    1/grad_accum) but does not hide any more of it: the exposed seconds per step stay
    ``(r − 1)·t_b``. Same assumptions as ``dp_overlap_ratio`` (peak rates, perfect overlap,
    attention FLOPs ignored).
    """
    accum = whole("grad_accum", grad_accum, low=1)
    r = dp_overlap_ratio(
        tokens_per_micro_batch,
        n_ranks,
        peak_flops_per_s,
        bandwidth_bytes_per_s,
        grad_bytes=grad_bytes,
    )
    exposed = max(0.0, r - 1.0)
    return exposed / (1.5 * accum + exposed)


# ----------------------------------------------------------------------------------------------
# Roofline (scaling-book roofline.md).


def critical_intensity(peak_flops_per_s: float, bandwidth_bytes_per_s: float) -> float:
    """Arithmetic intensity (FLOPs per byte moved) where a kernel stops being memory-bound: C/BW.

    H100 SXM: 989e12 / 3.35e12 ≈ 295 FLOPs/byte; H200: 989e12 / 4.8e12 ≈ 206.
    """
    return positive("peak_flops_per_s", peak_flops_per_s) / positive(
        "bandwidth_bytes_per_s", bandwidth_bytes_per_s
    )


def roofline_attainable_flops(
    intensity: float, peak_flops_per_s: float, bandwidth_bytes_per_s: float
) -> float:
    """Roofline bound in FLOP/s for a kernel of arithmetic intensity I: min(C, I·BW)."""
    i = number("intensity", intensity, low=0)
    C = positive("peak_flops_per_s", peak_flops_per_s)
    BW = positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    return min(C, i * BW)


# ----------------------------------------------------------------------------------------------
# Checkpoint size.


def checkpoint_bytes_per_param(
    weight_dtype: Any = "float32", optimizer: str = "adamw", state_dtype: Any = "float32"
) -> int:
    """Bytes a checkpoint holds per trainable parameter: its weight and its optimizer state.

    fp32 AdamW: 4 (weight) + 2 × 4 (m and v) = 12 B. Gradients are not saved: a resumed step
    computes them afresh. Training memory counts 16 B for the same setup (``fp32_adam``): the
    4 B of gradients are the difference. Optimizer states per parameter: ``OPTIMIZER_STATES``.
    """
    one_of("optimizer", optimizer, tuple(OPTIMIZER_STATES))
    return dtype_bytes(weight_dtype) + OPTIMIZER_STATES[optimizer] * dtype_bytes(state_dtype)


def checkpoint_bytes(
    n_params: float,
    *,
    weight_dtype: Any = "float32",
    optimizer: str = "adamw",
    state_dtype: Any = "float32",
    n_trainable: float | None = None,
    aliased_params: float = 0,
    n_tensors: int = 0,
    bytes_per_tensor: float = 0.0,
) -> float:
    """Bytes of a checkpoint of weights and optimizer state::

        (N + A)·w + N_t·k·s + T·o

    N parameters (``n_params``, each counted once) of w bytes; N_t of them trainable (default
    all), each with k optimizer states of s bytes; A parameters the state dict names twice
    (``aliased_params``: a tied embedding saved as both ``wte.weight`` and ``lm_head.weight``,
    written once per name); T tensors (``n_tensors``) costing o bytes each in the file format
    (``bytes_per_tensor``: headers, the index). Weights plus states are the bytes-per-parameter
    count of ``checkpoint_bytes_per_param``.
    """
    n = number("n_params", n_params, low=0)
    trainable = n if n_trainable is None else number("n_trainable", n_trainable, low=0)
    one_of("optimizer", optimizer, tuple(OPTIMIZER_STATES))
    w, s = dtype_bytes(weight_dtype), dtype_bytes(state_dtype)
    states = OPTIMIZER_STATES[optimizer] * s
    tensors = number("n_tensors", n_tensors, low=0)
    per_tensor = number("bytes_per_tensor", bytes_per_tensor, low=0)
    aliased = number("aliased_params", aliased_params, low=0)
    return (n + aliased) * w + trainable * states + tensors * per_tensor


class GemmQuantization(NamedTuple):
    """How a GEMM's output C (m × n) maps onto tiles and waves of a GPU (modelled)."""

    tiles: int  # ceil(m / tile_m) × ceil(n / tile_n) output tiles, one thread block each
    waves: int  # ceil(tiles / concurrent), rounds of tiles the GPU runs one after another
    tile_efficiency: float  # useful outputs ÷ outputs the tiles compute (padding wasted)
    wave_efficiency: float  # tiles ÷ (waves × concurrent): the last wave's idle share
    efficiency: float  # their product: the share of the launched work that is useful


def gemm_quantization(m: int, n: int, *, tile_m: int = 256, tile_n: int = 128,
                      concurrent: int = 108) -> GemmQuantization:  # fmt: skip
    """Tile and wave quantization of an m × n GEMM output (NVIDIA, "Matrix Multiplication
    Background User's Guide", §3.1 Tile Quantization and §3.2 Wave Quantization).

    A GPU computes C in tiles of tile_m × tile_n, one thread block each; a dimension that is
    not a multiple of the tile pads the last tile with work that is thrown away (**tile
    quantization**). The tiles run in waves of ``concurrent`` at a time (the guide's A100
    example: 108 SMs, one 256 × 128 tile per SM, so a wave of 108 tiles); a tile count just
    above a multiple of the wave adds a nearly empty last wave that takes as long as a full
    one (**wave quantization**). Time is modelled as proportional to waves, so throughput
    follows ``efficiency``: a saw-tooth against m or n. Which tile cuBLAS picks depends on
    the shape and the library version; the defaults are the guide's example, not a rule.

    >>> q = gemm_quantization(256 * 9, 128 * 12)  # 108 tiles: exactly one full wave
    >>> q.tiles, q.waves, q.efficiency
    (108, 1, 1.0)
    >>> round(gemm_quantization(256 * 9 + 1, 128 * 12).efficiency, 3)  # 120 tiles: 2 waves
    0.5
    """
    m, n = whole("m", m, low=1), whole("n", n, low=1)
    tile_m, tile_n = whole("tile_m", tile_m, low=1), whole("tile_n", tile_n, low=1)
    concurrent = whole("concurrent", concurrent, low=1)
    rows, cols = math.ceil(m / tile_m), math.ceil(n / tile_n)
    tiles = rows * cols
    waves = math.ceil(tiles / concurrent)
    tile_eff = (m * n) / (rows * tile_m * cols * tile_n)
    wave_eff = tiles / (waves * concurrent)
    return GemmQuantization(tiles, waves, tile_eff, wave_eff, tile_eff * wave_eff)
