"""Exercise checks for notebook 00 (setup and a first job), run in the kernel.

* ``00.ring_bytes``  ``ring_bytes_sent(numel, n_ranks, bytes_per_element=4) -> float``: the
  bytes one rank sends in a ring all-reduce of ``numel`` elements over ``n_ranks`` ranks.
  Checked against the formula on 1 to 8 ranks (a measurement on 2 ranks alone cannot tell the
  whole message from the right answer); the notebook then holds the learner's prediction
  against the bytes the loopback interface counted during the job.
* ``00.bucket_size``  ``bucket_bytes(alpha_s, beta, n_ranks, share=0.8) -> float``: a decision
  from the notebook's measured α–β fit, the smallest all-reduce message (a DDP bucket) whose
  algorithm bandwidth reaches ``share`` of its large-message limit in the ring's α–β model.
  Checked on four links where each usual mistake (one message's rule, gloo's message count,
  the half-bandwidth point, the share upside down, units) gives a size of its own; the notebook
  then runs the size for this machine's α and β with :func:`run_bucket_plan` (a quarter of it,
  it, and 8 times it, on the job's ranks) and :func:`judge_bucket_plan` says with
  ``labkit.verdict`` whether it reached the share, the quarter fell short, or the noise is too
  large to tell.

Registers with :func:`labkit.course.exercises.exercise`; importing this module does nothing else.
"""

from __future__ import annotations

import math
import numbers
import statistics
from collections.abc import Callable
from typing import Any

from labkit.course.exercises import ExerciseFailed, call, exercise, short_repr
from labkit.course.exercises.learner_code import callable_name, require_callable


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
        "recipe: work out the message's size in bytes from numel and bytes_per_element; cut "
        "it into as many equal chunks as there are ranks; count the steps of the two phases "
        "(each phase has one step fewer than there are ranks), in each of which this rank sends "
        "one chunk; multiply the steps by the chunk's bytes and return that (on one rank, "
        "nothing is sent)",
    ),
    reference=reference_ring_bytes_sent,
)
def _verify_ring_bytes(ring_bytes_sent: Any) -> str:
    fn = require_callable(ring_bytes_sent,
                           "ring_bytes_sent(numel, n_ranks, bytes_per_element=4) -> float")  # fmt: skip
    for numel, p, e in RING_CASES:
        got = call(fn, numel, p, e)
        shown = f"{callable_name(fn)}({numel}, {p}, {e})"
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
    return (f"{callable_name(fn)}(numel, n_ranks, bytes_per_element) is 2(p−1)/p × numel × "
            "bytes_per_element on 1, 2, 3, 4 and 8 ranks; below, it predicts the bytes the "
            "loopback interface counts")  # fmt: skip


# --------------------------------------------------------------------------- 00.bucket_size


def reference_bucket_bytes(alpha_s: float, beta: float, n_ranks: int, share: float = 0.8) -> float:
    """What later cells use while the learner's answer is not done or wrong: the smallest
    message whose ring all-reduce reaches ``share`` of its large-message algbw, α–β model."""
    return share / (1 - share) * n_ranks * alpha_s * beta


# (alpha_s, beta bytes/s, n_ranks, share): loopback-like, NVLink-like, a wide ring at half the
# rate, a slow link; each usual mistake gives a size of its own in at least one of them
BUCKET_CASES = (
    (92e-6, 3.5e9, 2, 0.8),
    (5e-6, 2e10, 4, 0.9),
    (2e-5, 1e10, 8, 0.5),
    (1e-3, 1e8, 3, 0.75),
)


def _r(a: float, b: float, n: int, s: float) -> float:
    return reference_bucket_bytes(a, b, n, s)


# (what a usual mistake returns, as a function of alpha_s, beta, n_ranks, share; what it is)
_BUCKET_MISTAKES: tuple[tuple[Callable[[float, float, int, float], float], str], ...] = (
    (lambda a, b, n, s: s / (1 - s) * a * b,
     "that is where ONE point-to-point message reaches the share; an all-reduce's ring sends "
     "each rank's chunk, a fraction of the message, so each of its messages is smaller than "
     "the message"),
    (lambda a, b, n, s: 2 * (n - 1) * s / (1 - s) * a * b,
     "that charges each of the ring's steps the whole message; a step sends one chunk of it"),
    (lambda a, b, n, s: 2 * _r(a, b, n, s),
     "that counts gloo's 4(n−1) messages; this plan uses the ring's 2(n−1) "
     "(formulas.ring_allreduce_time), the prediction the cell above starts from"),
    (lambda a, b, n, s: a * b,
     "that is where one message reaches half of β (Hockney's n½), whatever share is asked and "
     "however many ranks"),
    (lambda a, b, n, s: n * a * b,
     "that reaches half of the limit whatever share is asked: the share must set the size"),
    (lambda a, b, n, s: s * n * a * b,
     "the share enters the wrong way: a larger share needs a much larger message, without "
     "bound as the share nears 100%"),
    (lambda a, b, n, s: (1 - s) / s * n * a * b,
     "the share enters upside down: a larger share must need a larger message"),
    (lambda a, b, n, s: _r(a, b, n, s) * 8, "that is bits; return bytes"),
    (lambda a, b, n, s: _r(a, b, n, s) / 4, "that counts float32 elements; return bytes"),
    (lambda a, b, n, s: _r(a, b, n, s) / 1e9,
     "that looks like GB; return bytes (β is in bytes per second)"),
    (lambda a, b, n, s: _r(a, b, n, s) * 1e6,
     "that is a million times too large: α is in seconds, not µs"),
)


