"""Exercise checks for notebook 02 (data parallelism) that run inside worker processes.

A data-parallel exercise is only checked for real when several ranks run it, so the learner's
code goes into a file (a ``%%writefile`` cell in the notebook) that a worker imports on every
rank. The notebook then calls::

    from labkit import exercises as ex
    ex.check_in_workers("02.allreduce_grads", ex_dir / "dp_allreduce.py")
    # ✓ 02.allreduce_grads: ... (checked in 2 worker processes)

which reads the file in the kernel (a stub is reported at once) and then launches
``labkit.exercises.dp_worker`` on ``nproc`` ranks. Each rank imports the file,
runs the registered check (:func:`labkit.exercises.verify`) against labkit's own strategies
and a single-process reference, and reports ok, not done (the generated stub) or failed with
the reason. :func:`verify_file` turns the ranks' reports into one sentence or one
:class:`~labkit.exercises.ExerciseIncomplete` / :class:`~labkit.exercises.ExerciseFailed`,
which ``check_in_workers`` prints as one line, as ``exercises.check`` does in the kernel. Notebooks define no function a worker
imports (a new process cannot import a notebook's memory: pytorch #20375).

The checks register themselves with :func:`labkit.exercises.exercise` when this module is
imported, and need a process group: in a worker the launcher made one; a test may make a
one-rank group in process (``torch.distributed.init_process_group("gloo",
store=torch.distributed.HashStore(), rank=0, world_size=1)``).

The exercises:

* ``02.allreduce_grads``  ``allreduce_gradients(model, world_size)``: sum every gradient over
  ranks and divide by the world size (naive DP, ``labkit.parallel.dp_naive``);
* ``02.bucket_hook``      ``on_grad_ready(bucket, p, offset)``: copy a ready gradient into its
  bucket and start the bucket's asynchronous all-reduce once it is full
  (``labkit.parallel.dp_bucketed``);
* ``02.zero1_shard``      ``shard_bounds(numel, rank, world_size)``: the slice of the zero-padded
  flat buffer a rank owns under ZeRO-1 (``labkit.parallel.zero1``).

Importing this module has no side effects beyond the registration: no process group, no
files.
"""

from __future__ import annotations

import copy
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from labkit import diagnosis
from labkit.config import ModelConfig
from labkit.exercises import (
    ExerciseError,
    ExerciseFailed,
    ExerciseIncomplete,
    call,
    exercise,
    explain_job_error,
    incomplete,
    is_stub,
    time_limit_paused,
    verify,
    without_failed_prefix,
)

WORKER = "labkit.exercises.dp_worker"

EXERCISES: dict[str, str] = {
    "02.allreduce_grads": "allreduce_gradients",
    "02.bucket_hook": "on_grad_ready",
    "02.zero1_shard": "shard_bounds",
}
"""Exercise id -> the function the learner's file must define."""

# A GPT small enough to build and differentiate in milliseconds, with the two traps of a
# real model (CS336's DDP tests use the same): a frozen parameter (no .grad at all) and a
# tied one (wte.weight is lm_head.weight: one tensor, listed once by parameters()).
CHECK_MODEL = ModelConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32)
FROZEN = "wpe.weight"
ROWS_PER_RANK = 2  # sequences in each rank's slice of the global batch
# fp32 gradients of two rank-means vs the mean of the whole batch differ by rounding only
# (~1e-7 relative); a missing average is off by a factor of world_size.
RTOL, ATOL = 1e-4, 1e-6
BUCKET_CAP_MB = 0.02  # ~20 kB buckets: several of them in CHECK_MODEL, as in a real model


# --------------------------------------------------------------------------- shared pieces


def _group() -> tuple[int, int, torch.device]:
    """(rank, world size, device) of the default process group."""
    if not (tdist.is_available() and tdist.is_initialized()):
        raise RuntimeError(
            "the 02.* exercise checks run inside worker processes, where a process group "
            "exists: use labkit.exercises.check_in_workers(exercise_id, path_to_file)"
        )
    nccl = tdist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    return tdist.get_rank(), tdist.get_world_size(), device


def _require_callable(answer: object, signature: str) -> Callable[..., Any]:
    if not callable(answer):
        raise ExerciseFailed(
            f"expected the function {signature}, got {type(answer).__name__} {answer!r}"
        )
    return answer


