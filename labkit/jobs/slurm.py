"""A course job on a SLURM cluster: the sbatch script that runs a labkit worker on many nodes.

    job = SlurmJob(nodes=2, gpus_per_node=8, time="00:30:00", partition="gpu")
    Path("multinode.sbatch").write_text(job.render())
    # then, on the cluster's login node:  sbatch multinode.sbatch

or from a shell: ``python -m labkit slurm --nodes 2 --gpus-per-node 8 --time 00:30:00 -o
multinode.sbatch``.

How the script runs the job (each step is commented in the script itself, for a reader who
has never seen one):

- SLURM gives the job ``nodes`` machines and runs the script once, on the first of them.
- ``srun`` starts one task per node, and each task is one torchrun *agent*; the agents meet at
  a c10d rendezvous hosted on the first node (its name from ``scontrol show hostnames``), on
  a port the script asks that node's OS for, and each agent starts the node's ranks (one per
  GPU, or ``ranks_per_node`` CPU ranks).
- Every rank runs the same worker module as ``labkit.jobs.launch.run`` does on one machine, and
  talks to the same job folder (``labkit.jobs.spec``: ``job.json`` in, ``rank{r}.json`` out),
  here ``runs/slurm-<job id>`` under the folder the job was submitted from, which must be on
  a filesystem every node sees. torchrun writes every rank's output to its own file there.

Nothing here runs SLURM; ``tests/test_slurm.py`` submits a rendered script to a real
single-node SLURM (slurmctld + slurmd on this machine).
"""

from __future__ import annotations

import json
import math
import re
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any

# The job folder and the rank prefix are the ones launch.run uses (labkit.jobs.spec: no torch).
from labkit.jobs.spec import JOB_DIR_ENV, MAX_RANKS_PER_CORE, RANK_PREFIX, SPEC_FILE
from labkit.validate import flag, whole

DEFAULT_MODULE = "labkit.workers.multinode"

# Values that end up inside the script: a name SLURM accepts and the shell cannot misread
# (no spaces, quotes, $, ;, |, &, newlines, ...).
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_PATH = re.compile(r"[A-Za-z0-9_.\-/+@]{1,4096}")
_IFNAME = re.compile(r"[A-Za-z0-9_.\-,^=]{1,64}")  # NCCL takes "eth0", "^docker,lo", "=ib0"
_MEM = re.compile(r"0|[1-9][0-9]{0,8}[KMGT]?")
CPUS_PER_GPU_RANK = 3  # the rank and two data-loader workers (see SlurmJob.cpus_per_node)
_TIME = re.compile(r"(?:(\d{1,3})-)?(\d{1,2}):(\d{2}):(\d{2})")


