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
* ``03c.sequence_plan`` (in the kernel, ``ex.check``): ``plan_sequence(seq_len, budget_bytes,
  measured)``, which of section 1's layouts ("tp", "sp_keep_gathered", "sp") to run a longer
  sequence with, from their measured saved activations and traffic, or "cp" when none fits.
  Checked on what the notebook measures for its model at two sizes (:func:`sequence_measurements`)
  in seven cases; a learner whose answers all follow one usual wrong rule (``WRONG_RULES``) gets
  that rule named. The notebook then runs the three layouts at the new length for real.

Importing this module registers the exercises and has no other effect.
"""

from __future__ import annotations

import copy
import functools
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
        return ("NaN in your result. A row that saw none of a part's keys has lse −inf there, "
                "and a row that saw no key at all has −inf in both parts: −inf − (−inf) is NaN. "
                "Such a part must weigh exactly 0, and a row with no key must come out 0")  # fmt: skip
    if torch.allclose(out, (a + b) / 2, atol=1e-4):
        return ("you averaged the two outputs. Each is normalised over its own keys only, so "
                "each counts in proportion to its share of the union's softmax mass, which "
                "the log-sum-exps give")  # fmt: skip
    if torch.allclose(lse, torch.maximum(case["lse_a"], case["lse_b"]), atol=1e-4):
        return ("your lse is the larger of the two. The union's log-sum-exp is "
                "log(exp(lse_a) + exp(lse_b)): torch.logaddexp computes it without overflow")  # fmt: skip
    if torch.allclose(lse, case["lse"], atol=1e-4):
        return ("the lse is right; the output is not. Each partial output must be scaled by "
                "its part's share of the union's softmax mass before the two are added")  # fmt: skip
    return ("compare with attention over the union of both key sets: its denominator is the "
            "sum of the two parts' denominators, and each partial output counts in proportion "
            "to its part's share of it")  # fmt: skip


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
        "recipe: first combine the two log-sum-exps into the union's with the overflow-safe "
        "function of hint 2; then give each part a weight, the exponential of how far its own "
        "log-sum-exp lies below the union's (one number per query, broadcast over the "
        "features); scale each partial output by its weight and add the two; last, guard the "
        "rows that saw no key: where the union's log-sum-exp is minus infinity, subtract zero "
        "instead, so that no weight becomes NaN, and let a part of weight zero add nothing.",
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
    _require_callable(answer, "dispatch")
    return mp.run_in_workers("03c.moe_dispatch", [answer], nproc=NPROC["03c.moe_dispatch"])


# --------------------------------------------------------------------------- 03c.sequence_plan
#
# A longer sequence on the same two tensor-parallel ranks, the batch fixed, no recomputation:
# plain TP, TP+SP keeping the gathered inputs, TP+SP re-gathering them, or, if none of them
# fits, context parallelism (the sequence split over more ranks).

SEQ_LAYOUTS = ("tp", "sp_keep_gathered", "sp")
"""The layouts of notebook 03c's section 1, as ``sequence.MODES`` names them."""
SEQ_ANSWERS = (*SEQ_LAYOUTS, "cp")


def _scaled(m: dict[str, Any], seq_len: int, power: int = 1) -> float:
    return m["saved_bytes"] * (seq_len / m["seq_len"]) ** power


def _plan(measured: dict[str, Any], seq_len: int, budget: float, *, power: int = 1,
          fit: bool = True, by: str = "sent_bytes") -> str:  # fmt: skip
    """The reference (power 1, fit, by bytes sent) and the usual wrong rules."""
    fits = [k for k in SEQ_LAYOUTS if not fit or _scaled(measured[k], seq_len, power) <= budget]
    if not fits:
        return "cp"
    if by == "saved_bytes":
        return min(fits, key=lambda k: measured[k]["saved_bytes"])
    return min(fits, key=lambda k: (measured[k]["sent_bytes"], measured[k]["saved_bytes"]))


def reference_plan_sequence(seq_len: int, budget_bytes: float, measured: dict[str, Any]) -> str:
    """What later cells use while the learner's answer is not done or wrong: of the layouts
    whose saved activations, grown linearly from the measured length to ``seq_len``, fit the
    budget, the one that sends the fewest bytes; "cp" if none fits."""
    return _plan(measured, seq_len, budget_bytes)


def sequence_measurements(cfg: Any, batch: int, tp: int = 2) -> dict[str, Any]:
    """What notebook 03c's section 1 measures for ``cfg`` (it finds the saved bytes equal to
    these predictions on CPU ranks, to the byte, and counts the collectives): per layout, the
    sequence length, the bytes autograd saves per rank in one forward and the bytes a rank sends
    per training step."""
    from labkit.parallel import sequence

    return {mode: {"seq_len": cfg.seq_len,
                   "saved_bytes": sum(sequence.predicted_activations_per_rank(
                       cfg, batch, tp, mode=mode).values()),
                   "sent_bytes": sum(r["sent_per_rank"] for r in sequence.collectives_per_step(
                       cfg, batch, tp, mode=mode).values())}
            for mode in SEQ_LAYOUTS}  # fmt: skip


