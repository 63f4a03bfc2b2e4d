"""Training throughput and MFU of the course's model on this GPU.

    python -m benchmarks.bench_gpu_throughput                 # lab and gpu presets, bf16
    python -m benchmarks.bench_gpu_throughput --record        # save to benchmarks/results/
    python -m benchmarks.bench_gpu_throughput --allow-cpu     # dry run on a CPU (tiny model)

For each preset, builds ``labkit.model.GPT``, runs ``--warmup`` uncounted optimiser steps
through ``labkit.train.train_step`` (allocator growth, kernel selection), then ``--steps``
counted ones, and reports

    tokens/s = tokens per step / median step time
    MFU      = tokens/s x training FLOPs per token / peak FLOP/s        (formulas.mfu)

FLOPs per token follow nanoGPT's ``estimate_mfu``: 6N + 12·L·h·s, with N the parameters
without the position table (a lookup, no FLOPs; the tied token table is also the output
matmul, so it stays). The peak is the published dense bf16 figure of this GPU from
``labkit.hardware.peak_flops``; a GPU not in that table gets "MFU: N/A (reason)", never a
guessed peak.

Without a CUDA GPU it prints that it needs one and exits 0. ``--allow-cpu`` runs the smoke
model in float32 on the CPU instead, labelled as CPU, with no MFU: that exercises the code
path (gpu_check.sh --dry-run uses it), it is not a GPU result.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks import _common
from labkit import config, data, formulas, hardware, train
from labkit.model import GPT

NAME = "gpu_throughput"


def measure(
    size: str, dtype: str, device: torch.device, *, warmup: int, steps: int, seed: int = 0
) -> tuple[list[float], dict[str, Any]]:
    """Per-step seconds of ``steps`` counted steps, and the derived numbers, for one preset."""
    cfg = config.preset(size).replace(dtype=dtype)
    t = cfg.train
    torch.manual_seed(seed)
    model = GPT(cfg.model).to(device).train()
    optimizer = train.make_optimizer(model, t)
    scaler = train.make_scaler(device, dtype)
    gen = torch.Generator().manual_seed(seed)
    tokens = data.load_splits().train
    # A few distinct batches already on the device: the input pipeline is not measured.
    batches = [
        [
            data.get_batch(tokens, t.micro_batch, cfg.model.seq_len, gen, device=device)
            for _ in range(t.grad_accum)
        ]
        for _ in range(4)
    ]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds, losses = [], []
    for i in range(warmup + steps):
        stats = train.train_step(
            model,
            optimizer,
            batches[i % len(batches)],
            device=device,
            dtype=dtype,
            scaler=scaler,
            grad_clip=t.grad_clip,
        )
        if i >= warmup:
            seconds.append(stats.seconds)
            losses.append(stats.loss)
    tokens_per_step = t.micro_batch * t.grad_accum * cfg.model.seq_len
    median_s = statistics.median(seconds)
    tokens_per_s = tokens_per_step / median_s
    n_params = model.num_params(exclude_position_embedding=True)
    fpt = formulas.flops_per_token(
        n_params, cfg.model.n_layer, cfg.model.d_model, cfg.model.seq_len, attention="full"
    )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = hardware.peak_flops(name, dtype)
    result: dict[str, Any] = {
        "size": size, "dtype": dtype, "device_name": name,
        "n_params": model.num_params(), "n_params_for_flops": n_params,
        "tokens_per_step": tokens_per_step, "median_step_s": median_s,
        "tokens_per_s": tokens_per_s, "flops_per_token": fpt,
        "flops_convention": "6N + 12·L·h·s (nanoGPT estimate_mfu), N without position table",
        "achieved_flops_per_s": tokens_per_s * fpt,
        "peak_flops_per_s": peak.flops_per_s, "peak_source": peak.source,
        "mfu": formulas.mfu(tokens_per_s, fpt, peak.flops_per_s) if peak.known else None,
        "mfu_note": None if peak.known else peak.reason,
        "last_loss": losses[-1],
        "peak_memory_bytes": (torch.cuda.max_memory_allocated(device)
                              if device.type == "cuda" else None),
    }  # fmt: skip
    return seconds, result


def describe(r: dict[str, Any]) -> str:
    mfu = (
        f"MFU {100 * r['mfu']:.1f}% of {r['peak_flops_per_s'] / 1e12:g} TFLOP/s {r['dtype']} peak"
        if r["mfu"] is not None
        else f"MFU: N/A ({r['mfu_note']})"
    )
    mem = (
        f", peak memory {r['peak_memory_bytes'] / 2**30:.2f} GiB"
        if r["peak_memory_bytes"] is not None
        else ""
    )
    return (
        f"{r['size']:>5} {r['dtype']}: {r['median_step_s'] * 1e3:.1f} ms/step, "
        f"{r['tokens_per_s']:,.0f} tokens/s, "
        f"{r['achieved_flops_per_s'] / 1e12:.2f} TFLOP/s achieved; {mfu}{mem}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="lab,gpu", help="comma-separated presets (lab,gpu)")
    p.add_argument(
        "--dtype",
        choices=config.DTYPES,
        default="bfloat16",
        help="autocast dtype on the GPU (bfloat16)",
    )
    p.add_argument("--warmup", type=int, default=10, help="uncounted steps per preset (10)")
    p.add_argument("--steps", type=int, default=30, help="counted steps per preset (30)")
    p.add_argument(
        "--allow-cpu",
        action="store_true",
        help="without a GPU: run the smoke preset in float32 on the CPU (dry run)",
    )
    p.add_argument(
        "--record",
        action="store_true",
        help="save to benchmarks/results/gpu_throughput-<machine>.json",
    )
    p.add_argument("--out", default=None, help="save the JSON record to this file instead")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    for s in sizes:
        if s not in config.SIZES:
            raise SystemExit(f"--sizes: {s!r} is not a preset; use some of {config.SIZES}")
    if torch.cuda.is_available():
        device, dtype = torch.device("cuda"), args.dtype
    elif args.allow_cpu:
        # A dry run of the code path, not a measurement of anything a GPU would do.
        device, dtype, sizes = torch.device("cpu"), "float32", ["smoke"]
        print(
            "no CUDA GPU: --allow-cpu runs the smoke preset in float32 on the CPU; "
            "this is a CPU dry run, not a GPU result"
        )
    else:
        print(
            "bench_gpu_throughput needs a CUDA GPU (torch.cuda.is_available() is False); "
            "nothing measured. Use --allow-cpu for a dry run of the code path on the CPU."
        )
        return 0

    samples: dict[str, list[float]] = {}
    results: dict[str, dict[str, Any]] = {}
    for size in sizes:
        seconds, result = measure(size, dtype, device, warmup=args.warmup, steps=args.steps)
        samples[size], results[size] = seconds, result
        print(describe(result), flush=True)

    record = _common.make_record(
        NAME, device=str(device) if device.type == "cuda" else "cpu",
        params={"sizes": sizes, "dtype": dtype, "warmup": args.warmup, "steps": args.steps,
                "threads": torch.get_num_threads()},
        samples_s=samples, results=results,
        label="GPU measurement" if device.type == "cuda" else "CPU dry run (no GPU, no MFU)",
    )  # fmt: skip
    _common.emit(record, name=NAME, out=args.out, record_it=args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
