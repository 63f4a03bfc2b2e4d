"""The largest micro-batch that fits: predicted from the memory model, then found by real steps.

Lightning's ``BatchSizeFinder`` and Accelerate's ``find_executable_batch_size`` both search by
running steps until one fails with an out-of-memory error. This finder adds what a lab needs:

1. **a prediction first** (:func:`predict_max_batch`, from :mod:`labkit.formulas.max_batch`):
   model states (parameters, gradients, AdamW's two moments) plus the activations autograd keeps
   per sequence, so the search starts near the answer and the notebook can reconcile the two;
2. **a search** (:func:`search_max_batch`): double from the predicted batch until a trial fails,
   then bisect between the last fit and the first failure (halve down first if the predicted
   batch itself fails); each batch is tried at most once, and the answer is exact for any
   memory use that grows with the batch;
3. **recovery that is checked**: every failed trial is cleaned up (references dropped, frames
   cleared, ``gc``, ``torch.cuda.empty_cache``) and, on CUDA, ``torch.cuda.memory_allocated``
   must be back at its baseline after every trial, or :class:`MemoryLeakError` is raised;
4. **the same search on a CPU**, where no device ever runs out of memory: the caller sets a
   budget, and :class:`BudgetedCPU` enforces it on the *measured* live bytes of every tensor
   the trial step allocates, raising :class:`BudgetExceeded` (an ``torch.OutOfMemoryError``)
   mid-step, as an allocator would. That is a budget the caller chose, not a device limit,
   and the result says so; a budget beyond the memory the host (or the card) has free is
   capped at 90% of that, with a warning (:func:`capped_budget`), since the trials allocate
   real memory up to it and the OOM killer would end the process without a word.

Where a trial runs and how its memory is measured (the devices, :class:`LiveTensorBytes`) is
:mod:`labkit.batching.trials`; this module predicts, searches and reports.

The trials run in this process: there is no child process to leave behind, and an interrupt
(``KeyboardInterrupt`` from a notebook) releases the trial's tensors on its way out.
"""

from __future__ import annotations

import html
import math
import re
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from labkit import train
from labkit.batching.trials import (
    PHASES,
    BudgetedCPU,
    BudgetExceeded,
    CudaOOM,
    LiveTensorBytes,
    MemoryLeakError,
    Trial,
    checked_dtype,
    model_config_of,
    open_trials,
)
from labkit.config import ModelConfig, TrainConfig
from labkit.errors import LabkitError

# The prediction, closed-form: in labkit.formulas.max_batch (sizes and a budget in, a batch out)
from labkit.formulas.max_batch import OMISSIONS as OMISSIONS
from labkit.formulas.max_batch import BatchPrediction as BatchPrediction
from labkit.formulas.max_batch import checked_budget, checked_seq_len, max_batch_prediction, mib
from labkit.formulas.max_batch import predict_max_batch as predict_max_batch
from labkit.hardware.host import cgroup_room as _cgroup_room  # noqa: F401 (test_bad_inputs reads it)
from labkit.hardware.host import host_memory_available as host_memory_available
from labkit.model import GPT
from labkit.tables import html_table
from labkit.validate import whole

__all__ = [  # the finder's API; the trials' names are re-exported for finder.X callers
    "OMISSIONS",
    "PHASES",
    "BatchPrediction",
    "BudgetExceeded",
    "BudgetedCPU",
    "CudaOOM",
    "HostMemoryError",
    "LiveTensorBytes",
    "MaxBatchResult",
    "MemoryLeakError",
    "SearchOutcome",
    "Trial",
    "capped_budget",
    "find_max_batch",
    "host_memory_available",
    "predict_max_batch",
    "predict_max_batch_tensorwise",
    "search_max_batch",
]

GiB = 2**30

# ----------------------------------------------------------------------------------------------
# Input validation: errors name the argument, the value and what is allowed (the shared checks
# are in labkit.batching.trials).

