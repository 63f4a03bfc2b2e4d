"""The capstone's job: data-parallel training of the course GPT, every knob of it a setting.

    capstone_train.run(CapstoneConfig(steps=8, settings={"prepare_data": "per_item",
                                                         "straggler_s": 0.1}), nproc=2)

Usually started by :func:`labkit.course.capstone.run_job`, which turns a job's settings
(:class:`labkit.course.capstone.Settings`) into this config's knobs and passes them sealed
(:class:`labkit.workers.capstone_config.CapstoneConfig`), so the job spec on disk names no
setting. This module knows
no fault: it trains, with whatever knobs it is given, and reports what an engineer's tools
would show (the tools of notebooks 00–06), raw:

* per step: the wall time and its labelled phases (data, forward, backward, optimizer; what
  the step spends outside them is the learner's to explain), the loss, the gradient norm,
  the memory, the all-reduce calls and bytes each micro-batch's backward issued, the host
  syncs in forward and in backward (a GPU only);
* a checkpoint every ``checkpoint_every`` steps, written by rank 0 alone (its time falls
  outside the phases: a healthy job's slow step);
* a profiler trace of the last ``profile_steps`` steps (not timed), with those phases as
  ``record_function``/NVTX ranges, written into the job directory;
* facts: threads and cores, the environment's thread and NCCL variables, a few runtime flags,
  the loader (dataset, sampler, batch, pinning, the cost of one item), the optimizer's class
  and hyper-parameters, the model's dimensions, the sample indices of every epoch. Settings
  the job was started with are not echoed back: what they do shows in the measurements and
  the trace (the dtype of each matmul, the optimizer's operators, autograd's checks).

Config (:class:`~labkit.workers.capstone_config.CapstoneConfig`, all optional; defaults are the
healthy job; every field below but the last line's is a knob, in ``settings`` or ``sealed``):
    model          GPT fields (seq_len, n_layer, n_head, d_model); default the smoke model
    global_batch   sequences per optimizer step over all ranks (32)
    micro_batch    sequences per forward/backward on each rank (half a rank's share)
    prepare_data   "once" (tokenise before training) or "per_item" (in __getitem__)
    loader_workers DataLoader worker processes per rank (0: the rank loads its own batches)
    no_sync        DDP's no_sync() for every micro-batch but the last (True)
    bucket_cap_mb  DDP's gradient bucket cap (25)
    straggler_s    seconds the last rank sleeps in each step's first forward (0)
    threads        PyTorch threads per rank (None: the cores shared out among the ranks)
    anomaly_detection   autograd's anomaly mode for the whole run (False)
    eval_every_steps    validate every this many steps; 0: once, after the last (0)
    activation_checkpointing  recompute each block in backward (False)
    sampler        "distributed" or "random" (one shuffled order shared by every rank)
    set_epoch      call sampler.set_epoch(epoch) each epoch (True)
    zero_grad      zero the gradients after each optimizer step (True)
    dtype          the autocast dtype on a GPU ("bfloat16"; a CPU trains in float32)
    loss_item_every_micro_batch  read loss.item() after every micro-batch (False)
    optimizer      AdamW's implementation: "default", "for_loop", "foreach", "fused"
    pin_memory     on a GPU: pinned batches and non_blocking copies (True)
    vocab_size     the model's vocabulary (320: the tokeniser's 257 padded to 64s)
    steps, epoch_steps, loader_passes, profile_steps, checkpoint_every, eval_batches, seed, lr
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as tdist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import profile, schedule
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, RandomSampler, Sampler
from torch.utils.data.distributed import DistributedSampler

from labkit import data
from labkit.config import TrainConfig
from labkit.jobs import runtime
from labkit.model import GPT
from labkit.parallel import comm
from labkit.profiling.bottlenecks import TokenizingDataset
from labkit.profiling.capture import activities, quiet_kineto
from labkit.profiling.phases import phase
from labkit.timing import synchronize
from labkit.train import autocast, make_optimizer
from labkit.workers.capstone_config import DEFAULTS as DEFAULTS
from labkit.workers.capstone_config import CapstoneConfig

if TYPE_CHECKING:
    from labkit.jobs import launch

PHASES = ("data", "forward", "backward", "optimizer")
ENV_SHOWN = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
SHORT_TMP = 60  # characters of TMPDIR that leave room for multiprocessing's socket names


class PhaseClock:
    """Marks in time without waiting for the device: ``time.perf_counter`` on a CPU, CUDA events
    on a GPU (read once the step has synchronised), so timing the phases adds no sync of its
    own: one would hide a host sync and blunt a slow dtype. On a GPU a phase is the time
    between two events on the stream; an event recorded on an idle stream completes at once,
    so a delay on the host between it and the next kernels (a slow rank's sleep) falls inside
    the phase, as it does on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


class SyncCounter:
    """Counts the host-device synchronisations inside a ``with`` block on a GPU, through
    CUDA's sync debug mode (``torch.cuda.set_sync_debug_mode("warn")`` warns at every op that
    makes the CPU wait for the GPU: ``.item()``, printing a CUDA tensor, ``.cpu()``). Counts 0
    on a CPU, which has nothing to wait for."""

    def __init__(self, device: torch.device) -> None:
        self.cuda, self.count = device.type == "cuda", 0

    def __enter__(self) -> SyncCounter:
        if self.cuda:
            self._mode = torch.cuda.get_sync_debug_mode()
            self._caught = warnings.catch_warnings(record=True)
            self._records = self._caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode(self._mode)
            self._caught.__exit__(*exc)
            self.count = sum("synchroniz" in str(w.message) for w in self._records)


class Prepared(torch.utils.data.Dataset):
    """Every item of ``dataset`` computed once, up front."""

    def __init__(self, dataset: torch.utils.data.Dataset) -> None:
        self.items = [dataset[i] for i in range(len(dataset))]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


class Recording(Sampler[int]):
    """``inner``'s indices, each epoch's appended to ``epochs`` as they are handed out. With
    loader workers the sampler runs ahead of training (prefetching), so the last epoch can
    hold indices no step trained on yet."""

    def __init__(self, inner: Sampler[int], epochs: list[list[int]]) -> None:
        self.inner, self.epochs = inner, epochs

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self):
        self.epochs.append([])
        for i in self.inner:
            self.epochs[-1].append(int(i))
            yield i


