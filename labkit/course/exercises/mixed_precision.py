"""Notebook 04's exercises (mixed precision), checked in the kernel.

* ``04.loss_scaling``: dynamic loss scaling, step by step against ``torch.amp.GradScaler``.
* ``04.underflow``: the fraction of a tensor's values a cast to fp16 flushes to zero.
* ``04.bytes_per_param``: persistent bytes per parameter of a training recipe
  (:class:`labkit.recipes.Recipe`), against the prediction and a measured step.
* ``04.choose_recipe``: a decision from measurements, the recipe to train with on a device and
  a memory budget (:class:`labkit.recipes.Situation`), checked on this notebook's measurements
  (:func:`checking_on`) and on :data:`PLAN_CASES`, each usual mistake named; the notebook then
  runs the choice for real beside fp32 (:func:`run_plan`).

Each check runs the learner's code on small, fixed inputs (well under a second on a laptop
CPU), compares it with PyTorch's or labkit's tested implementation, and names the usual
mistake behind a wrong value without printing the code that would fix it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import numbers
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from labkit import recipes
from labkit.course.exercises import (
    ExerciseFailed,
    _name,
    _require_callable,
    _require_int,
    call,
    exercise,
)
from labkit.formulas import OPTIMIZER_STATES, dtype_bytes

# --------------------------------------------------------------------------- references
# What later cells use while the learner's answer is not done or wrong.


def reference_scaled_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer,
                          state: dict[str, Any]) -> bool:  # fmt: skip
    """One loss-scaled step with ``torch.amp.GradScaler``'s rules; True if it stepped."""
    (loss * state["scale"]).backward()
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]
             if p.grad is not None]  # fmt: skip
    if not all(bool(torch.isfinite(g).all()) for g in grads):
        state["scale"] *= state["backoff_factor"]  # overflow: skip the step, back off
        state["growth_tracker"] = 0
        return False
    for g in grads:
        g.div_(state["scale"])  # the true gradients again
    optimizer.step()
    state["growth_tracker"] += 1
    if state["growth_tracker"] == state["growth_interval"]:
        state["scale"] *= state["growth_factor"]  # long enough without overflow: try higher
        state["growth_tracker"] = 0
    return True


