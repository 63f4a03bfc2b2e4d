"""Notebook 03b's data × pipeline section in the kernel: the prediction from the stage sizes,
then what ``pp_compose``'s "dp_pp" ranks counted and measured held against it, each a frozen
result with ``describe()``, and the timeline drawn from the ranks' timestamps.

Apart from :mod:`labkit.workers.pp_compose`, which every rank of the job runs: this module runs
in the notebook's kernel, on the ``JobResult`` those ranks returned; the sentences are chosen
by those numbers, never written in advance. Notebook 03b (``from labkit import workers``)::

    pred = workers.dp_pp_report.predict_dp_pp(model_cfg, 4, pp=2, dp=2, batch_size=8, microbatches=4)
    job = workers.pp_compose.run(workers.pp_compose.PPComposeConfig(part="dp_pp", ...), nproc=4)
    check = workers.dp_pp_report.check_dp_pp(job)
    print(check.describe())
    workers.dp_pp_report.plot_dp_pp(check)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from labkit.config import ModelConfig
from labkit.jobs.launch import JobResult
from labkit.parallel import pipeline

ZERO1_BUFFERS = 2
"""labkit's ZeRO1 keeps one flat buffer per AdamW group: with and without weight decay."""


@dataclass(frozen=True)
class DpPpPrediction:
    """The dp traffic of each stage per optimizer step under every gradient sync
    (``pipeline.dp_sync_per_step``), and the AdamW state per rank, from the stage sizes."""

    pp: int
    dp: int
    batch_size: int
    microbatches: int
    bounds: list[tuple[int, int]]
    """Each stage's blocks [start, end)."""
    stage_params: list[int]
    syncs: dict[int, dict[str, dict[str, Any]]]
    """{stage: {sync: dp_sync_per_step's result}}."""
    zero3_over_zero1: float
    """ZeRO-3's bytes per step over ZeRO-1's, gathering per micro-batch (3m/2)."""

    def describe(self) -> str:
        dp, m, B = self.dp, self.microbatches, self.batch_size
        lines = [f"mesh ('pp', 'dp') = ({self.pp}, {dp}); each replica runs {B // dp} of the {B} "
                 f"sequences as m = {m} micro-batches; stages (blocks): {self.bounds}",
                 "",
                 f"predicted dp traffic per stage per optimizer step (fp32 gradients, ring formulas, "
                 f"d = {dp}; zero1: a reduce-scatter and an all-gather for each of its "
                 f"{ZERO1_BUFFERS} flat buffers):",
                 f"{'stage':>5} {'params':>9} | {'sync':<15} {'calls':>5} {'sent per rank':>14}"]  # fmt: skip
        for s, P in enumerate(self.stage_params):
            for sync, pred in self.syncs[s].items():
                lines.append(f"{s:>5} {P:>9,} | {sync:<15} {pred['calls']:>5} "
                             f"{pred['sent_per_rank'] / 1e6:>11.3f} MB")  # fmt: skip
        P0 = self.stage_params[0]
        lines += ["",
                  f"predicted AdamW state per rank: {8 * P0 / 1e6:.3f} MB replicated (stage 0), "
                  f"{8 * P0 / dp / 1e6:.3f} MB with ZeRO-1 over dp = {dp}",
                  f"ZeRO-3 would send {self.zero3_over_zero1:.0f}x ZeRO-1's bytes per step at m = {m} "
                  "(3m/2) if it gathered per micro-batch: predicted, not run here (deferred as "
                  "torch's PipelineStage does, it sends ZeRO-1's bytes and keeps the gathered "
                  "parameters)"]  # fmt: skip
        return "\n".join(lines)


