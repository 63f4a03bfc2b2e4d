"""The doctor's checks of the GPU stack: torch's build, the CUDA runtime, cuDNN, NCCL, the
NVIDIA driver, NVML, the GPUs themselves, who else holds them, and how they are linked.

Apart from the host's checks (:mod:`labkit.hardware.doctor.host`) because these read the
driver (through :mod:`labkit.hardware.nvml`) and ``torch.cuda``, and on a machine without an
NVIDIA GPU most of them say "not applicable" rather than fail: the course runs in the CPU tier
there. Each takes the :class:`~labkit.hardware.doctor.probe.Probe` and returns a ``Check``; a
value that cannot be read is N/A, never filled in.
"""

from __future__ import annotations

import os
import re
from typing import Any

import psutil
import torch

from labkit import hardware
from labkit.hardware.doctor.probe import FIX_CUDA_TORCH, FIX_REQUIREMENTS, Probe, version_tuple
from labkit.hardware.doctor.report import Check, fail, info, ok, warning
from labkit.hardware.nvml import cuda_driver_text, field_or_na, nvml_session, nvml_text

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


def check_torch_build(probe: Probe) -> Check:
    cuda_version = torch.version.cuda
    hip = getattr(torch.version, "hip", None)
    if hip:
        return warning(
            f"ROCm build (HIP {hip}): the course targets NVIDIA GPUs, NCCL and NVML",
            "expect the GPU labs to differ; the CPU tier works the same everywhere",
            build="rocm",
        )
    seen = probe.nvml_gpu_count
    if cuda_version is None:
        if seen:
            return warning(
                f"CPU-only build, but the NVIDIA driver sees {seen} GPU(s) that this torch "
                "cannot use: the course runs in the CPU tier",
                FIX_CUDA_TORCH,
                build="cpu",
                nvml_gpus=seen,
            )
        return ok("CPU-only build: the course runs in the CPU tier", build="cpu")
    if probe.cuda_available:
        n = probe.usable_gpu_count
        return ok(f"CUDA {cuda_version} build; {n} GPU(s) usable", build="cuda", gpus=n)
    if seen:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return fail(
            f"CUDA {cuda_version} build, but torch cannot use the {seen} GPU(s) the driver sees",
            "the driver may be too old for this build's CUDA (see 'NVIDIA driver' below): "
            "update it, or install a torch built for the CUDA version the driver supports"
            + (f"; also check CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""),
            build="cuda",
            nvml_gpus=seen,
        )
    return ok(
        f"CUDA {cuda_version} build, no NVIDIA GPU here: the course runs in the CPU tier",
        build="cuda",
        gpus=0,
    )


_NOT_ON_CPU = "not applicable on the CPU tier (torch can use no CUDA GPU here)"


def check_cuda_runtime(probe: Probe) -> Check:
    if not probe.cuda_available:
        return info(_NOT_ON_CPU)
    return ok(f"CUDA runtime {torch.version.cuda} (ships with torch)", version=torch.version.cuda)


def _cudnn_text(v: int) -> str:
    # cuDNN 9 encodes major*10000 + minor*100 + patch (90100 = 9.1.0); cuDNN 8 and older,
    # major*1000 + minor*100 + patch (8902 = 8.9.2). See cudnn.h, CUDNN_VERSION.
    major, rest = (v // 10000, v % 10000) if v >= 10000 else (v // 1000, v % 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def check_cudnn(probe: Probe) -> Check:
    if not probe.cuda_available:
        return info(_NOT_ON_CPU)
    v = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if v is None:
        return warning(
            "cuDNN is not available to torch (transformers run without it; torch's cuDNN "
            "attention backend is then unused)",
            "reinstall torch from the official wheels, which bundle cuDNN",
        )
    return ok(f"cuDNN {_cudnn_text(int(v))}", version=_cudnn_text(int(v)))


def check_nccl(probe: Probe) -> Check:
    if not probe.cuda_available:
        return info(_NOT_ON_CPU + "; multi-process labs use gloo")
    import torch.distributed as tdist

    if not tdist.is_available() or not tdist.is_nccl_available():
        gpus = probe.usable_gpu_count
        detail = "this torch build has no NCCL: multi-GPU jobs cannot use NCCL"
        fix = "install an official Linux CUDA wheel of torch, which includes NCCL"
        return fail(detail, fix) if gpus >= 2 else warning(detail + " (1 GPU: unused)", fix)
    v = torch.cuda.nccl.version()
    text = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return ok(f"NCCL {text}", version=text)


def check_driver(probe: Probe) -> Check:
    err = probe.nvml_error
    if err is None:
        with nvml_session(probe.nvml) as nv:
            driver = nvml_text(nv.nvmlSystemGetDriverVersion())
            cuda_drv = field_or_na(nv.nvmlSystemGetCudaDriverVersion)
        data: dict[str, Any] = {"version": driver}
        detail = f"NVIDIA driver {driver}"
        if cuda_drv is None:
            return ok(detail + " (its CUDA version: N/A)", **data)
        data["cuda"] = supports = cuda_driver_text(int(cuda_drv))
        detail += f", supports CUDA up to {supports}"
        runtime = torch.version.cuda
        if runtime and version_tuple(runtime)[:1] > version_tuple(supports)[:1]:
            return fail(
                f"{detail}, but torch is built for CUDA {runtime}",
                f"update the driver to one for CUDA {runtime}, or install a torch built for "
                f"CUDA {supports}",
                **data,
            )
        if runtime and version_tuple(runtime) > version_tuple(supports):
            # Same major version: CUDA's minor-version compatibility runs it on this driver.
            detail += f" (torch's CUDA {runtime} runs on it by minor-version compatibility)"
        return ok(detail, **data)
    if err == "not-installed":
        return warning(
            "driver version unknown: nvidia-ml-py (NVML's Python binding) is not installed",
            FIX_REQUIREMENTS,
        )
    if err == "NVMLError_LibraryNotFound" and not probe.cuda_available:
        return info("no NVIDIA driver: the course runs in the CPU tier")
    return warning(
        f"driver version unknown: NVML says {err}",
        _NVML_FIXES.get(err, "check `nvidia-smi`; it reports driver problems in words"),
        error=err,
    )


def check_nvml(probe: Probe) -> Check:
    err = probe.nvml_error
    status = hardware.nvml_status(probe.nvml) if probe.nvml is not None else None
    if err is None and status is not None and status.ok:
        return ok(f"{status.message}: live GPU metrics are measured", gpus=probe.nvml_gpu_count)
    message = status.message if status is not None else "nvidia-ml-py is not installed"
    if err == "NVMLError_LibraryNotFound" and not probe.cuda_available:
        return info(
            f"{message}. Live metrics show the CPU and the job's processes instead",
            error=err,
        )
    return warning(
        f"{message}: no GPU telemetry (utilisation, memory, power) in the live metrics",
        FIX_REQUIREMENTS
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
        return info("no NVIDIA GPU: the course runs in the CPU tier", **data)
    lines = [str(g) for g in gpus]
    if not probe.cuda_available:
        return warning(
            "\n".join([f"{len(gpus)} GPU(s) seen by the driver, none usable by torch:", *lines]),
            FIX_CUDA_TORCH,
            **data,
        )
    arch_list = list(field_or_na(probe.cuda.get_arch_list) or [])
    no_kernels = [
        g
        for g in gpus
        if arch_list
        and g.compute_capability
        and not _arch_supported(g.compute_capability, arch_list)
    ]
    if no_kernels:
        names = ", ".join(f"GPU {g.index} ({g.name}, {g.compute_capability})" for g in no_kernels)
        return fail(
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
        return warning(
            "\n".join([f"tier {tier}", *lines, "compute capability < 7.0: no tensor cores"]),
            "the mixed-precision and MFU labs assume tensor cores (7.0+, bf16 from 8.0): "
            "use a newer GPU for them",
            **data,
        )
    notes = []
    if any(g.compute_capability and g.compute_capability < (8, 0) for g in gpus):
        notes.append("bf16 needs compute capability 8.0: on this GPU the precision labs use fp16")
    return ok("\n".join([f"tier {tier}", *lines, *notes]), **data)


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
        for p in field_or_na(lambda fn=fn: getattr(nv, fn)(handle)) or []:
            used = getattr(p, "usedGpuMemory", None)
            found.setdefault(int(p.pid), None if used is None else int(used))
    return sorted(found.items())


def check_gpu_sharing(probe: Probe) -> Check:
    """Do processes other than this one already hold the GPUs this process would use?"""
    visible_env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if probe.nvml_error is not None:
        return info(
            f"N/A: NVML cannot be read here ({probe.nvml_error}), so there is no GPU process "
            "list to check",
            nvml_error=probe.nvml_error,
        )
    me = os.getpid()
    with nvml_session(probe.nvml) as nv:
        everyone, _ = hardware.visible_gpus(nv, None)
        mine, notes = hardware.visible_gpus(nv)
        names = {g.index: nvml_text(field_or_na(lambda h=g.handle: nv.nvmlDeviceGetName(h))
                                    or "N/A") for g in everyone}  # fmt: skip
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
        return info("\n".join([f"{why}: this process would use none, so none is shared", *notes]),
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
        return ok("\n".join([f"{which}; no other process holds {used_here}", *notes]), **data)
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
    return warning("\n".join([head, *lines, *notes]), fix, **data)


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
        bus = field_or_na(
            lambda link=link: nvml_text(nv.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
        )
        kind = field_or_na(lambda link=link: nv.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link))
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
        return info(f"not applicable: needs 2 or more usable GPUs (this machine: {len(gpus)})")
    pairs = [(a, b) for n, a in enumerate(gpus) for b in gpus[n + 1 :]]
    peer = {
        (a.index, b.index): field_or_na(
            lambda a=a, b=b: bool(probe.cuda.can_device_access_peer(a.index, b.index))
        )
        for a, b in pairs
    }
    nvml_rows: dict[tuple[int, int], dict[str, Any]] = {}
    if probe.nvml_error is None:
        with nvml_session(probe.nvml) as nv:
            # torch's indices follow CUDA_VISIBLE_DEVICES, NVML's do not: match by UUID.
            handles = {
                g.index: (field_or_na(lambda g=g: nv.nvmlDeviceGetHandleByUUID(g.uuid))
                          if g.uuid else None)
                for g in gpus
            }  # fmt: skip
            buses = {
                i: (field_or_na(lambda h=h: nvml_text(nv.nvmlDeviceGetPciInfo(h).busId).lower())
                    if h else None)
                for i, h in handles.items()
            }  # fmt: skip
            links = {i: (_nvlinks(nv, h) if h else []) for i, h in handles.items()}
            # nvidia-ml-py defines NVML_P2P_CAPS_INDEX_READ = 0, (a stray comma: a tuple), and
            # ctypes rejects a tuple argument; the C enum value is 0.
            read = getattr(nv, "NVML_P2P_CAPS_INDEX_READ", 0)
            read = read[0] if isinstance(read, tuple) else read
            for a, b in pairs:
                ha, hb = handles[a.index], handles[b.index]
                if ha is None or hb is None:
                    continue
                status = field_or_na(lambda ha=ha, hb=hb: nv.nvmlDeviceGetP2PStatus(ha, hb, read))
                topo = field_or_na(
                    lambda ha=ha, hb=hb: nv.nvmlDeviceGetTopologyCommonAncestor(ha, hb)
                )
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
        return warning(
            "\n".join(lines),
            "without peer-to-peer access NCCL routes those pairs through host memory (slower): "
            "see `nvidia-smi topo -m`; in VMs and on some PCIe boards P2P is disabled (IOMMU/ACS)",
            pairs=data,
        )
    return ok("\n".join(lines), pairs=data)

