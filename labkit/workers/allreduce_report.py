"""Notebook 00's first job, told: the prediction, the values each rank holds, the bytes on the
wire and the time against the α–β model, each a frozen result with ``describe()``.

Apart from :mod:`labkit.workers.allreduce`, which every rank of the job runs: this module runs
in the notebook's kernel, on the ``JobResult`` those ranks returned. The worker reports what it
holds and what it timed; the sentences here are chosen by those measurements (with
``labkit.verdict`` where a prediction is held against a measured figure), never written in
advance. Notebook 00 names the worker ``worker`` and this module ``report``
(``worker, report = workers.allreduce, workers.allreduce_report``)::

    prediction = report.predict(job_config, nproc, backend, device, sent_per_rank=..., whose=...)
    with report.count_job_wire(backend) as wire:
        result = worker.run(job_config, nproc=nproc)
    print(report.check_values(result, expected, op="sum").describe())
    print(report.reconcile_wire(result, wire, predicted_per_rank=..., whose=...).describe())
    print(report.reconcile_time(result).describe())
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from labkit import formulas, verdict
from labkit.jobs.launch import JobResult
from labkit.metrics import net

if TYPE_CHECKING:
    from labkit.workers.allreduce import AllReduceConfig

MIB = 2**20


# --- before the job: what the notebook predicts ------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    """What notebook 00 predicts before launching: where the ranks run, the value every element
    should hold, and the bytes each rank sends (``sent_per_rank``: the learner's
    ``ring_bytes_sent``, or the reference while that exercise is not done; ``whose`` says
    which, as ``ex.whose`` words it)."""

    nproc: int
    backend: str
    device: str
    numel: int
    allreduces: int
    """The one whose values are checked, then the warm-up and timed ones."""
    expected: float
    sent_per_rank: float
    whose: str

    @property
    def message_bytes(self) -> int:
        return 4 * self.numel  # float32

    def describe(self) -> str:
        n, sent = self.nproc, self.sent_per_rank
        return "\n".join([
            f"{n} ranks will run on the {self.device} over {self.backend}",
            f"predicted: every element = {self.expected:g}",
            f"predicted ({self.whose}): each rank sends {sent / MIB:.3f} MiB per all-reduce of a "
            f"{self.message_bytes / MIB:.3f} MiB message (n = {n}); {n} ranks × "
            f"{self.allreduces} all-reduces put {n * self.allreduces * sent / MIB:.1f} MiB of "
            "payload on the wire",
            f"bus bandwidth = algorithm bandwidth × {formulas.bus_bandwidth_factor('all_reduce', n):g}"
            f" for n = {n} (it tends to 2 as n grows: "
            f"{formulas.bus_bandwidth_factor('all_reduce', 8):g} for n = 8)",
        ])  # fmt: skip


def predict(config: AllReduceConfig, nproc: int, backend: str, device: str, *,
            sent_per_rank: float, whose: str) -> Prediction:  # fmt: skip
    """The :class:`Prediction` for ``config`` on ``nproc`` ranks (``config.expect`` is the value
    predicted for every element; None: the sum's n(n+1)/2)."""
    expected = config.expect if config.expect is not None else nproc * (nproc + 1) / 2
    return Prediction(nproc=nproc, backend=backend, device=device, numel=config.numel,
                      allreduces=1 + config.warmup + config.repeats, expected=float(expected),
                      sent_per_rank=sent_per_rank, whose=whose)  # fmt: skip


@contextlib.contextmanager
def count_job_wire(backend: str, interface: str = "lo") -> Iterator[net.WireCount | None]:
    """The whole job's bytes on ``interface`` (``net.count_wire``) when its ranks talk over it:
    gloo ranks on one host use loopback. Under NCCL, or where the counters cannot be read,
    nothing is counted and the block gets None."""
    if backend != "gloo" or net.unavailable(interface) is not None:
        yield None
        return
    with net.count_wire(interface) as count:
        yield count


# --- after the job: the values -----------------------------------------------------------------


@dataclass(frozen=True)
class ValueCheck:
    """What each rank holds against the value the notebook predicted."""

    expected: float
    op: str
    numel: int
    nproc: int
    held: dict[int, tuple[float, float]]
    """{rank: (smallest element, largest element)}."""
    wrong: dict[int, int]
    """{rank: elements that differ from ``expected``}, for the ranks where some do."""

    @property
    def ok(self) -> bool:
        return not self.wrong

    def describe(self) -> str:
        e = f"{self.expected:g}"
        lines = [f"measured: smallest and largest element on each rank {self.held} "
                 f"(predicted: all {e}, {self.op!r} all-reduce)"]  # fmt: skip
        if self.wrong:
            lines.append(f"✗ value check: elements differ from the predicted {e} on "
                         + ", ".join(f"rank {r} ({k:,} of {self.numel:,})"
                                     for r, k in self.wrong.items()))  # fmt: skip
        else:
            lines.append(f"✓ value check: all {self.numel:,} elements on all {self.nproc} ranks "
                         f"equal {e} exactly")  # fmt: skip
        if self.op != "sum":
            lines.append(f"(the prediction n(n+1)/2 = {e} is a sum's; the {self.op!r} all-reduce "
                         "was the one checked, and the timed all-reduces below are sums whatever "
                         "reduce_op says)")  # fmt: skip
        return "\n".join(lines)


def check_values(result: JobResult, expected: float, *, op: str) -> ValueCheck:
    """Hold each rank's elements against ``expected``: the worker counted those that differ
    from the value it was given (``expect``), so that value must be this one."""
    if any(r["expected"] != expected for r in result.ranks):
        raise AssertionError("the worker checked another value")
    r0 = result.rank(0)
    return ValueCheck(
        expected=expected, op=op, numel=r0["message_bytes"] // r0["bytes_per_element"],
        nproc=len(result.ranks),
        held={r["rank"]: (r["value_min"], r["value_max"]) for r in result.ranks},
        wrong={r["rank"]: r["wrong_elements"] for r in result.ranks if r["wrong_elements"]},
    )  # fmt: skip


def describe_speed(result: JobResult) -> str:
    """Rank 0's timed all-reduces: median, fastest, and the bandwidths (NCCL-tests' algbw and
    busbw) over the job's backend."""
    r0 = result.rank(0)
    return (f"measured on rank 0: {r0['median_s'] * 1e3:.2f} ms per all-reduce of "
            f"{r0['message_bytes'] / MIB:.2f} MiB (median of {r0['repeats']}; fastest "
            f"{r0['min_s'] * 1e3:.2f} ms) -> algbw {r0['algbw_GBps']:.3f} GB/s, "
            f"busbw {r0['busbw_GBps']:.3f} GB/s over {result.backend}")  # fmt: skip


# --- after the job: the bytes on the wire ------------------------------------------------------


@dataclass(frozen=True)
class WireReconcile:
    """The bytes one rank sent in one all-reduce, counted on loopback, against the prediction.

    The worker read ``lo`` between two barriers around its loop (``loop_bytes`` in ``loop_s``)
    and then for a baseline of the same ranks doing nothing but a barrier (``idle_bytes`` in
    ``idle_s``); the baseline's bytes, scaled to the loop's time, are subtracted, and what is
    left, divided by the ranks and the looped all-reduces, is one rank's one all-reduce. A byte
    on ``lo`` is counted once, however many processes touch it."""

    unavailable: str | None
    """Why nothing was counted (the worker's ``wire_unavailable``); None: counted."""
    whole_job_bytes: int | None
    """What ``lo`` carried during the whole job, from the kernel (None: not counted)."""
    loop_bytes: int | None
    loop_s: float | None
    idle_bytes: int | None
    idle_s: float | None
    nproc: int
    loop_allreduces: int
    predicted_per_rank: float
    whose: str

    @property
    def measured_per_rank(self) -> float | None:
        if self.unavailable or None in (self.loop_bytes, self.loop_s, self.idle_bytes, self.idle_s):
            return None
        background = self.idle_bytes * self.loop_s / self.idle_s
        return (self.loop_bytes - background) / self.nproc / self.loop_allreduces

    @property
    def extra(self) -> float | None:
        """Measured − predicted bytes per rank and all-reduce; None when not counted, or when
        ``lo`` carried less than half of the prediction (then the wire cannot check it)."""
        measured = self.measured_per_rank
        if measured is None or measured < 0.5 * self.predicted_per_rank:
            return None
        return measured - self.predicted_per_rank

    def describe(self) -> str:
        measured = self.measured_per_rank
        if measured is None:
            return f"no bytes counted on the wire here: {self.unavailable}"
        predicted, n = self.predicted_per_rank, self.loop_allreduces
        whole = ("not counted" if self.whole_job_bytes is None
                 else f"{self.whole_job_bytes / MIB:.1f} MiB")  # fmt: skip
        lines = [
            f"measured on lo: {whole} during the whole job, {self.loop_bytes / MIB:.1f} MiB "
            f"during its {n} looped all-reduces ({self.loop_s:.2f} s); baseline "
            f"{self.idle_bytes / 2**10:.0f} KiB in {self.idle_s:.2f} s without any",
            f"measured: {measured / MIB:.4f} MiB per rank and all-reduce "
            f"((loop − baseline) / {self.nproc} ranks / {n} all-reduces)",
            f"predicted ({self.whose}): {predicted / MIB:.4f} MiB of payload",
        ]  # fmt: skip
        if self.extra is None:
            lines.append("lo carried less than half of the ring's payload: the baseline was "
                         "disturbed, or this torch's gloo moved the data another way than TCP (a "
                         "shared-memory all-reduce for ranks on one node was merged into gloo in "
                         "January 2026 and reverted in February, pytorch/gloo#458 and #490); here "
                         "the wire cannot check the prediction")  # fmt: skip
            return "\n".join(lines)
        lines.append(str(verdict.share(
            predicted, measured, part_name="the predicted payload",
            whole_name="the bytes measured on lo per rank and all-reduce",
            fmt=lambda b: f"{b / MIB:.4f} MiB",
            if_over="other traffic on lo disturbed the baseline")))  # fmt: skip
        lines.append(f"measured − predicted: {self.extra:,.0f} bytes per rank and all-reduce "
                     f"({self.extra / predicted:+.2%} of the payload)")  # fmt: skip
        return "\n".join(lines)


def reconcile_wire(result: JobResult, whole_job: net.WireCount | None, *,
                   predicted_per_rank: float, whose: str) -> WireReconcile:  # fmt: skip
    """The :class:`WireReconcile` of rank 0's counts (``whole_job``: what
    :func:`count_job_wire` counted around the job, or None)."""
    r0 = result.rank(0)
    return WireReconcile(
        unavailable=r0["wire_unavailable"] or None,
        whole_job_bytes=None if whole_job is None else whole_job.sent,
        loop_bytes=r0["wire_loop_bytes"], loop_s=r0["wire_loop_s"],
        idle_bytes=r0["wire_idle_bytes"], idle_s=r0["wire_idle_s"],
        nproc=len(result.ranks), loop_allreduces=r0["loop_allreduces"],
        predicted_per_rank=predicted_per_rank, whose=whose,
    )  # fmt: skip


# --- after the job: the time against the α–β model ---------------------------------------------


@dataclass(frozen=True)
class TimeReconcile:
    """The all-reduce's measured time against the α–β model (Thakur, Rabenseifner and Gropp,
    2005), with α and β fitted to the worker's link probe (``formulas.alpha_beta_fit``).

    Two message counts bound the prediction: the ring's 2(n−1) steps, and, on gloo, at least
    2 segments per chunk (gloo/allreduce.cc), so at least 4(n−1) messages. How NCCL splits its
    steps is not modelled here: on NCCL the ring's count is the one prediction."""

    backend: str
    nproc: int
    message_bytes: int
    median_s: float
    min_s: float
    alpha_s: float | None
    """The fitted per-message cost α, seconds; None when the probe gave no line to fit."""
    beta: float | None
    """The fitted bandwidth β, bytes/s; None with ``alpha_s``."""
    no_fit: str | None = None
    """Why there is no fit (the probe was disturbed); None: fitted."""

    @property
    def t_ring(self) -> float | None:
        """The α–β time with the ring's 2(n−1) messages (``formulas.ring_allreduce_time``)."""
        if self.alpha_s is None or self.beta is None:
            return None
        return formulas.ring_allreduce_time(self.message_bytes, self.nproc, self.alpha_s, self.beta)

    @property
    def t_high(self) -> float | None:
        """The α–β time with gloo's at least 4(n−1) messages; on NCCL the ring's."""
        if self.alpha_s is None or self.beta is None:
            return None
        if self.backend != "gloo":
            return self.t_ring
        return formulas.alpha_beta_time(
            formulas.ring_allreduce_bytes_per_rank(self.message_bytes, self.nproc),
            self.alpha_s, self.beta, messages=4 * (self.nproc - 1))  # fmt: skip

    def describe(self) -> str:
        t_ring, t_high = self.t_ring, self.t_high
        if self.alpha_s is None or self.beta is None or t_ring is None or t_high is None:
            return f"no α–β prediction: {self.no_fit}"
        lines = [f"measured (link probe, one ring step): α = {self.alpha_s * 1e6:.0f} µs per "
                 f"message, β = {self.beta / 1e9:.2f} GB/s"]  # fmt: skip
        if self.backend == "gloo":
            high_name = "4(n−1)-message"
            lines.append(f"predicted (α–β): {t_ring * 1e3:.3f} ms with the ring's 2(n−1) "
                         f"messages, {t_high * 1e3:.3f} ms with gloo's 4(n−1)")  # fmt: skip
        else:
            high_name = "2(n−1)-message"
            lines.append(f"predicted (α–β, the ring's 2(n−1) messages): {t_ring * 1e3:.3f} ms")
        median = self.median_s
        low_x, high_x = median / t_ring, median / t_high
        lines.append(f"measured: median {median * 1e3:.3f} ms, fastest {self.min_s * 1e3:.3f} ms: "
                     f"{low_x:.2f} × the 2(n−1)-message prediction"
                     + (f", {high_x:.2f} × gloo's 4(n−1)-message one" if t_high > t_ring else ""))  # fmt: skip
        if low_x < 0.8:
            lines.append(f"the median is {low_x:.2f} × the 2(n−1)-message prediction, the fewest "
                         "messages a ring sends: the model over-charges this all-reduce. A "
                         "possible explanation, not measured here: α, timed per Python call, "
                         "carries that call's own overhead, which the backend's internal messages "
                         "need not each pay")  # fmt: skip
        elif low_x < 1:
            lines.append(f"the median is within 20% below the 2(n−1)-message prediction "
                         f"({low_x:.2f} ×): the link's α and β account for the all-reduce's time")
        elif t_high > t_ring and high_x <= 1:
            lines.append("the median lies between the two predictions: the link's α and β "
                         "account for the all-reduce's time, with between 2(n−1) and 4(n−1) "
                         "messages paying α")  # fmt: skip
        elif high_x <= 1.5:
            lines.append(f"the median is within 50% above the {high_name} prediction "
                         f"({high_x:.2f} ×): the link's α and β account for most of the "
                         "all-reduce's time")  # fmt: skip
        else:
            lines.append(f"the median took {high_x:.1f} × the {high_name} prediction (the "
                         f"fastest {self.min_s / t_high:.1f} ×): time the α–β model does not "
                         "charge; the list below gives possible causes, none of them measured "
                         "here")  # fmt: skip
        return "\n".join(lines)


def reconcile_time(result: JobResult) -> TimeReconcile:
    """Fit α and β to rank 0's link probe and hold its median all-reduce against the model. A
    disturbed probe (no line to fit: ``formulas.alpha_beta_fit`` raises ValueError), or a job
    run with ``probe=False``, gives no prediction, and ``describe()`` says why."""
    r0 = result.rank(0)
    fit: dict[str, Any] = {}
    if "probe_small_s" not in r0:
        fit = {"alpha_s": None, "beta": None,
               "no_fit": "the job ran no link probe (probe=False), so α and β are unknown"}
    else:
        try:
            fit["alpha_s"], fit["beta"] = formulas.alpha_beta_fit(
                r0["probe_small_bytes"], r0["probe_small_s"], r0["probe_big_bytes"],
                r0["probe_big_s"])  # fmt: skip
        except ValueError as err:
            fit = {"alpha_s": None, "beta": None, "no_fit": str(err)}
    return TimeReconcile(backend=result.backend, nproc=len(result.ranks),
                         message_bytes=r0["message_bytes"], median_s=r0["median_s"],
                         min_s=r0["min_s"], **fit)  # fmt: skip


# --- the notebook's last cell ------------------------------------------------------------------


@dataclass(frozen=True)
class FirstJobSummary:
    """What notebook 00 measured, one line a figure."""

    tier: str
    result: JobResult
    values: ValueCheck
    wire: WireReconcile
    time: TimeReconcile

    def describe(self) -> str:
        res, values, wire, time = self.result, self.values, self.wire, self.time
        e = f"{values.expected:g}"
        lines = [f"tier: {self.tier}; {values.nproc} ranks over {res.backend} on the {res.device}"]
        if values.wrong:
            lines.append(f"values: elements differ from the predicted {e} on rank(s) "
                         f"{', '.join(map(str, values.wrong))} ({values.op!r} all-reduce)")
        else:
            lines.append(f"values: every element as predicted ({e}, {values.op!r} all-reduce)")
        extra, measured = wire.extra, wire.measured_per_rank
        if wire.unavailable:
            lines.append(f"bytes on the wire: not counted here ({wire.unavailable})")
        elif extra is not None and measured is not None:
            predicted = wire.predicted_per_rank
            lines.append(f"bytes per rank and all-reduce: measured {measured / MIB:.4f} MiB on lo, "
                         f"predicted {predicted / MIB:.4f} MiB of payload "
                         f"({extra / predicted:+.2%})")  # fmt: skip
        t_ring, t_high = time.t_ring, time.t_high
        if t_ring is not None and t_high is not None:
            lines.append(f"all-reduce time: measured median {time.median_s * 1e3:.3f} ms; α–β "
                         f"prediction {t_ring * 1e3:.3f} ms with 2(n−1) messages"
                         + (f", {t_high * 1e3:.3f} ms with gloo's 4(n−1)" if t_high > t_ring
                            else ""))  # fmt: skip
        r0 = res.rank(0)
        lines.append(f"bandwidth (measured): algbw {r0['algbw_GBps']:.3f} GB/s, "
                     f"busbw {r0['busbw_GBps']:.3f} GB/s")  # fmt: skip
        return "\n".join(lines)


def summarize(tier: str, result: JobResult, values: ValueCheck, wire: WireReconcile,
              time: TimeReconcile) -> FirstJobSummary:  # fmt: skip
    """The :class:`FirstJobSummary` of notebook 00's measurements."""
    return FirstJobSummary(tier=tier, result=result, values=values, wire=wire, time=time)