MAX_BATCH = 2**24
"""The largest ``max_batch`` :func:`find_max_batch` takes. Far more sequences than any device the
course runs on holds: the smoke GPT needs about 0.8 MiB a sequence at seq_len 64 (18 fit in
16 MiB with its 1.8 MiB of model states), so an H200's 141 GB holds about 0.2 M of them, and
about 11 M at seq_len 1. A larger one is a typo (``10**9``), and a start near it would ask the
allocator for the token ids alone, 16 bytes a token, before any budget is checked."""


def _max_batch(value: object) -> int:
    return whole("max_batch", value, low=1, high=MAX_BATCH,
                 why="2**24, more sequences than any GPU holds; the default is 4096")


# ----------------------------------------------------------------------------------------------
# 1. The prediction: closed-form, so it lives in labkit.formulas.max_batch (imported above).


# ----------------------------------------------------------------------------------------------
# 2. The search, independent of any device: a trial either returns (fits) or raises
#    torch.OutOfMemoryError (does not fit). Each is logged as a trials.Trial.


@dataclass(frozen=True)
class SearchOutcome:
    """The largest batch :func:`search_max_batch` found, and every trial it ran, in order."""

    found: int
    trials: tuple[Trial, ...]
    capped: bool
    """True when ``found`` is ``max_batch``: the search stopped there, and more may fit."""


TrialFn = Callable[[int], "int | None"]


def search_max_batch(
    trial: TrialFn,
    *,
    start: int,
    max_batch: int,
    recover: Callable[[], None] = lambda: None,
    limit: str = "the memory limit",
) -> SearchOutcome:
    """The largest batch in 1..max_batch for which ``trial(batch)`` does not raise OOM.

    ``trial(b)`` runs one step at batch b and returns its peak bytes (or None), or raises
    ``torch.OutOfMemoryError`` (:class:`BudgetExceeded` on a CPU); any other exception
    propagates. ``recover()`` runs after every trial, fit or failure (free, check the baseline).
    A failed trial's bytes are read from ``trial.last_peak_bytes`` where the trial has one
    (the devices below do). Assumes memory grows with the batch: then the answer is exact.
    """
    max_batch = whole("max_batch", max_batch, low=1)
    b = min(whole("start", start, low=1), max_batch)
    log: list[Trial] = []

    def attempt(batch: int, phase: str) -> bool:
        error = None
        peak = None
        t0 = time.perf_counter()
        try:
            peak = trial(batch)
        except torch.OutOfMemoryError as e:
            error = f"{type(e).__name__}: {e}"
            # the traceback's frames hold the failed step's tensors: release them now
            traceback.clear_frames(e.__traceback__)
        seconds = time.perf_counter() - t0
        if error is not None:  # `e` is gone here (Python deletes it after the except block)
            peak = getattr(trial, "last_peak_bytes", None)
        recover()
        log.append(Trial(batch=batch, fits=error is None, peak_bytes=peak, seconds=seconds,
                         phase=phase, error=error))  # fmt: skip
        return error is None

    lo: int | None = None  # largest batch seen to fit
    hi: int | None = None  # smallest batch seen to fail
    if attempt(b, "start"):
        lo = b
        while lo < max_batch:
            b = min(2 * lo, max_batch)
            if not attempt(b, "double"):
                hi = b
                break
            lo = b
        if hi is None:
            return SearchOutcome(found=lo, trials=tuple(log), capped=lo == max_batch)
    else:
        hi = b
        while hi > 1:
            b = hi // 2
            if attempt(b, "halve"):
                lo = b
                break
            hi = b
        if lo is None:
            raise ValueError(
                f"not even a micro-batch of 1 fits {limit}: {log[-1].error}. Give a larger "
                f"budget, a shorter seq_len or a smaller model"
            )
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if attempt(mid, "bisect"):
            lo = mid
        else:
            hi = mid
    return SearchOutcome(found=lo, trials=tuple(log), capped=lo == max_batch)


