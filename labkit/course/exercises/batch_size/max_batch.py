"""Notebook 05's ``05.max_batch``: the largest batch that fits, by doubling and bisection.

``largest_batch(trial, recover, start, max_batch) -> int``, with recovery after each failure,
run on simulated memory limits and then on real training steps of a small GPT under a CPU
memory budget (:class:`labkit.batching.trials.BudgetedCPU`), against
:func:`labkit.batching.finder.search_max_batch`; the trials the learner's search makes are
recorded, so a search that never recovers, tries past ``max_batch`` or swallows a real bug
is named.
"""

from __future__ import annotations

import functools
import gc
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from labkit.batching import finder
from labkit.batching.trials import BudgetedCPU
from labkit.config import ModelConfig, TrainConfig
from labkit.course.exercises import ExerciseFailed, call, exercise, short_repr
from labkit.course.exercises.learner_code import callable_name, require_callable, require_int

# --------------------------------------------------------------------------- the reference
# What later cells use while the learner's answer is not done or wrong.


def reference_largest_batch(trial: Callable[[int], Any], recover: Callable[[], None],
                            start: int, max_batch: int) -> int:  # fmt: skip
    """The largest batch in 1..max_batch whose ``trial`` does not raise out-of-memory."""
    return finder.search_max_batch(trial, start=start, max_batch=max_batch,
                                   recover=recover).found  # fmt: skip



# --------------------------------------------------------------------------- 05.max_batch


class _Stop(BaseException):
    """Ends the learner's search from inside a trial (a BaseException, so that an ``except
    Exception`` in the learner's code does not swallow it)."""


MAX_TRIALS = 10_000
"""More trials than this end the check: the search's loop does not end."""


@dataclass
class _Recorded:
    """A trial and a recover for the learner's search that record how they were called.

    ``run(b)`` does the real work: it returns peak bytes or raises ``torch.OutOfMemoryError``.
    """

    run: Callable[[int], int]
    calls: list[tuple[int, bool]] = field(default_factory=list)
    """(batch, fitted) for each trial, in order."""
    pending: int | None = None
    """The batch of a failed trial not yet followed by recover()."""
    unrecovered: list[tuple[int, int | None]] = field(default_factory=list)
    """(failed batch, the batch tried next without recover() between; None: none followed)."""

    def trial(self, batch: int) -> int:
        if isinstance(batch, bool) or not isinstance(batch, numbers.Integral):
            raise _Stop(f"your function called trial({batch!r}): a batch size is a whole number "
                        f"(halve and bisect with //)")  # fmt: skip
        if batch < 1:
            raise _Stop(f"your function called trial({batch}): batch sizes start at 1, so "
                        f"stop halving at 1")  # fmt: skip
        if len(self.calls) >= MAX_TRIALS:
            raise _Stop(f"your function called trial more than {MAX_TRIALS:,} times: does its "
                        f"loop ever end?")  # fmt: skip
        if self.pending is not None:
            self.unrecovered.append((self.pending, int(batch)))
            self.pending = None
        try:
            peak = self.run(int(batch))
        except torch.OutOfMemoryError:
            self.calls.append((int(batch), False))
            self.pending = int(batch)
            raise
        self.calls.append((int(batch), True))
        return peak

    def recover(self) -> None:
        self.pending = None

    def log(self) -> str:
        shown = [f"{b} {'fits' if ok else 'OOM'}" for b, ok in self.calls[:24]]
        more = f", … ({len(self.calls)} in all)" if len(self.calls) > 24 else ""
        return ", ".join(shown) + more


def _synthetic(fits_up_to: int) -> Callable[[int], int]:
    """A stand-in for a training step: batches up to ``fits_up_to`` fit, larger ones raise."""

    def run(batch: int) -> int:
        if batch > fits_up_to:
            raise torch.OutOfMemoryError(f"batch {batch} does not fit (the check's simulated "
                                         f"out-of-memory error)")  # fmt: skip
        return 1000 * batch  # peak bytes, growing with the batch

    return run


SEARCH_CASES = (
    # (what, largest batch that fits, start, max_batch)
    ("an answer between two doublings", 37, 4, 1000),
    ("a start above the answer", 37, 64, 1000),
    ("everything up to the cap fits", 10**6, 8, 100),
    ("only a batch of 1 fits", 1, 16, 64),
    ("the start is max_batch and fails", 63, 64, 64),
    ("a large answer from a start of 1", 300, 1, 1024),
)
"""Simulated memory limits: each is a few microseconds per trial."""

