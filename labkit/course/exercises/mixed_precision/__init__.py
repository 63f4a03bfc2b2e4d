"""Notebook 04's exercises (mixed precision), checked in the kernel.

* ``04.loss_scaling``: dynamic loss scaling, step by step against ``torch.amp.GradScaler``.
* ``04.underflow``: the fraction of a tensor's values a cast to fp16 flushes to zero.
* ``04.bytes_per_param``: persistent bytes per parameter of a training recipe
  (:class:`labkit.recipes.Recipe`), against the prediction and a measured step.
* ``04.choose_recipe``: a decision from measurements, the recipe to train with on a device and
  a memory budget (:class:`labkit.recipes.Situation`), checked on this notebook's measurements
  (:func:`checking_on`) and on :data:`PLAN_CASES`, each usual mistake named; the notebook then
  runs the choice for real beside fp32 (:func:`run_plan`). Its check is
  :mod:`labkit.course.exercises.mixed_precision.choose_recipe`, whose public names are re-exported here.

Each check runs the learner's code on small, fixed inputs (well under a second on a laptop
CPU), compares it with PyTorch's or labkit's tested implementation, and names the usual
mistake behind a wrong value without printing the code that would fix it.
"""

from __future__ import annotations

import copy
import functools
import math
import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from labkit import precision, recipes
from labkit.course.exercises import ExerciseFailed, call, exercise
from labkit.course.exercises.learner_code import callable_name, require_callable, require_int
from labkit.course.exercises.mixed_precision.choose_recipe import (  # 04.choose_recipe, re-exported
    PLAN_CASES as PLAN_CASES,
)
from labkit.course.exercises.mixed_precision.choose_recipe import checking_on as checking_on
from labkit.course.exercises.mixed_precision.choose_recipe import run_plan as run_plan
from labkit.formulas import OPTIMIZER_STATES, dtype_bytes

# --------------------------------------------------------------------------- references
# What later cells use while the learner's answer is not done or wrong.


def reference_scaled_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer,
                          state: dict[str, Any]) -> bool:  # fmt: skip
    """One loss-scaled step with ``torch.amp.GradScaler``'s rules; True if it stepped.

    The library's :class:`labkit.precision.ManualScaler` behind the exercise's interface: the
    scaler is rebuilt from ``state`` (scale, growth tracker, factors, interval), runs the step,
    and its scale and tracker are written back into the same dict."""
    scaler = precision.ManualScaler(init_scale=state["scale"], growth_factor=state["growth_factor"],
                                    backoff_factor=state["backoff_factor"],
                                    growth_interval=state["growth_interval"])  # fmt: skip
    scaler.growth_tracker = state["growth_tracker"]
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    state["scale"], state["growth_tracker"] = scaler.get_scale(), scaler.growth_tracker
    return not scaler.history[-1].skipped


def reference_fp16_underflow_fraction(t: torch.Tensor) -> float:
    return precision.underflow_fraction(t, "fp16", "zero")


def reference_bytes_per_param(recipe: recipes.Recipe) -> int:
    return recipes.predicted_bytes_per_param(recipe)


# --------------------------------------------------------------------------- 04.loss_scaling

SCALING_INIT = 2.0**8
SCALING_INTERVAL = 3  # small, so the scale grows within the check's few steps
SCALING_STEPS = ("clean", "inf_loss", "clean", "clean", "clean", "inf_grad", "clean", "clean",
                 "clean")  # fmt: skip
"""What each step of the check feeds the learner: a clean step; a loss that is inf (the
forward overflowed); a finite loss with one inf gradient (the backward overflowed)."""

_STEP_WORDS = {
    "clean": "a clean step (every gradient finite)",
    "inf_loss": "a step whose loss was inf",
    "inf_grad": "a step whose loss was finite but one gradient was inf",
}


