"""Notebook 05's ``05.batch_plan``, checked and run: the plan on the notebook's own machine.

The check runs the learner's ``plan_batch`` on the cases of :mod:`.batch_plan` and on the
notebook's own measurements (:func:`measured_here`); then the plan runs for real
(:func:`run_plan`): one step under the notebook's memory limit, and its step time against
one other split with :func:`labkit.verdict.compare_times`, which never fails a right plan.
"""

from __future__ import annotations

import copy
import gc
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from labkit import timing, train, verdict
from labkit.batching import trials
from labkit.batching.noise import Batch
from labkit.config import TrainConfig
from labkit.course.exercises import ExerciseFailed, call, exercise, time_limit_paused
from labkit.course.exercises.batch_size.batch_plan import (
    FLAT,
    PLAN_CASES,
    PlanInputs,
    noise_resolved,
    plan_answer,
    plan_candidates,
    plan_failure,
    reference_plan_batch,
)
from labkit.course.exercises.learner_code import callable_name, require_callable
from labkit.data import get_batch

# --------------------------------------------------------------------------- the plan, run


@dataclass(frozen=True)
class PlanRun:
    """A plan run for real: one step under the memory limit, and its step time against one
    other split of the same global batch, alternated step by step (all measured)."""

    inputs: PlanInputs
    plan: tuple[int, int, bool | None]
    alternative: tuple[int, int] | None
    fits: bool
    peak_bytes: int | None
    limit: str
    seconds: dict[str, list[float]]
    comparison: verdict.Comparison | None

    @property
    def name(self) -> str:
        return f"{self.plan[0]} × {self.plan[1]}"

    def _expected(self) -> str:
        """What the sweep says of the two micro-batches: "faster" or "as fast"."""
        assert self.alternative is not None
        tps = self.inputs.tokens_per_s
        a, b = tps[self.plan[0]], tps[self.alternative[0]]
        return "faster" if b < FLAT * a else "as fast"

    def outcome(self) -> str:
        """The run against the decision: "fits", "over" (did not fit), then the time verdict
        against what the sweep said ("as the sweep said", "against the sweep", "gap not
        repeated", "gap the sweep did not see", "noisy")."""
        if not self.fits:
            return "over"
        if self.comparison is None:
            return "fits"
        c = self.comparison
        if c.outcome == "noisy":
            return "noisy"
        plan_faster = c.outcome == "faster" and c.faster.name == self.name
        alt_faster = c.outcome == "faster" and not plan_faster
        if alt_faster:
            return "against the sweep"
        if self._expected() == "faster" and c.outcome == "agree":
            return "gap not repeated"
        if self._expected() == "as fast" and plan_faster:
            return "gap the sweep did not see"
        return "as the sweep said"

    def memory_sentence(self) -> str:
        m, k, _ = self.plan
        peak = "" if self.peak_bytes is None else f"peak {self.peak_bytes / 2**20:.2f} MiB, "
        if self.fits:
            return f"measured: one step of {m} × {k} under {self.limit}: {peak}it fits"
        return (f"measured: one step of {m} × {k} under {self.limit}: {peak}it does NOT fit. The "
                f"finder fitted {self.inputs.fits} for one pass; an accumulated step also holds "
                f"the gradients while micro-batches 2 to {k} run (section 3), so a plan at the "
                f"edge of memory needs that much room too")  # fmt: skip

    def time_sentence(self) -> str:
        if self.comparison is None:
            return "(no other measured micro-batch fits and divides the share: nothing to time against)"
        alt = f"{self.alternative[0]} × {self.alternative[1]}"
        said = {"faster": f"the sweep measured {alt.split(' ')[0]} more than {1 - FLAT:.0%} slower",
                "as fast": f"the sweep measured the two within {1 - FLAT:.0%}"}[self._expected()]
        return {
            "as the sweep said": f"as the sweep said ({said})",
            "gap not repeated": (f"the sweep's gap did not repeat ({said}; now they agree): at "
                                 f"this size the gap was within what a shared machine moves"),
            "gap the sweep did not see": (f"the plan ran faster than the sweep said ({said}; now "
                                          f"{self.name} is faster): at this size the sweep's rates "
                                          f"were within what a shared machine moves"),
            "against the sweep": (f"against the sweep ({said}): {alt} ran faster now. The plan "
                                  f"followed the measurements it was given; rerun the sweep and "
                                  f"this cell when the machine is quieter to see which holds"),
            "noisy": (f"too noisy to hold against the sweep ({said}): rerun, or run it alone; "
                      f"a right plan does not fail on noise"),
        }.get(self.outcome(), "")

    def lines(self) -> list[str]:
        m, k, worth = self.plan
        i = self.inputs
        out = [f"plan for a global batch of {i.target} on {i.ranks} rank"
               f"{'s' * (i.ranks > 1)}: micro-batch {m} × {k} accumulation steps"
               + (f" per rank (the step below is one rank's share, {m * k} sequences)"
                  if i.ranks > 1 else ""),
               _worth_sentence(i, worth), self.memory_sentence()]  # fmt: skip
        if self.comparison is not None:
            out.append(f"measured: step time of the plan against {self.alternative[0]} × "
                       f"{self.alternative[1]}, the same {m * k} sequences, alternated step by "
                       f"step:")  # fmt: skip
            out.append(str(self.comparison))
        out.append(self.time_sentence())
        return [line for line in out if line]

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _worth_sentence(i: PlanInputs, worth: bool | None) -> str:
    if worth is None or not noise_resolved(i.b_noise):
        return (f"worth it: cannot tell (the noise scale is not resolved: {i.b_noise!r}); "
                f"more pairs in section 6 would resolve it")  # fmt: skip
    times = 1 + i.target / i.b_noise
    return (f"worth it: {'yes' if worth else 'no'} (modelled, eq. 2.11 with B_crit taken as the "
            f"measured noise scale of {i.b_noise:.3g} sequences: {times:.2f}× the least tokens to "
            f"a given loss, {'at most' if times <= 2 else 'more than'} twice)")  # fmt: skip


