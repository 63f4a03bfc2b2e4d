"""Notebook 04's presentation, moved into labkit: what each describe() prints for given inputs,
and what each plot draws. Small models and constructed measurements keep this fast on a CPU."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
import torch
from torch import nn

from labkit import config, data, fp8, hardware, precision, recipes, roofline
from labkit.model import GPT
from labkit.precision import ScalerStep
from labkit.profiling import precision_report as step_speed
from labkit.recordings import show
from labkit.train import History


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def history(losses, val=(3.0,)):
    return History(steps=list(range(1, len(losses) + 1)), loss=list(losses),
                   val_steps=[len(losses)] * len(val), val_loss=list(val))


@pytest.fixture(scope="module")
def smoke():
    cfg = config.preset("smoke").replace(steps=2, eval_every=1)
    torch.manual_seed(0)
    model = GPT(cfg.model)
    splits = data.load_splits()
    x, y = data.get_batch(splits.train, 2, cfg.model.seq_len, torch.Generator().manual_seed(1))
    return cfg, model, splits, (x, y)


# -- precision: formats, sums, autocast -------------------------------------------------------

def test_describe_formats_prints_the_fp16_row_and_the_tf32_note():
    text = precision.describe_formats().splitlines()
    assert text[0].startswith("format    s/e/m bits        max")
    assert ("fp16          1/5/10     65,504        6.104e-05            5.96e-08  0.0009766     2"
            in text)
    assert text[-1] == ("tf32 is defined, not read (no dtype to read); NVIDIA does not document "
                        "its subnormals.")


def test_plot_formats_labels_every_format():
    ax_range, _ = precision.plot_formats()
    assert [t.get_text() for t in ax_range.get_yticklabels()] == list(precision.FORMATS)


def test_running_sums_stall_where_predicted():
    sums = precision.running_sums(0.01, 1000, [("bf16", "bf16"), ("fp16", "fp32")])
    lines = sums.describe().splitlines()
    assert lines[0] == ("bf16                          measured sum 4          stalled at 4 after "
                        "351 additions   predicted stall: 4")
    assert lines[1].startswith("fp16 values, fp32 accumulator measured sum 10.0021")
    assert lines[1].endswith("never stalled                      predicted stall: 262144")
    ax = precision.plot_running_sums(sums)
    assert [ln.get_label() for ln in ax.get_lines()][-1] == "exact"


def test_describe_dtypes_groups_ops_by_kind():
    rows = [precision.DtypeRow("a.q", "Linear", "float32", ("float32",), "bfloat16"),
            precision.DtypeRow("a.k", "Linear", "float32", ("float32",), "bfloat16"),
            precision.DtypeRow("", "F.cross_entropy", None, ("float32", "int64"), "float32")]
    lines = precision.describe_dtypes(rows, device_type="cpu", dtype="bfloat16").splitlines()
    assert lines[0] == "autocast to bfloat16 on cpu, measured on the real model (3 op calls):"
    assert lines[2] == ("Linear                               2  float32  float32                 "
                        "      bfloat16  a.q")
    assert lines[3].endswith("float32, int64                float32   (model)")


def test_describe_here_says_what_each_tier_shows():
    cpu = precision.describe_here("cpu", ("bf16", "fp16"), tier="TIER")
    assert cpu.startswith("TIER\n\nautocast on cpu accepts: bf16, fp16\nThis tier shows the numerics")
    assert "tf32 and fp8 training need an NVIDIA GPU." in cpu
    h100 = precision.describe_here("cuda", ("bf16", "fp16"), tier="T", choice=hardware.autocast_dtype_for((9, 0)))
    assert h100.splitlines()[-2].startswith("training dtype bfloat16: compute capability 9.0")
    assert h100.splitlines()[-1].startswith("This tier shows real GPU numerics and speed")
    assert "(tf32 included)" in h100
    t4 = precision.describe_here("cuda", ("bf16", "fp16"), tier="T", choice=hardware.autocast_dtype_for((7, 5)))
    assert "training dtype float16, with a loss scaler" in t4 and "no bf16 ones" in t4
    assert "bf16 runs are emulated, without tensor cores" in t4 and "tf32" not in t4


# -- precision: training runs -------------------------------------------------------------------

def test_copy_trainer_and_gradients(smoke, capsys):
    cfg, model, splits, batch = smoke
    train_copy = precision.CopyTrainer(model, cfg, splits, torch.device("cpu"))
    trained, h = train_copy("float32", shrink=2.0**-4, validate=False)
    out = capsys.readouterr().out
    assert out.startswith("  trained float32, loss × 2^-4: final loss ")
    assert len(h.loss) == 2 and h.loss[0] > 1  # divided back to the true scale
    grads = precision.fp32_gradients({"untrained": model, "after": trained}, batch,
                                     torch.device("cpu"), n_layer=cfg.model.n_layer)
    text = grads.describe().splitlines()
    n = sum(p.numel() for p in model.parameters())
    assert text[1] == f"fp32 gradients of all {n:,} parameters, cast to fp16 (measured):"
    assert text[2].startswith("  untrained        become 0: ")
    assert "blocks.0.mlp.fc.weight" in grads["after"]
    assert grads.roles("after")[0] == "ln_1.weight"
    assert len(precision.plot_underflow_map(grads, "after")) == 2
    assert precision.plot_gradient_histogram(grads, "after").get_xlabel().startswith("log2")
    acts = precision.activation_gradients(trained, batch, torch.device("cpu"))
    assert acts.ndim == 1 and acts.numel() > 0


def test_describe_roles_names_a_role_below_fp16_subnormals():
    tiny = {"blocks.0.attn.k.bias": torch.tensor([1e-12]), "blocks.0.attn.q.bias": torch.ones(1)}
    grads = precision.Gradients({"m": tiny}, n_layer=1)
    assert grads.describe_roles("m") == ("attn.k.bias: the largest gradient in any layer is 1e-12, "
                                         "below fp16's smallest subnormal")


def test_compare_scaler_judges_the_gap_by_the_yardstick():
    runs = {"fp32": (None, history([4, 3, 3, 3])), "fp16 + scaler": (None, history([4, 3, 3, 3])),
            "fp16, no scaler": (None, history([4, 4, 4, 4]))}
    result = precision.compare_scaler(runs, [history([4, 3.1, 3.1, 3.1])])
    lines = result.describe().splitlines()
    assert lines[1] == ("late training loss (mean of the last fifth of the steps), measured: fp32 "
                        "3.0000, fp16 + scaler 3.0000, fp16, no scaler 4.0000")
    assert lines[2] == "yardstick: three data orders in fp32 span 0.1000 (3.0000, 3.1000)"
    assert lines[3] == ("fp16 without a scaler vs with: +1.0000, larger than the data-order "
                        "spread")
    assert precision.late_loss(history([9, 1, 2, 3])) == 2


def test_shrink_result_says_who_falls_behind():
    shrunk = {(12, "fp32"): history([3, 3, 3]), (12, "fp16 + scaler"): history([3, 3, 3]),
              (12, "fp16, no scaler"): history([5, 5, 5])}
    result = precision.ShrinkResult(shrunk, history([3, 3, 3]), 0.1, torch.ones(4),
                                    lambda t: 0.5, "the reference")
    lines = result.describe().splitlines()
    assert lines[0].endswith("× 2^-0: 50.0%, × 2^-4: 50.0%, × 2^-8: 50.0%, × 2^-12: 50.0%, "
                             "× 2^-16: 50.0%")
    assert lines[1] == ("k = 12: control: fp32 with the loss × 2^-12 ends 0.0000 from fp32 × 1 "
                        "(within the yardstick: the shrink itself changes nothing)")
    assert lines[2] == ("        late loss fp32 3.000, fp16 + scaler 3.000, fp16 without 5.000 → "
                        "fp16 without a scaler falls behind (gap +2.000)")
    assert lines[3].endswith("zeroes: 50.0%, against 50.0% at × 1 (the reference)")
    assert len(precision.plot_shrink(result).get_lines()) == 4


def test_late_losses_and_curves():
    runs = {"fp32": (None, history([3, 3, 3], val=(2.5,))),
            "bf16": (None, history([3.5, 3.5, 3.5], val=(2.6,)))}
    lines = precision.LateLosses(runs, 0.1).describe().splitlines()
    assert lines[1] == "  fp32             3.0000 (+0.0000)                       validation 2.5000"
    assert lines[2] == "  bf16             3.5000 (+0.5000) beyond the yardstick  validation 2.6000"
    ax_train, ax_val = precision.plot_loss_curves(runs)
    assert len(ax_train.get_lines()) == 2 and ax_val.get_title() == "validation loss (measured)"


def test_gain_prediction_and_stuck_parameters():
    prediction = precision.GainPrediction(lr=0.003)
    assert prediction.describe().endswith("peak lr 0.003, so the LayerNorm gains can move down "
                                          "but not up")

    class Tiny(nn.Module):
        def __init__(self, gain):
            super().__init__()
            self.ln_1 = nn.LayerNorm(2)
            self.fc = nn.Linear(2, 2)
            with torch.no_grad():
                self.ln_1.weight.copy_(torch.tensor(gain))

    initial = Tiny([1.0, 1.0])
    moved_up = Tiny([1.0, 1.5])
    result = precision.stuck_parameters({"pure bf16": (moved_up, history([3, 3, 3]))}, initial,
                                        prediction, baseline=history([3, 3, 3]))
    lines = result.describe().splitlines()
    assert lines[0] == "measured: share of parameters still exactly at their initial value after 3 steps"
    assert lines[1].startswith("  pure bf16                    LayerNorm gains 50%, LayerNorm biases 100%")
    assert lines[2].endswith("LayerNorm gains that moved: 0 down, 1 up, of 2")
    assert lines[3] == ("the pure-bf16 split does not match the prediction: some step was larger "
                        "than the peak lr (predicted: the gains can move down but not up)")


def test_scaler_race_describes_its_backoffs():
    settings = {"init_scale": 4.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                "growth_interval": 1}
    steps = (ScalerStep(1, 4.0, False), ScalerStep(2, 8.0, True))
    race = precision.ScalerRace(settings, steps, 4.0, (8.0, 4.0), 0.0, on_gpu=False)
    lines = race.describe().splitlines()
    assert lines[0] == "2 fp16 steps, measured: 1 skipped (inf/NaN found) at steps [2]"
    assert lines[1].startswith("ManualScaler and torch.amp.GradScaler chose the same scale")
    other = precision.ScalerRace(settings, steps, 4.0, (8.0, 8.0), 0.0, on_gpu=False)
    assert other.describe().splitlines()[1].startswith(
        "ManualScaler and GradScaler chose different scales from step 2: on a CPU that is a bug")
    back = race.describe_backoffs().splitlines()
    assert back[0].startswith("The scale grew ×2 after every 1 clean steps, from 2^16 to 2^3 at "
                              "step 2")
    assert back[2] == "Steps that overflowed at or below GradScaler's default initial scale 2^16: none"
    clean = precision.ScalerRace(settings, steps[:1], 8.0, (8.0,), 0.0, on_gpu=False)
    assert clean.describe_backoffs().startswith("No step overflowed: the scale only grew, to 2^3.")
    assert len(precision.plot_scale(race).get_lines()) == 2


def test_race_scalers_agree_on_a_cpu(smoke):
    cfg, model, splits, _ = smoke
    race = precision.race_scalers(model, cfg.replace(eval_every=0), splits, torch.device("cpu"),
                                  {"init_scale": 2.0**16, "growth_interval": 1})
    assert race.describe().splitlines()[1].startswith(
        "ManualScaler and torch.amp.GradScaler chose the same scale after every step")


# -- recipes ------------------------------------------------------------------------------------

def test_recipes_described_and_plotted(smoke):
    _, model, _, batch = smoke
    measured = {name: recipes.measure_recipe(recipes.RECIPES[name], model, [batch], "cpu")
                for name in ("fp32_adamw", "pure_bf16")}
    lines = recipes.describe_measured(measured).splitlines()
    n = sum(p.numel() for p in model.parameters())
    assert lines[0] == f"bytes per parameter, {n:,}-parameter GPT on cpu:"
    assert lines[2] == "fp32_adamw                      16     16.00"
    assert lines[3] == "pure_bf16                        8      8.00"
    assert "  16 B  fp32_adam" in recipes.describe_measured(measured)
    ax = recipes.plot_measured(measured)
    assert ax.get_xlabel() == "bytes per parameter"


def test_describe_fsdp2_against_a_recipe():
    fsdp = recipes.FSDP2Measurement(
        param_dtype="bfloat16", reduce_dtype="float32", world_size=1, n_local=10,
        persistent={"parameters": 40, "gradients": 40, "optimizer_state": 80, "other": 0},
        dtypes={"parameters": ("float32",), "gradients": ("float32",),
                "optimizer_state": ("float32",), "other": ()},
        step_counters=8, gathered_params=10, gathered_grads=5, gathered_where="backward",
        unsharded_grad_dtypes=("bfloat16",))

    class Amp:
        autocast_copies, n_params = 20, 10

    lines = recipes.describe_fsdp2(fsdp, {"amp_bf16": recipes.RECIPES["amp_bf16"]},
                                   amp=Amp()).splitlines()
    assert lines[1] == "  parameters        4.00 B per parameter  (40 bytes; float32)"
    assert lines[4] == "  other             0.00 B per parameter  (0 bytes; nothing)"
    assert lines[6].startswith("against amp_bf16: FSDP2 holds what amp_bf16 predicts")
    assert lines[8] == ("transient bf16 weights at their peak (measured): FSDP2 1.00 B per "
                        "parameter (backward; with 0.50 B per parameter of bfloat16 gradients "
                        "not yet reduce-scattered), AMP 2.00 (autocast's copies, kept from "
                        "forward to backward)")
    assert lines[9] == "FSDP2 held fewer bf16 weight bytes at its peak than AMP."


def test_step_dtypes_and_activations(smoke):
    cfg, model, _, batch = smoke
    assert recipes.step_dtypes(model, cfg.train, batch, torch.device("cpu")).describe() == (
        "after one fp16 autocast step (measured): parameter dtypes ['torch.float32'], AdamW "
        "state dtypes ['torch.float32']\ngradient dtypes after an fp16 backward: "
        "['torch.float32']: the backward of autocast's cast returns each gradient in its "
        "parameter's dtype, so fp32 weights get fp32 gradients")
    result = recipes.autocast_activations(model, cfg, batch, torch.device("cpu"),
                                          ["float32", "bfloat16"])
    lines = result.describe().splitlines()
    assert lines[0].startswith("float32   activations: predicted ")
    assert lines[2].startswith("bfloat16 / float32: predicted 0.")
    fixed = recipes.AutocastActivations({"float32": 2**21, "bfloat16": 2**20},
                                        {"float32": 2**21, "bfloat16": 2**20})
    assert fixed.describe().splitlines()[2] == "bfloat16 / float32: predicted 0.50, measured 0.50"


# -- roofline and the step's speed --------------------------------------------------------------

def _ceiling(value, unit, prec=None):
    return roofline.Ceiling(value=value, unit=unit, precision=prec, device_name="test CPU",
                            kind="measured", method="by hand", device="cpu",
                            when="2026-01-01T00:00:00+00:00")


def _sweep(times):
    rows = tuple(roofline.SweepRow(p, n, (s,)) for (p, n), s in times.items())
    return roofline.MatmulSweep(rows, "cpu", "test CPU", "now", "by hand", None)


def test_plot_sweep_and_place_kernels():
    sweep = _sweep({("float32", 64): 1e-4, ("float32", 128): 1e-3,
                    ("bfloat16", 64): 2e-4, ("bfloat16", 128): 5e-4})
    assert len(roofline.plot_sweep(sweep).get_lines()) == 2
    roof = roofline.Roofline(compute=(_ceiling(1e12, roofline.FLOPS, "float32"),
                                      _ceiling(1e12, roofline.FLOPS, "bfloat16")),
                             bandwidth=_ceiling(1e3, roofline.BYTES))
    placed = roofline.place_kernels(roof, sweep, ["float32", "bfloat16"], torch.device("cpu"),
                                    n_elem=1024)
    lines = placed.describe().splitlines()
    assert lines[0].startswith("float32 n=64 (vs float32 roof)       intensity    10.7 FLOP/B")
    assert len(placed.points) == 6 and placed.published_ceilings == ()
    # a bandwidth of 1 kB/s: the elementwise product runs far above that roof
    assert any(line.startswith("A point above 105% of its roof (memory)") for line in lines)
    assert lines[-1].startswith("elementwise a*b of 1,024 values, best of 5 (measured): fp32 ")


def test_step_times_describe_and_case():
    steps = step_speed.StepTimes({"float32": [0.010] * 5, "bfloat16": [0.020] * 5}, 512,
                                 "measured here", "cpu", "smoke", "smoke")
    lines = steps.describe().splitlines()
    assert lines[0] == "training step, 512 tokens, measured in alternated rounds (measured here):"
    assert lines[1] == "  float32        51,200 tokens/s  = 1 × fp32"
    assert lines[2] == "  bfloat16       25,600 tokens/s  = 0.5 × fp32"
    assert lines[-1].startswith("verdict: float32 is faster than bfloat16")
    assert steps.medians == {"float32": 0.010, "bfloat16": 0.020}
    gpu = step_speed.StepTimes({"float32": [0.01] * 3}, 8, "x", "cuda", "lab", "lab")
    assert gpu.describe().splitlines()[-1].startswith("size='lab' times the 'lab' model on this GPU")
    sweep = _sweep({("float32", 64): 1.0, ("float32", 256): 1.0,
                    ("bfloat16", 64): 2.0, ("bfloat16", 256): 0.5})
    assert step_speed.describe_case(sweep, steps, width=64) == (
        "bfloat16: matmuls ran 2× fp32 at n=256, but 0.5× at n=64; the step ran at 0.5× fp32: its "
        "matmuls are small, and the ops and casts around them do not get faster (the profile "
        "above says which grew).")


def test_profile_steps_keeps_the_least_disturbed(monkeypatch):
    def fake(step_s, matmul_s, dtype):
        row = precision.OpRow("aten::mm", dtype, 3, matmul_s)
        return precision.StepProfile(dtype, "cpu", step_s, (row,), 0.0, 0.0, 0, ())

    made = iter([fake(0.010, 0.005, "float32"), fake(0.030, 0.002, "bfloat16"),
                 fake(0.008, 0.004, "float32"), fake(0.040, 0.002, "bfloat16")])
    monkeypatch.setattr(precision, "profile_step", lambda *a, **k: next(made))
    steps = step_speed.StepTimes({"float32": [0.01] * 3, "bfloat16": [0.02] * 3}, 8, "x")
    result = step_speed.profile_precisions(None, None, None, steps, ["float32", "bfloat16"],
                                      device=torch.device("cpu"), rounds=2)
    lines = result.describe().splitlines()
    assert lines[1] == ("  float32      8.00 ms: matmuls 50%, attention 0%, casts 0%, "
                        "everything else 50%")
    assert lines[3].startswith("  bfloat16    30.00 ms")
    assert lines[6] == ("Amdahl: matmuls and attention are 50% of the fp32 step, so 16-bit "
                        "arithmetic can make this step at most 2× faster (predicted from the "
                        "measured shares)")
    assert lines[7] == ("bfloat16: autocast engaged every matmul. Against fp32 the everything "
                        "else grew most (24.00 ms more a step), the matmuls took 2.00 ms less; the "
                        "timed step ran at 0.5× fp32's speed: slower, so what grew decides.")


def test_step_times_beside_without_recordings():
    text = show.step_times_beside({"float32": [0.01] * 3, "tf32": [0.01] * 3}, preset="smoke",
                                  device="cpu", tokens_per_step=8, dtypes=["float32"],
                                  recordings=[])
    assert text.startswith(show.NONE_SHIPS)


# -- fp8 ------------------------------------------------------------------------------------------

def test_fp8_tables(smoke):
    _, model, _, batch = smoke
    grads = {n: torch.randn_like(p) * 1e-6 for n, p in model.named_parameters()}
    tensors = fp8.gpt_tensors(model, batch, grads)
    assert list(tensors) == ["MLP input, layer 0 (activation)", "MLP weight, layer 0",
                             "MLP weight gradient, layer 0", "all gradients"]
    rows = [{"name": "w", "format": "fp8_e4m3", "scaled": True, "scale": 2.0,
             "rel_rms_error": 0.025, "flushed_to_zero": 0.5, "overflow": 0.0}]
    assert fp8.describe_error_table(rows).splitlines()[1] == (
        "w                               fp8_e4m3  yes              2           0.025   50.0%"
        "      0.0%")
    text = fp8.describe_scaling_errors({"all gradients": tensors["all gradients"]})
    assert text.splitlines()[1].startswith("all gradients                   unscaled")
    assert text.splitlines()[-1].startswith("all gradients under one scale: ")


def test_train_fp8_says_why_not_on_a_cpu(smoke):
    cfg, model, splits, _ = smoke
    result = fp8.train_fp8(model, cfg, splits, torch.device("cpu"), bf16=None)
    assert result.describe().startswith("fp8 training does not run here: device 'cpu' is not a "
                                        "CUDA device")
    assert result.describe().endswith("Nothing below is measured, and no fp8 speed or loss is "
                                      "shown in its place.")
