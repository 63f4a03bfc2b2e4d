"""Notebook 04's exercise checks: they pass on the solutions, say "not done" on the stubs, and
name each usual mistake."""

from __future__ import annotations

import math

import pytest
import torch
from exercise_cells import assert_check_passes, assert_stub_is_not_done

from labkit import recipes
from labkit.course import exercises as ex
from labkit.course.exercises import mixed_precision as exmp
from labkit.course.exercises.mixed_precision import choose_recipe as choose
from labkit.formulas import OPTIMIZER_STATES, dtype_bytes

# --------------------------------------------------------------------------- solutions, written
# the way the solution notebook marks them, so the same source yields the stub.

SOLUTIONS = {
    "04.loss_scaling": """
import torch

def scaled_step(loss, optimizer, state):
    # BEGIN SOLUTION
    (loss * state["scale"]).backward()
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if not all(torch.isfinite(g).all() for g in grads):
        state["scale"] *= state["backoff_factor"]
        state["growth_tracker"] = 0
        return False
    for g in grads:
        g.div_(state["scale"])
    optimizer.step()
    state["growth_tracker"] += 1
    if state["growth_tracker"] == state["growth_interval"]:
        state["scale"] *= state["growth_factor"]
        state["growth_tracker"] = 0
    return True
    # END SOLUTION
answer = scaled_step
""",
    "04.underflow": """
import torch

def fp16_underflow_fraction(t):
    # BEGIN SOLUTION
    v = t[torch.isfinite(t) & (t != 0)]
    return float((v.to(torch.float16) == 0).sum()) / v.numel()
    # END SOLUTION
answer = fp16_underflow_fraction
""",
    "04.bytes_per_param": """
import torch

def bytes_per_param(recipe):
    # BEGIN SOLUTION
    def size(name):
        return getattr(torch, name).itemsize if name else 0
    n_states = {"adamw": 2, "sgd_momentum": 1, "sgd": 0}[recipe.optimizer]
    return (size(recipe.param_dtype) + size(recipe.grad_dtype) + size(recipe.master_dtype)
            + size(recipe.grad_buffer_dtype) + n_states * size(recipe.state_dtype))
    # END SOLUTION
answer = bytes_per_param
""",
    "04.choose_recipe": """
from labkit import recipes

bytes_per_param = recipes.predicted_bytes_per_param  # exercise 3's, in the notebook


def choose_recipe(situation):
    # BEGIN SOLUTION
    def need(name):
        recipe = situation.candidates[name]
        return (bytes_per_param(recipe) * situation.n_params
                + situation.activation_bytes[name])

    def runs_here(recipe):
        dtype = recipe.compute_dtype
        supported = dtype == "float32" or dtype in situation.autocast_dtypes
        return supported and (dtype != "float16" or recipe.loss_scaler)

    fits = [name for name, recipe in situation.candidates.items()
            if runs_here(recipe) and need(name) <= situation.budget_bytes]
    fp32_weights = [name for name in fits if situation.candidates[name].steps_fp32_weights]
    pool = fp32_weights or fits  # 16-bit weights only when nothing else fits
    if not pool:
        return None
    return min(pool, key=lambda name: (situation.step_s[situation.candidates[name].compute_dtype],
                                       need(name)))
    # END SOLUTION
answer = choose_recipe
""",
}


