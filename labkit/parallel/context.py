"""Context parallelism: ring attention over sequence shards, from scratch.

Each of n ranks holds a contiguous shard of the sequence: q, k, v of shape (B, H, T/n, D),
rank r holding positions [r·T/n, (r+1)·T/n). Attention needs every query against every key,
so the key/value blocks travel around the ring (Liu, Zaharia & Abbeel 2023, "Ring Attention
with Blockwise Transformers", arXiv 2310.01889): at step s rank r holds the block of rank
(r - s) mod n, attends its queries to it, and passes it to rank r + 1 with a point-to-point
``isend``/``irecv`` (n - 1 hops; the next hop is started before the current block is used,
so the transfer can hide behind the compute).

Each block gives a *partial* attention: softmax over that block's keys only. Partials over
disjoint key sets combine exactly with the online softmax (Milakov & Gimelshein 2018, arXiv
1805.02867; FlashAttention, Dao et al. 2022, arXiv 2205.14135): keep, per query, the output
normalised over the keys seen so far and the log-sum-exp (lse) of their scaled scores;
``merge`` folds in the next block. No rank ever holds more than a (T/n) x (T/n) block of
scores, and no rank holds the whole sequence's q, k or v. ``ring_attention_blocks`` is one
rank's loop, readable on its own, on a ring simulated in one process (``LocalRing``) or a
real one (``P2PRing``); ``_ring_forward`` is the same loop with each hop overlapped.

Causal masking with contiguous shards: a block from a later rank (j > r) holds only future
keys and is skipped; the diagonal block (j = r) is masked (key position <= query position);
earlier blocks (j < r) are attended in full. Rank r therefore computes r + 1 blocks (the
diagonal one half-full) while rank 0 computes one: the last rank does ~2n/(n+1) times the
mean work, and every rank waits for it. Zig-zag layouts fix that by giving each rank one
chunk from the head of the sequence and its mirror from the tail (Llama 3, Dubey et al. 2024,
arXiv 2407.21783, section 3.3.2; torch's ``_HeadTailLoadBalancer``); striped attention gives
rank r every n-th token (Brandon et al. 2023, arXiv 2311.09431). Skipped blocks are still
forwarded: causal masking saves compute, never ring traffic.

Not every context parallelism is a ring. Llama 3 all-gathers K and V once (small under
grouped-query attention) and attends locally; torch 2.13's ``context_parallel`` does the same
by default (``_ContextParallelOptions.rotate_method = ALL_GATHER``) and passes K/V round a
ring only after ``set_rotate_method("alltoall")``.

The gradient (``RingAttention``, a custom autograd function) recomputes each block's
probabilities from the saved lse and runs the ring again: the k/v blocks travel as in the
forward, and the gradients dK, dV of each block travel with it, accumulating, and take one
last hop home (the scheme of Liu et al. 2023, section 3, and of ring-flash-attention).

Shapes: B batch, H heads, T whole sequence, Tl = T/n the shard, D head size.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from labkit.validate import whole

BlockKind = Literal["full", "diagonal", "skip"]


# ----------------------------------------------------------------------------------------------
# Validation: before any process group exists.


def validate_context_parallel(seq_len: int, world_size: int) -> None:
    """Raise ValueError unless ``seq_len`` splits into ``world_size`` equal contiguous shards."""
    for name, value in (("seq_len", seq_len), ("world_size", world_size)):
        whole(name, value, low=1)
    if seq_len % world_size:
        raise ValueError(
            f"seq_len={seq_len} is not divisible by the context-parallel degree {world_size}: "
            f"every rank holds seq_len/{world_size} positions; choose a seq_len that is a "
            f"multiple of {world_size} (e.g. {seq_len - seq_len % world_size or world_size})"
        )


# ----------------------------------------------------------------------------------------------
# The pieces: one block's partial attention, and the merge of two partials.


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries ``q`` (B, H, Tq, D) over one block of keys (B, H, Tk, D).

    ``mask`` (Tq, Tk), True where a query may see a key. Returns the output normalised over
    this block's keys (B, H, Tq, D) and the log-sum-exp of the scaled scores (B, H, Tq), both
    float32. A query that sees no key gets output 0 and lse -inf, so that ``merge`` gives it
    weight 0. The matmuls run in the inputs' dtype (as a fused kernel's tensor-core matmuls
    do), the softmax statistics in float32.
    """
    s = (q @ k.transpose(-2, -1)).float() * scale  # (B, H, Tq, Tk)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)  # (B, H, Tq, 1); -inf on a fully masked row
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # exp(-inf - 0) = 0, no NaN
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    out = (p.to(v.dtype) @ v).float() / torch.where(denom > 0, denom, torch.ones_like(denom))
    lse = (m + torch.log(denom)).squeeze(-1)  # log(0) = -inf where no key is seen
    return out, lse


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint key sets into one over their union.

    out_* (B, H, T, D): each normalised over its own keys; lse_* (B, H, T): the log-sum-exp
    of its scaled scores. The union's lse is logaddexp(lse_a, lse_b) and its output the mix
    of the two weighted by each part's share of the softmax mass, exp(lse_x - lse). A part
    with lse -inf (a query that saw none of its keys) gets weight 0, whatever its output
    holds; a query that saw no key in either part keeps output 0 and lse -inf.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    ref = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)  # avoid -inf - -inf
    w_a = torch.exp(lse_a - ref).unsqueeze(-1)
    w_b = torch.exp(lse_b - ref).unsqueeze(-1)
    zero = torch.zeros((), dtype=out_a.dtype, device=out_a.device)
    out = torch.where(w_a > 0, w_a * out_a, zero) + torch.where(w_b > 0, w_b * out_b, zero)
    return out, lse


