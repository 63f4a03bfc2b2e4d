"""What notebook 03d prints and draws about plans: the published cases summed up, the ranking's
sensitivity, a chooser's picks, this machine's link fitted and its DP term held against a
measured all-reduce.

Apart from :mod:`labkit.planner.search` and :mod:`labkit.planner.published` because those
model; this module only words and draws what they return (and, for this machine, the link
measured by ``labkit.workers.allreduce``, whose result it reads as a plain mapping).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from labkit import formulas
from labkit.planner.published import Published
from labkit.planner.search import Plan, plan
from labkit.planner.specs import ModelSpec

# --- the published cases ------------------------------------------------------------------------


def describe_published(cases: Sequence[Published], plans: Mapping[str, Plan], mfu: float) -> str:
    """The assumed MFU; each case's report (its top two layouts and where the published one
    ranks); whether every published layout and top-two choice keeps TP at one node's GPUs; and
    the planner's first choice for the first case (all modelled)."""
    lines = [f"assumed: compute runs at MFU {mfu:.0%} of the published dense bf16 peak "
             "(an assumption, not a measurement)", ""]  # fmt: skip
    for case in cases:  # the fastest fitting variant of the best two layouts, and the published one
        lines += [case.report(plans[case.name], top=2), ""]
    tops = {c.name: plans[c.name].best_per_shape()[:2] for c in cases}
    node_tp = all(c.shape["tp"] == c.cluster.gpus_per_node and tops[c.name]
                  and all(p.layout.tp == c.cluster.gpus_per_node for p in tops[c.name]) for c in cases)  # fmt: skip
    lines.append("every published layout and the planner's top two keep TP at one node's GPUs" if node_tp
                 else "NOT every published layout or top-two choice keeps TP at one node's GPUs: "
                 "read the tables")  # fmt: skip
    if cases and tops[cases[0].name]:
        first = tops[cases[0].name][0].layout
        lines.append(f"the planner's first choice for {cases[0].name}: " + (
            f"no pipeline, ZeRO-{first.zero} over {first.dp:,} replicas" if first.pp == 1 else
            f"a pipeline of {first.pp} stages, ZeRO-{first.zero} over {first.dp:,} replicas"))
    return "\n".join(lines)


def plot_layouts(plans: Mapping[str, Plan], cases: Sequence[Published], axes: Any = None) -> Any:
    """One panel per case: every valid layout's predicted memory per GPU against its step
    time, fitting or not, the published layout's variants, the first choice and the device's
    memory. Returns the Axes."""
    import matplotlib.pyplot as plt  # lazy: importing labkit must stay cheap

    if axes is None:
        fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 4.2), squeeze=False)
        axes = axes[0]
    for ax, case in zip(axes, cases, strict=True):
        preds, cap = plans[case.name].predictions, case.cluster.device.memory_bytes / 1e9
        for fits, marker, color, label in ((True, "o", "tab:blue", "fits"),
                                           (False, "x", "tab:gray", "does not fit")):
            sel = [p for p in preds if p.fits is fits]
            ax.scatter([p.step_s for p in sel], [p.memory["total"] / 1e9 for p in sel], s=14,
                       marker=marker, color=color, alpha=0.6, label=label)
        pub = [p for p in preds if p.layout.name == case.shape_name]
        ax.scatter([p.step_s for p in pub], [p.memory["total"] / 1e9 for p in pub], s=90, marker="*",
                   color="tab:red", zorder=3, label="published layout (its variants)")
        best = plans[case.name].best_per_shape()[0]
        ax.scatter([best.step_s], [best.memory["total"] / 1e9], s=80, facecolors="none",
                   edgecolors="black", zorder=4, label="planner's first choice")
        ax.axhline(cap, color="tab:red", lw=1, ls="--", label="published device memory")
        ax.set(ylim=(0, min(ax.get_ylim()[1], 4 * cap)), title=f"{case.name}: {len(preds)} layouts",
               xlabel="predicted step time (s; modelled)", ylabel="predicted memory per GPU (GB; modelled)")
    axes[-1].legend(fontsize=8, loc="upper right")
    fig = axes[0].figure
    fig.suptitle("Every valid layout: memory per GPU against step time, both modelled", fontsize=11)
    fig.tight_layout()
    return axes


