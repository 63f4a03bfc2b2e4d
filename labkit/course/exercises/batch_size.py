"""Notebook 05's exercises (batch-size tuning), checked in the kernel.

* ``05.accumulation``: ``accumulate(model, batch, k)``: k micro-batches whose backward passes
  leave the whole batch's gradient in ``.grad``, against one backward over the batch
  (:func:`labkit.batching.accumulation.accumulated_gradients` with k=1).
* ``05.max_batch``: ``largest_batch(trial, recover, start, max_batch) -> int``: the largest
  batch that fits, by doubling and bisection with recovery after each failure, run on simulated
  memory limits and then on real training steps of a small GPT under a CPU memory budget
  (:class:`labkit.batching.trials.BudgetedCPU`), against
  :func:`labkit.batching.finder.search_max_batch`.
* ``05.noise_scale``: ``noise_scale(sq_small, sq_big, b_small, b_big) -> float``: B_simple from
  paired squared gradient norms (McCandlish et al. 2018, arXiv 1812.06162, appendix A.1), against
  :func:`labkit.batching.noise.estimate_noise_scale`.
* ``05.batch_plan``: ``plan_batch(target, ranks, fits, tokens_per_s, b_noise) -> (micro, k,
  worth_it)``: a decision from measurements, how each rank runs a global batch (the measured
  micro-batches that fit and make the target, the fastest within the sweep's noise, of those
  the fewest passes) and whether the global batch is worth it (McCandlish et al.'s eq. 2.11:
  at most twice the least tokens; None where the noise scale is not resolved). Checked on other
  machines' measurements (:data:`PLAN_CASES`, where each usual mistake gives a plan of its own)
  and on the notebook's (:func:`measured_here`); then the plan runs for real
  (:func:`run_plan`): one step under the notebook's memory limit, and its step time against one
  other split with :func:`labkit.verdict.compare_times`, which never fails a right plan.

Each check runs the learner's code on small, fixed inputs (about a second on a laptop CPU),
compares it with labkit's tested implementation, and names the usual mistake behind a wrong
answer without printing the code that would fix it.
"""

from __future__ import annotations

import copy
import functools
import gc
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from labkit import timing, train, verdict
from labkit.batching import accumulation, finder, noise, sweep, trials
from labkit.batching.noise import Batch
from labkit.batching.trials import BudgetedCPU
from labkit.config import ModelConfig, TrainConfig
from labkit.course.exercises import (
    ExerciseFailed,
    _name,
    _require_callable,
    _require_int,
    call,
    exercise,
    short_repr,
    time_limit_paused,
)
from labkit.data import get_batch

# --------------------------------------------------------------------------- references
# What later cells use while the learner's answer is not done or wrong.


def reference_accumulate(model: nn.Module, batch: Batch, k: int) -> None:
    """Add the gradient of ``batch``'s mean loss to ``.grad``, in k micro-batches."""
    x, y = batch
    if x.shape[0] % k:
        raise ValueError(f"k={k} does not divide the batch of {x.shape[0]} sequences: use a "
                         f"divisor of {x.shape[0]}")  # fmt: skip
    micro = x.shape[0] // k
    for xi, yi in zip(x.split(micro), y.split(micro), strict=True):
        _, loss = model(xi, yi)
        (loss / k).backward()  # the batch's mean loss is the mean of the k micro-batch means


def reference_largest_batch(trial: Callable[[int], Any], recover: Callable[[], None],
                            start: int, max_batch: int) -> int:  # fmt: skip
    """The largest batch in 1..max_batch whose ``trial`` does not raise out-of-memory."""
    return finder.search_max_batch(trial, start=start, max_batch=max_batch,
                                   recover=recover).found  # fmt: skip


def reference_noise_scale(sq_small: Sequence[float], sq_big: Sequence[float], b_small: int,
                          b_big: int) -> float:  # fmt: skip
    """B_simple = tr(Sigma)/|G|^2, each averaged over the measurements before dividing."""
    return noise.estimate_noise_scale(sq_small, sq_big, b_small, b_big).b_simple


# --------------------------------------------------------------------------- 05.accumulation

ACCUM_CFG = ModelConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, dropout=0.0)
"""A small GPT without dropout: its forward is deterministic, so parity is only rounding."""
ACCUM_BATCH = 8
ACCUM_RUNS = ((2, False), (4, True))
"""(k, whether .grad starts as zeros rather than None): the caller may have zeroed either way."""
ACCUM_KS = tuple(k for k, _ in ACCUM_RUNS)
ACCUM_REL_TOL = 1e-5
"""Largest relative difference per parameter tensor allowed: float32 summed in another order
(tests/test_batching_accumulation.py measures <= 4e-7)."""
_SAME = 1e-4  # a wrong answer "is" a known mistake when it is this close to it (relative)


