"""Run a multi-process job from a notebook cell, and never leave a process behind.

    from labkit.jobs import launch
    from labkit.workers.allreduce import AllReduceConfig
    res = launch.run(AllReduceConfig(numel=2**20), nproc=2)  # the config names its worker
    res.ranks          # [rank 0's result dict, rank 1's result dict]

``run`` starts ``python -m torch.distributed.run`` (torchrun) as a subprocess on an importable
worker module (see ``labkit.jobs.runtime``) and supervises it from the calling thread:

- bad input fails before anything starts (unknown module, more ranks than GPUs, ...);
- each rank's output appears under the cell with a "[rank0]" prefix, bounded to ``tail_lines``
  lines; full per-rank logs stay in the job directory;
- per-rank results come back as dicts (``JobResult.ranks``);
- a failure raises ``JobFailed`` naming the rank, its exception and traceback;
- a hang raises ``JobTimeout`` naming the rank that fell behind, from per-rank heartbeats
  (torchrun's own report names the *victim*, the rank whose collective timed out first);
- on error, timeout or interrupt the whole process tree is ended, SIGTERM then SIGKILL;
- a kernel killed outright (Jupyter restart) still takes its job down: torchrun runs under a
  small supervisor (``labkit.jobs.spawn --supervise``) that gets a parent-death signal, keeps every
  process of the job as its descendant (a child subreaper) and SIGKILLs whatever is left after
  a few seconds, however the ranks' children treat SIGTERM; a registry of job PIDs lets the
  next ``run`` (or ``cleanup()``) end anything that still escaped.

Why a subprocess and not ``mp.spawn`` or an in-process launcher: functions defined in a
notebook cannot be pickled into spawned workers (pytorch #20375), fork breaks once the kernel
touched CUDA (accelerate #908), and torch's in-process ``elastic_launch`` leaves its signal
handlers installed in the kernel. A subprocess keeps the kernel clean.

``run`` is the one flow here; each of its steps lives in a module of its own, and the names
notebooks use are re-exported from this one:

    preflight    the checks before anything starts, and the job's folder
    supervisor   torchrun started, watched and ended, with all it started
    observers    the running job as a live plot sees it; ``ProgressLines``
    outcome      ``JobResult`` and the errors, worded from ``labkit.jobs.diagnosis``
    cli          ``python -m labkit launch`` on each node, and ``rehearse_nodes``
"""


from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from labkit.jobs import cli, spec
from labkit.jobs.cli import Rehearsal as Rehearsal
from labkit.jobs.diagnosis import diagnose_hang as diagnose_hang
from labkit.jobs.diagnosis import rank_log_path as rank_log_path
from labkit.jobs.diagnosis import traceback_excerpt as traceback_excerpt
from labkit.jobs.nodes import Nodes as Nodes
from labkit.jobs.observers import Job as Job
from labkit.jobs.observers import ProgressLines as ProgressLines
from labkit.jobs.outcome import JobError as JobError
from labkit.jobs.outcome import JobFailed as JobFailed
from labkit.jobs.outcome import JobResult as JobResult
from labkit.jobs.outcome import JobTimeout as JobTimeout
from labkit.jobs.outcome import LaunchError as LaunchError
from labkit.jobs.outcome import failure_error, no_worker_error, timeout_error
from labkit.jobs.preflight import BACKENDS as BACKENDS
from labkit.jobs.preflight import DEVICES as DEVICES
from labkit.jobs.preflight import check_cpu_ranks as check_cpu_ranks
from labkit.jobs.preflight import (
    check_inputs,
    check_machine,
    clear_leftovers,
    disk_error,
    disk_full,
    new_job,
    worker_and_config,
)
from labkit.jobs.preflight import fallback_note as fallback_note
from labkit.jobs.preflight import resolve_backend as resolve_backend
from labkit.jobs.preflight import usable_cpus as usable_cpus
from labkit.jobs.preflight import visible_gpu_count as visible_gpu_count
from labkit.jobs.procs import cleanup as cleanup
from labkit.jobs.procs import labkit_home as labkit_home
from labkit.jobs.runtime import DEFAULT_PG_TIMEOUT_S
from labkit.jobs.spec import MAX_RANKS_PER_CORE as MAX_RANKS_PER_CORE
from labkit.jobs.spec import WorkerConfig
from labkit.jobs.supervisor import SUPERVISED, Echo, Supervisor
from labkit.validate import whole


