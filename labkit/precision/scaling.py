"""Dynamic loss scaling: :class:`ManualScaler`, ``torch.amp.GradScaler``'s algorithm in readable
Python, with a history of the scale per step.

The one loss scaler of labkit: ``labkit.train.train_step`` takes it as its ``scaler``, and
notebook 04's exercise uses it as its reference (``course.exercises.mixed_precision``).
Sources ([MPT], [AMP], [scaler]): see :mod:`labkit.precision`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from labkit.validate import whole

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
        growth_interval = whole("growth_interval", growth_interval, low=1)
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
