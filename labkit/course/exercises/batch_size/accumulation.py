"""Notebook 05's ``05.accumulation``: gradient accumulation over k micro-batches.

``accumulate(model, batch, k)``: k micro-batches whose backward passes leave the whole batch's
gradient in ``.grad``, compared with one backward over the batch
(:func:`labkit.batching.accumulation.accumulated_gradients` with k=1) on a small GPT, and a
wrong answer matched against the usual mistakes (the loss not divided by k, one micro-batch's
gradient, micro-batches of the wrong size).
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from labkit.batching import accumulation
from labkit.batching.noise import Batch
from labkit.config import ModelConfig
from labkit.course.exercises import ExerciseFailed, call, exercise
from labkit.course.exercises.learner_code import require_callable

# --------------------------------------------------------------------------- the reference
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
    fn = require_callable(accumulate, "accumulate(model, batch, k) -> None")
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
