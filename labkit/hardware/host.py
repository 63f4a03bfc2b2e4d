"""How much memory this process can still take on the host: the kernel's MemAvailable, or the
room left under a cgroup's memory limit (a container, a SLURM job) where that is lower.

Apart from the batch-size finder, which caps its budget with it, because it is a fact about
this machine that any memory check may need; the cgroup readers are here so that the v1/v2
file names are read in one place.

    from labkit.hardware.host import host_memory_available
    available, source = host_memory_available()   # bytes, and "MemAvailable" or the cgroup
"""

from __future__ import annotations

from pathlib import Path

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where cgroup hierarchies are mounted (v2 at the root or under unified/, v1 per controller)."""


def host_memory_available() -> tuple[int, str]:
    """Bytes this process can still take on the host, and where that was read: the kernel's
    MemAvailable (``psutil.virtual_memory().available``), or, where it is lower, the room left
    under the memory limit of this process's cgroup or one above it (a container, a SLURM job:
    where the OOM killer acts first)."""
    available, source = int(psutil.virtual_memory().available), "MemAvailable"
    for folder in cgroup_folders():
        room = cgroup_room(folder)
        if room is not None and room < available:
            available, source = room, f"the memory limit of cgroup {folder}"
    return available, source


def cgroup_folders() -> list[Path]:
    """This process's memory cgroup folders (cgroup v2 and v1), innermost first, with every
    ancestor up to the mount: a limit on any of them holds."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    folders = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy, mounted at the root or under unified/
            root = next((r for r in (CGROUP_ROOT, CGROUP_ROOT / "unified")
                         if (r / "cgroup.controllers").exists()), None)  # fmt: skip
        else:
            root = CGROUP_ROOT / "memory" if "memory" in controllers.split(",") else None
        if root is None:
            continue
        folder = root / path.lstrip("/")
        while folder != root and root in folder.parents:
            folders.append(folder)
            folder = folder.parent
        folders.append(root)
    return [f for f in folders if f.is_dir()]


def cgroup_room(folder: Path) -> int | None:
    """Bytes left under ``folder``'s memory limit (v2 memory.max, v1 memory.limit_in_bytes),
    counting its reclaimable page cache (inactive_file) as room; None without a limit."""
    v2 = (folder / "memory.max").exists()
    names = (("memory.max", "memory.current", "inactive_file") if v2 else
             ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))  # fmt: skip
    try:
        limit_text = (folder / names[0]).read_text().strip()
        if limit_text == "max" or int(limit_text) >= 2**60:  # v1 writes "no limit" as ~2**63
            return None
        usage = int((folder / names[1]).read_text())
        stat = (folder / "memory.stat").read_text().split()
    except (OSError, ValueError):
        return None
    cache = dict(zip(stat[::2], stat[1::2], strict=False)).get(names[2], "0")
    return max(0, int(limit_text) - usage + int(cache))
