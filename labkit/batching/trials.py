"""Where a trial step of the batch finder runs, and how its memory is measured and limited.

A trial is one real ``labkit.train.train_step`` at micro-batch b on a fresh copy of a template
model, with AdamW's state already present, as in steady-state training. Two devices run it
behind one interface (:class:`MemoryDevice`), which :mod:`labkit.batching.finder` drives:

* :class:`BudgetedCPU`: on the CPU, against a budget the caller sets, enforced on the measured
  live bytes of every tensor the step allocates; passing it raises :class:`BudgetExceeded` (a
  ``torch.OutOfMemoryError``) mid-step, as an allocator would. A budget, not a device limit;
* :class:`CudaOOM`: on a GPU until a real ``torch.OutOfMemoryError``, optionally on a smaller
  card emulated with ``torch.cuda.set_per_process_memory_fraction``.

After every trial the device's ``recover`` frees what the trial held and checks that it is
gone (:class:`MemoryLeakError` otherwise). :func:`measure_step_peak` measures the same step with
no limit, on any device.

How the CPU peak is measured (:class:`LiveTensorBytes`): a ``TorchDispatchMode`` sees the
output of every ATen op the trial runs, forward, backward and optimiser step alike. Each output
whose storage is new (not an input's storage: views, in-place ops and ``detach`` allocate
nothing) is counted, and a ``weakref`` callback on its storage subtracts it when the storage is
freed; the peak is the maximum of that running total. PyTorch keeps a storage's Python object
alive exactly as long as the storage (``torch/distributed/_tools/mem_tracker.py`` relies on
the same), so the callback fires when the memory is really released. It counts what CUDA's
``max_memory_allocated`` would count for the same tensors, except scratch memory a kernel
allocates and frees inside one op (the mode runs with itself disabled inside each op) and the
caching allocator's rounding.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
import traceback
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from labkit import config, train
from labkit.config import ModelConfig, TrainConfig
from labkit.errors import LabkitError
from labkit.formulas.max_batch import checked_budget, checked_seq_len, mib
from labkit.validate import whole

# ----------------------------------------------------------------------------------------------
# Input validation, shared with the finder: errors name the argument, the value and what is
# allowed.


def checked_dtype(value: Any) -> str:
    """``value`` if it names a training dtype (``labkit.config.DTYPES``), else ValueError."""
    if value not in config.DTYPES:
        raise ValueError(f"dtype={value!r} is not allowed: give one of {config.DTYPES}")
    return value


def model_config_of(model: nn.Module) -> ModelConfig | None:
    """The ``ModelConfig`` of a labkit GPT (its ``.cfg``); None for any other module."""
    cfg = getattr(model, "cfg", None)
    return cfg if isinstance(cfg, ModelConfig) else None


# ----------------------------------------------------------------------------------------------
# The record of one trial (the finder's log; the CUDA warm-up below makes one too).

PHASES = ("warm-up", "start", "double", "halve", "bisect")
"""Why each trial ran: the warm-up (CUDA only, at batch 1, before the baseline is read), the
predicted start, doubling up after a fit, halving down after a failed start, bisection."""


@dataclass(frozen=True)
class Trial:
    """One real training step the finder ran (measured)."""

    batch: int
    fits: bool
    peak_bytes: int | None
    """Fit: the most bytes the trial held at once. Failure: the bytes held when the failing
    allocation was asked for (CPU: including it; CUDA: without it)."""
    seconds: float
    phase: str
    """One of :data:`PHASES`."""
    error: str | None = None
    """The out-of-memory message of a failed trial."""


# ----------------------------------------------------------------------------------------------
# What can go wrong (a budget passed, memory left held), and the CPU's measure of live memory.


class BudgetExceeded(torch.OutOfMemoryError, LabkitError):
    """A CPU trial's live tensor bytes passed the budget the caller set (not a device limit).

    An ``torch.OutOfMemoryError``, so the finder (and a learner's ``except
    torch.OutOfMemoryError``) treats it exactly like a CUDA out-of-memory failure.
    """

    def __init__(self, requested_bytes: int, live_bytes: int, budget_bytes: int) -> None:
        self.requested_bytes = requested_bytes
        self.live_bytes = live_bytes
        self.budget_bytes = budget_bytes
        super().__init__(
            f"allocating {mib(requested_bytes)} with {mib(live_bytes)} live would pass the "
            f"CPU memory budget of {mib(budget_bytes)} (a budget the caller set, not a "
            f"device limit)"
        )


class MemoryLeakError(RuntimeError, LabkitError):
    """After a trial, memory it allocated is still held (CUDA: memory_allocated above its
    baseline; CPU: live bytes the trial counted): a leak, and a bug to report."""


class LiveTensorBytes(TorchDispatchMode):
    """Count the bytes of live tensor storages allocated under this mode; keep the peak.

    A storage is counted when an op returns it and none of the op's inputs holds it (so views,
    in-place ops and ``detach`` count nothing), and uncounted by a weakref callback when it is
    freed. With ``budget_bytes``, an allocation that would take the count past the budget
    raises :class:`BudgetExceeded` (the new tensor is dropped, as a failed allocation would be).
    Tensors that existed before the mode are not counted.
    """

    def __init__(self, budget_bytes: int | None = None) -> None:
        super().__init__()
        self.budget_bytes = budget_bytes
        self.current = 0
        self.peak = 0
        self._live: dict[int, weakref.ref] = {}

    def _freed(self, key: int, nbytes: int) -> None:
        if self._live.pop(key, None) is not None:
            self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs))
                  if isinstance(t, (torch.Tensor, torch.UntypedStorage))}  # fmt: skip
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            key = _storage_key(t)
            if key is None or key in inputs or key in self._live:
                continue
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            if self.budget_bytes is not None and self.current + nbytes > self.budget_bytes:
                self.peak = max(self.peak, self.current + nbytes)
                raise BudgetExceeded(nbytes, self.current, self.budget_bytes)
            self._live[key] = weakref.ref(storage, lambda _, k=key, n=nbytes: self._freed(k, n))
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        return out


def _storage_key(t: torch.Tensor | torch.UntypedStorage) -> int | None:
    try:
        storage = t if isinstance(t, torch.UntypedStorage) else t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        return None
    return storage._cdata  # the address of the C++ StorageImpl: one per storage


# ----------------------------------------------------------------------------------------------
# Memory devices: run one real training step at batch b, on a CPU against a budget or on a GPU
# against the card (optionally shrunk with a per-process memory fraction).


class MemoryDevice(Protocol):
    """Where the trials run: ``kind`` names who enforces the limit ("CPU budget", "cuda OOM")."""

    kind: str
    device: torch.device
    budget_bytes: int
    limit: str
    """The limit in words, for messages and the result."""
    method: str
    """How a trial's peak is measured."""
    last_peak_bytes: int | None
    warmup: Trial | None
    """The CUDA warm-up step :func:`open_trials` ran (None on the CPU)."""

    def __call__(self, batch: int, grad_accum: int = 1) -> int: ...
    def recover(self) -> None: ...
    def session(self) -> contextlib.AbstractContextManager: ...


