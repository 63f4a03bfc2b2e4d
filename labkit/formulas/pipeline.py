"""Pipeline bubbles: the idle share of a pipeline step, under both conventions in use.

GPipe's (the bubble as a share of the whole step) and Narayanan et al.'s (relative to the
ideal step), each under its own name; neither is "the" bubble. And the step time they imply
with a cost per micro-batch (:func:`predicted_step`), the model notebook 03's exercise fits;
and the micro-batches each stage holds at once under 1F1B (:func:`one_f_one_b_in_flight`).
"""

from __future__ import annotations

from labkit.validate import whole


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Fraction of a pipeline step that a stage sits idle: (p−1) / (v·m + p−1).

    GPipe's convention (arXiv 1811.06965, section 2.3): the bubble as a share of the whole
    step, ideal work plus bubble. With v = 1 it is (p−1)/(m+p−1); for p = 4, m = 8: 3/11.
    Interleaving v model chunks per stage (Narayanan et al. 2021) shrinks the bubble v times.
    Same value for GPipe and 1F1B schedules, which differ in memory, not in bubble.
    """
    p = whole("p", p, low=1)
    m = whole("m", m, low=1)
    v = whole("v", v, low=1)
    return (p - 1) / (v * m + p - 1)


def bubble_overhead(p: int, m: int, v: int = 1) -> float:
    """Pipeline bubble time relative to the ideal (bubble-free) step time: (p−1) / (v·m).

    Narayanan et al. 2021 (arXiv 2104.04473, section 2.2) call this the "bubble time
    fraction"; the Playbook uses it too. (p−1)/m for GPipe and 1F1B; (p−1)/(v·m) for the
    interleaved schedule with v chunks per stage. For p = 4, m = 8: 3/8, i.e. the step takes
    1.375× the ideal time. Compare ``bubble_fraction``, the share of the actual step.
    """
    p = whole("p", p, low=1)
    m = whole("m", m, low=1)
    v = whole("v", v, low=1)
    return (p - 1) / (v * m)


def predicted_step(m: int, p: int, T: float, c: float) -> float:
    """Seconds of a pipeline step of m micro-batches over p stages: (m + p − 1) · (T/m + c).

    T is one stage's compute for the whole batch, so a micro-batch takes T/m, plus c that does
    not shrink with it (a launch, a send); the schedule runs m + p − 1 such slots, the p − 1
    of them the bubble (:func:`bubble_fraction`). More micro-batches shrink the bubble but pay
    c more often: the step is least near m = √((p − 1)·T/c).
    """
    return (m + p - 1) * (T / m + c)


def one_f_one_b_in_flight(stages: int, micro_batches: int) -> list[int]:
    """Micro-batches each pipeline stage holds at once under 1F1B: min(p - i, m) for stage i.

    Stage i runs p - i forwards before its first backward (PipeDream-Flush, Narayanan et al.
    2021, arXiv 2104.04473, section 2.2), then one backward frees one micro-batch for each new
    forward. So the first stage holds p micro-batches' activations, the last one; GPipe holds
    all m on every stage.
    """
    p = whole("stages", stages, low=1)
    m = whole("micro_batches", micro_batches, low=1)
    return [min(p - i, m) for i in range(p)]
