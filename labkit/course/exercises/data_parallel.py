"""Exercise checks for notebook 02 (data parallelism): three run inside worker processes, one
decision in the kernel.

The learner writes the real thing, three times: DDP that all-reduces each gradient
asynchronously while backward still runs, the bucketed version of it, and ZeRO-1's sharded
optimizer step. A data-parallel exercise is only checked for real when several ranks run it,
so the learner's code goes into a file (a ``%%writefile`` cell in the notebook) that a worker
imports on every rank. The notebook then calls::

    from labkit.course import exercises as ex
    ex.check_in_workers("02.allreduce_grads", ex_dir / "dp_overlap.py")
    # ✓ 02.allreduce_grads: ... (checked in 2 worker processes)

which reads the file in the kernel (a stub is reported at once) and then launches
``labkit.course.exercises.dp_worker`` on ``nproc`` ranks. Each rank imports the file and runs the
registered check (:func:`labkit.course.exercises.verify`) against what torch's
``DistributedDataParallel`` computes (rank 0's weights, the mean of the ranks' gradients; the
tests compare that reference with torch DDP itself) and ``torch.optim.AdamW``, and
reports ok, not done (the generated stub) or failed with the reason. :func:`verify_file`
turns the ranks' reports into one sentence or one :class:`~labkit.course.exercises.ExerciseIncomplete`
/ :class:`~labkit.course.exercises.ExerciseFailed`, which ``check_in_workers`` prints as one line, as
``exercises.check`` does in the kernel. Notebooks define no function a worker imports (a new
process cannot import a notebook's memory: pytorch #20375).

The checks register themselves with :func:`labkit.course.exercises.exercise` when this module is
imported, and need a process group: in a worker the launcher made one; a test may make a
one-rank group in process (``torch.distributed.init_process_group("gloo",
store=torch.distributed.HashStore(), rank=0, world_size=1)``).

The exercises (the class each file must define, see :data:`EXERCISES`):

* ``02.allreduce_grads``  ``OverlapDDP(model, world_size)``: broadcast rank 0's weights, then
  one ``dist.all_reduce(p.grad, async_op=True)`` per parameter from a
  ``register_post_accumulate_grad_hook``, and ``finish_gradient_sync()`` waits on the handles
  and averages, before the optimizer steps (CS336 assignment 2's ``DDPIndividualParameters``);
* ``02.bucketed_ddp``     ``BucketedDDP(model, world_size, bucket_cap_mb)``: the same with the
  gradients grouped, in reverse order, into flat buckets of at most the cap, one all-reduce per
  bucket started when its last gradient arrives (``labkit.parallel.dp_bucketed``; PyTorch DDP
  paper, Li et al. VLDB 2020, section 3.2);
* ``02.zero1_step``       ``ZeRO1Optimizer(params, make_optimizer, rank, world_size)``: its
  ``shard_bounds`` and ``step`` (reduce-scatter the flat gradient, update this rank's shard
  with the optimizer, all-gather the parameters: ZeRO paper, Rajbhandari et al. 2019, 5.1).

And one decision, checked in the kernel with ``exercises.check`` (no ranks needed):

* ``02.choose_strategy``  ``choose_strategy(measured, budget_bytes) -> str | None``: which of
  DDP, ZeRO-1 and FSDP2 to run in a per-rank memory budget, from the ladder's measured step
  times and model-state bytes per rank (:func:`strategy_measurements`; after a step and
  between micro-batches) beside ZeRO's prediction: the fastest whose measured peak fits, None
  if none does. Checked on the notebook's own measurements (:func:`checking_on`) and on
  :func:`strategy_cases`, where each usual wrong decision (:data:`STRATEGY_MISTAKES`: memory
  ignored, the least memory, the formula's bytes, the after-step bytes only, bytes or budget
  times the ranks, the test inverted or strict, the slowest, the least bad when nothing fits)
  gives answers of its own, so the check can name it. The notebook then runs the choice for
  real and holds its measured peak against the budget (:func:`fit_sentence`).

How a check sees *when* things happened: while the learner's code runs, the collectives of
``torch.distributed`` are replaced by thin wrappers that record each call (kind, bytes,
``async_op``, whether backward was still running, how many gradients were ready) and hand out
handles that record when they are waited on. The learner's code is unchanged; it must call the
collectives as ``dist.<name>`` (``import torch.distributed as dist``), as PyTorch's tutorials do.

Importing this module has no side effects beyond the registration: no process group, no
files.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from labkit.course.exercises import (
    ExerciseError,
    ExerciseFailed,
    ExerciseIncomplete,
    _name,
    _require_callable,
    call,
    exercise,
    explain_job_error,
    incomplete,
    is_stub,
    learner_frame,
    ranks_apart,
    short_repr,
    time_limit_paused,
    verify,
    without_failed_prefix,
)
from labkit.jobs import diagnosis

WORKER = "labkit.course.exercises.dp_worker"

EXERCISES: dict[str, str] = {
    "02.allreduce_grads": "OverlapDDP",
    "02.bucketed_ddp": "BucketedDDP",
    "02.zero1_step": "ZeRO1Optimizer",
}
"""Exercise id -> the class the learner's file must define."""

# fp32 gradients averaged by two different all-reduce schedules differ by rounding only
# (with 2 ranks not even that: a + b is exact to compare, and /2 is exact); a missing average
# is off by a factor of world_size.
RTOL, ATOL = 1e-5, 1e-7
STEPS = 2  # two steps: a list of handles that is never cleared shows in the second
ROWS_PER_RANK = 2  # sequences in each rank's slice of the global batch
BUCKET_CAP_MB = 0.02  # ~20 kB: several buckets in CheckLM, and a small last one
PG_TIMEOUT_S = 15.0
"""The check job's process-group timeout: how long a rank waits in a collective another rank
never calls before it fails (gloo's default is 30 minutes). A check's collectives move a few
kB between ranks that started together, and the longest gap between two of them (a first use
of a module, on a busy 2-core machine) is a few seconds: 15 s leaves room for that and still
names the mismatch (:func:`labkit.course.exercises.ranks_apart`) in about 25 s from the launch."""
LR, WEIGHT_DECAY = 1e-2, 0.1  # SGD in the DDP checks, torch's AdamW in ZeRO-1's (and its reference)


# --------------------------------------------------------------------------- the check model


