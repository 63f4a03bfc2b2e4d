"""Two-dimensional parallelism on 4 ranks: a mesh's groups, FSDP2 × TP, and HSDP.

    mesh_train.run(mesh_train.MeshTrainConfig(steps=3), nproc=4)

Parts (``parts``, all three by default):

    groups   each rank reads, from the real DeviceMesh, the ranks of its process group on
             every dimension of both meshes (torch.distributed.get_process_group_ranks)
    fsdp_tp  the course GPT with DTensor tensor parallelism on mesh["tp"] and FSDP2 on
             mesh["dp"] (``compose.apply_fsdp_tp``), ``steps`` AdamW steps on real text
    hsdp     the same GPT under FSDP2 on a ("replicate", "shard") mesh (``compose.apply_hsdp``)

Data: step s uses the s-th global batch of ``batch_size`` rows (``data.fixed_batches``); each
data-parallel index d takes rows [d·b, (d+1)·b), b = batch_size / (data-parallel degree). In
fsdp_tp the two ranks of a TP group share one index (they compute one batch together); in
hsdp every rank is its own index (replicate coordinate × shard + shard coordinate = rank).

Per training part, each rank reports: losses (mean over the data-parallel shards); the
bytes of every collective issued in the first step's forward and backward, counted per mesh
dimension by a dispatch-mode spy that reads each collective's process group
(``mesh.MeshSpy``), next to ``mesh.predict_comm``; the parameter, gradient and AdamW-state bytes
this rank holds after the last step, measured on local shards, next to
``mesh.predict_memory``; and step times. Rank 0 saves the first step's gradients and the final
parameters, gathered whole, to ``mesh_<part>_params.pt`` in the job directory.

Config: :class:`MeshTrainConfig`, every field optional: model (ModelConfig fields; default
seq_len 32, 2 layers, 4 heads, d_model 64), batch_size (global, 8), steps (3), seed (0), lr
(3e-3), weight_decay (0.1), grad_clip (1.0 or None), parts, save (True), fsdp_tp_mesh
({"dp": 2, "tp": 2}), hsdp_mesh ({"replicate": 2, "shard": 2}), group_meshes ({label: mesh}:
further meshes of any names and shape whose groups the "groups" part reads too, e.g.
{"flat": {"x": 4}}).

Notebook 03b's reading of the job in its kernel (the prediction; the groups, bytes, parity and
memory held against it; the step times compared) is :mod:`labkit.workers.mesh_report`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as tdist

from labkit import data, timing
from labkit.config import ModelConfig
from labkit.jobs import runtime
from labkit.memory import optimizer_state_tensors, storage_bytes
from labkit.model import GPT
from labkit.parallel import compose, mesh, tensor
from labkit.parallel.dp_config import local
from labkit.train import make_optimizer
from labkit.validate import InvalidValue
from labkit.workers.job_config import GPTTrainingConfig, some_of

if TYPE_CHECKING:
    from labkit.jobs import launch

DEFAULT_MODEL = {"seq_len": 32, "n_layer": 2, "n_head": 4, "d_model": 64}
PARTS = ("groups", "fsdp_tp", "hsdp")
MESHES = {"fsdp_tp": {"dp": 2, "tp": 2}, "hsdp": {"replicate": 2, "shard": 2}}
DATA_DIMS = {"fsdp_tp": ("dp",), "hsdp": ("replicate", "shard")}


def data_index(spec: mesh.MeshLike, part: str, rank: int) -> tuple[int, int]:
    """(this rank's data-parallel index, the data-parallel degree) for ``part``."""
    s = mesh.as_spec(spec)
    dims = DATA_DIMS[part]
    index, degree = 0, 1
    for name in dims:  # row-major over the data dimensions, outer first
        coord = s.names.index(name)
        stride = 1
        for later in s.shape[coord + 1 :]:
            stride *= later
        index = index * s[name] + (rank // stride) % s[name]
        degree *= s[name]
    return index, degree


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshTrainConfig(GPTTrainingConfig):
    """Two compositions of a 4-rank mesh, and the groups of every mesh (module docstring)."""

    WORKER: ClassVar[str] = "labkit.workers.mesh_train"
    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(**DEFAULT_MODEL))
    batch_size: int = 8
    """The global batch: every data-parallel shard of a mesh takes an equal share of it."""
    parts: tuple[str, ...] = PARTS
    """Which of PARTS to run."""
    fsdp_tp_mesh: dict[str, int] = dataclasses.field(default_factory=lambda: dict(MESHES["fsdp_tp"]))
    """fsdp_tp's mesh {"dp": n, "tp": n}, outer dimension first."""
    hsdp_mesh: dict[str, int] = dataclasses.field(default_factory=lambda: dict(MESHES["hsdp"]))
    """hsdp's mesh {"replicate": n, "shard": n}, outer dimension first."""
    group_meshes: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    """{label: mesh}: further meshes of any names and shape whose groups "groups" reads too."""

    def __post_init__(self) -> None:
        super().__post_init__()
        some_of("parts", self.parts, PARTS)
        B = self.batch_size
        for part in MESHES:
            spec = _own_world(getattr(self, f"{part}_mesh"), model_cfg=self.model)
            missing = [d for d in MESHES[part] if d not in spec.names]
            if missing or len(spec.names) != 2:
                raise InvalidValue(
                    f"{part}_mesh={spec.as_dict()}: {part} needs the 2 dimensions "
                    f"{list(MESHES[part])} (outer first), e.g. {MESHES[part]}"
                )
            _, degree = data_index(spec, part, 0)
            if B % degree:
                raise InvalidValue(
                    f"batch_size={B!r} does not divide among the {degree} data-parallel shards "
                    f"of {part}'s mesh {spec}: use a positive multiple of {degree}"
                )
            object.__setattr__(self, f"{part}_mesh", spec.as_dict())  # one shape: a dict
        extra = self.group_meshes
        if not isinstance(extra, dict) or set(extra) & set(MESHES):
            raise InvalidValue(
                f"group_meshes={extra!r}: give a dict {{label: mesh}} whose labels are not "
                f"{list(MESHES)}, e.g. {{'flat': {{'x': 4}}}}"
            )
        object.__setattr__(self, "group_meshes",
                           {label: _own_world(spec).as_dict() for label, spec in extra.items()})  # fmt: skip


def _own_world(spec: mesh.MeshLike, **checks: Any) -> mesh.MeshSpec:
    """``spec`` checked for what holds on any world (its names and sizes, the heads its "tp"
    splits); the world it must fill is the launch's (:func:`validate`)."""
    return mesh.validate_mesh(spec, mesh.as_spec(spec).size, **checks)


def validate(conf: MeshTrainConfig | dict[str, Any], world_size: int) -> dict[str, Any]:
    """The job's settings, complete, with every mesh checked against ``world_size`` ranks too,
    or ValueError naming the field (no process group yet)."""
    cfg = conf if isinstance(conf, MeshTrainConfig) else MeshTrainConfig.from_dict(conf)
    meshes = {part: mesh.validate_mesh(getattr(cfg, f"{part}_mesh"), world_size) for part in MESHES}
    return {
        "model": cfg.model,
        "train": cfg.train_config(),
        "parts": list(cfg.parts),
        "meshes": meshes,
        "group_meshes": {k: mesh.validate_mesh(s, world_size) for k, s in cfg.group_meshes.items()},
        "save": cfg.save,
    }


def run(config: MeshTrainConfig, *, nproc: int = 4, **launch_options: Any) -> launch.JobResult:
    """Launch ``config`` on ``nproc`` ranks (refused first unless every mesh has one cell per
    rank); ``launch_options`` go to ``launch.run``."""
    from labkit.jobs import launch  # the caller's side: a rank never imports the launcher
    validate(config, nproc)
    return launch.run(config, nproc=nproc, **launch_options)


# --- the parts --------------------------------------------------------------------------------


def _groups(meshes: dict[str, Any]) -> dict[str, Any]:
    """{part: {dim: the ranks of this rank's group along dim}}, read from torch's DeviceMesh."""
    return {
        part: {d: tdist.get_process_group_ranks(dm[d].get_group()) for d in dm.mesh_dim_names}
        for part, dm in meshes.items()
    }


def _measure_memory(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    got = {
        "parameters": storage_bytes(local(p) for p in params),
        "gradients": storage_bytes(local(p.grad) for p in params if p.grad is not None),
        "optimizer_state": storage_bytes(local(t) for t in optimizer_state_tensors(opt)),
    }
    got["total"] = sum(got.values())
    return got


def _train_part(
    ctx: runtime.Context, part: str, job: dict[str, Any], dm: Any, batches: list, done: int = 0
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Train ``part`` on ``batches``; ``done``: steps of the job before it (for the heartbeat,
    which counts over the whole job)."""
    cfg, tcfg, spec = job["model"], job["train"], job["meshes"][part]
    torch.manual_seed(tcfg.seed)  # same weights on every rank before sharding
    model = GPT(cfg).to(ctx.device)
    if part == "fsdp_tp":
        compose.apply_fsdp_tp(model, dm)
    else:
        compose.apply_hsdp(model, dm)
    opt = make_optimizer(model, tcfg)
    for group in opt.param_groups:  # DTensors on different meshes share no foreach kernel
        group["foreach"] = False
    index, degree = data_index(spec, part, ctx.rank)
    b = tcfg.micro_batch // degree
    names = {dm[d].get_group().group_name: d for d in spec.names}
    spy = mesh.MeshSpy(names)
    losses, times, first_grads, memory = [], [], {}, {}
    for i, (x, y) in enumerate(batches):
        x, y = x[index * b : (index + 1) * b].to(ctx.device), y[index * b : (index + 1) * b]
        timing.synchronize(ctx.device)
        t = time.perf_counter()
        with ctx.phase(f"{part} step"):
            if i == 0:
                with spy:
                    _, loss = model(x, y.to(ctx.device))
                    loss.backward()
            else:
                _, loss = model(x, y.to(ctx.device))
                loss.backward()
            if i == 0:  # gathered whole for the parity test; not part of the timed step
                timing.synchronize(ctx.device)
                t_gather = time.perf_counter()
                first_grads = tensor.full_state(model, grads=True)
                t += time.perf_counter() - t_gather
            if tcfg.grad_clip is not None:
                compose.clip_grad_norm_(model, tcfg.grad_clip)
            opt.step()
        timing.synchronize(ctx.device)
        times.append(time.perf_counter() - t)
        if i == len(batches) - 1:
            memory = _measure_memory(model, opt)  # gradients still held: before zero_grad
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().reshape(1).clone()
        tdist.all_reduce(mean)  # reporting: every data shard's loss, averaged (TP peers agree)
        losses.append(float(mean) / ctx.world_size)
        ctx.heartbeat(step=done + i + 1, part=part)
    predicted = mesh.predict_comm(cfg, spec, part, b)
    result = {
        "mesh": spec.as_dict(),
        "losses": losses,
        "step_s": times,
        "bytes": spy.summary(spec.as_dict()),
        "bytes_predicted": predicted,
        "bytes_unknown_ops": sorted(set(spy.unknown)),
        "memory": {**memory, "method": "storage bytes of local shards after the last step"},
        "memory_predicted": mesh.predict_memory(cfg, spec, part),
    }
    state = {"params": tensor.full_state(model), "first_grads": first_grads}
    return result, state


@runtime.entrypoint
def main(ctx: runtime.Context) -> dict[str, Any]:
    job = validate(ctx.config, ctx.world_size)
    # DTensor logs a warning each time it redistributes over two mesh dimensions in two
    # collectives (full_tensor of a (_StridedShard, Shard) tensor): the gathers here are for
    # the parity check only, and the per-mesh norms in clip_grad_norm_ are two scalars.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    save = job["save"] and ctx.job_dir is not None
    tcfg = job["train"]
    batches = data.fixed_batches(job["model"].seq_len, tcfg.micro_batch, tcfg.steps, tcfg.seed)
    result: dict[str, Any] = {"rank": ctx.rank}
    # Every process group of both meshes, made once (each is a collective over the world).
    meshes = {part: mesh.build(spec, ctx.device.type) for part, spec in job["meshes"].items()}
    if "groups" in job["parts"]:
        extra = {k: mesh.build(s, ctx.device.type) for k, s in job["group_meshes"].items()}
        result["groups"] = _groups({**meshes, **extra})
    training = [p for p in ("fsdp_tp", "hsdp") if p in job["parts"]]
    ctx.heartbeat(step=0, total=len(training) * len(batches))
    for i, part in enumerate(training):
        result[part], state = _train_part(
            ctx, part, job, meshes[part], batches, done=i * len(batches)
        )
        if save and ctx.rank == 0:
            torch.save(state, ctx.job_dir / f"mesh_{part}_params.pt")
        ctx.print0(f"{part} on {job['meshes'][part]}: losses "
                   f"{[round(v, 4) for v in result[part]['losses']]}")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
