"""Pipeline-parallel GPT: every schedule on the same batch, timed per micro-batch.

    pp_train.run(pp_train.PPTrainConfig(microbatches=(1, 2, 4, 8), schedules=("gpipe", "1f1b")),
                 nproc=2)

Rank r runs stage r of the GPT (``labkit.parallel.pipeline``). For each schedule and each
micro-batch count m the worker runs ``warmup`` untimed steps, then ``repeats`` timed ones, all
on the same batch and without an optimiser update, so every schedule computes the very same
loss and gradients (the parity test checks them against a single-process GPT).

Config (:class:`PPTrainConfig`, every field optional):
    model         ModelConfig fields (default: seq_len 32, 4 layers, 2 heads, d_model 64, tied)
    batch_size    sequences per step, B (default 8); split into m micro-batches of B/m
    microbatches  m, an int or a list of ints to sweep (default 4); "naive" always uses 1
    schedules     names from pipeline.SCHEDULES (default: all five)
    partition_by  "params" or "time" (time: measured on this machine first) (default params)
    seed          model init and batch (default 0)
    warmup, repeats   untimed and timed steps per (schedule, m) (default 1 and 3)
    save_grads    write each schedule's gradients to the job directory (default false)

Result per rank: bounds, and one entry per (schedule, m) in ``runs`` with the loss, median
step time (and every timed step's, ``steps_s``), measured bubble (this rank, and the mean over ranks) next to the formulas, and the
stage's activation memory measured and predicted. Rank 0 also returns ``events``: every
rank's F/B events of the last timed step of each run, keyed "schedule/m", for
``timeline.plot_timeline``.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as tdist

from labkit import data, formulas, validate
from labkit.config import ModelConfig
from labkit.jobs import runtime
from labkit.model import GPT
from labkit.parallel import pipeline
from labkit.parallel.timeline import bubble_from_events, common_t0
from labkit.workers import job_config
from labkit.workers.job_config import GPTJobConfig, some_of

if TYPE_CHECKING:
    from labkit.jobs import launch

DEFAULT_MODEL = {"seq_len": 32, "n_layer": 4, "n_head": 2, "d_model": 64}
PARTITIONS = ("params", "time")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPTrainConfig(GPTJobConfig):
    """Every pipeline schedule on one batch (the fields are the docstring's list)."""

    WORKER: ClassVar[str] = "labkit.workers.pp_train"
    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(**DEFAULT_MODEL))
    batch_size: int = 8
    """Sequences per step, B, split into m micro-batches of B/m."""
    microbatches: int | tuple[int, ...] = 4
    """m, or the counts to sweep (stored as a tuple)."""
    schedules: tuple[str, ...] = tuple(pipeline.SCHEDULES)
    """Names from ``pipeline.SCHEDULES``, run in this order."""
    partition_by: str = "params"
    """Cut the model into stages by "params" or by "time" (measured here first)."""
    warmup: int = 1
    """Untimed steps per (schedule, m)."""
    repeats: int = 3
    """Timed steps per (schedule, m)."""
    save_grads: bool = False
    """Write each schedule's gradients to the job directory."""

    def __post_init__(self) -> None:
        super().__post_init__()
        ms = self.microbatches
        ms = (ms,) if isinstance(ms, int) and not isinstance(ms, bool) else ms
        # one shape for the worker: a tuple
        object.__setattr__(self, "microbatches", job_config.counts("microbatches", ms))
        some_of("schedules", self.schedules, pipeline.SCHEDULES)
        validate.one_of("partition_by", self.partition_by, PARTITIONS)
        validate.whole("warmup", self.warmup, low=0)
        validate.whole("repeats", self.repeats, low=1)
        validate.flag("save_grads", self.save_grads)


def run(config: PPTrainConfig, *, nproc: int = 2, **launch_options: Any) -> launch.JobResult:
    """Launch ``config`` on ``nproc`` ranks; ``launch_options`` go to ``launch.run``."""
    from labkit.jobs import launch  # the caller's side: a rank never imports the launcher
    return launch.run(config, nproc=nproc, **launch_options)


