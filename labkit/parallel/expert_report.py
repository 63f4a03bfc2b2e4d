"""Notebook 03c's reading of the mixture of experts: the all-to-all's bytes predicted for an even
router, the dispatch predicted, counted and measured per rank, the load per expert, and the
auxiliary loss's effect on balance, each a result with ``describe()``, with their figures
(matplotlib imported only when drawing).

:mod:`labkit.parallel.expert` is the layer and its all-to-all (the teaching code); this module
reads what ``labkit.workers.moe_train`` and ``expert.balance_run`` return and prints and draws it.
``expert`` re-exports every name here, so ``expert.dispatch_report`` and the others keep
working; this module imports ``expert`` only inside the functions that need it, since an import
at the top would be circular.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from labkit import formulas


@dataclass(frozen=True)
class AllToAllPrediction:
    """The even-router prediction of one dispatch's bytes per rank: :func:`predict_alltoall`."""

    tokens: int  # tokens each rank routes
    top_k: int
    d_model: int
    world_size: int

    @property
    def message_bytes(self) -> int:
        """S: the fp32 copies each rank puts into one dispatch."""
        return self.tokens * self.top_k * self.d_model * 4

    @property
    def sent(self) -> float:
        """Bytes one rank sends per all-to-all with an even router ((n−1)/n · S)."""
        from labkit.parallel.expert import alltoall_sent_bytes_uniform  # see the docstring

        return alltoall_sent_bytes_uniform(self.tokens * self.top_k, self.d_model, self.world_size)

    def describe(self) -> str:
        factor = formulas.bus_bandwidth_factor("all_to_all", self.world_size)
        return (f"per rank: {self.tokens} tokens × top-{self.top_k} = {self.tokens * self.top_k} "
                f"copies of h = {self.d_model} fp32 numbers: S = {self.message_bytes:,} B into each "
                f"dispatch\npredicted (even router): {factor:.2f} × S = {self.sent:,.0f} B sent "
                f"per rank per all-to-all; × 4 all-to-alls = {4 * self.sent:,.0f} B per rank per "
                "step for this one layer")


def predict_alltoall(tokens: int, top_k: int, d_model: int, world_size: int) -> AllToAllPrediction:
    """What one dispatch of ``tokens`` tokens per rank, each to ``top_k`` experts, sends per rank
    with an even router (forward and backward make four such all-to-alls)."""
    return AllToAllPrediction(tokens, top_k, d_model, world_size)


@dataclass(frozen=True)
class DispatchReport:
    """Cell-ready reading of ``labkit.workers.moe_train``'s per-rank results for the dispatch."""

    text: str
    sent: list[int]  # bytes each rank's dispatch was told to send to other ranks (counted)
    extra: list[int | None]  # bytes written to sockets beyond that (measured), None if unseen
    consistent: bool  # every receiver counted what its senders said they sent
    matches_routing: bool  # counted == the prediction from the routing, on every rank
    mean_over_even: float = float("nan")  # mean counted bytes over ranks / the even-router prediction
    even_sent: float = float("nan")  # bytes one dispatch sends per rank, even router (predicted)
    routed: tuple[int, ...] = ()  # bytes each rank's dispatch sends, from its routing (predicted)
    tolerance: float = 0.05  # how close to the even-router prediction counts as right (ours)

    def describe(self) -> str:
        """The table and verdicts of :attr:`text`, then whether the even-router prediction is
        right on average and per rank (within :attr:`tolerance`)."""
        per_rank = [s / self.even_sent for s in self.sent]
        avg_ok = abs(self.mean_over_even - 1) <= self.tolerance
        rank_ok = all(abs(x - 1) <= self.tolerance for x in per_rank)
        return (f"{self.text}\nthe even-router prediction is {'right' if avg_ok else 'OFF'} on "
                f"average (mean over ranks {self.mean_over_even:.2f}×) and "
                f"{'right' if rank_ok else 'wrong'} per rank ({min(per_rank):.2f}× to "
                f"{max(per_rank):.2f}×); right means within {self.tolerance * 100:g} %")


