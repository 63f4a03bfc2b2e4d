"""The largest micro-batch a memory budget holds, predicted from the memory formulas.

An affine model of a training step's peak in the micro-batch b: model states (parameters,
gradients, AdamW's two moments, :func:`.state_bytes.memory_breakdown`) plus the activations
autograd keeps (:func:`.activations.activation_bytes`) and the logits' log-softmax, per
sequence. Separate from both because it combines them into one answer for a budget; the search
that checks it with real steps is :mod:`labkit.batching.finder`, which re-exports these names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from labkit.formulas.activations import GPTShape, activation_bytes, training_dtype
from labkit.formulas.flops import gpt_params
from labkit.formulas.state_bytes import memory_breakdown
from labkit.validate import positive, whole


def mib(n: float) -> str:
    """Bytes as MiB with two decimals, the finder's and the prediction's one format."""
    return f"{n / 2**20:,.2f} MiB"


def checked_budget(value: Any) -> int:
    """A memory budget in bytes, refused by name unless positive."""
    positive("budget_bytes", value, why="bytes, e.g. budget_bytes=16 * 2**30 for a 16 GiB card")
    return int(value)


def checked_seq_len(cfg: GPTShape | None, value: Any) -> int:
    """``value`` checked against the model's context; None means the whole context."""
    if value is None:
        if cfg is None:
            raise ValueError("seq_len=None is not allowed for a model without a ModelConfig "
                             "(.cfg): give the sequence length in tokens")  # fmt: skip
        return cfg.seq_len
    s = whole("seq_len", value, low=1)
    if cfg is not None and s > cfg.seq_len:
        raise ValueError(
            f"seq_len={s} is not allowed: the model's context is seq_len={cfg.seq_len} tokens "
            f"(its position table has that many rows); give 1..{cfg.seq_len}"
        )
    return s


OMISSIONS = (
    "not predicted: the logits, which train_step's forward result keeps alive through the "
    "backward pass, and the two s·V float32 gradients the loss's backward makes (with the saved "
    "log-softmax the head then holds 4·s·V·4 bytes per sequence); the inputs of the final "
    "LayerNorm and of the output head (2·s·h·e); LayerNorm's per-token mean and rstd "
    "(8·s bytes per LayerNorm); the token ids; optimizer temporaries; scratch memory inside a "
    "single kernel; on CUDA the caching allocator's rounding and the CUDA context. Counted but "
    "not all present at the peak: the gradients, which grow as the activations are freed"
)
"""What the prediction leaves out (labkit.formulas.activation_bytes_per_layer lists the same).
``labkit.memory.predicted_step_peak`` counts all of it, tensor by tensor, at the moment the step
peaks (dropout off); this affine model is the one the search starts from."""


@dataclass(frozen=True)
class BatchPrediction:
    """The largest micro-batch the memory model says fits in ``budget_bytes`` (modelled).

    Predicted peak of a training step at micro-batch b::

        model_state_bytes + fixed_activation_bytes + b · (activation + logits bytes per sequence)

    model states: parameters + gradients + AdamW's exp_avg and exp_avg_sq, all float32
    (``formulas.memory_breakdown``), all present at once in steady-state training. Activations:
    ``formulas.activation_bytes`` for the GPT's blocks (its ``fixed`` part is autocast's cache of
    16-bit weights, zero in float32). Logits: the float32 log-softmax cross-entropy saves, s·V·4
    bytes per sequence, which the formula leaves out and which is large for a small model.
    """

    batch: int
    """Largest b whose predicted peak fits (0: not even one sequence fits)."""
    budget_bytes: int
    model_state_bytes: float
    fixed_activation_bytes: float
    activation_bytes_per_sequence: float
    logits_bytes_per_sequence: float
    seq_len: int
    dtype: str
    omissions: str = OMISSIONS

    @property
    def bytes_per_sequence(self) -> float:
        return self.activation_bytes_per_sequence + self.logits_bytes_per_sequence

    def peak_bytes(self, batch: int) -> float:
        """Predicted peak bytes of one training step at micro-batch ``batch``."""
        b = whole("batch", batch, low=1)
        return self.model_state_bytes + self.fixed_activation_bytes + b * self.bytes_per_sequence


def max_batch_prediction(cfg: GPTShape, budget: int, seq_len: int, dtype: str, attention: str,
                         dropout_mask_bytes: int) -> BatchPrediction:  # fmt: skip
    """:func:`predict_max_batch` on arguments already checked, which the finder shares: a
    ``batch`` below 1 is returned, not refused (the finder falls back to trials then)."""
    n_params = gpt_params(cfg.vocab_size, cfg.d_model, cfg.n_layer,
                          seq_len=cfg.seq_len, tied=cfg.tie_weights)  # fmt: skip
    # labkit trains float32 parameters with AdamW; bf16/fp16 is autocast over them
    states = memory_breakdown(n_params, param_dtype="float32", optimizer="adamw").total
    low = dtype != "float32"

    def activations(b: int) -> float:
        return activation_bytes(
            cfg.n_layer, seq_len, b, cfg.d_model, cfg.n_head,
            bytes_per_element=2 if low else 4, autocast=low, attention=attention,
            dropout=cfg.dropout > 0, dropout_mask_bytes=dropout_mask_bytes,
        )  # fmt: skip

    # the formula is affine in b: a per-sequence slope plus autocast's weight cache
    per_seq = activations(2) - activations(1)
    fixed = activations(1) - per_seq
    logits = seq_len * cfg.vocab_size * 4  # cross_entropy on float32 logits saves log_softmax
    room = budget - states - fixed
    batch = max(0, math.floor(room / (per_seq + logits)))
    return BatchPrediction(batch=batch, budget_bytes=budget, model_state_bytes=states,
                           fixed_activation_bytes=fixed, activation_bytes_per_sequence=per_seq,
                           logits_bytes_per_sequence=logits, seq_len=seq_len, dtype=dtype)  # fmt: skip


def predict_max_batch(
    cfg_model: GPTShape,
    budget_bytes: float,
    *,
    dtype: str = "float32",
    seq_len: int | None = None,
    attention: str = "flash",
    dropout_mask_bytes: int = 1,
) -> BatchPrediction:
    """The largest micro-batch whose predicted training-step peak fits ``budget_bytes``.

    ``attention="flash"``: the GPT calls ``scaled_dot_product_attention``, which runs a fused
    kernel that keeps no s×s matrix on CPU and CUDA; pass "materialized" for the math kernel.
    ``dropout_mask_bytes``: 1 for CUDA's fused dropout; PyTorch's CPU dropout keeps its mask in
    the activation dtype (4 in float32). Only used when ``cfg_model.dropout > 0``.

    Raises ValueError for a budget <= 0, a seq_len beyond the model's context, and a budget in
    which not even one sequence is predicted to fit (naming what one sequence needs).
    """
    budget = checked_budget(budget_bytes)
    p = max_batch_prediction(cfg_model, budget, checked_seq_len(cfg_model, seq_len),
                             training_dtype(dtype), attention, dropout_mask_bytes)
    if p.batch < 1:
        need = p.peak_bytes(1)
        raise ValueError(
            f"budget_bytes={budget} ({mib(budget)}) is below one micro-batch: the model states "
            f"need {mib(p.model_state_bytes)} and one sequence of {p.seq_len} tokens "
            f"{mib(need - p.model_state_bytes)} more (predicted, {dtype}); give "
            f"budget_bytes >= {math.ceil(need)}, a shorter seq_len or a smaller model"
        )
    return p
