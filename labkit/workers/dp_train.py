"""Train the lab GPT with data-parallel strategies, one after another, in one job.

    from labkit.workers import dp_train
    res = dp_train.run(dp_train.DPTrainConfig(strategies=("naive", "bucketed", "ddp", "zero1",
                                                          "fsdp2"), mesh=[2], global_batch=8),
                       nproc=2)
    res.result["runs"]["zero1"]["bytes"]["sent_per_rank_last_step"]

Starting a job costs seconds, so one job runs every strategy asked for, in order, in the
same process group. Each one starts from the same seed (same weights, same batches), so
their results compare directly with each other and with :func:`train_reference`, plain
training in one process on the whole global batch. Config: :class:`DPTrainConfig`, whose fields
``labkit.parallel.dp_config.DPSettings`` documents and checks (``run`` takes them as a dict
too); resolved for the launch it is a ``DPJob``, which every function here reads.

Per strategy, each rank reports: the loss per step (mean over ranks), step times, the bytes
sent (counted; see labkit.parallel.comm) beside the ring-formula prediction, and the bytes
of parameters, gradients and optimizer state it holds (measured on local shards) beside
``formulas.zero_memory_per_rank``. On gloo it also reads the loopback interface's byte
counters around every step (``wire``: the bytes really carried, see :func:`wire_window`). With ``save_params`` the final parameters go to
``<job dir>/params_rank{r}.pt`` as {strategy: {name: tensor}}.

Data: step s uses the s-th global batch of ``global_batches(job)`` (G sequences); rank r
takes rows [r·A·b, (r+1)·A·b) as A micro-batches of b rows (A = grad_accum, b = micro_batch).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as tdist
from torch import nn

from labkit import formulas, validate
from labkit.jobs import runtime
from labkit.memory import storage_bytes
from labkit.metrics import net
from labkit.model import GPT
from labkit.parallel import comm
from labkit.parallel.dp_config import AUTO as AUTO  # the worker's names, as every worker has
from labkit.parallel.dp_config import DEFAULT_MODEL as DEFAULT_MODEL
from labkit.parallel.dp_config import (
    ZERO_STAGE,
    DPJob,
    DPSettings,
    Strategy,
    optimizer_factory,
)
from labkit.train import Batch, make_scaler, train_step

if TYPE_CHECKING:
    from labkit.jobs import launch

MODULE = "labkit.workers.dp_train"
# What gloo cannot do on GPU tensors that this worker does (runtime.require_gpu_backend).
NEEDS = "ZeRO-1 and FSDP2 reduce-scatter gradients"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPTrainConfig(DPSettings):
    """Data-parallel strategies run one after another in one job. Every field, its default and
    its check is :class:`~labkit.parallel.dp_config.DPSettings`'s (checked when built);
    ``config.resolve(world_size, gpu_count, device=...)`` gives the complete
    :class:`~labkit.parallel.dp_config.DPJob` the ranks run."""

    WORKER: ClassVar[str] = MODULE


# --- pieces shared by the worker and the single-process reference -----------------------------


def build_model(job: DPJob, device: torch.device | str = "cpu") -> GPT:
    """The GPT of ``job.model``, seeded with ``job.train.seed``, with ``job.freeze`` frozen."""
    torch.manual_seed(job.train.seed)
    model = GPT(job.model).to(device)
    params = dict(model.named_parameters())
    for name in job.freeze:
        params[name].requires_grad_(False)
    return model


@functools.lru_cache(maxsize=4)
def _train_split() -> torch.Tensor:
    from labkit.data import load_splits

    return load_splits().train


def global_batches(job: DPJob) -> list[Batch]:
    """One (x, y) pair of int64 (G, T) per step: G = global_batch, T = seq_len."""
    from labkit.data import get_batch

    g = torch.Generator().manual_seed(job.train.seed)
    G, T = job.global_batch, job.model.seq_len
    return [get_batch(_train_split(), G, T, g) for _ in range(job.train.steps)]


def rank_micro_batches(batch: Batch, rank: int, job: DPJob) -> list[Batch]:
    """Rank ``rank``'s micro-batches of one global batch: A slices of b rows each."""
    x, y = batch
    b, accum = job.train.micro_batch, job.train.grad_accum
    start = rank * accum * b
    return [
        (x[start + i * b : start + (i + 1) * b], y[start + i * b : start + (i + 1) * b])
        for i in range(accum)
    ]


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole (sharded ones gathered: a collective for DTensors), on CPU."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().cpu().clone()
    return out


