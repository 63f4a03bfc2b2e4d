"""What a mixed-precision step holds, and in which dtype (notebook 04, section 6): the dtypes of
the parameters, optimizer state and gradients after an autocast step, and the activations
autocast saves per dtype, predicted by the formula and measured by tensor accounting.

Apart from :mod:`labkit.recipes.measured`, which counts bytes per category under a recipe,
because these look at the plain training step (``labkit.train``) the recipes are built on.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from labkit import train
from labkit.formulas import activation_bytes
from labkit.memory import measure_training_memory, optimizer_state_tensors
from labkit.precision import checked_autocast


@dataclass(frozen=True)
class StepDtypes:
    """The dtypes found after one fp16 autocast step and one more fp16 backward."""

    params: tuple[str, ...]
    optimizer_state: tuple[str, ...]
    grads: tuple[str, ...]

    def describe(self) -> str:
        return (f"after one fp16 autocast step (measured): parameter dtypes {list(self.params)}, "
                f"AdamW state dtypes {list(self.optimizer_state)}\n"
                f"gradient dtypes after an fp16 backward: {list(self.grads)}: the backward of "
                "autocast's cast returns each gradient in its parameter's dtype, so fp32 weights "
                "get fp32 gradients")


def step_dtypes(model: nn.Module, train_cfg: object, batch: tuple[torch.Tensor, torch.Tensor],
                device: torch.device) -> StepDtypes:
    """One fp16 autocast training step on a copy of ``model`` (``labkit.train.train_step`` with
    its GradScaler), then one more fp16 forward and backward; the dtypes each part is in."""
    x, y = batch
    probe = copy.deepcopy(model).to(device)
    optimizer = train.make_optimizer(probe, train_cfg)
    train.train_step(probe, optimizer, [(x, y)], device=device, dtype="float16",
                     scaler=train.make_scaler(device, "float16"))
    state = sorted({str(t.dtype) for t in optimizer_state_tensors(optimizer)})
    params = sorted({str(p.dtype) for p in probe.parameters()})
    with checked_autocast(device.type, "fp16"):  # one more fp16 forward and backward
        loss = probe(x, y)[1]
    loss.backward()
    grads = sorted({str(p.grad.dtype) for p in probe.parameters()})
    return StepDtypes(tuple(params), tuple(state), tuple(grads))


@dataclass(frozen=True)
class AutocastActivations:
    """Activation bytes per dtype: predicted for the blocks (``formulas.activation_bytes``) and
    measured (every tensor autograd saved, ``memory.measure_training_memory``)."""

    predicted: dict[str, float]
    measured: dict[str, int]

    def describe(self) -> str:
        lines = [f"{dtype:<9} activations: predicted {self.predicted[dtype] / 2**20:6.2f} MiB "
                 f"(the blocks), measured {self.measured[dtype] / 2**20:6.2f} MiB (everything "
                 "saved)" for dtype in self.predicted]
        low = [d for d in self.predicted if d != "float32"]
        for dtype in low:
            lines.append(f"{dtype} / float32: predicted "
                         f"{self.predicted[dtype] / self.predicted['float32']:.2f}, measured "
                         f"{self.measured[dtype] / self.measured['float32']:.2f}")
        return "\n".join(lines)


def autocast_activations(model: nn.Module, cfg: object, batch: tuple[torch.Tensor, torch.Tensor],
                         device: torch.device, dtypes: Sequence[str]) -> AutocastActivations:
    """Predict and measure the activations of one step of a copy of ``model`` per dtype
    (float32 without autocast, a 16-bit dtype under it). ``cfg``: the notebook's RunConfig."""
    m_cfg, b = cfg.model, cfg.train.micro_batch
    predicted, measured = {}, {}
    for dtype in dict.fromkeys(dtypes):
        e = 4 if dtype == "float32" else 2
        predicted[dtype] = activation_bytes(
            m_cfg.n_layer, m_cfg.seq_len, b, m_cfg.d_model, m_cfg.n_head, bytes_per_element=e,
            dropout=m_cfg.dropout > 0, attention="flash", autocast=dtype != "float32")
        probe = copy.deepcopy(model).to(device)
        optimizer = train.make_optimizer(probe, cfg.train)
        measured[dtype] = measure_training_memory(probe, optimizer, batch, device=device,
                                                  dtype=dtype).activations
    return AutocastActivations(predicted, measured)
