"""labkit.jobs.launch at the edges (issue 31): a kernel restart mid-job, a rendezvous endpoint that
cannot work, a write cut short by a full disk, and ``env`` of the wrong type.

Processes are found by an environment variable that only this test's processes carry, so a
process that escaped its parent (an orphan adopted by PID 1) is found too.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from labkit.jobs import launch, nodes, observers, preflight, procs, runtime, spawn, supervisor
from labkit.jobs.nodes import Nodes
from labkit.workers._faults import FaultsConfig

REPO = Path(__file__).resolve().parents[1]
LINUX = sys.platform.startswith("linux")


def marked(name: str, value: str) -> list[int]:
    """PIDs of live (non-zombie) processes whose environment has ``name=value``."""
    found = []
    for p in psutil.process_iter(["environ", "status"]):
        with contextlib.suppress(psutil.Error, OSError):
            if (p.info["environ"] or {}).get(name) == value and p.info["status"] != "zombie":
                found.append(p.pid)
    return found


def wait_until_gone(name: str, value: str, guard_s: float) -> list[int]:
    """Poll until no process carries ``name=value``; return those left when ``guard_s`` (a
    guard against a hang, not a speed limit) ran out."""
    deadline = time.monotonic() + guard_s
    while (left := marked(name, value)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture
def mark():
    """A unique marker for this test's processes; anything still carrying it is killed after."""
    value = uuid.uuid4().hex
    yield value
    for pid in marked("T31_PROCESS_MARK", value):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def home(tmp_path, monkeypatch):
    path = tmp_path / "home"
    monkeypatch.setenv("LABKIT_HOME", str(path))
    return path


# --- a kernel restart during a job ----------------------------------------------------------------

# A job's stand-in: ignores SIGTERM and starts a child that inherits SIG_IGN, then waits.
_STUBBORN = (
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
    "print('ready', flush=True)\n"
    "time.sleep(300)\n"
)

# The owner (a notebook kernel's stand-in) starts the job the way labkit.jobs.launch does.
_OWNER = """
import subprocess, sys, time
from labkit.jobs import supervisor
job = subprocess.Popen(supervisor.supervised([sys.executable, "-c", {stubborn!r}]),
                       stdout=subprocess.PIPE, text=True, start_new_session=True)
print(job.stdout.readline().strip(), flush=True)
time.sleep(300)
"""


