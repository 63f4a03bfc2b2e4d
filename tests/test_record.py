"""Recording a run (``Monitor(record_to=...)``, ``labkit record-trace``) and replaying it.

The GPU readings here come from the NVML test double (tests/fake_nvml.py): they are test data,
never shown to a learner and never checked in as a recording.
"""

from __future__ import annotations

import json
import os

import pynvml
import pytest
from fake_nvml import FakeGpu, FakeNvml

from labkit.course import record
from labkit.metrics import (
    BackendUnavailable,
    CpuBackend,
    NvmlBackend,
    Recorder,
    ReplayBackend,
    ReplayError,
    load_trace,
)
from labkit.metrics import replay as replay_mod
from labkit.monitor import Monitor

META = {"hardware": "1× NVIDIA H200", "driver": "570.86.15", "date": "2026-01-31"}


def fake_backend(gpu: FakeGpu | None = None) -> NvmlBackend:
    return NvmlBackend(lambda: {0: os.getpid()}, nvml=FakeNvml([gpu or FakeGpu()]))


def write_lines(path, *rows, meta=META):
    header = {"format": "labkit-metrics-trace", "version": 1, "metadata": meta}
    path.write_text("\n".join(json.dumps(r) for r in (header, *rows)) + "\n")
    return path


# --- the format: step events ---------------------------------------------------------------


def test_recorder_writes_step_events_on_the_samples_clock(tmp_path):
    path = tmp_path / "t.jsonl"
    nv = fake_backend()
    with Recorder(path, nv, t0=100.0) as rec:
        rec.step(1, 99.5)  # stamped before t0 (a heartbeat read late): written at t = 0
        rec.write(nv.sample(now=100.25))
        rec.step(2, 100.75, rank=1)
    nv.close()
    trace = load_trace(path)
    assert [(e.rank, e.step, e.time_s) for e in trace.steps] == [(0, 1, 0.0), (1, 2, 0.75)]
    assert {s.time_s for s in trace.samples} == {0.25}
    assert (rec.written, rec.steps_written) == (len(trace.samples), 2)


def test_a_closed_recorder_never_reopens_and_overwrites(tmp_path):
    path = tmp_path / "t.jsonl"
    nv = fake_backend()
    with Recorder(path, nv) as rec:
        rec.write(nv.sample(now=1.0))
    before = path.read_text()
    with pytest.raises(RuntimeError, match="closed"):
        rec.step(1, 2.0)
    with pytest.raises(RuntimeError, match="closed"):
        rec.write(nv.sample(now=2.0))
    nv.close()
    assert path.read_text() == before


def test_steps_and_samples_may_interleave_but_each_keeps_its_order(tmp_path):
    sample = {"t": 1.0, "source": "gpu0", "values": {"power_w": 500.0}}
    ok = write_lines(tmp_path / "ok.jsonl", sample, {"t": 0.99, "rank": 0, "step": 3})
    assert [e.step for e in load_trace(ok).steps] == [3]
    back = write_lines(tmp_path / "back.jsonl", {"t": 2.0, "rank": 0, "step": 1},
                       {"t": 1.0, "rank": 0, "step": 2})  # fmt: skip
    with pytest.raises(ReplayError, match=r"back\.jsonl:3: rank 0's step at t=1.0 goes back"):
        load_trace(back)
    other_rank = write_lines(tmp_path / "ranks.jsonl", {"t": 2.0, "rank": 0, "step": 1},
                             {"t": 1.0, "rank": 1, "step": 1})  # fmt: skip
    assert len(load_trace(other_rank).steps) == 2


@pytest.mark.parametrize(("row", "words"), [
    ({"t": 1.0, "rank": 0, "step": -1}, "step=-1"),
    ({"t": 1.0, "rank": "0", "step": 1}, "rank='0'"),
    ({"t": -1.0, "rank": 0, "step": 1}, "t=-1.0"),
    ({"t": 1.0, "rank": 0, "step": 1, "loss": 2.0}, "exactly 't', 'rank' and 'step'"),
])  # fmt: skip
def test_bad_step_lines_are_named(tmp_path, row, words):
    path = write_lines(tmp_path / "bad.jsonl", row)
    with pytest.raises(ReplayError, match=r"bad\.jsonl:2") as err:
        load_trace(path)
    assert words in str(err.value)


def test_shipped_traces_are_the_jsonl_files_in_the_traces_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(replay_mod, "SHIPPED_DIR", tmp_path)
    assert replay_mod.shipped_traces() == []
    for name in ("b.jsonl", "a.jsonl", "notes.md"):
        (tmp_path / name).write_text("")
    assert [p.name for p in replay_mod.shipped_traces()] == ["a.jsonl", "b.jsonl"]


NONE_SHIPPED = pytest.param(None, marks=pytest.mark.skip(
    reason="no recording ships yet: record one on a GPU with `python -m labkit record-trace`"))  # fmt: skip


@pytest.mark.parametrize("path", replay_mod.shipped_traces() or [NONE_SHIPPED])
def test_every_shipped_trace_is_a_valid_small_recording(path):
    """What ships in labkit/metrics/traces/ must load, say what ran, and stay small."""
    trace = load_trace(path)
    assert trace.samples and trace.steps, "a recording of a run has samples and step events"
    assert "notebook 01" in trace.metadata.get("notes", "")
    assert trace.metadata.get("torch") and trace.metadata.get("gpus")
    assert path.stat().st_size < 256 * 1024, "keep recordings small: raise period_s"


