"""labkit.roofline: measured ceilings, the roofline bound, kernels placed on it, the figure,
the precision sweep and a CPU's bf16/fp16 support.

No speed is asserted: measurements are checked for being positive, finite and labelled, and
the arithmetic is checked with injected timings. The same paths on CUDA are in
tests/test_gpu_precision.py (marked ``gpu``; scripts/gpu_check.sh runs them on a GPU machine).
"""

from __future__ import annotations

import math
import subprocess
import sys
from types import SimpleNamespace

import matplotlib
import pytest
import torch

from labkit import hardware, roofline, timing

matplotlib.use("Agg")


class FakeTimer:
    """Stands in for labkit.timing.Timer: every timed region lasts ``elapsed`` seconds."""

    elapsed = 0.5
    method = "fake timer"

    def __init__(self, device="cpu", **_):
        self.elapsed_s = float("nan")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.elapsed_s = type(self).elapsed


def measured(value: float, unit: str, precision: str | None = None, device: str = "cpu"):
    return roofline.Ceiling(value=value, unit=unit, precision=precision, device_name="test CPU",
                            kind="measured", method="by hand", device=device,
                            when="2026-01-01T00:00:00+00:00")  # fmt: skip


def toy(peak: float = 100.0, bandwidth: float = 10.0) -> roofline.Roofline:
    """A roofline with ridge at peak / bandwidth = 10 FLOP/B."""
    return roofline.Roofline(compute=(measured(peak, roofline.FLOPS, "float32"),),
                             bandwidth=measured(bandwidth, roofline.BYTES))  # fmt: skip


# --- precisions ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("given", "name"), [
    ("fp32", "float32"), (torch.float32, "float32"), ("bf16", "bfloat16"),
    (torch.bfloat16, "bfloat16"), ("half", "float16"), ("TF32", "tf32"),
])  # fmt: skip
def test_precision_names(given, name):
    assert roofline.precision_name(given) == name


@pytest.mark.parametrize("bad", ["fp8", "int8", 16, None, torch.int32])
def test_an_unknown_precision_is_refused_naming_the_allowed(bad):
    with pytest.raises(ValueError, match="float32, tf32, bfloat16, float16"):
        roofline.precision_name(bad)


# --- ceilings -----------------------------------------------------------------------------------


def test_compute_ceiling_is_measured_positive_finite_and_says_where_and_when():
    c = roofline.measure_compute_ceiling("cpu", "float32", n=64, repeats=2, warmup=1)
    assert math.isfinite(c.value) and c.value > 0
    assert (c.unit, c.precision, c.kind, c.device) == (roofline.FLOPS, "float32", "measured", "cpu")
    assert c.device_name == hardware.cpu_info().model_name
    assert c.provenance.startswith(f"measured on {c.device_name} (cpu) at {c.when}")
    assert "64×64 @ 64×64" in c.method and "measured: measured" not in c.provenance


def test_compute_ceiling_is_flops_of_the_best_call(monkeypatch):
    monkeypatch.setattr(timing, "Timer", FakeTimer)
    c = roofline.measure_compute_ceiling("cpu", "bf16", n=32, repeats=2, warmup=0)
    assert c.value == pytest.approx(2 * 32**3 / FakeTimer.elapsed)
    assert c.precision == "bfloat16"


def test_the_ladder_stops_before_a_size_that_would_pass_the_budget(monkeypatch):
    # the median call of 64², 128², 256², 512² takes 0.1, 0.8, 6.4, 51.2 ms (n³). Before 512²:
    # 8 calls x (7.3 ms so far + 8 x 6.4 ms) = 0.47 s <= 1 s, go on. Before 1024²: 8 x (58.5 ms
    # + 8 x 51.2 ms) = 3.7 s > 1 s: stop (without the 8x for n³ it would be 0.88 s, and go on).
    # Each size is timed three times; one slow call (the 9.0 s) does not move the median.
    elapsed = iter([1e-4, 9.0, 1e-4, 8e-4, 8e-4, 8e-4, 6.4e-3, 6.4e-3, 6.4e-3,
                    5.12e-2, 5.12e-2, 5.12e-2])

    class Timer(FakeTimer):
        def __exit__(self, *exc):
            self.elapsed_s = next(elapsed)

    monkeypatch.setattr(timing, "Timer", Timer)
    assert roofline.ceilings._budgeted_sizes(torch.device("cpu"), torch.float32, 8, 1.0) == [
        64,
        128,
        256,
        512,
    ]
    # even the smallest size is over budget: the first three sizes are still measured (one
    # slow call on a shared machine once stopped the ladder at n=64; review N04-3)
    elapsed = iter([1.0] * 9)
    assert roofline.ceilings._budgeted_sizes(torch.device("cpu"), torch.float32, 8, 0.5) == [
        64, 128, 256]


