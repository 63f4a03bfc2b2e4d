"""fp8: what casting to 8-bit floats does to real tensors, and real fp8 training where it runs.

Two parts, kept apart:

1. Numerics, on any machine (``tensorwise_scale``, ``round_trip``, ``measure_fp8_error``,
   ``fp8_error_table``): cast a tensor to e4m3 or e5m2, with and without a per-tensor scale,
   back to fp32, and measure what was lost: relative RMS error, values flushed to zero, values
   out of range (and what the cast made of them: ±max, inf or NaN).
2. Training (``fp8_training_support``, ``convert_for_fp8_training``): torchao's float8
   training swaps ``nn.Linear`` layers for ``Float8Linear``, whose matmuls run on fp8 tensor
   cores. Those exist from compute capability 8.9 (Ada, Hopper, Blackwell); elsewhere this
   module says why not and refuses, never falling back to bf16 while calling it fp8.

Why scale: e4m3 spans only about 2**-9 to 448, e5m2 2**-16 to 57,344 [FP8]. Gradients of a
small GPT sit near 1e-5 and would mostly flush to zero. Multiplying a tensor by
``fp8 max / amax`` before the cast puts its largest value at the top of the range and uses
all of it; dividing by the same scale afterwards gives back the original magnitude [FP8, §3;
torchao-README, "tensorwise scaling"]. The scale is kept in fp32 beside the fp8 data.

What ``tensor.to(torch.float8_*)`` does with a value beyond the format's max, in the torch this
was written against (2.13; torch/headeronly/util/Float8_e4m3fn.h and Float8_e5m2.h,
``fp8e4m3fn_from_fp32_value`` / ``fp8e5m2_from_fp32_value``), checked by casting:

* e4m3fn has no infinity: a finite overflow *and* ±inf saturate to ±448; NaN stays NaN.
* e5m2 has infinities (IEEE-like): anything from 61,440 up (halfway past 57,344) becomes ±inf.

Older torch behaved differently: torchao notes that up to torch 2.11 eager casts to fp8 did
not saturate finite overflow (torchao/float8/float8_utils.py, ``to_fp8_saturated``), e4m3fn
then giving NaN. So the error report *measures* what each overflowing value became instead of
assuming, and the scaled cast clamps to ±max first, as torchao does.

Importing this module touches no device and does not import torchao (its import loads CUDA
extension libraries and, on a CPU, prints that it could not); that happens only when fp8
training is asked for.

Sources cited below:
    [FP8]      Micikevicius et al. 2022, "FP8 Formats for Deep Learning", arXiv 2209.05433:
               e4m3 for weights and activations, e5m2 for gradients; per-tensor scaling.
    [OFP8]     Open Compute Project, "OCP 8-bit Floating Point Specification (OFP8)", rev. 1.0
               (2023): e4m3 has no infinities and saturates in its conversions' "saturation
               mode"; e5m2 follows IEEE 754 with infinities.
    [torchao-README]  pytorch/ao, torchao/float8/README.md: convert_to_float8_training,
               tensorwise scaling (the default recipe), the module_filter_fn example that skips
               Linear layers whose dims are not divisible by 16.
    [torchao-src]  pytorch/ao 0.18.0, torchao/float8/float8_utils.py (``amax_to_scale``:
               scale = finfo(fp8).max / clamp(amax, min=1e-12), computed in float64, stored as
               float32; ``to_fp8_saturated``), float8_training_tensor.py (x_fp8 = saturate(x ·
               scale), x ≈ x_fp8 / scale), float8_linear_utils.py (``convert_to_float8_training``,
               ``_auto_filter_for_tensorwise``: "All dims must be divisible by 16 due to float8
               hardware requirements").
    [MX]       Open Compute Project, "OCP Microscaling Formats (MX) Specification", v1.0 (2023):
               blocks of k = 32 elements share one E8M0 (power-of-two) scale; §6.3 computes
               the shared exponent as floor(log2 amax) minus the element format's emax.
    [MXFP8-recipe]  Mishra et al. (NVIDIA) 2025, "Recipes for Pre-training LLMs with MXFP8",
               arXiv 2506.08027: round the E8M0 scale up (amax / max toward +inf) so that no
               value saturates; NVIDIA Transformer Engine implements it (``float_to_e8m0``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from labkit.precision import FORMATS, autocast_formats, dtype_of, format_name
from labkit.validate import whole

FP8_FORMATS = ("fp8_e4m3", "fp8_e5m2")
"""The two fp8 formats [FP8, OFP8], in labkit.precision's short names."""

