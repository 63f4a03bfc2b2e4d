"""Two torchrun agents on this machine act as two nodes of one job.

Each "node" is its own Python process calling ``launch.run(..., nodes=Nodes(...))``, with its
own LABKIT_HOME, exactly as a learner runs the same cell on two machines; they meet through a
c10d rendezvous (or a static one) on localhost. What a real cluster adds (a network between
the nodes, one interface to pick) is not here; what the launcher does with a second node is.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

from labkit.jobs import runtime
from labkit.jobs.nodes import Nodes, rank_range
from labkit.workers import multinode
from tests.test_launch import assert_no_survivors

NODE = textwrap.dedent(
    """
    import json, sys
    from labkit.jobs import launch
    from labkit.jobs.nodes import Nodes
    from labkit.workers.multinode import MultinodeConfig

    args = json.loads(sys.argv[1])
    try:
        res = launch.run(MultinodeConfig(**args["config"]), nproc=1, timeout_s=args["timeout_s"],
                         pg_timeout_s=args["pg_timeout_s"], nodes=Nodes(**args["nodes"]))
        out = {"ok": True, "node_rank": res.node_rank, "local_ranks": res.local_ranks,
               "world_size": res.world_size, "results": {r: res.rank(r) for r in res.local_ranks},
               "summary": repr(res).splitlines()[0], "log_dir": str(res.log_dir)}
    except launch.JobError as e:
        out = {"ok": False, "error": type(e).__name__, "message": str(e),
               "log_dir": str(e.result.log_dir)}
    print("NODE-RESULT " + json.dumps(out), flush=True)
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(tmp_path: Path, name: str, nodes: dict, *, config: dict | None = None,
               timeout_s: float = 90, pg_timeout_s: float = 30) -> subprocess.Popen:  # fmt: skip
    script = tmp_path / "node.py"
    script.write_text(NODE)
    args = {"nodes": nodes, "config": config or {}, "timeout_s": timeout_s,
            "pg_timeout_s": pg_timeout_s}  # fmt: skip
    env = {**os.environ, "LABKIT_HOME": str(tmp_path / name)}
    return subprocess.Popen(
        [sys.executable, str(script), json.dumps(args)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip


def finish(proc: subprocess.Popen, timeout: float) -> tuple[dict, str]:
    out, _ = proc.communicate(timeout=timeout)
    line = next((x for x in out.splitlines() if x.startswith("NODE-RESULT ")), None)
    assert line, f"the node process printed no result:\n{out}"
    return json.loads(line.removeprefix("NODE-RESULT ")), out


def test_two_agents_meet_through_c10d_and_their_ddp_step_matches_one_process(tmp_path):
    port = free_port()
    layout = {"count": 2, "endpoint": f"localhost:{port}", "rdzv_id": "two-agents"}
    procs = [start_node(tmp_path, f"node{i}", layout) for i in range(2)]
    (a, out_a), (b, out_b) = (finish(p, 120) for p in procs)
    assert a["ok"] and b["ok"], (a, b)
    # c10d hands out node ranks: one agent got each, and each holds its own rank
    by_node = {a["node_rank"]: a, b["node_rank"]: b}
    assert sorted(by_node) == [0, 1]
    for node, res in by_node.items():
        assert res["local_ranks"] == [node] and res["world_size"] == 2
        (rank_result,) = res["results"].values()
        assert rank_result["node_rank"] == node and rank_result["local_rank"] == 0
        assert rank_result["allreduce"] == rank_result["allreduce_expected"] == 3.0
        assert f"node {node} of 2" in res["summary"]
    # every line a rank printed says which node it came from
    for res, out in ((a, out_a), (b, out_b)):
        n = res["node_rank"]
        assert f"[node{n} rank{n}] rank {n} is local rank 0 of node {n}" in out, out
    # DDP averaged the two nodes' gradients: both hold the weights one process gets from one
    # step on both batches at once
    p0, p1 = (torch.tensor(next(iter(r["results"].values()))["params"]) for r in (a, b))
    assert torch.equal(p0, p1), "the two nodes' weights differ after a DDP step"
    torch.testing.assert_close(p0, multinode.reference_params(2), rtol=0, atol=1e-6)
    for res in (a, b):
        assert_no_survivors(res["log_dir"], wait_s=5)


def test_killing_one_agent_ends_the_other_and_leaves_no_process(tmp_path):
    # a static rendezvous here (each node told its rank), so both ways of meeting run for real
    port = free_port()
    layouts = [{"count": 2, "endpoint": f"127.0.0.1:{port}", "node_rank": i} for i in range(2)]
    pg_timeout_s = 20.0
    procs = [
        start_node(
            tmp_path, f"node{i}", layouts[i], config={"hold_s": 120}, pg_timeout_s=pg_timeout_s
        )
        for i in range(2)
    ]
    # wait until node 1's rank holds (node 0's rank then waits for it in a barrier)
    deadline = time.monotonic() + 60
    beat = None
    while time.monotonic() < deadline:
        beats = [runtime.read_json(p) for p in (tmp_path / "node1").glob("runs/*/heartbeat/rank1.json")]
        beat = next((b for b in beats if b and b.get("phase") == "hold"), None)
        if beat:
            break
        assert all(p.poll() is None for p in procs), "a node ended before the job was running"
        time.sleep(0.2)
    assert beat, "node 1's rank never reached its hold"
    agent = psutil.Process(beat["pid"]).parent()
    assert "torch.distributed.run" in " ".join(agent.cmdline())
    killed_at = time.monotonic()
    agent.send_signal(signal.SIGKILL)  # the plug pulled on node 1

    (a, _), (b, _) = finish(procs[0], 90), finish(procs[1], 90)
    ended_after = time.monotonic() - killed_at
    print(f"node 0's launcher ended {ended_after:.1f} s after node 1's agent was killed")
    # node 0 is not left waiting: its rank's barrier breaks when node 1's rank is gone, well
    # inside the job's own limits
    assert not a["ok"] and a["error"] == "JobFailed", a
    assert ended_after < pg_timeout_s, f"node 0 took {ended_after:.1f} s to end"
    assert "this is node 0 (ranks 0..0)" in a["message"], a["message"]
    assert not b["ok"], b  # node 1's launcher reports its agent's death too
    for res in (a, b):
        assert_no_survivors(res["log_dir"], wait_s=5)
    assert not psutil.pid_exists(beat["pid"]) or psutil.Process(beat["pid"]).status() == "zombie"


def test_a_node_alone_at_the_rendezvous_is_told_what_is_missing(tmp_path):
    layout = {"count": 2, "endpoint": f"localhost:{free_port()}", "rdzv_id": "alone"}
    res, _ = finish(start_node(tmp_path, "node0", layout, timeout_s=4), 60)
    assert not res["ok"] and res["error"] == "JobTimeout"
    assert "waiting at the rendezvous localhost:" in res["message"]
    assert "rdzv_id='alone'" in res["message"] and "every node" in res["message"]
    assert_no_survivors(res["log_dir"], wait_s=5)


# --- the layout itself ------------------------------------------------------------------------


def test_c10d_flags_and_the_command_each_node_runs():
    n = Nodes("2:4", endpoint="gpu-01:29400", rdzv_id="job-7")
    assert (n.min_nodes, n.max_nodes, n.static, n.on_loopback) == (2, 4, False, False)
    assert n.torchrun_args() == ["--rdzv-backend=c10d", "--rdzv-endpoint=gpu-01:29400",
                                 "--rdzv-id=job-7", "--nnodes=2:4"]  # fmt: skip
    assert n.command("labkit.workers.multinode", 8).endswith(
        "--nnodes=2:4 --nproc-per-node=8 -m labkit.workers.multinode")


def test_static_flags_name_this_nodes_rank():
    n = Nodes(2, endpoint="10.0.0.1:29500", node_rank=1)
    assert n.torchrun_args() == ["--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1",
                                 "--master-port=29500"]  # fmt: skip
    assert "--node-rank=<this node" in n.command("m", 1)
    assert Nodes(2, endpoint="127.0.0.1:1234").on_loopback
    assert list(rank_range(1, 4)) == [4, 5, 6, 7]


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"count": 2, "endpoint": "gpu-01:0"}, "cannot be 0"),
        ({"count": 2, "endpoint": "gpu-01"}, "need 'host:port'"),
        ({"count": 0, "endpoint": "h:1234"}, "1 <= MIN <= MAX"),
        ({"count": "4:2", "endpoint": "h:1234"}, "1 <= MIN <= MAX"),
        ({"count": "two", "endpoint": "h:1234"}, "elastic range"),
        ({"count": "1:4", "endpoint": "h:1234", "node_rank": 0}, "fixed number of nodes"),
        ({"count": 2, "endpoint": "h:1234", "node_rank": 2}, "0..1"),
        ({"count": 2, "endpoint": "h:1234", "rdzv_id": "a b"}, "the same on every node"),
    ],
)
def test_bad_layouts_are_refused_with_the_fix(kwargs, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(".", r"\.")):
        Nodes(**kwargs)


