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
from labkit.tabular import cluster, data, gpu, memory, scaling, training

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


def test_tcp_headers_count_the_ring_sends_and_segments():
    assert boosting.ring_sends(1) == 0 and boosting.ring_sends(2) == 6 and boosting.ring_sends(4) == 28
    # 16 KiB on 2 workers: six sends of 8 KiB, one segment each
    assert boosting.tcp_header_bytes(16384, 2) == 6 * 52
    # 256 KiB: sends of 128 KiB, three segments of at most 65,483 bytes each
    assert boosting.tcp_header_bytes(262144, 2) == 6 * 3 * 52
    assert boosting.tcp_header_bytes(16384, 1) == 0 and boosting.tcp_header_bytes(0, 2) == 0


def test_ellpack_packs_bits_not_bytes():
    # 64 bins: 6 bits per value (SymbolBits), 8 bytes of padding, whole 4-byte words
    assert boosting.ellpack_bytes(1000, 16, 64) == -(-(6 * 16000 // 8 + 8) // 4) * 4
    assert boosting.ellpack_bytes(1, 1, 1) == 12  # 1 bit, padded: 9 bytes, rounded to words
    assert boosting.ellpack_bytes(400_000, 16, 64) < boosting.quantised_bytes(400_000, 16, 64) / 2


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


def test_gpu_plan_one_worker_per_gpu_by_uuid_with_pool_and_automatic_ucx():
    p = gpu.plan(_gpus(2), rmm_pool_size="2GB", protocol="ucx", absent=[])
    assert p.runs and p.workers == 2
    # UCX's automatic configuration: the protocol alone, no enable_* transport flags
    assert p.cuda_kwargs == {"CUDA_VISIBLE_DEVICES": "GPU-0000,GPU-0001", "protocol": "ucx",
                             "rmm_pool_size": "2GB"}  # fmt: skip
    assert p.xgboost_params()["device"] == "cuda"


def test_a_ucx_plan_asks_for_the_ucx_backend(monkeypatch):
    monkeypatch.setattr(gpu, "missing", lambda modules: [m for m in modules if m == gpu.UCX_MODULE])
    assert gpu.plan(_gpus(2), protocol="ucx").absent == (gpu.UCX_MODULE,)
    assert gpu.plan(_gpus(2), protocol="tcp").absent == ()


def test_gpu_plan_on_mig_prints_the_limits():
    p = gpu.plan(_gpus(2, mig=True), protocol="ucx", absent=[])
    assert p.mig and "enable_nvlink" not in p.cuda_kwargs
    assert p.cuda_kwargs["CUDA_VISIBLE_DEVICES"] == "MIG-0000,MIG-0001"
    assert "CUDA IPC" in p.describe() and "DCGM" in p.describe()
    assert not any("some drivers" in limit for limit in gpu.MIG_LIMITS)


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
        gpu.allocation_samples(1024, 1, 1, 4096)


class _FakeResource:
    """An ``rmm.mr`` resource: allocate and deallocate, slower without a pool."""

    def __init__(self, delay_s: float, log: list[tuple[str, int]], name: str) -> None:
        self.delay_s, self.log, self.name = delay_s, log, name

    def allocate(self, nbytes: int) -> int:
        time.sleep(self.delay_s)
        self.log.append((self.name, nbytes))
        return 1

    def deallocate(self, ptr: int, nbytes: int) -> None:
        pass


def _fake_rmm(log: list[tuple[str, int]]) -> types.SimpleNamespace:
    def pool(upstream, initial_pool_size):
        log.append(("pool of", initial_pool_size))
        return _FakeResource(0.0, log, "pool")

    mr = types.SimpleNamespace(CudaMemoryResource=lambda: _FakeResource(2e-4, log, "plain"),
                               PoolMemoryResource=pool)  # fmt: skip
    # no reinitialize: the worker's own current resource must not be touched
    return types.SimpleNamespace(mr=mr)


class _FakeClient:
    """``client.run`` on one worker, in this process."""

    def __init__(self) -> None:
        self.ran_on: list[list[str]] = []

    def run(self, fn, *args, workers, **kwargs):
        self.ran_on.append(workers)
        return {workers[0]: fn(*args, **kwargs)}


def test_rmm_allocation_times_run_on_a_worker_and_give_a_verdict(monkeypatch):
    log: list[tuple[str, int]] = []
    monkeypatch.setattr(gpu, "require", lambda module: _fake_rmm(log))
    client = _FakeClient()
    w = types.SimpleNamespace(client=client, addresses=["tcp://w0", "tcp://w1"])
    t = gpu.rmm_allocation_times(w, 2**20, repeats=5, batches=5)
    assert client.ran_on == [["tcp://w0"]] and ("pool of", 4 * 2**20) in log
    assert len(t.plain_s) == len(t.pool_s) == 5
    assert "verdict: RMM pool is faster than cudaMalloc" in t.describe()


def test_cuml_kmeans_copies_partitions_to_the_gpu_and_passes_the_client_and_k():
    import dask.array as da

    seen = {}

    class FakeKMeans:
        def __init__(self, n_clusters, client):
            seen.update(k=n_clusters, client=client)

        def fit(self, x):
            seen["x"] = x.compute()
            return self

    x = da.ones((8, 2), chunks=4)
    gpu.cuml_kmeans("client", x, 8, kmeans_cls=FakeKMeans, to_device=lambda b: b * 2)
    assert seen["k"] == 8 and seen["client"] == "client" and float(seen["x"].sum()) == 32


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
    bins = training.cut_bins(two_workers.client, x, 16)
    assert bins == [16] * 8  # continuous features: max_bin each, read from the cuts
    wire = training.read_wire(fit, features=8, bins=bins)
    root_sum = boosting.ring_wire_bytes(training.ROOT_SUM_BYTES, 2)
    assert wire.bins_read and wire.predicted_full == boosting.hist_round_wire_bytes(8, 16, 3, 2) + root_sum
    # headers, ACKs and other traffic only add: the count is the prediction or a little more
    assert 0.99 <= wire.ratio <= 1.5, wire.describe()
    assert "predicted" in wire.describe() and "informative" in fit.describe()


def test_one_worker_against_two_gives_a_verdict(two_workers):
    from labkit.tabular import training

    d = data.synthetic(4000, 8, partitions=2)
    lines: list[str] = []
    got = scaling.compare_workers(two_workers, d, params=training.params(max_depth=2, max_bin=16),
                                  rounds=2, repeats=5, round_wire_bytes=1e5, bandwidth=1e9,
                                  progress=lines.append)  # fmt: skip
    assert len(got.seconds["one worker"]) == len(got.seconds["two workers"]) == 5
    assert len(got.round_s["two workers"]) == len(got.fixed_s["one worker"]) == 5  # no warm-up
    assert got.fits["one worker"].workers == 1 and got.fits["two workers"].workers == 2
    text = got.describe()
    assert text.count("verdict: ") == 2 and "predicted two-worker round" in text
    assert "whole calls: " in got.sentence and len(lines) == 6  # a warm-up and five rounds


def test_the_task_stream_reads_per_worker_time():
    records = [{"worker": "a", "startstops": [{"action": "compute", "start": 0.0, "stop": 1.0}]},
               {"worker": "b", "startstops": [{"action": "transfer", "start": 0.5, "stop": 1.0},
                                              {"action": "compute", "start": 1.0, "stop": 2.0}]}]
    s = cluster.read_task_stream(records)
    assert s.wall_s == 2.0 and s.compute_s == {"a": 1.0, "b": 1.0} and s.transfer_s["b"] == 0.5
    assert "2 tasks" in s.describe()


def test_a_second_cluster_on_the_machine_takes_no_fixed_port():
    """dask's default HTTP port (8787) held, as by another learner's cluster on a shared server:
    the cluster still starts, and says nothing about it under the cell."""
    import warnings

    from labkit.tabular import cluster

    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", 8787))
        holder.listen()
    except OSError:
        pass  # held already: the case this test is about
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with cluster.local_workers(1):
                pass
    finally:
        holder.close()
    assert not [w for w in seen if "8787" in str(w.message)]


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


# --------------------------------------------------------------------------- sentences, per branch


def _wire(counted, *, predicted=1_000_000.0, headers=3000.0, workers=2, device="cpu", why=""):
    return training.WireReading(workers=workers, device=device, total_bins=1024, bins_read=True,
                                nodes_per_level=[1, 1], predicted_full=predicted,
                                predicted_trees=predicted, textbook=predicted * 2 / 3,
                                headers=headers, counted=counted, not_counted=why)  # fmt: skip


def test_wire_sentence_agrees_within_the_headers_and_acks():
    w = _wire([1_004_000] * 9)
    assert w.band == (3000, 6000) and w.sentence().startswith("counted and predicted agree")
    assert "4,000 bytes" in w.sentence()


def test_wire_sentence_one_bin_off_is_caught():
    # a model 1.6% short (63 bins for 64): far beyond headers and ACKs
    assert _wire([1_016_000] * 9).sentence().startswith("counted is above the prediction")
    assert _wire([990_000] * 9).sentence().startswith("counted is below the prediction")


def test_wire_band_widens_with_the_counts_spread():
    w = _wire([1_000_000, 1_010_000, 1_007_000, 1_004_000, 1_001_000])
    assert w.spread > 0 and w.band[1] > 6000
    assert w.sentence().startswith("counted and predicted agree")


def test_wire_sentence_one_worker_and_not_counted():
    assert _wire([500] * 5, predicted=0.0, workers=1).sentence().startswith("one worker all-reduces nothing")
    gone = _wire(None, device="cuda", why="NCCL")
    assert gone.sentence().startswith("not counted on this tier: NCCL")
    assert gone.counted_summary() == "not counted on this tier" and "counted on lo" not in gone.describe()


def _fit(device="cpu", round_bytes=(10, 1_600_000, 1_600_100), workers=2):
    booster = types.SimpleNamespace(get_dump=lambda dump_format: [
        '{"depth": 0, "children": [{"depth": 1, "children": [{"leaf": 1}, {"leaf": 2}]}, {"leaf": 3}]}'])
    return training.Fit(workers=workers, rounds=3, total_s=1.0, round_s=[0.01] * 3,
                        round_bytes=None if round_bytes is None else list(round_bytes),
                        booster=booster, params=training.params(max_depth=3, max_bin=16, device=device))


def test_read_wire_on_gpus_predicts_nccl_and_does_not_count_lo():
    w = training.read_wire(_fit(device="cuda"), features=8)
    assert w.counted is None and "NCCL" in w.not_counted and "NCCL's ring" in w.describe()
    assert w.predicted_trees == w.textbook  # NCCL's ring is the textbook one
    assert not w.bins_read and w.total_bins == 8 * 16


def test_read_wire_without_a_counter_says_why():
    w = training.read_wire(_fit(round_bytes=None), features=8)
    assert w.counted is None and "cannot be read" in w.sentence()
    with pytest.raises(ValueError, match="one per feature"):
        training.read_wire(_fit(), features=8, bins=[16] * 7)


def test_the_task_stream_says_whether_data_moved():
    quiet = cluster.read_task_stream(
        [{"worker": "a", "startstops": [{"action": "compute", "start": 0.0, "stop": 1.0}]}])
    assert "no worker received data" in quiet.describe()
    moved = cluster.read_task_stream(
        [{"worker": "a", "startstops": [{"action": "transfer", "start": 0.0, "stop": 0.5},
                                        {"action": "compute", "start": 0.5, "stop": 1.0}]},
         {"worker": "a", "startstops": [{"action": "compute", "start": 2.0, "stop": 3.0}]}])
    text = moved.describe()
    assert "received data for 0.500 s" in text and "neither computed nor received for 1.00 s" in text


def _reading(dmatrix_round: int, quantile_round: int) -> memory.MemoryReading:
    probe = {"DMatrix": memory.Probe("DMatrix", 0, 1, dmatrix_round),
             "QuantileDMatrix": memory.Probe("QuantileDMatrix", 0, 1, quantile_round)}
    return memory.MemoryReading(rows=1000, features=4, max_bin=64, probes=probe)


def test_memory_sentence_per_branch():
    saving = boosting.dmatrix_bytes(1000, 4)
    assert "as predicted" in _reading(saving + 500, 500).sentence()
    assert "more than 15% off" in _reading(2 * saving, 0).sentence()
    assert "ELLPACK page" in _reading(saving, 0).describe()


def test_one_worker_cannot_compare_and_says_so():
    one = types.SimpleNamespace(addresses=["tcp://w0"])
    got = scaling.compare_workers(one, data.Synthetic(rows=100), params={}, rounds=1, repeats=5)
    assert got.comparison is None and got.sentence == scaling.ONE_WORKER == got.describe()
    assert got.plot() is None


def test_round_sentence_per_branch():
    p = scaling.RoundPrediction(one_round_s=0.020, wire_bytes=1e6, bandwidth=1e9)
    assert p.two_round_s == pytest.approx(0.011)
    assert scaling.round_sentence([0.0105, 0.011, 0.0115], p, 2).startswith("two workers' round as predicted")
    slow = scaling.round_sentence([0.024, 0.025, 0.026], p, 2)
    assert slow.startswith("two workers' round is slower") and "2 CPU core(s)" in slow
    assert "waiting for the slower worker" in scaling.round_sentence([0.024, 0.025, 0.026], p, 16)
    assert "faster than predicted" in scaling.round_sentence([0.005, 0.0055, 0.006], p, 16)


def test_loopback_bandwidth_is_measured():
    assert scaling.loopback_bandwidth(2**20, repeats=2) > 1e6  # bytes/s: any machine beats 1 MB/s


# --------------------------------------------------------------------------- the GPU tier, walked


@pytest.fixture
def fake_dask_cuda(monkeypatch):
    """``dask_cuda.LocalCUDACluster`` as a CPU ``LocalCluster`` of the same worker count, which
    records the arguments the plan gave it."""
    from distributed import LocalCluster

    seen: list[dict] = []

    def local_cuda_cluster(n_workers, scheduler_port, dashboard_address, **kwargs):
        seen.append(dict(kwargs, n_workers=n_workers))
        return LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True,
                            scheduler_port=scheduler_port, dashboard_address=dashboard_address,
                            host="127.0.0.1", worker_dashboard_address=None)  # fmt: skip

    monkeypatch.setitem(sys.modules, "dask_cuda",
                        types.SimpleNamespace(LocalCUDACluster=local_cuda_cluster))
    return seen


@pytest.mark.parametrize(("n", "mig"), [(1, False), (2, True)])
def test_the_notebook_on_the_gpu_tier_reaches_the_end(fake_dask_cuda, n, mig):
    """Cells 3, 5, 12, 15 and 23 of notebook 08 with a faked GPU plan: one GPU (the cluster of
    one worker must not stop Run All) and two MIG instances."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the fake rmm goes to a worker
    plan = gpu.plan(_gpus(n, mig=mig), absent=[])
    assert plan.runs and plan.workers == n
    with cluster.local_workers(plan.workers, device="cuda", cuda_kwargs=plan.cuda_kwargs) as w:
        assert fake_dask_cuda[-1]["CUDA_VISIBLE_DEVICES"] == plan.cuda_kwargs["CUDA_VISIBLE_DEVICES"]
        assert len(w.addresses) == n
        d = data.synthetic(2000, 4, partitions=2)
        compared = scaling.compare_workers(w, d, params=training.params(max_depth=2, max_bin=8),
                                           rounds=1, repeats=1, progress=None)  # fmt: skip
        if n == 1:
            assert compared.sentence == scaling.ONE_WORKER
        else:
            assert compared.comparison is not None  # two instances: compared, as two GPUs
        fit = _fit(device="cuda", workers=n)
        assert training.read_wire(fit, features=4).sentence().startswith("not counted on this tier")
        t = gpu.rmm_allocation_times(w, 2**10, repeats=2, batches=5, rmm=_fake_rmm([]))  # on worker 0
        assert t.worker == w.addresses[0] and len(t.pool_s) == 5
    assert cluster.survivors(w) == []
