"""Notebook 04's last exercise, ``04.choose_recipe``: a decision from measurements.

The learner chooses the recipe to train with on a device and a memory budget
(:class:`labkit.recipes.Situation`); the check tries the choice on this notebook's measurements
(:func:`checking_on`) and on :data:`PLAN_CASES`, each usual mistake named, and the notebook
then runs the choice for real beside fp32 (:func:`run_plan`). Apart from the other checks of
notebook 04 because it judges a plan, not a number; ``mixed_precision`` re-exports its names.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from labkit import recipes
from labkit.course.exercises import ExerciseFailed, call, exercise
from labkit.course.exercises.learner_code import callable_name, require_callable

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
            f"in {s.what}, {callable_name(fn)}(situation) returned {type(got).__name__} {got!r}: return "
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
    fn = require_callable(choose_recipe, "choose_recipe(situation) -> str | None")
    cases = [*_NOTEBOOK_SITUATION[-1:], *PLAN_CASES]
    got = [_plan_answer(fn, s) for s in cases]
    wrong = [i for i, (g, s) in enumerate(zip(got, cases, strict=True)) if g not in _acceptable(s)]
    if not wrong:
        mine = "this notebook's measurements and " if _NOTEBOOK_SITUATION else ""
        return (f"{callable_name(fn)} chooses as the plan does on {mine}{len(PLAN_CASES)} other "
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
