"""labkit.precision: formats against torch.finfo, underflow by the cast, ManualScaler against
GradScaler step by step, and what autocast really does to the course's GPT on this CPU."""

from __future__ import annotations

import copy
import itertools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labkit import precision, train
from labkit.config import ModelConfig, TrainConfig
from labkit.model import GPT

STORED = [n for n in precision.FORMAT_NAMES if n != "tf32"]

# ----------------------------------------------------------------------------------------------
# Formats


@pytest.mark.parametrize("name", STORED)
def test_format_is_read_from_finfo(name):
    fmt = precision.FORMATS[name]
    info = torch.finfo(precision.dtype_of(name))
    assert fmt.measured
    assert (fmt.max, fmt.smallest_normal, fmt.eps, fmt.bits) == (
        info.max, info.smallest_normal, info.eps, info.bits)  # fmt: skip
    assert fmt.sign_bits + fmt.exponent_bits + fmt.mantissa_bits == fmt.bits
    assert fmt.eps == 2.0**-fmt.mantissa_bits


@pytest.mark.parametrize(
    ("name", "bits", "max_", "normal", "subnormal"),
    [
        # IEEE 754 binary32 and binary16; bfloat16 keeps binary32's exponent.
        ("fp32", (8, 23), 3.4028234663852886e38, 2.0**-126, 2.0**-149),
        ("bf16", (8, 7), 3.3895313892515355e38, 2.0**-126, 2.0**-133),
        ("fp16", (5, 10), 65504.0, 2.0**-14, 2.0**-24),
        # OCP 8-bit floating point (arXiv 2209.05433): e4m3 has no inf, so max is 448.
        ("fp8_e4m3", (4, 3), 448.0, 2.0**-6, 2.0**-9),
        ("fp8_e5m2", (5, 2), 57344.0, 2.0**-14, 2.0**-16),
    ],
)
def test_format_has_the_published_values(name, bits, max_, normal, subnormal):
    fmt = precision.FORMATS[name]
    assert (fmt.exponent_bits, fmt.mantissa_bits) == bits
    assert (fmt.max, fmt.smallest_normal, fmt.smallest_subnormal) == (max_, normal, subnormal)


@pytest.mark.parametrize("name", STORED)
def test_smallest_subnormal_is_the_smallest_value_the_cast_keeps(name):
    fmt, dtype = precision.FORMATS[name], precision.dtype_of(name)
    tiny = fmt.smallest_subnormal

    def cast(x):
        return torch.tensor([x], dtype=torch.float64).to(dtype).double().item()

    assert cast(tiny) == tiny
    assert cast(0.49 * tiny) == 0.0  # below half of it: gone
    assert cast(0.51 * tiny) == tiny  # above half: rounds up to it, not down to zero
    assert 0 < cast(0.5 * fmt.smallest_normal) < fmt.smallest_normal  # subnormals exist


@pytest.mark.parametrize("name", STORED)
def test_one_plus_half_eps_rounds_back_to_one(name):
    dtype, eps = precision.dtype_of(name), precision.FORMATS[name].eps
    one = torch.ones(1, dtype=dtype)
    assert (one.float() + eps / 2).to(dtype).item() == 1.0  # a tie: to even, i.e. 1.0
    assert (one.float() + eps).to(dtype).item() == 1.0 + eps


def test_tf32_is_defined_not_read():
    tf32 = precision.FORMATS["tf32"]
    assert not tf32.measured and tf32.torch_dtype is None
    assert (tf32.exponent_bits, tf32.mantissa_bits, tf32.bits) == (8, 10, 19)
    assert tf32.eps == precision.FORMATS["fp16"].eps  # fp16's precision...
    assert tf32.smallest_normal == precision.FORMATS["fp32"].smallest_normal  # ...fp32's range
    assert tf32.smallest_subnormal is None  # not documented: N/A, never a guess
    assert tf32.storage_bytes == 4


