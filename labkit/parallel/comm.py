"""Collectives that count what they send: the bytes behind every data-parallel strategy.

Each strategy reports how many bytes it put on the wire per step, so the notebook can set a
*counted* number beside the *formula* (labkit.formulas) and see where they differ. Counting
follows NCCL-tests' conventions (doc/PERFORMANCE.md): a collective's message size S is

    all_reduce       the tensor reduced (the same on every rank)
    all_gather       the gathered result (n x the piece each rank contributes)
    reduce_scatter   the full input (n x the piece each rank keeps)
    broadcast        the tensor broadcast

(``sync_module_states``, the one-off broadcast of rank 0's weights every strategy makes when
it wraps a model, is not counted as a step's traffic, as DDP's own is not), and the bytes
each rank *sends* follow from S with the ring formulas (formulas.py):
all_reduce 2(n-1)/n·S, all_gather and reduce_scatter (n-1)/n·S, broadcast S.

Three ways to count, from most to least direct, each named in the results:

* our own wrappers (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast`` below),
  used by the strategies written here: the count is what we asked torch to send;
* a DDP communication hook that counts each bucket before calling the real hook
  (``counting_hook``): what DDP's reducer hands to the network;
* ``CollectiveSpy``, a dispatch mode that sees every c10d collective the process issues from
  the calling thread (FSDP2's all-gathers and reduce-scatters are issued there).

Where the backend emulates a collective the count is of what we *called*: torch's gloo runs
reduce_scatter as an all-reduce and keeps one chunk (pytorch #118911, #149869), so on gloo
the wire carries about twice the reduce-scatter formula. ``ByteCounter.summary`` says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from labkit import formulas

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
GLOO_EMULATED = {
    "reduce_scatter": "gloo runs reduce_scatter as an all-reduce plus a local chunk "
    "(pytorch #118911, #149869): the wire carries ~2x the reduce-scatter formula"
}


def nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements (its numel times element size, not its storage)."""
    return t.numel() * t.element_size()


def sent_per_rank(kind: str, message_bytes: float, world_size: int) -> float:
    """Bytes one rank sends for one collective of message size S (NCCL-tests S), ring model."""
    if kind == "all_reduce":
        return formulas.ring_allreduce_bytes_per_rank(message_bytes, world_size)
    if kind == "all_gather":
        return formulas.allgather_bytes_per_rank(message_bytes, world_size)
    if kind == "reduce_scatter":
        return formulas.reduce_scatter_bytes_per_rank(message_bytes, world_size)
    if kind == "broadcast":
        return float(message_bytes)  # pipelined chain: every rank but the last forwards S
    raise ValueError(f"kind={kind!r}: use one of {KINDS}")


