"""Exercise checks for notebook 02b (beyond one machine), run in the kernel.

* ``02b.checkpoint_plan``  ``checkpoint_plan(blocking_s, restart_s, mtbf_s) -> (interval_s,
  waste)``: how often to checkpoint, from a save that stops training for ``blocking_s``
  seconds (measured in the notebook, synchronous and asynchronous), a restart of ``restart_s``
  seconds (measured too) and a failure every ``mtbf_s`` seconds on average; and the share of
  the time that plan loses to saving, to lost work and to restarts. Checked on cases where the
  usual mistakes give different numbers; the notebook then plans with the learner's function
  for both kinds of save and holds the two plans side by side.

Registers with :func:`labkit.course.exercises.exercise`; importing this module does nothing else.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from labkit.course.exercises import ExerciseFailed, call, exercise, short_repr
from labkit.course.exercises.learner_code import callable_name, require_callable


def reference_checkpoint_plan(blocking_s: float, restart_s: float, mtbf_s: float) -> tuple[float, float]:
    """What later cells use while the learner's answer is not done or wrong: Young's interval
    and the first-order waste, restart included (``labkit.formulas``)."""
    from labkit import formulas

    tau = formulas.young_checkpoint_interval(blocking_s, mtbf_s)
    return tau, formulas.checkpoint_waste_fraction(tau, blocking_s, mtbf_s, restart_s)


# (blocking_s, restart_s, mtbf_s): a slow synchronous save, a fast asynchronous one, a restart
# that dominates, and one with none, so each usual mistake gives a number of its own
CASES = (
    (60.0, 600.0, 11136.0),
    (0.5, 30.0, 11136.0),
    (20.0, 0.0, 3600.0),
    (2.0, 120.0, 86400.0),
)


def _interval_diagnosis(delta: float, m: float, got: float) -> str:
    right = math.sqrt(2 * delta * m)
    mistakes = [
        (math.sqrt(delta * m), "that is √(δM): the lost work per failure is half an interval on "
                               "average, τ/2, which puts a 2 under the root"),
        (2 * delta * m, "that is 2δM without the square root: set the derivative of "
                        "δ/τ + τ/(2M) to zero and solve for τ"),
        (right / 60, "that looks like minutes: keep every time in seconds"),
        (right - delta, "that is Daly's first-order correction, √(2δM) − δ; this exercise asks "
                        "for Young's √(2δM) (the notebook prints Daly's beside it)"),
        (m, "that is the mean time between failures itself: the interval balances the cost of a "
            "save against the work a failure loses"),
    ]
    for wrong, why in mistakes:
        if math.isclose(got, wrong, rel_tol=1e-6):
            return why
    return ("balance the two costs per unit of time: δ/τ spent saving, and (τ/2)/M of work "
            "lost to failures")


def _waste_diagnosis(tau: float, delta: float, m: float, r: float, got: float) -> str:
    right = delta / tau + (tau / 2 + r) / m
    mistakes = [
        (delta / tau + tau / (2 * m), "the restart is missing: every failure also costs the "
                                      "restart time, r/M of the time"),
        (delta / tau + (tau + r) / m, "a failure loses τ/2 of work on average (it strikes "
                                      "anywhere in the interval), not τ"),
        (delta / tau, "that counts the saves only: failures lose work and restarts too"),
        ((tau / 2 + r) / m, "that leaves out the saves themselves, δ/τ"),
        (100 * right, "that looks like a percentage: return a fraction (0.05, not 5)"),
    ]
    for wrong, why in mistakes:
        if math.isclose(got, wrong, rel_tol=1e-6):
            return why
    return "add the three shares of the time: saving, lost work and restarting"


@exercise(
    "02b.checkpoint_plan",
    "Plan how often to checkpoint, from measured save and restart times",
    hints=(
        "saving more often costs more saves; saving less often loses more work when a failure "
        "strikes. Write each as a share of the time and find the interval where their sum is "
        "least; then add what a restart costs per failure",
        "a save every τ seconds that stops training for δ: which share of the time goes to "
        "saving? A failure, every M seconds on average, strikes on average half-way through an "
        "interval: how much work does it lose, and what does the restart r add to that? What "
        "one failure costs, divided by M, is the share of the time failures take",
        "the restart's share does not depend on τ, so it cannot move the best interval; it only "
        "adds to the waste. The best τ (Young's interval) is where the derivative, with respect "
        "to τ, of the other two shares together is zero",
        "recipe: write the shares of the time lost to saves and to lost work as one function of "
        "τ; set its derivative with respect to τ to zero and solve for the positive τ; the "
        "waste is the three shares (saves, lost work, restarts) added up at that τ; return the "
        "interval in seconds and the waste as a fraction of the time",
    ),
    reference=reference_checkpoint_plan,
)
def _verify_checkpoint_plan(checkpoint_plan: Any) -> str:
    fn = require_callable(checkpoint_plan,
                           "checkpoint_plan(blocking_s, restart_s, mtbf_s) -> (interval_s, waste)")  # fmt: skip
    for delta, r, m in CASES:
        shown = f"{callable_name(fn)}({delta:g}, {r:g}, {m:g})"
        got = call(fn, delta, r, m)
        if (not isinstance(got, tuple | list) or len(got) != 2
                or not all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in got)):  # fmt: skip
            raise ExerciseFailed(f"{shown} returned {short_repr(got)}: return two numbers, "
                                 "(interval in seconds, waste as a fraction of the time)")  # fmt: skip
        tau, waste = float(got[0]), float(got[1])
        want_tau, _ = reference_checkpoint_plan(delta, r, m)
        if not math.isclose(tau, want_tau, rel_tol=1e-6):
            raise ExerciseFailed(f"{shown} gave an interval of {tau:,.6g} s, which is not the "
                                 f"optimum for a save of {delta:g} s and a failure every "
                                 f"{m:g} s: {_interval_diagnosis(delta, m, tau)}")  # fmt: skip
        want = delta / tau + (tau / 2 + r) / m
        if not math.isclose(waste, want, rel_tol=1e-6):
            raise ExerciseFailed(f"{shown} gave a waste of {waste:.6g} at your interval, which "
                                 f"is not the share of the time lost with a {r:g} s restart: "
                                 f"{_waste_diagnosis(tau, delta, m, r, waste)}")  # fmt: skip
    return (f"{callable_name(fn)} gives Young's √(2δM) and the waste δ/τ + (τ/2 + r)/M on four cases "
            "(slow and fast saves, long and no restarts); below it plans both kinds of save")