def test_the_ceiling_is_the_best_size_not_the_largest(monkeypatch):
    monkeypatch.setattr(roofline.ceilings, "_COMPUTE_SIZES", {"cpu": (8, 16, 32)})
    c = roofline.measure_compute_ceiling("cpu", "float32", repeats=1, warmup=0, budget_s=10.0)
    assert "3 shapes, fastest" in c.method


def test_compute_ceiling_refuses_bad_arguments():
    with pytest.raises(ValueError, match="only on CUDA"):
        roofline.measure_compute_ceiling("cpu", "tf32", n=16)
    with pytest.raises(ValueError, match="precision='fp8'"):
        roofline.measure_compute_ceiling("cpu", "fp8", n=16)
    with pytest.raises(ValueError, match="repeats=0"):
        roofline.measure_compute_ceiling("cpu", n=16, repeats=0)
    with pytest.raises(ValueError, match="budget_s"):
        roofline.measure_compute_ceiling("cpu", budget_s=float("nan"))
    with pytest.raises(ValueError, match="n=0"):
        roofline.measure_compute_ceiling("cpu", n=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            roofline.measure_compute_ceiling("cuda", n=16)


def test_bandwidth_ceiling_counts_read_plus_write(monkeypatch):
    monkeypatch.setattr(timing, "Timer", FakeTimer)
    c = roofline.measure_bandwidth_ceiling("cpu", n_bytes=1000, repeats=2, warmup=0)
    assert c.value == pytest.approx(2 * 1000 / FakeTimer.elapsed)  # not 1000 / 0.5
    assert "read + write" in c.method and c.unit == roofline.BYTES and c.precision is None


def test_bandwidth_ceiling_is_measured_positive_and_finite():
    c = roofline.measure_bandwidth_ceiling("cpu", n_bytes=2**20, repeats=2, warmup=1)
    assert math.isfinite(c.value) and c.value > 0
    assert c.kind == "measured" and c.provenance.startswith("measured on")
    with pytest.raises(ValueError, match="n_bytes=0"):
        roofline.measure_bandwidth_ceiling("cpu", n_bytes=0)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), True, "1e9"])
def test_a_ceiling_must_be_positive_and_finite(value):
    with pytest.raises(ValueError, match="value="):
        measured(value, roofline.FLOPS, "float32")


def test_a_measured_ceiling_says_where_and_when_and_units_match_the_kind():
    with pytest.raises(ValueError, match="device and when"):
        roofline.Ceiling(value=1.0, unit=roofline.FLOPS, precision="float32", device_name="x",
                         kind="measured", method="guess")  # fmt: skip
    with pytest.raises(ValueError, match="precision"):
        measured(1.0, roofline.BYTES, "float32")
    with pytest.raises(ValueError, match="precision"):
        measured(1.0, roofline.FLOPS, None)
    with pytest.raises(ValueError, match="kind"):
        roofline.Ceiling(value=1.0, unit=roofline.BYTES, precision=None, device_name="x",
                         kind="guessed", method="?")  # fmt: skip


# --- the roofline -------------------------------------------------------------------------------


def test_arithmetic_intensity():
    assert roofline.arithmetic_intensity(10, 5) == 2.0
    assert roofline.arithmetic_intensity(0, 5) == 0.0
    for flops, nbytes in [(10, 0), (-1, 5), (float("nan"), 5), (10, float("inf")), (True, 5)]:
        with pytest.raises(ValueError, match="not allowed"):
            roofline.arithmetic_intensity(flops, nbytes)