@dataclass(frozen=True)
class _AccumCase:
    """The model and batch a check hands the learner, and the gradients to compare with."""

    model: nn.Module
    batch: Batch
    whole: dict[str, torch.Tensor]
    """Gradient of the whole batch's mean loss, by parameter name (one backward)."""
    micro: dict[int, list[dict[str, torch.Tensor]]]
    """k -> the gradient of each micro-batch's own mean loss, in order."""


@functools.cache
def _accum_case() -> _AccumCase:
    from labkit.model import GPT  # lazy: only the checks need a model

    torch.manual_seed(0)
    model = GPT(ACCUM_CFG).train()
    g = torch.Generator().manual_seed(1)
    shape = (ACCUM_BATCH, ACCUM_CFG.seq_len)
    batch = (torch.randint(0, ACCUM_CFG.vocab_size, shape, generator=g),
             torch.randint(0, ACCUM_CFG.vocab_size, shape, generator=g))  # fmt: skip
    whole = accumulation.accumulated_gradients(model, batch, 1)
    micro = {}
    for k in ACCUM_KS:
        size = ACCUM_BATCH // k
        micro[k] = [accumulation.accumulated_gradients(model, (xi, yi), 1)
                    for xi, yi in zip(batch[0].split(size), batch[1].split(size), strict=True)]  # fmt: skip
    return _AccumCase(model, batch, whole, micro)


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.detach().double().flatten() for g in grads.values()])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _accum_mistakes(case: _AccumCase, k: int) -> list[tuple[torch.Tensor, str]]:
    """The gradient each usual mistake leaves in .grad, with what the check says about it."""
    whole = _flat(case.whole)
    micro = [_flat(m) for m in case.micro[k]]
    zeroed = ("only the last micro-batch's gradient is left in .grad: zeroing the gradients "
              "inside the loop wipes what the earlier micro-batches added. They start at zero "
              "(the caller zeroes them once per optimizer step), so never zero them between "
              "micro-batches")  # fmt: skip
    first = ("the gradients are those of the first micro-batch alone: each pass must use its "
             "own slice of the batch (the i-th B/k sequences), and every one of the k must run")  # fmt: skip
    return [
        (sum(micro), f"the gradients are k={k} times too large: backward() adds into .grad, so "
                     f"k undivided micro-batch losses add up k mean gradients. The batch's mean "
                     f"loss is the average of the k micro-batch means: divide each micro-batch's "
                     f"loss by k before its backward"),
        (micro[-1] / k, zeroed),
        (micro[-1], f"{zeroed} (and the loss was not divided by k either)"),
        (micro[0] / k, first),
        (micro[0], f"{first} (and the loss was not divided by k either)"),
        (whole / k, f"the gradients are k={k} times too small: the loss was divided by k twice "
                    f"(once is what makes the average)"),
    ]  # fmt: skip


def _forward_recorder(model: nn.Module) -> tuple[list[int], Any]:
    """Record the batch size (rows of the token ids) of every call of ``model``."""
    sizes: list[int] = []

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(ids, torch.Tensor) and ids.dim() >= 1:
            sizes.append(int(ids.shape[0]))

    return sizes, model.register_forward_pre_hook(hook, with_kwargs=True)


def _split_failure(sizes: list[int], k: int, batch: int) -> str | None:
    """What is wrong with the micro-batches the model ran on, or None."""
    micro = batch // k
    if not sizes or sizes == [micro] * k:
        return None  # no call seen (model.forward called directly): the gradients will tell
    ran = f"the model ran {len(sizes)} time{'s' * (len(sizes) > 1)} on {_sizes(sizes)}"
    want = f"k={k} micro-batches of B/k={micro} sequences each, one forward and backward each"
    if sizes == [batch]:
        return (f"{ran}, the whole batch at once: the gradients may be right, but nothing was "
                f"accumulated, and the memory is that of the whole batch. Run {want}")  # fmt: skip
    if k != micro and sizes == [k] * micro:
        return (f"{ran}: that is B/k micro-batches of k sequences. k is the number of "
                f"micro-batches: run {want}")  # fmt: skip
    if len(sizes) < k and set(sizes) == {micro}:
        return (f"{ran}, not k={k}: the loop stopped early (a return or break inside it?). "
                f"Run {want}")  # fmt: skip
    return f"{ran}; expected {want}"


