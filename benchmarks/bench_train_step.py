"""Does labkit's training step cost anything over the textbook PyTorch loop?

    python -m benchmarks.bench_train_step                 # lab size, this machine
    python -m benchmarks.bench_train_step --size gpu      # on a GPU (bf16 by default there)
    python -m benchmarks.bench_train_step --record        # save to benchmarks/results/

Times ``labkit.train.train_step`` against a plain loop written out below (forward, loss
divided by the number of micro-batches, backward, gradient clipping, AdamW step,
``zero_grad``, one ``.item()``), round by round in alternation (see ``_common.alternate``),
and reports ratio = median(labkit) / median(plain). Target: <= 1.02.

The two paths do the same work:
- two copies of one freshly initialised ``labkit.model.GPT`` (same seed), each with its own
  AdamW over the same parameter groups (weight decay on matrices only, betas (0.9, 0.95));
- the same batches, already on the device, in the same order;
- the same host synchronisation: ``train_step`` reads its loss once per step with
  ``float(total)``; the plain loop does ``total.item()``;
- the same thread count, in the same process.
Because both models see the same batches after the same updates, their losses should
agree; the record keeps the largest difference as evidence that the work was the same.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

from benchmarks import _common
from labkit import config, data, train
from labkit.model import GPT

NAME = "train_step"
TARGET = 1.02  # labkit may cost at most 2% more per step than the plain loop


def plain_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    device: torch.device,
    dtype: torch.dtype,
    scaler: torch.amp.GradScaler | None,
    grad_clip: float | None,
) -> float:
    """One optimiser step the way a PyTorch tutorial writes it; returns the mean loss."""
    n = len(batches)
    total = 0.0  # becomes a device tensor at the first +=: no sync inside the loop
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        amp = (
            torch.autocast(device.type, dtype=dtype)
            if dtype != torch.float32
            else contextlib.nullcontext()
        )
        with amp:
            _, loss = model(x, y)
        loss = loss / n  # accumulate the gradient of the mean loss over micro-batches
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        total += loss.detach()
    if grad_clip is not None:
        if scaler is not None:
            scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total.item()  # type: ignore[union-attr]  # the one host sync per step, as train_step's float(total)


def plain_adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only, written out as a tutorial would."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.95),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=config.SIZES, default="lab", help="model preset (lab)")
    p.add_argument(
        "--dtype",
        choices=("auto", *config.DTYPES),
        default="auto",
        help="autocast dtype; auto: bfloat16 on a GPU, float32 on a CPU",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--rounds", type=int, default=100, help="counted rounds (one step of each)")
    p.add_argument("--warmup", type=int, default=10, help="uncounted rounds first")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's current setting)",
    )
    p.add_argument(
        "--batches",
        type=int,
        default=4,
        help="distinct steps' worth of batches, cycled (default 4)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--record",
        action="store_true",
        help="save to benchmarks/results/train_step-<size>-<machine>.json",
    )
    p.add_argument("--out", default=None, help="save the JSON record to this file instead")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = train.resolve_device(args.device)
    dtype_name = args.dtype
    if dtype_name == "auto":
        dtype_name = "bfloat16" if device.type == "cuda" else "float32"
    cfg = config.preset(args.size).replace(dtype=dtype_name)
    t = cfg.train

    torch.manual_seed(args.seed)
    model_labkit = GPT(cfg.model).to(device).train()
    model_plain = copy.deepcopy(model_labkit)  # same initial weights, tying kept
    opt_labkit = train.make_optimizer(model_labkit, t)
    opt_plain = plain_adamw(model_plain, t.lr, t.weight_decay)
    scaler_labkit = train.make_scaler(device, dtype_name)
    scaler_plain = torch.amp.GradScaler(device.type) if dtype_name == "float16" else None

    # Batches are made once and moved to the device before timing: data loading is not
    # what is compared. Each step gets grad_accum micro-batches.
    gen = torch.Generator().manual_seed(args.seed)
    tokens = data.load_splits().train
    steps = [
        [
            data.get_batch(tokens, t.micro_batch, cfg.model.seq_len, gen, device=device)
            for _ in range(t.grad_accum)
        ]
        for _ in range(max(1, args.batches))
    ]

    losses: dict[str, list[float]] = {"labkit": [], "plain": []}
    turn = {"labkit": 0, "plain": 0}

    def labkit_step() -> None:
        batches = steps[turn["labkit"] % len(steps)]
        turn["labkit"] += 1
        stats = train.train_step(
            model_labkit,
            opt_labkit,
            batches,
            device=device,
            dtype=dtype_name,
            scaler=scaler_labkit,
            grad_clip=t.grad_clip,
        )
        losses["labkit"].append(stats.loss)

    def textbook_step() -> None:
        batches = steps[turn["plain"] % len(steps)]
        turn["plain"] += 1
        losses["plain"].append(
            plain_step(
                model_plain,
                opt_plain,
                batches,
                device=device,
                dtype=train.DTYPES[dtype_name],
                scaler=scaler_plain,
                grad_clip=t.grad_clip,
            )
        )

    print(
        f"train_step vs plain loop: size={args.size} dtype={dtype_name} device={device} "
        f"threads={torch.get_num_threads()} rounds={args.rounds} (+{args.warmup} warm-up)"
    )
    samples = _common.alternate(
        {
            "labkit": _common.timed(labkit_step, device),
            "plain": _common.timed(textbook_step, device),
        },
        rounds=args.rounds,
        warmup=args.warmup,
    )
    loss_diff = max(abs(a - b) for a, b in zip(losses["labkit"], losses["plain"], strict=True))

    cmp = _common.comparison(samples, "labkit", "plain", TARGET,
                             what="median seconds per optimiser step, labkit.train.train_step / "
                                  "plain PyTorch loop, alternated")  # fmt: skip
    record = _common.make_record(
        NAME, device=str(device),
        params={"size": args.size, "dtype": dtype_name, "rounds": args.rounds,
                "warmup": args.warmup, "threads": torch.get_num_threads(),
                "micro_batch": t.micro_batch, "grad_accum": t.grad_accum,
                "seq_len": cfg.model.seq_len, "n_params": model_labkit.num_params(),
                "distinct_batches": len(steps), "order": "alternating, first mover swapped"},
        samples_s=samples, loss_max_abs_diff=loss_diff, **cmp,
    )  # fmt: skip
    med = cmp["median_s"]
    print(f"median step: labkit {med['labkit'] * 1e3:.2f} ms, plain {med['plain'] * 1e3:.2f} ms")
    print(
        f"ratio labkit/plain = {cmp['ratio']:.4f}, per-round {cmp['paired_ratio']:.4f} "
        f"(target <= {TARGET}: "
        f"{'met' if cmp['within_target'] else 'NOT met'}); "
        f"largest loss difference between the paths: {loss_diff:.3g}"
    )
    _common.emit(record, name=f"{NAME}-{args.size}", out=args.out, record_it=args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
