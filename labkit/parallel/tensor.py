"""Tensor parallelism: split every layer's matrices across ranks (Megatron-LM style).

Shoeybi et al. 2019, "Megatron-LM" (arXiv 1909.08053), section 3: in an MLP, split the first
matrix by columns and the second by rows. Each rank then computes its share of the hidden
units with no communication in between, and one all-reduce sums the partial outputs. The
same holds for attention, split by heads. Two conjugate operators carry all communication:

    f: identity in forward, all-reduce in backward   (entering a parallel region)
    g: all-reduce in forward, identity in backward   (leaving it)

so a transformer layer costs two all-reduces of a (b, s, h) activation in the forward pass
(g after attention, g after the MLP) and two in the backward (f before each).

    model = apply_tensor_parallel(GPT(cfg), world_size=2, rank=ctx.rank)  # in place
    _, loss = model(x, y)                   # same loss as the single-process GPT

What is split (n = tensor-parallel ranks; a = heads, h = d_model):

* attention: q, k, v column-parallel, a/n whole heads per rank (the model has separate q/k/v
  layers, so each splits by output rows in head-sized chunks; a fused qkv would need a
  head-aware split); proj row-parallel;
* MLP: fc column-parallel (4h/n hidden units per rank), proj row-parallel;
* replicated on every rank: embeddings, LayerNorms, lm_head, and the biases added after an
  all-reduce. This is the simplest correct choice: Megatron also splits the embedding and
  the output layer by vocabulary, which saves memory but needs a parallel cross-entropy.

Replicated parameters need no gradient communication: everything upstream of ``f`` and
downstream of ``g`` is computed identically on every rank, so their gradients agree. That holds
only while the replicated regions draw the same random numbers on every rank: with dropout there
(after the embedding, on the residual stream), every rank of a tensor-parallel group must seed
that dropout alike, while dropout *inside* the split region wants a different seed per rank
(Megatron-LM keeps two RNG states for this, its ``model-parallel-rng`` tracker; Shoeybi et al.
2019, arXiv 1909.08053, section 3). The course's presets train without dropout.

``apply_tensor_parallel`` converts a *loaded* GPT by slicing its weights, so the parallel
model starts equal to the single-process one by construction. ``apply_dtensor_parallel`` does
the same through PyTorch's DTensor (``parallelize_module`` with ``ColwiseParallel`` and
``RowwiseParallel`` on a device mesh), for comparison; ``count_collectives`` counts what
each issues with PyTorch's ``CommDebugMode``.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from labkit.config import ModelConfig
from labkit.validate import whole

# --- checks before anything is launched ------------------------------------------------------


def validate_tensor_parallel(model_cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError, naming the field and the fix, if ``tp`` ranks cannot split the model.

    Heads are the unit of the attention split (a head's q, k and v must stay on one rank).
    One check covers the hidden size too: d_model = n_head × head_dim (``ModelConfig``
    enforces it), so a tp that divides n_head divides d_model and the MLP's 4·d_model.
    """
    tp = whole("tp", tp, low=1, why="tensor-parallel ranks")
    if model_cfg.n_head % tp:
        divisors = [d for d in range(1, model_cfg.n_head + 1) if model_cfg.n_head % d == 0]
        raise ValueError(
            f"tp={tp} does not divide n_head={model_cfg.n_head}: attention is split by whole"
            f" heads (and d_model={model_cfg.d_model} by head_dim-wide slices); use tp in"
            f" {divisors} or a model with a multiple of {tp} heads"
        )


# --- counting what f and g send --------------------------------------------------------------


@dataclass
class CommCounter:
    """All-reduces issued by f and g, and their message bytes, split by pass.

    Message bytes are the size of the tensor reduced (what NCCL-tests call the size); a ring
    all-reduce moves 2(n−1)/n times that per rank (``formulas.ring_allreduce_bytes_per_rank``).
    """

    calls: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})
    bytes: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})

    def add(self, direction: str, t: torch.Tensor) -> None:
        self.calls[direction] += 1
        self.bytes[direction] += t.numel() * t.element_size()

    def reset(self) -> None:
        for d in ("forward", "backward"):
            self.calls[d] = self.bytes[d] = 0

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def as_dict(self) -> dict[str, int]:
        return {
            "forward_calls": self.calls["forward"],
            "backward_calls": self.calls["backward"],
            "forward_bytes": self.bytes["forward"],
            "backward_bytes": self.bytes["backward"],
        }


