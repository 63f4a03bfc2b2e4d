"""Generate the learners' notebooks from the complete ones: one source per exercise.

``solutions/NN_*.ipynb`` are the source of truth: complete, runnable notebooks. Each learner's
notebook ``notebooks/NN_*.ipynb`` is generated from its solution by cutting out the marked
regions (the habit of nbgrader and srush/GPU-Puzzles):

Code cells: whole-line comment markers, at any indentation, so the solution still runs as-is::

    def count_params(cfg):
        # BEGIN SOLUTION
        h = cfg.d_model
        ...
        # END SOLUTION

becomes, at the indentation of ``# BEGIN SOLUTION``::

    def count_params(cfg):
        raise NotImplementedError("exercise not done yet: replace this line with your code")

The stub says nothing about the answer: hints live with the exercise's check, in steps
(``labkit.course.exercises.hint``), so running a cell gives nothing away. A ``# HINT:`` line inside a
region is refused for the same reason. A region must hold whole statements.

Markdown cells (written answers)::

    <!-- BEGIN SOLUTION -->
    The GPU had not finished: ...
    <!-- END SOLUTION -->

becomes ``*Your answer here.*``.

The generated notebook keeps cell ids and metadata, has no outputs or execution counts, and is
written exactly as Jupyter writes it (nbformat JSON, indent 1, trailing newline), so the same
solution always gives byte-identical output and ``--check`` can compare bytes.

Usage (from the repository root)::

    python -m labkit.course.nbgen            # regenerate notebooks/ from solutions/
    python -m labkit.course.nbgen --check    # exit 1 if notebooks/ is stale or solutions/ has outputs
    python -m labkit.course.nbgen --strip    # clear outputs from solutions/ in place, then regenerate
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import nbformat

from labkit import ids
from labkit.course.exercises import STUB_MESSAGE
from labkit.errors import LabkitError

CODE_BEGIN = re.compile(r"^(?P<indent>[ \t]*)#\s*BEGIN SOLUTION\s*$")
CODE_END = re.compile(r"^[ \t]*#\s*END SOLUTION\s*$")
CODE_HINT = re.compile(r"^[ \t]*#\s*HINT:")
MD_BEGIN = re.compile(r"^\s*<!--\s*BEGIN SOLUTION\s*-->\s*$")
MD_END = re.compile(r"^\s*<!--\s*END SOLUTION\s*-->\s*$")

MD_STUB = "*Your answer here.*"
NOTEBOOK_GLOB = ids.NOTEBOOK_GLOB

LANGUAGE_INFO = {
    "codemirror_mode": {"name": "ipython", "version": 3},
    "file_extension": ".py",
    "mimetype": "text/x-python",
    "name": "python",
    "nbconvert_exporter": "python",
    "pygments_lexer": "ipython3",
    "version": "3.11.7",
}
"""The ``language_info`` ipykernel reports on the course's reference Python (CI's machine).

