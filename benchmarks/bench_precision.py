"""Tokens/s of the course's training step per precision: fp32, bf16 autocast, fp16 + GradScaler.

    python -m benchmarks.bench_precision                    # smoke size on a CPU, gpu on a GPU
    python -m benchmarks.bench_precision --size lab         # another preset of labkit.config
    python -m benchmarks.bench_precision --precisions fp32,bf16
    python -m benchmarks.bench_precision --record           # save to benchmarks/results/

Times ``labkit.train.train_step`` (its own synchronised timer: CUDA events on a GPU) on the
course's GPT once per precision per round, the precisions alternated round by round with the
first mover swapped (``_common.alternate``), and reports tokens/s of each and its speed
relative to fp32 measured in the same run: the ratio of median step times, and the median of
the per-round ratios.

Every precision does the same work: copies of one freshly initialised model (same seed), each
with its own AdamW (and, for fp16, its own ``GradScaler``: ``train.make_scaler``), the same
batches (already on the device) in the same order, the preset's gradient clipping, in one
process at one thread count. Only the autocast dtype differs.

Precisions: "auto" measures float32, bfloat16 and float16, leaving out (with the reason, in
the record's ``skipped``) any whose autocast or loss scaler this device does not provide;
a precision named in ``--precisions`` that the device cannot run is an error, never silently
replaced by another.

On a GPU the target is bf16 at least 2× fp32's tokens/s at the gpu preset (median seconds
ratio ≤ 0.5). Not at lab size: its 0.8 M-parameter model leaves an H200 waiting on kernel
launches, and precision barely moves the step (measured 2026-12-04 on an H200, torch 2.11:
fp32 11.1 ms, bf16 12.4 ms per step; results/precision-lab-nvidia-h200.json). On a CPU there is no target: the ratio is what this CPU does, reported with what its
flags say about bf16 and fp16 arithmetic (``labkit.roofline.cpu_precision_support``), and it
is never a GPU speedup.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

from benchmarks import _common
from labkit import config, data, precision, roofline, train
from labkit.model import GPT

NAME = "precision"
BASELINE = "float32"
GPU_TARGET = 0.5  # bf16 median step time ≤ 0.5 × fp32's: at least 2× the tokens/s (issue 11)

Batch = tuple[torch.Tensor, torch.Tensor]


def autocast_problem(device: torch.device, dtype: str) -> str | None:
    """Why ``train_step`` cannot train in ``dtype`` on ``device``, or None when it can.

    Tried, not assumed: ``labkit.precision.checked_autocast`` enters the autocast and refuses
    one that torch would quietly switch off (it warns and runs in float32), and fp16 also
    needs a ``GradScaler`` that is enabled on this device (one that is not does nothing).
    """
    if dtype == BASELINE:
        return None
    try:
        precision.checked_autocast(device.type, dtype)
    except ValueError as e:
        return str(e)
    if dtype == "float16":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scaler = train.make_scaler(device, dtype)
        if scaler is None or not scaler.is_enabled():
            said = "; ".join(str(w.message) for w in caught)
            return (f"torch.amp.GradScaler({device.type!r}) is not enabled on this device, and "
                    "fp16 training without loss scaling is not what this benchmark measures"
                    + (f" ({said})" if said else ""))  # fmt: skip
    return None


@dataclass
class Replica:
    """One precision's copy of the model, its optimiser and (fp16) its loss scaler."""

    dtype: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    losses: list[float]
    skipped_steps: int = 0  # fp16 steps the scaler skipped (inf/NaN gradients)
    turn: int = 0  # steps taken: which batch comes next


def make_replicas(cfg: config.RunConfig, dtypes: list[str], device: torch.device,
                  seed: int) -> dict[str, Replica]:  # fmt: skip
    """One replica per dtype, all copies of a single model initialised from ``seed``."""
    torch.manual_seed(seed)
    base = GPT(cfg.model).to(device).train()
    replicas = {}
    for dtype in dtypes:
        model = copy.deepcopy(base)  # same initial weights; deepcopy keeps the weight tying
        replicas[dtype] = Replica(dtype=dtype, model=model,
                                  optimizer=train.make_optimizer(model, cfg.train),
                                  scaler=train.make_scaler(device, dtype), losses=[])  # fmt: skip
    return replicas


