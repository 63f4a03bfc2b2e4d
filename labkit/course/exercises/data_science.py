"""Notebook 08's exercises (multi-GPU training for the data scientist's models), in the kernel.

* ``08.round_bytes``: ``round_bytes(features, max_bin, max_depth, workers) -> float``: the bytes
  one boosting round of XGBoost's ``hist`` puts on the wire, all workers together, for a full
  tree of continuous features; checked against
  :func:`labkit.formulas.boosting.hist_round_wire_bytes` on shapes chosen so that each usual
  mistake (no hessian, every node's histogram, the leaves' level, the textbook ring, one
  worker's share) gives a different number, which the check names.
* ``08.matrix_bytes``: ``matrix_bytes(rows, features, max_bin, quantile) -> int``: the bytes a
  ``QuantileDMatrix`` (``quantile=True``) or a ``DMatrix`` holds once ``hist`` trained on it,
  against :func:`labkit.formulas.boosting.quantised_bytes` and ``dmatrix_bytes``.

:func:`reveal` gives each exercise's closed form once the learner's answer passed: the notebook's
markdown gives the mechanisms, not the formula. Registers with
:func:`labkit.course.exercises.exercise`; importing this module does nothing else.
"""

from __future__ import annotations

import math
from typing import Any

from labkit.course.exercises import ExerciseFailed, call, exercise, short_repr, whose
from labkit.course.exercises.learner_code import callable_name, require_callable
from labkit.formulas import boosting

# --------------------------------------------------------------------------- 08.round_bytes


def reference_round_bytes(features: int, max_bin: int, max_depth: int, workers: int) -> float:
    return boosting.hist_round_wire_bytes(features, max_bin, max_depth, workers)


ROUND_CASES = ((16, 64, 6, 2), (28, 256, 4, 2), (10, 32, 8, 4), (50, 128, 3, 3), (16, 64, 6, 1))


def _full_tree(features: int, max_bin: int, depth: int, workers: int, *, values: int = 2,
               nodes: int | None = None, factor: float | None = None) -> float:
    s = features * max_bin * values * 8 * (2 ** (depth - 1) if nodes is None else nodes)
    return s * (2 * workers - 1 if factor is None else factor)


def _round_mistakes(f: int, b: int, d: int, w: int) -> list[tuple[float, str]]:
    return [
        (_full_tree(f, b, d, w, values=1),
         "half the bytes: each bin holds two float64 values, the gradient and the hessian"),
        (_full_tree(f, b, d, w, nodes=2**d - 1),
         "every node of the tree sends its histogram here; with the subtraction trick only one "
         "child of each split is built and all-reduced (its sibling is the parent's minus it)"),
        (_full_tree(f, b, d, w, nodes=2**d),
         "the leaves' level sends histograms here; a node at depth max_depth cannot split, so "
         "no histogram is built for it"),
        (_full_tree(f, b, d, w, factor=2 * (w - 1)),
         "this is the textbook ring, 2(w-1)·S; read how XGBoost's all-gather loop runs "
         "(src/collective/allgather.cc): each worker sends w segments there, not w - 1"),
        (_full_tree(f, b, d, w, factor=(2 * w - 1) / w),
         "this is one worker's share; the question asks for all workers together"),
        (_full_tree(f, b, d, w, factor=1),
         "this is the message one worker puts into the all-reduce, not what the ring sends"),
    ]


def _round_diagnosis(fn: Any) -> str:
    """The one mistake that explains the answers on every shape of several workers (on two
    workers alone, half the bytes and one worker's share are the same number)."""
    cases = [c for c in ROUND_CASES if c[3] > 1]
    answers = [call(fn, *c) for c in cases]
    for i, (_, why) in enumerate(_round_mistakes(*cases[0])):
        if all(isinstance(a, (int, float)) and math.isclose(a, _round_mistakes(*c)[i][0], rel_tol=1e-9)
               for a, c in zip(answers, cases, strict=True)):  # fmt: skip
            return why
    return ("count the parts again: one node's histogram in bytes, the node histograms of a "
            "full tree, then what XGBoost's ring sends of the message (ex.hint gives them in steps)")


@exercise(
    "08.round_bytes",
    "Predict the bytes one boosting round puts on the wire",
    hints=(
        "a round all-reduces histograms only: for each node whose split is searched, one "
        "histogram per feature, summed over the workers; count the histograms, their bytes, "
        "and what the ring does with a message",
        "one node's histogram: every bin of every feature holds two float64 sums, so 16 bytes per "
        "bin; the nodes per level: the root, then one child of each node split (the subtraction "
        "trick gives the other), down to depth max_depth - 1, so 1 + 1 + 2 + ... + 2^(d-2) = "
        "2^(max_depth-1) node histograms for a full tree",
        "XGBoost's CPU ring: in the reduce-scatter each worker sends w - 1 segments of S/w, in "
        "its all-gather w segments of S/w (the loop runs w steps): (w-1)·S + w·S = (2w-1)·S for "
        "all workers together; one worker sends nothing",
        "recipe: first one node's histogram in bytes (every bin of every feature, two float64 "
        "values each); then the message, that many times the node histograms of a full tree; "
        "then what the ring sends of it, all workers together; one worker sends nothing",
    ),
    reference=reference_round_bytes,
)
def _verify_round_bytes(round_bytes: Any) -> str:
    fn = require_callable(round_bytes, "round_bytes(features, max_bin, max_depth, workers) -> float")
    for case in ROUND_CASES:
        got, want = call(fn, *case), reference_round_bytes(*case)
        shown = "round_bytes(features={}, max_bin={}, max_depth={}, workers={})".format(*case)
        if not isinstance(got, (int, float)) or isinstance(got, bool) or not math.isfinite(got):
            raise ExerciseFailed(f"{shown} returned {short_repr(got)}: return a number of bytes")
        if math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-6):
            continue
        if case[3] == 1:
            raise ExerciseFailed(f"{shown} returned {got:,.0f}: one worker has no one to "
                                 "all-reduce with, so it puts nothing on the wire")  # fmt: skip
        raise ExerciseFailed(f"{shown} returned {got:,.0f} bytes: {_round_diagnosis(fn)}")
    return (f"{callable_name(fn)} gives the bytes of a round for {len(ROUND_CASES)} shapes, one to "
            "four workers, as XGBoost's source sends them")


