"""Training runs compared across precisions: copies of one model trained on the same batches,
the gradients they cast, and the sentences their losses choose (notebook 04, sections 2 to 5).

Apart from the other tools of :mod:`labkit.precision` because these train: they call
:func:`labkit.train.train` on copies of one model and compare what the runs end at, against a
yardstick measured the same way (the fp32 run on other data orders). Every verdict sentence is
chosen here from the measured numbers; the notebook only prints it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from labkit import train as trainer
from labkit.data import Splits
from labkit.precision.formats import FORMATS, spacing
from labkit.precision.scaling import ManualScaler
from labkit.precision.underflow import underflow_fraction

Run = tuple[nn.Module, trainer.History]
"""What :class:`CopyTrainer` returns: the trained copy and its history."""


def late_loss(history: trainer.History) -> float:
    """Mean training loss over the last fifth of the run: one batch's loss is too noisy."""
    tail = history.loss[-max(3, len(history.loss) // 5):]
    return sum(tail) / len(tail)


@dataclass(frozen=True)
class CopyTrainer:
    """Trains copies of ``initial`` with labkit's training loop (same batches, same seed).

    Calling it returns ``(model, history)`` and prints one line with the final loss.
    """

    initial: nn.Module
    cfg: Any
    """The notebook's RunConfig; each run replaces its dtype (and clipping, eps, seed)."""
    splits: Splits
    device: torch.device

    def __call__(self, dtype: str, scaler: Any = "auto", shrink: float = 1.0,
                 seed: int | None = None, cast: torch.dtype | None = None,
                 validate: bool = True) -> Run:
        """Train a copy in ``dtype``. ``cast`` stores the copy's parameters in another dtype (no
        master copy: pure 16-bit training). ``shrink`` multiplies the training loss (section 2's
        experiment), and with it the clipping norm and AdamW's eps; the history's losses are
        divided by it again, so every run reports the true loss. ``validate=False`` skips the
        validation loss (runs compared only by their training loss)."""
        cfg = self.cfg
        model = copy.deepcopy(self.initial) if cast is None else copy.deepcopy(self.initial).to(cast)
        # Clipping and AdamW's eps act on the gradients' size: scaled with the loss, an fp32 run
        # with the loss × shrink takes the same steps as one without (up to rounding).
        clip = None if cfg.train.grad_clip is None else cfg.train.grad_clip * shrink
        run_cfg = cfg.replace(dtype=dtype, grad_clip=clip, adam_eps=cfg.train.adam_eps * shrink,
                              **({} if seed is None else {"seed": seed}))
        hook = model.register_forward_hook(
            lambda module, args, out: (out[0], out[1] * shrink) if module.training else out)
        try:
            history = trainer.train(model, run_cfg, self.splits.train, device=self.device,
                                    scaler=scaler, val_data=self.splits.val if validate else None)
        finally:
            hook.remove()
        history.loss = [loss / shrink for loss in history.loss]
        how = "" if scaler == "auto" else " without a loss scaler" if scaler is None else \
            f" with {type(scaler).__name__}"
        how += "" if cast is None else f", parameters stored in {str(cast).removeprefix('torch.')}"
        shrunk_by = f", loss × 2^{round(math.log2(shrink))}" if shrink != 1 else ""
        print(f"  trained {dtype}{how}{shrunk_by}: final loss {history.loss[-1]:.3f}")
        return model, history


# ----------------------------------------------------------------------------------------------
# Gradients cast to fp16 (section 2)


@dataclass(frozen=True)
class Gradients:
    """fp32 gradients of a model at several moments (name → tensor, on the CPU), and what a cast
    to fp16 does to them. ``grads[moment]`` is the moment's name → tensor dict."""

    by_moment: Mapping[str, Mapping[str, torch.Tensor]]
    n_layer: int

    def __getitem__(self, moment: str) -> Mapping[str, torch.Tensor]:
        return self.by_moment[moment]

    def every(self, moment: str) -> torch.Tensor:
        """All the moment's gradient values in one flat tensor."""
        return torch.cat([v.flatten() for v in self.by_moment[moment].values()])

    def roles(self, moment: str) -> list[str]:
        """The parameter roles of a block ("attn.q.weight"...), in model order."""
        g = self.by_moment[moment]
        return list(dict.fromkeys(n.split(".", 2)[2] for n in g if n.startswith("blocks.")))

    def describe(self) -> str:
        """Per moment: the share of all gradient values fp16 zeroes, makes subnormal, and the
        share bf16 would zero."""
        n_params = sum(v.numel() for v in next(iter(self.by_moment.values())).values())
        lines = [f"\nfp32 gradients of all {n_params:,} parameters, cast to fp16 (measured):"]
        for moment in self.by_moment:
            every = self.every(moment)
            f = {kind: underflow_fraction(every, "fp16", kind) for kind in ("zero", "subnormal")}
            lines.append(f"  {moment:<16} become 0: {f['zero']:7.2%}   become subnormal: "
                         f"{f['subnormal']:7.2%}   bf16 would zero "
                         f"{underflow_fraction(every, 'bf16'):.2%}")
        return "\n".join(lines)

    def describe_roles(self, moment: str) -> str:
        """The roles whose largest gradient, in every layer, lies below fp16's smallest
        subnormal (empty when there is none)."""
        g = self.by_moment[moment]
        lines = []
        for role in self.roles(moment):
            worst = max(g[f"blocks.{i}.{role}"].abs().max().item() for i in range(self.n_layer))
            if worst < FORMATS["fp16"].smallest_subnormal:
                lines.append(f"{role}: the largest gradient in any layer is {worst:.2g}, below "
                             "fp16's smallest subnormal")
        return "\n".join(lines)


def fp32_gradients(models: Mapping[str, nn.Module], batch: tuple[torch.Tensor, torch.Tensor],
                   device: torch.device, n_layer: int) -> Gradients:
    """One fp32 forward and backward of a copy of each model on ``batch``; the gradients, per
    moment (the mapping's keys)."""
    x, y = batch
    by_moment = {}
    for moment, source in models.items():
        probe = copy.deepcopy(source).to(device)
        probe(x, y)[1].backward()
        by_moment[moment] = {name: p.grad.detach().float().cpu()
                             for name, p in probe.named_parameters()}
    return Gradients(by_moment, n_layer)


def plot_underflow_map(grads: Gradients, moment: str, ax: Any = None) -> Any:
    """Per role and layer, the share of the gradient's values that become 0 and subnormal in
    fp16 (two heat maps with the shares written in). ``ax``: a pair of axes, or None."""
    import matplotlib.pyplot as plt  # here, so that importing labkit stays light

    g, roles, n_layer = grads[moment], grads.roles(moment), grads.n_layer
    fractions = {kind: torch.full((len(roles), n_layer), float("nan"))
                 for kind in ("zero", "subnormal")}
    for name, value in g.items():
        if name.startswith("blocks."):
            _, layer, role = name.split(".", 2)
            for kind, table in fractions.items():
                table[roles.index(role), int(layer)] = underflow_fraction(value, "fp16", kind)
    if ax is None:
        fig, ax = plt.subplots(1, 2, figsize=(8, 0.28 * len(roles) + 1.4), sharey=True)
    layers = range(n_layer)
    for a, (kind, table) in zip(ax, fractions.items(), strict=True):
        a.imshow(table.numpy(), vmin=0, vmax=1, cmap="Reds", aspect="auto")
        for r in range(len(roles)):
            for c in layers:
                v = table[r, c].item()
                a.text(c, r, f"{v:.0%}", ha="center", va="center", fontsize=7,
                       color="white" if v > 0.6 else "black")
        a.set(xlabel="layer", title=f"share that becomes {kind} in fp16", xticks=list(layers))
    ax[0].set_yticks(range(len(roles)), roles, fontsize=8)
    fig = ax[0].figure
    fig.suptitle(f"fp32 gradients of the GPT {moment}, cast to fp16 (measured)", fontsize=10)
    fig.tight_layout()
    return ax


def plot_gradient_histogram(grads: Gradients, moment: str, ax: Any = None) -> Any:
    """Histogram of log2 |gradient| of every value, with fp16's smallest normal, smallest
    subnormal and the rounding-to-0 threshold marked."""
    import matplotlib.pyplot as plt

    every = grads.every(moment)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 2.8))
    ax.hist(every[every != 0].abs().log2().tolist(), bins=60, color="#9ecae1")
    for value, text, style in ((-14, "fp16 smallest normal 2^-14", "-"),
                               (-24, "fp16 smallest subnormal 2^-24", ":"),
                               (-25, "half of it: below, rounds to 0", "--")):
        ax.axvline(value, c="tab:red", ls=style, lw=1)
        ax.text(value, 0.95, f" {text}", transform=ax.get_xaxis_transform(), rotation=90,
                va="top", fontsize=7)
    ax.set(xlabel="log2 |gradient| (measured, fp32)", ylabel="number of values",
           title="every gradient value; left of the dashed line, fp16 rounds to 0")
    return ax