When a kernel starts, JupyterLab copies the kernel's ``language_info`` into the notebook and
marks the notebook modified if that changed anything (jupyter/notebook #2123), so a notebook
carrying only ``{"name": "python"}`` showed as modified the moment it opened. Carrying the
whole dict, it opens clean; on another Python only ``version`` differs, and JupyterLab updates
it as it would for any notebook. The browser test checks a learner's copy opens clean."""

# Keys that record a run rather than the notebook: JupyterLab's per-cell timing, papermill's
# bookkeeping and saved widget state. They are cleared with the outputs.
RUN_CELL_METADATA = ("execution", "papermill")
RUN_NOTEBOOK_METADATA = ("papermill", "widgets")


class MarkerError(ValueError, LabkitError):
    """Solution markers that do not pair up, or leave a cell that is not valid Python."""


# --------------------------------------------------------------------------- one cell


def _stub_line(indent: str) -> str:
    return f'{indent}raise NotImplementedError("{STUB_MESSAGE}")'


def _replace_code_regions(source: str, where: str) -> str:
    lines = source.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        begin = CODE_BEGIN.match(lines[i])
        if CODE_END.match(lines[i]):
            raise MarkerError(
                f"{where}: '# END SOLUTION' on line {i + 1} has no '# BEGIN SOLUTION' before it"
            )
        if not begin:
            out.append(lines[i])
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and not CODE_END.match(lines[i]):
            if CODE_HINT.match(lines[i]):
                raise MarkerError(
                    f"{where}: '# HINT:' on line {i + 1}: a stub carries no hint (it would give "
                    "the answer away); put graded hints in the exercise's registration "
                    "(labkit.course.exercises.exercise(..., hints=...))"
                )
            if CODE_BEGIN.match(lines[i]):
                raise MarkerError(
                    f"{where}: '# BEGIN SOLUTION' on line {i + 1} is inside the region opened "
                    f"on line {start + 1}; close that one with '# END SOLUTION' first"
                )
            i += 1
        if i == len(lines):
            raise MarkerError(
                f"{where}: '# BEGIN SOLUTION' on line {start + 1} has no matching "
                "'# END SOLUTION'; add one after the solution code"
            )
        out.append(_stub_line(begin["indent"]))
        i += 1  # skip the END line
    return "\n".join(out)


def _replace_markdown_regions(source: str, where: str) -> str:
    lines = source.split("\n")
    out: list[str] = []
    inside_from: int | None = None
    for n, line in enumerate(lines, start=1):
        if MD_BEGIN.match(line):
            if inside_from is not None:
                raise MarkerError(
                    f"{where}: '<!-- BEGIN SOLUTION -->' on line {n} is inside the region "
                    f"opened on line {inside_from}; close that one first"
                )
            inside_from = n
            out.append(MD_STUB)
        elif MD_END.match(line):
            if inside_from is None:
                raise MarkerError(
                    f"{where}: '<!-- END SOLUTION -->' on line {n} has no "
                    "'<!-- BEGIN SOLUTION -->' before it"
                )
            inside_from = None
        elif inside_from is None:
            out.append(line)
    if inside_from is not None:
        raise MarkerError(
            f"{where}: '<!-- BEGIN SOLUTION -->' on line {inside_from} has no matching "
            "'<!-- END SOLUTION -->'"
        )
    return "\n".join(out)


def _parses(source: str) -> bool:
    """True if the cell is valid Python once IPython syntax (%magic, !cmd) is translated."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager

        source = TransformerManager().transform_cell(source)
    except ImportError:  # plain Python cells still get checked
        pass
    try:
        ast.parse(source)
    except SyntaxError:
        return False
    return True


# --------------------------------------------------------------------------- one notebook


def _fill_missing_ids(raw: dict, name: str) -> None:
    """Give id-less cells an id derived from the notebook's name and the cell's index.

    nbformat would otherwise invent random ids on every read, and the output would change
    from run to run. Only nbformat >= 4.5 has cell ids.
    """
    if (raw.get("nbformat"), raw.get("nbformat_minor", 0)) < (4, 5):
        return
    for index, cell in enumerate(raw.get("cells", [])):
        if "id" not in cell:
            cell["id"] = hashlib.sha1(f"{name}:{index}".encode()).hexdigest()[:8]


def read_notebook(path: str | Path) -> nbformat.NotebookNode:
    """Read a v4 notebook; cells without ids get deterministic ones (see _fill_missing_ids)."""
    path = Path(path)
    raw = json.loads(path.read_text(encoding="utf-8"))
    _fill_missing_ids(raw, path.name)
    return nbformat.reads(json.dumps(raw), as_version=4)


def notebook_text(nb: nbformat.NotebookNode) -> str:
    """The notebook as Jupyter writes it: nbformat JSON, indent 1, sorted keys, final newline."""
    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"


CHECKED_OUTPUT_MARKER = "# NBVAL_CHECK_OUTPUT"
"""A code cell carrying this comment keeps its stored output: nbval compares it with the
output of a fresh run. Use it only where the output is deterministic on every machine."""


def strip_outputs(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy with outputs, execution counts and run bookkeeping removed; all else kept.

    Cells marked with :data:`CHECKED_OUTPUT_MARKER` keep their outputs and execution count
    (nbval treats a cell with outputs but no count as never run).
    """
    nb = copy.deepcopy(nb)
    for key in RUN_NOTEBOOK_METADATA:
        nb.metadata.pop(key, None)
    for cell in nb.cells:
        for key in RUN_CELL_METADATA:
            cell.metadata.pop(key, None)
        if cell.cell_type == "code" and CHECKED_OUTPUT_MARKER not in cell.source:
            cell.outputs = []
            cell.execution_count = None
    return nb


def has_outputs(nb: nbformat.NotebookNode) -> bool:
    """True if the notebook carries anything :func:`strip_outputs` would remove."""
    return strip_outputs(nb) != nb


def generate(nb: nbformat.NotebookNode, name: str = "<notebook>") -> nbformat.NotebookNode:
    """The learner's version of solution notebook ``nb`` (which is not modified).

    ``name`` only labels errors: ``MarkerError`` names the notebook, the cell index and line.
    """
    out = strip_outputs(nb)
    out.metadata["language_info"] = copy.deepcopy(LANGUAGE_INFO)  # opens unmodified
    for index, cell in enumerate(out.cells):
        where = f"{name}, cell {index} ({cell.cell_type})"
        if cell.cell_type == "code":
            stubbed = _replace_code_regions(cell.source, where)
            if stubbed != cell.source and _parses(cell.source) and not _parses(stubbed):
                raise MarkerError(
                    f"{where}: the cell is no longer valid Python once its solution region is "
                    "replaced by a stub; a region must hold whole statements"
                )
            cell.source = stubbed
        elif cell.cell_type == "markdown":
            cell.source = _replace_markdown_regions(cell.source, where)
    return out


def generated_text(solution: str | Path) -> str:
    """The exact file contents :func:`main` writes for the solution notebook at ``solution``."""
    solution = Path(solution)
    return notebook_text(generate(read_notebook(solution), name=str(solution)))


# --------------------------------------------------------------------------- folders


@dataclass(frozen=True)
class Report:
    """What a pass over the folders found (paths as given)."""

    stale: tuple[Path, ...] = ()
    """Learners' notebooks that are missing or differ from what would be generated."""
    orphans: tuple[Path, ...] = ()
    """Learners' notebooks with no solution of the same name."""
    with_outputs: tuple[Path, ...] = ()
    """Solutions that carry outputs, execution counts or run metadata."""

    @property
    def ok(self) -> bool:
        return not (self.stale or self.orphans or self.with_outputs)


def solutions_in(src: Path) -> list[Path]:
    if not src.is_dir():
        raise FileNotFoundError(
            f"solutions folder {str(src)!r} does not exist; run from the repository root "
            "or pass --src"
        )
    return sorted(src.glob(NOTEBOOK_GLOB))


def sync(src: str | Path, dst: str | Path, *, check: bool = False, strip: bool = False) -> Report:
    """Regenerate ``dst`` from ``src`` (or, with ``check``, only compare; nothing is written).

    With ``strip``, solutions that carry outputs are first rewritten without them.
    """
    src, dst = Path(src), Path(dst)
    solutions = solutions_in(src)
    stale, with_outputs = [], []
    for solution in solutions:
        nb = read_notebook(solution)
        if has_outputs(nb):
            if strip and not check:
                solution.write_text(
                    notebook_text(strip_outputs(nb)), encoding="utf-8", newline="\n"
                )
            else:
                with_outputs.append(solution)
        target = dst / solution.name
        text = notebook_text(generate(nb, name=str(solution)))
        if target.exists() and target.read_bytes() == text.encode("utf-8"):
            continue
        if check:
            stale.append(target)
        else:
            dst.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8", newline="\n")
    names = {s.name for s in solutions}
    orphans = [p for p in sorted(dst.glob(NOTEBOOK_GLOB)) if p.name not in names]
    return Report(tuple(stale), tuple(orphans), tuple(with_outputs))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m labkit.course.nbgen",
        description="Generate learners' notebooks from solutions/ by replacing marked "
        "solution regions with stubs.",
    )
    parser.add_argument(
        "--src",
        default="solutions",
        help="folder of solution notebooks "
        "(default: %(default)s, relative to the current directory)",
    )
    parser.add_argument(
        "--dst", default="notebooks", help="folder of learners' notebooks (default: %(default)s)"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if any "
        "learner's notebook is stale or orphaned, or any solution has outputs",
    )
    mode.add_argument(
        "--strip", action="store_true", help="also clear outputs from the solutions in place"
    )
    args = parser.parse_args(argv)

    try:
        report = sync(args.src, args.dst, check=args.check, strip=args.strip)
    except (MarkerError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path in report.stale:
        print(f"stale: {path} differs from what {args.src}/{path.name} generates")
    for path in report.orphans:
        print(f"orphan: {path} has no {args.src}/{path.name}")
    for path in report.with_outputs:
        print(f"outputs: {path} carries outputs or execution counts")
    if report.ok:
        print("notebooks are up to date" if args.check else f"wrote {args.dst}/ from {args.src}/")
        return 0
    if report.stale or report.with_outputs:
        print("fix: run `python -m labkit.course.nbgen --strip` and commit both folders", file=sys.stderr)
    if report.orphans:
        print(f"fix: delete the orphans or add their solutions to {args.src}/", file=sys.stderr)
    # Generating succeeded even with warnings; only --check turns findings into a failure.
    return 1 if args.check else 0


if __name__ == "__main__":
    sys.exit(main())
