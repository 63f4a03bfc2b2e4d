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

The bins are read from the quantised matrix itself (:func:`cut_bins`: XGBoost's
``get_quantile_cut``), not assumed to be ``max_bin``. The count is held to the payload plus the
TCP/IP headers it must carry (:func:`labkit.formulas.boosting.tcp_header_bytes`), widened by the
count's own spread over the rounds. With ``device="cuda"`` the histograms go through NCCL, whose
bytes never touch ``lo``: the reading then says that they are not counted on this tier.

One worker against two: :mod:`labkit.tabular.scaling`.
"""

from __future__ import annotations

import itertools
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xgboost
import xgboost.collective

from labkit.formulas import boosting
from labkit.metrics import net
from labkit.tabular.cluster import ClusterError, Workers
from labkit.tabular.data import informative
from labkit.timing import format_seconds, quartiles
from labkit.validate import whole

COLLECTIVE_TIMEOUT_S = 60
"""XGBoost's collective gives up after this long: a worker that died mid-round ends the job with
an error instead of leaving the other waiting for ever (``CollConfig(timeout=...)``)."""
ROOT_SUM_BYTES = 16
"""The round's small all-reduce besides the histograms: the root's gradient and hessian sums, two
float64 (``src/tree/updater_quantile_hist.cc``, ``InitRoot``: ``collective::GlobalSum``),
through the same ring."""


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
        if self.round_bytes:  # the first round also carries the start of training: left out
            lines.append(f"  bytes on lo per round (counted): median "
                         f"{statistics.median(self.round_bytes[1:] or self.round_bytes):,.0f}")
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
    """Bytes per round: predicted from the formula, counted on ``lo`` (where it can see them),
    reconciled."""

    workers: int
    device: str
    total_bins: int
    bins_read: bool
    """True when the bins were read from the matrix's cuts; False: assumed features × max_bin."""
    nodes_per_level: list[int]
    predicted_full: float
    """A full tree: 2^(d-1) node histograms, through the tier's collective."""
    predicted_trees: float
    """The trees that were grown: their split counts per level, and the root's sums."""
    textbook: float
    """The same histograms through the textbook ring, 2(w-1)·S (NCCL's ring on GPUs)."""
    headers: float
    """TCP/IP headers of the data segments that carry ``predicted_trees`` on ``lo``; ACKs add
    from nothing up to as much again."""
    counted: list[int] | None
    """``lo``'s step per round; None when this tier's bytes do not go through ``lo``."""
    not_counted: str = ""
    """Why nothing was counted (empty when counted)."""

    @property
    def collective(self) -> str:
        return ("NCCL's ring, 2(w-1)·S" if self.device.startswith("cuda")
                else "XGBoost's CPU ring over TCP, (2w-1)·S")  # fmt: skip

    @property
    def counted_median(self) -> float:
        return statistics.median(self.counted) if self.counted else float("nan")

    @property
    def spread(self) -> float:
        """Half the middle half of the counts: how far a round's count wanders."""
        if not self.counted:
            return float("nan")
        q1, q3 = quartiles([float(c) for c in self.counted])
        return (q3 - q1) / 2

    @property
    def residual(self) -> float:
        """Counted less the predicted payload: what headers, ACKs and other traffic added."""
        return self.counted_median - self.predicted_trees

    @property
    def band(self) -> tuple[float, float]:
        """The residual the model expects: the headers, up to twice that with one ACK per data
        segment, widened by the count's spread."""
        return self.headers - self.spread, 2 * self.headers + self.spread

    @property
    def ratio(self) -> float:
        return self.counted_median / self.predicted_trees if self.predicted_trees else float("nan")

    def counted_summary(self) -> str:
        """The count in a few words: the median, or why there is none."""
        if self.counted is None:
            return "not counted on this tier"
        return f"{self.counted_median:,.0f} (median of {len(self.counted)} rounds)"

    def sentence(self) -> str:
        if self.counted is None:
            return (f"not counted on this tier: {self.not_counted}; the prediction stands alone "
                    "(no measurement checks it here)")
        if not self.predicted_trees:
            return ("one worker all-reduces nothing: the counter saw only other traffic on lo "
                    f"(median {self.counted_median:,.0f} bytes per round)")
        low, high = self.band
        said = (f"counted - predicted = {self.residual:,.0f} bytes against the "
                f"{max(low, 0):,.0f} to {high:,.0f} that headers and ACKs explain")
        if low <= self.residual <= high:
            return (f"counted and predicted agree: {said} (counted/predicted = {self.ratio:.4f});"
                    " the model accounts for every byte lo carried")
        if self.residual > high:
            return (f"counted is above the prediction: {said}: other traffic shared lo during the "
                    "rounds, or the model leaves out a collective; rerun on a quieter machine, and "
                    "if it stays, look for the missing bytes")
        return (f"counted is below the prediction: {said}: the formula counts bytes this run did "
                "not send (fewer bins or nodes than assumed)")

    def describe(self) -> str:
        source = "read from the matrix's cuts" if self.bins_read else "assumed: features × max_bin"
        lines = [
            f"histograms of {self.total_bins:,} bins ({source}) × 16 bytes; node histograms per "
            f"level {self.nodes_per_level} (the trees grown); the collective: {self.collective}",
            f"  predicted, a full tree:                 {self.predicted_full:12,.0f} bytes/round",
            f"  predicted, the trees grown:             {self.predicted_trees:12,.0f} bytes/round",
            f"  predicted, the same through the textbook ring 2(w-1)·S: {self.textbook:,.0f}",
        ]
        if self.counted:
            q = sorted(self.counted)
            lines.append(f"  predicted TCP/IP headers on lo:         {self.headers:12,.0f} bytes/round"
                         " (ACKs: up to as much again)")
            lines.append(f"  counted on lo (measured): median {self.counted_median:,.0f}, middle "
                         f"half {q[len(q) // 4]:,.0f} to {q[(3 * len(q)) // 4]:,.0f}, {len(q)} rounds")
        lines.append(f"  {self.sentence()}")
        return "\n".join(lines)