# ----------------------------------------------------------------------------------------------
# The memory that is really there. A CPU budget is enforced on counted tensor bytes, but the
# trials allocate real memory up to it: a budget beyond the host's memory does not stop a trial
# before the kernel's OOM killer does, and that ends the process (a notebook's kernel) with no
# message. So the finder caps the budget at what the host (or the card) has free, and says so.

HEADROOM = 0.9
"""The share of the free memory a capped budget takes: the rest is for what the count leaves out
(scratch memory inside a kernel, the interpreter) and for the other processes on the machine."""

class HostMemoryError(MemoryError, LabkitError):
    """The host's allocator refused a trial's memory: the budget asked for more than this
    machine could give at that moment. The message names the batch, the bytes and the fix."""


def _size(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (MiB at least)."""
    for unit, name in ((2**40, "TiB"), (2**30, "GiB")):
        if n >= unit:
            return f"{n / unit:,.2f} {name}"
    return mib(n)


def capped_budget(budget_bytes: float | None, device: torch.device, *,
                  stacklevel: int = 2) -> int | None:  # fmt: skip
    """``budget_bytes`` checked, or :data:`HEADROOM` of what ``device`` has free where it asks
    for more, with a warning naming both numbers. CPU: the host's available memory
    (:func:`host_memory_available`); CUDA: ``torch.cuda.mem_get_info``'s free bytes plus what
    this process's caching allocator already holds. None (the whole card on CUDA) and a budget
    beyond the card (refused by :class:`CudaOOM`, naming the card) are returned as given."""
    if budget_bytes is None:
        return None
    budget = checked_budget(budget_bytes)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if budget > total:
            return budget
        have, where = free + torch.cuda.memory_reserved(device), f"{device} has free"
    elif device.type == "cpu":
        have, source = host_memory_available()
        where = f"available ({source}) on this host"
    else:
        return budget
    cap = int(HEADROOM * have)
    if budget <= cap:
        return budget
    warnings.warn(
        f"budget_bytes={budget} ({_size(budget)}) is more than the {_size(have)} {where}: trials "
        f"would run out of real memory before the budget (on the CPU the OOM killer ends the "
        f"process without a message), so the budget is capped at {_size(cap)}, "
        f"{HEADROOM:.0%} of it; give budget_bytes <= {cap}, or free memory first",
        UserWarning, stacklevel=stacklevel,
    )  # fmt: skip
    return cap


_ALLOCATOR_REFUSAL = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")
"""What torch's CPU allocator raises (a RuntimeError, c10's DefaultCPUAllocator) when the host
refuses an allocation; CUDA's is a torch.OutOfMemoryError, which the search handles."""


class _HostRefusals:
    """The trial device, with the host allocator's refusal (a RuntimeError) turned into a
    :class:`HostMemoryError` that names the batch, the bytes and the fix; the search's view of
    the device (``last_peak_bytes``) is the device's own."""

    def __init__(self, trials: Callable[[int], int]) -> None:
        self.trials = trials

    @property
    def last_peak_bytes(self) -> int | None:
        return getattr(self.trials, "last_peak_bytes", None)

    def __call__(self, batch: int) -> int:
        try:
            return self.trials(batch)
        except RuntimeError as e:
            refused = _ALLOCATOR_REFUSAL.search(str(e))
            if refused is None or isinstance(e, torch.OutOfMemoryError):
                raise  # an OOM is the search's to handle; any other error is a bug to read
            traceback.clear_frames(e.__traceback__)  # the failed step's tensors go now
        have, source = host_memory_available()
        raise HostMemoryError(
            f"the trial at micro-batch {batch} asked this host for "
            f"{_size(int(refused[1]))} and was refused (DefaultCPUAllocator: can't allocate "
            f"memory): the host has less memory free than the budget lets a trial take "
            f"({_size(have)} available, {source}); give a smaller budget_bytes or max_batch"
        )


# ----------------------------------------------------------------------------------------------
# 3. The finder: the prediction, then the search on a memory device from labkit.batching.trials.