# --- Monitor(record_to=...) ------------------------------------------------------------------


def test_monitor_records_what_it_shows_and_the_replay_shows_it_again(tmp_path):
    path = tmp_path / "run.jsonl"
    now = [10.0]
    gpu = FakeGpu()
    with Monitor(backend=fake_backend(gpu), live=False, record_to=path, record_notes="test",
                 clock=lambda: now[0]) as mon:  # fmt: skip
        for step in range(1, 4):
            now[0] += 1.0
            gpu.power_mw = 500_000 + step * 1000
            mon.on_step(step)
    trace = load_trace(path)
    assert trace.metadata["notes"] == "test" and trace.metadata["period_s"] == 1.0
    assert [(e.step, e.time_s) for e in trace.steps] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert trace.samples and all(s.source.startswith("gpu0") for s in trace.samples)
    assert len(trace.samples) == len(mon.samples)

    with Monitor(backend=ReplayBackend(path, realtime=False), live=False) as replayed:
        pass
    assert [(e.rank, e.step) for e in replayed.steps] == [(0, 1), (0, 2), (0, 3)]
    assert replayed.summary().last_step == {0: 3}
    assert "recording of 1× NVIDIA H200" in replayed.figure()._suptitle.get_text()


def test_a_realtime_replay_shows_only_the_steps_played_so_far(tmp_path):
    path = write_lines(
        tmp_path / "t.jsonl",
        *({"t": float(t), "source": "gpu0", "values": {"power_w": 500.0}} for t in range(4)),
        {"t": 0.5, "rank": 0, "step": 1}, {"t": 2.5, "rank": 0, "step": 2},
    )  # fmt: skip
    now = [100.0]
    rp = ReplayBackend(path, clock=lambda: now[0])
    with rp:
        rp.sample()
        assert rp.steps() == []
        now[0] = 101.0
        rp.sample()
        assert [(e.step, e.time_s) for e in rp.steps()] == [(1, 100.5)]
        now[0] = 110.0
        rp.sample()
        assert [e.step for e in rp.steps()] == [1, 2]


def test_a_failing_recording_warns_and_ends_but_the_run_goes_on(tmp_path, monkeypatch):
    path = tmp_path / "run.jsonl"
    with Monitor(backend=fake_backend(), live=False, record_to=path) as mon:
        mon.on_step(1)

        def disk_full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(mon.recorder, "step", disk_full)
        with pytest.warns(UserWarning, match="recording to .*run.jsonl stopped.*No space"):
            mon.on_step(2)
        assert mon.recorder is None
        mon.on_step(3)  # no recorder, no warning: the run just goes on
    assert [e.step for e in mon.steps] == [1, 2, 3] and mon.status == "ok"
    assert [e.step for e in load_trace(path).steps] == [1]


def test_record_to_refuses_a_backend_that_is_not_nvml(tmp_path):
    mon = Monitor(backend=CpuBackend(), live=False, record_to=tmp_path / "x.jsonl")
    with pytest.raises(ValueError, match=r"record_to=.*real GPU readings.*'cpu'"), mon:
        pass
    assert not (tmp_path / "x.jsonl").exists()
    assert mon.sampler.state != "running"


def test_record_to_without_a_driver_fails_before_anything_runs(tmp_path):
    nv = NvmlBackend(nvml=FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    monitor = Monitor(backend=nv, live=False, record_to=tmp_path / "x.jsonl")
    with pytest.raises(BackendUnavailable, match="library not found"), monitor:
        raise AssertionError("the block must not run")


# --- python -m labkit record-trace ---------------------------------------------------------------


def test_record_training_run_records_notebook_01s_run(tmp_path):
    out = record.record_training_run(tmp_path / "nb01.jsonl", size="smoke", steps=6,
                                     period_s=0.1, backend=fake_backend())  # fmt: skip
    trace = load_trace(out)
    assert [e.step for e in trace.steps] == [1, 2, 3, 4, 5, 6]
    assert trace.metadata["hardware"] == "1× NVIDIA H200"
    assert "notebook 01" in trace.metadata["notes"] and "6 steps" in trace.metadata["notes"]
    assert trace.samples[0].values["power_w"] == pytest.approx(612.5)
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_record_trace_command_says_why_it_cannot_record(tmp_path, monkeypatch, capsys):
    def no_driver(*args, **kw):
        return NvmlBackend(nvml=FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))

    monkeypatch.setattr(record, "NvmlBackend", no_driver)
    assert record.main(["--out", str(tmp_path / "x.jsonl"), "--size", "smoke"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().out
    assert not (tmp_path / "x.jsonl").exists()


def test_record_trace_fails_when_no_gpu_reading_was_recorded(tmp_path, monkeypatch, capsys):
    """A driver that stops answering utilisation: the trace holds no GPU reading, so the
    command must fail rather than hand over an empty recording as a success."""
    gpu = FakeGpu(unsupported={"nvmlDeviceGetUtilizationRates"})
    monkeypatch.setattr(record, "NvmlBackend", lambda *a, **k: fake_backend(gpu))
    code = record.main(["--out", str(tmp_path / "x.jsonl"), "--size", "smoke", "--steps", "2",
                        "--period-s", "0.1"])  # fmt: skip
    assert code == 1
    assert "no GPU utilisation was read" in capsys.readouterr().out