@pytest.mark.parametrize(("intensity", "expected"), [
    (0.0, 0.0),     # nothing to compute
    (1.0, 10.0),    # memory-bound: I × bandwidth
    (5.0, 50.0),
    (10.0, 100.0),  # the ridge: both roofs meet
    (20.0, 100.0),  # compute-bound: flat at the peak
    (1e6, 100.0),
])  # fmt: skip
def test_attainable_is_the_lower_of_the_two_roofs(intensity, expected):
    assert roofline.attainable(intensity, toy()) == pytest.approx(expected)


def test_each_precision_has_its_own_roof_and_ridge():
    rf = roofline.Roofline(compute=(measured(100.0, roofline.FLOPS, "float32"),
                                    measured(400.0, roofline.FLOPS, "bf16")),
                           bandwidth=measured(10.0, roofline.BYTES))  # fmt: skip
    assert rf.precisions == ("float32", "bfloat16")
    assert rf.ridge_intensity("float32") == 10.0 and rf.ridge_intensity("bfloat16") == 40.0
    assert roofline.attainable(20.0, rf, "bfloat16") == 200.0  # bf16 still memory-bound at 20
    assert roofline.attainable(20.0, rf, "float32") == 100.0
    with pytest.raises(ValueError, match="ambiguous"):
        rf.peak()
    with pytest.raises(ValueError, match=r"float16.*has no compute ceiling"):
        rf.peak("fp16")
    assert "ridge at 40 FLOP/B" in str(rf)


def test_a_single_ceiling_may_be_passed_bare():
    rf = roofline.Roofline(compute=measured(100.0, roofline.FLOPS, "float32"),
                           bandwidth=measured(10.0, roofline.BYTES))  # fmt: skip
    assert rf.compute == (rf.peak(),) and rf.device == "cpu"


@pytest.mark.parametrize(("compute", "bandwidth", "match"), [
    (None, "bw", "no compute ceiling"),
    ((), "bw", "no compute ceiling"),
    ("fl", None, "no memory-bandwidth ceiling"),
    ("published", "bw", "published ceiling"),
    ("fl", "bw-as-flops", "Ceiling objects in B/s"),
    ("fl", "bw-on-gpu", "different devices"),
    ("twice", "bw", "two ceilings for one precision"),
])  # fmt: skip
def test_a_roofline_without_measured_ceilings_is_refused(compute, bandwidth, match):
    fl = measured(100.0, roofline.FLOPS, "float32")
    pub = roofline.Ceiling(
        value=1e15,
        unit=roofline.FLOPS,
        precision="bfloat16",
        device_name="NVIDIA H100 80GB HBM3",
        kind="published",
        method="sheet",
    )
    compute = {"fl": (fl,), "published": (pub,), "twice": (fl, fl)}.get(compute, compute)
    bandwidth = {
        "bw": measured(10.0, roofline.BYTES),
        "bw-as-flops": measured(10.0, roofline.FLOPS, "float32"),
        "bw-on-gpu": measured(10.0, roofline.BYTES, device="cuda:0"),
    }.get(bandwidth)
    with pytest.raises(ValueError, match=match) as e:
        roofline.Roofline(compute=compute, bandwidth=bandwidth)
    if match.startswith(("no ", "published")):
        assert "measured on this machine" in str(e.value) and "guessed" in str(e.value)