# CommDebugMode names an op by its packet: "c10d.allreduce_" for torch.distributed.all_reduce
# (our f and g), "c10d_functional.all_reduce" for DTensor's functional collectives. One name
# per collective, so the two can be compared. A table of its own, not comm.C10D_OPS: these
# are CommDebugMode's names (no trailing underscore, c10d and functional ops mixed) mapped to a
# name only, for counting calls; comm's are dispatcher op names mapped to the argument whose
# bytes are counted. Neither is torch 2.13's Python rename (comm.ALL_GATHER_NAMES).
_COLLECTIVE_NAMES = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "allgather": "all_gather",
    "_allgather_base": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "alltoall_base": "all_to_all",
    "all_to_all_single": "all_to_all",
}


@contextlib.contextmanager
def count_collectives() -> Iterator[dict[str, dict[str, int]]]:
    """Count the collectives issued inside the block, by pass, with PyTorch's CommDebugMode.

        with tensor.count_collectives() as counts:
            _, loss = model(x, y)
            loss.backward()
        counts  # {"forward": {"all_reduce": 4}, "backward": {"all_reduce": 4}}

    CommDebugMode is a TorchDispatchMode: it sees both ``torch.distributed`` calls (c10d ops,
    as our f and g issue) and DTensor's functional collectives, so one counter measures both
    implementations; it tells forward from backward by module hooks
    (torch/distributed/tensor/debug/_comm_mode.py;
    https://docs.pytorch.org/tutorials/recipes/distributed_comm_debug_mode.html). The dict
    is filled when the block exits. Counts are of calls, not bytes.
    """
    from torch.distributed.tensor.debug import CommDebugMode

    counts: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}
    mode = CommDebugMode()
    with warnings.catch_warnings():
        # Its module tracker hooks the whole model, whose input (token ids) needs no grad:
        # torch warns once per module that the full backward hook fires on outputs only.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        with mode:
            yield counts
    for direction in counts:
        for op, n in mode.comm_module_counts["Global"][direction].items():
            name = str(op).split(".")[-1].rstrip("_") or str(op)
            name = _COLLECTIVE_NAMES.get(name, name)
            counts[direction][name] = counts[direction].get(name, 0) + n


def _all_reduce(
    t: torch.Tensor, group: Any, counter: CommCounter | None, direction: str
) -> torch.Tensor:
    # A fresh contiguous copy: collectives need contiguous memory, and reducing in place could
    # change a tensor autograd or another branch of the graph still uses.
    out = t.contiguous().clone()
    if counter is not None:
        counter.add(direction, out)
    if tdist.is_initialized() and tdist.get_world_size(group) > 1:
        tdist.all_reduce(out, group=group)
    return out


# --- f and g (Megatron's conjugate operators) ---------------------------------------------------


class CopyToParallelRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward (Shoeybi et al. 2019, figure 3).

    Every rank feeds the same input into its own slice of the weights; each slice contributes
    a partial gradient of that input, and the all-reduce sums them into the full gradient.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, counter: CommCounter | None) -> torch.Tensor:
        ctx.group, ctx.counter = group, counter
        return x.view_as(x)  # a new autograd node over the same memory: no copy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_reduce(grad, ctx.group, ctx.counter, "backward"), None, None


class ReduceFromParallelRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward (Shoeybi et al. 2019, figure 3).

    Each rank holds a partial sum of the layer's output; the all-reduce completes it. The
    gradient of a sum with respect to each term is the gradient of the sum: no communication.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, counter: CommCounter | None) -> torch.Tensor:
        return _all_reduce(x, group, counter, "forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


def f(x: torch.Tensor, group: Any = None, counter: CommCounter | None = None) -> torch.Tensor:
    """Enter a tensor-parallel region (identity forward, all-reduce backward)."""
    return CopyToParallelRegion.apply(x, group, counter)


def g(x: torch.Tensor, group: Any = None, counter: CommCounter | None = None) -> torch.Tensor:
    """Leave a tensor-parallel region (all-reduce forward, identity backward)."""
    return ReduceFromParallelRegion.apply(x, group, counter)


# --- parallel linear layers ----------------------------------------------------------------------


def _shard_range(size: int, world_size: int, rank: int, what: str) -> slice:
    if size % world_size:
        raise ValueError(f"{what}={size} is not divisible by world_size={world_size}")
    per = size // world_size
    return slice(rank * per, (rank + 1) * per)


class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i + b_i: this rank's ``out_features / n`` output columns (weight rows).

    Input (…, in_features), replicated; output (…, out_features / n), sharded by features.
    ``copy_input=True`` applies f to the input itself; a layer sharing its input with
    others (q, k and v) leaves that to its caller, so the backward all-reduces once, not
    three times. Weight and bias carry ``tp_shard_dim = 0``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        world_size: int,
        rank: int,
        group: Any = None,
        bias: bool = True,
        copy_input: bool = True,
        counter: CommCounter | None = None,
    ) -> None:
        super().__init__()
        rows = _shard_range(out_features, world_size, rank, "out_features")
        self.in_features, self.out_features = in_features, out_features
        self.world_size, self.rank, self.group = world_size, rank, group
        self.copy_input, self.counter = copy_input, counter
        self.weight = nn.Parameter(torch.empty(rows.stop - rows.start, in_features))
        self.bias = nn.Parameter(torch.zeros(rows.stop - rows.start)) if bias else None
        # Initialised shard by shard, the same draw on every rank: a freshly built parallel
        # layer is NOT a slice of any single-process layer. Build from a loaded model with
        # ``from_linear`` (what ``apply_tensor_parallel`` does) to start equal to one process.
        nn.init.normal_(self.weight, std=0.02)
        self.weight.tp_shard_dim = 0  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.tp_shard_dim = 0  # type: ignore[attr-defined]

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        world_size: int,
        rank: int,
        group: Any = None,
        copy_input: bool = True,
        counter: CommCounter | None = None,
    ) -> ColumnParallelLinear:
        """This rank's slice of a full ``nn.Linear`` (same values: parity by construction)."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            world_size=world_size,
            rank=rank,
            group=group,
            bias=linear.bias is not None,
            copy_input=copy_input,
            counter=counter,
        )
        rows = _shard_range(linear.out_features, world_size, rank, "out_features")
        with torch.no_grad():
            layer.weight.copy_(linear.weight[rows])  # nn.Linear stores (out, in)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias[rows])
        return layer.to(linear.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = f(x, self.group, self.counter)
        return F.linear(x, self.weight, self.bias)  # (…, out_features / n)


class RowParallelLinear(nn.Module):
    """Y = Σ_i X_i A_i + b: this rank's ``in_features / n`` input rows (weight columns).

    Input (…, in_features / n), sharded (a column-parallel layer's output); output
    (…, out_features), complete on every rank after g. The bias is replicated and added once,
    after the all-reduce (adding it on every rank before would count it n times).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        world_size: int,
        rank: int,
        group: Any = None,
        bias: bool = True,
        counter: CommCounter | None = None,
    ) -> None:
        super().__init__()
        cols = _shard_range(in_features, world_size, rank, "in_features")
        self.in_features, self.out_features = in_features, out_features
        self.world_size, self.rank, self.group, self.counter = world_size, rank, group, counter
        self.weight = nn.Parameter(torch.empty(out_features, cols.stop - cols.start))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        # Initialised shard by shard, the same draw on every rank: a freshly built parallel
        # layer is NOT a slice of any single-process layer. Build from a loaded model with
        # ``from_linear`` (what ``apply_tensor_parallel`` does) to start equal to one process.
        nn.init.normal_(self.weight, std=0.02)
        self.weight.tp_shard_dim = 1  # type: ignore[attr-defined]

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        world_size: int,
        rank: int,
        group: Any = None,
        counter: CommCounter | None = None,
    ) -> RowParallelLinear:
        """This rank's slice of a full ``nn.Linear``."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            world_size=world_size,
            rank=rank,
            group=group,
            bias=linear.bias is not None,
            counter=counter,
        )
        cols = _shard_range(linear.in_features, world_size, rank, "in_features")
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, cols])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer.to(linear.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = g(F.linear(x, self.weight), self.group, self.counter)  # partial sums -> full
        return y + self.bias if self.bias is not None else y


# --- attention and MLP over local heads / hidden units ---------------------------------------


class _Identity(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _EnterRegion(nn.Module):
    """f as a module, so a block applies it once for all the layers reading its input."""

    def __init__(self, group: Any, counter: CommCounter | None) -> None:
        super().__init__()
        self.group, self.counter = group, counter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return f(x, self.group, self.counter)


class ParallelAttention(nn.Module):
    """Causal self-attention over whatever heads this rank's q, k, v produce.

    The head count is read from the width of q's output (-1 in the view), so the same code
    runs our column-parallel layers and DTensor's ``ColwiseParallel`` ones. Parameter names
    (q, k, v, proj) match ``labkit.model.CausalSelfAttention``.
    """

    def __init__(
        self,
        q: nn.Module,
        k: nn.Module,
        v: nn.Module,
        proj: nn.Module,
        *,
        head_dim: int,
        dropout: float,
        enter: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.q, self.k, self.v, self.proj = q, k, v, proj
        self.head_dim, self.dropout = head_dim, dropout
        self.enter = enter if enter is not None else _Identity()
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        hs = self.head_dim
        x = self.enter(x)  # f: one all-reduce in backward for q, k and v together
        # (B, T, C/n) -> (B, nh/n, T, hs): this rank's heads only.
        q = self.q(x).view(B, T, -1, hs).transpose(1, 2)
        k = self.k(x).view(B, T, -1, hs).transpose(1, 2)
        v = self.v(x).view(B, T, -1, hs).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh/n, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, C/n)
        return self.resid_dropout(self.proj(y))  # row-parallel: g inside -> (B, T, C)


class ParallelMLP(nn.Module):
    """fc column-parallel (4h/n hidden units here), GELU, proj row-parallel."""

    def __init__(
        self, fc: nn.Module, proj: nn.Module, *, dropout: float, enter: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.fc, self.proj = fc, proj
        self.enter = enter if enter is not None else _Identity()
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GELU is elementwise, so it applies to each rank's hidden units independently: the
        # reason fc is split by columns (splitting by rows would need a sum before GELU).
        h = F.gelu(self.fc(self.enter(x)), approximate="tanh")  # (B, T, 4C/n)
        return self.dropout(self.proj(h))


# --- the whole GPT ------------------------------------------------------------------------------


def apply_tensor_parallel(
    model: nn.Module,
    *,
    world_size: int,
    rank: int,
    group: Any = None,
    counter: CommCounter | None = None,
) -> nn.Module:
    """Make ``model`` (a ``labkit.model.GPT``) tensor-parallel over ``world_size`` ranks, in place.

    Each block's attention and MLP are replaced by parallel versions holding this rank's
    slices of the very same weights; everything else stays replicated. ``counter`` (optional)
    records every all-reduce f and g issue. Returns ``model``. Dropout must be 0 for exact
    parity with the single-process model (dropout masks inside a parallel region differ).
    """
    validate_tensor_parallel(model.cfg, world_size)
    kw = {"world_size": world_size, "rank": rank, "group": group, "counter": counter}
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        block.attn = ParallelAttention(
            *(
                ColumnParallelLinear.from_linear(lin, copy_input=False, **kw)
                for lin in (attn.q, attn.k, attn.v)
            ),
            RowParallelLinear.from_linear(attn.proj, **kw),
            head_dim=model.cfg.head_dim,
            dropout=model.cfg.dropout,
            enter=_EnterRegion(group, counter),
        )
        block.mlp = ParallelMLP(
            ColumnParallelLinear.from_linear(mlp.fc, copy_input=False, **kw),
            RowParallelLinear.from_linear(mlp.proj, **kw),
            dropout=model.cfg.dropout,
            enter=_EnterRegion(group, counter),
        )
    return model


def apply_dtensor_parallel(model: nn.Module, mesh: Any) -> nn.Module:
    """The same split through PyTorch DTensor: ``parallelize_module`` on a 1-D device mesh.

    ``mesh = init_device_mesh("cpu", (tp,))`` (or "cuda"). ``ColwiseParallel`` shards a
    Linear's weight by output features and takes a replicated input (its backward all-reduces
    the input gradient: f); ``RowwiseParallel`` shards by input features and all-reduces the
    output (g). A ``PrepareModuleInput`` on the attention makes its input one replicated
    DTensor shared by q, k and v, so their input gradient is all-reduced once, as our f does:
    both issue 2 all-reduces per layer in each pass (``count_collectives`` measures it).
    Attention is first rewritten to read its head count from q's output width
    (``ParallelAttention``): the model's own forward assumes all heads are local. In place;
    returns ``model``.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    validate_tensor_parallel(model.cfg, mesh.size())
    plan = {
        # f once for q, k and v: the attention's input becomes one replicated DTensor that the
        # three ColwiseParallel layers share (use_local_output=False keeps it a DTensor), so
        # their three partial input gradients add up as one Partial DTensor and are
        # all-reduced once where it was made. Without this, each ColwiseParallel wraps the
        # plain tensor itself and all-reduces its own input gradient: 3 backward all-reduces
        # per attention instead of 1 (counted with CommDebugMode: 4 + 8 per step on 2 layers,
        # against 4 + 4). PyTorch's TP tutorial and torchtitan's parallelize do the same:
        # https://docs.pytorch.org/tutorials/intermediate/TP_tutorial.html
        # https://github.com/pytorch/torchtitan/blob/238fa9953/torchtitan/models/llama3/infra/parallelize.py
        # (since Feb 2026: torchtitan/models/llama3/parallelize.py)
        "attn": PrepareModuleInput(
            input_layouts=(Replicate(),),
            desired_input_layouts=(Replicate(),),
            use_local_output=False,
        ),
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(),
    }
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        block.attn = ParallelAttention(
            attn.q,
            attn.k,
            attn.v,
            attn.proj,
            head_dim=model.cfg.head_dim,
            dropout=model.cfg.dropout,
        )
        block.mlp = ParallelMLP(mlp.fc, mlp.proj, dropout=model.cfg.dropout)
        parallelize_module(block, mesh, plan)
    return model


