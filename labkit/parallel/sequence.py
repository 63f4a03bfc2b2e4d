"""Sequence parallelism: tensor parallelism's replicated regions split along the sequence.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv 2205.05198), section 4.2.2. Megatron tensor parallelism (``labkit.parallel.tensor``)
splits attention and the MLP across t ranks, but every rank still runs the LayerNorms, the
dropouts and the residual adds on the whole (b, s, h) activation, and keeps what those save
for the backward pass: the paper's replicated "10·sbh" per layer. These operations act on each
token alone, so they can run on 1/t of the sequence instead. The all-reduce that ended a
tensor-parallel region then becomes a reduce-scatter *along the sequence* (sum the partial
outputs and keep only this rank's tokens), and the identity that began one becomes an
all-gather (every rank needs every token's input to its columns):

    TP:      f  identity    / all-reduce      g  all-reduce      / identity
    TP + SP: g  all-gather  / reduce-scatter  ḡ  reduce-scatter  / all-gather
                (forward    / backward)

(the paper's names; ``labkit.parallel.tensor`` calls TP's pair f and g as Megatron-LM did).
A ring all-reduce *is* a reduce-scatter followed by an all-gather, so the bytes each rank
sends are the same: 2(n−1)/n·S per all-reduce against (n−1)/n·S + (n−1)/n·S.

Two more things change, and this module does both the way Megatron-LM does:

* **The gathered input is not kept.** The q/k/v and MLP input matmuls need the whole sequence,
  and a plain all-gather would hand autograd the gathered (b, s, h) tensor to save: two of the
  ten replicated sbh would stay. Like the paper ("we store only the Y_i^s part ... and perform
  an extra all-gather in the backward pass"), :class:`_GatheredLinears` saves this rank's shard
  and gathers it again in the backward: 2 more all-gathers per layer, for the last 1/t of the
  memory. ``regather=False`` keeps the gathered tensor instead (what DTensor's plan does).
* **Parameters used on a shard see a shard of the tokens**: the LayerNorms' weights and
  biases and the biases added after a reduce-scatter get a partial gradient on each rank.
  :func:`sync_sequence_parallel_grads` sums them (one all-reduce of (6L + 2)·h floats) after
  the backward, before clipping and the optimiser step (Megatron-LM's
  ``finalize_model_grads``).

The GPT's embeddings and output head stay replicated as in ``apply_tensor_parallel``: the
embedding output is split along the sequence before the first block (no communication
forward, an all-gather of its gradient backward) and the final LayerNorm's output is
gathered before the head (an all-gather forward, a split backward).

    model = apply_sequence_parallel(GPT(cfg), world_size=2, rank=ctx.rank)   # in place
    _, loss = model(x, y)                 # same loss as the single-process GPT
    loss.backward()
    sync_sequence_parallel_grads(model)   # before clip and step

``apply_dtensor_sequence_parallel`` does the same with PyTorch's DTensor
(``SequenceParallel``, ``ColwiseParallel``, ``RowwiseParallel(output_layouts=Shard(1))``,
``PrepareModuleInput``). The activation-memory formulas of the paper's Table 2 are
tested functions, with the version for this course's GPT (float32, no dropout, fused
attention) that predicts to the byte what autograd saves on each rank: they, the config
check and the measurement live in ``labkit.parallel.sequence_costs``, re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from labkit.parallel import comm, tensor
from labkit.parallel.sequence_costs import LAYOUTS as LAYOUTS
from labkit.parallel.sequence_costs import MODES as MODES
from labkit.parallel.sequence_costs import LayerPrediction as LayerPrediction
from labkit.parallel.sequence_costs import LayoutPrediction as LayoutPrediction
from labkit.parallel.sequence_costs import Table2AtScale as Table2AtScale
from labkit.parallel.sequence_costs import collectives_per_step as collectives_per_step
from labkit.parallel.sequence_costs import layer_activation_bytes as layer_activation_bytes
from labkit.parallel.sequence_costs import layer_prediction as layer_prediction
from labkit.parallel.sequence_costs import (
    paper_activation_bytes_per_layer as paper_activation_bytes_per_layer,
)
from labkit.parallel.sequence_costs import predict_layouts as predict_layouts
from labkit.parallel.sequence_costs import (
    predicted_activations_per_rank as predicted_activations_per_rank,
)
from labkit.parallel.sequence_costs import relative as relative
from labkit.parallel.sequence_costs import ring_sent_per_rank as ring_sent_per_rank
from labkit.parallel.sequence_costs import saved_activation_bytes as saved_activation_bytes
from labkit.parallel.sequence_costs import table2_at_scale as table2_at_scale
from labkit.parallel.sequence_costs import (
    validate_sequence_parallel as validate_sequence_parallel,
)

SEQ_DIM = 1  # activations are (B, T, C): the sequence is dimension 1


# --- counting --------------------------------------------------------------------------------


@dataclass
class SeqCommCounter:
    """Collectives issued by this module, by kind and pass: calls and message bytes (NCCL-tests
    S), with the re-gathers (``regather=True``) and the embedding/head boundary gathers also
    tallied apart, so the all-gathers and reduce-scatters that *replace* TP's all-reduces can be
    compared with them alone."""

    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    extra_calls: dict[str, int] = field(default_factory=dict)
    extra_bytes: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, direction: str, message_bytes: int, extra: str | None = None) -> None:
        key = f"{kind} {direction}"
        self.calls[key] = self.calls.get(key, 0) + 1
        self.bytes[key] = self.bytes.get(key, 0) + message_bytes
        if extra is not None:
            self.extra_calls[extra] = self.extra_calls.get(extra, 0) + 1
            self.extra_bytes[extra] = self.extra_bytes.get(extra, 0) + message_bytes

    def reset(self) -> None:
        for d in (self.calls, self.bytes, self.extra_calls, self.extra_bytes):
            d.clear()

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {
            "calls": dict(self.calls),
            "bytes": dict(self.bytes),
            "extra_calls": dict(self.extra_calls),
            "extra_bytes": dict(self.extra_bytes),
        }


def _world(group: Any) -> int:
    return tdist.get_world_size(group) if tdist.is_initialized() else 1


def _rank(group: Any) -> int:
    return tdist.get_rank(group) if tdist.is_initialized() else 0


def _gather_seq(
    x: torch.Tensor,
    group: Any,
    counter: SeqCommCounter | None,
    direction: str,
    extra: str | None = None,
) -> torch.Tensor:
    """(B, T/n, C) on each rank -> (B, T, C), ranks' pieces in rank order along T."""
    n = _world(group)
    if counter is not None:
        counter.add("all_gather", direction, x.numel() * x.element_size() * n, extra)
    if n == 1:
        return x.contiguous().clone()
    # The collective concatenates along dim 0: bring T to the front, gather, put it back.
    xt = x.movedim(SEQ_DIM, 0).contiguous()
    out = xt.new_empty((xt.shape[0] * n, *xt.shape[1:]))
    comm.all_gather_fn()(out, xt, group=group)
    return out.movedim(0, SEQ_DIM).contiguous()