def test_format_table_rows_in_order():
    rows = precision.format_table()
    assert [r["format"] for r in rows] == list(precision.FORMAT_NAMES)
    fp16 = rows[3]
    assert fp16["sign/exponent/mantissa"] == "1/5/10" and fp16["bytes"] == 2
    assert fp16["source"].startswith("read: torch.finfo(torch.float16)")


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("fp32", torch.float32), ("float32", torch.float32), ("bf16", torch.bfloat16),
     ("BFloat16", torch.bfloat16), ("fp16", torch.float16), ("float16", torch.float16),
     ("fp8_e4m3", torch.float8_e4m3fn), ("float8_e4m3fn", torch.float8_e4m3fn),
     ("fp8_e5m2", torch.float8_e5m2), (torch.bfloat16, torch.bfloat16),
     ("torch.float16", torch.float16)],
)  # fmt: skip
def test_dtype_of_accepts_the_notebook_names(name, dtype):
    assert precision.dtype_of(name) is dtype


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("fp12", r"allowed: 'fp32', 'tf32', 'bf16', 'fp16', 'fp8_e4m3', 'fp8_e5m2'"),
        ("fp8", r"say 'fp8_e4m3' .* or 'fp8_e5m2'"),
        (torch.int8, r"allowed: 'fp32'"),
        ("tf32", r"not a dtype.*set_float32_matmul_precision\('high'\)"),
    ],
)
def test_dtype_of_refuses_with_what_is_allowed(name, says):
    with pytest.raises(ValueError, match=says):
        precision.dtype_of(name)


def test_fp8_missing_from_the_torch_build(monkeypatch):
    monkeypatch.delattr(torch, "float8_e5m2")
    with pytest.raises(ValueError, match=r"has no torch\.float8_e5m2; formats it has: 'fp32'"):
        precision.dtype_of("fp8_e5m2")
    assert "fp8_e5m2" not in precision.read_formats()  # left out, not invented
    assert "fp8_e4m3" in precision.read_formats()


# ----------------------------------------------------------------------------------------------
# Underflow

# Values chosen around fp16's smallest subnormal 2**-24, plus an exact zero.
KNOWN = torch.tensor([
    2.0**-26,         # -> 0
    2.0**-25,         # exactly half of 2**-24: a tie, rounds to even -> 0
    1.5 * 2.0**-25,   # -> 2**-24: a "< 2**-24" threshold would wrongly call it lost
    2.0**-24,         # -> 2**-24, subnormal
    1e-6,             # subnormal (below 2**-14)
    1.0,              # normal
    0.0,              # an exact zero: not an underflow, not counted
])  # fmt: skip


def test_underflow_fraction_of_known_values():
    assert precision.underflow_fraction(KNOWN, "fp16") == 2 / 6
    assert precision.underflow_fraction(KNOWN, "fp16", kind="subnormal") == 3 / 6
    assert precision.underflow_fraction(KNOWN, "fp16", kind="below_normal") == 5 / 6
    assert precision.underflow_fraction(KNOWN, "bf16") == 0.0  # fp32's range
    assert precision.underflow_fraction(KNOWN, "fp8_e4m3") == 5 / 6  # only 1.0 survives


def test_underflow_fraction_is_not_a_common_mistake():
    got = precision.underflow_fraction(KNOWN, "fp16")
    nonzero = KNOWN[KNOWN != 0]
    threshold_guess = float((nonzero.abs() < 2.0**-24).float().mean())  # 3/6
    normal_limit_guess = float((nonzero.abs() < 2.0**-14).float().mean())  # 5/6
    zeros_counted = float((KNOWN.half() == 0).float().mean())  # 3/7
    assert got not in (threshold_guess, normal_limit_guess, zeros_counted)


def test_underflow_fraction_edges():
    assert math.isnan(precision.underflow_fraction(torch.zeros(4)))  # nothing to judge: N/A
    with_nonfinite = torch.tensor([float("inf"), float("nan"), 2.0**-30, 1.0])
    assert precision.underflow_fraction(with_nonfinite) == 1 / 2
    with pytest.raises(ValueError, match="floating-point"):
        precision.underflow_fraction(torch.arange(3))
    with pytest.raises(ValueError, match="kind must be one of 'zero', 'subnormal'"):
        precision.underflow_fraction(KNOWN, kind="flush")
    with pytest.raises(ValueError, match="tf32 is not a dtype"):
        precision.underflow_fraction(KNOWN, "tf32")