TORCHAO_VERSION = "0.18.0"
"""The torchao version requirements.txt pins (tests/test_fp8.py checks they agree)."""

MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first GPUs with fp8 tensor cores (Ada sm_89; Hopper 9.0)."""

EPS = 1e-12
"""Lower clamp on amax before dividing by it, torchao's ``EPS`` [torchao-src]: an all-zero
tensor gets a large finite scale rather than inf."""

DIMS_MULTIPLE = 16
"""fp8 matmuls (``torch._scaled_mm``) need both dims of a Linear's weight divisible by 16
[torchao-README, torchao-src]."""


def _fp8_name(fmt: str | torch.dtype) -> str:
    short = format_name(fmt)
    if short not in FP8_FORMATS:
        raise ValueError(f"fmt={fmt!r} is not an fp8 format; allowed: {', '.join(FP8_FORMATS)}")
    return short


# ----------------------------------------------------------------------------------------------
# Numerics


def tensorwise_scale(x: torch.Tensor, fmt: str | torch.dtype) -> float:
    """The per-tensor scale torchao's tensorwise recipe uses: ``fp8 max / max(amax, 1e-12)``.

    Computed in float64 and rounded to float32, as ``torchao.float8.float8_utils.amax_to_scale``
    does (so eager and compiled code agree) [torchao-src]. amax is ``max(|x|)``.
    """
    dtype = dtype_of(_fp8_name(fmt))
    amax = x.detach().abs().max().double()
    scale = torch.finfo(dtype).max / torch.clamp(amax, min=EPS)
    return float(scale.float())


def _cast(x: torch.Tensor, short: str, scale: float | None) -> torch.Tensor:
    """The fp8 values of ``x`` (times ``scale``), as fp32 for arithmetic: see round_trip."""
    dtype = dtype_of(short)
    x = x.detach().float()
    if scale is None:
        return x.to(dtype).float()
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale!r}: must be a positive finite number "
                         "(tensorwise_scale(x, fmt) gives torchao's)")  # fmt: skip
    fp8_max = torch.finfo(dtype).max
    # The clamp only matters for a scale that does not come from this tensor's amax (a stale
    # or hand-picked one); torchao clamps because older torch turned overflow into NaN.
    return (x * scale).clamp(-fp8_max, fp8_max).to(dtype).float()


def round_trip(x: torch.Tensor, fmt: str | torch.dtype, scale: float | None = None) -> torch.Tensor:
    """``x`` cast to fp8 and back to fp32: what survives of it.

    ``scale=None``: the plain cast ``x.float().to(fp8)``, whatever torch does with values out
    of range (see the module docstring). With a scale: torchao's recipe [torchao-src],
    ``(x · scale)`` clamped to ±max, cast, then divided by the scale again.
    """
    q = _cast(x, _fp8_name(fmt), scale)
    return q if scale is None else q / scale


def overflow_threshold(fmt: str | torch.dtype) -> float:
    """Where overflow starts: max + half a unit in the last place at max.

    Below it, rounding to nearest lands on max, as in any binary format (IEEE 754 §7.4 counts
    overflow after rounding); from it on (ties included) it rounds past max. e4m3: 448 + 16 = 464;
    e5m2: 57,344 + 4,096 = 61,440. Values between max and here are not overflow: a tensorwise
    scale in fp32 can put amax a hair above max.
    """
    f = FORMATS[_fp8_name(fmt)]
    ulp_at_max = 2.0 ** math.floor(math.log2(f.max)) * f.eps
    return f.max + ulp_at_max / 2


@dataclass(frozen=True)
class Fp8Error:
    """What one cast to fp8 (and back) did to one tensor. Fractions are of the tensor's nonzero
    values (exact zeros survive any cast and are left out), 0..1."""

    name: str
    """The tensor's name ("blocks.0.mlp.fc input", "lm_head.weight grad")."""
    format: str
    """"fp8_e4m3" or "fp8_e5m2"."""
    scaled: bool
    """True: multiplied by ``scale`` before the cast (tensorwise); False: cast as it is."""
    scale: float
    """The factor used (1.0 when not scaled)."""
    amax: float
    """max(|x|) of the original tensor."""
    rel_rms_error: float
    """sqrt(sum((x' - x)²) / sum(x²)), x' the round trip; inf or NaN when the cast made any."""
    flushed_to_zero: float
    """Nonzero values that came back as exactly 0 (underflow)."""
    overflow: float
    """Values (after scaling) from :func:`overflow_threshold` on: no fp8 value is near them."""
    to_max: float
    """Overflowing values that came back as ±max (saturated)."""
    to_inf: float
    """Overflowing values that came back as ±inf."""
    to_nan: float
    """Overflowing values that came back as NaN."""
    count: int
    """Nonzero values judged."""