def _bucket_diagnosis(answers: dict[tuple[float, float, int, float], float]) -> str:
    """Name the usual mistake that gives the learner's sizes on every case they returned a
    number for (on one case alone, several mistakes can give the same size)."""
    for mistake, why in _BUCKET_MISTAKES:
        if all(math.isclose(got, mistake(*case), rel_tol=1e-3) for case, got in answers.items()):
            return why
    return ("write the all-reduce's time for S bytes in the α–β model, its algorithm bandwidth "
            "S / time, and that bandwidth's limit for very large messages; then find the S at "
            "which the first reaches the share of the second")


@exercise(
    "00.bucket_size",
    "Decide the smallest all-reduce bucket that reaches a share of the link's bandwidth",
    hints=(
        "every message pays the fixed cost α however small it is, so a small all-reduce is "
        "mostly waiting; its bandwidth (bytes over time) rises with its size towards a limit. "
        "Write the time with the α–β model, then the bandwidth, then ask where it reaches the "
        "share",
        "a ring all-reduce of S bytes on n ranks is 2(n−1) steps, each sending one chunk of S/n "
        "bytes and paying α: formulas.ring_allreduce_time gives its time. Its algorithm "
        "bandwidth is S divided by that time; let S grow without bound to find the limit",
        "divide the bandwidth at S by its limit: the ratio depends on S only through S "
        "compared with n·α·β, and it is one half where the two are equal. Set the ratio to the "
        "share and solve for S",
        "recipe: write the ratio of the bandwidth at S to its limit as a fraction of S and "
        "n·α·β; set it equal to share; solve that equation for S (a larger share must give a "
        "larger S, without bound as the share nears one); return S in bytes",
    ),
    reference=reference_bucket_bytes,
)
def _verify_bucket_size(bucket_bytes: Any) -> str:
    fn = require_callable(bucket_bytes,
                           "bucket_bytes(alpha_s, beta, n_ranks, share=0.8) -> float")  # fmt: skip
    for a, b, n, s in BUCKET_CASES:
        shown = f"{callable_name(fn)}({a:g}, {b:g}, {n}, {s:g})"
        got = call(fn, a, b, n, s)
        if isinstance(got, bool) or not isinstance(got, numbers.Real):
            raise ExerciseFailed(f"{shown} returned {type(got).__name__} {short_repr(got)}; "
                                 "return a number of bytes")  # fmt: skip
        right = reference_bucket_bytes(a, b, n, s)
        # rounding to whole float32 elements (or whole ones per rank) is fine
        if abs(float(got) - right) > max(1e-3 * right, 4 * n):
            raise ExerciseFailed(
                f"{shown} returned {float(got):,.6g} bytes, which is not the smallest "
                f"all-reduce on {n} ranks whose bandwidth reaches {s:.0%} of its limit for an "
                f"α of {a * 1e6:g} µs and a β of {b / 1e9:g} GB/s: "
                f"{_bucket_diagnosis(_all_answers(fn))}"
            )
    return (f"{callable_name(fn)} finds the size at which a ring all-reduce reaches the share of its "
            f"bandwidth limit on {len(BUCKET_CASES)} links (2 to 8 ranks, shares 50% to 90%); "
            "below, the size it gives for this machine's α and β runs for real")


def _all_answers(fn: Callable[..., Any]) -> dict[tuple[float, float, int, float], float]:
    """The learner's size on every case where it returns a number (for the diagnosis)."""
    out = {}
    for case in BUCKET_CASES:
        try:
            got = fn(*case)
        except Exception:  # a case it fails on says nothing about the others
            continue
        if isinstance(got, numbers.Real) and not isinstance(got, bool):
            out[case] = float(got)
    return out


BUCKET_ROUNDS = 15  # timed rounds per size: enough for a verdict's spread on a busy machine
BUCKET_BIG = 8  # the large message, times the planned size: near the limit if the plan holds
BUCKET_MAX_BYTES = 256 * 2**20  # no message larger than this, on any tier


