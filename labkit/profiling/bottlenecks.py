"""Three training bottlenecks, each planted, measured, fixed and measured again.

Notebook 06 profiles them; this module builds and measures them, so the notebook only
orchestrates and a DataLoader worker process can import the dataset (a class defined in a
notebook cannot be unpickled in a worker: pytorch #20375).

1. **Data loading.** :class:`TokenizingDataset` tokenises raw text in Python inside
   ``__getitem__``, as a real pipeline does on the fly. With ``num_workers=0`` the training
   process does that work between steps, and the trace shows a ``data`` range as long as the
   compute; worker processes, prefetching and persistent workers move it off the critical
   path (:func:`loader_variants`, :func:`make_loader`, :func:`measure_data_loading`).
2. **Python overhead and many small kernels.** A small model is launch-bound: each operator
   costs microseconds of Python and dispatch whatever its size. ``torch.compile`` fuses
   operators into fewer, larger kernels and, with ``mode="reduce-overhead"`` on CUDA, replays
   the step as a CUDA graph with one launch (:func:`measure_compile`).
3. **Host-device synchronisation.** ``loss.item()`` every step makes the CPU wait for the GPU
   to drain its queue, so the CPU cannot run ahead and launch the next step's kernels. A CPU
   has no such queue, and :func:`measure_sync` says so instead of showing an effect it
   cannot have.

Typical use (what notebook 06 does at smoke size)::

    cfg = config.preset("smoke")
    hardware.limit_cpu_threads(1)
    passes = calibrate_passes(0.015, batch_size=cfg.train.micro_batch)  # ~ one smoke step
    ds = TokenizingDataset(seq_len=cfg.model.seq_len, passes=passes, n_items=64)
    data = measure_data_loading(cfg, ds)  # BeforeAfter: num_workers=0 ... workers, persistent
    comp = measure_compile(cfg)           # CompileResult: compile time, eager vs compiled
    sync = measure_sync(cfg)              # SyncResult: .item() every step vs every K steps
    print(data, comp, sync, sep="\n\n")

A cold compile of the smoke GPT (forward and backward) takes about a minute on a 2-core
machine, nearly all of it building C++ kernels; with inductor's cache warm it takes seconds.

Every step is :func:`phased_step`, in the run's precision (``cfg.train.dtype``, autocast as
``labkit.train`` applies it), so a bf16 run is measured in bf16. Every result keeps its
samples (seconds per step), the device, and how they were measured;
``tokens_per_s`` is derived from the median step. Nothing here asserts or assumes a speed-up:
on a 2-core machine worker processes compete with the training process for the cores, so
the numbers decide.

Sources: PyTorch ``torch.utils.data`` docs (multi-process loading, memory pinning,
``prefetch_factor``, ``persistent_workers``) https://docs.pytorch.org/docs/stable/data.html;
``torch.compile`` https://docs.pytorch.org/docs/stable/generated/torch.compile.html;
CUDA semantics, asynchronous execution
https://docs.pytorch.org/docs/stable/notes/cuda.html#asynchronous-execution; the performance
tuning guide ("avoid unnecessary CPU-GPU synchronization")
https://docs.pytorch.org/tutorials/recipes/recipes/tuning_guide.html.
"""

from __future__ import annotations

import copy
import html
import math
import os
import re
import statistics
import time
import unicodedata
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from labkit import timing, verdict
from labkit.config import RunConfig
from labkit.data import get_batch, load_splits
from labkit.errors import LabkitError
from labkit.jobs import procs
from labkit.model import GPT
from labkit.profiling.phases import phase
from labkit.train import DTYPES, autocast, make_optimizer, resolve_device

__all__ = [
    "BatchStream",
    "BeforeAfter",
    "CompileResult",
    "CompileUnavailable",
    "DatasetItemError",
    "EpochSampler",
    "LoaderError",
    "LoaderVariant",
    "Measured",
    "SyncResult",
    "TokenizingDataset",
    "annotated_step",
    "calibrate_passes",
    "check_compiler",
    "compile_loss_rtol",
    "default_workers",
    "loader_variants",
    "make_loader",
    "measure_compile",
    "measure_data_loading",
    "measure_loader",
    "measure_sync",
    "tokenize",
    "use_inductor_cache",
]

Batch = tuple[torch.Tensor, torch.Tensor]


# ---------------------------------------------------------------------------------------
# Results


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
        rows = self._table()
        head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
                       for r in rows[1:])  # fmt: skip
        foot = "".join(f"<p>{html.escape(line)}</p>" for line in self._footer())
        return (f"<p><b>{html.escape(self._header())}</b></p><table><thead><tr>{head}</tr>"
                f"</thead><tbody>{body}</tbody></table>{foot}")


def _tokens_per_step(cfg: RunConfig) -> int:
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


def _device(cfg: RunConfig, device: torch.device | str | None) -> torch.device:
    return resolve_device(cfg.train.device) if device is None else resolve_device(str(device))