class CheckLM(nn.Module):
    """A language model small enough to run in milliseconds, with a real model's traps.

    * a frozen parameter (``wpe.weight``: ``requires_grad=False``, no ``.grad`` at all);
    * a tied one (``head.weight`` is ``wte.weight``: one tensor, listed once by
      ``parameters()``, whose gradient arrives from two places);
    * a buffer (``shift``), random like the weights, which DDP broadcasts too;
    * a tiny first parameter (``scale``, one element) used at the input: backward finishes it
      last, so it lands in the last bucket, which stays smaller than any cap; and it makes the
      number of trainable elements odd, so ZeRO-1's shards need padding on 2 ranks.
    """

    def __init__(self, vocab: int = 64, d: int = 32, n_layer: int = 2, seq_len: int = 8):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq_len, d)
        self.wpe.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
            for _ in range(n_layer)
        )
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied (Press & Wolf 2017), as in GPT-2
        self.register_buffer("shift", 0.02 * torch.randn(d))
        self.vocab, self.seq_len = vocab, seq_len

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) * self.scale + self.wpe(pos) + self.shift
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


FROZEN = "wpe.weight"


def _model(seed: int, device: torch.device) -> CheckLM:
    with torch.random.fork_rng(devices=[]):  # leave the caller's random state alone
        torch.manual_seed(seed)
        return CheckLM().to(device)


