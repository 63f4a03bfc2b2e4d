"""XGBoost trained across Dask workers, timed per round, with the bytes each round put on the wire.

    fit = train(workers, X, y, params=params(max_depth=6), rounds=20)
    print(fit.describe())                 # seconds: whole call, per round; bytes per round
    wire = read_wire(fit, features=16, max_bin=64)
    print(wire.describe())                # predicted against counted, reconciled

``xgboost.dask.train`` starts a tracker, sends one training task to every worker that holds a
partition, and those tasks form XGBoost's collective (one rank per worker, TCP sockets between
them); each builds its quantised matrix from its own partitions and all-reduces the histograms
every round (:mod:`labkit.formulas.boosting`). A callback (:class:`RoundRecorder`, run inside
each worker) stamps every round with the time and with the loopback interface's byte counter
(:mod:`labkit.metrics.net`): on this machine the workers' sockets run over ``lo``, so the
counter's step from one round to the next is what that round put on the wire, plus whatever else
used ``lo`` in that moment (Dask's heartbeats, the kernel's own sockets), which the median over
rounds sets aside.

:func:`compare_workers` trains the same data on one worker and on two, alternately, and lets
:func:`labkit.verdict.compare_times` choose the sentence.
"""

from __future__ import annotations

import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xgboost
import xgboost.collective

from labkit import verdict
from labkit.formulas import boosting
from labkit.metrics import net
from labkit.tabular.cluster import ClusterError, Workers
from labkit.tabular.data import Synthetic, informative, place
from labkit.timing import alternate, format_seconds
from labkit.validate import whole

COLLECTIVE_TIMEOUT_S = 60
"""XGBoost's collective gives up after this long: a worker that died mid-round ends the job with
an error instead of leaving the other waiting for ever (``CollConfig(timeout=...)``)."""
AGREE = 0.05
"""Counted within 5% of predicted counts as agreement: TCP/IP headers and ACKs add about 0.1-1%
on loopback (64 KiB segments), and the round's other collectives are a few dozen bytes."""


def params(*, max_depth: int = 6, max_bin: int = 64, eta: float = 0.3, device: str = "cpu",
           nthread: int = 1) -> dict[str, Any]:
    """XGBoost's parameters for this lab: ``hist``, squared error, depth-wise growth."""
    whole("max_depth", max_depth, low=1)
    whole("max_bin", max_bin, low=2)
    return {"tree_method": "hist", "objective": "reg:squarederror", "max_depth": max_depth,
            "max_bin": max_bin, "eta": eta, "device": device, "nthread": nthread,
            "grow_policy": "depthwise"}  # fmt: skip


def _counter() -> int:
    """``lo``'s bytes so far, or -1 where they cannot be read (not Linux, no ``lo``)."""
    return net.interface_bytes("lo").sent if net.unavailable("lo") is None else -1


class RoundRecorder(xgboost.callback.TrainingCallback):
    """A training callback, run in every worker: (time, bytes on ``lo``) before training and
    after every round, written to ``folder/rank-<r>.json`` when training ends."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder
        self.marks: list[tuple[float, int]] = []

    def before_training(self, model: Any) -> Any:
        self.marks = [(time.perf_counter(), _counter())]
        return model

    def after_iteration(self, model: Any, epoch: int, evals_log: Any) -> bool:
        self.marks.append((time.perf_counter(), _counter()))
        return False  # never stop early

    def after_training(self, model: Any) -> Any:
        rank = xgboost.collective.get_rank()
        Path(self.folder, f"rank-{rank}.json").write_text(json.dumps(self.marks))
        return model


@dataclass
class Fit:
    """One ``xgboost.dask.train`` call, measured."""

    workers: int
    rounds: int
    total_s: float
    """The whole call: tracker, each worker's quantised matrix, every round, the model back."""
    round_s: list[float]
    """Each round's seconds, from rank 0's callback."""
    round_bytes: list[int] | None
    """Bytes ``lo`` carried during each round (None where ``lo`` cannot be read)."""
    booster: Any = field(repr=False)
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def rounds_s(self) -> float:
        return sum(self.round_s)

    @property
    def fixed_s(self) -> float:
        """The call's time outside the rounds: tracker, matrices, scheduling, the model back."""
        return max(0.0, self.total_s - self.rounds_s)

    def splits_per_level(self) -> list[float]:
        """Nodes split at each depth, averaged over the trees: the nodes whose children the
        next level's histograms belong to."""
        counts: list[int] = []
        dumps = self.booster.get_dump(dump_format="json")
        for text in dumps:
            stack = [json.loads(text)]
            while stack:
                node = stack.pop()
                if "children" in node:
                    depth = node["depth"]
                    counts.extend([0] * (depth + 1 - len(counts)))
                    counts[depth] += 1
                    stack.extend(node["children"])
        return [c / len(dumps) for c in counts]

    def importance(self) -> dict[str, float]:
        return self.booster.get_score(importance_type="gain")

    def describe(self) -> str:
        med = statistics.median(self.round_s)
        lines = [f"{self.workers} worker(s), {self.rounds} rounds: {format_seconds(self.total_s)} "
                 f"in all (measured), of which the rounds {format_seconds(self.rounds_s)} "
                 f"(median {format_seconds(med)} per round) and the rest "
                 f"{format_seconds(self.fixed_s)} (tracker, quantised matrices, scheduling)"]
        if self.round_bytes:
            lines.append(f"  bytes on lo per round (counted): median "
                         f"{statistics.median(self.round_bytes):,.0f}")
        found = "found" if informative(self.importance()) else "did NOT find"
        lines.append(f"  the trees {found} the informative features 0-3 as the top four by gain")
        return "\n".join(lines)


