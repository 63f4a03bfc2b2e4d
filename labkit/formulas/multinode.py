"""An all-reduce across nodes, flat and two-level, over a range of node counts (modelled).

Notebook 02b's section 2 holds the gradient all-reduce of one model against the number of
8-GPU nodes: one flat ring through every GPU, whose every step waits for a network hop, against
the two-level all-reduce that sends only 1/G of the bytes over the network. Separate from
:mod:`labkit.formulas.communication` because it is an application of
:func:`~labkit.formulas.communication.multinode_allreduce_time` to a sweep, with the table and
the figure it shows; the links' speeds come in as numbers (``hardware.link_bandwidth`` looks
them up). ``plot_multinode_allreduce`` imports matplotlib when it is called, never on import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from labkit.formulas.communication import multinode_allreduce_time
from labkit.validate import number, positive, whole


@dataclass(frozen=True)
class MultinodeAllreduce:
    """Seconds of one all-reduce of ``message_bytes`` per node count, flat and two-level
    (see :func:`multinode_allreduce_sweep`)."""

    message_bytes: float
    gpus_per_node: int
    node_counts: tuple[int, ...]
    """Node counts, the first 1 (one node: no network hop)."""
    flat_s: tuple[float, ...]
    """One flat ring through every GPU, per node count."""
    two_level_s: tuple[float, ...]
    """Reduce-scatter in the node, all-reduce across nodes, all-gather in the node."""
    intra_bytes_per_s: float
    inter_bytes_per_s: float
    intra_name: str = "NVLink"
    inter_name: str = "network"

    def describe(self) -> str:
        """The table of both times per node count, and what the first network hop costs."""
        flat, tiered, counts, g = self.flat_s, self.two_level_s, self.node_counts, self.gpus_per_node
        lines = [f"all-reduce of {self.message_bytes / 1e9:.0f} GB over nodes of {g} GPUs "
                 "(modelled, seconds)",
                 f"{'nodes':>5} {'GPUs':>5} {'flat ring':>10} {'two-level':>13}"]
        lines += [f"{n:>5} {n * g:>5} {a:>10.3f} {b:>13.3f}"
                  for n, a, b in zip(counts, flat, tiered, strict=True)]
        lines += ["", f"one node ({self.intra_name} only): {flat[0]:.3f} s; the first network hop "
                  f"makes the flat ring {flat[1] / flat[0]:.1f}x slower, the two-level one "
                  f"{tiered[1] / tiered[0]:.2f}x (the {self.intra_name} to {self.inter_name} "
                  f"ratio is {self.intra_bytes_per_s / self.inter_bytes_per_s:.0f}x); at "
                  f"{counts[-1]} nodes the two-level one is {tiered[-1] / tiered[0]:.1f}x one "
                  f"node's time, the flat ring {flat[-1] / flat[0]:.1f}x"]
        return "\n".join(lines)


def multinode_allreduce_sweep(message_bytes: float, gpus_per_node: int,
                              node_counts: Sequence[int], *, intra_bytes_per_s: float,
                              inter_bytes_per_s: float, intra_name: str = "NVLink",
                              inter_name: str = "network") -> MultinodeAllreduce:  # fmt: skip
    """:func:`multinode_allreduce_time` of ``message_bytes`` at each of ``node_counts`` (rising,
    from 1, at least two), flat and two-level: bandwidth time only, no latency, no overlap."""
    s = number("message_bytes", message_bytes, low=0)
    g = whole("gpus_per_node", gpus_per_node, low=1)
    counts = tuple(whole("node_counts", n, low=1) for n in node_counts)
    if len(counts) < 2 or counts[0] != 1 or any(b <= a for a, b in pairwise(counts)):
        raise ValueError(f"node_counts={list(node_counts)!r}: rising node counts from 1, at least "
                         "two (one node is the reference the others are compared with)")  # fmt: skip
    intra = positive("intra_bytes_per_s", intra_bytes_per_s)
    inter = positive("inter_bytes_per_s", inter_bytes_per_s)

    def times(hierarchical: bool) -> tuple[float, ...]:
        return tuple(multinode_allreduce_time(s, n, g, intra_bytes_per_s=intra,
                                              inter_bytes_per_s=inter, hierarchical=hierarchical)
                     for n in counts)  # fmt: skip

    return MultinodeAllreduce(s, g, counts, times(False), times(True), intra, inter,
                              intra_name, inter_name)  # fmt: skip


def plot_multinode_allreduce(result: MultinodeAllreduce, ax: Any = None) -> Any:
    """Both times against the GPU count (log scale), on ``ax`` (a new figure if None)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.4))
    gpus = [n * result.gpus_per_node for n in result.node_counts]
    ax.plot(gpus, result.flat_s, "o-", label="flat ring through every GPU (modelled)")
    ax.plot(gpus, result.two_level_s, "s-",
            label=f"two-level: {result.intra_name}, then the {result.inter_name} (modelled)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(gpus, [str(n) for n in gpus])
    ax.set(xlabel=f"GPUs ({result.gpus_per_node} per node)", ylabel="all-reduce time (s)",
           title=f"all-reduce of {result.message_bytes / 1e9:.0f} GB of gradients: "
                 f"{result.intra_name} {result.intra_bytes_per_s / 1e9:.0f} GB/s, "
                 f"{result.inter_name} {result.inter_bytes_per_s / 1e9:.0f} GB/s per GPU")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return ax