def _fresh_copy(template: nn.Module, train_cfg: TrainConfig,
                device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:  # fmt: skip
    """A copy of ``template`` on ``device`` with an AdamW whose state already exists.

    AdamW creates its moments lazily at the first ``step``; a steady-state step has them in
    memory during forward and backward, so the trial creates them first: one step with zero
    gradients at learning rate 0, which moves no parameter.
    """
    model = copy.deepcopy(template).to(device).train()
    optimizer = train.make_optimizer(model, train_cfg)
    lrs = [g["lr"] for g in optimizer.param_groups]
    train.set_lr(optimizer, 0.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    return model, optimizer


def _vocab_size(model: nn.Module) -> int:
    cfg = model_config_of(model)
    return cfg.vocab_size if cfg is not None else config.CORPUS_VOCAB_SIZE


class _Trials:
    """What both devices (and :func:`measure_step_peak`) share: one real ``train.train_step``
    on a fresh copy, references dropped in ``finally`` and the traceback's frames cleared on
    an out-of-memory error or an interrupt."""

    kind = ""

    def __init__(self, template: nn.Module, *, seq_len: int, dtype: str,
                 train_cfg: TrainConfig, device: torch.device) -> None:  # fmt: skip
        self.template = template
        self.seq_len = seq_len
        self.dtype = dtype
        self.train_cfg = train_cfg
        self.device = device
        self.vocab_size = _vocab_size(template)
        self.last_peak_bytes: int | None = None
        self.warmup: Trial | None = None

    def _step(self, batch: int, grad_accum: int = 1) -> None:
        model = optimizer = batches = None
        try:
            model, optimizer = _fresh_copy(self.template, self.train_cfg, self.device)
            g = torch.Generator().manual_seed(batch)
            shape = (batch, self.seq_len)
            batches = [(torch.randint(0, self.vocab_size, shape, generator=g),
                        torch.randint(0, self.vocab_size, shape, generator=g))
                       for _ in range(grad_accum)]  # fmt: skip
            train.train_step(model, optimizer, batches, device=self.device, dtype=self.dtype,
                             scaler=train.make_scaler(self.device, self.dtype),
                             grad_clip=self.train_cfg.grad_clip)  # fmt: skip
        except (torch.OutOfMemoryError, KeyboardInterrupt) as e:
            # The traceback's frames below this one (train_step, the model's forward) hold the
            # batch, the model copy and through the activations the autograd graph; clearing
            # their locals is not enough, since a cleared frame still holds its function, and
            # nn.Module's hook wrapper is a closure over the module and its inputs. So the
            # error leaves without them: a notebook keeps the last traceback (sys.last_traceback)
            # and would otherwise keep the memory too. Other errors are bugs and keep their
            # whole traceback, to be read.
            traceback.clear_frames(e.__traceback__)
            raise e.with_traceback(None)  # noqa: B904 (the same error, its inner frames dropped)
        finally:
            model = optimizer = batches = None  # released here, not when the traceback goes


class BudgetedCPU(_Trials):
    """Trials on the CPU against ``budget_bytes``, enforced on measured live tensor bytes."""

    kind = "CPU budget"

    def __init__(self, template: nn.Module, budget_bytes: int, **kw: Any) -> None:
        super().__init__(template, device=torch.device("cpu"), **kw)
        self.budget_bytes = budget_bytes
        self._counter: LiveTensorBytes | None = None
        self.limit = (f"a CPU memory budget of {mib(budget_bytes)} (set by the caller and "
                      f"enforced on measured live tensor bytes: a budget, not a device limit)")  # fmt: skip
        self.method = ("live tensor bytes: every storage the trial allocates (model copy, "
                       "optimizer state, batch, activations, gradients, temporaries), counted by "
                       "a TorchDispatchMode until freed; peak over the whole trial")  # fmt: skip

    def __call__(self, batch: int, grad_accum: int = 1) -> int:
        """One step of ``grad_accum`` micro-batches of ``batch`` sequences; its peak bytes."""
        self.last_peak_bytes = None
        self._counter = counter = LiveTensorBytes(self.budget_bytes)
        try:
            with counter:
                self._step(batch, whole("grad_accum", grad_accum, low=1))
        finally:
            self.last_peak_bytes = counter.peak
        return counter.peak

    @property
    def held_bytes(self) -> int:
        """Bytes the last trial allocated that are still alive (0 once it is cleaned up)."""
        return self._counter.current if self._counter is not None else 0

    def recover(self) -> None:
        gc.collect()  # tensors in reference cycles (a traceback's frames) go now
        if self.held_bytes:
            raise MemoryLeakError(
                f"after a trial {self.held_bytes} bytes it allocated are still alive: the trial "
                f"leaked memory. This is a bug in the trial step (a reference kept past its "
                f"end); report it"
            )

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        yield


class CudaOOM(_Trials):
    """Trials on a GPU until ``torch.OutOfMemoryError``; ``budget_bytes`` (optional) emulates a
    smaller card with ``torch.cuda.set_per_process_memory_fraction``, restored afterwards."""

    kind = "cuda OOM"

    def __init__(self, template: nn.Module, budget_bytes: int | None, *,
                 device: torch.device, **kw: Any) -> None:  # fmt: skip
        device = torch.device(device)
        if device.index is None:  # torch.cuda's memory-fraction calls refuse a bare "cuda"
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(template, device=device, **kw)
        self.total_bytes = torch.cuda.get_device_properties(device).total_memory
        self.memory_fraction = None
        if budget_bytes is not None:
            if budget_bytes > self.total_bytes:
                raise ValueError(
                    f"budget_bytes={budget_bytes} ({mib(budget_bytes)}) is not allowed: "
                    f"{torch.cuda.get_device_name(device)} has {mib(self.total_bytes)}; give "
                    f"at most {self.total_bytes}, or None for the whole card"
                )
            self.memory_fraction = budget_bytes / self.total_bytes
        self.budget_bytes = budget_bytes if budget_bytes is not None else self.total_bytes
        self.baseline_bytes: int | None = None
        card = (f"a card emulated at {mib(self.budget_bytes)} (memory fraction "
                f"{self.memory_fraction:.4f})" if self.memory_fraction is not None
                else f"the whole card ({mib(self.total_bytes)})")  # fmt: skip
        self.limit = f"{card} on {device}: a real CUDA out-of-memory error"
        self.method = ("CUDA allocator: max_memory_allocated over the trial minus the baseline "
                       "memory_allocated before the search")  # fmt: skip

    def __call__(self, batch: int, grad_accum: int = 1) -> int:
        """One step of ``grad_accum`` micro-batches of ``batch`` sequences; its peak bytes."""
        base = self.baseline_bytes or torch.cuda.memory_allocated(self.device)
        self.last_peak_bytes = None
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            self._step(batch, whole("grad_accum", grad_accum, low=1))
            torch.cuda.synchronize(self.device)
        finally:
            self.last_peak_bytes = torch.cuda.max_memory_allocated(self.device) - base
        return self.last_peak_bytes

    def recover(self) -> None:
        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # cached blocks of the failed step back to the driver
        now = torch.cuda.memory_allocated(self.device)
        if self.baseline_bytes is not None and now != self.baseline_bytes:
            raise MemoryLeakError(
                f"after a trial the CUDA allocator holds {now} bytes, {now - self.baseline_bytes} "
                f"more than its baseline of {self.baseline_bytes}: the trial leaked memory. "
                f"This is a bug in the trial step (a reference kept past its end); report it"
            )

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        previous = torch.cuda.get_per_process_memory_fraction(self.device)
        try:
            gc.collect()
            torch.cuda.empty_cache()
            if self.memory_fraction is not None:
                torch.cuda.set_per_process_memory_fraction(self.memory_fraction, self.device)
            yield
        finally:
            self.baseline_bytes = None
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(previous, self.device)


def _cuda_warmup(trials: CudaOOM) -> Trial:
    """One step at batch 1 before the baseline is read: cuBLAS and other libraries allocate
    their workspaces through the caching allocator on first use and keep them, which would
    otherwise look like a leak after the first trial."""
    t0 = time.perf_counter()
    try:
        peak = trials(1)
    except torch.OutOfMemoryError as e:
        message = f"{type(e).__name__}: {e}"
        traceback.clear_frames(e.__traceback__)
    else:
        message = None
    trials.recover()
    if message is not None:
        raise ValueError(f"not even a micro-batch of 1 fits {trials.limit}: {message}. Give a "
                         f"larger budget, a shorter seq_len or a smaller model")  # fmt: skip
    trials.baseline_bytes = torch.cuda.memory_allocated(trials.device)
    return Trial(batch=1, fits=True, peak_bytes=peak, seconds=time.perf_counter() - t0,
                 phase="warm-up")  # fmt: skip


@contextlib.contextmanager
def open_trials(
    template: nn.Module,
    budget_bytes: float | None,
    *,
    device: torch.device,
    seq_len: int,
    dtype: str,
    train_cfg: TrainConfig,
) -> Iterator[MemoryDevice]:
    """The trial device for ``device``, ready to call: ``trials(b)`` runs one step at batch b.

    On the CPU a :class:`BudgetedCPU` (``budget_bytes`` required); on CUDA a :class:`CudaOOM`
    (``budget_bytes`` optional: it emulates a smaller card), inside its session (the memory
    fraction set, and restored on exit) and after its warm-up step, so that its baseline is
    read and ``recover()`` checks every trial against it. The warm-up is ``trials.warmup``
    (None on the CPU).
    """
    common = {"seq_len": seq_len, "dtype": dtype, "train_cfg": train_cfg}
    if device.type == "cuda":
        budget = None if budget_bytes is None else checked_budget(budget_bytes)
        trials: MemoryDevice = CudaOOM(template, budget, device=device, **common)
    elif device.type == "cpu":
        if budget_bytes is None:
            raise ValueError(
                "budget_bytes=None is not allowed on the CPU: a CPU has no device memory "
                "limit to run out of, so give the budget to search against, e.g. "
                "budget_bytes=16 * 2**30 for a 16 GiB card"
            )
        trials = BudgetedCPU(template, checked_budget(budget_bytes), **common)
    else:
        raise ValueError(f"device={str(device)!r} is not allowed: give 'cpu' or 'cuda[:N]'")
    with trials.session():
        if isinstance(trials, CudaOOM):
            trials.warmup = _cuda_warmup(trials)
        yield trials


# ----------------------------------------------------------------------------------------------
# One step measured without a limit.


def measure_step_peak(
    template: nn.Module,
    batch: int,
    *,
    seq_len: int,
    dtype: str = "float32",
    train_cfg: TrainConfig | None = None,
    device: torch.device | str = "cpu",
    grad_accum: int = 1,
) -> int:
    """The peak live tensor bytes of one real ``train.train_step`` at micro-batch ``batch``.

    ``grad_accum``: micro-batches of ``batch`` sequences accumulated in the step (all of them
    drawn before it, as token ids: b·s·16 bytes each).

    The step is the finder's trial: a fresh copy of ``template`` (never modified) on ``device``
    with AdamW's state already present, ``batch`` sequences of ``seq_len`` tokens, ``train_cfg``
    (default ``TrainConfig()``) for the optimizer and grad_clip, a GradScaler for float16. Its
    memory is counted by :class:`LiveTensorBytes` with no budget: every storage the step
    allocates, on any device (the model copy, optimizer state, batch, activations, gradients,
    temporaries; on CUDA the token ids' CPU copies too), until freed. Measured, and the same
    number ``BudgetedCPU`` reports for a trial that fits.
    """
    if not isinstance(template, nn.Module):
        raise ValueError(f"template={type(template).__name__} is not allowed: give an nn.Module "
                         f"(such as labkit.model.GPT)")  # fmt: skip
    batch = whole("batch", batch, low=1)
    grad_accum = whole("grad_accum", grad_accum, low=1)
    seq_len = checked_seq_len(model_config_of(template), whole("seq_len", seq_len, low=1))
    step = _Trials(template, seq_len=seq_len, dtype=checked_dtype(dtype),
                   train_cfg=train_cfg if train_cfg is not None else TrainConfig(),
                   device=train.resolve_device(str(device)))  # fmt: skip
    with LiveTensorBytes() as counter:
        step._step(batch, grad_accum)
    return counter.peak


def measured_step_peak(template: nn.Module, batch: int, *, device: torch.device | str,
                       seq_len: int, dtype: str = "float32",
                       train_cfg: TrainConfig | None = None) -> int:
    """The measured peak of one training step at ``batch`` sequences, on whatever ``device``
    is: on a GPU the finder's CUDA trial (:class:`CudaOOM`: ``max_memory_allocated`` over the
    step minus what came before), on a CPU live tensor bytes (:func:`measure_step_peak`)."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaOOM(template, None, device=device, seq_len=seq_len, dtype=dtype,
                       train_cfg=train_cfg)(batch)
    return measure_step_peak(template, batch, seq_len=seq_len, dtype=dtype, train_cfg=train_cfg)
