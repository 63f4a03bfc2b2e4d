"""How a check of notebook 02 sees *when* the learner's collectives happened.

While the learner's code runs, the collectives of ``torch.distributed`` are replaced by thin
wrappers that record each call (kind, bytes, ``async_op``, whether backward was still running,
how many gradients were ready) and hand out handles that record when they are waited on. The
learner's code is unchanged; it must call the collectives as ``dist.<name>``. Separate from the
checks: it knows nothing of any exercise, only of calls and waits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from labkit.parallel import comm

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
# renamed all_gather_into_tensor to all_gather_single, and the old names still work; the
# names are comm's, the one table of that rename)
_SPIED = {
    "all_reduce": "all_reduce",
    "reduce_scatter": "reduce_scatter",
    **dict.fromkeys(comm.REDUCE_SCATTER_NAMES, "reduce_scatter"),
    "all_gather": "all_gather",
    **dict.fromkeys(comm.ALL_GATHER_NAMES, "all_gather"),
    "broadcast": "broadcast",
}

class _Handle:
    """A collective's work handle that remembers when it was first waited on."""

    def __init__(self, work: Any, record: _Call, spy: DistSpy) -> None:
        self._work, self._record, self._spy = work, record, spy

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        if not any(c is self._record for c in self._spy.calls):
            self._spy.stale_waits += 1  # a handle of an earlier step, waited on again
        if self._record.waited is None:
            self._record.waited = self._spy.phase
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # is_completed, get_future, ...
        return getattr(self._work, name)


class DistSpy:
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
            record = _Call(kind, comm.tensor_bytes(tensor), async_op, self.phase, self.ready)
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
    def active(self) -> Iterator[DistSpy]:
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