# ----------------------------------------------------------------------------------------------
# fp16 with and without a scaler, against the data-order yardstick (section 2)


@dataclass(frozen=True)
class ScalerComparison:
    """The late losses of the runs so far, the yardstick (the fp32 run's late loss on three data
    orders) and fp16's gap without a scaler against with one."""

    late: Mapping[str, float]
    orders: tuple[float, ...]

    @property
    def noise(self) -> float:
        """How far apart three fp32 runs end that differ only in their batches' order."""
        return max(self.orders) - min(self.orders)

    @property
    def gap(self) -> float:
        return self.late["fp16, no scaler"] - self.late["fp16 + scaler"]

    def describe(self) -> str:
        lines = ["\nlate training loss (mean of the last fifth of the steps), measured: "
                 + ", ".join(f"{k} {v:.4f}" for k, v in self.late.items()),
                 f"yardstick: three data orders in fp32 span {self.noise:.4f} "
                 f"({', '.join(f'{v:.4f}' for v in self.orders)})"]
        if abs(self.gap) <= self.noise:
            lines.append(f"fp16 without a scaler vs with: {self.gap:+.4f}, within the data-order "
                         "spread: at this gradient scale the scaler changes nothing we can measure")
        else:
            lines.append(f"fp16 without a scaler vs with: {self.gap:+.4f}, larger than the "
                         "data-order spread")
        return "\n".join(lines)