@pytest.mark.skipif(not LINUX, reason="the supervisor needs Linux (prctl)")
def test_a_killed_owner_takes_down_a_job_whose_processes_ignore_sigterm(mark):
    """SIGKILL to the owner (Jupyter's restart) must end the job, down to a grandchild that
    inherited SIG_IGN for SIGTERM and was orphaned: a parent-death signal alone reaches only
    the direct child, and SIGTERM alone ends none of them."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "T31_PROCESS_MARK": mark}
    owner = subprocess.Popen([sys.executable, "-c", _OWNER.format(stubborn=_STUBBORN)], env=env,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert owner.stdout.readline().strip() == "ready"
    assert len(marked("T31_PROCESS_MARK", mark)) == 4  # owner, supervisor, job, its child
    owner.kill()
    owner.wait(timeout=10)
    left = wait_until_gone("T31_PROCESS_MARK", mark, guard_s=supervisor.SUPERVISOR_GRACE_S + 15)
    assert not left, f"still running after the owner's death: {left}"


@pytest.mark.skipif(not LINUX, reason="the supervisor needs Linux (prctl)")
def test_the_supervisor_exits_as_its_command_did_and_ends_what_it_left(mark):
    env = {**os.environ, "PYTHONPATH": str(REPO), "T31_PROCESS_MARK": mark}

    def run(code: str) -> int:
        cmd = supervisor.supervised([sys.executable, "-c", code])
        return subprocess.run(cmd, env=env, timeout=60).returncode

    assert run("import sys; sys.exit(3)") == 3
    assert run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)") == -signal.SIGKILL
    # It exits 0, leaving a child that ignores SIGTERM: the supervisor ends that child.
    leaves = (
        "import signal, subprocess, sys\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
    )
    assert run(leaves) == 0
    assert not marked("T31_PROCESS_MARK", mark), "the command's leftover child is still running"


def test_the_plain_wrapper_still_execs_in_place():
    """Without --supervise (the profilers' use) the wrapper execs: same PID, signal armed."""
    probe = ("import os; from labkit.jobs import spawn; "
             "print(spawn.get_parent_death_signal(), os.environ['LABKIT_AGENT_PID'] == str(os.getpid()))")  # fmt: skip
    cmd = [sys.executable, "-m", "labkit.jobs.spawn", "SIGTERM", str(os.getpid()), "--",
           sys.executable, "-c", probe]  # fmt: skip
    out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    expected = [str(int(signal.SIGTERM)) if LINUX else "0", "True"]
    assert out.returncode == 0 and out.stdout.split() == expected, out.stderr
    assert spawn.get_parent_death_signal() == 0


def _stress_script():
    path = REPO / "scripts" / "stress_kernel_restart.py"
    spec = importlib.util.spec_from_file_location("stress_kernel_restart", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="the supervisor needs Linux (prctl)")
@pytest.mark.parametrize("mode", ["now", "graceful", "now"], ids=["now", "graceful", "now-again"])
def test_a_kernel_restart_during_a_job_leaves_nothing_running(mode, tmp_path):
    """A real Jupyter kernel runs launch.run; rank 0 has started a child that ignores SIGTERM;
    the kernel is restarted. Nothing of the job may be left (scripts/stress_kernel_restart.py
    runs the same trial 20+ times)."""
    pytest.importorskip("jupyter_client")
    stress = _stress_script()
    res = stress.trial(mode, after_s=supervisor.SUPERVISOR_GRACE_S + 15, workdir=tmp_path)
    assert res.started, "the job never got going before the restart"
    assert res.clean, f"still running after the {mode} restart: {res.survivors}"


# --- a rendezvous endpoint that cannot work ------------------------------------------------------


@pytest.fixture
def no_spawn(home, monkeypatch):
    def refuse(self):
        raise AssertionError("run() started torchrun for an endpoint it should have refused")

    monkeypatch.setattr(supervisor.Supervisor, "start", refuse)
    return home


def test_a_rendezvous_port_held_by_another_program_is_named_at_once(no_spawn):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(launch.LaunchError) as info:
            launch.run(FaultsConfig(), nproc=1, stream=False,
                       nodes=Nodes(2, endpoint=f"127.0.0.1:{port}"))  # fmt: skip
    msg = str(info.value)
    assert f"rendezvous port {port} of endpoint '127.0.0.1:{port}' is already taken" in msg, msg
    assert f"by process {os.getpid()} (" in msg, "the holder (this test process) is named"
    assert "torch takes '127.0.0.1' for this machine" in msg, "c10d: the agent here hosts it"
    assert "Stop that program, or pick another port" in msg
    assert not (no_spawn / "runs").exists(), "nothing may be started"


def test_a_static_node_0_refuses_a_held_port_too(no_spawn):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        problem = nodes.endpoint_problem(Nodes(2, endpoint=f"localhost:{port}", node_rank=0))
        assert problem and f"rendezvous port {port}" in problem
        assert "node 0 of a static rendezvous" in problem and "stop at once" in problem
        # node 1 only connects to node 0's rendezvous: a taken port is what it expects
        assert nodes.endpoint_problem(Nodes(2, endpoint=f"localhost:{port}", node_rank=1)) is None


def test_a_free_local_endpoint_and_an_agent_already_hosting_it_pass(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert nodes.endpoint_problem(Nodes(2, endpoint=f"127.0.0.1:{port}")) is None
    # A rehearsal of several nodes on one machine: another agent of the job hosts it already.
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                              "-m", "torch.distributed.run"])  # fmt: skip
    try:
        monkeypatch.setattr(nodes, "port_holder", lambda p: psutil.Process(agent.pid))
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            held.listen()
            taken = held.getsockname()[1]
            assert nodes.endpoint_problem(Nodes(2, endpoint=f"127.0.0.1:{taken}")) is None
    finally:
        agent.kill()
        agent.wait()


class Started(Exception):
    """Raised where run() would start torchrun: it got past every check."""


# A killed kernel's torchrun agent: still listening on the rendezvous port. Its command line
# ends in "-m torch.distributed.run", as an agent's does.
_LEFTOVER_AGENT = (
    "import socket, time\n"
    "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
    "print(s.getsockname()[1], flush=True)\n"
    "time.sleep(120)\n"
)