def _reduce_scatter_seq(
    x: torch.Tensor, group: Any, counter: SeqCommCounter | None, direction: str
) -> torch.Tensor:
    """(B, T, C) partial sums on each rank -> this rank's (B, T/n, C) of their total."""
    n = _world(group)
    if counter is not None:
        counter.add("reduce_scatter", direction, x.numel() * x.element_size())
    if n == 1:
        return x.contiguous().clone()
    xt = x.movedim(SEQ_DIM, 0).contiguous()
    out = xt.new_empty((xt.shape[0] // n, *xt.shape[1:]))
    comm.reduce_scatter_fn()(out, xt, group=group)
    return out.movedim(0, SEQ_DIM).contiguous()


def _split_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's T/n tokens of a (B, T, C) tensor every rank holds whole (no communication)."""
    n, r = _world(group), _rank(group)
    return x.chunk(n, dim=SEQ_DIM)[r].contiguous()


# --- the paper's g and ḡ, and the two boundary operators --------------------------------------


class GatherFromSequence(torch.autograd.Function):
    """g: all-gather along the sequence forward, reduce-scatter backward (paper, figure 5).

    Each rank's columns produce a partial gradient for every token of the gathered input;
    the reduce-scatter sums them and hands each rank its own tokens' total.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: Any, counter: SeqCommCounter | None
    ) -> torch.Tensor:
        ctx.group, ctx.counter = group, counter
        return _gather_seq(x, group, counter, "forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter_seq(grad, ctx.group, ctx.counter, "backward"), None, None


class ReduceScatterToSequence(torch.autograd.Function):
    """ḡ: reduce-scatter along the sequence forward, all-gather backward (paper, figure 5)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: Any, counter: SeqCommCounter | None
    ) -> torch.Tensor:
        ctx.group, ctx.counter = group, counter
        return _reduce_scatter_seq(x, group, counter, "forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather_seq(grad, ctx.group, ctx.counter, "backward"), None, None


class ScatterToSequence(torch.autograd.Function):
    """Enter the sequence-parallel region from a replicated tensor: keep this rank's tokens
    (forward, no communication); all-gather the gradient (backward), so everything upstream
    (the replicated embeddings) gets the whole, identical gradient on every rank."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: Any, counter: SeqCommCounter | None
    ) -> torch.Tensor:
        ctx.group, ctx.counter = group, counter
        return _split_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather_seq(grad, ctx.group, ctx.counter, "backward", "boundary"), None, None


class GatherToReplicated(torch.autograd.Function):
    """Leave the sequence-parallel region into replicated computation (the output head): an
    all-gather forward; backward, every rank holds the same whole gradient (the loss is
    computed identically everywhere), so each keeps its own tokens' part: a split, not a
    reduce-scatter (which would count the gradient n times)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: Any, counter: SeqCommCounter | None
    ) -> torch.Tensor:
        ctx.group = group
        return _gather_seq(x, group, counter, "forward", "boundary")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _split_seq(grad, ctx.group), None, None


class _GatheredLinears(torch.autograd.Function):
    """g fused with the column-parallel matmuls that read its output (q, k and v; or the MLP's
    fc), saving only this rank's shard of the input and gathering it again in the backward
    (paper, section 4.2.2, last paragraphs; Megatron-LM's linear layers do the same with
    ``sequence_parallel``). Outputs: one (B, T, out/n) tensor per layer."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, counter: SeqCommCounter | None,
                n_layers: int, *params: torch.Tensor | None) -> tuple[torch.Tensor, ...]:  # fmt: skip
        ctx.group, ctx.counter, ctx.n_layers = group, counter, n_layers
        weights, biases = params[:n_layers], params[n_layers:]
        ctx.has_bias = [bias is not None for bias in biases]
        full = _gather_seq(x, group, counter, "forward")  # (B, T, C): not saved
        ctx.save_for_backward(x, *weights)  # the shard, (B, T/n, C), and the weights
        return tuple(F.linear(full, w, bias) for w, bias in zip(weights, biases, strict=True))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        x, *weights = ctx.saved_tensors
        full = _gather_seq(x, ctx.group, ctx.counter, "backward", "regather")
        flat = full.flatten(0, -2)  # (B·T, C)
        grad_full = None
        grad_w, grad_b = [], []
        for g, w, has_bias in zip(grads, weights, ctx.has_bias, strict=True):
            g2 = g.flatten(0, -2)  # (B·T, out/n)
            grad_w.append(g2.t() @ flat)
            grad_b.append(g2.sum(0) if has_bias else None)
            part = g @ w  # (B, T, C): this layer's share of the input's gradient
            grad_full = part if grad_full is None else grad_full + part
        grad_x = _reduce_scatter_seq(grad_full, ctx.group, ctx.counter, "backward")
        return (grad_x, None, None, None, *grad_w, *grad_b)


def gathered_linears(
    x: torch.Tensor,
    layers: Sequence[nn.Module],
    group: Any,
    counter: SeqCommCounter | None,
    *,
    regather: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Each column-parallel layer applied to the sequence-gathered ``x`` (this rank's tokens).

    ``regather=True``: one autograd node that keeps only the shard (:class:`_GatheredLinears`);
    ``False``: g, then the layers, which save the gathered tensor (one storage for all)."""
    if not regather:
        full = GatherFromSequence.apply(x, group, counter)
        return tuple(F.linear(full, lin.weight, lin.bias) for lin in layers)
    return _GatheredLinears.apply(
        x, group, counter, len(layers), *(lin.weight for lin in layers),
        *(lin.bias for lin in layers))  # fmt: skip


# --- the parallel blocks -----------------------------------------------------------------------


class SequenceParallelRowLinear(tensor.RowParallelLinear):
    """Row-parallel linear ending in ḡ (reduce-scatter along the sequence) instead of g (an
    all-reduce): the output is this rank's (B, T/n, out) tokens, complete; the replicated bias
    is added to them after the sum, and its gradient is then partial (a shard of the tokens)."""

    def __init__(self, *args: Any, seq_counter: SeqCommCounter | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.seq_counter = seq_counter
        if self.bias is not None:
            self.bias.sequence_parallel = True  # type: ignore[attr-defined]

    @classmethod
    def from_row(cls, row: tensor.RowParallelLinear, seq_counter: SeqCommCounter | None
                 ) -> SequenceParallelRowLinear:  # fmt: skip
        layer = cls(row.in_features, row.out_features, world_size=row.world_size,
                    rank=row.rank, group=row.group, bias=row.bias is not None,
                    seq_counter=seq_counter)  # fmt: skip
        with torch.no_grad():
            layer.weight.copy_(row.weight)
            if row.bias is not None:
                layer.bias.copy_(row.bias)
        return layer.to(row.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ReduceScatterToSequence.apply(F.linear(x, self.weight), self.group, self.seq_counter)
        return y + self.bias if self.bias is not None else y


class SequenceParallelAttention(nn.Module):
    """Attention over this rank's heads, taking and returning this rank's tokens: g (all-gather)
    into q, k, v; ḡ (reduce-scatter) out of proj. Parameter names match the model's."""

    def __init__(self, q: nn.Module, k: nn.Module, v: nn.Module, proj: nn.Module, *,
                 head_dim: int, dropout: float, group: Any, counter: SeqCommCounter | None,
                 regather: bool) -> None:  # fmt: skip
        super().__init__()
        self.q, self.k, self.v, self.proj = q, k, v, proj
        self.head_dim, self.dropout = head_dim, dropout
        self.group, self.counter, self.regather = group, counter, regather
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hs = self.head_dim
        q, k, v = gathered_linears(x, (self.q, self.k, self.v), self.group, self.counter,
                                   regather=self.regather)  # (B, T, C/n) each  # fmt: skip
        B, T, _ = q.shape
        q, k, v = (t.view(B, T, -1, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh/n, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, C/n)
        return self.resid_dropout(self.proj(y))  # ḡ inside: (B, T/n, C), on the shard


class SequenceParallelMLP(nn.Module):
    """g into fc (column-parallel), GELU, proj (row-parallel) ending in ḡ."""

    def __init__(self, fc: nn.Module, proj: nn.Module, *, dropout: float, group: Any,
                 counter: SeqCommCounter | None, regather: bool) -> None:  # fmt: skip
        super().__init__()
        self.fc, self.proj = fc, proj
        self.group, self.counter, self.regather = group, counter, regather
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (h,) = gathered_linears(x, (self.fc,), self.group, self.counter, regather=self.regather)
        return self.dropout(self.proj(F.gelu(h, approximate="tanh")))  # (B, T/n, C)


def apply_sequence_parallel(
    model: nn.Module,
    *,
    world_size: int,
    rank: int,
    group: Any = None,
    counter: SeqCommCounter | None = None,
    regather: bool = True,
) -> nn.Module:
    """Make ``model`` (a ``labkit.model.GPT``) tensor- and sequence-parallel, in place.

    Attention and MLP are split as by ``tensor.apply_tensor_parallel`` (the same slices of the
    same weights), with g/ḡ (all-gather / reduce-scatter along the sequence) where TP has its
    all-reduces; LayerNorms, dropouts and residual adds run on this rank's seq_len/n tokens.
    Hooks on the model's own ``drop`` (split its input along the sequence) and ``lm_head``
    (gather its input) mark where the region begins and ends; ``labkit.model`` is untouched.
    After ``loss.backward()`` call :func:`sync_sequence_parallel_grads`. Dropout must be 0 for
    parity with one process (the masks of different tokens come from different ranks).
    """
    validate_sequence_parallel(model.cfg, world_size)
    tensor.apply_tensor_parallel(model, world_size=world_size, rank=rank, group=group)
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp  # tensor.ParallelAttention / ParallelMLP
        block.attn = SequenceParallelAttention(
            attn.q, attn.k, attn.v, SequenceParallelRowLinear.from_row(attn.proj, counter),
            head_dim=model.cfg.head_dim, dropout=model.cfg.dropout, group=group,
            counter=counter, regather=regather)  # fmt: skip
        block.mlp = SequenceParallelMLP(
            mlp.fc, SequenceParallelRowLinear.from_row(mlp.proj, counter),
            dropout=model.cfg.dropout, group=group, counter=counter, regather=regather)  # fmt: skip
        for norm in (block.ln_1, block.ln_2):
            for p in norm.parameters():
                p.sequence_parallel = True  # type: ignore[attr-defined]
    for p in model.ln_f.parameters():
        p.sequence_parallel = True  # type: ignore[attr-defined]
    model._sequence_parallel_hooks = [  # kept so they can be removed
        model.drop.register_forward_pre_hook(
            lambda _m, args: (ScatterToSequence.apply(args[0], group, counter),)),
        model.lm_head.register_forward_pre_hook(
            lambda _m, args: (GatherToReplicated.apply(args[0], group, counter),)),
    ]  # fmt: skip
    model._sequence_parallel_group = group
    return model


@torch.no_grad()
def sync_sequence_parallel_grads(
    model: nn.Module, group: Any = None, counter: SeqCommCounter | None = None
) -> int:
    """Sum, over the ranks, the gradients of parameters that saw only this rank's tokens
    (LayerNorms, biases after a reduce-scatter): one all-reduce of them flattened together.
    Call after the last backward of a step (after accumulation), before clipping. Returns the
    message bytes."""
    grads = [p.grad for p in model.parameters()
             if getattr(p, "sequence_parallel", False) and p.grad is not None]  # fmt: skip
    if not grads:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    nbytes = flat.numel() * flat.element_size()
    if counter is not None:
        counter.add("all_reduce", "backward", nbytes, "parameter gradients")
    if _world(group) > 1:
        tdist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return nbytes


# --- torch's own: DTensor's SequenceParallel ------------------------------------------------


def apply_dtensor_sequence_parallel(model: nn.Module, mesh: Any) -> nn.Module:
    """The same layout through DTensor's ``parallelize_module`` on a 1-D mesh, in place.

    Per block: ``SequenceParallel()`` on both LayerNorms (their input and output Shard(1),
    their parameters replicated DTensors whose partial gradients DTensor all-reduces),
    ``PrepareModuleInput`` from Shard(1) to Replicate() on attention and MLP (the all-gather,
    shared by q, k, v), ``ColwiseParallel`` on q, k, v, fc and ``RowwiseParallel(
    output_layouts=Shard(1))`` on the two projections (the reduce-scatter). Outside: the
    embedding output is redistributed Replicate() -> Shard(1) at ``drop`` (a local split;
    its backward an all-gather), ``SequenceParallel()`` on ``ln_f``, and the head's input
    Shard(1) -> Replicate() (an all-gather). PyTorch's TP tutorial and torchtitan's
    parallelize use the same styles:
    https://docs.pytorch.org/tutorials/intermediate/TP_tutorial.html
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    validate_sequence_parallel(model.cfg, mesh.size())
    to_replicated = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}
    plan = {
        "ln_1": SequenceParallel(),
        "attn": PrepareModuleInput(**to_replicated, use_local_output=False),
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln_2": SequenceParallel(),
        "mlp": PrepareModuleInput(**to_replicated, use_local_output=False),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        block.attn = tensor.ParallelAttention(attn.q, attn.k, attn.v, attn.proj,
                                              head_dim=model.cfg.head_dim,
                                              dropout=model.cfg.dropout)  # fmt: skip
        block.mlp = tensor.ParallelMLP(mlp.fc, mlp.proj, dropout=model.cfg.dropout)
        parallelize_module(block, mesh, plan)
    parallelize_module(model, mesh, {
        "drop": PrepareModuleInput(input_layouts=(Replicate(),),
                                   desired_input_layouts=(Shard(1),), use_local_output=True),
        "ln_f": SequenceParallel(),
        "lm_head": PrepareModuleInput(**to_replicated, use_local_output=True),
    })  # fmt: skip
    return model


@torch.no_grad()
def replicate_partial_grads(model: nn.Module) -> int:
    """DTensor leaves the gradient of a replicated parameter used on sequence shards (the
    LayerNorms under ``SequenceParallel``) as a ``Partial(sum)`` DTensor: each rank's local
    value is its tokens' share, and the all-reduce waits until something redistributes it
    (``full_tensor()``, or each optimiser op that reads it). Reduce them now, one all-reduce
    per parameter, so that clipping (which reads local values) and the optimiser see the
    whole gradient. Returns how many were reduced."""
    from torch.distributed.tensor import Replicate

    n = 0
    for p in model.parameters():
        g = p.grad
        if g is not None and any(pl.is_partial() for pl in getattr(g, "placements", ())):
            p.grad = g.redistribute(placements=[Replicate()] * len(g.placements))
            n += 1
    return n


