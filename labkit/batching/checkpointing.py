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

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

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
