"""The check of notebook 02's ZeRO-1 exercise (``02.zero1_step``), run on every rank of a check
job: ``shard_bounds`` against ZeRO-1's rules on many (numel, world_size), then two AdamW steps
of the learner's ``ZeRO1Optimizer`` against torch's AdamW on the averaged gradient.

Registered with :func:`labkit.course.exercises.exercise` when imported
(``labkit.course.exercises.data_parallel`` imports it).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from labkit.course.exercises import (
    ExerciseFailed,
    call,
    exercise,
    short_repr,
)
from labkit.course.exercises.data_parallel.check_tools import (
    agree_on_problem,
    default_group,
    require_class,
    tensors_close,
    try_learner_code,
)
from labkit.course.exercises.data_parallel.reference import (
    ATOL,
    LR,
    RTOL,
    STEPS,
    WEIGHT_DECAY,
    ZeRO1Optimizer,
    check_model,
    rank_batches,
    trainable_params,
)
from labkit.course.exercises.data_parallel.spy import DistSpy

# --------------------------------------------------------------------------- 02.zero1_step

# (numel, world sizes) that expose the usual mistakes: exact multiples, remainders of 1 and
# n-1, fewer elements than ranks, and a size like a real parameter group.
SHARD_CASES: tuple[tuple[int, tuple[int, ...]], ...] = (
    (8, (1, 2, 4)),
    (10, (3, 4)),
    (7, (2, 8)),
    (1, (1, 2)),
    (1001, (2, 4, 8)),
    (12_345, (3, 7)),
)


def _check_bounds(fn: Callable[..., Any], numel: int, n: int) -> list[tuple[int, int]]:
    """The bounds ``fn`` gives every rank for one (numel, n), checked against ZeRO-1's rules."""
    bounds = []
    for r in range(n):
        got = call(fn, numel, r, n)
        ok = (
            isinstance(got, (tuple, list))
            and len(got) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in got)
        )
        if not ok:
            raise ExerciseFailed(
                f"shard_bounds({numel}, {r}, {n}) returned {short_repr(got)}; return a tuple of "
                "two ints (start, stop): the slice [start, stop) of the flat buffer"
            )
        bounds.append((int(got[0]), int(got[1])))
    sizes = [stop - start for start, stop in bounds]
    where = f"for numel={numel}, world_size={n} your shards are {bounds}"
    if bounds[0][0] != 0 or any(bounds[r][0] != bounds[r - 1][1] for r in range(1, n)):
        raise ExerciseFailed(
            f"{where}: they must tile the buffer from 0 with no gap or overlap "
            "(rank r's start is rank r-1's stop)"
        )
    if len(set(sizes)) != 1:
        raise ExerciseFailed(
            f"{where}: the sizes {sizes} differ. reduce_scatter and all_gather move equal "
            "pieces, so every rank owns the same number of elements: pad the buffer with "
            "zeros up to a multiple of world_size instead of giving one rank the remainder"
        )
    padded = n * sizes[0]
    if padded < numel:
        lost = f"element {padded}" if numel - padded == 1 else f"elements {padded}..{numel - 1}"
        raise ExerciseFailed(
            f"{where}: {lost} belong(s) to no rank, so no rank would update it: the shards "
            "are too small to cover numel (round up)"
        )
    if padded - numel >= n:
        raise ExerciseFailed(
            f"{where}: {padded - numel} padding elements, but fewer than world_size={n} are "
            "ever needed: the shards are larger than they must be"
        )
    return bounds


def _flat(tensors: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor], size: int) -> torch.Tensor:
    """The tensors flattened in order into a zero-padded buffer of ``size`` elements."""
    out = torch.zeros(size, dtype=like[0].dtype, device=like[0].device)
    offset = 0
    for t, ref in zip(tensors, like, strict=True):
        if t is not None:
            out[offset : offset + ref.numel()] = t.reshape(-1)
        offset += ref.numel()
    return out


