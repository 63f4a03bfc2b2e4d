"""labkit.jobs.slurm: the sbatch script `python -m labkit slurm` writes, checked as text and run
for real on a one-node SLURM cluster on this machine.

The cluster test starts munged, slurmctld and slurmd from Debian's packages
(scripts/install_slurm.sh) with a configuration written into its temporary folder (its own
ports, asked of the OS; its own munge key and socket; no accounting, no cgroups), submits the
generated script with `sbatch --wait`, and checks what the job left: completed, every rank's
output in its own file, and both ranks' results equal to each other and to one process's.
Without the SLURM programs it skips, except in CI (CI=true), where it fails.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from labkit import __main__ as cli
from labkit.jobs import spec
from labkit.jobs.slurm import SlurmJob

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = {
    "munged": "/usr/sbin/munged",
    "slurmctld": "/usr/sbin/slurmctld",
    "slurmd": "/usr/sbin/slurmd",
    "sbatch": "/usr/bin/sbatch",
    "srun": "/usr/bin/srun",
    "sinfo": "/usr/bin/sinfo",
    "scontrol": "/usr/bin/scontrol",
}
INSTALL_HINT = "install them with `sudo scripts/install_slurm.sh` (Debian's slurmctld, slurmd, slurm-client and munge)"  # fmt: skip
NODE_UP_S = 30  # slurmd registers with slurmctld within ~2 s here
JOB_S = 150  # the job takes ~10 s (two ranks importing torch); generous for a loaded CI machine


def gpu_job(**kw) -> SlurmJob:
    return SlurmJob(**{"nodes": 2, "gpus_per_node": 8, "time": "00:30:00", "python": "/usr/bin/python3", **kw})  # fmt: skip


# --- the script as text -----------------------------------------------------------------------


def test_a_job_near_its_time_limit_requests_a_checkpoint_and_requeues(tmp_path):
    # review N02b-6: the scheduler's time limit meets section 4's checkpoints
    job = gpu_job(signal_s=120, requeue=True, max_restarts=1)
    script = job.render()
    sbatch = [line.split()[1] for line in script.splitlines() if line.startswith("#SBATCH")]
    assert "--signal=B:USR1@120" in sbatch and "--requeue" in sbatch
    assert "trap on_time_limit USR1" in script
    assert 'touch "$LABKIT_JOB_DIR/checkpoint_requested"' in script
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    # the trap can only run while the script waits: srun in the background, then wait
    assert "-m labkit.workers.multinode' &\nSRUN_PID=$!" in script
    assert script.index("trap on_time_limit USR1") < script.index("\nsrun ")
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    # without a signal nothing waits in the background
    assert "SRUN_PID" not in gpu_job().render()
    # a CPU job shares its machine and takes the cluster's memory default, unless asked
    cpu = SlurmJob(nodes=1, ranks_per_node=2, python="/usr/bin/python3")
    assert "--exclusive" not in cpu.render() and "--mem" not in cpu.render()
    assert "--mem=64G" in SlurmJob(nodes=1, mem="64G", python="/usr/bin/python3").render()
    with pytest.raises(ValueError, match="mem="):
        SlurmJob(nodes=1, mem="lots", python="/usr/bin/python3")
    with pytest.raises(ValueError, match="before the time limit"):
        gpu_job(time="00:01:00", signal_s=120)


def test_the_script_uses_the_job_folder_the_ranks_read():
    # One layout for launch.run, the ranks and the script: labkit.jobs.spec's.
    script = SlurmJob().render()
    assert f'export {spec.JOB_DIR_ENV}="$SLURM_SUBMIT_DIR/runs/slurm-$SLURM_JOB_ID"' in script
    assert f'cat > "${spec.JOB_DIR_ENV}/{spec.SPEC_FILE}"' in script
    assert f"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='{spec.RANK_PREFIX}'" in script


def test_a_gpu_job_asks_for_its_nodes_and_gpus_and_runs_one_agent_per_node():
    script = gpu_job(partition="gpu", account="proj42").render()
    sbatch = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    options = [line.split()[1] for line in sbatch]
    assert options == [
        "--job-name=labkit-multinode", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8",
        "--cpus-per-task=24", "--time=00:30:00", "--output=%x-%j.out", "--exclusive",
        "--mem=0", "--partition=gpu", "--account=proj42",
    ]  # fmt: skip
    assert script.startswith("#!/bin/bash\n")
    assert "set -euo pipefail" in script
    assert 'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)' in script
    srun = script[script.index("\nsrun ") :]
    assert srun.startswith("\nsrun --ntasks-per-node=1 --cpus-per-task=$SLURM_CPUS_PER_TASK "
                           "--gpus-per-node=8 ")  # fmt: skip
    for flag in ("--nnodes=$SLURM_NNODES", "--nproc-per-node=8", "--rdzv-backend=c10d",
                 "--rdzv-endpoint=$HEAD_NODE:$RDZV_PORT", "--rdzv-id=$SLURM_JOB_ID",
                 "--max-restarts=0", "--tee=3", "-m labkit.workers.multinode'"):  # fmt: skip
        assert flag in srun, flag
    assert 'exec "$PYTHON" -m torch.distributed.run' in srun
    assert "export PYTHON=/usr/bin/python3" in script
    assert "export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank${rank}] '" in script
    assert "NCCL_DEBUG=INFO" in script  # mentioned, for the learner to switch on
    assert not re.search(r"^export NCCL_DEBUG", script, re.M)  # but left to them
    assert "SOCKET_IFNAME" not in script  # no interface named: NCCL and gloo choose


def test_the_rendezvous_port_is_asked_of_the_first_node_not_written_in():
    script = gpu_job().render()
    port_line = next(line for line in script.splitlines() if line.startswith("RDZV_PORT="))
    assert 's.bind(("", 0))' in port_line and port_line.startswith(
        "RDZV_PORT=$(/usr/bin/python3 -c"
    )
    assert not re.search(r"\b(29400|29500|6817|6818)\b", script.replace("hard-coding 29400", ""))
    assert "race" in script  # the comment says why it can still fail


def test_a_cpu_job_has_no_gpu_line_and_no_partition_unless_given():
    job = SlurmJob(
        ranks_per_node=2, cpus_per_node=2, time="1-00:00:00", python="/opt/py/bin/python"
    )
    script = job.render()
    assert "--gpus-per-node" not in script
    assert "--partition" not in script and "--account" not in script
    assert "#SBATCH --cpus-per-task=2" in script and "--nproc-per-node=2" in script
    assert "#SBATCH --time=1-00:00:00" in script
    assert "GLOO_SOCKET_IFNAME" not in script


def test_the_socket_interface_is_exported_for_nccl_and_gloo_when_given():
    script = gpu_job(socket_ifname="^docker,lo").render()
    assert "export NCCL_SOCKET_IFNAME='^docker,lo'" in script
    assert "export GLOO_SOCKET_IFNAME='^docker,lo'" in script
    assert script.index("GLOO_SOCKET_IFNAME=") < script.index("\nsrun ")


def test_the_job_folder_gets_the_spec_the_workers_read():
    job = SlurmJob(ranks_per_node=2, config={"numel": 1024, "note": "a $HOME `x` 'y'"},
                   max_restarts=2, python="/usr/bin/python3")  # fmt: skip
    script = job.render()
    assert 'export LABKIT_JOB_DIR="$SLURM_SUBMIT_DIR/runs/slurm-$SLURM_JOB_ID"' in script
    # a quoted here-document: the shell expands nothing in it, so the JSON arrives as written
    body = script.split("<<'END_OF_JOB_SPEC'\n", 1)[1].split("\nEND_OF_JOB_SPEC\n", 1)[0]
    spec = json.loads(body)
    assert spec == job.spec()
    assert spec["config"] == {"numel": 1024, "note": "a $HOME `x` 'y'"}
    assert (spec["backend"], spec["device"], spec["nproc"]) == ("gloo", "cpu", 2)
    assert gpu_job().spec()["backend"] == "nccl"
    assert "--max-restarts=2" in script
    assert (
        'LABKIT_JOB_DIR="/scratch/me/runs/slurm-$SLURM_JOB_ID"'
        in SlurmJob(runs_dir="/scratch/me/runs", python="/usr/bin/python3").render()
    )


@pytest.mark.parametrize("job", [gpu_job(), gpu_job(partition="p", socket_ifname="ib0"),
                                 SlurmJob(ranks_per_node=3, config={"a": [1, 2]})],
                         ids=["gpu", "gpu-partition-ifname", "cpu"])  # fmt: skip
def test_bash_accepts_the_script(job):
    bash = shutil.which("bash")
    assert bash
    proc = subprocess.run([bash, "-n"], input=job.render(), text=True, capture_output=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("kw", "field_name"),
    [
        ({"nodes": 0}, "nodes="),
        ({"nodes": True}, "nodes="),
        ({"nodes": 1.5}, "nodes="),
        ({"gpus_per_node": -1}, "gpus_per_node="),
        ({"ranks_per_node": 0}, "ranks_per_node="),
        ({"gpus_per_node": 8, "ranks_per_node": 4}, "ranks_per_node=4 with gpus_per_node=8"),
        ({"cpus_per_node": 0}, "cpus_per_node="),
        ({"ranks_per_node": 9, "cpus_per_node": 2}, "raise cpus_per_node to 3"),
        ({"time": "30"}, "time="),
        ({"time": "00:60:00"}, "time="),
        ({"time": "1-24:00:00"}, "time="),
        ({"time": "00:00:00"}, "time="),
        ({"time": "00:30:00\n#SBATCH --x"}, "time="),
        ({"partition": "gpu; rm -rf ~"}, "partition="),
        ({"partition": "a b"}, "partition="),
        ({"account": "x\ny"}, "account="),
        ({"account": ""}, "account="),
        ({"job_name": "$(id)"}, "job_name="),
        ({"module": "labkit.workers.multinode'; id; '"}, "module="),
        ({"module": "1abc"}, "module="),
        ({"config": [1]}, "config="),
        ({"config": {"x": float("nan")}}, "config:"),
        ({"config": {"x": object()}}, "config:"),
        ({"max_restarts": -1}, "max_restarts="),
        ({"socket_ifname": "eth0 lo"}, "socket_ifname="),
        ({"socket_ifname": "eth0;id"}, "socket_ifname="),
        ({"python": "python3"}, "python="),
        ({"python": "/opt/my env/python"}, "python="),
        ({"runs_dir": "runs;id"}, "runs_dir="),
    ],
)
def test_bad_input_names_the_field(kw, field_name):
    with pytest.raises(ValueError) as err:
        SlurmJob(**{"python": "/usr/bin/python3", **kw})
    assert field_name in str(err.value)
    assert re.search(r": need |; leave |; raise |; use | is not allowed: ", str(err.value)), "and a fix"


@pytest.mark.parametrize(("time_", "seconds"), [("00:30:00", 1800), ("1-12:00:00", 129600),
                                                ("99:59:59", 359999), ("0-00:00:01", 1)])  # fmt: skip
def test_time_limits(time_, seconds):
    assert SlurmJob(time=time_).time_limit_s == seconds


def test_each_rank_gets_its_share_of_the_cores_as_threads():
    assert "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}" in gpu_job().render()
    job = SlurmJob(ranks_per_node=2, cpus_per_node=9, python="/usr/bin/python3")
    assert "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}" in job.render()


def test_ranks_and_cores_default_from_the_gpus():
    assert (gpu_job().ranks, gpu_job().cpus, gpu_job().world_size) == (8, 24, 16)  # 3 per GPU rank
    assert (SlurmJob().ranks, SlurmJob().cpus) == (1, 1)
    assert SlurmJob(ranks_per_node=4, cpus_per_node=16).cpus == 16
    assert SlurmJob().python == sys.executable


# --- the command line -------------------------------------------------------------------------


def test_cli_prints_the_script_and_says_how_to_submit_it(capsys):
    assert cli.main(["slurm", "--nodes", "2", "--gpus-per-node", "8", "--time", "00:30:00",
                     "--partition", "P", "--account", "A", "--python", "/usr/bin/python3"]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    assert out == gpu_job(partition="P", account="A").render()
    assert "sbatch" in err


def test_cli_writes_the_file_and_prints_the_sbatch_line(tmp_path, capsys):
    path = tmp_path / "job.sbatch"
    config = '{"numel": 1024, "repeats": 2}'
    assert cli.main(["slurm", "--ranks-per-node", "2", "--module", "labkit.workers.allreduce",
                     "--config", config, "-o", str(path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert f"submit it with: sbatch {path}" in out
    assert os.access(path, os.X_OK)
    assert path.read_text() == SlurmJob(ranks_per_node=2, module="labkit.workers.allreduce",
                                        config=json.loads(config)).render()  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nodes", "0"], "nodes=0"),
        (["--time", "soon"], "time='soon'"),
        (["--partition", "gpu q"], "partition='gpu q'"),
        (["--config", "{numel: 3}"], "--config '{numel: 3}' is not JSON"),
        (["--config", "[1]"], "config=[1]"),
        (["-o", "/nonexistent-dir/job.sbatch"], "cannot write /nonexistent-dir/job.sbatch"),
    ],
)
def test_cli_errors_go_to_stderr_with_status_2(argv, message, capsys):
    assert cli.main(["slurm", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("labkit slurm: ") and message in err


def test_cli_runs_as_a_module():
    proc = subprocess.run([sys.executable, "-m", "labkit", "slurm", "--nodes", "-1"],
                          capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 2 and "nodes=-1 is not allowed: a positive integer" in proc.stderr


# --- a real SLURM: slurmctld + slurmd on this machine -----------------------------------------


def _unavailable(reason: str) -> None:
    """Skip on a developer's machine; in CI missing SLURM is a broken setup, so fail."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason}: {INSTALL_HINT}")
    pytest.skip(f"{reason} ({INSTALL_HINT})")