@dataclass
class _Setup:
    """The check model on this rank, its slice of the batch, and the reference gradients."""

    model: nn.Module
    x: torch.Tensor  # (ROWS_PER_RANK, T) int64: this rank's inputs
    y: torch.Tensor  # (ROWS_PER_RANK, T) int64: this rank's targets
    reference: dict[str, torch.Tensor]  # name -> gradient of the whole batch's mean loss


def _setup(rank: int, world_size: int, device: torch.device) -> _Setup:
    """Identical replicas on every rank (same seed), a global batch of world_size x
    ROWS_PER_RANK sequences, and the gradient one process gets from all of it."""
    from labkit.model import GPT

    with torch.random.fork_rng(devices=[]):  # leave the caller's random state alone
        torch.manual_seed(0)
        model = GPT(CHECK_MODEL).to(device)
    dict(model.named_parameters())[FROZEN].requires_grad_(False)
    g = torch.Generator().manual_seed(1234)  # the same global batch on every rank
    T = CHECK_MODEL.seq_len
    tokens = torch.randint(0, CHECK_MODEL.vocab_size, (world_size * ROWS_PER_RANK, T + 1),
                           generator=g).to(device)  # fmt: skip
    x_all, y_all = tokens[:, :-1], tokens[:, 1:]  # (G, T) each

    # The reference: one process, the whole batch (the mean over all G·T tokens equals the
    # mean over ranks of each rank's mean, since every rank has equally many tokens).
    reference_model = copy.deepcopy(model)
    _, loss = reference_model(x_all, y_all)
    loss.backward()
    reference = {
        n: p.grad.detach().clone()
        for n, p in reference_model.named_parameters()
        if p.grad is not None
    }
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    return _Setup(model, x_all[rows], y_all[rows], reference)