def test_a_kernel_is_placed_under_the_right_roof():
    rf = toy()  # ridge at 10 FLOP/B
    slow = rf.place("elementwise", flops=100, bytes_moved=200, seconds=20.0)
    assert slow.intensity == 0.5 and slow.bound == "memory"
    assert slow.attainable_flops_per_s == pytest.approx(5.0)  # 0.5 FLOP/B × 10 B/s
    assert slow.achieved_flops_per_s == pytest.approx(5.0) and slow.fraction_of_roof == 1.0
    big = rf.place("matmul", flops=4000, bytes_moved=100, seconds=100.0)
    assert big.intensity == 40.0 and big.bound == "compute"
    assert big.attainable_flops_per_s == 100.0
    assert big.fraction_of_roof == pytest.approx(0.4)
    assert "40% of the 100 FLOP/s attainable (compute-bound" in str(big)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"seconds": 0.0}, "seconds=0.0"),
    ({"seconds": float("nan")}, "seconds=nan"),
    ({"flops": 0}, "flops=0"),
    ({"bytes_moved": 0}, "bytes_moved=0"),
    ({"kernel_name": " "}, "kernel_name"),
    ({"precision": "bf16"}, "no compute ceiling"),
])  # fmt: skip
def test_place_refuses_bad_input(kwargs, match):
    args = {"kernel_name": "k", "flops": 10, "bytes_moved": 10, "seconds": 1.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        toy().place(**args)


def test_matmul_traffic():
    assert roofline.matmul_traffic(2, 3, 4, "float32") == (48, (6 + 12 + 8) * 4)
    assert roofline.matmul_traffic(2, 3, 4, "bf16") == (48, (6 + 12 + 8) * 2)
    assert roofline.matmul_traffic(2, 3, 4, "tf32")[1] == (6 + 12 + 8) * 4  # stored as fp32
    with pytest.raises(ValueError, match="k=0"):
        roofline.matmul_traffic(2, 0, 4, "float32")


def test_published_ceilings_only_for_a_device_the_tables_know():
    pub = roofline.published_ceilings("NVIDIA H100 80GB HBM3", ("bf16", "tf32"))
    values = {(c.unit, c.precision): c.value for c in pub.ceilings}
    assert values == {(roofline.FLOPS, "bfloat16"): 989e12, (roofline.FLOPS, "tf32"): 494.5e12,
                      (roofline.BYTES, None): 3.35e12}  # fmt: skip
    assert all(c.kind == "published" and "datasheet" in c.method for c in pub.ceilings)
    for unknown in ("AMD EPYC", "NVIDIA A10G"):  # A10G: recognised, no public peak
        pub = roofline.published_ceilings(unknown)
        assert pub.ceilings == () and len(pub.reasons) == 2


def test_a_published_ceiling_is_drawn_beside_a_roofline_but_never_is_one():
    pub = roofline.published_ceilings("NVIDIA H100 80GB HBM3").ceilings
    with pytest.raises(ValueError, match="published ceiling"):
        roofline.Roofline(compute=pub[:1], bandwidth=pub[1])


def test_measure_roofline_on_the_cpu():
    rf = roofline.measure_roofline("cpu", ("float32", "bf16"), n_bytes=2**20, budget_s=0.05)
    assert rf.precisions == ("float32", "bfloat16") and rf.device == "cpu"
    assert all(c.kind == "measured" and math.isfinite(c.value) for c in (*rf.compute, rf.bandwidth))
    with pytest.raises(ValueError, match="precisions"):
        roofline.measure_roofline("cpu", "float32")


# --- the figure ---------------------------------------------------------------------------------


def test_the_figure_draws_log_log_marks_the_ridge_and_labels_every_point():
    import matplotlib.pyplot as plt

    rf = toy()
    points = [rf.place("elementwise add", 1, 12, 1.0), rf.place("matmul 512", 4000, 100, 100.0)]
    pub = roofline.Ceiling(
        value=1000.0,
        unit=roofline.FLOPS,
        precision="float32",
        device_name="test CPU",
        kind="published",
        method="sheet",
    )
    ax = roofline.plot_roofline(rf, points, published=[pub])
    texts = [t.get_text() for t in ax.texts]
    assert ax.get_xscale() == ax.get_yscale() == "log"
    assert "elementwise add" in texts and "matmul 512" in texts
    assert any(t.startswith("ridge 10 FLOP/B") for t in texts)
    caption = next(t for t in texts if t.startswith("roofs measured"))
    assert "time measured, FLOPs and bytes modelled" in caption
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("(measured)" in t for t in legend)
    assert any("datasheet, not measured" in t for t in legend)
    # the roof is min(peak, I·BW): its right end is flat at the peak
    roof = ax.get_lines()[0]
    assert roof.get_ydata()[-1] == 100.0 and roof.get_ydata()[0] < 100.0
    plt.close(ax.figure)


def test_the_figure_without_points_and_refusals():
    import matplotlib.pyplot as plt

    ax = roofline.plot_roofline(toy())
    caption = next(t.get_text() for t in ax.texts if t.get_text().startswith("roofs measured"))
    assert "modelled" not in caption
    plt.close(ax.figure)
    with pytest.raises(ValueError, match="Roofline"):
        roofline.plot_roofline(None)
    with pytest.raises(ValueError, match="place"):
        roofline.plot_roofline(toy(), [(1.0, 2.0)])
    with pytest.raises(ValueError, match="published"):
        roofline.plot_roofline(toy(), published=[measured(1.0, roofline.BYTES)])
    h100 = roofline.published_ceilings("NVIDIA H100 80GB HBM3").ceilings
    with pytest.raises(ValueError, match="its own device"):
        roofline.plot_roofline(toy(), published=h100)  # a CPU's roof beside an H100's sheet


# --- precisions compared ------------------------------------------------------------------------


def cpu_with(*flags: str, arch: str = "x86_64") -> hardware.CpuInfo:
    return hardware.CpuInfo(model_name="Test CPU", architecture=arch, logical_cores=2,
                            physical_cores=2, usable_cores=2, flags=flags)  # fmt: skip


def test_cpu_support_reads_the_bf16_and_fp16_flags():
    amx = roofline.cpu_precision_support(cpu_with("avx2", "avx512_bf16", "amx_bf16"))
    assert (amx.bfloat16, amx.float16) == (True, False)
    assert "AMX-BF16" in str(amx) and "no fp16 arithmetic" in str(amx)
    plain = roofline.cpu_precision_support(cpu_with("avx2", "fma"))
    assert (plain.bfloat16, plain.float16) == (False, False)
    assert "expected to run slower than fp32" in str(plain)
    fp16 = roofline.cpu_precision_support(cpu_with("avx512_fp16"))
    assert (fp16.bfloat16, fp16.float16) == (False, True)
    arm = roofline.cpu_precision_support(cpu_with(arch="aarch64"))
    assert (arm.bfloat16, arm.float16) == (None, None) and "N/A" in str(arm)


def test_matmul_sweep_on_the_cpu_reports_ratios_as_this_cpus():
    sweep = roofline.matmul_sweep("cpu", ("float32", "bf16"), (8, 16), repeats=2, warmup=0)
    assert [(r.precision, r.n) for r in sweep.rows] == [
        ("float32", 8),
        ("float32", 16),
        ("bfloat16", 8),
        ("bfloat16", 16),
    ]
    assert all(len(r.samples_s) == 2 and r.median_flops_per_s > 0 for r in sweep.rows)
    assert sweep.speed_ratio("float32", 16) == 1.0
    r = sweep.row("bf16", 16)
    assert sweep.speed_ratio("bf16", 16) == sweep.row("float32", 16).median_s / r.median_s
    assert r.flops == 2 * 16**3 and r.bytes == 3 * 16 * 16 * 2
    text = str(sweep)
    assert "not a GPU speedup" in text and "CPU support" in text
    assert sweep.cpu_support == roofline.cpu_precision_support()


def test_matmul_sweep_alternates_the_order_round_by_round(monkeypatch):
    calls: list[tuple[int, torch.dtype]] = []
    real = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: calls.append((a.shape[0], a.dtype))
                        or real(a, b))  # fmt: skip
    roofline.matmul_sweep("cpu", ("fp32", "fp16"), (4, 8), repeats=3, warmup=0)
    order = [(4, torch.float32), (8, torch.float32), (4, torch.float16), (8, torch.float16)]
    assert calls == order + order[::-1] + order


