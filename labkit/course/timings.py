"""How long each notebook takes on this machine, section by section: a workshop's timing plan.

    python -m labkit timings                         # every notebook in solutions/, smoke size
    python -m labkit timings --size lab --only 02 03b --out /tmp/plan
    python -m labkit timings --size smoke lab --record   # the README's run times (repo checkout)

Each notebook in ``solutions/`` (the complete ones: every exercise check runs too, so this is the
longest a learner's copy takes) runs headless in a fresh kernel, with the ``size`` parameter
injected as papermill does, and is timed three ways:

- total: wall time from before the kernel starts to after it is shut down (imports, every cell,
  the jobs the notebook launches);
- per section (each ``## `` heading up to the next): the sum of its code cells' run times, from
  the execution timestamps the kernel reports for each cell (``iopub.execute_input`` to
  ``shell.execute_reply``);
- peak memory: the peak of the summed resident memory (RSS) of the kernel's whole process tree
  (the kernel and every process it starts: the ranks of a launched job, their workers), sampled
  every ``sample_every_s`` (0.2 s) from this process with psutil. A sampled peak can miss a
  spike shorter than the interval, and RSS counts shared pages once per process.

The results go to ``--out`` (default ``<labkit home>/timings``) as ``timings-<size>.json`` and
``timings-<size>.md``. Nothing here is a pass or fail: it is a measurement of this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

from labkit import ids
from labkit.jobs import procs
from labkit.validate import whole

SIZES = ("smoke", "lab", "gpu")
SAMPLE_EVERY_S = 0.2
BEFORE_FIRST_SECTION = "(before the first section)"
MEMORY_NOTE = (
    "peak memory: the highest summed RSS of the kernel and every process it started (the "
    "launched ranks included), sampled every {every:g} s with psutil; a shorter spike can be "
    "missed, and pages shared between processes count once per process"
)


@dataclass
class Section:
    """One ``## `` section: its title, its code cells' summed run time, its sampled memory peak."""

    title: str
    seconds: float = 0.0
    cells: int = 0
    peak_rss_bytes: int | None = None


@dataclass
class NotebookTiming:
    """One notebook run at one size."""

    notebook: str  # the file's stem, "02_data_parallelism"
    size: str
    total_s: float
    peak_rss_bytes: int | None
    sections: list[Section] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------------------------
# Sections and cell times


def section_of_cells(nb: Any) -> list[str]:
    """Each cell's section title: the last ``## `` heading of a markdown cell at or above it."""
    title, out = BEFORE_FIRST_SECTION, []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in "".join(cell.source).splitlines():
                if line.startswith("## "):
                    title = line[3:].strip()
                    break
        out.append(title)
    return out


def _stamp(value: Any) -> float | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def cell_seconds(cell: Any) -> float | None:
    """A code cell's run time from the kernel's timestamps; None when it did not run."""
    ex = cell.get("metadata", {}).get("execution", {})
    start, end = _stamp(ex.get("iopub.execute_input")), _stamp(ex.get("shell.execute_reply"))
    return None if start is None or end is None else max(0.0, end - start)


def sections_of(nb: Any, peaks: dict[str, int] | None = None) -> list[Section]:
    """The executed notebook's sections in order, their code cells' run times summed."""
    found: dict[str, Section] = {}
    for cell, title in zip(nb.cells, section_of_cells(nb), strict=True):
        sec = found.setdefault(title, Section(title))
        if cell.cell_type != "code":
            continue
        seconds = cell_seconds(cell)
        if seconds is not None:
            sec.seconds += seconds
            sec.cells += 1
    for title, sec in found.items():
        sec.peak_rss_bytes = (peaks or {}).get(title)
    return [s for s in found.values() if s.cells or s.title != BEFORE_FIRST_SECTION]


# ----------------------------------------------------------------------------------------------
# Memory of a process tree


def tree_rss(pid: int) -> int | None:
    """Summed RSS of ``pid`` and all its descendants; None when ``pid`` is gone."""
    try:
        root = psutil.Process(pid)
        members = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for p in members:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue  # ended between the listing and the reading
    return total


