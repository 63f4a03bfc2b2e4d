"""The speed of a training step per precision: step times with the dtypes taking turns
(:func:`step_times`), and where a step's time goes (:func:`profile_step`): is the 16-bit
arithmetic engaged, and how much of the step could it speed up at all?

Apart from the formats and autocast because it times and profiles whole training steps.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from labkit.formulas import dtype_name
from labkit.op_kinds import is_matmul
from labkit.precision.autocast import checked_autocast
from labkit.validate import whole

if TYPE_CHECKING:
    from labkit.config import TrainConfig

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

    Matrix multiplies are the ATen ops :func:`labkit.op_kinds.is_matmul` names, grouped by the
    dtype of their first input, which is what tells whether autocast engaged them in 16 bits
    (PyTorch profiler, ``record_shapes=True`` records each op's input dtypes). Attention is every op
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

    steps = whole("steps", steps, low=1)
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
        if is_matmul(e.name):
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