def predict_dp_pp(
    model_cfg: ModelConfig, nproc: int, pp: int, dp: int, batch_size: int, microbatches: int
) -> DpPpPrediction:
    """The layout checked (``pipeline.validate_dp_pp``, before any process group), the GPT cut
    into ``pp`` stages (``pipeline.partition``), and each stage's dp traffic predicted."""
    m = microbatches
    pipeline.validate_dp_pp(model_cfg, nproc, pp, dp, batch_size, m)
    bounds = pipeline.partition(model_cfg, pp)
    params = [int(c) for c in pipeline.stage_costs(model_cfg, bounds)]  # parameters per stage
    syncs = {
        s: {sync: pipeline.dp_sync_per_step(P, dp, m, sync,
                                            buffers=ZERO1_BUFFERS if sync == "zero1" else 1)
            for sync in pipeline.DP_SYNCS}
        for s, P in enumerate(params)
    }  # fmt: skip
    ratio = (pipeline.dp_sync_per_step(1, dp, m, "zero3")["sent_per_rank"]
             / pipeline.dp_sync_per_step(1, dp, m, "zero1")["sent_per_rank"])  # fmt: skip
    return DpPpPrediction(pp=pp, dp=dp, batch_size=batch_size, microbatches=m,
                          bounds=[tuple(b) for b in bounds], stage_params=params, syncs=syncs,
                          zero3_over_zero1=ratio)  # fmt: skip


@dataclass(frozen=True)
class DpPpCheck:
    """Each rank's collectives of the last step (counted by our wrappers) and its optimizer
    state, against the prediction; parity of both syncs with one process; and when each
    rank's dp all-reduce ran."""

    dp: int
    rows: tuple[dict[str, Any], ...]
    """One per rank and sync: rank, stage, pp_group, dp_group, sync, calls, calls_pred, msg,
    msg_pred (mean message bytes), opt, opt_pred (optimizer state bytes)."""
    errors: dict[str, dict[str, float]]
    """{sync: the largest loss_error, grad_error, weight_error over the ranks (NaN: no full
    gradient on a rank)}."""
    spans: tuple[dict[str, Any], ...]
    """One per rank: rank, stage, dp_rank, last_backward_end_s, sync_start_s, sync_end_s (the
    all_reduce run's; seconds since the step's start)."""
    events: tuple[dict[str, Any], ...] = ()
    """Rank 0's copy of every rank's F and B events (the timeline)."""

    @property
    def calls_ok(self) -> bool:
        return all(row["calls"] == row["calls_pred"] for row in self.rows)

    @property
    def memory_ratio(self) -> list[float]:
        """ZeRO-1's optimizer state over the replicated one's, rank by rank."""
        opt = {(row["rank"], row["sync"]): row["opt"] for row in self.rows}
        return [opt[r, "zero1"] / opt[r, "all_reduce"] for r in sorted({k[0] for k in opt})]

    @property
    def parity(self) -> bool:
        return all(e["loss_error"] < 1e-4 and e["weight_error"] < 1e-3
                   and not e["grad_error"] >= 1e-5 for e in self.errors.values())  # fmt: skip

    def describe(self) -> str:
        lines = [f"{'rank':>4} {'stage':>5} {'pp group':>9} {'dp group':>9} | {'sync':<10} "
                 f"{'calls counted/pred':>18} {'bytes counted/pred (MB)':>24} "
                 f"{'opt. state (MB) meas/pred':>26}"]  # fmt: skip
        for w in self.rows:
            lines.append(f"{w['rank']:>4} {w['stage']:>5} {w['pp_group']!s:>9} {w['dp_group']!s:>9} | "
                         f"{w['sync']:<10} {w['calls']:>9} / {w['calls_pred']:<6} "
                         f"{w['msg'] / 1e6:>11.4f} / {w['msg_pred'] / 1e6:<10.4f} "
                         f"{w['opt'] / 1e6:>11.4f} / {w['opt_pred'] / 1e6:.4f}")  # fmt: skip
        ratio = self.memory_ratio
        lines += ["(bytes: the message each collective carries, counted by our wrappers; ZeRO-1's "
                  "flat buffers are padded to a multiple of dp)",
                  f"counted calls {'equal' if self.calls_ok else 'DIFFER FROM'} the predicted ones "
                  f"on every rank; ZeRO-1 optimizer state / replicated, measured: "
                  f"{min(ratio):.4f}..{max(ratio):.4f} (predicted 1/dp = {1 / self.dp:.4f})",
                  "",
                  "parity with one process (same seed, whole batch, one AdamW step), max over ranks:"]  # fmt: skip
        for sync, e in self.errors.items():
            grad = ("n/a (each rank keeps only its shard's mean)" if e["grad_error"] != e["grad_error"]
                    else f"{e['grad_error']:.1e}")  # fmt: skip
            lines.append(f"  {sync:<10} |loss diff| {e['loss_error']:.1e}, |grad diff| {grad}, "
                         f"|weight diff after the step| {e['weight_error']:.1e}")  # fmt: skip
        lines.append(("→ the counts are exact" if self.calls_ok else "→ the counts DIFFER from the prediction")
                     + " and " + ("parity holds to float32 rounding (|loss diff| < 1e-4, |grad diff| "
                                  "< 1e-5, |weight diff| < 1e-3)" if self.parity
                                  else "parity FAILS: see the rows above"))  # fmt: skip
        for a in self.spans:
            lines.append(f"rank {a['rank']} (stage {a['stage']}): last backward ended "
                         f"{1e3 * a['last_backward_end_s']:.1f} ms, dp all-reduce "
                         f"{1e3 * a['sync_start_s']:.1f} -> {1e3 * a['sync_end_s']:.1f} ms (measured)")  # fmt: skip
        return "\n".join(lines)


