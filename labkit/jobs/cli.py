"""Several nodes from a terminal, and a rehearsal of them on one machine.

``python -m labkit launch MODULE --nodes N --endpoint HOST:PORT`` is the command a learner runs
on each machine of a job across nodes (``main``); ``rehearse_nodes`` runs such a job on one
machine, this kernel being one node and that command the others, which report back through
the node record ``main`` writes (``--json``). Both run a node through ``launch.run``, which
sits above this module: ``labkit.jobs.launch`` passes its ``run`` in (its ``main`` and
``rehearse_nodes`` are the public names), so this module needs nothing above the supervisor.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from labkit.config import parse_json_object
from labkit.jobs import procs, spec
from labkit.jobs.nodes import Nodes
from labkit.jobs.outcome import JobError, JobResult, LaunchError
from labkit.jobs.preflight import DEVICES, config_class, visible_gpu_count, worker_and_config
from labkit.jobs.spec import WorkerConfig
from labkit.jobs.supervisor import supervised
from labkit.validate import whole

Launcher = Callable[..., JobResult]
"""``labkit.jobs.launch.run``, as the functions here receive it."""


def main(argv: Sequence[str] | None, *, run: Launcher) -> int:
    """``python -m labkit launch MODULE ...``: the command a learner runs on each node
    (``labkit.jobs.launch.main``, which passes its ``run``)."""
    import argparse

    p = argparse.ArgumentParser(
        prog="labkit launch",
        description="Run a labkit worker module on this machine's ranks, alone or as one node "
        "of a job across machines (the same command on every node).",
    )
    p.add_argument("module", help="worker module, e.g. labkit.workers.multinode")
    p.add_argument("--nproc", type=int, default=1, help="ranks on this node (default 1)")
    p.add_argument("--nodes", help="number of nodes, or MIN:MAX for an elastic job")
    p.add_argument("--endpoint", help="HOST:PORT of the rendezvous (with --nodes)")
    p.add_argument("--rdzv-id", default="labkit", help="the job's name, the same on every node")
    p.add_argument("--node-rank", type=int, help="this node's rank: a static rendezvous")
    p.add_argument("--config", default="{}", help="the worker's config fields, as JSON (the "
                   "worker's WorkerConfig class checks them)")
    p.add_argument("--timeout", type=float, default=300, help="seconds for the whole job")
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--device", default="auto", choices=DEVICES)
    p.add_argument("--json", metavar="FILE", help="also write this node's results to FILE")
    args = p.parse_args(argv)
    try:
        config = parse_json_object(args.config, "--config")  # says it takes JSON, with an example
        job = typed_config(args.module, config)
        nodes = None
        if args.nodes or args.endpoint:
            if not (args.nodes and args.endpoint):
                raise ValueError("--nodes and --endpoint go together: both, or neither")
            nodes = Nodes(args.nodes, args.endpoint, args.rdzv_id, args.node_rank)
        res = run(job, nproc=args.nproc, nodes=nodes,
                  timeout_s=args.timeout, max_restarts=args.max_restarts,
                  device=args.device)  # fmt: skip
    except (ValueError, LaunchError) as e:
        print(f"labkit launch: {e}", file=sys.stderr)
        return 2
    except JobError as e:
        print(str(e), file=sys.stderr)
        res, code = e.result, 1
    else:
        print(repr(res))
        code = 0
    if args.json:
        spec.write_json_atomic(Path(args.json), node_record(res))
    return code


def typed_config(module: str, values: dict[str, Any]) -> WorkerConfig | str:
    """What ``launch.run`` takes for ``labkit launch MODULE --config JSON``: the worker's own
    config class built from ``values`` (each field checked there), or, for a module of your own
    that has no config class, its name alone, which takes no config."""
    cls = config_class(module)
    if cls is not None:
        return cls.from_dict(values)
    if values:
        raise ValueError(f"--config: {module} has no config class (a labkit.jobs.spec.WorkerConfig "
                         "whose WORKER names it) to take the fields; give settings through the "
                         "environment instead")  # fmt: skip
    return module


def node_record(res: JobResult) -> dict[str, Any]:
    return {
        "status": res.status,
        "node_rank": res.node_rank,
        "world_size": res.world_size,
        "results": {str(r): res.ranks[r] for r in res.local_ranks if r < len(res.ranks)},
        "wall_s": res.wall_s,
        "log_dir": str(res.log_dir),
    }


@dataclass
class Rehearsal:
    """A job of several "nodes" run on this one machine: what each node's agent reported.

    ``nodes[k]`` is node k's record: status, results by rank, wall time, log folder (and for
    the nodes run in the background, ``agent_log``, what their agent printed). ``here`` is the
    node this kernel ran (its ranks' output appeared under the cell).
    """

    nodes: list[dict[str, Any]]
    here: JobResult
    command: str  # what each node of a real cluster would run

    def output(self, node: int) -> list[str]:
        """The rank lines node ``node``'s agent printed ([] for the node this kernel ran:
        its lines appeared under the cell)."""
        path = self.nodes[node].get("agent_log")
        if not path:
            return []
        text = Path(path).read_text(errors="replace")
        return [line for line in text.splitlines() if line.startswith("[node")]

    def results(self) -> dict[int, dict[str, Any]]:
        """Every rank's result, from every node: {rank: result}."""
        out: dict[int, dict[str, Any]] = {}
        for node in self.nodes:
            out.update({int(r): res for r, res in node["results"].items()})
        return dict(sorted(out.items()))


