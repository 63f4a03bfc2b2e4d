"""What the three planted bottlenecks share: their results, the step they time, their models.

Apart from the bottlenecks themselves (:mod:`.data_loading`, :mod:`.launch_overhead`,
:mod:`.host_sync`) because each of them measures the same way: :func:`phased_step` (forward,
backward and optimizer in named phases, in the run's precision) is the step every one of
them times, :func:`fresh_models` gives each way of training its own copy of one initialised
GPT, and the results are :class:`Measured` samples paired as :class:`BeforeAfter`.
:func:`annotated_step` is notebook 06's step (the data phase too), which the exercise checks
and ``labkit record-profile`` profile.
"""

from __future__ import annotations

import copy
import html
import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from labkit import timing, verdict
from labkit.config import RunConfig
from labkit.model import GPT
from labkit.profiling.phases import phase
from labkit.tables import html_table
from labkit.train import autocast, make_optimizer, resolve_device


@dataclass(frozen=True)
class Measured:
    """Per-step samples of one way of training, measured on this machine.

    ``step_s`` holds one entry per counted sample: seconds per training step (a whole step, or
    the mean over a block of steps when ``method`` says so). Warm-up steps are not in it.
    """

    name: str
    step_s: tuple[float, ...]
    """Seconds per step, one per counted sample."""
    tokens_per_step: int
    """Tokens one step trains on (batch x seq_len)."""
    device: str
    method: str
    """How the samples were taken (clock, synchronisation, what one sample covers)."""
    data_s: tuple[float, ...] = ()
    """Loader runs only: the part of each step spent in the ``data`` phase (waiting for the
    batch and issuing its copy to the device); empty elsewhere."""
    losses: tuple[float, ...] = ()
    """Training loss of every step run, warm-up included, in order."""
    settings: Mapping[str, Any] = field(default_factory=dict)
    """The knobs this way was run with (num_workers, mode, ...)."""

    def __post_init__(self) -> None:
        if not self.step_s:
            raise ValueError(f"{self.name!r} has no samples: measure at least one step")
        if self.data_s and len(self.data_s) != len(self.step_s):
            raise ValueError(f"{self.name!r}: {len(self.data_s)} data samples for "
                             f"{len(self.step_s)} steps; give one per step or none")  # fmt: skip

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def compute_s(self) -> tuple[float, ...]:
        """Loader runs: each step minus its data phase (forward, backward, optimizer)."""
        return tuple(s - d for s, d in zip(self.step_s, self.data_s, strict=True))

    @property
    def data_share(self) -> float | None:
        """Fraction of the measured time spent in the data phase; None when not measured."""
        if not self.data_s:
            return None
        total = sum(self.step_s)
        return sum(self.data_s) / total if total > 0 else math.nan

    @property
    def tokens_per_s(self) -> float:
        """Throughput from the median step: tokens_per_step / median(step_s). The median,
        not the mean, so one step slowed by another process on a shared machine moves it
        little."""
        return self.tokens_per_step / self.median_s if self.median_s > 0 else math.nan