class ByteCounter:
    """Message bytes and calls per kind of collective, step by step.

    ``add`` records one collective; ``end_step`` closes a training step. ``summary`` gives
    the totals of the last step (the steady state) and of every step, with the bytes each
    rank sends derived from the message bytes by the ring formulas.

    Args:
        world_size: ranks in the group (n in the formulas).
        backend: "gloo" or "nccl"; emulated collectives are flagged for gloo.
        method: how the bytes were counted, copied into the summary.
    """

    def __init__(self, world_size: int, backend: str = "gloo", method: str = "") -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: need at least 1 rank")
        self.world_size, self.backend, self.method = world_size, backend, method
        self.steps: list[dict[str, dict[str, int]]] = []
        self._current: dict[str, dict[str, int]] = {}

    def add(self, kind: str, message_bytes: int, calls: int = 1) -> None:
        """Record ``calls`` collectives of kind ``kind`` carrying ``message_bytes`` in all."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}: use one of {KINDS}")
        entry = self._current.setdefault(kind, {"calls": 0, "message_bytes": 0})
        entry["calls"] += calls
        entry["message_bytes"] += int(message_bytes)

    def calls_so_far(self) -> int:
        """Collectives recorded in the step not yet closed (all kinds)."""
        return sum(v["calls"] for v in self._current.values())

    def bytes_so_far(self) -> int:
        """Message bytes recorded in the step not yet closed (all kinds)."""
        return sum(v["message_bytes"] for v in self._current.values())

    def end_step(self) -> None:
        """Close the current step (an empty step is recorded too: no_sync steps send nothing)."""
        self.steps.append(self._current)
        self._current = {}

    def step_sent_per_rank(self, step: dict[str, dict[str, int]]) -> float:
        return sum(sent_per_rank(k, v["message_bytes"], self.world_size) for k, v in step.items())

    def summary(self) -> dict[str, Any]:
        """JSON-ready totals: per kind for the last step, and bytes sent per rank per step."""
        last = self.steps[-1] if self.steps else self._current
        notes = [GLOO_EMULATED[k] for k in last if self.backend == "gloo" and k in GLOO_EMULATED]
        return {
            "method": self.method,
            "world_size": self.world_size,
            "backend": self.backend,
            "last_step": {k: dict(v) for k, v in last.items()},
            "message_bytes_per_step": [
                sum(v["message_bytes"] for v in s.values()) for s in self.steps
            ],
            "sent_per_rank_per_step": [self.step_sent_per_rank(s) for s in self.steps],
            "sent_per_rank_last_step": self.step_sent_per_rank(last),
            "notes": notes,
        }


# --- the one-tensor all-gather and reduce-scatter, under either of torch's names -------------

# torch 2.13 renamed all_gather_into_tensor to all_gather_single and reduce_scatter_tensor to
# reduce_scatter_single; the old names remain as aliases that emit a FutureWarning and call the
# new ones (torch/distributed/distributed_c10d.py), and torch before 2.13 has only the old ones.
# Newest name first. Everything in labkit that calls, or spies on, these collectives by name
# reads these two tuples (the exercise checks of notebook 02 replace both names with spies).
ALL_GATHER_NAMES = ("all_gather_single", "all_gather_into_tensor")
REDUCE_SCATTER_NAMES = ("reduce_scatter_single", "reduce_scatter_tensor")


def _newest(names: tuple[str, ...]) -> Callable[..., Any]:
    # Looked up on every call, not once at import: a spy that replaced the attribute of
    # torch.distributed (the exercise checks do) sees the call.
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    raise AttributeError(f"torch.distributed has none of {names} (torch {torch.__version__})")


def all_gather_fn() -> Callable[..., Any]:
    """torch.distributed's all-gather into one tensor, ``fn(out, inp, group=, async_op=)``:
    ``all_gather_single`` where it exists (torch 2.13+), else ``all_gather_into_tensor``."""
    return _newest(ALL_GATHER_NAMES)


def reduce_scatter_fn() -> Callable[..., Any]:
    """torch.distributed's reduce-scatter of one tensor, ``fn(out, inp, op=, group=,
    async_op=)``: ``reduce_scatter_single`` where it exists (torch 2.13+), else
    ``reduce_scatter_tensor``."""
    return _newest(REDUCE_SCATTER_NAMES)


# --- counted collectives: count, then call torch ---------------------------------------------


def all_reduce(
    t: torch.Tensor, counter: ByteCounter | None, *, async_op: bool = False, group: Any = None
) -> Any:
    """Sum ``t`` over ranks in place; returns a work handle when ``async_op``."""
    if counter is not None:
        counter.add("all_reduce", nbytes(t))
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_gather(
    out: torch.Tensor,
    inp: torch.Tensor,
    counter: ByteCounter | None,
    *,
    async_op: bool = False,
    group: Any = None,
) -> Any:
    """Concatenate every rank's ``inp`` (same size everywhere) into ``out`` (n x larger)."""
    if counter is not None:
        counter.add("all_gather", nbytes(out))
    return all_gather_fn()(out, inp, group=group, async_op=async_op)


