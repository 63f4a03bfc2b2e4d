"""The single-process reference every tensor-, sequence- and mesh-parallel test compares with.

The same GPT, the same batches, the same global-norm clip and AdamW as the workers train:
what a parallel strategy must reproduce to rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from labkit.config import ModelConfig, TrainConfig
from labkit.model import GPT
from labkit.train import make_optimizer

Trained = tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]


def train_one_process(
    cfg: ModelConfig, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, seed: int,
    micro_batch: int, lr: float = 3e-3, weight_decay: float = 0.1, grad_clip: float = 1.0,
    threads: int | None = None,
) -> Trained:  # fmt: skip
    """(losses per step, the first step's gradients, the final parameters) of ``GPT(cfg)``
    seeded with ``seed`` and trained one AdamW step per batch. ``threads``: PyTorch threads
    while training (each rank has one; two were slower for a small model on a busy 2-core
    machine), restored after."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        model = GPT(cfg)
        opt = make_optimizer(
            model, TrainConfig(micro_batch=micro_batch, lr=lr, weight_decay=weight_decay)
        )
        losses, first_grads = [], {}
        for x, y in batches:
            _, loss = model(x, y)
            loss.backward()
            if not first_grads:
                first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
    finally:
        torch.set_num_threads(before)
    return losses, first_grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_saved_state_matches(saved: dict, reference: Trained, initial_fc: torch.Tensor) -> None:
    """A job's gathered first-step gradients and final parameters (``saved``: "first_grads",
    "params") equal the single-process ``reference``'s, and the parameters moved from
    ``initial_fc`` (blocks.0.mlp.fc.weight before training): two unchanged copies prove nothing."""
    _, ref_grads, ref_params = reference
    params, grads = saved["params"], saved["first_grads"]
    assert set(params) == set(grads) == set(ref_params)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, atol=1e-6, rtol=1e-4, msg=name)
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, atol=1e-4, rtol=0, msg=name)
    assert not torch.allclose(params["blocks.0.mlp.fc.weight"], initial_fc)
