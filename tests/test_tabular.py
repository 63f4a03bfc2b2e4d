"""labkit.tabular and labkit.formulas.boosting: the formulas against XGBoost's source, the data
set, and (one real cluster, shared by the tests that need it) training, the byte count, a killed
worker, a taken port and the cleanup."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import types

import numpy as np
import psutil
import pytest

from labkit.formulas import boosting
from labkit.hardware.gpus import GpuInfo
from labkit.tabular import cluster, data, gpu, memory

# --------------------------------------------------------------------------- the formulas


def test_nodes_per_level_is_the_root_then_one_child_per_split():
    assert boosting.hist_nodes_per_level(1) == [1]
    assert boosting.hist_nodes_per_level(6) == [1, 1, 2, 4, 8, 16]  # 32 = 2^(6-1)
    assert sum(boosting.hist_nodes_per_level(6)) == 2 ** 5
    assert boosting.hist_nodes_per_level(4, [1, 2, 3]) == [1, 1, 2, 3]  # a pruned level
    assert boosting.hist_nodes_per_level(4, [1]) == [1, 1, 0, 0]


def test_ring_bytes_xgboost_against_the_textbook():
    assert boosting.ring_wire_bytes(100, 1) == 0
    assert boosting.ring_wire_bytes(100, 2) == 300  # (2w-1)·S: its all-gather runs w steps
    assert boosting.ring_wire_bytes(100, 2, xgboost_allgather=False) == 200  # 2(w-1)·S
    assert boosting.ring_wire_bytes(100, 4) == 700


def test_round_bytes_the_shape_the_notebook_counts():
    # 16 features × 64 bins × 16 bytes × 32 nodes × 3: what lo counted (1,576,656) less headers
    assert boosting.hist_round_wire_bytes(16, 64, 6, 2) == 1_572_864
    assert boosting.hist_round_wire_bytes(16, 64, 6, 1) == 0
    assert boosting.hist_round_wire_bytes(16, 64, 6, 2, distinct=31) == 1_572_864 * 31 / 64
    assert boosting.bins_per_feature(256, distinct=10) == 10


def test_matrix_bytes():
    assert boosting.dmatrix_bytes(10, 4) == 10 * 4 * 8 + 11 * 8
    assert boosting.quantised_bytes(10, 4, 64) == 2 * 40 + 11 * 8
    assert [boosting.bin_index_bytes(b) for b in (2, 256, 257, 65536, 65537)] == [1, 1, 2, 2, 4]


@pytest.mark.parametrize("call", [
    lambda: boosting.hist_nodes_per_level(0),
    lambda: boosting.ring_wire_bytes(-1, 2),
    lambda: boosting.bins_per_feature(1),
    lambda: boosting.dmatrix_bytes(10, 4, density=0),
])  # fmt: skip
def test_formulas_refuse_bad_input(call):
    with pytest.raises(ValueError):
        call()


# --------------------------------------------------------------------------- the data


def test_partitions_are_seeded_and_carry_the_structure():
    d = data.Synthetic(rows=1001, features=6, partitions=4, noise_sd=0.0)
    assert sum(d.partition_rows(i) for i in range(4)) == 1001
    x0, y0 = d.partition(0)
    x1, _ = data.Synthetic(rows=1001, features=6, partitions=4, noise_sd=0.0).partition(0)
    assert np.array_equal(x0, x1) and x0.dtype == np.float32 and x0.shape == (251, 6)
    assert not np.array_equal(d.partition(1)[0][:10], x0[:10])
    np.testing.assert_allclose(y0, data.target(x0), rtol=1e-6)
    assert d.nbytes == 1001 * 7 * 4 and "1,001 rows" in d.describe()


def test_a_data_set_too_large_is_refused_with_the_rows_that_fit():
    with pytest.raises(data.DataTooLarge, match=r"use rows=[\d,]+ or fewer"):
        data.synthetic(10_000_000, 16, available_bytes=100 * 2**20)
    assert data.synthetic(1000, 16, available_bytes=100 * 2**20).rows == 1000


def test_informative_reads_the_top_features():
    assert data.informative({"f0": 9, "f1": 8, "f2": 7, "f3": 6, "f9": 1})
    assert not data.informative({"f0": 9, "f1": 8, "f2": 7, "f9": 6, "f3": 1})


# --------------------------------------------------------------------------- the GPU paths, faked


def _gpus(n: int, mig: bool = False) -> list[GpuInfo]:
    prefix = "MIG-" if mig else "GPU-"
    return [GpuInfo(index=i, name="NVIDIA A100" + (" MIG 3g.20gb" if mig else ""),
                    memory_bytes=40 * 2**30, compute_capability=(8, 0),
                    uuid=f"{prefix}{i:04d}", source="nvml") for i in range(n)]  # fmt: skip


def test_gpu_plan_on_the_cpu_tier_says_what_it_cannot_show():
    p = gpu.plan([], absent=[])
    assert not p.runs and p.workers == 0 and "cannot show" in p.describe()
    assert "No GPU run of this notebook has been recorded" in p.describe() and not gpu.RECORDED


def test_gpu_plan_one_worker_per_gpu_by_uuid_with_pool_and_ucx():
    p = gpu.plan(_gpus(2), rmm_pool_size="2GB", protocol="ucx", absent=[])
    assert p.runs and p.workers == 2
    assert p.cuda_kwargs == {"CUDA_VISIBLE_DEVICES": "GPU-0000,GPU-0001", "protocol": "ucx",
                             "rmm_pool_size": "2GB", "enable_nvlink": True,
                             "enable_infiniband": True}  # fmt: skip
    assert p.xgboost_params()["device"] == "cuda"


def test_gpu_plan_on_mig_turns_nvlink_off_and_prints_the_limits():
    p = gpu.plan(_gpus(2, mig=True), protocol="ucx", absent=[])
    assert p.mig and p.cuda_kwargs["enable_nvlink"] is False
    assert "CUDA IPC" in p.describe()


def test_gpu_plan_names_the_extra_when_packages_are_missing():
    p = gpu.plan(_gpus(1), absent=["dask_cuda", "cuml"])
    assert not p.runs and "pip install -e '.[rapids]'" in p.describe()
    with pytest.raises(ValueError, match="protocol"):
        gpu.plan(_gpus(1), protocol="infiniband")


def test_require_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "rmm", None)  # an import of it fails
    with pytest.raises(cluster.MissingExtra, match=r"\.\[rapids\]"):
        gpu.require("rmm")
    with pytest.raises(cluster.MissingExtra, match=r"\.\[rapids\]"):
        gpu.rmm_allocation_times(1024)


class _FakeRmm:
    """rmm's two calls the timing uses; the pool makes an allocation cheaper."""

    def __init__(self) -> None:
        self.pool = False
        self.calls: list[tuple[bool, int | None]] = []

    def reinitialize(self, pool_allocator: bool = False, initial_pool_size: int | None = None):
        self.pool = pool_allocator
        self.calls.append((pool_allocator, initial_pool_size))

    def DeviceBuffer(self, size: int) -> None:
        time.sleep(0 if self.pool else 1e-4)


