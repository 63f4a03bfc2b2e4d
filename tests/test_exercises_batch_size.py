"""Notebook 05's exercise checks: they pass on the solutions, say "not done" on the stubs, and
name each usual mistake."""

from __future__ import annotations

import math

import pytest
import torch
from exercise_cells import assert_check_passes, assert_stub_is_not_done

from labkit import verdict
from labkit.batching import finder, noise, trials
from labkit.course import exercises as ex
from labkit.course.exercises import batch_size as exbs
from labkit.course.exercises.batch_size import accumulation as bs_accumulation
from labkit.course.exercises.batch_size import max_batch as bs_max_batch
from labkit.course.exercises.batch_size import noise_scale as bs_noise_scale

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
    "05.batch_plan": """
import math
from labkit.batching import sweep

def plan_batch(target: int, ranks: int, fits: int, tokens_per_s: dict[int, float],
               b_noise: float) -> tuple[int, int, bool | None]:
    \"\"\"(micro-batch per rank, accumulation steps, whether a global batch of target is worth
    it), decided from the measurements.\"\"\"
    # BEGIN SOLUTION
    share = target // ranks  # one rank's sequences per optimiser step
    usable = [b for b in tokens_per_s if b <= fits and share % b == 0]  # fits, makes the target
    best = max(tokens_per_s[b] for b in usable)
    # the same gradient whatever the split: within the sweep's noise of the fastest is as fast,
    # and of those the fewest passes (each pays the per-pass costs of section 1)
    micro = max(b for b in usable if tokens_per_s[b] >= sweep.SATURATION * best)
    resolved = math.isfinite(b_noise) and b_noise > 0
    worth = target <= b_noise if resolved else None  # 1 + B/B_noise at most 2 (eq. 2.11)
    return micro, share // micro, worth
    # END SOLUTION
answer = plan_batch
""",
}


def test_the_notebook_05_exercises_are_registered():
    assert [e.id for e in ex.catalogue("05")] == [
        "05.accumulation", "05.batch_plan", "05.max_batch", "05.noise_scale"]  # fmt: skip
    assert all(e.reference is not None for e in ex.catalogue("05"))


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_check_passes_on_the_solution_and_on_the_reference(exercise_id, capsys):
    assert_check_passes(exercise_id, SOLUTIONS[exercise_id], capsys)


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_the_stub_is_not_done_and_gives_nothing_away(exercise_id, capsys):
    assert_stub_is_not_done(exercise_id, SOLUTIONS[exercise_id], capsys,
                            secrets=("loss / k", "x.split", "fits(", "// 2", "b_big * big",
                                     "share % b", "SATURATION *", "target <= b_noise"))


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
    monkeypatch.setattr(bs_accumulation, "ACCUM_RUNS", ((4, True),))  # .grad starts as zeros
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
    case = bs_accumulation._accum_case()
    whole = bs_accumulation._flat(case.whole)
    for k in exbs.ACCUM_KS:
        wrongs = [w for w, _ in bs_accumulation._accum_mistakes(case, k)]
        assert all(bs_accumulation._rel(w, whole) > 0.1 for w in wrongs)  # none is the right answer
        for i, a in enumerate(wrongs):
            assert all(bs_accumulation._rel(a, b) > 0.01 for b in wrongs[i + 1:])  # each names one mistake
        # the micro-batch gradients really average to the whole batch's
        assert bs_accumulation._rel(sum(bs_accumulation._flat(m) for m in case.micro[k]) / k, whole) < 1e-6


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
    case = bs_max_batch._real_case()
    low, high = case.peaks
    assert low < case.budget_bytes < high  # measured, deterministic on a CPU
    assert case.answer == exbs.REAL_BETWEEN[0]
    device = bs_max_batch._budgeted(case.model, case.budget_bytes)
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
        rec = bs_max_batch._Recorded(bs_max_batch._synthetic(fits_up_to))
        assert exbs.reference_largest_batch(rec.trial, rec.recover, start, max_batch) == min(
            fits_up_to, max_batch)  # fmt: skip
        assert len(rec.calls) <= exbs.trial_bound(max_batch)
        assert not rec.unrecovered and rec.pending is None


def test_the_synthetic_cases_tell_the_usual_searches_apart():
    # linear search is caught by the count on at least one case, and only there
    counts = []
    for _, fits_up_to, start, max_batch in exbs.SEARCH_CASES:
        rec = bs_max_batch._Recorded(bs_max_batch._synthetic(fits_up_to))
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
    cases = [*exbs.NOISE_KNOWN, bs_noise_scale._real_noise_case()]
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


