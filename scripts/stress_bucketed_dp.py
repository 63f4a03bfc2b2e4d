"""Stress BucketedDP on tied weights with one parameter per bucket (issue 31).

The case as a user met it: a toy model whose two layers share one weight, ``BucketedDP``
with a 0.0001 MB bucket cap (every parameter in a bucket of its own), 2 gloo ranks started
with ``torch.multiprocessing.spawn``, each rank seeded differently, a few SGD steps, the
result compared with one process on the whole batch. Each run is a fresh Python process, so
a rank killed by a signal (SIGABRT: "terminate called without an active exception") is seen
as the user saw it. Prints one line per run, then how many died and how.

    .venv/bin/python scripts/stress_bucketed_dp.py --runs 20

Exit status: 0 when every run trained and matched the reference, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
from pathlib import Path

WORLD = 2
STEPS = 4
BATCH = 8  # global batch; each rank trains on its half
SEED = 100  # rank r builds its replica from SEED + r; the reference from SEED (rank 0's)
ATOL = 1e-6  # SGD, fp32 (tests/test_dp_toy_parity.py): a summed gradient is ~1e-2 off


def build_model(seed: int):
    """The tied-weight toy model of tests/test_dp_bucketed_tied.py (an embedding and an output
    head sharing one weight), built from ``seed``."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_dp_bucketed_tied import Tied

    torch.manual_seed(seed)
    return Tied()


def batch(step: int):
    import torch

    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 12, (BATCH, 5), generator=g)
    return x, torch.randint(0, 12, (BATCH, 5), generator=g)


def train(wrapped, model, rank: int | None) -> dict:
    """SGD on the whole batch (``rank`` None) or on ``rank``'s half of it, through
    ``wrapped`` (DDP hooks its forward); returns ``model``'s parameters."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    per = BATCH // WORLD
    for step in range(STEPS):
        x, y = batch(step)
        if rank is not None:
            x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        wrapped(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def make_strategy(name: str, cap_mb: float):
    """The strategy under test; the others are there to compare with."""
    from labkit.parallel.ddp import TorchDDP
    from labkit.parallel.dp_bucketed import BucketedDP
    from labkit.parallel.dp_naive import NaiveDP

    if name == "bucketed":
        return BucketedDP(WORLD, bucket_cap_mb=cap_mb)
    if name == "ddp":
        return TorchDDP(WORLD, bucket_cap_mb=cap_mb)
    return NaiveDP(WORLD)


def worker(rank: int, folder: str, strategy: str, cap_mb: float) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(folder) / "store"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    try:
        model = build_model(SEED + rank)  # a different replica on every rank
        wrapped = make_strategy(strategy, cap_mb).wrap(model)  # rank 0's weights everywhere
        torch.save(train(wrapped, model, rank), Path(folder) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def one_run(strategy: str, cap_mb: float) -> str:
    """Spawn the 2-rank job once; return 'ok' or what went wrong, in one line."""
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        try:
            mp.spawn(worker, args=(folder, strategy, cap_mb), nprocs=WORLD)
        except mp.ProcessExitedException as e:  # killed by a signal or exited non-zero
            return f"rank {e.error_index} died: {e.signal_name or f'exit code {e.exit_code}'}"
        except mp.ProcessRaisedException as e:
            return f"rank {e.error_index} raised: {str(e).strip().splitlines()[-1]}"
        got = [torch.load(Path(folder) / f"rank{r}.pt") for r in range(WORLD)]
    reference = build_model(SEED)
    want = train(reference, reference, None)
    for rank, params in enumerate(got):
        diff = max((params[n] - want[n]).abs().max().item() for n in want)
        if diff > ATOL:
            return f"wrong result: rank {rank} is {diff:.2g} off the one-process reference"
    return "ok"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=20, help="how many fresh 2-rank jobs (default 20)")
    ap.add_argument(
        "--cap-mb", type=float, default=0.0001, help="bucket cap in MB (default 0.0001)"
    )
    ap.add_argument(
        "--strategy",
        choices=["bucketed", "naive", "ddp"],
        default="bucketed",
        help="default: bucketed",
    )
    ap.add_argument("--timeout-s", type=float, default=120, help="limit per run (default 120 s)")
    ap.add_argument("--once", action="store_true", help=argparse.SUPPRESS)  # one run, in-process
    args = ap.parse_args()
    if args.once:
        print(one_run(args.strategy, args.cap_mb))
        return 0
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [
        sys.executable,
        __file__,
        "--once",
        "--strategy",
        args.strategy,
        "--cap-mb",
        str(args.cap_mb),
    ]
    outcomes: collections.Counter[str] = collections.Counter()
    for i in range(1, args.runs + 1):
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, env=env)
            lines = p.stdout.strip().splitlines()
            outcome = lines[-1] if p.returncode == 0 and lines else f"launcher exit {p.returncode}"
            if "terminate called" in p.stderr:
                outcome += ' ("terminate called without an active exception")'
        except subprocess.TimeoutExpired:
            outcome = f"hung: no result after {args.timeout_s:.0f} s"
        outcomes[outcome] += 1
        print(f"run {i:3d}/{args.runs}: {outcome}", flush=True)
    bad = args.runs - outcomes["ok"]
    print(
        f"\n{bad} of {args.runs} runs failed ({args.strategy}, cap {args.cap_mb} MB, {WORLD} gloo ranks)"
    )
    for outcome, n in outcomes.most_common():
        print(f"  {n:3d}  {outcome}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
