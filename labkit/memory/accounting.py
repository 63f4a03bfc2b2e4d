"""Training memory measured: the four parts of a real step, by tensor accounting (every
device) and, on a GPU, by the CUDA allocator; what is alive at each phase of the first steps.

The measuring half of :mod:`labkit.memory` (its docstring says how each method counts). Apart
from the predictions (:mod:`labkit.memory.prediction`) and notebook 01's reading of both
(:mod:`labkit.memory.report`) because this is what the others are checked against. Import it as
``labkit.memory``, which re-exports what notebooks call.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from labkit.tables import html_table
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
        rows = [[k, f"{v / 2**20:,.2f} MiB"] for k, v in self.as_dict().items()]
        where = f"<p>{html.escape(self.method)} on {html.escape(self.device)}</p>"
        return html_table(["part", "measured"], rows) + where


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


@dataclass(frozen=True)
class PhaseBytes:
    """Bytes alive at the end of one phase of one training step (tensor accounting)."""

    step: int
    phase: str
    """"start", "forward", "backward" or "optimizer step" (before ``zero_grad``)."""
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    """Tensors saved for backward and still held: only after the forward."""
    cuda_allocated: int | None = None
    """On CUDA: ``torch.cuda.memory_allocated`` at this point."""
    cuda_step_peak: int | None = None
    """On CUDA, on each step's last phase: ``max_memory_allocated`` over that step."""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.activations


def live_bytes_over_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Batch],
    *,
    device: torch.device,
    dtype: str = "float32",
) -> list[PhaseBytes]:
    """Train one real step per batch and record what is alive after each phase.

    PyTorch's optimisers create their state lazily, in the first ``step()`` (``torch.optim``'s
    ``_init_group``): the first forward and backward run without it, every later one beside
    it. So step 2's forward holds exactly the optimiser state more than step 1's (same batch
    shape), and an out-of-memory error can first strike at step 2. The model takes real
    steps: use a copy, or a model you are about to train anyway.
    """
    params = list(model.parameters())
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    cuda = device.type == "cuda"
    rows: list[PhaseBytes] = []

    def record(step: int, phase: str, saved: list[torch.Tensor], peak: bool = False) -> None:
        if cuda:
            torch.cuda.synchronize(device)
        rows.append(PhaseBytes(
            step=step, phase=phase, parameters=storage_bytes(params),
            gradients=storage_bytes(p.grad for p in params if p.grad is not None),
            optimizer_state=storage_bytes(optimizer_state_tensors(optimizer)),
            activations=storage_bytes(saved),
            cuda_allocated=_cuda_allocated(device),
            cuda_step_peak=torch.cuda.max_memory_allocated(device) if cuda and peak else None))

    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in param_storages:
            saved.append(t)
        return t

    for step, (x, y) in enumerate(batches, start=1):
        x, y = x.to(device), y.to(device)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        record(step, "start", [])
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(device, dtype):
            _, loss = model(x, y)
        record(step, "forward", saved)
        saved.clear()  # our references would otherwise keep the activations alive
        loss.backward()
        del loss
        record(step, "backward", [])
        optimizer.step()
        record(step, "optimizer step", [], peak=True)
        optimizer.zero_grad(set_to_none=True)
    return rows


def saved_activation_bytes(
    model: nn.Module, batch: Batch, *, device: torch.device, dtype: str = "float32",
) -> int:
    """Bytes autograd saves for backward in one forward pass of ``model`` on ``batch``.

    The activation part of :func:`measure_training_memory` alone: no backward, no optimiser
    step, the model left unchanged (the graph is dropped when this returns). Cheap enough
    for a sweep over batch sizes and sequence lengths.
    """
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in param_storages:
            saved.append(t)
        return t

    x, y = (t.to(device) for t in batch)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(device, dtype):
        model(x, y)
    return storage_bytes(saved)
