"""A Dask cluster of worker processes on this machine, started and ended by a ``with`` block.

    from labkit.tabular import cluster
    with cluster.local_workers(2) as workers:        # two worker processes, one thread each
        print(workers.describe())                    # addresses, PIDs, threads, devices
        ...                                          # workers.client runs the jobs

A worker is a process that holds data partitions and runs tasks; the scheduler (a thread of this
process for a ``LocalCluster``) decides which task runs where, and a nanny restarts a worker whose
process died. One worker process per device is Dask's rule for GPUs (``dask_cuda.
LocalCUDACluster`` starts one per visible GPU and pins it with ``CUDA_VISIBLE_DEVICES``): a
process owns its CUDA context and its memory pool, and a process per device keeps Python's GIL
and one device's failure out of the others' way. On the CPU tier each worker gets one thread,
as each GPU would get one process.

What the block promises, as ``labkit.jobs`` does for torchrun jobs: no worker process outlives
it, whether the block ends, raises or is interrupted (a second pass ends, by PID, any process
the cluster started that is still running); a worker that died is reported by :meth:`Workers.
check` with the fix, not found later as a hang; a port that is taken stops the start with a
message that says so.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil

from labkit.errors import LabkitError
from labkit.jobs import procs
from labkit.tables import html_table
from labkit.validate import one_of, whole

DEVICES = ("cpu", "cuda")
RAPIDS_INSTALL = "pip install -e '.[rapids]'"
"""How to install the GPU stack (dask-cuda, rmm, cuml): the ``rapids`` extra of pyproject.toml."""
CLOSE_TIMEOUT_S = 10.0


class ClusterError(LabkitError, RuntimeError):
    """A cluster that could not start, or lost a worker; the message says what to do."""


class PortTaken(ClusterError):
    """The scheduler's port is held by another process."""


class WorkerDied(ClusterError):
    """A worker process of the cluster ended while the cluster was in use."""


class MissingExtra(LabkitError, ImportError):
    """A GPU-tier package is not installed; the message names the extra that brings it."""


