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

Where each part lives (this module re-exports every public name, so ``nsight.X`` keeps working):

    nsight_runs      ToolRun, NotRun and the errors every Nsight module shares
    nsight_commands  the command builders (NsysCommand, NsysTorchrunCommand, NcuCommand,
                     nsys_stats_command) and the ``python -c`` snippets
    nsight           running the tools (run_nsys, run_nsys_stats, run_ncu, profile_nsys,
                     read_nsys_report) and the program's capture range
    nsys_reports     nsys stats CSV as tables, the kernel-summary figure, short_kernel_name
    ncu_reports      ncu CSV as kernel records; a kernel placed on the roofline

Importing this module starts nothing and touches no GPU; matplotlib is imported only to draw.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import psutil
import torch

from labkit.jobs import procs
from labkit.profiling.ncu_reports import (
    NcuKernel,
    NcuMetric,
    NcuPlacement,
    NcuResult,
    parse_ncu_csv,
    place_on_roofline,
)
from labkit.profiling.nsight_commands import (
    CAPTURE_ENDS,
    CAPTURE_MODES,
    DEFAULT_TRACE,
    DRAM_BYTES_METRICS,
    KERNEL_REPORT,
    MEM_SIZE_REPORT,
    MEM_TIME_REPORT,
    NCU,
    NCU_INSTALL,
    NSYS,
    NSYS_INSTALL,
    NVTX_REPORT,
    NVTX_UNREGISTERED,
    SAMPLE_MODES,
    NcuCommand,
    NsysCommand,
    NsysTorchrunCommand,
    linear_snippet,
    nsys_stats_command,
    step_snippet,
)
from labkit.profiling.nsight_runs import (
    CsvFormatError,
    NothingProfiled,
    NotRun,
    ProfilerError,
    ReportMissing,
    ToolFailed,
    ToolRun,
    ToolTimeout,
)
from labkit.profiling.nsys_reports import (
    NsysResult,
    NsysSummaries,
    SizeSummaryRow,
    SummaryTable,
    TimeSummaryRow,
    parse_kernel_summary,
    parse_memop_size_summary,
    parse_memop_time_summary,
    parse_nvtx_summary,
    plot_kernel_summary,
    short_kernel_name,
)
from labkit.validate import positive

__all__ = [
    "CAPTURE_ENDS",
    "CAPTURE_MODES",
    "DEFAULT_TRACE",
    "DRAM_BYTES_METRICS",
    "KERNEL_REPORT",
    "MEM_SIZE_REPORT",
    "MEM_TIME_REPORT",
    "NCU",
    "NCU_INSTALL",
    "NSYS",
    "NSYS_INSTALL",
    "NVTX_REPORT",
    "NVTX_UNREGISTERED",
    "SAMPLE_MODES",
    "CsvFormatError",
    "NcuCommand",
    "NcuKernel",
    "NcuMetric",
    "NcuPlacement",
    "NcuResult",
    "NotRun",
    "NothingProfiled",
    "NsysCommand",
    "NsysResult",
    "NsysSummaries",
    "NsysTorchrunCommand",
    "ProfilerError",
    "ReportMissing",
    "SizeSummaryRow",
    "SummaryTable",
    "TimeSummaryRow",
    "ToolFailed",
    "ToolRun",
    "ToolTimeout",
    "cuda_profiler_capture",
    "linear_snippet",
    "nsys_stats_command",
    "parse_kernel_summary",
    "parse_memop_size_summary",
    "parse_memop_time_summary",
    "parse_ncu_csv",
    "parse_nvtx_summary",
    "place_on_roofline",
    "plot_kernel_summary",
    "profile_nsys",
    "read_nsys_report",
    "run_ncu",
    "run_nsys",
    "run_nsys_stats",
    "short_kernel_name",
    "step_snippet",
]

TAIL_LINES = 15  # lines of a failing tool's stderr quoted in the error


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