def make_batches(cfg: config.RunConfig, device: torch.device, seed: int,
                 n_steps: int) -> list[list[Batch]]:  # fmt: skip
    """``n_steps`` steps' worth of micro-batches, made once and put on the device before any
    timing: the input pipeline is not what is compared."""
    gen = torch.Generator().manual_seed(seed)
    tokens = data.load_splits().train
    t = cfg.train
    return [[data.get_batch(tokens, t.micro_batch, cfg.model.seq_len, gen, device=device)
             for _ in range(t.grad_accum)] for _ in range(n_steps)]  # fmt: skip


def step_fn(replica: Replica, batches: list[list[Batch]], device: torch.device,
            grad_clip: float | None):  # fmt: skip
    """A function that runs the replica's next ``train_step`` and returns its seconds."""

    def step() -> float:
        scale = replica.scaler.get_scale() if replica.scaler is not None else None
        stats = train.train_step(replica.model, replica.optimizer,
                                 batches[replica.turn % len(batches)], device=device,
                                 dtype=replica.dtype, scaler=replica.scaler,
                                 grad_clip=grad_clip)  # fmt: skip
        replica.turn += 1
        replica.losses.append(stats.loss)
        # GradScaler halves its scale when it skips a step for inf/NaN gradients (PyTorch
        # torch.amp.GradScaler docs): a skipped step does no optimiser update, so it is cheaper
        if replica.scaler is not None and replica.scaler.get_scale() < scale:
            replica.skipped_steps += 1
        return stats.seconds

    return step


def choose_precisions(requested: str, device: torch.device) -> tuple[list[str], dict[str, str]]:
    """The precisions to measure and, for "auto", those left out with the reason.

    Raises ValueError for an unknown or unsupported precision named explicitly.
    """
    if requested == "auto":
        chosen, skipped = [], {}
        for dtype in config.DTYPES:
            problem = autocast_problem(device, dtype)
            if problem is None:
                chosen.append(dtype)
            else:
                skipped[dtype] = problem
        return chosen, skipped
    chosen = []
    for item in requested.split(","):
        name = roofline.precision_name(item.strip())  # refuses unknown names, listing them
        if name not in config.DTYPES:
            raise ValueError(f"precision {item.strip()!r} is not an autocast dtype: training "
                             f"runs in one of {', '.join(config.DTYPES)} (tf32 is how CUDA "
                             "runs float32 matmuls; labkit.roofline.matmul_sweep measures "
                             "it)")  # fmt: skip
        if name in chosen:
            raise ValueError(f"precision {name!r} is named twice in --precisions")
        problem = autocast_problem(device, name)
        if problem is not None:
            raise ValueError(f"precision {name!r} cannot run here: {problem}; leave it out, or "
                             "use --precisions auto to measure what this device supports")
        chosen.append(name)
    if BASELINE not in chosen:
        raise ValueError(f"--precisions {requested!r} lacks float32: speeds are relative to an "
                         "fp32 baseline measured in the same run; e.g. --precisions fp32,bf16")
    return [BASELINE] + [d for d in chosen if d != BASELINE], {}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=config.SIZES, default=None,
                   help="model preset (default: smoke on a CPU, lab on a GPU)")
    p.add_argument("--precisions", default="auto",
                   help="comma-separated, e.g. fp32,bf16,fp16 (must include fp32); auto: every "
                        "precision this device can train in (default)")  # fmt: skip
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--rounds", type=int, default=30, help="counted rounds, one step of each (30)")
    p.add_argument("--warmup", type=int, default=5, help="uncounted rounds first (5)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's current setting)")
    p.add_argument("--batches", type=int, default=4,
                   help="distinct steps' worth of batches, cycled (4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record", action="store_true",
                   help="save to benchmarks/results/precision-<size>-<machine>.json")
    p.add_argument("--out", default=None, help="save the JSON record to this file instead")
    return p.parse_args(argv)


