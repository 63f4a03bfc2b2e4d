"""CPU backend: each rank's process tree and the host, from psutil.

    from labkit.metrics import CpuBackend
    cpu = CpuBackend(lambda: {0: pid0, 1: pid1}, reason="NVML library not found")
    with cpu:
        print(cpu.describe())  # "CPU only (2 ranks and the host ...); no NVIDIA GPU found: ..."
        cpu.sample()           # [Sample("rank0", {"cpu_pct": ..., "rss_gib": ...}), ..., "host"]

This is what a learner sees on a machine without an NVIDIA GPU, where ranks are processes
talking over gloo. It reports no GPU numbers at all, and ``describe()`` says so.

CPU percentages are rates, so they need two readings: psutil's ``cpu_percent`` returns a
meaningless 0.0 the first time it is called for a process (the call only primes it). We show
that first reading as N/A instead, and prime what we can in ``open()``. Host CPU is computed
from our own ``psutil.cpu_times()`` differences rather than ``psutil.cpu_percent()``, whose
state is shared by every caller in the process (another sampler would corrupt ours).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping

import psutil

from labkit.metrics.base import GIB, Backend, Clock, Sample

PidsFn = Callable[[], Mapping[int, int]]  # returns {rank: pid}


class CpuBackend(Backend):
    """Per-rank CPU % and resident memory of the job's process trees, plus the host's.

    Args:
        pids_fn: returns {rank: pid} of the job's processes; called every sample, so PIDs
            may appear as the job starts (the launcher learns worker PIDs from heartbeats).
            None: host metrics only.
        reason: why this backend is used instead of NVML (shown by ``describe()``), e.g.
            the ``BackendUnavailable`` message from ``NvmlBackend.open()``.
        note: why CPU metrics are shown although a GPU is there (e.g. the job's ranks run on
            the CPU); shown by ``describe()`` when there is no ``reason``.
        children: include each rank's descendants (data-loader workers, compile workers).
        clock: seconds; stamps the samples.
    """

    kind = "cpu"

    def __init__(self, pids_fn: PidsFn | None = None, *, reason: str | None = None,
                 note: str | None = None, children: bool = True,
                 clock: Clock = time.monotonic) -> None:  # fmt: skip
        super().__init__(clock)
        self.pids_fn, self.reason, self.children = pids_fn, reason, children
        self.note = note
        self._open = False
        self._procs: dict[int, psutil.Process] = {}  # pid -> primed Process (cpu_percent state)
        self._ranks: dict[int, int] = {}  # rank -> pid last seen
        self._host_prev: tuple[float, float] | None = None  # (busy s, total s) of all cores

    def open(self) -> None:
        if self._open:
            return
        self._host_prev = _host_times()
        self._procs = {}
        self.status = {"host": "ok"}
        self._open = True
        for rank, pid in self._pids().items():
            self._tree(rank, pid)  # primes cpu_percent for the processes already there

    def close(self) -> None:
        self._procs = {}
        self._open = False

    def describe(self) -> str:
        n = len(self._ranks)
        what = f"{n} rank{'s' if n != 1 else ''} and the host" if n else "the host"
        if self.reason:
            why = f"no NVIDIA GPU found: {self.reason}"
        else:
            why = self.note or "no GPU metrics collected"
        return f"CPU only ({what}, {os.cpu_count()} logical cores); {why}"

    def _pids(self) -> dict[int, int]:
        if self.pids_fn is None:
            return {}
        try:
            ranks = {int(r): int(p) for r, p in dict(self.pids_fn()).items()}
        except Exception as e:  # a broken callback must not stop the host readings
            self.status["pids_fn"] = f"error: {e!r}"
            return {}
        self.status.pop("pids_fn", None)
        return ranks

    def _process(self, pid: int) -> tuple[psutil.Process | None, bool]:
        """(process, primed): a cached Process keeps its cpu_percent state between samples.

        A process that has exited but is not reaped yet (a zombie: a rank whose torchrun
        agent has not collected it) counts as gone: psutil reads its memory as 0 B and its CPU
        as 0 %, and a line dropping to zero would say the rank freed its memory.
        """
        p = self._procs.get(pid)
        try:
            if p is not None and p.is_running():  # is_running also catches a reused PID
                if p.status() != psutil.STATUS_ZOMBIE:
                    return p, True
                raise psutil.ZombieProcess(pid)
            p = psutil.Process(pid)
            if p.status() == psutil.STATUS_ZOMBIE:
                raise psutil.ZombieProcess(pid)
            p.cpu_percent(None)  # primes: psutil's first reading is always 0.0
        except psutil.Error:
            self._procs.pop(pid, None)
            return None, False
        self._procs[pid] = p
        return p, False

    def _tree(self, rank: int, pid: int) -> tuple[list[psutil.Process], list[psutil.Process]]:
        """(primed, all) live processes of rank ``rank``'s tree; [] if its root has exited."""
        root, primed = self._process(pid)
        if root is None:
            return [], []
        found = [(root, primed)]
        if self.children:
            with contextlib.suppress(psutil.Error):
                found += [self._process(c.pid) for c in root.children(recursive=True)]
        live = [(p, ok) for p, ok in found if p is not None]
        return [p for p, ok in live if ok], [p for p, _ in live]

    def sample(self, now: float | None = None) -> list[Sample]:
        if not self._open:
            raise RuntimeError("CpuBackend.sample() before open(): call open() or use `with`")
        now = self._now(now)
        out = []
        keep: set[int] = set()
        self._ranks = self._pids()
        for rank, pid in sorted(self._ranks.items()):
            sample, pids = self._rank_sample(now, rank, pid)
            out.append(sample)
            keep |= pids
        # Forget processes no rank owns any more: nothing grows over a long session.
        self._procs = {pid: p for pid, p in self._procs.items() if pid in keep}
        out.append(Sample(now, "host", self._host_values(), kind="cpu"))
        return out

    def _rank_sample(self, now: float, rank: int, pid: int) -> tuple[Sample, set[int]]:
        """Rank ``rank``'s sample, and the PIDs of its live process tree."""
        source = f"rank{rank}"
        primed, live = self._tree(rank, pid)
        if not live:
            self.status[source] = f"exited (pid {pid})"
            return Sample(now, source, {}, status="exited", kind="cpu"), set()
        self.status[source] = "ok"
        cpu, counted, rss = 0.0, 0, 0
        for p in live:
            with contextlib.suppress(psutil.Error):  # a child may exit between the calls
                rss += p.memory_info().rss
                if p in primed:
                    cpu += p.cpu_percent(None)
                    counted += 1
        # No primed process yet: the rate is unknown (N/A), not zero.
        values = {"cpu_pct": cpu if counted else None, "rss_gib": rss / GIB}
        return Sample(now, source, values, kind="cpu"), {p.pid for p in live}

    def _host_values(self) -> dict[str, float | None]:
        busy, total = _host_times()
        prev, self._host_prev = self._host_prev, (busy, total)
        pct = None
        if prev is not None and total > prev[1]:
            # busy <= total by definition; summed float times can overshoot by ~1e-9 (a fully
            # busy host read 100.00000000115 in CI): clamp to the share it is.
            pct = min(100.0, 100.0 * max(0.0, busy - prev[0]) / (total - prev[1]))
        vm = psutil.virtual_memory()
        return {"host_cpu_pct": pct, "host_mem_used_gib": (vm.total - vm.available) / GIB,
                "host_mem_total_gib": vm.total / GIB}  # fmt: skip


def _host_times() -> tuple[float, float]:
    """(busy, total) CPU seconds summed over all cores since boot.

    Idle and I/O wait count as not busy, as psutil's own cpu_percent counts them; guest time
    is already inside user time on Linux, so it is left out of the total.
    """
    t = psutil.cpu_times()
    fields = t._asdict()
    total = sum(v for k, v in fields.items() if k not in ("guest", "guest_nice"))
    idle = fields.get("idle", 0.0) + fields.get("iowait", 0.0)
    return total - idle, total