def compare_scaler(runs: Mapping[str, Run], other_orders: Sequence[trainer.History]
                   ) -> ScalerComparison:
    """``runs`` holds "fp32", "fp16 + scaler" and "fp16, no scaler"; ``other_orders`` the fp32
    run's histories on other data orders."""
    return ScalerComparison(
        late={k: late_loss(h) for k, (_, h) in runs.items()},
        orders=tuple(late_loss(h) for h in (runs["fp32"][1], *other_orders)))


# ----------------------------------------------------------------------------------------------
# The loss shrunk: fp16 without loss scaling fails (section 2)

SHRINK_RUNS = (("fp32", "float32", "auto"), ("fp16 + scaler", "float16", "auto"),
               ("fp16, no scaler", "float16", None))
"""The three runs trained at each shrink: (label, dtype, scaler)."""


def activation_gradients(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                         device: torch.device) -> torch.Tensor:
    """The gradient each Linear layer's output receives, recorded in one fp32 backward of a
    copy of ``model`` (up to 2^18 values each), flat on the CPU: what the shrink emulation
    shrinks in the fp16 part of a backward."""
    found = []
    probe = copy.deepcopy(model).to(device)
    handles = [m.register_full_backward_hook(lambda m, g_in, g_out: found.append(
        g_out[0].detach().flatten()[::max(1, g_out[0].numel() // 2**18)].float().cpu()))
        for m in probe.modules() if isinstance(m, nn.Linear)]
    try:
        probe(*batch)[1].backward()
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat(found)


@dataclass(frozen=True)
class ShrinkResult:
    """The shrink experiment: per k, three runs with the loss × 2^-k, judged against fp32 × 1
    and the data-order yardstick; and the activation gradients a shrink zeroes in fp16."""

    shrunk: Mapping[tuple[int, str], trainer.History]
    baseline: trainer.History
    """The fp32 run with the loss × 1."""
    noise: float
    act_grads: torch.Tensor
    underflow: Callable[[torch.Tensor], float]
    """The fp16 underflow fraction used (the learner's function of exercise 1)."""
    whose: str
    """Whose underflow function that is, for the printed line."""

    @property
    def ks(self) -> list[int]:
        return list(dict.fromkeys(k for k, _ in self.shrunk))

    def describe(self) -> str:
        lost = self.underflow
        lines = ["activation gradients that fp16 zeroes, by shrink (one fp32 backward, "
                 "measured): " + ", ".join(f"× 2^-{k}: {lost(self.act_grads * 2.0**-k):.1%}"
                                           for k in range(0, 17, 4))]
        noise = self.noise
        for k in self.ks:
            f32, scaled, unscaled = (late_loss(self.shrunk[k, label]) for label, _, _ in SHRINK_RUNS)
            control = abs(f32 - late_loss(self.baseline))
            lines.append(f"k = {k:>2}: control: fp32 with the loss × 2^-{k} ends {control:.4f} "
                         "from fp32 × 1 "
                         + ("(within the yardstick: the shrink itself changes nothing)"
                            if control <= noise else
                            "(beyond the yardstick: the emulation is not exact here; compare "
                            "within k)"))
            gap = unscaled - scaled
            said = ("fp16 without a scaler falls behind" if gap > 3 * noise else
                    "fp16 without a scaler keeps up" if abs(gap) <= noise else
                    "fp16 without a scaler ends ahead" if gap < -3 * noise else
                    "a difference, but within 3× the data-order spread: not clear")
            lines.append(f"        late loss fp32 {f32:.3f}, fp16 + scaler {scaled:.3f}, fp16 "
                         f"without {unscaled:.3f} → {said} (gap {gap:+.3f})")
            lines.append(f"        activation gradients (Linear outputs, one fp32 backward) × "
                         f"2^-{k} that fp16 zeroes: {lost(self.act_grads * 2.0**-k):.1%}, against "
                         f"{lost(self.act_grads):.1%} at × 1 ({self.whose})")
        return "\n".join(lines)


def plot_shrink(result: ShrinkResult, ax: Any = None) -> Any:
    """Training loss of the three runs per shrink, and fp32 × 1 in grey."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.4))
    for i, k in enumerate(result.ks):
        for (label, _, _), style in zip(SHRINK_RUNS, (":", "--", "-"), strict=True):
            h = result.shrunk[k, label]
            ax.plot(h.steps, h.loss, style, c=f"C{i}", label=f"{label}, loss × 2^-{k}")
    ax.plot(result.baseline.steps, result.baseline.loss, c="grey", lw=0.8, label="fp32, loss × 1")
    ax.set(xlabel="optimizer step", ylabel="training loss (nats, true scale)",
           title="fp16 without loss scaling, gradients made smaller (measured)")
    ax.legend(fontsize=7, ncol=2)
    return ax


# ----------------------------------------------------------------------------------------------
# Loss curves side by side (section 5)


@dataclass(frozen=True)
class LateLosses:
    """Each run's late training loss against fp32's, judged by the yardstick, and its final
    validation loss."""

    runs: Mapping[str, Run]
    noise: float

    def describe(self) -> str:
        base = late_loss(self.runs["fp32"][1])
        lines = ["measured: late training loss (mean of the last fifth), its difference from fp32 "
                 f"against the yardstick of three data orders ({self.noise:.4f}), and the final "
                 "validation loss:"]
        for label, (_, h) in self.runs.items():
            diff = late_loss(h) - base
            judged = "" if label == "fp32" else (
                "within the yardstick" if abs(diff) <= self.noise else "beyond the yardstick")
            lines.append(f"  {label:<16} {late_loss(h):.4f} ({diff:+.4f}) {judged:<21} "
                         f"validation {h.val_loss[-1]:.4f}")
        return "\n".join(lines)


def plot_loss_curves(runs: Mapping[str, Run], ax: Any = None) -> Any:
    """Training loss (left) and validation loss (right) of every run. ``ax``: a pair, or None."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(1, 2, figsize=(11, 3.5), sharey=True)
    ax_train, ax_val = ax
    for i, (label, (_, h)) in enumerate(runs.items()):
        ax_train.plot(h.steps, h.loss, c=f"C{i}", lw=1, label=label)
        ax_val.plot(h.val_steps, h.val_loss, "o-", c=f"C{i}", label=label)
    ax_train.set(xlabel="optimizer step", ylabel="cross-entropy (nats)",
                 title="training loss (measured)")
    ax_val.set(xlabel="optimizer step", title="validation loss (measured)")
    ax_val.legend(fontsize=8)
    return ax


# ----------------------------------------------------------------------------------------------
# Without the master copy: pure bf16 (section 5)


@dataclass(frozen=True)
class GainPrediction:
    """Which way a bf16 LayerNorm gain of 1.0 can move under steps of at most the peak lr."""

    lr: float

    @property
    def gaps(self) -> tuple[float, float]:
        """The smallest step up and down that a bf16 weight of 1.0 does not lose."""
        up, down = (spacing(1.0, "bf16", toward=t) / 2 for t in ("larger", "smaller"))
        return up, down

    @property
    def can_move(self) -> str:
        up_gap, down_gap = self.gaps
        return ("neither way" if self.lr <= down_gap else "down but not up" if self.lr <= up_gap
                else "both ways")

    def describe(self) -> str:
        up_gap, down_gap = self.gaps
        return (f"predicted: on a bf16 weight of 1.0 a step up is lost unless it exceeds "
                f"{up_gap:.4f}, a step down unless it exceeds {down_gap:.4f}; AdamW's steps are "
                f"at most about the peak lr {self.lr:g}, so the LayerNorm gains can move "
                f"{self.can_move}")


PARAMETER_KINDS: dict[str, Callable[[str], bool]] = {
    "LayerNorm gains": lambda n: "ln_" in n and n.endswith("weight"),
    "LayerNorm biases": lambda n: "ln_" in n and n.endswith("bias"),
    "matrices": lambda n: n.endswith("weight") and "ln_" not in n,
}
"""The kinds of parameter the pure-bf16 comparison counts, by name."""


@dataclass(frozen=True)
class StuckParameters:
    """Per run: the share of each kind of parameter still exactly at its initial value, the
    LayerNorm gains that moved down and up, and the last run's split against the prediction."""

    stuck: Mapping[str, Mapping[str, float]]
    moved: Mapping[str, tuple[int, int, int]]
    """Per run: LayerNorm gains that moved (down, up, of how many)."""
    late: Mapping[str, float]
    base: float
    """fp32's late loss."""
    steps: int
    prediction: GainPrediction

    def describe(self) -> str:
        lines = ["measured: share of parameters still exactly at their initial value after "
                 f"{self.steps} steps"]
        for label, stuck in self.stuck.items():
            late = self.late[label]
            lines.append(f"  {label:<28} " + ", ".join(f"{k} {v:.0%}" for k, v in stuck.items())
                         + f"; late loss {late:.4f} ({late - self.base:+.4f} vs fp32)")
            down, up, n = self.moved[label]
            lines.append(f"  {'':<28} LayerNorm gains that moved: {down} down, {up} up, of {n}")
        # The pure-bf16 run's split (the last) against the prediction:
        down, up, _ = list(self.moved.values())[-1]
        can_move = self.prediction.can_move
        if (up > 0 and can_move != "both ways") or (down > 0 and can_move == "neither way"):
            said = "does not match the prediction: some step was larger than the peak lr"
        elif up == down == 0 and can_move != "neither way":
            said = "cannot be judged: no gain moved, so no step passed a threshold in this run"
        else:
            said = "agrees with the prediction"
        lines.append(f"the pure-bf16 split {said} (predicted: the gains can move {can_move})")
        return "\n".join(lines)


def stuck_parameters(runs: Mapping[str, Run], initial: nn.Module, prediction: GainPrediction,
                     baseline: trainer.History) -> StuckParameters:
    """Compare each run's parameters with ``initial``'s (the pure-bf16 run last);
    ``baseline`` is the fp32 run, for the late loss."""
    stuck, moved, late = {}, {}, {}
    for label, (model, history) in runs.items():
        stuck[label] = {}
        for kind, test in PARAMETER_KINDS.items():
            pairs = [(p, p0) for (n, p), (_, p0) in zip(model.named_parameters(),
                                                        initial.named_parameters(), strict=True)
                     if test(n)]
            same = sum(int((p.detach().float().cpu() == p0.to(p.dtype).float()).sum())
                       for p, p0 in pairs)
            stuck[label][kind] = same / sum(p.numel() for p, _ in pairs)
        gains = torch.cat([p.detach().float().cpu().flatten() for n, p in model.named_parameters()
                           if PARAMETER_KINDS["LayerNorm gains"](n)])  # all start at exactly 1.0
        moved[label] = (int((gains < 1).sum()), int((gains > 1).sum()), gains.numel())
        late[label] = late_loss(history)
    return StuckParameters(stuck, moved, late, late_loss(baseline), len(baseline.loss), prediction)


# ----------------------------------------------------------------------------------------------
# Dynamic loss scaling, step by step (section 3)


@dataclass(frozen=True)
class ScalerRace:
    """One fp16 run with :class:`~labkit.precision.ManualScaler` and one with
    ``torch.amp.GradScaler``, same settings, same weights and batches."""

    settings: Mapping[str, float]
    history: tuple[Any, ...]
    """ManualScaler's ScalerStep per step."""
    final_scale: float
    torch_scales: tuple[float, ...]
    """GradScaler's scale after each step's update()."""
    weight_gap: float
    """Largest difference between the two runs' final weights."""
    on_gpu: bool

    @property
    def scales(self) -> list[float]:
        """The scale each step used."""
        return [h.scale for h in self.history]

    @property
    def skipped(self) -> list[int]:
        return [h.step for h in self.history if h.skipped]

    def describe(self) -> str:
        """Skipped steps, and whether the two scalers chose the same scale after every step."""
        scales, skipped = self.scales, self.skipped
        after = [*scales[1:], self.final_scale]  # GradScaler's get_scale() is after update()
        lines = [f"{len(scales)} fp16 steps, measured: {len(skipped)} skipped (inf/NaN found) at "
                 f"steps {skipped or 'none'}"]
        if after == list(self.torch_scales):
            lines.append(
                f"ManualScaler and torch.amp.GradScaler chose the same scale after every step; "
                f"their weights differ by at most {self.weight_gap:.3g} at the end (0: "
                "bit-identical; on a GPU some backward kernels sum in a different order from run "
                "to run)")
        else:
            first_diff = next(i for i, (a, b) in enumerate(zip(after, self.torch_scales,
                                                               strict=True)) if a != b) + 1
            lines.append(
                f"ManualScaler and GradScaler chose different scales from step {first_diff}: "
                + ("on a GPU, nondeterministic backward kernels can make the two runs' gradients, "
                   "and so their overflows, differ" if self.on_gpu else "on a CPU that is a bug "
                   "in labkit.precision, please report it"))
        return "\n".join(lines)

    def describe_backoffs(self) -> str:
        """The run's own numbers: where the scale grew to, the first overflow and what it says
        about the gradient, what the skipped steps cost."""
        scales, skipped = self.scales, self.skipped
        fp16_max = FORMATS["fp16"].max
        if not skipped:
            return (f"No step overflowed: the scale only grew, to "
                    f"2^{round(math.log2(self.final_scale))}. Run more steps "
                    "(run['scale_steps']) to see a backoff.")
        first = skipped[0]
        s_first = scales[first - 1]
        at_default = [s for s in skipped if scales[s - 1] <= self.settings["init_scale"]]
        return "\n".join([
            f"The scale grew ×2 after every {self.settings['growth_interval']} clean steps, from "
            f"2^16 to 2^{round(math.log2(s_first))} at step {first}, where the backward "
            f"overflowed: some scaled activation gradient exceeded fp16's {fp16_max:,.0f}, so "
            f"some true gradient was at least {fp16_max / s_first:.3g}. The step was skipped and "
            f"the scale halved to 2^{round(math.log2(s_first)) - 1}.",
            f"Skipped steps cost {len(skipped)} of {len(scales)} updates "
            f"({len(skipped) / len(scales):.0%}); the scale ended at "
            f"2^{round(math.log2(self.final_scale))}.",
            f"Steps that overflowed at or below GradScaler's default initial scale 2^16: "
            f"{at_default or 'none'}"])


def race_scalers(initial: nn.Module, cfg: Any, splits: Splits, device: torch.device,
                 settings: Mapping[str, float]) -> ScalerRace:
    """Train two fp16 copies of ``initial`` (``cfg`` as given, dtype float16), one with a
    ManualScaler and one with torch.amp.GradScaler built from the same ``settings``."""
    scaler = ManualScaler(**settings)
    torch_scaler = torch.amp.GradScaler(device.type, **settings)
    torch_scales: list[float] = []
    models = {}
    for name, s, on_step in (("ManualScaler", scaler, None),
                             ("GradScaler", torch_scaler,
                              lambda step, stats: torch_scales.append(torch_scaler.get_scale()))):
        models[name] = copy.deepcopy(initial)
        # GradScaler reports the scale after update(); the history records the one the step used.
        trainer.train(models[name], cfg.replace(dtype="float16"), splits.train, device=device,
                      scaler=s, on_step=on_step)
    weight_gap = max((a - b).abs().max().item() for a, b in zip(
        models["ManualScaler"].parameters(), models["GradScaler"].parameters(), strict=True))
    return ScalerRace(dict(settings), tuple(scaler.history), scaler.get_scale(),
                      tuple(torch_scales), weight_gap, device.type == "cuda")


def plot_scale(race: ScalerRace, ax: Any = None) -> Any:
    """log2 of the scale per step, with the skipped steps marked."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3))
    scales, skipped = race.scales, race.skipped
    steps = [h.step for h in race.history]
    ax.step(steps, [math.log2(s) for s in scales], where="post",
            label="log2 of the scale (measured)")
    ax.plot(skipped, [math.log2(scales[s - 1]) for s in skipped], "x", c="tab:red", ms=8,
            label="step skipped: a gradient overflowed")
    ax.set(xlabel="optimizer step", ylabel="log2 scale",
           title="dynamic loss scaling in a real fp16 run (growth_interval = "
                 f"{race.settings['growth_interval']})")
    ax.legend(fontsize=8)
    return ax