def _scaling_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _update_ratio(before: torch.Tensor, mine: torch.Tensor, ref: torch.Tensor) -> float:
    """How many times GradScaler's update the learner's update is (least squares)."""
    d_ref, d_mine = ref - before, mine - before
    return float((d_mine @ d_ref) / (d_ref @ d_ref))


def _near(x: float, y: float) -> bool:
    return math.isfinite(x) and math.isclose(x, y, rel_tol=1e-3)


class _Run:
    """One model, its SGD optimizer and a hook that can make one gradient inf."""

    def __init__(self, base: nn.Module) -> None:
        self.model = copy.deepcopy(base)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.inject = False
        self.model[0].weight.register_hook(self._hook)

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        if not self.inject:
            return grad
        grad = grad.clone()
        grad[0, 0] = math.inf
        return grad

    def loss(self, x: torch.Tensor, y: torch.Tensor, kind: str) -> torch.Tensor:
        self.inject = kind == "inf_grad"
        loss = nn.functional.mse_loss(self.model(x), y)
        return loss * math.inf if kind == "inf_loss" else loss


def _scaling_failure(i: int, kind: str, got: Any, state: dict[str, Any], seen: dict[str, Any],
                     skipped_inf_loss: bool) -> str | None:  # fmt: skip
    """What is wrong at step ``i`` (1-based), or None. ``seen``: the learner's parameters
    before and after the step ("before", "mine"), and GradScaler's outcome: its parameters
    ("ref"), scale before and after, growth tracker, and whether it skipped the step."""
    at = f"at step {i} of {len(SCALING_STEPS)}, {_STEP_WORDS[kind]}"
    if not isinstance(got, bool):
        return (f"{at}, scaled_step returned {type(got).__name__} {got!r}; return True when "
                "the optimizer stepped and False when the step was skipped")  # fmt: skip
    changed = not torch.equal(seen["mine"], seen["before"])
    scale = float(state.get("scale", math.nan))
    if seen["skipped"]:
        if changed and not got and scale == seen["scale"]:
            return (f"{at}: you backed off the scale and returned False, but the parameters "
                    "changed: optimizer.step() ran with the inf/NaN gradients. Check the "
                    "gradients before stepping, and do not step when one is not finite")  # fmt: skip
        if changed and kind == "inf_grad" and skipped_inf_loss:
            return (f"{at}, the step was not skipped, although you skipped the step whose "
                    "loss was inf: a finite loss can still give an inf gradient (the backward "
                    "overflows), so check every gradient in optimizer.param_groups, not the "
                    "loss")  # fmt: skip
        if changed:
            return (f"{at}, the step was not skipped: optimizer.step() ran with inf/NaN "
                    "gradients and the parameters are no longer finite. When any gradient is "
                    "inf or NaN, skip the step, back off the scale and return False")  # fmt: skip
        if got:
            return f"{at}, the step was skipped (rightly), but scaled_step returned True"
    else:
        if not changed:
            return (f"{at}, the parameters did not change: the step was skipped although every "
                    "gradient was finite (is the inf/NaN test the right way round?)")  # fmt: skip
        if not torch.allclose(seen["mine"], seen["ref"], rtol=1e-5, atol=1e-7):
            ratio = _update_ratio(seen["before"], seen["mine"], seen["ref"])
            s = seen["scale_before"]
            if _near(ratio, s):
                why = ("exactly scale times too large: the gradients were never unscaled; divide "
                       "each gradient by the scale before optimizer.step()")  # fmt: skip
            elif _near(ratio, s * s):
                why = ("scale² times too large: the gradients were multiplied by the scale "
                       "again instead of divided by it")  # fmt: skip
            elif _near(ratio, 1 / s):
                why = ("1/scale of the right size: either the loss was not multiplied by the "
                       "scale before backward, or the gradients were divided twice")  # fmt: skip
            else:
                why = (f"{ratio:.3g} times GradScaler's update; unscale each gradient "
                       "(divide by the scale) in place, then call optimizer.step() once")  # fmt: skip
            return (
                f"{at}, the parameters differ from GradScaler's after the step: the update is {why}"
            )
        if not got:
            return f"{at}, the optimizer stepped (rightly), but scaled_step returned False"
    if scale != seen["scale"]:
        before, growth = seen["scale_before"], state.get("growth_factor", 2.0)
        said = f"{at}, state['scale'] is {scale:g}; GradScaler's is {seen['scale']:g}"
        if scale == before and seen["skipped"]:
            return f"{said}: after a skipped step multiply the scale by backoff_factor"
        if scale == before * growth and seen["scale"] == before and seen["tracker"] == 1:
            return (f"{said}: the scale grew after a single clean step; it should grow only "
                    "after growth_interval clean steps in a row (count them in "
                    "state['growth_tracker'])")  # fmt: skip
        if scale == before * growth and seen["scale"] == before:
            return (f"{said}: the scale grew too early; it grows after growth_interval clean "
                    "steps in a row, counted since the last change of the scale")  # fmt: skip
        if scale == before and seen["scale"] == before * growth:
            return (f"{said}: this was the growth_interval-th clean step in a row, so the "
                    "scale should have grown by growth_factor")  # fmt: skip
        return (f"{said} (did you update state['scale'] in place, in the dict you were "
                "given?)")  # fmt: skip
    tracker = state.get("growth_tracker")
    if tracker != seen["tracker"]:
        said = f"{at}, state['growth_tracker'] is {tracker!r}; GradScaler's is {seen['tracker']}"
        if seen["skipped"]:
            return (f"{said}: a skipped step ends the run of clean steps, so reset the tracker "
                    "to 0 when you back off")  # fmt: skip
        if seen["scale"] != seen["scale_before"]:
            return f"{said}: when the scale grows, start counting again from 0"
        return (f"{said}: add 1 to it after each step that was not skipped (in the dict you "
                "were given: update state in place)")  # fmt: skip
    return None


