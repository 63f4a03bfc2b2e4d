"""Bottleneck 1, data loading: a dataset that tokenises in ``__getitem__``, and its fixes.

:class:`TokenizingDataset` does real Python work per item, so with ``num_workers=0`` the
training process waits for every batch; worker processes, prefetching and persistent workers
(:func:`loader_variants`) move that work off the critical path. :class:`BatchStream` shuts the
workers down however a run ends, and :func:`measure_data_loading` times each variant on the
same batches. A module of its own because a DataLoader worker process imports the dataset
from here (a class defined in a notebook cannot be unpickled in a worker: pytorch #20375).

Source: PyTorch ``torch.utils.data`` docs (multi-process loading, memory pinning,
``prefetch_factor``, ``persistent_workers``) https://docs.pytorch.org/docs/stable/data.html.
"""

from __future__ import annotations

import math
import os
import re
import time
import unicodedata
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from labkit import timing
from labkit.config import RunConfig
from labkit.data import load_splits
from labkit.errors import LabkitError
from labkit.profiling.bottlenecks.common import (
    BeforeAfter,
    Measured,
    fresh_models,
    phased_step,
    run_device,
)
from labkit.profiling.phases import phase
from labkit.validate import whole

Batch = tuple[torch.Tensor, torch.Tensor]


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
        seq_len, passes = whole("seq_len", seq_len, low=1), whole("passes", passes, low=1)
        if data is None:
            data = load_splits().train
        if not isinstance(data, torch.Tensor) or data.dim() != 1 or data.dtype != torch.uint8:
            raise ValueError("data must be a 1-D torch.uint8 tensor of byte tokens (such as "
                             "labkit.data.load_splits().train)")  # fmt: skip
        available = (data.numel() - 1) // seq_len if data.numel() > seq_len else 0
        if n_items is None:
            n_items = available
        n_items = whole("n_items", n_items, low=1, high=available,
                        why=f"{data.numel()} tokens hold {available} windows of "
                            f"seq_len={seq_len}")  # fmt: skip
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


def time_batch_loading(dataset: Dataset, *, batch_size: int, batches: int = 3,
                       clock: Callable[[], float] = time.perf_counter) -> timing.TimingResult:
    """Seconds to load one batch of ``dataset`` in this process (no DataLoader, no worker):
    the first ``batches`` batches, each timed by ``labkit.timing.benchmark``.

    No warm-up call: each batch is new items (a warm-up would load one more batch than the
    dataset was sized for, ``batches × batch_size`` items), and tokenising keeps no cache that a
    first call would fill.
    """
    batch_size = whole("batch_size", batch_size, low=1)
    batches = whole("batches", batches, low=1)
    starts = iter(range(0, batches * batch_size, batch_size))

    def load_one() -> None:
        k = next(starts)
        [dataset[i] for i in range(k, k + batch_size)]

    return timing.benchmark(load_one, warmup=0, repeats=batches, name="loading a batch",
                            clock=clock)  # fmt: skip



# ---------------------------------------------------------------------------------------
# Loaders, a stream that cleans up, the measured loop


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
        whole("num_workers", w, low=0, why=f"loader variant {self.name!r}")
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
    steps = whole("steps", steps, low=1)
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
    device = run_device(cfg, device)
    variants = tuple(variants or loader_variants(device))
    if not variants:
        raise ValueError("variants is empty: give at least one LoaderVariant")
    rounds = whole("rounds", rounds, low=1)
    runs = fresh_models(cfg, device, len(variants))
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