def test_the_notebook_04_exercises_are_registered():
    assert [e.id for e in ex.catalogue("04")] == [
        "04.bytes_per_param", "04.choose_recipe", "04.loss_scaling", "04.underflow"]  # fmt: skip
    assert all(e.reference is not None for e in ex.catalogue("04"))


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_check_passes_on_the_solution_and_on_the_reference(exercise_id, capsys):
    assert_check_passes(exercise_id, SOLUTIONS[exercise_id], capsys)


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_the_stub_is_not_done_and_gives_nothing_away(exercise_id, capsys):
    assert_stub_is_not_done(exercise_id, SOLUTIONS[exercise_id], capsys,
                            secrets=("growth_tracker", "float16"))


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_hints_go_from_the_idea_to_the_recipe(exercise_id):
    hints = ex.get(exercise_id).hints
    assert len(hints) >= 3 and hints[-1].startswith("recipe:")
    first = hints[0]
    # the first hint is conceptual: no code, no numbers that are the answer
    assert "(" not in first.replace("(the chain rule is linear)", "") and "==" not in first
    assert not any(s in first for s in ("16 bytes", "2**-25", "isfinite", ".to("))
    # the last hint guides in words: steps, never code (issue 30 item 5)
    assert not any(t in hints[-1] for t in ("=", "()", "[", ".to(", "lambda")), hints[-1]


# --------------------------------------------------------------------------- 04.loss_scaling
# Learner-style answers, each with one usual mistake.


def _grads(optimizer):
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def _finite(optimizer):
    return all(torch.isfinite(g).all() for g in _grads(optimizer))


def _grow(state):
    state["growth_tracker"] += 1
    if state["growth_tracker"] == state["growth_interval"]:
        state["scale"] *= state["growth_factor"]
        state["growth_tracker"] = 0


def _back_off(state):
    state["scale"] *= state["backoff_factor"]
    state["growth_tracker"] = 0


def no_unscaling(loss, optimizer, state):
    (loss * state["scale"]).backward()
    if not _finite(optimizer):
        _back_off(state)
        return False
    optimizer.step()
    _grow(state)
    return True


def unscale_by_multiplying(loss, optimizer, state):
    (loss * state["scale"]).backward()
    if not _finite(optimizer):
        _back_off(state)
        return False
    for g in _grads(optimizer):
        g.mul_(state["scale"])
    optimizer.step()
    _grow(state)
    return True


def never_skips(loss, optimizer, state):
    (loss * state["scale"]).backward()
    for g in _grads(optimizer):
        g.div_(state["scale"])
    optimizer.step()
    _grow(state)
    return True


def steps_then_backs_off(loss, optimizer, state):
    (loss * state["scale"]).backward()
    finite = _finite(optimizer)
    for g in _grads(optimizer):
        g.div_(state["scale"])
    optimizer.step()
    if not finite:
        _back_off(state)
        return False
    _grow(state)
    return True


def keeps_tracker_on_backoff(loss, optimizer, state):
    (loss * state["scale"]).backward()
    if not _finite(optimizer):
        state["scale"] *= state["backoff_factor"]
        return False
    for g in _grads(optimizer):
        g.div_(state["scale"])
    optimizer.step()
    _grow(state)
    return True


def grows_every_step(loss, optimizer, state):
    (loss * state["scale"]).backward()
    if not _finite(optimizer):
        _back_off(state)
        return False
    for g in _grads(optimizer):
        g.div_(state["scale"])
    optimizer.step()
    state["scale"] *= state["growth_factor"]
    state["growth_tracker"] += 1
    return True


def checks_only_the_loss(loss, optimizer, state):
    scaled = loss * state["scale"]
    if not torch.isfinite(scaled):
        _back_off(state)
        return False
    scaled.backward()
    for g in _grads(optimizer):
        g.div_(state["scale"])
    optimizer.step()
    _grow(state)
    return True


def forgets_to_scale_the_loss(loss, optimizer, state):
    loss.backward()
    if not _finite(optimizer):
        _back_off(state)
        return False
    for g in _grads(optimizer):
        g.div_(state["scale"])
    optimizer.step()
    _grow(state)
    return True


def returns_nothing(loss, optimizer, state):
    exmp.reference_scaled_step(loss, optimizer, state)


