"""The GPU tier of mixed precision: fp32, tf32, bf16 and fp16 matmuls, and the roofline, on CUDA.

Run by scripts/gpu_check.sh (step gpu-tests: ``pytest -m gpu`` over the test files that use
the marker) on a machine with an NVIDIA GPU; skipped elsewhere, and importable anywhere.

No speed is asserted: how much faster tf32 or bf16 runs than fp32 is what notebook 04 and
benchmarks/bench_precision.py measure. These check that every precision is measured, that
tf32 is really on for the tf32 rows and off for the float32 ones (by the switch each call saw
and by tf32's rounding error), that the caller's TF32 setting comes back, and that the roofline
measured on the GPU has a matmul under its roof and draws.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from labkit import roofline, timing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda", 0)
ALL = ("float32", "tf32", "bfloat16", "float16")
MATMUL = torch.backends.cuda.matmul


def tf32_state() -> tuple:
    """The caller's whole TF32 setting, old and new switches (PyTorch "CUDA semantics", TF32).

    Reading the old switches raises a RuntimeError once code has set the new one (2.9+), so
    that case reads as None for them.
    """
    new = getattr(MATMUL, "fp32_precision", None)
    try:
        old = (MATMUL.allow_tf32, torch.get_float32_matmul_precision())
    except RuntimeError:
        old = None
    return new, old


def tf32_on() -> bool:
    """Whether a CUDA float32 matmul issued now may run in TF32: the old switch where it can be
    read, else (the new switch was set, 2.9+) the new one."""
    try:
        return bool(MATMUL.allow_tf32)
    except RuntimeError:
        return MATMUL.fp32_precision == "tf32"


def _legacy_tf32_on() -> None:
    torch.set_float32_matmul_precision("high")


def _new_api_tf32_on() -> None:
    if not hasattr(MATMUL, "fp32_precision"):
        pytest.skip(f"torch {torch.__version__} has no matmul.fp32_precision (added in 2.9)")
    MATMUL.fp32_precision = "tf32"  # now the old switches raise when read


@pytest.fixture(
    params=["default", "caller allowed tf32 (old switch)", "caller allowed tf32 (new switch)"]
)
def callers_setting(request):
    """The caller's TF32 setting before the code under test runs; put back afterwards."""
    saved_new = getattr(MATMUL, "fp32_precision", None)
    saved_old = MATMUL.allow_tf32, torch.get_float32_matmul_precision()
    try:
        if request.param.endswith("(old switch)"):
            _legacy_tf32_on()
        elif request.param.endswith("(new switch)"):
            _new_api_tf32_on()
        yield request.param
    finally:
        if saved_new is not None:
            MATMUL.fp32_precision = saved_new
        MATMUL.allow_tf32 = saved_old[0]
        torch.set_float32_matmul_precision(saved_old[1])
        if saved_new is not None:
            MATMUL.fp32_precision = saved_new  # the old setters write "ieee" over "none"


# --- fp32, tf32, bf16, fp16 matmuls timed -------------------------------------------------------


def test_sweep_measures_each_precision_with_tf32_on_only_for_its_rows(monkeypatch, callers_setting):
    seen: list[tuple[torch.dtype, bool]] = []
    real = torch.matmul

    def spy(a, b):
        seen.append((a.dtype, tf32_on()))
        return real(a, b)

    monkeypatch.setattr(torch, "matmul", spy)
    before = tf32_state()
    sizes, repeats, warmup = (1024, 2048), 3, 1
    sweep = roofline.matmul_sweep("cuda", ("fp32", "tf32", "bf16", "fp16"), sizes,
                                  repeats=repeats, warmup=warmup)  # fmt: skip
    monkeypatch.undo()
    assert tf32_state() == before, f"the caller's setting ({callers_setting}) was not restored"

    assert [(r.precision, r.n) for r in sweep.rows] == [(p, n) for p in ALL for n in sizes]
    for r in sweep.rows:
        assert len(r.samples_s) == repeats
        assert all(math.isfinite(s) and s > 0 for s in r.samples_s), r
        assert math.isfinite(r.median_flops_per_s) and r.median_flops_per_s > 0
        ratio = sweep.speed_ratio(r.precision, r.n)
        assert math.isfinite(ratio) and ratio > 0
    # Each case ran warmup + repeats calls, in its dtype; float32 with TF32 off even where the
    # caller had allowed it, through either switch; tf32 with it on.
    calls = len(sizes) * (warmup + repeats)
    assert seen.count((torch.float32, False)) == calls  # the float32 rows
    assert seen.count((torch.float32, True)) == calls  # the tf32 rows
    assert seen.count((torch.bfloat16, True)) + seen.count((torch.bfloat16, False)) == calls
    assert seen.count((torch.float16, True)) + seen.count((torch.float16, False)) == calls
    assert sweep.device.startswith("cuda") and sweep.device_name == torch.cuda.get_device_name(CUDA)
    assert sweep.cpu_support is None and "CUDA events" in sweep.method
    text = str(sweep)
    assert f"measured on {sweep.device_name}" in text and "not a GPU speedup" not in text