def _sizes(sizes: list[int]) -> str:
    if len(set(sizes)) == 1:
        return f"{sizes[0]} sequence{'s' * (sizes[0] > 1)}" + (" each" if len(sizes) > 1 else "")
    return f"batches of {', '.join(map(str, sizes))} sequences"


def _max_rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest normwise relative difference over tensors whose true gradient is not zero
    (as :func:`labkit.batching.accumulation.gradient_parity` measures it), and where."""
    total = float(_flat(want).norm())
    worst, where = 0.0, ""
    for name, w in want.items():
        w64 = w.double()
        if float(w64.norm()) <= accumulation.ZERO_GRADIENT * total:
            continue  # a key bias: its true gradient is 0 (softmax's shift invariance)
        rel = float((got[name].double() - w64).norm() / w64.norm())
        if rel > worst:
            worst, where = rel, name
    return worst, where


def _accumulation_failure(fn: Callable[..., Any], k: int, with_zeros: bool) -> tuple[str | None, float]:
    """Run the learner's ``accumulate`` once; return what is wrong (or None) and the error."""
    case = _accum_case()
    model = copy.deepcopy(case.model)
    if with_zeros:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    before = [p.detach().clone() for p in model.parameters()]
    sizes, handle = _forward_recorder(model)
    x, y = case.batch
    try:
        call(fn, model, (x.clone(), y.clone()), k)
    finally:
        handle.remove()
    at = f"with k={k} (a batch of B={ACCUM_BATCH} sequences)"
    if any(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True)):
        return (f"{at} the model's parameters changed: accumulate only fills .grad. The "
                f"optimizer step, and zeroing the gradients after it, are the caller's, once "
                f"per k micro-batches"), math.nan  # fmt: skip
    grads = dict(model.named_parameters())
    needed = [n for n in grads if bool(case.whole[n].abs().max() > 0)]
    missing = [n for n in needed if grads[n].grad is None]
    if missing and missing == needed:
        ran = "the model was never called and" if not sizes else "the model ran but"
        return (f"{at} {ran} every parameter's .grad is still None: no backward pass ran. "
                f"Each micro-batch's loss needs its own backward(), which adds its gradient "
                f"into .grad"), math.nan  # fmt: skip
    if missing:
        return (f"{at} the .grad of {len(missing)} parameters is None (first: {missing[0]}): "
                f"the gradients must end up in each parameter's .grad, where backward() puts "
                f"them"), math.nan  # fmt: skip
    split = _split_failure(sizes, k, ACCUM_BATCH)
    if split:
        return f"{at} {split}", math.nan
    got = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in grads.items()}
    if not any(bool(g.any()) for g in got.values()):
        return (f"{at} every parameter's .grad is still zero: no gradient reached .grad. Each "
                f"micro-batch's loss needs its own backward(), which adds its gradient into "
                f".grad"), math.nan  # fmt: skip
    worst, where = _max_rel(got, case.whole)
    if worst <= ACCUM_REL_TOL:
        return None, worst
    flat = _flat(got)
    for wrong, why in _accum_mistakes(case, k):
        if _rel(flat, wrong) < _SAME:
            return f"{at} {why}", worst
    ratio = float(flat.norm() / _flat(case.whole).norm())
    return (f"{at} the gradient of {where} differs from one backward over the whole batch by "
            f"{worst:.2g} (relative; float32 rounding stays below {ACCUM_REL_TOL:g}), and the "
            f"whole gradient's norm is {ratio:.3g} times the right one. Each of the k "
            f"micro-batches must add 1/k of its own mean-loss gradient"), worst  # fmt: skip


