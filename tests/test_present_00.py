"""What notebook 00's cells print, now that labkit tells it: the environment, the prediction,
the value check, the bytes on the wire, the time against the α–β model and the summary.

The rank results are the figures of a real smoke run of notebook 00 on the course's CPU
machine (2 gloo ranks), so the expected lines are the ones that notebook printed."""

from __future__ import annotations

from pathlib import Path

import pytest

from labkit.hardware import CpuInfo, GpuInfo, NvmlStatus
from labkit.hardware.environment import Environment
from labkit.jobs.launch import JobResult
from labkit.metrics import net
from labkit.workers import allreduce as worker
from labkit.workers import allreduce_report as report

MIB = 2**20


def _rank(rank: int, **changes: object) -> dict:
    r = {"rank": rank, "expected": 3.0, "value_min": 3.0, "value_max": 3.0, "wrong_elements": 0,
         "bytes_per_element": 4, "message_bytes": 262144, "loop_allreduces": 303, "repeats": 300,
         "probe_small_bytes": 4, "probe_small_s": 0.0001308, "probe_big_bytes": 1048576,
         "probe_big_s": 0.0006775, "wire_loop_bytes": 159830379, "wire_loop_s": 0.8041,
         "wire_idle_bytes": 3381, "wire_idle_s": 0.8057, "wire_unavailable": None,
         "median_s": 0.001478, "min_s": 0.0006974, "algbw_GBps": 0.1773, "busbw_GBps": 0.1773}  # fmt: skip
    return r | changes


def _result(backend: str = "gloo", **changes: object) -> JobResult:
    return JobResult(module="labkit.workers.allreduce", job_id="j", nproc=2, backend=backend,
                     device="cpu" if backend == "gloo" else "cuda",
                     ranks=[_rank(0, **changes), _rank(1, **changes)], wall_s=5.2,
                     log_dir=Path("/tmp/j"), status="ok", returncode=0)  # fmt: skip


def _whole_job(sent: int) -> net.WireCount:
    start = net.WireBytes("lo", 0, 0)
    return net.WireCount("lo", start, net.WireBytes("lo", sent, sent), sent, sent)


def test_environment_describe_prints_versions_cpu_nvml_and_each_gpu():
    cpu = CpuInfo("AMD EPYC", "x86_64", 2, 2, 2, ("avx2", "fma"))
    gpu = GpuInfo(0, "NVIDIA H100 80GB HBM3", 80 * 2**30, (9, 0), None, "nvml")
    env = Environment("3.11.7", "2.13.0+cpu", None, cpu, NvmlStatus(False, "no driver"), ())
    assert env.describe() == (
        "Python 3.11.7, torch 2.13.0+cpu (CPU-only build)\n"
        "AMD EPYC (x86_64): 2 usable of 2 logical cores, 2 physical; flags: avx2, fma\n"
        "NVML (the NVIDIA driver's monitoring library): unavailable: no driver")
    cuda = Environment("3.11.7", "2.13.0", "12.8", cpu, NvmlStatus(True, "NVML works"), (gpu,))
    assert cuda.describe().splitlines()[0] == "Python 3.11.7, torch 2.13.0 (CUDA 12.8)"
    assert cuda.describe().splitlines()[2:] == [
        "NVML (the NVIDIA driver's monitoring library): ok: NVML works",
        "GPU 0: NVIDIA H100 80GB HBM3, 80.0 GiB, compute capability 9.0 (via nvml)"]


def test_preset_sizes_the_job_and_keeps_the_lab_message_on_cpu_ranks():
    smoke = worker.preset("smoke", "cpu", op="sum", expect=3.0)
    assert (smoke.numel, smoke.warmup, smoke.repeats, smoke.expect) == (2**16, 3, 300, 3.0)
    assert worker.preset("gpu", "cpu").numel == 2**20  # minutes over loopback otherwise
    assert (worker.preset("gpu", "cuda").numel, worker.preset("gpu", "cuda").repeats) == (2**26, 500)
    with pytest.raises(ValueError, match="size"):
        worker.preset("huge", "cpu")


def test_prediction_prints_the_value_the_payload_and_the_busbw_factor():
    cfg = worker.preset("smoke", "cpu", expect=3.0)
    p = report.predict(cfg, 2, "gloo", "cpu", sent_per_rank=0.25 * MIB, whose="your answer")
    assert p.describe() == (
        "2 ranks will run on the cpu over gloo\n"
        "predicted: every element = 3\n"
        "predicted (your answer): each rank sends 0.250 MiB per all-reduce of a 0.250 MiB "
        "message (n = 2); 2 ranks × 304 all-reduces put 152.0 MiB of payload on the wire\n"
        "bus bandwidth = algorithm bandwidth × 1 for n = 2 (it tends to 2 as n grows: 1.75 for "
        "n = 8)")
    assert report.predict(worker.preset("smoke", "cpu"), 3, "gloo", "cpu", sent_per_rank=1.0,
                          whose="w").expected == 6.0  # no expect: the sum's n(n+1)/2