class TreeMemorySampler:
    """Samples a process tree's summed RSS every ``every_s`` in a thread; keeps the peak overall
    and per label (the section running when the sample was taken)."""

    def __init__(self, every_s: float = SAMPLE_EVERY_S) -> None:
        if not every_s > 0:
            raise ValueError(f"every_s={every_s!r}: need seconds > 0")
        self.every_s = every_s
        self.pid: int | None = None
        self.label = BEFORE_FIRST_SECTION
        self.peak: int | None = None
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="labkit-timings-rss")

    def start(self) -> TreeMemorySampler:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def sample(self) -> None:
        if self.pid is None:
            return
        rss = tree_rss(self.pid)
        if rss is None:
            return
        label = self.label
        self.peak = rss if self.peak is None else max(self.peak, rss)
        self.peaks[label] = max(self.peaks.get(label, 0), rss)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


# ----------------------------------------------------------------------------------------------
# Running one notebook


def _kernel_pid(client: Any) -> int | None:
    km = getattr(client, "km", None)
    provisioner = getattr(km, "provisioner", None)
    pid = getattr(provisioner, "pid", None)
    if pid is None:
        process = getattr(provisioner, "process", None)
        pid = getattr(process, "pid", None)
    return int(pid) if pid is not None else None


def run_notebook(path: Path, size: str, out_dir: Path | None = None, *,
                 sample_every_s: float = SAMPLE_EVERY_S, timeout_s: float | None = None,
                 kernel_name: str = "python3") -> NotebookTiming:  # fmt: skip
    """Execute ``path`` at ``size`` in a fresh kernel (cwd: its folder) and time it.

    The ``size`` parameter is injected after the cell tagged ``parameters``, as papermill does,
    and ``LABKIT_SIZE`` is set for the kernel. With ``out_dir``, the executed notebook is saved
    there as ``<size>-<name>``.
    """
    import nbformat  # lazy: only this tool needs them
    from nbclient import NotebookClient
    from papermill.parameterize import parameterize_notebook

    if size not in SIZES:
        raise ValueError(f"size={size!r}: one of {SIZES}")
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    nb.metadata.setdefault("papermill", {})  # parameterize_notebook records the parameters here
    for cell in nb.cells:  # and looks for the "parameters" tag on every cell
        cell.metadata.setdefault("tags", [])
    nb = parameterize_notebook(nb, {"size": size}, kernel_name=kernel_name, language="python")
    titles = section_of_cells(nb)
    sampler = TreeMemorySampler(sample_every_s)

    def on_cell_execute(cell: Any, cell_index: int, **_: Any) -> None:
        sampler.label = titles[cell_index]
        if sampler.pid is None:
            sampler.pid = _kernel_pid(client)

    client = NotebookClient(
        nb, timeout=timeout_s, kernel_name=kernel_name, record_timing=True,
        resources={"metadata": {"path": str(path.parent.resolve())}},
        on_cell_execute=on_cell_execute,
    )  # fmt: skip
    env_before = os.environ.get("LABKIT_SIZE")
    os.environ["LABKIT_SIZE"] = size  # the kernel inherits this process's environment
    if "LABKIT_CAPSTONE_JOB" not in os.environ:  # notebook 07: the test suite's job, this tier
        from labkit.course import capstone

        os.environ["LABKIT_CAPSTONE_JOB"] = capstone.example_code()
    start = time.perf_counter()
    sampler.start()
    try:
        client.execute()
    finally:
        total = time.perf_counter() - start
        sampler.sample()
        sampler.stop()
        if env_before is None:
            os.environ.pop("LABKIT_SIZE", None)
        else:
            os.environ["LABKIT_SIZE"] = env_before
        if out_dir is not None:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, Path(out_dir) / f"{size}-{path.name}")
    return NotebookTiming(path.stem, size, total, sampler.peak, sections_of(nb, sampler.peaks))


# ----------------------------------------------------------------------------------------------
# Many notebooks, the record and the table


def find_notebooks(solutions: Path, only: Sequence[str] | None = None) -> list[Path]:
    """The notebooks in ``solutions`` (``NN_*.ipynb``), or those whose id is in ``only``; an id
    in ``only`` that names no notebook is a ValueError listing the ids there are."""
    if not Path(solutions).is_dir():
        raise FileNotFoundError(f"solutions folder {str(solutions)!r} does not exist; run from "
                                "the repository root or pass --solutions")  # fmt: skip
    found = sorted(Path(solutions).glob(ids.NOTEBOOK_GLOB))
    known = [ids.notebook_id(p) for p in found]
    unknown = [nb for nb in only or () if nb not in known]
    if unknown:
        raise ValueError(_unknown_notebooks(unknown, known, Path(solutions)))
    return [p for p in found if only is None or ids.notebook_id(p) in only]


