"""Name the phases of a training step once, and see the names in every profiler.

    from labkit.profiling import phase
    with phase("forward"):
        loss = model(x, y)

``phase`` opens two ranges with the same name around the block:

- a ``torch.profiler.record_function`` range, which the PyTorch profiler records as a
  ``user_annotation`` event (a row in ``key_averages()``, a bar in the Chrome trace);
- an NVTX range (NVIDIA Tools Extension), which Nsight Systems draws on its NVTX row and
  ``nsys stats --report nvtx_sum`` totals. On CUDA builds it goes through ``torch.cuda.nvtx``;
  without CUDA, through the ``nvtx`` package from PyPI if it is installed (it works without a
  GPU); else there is no NVTX range and :func:`nvtx_backend` says why.

So one annotation serves both tools, and the phase names a learner reads in the PyTorch
trace are the ones Nsight shows. Outside an active profiler either range costs about a
microsecond (record_function checks a flag; an NVTX push with no tool attached is a no-op:
https://nvidia.github.io/NVTX/).

The four phases of a step, in order, are :data:`PHASES`; a data-parallel step adds
``"communication"`` around collectives the training code issues itself.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import torch

PHASES: tuple[str, ...] = ("data", "forward", "backward", "optimizer")
COMMUNICATION = "communication"


@functools.cache
def _nvtx_push_pop() -> tuple[str, Callable[[str], Any] | None, Callable[[], Any] | None]:
    """(backend name, push, pop). Looked up on first use, not at import (no CUDA init)."""
    if torch.cuda.is_available():
        return "torch.cuda.nvtx", torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    if importlib.util.find_spec("nvtx") is not None:
        import nvtx  # the PyPI package: NVTX without CUDA

        return "nvtx (PyPI)", nvtx.push_range, nvtx.pop_range
    return "none", None, None


def nvtx_backend() -> str:
    """Which NVTX library :func:`phase` uses, and, when none, why and how to get one."""
    name, _, _ = _nvtx_push_pop()
    if name != "none":
        return name
    return (
        "none: this torch has no CUDA (torch.cuda.nvtx needs it) and the `nvtx` package is "
        "not installed; `pip install nvtx` adds NVTX ranges on a CPU-only machine"
    )


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """A ``record_function`` range and an NVTX range, both called ``name``, around the block."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"phase name={name!r}: give a non-empty string such as 'forward'")
    _, push, pop = _nvtx_push_pop()
    with torch.profiler.record_function(name):
        if push is None:
            yield
            return
        push(name)
        try:
            yield
        finally:
            pop()
