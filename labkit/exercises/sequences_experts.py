"""Exercise checks for notebook 03c (long sequences and many experts), in the kernel and in ranks.

As in notebooks 03 and 03b (:mod:`labkit.exercises.model_parallel`, whose machinery this module
reuses), the learner writes each answer to a file with ``%%writefile`` and checks it with
``ex.check_in_workers``: first what the kernel can check (merges of partial attentions with
masked rows), then a launch of ``labkit.exercises.mp_worker``, whose ranks import the same file
and run the rank-side check (:func:`rank_check`).

Exercises (``EXERCISES``: id -> the names the learner's file defines):

* ``03c.ring_merge``: ``merge(out_a, lse_a, out_b, lse_b) -> (out, lse)``, the online-softmax
  step of ring attention. Checked in the kernel against attention over the union of two
  disjoint key sets (rows that saw no key in one part included); in 2 ranks it replaces
  labkit's own merge inside :func:`labkit.parallel.context.ring_attention`, whose output must
  equal full attention's.
* ``03c.moe_dispatch``: ``dispatch(x, dest, group=None) -> (received, recv_counts)``, the
  all-to-all that sends each token to the rank holding its expert. Checked in 2 ranks: the
  tokens each rank receives and their order, the counts, and the bytes the collectives moved
  (counted by a dispatch mode that sees every collective): one all-to-all of the tokens, not
  a gather of all of them.

Importing this module registers the exercises and has no other effect.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from labkit.exercises import ExerciseFailed, _require_callable, call, exercise, short_repr
from labkit.exercises import model_parallel as mp

EXERCISES: dict[str, tuple[str, ...]] = {
    "03c.ring_merge": ("merge",),
    "03c.moe_dispatch": ("dispatch",),
}
"""Exercise id -> the names the learner's file must define."""
NPROC = {"03c.ring_merge": 2, "03c.moe_dispatch": 2}
"""Ranks each exercise's rank-side check runs on."""


def verify_file(exercise_id: str, path: str | Path) -> tuple[str, str]:
    """Check the learner's file ``path`` for ``exercise_id``, in the kernel and in ranks (what
    ``ex.check_in_workers`` calls)."""
    __tracebackhide__ = True
    return mp.verify_file(exercise_id, path, EXERCISES, nproc=NPROC.get(exercise_id, 2))


def rank_check(exercise_id: str, objs: Sequence[Any], ctx: Any) -> dict[str, Any]:
    """Inside a worker rank: run ``exercise_id``'s rank-side check, reported, never raised."""
    checks: dict[str, Callable[..., str]] = {
        "03c.ring_merge": _rank_ring_merge,
        "03c.moe_dispatch": _rank_moe_dispatch,
    }
    return mp.run_rank_check(exercise_id, checks, objs, ctx)


# --------------------------------------------------------------------------- 03c.ring_merge

MERGE_SHAPE = (2, 2, 6, 4)  # (B, H, T, D) of the queries; each part sees its own keys
MERGE_TOL = 1e-5


def _merge_case(seed: int, masked_a: int, masked_b: int) -> dict[str, torch.Tensor]:
    """Queries, two disjoint random key sets, each part's (out, lse), and the union's. The first
    ``masked_a`` queries see none of part a's keys (as early rows of a causal block do), the
    first ``masked_b`` none of part b's (a padding query sees no key at all)."""
    from labkit.parallel import context

    g = torch.Generator().manual_seed(seed)
    B, H, T, D = MERGE_SHAPE
    q = torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, H, 2 * T, D, generator=g) * 3  # large scores: a naive exp overflows less
    v = torch.randn(B, H, 2 * T, D, generator=g)
    perm = torch.randperm(2 * T, generator=g)
    keys_a, keys_b = perm[:T], perm[T:]
    mask_a = torch.ones(T, T, dtype=torch.bool)
    mask_a[:masked_a] = False
    mask_b = torch.ones(T, T, dtype=torch.bool)
    mask_b[:masked_b] = False
    scale = 1 / math.sqrt(D)
    out_a, lse_a = context.block_attention(q, k[..., keys_a, :], v[..., keys_a, :], scale=scale,
                                           mask=mask_a)  # fmt: skip
    out_b, lse_b = context.block_attention(q, k[..., keys_b, :], v[..., keys_b, :], scale=scale,
                                           mask=mask_b)  # fmt: skip
    union = torch.cat([mask_a, mask_b], dim=1)
    keys = torch.cat([keys_a, keys_b])
    out, lse = context.block_attention(q, k[..., keys, :], v[..., keys, :], scale=scale, mask=union)
    return {"out_a": out_a, "lse_a": lse_a, "out_b": out_b, "lse_b": lse_b, "out": out, "lse": lse}


