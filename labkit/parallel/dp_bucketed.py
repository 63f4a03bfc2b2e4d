"""Bucketed, overlapped data parallelism: all-reduce gradients while backward still runs.

Two fixes to ``dp_naive`` (PyTorch DDP paper, Li et al. VLDB 2020, section 3.2):

* **buckets**: gradients are copied into a few flat buffers of about ``bucket_cap_mb`` each,
  so the network sees a few large messages instead of one small message per tensor;
* **overlap**: a bucket's all-reduce starts (``async_op=True``) as soon as every gradient in
  it is ready, while autograd is still computing the gradients of earlier layers.

Backward produces gradients roughly in reverse order of the forward pass, so buckets are
filled from the last parameters to the first. At the end of backward we wait on every
handle, then copy the averaged buckets back into ``.grad`` before the optimizer steps.
Like ``NaiveDP`` (and torch's DDP), ``wrap`` first broadcasts rank 0's parameters and buffers.

    strategy = BucketedDP(world_size, bucket_cap_mb=25.0)
    model = strategy.wrap(model)            # rank 0's weights everywhere; buckets and hooks
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from labkit.parallel import comm
from labkit.parallel.dp_naive import NaiveDP


@dataclass
class Bucket:
    """Parameters whose gradients travel together in one flat buffer."""

    params: list[nn.Parameter]
    buffer: torch.Tensor  # (sum of numel,) flat gradients, in the order of ``params``
    offsets: list[int]
    ready: set[int] = field(default_factory=set)  # id() of parameters whose grad is copied
    work: object | None = None  # handle of this step's all-reduce; None until it starts
    done: object | None = None  # the previous step's handle, kept on purpose (after_backward)


def make_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[Bucket]:
    """Group ``params`` (in the given order) into buckets of at most ``cap_bytes`` each.

    A parameter larger than the cap gets a bucket of its own; ``cap_bytes=0`` gives every
    parameter its own bucket (one all-reduce per gradient, overlapped all the same).
    """
    groups: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in params:
        b = p.numel() * p.element_size()
        if groups[-1] and size + b > cap_bytes:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += b
    buckets = []
    for group in groups:
        offsets, total = [], 0
        for p in group:
            offsets.append(total)
            total += p.numel()
        buf = torch.zeros(total, dtype=group[0].dtype, device=group[0].device)
        buckets.append(Bucket(group, buf, offsets))
    return buckets


class BucketedDP(NaiveDP):
    """Gradient hooks fill buckets; each full bucket's all-reduce starts at once (async)."""

    name = "bucketed"
    counting = "counted by our all_reduce wrapper (one call per bucket)"

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        bucket_cap_mb: float = 25.0,
        *,
        group: Any = None,
        sync_in_backward: bool = True,
    ):
        super().__init__(world_size, backend, group=group, sync_in_backward=sync_in_backward)
        self.cap_bytes = int(bucket_cap_mb * 2**20)
        self.buckets: list[Bucket] = []
        self._where: dict[int, tuple[Bucket, int]] = {}  # id(param) -> (bucket, offset)

    def wrap(self, model: nn.Module) -> nn.Module:
        """Start every rank from rank 0's weights, make the buckets, hook every parameter."""
        # As DDP does on construction (see NaiveDP.wrap).
        comm.sync_module_states(model, src=self.src, group=self.group)
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Reverse order: the last layers' gradients are ready first, so their bucket fills first.
        self.buckets = make_buckets(self.params[::-1], self.cap_bytes)
        self._where = {
            id(p): (b, off)
            for b in self.buckets
            for p, off in zip(b.params, b.offsets, strict=True)
        }
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        return model

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        """Runs when ``p.grad`` is final for this backward pass (accumulation included)."""
        if not self.require_sync:
            return
        self._on_any_grad_ready()  # after_backward once the whole graph is done
        bucket, off = self._where[id(p)]
        bucket.buffer[off : off + p.numel()].copy_(p.grad.reshape(-1))
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        bucket.work = comm.all_reduce(
            bucket.buffer, self.bytes_counter, async_op=True, group=self.group
        )

    def after_backward(self) -> None:
        self.callback_queued = False
        for bucket in self.buckets:
            if bucket.work is None:  # some parameter got no gradient: send what we have
                for p, off in zip(bucket.params, bucket.offsets, strict=True):
                    if id(p) not in bucket.ready:
                        bucket.buffer[off : off + p.numel()].zero_()
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()  # type: ignore[union-attr]
            bucket.buffer /= self.world_size  # sum -> mean
            for p, off in zip(bucket.params, bucket.offsets, strict=True):
                g = bucket.buffer[off : off + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
            # Keep the finished handle one step rather than drop it (issue 31's SIGABRT). A
            # Work started in backward captures the thread's state (``tls_`` of gloo's
            # AsyncWork, torch 2.13 ProcessGroupGloo.hpp), which then holds a Python object
            # (the contextvars copy _engine_run_backward stashes, torch/autograd/graph.py).
            # gloo's worker thread lets go of the Work just after wait() returns; when ours
            # was gone first, the worker freed that object and needed the GIL, and at
            # interpreter exit CPython ends such a thread inside a C++ destructor:
            # "terminate called without an active exception". Now the training thread
            # releases it, at the next step or when the strategy is collected.
            bucket.done, bucket.work = bucket.work, None
            bucket.ready.clear()
