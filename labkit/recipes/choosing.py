"""Choosing a recipe: what a precision plan decides from (:class:`Situation`, over
:data:`PLAN_CANDIDATES`) and a few real steps to check the choice (:func:`train_recipe`).

Apart from the measurements because it is the decision's side: notebook 04's exercise chooses
from a situation, then runs the choice beside fp32.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from labkit.memory import optimizer_state_tensors, storage_bytes
from labkit.precision import checked_autocast
from labkit.recipes.measured import recipe_optimizer
from labkit.recipes.recipe import RECIPES, Recipe
from labkit.train import DTYPES, Batch

PLAN_CANDIDATES: dict[str, Recipe] = {
    **RECIPES,
    "amp_fp16_no_scaler": Recipe(
        "amp_fp16_no_scaler", autocast="float16",
        description="PyTorch AMP in fp16, without a loss scaler",
        source="PyTorch AMP docs: fp16 autocast is meant to be used with GradScaler"),
    "amp_fp16": Recipe(
        "amp_fp16", autocast="float16", loss_scaler=True,
        description="PyTorch AMP in fp16 with a GradScaler (dynamic loss scaling)",
        source="PyTorch AMP docs, 'Automatic Mixed Precision examples'"),
}  # fmt: skip
"""The recipes a precision plan chooses among: :data:`RECIPES` and the two fp16 AMP variants."""


@dataclass(frozen=True)
class Situation:
    """What a precision plan decides from: one model on one device, and what was measured.

    A recipe *fits* when its model states (bytes per parameter × ``n_params``) and its
    activations (``activation_bytes``) together are at most ``budget_bytes``. Speed is that of
    the recipe's compute dtype (``step_s[recipe.compute_dtype]``): the step timed per precision.
    """

    what: str
    """Which model on which device, and where the numbers come from (measured or constructed)."""
    n_params: int
    budget_bytes: float
    """The memory the training step may fill."""
    autocast_dtypes: tuple[str, ...]
    """The 16-bit dtypes this device computes in ("bfloat16", "float16"); float32 always runs."""
    step_s: dict[str, float]
    """Seconds of one training step by compute dtype; only dtypes the device runs."""
    activation_bytes: dict[str, float]
    """Recipe name -> bytes autograd keeps for the backward at the micro-batch (autocast's
    16-bit weight copies included)."""
    candidates: dict[str, Recipe]
    """The recipes to choose among, by name."""

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("candidates is empty: give the recipes to choose among")
        missing = [n for n in self.candidates if n not in self.activation_bytes]
        if missing:
            raise ValueError(f"activation_bytes has no entry for {missing}")
        bad = [d for d in self.autocast_dtypes if d not in ("bfloat16", "float16")]
        if bad or "float32" not in self.step_s:
            raise ValueError(f"autocast_dtypes={self.autocast_dtypes!r}, step_s keys "
                             f"{sorted(self.step_s)}: 16-bit dtypes only, and float32 timed")  # fmt: skip
        untimed = [d for d in self.autocast_dtypes if d not in self.step_s]
        if untimed:
            raise ValueError(f"step_s has no time for {untimed}, which the device runs")

    def table(self) -> str:
        """The candidates as the plan sees them (no verdict: that is the plan's job)."""
        lines = [f"{self.what}: {self.n_params:,} parameters, budget {self.budget_bytes / 2**20:,.2f} "
                 f"MiB; 16-bit dtypes this device runs: {', '.join(self.autocast_dtypes) or 'none'}",
                 f"  {'recipe':<24}{'compute':<10}{'scaler':<8}{'fp32 weights':<14}"
                 f"{'activations':>14}{'step':>10}"]  # fmt: skip
        for name, r in self.candidates.items():
            s = self.step_s.get(r.compute_dtype)
            lines.append(f"  {name:<24}{r.compute_dtype:<10}{'yes' if r.loss_scaler else 'no':<8}"
                         f"{'yes' if r.steps_fp32_weights else 'no':<14}"
                         f"{self.activation_bytes[name] / 2**20:>10.2f} MiB"
                         f"{'not run' if s is None else f'{s * 1e3:.1f} ms':>10}")  # fmt: skip
        return "\n".join(lines)


@dataclass(frozen=True)
class RecipeRun:
    """A few real training steps of one recipe: its losses and the bytes it held."""

    recipe: Recipe
    losses: list[float]
    """Training loss of each step (true scale, as computed in the forward)."""
    skipped: int
    """Steps the loss scaler skipped (an inf or NaN gradient); 0 without a scaler."""
    peak_bytes: int
    """Most bytes held at the end of any phase (forward, backward, optimizer step), by tensor
    accounting: parameters, gradients, master copy, buffer, optimizer state and the tensors
    saved for backward, each storage once. The backward's own transient peak is not seen."""
    cuda_peak_bytes: int | None = None
    """On CUDA: ``torch.cuda.max_memory_allocated`` over the run, minus what was allocated before."""


def train_recipe(
    recipe: Recipe,
    model: nn.Module,
    batches: Sequence[Batch],
    *,
    device: str | torch.device = "cpu",
    steps: int = 8,
    lr: float = 1e-3,
) -> RecipeRun:
    """Train a copy of ``model`` for ``steps`` real steps under ``recipe`` (one micro-batch per
    step, ``batches`` cycled) and return its losses and the bytes it held.

    Each step as :func:`measure_recipe` does it (parameters cast to ``param_dtype``, autocast
    where the recipe has it, the master copy stepped and copied back, the fp32 buffer), with
    AdamW or SGD at a constant ``lr``, and a ``torch.amp.GradScaler`` where
    ``recipe.loss_scaler`` (it unscales the gradients the optimizer steps, skips a step with an
    inf or NaN gradient and adapts its scale). ``model`` itself is left as it was.
    """
    if not batches or steps < 1:
        raise ValueError(f"steps={steps!r} with {len(batches)} batches: give at least one of each")
    device = torch.device(device)
    model = copy.deepcopy(model).to(device=device, dtype=DTYPES[recipe.param_dtype]).train()
    params = [p for p in model.parameters() if p.requires_grad]
    master = [p.detach().to(DTYPES[recipe.master_dtype]).requires_grad_()
              for p in params] if recipe.master_dtype else []  # fmt: skip
    buffers = [torch.zeros_like(m) for m in master] if recipe.grad_buffer_dtype else []
    optimizer = recipe_optimizer(recipe.optimizer, master or params)
    for group in optimizer.param_groups:
        group["lr"] = lr
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**16) if recipe.loss_scaler else None
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in param_ptrs:
            saved.append(t)
        return t

    def held() -> int:
        grads = [t.grad for t in (*params, *master) if t.grad is not None]
        return storage_bytes([*params, *grads, *master, *buffers, *saved,
                              *optimizer_state_tensors(optimizer)])  # fmt: skip

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device) if cuda else 0
    losses: list[float] = []
    peak = skipped = 0
    for step in range(steps):
        x, y = (t.to(device) for t in batches[step % len(batches)])
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                checked_autocast(device.type, recipe.autocast or "fp32"):  # fmt: skip
            _, loss = model(x, y)
        peak = max(peak, held())
        saved.clear()
        (scaler.scale(loss) if scaler is not None else loss).backward()
        losses.append(float(loss.detach()))
        peak = max(peak, held())  # the 16-bit gradients beside the buffer, before the add
        if buffers:
            for b, p in zip(buffers, params, strict=True):
                b.add_(p.grad.to(b.dtype))
                p.grad = None
        if master:
            for m, p, b in zip(master, params, buffers or [None] * len(master), strict=True):
                m.grad = b if b is not None else p.grad.to(m.dtype)
        peak = max(peak, held())
        if scaler is not None:
            before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            skipped += scaler.get_scale() < before
        else:
            optimizer.step()
        peak = max(peak, held())
        if master:
            with torch.no_grad():
                for p, m in zip(params, master, strict=True):
                    p.copy_(m)
        for t in (*params, *master):
            t.grad = None
        for b in buffers:
            b.zero_()
    cuda_peak = torch.cuda.max_memory_allocated(device) - start if cuda else None
    return RecipeRun(recipe=recipe, losses=losses, skipped=skipped, peak_bytes=peak,
                     cuda_peak_bytes=cuda_peak)  # fmt: skip