@dataclass(frozen=True, kw_only=True)
class SlurmJob:
    """One labkit job for SLURM's ``sbatch``.

    Attributes:
        nodes: machines in the job, >= 1. One torchrun agent runs on each.
        gpus_per_node: GPUs per machine, one rank each (NCCL). 0: CPU ranks (gloo), as many
            as ``ranks_per_node``.
        ranks_per_node: ranks each machine runs. Default: ``gpus_per_node``, or 1 CPU rank.
            A GPU job runs one rank per GPU, so it may only repeat ``gpus_per_node``.
        cpus_per_node: CPU cores SLURM reserves on each machine for its agent and ranks
            (``--cpus-per-task``: the node's one task is the agent). Default: for GPU ranks
            ``CPUS_PER_GPU_RANK`` per rank (the rank itself and two data-loader workers, the
            rule of thumb of ml-engineering's ``orchestration/slurm/performance.md``: "8 gpus
            and 2 DataLoader workers per gpu ... at least 3*8=24 cpu-cores per node"); for CPU
            ranks one per rank.
        exclusive: ask for whole machines (``--exclusive``), no other job's ranks beside
            yours. Default: True for GPU jobs, False for CPU ones.
        mem: memory per node (``--mem``): "0" is all of each node's memory (sbatch's man
            page), "64G" a size. Default: "0" with ``exclusive``, otherwise the cluster's
            default (``DefMemPerCPU``), which may be small.
        signal_s: seconds before the time limit at which SLURM sends SIGUSR1 to the batch
            script (``--signal=B:USR1@N``); its trap writes ``checkpoint_requested`` into the
            job folder, for a worker that checks for it after each step to save at once, and
            with ``requeue`` puts the job back in the queue. None: no signal.
        requeue: let SLURM requeue the job (``--requeue``): after a node failure, or from the
            trap above; the requeued job resumes from its newest checkpoint.
        time: the job's wall-clock limit, ``HH:MM:SS`` or ``D-HH:MM:SS``. SLURM ends the job
            when it is up (and schedules short jobs sooner).
        partition, account: SLURM's queue and the account billed, if the cluster needs them
            (``sinfo`` lists partitions; ``sacctmgr show assoc user=$USER`` the accounts).
        job_name: the name ``squeue`` shows; also names the job's output file.
        module: the importable worker module every rank runs (see ``labkit.jobs.runtime``).
        config: the worker's config fields, a JSON object (its ``WorkerConfig``'s ``to_dict()``).
        max_restarts: torchrun restarts all of a node's ranks this often after a failure.
        socket_ifname: the network interface between the nodes, for NCCL and gloo
            (``NCCL_SOCKET_IFNAME``/``GLOO_SOCKET_IFNAME``, e.g. "ib0" or "eth0"); None: let
            them choose.
        python: the Python every node runs; default the one this object was made in, which
            must exist at the same path on every node, with labkit importable there: the
            virtual environment and the repository on a filesystem every node sees (or the same
            container image), not a laptop-style checkout on the login node's own disk.
        runs_dir: where the job folder goes, relative to the folder the job is submitted from
            (or absolute); on a filesystem every node sees.
    """

    nodes: int = 1
    gpus_per_node: int = 0
    ranks_per_node: int | None = None
    cpus_per_node: int | None = None
    time: str = "00:30:00"
    partition: str | None = None
    account: str | None = None
    job_name: str | None = None
    module: str = DEFAULT_MODULE
    config: dict[str, Any] = field(default_factory=dict)
    max_restarts: int = 0
    exclusive: bool | None = None
    mem: str | None = None
    signal_s: int | None = None
    requeue: bool = False
    socket_ifname: str | None = None
    python: str = field(default_factory=lambda: sys.executable)
    runs_dir: str = "runs"

    def _whole(self, name: str, *, low: int, why: str) -> None:
        """Check an integer field and store it as a Python int: numpy's integers pass the
        check, and the job's spec is JSON."""
        object.__setattr__(self, name, whole(name, getattr(self, name), low=low, why=why))

    def __post_init__(self) -> None:
        self._whole("nodes", low=1, why="a number of machines, e.g. nodes=2")
        self._whole("gpus_per_node", low=0,
                    why="GPUs per machine, one rank each; 0 for CPU ranks")  # fmt: skip
        if self.ranks_per_node is not None:
            self._whole("ranks_per_node", low=1, why="ranks each machine runs, e.g. 2")
            if self.gpus_per_node and self.ranks_per_node != self.gpus_per_node:
                raise ValueError(
                    f"ranks_per_node={self.ranks_per_node} with gpus_per_node="
                    f"{self.gpus_per_node}: a GPU job runs one rank per GPU; leave "
                    "ranks_per_node out (or equal to gpus_per_node), or set gpus_per_node=0 "
                    "for CPU ranks"
                )
        if self.cpus_per_node is not None:
            self._whole("cpus_per_node", low=1,
                    why="CPU cores SLURM reserves per machine, e.g. 8")  # fmt: skip
        if not self.gpus_per_node and self.ranks > MAX_RANKS_PER_CORE * self.cpus:
            raise ValueError(
                f"ranks_per_node={self.ranks} CPU ranks on cpus_per_node={self.cpus}: at most "
                f"{MAX_RANKS_PER_CORE} per core; raise cpus_per_node to "
                f"{math.ceil(self.ranks / MAX_RANKS_PER_CORE)} or more, or run fewer ranks"
            )
        self.time_limit_s  # noqa: B018 (parses and checks time)
        for name in ("partition", "account", "job_name"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and _NAME.fullmatch(value)):
                raise ValueError(
                    f"{name}={value!r}: need 1-64 letters, digits, '.', '_' or '-' (no spaces, "
                    "quotes or shell characters: it goes into the script), e.g. 'gpu'"
                )
        if not (isinstance(self.module, str) and _MODULE.fullmatch(self.module)):
            raise ValueError(
                f"module={self.module!r}: need an importable module's dotted name, e.g. "
                f"{DEFAULT_MODULE!r}"
            )
        if not isinstance(self.config, dict):
            raise ValueError(f"config={self.config!r}: need a dict (a JSON object), e.g. "
                             '{"numel": 1024}')  # fmt: skip
        try:
            json.dumps(self.config, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"config: not plain JSON ({e}); use numbers, strings, lists and dicts"
            ) from None
        self._whole("max_restarts", low=0, why="restarts after a failure, 0 for none")
        if self.exclusive is not None:
            flag("exclusive", self.exclusive, why="or None, the default")
        if self.mem is not None and not (isinstance(self.mem, str) and _MEM.fullmatch(self.mem)):
            raise ValueError(f"mem={self.mem!r}: need '0' (all of each node's memory) or a size "
                             "such as '64G' or '500000M'")  # fmt: skip
        if self.signal_s is not None:
            self._whole("signal_s", low=1, why="seconds before the time limit, e.g. 120")
            if self.signal_s >= self.time_limit_s:
                raise ValueError(f"signal_s={self.signal_s}: the signal must come before the "
                                 f"time limit ({self.time_limit_s} s) and leave time to work")  # fmt: skip
        flag("requeue", self.requeue)
        if self.socket_ifname is not None and not (
            isinstance(self.socket_ifname, str) and _IFNAME.fullmatch(self.socket_ifname)
        ):
            raise ValueError(
                f"socket_ifname={self.socket_ifname!r}: need a network interface's name as "
                "`ip -brief addr` lists it on the nodes (e.g. 'ib0', 'eth0', or NCCL's "
                "'^docker,lo' to exclude some), or None to let NCCL and gloo choose"
            )
        for name in ("python", "runs_dir"):
            value = getattr(self, name)
            if not (isinstance(value, str) and _PATH.fullmatch(value)):
                raise ValueError(
                    f"{name}={value!r}: need a path of letters, digits and '_.-/+@' (no "
                    "spaces or shell characters: it goes into the script)"
                )
        if not self.python.startswith("/"):
            raise ValueError(
                f"python={self.python!r}: need an absolute path (`which python` on the "
                "cluster), the same on every node"
            )

    # -- derived ------------------------------------------------------------------------

    @property
    def ranks(self) -> int:
        """Ranks per node."""
        if self.ranks_per_node is not None:
            return self.ranks_per_node
        return self.gpus_per_node or 1

    @property
    def cpus(self) -> int:
        """CPU cores reserved per node (``--cpus-per-task`` of the node's one task)."""
        if self.cpus_per_node is not None:
            return self.cpus_per_node
        return self.ranks * (CPUS_PER_GPU_RANK if self.gpus_per_node else 1)

    @property
    def is_exclusive(self) -> bool:
        return bool(self.gpus_per_node) if self.exclusive is None else self.exclusive

    @property
    def memory(self) -> str | None:
        """``--mem``: the given one, "0" (all of it) on whole machines, else None."""
        if self.mem is not None:
            return self.mem
        return "0" if self.is_exclusive else None

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks

    @property
    def name(self) -> str:
        return self.job_name or f"labkit-{self.module.rsplit('.', 1)[-1]}"[:64]

    @property
    def time_limit_s(self) -> int:
        """``time`` in seconds."""
        m = _TIME.fullmatch(self.time) if isinstance(self.time, str) else None
        if m is not None:
            days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
            if minutes < 60 and seconds < 60 and (m.group(1) is None or hours < 24):
                total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
                if total > 0:
                    return total
        raise ValueError(
            f"time={self.time!r}: need the job's limit as HH:MM:SS ('00:30:00') or "
            "D-HH:MM:SS ('1-12:00:00'), minutes and seconds below 60, more than zero"
        )

    def spec(self) -> dict[str, Any]:
        """The job.json every rank reads (``labkit.jobs.runtime``): the worker's config and backend."""
        return {
            "module": self.module,
            "scheduler": "slurm",
            "nodes": self.nodes,
            "nproc": self.ranks,
            "backend": "nccl" if self.gpus_per_node else "gloo",
            "device": "cuda" if self.gpus_per_node else "cpu",
            "config": self.config,
            "max_restarts": self.max_restarts,
        }

    # -- the script ---------------------------------------------------------------------

    def render(self) -> str:
        """The sbatch script, commented for a reader who has never seen one."""
        gpus = self.gpus_per_node
        what = f"{gpus} GPU rank(s)" if gpus else f"{self.ranks} CPU rank(s)"
        sbatch = [
            f"#SBATCH --job-name={self.name}",
            f"#SBATCH --nodes={self.nodes}",
            "#SBATCH --ntasks-per-node=1        # one task per node: the node's torchrun agent",
        ]
        if gpus:
            sbatch.append(f"#SBATCH --gpus-per-node={gpus}")
        sbatch += [
            f"#SBATCH --cpus-per-task={self.cpus}          # cores for the agent and its ranks",
            f"#SBATCH --time={self.time}",
            "#SBATCH --output=%x-%j.out        # job name and job id: one file per job",
        ]
        if self.is_exclusive:
            sbatch.append("#SBATCH --exclusive                # whole machines: no other job beside")
        if self.memory is not None:
            sbatch.append(f"#SBATCH --mem={self.memory}"
                          + ("                     # all of each node's memory" if self.memory == "0" else ""))
        if self.signal_s:
            sbatch.append(f"#SBATCH --signal=B:USR1@{self.signal_s}     # SIGUSR1 to this script "
                          f"{self.signal_s} s before the limit")
        if self.requeue:
            sbatch.append("#SBATCH --requeue                  # SLURM may put the job back in the queue")
        if self.partition:
            sbatch.append(f"#SBATCH --partition={self.partition}")
        if self.account:
            sbatch.append(f"#SBATCH --account={self.account}")

        net = ""
        if self.socket_ifname:
            ifname = shlex.quote(self.socket_ifname)
            net = (
                "# The interface between the nodes, for NCCL and for gloo (without it they may\n"
                "# pick one the other nodes cannot reach, e.g. a container bridge).\n"
                f"export NCCL_SOCKET_IFNAME={ifname}\n"
                f"export GLOO_SOCKET_IFNAME={ifname}\n\n"
            )
        restarts = (
            "# A restart's ranks need a rendezvous store of their own: torch's torchrun otherwise\n"
            "# hands them the store of the attempt that failed (pytorch #135712).\n"
            "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\n"
            if self.max_restarts else ""
        )
        srun_gpus = f"--gpus-per-node={gpus} " if gpus else ""
        trap, wait = "", ""
        if self.signal_s:
            requeue = ('  scontrol requeue "$SLURM_JOB_ID"  # back in the queue; it resumes from '
                       'its newest checkpoint\n') if self.requeue else ""
            trap = (
                f"# SLURM sends SIGUSR1 {self.signal_s} s before the time limit (--signal=B:...: to this\n"
                "# script only). The trap asks the ranks for a checkpoint through a file in the job\n"
                "# folder: a worker that looks for it after each step saves at once (a worker that\n"
                "# does not only gets the requeue). bash runs a trap only between commands, so srun\n"
                "# runs in the background and the script waits for it.\n"
                "on_time_limit() {\n"
                f'  echo "job $SLURM_JOB_ID: {self.signal_s} s left, checkpoint requested"\n'
                f'  touch "${JOB_DIR_ENV}/checkpoint_requested"\n'
                f"{requeue}"
                "}\n"
                "trap on_time_limit USR1\n"
            )
            wait = (" &\nSRUN_PID=$!\n# wait returns early when the trap runs: wait again for srun itself\n"
                    'wait "$SRUN_PID" || wait "$SRUN_PID"')
        spec = json.dumps(self.spec(), indent=2, sort_keys=True, allow_nan=False)
        return f"""#!/bin/bash
# A labkit job for SLURM: {self.nodes} node(s) x {what} of {self.module}.
# Made by `python -m labkit slurm`. Submit it with:  sbatch <this file>
# Watch it with `squeue --me`; cancel it with `scancel <job id>`.
#
# The #SBATCH lines below are sbatch's options, read before the job starts (to bash they are
# comments). SLURM then runs this script once, on the first node of the allocation.
{chr(10).join(sbatch)}
#
# The --output file is opened before this script runs, in the folder sbatch was run from: a
# folder named there must already exist, or the job ends at once with no output at all.

# Stop at the first failing command, at an unset variable, and when any part of a pipe fails.
set -euo pipefail

# --- where the rendezvous is ----------------------------------------------------------------
# torchrun's agents (one per node) meet at a "rendezvous": a small key-value store on the
# first node of the allocation. $SLURM_JOB_NODELIST is compressed ("gpu[01-04]");
# scontrol expands it to one name per line; sed (not head) reads them all, so that under
# pipefail a long list never ends scontrol with SIGPIPE.
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
# Its port must be free on that node, and this script runs on that node, so it asks the OS
# for one (bind to port 0, read the number back) rather than hard-coding 29400, which two
# jobs sharing a node would both want. The race: the port is free again once this command
# ends, so another program could take it before torchrun binds it; then the rendezvous fails
# with "address already in use" and resubmitting is the fix.
RDZV_PORT=$({shlex.quote(self.python)} -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
echo "job $SLURM_JOB_ID: $SLURM_NNODES node(s) ($SLURM_JOB_NODELIST), rendezvous at $HEAD_NODE:$RDZV_PORT"

# --- the job folder -------------------------------------------------------------------------
# Every rank reads the job's spec (config, backend) from job.json here and writes its result
# to rank<r>.json; torchrun writes each rank's output to its own file under torchrun/<node>/.
# It must be on a filesystem every node sees (your home or project space, not /tmp).
export {JOB_DIR_ENV}="{self._runs_dir_sh()}/slurm-$SLURM_JOB_ID"
mkdir -p "${JOB_DIR_ENV}"
cat > "${JOB_DIR_ENV}/{SPEC_FILE}" <<'END_OF_JOB_SPEC'
{spec}
END_OF_JOB_SPEC

# --- the environment every rank inherits ----------------------------------------------------
export PYTHON={shlex.quote(self.python)}  # the Python the script was made with, on every node
export HEAD_NODE RDZV_PORT
# torchrun starts each line of a rank's output with its rank: "[rank3] ..."
export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='{RANK_PREFIX}'
export PYTHONUNBUFFERED=1  # lines arrive as they are printed, not when a buffer fills
# torch's CPU threads per rank: the node's {self.cpus} reserved core(s) shared among its
# {self.ranks} rank(s){" and their data-loader workers (" + str(CPUS_PER_GPU_RANK - 1) + " each)" if gpus else ""}. Unset, torchrun would set 1 and print a banner saying so.
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{max(1, self.cpus // (self.ranks * (CPUS_PER_GPU_RANK if gpus else 1)))}}}
{restarts}# When NCCL fails or hangs, `export NCCL_DEBUG=INFO` here makes it say which interfaces and
# transports (InfiniBand or TCP sockets) it chose, and where it stopped; it is off by default
# because it prints a lot.

{net}# --- one torchrun agent per node ------------------------------------------------------------
# srun starts one task on each node (--ntasks-per-node=1); each task is a torchrun agent that
# starts that node's {self.ranks} rank(s). srun is given --cpus-per-task (and the GPUs) again:
# some SLURM versions (22.05 among them) do not pass the job's --cpus-per-task on to a step,
# whose task would then get one core for all its ranks. --kill-on-bad-exit=1: if one node's
# agent fails, SLURM ends the others.
# The command is in single quotes so that $SLURMD_NODENAME (each node's own name, set by
# srun for the task) is read on that node, not here.
{trap}srun --ntasks-per-node=1 --cpus-per-task=$SLURM_CPUS_PER_TASK {srun_gpus}--kill-on-bad-exit=1 \\
  bash -c 'exec "$PYTHON" -m torch.distributed.run \\
    --nnodes=$SLURM_NNODES \\
    --nproc-per-node={self.ranks} \\
    --rdzv-backend=c10d \\
    --rdzv-endpoint=$HEAD_NODE:$RDZV_PORT \\
    --rdzv-id=$SLURM_JOB_ID \\
    --max-restarts={self.max_restarts} \\
    --log-dir="${JOB_DIR_ENV}/torchrun/$SLURMD_NODENAME" \\
    --tee=3 \\
    -m {self.module}'{wait}
# --rdzv-backend=c10d: the agent on $HEAD_NODE hosts the store, the others join it, and they
# number the nodes among themselves; --rdzv-id keeps two jobs on one port apart.
# --tee=3: each rank's stdout and stderr go to its own file under --log-dir as well as here.

echo "job $SLURM_JOB_ID done: results in ${JOB_DIR_ENV}/rank<r>.json"
"""

    def _runs_dir_sh(self) -> str:
        """The runs folder as the script spells it: relative ones under the submit folder."""
        if self.runs_dir.startswith("/"):
            return self.runs_dir
        return f"$SLURM_SUBMIT_DIR/{self.runs_dir}"