def _save(path: Path, state: dict[str, Any]) -> int:
    """Write ``state`` to ``path`` durably (a temporary file, fsync, rename: a crash mid-write
    leaves the last checkpoint whole) and return its bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return path.stat().st_size


def _rss_mb() -> float:
    """This process's resident memory in MiB (Linux's /proc; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def _optimizer(model: torch.nn.Module, cfg: dict[str, Any]) -> torch.optim.Optimizer:
    impl = {"default": {}, "for_loop": {"foreach": False, "fused": False},
            "foreach": {"foreach": True}, "fused": {"fused": True}}[cfg["optimizer"]]  # fmt: skip
    return make_optimizer(model, TrainConfig(lr=cfg["lr"]), **impl)


def _checkpointed(block: torch.nn.Module) -> None:
    """Make ``block`` keep only its input and recompute the rest in backward (Chen et al.
    2016, arXiv:1604.06174): memory for one more forward."""
    inner = block.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    block.forward = forward


@runtime.entrypoint
def main(ctx: runtime.Context) -> dict[str, Any]:
    n, rank, device = ctx.world_size, ctx.rank, ctx.device
    job = CapstoneConfig.from_dict(ctx.config)
    share, micro = job.split(n)
    gpt = job.gpt()
    cfg = job.flat()  # the knobs by name: a planted fault is a knob set wrong
    quiet_kineto()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    torch.set_num_threads(int(cfg["threads"] or max(1, cores // n)))
    torch.autograd.set_detect_anomaly(bool(cfg["anomaly_detection"]))
    on_gpu = device.type == "cuda"

    # The data: windows of the course corpus, tokenised in __getitem__ or once, up front.
    seq_len = gpt.seq_len
    raw = TokenizingDataset(seq_len=seq_len, passes=cfg["loader_passes"],
                            n_items=cfg["global_batch"] * cfg["epoch_steps"])  # fmt: skip
    t0 = time.perf_counter()
    dataset = raw if cfg["prepare_data"] == "per_item" else Prepared(raw)
    prepare_s = time.perf_counter() - t0
    if cfg["sampler"] == "random":  # one seed on every rank: one order everywhere
        inner: Sampler[int] = RandomSampler(dataset, generator=torch.Generator().manual_seed(cfg["seed"]))
    else:
        inner = DistributedSampler(dataset, num_replicas=n, rank=rank, shuffle=True,
                                   seed=cfg["seed"], drop_last=True)  # fmt: skip
    epochs: list[list[int]] = []
    pin = on_gpu and bool(cfg["pin_memory"])
    workers = int(cfg["loader_workers"])  # the sampler stays in this process: epochs recorded
    if workers and len(tempfile.gettempdir()) > SHORT_TMP:
        # Workers hand batches back through a Unix socket that Python's multiprocessing makes
        # under TMPDIR, which the launcher points into the job's folder: past 107 characters
        # the socket cannot bind ("AF_UNIX path too long", seen in CI) and no batch arrives.
        # One short folder per user, reused by every such job (ranks end with os._exit, so a
        # folder per job would outlive it).
        short = Path("/tmp") / f"labkit-{os.getuid()}"
        short.mkdir(mode=0o700, exist_ok=True)
        os.environ["TMPDIR"] = tempfile.tempdir = str(short)
    loader = DataLoader(dataset, batch_size=share, sampler=Recording(inner, epochs),
                        drop_last=True, pin_memory=pin, num_workers=workers,
                        persistent_workers=workers > 0)  # fmt: skip
    val = TokenizingDataset(data.load_splits().val, seq_len=seq_len,
                            n_items=share * cfg["eval_batches"])  # fmt: skip
    val_x, val_y = (torch.stack(t).to(device) for t in zip(*(val[i] for i in range(len(val))), strict=True))

    torch.manual_seed(cfg["seed"])  # the same initial weights on every rank (DDP broadcasts)
    model = GPT(gpt).to(device)
    if cfg["activation_checkpointing"]:
        for block in model.blocks:
            _checkpointed(block)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if on_gpu else None,
                                  bucket_cap_mb=float(cfg["bucket_cap_mb"]))  # fmt: skip
    counter = comm.ByteCounter(n, ctx.backend, "counted by a DDP communication hook")
    ddp.register_comm_hook(None, comm.counting_hook(counter, default_hooks.allreduce_hook))
    opt = _optimizer(ddp, cfg)
    dtype = cfg["dtype"] if on_gpu else "float32"
    k = share // micro
    slow = rank == n - 1 and cfg["straggler_s"] > 0
    uses_set_epoch = isinstance(inner, DistributedSampler) and cfg["set_epoch"]

    def evaluate() -> float:
        model.eval()
        with torch.no_grad(), autocast(device, dtype):
            losses = [model(val_x[i:i + share], val_y[i:i + share])[1]
                      for i in range(0, len(val_x), share)]  # fmt: skip
        model.train()
        return float(torch.stack(losses).mean())

    clock = PhaseClock(device)
    timed, total_steps = cfg["steps"], cfg["steps"] + cfg["profile_steps"]
    rec: dict[str, list[Any]] = {key: [] for key in (
        "step_s", "data_s", "forward_s", "backward_s", "optimizer_s", "losses", "grad_norm",
        "memory_mb", "allreduce_calls", "allreduce_bytes", "host_syncs", "val_losses")}  # fmt: skip
    state = {"epoch": 0, "batches": iter(())}
    checkpoints = Path(ctx.job_dir or Path.cwd()) / "checkpoint"
    saved: list[tuple[int, int]] = []  # (after step, bytes) of each checkpoint rank 0 wrote
    if uses_set_epoch:
        inner.set_epoch(0)

    def one_step(step: int) -> None:
        synchronize(device)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
        t_start = time.perf_counter()
        with phase("data"):
            batch = next(state["batches"], None)
            if batch is None:  # the epoch ended: a new pass over the data
                if epochs:
                    state["epoch"] += 1
                    if uses_set_epoch:
                        inner.set_epoch(state["epoch"])
                state["batches"] = iter(loader)
                batch = next(state["batches"])
            x, y = (t.to(device, non_blocking=pin) for t in batch)
        t_data = time.perf_counter()
        total = torch.zeros((), device=device)
        spans, calls, sent = [], [], []  # per micro-batch: marks, all-reduce calls and bytes
        syncs = {"forward": 0, "backward": 0}  # host-device syncs counted in each phase
        for j in range(k):
            sl = slice(j * micro, (j + 1) * micro)
            sync = j == k - 1 or not cfg["no_sync"]
            before = counter.calls_so_far(), counter.bytes_so_far()
            with contextlib.nullcontext() if sync else ddp.no_sync():
                a = clock.mark()
                with phase("forward"), SyncCounter(device) as counted:
                    if slow and j == 0:
                        time.sleep(cfg["straggler_s"])  # a slow node: its compute takes longer
                    with autocast(device, dtype):
                        _, loss = ddp(x[sl], y[sl])
                    loss = loss / k
                    if cfg["loss_item_every_micro_batch"]:
                        loss.item()  # the CPU waits for the GPU to drain its queue
                syncs["forward"] += counted.count
                b = clock.mark()
                with phase("backward"), SyncCounter(device) as counted:
                    loss.backward()
                syncs["backward"] += counted.count
                spans.append((a, b, clock.mark()))
            calls.append(counter.calls_so_far() - before[0])
            sent.append(counter.bytes_so_far() - before[1])
            total += loss.detach()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        c = clock.mark()
        with phase("optimizer"):
            opt.step()
            if cfg["zero_grad"]:
                opt.zero_grad(set_to_none=True)
        end = clock.mark()
        if cfg["eval_every_steps"] and (step + 1) % cfg["eval_every_steps"] == 0:
            rec["val_losses"].append((step + 1, evaluate()))
        if rank == 0 and cfg["checkpoint_every"] and (step + 1) % cfg["checkpoint_every"] == 0:
            # Rank 0 alone writes, as DDP's tutorial does; the others wait for it at the next
            # collective. A slow step of a healthy job, in rank 0's time outside the phases.
            saved.append((step + 1, _save(checkpoints / "latest.pt", {
                "step": step + 1, "model": model.state_dict(), "optimizer": opt.state_dict()})))
        synchronize(device)  # once per step: no other wait a slow setting could hide behind
        t_end = time.perf_counter()
        counter.end_step()
        rec["host_syncs"].append(syncs)
        tdist.all_reduce(total)  # the mean loss over ranks (reporting, not counted)
        rec["losses"].append(float(total) / n)
        rec["grad_norm"].append(float(grad_norm))
        rec["memory_mb"].append(torch.cuda.max_memory_allocated(device) / 2**20 if on_gpu else _rss_mb())
        rec["allreduce_calls"].append(calls)
        rec["allreduce_bytes"].append(sent)
        if step < timed:
            for key, v in (("step_s", t_end - t_start), ("data_s", t_data - t_start),
                           ("forward_s", sum(clock.seconds(a, b) for a, b, _ in spans)),
                           ("backward_s", sum(clock.seconds(b, e) for _, b, e in spans)),
                           ("optimizer_s", clock.seconds(c, end))):  # fmt: skip
                rec[key].append(v)
        ctx.heartbeat(step=step + 1, total=total_steps)

    for step in range(timed):
        one_step(step)
    trace = None
    if cfg["profile_steps"]:
        root = Path(ctx.job_dir or Path.cwd()) / "traces"
        root.mkdir(parents=True, exist_ok=True)
        trace = root / f"rank{rank}.json"

        def export(prof: profile) -> None:
            tmp = trace.with_suffix(".part")  # a reader never sees a half-written trace
            prof.export_chrome_trace(str(tmp))
            tmp.replace(trace)

        with profile(activities=activities(device), record_shapes=on_gpu, on_trace_ready=export,
                     schedule=schedule(wait=0, warmup=0, active=cfg["profile_steps"], repeat=1)) as prof:  # fmt: skip
            for step in range(timed, total_steps):
                one_step(step)
                prof.step()
    if not cfg["eval_every_steps"]:
        rec["val_losses"].append((total_steps, evaluate()))

    t0 = time.perf_counter()
    sample = [dataset[i] for i in range(min(8, len(dataset)))]
    item_ms = (time.perf_counter() - t0) / len(sample) * 1e3
    with torch.no_grad():
        checksum = float(sum(p.double().sum() for p in model.parameters()))
    with contextlib.suppress(Exception):
        tdist.barrier()  # every rank's trace written before rank 0 reports
    steady = rec["step_s"][1:] or rec["step_s"]
    params = sum(p.numel() for p in model.parameters())
    group = opt.param_groups[0]
    return {
        "rank": rank, "world_size": n, "device": str(device), "backend": ctx.backend, **rec,
        "tokens_per_s": cfg["global_batch"] * seq_len / statistics.median(steady),
        "micro_batch": micro, "grad_accum": k, "global_batch": cfg["global_batch"],
        "threads": torch.get_num_threads(), "cores": cores,
        "env": {key: v for key, v in os.environ.items()
                if key in ENV_SHOWN or key.startswith("NCCL_")},
        "runtime": {"grad_enabled": torch.is_grad_enabled(),
                    "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                    "float32_matmul_precision": torch.get_float32_matmul_precision(),
                    "torch": torch.__version__},
        "loader": {"dataset": type(dataset).__name__, "items": len(dataset),
                   "item_ms": item_ms, "prepare_s": prepare_s, "batch_size": share,
                   "sampler": type(inner).__name__, "num_workers": loader.num_workers,
                   "pin_memory": loader.pin_memory, "drop_last": loader.drop_last},
        "optimizer": {"class": type(opt).__name__, "lr": group["lr"], "betas": group["betas"],
                      "weight_decay": group["weight_decay"]},
        "model": {**dataclasses.asdict(gpt), "parameters": params,
                  "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                  "tensors": len(list(model.parameters()))},
        "checkpoint": {"every_steps": cfg["checkpoint_every"], "writer": "rank 0",
                       "after_steps": [s for s, _ in saved],
                       "bytes": saved[-1][1] if saved else 0},
        "indices": epochs, "checksum": checksum, "dtype": dtype,
        "trace": str(trace) if trace is not None else None,
        "steps_timed": timed,
    }  # fmt: skip


def run(config: CapstoneConfig, *, nproc: int = 2, **launch_options: Any) -> launch.JobResult:
    """Launch ``config`` on ``nproc`` ranks (refused first if they cannot split its batch);
    ``launch_options`` go to ``launch.run``."""
    from labkit.jobs import launch  # the caller's side: a rank never imports the launcher
    config.split(nproc)
    return launch.run(config, nproc=nproc, **launch_options)


if __name__ == "__main__":
    main()