@exercise(
    "05.accumulation",
    "Accumulate k micro-batches into one batch's gradients",
    hints=(
        "the mean loss over a batch is the average of the mean losses of k equal micro-batches, "
        "and gradients are linear. A backward pass adds into the gradients already stored "
        "instead of replacing them, so k backward passes can build the whole batch's gradient, "
        "if each adds the right share",
        "split x and y the same way into k micro-batches of B/k sequences and run a forward and "
        "a backward on each. Do not zero the gradients between them (they start at zero) and "
        "do not step an optimizer: the caller does both, once per k micro-batches",
        "each micro-batch's loss is a mean over its own B/k sequences; the whole batch's mean "
        "loss is 1/k times the sum of the k of them. Scale each loss before its backward",
        "recipe: a micro-batch holds B divided by k sequences, a whole number; split x and y "
        "along their first dimension into pieces of that many sequences and walk the two lists "
        "of pieces side by side; for each pair, run the model on it and keep the loss it "
        "returns, divide that loss by k, and run backward on the quotient. Nothing else: no "
        "zeroing of the gradients, no optimizer step",
    ),
    reference=reference_accumulate,
)
def _verify_accumulation(accumulate: Any) -> str:
    fn = _require_callable(accumulate, "accumulate(model, batch, k) -> None")
    worst = 0.0
    for k, with_zeros in ACCUM_RUNS:
        failure, rel = _accumulation_failure(fn, k, with_zeros)
        if failure:
            raise ExerciseFailed(failure)
        worst = max(worst, rel)
    ks = " and ".join(f"k={k}" for k, _ in ACCUM_RUNS)
    return (f"accumulate leaves the gradient of one backward over the whole batch in .grad for "
            f"{ks} (B={ACCUM_BATCH}, a {ACCUM_CFG.n_layer}-layer GPT): largest relative "
            f"difference {worst:.1e}, float32 rounding")  # fmt: skip


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
    got = _require_int(_search_call(fn, rec, start, max_batch),
                       f"{_name(fn)}(trial, recover, start={start}, max_batch={max_batch})")  # fmt: skip
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
    fn = _require_callable(largest_batch, "largest_batch(trial, recover, start, max_batch) -> int")
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


# --------------------------------------------------------------------------- 05.noise_scale

NOISE_KNOWN = (
    # Around |G|^2 = 1, tr(Sigma) = 64 (B_simple 64): E|G_B|^2 = 1 + 64/B is 17 at B=4 and 3 at
    # B=32; each measurement is off by noise, so the per-pair estimates differ.
    ("four measurements whose pair estimates differ", 4, 32,
     (15.0, 19.0, 14.0, 18.0), (3.4, 3.0, 3.1, 2.9)),
)  # fmt: skip
NOISE_REAL_B = (2, 16)
NOISE_REAL_PAIRS = 4


@functools.cache
def _real_noise_case() -> tuple[str, int, int, tuple[float, ...], tuple[float, ...]]:
    """Squared gradient norms of a small GPT at initialisation, measured now (milliseconds)."""
    from labkit.model import GPT

    torch.manual_seed(0)
    model = GPT(ACCUM_CFG)
    g = torch.Generator().manual_seed(2)
    bs, bb = NOISE_REAL_B

    def batch(b: int) -> Batch:
        # a rule to learn (the next token is this one plus 1): on random targets the true
        # gradient is near 0 and a few pairs cannot resolve it (the estimate of |G|^2 is <= 0)
        x = torch.randint(0, ACCUM_CFG.vocab_size, (b, ACCUM_CFG.seq_len), generator=g)
        return x, (x + 1) % ACCUM_CFG.vocab_size

    small, big = [], []
    for _ in range(NOISE_REAL_PAIRS):
        small += noise.gradient_sq_norms(model, [batch(bs)])
        big += noise.gradient_sq_norms(model, [batch(bb)])
    return ("squared gradient norms of a small GPT at initialisation, measured now", bs, bb,
            tuple(small), tuple(big))  # fmt: skip


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def noise_mistakes(small: Sequence[float], big: Sequence[float], bs: int,
                   bb: int) -> dict[str, float]:  # fmt: skip
    """The value each usual mistake gives, keyed by what the check says about it."""
    g2 = [(bb * gb - bs * gs) / (bb - bs) for gs, gb in zip(small, big, strict=True)]
    tr = [(gs - gb) / (1 / bs - 1 / bb) for gs, gb in zip(small, big, strict=True)]
    # b_small and b_big swapped (or the two lists): each formula with the other batch's size
    g2_swapped = [(bs * gb - bb * gs) / (bs - bb) for gs, gb in zip(small, big, strict=True)]
    tr_swapped = [(gs - gb) / (1 / bb - 1 / bs) for gs, gb in zip(small, big, strict=True)]
    mistakes = {
        "you averaged the ratio of each pair. One pair's |G|² estimate is noisy (it can be near "
        "0, or negative), and the mean of ratios of noisy numbers is biased: average the |G|² "
        "estimates and the tr(Σ) estimates over all pairs first, then divide once":
            _mean([t / g for t, g in zip(tr, g2, strict=True)]),
        "b_small and b_big are swapped (or the two lists are): the small batch's gradient is "
        "the noisier, so its squared norm is the larger one, and it goes with b_small":
            _mean(tr_swapped) / _mean(g2_swapped),
        "you used |G_big|² as |G|²: a batch of b_big still carries noise tr(Σ)/b_big. Combine "
        "both sizes into the unbiased estimate of |G|²": _mean(tr) / _mean(big),
        "tr(Σ) is missing its denominator: |G_small|² − |G_big|² estimates "
        "tr(Σ)·(1/b_small − 1/b_big), so divide by that":
            _mean([gs - gb for gs, gb in zip(small, big, strict=True)]) / _mean(g2),
        "|G|² is missing its denominator: b_big·|G_big|² − b_small·|G_small|² estimates "
        "|G|²·(b_big − b_small), so divide by that":
            _mean(tr) / _mean([bb * gb - bs * gs for gs, gb in zip(small, big, strict=True)]),
        "that is |G|²/tr(Σ), upside down: B_simple = tr(Σ)/|G|², the batch at which the noise "
        "equals the signal": _mean(g2) / _mean(tr),
        "you used only the first measurement: one pair is noisy; average over all of them":
            tr[0] / g2[0],
    }  # fmt: skip
    return mistakes


