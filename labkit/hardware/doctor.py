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
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import html
import importlib.metadata
import json
import math
import os
import platform
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import psutil
import torch

from labkit import hardware
from labkit.jobs import launch, procs

VERDICTS = ("ok", "info", "warning", "fail")
SYMBOLS = {"ok": "✓", "info": "i", "warning": "!", "fail": "✗"}
ASCII_SYMBOLS = {"ok": "+", "info": "i", "warning": "!", "fail": "x"}  # for a non-UTF-8 terminal

MIN_PYTHON = (3, 10)  # pyproject.toml: requires-python = ">=3.10"
MIN_TORCH = (2, 4)  # pyproject.toml: "torch>=2.4"
TESTED_JUPYTERLAB = (4, 2)  # pyproject.toml: "jupyterlab>=4.2"
LOW_MEMORY_BYTES = 4 * 2**30  # warn below this much available RAM: each rank holds its own copy
LOW_DISK_BYTES = 2 * 2**30  # warn below this much free disk: job logs, caches, checkpoints
FULL_DISK_BYTES = 256 * 2**20  # fail below this: a job cannot even write its logs

# The all-reduce job: a 1 MiB float32 message is enough to prove the ranks connect and to time
# them over gloo in well under a second. NCCL over NVLink needs a much bigger message to get out
# of the latency-bound regime (NCCL-tests sweep up to GBs), so GPUs get 128 MiB.
ALLREDUCE_NUMEL = {"cpu": 2**18, "cuda": 2**25}
ALLREDUCE_REPEATS = 5

# Fixes shared by several checks.
_FIX_REQUIREMENTS = "run `./course setup` (installs the tested pins from requirements.txt)"
_FIX_CUDA_TORCH = (
    "install a CUDA build of torch: `TORCH_INDEX_URL=<PyTorch wheel index for your CUDA "
    "version> ./course setup` (README, 'GPU machines'); on a GPU image that has one, "
    "`LABKIT_KEEP_TORCH=1 ./course setup` keeps it"
)

# What to do about each NVML error (nvidia-ml-py names one exception class per error code).
_NVML_FIXES = {
    "NVMLError_LibraryNotFound": "install the NVIDIA driver; in a container, start it with "
    "the GPU runtime (`--gpus all`), which mounts libnvidia-ml.so",
    "NVMLError_DriverNotLoaded": "load the driver: check `nvidia-smi`; `sudo modprobe nvidia` "
    "or a reboot usually does it",
    "NVMLError_LibRmVersionMismatch": "the driver was upgraded without a reboot: reboot (or "
    "reload the nvidia kernel module)",
    "NVMLError_NoPermission": "give your user access to /dev/nvidia* (often the `video` group)",
    "NVMLError_FunctionNotFound": "update the NVIDIA driver: it is older than nvidia-ml-py expects",
}


# ----------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class Check:
    """One item of the report.

    Attributes:
        name: the item, e.g. "torch" or "all-reduce" (see ``ITEMS``).
        verdict: one of ``VERDICTS``.
        detail: what was found, in words (may span lines).
        fix: what to do; required for "warning" and "fail".
        data: the same facts as numbers and strings, for ``--json`` (units in the key names).
    """

    name: str
    verdict: str
    detail: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict={self.verdict!r} is not allowed: one of {VERDICTS}")
        if self.verdict in ("warning", "fail") and not self.fix.strip():
            raise ValueError(f"check {self.name!r}: a {self.verdict} needs a fix saying what to do")


