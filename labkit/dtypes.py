"""The names of the number formats labkit speaks of: one table, every spelling, bytes each.

The course meets one format under several names: ``torch.bfloat16``, "bfloat16", "bf16".
Each row of :data:`FORMATS` holds one format's canonical name, its short name, the attribute
of ``torch`` that holds its dtype, the other spellings accepted for it, and the bytes one
element occupies. Every labkit module that takes a dtype by name resolves it here
(``formulas.dtype_name``, ``precision.format_name``, ``roofline.precision_name``,
``train.DTYPES``), each accepting the rows it has a use for, so the spellings cannot drift
apart between modules.

tf32 has a row but is no storage dtype: it is how NVIDIA tensor cores (Ampere and later)
multiply float32 tensors when PyTorch allows it, so its values live in float32 tensors, 4
bytes each, and torch has no ``torch.tf32`` (NVIDIA A100 Tensor Core GPU Architecture
whitepaper, TF32 section; PyTorch docs, "CUDA semantics", TF32 section).

"fp8" alone names no row: the OCP 8-bit floating point specification defines two formats,
e4m3 and e5m2 (Micikevicius et al. 2022, arXiv 2209.05433), and a name must say which.

Pure Python: importing this module imports no torch, so layer-0 modules may use it. A
``torch.dtype`` is recognised by its printed name ("torch.bfloat16"); :func:`torch_dtype`
imports torch when asked for a dtype object.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

TRAINING = ("float32", "bfloat16", "float16")
"""The dtypes a labkit training run takes (``config.DTYPES``): fp32, or autocast to bf16 or fp16."""


@dataclass(frozen=True)
class Format:
    """One number format: its names and its size in memory."""

    short: str
    """Short name, as tables print it: "fp32", "tf32", "bf16", "fp8_e4m3", "int8"."""
    torch_name: str | None
    """Attribute of ``torch`` holding the dtype ("float8_e4m3fn"); None for tf32."""
    aliases: tuple[str, ...]
    """Further spellings, lower case ("half" for float16); the two names above are implied."""
    bytes: int
    """Bytes one element occupies in memory (tf32: 4, its values live in float32 tensors)."""
    stored_as: str
    """Attribute of ``torch`` of the tensors that hold the values: torch_name, or "float32"
    for tf32."""
    floating: bool = True

    @property
    def name(self) -> str:
        """The canonical name: torch's ("bfloat16", "float8_e4m3fn"), or "tf32"."""
        return self.torch_name or self.short

    @property
    def storage(self) -> bool:
        """True for a dtype a tensor can have; False for tf32, a matmul mode."""
        return self.torch_name is not None

    @property
    def spellings(self) -> tuple[str, ...]:
        """Every lower-case name that resolves to this format, canonical name first."""
        return tuple(dict.fromkeys((self.name, self.short, *self.aliases)))


def _stored(short: str, torch_name: str, nbytes: int, *aliases: str, floating: bool = True):
    return Format(short, torch_name, aliases, nbytes, torch_name, floating)


# Widest first. Bytes are bits / 8 of IEEE 754-2019 binary64/32/16, bfloat16 (Google's brain
# float: fp32's 8 exponent bits, 7 mantissa bits) and OCP OFP8; tests/test_dtypes.py checks
# each against torch's element_size().
FORMATS: tuple[Format, ...] = (
    _stored("fp64", "float64", 8, "double"),
    _stored("fp32", "float32", 4, "float"),
    Format("tf32", None, ("tfloat32",), 4, stored_as="float32"),
    _stored("bf16", "bfloat16", 2),
    _stored("fp16", "float16", 2, "half"),
    _stored("fp8_e4m3", "float8_e4m3fn", 1, "fp8_e4m3fn"),
    _stored("fp8_e5m2", "float8_e5m2", 1),
    _stored("int8", "int8", 1, floating=False),
    _stored("uint8", "uint8", 1, floating=False),
    _stored("bool", "bool", 1, floating=False),
)

_BY_SPELLING: dict[str, Format] = {s: f for f in FORMATS for s in f.spellings}
assert len(_BY_SPELLING) == sum(len(f.spellings) for f in FORMATS), "a spelling names two rows"


def _key(dtype: Any) -> str:
    # torch.bfloat16 prints as "torch.bfloat16"; case is ignored ("BFloat16", "FP16").
    return str(dtype).lower().removeprefix("torch.")


def find(dtype: Any) -> Format | None:
    """The row of ``dtype`` (any spelling, any case, or a ``torch.dtype``); None if unknown."""
    return _BY_SPELLING.get(_key(dtype))


def why_not(dtype: Any, *, storage_only: bool = False) -> str:
    """Why ``dtype`` is not what its writer probably meant, as a clause starting with ": ";
    "" when there is nothing to add. For fp8 (two formats) and, where only storage dtypes are
    allowed, tf32 (a matmul mode for float32 tensors)."""
    key = _key(dtype)
    if key in ("fp8", "float8"):
        return (
            ": fp8 names two formats; say 'fp8_e4m3' (more precision: weights and "
            "activations) or 'fp8_e5m2' (more range: gradients), as in arXiv 2209.05433"
        )
    if storage_only and key in _BY_SPELLING and not _BY_SPELLING[key].storage:
        return (": tf32 is a tensor-core mode for multiplying float32 tensors, which are stored "
                "in 4 bytes: pass 'float32'")  # fmt: skip
    return ""


def lookup(dtype: Any, among: Iterable[str] | None = None, *, what: str = "dtype") -> Format:
    """The row of ``dtype``, which must be one of ``among`` (names or spellings; default: every
    row). Raises ValueError naming the value, why it is wrong, and what is allowed."""
    rows = FORMATS if among is None else tuple(_row(a) for a in among)
    found = find(dtype)
    if found is not None and found in rows:
        return found
    allowed = ", ".join(repr(f.name) for f in rows)
    others = ", ".join(repr(s) for f in rows for s in f.spellings[1:])
    storage_only = all(f.storage for f in rows)
    raise ValueError(f"{what}={dtype!r} is not allowed{why_not(dtype, storage_only=storage_only)}; "
                     f"allowed: {allowed} (also spelled {others}; any case, or a torch.dtype)")  # fmt: skip


def _row(name: str) -> Format:
    found = find(name)
    if found is None:
        raise ValueError(f"{name!r} is not a row of labkit.dtypes.FORMATS: use one of "
                         f"{', '.join(f.name for f in FORMATS)}")  # fmt: skip
    return found


def torch_dtype(dtype: Any) -> Any:
    """The ``torch.dtype`` of a storage format ("bf16" -> torch.bfloat16).

    Refuses tf32 (no dtype: a mode for float32 tensors), an unknown name, and a format this
    torch build lacks (fp8 in an old build), each naming the fix.
    """
    import torch  # here, not at the top: the table itself needs no torch

    fmt = lookup(dtype)
    if not fmt.storage:
        raise ValueError(f"dtype={dtype!r}: tf32 is not a dtype but a way tensor cores multiply "
                         "float32 tensors; use torch.float32 and allow TF32 matmuls with "
                         "torch.set_float32_matmul_precision('high') (PyTorch 'CUDA semantics')")  # fmt: skip
    found = getattr(torch, fmt.torch_name, None)  # type: ignore[arg-type]  # storage: a name
    if found is None:
        raise ValueError(f"dtype={dtype!r}: this torch build ({torch.__version__}) has no "
                         f"torch.{fmt.torch_name}; install a torch that has it "
                         "(see requirements.txt)")  # fmt: skip
    return found