@dataclass
class Here:
    """This notebook's measurements for ``05.batch_plan`` and what running a plan needs.

    :func:`measured_here` makes one and remembers it: the check then decides on these
    measurements too, and runs the plan (:meth:`run`). One per kernel, the last made.
    """

    inputs: PlanInputs
    template: nn.Module
    budget_bytes: int | None
    device: torch.device
    dtype: str
    train_cfg: TrainConfig
    data: torch.Tensor | None
    rounds: int
    runs: dict[tuple[int, int, bool | None], PlanRun] = field(default_factory=dict)

    def run(self, plan: tuple[int, int, bool | None]) -> PlanRun:
        """Run ``plan`` for real (once: a second call returns the first run)."""
        key = (int(plan[0]), int(plan[1]), plan[2])
        if key not in self.runs:
            self.runs[key] = run_plan(self, key)
        return self.runs[key]


_HERE: Here | None = None


def measured_here(*, target: int, ranks: int, fits: int, tokens_per_s: dict[int, float],
                  b_noise: float, template: nn.Module, budget_bytes: int | None,
                  device: torch.device | str, dtype: str, train_cfg: TrainConfig,
                  data: torch.Tensor | None = None, rounds: int = 7) -> Here:  # fmt: skip
    """Remember this notebook's measurements for ``05.batch_plan``'s check, and how to run a
    plan here: ``template`` (never modified), the memory limit ``budget_bytes`` (required on the
    CPU; None on a GPU means the whole card), ``rounds`` timed steps per split."""
    global _HERE
    if isinstance(b_noise, numbers.Real):
        b_noise = float(b_noise)
    inputs = PlanInputs(target=int(target), ranks=int(ranks), fits=int(fits),
                        tokens_per_s={int(b): float(t) for b, t in tokens_per_s.items()},
                        b_noise=b_noise)  # fmt: skip
    reference_plan_batch(*inputs.args())  # refuses a target no measured split can make
    _HERE = Here(inputs=inputs, template=template, budget_bytes=budget_bytes,
                 device=torch.device(device), dtype=dtype, train_cfg=train_cfg, data=data,
                 rounds=rounds)  # fmt: skip
    return _HERE


def forget_here() -> None:
    """Forget the measurements :func:`measured_here` remembered (tests)."""
    global _HERE
    _HERE = None


def _alternative(inputs: PlanInputs, micro: int) -> int | None:
    """The other split to time the plan against: the largest measured micro-batch that fits
    and divides (what "as large as fits" would run) when the plan is not it, else the next
    smaller one (one more halving: more accumulation)."""
    others = [b for b in plan_candidates(inputs.target, inputs.ranks, inputs.fits,
                                     inputs.tokens_per_s) if b != micro]  # fmt: skip
    return max(others) if others else None  # all others smaller: the next smaller one


