"""Real text for a byte-level GPT, with no network: corpus, splits, shards and batches.

The corpus is about 1.6 MB of English written by people: the docstrings of the Python
standard library, extracted by ``scripts/build_corpus.py`` and shipped gzip-compressed in
``labkit/data/`` under the PSF License (provenance and licence in ``labkit/data/CORPUS.md``).
The tokenizer is the identity on bytes: a token is one byte, so the vocabulary is 256 and
``encode``/``decode`` need no files (as in nanoGPT's ``shakespeare_char``, one level lower).

Shapes and names used below:

    N  bytes in a 1-D tensor of tokens
    B  batch size (sequences per batch)
    T  sequence length (tokens per sequence)

Typical use::

    train, val = load_splits()                     # uint8 (N_train,), uint8 (N_val,)
    mine = shard(train, rank, world_size)          # this rank's contiguous share
    g = torch.Generator().manual_seed(seed + rank)
    x, y = get_batch(mine, batch_size=8, seq_len=128, generator=g)   # int64 (B, T) each

Nothing happens at import: the corpus is read on the first call to :func:`load_corpus`
and kept in memory after that.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import zlib
from collections.abc import Iterator, Sequence
from importlib import resources
from typing import NamedTuple

import torch

from labkit.config import CORPUS_VOCAB_SIZE
from labkit.errors import LabkitError
from labkit.validate import number, refuse, whole

__all__ = [
    "CORPUS_BYTES",
    "CORPUS_PYTHON",
    "CORPUS_SHA256",
    "CORPUS_SOURCE_SHA256",
    "VOCAB_SIZE",
    "BatchIterator",
    "CorpusError",
    "Splits",
    "decode",
    "describe",
    "encode",
    "get_batch",
    "load_corpus",
    "load_splits",
    "shard",
    "split_train_val",
    "unpack_corpus",
]

# Recorded by scripts/build_corpus.py (it prints new values when a rebuild changes them).
CORPUS_SHA256 = "d8e8403f51242bb0d506161c2e39ade43a703a0f1dff0618166b4def6013b7f8"
"""SHA-256 of the uncompressed corpus: :func:`load_corpus` refuses anything else."""
CORPUS_BYTES = 1634061
"""Size of the uncompressed corpus in bytes (= tokens)."""
CORPUS_PYTHON = "3.11.7"
"""The Python whose standard library the corpus was built from."""
CORPUS_SOURCE_SHA256 = "bff1527db71686ccec1046c88a77d4110eff1d7e2be8747ec16f3b059758230c"
"""Fingerprint of the stdlib files read: equal here means a rebuild must match exactly."""

CORPUS_RESOURCE = "data/corpus.txt.gz"  # relative to the labkit package
VOCAB_SIZE = CORPUS_VOCAB_SIZE  # 256, one token per byte value; config checks runs against it

_REBUILD_HINT = (
    "reinstall labkit, or rebuild the file with `python scripts/build_corpus.py` "
    f"(run with Python {CORPUS_PYTHON} to get the recorded corpus)"
)


class CorpusError(RuntimeError, LabkitError):
    """The shipped corpus is missing, unreadable or not the recorded one."""


class Splits(NamedTuple):
    """Train and validation tokens: 1-D uint8 tensors, disjoint, in corpus order."""

    train: torch.Tensor
    val: torch.Tensor


# ---------------------------------------------------------------------------------------
# Loading


def unpack_corpus(packed: bytes, sha256: str = CORPUS_SHA256) -> bytes:
    """Decompress a gzip-compressed corpus and check it against the expected SHA-256.

    Args:
        packed: the gzip file's bytes.
        sha256: expected hex digest of the *uncompressed* bytes.

    Raises:
        CorpusError: the data is not valid gzip, or decompresses to other bytes.
    """
    try:
        data = gzip.decompress(packed)
    except (OSError, EOFError, zlib.error) as exc:  # BadGzipFile is an OSError
        raise CorpusError(f"corpus file is not valid gzip ({exc}); {_REBUILD_HINT}") from exc
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise CorpusError(
            f"corpus SHA-256 is {digest}, expected {sha256} ({len(data):,} bytes read, "
            f"{CORPUS_BYTES:,} expected); the file is corrupt or from another build: "
            f"{_REBUILD_HINT}"
        )
    return data


@functools.lru_cache(maxsize=1)
def load_corpus() -> bytes:
    """The whole corpus as bytes (ASCII text), read once from package data and cached.

    Verified against :data:`CORPUS_SHA256`, so every learner trains on the same bytes.

    Raises:
        CorpusError: the file is missing or corrupt.
    """
    resource = resources.files("labkit").joinpath(CORPUS_RESOURCE)
    try:
        packed = resource.read_bytes()
    except OSError as exc:
        raise CorpusError(
            f"corpus file labkit/{CORPUS_RESOURCE} not found; {_REBUILD_HINT}"
        ) from exc
    return unpack_corpus(packed)


def _as_tensor(data: bytes) -> torch.Tensor:
    # frombuffer shares memory with a *writable* copy (a bytes object is read-only and
    # torch warns about that); 1.6 MB copies in about a millisecond.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def split_train_val(data: torch.Tensor, val_fraction: float = 0.1) -> Splits:
    """Cut a 1-D token tensor into train (first part) and validation (last part).

    Why one cut and not a random choice of bytes or windows: training samples are
    overlapping windows, so a random split would put most validation bytes inside some
    training window too, and validation loss would measure memorisation. With a single
    cut no training window contains a validation byte. Neighbouring text is also alike
    (the methods of one class), so the held-out end is a fairer test of generalisation.

    Args:
        data: 1-D tensor of tokens, shape (N,).
        val_fraction: share of the tokens kept for validation, strictly between 0 and 1;
            the validation part has ``int(N * val_fraction)`` tokens.

    Returns:
        ``Splits(train, val)``: views of ``data`` of shapes (N - n_val,) and (n_val,).
    """
    _check_tokens(data)
    if not 0.0 < number("val_fraction", val_fraction) < 1.0:
        raise refuse("val_fraction", val_fraction, "a number strictly between 0 and 1")
    n = data.numel()
    n_val = int(n * val_fraction)
    if n_val < 1 or n_val >= n:
        raise ValueError(
            f"val_fraction={val_fraction} of {n} tokens leaves {n_val} for validation and "
            f"{n - n_val} for training; both need at least 1: choose a fraction nearer 0.5"
        )
    return Splits(train=data[: n - n_val], val=data[n - n_val :])


def load_splits(val_fraction: float = 0.1) -> Splits:
    """The corpus as ``Splits(train, val)`` uint8 tensors (a tuple: ``train, val = ...``).

    Deterministic: the last ``val_fraction`` of the bytes is validation (see
    :func:`split_train_val` for why). Each call returns fresh tensors, so changing one in
    place does not change the next caller's data.
    """
    return split_train_val(_as_tensor(load_corpus()), val_fraction)


# ---------------------------------------------------------------------------------------
# Sharding and batches


def _check_tokens(data: torch.Tensor) -> None:
    if not isinstance(data, torch.Tensor):
        raise ValueError(f"data must be a torch.Tensor of tokens, got {type(data).__name__}")
    if data.dim() != 1:
        raise ValueError(f"data must be 1-D (N,), got shape {tuple(data.shape)}")
    if data.dtype.is_floating_point or data.dtype.is_complex or data.dtype == torch.bool:
        raise ValueError(f"data must hold integer tokens, got dtype {data.dtype}")


def shard(data: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's share of ``data``: contiguous, disjoint from the others, equal in length.

    Every shard has ``N // world_size`` tokens; the last ``N % world_size`` tokens (fewer
    than ``world_size``) belong to no shard. Equal lengths matter in data parallelism:
    ranks that walk their shards in epochs then run the same number of steps, and no rank
    waits forever in an all-reduce that a rank with less data never joins.

    Args:
        data: 1-D tokens, shape (N,).
        rank: this process's index, ``0 <= rank < world_size``.
        world_size: number of processes sharing the data.

    Returns:
        A view of shape (N // world_size,).
    """
    _check_tokens(data)
    world_size = whole("world_size", world_size, low=1)
    rank = whole("rank", rank, low=0, high=world_size - 1)
    size = data.numel() // world_size
    if size < 1:
        raise ValueError(
            f"world_size={world_size} is larger than the data ({data.numel()} tokens): "
            "every shard would be empty"
        )
    return data[rank * size : (rank + 1) * size]