# --------------------------------------------------------------------------- 08.matrix_bytes


def reference_matrix_bytes(rows: int, features: int, max_bin: int, quantile: bool) -> int:
    quantised = boosting.quantised_bytes(rows, features, max_bin)
    return quantised if quantile else quantised + boosting.dmatrix_bytes(rows, features)


MATRIX_CASES = ((1000, 16, 64), (250_000, 28, 256), (77, 5, 1024))


def _matrix_mistakes(rows: int, f: int, b: int, quantile: bool) -> list[tuple[int, str]]:
    index = boosting.bin_index_bytes(b)
    offsets = (rows + 1) * 8
    csr = boosting.dmatrix_bytes(rows, f)
    extra = 0 if quantile else csr
    return [
        (rows * f * index + offsets + extra,
         "the quantised copy is kept twice, in the row layout and in the column layout hist "
         "partitions rows with"),
        (2 * rows * f * index + extra,
         "the row layout needs an 8-byte offset per row (rows + 1 of them); the column layout of "
         "dense data needs none"),
        (2 * rows * f * index + 2 * offsets + extra,
         "the row offsets are counted twice: only the row layout has them; the column layout of "
         "dense data is one index per value and nothing else"),
        (2 * rows * f * 4 + offsets + extra,
         "a bin index is not a float32: it takes the fewest bytes that hold every bin number "
         "(1 byte up to 256 bins per feature)"),
        (2 * rows * f * (2 if index == 1 else 4) + offsets + extra,
         "the index is one size too large: up to 256 bins per feature fit one byte, up to "
         "65,536 two"),
        (2 * rows * f * index + offsets,
         "a DMatrix keeps its stored values (8 bytes each: a feature index and a value) and "
         "builds the quantised copy beside them"),
        (csr, "a DMatrix trained with hist also holds the quantised copy it built"),
    ]


@exercise(
    "08.matrix_bytes",
    "Predict the bytes of a DMatrix and a QuantileDMatrix once hist trained",
    hints=(
        "hist trains on a quantised copy of the data: one bin number per value; a DMatrix keeps "
        "the values as well, a QuantileDMatrix does not",
        "the CPU's quantised copy: a bin index per value in the row layout and again in the column "
        "layout, plus an 8-byte row offset per row (rows + 1 of them) in the row layout only; a "
        "bin index takes 1 byte when every feature has at most 256 bins, 2 up to 65,536, else 4",
        "a DMatrix's values are compressed sparse rows: 8 bytes per value (a uint32 feature "
        "index and a float32) and an 8-byte offset per row",
        "recipe: size the bin index from max_bin; count the quantised copy (both layouts and "
        "the row offsets): that alone is a QuantileDMatrix; a DMatrix adds its stored values "
        "and their row offsets",
    ),
    reference=reference_matrix_bytes,
)
def _verify_matrix_bytes(matrix_bytes: Any) -> str:
    fn = require_callable(matrix_bytes, "matrix_bytes(rows, features, max_bin, quantile) -> int")
    for rows, f, b in MATRIX_CASES:
        for quantile in (True, False):
            got, want = call(fn, rows, f, b, quantile), reference_matrix_bytes(rows, f, b, quantile)
            shown = f"matrix_bytes(rows={rows}, features={f}, max_bin={b}, quantile={quantile})"
            if not isinstance(got, (int, float)) or isinstance(got, bool):
                raise ExerciseFailed(f"{shown} returned {short_repr(got)}: return a number of bytes")
            if got == want:
                continue
            why = next((w for v, w in _matrix_mistakes(rows, f, b, quantile) if got == v),
                       "check each part: the quantised copy (two layouts, row offsets) and, for a "
                       "DMatrix, its stored values")  # fmt: skip
            raise ExerciseFailed(f"{shown} returned {got:,} bytes: {why}")
    return (f"{callable_name(fn)} predicts both matrices for {len(MATRIX_CASES)} shapes, 1- and "
            "2-byte bin indices")


# --------------------------------------------------------------------------- the reveals

REVEALS = {
    "08.round_bytes": ("bytes per round = (2w-1) × Σ over depths l < max_depth of features × bins "
                       "× 2 × 8 × nodes_l, with nodes = 1, 1, 2, 4, ... (2^(d-1) in all for a "
                       "full tree); 0 for one worker. On GPUs NCCL's ring sends 2(w-1)·S instead"),
    "08.matrix_bytes": ("CPU hist: QuantileDMatrix = 2 × rows × features × index bytes + (rows + 1) "
                        "× 8; DMatrix = that + rows × features × 8 + (rows + 1) × 8. On a GPU: one "
                        "ELLPACK page of ceil(log2(bins)) bits per value"),
}
"""Each exercise's closed form, printed under it once the learner's own answer passed."""


def reveal(exercise_id: str) -> str:
    """The closed form of ``exercise_id`` if the learner's answer passed in this kernel; until
    then a line that says it appears here once it does (the markdown leaves it out)."""
    if whose(exercise_id) == "your answer":
        return f"the formula you derived: {REVEALS[exercise_id]}"
    return ("the formula appears here once your answer passes the check (the numbers above come "
            "from the reference answer)")

