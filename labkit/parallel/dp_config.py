"""What every data-parallel strategy offers, and the checks a config passes before launch.

The interface is small on purpose (torchtitan and picotron keep the model ignorant of
parallelism and add it from outside):

    strategy = NaiveDP(world_size)              # or BucketedDP, TorchDDP, ZeRO1, FSDP2
    strategy = NaiveDP(2, group=mesh["dp"].get_group())   # or over one dimension of a mesh
    model = strategy.wrap(model)                # hooks, wrapper or sharding
    opt = strategy.optimizer(model, make_opt)   # make_opt(model) -> AdamW; ZeRO-1 shards it
    labkit.train.train_step(model, opt, micro_batches, device=..., no_sync=strategy.no_sync)
    strategy.bytes_counter.end_step()           # what this step sent, by collective

Gradients are synchronised by the time ``loss.backward()`` returns, as with torch's DDP (its
reducer finishes in a callback queued on the autograd engine): so the one ``train_step``
every lab uses works unchanged, and ``after_backward`` is where each strategy's own
synchronisation lives. ZeRO-1 communicates in its optimizer's ``step`` instead.

``validate_dp_config`` turns a job's config dict into a complete one or raises ValueError
naming the field, before any process starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from labkit.config import ModelConfig, RunConfig, TrainConfig
from labkit.memory import optimizer_state_tensors, storage_bytes
from labkit.parallel.comm import ByteCounter
from labkit.train import make_optimizer

STRATEGIES = (
    "naive",
    "bucketed",
    "ddp",
    "ddp_fp16",
    "ddp_bf16",
    "ddp_powersgd",
    "zero1",
    "fsdp2",
)
SHARDED = ("zero1", "fsdp2")
OPTIMIZERS = ("adamw", "sgd", "sgd_momentum")
SGD_MOMENTUM = 0.9  # "sgd_momentum": the momentum of PowerSGD's experiments (Vogels et al. 2019)
MakeOptimizer = Callable[[nn.Module], torch.optim.Optimizer]
# ZeRO stage each strategy corresponds to, for formulas.zero_memory_per_rank.
ZERO_STAGE = {"zero1": 1, "fsdp2": 3}


class Strategy:
    """Base class: plain single-copy training, nothing communicated.

    Attributes:
        name: the strategy's name in configs and results.
        world_size: the ranks gradients are averaged over (the size of ``group``).
        group: the process group it communicates in: None for every rank (the default), or
            one dimension of a device mesh (``mesh["dp"].get_group()``: see
            ``labkit.parallel.mesh``), so data parallelism composes with another dimension.
        bytes_counter: a :class:`~labkit.parallel.comm.ByteCounter` of what it sends.
        counting: how bytes are counted, shown in results.
    """

    name = "none"
    counting = "nothing is sent"

    def __init__(self, world_size: int, backend: str = "gloo", *, group: Any = None) -> None:
        self.world_size = world_size
        self.group = group
        self.bytes_counter = ByteCounter(world_size, backend, method=self.counting)

    @property
    def src(self) -> int:
        """The global rank whose weights every rank of ``group`` starts from: its first."""
        if self.group is None:
            return 0
        import torch.distributed as tdist

        return tdist.get_global_rank(self.group, 0)

    def wrap(self, model: nn.Module) -> nn.Module:
        """Prepare ``model`` for this strategy; returns the module to train."""
        return model

    def optimizer(self, model: nn.Module, make: MakeOptimizer) -> torch.optim.Optimizer:
        """The optimizer to step; ``make(model)`` builds the unsharded one (see
        ``optimizer_factory``), and a sharding strategy mirrors its groups on shards."""
        return make(model)

    def after_backward(self) -> None:
        """Finish gradient synchronisation (runs at the end of backward; idempotent)."""

    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None
    """A context manager factory that skips synchronisation (gradient accumulation), or None
    when gradients are never synchronised during backward anyway."""

    def memory(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state (local shards).

        Measured by storage (``labkit.memory.storage_bytes``): views of one buffer count
        once, and a sharded tensor counts only the shard this rank stores.
        """
        params = list(model.parameters())
        return {
            "parameters": storage_bytes(local(p) for p in params),
            "gradients": storage_bytes(local(p.grad) for p in params if p.grad is not None),
            "optimizer_state": storage_bytes(local(t) for t in optimizer_state_tensors(optimizer)),
        }


