"""A job across several machines: where this machine sits, and torchrun's flags for it.

    nodes = Nodes(2, endpoint="gpu-node-01:29400", rdzv_id="course-demo")
    launch.run(MultinodeConfig(), nproc=8, nodes=nodes)   # the same line on every node

torchrun starts one *agent* per machine (node); the agents meet at a *rendezvous* and agree
on who is in the job, then each starts its ``nproc`` ranks. Two ways to meet
(torch/distributed/run.py, "Usage"):

- **c10d rendezvous** (``node_rank`` left None, the default): the agent on the endpoint's
  machine hosts a small key-value store there (a TCPStore; torch's c10d_rendezvous_backend.py
  matches the endpoint against this machine's host name, its full name and the addresses that
  name resolves to, not every network card's: ``agent_hosts_here``; on one machine the first
  agent to bind the port wins) and every agent registers with it; the others wait for it about
  a minute (its read timeout) before giving up. Node ranks are handed out when the rendezvous
  completes, in an order the agents agree on (torch sorts them by address and process id), so
  no machine needs to know its place beforehand, and ``count`` may be a range ``"2:4"``: the
  job starts once 2 nodes are in and admits up to 4 (an *elastic* job).
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

import contextlib
import errno
import ipaddress
import re
import socket
from dataclasses import dataclass

import psutil

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


# --- can this machine use the endpoint? (asked before torchrun starts) -------------------------

CONNECT_TIMEOUT_S = 5.0
"""How long the probe waits for the endpoint's machine to answer at all. torchrun itself would
retry for over a minute and then print a raw connection error."""

_FREE_PORT_HINT = (
    "`python -c \"import socket; s = socket.socket(); s.bind(('', 0)); "
    "print(s.getsockname()[1])\"` prints a free one"
)


def endpoint_problem(nodes: Nodes, connect_timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """Why this machine cannot use ``nodes.endpoint`` as a rendezvous, worded for the learner
    with the fix; None when a quick look finds nothing wrong.

    torchrun alone reports these late and raw: a host name that does not resolve, or a machine
    that does not answer, after about 80 s of retries; a port on this machine held by another
    program after a minute, blaming the other nodes or a firewall (its agent connects to that
    program as if it were the rendezvous, and waits for an answer that never comes); an
    endpoint that is this machine by an address torch does not take for it (a second network
    card's), where no agent hosts the rendezvous and every one waits for it.
    """
    host, port = nodes.host, nodes.port
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        return (
            f"the rendezvous endpoint {nodes.endpoint!r} names host {host!r}, which does not "
            f"resolve to an address ({getattr(e, 'strerror', None) or e}). Check the spelling; "
            "give the endpoint machine's name as the other nodes know it (`hostname -f` on "
            "it), or its address (`hostname -I`)"
        )
    addresses = sorted({info[4][0] for info in infos})
    recognised = agent_hosts_here(host)
    if not recognised and not is_this_machine(addresses):
        return _reach_problem(nodes, infos, connect_timeout_s)
    if nodes.static:
        # Node 0 hosts the store, whatever the endpoint's spelling (torch's
        # static_tcp_rendezvous.py: is_master = rank == 0); the others connect to it.
        return _held_port_problem(nodes) if nodes.node_rank == 0 else None
    if recognised:
        return _held_port_problem(nodes)
    return _unrecognised_problem(nodes, addresses)


def agent_hosts_here(host: str) -> bool:
    """Whether torchrun's c10d agent on this machine takes ``host`` for this machine, and so
    hosts the rendezvous there (else it only connects to it, as on any other node).

    torch 2.13's ``_matches_machine_hostname`` (torch/distributed/elastic/rendezvous/utils.py,
    used by c10d_rendezvous_backend.py), rule for rule: "localhost" or a loopback address;
    this machine's host name (``socket.gethostname()``) or the full name it resolves to; an
    address that name resolves to, given as such or as a name resolving to it. An address of
    a second network card that the host name does not resolve to is *not* this machine to
    torch (its docstring says so). Mirrored, not imported: it is private to torch.
    """
    if host == "localhost":
        return True
    try:
        literal: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None and literal.is_loopback:
        return True
    host_addresses = {info[4][0] for info in _resolve(host)}
    this_host = socket.gethostname()
    if host == this_host:
        return True
    for _, _, _, canonical, sockaddr in _resolve(this_host):
        if canonical and canonical == host:
            return True
        if literal is not None and sockaddr[0] == str(literal):
            return True
        if sockaddr[0] in host_addresses:
            return True
    return False


def _resolve(host: str) -> list:
    """``getaddrinfo`` as torch's test calls it; [] where the name does not resolve (torch
    gives up on the endpoint's name the same way, and fails outright on its own host name's)."""
    try:
        return socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP, flags=socket.AI_CANONNAME)
    except (ValueError, OSError):
        return []


def is_this_machine(addresses: list[str]) -> bool:
    """Whether one of ``addresses`` (an endpoint's, resolved) reaches this machine: a loopback
    address, or one that a network interface of this machine has. Wider than torch's test of
    whether its agent hosts the rendezvous (``agent_hosts_here``): a second card's address is
    this machine here, and not to torch."""
    mine: set[str] = set()
    with contextlib.suppress(OSError, psutil.Error):
        for addrs in psutil.net_if_addrs().values():
            mine.update(a.address.split("%")[0] for a in addrs)
    for address in addresses:
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(address.split("%")[0]).is_loopback:
                return True
        if address.split("%")[0] in mine:
            return True
    return False


def _held_port_problem(nodes: Nodes) -> str | None:
    """An agent here hosts the rendezvous on the endpoint's port (node 0 of a static job; under
    c10d, torch takes the endpoint for this machine): is the port free for it?"""
    port = nodes.port
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # As the rendezvous store does: a port whose last connection is in TIME_WAIT is free.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("", port))
        return None
    except PermissionError:
        return (
            f"the rendezvous endpoint {nodes.endpoint!r} is this machine, and its port {port} "
            "is below 1024: only root may listen there. Pick a port from 1024 to 65535 for "
            f"every node ({_FREE_PORT_HINT})"
        )
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            return None  # not ours to judge: torchrun will say
    holder = port_holder(port)
    if not nodes.static and holder is not None and is_torchrun_agent(holder):
        # Another agent on this machine hosts the rendezvous already (a rehearsal of several
        # nodes on one machine): ours connects to it.
        return None
    who = _describe(holder) if holder else (
        f"a program of another user (as root, `ss -ltnp 'sport = :{port}'` names it)"
    )  # fmt: skip
    if nodes.static:
        # TCPStore's server does not retry a port in use: node 0's agent stops at once.
        then = ("this node is node 0 of a static rendezvous, so its torchrun agent must host "
                "the rendezvous on that port, and would stop at once, unable to listen there")
    else:
        # c10d_rendezvous_backend.py: hosting fails, so the agent connects as a client instead.
        then = (f"torchrun's agent here must host the rendezvous there (torch takes "
                f"{nodes.host!r} for this machine); unable to listen, it would connect to that "
                "program instead, wait a minute for an answer, then blame the other nodes")
    return (
        f"the rendezvous port {port} of endpoint {nodes.endpoint!r} is already taken on this "
        f"machine, by {who}: {then}. Stop that program, or pick another port and give the "
        f"same endpoint to every node ({_FREE_PORT_HINT})"
    )


def _unrecognised_problem(nodes: Nodes, addresses: list[str]) -> str:
    """A c10d endpoint that reaches this machine, spelt in a way torch does not take for this
    machine (a second network card's address): no node's agent hosts the rendezvous, and
    every one waits for it."""
    this_host = socket.gethostname()
    known = sorted({info[4][0] for info in _resolve(this_host)})
    resolved = ", ".join(known) if known else "none: it does not resolve"
    spelt = ("an address" if nodes.host in addresses
             else f"a name resolving to {', '.join(addresses)}")  # fmt: skip
    return (
        f"the rendezvous endpoint {nodes.endpoint!r} is this machine ({spelt} it has), but "
        "torch does not take it for this machine: its agent hosts the rendezvous only at "
        f"loopback, this machine's host name {this_host!r}, its full name, or the addresses "
        f"that name resolves to ({resolved}). So no node's agent would host the rendezvous, "
        "and each would wait for it over a minute, then fail. Give every node the endpoint "
        f"'{this_host}:{nodes.port}' (or this machine's `hostname -f`), a name the other "
        "nodes resolve to this machine; every node on this machine alone (a rehearsal): "
        f"'127.0.0.1:{nodes.port}'"
    )


def port_holder(port: int) -> psutil.Process | None:
    """The process listening on TCP ``port`` here; None if none or it cannot be told (another
    user's sockets show no process)."""
    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections(kind="tcp"):
            listens = conn.status == psutil.CONN_LISTEN and conn.laddr
            if listens and conn.laddr.port == port and conn.pid is not None:
                return psutil.Process(conn.pid)
    return None


def is_torchrun_agent(p: psutil.Process) -> bool:
    """Whether ``p`` is torchrun's agent (``python -m torch.distributed.run`` or the
    ``torchrun`` script): by its command line; False when that cannot be read."""
    with contextlib.suppress(psutil.Error):
        cmd = p.cmdline()
        return "torch.distributed.run" in cmd or any(a.endswith("torchrun") for a in cmd[:2])
    return False


def _describe(p: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        cmd = " ".join(p.cmdline()) or p.name()
        return f"process {p.pid} (`{cmd[:100]}{'…' if len(cmd) > 100 else ''}`)"
    return f"process {p.pid}"


def _reach_problem(nodes: Nodes, infos: list, timeout_s: float) -> str | None:
    """The endpoint is another machine: does it answer at all? "Connection refused" counts as
    an answer (the machine is up; its agent may simply not have started yet)."""
    failure = ""
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as s:
            s.settimeout(timeout_s)
            try:
                s.connect(address)
                return None
            except ConnectionRefusedError:
                return None
            except TimeoutError:
                failure = f"no answer within {timeout_s:g} s"
            except OSError as e:
                failure = e.strerror or str(e)
    return (
        f"the rendezvous endpoint {nodes.endpoint!r} cannot be reached from this machine "
        f"(host {nodes.host!r}: {failure}): torchrun would retry for over a minute, then fail. "
        "Check that the endpoint names the first node by a name or address the other nodes "
        "can reach (not 127.0.0.1 or localhost, unless every node is this machine), that the "
        "machine is up, and that no firewall blocks the port between the nodes"
    )
