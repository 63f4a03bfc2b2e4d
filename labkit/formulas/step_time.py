"""Step times from measured parts: what a changed step will take, before it is timed.

Closed forms over seconds a notebook has measured (a single step, its once-per-step update);
the measuring stays with the code that runs the step (``labkit.batching.accumulation``).
"""

from __future__ import annotations

import math

from labkit.validate import whole


def predict_accumulated_seconds(single_step_s: float, update_s: float, k: int) -> float:
    """Predicted seconds of one optimiser step that accumulates k micro-batches of b sequences.

    ``single_step_s``: a measured single step at micro-batch b, t(b); ``update_s``: the measured
    once-per-step cost u (``labkit.batching.accumulation.measure_update_seconds``), part of every single step. k single
    steps pay k passes and k updates; the accumulated step pays the same k passes and one
    update::

        t_acc = k·t(b) - (k - 1)·u

    What it assumes: a pass over b sequences costs the same whether its gradients go into
    fresh ``.grad`` tensors or are added to the ones already there.
    """
    for name, v in (("single_step_s", single_step_s), ("update_s", update_s)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{name}={v!r} is not allowed: a finite number of seconds >= 0")
    k = whole("k", k, low=1)
    if update_s > single_step_s:
        raise ValueError(f"update_s={update_s!r} is more than the whole step "
                         f"single_step_s={single_step_s!r}: the update is part of the step")
    return k * single_step_s - (k - 1) * update_s
