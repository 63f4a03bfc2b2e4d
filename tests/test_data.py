"""Tests of labkit.data: the shipped corpus, its rebuild, splits, shards and batches."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import platform
import string
import sys
from pathlib import Path

import pytest
import torch

from labkit import data

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = REPO_ROOT / "labkit" / "data"


def _load_build_script():
    spec = importlib.util.spec_from_file_location(
        "build_corpus", REPO_ROOT / "scripts" / "build_corpus.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------
# The corpus itself


def test_corpus_is_large_enough_and_matches_recorded_values():
    corpus = data.load_corpus()
    assert len(corpus) >= 1_000_000
    assert len(corpus) == data.CORPUS_BYTES
    assert hashlib.sha256(corpus).hexdigest() == data.CORPUS_SHA256
    assert data.load_corpus() is corpus  # cached: read once


def test_corpus_is_printable_english():
    corpus = data.load_corpus()
    printable = frozenset(string.printable.encode())
    assert sum(b in printable for b in corpus) / len(corpus) > 0.95
    text = corpus.decode("ascii")  # the build keeps ASCII only
    assert sum(c.isalpha() for c in text) / len(text) > 0.6
    words = text.lower().split()
    # The commonest English function words are frequent in prose, rare in code.
    for word in ("the", "of", "a", "is", "to"):
        assert words.count(word) / len(words) > 0.005, word


def test_shipped_files_and_provenance_agree():
    packed = (DATA_DIR / "corpus.txt.gz").read_bytes()
    assert len(packed) < 1_000_000
    assert hashlib.sha256(gzip.decompress(packed)).hexdigest() == data.CORPUS_SHA256
    doc = (DATA_DIR / "CORPUS.md").read_text(encoding="utf-8")
    assert data.CORPUS_SHA256 in doc
    assert data.CORPUS_SOURCE_SHA256 in doc
    assert f"{data.CORPUS_BYTES:,}" in doc
    assert f"Python {data.CORPUS_PYTHON}" in doc
    licence = (DATA_DIR / "LICENSE-PSF.txt").read_text(encoding="utf-8")
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in licence


def test_pyproject_ships_the_data_files():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    from fnmatch import fnmatch

    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = config["tool"]["setuptools"]["package-data"]["labkit"]
    for name in ("corpus.txt.gz", "CORPUS.md", "LICENSE-PSF.txt"):
        assert any(fnmatch(f"data/{name}", p) for p in patterns), name


def test_unpack_corpus_rejects_corrupt_data():
    good = gzip.compress(b"hello world", mtime=0)
    sha = hashlib.sha256(b"hello world").hexdigest()
    assert data.unpack_corpus(good, sha) == b"hello world"
    with pytest.raises(data.CorpusError, match="SHA-256"):
        data.unpack_corpus(gzip.compress(b"hello worle", mtime=0), sha)
    with pytest.raises(data.CorpusError, match="gzip"):
        data.unpack_corpus(b"not gzip at all", sha)
    with pytest.raises(data.CorpusError, match="gzip"):
        data.unpack_corpus(good[:-6], sha)  # truncated


def test_rebuild_is_identical():
    build_corpus = _load_build_script()
    if platform.python_version() != data.CORPUS_PYTHON:
        pytest.skip(
            f"corpus built from Python {data.CORPUS_PYTHON}'s stdlib; this is "
            f"{platform.python_version()}, whose docstrings differ"
        )
    result = build_corpus.build()
    if result.source_sha256 != data.CORPUS_SOURCE_SHA256:
        pytest.skip("same Python version but a differently patched stdlib (distribution build)")
    assert result.sha256 == data.CORPUS_SHA256
    assert result.data == data.load_corpus()
    assert build_corpus.check(result) == 0


def test_build_steps_on_a_tiny_stdlib(tmp_path):
    build_corpus = _load_build_script()
    (tmp_path / "pkg").mkdir()
    (tmp_path / "test").mkdir()
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "b.py").write_text(
        '"""Module b explains things at some length."""\n'
        "class C:\n"
        '    """Class C docstring, long enough.\n\n\n\n    Second paragraph.   \n    """\n'
        "    def f(self):\n"
        '        """Short."""\n'
        "def g():\n"
        '    """Module b explains things at some length."""\n'  # duplicate: dropped
        "def h():\n"
        '    """Caf\u00e9 is not ASCII, so this one goes."""\n',
        encoding="utf-8",
    )
    (tmp_path / "pkg" / "a.py").write_text('"""Docstring of pkg/a.py, sorted after b.py."""\n')
    (tmp_path / "test" / "t.py").write_text('"""Tests are left out of the corpus."""\n')
    (tmp_path / "site-packages" / "s.py").write_text('"""Third-party code is left out."""\n')
    result = build_corpus.build(tmp_path)
    assert result.n_files == 2
    assert result.text == (
        "Module b explains things at some length.\n\n"
        "Class C docstring, long enough.\n\nSecond paragraph.\n\n"
        "Docstring of pkg/a.py, sorted after b.py.\n"
    )
    # Same input, same output; different input, different fingerprint.
    assert build_corpus.build(tmp_path) == result
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    assert build_corpus.build(tmp_path).source_sha256 != result.source_sha256


def test_gzip_output_is_byte_deterministic():
    build_corpus = _load_build_script()
    payload = b"same bytes in, same bytes out\n" * 100
    assert build_corpus.gzip_bytes(payload) == build_corpus.gzip_bytes(payload)
    assert gzip.decompress(build_corpus.gzip_bytes(payload)) == payload


# ---------------------------------------------------------------------------------------
# Splits


def test_splits_are_disjoint_and_cover_the_corpus():
    train, val = data.load_splits(0.1)
    corpus = data.load_corpus()
    assert train.dtype == val.dtype == torch.uint8
    assert train.numel() + val.numel() == len(corpus)
    assert val.numel() == int(len(corpus) * 0.1)
    assert bytes(train.tolist()) + bytes(val.tolist()) == corpus
    assert isinstance(data.load_splits(), data.Splits)


def test_splits_are_fresh_tensors():
    train, _ = data.load_splits()
    train[0] = 0
    assert data.load_splits().train[0] != 0


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 1.5, True, "0.1"])
def test_bad_val_fraction_is_rejected(bad):
    with pytest.raises(ValueError, match="val_fraction"):
        data.split_train_val(torch.arange(100), bad)


def test_val_fraction_leaving_an_empty_part_is_rejected():
    with pytest.raises(ValueError, match="val_fraction"):
        data.split_train_val(torch.arange(5), 0.1)  # int(0.5) = 0 validation tokens


# ---------------------------------------------------------------------------------------
# Shards


@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
def test_shards_are_disjoint_equal_and_cover_all_but_the_remainder(world_size):
    tokens = torch.arange(100)
    shards = [data.shard(tokens, r, world_size) for r in range(world_size)]
    assert {s.numel() for s in shards} == {100 // world_size}
    joined = torch.cat(shards)
    assert torch.equal(joined, tokens[: 100 // world_size * world_size])  # contiguous, in order
    assert joined.unique().numel() == joined.numel()  # disjoint


@pytest.mark.parametrize(
    ("rank", "world_size", "name"),
    [
        (-1, 2, "rank"),
        (2, 2, "rank"),
        (0, 0, "world_size"),
        (0, 101, "world_size"),
        (0.0, 2, "rank"),
    ],
)
def test_bad_shard_arguments_are_rejected(rank, world_size, name):
    with pytest.raises(ValueError, match=name):
        data.shard(torch.arange(100), rank, world_size)


def test_shard_rejects_non_token_data():
    with pytest.raises(ValueError, match="data"):
        data.shard(torch.zeros(4, 4, dtype=torch.uint8), 0, 1)
    with pytest.raises(ValueError, match="data"):
        data.shard(torch.zeros(10), 0, 1)


# ---------------------------------------------------------------------------------------
# Batches


def test_get_batch_shapes_and_targets():
    tokens = torch.arange(1000) % 256
    tokens = tokens.to(torch.uint8)
    x, y = data.get_batch(tokens, 4, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
    assert torch.equal((x + 1) % 256, y)  # and is the next token of the data


def test_get_batch_windows_come_from_the_data():
    train, _ = data.load_splits()
    x, y = data.get_batch(train, 8, 64, torch.Generator().manual_seed(1))
    haystack = data.decode(train)
    for row_x, row_y in zip(x, y, strict=True):
        window = data.decode(row_x) + data.decode(row_y[-1:])
        assert window in haystack


def test_get_batch_is_deterministic_per_seed():
    tokens = torch.randint(
        0, 256, (5000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
    )
    a = data.get_batch(tokens, 8, 32, torch.Generator().manual_seed(7))
    b = data.get_batch(tokens, 8, 32, torch.Generator().manual_seed(7))
    c = data.get_batch(tokens, 8, 32, torch.Generator().manual_seed(8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_get_batch_reaches_both_ends_of_the_data():
    tokens = torch.arange(10)
    x, y = data.get_batch(tokens, 2000, 3, torch.Generator().manual_seed(0))
    assert x[:, 0].min() == 0  # first window starts at 0
    assert y[:, -1].max() == 9  # last window ends on the last token


def test_get_batch_accepts_the_shortest_data():
    x, y = data.get_batch(torch.arange(5), 2, 4, torch.Generator())
    assert torch.equal(x[0], torch.arange(4)) and torch.equal(y[0], torch.arange(1, 5))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"seq_len": 10}, "seq_len"),  # data (10 tokens) shorter than seq_len + 1
        ({"seq_len": 0}, "seq_len"),
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 2.0}, "batch_size"),
        ({"generator": 0}, "generator"),
    ],
)
def test_bad_get_batch_arguments_are_rejected(kwargs, name):
    args = {"data": torch.arange(10), "batch_size": 2, "seq_len": 4, "generator": torch.Generator()}
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        data.get_batch(**args)


# ---------------------------------------------------------------------------------------
# BatchIterator


def _rows(iterator: data.BatchIterator) -> list[tuple[int, ...]]:
    return [tuple(row.tolist()) for x, _ in iterator for row in x]


def test_batch_iterator_ranks_are_disjoint_equal_and_cover_an_epoch():
    tokens = torch.arange(1001)  # 1000 // 10 = 100 windows of 11 tokens
    ranks = [data.BatchIterator(tokens, 4, 10, rank=r, world_size=3, seed=5) for r in range(3)]
    assert [len(it) for it in ranks] == [8, 8, 8]  # 100 // 3 = 33 windows each, 8 batches of 4
    rows = [_rows(it) for it in ranks]
    assert all(len(r) == 32 for r in rows)
    all_rows = [row for r in rows for row in r]
    assert len(set(all_rows)) == len(all_rows)  # no window on two ranks
    assert all(row[0] % 10 == 0 for row in all_rows)  # windows start every seq_len tokens
    for x, y in ranks[0]:
        assert x.shape == y.shape == (4, 10) and x.dtype == torch.int64
        assert torch.equal(y, x + 1)


def test_batch_iterator_set_epoch_changes_the_order_reproducibly():
    tokens = torch.arange(2001)
    it = data.BatchIterator(tokens, 4, 10, seed=1)
    first = _rows(it)
    assert _rows(it) == first  # no set_epoch: same order again
    it.set_epoch(1)
    second = _rows(it)
    assert second != first and sorted(second) == sorted(first)
    again = data.BatchIterator(tokens, 4, 10, seed=1)
    again.set_epoch(1)
    assert _rows(again) == second


def test_batch_iterator_rejects_too_little_data():
    with pytest.raises(ValueError, match="batch_size"):
        data.BatchIterator(torch.arange(50), 8, 10)
    with pytest.raises(ValueError, match="rank"):
        data.BatchIterator(torch.arange(500), 2, 10, rank=2, world_size=2)
    with pytest.raises(ValueError, match="epoch"):
        data.BatchIterator(torch.arange(500), 2, 10).set_epoch(-1)


# ---------------------------------------------------------------------------------------
# Text


def test_encode_decode_round_trip():
    text = "Return the sum of a and b. Caf\u00e9 \u2603"
    tokens = data.encode(text)
    assert tokens.dtype == torch.int64 and tokens.dim() == 1
    assert tokens.numel() == len(text.encode("utf-8"))
    assert data.decode(tokens) == text
    assert data.decode(tokens.tolist()) == text
    assert data.decode(text.encode()) == text


def test_decode_replaces_invalid_utf8_and_rejects_non_bytes():
    assert data.decode(torch.tensor([104, 0xFF, 105])) == "h\ufffdi"
    with pytest.raises(ValueError, match="tokens"):
        data.decode([65, 256])


def test_describe_states_size_source_and_licence():
    text = data.describe()
    assert f"{data.CORPUS_BYTES:,}" in text
    assert "standard library" in text
    assert "PSF License" in text


def test_fixed_batches_are_the_same_list_for_the_same_seed_in_any_process():
    a = data.fixed_batches(16, 3, 2, seed=5)
    b = data.fixed_batches(16, 3, 2, seed=5)
    c = data.fixed_batches(16, 3, 2, seed=6)
    assert len(a) == 2 and a[0][0].shape == (3, 16) and a[0][1].shape == (3, 16)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b, strict=True))
    assert not torch.equal(a[0][0], c[0][0])
    assert torch.equal(a[0][0][:, 1:], a[0][1][:, :-1])  # targets are the inputs shifted by one