@dataclass
class Workers:
    """A running cluster: its client, its workers' addresses and processes."""

    client: Any
    cluster: Any
    device: str
    threads_per_worker: int
    pids: dict[str, int]
    """Worker address -> PID, read from each worker when the cluster started."""
    started: list[psutil.Process] = field(default_factory=list)
    """Every process the cluster started (workers and their helpers), for the final sweep."""

    @property
    def addresses(self) -> list[str]:
        return sorted(self.pids)

    def check(self) -> None:
        """Raise :class:`WorkerDied` if a worker process has ended since the cluster started."""
        dead = {a: pid for a, pid in self.pids.items() if not psutil.pid_exists(pid)
                or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE}  # fmt: skip
        if dead:
            names = ", ".join(f"{a} (pid {pid})" for a, pid in sorted(dead.items()))
            raise WorkerDied(
                f"worker {names} died while the cluster was in use: its partitions and any "
                "training job it was part of are lost (Dask's nanny starts a fresh, empty "
                "worker in its place). Fix: end this block and run the cell again; if a worker "
                "dies again, it most likely ran out of memory: use fewer rows or more workers "
                "(the data set's describe() says how many bytes each worker holds)")

    def close(self) -> None:
        """End the cluster and every process it started (idempotent)."""
        live = [p for p in self.started if procs.alive(p)]
        for pid in self.pids.values():  # a worker the nanny restarted is a new process
            with contextlib.suppress(psutil.Error):
                live.extend(c for c in psutil.Process(pid).children(recursive=True))
        _end(live + _restarted(self), self.client, self.cluster)

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> str:
        lines = [f"{len(self.pids)} Dask worker process(es) on this machine, device {self.device}, "
                 f"{self.threads_per_worker} thread(s) each; scheduler {self.cluster.scheduler_address}"]
        lines += [f"  worker {a}  pid {self.pids[a]}" for a in self.addresses]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = [[a, str(self.pids[a]), str(self.threads_per_worker), self.device]
                for a in self.addresses]  # fmt: skip
        return html_table(["worker", "pid", "threads", "device"], rows)


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on ``host:port`` (0 always counts as free: the OS picks)."""
    if port == 0:
        return True
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _port_message(port: int) -> str:
    return (f"port {port} is taken on this machine (another scheduler, or any other program, "
            f"listens there): pass port=0 to let the system pick a free one, or find the "
            f"process that holds it with `ss -ltnp 'sport = :{port}'` and stop it")


# The scheduler's HTTP server (its /health and /metrics, and the dashboard where bokeh is
# installed): None does not switch it off but takes dask's default, port 8787, which a second
# learner on a shared server already holds (a warning under the cell); ":0" lets the system pick.
HTTP_ADDRESS = ":0"


def _cpu_cluster(n: int, threads_per_worker: int, port: int, memory_limit: str | int) -> Any:
    from distributed import LocalCluster

    return LocalCluster(n_workers=n, threads_per_worker=threads_per_worker, processes=True,
                        scheduler_port=port, dashboard_address=HTTP_ADDRESS, memory_limit=memory_limit,
                        host="127.0.0.1", worker_dashboard_address=None)  # fmt: skip


def _cuda_cluster(n: int, port: int, cuda_kwargs: dict[str, Any]) -> Any:
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError as err:
        raise MissingExtra(f"device='cuda' starts a dask_cuda.LocalCUDACluster, and dask-cuda is "
                           f"not installed ({err}): install the GPU stack with "
                           f"`{RAPIDS_INSTALL}`") from None  # fmt: skip
    return LocalCUDACluster(n_workers=n, scheduler_port=port, dashboard_address=HTTP_ADDRESS,
                            **cuda_kwargs)  # fmt: skip


def open_workers(n: int = 2, *, threads_per_worker: int = 1, port: int = 0,
                 device: str = "cpu", memory_limit: str | int = "auto",
                 cuda_kwargs: dict[str, Any] | None = None,
                 start_timeout_s: float = 60.0) -> Workers:
    """Start ``n`` worker processes (``LocalCluster`` on ``device="cpu"``, ``LocalCUDACluster``
    with ``cuda_kwargs`` on ``"cuda"``: :func:`labkit.tabular.gpu.plan` writes them) and return
    the running :class:`Workers`; :meth:`Workers.close` (or a ``with`` block) ends every process
    the cluster started. A notebook keeps it open across cells and closes it in its last; a
    kernel that dies takes the workers with it (each worker watches its parent)."""
    whole("n", n, low=1)
    whole("threads_per_worker", threads_per_worker, low=1)
    whole("port", port, low=0, high=65535)
    one_of("device", device, DEVICES)
    if not port_free(port):
        raise PortTaken(_port_message(port))
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    cluster = client = None
    try:
        try:
            if device == "cuda":
                cluster = _cuda_cluster(n, port, dict(cuda_kwargs or {}))
            else:
                cluster = _cpu_cluster(n, threads_per_worker, port, memory_limit)
        except OSError as err:  # the port was taken between our check and the bind
            if port and not port_free(port):
                raise PortTaken(_port_message(port)) from err
            raise ClusterError(f"the cluster could not start: {err}") from err
        from distributed import Client

        client = Client(cluster, timeout=start_timeout_s)
        client.wait_for_workers(n, timeout=start_timeout_s)
        pids = client.run(os.getpid)
    except BaseException:  # KeyboardInterrupt too: nothing half-started is left behind
        _end([p for p in me.children(recursive=True) if p.pid not in before], client, cluster)
        raise
    started = [p for p in me.children(recursive=True) if p.pid not in before]
    return Workers(client=client, cluster=cluster, device=device,
                   threads_per_worker=threads_per_worker, pids=dict(pids), started=started)


@contextlib.contextmanager
def local_workers(n: int = 2, **kwargs: Any) -> Iterator[Workers]:
    """:func:`open_workers` as a ``with`` block: every process ends when the block does,
    whether it returns, raises or is interrupted."""
    workers = open_workers(n, **kwargs)
    try:
        yield workers
    finally:
        workers.close()


def _end(ours: list[psutil.Process], client: Any, cluster: Any) -> None:
    _close(client, cluster)
    # A worker the nanny could not stop (stuck in C code, or restarted during close): end it,
    # and anything it started, by PID. The multiprocessing resource tracker is shared by the
    # whole kernel, so it is not ours to end.
    procs.end_tree([p for p in ours if procs.alive(p) and not _shared_helper(p)])


def _shared_helper(p: psutil.Process) -> bool:
    try:
        return "resource_tracker" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def _close(client: Any, cluster: Any) -> None:
    deadline = time.monotonic() + CLOSE_TIMEOUT_S
    if client is not None:
        with contextlib.suppress(Exception):
            client.close(timeout=CLOSE_TIMEOUT_S)
    if cluster is not None:
        with contextlib.suppress(Exception):
            cluster.close(timeout=max(1.0, deadline - time.monotonic()))


def _restarted(workers: Workers) -> list[psutil.Process]:
    """Worker processes the nannies run now that the cluster did not start with (a nanny
    replaces a worker that died): read from the cluster's own nannies, never guessed."""
    known = {p.pid for p in workers.started}
    found = []
    for nanny in getattr(workers.cluster, "workers", {}).values():
        pid = getattr(nanny, "pid", None)
        if isinstance(pid, int) and pid not in known:
            with contextlib.suppress(psutil.Error):
                found.append(psutil.Process(pid))
    return found


