"""Autocast: which dtype each module and functional op of a model runs in under ``torch.autocast``,
recorded with hooks on the real model (:func:`capture_dtypes`).

Where torch would only warn and quietly run in fp32, :func:`checked_autocast` refuses instead.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from labkit.precision.formats import dtype_of, format_name

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


def describe_dtypes(rows: Sequence[DtypeRow], *, device_type: str, dtype: str) -> str:
    """``capture_dtypes``' rows as a table: one line per kind of op (op, weight, input and
    output dtypes), with how often it ran and the first module it ran in as an example."""
    seen: dict[tuple, list] = {}
    for r in rows:
        key = (r.op, r.param_dtype, r.input_dtypes, r.output_dtype)
        seen.setdefault(key, [0, r.module])[0] += 1
    lines = [f"autocast to {dtype} on {device_type}, measured on the real model "
             f"({len(rows)} op calls):",
             f"{'op':<32}{'calls':>6}  {'weights':<9}{'inputs':<30}{'output':<10}example"]
    for (op, param, inputs, output), (count, module) in seen.items():
        lines.append(f"{op:<32}{count:>6}  {param or '-':<9}{', '.join(inputs):<30}"
                     f"{output or '-':<10}{module or '(model)'}")
    return "\n".join(lines)


def describe_here(device_type: str, formats: Sequence[str], tier: Any = None,
                  choice: Any = None) -> str:
    """What notebook 04 can show on this machine: the tier (``labkit.hardware.describe_tier``
    unless given), the formats autocast accepts here, and which figures are real on this tier.
    On a GPU, also the training dtype its compute capability calls for and why
    (``choice``: ``labkit.hardware.default_autocast_dtype`` unless given): on a T4 or V100,
    autocast accepts bf16 but runs it without tensor cores."""
    from labkit import hardware  # a lower layer; imported here, where it is needed

    if tier is None:
        tier = hardware.describe_tier()
    lines = [str(tier), f"\nautocast on {device_type} accepts: {', '.join(formats)}"]
    if device_type == "cuda":
        choice = hardware.default_autocast_dtype("cuda") if choice is None else choice
        lines.append(choice.describe())
        # a GPU before compute capability 8.0 gets fp16 by default: it has no bf16 or tf32 units
        which = ("fp32 and fp16; bf16 runs are emulated, without tensor cores"
                 if choice.dtype == "float16" else "tf32 included")  # fmt: skip
        lines.append("This tier shows real GPU numerics and speed: tensor-core matmuls per "
                     f"precision ({which}), memory, and fp8 training if the GPU has compute "
                     "capability ≥ 8.9.")
    else:
        lines.append(
            "This tier shows the numerics for real: formats, rounding, underflow and loss scaling\n"
            "are the same arithmetic on a CPU as on a GPU (autocast's op lists differ a little by\n"
            "device: section 4), and memory is counted from real tensors. Speed is this CPU's, "
            "measured; it is not a GPU's, and no GPU\nnumber below is invented. tf32 and fp8 "
            "training need an NVIDIA GPU.")
    return "\n".join(lines)
