"""Build labkit's training corpus from the docstrings of CPython's standard library.

The course trains a byte-level GPT on real English and must work with no network, so the
text comes from a source every learner already has on disk: the docstrings of the Python
standard library. They are written by people, they are prose (with some reStructuredText
and doctest examples), and the PSF License lets us redistribute them with the licence
kept (see labkit/data/CORPUS.md).

What the build does, in order (every step is deterministic):

1. List the ``.py`` files under the running interpreter's stdlib directory, leaving out
   tests, demos, IDLE, codec tables and third-party ``site-packages``; sort them by
   relative POSIX path so the order does not depend on the file system.
2. Parse each file with :mod:`ast` (never import it: importing runs code, and some modules
   only import on one platform) and take the docstrings of the module, its classes and its
   functions, in source order.
3. Normalise each one: ``inspect.cleandoc`` (via ``ast.get_docstring``), strip trailing
   spaces, collapse runs of blank lines to one. Keep it only if it is pure ASCII (so one
   byte is one character: a byte-level model then never sees half a character) and at
   least ``MIN_CHARS`` long.
4. Drop exact duplicates (first one wins), join with a blank line, end with a newline.

Usage (from the repository root)::

    python scripts/build_corpus.py           # rebuild labkit/data/ (needs the recorded Python)
    python scripts/build_corpus.py --check   # rebuild in memory, compare with the shipped file

``--check`` exits 0 when the rebuild matches the shipped corpus byte for byte, 1 when it
differs, and 2 when it cannot tell because this interpreter's stdlib is not the one the
corpus was built from (another Python version, or a distribution that patches the stdlib).

This script imports nothing from labkit (and so not torch): it reads the recorded values
from ``labkit/data/__init__.py`` with :mod:`ast`.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import os
import platform
import re
import shutil
import sys
import sysconfig
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_MODULE = REPO_ROOT / "labkit" / "data" / "__init__.py"
DATA_DIR = REPO_ROOT / "labkit" / "data"
CORPUS_FILE = DATA_DIR / "corpus.txt.gz"
CORPUS_DOC = DATA_DIR / "CORPUS.md"
LICENCE_FILE = DATA_DIR / "LICENSE-PSF.txt"

# Directories skipped wherever they occur. Tests and demos are code, not prose; IDLE is an
# application; `encodings` is hundreds of generated codec tables with near-identical
# docstrings; `site-packages` is third-party code under other licences.
EXCLUDED_DIRS = frozenset(
    {
        "__pycache__",
        "__phello__",
        "dist-packages",
        "encodings",
        "ensurepip",
        "idle_test",
        "idlelib",
        "pydoc_data",
        "site-packages",
        "test",
        "tests",
        "turtledemo",
    }
)
MIN_CHARS = 20  # shorter docstrings ("Return self.") add little prose
GZIP_LEVEL = 9


@dataclass(frozen=True)
class Build:
    """The result of one build, held in memory.

    Attributes:
        text: the corpus, ASCII, one docstring per paragraph group.
        n_files: number of ``.py`` files read.
        n_docstrings: number of docstrings kept (after filtering and de-duplication).
        source_sha256: SHA-256 over every file read (its relative path and its bytes):
            two interpreters with the same value have byte-identical inputs.
    """

    text: str
    n_files: int
    n_docstrings: int
    source_sha256: str

    @property
    def data(self) -> bytes:
        return self.text.encode("ascii")

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def stdlib_dir() -> Path:
    """The running interpreter's pure-Python standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def python_version() -> str:
    """``3.11.7``-style version of the running interpreter."""
    return platform.python_version()


def source_files(root: Path) -> list[Path]:
    """Every ``.py`` file under ``root`` that the corpus draws from, in sorted order.

    Sorted by relative POSIX path, not by ``os.walk`` order, which depends on the file
    system. Directories are pruned during the walk so ``site-packages`` is never entered.
    """
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place: os.walk then skips these subtrees entirely.
        dirnames[:] = [
            d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith("config-")
        ]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def docstrings(tree: ast.AST) -> Iterator[str]:
    """Docstrings of a module and of every class and function in it, in source order.

    A depth-first walk over statement bodies (``ast.walk`` is breadth-first, which would
    separate a class's docstring from those of its methods).
    """
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    if isinstance(tree, kinds):
        doc = ast.get_docstring(tree, clean=True)  # clean=True applies inspect.cleandoc
        if doc:
            yield doc
    for child in ast.iter_child_nodes(tree):
        yield from docstrings(child)


_BLANK_RUNS = re.compile(r"\n{3,}")


def normalise(doc: str) -> str | None:
    """One docstring as it goes into the corpus, or None if it is left out."""
    lines = [line.rstrip() for line in doc.replace("\r\n", "\n").split("\n")]
    text = _BLANK_RUNS.sub("\n\n", "\n".join(lines)).strip()
    if len(text) < MIN_CHARS or not text.isascii():
        return None
    # Control characters other than newline (a stray form feed, say) are not prose.
    if any(ord(c) < 32 and c != "\n" for c in text):
        return None
    return text


def build(root: Path | None = None) -> Build:
    """Build the corpus in memory from the stdlib at ``root`` (default: this interpreter's)."""
    root = stdlib_dir() if root is None else root
    files = source_files(root)
    source_hash = hashlib.sha256()
    seen: set[str] = set()
    kept: list[str] = []
    for path in files:
        raw = path.read_bytes()
        rel = path.relative_to(root).as_posix().encode()
        # Length-prefixed so that no two different inputs hash the same byte stream.
        source_hash.update(b"%d:%s%d:" % (len(rel), rel, len(raw)))
        source_hash.update(raw)
        with warnings.catch_warnings():
            # Old stdlib files trigger "invalid escape sequence" warnings on newer parsers.
            warnings.simplefilter("ignore")
            try:
                tree = ast.parse(raw, filename=str(path))
            except SyntaxError:
                continue  # e.g. a lib2to3 fixture written in Python 2; not prose anyway
        for doc in docstrings(tree):
            text = normalise(doc)
            if text is not None and text not in seen:
                seen.add(text)
                kept.append(text)
    return Build(
        text="\n\n".join(kept) + "\n",
        n_files=len(files),
        n_docstrings=len(kept),
        source_sha256=source_hash.hexdigest(),
    )


