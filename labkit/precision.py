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
   the real model. Where torch would only warn and quietly run in fp32, this module refuses.

Importing this module reads ``torch.finfo`` (pure) and touches no device.

Sources cited below:
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

import contextlib
import copy
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from labkit import dtypes
from labkit.formulas import dtype_bytes, dtype_name

if TYPE_CHECKING:
    from labkit.config import TrainConfig

# ----------------------------------------------------------------------------------------------
# Formats

# Short names, in the order a table shows them (widest first). Everything else about a name
# (torch attribute, spellings, bytes) comes from the one table, labkit.dtypes.FORMATS.
FORMAT_NAMES = ("fp32", "tf32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2")
_ROWS = {short: dtypes.lookup(short) for short in FORMAT_NAMES}

# The torch dtype behind each stored format; tf32 has none (see _TF32).
TORCH_DTYPE_NAMES: dict[str, str] = {s: f.torch_name for s, f in _ROWS.items() if f.torch_name}

# Every spelling dtype_of and format_name accept, lower case, mapped to the short name.
ALIASES: dict[str, str] = {spelling: s for s, f in _ROWS.items() for spelling in f.spellings}


@dataclass(frozen=True)
class FloatFormat:
    """One binary floating-point format. Values are plain numbers (not ``torch.dtype``s)."""

    name: str
    """Short name: "fp32", "tf32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"."""
    torch_dtype: str | None
    """Attribute of ``torch`` holding the dtype ("float8_e4m3fn"); None for tf32."""
    bits: int
    """Significant bits: sign + exponent + mantissa (tf32: 19, although stored in 32)."""
    exponent_bits: int
    mantissa_bits: int
    """Explicit fraction bits; a normal number has one more, implicit, leading bit."""
    max: float
    """Largest finite value."""
    smallest_normal: float
    """Smallest positive normal value, 2**(1 - bias): ``finfo.smallest_normal``."""
    smallest_subnormal: float | None
    """Smallest positive value at all: smallest_normal × eps. None where not documented."""
    eps: float
    """Machine epsilon: the gap between 1.0 and the next value up, 2**-mantissa_bits."""
    storage_bytes: int
    """Bytes one element occupies in memory (tf32: 4, it lives in fp32 tensors)."""
    source: str
    """Where the numbers come from: "read: torch.finfo(...)" or "defined: ..."."""
    sign_bits: int = 1

    @property
    def measured(self) -> bool:
        """True when the numbers were read from this torch, False when defined from a spec."""
        return self.source.startswith("read")


def _read(name: str, dtype: torch.dtype) -> FloatFormat:
    info = torch.finfo(dtype)
    mantissa = -round(math.log2(info.eps))  # eps = 2**-m exactly for every binary format
    return FloatFormat(
        name=name,
        torch_dtype=TORCH_DTYPE_NAMES[name],
        bits=info.bits,
        exponent_bits=info.bits - 1 - mantissa,
        mantissa_bits=mantissa,
        max=info.max,
        smallest_normal=info.smallest_normal,
        # One unit in the last place at the bottom of the normal range: every format here has
        # gradual underflow [IEEE754, FP8]; the tests check it by casting it and half of it.
        smallest_subnormal=info.smallest_normal * info.eps,
        eps=info.eps,
        storage_bytes=dtype_bytes(TORCH_DTYPE_NAMES[name]),
        source=f"read: torch.finfo(torch.{TORCH_DTYPE_NAMES[name]}), torch {torch.__version__}",
    )


# tf32 is a tensor-core math mode for fp32 tensors, not a dtype torch can hold, so there is no
# finfo to read: its numbers follow from its definition, 1 sign, 8 exponent (fp32's bias 127)
# and 10 mantissa bits [A100, CUDA-sem]. NVIDIA does not document how tf32 treats subnormals, so
# that field is None (not available), not a guess.
_TF32 = FloatFormat(
    name="tf32",
    torch_dtype=None,
    bits=19,
    exponent_bits=8,
    mantissa_bits=10,
    max=(2 - 2**-10) * 2.0**127,
    smallest_normal=2.0**-126,
    smallest_subnormal=None,
    eps=2.0**-10,
    storage_bytes=4,
    source="defined: 1 sign, 8 exponent, 10 mantissa bits (NVIDIA A100 whitepaper; "
    "PyTorch 'CUDA semantics', TF32 section); stored and returned as float32",
)