def optimizer_factory(name: str, cfg: TrainConfig) -> MakeOptimizer:
    """``make(model)`` for optimizer ``name``: "adamw" is ``labkit.train.make_optimizer``;
    "sgd" is plain SGD (no momentum, no decay), whose update is proportional to the gradient,
    so a parity test with it catches a gradient summed instead of averaged. AdamW would hide
    that: its update g/sqrt(v) is nearly invariant to the gradient's scale. "sgd_momentum"
    is SGD with momentum ``SGD_MOMENTUM`` (no decay), the optimizer PowerSGD was designed and
    measured with (Vogels et al., NeurIPS 2019, https://arxiv.org/abs/1905.13727): its update
    is linear in the gradients, which error feedback relies on."""
    if name == "adamw":
        return lambda model: make_optimizer(model, cfg)
    if name == "sgd":
        return lambda model: torch.optim.SGD(
            [p for p in model.parameters() if p.requires_grad], lr=cfg.lr
        )
    if name == "sgd_momentum":
        return lambda model: torch.optim.SGD(
            [p for p in model.parameters() if p.requires_grad], lr=cfg.lr, momentum=SGD_MOMENTUM
        )
    raise ValueError(f"optimizer={name!r}: use one of {OPTIMIZERS}")


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` stored on this rank: a DTensor's local shard, else ``t`` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


# --- config checks (no process started) --------------------------------------------------------


def _fail(field: str, value: Any, allowed: str) -> None:
    raise ValueError(f"{field}={value!r} is not allowed: {allowed}")


def validate_dp_config(
    cfg: dict[str, Any], world_size: int, gpu_count: int, *, device: str = "cpu"
) -> dict[str, Any]:
    """Check a data-parallel job config and return it complete, or raise ValueError.

    Config keys (all optional but ``strategies``):
        strategies   names from STRATEGIES, run one after the other in the same job
        model        ModelConfig fields (default: a 2-layer, 64-wide GPT)
        train        TrainConfig fields; ``grad_clip`` defaults to None here
        global_batch sequences per optimizer step over all ranks; sets micro_batch to
                     global_batch / (world_size x grad_accum), which must be a whole number
        optimizer    "adamw" (default, labkit.train.make_optimizer), "sgd" (parity tests) or
                     "sgd_momentum" (momentum 0.9: PowerSGD's setting)
        freeze       parameter names to freeze (requires_grad False), e.g. ["wpe.weight"]
        bucket_cap_mb  bucket size in MiB for "bucketed" and DDP; None (default): DDP's own
                     default, 25 MiB with a 1 MiB first bucket (a number caps every bucket,
                     the first included: labkit.parallel.ddp), and 25 for "bucketed"
        gradient_as_bucket_view  DDP's .grad as views into its buckets (default True:
                     4 bytes of gradient memory per parameter, not 8)
        powersgd_rank  PowerSGD matrix rank (default 2); powersgd_start_iter (default 2)
        mesh         the device mesh the strategies communicate over: [world_size] (1-D,
                     unnamed), or one named dimension {"dp": world_size}, whose process
                     group every strategy then takes (labkit.parallel.mesh). Required for
                     "fsdp2". A 2-D mesh composes data parallelism with another dimension:
                     labkit.parallel.compose (FSDP2 x TP, HSDP), run by
                     labkit.workers.mesh_train
        fsdp_mixed_precision  None or "bf16": FSDP2's MixedPrecisionPolicy with bf16
                     parameters and fp32 gradient reduction (labkit.parallel.fsdp). Default:
                     "bf16" when train.dtype is "bfloat16" (the gpu preset), else None
        fsdp_reshard_after_forward  True (default: ZeRO-3, every block gathered again in
                     backward) or False (blocks stay unsharded from forward to backward)
        spy          also count every collective with CollectiveSpy (slower; for checks)
        save_params  save each strategy's final parameters in the job directory

    Args:
        world_size: ranks the job will start.
        gpu_count: CUDA GPUs visible to the launcher.
        device: "cpu" (gloo) or "cuda" (one GPU per rank, NCCL).
    """
    if device not in ("cpu", "cuda"):
        _fail("device", device, "'cpu' (gloo) or 'cuda' (NCCL)")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        _fail("world_size", world_size, "a positive integer (ranks to start)")
    if device == "cuda" and world_size > gpu_count:
        raise ValueError(
            f"world_size={world_size} is larger than the {gpu_count} visible GPU(s): data "
            f"parallelism on device='cuda' needs one GPU per rank; use world_size<={gpu_count} "
            "or device='cpu' (gloo)"
        )
    if not isinstance(cfg, dict):
        raise ValueError(f"config must be a dict, got {type(cfg).__name__}")
    known = {
        "strategies",
        "model",
        "train",
        "global_batch",
        "optimizer",
        "freeze",
        "bucket_cap_mb",
        "gradient_as_bucket_view",
        "powersgd_rank",
        "powersgd_start_iter",
        "mesh",
        "fsdp_mixed_precision",
        "fsdp_reshard_after_forward",
        "spy",
        "save_params",
    }
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}: allowed keys are {sorted(known)}")
    backend = "nccl" if device == "cuda" else "gloo"

    strategies = cfg.get("strategies")
    if not isinstance(strategies, list) or not strategies:
        _fail("strategies", strategies, f"a non-empty list of names from {STRATEGIES}")
    for s in strategies:
        if s not in STRATEGIES:
            _fail("strategies", s, f"each one of {STRATEGIES}")

    model = ModelConfig(
        **{"seq_len": 64, "n_layer": 2, "n_head": 2, "d_model": 64, **cfg.get("model", {})}
    )
    train_in = dict(cfg.get("train", {}))
    train_in.setdefault("grad_clip", None)
    accum = train_in.get("grad_accum", 1)
    if "global_batch" in cfg:
        gb = cfg["global_batch"]
        if isinstance(gb, bool) or not isinstance(gb, int) or gb < 1:
            _fail("global_batch", gb, "a positive integer (sequences per step, all ranks)")
        if not isinstance(accum, int) or accum < 1:
            _fail("grad_accum", accum, "a positive integer")
        if gb % (world_size * accum):
            raise ValueError(
                f"global_batch={gb} does not divide by world_size={world_size} x "
                f"grad_accum={accum} = {world_size * accum}: every rank must get the same "
                f"number of sequences per micro-batch; use a multiple of {world_size * accum}"
            )
        if "micro_batch" in train_in and train_in["micro_batch"] != gb // (world_size * accum):
            _fail(
                "train.micro_batch",
                train_in["micro_batch"],
                f"global_batch/(world_size x grad_accum) = {gb // (world_size * accum)} "
                "or left out",
            )
        train_in["micro_batch"] = gb // (world_size * accum)
    train = TrainConfig(**{"micro_batch": 4, "steps": 3, "lr": 1e-2, **train_in})
    RunConfig(model=model, train=train)  # what only the pair can check (the corpus's vocabulary)

    if train.grad_clip is not None and "zero1" in strategies:
        _fail(
            "train.grad_clip",
            train.grad_clip,
            "None with 'zero1': its gradients are reduced inside the optimizer step, after "
            "train_step would clip them, so the norm would be a local one",
        )
    if train.dtype == "float16" and any(s in SHARDED for s in strategies):
        _fail(
            "train.dtype",
            "float16",
            "float32 or bfloat16 with zero1/fsdp2 (a float16 "
            "loss scaler would need a sharding-aware GradScaler)",
        )
    if train.device not in ("auto", device):
        _fail("train.device", train.device, f"'auto' or {device!r}, the job's device")

    optimizer = cfg.get("optimizer", "adamw")
    if optimizer not in OPTIMIZERS:
        _fail("optimizer", optimizer, f"one of {OPTIMIZERS}")

    names = {n for n, _ in _param_names(model)}
    freeze = cfg.get("freeze", [])
    if not isinstance(freeze, list) or any(f not in names for f in freeze):
        _fail("freeze", freeze, f"a list of parameter names from {sorted(names)}")

    bucket_cap_mb = cfg.get("bucket_cap_mb")
    if bucket_cap_mb is not None and (
        isinstance(bucket_cap_mb, bool)
        or not isinstance(bucket_cap_mb, (int, float))
        or bucket_cap_mb <= 0
    ):
        _fail("bucket_cap_mb", bucket_cap_mb, "a positive number of MiB, or None for DDP's default")
    as_view = cfg.get("gradient_as_bucket_view", True)
    if not isinstance(as_view, bool):
        _fail("gradient_as_bucket_view", as_view, "True (.grad views into DDP's buckets) or False")
    for key, default, low in (("powersgd_rank", 2, 1), ("powersgd_start_iter", 2, 2)):
        v = cfg.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            # PowerSGD with error feedback needs start_powerSGD_iter >= 2 (its own assertion).
            _fail(key, v, f"an integer >= {low}")

    if "ddp_bf16" in strategies and backend == "nccl":
        nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else (0,)
        if tuple(nccl) < (2, 10):
            _fail("strategies", "ddp_bf16", "with NCCL >= 2.10 only (bf16 all-reduce)")

    mesh = cfg.get("mesh")
    if "fsdp2" in strategies and mesh is None:
        raise ValueError(
            "mesh=None with strategy 'fsdp2': FSDP2 shards over an explicit device mesh "
            f"(on CPU/gloo it cannot infer one: pytorch #132471); pass mesh=[{world_size}]"
        )
    if isinstance(mesh, list) and all(isinstance(m, int) and not isinstance(m, bool) for m in mesh):
        if mesh != [world_size]:
            _fail(
                "mesh",
                mesh,
                f"[{world_size}] (1-D over all ranks) or a named dimension such as "
                f"{{'dp': {world_size}}}: strategies take their process group from a named "
                "dimension, so a mesh of more than one dimension needs names",
            )
    elif mesh is not None:
        from labkit.parallel.mesh import validate_mesh

        spec = validate_mesh(mesh, world_size)
        if len(spec.dims) > 1:
            _fail(
                "mesh",
                mesh,
                f"one named dimension such as {{'dp': {world_size}}}: this job trains every "
                "rank data-parallel; a 2-D mesh composes data parallelism with another "
                "dimension (labkit.parallel.compose: FSDP2 x TP, HSDP; worker "
                "labkit.workers.mesh_train)",
            )
        mesh = spec.as_dict()

    fsdp_mp = cfg.get("fsdp_mixed_precision", "bf16" if train.dtype == "bfloat16" else None)
    if fsdp_mp not in (None, "bf16"):
        _fail(
            "fsdp_mixed_precision",
            fsdp_mp,
            "None (parameters' own dtype) or 'bf16' (bf16 parameters, fp32 reduction)",
        )
    reshard = cfg.get("fsdp_reshard_after_forward", True)
    if not isinstance(reshard, bool):
        _fail("fsdp_reshard_after_forward", reshard, "True (ZeRO-3) or False (ZeRO-2-like)")

    return {
        "strategies": list(strategies),
        "model": dataclasses.asdict(model),
        "train": dataclasses.asdict(train),
        "global_batch": train.micro_batch * train.grad_accum * world_size,
        "optimizer": optimizer,
        "freeze": list(freeze),
        "bucket_cap_mb": None if bucket_cap_mb is None else float(bucket_cap_mb),
        "gradient_as_bucket_view": as_view,
        "powersgd_rank": int(cfg.get("powersgd_rank", 2)),
        "powersgd_start_iter": int(cfg.get("powersgd_start_iter", 2)),
        "mesh": mesh,
        "fsdp_mixed_precision": fsdp_mp,
        "fsdp_reshard_after_forward": reshard,
        "spy": bool(cfg.get("spy", False)),
        "save_params": bool(cfg.get("save_params", False)),
        "device": device,
        "backend": backend,
    }


def _param_names(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of a GPT built from ``cfg``, without building it."""
    from labkit.model import GPT

    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        model = GPT(cfg)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]