def test_tf32_matmuls_round_like_tf32_inside_the_switch_and_like_fp32_outside(callers_setting):
    # TF32 keeps 10 of fp32's 23 mantissa bits (NVIDIA A100 whitepaper): inputs rounded to it
    # put a relative error of a few 1e-4 on a product, against ~1e-6 for IEEE fp32 at k=1024.
    # So the error, not the speed, shows which one cuBLAS ran.
    gen = torch.Generator(device=CUDA).manual_seed(0)
    a = torch.randn(1024, 1024, device=CUDA, generator=gen)
    b = torch.randn(1024, 1024, device=CUDA, generator=gen)
    exact = a.double() @ b.double()

    def rel_err() -> float:
        return float(((a @ b).double() - exact).norm() / exact.norm())

    before = tf32_state()
    with roofline.tf32_matmuls(True):
        err_tf32 = rel_err()
    with roofline.tf32_matmuls(False):
        err_fp32 = rel_err()
    assert tf32_state() == before
    assert err_fp32 < 1e-5, f"IEEE fp32 matmul off by {err_fp32:.2e}: TF32 was not switched off"
    assert 10 * err_fp32 < err_tf32 < 2**-8, (
        f"relative error {err_tf32:.2e} with TF32 allowed, {err_fp32:.2e} without: "
        "TF32 was not switched on (or something coarser than tf32 ran)"
    )


@pytest.mark.parametrize("precision", ALL)
def test_each_precision_has_a_measured_compute_ceiling(precision):
    before = tf32_state()
    c = roofline.measure_compute_ceiling("cuda", precision, repeats=3, warmup=1)
    assert tf32_state() == before
    assert math.isfinite(c.value) and c.value > 0 and c.kind == "measured"
    assert c.device.startswith("cuda") and c.device_name == torch.cuda.get_device_name(CUDA)
    assert ("TF32 on" in c.method) == (precision == "tf32")


# --- the roofline measured on the GPU -----------------------------------------------------------


def test_gpu_roofline_is_measured_takes_kernels_under_its_roofs_and_draws():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    before = tf32_state()
    rf = roofline.measure_roofline("cuda", ALL)
    assert tf32_state() == before
    assert rf.precisions == ALL and rf.device.startswith("cuda")
    assert rf.device_name == torch.cuda.get_device_name(CUDA)
    for c in (*rf.compute, rf.bandwidth):
        assert c.kind == "measured" and c.when and math.isfinite(c.value) and c.value > 0
    assert "CUDA events" in rf.bandwidth.method
    assert all(math.isfinite(rf.ridge_intensity(p)) and rf.ridge_intensity(p) > 0 for p in ALL)

    # A bf16 matmul at n=4096: 2n³ FLOPs over 3n² bf16 elements, n/3 ≈ 1365 FLOP/B, far right
    # of any GPU's ridge (an H200: ~790 TFLOP/s over ~4.3 TB/s, ~180 FLOP/B).
    row = roofline.matmul_sweep("cuda", ("bf16",), (4096,), repeats=3).row("bf16", 4096)
    matmul = rf.place("bf16 matmul 4096", row.flops, row.bytes, row.best_s, precision="bf16")
    # An fp32 add of 2^27 elements (512 MiB each, far beyond L2): 1 FLOP per 12 bytes.
    n = 2**27
    x, y = torch.ones(n, device=CUDA), torch.ones(n, device=CUDA)
    out = torch.empty_like(x)
    add_s = timing.benchmark(lambda: torch.add(x, y, out=out), device=CUDA, repeats=5).min_s
    add = rf.place("fp32 add 2^27", n, 3 * 4 * n, add_s, precision="float32")

    assert (matmul.bound, add.bound) == ("compute", "memory")
    assert matmul.attainable_flops_per_s == rf.peak("bf16").value
    assert add.attainable_flops_per_s == pytest.approx(add.intensity * rf.bandwidth.value)
    # Under the roof: each roof is the best the device reached at the same kind of work (the
    # compute roof over matmul sizes that include 4096, the memory roof a streaming copy), so a
    # kernel far above it would mean a ceiling measured wrong (too few sizes, a timer that does
    # not wait for the GPU). The slack is for run-to-run noise only; nothing here is a speed.
    for p in (matmul, add):
        assert 0 < p.fraction_of_roof < 1.5, str(p)

    pub = roofline.published_ceilings(rf.device_name, ("bfloat16", "tf32"))
    assert pub.ceilings or pub.reasons  # a sourced figure, or the reason there is none
    ax = roofline.plot_roofline(rf, [matmul, add], published=pub.ceilings)
    texts = [t.get_text() for t in ax.texts]
    assert {"bf16 matmul 4096", "fp32 add 2^27"} <= set(texts)
    assert sum(t.startswith("ridge ") for t in texts) == len(ALL)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert all(any(t.startswith(f"{p} roof:") and "(measured)" in t for t in legend) for p in ALL)
    png = io.BytesIO()
    ax.figure.savefig(png, format="png")
    assert png.getvalue().startswith(b"\x89PNG")
    plt.close(ax.figure)
