"""Pipelines composed: data × pipeline on a 2-D mesh, and torch's multi-stage schedules.

    pp_compose.run(pp_compose.PPComposeConfig(part="dp_pp"), nproc=4)
    pp_compose.run(pp_compose.PPComposeConfig(part="schedules"), nproc=2)
    pp_compose.run(pp_compose.PPComposeConfig(part="layouts"), nproc=4)

part="dp_pp" (pp × dp ranks, default 2 × 2). A mesh ("pp", "dp"): rank = stage·dp + replica,
so ranks {0, 2} are one pipeline and {1, 3} the other. Each pipeline runs its half of the
batch with 1F1B (``labkit.parallel.pipeline.Pipeline`` over the mesh's "pp" group); then
each stage syncs its gradients with its replica over the "dp" group, once per step:

* run "all_reduce": one flat all-reduce of the stage's gradients after its last backward,
  then AdamW on every rank (full optimizer state everywhere);
* run "zero1": no all-reduce; ZeRO-1 (``labkit.parallel.zero1.ShardedOptimizer`` over the
  "dp" group) reduce-scatters the gradients, steps its shard, all-gathers the weights.

Both are checked against one process (same seed, whole batch, AdamW): loss, gradients and
the weights after the step. Collectives are counted by our wrappers (``comm.ByteCounter``):
calls and bytes per step, next to ``pipeline.dp_sync_per_step``.

part="schedules" (p ranks, default 2). The GPT cut into v·p stages (one block each at 4
layers), run by torch.distributed.pipelining's ``ScheduleGPipe`` and ``Schedule1F1B`` (v = 1)
and ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``
(v = 2) on the same batch. Every F, B, I (backward to the input) and W (backward to the
weights) each rank runs is timestamped by wrapping the stage's own methods, so the bubble is
measured whichever schedule drives it. Loss and gradients are compared with one process.

The order each rank ran its actions in is read from those events
(``schedules.order_from_events``) for every schedule, 1F1B included: ``recorded`` holds it,
with whether every timed step ran the same order; ``orders`` holds torch's plan
(``pipeline_order``) of the multi-stage schedules to hold it against.

part="layouts" (world_size ranks, default 4). The data × pipeline layouts of the planner
(``labkit.planner``, tensor and context parallelism left out) timed one after another in one
job, as the planner models them: a ("pp", "dp") mesh, each replica's rows cut into micro-batches
of ``micro_batch`` rows run by our 1F1B (one stage: plain gradient accumulation), one flat
all-reduce of the gradients over "dp" after the last backward (ZeRO-0, not overlapped), AdamW.
Every layout starts from the same weights and steps on the same batch, so their losses agree
step by step (the first with one process's). Each step is timed from a common start to the
end of the slowest rank's optimizer step.

Config: :class:`PPComposeConfig`, every field optional: part, model (ModelConfig fields),
batch_size (global, default 8), microbatches (m, default 4), seed, warmup/repeats (untimed and
timed steps, default 1/3), pp and dp (dp_pp), schedules (names from
``schedules.TORCH_SCHEDULES``), layouts (((pp, dp), ...), default ((1, n), (2, n/2))) and
micro_batch (rows, default 1).

Notebook 03b's reading of the "dp_pp" part in its kernel (the prediction from the stage sizes,
the counts and parity held against it, the timeline) is :mod:`labkit.workers.dp_pp_report`.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as tdist

from labkit import validate
from labkit.config import ModelConfig, TrainConfig
from labkit.jobs import runtime
from labkit.memory import optimizer_state_tensors, storage_bytes
from labkit.parallel import comm, pipeline, schedules
from labkit.parallel.timeline import bubble_from_events, common_t0
from labkit.parallel.zero1 import ShardedOptimizer
from labkit.timing import synchronize
from labkit.train import make_optimizer
from labkit.workers.job_config import GPTJobConfig, some_of
from labkit.workers.pp_train import DEFAULT_MODEL, build_model, make_batch

if TYPE_CHECKING:
    from labkit.jobs import launch

PARTS = ("dp_pp", "schedules", "layouts")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPComposeConfig(GPTJobConfig):
    """One of the composed pipelines (the module docstring says what each part does). No
    training fields: every part takes one AdamW step of ``TrainConfig``'s defaults, the step
    its single-process reference takes."""

    WORKER: ClassVar[str] = "labkit.workers.pp_compose"
    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(**DEFAULT_MODEL))
    part: str = "dp_pp"
    """One of PARTS."""
    batch_size: int = 8
    """The global batch, in sequences."""
    microbatches: int = 4
    """m, micro-batches per pipeline step (dp_pp, schedules)."""
    warmup: int = 1
    """Untimed steps before the timed ones (schedules, layouts)."""
    repeats: int = 3
    """Timed steps (schedules, layouts)."""
    pp: int = 2
    """Pipeline stages of dp_pp's mesh."""
    dp: int = 2
    """Data-parallel replicas of dp_pp's mesh."""
    schedules: tuple[str, ...] = tuple(schedules.TORCH_SCHEDULES)
    """Names from ``schedules.TORCH_SCHEDULES``, run in this order (schedules)."""
    layouts: tuple[tuple[int, int], ...] | None = None
    """(pp, dp) of each layout to time (layouts); None: (1, n) and, for an even n, (2, n/2)."""
    micro_batch: int = 1
    """Rows per micro-batch (layouts)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        validate.one_of("part", self.part, PARTS)
        for name in ("microbatches", "repeats", "pp", "dp", "micro_batch"):
            validate.whole(name, getattr(self, name), low=1)
        validate.whole("warmup", self.warmup, low=0)
        some_of("schedules", self.schedules, schedules.TORCH_SCHEDULES)
        if self.layouts is not None:
            if isinstance(self.layouts, str) or not self.layouts:
                raise validate.refuse("layouts", self.layouts, "a non-empty list of (pp, dp) pairs")
            pairs = []
            for lay in self.layouts:
                if isinstance(lay, str) or len(lay) != 2:
                    raise validate.refuse("layouts", lay, "a (pp, dp) pair of positive integers")
                pairs.append((validate.whole("pp", lay[0], low=1), validate.whole("dp", lay[1], low=1)))
            object.__setattr__(self, "layouts", tuple(pairs))  # one shape: a tuple of pairs

    def layouts_on(self, world_size: int) -> list[tuple[int, int]]:
        """The (pp, dp) layouts the layouts part times on ``world_size`` ranks."""
        if self.layouts is not None:
            return list(self.layouts)
        n = world_size
        return [(1, n), (2, n // 2)] if n % 2 == 0 else [(1, n)]

    def check_ranks(self, world_size: int) -> None:
        """Refuse a job of ``world_size`` ranks this part cannot run on (before launch, and
        again first thing on the rank)."""
        cfg, B, m = self.model, self.batch_size, self.microbatches
        if self.part == "dp_pp":
            pipeline.validate_dp_pp(cfg, world_size, self.pp, self.dp, B, m)
        elif self.part == "schedules":
            for name in self.schedules:
                schedules.validate_torch_schedule(name, world_size, m, B, cfg.n_layer)
        else:
            validate_layouts(cfg, world_size, self.layouts_on(world_size), B, self.micro_batch)


def run(config: PPComposeConfig, *, nproc: int, **launch_options: Any) -> launch.JobResult:
    """Launch ``config`` on ``nproc`` ranks (refused first if its part cannot run on them);
    ``launch_options`` go to ``launch.run``. No default ``nproc``: each part wants its own
    (dp_pp pp × dp, schedules 2, layouts 4)."""
    from labkit.jobs import launch  # the caller's side: a rank never imports the launcher
    config.check_ranks(nproc)
    return launch.run(config, nproc=nproc, **launch_options)


def reference(cfg: ModelConfig, x: torch.Tensor, y: torch.Tensor, seed: int) -> dict[str, Any]:
    """One process, the whole batch: loss, gradients, and the weights after one AdamW step."""
    model = build_model(cfg, seed)
    _, loss = model(x, y)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt = make_optimizer(model, TrainConfig())
    opt.step()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"loss": float(loss.detach()), "grads": grads, "weights": weights}


def ref_name(name: str) -> str:
    """A stage's parameter name as the whole GPT spells it (``blocks.2.…``; the last stage's
    copy of a tied embedding, ``lm_head.weight``, is ``wte.weight`` in the GPT)."""
    return "wte.weight" if name == "lm_head.weight" else name


def max_error(module: torch.nn.Module, ref: dict[str, torch.Tensor], what: str) -> float:
    """Largest |ours − reference| over ``module``'s gradients ("grad") or weights ("weight")."""
    worst = 0.0
    for n, p in module.named_parameters():
        t = p.grad if what == "grad" else p
        if t is None:
            raise RuntimeError(f"{n} has no gradient")
        worst = max(worst, float((t.detach().cpu() - ref[ref_name(n)]).abs().max()))
    return worst