def train_reference(
    job: DPJob | Mapping[str, Any], *, grad_scale: float = 1.0
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Single-process training on each whole global batch: the parity reference.

    ``job``: the resolved job (``DPTrainConfig.resolve``), or the ``config`` a rank reported
    (its ``to_dict``). ``grad_scale`` multiplies every gradient (2.0 imitates a 2-rank job that
    sums gradients instead of averaging them, the bug of pytorch #162338): tests use it to show
    their tolerance can tell the two apart. Returns (final parameters by name, loss per step).
    """
    job = job if isinstance(job, DPJob) else DPJob.from_dict(job)
    model = build_model(job)
    train = job.train
    if grad_scale != 1.0:
        for p in model.parameters():
            if p.requires_grad:
                p.register_hook(lambda g: g * grad_scale)
    opt = optimizer_factory(job.optimizer, train)(model)
    losses = []
    for batch in global_batches(job):
        stats = train_step(
            model,
            opt,
            [batch],
            device=torch.device("cpu"),
            dtype=train.dtype,
            grad_clip=train.grad_clip,
        )
        losses.append(stats.loss)
    return full_params(model), losses


# --- strategies --------------------------------------------------------------------------------


def device_mesh(job: DPJob, device_type: str) -> tuple[Any, str | None]:
    """(the job's DeviceMesh, the name of its data-parallel dimension), or (None, None)
    without a mesh. ``job.mesh`` is [n] (unnamed) or {name: n} (``DPSettings.mesh``)."""
    from torch.distributed.device_mesh import init_device_mesh

    spec = job.mesh
    if spec is None:
        return None, None
    if isinstance(spec, dict):
        from labkit.parallel import mesh

        return mesh.build(spec, device_type), next(iter(spec))
    return init_device_mesh(device_type, tuple(spec)), None


def make_strategy(
    name: str, job: DPJob, rank: int, world_size: int, device_type: str = "cpu"
) -> Strategy:
    """The strategy called ``name``, configured from ``job``. With a named mesh every
    strategy but ZeRO-1 takes its process group from the named dimension."""
    backend = job.backend
    named = isinstance(job.mesh, dict)  # [n] as before: only FSDP2 builds a mesh
    dm, dim = device_mesh(job, device_type) if named or name == "fsdp2" else (None, None)
    group = dm.get_group(dim) if dim is not None else None
    if name in ("naive", "bucketed"):
        from labkit.parallel.dp_bucketed import BucketedDP
        from labkit.parallel.dp_naive import NaiveDP

        if name == "naive":
            return NaiveDP(world_size, backend, group=group)
        cap = job.bucket_cap_mb
        return BucketedDP(
            world_size, backend, bucket_cap_mb=25.0 if cap is None else cap, group=group
        )
    if name.startswith("ddp"):
        from labkit.parallel.ddp import TorchDDP

        return TorchDDP(
            world_size,
            backend,
            compression=name.partition("_")[2] or None,
            bucket_cap_mb=job.bucket_cap_mb,
            powersgd_rank=job.powersgd_rank,
            powersgd_start_iter=job.powersgd_start_iter,
            gradient_as_bucket_view=job.gradient_as_bucket_view,
            group=group,
        )
    if name == "zero1":
        from labkit.parallel.zero1 import ZeRO1

        return ZeRO1(world_size, backend, rank=rank)
    if name == "fsdp2":
        from labkit.parallel.fsdp import FSDP2

        return FSDP2(
            world_size,
            backend,
            mesh=dm,
            mesh_dim=dim,
            mixed_precision=job.fsdp_mixed_precision,
            reshard_after_forward=job.fsdp_reshard_after_forward,
        )
    raise ValueError(f"strategy={name!r}: unknown")


def predicted_sent_per_rank(
    name: str,
    model: nn.Module,
    n: int,
    grad_accum: int = 1,
    *,
    fsdp_param_bytes: int = 4,
    fsdp_reshard_after_forward: bool = True,
) -> float | None:
    """Modelled bytes sent per rank per step (ring formulas, fp32 gradients, no padding).

    Not in :mod:`labkit.formulas` (whose ring formulas it uses): it needs the model, to count
    its trainable, frozen and per-block parameters.

    Gradients are reduced once per step whatever ``grad_accum`` (no_sync), but FSDP2 must
    all-gather the parameters for every micro-batch's forward, and with
    ``fsdp_reshard_after_forward`` again for its backward. ``fsdp_param_bytes``: bytes per
    all-gathered parameter (2 under the bf16 MixedPrecisionPolicy; reduction stays fp32).
    None for PowerSGD, whose volume depends on the matrix shapes and rank (see its count).
    """
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if name in ("naive", "bucketed", "ddp"):
        return formulas.ring_allreduce_bytes_per_rank(4 * trainable, n)
    if name in ("ddp_fp16", "ddp_bf16"):
        return formulas.ring_allreduce_bytes_per_rank(2 * trainable, n)
    if name == "zero1":  # reduce-scatter the gradients, all-gather the parameters
        return formulas.reduce_scatter_bytes_per_rank(
            4 * trainable, n
        ) + formulas.allgather_bytes_per_rank(4 * trainable, n)
    if name == "fsdp2":
        # forward: all-gather every unit; backward: all-gather every block again (the root
        # stays unsharded after forward); reduce-scatter the trainable gradients.
        every = sum(p.numel() for p in model.parameters())
        blocks = sum(p.numel() for b in model.blocks for p in b.parameters())
        gathered = every + (blocks if fsdp_reshard_after_forward else 0)
        return grad_accum * formulas.allgather_bytes_per_rank(
            fsdp_param_bytes * gathered, n
        ) + formulas.reduce_scatter_bytes_per_rank(4 * trainable, n)
    return None


def predicted_memory(
    name: str, model: nn.Module, n: int, optimizer: str = "adamw"
) -> dict[str, float]:
    """ZeRO's model-state bytes per rank, fp32: 4 + 4 + k bytes per trainable parameter.

    ``formulas.zero_memory_per_rank`` with param_bytes=4, grad_bytes=4 and k=8 for AdamW
    (m and v in fp32), k=4 for SGD with momentum, k=0 for plain SGD; frozen parameters add 4
    bytes each (sharded only by FSDP2). Modelled, not measured. Not in :mod:`labkit.formulas`
    (whose ``zero_memory_per_rank`` it uses): it needs the model, to count its parameters.
    """
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    stage = ZERO_STAGE.get(name, 0)
    k = {"adamw": 8, "sgd_momentum": 4}.get(optimizer, 0)  # fp32 moments / momentum buffer
    total = formulas.zero_memory_per_rank(trainable, stage, n, k=k, param_bytes=4, grad_bytes=4)
    return {
        "zero_stage": stage,
        "k": k,
        "model_states": total + 4 * frozen / (n if stage == 3 else 1),
    }


def unsharded_grad_bytes(model: nn.Module) -> int:
    """Bytes of the full-size gradients FSDP2 keeps on its units' unsharded parameters.

    Under ``set_requires_gradient_sync(False)`` (our ``no_sync``) FSDP2 skips the
    reduce-scatter, so each unit's gradient stays whole, on the unsharded parameter (or in
    ``unsharded_accumulated_grad`` when it reduces in another dtype), until a synchronised
    backward reduce-scatters it. No public API lists them: this reads FSDP2's private
    ``FSDPParam`` fields (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, torch 2.13) and
    finds nothing in a model that is not FSDP2's.
    """
    grads = []
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        group = getattr(get_state(), "_fsdp_param_group", None) if callable(get_state) else None
        for fsdp_param in getattr(group, "fsdp_params", ()):
            grad = getattr(fsdp_param, "unsharded_accumulated_grad", None)
            if grad is None:
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                grad = getattr(unsharded, "grad", None)
            if grad is not None:
                grads.append(grad)
    return storage_bytes(grads)


def unsharded_param_bytes(model: nn.Module) -> int:
    """Bytes of FSDP2's gathered (unsharded) parameters still allocated: a resharded unit
    frees them by resizing their storage to 0 (FSDP2's private ``FSDPParam``, as above)."""
    held = []
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        group = getattr(get_state(), "_fsdp_param_group", None) if callable(get_state) else None
        for fsdp_param in getattr(group, "fsdp_params", ()):
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None and unsharded.untyped_storage().nbytes() > 0:
                held.append(unsharded)
    return storage_bytes(held)


def reshard_probe(
    job: DPJob, ctx: runtime.Context, batch: Batch
) -> dict[str, dict[str, float]] | None:
    """FSDP2 with ``reshard_after_forward`` True (ZeRO-3) and False (ZeRO-2-like), one
    micro-batch each on a fresh model: the gathered weights still held between forward and
    backward, and the bytes sent per rank for that micro-batch. None when this labkit's FSDP2
    has no such option."""
    from labkit.parallel.fsdp import FSDP2

    mesh, _ = device_mesh(job, ctx.device.type)
    x, y = (t.to(ctx.device) for t in batch)
    out = {}
    for reshard in (True, False):
        try:
            strategy = FSDP2(ctx.world_size, job.backend, mesh=mesh, reshard_after_forward=reshard)
        except TypeError:
            return None
        model = strategy.wrap(build_model(job, ctx.device))
        with comm.spying(strategy.bytes_counter):
            _, loss = model(x, y)
            held = unsharded_param_bytes(model)
            loss.backward()
        strategy.bytes_counter.end_step()
        out[f"reshard_after_forward={reshard}"] = {
            "held_after_forward": held,
            "sent_per_rank": strategy.bytes_counter.summary()["sent_per_rank_last_step"],
        }
    return out


def measure_memory(
    strategy: Strategy, model: nn.Module, opt: Any, batch: Batch, device: torch.device
) -> dict[str, int | None]:
    """One extra real step, measured: gradients between two accumulated micro-batches (under
    the strategy's ``no_sync``; None without one), after the synchronised backward, and the
    optimizer state after the step."""
    x, y = (t.to(device) for t in batch)
    accumulating = None
    if strategy.no_sync is not None:
        with strategy.no_sync():
            _, loss = model(x, y)
            loss.backward()  # gradients stay local (FSDP2: whole, not sharded)
        during = strategy.memory(model, opt)
        # DDP: the buckets are a second copy once .grad is no longer a view of them
        accumulating = (during["gradients"] + during.get("gradient_buckets", 0)
                        + unsharded_grad_bytes(model))  # fmt: skip
    _, loss = model(x, y)
    loss.backward()  # gradients synchronised (or reduce-scattered) by now
    grads = strategy.memory(model, opt)["gradients"]
    opt.step()
    mem = strategy.memory(model, opt)
    opt.zero_grad(set_to_none=True)
    return {**mem, "gradients": grads, "gradients_accumulating": accumulating}


def wire_window(interface: str | None) -> int | None:
    """Bytes ``interface`` carried between two barriers: call once to open (returns None) and
    once to close, or pass None to measure nothing.

    gloo ranks on one host talk TCP through loopback, and ``lo`` counts every packet once, so
    a window's delta is the traffic of *all* ranks, headers and ACKs included, plus whatever
    else used ``lo`` meanwhile (``labkit.metrics.net``). The barriers make every rank finish
    the step inside the window; a window with nothing in it measures the barriers themselves.
    """
    if interface is None:
        return None
    tdist.barrier()
    return net.interface_bytes(interface).sent


# --- the worker ----------------------------------------------------------------------------


def _one_strategy(
    ctx: runtime.Context, job: DPJob, name: str, batches: list[Batch], done: int = 0
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Train with strategy ``name`` on ``batches``. ``done``: steps of the job so far (the
    strategies before this one), so the heartbeat counts steps over the whole job."""
    n, device = ctx.world_size, ctx.device
    train = job.train
    strategy = make_strategy(name, job, ctx.rank, n, device.type)
    base = build_model(job, device)  # same seed on every rank: identical replicas
    model = strategy.wrap(base)
    opt = strategy.optimizer(model, optimizer_factory(job.optimizer, train))
    scaler = make_scaler(device, train.dtype)
    # FSDP2 has no hook to wrap: its collectives are counted by interception (CollectiveSpy).
    # The others are counted by our wrappers and hooks and, with job.spy, a second time by
    # interception, as a check. The spy slows every operator: FSDP2's step times include it.
    if name == "fsdp2":
        spy = strategy.bytes_counter
    elif job.spy:
        spy = comm.ByteCounter(n, ctx.backend, "intercepted c10d collectives")
    else:
        spy = None
    check = spy if spy is not strategy.bytes_counter else None
    # gloo between processes of one host goes through loopback: count it around every step.
    iface = "lo" if ctx.backend == "gloo" and net.unavailable("lo") is None else None
    losses, seconds, wire, idle = [], [], [], []
    consumed = []  # sequences this rank's forward passes took, per step (counted, not configured)
    for step, batch in enumerate(batches):
        micro = rank_micro_batches(batch, ctx.rank, job)
        consumed.append(sum(int(x.shape[0]) for x, _ in micro))
        opened = wire_window(iface)
        with ctx.phase(f"{name} step"), comm.spying(spy):
            stats = train_step(
                model,
                opt,
                micro,
                device=device,
                dtype=train.dtype,
                scaler=scaler,
                grad_clip=train.grad_clip,
                no_sync=strategy.no_sync,
            )
        if iface is not None:
            wire.append(wire_window(iface) - opened)
            opened = wire_window(iface)
            idle.append(wire_window(iface) - opened)  # the same barriers, no step between
        strategy.bytes_counter.end_step()
        if check is not None:
            check.end_step()
        loss = torch.tensor([stats.loss], device=device)
        tdist.all_reduce(loss)  # (not counted: reporting, not training)
        losses.append(loss.item() / n)
        seconds.append(stats.seconds)
        ctx.heartbeat(step=done + step + 1)
    per_step = torch.tensor(consumed, dtype=torch.int64, device=device)
    tdist.all_reduce(per_step)  # every rank's count summed (not counted: reporting)
    params = full_params(base)
    memory = measure_memory(
        strategy, model, opt, rank_micro_batches(batches[0], ctx.rank, job)[0], device
    )
    tokens = job.global_batch * job.model.seq_len
    result = {
        "loss": losses,
        "step_s": seconds,
        "sequences_per_rank_step": consumed,
        "sequences_per_step": per_step.tolist(),  # summed over the ranks: the global batch
        "timed_with_spy": spy is not None,
        "tokens_per_s": tokens * len(seconds[1:]) / sum(seconds[1:]) if len(seconds) > 1 else None,
        "bytes": strategy.bytes_counter.summary(),
        "bytes_predicted_sent_per_rank": predicted_sent_per_rank(
            name,
            base,
            n,
            train.grad_accum,
            fsdp_param_bytes=2 if job.fsdp_mixed_precision == "bf16" else 4,
            fsdp_reshard_after_forward=job.fsdp_reshard_after_forward,
        ),
        "memory": {**memory, "method": "storage bytes of local tensors after a real step"},
        "memory_predicted": predicted_memory(name, base, n, job.optimizer),
        "wire": None
        if iface is None
        else {
            "interface": iface,
            "bytes_per_step": wire,  # all ranks together, headers and ACKs included
            "baseline_per_step": idle,
            "method": "tx_bytes of lo between barriers around each step, all ranks together",
        },
    }
    if check is not None:
        result["bytes_spy"] = check.summary()
    if name == "fsdp2":
        result["reshard_probe"] = reshard_probe(
            job, ctx, rank_micro_batches(batches[0], ctx.rank, job)[0]
        )
    return result, params


@runtime.entrypoint
def main(ctx: runtime.Context) -> dict[str, Any]:
    runtime.require_gpu_backend(ctx.backend, ctx.device.type, NEEDS)  # launched without run()
    job = DPTrainConfig.from_dict(ctx.config).resolve(
        ctx.world_size, torch.cuda.device_count(), device=ctx.device.type
    )
    batches = global_batches(job)
    probe = build_model(job)
    runs: dict[str, Any] = {}
    saved: dict[str, dict[str, torch.Tensor]] = {}
    for i, name in enumerate(job.strategies):
        ctx.print0(f"--- {name}")
        # Steps count over the whole job: "step 12/12" must not show while 7 strategies wait.
        part = f"{name} ({i + 1}/{len(job.strategies)})"
        ctx.heartbeat(total=len(job.strategies) * len(batches), part=part)
        runs[name], saved[name] = _one_strategy(ctx, job, name, batches, done=i * len(batches))
        ctx.print0(
            f"{name}: loss {runs[name]['loss'][0]:.4f} -> {runs[name]['loss'][-1]:.4f}, "
            f"{runs[name]['bytes']['sent_per_rank_last_step'] / 1e3:.1f} kB sent/rank "
            "in the last step"
        )
    params_file = None
    if job.save_params and ctx.job_dir is not None:
        params_file = ctx.job_dir / f"params_rank{ctx.rank}.pt"
        torch.save(saved, params_file)
    return {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "device": str(ctx.device),
        "torch": torch.__version__,
        "n_params": sum(p.numel() for p in probe.parameters()),
        "n_trainable": sum(p.numel() for p in probe.parameters() if p.requires_grad),
        "global_batch": job.global_batch,
        "config": job.to_dict(),  # DPJob.from_dict reads it back (train_reference does)
        "runs": runs,
        "params_file": None if params_file is None else str(params_file),
    }


def run(
    config: DPTrainConfig,
    *,
    nproc: int = 2,
    device: str = "auto",
    backend: str = "auto",
    **launch_kwargs: Any,
) -> launch.JobResult:
    """Check ``config`` against ``nproc`` ranks and the backend (ValueError before anything
    starts), then launch."""
    from labkit.jobs import launch  # the caller's side: a rank never imports the launcher
    if not isinstance(config, DPTrainConfig):
        raise validate.refuse("config", config, "a DPTrainConfig (DPTrainConfig(**fields) "
                              "builds one from a dict of its fields)")  # fmt: skip
    job = config
    gpu_count = launch.visible_gpu_count()
    be, dev = launch.resolve_backend(nproc, device, backend, gpu_count=gpu_count)
    runtime.require_gpu_backend(be, dev, NEEDS)
    job.resolve(nproc, gpu_count, device=dev)
    return launch.run(job, nproc=nproc, device=dev, backend=be, **launch_kwargs)


if __name__ == "__main__":
    main()
