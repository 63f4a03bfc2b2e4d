"""Notebook 05's exercise checks: they pass on the solutions, say "not done" on the stubs, and
name each usual mistake."""

from __future__ import annotations

import math

import pytest
import torch
from exercise_cells import assert_check_passes, assert_stub_is_not_done

from labkit import exercises as ex
from labkit.batching import finder, noise, trials
from labkit.exercises import batch_size as exbs

# --------------------------------------------------------------------------- solutions, written
# the way the solution notebook marks them (these are its cells, less the ex.check line), so
# the same source yields the stub.

SOLUTIONS = {
    "05.accumulation": """
import torch

def accumulate(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], k: int) -> None:
    \"\"\"Forward and backward k micro-batches of B/k sequences; afterwards each .grad holds the
    gradient of the mean loss over the whole batch. No zero_grad, no optimizer step.\"\"\"
    # BEGIN SOLUTION
    x, y = batch
    micro = x.shape[0] // k
    for xi, yi in zip(x.split(micro), y.split(micro), strict=True):
        _, loss = model(xi, yi)
        (loss / k).backward()  # backward() adds into .grad: k shares of 1/k make the mean
    # END SOLUTION
answer = accumulate
""",
    "05.max_batch": """
import torch

def largest_batch(trial, recover, start: int, max_batch: int) -> int:
    \"\"\"The largest batch in 1..max_batch whose trial(b) does not raise torch.OutOfMemoryError:
    double from start, then bisect; recover() after every failed trial. ValueError if not even
    a batch of 1 fits.\"\"\"
    # BEGIN SOLUTION
    def fits(b: int) -> bool:
        try:
            trial(b)
            return True
        except torch.OutOfMemoryError:  # only this: any other error is a bug
            recover()
            return False

    b = min(start, max_batch)
    if fits(b):
        lo, hi = b, None  # largest batch seen to fit, smallest seen to fail
        while lo < max_batch:
            b = min(2 * lo, max_batch)
            if not fits(b):
                hi = b
                break
            lo = b
        if hi is None:
            return lo  # everything up to the cap fits
    else:
        hi = b
        while True:
            if hi == 1:
                raise ValueError("not even a micro-batch of 1 fits")
            b = hi // 2
            if fits(b):
                lo = b
                break
            hi = b
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
    # END SOLUTION
answer = largest_batch
""",
    "05.noise_scale": """
import torch

def noise_scale(sq_small: list[float], sq_big: list[float], b_small: int, b_big: int) -> float:
    \"\"\"B_simple = tr(Sigma) / |G|^2 from paired squared gradient norms at two batch sizes: each
    pair's unbiased estimates, averaged over the pairs, then divided.\"\"\"
    # BEGIN SOLUTION
    pairs = list(zip(sq_small, sq_big, strict=True))
    g2 = [(b_big * big - b_small * small) / (b_big - b_small) for small, big in pairs]
    tr = [(small - big) / (1 / b_small - 1 / b_big) for small, big in pairs]
    return sum(tr) / sum(g2)  # the ratio of the means (the 1/n cancels), not a mean of ratios
    # END SOLUTION
answer = noise_scale
""",
}


def test_the_notebook_05_exercises_are_registered():
    assert [e.id for e in ex.catalogue("05")] == [
        "05.accumulation", "05.max_batch", "05.noise_scale"]  # fmt: skip
    assert all(e.reference is not None for e in ex.catalogue("05"))


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_check_passes_on_the_solution_and_on_the_reference(exercise_id, capsys):
    assert_check_passes(exercise_id, SOLUTIONS[exercise_id], capsys)


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_the_stub_is_not_done_and_gives_nothing_away(exercise_id, capsys):
    assert_stub_is_not_done(exercise_id, SOLUTIONS[exercise_id], capsys,
                            secrets=("loss / k", "x.split", "fits(", "// 2", "b_big * big"))


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_hints_go_from_the_idea_to_the_recipe(exercise_id):
    hints = ex.get(exercise_id).hints
    assert 3 <= len(hints) <= 4 and hints[-1].startswith("recipe:")
    first = hints[0]  # conceptual: no code, no formula that is the answer
    assert not any(s in first for s in ("=", "backward()", "//", "recover()", "b_big", "mean("))