@exercise(
    "05.noise_scale",
    "The gradient noise scale B_simple from two batch sizes",
    hints=(
        "a batch gradient's squared norm is signal plus noise: on average the true gradient's "
        "squared norm plus the per-example noise divided by the batch size. Two batch sizes "
        "give two equations in those two unknowns; B_simple is noise over signal",
        "solve the two equations for one measurement pair. For |G|², eliminate the noise: "
        "weight each squared norm by its batch size and divide by the difference of the sizes. "
        "For tr(Σ), eliminate the signal: the difference of the squared norms over the "
        "difference of 1/B",
        "one pair's estimates are noisy and can even be negative, and a ratio of noisy numbers "
        "is biased: average the |G|² estimates and the tr(Σ) estimates over all pairs first, "
        "then divide once. Return a Python float",
        "recipe: take the measurements pair by pair, the small batch's squared norm with the "
        "big batch's of the same index, and write eq. A.1 once for each of the two sizes. To "
        "eliminate the noise and keep the signal |G|², multiply each squared norm by its own "
        "batch size, take the small batch's product from the big batch's, and divide by the "
        "big size less the small size. To eliminate the signal and keep the noise, the trace "
        "of Σ, take the big batch's squared norm from the small batch's and divide by the "
        "reciprocal of the small size less the reciprocal of the big size. Average the signal "
        "estimates over all pairs, average the noise estimates over all pairs, and return the "
        "noise average divided by the signal average, as a Python float",
    ),
    reference=reference_noise_scale,
)
def _verify_noise_scale(noise_scale: Any) -> str:
    fn = _require_callable(noise_scale, "noise_scale(sq_small, sq_big, b_small, b_big) -> float")
    cases = [*NOISE_KNOWN, _real_noise_case()]
    for what, bs, bb, small, big in cases:
        got = call(fn, list(small), list(big), bs, bb)
        if isinstance(got, noise.NoiseScale):
            raise ExerciseFailed(
                f"{_name(fn)} returned a NoiseScale (labkit's whole estimate); return the float "
                f"B_simple itself (its b_simple)"
            )
        if isinstance(got, (torch.Tensor, bool)) or not isinstance(got, numbers.Real):
            raise ExerciseFailed(
                f"{_name(fn)}(...) returned {type(got).__name__} {short_repr(got)}; return a "
                f"Python float (float(x), or x.item() for a one-element tensor)"
            )
        expected = reference_noise_scale(small, big, bs, bb)
        if math.isclose(float(got), expected, rel_tol=1e-9):
            continue
        why = next((w for w, v in noise_mistakes(small, big, bs, bb).items()
                    if math.isclose(float(got), v, rel_tol=1e-9)),
                   "estimate |G|² and tr(Σ) for each pair, average each, then divide")  # fmt: skip
        raise ExerciseFailed(
            f"on {what} (b_small={bs}, b_big={bb}, {len(small)} pairs) expected B_simple = "
            f"{expected:.6g} (labkit.batching.noise.estimate_noise_scale), got {float(got):.6g}: "
            f"{why}"
        )
    _, bs, bb, small, big = cases[-1]
    return (f"noise_scale agrees with labkit.batching.noise.estimate_noise_scale on "
            f"{len(cases)} sets of measurements, among them real gradients of a small GPT "
            f"(B_simple = {reference_noise_scale(small, big, bs, bb):.3g} sequences)")  # fmt: skip


