"""Measured training memory, split into the four parts the formulas predict.

Where the bytes of a training step go (ZeRO paper, section 3): the parameters, their
gradients, the optimiser state, and the activations autograd keeps for the backward pass.
:mod:`labkit.formulas` predicts each part; this module measures them on a real step.

Two methods, each named in the result:

* **tensor accounting** (every device): add up the bytes of the tensors that really exist
  (``p``, ``p.grad``, ``optimizer.state``) and of every tensor autograd *saves for backward*
  during the forward pass, caught with ``torch.autograd.graph.saved_tensors_hooks``. Each
  storage is counted once, and saved tensors that are parameters are not counted twice.
  This is exact for what autograd keeps, and works on a CPU where no allocator statistics
  exist.
* **CUDA allocator** (GPU only): ``torch.cuda.memory_allocated`` before and after each phase,
  and ``max_memory_allocated`` for the peak. This also sees temporaries, workspace and
  fragmentation-free rounding that tensor accounting cannot (PyTorch "CUDA memory management").
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from labkit.train import Batch, autocast


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views share one storage)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        seen.setdefault(s.data_ptr(), s.nbytes())
    return sum(seen.values())


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0]  # skip scalar step counters


def _cuda_allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


@dataclass(frozen=True)
class MemoryMeasurement:
    """Bytes of each part of training memory, measured on one training step."""

    parameters: int
    gradients: int
    optimizer_state: int
    optimizer_state_before_first_step: int
    activations: int
    """Bytes autograd saved for backward in one forward pass (tensor accounting)."""
    device: str
    method: str
    cuda_activations: int | None = None
    """On CUDA: memory_allocated after forward minus before it (allocator view)."""
    cuda_peak: int | None = None
    """On CUDA: max_memory_allocated over the step."""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.activations

    def as_dict(self) -> dict[str, int]:
        return {"parameters": self.parameters, "gradients": self.gradients,
                "optimizer state": self.optimizer_state, "activations": self.activations}

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{k}</td><td>{v / 2**20:,.2f} MiB</td></tr>"
                       for k, v in self.as_dict().items())
        return (f"<table><thead><tr><th>part</th><th>measured</th></tr></thead>"
                f"<tbody>{rows}</tbody></table><p>{html.escape(self.method)} on "
                f"{html.escape(self.device)}</p>")


def measure_training_memory(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    *,
    device: torch.device,
    dtype: str = "float32",
) -> MemoryMeasurement:
    """Run one real forward, backward and optimiser step on ``batch`` and measure each part.

    The model takes a real step: call it on a model you are about to train anyway (or a copy).
    """
    params = [p for p in model.parameters()]
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    state_before = storage_bytes(optimizer_state_tensors(optimizer))

    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in param_storages:
            saved.append(t)
        return t

    x, y = (t.to(device) for t in batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before_forward = _cuda_allocated(device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(device, dtype):
        _, loss = model(x, y)
    after_forward = _cuda_allocated(device)
    activations = storage_bytes(saved)
    saved.clear()
    loss.backward()
    gradients = storage_bytes(p.grad for p in params if p.grad is not None)
    optimizer.step()
    optimizer_state = storage_bytes(optimizer_state_tensors(optimizer))
    optimizer.zero_grad(set_to_none=True)
    cuda = device.type == "cuda"
    return MemoryMeasurement(
        parameters=storage_bytes(params),
        gradients=gradients,
        optimizer_state=optimizer_state,
        optimizer_state_before_first_step=state_before,
        activations=activations,
        device=str(device),
        method="tensor accounting (storages of parameters, .grad, optimizer.state, "
               "and tensors saved for backward)" + (" + CUDA allocator" if cuda else ""),
        cuda_activations=(after_forward - before_forward) if cuda else None,
        cuda_peak=torch.cuda.max_memory_allocated(device) if cuda else None,
    )
