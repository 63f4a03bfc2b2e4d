"""Notebook 02b's first job of several nodes, told: the prediction, each rank's place and result
in a rehearsal, and the reconcile, each a frozen result with ``describe()``.

Apart from :mod:`labkit.workers.multinode`, which every rank of the job runs: this module runs
in the notebook's kernel, on the ``Rehearsal`` (``labkit.jobs.launch.rehearse_nodes``) those
ranks reported to. The sentences are chosen by what the ranks hold, never written in advance.
The prediction's reference step is the worker's own (``multinode.reference_params``). Notebook
02b (``from labkit import workers``) writes::

    prediction = workers.multinode_report.predict(nodes, nproc_per_node)
    print(prediction.describe())
    rehearsal = launch.rehearse_nodes(workers.multinode.MultinodeConfig(), nodes=nodes, nproc=...)
    print(workers.multinode_report.describe_rehearsal(prediction, rehearsal))
    print(workers.multinode_report.reconcile(prediction, rehearsal).describe())
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from labkit import validate
from labkit.jobs.launch import Rehearsal
from labkit.jobs.nodes import rank_range
from labkit.workers.multinode import reference_params


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What a job of ``nodes`` nodes of ``nproc_per_node`` ranks should report
    (:func:`predict`)."""

    nodes: int
    nproc_per_node: int
    reference: torch.Tensor
    """One process's step on every rank's batch (``multinode.reference_params``)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    @property
    def allreduce(self) -> int:
        """1 + 2 + ... + n: every rank's ``rank + 1``, summed."""
        return self.world_size * (self.world_size + 1) // 2

    def describe(self) -> str:
        """Each node's ranks, and the all-reduce every rank should hold."""
        lines = [f"node {k}: ranks {list(rank_range(k, self.nproc_per_node))}  (predicted)"
                 for k in range(self.nodes)]
        lines.append(f"all-reduce of rank + 1 over {self.world_size} ranks: {self.allreduce} on "
                     "every rank (predicted)")
        return "\n".join(lines)

    def gap(self, result: dict[str, Any]) -> float:
        """The largest |difference| between a rank's weights after the step and the reference."""
        return (torch.tensor(result["params"]) - self.reference).abs().max().item()


def predict(nodes: int, nproc_per_node: int, *, seed: int = 0, batch: int = 8,
            lr: float = 0.1) -> Prediction:  # fmt: skip
    """Ranks numbered node by node (``nodes.rank_range``), the all-reduce's n(n+1)/2, and one
    process's step on all the ranks' batches, for a job of the default config's seed, batch and
    learning rate."""
    nodes = validate.whole("nodes", nodes, low=1)
    nproc_per_node = validate.whole("nproc_per_node", nproc_per_node, low=1)
    reference = reference_params(nodes * nproc_per_node, seed=seed, batch=batch, lr=lr)
    return Prediction(nodes, nproc_per_node, reference)


def describe_rehearsal(prediction: Prediction, rehearsal: Rehearsal) -> str:
    """A rehearsal's measurements: which node rank this kernel's agent got, what the agents in
    the background printed, every rank's place, all-reduce and distance from the reference,
    each agent's status and time, and the command each agent ran."""
    here = rehearsal.here.node_rank
    lines = [f"(this kernel's agent got node rank {here})"]
    lines += ["\n".join(rehearsal.output(k)) for k in range(len(rehearsal.nodes)) if k != here]
    lines += ["", f"{'rank':>4} {'node':>5} {'local rank':>11} {'host':>10} {'all-reduce':>11} "
              f"{'max |w - one process|':>22}"]
    lines += [f"{r:>4} {res['node_rank']:>5} {res['local_rank']:>11} {res['host']:>10} "
              f"{res['allreduce']:>11g} {prediction.gap(res):>22.2e}"
              for r, res in rehearsal.results().items()]
    lines.append("(all measured) each node's agent: " + ", ".join(
        f"node {n['node_rank']} {n['status']} in {n['wall_s']:.1f} s" for n in rehearsal.nodes))
    lines += ["", f"this rehearsal's agents each ran:\n  {rehearsal.command}"]
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Reconcile:
    """A rehearsal's ranks held against the prediction (:func:`reconcile`)."""

    prediction: Prediction
    held: dict[int, int]
    """Rank -> the node rank it ran on."""
    summed: tuple[float, ...]
    """The distinct all-reduce results the ranks hold."""
    identical: bool
    """Every rank's weights after the DDP step bitwise equal."""
    gap: float
    """The first rank's weights from the reference, max |difference|."""

    @property
    def placed(self) -> bool:
        g = self.prediction.nproc_per_node
        return all(self.held.get(r) == k for k in range(self.prediction.nodes)
                   for r in rank_range(k, g))  # fmt: skip

    def describe(self) -> str:
        p = self.prediction
        agree = set(self.summed) == {p.world_size * (p.world_size + 1) / 2}
        return "\n".join([
            f"ranks on the predicted nodes: {'yes' if self.placed else 'NO'}  ({self.held})",
            f"all-reduce: every rank holds {sorted(self.summed)}, predicted {p.allreduce}: "
            + ("agree" if agree else "DISAGREE"),
            f"after one DDP step the {p.world_size} ranks' weights are "
            + ("bitwise identical" if self.identical else "NOT identical")
            + f", and {self.gap:.1e} from one process's step on all batches "
            + ("(rounding: the mean is summed in another order)" if self.gap < 1e-5
               else "(too far: a bug)"),
        ])  # fmt: skip


def reconcile(prediction: Prediction, rehearsal: Rehearsal) -> Reconcile:
    """Where each rank ran, what its all-reduce held, and whether the ranks' weights agree with
    each other and with one process's step."""
    results = rehearsal.results()
    weights = [torch.tensor(res["params"]) for res in results.values()]
    return Reconcile(
        prediction,
        held={r: res["node_rank"] for r, res in results.items()},
        summed=tuple(sorted({res["allreduce"] for res in results.values()})),
        identical=all(torch.equal(w, weights[0]) for w in weights),
        gap=(weights[0] - prediction.reference).abs().max().item(),
    )
