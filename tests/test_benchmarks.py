"""The benchmarks' helpers: alternation, medians, the JSON record, and "same work".

No timing is asserted here (speed is what the benchmarks report, never what a test checks):
these tests pin down how samples are collected and recorded, and that the plain loop the
train-step benchmark compares against does exactly the work ``train_step`` does.
"""

from __future__ import annotations

import copy
import json
import socket
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a folder of the checkout, not of labkit
    sys.path.insert(0, str(ROOT))

from benchmarks import _common, bench_gpu_throughput, bench_launch, bench_train_step  # noqa: E402
from labkit import config, data, train  # noqa: E402
from labkit.jobs import runtime  # noqa: E402
from labkit.model import GPT  # noqa: E402


def fake_fns(log: list[str], values: dict[str, list[float]]):
    """Functions that log their calls and return the next of their preset samples."""

    def make(name: str):
        it = iter(values[name])

        def fn() -> float:
            log.append(name)
            return next(it)

        return fn

    return {name: make(name) for name in values}


# --- alternation --------------------------------------------------------------------------------


def test_alternate_interleaves_and_swaps_the_first_mover():
    log: list[str] = []
    samples = _common.alternate(
        fake_fns(log, {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}), rounds=4, warmup=0
    )
    assert log == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert samples == {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}


def test_alternate_without_swap_keeps_the_order():
    log: list[str] = []
    _common.alternate(fake_fns(log, {"a": [1, 2], "b": [3, 4]}), rounds=2, swap=False)
    assert log == ["a", "b", "a", "b"]


def test_alternate_drops_warmup_rounds_and_reports_every_round():
    log: list[str] = []
    seen: list[tuple[int, dict[str, float]]] = []
    samples = _common.alternate(
        fake_fns(log, {"a": [100, 1, 2], "b": [200, 3, 4]}),
        rounds=2,
        warmup=1,
        on_round=lambda r, got: seen.append((r, got)),
    )
    assert samples == {"a": [1.0, 2.0], "b": [3.0, 4.0]}  # the 100/200 warm-up is gone
    assert [r for r, _ in seen] == [-1, 0, 1]
    assert seen[0][1] == {"b": 200.0, "a": 100.0} or seen[0][1] == {"a": 100.0, "b": 200.0}
    assert len(log) == 6


@pytest.mark.parametrize("kwargs", [{"rounds": 0}, {"rounds": 2, "warmup": -1}, {"rounds": True}])
def test_alternate_rejects_bad_counts(kwargs):
    with pytest.raises(ValueError, match=r"rounds|warmup"):
        _common.alternate({"a": lambda: 1.0}, **kwargs)


def test_alternate_needs_functions():
    with pytest.raises(ValueError, match="empty"):
        _common.alternate({}, rounds=1)


# --- statistics ---------------------------------------------------------------------------------


def test_ratio_of_medians_ignores_outliers():
    samples = {"a": [1.0, 1.1, 50.0], "b": [1.0, 1.0, 0.9]}  # one stray slow sample in a
    assert _common.ratio_of_medians(samples, "a", "b") == pytest.approx(1.1)
    assert _common.ratio_of_medians(samples, "b", "a") == pytest.approx(1 / 1.1)


def test_paired_ratio_cancels_load_shared_by_a_round():
    # round 2 ran under load: both sides 10x slower; per round, a is always 1.1x b
    samples = {"a": [1.1, 11.0, 1.1], "b": [1.0, 10.0, 1.0]}
    assert _common.paired_ratio(samples, "a", "b") == pytest.approx(1.1)
    with pytest.raises(ValueError):
        _common.paired_ratio({"a": [1.0, 2.0], "b": [1.0]}, "a", "b")


def test_ratio_of_medians_refuses_a_zero_denominator():
    with pytest.raises(ValueError, match="'b'"):
        _common.ratio_of_medians({"a": [1.0], "b": [0.0]}, "a", "b")


