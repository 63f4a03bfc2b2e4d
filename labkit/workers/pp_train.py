"""Pipeline-parallel GPT: every schedule on the same batch, timed per micro-batch.

    labkit.jobs.launch.run("labkit.workers.pp_train", nproc=2,
                      config={"microbatches": [1, 2, 4, 8], "schedules": ["gpipe", "1f1b"]})

Rank r runs stage r of the GPT (``labkit.parallel.pipeline``). For each schedule and each
micro-batch count m the worker runs ``warmup`` untimed steps, then ``repeats`` timed ones, all
on the same batch and without an optimiser update, so every schedule computes the very same
loss and gradients (the parity test checks them against a single-process GPT).

Config (all optional):
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

import statistics
from typing import Any

import torch
import torch.distributed as tdist

from labkit import data, formulas
from labkit.config import ModelConfig, RunConfig
from labkit.jobs import runtime
from labkit.model import GPT
from labkit.parallel import pipeline
from labkit.parallel.timeline import bubble_from_events, common_t0

DEFAULT_MODEL = {"seq_len": 32, "n_layer": 4, "n_head": 2, "d_model": 64}


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
    conf = ctx.config
    # RunConfig: a model trained on the byte corpus (vocab_size >= 256), checked before setup.
    cfg = RunConfig(model=ModelConfig(**{**DEFAULT_MODEL, **conf.get("model", {})})).model
    B = int(conf.get("batch_size", 8))
    ms = conf.get("microbatches", 4)
    ms = [int(ms)] if isinstance(ms, (int, float)) else [int(m) for m in ms]
    schedules = list(conf.get("schedules", pipeline.SCHEDULES))
    seed = int(conf.get("seed", 0))
    warmup, repeats = int(conf.get("warmup", 1)), int(conf.get("repeats", 3))
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
    if conf.get("partition_by", "params") == "time":
        times = unit_times(model, x, ctx.device)
        # Every rank must cut the model the same way: use rank 0's measurement.
        box = [times]
        tdist.broadcast_object_list(box, src=0)
        times = box[0]
    bounds = pipeline.partition(cfg, p, by=conf.get("partition_by", "params"), times=times)
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
            if conf.get("save_grads") and ctx.job_dir is not None:
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


if __name__ == "__main__":
    main()
