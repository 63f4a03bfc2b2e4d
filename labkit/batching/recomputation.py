"""Activation checkpointing on a GPT's blocks, applied from outside the model.

A checkpointed block keeps only its input for the backward pass; everything it computes
inside is thrown away after the forward and recomputed when backward reaches it (Chen et al.
2016, "Training Deep Nets with Sublinear Memory Cost"). Memory for activations falls, and
each checkpointed block runs its forward twice per step.

As in torchtitan's ``apply_ac``, the model knows nothing about it: :func:`apply_checkpointing`
swaps blocks in ``model.blocks`` for a small :class:`CheckpointedBlock` that calls the
original block through ``torch.utils.checkpoint.checkpoint``.

* ``use_reentrant=False``: the mode torch recommends (torch/utils/checkpoint.py, the
  ``checkpoint`` docstring: "It is recommended that you use ``use_reentrant=False``"). It
  works with ``torch.autograd.grad``, with inputs that do not require grad, and with the
  saved-tensor hooks that :func:`labkit.memory.measure_training_memory` uses to count bytes.
* Dropout stays correct: ``checkpoint`` keeps ``preserve_rng_state=True`` by default, stashing
  the CPU (and the input's device) RNG state before the forward and restoring it for the
  recompute, so the recomputed dropout masks are the masks of the forward.
* Selective recomputation (Korthikanti et al. 2022): :func:`apply_ac` with ``"selective"``
  keeps the outputs of the matmuls and the attention kernel and recomputes only the cheap
  elementwise ops around them (PyTorch's ``create_selective_checkpoint_contexts``); see the
  section "Selective recomputation" below for why that, and not the attention core, is the
  selective choice for a GPT whose attention is a fused SDPA kernel.
* ``state_dict`` keys do not change. The wrapper holds the block as ``self.block``, which would
  add ``.block`` to every key (``blocks.0.block.ln_1.weight``); two state-dict hooks strip it on
  save and add it back on load, as torch's own ``checkpoint_wrapper`` does
  (torch/distributed/algorithms/_checkpoint/checkpoint_wrapper.py). So a checkpoint saved with
  or without checkpointing loads into either. ``named_parameters()`` does show the extra
  ``.block`` level: match parameters by ``state_dict`` key or by position, not by that name.

Notebook 05's measurements of checkpointing and the text it prints are in
:mod:`labkit.batching.recomputation_report`, re-exported here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from labkit import formulas

# Notebook 05's measurements and text, from recomputation_report (see the docstring)
from labkit.batching.recomputation_report import CheckpointingMemory as CheckpointingMemory
from labkit.batching.recomputation_report import CheckpointingTime as CheckpointingTime
from labkit.batching.recomputation_report import (
    describe_checkpointed_found as describe_checkpointed_found,
)
from labkit.batching.recomputation_report import (
    describe_checkpointed_peak as describe_checkpointed_peak,
)
from labkit.batching.recomputation_report import describe_memory_levers as describe_memory_levers
from labkit.batching.recomputation_report import measure_checkpointing as measure_checkpointing
from labkit.batching.recomputation_report import time_checkpointing as time_checkpointing
from labkit.batching.trials import _dtype
from labkit.config import ModelConfig
from labkit.validate import whole

_PREFIX = "block."
_EVERY = "1 checkpoints every block, 2 every other block, ..."  # what `every` means, in refusals


class CheckpointedBlock(nn.Module):
    """Runs ``block`` under non-reentrant activation checkpointing; same state_dict keys.

    ``selective=True`` keeps the outputs of the ops :func:`selective_policy` saves (matmuls
    and the attention kernel) through the backward and recomputes only the rest.
    """

    def __init__(self, block: nn.Module, *, selective: bool = False) -> None:
        super().__init__()
        self.block = block
        self.selective = selective
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.selective:
            return checkpoint(self.block, x, use_reentrant=False, context_fn=_selective_contexts)
        return checkpoint(self.block, x, use_reentrant=False)


def _strip_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    # "blocks.0.block.ln_1.weight" -> "blocks.0.ln_1.weight"
    for key in [k for k in state_dict if k.startswith(prefix + _PREFIX)]:
        state_dict[prefix + key[len(prefix + _PREFIX):]] = state_dict.pop(key)


def _add_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    # The reverse, so that an unwrapped model's state_dict loads into a wrapped one.
    for key in [k for k in state_dict
                if k.startswith(prefix) and not k.startswith(prefix + _PREFIX)]:
        state_dict[prefix + _PREFIX + key[len(prefix):]] = state_dict.pop(key)


def apply_checkpointing(model: nn.Module, every: int = 1) -> list[str]:
    """Checkpoint every ``every``-th block of ``model.blocks`` in place (blocks 0, every, ...).

    ``every=1`` checkpoints all blocks (least memory, one extra forward per step);
    ``every=2`` every other block (about half the saving for half the recompute).
    Returns the names of the wrapped blocks, e.g. ``["blocks.0", "blocks.2"]``.
    """
    every = whole("every", every, low=1, why=_EVERY)
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no `blocks` nn.ModuleList: "
                         "apply_checkpointing takes a labkit.model.GPT (or a model shaped like it)")
    if any(isinstance(b, CheckpointedBlock) for b in blocks):
        raise ValueError("this model's blocks are already checkpointed: apply_checkpointing "
                         "once per model (build a fresh model to change `every`)")
    names = []
    for i in range(0, len(blocks), every):
        blocks[i] = CheckpointedBlock(blocks[i])
        names.append(f"blocks.{i}")
    return names


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
    cfg: ModelConfig,
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
        bytes_per_element = 4 if _dtype(dtype) == "float32" else 2
    if every is not None:
        every = whole("every", every, low=1, why=_EVERY + "; None: no checkpointing")
    s = cfg.seq_len if seq_len is None else whole("seq_len", seq_len, low=1)
    if s > cfg.seq_len:
        raise ValueError(f"seq_len={s} is not allowed: the model's context is {cfg.seq_len} "
                         f"tokens; give 1..{cfg.seq_len}")
    b = whole("micro_batch", micro_batch, low=1)
    per_layer = formulas.activation_bytes_per_layer(
        s, b, cfg.d_model, cfg.n_head, bytes_per_element=bytes_per_element,
        dropout=cfg.dropout > 0, dropout_mask_bytes=dropout_mask_bytes, attention="flash",
        autocast=dtype is not None and dtype != "float32",
    )  # fmt: skip
    checkpointed = 0 if every is None else len(range(0, cfg.n_layer, every))
    return CheckpointPrediction(checkpointed=checkpointed, n_layer=cfg.n_layer,
                                per_layer_bytes=per_layer, input_bytes=s * b * cfg.d_model * 4)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Selective recomputation: keep what is expensive to recompute, recompute what is cheap.
#
# Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
# arXiv 2205.05198) recompute only the attention core (QKᵀ, softmax, dropout,
# ·V): its a·s²·b-sized tensors are most of a layer's activations at long sequences, and its
# FLOPs are few. labkit's GPT runs attention through ``F.scaled_dot_product_attention``, whose
# fused kernel (flash on CUDA and on CPU) already never stores the s×s matrix: it keeps a
# float32 log-sum-exp per row and recomputes the scores inside its own backward (Dao et al.
# 2022, FlashAttention, arXiv 2205.14135, section 3.1). So the paper's selective recompute is
# built into the kernel here, and checkpointing the attention core again would save nothing.
# What is left that is cheap to recompute and costs memory are the elementwise ops around the
# matmuls: the LayerNorms, GELU (its 4h-wide input and output are half of a block's saved
# bytes), the residual adds and the reshapes. The policy below is the same idea applied to
# them, with PyTorch's selective activation checkpointing (``create_selective_checkpoint_
# contexts``, torch.utils.checkpoint; torchtitan's ``apply_ac`` in "selective op" mode): keep
# the output of every matmul and of the attention kernel, recompute everything else.


def _op(name: str) -> Any:
    return getattr(torch.ops.aten, name).default


_SAVE_NAMES = ("mm", "addmm", "bmm", "baddbmm",
               "_scaled_dot_product_flash_attention_for_cpu",  # SDPA's fused kernel on a CPU
               "_scaled_dot_product_flash_attention",  # on CUDA (flash, efficient, cuDNN)
               "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_cudnn_attention")  # fmt: skip
SELECTIVE_SAVE_OPS = frozenset(_op(n) for n in _SAVE_NAMES if hasattr(torch.ops.aten, n))
"""The ops whose outputs :func:`selective_policy` keeps: matmuls and the fused attention kernels."""


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep matmul and attention-kernel outputs (MUST_SAVE); recompute every other op."""
    return (CheckpointPolicy.MUST_SAVE if op in SELECTIVE_SAVE_OPS
            else CheckpointPolicy.PREFER_RECOMPUTE)  # fmt: skip