@dataclass
class _Update:
    """What the inner optimizer held when its step() began (a step pre-hook records it)."""

    numel: int
    param: torch.Tensor
    grad: torch.Tensor | None
    state_numel: int = 0


@exercise(
    "02.zero1_step",
    "ZeRO-1: reduce-scatter the gradients, update this rank's shard, all-gather the weights",
    hints=(
        "under ZeRO-1 every rank keeps the whole model but the optimizer state of one shard of "
        "the flat parameters only: a step needs the averaged gradient of that shard (not of "
        "everything), an update of that shard, and then everyone's updated shards so that all "
        "ranks hold the same new weights",
        "shard_bounds: every shard has the same length (reduce-scatter and all-gather move "
        "equal pieces), the smallest whole number that covers numel, so the flat buffer is "
        "zero-padded at the end",
        "step: dist.reduce_scatter_single(out, inp) leaves in out (one shard) the sum over "
        "ranks of that piece of inp (the whole padded buffer); dist.all_gather_single(out, "
        "inp) is the reverse. Order matters: gather what was updated. self.flat is a copy of "
        "the parameters, not a view of them: what lands in it must be copied back",
        "recipe: in shard_bounds, the shard length is numel divided by world_size and rounded "
        "up, in whole-number arithmetic (no floats); rank r's slice starts r shard lengths in "
        "and stops one shard length later. In step: make a buffer of zeros shaped like the "
        "flat buffer the class keeps in flat, and copy every trainable parameter's gradient, "
        "flattened, into that parameter's slice of it, in parameter order (zeros stand in for "
        "a gradient that is None: here every trainable parameter gets one; "
        "labkit.parallel.zero1 also skips such a parameter's update, as torch's optimizers "
        "skip a parameter whose gradient is None); reduce-scatter that buffer into a new "
        "tensor one shard long; divide it by world_size and make the quotient the gradient of "
        "the shard; step the inner optimizer; all-gather the updated shard into the flat "
        "buffer; last, copy each parameter's slice of the flat buffer back into the "
        "parameter, in its shape",
    ),
    reference=ZeRO1Optimizer,
)
def _verify_zero1_step(cls: Any) -> str:
    cls = require_class(cls, "ZeRO1Optimizer(params, make_optimizer, rank, world_size)")
    bounds = getattr(cls, "shard_bounds", None)
    if not callable(bounds) and not inspect.isclass(cls):
        with contextlib.suppress(ExerciseFailed):
            call(cls)  # a stub that raises NotImplementedError is "not done yet"
        raise ExerciseFailed(f"expected the class ZeRO1Optimizer, got {short_repr(cls)}")
    if not callable(bounds):
        raise ExerciseFailed(f"{getattr(cls, '__name__', cls)} has no shard_bounds(numel, rank, "
                             "world_size): keep the @staticmethod the cell starts with")  # fmt: skip
    # 1. The rules, for every rank of every case: the same verdict on every rank, so a wrong
    #    answer stops all ranks here, before any collective.
    for numel, sizes in SHARD_CASES:
        for k in sizes:
            _check_bounds(bounds, numel, k)

    rank, n, device = default_group()
    model = check_model(7, device)  # the same weights on every rank: ZeRO-1 does not broadcast
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(
        [p for _, p in trainable_params(reference)], lr=LR, weight_decay=WEIGHT_DECAY
    )
    names = [name for name, _ in trainable_params(model)]
    params = [p for _, p in trainable_params(model)]
    numel = sum(p.numel() for p in params)
    start, stop = bounds(numel, rank, n)
    size = n * (stop - start)

    updates: list[_Update] = []
    spy = DistSpy()
    made: list[torch.optim.Optimizer] = []

    def make_optimizer(shard_params: Any) -> torch.optim.Optimizer:
        opt = torch.optim.AdamW(shard_params, lr=LR, weight_decay=WEIGHT_DECAY)

        def before_step(o: torch.optim.Optimizer, *_: Any) -> None:
            ps = [p for g in o.param_groups for p in g["params"]]
            spy.events.append("update")
            updates.append(_Update(
                numel=sum(p.numel() for p in ps),
                param=torch.cat([p.detach().reshape(-1) for p in ps]).clone(),
                grad=None if any(p.grad is None for p in ps)
                else torch.cat([p.grad.detach().reshape(-1) for p in ps]).clone(),
            ))  # fmt: skip

        def after_step(o: torch.optim.Optimizer, *_: Any) -> None:
            updates[-1].state_numel = sum(
                s["exp_avg"].numel() for s in o.state.values() if "exp_avg" in s
            )

        opt.register_step_pre_hook(before_step)
        opt.register_step_post_hook(after_step)
        made.append(opt)
        return opt

    signature = "ZeRO1Optimizer(model.parameters(), make_optimizer, rank, world_size)"
    with spy.active():
        zero, problem = try_learner_code(lambda: call(cls, model.parameters(), make_optimizer, rank, n))
    agree_on_problem(problem)
    if len(made) != 1:
        agree_on_problem(f"{signature} called make_optimizer {len(made)} times; ZeRO-1 keeps one "
               "optimizer, for the shard this rank updates")  # fmt: skip
    held = sum(p.numel() for g in made[0].param_groups for p in g["params"])
    if held != stop - start:
        agree_on_problem(f"on rank {rank} of {n} the optimizer was given {held} elements, but the rank "
               f"owns a shard of {stop - start} of the {numel} (shard_bounds({numel}, {rank}, "
               f"{n}) = ({start}, {stop})), so AdamW would keep state for more than "
               "1/world_size of the model")  # fmt: skip

    batches = rank_batches(rank, n, device)
    for step, (x, y) in enumerate(batches, start=1):
        before = _flat([p.detach() for p in params], params, size)
        # the reference: torch's AdamW on every parameter, with the averaged gradient
        ref_params = [p for _, p in trainable_params(reference)]
        ref_opt.zero_grad(set_to_none=True)
        reference(x, y).backward()
        for p in ref_params:
            tdist.all_reduce(p.grad)
            p.grad /= n
        averaged = _flat([p.grad for p in ref_params], ref_params, size)
        ref_opt.step()
        want = _flat([p.detach() for p in ref_params], ref_params, size)

        zero_grad = getattr(zero, "zero_grad", None)
        if callable(zero_grad):
            zero_grad()
        else:
            for p in params:
                p.grad = None
        model(x, y).backward()
        mine = _flat([p.grad for p in params], params, size)
        spy.calls, spy.events = [], []
        updates.clear()
        with spy.active():
            spy.phase = "step"
            _, problem = try_learner_code(lambda: call(zero.step))
        spy.phase = "after"
        spy.wait_all()
        agree_on_problem(None if problem is None else f"in step {step}: {problem}")
        agree_on_problem(_zero1_problem(step, spy, updates, averaged, mine, before, want, params, names,
                              (start, stop), rank, n, numel))  # fmt: skip
    shard = stop - start
    return (
        f"shard_bounds tiles a zero-padded buffer in equal shards in "
        f"{sum(len(s) for _, s in SHARD_CASES)} (numel, world_size) cases; on rank {rank} of "
        f"{n} AdamW keeps state for {shard} of {numel} elements (padding {size - numel}), and "
        f"in each of {STEPS} steps reduce-scatter → update → all-gather gives every parameter "
        "exactly what torch's AdamW gives it on the averaged gradient"
    )


