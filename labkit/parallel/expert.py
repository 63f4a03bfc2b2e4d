"""Expert parallelism: a mixture-of-experts layer whose experts live on different ranks.

A mixture of experts (MoE) replaces one MLP by ``n_experts`` MLPs and a *router* that sends each
token to ``top_k`` of them (Shazeer et al. 2017, "Outrageously Large Neural Networks",
arXiv 1701.06538):

    router    logits = x W_r (N, E);  p = softmax(logits);  (w, e) = top_k(p)
    experts   y_t = sum_j w_tj · expert_{e_tj}(x_t)          (w renormalised to sum 1 when k > 1)

The parameters grow with E, the compute per token only with k. GShard (Lepikhin et al. 2020,
arXiv 2006.16668) routes to the top 2 and renormalises their gates; Switch Transformer (Fedus et
al. 2021, arXiv 2101.03961) routes to the top 1 and keeps the raw probability as the gate. Here
``top_k`` chooses; k > 1 renormalises (GShard), k = 1 keeps p (Switch). Shazeer's noisy gating
and the capacity limit that makes Switch drop tokens are left out: every token is processed.

**Expert parallelism** places E / n whole experts on each of n ranks. Each rank routes its own
tokens, then one all-to-all sends every (token, expert) copy to the rank holding that expert
(*dispatch*), the local experts run, and the reverse all-to-all brings the outputs home
(*combine*), where they are weighted and summed. The split sizes vary with the routing, so the
counts go first (an all-to-all of integers) and ``all_to_all_single`` gets explicit splits.

Bytes: a rank that dispatches C copies of h-element tokens puts C·h·b bytes into the
all-to-all (S in NCCL-tests' convention) and keeps the copies bound for its own experts, so it
sends (C − C_self)·h·b. With a router that spreads tokens evenly C_self = C/n, which is
NCCL-tests' (n−1)/n factor (``formulas.bus_bandwidth_factor("all_to_all", n)``); a skewed
router moves the figure either way. Forward is dispatch + combine; backward runs the same two
in reverse (the gradient of an all-to-all is the all-to-all with the splits swapped).

Two implementations of the collective, side by side:

* ``all_to_all`` below, an autograd Function written here: forward ``dist.all_to_all_single``,
  backward the same call with send and receive splits swapped; it counts what it sends;
* torch's own ``torch.distributed.nn.functional.all_to_all_single`` (deprecated in torch 2.13 in
  favour of ``torch.distributed._functional_collectives.all_to_all_single_autograd``); both run
  on gloo and NCCL, and ``ExpertParallelMoE(..., impl="torch")`` uses the second.

Load balance: a router left alone may send most tokens to a few experts, which then do most of
the work while the others idle (and, under expert parallelism, one rank becomes the straggler).
Switch's auxiliary loss ``E · sum_i f_i · P_i`` (f_i: fraction of token copies routed to expert
i, P_i: mean router probability of expert i) is 1 when both are uniform and grows with the skew;
adding ``alpha · aux`` (Switch: alpha = 0.01) to the loss pulls the router towards balance.

Notebook 03c's readings of the layer (bytes predicted, counted and measured per rank, the load
per expert, the auxiliary loss compared) are in :mod:`labkit.parallel.expert_report`,
re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit import formulas
from labkit.config import ModelConfig
from labkit.model import MLP

# Notebook 03c's readings and figures of this layer live in expert_report (presentation); the
# names stay importable from here, where the notebook, the worker and the tests use them.
from labkit.parallel.expert_report import AllToAllPrediction as AllToAllPrediction
from labkit.parallel.expert_report import BalanceComparison as BalanceComparison
from labkit.parallel.expert_report import DispatchReport as DispatchReport
from labkit.parallel.expert_report import ExpertLoad as ExpertLoad
from labkit.parallel.expert_report import compare_balance as compare_balance
from labkit.parallel.expert_report import dispatch_report as dispatch_report
from labkit.parallel.expert_report import expert_load as expert_load
from labkit.parallel.expert_report import plot_dispatch as plot_dispatch
from labkit.parallel.expert_report import plot_expert_load as plot_expert_load
from labkit.parallel.expert_report import predict_alltoall as predict_alltoall
from labkit.validate import whole

# --- validation: before any process group ------------------------------------------------------


def validate_moe(n_experts: int, top_k: int, world_size: int = 1) -> None:
    """Raise ValueError, naming the constraint and the fix, for a layout that cannot run.

    * ``n_experts`` >= 1 and ``1 <= top_k <= n_experts`` (a token picks k *distinct* experts);
    * ``world_size`` divides ``n_experts``: each rank holds ``n_experts / world_size`` whole
      experts, so there can be no more ranks than experts and no remainder.
    """
    for name, value in (("n_experts", n_experts), ("top_k", top_k), ("world_size", world_size)):
        whole(name, value, low=1)
    if top_k > n_experts:
        raise ValueError(
            f"top_k={top_k} > n_experts={n_experts}: each token is sent to top_k distinct "
            f"experts; use top_k <= {n_experts} or more experts"
        )
    if n_experts < world_size:
        raise ValueError(
            f"n_experts={n_experts} < world_size={world_size}: expert parallelism places whole "
            f"experts on ranks, so {world_size - n_experts} rank(s) would hold none; use at least "
            f"{world_size} experts (a multiple of {world_size}) or {n_experts} rank(s)"
        )
    if n_experts % world_size:
        lower = n_experts - n_experts % world_size
        raise ValueError(
            f"n_experts={n_experts} is not divisible by world_size={world_size}: each rank holds "
            f"n_experts / world_size whole experts; use {lower} or {lower + world_size} experts, "
            f"or a world size that divides {n_experts}"
        )


# --- router and the single-process layer --------------------------------------------------------


@dataclass
class Routing:
    """What the router decided for N tokens: gates (N, k), expert ids (N, k), probs (N, E)."""

    weights: torch.Tensor
    experts: torch.Tensor
    probs: torch.Tensor


class Router(nn.Module):
    """Linear → softmax → top-k (Shazeer et al. 2017 without the noise; GShard's top-2 gates)."""

    def __init__(self, d_model: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        validate_moe(n_experts, top_k)
        self.top_k = top_k
        self.gate = nn.Linear(d_model, n_experts, bias=False)

    def forward(self, x: torch.Tensor) -> Routing:
        probs = self.gate(x).softmax(dim=-1)  # (N, E)
        weights, experts = probs.topk(self.top_k, dim=-1)  # (N, k), largest first
        if self.top_k > 1:  # GShard renormalises the chosen gates; Switch (k=1) keeps p
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(weights, experts, probs)


def tokens_per_expert(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Token copies routed to each expert (E,), from the router's (N, k) expert ids."""
    return torch.bincount(experts.reshape(-1), minlength=n_experts)


def imbalance(counts: torch.Tensor | list[int]) -> float:
    """max / mean of tokens per expert (or per rank): 1.0 is perfect balance.

    With top-k routing each token sends one copy to each of k *distinct* experts, so an expert
    gets at most one copy per token: the worst is E/k over experts (:func:`worst_imbalance`).
    """
    c = torch.as_tensor(counts, dtype=torch.float64)
    mean = float(c.mean())
    return float(c.max()) / mean if mean > 0 else float("nan")


def worst_imbalance(n_experts: int, top_k: int) -> float:
    """The largest max/mean over experts top-k routing allows: E/k (every token's k copies on
    the same k experts; each expert gets at most one copy per token)."""
    validate_moe(n_experts, top_k)
    return n_experts / top_k


def load_balancing_loss(routing: Routing) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, eq. 4 without alpha):
    ``E · sum_i f_i · P_i``; f_i the fraction of token copies sent to expert i (no gradient),
    P_i the mean router probability of expert i (the gradient flows through it). 1 when both
    are uniform; larger the more tokens and probability pile onto the same experts."""
    n_experts = routing.probs.shape[-1]
    f = tokens_per_expert(routing.experts, n_experts).to(routing.probs.dtype)
    f = f / f.sum()
    p = routing.probs.reshape(-1, n_experts).mean(dim=0)
    return n_experts * (f * p).sum()


class MoE(nn.Module):
    """A mixture-of-experts MLP on one process: the reference expert parallelism must equal.

    ``experts[i]`` is a ``labkit.model.MLP`` (d → 4d → d, GELU), the block's own MLP. Takes
    (..., d) and returns (output of the same shape, Routing of the N = prod(...) tokens).
    """

    def __init__(self, cfg: ModelConfig, n_experts: int, top_k: int) -> None:
        super().__init__()
        validate_moe(n_experts, top_k)
        self.n_experts, self.top_k = n_experts, top_k
        self.router = Router(cfg.d_model, n_experts, top_k)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(n_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, C)
        r = self.router(x)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = (r.experts == e).nonzero(as_tuple=True)  # copies routed to e
            if token.numel():
                gate = r.weights[token, slot].unsqueeze(-1)
                y = y.index_add(0, token, gate * expert(x[token]))
        return y.reshape(shape), r


# --- the all-to-all, counted, with its gradient -------------------------------------------------


class AllToAllCounter:
    """Bytes of every all-to-all this rank issued: what went in, what left, what came in.

    One record per call: ``label`` (dispatch, combine, counts; "(backward)" appended in
    backward), ``message_bytes`` (the input, S), ``sent_bytes`` (the part bound for other
    ranks), ``received_bytes`` (what arrived from other ranks), all counted from the split
    sizes; and ``written_bytes``, *measured*: what the process wrote to its sockets during the
    call (``written_bytes()``; gloo only, None elsewhere: not available is not zero).
    """

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def add(self, label: str, x: torch.Tensor, send: list[int], recv: list[int], me: int) -> None:
        row = x[0].numel() * x.element_size() if x.dim() > 1 else x.element_size()
        self.records.append(
            {
                "label": label,
                "message_bytes": sum(send) * row,
                "sent_bytes": (sum(send) - send[me]) * row,
                "received_bytes": (sum(recv) - recv[me]) * row,
            }
        )

    def by_label(self) -> dict[str, dict[str, int]]:
        """Totals per label: calls and bytes."""
        out: dict[str, dict[str, int]] = {}
        for rec in self.records:
            e = out.setdefault(
                rec["label"], {"calls": 0, "message_bytes": 0, "sent_bytes": 0, "received_bytes": 0}
            )
            e["calls"] += 1
            for k in ("message_bytes", "sent_bytes", "received_bytes"):
                e[k] += rec[k]
            w = rec.get("written_bytes")
            e["written_bytes"] = (
                None
                if w is None or e.get("written_bytes", 0) is None
                else (e.get("written_bytes", 0) + w)
            )
        return out

    def reset(self) -> None:
        self.records.clear()


def written_bytes() -> int | None:
    """Bytes this process has handed to write/send system calls so far (``wchar`` in
    ``/proc/self/io``, Linux; all threads, sockets included), or None where unavailable.

    gloo moves an all-to-all over TCP sockets, so the change across one call measures what the
    process put on the (loopback) wire: payload plus gloo's small headers. NCCL moves GPU
    buffers over NVLink or InfiniBand without such system calls: there it says nothing.
    """
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _raw_all_to_all(x, send, recv, group, counter, label):
    out = x.new_empty((sum(recv), *x.shape[1:]))
    x = x.contiguous()
    on_sockets = counter is not None and dist.get_backend(group) == "gloo"
    before = written_bytes() if on_sockets else None
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    after = written_bytes() if before is not None else None
    if counter is not None:
        counter.add(label, x, send, recv, dist.get_rank(group))
        counter.records[-1]["written_bytes"] = None if after is None else after - before
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group, counter, label):
        ctx.args = (send, recv, group, counter, label)
        return _raw_all_to_all(x, send, recv, group, counter, label)

    @staticmethod
    def backward(ctx, grad):
        send, recv, group, counter, label = ctx.args
        # Row i of the output came from row j of some rank's input: the gradient goes back the
        # same way, i.e. an all-to-all with the splits swapped.
        g = _raw_all_to_all(grad, recv, send, group, counter, f"{label} (backward)")
        return g, None, None, None, None, None


def all_to_all(
    x: torch.Tensor,
    send: list[int],
    recv: list[int],
    group: Any = None,
    counter: AllToAllCounter | None = None,
    label: str = "all_to_all",
    impl: str = "ours",
) -> torch.Tensor:
    """Rows ``x[sum(send[:j]) : sum(send[:j+1])]`` go to rank j; returns the rows received,
    ``recv[i]`` from rank i, in rank order. Differentiable. ``impl="torch"`` uses torch's
    autograd-aware functional collective instead of ours (counted all the same)."""
    if impl == "ours":
        return _AllToAll.apply(x, list(send), list(recv), group, counter, label)
    if impl != "torch":
        raise ValueError(f"impl={impl!r}: use 'ours' or 'torch'")
    from torch.distributed import _functional_collectives as funcol

    if counter is not None:  # forward only: torch's backward is out of our sight
        counter.add(label, x, list(send), list(recv), dist.get_rank(group))
    out = funcol.all_to_all_single_autograd(
        x.contiguous(), list(recv), list(send), group or dist.group.WORLD
    )
    return funcol.wait_tensor(out)


def exchange_counts(
    counts: torch.Tensor, group: Any = None, counter: AllToAllCounter | None = None
) -> torch.Tensor:
    """Rank i's ``counts`` (n·m integers: m for each destination rank) → (n, m): row i is what
    rank i will send to this rank. The all-to-all before the all-to-all: receivers must know the
    split sizes before the tokens can move."""
    n = dist.get_world_size(group)
    counts = counts.reshape(-1).to(torch.int64)
    m = counts.numel() // n
    out = _raw_all_to_all(counts.reshape(n, m), [1] * n, [1] * n, group, counter, "counts")
    return out.reshape(n, m)


def dispatch(
    x: torch.Tensor, dest: torch.Tensor, group: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Send each token (row of x, (N, h)) to rank ``dest`` (N,), by one all-to-all.

    The counts go first (an all-to-all of n integers), then the tokens, sorted by destination
    (stably: a rank's tokens keep their order). Returns the tokens this rank received (M, h),
    ordered by source rank, and ``recv_counts`` (n,) int64: how many came from each rank.
    Differentiable: the gradient of ``received`` flows back to ``x``.
    """
    n = dist.get_world_size(group)
    dest = dest.reshape(-1).to(torch.int64)
    if dest.numel() != x.shape[0]:
        raise ValueError(f"dest has {dest.numel()} entries for {x.shape[0]} tokens: one per row")
    if dest.numel() and (int(dest.min()) < 0 or int(dest.max()) >= n):
        raise ValueError(f"dest must hold ranks in [0, {n}); got {dest.min()}..{dest.max()}")
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=n)
    recv = exchange_counts(send, group).reshape(n)
    received = all_to_all(x[order], send.tolist(), recv.tolist(), group)
    return received, recv


# --- the expert-parallel layer -------------------------------------------------------------------


class ExpertParallelMoE(nn.Module):
    """The same MoE with its experts spread over the ranks of ``group``.

    Every rank holds the whole router (replicated, as data parallelism would) and experts
    ``rank·E/n .. (rank+1)·E/n − 1``. Build it from a single-process ``MoE`` with the same
    weights on every rank (``from_moe``) to compare with it.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        n_experts: int,
        top_k: int,
        group: Any = None,
        counter: AllToAllCounter | None = None,
        impl: str = "ours",
    ) -> None:
        super().__init__()
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        validate_moe(n_experts, top_k, n)
        self.n_experts, self.top_k, self.group, self.counter, self.impl = (
            n_experts,
            top_k,
            group,
            counter,
            impl,
        )
        self.world_size, self.rank, self.local = n, rank, n_experts // n
        self.router = Router(cfg.d_model, n_experts, top_k)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(self.local))
        self.last: dict[str, Any] = {}

    @classmethod
    def from_moe(cls, moe: MoE, cfg: ModelConfig, group: Any = None, **kw: Any):
        """Copy ``moe``'s router and this rank's experts (same values, new tensors)."""
        ep = cls(cfg, moe.n_experts, moe.top_k, group, **kw)
        ep.router.load_state_dict(moe.router.state_dict())
        first = ep.rank * ep.local
        for j, expert in enumerate(ep.experts):
            expert.load_state_dict(moe.experts[first + j].state_dict())
        return ep

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, C): this rank's tokens
        n, m = self.world_size, self.local
        r = self.router(x)
        flat = r.experts.reshape(-1)  # (N·k,) one entry per (token, slot) copy
        order = torch.argsort(flat, stable=True)  # by expert, hence by the rank holding it
        token = order // self.top_k
        per_expert = tokens_per_expert(r.experts, self.n_experts)  # (E,)
        recv_per_expert = exchange_counts(per_expert, self.group, self.counter)  # (n, m)
        send = per_expert.reshape(n, m).sum(1).tolist()
        recv_rows = recv_per_expert.reshape(-1).tolist()  # src0·e0, src0·e1, ..., src1·e0, ...
        recv = recv_per_expert.sum(1).tolist()

        received = all_to_all(x[token], send, recv, self.group, self.counter, "dispatch", self.impl)
        # The rows arrive by source rank, each source's rows by local expert: label each row.
        local_id = torch.arange(m, device=x.device).repeat(n)
        row_expert = local_id.repeat_interleave(torch.as_tensor(recv_rows, device=x.device))
        out = torch.zeros_like(received)
        for j, expert in enumerate(self.experts):
            rows = (row_expert == j).nonzero(as_tuple=True)[0]
            if rows.numel():
                out = out.index_add(0, rows, expert(received[rows]))
        back = all_to_all(out, recv, send, self.group, self.counter, "combine", self.impl)

        gate = r.weights.reshape(-1)[order].unsqueeze(-1)  # (N·k, 1) in the sorted order
        y = torch.zeros_like(x).index_add(0, token, gate * back)
        self.last = {
            "tokens_per_expert": per_expert.tolist(),
            "sent_rows": send,
            "received_rows": recv,
            "received_per_local_expert": recv_per_expert.sum(0).tolist(),
        }
        return y.reshape(shape), r


# --- bytes: predicted ---------------------------------------------------------------------------


def alltoall_sent_bytes_uniform(
    copies: int, d_model: int, world_size: int, bytes_per_element: int = 4
) -> float:
    """Predicted bytes one rank sends in one token all-to-all (dispatch or combine) when the
    router spreads its ``copies`` (tokens × top_k) evenly over the ranks: (n−1)/n · S, with
    S = copies · d_model · bytes (NCCL-tests' all-to-all factor)."""
    for name, v in (
        ("copies", copies),
        ("d_model", d_model),
        ("bytes_per_element", bytes_per_element),
    ):
        if v < 0:
            raise ValueError(f"{name}={v}: need a non-negative number")
    S = copies * d_model * bytes_per_element
    return formulas.bus_bandwidth_factor("all_to_all", world_size) * S


def alltoall_sent_bytes(
    copies_per_rank: list[int], rank: int, d_model: int, bytes_per_element: int = 4
) -> int:
    """Bytes rank ``rank`` sends in one dispatch, given how many of its token copies go to
    each rank (from the router): every copy not bound for itself, times d_model · bytes.
    The combine sends back what the dispatch received: apply this to the received counts."""
    if not 0 <= rank < len(copies_per_rank):
        raise ValueError(f"rank={rank}: need 0 <= rank < {len(copies_per_rank)}")
    return (sum(copies_per_rank) - copies_per_rank[rank]) * d_model * bytes_per_element


def copies_per_rank(experts: torch.Tensor, n_experts: int, world_size: int) -> list[int]:
    """Token copies bound for each rank, from the router's (N, k) expert ids (experts are placed
    in contiguous blocks of n_experts / world_size)."""
    validate_moe(n_experts, 1, world_size)
    per_expert = tokens_per_expert(experts, n_experts)
    return per_expert.reshape(world_size, -1).sum(1).tolist()


# --- what the auxiliary loss changes: a small run on one process ---------------------------------


def balance_run(
    alpha: float,
    steps: int,
    *,
    d_model: int = 64,
    n_experts: int = 8,
    top_k: int = 2,
    batch_size: int = 8,
    seq_len: int = 32,
    lr: float = 1e-2,
    seed: int = 0,
) -> dict[str, list[float]]:
    """Train a byte-level next-token model whose only hidden layer is a MoE, with
    ``loss + alpha · load_balancing_loss`` (``alpha=0``: no balancing), on the course's text.

    embed → LayerNorm → h + MoE(h) → linear head; AdamW. Returns per step the token copies'
    imbalance over experts (max/mean), the auxiliary loss and the language-model loss.
    Small enough for a notebook cell (60 steps: about a second on an idle CPU core); it runs
    on one thread and restores the thread count after.
    """
    validate_moe(n_experts, top_k)
    if alpha < 0 or steps < 1:
        raise ValueError(f"alpha={alpha}, steps={steps}: need alpha >= 0 and steps >= 1")
    threads = torch.get_num_threads()
    # One thread: these ops are tiny, and on a shared machine intra-op threads spend more time
    # waiting for each other than computing (measured: 20 steps took 1.8 s on one thread, 29 s
    # on two, with the 2-core machine loaded ~5x).
    torch.set_num_threads(1)
    try:
        return _balance_run(alpha, steps, d_model, n_experts, top_k, batch_size, seq_len, lr, seed)
    finally:
        torch.set_num_threads(threads)


def _balance_run(alpha, steps, d_model, n_experts, top_k, batch_size, seq_len, lr, seed):
    from labkit import data

    cfg = ModelConfig(d_model=d_model, n_head=1, seq_len=seq_len)
    torch.manual_seed(seed)
    emb, moe, head = nn.Embedding(256, d_model), MoE(cfg, n_experts, top_k), nn.Linear(d_model, 256)
    params = [*emb.parameters(), *moe.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=lr)
    g = torch.Generator().manual_seed(seed)
    train = data.load_splits().train
    out: dict[str, list[float]] = {"imbalance": [], "aux": [], "loss": []}
    for _ in range(steps):
        x, y = data.get_batch(train, batch_size, seq_len, g)
        h = nn.functional.layer_norm(emb(x), (d_model,))
        z, r = moe(h)
        loss = nn.functional.cross_entropy(head(h + z).flatten(0, 1), y.flatten())
        aux = load_balancing_loss(r)
        (loss + alpha * aux).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["imbalance"].append(imbalance(tokens_per_expert(r.experts, n_experts)))
        out["aux"].append(float(aux.detach()))
        out["loss"].append(float(loss.detach()))
    return out
