"""ZeRO stage 1 from scratch: each rank keeps the optimizer state of 1/n of the parameters.

AdamW keeps two fp32 numbers per parameter (m and v): 8 bytes, twice the weights. Plain data
parallelism stores them on every rank, n identical copies. ZeRO-1 (Rajbhandari et al. 2019,
section 5.1) gives each rank one contiguous shard of the flattened parameters and the
optimizer state for that shard only:

    1. reduce-scatter the gradients: rank r receives the sum of everyone's gradients for its
       shard (n-1)/n·S bytes sent per rank;
    2. AdamW steps the shard, locally (1/n of the optimizer work, 1/n of its memory);
    3. all-gather the updated shards: every rank has all the new weights again, another
       (n-1)/n·S. Together the same volume as one all-reduce (ZeRO paper, section 7).

Parameters are made views into one flat buffer per optimizer group, so step 2 writes the
owned shard straight into the model's weights and step 3 fills in the rest. Parameters in a
group with weight decay and without (biases, LayerNorm) stay in separate buffers, so the
sharded AdamW applies exactly the hyperparameters ``labkit.train.make_optimizer`` does
(any torch optimizer whose update is elementwise can be sharded this way).

Gradients are reduced inside ``step()``, so micro-batches accumulate locally for free (no
``no_sync`` needed), and ``train_step``'s gradient clipping would see local gradients: the
config check rejects ``grad_clip`` with zero1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from labkit.parallel import comm
from labkit.parallel.dp_config import MakeOptimizer, Strategy


@dataclass
class _FlatGroup:
    params: list[nn.Parameter]
    offsets: list[int]
    flat: torch.Tensor  # (n * shard_numel,) all parameters of the group, zero-padded
    shard: nn.Parameter  # (shard_numel,) view of this rank's slice of ``flat``


class ShardedOptimizer:
    """The optimizer ``make(model)`` would build, run on this rank's shard of each of its
    parameter groups (the ZeRO-1 optimizer; AdamW in the labs).

    Has the parts of ``torch.optim.Optimizer`` that ``train_step`` and
    ``labkit.memory`` use: ``step``, ``zero_grad``, ``state`` and ``param_groups``.
    """

    def __init__(
        self,
        model: nn.Module,
        make: MakeOptimizer,
        rank: int,
        world_size: int,
        counter: comm.ByteCounter,
    ) -> None:
        self.rank, self.world_size, self.counter = rank, world_size, counter
        reference = make(model)  # the optimizer, groups and hyperparameters to mirror
        self.groups: list[_FlatGroup] = []
        inner_groups = []
        for group in reference.param_groups:
            params = [p for p in group["params"] if p.numel() > 0]
            if not params:
                continue
            fg = self._flatten(params)
            self.groups.append(fg)
            inner_groups.append(
                {**{k: v for k, v in group.items() if k != "params"}, "params": [fg.shard]}
            )
        self.inner = type(reference)(inner_groups)  # same class, shards as parameters

    def _flatten(self, params: list[nn.Parameter]) -> _FlatGroup:
        n = self.world_size
        total = sum(p.numel() for p in params)
        shard_numel = -(-total // n)  # ceil: pad so every rank owns an equal shard
        flat = torch.zeros(shard_numel * n, dtype=params[0].dtype, device=params[0].device)
        offsets, off = [], 0
        for p in params:
            flat[off : off + p.numel()].copy_(p.detach().reshape(-1))
            p.data = flat[off : off + p.numel()].view_as(p)  # the model now reads the buffer
            offsets.append(off)
            off += p.numel()
        lo = self.rank * shard_numel
        shard = nn.Parameter(flat[lo : lo + shard_numel])  # a view: shares flat's memory
        return _FlatGroup(params, offsets, flat, shard)

    @torch.no_grad()
    def step(self) -> None:
        for g in self.groups:
            # Gather this rank's gradients into one flat buffer (zeros for padding and for a
            # parameter without a gradient), then reduce-scatter: we receive our shard's sum.
            grads = torch.zeros_like(g.flat)
            for p, off in zip(g.params, g.offsets, strict=True):
                if p.grad is not None:
                    grads[off : off + p.numel()].copy_(p.grad.reshape(-1))
            shard_grad = torch.empty_like(g.shard)
            comm.reduce_scatter(shard_grad, grads, self.counter)
            g.shard.grad = shard_grad.div_(self.world_size)  # sum -> mean
        self.inner.step()  # updates the shard only, which writes into the model's weights
        for g in self.groups:
            # Everyone's updated shard -> every rank's full buffer (the model's weights).
            comm.all_gather(g.flat, g.shard.detach().clone(), self.counter)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.groups:
            g.shard.grad = None
            for p in g.params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    @property
    def state(self) -> Any:
        return self.inner.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups


class ZeRO1(Strategy):
    """Replicated weights and gradients; optimizer state sharded by flat-buffer slices."""

    name = "zero1"
    counting = "counted by our reduce_scatter and all_gather wrappers"

    def __init__(self, world_size: int, backend: str = "gloo", rank: int = 0) -> None:
        super().__init__(world_size, backend)
        self.rank = rank

    def wrap(self, model: nn.Module) -> nn.Module:
        # Nothing to wrap: communication happens in the optimizer. Every rank must start from
        # the same weights; the worker seeds every rank alike (DDP broadcasts rank 0's).
        return model

    def optimizer(self, model: nn.Module, make: MakeOptimizer) -> ShardedOptimizer:  # type: ignore[override]
        return ShardedOptimizer(model, make, self.rank, self.world_size, self.bytes_counter)
