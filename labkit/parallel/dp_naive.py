"""Naive data parallelism: after backward, all-reduce every gradient, one at a time.

Every rank holds the whole model and computes gradients on its own slice of the batch. The
mean of the ranks' gradients is the gradient of the whole batch (each rank's loss is a mean
over equally many sequences), so after

    grad <- (grad_0 + grad_1 + ... + grad_{n-1}) / n

every rank takes the same optimizer step and the replicas never drift apart, provided they
start equal: ``wrap`` broadcasts rank 0's parameters and buffers first, as torch's DDP does
(``_sync_module_states``), so ranks seeded differently still train one model.

    strategy = NaiveDP(world_size)          # inside a process group
    model = strategy.wrap(model)            # rank 0's weights everywhere; hooks registered
    loss.backward()                         # gradients averaged when backward returns

Naive because communication waits for the whole backward to finish and then sends one
message per parameter tensor: many small messages (each pays a latency) and no overlap with
compute. ``dp_bucketed`` fixes both; compare the two in notebook 02 (picotron keeps the same
pair side by side in ``data_parallel.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from labkit.parallel import comm
from labkit.parallel.dp_config import Strategy


class NaiveDP(Strategy):
    """All-reduce each gradient after backward; ``no_sync`` skips it (accumulation).

    ``sync_in_backward=False``: nothing is queued on the autograd engine, and the caller runs
    ``after_backward()`` itself once backward has returned (the interface of notebook 02's
    exercises, ``finish_gradient_sync()``, whose checks use these classes as the reference).
    """

    name = "naive"
    counting = "counted by our all_reduce wrapper (one call per gradient tensor)"

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        *,
        group: Any = None,
        sync_in_backward: bool = True,
    ) -> None:
        super().__init__(world_size, backend, group=group)
        self.params: list[nn.Parameter] = []
        self.require_sync = True  # False inside no_sync(): gradients stay local
        self.sync_in_backward = sync_in_backward
        self.callback_queued = False

    def _on_any_grad_ready(self, _: torch.Tensor | None = None) -> None:
        """Make ``after_backward`` run once this backward pass has finished.

        A hook on each parameter calls this when its gradient is final for this backward; the
        first call queues a callback that the autograd engine runs after the whole graph is
        done (what DDP's reducer and picotron's ``DataParallelBucket`` do).
        """
        if self.sync_in_backward and self.require_sync and not self.callback_queued:
            self.callback_queued = True
            # Private API, not for production: _execution_engine.queue_callback is what DDP's
            # own Python side uses (torch/nn/parallel/distributed.py) and has no public,
            # stable equivalent; it may change between torch releases.
            torch.autograd.Variable._execution_engine.queue_callback(self.after_backward)

    def wrap(self, model: nn.Module) -> nn.Module:
        """Start every rank from rank 0's weights, then hook every trainable parameter."""
        # As DDP does on construction: ranks seeded differently would otherwise train n
        # different models on n shards of the data. Not counted in bytes_counter: it is
        # sent once, not per step (DDP's own broadcast is not seen by its comm hooks either).
        comm.sync_module_states(model, src=self.src, group=self.group)
        # parameters() yields a tied tensor once; frozen ones have no gradient to share.
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_any_grad_ready)
        return model

    def after_backward(self) -> None:
        self.callback_queued = False
        for p in self.params:
            if p.grad is None:  # unused this step; every rank must still join the collective
                p.grad = torch.zeros_like(p)
            comm.all_reduce(p.grad, self.bytes_counter, group=self.group)  # sum, in place
            p.grad /= self.world_size  # sum -> mean (gloo lacks ReduceOp.AVG before 2.8)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:  # type: ignore[override]
        """Backward passes inside keep their gradients local (they accumulate in .grad)."""
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = True