def describe_sensitivity(cases: Sequence[Published], sweeps: Mapping[str, Sequence[dict[str, Any]]]) -> str:
    """Each case's ``sensitivity_summary``, and for the first case the first choice with ZeRO's
    traffic hidden against charged, all memory usable (modelled)."""
    from labkit.planner.search import sensitivity_summary

    lines = [f"{c.name} (published {c.shape_name}): {sensitivity_summary(sweeps[c.name])}" for c in cases]
    at = {(r["usable_memory"], r["overlap_dp"]): r for r in sweeps[cases[0].name]}
    hidden, charged = at[(1.0, True)], at[(1.0, False)]
    lines += ["", f"{cases[0].name.split(',')[0]}: with ZeRO's traffic hidden and all "
              f"{cases[0].cluster.device.memory_bytes / 1e9:.0f} GB usable the first choice is "
              f"{hidden['first']} ({hidden['first_step_s']:.2f} s); charged in full it is "
              f"{charged['first']} ({charged['first_step_s']:.2f} s)"
              + (", the published layout" if charged["published_rank"] == 1 else "")
              + ". The answer turns on an assumption no formula here can measure: on real GPUs, "
              "time the two."]  # fmt: skip
    return "\n".join(lines)


def describe_choices(case: Published, choose: Callable[..., Any],
                     usable: Sequence[float] = (1.0, 0.95, 0.9)) -> str:  # fmt: skip
    """What ``choose(predictions, memory_bytes, usable_memory)`` picks for ``case`` at each
    usable share, ZeRO's traffic hidden and charged, and how far behind the published layout
    falls (modelled)."""
    cap = case.cluster.device.memory_bytes
    lines = [f"{case.name}: the layout choose_layout picks (modelled)",
             f"{'ZeRO traffic':<13}{'usable':>6}  {'pick':<15}{'variant':<13}{'memory':>8}{'step':>9}"
             "  published layout"]  # fmt: skip
    for overlap in (True, False):
        w = dataclasses.replace(case.workload, usable_memory=1.0, overlap_dp=overlap)
        preds = list(plan(case.model, case.cluster, w, case.search).predictions)
        for u in usable:
            pick = choose(preds, cap, u)
            pub = choose([p for p in preds if p.layout.name == case.shape_name], cap, u)
            gap = ("does not fit" if pub is None else "is the pick" if pick is not None
                   and pick.layout.name == case.shape_name else f"{pub.step_s / pick.step_s - 1:.0%} slower")
            lines.append(f"{'hidden' if overlap else 'charged':<13}{u:>6.0%}  " + (
                "nothing fits" if pick is None else f"{pick.layout.name:<15}{pick.layout.variant:<13}"
                f"{pick.memory['total'] / 1e9:>5.1f} GB{pick.step_s:>7.2f} s  {gap}"))
    return "\n".join(lines)


# --- this machine -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkFit:
    """This machine's link in the α–β model, fitted to the all-reduce job's two probe messages
    (``formulas.alpha_beta_fit``); when the probe was disturbed, the all-reduce's own bus
    bandwidth as β and α = 0 (measured either way)."""

    alpha_s: float
    bytes_per_s: float
    backend: str
    failure: str | None = None
    """Why no line could be fitted (then β is the measured busbw); None when it could."""

    def describe(self) -> str:
        line = (f"measured ({self.backend}): α = {self.alpha_s * 1e6:.0f} µs per message, "
                f"β = {self.bytes_per_s / 1e9:.2f} GB/s (link probe, one ring step)")
        if self.failure is None:
            return line
        return f"no α–β fit ({self.failure}); using the measured busbw as β and α = 0\n{line}"