def test_per_parameter_underflow_reads_the_grads():
    layer = nn.Linear(3, 1)
    with pytest.raises(ValueError, match=r"run loss\.backward"):
        precision.per_parameter_underflow(layer)
    layer.weight.grad = torch.tensor([[2.0**-30, 1.0, 0.0]])
    fractions = precision.per_parameter_underflow(layer)
    assert fractions == {"weight": 1 / 2}  # the bias has no grad: left out


# ----------------------------------------------------------------------------------------------
# ManualScaler against torch.amp.GradScaler


def test_defaults_are_gradscalers():
    ours, theirs = precision.ManualScaler(), torch.amp.GradScaler("cpu")
    assert ours.get_scale() == theirs.get_scale() == 2.0**16
    assert ours.growth_factor == theirs.get_growth_factor() == 2.0
    assert ours.backoff_factor == theirs.get_backoff_factor() == 0.5
    assert ours.growth_interval == theirs.get_growth_interval() == 2000


def _pair(**kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    twin = copy.deepcopy(model)
    return [(model, torch.optim.SGD(model.parameters(), lr=0.1),
             precision.ManualScaler(**kwargs)),
            (twin, torch.optim.SGD(twin.parameters(), lr=0.1),
             torch.amp.GradScaler("cpu", **kwargs))]  # fmt: skip


def _run(pairs, steps, *, inject=None, loss_factor=1.0):
    """Both scalers over the same batches; ``inject`` maps a step to a value written into one
    gradient after backward. Returns per scaler a list of (scale used, skipped)."""
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen))
               for _ in range(steps)]  # fmt: skip
    seen = [[], []]
    for step, (x, y) in enumerate(batches, start=1):
        for i, (model, opt, scaler) in enumerate(pairs):
            before = [p.detach().clone() for p in model.parameters()]
            scale = scaler.get_scale()
            loss = F.mse_loss(model(x), y) * loss_factor
            scaler.scale(loss).backward()
            if inject and step in inject:
                model[0].weight.grad[0, 0] = inject[step]
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
            seen[i].append((scale, unchanged))
        for p, q in zip(pairs[0][0].parameters(), pairs[1][0].parameters(), strict=True):
            assert torch.equal(p, q), f"parameters differ after step {step}"
    return seen


def test_manual_scaler_matches_gradscaler_step_by_step():
    pairs = _pair(init_scale=2.0**10, growth_interval=3)
    seen = _run(pairs, 10, inject={2: float("inf"), 7: float("nan")})
    ours, theirs = seen
    assert ours == theirs
    scales = [s for s, _ in ours]
    # step 2 skipped: 2**10 backs off to 2**9; three clean steps (3, 4, 5) grow it to 2**10;
    # step 6 is clean; step 7 (NaN) backs off to 2**9.
    assert scales == [2.0**10, 2.0**10, 2.0**9, 2.0**9, 2.0**9, 2.0**10, 2.0**10, 2.0**9,
                      2.0**9, 2.0**9]  # fmt: skip
    assert [skipped for _, skipped in ours] == [s in (2, 7) for s in range(1, 11)]
    manual = pairs[0][2]
    assert [(h.step, h.scale, h.skipped) for h in manual.history] == [
        (i + 1, s, i + 1 in (2, 7)) for i, s in enumerate(scales)]  # fmt: skip
    assert manual.get_scale() == pairs[1][2].get_scale() == 2.0**10  # grown after 8, 9, 10


def test_overflowing_scale_backs_off_until_the_grads_are_finite():
    # A loss of ~1e4 times 2**120 overflows float32 (max ~3.4e38): real infs, not injected.
    pairs = _pair(init_scale=2.0**120, growth_interval=1000)
    ours, theirs = _run(pairs, 12, loss_factor=1e4)
    assert ours == theirs
    skips = [skip for _, skip in ours]
    assert skips[0] and not all(skips)  # overflows at first, then a step goes through
    for (scale, skip), (after, _) in itertools.pairwise(ours):
        assert after == (scale / 2 if skip else scale)  # each skip halves; no growth in 12
    assert pairs[0][2].get_scale() == pairs[1][2].get_scale() == 2.0 ** (120 - sum(skips))


