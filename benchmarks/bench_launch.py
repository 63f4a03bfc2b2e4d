"""What does labkit's launcher cost over a bare torchrun?

    python -m benchmarks.bench_launch                  # 5 pairs of 2-rank launches
    python -m benchmarks.bench_launch --record         # save to benchmarks/results/

Times ``labkit.jobs.launch.run(AllReduceConfig(...), nproc=2, ...)`` against

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m labkit.workers.allreduce

started with ``subprocess`` and its output sent to a file, each measured from the caller's
side (start of the call to the moment it returns), alternately, and reports
ratio = median(labkit) / median(bare). Target: <= 1.05.

Both launch the same worker on the same work. The worker reads its configuration from the
job directory named by ``LABKIT_JOB_DIR`` (``job.json``, written by ``labkit.jobs.launch``): for
the bare launch this benchmark writes the same ``job.json`` itself, and sets the variables
the worker's behaviour depends on (the job directory, ``TMPDIR`` inside it, and
``GLOO_SOCKET_IFNAME=lo`` where the launcher would set it). Both use gloo on the CPU, even on a
GPU machine: what is measured is the launcher, not the interconnect. Both must leave a result
from every rank, or the benchmark fails.

What the launcher adds on top: input checks, a look for leftover jobs, the exec wrapper that
arms the parent-death signal, ``--tee`` and per-rank log files, and a supervision loop that
reads heartbeats every 0.25 s. A 2-rank launch costs ~5-8 s on 2 CPU cores (``import torch``
in three processes dominates), so the rounds are few and the spread matters: read the
quartiles in the record, not only the ratio.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common
from labkit.jobs import launch, runtime
from labkit.workers.allreduce import AllReduceConfig

NAME = "launch"
TARGET = 1.05  # the launcher may cost at most 5% more wall time than bare torchrun
MODULE = AllReduceConfig.WORKER
NPROC = 2
WORKER_CONFIG = AllReduceConfig(numel=2**16, repeats=3, warmup=1)  # small: launching is the point
REPO_ROOT = Path(__file__).resolve().parents[1]


def launch_labkit(job_root: Path, timeout_s: float) -> float:
    """One job through labkit.jobs.launch.run; returns its wall time seen by the caller."""
    t0 = time.perf_counter()
    res = launch.run(
        WORKER_CONFIG,
        nproc=NPROC,
        device="cpu",
        backend="gloo",
        log_dir=job_root,
        stream=False,
        timeout_s=timeout_s,
    )
    elapsed = time.perf_counter() - t0
    _check_ranks([res.rank(r) for r in range(NPROC)], "labkit.jobs.launch.run", res.log_dir)
    return elapsed


def bare_command() -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(NPROC),
        "-m",
        MODULE,
    ]


def bare_env(job_dir: Path) -> dict[str, str]:
    """The environment the worker needs to find its job, and nothing of the launcher's own."""
    env = dict(os.environ)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env[runtime.JOB_DIR_ENV] = str(job_dir)
    env["TMPDIR"] = str(job_dir / "tmp")
    if "lo" in {name for _, name in socket.if_nameindex()}:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # as labkit.jobs.launch does for gloo
    # the worker module must be importable from a fresh interpreter, as the launcher ensures
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def write_spec(job_dir: Path) -> None:
    """The job.json labkit.jobs.launch.run would write for this job (see labkit.jobs.runtime)."""
    (job_dir / "tmp").mkdir(parents=True)
    runtime.write_json_atomic(job_dir / runtime.SPEC_FILE, {
        "job_id": job_dir.name, "module": MODULE, "nproc": NPROC, "backend": "gloo",
        "device": "cpu", "pg_timeout_s": runtime.DEFAULT_PG_TIMEOUT_S,
        "config": WORKER_CONFIG.to_dict(),
    })  # fmt: skip


def launch_bare(job_root: Path, index: int, timeout_s: float) -> float:
    """One job through a bare torchrun subprocess; returns its wall time seen by the caller.

    Writing job.json happens before the clock starts: it stands for what the user of a bare
    torchrun would have prepared anyway (a config file).
    """
    job_dir = job_root / f"bare-{index:03d}"
    write_spec(job_dir)
    env = bare_env(job_dir)
    with open(job_dir / "torchrun.log", "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.run(
            bare_command(),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            check=False,
        )
        elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (job_dir / "torchrun.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"bare torchrun exited with {proc.returncode}; log {job_dir}:\n{tail}")
    _check_ranks(
        [runtime.read_json(runtime.result_path(job_dir, r)) or {} for r in range(NPROC)],
        "bare torchrun",
        job_dir,
    )
    return elapsed


def _check_ranks(results: list[dict[str, Any]], who: str, where: Path) -> None:
    """Both launches must have done the work: every rank reports the right sum."""
    for r, res in enumerate(results):
        if res.get("value") != res.get("expected") or res.get("expected") is None:
            raise RuntimeError(f"{who}: rank {r} left no correct result ({res!r}); see {where}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="counted pairs of launches (5)")
    p.add_argument("--warmup", type=int, default=1, help="uncounted pairs first (1)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="limit per launch, seconds")
    p.add_argument(
        "--record", action="store_true", help="save to benchmarks/results/launch-<machine>.json"
    )
    p.add_argument("--out", default=None, help="save the JSON record to this file instead")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    counter = {"bare": 0}

    with tempfile.TemporaryDirectory(prefix="labkit-bench-launch-") as tmp:
        root = Path(tmp)

        def bare() -> float:
            counter["bare"] += 1
            return launch_bare(root, counter["bare"], args.timeout_s)

        def report(r: int, got: dict[str, float]) -> None:
            tag = "warm-up" if r < 0 else f"round {r + 1}/{args.rounds}"
            print(
                f"{tag}: labkit {got['labkit']:.2f} s, bare torchrun {got['bare']:.2f} s",
                flush=True,
            )

        print(
            f"launch: {NPROC}-rank {MODULE} (gloo, CPU), labkit.jobs.launch.run vs bare torchrun, "
            f"{args.rounds} pairs (+{args.warmup} warm-up)",
            flush=True,
        )
        samples = _common.alternate(
            {"labkit": lambda: launch_labkit(root / "labkit", args.timeout_s), "bare": bare},
            rounds=args.rounds,
            warmup=args.warmup,
            on_round=report,
        )

    cmp = _common.comparison(samples, "labkit", "bare", TARGET,
                             what="median wall seconds per 2-rank job, labkit.jobs.launch.run / bare "
                                  "torchrun --standalone, alternated")  # fmt: skip
    record = _common.make_record(
        NAME, device="cpu",
        params={"module": MODULE, "nproc": NPROC, "backend": "gloo",
                "config": WORKER_CONFIG.to_dict(),
                "rounds": args.rounds, "warmup": args.warmup, "bare_command": bare_command()[1:],
                "order": "alternating, first mover swapped"},
        samples_s=samples, **cmp,
    )  # fmt: skip
    med = cmp["median_s"]
    print(f"median launch: labkit {med['labkit']:.2f} s, bare torchrun {med['bare']:.2f} s")
    print(
        f"ratio labkit/bare = {cmp['ratio']:.4f}, per-round {cmp['paired_ratio']:.4f} "
        f"(target <= {TARGET}: "
        f"{'met' if cmp['within_target'] else 'NOT met'})"
    )
    _common.emit(record, name=NAME, out=args.out, record_it=args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
