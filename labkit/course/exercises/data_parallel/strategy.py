"""Notebook 02's decision exercise, ``02.choose_strategy``: which of DDP, ZeRO-1 and FSDP2 to
run in a per-rank memory budget, checked in the kernel (``exercises.check``: no ranks needed).

The measurements it decides from (:func:`strategy_measurements`, out of the ladder's job), the
reference decision, the usual wrong ones (:data:`STRATEGY_MISTAKES`) and the made-up jobs
that tell them apart (:func:`strategy_cases`), and the measured sentence the notebook prints
when it runs the choice (:func:`fit_sentence`). Separate from the worker-run checks: it
needs no process group and no check model.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from labkit.course.exercises import ExerciseFailed, call, exercise, short_repr
from labkit.course.exercises.learner_code import callable_name, require_callable

# --------------------------------------------------------------------------- 02.choose_strategy
# A decision, checked in the kernel (ex.check): no process group, no worker.

CANDIDATES = ("ddp", "zero1", "fsdp2")
"""The strategies 02.choose_strategy decides between: the rows of notebook 02's memory table."""


def strategy_measurements(
    ranks: Sequence[dict[str, Any]], names: Sequence[str] = CANDIDATES
) -> dict[str, dict[str, Any]]:
    """What 02.choose_strategy decides from, out of a ``labkit.workers.dp_train`` job's
    per-rank results (``JobResult.ranks``). Per strategy:

    * ``step_s``: rank 0's median seconds per optimizer step, the first step left out (as the
      ladder's table does: warm-up, and DDP rebuilds its buckets there); measured;
    * ``after_step_bytes``: parameters + gradients + optimizer state one rank holds after a
      step (storage bytes of its local tensors, the largest over the ranks); measured;
    * ``accumulating_bytes``: the same between two micro-batches under the strategy's
      ``no_sync`` (the gradients measured then, parameters and optimizer state as after the
      step); None for a strategy without ``no_sync`` (ZeRO-1 accumulates in the one flat
      buffer it keeps after the step too); measured;
    * ``predicted_bytes``: ZeRO's model states per rank (``dp_train.predicted_memory``);
      modelled;
    * ``ranks``: how many ranks the job ran. Every byte figure is per rank.
    """
    table: dict[str, dict[str, Any]] = {}
    for name in names:
        runs = [r["runs"][name] for r in ranks if r]
        steps = runs[0]["step_s"][1:] or runs[0]["step_s"]
        mems = [run["memory"] for run in runs]
        after = [m["parameters"] + m["gradients"] + m["optimizer_state"] for m in mems]
        grads_acc = [m.get("gradients_accumulating") for m in mems]
        accumulating = None
        if all(g is not None for g in grads_acc):
            accumulating = max(m["parameters"] + g + m["optimizer_state"]
                               for m, g in zip(mems, grads_acc, strict=True))
        table[name] = {
            "step_s": statistics.median(steps),
            "after_step_bytes": max(after),
            "accumulating_bytes": accumulating,
            "predicted_bytes": max(run["memory_predicted"]["model_states"] for run in runs),
            "ranks": len(ranks),
        }
    return table


def peak_bytes(record: dict[str, Any]) -> float:
    """The most one rank holds of a strategy's model states during a step (measured)."""
    acc = record["accumulating_bytes"]
    return record["after_step_bytes"] if acc is None else max(record["after_step_bytes"], acc)


def fit_sentence(name: str, record: dict[str, Any], ladder: dict[str, Any] | None,
                 budget_bytes: float, role: str = "") -> str:  # fmt: skip
    """One measured line: ``name``'s peak per rank in a run (``record``, from
    :func:`strategy_measurements`) against ``budget_bytes``, within or above as the numbers
    say, and whether the ladder's measurement (``ladder``) found the same bytes."""
    peak = peak_bytes(record)
    acc = record["accumulating_bytes"]
    parts = f"{_mib(record['after_step_bytes'])} after a step" + (
        f", {_mib(acc)} between micro-batches" if acc is not None else "")
    side = "within" if peak <= budget_bytes else "above"
    again = ""
    if ladder is not None:
        before = peak_bytes(ladder)
        again = ("; the ladder measured the same bytes" if before == peak
                 else f"; the ladder measured {_mib(before)}")  # fmt: skip
    return (f"measured: {name}{f' ({role})' if role else ''} peaks at {_mib(peak)} per rank "
            f"({parts}), {side} the budget of {_mib(budget_bytes)} by "
            f"{_mib(abs(budget_bytes - peak))}{again}")  # fmt: skip


