"""A job across several machines: where this machine sits, and torchrun's flags for it.

    nodes = Nodes(2, endpoint="gpu-node-01:29400", rdzv_id="course-demo")
    launch.run("labkit.workers.multinode", nproc=8, nodes=nodes)   # the same line on every node

torchrun starts one *agent* per machine (node); the agents meet at a *rendezvous* and agree
on who is in the job, then each starts its ``nproc`` ranks. Two ways to meet
(torch/distributed/run.py, "Usage"):

- **c10d rendezvous** (``node_rank`` left None, the default): the agent on the endpoint's
  machine hosts a small key-value store there (a TCPStore; torch's c10d_rendezvous_backend.py
  matches the endpoint against the machine's names and addresses, and on one machine the first
  agent to bind the port wins) and every agent registers with it; the others wait for it about
  a minute (its read timeout) before giving up. Node ranks are handed out when the rendezvous completes, in an order the agents agree on
  (torch sorts them by address and process id), so no machine needs to know its place
  beforehand, and ``count`` may be a range ``"2:4"``: the job starts once 2 nodes are in and
  admits up to 4 (an *elastic* job).
- **static rendezvous** (``node_rank`` given): each machine is told its place; node 0 hosts the
  store at ``endpoint``. This is ``torchrun --node-rank=R --master-addr=... --master-port=...``.

Either way, torchrun numbers the ranks node by node: with ``nproc`` ranks per node, node ``k``
holds ranks ``k*nproc .. k*nproc + nproc - 1`` (``rank_range``).

The endpoint's port must be known to every node before the job starts, so it cannot be the
"any free port" (0) a one-machine job uses: pick one that is free on the endpoint's machine
(``python -c "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"``
prints one) and give the same to every node.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

_ID = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
_HOST = re.compile(r"[A-Za-z0-9_.\-:]{1,253}")
_COUNT = re.compile(r"(\d+)(?::(\d+))?")


@dataclass(frozen=True)
class Nodes:
    """This machine's place in a job of several machines.

    Attributes:
        count: number of nodes, or a range "MIN:MAX" for an elastic job (c10d only).
        endpoint: "host:port" of the rendezvous: a machine every node can reach, usually the
            first node. The port must be given (not 0) and the same on every node.
        rdzv_id: the job's name at the rendezvous, the same on every node; two jobs that share
            an endpoint are kept apart by it.
        node_rank: this node's place, 0..count-1, for a static rendezvous; None (default): the
            c10d rendezvous assigns it.
    """

    count: int | str
    endpoint: str
    rdzv_id: str = "labkit"
    node_rank: int | None = None

    def __post_init__(self) -> None:
        lo, hi = self.min_nodes, self.max_nodes  # parses and checks count
        host, sep, port = self.endpoint.rpartition(":")
        if not sep or not host or not _HOST.fullmatch(host) or not port.isdigit():
            raise ValueError(
                f"endpoint={self.endpoint!r}: need 'host:port' of the rendezvous, e.g. "
                "'gpu-node-01:29400' (the first node's name or address, and a port free there)"
            )
        if not 1 <= int(port) <= 65535:
            raise ValueError(
                f"endpoint={self.endpoint!r}: port {port} cannot be a rendezvous port. Every node "
                "must know the port before the job starts, so it cannot be 0 ('any free port', "
                "which only a one-machine job can use): pick one free on the endpoint's machine, "
                "1024..65535, and give the same to every node"
            )
        if not isinstance(self.rdzv_id, str) or not _ID.fullmatch(self.rdzv_id):
            raise ValueError(
                f"rdzv_id={self.rdzv_id!r}: need 1-128 letters, digits, '.', '_' or '-', the "
                "same on every node (e.g. the scheduler's job id)"
            )
        if self.node_rank is not None:
            if lo != hi:
                raise ValueError(
                    f"node_rank={self.node_rank} with count={self.count!r}: a fixed node rank "
                    "needs a fixed number of nodes. Leave node_rank=None for an elastic job "
                    "(the c10d rendezvous assigns node ranks)"
                )
            if (
                isinstance(self.node_rank, bool)
                or not isinstance(self.node_rank, int)
                or not (0 <= self.node_rank < hi)
            ):
                raise ValueError(
                    f"node_rank={self.node_rank!r}: need an integer 0..{hi - 1} (count={hi}), "
                    "a different one on each node"
                )

    @property
    def _bounds(self) -> tuple[int, int]:
        if isinstance(self.count, bool):
            raise ValueError(f"count={self.count!r}: need a number of nodes, e.g. 2, or '1:4'")
        m = _COUNT.fullmatch(str(self.count).strip())
        if not m:
            raise ValueError(
                f"count={self.count!r}: need a number of nodes (2) or an elastic range "
                "'MIN:MAX' ('2:4': start with 2, admit up to 4)"
            )
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if not 1 <= lo <= hi:
            raise ValueError(f"count={self.count!r}: need 1 <= MIN <= MAX nodes")
        return lo, hi

    @property
    def min_nodes(self) -> int:
        return self._bounds[0]

    @property
    def max_nodes(self) -> int:
        return self._bounds[1]

    @property
    def static(self) -> bool:
        """True for a static rendezvous (node ranks given), False for c10d."""
        return self.node_rank is not None

    @property
    def host(self) -> str:
        return self.endpoint.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.endpoint.rpartition(":")[2])

    @property
    def on_loopback(self) -> bool:
        """The rendezvous is on this machine's loopback: every "node" is this machine (a
        rehearsal), so gloo may talk over ``lo``; real nodes need a real interface."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def torchrun_args(self) -> list[str]:
        """torchrun's flags that place this agent in the job (run.py's argument names)."""
        lo, hi = self._bounds
        if self.static:
            return [
                f"--nnodes={hi}",
                f"--node-rank={self.node_rank}",
                f"--master-addr={self.host}",
                f"--master-port={self.port}",
            ]
        return [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.rdzv_id}",
            f"--nnodes={lo}" if lo == hi else f"--nnodes={lo}:{hi}",
        ]

    def command(self, module: str, nproc: int) -> str:
        """The torchrun line to type on each node (the same on every node for c10d; for a
        static rendezvous each node puts its own ``--node-rank``)."""
        args = self.torchrun_args()
        if self.static:
            args = [a if not a.startswith("--node-rank=") else "--node-rank=<this node: 0, 1, ...>"
                    for a in args]  # fmt: skip
        return " ".join(["torchrun", *args, f"--nproc-per-node={nproc}", "-m", module])


def rank_range(node_rank: int, nproc: int) -> range:
    """The global ranks torchrun gives node ``node_rank`` when every node runs ``nproc``."""
    return range(node_rank * nproc, (node_rank + 1) * nproc)
