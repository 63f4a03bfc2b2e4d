"""Does watching the hardware slow training down?

    python -m benchmarks.bench_sampler                  # lab size, 10 rounds of ~2 s blocks
    python -m benchmarks.bench_sampler --record         # save to benchmarks/results/

Trains one ``labkit.model.GPT`` in blocks of optimiser steps, alternating a block with the
metrics sampler running (``labkit.metrics.Sampler`` on its own thread, period 1 s, the
backend ``auto_backend`` picks: NVML on a GPU machine, psutil here) with a block without it,
first mover swapped each round (``_common.alternate``). Only the steps are timed: the
sampler is started before and stopped after each block, as in a notebook cell that trains
for minutes. Reports throughput(with) / throughput(without) = median seconds(without) /
median seconds(with). Target: >= 0.99.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks import _common
from labkit import config, data, timing, train
from labkit.metrics import Sampler, auto_backend
from labkit.model import GPT

NAME = "sampler"
TARGET_THROUGHPUT = 0.99


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="lab", choices=config.SIZES)
    p.add_argument("--device", default="auto")
    p.add_argument("--period-s", type=float, default=1.0, help="sampler period (default 1 s)")
    p.add_argument("--block-s", type=float, default=2.0, help="target seconds per block")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--record", action="store_true", help="save to benchmarks/results/")
    p.add_argument("--out", help="write the JSON record to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = train.resolve_device(args.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    cfg = config.preset(args.size).replace(dtype=dtype)
    torch.manual_seed(0)
    model = GPT(cfg.model).to(device).train()
    opt = train.make_optimizer(model, cfg.train)
    gen = torch.Generator().manual_seed(0)
    tokens = data.load_splits().train
    batches = [[data.get_batch(tokens, cfg.train.micro_batch, cfg.model.seq_len, gen, device)]
               for _ in range(4)]

    def step(i: int) -> None:
        train.train_step(model, opt, batches[i % len(batches)], device=device, dtype=dtype)

    # Size the block so each lasts about block_s: the sampler must tick a few times in it.
    probe = timing.benchmark(lambda: step(0), device=device, warmup=2, repeats=3)
    steps_per_block = max(5, round(args.block_s / probe.median_s))

    def block(with_sampler: bool) -> float:
        sampler = None
        if with_sampler:
            sampler = Sampler(auto_backend(lambda: {0: os.getpid()}), args.period_s)
            sampler.start()
        try:
            with timing.Timer(device) as t:
                for i in range(steps_per_block):
                    step(i)
        finally:
            if sampler is not None:
                sampler.stop()
        return t.elapsed_s

    print(f"sampler overhead: size={args.size} device={device} period={args.period_s} s, "
          f"{steps_per_block} steps per block, rounds={args.rounds} (+{args.warmup} warm-up)")
    samples = _common.alternate(
        {"with_sampler": lambda: block(True), "without": lambda: block(False)},
        rounds=args.rounds, warmup=args.warmup,
    )
    cmp = _common.comparison(samples, "with_sampler", "without", 1 / TARGET_THROUGHPUT,
                             what="median seconds per block of training steps, with the "
                                  "sampler / without it, alternated")  # fmt: skip
    throughput = 1 / cmp["ratio"]
    record = _common.make_record(
        NAME, device=str(device),
        params={"size": args.size, "period_s": args.period_s, "steps_per_block": steps_per_block,
                "rounds": args.rounds, "warmup": args.warmup, "dtype": dtype,
                "order": "alternating, first mover swapped"},
        samples_s=samples, throughput_ratio=throughput,
        throughput_target=TARGET_THROUGHPUT, **cmp,
    )  # fmt: skip
    print(f"throughput with sampler / without = {throughput:.4f} "
          f"(per-round {1 / cmp['paired_ratio']:.4f}; target >= {TARGET_THROUGHPUT}: "
          f"{'met' if throughput >= TARGET_THROUGHPUT else 'NOT met'})")
    _common.emit(record, name=f"{NAME}-{args.size}", out=args.out, record_it=args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
