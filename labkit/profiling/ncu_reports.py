"""Nsight Compute's results read back: ``ncu --csv --page details`` as kernel records, and a
profiled kernel placed on notebook 04's roofline.

Apart from :mod:`labkit.profiling.nsight` (which runs ``ncu``) because reading is pure: the
parser takes the CSV text, so it is tested on NVIDIA's documented layout on any machine.

- :func:`parse_ncu_csv`: one :class:`NcuKernel` per profiled launch, its metrics by name;
  :class:`NcuKernel` reads SpeedOfLight's duration and throughputs, and the DRAM bytes;
- :func:`place_on_roofline`: the kernel's measured time (and, where collected, its measured
  DRAM bytes) against modelled FLOPs, on the roofline's measured ceilings
  (:class:`NcuPlacement` says which number came from where).

Source for the sections and metrics: Nsight Compute Profiling Guide,
https://docs.nvidia.com/nsight-compute/ProfilingGuide/index.html ("Sections": SpeedOfLight;
"Throughputs"; "Metrics Structure").
"""

from __future__ import annotations

import contextlib
import csv
import io
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from labkit.profiling.nsight_commands import DRAM_BYTES_METRICS
from labkit.profiling.nsight_runs import CsvFormatError, ProfilerError, ToolRun
from labkit.profiling.nsys_reports import csv_float, short_kernel_name
from labkit.roofline import Point, Roofline