def measure_fp8_error(
    x: torch.Tensor, fmt: str | torch.dtype, *, scaled: bool, name: str = ""
) -> Fp8Error:
    """Cast ``x`` to ``fmt`` (scaled by :func:`tensorwise_scale` or not) and measure the loss.

    Everything is measured on the cast itself, not predicted from thresholds. ``x`` must be a
    finite floating-point tensor (a non-finite one has no relative error to speak of).
    """
    short = _fp8_name(fmt)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name or 'tensor'}: must be a floating-point torch.Tensor, got {got}")
    x = x.detach().float().flatten()
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name or 'tensor'} has inf or NaN values: measure a finite tensor "
                         "(activations and gradients of a healthy fp32 step)")  # fmt: skip
    fp8_max = FORMATS[short].max
    scale = tensorwise_scale(x, short) if scaled else 1.0
    q = _cast(x, short, scale if scaled else None)  # the fp8 values, before unscaling
    back = q / scale

    nonzero = x != 0
    count = int(nonzero.sum())
    went_inf, went_nan = q.isinf(), q.isnan()
    over = ((x.double() * scale).abs() >= overflow_threshold(short)) | went_inf | went_nan

    def frac(mask: torch.Tensor) -> float:
        return int(mask.sum()) / count if count else math.nan

    sum_sq = float((x.double() ** 2).sum())
    err_sq = float(((back.double() - x.double()) ** 2).sum())
    return Fp8Error(
        name=name,
        format=short,
        scaled=scaled,
        scale=scale,
        amax=float(x.abs().max()) if x.numel() else 0.0,
        rel_rms_error=math.sqrt(err_sq / sum_sq) if sum_sq > 0 else math.nan,
        flushed_to_zero=frac(nonzero & (back == 0)),
        overflow=frac(over),
        to_max=frac(over & (q.abs() == fp8_max)),
        to_inf=frac(went_inf),
        to_nan=frac(went_nan),
        count=count,
    )


def fp8_error_table(
    tensors: Mapping[str, torch.Tensor],
    formats: Iterable[str] = FP8_FORMATS,
    scalings: Iterable[bool] = (False, True),
) -> list[dict[str, Any]]:
    """:func:`measure_fp8_error` for every named tensor × format × scaling, as rows (dicts in
    that order), ready for pandas or printing: e4m3 against e5m2, unscaled against scaled."""
    formats, scalings = list(formats), list(scalings)
    return [
        dataclasses.asdict(measure_fp8_error(t, fmt, scaled=s, name=name))
        for name, t in tensors.items()
        for fmt in formats
        for s in scalings
    ]


# ----------------------------------------------------------------------------------------------
# Block scaling (the OCP Microscaling formats), simulated

MX_BLOCK = 32
"""Elements that share one scale in the MX formats [MX, §5: k = 32 for every MX format]."""


