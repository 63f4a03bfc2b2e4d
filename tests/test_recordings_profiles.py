"""Profile recordings (``labkit.recordings.profiles``): the format, the refusals, the summary
notebook 06 prints, and the recorder's whole path on the CPU (which must be refused as a GPU
recording). The GPU traces here are SYNTHETIC (``tests/gpu_traces.py``): the recording itself
is made on a GPU by ``python -m labkit record-profile``."""

from __future__ import annotations

import json

import pytest
from gpu_traces import build

from labkit.__main__ import main as labkit_main
from labkit.recordings.profiles import (
    FORMAT,
    HEADER,
    TRACES,
    VERSION,
    ProfileRecordingError,
    load_profile,
    record_profile,
    shipped_profiles,
    summarize,
)

GOOD = {"format": FORMAT, "version": VERSION, "hardware": "1× NVIDIA H100 80GB HBM3",
        "date": "2026-12-06", "torch": "2.11.0+cu130", "cuda": "13.0",
        "what": "SYNTHETIC trace for a test", "conditions": "none: built by tests/gpu_traces.py"}  # fmt: skip


def _recording(folder, header=GOOD, ranks=(0,)):
    (folder / TRACES).mkdir(parents=True, exist_ok=True)
    for r in ranks:
        build(rank=r, world_size=len(ranks), copy_us=30.0).write(folder / TRACES / f"rank{r}.json.gz",
                                                                gz=True)
    if header is not None:
        (folder / HEADER).write_text(json.dumps(header))
    return folder


def test_a_recording_loads_labelled_and_summarised(tmp_path):
    rec = load_profile(_recording(tmp_path / "h100", ranks=(0, 1)))
    assert rec.label() == "recorded on 1× NVIDIA H100 80GB HBM3, 2026-12-06, torch 2.11.0+cu130, CUDA 13.0"
    assert [t.rank for t in rec.traces] == [0, 1]
    text = summarize(rec, phases=("forward",))
    assert text.startswith(rec.label() + " (measured on that GPU, not on this machine)")
    assert text.count("GPU busy span") == 2 and "of which hidden" in text  # NCCL: overlap shown
    assert "10 kernels, copies and memsets a step" in text  # 8 compute, 1 NCCL, 1 copy
    assert "phases on the training thread (CPU time, median ms a step): forward 0.50" in text
    assert "GPU 'NVIDIA H100 80GB HBM3' (rank0.json.gz): peak bfloat16 on H100 SXM: 989" in text
    assert shipped_profiles(tmp_path) == [tmp_path / "h100"]


def test_a_gpu_the_hardware_table_does_not_know_gets_no_figure_of_its_own(tmp_path):
    folder = _recording(tmp_path / "odd")
    built = build(copy_us=30.0)
    built.meta["deviceProperties"][0]["name"] = "NVIDIA B777 Prototype"
    built.write(folder / TRACES / "rank0.json.gz", gz=True)
    text = summarize(load_profile(folder))
    assert ("GPU 'NVIDIA B777 Prototype' (rank0.json.gz) is not one labkit's hardware table can "
            "place (no peak known for 'NVIDIA B777 Prototype': MFU is not computed)") in text
    assert "TFLOP/s" not in text and "MFU " not in text.replace("MFU is not computed", "")
    assert shipped_profiles(tmp_path / "nowhere") == []


@pytest.mark.parametrize("change, message", [
    ({"hardware": ""}, "missing hardware"),
    ({"torch": None}, "missing torch"),
    ({"format": "labkit-gpu-recording"}, "not a profile recording"),
    ({"version": 9}, "version 9"),
    ({"date": "yesterday"}, "not ISO 8601"),
    ({"tflops": 900}, "unknown field"),
])  # fmt: skip
def test_a_header_that_does_not_say_what_recorded_it_is_refused(tmp_path, change, message):
    folder = _recording(tmp_path / "r", {**GOOD, **change})
    with pytest.raises(ProfileRecordingError, match=message):
        load_profile(folder)


def test_traces_without_a_header_or_without_gpu_work_are_refused(tmp_path):
    with pytest.raises(ProfileRecordingError, match=r"no recording\.json"):
        load_profile(_recording(tmp_path / "bare", header=None))
    folder = _recording(tmp_path / "cpu")
    built = build()
    built.events[:] = [e for e in built.events if e["cat"] not in ("kernel", "gpu_memcpy")]
    built.write(folder / TRACES / "rank0.json.gz", gz=True)
    with pytest.raises(ProfileRecordingError, match="no GPU kernels"):
        load_profile(folder)
    (folder / TRACES / "rank0.json.gz").write_bytes(b"{\"traceEvents\": [")
    with pytest.raises(ProfileRecordingError, match="truncated"):
        load_profile(folder)


def test_the_recorder_runs_its_whole_path_on_the_cpu_and_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("KINETO_LOG_LEVEL", "6")
    with pytest.raises(ProfileRecordingError, match="no GPU kernels: not a recording of a GPU"):
        record_profile(tmp_path / "dry", size="smoke", wait=0, warmup=1, active=1, device="cpu")
    header = json.loads((tmp_path / "dry" / HEADER).read_text())
    assert header["hardware"] == "1× CPU (a dry run)" and "preset smoke" in header["what"]
    assert (tmp_path / "dry" / TRACES / "rank0.json.gz").stat().st_size > 0


def test_the_command_refuses_to_record_without_a_gpu(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert labkit_main(["record-profile", "--out", str(tmp_path / "x")]) == 1
    assert "needs an NVIDIA GPU" in capsys.readouterr().out


def test_the_command_dry_runs_on_the_cpu_and_succeeds_on_the_refusal(tmp_path, capsys, monkeypatch):
    """``--device cpu`` (gpu_check.sh --dry-run): the whole path at smoke size, ending in the
    loader's refusal, which is the dry run's success; a CPU trace never passes as a recording."""
    monkeypatch.setenv("KINETO_LOG_LEVEL", "6")
    out = tmp_path / "dry"
    assert labkit_main(["record-profile", "--device", "cpu", "--active", "1",
                        "--out", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "dry run on the CPU, size smoke" in printed
    assert "refused it as expected" in printed and "no GPU kernels" in printed
    assert json.loads((out / HEADER).read_text())["hardware"] == "1× CPU (a dry run)"
    with pytest.raises(ProfileRecordingError, match="no GPU kernels"):
        load_profile(out)
    # a refusal for any other reason is a failure of the dry run, not its success
    def truncated(folder):
        raise ProfileRecordingError(f"{folder}: truncated")

    monkeypatch.setattr("labkit.recordings.profiles.load_profile", truncated)
    assert labkit_main(["record-profile", "--device", "cpu", "--active", "1",
                        "--out", str(tmp_path / "other")]) == 1  # fmt: skip
    assert "truncated" in capsys.readouterr().out
