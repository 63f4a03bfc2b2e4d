"""Is this machine ready for the course? ``python -m labkit doctor`` answers, item by item.

    from labkit.hardware import doctor
    report = doctor.run_checks()      # in a notebook: shows as a table
    report.exit_code                  # 1 if any item failed, else 0

Each item gets a verdict:

    ok       works as the course expects
    info     not applicable on this tier (no NVIDIA driver on a laptop is not a fault: the
             course runs in the CPU tier there), or plain information
    warning  works, but something will be slower, missing or differ from the tested setup
    fail     a lab will break; the check says what to do about it

Every number comes from this machine: versions as the libraries report them, GPUs from
torch.cuda or NVML, and a real 2-process all-reduce whose bandwidth is measured, not
estimated. A check that cannot read something says N/A; it never fills in a value.

Each check runs on its own: one that raises becomes a "fail" carrying the error, and the others
still run. Facts several checks need (is CUDA usable? does NVML work?) are gathered once, lazily,
by a ``Probe``, which also takes stand-ins for ``torch.cuda`` and ``pynvml`` in tests.

The doctor is four modules besides this one: ``report`` (verdicts, ``Check``,
``Report``), ``probe`` (the shared facts), ``gpu`` and ``host`` (the
checks). This one runs them in order and is the command line; every name a test or a notebook
uses as ``doctor.<name>`` is re-exported here.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

from labkit.hardware.doctor.gpu import check_cuda_runtime as check_cuda_runtime
from labkit.hardware.doctor.gpu import check_cudnn as check_cudnn
from labkit.hardware.doctor.gpu import check_driver as check_driver
from labkit.hardware.doctor.gpu import check_gpu_sharing as check_gpu_sharing
from labkit.hardware.doctor.gpu import check_gpus as check_gpus
from labkit.hardware.doctor.gpu import check_interconnect as check_interconnect
from labkit.hardware.doctor.gpu import check_nccl as check_nccl
from labkit.hardware.doctor.gpu import check_nvml as check_nvml
from labkit.hardware.doctor.gpu import check_torch_build as check_torch_build
from labkit.hardware.doctor.host import ALLREDUCE_REPEATS as ALLREDUCE_REPEATS
from labkit.hardware.doctor.host import MIN_PYTHON as MIN_PYTHON
from labkit.hardware.doctor.host import MIN_TORCH as MIN_TORCH
from labkit.hardware.doctor.host import TESTED_JUPYTERLAB as TESTED_JUPYTERLAB
from labkit.hardware.doctor.host import check_allreduce as check_allreduce
from labkit.hardware.doctor.host import check_cpu as check_cpu
from labkit.hardware.doctor.host import check_disk as check_disk
from labkit.hardware.doctor.host import check_ipywidgets as check_ipywidgets
from labkit.hardware.doctor.host import check_jupyterlab as check_jupyterlab
from labkit.hardware.doctor.host import check_matplotlib as check_matplotlib
from labkit.hardware.doctor.host import check_memory as check_memory
from labkit.hardware.doctor.host import check_python as check_python
from labkit.hardware.doctor.host import check_torch as check_torch
from labkit.hardware.doctor.host import check_widgets_extension as check_widgets_extension
from labkit.hardware.doctor.probe import Probe as Probe
from labkit.hardware.doctor.probe import tested_pin as tested_pin
from labkit.hardware.doctor.report import VERDICTS as VERDICTS
from labkit.hardware.doctor.report import Check as Check
from labkit.hardware.doctor.report import Report as Report
from labkit.hardware.doctor.report import first_line

# ----------------------------------------------------------------------------------------------
# Running them

# (item, function name). Functions are looked up by name in this module (which re-exports them
# from doctor_gpu and doctor_host) when the checks run, so a test (or a course variant) can
# replace one with monkeypatch.
_REGISTRY: tuple[tuple[str, str], ...] = (
    ("Python", "check_python"),
    ("torch", "check_torch"),
    ("torch build", "check_torch_build"),
    ("CUDA runtime", "check_cuda_runtime"),
    ("cuDNN", "check_cudnn"),
    ("NCCL", "check_nccl"),
    ("NVIDIA driver", "check_driver"),
    ("NVML", "check_nvml"),
    ("GPUs", "check_gpus"),
    ("GPU sharing", "check_gpu_sharing"),
    ("interconnect", "check_interconnect"),
    ("CPU cores", "check_cpu"),
    ("memory", "check_memory"),
    ("disk", "check_disk"),
    ("all-reduce", "check_allreduce"),
    ("JupyterLab", "check_jupyterlab"),
    ("widgets extension", "check_widgets_extension"),
    ("ipywidgets", "check_ipywidgets"),
    ("matplotlib", "check_matplotlib"),
)
ITEMS: tuple[str, ...] = tuple(name for name, _ in _REGISTRY)


def _run_one(name: str, fn: Callable[[Probe], Check], probe: Probe) -> Check:
    try:
        check = fn(probe)
        if not isinstance(check, Check):
            raise TypeError(f"{fn.__name__} returned {type(check).__name__}, not a Check")
    except Exception as e:  # one broken check must not hide the others' answers
        return Check(
            name,
            "fail",
            f"the check itself raised {type(e).__name__}: {first_line(e)}",
            "this environment surprised labkit's doctor: report it with the output of "
            "`python -m labkit doctor --json`",
            {"error": f"{type(e).__name__}: {e}"},
        )
    return dataclasses.replace(check, name=name)


def run_checks(
    *,
    allreduce: bool = True,
    nproc: int = 2,
    timeout_s: float = 120,
    cuda: Any | None = None,
    nvml: Any | None = None,
) -> Report:
    """Run every check (``ITEMS``, in order) and return the report.

    Args:
        allreduce: launch the real ``nproc``-rank all-reduce job (a few seconds on a CPU).
        nproc: ranks in that job (>= 2).
        timeout_s: wall-clock limit of that job, seconds.
        cuda, nvml: stand-ins for ``torch.cuda`` and ``pynvml`` (tests).
    """
    probe = Probe(cuda=cuda, nvml=nvml, allreduce=allreduce, nproc=nproc, timeout_s=timeout_s)
    module = sys.modules[__name__]
    return Report([_run_one(name, getattr(module, fn), probe) for name, fn in _REGISTRY])


def _stdout_takes(text: str) -> bool:
    try:
        text.encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def _nproc_arg(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: need an integer >= 2 (ranks)")
    return n


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit doctor [--json] [--no-allreduce] [--nproc N]``; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="labkit doctor",
        description="Check that this machine is ready for LLM GPU Lab; exit code 1 on any fail.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--no-allreduce", action="store_true", help="skip the real multi-process all-reduce job"
    )
    parser.add_argument(
        "--nproc", type=_nproc_arg, default=2, help="ranks in the all-reduce job (default 2)"
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="limit for the all-reduce job, s (120)"
    )
    args = parser.parse_args(argv)
    options = {"allreduce": not args.no_allreduce, "nproc": args.nproc, "timeout_s": args.timeout}
    if args.json:
        # Anything a check prints (the launcher's notes) goes to stderr: stdout stays JSON.
        with contextlib.redirect_stdout(sys.stderr):
            report = run_checks(**options)
        print(report.to_json())
    else:
        report = run_checks(**options)
        print(report.format(ascii_only=not _stdout_takes("✓✗↔×")))
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