def run(
    config: WorkerConfig | str,
    /,
    *,
    nproc: int = 2,
    timeout_s: float = 300,
    device: str = "auto",
    backend: str = "auto",
    log_dir: str | Path | None = None,
    stream: bool = True,
    tail_lines: int | None = 30,
    env: dict[str, str] | None = None,
    heartbeat_timeout_s: float | None = None,
    pg_timeout_s: float = DEFAULT_PG_TIMEOUT_S,
    observers: Sequence[Any] = (),
    oversubscribe: bool = False,
    nodes: Nodes | None = None,
    max_restarts: int = 0,
) -> JobResult:
    """Run the worker ``config`` names on ``nproc`` processes and return their results.

    Args:
        config: the worker's typed config (a ``labkit.jobs.spec.WorkerConfig``, which names
            its module; every rank reads it back as ``ctx.config``). The one escape hatch: the
            dotted name of an importable module of your own that is not a labkit worker (see
            ``labkit.jobs.runtime``), such as a test's fixture; its ranks get an empty
            ``ctx.config`` and take any settings through ``env``.
        nproc: number of processes (ranks).
        timeout_s: wall-clock limit for the whole job, seconds.
        device: "auto" (CUDA if every rank can have its own GPU, else CPU), "cpu" or "cuda".
        backend: "auto" (nccl on CUDA, gloo on CPU), "gloo" or "nccl".
        log_dir: parent folder for the job directory (default: ``labkit_home()/runs``, where
            the oldest finished job directories are deleted before each launch so at most
            ``$LABKIT_KEEP_RUNS`` (default 50) remain; see ``procs.prune_runs``).
        stream: print rank-prefixed output while the job runs.
        tail_lines: at most this many lines are printed live, and the last lines of the rest
            at the end (None: print all). The logs on disk are always complete.
        env: extra environment variables for the workers.
        heartbeat_timeout_s: end the job when no rank's heartbeat changed for this long,
            counted once every rank has started (None: only ``timeout_s`` applies).
        pg_timeout_s: process-group timeout inside the workers, seconds: a collective that
            waits longer raises there.
        observers: objects with optional ``on_start(job)``, ``on_tick(job)``,
            ``on_end(job, result)`` methods (live plots).
        oversubscribe: allow more than ``MAX_RANKS_PER_CORE`` CPU ranks per core.
        nodes: run as one node of a job across machines (``labkit.jobs.nodes.Nodes``: node count,
            rendezvous endpoint and id, optionally this node's rank); call ``run`` with the
            same arguments on every node. ``nproc`` is then the ranks on *this* node, the
            output says which node each rank is on, and the result holds this node's ranks.
            None (default): every rank on this machine.
        max_restarts: how many times torchrun may restart all ranks after one fails (its
            ``--max-restarts``). A worker that resumes from a checkpoint makes a restart worth
            it (``labkit.jobs.checkpoint``); without one, a restart repeats the work, or the failure.
            Default 0: a failure ends the job and is reported at once.

    Raises:
        ValueError: bad arguments or a bad ``$LABKIT_KEEP_RUNS``; nothing was started.
        LaunchError: the machine cannot run it now (no free port, a full disk, a rendezvous
            endpoint whose port another program holds or whose host cannot be reached);
            nothing was started, or what was is ended.
        JobFailed: a rank raised or died; names the rank, the exception and the logs.
        JobTimeout: out of time; names the rank(s) that fell behind.
        KeyboardInterrupt: re-raised after every process of the job has been ended.
    """
    module, values, config_json = worker_and_config(config)
    check_inputs(nproc, timeout_s, tail_lines, env, heartbeat_timeout_s, pg_timeout_s, nodes)
    max_restarts = whole("max_restarts", max_restarts, low=0, why="0: no restart")
    # visible_gpu_count is looked up here, in launch: a test (or a notebook) may stand in
    # another GPU count for launch.visible_gpu_count.
    backend, device, roots = check_machine(
        module, nproc, device, backend, gpu_count=visible_gpu_count(),
        oversubscribe=oversubscribe, stream=stream,
    )  # fmt: skip
    clear_leftovers(nodes, log_dir, supervised=SUPERVISED)
    job = new_job(module, values, config_json, nproc=nproc, backend=backend, device=device,
                  pg_timeout_s=pg_timeout_s, nodes=nodes, max_restarts=max_restarts,
                  log_dir=log_dir)  # fmt: skip
    sup = Supervisor(
        job,
        roots,
        env or {},
        observers=list(observers),
        echo=Echo(tail_lines if stream else 0, job.job_dir, quiet=not stream),
    )
    result = sup.supervise(timeout_s, heartbeat_timeout_s)
    _raise_unless_ok(sup, result)
    return result


def _raise_unless_ok(sup: Supervisor, result: JobResult) -> None:
    """Raise the error that says how a job that did not finish cleanly ended."""
    job = sup.job
    if sup.status == "timeout":
        raise timeout_error(job, result, sup.timeout_reason, ranks_started=bool(sup.workers))
    if sup.agent_problem:
        raise LaunchError(f"{job.module} could not run: {sup.agent_problem}\nlogs in {job.job_dir}")
    if sup.status == "failed":
        agent_log = "\n".join(sup.agent_lines)
        if (full := disk_full(job.job_dir)) is not None:  # every later write would fail too
            raise disk_error(job.job_dir, full)
        raise failure_error(job, result, agent_log)
    beats = spec.read_heartbeats(job.job_dir, job.ranks_here())
    if missing := [r for r in job.local_ranks or range(job.nproc) if r not in beats]:
        raise no_worker_error(job, result, missing)


# --- several nodes from a terminal, and a rehearsal of them on one machine (labkit.jobs.cli) ---


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m labkit launch MODULE ...``: the command a learner runs on each node."""
    return cli.main(argv, run=run)


def rehearse_nodes(config: WorkerConfig | str, /, **kwargs: Any) -> Rehearsal:
    """Run the worker ``config`` names as several nodes, every node an agent on this machine:
    this kernel runs one node through ``run`` (its ranks stream under the cell), the others run
    ``python -m labkit launch ...`` in the background, as real nodes would. Keyword arguments
    (``nodes=2``, ``nproc=1``, ``timeout_s=120``, and any of ``run``'s) and the details:
    :func:`labkit.jobs.cli.rehearse_nodes`."""
    return cli.rehearse_nodes(run, config, **kwargs)


def describe_rehearsal(nodes: int, nproc: int) -> str:
    """Where a rehearsal of ``nodes`` nodes of ``nproc`` ranks would run on this machine (a GPU
    per rank, or every rank on the CPU), and what it shows for real and not:
    :func:`labkit.jobs.cli.describe_rehearsal_plan` with this machine's GPU count."""
    return cli.describe_rehearsal_plan(whole("nodes", nodes, low=1), whole("nproc", nproc, low=1),
                                       visible_gpu_count())