def dispatch_report(ranks: list[dict[str, Any]], even_sent: float, n_experts: int) -> DispatchReport:
    """Predicted (even router, and from the routing), counted and measured dispatch bytes per
    rank, with the verdict lines chosen by comparing them. ``ranks`` sorted by rank."""
    n = len(ranks)
    sent_copies = [r["copies_per_rank"] for r in ranks]  # [i][j]: copies rank i sent to j
    consistent = all(r["received_per_rank"] == [sent_copies[i][r["rank"]] for i in range(n)]
                     for r in ranks)
    lines = ["copies sent, rank i (row) → rank j (column), counted by the sender:"]
    lines += [f"  rank {i}: " + "  ".join(f"{c:5d}" for c in row) + f"   (keeps {row[i]} of {sum(row)})"
              for i, row in enumerate(sent_copies)]
    lines += [f"→ every receiver counted what its senders sent: {consistent}", "",
              "dispatch, bytes sent per rank:",
              "rank | predicted (even) | predicted (routing) | counted | measured (written) | "
              "measured − counted"]
    sent, extra = [], []
    for r in ranks:
        d = r["counted"]["dispatch"]
        w = d.get("written_bytes")
        sent.append(d["sent_bytes"])
        extra.append(None if w is None else w - d["sent_bytes"])
        w_txt, x_txt = ("N/A", "N/A") if w is None else (f"{w:,}", f"{w - d['sent_bytes']:+,}")
        lines.append(f"{r['rank']:4d} | {r['predicted_uniform_sent']:16,.0f} | "
                     f"{r['predicted_routed_sent']['dispatch']:19,} | {d['sent_bytes']:7,} | "
                     f"{w_txt:>18} | {x_txt:>17}")
    matches = all(r["counted"]["dispatch"]["sent_bytes"] == r["predicted_routed_sent"]["dispatch"]
                  for r in ranks)
    mean_over_even = sum(sent) / len(sent) / even_sent
    lines += ["", f"→ counted {'equals' if matches else 'DIFFERS from'} the routing's prediction on "
              f"every rank; counted is {min(sent) / even_sent:.2f}× to {max(sent) / even_sent:.2f}× "
              f"the even-router prediction, {mean_over_even:.2f}× on average over the ranks"]
    if None in extra:
        lines.append("→ measured: N/A (this backend moves the bytes without socket writes the "
                     "process can see)")
    else:
        per_peer = [e / (n - 1) for e in extra]

        def span(v: list[float], f: Any) -> str:
            return f(min(v)) if min(v) == max(v) else f"{f(min(v))} to {f(max(v))}"

        header = all(0 <= e <= 1024 for e in per_peer)
        lines.append(f"→ measured − counted: {span(extra, lambda v: f'{v:,}')} B per call on every "
                     f"rank, {span(per_peer, lambda v: f'{v:.0f}')} B per peer: "
                     + ("gloo's message header, the payload itself agrees to the byte" if header else
                        "MORE than a header: something else wrote during the call, or bytes were "
                        "sent twice"))
    four = [sum(r["counted"][k]["sent_bytes"] for k in
                ("dispatch", "combine", "dispatch (backward)", "combine (backward)")) for r in ranks]
    lines.append(f"four token all-to-alls per step (counted): {', '.join(f'{b:,}' for b in four)} B "
                 f"per rank (predicted, even router: {4 * even_sent:,.0f}); plus the count exchange, "
                 f"{n_experts} int64 = {ranks[0]['counted']['counts']['message_bytes']} B per rank, "
                 "once per forward")
    return DispatchReport("\n".join(lines), sent, extra, consistent, matches, mean_over_even,
                          even_sent=even_sent,
                          routed=tuple(r["predicted_routed_sent"]["dispatch"] for r in ranks))


def plot_dispatch(report: DispatchReport, ax: Any = None) -> Any:
    """Bytes each rank's dispatch sent: predicted (even router, and from its routing), counted,
    and measured (written to sockets) where seen, in KiB. Returns the axes."""
    import matplotlib.pyplot as plt  # here, so that importing labkit stays light

    if ax is None:
        _, ax = plt.subplots(figsize=(5.5, 3.8))
    n = len(report.sent)
    bars = {"predicted (even router)": [report.even_sent] * n,
            "predicted (from routing)": list(report.routed), "counted (split sizes)": report.sent}
    if None not in report.extra:
        bars["measured (written to sockets)"] = [d + e for d, e in zip(report.sent, report.extra,
                                                                       strict=True)]  # fmt: skip
    wid = 0.8 / len(bars)
    for j, (label, vals) in enumerate(bars.items()):
        ax.bar([x - 0.4 + wid * (j + 0.5) for x in range(n)], [v / 1024 for v in vals], wid,
               label=label)
    ax.set(xlabel="rank", ylabel="KiB sent in one dispatch", xticks=list(range(n)),
           title="all-to-all bytes per rank")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    return ax