# --- part 1: data × pipeline ---------------------------------------------------------------------


def _dp_pp(ctx: runtime.Context, cfg: ModelConfig, job: PPComposeConfig) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    pp, dp = job.pp, job.dp
    B, m, seed = job.batch_size, job.microbatches, job.seed
    mesh = init_device_mesh(ctx.device.type, (pp, dp), mesh_dim_names=("pp", "dp"))
    dp_group, dp_rank = mesh.get_group("dp"), mesh.get_local_rank("dp")
    stage_index = mesh.get_local_rank("pp")
    x, y = make_batch(cfg, B, seed)
    ref = reference(cfg, x, y, seed)
    xr, yr = x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]  # this replica's half of the batch
    bounds = pipeline.partition(cfg, pp)
    model = build_model(cfg, seed)
    runs: dict[str, Any] = {}
    events: list[dict[str, Any]] = []
    for sync in ("all_reduce", "zero1"):
        pipe = pipeline.Pipeline(model, bounds, rank=ctx.rank, device=ctx.device, group=mesh)
        stage = pipe.stage
        counter = comm.ByteCounter(dp, ctx.backend)
        if sync == "zero1":
            opt: Any = ShardedOptimizer(
                stage, lambda mod: make_optimizer(mod, TrainConfig()), dp_rank, dp, counter,
                group=dp_group,
            )  # fmt: skip
        else:
            opt = make_optimizer(stage, TrainConfig())
        pipe.timeline.t0 = common_t0()
        with ctx.phase(f"dp×pp {sync}: pipeline step"):
            loss = pipe.step("1f1b", xr, yr, m)  # mean over this replica's half
        last_b = max(e["end_s"] for e in pipe.timeline.events if e["kind"] == "B")
        sync_start = pipe.timeline.now()
        with ctx.phase(f"dp×pp {sync}: gradient sync over dp"):
            if sync == "all_reduce":
                grads = [p.grad for p in stage.parameters()]
                flat = torch.cat([g.reshape(-1) for g in grads])
                comm.all_reduce(flat, counter, group=dp_group)  # once per step, all micro-batches
                flat /= dp
                off = 0
                for g in grads:
                    g.copy_(flat[off : off + g.numel()].view_as(g))
                    off += g.numel()
                grad_err = max_error(stage, ref["grads"], "grad")
                opt.step()
            else:
                # ZeRO-1's step reduce-scatters: only the owner of a shard sees its mean
                # gradient, so the gradient parity is read on the shards, and the weights
                # after the all-gather are the end-to-end check.
                opt.step()
                grad_err = float("nan")
        sync_end = pipe.timeline.now()
        loss_t = torch.tensor([loss], dtype=torch.float64, device=runtime.collective_device(dp_group))
        tdist.all_reduce(loss_t, group=dp_group)  # the whole batch's mean: average of halves
        counter.end_step()
        summary = counter.summary()
        stage_params = sum(p.numel() for p in stage.parameters())
        runs[sync] = {
            "loss": float(loss_t.item()) / dp,
            "loss_error": abs(float(loss_t.item()) / dp - ref["loss"]),
            "grad_error": grad_err,
            "weight_error": max_error(stage, ref["weights"], "weight"),
            "counted": summary,
            "predicted": pipeline.dp_sync_per_step(
                stage_params, dp, m, sync, buffers=len(opt.groups) if sync == "zero1" else 1
            ),
            "predicted_zero3": pipeline.dp_sync_per_step(stage_params, dp, m, "zero3"),
            "optimizer_state_bytes": storage_bytes(optimizer_state_tensors(opt)),
            "stage_params": stage_params,
            "last_backward_end_s": last_b,
            "sync_start_s": sync_start,
            "sync_end_s": sync_end,
        }
        if sync == "all_reduce":
            events = [{**e, "rank": ctx.rank, "stage": stage_index} for e in pipe.timeline.events]
        ctx.heartbeat(step=len(runs), total=2)
    gathered: list[Any] = [None] * ctx.world_size
    tdist.all_gather_object(gathered, events)
    return {
        "rank": ctx.rank,
        "stage": stage_index,
        "dp_rank": dp_rank,
        "pp_group": tdist.get_process_group_ranks(mesh.get_group("pp")),
        "dp_group": tdist.get_process_group_ranks(dp_group),
        "reference_loss": ref["loss"],
        "runs": runs,
        "events": [e for evs in gathered for e in evs] if ctx.rank == 0 else None,
    }