# --------------------------------------------------------------------------- 05.batch_plan

FLAT = sweep.SATURATION
"""Measured tokens/s at or above this fraction of the fastest candidate count as "as fast": the
sweep's medians move by about 10% between runs on a shared machine (``sweep.SATURATION``)."""


@dataclass(frozen=True)
class PlanInputs:
    """What a batch plan is decided from: a target global batch and one machine's measurements."""

    target: int
    """The global batch a recipe asks for: sequences per optimiser step, all ranks together."""
    ranks: int
    """Data-parallel ranks, each with its own device (and memory)."""
    fits: int
    """The largest micro-batch one rank's memory holds: the finder's, for one pass."""
    tokens_per_s: dict[int, float]
    """Measured tokens/s of a training step at each micro-batch size (the sweep's medians)."""
    b_noise: float
    """The measured gradient noise scale B_simple in sequences; nan, inf or <= 0 where the
    measurement did not resolve it."""
    what: str = "this notebook's measurements"

    def args(self) -> tuple[int, int, int, dict[int, float], float]:
        """The learner's arguments, in order (a fresh dict of the sweep: the function may
        change it)."""
        return self.target, self.ranks, self.fits, dict(self.tokens_per_s), self.b_noise

    def describe(self) -> str:
        sweep_text = ", ".join(f"{b}: {t:,.0f}" for b, t in sorted(self.tokens_per_s.items()))
        return (f"target {self.target} sequences per step on {self.ranks} rank"
                f"{'s' * (self.ranks > 1)}, fits {self.fits}, tokens/s {{{sweep_text}}}, "
                f"b_noise {self.b_noise:.3g}")  # fmt: skip


def _resolved(b_noise: float) -> bool:
    return isinstance(b_noise, numbers.Real) and math.isfinite(b_noise) and b_noise > 0


def _candidates(target: int, ranks: int, fits: int, tokens_per_s: dict[int, float]) -> list[int]:
    """Measured micro-batches that fit one rank and divide its share of the target."""
    share = target // ranks
    return sorted(b for b in tokens_per_s if 1 <= b <= fits and share % b == 0)


def reference_plan_batch(target: int, ranks: int, fits: int, tokens_per_s: dict[int, float],
                         b_noise: float) -> tuple[int, int, bool | None]:  # fmt: skip
    """(micro-batch, accumulation steps, worth it) for ``target`` sequences per optimiser step.

    Every split of one global batch gives the same gradient, so the split is chosen for speed
    alone: among the measured micro-batches that fit a rank and divide its share, those within
    the sweep's noise (:data:`FLAT`) of the fastest are as fast, and of those the one with the
    fewest accumulation steps (each pass pays the fixed per-pass costs). The target is worth it
    when it needs at most twice the least tokens to a given loss, 1 + B/B_noise <= 2
    (McCandlish et al. 2018, eq. 2.11): None where the noise scale is not resolved.
    """
    if target % ranks:
        raise ValueError(f"target={target} is not a multiple of ranks={ranks}: every rank "
                         f"runs the same number of sequences per step")  # fmt: skip
    candidates = _candidates(target, ranks, fits, tokens_per_s)
    if not candidates:
        raise ValueError(f"no measured micro-batch in {sorted(tokens_per_s)} fits {fits} and "
                         f"divides each rank's {target // ranks} sequences")  # fmt: skip
    best = max(tokens_per_s[b] for b in candidates)
    micro = max(b for b in candidates if tokens_per_s[b] >= FLAT * best)
    worth = (target <= b_noise) if _resolved(b_noise) else None
    return micro, target // ranks // micro, worth


def _flat_sweep(rates: dict[int, float]) -> dict[int, float]:
    return {b: float(t) for b, t in rates.items()}


