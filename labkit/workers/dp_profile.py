"""A data-parallel job that profiles itself: one Chrome trace per rank, per run.

    from labkit.workers import dp_profile
    res = dp_profile.run(dp_profile.DPProfileConfig(runs=(
        {"name": "naive", "strategy": "naive"},
        {"name": "ddp", "strategy": "ddp"},
        {"name": "ddp, rank 1 slowed", "strategy": "ddp", "slow_ms": 30}), slow_rank=1))
    dp_profile.trace_paths(res, "ddp")     # [rank 0's trace, rank 1's]

Each rank trains the course GPT on its own shard of the corpus under ``torch.profiler`` with
``schedule(wait, warmup, active)`` and writes ``<job dir>/traces/<run>/rank{r}.json``. One job does
every run asked for, one after another (starting a job costs seconds; a run costs a few steps).
Every step is annotated with :func:`labkit.profiling.phase`: data, forward, backward,
optimizer, and, for the naive strategy, communication. Two strategies from notebook 02:

    naive  every gradient all-reduced one tensor at a time *after* backward (NaiveDP, run
           under its ``no_sync`` so that this worker can call its all-reduce inside a
           "communication" range): nothing can overlap
    ddp    DistributedDataParallel with ``bucket_cap_mb`` buckets, each all-reduced as soon as
           its gradients are ready, while backward goes on: overlap is possible

A run's ``slow_ms`` plants a straggler: rank ``slow_rank`` sleeps that long in its data phase
every step (a slow disk, a busy data loader); switch it off with 0. Traces are written by the profiler when its
active window ends; a rank that dies before that leaves no trace, and the launcher ends the
others (``labkit.jobs.launch``), so no partial set is ever returned as complete.

Config: :class:`DPProfileConfig` (``run`` and ``nsys_command`` take only this class), every
field optional: model (a ModelConfig, or a dict of its fields; default the smoke GPT),
micro_batch (8), runs (naive then ddp, none slowed), each {"name", "strategy", "slow_ms"};
bucket_cap_mb (0.05), wait (1), warmup (1), active (3), slow_rank (1), profiler ("torch"),
seed (0), lr (1e-3), dtype ("float32").
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.profiler import profile, schedule

from labkit import config as lk_config
from labkit import data, train, validate
from labkit.config import ModelConfig
from labkit.jobs import runtime
from labkit.jobs.spec import WorkerConfig
from labkit.model import GPT
from labkit.parallel.ddp import TorchDDP
from labkit.parallel.dp_naive import NaiveDP
from labkit.profiling.capture import activities, quiet_kineto
from labkit.profiling.nsight import NsysCommand, NsysTorchrunCommand, cuda_profiler_capture
from labkit.profiling.phases import COMMUNICATION, phase
from labkit.validate import InvalidValue

if TYPE_CHECKING:
    from labkit.jobs import launch

MODULE = "labkit.workers.dp_profile"
STRATEGIES = ("naive", "ddp")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPProfileConfig(WorkerConfig):
    """The runs to profile, one after another, and the profiler's schedule."""

    WORKER: ClassVar[str] = MODULE
    model: ModelConfig = dataclasses.field(default_factory=lambda: lk_config.smoke().model)
    """The GPT (default: the smoke preset's; a dict of ModelConfig fields changes that one)."""
    micro_batch: int = 8
    """Sequences per rank per step."""
    runs: tuple[dict[str, Any], ...] = tuple({"name": s, "strategy": s, "slow_ms": 0.0}
                                             for s in STRATEGIES)  # fmt: skip
    """Each {"name", "strategy" (from STRATEGIES), "slow_ms" (optional, default 0)}."""
    bucket_cap_mb: float = 0.05
    """DDP's bucket size. Small, so that a model of 0.5 MB of gradients has several: with
    DDP's default 25 MB there is one bucket, ready only when backward ends, and nothing to
    overlap."""
    wait: int = 1
    """Profiler schedule: steps not recorded at all."""
    warmup: int = 1
    """Profiler schedule: steps recorded and thrown away."""
    active: int = 3
    """Profiler schedule: steps in the trace."""
    slow_rank: int = 1
    """The rank a run's ``slow_ms`` slows."""
    profiler: str = "torch"
    """With "torch", torch.profiler writes the traces; with "nsys", no torch.profiler (it and Nsight
    Systems both use CUPTI and must not run together); on CUDA the active steps are wrapped in
    torch.cuda.profiler.start/stop, the range nsys --capture-range=cudaProfilerApi records."""
    seed: int = 0
    """Seeds the model (the same on every rank) and each rank's batches."""
    lr: float = 1e-3
    """AdamW's learning rate."""
    dtype: str = "float32"
    """The forward's autocast dtype (labkit.train.autocast): the notebook's on GPU ranks, so
    the job profiles the step its header names; float32 on CPU ranks."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.model, ModelConfig):
            raise validate.refuse("model", self.model, "a ModelConfig, or a dict of its fields")
        validate.whole("micro_batch", self.micro_batch, low=1)
        validate.whole("active", self.active, low=1,
                       why="a schedule with no active step records nothing")  # fmt: skip
        for name in ("wait", "warmup", "seed"):
            validate.whole(name, getattr(self, name), low=0)
        if not self.runs:
            raise validate.refuse("runs", self.runs, "a non-empty list of {'name', 'strategy', 'slow_ms'}")
        runs = tuple(_checked_run(run) for run in self.runs)
        names = [r["name"] for r in runs]
        if len(set(names)) != len(names):
            raise InvalidValue(f"runs have repeated names {names}: each names a folder of traces")
        object.__setattr__(self, "runs", runs)  # one shape: every run has its slow_ms
        validate.one_of("profiler", self.profiler, ("torch", "nsys"),
                        why="'torch': traces; 'nsys': a capture range")  # fmt: skip
        validate.positive("bucket_cap_mb", self.bucket_cap_mb, why="a size in MB")
        validate.positive("lr", self.lr)
        validate.one_of("dtype", self.dtype, sorted(train.DTYPES))

    def check_ranks(self, world_size: int) -> None:
        """Refuse a slowed run's ``slow_rank`` that is not one of ``world_size`` ranks."""
        if any(r["slow_ms"] for r in self.runs):
            validate.whole("slow_rank", self.slow_rank, low=0, high=world_size - 1,
                           why="the rank a run's slow_ms slows")  # fmt: skip