# --- part 2: torch's schedules with several stages per rank -----------------------------------


def _timed(method: Any, log: list[dict[str, Any]], kind: Any, rank: int, stage: int,
           clock: Any) -> Any:  # fmt: skip
    """Wrap a PipelineStage method so each call becomes an event {kind, stage, mb, times}."""

    @functools.wraps(method)
    def wrapper(mb: int, *args: Any, **kwargs: Any) -> Any:
        start = clock()
        out = method(mb, *args, **kwargs)
        k = kind(kwargs) if callable(kind) else kind
        log.append({"rank": rank, "stage": stage, "mb": int(mb), "kind": k,
                    "start_s": start, "end_s": clock()})  # fmt: skip
        return out

    return wrapper


def _sum_tied(mods: list[torch.nn.Module], vocab: int, d: int) -> None:
    """Sum the two copies of a tied embedding over the ranks that hold them (Megatron's way;
    with ZB-V both are on rank 0). Every rank joins the one all-reduce."""
    copies = [mod.wte.weight for mod in mods if mod.is_first]
    copies += [mod.lm_head.weight for mod in mods if mod.is_last and not mod.is_first]
    buf = torch.zeros(vocab, d, device=runtime.collective_device())  # NCCL needs a GPU tensor
    for w in copies:
        buf += w.grad.detach().to(buf.device)
    tdist.all_reduce(buf)
    for w in copies:
        w.grad.copy_(buf)


