"""Notebook 01's memory anatomy: the four parts predicted beside measured, the live bytes over
the first steps, a step's peak and the activations against b and s, each a result with
``describe()`` (the sentences it chooses from the numbers) and the figure (matplotlib imported only
when drawing).

Apart from :mod:`labkit.memory.accounting` and :mod:`labkit.memory.prediction` because those are
the teaching code; what is here is presentation. Import it as ``labkit.memory``, which re-exports
what notebooks call.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from labkit import formulas, hardware
from labkit.config import ModelConfig
from labkit.formulas.activations import predicted_activations
from labkit.memory.accounting import (
    MemoryMeasurement,
    PhaseBytes,
    measure_training_memory,
    saved_activation_bytes,
)
from labkit.memory.prediction import StepPeak
from labkit.train import Batch

MODEL_STATES = ("parameters", "gradients", "optimizer state")


@dataclass(frozen=True)
class MemoryAnatomy:
    """One training step's memory in four parts, predicted (formulas) and measured (tensors).

    ``sdpa`` is what :func:`labkit.hardware.sdpa_backend` found: which attention kernel runs
    decides whether the s×s scores are stored, so it is asked, not assumed.
    """

    cfg: ModelConfig
    micro_batch: int
    dtype: str
    states: formulas.MemoryBreakdown
    sdpa: Any
    activation_terms: dict[str, int]
    """Every term of the activations: the blocks (Korthikanti's count, generalised) and what
    that formula leaves out (the final LayerNorm, the loss's log-softmax, statistics, ids)."""
    measured: MemoryMeasurement

    @property
    def sdpa_kind(self) -> str:
        """"flash" for any fused kernel, "materialized" for math (the formulas' name)."""
        return self.sdpa.formula_attention

    @property
    def predicted(self) -> dict[str, float]:
        return {"parameters": self.states.parameters, "gradients": self.states.gradients,
                "optimizer state": self.states.optimizer_state,
                "activations": sum(self.activation_terms.values())}

    @property
    def model_states(self) -> int:
        """Measured bytes of parameters, gradients and optimizer state."""
        return sum(self.measured.as_dict()[part] for part in MODEL_STATES)

    @property
    def model_states_match(self) -> bool:
        """Whether the three model states were measured exactly as predicted."""
        return all(self.measured.as_dict()[p] == self.predicted[p] for p in MODEL_STATES)

    def describe(self) -> str:
        """The kernel SDPA runs, and the four parts: predicted, measured, difference."""
        lines = [f"measured: SDPA runs its {self.sdpa.backend} kernel here "
                 f"(attention={self.sdpa_kind!r} in the formula)"]
        if self.sdpa.warning:
            lines.append(self.sdpa.warning)
        lines.append(f"{'part':<16}{'predicted bytes':>16}{'measured bytes':>16}{'difference':>12}")
        for part, p in self.predicted.items():
            got = self.measured.as_dict()[part]
            lines.append(f"{part:<16}{p:>16,.0f}{got:>16,}{got - p:>+12,.0f}")
        return "\n".join(lines)

    def describe_activations(self) -> str:
        """The lazily created optimizer state, the activations term by term, and the published
        count beside them."""
        m, b, total = self.cfg, self.micro_batch, self.predicted["activations"]
        lines = [f"optimizer state before the first step(): "
                 f"{self.measured.optimizer_state_before_first_step} bytes (AdamW creates its "
                 "moments lazily)", "\nactivations, predicted term by term:"]
        for name, v in self.activation_terms.items():
            lines.append(f"  {name:<44}{v:>14,} B  {v / total:>6.1%}")
        if self.dtype != "float32":  # autocast to a 16-bit dtype over float32 parameters
            e = 2
            all_16_bit = formulas.activation_bytes(
                m.n_layer, m.seq_len, b, m.d_model, m.n_head,
                bytes_per_element=e, dropout=m.dropout > 0, attention=self.sdpa_kind)
            lines.append(f"the layers predicted without autocast's terms (every activation in "
                         f"{e} bytes): {all_16_bit / 2**20:.3f} MiB")
        korthikanti = formulas.activation_bytes(m.n_layer, m.seq_len, b, m.d_model, m.n_head)
        lines.append(f"Korthikanti's published count (16-bit, dropout, stored s×s scores): "
                     f"{korthikanti / 2**20:.3f} MiB")
        if self.measured.cuda_peak is not None:
            lines.append(f"CUDA allocator (measured): activations "
                         f"{self.measured.cuda_activations / 2**20:.2f} MiB, peak "
                         f"{self.measured.cuda_peak / 2**20:.2f} MiB over this first step (no "
                         "AdamW moments in its backward); a steady step's peak is predicted and "
                         "measured below")
        return "\n".join(lines)

    @property
    def activation_gap(self) -> int:
        """Measured minus predicted activation bytes."""
        return self.measured.activations - self.predicted["activations"]

    def describe_reconciliation(self) -> str:
        """Whether the activations closed, and what the per-layer formula alone would miss."""
        gap, measured = self.activation_gap, self.measured.activations
        layers_only = next(iter(self.activation_terms.values()))
        rest = self.predicted["activations"] - layers_only
        outside = dict(list(self.activation_terms.items())[1:])  # the terms after the layers
        largest = max(outside, key=outside.get)
        lines = [f"activations: predicted {self.predicted['activations']:,} B, measured "
                 f"{measured:,} B, difference {gap:+,} B",
                 f"the per-layer formula alone would have missed {measured - layers_only:,} B "
                 f"({(measured - layers_only) / measured:.1%} of the measured bytes); the "
                 f"largest term outside the layers: {largest} "
                 f"({outside[largest] / rest:.0%} of them)"]
        if gap == 0:
            lines.append("Closed to the byte: the layers' formula plus every term it leaves out "
                         "is exactly what autograd saved.")
        elif self.measured.device.startswith("cuda"):
            lines.append(f"Not closed on this GPU: {gap:+,} B that the formulas do not explain, "
                         f"with SDPA's {self.sdpa.backend} kernel (measured above). Unverified "
                         "possibilities: the fused kernel saves tensors the formula does not "
                         "model (a random-number state, a padded log-sum-exp), or this torch's "
                         "autograd saves others; the CPU run of this cell closes to the byte.")
        else:
            lines.append(f"Not closed ({gap:+,} B): this torch saves tensors the formulas do not "
                         "model (a different SDPA kernel, or another version's autograd); look "
                         "at the terms above.")
        return "\n".join(lines)


def anatomy(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, *,
            device: torch.device, dtype: str = "float32") -> MemoryAnatomy:
    """Predict the four parts of one training step's memory for ``model`` (a
    ``labkit.model.GPT``, fp32 parameters, AdamW) and measure them on one real step
    (:func:`measure_training_memory`)."""
    m: ModelConfig = model.cfg
    b = batch[0].shape[0]
    n_params = sum(p.numel() for p in model.parameters())
    states = formulas.memory_breakdown(n_params, param_dtype="float32", optimizer="adamw")
    sdpa = hardware.sdpa_backend(seq_len=m.seq_len, head_dim=m.d_model // m.n_head,
                                 n_head=m.n_head, dtype=dtype, device=device,
                                 dropout_p=m.dropout)
    terms = predicted_activations(m, b, dtype=dtype, attention=sdpa.formula_attention)
    measured = measure_training_memory(model, optimizer, batch, device=device, dtype=dtype)
    return MemoryAnatomy(cfg=m, micro_batch=b, dtype=dtype, states=states, sdpa=sdpa,
                         activation_terms=terms, measured=measured)


def plot_anatomy(result: MemoryAnatomy, ax: Any = None) -> Any:
    """The four parts as bars, predicted beside measured, in MiB. Returns the axes."""
    import matplotlib.pyplot as plt  # here, so that importing labkit stays light

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3))
    predicted, measured = result.predicted, result.measured.as_dict()
    parts = list(predicted)
    y = list(range(len(parts)))
    got = [measured[part] / 2**20 for part in parts]
    ax.barh([v - 0.2 for v in y], [predicted[part] / 2**20 for part in parts], 0.4,
            color="#9ecae1", label="predicted (formula)")
    ax.barh([v + 0.2 for v in y], got, 0.4, color="#3182bd", label="measured (tensors)")
    for yi, value in zip(y, got, strict=True):
        ax.annotate(f"{value:.2f}", (value, yi + 0.2), xytext=(3, 0), textcoords="offset points",
                    va="center", fontsize=8)
    ax.set_yticks(y, parts)
    ax.invert_yaxis()  # the four parts in the table's order, top to bottom
    ax.set(xlabel="MiB", title="memory of one training step: predicted vs measured")
    ax.legend(loc="lower right", fontsize=8)
    plt.tight_layout()
    return ax