_selective_contexts = functools.partial(create_selective_checkpoint_contexts, selective_policy)

AC_MODES = ("none", "selective", "full")


def apply_ac(model: nn.Module, mode: str) -> list[str]:
    """Activation recomputation for every block of ``model.blocks``, in place (torchtitan style).

    * ``"none"``: nothing changes; every block keeps all it saves for the backward.
    * ``"full"``: each block keeps only its input and reruns its whole forward in the backward
      (:func:`apply_checkpointing` with ``every=1``): about one more forward of the blocks.
    * ``"selective"``: each block keeps its input and the outputs of its matmuls and attention
      kernel (:func:`selective_policy`); the backward reruns only the LayerNorms, GELU, the
      residual adds and reshapes, using the kept outputs instead of redoing the matmuls.

    Loss and gradients are the same to the bit on a CPU (the recompute runs the same ops on the
    same inputs). Returns the names of the wrapped blocks (none for ``"none"``).
    """
    if mode not in AC_MODES:
        raise ValueError(f"mode={mode!r} is not allowed: one of {', '.join(map(repr, AC_MODES))}")
    if mode == "none":
        return []
    if mode == "full":
        return apply_checkpointing(model, every=1)
    apply_checkpointing(model, every=1)  # validates the model, then makes the blocks selective
    for block in model.blocks:
        block.selective = True
    return [f"blocks.{i}" for i in range(len(model.blocks))]