def describe_measurements(measured: dict[str, dict[str, Any]], budget_bytes: float) -> str:
    """The budget and the table 02.choose_strategy decides from (``measured``: from
    :func:`strategy_measurements`): each strategy's step, its model states per rank after a
    step and between micro-batches (measured), and ZeRO's prediction (modelled)."""
    nproc = next(iter(measured.values()))["ranks"]
    lines = [f"budget: {budget_bytes / 2**20:.3f} MiB of model states per rank "
             "(ZeRO's formula for DDP in this job: modelled)",
             f"{'strategy':<10}{'step (ms)':>11}{'after a step':>14}{'accumulating':>14}"
             f"{'predicted':>11}   (MiB per rank, {nproc} ranks; step and bytes measured, "
             "predicted modelled)"]
    for name, r in measured.items():
        acc = r["accumulating_bytes"]
        lines.append(f"{name:<10}{r['step_s'] * 1e3:>11.1f}{r['after_step_bytes'] / 2**20:>14.3f}"
                     + (f"{acc / 2**20:>14.3f}" if acc is not None else f"{'(= after)':>14}")
                     + f"{r['predicted_bytes'] / 2**20:>11.3f}")
    return "\n".join(lines)


def _fastest(measured: dict[str, dict[str, Any]], keep: Callable[[dict[str, Any]], bool],
             slowest: bool = False) -> str | None:  # fmt: skip
    names = [n for n, r in measured.items() if keep(r)]
    if not names:
        return None
    pick = max if slowest else min
    return pick(names, key=lambda n: measured[n]["step_s"])


def reference_choose_strategy(measured: dict[str, dict[str, Any]], budget_bytes: float) -> str | None:
    """What later cells use while the learner's answer is not done or wrong: the fastest
    strategy whose measured peak per rank fits the per-rank budget, None if none does."""
    return _fastest(measured, lambda r: peak_bytes(r) <= budget_bytes)


