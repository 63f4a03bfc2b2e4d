"""One real training step under a recipe, its tensors counted by category (:func:`measure_recipe`).

Separate from the recipe itself because it runs torch: a copy of the model, the master copy,
the buffer and the optimizer built from the recipe's fields, then the storage bytes of the real
tensors, each storage once; its agreement with ``predicted_breakdown`` is a consistency check.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from labkit.formulas import (
    BYTES_PER_PARAM_CONVENTIONS,
    predicted_bytes_per_param,
)
from labkit.memory import optimizer_state_tensors, storage_bytes
from labkit.precision import checked_autocast
from labkit.recipes.recipe import PERSISTENT, Recipe, matmul_weight_params
from labkit.train import DTYPES, Batch


@dataclass(frozen=True)
class RecipeMeasurement:
    """Bytes of every tensor category of one real training step under a recipe."""

    recipe: Recipe
    n_params: int
    matmul_weight_params: int
    parameters: int
    gradients: int
    """``param.grad`` right after the last backward (where a buffer exists, just before being
    added into it: the moment both exist)."""
    master: int
    grad_buffer: int
    optimizer_state: int
    """State tensors after the step (the scalar ``step`` counters are left out)."""
    autocast_copies: int
    """Transient: saved-for-backward tensors equal to a parameter cast to the autocast dtype."""
    master_step_grads: int
    """Transient: the fp32 ``.grad`` tensors made for the master step without a buffer."""
    activations: int
    """Transient: every other tensor autograd saved for backward (largest micro-batch)."""
    device: str

    @property
    def persistent(self) -> dict[str, int]:
        """Bytes of each persistent category, in :data:`PERSISTENT` order."""
        return {k: getattr(self, k) for k in PERSISTENT}

    @property
    def bytes_per_param(self) -> float:
        """Persistent model-state bytes per parameter."""
        return sum(self.persistent.values()) / self.n_params

    def per_param(self) -> dict[str, float]:
        """Bytes per parameter of each persistent category, then the transient ones: autocast
        copies per *matmul-weight* parameter, the rest per parameter."""
        out = {k: v / self.n_params for k, v in self.persistent.items()}
        out["total (persistent)"] = self.bytes_per_param
        out["autocast copies per matmul weight"] = (
            self.autocast_copies / self.matmul_weight_params if self.matmul_weight_params else 0.0
        )
        out["master-step fp32 grads (transient)"] = self.master_step_grads / self.n_params
        return out

    def as_row(self) -> dict[str, object]:
        """One table row: recipe name, predicted and measured bytes per parameter."""
        return {"recipe": self.recipe.name,
                "predicted": predicted_bytes_per_param(self.recipe),
                **{k: round(v, 3) for k, v in self.per_param().items()}}  # fmt: skip


def _split_saved(saved: list[torch.Tensor], params: list[torch.Tensor],
                 autocast: str | None) -> tuple[int, int]:  # fmt: skip
    """(bytes of autocast weight copies, bytes of other saved tensors), each storage once.

    A saved tensor is a weight copy when it equals a parameter cast to the autocast dtype (as
    saved for a matmul's backward it is often the transposed view ``w.t()``). Saved tensors that
    are parameters themselves cost nothing extra and are skipped.
    """
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    low = DTYPES[autocast] if autocast else None
    casts: dict[int, list[torch.Tensor]] = {}  # numel -> params cast to the autocast dtype
    if low is not None:
        for p in params:
            casts.setdefault(p.numel(), []).append(p.detach().to(low))
    copies: dict[int, int] = {}
    others: dict[int, int] = {}
    for t in saved:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in param_ptrs or ptr in copies or ptr in others:
            continue
        views = (t, t.t()) if t.dim() == 2 else (t,)
        is_copy = t.dtype == low and any(
            v.shape == c.shape and torch.equal(v, c)
            for c in casts.get(t.numel(), ())
            for v in views
        )
        (copies if is_copy else others)[ptr] = storage.nbytes()
    return sum(copies.values()), sum(others.values())


def recipe_optimizer(name: str, tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(tensors, lr=1e-3)
    return torch.optim.SGD(tensors, lr=1e-3, momentum=0.9 if name == "sgd_momentum" else 0.0)


def measure_recipe(
    recipe: Recipe,
    model: nn.Module,
    batches: Sequence[Batch],
    device: str | torch.device = "cpu",
) -> RecipeMeasurement:
    """Run ONE real training step of ``recipe`` on a copy of ``model`` and count the bytes.

    The step: the copy is cast to ``param_dtype``; a forward and backward pass per micro-batch
    in ``batches`` (under autocast where the recipe has it; each loss divided by their number);
    with a gradient buffer, each micro-batch's 16-bit gradients are added into it; the optimizer
    steps the master copy (its ``.grad`` is the buffer, or the gradients cast to fp32) or else
    the parameters; the master copy is copied back into the parameters. ``model`` itself is
    left as it was. No loss scaling: it changes no memory.

    Every number is read from the real tensors (``untyped_storage().nbytes()``, each storage
    once), none is filled in from :func:`predicted_breakdown`.
    """
    if not batches:
        raise ValueError("batches is empty: pass one (x, y) pair per micro-batch")
    device = torch.device(device)
    model = copy.deepcopy(model).to(device=device, dtype=DTYPES[recipe.param_dtype]).train()
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no parameter that requires grad: nothing to train")
    master = [p.detach().to(DTYPES[recipe.master_dtype]).requires_grad_()
              for p in params] if recipe.master_dtype else []  # fmt: skip
    buffers = [torch.zeros_like(m) for m in master] if recipe.grad_buffer_dtype else []
    optimizer = recipe_optimizer(recipe.optimizer, master or params)

    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)  # only looked at (and let go) before this micro-batch's backward
        return t

    copies = activations = gradients = 0
    for x, y in batches:
        context = checked_autocast(device.type, recipe.autocast or "fp32")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context:
            _, loss = model(x.to(device), y.to(device))
        c, a = _split_saved(saved, params, recipe.autocast)
        copies, activations = max(copies, c), max(activations, a)
        saved.clear()
        (loss / len(batches)).backward()
        gradients = max(gradients, storage_bytes(p.grad for p in params))
        if buffers:
            for b, p in zip(buffers, params, strict=True):
                b.add_(p.grad)  # fp32 accumulation of the 16-bit gradient
                p.grad = None
    master_step_grads = 0
    if master:
        for m, p, b in zip(master, params, buffers or [None] * len(master), strict=True):
            m.grad = b if b is not None else p.grad.to(m.dtype)
        if not buffers:
            master_step_grads = storage_bytes(m.grad for m in master)
    optimizer.step()
    if master:
        with torch.no_grad():
            for p, m in zip(params, master, strict=True):
                p.copy_(m)  # the updated master, rounded back into the 16-bit parameters
    return RecipeMeasurement(
        recipe=recipe,
        n_params=sum(p.numel() for p in params),
        matmul_weight_params=matmul_weight_params(model),
        parameters=storage_bytes(params),
        gradients=gradients,
        master=storage_bytes(master),
        grad_buffer=storage_bytes(buffers),
        optimizer_state=storage_bytes(optimizer_state_tensors(optimizer)),
        autocast_copies=copies,
        master_step_grads=master_step_grads,
        activations=activations,
        device=str(device),
    )


def describe_measured(measured: Mapping[str, RecipeMeasurement]) -> str:
    """Per recipe: bytes per parameter predicted and measured, and the transient 16-bit weight
    copies where autocast made some; then the literature's conventions, with their sources."""
    first = next(iter(measured.values()))
    lines = [f"bytes per parameter, {first.n_params:,}-parameter GPT on {first.device}:",
             f"{'recipe':<24}{'predicted':>10}{'measured':>10}"
             f"{'  + transient 16-bit weight copies':<36}"]
    for name, m in measured.items():
        copies = m.per_param()["autocast copies per matmul weight"]
        extra = f"  {copies:.2f} per matmul weight (measured)" if copies else ""
        lines.append(f"{name:<24}{predicted_bytes_per_param(m.recipe):>10}"
                     f"{m.bytes_per_param:>10.2f}{extra}")
    lines.append("\nthe literature's conventions (labkit.formulas.BYTES_PER_PARAM_CONVENTIONS):")
    lines.extend(f"  {c.bytes_per_param:>2} B  {c.name:<28} {c.source}"
                 for c in BYTES_PER_PARAM_CONVENTIONS.values())
    return "\n".join(lines)


def plot_measured(measured: Mapping[str, RecipeMeasurement], ax: Any = None) -> Any:
    """Stacked bars of each recipe's persistent bytes per parameter by category (measured),
    autocast's transient weight copies hatched, the predicted total marked."""
    import matplotlib.pyplot as plt  # here, so that importing labkit stays light

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.2))
    names = list(measured)
    left = [0.0] * len(names)
    for i, part in enumerate(PERSISTENT):
        widths = [measured[n].per_param()[part] for n in names]
        ax.barh(names, widths, left=left, color=f"C{i}", label=f"{part} (measured)")
        left = [a + b for a, b in zip(left, widths, strict=True)]
    copies = [measured[n].autocast_copies / measured[n].n_params for n in names]
    ax.barh(names, copies, left=left, color="white", edgecolor="grey", hatch="//",
            label="autocast weight copies (transient)")
    ax.plot([predicted_bytes_per_param(measured[n].recipe) for n in names], names,
            "k|", ms=18, mew=2, label="predicted total")
    ax.invert_yaxis()
    ax.set(xlabel="bytes per parameter", title="model states per recipe, measured from one real step")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.figure.tight_layout()
    return ax