def test_summary_quartiles():
    s = _common.summary([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s["min"], s["q1"], s["median"], s["q3"], s["max"], s["n"]) == (1, 2, 3, 4, 5, 5)
    assert _common.summary([2.0])["q1"] == 2.0
    with pytest.raises(ValueError):
        _common.summary([])


def test_comparison_judges_the_target():
    samples = {"labkit": [1.03, 1.03, 1.03], "plain": [1.0, 1.0, 1.0]}
    over = _common.comparison(samples, "labkit", "plain", 1.02, what="x")
    assert over["ratio"] == pytest.approx(1.03) and over["within_target"] is False
    under = _common.comparison(samples, "labkit", "plain", 1.05, what="x")
    assert under["within_target"] is True
    assert under["median_s"] == {"labkit": pytest.approx(1.03), "plain": pytest.approx(1.0)}


# --- the record ---------------------------------------------------------------------------------


def make_comparison_record() -> dict:
    samples = {"labkit": [1.0, 2.0], "plain": [1.0, 2.0]}
    return _common.make_record(
        "demo",
        device="cpu",
        params={"rounds": 2},
        samples_s=samples,
        **_common.comparison(samples, "labkit", "plain", 1.02, what="x"),
    )


def test_record_has_the_schema_and_no_hostname(tmp_path):
    record = make_comparison_record()
    _common.check_record(record)
    assert set(_common.RECORD_KEYS) <= set(record)
    assert record["date"].endswith("+00:00")  # UTC
    assert record["versions"]["torch"] == torch.__version__
    assert record["versions"]["python"]
    assert record["machine"]["cores"] and record["machine"]["cpu"]
    assert "hostname" not in record["machine"]
    assert socket.gethostname() not in record["machine"].values()
    path = _common.emit(record, name="demo", out=tmp_path / "r.json", record_it=False)
    assert json.loads(path.read_text()) == record


@pytest.mark.parametrize("drop", ["date", "samples_s", "machine", "target", "what"])
def test_check_record_names_what_is_missing(drop):
    record = make_comparison_record()
    record.pop(drop)
    with pytest.raises(ValueError, match=drop):
        _common.check_record(record)


def test_check_record_rejects_empty_or_non_float_samples():
    record = make_comparison_record()
    record["samples_s"] = {"labkit": []}
    with pytest.raises(ValueError, match="samples_s"):
        _common.check_record(record)


def test_emit_prints_when_neither_out_nor_record(capsys):
    assert _common.emit(make_comparison_record(), name="demo", out=None, record_it=False) is None
    assert json.loads(capsys.readouterr().out)["benchmark"] == "demo"


def test_record_path_is_named_by_benchmark_and_machine(tmp_path):
    cpu = {"machine": {"gpu": None}}
    gpu = {"machine": {"gpu": "NVIDIA H100 80GB HBM3"}}
    assert _common.record_path("launch", cpu, tmp_path) == tmp_path / "launch-cpu.json"
    assert _common.record_path("launch", gpu, tmp_path).name == "launch-nvidia-h100-80gb-hbm3.json"
    assert _common.RESULTS_DIR == ROOT / "benchmarks" / "results"


# --- same work ----------------------------------------------------------------------------------


def test_plain_loop_does_the_same_work_as_train_step():
    """Same model, batches and optimiser groups: identical loss and identical weights after."""
    cfg = config.preset("smoke").replace(grad_accum=2)
    torch.manual_seed(0)
    model_a = GPT(cfg.model)
    model_b = copy.deepcopy(model_a)
    opt_a = train.make_optimizer(model_a, cfg.train)
    opt_b = bench_train_step.plain_adamw(model_b, cfg.train.lr, cfg.train.weight_decay)
    gen = torch.Generator().manual_seed(0)
    tokens = data.load_splits().train
    batches = [data.get_batch(tokens, 4, cfg.model.seq_len, gen) for _ in range(2)]
    cpu = torch.device("cpu")
    for _ in range(2):
        stats = train.train_step(model_a, opt_a, batches, device=cpu, grad_clip=0.5)
        loss = bench_train_step.plain_step(
            model_b, opt_b, batches, device=cpu, dtype=torch.float32, scaler=None, grad_clip=0.5
        )
        assert loss == pytest.approx(stats.loss, rel=1e-6)
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    assert all(p.grad is None for p in model_b.parameters())  # zero_grad(set_to_none=True)


def test_train_step_benchmark_writes_a_comparison_record(tmp_path, capsys):
    out = tmp_path / "ts.json"
    assert (
        bench_train_step.main(
            [
                "--size",
                "smoke",
                "--rounds",
                "2",
                "--warmup",
                "0",
                "--device",
                "cpu",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    record = json.loads(out.read_text())
    _common.check_record(record)
    assert record["benchmark"] == "train_step"
    assert [len(v) for v in record["samples_s"].values()] == [2, 2]
    assert record["params"]["size"] == "smoke" and record["params"]["dtype"] == "float32"
    assert record["loss_max_abs_diff"] == 0.0  # both paths trained identical copies
    assert "ratio labkit/plain" in capsys.readouterr().out


def test_bare_launch_gets_the_job_spec_the_launcher_would_write(tmp_path):
    job = tmp_path / "bare-001"
    bench_launch.write_spec(job)
    spec = runtime.read_json(job / runtime.SPEC_FILE)
    assert spec["backend"] == "gloo" and spec["nproc"] == bench_launch.NPROC
    assert spec["config"] == bench_launch.WORKER_CONFIG.to_dict()
    env = bench_launch.bare_env(job)
    assert env[runtime.JOB_DIR_ENV] == str(job)
    assert "RANK" not in env
    cmd = bench_launch.bare_command()
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in cmd and cmd[-2:] == ["-m", bench_launch.MODULE]


def test_bare_launch_result_check_rejects_a_wrong_sum(tmp_path):
    bench_launch._check_ranks([{"value": 3.0, "expected": 3.0}], "x", tmp_path)
    with pytest.raises(RuntimeError, match="rank 1"):
        bench_launch._check_ranks([{"value": 3.0, "expected": 3.0}, {}], "x", tmp_path)


# --- throughput -----------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_throughput_without_gpu_measures_nothing(tmp_path, capsys):
    out = tmp_path / "tp.json"
    assert bench_gpu_throughput.main(["--out", str(out)]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU dry run")
def test_throughput_cpu_dry_run_is_labelled_and_has_no_mfu(tmp_path):
    out = tmp_path / "tp.json"
    assert (
        bench_gpu_throughput.main(
            ["--allow-cpu", "--warmup", "0", "--steps", "2", "--out", str(out)]
        )
        == 0
    )
    record = json.loads(out.read_text())
    _common.check_record(record)
    result = record["results"]["smoke"]
    assert record["device"] == "cpu" and "CPU" in record["label"]
    assert result["mfu"] is None and "no published peak" in result["mfu_note"]
    assert result["tokens_per_s"] > 0
    assert result["tokens_per_step"] == 8 * 64  # smoke: micro_batch 8 x seq_len 64


def test_throughput_rejects_an_unknown_size():
    with pytest.raises(SystemExit, match="huge"):
        bench_gpu_throughput.main(["--sizes", "lab,huge", "--allow-cpu"])


@pytest.mark.slow
def test_sampler_benchmark_writes_a_throughput_record(tmp_path):
    from benchmarks import bench_sampler

    out = tmp_path / "sampler.json"
    assert bench_sampler.main(["--size", "smoke", "--rounds", "1", "--warmup", "0",
                               "--block-s", "0.2", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    _common.check_record(record)
    assert record["throughput_ratio"] == pytest.approx(1 / record["ratio"])
    assert set(record["samples_s"]) == {"with_sampler", "without"}


# --------------------------------------------------------------------------- notebook run times


def readme_run_times() -> dict[str, tuple[int, int]]:
    """{"00_setup_and_first_job": (smoke_s, lab_s)} from the README's curriculum table."""
    import re

    rows = re.findall(r"^\| \d\d[a-z]? \| `(\d\d[a-z]?_\w+)` \|.*\| ~(\d+) s / ~(\d+) s \|$",
                      (ROOT / "README.md").read_text(), flags=re.M)  # fmt: skip
    return {name: (int(smoke), int(lab)) for name, smoke, lab in rows}


def test_readme_run_times_are_the_recorded_measurement():
    """The README's run times are the medians `bench_notebooks --record` measured, rounded to
    5 s: a table typed by hand drifts (notebook 02 was listed at 85 s and took 98–116 s)."""
    import re

    from benchmarks import bench_notebooks
    from labkit.course import timings

    record = json.loads((ROOT / "benchmarks" / "results" / "notebooks-cpu.json").read_text())
    _common.check_record(record)
    table = readme_run_times()
    notebooks = [p.stem for p in bench_notebooks.SOLUTIONS]
    assert sorted(table) == notebooks, "one README row per notebook in solutions/"
    for name, shown in table.items():
        cell = timings.run_time_cell(record, name)  # the README's cell, made from the record
        measured = tuple(int(n) for n in re.findall(r"~(\d+) s", cell))
        assert shown == measured, (
            f"README says {name} takes ~{shown[0]} s / ~{shown[1]} s; the record measured "
            f"~{measured[0]} s / ~{measured[1]} s: copy the record's numbers into the README, or "
            "run `python -m benchmarks.bench_notebooks --record` again"
        )


def test_notebook_benchmark_runs_through_labkit_timings(tmp_path, monkeypatch):
    """bench_notebooks does no running of its own: labkit.course.timings runs each notebook, and the
    record keeps its sections and sampled peak memory beside the run times the README reads."""
    from benchmarks import bench_notebooks
    from labkit.course import timings

    ran: list[tuple[str, str]] = []

    def fake_run(path, size, out_dir=None):
        ran.append((size, path.stem))
        return timings.NotebookTiming(path.stem, size, 12.0, 3 * 2**30,
                                      [timings.Section("Setup", 4.0, 2, 2**30)])  # fmt: skip

    monkeypatch.setattr(timings, "run_notebook", fake_run)
    out = tmp_path / "nb.json"
    assert bench_notebooks.main(["--sizes", "smoke", "--only", "00", "--out", str(out),
                                 "--timings-out", str(tmp_path / "plan")]) == 0  # fmt: skip
    record = json.loads(out.read_text())
    _common.check_record(record)
    stem = bench_notebooks.SOLUTIONS[0].stem
    assert ran == [("smoke", stem)]
    k = f"smoke/{stem}"
    assert record["samples_s"][k] == [12.0] and record["summary"][k]["median_s"] == 12.0
    assert record["peak_rss_bytes"][k] == [3 * 2**30]
    assert record["sections"][k][0][0]["title"] == "Setup"
    assert "sampled" in record["memory_note"]
    assert "| Setup | 2 | 4.0 s | 1.00 GiB |" in (tmp_path / "plan" / "timings-smoke.md").read_text()
