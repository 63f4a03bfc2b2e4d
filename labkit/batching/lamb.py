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

from collections.abc import Iterable
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