# --- gradients, parameters, memory ----------------------------------------------------------


def _shard_dim(p: torch.Tensor) -> int | None:
    """Dimension along which ``p`` is split across ranks, or None if it is replicated."""
    placements = getattr(p, "placements", None)  # a DTensor
    if placements is not None:
        dims = [pl.dim for pl in placements if pl.is_shard()]
        return dims[0] if dims else None
    return getattr(p, "tp_shard_dim", None)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def clip_grad_norm_(model: nn.Module, max_norm: float, group: Any = None) -> float:
    """Clip gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_`` would on
    the single-process model; returns that norm.

    Sharded gradients contribute the sum of squares of their slice, summed over ranks;
    replicated ones are identical on every rank and are counted once.
    """
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    params = [p for p in model.parameters() if p.grad is not None]
    for p in params:
        sq = _local(p.grad).detach().double().pow(2).sum().cpu()
        if _shard_dim(p) is not None:
            sharded += sq
        else:
            replicated += sq
    if tdist.is_initialized():
        device = params[0].grad.device if params else torch.device("cpu")
        buf = sharded.to(device)
        tdist.all_reduce(buf, group=group)
        sharded = buf.cpu()
    total = math.sqrt(float(sharded + replicated))
    coef = min(1.0, max_norm / (total + 1e-6))  # torch's clip_grad_norm_ formula
    if coef < 1.0:
        for p in params:
            p.grad.mul_(coef)
    return total