def test_value_check_passes_fails_and_notes_another_op():
    ok = report.check_values(_result(), 3.0, op="sum")
    assert ok.ok and ok.describe() == (
        "measured: smallest and largest element on each rank {0: (3.0, 3.0), 1: (3.0, 3.0)} "
        "(predicted: all 3, 'sum' all-reduce)\n"
        "✓ value check: all 65,536 elements on all 2 ranks equal 3 exactly")
    bad = report.check_values(_result(value_max=2.0, value_min=2.0, wrong_elements=65536), 3.0,
                              op="max")  # fmt: skip
    assert not bad.ok
    assert bad.describe().splitlines()[1:] == [
        "✗ value check: elements differ from the predicted 3 on rank 0 (65,536 of 65,536), "
        "rank 1 (65,536 of 65,536)",
        "(the prediction n(n+1)/2 = 3 is a sum's; the 'max' all-reduce was the one checked, and "
        "the timed all-reduces below are sums whatever reduce_op says)"]
    with pytest.raises(AssertionError, match="another value"):
        report.check_values(_result(), 6.0, op="sum")


def test_speed_line():
    assert report.describe_speed(_result()) == (
        "measured on rank 0: 1.48 ms per all-reduce of 0.25 MiB (median of 300; fastest 0.70 ms)"
        " -> algbw 0.177 GB/s, busbw 0.177 GB/s over gloo")


def test_wire_reconcile_subtracts_the_baseline_and_gives_the_verdict():
    w = report.reconcile_wire(_result(), _whole_job(int(195.1 * MIB)),
                              predicted_per_rank=0.25 * MIB, whose="your answer")  # fmt: skip
    assert w.describe() == (
        "measured on lo: 195.1 MiB during the whole job, 152.4 MiB during its 303 looped "
        "all-reduces (0.80 s); baseline 3 KiB in 0.81 s without any\n"
        "measured: 0.2515 MiB per rank and all-reduce ((loop − baseline) / 2 ranks / 303 "
        "all-reduces)\n"
        "predicted (your answer): 0.2500 MiB of payload\n"
        "verdict: the predicted payload is 99% of the bytes measured on lo per rank and "
        "all-reduce (0.2500 MiB of 0.2515 MiB)\n"
        "measured − predicted: 1,597 bytes per rank and all-reduce (+0.61% of the payload)")
    low = report.reconcile_wire(_result(wire_loop_bytes=1000), None, predicted_per_rank=0.25 * MIB,
                                whose="w")  # fmt: skip
    assert low.extra is None and "the wire cannot check the prediction" in low.describe()
    assert "not counted during the whole job" in low.describe()
    off = report.reconcile_wire(_result(wire_unavailable="nccl moves the bytes elsewhere"), None,
                                predicted_per_rank=1.0, whose="w")  # fmt: skip
    assert off.describe() == "no bytes counted on the wire here: nccl moves the bytes elsewhere"


def test_time_reconcile_fits_alpha_beta_and_places_the_median():
    t = report.reconcile_time(_result())
    assert t.describe() == (
        "measured (link probe, one ring step): α = 131 µs per message, β = 1.92 GB/s\n"
        "predicted (α–β): 0.398 ms with the ring's 2(n−1) messages, 0.660 ms with gloo's 4(n−1)\n"
        "measured: median 1.478 ms, fastest 0.697 ms: 3.71 × the 2(n−1)-message prediction, "
        "2.24 × gloo's 4(n−1)-message one\n"
        "the median took 2.2 × the 4(n−1)-message prediction (the fastest 1.1 ×): time the α–β "
        "model does not charge; the list below gives possible causes, none of them measured here")
    between = report.reconcile_time(_result(median_s=0.0005))
    assert between.describe().endswith("with between 2(n−1) and 4(n−1) messages paying α")
    below = report.reconcile_time(_result(median_s=0.0002))
    assert "the model over-charges this all-reduce" in below.describe()
    nccl = report.reconcile_time(_result("nccl"))
    assert nccl.t_high == nccl.t_ring
    assert nccl.describe().splitlines()[1] == "predicted (α–β, the ring's 2(n−1) messages): 0.398 ms"
    disturbed = report.reconcile_time(_result(probe_big_s=0.0001))
    assert (disturbed.alpha_s, disturbed.beta) == (None, None)
    assert disturbed.describe().startswith("no α–β prediction: big_bytes=1048576")


def test_summary_one_line_a_figure():
    res = _result()
    s = report.summarize("cpu", res, report.check_values(res, 3.0, op="sum"),
                         report.reconcile_wire(res, None, predicted_per_rank=0.25 * MIB, whose="w"),
                         report.reconcile_time(res))  # fmt: skip
    assert s.describe() == (
        "tier: cpu; 2 ranks over gloo on the cpu\n"
        "values: every element as predicted (3, 'sum' all-reduce)\n"
        "bytes per rank and all-reduce: measured 0.2515 MiB on lo, predicted 0.2500 MiB of "
        "payload (+0.61%)\n"
        "all-reduce time: measured median 1.478 ms; α–β prediction 0.398 ms with 2(n−1) "
        "messages, 0.660 ms with gloo's 4(n−1)\n"
        "bandwidth (measured): algbw 0.177 GB/s, busbw 0.177 GB/s")


def test_count_job_wire_counts_only_gloo_on_loopback():
    with report.count_job_wire("nccl") as wire:
        pass
    assert wire is None
    if net.unavailable("lo") is None:
        with report.count_job_wire("gloo") as wire:
            pass
        assert wire is not None and wire.sent is not None and wire.sent >= 0


def test_time_reconcile_without_a_probe_says_so():
    res = _result()
    for r in res.ranks:
        for key in ("probe_small_bytes", "probe_small_s", "probe_big_bytes", "probe_big_s"):
            del r[key]
    assert report.reconcile_time(res).describe() == (
        "no α–β prediction: the job ran no link probe (probe=False), so α and β are unknown")
