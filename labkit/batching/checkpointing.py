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
* ``state_dict`` keys do not change. The wrapper holds the block as ``self.block``, which would
  add ``.block`` to every key (``blocks.0.block.ln_1.weight``); two state-dict hooks strip it on
  save and add it back on load, as torch's own ``checkpoint_wrapper`` does
  (torch/distributed/algorithms/_checkpoint/checkpoint_wrapper.py). So a checkpoint saved with
  or without checkpointing loads into either. ``named_parameters()`` does show the extra
  ``.block`` level: match parameters by ``state_dict`` key or by position, not by that name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from labkit import formulas
from labkit.config import ModelConfig

_PREFIX = "block."


class CheckpointedBlock(nn.Module):
    """Runs ``block`` under non-reentrant activation checkpointing; same state_dict keys."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every={every!r} is not allowed: an int >= 1 "
                         "(1 checkpoints every block, 2 every other block, ...)")
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
) -> CheckpointPrediction:
    """What checkpointing every ``every``-th block (None: no block) keeps, per the formulas.

    ``bytes_per_element`` 4 for float32 training (2 models a model stored in 16 bits; for
    autocast use the formula's ``autocast=True`` directly). ``dropout_mask_bytes``: 4 for
    PyTorch's CPU dropout in float32, 1 for CUDA's; used only when ``cfg.dropout > 0``. The
    block input stays 4 bytes per value: the residual stream is float32 in labkit's GPT.
    """
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"every={every!r} is not allowed: None (no checkpointing) or an int "
                         ">= 1 (1 checkpoints every block, 2 every other block, ...)")
    s = cfg.seq_len if seq_len is None else formulas._positive_int("seq_len", seq_len)
    if s > cfg.seq_len:
        raise ValueError(f"seq_len={s} is not allowed: the model's context is {cfg.seq_len} "
                         f"tokens; give 1..{cfg.seq_len}")
    b = formulas._positive_int("micro_batch", micro_batch)
    per_layer = formulas.activation_bytes_per_layer(
        s, b, cfg.d_model, cfg.n_head, bytes_per_element=bytes_per_element,
        dropout=cfg.dropout > 0, dropout_mask_bytes=dropout_mask_bytes, attention="flash",
    )  # fmt: skip
    checkpointed = 0 if every is None else len(range(0, cfg.n_layer, every))
    return CheckpointPrediction(checkpointed=checkpointed, n_layer=cfg.n_layer,
                                per_layer_bytes=per_layer, input_bytes=s * b * cfg.d_model * 4)  # fmt: skip