def rehearse_nodes(
    run: Launcher,
    config: WorkerConfig | str,
    *,
    nodes: int = 2,
    nproc: int = 1,
    timeout_s: float = 120,
    **run_kwargs: Any,
) -> Rehearsal:
    """Run the worker ``config`` names (a ``WorkerConfig``, or as ``launch.run`` takes it, a
    module of your own by name) as ``nodes`` nodes of ``nproc`` ranks, every node an agent on
    this machine (``labkit.jobs.launch.rehearse_nodes``, which passes its ``run``).

    This kernel runs one node through ``run`` (its ranks stream under the cell); each other
    node is ``python -m labkit launch ... --nodes N --endpoint 127.0.0.1:PORT`` in a
    subprocess, the command a real node would run, tied to this process (it dies with the
    kernel) and ended with the job. They meet through a c10d rendezvous on a port free on
    this machine at the moment it was picked (another program could take it first: then the
    launch fails with a message, and running it again picks another).

    GPUs: every agent numbers its ranks' GPUs from 0 (``LOCAL_RANK``), so with a GPU for every
    rank of every node each agent is shown only its own slice (``CUDA_VISIBLE_DEVICES``), as
    on separate machines; with fewer, every rank runs on the CPU over gloo.
    """
    whole("nodes", nodes, low=2, why="a rehearsal of several nodes needs 2 or more")
    module, _, config_json = worker_and_config(config)  # the other nodes get it as --config
    gpus = visible_gpu_count()
    device = run_kwargs.pop("device", "auto")
    if device == "auto":
        device = "cuda" if gpus >= nodes * nproc else "cpu"
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    visible = visible or [str(i) for i in range(gpus)]
    slices = [",".join(visible[k * nproc:(k + 1) * nproc]) for k in range(nodes)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rdzv_id = f"rehearsal-{uuid.uuid4().hex[:8]}"
    layout = Nodes(nodes, endpoint=f"127.0.0.1:{port}", rdzv_id=rdzv_id)
    out_dir = procs.labkit_home() / "rehearsals" / layout.rdzv_id
    out_dir.mkdir(parents=True, exist_ok=True)
    others = []
    for k in range(1, nodes):
        cmd = supervised([
            sys.executable, "-m", "labkit", "launch", module, f"--nproc={nproc}",
            f"--nodes={nodes}", f"--endpoint={layout.endpoint}", f"--rdzv-id={layout.rdzv_id}",
            f"--config={config_json}", f"--timeout={timeout_s}", f"--device={device}",
            f"--json={out_dir / f'agent{k}.json'}",
        ])  # fmt: skip
        env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": slices[k]} if device == "cuda" else {})}
        log = open(out_dir / f"agent{k}.log", "w")  # noqa: SIM115 (closed below)
        others.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        stdin=subprocess.DEVNULL, start_new_session=True), log))  # fmt: skip
    mine = {"CUDA_VISIBLE_DEVICES": slices[0]} if device == "cuda" else {}
    try:
        here = run(config, nproc=nproc, nodes=layout, timeout_s=timeout_s,
                   device=device, env={**(run_kwargs.pop("env", None) or {}), **mine},
                   **run_kwargs)  # fmt: skip
    finally:
        deadline = time.monotonic() + 15  # the others end with the job; give them a moment
        for proc, log in others:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                procs.end_tree([psutil.Process(proc.pid)])
                proc.wait(timeout=5)
            log.close()
    records = {here.node_rank: node_record(here)}
    for k in range(1, nodes):
        rec = spec.read_json(out_dir / f"agent{k}.json")
        if rec is None:
            tail = (out_dir / f"agent{k}.log").read_text(errors="replace")[-2000:]
            raise LaunchError(f"the rehearsal's other agent {k} left no result; its output:\n{tail}")
        rec["agent_log"] = str(out_dir / f"agent{k}.log")  # what that agent printed
        records[rec["node_rank"]] = rec
    return Rehearsal([records[k] for k in sorted(records)], here, layout.command(module, nproc))


def describe_rehearsal_plan(nodes: int, nproc: int, gpus: int) -> str:
    """Where a rehearsal of ``nodes`` × ``nproc`` ranks runs on a machine with ``gpus`` GPUs
    (the rule ``rehearse_nodes`` applies), and what such a rehearsal shows for real and not."""
    world = nodes * nproc
    where = (f"each agent shown its own {nproc} of this machine's {gpus} GPU(s)" if gpus >= world
             else "every rank on the CPU over gloo"
             + (f" (this machine has {gpus} GPU(s), fewer than the {world} ranks)" if gpus else ""))  # fmt: skip
    return (f"{nodes} nodes x {nproc} rank(s) = {world} ranks, {where}\n"
            "What a rehearsal on one machine shows for real: the rendezvous, node and rank "
            "numbering, the collectives\nbetween agents, a killed rank and torchrun's restart, a "
            "checkpoint's bytes and time on this disk.\nWhat it cannot: a network between "
            "machines (the agents talk over this machine's loopback or GPU links).")  # fmt: skip
