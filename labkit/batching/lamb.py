"""Layer-wise trust ratios for large batches: LAMB, and the ratio LARS and LAMB share.

When the linear scaling rule raises the learning rate with the batch, one global rate is
too large for some layers and too small for others: a layer whose update is large beside its
weights moves by a large fraction of itself in one step and can diverge. LARS (You, Gitman and
Ginsburg 2017, "Large Batch Training of Convolutional Networks", arXiv 1708.03888) and LAMB
(You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
arXiv 1904.00962, Algorithm 2) scale each layer's update ``u`` by a **trust ratio**::

    ratio = φ(‖w‖) / ‖u‖        w ← w − η · ratio · u

so that every layer moves by η·φ(‖w‖) per step, a fixed fraction of its own norm (for
φ(z) = z), however large or small its gradient. LARS takes ``u`` from SGD with momentum
(the gradient plus weight decay), LAMB from Adam: ``u = m̂ / (√v̂ + ε) + λ·w``, bias-corrected
moments and decoupled weight decay, the ratio computed per parameter tensor.

Choices made here, and where they come from:

* **φ is the identity** (no clamp by default). The paper writes φ(z) = min(max(z, γ_l), γ_u)
  without fixing the bounds; TensorFlow Addons' ``LAMB`` (tensorflow_addons/optimizers/
  lamb.py) and NVIDIA apex's ``FusedLAMB`` use ‖w‖ unclamped. ``clamp=(lo, hi)`` gives the
  paper's bounded form.
* **A zero norm gives ratio 1**: a tensor initialised to zero (every bias here) or a zero
  update would otherwise get ratio 0 or a division by zero; TF Addons does the same
  (``tf.where(w_norm > 0, tf.where(g_norm > 0, w_norm / g_norm, 1), 1)``).
* **Biases and LayerNorm gains and biases (every 1-D tensor) are excluded** from the trust
  ratio and from weight decay: they take Adam's plain step. The paper's Algorithm 2 states
  the ratio for every layer; the reference implementations exclude these tensors: TF Addons'
  ``exclude_from_layer_adaptation`` defaults to the weight-decay exclusions, and apex's
  ``FusedLAMB`` applies the ratio only to parameters with weight decay unless
  ``use_nvlamb=True``, and NVIDIA's BERT recipe (DeepLearningExamples,
  PyTorch/LanguageModeling/BERT/run_pretraining.py) gives biases and LayerNorm weight decay
  0, so they take Adam's plain step there. The split is ``labkit.train.make_optimizer``'s
  weight-decay split. ``adapt=False`` in a parameter group turns the ratio off for it.

The optimizer keeps the last ratio of each adapted tensor (``state[p]["trust_ratio"]``), so a
notebook can show what the ratio did.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from labkit import train
from labkit.config import RunConfig, TrainConfig


def trust_ratio(weight_norm: float | torch.Tensor, update_norm: float | torch.Tensor, *,
                clamp: tuple[float, float] | None = None) -> torch.Tensor:  # fmt: skip
    """φ(‖w‖) / ‖u‖, the layer-wise trust ratio of LARS and LAMB; 1 where either norm is 0.

    ``clamp=(lo, hi)``: φ(z) = min(max(z, lo), hi), the paper's bounded φ; None: φ(z) = z.
    """
    w, u = (x if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=torch.float64)
            for x in (weight_norm, update_norm))  # a tensor keeps its dtype
    if clamp is not None:
        lo, hi = clamp
        if not 0 <= lo <= hi:
            raise ValueError(f"clamp={clamp!r} is not allowed: (lo, hi) with 0 <= lo <= hi")
        phi = w.clamp(lo, hi)
    else:
        phi = w
    ok = (w > 0) & (u > 0)
    return torch.where(ok, phi / torch.where(ok, u, torch.ones_like(u)), torch.ones_like(u))


class LAMB(torch.optim.Optimizer):
    """LAMB (You et al. 2019, Algorithm 2) with decoupled weight decay, per parameter tensor.

    For each tensor ``w`` with gradient ``g``, at step t (counted from 1)::

        m ← β₁ m + (1 − β₁) g          v ← β₂ v + (1 − β₂) g²
        u = (m / (1 − β₁ᵗ)) / (√(v / (1 − β₂ᵗ)) + ε) + λ w
        w ← w − η · trust_ratio(‖w‖, ‖u‖) · u      (ratio 1 where ``adapt`` is False)

    Parameter-group options: ``lr``, ``betas``, ``eps``, ``weight_decay`` (λ), ``adapt``
    (apply the trust ratio), ``clamp`` (φ's bounds or None). Use :func:`make_lamb` for the
    course's split (matrices adapted and decayed; 1-D tensors neither).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, adapt: bool = True,
                 clamp: tuple[float, float] | None = None) -> None:  # fmt: skip
        if not (isinstance(lr, (int, float)) and lr >= 0):
            raise ValueError(f"lr={lr!r} is not allowed: a learning rate >= 0")
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas={betas!r} is not allowed: two numbers in [0, 1)")
        if not eps > 0:
            raise ValueError(f"eps={eps!r} is not allowed: a number > 0")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay={weight_decay!r} is not allowed: a number >= 0")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      adapt=adapt, clamp=clamp))  # fmt: skip

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LAMB does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                update = (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                if group["adapt"]:
                    ratio = trust_ratio(p.norm(), update.norm(), clamp=group["clamp"])
                    state["trust_ratio"] = float(ratio)
                    p.add_(update * ratio.to(p.dtype), alpha=-group["lr"])
                else:
                    p.add_(update, alpha=-group["lr"])
        return loss


def make_lamb(model: nn.Module, cfg: TrainConfig, *, lr: float | None = None,
              betas: tuple[float, float] = (0.9, 0.95)) -> LAMB:  # fmt: skip
    """LAMB over ``model`` with ``labkit.train.make_optimizer``'s split and settings.

    Matrices and embeddings (2-D and up): weight decay ``cfg.weight_decay`` and the trust
    ratio. 1-D tensors (biases, LayerNorm gains and biases): neither (see the module docstring
    for the sources). ``betas`` and ε as the course's AdamW (β₂ = 0.95, ``cfg.adam_eps``), so
    that a comparison with it changes the trust ratio alone.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay,
               "adapt": True},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0,
               "adapt": False}]  # fmt: skip
    return LAMB(groups, lr=cfg.lr if lr is None else lr, betas=betas, eps=cfg.adam_eps)


def trust_ratios(optimizer: LAMB) -> list[float]:
    """The last trust ratio of every adapted tensor (after at least one step)."""
    return [s["trust_ratio"] for s in optimizer.state.values() if "trust_ratio" in s]


def train_with(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: RunConfig,
               train_data: torch.Tensor, *, device: torch.device | None = None) -> train.History:
    """``labkit.train.train`` with the optimizer given instead of made: the same batches (drawn
    from a generator seeded with ``cfg.train.seed``), the same schedule (``train.lr_at``), the
    same step (``train.train_step``, grad_clip included). With ``train.make_optimizer``'s AdamW
    it reproduces ``train.train`` step for step, so a run with another optimizer differs in the
    optimizer alone. float16 gets a GradScaler, as ``train.train``'s default ("auto")."""
    from labkit.data import get_batch

    t = cfg.train
    device = device or train.resolve_device(t.device)
    model.to(device).train()
    scaler = train.make_scaler(device, t.dtype)  # None unless float16
    history = train.History()
    batches = train.batch_stream(train_data, cfg, torch.Generator().manual_seed(t.seed), get_batch)
    for step in range(1, t.steps + 1):
        lr = train.lr_at(step, t)
        train.set_lr(optimizer, lr)
        micro = [(x.to(device), y.to(device)) for x, y in next(batches)]
        stats = train.train_step(model, optimizer, micro, device=device, dtype=t.dtype,
                                 scaler=scaler, grad_clip=t.grad_clip)
        history.record(step, stats, lr=lr)
    return history


# ----------------------------------------------------------------------------------------------
# Notebook 05, section 5: LAMB at AdamW's linearly scaled rate, against the AdamW runs.


@dataclass(frozen=True)
class LambComparison:
    """LAMB trained as one of :class:`labkit.batching.noise.LrRuns`' AdamW runs (the same
    batch, rate, schedule, seeds and initial weights): spikes, final losses and trust ratios."""

    batch: int
    lr: float
    seeds: tuple[int, ...]
    histories: dict[str, dict[int, train.History]]
    """"AdamW" and "LAMB" -> seed -> history."""
    finals: dict[str, list[float]]
    """Final validation loss per seed."""
    ratio: dict[int, float]
    """LAMB's median trust ratio at the last step, per seed."""

    @property
    def rises(self) -> dict[str, list[float]]:
        from labkit.batching.noise import largest_rise

        return {name: [largest_rise(h[s].loss) for s in self.seeds] for name, h in self.histories.items()}

    @property
    def spikes(self) -> dict[str, int]:
        from labkit.batching.noise import SPIKE

        return {name: sum(r > SPIKE for r in rises) for name, rises in self.rises.items()}

    def describe(self) -> str:
        from labkit.batching.noise import SPIKE

        n = len(self.seeds)
        lines = [f"predicted (You et al. 2017, 2019): LAMB at batch {self.batch} and lr {self.lr:.1e} "
                 "does not spike where AdamW at the same rate does; its loss is not predicted at this rate"]  # fmt: skip
        rises, spikes = self.rises, self.spikes
        for name in self.histories:
            lines.append(f"measured: {name:<5} final validation loss "
                         + ", ".join(f"{v:.3f}" for v in self.finals[name])
                         + "; largest rise " + ", ".join(f"{r:.3f}" for r in rises[name])
                         + f" nats; spiked (> {SPIKE}) in {spikes[name]} of {n} runs")  # fmt: skip
        if spikes["AdamW"] == 0:
            lines.append("stability: not tested here. AdamW at this rate did not spike in any run, so "
                         "there was no instability for LAMB to remove")  # fmt: skip
        elif spikes["LAMB"] < spikes["AdamW"]:
            lines.append(f"stability: as predicted. AdamW spiked in {spikes['AdamW']} run(s), LAMB in "
                         f"{spikes['LAMB']}")  # fmt: skip
        else:
            lines.append(f"stability: NOT as predicted. LAMB spiked in {spikes['LAMB']} run(s), AdamW in "
                         f"{spikes['AdamW']}")  # fmt: skip
        gap = statistics.fmean(self.finals["LAMB"]) - statistics.fmean(self.finals["AdamW"])
        if n > 1:
            spread = max(max(v) - min(v) for v in self.finals.values())  # seed to seed, within an optimizer
            lines.append(f"final loss: LAMB {gap:+.3f} against AdamW (mean of {n} seeds); seed "
                         f"spread up to {spread:.3f}: "
                         + (f"LAMB ended {'worse' if gap > 0 else 'better'}, by more than the spread"
                            if abs(gap) > spread else "not resolved by these seeds"))  # fmt: skip
        else:
            lines.append(f"final loss: LAMB {gap:+.3f} against AdamW, one seed: how far a rerun would "
                         "move it is not measured at this size (the lab size runs two)")  # fmt: skip
        ratio = statistics.median(self.ratio.values())
        lines.append(f"measured: LAMB's median trust ratio at the last step {ratio:.3f}: each matrix "
                     f"moved η·‖w‖ a step, {1 / ratio:.0f}× less than a step of η·u without the ratio "
                     "would have moved it")  # fmt: skip
        return "\n".join(lines)


def compare_with_adamw(runs: Any, label: str, cfg: RunConfig, train_data: torch.Tensor, *,
                       device: Any = "cpu", dtype: str = "float32") -> LambComparison:  # fmt: skip
    """Train LAMB (:func:`make_lamb`, :func:`train_with`) exactly as the AdamW run ``label`` of
    ``runs`` (a :class:`labkit.batching.noise.LrRuns`) was trained, seed by seed, and evaluate
    it on the same held-out batches."""
    from labkit.model import GPT

    b, steps, _ = runs.runs[label]
    lr = runs.lr[label]
    hist, val, ratio = {}, {}, {}
    for seed in runs.seeds:
        torch.manual_seed(seed)
        model = GPT(cfg.model)  # the same initial weights as the AdamW run of this seed
        run_cfg = cfg.replace(micro_batch=b, steps=steps, lr=lr, warmup_steps=max(1, steps // 10),
                              min_lr=None, eval_every=0, seed=seed, dtype=dtype)  # fmt: skip
        optimizer = make_lamb(model, run_cfg.train)
        hist[seed] = train_with(model, optimizer, run_cfg, train_data, device=device)
        val[seed] = train.evaluate(model, runs.val_batches, device=device, dtype=dtype)
        ratio[seed] = statistics.median(trust_ratios(optimizer))
    histories = {"AdamW": {s: runs.histories[label, s] for s in runs.seeds}, "LAMB": hist}
    finals = {"AdamW": [runs.final_val[label, s] for s in runs.seeds], "LAMB": [val[s] for s in runs.seeds]}
    return LambComparison(batch=b, lr=lr, seeds=runs.seeds, histories=histories, finals=finals,
                          ratio=ratio)  # fmt: skip


def plot_lamb(result: LambComparison, ax: Any = None) -> Any:
    """Training loss (moving average) against the optimiser step, AdamW against LAMB."""
    import matplotlib.pyplot as plt  # here, so that importing labkit stays light

    from labkit.batching.noise import smoothed

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.4))
    first = result.seeds[0]
    for i, (name, h) in enumerate(result.histories.items()):
        for seed in result.seeds:
            ax.plot(h[seed].steps, smoothed(h[seed].loss, max(1, len(h[seed].loss) // 10)), c=f"C{i}",
                    alpha=0.9 if seed == first else 0.4, label=name if seed == first else None)  # fmt: skip
    ax.set(xlabel="optimiser step", ylabel="training loss (moving average)",
           title=f"batch {result.batch}, lr {result.lr:.0e}: AdamW against LAMB (measured)")  # fmt: skip
    ax.legend(fontsize=8)
    return ax