# --------------------------------------------------------------------------- 05.batch_plan
# Learner-style plans, each with one usual mistake. Each returns (micro, k, worth_it).


def _share(target, ranks):
    return target // ranks


def _usable(target, ranks, fits, tps):
    return [b for b in tps if b <= fits and _share(target, ranks) % b == 0]


def _worth(target, b_noise):
    return target <= b_noise if math.isfinite(b_noise) and b_noise > 0 else None


def _right_split(target, ranks, fits, tps):
    usable = _usable(target, ranks, fits, tps)
    best = max(tps[b] for b in usable)
    micro = max(b for b in usable if tps[b] >= 0.9 * best)
    return micro, _share(target, ranks) // micro


def ignores_memory(target, ranks, fits, tps, b_noise):
    usable = [b for b in tps if _share(target, ranks) % b == 0]  # fits left out
    best = max(tps[b] for b in usable)
    micro = max(b for b in usable if tps[b] >= 0.9 * best)
    return micro, _share(target, ranks) // micro, _worth(target, b_noise)


def target_per_rank(target, ranks, fits, tps, b_noise):
    return (*_right_split(target, 1, fits, tps), _worth(target, b_noise))  # ranks forgotten


def largest_that_fits(target, ranks, fits, tps, b_noise):
    micro = max(_usable(target, ranks, fits, tps))  # memory decides, not the sweep
    return micro, _share(target, ranks) // micro, _worth(target, b_noise)


def fastest_median(target, ranks, fits, tps, b_noise):
    micro = max(_usable(target, ranks, fits, tps), key=tps.get)  # the noise ignored
    return micro, _share(target, ranks) // micro, _worth(target, b_noise)


def smallest_as_fast(target, ranks, fits, tps, b_noise):  # the saturation point of the sweep
    usable = _usable(target, ranks, fits, tps)
    best = max(tps[b] for b in usable)
    micro = min(b for b in usable if tps[b] >= 0.9 * best)
    return micro, _share(target, ranks) // micro, _worth(target, b_noise)


def least_memory(target, ranks, fits, tps, b_noise):  # "accumulation is free": micro-batch 1
    micro = min(_usable(target, ranks, fits, tps))
    return micro, _share(target, ranks) // micro, _worth(target, b_noise)


def ignores_divisibility(target, ranks, fits, tps, b_noise):
    usable = [b for b in tps if b <= fits]  # whether it divides the share left out
    best = max(tps[b] for b in usable)
    micro = max(b for b in usable if tps[b] >= 0.9 * best)
    return micro, math.ceil(_share(target, ranks) / micro), _worth(target, b_noise)


def unmeasured_divisor(target, ranks, fits, tps, b_noise):
    share = _share(target, ranks)
    micro = max(d for d in range(1, fits + 1) if share % d == 0)
    return micro, share // micro, _worth(target, b_noise)


def worth_per_rank(target, ranks, fits, tps, b_noise):
    return (*_right_split(target, ranks, fits, tps), _worth(_share(target, ranks), b_noise))


def worth_micro(target, ranks, fits, tps, b_noise):
    micro, k = _right_split(target, ranks, fits, tps)
    return micro, k, _worth(micro, b_noise)


def worth_upside_down(target, ranks, fits, tps, b_noise):
    worth = _worth(target, b_noise)
    return (*_right_split(target, ranks, fits, tps), None if worth is None else not worth)


def worth_when_unresolved(target, ranks, fits, tps, b_noise):
    return (*_right_split(target, ranks, fits, tps), target <= b_noise)


def worth_never_decided(target, ranks, fits, tps, b_noise):
    return (*_right_split(target, ranks, fits, tps), None)