def test_a_check_that_is_not_given_a_function_says_so():
    with pytest.raises(ex.ExerciseFailed, match=r"expected the function accumulate\(model"):
        ex.verify("05.accumulation", 42)


# --------------------------------------------------------------------------- 05.accumulation
# Learner-style answers, each with one usual mistake.


def _micro(batch, k):
    x, y = batch
    n = x.shape[0] // k
    return list(zip(x.split(n), y.split(n), strict=True))


def no_division(model, batch, k):
    for xi, yi in _micro(batch, k):
        model(xi, yi)[1].backward()


def zero_grad_inside(model, batch, k):
    for xi, yi in _micro(batch, k):
        model.zero_grad()
        (model(xi, yi)[1] / k).backward()


def zero_grad_inside_undivided(model, batch, k):
    for xi, yi in _micro(batch, k):
        model.zero_grad()
        model(xi, yi)[1].backward()


def forward_only(model, batch, k):
    for xi, yi in _micro(batch, k):
        model(xi, yi)


def autograd_grad(model, batch, k):
    for xi, yi in _micro(batch, k):
        torch.autograd.grad(model(xi, yi)[1] / k, list(model.parameters()))


def steps_an_optimizer(model, batch, k):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for xi, yi in _micro(batch, k):
        (model(xi, yi)[1] / k).backward()
    optimizer.step()


def returns_inside_the_loop(model, batch, k):
    for xi, yi in _micro(batch, k):
        (model(xi, yi)[1] / k).backward()
        return


def same_slice_every_time(model, batch, k):
    first = _micro(batch, k)[0]
    for _ in range(k):
        (model(*first)[1] / k).backward()


def micro_batches_of_k(model, batch, k):
    x, y = batch
    for xi, yi in zip(x.split(k), y.split(k), strict=True):
        (model(xi, yi)[1] / (x.shape[0] // k)).backward()  # right gradient, wrong split


def whole_batch_at_once(model, batch, k):
    model(*batch)[1].backward()


def divided_twice(model, batch, k):
    for xi, yi in _micro(batch, k):
        (model(xi, yi)[1] / k / k).backward()


def off_by_a_little(model, batch, k):
    for i, (xi, yi) in enumerate(_micro(batch, k)):
        (model(xi, yi)[1] / k * (1.01 if i == 0 else 1.0)).backward()


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        (no_division, r"with k=2 .*k=2 times too large: backward\(\) adds into \.grad.*divide "
                      r"each micro-batch's loss by k"),
        (zero_grad_inside, r"only the last micro-batch's gradient is left in \.grad: zeroing "
                           r"the gradients inside the loop"),
        (zero_grad_inside_undivided, r"only the last micro-batch's.*not divided by k either"),
        (forward_only, r"the model ran but every parameter's \.grad is still None: no backward"),
        (autograd_grad, r"every parameter's \.grad is still None"),
        (steps_an_optimizer, r"the model's parameters changed: accumulate only fills \.grad"),
        (returns_inside_the_loop, r"the model ran 1 time on 4 sequences, not k=2: the loop "
                                  r"stopped early"),
        (same_slice_every_time, r"the gradients are those of the first micro-batch alone"),
        (micro_batches_of_k, r"with k=2 .*ran 4 times on 2 sequences each: that is B/k "
                             r"micro-batches of k sequences"),
        (whole_batch_at_once, r"ran 1 time on 8 sequences, the whole batch at once"),
        (divided_twice, r"k=2 times too small: the loss was divided by k twice"),
        (off_by_a_little, r"the gradient of .* differs from one backward over the whole batch "
                          r"by .* norm is 1\.0\d* times"),
    ],
    ids=lambda v: getattr(v, "__name__", "message"),
)
def test_accumulation_names_each_mistake(wrong, message):
    with pytest.raises(ex.ExerciseFailed, match=message):
        ex.verify("05.accumulation", wrong)


def test_accumulation_with_gradients_that_start_as_zeros_says_none_arrived(monkeypatch):
    monkeypatch.setattr(exbs, "ACCUM_RUNS", ((4, True),))  # .grad starts as zeros
    with pytest.raises(ex.ExerciseFailed, match=r"with k=4 .*every parameter's \.grad is still "
                                                r"zero"):  # fmt: skip
        ex.verify("05.accumulation", autograd_grad)


