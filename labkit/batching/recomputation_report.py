"""Notebook 05, section 4: activation checkpointing's memory and time, measured beside the
predictions, the batch it buys, and the other levers on memory (modelled), each printed by a
result's ``describe()`` or a ``describe_*`` function.

:mod:`labkit.batching.recomputation` holds the ideas (``apply_checkpointing``,
``predict_checkpointing``, ``predicted_checkpointed_step_peak``); this module holds notebook 05's
measurements of them and the text the notebook prints. Apart from ``recomputation`` because that
file is the teaching code; what is here is presentation (notebook 03d's side by side of the
recompute modes is :mod:`labkit.batching.recompute_lab`). ``recomputation`` re-exports every name
here, so ``recomputation.measure_checkpointing`` and the others keep working; this module imports
``recomputation`` only inside the functions that need it, since an import at the top would be
circular.
"""

from __future__ import annotations

import copy
import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from labkit import formulas
from labkit.config import ModelConfig

if TYPE_CHECKING:
    from labkit.batching.recomputation import CheckpointPrediction


@dataclass(frozen=True)
class CheckpointingMemory:
    """Per variant (name -> every n-th block, None for none): the bytes saved for the backward
    pass (``labkit.memory.measure_training_memory``), the step's peak (live tensor bytes,
    ``trials.measure_step_peak``) and the prediction (:func:`predict_checkpointing`)."""

    micro_batch: int
    dtype: str
    saved: dict[str, int]
    step_peak: dict[str, int]
    plan: dict[str, CheckpointPrediction]

    def describe(self) -> str:
        lines = [f"micro-batch {self.micro_batch}, {self.dtype}: bytes saved for the backward pass",
                 f"{'checkpointing':<19}{'blocks':>7}{'kept less than none: predicted':>32}"
                 f"{'measured':>10}{'step peak (measured)':>23}"]  # fmt: skip
        for name, plan in self.plan.items():
            less = self.saved["none"] - self.saved[name]
            lines.append(f"{name:<19}{plan.checkpointed:>7}{plan.saving_bytes / 2**20:>28.2f} MiB"
                         f"{less / 2**20:>6.2f} MiB{self.step_peak[name] / 2**20:>19.2f} MiB")  # fmt: skip
        return "\n".join(lines)


def measure_checkpointing(templates: dict[str, nn.Module], every: dict[str, int | None],
                          micro_batch: int, *, data: torch.Tensor, train_cfg: Any,
                          device: torch.device | str = "cpu",
                          dtype: str = "float32") -> CheckpointingMemory:  # fmt: skip
    """Measure each of ``templates`` (checkpointed as ``every`` says; one named "none") at
    ``micro_batch`` sequences of real data (one batch, seed 1), beside the prediction."""
    from labkit import memory, train  # layers 3 and 2
    from labkit.batching import trials
    from labkit.batching.recomputation import predict_checkpointing  # here: see the docstring
    from labkit.data import get_batch

    cfg = next(iter(templates.values())).cfg
    device = torch.device(device)
    batch = get_batch(data, micro_batch, cfg.seq_len, torch.Generator().manual_seed(1))
    saved, step_peak, plan = {}, {}, {}
    for name, n in every.items():
        work = copy.deepcopy(templates[name]).to(device)
        saved[name] = memory.measure_training_memory(work, train.make_optimizer(work, train_cfg),
                                                     batch, device=device, dtype=dtype).activations  # fmt: skip
        step_peak[name] = trials.measure_step_peak(templates[name], micro_batch, seq_len=cfg.seq_len,
                                                   dtype=dtype, train_cfg=train_cfg, device=device)  # fmt: skip
        plan[name] = predict_checkpointing(cfg, micro_batch, n, dtype=dtype,
                                           dropout_mask_bytes=1 if device.type == "cuda" else 4)  # fmt: skip
    return CheckpointingMemory(micro_batch=micro_batch, dtype=dtype, saved=saved,
                               step_peak=step_peak, plan=plan)  # fmt: skip


@dataclass(frozen=True)
class CheckpointingTime:
    """Step times of each variant, trained side by side taking turns (measured), against the
    factor predicted from the FLOPs: the recomputed forward of the checkpointed blocks, one third
    of their training FLOPs, over the FLOPs of the whole step."""

    times: dict[str, list[float]]
    factor: dict[str, float]
    """Predicted step time over the time without checkpointing."""

    def describe(self) -> str:
        from labkit import verdict

        base = statistics.median(self.times["none"])
        lines = [f"{name:<19} step {statistics.median(t) * 1e3:7.1f} ms: "
                 f"{statistics.median(t) / base:.2f} × none (measured), "
                 f"{self.factor[name]:.2f} × (predicted from FLOPs)" for name, t in self.times.items()]  # fmt: skip
        lines.append(str(verdict.compare_times(self.times["every block"], self.times["none"],
                                               names=("every block", "none"))))  # fmt: skip
        return "\n".join(lines)