def replaces_the_state(loss, optimizer, state):
    state = dict(state)  # a copy: the caller's dict never changes
    return exmp.reference_scaled_step(loss, optimizer, state)


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        (
            no_unscaling,
            r"step 1 of 9.* exactly scale times too large: the gradients were never unscaled",
        ),
        (unscale_by_multiplying, r"step 1 .*scale² times too large: .*multiplied by the scale"),
        (
            forgets_to_scale_the_loss,
            r"step 1 .*1/scale of the right size: .*loss was not multiplied",
        ),
        (
            never_skips,
            r"step 2 of 9, a step whose loss was inf, the step was not skipped: "
            r"optimizer\.step\(\) ran with inf/NaN",
        ),
        (
            steps_then_backs_off,
            r"step 2 .*backed off the scale and returned False, but the "
            r"parameters changed",
        ),
        (
            keeps_tracker_on_backoff,
            r"step 2 .*growth_tracker'\] is 1; GradScaler's is 0: .*reset "
            r"the tracker to 0 when you back off",
        ),
        (
            grows_every_step,
            r"step 1 .*state\['scale'\] is 512; GradScaler's is 256: the scale grew "
            r"after a single clean step",
        ),
        (
            checks_only_the_loss,
            r"step 6 of 9, a step whose loss was finite but one gradient was "
            r"inf.*although you skipped the step whose loss was inf.*check "
            r"every gradient",
        ),
        (
            returns_nothing,
            r"step 1 .*returned NoneType None; return True when the optimizer "
            r"stepped",
        ),
        (
            replaces_the_state,
            r"step 1 .*state\['growth_tracker'\] is 0; GradScaler's is 1: "
            r"add 1 .*update state in place",
        ),
    ],
    ids=lambda v: getattr(v, "__name__", "message"),
)
def test_loss_scaling_names_each_mistake(wrong, message):
    with pytest.raises(ex.ExerciseFailed, match=message):
        ex.verify("04.loss_scaling", wrong)


def test_loss_scaling_accepts_other_correct_spellings():
    def mine(loss, optimizer, state):
        (loss * state["scale"]).backward()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if any(not torch.isfinite(p.grad).all() for p in params):
            state["scale"] = state["scale"] * state["backoff_factor"]
            state["growth_tracker"] = 0
            return False
        for p in params:
            p.grad = p.grad * (1.0 / state["scale"])  # a new tensor: fine too
        optimizer.step()
        state["growth_tracker"] = (state["growth_tracker"] + 1) % state["growth_interval"]
        if state["growth_tracker"] == 0:
            state["scale"] = state["scale"] * state["growth_factor"]
        return True

    assert "matches torch.amp.GradScaler" in ex.verify("04.loss_scaling", mine)


# --------------------------------------------------------------------------- 04.underflow


def _nonzero_finite(t):
    return t[torch.isfinite(t) & (t != 0)]


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        (
            lambda t: float((_nonzero_finite(t).abs() < 2**-14).float().mean()),
            r"smallest \*normal\* number \(2\*\*-14\)",
        ),
        (
            lambda t: float((_nonzero_finite(t).abs() < 2**-24).float().mean()),
            r"threshold at 2\*\*-24: values between 2\*\*-25 and 2\*\*-24 round \*up\*",
        ),
        (
            lambda t: float((_nonzero_finite(t).abs() <= 2**-24).float().mean()),
            r"exactly 2\*\*-24 is fp16's smallest subnormal: it survives",
        ),
        (
            lambda t: float((_nonzero_finite(t).abs() < 2**-25).float().mean()),
            r"exactly 2\*\*-25 is halfway .* ties round to even",
        ),
        (
            lambda t: float((t[torch.isfinite(t)].to(torch.float16) == 0).float().mean()),
            r"exact zeros, inf and NaN.*you counted the exact zeros as lost",
        ),
        (
            lambda t: float((_nonzero_finite(t).to(torch.float16) == 0).sum()) / t.numel(),
            r"you divided by every element",
        ),
        (
            lambda t: float((t[t != 0].to(torch.float16) == 0).float().mean()),
            r"including inf and NaN",
        ),
        (
            lambda t: 100 * float((_nonzero_finite(t).to(torch.float16) == 0).float().mean()),
            r"that is a percentage",
        ),
        (
            lambda t: (_nonzero_finite(t).to(torch.float16) == 0).float().mean(),
            r"returned Tensor .* return a Python float",
        ),
        (
            lambda t: float((_nonzero_finite(t).to(torch.bfloat16) == 0).float().mean()),
            r"you cast to bfloat16, which has fp32's 8 exponent bits",
        ),
    ],
)
def test_underflow_names_each_mistake(wrong, message):
    with pytest.raises(ex.ExerciseFailed, match=message) as info:
        ex.verify("04.underflow", wrong)
    assert "expected" in str(info.value) or "returned Tensor" in str(info.value)