def _local_backward(s: _Setup, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """Backward on this rank's slice only (of ``s.model``, or of ``model``, a copy of it);
    returns copies of the local gradients."""
    model = s.model if model is None else model
    _, loss = model(s.x, s.y)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def _compare_gradients(
    model: nn.Module,
    reference: dict[str, torch.Tensor],
    local: dict[str, torch.Tensor],
    world_size: int,
    advice: str,
) -> None:
    """Every trainable gradient must equal the reference; name the first one that does not
    and the usual mistake its value points to. ``advice`` ends a message with no better one."""
    params = dict(model.named_parameters())
    if params[FROZEN].grad is not None and params[FROZEN].grad.abs().sum() != 0:
        raise ExerciseFailed(
            f"the frozen parameter {FROZEN} (requires_grad=False) now has a nonzero gradient; "
            "leave parameters whose .grad is None alone"
        )
    for name, want in reference.items():
        got = params[name].grad
        if got is None:
            raise ExerciseFailed(f"{name}.grad is None after your code; it must hold the average")
        if _close(got, want):
            continue
        n = world_size
        if not torch.isfinite(got).all():
            why = "it contains inf/NaN"
        elif _close(got, local[name]):
            why = ("it is still this rank's own gradient: it was never all-reduced with the "
                   "other ranks")  # fmt: skip
        elif _close(got, n * want):
            why = (f"it is {n}x the average: all_reduce sums over the {n} ranks, so divide "
                   "by world_size afterwards")  # fmt: skip
        elif _close(got, want / n):
            why = f"it is 1/{n} of the average: it was divided by world_size twice"
        elif _close(got, local[name] / n):
            why = ("it is this rank's gradient divided by world_size: the sum over ranks never "
                   "happened (was the all-reduce started on the tensor that is copied back?)")  # fmt: skip
        else:
            err = (got - want).abs().max().item()
            why = f"it differs from the reference by up to {err:.3g}; {advice}"
        raise ExerciseFailed(
            f"{name}.grad does not equal the gradient of the whole batch on rank "
            f"{tdist.get_rank()} of {n}: {why}"
        )


# --------------------------------------------------------------------------- 02.allreduce_grads


@exercise(
    "02.allreduce_grads",
    "Average the gradients over ranks with all-reduce (naive data parallelism)",
    hints=(
        "every rank computed the gradient of its own slice of the batch; the step needs the "
        "gradient of the whole batch, which is the mean of the ranks' gradients",
        "dist.all_reduce(t) replaces t on every rank by the sum over ranks, in place; a "
        "parameter that does not train has no gradient at all (p.grad is None)",
        "recipe: for each parameter with a gradient, all-reduce p.grad, then divide it by "
        "world_size",
    ),
)
def _verify_allreduce_grads(allreduce_gradients: Any) -> str:
    fn = _require_callable(allreduce_gradients, "allreduce_gradients(model, world_size) -> None")
    rank, n, device = _group()
    s = _setup(rank, n, device)
    local = _local_backward(s)
    call(fn, s.model, n)
    _compare_gradients(s.model, s.reference, local, n,
                       "compare with what one process computes on the whole batch")  # fmt: skip
    return (
        f"after allreduce_gradients(model, {n}) each rank holds the gradient of the whole "
        f"{n * ROWS_PER_RANK}-sequence batch, as one process would (frozen {FROZEN} skipped, "
        "tied wte/lm_head included)"
    )


# --------------------------------------------------------------------------- 02.bucket_hook


@dataclass
class _Arrival:
    bucket: int  # index of the bucket the gradient belongs to
    full: bool  # this gradient was the bucket's last one
    launched: bool  # bucket.work went from None to a handle during this call
    seen_before: int  # gradients that arrived (in all buckets) before this one


def _bucket_harness(fill: Callable[..., Any], world_size: int, backend: str) -> Any:
    """labkit's BucketedDP with its fill-and-launch step replaced by the learner's ``fill``.

    Everything else (making buckets, queueing the end-of-backward callback, waiting, averaging
    and copying back) is labkit's. The harness records when each bucket was launched, and
    never raises inside autograd: the learner's exception is kept and raised after backward,
    once labkit has launched and waited on every bucket itself, so all ranks leave backward
    having issued the same collectives (no rank is left waiting).
    """
    from labkit.parallel.dp_bucketed import BucketedDP

    class Harness(BucketedDP):
        def __init__(self) -> None:
            super().__init__(world_size, backend, bucket_cap_mb=BUCKET_CAP_MB)
            self.error: Exception | None = None
            self.arrivals: list[_Arrival] = []
            self.work_at_end: list[Any] = []
            self._index: dict[int, int] = {}
            self._count: dict[int, int] = {}

        def wrap(self, model: nn.Module) -> nn.Module:
            out = super().wrap(model)
            self._index = {id(b): k for k, b in enumerate(self.buckets)}
            return out

        def _on_grad_ready(self, p: torch.Tensor) -> None:
            if not self.callback_queued:
                self.callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self.after_backward)
            bucket, offset = self._where[id(p)]
            k = self._index[id(bucket)]
            self._count[k] = self._count.get(k, 0) + 1
            before = bucket.work
            if self.error is None:
                try:
                    fill(bucket, p, offset)
                except Exception as err:  # kept and raised after backward (see above)
                    self.error = err
            self.arrivals.append(
                _Arrival(
                    bucket=k,
                    full=self._count[k] == len(bucket.params),
                    launched=before is None and bucket.work is not None,
                    seen_before=len(self.arrivals),
                )
            )

        def after_backward(self) -> None:
            self.work_at_end = [b.work for b in self.buckets]
            for b in self.buckets:
                if b.work is not None and not callable(getattr(b.work, "wait", None)):
                    b.work = None  # not a handle: labkit sends the bucket itself
            super().after_backward()
            self._count.clear()

    return Harness()


