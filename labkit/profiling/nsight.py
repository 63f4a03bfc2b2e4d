"""Nsight Systems and Nsight Compute from a notebook: the exact command, run when the tool is
here, read back into tables, a figure and a roofline point.

    from labkit.profiling import nsight
    cmd = nsight.NsysCommand(target=[sys.executable, "-m", "mytrain"], output="runs/step")
    print(cmd.shell())                     # the exact `nsys profile ...` line
    res = nsight.profile_nsys(cmd, timeout_s=600)
    print(res)                             # tables per rank, or why nothing ran
    nsight.plot_kernel_summary(res.ranks[0].kernels)

Nsight Systems (``nsys``) records a timeline: CUDA kernels and copies, NVTX ranges, OS calls.
The usual recipe for a training job (NERSC SC23 tutorial; Nsight Systems User Guide) records
only the steady state: the program calls ``torch.cuda.profiler.start()`` after warm-up and
``stop()`` a few steps later (:func:`cuda_profiler_capture`), and ``nsys profile
--capture-range=cudaProfilerApi --capture-range-end=stop`` records just that range; or it opens
an NVTX range and ``--capture-range=nvtx --nvtx-capture=NAME`` records the range. Then ``nsys
stats --report R --format csv`` turns the report into tables: the kernel summary
(``cuda_gpu_kern_sum``), the NVTX summary (``nvtx_sum``) and the memory-copy summaries
(``cuda_gpu_mem_time_sum``, ``cuda_gpu_mem_size_sum``).

A multi-rank job gets one report per rank: torchrun starts ``nsys`` once per rank
(``--no-python``), and nsys names each report after the rank's ``RANK`` variable with its
``%q{RANK}`` substitution (:class:`NsysTorchrunCommand`).

Nsight Compute (``ncu``) replays one kernel many times to read its hardware counters.
:class:`NcuCommand` profiles one kernel of the step (a name filter, launches to skip, how
many to profile) with the ``SpeedOfLight`` section, writing CSV; :func:`parse_ncu_csv` reads
it, and :func:`place_on_roofline` puts the kernel on notebook 04's roofline.

Rules every function here keeps:

- a missing tool is not an error: :func:`run_nsys`/:func:`run_ncu` return :class:`NotRun`,
  which prints the command and says why nothing ran (no ``nsys``, no ``ncu``, or no GPU);
- a failing tool raises :class:`ToolFailed`, naming the exit code and its last stderr lines;
- a report that is missing, partial, or holds nothing raises: a table shown is complete;
- a timeout ends the whole process tree (:func:`labkit.jobs.procs.end_tree`), and the tool is
  started through ``labkit.jobs.spawn``, so even a killed notebook kernel takes it down.

Sources, for the flags and formats used below:

- Nsight Systems User Guide, https://docs.nvidia.com/nsight-systems/UserGuide/index.html
  ("CLI Profile Command Switch Options", "CLI Stats Command Switch Options"); long options
  take ``=``: ``--sample=none`` ("Command Line Options");
- Nsight Systems Post-Collection Analysis Guide,
  https://docs.nvidia.com/nsight-systems/AnalysisGuide/index.html ("Statistical Reports
  Shipped With Nsight Systems": report names and their output columns);
- Nsight Compute CLI, https://docs.nvidia.com/nsight-compute/NsightComputeCli/index.html,
  and its filter examples (``--kernel-name regex:Bar``, ``--launch-skip 1 --launch-count 1``)
  in https://docs.nvidia.com/nsight-compute/Training/index.html;
- Nsight Compute Profiling Guide, https://docs.nvidia.com/nsight-compute/ProfilingGuide/
  index.html ("Sections": SpeedOfLight; "Throughputs"; "Clock Control").

Importing this module starts nothing and touches no GPU; matplotlib is imported only to draw.
"""

from __future__ import annotations

import contextlib
import csv
import html
import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from labkit import config
from labkit.errors import LabkitError
from labkit.jobs import procs
from labkit.roofline import Point, Roofline
from labkit.validate import flag, one_of, positive, whole

NSYS = "nsys"
NCU = "ncu"
NSYS_INSTALL = "https://developer.nvidia.com/nsight-systems"
NCU_INSTALL = "https://developer.nvidia.com/nsight-compute"

# What the course traces: CUDA API and GPU work, NVTX ranges, OS runtime calls (the data
# loader's waits show there), cuDNN and cuBLAS calls (Nsight Systems User Guide, --trace).
DEFAULT_TRACE: tuple[str, ...] = ("cuda", "nvtx", "osrt", "cudnn", "cublas")
CAPTURE_MODES = ("cudaProfilerApi", "nvtx")
# "stop": collection stops, the program runs on to its end and exits normally (its results
# get written); "stop-shutdown" (nsys's default) ends the program when the range ends.
# "repeat[:N]" is left out on purpose: it writes several reports per process, and labkit
# expects exactly one per rank.
CAPTURE_ENDS = ("stop", "stop-shutdown")
SAMPLE_MODES = ("none", "process-tree", "system-wide")
# torch.cuda.nvtx pushes plain (unregistered) strings, and nsys by default matches
# --nvtx-capture only against NVTX *registered* strings; this variable makes it compare every
# range name (Nsight Systems User Guide, --nvtx-capture).
NVTX_UNREGISTERED = "NSYS_NVTX_PROFILER_REGISTER_ONLY=0"