@exercise(
    "04.loss_scaling",
    "Dynamic loss scaling, as GradScaler does it",
    hints=(
        "small fp16 gradients vanish; multiplying the loss by a large number S multiplies every "
        "gradient by S (the chain rule is linear), so they survive. The optimizer must still "
        "see the true gradients, and an S so large that something overflows must not spoil "
        "the weights",
        "an overflow shows up as inf or NaN in the gradients, even when the loss itself is "
        "finite. Such a step is skipped and S halved; after growth_interval clean steps in a "
        "row S is doubled again, so it hovers just below the largest value that does not "
        "overflow",
        "state carries everything between steps: state['scale'] (S) and "
        "state['growth_tracker'] (clean steps in a row); update both in place. "
        "torch.isfinite(g).all() tests one gradient; walk optimizer.param_groups for all of "
        "them",
        "recipe: multiply the loss by the scale and run the backward; look at every gradient "
        "of every parameter group. If one is not finite, shrink the scale by the backoff "
        "factor, start the count of clean steps again from zero and report the step as "
        "skipped. Otherwise divide each gradient by the scale in place, let the optimizer "
        "step, count one more clean step, and when the count reaches the growth interval grow "
        "the scale by the growth factor and start counting again; report the step as taken",
    ),
    reference=reference_scaled_step,
)
def _verify_loss_scaling(scaled_step: Any) -> str:
    fn = require_callable(scaled_step, "scaled_step(loss, optimizer, state) -> bool")
    base = _scaling_model()
    ref, mine = _Run(base), _Run(base)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALING_INIT, growth_factor=2.0,
                                  backoff_factor=0.5, growth_interval=SCALING_INTERVAL)  # fmt: skip
    state = {"scale": SCALING_INIT, "growth_tracker": 0, "growth_factor": 2.0,
             "backoff_factor": 0.5, "growth_interval": SCALING_INTERVAL}  # fmt: skip
    g = torch.Generator().manual_seed(0)
    skipped_inf_loss = False
    for i, kind in enumerate(SCALING_STEPS, start=1):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        before = _flat(mine.model)
        scale_before = scaler.get_scale()
        scaler.scale(ref.loss(x, y, kind)).backward()
        scaler.step(ref.optimizer)
        scaler.update()
        ref.optimizer.zero_grad(set_to_none=True)
        got = call(fn, mine.loss(x, y, kind), mine.optimizer, state)
        mine.optimizer.zero_grad(set_to_none=True)
        outcome = {
            "before": before, "mine": _flat(mine.model), "ref": _flat(ref.model),
            "scale_before": scale_before, "scale": scaler.get_scale(),
            "skipped": scaler.get_scale() < scale_before,
            "tracker": scaler._get_growth_tracker(),
        }  # fmt: skip
        failure = _scaling_failure(i, kind, got, state, outcome, skipped_inf_loss)
        if failure:
            raise ExerciseFailed(failure)
        skipped_inf_loss |= kind == "inf_loss"
    return (
        f"scaled_step matches torch.amp.GradScaler over {len(SCALING_STEPS)} steps (parameters, "
        "scale, growth tracker and skipped steps), through an inf loss, an inf gradient and "
        "two growths of the scale"
    )


