"""Train through a failure: checkpoint every few steps, lose a rank, restart, resume.

    from labkit.workers import resilient_train
    res = resilient_train.run(resilient_train.ResilientTrainConfig(steps=12, every=4, kill_rank=1,
                                                                   kill_at_step=6),
                              nproc=2, max_restarts=1)
    res.result["lost_steps"], res.result["attempts"]        # 2, 2

A DDP job (gloo on CPU, NCCL on GPUs) trains labkit's GPT for ``steps`` optimizer steps.
Step s (counted from 0) reads batch s of ``data.fixed_batches``: the data position is the
step, so a job that resumes at step s reads exactly what an uninterrupted one would. Every
``every`` steps the ranks save a checkpoint with ``labkit.jobs.checkpoint`` (model, AdamW state,
data position, each rank's random-number generators); at start they load the newest complete
one, if any.

The planted failure: with ``kill_rank`` and ``kill_at_step`` set, that rank sends itself
SIGKILL when ``kill_at_step`` steps are done, as a machine that loses power would: no
exception, no cleanup. A marker file in the job folder makes it happen once per job, so the
rank torchrun restarts (``launch.run(..., max_restarts=1)``) trains on. Steps done since the
last checkpoint are lost and trained again: ``kill_at_step mod every`` of them.

Files in the job folder, for the notebook:

    losses.jsonl        rank 0, one line per step: step, loss (mean over ranks), attempt
                        (1 + torchrun's TORCHELASTIC_RESTART_COUNT), time
    events.jsonl        every rank: the kill, and in each attempt the process start, the
                        process group up, the checkpoint loaded, the first step done (times
                        from time.time(), one clock for every process of this machine)
    planted_kill.json   written by the killed rank just before it died: rank, step, time
    final_params.pt     rank 0: the trained parameters by name, for a bitwise comparison
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as tdist

from labkit import validate
from labkit.config import ModelConfig, TrainConfig
from labkit.data import fixed_batches
from labkit.formulas.checkpoints import predicted_lost_steps as predicted_lost_steps
from labkit.jobs import checkpoint, runtime
from labkit.jobs.spec import WorkerConfig
from labkit.model import GPT
from labkit.train import lr_at, make_optimizer, set_lr, train_step
from labkit.validate import InvalidValue

if TYPE_CHECKING:
    from labkit.jobs import launch

_IMPORTED = time.time()
MODULE = "labkit.workers.resilient_train"
KILL_MARKER = "planted_kill.json"
LOSSES = "losses.jsonl"
EVENTS = "events.jsonl"
FINAL_PARAMS = "final_params.pt"

DEFAULT_MODEL: dict[str, Any] = {"seq_len": 32, "n_layer": 2, "n_head": 2, "d_model": 64,
                                 "dropout": 0.1}  # fmt: skip
"""A GPT small enough for a CPU test; dropout on, so the saved RNG states matter."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResilientTrainConfig(WorkerConfig):
    """A DDP training job that checkpoints, and the failure planted in it (if any)."""

    WORKER: ClassVar[str] = MODULE
    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(**DEFAULT_MODEL))
    """The GPT (a dict of ModelConfig fields is taken as changes to DEFAULT_MODEL)."""
    seed: int = 0
    """Seeds the weights, the batches and each rank's dropout."""
    steps: int = 12
    """Optimizer steps."""
    every: int = 4
    """Checkpoint every this many steps."""
    keep: int = 2
    """Complete checkpoints kept."""
    global_batch: int = 8
    """Sequences per step, split evenly over the ranks."""
    lr: float = 3e-3
    """Peak learning rate."""
    grad_clip: float | None = 1.0
    """Gradient-norm clip (None: no clipping)."""
    kill_rank: int | None = None
    """The planted failure: this rank SIGKILLs itself ..."""
    kill_at_step: int | None = None
    """... once this many steps are done (once per job)."""
    checkpoint_dir: str | None = None
    """Where the checkpoints go (None: <job folder>/checkpoints)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.model, ModelConfig):
            raise validate.refuse("model", self.model, "a ModelConfig, or a dict of its fields")
        for name in ("steps", "every", "keep", "global_batch"):
            validate.whole(name, getattr(self, name), low=1)
        validate.whole("seed", self.seed, low=0)
        if (self.kill_rank is None) != (self.kill_at_step is None):
            raise InvalidValue("kill_rank and kill_at_step go together: both (a planted failure) "
                               "or neither")  # fmt: skip
        if self.kill_at_step is not None:
            validate.whole("kill_at_step", self.kill_at_step, low=1, high=self.steps - 1,
                           why="steps done when the rank dies")  # fmt: skip

    def check_ranks(self, world_size: int) -> None:
        """Refuse a job of ``world_size`` ranks that cannot split the batch or has no
        ``kill_rank``."""
        if self.global_batch % world_size:
            raise InvalidValue(f"global_batch={self.global_batch} does not split over {world_size} "
                               "ranks: make it a multiple of nproc")  # fmt: skip
        if self.kill_rank is not None:
            validate.whole("kill_rank", self.kill_rank, low=0, high=world_size - 1,
                           why="a rank of this job")  # fmt: skip

    def check_shared_root(self, agents: int) -> None:
        """A job of several agents (machines) needs a checkpoint folder they all see: by default
        each agent's job folder is its own, and the checkpoint would be split between them."""
        if agents > 1 and not self.checkpoint_dir:
            raise InvalidValue(
                f"this job spans {agents} agents (nodes), and each has its own job folder: give "
                "config checkpoint_dir, a folder on a file system every node sees, so that every "
                "rank writes the same checkpoint"
            )