def time_checkpointing(templates: dict[str, nn.Module], plan: dict[str, CheckpointPrediction],
                       micro_batch: int, *, flops_per_token: float, data: torch.Tensor,
                       train_cfg: Any, device: torch.device | str = "cpu",
                       dtype: str = "float32", rounds: int = 5) -> CheckpointingTime:  # fmt: skip
    """Train a copy of each template on four real batches in turn (``timing.alternate``, one
    warm-up round); predict each factor as 1 + (checkpointed blocks × a block's 6·(12h² + 2hs)
    FLOPs per token / 3) / ``flops_per_token``."""
    from labkit import timing, train  # layers 0 and 2
    from labkit.data import get_batch

    cfg = next(iter(templates.values())).cfg
    h, s = cfg.d_model, cfg.seq_len
    block_flops = 6 * 12 * h * h + 12 * h * s  # per token and layer: 12h² weights + attention
    batches = [get_batch(data, micro_batch, s, torch.Generator().manual_seed(i)) for i in range(4)]
    device = torch.device(device)

    def stepper(template: nn.Module) -> Any:
        work = copy.deepcopy(template).to(device)
        optimizer, scaler, turn = train.make_optimizer(work, train_cfg), train.make_scaler(device, dtype), [0]

        def step() -> float:
            turn[0] += 1
            return train.train_step(work, optimizer, [batches[turn[0] % 4]], device=device,
                                    dtype=dtype, scaler=scaler, grad_clip=train_cfg.grad_clip).seconds  # fmt: skip
        return step

    times = timing.alternate({name: stepper(t) for name, t in templates.items()},
                             rounds=rounds, warmup=1)  # fmt: skip
    factor = {name: 1 + plan[name].checkpointed * block_flops / 3 / flops_per_token
              for name in templates}  # fmt: skip
    return CheckpointingTime(times=times, factor=factor)


def describe_checkpointed_peak(cfg: ModelConfig, predicted: int, without: int, *,
                               dtype: str = "float32", seq_len: int | None = None,
                               cuda: bool = False, terms: int = 4) -> str:  # fmt: skip
    """The largest batch predicted with every block checkpointed (``predicted``) against the one
    without (``without``), the moment the step peaks in at that batch and its largest terms."""
    from labkit.batching.recomputation import predicted_checkpointed_step_peak  # see the docstring

    at_peak = predicted_checkpointed_step_peak(cfg, max(1, predicted), dtype=dtype, seq_len=seq_len)
    lines = [f"predicted (every tensor at the checkpointed step's peak): {predicted} sequences "
             f"instead of {without} without checkpointing ({predicted / max(1, without):.2f} ×); "
             f"at that batch the step peaks in {at_peak.moment}, the largest terms:"]  # fmt: skip
    for term, n in sorted(at_peak.as_dict(cuda=cuda).items(), key=lambda kv: -kv[1])[:terms]:
        lines.append(f"  {n / 2**20:8.2f} MiB  {term}")
    return "\n".join(lines)


def describe_checkpointed_found(found: Any, found_ckpt: Any, predicted: int) -> str:
    """The finder's batch with every block checkpointed against without, and against the
    tensor-by-tensor prediction (``finder.agreement``)."""
    from labkit.batching import finder

    return (f"measured: the largest micro-batch {found.found} without checkpointing, "
            f"{found_ckpt.found} with every block checkpointed "
            f"({found_ckpt.found / found.found:.2f} ×; {len(found_ckpt.trials)} trials, "
            f"{found_ckpt.failures} recovered from)\n"
            f"predicted {predicted}, found {found_ckpt.found}: "
            + finder.agreement(predicted, found_ckpt.found, step="the checkpointed step"))  # fmt: skip


def describe_memory_levers(cfg: ModelConfig, n_params: int, micro_batch: int, *,
                           dtype: str = "float32", dropout_mask_bytes: int = 4,
                           layers: tuple[int, ...] = (16, 64, 256, 1024)) -> str:  # fmt: skip
    """Modelled, from the formulas: bytes per parameter of the model states (float32 AdamW,
    8-bit states, states offloaded), and the blocks' activations at ``micro_batch`` with none,
    every block and √n segments checkpointed, for ``cfg``'s depth and ``layers``."""
    # here, not at the top: recomputation re-exports this module's names
    from labkit.batching.recomputation import predict_checkpointing, segment_checkpoint_bytes

    levers = {
        "float32 AdamW (this lab)": formulas.memory_breakdown(n_params).total,
        "8-bit AdamW states": formulas.memory_breakdown(n_params, optimizer_state_dtype="int8").total,
        "states offloaded to the CPU": formulas.memory_breakdown(n_params, optimizer="sgd").total,
    }
    lines = [f"{what:<28} {total / n_params:4.0f} bytes per parameter on the device (modelled)"
             for what, total in levers.items()]  # fmt: skip
    one_block = predict_checkpointing(cfg, micro_batch, 1, dtype=dtype,
                                      dropout_mask_bytes=dropout_mask_bytes)  # fmt: skip
    block_b, input_b = one_block.per_layer_bytes, one_block.input_bytes
    lines += ["", f"activations of the blocks at micro-batch {micro_batch} (modelled; a block "
              f"keeps {block_b / 2**20:.2f} MiB, its input {input_b / 2**20:.3f} MiB):",
              f"{'layers':>7}{'none':>11}{'every block':>13}{'√n segments':>13}"]  # fmt: skip
    for n in (cfg.n_layer, *layers):
        k = max(1, round(math.sqrt(n)))
        none_b, every_b, seg_b = (segment_checkpoint_bytes(n, block_b, input_b, seg) / 2**20
                                  for seg in (None, n, k))  # fmt: skip
        lines.append(f"{n:>7}{none_b:>7.1f} MiB{every_b:>9.1f} MiB{seg_b:>9.1f} MiB  "
                     f"({k} segment{'s' if k > 1 else ''})")  # fmt: skip
    return "\n".join(lines)