def make_batch(cfg: ModelConfig, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch every rank (and the single-process reference) uses: real text, seeded."""
    g = torch.Generator().manual_seed(seed)
    return data.get_batch(data.load_splits().train, batch_size, cfg.seq_len, g)


def build_model(cfg: ModelConfig, seed: int) -> GPT:
    """The GPT every rank builds before keeping its stage: same seed, same weights."""
    torch.manual_seed(seed)
    return GPT(cfg)


def grads_by_name(stage: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The stage's gradients by name, on the CPU: the parity test compares them with a CPU
    reference, which ``assert_close`` refuses for tensors on another device."""
    return {
        n: p.grad.detach().cpu().clone() for n, p in stage.named_parameters() if p.grad is not None
    }


def unit_times(model: GPT, x: torch.Tensor, device: torch.device) -> list[float]:
    """``pipeline.measure_unit_times`` on ``device``: the model moves there with its input.

    ``model.to`` works in place: the whole model stays on the device until ``Pipeline`` has
    copied this rank's stage out of it and ``del model`` frees it.
    """
    model.to(device)
    return pipeline.measure_unit_times(model, x.to(device))


def _counts(schedule: str, ms: list[int], p: int) -> list[int]:
    """The micro-batch counts a sweep runs ``schedule`` with: naive always runs one; torch's
    Schedule1F1B refuses m < p, so a sweep leaves those out (a single m < p still fails)."""
    if schedule == "naive":
        return [1]
    if schedule == "torch_1f1b" and any(m >= p for m in ms):
        return sorted({m for m in ms if m >= p})
    return sorted(set(ms))


@runtime.entrypoint
def main(ctx: runtime.Context) -> dict[str, Any]:
    job = PPTrainConfig.from_dict(ctx.config)
    cfg = job.model  # on the byte corpus (vocab_size >= 256), checked before setup
    B, ms, schedules, seed = job.batch_size, list(job.microbatches), job.schedules, job.seed
    warmup, repeats = job.warmup, job.repeats
    p = ctx.world_size
    runtime.require_gpu_backend(ctx.backend, ctx.device.type, "pipeline stages exchange "
                             "activations with send/recv")  # fmt: skip
    plan = {name: _counts(name, ms, p) for name in schedules}
    for name, counts in plan.items():  # fail before any work, with the launcher's clear message
        for m in counts:
            pipeline.validate_pipeline(cfg, p, B, m, name)

    model = build_model(cfg, seed)
    x, y = make_batch(cfg, B, seed)
    times = None
    if job.partition_by == "time":
        times = unit_times(model, x, ctx.device)
        # Every rank must cut the model the same way: use rank 0's measurement.
        box = [times]
        tdist.broadcast_object_list(box, src=0)
        times = box[0]
    bounds = pipeline.partition(cfg, p, by=job.partition_by, times=times)
    pipe = pipeline.Pipeline(model, bounds, rank=ctx.rank, device=ctx.device)
    del model
    ctx.print0(f"stages (blocks): {bounds}")

    runs, events_by_run = [], {}
    total = sum(len(c) for c in plan.values()) * (warmup + repeats)
    done = 0
    for name, counts in plan.items():
        for m in counts:
            steps_s, bubbles, mean_bubbles, loss = [], [], [], float("nan")
            for i in range(warmup + repeats):
                pipe.timeline.t0 = common_t0()  # a start every rank shares, per step
                with ctx.phase(f"{name} m={m}"):  # p2p waits are collective-like waits
                    loss = pipe.step(name, x, y, m)
                all_events = [None] * p
                tdist.all_gather_object(all_events, pipe.timeline.events)
                events = [e for rank_events in all_events for e in rank_events]
                done += 1
                ctx.heartbeat(step=done, total=total)
                if i < warmup:
                    continue
                per_rank = bubble_from_events(events)
                steps_s.append(per_rank[ctx.rank]["step_s"])
                bubbles.append(per_rank[ctx.rank]["bubble"])
                mean_bubbles.append(statistics.fmean(r["bubble"] for r in per_rank.values()))
                events_by_run[f"{name}/{m}"] = events
            if job.save_grads and ctx.job_dir is not None:
                torch.save(
                    {"loss": loss, "grads": grads_by_name(pipe.stage)},
                    ctx.job_dir / f"pp_{name}_m{m}_rank{ctx.rank}.pt",
                )
            runs.append(
                {
                    "schedule": name,
                    "m": m,
                    "loss": loss,
                    "step_s": statistics.median(steps_s),
                    "steps_s": steps_s,  # every timed step, for a verdict with spread
                    "bubble": statistics.median(bubbles),
                    "bubble_mean": statistics.median(mean_bubbles),
                    "bubble_formula": formulas.bubble_fraction(p, m),
                    "overhead_formula": formulas.bubble_overhead(p, m),
                    "activations": pipe.activation_summary(name, m),
                }
            )
            ctx.print0(
                f"{name:>10} m={m}: loss {loss:.4f}, bubble {runs[-1]['bubble_mean']:.2f}"
                f" (formula {runs[-1]['bubble_formula']:.2f})"
            )
    result: dict[str, Any] = {
        "rank": ctx.rank,
        "p": p,
        "bounds": bounds,
        "stage_params": sum(t.numel() for t in pipe.stage.parameters()),
        "runs": runs,
    }
    if ctx.rank == 0:
        result["events"] = events_by_run
    return result


# --- what notebook 03 shows of a finished job -------------------------------------------------
#
# Read in the notebook's kernel, never on a rank: each result holds what the job returned and
# the figures the notebook prints (``describe()``); matplotlib is imported only to draw.

LABELS = {"naive": "naive", "gpipe": "GPipe", "1f1b": "1F1B"}


def _monitor_turns(monitor: Any, p: int, step_s: float) -> str:
    """What a live monitor saw of p ranks taking turns: CPU ranks per process, GPUs by NVML."""
    if monitor.kind == "cpu":  # at each sample, was one rank (nearly) idle while another worked?
        sources, by_time = {f"rank{r}" for r in range(p)}, {}
        for sample in monitor.samples:
            if sample.source in sources and sample.get("cpu_pct") is not None:
                by_time.setdefault(sample.time_s, {})[sample.source] = sample.get("cpu_pct")
        pairs = [sorted(v.values()) for v in by_time.values() if len(v) == p]
        turns = sum(v[0] < 10 and v[-1] > 40 for v in pairs)
        return (f"monitor (measured): in {turns} of {len(pairs)} samples one rank used < 10% of "
                f"a core while the other used > 40%; a step took {step_s * 1e3:.0f} ms, a sample "
                f"spans {monitor.period_s:g} s")
    util: dict[str, list[float]] = {}  # one source per device: "gpu0" is rank 0's GPU (cuda:0)
    gpu_sources = {f"gpu{r}" for r in range(p)}
    for sample in monitor.samples:
        if sample.source in gpu_sources and sample.get("gpu_util_pct") is not None:
            util.setdefault(sample.source, []).append(sample.get("gpu_util_pct"))
    shown = ", ".join(f"{src} {sum(v) / len(v):.0f}%" for src, v in sorted(util.items()))
    return (f"monitor (measured, {monitor.kind}): mean GPU utilisation {shown or 'not reported'}; "
            "a GPU waiting in NCCL's recv runs a kernel that polls for the data, which NVML "
            "counts as busy, so the turns show in the timeline, not here")


@dataclasses.dataclass(frozen=True)
class NaiveSplit:
    """The naive split (one micro-batch) measured: each rank's busy time in its step, against
    the predicted idle share, and what a live monitor saw of the ranks taking turns."""

    events: list[dict[str, Any]]
    """Every rank's F/B events of the last timed step."""
    predicted: float
    """The idle share the bubble formula predicts at m = 1, (p−1)/p."""
    monitor_line: str = ""
    """What the monitor saw ("" when there was none)."""

    @classmethod
    def from_job(cls, job: Any, predicted: float, monitor: Any = None) -> NaiveSplit:
        """From a finished ``schedules=("naive",)`` job and the monitor that watched it."""
        events = job.rank(0)["events"]["naive/1"]
        split = cls(events, predicted)
        if monitor is None:
            return split
        turns = _monitor_turns(monitor, job.world_size, split.per_rank[0]["step_s"])
        return dataclasses.replace(split, monitor_line=turns)

    @property
    def per_rank(self) -> dict[int, dict[str, float]]:
        """{rank: busy_s, idle_s, step_s, bubble} (``timeline.bubble_from_events``)."""
        return bubble_from_events(self.events)

    @property
    def measured(self) -> float:
        """The bubble measured, averaged over ranks."""
        return statistics.fmean(v["bubble"] for v in self.per_rank.values())

    def describe(self) -> str:
        lines = [f"measured: rank {r} busy {v['busy_s'] * 1e3:.1f} ms of a {v['step_s'] * 1e3:.1f} "
                 f"ms step -> idle {v['bubble']:.0%} (predicted {self.predicted:.0%})"
                 for r, v in self.per_rank.items()]
        return "\n".join([*lines, self.monitor_line] if self.monitor_line else lines)


def plot_naive_split(split: NaiveSplit, ax: Any = None) -> Any:
    """The naive step's timeline (``timeline.plot_timeline``); returns the Axes."""
    from labkit.parallel.timeline import plot_timeline

    return plot_timeline(split.events, ax=ax, title="naive split, one step (measured)")


@dataclasses.dataclass(frozen=True)
class Bubbles:
    """One schedule's bubble at each m (mean over ranks, median over steps) against the
    formula (p−1)/(m+p−1)."""

    schedule: str
    p: int
    measured: dict[int, float]
    """{m: bubble measured}."""
    device: str = "cpu"

    def describe(self) -> str:
        lines = []
        if self.device.startswith("cuda"):  # the probe's own cost, GPU tier only
            lines.append("GPU ranks: every F/B mark synchronised the whole device, so these "
                         "bubbles include waits an unprobed run would hide: read them as above "
                         "the schedule's own")
        label = LABELS.get(self.schedule, self.schedule)
        for m, b in self.measured.items():
            predicted = formulas.bubble_fraction(self.p, m)
            lines.append(f"{label} m = {m}: measured {b:.2f} vs predicted {predicted:.2f} "
                         f"(gap {b - predicted:+.2f})")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Sweep:
    """Every (schedule, m) of one job: losses, step times and bubbles, next to the formula."""

    runs_by_rank: list[list[dict[str, Any]]]
    """Each rank's ``runs`` (the worker's result), rank 0's first."""
    events: dict[str, list[dict[str, Any]]]
    """"schedule/m": every rank's F/B events of that run's last timed step."""
    bounds: list[tuple[int, int]]
    """The blocks each stage ran."""
    device: str = "cpu"

    @classmethod
    def from_job(cls, job: Any) -> Sweep:
        ranks = [job.rank(r) for r in range(job.world_size)]
        return cls([r["runs"] for r in ranks], ranks[0]["events"],
                   [tuple(b) for b in ranks[0]["bounds"]], job.device)

    @property
    def p(self) -> int:
        return len(self.runs_by_rank)

    @property
    def runs(self) -> list[dict[str, Any]]:
        """Rank 0's runs: the step time is its own, the bubble the mean over ranks."""
        return self.runs_by_rank[0]

    @property
    def loss_spread(self) -> float:
        """How far apart the losses of every schedule and m are (the same computation)."""
        losses = [r["loss"] for r in self.runs]
        return max(losses) - min(losses)

    def bubbles(self, schedule: str) -> Bubbles:
        """``schedule``'s bubble at each m it ran."""
        measured = {r["m"]: r["bubble_mean"] for r in self.runs if r["schedule"] == schedule}
        return Bubbles(schedule, self.p, measured, self.device)

    def describe(self) -> str:
        lines = [f"{'schedule':>12} {'m':>3} {'loss':>8} {'step ms':>8} "
                 f"{'bubble (measured)':>18} {'(p−1)/(m+p−1)':>14}"]
        lines += [f"{r['schedule']:>12} {r['m']:>3} {r['loss']:>8.4f} {r['step_s'] * 1e3:>8.1f} "
                  f"{r['bubble_mean']:>18.2f} {r['bubble_formula']:>14.2f}" for r in self.runs]
        return "\n".join([*lines, "", "measured: the losses of every schedule and m differ by at "
                          f"most {self.loss_spread:.1e}"])


def plot_schedules(sweep: Sweep, m: int, axes: Any = None,
                   schedules: tuple[str, ...] = ("gpipe", "1f1b")) -> Any:
    """Each schedule's measured timeline at ``m``, one chart under the other; returns the Axes."""
    import matplotlib.pyplot as plt  # lazy: importing labkit must stay cheap

    from labkit.parallel.timeline import plot_timeline

    if axes is None:
        _, axes = plt.subplots(len(schedules), 1, figsize=(11, 4.5), squeeze=False)
        axes = axes[:, 0]
    for ax, name in zip(axes, schedules, strict=True):
        plot_timeline(sweep.events[f"{name}/{m}"], ax=ax,
                      title=f"{name}, p = {sweep.p}, m = {m} (measured)")
    plt.tight_layout()
    return axes


def plot_bubbles(sweep: Sweep, axes: Any = None,
                 schedules: tuple[str, ...] = ("gpipe", "1f1b", "torch_1f1b")) -> Any:
    """The bubble against m, measured and predicted, in both conventions: the idle share
    (p−1)/(m+p−1), and idle over busy time (p−1)/m, which the measured share converts to as
    bubble / (1 − bubble). Returns the two Axes."""
    import matplotlib.pyplot as plt  # lazy: importing labkit must stay cheap

    p, ms = sweep.p, [r["m"] for r in sweep.runs]
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    ax1, ax2 = axes
    top = max(ms)
    m_line = [1 + (top - 1) * i / 99 for i in range(100)]
    ax1.plot(m_line, [(p - 1) / (m + p - 1) for m in m_line], "k--",
             label="(p−1)/(m+p−1) (predicted)")
    ax2.plot(m_line, [(p - 1) / m for m in m_line], "k--", label="(p−1)/m (predicted)")
    for name, marker in zip(schedules, "os^v", strict=False):
        pts = sweep.bubbles(name).measured.items()
        ax1.plot([m for m, _ in pts], [b for _, b in pts], marker, label=f"{name} (measured)")
        ax2.plot([m for m, _ in pts], [b / (1 - b) for _, b in pts], marker,
                 label=f"{name} (measured)")
    ax1.set(xlabel="micro-batches m", ylabel="idle share of the step", title=f"bubble, p = {p}")
    ax2.set(xlabel="micro-batches m", ylabel="idle time / busy time", title="bubble overhead")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    plt.tight_layout()
    return axes


@dataclasses.dataclass(frozen=True)
class StageBytes:
    """One stage's activation bytes for one micro-batch: measured, and predicted term by term
    (``formulas.predicted_stage_activations``: its blocks by Korthikanti et al.'s per-layer
    formula, then what that formula leaves out on this stage)."""

    stage: int
    blocks: int
    measured: int
    terms: dict[str, int]

    @property
    def formula(self) -> int:
        """The per-layer formula's bytes for this stage's blocks."""
        return next(v for k, v in self.terms.items() if k.startswith("transformer layers"))

    @property
    def left_out(self) -> dict[str, int]:
        """The terms the per-layer formula leaves out on this stage."""
        return {k: v for k, v in self.terms.items() if not k.startswith("transformer layers")}

    def describe(self) -> str:
        gap = self.measured - self.formula
        lines = [f"  stage {self.stage}: predicted (formula, {self.blocks} "
                 f"layer{'s' * (self.blocks != 1)}) {self.formula:,.0f} B; measured "
                 f"{self.measured:,} B; gap {gap:+,.0f} B"]
        lines += [f"    left out of the formula: {term}: {nbytes:,} B"
                  for term, nbytes in self.left_out.items()]
        rest = gap - sum(self.left_out.values())
        if rest == 0:
            lines.append("    formula + the terms it leaves out = measured, to the byte")
        else:
            lines.append(f"    still unexplained: {rest:+,.0f} B ({rest / self.measured:+.2%} "
                         "of the measured bytes)")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class ActivationMemory:
    """What each stage held at m micro-batches, per schedule: how many micro-batches at once
    (counted against the schedule's order) and their bytes at the peak, measured against the
    formula; and one micro-batch's bytes per stage, term by term."""

    m: int
    micro_batch: int
    """Sequences per micro-batch."""
    rows: list[tuple[str, int, dict[str, Any], float]]
    """(schedule, stage, what the stage measured, peak bytes predicted)."""
    stages: list[StageBytes]

    @classmethod
    def from_sweep(cls, sweep: Sweep, model: ModelConfig, m: int, batch_size: int,
                   schedules: tuple[str, ...] = ("gpipe", "1f1b", "torch_1f1b")) -> ActivationMemory:
        b_mb, p = batch_size // m, sweep.p
        terms = [formulas.predicted_stage_activations(
            model, b_mb, blocks=end - start, first=stage == 0, last=stage == p - 1)
            for stage, (start, end) in enumerate(sweep.bounds)]  # fmt: skip
        def measured(runs: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
            return next((r["activations"] for r in runs
                         if r["schedule"] == name and r["m"] == m), None)

        rows = []
        for name in schedules:
            for rank, runs in enumerate(sweep.runs_by_rank):
                act = measured(runs, name)
                if act is None:  # torch's 1F1B is skipped where m < p
                    continue
                per_mb = sum(terms[rank].values())
                rows.append((name, rank, act, act["predicted_in_flight"] * per_mb))
        stages = []
        for rank, runs in enumerate(sweep.runs_by_rank):
            start, end = sweep.bounds[rank]
            one_mb = measured(runs, "1f1b")["bytes_per_microbatch"]  # type: ignore[index]
            stages.append(StageBytes(rank, end - start, one_mb, terms[rank]))
        return cls(m, b_mb, rows, stages)

    @property
    def held(self) -> dict[tuple[str, int], int]:
        """{(schedule, stage): the most micro-batches it held at once}."""
        return {(name, rank): a["peak_in_flight"] for name, rank, a, _ in self.rows}

    def describe(self) -> str:
        lines = []
        for name, rank, a, predicted_peak in self.rows:
            held = ("as predicted" if a["peak_in_flight"] == a["predicted_in_flight"]
                    else "NOT as predicted")
            lines.append(f"{name:>10} stage {rank}: holds {a['peak_in_flight']} of m = {self.m} "
                         f"micro-batches ({held}: {a['predicted_in_flight']}); peak "
                         f"{a['peak_bytes'] / 2**20:.2f} MiB measured vs "
                         f"{predicted_peak / 2**20:.2f} MiB predicted")
        lines += ["", f"one micro-batch ({self.micro_batch} sequences), per stage:"]
        return "\n".join(lines + [s.describe() for s in self.stages])


def plot_activation_memory(memory: ActivationMemory, ax: Any = None) -> Any:
    """Peak activation bytes per schedule and stage, predicted beside measured; returns the Axes."""
    import matplotlib.pyplot as plt  # lazy: importing labkit must stay cheap

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3))
    rows = memory.rows
    x = list(range(len(rows)))
    ax.bar([i - 0.2 for i in x], [pred / 2**20 for *_, pred in rows], 0.4, label="predicted",
           color="#9ecae1")
    ax.bar([i + 0.2 for i in x], [a["peak_bytes"] / 2**20 for _, _, a, _ in rows], 0.4,
           label="measured", color="#3182bd")
    ax.set_xticks(x, [f"{name}\nstage {rank}" for name, rank, *_ in rows])
    ax.set(ylabel="MiB", title=f"peak activation memory per stage, m = {memory.m}")
    ax.legend()
    plt.tight_layout()
    return ax


def describe_closing(naive: NaiveSplit, bubbles: Bubbles, memory: ActivationMemory) -> str:
    """Notebook 03's closing note for the pipeline: each bubble and each stage's activation
    memory, measured against the formulas (both bubble conventions)."""
    lines = [f"naive split: bubble measured {naive.measured:.2f}, predicted {naive.predicted:.2f}"]
    label = LABELS.get(bubbles.schedule, bubbles.schedule)
    for m, b in bubbles.measured.items():
        lines.append(f"{label} m = {m:>2}: bubble measured {b:.2f}, predicted "
                     f"{formulas.bubble_fraction(bubbles.p, m):.2f}; overhead measured "
                     f"{b / (1 - b):.2f}, predicted {formulas.bubble_overhead(bubbles.p, m):.2f}")
    lines.append(f"micro-batches held at m = {memory.m}: {memory.held} (predicted GPipe "
                 f"{memory.m}, 1F1B p − stage)")
    lines += [f"{name} stage {rank}: peak activations measured {a['peak_bytes']:,} B, predicted "
              f"{predicted:,.0f} B (formula + the terms it leaves out)"
              for name, rank, a, predicted in memory.rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
