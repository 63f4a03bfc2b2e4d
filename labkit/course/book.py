"""The rendered course: every learner's notebook, executed, as one static site (``./course book``).

    ./course book                               # run each learner's copy at lab size, then build
    ./course book --executed build/executed     # build from notebooks executed already (CI)
    ./course book --size smoke --only 00 01     # a quick look at two notebooks

Three steps, each a function here:

1. :func:`execute`: each learner's copy (``notebooks/``: exercises not done, each reporting itself
   in one line; no solution is published) runs top to bottom under papermill, at the learner's
   default size (``lab``), into ``build/executed/``. :func:`stamp` writes the run's date,
   machine, tier and size into each notebook's metadata (``labkit_run``). CI skips this step:
   ``tests/test_notebooks.py`` leaves the notebooks it executed in ``$LABKIT_EXECUTED_DIR``
   (:func:`keep`), stamped the same way.
2. :func:`prepare`: copies of the executed notebooks, each with a run header (:func:`header`)
   under its title and without papermill's injected-parameters cell, and the front page, the
   README's curriculum with every notebook linked, in course order (:func:`front_page`), go to
   ``build/book-src/``. The committed notebooks are never touched.
3. :func:`build`: Sphinx with myst-nb (``book/conf.py``; execution off, so nothing runs twice)
   writes the site to ``build/book/``. Publishing it: ``book/README.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from unittest import mock

from labkit import ids
from labkit.course import timings

ROOT = Path(__file__).resolve().parents[2]
"""The course checkout: the book is built from its README and notebooks."""
SIZES = ("smoke", "lab", "gpu")
DEFAULT_SIZE = "lab"
"""The learner's default: what a learner's parameters cell runs when LABKIT_SIZE is unset."""
CELL_TIMEOUT_S = 900  # notebook 06 compiles the model at lab size: a cold compile takes a minute
RUN_KEY = "labkit_run"
"""The executed notebook's metadata key that holds its :class:`RunInfo`."""
TIER_RUNS = {
    "cpu": "CPU tier: ranks as processes over gloo",
    "single-gpu": "single-GPU tier: CUDA, NVML metrics",
    "multi-gpu": "multi-GPU tier: one process per GPU over NCCL",
}
"""Each tier as the README's tier table says what runs in it."""
NOT_RECORDED = "not recorded"


# ----------------------------------------------------------------------------------------------
# What each page says about its run


@dataclass(frozen=True)
class RunInfo:
    """Where and how one notebook was executed: what its page states at the top."""

    date: str
    """When the run ended, ISO 8601 in UTC (papermill's ``end_time``)."""
    machine: str
    """CPU model, usable cores and memory (:func:`labkit.course.timings.machine_line`)."""
    os: str
    """The operating system, e.g. "Debian GNU/Linux 12 (bookworm), Linux 6.1.0"."""
    tier: str
    """One of :data:`TIER_RUNS`' keys: "cpu", "single-gpu", "multi-gpu"."""
    size: str
    """The size parameter the notebook ran at: smoke, lab or gpu."""

    @classmethod
    def of(cls, nb: Any) -> RunInfo:
        """The run stamped in ``nb``'s metadata; a field never stamped reads "not recorded",
        except the date and size, which papermill's own metadata also holds."""
        run = dict(nb.metadata.get(RUN_KEY, {}))
        papermill = nb.metadata.get("papermill", {})
        run.setdefault("date", papermill.get("end_time") or NOT_RECORDED)
        run.setdefault("size", papermill.get("parameters", {}).get("size", NOT_RECORDED))
        return cls(**{name: str(run.get(name, NOT_RECORDED)) for name in
                      ("date", "machine", "os", "tier", "size")})  # fmt: skip


def _os_name() -> str:
    try:
        distro = platform.freedesktop_os_release()["PRETTY_NAME"]
    except (OSError, KeyError):
        distro = platform.platform(terse=True)
    return f"{distro}, {platform.system()} {platform.release()}"