def survivors(workers: Workers) -> list[int]:
    """PIDs of the processes the cluster started that are still running (none after the block)."""
    return sorted(p.pid for p in workers.started if procs.alive(p) and not _shared_helper(p))


@dataclass(frozen=True)
class TaskStream:
    """What the dashboard's task stream shows, read as numbers: per worker, the seconds its
    tasks computed and the seconds it spent receiving data, within a wall-clock window."""

    wall_s: float
    compute_s: dict[str, float]
    transfer_s: dict[str, float]
    tasks: dict[str, int]

    def describe(self) -> str:
        lines = [f"task stream (measured): {sum(self.tasks.values())} tasks in "
                 f"{self.wall_s:.2f} s of wall time"]
        for w in sorted(self.tasks):
            busy = self.compute_s[w] / self.wall_s if self.wall_s else 0.0
            lines.append(f"  {w}: {self.tasks[w]} tasks, computing {self.compute_s[w]:.3f} s "
                         f"({busy:.0%} of the window), receiving data {self.transfer_s[w]:.3f} s")
        received = sum(self.transfer_s.values())
        lines.append("  no worker received data: each computed on what it held" if received == 0
                     else f"  the workers received data for {received:.3f} s in all: a task ran "
                     "where its inputs were not")  # fmt: skip
        busiest = max(self.compute_s, key=lambda w: self.compute_s[w], default=None)
        if busiest is not None:
            idle = self.wall_s - self.compute_s[busiest] - self.transfer_s[busiest]
            lines.append(f"  the busiest worker neither computed nor received for {max(idle, 0.0):.2f} s "
                         "of the window: waiting for the scheduler or for the tasks its own depend "
                         "on (the stream does not say which)")
        return "\n".join(lines)


def read_task_stream(records: list[dict[str, Any]]) -> TaskStream:
    """Summarise ``distributed.get_task_stream``'s records (the dashboard's Task Stream plot:
    one bar per task, colored by what it did, https://docs.dask.org/en/stable/dashboard.html)."""
    compute: dict[str, float] = {}
    transfer: dict[str, float] = {}
    tasks: dict[str, int] = {}
    starts, stops = [], []
    for rec in records:
        w = rec.get("worker", "?")
        tasks[w] = tasks.get(w, 0) + 1
        compute.setdefault(w, 0.0)
        transfer.setdefault(w, 0.0)
        for ss in rec.get("startstops", ()):
            span = ss["stop"] - ss["start"]
            starts.append(ss["start"])
            stops.append(ss["stop"])
            if ss["action"] == "compute":
                compute[w] += span
            elif ss["action"] == "transfer":
                transfer[w] += span
    wall = (max(stops) - min(starts)) if starts else 0.0
    return TaskStream(wall_s=wall, compute_s=compute, transfer_s=transfer, tasks=tasks)