PLAN_CASES = (
    PlanInputs(512, 1, 96, _flat_sweep({8: 40e3, 16: 70e3, 32: 105e3, 64: 130e3, 128: 142e3}),
               2000.0, "a GPU whose throughput still rises where its memory ends"),
    PlanInputs(128, 1, 200, _flat_sweep({1: 21e3, 2: 26e3, 4: 48e3, 8: 49e3, 16: 59e3,
                                         32: 57e3, 64: 58e3, 128: 50e3}),
               11.2, "a CPU whose throughput is flat from 16 on and falls at 128"),
    PlanInputs(96, 2, 40, _flat_sweep({3: 30e3, 6: 52e3, 12: 60e3, 24: 63e3, 48: 64e3}),
               70.0, "two ranks, a sweep of multiples of 3"),
    PlanInputs(1024, 4, 80, _flat_sweep({16: 100e3, 32: 118e3, 64: 112e3}),
               100.0, "four ranks whose fastest median is not the largest of the flat ones"),
    PlanInputs(64, 1, 20, _flat_sweep({1: 20e3, 2: 30e3, 4: 45e3, 8: 50e3, 16: 52e3, 32: 53e3}),
               math.nan, "a noise scale that was not resolved (nan)"),
    PlanInputs(48, 1, 40, _flat_sweep({4: 30e3, 8: 40e3, 16: 44e3, 32: 45e3}),
               -3.5, "a negative noise-scale estimate, and a fast size that does not divide"),
)  # fmt: skip
"""Other machines' measurements: each usual mistake gives a plan of its own in at least one
(tests/test_exercises_batch_size.py holds them apart)."""


def _plan_answer(got: Any, shown: str) -> tuple[int, int, bool | None]:
    """The learner's plan as (micro, k, worth), or a failure naming what came back."""
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        n = len(got) if isinstance(got, (tuple, list)) else None
        more = (" (did you leave out worth_it?)" if n == 2 else "")
        raise ExerciseFailed(f"{shown} returned {short_repr(got)}; return three things, "
                             f"(micro_batch, accumulation_steps, worth_it){more}")  # fmt: skip
    micro = _require_int(got[0], f"{shown}[0] (the micro-batch)")
    k = _require_int(got[1], f"{shown}[1] (the accumulation steps)")
    worth = got[2]
    if worth is not None and not isinstance(worth, bool):
        raise ExerciseFailed(f"{shown} returned worth_it={short_repr(worth)} "
                             f"({type(worth).__name__}); return True, False, or None where the "
                             f"measurements cannot say (bool(...) makes a Python bool)")  # fmt: skip
    return micro, k, worth


def _worth_rule(answers: dict[int, tuple[PlanInputs, tuple[int, int, bool | None]]],
                rule: Callable[[PlanInputs, tuple[int, int, bool | None]], float]) -> bool:
    """Whether every worth_it the learner gave on a resolved noise scale is ``rule``'s number
    held against the noise scale (one case alone cannot tell the share from the micro-batch)."""
    resolved = [(c, got) for c, got in answers.values() if _resolved(c.b_noise)]
    return bool(resolved) and all(got[2] == (rule(c, got) <= c.b_noise) for c, got in resolved)