def recorded_values(path: Path = DATA_MODULE) -> dict[str, object]:
    """The ``CORPUS_*`` constants of labkit/data/__init__.py, read with ast (no import, no torch)."""
    values: dict[str, object] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        target = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target = node.target
        if isinstance(target, ast.Name) and target.id.startswith("CORPUS_"):
            values[target.id] = ast.literal_eval(node.value)  # type: ignore[arg-type]
    return values


def gzip_bytes(data: bytes) -> bytes:
    """Gzip with mtime=0 and no file name, so equal input gives equal output bytes."""
    return gzip.compress(data, compresslevel=GZIP_LEVEL, mtime=0)


def check(result: Build) -> int:
    """Compare an in-memory rebuild with the shipped corpus; return the exit status."""
    recorded = recorded_values()
    if result.source_sha256 != recorded.get("CORPUS_SOURCE_SHA256"):
        print(
            f"cannot check: this stdlib (Python {python_version()}, {stdlib_dir()}) is not the "
            f"one the corpus was built from (Python {recorded.get('CORPUS_PYTHON')}); "
            "source fingerprints differ",
            file=sys.stderr,
        )
        return 2
    shipped = hashlib.sha256(gzip.decompress(CORPUS_FILE.read_bytes())).hexdigest()
    ok = result.sha256 == shipped == recorded.get("CORPUS_SHA256")
    print(
        f"rebuilt {len(result.data):,} bytes, sha256 {result.sha256}\n"
        f"shipped sha256 {shipped}\nrecorded sha256 {recorded.get('CORPUS_SHA256')}\n"
        + ("OK: identical" if ok else "MISMATCH")
    )
    return 0 if ok else 1


def corpus_doc(result: Build, gz_size: int) -> str:
    """The text of labkit/data/CORPUS.md for this build."""
    return f"""# The labkit corpus

`corpus.txt.gz` holds {len(result.data):,} bytes of ASCII English: the docstrings of the
Python {python_version()} standard library, taken from source with `ast` by
`scripts/build_corpus.py`. labkit's byte-level GPT trains on it (vocabulary of 256 byte values).

| field | value |
| --- | --- |
| source | docstrings of CPython {python_version()}'s standard library (`{sys.implementation.name}`) |
| files read | {result.n_files:,} `.py` files (tests, demos, IDLE, `encodings`, `site-packages` left out) |
| docstrings kept | {result.n_docstrings:,} |
| uncompressed size | {len(result.data):,} bytes |
| compressed size | {gz_size:,} bytes (gzip level {GZIP_LEVEL}, mtime 0) |
| SHA-256 of the uncompressed text | `{result.sha256}` |
| SHA-256 fingerprint of the files read | `{result.source_sha256}` |
| licence | PSF License Version 2, full text in `LICENSE-PSF.txt` |

## Rebuilding it

From the repository root, with the Python version above:

    python scripts/build_corpus.py --check   # rebuild in memory and compare: exit 0 when identical
    python scripts/build_corpus.py           # rewrite this folder

Another Python version (or a distribution that patches its stdlib) gives different text; `--check`
says so (exit status 2) instead of reporting a mismatch.

## Licence and changes made

The docstrings are part of Python, Copyright (c) 2001-2023 Python Software Foundation; All
Rights Reserved, and are redistributed under the PSF License Version 2, whose full text
(the interpreter's own `LICENSE.txt`) is in `LICENSE-PSF.txt`. As that licence asks of a
derivative work, here is a summary of the changes made: only docstrings were kept (all code,
comments and other strings removed); each was dedented with `inspect.cleandoc`, stripped of
trailing spaces and of repeated blank lines; docstrings shorter than {MIN_CHARS} characters,
containing non-ASCII or control characters, or repeating an earlier one were dropped; the
rest were joined, in sorted file order and source order within a file, with one blank line
between them.
"""


def write(result: Build) -> None:
    """Write corpus, provenance and licence to labkit/data/, and say what to record."""
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    packed = gzip_bytes(result.data)
    CORPUS_FILE.write_bytes(packed)
    CORPUS_DOC.write_text(corpus_doc(result, len(packed)), encoding="utf-8")
    shutil.copyfile(stdlib_dir() / "LICENSE.txt", LICENCE_FILE)
    print(
        f"wrote {CORPUS_FILE.relative_to(REPO_ROOT)}: {len(result.data):,} bytes "
        f"({len(packed):,} compressed) from {result.n_docstrings:,} docstrings"
    )
    wanted = {
        "CORPUS_SHA256": result.sha256,
        "CORPUS_BYTES": len(result.data),
        "CORPUS_PYTHON": python_version(),
        "CORPUS_SOURCE_SHA256": result.source_sha256,
    }
    recorded = recorded_values() if DATA_MODULE.exists() else {}
    stale = {k: v for k, v in wanted.items() if recorded.get(k) != v}
    if stale:
        print("update these constants in labkit/data/__init__.py:")
        for key, value in stale.items():
            print(f"    {key} = {value!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="rebuild in memory and compare with the shipped corpus instead of writing it",
    )
    args = parser.parse_args(argv)
    result = build()
    if args.check:
        return check(result)
    write(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