def test_scale_never_grows_past_float32():
    pairs = _pair(init_scale=2.0**127, growth_interval=1)
    ours, theirs = _run(pairs, 3, loss_factor=1e-3)  # scaled grads ~1e35: finite
    assert ours == theirs == [(2.0**127, False)] * 3


def test_manual_scaler_drives_train_step_as_gradscaler_does():
    cfg = ModelConfig(seq_len=8, n_layer=1, n_head=2, d_model=16)
    torch.manual_seed(0)
    models = [GPT(cfg)]
    models.append(copy.deepcopy(models[0]))
    scalers = [precision.ManualScaler(init_scale=2.0**8), torch.amp.GradScaler("cpu", 2.0**8)]
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2, 8), generator=gen)
    losses = []
    for model, scaler in zip(models, scalers, strict=True):
        opt = train.make_optimizer(model, TrainConfig(lr=1e-3))
        stats = train.train_step(model, opt, [(x, x.roll(-1, 1))], device=torch.device("cpu"),
                                 dtype="float16", scaler=scaler, grad_clip=1.0)
        losses.append(stats.loss)
    assert losses[0] == losses[1]
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(p, q)
    assert [h.skipped for h in scalers[0].history] == [False]


def test_manual_scaler_refuses_misuse():
    model, opt, scaler = _pair()[0]
    with pytest.raises(RuntimeError, match="update\\(\\) before step\\(\\)"):
        scaler.update()
    scaler.scale(model(torch.ones(1, 4)).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) was already called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) was already called"):
        scaler.step(opt)
    half = nn.Linear(2, 1).half()
    half.weight.grad = torch.ones_like(half.weight)
    with pytest.raises(ValueError, match="gradients are float16"):
        precision.ManualScaler().unscale_(torch.optim.SGD(half.parameters(), lr=0.1))
    for bad, says in [({"growth_factor": 1.0}, "growth_factor"),
                      ({"backoff_factor": 1.5}, "backoff_factor"),
                      ({"growth_interval": 0}, "growth_interval"),
                      ({"init_scale": float("inf")}, "init_scale")]:  # fmt: skip
        with pytest.raises(ValueError, match=says):
            precision.ManualScaler(**bad)


# ----------------------------------------------------------------------------------------------
# Autocast: measured on this torch's CPU autocast


def test_cpu_autocast_ops_as_measured():
    """What CPU autocast does in this torch, op by op (PyTorch docs, "Automatic Mixed Precision
    package - torch.amp", Autocast Op Reference, CPU Op-Specific Behavior).

    linear is on the CPU lower-precision list; layer_norm and softmax are on *no* CPU list, so
    they run in their input's dtype: bf16 in, bf16 out. (The CUDA lists send both to float32:
    this is a CPU/CUDA difference, not a labkit choice.) cross_entropy goes to float32: it is
    KERNEL_CPU(cross_entropy_loss, fp32) in aten/src/ATen/autocast_mode.cpp, although the
    rendered CPU float32 list of the docs page omits it.
    """
    x32 = torch.randn(4, 8)
    x16 = x32.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert nn.Linear(8, 8)(x32).dtype == torch.bfloat16
        assert F.layer_norm(x32, (8,)).dtype == torch.float32
        assert F.layer_norm(x16, (8,)).dtype == torch.bfloat16
        assert F.softmax(x32, -1).dtype == torch.float32
        assert F.softmax(x16, -1).dtype == torch.bfloat16
        assert F.cross_entropy(x16, torch.zeros(4, dtype=torch.long)).dtype == torch.float32
        assert torch.exp(x16).dtype == torch.bfloat16  # CUDA's list sends exp to fp32
        assert (x32 + x16).dtype == torch.float32  # add promotes: bf16 + fp32 is fp32


def test_cpu_autocast_accepts_fp16_in_this_torch():
    assert precision.autocast_formats("cpu") == ("bf16", "fp16")
    with precision.checked_autocast("cpu", "fp16"):
        assert nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.float16


TINY = ModelConfig(seq_len=8, n_layer=2, n_head=2, d_model=16)


