"""What a matmul on the roofline runs in: float32, tf32, bfloat16 or float16.

The names come from the one table of formats, :mod:`labkit.dtypes`; this module picks the four
a matmul here can run in and says how each runs. tf32 is not a storage dtype: it is how NVIDIA
tensor cores (Ampere and later) multiply float32 tensors when PyTorch allows it, switched with
:func:`tf32_matmuls`, and it exists only on CUDA.

Nothing here measures anything or needs a GPU: setting PyTorch's TF32 switches does not
initialise CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from labkit import dtypes

PRECISIONS = ("float32", "tf32", "bfloat16", "float16")
"""What a matmul here can run in. tf32 is not a storage dtype: it is how NVIDIA tensor cores
(Ampere and later) multiply float32 tensors when PyTorch allows it (see :func:`tf32_matmuls`)."""


def precision_name(precision: str | torch.dtype) -> str:
    """The canonical name of a precision: "float32", "tf32", "bfloat16" or "float16".

    Accepts a ``torch.dtype`` or a name or alias ("fp32", "bf16", "fp16", "half", "tf32").
    """
    if not isinstance(precision, (str, torch.dtype)):
        raise ValueError(f"precision={precision!r} is not allowed: give a torch.dtype or one of "
                         f"{', '.join(PRECISIONS)} (aliases fp32, bf16, fp16, half)")  # fmt: skip
    found = dtypes.find(precision)
    if found is None or found.name not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not allowed{dtypes.why_not(precision)}: use "
                         f"one of {', '.join(PRECISIONS)} (aliases fp32, bf16, fp16, half)")  # fmt: skip
    return found.name


def storage_dtype(precision: str | torch.dtype) -> torch.dtype:
    """The dtype of the tensors a matmul in ``precision`` multiplies (tf32: torch.float32)."""
    return dtypes.torch_dtype(dtypes.lookup(precision_name(precision)).stored_as)


def check_precision_on(name: str, dev: torch.device) -> None:
    """Refuse tf32 off CUDA, naming what this device can measure instead."""
    if name == "tf32" and dev.type != "cuda":
        raise ValueError(
            f"precision='tf32' is not allowed on device {str(dev)!r}: TF32 is a mode of NVIDIA "
            "tensor cores (Ampere and later) for float32 matmuls, so it exists only on CUDA; "
            "on this device measure 'float32', 'bfloat16' or 'float16'"
        )


@contextlib.contextmanager
def tf32_matmuls(enabled: bool = True) -> Iterator[None]:
    """Inside the block, CUDA float32 matmuls may (``enabled``) or may not use TF32; the
    caller's setting is restored afterwards, also when the block raises.

    PyTorch leaves TF32 off for matmuls by default since 1.12; the switches are
    ``torch.backends.cuda.matmul.allow_tf32`` and ``torch.set_float32_matmul_precision``
    ("highest": off, "high": TF32). PyTorch 2.9 added ``torch.backends.cuda.matmul
    .fp32_precision`` ("ieee" or "tf32"), and reading the old switches after code has set the
    new one raises a RuntimeError (PyTorch docs, CUDA semantics, "TensorFloat-32 (TF32) on
    Ampere (and later) devices"). So this sets the old switches ("high" or "highest"), which
    keeps both APIs readable, unless the caller already uses the new one: then it sets and
    restores that one. Setting either needs no GPU, and changes nothing off CUDA.
    """
    matmul = torch.backends.cuda.matmul
    new_api = hasattr(matmul, "fp32_precision")
    saved_new = matmul.fp32_precision if new_api else None
    try:
        saved = matmul.allow_tf32, torch.get_float32_matmul_precision()
    except RuntimeError:  # the caller set fp32_precision: stay with the new switch
        matmul.fp32_precision = "tf32" if enabled else "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = saved_new
        return
    # The precision setter sets allow_tf32 with it, so the two old switches agree inside.
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    try:
        yield
    finally:
        matmul.allow_tf32 = saved[0]
        # the precision setter also sets allow_tf32, consistently with itself: so it goes last
        torch.set_float32_matmul_precision(saved[1])
        if new_api and matmul.fp32_precision != saved_new:
            matmul.fp32_precision = saved_new  # the old setters write "ieee" where it was "none"


def matmul_mode(name: str, dev: torch.device) -> contextlib.AbstractContextManager:
    """The TF32 setting a matmul in precision ``name`` runs under on ``dev``."""
    # On CUDA "float32" means IEEE float32 even if the caller has TF32 switched on: a float32
    # ceiling measured with TF32 would be a tf32 ceiling under the wrong name.
    return tf32_matmuls(name == "tf32") if dev.type == "cuda" else contextlib.nullcontext()
