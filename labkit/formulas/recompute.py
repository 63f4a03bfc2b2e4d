"""Activation recomputation, predicted: what checkpointed blocks keep and what they re-run.

Closed-form, on sizes alone: the bytes a GPT's blocks hold for the backward with some of them
checkpointed (Chen et al. 2016, arXiv 1604.06174) or under a recompute mode, ``"none"``,
``"selective"`` or ``"full"`` (Korthikanti et al. 2022, arXiv 2205.05198), and the FLOPs the
backward re-runs. Separate from :mod:`.activations` because these compare strategies built on
its per-layer bytes; the code that applies checkpointing to a model and measures it is
:mod:`labkit.batching.recomputation`, which re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.formulas.activations import (
    GPTShape,
    activation_bytes_omitted,
    activation_bytes_per_layer,
    training_dtype,
)
from labkit.formulas.flops import flops_per_token, gpt_params
from labkit.validate import whole

EVERY_MEANS = "1 checkpoints every block, 2 every other block, ..."
"""What ``every`` means, in the refusals of a bad one (here and in labkit.batching)."""

AC_MODES = ("none", "selective", "full")
"""The recompute modes, named as torchtitan's ``apply_ac`` names them
(``labkit.batching.recomputation.apply_ac`` applies them to a model)."""


def _context_seq_len(cfg: GPTShape, seq_len: int | None) -> int:
    """``seq_len`` checked against the model's context; None means the whole context."""
    s = cfg.seq_len if seq_len is None else whole("seq_len", seq_len, low=1)
    if s > cfg.seq_len:
        raise ValueError(
            f"seq_len={s} is not allowed: the model's context is {cfg.seq_len} "
            f"tokens; give 1..{cfg.seq_len}"
        )
    return s


@dataclass(frozen=True)
class CheckpointPrediction:
    """Activation bytes of the GPT's blocks with ``checkpointed`` of them checkpointed (modelled).

    Each block that is not checkpointed keeps ``per_layer_bytes`` for the backward pass
    (``formulas.activation_bytes_per_layer``); a checkpointed one keeps only its input,
    ``input_bytes`` (the float32 residual stream, s·b·h·4). During the backward pass a
    checkpointed block's activations are rebuilt, one block at a time, and freed after its
    gradients: ``recompute_bytes`` more, briefly. Outside the blocks (embeddings, the final
    LayerNorm, the logits and loss) nothing changes, so those are left out, as in the formula.
    """

    checkpointed: int
    n_layer: int
    per_layer_bytes: float
    input_bytes: float

    @property
    def saved_bytes(self) -> float:
        """Held from the end of the forward into the backward."""
        kept = self.n_layer - self.checkpointed
        return kept * self.per_layer_bytes + self.checkpointed * self.input_bytes

    @property
    def recompute_bytes(self) -> float:
        """Rebuilt for one checkpointed block during the backward (0 with none checkpointed)."""
        return self.per_layer_bytes if self.checkpointed else 0.0

    @property
    def saving_bytes(self) -> float:
        """Saved bytes less than without checkpointing."""
        return self.checkpointed * (self.per_layer_bytes - self.input_bytes)

    @property
    def recompute_fraction(self) -> float:
        """Extra forward work per step, as a fraction of one whole forward of the blocks."""
        return self.checkpointed / self.n_layer


def predict_checkpointing(
    cfg: GPTShape,
    micro_batch: int,
    every: int | None,
    *,
    seq_len: int | None = None,
    bytes_per_element: int = 4,
    dropout_mask_bytes: int = 4,
    dtype: str | None = None,
) -> CheckpointPrediction:
    """What checkpointing every ``every``-th block (None: no block) keeps, per the formulas.

    ``dtype`` is the run's (``TrainConfig.dtype``): "float32", or "bfloat16"/"float16" for
    autocast over float32 weights (``formulas.activation_bytes_per_layer(autocast=True)``,
    whose per-layer bytes include autocast's 16-bit weight copies, 12h² values a layer, which
    do not grow with the batch: a per-sequence figure is the difference between two batches).
    Without ``dtype``, ``bytes_per_element`` 4 is float32 training and 2 a model stored in 16
    bits. ``dropout_mask_bytes``: 4 for PyTorch's CPU dropout in float32, 1 for CUDA's; used
    only when ``cfg.dropout > 0``. The block input stays 4 bytes per value: the residual
    stream is float32 in labkit's GPT.
    """
    if dtype is not None:
        bytes_per_element = 4 if training_dtype(dtype) == "float32" else 2
    if every is not None:
        every = whole("every", every, low=1, why=EVERY_MEANS + "; None: no checkpointing")
    s = _context_seq_len(cfg, seq_len)
    b = whole("micro_batch", micro_batch, low=1)
    per_layer = activation_bytes_per_layer(
        s, b, cfg.d_model, cfg.n_head, bytes_per_element=bytes_per_element,
        dropout=cfg.dropout > 0, dropout_mask_bytes=dropout_mask_bytes, attention="flash",
        autocast=dtype is not None and dtype != "float32",
    )  # fmt: skip
    checkpointed = 0 if every is None else len(range(0, cfg.n_layer, every))
    return CheckpointPrediction(checkpointed=checkpointed, n_layer=cfg.n_layer,
                                per_layer_bytes=per_layer, input_bytes=s * b * cfg.d_model * 4)  # fmt: skip