def this_run(nb: Any, *, size: str | None = None) -> RunInfo:
    """The run of ``nb``, executed just now on this machine: the end time papermill recorded
    (else now), this machine, its tier, and ``size`` (else the size papermill injected, else
    ``LABKIT_SIZE``, else the learner's default)."""
    from labkit import hardware  # lazy: detection imports torch

    papermill = nb.metadata.get("papermill", {})
    injected = papermill.get("parameters", {}).get("size")
    return RunInfo(
        date=papermill.get("end_time") or datetime.now(timezone.utc).isoformat(),
        machine=timings.machine_line(), os=_os_name(), tier=hardware.tier(),
        size=size or injected or os.environ.get("LABKIT_SIZE") or DEFAULT_SIZE,
    )  # fmt: skip


def stamp(nb: Any, run: RunInfo) -> None:
    """Write ``run`` into ``nb``'s metadata, where :meth:`RunInfo.of` reads it back."""
    nb.metadata[RUN_KEY] = asdict(run)


def keep(nb: Any, dest: Path) -> Path:
    """Stamp an executed notebook with this run and save it at ``dest``: how the test suite
    leaves what it executed for ``./course book --executed``."""
    import nbformat

    stamp(nb, this_run(nb))
    dest.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, dest)
    return dest


def _when(date: str) -> str:
    """"2026-12-06 16:17 UTC" from an ISO 8601 time; anything else as it is."""
    try:
        moment = datetime.fromisoformat(date)
    except ValueError:
        return date
    if moment.tzinfo is not None:
        moment = moment.astimezone(timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M UTC")


def header(run: RunInfo) -> str:
    """The run header every page shows under its title, as MyST Markdown (an admonition)."""
    tier = TIER_RUNS.get(run.tier, run.tier)
    size = f"{run.size} (the learner's default)" if run.size == DEFAULT_SIZE else run.size
    return "\n".join([
        "```{admonition} This page is a real run",
        ":class: note labkit-run",
        "",
        f"- **Date:** {_when(run.date)}",
        f"- **Machine:** {run.machine}; {run.os}",
        f"- **Tier:** {tier}",
        f"- **Size:** {size}",
        "",
        "The learner's copy, run top to bottom as it is: each exercise reports itself \"not done "
        "yet\" in one line, and no solution is shown. Figures from real GPUs are recordings, "
        "labelled with their hardware and date.",
        "```",
    ])  # fmt: skip


# ----------------------------------------------------------------------------------------------
# The pages


def page(nb: Any) -> Any:
    """A copy of executed ``nb`` as its page shows it: the run header under the title, no
    injected-parameters cell (the header states the size), no saved widget state (the static
    page shows each widget's HTML instead, and loads no widget script from the network)."""
    import copy

    import nbformat

    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)
    nb.cells = [c for c in nb.cells if "injected-parameters" not in c.metadata.get("tags", [])]
    box = nbformat.v4.new_markdown_cell(header(RunInfo.of(nb)))
    first = nb.cells[0] if nb.cells else None
    if first is not None and first.cell_type == "markdown" and first.source.startswith("# "):
        title, _, rest = first.source.partition("\n")
        first.source = title
        nb.cells[1:1] = [box] + ([nbformat.v4.new_markdown_cell(rest.strip())] if rest.strip()
                                 else [])  # fmt: skip
    else:
        nb.cells.insert(0, box)
    for cell in nb.cells:  # new cells get random ids; the page needs none
        cell.pop("id", None)
    nb.nbformat_minor = min(nb.get("nbformat_minor", 4), 4)  # ids are optional before 4.5
    return nb


def curriculum(readme: str) -> str:
    """The README's "## Curriculum" section, up to the next "## " heading."""
    lines = readme.splitlines()
    try:
        start = lines.index("## Curriculum")
    except ValueError:
        raise ValueError("README.md has no '## Curriculum' section for the front page") from None
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start:end]).strip() + "\n"


def _intro(readme: str) -> tuple[str, str]:
    """The README's title and its first paragraph."""
    blocks = readme.strip().split("\n\n")
    return blocks[0].lstrip("# ").strip(), blocks[1].strip()


