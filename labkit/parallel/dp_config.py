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

:class:`DPSettings` is what a data-parallel job trains and how (the fields of the worker's
``DPTrainConfig``), checked when built; ``settings.resolve(world_size)`` checks what the
launch decides and returns the complete :class:`DPJob`, before any process starts:

    job = DPSettings(strategies=("ddp", "zero1"), global_batch=8).resolve(2)
    job.train.micro_batch, job.backend          # 4, "gloo"
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from labkit.config import ModelConfig, RunConfig, TrainConfig
from labkit.jobs.spec import WorkerConfig
from labkit.memory import optimizer_state_tensors, storage_bytes
from labkit.parallel.comm import ByteCounter
from labkit.parallel.mesh import as_spec, validate_mesh
from labkit.train import make_optimizer
from labkit.validate import InvalidValue, flag, is_integer, one_of, positive, refuse, whole

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


# --- the job's settings, checked (no process started) -------------------------------------------

DEFAULT_MODEL: dict[str, Any] = {"seq_len": 64, "n_layer": 2, "n_head": 2, "d_model": 64}
"""A 2-layer, 64-wide GPT: small enough for two CPU ranks."""
DEFAULT_TRAIN: dict[str, Any] = {"micro_batch": 4, "steps": 3, "lr": 1e-2, "grad_clip": None}
"""The ``TrainConfig`` fields a data-parallel job sets unless ``train`` names them. No clipping
by default: ZeRO-1 reduces its gradients inside the optimizer step, after clipping would run."""
AUTO = "auto"
"""``fsdp_mixed_precision``'s default: "bf16" when train's dtype is bfloat16, else None."""
DEVICES = ("cpu", "cuda")
MESH_NEEDS_NAMES = ("strategies take their process group from a named dimension, so a mesh "
                    "of more than one dimension needs names")  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPSettings(WorkerConfig):
    """What a data-parallel job trains, and how: every check that holds on any number of ranks
    runs when it is built (ValueError naming the field); :meth:`resolve` adds the launch's
    (the ranks, the device) and returns the complete :class:`DPJob`.

    The body of ``labkit.workers.dp_train.DPTrainConfig``, which adds only its worker's name:
    this layer cannot import the worker, and the rules must live where the strategies do. Lists
    given for tuple fields become tuples and a dict given for ``model`` a ``ModelConfig``
    (``WorkerConfig``), so the same settings come back from JSON.
    """

    strategies: tuple[str, ...] = ()
    """Names from ``STRATEGIES``, run one after the other in the same job (at least one)."""
    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(**DEFAULT_MODEL))
    """The GPT (a dict of ``ModelConfig`` fields changes DEFAULT_MODEL's)."""
    train: dict[str, Any] = dataclasses.field(default_factory=dict)
    """``TrainConfig`` fields over DEFAULT_TRAIN (so ``grad_clip`` defaults to None here)."""
    global_batch: int | None = None
    """Sequences per optimizer step over all ranks; sets train's micro_batch to global_batch /
    (world_size x grad_accum), which must be a whole number (None: train's micro_batch on
    every rank)."""
    optimizer: str = "adamw"
    """"adamw" (labkit.train.make_optimizer), "sgd" (parity tests) or "sgd_momentum" (momentum
    0.9: PowerSGD's setting); see :func:`optimizer_factory`."""
    freeze: tuple[str, ...] = ()
    """Parameter names to freeze (requires_grad False), e.g. ("wpe.weight",)."""
    bucket_cap_mb: float | None = None
    """Bucket size in MiB for "bucketed" and DDP. None: DDP's own default, 25 MiB with a 1 MiB
    first bucket (a number caps every bucket, the first included: labkit.parallel.ddp), and 25
    for "bucketed"."""
    gradient_as_bucket_view: bool = True
    """DDP's .grad as views into its buckets: 4 bytes of gradient memory per parameter, not 8."""
    powersgd_rank: int = 2
    """PowerSGD's matrix rank."""
    powersgd_start_iter: int = 2
    """The step PowerSGD starts compressing at (>= 2: error feedback's own assertion)."""
    mesh: list[int] | dict[str, int] | None = None
    """The device mesh the strategies communicate over: [world_size] (1-D, unnamed), or one
    named dimension {"dp": world_size}, whose process group every strategy then takes
    (labkit.parallel.mesh). Required for "fsdp2". A 2-D mesh composes data parallelism with
    another dimension: labkit.parallel.compose (FSDP2 x TP, HSDP), worker mesh_train."""
    fsdp_mixed_precision: str | None = AUTO
    """None or "bf16": FSDP2's MixedPrecisionPolicy with bf16 parameters and fp32 gradient
    reduction (labkit.parallel.fsdp). AUTO: "bf16" when train's dtype is bfloat16 (the gpu
    preset), else None."""
    fsdp_reshard_after_forward: bool = True
    """True: ZeRO-3, every block gathered again in backward; False: blocks stay unsharded from
    forward to backward."""
    spy: bool = False
    """Also count every collective with CollectiveSpy (slower; a check)."""
    save_params: bool = False
    """Save each strategy's final parameters in the job directory."""

    def __post_init__(self) -> None:
        super().__post_init__()  # lists to tuples, a model dict to a ModelConfig
        if not isinstance(self.strategies, tuple) or not self.strategies:
            allowed = f"a non-empty list of names from {STRATEGIES}"
            raise refuse("strategies", self.strategies, allowed)
        for name in self.strategies:
            one_of("strategies", name, STRATEGIES)
        if not isinstance(self.model, ModelConfig):
            raise refuse("model", self.model, "a ModelConfig, or a dict of its fields")
        if not isinstance(self.train, dict):
            raise refuse("train", self.train, "a dict of TrainConfig fields")
        if self.global_batch is not None:
            whole("global_batch", self.global_batch, low=1, why="sequences per step, all ranks")
        train = self._train()
        RunConfig(model=self.model, train=train)  # what only the pair can check (the vocabulary)
        if train.grad_clip is not None and "zero1" in self.strategies:
            raise refuse("train.grad_clip", train.grad_clip,
                         "None with 'zero1': its gradients are reduced inside the optimizer "
                         "step, after train_step would clip them, so the norm would be a local "
                         "one")  # fmt: skip
        if train.dtype == "float16" and any(s in SHARDED for s in self.strategies):
            raise refuse("train.dtype", "float16", "float32 or bfloat16 with zero1/fsdp2 (a "
                         "float16 loss scaler would need a sharding-aware GradScaler)")  # fmt: skip
        one_of("optimizer", self.optimizer, OPTIMIZERS)
        names = [n for n, _ in _param_names(self.model)]
        if not isinstance(self.freeze, tuple):
            raise refuse("freeze", self.freeze, f"a list of parameter names from {names}")
        for name in self.freeze:
            one_of("freeze", name, names, why="parameter names to freeze")
        if self.bucket_cap_mb is not None:
            positive("bucket_cap_mb", self.bucket_cap_mb, why="MiB, or None for DDP's default")
        flag("gradient_as_bucket_view", self.gradient_as_bucket_view,
             why="True: .grad views into DDP's buckets")  # fmt: skip
        whole("powersgd_rank", self.powersgd_rank, low=1)
        # PowerSGD with error feedback needs start_powerSGD_iter >= 2 (its own assertion).
        whole("powersgd_start_iter", self.powersgd_start_iter, low=2)
        if self.mesh is not None:
            object.__setattr__(self, "mesh", self._mesh(None))  # frozen: one shape, once
        elif "fsdp2" in self.strategies:
            raise refuse("mesh", None, "a mesh with strategy 'fsdp2': FSDP2 shards over an "
                         "explicit device mesh (on CPU/gloo it cannot infer one: pytorch "
                         "#132471); pass mesh=[n] for n ranks, e.g. mesh=[2]")  # fmt: skip
        one_of("fsdp_mixed_precision", self.fsdp_mixed_precision, (AUTO, None, "bf16"),
               why="None: parameters' own dtype; 'bf16': bf16 parameters, fp32 reduction")  # fmt: skip
        flag("fsdp_reshard_after_forward", self.fsdp_reshard_after_forward,
             why="True: ZeRO-3; False: ZeRO-2-like")  # fmt: skip
        flag("spy", self.spy)
        flag("save_params", self.save_params)

    def _train(self, **resolved: Any) -> TrainConfig:
        """``train`` over DEFAULT_TRAIN, with what the launch resolved (the micro-batch)."""
        return TrainConfig(**{**DEFAULT_TRAIN, **self.train, **resolved})

    def _mesh(self, world_size: int | None) -> list[int] | dict[str, int]:
        """The mesh checked, on ``world_size`` ranks (None: on its own size, before a launch):
        [n] as it is, a named one as {name: size}."""
        mesh = self.mesh
        if isinstance(mesh, (list, tuple)) and all(is_integer(n) for n in mesh):
            n = world_size or (mesh[0] if len(mesh) == 1 and mesh[0] >= 1 else None)
            if n is None or list(mesh) != [n]:
                shown_n = "n" if n is None else n
                raise refuse("mesh", mesh, f"[{shown_n}] (1-D over all {shown_n} ranks) or a named "
                             f"dimension such as {{'dp': {shown_n}}}: {MESH_NEEDS_NAMES}")  # fmt: skip
            return [int(n)]
        spec = validate_mesh(mesh, world_size or as_spec(mesh).size)
        if len(spec.dims) > 1:
            n = spec.size
            raise refuse("mesh", mesh, f"one named dimension such as {{'dp': {n}}}: this job "
                         "trains every rank data-parallel; a 2-D mesh composes data parallelism "
                         "with another dimension (labkit.parallel.compose: FSDP2 x TP, HSDP; "
                         "worker labkit.workers.mesh_train)")  # fmt: skip
        return spec.as_dict()

    def resolve(self, world_size: int, gpu_count: int = 0, *, device: str = "cpu") -> DPJob:
        """The complete job on ``world_size`` ranks, or ValueError naming the field.

        Args:
            world_size: ranks the job will start.
            gpu_count: CUDA GPUs visible to the launcher.
            device: "cpu" (gloo) or "cuda" (one GPU per rank, NCCL).
        """
        one_of("device", device, DEVICES, why="'cpu': gloo; 'cuda': NCCL, one GPU per rank")
        whole("world_size", world_size, low=1, why="ranks to start")
        if device == "cuda" and world_size > gpu_count:
            raise InvalidValue(
                f"world_size={world_size} is larger than the {gpu_count} visible GPU(s): data "
                f"parallelism on device='cuda' needs one GPU per rank; use "
                f"world_size<={gpu_count} or device='cpu' (gloo)"
            )
        backend = "nccl" if device == "cuda" else "gloo"
        train = self._train()
        if self.global_batch is not None:
            gb, ranks = self.global_batch, world_size * train.grad_accum
            if gb % ranks:
                raise InvalidValue(
                    f"global_batch={gb} does not divide by world_size={world_size} x "
                    f"grad_accum={train.grad_accum} = {ranks}: every rank must get the same "
                    f"number of sequences per micro-batch; use a multiple of {ranks}"
                )
            if "micro_batch" in self.train and self.train["micro_batch"] != gb // ranks:
                raise refuse("train.micro_batch", self.train["micro_batch"],
                             f"global_batch/(world_size x grad_accum) = {gb // ranks} or left "
                             "out")  # fmt: skip
            train = self._train(micro_batch=gb // ranks)
        if train.device not in (AUTO, device):
            raise refuse("train.device", train.device, f"'auto' or {device!r}, the job's device")
        if "ddp_bf16" in self.strategies and backend == "nccl":
            nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else (0,)
            if tuple(nccl) < (2, 10):
                raise refuse("strategies", "ddp_bf16", "with NCCL >= 2.10 only (bf16 all-reduce)")
        mixed = self.fsdp_mixed_precision
        if mixed == AUTO:
            mixed = "bf16" if train.dtype == "bfloat16" else None
        return DPJob(
            strategies=self.strategies,
            model=self.model,
            train=train,
            global_batch=train.micro_batch * train.grad_accum * world_size,
            optimizer=self.optimizer,
            freeze=self.freeze,
            bucket_cap_mb=None if self.bucket_cap_mb is None else float(self.bucket_cap_mb),
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            powersgd_rank=self.powersgd_rank,
            powersgd_start_iter=self.powersgd_start_iter,
            mesh=None if self.mesh is None else self._mesh(world_size),
            fsdp_mixed_precision=mixed,
            fsdp_reshard_after_forward=self.fsdp_reshard_after_forward,
            spy=self.spy,
            save_params=self.save_params,
            world_size=world_size,
            device=device,
            backend=backend,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPJob:
    """A data-parallel job resolved for its launch (:meth:`DPSettings.resolve`): every default
    filled in, the micro-batch derived from the global batch, the backend chosen. The worker
    and the single-process reference read it; ``to_dict`` is what a rank reports as its
    ``config``, and ``from_dict`` reads that back (notebook 05 trains its reference from it)."""

    strategies: tuple[str, ...]
    model: ModelConfig
    train: TrainConfig
    global_batch: int
    """Sequences per optimizer step, all ranks: micro_batch x grad_accum x world_size."""
    optimizer: str
    freeze: tuple[str, ...]
    bucket_cap_mb: float | None
    gradient_as_bucket_view: bool
    powersgd_rank: int
    powersgd_start_iter: int
    mesh: list[int] | dict[str, int] | None
    fsdp_mixed_precision: str | None
    """None or "bf16" (AUTO resolved)."""
    fsdp_reshard_after_forward: bool
    spy: bool
    save_params: bool
    world_size: int
    device: str
    """"cpu" or "cuda"."""
    backend: str
    """"gloo" or "nccl"."""

    def to_dict(self) -> dict[str, Any]:
        """The job as JSON-ready values (nested configs as dicts, tuples as lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DPJob:
        """The job ``to_dict`` wrote (a rank's reported ``config``)."""
        fields = dict(values)
        fields["model"] = ModelConfig(**fields["model"])
        fields["train"] = TrainConfig(**fields["train"])
        return cls(**{**fields, "strategies": tuple(fields["strategies"]),
                      "freeze": tuple(fields["freeze"])})  # fmt: skip


def _param_names(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of a GPT built from ``cfg``, without building it."""
    from labkit.model import GPT

    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        model = GPT(cfg)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]