def _zero1_problem(
    step: int,
    spy: DistSpy,
    updates: list[_Update],
    averaged: torch.Tensor,
    mine: torch.Tensor,
    before: torch.Tensor,
    want_flat: torch.Tensor,
    params: list[nn.Parameter],
    names: list[str],
    bounds: tuple[int, int],
    rank: int,
    n: int,
    numel: int,
) -> str | None:
    """The first thing wrong with one ZeRO-1 step on this rank, or None."""
    start, stop = bounds
    where = f"in step {step} on rank {rank} of {n}"
    events = [e for e in spy.events if e != "broadcast"]
    if "update" not in events:
        return f"{where}: step() never called self.inner.step(): the shard was not updated"
    if events.count("update") > 1:
        return f"{where}: step() called self.inner.step() {events.count('update')} times"
    first_update = events.index("update")
    if "all_reduce" in events[:first_update] and "reduce_scatter" not in events:
        return (f"{where}: the gradients were all-reduced, so every rank received the sum of "
                "all of them, though it updates only its own shard: twice the bytes ZeRO-1 "
                "needs to send")  # fmt: skip
    if "reduce_scatter" not in events[:first_update]:
        return (f"{where}: no reduce-scatter before the update, so the shard was updated "
                "with a gradient that was not summed over the ranks")  # fmt: skip
    gathers = [i for i, e in enumerate(events) if e == "all_gather"]
    if gathers and all(i < first_update for i in gathers):
        return (f"{where}: the all-gather ran before the update, so every rank received the "
                "other shards' old weights and the new ones never left their rank")  # fmt: skip
    if not gathers:
        return (f"{where}: no all-gather after the update, so on every rank only its own "
                "shard of the weights changed")  # fmt: skip
    up = updates[0]
    piece = slice(start, stop)
    if up.grad is None:
        return f"{where}: self.shard.grad was None when the optimizer stepped: set it first"
    if not tensors_close(up.param, before[piece]):
        return (f"{where}: the parameter the optimizer updated is not this rank's slice "
                f"[{start}, {stop}) of the flat parameters")  # fmt: skip
    g, w = up.grad, averaged[piece]
    if not tensors_close(g, w):
        if tensors_close(g, n * w):
            why = (f"it is {n}x the average: reduce-scatter sums over the {n} ranks, divide by "
                   "world_size (AdamW hides most of it, weight decay and eps do not)")  # fmt: skip
        elif tensors_close(g, mine[piece]):
            why = "it is this rank's own gradient: it was never reduced over the ranks"
        elif tensors_close(g, mine[piece] / n):
            why = "it is this rank's own gradient divided by world_size: the sum never happened"
        else:
            why = f"it differs by up to {(g - w).abs().max().item():.3g}"
        return (f"{where}: the gradient the optimizer saw for the shard [{start}, {stop}) is not "
                f"the averaged gradient of those elements: {why}")  # fmt: skip
    if up.state_numel and up.state_numel != stop - start:
        return (f"{where}: AdamW keeps state for {up.state_numel} elements; ZeRO-1 keeps it for "
                f"this rank's {stop - start}")  # fmt: skip
    got = _flat([p.detach() for p in params], params, len(want_flat))
    bad = (got[:numel] - want_flat[:numel]).abs() > ATOL + RTOL * want_flat[:numel].abs()
    if bad.any():
        first = int(bad.nonzero()[0])
        offset, name = 0, names[0]
        for p, nm in zip(params, names, strict=True):
            if first < offset + p.numel():
                name = nm
                break
            offset += p.numel()
        stale = torch.equal(got[:numel][bad], before[:numel][bad])
        theirs = not bool(bad[start:stop].any()) if start < numel else True
        if stale and theirs:
            why = ("they still hold the old weights, and they belong to other ranks' shards: "
                   "the updated shards never reached the parameters of this rank")  # fmt: skip
        elif stale:
            why = ("they were never changed, this rank's own shard included: the gathered "
                   "weights never reached the parameters (self.flat is a copy, not a view "
                   "of them)")  # fmt: skip
        else:
            why = (f"the first differs by {(got[first] - want_flat[first]).abs().item():.3g}; "
                   "do the parameters get their own slices of self.flat?")  # fmt: skip
        return (f"{where}: {int(bad.sum())} of {numel} weights (the first in {name}) differ "
                f"from what torch's AdamW computes: {why}")  # fmt: skip
    return None


