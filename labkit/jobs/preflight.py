"""Everything ``launch.run`` checks before it starts a process, and the job folder it makes.

A job that cannot run must fail before anything starts, with a message that names the fix:
bad arguments (an unknown module, a config that is not JSON, a timeout of zero), a machine
that cannot carry it (more ranks than GPUs, or than the cores can take), no free port, a full
or unwritable disk. Here too: which backend and device the ranks get, leftovers of earlier
jobs ended, old job folders pruned, and the new job's folder with its spec. Kept apart from the
supervisor (``labkit.jobs.supervisor``) because none of it needs a running job, and each check
is tested without one.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Collection, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from labkit.jobs import procs, spec
from labkit.jobs.nodes import Nodes, endpoint_problem
from labkit.jobs.observers import Job
from labkit.jobs.outcome import LaunchError
from labkit.jobs.spec import MAX_RANKS_PER_CORE, WorkerConfig, worker_of
from labkit.validate import is_finite, shown, whole

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl")


# --- the arguments (nothing is started before these pass) ---------------------------------------


def worker_and_config(job: Any) -> tuple[str, dict[str, Any], str]:
    """run()'s first argument as (worker module, config dict, the config as JSON).

    A job is ``run(SomeConfig(...))``: the typed config names its worker module. A dotted
    module name alone is the one escape hatch, for a module of your own that is not a labkit
    worker (a test's fixture, a script's victim): it gets an empty ``ctx.config``, and takes
    any settings through ``env=``. A labkit module that has a config class is refused by
    name, so a worker's settings never travel untyped."""
    if isinstance(job, WorkerConfig):
        module = worker_of(job)
        try:
            config = job.to_dict()
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"{type(job).__name__} is not JSON-serialisable ({e}): workers get it as JSON, "
                "so its fields hold numbers, strings, bools, None, lists and dicts"
            ) from None
        return module, config, json.dumps(config)
    if not isinstance(job, str):
        raise ValueError(f"{shown(job)}: need a worker's config (a labkit.jobs.spec.WorkerConfig, "
                         "which names its module), or the dotted name of a module of your own "
                         "such as 'my_tests.worker'")  # fmt: skip
    if job.startswith("labkit.") and (cls := config_class(job)) is not None:
        raise ValueError(f"run({job!r}): {job} takes its settings typed; launch it as "
                         f"run({cls.__name__}(...)), from {cls.__module__}")  # fmt: skip
    return job, {}, "{}"


def config_class(module: str) -> type[WorkerConfig] | None:
    """The config class of worker ``module``: the ``WorkerConfig`` in its namespace whose
    ``WORKER`` names it (defined there, or imported from a torch-free ``*_config`` module).
    None for a module that has none, or that cannot be found or imported (the launch's own
    check says why). Imports the module: for ``labkit launch MODULE --config JSON``, and to
    name the class in a refusal."""
    try:
        if importlib.util.find_spec(module) is None:
            return None
        namespace = vars(importlib.import_module(module))
    except Exception:  # a module that does not import: the launch's own check says why
        return None
    found = [v for v in namespace.values()
             if isinstance(v, type) and issubclass(v, WorkerConfig) and v.WORKER == module]  # fmt: skip
    return found[0] if found else None