# The reports read here, by their names since Nsight Systems 2023 (2022.4 and earlier called
# them gpukernsum, nvtxsum, gpumemtimesum, gpumemsizesum; pass report_name= to use those).
KERNEL_REPORT = "cuda_gpu_kern_sum"
NVTX_REPORT = "nvtx_sum"
MEM_TIME_REPORT = "cuda_gpu_mem_time_sum"
MEM_SIZE_REPORT = "cuda_gpu_mem_size_sum"

# DRAM traffic measured by ncu, so that a kernel's bytes on the roofline can be measured rather
# than modelled (Nsight Compute Profiling Guide, "Metrics Structure": dram__bytes_read.sum).
DRAM_BYTES_METRICS: tuple[str, ...] = ("dram__bytes_read.sum", "dram__bytes_write.sum")

TAIL_LINES = 15  # lines of a failing tool's stderr quoted in the error


# ----------------------------------------------------------------------------------------------
# Results and errors


class ProfilerError(RuntimeError, LabkitError):
    """A profiler ran but gave nothing usable; the message says what and what to do."""


class ToolFailed(ProfilerError):
    """The tool exited non-zero (or was killed): exit code and its last stderr lines."""

    def __init__(self, message: str, *, returncode: int, stderr_tail: str) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.stderr_tail = stderr_tail


class ToolTimeout(ProfilerError):
    """The tool ran past its time limit; its whole process tree was ended."""


class ReportMissing(ProfilerError):
    """The tool exited 0 but a report it should have written is not there (or is empty)."""


class NothingProfiled(ProfilerError):
    """ncu ran, but profiled fewer kernel launches than asked (none matched, or too few)."""

    def __init__(self, message: str, kernels: Sequence[NcuKernel] = ()) -> None:
        super().__init__(message)
        self.kernels = tuple(kernels)  # what it did profile: for a deliberate look only


class CsvFormatError(ProfilerError, ValueError):
    """Text that is not the CSV the reader expects; names the columns it looked for."""


@dataclass(frozen=True)
class NotRun:
    """Nothing ran, and why; prints the command that would have run.

    Returned (not raised) by the runners, so a notebook cell on a machine without the tool
    shows the command to copy and the reason, and goes on."""

    tool: str
    command: str
    reason: str

    ran = False

    def __str__(self) -> str:
        return f"not run: {self.reason}; the command would be:\n  {self.command}"

    __repr__ = __str__


@dataclass(frozen=True)
class ToolRun:
    """A profiler run that finished with exit code 0 and wrote every report it should."""

    tool: str
    command: str
    seconds: float  # wall time of the whole profiled run, tool overhead included
    reports: tuple[Path, ...]  # nsys: one .nsys-rep per rank; ncu: the CSV log file
    stdout_log: Path
    stderr_log: Path

    ran = True

    def __str__(self) -> str:
        files = "\n".join(f"  {p}" for p in self.reports)
        return (f"{self.tool} ran in {self.seconds:.1f} s: {self.command}\nreports:\n{files}\n"
                f"logs: {self.stdout_log}, {self.stderr_log}")  # fmt: skip

    __repr__ = __str__


# ----------------------------------------------------------------------------------------------
# Validation helpers