def read_formats() -> dict[str, FloatFormat]:
    """The formats of ``FORMAT_NAMES`` this torch build has, read now, in table order.

    A format whose dtype this torch lacks (fp8 in an old build) is left out, not invented.
    """
    formats = {}
    for name in FORMAT_NAMES:
        if name == "tf32":
            formats[name] = _TF32
        elif (dtype := getattr(torch, TORCH_DTYPE_NAMES[name], None)) is not None:
            formats[name] = _read(name, dtype)
    return formats


FORMATS: dict[str, FloatFormat] = read_formats()
"""Every format of ``FORMAT_NAMES`` this torch has, keyed by short name (see read_formats)."""


def format_table() -> list[dict[str, Any]]:
    """``FORMATS`` as rows (one dict per format, widest first), ready for pandas or printing."""
    return [
        {
            "format": f.name,
            "sign/exponent/mantissa": f"{f.sign_bits}/{f.exponent_bits}/{f.mantissa_bits}",
            "max": f.max,
            "smallest normal": f.smallest_normal,
            "smallest subnormal": f.smallest_subnormal,
            "eps": f.eps,
            "bytes": f.storage_bytes,
            "source": f.source,
        }
        for f in FORMATS.values()
    ]


def format_name(name: str | torch.dtype) -> str:
    """The short name ("bf16") of a format given as any accepted spelling or a ``torch.dtype``.

    Accepted: fp32/float32, tf32, bf16/bfloat16, fp16/float16/half, fp8_e4m3/float8_e4m3fn,
    fp8_e5m2/float8_e5m2, case-insensitive, with or without a "torch." prefix.
    """
    found = dtypes.find(name)
    if found is not None and found.short in _ROWS:
        return found.short
    raise ValueError(
        f"dtype={name!r} is not a format labkit.precision knows{dtypes.why_not(name)}; allowed: "
        f"{', '.join(map(repr, FORMAT_NAMES))} (or their torch names: "
        f"{', '.join(map(repr, TORCH_DTYPE_NAMES.values()))})"
    )


def dtype_of(name: str | torch.dtype) -> torch.dtype:
    """The ``torch.dtype`` of a stored format ("bf16" -> torch.bfloat16).

    Refuses tf32 (a matmul mode for float32 tensors, not a dtype), any unknown name (listing
    the allowed ones) and an fp8 format this torch build does not have.
    """
    short = format_name(name)
    if short == "tf32":
        raise ValueError(
            f"dtype={name!r}: tf32 is not a dtype but a way tensor cores multiply float32 "
            "tensors (NVIDIA A100 whitepaper); use dtype 'fp32' and turn tf32 matmuls on with "
            "torch.backends.cuda.matmul.allow_tf32 = True or "
            "torch.set_float32_matmul_precision('high') (PyTorch 'CUDA semantics')"
        )
    attr = TORCH_DTYPE_NAMES[short]
    dtype = getattr(torch, attr, None)
    if dtype is None:
        have = [n for n, a in TORCH_DTYPE_NAMES.items() if getattr(torch, a, None) is not None]
        raise ValueError(
            f"dtype={name!r}: this torch build ({torch.__version__}) has no torch.{attr}; "
            f"formats it has: {', '.join(map(repr, have))}. Install a torch that has it "
            "(see requirements.txt) to use fp8."
        )
    return dtype