@torch.no_grad()
def full_state(
    model: nn.Module, group: Any = None, *, grads: bool = False
) -> dict[str, torch.Tensor]:
    """Every parameter (or, with ``grads=True``, its gradient), gathered whole, by the
    single-process model's names (tied ones once).

    Our shards are concatenated along ``tp_shard_dim`` in rank order; DTensors use
    ``full_tensor()``. Collective: every rank must call it.
    """
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        if t is None:
            continue
        if hasattr(t, "full_tensor"):
            out[name] = t.full_tensor().detach().cpu().clone()
            continue
        dim = _shard_dim(p)
        if dim is None or not tdist.is_initialized():
            out[name] = t.detach().cpu().clone()
            continue
        parts = [torch.empty_like(t) for _ in range(tdist.get_world_size(group))]
        tdist.all_gather(parts, t.detach().contiguous(), group=group)
        out[name] = torch.cat(parts, dim=dim).cpu()
    return out


def param_bytes_per_rank(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds (shards at their local size), measured."""
    return sum(_local(p).numel() * p.element_size() for p in model.parameters())


def tp_params_per_rank(cfg: ModelConfig, tp: int) -> int:
    """Parameters one rank holds under ``apply_tensor_parallel`` with ``tp`` ranks (formula).

    Per layer, 12h² + 7h are split (q, k, v weights and biases, proj weight, fc weight and
    bias, MLP proj weight) and 6h are replicated (two LayerNorms, the two row-parallel
    biases); embeddings (V·h + s·h), ln_f (2h) and an untied lm_head (V·h) are replicated.
    """
    validate_tensor_parallel(cfg, tp)
    h, V, s, L = cfg.d_model, cfg.vocab_size, cfg.seq_len, cfg.n_layer
    replicated = V * h + s * h + L * 6 * h + 2 * h + (0 if cfg.tie_weights else V * h)
    split = L * (12 * h * h + 7 * h)
    return replicated + split // tp


def tp_allreduce_bytes_per_step(
    cfg: ModelConfig, micro_batch: int, *, n_microbatches: int = 1, bytes_per_element: int = 4
) -> dict[str, int]:
    """All-reduces and their message bytes per training step under Megatron TP (formula).

    Each layer: 2 all-reduces in the forward (g after attention, g after the MLP) and 2 in
    the backward (f before each), every one of a (b, s, h) activation (Shoeybi et al. 2019,
    section 3). Per step: 4·L·m calls of b·s·h·bytes each. The bytes are message sizes; per
    rank a ring all-reduce moves 2(n−1)/n of each (``formulas.ring_allreduce_bytes_per_rank``).
    Returns {"calls", "message_bytes", "bytes_per_call"}.
    """
    for name, value in (
        ("micro_batch", micro_batch),
        ("n_microbatches", n_microbatches),
        ("bytes_per_element", bytes_per_element),
    ):
        whole(name, value, low=1)
    per_call = micro_batch * cfg.seq_len * cfg.d_model * bytes_per_element
    calls = 4 * cfg.n_layer * n_microbatches
    return {"calls": calls, "message_bytes": calls * per_call, "bytes_per_call": per_call}


@dataclass(frozen=True)
class TPPrediction:
    """What tensor parallelism over ``tp`` ranks should cost, predicted before anything runs:
    the parameters one rank holds (:func:`tp_params_per_rank`) against one device's
    (``formulas.gpt_params``), and the all-reduces of a step (:func:`tp_allreduce_bytes_per_step`)
    with the bytes each rank sends for them in a ring (``formulas.ring_allreduce_bytes_per_rank``).
    """

    tp: int
    n_layer: int
    params_per_rank: int
    params_single: int
    calls: int
    bytes_per_call: int
    message_bytes: int
    ring_bytes_per_rank: float

    def describe(self) -> str:
        return "\n".join([
            f"predicted: {self.params_per_rank:,} parameters per rank "
            f"({4 * self.params_per_rank / 2**20:.2f} MiB fp32) vs {self.params_single:,} on one "
            f"device: {self.params_per_rank / self.params_single:.0%}",
            f"predicted: {self.calls} all-reduces per step (4 per layer × {self.n_layer} layers), "
            f"{self.bytes_per_call / 2**10:.0f} KiB each (b·s·h·4 bytes), "
            f"{self.message_bytes / 2**20:.2f} MiB per step; each rank sends "
            f"{self.ring_bytes_per_rank / 2**20:.2f} MiB (ring, 2(n−1)/n)",
        ])


def predict_tp(cfg: ModelConfig, tp: int, micro_batch: int) -> TPPrediction:
    """:class:`TPPrediction` for ``cfg`` split over ``tp`` ranks, ``micro_batch`` sequences a step
    (float32, one micro-batch)."""
    from labkit import formulas  # layer 0; imported here to keep this module's imports few

    comm = tp_allreduce_bytes_per_step(cfg, micro_batch)
    return TPPrediction(
        tp=tp, n_layer=cfg.n_layer, params_per_rank=tp_params_per_rank(cfg, tp),
        params_single=formulas.gpt_params(vocab_size=cfg.vocab_size, d_model=cfg.d_model,
                                          n_layer=cfg.n_layer, seq_len=cfg.seq_len),
        calls=comm["calls"], bytes_per_call=comm["bytes_per_call"],
        message_bytes=comm["message_bytes"],
        ring_bytes_per_rank=formulas.ring_allreduce_bytes_per_rank(comm["message_bytes"], tp),
    )