def train(workers: Workers, x: Any, y: Any, *, params: dict[str, Any], rounds: int,
          quantile: bool = True) -> Fit:
    """Train on the partitions of ``x``, ``y`` (every worker holding one takes part)."""
    from xgboost import dask as dxgb  # imports dask.dataframe: only when training

    whole("rounds", rounds, low=1)
    workers.check()
    matrix = dxgb.DaskQuantileDMatrix if quantile else dxgb.DaskDMatrix
    with tempfile.TemporaryDirectory(prefix="labkit-xgb-") as folder:
        start = time.perf_counter()
        try:
            dtrain = matrix(workers.client, x, y, **({"max_bin": params["max_bin"]}
                                                    if quantile else {}))  # fmt: skip
            out = dxgb.train(workers.client, params, dtrain, num_boost_round=rounds,
                             callbacks=[RoundRecorder(folder)],
                             coll_cfg=xgboost.collective.Config(timeout=COLLECTIVE_TIMEOUT_S))  # fmt: skip
        except Exception:
            workers.check()  # a dead worker explains the failure better than its symptom
            raise
        total = time.perf_counter() - start
        ranks = sorted(Path(folder).glob("rank-*.json"))
        marks = json.loads(ranks[0].read_text()) if ranks else []
    times = [b[0] - a[0] for a, b in itertools.pairwise(marks)]
    counted = [b[1] - a[1] for a, b in itertools.pairwise(marks)]
    return Fit(workers=len(ranks), rounds=rounds, total_s=total, round_s=times,
               round_bytes=None if any(m[1] < 0 for m in marks) else counted,
               booster=out["booster"], params=dict(params))  # fmt: skip