def reference_fp16_underflow_fraction(t: torch.Tensor) -> float:
    from labkit import precision

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
    fn = _require_callable(scaled_step, "scaled_step(loss, optimizer, state) -> bool")
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
    fn = _require_callable(fp16_underflow_fraction, "fp16_underflow_fraction(t) -> float")
    cases = [(what, torch.tensor(values)) for what, values in UNDERFLOW_KNOWN]
    cases += [(f"real gradients of the smoke GPT × {s}", t)
              for s, t in zip(("1", "2**-12", "2**-16"), _real_gradients(), strict=True)]  # fmt: skip
    for what, t in cases:
        got = call(fn, t.clone())
        if isinstance(got, (torch.Tensor, bool)) or not isinstance(got, numbers.Real):
            raise ExerciseFailed(
                f"{_name(fn)}(t) returned {type(got).__name__} {got!r}; return a Python float "
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
    return _require_int(value, what)


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
    return _bytes_result(got, f"{_name(fn)}(<Recipe {r.name!r}>)")


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
    fn = _require_callable(bytes_per_param, "bytes_per_param(recipe) -> int")
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


# --------------------------------------------------------------------------- 04.choose_recipe
# A decision from measurements: which recipe to train with, on this device, in this memory.


def _need(s: recipes.Situation, name: str, master_times: int = 1, activations: bool = True) -> float:
    """Bytes recipe ``name`` needs in situation ``s``: model states plus activations. The
    keyword arguments give what the usual mistakes count instead."""
    r = s.candidates[name]
    master = recipes.predicted_breakdown(r)["master"]
    states = recipes.predicted_bytes_per_param(r) + (master_times - 1) * master
    return states * s.n_params + (s.activation_bytes[name] if activations else 0)


def _runs_here(s: recipes.Situation, r: recipes.Recipe) -> bool:
    return r.compute_dtype == "float32" or r.compute_dtype in s.autocast_dtypes


def _plan(s: recipes.Situation, *, scaler_rule: bool = True, master_times: int = 1,
          activations: bool = True, memory: bool = True, fp32_weights_first: bool = True,
          pure_as_last_resort: bool = True, key: str = "fastest",
          least_bad: bool = False) -> str | None:  # fmt: skip
    """The reference plan (every keyword at its default) and the usual mistakes (one changed).

    Keep the recipes the device runs (fp16 only with a loss scaler) whose needed bytes fit the
    budget; prefer those whose optimizer steps fp32 weights; take the fastest by the measured
    step of its compute dtype, the smaller need breaking a tie; None if nothing fits.
    """
    usable = [n for n, r in s.candidates.items() if _runs_here(s, r)
              and not (scaler_rule and r.compute_dtype == "float16" and not r.loss_scaler)]  # fmt: skip
    fits = [n for n in usable
            if not memory or _need(s, n, master_times, activations) <= s.budget_bytes]  # fmt: skip
    if least_bad and not fits:
        fits = usable
    safe = [n for n in fits if s.candidates[n].steps_fp32_weights]
    pool = safe if fp32_weights_first else fits
    if not pool and pure_as_last_resort:
        pool = fits
    if not pool:
        return None
    order = {
        "fastest": lambda n: (s.step_s[s.candidates[n].compute_dtype],
                              _need(s, n, master_times, activations)),
        "slowest": lambda n: (-s.step_s[s.candidates[n].compute_dtype],
                              _need(s, n, master_times, activations)),
        "least memory": lambda n: (_need(s, n, master_times, activations),
                                   s.step_s[s.candidates[n].compute_dtype]),
    }[key]  # fmt: skip
    return min(pool, key=order)


def reference_choose_recipe(situation: recipes.Situation) -> str | None:
    """What later cells use while the learner's answer is not done or wrong."""
    return _plan(situation)


def _acceptable(s: recipes.Situation) -> set[str | None]:
    """The right answers: the reference's, and any recipe the measurements cannot tell from it
    (it fits, runs here, steps fp32 weights as the reference does, and its compute dtype's
    step is as fast)."""
    ref = _plan(s)
    if ref is None:
        return {None}
    r = s.candidates[ref]
    return {n for n, c in s.candidates.items() if _runs_here(s, c)
            and not (c.compute_dtype == "float16" and not c.loss_scaler)
            and _need(s, n) <= s.budget_bytes and c.steps_fp32_weights == r.steps_fp32_weights
            and s.step_s[c.compute_dtype] == s.step_s[r.compute_dtype]}  # fmt: skip


def _case(what: str, n_params: float, budget: float, dtypes: tuple[str, ...],
          step_s: dict[str, float], act32: float, act_autocast: float,
          act16: float) -> recipes.Situation:  # fmt: skip
    """A constructed situation: activations by kind of recipe (fp32, autocast over fp32
    weights, 16-bit parameters), in bytes."""
    acts = {n: act32 if r.compute_dtype == "float32" else act_autocast if r.autocast else act16
            for n, r in recipes.PLAN_CANDIDATES.items()}  # fmt: skip
    return recipes.Situation(what=what, n_params=int(n_params), budget_bytes=budget,
                             autocast_dtypes=dtypes, step_s=step_s, activation_bytes=acts,
                             candidates=dict(recipes.PLAN_CANDIDATES))  # fmt: skip


GB = 1e9
PLAN_CASES = (
    # fp32 does not fit; the only 16-bit arithmetic is fp16: AMP with a scaler
    _case("a GPU with fp16 tensor cores and no bf16 (V100-class), 1.3B parameters, 32 GB",
          1.3e9, 32 * GB, ("float16",), {"float32": 1.0, "float16": 0.45}, 12 * GB, 7 * GB,
          5 * GB),
    # only pure bf16 fits: the last resort beats not training
    _case("an H100-class GPU, 7B parameters, 80 GB", 7e9, 80 * GB, ("bfloat16", "float16"),
          {"float32": 1.0, "bfloat16": 0.32, "float16": 0.33}, 40 * GB, 24 * GB, 14 * GB),
    # bf16_master needs 22 GB, 18 without its master copy; only pure bf16 fits in 20
    _case("an H100-class GPU, 1B parameters, 20 GB left", 1e9, 20 * GB, ("bfloat16", "float16"),
          {"float32": 1.0, "bfloat16": 0.32, "float16": 0.33}, 14 * GB, 9 * GB, 6 * GB),
    # bf16_master fits (38 of 39 GB), with its master copy counted twice it would not
    _case("an A100-class GPU, 2B parameters, 39 GB", 2e9, 39 * GB, ("bfloat16", "float16"),
          {"float32": 1.0, "bfloat16": 0.30, "float16": 0.31}, 20 * GB, 11 * GB, 6 * GB),
    # nothing fits
    _case("an H100-class GPU, 70B parameters, one 80 GB GPU", 70e9, 80 * GB,
          ("bfloat16", "float16"), {"float32": 1.0, "bfloat16": 0.32, "float16": 0.33},
          300 * GB, 180 * GB, 110 * GB),
    # a CPU whose 16-bit steps are slower: fp32 fits and is fastest
    _case("a CPU whose 16-bit steps are slower than fp32's, 124M parameters, 64 GB", 124e6,
          64 * GB, ("bfloat16", "float16"), {"float32": 1.0, "bfloat16": 1.6, "float16": 3.5},
          6 * GB, 4 * GB, 3 * GB),
    # everything fits; bf16 is fastest; pure bf16 needs least but steps bf16 weights
    _case("an H100-class GPU, 1.3B parameters, 40 GB", 1.3e9, 40 * GB, ("bfloat16", "float16"),
          {"float32": 1.0, "bfloat16": 0.34, "float16": 0.36}, 12 * GB, 7 * GB, 5 * GB),
)  # fmt: skip
"""Constructed situations (step times relative to fp32, activations in round numbers), each
built so that a usual mistake chooses differently from the plan."""

# The usual mistakes, as plans, and what the check says about each.
_PLAN_MISTAKES: tuple[tuple[dict[str, Any], str], ...] = (
    ({"scaler_rule": False}, "an fp16 recipe without a loss scaler was chosen: fp16's range "
     "ends at 2**-24, and without a scaler the small gradients of a real run flush to zero "
     "(section 2); keep fp16 only with recipe.loss_scaler"),
    ({"master_times": 0}, "the fp32 master copy was left out of the bytes: where master_dtype "
     "is set, the optimizer steps a separate 4-byte copy of every parameter"),
    ({"master_times": 2}, "the fp32 master copy was counted twice: its 4 bytes are counted once "
     "(the optimizer's moments are a separate field)"),
    ({"activations": False}, "the activations were left out: a recipe fits only if its model "
     "states and situation.activation_bytes[name] together fit the budget"),
    ({"memory": False}, "that picks by speed alone: the fastest recipe is no use if it does not "
     "fit; first keep the recipes that fit the budget"),
    ({"key": "least memory"}, "that picks the recipe that needs the least memory; among those "
     "that fit, the goal is the fastest step"),
    ({"key": "slowest"}, "that picks the slowest recipe that fits (a max where a min belongs?)"),
    ({"fp32_weights_first": False}, "a pure 16-bit recipe was chosen while one that steps fp32 "
     "weights fits: its optimizer steps 16-bit weights and loses small updates (section 5); "
     "take it only when nothing with fp32 weights fits"),
    ({"pure_as_last_resort": False, "fp32_weights_first": True}, "when only a pure 16-bit "
     "recipe fits, take it: training with 16-bit weights beats not training"),
    ({"least_bad": True}, "when no recipe fits, return None instead of the least bad one"),
)  # fmt: skip


def _gb(s: recipes.Situation, nbytes: float) -> str:
    return f"{nbytes / 1e9:,.1f} GB" if s.budget_bytes >= 1e9 else f"{nbytes / 2**20:,.2f} MiB"


def _plan_diagnosis(s: recipes.Situation, got: str | None) -> str:
    """What is wrong with choosing ``got`` in ``s``, said from the situation's numbers."""
    right = _plan(s)
    if got is None:
        r = s.candidates[right]
        why = ("it is the only kind that fits, and training with 16-bit weights beats not "
               "training" if not r.steps_fp32_weights else "it fits the budget")  # fmt: skip
        return (f"returned None, but {right!r} needs {_gb(s, _need(s, right))} of the "
                f"{_gb(s, s.budget_bytes)} budget: {why}")  # fmt: skip
    r = s.candidates[got]
    need = _need(s, got)
    if right is None:
        least = min(_need(s, n) for n in s.candidates)
        return (f"chose {got!r}, but nothing fits: even the smallest need is {_gb(s, least)} of "
                f"a {_gb(s, s.budget_bytes)} budget; return None rather than the least bad")  # fmt: skip
    if not _runs_here(s, r):
        return (f"chose {got!r}, which computes in {r.compute_dtype}, and this device does not "
                f"(situation.autocast_dtypes is {s.autocast_dtypes}): a recipe must run here")  # fmt: skip
    if r.compute_dtype == "float16" and not r.loss_scaler:
        return f"chose {got!r}: {_PLAN_MISTAKES[0][1]}"
    if need > s.budget_bytes:
        master = recipes.predicted_breakdown(r)["master"] * s.n_params
        states = need - s.activation_bytes[got]
        said = (f"chose {got!r}, which needs {_gb(s, need)} (model states {_gb(s, states)} + "
                f"activations {_gb(s, s.activation_bytes[got])}), over the {_gb(s, s.budget_bytes)}"
                " budget")  # fmt: skip
        if master and need - master <= s.budget_bytes:
            return f"{said}: without its fp32 master copy it would fit; was it left out?"
        if states <= s.budget_bytes:
            return f"{said}: its model states alone fit; were the activations left out?"
        return f"{said}: first keep the recipes that fit, then take the fastest of those"
    if not r.steps_fp32_weights and s.candidates[right].steps_fp32_weights:
        return f"chose {got!r}, but {right!r} fits too: {_PLAN_MISTAKES[7][1]}"
    mine, best = s.step_s[r.compute_dtype], s.step_s[s.candidates[right].compute_dtype]
    said = (f"chose {got!r} (its {r.compute_dtype} step takes {mine:.3g} s), but {right!r} fits "
            f"and is faster ({best:.3g} s)")  # fmt: skip
    twice = _need(s, right, master_times=2)
    if twice > s.budget_bytes and recipes.predicted_breakdown(s.candidates[right])["master"]:
        return (f"{said}; it needs {_gb(s, _need(s, right))}, and {_gb(s, twice)} with its "
                "master copy counted twice: was it?")  # fmt: skip
    if need == min(_need(s, n) for n in s.candidates if _runs_here(s, s.candidates[n])):
        return f"{said}: {_PLAN_MISTAKES[5][1]}"
    return f"{said}: among the recipes that fit, take the fastest"


def _plan_answer(fn: Callable[[recipes.Situation], Any], s: recipes.Situation) -> str | None:
    try:
        got = call(fn, s)
    except ExerciseFailed as err:
        missing = [d for d in ("bfloat16", "float16") if d not in s.step_s]
        if "KeyError" in str(err) and any(repr(d) in str(err) for d in missing):
            raise ExerciseFailed(
                f"in {s.what}: {err}. This device does not run {', '.join(missing)} (it is "
                "not in situation.autocast_dtypes), so there is no step time for it: leave the "
                "recipes that compute in it out before comparing speeds"
            ) from err
        raise
    if isinstance(got, recipes.Recipe) and got.name in s.candidates:
        got = got.name  # the recipe itself: its name is as good
    if got is not None and (not isinstance(got, str) or got not in s.candidates):
        raise ExerciseFailed(
            f"in {s.what}, {_name(fn)}(situation) returned {type(got).__name__} {got!r}: return "
            f"the name of one of situation.candidates ({', '.join(s.candidates)}), or None if "
            "none fits"
        )
    return got


_NOTEBOOK_SITUATION: list[recipes.Situation] = []


@contextlib.contextmanager
def checking_on(situation: recipes.Situation) -> Iterator[None]:
    """Inside the block, the check of 04.choose_recipe tries the learner's function on
    ``situation`` (this notebook's measurements) first, then on :data:`PLAN_CASES`::

        with exmp.checking_on(here):
            choose_recipe = ex.check("04.choose_recipe", choose_recipe)
    """
    _NOTEBOOK_SITUATION.append(situation)
    try:
        yield
    finally:
        _NOTEBOOK_SITUATION.pop()


@exercise(
    "04.choose_recipe",
    "Choose the precision recipe for a device and a memory budget, from measurements",
    hints=(
        "three questions, in order: can this device run it safely at all; does it fit "
        "the memory; and of those left, which trains fastest? Memory decides what is possible, "
        "speed only chooses among the possible",
        "a recipe runs here if its compute dtype (recipe.compute_dtype) is float32 or one of "
        "situation.autocast_dtypes; an fp16 recipe also needs recipe.loss_scaler (section 2). "
        "What it needs is its persistent bytes per parameter (exercise 3) times n_params, plus "
        "its activation bytes; it fits if that is at most budget_bytes",
        "speed is the measured step of the recipe's compute dtype (situation.step_s); on equal "
        "speed, the recipe that needs less memory. A recipe whose optimizer steps 16-bit "
        "weights (recipe.steps_fp32_weights is False) loses small updates (section 5): choose "
        "it only when no recipe with fp32 weights fits, and return None when nothing fits",
        "recipe: go through the candidates and drop those the device cannot run, and fp16 "
        "without a scaler; compute each remaining one's need and drop those over the budget; "
        "if any left steps fp32 weights, keep only those; return the name of the one with the "
        "shortest step (the smaller need on a tie), or None if none is left",
    ),
    reference=reference_choose_recipe,
)
def _verify_choose_recipe(choose_recipe: Any) -> str:
    fn = _require_callable(choose_recipe, "choose_recipe(situation) -> str | None")
    cases = [*_NOTEBOOK_SITUATION[-1:], *PLAN_CASES]
    got = [_plan_answer(fn, s) for s in cases]
    wrong = [i for i, (g, s) in enumerate(zip(got, cases, strict=True)) if g not in _acceptable(s)]
    if not wrong:
        mine = "this notebook's measurements and " if _NOTEBOOK_SITUATION else ""
        return (f"{_name(fn)} chooses as the plan does on {mine}{len(PLAN_CASES)} other "
                "situations (no bf16, fp16 only with a scaler, a master copy that does or does "
                "not fit, nothing that fits, a CPU whose 16-bit steps are slower); below, your "
                "choice runs for real")  # fmt: skip
    s = cases[wrong[0]]
    for mistake, said in _PLAN_MISTAKES:
        theirs = [_plan(c, **mistake) for c in cases]
        if all(t == g or (t in _acceptable(c) and g in _acceptable(c))
               for t, g, c in zip(theirs, got, cases, strict=True)):  # fmt: skip
            return _raise_plan(s, got[wrong[0]], said)
    return _raise_plan(s, got[wrong[0]], _plan_diagnosis(s, got[wrong[0]]))


def _raise_plan(s: recipes.Situation, got: str | None, why: str) -> str:
    right = " or ".join(repr(n) for n in sorted(_acceptable(s), key=str))
    raise ExerciseFailed(f"in {s.what}, expected {right}, got {got!r}: {why}")


def run_plan(choice: str | None, situation: recipes.Situation, model: nn.Module,
             batches: list[Any], *, device: Any, steps: int, lr: float,
             tolerance: float) -> str:  # fmt: skip
    """Run the chosen recipe and fp32 for ``steps`` real steps each (same weights, same
    batches) and return what the run says, chosen by comparing measurements: whether the
    choice fits the budget (measured bytes), trains (finite, falling loss) and ends within
    ``tolerance`` of fp32's loss (mean of the last third of the steps). Prints the numbers."""
    if choice is None:
        return "the plan is to train nothing here: there is nothing to run"
    recipe = situation.candidates[choice]
    runs = {name: recipes.train_recipe(situation.candidates[name], model, batches, device=device,
                                       steps=steps, lr=lr)
            for name in dict.fromkeys([choice, "fp32_adamw"])}  # fmt: skip
    tail = max(1, steps // 3)
    late = {name: sum(r.losses[-tail:]) / tail for name, r in runs.items()}
    for name, r in runs.items():
        print(f"measured: {name:<24} losses {r.losses[0]:.3f} → {r.losses[-1]:.3f} over {steps} "
              f"steps (late mean {late[name]:.4f}), {r.skipped} skipped; held at most "
              f"{r.peak_bytes / 2**20:.2f} MiB (tensor accounting)"
              + (f", CUDA peak {r.cuda_peak_bytes / 2**20:.2f} MiB" if r.cuda_peak_bytes else ""))
    mine = runs[choice]
    planned = _need(situation, choice)
    fits = mine.peak_bytes <= situation.budget_bytes
    said = [f"{choice!r} planned {planned / 2**20:.2f} MiB (model states and activations counted "
            f"as alive at once), held at most {mine.peak_bytes / 2**20:.2f} MiB, "
            + ("within" if fits else "over") + f" the {situation.budget_bytes / 2**20:.2f} MiB "
            "budget"]  # fmt: skip
    finite = all(math.isfinite(v) for v in mine.losses)
    falling = finite and mine.losses[-1] < mine.losses[0]
    gap = late[choice] - late["fp32_adamw"]
    if not finite:
        said.append("its loss is not finite: it does not train")
    elif not falling:
        said.append("its loss did not fall: it does not train")
    elif abs(gap) <= tolerance:
        said.append(f"it trains, and ends {gap:+.4f} from fp32, within the tolerance "
                    f"{tolerance:.4f}")
    else:
        said.append(f"it trains, but ends {gap:+.4f} from fp32, beyond the tolerance "
                    f"{tolerance:.4f}")
    verdict = "the plan held" if fits and falling and abs(gap) <= tolerance else \
        "the plan did not hold"
    return f"{verdict}: " + "; ".join(said) + (f" ({recipe.description})" if recipe.description else "")