def _mib(b: float) -> str:
    return f"{b / 2**20:.3g} MiB" if b >= 2**20 else f"{b / 2**10:.3g} KiB"


def judge_bucket_plan(sizes: list[int], samples_s: list[list[float]], share: float) -> str:
    """The verdict on a planned bucket from measured all-reduce times: ``sizes`` are a quarter
    of the plan, the plan and a large message (bytes), ``samples_s`` their timed runs. Each
    smaller size's times are held against the time that size would take at ``share`` of the
    large message's algbw (its rate), with :func:`labkit.verdict.compare_times`; the returned
    text prints both comparisons and a conclusion chosen by their outcomes."""
    from labkit import verdict

    (quarter, chosen, big), (t_quarter, t_chosen, t_big) = sizes, samples_s
    lines = ["measured algbw (median): " + ", ".join(
        f"{_mib(size)}: {size / statistics.median(ts) / 1e9:.3g} GB/s"
        for size, ts in zip(sizes, samples_s, strict=True))]  # fmt: skip

    def reached(size: int, times: list[float], name: str) -> verdict.Comparison:
        at_share = [t * size / big / share for t in t_big]  # that size at share of big's rate
        return verdict.compare_times(times, at_share, names=(
            f"{name}, {_mib(size)}", f"{_mib(size)} at {share:.0%} of {_mib(big)}'s algbw"))

    verdicts = {"plan": reached(chosen, t_chosen, "your size"),
                "quarter": reached(quarter, t_quarter, "a quarter of it")}  # fmt: skip
    lines += [str(v) for v in verdicts.values()]

    def outcome(v: verdict.Comparison) -> str:  # "reached", "short" or "noisy"
        if v.outcome == "noisy":
            return "noisy"
        return "short" if v.outcome == "faster" and v.faster is v.b else "reached"

    plan, q = outcome(verdicts["plan"]), outcome(verdicts["quarter"])
    if plan == "noisy":
        end = ("too noisy to tell whether your size reaches the share here: rerun the cell, or "
               "run it when the machine is quieter")
    elif plan == "short":
        end = (f"your size falls short of {share:.0%} of the large message's rate here: the "
               "all-reduce pays more per message than the probe's α (several messages per "
               "step, the reduction between them), so on this machine the bucket must be "
               "larger than the fit says")
    elif q == "short":
        about = " (or comes within the verdict's tolerance of it)" * (
            verdicts["plan"].outcome == "agree")
        end = (f"the plan held: your size reaches {share:.0%} of the large message's "
               f"rate{about}, a quarter of it does not")
    elif q == "reached":
        end = ("your size reaches the share, and so does a quarter of it: the measured "
               "all-reduce leaves latency behind sooner than the probe's α–β fit says (each "
               "byte costs more than the probe's β: the reduction and the copies), so a "
               "smaller bucket would do here")
    else:
        end = ("your size reaches the share; whether a quarter of it falls short is too noisy "
               "to tell here")
    return "\n".join([*lines, end])


def run_bucket_plan(size_bytes: float, n_ranks: int, share: float,
                    rounds: int = BUCKET_ROUNDS) -> str:  # fmt: skip
    """Run the planned bucket for real: all-reduces of a quarter of ``size_bytes``, of it and
    of a message 8 times larger, taking turns on ``n_ranks`` ranks
    (:mod:`labkit.workers.allreduce_sizes`), judged by :func:`judge_bucket_plan`."""
    from labkit.jobs import launch
    from labkit.workers import allreduce_sizes

    if not (isinstance(size_bytes, numbers.Real) and math.isfinite(size_bytes)) or size_bytes <= 0:
        return f"the plan is {size_bytes!r} bytes, which no all-reduce can have: nothing run"
    chosen = int(min(max(size_bytes, 16 * n_ranks), BUCKET_MAX_BYTES / BUCKET_BIG))
    sizes = [max(chosen // 4, 4 * n_ranks), chosen, chosen * BUCKET_BIG]
    job = allreduce_sizes.run(allreduce_sizes.AllReduceSizesConfig(sizes=tuple(sizes), rounds=rounds),
                              nproc=n_ranks, timeout_s=180, stream=False,
                              observers=[launch.ProgressLines("bucket timing job")])  # fmt: skip
    r0 = job.rank(0)
    note = "" if chosen == int(size_bytes) else f" (the plan, {size_bytes:,.0f} B, clipped)"
    return (f"ran on {n_ranks} ranks over {job.backend}: {rounds} rounds of all-reduces of "
            f"{', '.join(_mib(s) for s in r0['sizes'])}, taking turns{note}\n"
            + judge_bucket_plan(r0["sizes"], r0["samples_s"], share))