@dataclass
class WireReading:
    """Bytes per round: predicted from the formula, counted on ``lo``, reconciled."""

    workers: int
    total_bins: int
    nodes_per_level: list[int]
    predicted_full: float
    """A full tree: 2^(d-1) node histograms, through XGBoost's ring."""
    predicted_trees: float
    """The trees that were grown: their split counts per level."""
    textbook: float
    """The same histograms through the textbook ring, 2(w-1)·S."""
    counted: list[int]

    @property
    def counted_median(self) -> float:
        return statistics.median(self.counted)

    @property
    def ratio(self) -> float:
        return self.counted_median / self.predicted_trees if self.predicted_trees else float("nan")

    def sentence(self) -> str:
        if not self.predicted_trees:
            return ("one worker all-reduces nothing: the counter saw only other traffic on lo "
                    f"(median {self.counted_median:,.0f} bytes per round)")
        off = self.ratio - 1
        if abs(off) <= AGREE:
            return (f"counted and predicted agree within {AGREE:.0%} (counted/predicted = "
                    f"{self.ratio:.3f}); the rest is TCP/IP headers and ACKs, the round's small "
                    "all-reduces and other traffic on lo")
        if off > 0:
            return (f"counted is {off:.0%} above the prediction: other traffic shared lo during "
                    "the rounds (the count is an upper bound on the job's bytes); rerun on a "
                    "quieter machine")
        return (f"counted is {-off:.0%} below the prediction: the formula counts bytes this run "
                "did not send (fewer bins or nodes than assumed)")

    def describe(self) -> str:
        q = sorted(self.counted)
        lo_q, hi_q = q[len(q) // 4], q[(3 * len(q)) // 4]
        return "\n".join([
            f"histograms of {self.total_bins:,} bins × 16 bytes; node histograms per level "
            f"{self.nodes_per_level} (the trees grown)",
            f"  predicted, a full tree, XGBoost's ring ((2w-1)·S):  {self.predicted_full:12,.0f} bytes/round",
            f"  predicted, the trees grown, XGBoost's ring:          {self.predicted_trees:12,.0f} bytes/round",
            f"  predicted, the trees grown, textbook ring (2(w-1)·S): {self.textbook:11,.0f} bytes/round",
            f"  counted on lo (measured): median {self.counted_median:,.0f}, middle half "
            f"{lo_q:,.0f} to {hi_q:,.0f}, {len(q)} rounds",
            f"  {self.sentence()}",
        ])  # fmt: skip


def read_wire(fit: Fit, *, features: int, distinct: int | None = None) -> WireReading:
    """The bytes ``fit`` should have put on the wire per round, held against what ``lo`` counted."""
    if fit.round_bytes is None:
        raise RuntimeError(f"no byte counts: {net.unavailable('lo')}")
    depth, max_bin = fit.params["max_depth"], fit.params["max_bin"]
    bins = features * boosting.bins_per_feature(max_bin, distinct)
    splits = [round(s) for s in fit.splits_per_level()]
    nodes = boosting.hist_nodes_per_level(depth, splits)
    per_level = boosting.hist_allreduce_bytes(bins, nodes)
    grown = sum(boosting.ring_wire_bytes(s, fit.workers) for s in per_level)
    textbook = sum(boosting.ring_wire_bytes(s, fit.workers, xgboost_allgather=False)
                   for s in per_level)  # fmt: skip
    full = boosting.hist_round_wire_bytes(features, max_bin, depth, fit.workers, distinct=distinct)
    # the first round also carries the start of training (the booster's configuration, the
    # base score's all-reduce): it is left out of the count
    return WireReading(workers=fit.workers, total_bins=bins, nodes_per_level=nodes,
                       predicted_full=full, predicted_trees=grown, textbook=textbook,
                       counted=list(fit.round_bytes[1:] or fit.round_bytes))  # fmt: skip


@dataclass
class WorkerComparison:
    """One worker against two on the same data, run alternately, with the verdict."""

    seconds: dict[str, list[float]]
    round_s: dict[str, list[float]]
    fits: dict[str, Fit]
    comparison: verdict.Comparison

    def describe(self) -> str:
        lines = [str(self.comparison)]
        for name, fit in self.fits.items():
            lines.append(f"  {name}: per round median {format_seconds(statistics.median(self.round_s[name]))}, "
                         f"outside the rounds {format_seconds(fit.fixed_s)} (last run)")
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        import matplotlib.pyplot as plt

        ax = ax or plt.subplots(figsize=(6, 3))[1]
        names = list(self.seconds)
        ax.boxplot([self.seconds[n] for n in names], tick_labels=names)
        ax.set_ylabel("seconds per train call (measured)")
        ax.set_title("xgboost.dask.train: one worker against two")
        return ax


def compare_workers(workers: Workers, data: Synthetic, *, params: dict[str, Any], rounds: int,
                    repeats: int, progress: Callable[[str], None] | None = print) -> WorkerComparison:
    """Train ``data`` on the first worker alone and on the first two, alternately, ``repeats``
    times each after one warm-up of each; compare the whole calls' seconds."""
    if len(workers.addresses) < 2:
        raise ValueError(f"compare_workers needs a cluster of 2 workers; this one has "
                         f"{len(workers.addresses)}: start it with local_workers(2)")
    placed = {"one worker": place(workers.client, data, workers.addresses[:1]),
              "two workers": place(workers.client, data, workers.addresses[:2])}
    fits: dict[str, Fit] = {}
    round_s: dict[str, list[float]] = {n: [] for n in placed}

    def run(name: str) -> Callable[[], float]:
        def once() -> float:
            fits[name] = train(workers, *placed[name], params=params, rounds=rounds)
            round_s[name].extend(fits[name].round_s)
            return fits[name].total_s
        return once

    def report(r: int, got: dict[str, float]) -> None:
        if progress is not None:
            shown = ", ".join(f"{n} {format_seconds(s)}" for n, s in got.items())
            progress(f"  {'warm-up' if r < 0 else f'round {r + 1}/{repeats}'}: {shown}")

    samples = alternate({n: run(n) for n in placed}, rounds=repeats, warmup=1, on_round=report)
    comparison = verdict.compare_times(samples["one worker"], samples["two workers"],
                                       names=("one worker", "two workers"))  # fmt: skip
    return WorkerComparison(seconds=samples, round_s=round_s, fits=fits, comparison=comparison)


def check_device(device: str, tier: str) -> None:
    """Refuse a GPU-only option on the CPU tier, with the fix."""
    if device.startswith("cuda") and tier == "cpu":
        raise ClusterError(
            f"device={device!r} needs a CUDA GPU, and this machine's tier is 'cpu': use "
            "device='cpu' here; on a GPU machine install the `xgboost` wheel (the CUDA build, "
            "same version as xgboost-cpu) and the `rapids` extra")