def spacing(value: float, fmt: str | torch.dtype, toward: str = "larger") -> float:
    """The gap between ``value`` and its neighbour in ``fmt``, for a normal ``value``.

    ``toward="larger"`` (the default): the next representable number of larger magnitude,
    2**(floor(log2|value|) - mantissa_bits) [IEEE754]. ``toward="smaller"``: the neighbour of
    smaller magnitude; the same gap inside a binade (the values from one power of two to the
    next), but **half** of it when |value| is itself a power of two, the bottom of its binade,
    whose neighbour below lies in the finer binade beneath. So a bf16 weight of 1.0 is raised
    by an update only above half of 2**-7, but lowered by one above half of 2**-8.

    >>> spacing(1.0, "bf16"), spacing(1.0, "bf16", toward="smaller"), spacing(4.0, "bf16")
    (0.0078125, 0.00390625, 0.03125)
    """
    f = FORMATS[format_name(fmt)]
    if toward not in ("larger", "smaller"):
        raise ValueError(f"toward={toward!r} is not allowed: 'larger' or 'smaller'")
    if not (math.isfinite(value) and f.smallest_normal <= abs(value) <= f.max):
        raise ValueError(f"value={value!r} is not a normal {f.name} number (from "
                         f"{f.smallest_normal:g} to {f.max:g} in magnitude)")  # fmt: skip
    exponent = math.floor(math.log2(abs(value)))
    gap = 2.0 ** (exponent - f.mantissa_bits)
    bottom = abs(value) == 2.0**exponent and abs(value) > f.smallest_normal
    return gap / 2 if toward == "smaller" and bottom else gap


def sum_stall_point(increment: float, fmt: str | torch.dtype) -> float:
    """Predicted value at which a running sum of ``increment`` (> 0), kept in ``fmt``, stops
    growing: the first power of two 2**e whose spacing is at least twice the increment.

    At 2**e, S + increment is then no nearer to the next value than to S, and round to nearest
    (a tie going to the even neighbour, 2**e itself) returns S [IEEE754]. Below 2**e the gap is
    less than twice the increment, so each addition rounds to at least one whole gap and the
    sum arrives at 2**e exactly. The increment is first rounded to ``fmt``, as the sum stores
    it.

    >>> sum_stall_point(0.01, "bf16"), sum_stall_point(0.01, "fp16")
    (4.0, 32.0)
    """
    f = FORMATS[format_name(fmt)]
    if not (isinstance(increment, (int, float)) and math.isfinite(increment) and increment > 0):
        raise ValueError(f"increment={increment!r} is not allowed: a positive finite number")
    stored = float(torch.tensor(increment).to(dtype_of(f.name)).float()) if f.torch_dtype \
        else increment  # fmt: skip
    # spacing(2**e) = 2**(e - m) >= 2 × stored  <=>  e >= log2(stored) + m + 1
    e = math.ceil(math.log2(stored)) + f.mantissa_bits + 1
    return 2.0**e

# ----------------------------------------------------------------------------------------------
# Underflow

UNDERFLOW_KINDS = ("zero", "subnormal", "below_normal")


def underflow_fraction(
    tensor: torch.Tensor, dtype: str | torch.dtype = "fp16", kind: str = "zero"
) -> float:
    """Fraction (0..1) of ``tensor``'s nonzero finite values that the cast to ``dtype`` loses.

    Measured by doing the cast (``tensor.to(dtype)``), not by comparing with a threshold: a
    value just above half the smallest subnormal rounds *up* to it, and exactly half of it
    rounds to zero (round to nearest, ties to even [IEEE754]); a threshold test gets both wrong.

    ``kind``:
        "zero"          the cast gives exactly 0: the value is gone (fp16 below about 2**-25).
        "subnormal"     the cast is nonzero but below ``smallest_normal``: it survives with
                        fewer significant bits (fp16: between 2**-24 and 2**-14).
        "below_normal"  either of the two.

    Exact zeros of ``tensor`` are left out of the count and of the denominator: a zero is not
    lost by the cast. Non-finite values (inf, NaN) are left out too. Returns NaN when no value
    is left to judge (an all-zero tensor): not available, not 0.
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"tensor must be a floating-point torch.Tensor, got {got}")
    if kind not in UNDERFLOW_KINDS:
        raise ValueError(f"kind must be one of {', '.join(map(repr, UNDERFLOW_KINDS))}; "
                         f"got {kind!r}")  # fmt: skip
    target = dtype_of(dtype)
    smallest_normal = torch.finfo(target).smallest_normal
    values = tensor.detach().flatten()
    values = values[(values != 0) & torch.isfinite(values)]
    if values.numel() == 0:
        return math.nan
    cast = values.to(target).float()  # back to fp32 to compare: fp8 has few ops of its own
    zero = cast == 0
    subnormal = ~zero & (cast.abs() < smallest_normal)
    lost = {"zero": zero, "subnormal": subnormal, "below_normal": zero | subnormal}[kind]
    return int(lost.sum()) / values.numel()


def per_parameter_underflow(
    model: nn.Module, dtype: str | torch.dtype = "fp16", kind: str = "zero"
) -> dict[str, float]:
    """:func:`underflow_fraction` of every parameter's ``.grad``: {parameter name: fraction}.

    Parameters without a gradient are left out; a model with no gradient at all is an error
    (run ``loss.backward()`` first).
    """
    fractions = {
        name: underflow_fraction(p.grad, dtype, kind)
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    if not fractions:
        raise ValueError("model has no parameter with a .grad: run loss.backward() first")
    return fractions


# ----------------------------------------------------------------------------------------------
# Dynamic loss scaling


class ScalerStep(NamedTuple):
    """One optimiser step as the scaler saw it."""

    step: int
    """Steps counted from 1 (one per ``update()``)."""
    scale: float
    """The factor this step's loss was multiplied by."""
    skipped: bool
    """True when a gradient had an inf or NaN, so ``optimizer.step()`` was not called."""


