"""Notebook 03c's ``03c.ring_loop``: one rank's loop of ring attention.

``ring_loop(q, k, v, ring, *, causal) -> (out, lse)``: which rank's K/V block is in hand at
each step, which blocks a causal mask hides entirely (skipped, still passed on), the running
(output, log-sum-exp) merged with labkit's ``merge``. The reference is labkit's own
:func:`labkit.parallel.context.ring_attention_blocks`. Checked in the kernel on every rank of
simulated rings of 1 to 4 ranks, causal and not, against SDPA over the whole sequence, with each
hop checked and ``block_attention`` and ``merge`` traced, so that a mistake is named (a
hidden block merged, a block merged twice, a wasted block, a stale log-sum-exp); then on a real
2-rank ring (:class:`labkit.parallel.context.P2PRing`).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from labkit.course.exercises import ExerciseFailed, call, exercise, rank_checks, short_repr
from labkit.course.exercises.learner_code import require_callable

NPROC = 2
"""Ranks the rank-side check runs on."""


# --------------------------------------------------------------------------- 03c.ring_loop
#
# The learner writes one rank's ring loop, ``ring_loop(q, k, v, ring, *, causal) -> (out, lse)``,
# with labkit's block attention and merge; the reference is labkit's own
# :func:`labkit.parallel.context.ring_attention_blocks`. In the kernel every rank of rings of 1
# to 4 ranks runs it on a simulated ring that checks each hop, with ``block_attention`` and
# ``merge`` traced, against SDPA over the whole sequence; then 2 real ranks run it over gloo.

RING_CASES = ((4, 3, True), (3, 4, True), (2, 5, True), (1, 6, True),
              (4, 3, False), (3, 4, False), (2, 5, False), (1, 6, False))  # fmt: skip
"""(ranks n, positions per rank Tl, causal): the kernel runs every rank of each."""
RING_BHD = (1, 2, 4)  # B, H, D of the kernel's cases
RING_TOL = 1e-5  # float32 against SDPA: the same sums, reordered (~1e-7 here)


def _ring_case(n: int, tl: int, causal: bool, shape: tuple[int, int, int] = RING_BHD
               ) -> dict[str, Any]:  # fmt: skip
    """The whole sequence's q, k, v (B, H, n·Tl, D), its shards, and SDPA's output and the
    log-sum-exp of the scaled, masked scores, the learner's targets."""
    import torch.nn.functional as F

    B, H, D = shape
    g = torch.Generator().manual_seed(1000 * n + 10 * tl + causal)
    q, k, v = (torch.randn(B, H, n * tl, D, generator=g) for _ in range(3))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(D)
    if causal:
        hidden = ~torch.ones(n * tl, n * tl, dtype=torch.bool).tril()  # key after query
        scores = scores.masked_fill(hidden, float("-inf"))
    return {"n": n, "tl": tl, "causal": causal, "q": q, "k": k, "v": v,
            "qs": list(q.chunk(n, dim=2)), "ks": list(k.chunk(n, dim=2)),
            "vs": list(v.chunk(n, dim=2)),
            "out": F.scaled_dot_product_attention(q, k, v, is_causal=causal),
            "lse": torch.logsumexp(scores, dim=-1)}  # fmt: skip


def _owner(t: Any, blocks: Sequence[torch.Tensor]) -> int | None:
    """Which rank's block ``t`` is (by value), or None."""
    if not isinstance(t, torch.Tensor):
        return None
    return next((j for j, b in enumerate(blocks) if t.shape == b.shape and torch.equal(t, b)), None)


