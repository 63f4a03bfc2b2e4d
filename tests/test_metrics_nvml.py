"""NVML backend, driven through the NVML test double; recorder and replay of its traces."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys

import pytest
from fake_nvml import SM_OCCUPANCY, SM_UTIL, TENSOR, FakeGpu, FakeNvml
from pynvml import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_TIMEOUT,
)

from labkit.metrics import (
    METRICS,
    BackendUnavailable,
    CpuBackend,
    NvmlBackend,
    Recorder,
    ReplayBackend,
    ReplayError,
    Sample,
    auto_backend,
    load_trace,
    parse_visible_devices,
)

GIB = 2**30
JOB_PIDS = {0: 9_000_001, 1: 9_000_002}  # above Linux's pid_max: no real process has them


def by_source(samples: list[Sample]) -> dict[str, Sample]:
    return {s.source: s for s in samples}


def two_gpus(**kw) -> FakeNvml:
    return FakeNvml([FakeGpu(uuid="GPU-aaaa-0", **kw), FakeGpu(uuid="GPU-bbbb-1", **kw)])


@pytest.fixture(autouse=True)
def _no_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)


def test_import_starts_nothing():
    code = ("import sys, threading, labkit.metrics, labkit.metrics.nvml; "
            "assert 'pynvml' not in sys.modules, 'pynvml imported at import time'; "
            "assert threading.active_count() == 1, threading.enumerate()")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)


# -- library missing, driver problems at open -------------------------------------------------


@pytest.mark.parametrize(("code", "words"), [
    (NVML_ERROR_LIBRARY_NOT_FOUND, "library not found"),
    (NVML_ERROR_DRIVER_NOT_LOADED, "not loaded"),
    (NVML_ERROR_LIB_RM_VERSION_MISMATCH, "reboot"),
])  # fmt: skip
def test_open_fails_with_reason_and_auto_falls_back_to_cpu(code, words):
    fake = FakeNvml(init_error=code)
    with pytest.raises(BackendUnavailable, match=words):
        NvmlBackend(nvml=fake).open()
    backend = auto_backend(nvml=FakeNvml(init_error=code))
    try:
        assert isinstance(backend, CpuBackend)
        assert "no NVIDIA GPU found" in backend.describe()
        assert words in backend.describe()
        assert not any(s.kind == "nvml" for s in backend.sample())
    finally:
        backend.close()


def test_real_pynvml_without_driver_is_unavailable():
    backend = NvmlBackend()  # the real bindings
    try:
        backend.open()
    except BackendUnavailable as e:
        assert "NVML unavailable" in str(e) and backend.reason
        assert backend.describe().startswith("NVML unavailable")
    else:  # a machine with a driver: the real thing must work
        try:
            assert backend.sample()
        finally:
            backend.close()
        pytest.skip("an NVIDIA driver is present here")


def test_driver_with_no_gpu_is_unavailable():
    fake = FakeNvml([])
    with pytest.raises(BackendUnavailable, match="no GPU"):
        NvmlBackend(nvml=fake).open()
    assert fake.inits == fake.shutdowns == 1


# -- normal readings and units -----------------------------------------------------------------


def test_every_field_read_in_its_documented_unit():
    gpu = FakeGpu(nvlink_kib=(1_000_000, 2_000_000))
    fake = FakeNvml([gpu])
    clock = [0.0]
    with NvmlBackend(nvml=fake, clock=lambda: clock[0]) as nv:
        clock[0] = 10.0
        first = by_source(nv.sample(now=10.0))["gpu0"].values
        gpu.energy_mj += 250_000  # 250 J later
        gpu.nvlink_kib = (1_000_000 + 4 * 1024**2, 2_000_000 + 2 * 1024**2)  # +4 GiB, +2 GiB
        clock[0] = 12.0
        second = by_source(nv.sample(now=12.0))["gpu0"].values
    assert first["gpu_util_pct"] == 97.0 and first["mem_util_pct"] == 41.0
    assert first["mem_used_gib"] == pytest.approx(40.0)
    assert first["mem_total_gib"] == pytest.approx(141.0)
    assert first["power_w"] == pytest.approx(612.5)
    assert first["energy_j"] == 0.0  # difference since open
    assert second["energy_j"] == pytest.approx(250.0)
    assert first["temp_c"] == 61.0 and first["sm_clock_mhz"] == 1980.0
    assert first["pcie_tx_gbs"] == pytest.approx(2.0) and first["pcie_rx_gbs"] == pytest.approx(8.0)
    assert "nvlink_tx_gbs" not in first  # the first counter reading only sets the baseline
    assert second["nvlink_tx_gbs"] == pytest.approx(4 * 2**30 / 2 / 1e9)  # bytes over 2 s
    assert second["nvlink_rx_gbs"] == pytest.approx(2 * 2**30 / 2 / 1e9)
    assert (first["sm_active_pct"], first["sm_occupancy_pct"], first["tensor_active_pct"]) == (
        85.0, 40.0, 62.5)  # fmt: skip
    for name in (*first, *second):
        m = METRICS[name]  # every key produced is documented, with unit and nvidia-smi column
        assert m.backend == "nvml" and m.unit and m.window and m.nvidia_smi and m.description


def test_describe_names_gpus_driver_and_cuda():
    with NvmlBackend(nvml=two_gpus()) as nv:
        assert nv.describe() == "NVML: 2 GPUs (NVIDIA H200), driver 570.86.15, CUDA 12.8"
        assert nv.hardware == "2× NVIDIA H200"
    assert NvmlBackend(nvml=two_gpus()).describe() == "NVML (not opened)"


def test_slow_fields_read_at_lower_rate():
    gpu = FakeGpu(processes=[(JOB_PIDS[0], 3 * GIB)])
    fake = FakeNvml([gpu])
    with NvmlBackend(lambda: JOB_PIDS, nvml=fake, pcie_every=3, process_every=2) as nv:
        ticks = [by_source(nv.sample(now=float(t))) for t in range(6)]
    pcie = [t for t, s in enumerate(ticks) if "pcie_tx_gbs" in s["gpu0"].values]
    procs = [t for t, s in enumerate(ticks) if "gpu0/rank0" in s]
    assert pcie == [0, 3] and procs == [0, 2, 4]
    assert fake.calls[("nvmlDeviceGetPcieThroughput", 0)] == 2 * 2  # tx and rx, twice
    assert fake.calls[("nvmlDeviceGetComputeRunningProcesses", 0)] == 3
    assert fake.calls[("nvmlDeviceGetUtilizationRates", 0)] == 6


def test_process_memory_only_for_the_jobs_processes():
    gpu = FakeGpu(processes=[(JOB_PIDS[0], 3 * GIB), (JOB_PIDS[1], GIB // 2), (9_000_099, 7 * GIB)])
    with NvmlBackend(lambda: JOB_PIDS, nvml=FakeNvml([gpu])) as nv:
        got = by_source(nv.sample())
    assert got["gpu0/rank0"].values == {"proc_mem_gib": 3.0}
    assert got["gpu0/rank1"].values == {"proc_mem_gib": 0.5}
    assert not any("9000099" in s or "pid" in s for s in got)  # someone else's process
    with NvmlBackend(nvml=FakeNvml([gpu])) as nv:  # no job given: every process, by PID
        assert by_source(nv.sample())["gpu0/pid9000099"].values == {"proc_mem_gib": 7.0}


def test_no_process_of_the_job_in_nvmls_list_is_said_not_hidden():
    """In a container NVML may list host PIDs: the per-rank lines are missing, and we say so."""
    gpu = FakeGpu(processes=[(9_000_099, 7 * GIB)])
    with NvmlBackend(lambda: JOB_PIDS, nvml=FakeNvml([gpu]), process_every=1) as nv:
        assert set(by_source(nv.sample())) == {"gpu0"}
        assert "none with a PID of this job" in nv.status["gpu0.proc_mem_gib"]
        gpu.processes.append((JOB_PIDS[0], GIB))
        assert "gpu0/rank0" in by_source(nv.sample())
        assert "gpu0.proc_mem_gib" not in nv.status


def test_process_memory_hidden_by_driver_is_na_not_zero():
    gpu = FakeGpu(processes=[(JOB_PIDS[0], None)])
    with NvmlBackend(lambda: JOB_PIDS, nvml=FakeNvml([gpu])) as nv:
        assert by_source(nv.sample())["gpu0/rank0"].values == {"proc_mem_gib": None}


def test_broken_pids_fn_does_not_stop_gpu_readings():
    def broken():
        raise KeyError("no heartbeat yet")

    with NvmlBackend(broken, nvml=FakeNvml()) as nv:
        got = by_source(nv.sample())
        assert got["gpu0"].values["power_w"] == pytest.approx(612.5)
        assert "KeyError" in nv.status["pids_fn"]


# -- a field not supported ---------------------------------------------------------------------


def test_unsupported_field_is_na_never_zero_and_not_asked_again():
    gpu = FakeGpu(unsupported={"nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEnergyConsumption"})
    fake = FakeNvml([gpu])
    with NvmlBackend(nvml=fake) as nv:
        samples = [by_source(nv.sample())["gpu0"] for _ in range(3)]
        assert "not supported" in nv.status["gpu0.power_w"]
        assert "not supported" in nv.status["gpu0.energy_j"]
    for s in samples:
        assert s.status == "ok"
        assert s.values["power_w"] is None and s.values["energy_j"] is None  # N/A, not 0
        assert s.values["gpu_util_pct"] == 97.0  # the rest still works
    assert fake.calls[("nvmlDeviceGetPowerUsage", 0)] == 1
    assert fake.calls[("nvmlDeviceGetTotalEnergyConsumption", 0)] == 1  # at open only


def test_pre_hopper_gpu_has_no_gpm_and_pcie_card_no_nvlink():
    fake = FakeNvml([FakeGpu(name="NVIDIA A10", gpm=None, nvlink_links=0)])
    with NvmlBackend(nvml=fake) as nv:
        v = by_source(nv.sample())["gpu0"].values
        v2 = by_source(nv.sample())["gpu0"].values
        assert "Hopper" in nv.status["gpu0.sm_active_pct"]
        assert "no NVLink" in nv.status["gpu0.nvlink_tx_gbs"]
    for name in ("sm_active_pct", "sm_occupancy_pct", "tensor_active_pct", "nvlink_tx_gbs"):
        assert v[name] is None and v2[name] is None
    assert fake.buffers == []  # no GPM buffer was allocated
    assert fake.calls[("nvmlGpmSampleGet", 0)] == 0


def test_gpm_waits_for_a_window_of_at_least_a_tenth_of_a_second():
    """The first tick comes right after open(): a GPM window of a millisecond is noise, so
    GPM is not read then (keys absent: not read, rather than N/A) and read once it has run."""
    fake = FakeNvml([FakeGpu()])
    clock = [5.0]
    with NvmlBackend(nvml=fake, clock=lambda: clock[0]) as nv:
        clock[0] = 5.05
        first = by_source(nv.sample())["gpu0"].values
        clock[0] = 5.2
        second = by_source(nv.sample())["gpu0"].values
        third = by_source(nv.sample())["gpu0"].values  # no time passed since the second
    assert "sm_active_pct" not in first and first["gpu_util_pct"] == 97.0
    assert second["sm_active_pct"] == 85.0 and "sm_active_pct" not in third
    assert fake.calls[("nvmlGpmSampleGet", 0)] == 2  # at open, and once for the second tick


def test_gpm_partially_supported_and_buffers_freed():
    gpu = FakeGpu(gpm={SM_UTIL: 70.0, SM_OCCUPANCY: 30.0})  # no tensor metric on this one
    fake = FakeNvml([gpu])
    clock = [0.0]
    nv = NvmlBackend(nvml=fake, clock=lambda: clock[0])
    nv.open()
    assert fake.live_gpm_buffers == 2
    clock[0] = 1.0
    v = by_source(nv.sample())["gpu0"].values
    gpu.gpm = {SM_UTIL: 10.0, SM_OCCUPANCY: 5.0, TENSOR: 1.0}
    clock[0] = 2.0
    v2 = by_source(nv.sample())["gpu0"].values
    nv.close()
    assert (v["sm_active_pct"], v["tensor_active_pct"]) == (70.0, None)
    assert v2["tensor_active_pct"] == 1.0
    assert fake.live_gpm_buffers == 0 and fake.inits == fake.shutdowns == 1


def test_transient_error_is_na_once_then_retried():
    gpu = FakeGpu(errors={"nvmlDeviceGetTemperature": NVML_ERROR_TIMEOUT})
    with NvmlBackend(nvml=FakeNvml([gpu])) as nv:
        first = by_source(nv.sample())["gpu0"].values
        assert "will retry" in nv.status["gpu0.temp_c"]
        second = by_source(nv.sample())["gpu0"].values
        assert "gpu0.temp_c" not in nv.status
    assert first["temp_c"] is None and second["temp_c"] == 61.0


# -- a GPU lost mid-run; a driver/library mismatch mid-run -------------------------------------


def test_gpu_lost_mid_run_is_marked_and_left_alone():
    fake = two_gpus()
    with NvmlBackend(nvml=fake) as nv:
        assert by_source(nv.sample())["gpu1"].status == "ok"
        fake.gpus[1].lost = True
        lost = by_source(nv.sample())
        calls_after_loss = fake.calls.copy()
        later = by_source(nv.sample())
        assert "gpu1 lost" in nv.describe() and nv.status["gpu1"].startswith("lost")
    for got in (lost, later):
        assert got["gpu1"].status.startswith("lost") and got["gpu1"].values == {}
        assert got["gpu0"].status == "ok" and got["gpu0"].values["power_w"] == pytest.approx(612.5)
    gpu1_calls = {k: n for k, n in fake.calls.items() if k[1] == 1}
    assert gpu1_calls == {k: n for k, n in calls_after_loss.items() if k[1] == 1}  # no new calls
    assert fake.live_gpm_buffers == 0 and fake.inits == fake.shutdowns


def test_gpu_lost_before_open_shows_as_lost():
    fake = two_gpus()
    fake.gpus[0].errors["nvmlDeviceGetMemoryInfo"] = 15  # NVML_ERROR_GPU_IS_LOST, at open
    with NvmlBackend(nvml=fake) as nv:
        got = by_source(nv.sample())
    assert got["gpu0"].status.startswith("lost") and got["gpu1"].status == "ok"


def test_library_mismatch_mid_run_marks_devices_failed_without_raising():
    fake = two_gpus()
    with NvmlBackend(nvml=fake) as nv:
        nv.sample()
        fake.fail_all(NVML_ERROR_LIB_RM_VERSION_MISMATCH)
        got = by_source(nv.sample())
        n_calls = sum(fake.calls.values())
        again = by_source(nv.sample())
    for s in (*got.values(), *again.values()):
        assert s.status.startswith("failed") and "mismatch" in s.status and s.values == {}
    assert sum(fake.calls.values()) == n_calls  # a failed device is not asked again


def test_sample_before_open_is_an_error():
    with pytest.raises(RuntimeError, match="before open"):
        NvmlBackend(nvml=FakeNvml()).sample()


def test_open_close_balance_and_reopen():
    fake = FakeNvml()
    nv = NvmlBackend(nvml=fake)
    for _ in range(3):
        nv.open()
        nv.open()  # idempotent
        nv.sample()
        nv.close()
        nv.close()
    assert fake.inits == fake.shutdowns == 3 and fake.live_gpm_buffers == 0


@pytest.mark.parametrize("kw", [{"pcie_every": 0}, {"process_every": 1.5}])
def test_bad_rates_rejected(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        NvmlBackend(nvml=FakeNvml(), **kw)


# -- which GPUs: CUDA_VISIBLE_DEVICES by UUID ----------------------------------------------


def test_parse_visible_devices():
    uuids = ["GPU-aaaa-0", "GPU-bbbb-1", "GPU-cccc-2"]
    assert parse_visible_devices("2,0", uuids) == ([2, 0], [])
    assert parse_visible_devices("GPU-bbbb,cccc", uuids) == ([1, 2], [])
    idx, notes = parse_visible_devices("1,7,0", uuids)  # CUDA stops at the invalid entry
    assert idx == [1] and "no such GPU" in notes[0]
    idx, notes = parse_visible_devices("MIG-1234", uuids)
    assert idx == [] and "MIG" in notes[0]


def test_cuda_visible_devices_maps_job_ordinals_to_nvml_by_uuid(monkeypatch):
    fake = FakeNvml([FakeGpu(uuid=f"GPU-{c * 4}-{i}") for i, c in enumerate("abcd")])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-dddd,GPU-bbbb")
    with NvmlBackend(nvml=fake) as nv:
        sources = [s.source for s in nv.sample()]
        gpus = nv.info["gpus"]
    assert sources == ["gpu0", "gpu1"]
    assert [(g["label"], g["nvml_index"]) for g in gpus] == [("gpu0", 3), ("gpu1", 1)]
    assert fake.calls[("nvmlDeviceGetPowerUsage", 0)] == 0  # GPUs the job cannot see: unread
    with NvmlBackend(nvml=fake, devices=["GPU-cccc-2"]) as nv:  # explicit: the job's value
        assert nv.info["gpus"][0]["nvml_index"] == 2
    with pytest.raises(ValueError, match="no GPU"):
        NvmlBackend(nvml=fake, devices=["GPU-ffff"]).open()
    assert fake.inits == fake.shutdowns


def test_integer_devices_warn_when_models_differ(monkeypatch):
    fake = FakeNvml([FakeGpu(uuid="GPU-a"), FakeGpu(name="NVIDIA A10", uuid="GPU-b")])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with NvmlBackend(nvml=fake) as nv:
        assert "UUID" in nv.status["devices"]
        assert nv.info["gpus"][0]["name"] == "NVIDIA A10"


# -- recorder and replay ------------------------------------------------------------------


def record(path, n=3, **kw) -> None:
    gpu = FakeGpu()
    nv = NvmlBackend(nvml=FakeNvml([gpu]))
    with Recorder(path, nv, recorded_by="test", notes="test data, fake NVML", **kw) as rec:
        for t in range(n):
            gpu.power_mw = 500_000 + 1000 * t
            rec.write(nv.sample(now=100.0 + t))
    nv.close()


def test_recorder_writes_metadata_and_replay_plays_it_labelled(tmp_path):
    path = tmp_path / "trace.jsonl"
    record(path, period_s=1.0)
    header = json.loads(path.read_text().splitlines()[0])
    meta = header["metadata"]
    assert meta["hardware"] == "1× NVIDIA H200" and meta["driver"] == "570.86.15"
    assert meta["cuda"] == "12.8" and meta["date"] and meta["period_s"] == 1.0
    trace = load_trace(path)
    assert trace.duration_s == 2.0
    rp = ReplayBackend(path, realtime=False)
    with rp:
        ticks = [rp.sample() for _ in range(4)]
        assert "recording of 1× NVIDIA H200 on" in rp.describe() and "not live" in rp.describe()
        assert rp.finished
    assert ticks[-1] == []
    powers = [by_source(t)["gpu0"].values["power_w"] for t in ticks[:3]]
    assert powers == pytest.approx([500.0, 501.0, 502.0])
    for s in (s for t in ticks for s in t):
        assert s.kind == "replay" and s.label.startswith("recording of 1× NVIDIA H200 on 20")
    assert [by_source(t)["gpu0"].time_s for t in ticks[:3]] == [0.0, 1.0, 2.0]


def test_replay_in_real_time_follows_the_clock(tmp_path):
    path = tmp_path / "trace.jsonl"
    record(path, n=4)
    now = [50.0]
    with ReplayBackend(path, speed=2.0, clock=lambda: now[0]) as rp:
        assert [s.time_s for s in rp.sample() if s.source == "gpu0"] == [50.0]  # t=0 only
        now[0] = 51.0  # 1 s of wall time = 2 s of recording at speed 2
        assert [s.time_s for s in rp.sample() if s.source == "gpu0"] == [50.5, 51.0]
        now[0] = 60.0
        assert len([s for s in rp.sample() if s.source == "gpu0"]) == 1 and rp.finished


def test_recorder_refuses_anything_but_nvml(tmp_path):
    with pytest.raises(ValueError, match="NVML backend"):
        Recorder(tmp_path / "t.jsonl", CpuBackend())
    nv = NvmlBackend(nvml=FakeNvml())
    with Recorder(tmp_path / "t.jsonl", nv) as rec, pytest.raises(ValueError, match="only NVML"):
        rec.write([Sample(0.0, "host", {"host_cpu_pct": 5.0}, kind="cpu")])
    nv.close()


def _write(path, header, *rows):
    path.write_text("\n".join(json.dumps(x) for x in (header, *rows)) + "\n")


GOOD_META = {"hardware": "1× NVIDIA H200", "driver": "570.86.15", "date": "2026-01-31"}


@pytest.mark.parametrize(("meta", "words"), [
    ({"driver": "570.86.15", "date": "2026-01-31"}, "lacks hardware"),
    ({"hardware": "1× NVIDIA H200", "date": "2026-01-31"}, "lacks driver"),
    ({"hardware": "1× NVIDIA H200", "driver": "570.86.15", "date": ""}, "lacks date"),
    ({**GOOD_META, "date": "yesterday"}, "ISO 8601"),
    ({**GOOD_META, "synthetic": True}, "unknown metadata"),
])  # fmt: skip
def test_trace_without_provenance_is_rejected(tmp_path, meta, words):
    path = tmp_path / "t.jsonl"
    _write(path, {"format": "labkit-metrics-trace", "version": 1, "metadata": meta},
           {"t": 0, "source": "gpu0", "values": {"power_w": 100.0}})  # fmt: skip
    with pytest.raises(ReplayError, match=words):
        ReplayBackend(path).open()


@pytest.mark.parametrize(("row", "words"), [
    ({"t": 0, "source": "gpu0", "values": {"made_up_flops": 1.0}}, "unknown GPU metric"),
    ({"t": 0, "source": "gpu0", "values": {"host_cpu_pct": 1.0}}, "unknown GPU metric"),
    ({"t": 0, "source": "gpu0", "values": {"power_w": "lots"}}, "number or null"),
    ({"t": -1, "source": "gpu0", "values": {}}, "t=-1"),
    ({"source": "gpu0", "values": {}}, "needs 't'"),
])  # fmt: skip
def test_trace_rows_are_validated(tmp_path, row, words):
    path = tmp_path / "t.jsonl"
    _write(path, {"format": "labkit-metrics-trace", "version": 1, "metadata": GOOD_META}, row)
    with pytest.raises(ReplayError, match=words):
        load_trace(path)


def test_not_a_trace_is_rejected(tmp_path):
    path = tmp_path / "t.jsonl"
    _write(path, {"hello": 1})
    with pytest.raises(ReplayError, match="not a labkit-metrics-trace"):
        load_trace(path)
    with pytest.raises(ReplayError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")


def test_a_compressed_or_binary_trace_is_named_not_a_unicode_error(tmp_path):
    good = tmp_path / "trace.jsonl"
    record(good)
    packed = tmp_path / "trace.jsonl.gz"
    packed.write_bytes(gzip.compress(good.read_bytes()))
    with pytest.raises(ReplayError, match=(
            rf"^{re.escape(str(packed))}: gzip-compressed; a trace is plain UTF-8 JSON Lines: "
            rf"decompress it first \(gunzip {re.escape(str(packed))}\)")):  # fmt: skip
        load_trace(packed)
    binary = tmp_path / "trace.bin"
    binary.write_bytes(good.read_bytes()[:40] + b"\n\xff\xfe\x00 not text\n")
    with pytest.raises(ReplayError, match=(
            rf"^{re.escape(str(binary))}:2: not UTF-8 text \(byte 0xff at column 1\); a trace "
            "is UTF-8 JSON Lines written by labkit.metrics.Recorder")):  # fmt: skip
        load_trace(binary)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_a_trace_with_nan_or_infinity_is_refused_naming_the_line(tmp_path, constant):
    # Python's json module reads (and writes) these, but they are not JSON (RFC 8259, section 6)
    # and a recorded reading is a finite number or null (N/A).
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"format": "labkit-metrics-trace", "version": 1,
                                "metadata": GOOD_META}) + "\n"
                    + '{"t": 0, "source": "gpu0", "values": {"power_w": 100.0}}\n'
                    + f'{{"t": 1, "source": "gpu0", "values": {{"power_w": {constant}}}}}\n')  # fmt: skip
    with pytest.raises(ReplayError, match=(
            rf"^{re.escape(str(path))}:3: {constant} is not a JSON number: a trace holds "
            r"finite numbers, and null where a reading is N/A")):  # fmt: skip
        load_trace(path)


def test_a_trace_number_that_overflows_a_float_is_refused(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"format": "labkit-metrics-trace", "version": 1,
                                "metadata": GOOD_META}) + "\n"
                    + '{"t": 0, "source": "gpu0", "values": {"power_w": -1e999}}\n')  # fmt: skip
    with pytest.raises(ReplayError, match=rf"^{re.escape(str(path))}:2: -1e999 overflows a float"):
        load_trace(path)
