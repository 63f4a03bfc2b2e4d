"""The profiler's FLOP column, HTA's TraceDiff and kernel launch statistics, and ncu's NVTX
filtering and section sets (notebook 06, reviews N06-18 and N06-19).

FLOPs and TraceDiff run on traces recorded here by ``torch.profiler`` (CPU); the launch
statistics, which need CUDA launches, on a synthetic GPU trace (``tests/gpu_traces.py``) whose
every interval the test knows."""

from __future__ import annotations

import shlex
import sys

import pytest
import torch
from gpu_traces import build
from torch import nn

from labkit.profiling import (
    counted_flops,
    hta_launch_stats,
    hta_trace_diff,
    nsight,
    phase,
    profile_steps,
)

ROWS, D_IN, D_OUT = 16, 12, 20


def _step(model, opt, extra_muls: int = 0):
    def step(_i: int) -> None:
        with phase("data"):
            x = torch.randn(ROWS, D_IN)
        with phase("forward"):
            loss = model(x).square().mean()
            for _ in range(extra_muls):
                loss = loss * 1.0
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
    return step


def _model():
    torch.manual_seed(0)
    model = nn.Linear(D_IN, D_OUT)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_the_profiler_counts_six_flops_per_weight_per_row_in_a_linear_layer(tmp_path):
    """Forward addmm 2·rows·in·out; backward mm for the weight's gradient 2·rows·in·out (the
    input needs no gradient here, so no third product): 4 per weight per row, the bias none."""
    torch.set_num_threads(1)
    model, opt = _model()
    run = profile_steps(_step(model, opt), wait=0, warmup=1, active=2, trace_dir=tmp_path,
                        with_flops=True)
    flops = counted_flops(run.prof.key_averages(), steps=2)
    assert flops["aten::addmm"] == 2 * ROWS * D_IN * D_OUT
    assert flops["aten::mm"] == 2 * ROWS * D_IN * D_OUT
    assert run.settings["with_flops"] is True


def test_without_with_flops_nothing_is_counted_and_it_says_how(tmp_path):
    model, opt = _model()
    run = profile_steps(_step(model, opt), wait=0, warmup=0, active=1, trace_dir=tmp_path)
    with pytest.raises(ValueError, match="with_flops=True"):
        counted_flops(run.prof.key_averages(), steps=1)


def test_trace_diff_counts_the_operators_one_run_added_per_step(tmp_path):
    torch.set_num_threads(1)
    for name, extra in (("before", 0), ("after", 3)):
        model, opt = _model()
        profile_steps(_step(model, opt, extra_muls=extra), wait=0, warmup=1, active=2,
                      trace_dir=tmp_path / name)
    diff = hta_trace_diff(tmp_path / "before", tmp_path / "after")
    assert diff.failure == "" and diff.steps == (2, 2)
    before, after = diff.per_step("aten::mul")
    # three multiplications in the forward, and one in each of their backward nodes
    assert after - before == 6
    assert diff.per_step("MulBackward0") == (0.0, 3.0)
    assert diff.per_step("forward") == (1.0, 1.0)
    assert diff.per_step("ProfilerStep (the steps)") == (1.0, 1.0)  # HTA's #N rows, as one
    assert diff.per_step("no such operator") == (0.0, 0.0)
    text = diff.describe()
    assert "aten::mul" in text and "before → after" in text


def test_trace_diff_refuses_what_it_cannot_compare(tmp_path):
    with pytest.raises(FileNotFoundError):
        hta_trace_diff(tmp_path / "a", tmp_path)
    with pytest.raises(ValueError, match="'cpu', 'gpu' or 'all'"):
        hta_trace_diff(tmp_path, tmp_path, device="tpu")
    with pytest.raises(ValueError, match="two different names"):
        hta_trace_diff(tmp_path, tmp_path, labels=("x", "x"))
    empty = hta_trace_diff(tmp_path, tmp_path)  # no traces: HTA's failure, reported
    assert empty.table is None and empty.failure
    with pytest.raises(ValueError, match="produced nothing"):
        empty.per_step("x")


@pytest.mark.parametrize(("kernel_us", "shorter"), [(150.0, 0.0), (3.0, 1.0)])
def test_launch_stats_pair_each_launch_with_its_kernel(tmp_path, kernel_us, shorter):
    built = build(kernels=6, kernel_us=kernel_us, launch_us=6.0, all_reduce_us=0.0)
    built.write(tmp_path / "rank0.json")
    stats = hta_launch_stats(tmp_path)
    assert stats.launches == len(built.compute)
    assert (stats.table["cpu_duration"] == 6.0).all()
    assert (stats.table["gpu_duration"] == kernel_us).all()
    assert stats.shorter_than_launch == shorter
    assert "launches" in stats.describe()


def test_launch_stats_on_a_cpu_trace_say_there_are_no_launches(tmp_path):
    model, opt = _model()
    profile_steps(_step(model, opt), wait=0, warmup=0, active=1, trace_dir=tmp_path)
    stats = hta_launch_stats(tmp_path)
    assert stats.launches == 0 and "no CUDA launch calls" in stats.describe()


def test_ncu_selects_kernels_by_nvtx_range_and_a_section_set():
    cmd = nsight.NcuCommand(target=["python", "t.py"], kernel_name="gemm", log_file="k.csv",
                            metrics=(), sections=("Occupancy", "WarpStateStats"),
                            section_set="full", nvtx_include=("forward/", "Dom@range"))  # fmt: skip
    argv = cmd.argv()
    assert argv[argv.index("--set") + 1] == "full"
    assert argv[argv.index("--nvtx") + 1:argv.index("--nvtx") + 5] == [
        "--nvtx-include", "forward/", "--nvtx-include", "Dom@range"]
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--section"] == ["Occupancy",
                                                                              "WarpStateStats"]
    assert shlex.split(cmd.shell()) == argv
    plain = nsight.NcuCommand(target=["t"], kernel_name="k", log_file="k.csv")
    assert "--nvtx" not in plain.argv() and "--set" not in plain.argv()


@pytest.mark.parametrize(("kw", "message"), [
    ({"section_set": "full; rm"}, "a set's name"),
    ({"nvtx_include": "forward/"}, "a list of strings"),
    ({"nvtx_include": ("",)}, "non-empty string"),
])  # fmt: skip
def test_ncu_refuses_a_bad_set_or_nvtx_filter(kw, message):
    with pytest.raises(ValueError, match=message):
        nsight.NcuCommand(target=["t"], kernel_name="k", log_file="k.csv", **kw)


def test_the_step_snippet_trains_the_preset_with_its_phases_named():
    """The ncu target runs real steps, each phase in a named range (NVTX on CUDA)."""
    import subprocess

    code = nsight.step_snippet("smoke", "float32", steps=1, device="cpu")
    probe = (code + "; from labkit.profiling import phase; import labkit.profiling.phases as ph; "
             "print('ok')")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")
    with pytest.raises(ValueError, match="dtype='tf32'"):
        nsight.step_snippet("smoke", "tf32")
    with pytest.raises(ValueError):
        nsight.step_snippet("no-such-preset", "float32")