@dataclass
class Report:
    """The checks, in order. ``exit_code`` is 1 when any item failed."""

    checks: list[Check]

    @property
    def ok(self) -> bool:
        return not any(c.verdict == "fail" for c in self.checks)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def __getitem__(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check named {name!r}; the report has {[c.name for c in self.checks]}")

    def counts(self) -> dict[str, int]:
        return {v: sum(c.verdict == v for c in self.checks) for v in VERDICTS}

    def summary(self) -> str:
        n = self.counts()
        head = f"{n['ok']} ok, {n['info']} info, {n['warning']} warning(s), {n['fail']} failure(s)"
        verdict = (
            "ready for the course"
            if self.ok
            else "not ready: fix the items marked fail, then run `python -m labkit doctor` again"
        )
        return f"{head}: {verdict}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "exit_code": self.exit_code,
            "counts": self.counts(),
            "checks": [dataclasses.asdict(c) for c in self.checks],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def format(self, *, ascii_only: bool = False) -> str:
        """An aligned table: symbol, item, detail, and the fix under it."""
        symbols = ASCII_SYMBOLS if ascii_only else SYMBOLS
        width = max((len(c.name) for c in self.checks), default=0)
        pad = " " * (width + 6)  # under the detail column
        lines = ["labkit doctor"]
        for c in self.checks:
            detail = c.detail.splitlines() or [""]
            lines.append(f" {symbols[c.verdict]}  {c.name.ljust(width)}  {detail[0]}")
            lines += [pad + s for s in detail[1:]]
            if c.fix and c.verdict != "ok":
                lines.append(f"{pad}fix: {c.fix}")
        lines.append(self.summary())
        text = "\n".join(lines)
        if ascii_only:
            text = text.encode("ascii", "replace").decode("ascii")
        return text

    def __str__(self) -> str:
        return self.format()

    def __repr__(self) -> str:
        return self.format()

    def _repr_html_(self) -> str:
        colour = {"ok": "#1a7f37", "info": "#57606a", "warning": "#9a6700", "fail": "#cf222e"}
        esc = html.escape
        top = "vertical-align:top"
        rows = []
        for c in self.checks:
            fix = f"<br><i>fix: {esc(c.fix)}</i>" if c.fix and c.verdict != "ok" else ""
            rows.append(
                f"<tr class='labkit-doctor-{c.verdict}'>"
                f"<td style='color:{colour[c.verdict]};font-weight:bold;{top}' "
                f"title='{c.verdict}'>{SYMBOLS[c.verdict]}</td>"
                f"<td style='white-space:nowrap;{top}'>{esc(c.name)}</td>"
                f"<td style='text-align:left;white-space:pre-wrap;{top}'>{esc(c.detail)}{fix}</td>"
                "</tr>"
            )
        return (
            "<div class='labkit-doctor'><table><thead><tr><th></th><th>item</th>"
            "<th style='text-align:left'>found</th></tr></thead><tbody>"
            + "".join(rows)
            + f"</tbody></table><p><b>{esc(self.summary())}</b></p></div>"
        )


def _ok(detail: str, **data: Any) -> Check:
    return Check("", "ok", detail, "", data)


def _info(detail: str, fix: str = "", **data: Any) -> Check:
    return Check("", "info", detail, fix, data)


def _warning(detail: str, fix: str, **data: Any) -> Check:
    return Check("", "warning", detail, fix, data)


def _fail(detail: str, fix: str, **data: Any) -> Check:
    return Check("", "fail", detail, fix, data)


# ----------------------------------------------------------------------------------------------
# Facts shared by several checks


class Probe:
    """Facts about this machine, each read once, on first use.

    Args:
        cuda: a stand-in for ``torch.cuda`` (tests).
        nvml: a stand-in for the ``pynvml`` module (tests); default: nvidia-ml-py if installed.
        allreduce: run the 2-process all-reduce job (False: report it as skipped).
        nproc: ranks in that job (>= 2).
        timeout_s: wall-clock limit of that job, seconds.
    """

    def __init__(
        self,
        *,
        cuda: Any | None = None,
        nvml: Any | None = None,
        allreduce: bool = True,
        nproc: int = 2,
        timeout_s: float = 120,
    ) -> None:
        if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 2:
            raise ValueError(f"nproc={nproc!r}: an all-reduce needs an integer >= 2 ranks")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s={timeout_s!r}: need a number of seconds > 0")
        self.cuda = torch.cuda if cuda is None else cuda
        self._nvml_arg = nvml
        self.allreduce, self.nproc, self.timeout_s = allreduce, nproc, timeout_s

    @cached_property
    def nvml(self) -> Any | None:
        """The NVML module, or None when nvidia-ml-py is not installed."""
        if self._nvml_arg is not None:
            return self._nvml_arg
        try:
            import pynvml
        except ImportError:
            return None
        return pynvml

    @cached_property
    def nvml_error(self) -> str | None:
        """None when NVML works; else "not-installed" or the NVML error's class name."""
        if self.nvml is None:
            return "not-installed"
        try:
            with nvml_session(self.nvml) as nv:
                nv.nvmlDeviceGetCount()
        except Exception as e:  # one NVMLError subclass per error code
            return type(e).__name__
        return None

    @cached_property
    def nvml_gpu_count(self) -> int:
        """GPUs the driver sees (0 when NVML does not work), whether torch can use them or not."""
        if self.nvml_error is not None:
            return 0
        with nvml_session(self.nvml) as nv:
            return int(nv.nvmlDeviceGetCount())

    @cached_property
    def cuda_available(self) -> bool:
        return bool(self.cuda.is_available())

    @cached_property
    def gpus(self) -> list[hardware.GpuInfo]:
        """torch's GPUs when CUDA is usable, else the ones NVML sees (see hardware.gpu_info)."""
        return hardware.gpu_info(cuda=self.cuda, nvml=self.nvml)

    @cached_property
    def usable_gpu_count(self) -> int:
        return int(self.cuda.device_count()) if self.cuda_available else 0


@contextlib.contextmanager
def nvml_session(nvml: Any) -> Iterator[Any]:
    """``nvmlInit`` … ``nvmlShutdown``, the shutdown best effort (the queries are what matter)."""
    nvml.nvmlInit()
    try:
        yield nvml
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _na(query: Callable[[], Any]) -> Any | None:
    """One optional NVML or torch query: any failure is N/A (None), never a made-up value."""
    try:
        return query()
    except Exception:
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _version_tuple(version: str) -> tuple[int, ...]:
    """(major, minor[, patch]) from "2.13.0+cu128", "4.6.6", "2.9.0a0+git1234"; () if none."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return tuple(int(g) for g in m.groups() if g is not None) if m else ()


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def tested_pin(package: str, requirements: Path | None = None) -> str | None:
    """The version requirements.txt pins ``package`` to (``package==X``), or None.

    requirements.txt sits beside the labkit folder in the course repo; an installed copy of
    labkit has none, and then there is no pin to compare with.
    """
    path = requirements or _repo_root() / "requirements.txt"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return None
    m = re.search(rf"^\s*{re.escape(package)}\s*==\s*([^\s;#]+)", text, re.M | re.I)
    return m.group(1) if m else None


# ----------------------------------------------------------------------------------------------
# The checks. Each takes the Probe and returns a Check; ``run_checks`` names it.


def check_python(probe: Probe) -> Check:
    version = platform.python_version()
    detail = f"{version} ({platform.python_implementation()}, {sys.executable})"
    if sys.version_info[:2] < MIN_PYTHON:
        need = ".".join(map(str, MIN_PYTHON))
        return _fail(
            f"{detail}: the course needs Python >= {need}",
            f"install Python {need} or newer and run `PYTHON=/path/to/python3 ./course setup`",
            version=version,
        )
    return _ok(detail, version=version, executable=sys.executable)


def check_torch(probe: Probe, *, requirements: Path | None = None) -> Check:
    version = torch.__version__
    base = version.split("+")[0]
    pin = tested_pin("torch", requirements)
    data = {"version": version, "tested": pin}
    if _version_tuple(base) < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        return _fail(
            f"torch {version} is older than {need}, the oldest labkit supports",
            _FIX_REQUIREMENTS + (f" (torch=={pin})" if pin else ""),
            **data,
        )
    if pin is None:
        return _ok(f"torch {version} (no requirements.txt beside labkit to compare with)", **data)
    if base == pin.split("+")[0]:
        return _ok(f"torch {version}, the tested version", **data)
    return _warning(
        f"torch {version}; the course is tested with {pin}: results and APIs may differ",
        f"{_FIX_REQUIREMENTS}; on a GPU machine keeping its own CUDA torch this warning is "
        "expected (README, 'GPU machines')",
        **data,
    )


def check_torch_build(probe: Probe) -> Check:
    cuda_version = torch.version.cuda
    hip = getattr(torch.version, "hip", None)
    if hip:
        return _warning(
            f"ROCm build (HIP {hip}): the course targets NVIDIA GPUs, NCCL and NVML",
            "expect the GPU labs to differ; the CPU tier works the same everywhere",
            build="rocm",
        )
    seen = probe.nvml_gpu_count
    if cuda_version is None:
        if seen:
            return _warning(
                f"CPU-only build, but the NVIDIA driver sees {seen} GPU(s) that this torch "
                "cannot use: the course runs in the CPU tier",
                _FIX_CUDA_TORCH,
                build="cpu",
                nvml_gpus=seen,
            )
        return _ok("CPU-only build: the course runs in the CPU tier", build="cpu")
    if probe.cuda_available:
        n = probe.usable_gpu_count
        return _ok(f"CUDA {cuda_version} build; {n} GPU(s) usable", build="cuda", gpus=n)
    if seen:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return _fail(
            f"CUDA {cuda_version} build, but torch cannot use the {seen} GPU(s) the driver sees",
            "the driver may be too old for this build's CUDA (see 'NVIDIA driver' below): "
            "update it, or install a torch built for the CUDA version the driver supports"
            + (f"; also check CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""),
            build="cuda",
            nvml_gpus=seen,
        )
    return _ok(
        f"CUDA {cuda_version} build, no NVIDIA GPU here: the course runs in the CPU tier",
        build="cuda",
        gpus=0,
    )


_NOT_ON_CPU = "not applicable on the CPU tier (torch can use no CUDA GPU here)"


def check_cuda_runtime(probe: Probe) -> Check:
    if not probe.cuda_available:
        return _info(_NOT_ON_CPU)
    return _ok(f"CUDA runtime {torch.version.cuda} (ships with torch)", version=torch.version.cuda)


def _cudnn_text(v: int) -> str:
    # cuDNN 9 encodes major*10000 + minor*100 + patch (90100 = 9.1.0); cuDNN 8 and older,
    # major*1000 + minor*100 + patch (8902 = 8.9.2). See cudnn.h, CUDNN_VERSION.
    major, rest = (v // 10000, v % 10000) if v >= 10000 else (v // 1000, v % 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def check_cudnn(probe: Probe) -> Check:
    if not probe.cuda_available:
        return _info(_NOT_ON_CPU)
    v = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if v is None:
        return _warning(
            "cuDNN is not available to torch (transformers run without it; torch's cuDNN "
            "attention backend is then unused)",
            "reinstall torch from the official wheels, which bundle cuDNN",
        )
    return _ok(f"cuDNN {_cudnn_text(int(v))}", version=_cudnn_text(int(v)))


def check_nccl(probe: Probe) -> Check:
    if not probe.cuda_available:
        return _info(_NOT_ON_CPU + "; multi-process labs use gloo")
    import torch.distributed as tdist

    if not tdist.is_available() or not tdist.is_nccl_available():
        gpus = probe.usable_gpu_count
        detail = "this torch build has no NCCL: multi-GPU jobs cannot use NCCL"
        fix = "install an official Linux CUDA wheel of torch, which includes NCCL"
        return _fail(detail, fix) if gpus >= 2 else _warning(detail + " (1 GPU: unused)", fix)
    v = torch.cuda.nccl.version()
    text = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return _ok(f"NCCL {text}", version=text)


def _cuda_driver_text(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"  # 12080 -> "12.8" (cudaDriverGetVersion encoding)


def check_driver(probe: Probe) -> Check:
    err = probe.nvml_error
    if err is None:
        with nvml_session(probe.nvml) as nv:
            driver = _text(nv.nvmlSystemGetDriverVersion())
            cuda_drv = _na(nv.nvmlSystemGetCudaDriverVersion)
        data: dict[str, Any] = {"version": driver}
        detail = f"NVIDIA driver {driver}"
        if cuda_drv is None:
            return _ok(detail + " (its CUDA version: N/A)", **data)
        data["cuda"] = supports = _cuda_driver_text(int(cuda_drv))
        detail += f", supports CUDA up to {supports}"
        runtime = torch.version.cuda
        if runtime and _version_tuple(runtime)[:1] > _version_tuple(supports)[:1]:
            return _fail(
                f"{detail}, but torch is built for CUDA {runtime}",
                f"update the driver to one for CUDA {runtime}, or install a torch built for "
                f"CUDA {supports}",
                **data,
            )
        if runtime and _version_tuple(runtime) > _version_tuple(supports):
            # Same major version: CUDA's minor-version compatibility runs it on this driver.
            detail += f" (torch's CUDA {runtime} runs on it by minor-version compatibility)"
        return _ok(detail, **data)
    if err == "not-installed":
        return _warning(
            "driver version unknown: nvidia-ml-py (NVML's Python binding) is not installed",
            _FIX_REQUIREMENTS,
        )
    if err == "NVMLError_LibraryNotFound" and not probe.cuda_available:
        return _info("no NVIDIA driver: the course runs in the CPU tier")
    return _warning(
        f"driver version unknown: NVML says {err}",
        _NVML_FIXES.get(err, "check `nvidia-smi`; it reports driver problems in words"),
        error=err,
    )


def check_nvml(probe: Probe) -> Check:
    err = probe.nvml_error
    status = hardware.nvml_status(probe.nvml) if probe.nvml is not None else None
    if err is None and status is not None and status.ok:
        return _ok(f"{status.message}: live GPU metrics are measured", gpus=probe.nvml_gpu_count)
    message = status.message if status is not None else "nvidia-ml-py is not installed"
    if err == "NVMLError_LibraryNotFound" and not probe.cuda_available:
        return _info(
            f"{message}. Live metrics show the CPU and the job's processes instead",
            error=err,
        )
    return _warning(
        f"{message}: no GPU telemetry (utilisation, memory, power) in the live metrics",
        _FIX_REQUIREMENTS
        if err == "not-installed"
        else _NVML_FIXES.get(err or "", "check `nvidia-smi`"),
        error=err,
    )


def _arch_supported(cc: tuple[int, int], arch_list: list[str]) -> bool:
    """Can a torch built for ``arch_list`` (``torch.cuda.get_arch_list()``) run on ``cc``?

    A cubin for sm_XY runs on GPUs of the same major version X with minor >= Y; PTX for
    compute_XY is compiled by the driver for any GPU >= X.Y (CUDA C Programming Guide,
    "Binary Compatibility" and "PTX Compatibility"). Arch-specific targets (sm_90a) count as
    their base.
    """
    for arch in arch_list:
        m = re.fullmatch(r"(sm|compute)_(\d+)(\d)[a-z]?", arch)
        if not m:
            continue
        kind, major, minor = m.group(1), int(m.group(2)), int(m.group(3))
        if kind == "sm" and major == cc[0] and minor <= cc[1]:
            return True
        if kind == "compute" and (major, minor) <= cc:
            return True
    return False


def check_gpus(probe: Probe) -> Check:
    gpus = probe.gpus
    tier = hardware.tier(cuda=probe.cuda)
    data: dict[str, Any] = {
        "tier": tier,
        "gpus": [
            {
                "index": g.index,
                "name": g.name,
                "memory_bytes": g.memory_bytes,
                "compute_capability": list(g.compute_capability) if g.compute_capability else None,
                "uuid": g.uuid,
                "source": g.source,
            }
            for g in gpus
        ],
    }
    if not gpus:
        return _info("no NVIDIA GPU: the course runs in the CPU tier", **data)
    lines = [str(g) for g in gpus]
    if not probe.cuda_available:
        return _warning(
            "\n".join([f"{len(gpus)} GPU(s) seen by the driver, none usable by torch:", *lines]),
            _FIX_CUDA_TORCH,
            **data,
        )
    arch_list = list(_na(probe.cuda.get_arch_list) or [])
    no_kernels = [
        g
        for g in gpus
        if arch_list
        and g.compute_capability
        and not _arch_supported(g.compute_capability, arch_list)
    ]
    if no_kernels:
        names = ", ".join(f"GPU {g.index} ({g.name}, {g.compute_capability})" for g in no_kernels)
        return _fail(
            "\n".join(
                [
                    f"tier {tier}",
                    *lines,
                    f"torch has no kernels for {names}: it was built "
                    f"for {' '.join(arch_list)} ('no kernel image is available')",
                ]
            ),
            "install a newer torch (or one for a newer CUDA) that lists this GPU's sm_XY in "
            "torch.cuda.get_arch_list()",
            **data,
        )
    old = [g for g in gpus if g.compute_capability and g.compute_capability < (7, 0)]
    if old:
        return _warning(
            "\n".join([f"tier {tier}", *lines, "compute capability < 7.0: no tensor cores"]),
            "the mixed-precision and MFU labs assume tensor cores (7.0+, bf16 from 8.0): "
            "use a newer GPU for them",
            **data,
        )
    notes = []
    if any(g.compute_capability and g.compute_capability < (8, 0) for g in gpus):
        notes.append("bf16 needs compute capability 8.0: on this GPU the precision labs use fp16")
    return _ok("\n".join([f"tier {tier}", *lines, *notes]), **data)


def _holder(pid: int) -> tuple[str | None, str | None]:
    """(user, short command line) of a process, or Nones when it cannot be seen from here."""
    try:
        p = psutil.Process(pid)
        user = p.username()
        argv = p.cmdline()
    except (psutil.Error, OSError):
        return None, None
    if not argv:
        return user, None
    command = " ".join([os.path.basename(argv[0]), *argv[1:]])
    return user, command if len(command) <= 60 else command[:57] + "..."


def _gpu_processes(nv: Any, handle: Any) -> list[tuple[int, int | None]]:
    """(pid, used bytes or None) of every compute and graphics process NVML lists on a GPU."""
    found: dict[int, int | None] = {}
    for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        for p in _na(lambda fn=fn: getattr(nv, fn)(handle)) or []:
            used = getattr(p, "usedGpuMemory", None)
            found.setdefault(int(p.pid), None if used is None else int(used))
    return sorted(found.items())


def check_gpu_sharing(probe: Probe) -> Check:
    """Do processes other than this one already hold the GPUs this process would use?"""
    visible_env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if probe.nvml_error is not None:
        return _info(
            f"N/A: NVML cannot be read here ({probe.nvml_error}), so there is no GPU process "
            "list to check",
            nvml_error=probe.nvml_error,
        )
    me = os.getpid()
    with nvml_session(probe.nvml) as nv:
        everyone, _ = hardware.visible_gpus(nv, None)
        mine, notes = hardware.visible_gpus(nv)
        names = {g.index: _text(_na(lambda h=g.handle: nv.nvmlDeviceGetName(h)) or "N/A")
                 for g in everyone}  # fmt: skip
        held = {g.index: [(pid, used) for pid, used in _gpu_processes(nv, g.handle) if pid != me]
                for g in everyone}  # fmt: skip
    data: dict[str, Any] = {
        "cuda_visible_devices": visible_env,
        "notes": notes,
        "gpus": [
            {"nvml_index": g.index, "name": names[g.index], "uuid": g.uuid, "mig": g.mig,
             "processes": [{"pid": pid, "user": _holder(pid)[0], "command": _holder(pid)[1],
                            "used_bytes": used} for pid, used in held[g.index]]}
            for g in mine
        ],
    }  # fmt: skip
    if not mine:
        why = (f"CUDA_VISIBLE_DEVICES={visible_env!r} selects no GPU" if visible_env is not None
               else "NVML lists no GPU")  # fmt: skip
        return _info("\n".join([f"{why}: this process would use none, so none is shared", *notes]),
                     **data)  # fmt: skip
    which = (f"CUDA_VISIBLE_DEVICES={visible_env!r}" if visible_env is not None
             else "CUDA_VISIBLE_DEVICES unset: every GPU")  # fmt: skip
    label = {g.index: f"GPU {g.index} ({names[g.index]})" for g in everyone}
    lines = []
    for g in mine:
        for pid, used in held[g.index]:
            user, command = _holder(pid)
            who = (f"{user}, {command}" if user and command else user or
                   "not visible from here: another container's or an ended process")  # fmt: skip
            mem = f"{used / 2**30:.1f} GiB" if used is not None else "GPU memory N/A"
            lines.append(f"{label[g.index]}: pid {pid} ({who}) holds {mem}")
    if not lines:
        used_here = ", ".join(label[g.index] for g in mine)
        return _ok("\n".join([f"{which}; no other process holds {used_here}", *notes]), **data)
    free = [g.index for g in everyone if not held[g.index]]
    if free:
        fix = (f"give each learner their own GPU with CUDA_VISIBLE_DEVICES=<one index> (free "
               f"now: {', '.join(map(str, free))}, nvidia-smi's numbering; set "
               "CUDA_DEVICE_ORDER=PCI_BUS_ID so CUDA counts the same way), one JupyterLab per "
               "learner started with it")  # fmt: skip
    else:
        fix = ("every GPU on this machine already has a process: give each learner their own "
               "GPU with CUDA_VISIBLE_DEVICES=<one index> once it is free, or wait for these "
               "processes to end")  # fmt: skip
    data["free_gpus"] = free
    head = f"{which}; processes other than this one already hold the GPU(s) it would use:"
    return _warning("\n".join([head, *lines, *notes]), fix, **data)


_TOPOLOGY = {  # nvmlDeviceGetTopologyCommonAncestor, with nvidia-smi topo -m's short names
    0: "same board",
    10: "PIX (one PCIe switch)",
    20: "PXB (several PCIe switches)",
    30: "PHB (through a PCIe host bridge)",
    40: "NODE (across host bridges in one NUMA node)",
    50: "SYS (across NUMA nodes)",
}


def _nvlinks(nv: Any, handle: Any) -> list[tuple[int, str | None, int | None]]:
    """Active NVLinks of one GPU: (link, remote PCI bus id, remote device type); [] if none."""
    links = []
    for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            state = nv.nvmlDeviceGetNvLinkState(handle, link)
        except Exception:
            # NotSupported (no NVLink on this GPU) or InvalidArgument (past its last link).
            if link == 0:
                return []
            continue
        if state != nv.NVML_FEATURE_ENABLED:
            continue
        bus = _na(lambda link=link: _text(nv.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId))
        kind = _na(lambda link=link: nv.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link))
        links.append((link, bus.lower() if bus else None, kind))
    return links


def _pair_links(nv: Any, i: int, j: int, links: dict, buses: dict) -> str:
    """How GPUs i and j are joined by NVLink, from each one's active links; "" for not at all."""
    switch = getattr(nv, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    direct = sum(1 for _, bus, _ in links[i] if bus and buses[j] and bus == buses[j])
    if direct:
        return f"NVLink ×{direct} (direct)"
    to_switch = [sum(1 for *_, kind in links[k] if kind == switch) for k in (i, j)]
    if all(to_switch):
        return f"NVLink via NVSwitch ({to_switch[0]} and {to_switch[1]} links)"
    return ""


def check_interconnect(probe: Probe) -> Check:
    gpus = [g for g in probe.gpus if g.source == "torch.cuda"] if probe.cuda_available else []
    if len(gpus) < 2:
        return _info(f"not applicable: needs 2 or more usable GPUs (this machine: {len(gpus)})")
    pairs = [(a, b) for n, a in enumerate(gpus) for b in gpus[n + 1 :]]
    peer = {
        (a.index, b.index): _na(
            lambda a=a, b=b: bool(probe.cuda.can_device_access_peer(a.index, b.index))
        )
        for a, b in pairs
    }
    nvml_rows: dict[tuple[int, int], dict[str, Any]] = {}
    if probe.nvml_error is None:
        with nvml_session(probe.nvml) as nv:
            # torch's indices follow CUDA_VISIBLE_DEVICES, NVML's do not: match by UUID.
            handles = {
                g.index: _na(lambda g=g: nv.nvmlDeviceGetHandleByUUID(g.uuid)) if g.uuid else None
                for g in gpus
            }
            buses = {
                i: (_na(lambda h=h: _text(nv.nvmlDeviceGetPciInfo(h).busId).lower()) if h else None)
                for i, h in handles.items()
            }
            links = {i: (_nvlinks(nv, h) if h else []) for i, h in handles.items()}
            # nvidia-ml-py defines NVML_P2P_CAPS_INDEX_READ = 0, (a stray comma: a tuple), and
            # ctypes rejects a tuple argument; the C enum value is 0.
            read = getattr(nv, "NVML_P2P_CAPS_INDEX_READ", 0)
            read = read[0] if isinstance(read, tuple) else read
            for a, b in pairs:
                ha, hb = handles[a.index], handles[b.index]
                if ha is None or hb is None:
                    continue
                status = _na(lambda ha=ha, hb=hb: nv.nvmlDeviceGetP2PStatus(ha, hb, read))
                topo = _na(lambda ha=ha, hb=hb: nv.nvmlDeviceGetTopologyCommonAncestor(ha, hb))
                nvml_rows[(a.index, b.index)] = {
                    "p2p_read": None if status is None else status == nv.NVML_P2P_STATUS_OK,
                    "topology": _TOPOLOGY.get(topo, f"level {topo}") if topo is not None else None,
                    "nvlink": _pair_links(nv, a.index, b.index, links, buses) or None,
                }
    lines, data, blocked = [], [], []
    for a, b in pairs:
        key = (a.index, b.index)
        row = {"gpus": list(key), "peer_access": peer[key], **nvml_rows.get(key, {})}
        data.append(row)
        p2p = row.get("p2p_read")
        if p2p is None:  # NVML could not say: torch's peer-access answer is the next best
            p2p = peer[key]
        if p2p is False:
            blocked.append(key)
        p2p_text = {True: "P2P ok", False: "no P2P", None: "P2P N/A"}[p2p]
        parts = [p2p_text, row.get("nvlink") or "no NVLink seen", row.get("topology") or ""]
        lines.append(f"GPU {a.index} ↔ GPU {b.index}: " + ", ".join(p for p in parts if p))
    if "NCCL_P2P_DISABLE" in os.environ:
        lines.append(f"NCCL_P2P_DISABLE={os.environ['NCCL_P2P_DISABLE']} is set")
    if blocked:
        return _warning(
            "\n".join(lines),
            "without peer-to-peer access NCCL routes those pairs through host memory (slower): "
            "see `nvidia-smi topo -m`; in VMs and on some PCIe boards P2P is disabled (IOMMU/ACS)",
            pairs=data,
        )
    return _ok("\n".join(lines), pairs=data)


def check_cpu(probe: Probe) -> Check:
    cpu = hardware.cpu_info()
    data = {
        "model": cpu.model_name,
        "usable_cores": cpu.usable_cores,
        "logical_cores": cpu.logical_cores,
        "physical_cores": cpu.physical_cores,
        "flags": list(cpu.flags),
    }
    if cpu.usable_cores is None:
        return _warning(f"{cpu}: usable cores N/A", "check os.sched_getaffinity", **data)
    notes = []
    if cpu.has("amx_bf16") or cpu.has("avx512_bf16"):
        notes.append("bf16 runs natively on this CPU (AMX or AVX512-BF16)")
    detail = "\n".join([str(cpu), *notes])
    if cpu.usable_cores < 2:
        return _warning(
            detail + "\nthe multi-process labs start 2 or more ranks: they share one core here",
            "give the machine or container 2 or more CPUs; the labs still run, slowly",
            **data,
        )
    return _ok(detail, **data)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_memory(probe: Probe) -> Check:
    vm = psutil.virtual_memory()
    data = {"total_bytes": vm.total, "available_bytes": vm.available}
    detail = f"{_gib(vm.available)} available of {_gib(vm.total)}"
    if vm.available < LOW_MEMORY_BYTES:
        return _warning(
            f"{detail}: below {_gib(LOW_MEMORY_BYTES)}, and every rank of a job holds its own "
            "model, gradients and optimizer state",
            "close other programs; LABKIT_SIZE=smoke runs the labs at a small size",
            **data,
        )
    return _ok(detail, **data)


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (labkit's home may not exist yet)."""
    for p in (path, *path.parents):
        if p.exists():
            return p
    return Path(path.anchor or ".")


_NOT_A_FOLDER = "it is a file, not a folder"


def _cannot_write(folder: Path) -> str | None:
    """None if a file can be created and deleted in ``folder``, else the error, in words.

    A real file, not ``os.access``: root passes every mode-bit check, yet a read-only mount,
    a file in the way or a filesystem that takes no new files still stop it.
    """
    try:
        fd, name = tempfile.mkstemp(prefix=".labkit-doctor-", dir=folder)
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    os.close(fd)
    try:
        os.unlink(name)
    except OSError as e:
        return f"created {name} but cannot delete it: {type(e).__name__}: {e.strerror or e}"
    return None


def _unwritable_places() -> list[dict[str, str]]:
    """The folders under the labkit home that a job writes to and this user cannot.

    A folder not made yet is probed in its nearest existing parent, where labkit would make
    it; the registry and runs folders are probed too when they exist (made once with `sudo`,
    they belong to root however writable the home is).
    """
    home = procs.labkit_home()
    found, seen = [], set()
    for path in (home, procs.registry_dir(), procs.default_runs_dir()):
        where = _existing(path)
        if where in seen:
            continue
        seen.add(where)
        if where.exists() and not where.is_dir():
            found.append({"path": str(where), "for": str(path), "error": _NOT_A_FOLDER})
        elif (error := _cannot_write(where)) is not None:
            found.append({"path": str(where), "for": str(path), "error": error})
    return found


def check_disk(probe: Probe) -> Check:
    places = {"labkit home (job logs)": launch.labkit_home(), "course folder": _repo_root()}
    seen, lines, data = set(), [], []
    lowest = None
    for what, path in places.items():
        where = _existing(path)
        usage = shutil.disk_usage(where)
        dev = where.stat().st_dev
        data.append({"place": what, "path": str(path), "free_bytes": usage.free})
        if dev in seen:
            continue  # same filesystem as a place already listed
        seen.add(dev)
        lines.append(f"{_gib(usage.free)} free for the {what}, {path}")
        lowest = usage.free if lowest is None else min(lowest, usage.free)
    fix = "free space there, or set LABKIT_HOME to a folder on a disk with room"
    detail = "\n".join(lines)
    unwritable = _unwritable_places()
    if unwritable:
        # Free space means nothing where no file can be created: jobs fail at their first log.
        why = []
        for u in unwritable:
            line = f"cannot create a file in {u['path']}: {u['error']}"
            why.append(line if u["path"] == u["for"] else f"{line} (labkit makes {u['for']} there)")
        named = unwritable[0]["path"]
        remedy = (
            f"move the file {named} out of the way (labkit needs a folder there)"
            if unwritable[0]["error"] == _NOT_A_FOLDER
            else f"make {named} writable for your user (`ls -ld {named}` shows its owner and "
            "mode; a folder made once with `sudo` belongs to root)"
        )
        return _fail(
            "\n".join([*why, "jobs cannot write their logs", *lines]),
            f"{remedy}, or set LABKIT_HOME to a folder you can write, e.g. "
            "`export LABKIT_HOME=$HOME/labkit-cache`",
            places=data,
            unwritable=unwritable,
        )
    if lowest is not None and lowest < FULL_DISK_BYTES:
        return _fail(detail + "\njobs cannot write their logs", fix, places=data, unwritable=[])
    if lowest is not None and lowest < LOW_DISK_BYTES:
        return _warning(detail + f"\nbelow {_gib(LOW_DISK_BYTES)}", fix, places=data,
                        unwritable=[])  # fmt: skip
    return _ok(detail, places=data, unwritable=[])


def check_allreduce(probe: Probe) -> Check:
    if not probe.allreduce:
        return _info("skipped (--no-allreduce)")
    nproc = probe.nproc
    # NCCL needs one GPU per rank; with fewer GPUs than ranks the job runs over gloo on the CPU.
    on_gpu = probe.cuda_available and probe.usable_gpu_count >= nproc
    device = "cuda" if on_gpu else "cpu"
    numel = ALLREDUCE_NUMEL[device]
    try:
        res = launch.run(
            "labkit.workers.allreduce",
            nproc=nproc,
            # the doctor asks whether the ranks connect and agree: no link probe, no wire count
            config={"numel": numel, "repeats": ALLREDUCE_REPEATS, "probe": False, "wire": False},
            timeout_s=probe.timeout_s,
            device="auto" if on_gpu else "cpu",
            stream=False,
        )
    except launch.LaunchError as e:  # no port, a full or unwritable disk: it says which
        return _fail(f"the {nproc}-rank job could not start: {_first_line(e)}",
                     "do what the message says, then run the doctor again")  # fmt: skip
    except launch.JobTimeout as e:
        return _fail(
            f"the {nproc}-rank job did not finish in {probe.timeout_s:g} s: {_first_line(e)}",
            "the machine may be overloaded (see CPU cores and memory), or something blocks "
            f"localhost ports; rank logs are in {e.result.log_dir}",
            log_dir=str(e.result.log_dir),
        )
    except launch.JobError as e:
        return _fail(
            f"the {nproc}-rank job failed: {_first_line(e)}",
            "run `python -m labkit cleanup` (ends leftovers of earlier jobs) and try again; if "
            "the ranks cannot connect, set GLOO_SOCKET_IFNAME=lo (CPU) or NCCL_DEBUG=INFO "
            f"(GPU) to see why; rank logs are in {e.result.log_dir}",
            log_dir=str(e.result.log_dir),
        )
    ranks = res.ranks
    wrong = [r for r, out in enumerate(ranks) if out.get("value") != out.get("expected")]
    if wrong or len(ranks) != nproc:
        return _fail(
            f"the all-reduce returned a wrong sum on rank(s) {wrong or 'N/A'}",
            f"this should not happen: report it with the logs in {res.log_dir}",
            log_dir=str(res.log_dir),
        )
    r0 = res.rank(0)
    busbw = float(r0["busbw_GBps"])
    data = {
        "nproc": nproc,
        "backend": res.backend,
        "device": res.device,
        "message_bytes": r0["message_bytes"],
        "repeats": r0["repeats"],
        "median_s": r0["median_s"],
        "algbw_GBps": r0["algbw_GBps"],
        "busbw_GBps": busbw,
        "wall_s": res.wall_s,
        "measured": True,
    }
    detail = (
        f"{nproc} ranks over {res.backend} ({res.device}): the sum is right on every rank; "
        f"busbw {busbw:.3g} GB/s measured (median of {r0['repeats']} all-reduces of "
        f"{r0['message_bytes'] / 2**20:.3g} MiB); job {res.wall_s:.1f} s"
    )
    if res.backend == "gloo":
        detail += "\ngloo on one host moves bytes through memory and loopback: not a GPU link"
    if not (math.isfinite(busbw) and busbw > 0):
        return _fail(detail, f"a bandwidth of {busbw} is a bug: report it ({res.log_dir})", **data)
    return _ok(detail, **data)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def check_jupyterlab(probe: Probe) -> Check:
    version = _dist_version("jupyterlab")
    if version is None:
        pin = tested_pin("jupyterlab")
        return _fail(
            "JupyterLab is not installed in this environment: the course runs in it",
            _FIX_REQUIREMENTS + (f" (jupyterlab=={pin})" if pin else ""),
        )
    overrides = Path(sys.prefix) / "share/jupyter/lab/settings/overrides.json"
    news_off = overrides.is_file() and '"fetchNews"' in overrides.read_text(errors="replace")
    detail = f"JupyterLab {version}; news pop-up " + (
        f"off ({overrides})" if news_off else "not turned off (`./course setup` turns it off)"
    )
    data = {"version": version, "news_off": news_off}
    if _version_tuple(version) < TESTED_JUPYTERLAB:
        return _warning(
            f"{detail}: older than {'.'.join(map(str, TESTED_JUPYTERLAB))}, the oldest tested",
            _FIX_REQUIREMENTS,
            **data,
        )
    return _ok(detail, **data)


WIDGETS_EXTENSION = "@jupyter-widgets/jupyterlab-manager"


def _labextension_dirs() -> list[Path]:
    """Where JupyterLab looks for prebuilt extensions (jupyter --paths, "data" + labextensions)."""
    try:
        from jupyter_core.paths import jupyter_path

        return [Path(p) for p in jupyter_path("labextensions")]
    except ImportError:
        return [Path(sys.prefix) / "share/jupyter/labextensions"]


def check_widgets_extension(probe: Probe) -> Check:
    package = _dist_version("jupyterlab_widgets")
    for folder in _labextension_dirs():
        manifest = folder / WIDGETS_EXTENSION / "package.json"
        if manifest.is_file():
            ext_version = _na(lambda m=manifest: json.loads(m.read_text())["version"])
            return _ok(
                f"{WIDGETS_EXTENSION} {ext_version or 'N/A'} (jupyterlab_widgets "
                f"{package or 'N/A'}) in {folder}",
                package=package,
                extension=ext_version,
                path=str(manifest.parent),
            )
    return _fail(
        f"the widgets extension {WIDGETS_EXTENSION} is not installed in JupyterLab"
        + (f" (jupyterlab_widgets {package} is, elsewhere)" if package else "")
        + ": quizzes show as text and live plots do not update",
        "pip install jupyterlab_widgets (ipywidgets pulls it in), then restart JupyterLab; "
        "or " + _FIX_REQUIREMENTS,
        package=package,
    )


# ipywidgets and the JupyterLab extension speak a protocol per major version: a mismatch shows
# "Error displaying widget: model not found" in place of every widget.
_WIDGETS_PAIRS = {8: 3, 7: 1}  # ipywidgets major -> jupyterlab_widgets major


def check_ipywidgets(probe: Probe) -> Check:
    version = _dist_version("ipywidgets")
    if version is None:
        return _fail("ipywidgets is not installed: the quizzes show as text", _FIX_REQUIREMENTS)
    ext = _dist_version("jupyterlab_widgets")
    major = _version_tuple(version)[:1]
    want = _WIDGETS_PAIRS.get(major[0]) if major else None
    data = {"version": version, "jupyterlab_widgets": ext}
    if ext and want is not None and _version_tuple(ext)[:1] != (want,):
        return _fail(
            f"ipywidgets {version} needs jupyterlab_widgets {want}.x, found {ext}: widgets "
            "would show 'Error displaying widget'",
            _FIX_REQUIREMENTS,
            **data,
        )
    return _ok(f"ipywidgets {version}", **data)


def check_matplotlib(probe: Probe) -> Check:
    version = _dist_version("matplotlib")
    if version is None:
        return _fail("matplotlib is not installed: no plots", _FIX_REQUIREMENTS)
    import matplotlib

    try:  # matplotlib >= 3.10: read the backend without resolving "auto" (which imports a GUI)
        backend = matplotlib.get_backend(auto_select=False)  # type: ignore[call-arg]
    except TypeError:
        backend = matplotlib.get_backend()
    shown = backend or "not chosen yet (picked at the first plot; inline in a notebook)"
    return _ok(f"matplotlib {version}, backend {shown}", version=version, backend=backend)


# ----------------------------------------------------------------------------------------------
# Running them

# (item, function name). Functions are looked up by name when the checks run, so a test (or a
# course variant) can replace one with monkeypatch.
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
            f"the check itself raised {type(e).__name__}: {_first_line(e)}",
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
