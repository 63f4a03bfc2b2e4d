"""Checkpoints: their size in bytes, and how often to write them (Young, Daly).

A checkpoint's bytes per parameter (weights and optimizer state, no gradients) and the
interval between checkpoints that wastes the least time for a given save time and mean time
between failures. Together because a notebook sizes a checkpoint to time its save, then
chooses the interval from that time.
"""

from __future__ import annotations

import math
from typing import Any

from labkit.formulas.state_bytes import OPTIMIZER_STATES, dtype_bytes
from labkit.validate import number, one_of, positive


def checkpoint_bytes_per_param(
    weight_dtype: Any = "float32", optimizer: str = "adamw", state_dtype: Any = "float32"
) -> int:
    """Bytes a checkpoint holds per trainable parameter: its weight and its optimizer state.

    fp32 AdamW: 4 (weight) + 2 × 4 (m and v) = 12 B. Gradients are not saved: a resumed step
    computes them afresh. Training memory counts 16 B for the same setup (``fp32_adam``): the
    4 B of gradients are the difference. Optimizer states per parameter: ``OPTIMIZER_STATES``.
    """
    one_of("optimizer", optimizer, tuple(OPTIMIZER_STATES))
    return dtype_bytes(weight_dtype) + OPTIMIZER_STATES[optimizer] * dtype_bytes(state_dtype)


def checkpoint_bytes(
    n_params: float,
    *,
    weight_dtype: Any = "float32",
    optimizer: str = "adamw",
    state_dtype: Any = "float32",
    n_trainable: float | None = None,
    aliased_params: float = 0,
    n_tensors: int = 0,
    bytes_per_tensor: float = 0.0,
) -> float:
    """Bytes of a checkpoint of weights and optimizer state::

        (N + A)·w + N_t·k·s + T·o

    N parameters (``n_params``, each counted once) of w bytes; N_t of them trainable (default
    all), each with k optimizer states of s bytes; A parameters the state dict names twice
    (``aliased_params``: a tied embedding saved as both ``wte.weight`` and ``lm_head.weight``,
    written once per name); T tensors (``n_tensors``) costing o bytes each in the file format
    (``bytes_per_tensor``: headers, the index). Weights plus states are the bytes-per-parameter
    count of ``checkpoint_bytes_per_param``.
    """
    n = number("n_params", n_params, low=0)
    trainable = n if n_trainable is None else number("n_trainable", n_trainable, low=0)
    one_of("optimizer", optimizer, tuple(OPTIMIZER_STATES))
    w, s = dtype_bytes(weight_dtype), dtype_bytes(state_dtype)
    states = OPTIMIZER_STATES[optimizer] * s
    tensors = number("n_tensors", n_tensors, low=0)
    per_tensor = number("bytes_per_tensor", bytes_per_tensor, low=0)
    aliased = number("aliased_params", aliased_params, low=0)
    return (n + aliased) * w + trainable * states + tensors * per_tensor


def young_checkpoint_interval(save_s: float, mtbf_s: float) -> float:
    """Seconds of training between checkpoints that waste the least time: √(2·δ·M).

    Young, "A first order approximation to the optimum checkpoint interval", Communications of
    the ACM 17(9), 1974. A checkpoint that stops training for δ seconds, taken every τ seconds
    of work, costs δ/τ of the time; a failure (one every M seconds on average, the job's mean
    time between failures) loses on average τ/2 of work since the last one. The sum
    δ/τ + τ/(2M) is least at τ = √(2δM). First order: good while δ ≪ τ ≪ M.
    """
    return math.sqrt(2 * positive("save_s", save_s) * positive("mtbf_s", mtbf_s))


def daly_checkpoint_interval(save_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum checkpoint interval, seconds of work between checkpoints.

    Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
    Future Generation Computer Systems 22(3), 2006 (doi:10.1016/j.future.2004.11.016), eq. 37:
    τ = √(2δM)·[1 + ⅓·√(δ/2M) + ⅑·(δ/2M)] − δ for δ < 2M, else τ = M. It corrects Young's
    √(2δM) (``young_checkpoint_interval``) for the time the saves themselves take, and stays
    valid where δ is not small against M; to first order it is √(2δM) − δ.
    """
    delta = positive("save_s", save_s)
    m = positive("mtbf_s", mtbf_s)
    if delta >= 2 * m:
        return m
    r = delta / (2 * m)
    return math.sqrt(2 * delta * m) * (1 + math.sqrt(r) / 3 + r / 9) - delta


def checkpoint_waste_fraction(interval_s: float, save_s: float, mtbf_s: float,
                              restart_s: float = 0.0) -> float:  # fmt: skip
    """Share of the time lost to checkpoints and failures, to first order (Young 1974):
    δ/τ for writing them, and per failure, every M seconds, τ/2 of lost work plus the restart."""
    tau = positive("interval_s", interval_s)
    delta = number("save_s", save_s, low=0)
    m = positive("mtbf_s", mtbf_s)
    return delta / tau + (tau / 2 + number("restart_s", restart_s, low=0)) / m


def predicted_lost_steps(kill_at_step: int, every: int) -> int:
    """Steps trained again after a kill once ``kill_at_step`` steps were done: those since the
    last checkpoint, taken every ``every`` steps."""
    return kill_at_step % every
