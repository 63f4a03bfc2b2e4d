"""Nsight Systems' statistics read back: the CSV of ``nsys stats`` as tables, and a figure.

Apart from :mod:`labkit.profiling.nsight` (which runs ``nsys``) because reading is pure: these
parsers take the text ``nsys stats --format csv`` printed, so they are tested on NVIDIA's
documented layout on any machine, and a report copied from a GPU machine reads anywhere.

- :func:`parse_kernel_summary` (``cuda_gpu_kern_sum``), :func:`parse_nvtx_summary`
  (``nvtx_sum``), :func:`parse_memop_time_summary` (``cuda_gpu_mem_time_sum``),
  :func:`parse_memop_size_summary` (``cuda_gpu_mem_size_sum``): one :class:`SummaryTable`
  each, columns found by name, a preamble and extra columns tolerated;
- :class:`NsysSummaries` (one rank's four tables), :class:`NsysResult` (a run and its ranks);
- :func:`plot_kernel_summary`: the top kernels by GPU time, as bars;
- :func:`short_kernel_name` and :func:`csv_float`, which the ncu reader
  (:mod:`labkit.profiling.ncu_reports`) uses too.

Source for the report names and their columns: Nsight Systems Post-Collection Analysis Guide,
https://docs.nvidia.com/nsight-systems/AnalysisGuide/index.html ("Statistical Reports Shipped
With Nsight Systems"). matplotlib is imported only to draw.
"""

from __future__ import annotations

import csv
import html
import io
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labkit.profiling.nsight_runs import CsvFormatError, ToolRun
from labkit.tables import html_table
from labkit.validate import whole

_THOUSANDS = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")  # "1,234,567.8": nsys and ncu print these


def csv_float(text: str) -> float:
    """A number as the Nsight tools print it in CSV, thousands separators allowed
    (``"1,234.5"``); ValueError when ``text`` is not one."""
    t = text.strip()
    if _THOUSANDS.fullmatch(t):
        t = t.replace(",", "")
    return float(t)


# ----------------------------------------------------------------------------------------------
# Reading nsys stats CSV