@dataclass(frozen=True, kw_only=True)
class BeforeAfter:
    """A bottleneck's ``before`` (planted) and ``after`` (fixed) measurements, and every
    variant measured on the way (``variants`` holds before and after too)."""

    bottleneck: str
    before: Measured
    after: Measured
    variants: tuple[Measured, ...]
    note: str
    """What this measurement can and cannot show on this device, in a sentence or two."""

    @property
    def device(self) -> str:
        return self.after.device

    @property
    def speedup(self) -> float:
        """Median step time before / after: above 1 means the fix made steps faster."""
        return self.before.median_s / self.after.median_s

    def comparison(self, tolerance: float = verdict.DEFAULT_TOLERANCE) -> verdict.Comparison:
        """The verdict rule of :mod:`labkit.verdict` on the two samples of step times: its
        ``sentence`` says faster, agree, or too noisy to tell, with the spread printed."""
        return verdict.compare_times(self.before.step_s, self.after.step_s,
                                     names=(self.before.name, self.after.name),
                                     tolerance=tolerance)  # fmt: skip

    def rows(self) -> list[dict[str, Any]]:
        """One dict per variant, for a table: name, median step, tokens/s, data share."""
        return [{"way": m.name, "median_step_s": m.median_s, "tokens_per_s": m.tokens_per_s,
                 "data_share": m.data_share, "samples": len(m.step_s), "device": m.device}
                for m in self.variants]  # fmt: skip

    def _table(self) -> list[list[str]]:
        head = ["way", "step (median)", "tokens/s", "data wait", "samples"]
        body = [[m.name, timing.format_seconds(m.median_s), f"{m.tokens_per_s:,.0f}",
                 "-" if m.data_share is None else f"{100 * m.data_share:.0f}%",
                 str(len(m.step_s))] for m in self.variants]  # fmt: skip
        return [head, *body]

    def _header(self) -> str:
        return f"{self.bottleneck} on {self.device}: {self.after.method}"

    def _footer(self) -> list[str]:
        return [f"after/before speed-up: {self.speedup:.2f}x (median step {self.before.name} "
                f"/ median step {self.after.name})", *str(self.comparison()).splitlines(),
                self.note]  # fmt: skip

    def __str__(self) -> str:
        rows = self._table()
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        table = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        return "\n".join([self._header(), *table, *self._footer()])

    def _repr_html_(self) -> str:
        head, *body = self._table()
        foot = "".join(f"<p>{html.escape(line)}</p>" for line in self._footer())
        return f"<p><b>{html.escape(self._header())}</b></p>{html_table(head, body)}{foot}"


def step_tokens(cfg: RunConfig) -> int:
    """Tokens one training step of ``cfg`` trains on: micro-batch x sequence length."""
    return cfg.train.micro_batch * cfg.model.seq_len


def phased_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                y: torch.Tensor, *, dtype: str = "float32") -> torch.Tensor:
    """Forward, backward, optimizer, each in its named phase; returns the (device) loss.

    The same arithmetic as ``labkit.train.train_step`` with one micro-batch and no clipping,
    opened up so that a profiler trace shows the three phases apart. ``dtype`` is the run's
    (``TrainConfig.dtype``): the forward and the loss run under ``labkit.train.autocast``, as
    in ``train_step``; float32 turns autocast off. The backward stays outside autocast (its
    operators run in the dtype autocast chose for their forward ones: PyTorch AMP docs). There
    is no GradScaler: a float16 step runs float16's kernels, but its small gradients are not
    protected from underflow, which a profile of a few steps does not need.
    """
    with phase("forward"), autocast(x.device, dtype):
        _, loss = model(x, y)
    with phase("backward"):
        loss.backward()
    with phase("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def annotated_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                   next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                   dtype: str = "float32") -> torch.Tensor:
    """One training step in precision ``dtype``, each of its four phases (data, forward,
    backward, optimizer) in its own named range: notebook 06's step, the reference of its
    exercise 06.annotate, and what ``labkit record-profile`` profiles on a GPU."""
    with phase("data"):
        x, y = next_batch()
    return phased_step(model, optimizer, x, y, dtype=dtype)


def run_device(cfg: RunConfig, device: torch.device | str | None) -> torch.device:
    """``device`` if given, else the run's own (``cfg.train.device``), resolved."""
    return resolve_device(cfg.train.device) if device is None else resolve_device(str(device))


def fresh_models(cfg: RunConfig, device: torch.device, n: int) -> list[tuple[nn.Module, Any]]:
    """``n`` copies of one freshly initialised GPT (same weights), each with its own AdamW."""
    torch.manual_seed(cfg.train.seed)
    base = GPT(cfg.model).to(device).train()
    out = []
    for _ in range(n):
        model = copy.deepcopy(base)
        out.append((model, make_optimizer(model, cfg.train)))
    return out