def test_underflow_known_values_are_what_a_real_cast_gives():
    # the tie, just above it, the subnormals: checked here against torch, not assumed
    half = torch.tensor([2.0**-25, 2.0**-25 * (1 + 2.0**-8), 2.0**-24, 2.0**-15]).to(torch.float16)
    assert half.float().tolist() == [0.0, 2.0**-24, 2.0**-24, 2.0**-15]
    first = torch.tensor(exmp.UNDERFLOW_KNOWN[0][1])
    assert exmp.reference_fp16_underflow_fraction(first) == 3 / 12
    variants = list(exmp._underflow_variants(first).values())
    assert 3 / 12 not in variants[:4] and len(set(variants[:4])) == 4  # each mistake shows
    grads = exmp._real_gradients()
    fractions = [exmp.reference_fp16_underflow_fraction(g) for g in grads]
    assert fractions == sorted(fractions) and fractions[-1] > 0.01  # small gradients do vanish


# --------------------------------------------------------------------------- 04.bytes_per_param


def right(recipe):
    return recipes.predicted_bytes_per_param(recipe)


def part(recipe, name):
    return recipes.predicted_breakdown(recipe)[name]


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        (lambda r: right(r) - part(r, "master"), "the fp32 master copy is missing"),
        (
            lambda r: right(r) - (part(r, "optimizer_state") // 2 if r.optimizer == "adamw" else 0),
            "AdamW keeps two state tensors per parameter",
        ),
        (lambda r: 8 * right(r), "that is bits"),
        (
            lambda r: right(r) + recipes.autocast_copy_bytes_per_param(r),
            r"Recipe 'amp_bf16' .*expected 16 .*got 18: you counted autocast's 16-bit weight copies",
        ),
        (lambda r: right(r) - part(r, "gradients"), "the gradients .* are missing"),
        (lambda r: right(r) - part(r, "grad_buffer"), "the fp32 gradient buffer is missing"),
        (
            lambda r: (
                right(r)
                - part(r, "optimizer_state")
                + OPTIMIZER_STATES[r.optimizer] * dtype_bytes(r.param_dtype)
            ),
            r"state is in the dtype of what it steps",
        ),
        (
            lambda r: right(r) + (r.name == "sgd_momentum_bf16"),
            r"Recipe 'sgd_momentum_bf16' .*expected 6 .*measured 6\), got 7: list each",
        ),
    ],
)
def test_bytes_per_param_names_each_mistake(wrong, message):
    with pytest.raises(ex.ExerciseFailed, match=message):
        ex.verify("04.bytes_per_param", wrong)


def test_bytes_per_param_wants_a_whole_number():
    # 16.0 from dividing itemsizes is the right number (review N04-18); 16.5 is not a count
    assert "agrees with the prediction" in ex.verify("04.bytes_per_param",
                                                     lambda r: float(right(r)))  # fmt: skip
    with pytest.raises(ex.ExerciseFailed, match="returned float"):
        ex.verify("04.bytes_per_param", lambda r: right(r) + 0.5)