def test_launch_refuses_a_layout_that_is_not_nodes_and_negative_restarts():
    from labkit.jobs import launch

    with pytest.raises(ValueError, match=r"labkit\.jobs\.nodes\.Nodes"):
        launch.run(multinode.MultinodeConfig(), nodes={"count": 2})
    with pytest.raises(ValueError, match="max_restarts=-1"):
        launch.run(multinode.MultinodeConfig(), max_restarts=-1)


def test_launch_command_refuses_half_a_layout(capsys):
    from labkit.__main__ import main

    assert main(["launch", "labkit.workers.multinode", "--nodes", "2"]) == 2
    assert "--nodes and --endpoint go together" in capsys.readouterr().err
    assert main(["launch", "labkit.workers.multinode", "--nodes", "2", "--endpoint", "h:0"]) == 2
    assert "cannot be 0" in capsys.readouterr().err


def test_the_launch_command_builds_the_workers_own_config(capsys):
    from labkit.__main__ import main
    from labkit.jobs import cli

    # --config JSON becomes the worker's WorkerConfig, each field checked there.
    assert cli.typed_config("labkit.workers.multinode", {"numel": 64}) == multinode.MultinodeConfig(numel=64)
    assert main(["launch", "labkit.workers.multinode", "--config", '{"numell": 64}']) == 2
    assert "MultinodeConfig has no field(s) ['numell']" in capsys.readouterr().err
    # A module of one's own, without a config class, runs by name and takes no fields.
    assert cli.typed_config("my_tests.worker", {}) == "my_tests.worker"
    with pytest.raises(ValueError, match="has no config class"):
        cli.typed_config("my_tests.worker", {"n": 1})