def describe_live_bytes(rows: list[PhaseBytes], *, optimizer_state: float, n_params: int) -> str:
    """The table of :func:`live_bytes_over_steps` in MiB, and what step 2's forward holds more
    than step 1's beside ``optimizer_state``, the AdamW moments predicted (8 B × ``n_params``)."""
    lines = [f"{'step':<5}{'after':<16}{'params':>10}{'grads':>10}{'optimizer':>11}"
             f"{'activations':>13}{'total MiB':>11}   (measured, tensor accounting)"]
    for r in rows:
        lines.append(f"{r.step:<5}{r.phase:<16}" + "".join(f"{v / 2**20:>{w}.3f}" for v, w in (
            (r.parameters, 10), (r.gradients, 10), (r.optimizer_state, 11),
            (r.activations, 13), (r.total, 11))))
    at = {(r.step, r.phase): r for r in rows}
    grown = at[2, "forward"].total - at[1, "forward"].total
    lines.append(f"\nafter the forward: step 2 holds {grown:,} B more than step 1; the AdamW "
                 f"moments are {optimizer_state:,.0f} B (8 B × {n_params:,} parameters)")
    peaks = [r.cuda_step_peak for r in rows if r.cuda_step_peak is not None]
    if len(peaks) >= 2:
        lines.append(f"CUDA allocator peak (measured): step 1 {peaks[0] / 2**20:.2f} MiB, step 2 "
                     f"{peaks[1] / 2**20:.2f} MiB, difference "
                     f"{(peaks[1] - peaks[0]) / 2**20:+.2f} MiB (optimizer state: "
                     f"{optimizer_state / 2**20:.2f} MiB; the allocator also holds the batch, "
                     "temporaries and the optimizer's own scratch)")
    return "\n".join(lines)