@pytest.mark.parametrize("node_rank", [0, None], ids=["static", "c10d"])
def test_a_leftover_job_on_the_rendezvous_port_is_ended_before_the_port_is_judged(
    home, monkeypatch, mark, capsys, node_rank
):
    """The port is held by a registered job whose kernel is gone: run() ends it (cleanup) and
    then finds the port free; judged before, static refused it as a stranger and c10d took it
    for another agent hosting the rendezvous."""
    env = {**os.environ, "T31_PROCESS_MARK": mark}
    cmd = [sys.executable, "-c", _LEFTOVER_AGENT, "-m", "torch.distributed.run"]
    agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(agent.stdout.readline())
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        runtime.write_json_atomic(procs.registry_dir() / "leftover.json", {
            "job_id": "leftover", "module": "labkit.workers._faults", "job_dir": str(home),
            "owner": {"pid": gone.pid, "create_time": 0.0},  # the killed kernel
            "agent": procs.record(psutil.Process(agent.pid)), "workers": [],
        })  # fmt: skip
        judged: list[bool] = []  # whether the leftover still ran when the endpoint was judged
        real = preflight.endpoint_problem

        def endpoint_problem(n):
            judged.append(agent.poll() is None and procs.alive(psutil.Process(agent.pid)))
            return real(n)

        def start(self):
            raise Started

        monkeypatch.setattr(preflight, "endpoint_problem", endpoint_problem)
        monkeypatch.setattr(supervisor.Supervisor, "start", start)
        layout = Nodes(2, endpoint=f"127.0.0.1:{port}", node_rank=node_rank)
        with pytest.raises(Started):
            launch.run(FaultsConfig(), nproc=1, stream=False, nodes=layout)
        assert judged == [False], "the endpoint was judged while the leftover job still held it"
        assert "ended 1 leftover process(es) of job leftover" in capsys.readouterr().out
    finally:
        agent.kill()
        agent.wait()


def test_an_unresolvable_endpoint_host_fails_at_once_naming_it(no_spawn):
    with pytest.raises(launch.LaunchError) as info:
        launch.run(FaultsConfig(), nproc=1, stream=False,
                   nodes=Nodes(2, endpoint="nonexistent.invalid:29400"))  # fmt: skip
    msg = str(info.value)
    assert "host 'nonexistent.invalid', which does not resolve to an address" in msg, msg
    assert "`hostname -f`" in msg