def _models(cfg: RunConfig, device: torch.device, n: int) -> list[tuple[nn.Module, Any]]:
    """``n`` copies of one freshly initialised GPT (same weights), each with its own AdamW."""
    torch.manual_seed(cfg.train.seed)
    base = GPT(cfg.model).to(device).train()
    out = []
    for _ in range(n):
        model = copy.deepcopy(base)
        out.append((model, make_optimizer(model, cfg.train)))
    return out


# ---------------------------------------------------------------------------------------
# 1. Data loading: a dataset that tokenises in __getitem__


# GPT-2's pre-tokeniser splits text into words, numbers, punctuation runs and whitespace
# before encoding (openai/gpt-2, src/encoder.py: ``re.findall(self.pat, text)``). Its pattern
# uses \p{L} and \p{N} from the third-party ``regex`` module; this is the same split written
# with the standard library's ``re``: letters are [^\W\d_], and underscore joins punctuation,
# so every character falls in exactly one alternative and joining the pieces gives the text.
PRETOKENIZE = re.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:_|[^\s\w])+|\s+(?!\S)|\s+"""
)
_ESCAPED = range(0xDC80, 0xDD00)  # bytes that are not UTF-8, after decode("surrogateescape")


def tokenize(raw: bytes) -> list[int]:
    """Raw bytes → clean text → byte-level tokens, in Python, the way a tokeniser works.

    Decode (undecodable bytes kept as surrogate escapes, PEP 383), normalise to Unicode NFC,
    pre-tokenise with GPT-2's split, then encode every piece character by character to its
    UTF-8 bytes. On labkit's corpus (ASCII, ``\\n`` line ends) every step maps the text to
    itself, so the tokens equal the raw bytes, which :class:`TokenizingDataset` checks; on
    other text NFC may change it.
    """
    text = unicodedata.normalize("NFC", raw.decode("utf-8", errors="surrogateescape"))
    tokens: list[int] = []
    for piece in PRETOKENIZE.findall(text):
        for ch in piece:
            cp = ord(ch)
            if cp < 0x80:  # ASCII: one byte, the code point itself
                tokens.append(cp)
            elif cp in _ESCAPED:  # a byte that was not valid UTF-8, restored as it was
                tokens.append(cp - 0xDC00)
            else:
                tokens.extend(ch.encode("utf-8"))
    return tokens


class DatasetItemError(ValueError, LabkitError):
    """An item of :class:`TokenizingDataset` could not be produced (or a planted fault)."""


class TokenizingDataset(Dataset):
    """Windows of raw corpus text, tokenised in ``__getitem__``: a data pipeline with real work.

    Item ``i`` is the window ``data[i*T : i*T + T + 1]`` (T = ``seq_len``), the same windows
    ``labkit.data.BatchIterator`` cuts, returned as ``(x, y)``: int64 (T,) each, ``y`` being
    ``x`` shifted by one token. Instead of slicing a tensor of tokens, the item keeps the
    window as raw bytes and runs :func:`tokenize` on it ``passes`` times.

    Args:
        data: 1-D uint8 tokens (bytes); default the training split of labkit's corpus.
        seq_len: tokens per sequence, T.
        passes: how many times ``__getitem__`` runs the tokeniser on its window. 1 is what a
            byte-level pipeline costs; more stands for heavier preprocessing (a BPE tokeniser
            walks the text once per merge rule; augmentation adds passes of its own) and is
            the knob that makes the loader the bottleneck. Every pass yields the same tokens.
        n_items: use only the first this many windows (short epochs show what happens at an
            epoch boundary: new workers unless they are persistent); default all.
        fail_at: item index that raises :class:`DatasetItemError`: a planted fault, to see how
            an error inside a worker process reaches the training loop.
    """

    def __init__(self, data: torch.Tensor | None = None, seq_len: int = 64, *, passes: int = 1,
                 n_items: int | None = None, fail_at: int | None = None) -> None:
        for name, value in (("seq_len", seq_len), ("passes", passes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed: a positive integer")
        if data is None:
            data = load_splits().train
        if not isinstance(data, torch.Tensor) or data.dim() != 1 or data.dtype != torch.uint8:
            raise ValueError("data must be a 1-D torch.uint8 tensor of byte tokens (such as "
                             "labkit.data.load_splits().train)")  # fmt: skip
        available = (data.numel() - 1) // seq_len if data.numel() > seq_len else 0
        if n_items is None:
            n_items = available
        if isinstance(n_items, bool) or not isinstance(n_items, int) or not 1 <= n_items <= available:
            raise ValueError(f"n_items={n_items!r} is not allowed: {data.numel()} tokens hold "
                             f"{available} windows of seq_len={seq_len}; choose 1..{available}")  # fmt: skip
        self.seq_len, self.passes, self.n_items, self.fail_at = seq_len, passes, n_items, fail_at
        # Raw bytes, only as many as the items need: cheap to send to a worker process.
        self.raw = data[: n_items * seq_len + 1].cpu().numpy().tobytes()

    def __len__(self) -> int:
        return self.n_items

    def __getitem__(self, i: int) -> Batch:
        if not 0 <= i < self.n_items:
            raise IndexError(f"item {i} of a TokenizingDataset with {self.n_items} items")
        if i == self.fail_at:
            raise DatasetItemError(f"item {i}: planted fault (TokenizingDataset(fail_at={i}))")
        T = self.seq_len
        raw = self.raw[i * T : i * T + T + 1]
        tokens: list[int] = []
        for _ in range(self.passes):
            tokens = tokenize(raw)
        if len(tokens) != T + 1:
            raise DatasetItemError(
                f"item {i}: cleaning changed the window from {T + 1} to {len(tokens)} tokens "
                "(NFC normalisation merged or split characters); use byte-clean text such as "
                "labkit's corpus, or pad/crop windows after tokenising")
        window = torch.tensor(tokens, dtype=torch.int64)  # (T+1,)
        return window[:-1], window[1:]  # x: tokens 0..T-1, y: tokens 1..T (the next token)


def calibrate_passes(target_batch_s: float, *, batch_size: int, seq_len: int = 64,
                     data: torch.Tensor | None = None, items: int = 16,
                     clock: Callable[[], float] = time.perf_counter) -> int:
    """The ``passes`` that make one batch cost about ``target_batch_s`` to load, here.

    An item costs a fixed part (slicing, building tensors) plus a part per pass. Both are
    measured: ``items`` items at 1 pass and at 21 passes, best of three each (skipping a moment
    another process stole the core), and the slope between them is the cost of one pass. Use
    it to make the loader the bottleneck by a chosen margin on any machine, e.g.
    ``calibrate_passes(compute_step_s, batch_size=8)``: loading then takes half of each step
    with ``num_workers=0``, and one worker can hide all of it (a worker can hide at most one
    step's worth: with more loading than that per batch, the steps wait for it anyway).
    """
    if not target_batch_s > 0:
        raise ValueError(f"target_batch_s={target_batch_s!r} is not allowed: seconds > 0")

    def per_item(passes: int) -> float:
        ds = TokenizingDataset(data, seq_len, passes=passes, n_items=items)
        best = math.inf
        for _ in range(3):
            t0 = clock()
            for i in range(items):
                ds[i]
            best = min(best, (clock() - t0) / items)
        return best

    one, many = per_item(1), per_item(21)
    per_pass = max((many - one) / 20, 1e-9)
    fixed = max(one - per_pass, 0.0)
    return max(1, round((target_batch_s / batch_size - fixed) / per_pass))


# ---------------------------------------------------------------------------------------
# 1. Data loading: loaders, a stream that cleans up, the measured loop


@dataclass(frozen=True)
class LoaderVariant:
    """One DataLoader configuration (the DataLoader arguments of the same names).

    ``pin_memory``: page-locked host buffers, so the copy to a CUDA GPU can run asynchronously
    (``non_blocking=True``) and faster; it only concerns host-to-GPU copies, so it is refused
    on a CPU (https://docs.pytorch.org/docs/stable/data.html#memory-pinning).
    ``prefetch_factor``: batches each worker loads ahead (PyTorch's default is 2 when there are
    workers). ``persistent_workers``: keep the worker processes between epochs instead of
    starting new ones at each epoch.
    """

    name: str
    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int | None = None
    persistent_workers: bool = False

    def __post_init__(self) -> None:
        w = self.num_workers
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"{self.name}: num_workers={w!r} is not allowed: an integer >= 0")
        if w == 0 and (self.prefetch_factor is not None or self.persistent_workers):
            raise ValueError(f"{self.name}: prefetch_factor and persistent_workers need worker "
                             "processes: set num_workers >= 1 or leave them unset")  # fmt: skip
        if self.prefetch_factor is not None and self.prefetch_factor < 1:
            raise ValueError(f"{self.name}: prefetch_factor={self.prefetch_factor!r} is not "
                             "allowed: an integer >= 1")  # fmt: skip

    def settings(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers, "pin_memory": self.pin_memory,
                "prefetch_factor": self.prefetch_factor,
                "persistent_workers": self.persistent_workers}  # fmt: skip


def default_workers() -> int:
    """Worker processes that leave one core to the training process: cores - 1, 1 to 4.

    A worker tokenising text keeps a core busy; so does the training process on a CPU, and on
    a GPU the process launching kernels. More workers than free cores only take turns with
    the training process (measured on this course's 2-core machine: two workers slowed the
    training steps themselves by more than they saved).
    """
    return min(4, max(1, (os.cpu_count() or 1) - 1))


def loader_variants(device: torch.device | str = "cpu", *, workers: int | None = None,
                    prefetch_factor: int = 4) -> tuple[LoaderVariant, ...]:
    """The ladder of fixes, first the planted bottleneck, last the full fix.

    ``num_workers=0``; ``workers`` worker processes (default :func:`default_workers`); (CUDA
    only) plus ``pin_memory``; plus ``prefetch_factor`` and ``persistent_workers``.
    """
    workers = default_workers() if workers is None else workers
    cuda = timing.as_device(device).type == "cuda"
    pin = ", pin_memory" if cuda else ""
    ladder = [LoaderVariant("num_workers=0"),
              LoaderVariant(f"num_workers={workers}", num_workers=workers)]  # fmt: skip
    if cuda:
        ladder.append(LoaderVariant(f"num_workers={workers}{pin}", num_workers=workers,
                                    pin_memory=True))  # fmt: skip
    ladder.append(LoaderVariant(f"num_workers={workers}{pin}, prefetch_factor={prefetch_factor}, "
                                "persistent_workers", num_workers=workers, pin_memory=cuda,
                                prefetch_factor=prefetch_factor, persistent_workers=True))  # fmt: skip
    return tuple(ladder)


class EpochSampler(Sampler[int]):
    """A new random order of ``n`` items at each epoch, drawn from ``seed + epoch``.

    Each ``iter()`` is an epoch. The order depends only on the seed and the epoch number, not
    on how much of the previous epoch was consumed: ``RandomSampler`` with a shared generator
    draws its next permutation when a prefetching worker reaches the end of an epoch, so a
    loader with workers and one without would drift apart. ``DistributedSampler`` and
    ``labkit.data.BatchIterator`` seed each epoch the same way.
    """

    def __init__(self, n: int, *, seed: int = 0) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        self.epoch += 1
        return iter(torch.randperm(self.n, generator=g).tolist())


def make_loader(dataset: Dataset, variant: LoaderVariant, *, batch_size: int, seed: int = 0,
                device: torch.device | str = "cpu", timeout_s: float = 120.0) -> DataLoader:
    """A DataLoader over ``dataset`` configured as ``variant``, shuffled by a seeded sampler.

    The order is :class:`EpochSampler`'s (epoch ``e`` shuffled with ``seed + e``), and batches
    come back in sampler order whatever the number of workers (``in_order=True``, the default),
    so every variant with the same seed yields the same batches in the same order. The last
    partial batch is dropped, so every step has the same size. ``timeout_s`` bounds the wait
    for a worker's batch: a hung worker raises instead of stalling the notebook.
    """
    if variant.pin_memory and timing.as_device(device).type != "cuda":
        raise ValueError(f"{variant.name}: pin_memory only speeds copies from host to a CUDA "
                         f"GPU and this run is on {device}: leave it off here")  # fmt: skip
    sampler = EpochSampler(len(dataset), seed=seed)  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    if variant.num_workers > 0:
        kwargs = {"prefetch_factor": variant.prefetch_factor or 2, "timeout": timeout_s,
                  "persistent_workers": variant.persistent_workers}  # fmt: skip
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True,
                        num_workers=variant.num_workers, pin_memory=variant.pin_memory,
                        **kwargs)  # fmt: skip
    if len(loader) == 0:
        raise ValueError(f"{len(dataset)} items make no batch of batch_size={batch_size}: "  # type: ignore[arg-type]
                         "use more items or a smaller batch")
    return loader


class LoaderError(RuntimeError, LabkitError):
    """A batch could not be loaded; the loader's worker processes have been shut down."""


class BatchStream:
    """Batches from ``loader`` across epochs, with its worker processes shut down on exit.

        with BatchStream(loader) as stream:
            x, y = next(stream)

    A new epoch starts (``iter(loader)``) when one ends, so a run can be longer than an epoch.
    On leaving the block (normally, on an error, or on an interrupt) the current iterator's
    workers are shut down, persistent ones included, as Lightning does between fits
    (``_shutdown_workers()`` on the iterator, then dropping the loader's ``_iterator``:
    lightning/pytorch/loops/utilities.py). Without this a persistent worker lives as long as
    its loader, and a traceback that holds the loop's frame keeps a plain iterator's workers
    alive too. An exception from a worker is raised as :class:`LoaderError` naming the
    loader's settings, the worker's own message, and what to fix.
    """

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self.epochs = 0
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> Any:
        for _ in range(2):  # at most one epoch boundary per batch (make_loader refuses empty)
            if self._it is None:
                self._it = iter(self.loader)
                self.epochs += 1
            try:
                return next(self._it)
            except StopIteration:
                self._it = None
            except Exception as exc:
                self.close()
                last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                raise LoaderError(
                    f"the DataLoader (num_workers={self.loader.num_workers}) failed to load a "
                    f"batch: {last}. Its workers are shut down. The worker's traceback is "
                    "chained above; fix the Dataset's __getitem__ (it runs in the worker "
                    "process) and run again") from exc
        raise LoaderError("the DataLoader yielded no batch in a whole epoch: give it more items")

    def close(self) -> None:
        """Shut down worker processes, if any are running. Safe to call twice."""
        for it in (self._it, getattr(self.loader, "_iterator", None)):
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        self._it = None
        if getattr(self.loader, "_iterator", None) is not None:
            self.loader._iterator = None  # a persistent iterator, now without workers

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def measure_loader(model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader, *,
                   steps: int, warmup: int = 2, device: torch.device | str = "cpu",
                   name: str = "loader", settings: Mapping[str, Any] | None = None,
                   dtype: str = "float32") -> Measured:
    """Train ``warmup + steps`` real steps on batches from ``loader``; time the phases.

    ``dtype`` is the run's autocast dtype (:func:`phased_step`).

    Each step runs ``phase("data")`` (wait for the next batch, then send it to ``device``),
    then ``forward``, ``backward`` and ``optimizer``, and synchronises the device. Times are
    ``time.perf_counter`` reads: ``data`` from the step's start to the batch's arrival,
    ``compute`` from there to the end of the synchronised step. On CUDA the queue is empty at
    each step's start (the previous step was synchronised), so a pageable copy, which blocks
    the host, counts as data and a pinned ``non_blocking`` copy is queued before the forward
    and counts as compute. The first ``warmup`` steps (worker start-up, allocator growth) are
    run but not counted. Worker processes are shut down before this returns or raises.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} is not allowed: an integer >= 1")
    device = timing.as_device(device)
    non_blocking = bool(loader.pin_memory) and device.type == "cuda"
    data_s: list[float] = []
    step_s: list[float] = []
    losses: list[torch.Tensor] = []
    tokens = 0
    with BatchStream(loader) as stream:
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            with phase("data"):
                x, y = next(stream)
                x = x.to(device, non_blocking=non_blocking)
                y = y.to(device, non_blocking=non_blocking)
            t1 = time.perf_counter()
            losses.append(phased_step(model, optimizer, x, y, dtype=dtype))
            timing.synchronize(device)
            t2 = time.perf_counter()
            tokens = x.numel()
            if i >= warmup:
                data_s.append(t1 - t0)
                step_s.append(t2 - t0)
    return Measured(
        name=name, step_s=tuple(step_s), data_s=tuple(data_s), tokens_per_step=tokens,
        device=str(device), losses=tuple(torch.stack(losses).tolist()),
        method=("perf_counter per step, device synchronised at each step's end; data = wait "
                "for the batch + its copy to the device"),
        settings=dict(settings or {}),
    )


def measure_data_loading(cfg: RunConfig, dataset: Dataset, *,
                         variants: Sequence[LoaderVariant] | None = None, steps: int = 8,
                         warmup: int = 2, rounds: int = 2, device: torch.device | str | None = None,
                         progress: Callable[[str], None] | None = None) -> BeforeAfter:
    """Train the GPT from each loader variant in turn; before = the first, after = the last.

    Every variant trains its own copy of the same initial model on the same batches in the
    same order (seeded sampler), so their losses match and only the loading differs. The
    variants take turns in ``rounds`` blocks of ``warmup + steps`` steps (A B C, then C B A:
    a busy moment of a shared machine falls on all of them), each block with fresh workers,
    shut down at its end so no variant's workers run during another's block.
    ``progress`` receives one line per block. Every step runs in ``cfg.train.dtype``.
    """
    device = _device(cfg, device)
    variants = tuple(variants or loader_variants(device))
    if not variants:
        raise ValueError("variants is empty: give at least one LoaderVariant")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r} is not allowed: an integer >= 1")
    runs = _models(cfg, device, len(variants))
    loaders = [make_loader(dataset, v, batch_size=cfg.train.micro_batch, seed=cfg.train.seed,
                           device=device) for v in variants]  # fmt: skip
    got: dict[int, list[Measured]] = {i: [] for i in range(len(variants))}
    for r in range(rounds):
        order = range(len(variants)) if r % 2 == 0 else reversed(range(len(variants)))
        for i in order:
            (model, opt), v = runs[i], variants[i]
            m = measure_loader(model, opt, loaders[i], steps=steps, warmup=warmup, device=device,
                               name=v.name, settings=v.settings(),
                               dtype=cfg.train.dtype)  # fmt: skip
            got[i].append(m)
            if progress is not None:
                progress(f"round {r + 1}/{rounds}  {v.name:<52} median step "
                         f"{timing.format_seconds(m.median_s)}, data wait "
                         f"{100 * (m.data_share or 0):.0f}%")  # fmt: skip
    pooled = tuple(_pool(got[i]) for i in range(len(variants)))
    cores = os.cpu_count() or 1
    if device.type == "cuda":
        note = ("Workers load batches in other processes while the GPU computes; pin_memory "
                "lets the copy to the GPU run asynchronously. Look in the trace for the gap "
                "between steps: the data range.")
    else:
        note = (f"On this CPU the workers are processes that compete with training for its "
                f"{cores} cores, so they help only while a core is free: measured, not assumed. "
                "pin_memory is left out: it only speeds host-to-GPU copies.")
    return BeforeAfter(bottleneck="data loading", before=pooled[0], after=pooled[-1],
                       variants=pooled, note=note)  # fmt: skip


def _pool(parts: Sequence[Measured]) -> Measured:
    """One Measured holding the samples of several blocks of the same way of training."""
    first = parts[0]
    return Measured(
        name=first.name, step_s=tuple(s for p in parts for s in p.step_s),
        data_s=tuple(s for p in parts for s in p.data_s), tokens_per_step=first.tokens_per_step,
        device=first.device, method=first.method, settings=first.settings,
        losses=tuple(v for p in parts for v in p.losses),
    )


# ---------------------------------------------------------------------------------------
# 2. torch.compile


INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def use_inductor_cache() -> Path:
    """Point inductor's on-disk cache at ``labkit_home()/inductor`` unless the user chose one.

    By default the cache lives in the temp directory (``/tmp/torchinductor_<user>``:
    https://docs.pytorch.org/tutorials/recipes/torch_compile_caching_tutorial.html), which a
    launcher or a cleaned ``/tmp`` throws away, and a cold compile of even the smoke GPT costs
    tens of seconds on a 2-core machine. labkit's launcher gives jobs the same folder. Called
    by :func:`measure_compile`, never at import. Inductor reads the variable when it first
    needs the cache, so call this before the first compile in the process.
    """
    current = os.environ.get(INDUCTOR_CACHE_ENV)
    # Torch fills the variable in with its default the first time anything asks for the cache
    # folder (torch._inductor.runtime.cache_dir_utils.cache_dir; the profiler's memory
    # timeline does), so "set" is not "chosen by the user": the default value is replaced too.
    if current is None or current == _torch_default_cache_dir():
        os.environ[INDUCTOR_CACHE_ENV] = str(procs.labkit_home() / "inductor")
    return Path(os.environ[INDUCTOR_CACHE_ENV])


def _torch_default_cache_dir() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # pragma: no cover - older or newer torch: keep what is set
        return None
    return default_cache_dir()


class CompileUnavailable(RuntimeError, LabkitError):
    """``torch.compile`` cannot build kernels here (no C++ compiler on CPU, no Triton on CUDA)."""


_CXX_FIX = ("inductor turns the model into C++ on a CPU and needs a C++ compiler: install "
            "one (Debian/Ubuntu: `sudo apt install g++`; conda: `conda install -c conda-forge "
            "gxx`) or name yours in the CXX environment variable, then restart the kernel")  # fmt: skip


def check_compiler(device: torch.device | str = "cpu") -> str:
    """The C++ compiler inductor will use on a CPU, found the way inductor finds it.

    Raises :class:`CompileUnavailable` naming the fix when there is none. On CUDA inductor
    writes Triton kernels instead; that is checked by compiling.
    """
    if timing.as_device(device).type != "cpu":
        return "not needed (inductor generates Triton kernels on CUDA)"
    from torch._inductor import config as inductor_config  # the search inductor runs itself
    from torch._inductor import cpp_builder, exc

    try:
        return cpp_builder.cpp_compiler_search(tuple(inductor_config.cpp.cxx))
    except exc.InvalidCxxCompiler as err:
        tried = [c for c in inductor_config.cpp.cxx if c]
        raise CompileUnavailable(f"no working C++ compiler (tried {tried}): {_CXX_FIX}") from err


@dataclass(frozen=True, kw_only=True)
class CompileResult(BeforeAfter):
    """Eager (before) against ``torch.compile`` (after), with the compile's own cost."""

    compile_s: float
    """Wall time of the compiled model's first forward + backward: tracing, code generation,
    building kernels (or loading them from the cache) and running them once."""
    loss_eager: float
    loss_compiled: float
    """The losses of one batch, compared before any timing."""
    rtol: float
    atol: float
    mode: str
    scope: Literal["model", "blocks"]
    cache_dir: str
    cache: str
    """What inductor's FX-graph cache did during the first call: "cold" (compiled every
    graph), "warm" (loaded every graph), "mixed", or "unknown"."""

    @property
    def break_even_steps(self) -> float:
        """Steps after which the compile has paid for itself (inf if it never does)."""
        saved = self.before.median_s - self.after.median_s
        return self.compile_s / saved if saved > 0 else math.inf

    def _footer(self) -> list[str]:
        return [f"compile (first forward+backward): {self.compile_s:.1f} s, inductor cache "
                f"{self.cache} ({self.cache_dir}); loss eager {self.loss_eager:.6f}, compiled "
                f"{self.loss_compiled:.6f} (tolerance rtol={self.rtol:g}, atol={self.atol:g})",
                *super()._footer()]  # fmt: skip


def _cache_counts() -> tuple[int, int] | None:
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - every torch 2.x has it
        return None
    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def _cache_state(before: tuple[int, int] | None, after: tuple[int, int] | None) -> str:
    if before is None or after is None:
        return "unknown"
    hits, misses = after[0] - before[0], after[1] - before[1]
    if hits and not misses:
        return "warm"
    if misses and not hits:
        return "cold"
    return "mixed" if hits else "unknown"


def _compile(model: nn.Module, scope: str, mode: str | None, dynamic: bool,
             backend: str = "inductor") -> nn.Module:
    if scope == "model":
        return torch.compile(model, mode=mode, dynamic=dynamic, backend=backend)  # type: ignore[return-value]
    # Regional compilation: compile the repeated block, not the whole model. The blocks share
    # one compiled graph (their parameters are inputs, not constants, since PyTorch 2.5), so
    # inductor compiles one block's forward and backward instead of the whole network:
    # https://docs.pytorch.org/tutorials/recipes/regional_compilation.html
    for block in model.blocks:  # type: ignore[union-attr]
        block.compile(mode=mode, dynamic=dynamic, backend=backend)
    return model


def compile_loss_rtol(dtype: str) -> float:
    """How far a compiled model's loss may be from eager's, relative, in precision ``dtype``.

    float32: 1e-4 (fused kernels only reorder sums). In bf16 or fp16 eager rounds every
    intermediate to the 16-bit format while inductor keeps a fused kernel's intermediates in
    float32, so the two may differ by a unit of the format: 2 × its eps (``torch.finfo``: bf16
    2**-7, fp16 2**-10).
    """
    if dtype == "float32":
        return 1e-4
    return 2 * torch.finfo(DTYPES[dtype]).eps


def measure_compile(cfg: RunConfig, *, device: torch.device | str | None = None,
                    mode: str | None = "auto", scope: Literal["model", "blocks"] = "model",
                    dynamic: bool = False, rounds: int = 10, warmup: int = 2,
                    rtol: float | None = None, atol: float = 1e-5,
                    backend: str = "inductor") -> CompileResult:
    """Compile the GPT, time the compile, check its loss against eager, then time both.

    1. Two copies of one initialised GPT, each with its own AdamW. One is compiled:
       ``scope="model"`` compiles the whole model; ``scope="blocks"`` only its transformer
       blocks (regional compilation: less to compile, so a shorter cold start).
       ``mode="auto"`` is inductor's default on CPU and ``"reduce-overhead"`` (CUDA graphs:
       one launch replays the step's kernels) on CUDA. ``dynamic=False``: the shapes never
       change here, so no dynamic-shape graph is attempted.
    2. The compiled copy's first forward + backward on a batch is timed (``compile_s``), and
       its loss must equal eager's on the same batch within ``|Δ| <= atol + rtol·|eager|``
       (fused kernels reorder sums, so not bit for bit; ``rtol=None`` is
       :func:`compile_loss_rtol` of ``cfg.train.dtype``), else ValueError. No
       optimizer step is taken, so both copies still hold the same weights.
    3. Eager and compiled training steps alternate (``labkit.timing.alternate``: E C, C E, ...)
       on the same batches; ``warmup`` rounds are not counted (CUDA graphs record there).

    ``backend`` is torch.compile's: "inductor" (the default, what generates fused kernels) or,
    say, "aot_eager" (traces forward and backward but runs them with eager kernels: no code
    generation, so seconds instead of a minute, and no speed-up; the tests use it to check
    this function's own work).

    Inductor's cache goes to ``labkit_home()/inductor`` unless TORCHINDUCTOR_CACHE_DIR is set
    (:func:`use_inductor_cache`): a second run loads the kernels instead of building them.
    Raises :class:`CompileUnavailable` when there is no C++ compiler (CPU) or the backend fails.
    """
    if scope not in ("model", "blocks"):
        raise ValueError(f"scope={scope!r} is not allowed: 'model' or 'blocks'")
    device = _device(cfg, device)
    if mode == "auto":
        mode = "reduce-overhead" if device.type == "cuda" else None
    cache_dir = use_inductor_cache()
    if backend == "inductor":
        check_compiler(device)
    (eager, opt_e), (base, opt_c) = _models(cfg, device, 2)
    compiled = _compile(base, scope, mode, dynamic, backend)
    # CUDA graphs: https://docs.pytorch.org/docs/stable/generated/torch.compile.html
    cudagraphs = device.type == "cuda" and mode in ("reduce-overhead", "max-autotune")

    train, _ = load_splits()
    g = torch.Generator().manual_seed(cfg.train.seed)
    n_batches = warmup + rounds + 1
    batches = [get_batch(train, cfg.train.micro_batch, cfg.model.seq_len, g, device)
               for _ in range(n_batches)]  # fmt: skip

    dtype = cfg.train.dtype  # both copies train in the run's precision (phased_step)
    if rtol is None:
        rtol = compile_loss_rtol(dtype)
    x, y = batches[0]
    with autocast(device, dtype):
        _, loss_e = eager(x, y)
    loss_e.backward()
    counts = _cache_counts()
    timing.synchronize(device)
    t0 = time.perf_counter()
    try:
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        with autocast(device, dtype):
            _, loss_c = compiled(x, y)
        loss_c.backward()
        timing.synchronize(device)
    except Exception as err:
        raise _compile_error(err, device) from err
    compile_s = time.perf_counter() - t0
    cache = _cache_state(counts, _cache_counts())
    loss_eager, loss_compiled = loss_e.item(), loss_c.item()
    if not abs(loss_compiled - loss_eager) <= atol + rtol * abs(loss_eager):
        raise ValueError(f"compiled loss {loss_compiled!r} differs from eager {loss_eager!r} by "
                         f"more than atol={atol:g} + rtol={rtol:g}·|eager|: the compiled model "
                         "does not compute what the eager one does; nothing was timed")  # fmt: skip
    opt_e.zero_grad(set_to_none=True)
    opt_c.zero_grad(set_to_none=True)

    losses: dict[str, list[float]] = {"eager": [], "compiled": []}

    def stepper(name: str, model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], float]:
        def one_step() -> float:
            x, y = batches[1 + len(losses[name]) % (n_batches - 1)]
            timing.synchronize(device)
            t0 = time.perf_counter()
            if cudagraphs and model is compiled:
                torch.compiler.cudagraph_mark_step_begin()  # a new iteration: outputs reused
            loss = phased_step(model, opt, x, y, dtype=dtype)
            value = float(loss)  # synchronises; read now, before a CUDA graph reuses its memory
            t = time.perf_counter() - t0
            losses[name].append(value)
            return t
        return one_step

    samples = timing.alternate({"eager": stepper("eager", eager, opt_e),
                                "compiled": stepper("compiled", compiled, opt_c)},
                               rounds=rounds, warmup=warmup)  # fmt: skip
    tokens = _tokens_per_step(cfg)
    method = "perf_counter per training step, loss read each step (synchronises)"
    mode_name = mode or "default"
    eager_m = Measured(name="eager", step_s=tuple(samples["eager"]), tokens_per_step=tokens,
                       device=str(device), method=method, losses=tuple(losses["eager"]),
                       settings={"compiled": False})  # fmt: skip
    comp_m = Measured(name=f"compiled ({scope}, mode={mode_name})",
                      step_s=tuple(samples["compiled"]), tokens_per_step=tokens,
                      device=str(device), method=method, losses=tuple(losses["compiled"]),
                      settings={"compiled": True, "scope": scope, "mode": mode_name,
                                "dynamic": dynamic})  # fmt: skip
    if device.type == "cuda":
        note = ("On a GPU a small model is launch-bound: the compiled step launches fewer, "
                "fused kernels, and reduce-overhead replays them as one CUDA graph.")
    else:
        note = ("On a CPU there are no GPU launches to save: the gain is fewer passes over "
                "memory (fused element-wise operations) and less Python and dispatch per step.")
    return CompileResult(
        bottleneck="Python overhead / small kernels (torch.compile)", before=eager_m,
        after=comp_m, variants=(eager_m, comp_m), note=note, compile_s=compile_s,
        loss_eager=loss_eager, loss_compiled=loss_compiled, rtol=rtol, atol=atol,
        mode=mode_name, scope=scope, cache_dir=str(cache_dir), cache=cache,
    )


def _compile_error(err: Exception, device: torch.device) -> Exception:
    """A compile failure as CompileUnavailable naming the fix; other errors unchanged."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InvalidCxxCompiler

    chain: list[BaseException] = []
    e: BaseException | None = err
    while e is not None and e not in chain:
        chain.append(e)
        e = getattr(e, "inner_exception", None) or e.__cause__
    if any(isinstance(c, InvalidCxxCompiler) for c in chain):
        return CompileUnavailable(f"torch.compile found no working C++ compiler: {_CXX_FIX}")
    if isinstance(err, BackendCompilerFailed):
        fix = (_CXX_FIX if device.type == "cpu" else
               "inductor writes Triton kernels on CUDA: `pip install triton` (it ships with "
               "the CUDA wheels of torch) and check the GPU is supported")
        first = str(err).strip().splitlines()
        return CompileUnavailable(f"torch.compile could not build the model's kernels "
                                  f"({first[-1] if first else type(err).__name__}); {fix}. "
                                  "The eager model still works: skip the compiled run")  # fmt: skip
    return err


# ---------------------------------------------------------------------------------------
# 3. Host-device synchronisation


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
    if isinstance(read_every, bool) or not isinstance(read_every, int) or read_every < 1:
        raise ValueError(f"read_every={read_every!r} is not allowed: an integer >= 1")
    device = _device(cfg, device)
    (m_before, o_before), (m_after, o_after) = _models(cfg, device, 2)
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
    tokens = _tokens_per_step(cfg)
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