def _schedules(ctx: runtime.Context, cfg: ModelConfig, job: PPComposeConfig) -> dict[str, Any]:
    import torch.distributed.pipelining as tpp

    p = ctx.world_size
    B, m, seed = job.batch_size, job.microbatches, job.seed
    names = list(job.schedules)
    warmup, repeats = job.warmup, job.repeats
    x, y = make_batch(cfg, B, seed)
    ref = reference(cfg, x, y, seed)
    model = build_model(cfg, seed)
    out: dict[str, Any] = {}
    orders: dict[str, Any] = {}
    recorded: dict[str, Any] = {}
    total, done = len(names) * (warmup + repeats), 0
    t0 = [0.0]  # the step's common start, set before each step

    def clock() -> float:  # on a GPU, an op's time is only true once its kernels have run
        synchronize(ctx.device)
        return time.perf_counter() - t0[0]

    for name in names:
        cls_name, v = schedules.TORCH_SCHEDULES[name]
        n_stages = v * p
        bounds = pipeline.partition(cfg, n_stages)
        mine = schedules.stage_placement(name, p)[ctx.rank]
        mods = [pipeline.StageModule(model, bounds, s).to(ctx.device) for s in mine]
        pstages = [
            tpp.PipelineStage(mod, s, n_stages, ctx.device)
            for mod, s in zip(mods, mine, strict=True)
        ]
        cls = getattr(tpp, cls_name)
        sched = cls(pstages if v > 1 else pstages[0], n_microbatches=m, loss_fn=pipeline.loss_fn)
        log: list[dict[str, Any]] = []
        for ps, s in zip(pstages, mine, strict=True):
            ps.forward_one_chunk = _timed(ps.forward_one_chunk, log, "F", ctx.rank, s, clock)
            ps.backward_one_chunk = _timed(
                ps.backward_one_chunk, log,
                lambda kw: "B" if kw.get("full_backward", True) else "I", ctx.rank, s, clock,
            )  # fmt: skip
            ps.backward_weight_one_chunk = _timed(
                ps.backward_weight_one_chunk, log, "W", ctx.rank, s, clock
            )
        holds_first, holds_last = 0 in mine, n_stages - 1 in mine
        bubbles, steps_s, loss = [], [], float("nan")
        ran: list[Any] = []  # the order every rank ran its actions in, per timed step
        for i in range(warmup + repeats):
            for mod in mods:
                mod.zero_grad(set_to_none=True)
            log.clear()
            t0[0] = common_t0()
            losses: list[torch.Tensor] = []
            args = (x.to(ctx.device),) if holds_first else ()
            with ctx.phase(f"{name} step"):
                sched.step(*args, target=y.to(ctx.device) if holds_last else None, losses=losses)
            if cfg.tie_weights:
                _sum_tied(mods, cfg.vocab_size, cfg.d_model)
            box = torch.tensor(
                [sum(float(v_.detach()) for v_ in losses) / m if losses else 0.0],
                device=runtime.collective_device(),
            )
            tdist.all_reduce(box)  # only the last stage's holder has the loss
            loss = float(box.item())
            gathered: list[Any] = [None] * p
            tdist.all_gather_object(gathered, log)
            events = [e for evs in gathered for e in evs]
            done += 1
            ctx.heartbeat(step=done, total=total)
            if i < warmup:
                continue
            ran.append(schedules.order_from_events(events))
            per_rank = bubble_from_events(events)
            bubbles.append(statistics.fmean(r["idle_s"] / r["busy_s"] for r in per_rank.values()))
            steps_s.append(per_rank[0]["step_s"])
        grad_err = max(max_error(mod, ref["grads"], "grad") for mod in mods)
        errs: list[Any] = [None] * p
        tdist.all_gather_object(errs, grad_err)
        durations = {
            k: statistics.median(e["end_s"] - e["start_s"] for e in events if e["kind"] == k)
            for k in {e["kind"] for e in events}
        }
        out[name] = {
            "v": v,
            "stages": schedules.stage_placement(name, p),
            "loss": loss,
            "loss_error": abs(loss - ref["loss"]),
            "grad_error": max(errs),
            "overhead": statistics.median(bubbles),  # idle / busy, mean over ranks
            "overhead_samples": bubbles,
            "step_s": statistics.median(steps_s),
            "step_s_samples": steps_s,
            "op_s": durations,  # median seconds per F, B, I, W on this rank
            "events": events,  # the last timed step, every rank
        }
        # What ran, read from the wrappers' events (every schedule, 1F1B included), and, for
        # the multi-stage schedules, what torch planned (``pipeline_order``) to hold it against.
        recorded[name] = {"order": ran[-1], "same_every_step": all(o == ran[-1] for o in ran)}
        if v > 1:
            orders[name] = schedules.order_from_torch(sched.pipeline_order)
        ctx.print0(
            f"{name:>16} (v={v}): loss {loss:.4f}, measured idle/busy {out[name]['overhead']:.2f}"
        )
    return {"rank": ctx.rank, "p": p, "m": m, "reference_loss": ref["loss"], "runs": out,
            "orders": orders if ctx.rank == 0 else None,
            "recorded": recorded if ctx.rank == 0 else None}  # fmt: skip