def test_rmm_allocation_times_runs_plain_then_pooled():
    fake = _FakeRmm()
    t = gpu.rmm_allocation_times(2**20, repeats=20, rmm=fake)
    assert fake.calls == [(False, None), (True, 4 * 2**20)]
    assert t.pool_s < t.plain_s and "RMM pool" in t.describe()


def test_cuml_kmeans_passes_the_client_and_k():
    seen = {}

    class FakeKMeans:
        def __init__(self, n_clusters, client):
            seen.update(k=n_clusters, client=client)

        def fit(self, x):
            seen["x"] = x
            return self

    gpu.cuml_kmeans("client", "X", 8, kmeans_cls=FakeKMeans)
    assert seen == {"k": 8, "client": "client", "x": "X"}


def test_a_gpu_option_on_the_cpu_tier_is_refused_with_the_fix():
    from labkit.tabular import training

    with pytest.raises(cluster.ClusterError, match=r"use device='cpu' here"):
        training.check_device("cuda", "cpu")
    training.check_device("cuda", "single-gpu")
    training.check_device("cpu", "cpu")


def test_device_cuda_without_dask_cuda_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "dask_cuda", None)
    with pytest.raises(cluster.MissingExtra, match=r"pip install -e '\.\[rapids\]'"):
        cluster.open_workers(1, device="cuda")