def _batches(rank: int, world_size: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """This rank's (x, y) for each of STEPS steps: rows r·b … (r+1)·b − 1 of a global batch
    that every rank draws alike."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 64, (world_size * ROWS_PER_RANK, 9), generator=g)
        rows = tokens[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK].to(device)
        out.append((rows[:, :-1], rows[:, 1:]))
    return out


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


# --------------------------------------------------------------------------- reference answers
# The notebook's solutions, as classes the checks can be tested with and the benchmark
# (benchmarks/bench_dp_overlap.py) can time: naive, overlapped and bucketed DDP share one
# interface, ``Cls(model, world_size, ...)`` then ``finish_gradient_sync()`` after backward.


def _broadcast_from_rank0(model: nn.Module) -> None:
    """Every rank starts from rank 0's parameters and buffers, as torch DDP does when it wraps
    a model (https://pytorch.org/docs/stable/notes/ddp.html, "Construction")."""
    for t in [*model.parameters(), *model.buffers()]:
        tdist.broadcast(t.data, src=0)


class NaiveDDP:
    """After backward, one blocking all-reduce per gradient: nothing overlaps (the baseline)."""

    def __init__(self, model: nn.Module, world_size: int) -> None:
        _broadcast_from_rank0(model)
        self.world_size = world_size
        self.params = [p for p in model.parameters() if p.requires_grad]

    def finish_gradient_sync(self) -> None:
        for p in self.params:
            if p.grad is not None:
                tdist.all_reduce(p.grad)
                p.grad /= self.world_size


class OverlapDDP:
    """One asynchronous all-reduce per gradient, started by its post-accumulate hook while
    backward computes the earlier layers; waited on before the optimizer step (CS336
    assignment 2's ``DDPIndividualParameters``)."""

    def __init__(self, model: nn.Module, world_size: int) -> None:
        _broadcast_from_rank0(model)
        self.world_size = world_size
        self.handles: list[tuple[torch.Tensor, Any]] = []
        for p in model.parameters():
            if p.requires_grad:
                # https://pytorch.org/docs/stable/generated/torch.Tensor.register_post_accumulate_grad_hook.html
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        self.handles.append((p, tdist.all_reduce(p.grad, async_op=True)))

    def finish_gradient_sync(self) -> None:
        for p, handle in self.handles:
            handle.wait()
            p.grad /= self.world_size
        self.handles.clear()


class BucketedDDP:
    """Gradients copied into flat buckets of at most ``bucket_cap_mb`` (reverse parameter
    order); a bucket's asynchronous all-reduce starts when its last gradient arrives (PyTorch
    DDP paper, Li et al. VLDB 2020, section 3.2; ``labkit.parallel.dp_bucketed``)."""

    def __init__(self, model: nn.Module, world_size: int, bucket_cap_mb: float = 25.0) -> None:
        _broadcast_from_rank0(model)
        self.world_size = world_size
        params = [p for p in model.parameters() if p.requires_grad]
        cap_bytes = bucket_cap_mb * 2**20
        groups: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in reversed(params):  # backward makes the last layers' gradients first
            nbytes = p.numel() * p.element_size()
            if groups[-1] and size + nbytes > cap_bytes:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += nbytes
        self.buckets: list[dict[str, Any]] = []
        self.where: dict[int, tuple[dict[str, Any], int]] = {}
        for group in groups:  # the last group too, however small
            buffer = torch.zeros(sum(p.numel() for p in group), dtype=group[0].dtype,
                                 device=group[0].device)  # fmt: skip
            bucket = {"params": group, "buffer": buffer, "ready": 0, "handle": None}
            offset = 0
            for p in group:
                self.where[id(p)] = (bucket, offset)
                offset += p.numel()
            self.buckets.append(bucket)
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        bucket, offset = self.where[id(p)]
        bucket["buffer"][offset : offset + p.numel()].copy_(p.grad.reshape(-1))
        bucket["ready"] += 1
        if bucket["ready"] == len(bucket["params"]):
            bucket["handle"] = tdist.all_reduce(bucket["buffer"], async_op=True)

    def finish_gradient_sync(self) -> None:
        for bucket in self.buckets:
            bucket["handle"].wait()
            bucket["buffer"] /= self.world_size
            offset = 0
            for p in bucket["params"]:
                p.grad.copy_(bucket["buffer"][offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            bucket["ready"], bucket["handle"] = 0, None


class ZeRO1Optimizer:
    """ZeRO stage 1 (Rajbhandari et al. 2019, section 5.1): the flat parameters in equal,
    zero-padded shards; ``make_optimizer([shard])`` keeps state for this rank's shard only;
    ``step`` = reduce-scatter the gradients, update the shard, all-gather the weights."""

    def __init__(self, params: Any, make_optimizer: Callable[[list[nn.Parameter]], Any],
                 rank: int, world_size: int) -> None:  # fmt: skip
        self.params = [p for p in params if p.requires_grad]
        self.rank, self.world_size = rank, world_size
        numel = sum(p.numel() for p in self.params)
        self.start, self.stop = self.shard_bounds(numel, rank, world_size)
        self.flat = torch.zeros(world_size * (self.stop - self.start),
                                dtype=self.params[0].dtype, device=self.params[0].device)  # fmt: skip
        self.flat[:numel] = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.shard = nn.Parameter(self.flat[self.start : self.stop].clone())
        self.inner = make_optimizer([self.shard])

    @staticmethod
    def shard_bounds(numel: int, rank: int, world_size: int) -> tuple[int, int]:
        shard = -(-numel // world_size)  # ceil without floats
        return rank * shard, (rank + 1) * shard

    @torch.no_grad()
    def step(self) -> None:
        grads = torch.zeros_like(self.flat)
        offset = 0
        for p in self.params:
            if p.grad is not None:
                grads[offset : offset + p.numel()] = p.grad.reshape(-1)
            offset += p.numel()
        shard_grad = torch.empty_like(self.shard)
        tdist.reduce_scatter_single(shard_grad, grads)
        self.shard.grad = shard_grad / self.world_size
        self.inner.step()
        tdist.all_gather_single(self.flat, self.shard.detach())
        offset = 0
        for p in self.params:
            p.copy_(self.flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


# --------------------------------------------------------------------------- shared pieces


def _group() -> tuple[int, int, torch.device]:
    """(rank, world size, device) of the default process group."""
    if not (tdist.is_available() and tdist.is_initialized()):
        raise RuntimeError(
            "the 02.* exercise checks run inside worker processes, where a process group "
            "exists: use labkit.course.exercises.check_in_workers(exercise_id, path_to_file)"
        )
    nccl = tdist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    return tdist.get_rank(), tdist.get_world_size(), device


def _require_class(answer: object, signature: str) -> Callable[..., Any]:
    if not callable(answer):
        raise ExerciseFailed(
            f"expected the class {signature}, got {type(answer).__name__} {answer!r}"
        )
    return answer


def _agree(problem: str | None) -> None:
    """Every rank learns every rank's verdict, and all raise the first problem found.

    A rank that found a mistake must not leave the others waiting in the next collective:
    after each phase of a check the ranks compare notes (``all_gather_object``), so every
    rank stops at the same point, with the same message (which names the rank that found it).
    """
    n = tdist.get_world_size()
    found: list[str | None] = [None] * n
    tdist.all_gather_object(found, problem)
    for message in found:
        if message is not None:
            raise ExerciseFailed(message)


def _attempt(
    fn: Callable[[], Any], explain: Callable[[Exception], str | None] | None = None
) -> tuple[Any, str | None]:
    """Run a piece of the learner's code; (result, None), or (None, what went wrong).
    ``explain(err)`` may name the mistake behind an exception (None: it cannot)."""
    try:
        return fn(), None
    except NotImplementedError:
        raise
    except ExerciseFailed as err:
        return None, str(err)
    except Exception as err:  # call() turns most into ExerciseFailed; this is the rest
        why = explain(err) if explain is not None else None
        if why is not None:
            return None, f"{why}{learner_frame(err)}"
        return None, f"your code raised {type(err).__name__}: {err}{learner_frame(err)}"


def _missing_key(model: nn.Module) -> Callable[[Exception], str | None]:
    """An explainer for :func:`_attempt`: a KeyError whose key is one of ``model``'s trainable
    parameters (the tensor or its ``id``) means the learner's lookup table has no entry for
    it, most often because the bucket holding it was never made."""
    by_id = {id(p): name for name, p in _trainable(model)}

    def explain(err: Exception) -> str | None:
        if not isinstance(err, KeyError) or not err.args:
            return None
        key = err.args[0]
        name = by_id.get(id(key)) if isinstance(key, torch.Tensor) else by_id.get(key)
        if name is None:
            return None
        return (f"your code raised KeyError when the gradient of {name} arrived: {name} is "
                "in no bucket, so its hook found nowhere to put it. Every trainable "
                "parameter must belong to a bucket: was the last, still open bucket ever "
                "added?")  # fmt: skip

    return explain


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def _why_gradient_differs(
    got: torch.Tensor, want: torch.Tensor, local: torch.Tensor, n: int, step: int = 1
) -> str:
    """The usual mistake a wrong averaged gradient points to (``step``: counted from 1)."""
    if not torch.isfinite(got).all():
        return "it contains inf/NaN"
    if _close(got, local):
        return "it is still this rank's own gradient: it was never all-reduced with the other ranks"
    if _close(got, n * want):
        return (f"it is {n}x the average: all_reduce sums over the {n} ranks, so divide by "
                "world_size once the all-reduce has finished")  # fmt: skip
    if _close(got, want / n):
        if step > 1:
            return (f"it is 1/{n} of the average: it was divided by world_size twice, only from "
                    f"step 2 on. Is something of step 1 (its handles still in the list?) "
                    "divided again?")  # fmt: skip
        return f"it is 1/{n} of the average: it was divided by world_size twice"
    if _close(got, local / n):
        return ("it is this rank's gradient divided by world_size: the sum over ranks never "
                "reached it (was it divided before the all-reduce finished, or was the "
                "all-reduce started on a copy?)")  # fmt: skip
    err = (got - want).abs().max().item()
    return f"it differs from DDP's by up to {err:.3g}"


# --------------------------------------------------------------------------- the collective spy


@dataclass
class _Call:
    """One collective the learner's code called."""

    kind: str  # "all_reduce", "reduce_scatter", "all_gather", "broadcast"
    nbytes: int  # bytes of the tensor reduced / scattered from / gathered into / broadcast
    async_op: bool
    phase: str  # what the check was running: "init", "backward", "finish", "step"
    ready: int  # gradients that were final (post-accumulate hooks run) when it was called
    waited: str | None = None  # phase in which .wait() was first called on its handle
    work: Any = None


# torch.distributed names -> the kind of collective (several names for one kind: torch 2.13
# renamed all_gather_into_tensor to all_gather_single, and the old names still work)
_SPIED = {
    "all_reduce": "all_reduce",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "broadcast": "broadcast",
}


class _Handle:
    """A collective's work handle that remembers when it was first waited on."""

    def __init__(self, work: Any, record: _Call, spy: _Spy) -> None:
        self._work, self._record, self._spy = work, record, spy

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        if not any(c is self._record for c in self._spy.calls):
            self._spy.stale_waits += 1  # a handle of an earlier step, waited on again
        if self._record.waited is None:
            self._record.waited = self._spy.phase
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # is_completed, get_future, ...
        return getattr(self._work, name)


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    return 0


class _Spy:
    """Records the collectives ``torch.distributed`` is asked for while active, and counts the
    gradients that are final (its own post-accumulate hooks, registered before the learner's,
    so they run first for each parameter)."""

    def __init__(self, params: Sequence[nn.Parameter] = ()) -> None:
        self.calls: list[_Call] = []
        self.phase = "init"
        self.ready = 0
        self.events: list[str] = []  # "reduce_scatter", "update", "all_gather"... in order
        self.stale_waits = 0  # waits on handles an earlier step started (reset per step)
        self._depth = 0  # a collective that calls another by its new name is one call
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_ready) for p in params]

    def _on_ready(self, _: torch.Tensor) -> None:
        self.ready += 1

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()

    def _wrap(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def spied(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            async_op = bool(kwargs.get("async_op", False))
            # S as NCCL-tests counts it: the tensor reduced, the full input of a
            # reduce-scatter, the gathered output of an all-gather (its first argument)
            index = 1 if kind == "reduce_scatter" else 0
            tensor = args[index] if len(args) > index else kwargs.get("input" if index else "tensor")
            record = _Call(kind, _tensor_bytes(tensor), async_op, self.phase, self.ready)
            self.calls.append(record)
            self.events.append(kind)
            self._depth += 1
            try:
                work = fn(*args, **kwargs)
            finally:
                self._depth -= 1
            if work is None:
                return None
            record.work = work
            return _Handle(work, record, self)

        return spied

    @contextlib.contextmanager
    def active(self) -> Iterator[_Spy]:
        import torch.distributed.distributed_c10d as c10d

        saved = []
        for module in (tdist, c10d):
            for name, kind in _SPIED.items():
                fn = getattr(module, name, None)
                if fn is not None:
                    saved.append((module, name, fn))
                    setattr(module, name, self._wrap(kind, fn))
        try:
            yield self
        finally:
            for module, name, fn in saved:
                setattr(module, name, fn)

    def wait_all(self) -> None:
        """Wait on every handle the learner left behind, so no collective is left in flight."""
        for c in self.calls:
            if c.work is not None:
                c.work.wait()
                c.work = None


# --------------------------------------------------------------------------- DDP checks


@dataclass
class _DDPRun:
    """What one check of a DDP class saw: its spy per step and its model."""

    model: nn.Module
    steps: list[_Spy] = field(default_factory=list)
    init: _Spy | None = None


def _reference_ddp(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, ...]],
    bucket_cap_mb: float | None = None,
    *,
    use_torch_ddp: bool = False,
) -> tuple[list[dict[str, torch.Tensor]], nn.Module]:
    """What DDP computes on a copy of ``model``: the averaged gradients of each step (copies,
    by name) and the model after STEPS SGD steps (:func:`_sgd_step`).

    By hand by default: rank 0's parameters and buffers broadcast, then each step the mean over
    ranks of every gradient, which is torch's ``DistributedDataParallel`` semantics
    (https://pytorch.org/docs/stable/notes/ddp.html). ``use_torch_ddp=True`` runs torch's own
    (the tests compare the two): its first use imports torch._dynamo, seconds that every check
    job in a notebook would pay again.
    """
    replica = copy.deepcopy(model)
    n = tdist.get_world_size()
    if use_torch_ddp:
        from torch.nn.parallel import DistributedDataParallel

        kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
        forward: Callable[..., torch.Tensor] = DistributedDataParallel(replica, **kwargs)
    else:
        _broadcast_from_rank0(replica)
        forward = replica
    grads = []
    for x, y in batches:
        replica.zero_grad(set_to_none=True)
        forward(x, y).backward()
        if not use_torch_ddp:
            for _, p in _trainable(replica):
                tdist.all_reduce(p.grad)
                p.grad /= n
        grads.append({name: p.grad.detach().clone() for name, p in _trainable(replica)})
        _sgd_step(replica)
    return grads, replica


@torch.no_grad()
def _sgd_step(model: nn.Module) -> None:
    """p -= LR · p.grad. Not a torch optimizer: creating one imports torch._dynamo (seconds,
    in every check job); the DDP checks need the weights to move between steps, nothing more."""
    for _, p in _trainable(model):
        p.add_(p.grad, alpha=-LR)


def _local_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """This rank's own gradients for one batch (of a copy: the model is left alone)."""
    replica = copy.deepcopy(model)
    replica(x, y).backward()
    return {n: p.grad.detach().clone() for n, p in _trainable(replica)}


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
    gradients per step, DDP's (:func:`_reference_ddp`), this rank's local ones, and the
    reference's final model. ``explain(model)``: an explainer of the learner's exceptions
    during backward and ``finish_gradient_sync()`` (see :func:`_attempt`).
    Between phases the ranks agree (:func:`_agree`), so a mistake stops all of them together.
    """
    rank, n, device = _group()
    model = _model(100 + rank, device)
    original = copy.deepcopy(model)  # for the reference, which runs after the learner's class
    batches = _batches(rank, n, device)
    params = [p for _, p in _trainable(model)]

    run = _DDPRun(model)
    spy = _Spy(params)  # registered first: counts a gradient before the learner's hook sees it
    run.init = spy
    with spy.active():
        ddp, problem = _attempt(lambda: call(cls, model, n, *args))
    _agree(problem)
    disagree = _ranks_disagree(model)
    if disagree is not None:
        _agree(f"after {signature} the ranks hold different values of {disagree}: each rank "
               "initialised its own model (a different seed per rank), and nothing made them "
               "equal, so the ranks would train different models. torch DDP starts every rank "
               "from rank 0's parameters and buffers")  # fmt: skip
    finish = getattr(ddp, "finish_gradient_sync", None)
    if not callable(finish):
        _agree(f"{type(ddp).__name__} has no method finish_gradient_sync(): the training loop "
               "calls it after loss.backward() and before optimizer.step()")  # fmt: skip
    want, reference = _reference_ddp(original, batches, args[0] if args else None)

    why = explain(model) if explain is not None else None
    got, local = [], []
    for step, (x, y) in enumerate(batches):
        local.append(_local_grads(model, x, y))
        model.zero_grad(set_to_none=True)
        spy.calls, spy.events, spy.ready, spy.stale_waits = [], [], 0, 0
        problem = None
        with spy.active():
            spy.phase = "backward"
            _, problem = _attempt(lambda: model(x, y).backward(), why)  # noqa: B023
            if problem is None:
                spy.phase = "finish"
                _, problem = _attempt(lambda: call(finish), why)
        spy.phase = "after"
        spy.wait_all()
        run.steps.append(copy.copy(spy))
        if problem is not None:
            problem = f"in step {step + 1}: {problem}"
        _agree(problem)
        missing = [name for name, p in _trainable(model) if p.grad is None]
        if missing:
            _agree(f"after finish_gradient_sync() in step {step + 1}, {missing[0]}.grad is None "
                   f"on rank {tdist.get_rank()}: leave the averaged gradient in p.grad")  # fmt: skip
        got.append({name: p.grad.detach().clone() for name, p in _trainable(model)})
        _sgd_step(model)
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
        unreduced = [k for k in w if not _close(g[k], w[k]) and _close(g[k], loc[k])]
        if unreduced and extra is not None:
            message = extra(unreduced)
            if message is not None:
                return message
        for name, target in w.items():
            if not _close(g[name], target):
                return (f"in step {step + 1}, {name}.grad on rank {rank} of {n} is not "
                        f"the averaged gradient DDP computes: "
                        f"{_why_gradient_differs(g[name], target, loc[name], n, step + 1)}")  # fmt: skip
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
    cls = _require_class(cls, "OverlapDDP(model, world_size)")
    rank, n, _ = _group()
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
            _agree(f"in step {step}: {problem}")
    _agree(_frozen_untouched(run.model) or _compare_steps(got, want, local))
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
    cls = _require_class(cls, "BucketedDDP(model, world_size, bucket_cap_mb)")
    rank, n, _ = _group()
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
        explain=_missing_key,
    )
    params = dict(_trainable(run.model))
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
            _agree(f"in step {step}: {problem}")
    values = _frozen_untouched(run.model) or _compare_steps(got, want, local, never_reduced)
    if values is None and short:  # one rank: an unsent bucket has the right values anyway
        values = (f"on rank {rank} the buckets carried {short[0]} of the {short[1]} bytes of "
                  "gradients: the last gradients backward produces fill a last bucket that "
                  "never reaches the cap, and that bucket was never sent: was the last, still "
                  "open bucket ever closed?")  # fmt: skip
    _agree(values)
    calls = [c for c in run.steps[-1].calls if c.kind == "all_reduce"]
    before_end = sum(1 for c in calls if c.ready < n_params)
    return (
        f"on rank {rank} of {n}, {n_params} gradients travelled in {len(calls)} buckets of at "
        f"most ~{BUCKET_CAP_MB * 1024:.0f} KiB ({sorted(c.nbytes for c in calls)} bytes), "
        f"{before_end} of them started while backward was still running; over {STEPS} SGD "
        "steps every gradient equals DDP's"
    )


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
    cls = _require_class(cls, "ZeRO1Optimizer(params, make_optimizer, rank, world_size)")
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

    rank, n, device = _group()
    model = _model(7, device)  # the same weights on every rank: ZeRO-1 does not broadcast
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(
        [p for _, p in _trainable(reference)], lr=LR, weight_decay=WEIGHT_DECAY
    )
    names = [name for name, _ in _trainable(model)]
    params = [p for _, p in _trainable(model)]
    numel = sum(p.numel() for p in params)
    start, stop = bounds(numel, rank, n)
    size = n * (stop - start)

    updates: list[_Update] = []
    spy = _Spy()
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
        zero, problem = _attempt(lambda: call(cls, model.parameters(), make_optimizer, rank, n))
    _agree(problem)
    if len(made) != 1:
        _agree(f"{signature} called make_optimizer {len(made)} times; ZeRO-1 keeps one "
               "optimizer, for the shard this rank updates")  # fmt: skip
    held = sum(p.numel() for g in made[0].param_groups for p in g["params"])
    if held != stop - start:
        _agree(f"on rank {rank} of {n} the optimizer was given {held} elements, but the rank "
               f"owns a shard of {stop - start} of the {numel} (shard_bounds({numel}, {rank}, "
               f"{n}) = ({start}, {stop})), so AdamW would keep state for more than "
               "1/world_size of the model")  # fmt: skip

    batches = _batches(rank, n, device)
    for step, (x, y) in enumerate(batches, start=1):
        before = _flat([p.detach() for p in params], params, size)
        # the reference: torch's AdamW on every parameter, with the averaged gradient
        ref_params = [p for _, p in _trainable(reference)]
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
            _, problem = _attempt(lambda: call(zero.step))
        spy.phase = "after"
        spy.wait_all()
        _agree(None if problem is None else f"in step {step}: {problem}")
        _agree(_zero1_problem(step, spy, updates, averaged, mine, before, want, params, names,
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
    spy: _Spy,
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
    if not _close(up.param, before[piece]):
        return (f"{where}: the parameter the optimizer updated is not this rank's slice "
                f"[{start}, {stop}) of the flat parameters")  # fmt: skip
    g, w = up.grad, averaged[piece]
    if not _close(g, w):
        if _close(g, n * w):
            why = (f"it is {n}x the average: reduce-scatter sums over the {n} ranks, divide by "
                   "world_size (AdamW hides most of it, weight decay and eps do not)")  # fmt: skip
        elif _close(g, mine[piece]):
            why = "it is this rank's own gradient: it was never reduced over the ranks"
        elif _close(g, mine[piece] / n):
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


# --------------------------------------------------------------------------- 02.choose_strategy
# A decision, checked in the kernel (ex.check): no process group, no worker.

CANDIDATES = ("ddp", "zero1", "fsdp2")
"""The strategies 02.choose_strategy decides between: the rows of notebook 02's memory table."""


def strategy_measurements(
    ranks: Sequence[dict[str, Any]], names: Sequence[str] = CANDIDATES
) -> dict[str, dict[str, Any]]:
    """What 02.choose_strategy decides from, out of a ``labkit.workers.dp_train`` job's
    per-rank results (``JobResult.ranks``). Per strategy:

    * ``step_s``: rank 0's median seconds per optimizer step, the first step left out (as the
      ladder's table does: warm-up, and DDP rebuilds its buckets there); measured;
    * ``after_step_bytes``: parameters + gradients + optimizer state one rank holds after a
      step (storage bytes of its local tensors, the largest over the ranks); measured;
    * ``accumulating_bytes``: the same between two micro-batches under the strategy's
      ``no_sync`` (the gradients measured then, parameters and optimizer state as after the
      step); None for a strategy without ``no_sync`` (ZeRO-1 accumulates in the one flat
      buffer it keeps after the step too); measured;
    * ``predicted_bytes``: ZeRO's model states per rank (``dp_train.predicted_memory``);
      modelled;
    * ``ranks``: how many ranks the job ran. Every byte figure is per rank.
    """
    table: dict[str, dict[str, Any]] = {}
    for name in names:
        runs = [r["runs"][name] for r in ranks if r]
        steps = runs[0]["step_s"][1:] or runs[0]["step_s"]
        mems = [run["memory"] for run in runs]
        after = [m["parameters"] + m["gradients"] + m["optimizer_state"] for m in mems]
        grads_acc = [m.get("gradients_accumulating") for m in mems]
        accumulating = None
        if all(g is not None for g in grads_acc):
            accumulating = max(m["parameters"] + g + m["optimizer_state"]
                               for m, g in zip(mems, grads_acc, strict=True))
        table[name] = {
            "step_s": statistics.median(steps),
            "after_step_bytes": max(after),
            "accumulating_bytes": accumulating,
            "predicted_bytes": max(run["memory_predicted"]["model_states"] for run in runs),
            "ranks": len(ranks),
        }
    return table


def peak_bytes(record: dict[str, Any]) -> float:
    """The most one rank holds of a strategy's model states during a step (measured)."""
    acc = record["accumulating_bytes"]
    return record["after_step_bytes"] if acc is None else max(record["after_step_bytes"], acc)


def fit_sentence(name: str, record: dict[str, Any], ladder: dict[str, Any] | None,
                 budget_bytes: float, role: str = "") -> str:  # fmt: skip
    """One measured line: ``name``'s peak per rank in a run (``record``, from
    :func:`strategy_measurements`) against ``budget_bytes``, within or above as the numbers
    say, and whether the ladder's measurement (``ladder``) found the same bytes."""
    peak = peak_bytes(record)
    acc = record["accumulating_bytes"]
    parts = f"{_mib(record['after_step_bytes'])} after a step" + (
        f", {_mib(acc)} between micro-batches" if acc is not None else "")
    side = "within" if peak <= budget_bytes else "above"
    again = ""
    if ladder is not None:
        before = peak_bytes(ladder)
        again = ("; the ladder measured the same bytes" if before == peak
                 else f"; the ladder measured {_mib(before)}")  # fmt: skip
    return (f"measured: {name}{f' ({role})' if role else ''} peaks at {_mib(peak)} per rank "
            f"({parts}), {side} the budget of {_mib(budget_bytes)} by "
            f"{_mib(abs(budget_bytes - peak))}{again}")  # fmt: skip


def _fastest(measured: dict[str, dict[str, Any]], keep: Callable[[dict[str, Any]], bool],
             slowest: bool = False) -> str | None:  # fmt: skip
    names = [n for n, r in measured.items() if keep(r)]
    if not names:
        return None
    pick = max if slowest else min
    return pick(names, key=lambda n: measured[n]["step_s"])


def reference_choose_strategy(measured: dict[str, dict[str, Any]], budget_bytes: float) -> str | None:
    """What later cells use while the learner's answer is not done or wrong: the fastest
    strategy whose measured peak per rank fits the per-rank budget, None if none does."""
    return _fastest(measured, lambda r: peak_bytes(r) <= budget_bytes)


def as_predicted(measured: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A copy of ``measured`` in which every byte figure is ZeRO's prediction: what a plan
    made from the formula alone would see (the notebook runs the learner's decision on it)."""
    return {n: {**r, "after_step_bytes": r["predicted_bytes"], "accumulating_bytes": None}
            for n, r in measured.items()}  # fmt: skip


def _least(measured: dict[str, dict[str, Any]]) -> str:
    return min(measured, key=lambda n: peak_bytes(measured[n]))


# The usual wrong decisions: (name, what it returns, why it is wrong). The check runs each on
# every case and names the one that gives all of the learner's answers; the tests make sure no
# two give the same answers on the cases.
Mistake = tuple[str, Callable[[dict[str, dict[str, Any]], float], str | None], str]
STRATEGY_MISTAKES: tuple[Mistake, ...] = (
    ("ignores_memory", lambda m, b: _fastest(m, lambda r: True),
     "that is the fastest strategy whatever its memory: a strategy that does not fit in a "
     "rank's memory cannot run at all, however fast its steps"),
    ("smallest_memory", lambda m, b: _least(m),
     "that is the strategy with the least memory, every time: memory only has to fit, and "
     "among the strategies that fit, the one whose steps finish soonest is the one to run"),
    ("predicted", lambda m, b: _fastest(m, lambda r: r["predicted_bytes"] <= b),
     "you judged the fit by predicted_bytes, ZeRO's formula. It gives the model states after "
     "a step; what a rank was measured to hold is more (gradients while accumulating, padded "
     "shards), and the measurement is what has to fit"),
    ("after_step", lambda m, b: _fastest(m, lambda r: r["after_step_bytes"] <= b),
     "you judged the fit by the bytes after a step only. Between micro-batches, while the "
     "gradients accumulate, a rank can hold more (accumulating_bytes): the budget must hold "
     "the peak, or the step runs out of memory half-way"),
    ("times_ranks", lambda m, b: _fastest(m, lambda r: peak_bytes(r) * r["ranks"] <= b),
     "you multiplied the bytes by the number of ranks: they are already bytes per rank, and "
     "so is the budget"),
    ("budget_times_ranks", lambda m, b: _fastest(m, lambda r: peak_bytes(r) <= b * r["ranks"]),
     "you multiplied the budget by the number of ranks: every rank has its own memory, and "
     "each rank's bytes must fit in its own budget"),
    ("inverted", lambda m, b: _fastest(m, lambda r: peak_bytes(r) > b),
     "you kept the strategies that do not fit: the comparison with the budget points the "
     "wrong way"),
    ("strict", lambda m, b: _fastest(m, lambda r: peak_bytes(r) < b),
     "a strategy whose peak equals the budget exactly still fits: at most the budget, not "
     "strictly less"),
    ("slowest", lambda m, b: _fastest(m, lambda r: peak_bytes(r) <= b, slowest=True),
     "that is the slowest of the strategies that fit: step_s is seconds per step, so the "
     "smallest is the fastest"),
    ("least_bad_small", lambda m, b: reference_choose_strategy(m, b) or _least(m),
     "when nothing fits there is nothing to run: return None, not the strategy that misses "
     "the budget by the least"),
    ("least_bad_fast", lambda m, b: reference_choose_strategy(m, b) or _fastest(m, lambda r: True),
     "when nothing fits there is nothing to run: return None, not the fastest of the "
     "strategies that do not fit"),
)

PSI = 2**18  # parameters of the check's made-up models: 16Ψ bytes = 4 MiB


def _record(step_s: float, after: float, accumulating: float | None, predicted: float,
            ranks: int) -> dict[str, Any]:  # fmt: skip
    return {"step_s": step_s, "after_step_bytes": int(after * PSI),
            "accumulating_bytes": None if accumulating is None else int(accumulating * PSI),
            "predicted_bytes": int(predicted * PSI), "ranks": ranks}  # fmt: skip


def strategy_cases() -> list[tuple[dict[str, dict[str, Any]], float, str]]:
    """(measured, budget_bytes, what) for other jobs than the notebook's, in Ψ-byte units of a
    made-up model (fp32, AdamW, two micro-batches accumulated): DDP 16Ψ after a step and 20Ψ
    while accumulating (a fresh .grad beside its buckets), ZeRO-1 4Ψ + 4Ψ + 8Ψ/n, FSDP2 16Ψ/n
    after a step and 4Ψ/n + 4Ψ + 8Ψ/n while accumulating (whole gradients under no_sync), as
    notebook 02 measures them; made-up step times (DDP fastest in most, FSDP2 ahead of ZeRO-1
    in one). Each case is one where some usual mistake gives another answer."""
    def job(n: int, steps: tuple[float, float, float], zero1_pad: float = 0.0,
            fsdp_pad: float = 0.0) -> dict[str, dict[str, Any]]:  # fmt: skip
        zero1 = 8 + 8 / n
        fsdp = 16 / n
        return {
            "ddp": _record(steps[0], 16, 20, 16, n),
            "zero1": _record(steps[1], zero1 + zero1_pad, None, zero1, n),
            "fsdp2": _record(steps[2], fsdp + fsdp_pad, 4 / n + 4 + 8 / n + fsdp_pad, fsdp, n),
        }

    return [
        (job(2, (0.10, 0.12, 0.16)), 16 * PSI,
         "2 ranks, the budget ZeRO's formula gives DDP (16Ψ)"),
        (job(2, (0.080, 0.095, 0.130)), 48 * PSI, "2 ranks, a roomy budget (48Ψ)"),
        (job(2, (0.10, 0.12, 0.16)), 9 * PSI,
         "2 ranks, a budget (9Ψ) above FSDP2's formula but below its peak"),
        (job(4, (0.090, 0.100, 0.150)), 10 * PSI,
         "4 ranks, a budget equal to ZeRO-1's peak (10Ψ)"),
        (job(3, (0.060, 0.070, 0.100), zero1_pad=1 / 12, fsdp_pad=1 / 6), 10.7 * PSI,
         "3 ranks, shards padded past the formula, a budget of 10.7Ψ"),
        (job(8, (0.040, 0.070, 0.060)), 12 * PSI,
         "8 ranks, FSDP2 faster than ZeRO-1, a budget of 12Ψ"),
    ]


_NOTEBOOK_CASE: list[tuple[dict[str, dict[str, Any]], float, str]] = []


@contextlib.contextmanager
def checking_on(measured: dict[str, dict[str, Any]], budget_bytes: float,
                what: str = "this notebook's measurements") -> Iterator[None]:  # fmt: skip
    """Inside the block, the check of 02.choose_strategy tries the learner's function on
    ``measured`` and ``budget_bytes`` first, then on :func:`strategy_cases`::

        with exdp.checking_on(measured, budget_bytes):
            choose_strategy = ex.check("02.choose_strategy", choose_strategy)
    """
    _NOTEBOOK_CASE.append((copy.deepcopy(measured), float(budget_bytes), what))
    try:
        yield
    finally:
        _NOTEBOOK_CASE.pop()


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.3f} MiB"


def _wrong_type(got: Any, names: Sequence[str]) -> str | None:
    """Why ``got`` is not an answer at all (a name among ``names`` or None), or None."""
    if got is None or (isinstance(got, str) and got in names):
        return None
    if isinstance(got, bool | int | float):
        return (f"returned the number {got!r}: return the strategy's name (one of "
                f"{list(names)}), not its time, bytes or position; None if none can run")  # fmt: skip
    if isinstance(got, dict):
        return (f"returned a strategy's record {short_repr(got, 80)}: return its name, the key "
                f"it has in measured (one of {list(names)})")  # fmt: skip
    if isinstance(got, list | tuple | set):
        return (f"returned {short_repr(got, 80)}: return one name, the strategy to run (one of "
                f"{list(names)}), or None")  # fmt: skip
    if isinstance(got, str):
        return (f"returned {got!r}, which is not a strategy measured here: the names are "
                f"{list(names)}")  # fmt: skip
    return (f"returned {type(got).__name__} {short_repr(got, 80)}: return the strategy's name "
            f"(one of {list(names)}) or None")  # fmt: skip


def _facts(measured: dict[str, dict[str, Any]], budget: float, got: str | None,
           want: str | None) -> str:  # fmt: skip
    """What is wrong with ``got`` on one case, in the case's own numbers."""
    if got is None:
        r = measured[want]
        return (f"it returned None, but {want!r} fits: its measured peak is "
                f"{_mib(peak_bytes(r))} per rank, within the budget of {_mib(budget)}")  # fmt: skip
    r = measured[got]
    peak = peak_bytes(r)
    if want is None:
        least = _least(measured)
        return (f"it chose {got!r}, but nothing fits: every strategy's measured peak is above "
                f"the budget of {_mib(budget)} per rank (the least is {least!r}'s, "
                f"{_mib(peak_bytes(measured[least]))})")  # fmt: skip
    if peak > budget:
        acc = r["accumulating_bytes"]
        during = f", {_mib(acc)} while accumulating" if acc is not None else ""
        return (f"it chose {got!r}, whose measured peak is {_mib(peak)} per rank "
                f"({_mib(r['after_step_bytes'])} after a step{during}), above the budget of "
                f"{_mib(budget)}")  # fmt: skip
    return (f"it chose {got!r}, which fits, but {want!r} fits too and its steps take "
            f"{measured[want]['step_s'] * 1e3:.1f} ms against {r['step_s'] * 1e3:.1f} ms")  # fmt: skip


@exercise(
    "02.choose_strategy",
    "Choose the data-parallel strategy to run in a per-rank memory budget",
    hints=(
        "a strategy can run only if one rank can hold it at every moment of a step, not only "
        "at the end of one; among those that can, the job wants the one whose steps finish "
        "soonest. A budget may also leave nothing that can run",
        "each record gives one rank's model-state bytes measured after a step "
        "(after_step_bytes) and between micro-batches while gradients accumulate "
        "(accumulating_bytes; None where a strategy accumulates in the buffers it keeps after "
        "the step anyway), ZeRO's formula for them (predicted_bytes, modelled), the median "
        "seconds per step (step_s) and the number of ranks. The budget is per rank too",
        "the formula is what you plan with before anything has run; once a rank has been "
        "measured to hold more, the measurement is what must fit. The answer is a name, one "
        "of measured's keys, or None",
        "recipe: for each strategy, take the larger of its two measured byte figures (the "
        "after-step one alone where the other is None); keep the strategies whose figure is "
        "at most the budget; if none is left, answer None; otherwise answer the name of the "
        "one kept with the smallest step time",
    ),
    reference=reference_choose_strategy,
)
def _verify_choose_strategy(choose_strategy: Any) -> str:
    fn = _require_callable(choose_strategy,
                           "choose_strategy(measured, budget_bytes) -> str | None")  # fmt: skip
    cases = [*_NOTEBOOK_CASE[-1:], *strategy_cases()]
    answers = []
    for measured, budget, what in cases:
        got = call(fn, copy.deepcopy(measured), budget)
        why = _wrong_type(got, list(measured))
        if why is not None:
            raise ExerciseFailed(f"on {what}, {_name(fn)}(measured, {budget:,.0f}) {why}")
        answers.append(got)
    wants = [reference_choose_strategy(m, b) for m, b, _ in cases]
    wrong = [i for i, (got, want) in enumerate(zip(answers, wants, strict=True)) if got != want]
    if not wrong:
        mine = f"{_NOTEBOOK_CASE[-1][2]} and " if _NOTEBOOK_CASE else ""
        return (f"{_name(fn)} chose the fastest strategy whose measured peak fits each per-rank "
                f"budget, or None when none does, on {mine}{len(strategy_cases())} other jobs "
                "(2 to 8 ranks, padded shards, a peak exactly at the budget, nothing that "
                "fits)")  # fmt: skip
    i = wrong[0]
    measured, budget, what = cases[i]
    message = f"on {what}, {_facts(measured, budget, answers[i], wants[i])}"
    for _, mistake, why in STRATEGY_MISTAKES:
        if all(mistake(m, b) == got for (m, b, _), got in zip(cases, answers, strict=True)):
            raise ExerciseFailed(f"{message}. All its answers are what one usual mistake "
                                 f"gives: {why}")
    raise ExerciseFailed(f"{message} ({len(wrong)} of the {len(cases)} cases are wrong)")


# --------------------------------------------------------------------------- running checks


def load_learner_module(module: str, module_dir: str | Path) -> Any:
    """Import the learner's ``<module_dir>/<module>.py`` fresh (a changed file is re-read)."""
    path = Path(module_dir) / f"{module}.py"
    if not path.is_file():
        raise ExerciseFailed(
            f"{path} does not exist: run the %%writefile cell that writes it first"
        )
    if str(module_dir) not in sys.path:
        sys.path.insert(0, str(module_dir))
    sys.modules.pop(module, None)
    importlib.invalidate_caches()
    try:
        return importlib.import_module(module)
    except SyntaxError as err:
        raise ExerciseFailed(
            f"{path} is not valid Python: {err.msg} (line {err.lineno}); fix the cell that "
            "writes it"
        ) from None
    except Exception as err:
        raise ExerciseFailed(f"importing {path} raised {type(err).__name__}: {err}") from err


def run_checks(
    exercise_ids: Sequence[str], module: str, module_dir: str | Path
) -> list[dict[str, str]]:
    """Import the learner's module and run each exercise's check on this rank.

    Returns one ``{"id", "status", "message"}`` per exercise; status is "ok", "incomplete"
    (the stub) or "failed". Never raises for a wrong answer: every rank finishes and reports.
    """
    for exercise_id in exercise_ids:
        _function_name(exercise_id)
    results = []
    try:
        learner = load_learner_module(module, module_dir)
    except ExerciseFailed as err:
        return [{"id": i, "status": "failed", "message": str(err)} for i in exercise_ids]
    for exercise_id in exercise_ids:
        name = _function_name(exercise_id)
        try:
            answer = getattr(learner, name, None)
            if answer is None:
                raise ExerciseFailed(
                    f"{learner.__file__} defines no {name}(); the cell that writes it must "
                    f"define it"
                )
            message = verify(exercise_id, answer)
            results.append({"id": exercise_id, "status": "ok", "message": message})
        except ExerciseIncomplete as err:
            results.append({"id": exercise_id, "status": "incomplete", "message": str(err)})
        except ExerciseFailed as err:
            text = str(err)
            if not text.startswith("Exercise "):
                text = f"Exercise {exercise_id} failed: {text}"
            results.append({"id": exercise_id, "status": "failed", "message": text})
    return results


def _function_name(exercise_id: str) -> str:
    try:
        return EXERCISES[exercise_id]
    except KeyError:
        raise ValueError(
            f"exercise_id={exercise_id!r} is not a worker-checked exercise: use one of "
            f"{sorted(EXERCISES)}"
        ) from None


def summarize(exercise_id: str, ranks: Sequence[dict[str, Any]]) -> str:
    """What every rank's report on ``exercise_id`` verified, if all are ok; else raise the first
    problem (a failure before a stub), naming the rank."""
    __tracebackhide__ = True
    n = len(ranks)
    reports = []
    for r, res in enumerate(ranks):
        mine = [x for x in res.get("results", []) if x.get("id") == exercise_id]
        if not mine:
            raise _failed(
                exercise_id,
                f"rank {r} of {n} reported nothing: it ended before its check was done (a "
                "sys.exit or os._exit in your code?)",
            )
        reports.append((r, mine[0]))
    for status, kind in (("failed", ExerciseFailed), ("incomplete", ExerciseIncomplete)):
        bad = [(r, x) for r, x in reports if x["status"] == status]
        # A rank that saw its peer vanish reports a consequence: the other's report comes first.
        bad.sort(key=lambda rx: diagnosis.is_echo(rx[1]["message"]))
        if bad:
            first, message = bad[0][0], bad[0][1]["message"]  # a rank's message names its rank
            followed = [r for r, x in bad[1:] if diagnosis.is_echo(x["message"])]
            if followed and not diagnosis.is_echo(message):
                message = message.rstrip(".") + "." + (
                    f" Rank {', '.join(map(str, followed))} then failed in a collective that rank "
                    f"{first} never called: every rank must call the same collectives in the "
                    "same order."
                )
            err = kind(message)
            err.exercise_id = exercise_id
            raise err
    return reports[0][1]["message"]


def verify_file(
    exercise_id: str,
    path: str | Path,
    *,
    nproc: int = 2,
    device: str = "cpu",
    timeout_s: float = 90,
) -> tuple[str, str]:
    """Run exercise ``exercise_id``'s check on ``nproc`` ranks against the learner's file.

    ``path``: the file the notebook's ``%%writefile`` cell wrote (it must define the function
    the exercise names, see :data:`EXERCISES`). Returns (what was verified, where it ran) or
    raises :class:`ExerciseIncomplete` (still the stub: found by reading the file in the
    kernel, without launching anything) or :class:`ExerciseFailed` (the reason, and the rank
    that found it). ``device="cpu"`` runs gloo ranks, which every machine can.
    Notebooks call it through :func:`labkit.course.exercises.check_in_workers`.
    """
    __tracebackhide__ = True
    from labkit.jobs import launch

    name = _function_name(exercise_id)
    path = Path(path).resolve()
    if path.suffix != ".py":
        raise ValueError(f"path={str(path)!r}: the learner's file must end in .py")
    learner = load_learner_module(path.stem, path.parent)
    if is_stub(getattr(learner, name, None)):
        raise incomplete(exercise_id)
    config = {"exercises": [exercise_id], "module": path.stem, "module_dir": str(path.parent)}
    try:
        # A rank stuck in a collective that another rank never called fails after
        # PG_TIMEOUT_S, not after gloo's 30 minutes.
        with time_limit_paused():  # the job has its own limit, and ends its processes
            res = launch.run(WORKER, nproc=nproc, device=device, config=config,
                             timeout_s=timeout_s, stream=False, pg_timeout_s=PG_TIMEOUT_S)  # fmt: skip
    except (launch.JobTimeout, launch.JobFailed) as err:
        reports = _reports(exercise_id, err.result.ranks)
        raise _failed(exercise_id, explain_job_error(err, reports)) from None
    reports = _reports(exercise_id, res.ranks)
    if any(diagnosis.is_echo(m) for m in reports.values()):  # a rank saw its peer go or time out
        apart = ranks_apart(res, reports)
        if apart is not None:
            raise _failed(exercise_id, apart)
    return summarize(exercise_id, res.ranks), f"checked in {nproc} worker processes"


def _reports(exercise_id: str, ranks: Sequence[dict[str, Any]]) -> dict[int, str]:
    """{rank: its report} for the ranks whose check of ``exercise_id`` did not pass."""
    return {
        r: without_failed_prefix(exercise_id, x["message"])
        for r, res in enumerate(ranks)
        for x in res.get("results", [])
        if x.get("id") == exercise_id and x.get("status") != "ok"
    }


def _failed(exercise_id: str, message: str) -> ExerciseError:
    err = ExerciseFailed(f"Exercise {exercise_id} failed: {message}")
    err.exercise_id = exercise_id
    return err
