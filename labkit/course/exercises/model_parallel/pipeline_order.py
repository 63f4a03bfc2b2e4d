"""Notebook 03's ``03.one_f_one_b``: the 1F1B order of one pipeline stage.

``one_f_one_b(p, m, stage)`` is compared in the kernel with
:func:`labkit.parallel.schedules.one_f_one_b_order` on cases where each usual mistake (GPipe's
order, a warm-up one too long or too short or reversed) gives an order of its own, and named;
then, in 2 ranks, the learner's order drives a real pipeline (``labkit.parallel.pipeline``)
whose loss and gradients must equal GPipe's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labkit.course.exercises import ExerciseFailed, call, exercise, rank_checks
from labkit.course.exercises.learner_code import callable_name, require_callable

# --------------------------------------------------------------------------- 03.one_f_one_b

# (p, m, stage): m >= p, m < p (the warm-up is cut short), every stage, a single stage. The
# first case tells the usual mistakes apart (at p = 2 several give the same order).
ORDER_CASES = (
    (4, 8, 0), (4, 8, 1), (4, 8, 2), (4, 8, 3), (2, 4, 0), (2, 4, 1),
    (4, 2, 0), (4, 2, 2), (3, 1, 0), (1, 3, 0),
)  # fmt: skip


def _reference_order(p: int, m: int, stage: int) -> list[tuple[str, int]]:
    from labkit.parallel.schedules import one_f_one_b_order

    return one_f_one_b_order(p, m, stage)


def _warmup_order(p: int, m: int, warmup: int) -> list[tuple[str, int]]:
    """1F1B with a given warm-up, to recognise an off-by-one: labkit's own 1F1B order of the
    first stage of a pipeline ``warmup + 1`` stages deep, whose warm-up is min(warmup, m)."""
    from labkit.parallel.schedules import one_f_one_b_order

    return one_f_one_b_order(max(warmup, 0) + 1, m, 0)


def _normalise_order(got: Any, call_text: str) -> list[tuple[str, int]]:
    if not isinstance(got, (list, tuple)):
        raise ExerciseFailed(
            f"{call_text} returned {type(got).__name__} {got!r}; return a list of "
            "(kind, micro-batch) pairs such as [('F', 0), ('F', 1), ('B', 0), ...]"
        )
    out = []
    for item in got:
        ok = (isinstance(item, (list, tuple)) and len(item) == 2 and item[0] in ("F", "B")
              and isinstance(item[1], int) and not isinstance(item[1], bool))  # fmt: skip
        if not ok:
            raise ExerciseFailed(
                f"{call_text} returned an entry {item!r}; each entry is a pair ('F' or 'B', "
                "micro-batch index as an int), e.g. ('F', 0)"
            )
        out.append((item[0], int(item[1])))
    return out


def order_diagnosis(p: int, m: int, stage: int, got: list[tuple[str, int]]) -> str:
    """The usual mistake that gives ``got`` instead of the 1F1B order, if one does."""
    from labkit.parallel.schedules import gpipe_order

    warmup = min(p - 1 - stage, m)
    if any(j >= m for _, j in got) and m < p - 1 - stage:
        return (f"with m={m} < p−1−stage={p - 1 - stage} there are only m forwards to run: "
                "the warm-up is min(p−1−stage, m)")  # fmt: skip
    if sorted(got) != sorted([("F", j) for j in range(m)] + [("B", j) for j in range(m)]):
        return ("every micro-batch 0..m−1 needs exactly one ('F', j) and one ('B', j); "
                "count what your list holds")  # fmt: skip
    if got == gpipe_order(p, m, stage):
        return ("this is GPipe's order (every forward, then every backward); 1F1B starts each "
                "backward as soon as the stage can, so it holds fewer micro-batches")  # fmt: skip
    for w, why in (
        (p - stage, "one warm-up forward too many: the last stage needs none, so stage s runs "
                    "p−1−s"),
        (p - 2 - stage, "one warm-up forward too few: stage s runs p−1−s before its first backward"),
        (stage, "the warm-up is reversed: the *first* stage runs the most (p−1), the last none"),
    ):  # fmt: skip
        if min(max(w, 0), m) != warmup and got == _warmup_order(p, m, w):
            return why
    live = 0
    for kind, j in got:
        live += 1 if kind == "F" else -1
        if live < 0:
            return f"('B', {j}) comes before ('F', {j}): a backward needs its forward's activations"
    backward = [j for kind, j in got if kind == "B"]
    if backward != sorted(backward):
        return ("backwards must go oldest first (B0, B1, ...): the next stage sends the "
                "gradients back in the order it received the forwards")  # fmt: skip
    return "compare with the description: warm-up, then steady state (F then B), then cool-down"


def check_order(fn: Any) -> str:
    """In the kernel: ``fn(p, m, stage)`` equals the 1F1B order for every case of ORDER_CASES."""
    fn = require_callable(fn, "one_f_one_b(p, m, stage) -> list[tuple[str, int]]")
    for p, m, stage in ORDER_CASES:
        call_text = f"{callable_name(fn)}(p={p}, m={m}, stage={stage})"
        got = _normalise_order(call(fn, p, m, stage), call_text)
        expected = _reference_order(p, m, stage)
        if got != expected:
            # Where the orders part, not the whole expected order: that would be the answer.
            at = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
                      min(len(got), len(expected)))  # fmt: skip
            raise ExerciseFailed(
                f"{call_text} returned {got}: it goes wrong at position {at} "
                f"({got[at] if at < len(got) else 'the list ends'}). Likely: "
                + order_diagnosis(p, m, stage, got)
            )
    return (f"one_f_one_b(p, m, stage) gives the 1F1B order for {len(ORDER_CASES)} cases "
            "(m >= p, m < p, every stage)")  # fmt: skip


@exercise(
    "03.one_f_one_b",
    "The 1F1B order of operations for one pipeline stage",
    hints=(
        "a stage can run a micro-batch's backward only after the later stages have run its "
        "forward and backward; 1F1B starts each backward as early as that allows, so a stage "
        "never holds more micro-batches than it must",
        "the schedule has three phases: a warm-up of forwards only (longer for earlier stages, "
        "which wait longest for their first backward), a steady phase alternating one forward "
        "and one backward, and a cool-down of the backwards left; the last stage needs no "
        "warm-up",
        "recipe: begin with the warm-up, forwards only: one for each stage after this one, but "
        "never more than m; then, as long as micro-batches are left to run forward, run the "
        "next one's forward and then the backward of the oldest micro-batch still waiting for "
        "its backward; last, run the backwards still owed, oldest first",
    ),
)
def _verify_one_f_one_b(answer: Any) -> str:
    said = check_order(answer)
    return f"{said}; {rank_checks.run_in_workers('03.one_f_one_b', [answer])}"


# Small enough for a quick CPU run, deep enough that each of 2 stages holds 2 blocks.
PIPE_MODEL = {"seq_len": 16, "n_layer": 4, "n_head": 2, "d_model": 32}
PIPE_BATCH, PIPE_M = 8, 4


def _rank_one_f_one_b(ctx: Any, fn: Callable[[int, int, int], Any]) -> str:
    """Drive a real pipeline with the learner's order; compare with our GPipe on the same batch."""
    from unittest import mock

    import torch.distributed as tdist

    from labkit.config import ModelConfig
    from labkit.parallel import pipeline
    from labkit.workers import pp_train

    p, m, r = ctx.world_size, PIPE_M, ctx.rank
    cfg = ModelConfig(**PIPE_MODEL)
    x, y = pp_train.make_batch(cfg, PIPE_BATCH, seed=0)
    pipe = pipeline.Pipeline(pp_train.build_model(cfg, seed=0), pipeline.partition(cfg, p),
                             rank=r, device=ctx.device)  # fmt: skip
    ref_loss = pipe.step("gpipe", x, y, m)
    ref_grads = pp_train.grads_by_name(pipe.stage)

    try:
        mine = _normalise_order(fn(p, m, r), f"{callable_name(fn)}(p={p}, m={m}, stage={r})")
        why = None if mine == _reference_order(p, m, r) else order_diagnosis(p, m, r, mine)
    except NotImplementedError:
        raise  # a stub raises on every rank alike, before any collective
    except Exception as err:  # reported below, once the ranks agree
        mine, why = [], f"{type(err).__name__}: {err}"
    # Every rank learns whether every order is right *before* any runs: a wrong order would
    # leave its neighbour waiting for a tensor that never comes.
    verdicts: list[Any] = [None] * p
    tdist.all_gather_object(verdicts, why)
    if any(verdicts):
        stage = next(s for s, v in enumerate(verdicts) if v)
        raise ExerciseFailed(f"stage {stage}'s order is wrong. Likely: {verdicts[stage]}")
    real = pipeline.schedule_order

    def learner_order(name: str, p_: int, m_: int, stage: int) -> list[tuple[str, int]]:
        return list(mine) if name == "1f1b" else real(name, p_, m_, stage)

    with mock.patch.object(pipeline, "schedule_order", learner_order):
        loss = pipe.step("1f1b", x, y, m)
        held = pipe.activation_summary("1f1b", m)["peak_in_flight"]
    ran = [(e["kind"], e["mb"]) for e in sorted(pipe.timeline.events, key=lambda e: e["start_s"])]
    grads = pp_train.grads_by_name(pipe.stage)
    if ran != mine:
        raise ExerciseFailed(f"stage {r} ran {ran}, not your order {mine}")
    bad = [n for n, g in ref_grads.items() if not torch.allclose(grads[n], g, atol=1e-6, rtol=1e-4)]
    if abs(loss - ref_loss) > 1e-5 or bad:
        raise ExerciseFailed(
            f"stage {r}: loss {loss} vs GPipe's {ref_loss}; gradients differ: {bad}"
        )
    tdist.barrier()
    return (f"and it ran a real {p}-stage pipeline on {p} ranks: same loss ({loss:.4f}) and "
            f"gradients as GPipe, stage 0 holding {held} of m={m} micro-batches' activations"
            if r == 0 else "ok")  # fmt: skip


RANK_CHECKS: dict[str, Callable[..., str]] = {"03.one_f_one_b": _rank_one_f_one_b}
"""This exercise's rank-side check, for :func:`labkit.course.exercises.model_parallel.rank_check`."""