def merge_diagnosis(case: dict[str, torch.Tensor], out: torch.Tensor, lse: torch.Tensor) -> str:
    """The likely mistake behind a wrong merge."""
    a, b = case["out_a"], case["out_b"]
    if torch.isnan(out).any() or torch.isnan(lse).any():
        return ("NaN in your result. A row that saw none of a part's keys has lse −inf there; "
                "subtracting −inf from −inf is NaN. Weigh each part by exp(lse_part − lse) with "
                "lse = logaddexp(lse_a, lse_b), which gives such a part weight 0")  # fmt: skip
    if torch.allclose(out, (a + b) / 2, atol=1e-4):
        return ("you averaged the two outputs. Each is normalised over its own keys only; weigh "
                "each by its share of the union's softmax mass, exp(lse_part − lse)")  # fmt: skip
    if torch.allclose(lse, torch.maximum(case["lse_a"], case["lse_b"]), atol=1e-4):
        return ("your lse is the larger of the two. The union's log-sum-exp is "
                "log(exp(lse_a) + exp(lse_b)): torch.logaddexp computes it without overflow")  # fmt: skip
    if torch.allclose(lse, case["lse"], atol=1e-4):
        return ("the lse is right; the output is not. out = exp(lse_a − lse)·out_a + "
                "exp(lse_b − lse)·out_b")  # fmt: skip
    return ("compare with attention over the union of both key sets: lse = logaddexp(lse_a, "
            "lse_b); each output weighted by exp(lse_part − lse)")  # fmt: skip


def check_merge(fn: Any) -> str:
    _require_callable(fn, "merge")
    for seed, masked_a, masked_b in [(0, 0, 0), (1, 2, 0), (2, 3, 1)]:
        case = _merge_case(seed, masked_a, masked_b)
        got = call(fn, case["out_a"].clone(), case["lse_a"].clone(), case["out_b"].clone(),
                   case["lse_b"].clone())  # fmt: skip
        if not (isinstance(got, tuple) and len(got) == 2):
            raise ExerciseFailed(f"merge returned {short_repr(got)}: return (out, lse)")
        out, lse = got
        if not (isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)):
            raise ExerciseFailed(f"merge returned {short_repr(got)}: both must be tensors")
        if out.shape != case["out"].shape or lse.shape != case["lse"].shape:
            raise ExerciseFailed(
                f"merge returned shapes {tuple(out.shape)} and {tuple(lse.shape)}: expected "
                f"{tuple(case['out'].shape)} (B, H, T, D) and {tuple(case['lse'].shape)} (B, H, T)"
            )
        ok = torch.allclose(out, case["out"], atol=MERGE_TOL) and torch.allclose(
            lse, case["lse"], atol=MERGE_TOL
        )
        if not ok:
            raise ExerciseFailed(merge_diagnosis(case, out, lse))
    return ("your merge of two partial attentions equals attention over the union of their keys "
            "(rows that saw no key of one part, or of either, included)")  # fmt: skip


