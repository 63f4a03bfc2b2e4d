"""The checks of notebook 02's two DDP exercises, run on every rank of a check job:
``02.allreduce_grads`` (``OverlapDDP``: one asynchronous all-reduce per gradient) and
``02.bucketed_ddp`` (``BucketedDDP``: one per bucket). Both train :class:`CheckLM` for
``STEPS`` steps with the learner's class and with what DDP computes, and compare.

Registered with :func:`labkit.course.exercises.exercise` when imported
(``labkit.course.exercises.data_parallel`` imports it).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from labkit.course.exercises import (
    call,
    exercise,
)
from labkit.course.exercises.data_parallel.check_tools import (
    agree_on_problem,
    default_group,
    explain_missing_key,
    require_class,
    tensors_close,
    try_learner_code,
    why_gradient_differs,
)
from labkit.course.exercises.data_parallel.reference import (
    BUCKET_CAP_MB,
    FROZEN,
    STEPS,
    BucketedDDP,
    OverlapDDP,
    check_model,
    rank_batches,
    reference_ddp,
    sgd_step,
    trainable_params,
)
from labkit.course.exercises.data_parallel.spy import DistSpy

# --------------------------------------------------------------------------- DDP checks


@dataclass
class _DDPRun:
    """What one check of a DDP class saw: its spy per step and its model."""

    model: nn.Module
    steps: list[DistSpy] = field(default_factory=list)
    init: DistSpy | None = None


def _local_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """This rank's own gradients for one batch (of a copy: the model is left alone)."""
    replica = copy.deepcopy(model)
    replica(x, y).backward()
    return {n: p.grad.detach().clone() for n, p in trainable_params(replica)}