def _to_batch(
    windows: torch.Tensor, device: str | torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T+1) windows → inputs x and next-token targets y, int64 (B, T) on ``device``."""
    windows = windows.to(torch.int64)
    x = windows[:, :-1].contiguous()  # (B, T) tokens 0..T-1 of each window
    y = windows[:, 1:].contiguous()  # (B, T) tokens 1..T: y[b, t] is the token after x[b, t]
    device = torch.device(device)
    if device.type == "cuda":
        # Pinned (page-locked) host memory lets the copy run asynchronously with compute,
        # as nanoGPT's get_batch does.
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(
            device, non_blocking=True
        )
    return x.to(device), y.to(device)


def get_batch(
    data: torch.Tensor,
    batch_size: int,
    seq_len: int,
    generator: torch.Generator,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of random windows of ``data`` for next-token prediction.

    Each of the ``batch_size`` rows starts at an offset drawn uniformly from the
    ``N - seq_len`` valid ones with ``generator``, so the same seed gives the same batches.

    Args:
        data: 1-D tokens, shape (N,), with ``N >= seq_len + 1``.
        batch_size: rows per batch, B.
        seq_len: tokens per row, T.
        generator: a CPU ``torch.Generator`` (seed it for reproducible batches).
        device: where the returned tensors live.

    Returns:
        ``(x, y)``, both int64 (B, T), with ``y[:, t] == data[start + t + 1]`` for
        ``x[:, t] == data[start + t]``: the target is the next token.
    """
    _check_tokens(data)
    batch_size = whole("batch_size", batch_size, low=1)
    seq_len = whole("seq_len", seq_len, low=1)
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if data.numel() < seq_len + 1:
        raise ValueError(
            f"seq_len={seq_len} needs at least {seq_len + 1} tokens of data, got {data.numel()}: "
            "use a shorter seq_len or more data"
        )
    starts = torch.randint(data.numel() - seq_len, (batch_size,), generator=generator)  # (B,)
    # unfold is a view of all windows, shape (N - T, T + 1); indexing copies only B of them.
    windows = data.unfold(0, seq_len + 1, 1)[starts.to(data.device)]  # (B, T+1)
    return _to_batch(windows, device)


