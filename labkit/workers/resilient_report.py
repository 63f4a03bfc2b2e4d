"""Notebook 02b's section 4, told: a job killed mid-run and resumed, held against its prediction
and against the same job never killed; a checkpoint resharded; the two kinds of save; how often
to save. Each a frozen result with ``describe()``, or a ``describe_...`` function beside one.

Apart from :mod:`labkit.workers.resilient_train`, which every rank of the job runs: this module
runs in the notebook's kernel, on the ``JobResult`` those ranks returned and the files they left
(the losses and events lines, the final weights). The sentences are chosen by the measurements
(with ``labkit.verdict`` where two measured samples of save times meet), never written in
advance::

    model, opt = resilient_report.build(model_cfg)
    predicted = checkpoint.predict_bytes(**checkpoint.count(model, opt))
    bandwidth = checkpoint.write_bandwidth(folder, predicted["bytes"])
    forecast = resilient_report.forecast(model, predicted, bandwidth, kill_rank=1,
                                         kill_at_step=10, every=4)
    resumed = resilient_report.compare(killed, clean, forecast)   # two resilient_train.run results
    resilient_report.plot_resume(resumed)
    print(resumed.describe())
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from labkit import formulas, verdict
from labkit.config import ModelConfig, TrainConfig
from labkit.jobs.launch import JobResult
from labkit.model import GPT
from labkit.train import make_optimizer
from labkit.workers.resilient_train import DEFAULT_MODEL, read_jsonl

# The restart's stages, as rank 0 of the second attempt records them in events.jsonl.
RESTART_STAGES = (
    ("process_start", "new rank 0 started: failure seen, old ranks stopped, agents met again"),
    ("pg_up", "its process group up: torch imported, init_process_group"),
    ("checkpoint_loaded", "the checkpoint loaded"),
    ("first_step", "its first step done"),
)


def build(model: Mapping[str, Any]) -> tuple[GPT, torch.optim.Optimizer]:
    """The job's GPT (``model``'s fields over resilient_train's ``DEFAULT_MODEL``) and an AdamW
    for it (``TrainConfig``'s defaults), built in this process: the shapes and the state a
    checkpoint of that job holds."""
    gpt = GPT(ModelConfig(**{**DEFAULT_MODEL, **model}))
    return gpt, make_optimizer(gpt, TrainConfig())


# --- before the job: what a checkpoint costs, what a kill loses ----------------------------------


@dataclass(frozen=True)
class Forecast:
    """A checkpoint's bytes (predicted) and the disk's speed (measured), and the steps a planted
    kill loses (:func:`forecast`)."""

    n_params: int
    predicted: dict[str, Any]
    """``checkpoint.predict_bytes``'s answer: bytes, payload_bytes, method."""
    bandwidth_bytes_per_s: float
    """One fsync'd write of the checkpoint's size (``checkpoint.write_bandwidth``)."""
    kill_rank: int
    kill_at_step: int
    every: int

    @property
    def lost_steps(self) -> int:
        """Steps since the last checkpoint: ``kill_at_step mod every``."""
        return formulas.predicted_lost_steps(self.kill_at_step, self.every)

    @property
    def save_s(self) -> float:
        """The predicted save time if the disk were all that mattered."""
        return self.predicted["bytes"] / self.bandwidth_bytes_per_s

    def describe(self) -> str:
        return "\n".join([
            f"model: {self.n_params:,} parameters",
            f"predicted checkpoint: {self.predicted['bytes']:,} B ({self.predicted['method']})",
            f"measured: this disk writes {self.bandwidth_bytes_per_s / 1e6:.0f} MB/s (one fsync'd "
            "write of that size)",
            f"predicted save time, disk only: {self.save_s * 1e3:.1f} ms",
            f"predicted: rank {self.kill_rank} killed after step {self.kill_at_step}, checkpoints "
            f"every {self.every} steps: the last one holds step "
            f"{self.kill_at_step - self.lost_steps}, {self.lost_steps} steps lost and trained again",
        ])  # fmt: skip


def forecast(model: torch.nn.Module, predicted: dict[str, Any], bandwidth_bytes_per_s: float, *,
             kill_rank: int, kill_at_step: int, every: int) -> Forecast:  # fmt: skip
    """What section 4 predicts for a job of ``model`` killed at ``kill_at_step``, checkpointing
    every ``every`` steps, from the checkpoint's predicted bytes and the measured disk speed."""
    n_params = sum(p.numel() for p in model.parameters())
    return Forecast(n_params, predicted, bandwidth_bytes_per_s, kill_rank, kill_at_step, every)


# --- after the job: killed and resumed, against the same job never killed -----------------------


@dataclass(frozen=True)
class Resumed:
    """A job killed and resumed, beside the same job run without a failure (:func:`compare`)."""

    killed: dict[str, Any]
    """The killed job's rank-0 result (resilient_train's fields)."""
    clean: dict[str, Any]
    losses: list[dict[str, Any]]
    """The killed job's losses.jsonl: step, loss, attempt."""
    clean_losses: list[dict[str, Any]]
    events: list[dict[str, Any]]
    """The killed job's events.jsonl: event, rank, attempt, time."""
    final_params: dict[str, torch.Tensor]
    """The killed-and-resumed job's trained weights, by name."""
    clean_params: dict[str, torch.Tensor]
    forecast: Forecast

    def restart_stages(self) -> list[tuple[str, float]]:
        """(stage, seconds after the kill) for each stage rank 0 of the second attempt reached."""
        first: dict[str, float] = {}
        for e in self.events:
            if e["attempt"] == 2 and e["rank"] == 0:
                first.setdefault(e["event"], e["time"])
        t0 = next(e["time"] for e in self.events if e["event"] == "kill")
        return [(what, first[name] - t0) for name, what in RESTART_STAGES if name in first]

    @property
    def restart_s(self) -> float | None:
        """From the kill to the first step done again (measured; None if not recorded)."""
        stages = self.restart_stages()
        return stages[-1][1] if stages else None

    def describe(self) -> str:
        """Lost steps, the steps trained twice, the final weights, the checkpoint's size and save
        time against the forecast, and the restart's timeline from the kill."""
        k, ck, f = self.killed, self.killed["checkpoint"], self.forecast
        a, b = self.final_params, self.clean_params
        bitwise = all(torch.equal(a[n], b[n]) for n in a)
        weight_gap = max((a[n] - b[n]).abs().max().item() for n in a)
        twice = {e["step"]: e["loss"] for e in self.losses if e["attempt"] == 1}
        again = [(e["loss"], twice[e["step"]]) for e in self.losses
                 if e["attempt"] == 2 and e["step"] in twice]  # fmt: skip
        disk_s = ck["bytes"] / f.bandwidth_bytes_per_s
        lines = [
            f"attempts: {k['attempts']} (one restart); lost steps: measured {k['lost_steps']}, "
            f"predicted {k['lost_steps_predicted']}: "
            + ("agree" if k["lost_steps"] == k["lost_steps_predicted"] else "DISAGREE"),
            f"the {len(again)} lost steps, trained twice, gave the same loss both times: "
            + ("yes, bitwise" if all(x == y for x, y in again) else
               f"to {max(abs(x - y) for x, y in again):.1e}" if again else "(none)"),
            "final weights of the killed-and-resumed job vs the uninterrupted one: "
            + ("bitwise identical" if bitwise else
               f"within rounding (max |diff| {weight_gap:.1e})" if weight_gap < 1e-4 else
               f"DIFFERENT (max |diff| {weight_gap:.1e}): the resume lost some state")
            + f" ({len(a)} tensors)",
            f"checkpoint size: measured {ck['bytes']:,} B, predicted {f.predicted['bytes']:,} B "
            f"({ck['bytes'] / f.predicted['bytes'] - 1:+.1%}); of which 12 B/param: "
            f"{f.predicted['payload_bytes']:,} B",
            f"save time: measured {ck['seconds'] * 1e3:.0f} ms on rank 0 (the last save, one "
            f"sample), predicted {disk_s * 1e3:.1f} ms for the disk alone: {ck['seconds'] / disk_s:.1f}x",
            "",
            "from the kill, one restart (measured, one clock on this machine):",
        ]  # fmt: skip
        stages = self.restart_stages()
        lines += [f"  +{at:6.2f} s  {what}" for what, at in stages]
        if stages:
            parts = {what: at - before for (what, at), before
                     in zip(stages, [0.0] + [at for _, at in stages[:-1]], strict=True)}  # fmt: skip
            longest = max(parts, key=parts.get)
            lines.append(f"the longest part of this restart (one sample): '{longest}', "
                         f"{parts[longest]:.2f} of {stages[-1][1]:.2f} s")
        return "\n".join(lines)

    def describe_reshard(self, loaded: dict[str, Any], model: torch.nn.Module,
                         optimizer: torch.optim.Optimizer) -> str:  # fmt: skip
        """``checkpoint.load_resharded``'s answer, and whether ``model`` now holds this job's
        final weights bit for bit."""
        weights = dict(model.named_parameters())
        same = all(torch.equal(weights[n].detach(), self.final_params[n]) for n in self.final_params)
        return "\n".join([
            "files it read (measured bytes): "
            + ", ".join(f"{n} {b:,} B" for n, b in loaded["files"].items()),
            f"saved by {loaded['saved_by']} ranks, loaded by {loaded['loaded_by']}: the weights are "
            + ("bitwise equal to the job's final weights (as predicted)" if same else
               "NOT equal to the job's final weights: read why")
            + f"; optimizer state for {len(optimizer.state)} parameters restored",
        ])  # fmt: skip


def compare(killed: JobResult, clean: JobResult, forecast: Forecast) -> Resumed:
    """Read both jobs' results and files (losses, events, final weights)."""
    k, c = killed.result, clean.result
    return Resumed(k, c, read_jsonl(k["losses_file"]), read_jsonl(c["losses_file"]),
                   read_jsonl(k["events_file"]), torch.load(k["final_params"]),
                   torch.load(c["final_params"]), forecast)  # fmt: skip


def plot_resume(resumed: Resumed, ax: Any = None) -> Any:
    """Both jobs' losses per step: each attempt of the killed one, the lost steps shaded, the
    kill and every checkpoint marked; on ``ax`` (a new figure if None)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.6))
    k, f = resumed.killed, resumed.forecast
    ax.plot([e["step"] for e in resumed.clean_losses], [e["loss"] for e in resumed.clean_losses],
            c="grey", lw=7, alpha=0.35, label="the same job, never killed (measured)")
    for attempt, style, size in ((1, "o-", 4), (2, "s--", 8)):
        pts = [e for e in resumed.losses if e["attempt"] == attempt]
        ax.plot([e["step"] for e in pts], [e["loss"] for e in pts], style, ms=size, mfc="none",
                label=f"attempt {attempt}" + (" (killed)" if attempt == 1 else " (after the restart)"))
    ax.axvspan(k["resumed_from_step"] + 0.5, f.kill_at_step + 0.5, color="tab:red", alpha=0.12,
               label=f"steps lost: {k['lost_steps']} (trained twice)")
    ax.axvline(f.kill_at_step + 0.5, c="tab:red", lw=1)
    for s in range(f.every, k["steps"] + 1, f.every):
        ax.axvline(s, c="k", ls=":", lw=0.8)
    ax.set(xlabel="optimizer step (dotted: a checkpoint saved)", ylabel="training loss (nats)",
           title="a rank killed mid-run, restarted, resumed from the last checkpoint (measured)")
    ax.legend(fontsize=8)
    return ax


# --- how long a save stops training, and how often to save ---------------------------------------

SAVE_MODES = (
    ("sync_s", "dcp.save: training waits for the whole write"),
    ("async_blocking_s", "dcp.async_save: training waits until it returns (staging)"),
    ("async_total_s", "dcp.async_save: until the background write finished"),
)


def describe_save_modes(save_modes: Mapping[str, Any]) -> str:
    """``checkpoint.time_save_modes``'s answer: each kind of save's median, min and max, and
    labkit.verdict's reading of async_save's blocking time against a synchronous save."""
    rounds = len(save_modes["sync_s"])
    lines = [f"one save: {save_modes['bytes']:,} B (measured); {rounds} rounds, each kind in turn"]
    for key, what in SAVE_MODES:
        v = save_modes[key]
        lines.append(f"  {what:<58} median {statistics.median(v) * 1e3:7.1f} ms (min "
                     f"{min(v) * 1e3:.1f}, max {max(v) * 1e3:.1f})")
    lines.append(str(verdict.compare_times(save_modes["async_blocking_s"], save_modes["sync_s"],
                                           names=("async_save's blocking time",
                                                  "a synchronous save"))))  # fmt: skip
    return "\n".join(lines)


@dataclass(frozen=True)
class CheckpointPlans:
    """Young's interval and the time lost, per kind of save (:func:`plan_checkpoints`)."""

    mtbf_s: float
    mtbf_source: str
    restart_s: float
    rows: tuple[tuple[str, float, float, float, float], ...]
    """(label, blocking seconds δ, restart seconds R, interval τ, share of the time lost)."""

    def describe(self) -> str:
        lines = [f"(mean time between failures: {self.mtbf_s / 3600:.1f} h, {self.mtbf_source}; "
                 f"restart {self.restart_s:.1f} s, measured above)"]
        for label, save_s, restart_s, tau, waste in self.rows:
            daly = formulas.daly_checkpoint_interval(save_s, self.mtbf_s)
            lines.append(f"{label}: δ = {save_s:.3g} s -> every {tau / 60:.1f} min (Daly: "
                         f"{daly / 60:.1f} min), losing {waste:.2%} of the time, of which the "
                         f"restarts {restart_s / self.mtbf_s:.2%} (predicted)")
        (_, sync_s, _, tau_s, w_s), (_, async_s, _, tau_a, w_a) = self.rows[:2]
        if async_s < sync_s:
            lines.append(f"\nWith the asynchronous save's shorter stop, the plan saves "
                         f"{tau_s / tau_a:.1f}x as often and loses {w_s - w_a:.2%} less of the "
                         "time (predicted from measured δ and R).")
        else:
            lines.append("\nHere the asynchronous save did not stop training for less than the "
                         "synchronous one (its staging copy took as long as the small write): no "
                         "gain at this size.")
        return "\n".join(lines)


def plan_checkpoints(plan: Callable[[float, float, float], tuple[float, float]],
                     save_modes: Mapping[str, Any], restart_s: float | None, mtbf_s: float, *,
                     mtbf_source: str, large_save_s: float = 60.0,
                     large_restart_s: float = 600.0) -> CheckpointPlans:  # fmt: skip
    """``plan(blocking_s, restart_s, mtbf_s) -> (interval, waste)`` (exercise
    02b.checkpoint_plan) on this job's two kinds of save (their measured medians, the measured
    restart; 0 if none was recorded) and on a large model's synchronous save (assumed)."""
    restart = restart_s if restart_s is not None else 0.0
    cases = (
        ("synchronous save (measured median)", statistics.median(save_modes["sync_s"]), restart),
        ("asynchronous save, its blocking part (measured median)",
         statistics.median(save_modes["async_blocking_s"]), restart),
        (f"a large model's synchronous save, {large_save_s:.0f} s (assumed), "
         f"{large_restart_s / 60:.0f} min restart (assumed)", large_save_s, large_restart_s),
    )  # fmt: skip
    rows = tuple((label, save_s, r, *plan(save_s, r, mtbf_s)) for label, save_s, r in cases)
    return CheckpointPlans(mtbf_s, mtbf_source, restart, rows)