def check_inputs(
    nproc: int,
    timeout_s: float,
    tail_lines: int | None,
    env: Any,
    heartbeat_timeout_s: float | None,
    pg_timeout_s: float,
    nodes: Any,
) -> None:
    """Validate run()'s arguments other than the job (``worker_and_config`` checks that)."""
    whole("nproc", nproc, low=1, why="processes to start")
    for name, value in (
        ("timeout_s", timeout_s),
        ("pg_timeout_s", pg_timeout_s),
        ("heartbeat_timeout_s", heartbeat_timeout_s),
    ):
        if value is not None and not (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and is_finite(value)
            and value > 0
        ):
            raise ValueError(
                f"{name}={shown(value)}: need a finite number of seconds > 0, e.g. 120"
            )
    if tail_lines is not None and (not isinstance(tail_lines, int) or tail_lines < 0):
        raise ValueError(f"tail_lines={shown(tail_lines)}: need an integer >= 0, or None for all")
    if env is not None and not (
        isinstance(env, Mapping)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        raise ValueError(
            f"env={shown(env)}: env takes a dict of str to str, each extra environment "
            "variable's name to its value, e.g. env={'OMP_NUM_THREADS': '1'} (values are "
            "strings too: '1', not 1)"
        )
    if nodes is not None and not isinstance(nodes, Nodes):
        raise ValueError(
            f"nodes={shown(nodes)}: need a labkit.jobs.nodes.Nodes(count, endpoint=..., rdzv_id=...), "
            "or None for a job on this machine alone"
        )

# --- the machine: GPUs, cores, a port ------------------------------------------------------------


def visible_gpu_count() -> int:
    """CUDA GPUs this process may use (honours CUDA_VISIBLE_DEVICES), without creating a
    CUDA context in the kernel: ``torch.cuda.device_count`` asks NVML when it can."""
    return torch.cuda.device_count()


def resolve_backend(
    nproc: int, device: str = "auto", backend: str = "auto", *, gpu_count: int
) -> tuple[str, str]:
    """Pick (backend, device type) for ``nproc`` ranks on a machine with ``gpu_count`` GPUs.

    NCCL needs one GPU per rank. With ``device="auto"``, ranks that cannot each have their
    own GPU (none visible, or fewer GPUs than ranks: two ranks on a one-GPU machine) use gloo
    on the CPU; ``fallback_note`` says so to the learner. Raises ValueError for a combination
    the machine cannot run (``device="cuda"`` or ``backend="nccl"`` without enough GPUs).
    """
    if device not in DEVICES:
        raise ValueError(f"device={shown(device)}: use one of {DEVICES}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={shown(backend)}: use one of {BACKENDS}")
    if device == "cpu":
        if backend == "nccl":
            raise ValueError("backend='nccl' needs GPUs, but device='cpu': use backend='gloo'")
        return "gloo", "cpu"
    if gpu_count == 0:
        if device == "cuda" or backend == "nccl":
            what = "device='cuda'" if device == "cuda" else "backend='nccl'"
            raise ValueError(f"{what} but no CUDA GPU is visible: use device='cpu' (gloo)")
        return "gloo", "cpu"
    if nproc > gpu_count:
        if device == "auto" and backend != "nccl":
            return "gloo", "cpu"  # every rank on a GPU of its own, or none: see fallback_note
        raise ValueError(
            f"more ranks ({nproc}) than GPUs ({gpu_count}): use nproc<={gpu_count}"
            " or device='cpu' (gloo)"
        )
    return ("gloo" if backend == "gloo" else "nccl"), "cuda"


def fallback_note(nproc: int, device: str, gpu_count: int) -> str | None:
    """What to tell the learner when ``device="auto"`` put ranks on the CPU despite a GPU."""
    if device != "cpu" or gpu_count == 0:
        return None
    return (f"labkit: {nproc} ranks but {gpu_count} GPU{'s' if gpu_count > 1 else ''} visible: "
            "the ranks run on the CPU over gloo (NCCL needs a GPU per rank); the collectives "
            "and the algorithm are the real ones, the timings are the CPU's")  # fmt: skip


def module_roots(module: str) -> list[str]:
    """Check workers can import ``module``; return sys.path entries they need for it.

    The kernel may import it thanks to a ``sys.path`` edit (``sys.path.insert(0, "..")``) that
    a fresh process would not repeat, so the roots go into the workers' PYTHONPATH.
    """
    if not isinstance(module, str) or not re.fullmatch(r"[A-Za-z_][\w.]*", module):
        raise ValueError(
            f"module={shown(module)}: pass a dotted module name like 'my_tests.worker'"
        )
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or module == "__main__":
        raise ValueError(
            f"no module named {module!r}: workers must be importable modules (a "
            "function defined in a notebook cannot be imported by worker processes);"
            " put it in a .py file on sys.path and pass its dotted name"
        )
    roots = []
    for name in (module.partition(".")[0], __name__.partition(".")[0]):
        top = importlib.util.find_spec(name)
        locations = list(top.submodule_search_locations or []) if top else []
        if top and not locations and top.origin:
            locations = [top.origin]
        for loc in locations:
            root = str(Path(loc).resolve().parent)
            # site-packages is on every interpreter's path already; putting it on PYTHONPATH
            # would move it ahead of the standard library.
            if root not in roots and not root.endswith(("site-packages", "dist-packages")):
                roots.append(root)
    return roots


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity mask: a container's or taskset's limit)."""
    with contextlib.suppress(AttributeError, OSError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_cpu_ranks(nproc: int, device: str, *, oversubscribe: bool = False) -> str | None:
    """Refuse more CPU ranks than the cores can carry; return a note when ranks share cores.

    Each rank is a whole Python process with torch loaded (a few hundred MB) and a gloo
    connection to every other rank. GPU jobs are bounded by the GPU count already
    (``resolve_backend``).
    """
    if device != "cpu":
        return None
    cores = usable_cpus()
    limit = MAX_RANKS_PER_CORE * cores
    if nproc > limit and not oversubscribe:
        raise ValueError(
            f"nproc={nproc} CPU ranks on {cores} core{'s' if cores != 1 else ''}: at most "
            f"{limit} ({MAX_RANKS_PER_CORE} per core) are started without oversubscribe=True. "
            "Each rank is a process with torch loaded; this many would exhaust the machine. "
            f"Use nproc<={limit}, or pass oversubscribe=True if you mean it"
        )
    if nproc > cores:
        return (
            f"labkit: {nproc} ranks share {cores} CPU core{'s' if cores != 1 else ''}: they take "
            "turns, so the timings show contention, not what more hardware would give"
        )
    return None


def check_free_port() -> None:
    """torchrun's rendezvous and gloo each need a local TCP port. With none free, torchrun
    retries for a minute and then fails with errno 99 in its own log; this says so at once."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
    except OSError as e:
        raise LaunchError(no_port_message(e.strerror or str(e))) from None