def run_plan(here: Here, plan: tuple[int, int, bool | None]) -> PlanRun:
    """One step of ``plan`` under the notebook's memory limit (``labkit.batching.trials``:
    a CPU budget on live tensor bytes, or the real CUDA allocator), then its step time against
    one other split of the same share, alternated step by step (``labkit.timing.alternate``,
    a warm-up round first) and judged with ``labkit.verdict.compare_times``."""
    i = here.inputs
    micro, k, _ = plan
    seq_len = here.template.cfg.seq_len
    with trials.open_trials(here.template, here.budget_bytes, device=here.device,
                            seq_len=seq_len, dtype=here.dtype,
                            train_cfg=here.train_cfg) as device_trials:  # fmt: skip
        try:
            peak: int | None = device_trials(micro, grad_accum=k)
            fits = True
        except torch.OutOfMemoryError:
            device_trials.recover()
            fits, peak = False, device_trials.last_peak_bytes
        limit = device_trials.limit.split(" (")[0]
    alt = _alternative(i, micro)
    share = micro * k
    seconds: dict[str, list[float]] = {}
    comparison = None
    if alt is not None:
        g = torch.Generator().manual_seed(here.train_cfg.seed)
        vocab = here.template.cfg.vocab_size

        def batch_of(b: int) -> Batch:
            if here.data is not None:
                return get_batch(here.data, b, seq_len, g)
            shape = (b, seq_len)
            return (torch.randint(0, vocab, shape, generator=g),
                    torch.randint(0, vocab, shape, generator=g))  # fmt: skip

        def stepper(b: int) -> Callable[[], float]:
            work = copy.deepcopy(here.template).to(here.device).train()
            optimizer = train.make_optimizer(work, here.train_cfg)
            scaler = train.make_scaler(here.device, here.dtype)
            batches = [batch_of(b) for _ in range(share // b)]

            def step() -> float:
                return train.train_step(work, optimizer, batches, device=here.device,
                                        dtype=here.dtype, scaler=scaler,
                                        grad_clip=here.train_cfg.grad_clip).seconds  # fmt: skip

            return step

        names = (f"{micro} × {k}", f"{alt} × {share // alt}")
        seconds = timing.alternate({names[0]: stepper(micro), names[1]: stepper(alt)},
                                   rounds=here.rounds, warmup=1)  # fmt: skip
        comparison = verdict.compare_times(seconds[names[0]], seconds[names[1]], names=names)
    gc.collect()
    return PlanRun(inputs=i, plan=plan, alternative=None if alt is None else (alt, share // alt),
                   fits=fits, peak_bytes=peak, limit=limit, seconds=seconds,
                   comparison=comparison)  # fmt: skip


@exercise(
    "05.batch_plan",
    "Decide how to run a global batch here: micro-batch, accumulation, and whether it pays",
    hints=(
        "every way of splitting one global batch into micro-batches gives the same gradient "
        "(section 3), so the split is a question of memory and speed only: first rule out what "
        "cannot run, then let the measured throughput choose. Whether the global batch is "
        "worth running at all is a question for the noise scale, not for the machine",
        "memory and the micro-batch belong to one rank; the global batch is every rank's "
        "micro-batches of every accumulation step together. Only the sizes the sweep measured "
        "are evidence of speed, and an accumulated step runs at about the throughput of its "
        "micro-batch",
        "the sweep's medians move by about a tenth on a shared machine, so sizes that close to "
        "the fastest are as fast as it; among splits that are as fast, fewer passes pay the "
        "fixed per-pass costs fewer times. A global batch B needs 1 + B/B_noise times the "
        "least tokens to a loss (eq. 2.11): worth it up to twice the least; a noise scale that "
        "is not a positive finite number cannot say",
        "recipe: divide the target by the ranks for each rank's share; keep the measured "
        "micro-batches that fit and divide the share exactly; find the fastest of them and "
        "keep every one within a tenth of its throughput; take the largest of those, and the "
        "accumulation steps are the share divided by it; the target is worth it when it is no "
        "larger than the noise scale, and undecided (None) when the noise scale is not a "
        "positive finite number",
    ),
    reference=reference_plan_batch,
)
def _verify_batch_plan(plan_batch: Any) -> str:
    fn = require_callable(plan_batch, "plan_batch(target, ranks, fits, tokens_per_s, b_noise) "
                                       "-> (micro_batch, accumulation_steps, worth_it)")  # fmt: skip
    here = _HERE
    cases = [*PLAN_CASES, *([here.inputs] if here is not None else [])]
    answers = {}
    for i, case in enumerate(cases):
        shown = f"{callable_name(fn)}(target={case.target}, ranks={case.ranks}, fits={case.fits}, ...)"
        answers[i] = (case, plan_answer(call(fn, *case.args()), shown))
    for case, got in answers.values():
        failure = plan_failure(case, got, answers)
        if failure:
            raise ExerciseFailed(failure)
    plans = [got for _, got in answers.values()]
    said = (f"{callable_name(fn)} decides as the measurements say on {len(PLAN_CASES)} other machines' "
            f"measurements (1 to 4 ranks; throughput rising, flat, and falling at the largest; "
            f"noise scales resolved and not)")  # fmt: skip
    if here is None:
        return said
    m, k, worth = plans[-1]
    with time_limit_paused():  # labkit's run, not the learner's code: no check time limit
        run = here.run((m, k, worth))
    worth_text = {True: "worth it", False: "not worth it", None: "worth it: cannot tell"}[worth]
    return (f"{said}, and on this notebook's: {m} × {k} for a global batch of "
            f"{here.inputs.target}, {worth_text}. Run for real: "
            f"{'it fits' if run.fits else 'it does NOT fit'} {run.limit}"
            + (f"; its step time against {run.alternative[0]} × {run.alternative[1]}: "
               f"{_short(run.comparison)}" if run.comparison is not None else "")
            + " (details below)")  # fmt: skip


def _short(c: verdict.Comparison) -> str:
    """A verdict in a few words, for the check's one line (the full one prints below it)."""
    if c.outcome == "faster":
        return (f"{c.faster.name} faster by {100 * c.difference / c.slower.median:.0f}%")
    if c.outcome == "agree":
        return f"they agree within {100 * c.tolerance:g}%"
    return "too noisy to tell"