def test_accumulation_accepts_other_correct_spellings():
    def interleaved(model, batch, k):  # another partition into k equal micro-batches: fine
        x, y = batch
        for i in range(k):
            _, loss = model(x[i::k], targets=y[i::k])
            loss.div(k).backward()

    assert "largest relative difference" in ex.verify("05.accumulation", interleaved)


def test_accumulation_compares_with_one_backward_and_its_mistakes_are_distinct():
    case = exbs._accum_case()
    whole = exbs._flat(case.whole)
    for k in exbs.ACCUM_KS:
        wrongs = [w for w, _ in exbs._accum_mistakes(case, k)]
        assert all(exbs._rel(w, whole) > 0.1 for w in wrongs)  # none is the right answer
        for i, a in enumerate(wrongs):
            assert all(exbs._rel(a, b) > 0.01 for b in wrongs[i + 1:])  # each names one mistake
        # the micro-batch gradients really average to the whole batch's
        assert exbs._rel(sum(exbs._flat(m) for m in case.micro[k]) / k, whole) < 1e-6


# --------------------------------------------------------------------------- 05.max_batch


def _fits(trial, recover, b):
    try:
        trial(b)
        return True
    except torch.OutOfMemoryError:
        recover()
        return False


def returns_the_first_failure(trial, recover, start, max_batch):
    lo = hi = min(start, max_batch)
    while hi <= max_batch and _fits(trial, recover, hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fits(trial, recover, mid) else (lo, mid)
    return hi  # the first batch that failed


def doubling_only(trial, recover, start, max_batch):
    b = min(start, max_batch)
    while not _fits(trial, recover, b):
        b //= 2
    while b < max_batch and _fits(trial, recover, min(2 * b, max_batch)):
        b = min(2 * b, max_batch)
    return b


def no_cap(trial, recover, start, max_batch):
    return exbs.reference_largest_batch(trial, recover, start, 10**9)


def tries_past_the_cap(trial, recover, start, max_batch):
    return min(exbs.reference_largest_batch(trial, recover, start, 2 * max_batch), max_batch)


def no_try(trial, recover, start, max_batch):
    b = start
    while b < max_batch:
        trial(2 * b)
        b *= 2
    return b


def catches_runtime_error(trial, recover, start, max_batch):
    def fits(b):
        try:
            trial(b)
            return True
        except RuntimeError:  # torch.OutOfMemoryError is one, and so is every other bug
            recover()
            return False

    return _search(fits, start, max_batch)


def catches_everything(trial, recover, start, max_batch):
    def fits(b):
        try:
            trial(b)
            return True
        except Exception:
            recover()
            return False

    return _search(fits, start, max_batch)


def never_recovers(trial, recover, start, max_batch):
    return exbs.reference_largest_batch(trial, lambda: None, start, max_batch)


def linear(trial, recover, start, max_batch):
    b = 1
    while b < max_batch and _fits(trial, recover, b + 1):
        b += 1
    if not _fits(trial, recover, 1):
        raise ValueError("nothing fits")
    return b


def returns_zero_when_nothing_fits(trial, recover, start, max_batch):
    try:
        return exbs.reference_largest_batch(trial, recover, start, max_batch)
    except ValueError:
        return 0


def halves_to_zero(trial, recover, start, max_batch):
    b = min(start, max_batch)
    while not _fits(trial, recover, b):
        b //= 2
    return _search(lambda c: _fits(trial, recover, c), b, max_batch)


def true_division(trial, recover, start, max_batch):
    lo, hi = 1, max_batch + 1
    while hi - lo > 1:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _fits(trial, recover, mid) else (lo, mid)
    return lo


def _search(fits, start, max_batch):
    """The reference's search around a learner's ``fits`` (which is where the mistake is)."""
    def trial(b):
        if not fits(b):
            raise torch.OutOfMemoryError("no")

    return finder.search_max_batch(trial, start=start, max_batch=max_batch).found


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        (returns_the_first_failure, r"an answer between two doublings .*you returned 38, but "
                                    r"trial\(38\) failed. Return the largest batch that fitted"),
        (doubling_only, r"you returned 32, but the largest batch that fits is 37: you stopped at "
                        r"the first failure \(64\) without bisecting"),
        (no_cap, r"everything up to the cap fits .*you returned 1000000, above max_batch=100"),
        (tries_past_the_cap, r"you tried trial\(128\), above max_batch=100"),
        (no_try, r"trial\(64\) raised torch.OutOfMemoryError and your function let it escape"),
        (catches_runtime_error, r"every trial raises RuntimeError.*took the error for 'does not "
                                r"fit' \(4 trials\).*catch only torch.OutOfMemoryError; other "
                                r"errors are bugs"),
        (catches_everything, r"catch only torch.OutOfMemoryError"),
        (never_recovers, r"after trial\(64\) failed, you called trial\(48\) without calling "
                         r"recover\(\) first"),
        (linear, r"the answer is right, but your search ran 38 trials.*at most about "
                 r"2·log2\(max_batch\) \+ 2 = 22 here"),
        (returns_zero_when_nothing_fits, r"nothing fits, not even 1 .*you returned 0.*raise "
                                         r"ValueError instead"),
        (halves_to_zero, r"nothing fits.*your function called trial\(0\): batch sizes start at "
                         r"1, so stop halving at 1"),
        (true_division, r"called trial\(501\.0\): a batch size is a whole number"),
    ],
    ids=lambda v: getattr(v, "__name__", "message"),
)
def test_max_batch_names_each_mistake(wrong, message):
    with pytest.raises(ex.ExerciseFailed, match=message):
        ex.verify("05.max_batch", wrong)


