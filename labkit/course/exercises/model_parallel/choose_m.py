"""Notebook 03's ``03.choose_m``: the number of 1F1B micro-batches, from measured step times.

A decision from measurements, checked in the kernel: no ranks run the learner's code, but the
notebook runs its decision for real (:func:`run_m_plan`, one job of ``labkit.workers.pp_train``)
and :func:`judge_m_plan` says with ``labkit.verdict`` whether a neighbour ran faster.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from labkit.course.exercises import ExerciseFailed, call, exercise, short_repr
from labkit.course.exercises.learner_code import callable_name, require_callable
from labkit.course.exercises.rank_checks import NPROC
from labkit.formulas.pipeline import predicted_step as predicted_step

# --------------------------------------------------------------------------- 03.choose_m
# A decision from measurements, checked in the kernel: no ranks run the learner's code, but the
# notebook runs its decision for real (run_m_plan, below).


def fit_m_model(steps_s: Mapping[int, float], p: int) -> tuple[float, float]:
    """(T, c): least squares of the measured 1F1B steps against step(m) = (m + p − 1)·(T/m + c),
    the bubble formula's m + p − 1 slots each lasting a micro-batch's share of the compute, T/m,
    plus a fixed cost per micro-batch, c (hand-over, launches, Python). Linear in T and c."""
    rows = [((m + p - 1) / m, m + p - 1, t) for m, t in steps_s.items()]
    saa = sum(a * a for a, _, _ in rows)
    sab = sum(a * b for a, b, _ in rows)
    sbb = sum(b * b for _, b, _ in rows)
    sat = sum(a * t for a, _, t in rows)
    sbt = sum(b * t for _, b, t in rows)
    det = saa * sbb - sab * sab
    if len(rows) < 2 or det == 0:
        raise ValueError(f"steps_s={dict(steps_s)!r}: need steps measured at two or more m")
    return (sat * sbb - sbt * sab) / det, (saa * sbt - sab * sat) / det


def reference_choose_m(steps_s: Mapping[int, float], p: int, candidates: Sequence[int]) -> int:
    """What later cells use while the learner's answer is not done or wrong."""
    T, c = fit_m_model(steps_s, p)
    return min(candidates, key=lambda m: (predicted_step(m, p, T, c), m))


def _m_case(p: int, T: float, c: float, measured: Sequence[int], candidates: Sequence[int],
            what: str) -> tuple[dict[int, float], int, tuple[int, ...], str]:  # fmt: skip
    return ({m: predicted_step(m, p, T, c) for m in measured}, p, tuple(candidates), what)


# (measured steps by m, p, candidates, what): built from known T and c, so that each usual
# mistake picks an m of its own in at least one case, with the right m clear of its neighbours
M_CASES = (
    _m_case(2, 0.136, 0.0047, (1, 2, 4, 8), (1, 2, 4, 8, 16, 32),
            "a CPU-like pipeline of 2 stages (measured at m = 1, 2, 4, 8)"),
    _m_case(2, 0.5, 0.0005, (1, 2, 4, 8), (1, 2, 4, 8, 16, 32),
            "2 stages with little cost per micro-batch (measured at m = 1, 2, 4, 8)"),
    _m_case(4, 0.1, 0.012, (1, 2, 8, 16), (1, 2, 4, 8, 16),
            "4 stages, measured at m = 1, 2, 8, 16 but not 4"),
    _m_case(2, 0.01, 0.02, (1, 2, 4), (1, 2, 4, 8),
            "2 stages whose cost per micro-batch outweighs the compute"),
)


def _m_diagnosis(steps_s: dict[int, float], p: int, candidates: tuple[int, ...], got: int) -> str:
    right = reference_choose_m(steps_s, p, candidates)
    measured_best = min(steps_s, key=steps_s.get)
    if got not in candidates:
        return f"choose one of the candidates {list(candidates)} (m must divide the batch)"
    if got == measured_best and right not in steps_s:
        return ("that is the fastest m that was measured; the plan must predict the candidates "
                "that were not measured too: fit the measured steps, then predict every "
                "candidate")
    if got == max(candidates):
        return ("that is the most micro-batches: the bubble formula alone always asks for more, "
                "but each micro-batch also pays a fixed cost (hand-over, launches), and with m "
                "micro-batches the step pays it m + p − 1 times")
    if got == min(candidates):
        return ("that is one micro-batch: without the bubble in the model, fewer micro-batches "
                "always win; the (p − 1) idle slots shrink as m grows")
    if got > right:
        return (f"the model predicts m = {got} slower than a smaller candidate: past the "
                "optimum the fixed cost per micro-batch grows faster than the bubble shrinks")
    return (f"the model predicts m = {got} slower than a larger candidate: the bubble still "
            "shrinks faster there than the fixed cost per micro-batch grows")