def _checked_run(run: Any) -> dict[str, Any]:
    """One of ``runs``, with its ``slow_ms`` (0 if left out), or refused naming it."""
    if not isinstance(run, Mapping):
        raise validate.refuse("runs", run, "a dict {'name', 'strategy', 'slow_ms'} per run")
    run = {"slow_ms": 0.0, **run}
    if set(run) != {"name", "strategy", "slow_ms"}:
        raise InvalidValue(f"run {run!r}: give exactly 'name', 'strategy' and optionally 'slow_ms'")
    validate.one_of("strategy", run["strategy"], STRATEGIES, why=f"run {run['name']!r}")
    validate.number("slow_ms", run["slow_ms"], low=0, why=f"run {run['name']!r}: a delay in ms")
    return run


DEFAULTS: dict[str, Any] = {k: v for k, v in DPProfileConfig().to_dict().items() if k != "model"}
"""Every field's default but the model's (the notebook reads ``bucket_cap_mb`` from here)."""


def _checked(config: DPProfileConfig, nproc: int) -> DPProfileConfig:
    """``config``, refused unless it is a DPProfileConfig that ``nproc`` ranks can run."""
    if not isinstance(config, DPProfileConfig):
        raise validate.refuse("config", config, "a DPProfileConfig (DPProfileConfig(**fields) "
                              "builds one from a dict of its fields)")  # fmt: skip
    config.check_ranks(nproc)
    return config


def forward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
            dtype: str) -> torch.Tensor:
    """The step's forward and loss, in the ``forward`` phase, under autocast to ``dtype``."""
    with phase("forward"), train.autocast(x.device, dtype):
        _, loss = model(x, y)
    return loss