def full_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-device reference: softmax attention over the whole sequence, output and lse.

    Materialises the whole (T x T) score matrix per batch and head, as a naive
    implementation does.
    """
    T = q.shape[-2]
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril() if causal else None
    return block_attention(q, k, v, scale=1 / math.sqrt(q.shape[-1]), mask=mask)


def block_kind(q_rank: int, kv_rank: int, *, causal: bool) -> BlockKind:
    """What rank ``q_rank`` does with the k/v block of ``kv_rank`` (contiguous shards)."""
    if not causal or kv_rank < q_rank:
        return "full"
    return "diagonal" if kv_rank == q_rank else "skip"


def _diagonal_mask(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def blocks_computed(rank: int, world_size: int, *, causal: bool) -> int:
    """Blocks rank ``rank`` attends to (the diagonal one counted whole): r + 1 causal, else n."""
    return rank + 1 if causal else world_size


def causal_imbalance(world_size: int) -> float:
    """The busiest rank's attention work over the mean, contiguous causal shards.

    Work in half-blocks: rank r does 2r + 1 (r full blocks and the half-full diagonal); the
    mean is n; the last rank does 2n - 1, so the ratio is (2n - 1)/n (1.75 at n = 4).
    """
    n = world_size
    return (2 * n - 1) / n


def ring_local(
    q: list[torch.Tensor], k: list[torch.Tensor], v: list[torch.Tensor], *, causal: bool = True
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The ring algorithm for n ranks simulated in one process: the same steps, no network.

    ``q``, ``k``, ``v``: one (B, H, Tl, D) shard per rank. Each rank runs
    :func:`ring_attention_blocks` on a :class:`LocalRing`. Returns each rank's output and lse.
    """
    outs, lses = [], []
    for r in range(len(q)):
        out, lse = ring_attention_blocks(q[r], k[r], v[r], LocalRing(r, k, v), causal=causal)
        outs.append(out)
        lses.append(lse)
    return outs, lses


