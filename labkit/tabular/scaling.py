"""One worker against two on the same data: predicted, measured, and a verdict for each.

    cmp = compare_workers(workers, data, params=params, rounds=20, repeats=5,
                          round_wire_bytes=wire.predicted_trees, bandwidth=loopback_bandwidth())
    print(cmp.describe())

Two questions, two verdicts (:func:`labkit.verdict.compare_times`):

* **whole calls**: ``xgboost.dask.train`` from the first task to the model back. A call has a
  fixed part (the tracker, each worker's quantised matrix, Dask's scheduling) that a second worker
  does not shrink, so at small sizes this verdict is mostly about the fixed part;
* **per round**: each call's median round. A second worker halves each worker's rows, so the
  prediction (:class:`RoundPrediction`) is half the one-worker round plus the time the round's
  all-reduce takes on this machine's loopback (its bytes, from :mod:`labkit.tabular.training`,
  over the bandwidth :func:`loopback_bandwidth` measures). When the second worker has no core of
  its own, the measured round is slower than that, and the sentence says so with the core count.

A cluster of one worker (one GPU) cannot show scaling: :func:`compare_workers` then returns a
comparison that says so instead of raising, so that Run All reaches the end on one GPU.
"""

from __future__ import annotations

import os
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from labkit import verdict
from labkit.tabular.cluster import Workers
from labkit.tabular.data import Synthetic, place
from labkit.tabular.training import Fit, train
from labkit.timing import alternate, format_seconds, quartiles
from labkit.validate import number, whole

ONE, TWO = "one worker", "two workers"
AGREE = 0.15
"""A measured two-worker round within 15% of the prediction counts as "as predicted": the
one-worker round it halves has a spread of a few percent, and the loopback bandwidth is a best
case."""
ONE_WORKER = ("a cluster of one worker (one GPU) cannot show what a second one buys: nothing "
              "compared here. The CPU tier's run (two worker processes) shows the experiment, "
              "and a machine with two GPUs runs it on GPUs")


def loopback_bandwidth(nbytes: int = 32 * 2**20, repeats: int = 5) -> float:
    """Bytes per second one TCP stream carries over ``lo`` on this machine (median of
    ``repeats`` sends of ``nbytes``, a thread receiving): what a ring step between two workers
    on one host can reach at best."""
    whole("nbytes", nbytes, low=1)
    whole("repeats", repeats, low=1)
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()
        with sender, receiver:
            payload = bytes(min(nbytes, 4 * 2**20))
            rates = []
            for _ in range(repeats):
                done = threading.Thread(target=_drain, args=(receiver, nbytes))
                start = time.perf_counter()
                done.start()
                left = nbytes
                while left > 0:
                    left -= sender.send(payload[:left])
                done.join()
                rates.append(nbytes / (time.perf_counter() - start))
    return statistics.median(rates)


def _drain(sock: socket.socket, nbytes: int) -> None:
    while nbytes > 0:
        chunk = sock.recv(min(nbytes, 4 * 2**20))
        if not chunk:
            return
        nbytes -= len(chunk)


@dataclass(frozen=True)
class RoundPrediction:
    """Two workers' round, predicted from one worker's: half the compute, plus the all-reduce."""

    one_round_s: float
    """One worker's median round (measured)."""
    wire_bytes: float
    """What a round puts on the wire on two workers (predicted)."""
    bandwidth: float
    """Bytes per second over ``lo`` (measured)."""

    @property
    def allreduce_s(self) -> float:
        """The ring's steps run one after another: all its bytes at one stream's bandwidth."""
        return self.wire_bytes / self.bandwidth

    @property
    def two_round_s(self) -> float:
        return self.one_round_s / 2 + self.allreduce_s

    def describe(self) -> str:
        return (f"predicted two-worker round: {format_seconds(self.one_round_s)} / 2 + "
                f"{self.wire_bytes:,.0f} bytes at {self.bandwidth / 1e9:.2f} GB/s "
                f"({format_seconds(self.allreduce_s)}) = {format_seconds(self.two_round_s)}")


def round_sentence(measured: list[float], prediction: RoundPrediction,
                   cores: int | None) -> str:
    """The reconcile of the two-worker round: as predicted, slower (and why, from the core
    count), or faster. ``measured``: the two-worker calls' median rounds."""
    q1, q3 = quartiles(measured)
    med = statistics.median(measured)
    want = prediction.two_round_s
    shown = (f"measured {format_seconds(med)} (middle half {format_seconds(q1)} to "
             f"{format_seconds(q3)}) against {format_seconds(want)} predicted")
    if q1 <= want * (1 + AGREE) and q3 >= want * (1 - AGREE):
        return f"two workers' round as predicted: {shown}"
    if med > want:
        why = (f"this machine has {cores} CPU core(s) for two workers, the scheduler, this kernel "
               "and anyone else's work, so the second worker did not get a core of its own and "
               "the halved rounds ran in turns" if cores is not None and cores <= 2 else
               "the rounds pay costs the prediction leaves out (waiting for the slower worker at "
               "every all-reduce, the memory bandwidth both workers share)")
        return f"two workers' round is slower than predicted: {shown}: {why}"
    return (f"two workers' round is faster than predicted: {shown}: each worker's half of the "
            "data fits its caches better than the whole did")