def cut_bins(client: Any, x: Any, max_bin: int) -> list[int]:
    """Bins per feature of the quantised matrix, read from XGBoost's cuts
    (``QuantileDMatrix.get_quantile_cut``), built on the worker that holds ``x``'s first
    partition, from that partition. ``get_quantile_cut`` puts each numeric feature's minimum
    in front of its cut points (``src/c_api/c_api.cc``, ``GetCutImpl``), so a feature has one
    bin fewer than it has values there. On continuous features the distributed sketch keeps as
    many (``min(distinct, max_bin)``) as one partition does."""
    import dask

    whole("max_bin", max_bin, low=2)
    first = x.to_delayed().ravel()[0]
    return list(client.compute(dask.delayed(_cut_bins)(first, max_bin)).result())


def _cut_bins(part: Any, max_bin: int) -> list[int]:
    import numpy as np

    indptr, _ = xgboost.QuantileDMatrix(part, max_bin=max_bin, nthread=1).get_quantile_cut()
    return [int(n) - 1 for n in np.diff(indptr)]


def read_wire(fit: Fit, *, features: int, bins: list[int] | None = None,
              distinct: int | None = None) -> WireReading:
    """The bytes ``fit`` should have put on the wire per round, held against what ``lo`` counted.
    ``bins``: each feature's bins (:func:`cut_bins`); None assumes ``features × max_bin``."""
    depth, max_bin = fit.params["max_depth"], fit.params["max_bin"]
    device = str(fit.params.get("device", "cpu"))
    gpu = device.startswith("cuda")
    if bins is not None and len(bins) != features:
        raise ValueError(f"bins has {len(bins)} entries for features={features}: one per feature")
    total = sum(bins) if bins is not None else features * boosting.bins_per_feature(max_bin, distinct)
    splits = [round(s) for s in fit.splits_per_level()]
    nodes = boosting.hist_nodes_per_level(depth, splits)
    per_level = [*boosting.hist_allreduce_bytes(total, nodes), ROOT_SUM_BYTES]

    def wire(messages: list[int], *, ring: bool) -> float:
        return sum(boosting.ring_wire_bytes(m, fit.workers, xgboost_allgather=ring)
                   for m in messages)  # fmt: skip

    full_levels = boosting.hist_allreduce_bytes(total, boosting.hist_nodes_per_level(depth))
    headers = sum(boosting.tcp_header_bytes(m, fit.workers) for m in per_level)
    counted: list[int] | None = None
    why = ""
    if gpu:
        why = ("with device='cuda' NCCL all-reduces the histograms over NVLink, PCIe or the "
               "network, and none of its bytes goes through lo")
    elif fit.round_bytes is None:
        why = f"lo's counter cannot be read here ({net.unavailable('lo')})"
    else:
        # the first round also carries the start of training (the booster's configuration, the
        # base score's all-reduce): it is left out of the count
        counted = list(fit.round_bytes[1:] or fit.round_bytes)
    return WireReading(workers=fit.workers, device=device, total_bins=total,
                       bins_read=bins is not None, nodes_per_level=nodes,
                       predicted_full=wire([*full_levels, ROOT_SUM_BYTES], ring=not gpu),
                       predicted_trees=wire(per_level, ring=not gpu),
                       textbook=wire(per_level, ring=False), headers=float(headers),
                       counted=counted, not_counted=why)  # fmt: skip


def check_device(device: str, tier: str) -> None:
    """Refuse a GPU-only option on the CPU tier, with the fix."""
    if device.startswith("cuda") and tier == "cpu":
        raise ClusterError(
            f"device={device!r} needs a CUDA GPU, and this machine's tier is 'cpu': use "
            "device='cpu' here; on a GPU machine replace the CPU-only wheel with the CUDA one "
            "(`pip uninstall -y xgboost-cpu && pip install xgboost==<the same version>`: both "
            "wheels own the `xgboost` package) and install the `rapids` extra")