def _plan_failure(case: PlanInputs, got: tuple[int, int, bool | None],
                  answers: dict[int, tuple[PlanInputs, tuple[int, int, bool | None]]]
                  ) -> str | None:  # fmt: skip
    """What is wrong with the plan ``got`` for ``case``, naming the usual mistake, or None.
    ``answers``: the learner's plan on every case, by position (to tell mistakes apart)."""
    micro, k, worth = got
    T, n, F, tps, bn = case.target, case.ranks, case.fits, case.tokens_per_s, case.b_noise
    right_m, right_k, right_w = reference_plan_batch(*case.args())
    share = T // n
    at = f"for {case.what} ({case.describe()}) you planned {micro} × {k}, worth_it={worth!r}"
    if micro < 1 or k < 1:
        return f"{at}: a micro-batch and a number of accumulation steps are counts, at least 1"
    if micro * k * n != T:
        if n > 1 and micro * k == T:
            return (f"{at}: on {n} ranks that makes {micro * k * n} sequences per optimiser step, "
                    f"{n} times the target. Each rank runs its own micro-batches and the "
                    f"all-reduce averages them all: the global batch is micro-batch × "
                    f"accumulation × ranks, so a rank's share is the target over the ranks")  # fmt: skip
        if share % micro:
            return (f"{at}: each rank's share of {share} sequences is not a whole number of "
                    f"micro-batches of {micro}, so no accumulation count makes the target "
                    f"exactly ({micro} × {k} × {n} = {micro * k * n})")  # fmt: skip
        return (f"{at}: {micro} × {k} × {n} rank{'s' * (n > 1)} = {micro * k * n} sequences per "
                f"optimiser step, not the target {T}")  # fmt: skip
    if micro > F:
        return (f"{at}: a micro-batch of {micro} does not fit: the finder fitted at most {F} in "
                f"one rank's memory. Memory is per rank and per micro-batch: accumulation is "
                f"how a larger batch gets through it")  # fmt: skip
    if micro not in tps:
        return (f"{at}: micro-batch {micro} was never measured (the sweep measured "
                f"{sorted(tps)}): its speed is a guess. Decide among the measured sizes")  # fmt: skip
    candidates = _candidates(T, n, F, tps)
    fastest = max(candidates, key=lambda b: tps[b])
    if micro > right_m:  # the largest that fits and divides, measured slower beyond the noise
        return (f"{at}: the sweep measured micro-batch {micro} at {tps[micro]:,.0f} tokens/s, "
                f"{1 - tps[micro] / tps[fastest]:.0%} below {fastest}'s {tps[fastest]:,.0f}, more "
                f"than the sweep's noise ({1 - FLAT:.0%}). The largest micro-batch that fits is "
                f"not the fastest here: the measurements choose, not the memory")  # fmt: skip
    if micro < right_m:
        if tps[micro] >= FLAT * tps[fastest]:
            return (f"{at}: micro-batch {right_m} also fits and divides each rank's share, and "
                    f"the sweep cannot tell it from {micro} (both within {1 - FLAT:.0%} of the "
                    f"fastest, {fastest}: a median that high is luck as much as speed). Every "
                    f"split of one global batch gives the same gradient (section 3), so the "
                    f"{k} accumulation steps buy nothing over {right_k}, and each pass pays the "
                    f"fixed per-pass costs of section 1 again: of splits that are as fast, take "
                    f"the one with the fewest passes")  # fmt: skip
        return (f"{at}: the sweep measured micro-batch {micro} at {tps[micro]:,.0f} tokens/s, "
                f"{1 - tps[micro] / tps[fastest]:.0%} below {fastest}'s: more accumulation "
                f"than needed. Accumulating does not change the gradient (section 3); it only "
                f"cuts the step into more, slower passes. A larger measured micro-batch that "
                f"fits and divides each rank's share runs faster")  # fmt: skip
    if worth is right_w:
        return None
    if right_w is None:
        return (f"{at}: the noise scale was not resolved (b_noise={bn!r}: an estimate of |G|² "
                f"that was not positive gives no finite, positive scale), so the measurements "
                f"cannot say whether the target is worth it: say None, not {worth!r}")  # fmt: skip
    if worth is None:
        return (f"{at}: the noise scale is resolved here ({bn:.3g} sequences), so the "
                f"measurements can decide: say True or False")  # fmt: skip
    if _worth_rule(answers, lambda c, g: g[0]) and worth == (micro <= bn):
        return (f"{at}: you held the micro-batch ({micro}) against the noise scale ({bn:.3g}). "
                f"The optimiser steps once on the average of all {k * n} micro-batches of the "
                f"step: the gradient's noise is that of the global batch of {T}")  # fmt: skip
    if n > 1 and worth == (share <= bn) and (share <= bn) != (T <= bn):
        return (f"{at}: you held each rank's share ({share} sequences) against the noise scale "
                f"({bn:.3g}). The noise scale is about the gradient one optimiser step "
                f"averages, and with data parallelism that is every rank's micro-batches "
                f"together: the global batch of {T}")  # fmt: skip
    return (f"{at}: a global batch of {T} against a noise scale of {bn:.3g} sequences needs "
            f"1 + B/B_noise = {1 + T / bn:.3g} times the least tokens to reach a given loss "
            f"(McCandlish et al. 2018, eq. 2.11): {'at most' if right_w else 'more than'} "
            f"twice, which is where the trade of steps for tokens stops paying (B_crit)")  # fmt: skip


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
        against what the sweep said ("as the sweep said", "against the sweep", "noisy")."""
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
    if worth is None or not _resolved(i.b_noise):
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
    others = [b for b in _candidates(inputs.target, inputs.ranks, inputs.fits,
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
    fn = _require_callable(plan_batch, "plan_batch(target, ranks, fits, tokens_per_s, b_noise) "
                                       "-> (micro_batch, accumulation_steps, worth_it)")  # fmt: skip
    here = _HERE
    cases = [*PLAN_CASES, *([here.inputs] if here is not None else [])]
    answers = {}
    for i, case in enumerate(cases):
        shown = f"{_name(fn)}(target={case.target}, ranks={case.ranks}, fits={case.fits}, ...)"
        answers[i] = (case, _plan_answer(call(fn, *case.args()), shown))
    for case, got in answers.values():
        failure = _plan_failure(case, got, answers)
        if failure:
            raise ExerciseFailed(failure)
    plans = [got for _, got in answers.values()]
    said = (f"{_name(fn)} decides as the measurements say on {len(PLAN_CASES)} other machines' "
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