_UNIT_NS = {"ns": 1.0, "us": 1e3, "μs": 1e3, "µs": 1e3, "ms": 1e6, "s": 1e9}
_UNIT_BYTES = {"b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9}  # nsys's MB: 10^6 bytes


def _key(header: str) -> str:
    return re.sub(r"\s+", "", header.strip().lower())


def _number(text: str, what: str) -> float:
    try:
        return csv_float(text)
    except ValueError:
        raise CsvFormatError(f"{what}: {text!r} is not a number") from None


@dataclass(frozen=True)
class _Col:
    """A column the reader looks for: the header's spelling (after lower-casing and removing
    spaces) and, for times and sizes, the unit in brackets."""

    field: str
    pattern: str  # regex over the normalised header; group "u" is the unit if any
    required: bool = True
    shown: str = ""  # how the documentation spells it, for error messages


def _locate(text: str, cols: Sequence[_Col]) -> tuple[list[list[str]], dict]:
    """The data rows after the header, and field -> (column index, unit).

    Tolerates a preamble (nsys prints "Generating SQLite file ..." and "Processing [...]"
    lines before the CSV), columns in any order and extra columns."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    for i, line in enumerate(lines):
        try:
            cells = next(csv.reader([line]))
        except (csv.Error, StopIteration):
            continue
        found: dict[str, tuple[int, str | None]] = {}
        for j, cell in enumerate(cells):
            k = _key(cell)
            for c in cols:
                m = re.fullmatch(c.pattern, k)
                if m and c.field not in found:
                    found[c.field] = (j, m.groupdict().get("u"))
        if all(c.field in found for c in cols if c.required):
            rows = list(csv.reader(io.StringIO("\n".join(lines[i + 1 :]))))
            return [r for r in rows if any(x.strip() for x in r)], found
    return [], {}


def _empty_table(text: str, cols: Sequence[_Col], what: str) -> SummaryTable:
    """The table of a report that holds no rows (nsys says SKIPPED / 'does not contain'), with
    nsys's line as its note; text that is not the report's CSV at all raises."""
    for line in text.splitlines():
        if re.search(r"SKIPPED|does not contain", line):
            return SummaryTable(what, (), note=line.strip())
    need = ", ".join(repr(c.shown) for c in cols if c.required)
    head = text.strip().splitlines()[:3]
    raise CsvFormatError(
        f"this is not the CSV of nsys's {what}: no header line with the columns {need} (in any "
        f"order). It begins: {head!r}. Produce it with `nsys stats --report=... --format=csv "
        "--output=- REPORT` (nsight.nsys_stats_command)."
    )


@dataclass(frozen=True)
class TimeSummaryRow:
    """One row of a time summary: a kernel (``cuda_gpu_kern_sum``), an NVTX range
    (``nvtx_sum``) or a memory operation (``cuda_gpu_mem_time_sum``). Times in nanoseconds,
    measured by Nsight Systems on the GPU (kernels, copies) or the CPU thread (NVTX ranges)."""

    name: str  # kernel name; NVTX "domain:range" (":range" in the default domain); operation
    total_ns: float
    count: int  # "Instances" (kernels, ranges) or "Count" (memory operations)
    time_pct: float | None = None  # share of the summed "Total Time" of the table, not of wall
    avg_ns: float | None = None
    med_ns: float | None = None
    min_ns: float | None = None
    max_ns: float | None = None
    stddev_ns: float | None = None
    style: str | None = None  # NVTX only: "PushPop" or "StartEnd"

    @property
    def range_name(self) -> str:
        """The NVTX range's name without the empty default domain (":forward" -> "forward")."""
        return self.name[1:] if self.name.startswith(":") else self.name


@dataclass(frozen=True)
class SizeSummaryRow:
    """One row of ``cuda_gpu_mem_size_sum``: bytes moved by one kind of memory operation.
    nsys prints megabytes of 10^6 bytes."""

    name: str  # the operation, e.g. "[CUDA memcpy Host-to-Device]"
    total_bytes: float
    count: int
    avg_bytes: float | None = None
    med_bytes: float | None = None
    min_bytes: float | None = None
    max_bytes: float | None = None
    stddev_bytes: float | None = None


def _time_cols(name_header: str, count_header: str, style: bool = False) -> list[_Col]:
    t = r"\((?P<u>ns|us|μs|µs|ms|s)\)"
    cols = [
        _Col("name", re.escape(_key(name_header)), shown=name_header),
        _Col("total", r"totaltime" + t, shown="Total Time (ns)"),
        _Col("count", re.escape(_key(count_header)), shown=count_header),
        _Col("pct", r"time\(%\)", False, "Time (%)"),
        _Col("avg", r"(avg|average)" + t, False, "Avg (ns)"),
        _Col("med", r"(med|median)" + t, False, "Med (ns)"),
        _Col("min", r"(min|minimum)" + t, False, "Min (ns)"),
        _Col("max", r"(max|maximum)" + t, False, "Max (ns)"),
        _Col("std", r"(stddev|std)" + t, False, "StdDev (ns)"),
    ]
    if style:
        cols.append(_Col("style", "style", False, "Style"))
    return cols


def _read_time_summary(text: str, cols: Sequence[_Col], what: str) -> SummaryTable:
    rows, where = _locate(text, cols)
    if not where:
        return _empty_table(text, cols, what)
    out = []
    for n, r in enumerate(rows, start=1):

        def get(f: str, r: list[str] = r, n: int = n) -> str | None:
            if f not in where:
                return None
            j = where[f][0]
            if j >= len(r):
                raise CsvFormatError(f"{what}, data row {n}: {len(r)} cells, but the header "
                                     f"puts a column at position {j + 1}: {r!r}")  # fmt: skip
            return r[j]

        def ns(f: str, get: Callable[[str], str | None] = get, n: int = n) -> float | None:
            v = get(f)
            if v is None or not v.strip():
                return None
            return _number(v, f"{what}, row {n}, {f}") * _UNIT_NS[where[f][1]]

        pct = get("pct")
        out.append(TimeSummaryRow(
            name=get("name") or "", total_ns=ns("total") or 0.0,
            count=int(_number(get("count") or "", f"{what}, row {n}, count")),
            time_pct=_number(pct, f"{what}, row {n}, Time (%)") if pct and pct.strip() else None,
            avg_ns=ns("avg"), med_ns=ns("med"), min_ns=ns("min"), max_ns=ns("max"),
            stddev_ns=ns("std"), style=get("style"),
        ))  # fmt: skip
    return SummaryTable(what, tuple(out))


def parse_kernel_summary(text: str) -> SummaryTable:
    """Rows of ``nsys stats --report cuda_gpu_kern_sum --format csv``: per kernel, its total
    GPU time, launches, and the mean/median/min/max/stddev of one launch (Analysis Guide:
    columns Time (%), Total Time, Instances, Avg, Med, Min, Max, StdDev, Name; times in ns)."""
    return _read_time_summary(text, _time_cols("Name", "Instances"), "CUDA GPU kernel summary")


def parse_nvtx_summary(text: str) -> SummaryTable:
    """Rows of ``nsys stats --report nvtx_sum --format csv``: per NVTX range, the CPU time
    between its push and pop (columns as the kernel summary's, then Style and Range). A range
    times the thread that opened it: kernels launched inside may run later on the GPU."""
    return _read_time_summary(text, _time_cols("Range", "Instances", style=True),
                              "NVTX range summary")  # fmt: skip


def parse_memop_time_summary(text: str) -> SummaryTable:
    """Rows of ``nsys stats --report cuda_gpu_mem_time_sum --format csv``: GPU time per kind
    of memory operation (host-to-device copy, memset, ...); columns Count and Operation."""
    return _read_time_summary(text, _time_cols("Operation", "Count"),
                              "CUDA GPU memory operations by time")  # fmt: skip


def parse_memop_size_summary(text: str) -> SummaryTable:
    """Rows of ``nsys stats --report cuda_gpu_mem_size_sum --format csv``: bytes per kind of
    memory operation (columns Total (MB), Count, Avg, Med, Min, Max, StdDev (MB), Operation)."""
    what = "CUDA GPU memory operations by size"
    s = r"\((?P<u>b|kb|mb|gb)\)"
    cols = [
        _Col("name", "operation", shown="Operation"),
        _Col("total", "total" + s, shown="Total (MB)"),
        _Col("count", "count", shown="Count"),
        *(_Col(f, p + s, False, f"{p.title()} (MB)") for f, p in
          (("avg", "avg"), ("med", "med"), ("min", "min"), ("max", "max"), ("std", "stddev"))),
    ]  # fmt: skip
    rows, where = _locate(text, cols)
    if not where:
        return _empty_table(text, cols, what)

    def b(r: list[str], f: str, n: int) -> float | None:
        if f not in where or where[f][0] >= len(r) or not r[where[f][0]].strip():
            return None
        return _number(r[where[f][0]], f"{what}, row {n}, {f}") * _UNIT_BYTES[where[f][1]]

    out = []
    for n, r in enumerate(rows, start=1):
        if len(r) <= max(where[f][0] for f in ("name", "total", "count")):
            raise CsvFormatError(f"{what}, data row {n} is short: {r!r}")
        out.append(SizeSummaryRow(
            name=r[where["name"][0]], total_bytes=b(r, "total", n) or 0.0,
            count=int(_number(r[where["count"][0]], f"{what}, row {n}, Count")),
            avg_bytes=b(r, "avg", n), med_bytes=b(r, "med", n), min_bytes=b(r, "min", n),
            max_bytes=b(r, "max", n), stddev_bytes=b(r, "std", n),
        ))  # fmt: skip
    return SummaryTable(what, tuple(out))


# ----------------------------------------------------------------------------------------------
# Tables


def short_kernel_name(name: str, width: int = 60) -> str:
    """A kernel's name short enough for a table or a bar label: without the ``void`` return
    type, the argument list, and template arguments (``<...>`` becomes ``<…>``)."""
    s = re.sub(r"^void\s+", "", name.strip())
    depth, out = 0, []
    for ch in s:  # drop template arguments, keeping one "<…>" per outermost template
        if ch == "<":
            if depth == 0:
                out.append("<…>")
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif depth == 0:
            out.append(ch)
    s = "".join(out).strip()
    if s.endswith(")"):  # drop the argument list: the bracket that the final ")" closes
        depth = 0
        for i in range(len(s) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(s[i], 0)
            if depth == 0:
                s = s[:i].rstrip() or s  # "(anonymous namespace)::f(int)" keeps its namespace
                break
    return s if len(s) <= width else s[: width - 1] + "…"


def _ms(ns: float | None) -> str:
    return "" if ns is None else f"{ns / 1e6:.3f}"


def _us(ns: float | None) -> str:
    return "" if ns is None else f"{ns / 1e3:.1f}"


@dataclass(frozen=True)
class SummaryTable:
    """The rows of one nsys statistics report, largest first as nsys sorts them; prints as
    text and renders as an HTML table in a notebook. ``note`` says why it is empty."""

    title: str
    rows: tuple[TimeSummaryRow, ...] | tuple[SizeSummaryRow, ...]
    note: str | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.rows)

    def __getitem__(self, i: int) -> Any:
        return self.rows[i]

    def top(self, k: int = 10) -> tuple[Any, ...]:
        key = (lambda r: r.total_bytes) if self._sizes else (lambda r: r.total_ns)
        return tuple(sorted(self.rows, key=key, reverse=True)[:k])

    def get(self, name: str) -> Any:
        """The row called ``name`` (an NVTX range matches with or without its ":" prefix)."""
        for r in self.rows:
            if name in (r.name, getattr(r, "range_name", None)):
                return r
        names = [r.name for r in self.rows]
        raise KeyError(f"{name!r} is not in the {self.title}; it has {names}")

    @property
    def _sizes(self) -> bool:
        return bool(self.rows) and isinstance(self.rows[0], SizeSummaryRow)

    def _cells(self, limit: int | None = 15) -> tuple[list[str], list[list[str]]]:
        rows = list(self.rows[:limit] if limit else self.rows)
        if self._sizes:
            head = ["operation", "total MB", "count", "avg MB"]
            body = [[r.name, f"{r.total_bytes / 1e6:.3f}", str(r.count),
                     "" if r.avg_bytes is None else f"{r.avg_bytes / 1e6:.3f}"] for r in rows]  # fmt: skip
            return head, body
        head = ["name", "total ms", "count", "avg µs", "med µs", "share %"]
        body = [[short_kernel_name(r.name), _ms(r.total_ns), str(r.count), _us(r.avg_ns),
                 _us(r.med_ns), "" if r.time_pct is None else f"{r.time_pct:.1f}"]
                for r in rows]  # fmt: skip
        return head, body

    def __str__(self) -> str:
        if not self.rows:
            return f"{self.title}: no rows" + (f" ({self.note})" if self.note else "")
        head, body = self._cells()
        table = [head, *body]
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                 for row in table]  # fmt: skip
        more = len(self.rows) - len(body)
        return "\n".join([f"{self.title} (Nsight Systems):", *lines]
                         + ([f"... and {more} more rows"] if more > 0 else []))  # fmt: skip

    __repr__ = __str__

    def _repr_html_(self) -> str:
        if not self.rows:
            return f"<p>{html.escape(str(self))}</p>"
        return (f"<p><b>{html.escape(self.title)}</b> (Nsight Systems)</p>"
                + html_table(*self._cells()))  # fmt: skip