def _argv(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise ValueError(f"{name}={value!r} is not allowed: the program's argv as a non-empty "
                         f"list of strings, e.g. [sys.executable, '-m', 'mytrain']")  # fmt: skip
    if not all(isinstance(a, str) and a for a in value):
        raise ValueError(f"{name}={value!r}: every argument must be a non-empty string")
    return tuple(value)


def _strings(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(f"{name}={value!r} is not allowed: a list of strings")
    if not all(isinstance(a, str) and a for a in value):
        raise ValueError(f"{name}={value!r}: every item must be a non-empty string")
    return tuple(value)


def _report_stem(name: str, value: Any, suffix: str) -> Path:
    """The output path without the tool's extension (nsys and ncu add it themselves)."""
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise ValueError(f"{name}={value!r} is not allowed: a path for the report, such as "
                         f"'runs/profile/step'")  # fmt: skip
    text = os.fspath(value)
    if "%" in text:
        raise ValueError(f"{name}={text!r}: '%' is nsys's substitution character; labkit adds "
                         "%q{RANK} itself for multi-rank jobs. Use a plain path.")  # fmt: skip
    path = Path(text)
    return path.with_name(path.name[: -len(suffix)]) if path.name.endswith(suffix) else path


def _rank_report(stem: Path, rank: int) -> Path:
    return stem.with_name(f"{stem.name}_rank{rank}.nsys-rep")


# ----------------------------------------------------------------------------------------------
# Nsight Systems: the command


@dataclass(frozen=True, kw_only=True)
class _NsysOptions:
    """The ``nsys profile`` options shared by one-process and multi-rank commands."""

    output: str | os.PathLike  # report path; ".nsys-rep" is added (by nsys) if not given
    trace: Sequence[str] = DEFAULT_TRACE  # --trace: APIs to trace
    capture: str | None = "cudaProfilerApi"  # --capture-range: "cudaProfilerApi", "nvtx", None
    nvtx_capture: str | None = None  # --nvtx-capture: the NVTX range name (capture="nvtx")
    capture_end: str = "stop"  # --capture-range-end: "stop" or "stop-shutdown"
    sample: str = "none"  # --sample: CPU IP sampling ("none" keeps reports small)
    cpuctxsw: str = "none"  # --cpuctxsw: CPU context-switch tracing
    stats: bool = False  # --stats: also print nsys's own summary tables at the end
    force_overwrite: bool = True  # --force-overwrite: replace a report from an earlier run
    extra: Sequence[str] = ()  # further `nsys profile` options, passed as given

    def __post_init__(self) -> None:
        stem = _report_stem("output", self.output, ".nsys-rep")
        trace = _strings("trace", self.trace)
        bad = [t for t in trace if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", t)]
        if not trace or bad or len(set(trace)) != len(trace):
            raise ValueError(f"trace={self.trace!r} is not allowed: distinct API names such as "
                             f"{DEFAULT_TRACE} (nsys profile --help lists them)")  # fmt: skip
        if self.capture is not None and self.capture not in CAPTURE_MODES:
            raise ValueError(f"capture={self.capture!r} is not allowed: 'cudaProfilerApi' "
                             "(the program calls torch.cuda.profiler.start/stop), 'nvtx' (an "
                             "NVTX range, named by nvtx_capture), or None (the whole run)")  # fmt: skip
        if self.capture == "nvtx":
            if not isinstance(self.nvtx_capture, str) or not self.nvtx_capture.strip():
                raise ValueError("capture='nvtx' needs nvtx_capture: the name of the NVTX range "
                                 "to record, e.g. nvtx_capture='profiled_steps'")  # fmt: skip
            if "nvtx" not in trace:
                raise ValueError("capture='nvtx' needs 'nvtx' in trace: nsys sees the range "
                                 "only while tracing NVTX")  # fmt: skip
        elif self.nvtx_capture is not None:
            raise ValueError(f"nvtx_capture={self.nvtx_capture!r} is only used with "
                             f"capture='nvtx' (capture={self.capture!r})")  # fmt: skip
        if self.capture == "cudaProfilerApi" and "cuda" not in trace:
            raise ValueError("capture='cudaProfilerApi' needs 'cuda' in trace: the range starts "
                             "at a CUDA call, and the kernel summary needs CUDA tracing")  # fmt: skip
        if self.capture_end not in CAPTURE_ENDS:
            raise ValueError(f"capture_end={self.capture_end!r} is not allowed: one of "
                             f"{CAPTURE_ENDS} (repeat modes write several reports per "
                             "process; labkit reads one per rank)")  # fmt: skip
        for name in ("sample", "cpuctxsw"):
            one_of(name, getattr(self, name), SAMPLE_MODES)
        for name in ("stats", "force_overwrite"):
            flag(name, getattr(self, name))
        object.__setattr__(self, "output", stem)
        object.__setattr__(self, "trace", trace)
        object.__setattr__(self, "extra", _strings("extra", self.extra))

    def profile_options(self, output: str) -> list[str]:
        """``nsys profile`` and its options, writing the report to ``output``."""
        opts = [NSYS, "profile", f"--trace={','.join(self.trace)}", f"--sample={self.sample}",
                f"--cpuctxsw={self.cpuctxsw}"]  # fmt: skip
        if self.capture is not None:
            opts += [f"--capture-range={self.capture}", f"--capture-range-end={self.capture_end}"]
        if self.capture == "nvtx":
            opts += [f"--nvtx-capture={self.nvtx_capture}", f"--env-var={NVTX_UNREGISTERED}"]
        opts += [f"--stats={str(self.stats).lower()}",
                 f"--force-overwrite={str(self.force_overwrite).lower()}",
                 *self.extra, f"--output={output}"]  # fmt: skip
        return opts

    tool = NSYS

    def argv(self) -> list[str]:  # pragma: no cover - overridden
        raise NotImplementedError

    @property
    def reports(self) -> tuple[Path, ...]:  # pragma: no cover - overridden
        raise NotImplementedError

    def shell(self) -> str:
        """The command as one line a learner can paste into a terminal."""
        return shlex.join(self.argv())

    def __str__(self) -> str:
        return self.shell()


@dataclass(frozen=True, kw_only=True)
class NsysCommand(_NsysOptions):
    """``nsys profile ... <target>``: one process, one report at ``output``.nsys-rep.

    ``target`` is the program's argv, e.g. ``[sys.executable, "-m", "mytrain"]``. With the
    default ``capture="cudaProfilerApi"`` the program must call ``torch.cuda.profiler.start()``
    (and ``stop()``), e.g. through :func:`cuda_profiler_capture`, or nsys records nothing and
    writes no report."""

    target: Sequence[str]

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "target", _argv("target", self.target))

    def argv(self) -> list[str]:
        return [*self.profile_options(str(self.output)), *self.target]

    @property
    def reports(self) -> tuple[Path, ...]:
        return (self.output.with_name(self.output.name + ".nsys-rep"),)  # type: ignore[union-attr]


@dataclass(frozen=True, kw_only=True)
class NsysTorchrunCommand(_NsysOptions):
    """torchrun starting ``nsys profile ... python -m <module>`` once per rank: one report per
    rank, ``<output>_rank<R>.nsys-rep``.

    The pattern: ``torchrun --no-python ... nsys profile -o report_rank%q{RANK} python -m
    module``. ``--no-python`` makes torchrun run ``nsys`` itself instead of ``python <script>``
    (torch.distributed.run; it may not be combined with torchrun's ``-m``, so ``-m`` goes to
    the python that nsys starts), and nsys replaces ``%q{RANK}`` in the output name with the
    ``RANK`` variable torchrun sets for each worker (Nsight Systems User Guide, ``--output``).
    Profiling torchrun from outside (``nsys profile torchrun ...``) would instead put every rank
    in one report, and ``%q{RANK}`` would not expand there: torchrun sets ``RANK`` for its
    workers, not for the nsys that started it.

    The torchrun flags match ``labkit.jobs.launch``: a c10d rendezvous on port 0 (no fixed-port
    collisions), one node, no restarts; ``torchrun_args`` adds more."""

    module: str
    nproc: int
    module_args: Sequence[str] = ()
    python: str = field(default_factory=lambda: sys.executable)
    torchrun_args: Sequence[str] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.module, str) or not re.fullmatch(r"[A-Za-z_][\w.]*", self.module):
            raise ValueError(f"module={self.module!r} is not allowed: a dotted module name such "
                             "as 'labkit.workers.dp_train'")  # fmt: skip
        whole("nproc", self.nproc, low=1)
        if not isinstance(self.python, str) or not self.python:
            raise ValueError(f"python={self.python!r} is not allowed: the interpreter's path")
        object.__setattr__(self, "module_args", _strings("module_args", self.module_args))
        object.__setattr__(self, "torchrun_args", _strings("torchrun_args", self.torchrun_args))

    def argv(self) -> list[str]:
        torchrun = [
            self.python, "-m", "torch.distributed.run",
            "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--nnodes=1",
            f"--nproc-per-node={self.nproc}", "--max-restarts=0", *self.torchrun_args,
            "--no-python",
        ]  # fmt: skip
        output = f"{self.output}_rank%q{{RANK}}"
        return [*torchrun, *self.profile_options(output),
                self.python, "-u", "-m", self.module, *self.module_args]  # fmt: skip

    @property
    def reports(self) -> tuple[Path, ...]:
        return tuple(_rank_report(self.output, r) for r in range(self.nproc))  # type: ignore[arg-type]


def nsys_stats_command(report: str | os.PathLike, report_name: str) -> list[str]:
    """``nsys stats --report=R --format=csv --output=- <report>``: one statistics report, as
    CSV on stdout. ``--force-export=true`` rebuilds the SQLite file nsys derives from the
    report, so tables never come from a stale one (Nsight Systems User Guide, "CLI Stats
    Command Switch Options")."""
    if not isinstance(report_name, str) or not re.fullmatch(r"[a-z_][a-z0-9_:.-]*", report_name):
        raise ValueError(f"report_name={report_name!r} is not allowed: a report such as "
                         f"{KERNEL_REPORT!r} (nsys stats --help-reports lists them)")  # fmt: skip
    return [NSYS, "stats", f"--report={report_name}", "--format=csv", "--output=-",
            "--force-export=true", os.fspath(report)]  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Nsight Compute: the command


@dataclass(frozen=True, kw_only=True)
class NcuCommand:
    """``ncu`` profiling one kernel of the step: its SpeedOfLight section as CSV in ``log_file``.

    - ``kernel_name``: a regular expression (``--kernel-name regex:...``), or with
      ``regex=False`` the exact function name;
    - ``launch_skip``/``launch_count``: skip that many launches *of the matching kernels*
      (warm-up, autotuning), then profile that many (ncu's ``--launch-skip-before-match`` would
      count all kernels instead);
    - ``sections``: ``SpeedOfLight`` gives the kernel's duration and its compute (SM) and memory
      throughput as percentages of this GPU's peaks (Profiling Guide, "Sections");
    - ``metrics``: extra raw metrics; by default the DRAM bytes read and written, so the
      roofline's x-axis can use measured bytes;
    - ``--target-processes all`` follows child processes (a launcher's workers);
    - ``--csv --page details --print-units base --log-file F``: the results, one metric a
      line, in base units (ns, byte), in ``F`` rather than mixed into the program's output.

    ncu serialises kernels, replays each profiled one several times, and by default locks the
    GPU clocks to base (``--clock-control base``; Profiling Guide, "Clock Control"): durations
    are for base clocks and the program runs many times slower while profiled."""

    target: Sequence[str]
    kernel_name: str
    log_file: str | os.PathLike
    regex: bool = True
    launch_skip: int = 0
    launch_count: int = 1
    sections: Sequence[str] = ("SpeedOfLight",)
    metrics: Sequence[str] = DRAM_BYTES_METRICS
    target_processes: str = "all"
    extra: Sequence[str] = ()
    section_set: str | None = None
    """``--set NAME``: a predefined group of sections (``full`` collects every section,
    ``basic`` the default few; ``ncu --list-sets`` lists them), on top of ``sections``."""
    nvtx_include: Sequence[str] = ()
    """``--nvtx --nvtx-include F`` for each F: profile only kernels launched inside the NVTX
    ranges F names. A push/pop range (``torch.cuda.nvtx.range_push``, labkit's ``phase``) is
    written with a trailing slash, ``"forward/"``; a start/end range without one (Nsight
    Compute CLI, "NVTX Filtering", https://docs.nvidia.com/nsight-compute/NsightComputeCli/).
    ``--launch-skip``/``--launch-count`` then count only the kernels that pass both filters."""

    tool = NCU

    def __post_init__(self) -> None:
        object.__setattr__(self, "target", _argv("target", self.target))
        if not isinstance(self.kernel_name, str) or not self.kernel_name.strip():
            raise ValueError(f"kernel_name={self.kernel_name!r} is not allowed: the kernel's "
                             "name or a regular expression matching it (take it from the "
                             "nsys kernel summary)")  # fmt: skip
        if self.regex:
            try:
                re.compile(self.kernel_name)
            except re.error as e:
                raise ValueError(f"kernel_name={self.kernel_name!r} is not a valid regular "
                                 f"expression ({e}); pass regex=False for an exact name") from e  # fmt: skip
        whole("launch_skip", self.launch_skip, low=0)
        whole("launch_count", self.launch_count, low=1)
        sections = _strings("sections", self.sections)
        metrics = _strings("metrics", self.metrics)
        if not sections and not metrics:
            raise ValueError("sections and metrics are both empty: ncu would collect nothing; "
                             "keep sections=('SpeedOfLight',)")  # fmt: skip
        if self.target_processes not in ("all", "application-only"):
            raise ValueError(f"target_processes={self.target_processes!r} is not allowed: "
                             "'all' or 'application-only'")  # fmt: skip
        if not isinstance(self.log_file, (str, os.PathLike)) or not str(self.log_file).strip():
            raise ValueError(f"log_file={self.log_file!r} is not allowed: a path for the CSV, "
                             "such as 'runs/profile/kernel.csv'")  # fmt: skip
        object.__setattr__(self, "log_file", Path(self.log_file))
        object.__setattr__(self, "sections", sections)
        object.__setattr__(self, "metrics", metrics)
        object.__setattr__(self, "extra", _strings("extra", self.extra))
        object.__setattr__(self, "nvtx_include", _strings("nvtx_include", self.nvtx_include))
        if self.section_set is not None and (not isinstance(self.section_set, str)
                                             or not re.fullmatch(r"[\w-]+", self.section_set)):
            raise ValueError(f"section_set={self.section_set!r} is not allowed: a set's name "
                             "such as 'full' or 'basic' (ncu --list-sets), or None")  # fmt: skip

    def argv(self) -> list[str]:
        name = f"regex:{self.kernel_name}" if self.regex else self.kernel_name
        argv = [NCU, "--kernel-name", name, "--launch-skip", str(self.launch_skip),
                "--launch-count", str(self.launch_count)]  # fmt: skip
        if self.section_set is not None:
            argv += ["--set", self.section_set]
        for s in self.sections:
            argv += ["--section", s]
        if self.nvtx_include:
            argv.append("--nvtx")
            for f in self.nvtx_include:
                argv += ["--nvtx-include", f]
        if self.metrics:
            argv += ["--metrics", ",".join(self.metrics)]
        argv += ["--target-processes", self.target_processes, "--csv", "--page", "details",
                 "--print-units", "base", "--log-file", str(self.log_file), *self.extra,
                 *self.target]  # fmt: skip
        return argv

    @property
    def reports(self) -> tuple[Path, ...]:
        return (self.log_file,)  # type: ignore[return-value]

    def shell(self) -> str:
        return shlex.join(self.argv())

    def __str__(self) -> str:
        return self.shell()


def linear_snippet(
    m: int, k: int, n: int, dtype: str, *, device: str = "cuda", repeats: int = 5
) -> str:
    """Python source for ``python -c``: ``repeats`` calls of ``nn.Linear(k, n)``'s GEMM on ``m``
    rows, in ``dtype``, then a device synchronisation. An :class:`NcuCommand` target.

    It is the call the layer makes, ``F.linear(x, weight, bias)`` with the weight stored
    ``n × k`` and a bias, not ``a @ b``: the bias and the transposed weight change which cuBLAS
    kernel runs (addmm, with the bias in its epilogue where cuBLASLt can). Under autocast to
    ``dtype`` the layer casts its inputs and makes this same call, so the kernel profiled is
    one the training step launches. ``dtype`` is a training dtype: "float32", "bfloat16" or
    "float16"."""
    one_of("dtype", dtype, config.DTYPES)
    for name, value in (("m", m), ("k", k), ("n", n), ("repeats", repeats)):
        whole(name, value, low=1)
    sync = "torch.cuda.synchronize()" if device.startswith("cuda") else "None"
    return (
        f"import torch; t = dict(device={device!r}, dtype=torch.{dtype}); "
        f"x, w, b = torch.randn({m}, {k}, **t), torch.randn({n}, {k}, **t), "
        f"torch.randn({n}, **t); [torch.nn.functional.linear(x, w, b) for _ in "
        f"range({repeats})]; {sync}"
    )


def step_snippet(preset: str, dtype: str, *, steps: int = 3, device: str = "cuda") -> str:
    """Python source for ``python -c``: ``steps`` training steps of the course's GPT at
    ``preset`` in precision ``dtype``, each phase in ``labkit.profiling.phase`` (an NVTX range
    on CUDA: ``data``, ``forward``, ``backward``, ``optimizer``), then a device
    synchronisation. An :class:`NcuCommand` target whose kernels ``nvtx_include`` can select
    by phase: the step's own kernels, not a stand-alone call's."""
    if dtype not in config.DTYPES:
        raise ValueError(f"dtype={dtype!r} is not allowed: one of {config.DTYPES}")
    config.preset(preset)  # validates the name here, not in the profiled process
    whole("steps", steps, low=1)
    sync = "torch.cuda.synchronize()" if device.startswith("cuda") else "None"
    return (
        "import torch; from labkit import config, data, train; from labkit.model import GPT; "
        "from labkit.profiling.bottlenecks import annotated_step; "
        f"c = config.preset({preset!r}); torch.manual_seed(0); "
        f"m = GPT(c.model).to({device!r}); o = train.make_optimizer(m, c.train); "
        "s = data.load_splits().train; g = torch.Generator().manual_seed(0); "
        f"b = lambda: data.get_batch(s, c.train.micro_batch, c.model.seq_len, g, {device!r}); "
        f"[annotated_step(m, o, b, {dtype!r}) for _ in range({steps})]; {sync}"
    )


# ----------------------------------------------------------------------------------------------
# Running a tool


def _cuda_available() -> bool:
    """Whether a CUDA GPU is visible (a function, so tests can stand in for a GPU)."""
    return torch.cuda.is_available()


def _tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


def _exit_words(rc: int) -> str:
    if rc < 0:
        with contextlib.suppress(ValueError):
            return f"killed by signal {-rc} ({signal.Signals(-rc).name})"
        return f"killed by signal {-rc}"
    return f"exit code {rc}"


def _spawn_argv(argv: Sequence[str], tool_path: str, tool: str) -> list[str]:
    """argv behind ``labkit.jobs.spawn``, which arms a parent-death signal and then execs it (see
    labkit/jobs/spawn.py): a notebook kernel killed outright still takes the profiler down.
    ``execv`` needs a path, so a bare tool name is replaced by where ``which`` found it."""
    argv = list(argv)
    if argv[0] == tool:
        argv[0] = tool_path
    return [sys.executable, "-m", "labkit.jobs.spawn", "SIGTERM", str(os.getpid()), "--", *argv]


def _env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    root = str(Path(__file__).resolve().parents[2])  # so `-m labkit.jobs.spawn` imports anywhere
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _execute(argv: Sequence[str], *, tool: str, tool_path: str, timeout_s: float,
             stdout: Path, stderr: Path, env: Mapping[str, str] | None = None,
             cwd: str | os.PathLike | None = None) -> tuple[int, float]:  # fmt: skip
    """Run ``argv`` with its output in two files; end its whole tree on timeout or interrupt.

    Returns (exit code, seconds). Own session, so a notebook's interrupt reaches the kernel,
    which then ends the tree here in order; files, not pipes, so a chatty tool never blocks."""
    positive("timeout_s", timeout_s, why="seconds")
    start = time.monotonic()
    with open(stdout, "wb") as out, open(stderr, "wb") as err:
        proc = subprocess.Popen(
            _spawn_argv(argv, tool_path, tool), stdin=subprocess.DEVNULL, stdout=out,
            stderr=err, env=_env(env), cwd=cwd, start_new_session=True,
        )  # fmt: skip
        try:
            root = psutil.Process(proc.pid)
        except psutil.NoSuchProcess:  # already gone: nothing to end later
            root = None
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            if root is not None:
                procs.end_tree([root])
            proc.wait()
            raise ToolTimeout(
                f"{tool} ran past timeout_s={timeout_s:g} s and was ended with everything it "
                f"started: {shlex.join(argv)}\nlast lines of its stderr:\n"
                f"{_tail(stderr) or '(empty)'}\nlogs: {stdout}, {stderr}. Profile fewer steps "
                "(a shorter capture range) or pass a larger timeout_s."
            ) from None
        except BaseException:  # KeyboardInterrupt (a notebook's stop button) included
            if root is not None:
                procs.end_tree([root])
            proc.wait()
            raise
    return rc, time.monotonic() - start


def _missing(tool: str, argv: Sequence[str], *, needs_gpu: bool) -> NotRun | None:
    command = shlex.join(argv)
    if shutil.which(tool) is None:
        where = NSYS_INSTALL if tool == NSYS else NCU_INSTALL
        product = "Nsight Systems" if tool == NSYS else "Nsight Compute"
        return NotRun(tool, command, f"{tool} is not on the PATH (install {product} from "
                                     f"{where}; the CUDA toolkit also ships it, in "
                                     "<cuda>/bin, which must be on the PATH)")  # fmt: skip
    if needs_gpu and not _cuda_available():
        why = ("the capture range starts at a CUDA call, so nsys would record nothing"
               if tool == NSYS else "ncu profiles CUDA kernels")  # fmt: skip
        return NotRun(tool, command, f"no CUDA GPU is visible here ({why}); run this on the GPU "
                                     "tier")  # fmt: skip
    return None


def _logs(report: Path, tool: str) -> tuple[Path, Path]:
    return (report.with_name(f"{report.name}.{tool}.stdout.log"),
            report.with_name(f"{report.name}.{tool}.stderr.log"))  # fmt: skip


def _failed(tool: str, argv: Sequence[str], rc: int, seconds: float, stdout: Path,
            stderr: Path, hint: str = "") -> ToolFailed:  # fmt: skip
    tail = _tail(stderr) or _tail(stdout)
    return ToolFailed(
        f"{tool} failed with {_exit_words(rc)} after {seconds:.1f} s: {shlex.join(argv)}\n"
        f"last lines of its output:\n{tail or '(empty)'}\nfull logs: {stdout}, {stderr}"
        + (f"\n{hint}" if hint else ""),
        returncode=rc, stderr_tail=tail,
    )  # fmt: skip


def _clear(paths: Sequence[Path], *, overwrite: bool, tool: str) -> None:
    """Remove the reports a run is about to write, so a report found afterwards is this run's
    and never one left by an earlier run."""
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists():
            if not overwrite:
                raise FileExistsError(f"{p} exists and force_overwrite=False: {tool} would not "
                                      "replace it; move it, pick another output, or pass "
                                      "force_overwrite=True")  # fmt: skip
            p.unlink()


def run_nsys(cmd: NsysCommand | NsysTorchrunCommand, *, timeout_s: float = 600,
             env: Mapping[str, str] | None = None,
             cwd: str | os.PathLike | None = None) -> ToolRun | NotRun:  # fmt: skip
    """Run an ``nsys profile`` command and check that every rank's report is there.

    Returns :class:`NotRun` (printable: the command and why) when ``nsys`` is not on the PATH,
    or when no CUDA GPU is visible and the command waits for a CUDA capture range. Raises
    :class:`ToolFailed` on a non-zero exit, :class:`ToolTimeout` past ``timeout_s``, and
    :class:`ReportMissing` when nsys exited 0 without writing a report for every rank.
    ``env`` adds environment variables for the profiled program."""
    if not isinstance(cmd, (NsysCommand, NsysTorchrunCommand)):
        raise ValueError(f"cmd must be an NsysCommand or NsysTorchrunCommand, got "
                         f"{type(cmd).__name__}")  # fmt: skip
    argv = cmd.argv()
    skipped = _missing(NSYS, argv, needs_gpu=cmd.capture is not None)
    if skipped is not None:
        return skipped
    reports = cmd.reports
    _clear(reports, overwrite=cmd.force_overwrite, tool=NSYS)
    stdout, stderr = _logs(cmd.output, NSYS)  # type: ignore[arg-type]
    rc, seconds = _execute(argv, tool=NSYS, tool_path=shutil.which(NSYS) or NSYS,
                           timeout_s=timeout_s, stdout=stdout, stderr=stderr, env=env, cwd=cwd)  # fmt: skip
    if rc != 0:
        raise _failed(NSYS, argv, rc, seconds, stdout, stderr)
    missing = [p for p in reports if not p.is_file() or p.stat().st_size == 0]
    if missing:
        which = ", ".join(str(p) for p in missing)
        capture = {
            "cudaProfilerApi": "did the program call torch.cuda.profiler.start() (e.g. through "
                               "cuda_profiler_capture) on every rank? Without it nsys records "
                               "nothing and writes no report",
            "nvtx": f"did every rank open an NVTX range named {cmd.nvtx_capture!r}? nsys writes "
                    "no report when the range never starts",
        }.get(cmd.capture or "", "nsys's own output may say why")  # fmt: skip
        raise ReportMissing(
            f"nsys exited 0 but wrote no report at {which} ({len(missing)} of {len(reports)} "
            f"expected): {capture}. Logs: {stdout}, {stderr}\nlast lines of its output:\n"
            f"{_tail(stdout) or '(empty)'}"
        )
    return ToolRun(NSYS, shlex.join(argv), seconds, reports, stdout, stderr)


def run_nsys_stats(report: str | os.PathLike, report_name: str, *,
                   timeout_s: float = 300) -> str:  # fmt: skip
    """The CSV text of one ``nsys stats`` report of ``report`` (see :func:`nsys_stats_command`).

    Raises :class:`ProfilerError` when nsys is missing (reading a report needs it too),
    :class:`ToolFailed` when it fails."""
    path = Path(report)
    argv = nsys_stats_command(path, report_name)
    if shutil.which(NSYS) is None:
        raise ProfilerError(f"cannot read {path}: nsys is not on the PATH, and its statistics "
                            f"come from `{shlex.join(argv)}`; install Nsight Systems from "
                            f"{NSYS_INSTALL}, or open the report in the Nsight Systems GUI")  # fmt: skip
    if not path.is_file():
        raise ReportMissing(f"{path} does not exist: run the profile first (run_nsys)")
    with tempfile.TemporaryDirectory(prefix="labkit-nsys-stats-") as tmp:
        stdout, stderr = Path(tmp, "stdout.txt"), Path(tmp, "stderr.txt")
        rc, seconds = _execute(argv, tool=NSYS, tool_path=shutil.which(NSYS) or NSYS,
                               timeout_s=timeout_s, stdout=stdout, stderr=stderr)  # fmt: skip
        if rc != 0:
            raise _failed(NSYS, argv, rc, seconds, stdout, stderr, hint=(
                f"If nsys says the report {report_name!r} is unknown, this nsys predates the "
                "2023 names: pass report_name='gpukernsum', 'nvtxsum', 'gpumemtimesum' or "
                "'gpumemsizesum'."))  # fmt: skip
        return stdout.read_text(errors="replace")


def run_ncu(cmd: NcuCommand, *, timeout_s: float = 600, env: Mapping[str, str] | None = None,
            cwd: str | os.PathLike | None = None) -> NcuResult | NotRun:  # fmt: skip
    """Run an ``ncu`` command and read its CSV into :class:`NcuKernel` records.

    :class:`NotRun` when ``ncu`` is not on the PATH or no CUDA GPU is visible. Raises
    :class:`ToolFailed` on a non-zero exit (with a pointer to NVIDIA's page when the GPU's
    performance counters are not open to this user, ``ERR_NVGPUCTRPERM``),
    :class:`ToolTimeout`, :class:`ReportMissing` when the CSV was not written, and
    :class:`NothingProfiled` when fewer launches were profiled than ``launch_count``."""
    if not isinstance(cmd, NcuCommand):
        raise ValueError(f"cmd must be an NcuCommand, got {type(cmd).__name__}")
    argv = cmd.argv()
    skipped = _missing(NCU, argv, needs_gpu=True)
    if skipped is not None:
        return skipped
    log = cmd.log_file
    _clear([log], overwrite=True, tool=NCU)  # type: ignore[list-item]
    stdout, stderr = _logs(log, NCU)  # type: ignore[arg-type]
    rc, seconds = _execute(argv, tool=NCU, tool_path=shutil.which(NCU) or NCU,
                           timeout_s=timeout_s, stdout=stdout, stderr=stderr, env=env, cwd=cwd)  # fmt: skip
    said = "\n".join(_tail(p, 10_000) for p in (stdout, stderr, log))  # type: ignore[arg-type]
    if "ERR_NVGPUCTRPERM" in said:
        raise ToolFailed(
            f"ncu could not read the GPU's performance counters (ERR_NVGPUCTRPERM): this user "
            f"is not allowed to. See https://developer.nvidia.com/ERR_NVGPUCTRPERM (an admin "
            f"sets NVreg_RestrictProfilingToAdminUsers=0, or run as root). Command: "
            f"{shlex.join(argv)}; logs: {stdout}, {stderr}",
            returncode=rc, stderr_tail=_tail(stderr),
        )  # fmt: skip
    if rc != 0:
        raise _failed(NCU, argv, rc, seconds, stdout, stderr)
    if not log.is_file():  # type: ignore[union-attr]
        raise ReportMissing(
            f"ncu exited 0 but wrote no CSV at {log} (it may write none when no "
            f"kernel matched {cmd.kernel_name!r}); logs: {stdout}, {stderr}"
        )
    kernels = parse_ncu_csv(log.read_text(errors="replace"))  # type: ignore[union-attr]
    if len(kernels) < cmd.launch_count:
        what = "no launch" if not kernels else f"only {len(kernels)} launch(es)"
        raise NothingProfiled(
            f"ncu profiled {what} of kernels matching {cmd.kernel_name!r} (asked for "
            f"{cmd.launch_count} after skipping {cmd.launch_skip}): check the name against the "
            "nsys kernel summary (ncu matches the function name, without namespace, template "
            "and arguments, unless told otherwise), and that the program launches it more than "
            f"launch_skip + launch_count times. Logs: {stdout}, {stderr}", kernels,
        )  # fmt: skip
    return NcuResult(ToolRun(NCU, shlex.join(argv), seconds, (log,), stdout, stderr),  # type: ignore[arg-type]
                     tuple(kernels))  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Reading nsys stats CSV

_UNIT_NS = {"ns": 1.0, "us": 1e3, "μs": 1e3, "µs": 1e3, "ms": 1e6, "s": 1e9}
_UNIT_BYTES = {"b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9}  # nsys's MB: 10^6 bytes


def _key(header: str) -> str:
    return re.sub(r"\s+", "", header.strip().lower())


def _number(text: str, what: str) -> float:
    t = text.strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", t):  # thousands separators
        t = t.replace(",", "")
    try:
        return float(t)
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


def _no_table(text: str, cols: Sequence[_Col], what: str) -> CsvFormatError | str:
    """A note for an empty report (nsys says SKIPPED / 'does not contain'), else the error."""
    for line in text.splitlines():
        if re.search(r"SKIPPED|does not contain", line):
            return line.strip()
    need = ", ".join(repr(c.shown) for c in cols if c.required)
    head = text.strip().splitlines()[:3]
    return CsvFormatError(
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
        note = _no_table(text, cols, what)
        if isinstance(note, CsvFormatError):
            raise note
        return SummaryTable(what, (), note=note)
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
        note = _no_table(text, cols, what)
        if isinstance(note, CsvFormatError):
            raise note
        return SummaryTable(what, (), note=note)

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
        head, body = self._cells()
        h = "".join(f"<th>{html.escape(c)}</th>" for c in head)
        b = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                    for row in body)  # fmt: skip
        return (f"<p><b>{html.escape(self.title)}</b> (Nsight Systems)</p>"
                f"<table><thead><tr>{h}</tr></thead><tbody>{b}</tbody></table>")  # fmt: skip


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


def read_nsys_report(report: str | os.PathLike, *, timeout_s: float = 300) -> NsysSummaries:
    """The kernel, NVTX and memory-operation summaries of one ``.nsys-rep`` (four
    ``nsys stats`` runs). Raises if nsys is missing or any report fails: all four or none."""
    path = Path(report)
    return NsysSummaries(
        report=path,
        kernels=parse_kernel_summary(run_nsys_stats(path, KERNEL_REPORT, timeout_s=timeout_s)),
        nvtx=parse_nvtx_summary(run_nsys_stats(path, NVTX_REPORT, timeout_s=timeout_s)),
        memops_time=parse_memop_time_summary(
            run_nsys_stats(path, MEM_TIME_REPORT, timeout_s=timeout_s)),
        memops_size=parse_memop_size_summary(
            run_nsys_stats(path, MEM_SIZE_REPORT, timeout_s=timeout_s)),
    )  # fmt: skip


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


def profile_nsys(cmd: NsysCommand | NsysTorchrunCommand, *, timeout_s: float = 600,
                 env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike | None = None) -> NsysResult | NotRun:  # fmt: skip
    """:func:`run_nsys`, then :func:`read_nsys_report` for every rank's report: what a notebook
    cell calls. :class:`NotRun` where nothing could run; every other problem raises."""
    run = run_nsys(cmd, timeout_s=timeout_s, env=env, cwd=cwd)
    if isinstance(run, NotRun):
        return run
    return NsysResult(run, tuple(read_nsys_report(p) for p in run.reports))


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


# ----------------------------------------------------------------------------------------------
# Nsight Compute: reading the CSV

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
    t = text.strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", t):
        t = t.replace(",", "")
    try:
        return float(t)
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


# ----------------------------------------------------------------------------------------------
# The program's side: the capture range


@contextlib.contextmanager
def cuda_profiler_capture(enabled: bool = True) -> Iterator[bool]:
    """``torch.cuda.profiler.start()`` and ``stop()`` around the block: the range that ``nsys
    --capture-range=cudaProfilerApi`` records (cudaProfilerStart/Stop, CUDA Runtime API,
    "Profiler Control"). Synchronises first, so work queued before the block is not counted,
    and before ``stop()``, so the block's kernels are. Yields whether it captured: without
    CUDA (or with ``enabled=False``) the block just runs."""
    active = bool(enabled) and _cuda_available()
    if not active:
        yield False
        return
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    try:
        yield True
    finally:
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