def test_a_rehearsal_gives_every_node_the_same_typed_config(monkeypatch, tmp_path):
    """This node runs the config object; the others get it as --config JSON (no job starts:
    the agents are stand-ins, and this node's run stops at once)."""
    from labkit.jobs import cli, procs

    commands: list[list[str]] = []

    class Agent:  # stands in for a background node's `python -m labkit launch ...`
        pid = os.getpid()

        def __init__(self, cmd, **_):
            commands.append(cmd)

        def wait(self, timeout=None):
            return 0

    class Ran(Exception):
        pass

    ran = []

    def run(config, **kwargs):
        ran.append((config, kwargs))
        raise Ran

    monkeypatch.setattr(cli.subprocess, "Popen", Agent)
    monkeypatch.setattr(procs, "labkit_home", lambda: tmp_path)
    cfg = multinode.MultinodeConfig(numel=64)
    with pytest.raises(Ran):
        cli.rehearse_nodes(run, cfg, nodes=3, nproc=1, device="cpu")
    assert len(commands) == 2 and all(
        "labkit.workers.multinode" in cmd and f"--config={json.dumps(cfg.to_dict())}" in cmd
        for cmd in commands)  # fmt: skip
    ((config, kwargs),) = ran
    assert config is cfg and "config" not in kwargs and kwargs["nodes"].count == 3
