"""Underflow: the fraction of a tensor's values that a cast to a narrower format flushes to zero,
measured by doing the cast (per tensor, and per parameter of a model).

Apart from the formats because it measures real tensors; the formats only describe.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from labkit.precision.formats import dtype_of

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