def as_predicted(measured: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A copy of ``measured`` in which every byte figure is ZeRO's prediction: what a plan
    made from the formula alone would see (the notebook runs the learner's decision on it)."""
    return {n: {**r, "after_step_bytes": r["predicted_bytes"], "accumulating_bytes": None}
            for n, r in measured.items()}  # fmt: skip


def _least(measured: dict[str, dict[str, Any]]) -> str:
    return min(measured, key=lambda n: peak_bytes(measured[n]))


# The usual wrong decisions: (name, what it returns, why it is wrong). The check runs each on
# every case and names the one that gives all of the learner's answers; the tests make sure no
# two give the same answers on the cases.
Mistake = tuple[str, Callable[[dict[str, dict[str, Any]], float], str | None], str]
STRATEGY_MISTAKES: tuple[Mistake, ...] = (
    ("ignores_memory", lambda m, b: _fastest(m, lambda r: True),
     "that is the fastest strategy whatever its memory: a strategy that does not fit in a "
     "rank's memory cannot run at all, however fast its steps"),
    ("smallest_memory", lambda m, b: _least(m),
     "that is the strategy with the least memory, every time: memory only has to fit, and "
     "among the strategies that fit, the one whose steps finish soonest is the one to run"),
    ("predicted", lambda m, b: _fastest(m, lambda r: r["predicted_bytes"] <= b),
     "you judged the fit by predicted_bytes, ZeRO's formula. It gives the model states after "
     "a step; what a rank was measured to hold is more (gradients while accumulating, padded "
     "shards), and the measurement is what has to fit"),
    ("after_step", lambda m, b: _fastest(m, lambda r: r["after_step_bytes"] <= b),
     "you judged the fit by the bytes after a step only. Between micro-batches, while the "
     "gradients accumulate, a rank can hold more (accumulating_bytes): the budget must hold "
     "the peak, or the step runs out of memory half-way"),
    ("times_ranks", lambda m, b: _fastest(m, lambda r: peak_bytes(r) * r["ranks"] <= b),
     "you multiplied the bytes by the number of ranks: they are already bytes per rank, and "
     "so is the budget"),
    ("budget_times_ranks", lambda m, b: _fastest(m, lambda r: peak_bytes(r) <= b * r["ranks"]),
     "you multiplied the budget by the number of ranks: every rank has its own memory, and "
     "each rank's bytes must fit in its own budget"),
    ("inverted", lambda m, b: _fastest(m, lambda r: peak_bytes(r) > b),
     "you kept the strategies that do not fit: the comparison with the budget points the "
     "wrong way"),
    ("strict", lambda m, b: _fastest(m, lambda r: peak_bytes(r) < b),
     "a strategy whose peak equals the budget exactly still fits: at most the budget, not "
     "strictly less"),
    ("slowest", lambda m, b: _fastest(m, lambda r: peak_bytes(r) <= b, slowest=True),
     "that is the slowest of the strategies that fit: step_s is seconds per step, so the "
     "smallest is the fastest"),
    ("least_bad_small", lambda m, b: reference_choose_strategy(m, b) or _least(m),
     "when nothing fits there is nothing to run: return None, not the strategy that misses "
     "the budget by the least"),
    ("least_bad_fast", lambda m, b: reference_choose_strategy(m, b) or _fastest(m, lambda r: True),
     "when nothing fits there is nothing to run: return None, not the fastest of the "
     "strategies that do not fit"),
)

PSI = 2**18  # parameters of the check's made-up models: 16Ψ bytes = 4 MiB


def _record(step_s: float, after: float, accumulating: float | None, predicted: float,
            ranks: int) -> dict[str, Any]:  # fmt: skip
    return {"step_s": step_s, "after_step_bytes": int(after * PSI),
            "accumulating_bytes": None if accumulating is None else int(accumulating * PSI),
            "predicted_bytes": int(predicted * PSI), "ranks": ranks}  # fmt: skip


def strategy_cases() -> list[tuple[dict[str, dict[str, Any]], float, str]]:
    """(measured, budget_bytes, what) for other jobs than the notebook's, in Ψ-byte units of a
    made-up model (fp32, AdamW, two micro-batches accumulated): DDP 16Ψ after a step and 20Ψ
    while accumulating (a fresh .grad beside its buckets), ZeRO-1 4Ψ + 4Ψ + 8Ψ/n, FSDP2 16Ψ/n
    after a step and 4Ψ/n + 4Ψ + 8Ψ/n while accumulating (whole gradients under no_sync), as
    notebook 02 measures them; made-up step times (DDP fastest in most, FSDP2 ahead of ZeRO-1
    in one). Each case is one where some usual mistake gives another answer."""
    def job(n: int, steps: tuple[float, float, float], zero1_pad: float = 0.0,
            fsdp_pad: float = 0.0) -> dict[str, dict[str, Any]]:  # fmt: skip
        zero1 = 8 + 8 / n
        fsdp = 16 / n
        return {
            "ddp": _record(steps[0], 16, 20, 16, n),
            "zero1": _record(steps[1], zero1 + zero1_pad, None, zero1, n),
            "fsdp2": _record(steps[2], fsdp + fsdp_pad, 4 / n + 4 + 8 / n + fsdp_pad, fsdp, n),
        }

    return [
        (job(2, (0.10, 0.12, 0.16)), 16 * PSI,
         "2 ranks, the budget ZeRO's formula gives DDP (16Ψ)"),
        (job(2, (0.080, 0.095, 0.130)), 48 * PSI, "2 ranks, a roomy budget (48Ψ)"),
        (job(2, (0.10, 0.12, 0.16)), 9 * PSI,
         "2 ranks, a budget (9Ψ) above FSDP2's formula but below its peak"),
        (job(4, (0.090, 0.100, 0.150)), 10 * PSI,
         "4 ranks, a budget equal to ZeRO-1's peak (10Ψ)"),
        (job(3, (0.060, 0.070, 0.100), zero1_pad=1 / 12, fsdp_pad=1 / 6), 10.7 * PSI,
         "3 ranks, shards padded past the formula, a budget of 10.7Ψ"),
        (job(8, (0.040, 0.070, 0.060)), 12 * PSI,
         "8 ranks, FSDP2 faster than ZeRO-1, a budget of 12Ψ"),
    ]


_NOTEBOOK_CASE: list[tuple[dict[str, dict[str, Any]], float, str]] = []


@contextlib.contextmanager
def checking_on(measured: dict[str, dict[str, Any]], budget_bytes: float,
                what: str = "this notebook's measurements") -> Iterator[None]:  # fmt: skip
    """Inside the block, the check of 02.choose_strategy tries the learner's function on
    ``measured`` and ``budget_bytes`` first, then on :func:`strategy_cases`::

        with exdp.checking_on(measured, budget_bytes):
            choose_strategy = ex.check("02.choose_strategy", choose_strategy)
    """
    _NOTEBOOK_CASE.append((copy.deepcopy(measured), float(budget_bytes), what))
    try:
        yield
    finally:
        _NOTEBOOK_CASE.pop()


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.3f} MiB"


def _wrong_type(got: Any, names: Sequence[str]) -> str | None:
    """Why ``got`` is not an answer at all (a name among ``names`` or None), or None."""
    if got is None or (isinstance(got, str) and got in names):
        return None
    if isinstance(got, bool | int | float):
        return (f"returned the number {got!r}: return the strategy's name (one of "
                f"{list(names)}), not its time, bytes or position; None if none can run")  # fmt: skip
    if isinstance(got, dict):
        return (f"returned a strategy's record {short_repr(got, 80)}: return its name, the key "
                f"it has in measured (one of {list(names)})")  # fmt: skip
    if isinstance(got, list | tuple | set):
        return (f"returned {short_repr(got, 80)}: return one name, the strategy to run (one of "
                f"{list(names)}), or None")  # fmt: skip
    if isinstance(got, str):
        return (f"returned {got!r}, which is not a strategy measured here: the names are "
                f"{list(names)}")  # fmt: skip
    return (f"returned {type(got).__name__} {short_repr(got, 80)}: return the strategy's name "
            f"(one of {list(names)}) or None")  # fmt: skip


def _facts(measured: dict[str, dict[str, Any]], budget: float, got: str | None,
           want: str | None) -> str:  # fmt: skip
    """What is wrong with ``got`` on one case, in the case's own numbers."""
    if got is None:
        r = measured[want]
        return (f"it returned None, but {want!r} fits: its measured peak is "
                f"{_mib(peak_bytes(r))} per rank, within the budget of {_mib(budget)}")  # fmt: skip
    r = measured[got]
    peak = peak_bytes(r)
    if want is None:
        least = _least(measured)
        return (f"it chose {got!r}, but nothing fits: every strategy's measured peak is above "
                f"the budget of {_mib(budget)} per rank (the least is {least!r}'s, "
                f"{_mib(peak_bytes(measured[least]))})")  # fmt: skip
    if peak > budget:
        acc = r["accumulating_bytes"]
        during = f", {_mib(acc)} while accumulating" if acc is not None else ""
        return (f"it chose {got!r}, whose measured peak is {_mib(peak)} per rank "
                f"({_mib(r['after_step_bytes'])} after a step{during}), above the budget of "
                f"{_mib(budget)}")  # fmt: skip
    return (f"it chose {got!r}, which fits, but {want!r} fits too and its steps take "
            f"{measured[want]['step_s'] * 1e3:.1f} ms against {r['step_s'] * 1e3:.1f} ms")  # fmt: skip


@exercise(
    "02.choose_strategy",
    "Choose the data-parallel strategy to run in a per-rank memory budget",
    hints=(
        "a strategy can run only if one rank can hold it at every moment of a step, not only "
        "at the end of one; among those that can, the job wants the one whose steps finish "
        "soonest. A budget may also leave nothing that can run",
        "each record gives one rank's model-state bytes measured after a step "
        "(after_step_bytes) and between micro-batches while gradients accumulate "
        "(accumulating_bytes; None where a strategy accumulates in the buffers it keeps after "
        "the step anyway), ZeRO's formula for them (predicted_bytes, modelled), the median "
        "seconds per step (step_s) and the number of ranks. The budget is per rank too",
        "the formula is what you plan with before anything has run; once a rank has been "
        "measured to hold more, the measurement is what must fit. The answer is a name, one "
        "of measured's keys, or None",
        "recipe: for each strategy, take the larger of its two measured byte figures (the "
        "after-step one alone where the other is None); keep the strategies whose figure is "
        "at most the budget; if none is left, answer None; otherwise answer the name of the "
        "one kept with the smallest step time",
    ),
    reference=reference_choose_strategy,
)
def _verify_choose_strategy(choose_strategy: Any) -> str:
    fn = require_callable(choose_strategy,
                           "choose_strategy(measured, budget_bytes) -> str | None")  # fmt: skip
    cases = [*_NOTEBOOK_CASE[-1:], *strategy_cases()]
    answers = []
    for measured, budget, what in cases:
        got = call(fn, copy.deepcopy(measured), budget)
        why = _wrong_type(got, list(measured))
        if why is not None:
            raise ExerciseFailed(f"on {what}, {callable_name(fn)}(measured, {budget:,.0f}) {why}")
        answers.append(got)
    wants = [reference_choose_strategy(m, b) for m, b, _ in cases]
    wrong = [i for i, (got, want) in enumerate(zip(answers, wants, strict=True)) if got != want]
    if not wrong:
        mine = f"{_NOTEBOOK_CASE[-1][2]} and " if _NOTEBOOK_CASE else ""
        return (f"{callable_name(fn)} chose the fastest strategy whose measured peak fits each per-rank "
                f"budget, or None when none does, on {mine}{len(strategy_cases())} other jobs "
                "(2 to 8 ranks, padded shards, a peak exactly at the budget, nothing that "
                "fits)")  # fmt: skip
    i = wrong[0]
    measured, budget, what = cases[i]
    message = f"on {what}, {_facts(measured, budget, answers[i], wants[i])}"
    for _, mistake, why in STRATEGY_MISTAKES:
        if all(mistake(m, b) == got for (m, b, _), got in zip(cases, answers, strict=True)):
            raise ExerciseFailed(f"{message}. All its answers are what one usual mistake "
                                 f"gives: {why}")
    raise ExerciseFailed(f"{message} ({len(wrong)} of the {len(cases)} cases are wrong)")