def test_an_endpoint_host_that_does_not_answer_fails_naming_it(monkeypatch):
    """A machine that drops the connection attempt (down, or a firewall): the probe's connect
    times out. Simulated: whether a real address answers depends on the network."""

    class Silent(socket.socket):
        def connect(self, address):
            raise TimeoutError("timed out")

    def getaddrinfo(host, port, **kw):
        if host != "gpu-node-01":  # this machine's own name: not that machine's address
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("203.0.113.9", port))]

    monkeypatch.setattr(nodes.socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(nodes.socket, "socket", Silent)
    problem = nodes.endpoint_problem(Nodes(2, endpoint="gpu-node-01:29400"), connect_timeout_s=0.5)
    assert problem is not None
    assert "'gpu-node-01:29400' cannot be reached from this machine" in problem
    assert "host 'gpu-node-01': no answer within 0.5 s" in problem
    assert "firewall" in problem


def test_a_remote_endpoint_that_refuses_is_fine_its_agent_may_start_later():
    with socket.socket() as s:  # a port nobody listens on: "connection refused", an answer
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    infos = socket.getaddrinfo("127.0.0.1", port, type=socket.SOCK_STREAM)
    assert nodes._reach_problem(Nodes(2, endpoint=f"other:{port}"), infos, 2.0) is None


# torch's test of whether its c10d agent hosts the rendezvous, and labkit's copy of it, on a
# made-up machine: host name node1 (full name node1.cluster) resolving to 10.0.0.5 (eth0);
# a second card, ib0, has 10.1.0.5, which only the name "node1-ib" resolves to.
_DNS = {
    "localhost": ("localhost", "127.0.0.1"),
    "127.0.0.1": ("127.0.0.1", "127.0.0.1"),
    "node1": ("node1.cluster", "10.0.0.5"),
    "node1.cluster": ("node1.cluster", "10.0.0.5"),
    "alias": ("node1.cluster", "10.0.0.5"),
    "10.0.0.5": ("10.0.0.5", "10.0.0.5"),
    "10.1.0.5": ("10.1.0.5", "10.1.0.5"),
    "node1-ib": ("node1-ib", "10.1.0.5"),
    "other": ("other", "10.9.9.9"),
}
_CARDS = {"lo": ["127.0.0.1"], "eth0": ["10.0.0.5"], "ib0": ["10.1.0.5"]}


@pytest.fixture
def node1(monkeypatch):
    """This machine is node1 of ``_DNS`` and ``_CARDS``, to torch and to labkit alike."""

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        if host not in _DNS:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        canonical, address = _DNS[host]
        name = canonical if flags & socket.AI_CANONNAME else ""
        return [
            (socket.AF_INET, type or socket.SOCK_STREAM, proto or 6, name, (address, port or 0))
        ]

    monkeypatch.setattr(socket, "gethostname", lambda: "node1")
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    cards = {card: [SimpleNamespace(address=a) for a in addrs] for card, addrs in _CARDS.items()}
    monkeypatch.setattr(nodes.psutil, "net_if_addrs", lambda: cards)


@pytest.mark.parametrize(("host", "hosts"), [
    ("localhost", True), ("127.0.0.1", True), ("node1", True), ("node1.cluster", True),
    ("alias", True), ("10.0.0.5", True), ("10.1.0.5", False), ("node1-ib", False),
    ("other", False), ("nowhere.invalid", False),
])  # fmt: skip
def test_labkit_and_torch_agree_on_which_endpoint_the_agent_here_hosts(node1, host, hosts):
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    assert _matches_machine_hostname(host) is hosts, "torch's rule is not what this test assumes"
    assert nodes.agent_hosts_here(host) is hosts


@pytest.mark.parametrize("host", ["10.1.0.5", "node1-ib"])
def test_a_c10d_endpoint_on_a_second_card_is_refused_no_agent_would_host_it(node1, host):
    """torch's agent takes 10.1.0.5 for another machine and connects to it; so does every
    other node's: nobody hosts the rendezvous."""
    port = _free_port()
    problem = nodes.endpoint_problem(Nodes(2, endpoint=f"{host}:{port}"))
    assert problem is not None
    assert f"'{host}:{port}' is this machine" in problem, problem
    assert "torch does not take it for this machine" in problem
    assert "the addresses that name resolves to (10.0.0.5)" in problem
    assert "no node's agent would host the rendezvous" in problem
    assert f"Give every node the endpoint 'node1:{port}'" in problem
    # A static rendezvous does not ask torch's rule: node 0 hosts it wherever it is.
    assert nodes.endpoint_problem(Nodes(2, endpoint=f"{host}:{port}", node_rank=0)) is None


@pytest.mark.parametrize("host", ["node1", "node1.cluster", "alias", "10.0.0.5"])
def test_a_c10d_endpoint_torch_takes_for_this_machine_passes_when_its_port_is_free(node1, host):
    assert nodes.endpoint_problem(Nodes(2, endpoint=f"{host}:{_free_port()}")) is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- which processes are the ranks ------------------------------------------------------------


@dataclass
class FakeProcess:
    """The part of psutil.Process that observers.ranks_under and Job.rank_pids use."""

    pid: int
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    kids: list[FakeProcess] = field(default_factory=list)

    def cmdline(self) -> list[str]:
        return self.cmd

    def children(self, recursive: bool = False) -> list[FakeProcess]:
        return self.kids

    def environ(self) -> dict[str, str]:
        return self.env


def test_a_dead_ranks_orphans_under_the_supervisor_are_not_ranks(monkeypatch, tmp_path):
    """Rank 1 died; its child (RANK=1 inherited) and grandchild were adopted by the supervisor,
    a child subreaper. Only torchrun's children are ranks."""
    py = sys.executable
    rank0 = FakeProcess(110, [py, "-m", "labkit.workers._faults"], {"RANK": "0"})
    torchrun = FakeProcess(101, [py, "-m", "torch.distributed.run", "-m", "m"], kids=[rank0])
    grandchild = FakeProcess(151, [py, "-c", "pass"], {"RANK": "1"})
    orphan = FakeProcess(150, [py, "-c", "pass"], {"RANK": "1"}, kids=[grandchild])
    supervisor = FakeProcess(100, [py, "-m", "labkit.jobs.spawn", "SIGTERM", "1", "--supervise=5",
                                   "--", py, "-m", "torch.distributed.run"],
                             kids=[torchrun, orphan])  # fmt: skip
    table = {p.pid: p for p in (supervisor, torchrun, orphan, grandchild, rank0)}
    monkeypatch.setattr(observers.psutil, "Process", lambda pid: table[pid])

    assert [p.pid for p in observers.ranks_under(100)] == [110]
    job = launch.Job("j", "m", 2, "gloo", "cpu", {}, tmp_path, agent_pid=100)
    assert job.rank_pids() == {0: 110}, "rank 1 is dead: no process may stand in for it"
    # Where the supervisor cannot run, agent_pid is torchrun itself.
    assert [p.pid for p in observers.ranks_under(101)] == [110]


# --- a write cut short by a full disk -------------------------------------------------------------


def _write_with_no_room(path: Path) -> subprocess.CompletedProcess:
    """dist.write_json_atomic in a process that may not grow any file (RLIMIT_FSIZE=0): the
    temporary file is created, and writing to it fails, as on a full disk."""
    code = (
        "import resource, signal, sys; from pathlib import Path; from labkit import dist\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))\n"
        f"dist.write_json_atomic(Path({str(path)!r}), {{'job_id': 'x'}})\n"
    )
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.mark.skipif(not LINUX, reason="RLIMIT_FSIZE semantics are Linux's")
def test_a_failed_atomic_write_leaves_no_temporary_file(tmp_path):
    out = _write_with_no_room(tmp_path / "jobs" / "x.json")
    assert out.returncode != 0 and "File too large" in out.stderr, out.stderr
    assert sorted(p.name for p in (tmp_path / "jobs").iterdir()) == [], "a .tmp file stayed"


def test_cleanup_removes_temporary_files_of_dead_writers_only(home):
    jobs = procs.registry_dir()
    jobs.mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = jobs / f".job-a.json.{gone.pid}.tmp"
    dead.write_bytes(b"")
    live = jobs / f".job-b.json.{os.getpid()}.tmp"  # a writer alive right now
    live.write_bytes(b"")
    other = jobs / "notes.tmp"  # not one of ours
    other.write_bytes(b"")
    out = subprocess.run([sys.executable, "-m", "labkit", "cleanup"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert not dead.exists(), "the temporary file of a dead writer must go"
    assert live.exists() and other.exists()


def test_a_reused_pid_does_not_keep_a_stale_temporary_file(home):
    jobs = procs.registry_dir()
    jobs.mkdir(parents=True)
    stale = jobs / f".job-c.json.{os.getpid()}.tmp"  # our PID, but written before we started
    stale.write_bytes(b"")
    before = psutil.Process().create_time() - 60
    os.utime(stale, (before, before))
    assert procs.remove_stale_tmp(jobs) == [stale]


def test_an_unserialisable_object_leaves_no_file(tmp_path):
    with pytest.raises(TypeError):
        runtime.write_json_atomic(tmp_path / "x.json", {"bad": object()})
    assert list(tmp_path.iterdir()) == []


# --- env of the wrong type ------------------------------------------------------------------------


def test_a_timeout_too_large_for_a_float_is_named_not_overflowed(no_spawn):
    with pytest.raises(ValueError, match=r"timeout_s=an int of about 5001 digits.*seconds > 0"):
        launch.run(FaultsConfig(), nproc=1, timeout_s=10**5000)


@pytest.mark.parametrize("env", [["X=1"], "X=1", {"X": 1}, {1: "x"}])
def test_env_of_the_wrong_type_is_named(no_spawn, env):
    with pytest.raises(ValueError) as info:
        launch.run(FaultsConfig(), nproc=1, env=env)
    msg = str(info.value)
    assert msg.startswith(f"env={env!r}: env takes a dict of str to str"), msg
    assert "e.g. env={'OMP_NUM_THREADS': '1'}" in msg
