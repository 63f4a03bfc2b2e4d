"""What running an Nsight tool ends as: a :class:`ToolRun`, a :class:`NotRun`, or an error.

Apart from :mod:`labkit.profiling.nsight` (which runs the tools) because every Nsight module
shares them: the command builders (:mod:`labkit.profiling.nsight_commands`), the runners and
both CSV readers (:mod:`labkit.profiling.nsys_reports`, :mod:`labkit.profiling.ncu_reports`)
raise these errors and hand back these records. The rules they encode are the runners':

- a missing tool is not an error: the runner returns :class:`NotRun`, which prints the command
  and says why nothing ran;
- a failing tool raises :class:`ToolFailed` (exit code and last stderr lines), a hanging one
  :class:`ToolTimeout`, a missing report :class:`ReportMissing`, text that is not the expected
  CSV :class:`CsvFormatError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from labkit.errors import LabkitError

if TYPE_CHECKING:  # only for NothingProfiled's annotation: ncu_reports imports this module
    from labkit.profiling.ncu_reports import NcuKernel



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