def no_port_message(error: str) -> str:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = f.read().split()
        span = f" ({low} to {high}, in /proc/sys/net/ipv4/ip_local_port_range)"
    except (OSError, ValueError):
        span = ""
    return (
        f"no free local network port ({error}): torchrun's rendezvous and gloo each need "
        f"one, and every port of this machine's ephemeral range{span} is taken. See who holds "
        "them with `ss -tanp` (`ss -s` counts them); end that program, or wait a minute for "
        "closed connections to leave TIME_WAIT, then run the cell again"
    )


def check_machine(
    module: str, nproc: int, device: str, backend: str, *, gpu_count: int, oversubscribe: bool,
    stream: bool,
) -> tuple[str, str, list[str]]:
    """Can this machine run ``nproc`` ranks of ``module`` now? Returns (backend, device type,
    the ``sys.path`` roots the workers need); prints a note when the ranks go to the CPU
    despite a GPU, or share cores (with ``stream``). Raises ValueError or ``LaunchError``."""
    asked = device
    backend, device = resolve_backend(nproc, device, backend, gpu_count=gpu_count)
    roots = module_roots(module)
    crowded = check_cpu_ranks(nproc, device, oversubscribe=oversubscribe)
    note = fallback_note(nproc, device, gpu_count) if asked == "auto" else None
    for line in (note, crowded):
        if line and stream:
            print(line)
    check_free_port()
    return backend, device, roots


# --- leftovers of earlier jobs, and the new job's folder ------------------------------------------


def clear_leftovers(nodes: Nodes | None, log_dir: str | Path | None, *,
                    supervised: Collection[str]) -> None:  # fmt: skip
    """End what earlier jobs left running (not the ``supervised`` ones, this process's own),
    check the rendezvous endpoint of a job across nodes, and prune old job folders."""
    for ended in procs.cleanup(supervised=supervised):
        print(
            f"labkit: ended {len(ended['pids'])} leftover process(es) of job {ended['job_id']}"
            " (nothing supervised it any more)"
        )
    # After cleanup(): a leftover job of a killed kernel may still hold the rendezvous port,
    # and is gone now; looked at before, it would be refused as a stranger (static) or taken
    # for another agent hosting the rendezvous (c10d).
    if nodes is not None and (problem := endpoint_problem(nodes)) is not None:
        raise LaunchError(problem)
    if not log_dir:  # a folder the caller chose is the caller's to tidy
        # After cleanup(), so jobs it just ended count as finished. The new job is one of the
        # folders kept, hence keep - 1. A bad $LABKIT_KEEP_RUNS raises ValueError before
        # anything starts; a disk problem only costs the tidying, never the launch.
        keep = max(procs.keep_runs() - 1, 0)
        try:
            procs.prune_runs(keep)
        except OSError as e:
            print(f"labkit: could not delete old job folders ({e}); launching anyway")