# SpeedOfLight's display names in the details page, newest first (older ncu versions used the
# bracketed ones), and the raw metric behind each (Profiling Guide, "Sections").
_SOL_NAMES: dict[str, tuple[str, ...]] = {
    "duration": ("Duration", "gpu__time_duration.sum"),
    "compute": ("Compute (SM) Throughput", "Compute (SM) [%]",
                "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    "memory": ("Memory Throughput", "Memory [%]",
               "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"),
    "dram": ("DRAM Throughput", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
}  # fmt: skip
_TIME_UNITS = {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3,
               "msecond": 1e-3, "s": 1.0, "second": 1.0}  # fmt: skip
_BYTE_UNITS = {"byte": 1.0, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12}
_NCU_COLUMNS = ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value")


@dataclass(frozen=True)
class NcuMetric:
    section: str  # e.g. "GPU Speed Of Light Throughput"
    name: str
    unit: str
    value: float | str | None  # a number where it is one; None for "n/a" or empty


@dataclass(frozen=True)
class NcuKernel:
    """One profiled kernel launch: every metric ncu printed for it, by name."""

    id: int
    name: str
    metrics: Mapping[str, NcuMetric]
    process_id: str | None = None
    device: str | None = None
    cc: str | None = None  # compute capability, "9.0"
    block_size: str | None = None
    grid_size: str | None = None

    def _metric(self, key: str) -> NcuMetric:
        for name in _SOL_NAMES[key]:
            m = self.metrics.get(name)
            if m is not None and isinstance(m.value, float):
                return m
        raise ProfilerError(f"kernel {self.name!r} (ID {self.id}) has no {_SOL_NAMES[key][0]!r} "
                            "metric: profile it with --section SpeedOfLight (NcuCommand's "
                            "default)")  # fmt: skip

    def _pct(self, key: str) -> float:
        m = self._metric(key)
        if m.unit != "%":
            raise ProfilerError(f"{m.name!r} of {self.name!r} is in {m.unit!r}, not %")
        return float(m.value)  # type: ignore[arg-type]

    @property
    def duration_s(self) -> float:
        """The kernel's duration (SpeedOfLight "Duration", gpu__time_duration.sum), measured by
        ncu under its clock control (base clocks by default)."""
        m = self._metric("duration")
        if m.unit not in _TIME_UNITS:
            raise ProfilerError(f"Duration of {self.name!r} is in {m.unit!r}: expected one of "
                                f"{sorted(_TIME_UNITS)} (pass --print-units base)")  # fmt: skip
        return float(m.value) * _TIME_UNITS[m.unit]  # type: ignore[arg-type]

    @property
    def compute_throughput_pct(self) -> float:
        """SpeedOfLight's "Compute (SM) Throughput": the busiest SM sub-unit's use, % of its peak on this GPU.
        A maximum over pipes and issue slots, not FLOP/s as a share of peak FLOP/s."""
        return self._pct("compute")

    @property
    def memory_throughput_pct(self) -> float:
        """SpeedOfLight's "Memory Throughput": the busiest memory unit's use (L1, L2 or DRAM), % of its peak."""
        return self._pct("memory")

    @property
    def dram_throughput_pct(self) -> float:
        """SpeedOfLight's "DRAM Throughput": DRAM traffic as % of this GPU's peak DRAM bandwidth per ncu."""
        return self._pct("dram")

    @property
    def dram_bytes(self) -> float | None:
        """Bytes read from plus written to DRAM (``dram__bytes_read.sum`` +
        ``dram__bytes_write.sum``), measured; None if they were not collected."""
        total = 0.0
        for name in DRAM_BYTES_METRICS:
            m = self.metrics.get(name)
            if m is None or not isinstance(m.value, float):
                return None
            factor = _BYTE_UNITS.get(m.unit.lower())
            if factor is None:
                raise ProfilerError(f"{name} of {self.name!r} is in {m.unit!r}, not bytes")
            total += m.value * factor
        return total

    def __str__(self) -> str:
        parts = [f"{short_kernel_name(self.name)} (ncu ID {self.id})"]
        with contextlib.suppress(ProfilerError):
            parts.append(f"{self.duration_s * 1e6:.1f} µs")
        with contextlib.suppress(ProfilerError):
            parts.append(f"SM {self.compute_throughput_pct:.1f}%")
        with contextlib.suppress(ProfilerError):
            parts.append(f"memory {self.memory_throughput_pct:.1f}%")
        with contextlib.suppress(ProfilerError):
            parts.append(f"DRAM {self.dram_throughput_pct:.1f}%")
        return ", ".join(parts)


@dataclass(frozen=True)
class NcuResult:
    """A finished ``ncu`` run and the kernel launches it profiled."""

    run: ToolRun
    kernels: tuple[NcuKernel, ...]

    ran = True

    def __str__(self) -> str:
        return "\n".join([str(self.run), *(f"  {k}" for k in self.kernels)])

    __repr__ = __str__


def _ncu_value(text: str | None) -> float | str | None:
    if text is None or not text.strip() or text.strip().lower() == "n/a":
        return None
    try:
        return csv_float(text)
    except ValueError:
        return text.strip()  # a text value ("PolicySpread", "all"), kept as text


def parse_ncu_csv(text: str) -> list[NcuKernel]:
    """Kernel launches from ``ncu --csv --page details`` output, one metric per line under the
    header "ID","Process ID","Process Name","Host Name","Kernel Name",...,"Section Name",
    "Metric Name","Metric Unit","Metric Value" (columns found by name; extra ones ignored).

    Lines ncu writes about itself (``==PROF==``, ``==WARNING==``) are skipped, as are rule
    rows (no metric name). An empty list when ncu said it profiled no kernel; text that is
    neither raises :class:`CsvFormatError` naming the columns it needs."""
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("==")]
    header_at = None
    for i, line in enumerate(lines):
        with contextlib.suppress(csv.Error, StopIteration):
            if set(_NCU_COLUMNS) <= set(next(csv.reader([line]))):
                header_at = i
                break
    if header_at is None:
        if re.search(r"No kernels were profiled", text):
            return []
        raise CsvFormatError(
            f"this is not ncu's CSV: no header with the columns {list(_NCU_COLUMNS)}. It begins: "
            f"{text.strip().splitlines()[:3]!r}. Produce it with `ncu --csv --page details ...` "
            "(NcuCommand)."
        )
    header = next(csv.reader([lines[header_at]]))
    col = {h: j for j, h in enumerate(header)}
    kernels: dict[tuple[str, str], dict[str, Any]] = {}
    for n, row in enumerate(csv.reader(io.StringIO("\n".join(lines[header_at + 1 :]))), 1):
        if row == header:
            continue  # ncu repeats the header per kernel in some versions

        def cell(name: str, row: list[str] = row) -> str | None:
            j = col.get(name)
            return row[j] if j is not None and j < len(row) else None

        if cell("Metric Value") is None and cell("Rule Name") is None:
            raise CsvFormatError(f"ncu CSV data row {n} is short ({len(row)} cells for "
                                 f"{len(header)} columns): {row!r}")  # fmt: skip
        kid = cell("ID")
        if kid is None or not re.fullmatch(r"\d+", kid.strip()):
            raise CsvFormatError(f"ncu CSV data row {n}: ID {kid!r} is not a launch number")
        key = (cell("Process ID") or "", kid.strip())
        k = kernels.setdefault(key, {
            "id": int(kid), "name": cell("Kernel Name") or "", "metrics": {},
            "process_id": cell("Process ID"), "device": cell("Device"), "cc": cell("CC"),
            "block_size": cell("Block Size"), "grid_size": cell("Grid Size"),
        })  # fmt: skip
        metric = (cell("Metric Name") or "").strip()
        if not metric:
            continue  # a rule's advice row
        k["metrics"][metric] = NcuMetric(section=cell("Section Name") or "", name=metric,
                                         unit=(cell("Metric Unit") or "").strip(),
                                         value=_ncu_value(cell("Metric Value")))  # fmt: skip
    return [NcuKernel(**k) for k in kernels.values()]


