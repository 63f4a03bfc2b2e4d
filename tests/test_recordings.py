"""Recorded GPU figures: the builder, the loader's refusals, the displays and the README.

The shipped recording is rebuilt here from the H200 result files in ``benchmarks/results/``
and must equal the file in ``labkit/recordings/``: no shipped number was typed by hand. Every
other record below is SYNTHETIC (made up in this file to exercise the code, named so in its
GPU and conditions) and is never written anywhere but ``tmp_path``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from labkit import recordings as rec
from labkit.__main__ import main as labkit_main
from labkit.recordings import build, show

ROOT = Path(__file__).resolve().parents[1]
H200_RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*-nvidia-h200.json"))
SHIPPED = ROOT / "labkit" / "recordings" / "nvidia-h200-2026-12-04.json"


def synthetic_record(benchmark: str = "precision", *, gpu: str | None = "SYNTHETIC GPU",
                     date: str = "2030-01-02T03:04:05+00:00") -> dict:  # fmt: skip
    """A benchmark record in the shape bench_precision writes, with made-up samples."""
    samples = {"float32": [4.0, 1.0, 3.0, 2.0, 5.0], "bfloat16": [2.0, 1.0, 1.5, 2.5, 3.0]}
    return {
        "benchmark": benchmark, "date": date, "device": "cuda" if gpu else "cpu",
        "machine": {"gpu": gpu, "gpu_count": 1 if gpu else 0},
        "versions": {"torch": "9.9.9+synthetic", "cuda": "99.9"},
        "params": {"size": "lab", "rounds": 5, "warmup": 1, "order": "alternating",
                   "timer": "a synthetic timer", "tokens_per_step": 100,
                   "float32_matmul_precision": "highest"},
        "samples_s": samples, "median_s": {"float32": 3.0, "bfloat16": 2.0},
        "conditions": "SYNTHETIC: made up in tests/test_recordings.py",
    }  # fmt: skip


# --- the builder --------------------------------------------------------------------------------


def test_building_the_h200_results_gives_exactly_the_shipped_recording(tmp_path):
    assert len(H200_RESULTS) == 4, [p.name for p in H200_RESULTS]
    built = build.build_files(H200_RESULTS, tmp_path)
    assert built.skipped == () and len(built.recordings) == 1
    out = tmp_path / SHIPPED.name
    assert out.read_text(encoding="utf-8") == SHIPPED.read_text(encoding="utf-8"), (
        "labkit/recordings/ must hold what `python -m labkit recordings build "
        "benchmarks/results/*-nvidia-h200.json` writes")


def test_the_shipped_figures_are_the_benchmarks_own():
    """Medians computed from the samples equal what each benchmark printed from them."""
    r = rec.load(SHIPPED)
    assert r.label() == "recorded on 1× NVIDIA H200, 2026-12-04, torch 2.11.0+cu130, CUDA 13.0"
    records = {p.name.split("-")[0]: json.loads(p.read_text()) for p in H200_RESULTS}
    gpu = r.figure("gpu_throughput", "gpu", "bfloat16")
    result = records["gpu_throughput"]["results"]["gpu"]
    assert gpu.median == pytest.approx(result["median_step_s"], rel=1e-12)
    assert gpu.tokens_per_s == pytest.approx(result["tokens_per_s"], rel=1e-12)
    assert gpu.mfu == pytest.approx(result["mfu"], rel=1e-12)
    for dtype, stats in records["precision"]["stats_s"].items():
        f = r.figure("precision", "lab", dtype)
        assert (f.n, f.median, f.q1, f.q3, f.min, f.max) == pytest.approx(
            (stats["n"], stats["median"], stats["q1"], stats["q3"], stats["min"], stats["max"]))
    ratio = show.step_ratio(r.figure("precision", "lab", "bfloat16"),
                            r.figure("precision", "lab", "float32"))
    assert ratio == pytest.approx(records["precision"]["ratio"], rel=1e-12)
    assert "read the ratios" in r.conditions  # the run's caveat travels with its numbers


def test_builder_on_synthetic_records_groups_by_gpu_and_day(tmp_path):
    a = synthetic_record()
    b = synthetic_record(gpu="SYNTHETIC GPU 2")
    skipped = synthetic_record("launch")
    built = build.build([("a.json", a), ("b.json", b), ("launch.json", skipped)])
    assert [r.hardware for r in built.recordings] == ["1× SYNTHETIC GPU", "1× SYNTHETIC GPU 2"]
    assert built.skipped[0][0] == "launch.json" and "'launch'" in built.skipped[0][1]
    f = built.recordings[0].figure("precision", "lab", "float32")
    assert (f.n, f.median, f.q1, f.q3, f.min, f.max) == (5, 3.0, 2.0, 4.0, 1.0, 5.0)
    assert f.tokens_per_s == pytest.approx(100 / 3.0) and f.mfu is None
    assert build.file_name(built.recordings[0]) == "synthetic-gpu-2030-01-02.json"


@pytest.mark.parametrize(("change", "message"), [
    (lambda r: r.update(device="cpu", machine={"gpu": None}), "CPU run"),
    (lambda r: r["median_s"].update(float32=3.5), "not the median of its samples"),
    (lambda r: r.pop("samples_s"), "not a benchmark result"),
    (lambda r: r["params"].pop("timer"), "params lack"),
])  # fmt: skip
def test_builder_refuses_records_it_cannot_trust(change, message):
    record = synthetic_record()
    change(record)
    with pytest.raises(rec.RecordingError, match=message) as e:
        build.build([("synthetic.json", record)])
    assert "synthetic.json" in str(e.value)


def test_command_builds_and_shows(tmp_path, capsys):
    src = tmp_path / "precision-lab-synthetic.json"
    src.write_text(json.dumps(synthetic_record()))
    assert labkit_main(["recordings", "build", str(src), "--out", str(tmp_path / "out")]) == 0
    written = tmp_path / "out" / "synthetic-gpu-2030-01-02.json"
    assert "wrote" in capsys.readouterr().out and written.exists()
    assert labkit_main(["recordings", "show", str(written)]) == 0
    assert "recorded on 1× SYNTHETIC GPU, 2030-01-02, torch 9.9.9+synthetic" in capsys.readouterr().out
    assert labkit_main(["recordings", "show", str(src)]) == 1  # a benchmark result is not one
    assert "not a labkit-gpu-recording file" in capsys.readouterr().out


# --- the loader ---------------------------------------------------------------------------------


def synthetic_recording_json() -> dict:
    return build.build([("s.json", synthetic_record())]).recordings[0].to_json()


def write(tmp_path: Path, obj) -> Path:
    path = tmp_path / "r.json"
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj), encoding="utf-8")
    return path


def test_a_recording_round_trips(tmp_path):
    obj = synthetic_recording_json()
    loaded = rec.load(write(tmp_path, obj))
    assert loaded.to_json() == obj and loaded.path == tmp_path / "r.json"


@pytest.mark.parametrize("key", rec.REQUIRED)
def test_loader_refuses_a_recording_without_hardware_date_or_torch(tmp_path, key):
    obj = synthetic_recording_json()
    obj.pop(key)
    path = write(tmp_path, obj)
    with pytest.raises(rec.RecordingError, match=f"{path}: lacks {key}"):
        rec.load(path)


@pytest.mark.parametrize(("change", "message"), [
    (lambda o: o["figures"][0].update(median=0.5), "but its samples give"),
    (lambda o: o["figures"][0]["samples"].append(-1.0), r"samples\[5\]"),
    (lambda o: o.update(date="last tuesday"), "not an ISO 8601 date"),
    (lambda o: o.update(version=2), "version 2"),
    (lambda o: o.update(figures=[]), "non-empty list"),
    (lambda o: o.update(surprise=1), "unknown keys"),
])  # fmt: skip
def test_loader_refuses_edited_or_malformed_recordings(tmp_path, change, message):
    obj = synthetic_recording_json()
    change(obj)
    with pytest.raises(rec.RecordingError, match=message):
        rec.load(write(tmp_path, obj))


@pytest.mark.parametrize("content", ["{not json", json.dumps({"benchmark": "precision"}), "[]"])
def test_loader_refuses_a_file_that_is_not_a_recording(tmp_path, content):
    path = write(tmp_path, content)
    with pytest.raises(rec.RecordingError, match=str(path)):
        rec.load(path)


def test_shipped_recordings_load_and_ship_with_the_package():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    from fnmatch import fnmatch

    assert rec.shipped() == [SHIPPED]
    assert [r.hardware for r in rec.load_shipped()] == ["1× NVIDIA H200"]
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["labkit"]
    assert any(fnmatch(f"recordings/{SHIPPED.name}", p) for p in patterns)


# --- the displays -------------------------------------------------------------------------------


def here_figures() -> dict[str, rec.Figure]:
    """SYNTHETIC step times of "this machine", for the display only."""
    return {dtype: show.measured_here([s * k for s in (0.010, 0.011, 0.012, 0.011, 0.010)],
                                      preset="smoke", dtype=dtype, device="cpu",
                                      tokens_per_step=512)
            for dtype, k in (("float32", 1.0), ("bfloat16", 2.0))}  # fmt: skip


def test_precision_display_labels_both_sides_and_gives_each_ratio():
    r = rec.load(SHIPPED)
    text = show.precision_beside([r], here_figures())
    assert r.label() in text and show.NOT_HERE in text and r.conditions in text
    recorded = show.step_ratio(r.figure("precision", "lab", "bfloat16"),
                               r.figure("precision", "lab", "float32"))
    row = next(line for line in text.splitlines() if line.lstrip().startswith("bfloat16/fp32"))
    assert row.split()[-2:] == ["2.00", f"{recorded:.2f}"]  # here, then recorded
    assert "here: float32 is faster per step" in text
    assert "measured on this machine's cpu, now (preset 'smoke')" in text


def test_throughput_display_shows_the_gpu_preset_beside_this_machine():
    r = rec.load(SHIPPED)
    text = show.throughput_beside([r], here_figures()["float32"])
    lines = text.splitlines()
    assert lines[0].startswith("measured on this machine's cpu, now: preset 'smoke', float32")
    gpu = r.figure("gpu_throughput", "gpu", "bfloat16")
    assert f"{r.label()} (gpu_throughput): {gpu.describe()}" in lines
    assert "549,859 tokens/s at the median step; MFU 9.9%" in text
    assert "26% apart" in text  # the same step timed by two benchmarks that day


def test_displays_without_a_recording_say_so_and_how_to_make_one():
    here = here_figures()
    for text in (show.precision_beside([], here), show.throughput_beside([], here["float32"]),
                 show.no_trace_note([])):
        assert show.NONE_SHIPS in text
    assert show.HOW_TO_RECORD in show.precision_beside([], here)
    note = show.no_trace_note([rec.load(SHIPPED)])
    assert "recorded on 1× NVIDIA H200" in note and "python -m labkit record-trace" in note


# --- the README ---------------------------------------------------------------------------------


def test_readme_quotes_the_shipped_recording_verbatim():
    """The README's GPU figures are the recording's table, not numbers typed beside it."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = show.markdown_table(rec.load(SHIPPED))
    assert table in readme, (
        "README.md's table of recorded GPU figures differs from the shipped recording: paste "
        "`labkit.recordings.show.markdown_table(labkit.recordings.load_shipped()[0])` there")
    assert "no GPU machine has been available" not in readme

