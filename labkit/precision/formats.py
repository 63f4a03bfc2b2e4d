"""Number formats: sign, exponent and mantissa bits, range and spacing of fp32, tf32, bf16, fp16
and the two fp8 formats, *read* from ``torch.finfo`` wherever torch has the dtype.

tf32 is not a storage dtype, so its row is *defined* from NVIDIA's description and says so.
The other modules of :mod:`labkit.precision` name formats through :func:`format_name` and
:func:`dtype_of`. Sources: see :mod:`labkit.precision`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from labkit import dtypes
from labkit.formulas import dtype_bytes

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
# Presentation (notebook 04, section 1)


def describe_formats() -> str:
    """``FORMATS`` as the text table notebook 04 prints: bits, range, eps and bytes per format,
    and the note that tf32's row is defined, not read."""
    lines = [f"{'format':<9}{'s/e/m bits':>11}{'max':>11}{'smallest normal':>17}"
             f"{'smallest subnormal':>20}{'eps':>11}{'bytes':>6}"]
    for row in format_table():
        sub, top = row["smallest subnormal"], row["max"]
        top = f"{top:,.0f}" if top < 1e6 else f"{top:.4g}"  # 65,504 exactly; 3.403e+38
        lines.append(f"{row['format']:<9}{row['sign/exponent/mantissa']:>11}{top:>11}"
                     f"{row['smallest normal']:>17.4g}{'n/a' if sub is None else f'{sub:.4g}':>20}"
                     f"{row['eps']:>11.4g}{row['bytes']:>6}")
    lines.append("tf32 is defined, not read (no dtype to read); NVIDIA does not document its "
                 "subnormals.")
    return "\n".join(lines)


def plot_formats(ax: Any = None) -> Any:
    """Range (normal and subnormal, log2 of the magnitude) and eps of every format, side by side.
    ``ax``: a pair of axes (range, eps) to draw into; None makes a new figure. Returns the pair."""
    import matplotlib.pyplot as plt  # here, so that importing labkit stays light

    if ax is None:
        _, ax = plt.subplots(1, 2, figsize=(10, 3.2), sharey=True,
                             gridspec_kw={"width_ratios": [3, 1]})
    ax_range, ax_eps = ax
    formats = list(FORMATS.values())
    for y, f in enumerate(formats):
        lo = math.log2(f.smallest_subnormal or f.smallest_normal)
        normal, top = math.log2(f.smallest_normal), math.log2(f.max)
        ax_range.barh(y, normal - lo, left=lo, color="#c6dbef",
                      label="subnormal" if y == 0 else None)
        ax_range.barh(y, top - normal, left=normal, color="#3182bd",
                      label="normal" if y == 0 else None)
        ax_eps.plot(f.eps, y, "o", c="#3182bd")
        ax_eps.annotate(f"2^{round(math.log2(f.eps))}", (f.eps, y), xytext=(5, 0),
                        textcoords="offset points", va="center", fontsize=8)
    ax_range.set_yticks(range(len(formats)), [f.name for f in formats])
    ax_range.invert_yaxis()
    ax_range.axvline(0, c="grey", lw=0.8)
    ax_range.set(xlabel="log2 of the magnitude (range of positive values)",
                 title="range: set by the exponent bits")
    ax_range.legend(loc="lower left", fontsize=8)
    ax_eps.set_xscale("log", base=2)
    ax_eps.set(xlabel="eps (gap after 1.0)", title="spacing: mantissa bits")
    ax_range.figure.tight_layout()
    return ax
