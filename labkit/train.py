"""The one training step every lab uses, and a short loop around it.

:func:`train_step` is deliberately the only place where forward, backward and optimiser
step meet. Labs change *how* it runs through its arguments (device, autocast dtype,
gradient accumulation, a ``no_sync``-style context for data parallelism) and never copy
it, so a number measured in one notebook is comparable with one measured in another.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import nn

from labkit import config, dtypes
from labkit.config import RunConfig, TrainConfig
from labkit.timing import Timer

# The torch dtype of each dtype a run may train in (config.DTYPES), from labkit.dtypes' table.
DTYPES = {name: dtypes.torch_dtype(name) for name in config.DTYPES}

Batch = tuple[torch.Tensor, torch.Tensor]


def resolve_device(device: str = "auto") -> torch.device:
    """'auto' means the first CUDA GPU if there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} is not allowed here: this machine has no CUDA GPU "
            "(or this torch is a CPU build); use device='cpu' or 'auto'"
        )
    return resolved


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """Autocast to ``dtype`` on ``device``; float32 means autocast off.

    Autocast runs matmuls and convolutions in the low-precision dtype while keeping
    reductions such as softmax and the loss in float32 (PyTorch AMP op lists).
    """
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[dtype])


def make_optimizer(model: nn.Module, cfg: TrainConfig, *, foreach: bool | None = None,
                   fused: bool | None = None) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (biases and LayerNorm gains are exempt).

    ``foreach``/``fused``: AdamW's implementation (None: torch's own choice, foreach for CUDA
    tensors and a loop over the tensors otherwise; https://docs.pytorch.org/docs/stable/optim.html)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=cfg.adam_eps,
                             foreach=foreach, fused=fused)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of optimiser step ``step`` (counted from 1) under ``cfg``'s schedule.

    nanoGPT's ``get_lr`` (karpathy/nanoGPT, train.py), counted from step 1: a linear warm-up
    from lr/warmup_steps to lr over ``warmup_steps`` steps, then, if ``min_lr`` is set, a
    cosine from lr down to min_lr at step ``cfg.steps``.

    Why a warm-up and a modest peak: Adam moves each weight by at most about lr per step,
    and by about lr whenever its gradient keeps its sign, however small that gradient is
    (Kingma & Ba 2015, section 2.1). A fresh model first learns the
    byte frequencies, one prediction for every position, so each layer sees nearly the same
    input everywhere; then the steps on a row's fan_in weights share their signs and move
    its output by about lr x fan_in at once (why muP scales Adam's rate as 1/fan_in: Yang et
    al., "Tensor Programs V", arXiv:2203.03466). The lab preset at a constant 3e-3 built a
    context-free vector 27 times the token-dependent part of its residual stream by step 7;
    LayerNorm rescales whatever that sum is, and at step 9 one update turned the vector
    round: the model predicted the rarest bytes, and the loss leapt from 3.5 to 9.7, above
    ln 256, for four steps. See the presets in labkit.config for the rates that avoid it.
    """
    if step < 1:
        raise ValueError(f"step={step!r} is not allowed: optimiser steps count from 1")
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.min_lr is None:
        return cfg.lr
    span = cfg.steps - cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / span) if span > 0 else 1.0
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every parameter group's learning rate (what nanoGPT does before each step)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


class Scaler(Protocol):
    """What ``train_step`` needs of a loss scaler: ``torch.amp.GradScaler``, or
    ``labkit.precision.ManualScaler`` (the same algorithm, written out to be read)."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor: ...
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None: ...
    def step(self, optimizer: torch.optim.Optimizer) -> Any: ...
    def update(self) -> None: ...


def make_scaler(device: torch.device, dtype: str) -> torch.amp.GradScaler | None:
    """A loss scaler for float16 only: bfloat16 has float32's exponent range and needs none."""
    return torch.amp.GradScaler(device.type) if dtype == "float16" else None


