"""Which parallelism over which link: one layer's compute against what each axis sends (modelled).

Notebook 03's section 7 holds, per layer and micro-batch, the compute of a tensor-parallel rank
at peak FLOP/s against the time its all-reduces take over a link, and the time a pipeline
boundary takes to pass one activation forward and its gradient back; and, per link, the tokens a
data-parallel rank needs per micro-batch to hide its gradient all-reduce. Separate from
:mod:`labkit.formulas.communication` because it is an application of those formulas (and of
:func:`labkit.formulas.flops.layer_training_flops`) to named links, with the table it prints.

Every figure is modelled from peaks (FLOP/s and link bandwidth), which push the ratio of
communication to compute in opposite directions; the notebook weighs them.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.formulas.communication import dp_min_tokens_per_rank, ring_allreduce_bytes_per_rank
from labkit.formulas.flops import layer_training_flops
from labkit.validate import positive, whole


@dataclass(frozen=True)
class LinkCosts:
    """Per layer and micro-batch, over each link: compute, TP and PP communication (seconds),
    and the tokens per rank data parallelism needs (see :func:`link_costs`)."""

    h: int
    s: int
    b: int
    n: int
    compute_s: float
    """One layer's forward and backward on one of n tensor-parallel ranks, at peak."""
    tp_s: dict[str, float]
    """Link -> the 4 ring all-reduces (2 forward, 2 backward) of one (b, s, h) activation."""
    pp_s: dict[str, float]
    """Link -> one stage boundary: the activation forward, its gradient back."""
    dp_min_tokens: dict[str, float]
    """Link -> tokens per rank per micro-batch to hide the gradient all-reduce."""

    def describe(self) -> str:
        lines = [f"modelled, per layer and micro-batch (h = {self.h}, s = {self.s}, "
                 f"b = {self.b}, bf16):",
                 f"{'':>24}{'compute ms':>12}{f'TP {self.n} comm ms':>14}{'TP/compute':>12}"
                 f"{'PP comm ms':>12}"]
        for link, tp_s in self.tp_s.items():
            lines.append(f"{link:>24}{self.compute_s * 1e3:>12.2f}{tp_s * 1e3:>14.2f}"
                         f"{tp_s / self.compute_s:>12.1f}{self.pp_s[link] * 1e3:>12.2f}")
        lines += [f"data parallel over {link}: ≥ {need:,.0f} tokens per rank per micro-batch to "
                  "hide the gradient all-reduce behind the last backward (modelled)"
                  for link, need in self.dp_min_tokens.items()]
        return "\n".join(lines)


def link_costs(h: int, s: int, b: int, n: int, peak_flops_per_s: float,
               links: dict[str, float]) -> LinkCosts:
    """One layer's costs in bf16 over each of ``links`` (name -> bytes/s each way per GPU),
    modelled.

    compute = ``layer_training_flops(b, s, h)`` / n / C: a tensor-parallel rank does 1/n of the
    layer (72·b·s·h²·(1 + s/6h), Narayanan et al. 2021 eq. (3), without recomputation);
    TP = 4 · ``ring_allreduce_bytes_per_rank``(2·b·s·h, n) / W (2 all-reduces forward,
    2 backward); PP = 2 · 2·b·s·h / W (an activation forward, its gradient back);
    DP = ``dp_min_tokens_per_rank(n, C, W)``.
    """
    h, s, b, n = (whole(k, v, low=1) for k, v in (("h", h), ("s", s), ("b", b), ("n", n)))
    C = positive("peak_flops_per_s", peak_flops_per_s)
    widths = {link: positive(f"links[{link!r}]", W) for link, W in links.items()}
    act_bytes = b * s * h * 2  # one (b, s, h) activation in bf16
    compute_s = layer_training_flops(b, s, h) / n / C
    return LinkCosts(
        h, s, b, n, compute_s,
        tp_s={k: 4 * ring_allreduce_bytes_per_rank(act_bytes, n) / W for k, W in widths.items()},
        pp_s={k: 2 * act_bytes / W for k, W in widths.items()},
        dp_min_tokens={k: dp_min_tokens_per_rank(n, C, W) for k, W in widths.items()},
    )