def _unknown_notebooks(unknown: Sequence[str], known: Sequence[str], solutions: Path) -> str:
    """What ``--only`` names that is no notebook, with the ids there are; "1" gets "write 01"."""
    fixes = []
    for nb in unknown:  # an id is two digits and an optional lower-case letter: "03b"
        match = re.fullmatch(r"(\d{1,2})([a-zA-Z]?)", nb.strip())
        guess = f"{int(match[1]):02d}{match[2].lower()}" if match else None
        if guess in known and guess != nb:
            fixes.append(f"write {guess} for {nb}")
    hint = f" ({'; '.join(fixes)})" if fixes else ""
    listed = ", ".join(known) if known else "none"
    return (f"--only {' '.join(unknown)}: no such notebook in {solutions}{hint}; the notebooks "
            f"are {listed}")


def run_many(notebooks: Sequence[Path], sizes: Sequence[str], *, rounds: int = 1,
             out_dir: Path | None = None, progress: Callable[[str], None] | None = print,
             run: Callable[..., NotebookTiming] | None = None) -> list[NotebookTiming]:  # fmt: skip
    """Run every notebook at every size, ``rounds`` times (odd rounds in reverse order, so a
    neighbour's burst of load does not always land on the same notebook), with progress lines."""
    rounds = whole("rounds", rounds, low=1)
    run = run_notebook if run is None else run
    results, n, k = [], len(notebooks) * len(sizes) * rounds, 0
    for r in range(rounds):
        order = list(notebooks) if r % 2 == 0 else list(notebooks)[::-1]
        for size in sizes:
            for path in order:
                k += 1
                if progress:
                    progress(f"[{k}/{n}] {size:<5} {path.stem} ...")
                t = run(path, size, out_dir)
                results.append(t)
                if progress:
                    peak = _gib(t.peak_rss_bytes)
                    progress(f"[{k}/{n}] {size:<5} {path.stem}: {t.total_s:.1f} s, "
                             f"peak memory {peak}, {len(t.sections)} sections")  # fmt: skip
    return results


def key(size: str, stem: str) -> str:
    """The record's name for one notebook at one size: "lab/01_single_gpu_training"."""
    return f"{size}/{stem}"


def to_record_fields(results: Sequence[NotebookTiming]) -> dict[str, Any]:
    """The record's measured fields: ``samples_s`` and ``summary`` (as the README's run times
    have always been read), and ``peak_rss_bytes`` and ``sections`` per notebook and size."""
    samples: dict[str, list[float]] = {}
    peaks: dict[str, list[int | None]] = {}
    sections: dict[str, list[list[dict[str, Any]]]] = {}
    for t in results:
        k = key(t.size, t.notebook)
        samples.setdefault(k, []).append(t.total_s)
        peaks.setdefault(k, []).append(t.peak_rss_bytes)
        sections.setdefault(k, []).append([asdict(s) for s in t.sections])
    summary = {k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)}
               for k, v in samples.items()}  # fmt: skip
    return {"samples_s": samples, "summary": summary, "peak_rss_bytes": peaks,
            "sections": sections, "memory_note": MEMORY_NOTE.format(every=SAMPLE_EVERY_S)}  # fmt: skip


def round5(seconds: float) -> int:
    return 5 * round(seconds / 5)


def run_time_cell(record: dict[str, Any], stem: str) -> str:
    """The README curriculum table's run-time cell for a notebook: "~20 s / ~60 s" (smoke /
    lab medians of the record, rounded to 5 s)."""
    smoke, lab = (round5(record["summary"][key(s, stem)]["median_s"]) for s in ("smoke", "lab"))
    return f"~{smoke} s / ~{lab} s"


def _gib(n: int | None) -> str:
    return "N/A" if n is None else f"{n / 2**30:.2f} GiB"