@dataclass(frozen=True)
class StepStats:
    """What one optimiser step did, as measured on this rank."""

    loss: float
    """Mean training loss over the step's micro-batches."""
    seconds: float
    """Wall time of the whole step, device synchronised at both ends."""
    tokens: int
    """Tokens this rank processed in the step (micro-batches x batch x seq_len)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.nan


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[Batch],
    *,
    device: torch.device,
    dtype: str = "float32",
    scaler: Scaler | None = None,
    grad_clip: float | None = None,
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> StepStats:
    """One optimiser step over ``batches`` (one micro-batch each: gradient accumulation).

    Each micro-batch loss is divided by the number of micro-batches, so the accumulated
    gradient equals the gradient of the mean loss over all of them: k accumulated
    micro-batches of size b give the same update as one batch of size k*b.

    ``no_sync``, if given, is entered for every micro-batch but the last (as DDP's
    ``model.no_sync``): gradients then stay local until the final backward, which
    communicates once per step instead of once per micro-batch.
    """
    if not batches:
        raise ValueError("batches is empty: pass one (x, y) pair per micro-batch")
    n = len(batches)
    total = 0.0
    tokens = 0
    with Timer(device) as timer:
        for i, (x, y) in enumerate(batches):
            # Asynchronous only from pinned host memory (train() pins on CUDA: pin_batches).
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync_ctx = no_sync() if (no_sync is not None and i < n - 1) else contextlib.nullcontext()
            with sync_ctx:
                with autocast(device, dtype):
                    _, loss = model(x, y)
                loss = loss / n
                (scaler.scale(loss) if scaler is not None else loss).backward()
            total += loss.detach()
            tokens += x.numel()
        if grad_clip is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = float(total)  # one host sync per step, inside the timed region
    return StepStats(loss=loss_value, seconds=timer.elapsed_s, tokens=tokens)


@torch.no_grad()
def evaluate(model: nn.Module, batches: Sequence[Batch], *, device: torch.device,
             dtype: str = "float32") -> float:
    """Mean loss over ``batches`` with the model in eval mode (restored afterwards)."""
    was_training = model.training
    model.eval()
    losses = []
    for x, y in batches:
        with autocast(device, dtype):
            _, loss = model(x.to(device), y.to(device))
        losses.append(float(loss))
    model.train(was_training)
    return sum(losses) / len(losses)


@dataclass
class History:
    """Per-step measurements of a run, ready for plots and tables."""

    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    """Learning rate the step used (:func:`lr_at`)."""
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    data_seconds: list[float] = field(default_factory=list)
    """Host time to draw (and on CUDA pin) the step's batches, outside the step's timer; NaN
    where the caller did not measure it."""
    iteration_seconds: list[float] = field(default_factory=list)
    """Wall time of the whole iteration: the batches, then the synchronised step (evaluation
    and callbacks excluded); NaN where the caller did not measure it."""

    def record(self, step: int, stats: StepStats, *, lr: float, data_s: float | None = None,
               iteration_s: float | None = None) -> None:
        self.steps.append(step)
        self.loss.append(stats.loss)
        self.seconds.append(stats.seconds)
        self.tokens.append(stats.tokens)
        self.lr.append(lr)
        self.data_seconds.append(math.nan if data_s is None else data_s)
        self.iteration_seconds.append(math.nan if iteration_s is None else iteration_s)

    def tokens_per_s(self, skip: int = 1) -> float:
        """Steady-state throughput: total tokens / total time, skipping warm-up steps."""
        skip = min(skip, max(len(self.steps) - 1, 0))
        secs = sum(self.seconds[skip:])
        return sum(self.tokens[skip:]) / secs if secs > 0 else math.nan

    def iteration_tokens_per_s(self, skip: int = 1) -> float:
        """Throughput over whole iterations (data loading included), skipping warm-up steps;
        NaN if any iteration in the range was not timed."""
        skip = min(skip, max(len(self.steps) - 1, 0))
        secs = sum(self.iteration_seconds[skip:])
        return sum(self.tokens[skip:]) / secs if secs > 0 else math.nan

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def pin_batches(batches: Sequence[Batch], device: torch.device) -> list[Batch]:
    """``batches`` in page-locked host memory when ``device`` is a CUDA GPU, else unchanged.

    ``.to(device, non_blocking=True)`` is asynchronous only from pinned memory: from ordinary
    (pageable) memory CUDA first copies into a pinned staging buffer, with the host waiting
    (PyTorch tutorial "A guide on good usage of non_blocking and pin_memory()",
    https://docs.pytorch.org/tutorials/intermediate/pinmem_nonblock.html). Pinning needs CUDA,
    so a CPU run gets its batches back untouched.

    Pinning in the main thread right before the copy overlaps nothing, and the same tutorial
    notes that pinning then copying in one thread can be slower than a plain ``.to(device)``:
    :func:`train` therefore draws and pins each step's batches one step ahead, on a helper
    thread, while the current step runs (:class:`PinAhead`), as
    ``torch.utils.data.DataLoader(pin_memory=True)`` does with its pin-memory thread.
    """
    if device.type != "cuda":
        return list(batches)
    return [(x.pin_memory(), y.pin_memory()) for x, y in batches]


class PinAhead:
    """Each step's batches from ``stream``; on CUDA the next step's are drawn and pinned on a
    helper thread while the caller runs this step (a CPU run draws them when asked).

    ``get(more)`` returns this step's batches and, if ``more``, starts on the next step's, so
    no batch is drawn that no step uses: the random windows are the same as drawing in the
    main thread. ``close()`` waits for the helper (a context manager calls it).
    """

    def __init__(self, stream: Iterator[list[Batch]], device: torch.device) -> None:
        self.stream, self.device = stream, device
        self.pool = (ThreadPoolExecutor(1, thread_name_prefix="labkit-pin")
                     if device.type == "cuda" else None)  # fmt: skip
        self.next: Future | None = None

    def _draw(self) -> list[Batch]:
        return pin_batches(next(self.stream), self.device)

    def get(self, more: bool) -> list[Batch]:
        if self.pool is None:
            return self._draw()
        batches = (self.next or self.pool.submit(self._draw)).result()
        self.next = self.pool.submit(self._draw) if more else None
        return batches

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def __enter__(self) -> PinAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def batch_stream(data: torch.Tensor, cfg: RunConfig, generator: torch.Generator,
                 get_batch: Callable[..., Batch]) -> Iterator[list[Batch]]:
    """Endless lists of ``grad_accum`` micro-batches drawn from ``data``."""
    while True:
        yield [get_batch(data, cfg.train.micro_batch, cfg.model.seq_len, generator)
               for _ in range(cfg.train.grad_accum)]


def train(
    model: nn.Module,
    cfg: RunConfig,
    train_data: torch.Tensor,
    *,
    val_data: torch.Tensor | None = None,
    device: torch.device | None = None,
    on_step: Callable[[int, StepStats], None] | None = None,
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
    scaler: Scaler | Literal["auto"] | None = "auto",
) -> History:
    """Train ``model`` for ``cfg.train.steps`` steps on random windows of ``train_data``,
    with the learning rate of :func:`lr_at` at each step.

    ``scaler``: "auto" gives float16 a ``torch.amp.GradScaler`` and other dtypes none
    (:func:`make_scaler`); a scaler object is used as given (``labkit.precision.ManualScaler``
    keeps a history of its scale); None trains without loss scaling, also in float16, to show
    what loss scaling prevents.
    """
    from labkit.data import get_batch  # data depends on nothing here; import where used

    t = cfg.train
    device = device or resolve_device(t.device)
    model.to(device).train()
    optimizer = make_optimizer(model, t)
    if isinstance(scaler, str):
        if scaler != "auto":
            raise ValueError(f"scaler={scaler!r} is not allowed: 'auto', None (no loss scaling) "
                             "or a scaler object such as torch.amp.GradScaler")  # fmt: skip
        scaler = make_scaler(device, t.dtype)
    gen = torch.Generator().manual_seed(t.seed)
    val_gen = torch.Generator().manual_seed(t.seed + 1)
    history = History()
    with PinAhead(batch_stream(train_data, cfg, gen, get_batch), device) as ahead:
        for step in range(1, t.steps + 1):
            lr = lr_at(step, t)
            set_lr(optimizer, lr)
            # The step's timer (train_step) starts after the batches exist; the iteration's
            # clock starts before them, so the two together show what data loading costs (on
            # CUDA only what the pin thread has not finished while the last step ran).
            start = time.perf_counter()
            batches = ahead.get(more=step < t.steps)
            data_s = time.perf_counter() - start
            stats = train_step(model, optimizer, batches, device=device, dtype=t.dtype,
                               scaler=scaler, grad_clip=t.grad_clip, no_sync=no_sync)
            history.record(step, stats, lr=lr, data_s=data_s,
                           iteration_s=time.perf_counter() - start)
            if val_data is not None and t.eval_every and (
                step % t.eval_every == 0 or step == t.steps
            ):
                val_batches = [get_batch(val_data, t.micro_batch, cfg.model.seq_len, val_gen)
                               for _ in range(4)]
                history.val_steps.append(step)
                history.val_loss.append(evaluate(model, val_batches, device=device,
                                                 dtype=t.dtype))
            if on_step is not None:
                on_step(step, stats)
    return history


class Progress:
    """Prints a progress line every ``every`` steps: enough to see a long run move,
    few enough lines to keep a notebook's output short."""

    def __init__(self, total: int, *, lines: int = 10, print_fn: Callable[[str], None] = print):
        self.total = total
        self.every = max(1, total // lines)
        self.print = print_fn

    def __call__(self, step: int, stats: StepStats) -> None:
        if step % self.every == 0 or step == self.total:
            self.print(f"step {step:>5}/{self.total}  loss {stats.loss:.3f}  "
                       f"{stats.tokens_per_s:,.0f} tok/s  {stats.seconds * 1e3:.1f} ms/step")


def plot_history(history: History, *, title: str, ax: Any = None) -> Any:
    """The run's loss curve (train and validation, measured) against the uniform guess, with the
    learning-rate schedule the steps followed on its own right-hand axis. Returns the axes."""
    import matplotlib.pyplot as plt  # here, so that importing labkit stays light

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(history.steps, history.loss, label="train (measured)")
    ax.plot(history.val_steps, history.val_loss, "o-", label="validation (measured)")
    ax.axhline(math.log(256.0), ls=":", c="grey", label="uniform guess, ln 256")
    ax.set(xlabel="optimizer step", ylabel="cross-entropy (nats)", title=title)
    lr_ax = ax.twinx()  # the schedule the steps followed, on its own scale
    lr_ax.plot(history.steps, history.lr, c="tab:green", lw=1, label="learning rate (right axis)")
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_ylim(0, 1.1 * max(history.lr))
    lines = ax.get_legend_handles_labels()
    more = lr_ax.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8)
    return ax


def plot_step_times(history: History, *, skip: int, ax: Any = None) -> Any:
    """Each step's and each whole iteration's recorded time (log scale), the steady median of
    the steps after ``skip``, and the warm-up steps shaded. Returns the axes."""
    import statistics

    import matplotlib.pyplot as plt  # here, so that importing labkit stays light

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 2.8))
    steady = statistics.median(history.seconds[skip:])
    ax.plot(history.steps, [s * 1e3 for s in history.iteration_seconds], lw=1,
            label="whole iteration (measured)")
    ax.plot(history.steps, [s * 1e3 for s in history.seconds], lw=1, label="step (measured)")
    ax.axhline(steady * 1e3, ls=":", c="grey", label="steady median of the steps")
    ax.axvspan(0.5, skip + 0.5, color="0.9", label="skipped as warm-up")
    ax.set(xlabel="optimizer step", ylabel="ms", yscale="log", title="recorded step times")
    ax.legend(fontsize=8)
    return ax