@dataclass(frozen=True)
class MaxBatchResult:
    """Predicted and found largest micro-batch, and the trials that found it."""

    predicted: int | None
    """Modelled (:func:`predict_max_batch`); 0 if not even one sequence was predicted to fit,
    None for a model without a ``ModelConfig``."""
    found: int
    """Measured: the largest batch whose real training step fitted."""
    budget_bytes: int
    kind: str
    """"CPU budget" (a budget the caller set, enforced on measured bytes) or "cuda OOM"."""
    limit: str
    """The limit in words, e.g. "a CPU memory budget of 16.00 MiB (... not a device limit)"."""
    method: str
    """How each trial's peak was measured."""
    device: str
    dtype: str
    seq_len: int
    max_batch: int
    capped: bool
    """True when found == max_batch: the search stopped at the cap, more may fit."""
    trials: tuple[Trial, ...]
    prediction: BatchPrediction | None = None
    baseline_bytes: int | None = None
    """CUDA: memory_allocated after the warm-up trial, checked after every trial."""

    @property
    def failures(self) -> int:
        return sum(not t.fits for t in self.trials)

    def summary(self) -> str:
        cap = f" (capped at max_batch={self.max_batch})" if self.capped else ""
        return (f"largest micro-batch: predicted {self.predicted}, found {self.found}{cap}, "
                f"seq_len {self.seq_len}, {self.dtype}; {len(self.trials)} trials, "
                f"{self.failures} recovered from; limit: {self.limit}")  # fmt: skip

    def _repr_html_(self) -> str:
        rows = [[t.phase, t.batch, "fits" if t.fits else "OOM",
                 "" if t.peak_bytes is None else mib(t.peak_bytes), f"{t.seconds:.3f}"]
                for t in self.trials]  # fmt: skip
        table = html_table(["phase", "batch", "result", "peak (measured)", "s"], rows)
        return f"<p>{html.escape(self.summary())}</p>{table}<p>{html.escape(self.method)}</p>"


def find_max_batch(
    model: nn.Module | ModelConfig,
    budget_bytes: float | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: str = "float32",
    seq_len: int | None = None,
    max_batch: int = 4096,
    start: int | None = None,
    train_cfg: TrainConfig | None = None,
) -> MaxBatchResult:
    """Predict, then find by real training steps, the largest micro-batch that fits.

    ``model`` is a template that is never modified: each trial trains a fresh copy of it (a
    ``ModelConfig`` builds a ``labkit.model.GPT``). Each trial is one ``labkit.train.train_step``
    at micro-batch b and ``seq_len`` tokens, with AdamW's state present (``train_cfg``, default
    ``TrainConfig()``: its grad_clip, and a GradScaler for float16, as in training).

    On the CPU ``budget_bytes`` is required: the memory the caller pretends to have (say
    ``16 * 2**30`` for a 16 GiB card), enforced on measured live tensor bytes. On CUDA it is
    optional: given, it emulates a card of that size with a per-process memory fraction
    (what the process already holds on the GPU counts against it, as on a real card).

    ``start`` overrides the predicted starting batch. The search stops at ``max_batch``.
    """
    device = train.resolve_device(str(device))
    dtype = checked_dtype(dtype)
    max_batch = _max_batch(max_batch)
    if start is not None:
        start = whole("start", start, low=1)
    if isinstance(model, ModelConfig):
        model = GPT(model)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={type(model).__name__} is not allowed: give an nn.Module "
                         f"(such as labkit.model.GPT) or a labkit.config.ModelConfig")  # fmt: skip
    cfg = model_config_of(model)
    seq_len = checked_seq_len(cfg, seq_len)
    train_cfg = train_cfg if train_cfg is not None else TrainConfig()
    asked = budget_bytes
    budget_bytes = capped_budget(budget_bytes, device, stacklevel=3)  # the caller's line

    with open_trials(model, budget_bytes, device=device, seq_len=seq_len, dtype=dtype,
                     train_cfg=train_cfg) as trials:  # fmt: skip
        warmup = [trials.warmup] if trials.warmup is not None else []
        prediction = None
        if cfg is not None:
            room = trials.budget_bytes - (getattr(trials, "baseline_bytes", None) or 0)
            # PyTorch's CPU dropout keeps its mask in the activation dtype, CUDA's in 1 byte
            mask = (4 if dtype == "float32" else 2) if device.type == "cpu" else 1
            prediction = max_batch_prediction(cfg, max(room, 1), seq_len, dtype, "flash", mask)
        first = start or max(1, prediction.batch if prediction is not None else 1)
        outcome = search_max_batch(_HostRefusals(trials), start=first, max_batch=max_batch,
                                   recover=trials.recover, limit=trials.limit)  # fmt: skip
        baseline = getattr(trials, "baseline_bytes", None)
    limit = trials.limit
    if budget_bytes is not None and budget_bytes < checked_budget(asked):
        limit += f"; capped from the {_size(asked)} asked, more than the device has free"
    return MaxBatchResult(
        predicted=prediction.batch if prediction is not None else None,
        found=outcome.found, budget_bytes=trials.budget_bytes, kind=trials.kind,
        limit=limit, method=trials.method, device=str(trials.device), dtype=dtype,
        seq_len=seq_len, max_batch=max_batch, capped=outcome.capped,
        trials=tuple(warmup) + outcome.trials, prediction=prediction, baseline_bytes=baseline,
    )  # fmt: skip