def front_page(readme: str, stems: Sequence[str], runs: Sequence[RunInfo] = ()) -> str:
    """The front page: the README's title, first paragraph and curriculum, each notebook's name
    in the curriculum table linked to its page (only those in ``stems``, the pages built), the
    runs summarised, and the table of contents in course order (the sidebar's)."""
    title, intro = _intro(readme)
    table = []
    for line in curriculum(readme).splitlines():
        if line.startswith("| "):
            for stem in stems:
                line = line.replace(f"`{stem}`", f"[`{stem}`](notebooks/{stem}.ipynb)")
        table.append(line)
    parts = [f"# {title}", "", intro, ""]
    if runs:
        dates = sorted(_when(r.date) for r in runs)
        span = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
        facts = sorted({f"{TIER_RUNS.get(r.tier, r.tier)}, size {r.size}; {r.machine}; {r.os}"
                        for r in runs})  # fmt: skip
        parts += [
            f"This book shows {len(stems)} notebooks as a learner sees them after running each "
            "one top to bottom: the learners' copies, exercises not done, every output kept. "
            f"They ran {span}: {' / '.join(facts)}. Each page says how it ran.", ""]  # fmt: skip
    parts += table
    parts += ["", "```{toctree}", ":hidden:", ":caption: Notebooks", ""]
    parts += [f"notebooks/{stem}" for stem in stems]
    parts += ["```", ""]
    return "\n".join(parts)


def executed_notebooks(folder: Path) -> list[Path]:
    """The course notebooks in ``folder``, in course order (their ids sort as the course runs)."""
    return sorted(Path(folder).glob(ids.NOTEBOOK_GLOB))


def prepare(executed: Path, src: Path, *, readme: Path = ROOT / "README.md") -> list[str]:
    """Fill ``src`` (emptied first) with the front page and one page per notebook in
    ``executed``; returns the notebooks' stems in course order."""
    import nbformat

    found = executed_notebooks(executed)
    if not found:
        raise FileNotFoundError(f"no executed notebooks ({ids.NOTEBOOK_GLOB}) in {executed}")
    shutil.rmtree(src, ignore_errors=True)
    (src / "notebooks").mkdir(parents=True)
    runs = []
    for path in found:
        nb = nbformat.read(path, as_version=4)
        runs.append(RunInfo.of(nb))
        nbformat.write(page(nb), src / "notebooks" / path.name)
    stems = [p.stem for p in found]
    (src / "index.md").write_text(front_page(readme.read_text(encoding="utf-8"), stems, runs),
                                  encoding="utf-8")  # fmt: skip
    return stems


# ----------------------------------------------------------------------------------------------
# Executing and building


def _kernel_environment(size: str) -> dict[str, str]:
    """LABKIT_SIZE for the kernels (and any job they launch), and notebook 07's job fixed to the
    one the README's run times are of, as the test suite and ``labkit timings`` do."""
    values = {"LABKIT_SIZE": size}
    if not os.environ.get("LABKIT_CAPSTONE_JOB"):
        from labkit.course import capstone

        values["LABKIT_CAPSTONE_JOB"] = capstone.example_code()
    return values


def execute(notebooks: Sequence[Path], out: Path, size: str = DEFAULT_SIZE, *,
            progress: Callable[[str], None] = print) -> list[Path]:  # fmt: skip
    """Run each notebook top to bottom in a fresh kernel (cwd: its folder) at ``size``, stamp it
    (:func:`stamp`) and save it in ``out``; one progress line per notebook, with its time. A
    notebook that raises stops here: the book shows no error."""
    import nbformat
    import papermill as pm

    if size not in SIZES:
        raise ValueError(f"size={size!r} is not allowed: one of {SIZES}")
    out.mkdir(parents=True, exist_ok=True)
    done = []
    with mock.patch.dict(os.environ, _kernel_environment(size)):  # restored afterwards
        for path in notebooks:
            dest = out / path.name
            start = time.perf_counter()
            try:
                pm.execute_notebook(str(path), str(dest), parameters={"size": size},
                                    cwd=str(path.parent), kernel_name="python3",
                                    execution_timeout=CELL_TIMEOUT_S, progress_bar=False,
                                    log_output=False)  # fmt: skip
            except pm.PapermillExecutionError as e:
                raise RuntimeError(f"{path.name} raised {e.ename} in cell {e.exec_count} at "
                                   f"size {size}: {e.evalue} (the executed copy: {dest})") from e  # fmt: skip
            nb = nbformat.read(dest, as_version=4)
            stamp(nb, this_run(nb, size=size))
            nbformat.write(nb, dest)
            progress(f"book: {path.stem:<36} {size:<6} {time.perf_counter() - start:6.0f} s")
            done.append(dest)
    return done