# --- part 3: the planner's data × pipeline layouts, timed ------------------------------------


def layout_name(pp: int, dp: int) -> str:
    """The planner's name of a data × pipeline layout (``planner.Layout.name``): "DP2×PP2"."""
    parts = [f"{k}{d}" for k, d in (("DP", dp), ("PP", pp)) if d > 1]
    return "×".join(parts) if parts else "one rank"


def validate_layouts(cfg: ModelConfig, world_size: int, layouts: list[Any], batch_size: int,
                     micro_batch: int) -> list[tuple[int, int]]:  # fmt: skip
    """[(pp, dp), ...] checked (each covers the world, its replicas' rows cut into micro-batches
    of ``micro_batch`` rows); ValueError naming the fix otherwise. Call it before launch."""
    validate.whole("micro_batch", micro_batch, low=1)
    out = []
    for lay in layouts:
        pp, dp = (int(v) for v in lay)
        if batch_size % (dp * micro_batch):
            raise ValueError(f"layout pp={pp}, dp={dp}: batch_size={batch_size} does not split "
                             f"into {dp} replicas of micro-batches of {micro_batch} rows: use a "
                             f"multiple of {dp * micro_batch}")  # fmt: skip
        pipeline.validate_dp_pp(cfg, world_size, pp, dp, batch_size,
                                batch_size // (dp * micro_batch))  # fmt: skip
        out.append((pp, dp))
    if len(set(out)) != len(out):
        raise ValueError(f"layouts={layouts!r} names a layout twice")
    return out


def _layouts(ctx: runtime.Context, cfg: ModelConfig, job: PPComposeConfig) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    n = ctx.world_size
    B, b, seed = job.batch_size, job.micro_batch, job.seed
    layouts = job.layouts_on(n)
    warmup, repeats = job.warmup, job.repeats
    x, y = make_batch(cfg, B, seed)
    ref_loss = reference(cfg, x, y, seed)["loss"]
    model = build_model(cfg, seed)
    out: dict[str, Any] = {}
    total, done = len(layouts) * (warmup + repeats), 0
    for pp, dp in layouts:
        name = layout_name(pp, dp)
        mesh = init_device_mesh(ctx.device.type, (pp, dp), mesh_dim_names=("pp", "dp"))
        dp_group, dp_rank = mesh.get_group("dp"), mesh.get_local_rank("dp")
        xr, yr = x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]
        m = xr.shape[0] // b
        pipe = pipeline.Pipeline(model, pipeline.partition(cfg, pp), rank=ctx.rank,
                                 device=ctx.device, group=mesh)  # fmt: skip
        stage = pipe.stage
        opt = make_optimizer(stage, TrainConfig())
        losses, steps_s = [], []
        for i in range(warmup + repeats):
            t0 = common_t0()
            with ctx.phase(f"{name} step"):
                loss = pipe.step("1f1b", xr, yr, m)
                if dp > 1:  # one flat all-reduce of the stage's gradients, after its last backward
                    grads = [p.grad for p in stage.parameters()]
                    flat = torch.cat([g.reshape(-1) for g in grads])
                    tdist.all_reduce(flat, group=dp_group)
                    flat /= dp
                    off = 0
                    for g in grads:
                        g.copy_(flat[off : off + g.numel()].view_as(g))
                        off += g.numel()
                opt.step()
                synchronize(ctx.device)
                took = time.perf_counter() - t0
            dev = runtime.collective_device()
            took_t = torch.tensor([took], dtype=torch.float64, device=dev)
            loss_t = torch.tensor([loss], dtype=torch.float64, device=dev)
            tdist.all_reduce(took_t, op=tdist.ReduceOp.MAX)  # the step ends with its slowest rank
            tdist.all_reduce(loss_t, group=dp_group)  # the whole batch's loss: mean of replicas
            losses.append(float(loss_t.item()) / dp)
            if i >= warmup:
                steps_s.append(float(took_t.item()))
            done += 1
            ctx.heartbeat(step=done, total=total)
        out[name] = {"pp": pp, "dp": dp, "micro_batch": b, "microbatches": m,
                     "losses": losses, "step_s_samples": steps_s,
                     "step_s": statistics.median(steps_s) if steps_s else float("nan")}  # fmt: skip
        ctx.print0(f"{name:>10}: {m} micro-batches of {b} per replica, median step "
                   f"{1e3 * out[name]['step_s']:.1f} ms")  # fmt: skip
    return {"rank": ctx.rank, "reference_loss": ref_loss, "warmup": warmup, "layouts": out}