# --------------------------------------------------------------------------- 04.underflow

# Values around fp16's bottom: 2**-24 is its smallest subnormal, 2**-25 half of it (a tie,
# which rounds to even: 0), 2**-14 its smallest normal (IEEE 754 binary16; torch.finfo).
UNDERFLOW_KNOWN = (
    ("values around fp16's smallest subnormal",
     [2.0**-26, 2.0**-25, -(2.0**-25), 2.0**-25 * (1 + 2.0**-8), 2.0**-24, 1.5 * 2.0**-24,
      2.0**-20, 2.0**-15, 2.0**-14, 0.5, -3.0, 1e-3]),
    ("exact zeros, inf and NaN among the values",
     [0.0, 0.0, 0.0, 0.0, math.inf, -math.inf, math.nan, 2.0**-30, 1e-9, 1.0, 2.0, 1e-5,
      -0.25]),
)  # fmt: skip


def _underflow_variants(t: torch.Tensor) -> dict[str, float]:
    """The value each usual mistake gives on ``t``, keyed by what it did wrong."""
    finite = t[torch.isfinite(t)]
    nonzero = finite[finite != 0]
    lost = int((nonzero.to(torch.float16) == 0).sum())
    zeros = int((finite == 0).sum())
    n = nonzero.numel()
    a = nonzero.abs()
    return {
        "you counted values below fp16's smallest *normal* number (2**-14) as lost, but the "
        "subnormals between 2**-24 and 2**-14 survive the cast (with fewer bits)":
            int((a < 2.0**-14).sum()) / n,
        "you compared with a threshold at 2**-24: values between 2**-25 and 2**-24 round *up* "
        "to 2**-24 (round to nearest) and survive; let the cast decide, then look for zeros":
            int((a < 2.0**-24).sum()) / n,
        "a value of exactly 2**-24 is fp16's smallest subnormal: it survives the cast":
            int((a <= 2.0**-24).sum()) / n,
        "a value of exactly 2**-25 is halfway between 0 and 2**-24; ties round to even, which "
        "is 0, so it is lost. Let the cast decide, then look for zeros":
            int((a < 2.0**-25).sum()) / n,
        "you counted the exact zeros as lost: a zero is not lost by the cast, leave zeros out "
        "of the count and of the denominator": (lost + zeros) / (n + zeros),
        "you counted the exact zeros as lost (and divided by the nonzero values)":
            (lost + zeros) / n,
        "you divided by every element; the fraction is of the nonzero finite values":
            lost / t.numel(),
        "you divided by the nonzero values including inf and NaN; leave non-finite values "
        "out of the denominator": lost / int((t != 0).sum()),
        "you divided by the finite values including the zeros; leave exact zeros out of the "
        "denominator": lost / (n + zeros),
        "that is a percentage; return a fraction between 0 and 1": 100 * lost / n,
        "you cast to bfloat16, which has fp32's 8 exponent bits and so fp32's range: almost "
        "nothing underflows in it. The question is about float16 (5 exponent bits)":
            int((nonzero.to(torch.bfloat16) == 0).sum()) / n,
    }  # fmt: skip