def _profile_one(ctx: runtime.Context, cfg: DPProfileConfig, run: dict[str, Any], out: Path,
                 done: int, total: int) -> list[float]:
    """Train one run under the profiler; return the wall time of every step."""
    name = run["strategy"]
    torch.manual_seed(cfg.seed)  # identical replicas on every rank
    model = GPT(cfg.model).to(ctx.device)
    if name == "naive":
        strategy: NaiveDP | TorchDDP = NaiveDP(ctx.world_size, ctx.backend)
    else:
        strategy = TorchDDP(ctx.world_size, ctx.backend, bucket_cap_mb=cfg.bucket_cap_mb)
    wrapped = strategy.wrap(model)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=cfg.lr)
    shard = data.shard(data.load_splits().train, ctx.rank, ctx.world_size)
    gen = torch.Generator().manual_seed(cfg.seed + ctx.rank)
    seq_len = cfg.model.seq_len
    slow = run["slow_ms"] / 1e3 if ctx.rank == cfg.slow_rank else 0.0
    steps = cfg.wait + cfg.warmup + cfg.active
    out.parent.mkdir(parents=True, exist_ok=True)
    seconds: list[float] = []

    def export(prof: profile) -> None:
        tmp = out.with_suffix(".part")  # a reader never sees a half-written trace
        prof.export_chrome_trace(str(tmp))
        tmp.replace(out)

    sched = schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1)
    first_active = cfg.wait + cfg.warmup
    capture = contextlib.ExitStack()
    with_torch = cfg.profiler == "torch"
    with (profile(activities=activities(ctx.device), schedule=sched, on_trace_ready=export) if with_torch
          else contextlib.nullcontext()) as prof, capture:  # fmt: skip
        for step in range(steps):
            if not with_torch and step == first_active:
                capture.enter_context(cuda_profiler_capture())
            t0 = time.perf_counter()
            with phase("data"):
                x, y = data.get_batch(shard, cfg.micro_batch, seq_len, gen, ctx.device)
                if slow:
                    time.sleep(slow)  # the planted straggler
            loss = forward(wrapped, x, y, cfg.dtype)
            if name == "naive":
                with strategy.no_sync(), phase("backward"):
                    loss.backward()
                with phase(COMMUNICATION):
                    strategy.after_backward()  # notebook 02's all-reduce, one tensor at a time
            else:
                with phase("backward"):
                    loss.backward()  # DDP's buckets are all-reduced from inside this
            with phase("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            seconds.append(time.perf_counter() - t0)
            if with_torch:
                prof.step()
            ctx.heartbeat(step=done + step + 1, total=total)
    if with_torch and not out.exists():
        raise RuntimeError(f"rank {ctx.rank}: the profiler wrote no trace to {out}")
    return seconds


@runtime.entrypoint
def main(ctx: runtime.Context) -> dict[str, Any]:
    cfg = DPProfileConfig.from_dict(ctx.config)
    cfg.check_ranks(ctx.world_size)
    quiet_kineto()  # one "profiler_start" line per rank and run would bury the job's output
    if ctx.device.type == "cpu":
        torch.set_num_threads(1)  # ranks share the cores; more threads only contend
    root = (ctx.job_dir or Path.cwd()) / "traces"
    steps = cfg.wait + cfg.warmup + cfg.active
    total = steps * len(cfg.runs)
    traces: dict[str, str] = {}
    step_s: dict[str, list[float]] = {}
    for i, run in enumerate(cfg.runs):
        name = run["name"]
        ctx.heartbeat(part=f"{name} ({i + 1}/{len(cfg.runs)})")
        out = root / f"run{i}" / f"rank{ctx.rank}.json"
        step_s[name] = _profile_one(ctx, cfg, run, out, i * steps, total)
        if cfg.profiler == "torch":
            traces[name] = str(out)
            ctx.print0(f"{name}: traced {cfg.active} steps -> {out.parent}")
    with contextlib.suppress(Exception):
        torch.distributed.barrier()  # every rank's traces written before rank 0 reports
    return {"rank": ctx.rank, "traces": traces, "step_s": step_s, "config": cfg.to_dict(),
            "device": str(ctx.device), "backend": ctx.backend, "torch": torch.__version__}


def trace_paths(res: launch.JobResult, run: str) -> list[Path]:
    """Every rank's trace for the run called ``run``, in rank order; raises if one is missing."""
    paths = []
    for r, rank in enumerate(res.ranks):
        path = (rank.get("traces") or {}).get(run)
        if path is None or not Path(path).exists():
            raise FileNotFoundError(f"rank {r} wrote no trace for {run!r}: see {res.log_dir}")
        paths.append(Path(path))
    return paths


def nsys_command(config: DPProfileConfig, *, nproc: int, out_dir: str | Path,
                 python: str = sys.executable) -> tuple[NsysCommand | NsysTorchrunCommand, dict[str, str]]:
    """The ``nsys profile`` command for this job, and the environment it needs.

    One process: ``nsys profile ... python -m labkit.workers.dp_profile``; several:
    torchrun starting nsys once per rank (one report per rank). The job's config goes in a
    job directory under ``out_dir`` (``LABKIT_JOB_DIR``), with the torch profiler off and the
    CUDA capture range on. Writes that directory; runs nothing.
    """
    job = dataclasses.replace(_checked(config, nproc), profiler="nsys")
    out_dir = Path(out_dir)
    job_dir = out_dir / "job"
    runtime.write_json_atomic(job_dir / runtime.SPEC_FILE, {"config": job.to_dict()})
    env = {runtime.JOB_DIR_ENV: str(job_dir)}
    output = out_dir / "dp_profile"
    if nproc == 1:
        return NsysCommand(target=[python, "-u", "-m", MODULE], output=output), env
    return NsysTorchrunCommand(module=MODULE, nproc=nproc, output=output, python=python), env


def run(config: DPProfileConfig, *, nproc: int = 2, **launch_kwargs: Any) -> launch.JobResult:
    """Check ``config`` against ``nproc`` ranks (ValueError before anything starts), then launch
    the job."""
    from labkit.jobs import launch  # the caller's side: a rank never imports the launcher
    return launch.run(_checked(config, nproc), nproc=nproc, **launch_kwargs)


if __name__ == "__main__":
    main()
