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
:mod:`labkit.batching.recomputation_report`, re-exported here; so are the closed-form
predictions (what checkpointing and each recompute mode keep and re-run, 1F1B's micro-batches
in flight), which are in :mod:`labkit.formulas.recompute` and :mod:`labkit.formulas.pipeline`.
"""

from __future__ import annotations

import functools
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
from labkit.batching.trials import checked_dtype
from labkit.config import ModelConfig

# The closed-form predictions, from labkit.formulas (sizes in, bytes and FLOPs out)
from labkit.formulas.pipeline import one_f_one_b_in_flight as one_f_one_b_in_flight
from labkit.formulas.recompute import AC_MODES as AC_MODES
from labkit.formulas.recompute import (
    ELEMENTWISE_FLOPS_PER_TOKEN_PER_LAYER as ELEMENTWISE_FLOPS_PER_TOKEN_PER_LAYER,
)
from labkit.formulas.recompute import EVERY_MEANS
from labkit.formulas.recompute import CheckpointPrediction as CheckpointPrediction
from labkit.formulas.recompute import RecomputePrediction as RecomputePrediction
from labkit.formulas.recompute import paper_bytes_per_layer as paper_bytes_per_layer
from labkit.formulas.recompute import predict_checkpointing as predict_checkpointing
from labkit.formulas.recompute import predict_recompute as predict_recompute
from labkit.formulas.recompute import segment_checkpoint_bytes as segment_checkpoint_bytes
from labkit.op_kinds import ATTENTION, MATMUL, kind_of
from labkit.validate import whole

_PREFIX = "block."


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
    every = whole("every", every, low=1, why=EVERY_MEANS)
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


SELECTIVE_SAVE_KINDS = (MATMUL, ATTENTION)
"""The kinds of op (``labkit.op_kinds``) whose outputs :func:`selective_policy` keeps: the
matmuls and the fused attention kernels (``_scaled_dot_product_flash_attention_for_cpu`` on a
CPU; flash, efficient or cuDNN on CUDA)."""


@functools.cache
def saves_output(op_name: str) -> bool:
    """Whether :func:`selective_policy` keeps the output of the op called ``op_name``
    (``aten::mm``); cached, as the policy asks for every op of every checkpointed forward."""
    return kind_of(op_name) in SELECTIVE_SAVE_KINDS


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep matmul and attention-kernel outputs (MUST_SAVE); recompute every other op."""
    return (CheckpointPolicy.MUST_SAVE if saves_output(op.name())
            else CheckpointPolicy.PREFER_RECOMPUTE)  # fmt: skip


_selective_contexts = functools.partial(create_selective_checkpoint_contexts, selective_policy)

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
    as the CUDA allocator does. Dropout off (every preset). Not in :mod:`labkit.formulas`: it
    lists this code's own tensors, with ``formulas.gpt_parameter_counts`` and ``labkit.memory.StepPeak``.
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
    e = formulas.dtype_bytes(checked_dtype(dtype))
    mixed = e < 4
    r = 4  # the residual stream: float32 under autocast too
    sbh = s * b * h
    shapes = formulas.gpt_parameter_counts(cfg)
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