@functools.cache
def _real_gradients() -> tuple[torch.Tensor, ...]:
    """Gradients of the smoke GPT after one backward, as they are and scaled down."""
    from labkit import config
    from labkit.model import GPT

    torch.manual_seed(0)
    model = GPT(config.preset("smoke").model)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 256, (2, 32), generator=g), torch.randint(0, 256, (2, 32), generator=g)
    model(x, y)[1].backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    # ×2**-12 and ×2**-16: the size gradients take late in training, where fp16 loses many
    return tuple(grads * s for s in (1.0, 2.0**-12, 2.0**-16))


@exercise(
    "04.underflow",
    "The fraction of values fp16 flushes to zero",
    hints=(
        "a float16 cannot hold a magnitude below about 3e-8: a smaller value becomes exactly 0 "
        "when cast. Which values of the tensor count, and out of how many?",
        "a value that was already 0 is not lost, and inf/NaN are not numbers to lose: judge "
        "only the nonzero finite values (torch.isfinite). Rounding is to nearest, so a "
        "threshold test gets values near the bottom of fp16's range wrong: do the cast",
        "t.to(torch.float16) == 0 marks what became zero; float(...) turns a count "
        "ratio into a Python float",
        "recipe: keep only the values that are finite and not zero; cast those to float16; "
        "count how many of them became zero; divide that count by how many values you kept, "
        "and return the share as a Python float",
    ),
    reference=reference_fp16_underflow_fraction,
)
def _verify_underflow(fp16_underflow_fraction: Any) -> str:
    fn = require_callable(fp16_underflow_fraction, "fp16_underflow_fraction(t) -> float")
    cases = [(what, torch.tensor(values)) for what, values in UNDERFLOW_KNOWN]
    cases += [(f"real gradients of the smoke GPT × {s}", t)
              for s, t in zip(("1", "2**-12", "2**-16"), _real_gradients(), strict=True)]  # fmt: skip
    for what, t in cases:
        got = call(fn, t.clone())
        if isinstance(got, (torch.Tensor, bool)) or not isinstance(got, numbers.Real):
            raise ExerciseFailed(
                f"{callable_name(fn)}(t) returned {type(got).__name__} {got!r}; return a Python float "
                "(float(x) or x.item() turns a one-element tensor into one)"
            )
        expected = reference_fp16_underflow_fraction(t)
        # float32 arithmetic (a .mean() of a float32 tensor) is as good as exact: one value
        # more or less among the 120,576 of the real gradients still shows (8e-6 relative)
        if math.isclose(float(got), expected, rel_tol=1e-6, abs_tol=1e-9):
            continue
        why = next((w for w, v in _underflow_variants(t).items()
                    if math.isclose(float(got), v, rel_tol=1e-6, abs_tol=1e-9)),
                   "cast the nonzero finite values to float16 and count those that became 0")  # fmt: skip
        raise ExerciseFailed(
            f"on {what} ({t.numel():,} values) expected {expected:.6g} (the cast, as "
            f"labkit.precision.underflow_fraction does it), got {float(got):.6g}: {why}"
        )
    return (f"fp16_underflow_fraction agrees with the real cast on {len(cases)} tensors (ties "
            "at 2**-25, subnormals, zeros, inf/NaN, and real GPT gradients)")  # fmt: skip


# --------------------------------------------------------------------------- 04.bytes_per_param