def test_matmul_sweep_refuses_bad_input():
    with pytest.raises(ValueError, match="only on CUDA"):
        roofline.matmul_sweep("cpu", ("float32", "tf32"), (8,))
    with pytest.raises(ValueError, match="twice"):
        roofline.matmul_sweep("cpu", ("float32", "fp32"), (8,))
    with pytest.raises(ValueError, match="sizes"):
        roofline.matmul_sweep("cpu", ("float32",), ())
    with pytest.raises(ValueError, match="sizes"):
        roofline.matmul_sweep("cpu", ("float32",), (8, -1))
    with pytest.raises(ValueError, match="precisions"):
        roofline.matmul_sweep("cpu", "float32", (8,))
    with pytest.raises(ValueError, match="no row"):
        roofline.matmul_sweep("cpu", ("float32",), (8,), repeats=1).row("float32", 9)


def test_matmul_sweep_leaves_the_global_rng_alone():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    roofline.matmul_sweep("cpu", ("float32",), (8,), repeats=1, warmup=0)
    assert torch.equal(torch.rand(3), expected)


# --- the TF32 switch ----------------------------------------------------------------------------


def tf32_state() -> tuple:
    matmul = torch.backends.cuda.matmul
    new = matmul.fp32_precision if hasattr(matmul, "fp32_precision") else None
    return new, torch.get_float32_matmul_precision()