class LocalRing:
    """One rank's view of a ring whose n ranks live in this process (a simulation, no network).

    ``k_blocks[j]``, ``v_blocks[j]``: rank j's shard. ``pass_on`` stands for the hop: it
    returns what rank - 1 would send, the block that rank held, and counts the hops.
    """

    def __init__(self, rank: int, k_blocks: list[torch.Tensor], v_blocks: list[torch.Tensor]):
        self.rank, self.size = rank, len(k_blocks)
        self.k_blocks, self.v_blocks = k_blocks, v_blocks
        self.hops = 0

    def pass_on(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Send the block held (``k``, ``v``) to rank + 1; return the one rank - 1 sends."""
        self.hops += 1
        j = (self.rank - self.hops) % self.size  # after h hops the block of rank r - h is here
        return self.k_blocks[j], self.v_blocks[j]


def ring_attention_blocks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Any, *, causal: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's ring loop: its queries against every K/V block as the blocks come round.

    ``q``, ``k``, ``v``: this rank's shard (B, H, Tl, D); ``ring``: ``rank``, ``size`` and
    ``pass_on(k, v)``, which sends the block held to rank + 1 and returns the one rank - 1
    sent (:class:`LocalRing` in one process, :class:`P2PRing` across processes). Blocks
    travel from rank r - 1 to rank r, so at step s rank r holds the block of rank
    (r - s) mod n (Liu et al. 2023, arXiv 2310.01889, section 3). Each block's partial
    attention is merged into the running (output, lse) by the online softmax (Milakov &
    Gimelshein 2018, arXiv 1805.02867; FlashAttention, Dao et al. 2022, arXiv 2205.14135).
    Causal: a block from a later rank holds only future keys and is not computed at all.
    Returns (out (B, H, Tl, D), lse (B, H, Tl)), float32. :func:`_ring_forward` is the same
    loop with the next hop started before the compute, so that it can overlap.
    """
    n, r = ring.size, ring.rank
    acc: tuple[torch.Tensor, torch.Tensor] | None = None
    for s in range(n):
        j = (r - s) % n  # whose block is in hand: this rank's own first, then r - 1, r - 2, ...
        part = _attend(q, k, v, block_kind(r, j, causal=causal))  # None: every key in the future
        if part is not None:
            acc = part if acc is None else merge(*acc, *part)
        if s < n - 1:  # n - 1 hops; a skipped block is passed on all the same: rank r + 1 needs it
            k, v = ring.pass_on(k, v)
    assert acc is not None  # the diagonal block is never skipped
    return acc


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: BlockKind
) -> tuple[torch.Tensor, torch.Tensor] | None:
    if kind == "skip":
        return None
    mask = _diagonal_mask(q.shape[-2], q.device) if kind == "diagonal" else None
    return block_attention(q, k, v, scale=1 / math.sqrt(q.shape[-1]), mask=mask)


# ----------------------------------------------------------------------------------------------
# The distributed ring.


@dataclass
class P2PCounter:
    """Point-to-point sends this rank issued: calls and bytes, forward and backward apart.

    The count is of what we asked torch to send (each ``isend``'s tensor bytes); a transport
    adds its own headers on top.
    """

    calls: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})
    bytes: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})

    def add(self, pass_: str, t: torch.Tensor) -> None:
        self.calls[pass_] += 1
        self.bytes[pass_] += t.numel() * t.element_size()

    def reset(self) -> None:
        for d in (self.calls, self.bytes):
            for key in d:
                d[key] = 0

    def as_dict(self) -> dict[str, Any]:
        return {"calls": dict(self.calls), "bytes": dict(self.bytes)}


class _Ring:
    """Send to rank + 1, receive from rank - 1, within ``group``."""

    def __init__(self, group: Any, counter: P2PCounter | None, pass_: str) -> None:
        group = dist.group.WORLD if group is None else group
        self.group = group
        self.n = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.n)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.n)
        self.counter, self.pass_ = counter, pass_

    def start(self, t: torch.Tensor, tag: int = 0) -> tuple[torch.Tensor, list[Any]]:
        """Begin passing ``t`` on; returns the buffer the previous rank's tensor arrives in.

        Messages in flight at once between the same two ranks need distinct ``tag``s: gloo
        matches a receive to a send by peer and tag (NCCL by issue order, the same here).
        """
        t = t.contiguous()
        buf = torch.empty_like(t)
        if self.counter is not None:
            self.counter.add(self.pass_, t)
        # Receive first: gloo pairs a send with the matching receive by tag and peer.
        works = [dist.irecv(buf, self.prev, group=self.group, tag=tag),
                 dist.isend(t, self.next, group=self.group, tag=tag)]  # fmt: skip
        return buf, works

    @staticmethod
    def wait(works: list[Any]) -> None:
        for w in works:
            w.wait()