@dataclasses.dataclass(frozen=True)
class LayoutRuns:
    """The layouts job's rank 0 result (part "layouts") against the planner's step per layout
    (``predicted``, seconds, modelled): the table, whether every layout trained the same model
    (losses within float32 rounding, the first step against one process's), and whether the
    measured order holds the predicted one (``verdict.compare_ranking``)."""

    predicted: dict[str, float]
    runs: dict[str, dict[str, Any]]
    reference_loss: float
    repeats: int

    @property
    def order(self) -> list[str]:
        """The layouts, fastest predicted first."""
        return sorted(self.predicted, key=self.predicted.get)

    def describe(self) -> str:
        from labkit import verdict  # layer 3

        order, runs = self.order, self.runs
        lines = ["", f"{'layout':<10}{'m per replica':>14}{'predicted':>11}{'measured median':>17}{'ratio':>7}"]
        for name in order:
            r, want = runs[name], self.predicted[name]
            lines.append(f"{name:<10}{r['microbatches']:>14}{1e3 * want:>8.1f} ms{1e3 * r['step_s']:>14.1f} ms"
                         f"{r['step_s'] / want:>6.1f}x")  # fmt: skip
        losses = [runs[n]["losses"] for n in order]
        spread = max(abs(a - b) for ls in zip(*losses, strict=True) for a in ls for b in ls)
        same = spread < 1e-4 and abs(losses[0][0] - self.reference_loss) < 1e-4
        lines.append(f"losses: first step {losses[0][0]:.5f} (one process {self.reference_loss:.5f}); the "
                     f"layouts differ by at most {spread:.1e} over {len(losses[0])} steps: "
                     + ("float32 rounding, the same training" if same
                        else "MORE than float32 rounding: one layout does not train the same model"))
        lines += [f"(predicted: modelled, as above; measured: {self.repeats} steps each after one "
                  "untimed, common start to the slowest rank's optimizer step)", "",
                  str(verdict.compare_ranking(order, {n: runs[n]["step_s_samples"] for n in order}))]
        return "\n".join(lines)


def layout_runs(result: dict[str, Any], predicted: dict[str, float], *, repeats: int) -> LayoutRuns:
    """``result``: rank 0's result of the layouts job; ``predicted``: layout name -> step (s)."""
    return LayoutRuns(predicted=dict(predicted), runs=result["layouts"],
                      reference_loss=result["reference_loss"], repeats=repeats)  # fmt: skip


@runtime.entrypoint
def main(ctx: runtime.Context) -> dict[str, Any]:
    job = PPComposeConfig.from_dict(ctx.config)
    job.check_ranks(ctx.world_size)  # again, first thing on the rank
    runtime.require_gpu_backend(ctx.backend, ctx.device.type, "pipeline stages exchange "
                             "activations with send/recv")  # fmt: skip
    torch.manual_seed(0)
    part = {"dp_pp": _dp_pp, "schedules": _schedules, "layouts": _layouts}[job.part]
    return part(ctx, job.model, job)


if __name__ == "__main__":
    main()