def test_max_batch_finds_a_recover_missing_only_at_the_end():
    def recovers_late(trial, recover, start, max_batch):
        pending = []

        def fits(b):
            try:
                trial(b)
                return True
            except torch.OutOfMemoryError:
                pending.append(b)
                return False

        b = min(start, max_batch)
        lo = b if fits(b) else None
        if lo is None:
            recover()  # only this one
            return exbs.reference_largest_batch(trial, recover, max(b // 2, 1), max_batch)
        while lo < max_batch and fits(min(2 * lo, max_batch)):
            lo = min(2 * lo, max_batch)
        return lo

    with pytest.raises(ex.ExerciseFailed, match=r"after trial\(64\) failed, recover\(\) was never "
                                                r"called"):  # fmt: skip
        ex.verify("05.max_batch", recovers_late)


def test_max_batch_says_when_memory_is_not_back_to_its_baseline(monkeypatch):
    monkeypatch.setattr(trials.BudgetedCPU, "held_bytes", property(lambda self: 4096))
    with pytest.raises(ex.ExerciseFailed, match=r"real training steps .*4,096 bytes .* still "
                                                r"alive: memory is not back to its baseline"):  # fmt: skip
        ex.verify("05.max_batch", exbs.reference_largest_batch)


def test_max_batch_real_case_is_a_budget_between_two_measured_peaks():
    case = exbs._real_case()
    low, high = case.peaks
    assert low < case.budget_bytes < high  # measured, deterministic on a CPU
    assert case.answer == exbs.REAL_BETWEEN[0]
    device = exbs._budgeted(case.model, case.budget_bytes)
    with pytest.raises(torch.OutOfMemoryError):
        device(exbs.REAL_BETWEEN[1])
    device.recover()
    assert device(exbs.REAL_BETWEEN[0]) <= case.budget_bytes and device.held_bytes == 0


@pytest.mark.parametrize("max_batch", [1, 2, 7, 64, 100, 1000, 1024])
@pytest.mark.parametrize("start", [1, 3, 64, 5000])
def test_the_trial_bound_holds_for_the_reference_search(start, max_batch):
    # every answer 1..max_batch (sampled) from every start: doubling and bisection stay within
    for fits_up_to in sorted({1, 2, 3, max_batch - 1, max_batch, *range(1, max_batch, 37)}):
        if fits_up_to < 1:
            continue
        rec = exbs._Recorded(exbs._synthetic(fits_up_to))
        assert exbs.reference_largest_batch(rec.trial, rec.recover, start, max_batch) == min(
            fits_up_to, max_batch)  # fmt: skip
        assert len(rec.calls) <= exbs.trial_bound(max_batch)
        assert not rec.unrecovered and rec.pending is None


def test_the_synthetic_cases_tell_the_usual_searches_apart():
    # linear search is caught by the count on at least one case, and only there
    counts = []
    for _, fits_up_to, start, max_batch in exbs.SEARCH_CASES:
        rec = exbs._Recorded(exbs._synthetic(fits_up_to))
        linear(rec.trial, rec.recover, start, max_batch)
        counts.append(len(rec.calls) > exbs.trial_bound(max_batch))
    assert any(counts)
    assert exbs.trial_bound(1000) == 22


# --------------------------------------------------------------------------- 05.noise_scale


def _estimates(small, big, bs, bb):
    g2 = [(bb * gb - bs * gs) / (bb - bs) for gs, gb in zip(small, big, strict=True)]
    tr = [(gs - gb) / (1 / bs - 1 / bb) for gs, gb in zip(small, big, strict=True)]
    return g2, tr


def mean_of_ratios(small, big, bs, bb):
    g2, tr = _estimates(small, big, bs, bb)
    return sum(t / g for t, g in zip(tr, g2, strict=True)) / len(g2)


def swapped(small, big, bs, bb):
    g2, tr = _estimates(big, small, bs, bb)  # the lists the other way round
    return sum(tr) / sum(g2)


def big_norm_as_signal(small, big, bs, bb):
    _, tr = _estimates(small, big, bs, bb)
    return sum(tr) / sum(big)


def no_trace_denominator(small, big, bs, bb):
    g2, _ = _estimates(small, big, bs, bb)
    return sum(gs - gb for gs, gb in zip(small, big, strict=True)) / sum(g2)


def no_signal_denominator(small, big, bs, bb):
    _, tr = _estimates(small, big, bs, bb)
    return sum(tr) / sum(bb * gb - bs * gs for gs, gb in zip(small, big, strict=True))


def upside_down(small, big, bs, bb):
    g2, tr = _estimates(small, big, bs, bb)
    return sum(g2) / sum(tr)


def first_pair_only(small, big, bs, bb):
    g2, tr = _estimates(small, big, bs, bb)
    return tr[0] / g2[0]


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        (mean_of_ratios, r"four measurements .*expected B_simple = 51\.66\d* .*got 64\.51\d*: you "
                         r"averaged the ratio of each pair"),
        (swapped, r"b_small and b_big are swapped"),
        (big_norm_as_signal, r"you used \|G_big\|² as \|G\|²"),
        (no_trace_denominator, r"tr\(Σ\) is missing its denominator"),
        (no_signal_denominator, r"\|G\|² is missing its denominator"),
        (upside_down, r"upside down: B_simple = tr\(Σ\)/\|G\|²"),
        (first_pair_only, r"you used only the first measurement"),
        (lambda *a: noise.estimate_noise_scale(*a), r"returned a NoiseScale .* return the float"),
        (lambda *a: torch.tensor(exbs.reference_noise_scale(*a)), r"returned Tensor .* return a "
                                                                   r"Python float"),
        (lambda *a: 2 * exbs.reference_noise_scale(*a), r"expected B_simple = .*: estimate \|G\|² "
                                                         r"and tr\(Σ\) for each pair"),
    ],
    ids=lambda v: getattr(v, "__name__", "message"),
)
def test_noise_scale_names_each_mistake(wrong, message):
    with pytest.raises(ex.ExerciseFailed, match=message):
        ex.verify("05.noise_scale", wrong)


def test_noise_scale_cases_separate_every_mistake_and_are_resolved():
    cases = [*exbs.NOISE_KNOWN, exbs._real_noise_case()]
    for _, bs, bb, small, big in cases:
        estimate = noise.estimate_noise_scale(small, big, bs, bb)
        assert estimate.g2 > 0 and math.isfinite(estimate.b_simple)  # the signal is resolved
        values = [estimate.b_simple, *exbs.noise_mistakes(small, big, bs, bb).values()]
        for i, a in enumerate(values):  # each mistake is told apart from the others
            assert all(not math.isclose(a, b, rel_tol=1e-3) for b in values[i + 1:])
    # the known case: the mean of ratios differs clearly from the ratio of means
    _, bs, bb, small, big = exbs.NOISE_KNOWN[0]
    assert abs(mean_of_ratios(small, big, bs, bb) / exbs.reference_noise_scale(
        small, big, bs, bb) - 1) > 0.05  # fmt: skip