@dataclass(frozen=True)
class NsysSummaries:
    """The four tables of one report (one rank)."""

    report: Path
    kernels: SummaryTable
    nvtx: SummaryTable
    memops_time: SummaryTable
    memops_size: SummaryTable

    def __str__(self) -> str:
        return "\n\n".join([f"report {self.report}:", str(self.kernels), str(self.nvtx),
                            str(self.memops_time), str(self.memops_size)])  # fmt: skip

    __repr__ = __str__



@dataclass(frozen=True)
class NsysResult:
    """A finished ``nsys profile`` run and the tables of each rank's report."""

    run: ToolRun
    ranks: tuple[NsysSummaries, ...]

    ran = True

    def __str__(self) -> str:
        parts = [str(self.run)]
        for r, s in enumerate(self.ranks):
            parts.append(f"--- rank {r} ---\n{s}" if len(self.ranks) > 1 else str(s))
        return "\n\n".join(parts)

    __repr__ = __str__



# ----------------------------------------------------------------------------------------------
# The kernel-summary figure


def plot_kernel_summary(kernels: SummaryTable | Sequence[TimeSummaryRow], *, top: int = 10,
                        ax: Any = None, title: str | None = None) -> Any:  # fmt: skip
    """Horizontal bars: the ``top`` kernels by total GPU time in the capture, each labelled
    with its time, launch count and share. Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt  # lazy: importing labkit must stay cheap

    rows = list(kernels.rows if isinstance(kernels, SummaryTable) else kernels)
    if not all(isinstance(r, TimeSummaryRow) for r in rows):
        raise ValueError("kernels must be a kernel summary (parse_kernel_summary or "
                         "read_nsys_report(...).kernels)")  # fmt: skip
    if not rows:
        raise ValueError("the kernel summary is empty: the capture recorded no kernel. Check "
                         "that the capture range covers training steps (torch.cuda.profiler."
                         "start() after warm-up, stop() after the steps)")  # fmt: skip
    whole("top", top, low=1)
    rows.sort(key=lambda r: r.total_ns, reverse=True)
    shown, rest = rows[:top], rows[top:]
    total = sum(r.total_ns for r in rows)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.45 * len(shown) + 1.5))
    ms = [r.total_ns / 1e6 for r in shown]
    ax.barh(range(len(shown)), ms, color="tab:blue")
    ax.set_yticks(range(len(shown)), [short_kernel_name(r.name, 50) for r in shown], fontsize=8)
    ax.invert_yaxis()  # largest on top
    for i, r in enumerate(shown):
        share = 100 * r.total_ns / total if total else 0.0
        ax.annotate(f" {r.total_ns / 1e6:.2f} ms, {r.count}×, {share:.0f}%", (ms[i], i),
                    va="center", fontsize=8)  # fmt: skip
    ax.set_xlim(0, max(ms) * 1.35)
    ax.set_xlabel("total GPU time in the captured range (ms)")
    ax.set_title(title or f"Top {len(shown)} kernels by GPU time")
    caption = ("measured by Nsight Systems (cuda_gpu_kern_sum); % = share of the summed "
               "kernel time, not of wall time")  # fmt: skip
    if rest:
        caption += f"; {len(rest)} more kernels: {sum(r.total_ns for r in rest) / 1e6:.2f} ms"
    ax.text(0.0, -0.12 - 0.25 / max(len(shown), 1), caption, transform=ax.transAxes,
            fontsize=7, color="dimgrey", va="top")  # fmt: skip
    return ax