def _ranks_disagree(model: nn.Module) -> str | None:
    """Name the first parameter or buffer whose values differ across ranks (every rank gets
    the same answer: it is computed with all-reduces of the values' max and min)."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        hi, lo = t.detach().clone(), t.detach().clone()
        tdist.all_reduce(hi, op=tdist.ReduceOp.MAX)
        tdist.all_reduce(lo, op=tdist.ReduceOp.MIN)
        if not torch.equal(hi, lo):
            return name
    return None


def _run_ddp_class(
    cls: Callable[..., Any],
    args: tuple[Any, ...],
    signature: str,
    explain: Callable[[nn.Module], Callable[[Exception], str | None]] | None = None,
) -> tuple[_DDPRun, list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]],
           list[dict[str, torch.Tensor]], nn.Module]:  # fmt: skip
    """Train CheckLM for STEPS steps with the learner's DDP class and with what DDP computes.

    Every rank seeds its model differently (as separately initialised processes would): both
    must broadcast rank 0's weights. Returns what the learner's run saw, its averaged
    gradients per step, DDP's (:func:`reference_ddp`), this rank's local ones, and the
    reference's final model. ``explain(model)``: an explainer of the learner's exceptions
    during backward and ``finish_gradient_sync()`` (see :func:`try_learner_code`).
    Between phases the ranks agree (:func:`agree_on_problem`), so a mistake stops all of them together.
    """
    rank, n, device = default_group()
    model = check_model(100 + rank, device)
    original = copy.deepcopy(model)  # for the reference, which runs after the learner's class
    batches = rank_batches(rank, n, device)
    params = [p for _, p in trainable_params(model)]

    run = _DDPRun(model)
    spy = DistSpy(params)  # registered first: counts a gradient before the learner's hook sees it
    run.init = spy
    with spy.active():
        ddp, problem = try_learner_code(lambda: call(cls, model, n, *args))
    agree_on_problem(problem)
    disagree = _ranks_disagree(model)
    if disagree is not None:
        agree_on_problem(f"after {signature} the ranks hold different values of {disagree}: each rank "
               "initialised its own model (a different seed per rank), and nothing made them "
               "equal, so the ranks would train different models. torch DDP starts every rank "
               "from rank 0's parameters and buffers")  # fmt: skip
    finish = getattr(ddp, "finish_gradient_sync", None)
    if not callable(finish):
        agree_on_problem(f"{type(ddp).__name__} has no method finish_gradient_sync(): the training loop "
               "calls it after loss.backward() and before optimizer.step()")  # fmt: skip
    want, reference = reference_ddp(original, batches, args[0] if args else None)

    why = explain(model) if explain is not None else None
    got, local = [], []
    for step, (x, y) in enumerate(batches):
        local.append(_local_grads(model, x, y))
        model.zero_grad(set_to_none=True)
        spy.calls, spy.events, spy.ready, spy.stale_waits = [], [], 0, 0
        problem = None
        with spy.active():
            spy.phase = "backward"
            _, problem = try_learner_code(lambda: model(x, y).backward(), why)  # noqa: B023
            if problem is None:
                spy.phase = "finish"
                _, problem = try_learner_code(lambda: call(finish), why)
        spy.phase = "after"
        spy.wait_all()
        run.steps.append(copy.copy(spy))
        if problem is not None:
            problem = f"in step {step + 1}: {problem}"
        agree_on_problem(problem)
        missing = [name for name, p in trainable_params(model) if p.grad is None]
        if missing:
            agree_on_problem(f"after finish_gradient_sync() in step {step + 1}, {missing[0]}.grad is None "
                   f"on rank {tdist.get_rank()}: leave the averaged gradient in p.grad")  # fmt: skip
        got.append({name: p.grad.detach().clone() for name, p in trainable_params(model)})
        sgd_step(model)
    spy.remove_hooks()
    return run, got, want, local, reference


def _compare_steps(
    got: list[dict[str, torch.Tensor]],
    want: list[dict[str, torch.Tensor]],
    local: list[dict[str, torch.Tensor]],
    extra: Callable[[list[str]], str | None] | None = None,
) -> str | None:
    """The first gradient that differs from DDP's, and why; None when all agree.
    ``extra(names of still-local gradients)`` may explain a pattern of them (all of them
    too: a class that reduced everything and wrote nothing back)."""
    rank, n = tdist.get_rank(), tdist.get_world_size()
    for step, (g, w, loc) in enumerate(zip(got, want, local, strict=True)):
        unreduced = [k for k in w if not tensors_close(g[k], w[k]) and tensors_close(g[k], loc[k])]
        if unreduced and extra is not None:
            message = extra(unreduced)
            if message is not None:
                return message
        for name, target in w.items():
            if not tensors_close(g[name], target):
                return (f"in step {step + 1}, {name}.grad on rank {rank} of {n} is not "
                        f"the averaged gradient DDP computes: "
                        f"{why_gradient_differs(g[name], target, loc[name], n, step + 1)}")  # fmt: skip
    return None


def _frozen_untouched(model: nn.Module) -> str | None:
    p = dict(model.named_parameters())[FROZEN]
    if p.grad is not None:
        return (f"the frozen parameter {FROZEN} (requires_grad=False) now has a .grad: "
                "leave parameters that do not train alone")  # fmt: skip
    return None


# --------------------------------------------------------------------------- 02.allreduce_grads


@exercise(
    "02.allreduce_grads",
    "DDP from scratch: all-reduce each gradient asynchronously while backward runs",
    hints=(
        "the step needs the mean of the ranks' gradients; the all-reduce of one gradient can "
        "run while backward still computes the earlier layers', if it starts the moment that "
        "gradient is final and nothing waits for it until backward is over",
        "p.register_post_accumulate_grad_hook(fn) calls fn(p) once p.grad is final; "
        "dist.all_reduce(t, async_op=True) starts the sum over ranks and returns a handle at "
        "once; handle.wait() blocks until it is done. A blocking all-reduce, or a wait, inside "
        "the hook holds backward up: keep the handles until finish_gradient_sync()",
        "three traps: parameters with requires_grad=False get no gradient (and a hook on them "
        "is an error); ranks seeded differently train different models unless they start "
        "from rank 0's parameters and buffers (a dist.broadcast of each one's data, with "
        "rank 0 as the source); and whatever list of handles a step fills must be empty when "
        "the next step begins",
        "recipe: in __init__, broadcast the data of every parameter and every buffer from rank "
        "0, start an empty list of handles, and register on each trainable parameter (skip the "
        "frozen ones) a hook that starts the all-reduce of that parameter's gradient without "
        "waiting for it and appends the parameter together with the handle the call returns. "
        "In finish_gradient_sync, go through the list: wait on each handle, then divide that "
        "parameter's gradient by world_size, since the all-reduce left the sum over the ranks, "
        "not their mean; last, empty the list, so that the next step starts a new one",
    ),
    reference=OverlapDDP,
)
def _verify_overlap_ddp(cls: Any) -> str:
    cls = require_class(cls, "OverlapDDP(model, world_size)")
    rank, n, _ = default_group()
    run, got, want, local, _ = _run_ddp_class(cls, (), "OverlapDDP(model, world_size)")
    n_params = len(want[0])
    for step, spy in enumerate(run.steps, start=1):
        mine = [c for c in spy.calls if c.kind == "all_reduce"]
        problem = None
        after = [c for c in mine if c.phase != "backward"]
        sync = [c for c in mine if c.phase == "backward" and not c.async_op]
        early = [c for c in mine if c.waited == "backward"]
        unwaited = [c for c in mine if c.async_op and c.waited not in ("backward", "finish")]
        if not mine:
            problem = ("no dist.all_reduce was called during backward or in "
                       "finish_gradient_sync(): each gradient must be all-reduced (call it as "
                       "dist.all_reduce, with import torch.distributed as dist)")  # fmt: skip
        elif len(after) == len(mine):
            problem = (f"all {len(mine)} all-reduces started in finish_gradient_sync(), after "
                       "backward had ended, so none of them ran while backward was computing "
                       "(that is naive data parallelism). What could start a gradient's "
                       "all-reduce while backward is still running?")  # fmt: skip
        elif sync:
            problem = (f"{len(sync)} all-reduces ran with async_op=False inside backward: each "
                       "one held backward up until its bytes had moved, so nothing "
                       "overlapped")  # fmt: skip
        elif early:
            problem = (f"{len(early)} handles were waited on inside backward (right after "
                       "their all-reduce started): backward stopped there until the bytes had "
                       "moved, so nothing overlapped")  # fmt: skip
        elif unwaited:
            problem = (f"{len(unwaited)} all-reduce handles were never waited on before "
                       "finish_gradient_sync() returned: the optimizer would read gradients the "
                       "all-reduce may still be writing")  # fmt: skip
        elif spy.stale_waits:
            problem = (f"finish_gradient_sync() waited on {spy.stale_waits} handles that step "
                       f"{step - 1} started: they were still in the list, so their gradients "
                       "were averaged again (on more than one rank, divided by world_size "
                       "twice)")  # fmt: skip
        elif len(mine) > n_params:
            problem = (f"{len(mine)} all-reduces for {n_params} trainable parameters: some "
                       "gradient went out twice (a hook registered twice, or a tied weight "
                       "listed twice?)")  # fmt: skip
        if problem:
            agree_on_problem(f"in step {step}: {problem}")
    agree_on_problem(_frozen_untouched(run.model) or _compare_steps(got, want, local))
    calls = [c for c in run.steps[-1].calls if c.kind == "all_reduce"]
    before_end = sum(1 for c in calls if c.ready < n_params)
    return (
        f"on rank {rank} of {n} your DDP broadcast rank 0's weights and, in each of {STEPS} "
        f"SGD steps, all-reduced {len(calls)} gradients asynchronously from their hooks "
        f"({before_end} of them while backward still had gradients to compute) and waited "
        "before the step: every gradient equals DDP's (frozen wpe skipped, tied "
        "wte/head once)"
    )


# --------------------------------------------------------------------------- 02.bucketed_ddp


def _greedy_bucket_bytes(params: Any, cap: float) -> list[int]:
    """Bytes of each bucket when ``params`` are grouped in the order given, a new bucket
    started whenever the next one would take the open bucket past ``cap`` bytes."""
    sizes: list[int] = []
    size = count = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if count and size + nbytes > cap:
            sizes.append(size)
            size = count = 0
        size += nbytes
        count += 1
    if count:
        sizes.append(size)
    return sizes



@exercise(
    "02.bucketed_ddp",
    "Bucketed DDP: one asynchronous all-reduce per bucket of gradients, started when it fills",
    hints=(
        "one message per parameter pays the latency α once per parameter; grouping gradients "
        "into a few flat buckets pays it once per bucket, and a bucket can still leave while "
        "backward computes the layers before it, if the buckets follow the order in which "
        "backward makes the gradients (the reverse of model.parameters())",
        "walk the trainable parameters in reverse, start a new bucket when the next one would "
        "take it past the cap (bucket_cap_mb · 2**20 bytes); give each bucket a flat buffer "
        "and each parameter an offset in it. The last bucket is usually smaller than the cap, "
        "and it must be made and sent too",
        "a hook copies p.grad into its slot and counts the bucket's ready gradients; when all "
        "of them are in, it starts an asynchronous all-reduce of the bucket's buffer (as "
        "exercise 1 did for one gradient) and keeps the handle. The all-reduce sums the "
        "buffer, not p.grad: after waiting, and dividing by world_size, the slices must go "
        "back into each p.grad",
        "recipe: in __init__, broadcast parameters and buffers from rank 0; walk the trainable "
        "parameters in reverse and group them greedily, opening a new group when the next "
        "parameter's bytes would take the open one past the cap (a parameter larger than the "
        "cap still gets a group of its own), and after the loop keep the open group too, "
        "however small. For each bucket make a flat buffer of zeros with as many elements as "
        "its parameters hold together (their dtype, their device), note each parameter's "
        "offset in it, and keep a count of ready gradients and a place for the handle. Hook "
        "each trainable parameter: copy its gradient, flattened, into its slice of the "
        "bucket's buffer (from its offset, as many elements as it has), add one to the count, "
        "and when the count reaches the number of parameters in the bucket, start the "
        "buffer's all-reduce without waiting and keep the handle. In finish_gradient_sync, "
        "for each bucket in turn: wait on its handle, divide the buffer by world_size, copy "
        "each parameter's slice back into its gradient, in the parameter's shape, then set "
        "the count back to zero and forget the handle",
    ),
    reference=BucketedDDP,
)
def _verify_bucketed_ddp(cls: Any) -> str:
    cls = require_class(cls, "BucketedDDP(model, world_size, bucket_cap_mb)")
    rank, n, _ = default_group()
    cap = int(BUCKET_CAP_MB * 2**20)

    short: tuple[int, int] | None = None  # (bytes the buckets carried, gradient bytes)

    def never_reduced(names: list[str]) -> str | None:
        if short is None:  # every byte went through all-reduces that were waited on
            which = "every gradient" if len(names) == n_params else ", ".join(names)
            return (f"on rank {rank}, {which} still holds this rank's own gradient, although "
                    f"the buckets carried all {grad_bytes} bytes of gradients through "
                    "all-reduces that finished: the averaged buckets never reached p.grad")  # fmt: skip
        if len(names) == n_params:
            return None  # nothing reduced at all: the per-parameter message says so
        return (f"on rank {rank} the gradients of {', '.join(names)} were never all-reduced "
                "(each is still this rank's own). They are the last ones backward produces, "
                "in a last bucket that never reaches the cap, and that bucket was never sent: "
                "was the last, still open bucket ever closed?")  # fmt: skip

    run, got, want, local, _ = _run_ddp_class(
        cls, (BUCKET_CAP_MB,), f"BucketedDDP(model, world_size, bucket_cap_mb={BUCKET_CAP_MB})",
        explain=explain_missing_key,
    )
    params = dict(trainable_params(run.model))
    n_params = len(params)
    grad_bytes = sum(p.numel() * p.element_size() for p in params.values())
    largest = max(p.numel() * p.element_size() for p in params.values())
    ordered = list(params.values())
    in_reverse = sorted(_greedy_bucket_bytes(reversed(ordered), cap))
    in_forward = sorted(_greedy_bucket_bytes(ordered, cap))
    for step, spy in enumerate(run.steps, start=1):
        mine = [c for c in spy.calls if c.kind == "all_reduce"]
        sent = sum(c.nbytes for c in mine)
        problem = None
        if not mine:
            problem = ("no dist.all_reduce was called: each bucket's buffer must be all-reduced "
                       "(call it as dist.all_reduce, with import torch.distributed as dist)")  # fmt: skip
        elif all(c.phase != "backward" for c in mine):
            problem = (f"all {len(mine)} all-reduces started in finish_gradient_sync(), after "
                       "backward, so none of them ran while backward was computing. When is a "
                       "bucket ready to leave?")  # fmt: skip
        elif any(c.phase == "backward" and not c.async_op for c in mine):
            problem = ("an all-reduce ran with async_op=False inside backward: it held "
                       "backward up while the bucket moved, so nothing overlapped")  # fmt: skip
        elif any(c.waited == "backward" for c in mine):
            problem = ("a bucket's handle was waited on inside backward (right after starting "
                       "it): backward stopped there until the bucket had moved, so nothing "
                       "overlapped")  # fmt: skip
        elif any(c.async_op and c.waited not in ("backward", "finish") for c in mine):
            problem = ("a bucket's handle was never waited on before finish_gradient_sync() "
                       "returned: the gradients copied out of it may be half-reduced")  # fmt: skip
        elif len(mine) >= n_params:
            problem = (f"{len(mine)} all-reduces for {n_params} trainable parameters: one "
                       "message per gradient is not bucketing, and pays the latency once per "
                       "parameter")  # fmt: skip
        elif any(c.nbytes > cap + largest for c in mine) or len(mine) == 1:
            problem = (f"messages of {sorted(c.nbytes for c in mine)} bytes for a cap of "
                       f"{cap} bytes ({BUCKET_CAP_MB} MB · 2**20): a bucket holds up to the "
                       "cap, so this model needs several")  # fmt: skip
        elif min(c.ready for c in mine) >= n_params:
            problem = ("every bucket's all-reduce started only once all gradients were ready: "
                       "nothing overlapped with backward. Start each bucket as soon as its own "
                       "gradients are in (buckets in reverse parameter order fill first)")  # fmt: skip
        elif sent > grad_bytes:
            problem = (f"the buckets carried {sent} bytes, more than the {grad_bytes} bytes of "
                       "gradients: some gradient was sent twice")  # fmt: skip
        elif sorted(c.nbytes for c in mine) == in_forward != in_reverse:
            problem = (f"the buckets ({sorted(c.nbytes for c in mine)} bytes) are the "
                       "parameters grouped in the order model.parameters() lists them, but "
                       "backward produces gradients in roughly the reverse order. Sending each "
                       "bucket as it fills hides that here; DDP issues its buckets in bucket "
                       "order, so that every rank issues the same collectives in the same "
                       "order, and its first bucket would then be the last to fill, holding "
                       "every other all-reduce back until backward ends")  # fmt: skip
        if sent < grad_bytes:
            short = short or (sent, grad_bytes)
            problem = None  # a bucket never sent: the values below name its parameters
        if problem:
            agree_on_problem(f"in step {step}: {problem}")
    values = _frozen_untouched(run.model) or _compare_steps(got, want, local, never_reduced)
    if values is None and short:  # one rank: an unsent bucket has the right values anyway
        values = (f"on rank {rank} the buckets carried {short[0]} of the {short[1]} bytes of "
                  "gradients: the last gradients backward produces fill a last bucket that "
                  "never reaches the cap, and that bucket was never sent: was the last, still "
                  "open bucket ever closed?")  # fmt: skip
    agree_on_problem(values)
    calls = [c for c in run.steps[-1].calls if c.kind == "all_reduce"]
    before_end = sum(1 for c in calls if c.ready < n_params)
    return (
        f"on rank {rank} of {n}, {n_params} gradients travelled in {len(calls)} buckets of at "
        f"most ~{BUCKET_CAP_MB * 1024:.0f} KiB ({sorted(c.nbytes for c in calls)} bytes), "
        f"{before_end} of them started while backward was still running; over {STEPS} SGD "
        "steps every gradient equals DDP's"
    )