def written_for_this_machine(target, ranks, fits, tps, b_noise):
    return 64, 2, False  # the lab's plan, written down


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        (ignores_memory, r"a GPU whose .*you planned 128 × 4.*: a micro-batch of 128 does not "
                         r"fit: the finder fitted at most 96"),
        (target_per_rank, r"two ranks.*you planned 24 × 4.*on 2 ranks that makes 192 sequences "
                          r"per optimiser step, 2 times the target"),
        (largest_that_fits, r"flat from 16 .*you planned 128 × 1.*measured micro-batch 128 at "
                            r"50,000 tokens/s, 15% below 16's .*not the fastest here"),
        (fastest_median, r"flat from 16 .*you planned 16 × 8.*micro-batch 64 also fits.*cannot "
                         r"tell it from 16.*same gradient.*fewest passes"),
        (smallest_as_fast, r"you planned 16 × 8.*cannot tell it from 16"),
        (least_memory, r"a GPU whose .*you planned 8 × 64.*69% below 64's: more accumulation "
                       r"than needed. Accumulating does not change the gradient"),
        (ignores_divisibility, r"a fast size that does not divide.*share of 48 sequences is not "
                               r"a whole number of micro-batches of 32"),
        (unmeasured_divisor, r"you planned 128 × 1.*not the fastest here"),
        (lambda *a: (24, 2, None) if a[0] == 48 else exbs.reference_plan_batch(*a),
         r"a fast size that does not divide.*micro-batch 24 was never measured \(the sweep "
         r"measured \[4, 8, 16, 32\]\)"),
        (worth_per_rank, r"two ranks.*you held each rank's share \(48 sequences\) against the "
                         r"noise scale \(70\).*the global batch of 96"),
        (worth_micro, r"two ranks.*you held the micro-batch \(24\) against the noise scale"),
        (worth_upside_down, r"a GPU whose .*needs 1 \+ B/B_noise = 1\.26 times the least tokens"
                            r".*at most twice"),
        (worth_when_unresolved, r"not resolved \(nan\).*say None, not False"),
        (worth_never_decided, r"the noise scale is resolved here \(2e\+03 sequences\).*say True "
                              r"or False"),
        (written_for_this_machine, r"a GPU whose .*64 × 2 × 1 rank = 128 sequences per optimiser "
                                   r"step, not the target 512"),
        (lambda *a: exbs.reference_plan_batch(*a)[:2], r"return three things.*leave out worth_it"),
        (lambda *a: (*exbs.reference_plan_batch(*a)[:2], 1), r"worth_it=1 \(int\); return True, "
                                                              r"False, or None"),
        (lambda *a: (8.0, 64, True), r"returned float 8\.0; return an int"),
    ],
    ids=lambda v: getattr(v, "__name__", "message"),
)
def test_batch_plan_names_each_mistake(wrong, message):
    exbs.forget_here()
    with pytest.raises(ex.ExerciseFailed, match=message):
        ex.verify("05.batch_plan", wrong)


def test_batch_plan_cases_tell_every_mistake_apart():
    # Each mistake is wrong on some case, and no two give the same plans on every case.
    mistakes = [ignores_memory, target_per_rank, largest_that_fits, fastest_median,
                smallest_as_fast, least_memory, ignores_divisibility, unmeasured_divisor,
                worth_per_rank, worth_micro, worth_upside_down, worth_when_unresolved,
                worth_never_decided]  # fmt: skip
    right = [exbs.reference_plan_batch(*c.args()) for c in exbs.PLAN_CASES]
    seen = {tuple(right)}
    for wrong in mistakes:
        plans = tuple(wrong(*c.args()) for c in exbs.PLAN_CASES)
        assert plans != tuple(right), wrong.__name__
        seen.add(plans)
    assert len(seen) == len(mistakes) + 1
    # the reference is the notebook's solution, on every case
    solution = exbs.reference_plan_batch
    assert all(_right_split(*c.args()[:4]) == solution(*c.args())[:2] for c in exbs.PLAN_CASES)


def test_batch_plan_refuses_a_target_no_measured_split_makes():
    with pytest.raises(ValueError, match="not a multiple of ranks=2"):
        exbs.reference_plan_batch(33, 2, 8, {1: 1.0}, 4.0)
    with pytest.raises(ValueError, match="no measured micro-batch in \\[16\\] fits 8"):
        exbs.reference_plan_batch(32, 1, 8, {16: 1.0}, 4.0)


def _here(budget_bytes, *, rounds=5):
    from labkit.config import TrainConfig
    from labkit.model import GPT

    torch.manual_seed(0)
    model = GPT(exbs.REAL_CFG)
    # made-up speeds, flat from 2 on: the plan is 4 × 2, and 2 × 4 is the split it runs against
    return exbs.measured_here(target=8, ranks=1, fits=4, tokens_per_s={1: 1e3, 2: 2e3, 4: 2.1e3},
                              b_noise=3.0, template=model, budget_bytes=budget_bytes,
                              device="cpu", dtype="float32", train_cfg=TrainConfig(),
                              rounds=rounds)  # fmt: skip