# ----------------------------------------------------------------------------------------------
# A profiled kernel on the roofline


@dataclass(frozen=True)
class NcuPlacement:
    """A kernel profiled by ncu, placed on a measured roofline, with what is measured and what
    modelled said out loud. ``point`` draws with ``labkit.roofline.plot_roofline``."""

    point: Point
    kernel: NcuKernel
    bytes_source: str  # "measured" (ncu's DRAM byte counters) or "modelled"

    @property
    def achieved_bytes_per_s(self) -> float:
        return self.point.bytes / self.point.seconds

    def __str__(self) -> str:
        k = self.kernel
        sol = []
        for label, attr in (("compute (SM)", "compute_throughput_pct"),
                            ("memory", "memory_throughput_pct"), ("DRAM", "dram_throughput_pct")):  # fmt: skip
            with contextlib.suppress(ProfilerError):
                sol.append(f"{label} {getattr(k, attr):.1f}%")
        return "\n".join([
            str(self.point),
            f"  measured by ncu: duration {k.duration_s * 1e6:.2f} µs (ncu's clock control, "
            f"base clocks by default); {', '.join(sol) or 'no SpeedOfLight percentages'} — "
            "each % of ncu's own peak for that unit of this GPU, not of the roofline's "
            "measured ceilings",
            f"  bytes: {self.point.bytes:.4g} ({'measured by ncu: DRAM bytes read + written' if self.bytes_source == 'measured' else 'modelled from shapes'}); "
            f"FLOPs: {self.point.flops:.4g} (modelled from shapes)",
        ])  # fmt: skip

    __repr__ = __str__


def place_on_roofline(roofline: Roofline, kernel: NcuKernel, *, flops: float,
                      bytes_moved: float | None = None, precision: str | None = None,
                      name: str | None = None) -> NcuPlacement:  # fmt: skip
    """Put an ncu-profiled kernel on notebook 04's roofline (``roofline.place``).

    What comes from where:

    - **time: measured by ncu** (SpeedOfLight "Duration"), under ncu's clock control;
    - **FLOPs: modelled** (``flops``: counted from the kernel's shapes, e.g. with
      ``labkit.roofline.matmul_traffic``). ncu's "Compute (SM) Throughput" is not used for the
      FLOP rate: it is the maximum over SM pipes and issue slots of their use as a share of
      each one's peak (Profiling Guide, "Throughputs"), not FLOP/s over peak FLOP/s;
    - **bytes: measured by ncu** (DRAM bytes read + written) when ``bytes_moved`` is None and
      those metrics were collected (NcuCommand's default); else ``bytes_moved``, modelled;
    - **ceilings: measured by labkit** (the roofline). ncu's percentages are of *ncu's* peaks
      for this GPU; the placement prints them beside the point and never mixes them with the
      roofline's measured ceilings.

    ``name`` labels the point (default: the kernel's short name)."""
    if not isinstance(kernel, NcuKernel):
        raise ValueError(f"kernel must be an NcuKernel (parse_ncu_csv / run_ncu), got "
                         f"{type(kernel).__name__}")  # fmt: skip
    if bytes_moved is None:
        measured = kernel.dram_bytes
        if measured is None:
            raise ProfilerError(
                f"kernel {kernel.name!r} has no DRAM byte counts: profile with "
                f"metrics={DRAM_BYTES_METRICS} (NcuCommand's default), or pass bytes_moved= "
                "(modelled, e.g. from matmul_traffic)")  # fmt: skip
        if measured <= 0:
            raise ProfilerError(f"ncu measured {measured:g} DRAM bytes for {kernel.name!r}: the "
                                "data stayed in cache; pass bytes_moved= (modelled) to place it")  # fmt: skip
        bytes_moved, source = measured, "measured"
    else:
        source = "modelled"
    point = roofline.place(name or short_kernel_name(kernel.name, 40), flops, bytes_moved,
                           kernel.duration_s, precision=precision)  # fmt: skip
    return NcuPlacement(point=point, kernel=kernel, bytes_source=source)

