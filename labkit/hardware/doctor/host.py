"""The doctor's checks of the host: Python and torch versions, CPU cores, memory, disk (free
and writable), a real multi-process all-reduce, and JupyterLab with its widgets and plots.

Apart from the GPU stack's checks (:mod:`labkit.hardware.doctor.gpu`) because these hold on
every tier: a laptop without a GPU fails here only when a lab would really break. The
all-reduce is a real job (``labkit.jobs.launch``) whose bandwidth is measured, not estimated,
which is why this module sits above the jobs in the layer map. Each check takes the
:class:`~labkit.hardware.doctor.probe.Probe` and returns a ``Check``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import psutil
import torch

from labkit import hardware
from labkit.hardware.doctor.probe import (
    FIX_REQUIREMENTS,
    Probe,
    dist_version,
    repo_root,
    tested_pin,
    version_tuple,
)
from labkit.hardware.doctor.report import Check, fail, first_line, info, ok, warning
from labkit.hardware.nvml import field_or_na
from labkit.jobs import launch, procs

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


def check_python(probe: Probe) -> Check:
    version = platform.python_version()
    detail = f"{version} ({platform.python_implementation()}, {sys.executable})"
    if sys.version_info[:2] < MIN_PYTHON:
        need = ".".join(map(str, MIN_PYTHON))
        return fail(
            f"{detail}: the course needs Python >= {need}",
            f"install Python {need} or newer and run `PYTHON=/path/to/python3 ./course setup`",
            version=version,
        )
    return ok(detail, version=version, executable=sys.executable)


def check_torch(probe: Probe, *, requirements: Path | None = None) -> Check:
    version = torch.__version__
    base = version.split("+")[0]
    pin = tested_pin("torch", requirements)
    data = {"version": version, "tested": pin}
    if version_tuple(base) < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        return fail(
            f"torch {version} is older than {need}, the oldest labkit supports",
            FIX_REQUIREMENTS + (f" (torch=={pin})" if pin else ""),
            **data,
        )
    if pin is None:
        return ok(f"torch {version} (no requirements.txt beside labkit to compare with)", **data)
    if base == pin.split("+")[0]:
        return ok(f"torch {version}, the tested version", **data)
    return warning(
        f"torch {version}; the course is tested with {pin}: results and APIs may differ",
        f"{FIX_REQUIREMENTS}; on a GPU machine keeping its own CUDA torch this warning is "
        "expected (README, 'GPU machines')",
        **data,
    )


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
        return warning(f"{cpu}: usable cores N/A", "check os.sched_getaffinity", **data)
    notes = []
    if cpu.has("amx_bf16") or cpu.has("avx512_bf16"):
        notes.append("bf16 runs natively on this CPU (AMX or AVX512-BF16)")
    detail = "\n".join([str(cpu), *notes])
    if cpu.usable_cores < 2:
        return warning(
            detail + "\nthe multi-process labs start 2 or more ranks: they share one core here",
            "give the machine or container 2 or more CPUs; the labs still run, slowly",
            **data,
        )
    return ok(detail, **data)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_memory(probe: Probe) -> Check:
    vm = psutil.virtual_memory()
    data = {"total_bytes": vm.total, "available_bytes": vm.available}
    detail = f"{_gib(vm.available)} available of {_gib(vm.total)}"
    if vm.available < LOW_MEMORY_BYTES:
        return warning(
            f"{detail}: below {_gib(LOW_MEMORY_BYTES)}, and every rank of a job holds its own "
            "model, gradients and optimizer state",
            "close other programs; LABKIT_SIZE=smoke runs the labs at a small size",
            **data,
        )
    return ok(detail, **data)


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
    places = {"labkit home (job logs)": launch.labkit_home(), "course folder": repo_root()}
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
        return fail(
            "\n".join([*why, "jobs cannot write their logs", *lines]),
            f"{remedy}, or set LABKIT_HOME to a folder you can write, e.g. "
            "`export LABKIT_HOME=$HOME/labkit-cache`",
            places=data,
            unwritable=unwritable,
        )
    if lowest is not None and lowest < FULL_DISK_BYTES:
        return fail(detail + "\njobs cannot write their logs", fix, places=data, unwritable=[])
    if lowest is not None and lowest < LOW_DISK_BYTES:
        return warning(detail + f"\nbelow {_gib(LOW_DISK_BYTES)}", fix, places=data,
                        unwritable=[])  # fmt: skip
    return ok(detail, places=data, unwritable=[])


def check_allreduce(probe: Probe) -> Check:
    if not probe.allreduce:
        return info("skipped (--no-allreduce)")
    nproc = probe.nproc
    # NCCL needs one GPU per rank; with fewer GPUs than ranks the job runs over gloo on the CPU.
    on_gpu = probe.cuda_available and probe.usable_gpu_count >= nproc
    device = "cuda" if on_gpu else "cpu"
    numel = ALLREDUCE_NUMEL[device]
    # Imported here, not at the top: the worker brings torch.distributed, and the doctor's
    # other checks must still run (and say why) on a machine where that cannot import.
    from labkit.workers.allreduce import AllReduceConfig

    try:
        res = launch.run(
            # the doctor asks whether the ranks connect and agree: no link probe, no wire count
            AllReduceConfig(numel=numel, repeats=ALLREDUCE_REPEATS, probe=False, wire=False),
            nproc=nproc,
            timeout_s=probe.timeout_s,
            device="auto" if on_gpu else "cpu",
            stream=False,
        )
    except launch.LaunchError as e:  # no port, a full or unwritable disk: it says which
        return fail(f"the {nproc}-rank job could not start: {first_line(e)}",
                     "do what the message says, then run the doctor again")  # fmt: skip
    except launch.JobTimeout as e:
        return fail(
            f"the {nproc}-rank job did not finish in {probe.timeout_s:g} s: {first_line(e)}",
            "the machine may be overloaded (see CPU cores and memory), or something blocks "
            f"localhost ports; rank logs are in {e.result.log_dir}",
            log_dir=str(e.result.log_dir),
        )
    except launch.JobError as e:
        return fail(
            f"the {nproc}-rank job failed: {first_line(e)}",
            "run `python -m labkit cleanup` (ends leftovers of earlier jobs) and try again; if "
            "the ranks cannot connect, set GLOO_SOCKET_IFNAME=lo (CPU) or NCCL_DEBUG=INFO "
            f"(GPU) to see why; rank logs are in {e.result.log_dir}",
            log_dir=str(e.result.log_dir),
        )
    ranks = res.ranks
    wrong = [r for r, out in enumerate(ranks) if out.get("value") != out.get("expected")]
    if wrong or len(ranks) != nproc:
        return fail(
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
        return fail(detail, f"a bandwidth of {busbw} is a bug: report it ({res.log_dir})", **data)
    return ok(detail, **data)


def check_jupyterlab(probe: Probe) -> Check:
    version = dist_version("jupyterlab")
    if version is None:
        pin = tested_pin("jupyterlab")
        return fail(
            "JupyterLab is not installed in this environment: the course runs in it",
            FIX_REQUIREMENTS + (f" (jupyterlab=={pin})" if pin else ""),
        )
    overrides = Path(sys.prefix) / "share/jupyter/lab/settings/overrides.json"
    news_off = overrides.is_file() and '"fetchNews"' in overrides.read_text(errors="replace")
    detail = f"JupyterLab {version}; news pop-up " + (
        f"off ({overrides})" if news_off else "not turned off (`./course setup` turns it off)"
    )
    data = {"version": version, "news_off": news_off}
    if version_tuple(version) < TESTED_JUPYTERLAB:
        return warning(
            f"{detail}: older than {'.'.join(map(str, TESTED_JUPYTERLAB))}, the oldest tested",
            FIX_REQUIREMENTS,
            **data,
        )
    return ok(detail, **data)


WIDGETS_EXTENSION = "@jupyter-widgets/jupyterlab-manager"


def _labextension_dirs() -> list[Path]:
    """Where JupyterLab looks for prebuilt extensions (jupyter --paths, "data" + labextensions)."""
    try:
        from jupyter_core.paths import jupyter_path

        return [Path(p) for p in jupyter_path("labextensions")]
    except ImportError:
        return [Path(sys.prefix) / "share/jupyter/labextensions"]


def check_widgets_extension(probe: Probe) -> Check:
    package = dist_version("jupyterlab_widgets")
    for folder in _labextension_dirs():
        manifest = folder / WIDGETS_EXTENSION / "package.json"
        if manifest.is_file():
            ext_version = field_or_na(lambda m=manifest: json.loads(m.read_text())["version"])
            return ok(
                f"{WIDGETS_EXTENSION} {ext_version or 'N/A'} (jupyterlab_widgets "
                f"{package or 'N/A'}) in {folder}",
                package=package,
                extension=ext_version,
                path=str(manifest.parent),
            )
    return fail(
        f"the widgets extension {WIDGETS_EXTENSION} is not installed in JupyterLab"
        + (f" (jupyterlab_widgets {package} is, elsewhere)" if package else "")
        + ": quizzes show as text and live plots do not update",
        "pip install jupyterlab_widgets (ipywidgets pulls it in), then restart JupyterLab; "
        "or " + FIX_REQUIREMENTS,
        package=package,
    )


# ipywidgets and the JupyterLab extension speak a protocol per major version: a mismatch shows
# "Error displaying widget: model not found" in place of every widget.
_WIDGETS_PAIRS = {8: 3, 7: 1}  # ipywidgets major -> jupyterlab_widgets major


def check_ipywidgets(probe: Probe) -> Check:
    version = dist_version("ipywidgets")
    if version is None:
        return fail("ipywidgets is not installed: the quizzes show as text", FIX_REQUIREMENTS)
    ext = dist_version("jupyterlab_widgets")
    major = version_tuple(version)[:1]
    want = _WIDGETS_PAIRS.get(major[0]) if major else None
    data = {"version": version, "jupyterlab_widgets": ext}
    if ext and want is not None and version_tuple(ext)[:1] != (want,):
        return fail(
            f"ipywidgets {version} needs jupyterlab_widgets {want}.x, found {ext}: widgets "
            "would show 'Error displaying widget'",
            FIX_REQUIREMENTS,
            **data,
        )
    return ok(f"ipywidgets {version}", **data)


def check_matplotlib(probe: Probe) -> Check:
    version = dist_version("matplotlib")
    if version is None:
        return fail("matplotlib is not installed: no plots", FIX_REQUIREMENTS)
    import matplotlib

    try:  # matplotlib >= 3.10: read the backend without resolving "auto" (which imports a GUI)
        backend = matplotlib.get_backend(auto_select=False)  # type: ignore[call-arg]
    except TypeError:
        backend = matplotlib.get_backend()
    shown = backend or "not chosen yet (picked at the first plot; inline in a notebook)"
    return ok(f"matplotlib {version}, backend {shown}", version=version, backend=backend)