NOTHING_FITS = ("nothing fits, not even 1", 0, 8, 64)
BUG_MESSAGE = ("mat1 and mat2 shapes cannot be multiplied (the check's stand-in for a bug in the "
               "training step: not an out-of-memory error)")  # fmt: skip

REAL_CFG = ModelConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=32)
REAL_BETWEEN = (5, 6)
"""The budget is set halfway between the measured peaks of these two batches."""
REAL_START, REAL_MAX = 2, 64


def trial_bound(max_batch: int) -> int:
    """Trials doubling and bisection need at most: about log2(max_batch) to double up (or halve
    down) to the first change, as many to bisect the gap, and one each for the ends."""
    return 2 * math.ceil(math.log2(max_batch)) + 2 if max_batch > 1 else 1


def _search_call(fn: Callable[..., Any], rec: _Recorded, start: int, max_batch: int) -> Any:
    """Run the learner's search; an escaped OOM or a stop from a trial becomes the failure."""
    try:
        return call(fn, rec.trial, rec.recover, start, max_batch)
    except _Stop as stop:
        raise ExerciseFailed(f"with start={start}, max_batch={max_batch}: {stop}") from None
    except ExerciseFailed as err:
        if isinstance(err.__cause__, torch.OutOfMemoryError):
            b = rec.calls[-1][0] if rec.calls else "?"
            raise ExerciseFailed(
                f"with start={start}, max_batch={max_batch}, trial({b}) raised "
                f"torch.OutOfMemoryError and your function let it escape. A failed trial is "
                f"the search's information (that batch does not fit): catch "
                f"torch.OutOfMemoryError around each trial, call recover(), and go on with a "
                f"smaller batch"
            ) from None
        raise


def _search_failure(fn: Callable[..., Any], rec: _Recorded, answer: int, start: int,
                    max_batch: int, what: str) -> str | None:  # fmt: skip
    """Run one search; what is wrong with how it ran or what it returned, or None."""
    got = require_int(_search_call(fn, rec, start, max_batch),
                       f"{callable_name(fn)}(trial, recover, start={start}, max_batch={max_batch})")  # fmt: skip
    at = f"on {what} (start={start}, max_batch={max_batch}; your trials: {rec.log()})"
    if rec.pending is not None:
        rec.unrecovered.append((rec.pending, None))
    if rec.unrecovered:
        failed, then = rec.unrecovered[0]
        after = (f"you called trial({then}) without calling recover() first" if then is not None
                 else "recover() was never called")  # fmt: skip
        return (f"{at}: after trial({failed}) failed, {after}. recover() frees what the failed "
                f"step left behind and checks that nothing leaked: call it after every failed "
                f"trial, before the next one")  # fmt: skip
    fitted = [b for b, ok in rec.calls if ok]
    failed_at = [b for b, ok in rec.calls if not ok]
    if got > max_batch:
        return (f"{at}: you returned {got}, above max_batch={max_batch}. max_batch is the cap: "
                f"never try or return more, even when everything fits")  # fmt: skip
    if got > answer:
        if got in failed_at:
            return (f"{at}: you returned {got}, but trial({got}) failed. Return the largest "
                    f"batch that fitted, not the first that failed")  # fmt: skip
        return (f"{at}: you returned {got}, which you never tried and which does not fit. "
                f"Return only a batch whose trial succeeded")  # fmt: skip
    if got < answer:
        if got < 1:
            return (f"{at}: you returned {got}; batch sizes start at 1, and {answer} fits")
        if got not in fitted:
            return (f"{at}: you returned {got}, which you never tried. Return only a batch whose "
                    f"trial succeeded, the largest of them")  # fmt: skip
        bigger = [b for b in failed_at if b > got]
        gap = min(bigger) if bigger else None
        if gap is not None and gap - got > 1 and not any(got < b < gap for b, _ in rec.calls):
            return (f"{at}: you returned {got}, but the largest batch that fits is {answer}: "
                    f"you stopped at the first failure ({gap}) without bisecting. Between the "
                    f"last batch that fitted and the first that failed, try the middle until "
                    f"the two are adjacent")  # fmt: skip
        return (f"{at}: you returned {got}, but the largest batch that fits is {answer}. Keep "
                f"the largest batch seen to fit and the smallest seen to fail, and narrow the "
                f"gap until they are adjacent")  # fmt: skip
    above = sorted({b for b, _ in rec.calls if b > max_batch})
    if above:
        return (f"{at}: you tried trial({above[0]}), above max_batch={max_batch}. Never try "
                f"more than the cap: double up to max_batch at most")  # fmt: skip
    bound = trial_bound(max_batch)
    if len(rec.calls) > bound:
        return (f"{at}: the answer is right, but your search ran {len(rec.calls)} trials. Each "
                f"is a real training step: doubling, then bisecting, needs at most about "
                f"2·log2(max_batch) + 2 = {bound} here. A step-by-one search costs one step "
                f"per batch size")  # fmt: skip
    return None