@dataclass(frozen=True)
class ExpertLoad:
    """Token copies per expert over every rank, and per rank's experts: :func:`expert_load`."""

    counts: list[int]  # token copies routed to each expert, all ranks (counted)
    rank_load: list[int]  # copies each rank's experts processed
    top_k: int

    @property
    def imbalance(self) -> float:
        from labkit.parallel.expert import imbalance  # here: see the module's docstring

        return imbalance(self.counts)

    def describe(self) -> str:
        from labkit.parallel.expert import worst_imbalance  # here: see the module's docstring

        E, n = len(self.counts), len(self.rank_load)
        busiest = max(self.rank_load) / (sum(self.rank_load) / n)
        return "\n".join([
            f"token copies per expert, all ranks (counted): {self.counts}",
            f"load imbalance max/mean over experts (measured from the router): {self.imbalance:.2f} "
            f"(1.00 is even; {worst_imbalance(E, self.top_k):.0f} = E/k would be every token on "
            f"the same {self.top_k} experts)",
            f"copies each rank's experts processed: {self.rank_load}: the busiest rank did "
            f"{busiest:.2f}× the mean"])


def expert_load(ranks: list[dict[str, Any]], n_experts: int, top_k: int) -> ExpertLoad:
    """Read ``labkit.workers.moe_train``'s per-rank results (sorted by rank): copies per expert
    summed over the ranks, and the copies each rank received."""
    counts = [sum(r["tokens_per_expert"][e] for r in ranks) for e in range(n_experts)]
    return ExpertLoad(counts, [sum(r["received_per_rank"]) for r in ranks], top_k)


def plot_expert_load(load: ExpertLoad, ax: Any = None) -> Any:
    """Token copies per expert, coloured by the rank holding it, against the even mean.
    Returns the axes."""
    import matplotlib.pyplot as plt  # here, so that importing labkit stays light

    if ax is None:
        _, ax = plt.subplots(figsize=(5.5, 3.8))
    E, per_rank = len(load.counts), len(load.counts) // len(load.rank_load)
    ax.bar(range(E), load.counts, color=[f"C{e // per_rank}" for e in range(E)])
    ax.axhline(sum(load.counts) / E, color="k", ls="--", label="mean (even router)")
    ax.set(xlabel="expert (colour: the rank holding it)", ylabel="token copies routed (counted)",
           title=f"load per expert: max/mean {load.imbalance:.2f}")
    ax.legend(fontsize=8)
    return ax


@dataclass(frozen=True)
class BalanceComparison:
    """:func:`balance_run` without and with the auxiliary loss, the imbalance over the second
    half of the steps compared: :func:`compare_balance`."""

    steps: int
    runs: dict[float, dict[str, list[float]]]  # alpha -> balance_run's lists (0.0 first)

    @property
    def summaries(self) -> dict[float, Any]:
        """alpha -> ``verdict.summarize`` of the imbalance over the last half of the steps."""
        from labkit import verdict

        return {a: verdict.summarize(r["imbalance"][self.steps // 2:], name=f"alpha = {a:g}")
                for a, r in self.runs.items()}

    def describe(self) -> str:
        """One line per alpha, then the verdict: the medians' intervals decide."""
        sums = self.summaries
        lines = [f"alpha = {a:<4g}: imbalance max/mean (measured) median {s.median:.2f}, middle "
                 f"half {s.q1:.2f} to {s.q3:.2f}, over the last {s.n} of {self.steps} steps; "
                 f"LM loss at the end {self.runs[a]['loss'][-1]:.3f}" for a, s in sums.items()]
        s0, s1 = list(sums.values())[:2]
        (lo0, hi0), (lo1, hi1) = s0.interval, s1.interval
        if hi1 < lo0:
            lines.append(f"→ with the auxiliary loss the router is more even: median imbalance "
                         f"{s1.median:.2f} against {s0.median:.2f} (the medians' intervals do not "
                         "overlap)")
        elif hi0 < lo1:
            lines.append("→ in this run the auxiliary loss made the router LESS even (the intervals "
                         "do not overlap): too few steps for the loss to act, or α too small")
        else:
            lines.append("→ too noisy to tell: the medians' intervals overlap; run more steps "
                         "(run['moe_aux_steps']) to separate them")
        return "\n".join(lines)


def compare_balance(alpha: float, steps: int, **kw: Any) -> BalanceComparison:
    """:func:`balance_run` at alpha 0 and at ``alpha`` (``kw``: its keyword arguments)."""
    from labkit.parallel.expert import balance_run  # here: see the module's docstring

    return BalanceComparison(steps, {a: balance_run(a, steps, **kw) for a in (0.0, alpha)})
