"""labkit.fp8: the tensorwise scale against torchao's, round trips on every fp8 value, measured
errors of e4m3 against e5m2, torch's out-of-range casts, and where fp8 training may run."""

from __future__ import annotations

import math
import sys
from unittest import mock

import pytest
import torch

from labkit import fp8, precision
from labkit.config import ModelConfig
from labkit.model import GPT

FORMATS = list(fp8.FP8_FORMATS)
TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def every_finite_value(fmt: str) -> torch.Tensor:
    """All 256 bit patterns of the format, as fp32, less NaN and ±inf."""
    values = torch.arange(256, dtype=torch.uint8).view(precision.dtype_of(fmt)).float()
    return values[torch.isfinite(values)]


# ----------------------------------------------------------------------------------------------
# The scale


@pytest.mark.parametrize(("fmt", "fp8_max"), [("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)])
def test_scale_puts_amax_at_the_format_max(fmt, fp8_max):
    x = torch.tensor([0.5, -2.0, 1.0])
    assert fp8.tensorwise_scale(x, fmt) == fp8_max / 2.0
    assert fp8.tensorwise_scale(torch.tensor([-0.25, 0.0]), fmt) == fp8_max * 4.0
    # an all-zero tensor: amax clamped at 1e-12, a large finite scale (as torchao)
    zero = fp8.tensorwise_scale(torch.zeros(3), fmt)
    assert zero == float(torch.tensor(fp8_max / 1e-12, dtype=torch.float32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_scale_is_torchaos_amax_to_scale(fmt):
    float8_utils = pytest.importorskip("torchao.float8.float8_utils")
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3e-5
    dtype = precision.dtype_of(fmt)
    theirs = float8_utils.amax_to_scale(x.abs().max(), dtype)
    assert fp8.tensorwise_scale(x, fmt) == float(theirs)


def test_non_fp8_formats_are_refused_by_name():
    with pytest.raises(ValueError, match="allowed: fp8_e4m3, fp8_e5m2"):
        fp8.tensorwise_scale(torch.ones(2), "bf16")
    with pytest.raises(ValueError, match="fp8_e4m3"):  # precision's hint for a bare "fp8"
        fp8.measure_fp8_error(torch.ones(2), "fp8", scaled=True)


# ----------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_keeps_every_representable_value(fmt):
    values = every_finite_value(fmt)
    assert torch.equal(fp8.round_trip(values, fmt), values)
    # scaled by a power of two the values stay representable, so they come back exactly
    normals = values[values.abs() >= precision.FORMATS[fmt].smallest_normal]
    assert torch.equal(fp8.round_trip(normals / 1024, fmt, scale=1024.0), normals / 1024)


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_error_is_within_half_a_unit_in_the_last_place(fmt):
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    back = fp8.round_trip(x, fmt, scale=fp8.tensorwise_scale(x, fmt))
    # relative error of round-to-nearest on normal numbers: at most eps/2
    big = back.abs() * fp8.tensorwise_scale(x, fmt) >= precision.FORMATS[fmt].smallest_normal
    rel = ((back - x).abs() / x.abs())[big]
    assert float(rel.max()) <= precision.FORMATS[fmt].eps / 2


def test_scaled_cast_clamps_to_max_like_torchao():
    x = torch.tensor([1.0, 10.0])
    back = fp8.round_trip(x, "fp8_e5m2", scale=2.0**13)  # 10 · 8192 is past e5m2's 57,344
    assert back.tolist() == [1.0, 57344 / 2**13]
    with pytest.raises(ValueError, match="positive finite"):
        fp8.round_trip(x, "fp8_e4m3", scale=0.0)


# ----------------------------------------------------------------------------------------------
# Measured errors


def test_e4m3_is_more_precise_than_e5m2_on_a_normal_tensor():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    for scaled in (False, True):
        e4m3 = fp8.measure_fp8_error(x, "fp8_e4m3", scaled=scaled)
        e5m2 = fp8.measure_fp8_error(x, "fp8_e5m2", scaled=scaled)
        # one mantissa bit more: about half the error
        assert e4m3.rel_rms_error < 0.6 * e5m2.rel_rms_error
        assert e4m3.overflow == e5m2.overflow == 0.0


def test_e5m2_keeps_more_of_a_wide_tensor_in_range_unscaled():
    # 2**-20 .. 2**12: below e4m3's smallest subnormal (2**-9) and above its max (448)
    x = torch.logspace(-20, 12, 3201, base=2)
    e4m3 = fp8.measure_fp8_error(x, "fp8_e4m3", scaled=False)
    e5m2 = fp8.measure_fp8_error(x, "fp8_e5m2", scaled=False)

    def kept(e):
        return 1 - e.flushed_to_zero - e.overflow

    assert e4m3.overflow > 0 and e5m2.overflow == 0
    assert e4m3.flushed_to_zero > e5m2.flushed_to_zero > 0
    assert kept(e5m2) > kept(e4m3)


def test_scaling_rescues_small_gradients():
    g = torch.randn(10_000, generator=torch.Generator().manual_seed(2)) * 1e-5
    unscaled = fp8.measure_fp8_error(g, "fp8_e4m3", scaled=False)
    scaled = fp8.measure_fp8_error(g, "fp8_e4m3", scaled=True)
    assert unscaled.flushed_to_zero == 1.0 and unscaled.rel_rms_error == 1.0
    assert scaled.flushed_to_zero == 0.0 and scaled.rel_rms_error < 0.05
    assert scaled.scale == fp8.tensorwise_scale(g, "fp8_e4m3") and unscaled.scale == 1.0


@pytest.mark.parametrize("fmt", FORMATS)
def test_unscaled_flush_fraction_is_precisions_underflow_fraction(fmt):
    x = torch.randn(5000, generator=torch.Generator().manual_seed(3)) * 1e-3
    x[::7] = 0.0  # zeros survive any cast: left out of both counts
    report = fp8.measure_fp8_error(x, fmt, scaled=False)
    assert report.flushed_to_zero == precision.underflow_fraction(x, fmt, "zero")
    assert report.count == int((x != 0).sum())


def test_overflow_starts_half_a_unit_past_max():
    assert fp8.overflow_threshold("fp8_e4m3") == 448 + 16
    assert fp8.overflow_threshold("fp8_e5m2") == 57344 + 4096
    # 450 rounds to 448: not an overflow; 1000 is one
    report = fp8.measure_fp8_error(torch.tensor([450.0, 1000.0]), "fp8_e4m3", scaled=False)
    assert report.overflow == 0.5


def test_out_of_range_values_are_reported_as_what_the_cast_made_of_them():
    x = torch.tensor([1.0, 1e6, -1e6, 2.0])
    for fmt in FORMATS:
        cast = fp8.round_trip(x, fmt)
        r = fp8.measure_fp8_error(x, fmt, scaled=False)
        fp8_max = precision.FORMATS[fmt].max
        assert r.overflow == 0.5
        assert r.to_max == float((cast[1:3].abs() == fp8_max).sum()) / 4
        assert r.to_inf == float(cast.isinf().sum()) / 4
        assert r.to_nan == float(cast.isnan().sum()) / 4
        assert r.to_max + r.to_inf + r.to_nan == r.overflow


@pytest.mark.skipif(TORCH_VERSION < (2, 12), reason="torch <= 2.11 did not saturate e4m3fn")
def test_torch_saturates_e4m3_and_gives_e5m2_inf():
    # torch/headeronly/util/Float8_e4m3fn.h: finite overflow and inf -> 0x7e (448)
    x = torch.tensor([1e6, -1e6, math.inf, 61440.0, 57344.0])
    assert fp8.round_trip(x, "fp8_e4m3").tolist() == [448, -448, 448, 448, 448]
    # Float8_e5m2.h: from halfway past 57,344 on, inf (0x7c)
    assert fp8.round_trip(x, "fp8_e5m2").tolist() == [math.inf, -math.inf, math.inf, math.inf,
                                                      57344]  # fmt: skip
    r4 = fp8.measure_fp8_error(x[:2], "fp8_e4m3", scaled=False)
    r5 = fp8.measure_fp8_error(x[:2], "fp8_e5m2", scaled=False)
    assert (r4.to_max, r4.to_inf, r5.to_max, r5.to_inf) == (1.0, 0.0, 0.0, 1.0)
    assert r5.rel_rms_error == math.inf


def test_error_table_rows_cover_every_tensor_format_and_scaling():
    tensors = {"act": torch.randn(256), "grad": torch.randn(256) * 1e-6}
    rows = fp8.fp8_error_table(tensors)
    assert [(r["name"], r["format"], r["scaled"]) for r in rows] == [
        (n, f, s) for n in tensors for f in FORMATS for s in (False, True)
    ]
    assert set(rows[0]) >= {"rel_rms_error", "flushed_to_zero", "overflow", "scale"}


def test_non_finite_or_integer_tensors_are_refused():
    with pytest.raises(ValueError, match="inf or NaN"):
        fp8.measure_fp8_error(torch.tensor([1.0, math.nan]), "fp8_e4m3", scaled=True, name="g")
    with pytest.raises(ValueError, match="floating-point"):
        fp8.measure_fp8_error(torch.tensor([1, 2]), "fp8_e4m3", scaled=True)


# ----------------------------------------------------------------------------------------------
# Where fp8 training can run


class FakeCuda:
    """torch.cuda with one GPU of the given compute capability."""

    def __init__(self, capability: tuple[int, int] | None, name: str = "NVIDIA Fake"):
        self.capability, self.name = capability, name

    def is_available(self) -> bool:
        return self.capability is not None

    def device_count(self) -> int:
        return 1 if self.capability else 0

    def current_device(self) -> int:
        return 0

    def get_device_capability(self, i: int) -> tuple[int, int]:
        return self.capability

    def get_device_name(self, i: int) -> str:
        return self.name


def test_support_reasons_name_what_is_missing():
    assert "is not a CUDA device" in fp8.fp8_training_support("cpu")
    assert "compute capability >= 8.9" in fp8.fp8_training_support("cpu")
    assert "is_available() is False" in fp8.fp8_training_support("cuda", cuda=FakeCuda(None))
    a100 = fp8.fp8_training_support("cuda", cuda=FakeCuda((8, 0), "NVIDIA A100"))
    assert "NVIDIA A100 has compute capability 8.0 < 8.9" in a100
    assert "there are 1 CUDA device(s)" in fp8.fp8_training_support("cuda:3",
                                                                     cuda=FakeCuda((9, 0)))  # fmt: skip


def test_hopper_is_supported_when_torchao_imports():
    pytest.importorskip("torchao.float8")
    assert fp8.fp8_training_support("cuda", cuda=FakeCuda((9, 0), "NVIDIA H100")) is None
    assert fp8.fp8_training_support("cuda:0", cuda=FakeCuda((8, 9), "NVIDIA L4")) is None


def test_missing_torchao_names_the_pinned_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # makes `import torchao` raise
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    reason = fp8.fp8_training_support("cuda", cuda=FakeCuda((9, 0)))
    assert "torchao is not importable" in reason
    assert f"pip install torchao=={fp8.TORCHAO_VERSION}" in reason


def test_convert_refuses_on_cpu_naming_what_is_allowed():
    model = GPT(ModelConfig(n_layer=1, seq_len=16))
    with pytest.raises(ValueError) as e:
        fp8.convert_for_fp8_training(model, "cpu")
    message = str(e.value)
    assert "fp8 training asked for on device 'cpu'" in message
    assert "compute capability >= 8.9" in message
    assert "Allowed on 'cpu':" in message and "fp32" in message
    assert all(type(m).__name__ != "Float8Linear" for m in model.modules())  # untouched


def test_convert_swaps_linears_whose_dims_are_multiples_of_16():
    """The filter, run on a CPU by pretending the device qualifies: torchao's conversion itself
    needs no GPU (its matmuls do)."""
    pytest.importorskip("torchao.float8")
    model = GPT(ModelConfig(n_layer=2, seq_len=16, d_model=64, n_head=4))
    model.blocks[0].mlp.fc = torch.nn.Linear(64, 24)  # 24 is not a multiple of 16
    with mock.patch.object(fp8, "fp8_training_support", return_value=None):
        result = fp8.convert_for_fp8_training(model, "cuda")
    assert result.model is model
    assert result.left_out == {
        "blocks.0.mlp.fc": "weight is 24x64; fp8 matmuls need both dims divisible by 16"
    }
    linears = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    assert linears == {"blocks.0.mlp.fc"}
    assert len(result.converted) == 12 and "lm_head" in result.converted
    assert all(type(model.get_submodule(n)).__name__ == "Float8Linear" for n in result.converted)
    assert model.lm_head.weight is model.wte.weight  # weight tying survives


def test_convert_refuses_a_model_with_nothing_to_convert():
    pytest.importorskip("torchao.float8")
    model = torch.nn.Sequential(torch.nn.Linear(10, 24), torch.nn.ReLU())
    with (
        mock.patch.object(fp8, "fp8_training_support", return_value=None),
        pytest.raises(ValueError, match=r"no nn\.Linear of the model qualifies"),
    ):
        fp8.convert_for_fp8_training(model, "cuda")


# ----------------------------------------------------------------------------------------------
# GPU tier: real fp8 training


def _fp8_gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return fp8.fp8_training_support("cuda")


@pytest.mark.gpu
def test_fp8_training_of_the_course_gpt_runs_and_learns():
    reason = _fp8_gpu_reason()
    if reason is not None:
        pytest.skip(reason)
    from labkit import data, train

    cuda = torch.device("cuda", 0)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=4, d_model=128)
    model = GPT(cfg).to(cuda)
    result = fp8.convert_for_fp8_training(model, cuda)
    # every Linear: q, k, v, proj, fc, proj per block, and the (tied) head
    assert len(result.converted) == 6 * cfg.n_layer + 1 and not result.left_out
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = data.get_batch(data.load_splits().train, 8, cfg.seq_len,
                           torch.Generator().manual_seed(0))  # fmt: skip
    losses = [
        train.train_step(model, optimizer, [batch], device=cuda, dtype="bfloat16").loss
        for _ in range(10)
    ]
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses  # the same batch ten times: it must fit it
    assert type(model.lm_head).__name__ == "Float8Linear"


# --- block scaling (MX), simulated ------------------------------------------------------------


def test_mx_scales_are_powers_of_two_per_block_of_32():
    x = torch.cat([torch.full((32,), 1e-6), torch.full((32,), 300.0)])
    back = fp8.mx_round_trip(x, "fp8_e4m3")
    # each block has its own scale: the tiny block survives, unlike one scale for both
    assert bool((back[:32] != 0).all())
    assert bool((fp8.round_trip(x, "fp8_e4m3", fp8.tensorwise_scale(x, "fp8_e4m3"))[:32] == 0).all())
    # with a power-of-two scale, a value that is itself fp8 times a power of two comes back exact
    y = torch.tensor([3.0, 0.5, -1.25, 0.0] * 8) * 2.0**-20
    assert torch.equal(fp8.mx_round_trip(y, "fp8_e4m3"), y)


def test_mx_scale_rounded_down_saturates_and_rounded_up_does_not():
    # amax = 480: OCP v1.0 takes X = 2**(8 - 8) = 1, and 480 saturates to 448 in e4m3;
    # rounded up, X = 2**ceil(log2(480/448)) = 2, and 480/2 = 240 = 1.875 · 2**7 is exact
    x = torch.tensor([480.0] + [1.0] * 31)
    assert fp8.mx_round_trip(x, "fp8_e4m3", rounding="down")[0].item() == 448.0
    assert fp8.mx_round_trip(x, "fp8_e4m3", rounding="up")[0].item() == 480.0
    assert fp8.mx_round_trip(torch.zeros(40), "fp8_e5m2").abs().sum().item() == 0.0  # pads, zeros
    with pytest.raises(ValueError, match="rounding"):
        fp8.mx_round_trip(x, "fp8_e4m3", rounding="nearest")
    with pytest.raises(ValueError, match="block"):
        fp8.mx_round_trip(x, "fp8_e4m3", block=0)


def test_scaling_errors_measures_four_ways():
    torch.manual_seed(0)
    x = torch.randn(4096) * 1e-4
    x[7] = 3e-2  # one outlier sets the per-tensor scale for all
    rows = fp8.scaling_errors(x, "fp8_e4m3")
    assert list(rows)[:2] == ["unscaled", "per tensor"] and len(rows) == 4
    assert rows["unscaled"]["flushed_to_zero"] > 0.9  # 1e-4 is below e4m3's 2**-9
    blocks = [v for k, v in rows.items() if k.startswith("per 32-block")]
    assert all(b["flushed_to_zero"] <= rows["per tensor"]["flushed_to_zero"] for b in blocks)
    with pytest.raises(ValueError, match="no nonzero"):
        fp8.scaling_errors(torch.zeros(8))
