"""Which GPUs a process may use, as NVML knows them: ``CUDA_VISIBLE_DEVICES`` (integers, UUIDs,
MIG instances) mapped onto NVML's indices. The one place that mapping is done.

Apart from GPU detection because NVML ignores ``CUDA_VISIBLE_DEVICES``: it enumerates every
GPU on the machine, so whatever names or samples a GPU through NVML (``gpu_info``, the metric
collector, the doctor's GPU-sharing check) must go through here to stay on the GPUs the learner
was given. Pure functions of an NVML module passed in: no torch, no CUDA.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from labkit.hardware.nvml import nvml_text


def normalise_uuid(uuid: Any) -> str | None:
    """A GPU UUID as nvidia-smi prints it ("GPU-…" or "MIG-…"), whichever API reported it."""
    if uuid is None:
        return None
    value = nvml_text(uuid)
    # torch prints the bare UUID; NVML and nvidia-smi prefix it with "GPU-" (or "MIG-")
    return value if value.startswith(("GPU-", "MIG-")) else f"GPU-{value}"


_FROM_ENV: Any = object()  # visible_gpus' default: read CUDA_VISIBLE_DEVICES


class VisibleGpu(NamedTuple):
    """One GPU a process may use, as NVML knows it."""

    index: int  # NVML's index: nvidia-smi's numbering (PCI bus order), not CUDA's
    handle: Any  # the NVML handle of the whole GPU
    uuid: str  # "GPU-…"
    mig: str | None = None  # the "MIG-…" UUID when the entry named a MIG instance of this GPU


def parse_visible_devices(
    spec: str, uuids: Sequence[str], mig_parent: Callable[[str], int | None] | None = None
) -> tuple[list[int], list[str]]:
    """NVML indices of the GPUs a ``CUDA_VISIBLE_DEVICES`` value selects, in CUDA order.

    ``uuids`` are the NVML UUIDs by NVML index. Entries may be integers, (prefixes of) GPU
    UUIDs with or without ``GPU-``, or ``MIG-`` UUIDs, as CUDA accepts; an empty value selects
    no GPU. ``mig_parent`` maps a MIG UUID to the NVML index of its GPU (None: unknown); without
    it a MIG entry is not resolved. Like CUDA, parsing stops at the first entry that names no
    GPU. Returns (indices, notes): notes explain entries that were not used.

    Why UUIDs matter: NVML numbers GPUs by PCI bus ID and recommends looking devices up by
    PCI ID or UUID (NVML API reference, ``nvmlDeviceGetHandleByIndex``,
    https://docs.nvidia.com/deploy/nvml-api/group__nvmlDeviceQueries.html); CUDA numbers them
    fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (CUDA C++ Programming Guide,
    "CUDA Environment Variables"). The two orders agree on machines whose GPUs are all the
    same model; for an exact match pass UUIDs.
    """
    indices: list[int] = []
    notes: list[str] = []
    for raw in spec.split(","):
        token = raw.strip()
        if not token:
            break
        if token.lstrip("-").isdigit():
            i = int(token)
            if not 0 <= i < len(uuids):
                notes.append(f"CUDA_VISIBLE_DEVICES entry {token!r}: no such GPU; CUDA ignores "
                             "it and every entry after it")  # fmt: skip
                break
        elif token.startswith("MIG-"):
            parent = mig_parent(token) if mig_parent is not None else None
            if parent is None:
                notes.append(f"CUDA_VISIBLE_DEVICES entry {token!r}: a MIG instance NVML could "
                             "not place on a GPU here; not used")  # fmt: skip
                break
            notes.append(f"CUDA_VISIBLE_DEVICES entry {token!r}: a MIG instance of GPU {parent}"
                         " (nvidia-smi's index): NVML's readings and process list are the whole "
                         "GPU's")  # fmt: skip
            i = parent
        else:
            want = token if token.startswith("GPU-") else f"GPU-{token}"
            found = [k for k, u in enumerate(uuids) if u.startswith(want)]
            if len(found) != 1:
                notes.append(f"CUDA_VISIBLE_DEVICES entry {token!r}: matches {len(found)} GPUs"
                             " by UUID; CUDA ignores it and every entry after it")  # fmt: skip
                break
            i = found[0]
        if i not in indices:
            indices.append(i)
    return indices, notes


def _mig_parent(nvml: Any, uuids: Sequence[str]) -> Callable[[str], int | None]:
    def parent(mig_uuid: str) -> int | None:
        try:
            mig = nvml.nvmlDeviceGetHandleByUUID(mig_uuid)
            gpu = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
            uuid = normalise_uuid(nvml.nvmlDeviceGetUUID(gpu))
        except Exception:  # an old driver, no such instance, a test double without MIG
            return None
        return uuids.index(uuid) if uuid in uuids else None

    return parent


def visible_gpus(nvml: Any, spec: str | None = _FROM_ENV) -> tuple[list[VisibleGpu], list[str]]:
    """The GPUs a process may use, as NVML handles, in CUDA's order; and notes on entries of
    ``CUDA_VISIBLE_DEVICES`` that were not used.

    NVML ignores ``CUDA_VISIBLE_DEVICES``: it enumerates every GPU on the machine, so whatever
    names or samples a GPU through NVML must go through this mapping to stay on the GPUs the
    learner was given. ``nvml`` must be initialised (``nvmlInit``) by the caller. ``spec``:
    a ``CUDA_VISIBLE_DEVICES`` value; default: this process's, and all GPUs when it is unset;
    an empty value is no GPU, as in CUDA.
    """
    if spec is _FROM_ENV:
        spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = int(nvml.nvmlDeviceGetCount())
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    uuids = [normalise_uuid(nvml.nvmlDeviceGetUUID(h)) or "" for h in handles]
    if spec is None:
        return [VisibleGpu(i, handles[i], uuids[i]) for i in range(count)], []
    parent = _mig_parent(nvml, uuids)
    indices, notes = parse_visible_devices(spec, uuids, parent)
    mig_of: dict[int, str] = {}
    for token in (t.strip() for t in spec.split(",")):
        if token.startswith("MIG-") and (i := parent(token)) is not None:
            mig_of.setdefault(i, token)
    return [VisibleGpu(i, handles[i], uuids[i], mig_of.get(i)) for i in indices], notes