@dataclass(frozen=True)
class _RealCase:
    model: nn.Module
    budget_bytes: int
    answer: int
    reference_trials: int
    peaks: tuple[int, int]


def _budgeted(model: nn.Module, budget_bytes: int) -> BudgetedCPU:
    return BudgetedCPU(model, budget_bytes, seq_len=REAL_CFG.seq_len, dtype="float32",
                       train_cfg=TrainConfig())  # fmt: skip


@functools.cache
def _real_case() -> _RealCase:
    """A budget between two batches' measured peaks, and the reference search's answer under it
    (CPU peaks are counts of tensor bytes: the same on every run)."""
    from labkit.model import GPT

    torch.manual_seed(0)
    model = GPT(REAL_CFG)
    probe = _budgeted(model, 2**40)  # no limit: measure
    peaks = (probe(REAL_BETWEEN[0]), probe(REAL_BETWEEN[1]))
    probe.recover()
    budget = (peaks[0] + peaks[1]) // 2
    ref = _budgeted(model, budget)
    outcome = finder.search_max_batch(ref, start=REAL_START, max_batch=REAL_MAX,
                                      recover=ref.recover)  # fmt: skip
    if outcome.found != REAL_BETWEEN[0]:  # labkit's own search disagrees: not the learner's fault
        raise RuntimeError(f"labkit.batching.finder found {outcome.found} under a budget between "
                           f"the peaks of batches {REAL_BETWEEN}; please report this")  # fmt: skip
    return _RealCase(model, budget, outcome.found, len(outcome.trials), peaks)


def _verify_real(fn: Callable[..., Any]) -> tuple[_RealCase, _Recorded]:
    case = _real_case()
    device = _budgeted(case.model, case.budget_bytes)

    def run(batch: int) -> int:
        return device(batch)

    rec = _Recorded(run)
    what = (f"real training steps of a {REAL_CFG.n_layer}-layer GPT under a CPU budget of "
            f"{case.budget_bytes:,} bytes")  # fmt: skip
    failure = _search_failure(fn, rec, case.answer, REAL_START, REAL_MAX, what)
    if failure:
        raise ExerciseFailed(failure)
    gc.collect()
    if device.held_bytes:
        raise ExerciseFailed(
            f"on {what}: the answer is right, but after your search {device.held_bytes:,} bytes "
            f"that the trials allocated are still alive: memory is not back to its baseline. "
            f"Keep no reference to a failed trial (its exception or traceback), and call "
            f"recover() after each failure"
        )
    return case, rec