@exercise(
    "02.bucket_hook",
    "Fill a gradient bucket and start its all-reduce asynchronously when it is full",
    hints=(
        "the hook runs once per parameter, in the order backward finishes them; it must put "
        "the gradient where the bucket's one big message will carry it, and start that message "
        "only when nothing else in the bucket is still missing",
        "p's slot in the flat bucket.buffer starts at offset and is p.numel() long; bucket.ready "
        "remembers which parameters have arrived; async_op=True makes all_reduce return a "
        "handle at once instead of waiting",
        "recipe: copy p.grad flattened into its slot, add id(p) to bucket.ready, and when every "
        "parameter of the bucket is ready set bucket.work = dist.all_reduce(bucket.buffer, "
        "async_op=True)",
    ),
)
def _verify_bucket_hook(on_grad_ready: Any) -> str:
    fn = _require_callable(on_grad_ready, "on_grad_ready(bucket, p, offset) -> None")
    rank, n, device = _group()
    s = _setup(rank, n, device)
    local = _local_backward(s, copy.deepcopy(s.model))  # to recognise unreduced gradients
    harness = _bucket_harness(fn, n, tdist.get_backend())
    model = harness.wrap(s.model)
    _, loss = model(s.x, s.y)
    loss.backward()  # labkit's after_backward has waited on every bucket by now
    err = harness.error
    if isinstance(err, NotImplementedError):
        raise err  # the stub: verify() reports the exercise as not done, with its hint
    if err is not None:
        raise ExerciseFailed(
            f"on_grad_ready(bucket, p, offset) raised {type(err).__name__}: {err}"
        ) from err

    n_buckets, total = len(harness.buckets), len(harness.arrivals)
    for k, bucket in enumerate(harness.buckets):
        mine = [a for a in harness.arrivals if a.bucket == k]
        launches = [a for a in mine if a.launched]
        size = len(bucket.params)
        work = harness.work_at_end[k]
        if work is None:
            raise ExerciseFailed(
                f"bucket {k} ({size} gradients) was full but its all-reduce was never started "
                "from on_grad_ready: bucket.work was still None when backward ended (without "
                "async_op the call blocks and returns None, so there is no handle and nothing "
                "overlaps with backward)"
            )
        if not callable(getattr(work, "wait", None)):
            raise ExerciseFailed(
                f"bucket.work of bucket {k} is {type(work).__name__} {work!r}, not the handle "
                "of an asynchronous all-reduce (something with .wait())"
            )
        if launches and not launches[0].full:
            got = mine.index(launches[0]) + 1
            raise ExerciseFailed(
                f"bucket {k}'s all-reduce started when {got} of its {size} gradients had "
                "arrived: the rest would be missing from the sum"
            )
    # The values: what labkit copied back from the buckets must be the whole-batch gradient.
    _compare_gradients(
        model,
        s.reference,
        local,
        n,
        "is each gradient copied into its own slot of the bucket, before it is marked ready?",
    )
    overlapped = sum(1 for a in harness.arrivals if a.launched and a.seen_before < total - 1)
    return (
        f"{n_buckets} buckets each started their all-reduce as soon as they were full; "
        f"{overlapped} of them while backward was still computing earlier layers, and the "
        f"averaged gradients equal the whole batch's on rank {rank} of {n}"
    )


# --------------------------------------------------------------------------- 02.zero1_shard

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
                f"shard_bounds({numel}, {r}, {n}) returned {got!r}; return a tuple of two "
                "ints (start, stop): the slice [start, stop) of the flat buffer"
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
            "are too small to cover numel"
        )
    if padded - numel >= n:
        raise ExerciseFailed(
            f"{where}: {padded - numel} padding elements, but fewer than world_size={n} are "
            "ever needed: the shards are larger than they must be"
        )
    return bounds