def mx_round_trip(x: torch.Tensor, fmt: str | torch.dtype = "fp8_e4m3", block: int = MX_BLOCK,
                  rounding: str = "up") -> torch.Tensor:  # fmt: skip
    """``x`` cast to an MX format and back: every ``block`` consecutive values (the tensor
    flattened, zero-padded to a whole block) share one power-of-two scale X, stored as an
    E8M0 exponent (clamped to 2**-127..2**127), and each value V/X is cast to fp8 with
    saturation to ±max [MX, §5].

    ``rounding`` picks the scale of a block with largest magnitude amax:

    * ``"down"``, the spec's conversion [MX, §6.3]: X = 2**(floor(log2 amax) - emax), emax
      the exponent of the element format's largest normal (8 for e4m3, max 448 = 1.75·2**8).
      amax/X then lies in [2**emax, 2**(emax+1)), up to 511.9 for e4m3: a block's largest
      values can saturate at 448, losing up to 12.5 % of their size.
    * ``"up"``, NVIDIA's MXFP8 recipe [MXFP8-recipe; TE's ``float_to_e8m0`` of amax / max,
      rounded toward +inf]: X = 2**ceil(log2(amax / max)), so nothing saturates, at the cost
      of up to one binade of range left unused at the bottom.

    A block of zeros keeps X = 1. This simulates the numerics only: nothing here runs on MX
    hardware, and it says nothing about speed.
    """
    short = _fp8_name(fmt)
    block = whole("block", block, low=1, why="elements")
    if rounding not in ("up", "down"):
        raise ValueError(f"rounding={rounding!r} is not allowed: 'up' (NVIDIA's MXFP8 recipe) "
                         "or 'down' (the OCP MX v1.0 conversion)")  # fmt: skip
    dtype = dtype_of(short)
    fp8_max = torch.finfo(dtype).max
    flat = x.detach().float().flatten()
    pad = (-flat.numel()) % block
    blocks = torch.cat([flat, flat.new_zeros(pad)]).view(-1, block)
    amax = blocks.abs().amax(dim=1, keepdim=True).double()
    safe = amax.clamp(min=2.0**-160)
    if rounding == "down":
        exponent = torch.floor(torch.log2(safe)) - math.floor(math.log2(fp8_max))
    else:
        exponent = torch.ceil(torch.log2(safe / fp8_max))
    exponent = torch.where(amax > 0, exponent, torch.zeros_like(exponent)).clamp(-127, 127)
    scale = torch.exp2(exponent).float()
    q = (blocks / scale).clamp(-fp8_max, fp8_max).to(dtype).float() * scale
    return q.flatten()[: flat.numel()].view_as(x)


def scaling_errors(x: torch.Tensor, fmt: str | torch.dtype = "fp8_e4m3",
                   block: int = MX_BLOCK) -> dict[str, dict[str, float]]:  # fmt: skip
    """Relative RMS error, the median relative error of one value, and the share of nonzero
    values flushed to zero, for one tensor cast
    to ``fmt`` four ways: unscaled, one scale per tensor (torchao's tensorwise), and one
    power-of-two scale per ``block`` values (:func:`mx_round_trip`), rounded down as the OCP
    spec converts and up as NVIDIA's MXFP8 recipe does. Measured by casting."""
    x = x.detach().float()
    nonzero = x != 0
    if not bool(nonzero.any()):
        raise ValueError("x has no nonzero value: there is no error to measure")
    out = {}
    for how, back in (("unscaled", round_trip(x, fmt)),
                      ("per tensor", round_trip(x, fmt, tensorwise_scale(x, fmt))),
                      (f"per {block}-block, scale rounded down (OCP MX v1.0)",
                       mx_round_trip(x, fmt, block, rounding="down")),
                      (f"per {block}-block, scale rounded up (MXFP8 recipe)",
                       mx_round_trip(x, fmt, block, rounding="up"))):  # fmt: skip
        err = (back - x).double()
        out[how] = {
            # dominated by the largest values: what a matmul's sum mostly sees
            "rel_rms_error": float(err.pow(2).sum().sqrt() / x.double().pow(2).sum().sqrt()),
            # the typical value's own error, small values counted as much as large ones
            "median_rel_error": float((err.abs() / x.double().abs())[nonzero].median()),
            "flushed_to_zero": float(((back == 0) & nonzero).sum() / nonzero.sum()),
        }
    return out


# ----------------------------------------------------------------------------------------------
# Training


def _import_torchao_float8() -> tuple[Any, type]:
    """torchao's ``convert_to_float8_training`` and ``Float8Linear``, imported only now (see
    the module docstring)."""
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    return convert_to_float8_training, Float8Linear


def fp8_training_support(device: str | torch.device, *, cuda: Any | None = None) -> str | None:
    """None when torchao's fp8 training can run on ``device``, else the reason it cannot.

    Needs: a CUDA device of compute capability ≥ 8.9 (fp8 tensor cores: Ada, Hopper,
    Blackwell), a torch with the fp8 dtypes, and torchao importable. ``cuda`` stands in for
    ``torch.cuda`` (tests).
    """
    cuda = torch.cuda if cuda is None else cuda
    device = torch.device(device)
    need = f"fp8 training needs an NVIDIA GPU of compute capability >= {MIN_CAPABILITY[0]}." \
           f"{MIN_CAPABILITY[1]} (Ada, Hopper, Blackwell)"  # fmt: skip
    if device.type != "cuda":
        return f"device {str(device)!r} is not a CUDA device: {need}"
    if getattr(torch.version, "hip", None):
        return f"this torch is a ROCm build ({torch.version.hip}): {need}"
    if not cuda.is_available():
        return f"torch.cuda.is_available() is False (no GPU, or a CPU build of torch): {need}"
    index = device.index if device.index is not None else cuda.current_device()
    if index >= cuda.device_count():
        return f"device {str(device)!r}: there are {cuda.device_count()} CUDA device(s)"
    capability = tuple(cuda.get_device_capability(index))
    if capability < MIN_CAPABILITY:
        return (f"{cuda.get_device_name(index)} has compute capability "
                f"{capability[0]}.{capability[1]} < {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: "
                f"{need}")  # fmt: skip
    for name in FP8_FORMATS:
        try:
            dtype_of(name)
        except ValueError as e:
            return str(e)
    try:
        _import_torchao_float8()
    except ImportError as e:
        return (f"torchao is not importable ({e}): install the tested version with "
                f"`pip install torchao=={TORCHAO_VERSION}` (requirements.txt)")  # fmt: skip
    return None


