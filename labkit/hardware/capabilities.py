"""What a device runs: the autocast dtype its compute capability calls for, and which attention
kernel ``F.scaled_dot_product_attention`` picks for a shape.

Apart from the tables because these are rules and probes, not published figures: bf16 from
compute capability 8.0 (Ampere), fp16 with a GradScaler on a T4 or V100 (``autocast_dtype_for``,
a pure function); and the SDPA kernel found by running it once (``sdpa_backend``), since the
activation-memory prediction assumes a fused one.

    from labkit import hardware
    print(hardware.autocast_dtype_for((7, 5)).dtype)      # float16
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

BF16_MIN_CAPABILITY = (8, 0)
"""bf16 (and tf32) tensor cores arrived with Ampere, compute capability 8.0 (NVIDIA A100
whitepaper; https://developer.nvidia.com/cuda-gpus lists each GPU's capability). A T4 (7.5) or
V100 (7.0) accepts bf16 tensors, but ``torch.cuda.is_bf16_supported()`` only says so because
it can *emulate* them (``including_emulation=True``, torch/cuda/__init__.py): the matmuls run
without tensor cores."""
TENSOR_CORE_MIN_CAPABILITY = (7, 0)
"""fp16 tensor cores arrived with Volta, compute capability 7.0 (NVIDIA V100 datasheet)."""


class AutocastChoice(NamedTuple):
    """The autocast dtype a run should use on a device, and why.

    ``dtype`` is a ``TrainConfig.dtype`` value ("bfloat16", "float16" or "float32": autocast
    off). ``scaler`` says whether a loss scaler (``torch.amp.GradScaler``) must go with it:
    float16 only, since its 5 exponent bits flush small gradients to zero (Micikevicius et al.
    2018, arXiv 1710.03740) while bfloat16 keeps float32's 8.
    """

    dtype: str
    scaler: bool
    reason: str

    def describe(self) -> str:
        """The line a notebook prints where it picks its training dtype: what, and why.

        >>> print(autocast_dtype_for((8, 9)).describe().split(":")[0])
        training dtype bfloat16
        """
        scaling = ", with a loss scaler (torch.amp.GradScaler)" if self.scaler else ""
        return f"training dtype {self.dtype}{scaling}: {self.reason}"


def _check_capability(capability: Any) -> tuple[int, int] | None:
    if capability is None:
        return None
    ok = (isinstance(capability, (tuple, list)) and len(capability) == 2
          and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in capability))
    if not ok:
        raise ValueError(
            f"capability={capability!r} is not a compute capability: pass (major, minor) as "
            "torch.cuda.get_device_capability(device) returns it, e.g. (8, 0), or None for a "
            "machine without a CUDA GPU"
        )
    return int(capability[0]), int(capability[1])


def autocast_dtype_for(
    capability: tuple[int, int] | None, requested: str | None = None
) -> AutocastChoice:
    """The autocast dtype to train in on a GPU of this compute capability (a pure function).

    ``capability`` is ``torch.cuda.get_device_capability(device)``, or None for no CUDA GPU.
    ``requested`` is what a config asked for ("bfloat16", "float16", "float32"); None asks for
    the default. The rule, from the hardware (see ``BF16_MIN_CAPABILITY``):

    * 8.0 and newer (A100, A10, L4, L40S, H100, H200, GH200): bfloat16, no loss scaling;
    * 7.0 to 7.5 (V100, T4): float16 with a GradScaler. A request for bfloat16 becomes float16
      with the reason: bf16 there is emulated without tensor cores (slower than fp16, and with
      no published peak to compute MFU against);
    * older GPUs have no tensor cores: float32 by default;
    * no CUDA GPU (None): float32 by default (the CPU presets); a request is kept, since CPU
      autocast runs bf16 and fp16 (``labkit.precision.checked_autocast`` refuses what it cannot).

    float32 and float16 requests are always kept; a float16 run gets ``scaler=True``.

    >>> autocast_dtype_for((7, 5)).dtype, autocast_dtype_for((9, 0)).dtype
    ('float16', 'bfloat16')
    """
    cc = _check_capability(capability)
    allowed = ("bfloat16", "float16", "float32")
    if requested is not None and requested not in allowed:
        raise ValueError(f"requested={requested!r} is not an autocast dtype labkit trains in: "
                         f"one of {', '.join(map(repr, allowed))}, or None for the default")  # fmt: skip
    where = "no CUDA GPU" if cc is None else f"compute capability {cc[0]}.{cc[1]}"
    if requested == "float32":
        return AutocastChoice("float32", False, f"float32 requested ({where}): autocast off")
    if requested == "float16":
        return AutocastChoice("float16", True, f"float16 requested ({where}): with a "
                              "GradScaler, since fp16's range flushes small gradients to zero")  # fmt: skip
    if cc is None:
        if requested == "bfloat16":
            return AutocastChoice("bfloat16", False, "bfloat16 requested on the CPU: CPU "
                                  "autocast runs it (fast only with AVX512-BF16 or AMX, see "
                                  "cpu_info().flags)")  # fmt: skip
        return AutocastChoice("float32", False, "no CUDA GPU: float32, autocast off (the CPU "
                              "presets' default)")  # fmt: skip
    if cc >= BF16_MIN_CAPABILITY:
        return AutocastChoice("bfloat16", False, f"{where} (Ampere or newer) has bf16 tensor "
                              "cores; bf16 keeps fp32's exponent range, so no loss scaling")  # fmt: skip
    if cc >= TENSOR_CORE_MIN_CAPABILITY:
        asked = "bfloat16 requested, but " if requested == "bfloat16" else ""
        return AutocastChoice("float16", True, f"{asked}{where} has fp16 tensor cores and no "
                              "bf16 ones (bf16 arrived with 8.0, Ampere; here it is emulated "
                              "without tensor cores): float16 with a GradScaler")  # fmt: skip
    if requested == "bfloat16":
        return AutocastChoice("float32", False, f"bfloat16 requested, but {where} has neither "
                              "bf16 support nor tensor cores: float32")  # fmt: skip
    return AutocastChoice("float32", False, f"{where} has no tensor cores (they arrived with "
                          "7.0, Volta): float32")  # fmt: skip


def default_autocast_dtype(
    device: str | torch.device | None = None, requested: str | None = None, *,
    cuda: Any | None = None,
) -> AutocastChoice:
    """:func:`autocast_dtype_for` with the capability read from ``device`` (default: CUDA's
    current device if there is one). A CUDA device initialises CUDA; a CPU device does not."""
    cuda = torch.cuda if cuda is None else cuda
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type != "cuda":
        return autocast_dtype_for(None, requested)
    if not cuda.is_available():
        if dev is not None:
            raise ValueError(f"device={str(dev)!r} but torch.cuda.is_available() is False: "
                             "pass device='cpu', or install a CUDA build of torch")  # fmt: skip
        return autocast_dtype_for(None, requested)
    index = dev.index if dev is not None and dev.index is not None else cuda.current_device()
    major, minor = cuda.get_device_capability(index)
    return autocast_dtype_for((int(major), int(minor)), requested)


# The aten ops behind each fused SDPA kernel, as torch 2.13's dispatcher names them. The math
# kernel has no op of its own: it is composite (matmul, softmax, matmul), which is exactly why
# it stores the s×s attention matrix for the backward pass.
SDPA_FUSED_OPS = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_fused_attention_overrideable": "overrideable",
}
_SDPA_DOCS = ("https://docs.pytorch.org/docs/stable/generated/"
              "torch.nn.functional.scaled_dot_product_attention.html")


@dataclass(frozen=True)
class SdpaCheck:
    """Which kernel ``F.scaled_dot_product_attention`` ran for one shape, found by running it.

    ``backend`` is "flash", "efficient", "cudnn", "overrideable" or "math". Every fused kernel
    keeps one float32 log-sum-exp per row instead of the s×s matrix, so the memory prediction
    ``formulas.activation_bytes_per_layer(attention=...)`` takes ``formula_attention``: "flash"
    for a fused kernel, "materialized" for math. ``warning`` is the sentence a notebook prints
    when the prediction's default assumption (a fused kernel) does not hold; None when it does.
    """

    backend: str
    op: str | None  # the aten op observed; None for math, which has none of its own
    device: str
    dtype: str
    seq_len: int
    head_dim: int
    dropout_p: float
    is_causal: bool
    pinned: tuple[str, ...]  # the SDPBackend names the probe was limited to; () if none

    @property
    def materializes_scores(self) -> bool:
        return self.backend == "math"

    @property
    def formula_attention(self) -> str:
        return "materialized" if self.materializes_scores else "flash"

    @property
    def warning(self) -> str | None:
        if not self.materializes_scores:
            return None
        drop = f", dropout {self.dropout_p:g}" if self.dropout_p else ""
        return (
            f"SDPA ran its math kernel here ({self.device}, {self.dtype}, s={self.seq_len}, "
            f"head size {self.head_dim}{drop}): it stores the s×s attention matrix for backward "
            "(a·s²·b values per layer, more with dropout), which a prediction that assumes a "
            "fused kernel (attention='flash') leaves out. Predict with "
            "attention='materialized', or pin the fused kernels with "
            "torch.nn.attention.sdpa_kernel([SDPBackend.FLASH_ATTENTION, "
            "SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]) so that torch raises "
            f"instead of falling back ({_SDPA_DOCS})"
        )

    def __str__(self) -> str:
        kind = ("stores the s×s matrix" if self.materializes_scores
                else "no s×s matrix, one log-sum-exp per row")  # fmt: skip
        pin = f", limited to {', '.join(self.pinned)}" if self.pinned else ""
        return (f"SDPA backend: {self.backend} ({kind}), measured on {self.device}, "
                f"{self.dtype}, s={self.seq_len}, head size {self.head_dim}{pin}")  # fmt: skip


def sdpa_backend(
    *,
    seq_len: int,
    head_dim: int,
    n_head: int = 1,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    is_causal: bool = True,
    dropout_p: float = 0.0,
    requires_grad: bool = True,
    backends: Sequence[Any] | None = None,
) -> SdpaCheck:
    """Which SDPA kernel runs for this shape here: measured by running it once, not guessed.

    One ``F.scaled_dot_product_attention`` call on random (1, n_head, seq_len, head_dim)
    tensors of ``dtype`` on ``device`` runs under a ``TorchDispatchMode`` that records the aten
    ops it reaches; a fused kernel shows up as its own op (``SDPA_FUSED_OPS``), the math kernel
    as none. The choice depends on all of device, dtype, head size, dropout, mask and whether
    gradients are needed (torch's sdp_utils): on CUDA, flash needs fp16/bf16 and compute
    capability 8.0+, the memory-efficient kernel also runs fp32 and older GPUs (but bf16 only
    from 8.0, so bf16 on a T4 falls back to math); on CPU, torch 2.13 runs a flash-style kernel
    unless dropout is on. Pass the shapes and dtype of the real model (under autocast, the
    autocast dtype). ``backends`` (``torch.nn.attention.SDPBackend`` members) limits the probe
    as ``torch.nn.attention.sdpa_kernel`` would; a limit nothing satisfies raises torch's own
    "No available kernel" error, which is how a notebook can *enforce* a fused kernel.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel  # torch.nn.attention: on use only
    from torch.utils._python_dispatch import TorchDispatchMode

    for name, value in (("seq_len", seq_len), ("head_dim", head_dim), ("n_head", n_head)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r} is not allowed: a positive integer")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p={dropout_p!r} is not allowed: a probability in [0, 1)")
    dt = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not a floating-point torch dtype "
                         "(torch.float32, torch.bfloat16, torch.float16)")  # fmt: skip
    pinned = [] if backends is None else list(backends)
    if any(not isinstance(b, SDPBackend) for b in pinned):
        raise ValueError(f"backends={backends!r}: pass torch.nn.attention.SDPBackend members")
    dev = torch.device(device)

    ops: list[str] = []

    class _Record(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Sequence = (),
                               kwargs: dict | None = None) -> Any:  # fmt: skip
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    gen = torch.Generator(device=dev).manual_seed(0)  # leaves the global RNG alone
    q, k, v = (torch.randn(1, n_head, seq_len, head_dim, generator=gen, device=dev, dtype=dt)
               .requires_grad_(requires_grad) for _ in range(3))  # fmt: skip
    limit = sdpa_kernel(pinned) if pinned else contextlib.nullcontext()
    with limit, _Record():
        torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=is_causal, dropout_p=dropout_p
        )
    fused = [op for op in ops if op in SDPA_FUSED_OPS]
    return SdpaCheck(
        backend=SDPA_FUSED_OPS[fused[0]] if fused else "math",
        op=fused[0] if fused else None,
        device=str(dev),
        dtype=str(dt).removeprefix("torch."),
        seq_len=seq_len,
        head_dim=head_dim,
        dropout_p=float(dropout_p),
        is_causal=is_causal,
        pinned=tuple(b.name for b in pinned),
    )

