"""Number formats, underflow, loss scaling and autocast: the pieces of mixed precision, each
checked against the PyTorch implementation it explains.

Four tools, kept apart:

1. Formats (``FORMATS``, ``format_table``, ``dtype_of``): sign, exponent and mantissa bits,
   range and spacing of fp32, tf32, bf16, fp16 and the two fp8 formats, *read* from
   ``torch.finfo`` wherever torch has the dtype. tf32 is not a storage dtype, so its row is
   *defined* from NVIDIA's description and says so.
2. Underflow (``underflow_fraction``, ``per_parameter_underflow``): the fraction of a tensor's
   values that a cast to a narrower format flushes to zero, measured by doing the cast.
3. Loss scaling (``ManualScaler``): ``torch.amp.GradScaler``'s algorithm in readable Python,
   with a history of the scale per step.
4. Autocast (``checked_autocast``, ``autocast_formats``, ``capture_dtypes``): which dtype each
   module and functional op of a model runs in under ``torch.autocast``, recorded with hooks on
   the real model. Where torch would only warn and quietly run in fp32, this package refuses.

Importing this package reads ``torch.finfo`` (pure) and touches no device.

One module per tool (what notebooks and tests use is re-exported here: ``precision.<name>``)::

    formats    the number formats' bits, range and spacing, read from torch.finfo
    underflow  the share of a tensor's values a narrower format flushes to zero
    scaling    dynamic loss scaling: ManualScaler, GradScaler's rules in readable Python
    autocast   which dtype each op runs in under torch.autocast; refusing a silent fp32
    speed      a training step's time per precision, and where that time goes
    accumulation  a running sum kept in a narrow format, measured against its predicted stall
    runs       copies of one model trained per precision on the same batches, and their verdicts

Sources the modules cite:
    [IEEE754]   IEEE Std 754-2019, "Standard for Floating-Point Arithmetic" (binary32, binary16).
    [A100]      NVIDIA, "NVIDIA A100 Tensor Core GPU Architecture" whitepaper (2020), TF32 section:
                8 exponent bits like fp32, 10 mantissa bits like fp16.
    [CUDA-sem]  PyTorch docs, "CUDA semantics", section "TensorFloat-32 (TF32) on Ampere (and
                later) devices" (torch.backends.cuda.matmul.allow_tf32,
                torch.set_float32_matmul_precision).
    [FP8]       Micikevicius et al. 2022, "FP8 Formats for Deep Learning", arXiv 2209.05433, and the
                OCP "8-bit Floating Point Specification (OFP8)": e4m3 (no infinities, max 448) and
                e5m2 (IEEE-like, max 57,344); e4m3 for weights and activations, e5m2 for gradients.
    [MPT]       Micikevicius et al. 2018, "Mixed Precision Training", arXiv 1710.03740: fp32 master
                weights, loss scaling, fp32 accumulation.
    [AMP]       PyTorch docs, "Automatic Mixed Precision package - torch.amp": GradScaler, and the
                "Autocast Op Reference" (CUDA and CPU op-specific behavior).
    [autocast]  pytorch/pytorch, aten/src/ATen/autocast_mode.cpp: the op lists autocast applies.
    [scaler]    pytorch/pytorch, torch/amp/grad_scaler.py and
                aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp (_amp_update_scale_).
"""

from __future__ import annotations

from labkit.precision.accumulation import (
    plot_running_sums,
    running_sums,
)
from labkit.precision.autocast import (
    DtypeRow,
    autocast_formats,
    capture_dtypes,
    checked_autocast,
    describe_dtypes,
    describe_here,
)
from labkit.precision.formats import (
    ALIASES,
    FORMAT_NAMES,
    FORMATS,
    TORCH_DTYPE_NAMES,
    describe_formats,
    dtype_of,
    format_name,
    format_table,
    plot_formats,
    read_formats,
    spacing,
    sum_stall_point,
)
from labkit.precision.runs import (
    SHRINK_RUNS,
    CopyTrainer,
    GainPrediction,
    Gradients,
    LateLosses,
    ScalerRace,
    ShrinkResult,
    activation_gradients,
    compare_scaler,
    fp32_gradients,
    late_loss,
    plot_gradient_histogram,
    plot_loss_curves,
    plot_scale,
    plot_shrink,
    plot_underflow_map,
    race_scalers,
    stuck_parameters,
)
from labkit.precision.scaling import (
    ManualScaler,
    ScalerStep,
)
from labkit.precision.speed import (
    OpRow,
    StepProfile,
    profile_step,
    step_times,
)
from labkit.precision.underflow import (
    per_parameter_underflow,
    underflow_fraction,
)

__all__ = [
    "ALIASES",
    "FORMATS",
    "FORMAT_NAMES",
    "SHRINK_RUNS",
    "TORCH_DTYPE_NAMES",
    "CopyTrainer",
    "DtypeRow",
    "GainPrediction",
    "Gradients",
    "LateLosses",
    "ManualScaler",
    "OpRow",
    "ScalerRace",
    "ScalerStep",
    "ShrinkResult",
    "StepProfile",
    "activation_gradients",
    "autocast_formats",
    "capture_dtypes",
    "checked_autocast",
    "compare_scaler",
    "describe_dtypes",
    "describe_formats",
    "describe_here",
    "dtype_of",
    "format_name",
    "format_table",
    "fp32_gradients",
    "late_loss",
    "per_parameter_underflow",
    "plot_formats",
    "plot_gradient_histogram",
    "plot_loss_curves",
    "plot_running_sums",
    "plot_scale",
    "plot_shrink",
    "plot_underflow_map",
    "profile_step",
    "race_scalers",
    "read_formats",
    "running_sums",
    "spacing",
    "step_times",
    "stuck_parameters",
    "sum_stall_point",
    "underflow_fraction",
]