@dataclass(frozen=True)
class PeakCheck:
    """A training step's peak: predicted (:func:`predicted_step_peak`) against measured."""

    predicted: StepPeak
    measured: int
    """On a GPU: max_memory_allocated over the step; on a CPU: live tensor bytes."""
    cuda: bool
    sdpa_backend: str
    reserved: int | None = None
    """On a GPU: max_memory_reserved (whole process) at its peak in this step."""

    @property
    def predicted_bytes(self) -> int:
        """What the measurement counts: each tensor rounded up to 512 B on a GPU."""
        return self.predicted.cuda_bytes if self.cuda else self.predicted.bytes

    @property
    def gap(self) -> int:
        return self.measured - self.predicted_bytes

    def describe(self) -> str:
        predicted, gap, on_gpu = self.predicted_bytes, self.gap, self.cuda
        lines = [f"predicted: the peak of one training step is at {self.predicted.moment}"]
        for name, v in self.predicted.as_dict(cuda=on_gpu).items():
            lines.append(f"  {name:<62}{v:>13,} B {v / predicted:>6.1%}")
        how = ("measured (CUDA allocator, max_memory_allocated over the step)" if on_gpu else
               "measured (live tensor bytes, CPU; the CUDA allocator's own peak is measured on a "
               "GPU)")
        lines.append(f"\npredicted {predicted:,} B ({predicted / 2**20:.2f} MiB)"
                     + (", each tensor rounded up to 512 B" if on_gpu else ""))
        lines.append(f"{how}: {self.measured:,} B ({self.measured / 2**20:.2f} MiB)")
        lines.append(f"difference: {gap:+,} B ({gap / predicted:+.2%})")
        if gap == 0:
            lines.append("Closed to the byte: at the loss's backward exactly the predicted "
                         "tensors are alive, and no moment of the step holds more.")
        elif on_gpu and 0 < gap <= 0.02 * predicted:
            lines.append(f"Within {gap / predicted:.1%}, above the prediction: the allocator also "
                         "counts what no tensor accounting sees, such as scratch memory a kernel "
                         "allocates inside one op (the attention backward's, cuBLAS workspaces "
                         "taken for the first time), or a cached block larger than a request "
                         "that it did not split and counts whole. Unverified: this cell does not "
                         "say which.")
        elif on_gpu:
            lines.append(f"Not closed on this GPU ({gap:+,} B): SDPA's {self.sdpa_backend} kernel "
                         "or the CUDA autocast may save other tensors than the CPU's (the "
                         "activations above show whether they closed), or the peak falls at "
                         "another moment. Unverified possibilities; the CPU run of this cell "
                         "closes to the byte at the presets' batch sizes.")
        elif gap > 0:
            lines.append("Not closed: the step peaks at another moment, above this one. With few "
                         "sequences a batch's activations are small beside the parameters, and "
                         "the peak moves later: into the backward of the last block (the head's "
                         "gradients have arrived) or the optimizer step (16 bytes per parameter "
                         "and its temporaries).")
        else:
            lines.append("Not closed: fewer bytes were alive than predicted, so this torch saves "
                         "or keeps other tensors than the prediction lists; compare the "
                         "activations above.")
        if on_gpu:
            reserved = self.reserved if self.reserved is not None else 0
            lines.append(f"\nreserved (measured, whole process): {reserved / 2**20:,.2f} MiB at "
                         "its peak in this step. The caching allocator takes memory from the "
                         "driver in segments (2 MiB for requests up to 1 MiB, 20 MiB for "
                         "requests up to 10 MiB, larger ones rounded up to 2 MiB) and keeps "
                         "freed blocks for reuse, so reserved exceeds allocated; it also holds "
                         "what earlier cells freed. nvidia-smi shows reserved plus the CUDA "
                         "context.")
        else:
            p = self.predicted
            lines.append(f"\nOn a GPU the allocator would count {p.cuda_bytes:,} B (predicted: "
                         f"each tensor rounded up to a 512-byte block, "
                         f"{p.cuda_bytes - p.bytes:+,} B), and reserve more: it takes memory "
                         "from the driver in 2 MiB and 20 MiB segments and keeps freed blocks "
                         "cached.")
        return "\n".join(lines)