def measure_held_bytes(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Bytes a forward of ``model`` leaves alive for its backward (measured, tensor accounting).

    Every storage allocated during the forward and still alive when the backward would start,
    with the logits dropped and the loss kept: what autograd saved, plus, under selective
    checkpointing, the outputs its policy caches. Those are held in the checkpoint's own
    cache, not through ``saved_tensors_hooks``, so :func:`labkit.memory.saved_activation_bytes`
    does not see them; :class:`labkit.batching.trials.LiveTensorBytes` counts every storage an
    op creates until it is freed, and does. The token ids exist before the forward and are not
    counted. Runs a real backward afterwards (gradients accumulate in ``model``).
    """
    from labkit.batching.trials import LiveTensorBytes

    x, y = batch
    model.train()
    with LiveTensorBytes() as counter:
        loss = model(x, y)[1]  # the logits are freed here: the loss saved its log-softmax
        held = counter.current
        loss.backward()
    return held


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

    Measured (:func:`measure_held_bytes`, torch 2.13, CPU, float32): exact to the byte for each
    mode. On CUDA (an H200, torch 2.11, float32) 16 bytes more per block in "none" and
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


def predict_recompute(cfg: ModelConfig, micro_batch: int, mode: str, *,
                      seq_len: int | None = None) -> RecomputePrediction:
    """What a block holds and what the backward re-runs under ``mode`` (``AC_MODES``), predicted.

    FLOPs per token (the ``"full"`` attention convention of ``formulas.flops_per_token``, N
    without the position table): a step is 6N + 12·L·h·s, three passes of a forward of 2N +
    4·L·h·s. ``"full"`` re-runs the blocks' forward but their last matmul, L·(16h² + 4hs):
    torch's non-reentrant checkpoint stops the rerun once it has rebuilt the last tensor the
    backward needs ("early stop", on by default, ``torch.utils.checkpoint.set_checkpoint_early_
    stop``), and nothing needs the MLP output projection's output (8h² per token). So a little
    less than one pass more, less again for the output head's share. ``"selective"`` re-runs no matmul and no attention kernel; only
    the elementwise ops, ``ELEMENTWISE_FLOPS_PER_TOKEN_PER_LAYER``·h per layer (modelled).
    """
    if mode not in AC_MODES:
        raise ValueError(f"mode={mode!r} is not allowed: one of {', '.join(map(repr, AC_MODES))}")
    if cfg.dropout > 0:
        raise ValueError(f"cfg.dropout={cfg.dropout!r}: the prediction is for dropout off; "
                         "use a config with dropout=0.0 (every preset has it)")
    s = cfg.seq_len if seq_len is None else whole("seq_len", seq_len, low=1)
    if s > cfg.seq_len:
        raise ValueError(f"seq_len={s} is not allowed: the model's context is {cfg.seq_len} "
                         f"tokens; give 1..{cfg.seq_len}")
    b = whole("micro_batch", micro_batch, low=1)
    L, h, a = cfg.n_layer, cfg.d_model, cfg.n_head
    sbh = s * b * h
    none = formulas.activation_bytes_per_layer(
        s, b, h, a, bytes_per_element=4, dropout=False, attention="flash") + 2 * 2 * 4 * s * b
    per_layer = {"none": none, "selective": 4 * (11 * sbh) + 4 * a * s * b, "full": 4 * sbh}[mode]
    omitted = formulas.activation_bytes_omitted(L, s, b, h, cfg.vocab_size)
    outside = (omitted.total - 2 * L * 2 * 4 * s * b  # the blocks' LayerNorm statistics
               - 2 * 8 * s * b  # the token ids and targets: allocated before the forward
               + 4)  # the loss itself  # fmt: skip
    n_params = formulas.gpt_params(cfg.vocab_size, h, L, tied=cfg.tie_weights)
    step = formulas.flops_per_token(n_params, L, h, s, attention="full")
    recompute = {"none": 0.0, "full": L * (16 * h * h + 4 * h * s),
                 "selective": L * ELEMENTWISE_FLOPS_PER_TOKEN_PER_LAYER * h}[mode]
    return RecomputePrediction(mode=mode, n_layer=L, per_layer_bytes=per_layer,
                               none_per_layer_bytes=none, outside_bytes=outside,
                               recompute_flops_per_token=recompute,
                               step_flops_per_token=step)  # fmt: skip


def paper_bytes_per_layer(seq_len: int, micro_batch: int, d_model: int, n_head: int,
                          mode: str) -> float:
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
        return formulas.activation_bytes_per_layer(s, b, h, a)
    return {"selective": 34 * s * b * h, "full": 2 * s * b * h}[mode]


def one_f_one_b_in_flight(stages: int, micro_batches: int) -> list[int]:
    """Micro-batches each pipeline stage holds at once under 1F1B: min(p - i, m) for stage i.

    Stage i runs p - i forwards before its first backward (PipeDream-Flush, Narayanan et al.
    2021, arXiv 2104.04473, section 2.2), then one backward frees one micro-batch for each new
    forward. So the first stage holds p micro-batches' activations, the last one; GPipe holds
    all m on every stage.
    """
    p = whole("stages", stages, low=1)
    m = whole("micro_batches", micro_batches, low=1)
    return [min(p - i, m) for i in range(p)]


def measure_in_flight_bytes(stage: nn.Module, inputs: list[torch.Tensor]) -> list[int]:
    """Live bytes a pipeline stage holds after each of its forwards, none backward yet (measured).

    Each input is cloned inside the count (the receive buffer a stage fills), made to require
    grad (a stage sends its input's gradient back), and run through ``stage``; every output is
    kept, as a 1F1B stage keeps each micro-batch it has sent on until its backward. Returns the
    bytes alive after 1, 2, ... forwards; then runs the backwards, so nothing leaks.
    """
    from labkit.batching.trials import LiveTensorBytes

    if not inputs:
        raise ValueError("inputs is empty: give one activation tensor per micro-batch in flight")
    outputs, held = [], []
    with LiveTensorBytes() as counter:
        for x in inputs:
            received = x.detach().clone().requires_grad_(True)
            outputs.append(stage(received))
            del received
            held.append(counter.current)
        for out in outputs:
            out.sum().backward()
        outputs.clear()
    return held


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


# ----------------------------------------------------------------------------------------------
# The peak of a checkpointed training step, tensor by tensor.

_BLOCK_PARAMETERS = 16
"""Parameter tensors per block of labkit's GPT: 2 LayerNorms × 2, q/k/v/proj × 2, fc/proj × 2."""


def checkpointed_step_moments(cfg: ModelConfig, micro_batch: int, *, dtype: str = "float32",
                              seq_len: int | None = None) -> list:  # fmt: skip
    """The tensors alive at each candidate peak of a step with every block checkpointed.

    The step is ``labkit.train.train_step`` in steady state (AdamW's moments exist, gradients
    set to None, one micro-batch) on a GPT whose blocks are all checkpointed
    (:func:`apply_checkpointing` with ``every=1``, ``apply_ac(model, "full")``). Read from what
    autograd and ``torch.utils.checkpoint`` (non-reentrant, early stop on) do in
    ``labkit.model.GPT``, the live bytes can peak at three kinds of moment; this lists them
    all, in the order they happen, as :class:`labkit.memory.StepPeak` objects, and
    :func:`predicted_checkpointed_step_peak` takes the largest:

    1. **the loss's backward** (``log_softmax``'s backward), as without checkpointing
       (:func:`labkit.memory.predicted_step_peak`), except that each block has kept only its
       input (the float32 residual stream, s·b·h·4 bytes), not its activations;
    2. **each block's MLP output projection's backward**, at its weight gradient's matmul: the
       block has been rebuilt (the checkpoint reruns its forward when the backward first needs a
       saved tensor of it), and the projection's input (the GELU output) is still held;
    3. **each block's GELU backward**, the projection's backward done and its input released.

    At 2 and 3 the rest of what is alive is the same: the inputs of this block and the blocks
    before it; the logits (``train_step`` keeps them); the output head's and final
    LayerNorm's gradients; the gradient arriving at the block's output; the gradients of every
    later block's parameters; the block's rebuilt activations (what its forward saves, as in
    ``predicted_step_peak``); the gradient of the GELU output. One block further back adds that
    block's parameter gradients and drops one block input. Under autocast, moment 2 also holds
    the projection's 16-bit weight copy and the arriving gradient cast to 16 bits, and its
    weight gradient is 16-bit; in float32 moment 3 is the larger (by the bias gradient), under
    bf16 autocast moment 2 (by those copies).

    Measured (torch 2.13, CPU; tests/test_batching_checkpointing.py): every moment equals the
    live tensor bytes (:class:`labkit.batching.trials.LiveTensorBytes`) at its op to the byte,
    and the largest equals the step's measured peak
    (:func:`labkit.batching.trials.measure_step_peak`), for the smoke and lab presets at b = 2
    to 33 in float32 and under bf16 autocast. At b = 1 the step peaks elsewhere (in the
    optimizer step: 1,024 B above the largest moment in float32, up to 230,912 B under bf16),
    where a batch's activations are small beside the model states. Not predicted: what
    :func:`labkit.memory.predicted_step_peak` leaves out (scratch memory inside one op, the
    CUDA context and workspaces); :attr:`labkit.memory.StepPeak.cuda_bytes` rounds each tensor
    as the CUDA allocator does. Dropout off (every preset).
    """
    from labkit import memory  # layer 3

    if cfg.dropout > 0:
        raise ValueError(f"cfg.dropout={cfg.dropout!r}: the prediction is for dropout off; "
                         "use a config with dropout=0.0 (every preset has it)")
    b = whole("micro_batch", micro_batch, low=1)
    s = cfg.seq_len if seq_len is None else whole("seq_len", seq_len, low=1)
    if s > cfg.seq_len:
        raise ValueError(f"seq_len={s} is not allowed: the model's context is {cfg.seq_len} "
                         f"tokens; give 1..{cfg.seq_len}")
    L, h, a, V = cfg.n_layer, cfg.d_model, cfg.n_head, cfg.vocab_size
    e = formulas.dtype_bytes(_dtype(dtype))
    mixed = e < 4
    r = 4  # the residual stream: float32 under autocast too
    sbh = s * b * h
    shapes = memory._gpt_parameter_shapes(cfg)
    params = tuple(4 * n for n in shapes)
    block_grads = tuple(4 * n for n in shapes[2:2 + _BLOCK_PARAMETERS])  # after wte, wpe
    common: dict[str, tuple[int, ...]] = {
        "parameters": params,
        "optimizer state (AdamW exp_avg, exp_avg_sq)": params * 2,
        "token ids, targets and position ids": (8 * s * b, 8 * s * b, 8 * s),
        "logits (kept by train_step's forward result)": (e * s * b * V,),
        "loss and its seed gradient": (4, 4),
    }
    loss = dict(common)
    loss[f"saved: the {L} checkpointed blocks' inputs"] = (r * sbh,) * L
    loss["saved: final LayerNorm input, output and statistics"] = (r * sbh, e * sbh, 4 * s * b,
                                                                   4 * s * b)  # fmt: skip
    if mixed:
        loss["saved: output head 16-bit weight copy"] = (e * V * h,)
    loss["saved: log-softmax output (float32)"] = (4 * s * b * V,)
    loss["gradients of the log-softmax output and of the logits"] = (4 * s * b * V,) * 2
    moments = [memory.StepPeak(tensors=loss, moment="the loss's backward: log_softmax's "
                               "backward, before any parameter gradient exists")]  # fmt: skip
    rebuilt = {
        "rebuilt: LayerNorm mean and rstd (2 norms)": (4 * s * b,) * 4,
        "rebuilt: q/k/v projections' input": (e * sbh,) * (3 if mixed else 1),
        "rebuilt: Q, K, V (SDPA's inputs)": (e * sbh,) * 3,
        "rebuilt: attention output and log-sum-exp": (e * sbh, 4 * a * s * b),
        "rebuilt: residual stream after attention, MLP input": (r * sbh, e * sbh),
        "rebuilt: GELU input (fc output)": (4 * e * sbh,),
    }
    if mixed:
        rebuilt["rebuilt: 16-bit weight copies (q, k, v, attention proj, fc)"] = (
            (e * h * h,) * 4 + (e * 4 * h * h,))
    for j in range(L):  # j blocks after this one have finished their backward
        before = dict(common)
        before[f"saved: inputs of blocks 0..{L - 1 - j}"] = (r * sbh,) * (L - j)
        before["gradients: output head weight, final LayerNorm weight and bias"] = (
            4 * V * h, 4 * h, 4 * h)
        before["gradient arriving at the block's output"] = (r * sbh,)
        if j:
            before[f"gradients of the {j} later block(s)' parameters"] = block_grads * j
        before.update(rebuilt)
        before["MLP backward: gradient of the GELU output"] = (4 * e * sbh,)
        proj = dict(before)  # the output projection's backward, its weight gradient allocated
        proj["rebuilt: GELU output (the output projection's input)"] = (4 * e * sbh,)
        if mixed:
            proj["rebuilt: the output projection's 16-bit weight copy"] = (e * 4 * h * h,)
            proj["the arriving gradient cast to 16 bits"] = (e * sbh,)
        proj["MLP backward: the output projection's weight gradient"] = (e * 4 * h * h,)
        gelu = dict(before)  # GELU's backward, the projection's backward done
        gelu["MLP backward: the output projection's weight and bias gradients (float32)"] = (
            4 * 4 * h * h, 4 * h)
        gelu["MLP backward: GELU's input gradient"] = (4 * e * sbh,)
        block = L - 1 - j
        moments.append(memory.StepPeak(tensors=proj, moment=f"block {block}'s MLP output "
                                       "projection's backward (its weight gradient), the block "
                                       "rebuilt"))  # fmt: skip
        moments.append(memory.StepPeak(tensors=gelu, moment=f"block {block}'s GELU backward, "
                                       "the block rebuilt"))  # fmt: skip
    return moments


def predicted_checkpointed_step_peak(cfg: ModelConfig, micro_batch: int, *,
                                     dtype: str = "float32", seq_len: int | None = None) -> Any:
    """The largest of :func:`checkpointed_step_moments`: the predicted peak of a training step
    with every block checkpointed, tensor by tensor (a :class:`labkit.memory.StepPeak`; see
    that function for what is counted, how it was checked and where it falls short). Not in
    :mod:`labkit.formulas`: it models this code's own tensors at each moment of the step."""
    return max(checkpointed_step_moments(cfg, micro_batch, dtype=dtype, seq_len=seq_len),
               key=lambda m: m.bytes)