def new_job(
    module: str, config: dict[str, Any], config_json: str, *, nproc: int, backend: str,
    device: str, pg_timeout_s: float, nodes: Nodes | None, max_restarts: int,
    log_dir: str | Path | None,
) -> Job:
    """The job, named and given its folder: ``spec.SPEC_FILE`` written, nothing started."""
    job_id = f"{module.rsplit('.', 1)[-1]}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    job_spec = {
        "job_id": job_id,
        "module": module,
        "nproc": nproc,
        "backend": backend,
        "device": device,
        "pg_timeout_s": float(pg_timeout_s),
        "config": json.loads(config_json),
        "nodes": asdict(nodes) if nodes else None,
        "max_restarts": max_restarts,
    }
    job_dir = make_job_dir(Path(log_dir or procs.default_runs_dir()).resolve(), job_spec,
                           may_prune=not log_dir)  # fmt: skip
    return Job(job_id, module, nproc, backend, device, config, job_dir, nodes=nodes,
               node_rank=(nodes.node_rank if nodes else 0), max_restarts=max_restarts)  # fmt: skip


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def make_job_dir(parent: Path, job_spec: dict[str, Any], *, may_prune: bool) -> Path:
    """Create the job's folder and spec, and its entry in the registry of running jobs.

    On a full disk, the finished job folders under the default runs folder (old logs) are
    deleted to make room, once; if that is not enough, ``LaunchError`` names the path and the
    ways out.
    """
    job_dir = parent / job_spec["job_id"]
    for attempt in (1, 2):
        try:
            (job_dir / "tmp").mkdir(parents=True, exist_ok=True)
            spec.write_json_atomic(job_dir / spec.SPEC_FILE, job_spec)
            procs.registry_dir().mkdir(parents=True, exist_ok=True)
            return job_dir
        except OSError as e:
            shutil.rmtree(job_dir, ignore_errors=True)
            if e.errno in DISK_FULL and may_prune and attempt == 1:
                freed = procs.prune_runs(0)
                if freed:
                    print(f"labkit: the disk holding {parent} is full; deleted {len(freed)} "
                          "old job folder(s) (their logs) to make room")  # fmt: skip
                    continue
            raise disk_error(parent, e) from e
    raise AssertionError("unreachable")


LOW_SPACE_BYTES = 16 << 20
"""Less free space than this under a job that failed counts as a full disk: its own tidying
(torchrun's temp folder) frees a few pages after the fact, and a rank or torchrun that could
not write its files fails in ways that do not say why (an empty error file, say)."""


def disk_full(path: Path) -> OSError | None:
    """An ENOSPC error if the disk under ``path`` is full or nearly so, else None."""
    probe = path / f".space-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"\0" * 4096)
        if shutil.disk_usage(path).free < LOW_SPACE_BYTES:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    except OSError as e:
        if e.errno in DISK_FULL:
            return e
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None


def disk_error(path: Path, e: OSError) -> LaunchError:
    """The error for a job whose files could not be written under ``path``."""
    where = Path(e.filename) if e.filename else path
    if e.errno in DISK_FULL:
        try:
            free = f", {shutil.disk_usage(path if path.exists() else path.parent).free / 2**20:.1f} MiB free"
        except OSError:
            free = ""
        return LaunchError(
            f"the disk holding {where} is full ({e.strerror}{free}): labkit writes each "
            "job's logs and results there. Free space on it, delete the old job folders with "
            "`python -m labkit cleanup --runs 0`, or point LABKIT_HOME at a folder on another "
            "disk (e.g. `export LABKIT_HOME=/path/with/space`, then restart the kernel)"
        )
    return LaunchError(
        f"cannot write the job's files under {where} ({e.strerror or e}): labkit keeps each "
        "job's logs there. Make that folder writable for you, or point LABKIT_HOME at one "
        "that is (`export LABKIT_HOME=$HOME/labkit-cache`, then restart the kernel); "
        "`python -m labkit doctor` checks it"
    )