@dataclass(frozen=True)
class RecomputePrediction:
    """Bytes one block holds for the backward and FLOPs re-run, for one recompute mode (predicted).

    Per block and micro-batch of ``micro_batch`` sequences of ``seq_len`` tokens, float32,
    dropout off, flash attention (``F.scaled_dot_product_attention``'s fused kernel). Terms,
    with sbh = seq_len·micro_batch·d_model values of 4 bytes and a = heads:

    * ``"none"``: ``formulas.activation_bytes_per_layer`` (16·sbh values and the 4·a·s·b-byte
      log-sum-exp) plus LayerNorm's mean and rstd (2 norms × 2 × 4·s·b bytes), which that
      formula leaves out: 64·sbh + 4·asb + 16·sb bytes;
    * ``"selective"``: the block input (sbh) and the outputs of the matmuls and the attention
      kernel the policy keeps: q, k, v (3·sbh), the attention output and its log-sum-exp
      (sbh + a·s·b), the output projection (sbh), the MLP's two linears (4·sbh + sbh):
      44·sbh + 4·asb bytes;
    * ``"full"``: the block input alone, 4·sbh bytes.

    Measured (``labkit.batching.recomputation.measure_held_bytes``, torch 2.13, CPU, float32):
    exact to the byte for each mode. On CUDA (an H200, torch 2.11, float32) 16 bytes more per block in "none" and
    "selective": the attention kernel's int64 random-number seed and offset, not counted here.
    """

    mode: str
    n_layer: int
    per_layer_bytes: float
    none_per_layer_bytes: float
    outside_bytes: float
    """Held outside the blocks, the same in every mode: the final LayerNorm's input, output and
    statistics, the log-softmax output, the position ids, the loss and its total_weight
    (``formulas.activation_bytes_omitted`` less the blocks' LayerNorm statistics, counted in
    ``per_layer_bytes``, and less the token ids, which exist before the forward)."""
    recompute_flops_per_token: float
    """FLOPs re-run in the backward, per token, all blocks (modelled; see predict_recompute)."""
    step_flops_per_token: float
    """FLOPs of one training step without recompute, per token (formulas.flops_per_token)."""

    @property
    def held_bytes(self) -> float:
        """The whole model, one micro-batch: held from the forward into the backward."""
        return self.n_layer * self.per_layer_bytes + self.outside_bytes

    @property
    def saving_bytes(self) -> float:
        """Held bytes less than with no recompute."""
        return self.n_layer * (self.none_per_layer_bytes - self.per_layer_bytes)

    @property
    def flops_factor(self) -> float:
        """Training FLOPs of a step with this recompute over those without."""
        return 1 + self.recompute_flops_per_token / self.step_flops_per_token


ELEMENTWISE_FLOPS_PER_TOKEN_PER_LAYER = 50
"""Modelled FLOPs per token per d_model of a block's non-matmul forward ops, re-run under
selective recompute: two LayerNorms (~8 FLOPs per element each: mean, subtract, square, mean,
rsqrt, scale, shift), tanh-GELU on 4·h elements (~8 each) and two residual adds (1 each):
(2·8 + 4·8 + 2)·h = 50·h. An order of magnitude, not a count of kernel instructions."""


