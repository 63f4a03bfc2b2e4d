"""Notebook 03c's ``03c.sequence_plan``: which layout runs a longer sequence, from measurements.

``plan_sequence(seq_len, budget_bytes, measured)`` (in the kernel, ``ex.check``): which of
section 1's layouts ("tp", "sp_keep_gathered", "sp") to run a longer sequence with, from their
measured saved activations and traffic, or "cp" when none fits. Checked on what the notebook
measures for its model at two sizes (:func:`sequence_measurements`) in seven cases; a learner
whose answers all follow one usual wrong rule (``WRONG_RULES``) gets that rule named.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from labkit.course.exercises import ExerciseFailed, call, exercise, short_repr
from labkit.course.exercises.learner_code import require_callable

# --------------------------------------------------------------------------- 03c.sequence_plan
#
# A longer sequence on the same two tensor-parallel ranks, the batch fixed, no recomputation:
# plain TP, TP+SP keeping the gathered inputs, TP+SP re-gathering them, or, if none of them
# fits, context parallelism (the sequence split over more ranks).

SEQ_LAYOUTS = ("tp", "sp_keep_gathered", "sp")
"""The layouts of notebook 03c's section 1, as ``sequence.MODES`` names them."""
SEQ_ANSWERS = (*SEQ_LAYOUTS, "cp")


def _scaled(m: dict[str, Any], seq_len: int, power: int = 1) -> float:
    return m["saved_bytes"] * (seq_len / m["seq_len"]) ** power


def _plan(measured: dict[str, Any], seq_len: int, budget: float, *, power: int = 1,
          fit: bool = True, by: str = "sent_bytes") -> str:  # fmt: skip
    """The reference (power 1, fit, by bytes sent) and the usual wrong rules."""
    fits = [k for k in SEQ_LAYOUTS if not fit or _scaled(measured[k], seq_len, power) <= budget]
    if not fits:
        return "cp"
    if by == "saved_bytes":
        return min(fits, key=lambda k: measured[k]["saved_bytes"])
    return min(fits, key=lambda k: (measured[k]["sent_bytes"], measured[k]["saved_bytes"]))


def reference_plan_sequence(seq_len: int, budget_bytes: float, measured: dict[str, Any]) -> str:
    """What later cells use while the learner's answer is not done or wrong: of the layouts
    whose saved activations, grown linearly from the measured length to ``seq_len``, fit the
    budget, the one that sends the fewest bytes; "cp" if none fits."""
    return _plan(measured, seq_len, budget_bytes)


def sequence_measurements(cfg: Any, batch: int, tp: int = 2) -> dict[str, Any]:
    """What notebook 03c's section 1 measures for ``cfg`` (it finds the saved bytes equal to
    these predictions on CPU ranks, to the byte, and counts the collectives): per layout, the
    sequence length, the bytes autograd saves per rank in one forward and the bytes a rank sends
    per training step."""
    from labkit.parallel import sequence

    return {mode: {"seq_len": cfg.seq_len,
                   "saved_bytes": sum(sequence.predicted_activations_per_rank(
                       cfg, batch, tp, mode=mode).values()),
                   "sent_bytes": sum(r["sent_per_rank"] for r in sequence.collectives_per_step(
                       cfg, batch, tp, mode=mode).values())}
            for mode in SEQ_LAYOUTS}  # fmt: skip


@functools.cache
def _sequence_cases() -> tuple[tuple[dict[str, Any], int, float, str], ...]:
    """(measured, seq_len, budget_bytes, what) on notebook 03c's model at its lab and smoke
    sizes: every answer occurs, and each usual mistake gives another one somewhere."""
    from labkit.config import ModelConfig

    lab = ModelConfig(seq_len=128, n_layer=4, n_head=4, d_model=128)
    smoke = ModelConfig(seq_len=32, n_layer=4, n_head=4, d_model=64)
    out = []
    for cfg, batch, seq_len, budget_mib in ((lab, 8, 256, 21), (lab, 8, 256, 42), (lab, 8, 256, 38),
                                            (lab, 8, 512, 100), (lab, 8, 512, 60),
                                            (smoke, 4, 128, 5), (lab, 8, 128, 20)):  # fmt: skip
        what = (f"the GPT of d {cfg.d_model}, {cfg.n_layer} layers measured at {cfg.seq_len} "
                f"tokens × {batch} sequences, asked for {seq_len} tokens in {budget_mib} MiB "
                "per rank")  # fmt: skip
        out.append((sequence_measurements(cfg, batch), seq_len, budget_mib * 2**20, what))
    return tuple(out)


WRONG_RULES = {"unscaled": {"power": 0}, "squared": {"power": 2},
               "least memory": {"by": "saved_bytes"}, "budget ignored": {"fit": False}}  # fmt: skip