# Recipes beyond labkit.recipes.RECIPES: no state, one state, a master copy with SGD, fp16.
STATED_RECIPES = (
    recipes.Recipe("sgd_fp32", optimizer="sgd", description="plain SGD, everything fp32"),
    recipes.Recipe("sgd_momentum_bf16", param_dtype="bf16", optimizer="sgd_momentum",
                   description="SGD with momentum, everything bf16"),
    recipes.Recipe("fp16_master_sgd_momentum", param_dtype="fp16", master_dtype="fp32",
                   optimizer="sgd_momentum",
                   description="fp16 parameters, fp32 master copy stepped by SGD with momentum"),
    recipes.Recipe("amp_fp16", autocast="fp16",
                   description="PyTorch AMP with fp16 autocast (and a GradScaler)"),
)  # fmt: skip


def _bytes_cases() -> tuple[recipes.Recipe, ...]:
    return (*recipes.RECIPES.values(), *STATED_RECIPES)


@functools.cache
def _measured(recipe: recipes.Recipe) -> recipes.RecipeMeasurement:
    """One real step of ``recipe`` on the smoke GPT (cached: recipes are immutable)."""
    from labkit import config
    from labkit.model import GPT

    torch.manual_seed(0)
    model = GPT(config.preset("smoke").model)
    g = torch.Generator().manual_seed(0)
    batch = (
        torch.randint(0, 256, (2, 16), generator=g),
        torch.randint(0, 256, (2, 16), generator=g),
    )
    return recipes.measure_recipe(recipe, model, [batch], "cpu")


def _state_bytes(r: recipes.Recipe, n_states: int, dtype: str | None = None) -> int:
    return n_states * dtype_bytes(dtype or r.state_dtype)


# The usual mistakes, each as the function it amounts to and what the check says about it.
_BYTES_MISTAKES: tuple[tuple[Callable[[recipes.Recipe], int], str], ...] = (
    (lambda r: 8 * recipes.predicted_bytes_per_param(r), "that is bits; divide by 8 for bytes"),
    (lambda r: recipes.predicted_bytes_per_param(r) - recipes.predicted_breakdown(r)["master"],
     "the fp32 master copy is missing: where master_dtype is set, the optimizer steps a "
     "separate fp32 copy of every parameter"),
    (lambda r: recipes.predicted_bytes_per_param(r)
     - (_state_bytes(r, 1) if r.optimizer == "adamw" else 0),
     "AdamW keeps two state tensors per parameter (exp_avg and exp_avg_sq), you counted one"),
    (lambda r: recipes.predicted_bytes_per_param(r) + recipes.autocast_copy_bytes_per_param(r),
     "you counted autocast's 16-bit weight copies, but they live only from a forward pass to "
     "its backward pass: they are not persistent model state"),
    (lambda r: recipes.predicted_bytes_per_param(r) - recipes.predicted_breakdown(r)["gradients"],
     "the gradients (param.grad, in the parameter's dtype) are missing"),
    (lambda r: recipes.predicted_bytes_per_param(r)
     - recipes.predicted_breakdown(r)["grad_buffer"],
     "the fp32 gradient buffer is missing (grad_buffer_dtype)"),
    (lambda r: recipes.predicted_bytes_per_param(r) - recipes.predicted_breakdown(r)["optimizer_state"]
     + OPTIMIZER_STATES[r.optimizer] * dtype_bytes(r.param_dtype),
     "the optimizer's state is in the dtype of what it steps: with a master copy that is "
     "fp32 (state_dtype), not the 16-bit parameters' dtype"),
    (lambda r: recipes.predicted_bytes_per_param(r) - _state_bytes(r, OPTIMIZER_STATES[r.optimizer])
     + _state_bytes(r, 2),
     "you counted AdamW's two states for every optimizer: plain SGD keeps no state and SGD "
     "with momentum one (recipe.optimizer says which)"),
)  # fmt: skip