@exercise(
    "03c.ring_merge",
    "The online-softmax merge of two partial attentions",
    hints=(
        "Each partial output is normalised over its own keys only. To combine two, weigh each "
        "by its share of the total softmax mass, which its log-sum-exp tells you.",
        "The union's log-sum-exp is log(exp(lse_a) + exp(lse_b)); compute it with "
        "torch.logaddexp so that large scores do not overflow.",
        "recipe: lse = torch.logaddexp(lse_a, lse_b); out = exp(lse_a − lse)[..., None] · out_a + "
        "exp(lse_b − lse)[..., None] · out_b. Where lse is −inf (no key seen in either part) "
        "return 0, and make a part whose lse is −inf weigh 0 (no −inf − (−inf)).",
    ),
)
def _verify_ring_merge(answer: Any) -> str:
    said = check_merge(answer)
    return f"{said}; {mp.run_in_workers('03c.ring_merge', [answer], nproc=NPROC['03c.ring_merge'])}"


RING_SHAPE = (1, 2, 16, 8)  # (B, H, T, D) of the whole sequence; each rank holds T / n


def _rank_ring_merge(ctx: Any, fn: Callable[..., Any]) -> str:
    """labkit's ring attention with the learner's merge, against full attention."""
    from unittest import mock

    from labkit.parallel import context

    n, r = ctx.world_size, ctx.rank
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*RING_SHAPE, generator=g) for _ in range(3))
    tl = RING_SHAPE[2] // n
    shard = slice(r * tl, (r + 1) * tl)
    for causal in (True, False):
        want, _ = context.full_attention(q, k, v, causal=causal)
        with mock.patch.object(context, "merge", fn), torch.no_grad():
            got = context.ring_attention(q[..., shard, :], k[..., shard, :], v[..., shard, :],
                                         causal=causal, timings={})  # fmt: skip
        err = float((got - want[..., shard, :]).abs().max())
        if not err <= MERGE_TOL:
            raise ExerciseFailed(
                f"rank {r}'s ring attention with your merge ({'causal' if causal else 'full'} "
                f"mask) differs from full attention by {err:.2e}"
            )
    return (f"and it ran inside a real {n}-rank ring: each rank's output equals full "
            "attention's, causal and not" if r == 0 else "ok")  # fmt: skip


# --------------------------------------------------------------------------- 03c.moe_dispatch

DISPATCH_TOKENS, DISPATCH_H = 7, 4  # tokens per rank, features per token