def test_tf32_matmuls_sets_and_restores_the_callers_setting():
    before = tf32_state()
    with roofline.tf32_matmuls(True):
        assert torch.get_float32_matmul_precision() == "high"  # TF32 allowed
    assert tf32_state() == before
    with pytest.raises(RuntimeError, match="boom"), roofline.tf32_matmuls(True):
        raise RuntimeError("boom")
    assert tf32_state() == before
    with roofline.tf32_matmuls(False):
        assert torch.get_float32_matmul_precision() == "highest"
    assert tf32_state() == before


def test_tf32_matmuls_with_the_pre_2_9_switches(monkeypatch):
    old = SimpleNamespace(allow_tf32=False)  # a torch without matmul.fp32_precision
    monkeypatch.setattr(torch.backends.cuda, "matmul", old)
    before = torch.get_float32_matmul_precision()
    with roofline.tf32_matmuls(True):
        assert torch.get_float32_matmul_precision() == "high"
    assert old.allow_tf32 is False and torch.get_float32_matmul_precision() == before


def test_tf32_matmuls_stays_with_the_new_switch_when_the_caller_uses_it():
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip(f"torch {torch.__version__} has no matmul.fp32_precision (added in 2.9)")
    saved = matmul.fp32_precision
    matmul.fp32_precision = "tf32"  # now the old switches raise when read
    try:
        with roofline.tf32_matmuls(False):
            assert matmul.fp32_precision == "ieee"
        assert matmul.fp32_precision == "tf32"
    finally:
        matmul.fp32_precision = saved
    assert torch.get_float32_matmul_precision()  # readable again once the caller's is back


def test_on_cuda_float32_runs_with_tf32_off_and_tf32_with_it_on_whatever_the_caller_set():
    # Setting the switches needs no GPU: the mode each precision runs under is checked here,
    # what cuBLAS then does with it in tests/test_gpu_precision.py.
    cuda = torch.device("cuda")
    before = tf32_state()
    with roofline.tf32_matmuls(True):  # the caller allows TF32
        with roofline.precisions.matmul_mode("float32", cuda):
            assert torch.get_float32_matmul_precision() == "highest"
        assert torch.get_float32_matmul_precision() == "high"
    with roofline.precisions.matmul_mode("tf32", cuda):
        assert torch.get_float32_matmul_precision() == "high"
    with roofline.precisions.matmul_mode("tf32", torch.device("cpu")):
        assert tf32_state() == before  # off CUDA nothing is touched
    assert tf32_state() == before


# --- the package --------------------------------------------------------------------------------


def test_the_package_re_exports_its_api_and_importing_it_measures_and_plots_nothing():
    assert set(roofline.__all__) <= set(dir(roofline))
    assert {"measure_roofline", "plot_roofline", "matmul_sweep", "cpu_precision_support",
            "tf32_matmuls", "Roofline", "Point", "attainable"} <= set(roofline.__all__)  # fmt: skip
    code = ("import sys, torch, labkit.roofline; "
            "print('matplotlib' in sys.modules, torch.cuda.is_initialized())")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