def test_bytes_per_param_names_adamw_states_for_every_optimizer():
    def adamw_always(r):
        return right(r) - OPTIMIZER_STATES[r.optimizer] * dtype_bytes(r.state_dtype) \
            + 2 * dtype_bytes(r.state_dtype)  # fmt: skip

    with pytest.raises(ex.ExerciseFailed, match="plain SGD keeps no state"):
        ex.verify("04.bytes_per_param", adamw_always)


def test_bytes_per_param_names_a_table_of_known_recipes():
    table = {name: right(r) for name, r in recipes.RECIPES.items()}
    with pytest.raises(ex.ExerciseFailed, match="a table of known recipes cannot answer it"):
        ex.verify("04.bytes_per_param", lambda r: table[r.name])


def test_bytes_per_param_cases_cover_every_recipe_and_the_stated_ones():
    cases = exmp._bytes_cases()
    assert set(recipes.RECIPES.values()) <= set(cases)
    assert {r.name: right(r) for r in exmp.STATED_RECIPES} == {
        "sgd_fp32": 8, "sgd_momentum_bf16": 6, "fp16_master_sgd_momentum": 12, "amp_fp16": 16}  # fmt: skip
    for r in cases:  # what the check compares with was measured, and agrees
        assert exmp._measured(r).bytes_per_param == right(r)
    assert math.isclose(exmp._measured(exmp.STATED_RECIPES[-1]).per_param()[
        "autocast copies per matmul weight"], 2.0)  # fmt: skip


# --------------------------------------------------------------------------- 04.choose_recipe
# Learner-style plans, each with one usual mistake; the check must name it.


def _need(s, name, master=1, activations=True):
    r = s.candidates[name]
    states = recipes.predicted_bytes_per_param(r) + (master - 1) * recipes.predicted_breakdown(r)["master"]
    return states * s.n_params + (s.activation_bytes[name] if activations else 0)


def _runs(s, r, scaler=True, support=True):
    d = r.compute_dtype
    ok = d == "float32" or d in s.autocast_dtypes or not support
    return ok and (not scaler or d != "float16" or r.loss_scaler)


def plan(s, *, scaler=True, master=1, activations=True, memory=True, safe_first=True,
         pure_last=True, key="fast", least_bad=False, support=True, missing_time=None):  # fmt: skip
    usable = [n for n, r in s.candidates.items() if _runs(s, r, scaler, support)]
    fits = [n for n in usable if not memory or _need(s, n, master, activations) <= s.budget_bytes]
    if least_bad and not fits:
        fits = usable
    safe = [n for n in fits if s.candidates[n].steps_fp32_weights]
    pool = safe if safe_first else fits
    if not pool and pure_last:
        pool = fits
    if not pool:
        return None

    def step(n):
        d = s.candidates[n].compute_dtype
        return s.step_s[d] if missing_time is None else s.step_s.get(d, missing_time)

    def order(n):
        return {"fast": (step(n), _need(s, n, master, activations)),
                "slow": (-step(n), _need(s, n, master, activations)),
                "small": (_need(s, n, master, activations), step(n))}[key]  # fmt: skip

    return min(pool, key=order)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"scaler": False}, r"V100-class.*expected 'amp_fp16', got 'amp_fp16_no_scaler': an fp16 "
                            r"recipe without a loss scaler was chosen"),
        ({"master": 0}, r"1B parameters, 20 GB left.*expected 'pure_bf16', got 'bf16_master': the "
                        r"fp32 master copy was left out"),
        ({"master": 2}, r"2B parameters, 39 GB.*got 'pure_bf16': the fp32 master copy was counted "
                        r"twice"),
        ({"activations": False}, r"got 'amp_bf16': the activations were left out"),
        ({"memory": False}, r"7B parameters, 80 GB.*expected 'pure_bf16', got 'bf16_master': that "
                            r"picks by speed alone"),
        ({"key": "small"}, r"slower than fp32's.*expected 'fp32_adamw', got 'bf16_master': that "
                           r"picks the recipe that needs the least memory"),
        ({"key": "slow"}, r"got 'amp_fp16': that picks the slowest"),
        ({"safe_first": False}, r"got 'pure_bf16': a pure 16-bit recipe was chosen while one that "
                                r"steps fp32 weights fits"),
        ({"pure_last": False}, r"7B parameters, 80 GB.*expected 'pure_bf16', got None: when only "
                               r"a pure 16-bit recipe fits, take it"),
        ({"least_bad": True}, r"70B parameters.*expected None, got 'bf16_master': when no recipe "
                              r"fits, return None instead of the least bad one"),
        ({"support": False}, r"V100-class.*KeyError.*This device does not run bfloat16"),
        ({"support": False, "missing_time": 0.0},
         r"V100-class.*got 'bf16_master'.*computes in bfloat16, and this device does not"),
    ],
)
def test_choose_recipe_names_each_mistake(options, message):
    with pytest.raises(ex.ExerciseFailed, match=message):
        ex.verify("04.choose_recipe", lambda s: plan(s, **options))