@functools.cache
def _sequence_cases() -> tuple[tuple[dict[str, Any], int, float, str], ...]:
    """(measured, seq_len, budget_bytes, what) on notebook 03c's model at its lab and smoke
    sizes: every answer occurs, and each usual mistake gives another one somewhere."""
    from labkit.config import ModelConfig

    lab = ModelConfig(seq_len=128, n_layer=4, n_head=4, d_model=128)
    smoke = ModelConfig(seq_len=32, n_layer=4, n_head=4, d_model=64)
    out = []
    for cfg, batch, seq_len, budget_mib in ((lab, 8, 256, 21), (lab, 8, 256, 42), (lab, 8, 256, 38),
                                            (lab, 8, 512, 100), (lab, 8, 512, 60),
                                            (smoke, 4, 128, 5), (lab, 8, 128, 20)):  # fmt: skip
        what = (f"the GPT of d {cfg.d_model}, {cfg.n_layer} layers measured at {cfg.seq_len} "
                f"tokens × {batch} sequences, asked for {seq_len} tokens in {budget_mib} MiB "
                "per rank")  # fmt: skip
        out.append((sequence_measurements(cfg, batch), seq_len, budget_mib * 2**20, what))
    return tuple(out)


WRONG_RULES = {"unscaled": {"power": 0}, "squared": {"power": 2},
               "least memory": {"by": "saved_bytes"}, "budget ignored": {"fit": False}}  # fmt: skip
"""The usual wrong plans, as settings of :func:`_plan`: a learner's answers that match one of
them on every case get that mistake named."""


def plan_diagnosis(measured: dict[str, Any], seq_len: int, budget: float, got: str,
                   rule: str | None = None) -> str:  # fmt: skip
    """Why ``got`` is wrong in this case; ``rule``: the usual wrong rule (``WRONG_RULES``)
    that gave all the learner's answers, if one did."""
    want = _plan(measured, seq_len, budget)
    s0 = next(iter(measured.values()))["seq_len"]
    need = {k: _scaled(measured[k], seq_len) / 2**20 for k in SEQ_LAYOUTS}
    sizes = ", ".join(f"{k} {v:.1f} MiB" for k, v in need.items())
    if rule == "unscaled":
        return (f"you compared the bytes measured at {s0} tokens with the budget. Activations "
                f"grow with the sequence: at {seq_len} tokens each layout saves {seq_len / s0:g}× "
                "what was measured")  # fmt: skip
    if rule == "squared":
        return (f"you grew the activations with the square of the length. This GPT's fused "
                "attention keeps no s × s matrix, only a log-sum-exp per row (section 1 "
                f"counted every saved tensor): they grow linearly, to {sizes} at {seq_len} "
                "tokens")  # fmt: skip
    if got != "cp" and need[got] * 2**20 > budget:
        return (f"{got} does not fit: {need[got]:.1f} MiB at {seq_len} tokens against a budget "
                f"of {budget / 2**20:.1f} MiB. Keep only the layouts that fit"
                + (", and if none does, split the sequence over more ranks ('cp')"
                   if want == "cp" else ""))  # fmt: skip
    if got == "cp":
        return (f"{want} fits ({sizes} at {seq_len} tokens, budget {budget / 2**20:.1f} MiB): "
                "context parallelism adds ranks only when no layout of the tensor-parallel "
                "group fits")  # fmt: skip
    if want == "cp":
        return (f"no layout fits ({sizes} at {seq_len} tokens, budget {budget / 2**20:.1f} MiB): "
                "the sequence must be split over more ranks, 'cp'")  # fmt: skip
    if measured[got]["saved_bytes"] < measured[want]["saved_bytes"]:
        return (f"{got} saves less memory, but {want} fits too ({need[want]:.1f} MiB) and "
                f"sends fewer bytes per step ({measured[want]['sent_bytes'] / 2**20:.2f} MiB "
                f"against {measured[got]['sent_bytes'] / 2**20:.2f} MiB at the measured length): "
                "among the layouts that fit, choose the one that costs the least traffic")  # fmt: skip
    return "among the layouts that fit the budget, choose the one that sends the fewest bytes"


@exercise(
    "03c.sequence_plan",
    "Choose tensor, sequence or context parallelism for a longer sequence",
    hints=(
        "Two questions for each layout of section 1: will its activations fit at the new "
        "length, and what does it cost in communication? Less memory always costs more "
        "traffic here.",
        "You measured at one length and are asked about another. How do the bytes autograd "
        "saves grow with the sequence in this GPT, whose attention keeps no s × s matrix? "
        "Section 1 counted every saved tensor.",
        "When none of the tensor-parallel group's layouts fits, the only lever left here (the "
        "batch fixed, no recomputation) is to split the sequence over more ranks.",
        "recipe: for each of the three layouts, grow its measured saved bytes in proportion to "
        "the new length and keep it if that fits the budget; of those kept, answer the one "
        "whose measured traffic is smallest; if none is kept, answer context parallelism.",
    ),
    reference=reference_plan_sequence,
)
def _verify_sequence_plan(answer: Any) -> str:
    fn = _require_callable(answer, "plan_sequence(seq_len, budget_bytes, measured) -> str")
    cases = _sequence_cases()
    gots = []
    for measured, seq_len, budget, what in cases:
        got = call(fn, seq_len, budget, copy.deepcopy(measured))
        if got not in SEQ_ANSWERS:
            raise ExerciseFailed(f"{what}: you returned {short_repr(got)}: return one of "
                                 f"{list(SEQ_ANSWERS)}")  # fmt: skip
        gots.append(got)
    rule = next((name for name, kw in WRONG_RULES.items()
                 if all(_plan(m, s, b, **kw) == g for (m, s, b, _), g in zip(cases, gots, strict=True))),
                None)  # fmt: skip
    for (measured, seq_len, budget, what), got in zip(cases, gots, strict=True):
        if got != _plan(measured, seq_len, budget):
            raise ExerciseFailed(f"{what}: you chose {got!r}. "
                                 f"{plan_diagnosis(measured, seq_len, budget, got, rule)}")  # fmt: skip
    return ("your plan is right on the measurements of this notebook's model at two sizes, "
            "seven cases in all (each answer occurs); the next cell runs it for real")