"""The usual wrong plans, as settings of :func:`_plan`: a learner's answers that match one of
them on every case get that mistake named."""


def plan_diagnosis(measured: dict[str, Any], seq_len: int, budget: float, got: str,
                   rule: str | None = None) -> str:  # fmt: skip
    """Why ``got`` is wrong in this case; ``rule``: the usual wrong rule (``WRONG_RULES``)
    that gave all the learner's answers, if one did."""
    want = _plan(measured, seq_len, budget)
    s0 = next(iter(measured.values()))["seq_len"]
    need = {k: _scaled(measured[k], seq_len) / 2**20 for k in SEQ_LAYOUTS}
    sizes = ", ".join(f"{k} {v:.1f} MiB" for k, v in need.items())
    if rule == "unscaled":
        return (f"you compared the bytes measured at {s0} tokens with the budget. Activations "
                f"grow with the sequence: at {seq_len} tokens each layout saves {seq_len / s0:g}× "
                "what was measured")  # fmt: skip
    if rule == "squared":
        return (f"you grew the activations with the square of the length. This GPT's fused "
                "attention keeps no s × s matrix, only a log-sum-exp per row (section 1 "
                f"counted every saved tensor): they grow linearly, to {sizes} at {seq_len} "
                "tokens")  # fmt: skip
    if got != "cp" and need[got] * 2**20 > budget:
        return (f"{got} does not fit: {need[got]:.1f} MiB at {seq_len} tokens against a budget "
                f"of {budget / 2**20:.1f} MiB. Keep only the layouts that fit"
                + (", and if none does, split the sequence over more ranks ('cp')"
                   if want == "cp" else ""))  # fmt: skip
    if got == "cp":
        return (f"{want} fits ({sizes} at {seq_len} tokens, budget {budget / 2**20:.1f} MiB): "
                "context parallelism adds ranks only when no layout of the tensor-parallel "
                "group fits")  # fmt: skip
    if want == "cp":
        return (f"no layout fits ({sizes} at {seq_len} tokens, budget {budget / 2**20:.1f} MiB): "
                "the sequence must be split over more ranks, 'cp'")  # fmt: skip
    if measured[got]["saved_bytes"] < measured[want]["saved_bytes"]:
        return (f"{got} saves less memory, but {want} fits too ({need[want]:.1f} MiB) and "
                f"sends fewer bytes per step ({measured[want]['sent_bytes'] / 2**20:.2f} MiB "
                f"against {measured[got]['sent_bytes'] / 2**20:.2f} MiB at the measured length): "
                "among the layouts that fit, choose the one that costs the least traffic")  # fmt: skip
    return "among the layouts that fit the budget, choose the one that sends the fewest bytes"


@exercise(
    "03c.sequence_plan",
    "Choose tensor, sequence or context parallelism for a longer sequence",
    hints=(
        "Two questions for each layout of section 1: will its activations fit at the new "
        "length, and what does it cost in communication? Less memory always costs more "
        "traffic here.",
        "You measured at one length and are asked about another. How do the bytes autograd "
        "saves grow with the sequence in this GPT, whose attention keeps no s × s matrix? "
        "Section 1 counted every saved tensor.",
        "When none of the tensor-parallel group's layouts fits, the only lever left here (the "
        "batch fixed, no recomputation) is to split the sequence over more ranks.",
        "recipe: for each of the three layouts, grow its measured saved bytes in proportion to "
        "the new length and keep it if that fits the budget; of those kept, answer the one "
        "whose measured traffic is smallest; if none is kept, answer context parallelism.",
    ),
    reference=reference_plan_sequence,
)
def _verify_sequence_plan(answer: Any) -> str:
    fn = require_callable(answer, "plan_sequence(seq_len, budget_bytes, measured) -> str")
    cases = _sequence_cases()
    gots = []
    for measured, seq_len, budget, what in cases:
        got = call(fn, seq_len, budget, copy.deepcopy(measured))
        if got not in SEQ_ANSWERS:
            raise ExerciseFailed(f"{what}: you returned {short_repr(got)}: return one of "
                                 f"{list(SEQ_ANSWERS)}")  # fmt: skip
        gots.append(got)
    rule = next((name for name, kw in WRONG_RULES.items()
                 if all(_plan(m, s, b, **kw) == g for (m, s, b, _), g in zip(cases, gots, strict=True))),
                None)  # fmt: skip
    for (measured, seq_len, budget, what), got in zip(cases, gots, strict=True):
        if got != _plan(measured, seq_len, budget):
            raise ExerciseFailed(f"{what}: you chose {got!r}. "
                                 f"{plan_diagnosis(measured, seq_len, budget, got, rule)}")  # fmt: skip
    return ("your plan is right on the measurements of this notebook's model at two sizes, "
            "seven cases in all (each answer occurs); the next cell runs it for real")