class P2PRing:
    """The ring across processes, as :func:`ring_attention_blocks` uses it: ``pass_on`` sends
    the block held to rank + 1 and waits for rank - 1's (one ``isend``/``irecv`` pair, no
    overlap: :func:`_ring_forward` overlaps). ``counter`` counts the bytes sent."""

    def __init__(self, group: Any = None, counter: P2PCounter | None = None) -> None:
        self._ring = _Ring(group, counter, "forward")
        self.rank, self.size = self._ring.rank, self._ring.n

    def pass_on(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv, works = self._ring.start(torch.stack([k, v]))  # (2, B, H, Tl, D): one message
        self._ring.wait(works)
        return kv[0], kv[1]


def _ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    group: Any,
    counter: P2PCounter | None,
    timings: dict[str, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    ring = _Ring(group, counter, "forward")
    n, r = ring.n, ring.rank
    kv = torch.stack([k, v])  # (2, B, H, Tl, D): one message per hop
    acc: tuple[torch.Tensor, torch.Tensor] | None = None
    for s in range(n):
        j = (r - s) % n  # whose block this rank holds now
        t0 = clock(q.device) if timings is not None else 0.0
        pending = ring.start(kv) if s < n - 1 else None  # the next hop overlaps this compute
        if timings is not None:
            t1 = clock(q.device)
            timings["post_s"] = timings.get("post_s", 0.0) + t1 - t0
            t0 = t1
        part = _attend(q, kv[0], kv[1], block_kind(r, j, causal=causal))
        if part is not None:
            acc = part if acc is None else merge(*acc, *part)
        if timings is not None:
            timings["compute_s"] = timings.get("compute_s", 0.0) + clock(q.device) - t0
        if pending is not None:
            kv, works = pending
            t0 = clock(q.device) if timings is not None else 0.0
            ring.wait(works)
            if timings is not None:
                timings["wait_s"] = timings.get("wait_s", 0.0) + clock(q.device) - t0
    assert acc is not None
    return acc


def clock(device: torch.device) -> float:
    """``time.perf_counter()`` after the device's queued work is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _ring_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    *,
    causal: bool,
    group: Any,
    counter: P2PCounter | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of this rank's shard: the k/v blocks go round again, their gradients with them.

    For a block with probabilities P = exp(S - lse) (recomputed, S the scaled scores):
    dV += Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP - rowsum(dO ∘ O)), dQ += scale·dS K,
    dK += scale·dSᵀ Q (FlashAttention-2, Dao 2023, arXiv 2307.08691, algorithm 2).
    """
    ring = _Ring(group, counter, "backward")
    n, r = ring.n, ring.rank
    scale = 1 / math.sqrt(q.shape[-1])
    qf, do = q.float(), grad_out.float()
    delta = (do * out).sum(-1, keepdim=True)  # (B, H, Tl, 1)
    dq = torch.zeros_like(qf)
    kv = torch.stack([k, v])
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    for s in range(n):
        j = (r - s) % n
        pending = ring.start(kv) if s < n - 1 else None
        kind = block_kind(r, j, causal=causal)
        if kind != "skip":
            kf, vf = kv[0].float(), kv[1].float()
            sc = (qf @ kf.transpose(-2, -1)) * scale
            if kind == "diagonal":
                sc = sc.masked_fill(~_diagonal_mask(q.shape[-2], q.device), float("-inf"))
            p = torch.exp(sc - lse.unsqueeze(-1))  # masked entries: exp(-inf) = 0
            dkv[1] += p.transpose(-2, -1) @ do
            ds = p * (do @ vf.transpose(-2, -1) - delta)
            dq += scale * (ds @ kf)
            dkv[0] += scale * (ds.transpose(-2, -1) @ qf)
        # This block's gradient so far goes on with it; after the last step it goes home.
        if n > 1:
            dkv, works = ring.start(dkv, tag=1)
            ring.wait(works)
        if pending is not None:
            kv, works = pending
            ring.wait(works)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Ring attention with a ring backward; saves only this rank's q, k, v, output and lse."""

    @staticmethod
    def forward(ctx, q, k, v, causal, group, counter):
        out, lse = _ring_forward(q, k, v, causal=causal, group=group, counter=counter)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.group, ctx.counter = causal, group, counter
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(q, k, v, out, lse, grad_out, causal=ctx.causal,
                                    group=ctx.group, counter=ctx.counter)  # fmt: skip
        return dq, dk, dv, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    group: Any = None,
    counter: P2PCounter | None = None,
    timings: dict[str, float] | None = None,
) -> torch.Tensor:
    """This rank's attention output (B, H, Tl, D) over the whole sequence, by ring passing.

    ``q``, ``k``, ``v``: this rank's contiguous shard (rank r of ``group`` holds positions
    [r·Tl, (r+1)·Tl)). Differentiable (the backward runs the ring again). ``counter`` counts
    the bytes sent; ``timings`` (forward without grad only) receives the seconds spent
    posting each hop (``post_s``), computing (``compute_s``) and waiting for the next block
    (``wait_s``).
    """
    if timings is not None:
        out, _ = _ring_forward(q, k, v, causal=causal, group=group, counter=counter,
                               timings=timings)  # fmt: skip
        return out.to(q.dtype)
    return RingAttention.apply(q, k, v, causal, group, counter)


# ----------------------------------------------------------------------------------------------
# Predictions: what the ring sends, and what it keeps per rank.


def ring_kv_bytes_per_rank(
    batch: int, heads: int, seq_len: int, head_dim: int, world_size: int, bytes_per_el: int
) -> int:
    """Bytes one rank sends in one forward: n - 1 hops of its K and V blocks.

    2·(n-1)·B·H·(T/n)·D·bytes. The same with causal masking: skipped blocks still travel.
    """
    validate_context_parallel(seq_len, world_size)
    n = world_size
    return 2 * (n - 1) * batch * heads * (seq_len // n) * head_dim * bytes_per_el


def ring_backward_bytes_per_rank(
    batch: int,
    heads: int,
    seq_len: int,
    head_dim: int,
    world_size: int,
    bytes_per_el: int,
    grad_bytes_per_el: int = 4,
) -> int:
    """Bytes one rank sends in one backward: K, V n - 1 hops, their gradients n hops.

    The gradients (float32 here) travel with their block and take one last hop home.
    """
    validate_context_parallel(seq_len, world_size)
    n, blk = world_size, batch * heads * (seq_len // world_size) * head_dim
    if n == 1:  # the whole sequence on one rank: nothing travels
        return 0
    return 2 * blk * ((n - 1) * bytes_per_el + n * grad_bytes_per_el)


def score_bytes(batch: int, heads: int, q_len: int, k_len: int, bytes_per_el: int = 4) -> int:
    """One score matrix, B·H·Tq·Tk elements (float32 by default, as the softmax runs)."""
    return batch * heads * q_len * k_len * bytes_per_el


def saved_bytes_per_rank(
    batch: int, heads: int, seq_len: int, head_dim: int, world_size: int, bytes_per_el: int
) -> int:
    """What ``RingAttention`` saves for backward per rank: q, k, v, out (float32) and lse.

    Linear in T/n: the whole sequence's T x T probabilities are never kept.
    """
    validate_context_parallel(seq_len, world_size)
    shard = batch * heads * (seq_len // world_size)
    return shard * head_dim * (3 * bytes_per_el + 4) + shard * 4


def ring_time_report(times: dict[int, dict[str, Any]], *, causal: bool = True) -> str:
    """The printed verdict on a ring's timings (``labkit.workers.cp_attention``'s "time" part).

    ``times[r]`` is rank r's ``post_s``, ``wait_s``, ``call_s``, ``compute_s`` lists and its
    ``blocks_computed``. Summarises each, compares the last rank's compute time with rank 0's
    (``verdict.compare_times``), and places the ratio of medians against the two predictions:
    the count of blocks (what our code computes: the diagonal block whole) and the work in
    half-blocks (what a kernel that skips the masked half does), or says it confirms neither.
    """
    import statistics

    from labkit import verdict

    n = len(times)
    lines = []
    for key, what in (("post_s", "posting the next hop"), ("wait_s", "waiting for a block")):
        lines += [verdict.summarize(t[key], f"rank {r} {what}").line(width=36)
                  for r, t in times.items()]
    slowest = [max(c) for c in zip(*(t["call_s"] for t in times.values()), strict=True)]
    lines.append(verdict.summarize(slowest, "whole call, slowest rank").line(width=36))
    lines.append("blocks computed (counted): "
                 + ", ".join(f"rank {r} {t['blocks_computed']}" for r, t in times.items()))
    last, first = times[n - 1], times[0]
    lines += [verdict.summarize(t["compute_s"], f"rank {r} computing").line(width=36)
              for r, t in ((n - 1, last), (0, first))]
    lines.append(verdict.compare_times(last["compute_s"], first["compute_s"],
                                       names=(f"rank {n - 1} computing", "rank 0 computing")).sentence)
    ratio = statistics.median(last["compute_s"]) / statistics.median(first["compute_s"])
    blocks = last["blocks_computed"] / first["blocks_computed"]
    half_blocks = (2 * n - 1) if causal else 1  # rank n-1: n-1 full blocks and a half; rank 0: a half
    if ratio > max(blocks, half_blocks):
        where = ("above both: the busier rank's time is inflated (on shared cores, contention), "
                 "so neither prediction is confirmed here")
    elif ratio < min(blocks, half_blocks):
        where = "below both: neither prediction is confirmed here"
    else:
        nearer = "blocks computed" if abs(ratio - blocks) <= abs(ratio - half_blocks) else "half-blocks"
        where = f"nearer the {nearer}"
    lines.append(f"rank {n - 1} / rank 0 compute time, medians (measured): {ratio:.2f}; blocks "
                 f"computed {blocks:.0f} (counted); work in half-blocks {half_blocks:.0f} "
                 f"(predicted): {where}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# What notebook 03c prints: the predictions above, and the causal schedule, as its tables.


@dataclass(frozen=True)
class RingPrediction:
    """What a ring of ``world_size`` ranks sends and holds for one attention call:
    :func:`ring_prediction`."""

    batch: int
    heads: int
    seq_len: int
    head_dim: int
    world_size: int
    kv_bytes: dict[str, int]  # dtype -> bytes each rank sends per forward call
    full_scores: int  # the T x T score matrix on one device (float32)
    block_scores: int  # one (T/n) x (T/n) block of a ring step (float32)

    def describe(self) -> str:
        n, T = self.world_size, self.seq_len
        lines = [f"attention: B={self.batch}, H={self.heads}, T={T}, D={self.head_dim}; "
                 f"context-parallel degree n={n} (T/n = {T // n} positions per rank)"]
        lines += [f"  predicted bytes each rank sends per forward call, {dt:>8}: {b:>10,}"
                  for dt, b in self.kv_bytes.items()]
        lines += [f"  predicted score matrix, one device holding T  (B·H·T²·4 bytes): "
                  f"{self.full_scores:>12,}",
                  f"  predicted score block, one ring step (B·H·(T/n)²·4 bytes):     "
                  f"{self.block_scores:>12,}"]
        return "\n".join(lines)


def ring_prediction(batch: int, heads: int, seq_len: int, head_dim: int, world_size: int, *,
                    dtypes: tuple[tuple[str, int], ...] = (("float32", 4), ("bfloat16", 2)),
                    ) -> RingPrediction:  # fmt: skip
    """:func:`ring_kv_bytes_per_rank` for each (dtype name, bytes) of ``dtypes`` and the score
    matrices one device and one ring step hold (:func:`score_bytes`)."""
    n = world_size
    kv = {dt: ring_kv_bytes_per_rank(batch, heads, seq_len, head_dim, n, nbytes)
          for dt, nbytes in dtypes}
    return RingPrediction(batch, heads, seq_len, head_dim, n, kv,
                          score_bytes(batch, heads, seq_len, seq_len),
                          score_bytes(batch, heads, seq_len // n, seq_len // n))


@dataclass(frozen=True)
class CausalBlocks:
    """What each rank of a causal ring with contiguous shards does with each block:
    :func:`causal_blocks`."""

    world_size: int
    also: tuple[int, ...] = ()  # other ring sizes whose imbalance the last line gives too

    def describe(self) -> str:
        n = self.world_size
        lines = [f"causal, contiguous shards: what rank r does with the block of rank j (n = {n}):",
                 "        " + "".join(f"{'block ' + str(j):>11}" for j in range(n))
                 + "   blocks computed"]  # fmt: skip
        lines += [f"rank {r}  " + "".join(f"{block_kind(r, j, causal=True):>11}" for j in range(n))
                  + f"   {blocks_computed(r, n, causal=True)}" for r in range(n)]
        lines.append("busiest rank's work / mean work (half-blocks, predicted): " + ", ".join(
            f"{causal_imbalance(m):.2f} at n = {m}" for m in (n, *self.also)))
        return "\n".join(lines)


def causal_blocks(world_size: int, *, also: int | tuple[int, ...] = ()) -> CausalBlocks:
    """The causal schedule of a ring of ``world_size`` (:func:`block_kind`,
    :func:`blocks_computed`), with the imbalance at ``world_size`` and at each size in ``also``."""
    return CausalBlocks(world_size, (also,) if isinstance(also, int) else tuple(also))