def _fp32(x: float) -> float:
    # GradScaler keeps its scale in a float32 tensor; rounding here keeps ours bit-identical.
    return float(torch.tensor(x, dtype=torch.float32))


class ManualScaler:
    """Dynamic loss scaling [MPT] with ``torch.amp.GradScaler``'s semantics and defaults.

    Why: fp16 gradients below 2**-24 flush to zero. Multiplying the loss by S multiplies every
    gradient by S (the chain rule is linear), lifting small ones into range; dividing by S
    before the optimiser step restores the true values. Too large an S overflows to inf: then
    the step is skipped and S backed off. The scale grows again after ``growth_interval`` clean
    steps in a row, so it hovers just below the largest value that does not overflow.

    Used like GradScaler (so ``labkit.train.train_step`` takes it as its ``scaler``)::

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)     # optional: to clip true gradients
        scaler.step(optimizer)         # skipped if any gradient is inf/NaN
        scaler.update()                # back off or grow

    One optimiser per step, as in the course's loop. Unlike GradScaler (a fused kernel and a
    device-side flag [scaler]) the inf check here costs one host sync per gradient: clarity
    over speed.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        # GradScaler's defaults and its checks on them [AMP, scaler].
        if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale)
                and init_scale > 0):  # fmt: skip
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale!r}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1.0, got {growth_factor!r}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be between 0 and 1, got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) \
                or growth_interval < 1:  # fmt: skip
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
        self.scale_factor = _fp32(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.growth_tracker = 0
        """Clean steps in a row since the scale last changed."""
        self.history: list[ScalerStep] = []
        self._found_inf: bool | None = None  # None: gradients not checked yet this step
        self._stepped = False

    def get_scale(self) -> float:
        """The current scale factor (GradScaler's name)."""
        return self.scale_factor

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` × scale: backpropagate this, not ``loss``."""
        return loss * self.scale_factor

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide every gradient ``optimizer`` holds by the scale, in place, and note whether
        any was inf or NaN (checked before dividing, as GradScaler does)."""
        if self._found_inf is not None:
            raise RuntimeError("unscale_() was already called this step: call update() first")
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]  # fmt: skip
        if any(g.dtype == torch.float16 for g in grads):
            # GradScaler refuses too: fp16 master weights defeat the point [MPT].
            raise ValueError("gradients are float16: keep the parameters (master weights) in "
                             "float32 and let autocast run the matmuls in float16")
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        # GradScaler computes 1/S in float64, then rounds to float32 [scaler].
        inv_scale = _fp32(1.0 / self.scale_factor)
        for g in grads:
            g.mul_(inv_scale)
        self._found_inf = not finite

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless ``unscale_`` was called) and step, or skip the step if any gradient
        was inf/NaN. Returns what ``optimizer.step`` returns, None when skipped."""
        if self._stepped:
            raise RuntimeError("step() was already called this step: call update() first")
        if self._found_inf is None:
            self.unscale_(optimizer)
        self._stepped = True
        return None if self._found_inf else optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """Back off after a skipped step; grow after ``growth_interval`` clean steps in a row.

        The same rule as torch's ``_amp_update_scale_`` [scaler], including that the scale never
        grows past float32's range to inf.
        """
        if self._found_inf is None:
            raise RuntimeError("update() before step(): no gradients were checked this step; "
                               "call scaler.step(optimizer) first")  # fmt: skip
        self.history.append(ScalerStep(len(self.history) + 1, self.scale_factor, self._found_inf))
        if self._found_inf:
            self.scale_factor = _fp32(self.scale_factor * self.backoff_factor)
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                grown = _fp32(self.scale_factor * self.growth_factor)
                if math.isfinite(grown):
                    self.scale_factor = grown
                self.growth_tracker = 0
        self._found_inf, self._stepped = None, False


# ----------------------------------------------------------------------------------------------
# Autocast


def _autocast_refusal(device_type: str, dtype: torch.dtype) -> str | None:
    """Why ``torch.autocast(device_type, dtype)`` would not run in ``dtype`` here; None if it
    would. Found by entering it: torch answers an unsupported pair with a warning and runs in
    float32 (torch/amp/autocast_mode.py), which this turns into a reason."""
    try:
        if not torch.amp.is_autocast_available(device_type):
            return f"torch {torch.__version__} has no autocast for this device type"
    except RuntimeError as e:  # not a device type at all ("gpu")
        return str(e).splitlines()[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autocast(device_type, dtype=dtype):
                on = (torch.is_autocast_enabled(device_type)
                      and torch.get_autocast_dtype(device_type) == dtype)  # fmt: skip
        except (RuntimeError, AssertionError) as e:  # e.g. bf16 on a GPU older than Ampere
            return str(e).splitlines()[0]
    if on:
        return None
    said = "; ".join(str(w.message).splitlines()[0] for w in caught)
    return f"torch.autocast switched itself off ({said or 'no reason given'})"


def autocast_formats(device_type: str) -> tuple[str, ...]:
    """The low-precision formats ``torch.autocast`` accepts for ``device_type`` in this torch,
    found by trying each (bf16, fp16); empty if none."""
    return tuple(n for n in ("bf16", "fp16")
                 if _autocast_refusal(device_type, dtype_of(n)) is None)  # fmt: skip


def checked_autocast(
    device_type: str, dtype: str | torch.dtype
) -> contextlib.AbstractContextManager:
    """``torch.autocast(device_type, dtype)``, or an error where torch would fall back.

    "fp32" means autocast off (a null context). Any other format must be one autocast really
    runs in on ``device_type`` here: torch itself only warns and runs in float32 when it cannot
    (an fp8 dtype on CPU, CUDA missing), and a lab must not measure fp32 and call it fp16.
    """
    short = format_name(dtype)
    if short == "fp32":
        return contextlib.nullcontext()
    target = dtype_of(short)
    reason = _autocast_refusal(device_type, target)
    if reason is not None:
        allowed = [*autocast_formats(device_type), "fp32 (autocast off)"]
        hint = ""
        if short.startswith("fp8"):
            hint = (" fp8 is not an autocast dtype: fp8 training scales tensors and casts them "
                    "itself (torchao's float8 training API, on GPUs of compute capability 8.9+).")
        raise ValueError(
            f"dtype={dtype!r} autocast is not available for device_type={device_type!r} here: "
            f"{reason}. Allowed for {device_type!r}: {', '.join(allowed)}.{hint} "
            "labkit refuses rather than let torch quietly run in float32."
        )
    return torch.autocast(device_type, dtype=target)


@dataclass(frozen=True)
class DtypeRow:
    """What one module call, or one functional op, ran in during a captured forward pass."""

    module: str
    """Qualified name in the model ("blocks.0.attn.q"); "" is the model itself."""
    op: str
    """The module's class ("Linear"), or the function ("F.scaled_dot_product_attention")."""
    param_dtype: str | None
    """dtype of the module's own parameters (the master weights); None if it has none."""
    input_dtypes: tuple[str, ...]
    """dtypes of the tensor arguments, in order (token ids show as int64)."""
    output_dtype: str | None
    """dtype of the (first) output tensor."""


def _dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_dtypes(values: Any) -> tuple[str, ...]:
    if isinstance(values, torch.Tensor):
        return (_dtype_str(values.dtype),)
    if isinstance(values, (list, tuple)):
        return tuple(d for v in values for d in _tensor_dtypes(v))
    if isinstance(values, dict):
        return _tensor_dtypes(list(values.values()))
    return ()


# Namespaces of the functions recorded: torch.nn.functional (some of whose functions live in
# torch._C._nn) and torch.* itself. Tensor methods (x.view, x + y, x @ w) are not recorded.
_FUNCTION_PREFIXES = {"torch.nn.functional": "F", "torch._C._nn": "F", "torch": "torch"}


class _FunctionRecorder(TorchFunctionMode):
    """Records functional ops called directly by non-leaf modules (attention, GELU, loss).

    A TorchFunctionMode (PyTorch docs, "Extending PyTorch": torch function modes) sees each call
    above the dispatcher, so the output it records is the one autocast produced. Calls inside a
    leaf module are skipped: that module's own row already shows them.
    """

    def __init__(self, rows: list[DtypeRow], stack: list[tuple[str, bool]]) -> None:
        super().__init__()
        self.rows, self.stack = rows, stack

    def __torch_function__(self, func: Callable, types: Any, args: Sequence = (),
                           kwargs: dict | None = None) -> Any:  # fmt: skip
        out = func(*args, **(kwargs or {}))
        prefix = _FUNCTION_PREFIXES.get(getattr(func, "__module__", None) or "")
        inside_leaf = bool(self.stack) and self.stack[-1][1]
        if (prefix and not inside_leaf and isinstance(out, torch.Tensor)
                and out.is_floating_point()):  # fmt: skip
            self.rows.append(DtypeRow(
                module=self.stack[-1][0] if self.stack else "",
                op=f"{prefix}.{func.__name__}",
                param_dtype=None,
                input_dtypes=_tensor_dtypes([*args, *(kwargs or {}).values()]),
                output_dtype=_dtype_str(out.dtype),
            ))  # fmt: skip
        return out


@contextlib.contextmanager
def _hooks(model: nn.Module, rows: list[DtypeRow], stack: list[tuple[str, bool]]) -> Iterator[None]:
    """Forward hooks on every module: a stack of the modules running, a row per leaf call."""

    def enter(name: str, leaf: bool) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            stack.append((name, leaf))
        return hook

    def leave(name: str, leaf: bool) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            stack.pop()
            if leaf:
                params = list(module.parameters(recurse=False))
                outputs = _tensor_dtypes(output)
                rows.append(DtypeRow(
                    module=name,
                    op=type(module).__name__,
                    param_dtype=_dtype_str(params[0].dtype) if params else None,
                    input_dtypes=_tensor_dtypes(args),
                    output_dtype=outputs[0] if outputs else None,
                ))  # fmt: skip
        return hook

    handles = []
    try:
        for name, module in model.named_modules():
            leaf = next(module.children(), None) is None
            handles.append(module.register_forward_pre_hook(enter(name, leaf)))
            handles.append(module.register_forward_hook(leave(name, leaf)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def capture_dtypes(
    model: nn.Module, inputs: Sequence[Any], *, device_type: str, dtype: str | torch.dtype
) -> list[DtypeRow]:
    """Run ``model(*inputs)`` once under autocast and record what each op ran in.

    One row per call of a leaf module (Linear, LayerNorm, Embedding, ...) with its parameter,
    input and output dtypes, and one per ``torch.nn.functional``/``torch`` function called
    directly by a non-leaf module (the GPT's attention, GELU and loss), in the order they
    finished. ``dtype`` "fp32" runs without autocast (the baseline). The pass runs under
    ``torch.no_grad()``: autocast chooses dtypes the same way, and no activations are kept.

    The model must already be on ``device_type``: autocast for another device type would
    leave every op in float32 without a word.
    """
    on = {p.device.type for p in model.parameters()}
    if on and on != {device_type}:
        raise ValueError(
            f"device_type={device_type!r}, but the model's parameters are on "
            f"{', '.join(sorted(on))}: autocast would not touch them. Move the model "
            f"(model.to({device_type!r})) or pass device_type={sorted(on)[0]!r}"
        )
    context = checked_autocast(device_type, dtype)
    rows: list[DtypeRow] = []
    stack: list[tuple[str, bool]] = []
    with torch.no_grad(), _hooks(model, rows, stack), context, _FunctionRecorder(rows, stack):
        model(*inputs)
    return rows


# ----------------------------------------------------------------------------------------------
# Speed of the training step per precision


def step_times(
    model: nn.Module,
    train_cfg: TrainConfig,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    device: torch.device,
    precisions: Sequence[str] = ("float32", "bfloat16", "float16"),
    rounds: int = 5,
    warmup: int = 1,
    modes: Mapping[str, tuple[str, Callable[[], contextlib.AbstractContextManager]]] | None = None,
) -> dict[str, list[float]]:
    """Seconds of ``labkit.train.train_step`` per autocast dtype, the dtypes taking turns.

    ``modes`` adds rows that are not an autocast dtype alone: label -> (autocast dtype, a
    function returning a context manager entered around each of that row's steps). On CUDA,
    ``{"tf32": ("float32", lambda: roofline.tf32_matmuls(True))}`` times fp32 with TF32
    matmuls beside the IEEE fp32 baseline (PyTorch leaves TF32 off for matmuls by default).

    Each dtype trains its own copy of ``model`` (same weights, its own AdamW from
    ``train_cfg``, and for float16 its own ``GradScaler``) on the same ``batches`` (one
    micro-batch per step, cycled). Round r steps every copy once, in reverse order on odd
    rounds (``labkit.timing.alternate``), so a burst of other work on a shared machine falls on
    every precision alike instead of on whichever ran during it. ``warmup`` rounds are not kept.
    Every dtype is checked first (:func:`checked_autocast`): none is quietly run as float32.
    """
    from labkit import timing, train  # layer 2 and 0: imported where used

    if not batches:
        raise ValueError("batches is empty: pass one (x, y) micro-batch per step")
    rows = {dtype: (dtype, contextlib.nullcontext) for dtype in precisions}
    for label, mode in (modes or {}).items():
        if not (isinstance(mode, tuple) and len(mode) == 2 and callable(mode[1])):
            raise ValueError(f"modes[{label!r}]={mode!r} is not allowed: (autocast dtype, a "
                             "function returning a context manager)")  # fmt: skip
        rows[label] = mode
    for dtype, _ in rows.values():
        checked_autocast(device.type, dtype)
    steppers = {}
    for label, (dtype, context) in rows.items():
        copy_ = copy.deepcopy(model).to(device)  # deepcopy keeps the weight tying
        optimizer = train.make_optimizer(copy_, train_cfg)
        scaler = train.make_scaler(device, dtype_name(dtype))
        turn = iter(range(10**9))

        def step(copy_=copy_, optimizer=optimizer, scaler=scaler, dtype=dtype, turn=turn,
                 context=context) -> float:  # fmt: skip
            batch = batches[next(turn) % len(batches)]
            with context():
                return train.train_step(copy_, optimizer, [batch], device=device,
                                        dtype=dtype_name(dtype), scaler=scaler,
                                        grad_clip=train_cfg.grad_clip).seconds  # fmt: skip

        steppers[label] = step
    return timing.alternate(steppers, rounds=rounds, warmup=warmup)


# ----------------------------------------------------------------------------------------------
# Where a training step's time goes, per precision: is the 16-bit arithmetic engaged, and how
# much of the step could it speed up at all?

# The ATen operators that do a dense matrix multiply (F.linear reaches one of the first two).
MATMUL_OPS = ("aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation")


class OpRow(NamedTuple):
    """One kind of operator call in a profiled step: its name, the dtype of its first tensor
    input (as the profiler recorded it), how often it ran and its self time (seconds)."""

    name: str
    input_dtype: str
    calls: int
    self_s: float


class StepProfile(NamedTuple):
    """One training step under ``torch.profiler``, split into what 16-bit arithmetic can speed
    up (matrix multiplies, attention) and what it cannot, or costs (casts). Times are host
    (CPU) self times; on a GPU ``kernels`` holds the device's GEMM kernels by name."""

    dtype: str
    device: str
    step_s: float
    matmuls: tuple[OpRow, ...]
    attention_s: float
    cast_s: float
    cast_calls: int  # outermost aten::_to_copy calls per step
    kernels: tuple[OpRow, ...]  # GPU only: GEMM-like kernels, device seconds; input_dtype ""

    @property
    def matmul_s(self) -> float:
        return sum(r.self_s for r in self.matmuls)

    def share(self, seconds: float) -> float:
        return seconds / self.step_s if self.step_s > 0 else math.nan


# How the profiler spells a dtype (c10's C++ scalar type names) -> torch's name.
_PROFILER_DTYPES = {"float": "float32", "double": "float64", "c10::BFloat16": "bfloat16",
                    "c10::Half": "float16", "c10::Float8_e4m3fn": "float8_e4m3fn",
                    "c10::Float8_e5m2": "float8_e5m2"}  # fmt: skip

_GEMM_KERNEL_WORDS = ("gemm", "xmma", "cutlass", "wgmma", "matmul", "mma")


def profile_step(
    model: nn.Module,
    train_cfg: TrainConfig,
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    device: torch.device,
    dtype: str = "float32",
    warmup: int = 2,
    steps: int = 3,
) -> StepProfile:
    """Profile ``steps`` calls of ``labkit.train.train_step`` on a copy of ``model`` in
    ``dtype`` (autocast, or fp32) after ``warmup`` unprofiled ones, and say where the time of
    one step went (every time is the mean over the profiled steps).

    Matrix multiplies are the ATen ops of :data:`MATMUL_OPS`, grouped by the dtype of their
    first input, which is what tells whether autocast engaged them in 16 bits (PyTorch
    profiler, ``record_shapes=True`` records each op's input dtypes). Attention is every op
    whose name holds ``scaled_dot_product``. Casts are the outermost ``aten::_to_copy`` calls
    (autocast's weight and input casts, with the copies inside them). On CUDA the device's
    kernels whose names contain a GEMM word (gemm, xmma, cutlass, wgmma, mma) are listed with
    their device time: their names carry the dtypes and the instruction they run.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    from labkit import train  # layer 0, imported where used as in step_times

    checked_autocast(device.type, dtype)
    name = dtype_name(dtype)
    copy_ = copy.deepcopy(model).to(device)
    optimizer = train.make_optimizer(copy_, train_cfg)
    scaler = train.make_scaler(device, name)

    def step() -> None:
        train.train_step(copy_, optimizer, [batch], device=device, dtype=name, scaler=scaler,
                         grad_clip=train_cfg.grad_clip)  # fmt: skip

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} is not allowed: an integer >= 1")
    for _ in range(warmup):
        step()
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=True) as prof:
        with record_function("labkit.profile_step"):
            for _ in range(steps):
                step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.events()
    top = [e for e in events if e.name == "labkit.profile_step" and e.device_type == DeviceType.CPU]
    if not top:
        raise RuntimeError("the profiler recorded no step range; is another profiler active?")
    step_s = top[0].cpu_time_total / 1e6
    groups: dict[tuple[str, str], list[float]] = {}
    attention = cast = 0.0
    casts = 0
    kernels: dict[str, list[float]] = {}
    for e in events:
        if e.device_type != DeviceType.CPU:
            if any(w in e.name.lower() for w in _GEMM_KERNEL_WORDS):
                kernels.setdefault(e.name, []).append(e.time_range.elapsed_us() / 1e6)
            continue
        if e.name in MATMUL_OPS:
            dtypes_in = [d for d in (getattr(e, "input_dtypes", None) or []) if d]
            key = (e.name, _PROFILER_DTYPES.get(str(dtypes_in[0]), str(dtypes_in[0]))
                   if dtypes_in else "?")  # fmt: skip
            groups.setdefault(key, []).append(e.self_cpu_time_total / 1e6)
        elif "scaled_dot_product" in e.name:
            attention += e.self_cpu_time_total / 1e6
        elif e.name == "aten::_to_copy":
            parent, nested = e.cpu_parent, False
            while parent is not None:
                nested |= parent.name == "aten::_to_copy"
                parent = parent.cpu_parent
            if not nested:
                cast += e.cpu_time_total / 1e6
                casts += 1
    def rows(found: dict) -> tuple[OpRow, ...]:  # calls and seconds per step
        return tuple(sorted((OpRow(*key, round(len(t) / steps), sum(t) / steps)
                             for key, t in found.items()), key=lambda r: -r.self_s))  # fmt: skip

    gemms = rows({(n, ""): t for n, t in kernels.items()})
    return StepProfile(name, device.type, step_s / steps, rows(groups), attention / steps,
                       cast / steps, round(casts / steps), gemms)  # fmt: skip
