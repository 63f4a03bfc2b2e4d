"""What a failing rank wrote, cut to the lines that matter: its traceback, its stderr, and
where its faulthandler stack dump says it stands.

A worker's traceback starts with a dozen frames that every worker shares (``python -m``,
torchrun's ``@record``, labkit's entry point) and often runs through torch's module-call
machinery; the learner needs the exception, their own frames and the one that raised. A rank
that died in native code leaves a fatal error and a thread dump instead. Reading these texts is
one job, apart from deciding which rank caused a failure (:mod:`labkit.jobs.diagnosis`), where
a stalled job is held up (:mod:`labkit.jobs.diagnosis.hangs`) or which collective a rank called
(:mod:`labkit.jobs.diagnosis.collective_ledger`): each of those uses it.
"""

from __future__ import annotations

import linecache
import os
import re
import sysconfig
from collections.abc import Sequence

from labkit.jobs import runtime

# --- a traceback, shortened --------------------------------------------------------------------

_FRAME = re.compile(r'^  File "(?P<path>[^"]*)", line \d+, in (?P<func>.*)$')
# Frames that start every worker, whatever it does: ``python -m`` (runpy, importlib), the
# worker module's `if __name__ == "__main__": main()`, torchrun's @record wrapper, and
# labkit.jobs.runtime's entry point. The same in every failure: counted, not shown.
_LAUNCHER_FILES = ("<frozen runpy>", "/runpy.py", "<frozen importlib", "/importlib/",
                   "/torch/distributed/elastic/", "/torch/distributed/run.py")  # fmt: skip
_STDLIB = sysconfig.get_paths()["stdlib"]
PACKAGE_DIR = os.path.dirname(os.path.dirname(runtime.__file__)) + os.sep  # labkit/
EXCERPT_TAIL = 8  # lines kept of a failure's text that is not a Python traceback


def one_line(text: str, limit: int = 160) -> str:
    """``text`` on one line (whitespace runs made one space), cut to ``limit`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _starts_worker(path: str, func: str) -> bool:
    return path == runtime.__file__ or func == "<module>" or any(f in path for f in _LAUNCHER_FILES)


def in_library(path: str) -> bool:
    """The standard library or an installed package (torch...): not code the lab wrote.
    labkit counts as code even where it is installed among the packages."""
    if path.startswith(PACKAGE_DIR):
        return False
    return path.startswith(("<", _STDLIB)) or "-packages/" in path


def library_name(paths: Sequence[str]) -> str:
    """"torch and the standard library": the libraries the frames at ``paths`` belong to."""
    names: list[str] = []
    for path in paths:
        _, found, rest = path.partition("-packages/")
        name = rest.split("/", 1)[0].removesuffix(".py") if found else "the standard library"
        if name not in names:
            names.append(name)
    return " and ".join(names)


def traceback_excerpt(text: str) -> str:
    """The lines of a failing rank's traceback that tell what went wrong, for ``JobFailed``.

    Kept: the exception, every frame of code (the worker's, the learner's, labkit's), and the
    frame that raised. Left out: the frames that start every worker (``_LAUNCHER_FILES``),
    counted in one line; and runs of library frames between kept ones (torch's module-call
    machinery, say), one line per run naming the library. Chained exceptions keep their
    "During handling of..." lines. A text without frames (a rank killed by a signal leaves
    only its log) gives its last ``EXCERPT_TAIL`` lines.
    """
    lines = text.rstrip().splitlines()
    # Blocks: a frame ("  File ..." and its more-indented source and caret lines) or a line.
    blocks: list[tuple[re.Match[str] | None, list[str]]] = []
    for line in lines:
        if blocks and blocks[-1][0] is not None and line.startswith("    "):
            blocks[-1][1].append(line)
        else:
            blocks.append((_FRAME.match(line), [line]))
    if not any(m for m, _ in blocks):
        return "\n".join(lines[-EXCERPT_TAIL:])
    out: list[str] = []
    stack: list[tuple[re.Match[str], list[str]]] = []  # the frames of one traceback
    for m, block in [*blocks, (None, [])]:
        if m is not None:
            stack.append((m, block))
            continue
        out += _excerpt_stack(stack)
        stack = []
        out += block
    return "\n".join(out)


def _excerpt_stack(stack: Sequence[tuple[re.Match[str], list[str]]]) -> list[str]:
    """One traceback's frames, outermost first, as ``traceback_excerpt`` shows them."""
    if not stack:
        return []
    start = 0  # the frames that start the worker come first
    while start < len(stack) - 1 and _starts_worker(stack[start][0]["path"], stack[start][0]["func"]):
        start += 1
    out = [f"  … {start} frames of the launcher (torchrun, labkit.jobs.runtime) left out"] if start else []
    hidden: list[str] = []  # paths of a run of library frames not shown
    for k, (m, block) in enumerate(stack[start:], start):
        if in_library(m["path"]) and k < len(stack) - 1:
            hidden.append(m["path"])
            continue
        if hidden:
            out.append(f"  … {len(hidden)} frame{'s' if len(hidden) > 1 else ''} in "
                       f"{library_name(hidden)}")  # fmt: skip
            hidden = []
        out += block
    return out


def stderr_excerpt(text: str) -> str:
    """The telling part of a rank's stderr when it died without a Python exception.

    Native code that aborts (a failed gloo check, a segfault) prints its message, then Python's
    faulthandler dumps every thread and lists the extension modules: the message is what
    matters, and of the dump, the line of code the rank was on. Otherwise, the last lines.
    """
    lines = text.rstrip().splitlines()
    fatal = next((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")), None)
    if fatal is None:
        return "\n".join(lines[-EXCERPT_TAIL:])
    said = [line for line in lines[max(fatal - EXCERPT_TAIL, 0) : fatal + 1] if line.strip()]
    where = where_stuck("\n".join(lines[fatal:]))
    return "\n".join([*said, *([f"it was at {where}"] if where else [])])


# --- where a stuck rank is, from its stack dump ------------------------------------------------

# faulthandler's dump: a header per thread, then its frames, most recent call first.
_DUMP_THREAD = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-f]+", re.MULTILINE)
_DUMP_FRAME = re.compile(r'^\s+File "(?P<path>[^"]*)", line (?P<line>\d+) in (?P<func>.+)$',
                         re.MULTILINE)  # fmt: skip


def where_stuck(dump: str) -> str | None:
    """"_faults.py, line 73, in main: `time.sleep(...)`" from a rank's faulthandler dump.

    The thread running the worker (the one with labkit.jobs.runtime's frame in it, else the first) is
    read from its innermost frame out: the first frame of code (not the standard library's or
    an installed package's) is where the rank is; a library call it is inside is named too.
    """
    threads = [t for t in _DUMP_THREAD.split(dump) if _DUMP_FRAME.search(t)]
    if not threads:
        return None
    main = next((t for t in threads if runtime.__file__ in t), threads[0])
    frames = list(_DUMP_FRAME.finditer(main))
    inside = [f for f in frames if in_library(f["path"])]
    for f in frames:
        if in_library(f["path"]):
            continue
        source = linecache.getline(f["path"], int(f["line"])).strip()
        where = f"{os.path.basename(f['path'])}, line {f['line']}, in {f['func']}"
        where += f": `{source}`" if source else ""
        if frames[0] is not f and inside and inside[0] is frames[0]:
            where += f", inside {frames[0]['func']} ({library_name([frames[0]['path']])})"
        return where
    return None