@dataclass(frozen=True)
class Fp8Conversion:
    """What :func:`convert_for_fp8_training` did."""

    model: nn.Module
    """The converted model (the same object, changed in place)."""
    converted: tuple[str, ...]
    """Names of the Linear layers now ``torchao.float8.Float8Linear``."""
    left_out: dict[str, str]
    """Linear layers left in high precision, with the reason."""


def convert_for_fp8_training(model: nn.Module, device: str | torch.device) -> Fp8Conversion:
    """Swap the model's eligible ``nn.Linear`` layers for torchao's ``Float8Linear``.

    Uses ``torchao.float8.convert_to_float8_training`` with its default config (dynamic
    tensorwise scaling: e4m3 for inputs and weights, e5m2 for gradients [torchao-README]).
    A Linear whose weight dims are not both multiples of 16 is left out. Unlike torchao's
    auto-filter this keeps small layers: a lab-sized GPT would otherwise convert nothing
    (torchao skips them for speed, not correctness).

    Raises ValueError where fp8 training cannot run (see :func:`fp8_training_support`), and
    when no layer qualifies: a model with nothing in fp8 is not an fp8 run.
    """
    reason = fp8_training_support(device)
    if reason is not None:
        device_type = torch.device(device).type
        allowed = [f"{f} autocast" for f in autocast_formats(device_type)] + ["fp32"]
        raise ValueError(
            f"fp8 training asked for on device {str(device)!r}, but {reason}. Allowed on "
            f"{device_type!r}: {', '.join(allowed)} (labkit.precision.checked_autocast); the "
            "fp8 cast numerics (labkit.fp8.fp8_error_table) run on any device."
        )
    if isinstance(model, nn.Linear):
        raise ValueError("model is a bare nn.Linear, which torchao replaces instead of "
                         "changing in place: wrap it in a module (nn.Sequential(linear))")  # fmt: skip
    left_out = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            out_f, in_f = module.weight.shape
            if out_f % DIMS_MULTIPLE or in_f % DIMS_MULTIPLE:
                left_out[name] = (f"weight is {out_f}x{in_f}; fp8 matmuls need both dims "
                                  f"divisible by {DIMS_MULTIPLE}")  # fmt: skip

    def eligible(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and fqn not in left_out

    convert_to_float8_training, Float8Linear = _import_torchao_float8()
    convert_to_float8_training(model, module_filter_fn=eligible)
    converted = tuple(n for n, m in model.named_modules() if isinstance(m, Float8Linear))
    if not converted:
        raise ValueError(
            "no nn.Linear of the model qualifies for fp8 (both weight dims divisible by "
            f"{DIMS_MULTIPLE}): {left_out or 'it has none'}. Choose d_model, vocab_size and the "
            "MLP width as multiples of 16."
        )
    return Fp8Conversion(model=model, converted=converted, left_out=left_out)


# ----------------------------------------------------------------------------------------------
# Presentation (notebook 04, section 8)


def gpt_tensors(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors notebook 04 casts to fp8: the first MLP's input (an activation, captured in
    one forward of ``model`` on ``batch``), its weight, that weight's gradient, and all the
    gradients (``grads``: parameter name → gradient) concatenated."""
    fc = model.blocks[0].mlp.fc
    captured = {}
    hook = fc.register_forward_hook(
        lambda module, args, out: captured.update({"MLP input, layer 0 (activation)": args[0].detach()}))
    try:
        with torch.no_grad():
            model(*batch)
    finally:
        hook.remove()
    return {
        **captured,
        "MLP weight, layer 0": fc.weight.detach(),
        "MLP weight gradient, layer 0": grads["blocks.0.mlp.fc.weight"],
        "all gradients": torch.cat([v.flatten() for v in grads.values()]),
    }


def describe_error_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """:func:`fp8_error_table`'s rows as text: scale, relative RMS error, the share flushed to
    zero and the share that overflowed, per tensor, format and scaling."""
    lines = [f"{'tensor':<32}{'format':<10}{'scaled':<8}{'scale':>10}{'rel. RMS error':>16}"
             f"{'→ 0':>8}{'overflow':>10}"]
    lines.extend(f"{r['name']:<32}{r['format']:<10}{'yes' if r['scaled'] else 'no':<8}"
                 f"{r['scale']:>10.3g}{r['rel_rms_error']:>16.3g}{r['flushed_to_zero']:>8.1%}"
                 f"{r['overflow']:>10.1%}" for r in rows)
    return "\n".join(lines)


def describe_scaling_errors(tensors: Mapping[str, torch.Tensor], fmt: str = "fp8_e4m3",
                            together: str = "all gradients") -> str:
    """:func:`scaling_errors` of every tensor as text, then whether block scales keep values of
    ``tensors[together]`` that one tensor-wide scale flushes to zero (measured)."""
    lines = [f"{'tensor':<32}{'scaling (e4m3)':<52}{'rel. RMS':>9}{'median rel.':>12}{'→ 0':>8}"]
    for name, t in tensors.items():
        for how, e in scaling_errors(t, fmt).items():
            lines.append(f"{name[:31]:<32}{how:<52}{e['rel_rms_error']:>9.3g}"
                         f"{e['median_rel_error']:>12.3g}{e['flushed_to_zero']:>8.2%}")
    every = scaling_errors(tensors[together], fmt)
    tensor_lost, block_lost = (every[k]["flushed_to_zero"] for k in
                               ("per tensor", f"per {MX_BLOCK}-block, scale rounded up (MXFP8 recipe)"))
    lines.append(f"\n{together} under one scale: {tensor_lost:.2%} flushed to zero; with a scale "
                 f"per {MX_BLOCK} values (rounded up): {block_lost:.2%} (measured)"
                 + (": block scales keep the small values one tensor-wide scale loses."
                    if block_lost < tensor_lost else
                    ": no difference here, the values of each tensor span few enough binades."))
    return "\n".join(lines)


@dataclass(frozen=True)
class Fp8Training:
    """fp8 training (tensorwise, under bf16 autocast) against a bf16 run, or why it did not run."""

    reason: str | None
    """Why fp8 training does not run here; None when it ran."""
    conversion: Fp8Conversion | None = None
    history: Any = None
    """The fp8 run's ``labkit.train.History``."""
    bf16_history: Any = None

    def describe(self) -> str:
        if self.reason is not None:
            return (f"fp8 training does not run here: {self.reason}.\nNothing below is measured, "
                    "and no fp8 speed or loss is shown in its place.")
        conv, h, b = self.conversion, self.history, self.bf16_history
        return "\n".join([
            f"converted {len(conv.converted)} Linear layers to fp8; left in high precision: "
            f"{conv.left_out or 'none'}",
            f"fp8 (tensorwise, under bf16 autocast), measured in two runs one after the other: "
            f"final validation loss {h.val_loss[-1]:.4f} vs bf16 {b.val_loss[-1]:.4f}; "
            f"{h.tokens_per_s():,.0f} vs {b.tokens_per_s():,.0f} tokens/s",
            "(two runs one after the other and without torch.compile: a speed verdict needs "
            "alternated timing; fp8 pays off on large matmuls, where its casts cost little)"])


def train_fp8(initial: nn.Module, cfg: Any, splits: Any, device: torch.device,
              bf16: tuple[nn.Module, Any] | None) -> Fp8Training:
    """Where fp8 training runs (:func:`fp8_training_support`), convert a copy of ``initial``
    (:func:`convert_for_fp8_training`) and train it as ``cfg`` says under bf16 autocast, for
    comparison with the bf16 run ``bf16`` (model, history); elsewhere, say why not and train
    nothing."""
    reason = fp8_training_support(device)
    if reason is not None:
        return Fp8Training(reason)
    from labkit import train  # a lower layer; imported where used

    model = copy.deepcopy(initial).to(device)
    conversion = convert_for_fp8_training(model, device)
    history = train.train(model, cfg.replace(dtype="bfloat16"), splits.train,
                          val_data=splits.val, device=device)
    return Fp8Training(None, conversion, history, bf16[1] if bf16 else None)