def fit_link(probe: Mapping[str, Any], backend: str) -> LinkFit:
    """``probe``: rank 0's result of ``labkit.workers.allreduce`` (its ``probe_*`` and
    ``busbw_GBps`` keys)."""
    try:
        alpha_s, beta = formulas.alpha_beta_fit(probe["probe_small_bytes"], probe["probe_small_s"],
                                                probe["probe_big_bytes"], probe["probe_big_s"])  # fmt: skip
    except ValueError as err:  # a disturbed probe: fall back to the all-reduce's own busbw
        return LinkFit(0.0, probe["busbw_GBps"] * 1e9, backend, str(err))
    return LinkFit(alpha_s, beta, backend)


def describe_bytes(here: Plan) -> str:
    """This machine's plan as bytes each rank sends per step and the step, per layout (a blank
    line first, to set it apart from what the job printed)."""
    return (f"\nMiB each rank sends per step, and the step (modelled from counts, not timed; fp32, "
            f"{here.workload.global_batch} sequences, micro-batch 1; FSDP: ZeRO-3, one micro-batch)\n"
            + here.bytes_table())


@dataclass(frozen=True)
class DPSyncCheck:
    """The planner's charge for data parallelism's gradient sync (a ring all-reduce of the fp32
    gradients in the α–β model, predicted) against the same message all-reduced (measured)."""

    grad_bytes: int
    nproc: int
    predicted_s: float
    median_s: float
    min_s: float
    repeats: int

    def describe(self) -> str:
        ratio, fastest = self.median_s / self.predicted_s, self.min_s / self.predicted_s
        lines = ["", f"DP{self.nproc} gradient sync, {self.grad_bytes / 2**20:.2f} MiB: predicted "
                 f"{self.predicted_s * 1e3:.2f} ms (planner, α–β), measured median "
                 f"{self.median_s * 1e3:.2f} ms, fastest {self.min_s * 1e3:.2f} ms ({self.repeats} "
                 f"all-reduces): {ratio:.2f} × the prediction"]  # fmt: skip
        if fastest > 1.5:
            lines.append(f"even the fastest took {fastest:.1f} × the prediction: time the α–β model "
                         "does not charge (gloo's extra messages per ring step, the reduction's "
                         "compute); the planner's DP all-reduce term is optimistic here by about that much")
        elif ratio < 0.67:
            lines.append(f"the median took {ratio:.2f} × the prediction: the probe's per-call α "
                         "over-charges the backend's internal messages; the planner's DP all-reduce "
                         "term is pessimistic here")
        elif ratio <= 1.5:
            lines.append("the median is within 1.5× of the prediction either way: the measured link "
                         "accounts for the all-reduce, so the planner's DP all-reduce term holds here "
                         "(one term; the ranking of whole layouts is timed next)")
        else:
            lines.append(f"the fastest is within 1.5× of the prediction but the median took {ratio:.1f} ×: "
                         "other work slowed most timings; too noisy to tell how far the model falls "
                         "short (rerun on a quieter machine)")
        return "\n".join(lines)


def check_dp_sync(model: ModelSpec, link: LinkFit, measured: Mapping[str, Any], nproc: int) -> DPSyncCheck:
    """The ring all-reduce of ``model``'s fp32 gradients over ``nproc`` ranks on ``link``
    (predicted, ``formulas.ring_allreduce_time``) against ``measured``: rank 0's result of the
    all-reduce job of the same message (``median_s``, ``min_s``, ``repeats``)."""
    grad_bytes = 4 * model.params
    return DPSyncCheck(grad_bytes=grad_bytes, nproc=nproc,
                       predicted_s=formulas.ring_allreduce_time(grad_bytes, nproc, link.alpha_s,
                                                                link.bytes_per_s),
                       median_s=measured["median_s"], min_s=measured["min_s"],
                       repeats=measured["repeats"])  # fmt: skip