def _bytes_result(value: object, what: str) -> int:
    """The learner's answer as an int; a float that is a whole number (16.0, from dividing
    itemsizes) is accepted as that number."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and float(value).is_integer():
        return int(value)
    return require_int(value, what)


def _call_bytes(fn: Callable[[recipes.Recipe], Any], r: recipes.Recipe) -> int:
    try:
        got = call(fn, r)
    except ExerciseFailed as err:
        if r.name not in recipes.RECIPES and "KeyError" in str(err):
            raise ExerciseFailed(
                f"{err}. Recipe {r.name!r} is not one of labkit.recipes.RECIPES: a table of known "
                "recipes cannot answer it; compute the bytes from the recipe's fields "
                "(param_dtype, master_dtype, grad_buffer_dtype, optimizer, state_dtype)"
            ) from err
        raise
    return _bytes_result(got, f"{callable_name(fn)}(<Recipe {r.name!r}>)")


def _describe(r: recipes.Recipe) -> str:
    return (f"Recipe {r.name!r} (param_dtype={r.param_dtype}, master_dtype={r.master_dtype}, "
            f"grad_buffer_dtype={r.grad_buffer_dtype}, optimizer={r.optimizer}, "
            f"state_dtype={r.state_dtype}, autocast={r.autocast})")  # fmt: skip


@exercise(
    "04.bytes_per_param",
    "Persistent bytes per parameter of a mixed-precision setup",
    hints=(
        "list the tensors that exist for every parameter from one step to the next: the "
        "parameter, its gradient, any extra copy or buffer, the optimizer's state. Each is "
        "stored in some dtype; add up their sizes",
        "which fields of the Recipe name such a tensor? master_dtype and grad_buffer_dtype are "
        "None when there is none. AdamW keeps two state tensors per parameter, SGD with "
        "momentum one, plain SGD none. Tensors that exist only during a step (autocast's "
        "16-bit weight copies) are not persistent",
        "bytes of one element of a dtype named by a string: getattr(torch, name).itemsize "
        "(float32 4, bfloat16 and float16 2)",
        "recipe: add the itemsize of the parameters' dtype and of the gradients' dtype; add "
        "the master copy's and the gradient buffer's where the recipe names one; add the "
        "optimizer state's itemsize once per state tensor the optimizer keeps (two for AdamW, "
        "one for SGD with momentum, none for plain SGD); return the sum as a whole number",
    ),
    reference=reference_bytes_per_param,
)
def _verify_bytes_per_param(bytes_per_param: Any) -> str:
    fn = require_callable(bytes_per_param, "bytes_per_param(recipe) -> int")
    cases = _bytes_cases()
    got = [_call_bytes(fn, r) for r in cases]
    expected = []
    for r in cases:
        predicted, measured = recipes.predicted_bytes_per_param(r), _measured(r).bytes_per_param
        if predicted != measured:  # labkit's own two answers disagree: not the learner's fault
            raise RuntimeError(f"labkit.recipes: {r.name} predicted {predicted} bytes/param but "
                               f"a real step measured {measured}; please report this")  # fmt: skip
        expected.append(predicted)
    if got == expected:
        return (f"bytes_per_param agrees with the prediction and a measured training step of "
                f"the smoke GPT for {len(cases)} setups (fp32, AMP, master copies, fp32 "
                "gradient buffer, pure bf16, SGD)")  # fmt: skip
    wrong = next(i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b)
    r = cases[wrong]
    why = next((said for mistake, said in _BYTES_MISTAKES
                if [mistake(c) for c in cases] == got),
               "list each persistent tensor the setup keeps per parameter and its dtype again")  # fmt: skip
    raise ExerciseFailed(
        f"for {_describe(r)} expected {expected[wrong]} bytes per parameter (a real training "
        f"step of the smoke GPT measured {_measured(r).bytes_per_param:g}), got {got[wrong]}: "
        f"{why}"
    )
