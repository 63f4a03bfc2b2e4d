"""Enumeration and ranking: every layout the cluster admits (:func:`enumerate_layouts`), each
predicted and ranked fastest first (:func:`plan`, a :class:`Plan`), and how the ranking moves
when an assumption does (:func:`sensitivity`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from labkit.planner.prediction import Prediction, predict
from labkit.planner.specs import (
    Cluster,
    Layout,
    ModelSpec,
    Search,
    Workload,
    check_layout,
    divisors,
)

# ----------------------------------------------------------------------------------------------
# Enumeration and ranking.


def _powers_of_two(limit: int) -> list[int]:
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return out


def enumerate_layouts(model: ModelSpec, cluster: Cluster, workload: Workload,
                      search: Search | None = None) -> list[Layout]:  # fmt: skip
    """Every layout (with each variant of ``search``) that passes ``check_layout``."""
    search = search or Search()
    n = cluster.n_gpus
    out = []
    for tp in divisors(min(cluster.gpus_per_node, n)):
        for cp in _powers_of_two(search.max_cp):
            if n % (tp * cp):
                continue
            for pp in divisors(n // (tp * cp)):
                dp = n // (tp * cp * pp)
                eps = (
                    [d for d in divisors(dp) if model.moe_experts % d == 0]
                    if model.is_moe
                    else [1]
                )
                for ep in eps:
                    for b in search.micro_batches:
                        for v in search.interleave:
                            for zero in search.zero_stages:
                                for rc in search.recompute:
                                    lay = Layout(dp, tp, pp, cp, ep, v, b, zero, rc)
                                    try:
                                        check_layout(model, cluster, workload, lay, search)
                                    except ValueError:
                                        continue
                                    out.append(lay)
    return out


@dataclass(frozen=True)
class Plan:
    """Every candidate's prediction, ranked: those that fit, fastest first, then the rest."""

    model: ModelSpec
    cluster: Cluster
    workload: Workload
    search: Search
    predictions: tuple[Prediction, ...] = field(default=())

    def ranked(self, *, fitting_only: bool = False) -> list[Prediction]:
        fit = [p for p in self.predictions if p.fits is not False]
        fit.sort(key=lambda p: p.step_s)
        if fitting_only:
            return fit
        rest = sorted((p for p in self.predictions if p.fits is False), key=lambda p: p.step_s)
        return fit + rest

    def best_per_shape(self) -> list[Prediction]:
        """The fastest fitting variant of each (dp, tp, pp, cp, ep), fastest shape first."""
        seen: dict[tuple, Prediction] = {}
        for p in self.ranked(fitting_only=True):
            seen.setdefault(p.layout.shape, p)
        return list(seen.values())

    def rank_of(self, *, dp: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> int | None:
        """1-based rank of that shape among ``best_per_shape()``; None if no variant fits."""
        for i, p in enumerate(self.best_per_shape(), 1):
            if p.layout.shape == (dp, tp, pp, cp, ep):
                return i
        return None

    def table(self, top: int = 8, *, compact: bool = False) -> str:
        """The ``top`` layouts of ``best_per_shape()``, one row each. ``compact``: narrower rows
        without the fit (every row fits) and the per-row label (say "modelled" around it)."""
        rows = self.best_per_shape()[:top]
        if compact:
            lines = [f"{'rank':>4}  {'layout':<16} {'best variant':<32} {'memory':>9} "
                     f"{'step':>10} {'MFU':>6}"]  # fmt: skip
        else:
            lines = [f"{'rank':>4}  {'layout':<22} {'best variant':<30} {'memory per GPU':<26}"
                     f"{'time per step':>15}  {'MFU':>9}"]  # fmt: skip
        lines += [f"{i:>4}  {p.line(compact=compact)}" for i, p in enumerate(rows, 1)]
        return "\n".join(lines)

    def bytes_table(self, *, fsdp: bool = True) -> str:
        """Bytes one rank sends per step in each dimension (MiB; counts, modelled, not timed), and
        the modelled step, for the fastest variant of each layout. ``fsdp`` adds the data-parallel
        bytes of the same layout under ZeRO-3 with one micro-batch per step (no accumulation),
        for layouts with DP and no PP ("-" otherwise)."""
        dims = ("dp", "tp", "pp", "cp")
        lines = [f"{'layout':<10}" + "".join(f"{k.upper() + ' MiB':>9}" for k in dims)
                 + (f"{'DP MiB FSDP':>13}" if fsdp else "") + f"{'step':>12}"]  # fmt: skip
        for p in self.best_per_shape():
            lay = p.layout
            row = f"{lay.name:<10}" + "".join(f"{p.bytes_per_rank[k] / 2**20:>9.2f}" for k in dims)
            if fsdp:
                cell = "-"
                if lay.dp > 1 and lay.pp == 1:
                    f3 = predict(self.model, self.cluster, self.workload,
                                 Layout(lay.dp, lay.tp, 1, lay.cp, zero=3,
                                        micro_batch=self.workload.global_batch // lay.dp),
                                 self.search)  # fmt: skip
                    cell = f"{f3.bytes_per_rank['dp'] / 2**20:.2f}"
                row += f"{cell:>13}"
            lines.append(row + f"{p.step_s * 1e3:>9.1f} ms")
        return "\n".join(lines)


def plan(model: ModelSpec, cluster: Cluster, workload: Workload,
         search: Search | None = None) -> Plan:  # fmt: skip
    """Enumerate, predict and rank (all modelled). Raises ValueError when nothing is valid."""
    search = search or Search()
    layouts = enumerate_layouts(model, cluster, workload, search)
    if not layouts:
        raise ValueError(f"no layout of {cluster.n_gpus} GPUs satisfies the constraints for "
                         f"{model.name} with global_batch={workload.global_batch}: check a "
                         "candidate with check_layout() to see which constraint fails")  # fmt: skip
    preds = tuple(predict(model, cluster, workload, lay, search) for lay in layouts)
    return Plan(model, cluster, workload, search, preds)


def sensitivity(model: ModelSpec, cluster: Cluster, workload: Workload, search: Search,
                shape: dict[str, int], *, usable: Sequence[float] = (1.0, 0.95, 0.9),
                overlap: Sequence[bool] = (True, False)) -> list[dict[str, Any]]:  # fmt: skip
    """Re-plan under each (usable_memory, overlap_dp) and say where ``shape`` lands (modelled).

    One row per setting: the planner's first choice (its layout, variant, step and memory),
    the rank of ``shape`` among the fitting layouts (None: no variant of it fits) with its
    step, and how many layouts fit. The two assumptions are the ones a ranking rests on most:
    how much of the memory the formulas may fill, and whether ZeRO's gathers and the gradient
    sync hide behind compute (False charges every byte of them).
    """
    import dataclasses

    rows = []
    for u in usable:
        for ov in overlap:
            w = dataclasses.replace(workload, usable_memory=u, overlap_dp=ov)
            pl = plan(model, cluster, w, search)
            best = pl.best_per_shape()
            rank = pl.rank_of(**shape)
            pub = best[rank - 1] if rank else None
            first = best[0] if best else None
            rows.append({
                "usable_memory": u, "overlap_dp": ov, "fitting": len(best),
                "first": None if first is None else first.layout.name,
                "first_variant": None if first is None else first.layout.variant,
                "first_step_s": None if first is None else first.step_s,
                "first_memory_bytes": None if first is None else first.memory["total"],
                "published_rank": rank,
                "published_step_s": None if pub is None else pub.step_s,
                "published_variant": None if pub is None else pub.layout.variant,
            })  # fmt: skip
    return rows


def sensitivity_summary(rows: Sequence[dict[str, Any]]) -> str:
    """One sentence on ``sensitivity()``'s rows: whether the first choice moves with the
    assumptions, and in how many settings the published layout ranks first or does not fit."""
    firsts = {r["first"] for r in rows}
    ranks = [r["published_rank"] for r in rows]
    text = ("the first choice stays the same in every setting" if len(firsts) == 1 else
            f"the first choice changes with the assumptions ({len(firsts)} different layouts)")  # fmt: skip
    text += "; the published layout ranks " + (
        f"first in {ranks.count(1)} of {len(rows)} settings" if 1 in ranks else "first in none")
    if None in ranks:
        text += f" and does not fit in {ranks.count(None)}"
    return text