def _capture(dtype):
    torch.manual_seed(0)
    model = GPT(TINY)
    x = torch.randint(0, 256, (2, 8))
    return model, precision.capture_dtypes(model, (x, x.roll(-1, 1)), device_type="cpu",
                                           dtype=dtype)  # fmt: skip


def _by_op(rows):
    out = {}
    for r in rows:
        out.setdefault(r.op, []).append(r)
    return out


@pytest.mark.parametrize(("dtype", "low"), [("bf16", "bfloat16"), ("fp16", "float16")])
def test_capture_dtypes_on_the_course_gpt(dtype, low):
    model, rows = _capture(dtype)
    ops = _by_op(rows)
    assert set(ops) == {"Embedding", "Dropout", "LayerNorm", "Linear", "F.gelu",
                        "F.scaled_dot_product_attention", "F.cross_entropy"}  # fmt: skip
    # every leaf module and the three functional ops the GPT calls itself
    assert len(ops["Linear"]) == 6 * TINY.n_layer + 1  # q, k, v, proj, fc, proj; lm_head
    assert len(ops["LayerNorm"]) == 2 * TINY.n_layer + 1
    assert {r.output_dtype for r in ops["Linear"]} == {low}  # matmuls in low precision
    # LayerNorm stays fp32 here because its input, the residual stream, is fp32: embeddings
    # are not autocast and fp32 + low-precision adds promote to fp32. Not a CPU autocast rule.
    assert {(r.input_dtypes, r.output_dtype) for r in ops["LayerNorm"]} == {
        (("float32",), "float32")}  # fmt: skip
    assert {r.output_dtype for r in ops["Embedding"]} == {"float32"}
    (attn,) = {r.output_dtype for r in ops["F.scaled_dot_product_attention"]}
    assert attn == low  # softmax inside the fused kernel runs in its inputs' low precision
    assert {r.output_dtype for r in ops["F.gelu"]} == {low}
    (loss,) = ops["F.cross_entropy"]
    assert (loss.module, loss.output_dtype) == ("", "float32")
    # master weights stay fp32 under autocast
    assert {r.param_dtype for r in rows if r.param_dtype} == {"float32"}
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # the hooks are gone afterwards
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_capture_dtypes_fp32_is_the_baseline():
    _, rows = _capture("fp32")
    assert {r.output_dtype for r in rows} == {"float32"}
    assert {"Linear", "LayerNorm", "Embedding", "F.cross_entropy"} <= {r.op for r in rows}


def test_capture_dtypes_removes_hooks_on_error():
    model = GPT(TINY)
    with pytest.raises(ValueError, match="exceeds the model's seq_len"):
        precision.capture_dtypes(model, (torch.zeros(1, 99, dtype=torch.long),),
                                 device_type="cpu", dtype="bf16")  # fmt: skip
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_capture_dtypes_refuses_a_model_on_another_device():
    with pytest.raises(ValueError, match=r"parameters are on cpu: autocast would not touch"):
        precision.capture_dtypes(GPT(TINY), (), device_type="cuda", dtype="fp16")


def test_torch_itself_only_warns_on_fp8_autocast_and_labkit_refuses():
    # Measured torch behaviour: a warning, then float32 (the silent fallback labkit prevents).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cpu", dtype=torch.float8_e4m3fn):
            out = nn.Linear(4, 4)(torch.randn(2, 4))
    assert out.dtype == torch.float32 and "not supported" in str(caught[0].message)
    with pytest.raises(ValueError, match=r"Allowed for 'cpu': bf16, fp16, fp32 \(autocast off\)"
                                         r"\. fp8 is not an autocast dtype"):
        precision.checked_autocast("cpu", "fp8_e4m3")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_fp16_autocast_refused_where_the_device_has_none():
    with pytest.raises(ValueError, match=r"device_type='cuda' here: .*CUDA is not available.*"
                                         r"Allowed for 'cuda': fp32 \(autocast off\)"):
        precision.checked_autocast("cuda", "fp16")
    assert precision.autocast_formats("cuda") == ()