def check_dp_pp(job: JobResult) -> DpPpCheck:
    """``job`` (pp_compose's "dp_pp" part) held against the predictions its ranks carry."""
    dp = int(job.config["dp"])
    rows = []
    for r in job.ranks:
        for sync, run_ in r["runs"].items():
            counted = run_["counted"]["last_step"]
            pred = run_["predicted"]
            rows.append({
                "rank": r["rank"], "stage": r["stage"], "pp_group": r["pp_group"],
                "dp_group": r["dp_group"], "sync": sync,
                "calls": sum(v["calls"] for v in counted.values()), "calls_pred": pred["calls"],
                "msg": sum(v["message_bytes"] for v in counted.values()) / len(counted),
                "msg_pred": pred["message_bytes"],
                "opt": run_["optimizer_state_bytes"],
                "opt_pred": 8 * run_["stage_params"] / (dp if sync == "zero1" else 1),
            })  # fmt: skip
    errors = {sync: {k: max(r["runs"][sync][k] for r in job.ranks)
                     for k in ("loss_error", "grad_error", "weight_error")}
              for sync in ("all_reduce", "zero1")}  # fmt: skip
    keys = ("last_backward_end_s", "sync_start_s", "sync_end_s")
    spans = tuple({"rank": r["rank"], "stage": r["stage"], "dp_rank": r["dp_rank"],
                   **{k: r["runs"]["all_reduce"][k] for k in keys}} for r in job.ranks)  # fmt: skip
    return DpPpCheck(dp=dp, rows=tuple(rows), errors=errors, spans=spans,
                     events=tuple(job.rank(0)["events"]))  # fmt: skip


def plot_dp_pp(check: DpPpCheck, ax: Any = None) -> Any:
    """The measured 1F1B timeline of both pipelines, each rank's dp all-reduce drawn over it
    in red."""
    import matplotlib.pyplot as plt

    from labkit.parallel.timeline import plot_timeline

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2.6))
    plot_timeline(check.events, ax=ax, title="1F1B on two pipelines, then the dp all-reduce (measured)")
    for a in check.spans:
        ax.barh(a["rank"], 1e3 * (a["sync_end_s"] - a["sync_start_s"]), left=1e3 * a["sync_start_s"],
                height=0.8, color="#d62728", alpha=0.6)  # fmt: skip
    ax.set_yticks(range(len(check.spans)), [f"rank {a['rank']} (stage {a['stage']}, replica {a['dp_rank']})"
                                           for a in check.spans])  # fmt: skip
    ax.set_xlabel("time since the step's start (ms); red: gradient all-reduce over dp")
    return ax
