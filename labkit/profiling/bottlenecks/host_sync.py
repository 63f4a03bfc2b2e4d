"""Bottleneck 3, host-device synchronisation: ``loss.item()`` every step, against every K.

``loss.item()`` every step makes the CPU wait for the GPU to drain its queue, so the CPU
cannot run ahead and launch the next step's kernels. :func:`measure_sync` times both loops on
the same batches. A CPU has no such queue, and the result says so (``asynchronous=False``)
instead of showing an effect it cannot have.

Sources: CUDA semantics, asynchronous execution
https://docs.pytorch.org/docs/stable/notes/cuda.html#asynchronous-execution; the performance
tuning guide ("avoid unnecessary CPU-GPU synchronization")
https://docs.pytorch.org/tutorials/recipes/recipes/tuning_guide.html.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from labkit import timing
from labkit.config import RunConfig
from labkit.data import get_batch, load_splits
from labkit.profiling.bottlenecks.common import (
    BeforeAfter,
    Measured,
    fresh_models,
    phased_step,
    run_device,
    step_tokens,
)
from labkit.validate import whole


@dataclass(frozen=True, kw_only=True)
class SyncResult(BeforeAfter):
    """``loss.item()`` (and a printed line) every step, against reading losses every K steps."""

    read_every: int
    """K: the "after" loop reads its losses once per this many steps."""
    asynchronous: bool
    """Whether this device queues work asynchronously (CUDA), so a sync can cost anything."""
    lines: tuple[str, ...]
    """The lines the every-step loop formatted (and printed, if asked)."""


def measure_sync(cfg: RunConfig, *, device: torch.device | str | None = None,
                 read_every: int = 4, rounds: int = 10, warmup: int = 1,
                 print_fn: Callable[[str], None] | None = None) -> SyncResult:
    """Train with ``loss.item()`` + a formatted line every step, then reading every K steps.

    Two copies of one initialised GPT train in ``cfg.train.dtype`` on the same pre-made
    batches (already on the device, so no data loading is timed). One block is
    ``read_every`` steps:

    * before: each step calls ``loss.item()`` and formats a log line (printed if ``print_fn``);
    * after: each step keeps ``loss.detach()`` on the device; one ``torch.stack(...).tolist()``
      at the block's end reads all K (one synchronisation per K steps).

    A sample is the block's wall time / K, the device synchronised at the block's end, so the
    work queued by the "after" loop is counted. The blocks alternate (before, after; after,
    before; ...), ``warmup`` rounds uncounted. Both loops compute the same losses.

    On a CPU every operator finishes before Python continues: there is no queue to drain, and
    ``.item()`` waits for nothing. The result says so (``asynchronous=False``) rather than show
    an effect this device cannot have.
    """
    read_every = whole("read_every", read_every, low=1)
    device = run_device(cfg, device)
    (m_before, o_before), (m_after, o_after) = fresh_models(cfg, device, 2)
    train, _ = load_splits()
    g = torch.Generator().manual_seed(cfg.train.seed)
    blocks = warmup + rounds
    batches = [get_batch(train, cfg.train.micro_batch, cfg.model.seq_len, g, device)
               for _ in range(blocks * read_every)]  # fmt: skip
    losses: dict[str, list[float]] = {"before": [], "after": []}
    lines: list[str] = []

    def every_step() -> float:
        done = len(losses["before"])
        timing.synchronize(device)
        t0 = time.perf_counter()
        for k in range(read_every):
            x, y = batches[done + k]
            loss = phased_step(m_before, o_before, x, y, dtype=cfg.train.dtype)
            value = loss.item()  # the planted sync: the CPU waits here for the device
            line = f"step {done + k + 1:>4}  loss {value:.4f}"
            lines.append(line)
            if print_fn is not None:
                print_fn(line)
            losses["before"].append(value)
        timing.synchronize(device)
        return (time.perf_counter() - t0) / read_every

    def every_k() -> float:
        done = len(losses["after"])
        timing.synchronize(device)
        t0 = time.perf_counter()
        pending = []
        for k in range(read_every):
            x, y = batches[done + k]
            pending.append(phased_step(m_after, o_after, x, y, dtype=cfg.train.dtype))  # on the device
        losses["after"].extend(torch.stack(pending).tolist())  # one sync for K steps
        timing.synchronize(device)
        return (time.perf_counter() - t0) / read_every

    before_name = "loss.item() + log line every step"
    after_name = f"losses read every {read_every} steps"
    samples = timing.alternate({before_name: every_step, after_name: every_k},
                               rounds=rounds, warmup=warmup)  # fmt: skip
    tokens = step_tokens(cfg)
    method = (f"perf_counter per block of {read_every} steps / {read_every}, device "
              "synchronised at each block's end")  # fmt: skip
    before = Measured(name=before_name, step_s=tuple(samples[before_name]),
                      tokens_per_step=tokens, device=str(device), method=method,
                      losses=tuple(losses["before"]), settings={"read_every": 1})  # fmt: skip
    after = Measured(name=after_name, step_s=tuple(samples[after_name]), tokens_per_step=tokens,
                     device=str(device), method=method, losses=tuple(losses["after"]),
                     settings={"read_every": read_every})  # fmt: skip
    asynchronous = device.type == "cuda"
    if asynchronous:
        note = ("On CUDA .item() blocks the CPU until the GPU has drained its queue: in the "
                "trace, a cudaStreamSynchronize / device-to-host copy on the CPU row every step, "
                "and a GPU gap while the CPU launches the next step.")
    else:
        note = (f"On {device.type} there is no asynchronous queue: each operator has finished "
                "before Python continues, so .item() waits for nothing and the two loops "
                "should agree; any difference is noise or the cost of the log line. The "
                "effect exists only where work is queued, as on a GPU.")
    return SyncResult(bottleneck="host-device synchronisation", before=before, after=after,
                      variants=(before, after), note=note, read_every=read_every,
                      asynchronous=asynchronous, lines=tuple(lines))  # fmt: skip