@pytest.mark.parametrize(("device_type", "says"), [
    ("meta", "has no autocast for this device type"),
    ("gpu", "Expected one of cpu, cuda"),
])  # fmt: skip
def test_unknown_autocast_device_type(device_type, says):
    with pytest.raises(ValueError, match=says):
        precision.checked_autocast(device_type, "bf16")


def test_checked_autocast_fp32_is_off():
    with precision.checked_autocast("cpu", "float32"):
        assert not torch.is_autocast_enabled("cpu")
        assert nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.float32


# --- spacing and running sums ---------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("value", [1.0, 3.0, 4.0, 1000.0, 0.011])
def test_spacing_is_the_gap_to_the_next_value_up(fmt, value):
    dtype = precision.dtype_of(fmt)
    v = torch.tensor(value, dtype=dtype)
    # The next value up: a positive float's bits, read as an integer, plus one [IEEE754].
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    up = (v.view(bits) + 1).view(dtype)
    assert precision.spacing(v.item(), fmt) == (up.double() - v.double()).item()


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("value", [1.0, 3.0, 4.0, 1000.0, 0.011, -2.0])
def test_spacing_toward_smaller_is_the_gap_to_the_next_value_down(fmt, value):
    dtype = precision.dtype_of(fmt)
    v = torch.tensor(abs(value), dtype=dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    down = (v.view(bits) - 1).view(dtype)  # the next magnitude down [IEEE754]
    assert precision.spacing(value, fmt, toward="smaller") == (v.double() - down.double()).item()


def test_a_bf16_one_is_lowered_by_a_smaller_step_than_raises_it():
    # the review's measurement (N04-1): 1 - 0.003 moves, 1 + 0.0035 does not
    one = torch.ones((), dtype=torch.bfloat16)
    assert (one - 0.003).item() == 0.99609375 and (one + 0.0035).item() == 1.0
    assert precision.spacing(1.0, "bf16", toward="smaller") / 2 < 0.003
    assert precision.spacing(1.0, "bf16") / 2 > 0.0035
    # the smallest normal's neighbour below is a subnormal, one whole gap away
    tiny = precision.FORMATS["fp16"].smallest_normal
    assert precision.spacing(tiny, "fp16", toward="smaller") == precision.spacing(tiny, "fp16")
    with pytest.raises(ValueError, match="toward"):
        precision.spacing(1.0, "bf16", toward="up")


def test_spacing_refuses_values_outside_the_normal_range():
    with pytest.raises(ValueError, match="not a normal fp16 number"):
        precision.spacing(70000.0, "fp16")
    with pytest.raises(ValueError, match="not a normal fp16 number"):
        precision.spacing(1e-6, "fp16")


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("increment", [0.01, 0.003, 0.1, 2.0**-6, 0.3, 1 / 3])
def test_sum_stall_point_is_where_a_real_running_sum_stops(fmt, increment):
    dtype = precision.dtype_of(fmt)
    x, total = torch.tensor(increment, dtype=dtype), torch.zeros((), dtype=dtype)
    while (grown := total + x) != total:
        total = grown
    assert total.item() == precision.sum_stall_point(increment, fmt)


def test_sum_stall_point_known_values_and_bad_input():
    assert precision.sum_stall_point(0.01, "bf16") == 4.0  # CS336's bf16 sum of 0.01 stalls at 4
    assert precision.sum_stall_point(0.01, "fp16") == 32.0
    with pytest.raises(ValueError, match="positive finite"):
        precision.sum_stall_point(0.0, "bf16")


# --- step times per precision -----------------------------------------------------------------


def test_step_times_trains_a_copy_per_dtype_in_alternated_rounds(monkeypatch):
    from labkit import config, timing, train
    from labkit.model import GPT

    cfg = config.preset("smoke")
    torch.manual_seed(0)
    model = GPT(cfg.model)
    before = copy.deepcopy(model.state_dict())
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2, cfg.model.seq_len), generator=g)
    batches = [(x, torch.roll(x, -1, 1))]
    calls = []
    real_step = train.train_step

    def recording_step(m, *args, dtype, **kwargs):
        calls.append((id(m), dtype, kwargs["scaler"] is not None))
        return real_step(m, *args, dtype=dtype, **kwargs)

    monkeypatch.setattr(train, "train_step", recording_step)
    seen_rounds = []
    real_alternate = timing.alternate
    monkeypatch.setattr(timing, "alternate", lambda fns, **kw: seen_rounds.append(kw) or
                        real_alternate(fns, **kw))  # fmt: skip
    times = precision.step_times(model, cfg.train, batches, device=torch.device("cpu"),
                                 precisions=("float32", "float16"), rounds=3, warmup=1)  # fmt: skip
    assert set(times) == {"float32", "float16"} and all(len(v) == 3 for v in times.values())
    assert all(t > 0 for v in times.values() for t in v)
    assert seen_rounds == [{"rounds": 3, "warmup": 1}]
    assert len({i for i, _, _ in calls}) == 2  # one copy per dtype, 4 steps each
    assert [d for _, d, _ in calls][:4] == ["float32", "float16", "float16", "float32"]
    assert {(d, s) for _, d, s in calls} == {("float32", False), ("float16", True)}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched


def test_step_times_refuses_a_dtype_autocast_would_drop():
    from labkit import config
    from labkit.model import GPT

    cfg = config.preset("smoke")
    x = torch.zeros(1, cfg.model.seq_len, dtype=torch.long)
    with pytest.raises(ValueError, match="autocast is not available"):
        precision.step_times(GPT(cfg.model), cfg.train, [(x, x)], device=torch.device("cpu"),
                             precisions=("float32", "fp8_e4m3"))  # fmt: skip
    with pytest.raises(ValueError, match="batches is empty"):
        precision.step_times(GPT(cfg.model), cfg.train, [], device=torch.device("cpu"))


def test_step_times_modes_add_a_row_run_inside_its_context():
    import contextlib

    from labkit import config
    from labkit.model import GPT

    cfg = config.preset("smoke")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2, cfg.model.seq_len), generator=g)
    entered = []

    @contextlib.contextmanager
    def marked():
        entered.append(torch.is_autocast_enabled("cpu"))
        yield

    times = precision.step_times(GPT(cfg.model), cfg.train, [(x, torch.roll(x, -1, 1))],
                                 device=torch.device("cpu"), precisions=("float32",), rounds=2,
                                 warmup=1, modes={"marked fp32": ("float32", marked)})  # fmt: skip
    assert set(times) == {"float32", "marked fp32"} and len(times["marked fp32"]) == 2
    assert entered == [False, False, False]  # one per step of that row only, warm-up included
    with pytest.raises(ValueError, match="modes"):
        precision.step_times(GPT(cfg.model), cfg.train, [(x, x)], device=torch.device("cpu"),
                             modes={"tf32": "float32"})  # fmt: skip


# --- where a step's time goes -------------------------------------------------------------------


def test_profile_step_finds_the_matmuls_in_the_autocast_dtype():
    from labkit import config
    from labkit.model import GPT

    cfg = config.preset("smoke")
    torch.manual_seed(0)
    model = GPT(cfg.model)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2, cfg.model.seq_len), generator=g)
    batch = (x, torch.roll(x, -1, 1))
    fp32 = precision.profile_step(model, cfg.train, batch, device=torch.device("cpu"),
                                  warmup=1, steps=2)  # fmt: skip
    bf16 = precision.profile_step(model, cfg.train, batch, device=torch.device("cpu"),
                                  dtype="bf16", warmup=1, steps=2)  # fmt: skip
    assert {r.input_dtype for r in fp32.matmuls} == {"float32"}
    assert {r.input_dtype for r in bf16.matmuls} == {"bfloat16"}  # autocast engaged every one
    # the same matmuls per step: 6 Linear layers a block + the head, forward and backward
    assert sum(r.calls for r in fp32.matmuls) == sum(r.calls for r in bf16.matmuls) > 0
    assert bf16.cast_calls > fp32.cast_calls  # autocast's casts of weights and inputs
    assert 0 < fp32.share(fp32.matmul_s + fp32.attention_s + fp32.cast_s) < 1
    assert fp32.kernels == bf16.kernels == ()  # no GPU
    with pytest.raises(ValueError, match="steps"):
        precision.profile_step(model, cfg.train, batch, device=torch.device("cpu"), steps=0)