def describe_sbatch_here(which: Any = None) -> str:
    """One line: whether this machine has SLURM's ``sbatch`` to queue such a script, and how
    (``which``: a stand-in for ``shutil.which``, for tests)."""
    import shutil

    sbatch = (which or shutil.which)("sbatch")
    if sbatch:
        return (f"this machine: SLURM's sbatch is at {sbatch}: `python -m labkit slurm ... -o "
                "multinode.sbatch` writes this script to a file and `sbatch multinode.sbatch` "
                "queues it")  # fmt: skip
    return ("this machine: no sbatch here; the course's tests submit such a script to a one-node "
            "SLURM cluster (tests/test_slurm.py) and check every rank's output")


# --- the command line (python -m labkit slurm) -------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit slurm``: print (or write) the sbatch script and how to submit it."""
    import argparse
    from pathlib import Path

    p = argparse.ArgumentParser(
        prog="labkit slurm",
        description="Write an sbatch script that runs a labkit worker on a SLURM cluster: one "
        "torchrun agent per node, rendezvous on the first node, output per rank.",
    )
    p.add_argument("--nodes", type=int, default=1, help="machines (default 1)")
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=0,
        help="GPUs per machine, one rank each; 0 (default): CPU ranks",
    )
    p.add_argument(
        "--ranks-per-node", type=int, help="CPU ranks per machine (default: --gpus-per-node, or 1)"
    )
    p.add_argument(
        "--cpus-per-node", type=int, help="CPU cores reserved per machine (default: one per rank)"
    )
    p.add_argument(
        "--time",
        default="00:30:00",
        help="wall-clock limit, HH:MM:SS or D-HH:MM:SS (default 00:30:00)",
    )
    p.add_argument("--partition", help="SLURM partition (queue), if the cluster needs one")
    p.add_argument("--account", help="SLURM account to bill, if the cluster needs one")
    p.add_argument("--job-name", help="the name squeue shows (default labkit-<module>)")
    p.add_argument(
        "--module",
        default=DEFAULT_MODULE,
        help=f"worker module every rank runs (default {DEFAULT_MODULE})",
    )
    p.add_argument("--config", default="{}", help="the worker's config, a JSON object")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="torchrun's restarts after a failure (default 0)",
    )
    p.add_argument("--exclusive", action=argparse.BooleanOptionalAction, default=None,
                   help="whole machines (default: yes for GPU jobs, no for CPU ones)")
    p.add_argument("--mem", help="memory per node: '0' all of it (default with --exclusive), "
                   "or a size such as 64G")
    p.add_argument("--signal-s", type=int, help="SIGUSR1 this many seconds before the time "
                   "limit: the script's trap requests a checkpoint (and requeues with --requeue)")
    p.add_argument("--requeue", action="store_true", help="let SLURM requeue the job")
    p.add_argument(
        "--socket-ifname", help="network interface between the nodes (NCCL/GLOO_SOCKET_IFNAME)"
    )
    p.add_argument(
        "--python", default=sys.executable, help="the Python on the nodes (default: this one)"
    )
    p.add_argument(
        "-o", "--output", metavar="FILE", help="write the script here (default: print it)"
    )
    args = p.parse_args(argv)
    try:
        config = json.loads(args.config)
    except ValueError as e:
        print(f"labkit slurm: --config {args.config!r} is not JSON ({e}); e.g. "
              """--config '{"numel": 1024}'""", file=sys.stderr)  # fmt: skip
        return 2
    try:
        job = SlurmJob(
            nodes=args.nodes, gpus_per_node=args.gpus_per_node, ranks_per_node=args.ranks_per_node,
            cpus_per_node=args.cpus_per_node, time=args.time, partition=args.partition,
            account=args.account, job_name=args.job_name, module=args.module, config=config,
            max_restarts=args.max_restarts, socket_ifname=args.socket_ifname, python=args.python,
            exclusive=args.exclusive, mem=args.mem, signal_s=args.signal_s, requeue=args.requeue,
        )  # fmt: skip
    except ValueError as e:
        print(f"labkit slurm: {e}", file=sys.stderr)
        return 2
    script = job.render()
    if args.output is None:
        print(script, end="")
        print("# save it to a file and submit it with: sbatch FILE", file=sys.stderr)
        return 0
    path = Path(args.output)
    try:
        path.write_text(script)
        path.chmod(0o755)
    except OSError as e:
        print(f"labkit slurm: cannot write {path}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote {path}: {job.nodes} node(s) x {job.ranks} rank(s) of {job.module}, "
          f"limit {job.time}")  # fmt: skip
    print(f"submit it with: sbatch {shlex.quote(str(path))}")
    return 0