class BatchIterator:
    """Epochs of non-overlapping windows, divided among ranks as ``DistributedSampler`` does
    with ``drop_last=True`` (it drops; it never pads by repeating windows).

    The data is cut into windows of ``seq_len + 1`` tokens that start every ``seq_len``
    tokens (consecutive windows share one token: the last target of one is the first input
    of the next). Each epoch every rank draws the same permutation of all windows (seeded
    with ``seed + epoch``) and takes every ``world_size``-th one from position ``rank``, so
    the ranks see disjoint windows and, together, each window once per epoch. Windows that
    would make the ranks unequal, and the last partial batch, are dropped, so every rank
    yields exactly ``len(self)`` batches. Call :meth:`set_epoch` before each epoch for a
    new order; without it every epoch repeats the same one.

    Args:
        data: 1-D tokens (N,), the whole training split (not a shard: this class shards).
        batch_size: rows per batch, B.
        seq_len: tokens per row, T.
        rank: this process's index, ``0 <= rank < world_size``.
        world_size: number of ranks.
        seed: base seed, the same on every rank.
        device: where batches are put.
    """

    def __init__(
        self,
        data: torch.Tensor,
        batch_size: int,
        seq_len: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        device: str | torch.device = "cpu",
    ) -> None:
        _check_tokens(data)
        batch_size = whole("batch_size", batch_size, low=1)
        seq_len = whole("seq_len", seq_len, low=1)
        world_size = whole("world_size", world_size, low=1)
        rank = whole("rank", rank, low=0, high=world_size - 1)
        self.windows = data.unfold(0, seq_len + 1, seq_len) if data.numel() > seq_len else None
        n_windows = 0 if self.windows is None else self.windows.shape[0]
        self.per_rank = n_windows // world_size
        self.n_batches = self.per_rank // batch_size
        if self.n_batches == 0:
            raise ValueError(
                f"{data.numel()} tokens make {n_windows} windows of seq_len={seq_len}, "
                f"not one batch of batch_size={batch_size} for each of world_size={world_size} "
                "ranks: use more data or smaller batch_size/seq_len"
            )
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.seed, self.device, self.epoch = seed, device, 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration follows (same on all ranks)."""
        self.epoch = whole("epoch", epoch, low=0)

    def __len__(self) -> int:
        """Batches per epoch, equal on every rank."""
        return self.n_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        assert self.windows is not None  # guaranteed by __init__
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.windows.shape[0], generator=g)
        usable = self.per_rank * self.world_size
        mine = order[:usable][self.rank :: self.world_size]  # (per_rank,)
        for i in range(self.n_batches):
            idx = mine[i * self.batch_size : (i + 1) * self.batch_size]  # (B,)
            yield _to_batch(self.windows[idx.to(self.windows.device)], self.device)


# ---------------------------------------------------------------------------------------
# Text <-> tokens


def fixed_batches(
    seq_len: int, batch_size: int, steps: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of the training split drawn with ``seed``: the same list in every
    rank of a parallel job and in the single-process reference it is compared with."""
    g = torch.Generator().manual_seed(seed)
    train = load_splits().train
    return [get_batch(train, batch_size, seq_len, g) for _ in range(steps)]


def encode(text: str) -> torch.Tensor:
    """Text → int64 token ids (its UTF-8 bytes), shape (len(utf8 bytes),), ready for the model."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def decode(tokens: torch.Tensor | bytes | Sequence[int]) -> str:
    """Token ids (bytes) → text. Invalid UTF-8, which a sampled sequence can contain,
    becomes U+FFFD instead of raising. A tensor of any shape is read in row-major order."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.flatten().tolist()
    if not isinstance(tokens, (bytes, bytearray)):
        bad = [t for t in tokens if not 0 <= int(t) < VOCAB_SIZE]
        if bad:
            raise ValueError(f"tokens must be byte values in [0, 255], got {bad[:5]}")
        tokens = bytes(int(t) for t in tokens)
    return bytes(tokens).decode("utf-8", errors="replace")


def describe() -> str:
    """A short provenance note for notebooks (reads the corpus to report the split)."""
    train, val = load_splits()
    return (
        f"labkit corpus: {CORPUS_BYTES:,} bytes of English, the docstrings of the Python "
        f"{CORPUS_PYTHON} standard library (PSF License Version 2; see labkit/data/CORPUS.md).\n"
        f"byte-level tokens, vocabulary {VOCAB_SIZE}; split {train.numel():,} train / "
        f"{val.numel():,} validation (last 10%); SHA-256 {CORPUS_SHA256[:16]}…"
    )