def _tokens(rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens, each tagged with (source rank, index), and their destinations
    (uneven and unsorted, so a missing sort or a swapped split shows)."""
    idx = torch.arange(DISPATCH_TOKENS, dtype=torch.float32)
    x = torch.stack([torch.full_like(idx, rank), idx, idx * 0 + 7, idx * 0 - 1], dim=1)
    g = torch.Generator().manual_seed(100 + rank)
    dest = torch.randint(0, n, (DISPATCH_TOKENS,), generator=g)
    dest[0], dest[1] = n - 1, 0  # every rank sends to the last rank and to rank 0
    return x, dest


def expected_dispatch(rank: int, n: int) -> tuple[torch.Tensor, list[int]]:
    """The tokens ``rank`` must receive: by source rank, each source's in its own order."""
    rows, counts = [], []
    for src in range(n):
        x, dest = _tokens(src, n)
        mine = x[dest == rank]
        rows.append(mine)
        counts.append(mine.shape[0])
    return torch.cat(rows), counts


def _c10d_calls() -> Any:
    """A dispatch mode recording every c10d collective as (name, bytes of the tensor it sends)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d" and func._opname not in ("barrier", "monitored_barrier_"):
                # alltoall_base_(output, input, ...): the tensor sent is the second argument
                sent = args[1] if func._opname == "alltoall_base_" else args[0]
                size = sum(t.numel() * t.element_size() for t in
                           (sent if isinstance(sent, (list, tuple)) else [sent])
                           if isinstance(t, torch.Tensor))  # fmt: skip
                self.calls.append((func._opname.rstrip("_"), size))
            return func(*args, **(kwargs or {}))

    return Seen()


def _rank_moe_dispatch(ctx: Any, fn: Callable[..., Any]) -> str:
    n, r = ctx.world_size, ctx.rank
    x, dest = _tokens(r, n)
    want, want_counts = expected_dispatch(r, n)
    seen = _c10d_calls()
    with seen:
        got = call(fn, x.clone(), dest.clone(), None)
    if not (isinstance(got, tuple) and len(got) == 2):
        raise ExerciseFailed(f"dispatch returned {short_repr(got)}: return (received, recv_counts)")
    received, recv_counts = got
    recv_counts = [int(c) for c in torch.as_tensor(recv_counts).reshape(-1).tolist()]
    if recv_counts != want_counts:
        raise ExerciseFailed(
            f"rank {r} should receive {want_counts} tokens from ranks 0..{n - 1}; your counts "
            f"say {recv_counts}. Likely: the receive counts are what the *other* ranks send here "
            "(exchange the send counts with an all-to-all first), not this rank's send counts"
        )
    if not isinstance(received, torch.Tensor) or received.shape != want.shape:
        raise ExerciseFailed(
            f"rank {r} should receive a tensor of shape {tuple(want.shape)}; got "
            f"{short_repr(received)}"
        )
    if not torch.equal(received, want):
        pairs = [(int(a), int(b)) for a, b in received[:, :2].tolist()]
        raise ExerciseFailed(
            f"rank {r} received the tokens (source, index) {pairs}, expected "
            f"{[(int(a), int(b)) for a, b in want[:, :2].tolist()]}. Likely: the tokens were "
            "not sorted by destination before the all-to-all, which sends the first send[0] rows "
            "to rank 0, the next send[1] to rank 1, and so on (sort stably to keep their order)"
        )
    others = sorted({name for name, _ in seen.calls if name != "alltoall_base"})
    token_bytes = x.numel() * x.element_size()
    biggest = max((b for name, b in seen.calls if name == "alltoall_base"), default=0)
    if others or biggest != token_bytes:
        raise ExerciseFailed(
            f"rank {r} called {[name for name, _ in seen.calls]}, the largest all-to-all sending "
            f"{biggest} B; its {DISPATCH_TOKENS} tokens are {token_bytes} B. Send each token "
            "once, to its own rank, with all_to_all_single (an all-gather sends every token to "
            "every rank)"
        )
    count_bytes = sum(b for _, b in seen.calls) - token_bytes
    return (f"on {n} real ranks every token reached its rank in order; counted on rank 0: "
            f"{len(seen.calls)} all-to-all calls, {token_bytes} B of tokens (each sent once) and "
            f"{count_bytes} B of counts" if r == 0 else "ok")  # fmt: skip


@exercise(
    "03c.moe_dispatch",
    "Dispatch tokens to the ranks of their experts with one all-to-all",
    hints=(
        "An all-to-all sends a different slice of one tensor to each rank. Before the tokens "
        "can move, every rank must know how many it will receive from each of the others.",
        "Count the tokens per destination (torch.bincount), exchange those counts with an "
        "all_to_all_single of n integers, then sort the tokens by destination so that each "
        "rank's tokens form one contiguous slice.",
        "recipe: order = torch.argsort(dest, stable=True); send = torch.bincount(dest, minlength=n); "
        "recv = torch.empty_like(send); all_to_all_single(recv, send); out = x.new_empty("
        "(int(recv.sum()), x.shape[1])); all_to_all_single(out, x[order], recv.tolist(), "
        "send.tolist()); return out, recv.",
    ),
)
def _verify_moe_dispatch(answer: Any) -> str:
    _require_callable(answer, "dispatch")
    return mp.run_in_workers("03c.moe_dispatch", [answer], nproc=NPROC["03c.moe_dispatch"])
