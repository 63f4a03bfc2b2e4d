"""CPU backend on real processes: two busy child processes stand in for a job's ranks."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time

import psutil
import pytest

from labkit.metrics import METRICS, CpuBackend, Sample

# A rank stand-in: starts a sleeping child of its own (its process tree), says "ready", then
# burns CPU until killed. The deadline keeps it from outliving a crashed test.
RANK = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("ready", child.pid, flush=True)
end = time.time() + 60
x = 0
while time.time() < end:
    x += 1
"""


def by_source(samples: list[Sample]) -> dict[str, Sample]:
    return {s.source: s for s in samples}


@pytest.fixture
def ranks():
    procs = [subprocess.Popen([sys.executable, "-c", RANK], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]  # fmt: skip
    kids = [int(p.stdout.readline().split()[1]) for p in procs]  # waits until each is ready
    yield procs, kids
    for p in procs:
        p.kill()
        p.wait()
        p.stdout.close()
    for pid in kids:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).kill()


def wait_for_cpu_time(procs, seconds: float = 0.05) -> None:
    """Until each process has used some CPU since now (no fixed sleep on a busy machine)."""
    start = [psutil.Process(p.pid).cpu_times().user for p in procs]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        used = [
            psutil.Process(p.pid).cpu_times().user - s for p, s in zip(procs, start, strict=True)
        ]
        if min(used) >= seconds:
            return
        time.sleep(0.05)
    raise AssertionError("the rank stand-ins got no CPU time in 30 s")


def test_samples_each_ranks_process_tree_and_the_host(ranks):
    procs, kids = ranks
    pids = {r: p.pid for r, p in enumerate(procs)}
    with CpuBackend(lambda: pids, reason="NVML library not found") as cpu:
        wait_for_cpu_time(procs)
        got = by_source(cpu.sample())
        describe = cpu.describe()
    assert set(got) == {"rank0", "rank1", "host"}
    for r in (0, 1):
        s = got[f"rank{r}"]
        assert s.kind == "cpu" and s.status == "ok"
        assert s.values["cpu_pct"] > 0  # busy-looping since open(): primed there
        own = psutil.Process(procs[r].pid).memory_info().rss / 2**30
        child = psutil.Process(kids[r]).memory_info().rss / 2**30
        assert s.values["rss_gib"] >= own + 0.5 * child  # the child is counted too
    host = got["host"].values
    assert 0 < host["host_mem_used_gib"] < host["host_mem_total_gib"]
    assert host["host_cpu_pct"] is None or 0 <= host["host_cpu_pct"] <= 100
    assert "no NVIDIA GPU found" in describe and "NVML library not found" in describe
    assert "2 ranks" in describe
    for s in got.values():
        for name in s.values:
            m = METRICS[name]
            assert m.backend == "cpu" and m.unit and m.description and m.nvidia_smi


def test_rank_seen_late_is_na_first_then_measured(ranks):
    procs, _ = ranks
    pids: dict[int, int] = {}
    with CpuBackend(lambda: pids) as cpu:
        assert [s.source for s in cpu.sample()] == ["host"]  # no rank yet
        pids[0] = procs[0].pid  # the launcher learns a worker's PID
        first = by_source(cpu.sample())["rank0"].values
        wait_for_cpu_time(procs[:1])
        second = by_source(cpu.sample())["rank0"].values
    assert first["cpu_pct"] is None  # psutil's first reading primes: N/A, not 0
    assert first["rss_gib"] > 0
    assert second["cpu_pct"] > 0


def test_rank_that_exits_is_marked_not_zeroed(ranks):
    procs, _ = ranks
    pids = {r: p.pid for r, p in enumerate(procs)}
    with CpuBackend(lambda: pids) as cpu:
        cpu.sample()
        procs[1].kill()
        procs[1].wait()
        got = by_source(cpu.sample())
        assert "exited" in cpu.status["rank1"]
    assert got["rank1"].status == "exited" and got["rank1"].values == {}
    assert got["rank0"].status == "ok"


def test_host_cpu_from_own_counters(ranks):
    times = iter([10.0, 11.0])
    with CpuBackend(clock=lambda: next(times)) as cpu:
        wait_for_cpu_time(ranks[0])  # the stand-ins keep at least one core busy
        (host,) = cpu.sample()
    assert host.time_s == 10.0  # stamped by the injected clock
    assert host.values["host_cpu_pct"] > 0


def test_broken_pids_fn_keeps_host_metrics():
    def broken():
        raise RuntimeError("launcher not ready")

    with CpuBackend(broken) as cpu:
        got = by_source(cpu.sample())
        assert "launcher not ready" in cpu.status["pids_fn"]
    assert set(got) == {"host"}


def test_describe_without_reason_says_no_gpu_metrics():
    assert "no GPU metrics collected" in CpuBackend().describe()


def test_sample_before_open_is_an_error():
    with pytest.raises(RuntimeError, match="before open"):
        CpuBackend().sample()


def test_a_fully_busy_host_reads_at_most_100_percent(monkeypatch):
    """Summed float CPU times can put the busy time a hair above the total (CI read
    100.00000000115 %): the share of all cores is clamped to what it is."""
    from labkit.metrics import cpu

    readings = iter([(10.0, 20.0), (10.0 + 5.000000001, 25.0)])
    monkeypatch.setattr(cpu, "_host_times", lambda: next(readings))
    backend = CpuBackend(lambda: {})
    backend._host_prev = cpu._host_times()
    assert backend._host_values()["host_cpu_pct"] == 100.0
