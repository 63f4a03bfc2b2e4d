"""Notebook 03c's ``03c.moe_dispatch``: the all-to-all that sends each token to its expert.

``dispatch(x, dest, group=None) -> (received, recv_counts)``. Checked in 2 ranks: the tokens
each rank receives and their order, the counts, and the bytes the collectives moved (counted by
a dispatch mode that sees every collective): one all-to-all of the tokens, not a gather of all
of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labkit.course.exercises import ExerciseFailed, call, exercise, rank_checks, short_repr
from labkit.course.exercises.learner_code import require_callable

NPROC = 2
"""Ranks the rank-side check runs on."""


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
        "recipe: order this rank's tokens by destination with a stable sort (keeping each "
        "rank's tokens in their original order); count how many go to each rank; exchange "
        "those counts with one all-to-all of n integers, so that each rank learns how many it "
        "will receive from every other; make an output with room for their sum; then send the "
        "sorted tokens with one all-to-all, giving it the counts to receive as the output "
        "split sizes and the counts to send as the input split sizes; return the output and "
        "the received counts.",
    ),
)
def _verify_moe_dispatch(answer: Any) -> str:
    require_callable(answer, "dispatch")
    return rank_checks.run_in_workers("03c.moe_dispatch", [answer], nproc=NPROC)


RANK_CHECKS: dict[str, Callable[..., str]] = {"03c.moe_dispatch": _rank_moe_dispatch}
"""This exercise's rank-side check, for :func:`labkit.course.exercises.sequences_experts.rank_check`."""