def test_batch_plan_decides_on_the_notebook_measurements_and_runs_the_plan(capsys):
    here = _here(2**30)
    try:
        # right on every other machine, wrong on this notebook's: the check holds it against them
        with pytest.raises(ex.ExerciseFailed, match=r"this notebook's measurements .*you planned "
                                                    r"2 × 4.*micro-batch 4 also fits"):
            ex.verify("05.batch_plan", lambda *a: (2, 4, False) if a[0] == 8
                      else exbs.reference_plan_batch(*a))  # fmt: skip
        assert not here.runs  # a wrong plan is not run
        said = ex.verify("05.batch_plan", exbs.reference_plan_batch)
        assert "and on this notebook's: 4 × 2 for a global batch of 8, not worth it" in said
        assert "Run for real: it fits a CPU memory budget of 1,024.00 MiB" in said
        assert "its step time against 2 × 4: " in said
        run = here.runs[(4, 2, False)]
        assert run.fits and run.alternative == (2, 4) and run.peak_bytes > 0
        assert [len(v) for v in run.seconds.values()] == [5, 5]
        assert run.outcome() in ("as the sweep said", "gap not repeated", "against the sweep",
                                 "gap the sweep did not see", "noisy")  # fmt: skip
        # the notebook's cell prints the check's run: nothing runs twice
        assert here.run((4, 2, False)) is run
        text = str(run)
        assert "worth it: no (modelled, eq. 2.11" in text and "3.67× the least tokens" in text
        assert "measured: one step of 4 × 2 under a CPU memory budget" in text
        assert "verdict: " in text
    finally:
        exbs.forget_here()
    assert capsys.readouterr().out == ""


def test_a_plan_over_the_budget_is_reported_as_measured_not_failed():
    # A budget between the peaks of one pass of 4 and of the accumulated 4 × 2: the finder's
    # batch for one pass, accumulated, holds the gradients too (the right plan still passes).
    from labkit.config import TrainConfig

    here = _here(2**30)
    try:
        one = trials.measure_step_peak(here.template, 4, seq_len=exbs.REAL_CFG.seq_len,
                                       train_cfg=TrainConfig())  # fmt: skip
        two = trials.measure_step_peak(here.template, 4, grad_accum=2,
                                       seq_len=exbs.REAL_CFG.seq_len, train_cfg=TrainConfig())  # fmt: skip
        assert two > one
        here.budget_bytes = (one + two) // 2
        said = ex.verify("05.batch_plan", exbs.reference_plan_batch)
        assert "Run for real: it does NOT fit a CPU memory budget" in said
        run = here.runs[(4, 2, False)]
        assert not run.fits and run.outcome() == "over"
        assert "an accumulated step also holds the gradients" in str(run)
    finally:
        exbs.forget_here()


def test_the_plan_run_reads_its_verdict_against_the_sweep():
    inputs = exbs.PlanInputs(8, 1, 4, {1: 1e3, 2: 1.5e3, 4: 2.1e3}, 3.0)
    fast, slow = [0.10] * 5, [0.20] * 5

    def run(plan_s, alt_s):
        c = verdict.compare_times(plan_s, alt_s, names=("4 × 2", "2 × 4"))
        return exbs.PlanRun(inputs, (4, 2, False), (2, 4), True, 1, "a budget",
                            {"4 × 2": plan_s, "2 × 4": alt_s}, c)  # fmt: skip

    # the sweep says 2 is more than 10% slower than 4
    assert run(fast, slow).outcome() == "as the sweep said"
    assert run(slow, fast).outcome() == "against the sweep"
    assert run(fast, fast).outcome() == "gap not repeated"
    assert run([0.1, 0.3, 0.1, 0.3, 0.2], [0.3, 0.1, 0.3, 0.1, 0.2]).outcome() == "noisy"
    assert "a right plan does not fail on noise" in run([0.1, 0.3, 0.1, 0.3, 0.2],
                                                        [0.3, 0.1, 0.3, 0.1, 0.2]).time_sentence()


def test_a_gap_the_sweep_did_not_measure_is_not_called_as_the_sweep_said():
    """The sweep measured 4 and 2 within 10% of each other; a run that finds the plan clearly
    faster contradicts that, and the sentence must say so (it said 'as the sweep said')."""
    inputs = exbs.PlanInputs(8, 1, 4, {1: 1e3, 2: 2.0e3, 4: 2.1e3}, 3.0)  # 2 within 10% of 4
    c = verdict.compare_times([0.10] * 5, [0.20] * 5, names=("4 × 2", "2 × 4"))
    run = exbs.PlanRun(inputs, (4, 2, False), (2, 4), True, 1, "a budget",
                       {"4 × 2": [0.10] * 5, "2 × 4": [0.20] * 5}, c)  # fmt: skip
    assert run.outcome() == "gap the sweep did not see"
    assert run.time_sentence().startswith(
        "the plan ran faster than the sweep said (the sweep measured the two within 10%; now 4 × 2 is faster)")