DEFAULTS: dict[str, Any] = ResilientTrainConfig().to_dict()
"""Every field's default, the model's fields included (the notebook reads them here)."""


def weights_checksum(params: dict[str, torch.Tensor]) -> str:
    """SHA-256 of every parameter's bytes, in name order: equal only for bitwise-equal weights."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def process_start_time() -> float:
    """When this process started, as a ``time.time()`` value, to the kernel's clock tick
    (10 ms). ``/proc/self/stat`` gives the start in ticks since boot; the time since boot,
    subtracted from now, places it. (psutil's ``create_time`` adds the boot time, which Linux
    gives in whole seconds: up to a second off, too coarse for a restart that takes two.)
    Outside Linux: this module's import time, a little later than the start."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rpartition(")")[2].split()[19])  # field 22, starttime
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED


def read_jsonl(path: Path | str) -> list[dict[str, Any]]:
    """The JSON lines of ``path`` ([] if missing); a line torn by a kill is left out."""
    out = []
    try:
        text = Path(path).read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _append(path: Path | None, record: dict[str, Any]) -> None:
    if path is None:
        return
    with open(path, "a") as f:  # one short write per line: O_APPEND keeps lines whole
        f.write(json.dumps(record) + "\n")
        f.flush()


@runtime.entrypoint
def main(ctx: runtime.Context) -> dict[str, Any]:
    pg_up = time.time()  # runtime.entrypoint has just joined the process group
    started = process_start_time()
    cfg = ResilientTrainConfig.from_dict(ctx.config)
    cfg.check_ranks(ctx.world_size)
    cfg.check_shared_root(int(os.environ.get("GROUP_WORLD_SIZE", "1")))
    attempt = 1 + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    job_dir = ctx.job_dir
    events = job_dir / EVENTS if job_dir else None
    losses_file = job_dir / LOSSES if job_dir else None
    root = Path(cfg.checkpoint_dir or ((job_dir or Path.cwd()) / "checkpoints"))
    marker = (job_dir or root) / KILL_MARKER

    def event(name: str, t: float | None = None, **more: Any) -> float:
        t = time.time() if t is None else t
        _append(events, {"event": name, "rank": ctx.rank, "attempt": attempt, "time": t, **more})
        return t

    event("process_start", started)
    event("pg_up", pg_up)

    # Same seed on every rank: identical replicas (DDP would broadcast rank 0's anyway).
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model).to(ctx.device)
    n_params = sum(p.numel() for p in model.parameters())
    train = TrainConfig(steps=cfg.steps, lr=cfg.lr, grad_clip=cfg.grad_clip,
                        micro_batch=cfg.global_batch // ctx.world_size)  # fmt: skip
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None
    )
    opt = make_optimizer(model, train)
    # Each rank its own dropout stream: what the per-rank RNG state in a checkpoint is for.
    torch.manual_seed(cfg.seed + 1 + ctx.rank)
    if ctx.device.type == "cuda":
        torch.cuda.manual_seed(cfg.seed + 1 + ctx.rank)

    with ctx.phase("loading checkpoint"):
        loaded = checkpoint.load_latest(root, ddp, opt, log=print)
    loaded_at = event("checkpoint_loaded", step=loaded.step if loaded else 0)
    start = loaded.extra["data_position"] if loaded else 0

    kill = runtime.read_json(marker)
    lost = None
    if loaded is not None or kill is not None:
        done_before = kill["step"] if kill else start
        lost = done_before - start
        ctx.print0(f"attempt {attempt}: resumed from {loaded.path if loaded else 'scratch'} "
                   f"(step {start}); {done_before} steps were done before the kill: "
                   f"{lost} lost, trained again")  # fmt: skip

    batches = fixed_batches(cfg.model.seq_len, cfg.global_batch, cfg.steps, cfg.seed)
    b = cfg.global_batch // ctx.world_size
    ctx.heartbeat(step=start, total=cfg.steps)
    first_step_at = None
    saved: checkpoint.Saved | None = None
    for step in range(start, cfg.steps):
        if (ctx.rank == cfg.kill_rank and step == cfg.kill_at_step
                and not marker.exists()):  # fmt: skip
            runtime.write_json_atomic(marker, {"rank": ctx.rank, "step": step, "time": time.time(),
                                            "attempt": attempt})  # fmt: skip
            event("kill", step=step)
            print(f"planted failure: rank {ctx.rank} sends itself SIGKILL after {step} steps",
                  flush=True)  # fmt: skip
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batches[step]  # data position = step
        rows = slice(ctx.rank * b, (ctx.rank + 1) * b)
        set_lr(opt, lr_at(step + 1, train))
        with ctx.phase("train step"):
            stats = train_step(ddp, opt, [(x[rows], y[rows])], device=ctx.device,
                               grad_clip=train.grad_clip)  # fmt: skip
        loss = torch.tensor([stats.loss], device=runtime.collective_device())
        tdist.all_reduce(loss)
        mean = loss.item() / ctx.world_size
        if ctx.rank == 0:
            _append(losses_file, {"step": step + 1, "loss": mean, "attempt": attempt,
                                  "time": time.time()})  # fmt: skip
        if first_step_at is None:
            first_step_at = event("first_step", step=step + 1)
        ctx.heartbeat(step=step + 1)
        if (step + 1) % cfg.every == 0:
            with ctx.phase("checkpoint"):
                saved = checkpoint.save(root, step + 1, ddp, opt,
                                        extra={"data_position": step + 1}, keep=cfg.keep,
                                        log=None)  # fmt: skip

    params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    checksum = weights_checksum(params)
    final = None
    if job_dir is not None and ctx.rank == 0:
        final = job_dir / FINAL_PARAMS
        torch.save(params, final)
    kill_t = kill["time"] if kill else None

    def since(t: float | None) -> float | None:
        return None if kill_t is None or t is None else t - kill_t

    lost_predicted = None
    if cfg.kill_at_step is not None:
        lost_predicted = predicted_lost_steps(cfg.kill_at_step, cfg.every)
    return {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "device": str(ctx.device),
        "n_params": n_params,
        "steps": cfg.steps,
        "every": cfg.every,
        "attempts": attempt,
        "resumed_from_step": loaded.step if loaded else None,
        "resumed_from": loaded.path if loaded else None,
        "lost_steps": lost,
        "lost_steps_predicted": lost_predicted,
        "killed": kill,
        # measured on this rank, this attempt (one clock: time.time() on one machine)
        "kill_to_restart_s": since(started),
        "kill_to_pg_up_s": since(pg_up),
        "kill_to_loaded_s": since(loaded_at),
        "kill_to_first_step_s": since(first_step_at),
        "load_s": loaded.seconds if loaded else None,
        "checkpoint": saved.as_dict() if saved else None,
        "checksum": checksum,
        "final_params": str(final) if final else None,
        "losses_file": str(losses_file) if losses_file else None,
        "events_file": str(events) if events else None,
        "checkpoint_dir": str(root),
    }


def run(config: ResilientTrainConfig, *, nproc: int = 2, max_restarts: int = 1,
        **launch_kwargs: Any) -> launch.JobResult:  # fmt: skip
    """Check ``config`` against ``nproc`` ranks (ValueError before anything starts), then
    launch with torchrun allowed ``max_restarts`` restarts (the launcher gives each attempt
    its own rendezvous store).
    """
    from labkit.jobs import launch  # the caller's side: a rank never imports the launcher
    if not isinstance(config, ResilientTrainConfig):
        raise validate.refuse("config", config, "a ResilientTrainConfig (ResilientTrainConfig(**fields) "
                              "builds one from a dict of its fields)")  # fmt: skip
    config.check_ranks(nproc)
    return launch.run(config, nproc=nproc, max_restarts=max_restarts, **launch_kwargs)


if __name__ == "__main__":
    main()