def reduce_scatter(
    out: torch.Tensor,
    inp: torch.Tensor,
    counter: ByteCounter | None,
    *,
    async_op: bool = False,
    group: Any = None,
) -> Any:
    """Sum ``inp`` (n x ``out``) over ranks and keep this rank's chunk in ``out``."""
    if counter is not None:
        counter.add("reduce_scatter", nbytes(inp))
    return reduce_scatter_fn()(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def broadcast(
    t: torch.Tensor, counter: ByteCounter | None, *, src: int = 0, group: Any = None
) -> Any:
    """Overwrite ``t`` on every rank with rank ``src``'s ``t`` (in place)."""
    if counter is not None:
        counter.add("broadcast", nbytes(t))
    return dist.broadcast(t, src=src, group=group)


@torch.no_grad()
def sync_module_states(
    module: torch.nn.Module,
    *,
    src: int = 0,
    group: Any = None,
    counter: ByteCounter | None = None,
) -> int:
    """Copy rank ``src``'s parameters and buffers into every rank's ``module``, in place.

    What torch's DDP does when it wraps a model (``_sync_module_states`` in
    torch/nn/parallel/distributed.py, called from ``DistributedDataParallel.__init__``): ranks
    that initialised their replicas differently (another seed, another checkpoint) start
    training from identical weights, and data parallelism keeps them identical only if they
    start so. Tensors are concatenated per (device, dtype) and sent as one broadcast each, as
    DDP coalesces them (``dist._broadcast_coalesced``). Returns the bytes broadcast.

    Raises RuntimeError when no process group is initialised: there is no rank to copy from.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "sync_module_states needs an initialised process group to copy rank "
            f"{src}'s weights from; call torch.distributed.init_process_group first (the labkit "
            "workers do so in labkit.jobs.runtime.entrypoint)"
        )
    # Tied parameters appear once in parameters(); keep each storage view once.
    tensors = [t for t in list(module.parameters()) + list(module.buffers()) if t.numel() > 0]
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    sent = 0
    for ts in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        broadcast(flat, counter, src=src, group=group)
        off = 0
        for t in ts:
            t.detach().copy_(flat[off : off + t.numel()].view_as(t))
            off += t.numel()
        sent += nbytes(flat)
    return sent


# --- DDP: count each bucket, then run the real hook --------------------------------------------


def _note_bucket(buckets: dict[int, tuple[int, int]] | None, bucket: Any) -> None:
    """Record where DDP's bucket lives: index -> (storage data_ptr, storage bytes). The
    reducer launches buckets in index order, so index 0 starts a new backward pass."""
    if buckets is None:
        return
    if bucket.index() == 0:
        buckets.clear()  # rebuilt buckets replace the previous ones
    storage = bucket.buffer().untyped_storage()
    buckets[bucket.index()] = (storage.data_ptr(), storage.nbytes())


def counting_hook(
    counter: ByteCounter,
    inner: Callable[[Any, Any], torch.futures.Future],
    wire_dtype=None,
    *,
    buckets: dict[int, tuple[int, int]] | None = None,
) -> Callable[[Any, Any], torch.futures.Future]:
    """A DDP communication hook that records the bucket it is given, then calls ``inner``.

    ``wire_dtype``: the dtype ``inner`` sends (fp16 for ``fp16_compress_hook``); None means
    the bucket's own dtype. One all-reduce per bucket, as DDP's default hook does.
    ``buckets``: a dict the hook fills with each bucket's storage (``TorchDDP.memory``).
    """

    # No annotations: DDP checks them with inspect, and this module's postponed (string)
    # annotations would not compare equal to dist.GradBucket.
    def hook(state, bucket):  # (state, dist.GradBucket) -> Future[Tensor]
        _note_bucket(buckets, bucket)
        buf = bucket.buffer()
        size = torch.empty((), dtype=wire_dtype).element_size() if wire_dtype else None
        counter.add("all_reduce", buf.numel() * (size or buf.element_size()))
        return inner(state, bucket)

    return hook


def counting_powersgd_hook(
    counter: ByteCounter,
    *,
    serialize: bool = False,
    buckets: dict[int, tuple[int, int]] | None = None,
) -> Callable:
    """PowerSGD's hook, counted by PowerSGD's own element counters.

    Before ``start_powerSGD_iter`` the hook runs a plain all-reduce of the bucket. After it,
    each bucket needs three all-reduces: the tensors left uncompressed, the P matrices and
    the Q matrices (Vogels et al. 2019). ``PowerSGDState.total_numel_after_compression``
    adds up exactly those elements while the hook splits the bucket, so its growth during
    the call is the message size. The P and Q all-reduces run in future callbacks on
    another thread, out of sight of ``CollectiveSpy``: this is the reliable count.

    ``serialize=True`` (needed on gloo) waits for each bucket's three all-reduces before
    the next bucket starts. On gloo a future completes on a backend thread, so the P and Q
    all-reduces of bucket k are issued from there while the main thread already issues
    bucket k+1's: the ranks can interleave them in different orders, and gloo aborts with
    "Received data size doesn't match expected size" (seen with torch 2.13 and several
    buckets). A CUDA future completes when work is enqueued, so the chain runs in order.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    def hook(state, bucket):  # (PowerSGDState, dist.GradBucket) -> Future[Tensor]
        _note_bucket(buckets, bucket)
        buf = bucket.buffer()
        if state.iter < state.start_powerSGD_iter:
            counter.add("all_reduce", nbytes(buf))
            return psgd.powerSGD_hook(state, bucket)
        before = state.total_numel_after_compression
        fut = psgd.powerSGD_hook(state, bucket)
        sent = state.total_numel_after_compression - before
        counter.add("all_reduce", sent * buf.element_size(), calls=3)
        if serialize:
            fut.wait()  # no overlap across buckets, but one order of collectives on all ranks
        return fut

    return hook


# --- seeing every collective a library issues ------------------------------------------------

# c10d operator -> (kind, index of the argument whose bytes are S in NCCL-tests' convention).
# The dispatcher's op names, not the Python API's: they did not change with torch 2.13's rename.
# mesh.MeshSpy counts a subset of them by mesh dimension.
C10D_OPS = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0),
}


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a collective's argument: a tensor, or lists of them (nested,
    as ``allgather_``'s output is); anything else counts 0."""
    if isinstance(obj, torch.Tensor):
        return nbytes(obj)
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(o) for o in obj)
    return 0


class CollectiveSpy(TorchDispatchMode):
    """Count every c10d collective issued on this thread while active.

    Since torch 2.0 ``torch.distributed`` calls go through the dispatcher as ``c10d::*`` ops
    (that is how ``CommDebugMode`` sees them), so a dispatch mode sees FSDP2's and DDP's
    collectives as well as ours. It cannot see collectives that a future callback issues on
    a backend thread (PowerSGD's second and third all-reduce), and it adds Python overhead
    to every operator while active: use it to count, not while timing.
    """

    def __init__(self, counter: ByteCounter) -> None:
        super().__init__()
        self.counter = counter
        self.unknown: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func._opname
            if name in C10D_OPS:
                kind, i = C10D_OPS[name]
                self.counter.add(kind, tensor_bytes(args[i]))
            elif name not in ("barrier", "monitored_barrier_"):
                self.unknown.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def spying(counter: ByteCounter | None) -> Iterator[None]:
    """``with spying(counter):`` counts collectives via ``CollectiveSpy``; None: no-op."""
    if counter is None:
        yield
        return
    with CollectiveSpy(counter):
        yield