def predict_max_batch_tensorwise(cfg_model: ModelConfig, budget_bytes: float, *,
                                 dtype: str = "float32", seq_len: int | None = None,
                                 cuda: bool = False, max_batch: int = 1 << 20,
                                 checkpointed: bool = False) -> int:  # fmt: skip
    """The largest micro-batch whose step peak, counted tensor by tensor, fits ``budget_bytes``.

    Not in :mod:`labkit.formulas`: a search over ``labkit.memory``'s model of the step's tensors.

    A prediction from formulas alone, independent of any measurement:
    ``labkit.memory.predicted_step_peak`` lists every tensor alive at the step's peak (model
    states, batch, saved activations, logits and the head's gradients, ...), the terms the
    affine memory model of :func:`predict_max_batch` leaves out (``OMISSIONS``) included.
    ``cuda=True`` rounds each tensor as the CUDA caching allocator does (512-byte blocks).
    Returns 0 when not even one sequence fits. Dropout off (every preset has it).

    ``checkpointed=True``: every block checkpointed (``recomputation.apply_checkpointing(model,
    every=1)``); the peak is then the largest of the moments
    :func:`labkit.batching.recomputation.checkpointed_step_moments` lists.
    """
    from labkit import memory  # layer 3
    from labkit.batching import recomputation

    budget = checked_budget(budget_bytes)
    seq_len = checked_seq_len(cfg_model, seq_len)
    dtype = checked_dtype(dtype)

    def fits(b: int) -> bool:
        peak = (recomputation.predicted_checkpointed_step_peak if checkpointed
                else memory.predicted_step_peak)(cfg_model, b, dtype=dtype, seq_len=seq_len)
        return (peak.cuda_bytes if cuda else peak.bytes) <= budget

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= max_batch and fits(hi):  # the peak grows with b: double, then bisect
        lo, hi = hi, 2 * hi
    hi = min(hi, max_batch + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# ----------------------------------------------------------------------------------------------
# Notebook 05, section 2: the limit and its predictions, the found batch read against them, and
# the trials' figure (matplotlib imported only when drawing).


def agreement(predicted: int, found: int, *, step: str = "the step") -> str:
    """``predicted P, found F: +d (+x%): `` and whether they agree within ±3% (at least one
    sequence), or which way the count is off and why."""
    near = max(1, round(0.03 * found))  # ±3%, at least one sequence
    off = predicted - found
    return (f"{off:+d} ({off / found:+.0%}): "
            + (f"agrees within ±{near}" if abs(off) <= near else
               f"too high: {step} holds memory this count leaves out" if off > 0 else
               "too low: this count holds memory the step has already freed at its peak"))  # fmt: skip


@dataclass(frozen=True)
class LimitPrediction:
    """The limit section 2's finder searches under, and the largest batch predicted in it: by
    the memory model (where the finder starts), by every tensor alive at the step's peak, and
    calibrated with a measured slope per sequence."""

    budget: int | None
    """The finder's ``budget_bytes``: None for the whole card."""
    room: int
    """The bytes the predictions are for: the limit less what this process holds."""
    held: int
    """CUDA: what this process already held on the card; 0 on a CPU."""
    limit: str
    """The limit, in words."""
    predicted: BatchPrediction
    tensorwise: int
    slope: float
    """Measured bytes per sequence (section 1)."""
    on_gpu: bool

    @property
    def calibrated(self) -> int:
        return math.floor((self.room - self.predicted.model_state_bytes) / self.slope)

    def describe(self) -> str:
        p = self.predicted
        lines = [self.limit]
        if self.held:
            lines.append(f"this process already holds {self.held / 2**20:.1f} MiB on the card: "
                         f"every prediction below is for the {self.room / 2**20:,.0f} MiB left, "
                         "as the finder's")  # fmt: skip
        why = ("(the slope comes from live tensor bytes, the limit is the CUDA allocator's: two "
               "counts)" if self.on_gpu else "(not a test here: the slope was counted by the same "
               "live-tensor counter that enforces the budget)")  # fmt: skip
        lines += [f"predicted (the memory model, where the finder starts): {p.batch} "
                  f"(model states {p.model_state_bytes / 2**20:.2f} MiB + "
                  f"{p.bytes_per_sequence / 2**20:.3f} MiB per sequence)",
                  "predicted (every tensor alive at the step's peak, the omissions included: "
                  f"memory.predicted_step_peak): {self.tensorwise}",
                  f"calibrated with section 1's measured {self.slope / 2**20:.3f} MiB per "
                  f"sequence: {self.calibrated} " + why]  # fmt: skip
        return "\n".join(lines)


def limit_prediction(cfg: ModelConfig, *, device: str | torch.device, slope: float,
                     cpu_budget_mib: float, gpu_budget_gib: float | None = None,
                     dtype: str = "float32", seq_len: int | None = None) -> LimitPrediction:  # fmt: skip
    """On a GPU the card (or a ``gpu_budget_gib`` card emulated on it, less what this process
    holds, as the finder subtracts it); on a CPU a budget of ``cpu_budget_mib`` of live tensor
    bytes, chosen, not a device limit. Then the predictions in it."""
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    if on_gpu:
        budget = None if gpu_budget_gib is None else int(gpu_budget_gib * 2**30)
        card = torch.cuda.get_device_properties(device).total_memory
        emulated = "the whole card" if budget is None else f"a {gpu_budget_gib} GiB card emulated on"
        limit = (f"limit: {emulated} {torch.cuda.get_device_name(device)} "
                 f"({card / 2**30:.1f} GiB)")  # fmt: skip
        held = torch.cuda.memory_allocated(device)  # what this process already holds on the card
    else:
        budget = card = int(cpu_budget_mib * 2**20)
        limit = (f"limit: a budget of {budget / 2**20:g} MiB of live tensor bytes (chosen, not a "
                 "device limit)")  # fmt: skip
        held = 0
    room = (budget or card) - held  # the finder subtracts what is held the same way
    predicted = predict_max_batch(cfg, room, dtype=dtype, seq_len=seq_len,
                                  dropout_mask_bytes=1 if on_gpu else 4)  # fmt: skip
    tensorwise = predict_max_batch_tensorwise(cfg, room, dtype=dtype, seq_len=seq_len,
                                              cuda=on_gpu)  # fmt: skip
    return LimitPrediction(budget=budget, room=room, held=held, limit=limit, predicted=predicted,
                           tensorwise=tensorwise, slope=slope, on_gpu=on_gpu)  # fmt: skip


def describe_found(found: MaxBatchResult, limit: LimitPrediction) -> str:
    """The finder's summary, and the found batch against each prediction of ``limit``."""
    lines = [found.summary()]
    if found.predicted != limit.predicted.batch:  # CUDA: the finder reads its baseline after a warm-up
        lines.append(f"(the finder's own prediction is {found.predicted}: its baseline, read after "
                     f"one warm-up step, is {found.baseline_bytes / 2**20:.1f} MiB, "
                     f"{(found.baseline_bytes - limit.held) / 2**20:+.1f} MiB against what this "
                     "process held before: library workspaces allocated on first use)")  # fmt: skip
    for what, value in (("the memory model", limit.predicted.batch),
                        ("every tensor at the peak", limit.tensorwise)):  # fmt: skip
        lines.append(f"predicted {value} by {what}, found {found.found}: "
                     + agreement(value, found.found))  # fmt: skip
    lines.append(f"calibrated {limit.calibrated}: {limit.calibrated - found.found:+d}")
    if found.baseline_bytes is not None:
        lines.append(f"CUDA allocator back at its baseline of {found.baseline_bytes / 2**20:.1f} "
                     f"MiB after each of the {len(found.trials)} trials (checked; "
                     f"{found.failures} were real OOMs)")  # fmt: skip
    return "\n".join(lines)


def plot_trials(found: MaxBatchResult, limit: LimitPrediction, ax: object = None) -> object:
    """Each trial at its peak bytes (fitted, or the bytes at the failure), beside the memory
    model, the model states plus the measured slope, the limit and the found batch."""
    import matplotlib.pyplot as plt  # here, so that importing labkit stays light

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.4))
    for t in found.trials:
        if t.peak_bytes is not None:
            ax.plot(t.batch, t.peak_bytes / 2**20, "o" if t.fits else "x", ms=8,
                    c="C2" if t.fits else "C3")  # fmt: skip
    ax.plot([], [], "o", c="C2", label="fitted (measured peak)")
    ax.plot([], [], "x", c="C3", label="failed (bytes at the failure)")
    top = max(t.batch for t in found.trials)
    predicted, slope = limit.predicted, limit.slope
    ax.plot([1, top], [predicted.peak_bytes(1) / 2**20, predicted.peak_bytes(top) / 2**20], "--",
            c="grey", label="memory model (predicted)")  # fmt: skip
    states = predicted.model_state_bytes
    ax.plot([1, top], [(states + slope) / 2**20, (states + top * slope) / 2**20], ":", c="C0",
            label="model states + section 1's measured slope (calibrated)")  # fmt: skip
    ax.axhline(found.budget_bytes / 2**20, c="k", lw=1, label="limit")
    ax.axvline(found.found, c="C2", ls=":", label=f"found: {found.found}")
    ax.set(xlabel="micro-batch", ylabel="MiB", title="the finder's trials")
    ax.legend(fontsize=8)
    return ax


def describe_two_searches(mine: int, found: MaxBatchResult, *, whose: str) -> str:
    """The learner's search against the finder's, under the same limit. Near the limit a real
    allocator's edge is not sharp (measured on an H200, 2026-12-04: 186 against the finder's
    188): batches within a few of it fit or fail by what the earlier trials left in the caching
    allocator."""
    line = f"the search in largest_batch ({whose}) found {mine}; the finder found {found.found}"
    if mine == found.found:
        return line
    off = abs(mine - found.found)
    return (line + f"\nthey differ by {off} ({off / found.found:.1%}): near the limit a real "
            "allocator's edge is not sharp: whether a batch fits depends on how earlier trials "
            "left its memory blocks, so two searches that try different batches on the way can "
            "end a few apart")  # fmt: skip