def _minsec(s: float) -> str:
    return f"{s:.1f} s" if s < 60 else f"{int(s // 60)} min {s % 60:04.1f} s"


def markdown(
    results: Sequence[NotebookTiming], *, machine: str = "", every_s: float = SAMPLE_EVERY_S
) -> str:
    """The timing plan as Markdown: one row per notebook, then each notebook's sections."""
    lines = ["# Notebook timings", ""]
    if machine:
        lines += [f"Measured on {machine}.", ""]
    lines += [
        "Total: wall time of the whole notebook in a fresh kernel (start-up included). Section: "
        "the summed run time of its code cells. P" + MEMORY_NOTE.format(every=every_s)[1:] + ".",
        "",
        "| notebook | size | total | peak memory (sampled) |", "|---|---|---:|---:|",
    ]  # fmt: skip
    for t in results:
        lines.append(f"| `{t.notebook}` | {t.size} | {_minsec(t.total_s)} | "
                     f"{_gib(t.peak_rss_bytes)} |")  # fmt: skip
    for t in results:
        lines += ["", f"## `{t.notebook}` ({t.size}): {_minsec(t.total_s)}", "",
                  "| section | cells | run time | peak memory (sampled) |", "|---|---:|---:|---:|"]  # fmt: skip
        for s in t.sections:
            peak = "no sample taken" if s.peak_rss_bytes is None else _gib(s.peak_rss_bytes)
            lines.append(f"| {s.title} | {s.cells} | {_minsec(s.seconds)} | {peak} |")
    return "\n".join(lines) + "\n"


def machine_line() -> str:
    from labkit import hardware  # lazy: reads /proc/cpuinfo

    cpu = hardware.cpu_info()
    mem = psutil.virtual_memory().total / 2**30
    return f"{cpu.model_name}, {cpu.usable_cores} usable cores, {mem:.0f} GiB RAM"


def default_out_dir() -> Path:
    return procs.labkit_home() / "timings"


def write(results: Sequence[NotebookTiming], out_dir: Path, sizes: Sequence[str]) -> list[Path]:
    """``timings-<sizes>.json`` and ``.md`` in ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "timings-" + "-".join(sizes)
    machine = machine_line()
    data = {"machine": machine, "sample_every_s": SAMPLE_EVERY_S,
            "memory_note": MEMORY_NOTE.format(every=SAMPLE_EVERY_S),
            "notebooks": [t.to_dict() for t in results]}  # fmt: skip
    js, md = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    js.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    md.write_text(markdown(results, machine=machine), encoding="utf-8")
    return [js, md]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="labkit timings", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--size", nargs="+", default=["smoke"], choices=SIZES, help="sizes to run (default: smoke)"
    )
    parser.add_argument(
        "--only", nargs="+", metavar="NN", help="notebook numbers, e.g. 02 03b (default: all)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"folder for the JSON and Markdown (default: {default_out_dir()})",
    )
    parser.add_argument(
        "--solutions",
        type=Path,
        default=Path("solutions"),
        help="folder of the complete notebooks (default: %(default)s)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="runs of each notebook per size")
    parser.add_argument("--record", action="store_true",
                        help="also write the repository's benchmarks/results/notebooks-<machine>"
                             ".json, which the README's run times are checked against (run it "
                             "with --size smoke lab on a quiet machine)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give 1 or more")
    try:
        notebooks = find_notebooks(args.solutions, args.only)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    if not notebooks:
        parser.error(f"--only {args.only}: no such notebook in {args.solutions}")
    if args.record:  # one place builds the record: the benchmark, over this module
        root = Path(__file__).resolve().parents[2]
        if not (root / "benchmarks" / "bench_notebooks.py").is_file():
            parser.error("--record writes into the course repository's benchmarks/results/: "
                         "run it from a checkout")  # fmt: skip
        sys.path.insert(0, str(root))
        from benchmarks import bench_notebooks

        forwarded = ["--sizes", *args.size, "--rounds", str(args.rounds), "--record"]
        if args.only:
            forwarded += ["--only", *args.only]
        if args.out:
            forwarded += ["--timings-out", str(args.out)]
        return bench_notebooks.main(forwarded)
    out = args.out or default_out_dir()
    results = run_many(notebooks, args.size, rounds=args.rounds)
    for p in write(results, out, args.size):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