@exercise(
    "03.choose_m",
    "Choose the number of micro-batches for 1F1B, from measured step times",
    hints=(
        "more micro-batches shrink the bubble, (p−1)/(m+p−1), but each micro-batch also "
        "costs a fixed amount (its sends and receives, its launches, Python) whatever its size. "
        "Model a step as both, fit the model to the measured steps, then predict every candidate",
        "a 1F1B step has m + p − 1 slots per stage; each slot lasts one micro-batch's forward "
        "and backward, T/m for a batch whose compute is T, plus the fixed cost c: "
        "step(m) = (m + p − 1)·(T/m + c). The unknowns are T and c, and the model is linear "
        "in them",
        "two measured m give two equations for T and c; with more, fit by least squares "
        "(every measured m weighs in, and one noisy step moves the fit less). Then predict the "
        "candidates that were not measured too, and keep the fastest",
        "recipe: for each measured m, write its step as hint 2's model, T times a factor that "
        "depends on m and p alone plus c times another such factor; "
        "solve for T and c by least squares over the measured steps (two unknowns: the 2×2 "
        "normal equations); predict each candidate's step with them; return the candidate "
        "with the smallest predicted step",
    ),
    reference=reference_choose_m,
)
def _verify_choose_m(choose_m: Any) -> str:
    fn = require_callable(choose_m, "choose_m(steps_s: dict[int, float], p: int, "
                                     "candidates: list[int]) -> int")  # fmt: skip
    for steps_s, p, candidates, what in M_CASES:
        shown = f"{callable_name(fn)}({{{', '.join(f'{m}: {t:.4g}' for m, t in steps_s.items())}}}, {p}, {list(candidates)})"
        got = call(fn, dict(steps_s), p, list(candidates))
        if isinstance(got, bool) or not isinstance(got, int):
            raise ExerciseFailed(f"{shown} returned {type(got).__name__} {short_repr(got)}; "
                                 "return one of the candidates, an int")  # fmt: skip
        if got != reference_choose_m(steps_s, p, candidates):
            raise ExerciseFailed(f"for {what}, {shown} chose m = {got}: "
                                 f"{_m_diagnosis(steps_s, p, candidates, got)}")  # fmt: skip
    return (f"{callable_name(fn)} predicts every candidate from the measured steps and picks the "
            f"fastest, on {len(M_CASES)} pipelines (2 and 4 stages, the best m measured or not); "
            "below, your choice runs for real beside its neighbours")


M_REPEATS = 5  # timed steps per m in the run: the fewest a verdict takes (labkit.verdict.MIN_RUNS)


def judge_m_plan(chosen: int, steps_s: Mapping[int, Sequence[float]]) -> str:
    """The verdict on a chosen m from the measured steps of it and its neighbours
    (``labkit.verdict.compare_times``, one comparison per neighbour), and a conclusion chosen
    by their outcomes."""
    from labkit import verdict

    lines, beaten, noisy = [], [], []
    for m in sorted(steps_s):
        if m == chosen:
            continue
        v = verdict.compare_times(steps_s[chosen], steps_s[m],
                                  names=(f"1F1B, m = {chosen} (your choice)", f"1F1B, m = {m}"))  # fmt: skip
        lines.append(str(v))
        if v.outcome == "noisy":
            noisy.append(m)
        elif v.outcome == "faster" and v.faster is v.b:
            beaten.append(m)
    if beaten:
        end = (f"the plan missed: m = {', '.join(map(str, beaten))} ran faster (measured). The "
               "model charges each micro-batch a fixed cost and shares the compute evenly; "
               "compute that does not shrink in proportion to the micro-batch (small matrices "
               "run below the machine's rate) or a busier machine during the sweep moves the "
               "optimum")
    elif noisy:
        end = (f"no neighbour ran clearly faster, but against m = "
               f"{', '.join(map(str, noisy))} it is too noisy to tell: rerun the cell, or run it "
               "when the machine is quieter")
    else:
        end = f"the plan held: no neighbour of m = {chosen} ran faster (measured)"
    return "\n".join([*lines, end])


def run_m_plan(chosen: int, candidates: Sequence[int], model: dict[str, int], batch_size: int,
               p: int = NPROC, repeats: int = M_REPEATS) -> str:  # fmt: skip
    """Run 1F1B for real at the chosen m and at its neighbours among ``candidates`` (one job of
    ``labkit.workers.pp_train``) and judge it with :func:`judge_m_plan`."""
    from labkit.jobs import launch
    from labkit.workers import pp_train

    ordered = sorted(candidates)
    if chosen not in ordered:
        return f"m = {chosen!r} is not one of the candidates {ordered}: nothing run"
    i = ordered.index(chosen)
    ms = ordered[max(0, i - 1): i + 2]
    job = pp_train.run(pp_train.PPTrainConfig(model=dict(model), schedules=("1f1b",),
                                              microbatches=tuple(ms), batch_size=batch_size,
                                              warmup=1, repeats=repeats),
                       nproc=p, timeout_s=300, stream=False,
                       observers=[launch.ProgressLines("1F1B timing job")])  # fmt: skip
    steps = {r["m"]: r["steps_s"] for r in job.rank(0)["runs"]}
    return (f"ran 1F1B on {p} ranks ({job.backend}), batch {batch_size}, m = "
            f"{', '.join(map(str, ms))}: {repeats} timed steps each (rank 0's)\n"
            + judge_m_plan(chosen, steps))
