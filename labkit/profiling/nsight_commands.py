"""The exact ``nsys`` and ``ncu`` command lines, built and validated before anything runs.

Apart from :mod:`labkit.profiling.nsight` (which runs them) because a command is plain data:
a notebook on a machine without the tools still builds one and prints it to copy
(``cmd.shell()``), and a worker builds its own without importing the runners.

- :class:`NsysCommand`: ``nsys profile ... <target>``, one process, one report;
- :class:`NsysTorchrunCommand`: torchrun starting ``nsys`` once per rank, one report per rank
  (nsys's ``%q{RANK}`` substitution);
- :func:`nsys_stats_command`: ``nsys stats`` turning a report into one CSV table;
- :class:`NcuCommand`: ``ncu`` profiling one kernel of the step, its SpeedOfLight section as
  CSV;
- :func:`linear_snippet`, :func:`step_snippet`: ``python -c`` sources for an ncu target.

Sources for the flags: Nsight Systems User Guide,
https://docs.nvidia.com/nsight-systems/UserGuide/index.html ("CLI Profile Command Switch
Options", "CLI Stats Command Switch Options"); Nsight Compute CLI,
https://docs.nvidia.com/nsight-compute/NsightComputeCli/index.html; Nsight Compute Profiling
Guide, https://docs.nvidia.com/nsight-compute/ProfilingGuide/index.html ("Sections").
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit import config
from labkit.validate import flag, one_of, whole

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

