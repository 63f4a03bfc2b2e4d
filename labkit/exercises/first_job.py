"""Exercise checks for notebook 00 (setup and a first job), run in the kernel.

* ``00.ring_bytes``  ``ring_bytes_sent(numel, n_ranks, bytes_per_element=4) -> float``: the
  bytes one rank sends in a ring all-reduce of ``numel`` elements over ``n_ranks`` ranks.
  Checked against the formula on 1 to 8 ranks (a measurement on 2 ranks alone cannot tell the
  whole message from the right answer); the notebook then holds the learner's prediction
  against the bytes the loopback interface counted during the job.

Registers with :func:`labkit.exercises.exercise`; importing this module does nothing else.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from labkit.exercises import ExerciseFailed, _name, _require_callable, call, exercise, short_repr


def reference_ring_bytes_sent(numel: int, n_ranks: int, bytes_per_element: int = 4) -> float:
    """What later cells use while the learner's answer is not done or wrong."""
    from labkit import formulas

    return formulas.ring_allreduce_bytes_per_rank(numel * bytes_per_element, n_ranks)


# (numel, n_ranks, bytes_per_element). Two ranks first, the notebook's job; then shapes where
# the usual mistakes give different numbers: on 2 ranks "the whole message" is right by luck.
RING_CASES = (
    (2**16, 2, 4),
    (3000, 3, 4),
    (1000, 4, 4),
    (2**20, 8, 2),
    (12, 1, 4),
)


def _ring_diagnosis(numel: int, p: int, e: int, got: float) -> str:
    """Name the usual mistake that gives exactly ``got``, if one does."""
    S = numel * e
    right = 2 * (p - 1) / p * S
    mistakes = [
        (S, "that is the whole message S: right on 2 ranks only, where 2(p−1)/p = 1, which is "
            "why a measurement on 2 ranks cannot tell the two apart. With more ranks each rank "
            "sends less than S per phase: one chunk of S/p per step"),
        (2 * S, "that is the whole message twice (once per phase); each step sends only one "
                "chunk of S/p, not all of S"),
        ((p - 1) / p * S, "that is the reduce-scatter alone; the all-gather that follows sends "
                          "as much again"),
        (2 * (p - 1) * S, "that is 2(p−1)·S: the whole message at each of the 2(p−1) steps "
                          "(a step sends one chunk, S/p), or what all p ranks send together "
                          "(what the loopback interface counts for a whole job), not one rank"),
        (right / e, "that counts elements, not bytes: multiply by bytes_per_element"),
        (right * 4 / e, f"that is right for 4-byte elements, but this case passes "
                        f"bytes_per_element={e}: the answer must use that argument, not a fixed "
                        "4 bytes"),
        (right / 2, "that is half of it: a rank also sends during the all-gather, not only "
                    "the reduce-scatter (or the other way round)"),
    ]
    for wrong, why in mistakes:
        if wrong != right and math.isclose(got, wrong, rel_tol=1e-9):
            return why
    return ("count per phase: how many steps, and how many bytes in each step, for one rank")


@exercise(
    "00.ring_bytes",
    "Predict the bytes each rank sends in a ring all-reduce",
    hints=(
        "a ring all-reduce is two phases, a reduce-scatter and then an all-gather; count the "
        "bytes one rank sends in each and add them",
        "the message of S = numel × bytes_per_element bytes is cut into p chunks of S/p, one "
        "per rank. In the reduce-scatter each rank sends one chunk to its neighbour per step, "
        "for p − 1 steps; after that each rank holds one chunk fully summed",
        "the all-gather passes the summed chunks around the ring: again p − 1 steps of one "
        "chunk each. On 2 ranks the total is exactly S, so a measurement on 2 ranks cannot tell "
        "S from the right formula: the check asks about 1, 3, 4 and 8 ranks too",
        "recipe: return 2 * (n_ranks - 1) / n_ranks * numel * bytes_per_element",
    ),
    reference=reference_ring_bytes_sent,
)
def _verify_ring_bytes(ring_bytes_sent: Any) -> str:
    fn = _require_callable(ring_bytes_sent,
                           "ring_bytes_sent(numel, n_ranks, bytes_per_element=4) -> float")  # fmt: skip
    for numel, p, e in RING_CASES:
        got = call(fn, numel, p, e)
        shown = f"{_name(fn)}({numel}, {p}, {e})"
        if isinstance(got, bool) or not isinstance(got, numbers.Real):
            raise ExerciseFailed(f"{shown} returned {type(got).__name__} {short_repr(got)}; "
                                 "return a number of bytes (an int or a float)")  # fmt: skip
        right = reference_ring_bytes_sent(numel, p, e)
        if not math.isclose(float(got), right, rel_tol=1e-9, abs_tol=1e-9):
            raise ExerciseFailed(
                # The diagnosis, not the target: printing the expected bytes would hand over
                # the answer the hints lead to one step at a time.
                f"{shown} returned {got:,.6g} bytes, which is not what one rank sends in a ring "
                f"all-reduce of {numel:,} elements of {e} bytes over {p} "
                f"rank{'s' if p != 1 else ''}: {_ring_diagnosis(numel, p, e, float(got))}"
            )
    return (f"{_name(fn)}(numel, n_ranks, bytes_per_element) is 2(p−1)/p × numel × "
            "bytes_per_element on 1, 2, 3, 4 and 8 ranks; below, it predicts the bytes the "
            "loopback interface counts")  # fmt: skip
