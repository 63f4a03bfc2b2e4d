"""Activation bytes: what a transformer keeps for the backward pass, per layer and outside.

Korthikanti et al. 2022's per-layer count, generalised to the element size, autocast and a
fused attention kernel, and the terms a whole GPT adds outside its blocks. Separate from the
model states (:mod:`.state_bytes`) because these grow with the tokens of a micro-batch.

:func:`predicted_activations` and :func:`predicted_stage_activations` apply them to
``labkit.model.GPT``, term by term (``labkit.memory`` measures the same terms and re-exports
both under their old names there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from labkit.dtypes import TRAINING
from labkit.formulas.state_bytes import dtype_bytes
from labkit.validate import one_of, whole

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
# labkit's GPT, term by term.


class GPTShape(Protocol):
    """The sizes of a GPT that the predictions read: a ``labkit.config.ModelConfig`` has them
    (a protocol, not that class, because ``config`` sits on the formulas' own layer)."""

    n_layer: int
    n_head: int
    d_model: int
    seq_len: int
    vocab_size: int
    dropout: float
    tie_weights: bool




def training_dtype(value: Any) -> str:
    """``value``, if it is a run's dtype (``TrainConfig.dtype``); the finder's message."""
    if value not in TRAINING:
        raise ValueError(f"dtype={value!r} is not allowed: give one of {TRAINING}")
    return value


def predicted_activations(
    cfg: GPTShape, micro_batch: int, *, dtype: str = "float32", attention: str = "flash",
    seq_len: int | None = None,
) -> dict[str, int]:
    """Bytes ``labkit.model.GPT`` saves for backward in one forward pass, term by term.

    The transformer layers from :func:`labkit.formulas.activation_bytes` (Korthikanti et
    al. 2022, generalised to the element size, autocast and a fused attention kernel), then
    every term that formula leaves out (:func:`labkit.formulas.activation_bytes_omitted`).
    ``dtype`` is the run's dtype: float32, or a 16-bit dtype by autocast over float32
    parameters (how ``labkit.train`` trains in bf16). ``attention``: "flash" for a fused SDPA
    kernel (no s×s matrix stored), "materialized" for the math backend. ``seq_len`` overrides
    the config's for a shorter input. Dropout must be off (the presets' ``dropout=0``): with
    p > 0 the masks' size depends on the backend.
    """
    if cfg.dropout > 0:
        raise ValueError(f"cfg.dropout={cfg.dropout!r}: the prediction is for dropout off; "
                         "use a config with dropout=0.0 (every preset has it)")
    s = seq_len if seq_len is not None else cfg.seq_len
    e = dtype_bytes(dtype)
    mixed = e < 4
    layers = activation_bytes(
        cfg.n_layer, s, micro_batch, cfg.d_model, cfg.n_head, bytes_per_element=e,
        dropout=False, attention=attention, autocast=mixed)
    rest = activation_bytes_omitted(
        cfg.n_layer, s, micro_batch, cfg.d_model, cfg.vocab_size, bytes_per_element=e,
        autocast=mixed)
    terms = {f"transformer layers ({attention} attention)": layers, **rest.as_dict()}
    return {name: int(v) for name, v in terms.items() if v}


def predicted_stage_activations(
    cfg: GPTShape, micro_batch: int, *, blocks: int, first: bool, last: bool,
    dtype: str = "float32", attention: str = "flash",
) -> dict[str, int]:
    """Bytes one pipeline stage of ``labkit.model.GPT`` saves per micro-batch, term by term.

    A stage runs ``blocks`` transformer blocks, the first stage also the embeddings and the
    last one the final LayerNorm and the output head (``labkit.parallel.pipeline``); the loss
    is computed outside the stage. So from the whole model's terms
    (:func:`labkit.formulas.activation_bytes_omitted`) a stage keeps:

    * every stage: its blocks (``formulas.activation_bytes``) and their LayerNorms' float32
      mean and rstd (2 norms per block, 2·4·s·b bytes each);
    * the first: the int64 token ids its embedding saves (8·s·b) and the position ids (8·s);
    * the last: the final LayerNorm's input, its output (the head's input) and its statistics,
      and under autocast the head weight's 16-bit copy; no log-softmax, no targets.

    Dropout must be off, as for :func:`predicted_activations`.
    """
    if cfg.dropout > 0:
        raise ValueError(f"cfg.dropout={cfg.dropout!r}: the prediction is for dropout off; "
                         "use a config with dropout=0.0 (every preset has it)")
    blocks = whole("blocks", blocks, low=0, high=cfg.n_layer, why="the blocks this stage runs")
    s, b, h = cfg.seq_len, micro_batch, cfg.d_model
    e = dtype_bytes(dtype)
    mixed = e < 4
    model_terms = activation_bytes_omitted(
        max(blocks, 1), s, b, h, cfg.vocab_size, bytes_per_element=e, autocast=mixed)
    stats_per_norm = 2 * 4 * s * b  # float32 mean and rstd per token
    terms: dict[str, float] = {}
    if blocks:
        terms[f"transformer layers ({attention} attention)"] = activation_bytes(
            blocks, s, b, h, cfg.n_head, bytes_per_element=e, dropout=False,
            attention=attention, autocast=mixed)  # fmt: skip
        terms["LayerNorm statistics (blocks)"] = 2 * blocks * stats_per_norm
    if first:
        terms["token and position ids"] = 8 * s * b + 8 * s
    if last:
        terms["final LayerNorm input"] = model_terms.final_norm_input
        terms["output head input (final LayerNorm output)"] = model_terms.head_input
        terms["final LayerNorm statistics"] = stats_per_norm
        terms["head weight copy (autocast)"] = model_terms.head_weight_copy
    return {name: int(v) for name, v in terms.items() if v}