@exercise(
    "05.max_batch",
    "Find the largest batch that fits, recovering from each failure",
    hints=(
        "a failed trial is information, not a crash: it says that batch, and every larger one, "
        "does not fit. Every trial is a real training step, so spend few: grow fast until "
        "something fails, then narrow the gap between the largest batch that fitted and the "
        "smallest that failed",
        "keep two numbers, the largest batch seen to fit and the smallest seen to fail. Double "
        "from start, never past max_batch, until a trial fails or you reach max_batch; if start "
        "itself fails, halve until one fits, and if not even 1 fits, raise ValueError. Then try "
        "the middle of the two until they are adjacent",
        "catch only torch.OutOfMemoryError: any other error is a bug in the training step and "
        "must reach the caller. In that except branch call recover() before the next trial",
        "recipe: write a small helper that runs one trial at a batch and says whether it "
        "fitted: true when the trial returns; when the trial raises OutOfMemoryError, and only "
        "that error, it calls recover and says false. Begin at the smaller of start and "
        "max_batch. If that fits, it is the largest fit so far: double it, capped at "
        "max_batch, while each batch tried fits and max_batch is not yet reached; the first "
        "batch that fails is the smallest failure, and if every batch up to max_batch fitted, "
        "return max_batch. If the first batch fails instead, it is the smallest failure: halve "
        "it (whole-number division) until a batch fits, which is then the largest fit, and "
        "raise ValueError when the failure you would halve is already 1. Then, while the "
        "largest fit and the smallest failure are more than one apart, try the batch halfway "
        "between them (rounded down) and move whichever of the two it proves; return the "
        "largest fit",
    ),
    reference=reference_largest_batch,
)
def _verify_max_batch(largest_batch: Any) -> str:
    fn = require_callable(largest_batch, "largest_batch(trial, recover, start, max_batch) -> int")
    most = 0
    for what, fits_up_to, start, max_batch in SEARCH_CASES:
        rec = _Recorded(_synthetic(fits_up_to))
        failure = _search_failure(fn, rec, min(fits_up_to, max_batch), start, max_batch, what)
        if failure:
            raise ExerciseFailed(failure)
        most = max(most, len(rec.calls))
    _check_nothing_fits(fn)
    _check_bug_propagates(fn)
    case, rec = _verify_real(fn)
    return (f"largest_batch finds the largest batch on {len(SEARCH_CASES) + 2} simulated memory "
            f"limits (a cap, a failing start, nothing fitting, a non-memory error that must "
            f"propagate) in at most {most} trials, and on real training steps of a small GPT "
            f"under a CPU budget: batch {case.answer} in {len(rec.calls)} trials (labkit's "
            f"finder: {case.reference_trials}), recovering after each failure, with memory back "
            f"to its baseline")  # fmt: skip


def _check_nothing_fits(fn: Callable[..., Any]) -> None:
    what, fits_up_to, start, max_batch = NOTHING_FITS
    rec = _Recorded(_synthetic(fits_up_to))
    at = f"on {what} (start={start}, max_batch={max_batch})"
    try:
        got = fn(rec.trial, rec.recover, start, max_batch)
    except ValueError:
        return
    except _Stop as stop:
        raise ExerciseFailed(f"{at}: {stop}") from None
    except torch.OutOfMemoryError:
        raise ExerciseFailed(
            f"{at}: trial({rec.calls[-1][0]})'s torch.OutOfMemoryError escaped. When not even a "
            f"batch of 1 fits, say so: raise ValueError"
        ) from None
    except NotImplementedError:
        raise
    except Exception as err:
        raise ExerciseFailed(f"{at}: your function raised {type(err).__name__}: {err}; when "
                             f"not even a batch of 1 fits, raise ValueError") from err  # fmt: skip
    raise ExerciseFailed(f"{at}: you returned {short_repr(got)}, but no batch fits, not even "
                         f"1 (your trials: {rec.log()}): raise ValueError instead")  # fmt: skip


def _check_bug_propagates(fn: Callable[..., Any]) -> None:
    bug = RuntimeError(BUG_MESSAGE)
    tried = []

    def run(batch: int) -> int:
        tried.append(batch)
        raise bug

    start, max_batch = 8, 64
    rec = _Recorded(run)
    at = f"when every trial raises RuntimeError({BUG_MESSAGE.split(' (')[0]!r})"
    try:
        got = fn(rec.trial, rec.recover, start, max_batch)
    except RuntimeError as err:
        if err is bug or bug in _causes(err):
            return
        caught = f"raised {type(err).__name__}: {err}"
    except _Stop as stop:
        raise ExerciseFailed(f"{at}: {stop}") from None
    except NotImplementedError:
        raise
    except Exception as err:
        caught = f"raised {type(err).__name__}: {err}"
    else:
        caught = f"returned {short_repr(got)}"
    raise ExerciseFailed(
        f"{at}, your function took the error for 'does not fit' ({len(tried)} trials) and "
        f"then {caught}. torch.OutOfMemoryError is a RuntimeError, so catching RuntimeError "
        f"(or Exception) catches far more: catch only torch.OutOfMemoryError; other errors "
        f"are bugs and must reach the caller"
    )


def _causes(err: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while err.__cause__ or err.__context__:
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
        if err in seen:
            break
        seen.append(err)
    return seen