def _free_port() -> int:
    with socket.socket() as s:  # ask the OS: never 6817/6818, which a real SLURM may hold
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    dir: Path
    host: str
    env: dict[str, str]  # SLURM_CONF and the tag every cluster process carries
    tag: str
    procs: dict[str, subprocess.Popen]

    def run(
        self, *cmd: str, timeout: float = 30, cwd: Path | None = None
    ) -> subprocess.CompletedProcess:
        return subprocess.run([PROGRAMS.get(cmd[0], cmd[0]), *cmd[1:]], env=self.env, cwd=cwd,
                              capture_output=True, text=True, timeout=timeout)  # fmt: skip

    def logs(self) -> str:
        parts = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log"):
            path = self.dir / name
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-15:]
                parts.append(f"--- {name} (last lines)\n" + "\n".join(tail))
        return "\n".join(parts)


def _tagged(tag: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``tag``: the cluster's daemons and all they
    started (slurmstepd, the job's shell, torchrun, the ranks), wherever they were reparented."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get("LABKIT_SLURM_TEST") == tag:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


SLURM_CONF = """\
# A one-node SLURM for tests/test_slurm.py, in its temporary folder.
ClusterName=labkit-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={sockets}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
# no cgroups (a container may not have them to give): processes tracked by their parent
# pid, tasks not bound to cores
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# no accounting database, no job accounting; each finished job's record to a text file
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={dir}/jobcomp.txt
# `sbatch --wait` polls the controller after 2 s, then 4x longer each time (2, 8, 32 s: a
# job done after 11 s is noticed at 42 s) unless that exceeds MinJobAge/2 (sbatch.c,
# _job_wait): 5 keeps it at 2 s. The finished job's record is in jobcomp.txt for good.
MinJobAge=5
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# the node's CPUs as configured below, even where the hardware differs
SlurmdParameters=config_overrides
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture
def slurm_cluster(tmp_path: Path) -> Iterator[Cluster]:
    missing = [path for path in PROGRAMS.values() if not os.access(path, os.X_OK)]
    if missing:
        _unavailable(f"SLURM is not installed ({', '.join(missing)} missing)")
    if os.geteuid() != 0:
        _unavailable("the one-node SLURM runs its daemons as root (SlurmUser=root, slurmd)")
    # Unix sockets (munge's, slurmd's) take paths of at most 107 bytes: a deep tmp_path
    # (pytest-xdist's) gets a short folder beside it for them.
    short = len(str(tmp_path)) <= 60
    sockets = tmp_path if short else Path(tempfile.mkdtemp(prefix="slurm-"))
    (tmp_path / "state").mkdir()
    (sockets / "spool").mkdir(exist_ok=True)
    host = socket.gethostname().split(".")[0]
    # The node's CPUs from this machine, but at least the 2 the test's job asks for.
    cpus = max(2, len(os.sched_getaffinity(0)))
    munge_socket = sockets / "munge.sock"
    ports = [_free_port()]
    while len(ports) < 2:  # the OS may hand the same free port out twice in a row
        if (port := _free_port()) != ports[0]:
            ports.append(port)
    (tmp_path / "slurm.conf").write_text(SLURM_CONF.format(
        host=host, ctld_port=ports[0], slurmd_port=ports[1], munge_socket=munge_socket,
        dir=tmp_path, sockets=sockets, cpus=cpus))  # fmt: skip
    key = tmp_path / "munge.key"  # this cluster's own key, not the machine's /etc/munge one
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o600)

    tag = secrets.token_hex(8)
    env = {**os.environ, "SLURM_CONF": str(tmp_path / "slurm.conf"), "LABKIT_SLURM_TEST": tag,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    cluster = Cluster(tmp_path, host, env, tag, {})

    def start(name: str, *args: str) -> None:
        out = open(tmp_path / f"{name}.out", "w")  # noqa: SIM115 (the daemon's, closed on exit)
        cluster.procs[name] = subprocess.Popen([PROGRAMS[name], *args], env=env, stdout=out,
                                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)  # fmt: skip
        out.close()

    try:
        # --force: munged refuses a socket whose folders are not open to everyone (tmp_path's
        # parents are private to root); -F: stay in the foreground, our child.
        start("munged", "-F", "--force", f"--socket={munge_socket}", f"--key-file={key}",
              f"--log-file={tmp_path / 'munged.log'}", f"--pid-file={tmp_path / 'munged.pid'}",
              f"--seed-file={tmp_path / 'munged.seed'}")  # fmt: skip
        deadline = time.monotonic() + 10
        while not munge_socket.exists():
            if cluster.procs["munged"].poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"munged did not start:\n{(tmp_path / 'munged.out').read_text()}")
            time.sleep(0.05)
        start("slurmctld", "-D", "-i")  # -D: foreground; -i: no saved state to read
        start("slurmd", "-D")
        deadline = time.monotonic() + NODE_UP_S
        state = ""
        while state != "idle":
            for name, proc in cluster.procs.items():
                if proc.poll() is not None:
                    pytest.fail(f"{name} exited with {proc.returncode}:\n"
                                f"{(tmp_path / f'{name}.out').read_text()}\n{cluster.logs()}")  # fmt: skip
            if time.monotonic() > deadline:
                pytest.fail(f"the node is {state or 'not listed'} after {NODE_UP_S} s, not "
                            f"idle:\n{cluster.logs()}")  # fmt: skip
            time.sleep(0.2)
            state = cluster.run("sinfo", "-h", "-n", host, "-o", "%T").stdout.strip()
        yield cluster
    finally:
        # Stop the node first (it ends any job step left), then the controller, then munge.
        for name in ("slurmd", "slurmctld", "munged"):
            proc = cluster.procs.get(name)
            if proc is None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        left = _tagged(tag)
        for p in left:  # never leave them to the next test, even when failing over them
            p.kill()
        if not short:
            shutil.rmtree(sockets, ignore_errors=True)
        assert not left, "processes of the test's SLURM outlived it: " + ", ".join(
            f"{p.pid} {p.name()}" for p in left
        )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_real_slurm_runs_the_generated_script_to_completion(slurm_cluster, tmp_path):
    cluster = slurm_cluster
    submit = tmp_path / "submit"
    submit.mkdir()
    # 1 node x 2 CPU ranks. SLURM's one task on the node is the torchrun agent
    # (--ntasks-per-node=1), and the agent starts --nproc-per-node=2 ranks: the job's 2
    # tasks in the sense are the 2 ranks, each a process with its own rank and output.
    # socket_ifname="lo": the one "node" talks to itself over loopback.
    script = submit / "multinode.sbatch"
    assert cli.main(["slurm", "--nodes", "1", "--ranks-per-node", "2", "--cpus-per-node", "2",
                     "--time", "00:05:00", "--socket-ifname", "lo", "-o", str(script)]) == 0  # fmt: skip

    start = time.monotonic()
    proc = cluster.run("sbatch", "--wait", "--parsable", script.name, cwd=submit, timeout=JOB_S)
    took = time.monotonic() - start
    job_id = proc.stdout.strip().split(";")[0]
    output = submit / f"labkit-multinode-{job_id}.out"
    log = output.read_text(errors="replace") if output.exists() else "(no job output file)"
    assert proc.returncode == 0, (
        f"sbatch --wait exited {proc.returncode} after {took:.0f} s: {proc.stderr}\n"
        f"--- job output\n{log}\n{cluster.logs()}"
    )
    # SLURM's own record of the job: it ran to the end and exited 0
    records = (cluster.dir / "jobcomp.txt").read_text().splitlines()
    record = next(line for line in records if line.startswith(f"JobId={job_id} "))
    assert "JobState=COMPLETED" in record and "ExitCode=0:0" in record, record

    # the job's output: the batch script's own lines, then every rank's, prefixed with its rank
    assert f"job {job_id}: 1 node(s) ({cluster.host}), rendezvous at {cluster.host}:" in log
    for rank in (0, 1):
        assert f"[rank{rank}] rank {rank} is local rank {rank} of node 0 ({cluster.host})" in log
    assert f"job {job_id} done" in log
    assert "Setting OMP_NUM_THREADS" not in log  # the script's setting reached torchrun

    job_dir = submit / "runs" / f"slurm-{job_id}"
    assert json.loads((job_dir / "job.json").read_text())["nproc"] == 2
    # each rank's output in its own file, torchrun's --log-dir under the node's name
    for rank in (0, 1):
        files = list(job_dir.glob(f"torchrun/{cluster.host}/*/attempt_0/{rank}/stdout.log"))
        assert len(files) == 1, sorted(map(str, job_dir.rglob("*.log")))
        text = files[0].read_text()
        assert f"rank {rank} is local rank {rank} of node 0" in text
        assert f"rank {1 - rank} is" not in text  # its own lines only
    # both ranks' results: the all-reduce summed 1 + 2 on each, and DDP's step left the same
    # parameters on both, equal to one process's step on both ranks' batches
    from labkit.workers.multinode import reference_params

    results = [json.loads((job_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, res in enumerate(results):
        assert res["allreduce"] == res["allreduce_expected"] == 3.0
        assert (res["node_rank"], res["local_rank"], res["world_size"]) == (0, r, 2)
        assert res["host"] == socket.gethostname()
    assert results[0]["checksum"] == results[1]["checksum"]
    assert results[0]["params"] == results[1]["params"]
    assert results[0]["params"] == pytest.approx(reference_params(2).tolist(), abs=1e-6)
    print(f"sbatch --wait: job {job_id} completed in {took:.1f} s")


def test_missing_slurm_skips_here_and_fails_in_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"install_slurm\.sh"):
        _unavailable("SLURM is not installed")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="SLURM is not installed: install them"):
        _unavailable("SLURM is not installed")
