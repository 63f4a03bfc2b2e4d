"""Exercise checks for notebook 03d (schedules, debugging, planning), run in the kernel.

* ``03d.choose_layout``  ``choose_layout(predictions, memory_bytes, usable_memory) ->
  Prediction | None``: the layout to run, given the planner's predictions
  (``labkit.planner.Prediction``: ``.memory["total"]`` bytes per GPU, ``.step_s``), the device's
  memory and the share of it a layout may fill (the rest a reserve for the CUDA context, NCCL's
  buffers and fragmentation): the fastest that fits under the reserve, None if none does.
  Checked on the Llama 3 405B case of ``planner.published_cases`` planned at 100 % of the
  memory with ZeRO's traffic hidden and charged, at reserves of 0 %, 5 % and 10 %: the
  settings where the answer changes. The notebook then runs the learner's choice over the same
  sweep and prints the change of rank.

Registers with :func:`labkit.course.exercises.exercise`; importing this module does nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from labkit.course.exercises import ExerciseFailed, call, exercise, short_repr
from labkit.course.exercises.learner_code import callable_name, require_callable


def reference_choose_layout(predictions: Any, memory_bytes: float, usable_memory: float) -> Any:
    """What later cells use while the learner's answer is not done or wrong."""
    fits = [p for p in predictions if p.memory["total"] <= usable_memory * memory_bytes]
    return min(fits, key=lambda p: p.step_s) if fits else None


@functools.cache
def _cases() -> tuple[tuple[tuple[Any, ...], float, float, str], ...]:
    """(predictions, memory_bytes, usable_memory, what) for the Llama case: planned at 100 %."""
    from labkit import planner

    case = planner.published_cases(mfu=0.5)[0]
    out = []
    for overlap in (True, False):
        w = dataclasses.replace(case.workload, usable_memory=1.0, overlap_dp=overlap)
        preds = planner.plan(case.model, case.cluster, w, case.search).predictions
        for usable in (1.0, 0.95, 0.9):
            what = (f"Llama 3 405B on 8,192 H100, ZeRO traffic {'hidden' if overlap else 'charged'},"
                    f" {usable:.0%} of {case.cluster.device.memory_bytes / 1e9:.0f} GB usable")  # fmt: skip
            out.append((preds, case.cluster.device.memory_bytes, usable, what))
    return tuple(out)


def _describe(p: Any) -> str:
    return (f"{p.layout.name} ({p.layout.variant}), {p.memory['total'] / 1e9:.1f} GB, "
            f"{p.step_s:.2f} s")  # fmt: skip


def _diagnosis(preds: Any, cap: float, usable: float, got: Any) -> str:
    fastest_any = min(preds, key=lambda p: p.step_s)
    whole = reference_choose_layout(preds, cap, 1.0)
    smallest = min(preds, key=lambda p: p.memory["total"])
    if got is fastest_any and got.memory["total"] > cap:
        return ("it does not fit at all: it is the fastest layout of all, whatever its memory. "
                "Keep only those whose memory fits first")
    if got is whole and got.memory["total"] > usable * cap:
        return ("it fits in the whole memory but not under the reserve: compare each layout's "
                "memory with usable_memory × memory_bytes, not with memory_bytes (nor with "
                "the planner's own .fits, which used the memory it was planned with)")
    if got is smallest:
        return ("it is the layout with the least memory: among those that fit, the one to run is "
                "the fastest, not the smallest")
    if got.memory["total"] > usable * cap:
        return "it does not fit under the reserve: filter on memory first"
    return "among the layouts that fit under the reserve, pick the one with the least step time"


@exercise(
    "03d.choose_layout",
    "Choose the layout to run under a memory reserve",
    hints=(
        "two steps: first keep the layouts whose memory per GPU fits in the part of the memory "
        "a layout may fill; then, among those, the one the planner predicts fastest",
        "a prediction's memory per GPU is p.memory['total'] (bytes) and its time p.step_s "
        "(seconds). The usable part of the memory is usable_memory × memory_bytes; the "
        "planner's own p.fits was computed with the memory share it was planned with, not "
        "yours",
        "if nothing fits, there is no layout to run: return None rather than the least bad one",
        "recipe: work out the bytes a layout may fill from memory_bytes and usable_memory; "
        "keep the predictions whose memory per GPU is at most that; if none is kept, return "
        "None; otherwise return the kept prediction with the shortest predicted step",
    ),
    reference=reference_choose_layout,
)
def _verify_choose_layout(choose_layout: Any) -> str:
    fn = require_callable(choose_layout,
                           "choose_layout(predictions, memory_bytes, usable_memory) -> Prediction | None")  # fmt: skip
    for preds, cap, usable, what in _cases():
        got = call(fn, list(preds), cap, usable)
        want = reference_choose_layout(preds, cap, usable)
        if got is None and want is not None:
            raise ExerciseFailed(f"{what}: {callable_name(fn)} returned None, but layouts fit under "
                                 "the reserve: usable_memory is the share a layout may fill "
                                 "(0.9: 90 %), not the share kept back")  # fmt: skip
        if not hasattr(got, "memory") or not hasattr(got, "step_s"):
            raise ExerciseFailed(f"{what}: {callable_name(fn)} returned {short_repr(got)}: return one "
                                 "of the predictions it was given (or None if none fits)")  # fmt: skip
        if got is not want and (got.memory["total"] != want.memory["total"]
                                or got.step_s != want.step_s):  # fmt: skip
            raise ExerciseFailed(f"{what}: {callable_name(fn)} chose {_describe(got)}: "
                                 f"{_diagnosis(preds, cap, usable, got)}")  # fmt: skip
    return (f"{callable_name(fn)} picks the fastest layout that fits under a 0 %, 5 % and 10 % reserve, "
            "with ZeRO's traffic hidden and charged (Llama 3 405B, 8,192 H100)")