class CheckingRing:
    """One rank's ring in the kernel: :class:`labkit.parallel.context.LocalRing`'s hops, each
    checked: the block passed on must be the one in hand."""

    def __init__(self, rank: int, k_blocks: list[torch.Tensor], v_blocks: list[torch.Tensor]):
        from labkit.parallel import context

        self._ring = context.LocalRing(rank, k_blocks, v_blocks)
        self.rank, self.size = rank, len(k_blocks)
        self.bad_pass: tuple[int, int | None, int] | None = None  # (hop, passed, in hand)

    @property
    def hops(self) -> int:
        return self._ring.hops

    def pass_on(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        held = (self.rank - self.hops) % self.size
        passed = _owner(k, self._ring.k_blocks)
        if self.bad_pass is None and (passed != held or _owner(v, self._ring.v_blocks) != held):
            self.bad_pass = (self.hops + 1, passed, held)
        k, v = self._ring.pass_on(k, v)
        return k.clone(), v.clone()  # copies, as a real hop delivers: the originals stay intact


class _Trace:
    """What the learner's loop did on one rank: each block computed (whose, which mask, after
    how many hops, with which scale, its result) and each merge (its arguments, its result)."""

    def __init__(self, case: dict[str, Any], ring: CheckingRing) -> None:
        self.case, self.ring = case, ring
        self.attended: list[dict[str, Any]] = []
        self.merges: list[dict[str, Any]] = []
        self.library_loop = False

    def mask_kind(self, mask: Any) -> str:
        if mask is None:
            return "none"
        tl = self.case["tl"]
        if not isinstance(mask, torch.Tensor) or mask.shape != (tl, tl) or mask.dtype != torch.bool:
            return "other"
        if bool(mask.all()):
            return "none"  # every key visible: the same as no mask
        if not bool(mask.any()):
            return "hidden"
        tril = torch.ones(tl, tl, dtype=torch.bool).tril()
        return "diagonal" if torch.equal(mask.cpu(), tril) else "other"


@contextlib.contextmanager
def _traced(trace: _Trace, fn: Callable[..., Any]) -> Any:
    """Route labkit's ``block_attention`` and ``merge`` (as ``context.<name>`` and as names the
    learner's module imported) through ``trace``; flag a call to labkit's own ring loop."""
    from labkit.parallel import context

    attend0, merge0 = context.block_attention, context.merge

    def block_attention(*args: Any, **kwargs: Any) -> Any:
        result = attend0(*args, **kwargs)
        bound = inspect.signature(attend0).bind(*args, **kwargs).arguments
        trace.attended.append({"owner": _owner(bound["k"], trace.case["ks"]),
                               "mask": trace.mask_kind(bound.get("mask")),
                               "hop": trace.ring.hops, "scale": bound["scale"], "result": result})  # fmt: skip
        return result

    def merge(*args: Any, **kwargs: Any) -> Any:
        result = merge0(*args, **kwargs)
        trace.merges.append({"args": inspect.signature(merge0).bind(*args, **kwargs).arguments,
                             "result": result})  # fmt: skip
        return result

    def library(orig: Callable[..., Any]) -> Callable[..., Any]:
        def flagged(*args: Any, **kwargs: Any) -> Any:
            trace.library_loop = True
            return orig(*args, **kwargs)

        return flagged

    swaps = {"block_attention": block_attention, "merge": merge,
             "ring_attention_blocks": library(context.ring_attention_blocks),
             "ring_local": library(context.ring_local)}  # fmt: skip
    originals = {name: getattr(context, name) for name in swaps}
    learner = getattr(fn, "__globals__", {})
    imported = {name: value for name, value in learner.items()
                if any(value is originals[n] for n in swaps)}  # fmt: skip
    try:
        for name, new in swaps.items():
            setattr(context, name, new)
        for name, value in imported.items():
            learner[name] = swaps[next(n for n in swaps if originals[n] is value)]
        yield trace
    finally:
        for name, value in originals.items():
            setattr(context, name, value)
        learner.update(imported)


def _same(a: Any, b: torch.Tensor) -> bool:
    return a is b or (isinstance(a, torch.Tensor) and a.shape == b.shape and torch.equal(a, b))


def _find(pair: tuple[Any, Any], among: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int | None:
    """Index of ``pair`` in ``among``: the same tensors first, else equal ones (two hidden
    blocks give equal results, zeros and -inf)."""
    for same in (lambda x, y: x is y, _same):
        i = next((i for i, p in enumerate(among)
                  if same(pair[0], p[0]) and same(pair[1], p[1])), None)  # fmt: skip
        if i is not None:
            return i
    return None


def _merge_chain(trace: _Trace) -> str | None:
    """The first merge that does not fold a new block into the running state, in words."""
    parts = [a["result"] for a in trace.attended]
    if not parts:
        return None
    state: tuple[torch.Tensor, torch.Tensor] | None = None
    merged: set[int] = set()
    for i, m in enumerate(trace.merges, start=1):
        a = (m["args"]["out_a"], m["args"]["lse_a"])
        b = (m["args"]["out_b"], m["args"]["lse_b"])
        if state is None:  # the running state starts as a block: the first merge's first one
            ia, ib = _find(a, parts), _find(b, parts)
            if ia is not None and ia == ib:
                return (f"a block merged twice: merge 1 folded the block of rank "
                        f"{trace.attended[ia]['owner']} into itself; fold each new block into "
                        "the running state (the first block, then what each merge returned)")  # fmt: skip
            first = ia if ia is not None else ib
            if first is None:
                return None  # it merged none of the blocks computed: the comparison tells
            merged.add(first)
            state = parts[first]
        if _find(a, [state]) is not None:
            other = b
        elif _find(b, [state]) is not None:
            other = a
        else:
            if any(_same(x[0], state[0]) for x in (a, b)):
                return (f"the running log-sum-exp was not updated: merge {i} got the running "
                        "output with an older log-sum-exp. Keep both things each merge "
                        "returns: the next merge weighs the running output by that log-sum-exp")  # fmt: skip
            if any(_same(x[1], state[1]) for x in (a, b)):
                return (f"the running output was not updated: merge {i} got the running "
                        "log-sum-exp with an older output. Keep both things each merge returns")  # fmt: skip
            return (f"merge {i} was not given the running (output, log-sum-exp), the pair merge "
                    f"{i - 1} returned: each block is folded into the running state")  # fmt: skip
        unmerged = [k for k in range(len(parts)) if k not in merged]
        new = _find(other, [parts[k] for k in unmerged])
        if new is not None:
            merged.add(unmerged[new])
        elif (again := _find(other, parts)) is not None:
            return (f"a block merged twice: merge {i} folded in the block of rank "
                    f"{trace.attended[again]['owner']} again; each block counts once")  # fmt: skip
        state = m["result"]
    return None


def _returned_state(trace: _Trace, out: torch.Tensor, lse: torch.Tensor) -> str | None:
    """Whether the loop returned its last state with an older log-sum-exp or output."""
    states = [a["result"] for a in trace.attended] + [m["result"] for m in trace.merges]
    last = trace.merges[-1]["result"] if trace.merges else None
    if last is None or _find((out, lse), [last]) is not None:
        return None
    if _same(out, last[0]) and any(_same(lse, st[1]) for st in states):
        return ("the running log-sum-exp was not updated: your loop returned the output of its "
                "last merge with an older log-sum-exp. Keep both things each merge returns (the "
                "next merge weighs the running output by it; the backward recomputes each "
                "block's probabilities from it)")  # fmt: skip
    if _same(lse, last[1]) and any(_same(out, st[0]) for st in states):
        return ("the running output was not updated: your loop returned the log-sum-exp of its "
                "last merge with an older output. Keep both things each merge returns")  # fmt: skip
    return None


def _decisions_message(r: int, n: int, causal: bool, did: dict[int, str]) -> str | None:
    """The first block rank ``r`` handled otherwise than the causal rule asks, in words.
    ``did``: owner -> "skip", "none" (no mask), "diagonal", "hidden" or "other"."""
    from labkit.parallel import context

    as_mask = {"skip": "skip", "full": "none", "diagonal": "diagonal"}
    want = {j: as_mask[context.block_kind(r, j, causal=causal)] for j in range(n)}
    ok = {j: did[j] == want[j] or (want[j] == "skip" and did[j] == "hidden") for j in range(n)}
    if all(ok.values()):
        return None
    arrival = [(r - s) % n for s in range(n)]
    mirrored = {arrival[s]: want[(r + s) % n] for s in range(n)}  # blocks read as coming from r + 1
    if causal and n > 2 and all(did[j] == mirrored[j]
                                or (mirrored[j] == "skip" and did[j] == "hidden")
                                for j in range(n)):  # fmt: skip
        return (f"rank {r} skipped and masked the blocks as if they came round the other way: "
                f"pass_on sends to rank + 1, so what arrives comes from rank − 1; at step 1 rank "
                f"{r} holds the block of rank {(r - 1) % n}, not of rank {(r + 1) % n}")  # fmt: skip
    j = next(j for j in arrival if not ok[j])
    how = {"none": "in full", "diagonal": "with the diagonal block's causal mask",
           "hidden": "with every key masked", "other": "with another mask",
           "skip": "not at all"}[did[j]]  # fmt: skip
    if want[j] == "skip":
        return (f"the block of rank {j}, which the causal mask hides entirely from rank {r}'s "
                f"queries (all its keys come after them), was merged ({how}): rank {r} must skip "
                "blocks from later ranks")  # fmt: skip
    if want[j] == "diagonal":
        if did[j] == "skip":
            return (f"rank {r} skipped its own block: it holds each query's own position and the "
                    "positions before it in the shard; attend it with the causal mask")  # fmt: skip
        return (f"rank {r}'s own block (the diagonal one) was attended {how}: inside it a query at "
                "position i of the shard sees the keys at positions 0 to i, itself included, and "
                "no later one")  # fmt: skip
    why = (f"every key of rank {j} comes before every query of rank {r}" if causal
           else "without a causal mask every query sees every key")  # fmt: skip
    block = "its own block" if j == r else f"the block of rank {j}"
    did_what = f"skipped {block}" if did[j] == "skip" else f"attended {block} {how}"
    return f"rank {r} {did_what}; {why}: attend it in full, unmasked"


def ring_diagnosis(case: dict[str, Any], r: int, trace: _Trace, got: Any) -> str | None:
    """What is wrong with what the learner's loop did on rank ``r`` of ``case``, or None."""
    n, tl, causal = case["n"], case["tl"], case["causal"]
    B, H, _, D = case["q"].shape
    if trace.library_loop:
        return ("your loop called labkit's own ring loop (cp.ring_attention_blocks or "
                "cp.ring_local): write the loop itself, with cp.block_attention and cp.merge")  # fmt: skip
    if not (isinstance(got, tuple) and len(got) == 2
            and all(isinstance(t, torch.Tensor) for t in got)):  # fmt: skip
        return f"ring_loop returned {short_repr(got)}: return (out, lse), two tensors"
    out, lse = got
    if out.shape != (B, H, tl, D) or lse.shape != (B, H, tl):
        return (f"ring_loop returned shapes {tuple(out.shape)} and {tuple(lse.shape)}: expected "
                f"{(B, H, tl, D)} (B, H, Tl, D) and {(B, H, tl)} (B, H, Tl)")  # fmt: skip
    ring = trace.ring
    if ring.bad_pass is not None:
        hop, passed, held = ring.bad_pass
        what = ("its own block again" if passed == r else f"the block of rank {passed}"
                if passed is not None else "a tensor that is no rank's block")  # fmt: skip
        return (f"at hop {hop} rank {r} passed on {what}, but the block in hand was rank {held}'s: "
                "pass on the block you hold, the one the last hop brought; the next rank has not "
                "seen it yet")  # fmt: skip
    if ring.hops < n - 1:
        times = f"{ring.hops} time{'s' * (ring.hops != 1)}"
        return (f"rank {r} passed blocks on {times}; in a ring of {n} every rank makes "
                f"{n - 1} hops whatever it computes, or the next rank waits for a block that never "
                "comes: a block a rank skips is still passed on")  # fmt: skip
    if ring.hops > n - 1:
        return (f"rank {r} passed blocks on {ring.hops} times where {n - 1} hops bring it every "
                "block: the last hop only brings back a block already used, and costs a transfer")  # fmt: skip
    if not trace.attended:
        return ("your loop computed no block with cp.block_attention: compute each block's "
                "partial attention with it (the check counts the blocks computed through it)")  # fmt: skip
    if any(a["owner"] is None for a in trace.attended):
        return (f"rank {r} computed attention over keys that are none of the ranks' blocks: "
                "attend the block in hand, as pass_on returned it")  # fmt: skip
    owners = [a["owner"] for a in trace.attended]
    twice = next((j for j in owners if owners.count(j) > 1), None)
    if twice is not None:
        return (f"a block merged twice: rank {r} computed the block of rank {twice} "
                f"{owners.count(twice)} times. The block in hand changes at every hop: hold the "
                "one pass_on returns")  # fmt: skip
    late = next((a for a in trace.attended if a["hop"] != (r - a["owner"]) % n), None)
    if late is not None:
        whose = "its own block" if late["owner"] == r else f"the block of rank {late['owner']}"
        return (f"rank {r} computed {whose} after {late['hop']} hops, "
                f"when it had already passed it on: a rank holds one block at a time and attends "
                "it before the next hop (holding them all would hold the whole sequence's K and "
                "V, what context parallelism avoids)")  # fmt: skip
    bad_scale = next((a["scale"] for a in trace.attended
                      if not math.isclose(float(a["scale"]), 1 / math.sqrt(D))), None)  # fmt: skip
    if bad_scale is not None:
        return (f"the scores were scaled by {float(bad_scale):.4g}; attention scales them by "
                f"1/√D, D the head size (q's last dimension, {D} here)")  # fmt: skip
    did = {j: "skip" for j in range(n)} | {a["owner"]: a["mask"] for a in trace.attended}
    said = _decisions_message(r, n, causal, did)
    rows = slice(r * tl, (r + 1) * tl)
    err = float((out - case["out"][..., rows, :]).abs().max())
    lse_err = float((lse - case["lse"][..., rows]).abs().max())
    if said is not None:
        return (f"rank {r}'s output differs in rows it owns by {err:.1e}: " if err > RING_TOL
                else "") + said  # fmt: skip
    computed = len(trace.attended)
    if not (err <= RING_TOL and lse_err <= RING_TOL):  # the right blocks: why is the sum wrong?
        chain = _merge_chain(trace) or _returned_state(trace, out, lse)
        if chain is not None:
            return chain
        if trace.merges and len(trace.merges) < computed - 1:
            return (f"rank {r} computed {computed} blocks but merged {len(trace.merges)} times: "
                    "every block after the first is folded into the running state")  # fmt: skip
        if err <= RING_TOL:
            return (f"rank {r}'s output is right but its log-sum-exp is off by {lse_err:.1e}: "
                    "return the running log-sum-exp after the last merge (the backward "
                    "recomputes each block's probabilities from it)")  # fmt: skip
        if not trace.merges and computed > 1:
            return (f"rank {r}'s output differs from SDPA's in rows it owns by {err:.1e}; you "
                    "combined the blocks without cp.merge: fold each block into the running "
                    "(output, log-sum-exp) with it")  # fmt: skip
        arrival = [(r - s) % n for s in range(n)]
        order = [trace.attended[i]["owner"] for i in _merge_order(trace)]
        lead = ("blocks merged in the wrong order changed nothing (merging is order-free): the "
                "difference is elsewhere. " if order != [j for j in arrival if j in order]
                else "")  # fmt: skip
        return (f"{lead}rank {r}'s output differs from SDPA over the whole sequence by {err:.1e} "
                "in rows it owns, though it computed the right blocks with the right masks: "
                "compare what your loop returns with the (output, log-sum-exp) its last merge "
                "returned")  # fmt: skip
    needed = sum(j <= r for j in range(n)) if causal else n
    if computed > needed:
        hidden = sorted(a["owner"] for a in trace.attended if did[a["owner"]] == "hidden")
        return (f"did not skip: rank {r}'s output is correct but it computes {computed} blocks "
                f"where {needed} suffice (and merges {len(trace.merges)} times where "
                f"{needed - 1} suffice): the block{'s' * (len(hidden) > 1)} of rank"
                f"{'s' * (len(hidden) > 1)} {', '.join(map(str, hidden))} "
                f"{'were' if len(hidden) > 1 else 'was'} computed with every key masked. A block "
                "the causal mask hides entirely need not be computed at all; it is still passed "
                "on")  # fmt: skip
    return None


def _merge_order(trace: _Trace) -> list[int]:
    """Indices (into ``trace.attended``) of the blocks in the order the merges took them in."""
    parts = [a["result"] for a in trace.attended]
    order: list[int] = []
    for m in trace.merges:
        args = m["args"]
        for pair in ((args["out_a"], args["lse_a"]), (args["out_b"], args["lse_b"])):
            i = _find(pair, [parts[k] for k in range(len(parts)) if k not in order])
            if i is not None:
                order.append([k for k in range(len(parts)) if k not in order][i])
    return order


def check_ring_loop(fn: Any) -> str:
    """Every rank of each of ``RING_CASES``, in the kernel: the first mistake, named."""
    require_callable(fn, "ring_loop(q, k, v, ring, *, causal)")
    for n, tl, causal in RING_CASES:
        case = _ring_case(n, tl, causal)
        for r in reversed(range(n)):  # the last rank first: it handles the most blocks
            ring = CheckingRing(r, case["ks"], case["vs"])
            with _traced(_Trace(case, ring), fn) as trace:
                got = call(fn, case["qs"][r].clone(), case["ks"][r].clone(),
                           case["vs"][r].clone(), ring, causal=causal)  # fmt: skip
            said = ring_diagnosis(case, r, trace, got)
            if said is not None:
                raise ExerciseFailed(f"a ring of {n} rank{'s' * (n > 1)}, {tl} positions each, "
                                     f"{'causal' if causal else 'not causal'}: {said}")  # fmt: skip
    return ("every rank's rows equal SDPA over the whole sequence (and its log-sum-exp), on "
            "simulated rings of 1 to 4 ranks, causal and not, with n − 1 hops, each block in hand "
            "computed at most once and the hidden ones skipped")  # fmt: skip


@exercise(
    "03c.ring_loop",
    "One rank's ring-attention loop, the causal block skip included",
    hints=(
        "A rank holds one K/V block at a time. Think of n steps: at each, work out whose block "
        "is in hand, decide whether this rank's queries see any of its keys, fold it into the "
        "running (output, log-sum-exp), and pass it on.",
        "pass_on sends to rank + 1, so what arrives comes from rank − 1: a rank sees its own "
        "block first, then its predecessor's, and so on round the ring. With contiguous shards "
        "the owner's rank against this rank's tells whether a block's keys lie before, "
        "alongside or after this rank's queries.",
        "Under a causal mask a block whose keys all come after this rank's queries adds "
        "nothing: do not compute it (the check counts the blocks you compute), but pass it on "
        "all the same. Only the rank's own block needs a mask inside it; cp.merge returns the "
        "new running output and log-sum-exp.",
        "recipe: for each of the ring's steps, work out whose block is in hand from this "
        "rank and the hops made so far, counting backwards round the ring; if the mask is "
        "causal and that owner comes after this rank, compute nothing; otherwise compute the "
        "block's partial attention, scores scaled by one over the square root of the head "
        "size, with the lower-triangular mask for the rank's own block and no mask for the "
        "others; the first block computed is the running state, and each later one is merged "
        "into it with labkit's merge, keeping both things it returns; after every step but "
        "the last, pass the block in hand on and hold the one that comes back; return the "
        "running output and log-sum-exp.",
    ),
)
def _verify_ring_loop(answer: Any) -> str:
    said = check_ring_loop(answer)
    return f"{said}; {rank_checks.run_in_workers('03c.ring_loop', [answer], nproc=NPROC)}"


RING_SHAPE = (1, 2, 4, 8)  # (B, H, Tl, D) of each rank's shard in the ranks' check


def _rank_ring_loop(ctx: Any, fn: Callable[..., Any]) -> str:
    """The learner's loop on labkit's real ring (isend/irecv), against SDPA on the whole sequence."""
    import torch.nn.functional as F

    from labkit.parallel import context

    n, r = ctx.world_size, ctx.rank
    B, H, tl, D = RING_SHAPE
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n * tl, D, generator=g) for _ in range(3))
    rows = slice(r * tl, (r + 1) * tl)
    for causal in (True, False):
        counter = context.P2PCounter()
        ring = context.P2PRing(counter=counter)
        got = call(fn, q[..., rows, :].clone(), k[..., rows, :].clone(), v[..., rows, :].clone(),
                   ring, causal=causal)  # fmt: skip
        out = got[0] if isinstance(got, tuple) and got else got
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)[..., rows, :]
        if not isinstance(out, torch.Tensor) or out.shape != want.shape:
            raise ExerciseFailed(f"rank {r}'s loop returned {short_repr(got)} on the real ring")
        err = float((out - want).abs().max())
        hops = counter.calls["forward"]
        if not err <= RING_TOL or hops != n - 1:
            raise ExerciseFailed(
                f"on the real ring ({'causal' if causal else 'not causal'}) rank {r}'s rows "
                f"differ from SDPA's by {err:.1e} after {hops} hops ({n - 1} expected)"
            )
    return (f"and it ran on a real {n}-rank ring over gloo (isend/irecv): every rank's rows equal "
            f"SDPA's, causal and not, with {n - 1} hop{'s' * (n > 2)} each" if r == 0 else "ok")  # fmt: skip


RANK_CHECKS: dict[str, Callable[..., str]] = {"03c.ring_loop": _rank_ring_loop}
"""This exercise's rank-side check, for :func:`labkit.course.exercises.sequences_experts.rank_check`."""