@dataclass(frozen=True)
class ActivationSweep:
    """Activation bytes against batch ``b`` and sequence length ``s``, with PyTorch's math
    attention kernel (the s×s scores stored): {(b, s): (predicted, measured)}."""

    cfg: ModelConfig
    points: dict[tuple[int, int], tuple[int, int]]

    @property
    def closed(self) -> bool:
        return all(p == got for p, got in self.points.values())

    def describe(self) -> str:
        m, s_full = self.cfg, self.cfg.seq_len
        lines = [f"{'b':>3}{'s':>6}{'predicted B':>14}{'measured B':>14}{'difference':>12}"
                 f"{'s² term':>10}"]
        for (b_, s_), (p, got) in sorted(self.points.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            quadratic = m.n_layer * m.n_head * s_ * s_ * b_ * 4
            lines.append(f"{b_:>3}{s_:>6}{p:>14,}{got:>14,}{got - p:>+12,}{quadratic / got:>10.0%}")
        at = {k: v[1] for k, v in self.points.items()}
        by_b = [at[2, s_full] - at[1, s_full], at[4, s_full] - at[2, s_full]]
        lines.append(f"\nbatch: 1 -> 2 adds {by_b[0]:,} B, 2 -> 4 adds {by_b[1]:,} B (linear: the "
                     f"second is {by_b[1] / by_b[0]:.3f}x the first, 2 for a straight line)")
        gammas = [(at[2, 2 * x] - 2 * at[2, x] + 4) / (2 * x * x)
                  for x in (s_full // 4, s_full // 2)]
        lines.append(f"sequence: quadratic coefficient from s/4 -> s/2: {gammas[0]:,.1f} B, from "
                     f"s/2 -> s: {gammas[1]:,.1f} B; predicted L·a·b·4 = "
                     f"{m.n_layer * m.n_head * 2 * 4} B")
        lines.append("Every point closed to the byte." if self.closed else
                     "Not every point closed: this torch's math kernel saves other tensors than "
                     "the formula models (see the differences).")
        return "\n".join(lines)


def activation_sweep(model: nn.Module, points: Iterable[tuple[int, int]], *,
                     device: torch.device) -> ActivationSweep:
    """Predict (``attention="materialized"``) and measure the saved activation bytes of
    ``model`` (a ``labkit.model.GPT``) at each (batch, sequence length) in ``points``, under
    PyTorch's math attention kernel. ``describe()`` reads the points (1, s), (2, s), (4, s),
    (2, s/4) and (2, s/2), s the model's seq_len."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    m: ModelConfig = model.cfg

    def saved(b_: int, s_: int) -> int:
        x = torch.randint(0, m.vocab_size, (b_, s_), generator=torch.Generator().manual_seed(0))
        with sdpa_kernel(SDPBackend.MATH):
            return saved_activation_bytes(model, (x, torch.roll(x, -1, 1)), device=device)

    def predicted(b_: int, s_: int) -> int:
        return sum(predicted_activations(m, b_, seq_len=s_, attention="materialized").values())

    return ActivationSweep(cfg=m, points={(b_, s_): (predicted(b_, s_), saved(b_, s_))
                                          for b_, s_ in points})