# --------------------------------------------------------------------------- a real cluster


def test_a_taken_port_is_refused_with_the_fix():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(cluster.PortTaken, match=rf"port {port} is taken.*port=0"):
            cluster.open_workers(1, port=port)
    assert cluster.port_free(0)


@pytest.fixture(scope="module")
def two_workers():
    with cluster.local_workers(2) as workers:
        yield workers
    assert cluster.survivors(workers) == []


def test_training_counts_the_predicted_bytes_per_round(two_workers):
    from labkit.tabular import training

    d = data.synthetic(8000, 8, partitions=2)
    x, y = data.place(two_workers.client, d, two_workers.addresses)
    fit = training.train(two_workers, x, y, params=training.params(max_depth=3, max_bin=16),
                         rounds=4)  # fmt: skip
    assert fit.workers == 2 and len(fit.round_s) == 4 and fit.total_s > fit.rounds_s
    assert fit.splits_per_level()[0] == 1  # every tree splits its root
    wire = training.read_wire(fit, features=8)
    assert wire.predicted_full == boosting.hist_round_wire_bytes(8, 16, 3, 2)
    # headers, ACKs and other traffic only add: the count is the prediction or a little more
    assert 0.99 <= wire.ratio <= 1.5, wire.describe()
    assert "predicted" in wire.describe() and "informative" in fit.describe()


def test_one_worker_against_two_gives_a_verdict(two_workers):
    from labkit.tabular import training

    d = data.synthetic(4000, 8, partitions=2)
    lines: list[str] = []
    got = training.compare_workers(two_workers, d, params=training.params(max_depth=2, max_bin=16),
                                   rounds=2, repeats=5, progress=lines.append)  # fmt: skip
    assert len(got.seconds["one worker"]) == len(got.seconds["two workers"]) == 5
    assert got.fits["one worker"].workers == 1 and got.fits["two workers"].workers == 2
    assert "verdict: " in got.describe() and len(lines) == 6  # a warm-up and five rounds


def test_the_task_stream_reads_per_worker_time():
    records = [{"worker": "a", "startstops": [{"action": "compute", "start": 0.0, "stop": 1.0}]},
               {"worker": "b", "startstops": [{"action": "transfer", "start": 0.5, "stop": 1.0},
                                              {"action": "compute", "start": 1.0, "stop": 2.0}]}]
    s = cluster.read_task_stream(records)
    assert s.wall_s == 2.0 and s.compute_s == {"a": 1.0, "b": 1.0} and s.transfer_s["b"] == 0.5
    assert "2 tasks" in s.describe()


def test_a_killed_worker_is_reported_with_the_fix_and_nothing_survives():
    workers = cluster.open_workers(2)
    try:
        victim = workers.pids[workers.addresses[0]]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while psutil.pid_exists(victim) and psutil.Process(victim).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(cluster.WorkerDied, match=rf"pid {victim}.*Fix: .*fewer rows"):
            workers.check()
    finally:
        workers.close()
    assert cluster.survivors(workers) == []
    for pid in workers.pids.values():
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_an_interrupted_block_leaves_no_worker():
    with pytest.raises(KeyboardInterrupt), cluster.local_workers(1) as workers:
        raise KeyboardInterrupt
    assert cluster.survivors(workers) == []


# --------------------------------------------------------------------------- memory


def test_the_memory_probe_measures_both_matrices():
    reading = memory.matrix_memory(100_000, 8, 64)
    q, d = reading.probes["QuantileDMatrix"], reading.probes["DMatrix"]
    assert q.after_round > 0 and d.after_round > q.after_round
    # the saving is the DMatrix's stored values: 8 bytes per value (the lab checks it at 15%)
    assert 0.5 < reading.measured_saving / reading.predicted_saving < 1.5, reading.describe()
    assert "predicted" in reading.describe()


def test_a_failing_probe_says_so(monkeypatch):
    def fail(*args, **kwargs):
        return types.SimpleNamespace(returncode=1, stderr="boom", stdout="")

    monkeypatch.setattr(memory.subprocess, "run", fail)
    with pytest.raises(RuntimeError, match=r"memory probe for DMatrix failed.*boom"):
        memory.probe("DMatrix", 10, 2, 16)