def speeds(samples: dict[str, list[float]], tokens_per_step: int) -> dict[str, dict[str, float]]:
    """Per precision: tokens/s at the median step time, and speed relative to fp32 (ratio of
    medians, and median of per-round ratios): above 1 faster than fp32, below 1 slower."""
    out = {}
    for dtype, secs in samples.items():
        out[dtype] = {
            "median_step_s": statistics.median(secs),
            "tokens_per_s": tokens_per_step / statistics.median(secs),
            "speed_vs_float32": _common.ratio_of_medians(samples, BASELINE, dtype),
            "paired_speed_vs_float32": _common.paired_ratio(samples, BASELINE, dtype),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = train.resolve_device(args.device)
    size = args.size or ("gpu" if device.type == "cuda" else "smoke")
    try:
        dtypes, skipped = choose_precisions(args.precisions, device)
    except ValueError as e:
        raise SystemExit(f"bench_precision: {e}") from None
    cfg = config.preset(size)
    t = cfg.train
    replicas = make_replicas(cfg, dtypes, device, args.seed)
    batches = make_batches(cfg, device, args.seed, max(1, args.batches))
    tokens_per_step = t.micro_batch * t.grad_accum * cfg.model.seq_len

    on_cpu = device.type != "cuda"
    support = roofline.cpu_precision_support() if on_cpu else None
    print(f"train_step per precision: size={size} device={device} "
          f"({roofline.device_name(device)}) threads={torch.get_num_threads()} "
          f"precisions={','.join(dtypes)} rounds={args.rounds} (+{args.warmup} warm-up)")
    for dtype, why in skipped.items():
        print(f"  {dtype} left out: {why}")
    samples = _common.alternate(
        {d: step_fn(r, batches, device, t.grad_clip) for d, r in replicas.items()},
        rounds=args.rounds, warmup=args.warmup,
    )  # fmt: skip
    result = speeds(samples, tokens_per_step)
    label = (f"CPU ({support.cpu}): speeds relative to fp32 are this CPU's, not a GPU speedup"
             if on_cpu else f"GPU ({roofline.device_name(device)})")  # fmt: skip
    extra: dict[str, Any] = {}
    if "bfloat16" in samples:
        extra = _common.comparison(
            samples, "bfloat16", BASELINE, GPU_TARGET,
            what="median seconds per train_step, bf16 autocast / fp32, alternated rounds; "
                 f"≤ {GPU_TARGET} means bf16 reaches at least {1 / GPU_TARGET:g}x fp32's tokens/s",
        )  # fmt: skip
        if on_cpu:  # the 2x target is for a GPU; on a CPU the ratio is reported as measured
            extra["target"] = extra["within_target"] = None
            extra["target_note"] = (f"the ≤ {GPU_TARGET} target applies on a GPU at the gpu preset; "
                                    "a CPU's ratio has no target")  # fmt: skip
    for dtype, r in replicas.items():
        result[dtype].update(first_loss=r.losses[0], last_loss=r.losses[-1],
                             steps_incl_warmup=len(r.losses))  # fmt: skip
        if r.scaler is not None:
            result[dtype].update(scaler_skipped_steps=r.skipped_steps,
                                 final_scale=float(r.scaler.get_scale()))  # fmt: skip
    record = _common.make_record(
        NAME, device=str(device),
        params={"size": size, "precisions": dtypes, "rounds": args.rounds,
                "warmup": args.warmup, "threads": torch.get_num_threads(),
                "micro_batch": t.micro_batch, "grad_accum": t.grad_accum,
                "seq_len": cfg.model.seq_len, "tokens_per_step": tokens_per_step,
                "n_params": replicas[BASELINE].model.num_params(),
                "grad_clip": t.grad_clip, "seed": args.seed, "distinct_batches": len(batches),
                "float32_matmul_precision": torch.get_float32_matmul_precision(),
                "order": "alternating, first mover swapped",
                "timer": "train_step's StepStats.seconds (labkit.timing.Timer)"},
        samples_s=samples, label=label, results=result, skipped=skipped,
        cpu_support=None if support is None else {
            "bfloat16": support.bfloat16, "float16": support.float16,
            "notes": list(support.notes)},
        **extra,
    )  # fmt: skip
    for dtype, r in result.items():
        note = ("" if dtype == BASELINE else
                f", {r['speed_vs_float32']:.3g}x fp32's speed "
                f"(per round {r['paired_speed_vs_float32']:.3g}x)")  # fmt: skip
        print(f"  {dtype:>9}: {r['median_step_s'] * 1e3:8.2f} ms/step, "
              f"{r['tokens_per_s']:>10,.0f} tokens/s{note}")
    print(f"  {label}")
    if support is not None:
        print(f"  CPU support: {support}")
    if extra and not on_cpu:
        print(f"  bf16/fp32 step time {extra['ratio']:.3f} (target ≤ {GPU_TARGET}: "
              f"{'met' if extra['within_target'] else 'NOT met'})")
    _common.emit(record, name=f"{NAME}-{size}", out=args.out, record_it=args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