def predict_recompute(
    cfg: GPTShape, micro_batch: int, mode: str, *, seq_len: int | None = None
) -> RecomputePrediction:
    """What a block holds and what the backward re-runs under ``mode`` (``AC_MODES``), predicted.

    FLOPs per token (the ``"full"`` attention convention of ``formulas.flops_per_token``, N
    without the position table): a step is 6N + 12·L·h·s, three passes of a forward of 2N +
    4·L·h·s. ``"full"`` re-runs the blocks' forward but their last matmul, L·(16h² + 4hs):
    torch's non-reentrant checkpoint stops the rerun once it has rebuilt the last tensor the
    backward needs ("early stop", on by default, ``torch.utils.checkpoint.set_checkpoint_early_
    stop``), and nothing needs the MLP output projection's output (8h² per token). So a little
    less than one pass more, less again for the output head's share. ``"selective"`` re-runs no
    matmul and no attention kernel; only the elementwise ops,
    ``ELEMENTWISE_FLOPS_PER_TOKEN_PER_LAYER``·h per layer (modelled).
    """
    if mode not in AC_MODES:
        raise ValueError(f"mode={mode!r} is not allowed: one of {', '.join(map(repr, AC_MODES))}")
    if cfg.dropout > 0:
        raise ValueError(
            f"cfg.dropout={cfg.dropout!r}: the prediction is for dropout off; "
            "use a config with dropout=0.0 (every preset has it)"
        )
    s = _context_seq_len(cfg, seq_len)
    b = whole("micro_batch", micro_batch, low=1)
    L, h, a = cfg.n_layer, cfg.d_model, cfg.n_head
    sbh = s * b * h
    none = (
        activation_bytes_per_layer(
            s, b, h, a, bytes_per_element=4, dropout=False, attention="flash"
        )
        + 2 * 2 * 4 * s * b
    )
    per_layer = {"none": none, "selective": 4 * (11 * sbh) + 4 * a * s * b, "full": 4 * sbh}[mode]
    omitted = activation_bytes_omitted(L, s, b, h, cfg.vocab_size)
    outside = (omitted.total - 2 * L * 2 * 4 * s * b  # the blocks' LayerNorm statistics
               - 2 * 8 * s * b  # the token ids and targets: allocated before the forward
               + 4)  # the loss itself  # fmt: skip
    n_params = gpt_params(cfg.vocab_size, h, L, tied=cfg.tie_weights)
    step = flops_per_token(n_params, L, h, s, attention="full")
    recompute = {
        "none": 0.0,
        "full": L * (16 * h * h + 4 * h * s),
        "selective": L * ELEMENTWISE_FLOPS_PER_TOKEN_PER_LAYER * h,
    }[mode]
    return RecomputePrediction(mode=mode, n_layer=L, per_layer_bytes=per_layer,
                               none_per_layer_bytes=none, outside_bytes=outside,
                               recompute_flops_per_token=recompute,
                               step_flops_per_token=step)  # fmt: skip


def paper_bytes_per_layer(
    seq_len: int, micro_batch: int, d_model: int, n_head: int, mode: str
) -> float:
    """Korthikanti et al. 2022's activation bytes per layer (16-bit, dropout on, s×s stored).

    ``"none"``: s·b·h·(34 + 5·a·s/h) (``formulas.activation_bytes_per_layer``'s defaults);
    ``"selective"``: 34·s·b·h, the attention core's 5·a·s²·b recomputed; ``"full"``: 2·s·b·h,
    the layer's 16-bit input alone. The paper's convention, not this GPT's.
    """
    if mode not in AC_MODES:
        raise ValueError(f"mode={mode!r} is not allowed: one of {', '.join(map(repr, AC_MODES))}")
    s, b = whole("seq_len", seq_len, low=1), whole("micro_batch", micro_batch, low=1)
    h, a = whole("d_model", d_model, low=1), whole("n_head", n_head, low=1)
    if mode == "none":  # the formula's defaults are the paper's: 16-bit, 1-byte masks, s×s stored
        return activation_bytes_per_layer(s, b, h, a)
    return {"selective": 34 * s * b * h, "full": 2 * s * b * h}[mode]


def segment_checkpoint_bytes(n_layer: int, per_layer_bytes: float, input_bytes: float,
                             segments: int | None) -> float:  # fmt: skip
    """Activation bytes held at the worst moment with the layers cut into checkpointed segments.

    Chen et al. 2016 (arXiv 1604.06174, §4): keep only each segment's input through the
    forward, and in the backward rebuild one segment at a time. With k segments of at most
    ⌈n/k⌉ layers the most held at once is k inputs plus one rebuilt segment::

        k · input_bytes + ⌈n / k⌉ · per_layer_bytes

    k = √n gives their O(√n) memory. ``segments=None``: no checkpointing, n · per_layer_bytes;
    ``segments=n_layer`` is checkpointing every block. Modelled: per-layer bytes from the
    formulas (``predict_checkpointing``), as for a chain of equal layers.
    """
    n = whole("n_layer", n_layer, low=1)
    for name, v in (("per_layer_bytes", per_layer_bytes), ("input_bytes", input_bytes)):
        if not (isinstance(v, (int, float)) and v >= 0):
            raise ValueError(f"{name}={v!r} is not allowed: a number of bytes >= 0")
    if segments is None:
        return n * per_layer_bytes
    k = whole("segments", segments, low=1)
    if k > n:
        raise ValueError(f"segments={k} is not allowed: at most n_layer={n} (one layer each)")
    return k * input_bytes + -(-n // k) * per_layer_bytes