@exercise(
    "02.zero1_shard",
    "ZeRO-1 bookkeeping: the slice of the zero-padded flat buffer each rank owns",
    hints=(
        "reduce-scatter and all-gather move pieces of equal size, one per rank, in rank order; "
        "the padding exists so that numel need not divide evenly",
        "every shard has the same length, the smallest whole number of elements that lets "
        "world_size shards cover all numel (round up, and without floats)",
        "recipe: shard = ceil(numel / world_size) (in integers: -(-numel // world_size)); rank r "
        "owns [r · shard, (r + 1) · shard)",
    ),
)
def _verify_zero1_shard(shard_bounds: Any) -> str:
    fn = _require_callable(shard_bounds, "shard_bounds(numel, rank, world_size) -> (start, stop)")
    # 1. The rules, for every rank of every case: the same verdict on every rank, so a wrong
    #    answer stops all ranks here, before any collective below.
    for numel, sizes in SHARD_CASES:
        for n in sizes:
            _check_bounds(fn, numel, n)

    rank, n, device = _group()
    s = _setup(rank, n, device)

    # 2. The same layout as labkit's ZeRO-1 (its ShardedOptimizer flattens each parameter
    #    group of labkit.train.make_optimizer into one padded buffer).
    from labkit.config import TrainConfig
    from labkit.parallel.comm import ByteCounter
    from labkit.parallel.zero1 import ShardedOptimizer
    from labkit.train import make_optimizer

    replica = copy.deepcopy(s.model)
    sharded = ShardedOptimizer(
        replica, lambda m: make_optimizer(m, TrainConfig()), rank, n, ByteCounter(n)
    )
    for group in sharded.groups:
        total = sum(p.numel() for p in group.params)
        lo = group.shard.storage_offset() - group.flat.storage_offset()
        labkit_bounds = (lo, lo + group.shard.numel())
        mine = tuple(call(fn, total, rank, n))
        if mine != labkit_bounds:
            raise ExerciseFailed(
                f"for a parameter group of {total} elements on rank {rank} of {n}, "
                f"labkit.parallel.zero1 owns {labkit_bounds}, you gave {mine}"
            )

    # 3. Use the bounds for real: reduce-scatter this rank's flat gradient; the piece we get
    #    back, averaged, must be the whole-batch gradient's slice [start, stop).
    from labkit.parallel import comm

    _local_backward(s)
    names = [name for name, p in s.model.named_parameters() if p.requires_grad]
    params = dict(s.model.named_parameters())
    numel = sum(params[name].numel() for name in names)
    start, stop = call(fn, numel, rank, n)
    flat = torch.zeros(n * (stop - start), device=device)  # zero padding at the end
    want = torch.zeros_like(flat)
    offset = 0
    for name in names:
        k = params[name].numel()
        flat[offset : offset + k] = params[name].grad.reshape(-1)
        want[offset : offset + k] = s.reference[name].reshape(-1)
        offset += k
    piece = torch.empty(stop - start, device=device)
    comm.reduce_scatter(piece, flat, None)
    piece /= n
    if not _close(piece, want[start:stop]):
        raise ExerciseFailed(
            f"reduce-scattering the flat gradient gave rank {rank} a piece that is not "
            f"the whole-batch gradient's elements [{start}, {stop})"
        )
    cases = sum(len(sizes) for _, sizes in SHARD_CASES)
    return (
        f"shard_bounds tiles a zero-padded buffer in equal shards in {cases} "
        f"(numel, world_size) cases, matches labkit's ZeRO-1 layout, and on rank {rank} of "
        f"{n} a real reduce-scatter delivers exactly the gradient slice [{start}, {stop}) "
        f"of {numel} elements"
    )


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
    Notebooks call it through :func:`labkit.exercises.check_in_workers`.
    """
    __tracebackhide__ = True
    from labkit import launch

    name = _function_name(exercise_id)
    path = Path(path).resolve()
    if path.suffix != ".py":
        raise ValueError(f"path={str(path)!r}: the learner's file must end in .py")
    learner = load_learner_module(path.stem, path.parent)
    if is_stub(getattr(learner, name, None)):
        raise incomplete(exercise_id)
    config = {"exercises": [exercise_id], "module": path.stem, "module_dir": str(path.parent)}
    try:
        # A rank stuck in a collective that another rank never called fails in 30 s, not 60.
        with time_limit_paused():  # the job has its own limit, and ends its processes
            res = launch.run(WORKER, nproc=nproc, device=device, config=config,
                             timeout_s=timeout_s, stream=False, pg_timeout_s=30)  # fmt: skip
    except (launch.JobTimeout, launch.JobFailed) as err:
        reports = {
            r: without_failed_prefix(exercise_id, x["message"])
            for r, res in enumerate(err.result.ranks)
            for x in res.get("results", [])
            if x.get("id") == exercise_id and x.get("status") != "ok"
        }
        raise _failed(exercise_id, explain_job_error(err, reports)) from None
    return summarize(exercise_id, res.ranks), f"checked in {nproc} worker processes"


def _failed(exercise_id: str, message: str) -> ExerciseError:
    err = ExerciseFailed(f"Exercise {exercise_id} failed: {message}")
    err.exercise_id = exercise_id
    return err