def build(src: Path, out: Path, *, conf: Path = ROOT / "book") -> float:
    """Sphinx (``conf/conf.py``: myst-nb, execution off) from ``src`` into ``out``, emptied
    first; returns its wall time in seconds."""
    shutil.rmtree(out, ignore_errors=True)
    doctrees = out.with_name(out.name + "-doctrees")
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-E", "-c", str(conf),
           "-d", str(doctrees), str(src), str(out)]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - start


@dataclass(frozen=True)
class Site:
    """What :func:`build` made: its pages, its size on disk."""

    pages: int
    """HTML pages: the front page and one per notebook (Sphinx's search and index pages not
    counted)."""
    size_bytes: int


def site(out: Path) -> Site:
    pages = [p for p in out.rglob("*.html") if p.parent == out / "notebooks" or
             p == out / "index.html"]  # fmt: skip
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return Site(len(pages), size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./course book", description=__doc__.split("\n\n")[0])
    parser.add_argument("--executed", type=Path, metavar="DIR",
                        help="build from the notebooks executed already in DIR (CI: the test "
                             "suite's, LABKIT_EXECUTED_DIR); default: execute them first")  # fmt: skip
    parser.add_argument("--size", default=DEFAULT_SIZE, choices=SIZES,
                        help="the size to execute at (default: %(default)s, the learner's)")  # fmt: skip
    parser.add_argument("--only", nargs="+", metavar="NN",
                        help="notebook ids, e.g. 00 03b (default: all)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "build",
                        help="the build folder: executed/, book-src/, book/ (default: %(default)s)")  # fmt: skip
    args = parser.parse_args(argv)
    executed = args.executed
    if executed is None:
        try:
            notebooks = timings.find_notebooks(ROOT / "notebooks", args.only)
        except (FileNotFoundError, ValueError) as e:
            parser.error(str(e))
        executed = args.out / "executed"
        print(f"book: executing {len(notebooks)} learner's notebooks at size {args.size} into "
              f"{executed} (about a minute each at lab size on 2 cores)")  # fmt: skip
        try:
            execute(notebooks, executed, args.size)
        except RuntimeError as e:
            print(f"book: {e}", file=sys.stderr)
            return 1
    elif args.only:
        parser.error("--only chooses notebooks to execute: with --executed the book holds "
                     "every notebook in DIR")  # fmt: skip
    try:
        stems = prepare(executed, args.out / "book-src")
    except (FileNotFoundError, ValueError) as e:
        print(f"book: {e}", file=sys.stderr)
        return 1
    missing = sorted({p.stem for p in (ROOT / "notebooks").glob(ids.NOTEBOOK_GLOB)} - set(stems))
    if missing:
        print(f"book: not in {executed}, so not in the book: {', '.join(missing)}")
    book = args.out / "book"
    try:
        seconds = build(args.out / "book-src", book)
    except subprocess.CalledProcessError as e:
        print(f"book: Sphinx failed (exit {e.returncode}); its messages are above",
              file=sys.stderr)  # fmt: skip
        return 1
    made = site(book)
    print(f"book: {book / 'index.html'}: {made.pages} pages, {made.size_bytes / 2**20:.1f} MiB, "
          f"built by Sphinx in {seconds:.0f} s; to publish it, see book/README.md")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