def test_choose_recipe_refuses_a_hard_coded_answer_and_a_wrong_type():
    for fixed in ("bf16_master", "fp32_adamw", None):
        with pytest.raises(ex.ExerciseFailed, match=r"expected .*, got "):
            ex.verify("04.choose_recipe", lambda s, fixed=fixed: fixed)
    with pytest.raises(ex.ExerciseFailed, match=r"return the name of one of situation\.candidates"):
        ex.verify("04.choose_recipe", lambda s: 3)
    # the Recipe itself is as good as its name
    assert "chooses as the plan does" in ex.verify(
        "04.choose_recipe", lambda s: None if plan(s) is None else s.candidates[plan(s)])


def test_choose_recipe_accepts_any_recipe_the_measurements_cannot_tell_apart():
    # equal step and fp32 weights: amp_bf16 is as right as bf16_master where both fit
    def prefer_amp(s):
        best = plan(s)
        if best is not None and "amp_bf16" in choose._acceptable(s):
            return "amp_bf16"
        return best

    assert "chooses as the plan does" in ex.verify("04.choose_recipe", prefer_amp)


def test_each_plan_mistake_is_wrong_somewhere_and_told_apart():
    seen = {}
    for mistake, said in choose._PLAN_MISTAKES:
        chosen = tuple(choose._plan(c, **mistake) for c in exmp.PLAN_CASES)
        assert any(g not in choose._acceptable(c) for g, c in zip(chosen, exmp.PLAN_CASES,
                                                                  strict=True)), said  # fmt: skip
        assert chosen not in seen, (said, seen.get(chosen))
        seen[chosen] = said


def test_choose_recipe_tries_the_notebooks_situation_first():
    base = exmp.PLAN_CASES[-1]
    here = recipes.Situation(what="this test's device", n_params=base.n_params,
                             budget_bytes=base.budget_bytes, autocast_dtypes=("bfloat16",),
                             step_s={"float32": 1.0, "bfloat16": 2.0},
                             activation_bytes=base.activation_bytes,
                             candidates=base.candidates)  # fmt: skip

    def right_elsewhere(s):  # hard-codes the constructed cases' answers, wrong on "here"
        return "bf16_master" if s is here else plan(s)

    assert "chooses as the plan does" in ex.verify("04.choose_recipe", right_elsewhere)
    with exmp.checking_on(here), pytest.raises(ex.ExerciseFailed,
                                               match=r"in this test's device, expected 'fp32_adamw'"):  # fmt: skip
        ex.verify("04.choose_recipe", right_elsewhere)
    with exmp.checking_on(here):
        assert "this notebook's measurements and 7 other" in ex.verify("04.choose_recipe", plan)