@dataclass
class WorkerComparison:
    """One worker against two on the same data, run alternately, with the verdicts; or, on a
    cluster of one worker, the sentence that says why there is nothing to compare."""

    seconds: dict[str, list[float]] = field(default_factory=dict)
    """Each measured call's whole seconds (warm-up left out)."""
    round_s: dict[str, list[float]] = field(default_factory=dict)
    """Each measured call's median round."""
    fixed_s: dict[str, list[float]] = field(default_factory=dict)
    """Each measured call's seconds outside its rounds."""
    fits: dict[str, Fit] = field(default_factory=dict)
    comparison: verdict.Comparison | None = None
    """Whole calls."""
    per_round: verdict.Comparison | None = None
    prediction: RoundPrediction | None = None
    cores: int | None = None
    skipped: str = ""

    @property
    def sentence(self) -> str:
        """The verdicts in one line (the figures table's)."""
        if self.comparison is None or self.per_round is None:
            return self.skipped
        return (f"whole calls: {self.comparison.sentence.removeprefix(verdict.PREFIX)}; per round: "
                f"{self.per_round.sentence.removeprefix(verdict.PREFIX)}")

    def describe(self) -> str:
        if self.comparison is None or self.per_round is None:
            return self.skipped
        lines = ["whole train calls (measured):", str(self.comparison),
                 "each call's median round (measured):", str(self.per_round)]
        for name, fixed in self.fixed_s.items():
            q1, q3 = quartiles(fixed)
            lines.append(f"  {name}: outside the rounds median {format_seconds(statistics.median(fixed))}, "
                         f"middle half {format_seconds(q1)} to {format_seconds(q3)}, "
                         f"{len(fixed)} runs")  # fmt: skip
        if self.prediction is not None:
            lines += [self.prediction.describe(),
                      round_sentence(self.round_s[TWO], self.prediction, self.cores)]
        else:
            lines.append("no prediction of the two-worker round: the all-reduce's bandwidth is "
                         "not measured on this tier")
        return "\n".join(lines)

    def plot(self, axes: Any = None) -> Any:
        """Whole calls and median rounds per call (measured), the predicted round beside them."""
        import matplotlib.pyplot as plt

        if self.comparison is None:
            return None
        axes = axes if axes is not None else plt.subplots(1, 2, figsize=(9, 3))[1]
        names = list(self.seconds)
        axes[0].boxplot([self.seconds[n] for n in names], tick_labels=names)
        axes[0].set_ylabel("seconds per train call (measured)")
        axes[0].set_title("whole calls")
        axes[1].boxplot([[s * 1e3 for s in self.round_s[n]] for n in names], tick_labels=names)
        if self.prediction is not None:
            axes[1].plot([2], [self.prediction.two_round_s * 1e3], "rx", markersize=10,
                         label="two workers, predicted")  # fmt: skip
            axes[1].legend(loc="best", fontsize="small")
        axes[1].set_ylabel("ms per round (median of a call)")
        axes[1].set_title("per round")
        return axes


def compare_workers(workers: Workers, data: Synthetic, *, params: dict[str, Any], rounds: int,
                    repeats: int, round_wire_bytes: float | None = None,
                    bandwidth: float | None = None,
                    progress: Callable[[str], None] | None = print) -> WorkerComparison:
    """Train ``data`` on the first worker alone and on the first two, alternately, ``repeats``
    times each after one warm-up of each; compare whole calls and median rounds, and predict
    the two-worker round when ``round_wire_bytes`` and ``bandwidth`` are given. A cluster of
    one worker returns the comparison that says it cannot compare."""
    whole("repeats", repeats, low=1)
    if len(workers.addresses) < 2:
        return WorkerComparison(skipped=ONE_WORKER)
    placed = {ONE: place(workers.client, data, workers.addresses[:1]),
              TWO: place(workers.client, data, workers.addresses[:2])}
    calls: dict[str, list[Fit]] = {n: [] for n in placed}

    def run(name: str) -> Callable[[], float]:
        def once() -> float:
            calls[name].append(train(workers, *placed[name], params=params, rounds=rounds))
            return calls[name][-1].total_s
        return once

    def report(r: int, got: dict[str, float]) -> None:
        if progress is not None:
            shown = ", ".join(f"{n} {format_seconds(s)}" for n, s in got.items())
            progress(f"  {'warm-up' if r < 0 else f'round {r + 1}/{repeats}'}: {shown}")

    samples = alternate({n: run(n) for n in placed}, rounds=repeats, warmup=1, on_round=report)
    kept = {n: fits[1:] for n, fits in calls.items()}  # the warm-up call is not a sample
    round_s = {n: [statistics.median(f.round_s) for f in fits] for n, fits in kept.items()}
    prediction = None
    if round_wire_bytes is not None and bandwidth is not None:
        number("round_wire_bytes", round_wire_bytes, low=0)
        number("bandwidth", bandwidth, low=1)
        prediction = RoundPrediction(one_round_s=statistics.median(round_s[ONE]),
                                     wire_bytes=round_wire_bytes, bandwidth=bandwidth)
    return WorkerComparison(
        seconds=samples, round_s=round_s,
        fixed_s={n: [f.fixed_s for f in fits] for n, fits in kept.items()},
        fits={n: fits[-1] for n, fits in kept.items()},
        comparison=verdict.compare_times(samples[ONE], samples[TWO], names=(ONE, TWO)),
        per_round=verdict.compare_times(round_s[ONE], round_s[TWO], names=(ONE, TWO)),
        prediction=prediction, cores=os.cpu_count())  # fmt: skip
