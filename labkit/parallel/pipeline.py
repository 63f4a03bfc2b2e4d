"""Pipeline parallelism: cut the GPT into p stages, one per rank, and stream micro-batches.

    bounds = partition(cfg, p=2)                       # [(0, 2), (2, 4)]: blocks per stage
    pipe = Pipeline(GPT(cfg), bounds, rank=ctx.rank, device=ctx.device)
    loss = pipe.step("1f1b", x, y, n_microbatches=4)   # same loss and grads as GPT(x, y)
    pipe.timeline.events                               # when each F and B ran, for a Gantt

Stage 0 also holds the embeddings (``wte``, ``wpe``), the last stage ``ln_f`` and ``lm_head``.
Activations go forward and their gradients backward with point-to-point sends and receives
(gloo does them on CPU tensors, NCCL on GPU ones), posted in the batches of ``p2p_plan`` so
that they cannot deadlock where sends do not buffer (NCCL); ``p2p_deadlock`` checks a plan.

Schedules (action lists in ``labkit.parallel.schedules``):

* ``naive``: the whole batch at once; stage i+1 waits for all of stage i (no micro-batches);
* ``gpipe``: m micro-batches, all forwards then all backwards (Huang et al. 2019);
* ``1f1b``: one-forward-one-backward, same bubble, fewer activations held (PipeDream-Flush,
  Narayanan et al. 2021, arXiv 2006.09503; Megatron-LM's schedule, arXiv 2104.04473);
* ``torch_gpipe``, ``torch_1f1b``: the same stage module run by PyTorch's own
  ``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe``/``Schedule1F1B``).

Each micro-batch loss is divided by m, so the accumulated gradient equals that of the mean
loss over the batch: every schedule gives the sequential model's gradients (tests prove it).

**Tied embeddings** (``ModelConfig.tie_weights=True``) are handled the Megatron way (Shoeybi
et al. 2019; Narayanan et al. 2021, section 4): the first stage owns ``wte`` and the last stage
a *copy* of it as ``lm_head.weight``; after the backward the two gradients are summed with
an all-reduce between the first and the last rank, so both copies take identical optimiser
steps and stay equal. That sum is exactly the gradient of the single shared matrix.

**Composed with data parallelism** (``group=``): by default the pipeline spans all ranks of
the job (stage i on rank i). Pass the process group of a device mesh's "pp" dimension (or the
mesh itself) and the pipeline runs over that group's ranks only: with 4 ranks and a mesh
("pp", "dp") of shape (2, 2), ranks {0, 2} form one pipeline and {1, 3} another, each a
data-parallel replica of the other (``pp_group``). Stage i is then the i-th rank of the group;
sends, receives, the loss broadcast and the tied-embedding sum stay inside it.

This module is the stage runner (one stage's module, its probe, the executor of a schedule).
What is planned before any rank runs (checks, the dp traffic, ``partition``) is in
``labkit.parallel.pipeline_plan``, the point-to-point plan (``p2p_plan``, ``p2p_deadlock``) in
``labkit.parallel.pipeline_p2p``; both are re-exported here under their old names.

Scope: dropout should be 0 for exact parity, and each rank builds the whole model before
keeping its stage (fine at lab sizes; real systems build only their stage, e.g. on the meta
device).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from labkit.parallel.pipeline_p2p import P2P as P2P
from labkit.parallel.pipeline_p2p import Batch as Batch
from labkit.parallel.pipeline_p2p import p2p_batches as p2p_batches
from labkit.parallel.pipeline_p2p import p2p_deadlock as p2p_deadlock
from labkit.parallel.pipeline_p2p import p2p_plan as p2p_plan
from labkit.parallel.pipeline_plan import DP_SYNCS as DP_SYNCS
from labkit.parallel.pipeline_plan import PARTITION_BY as PARTITION_BY
from labkit.parallel.pipeline_plan import SCHEDULES as SCHEDULES
from labkit.parallel.pipeline_plan import Bounds as Bounds
from labkit.parallel.pipeline_plan import dp_sync_per_step as dp_sync_per_step
from labkit.parallel.pipeline_plan import measure_unit_times as measure_unit_times
from labkit.parallel.pipeline_plan import partition as partition
from labkit.parallel.pipeline_plan import stage_costs as stage_costs
from labkit.parallel.pipeline_plan import unit_param_counts as unit_param_counts
from labkit.parallel.pipeline_plan import validate_dp_pp as validate_dp_pp
from labkit.parallel.pipeline_plan import validate_pipeline as validate_pipeline
from labkit.parallel.schedules import peak_in_flight, schedule_order
from labkit.parallel.timeline import Timeline
from labkit.timing import synchronize

# --- one stage of the model ------------------------------------------------------------------


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy, as ``GPT.forward`` computes it: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class StageModule(nn.Module):
    """The part of a GPT one pipeline stage runs.

    Parameter names match the whole model's (``blocks.2.attn.q.weight``, ``wte.weight``), so
    gradients can be compared name by name with a single-process GPT.
    """

    def __init__(self, model: nn.Module, bounds: Bounds, stage: int) -> None:
        super().__init__()
        p = len(bounds)
        if not 0 <= stage < p:
            raise ValueError(f"stage={stage}: need 0 <= stage < {p} (one per entry of bounds)")
        self.stage, self.num_stages = stage, p
        self.is_first, self.is_last = stage == 0, stage == p - 1
        self.tied = bool(model.cfg.tie_weights)
        start, end = bounds[stage]
        self.start, self.end = start, end
        # deepcopy: the stage owns its tensors; the full model can be dropped afterwards.
        if self.is_first:
            self.wte = copy.deepcopy(model.wte)
            self.wpe = copy.deepcopy(model.wpe)
            self.drop = copy.deepcopy(model.drop)
        # ModuleDict keyed by the global block index keeps the whole model's parameter names.
        self.blocks = nn.ModuleDict(
            {str(i): copy.deepcopy(model.blocks[i]) for i in range(start, end)}
        )
        if self.is_last:
            self.ln_f = copy.deepcopy(model.ln_f)
            # With tied weights this deepcopy makes the last stage's own copy of wte (Megatron).
            self.lm_head = copy.deepcopy(model.lm_head)
            if self.tied and self.is_first:  # a single stage: keep the one shared matrix
                self.lm_head.weight = self.wte.weight
        self.probe: StageProbe | None = None

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token + position embeddings: idx (B, T) int64 -> (B, T, C)."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        """This stage's blocks, then the head on the last stage: (B, T, C) -> (B, T, C or V)."""
        for block in self.blocks.values():
            x = block(x)
        if self.is_last:
            x = self.lm_head(self.ln_f(x))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.probe is not None and not x.is_meta:  # torch's shape inference runs on meta
            return self.probe.forward(self, x)
        return self.body(self.embed(x) if self.is_first else x)


# --- instrumentation: when each F and B ran, and what each micro-batch keeps -----------------


class StageProbe:
    """Records F and B events and the activation bytes each micro-batch keeps for backward.

    Attached to a ``StageModule`` it sees every forward call, whoever drives the schedule
    (our executor or ``torch.distributed.pipelining``):

    * F: the module's forward, timed; micro-batches are numbered in call order;
    * B: from the moment the gradient of the stage's output exists (a tensor hook on the
      output) to the moment the gradient of its input exists (a hook on the input; on stage
      0, on the embedding output: the embedding's own scatter-add is left out, it is tiny);
    * activation bytes: every tensor autograd saves during the forward
      (``saved_tensors_hooks``, as ``labkit.memory``), parameters excluded, views counted
      once. A micro-batch's bytes are live from its F until its B ends.

    On CUDA each mark synchronises the device, so times are true but the run is serialised.
    """

    def __init__(self, timeline: Timeline, device: torch.device, num_stages: int) -> None:
        self.timeline, self.device, self.num_stages = timeline, device, num_stages
        self.reset()

    def reset(self) -> None:
        self.next_mb = 0
        self.live: dict[int, int] = {}
        self.bytes_per_mb: list[int] = []
        self.peak_bytes = 0
        self.peak_in_flight = 0
        self._b_start: dict[int, float] = {}
        # torch's PipelineStage reuses its receive buffers from step to step: hooks left on
        # them would fire again next step, so each step removes the previous step's hooks.
        for handle in getattr(self, "_hooks", []):
            handle.remove()
        self._hooks: list[Any] = []

    def _now(self) -> float:
        synchronize(self.device)
        return self.timeline.now()

    def forward(self, stage: StageModule, x: torch.Tensor) -> torch.Tensor:
        mb = self.next_mb
        self.next_mb += 1
        param_storages = {p.untyped_storage().data_ptr() for p in stage.parameters()}
        saved: dict[int, int] = {}  # storage pointer -> bytes: views of one storage count once
        # The first stage's input is a chunk (a view) of the whole batch's token ids: counted
        # whole, every micro-batch would be charged for all the others' ids too.
        inputs = x.untyped_storage().data_ptr()

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            if s.data_ptr() == inputs:
                saved.setdefault(s.data_ptr(), x.numel() * x.element_size())
            elif s.data_ptr() not in param_storages:
                saved.setdefault(s.data_ptr(), s.nbytes())
            return t

        start = self._now()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = stage.embed(x) if stage.is_first else x
            out = stage.body(h)
        self.timeline.add("F", mb, start, self._now())

        nbytes = sum(saved.values())
        self.bytes_per_mb.append(nbytes)
        self.live[mb] = nbytes
        self.peak_bytes = max(self.peak_bytes, sum(self.live.values()))
        self.peak_in_flight = max(self.peak_in_flight, len(self.live))
        if out.requires_grad:
            self._hooks.append(out.register_hook(lambda g: self._backward_start(mb, g)))
        if h.requires_grad:
            self._hooks.append(h.register_hook(lambda g: self._backward_end(mb, g)))
        return out

    def _backward_start(self, mb: int, grad: torch.Tensor) -> torch.Tensor:
        self._b_start[mb] = self._now()
        return grad

    def _backward_end(self, mb: int, grad: torch.Tensor) -> torch.Tensor:
        end = self._now()
        self.timeline.add("B", mb, self._b_start.pop(mb, end), end)
        self.live.pop(mb, None)
        return grad

    def summary(self, schedule: str, m: int) -> dict[str, Any]:
        """Measured against predicted activation memory of this stage for one step."""
        stage, p = self.timeline.rank, self.num_stages
        predicted_in_flight = peak_in_flight(
            schedule_order(schedule.removeprefix("torch_"), p, m, stage)
        )
        per_mb = max(self.bytes_per_mb, default=0)
        return {
            "bytes_per_microbatch": per_mb,
            "peak_in_flight": self.peak_in_flight,
            "peak_bytes": self.peak_bytes,
            "predicted_in_flight": predicted_in_flight,
            # Not a prediction of bytes (that is memory.predicted_stage_activations): the count
            # the schedule predicts times the largest micro-batch this stage measured.
            "in_flight_x_measured_mb_bytes": predicted_in_flight * per_mb,
        }




def pp_group(group: Any, dim: str = "pp") -> Any:
    """The process group a pipeline runs over: ``group`` itself, or a mesh's ``dim`` group.

    Accepts None (the whole job), a ``ProcessGroup``, or a ``DeviceMesh`` (torch's
    ``init_device_mesh``) with a dimension named ``dim``.
    """
    if group is None or not hasattr(group, "get_group"):
        return group
    names = getattr(group, "mesh_dim_names", None) or ()
    if dim not in names:
        raise ValueError(f"the mesh has dimensions {names}: name one of them {dim!r}")
    return group.get_group(dim)


# --- the pipeline, one rank's view -------------------------------------------------------------


class _Links:
    """Point-to-point transfers with the neighbour stages (``ranks[stage]`` is its global rank).

    Everything goes through ``batch_isend_irecv``, one batch as ``p2p_plan`` says. A batch with
    a receive is waited for at once (the stage cannot compute without its input; its held-back
    send, if any, completes with it). A batch of one send is not: the stage computes on while
    it travels, and ``wait`` ends the step's last ones.
    """

    def __init__(self, ranks: Sequence[int] | None = None, group: Any = None) -> None:
        self.ranks, self.group = ranks, group  # None: stage index = global rank, world group
        self.outbox: dict[tuple[str, int], torch.Tensor] = {}  # ("act"/"grad", mb) -> to send
        self.pending: list[tuple[list[Any], list[torch.Tensor]]] = []  # send works, tensors

    def put(self, what: str, mb: int, t: torch.Tensor) -> None:
        """Hand over a tensor for the plan's send of (``what``, ``mb``)."""
        self.outbox[(what, mb)] = t.detach().contiguous()

    def post(
        self, batch: Batch, shape: tuple[int, ...], device: torch.device
    ) -> dict[tuple[str, int], torch.Tensor]:
        """Post one batch; return its received tensors by (``what``, ``mb``)."""
        if not batch:
            return {}
        ops, sent, received = [], [], {}
        kw = {} if self.group is None else {"group": self.group}
        for verb, peer_stage, what, mb in batch:
            peer = peer_stage if self.ranks is None else self.ranks[peer_stage]
            if verb == "send":
                t = self.outbox.pop((what, mb))
                sent.append(t)
                ops.append(tdist.P2POp(tdist.isend, t, peer, **kw))
            else:
                buf = torch.empty(shape, dtype=torch.float32, device=device)
                received[(what, mb)] = buf
                ops.append(tdist.P2POp(tdist.irecv, buf, peer, **kw))
        works = tdist.batch_isend_irecv(ops)
        if received:
            for work in works:
                work.wait()
        else:
            self.pending.append((works, sent))  # the tensors stay alive until sent
        return received

    def wait(self) -> None:
        for works, _ in self.pending:
            for work in works:
                work.wait()
        self.pending.clear()
        if self.outbox:
            raise RuntimeError(f"p2p plan left tensors unsent: {sorted(self.outbox)}")


class Pipeline:
    """One rank's stage of a pipelined GPT, and the schedules that run it.

    Args:
        model: the whole GPT, built with the same seed on every rank; this rank keeps
            ``bounds[stage]`` of it (``StageModule``).
        bounds: one (start, end) per stage, e.g. from ``partition``; len(bounds) must equal
            the number of ranks in the pipeline (the world, or ``group``).
        rank: this process's global rank. Its stage is its index in ``group`` (= ``rank``
            when the pipeline spans the world); ``self.rank`` is that stage index.
        device: where the stage lives (``ctx.device``).
        group: the pipeline's process group, e.g. ``mesh.get_group("pp")``, or a
            ``DeviceMesh`` with a "pp" dimension; None spans every rank of the job.
        t0, clock: events are ``clock() - t0`` seconds; set ``pipe.timeline.t0`` from
            ``timeline.common_t0()`` before a step so all ranks share the origin.
    """

    def __init__(
        self,
        model: nn.Module,
        bounds: Bounds,
        *,
        rank: int,
        device: torch.device,
        t0: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
        group: Any = None,
    ) -> None:
        self.p = len(bounds)
        group = pp_group(group)
        if group is None:
            world = tdist.get_world_size() if tdist.is_initialized() else 1
            if world != self.p:
                raise ValueError(
                    f"{self.p} stages in bounds but {world} ranks: the pipeline spans every rank"
                    f" (launch nproc={self.p}, partition into p={world} stages, or pass the"
                    f" group of a mesh's 'pp' dimension)"
                )
            self.stage_ranks = list(range(self.p))
            stage_index = rank
        else:
            self.stage_ranks = tdist.get_process_group_ranks(group)
            if len(self.stage_ranks) != self.p:
                raise ValueError(
                    f"{self.p} stages in bounds but the pipeline group has"
                    f" {len(self.stage_ranks)} ranks {self.stage_ranks}: partition into"
                    f" p={len(self.stage_ranks)} stages"
                )
            if rank not in self.stage_ranks:
                raise ValueError(f"rank {rank} is not in the pipeline group {self.stage_ranks}")
            stage_index = self.stage_ranks.index(rank)
        self.group, self.global_rank = group, rank
        self.rank, self.device = stage_index, device
        self.stage = StageModule(model, bounds, stage_index).to(device)
        self.timeline = Timeline(stage_index, t0=t0, clock=clock)
        self.probe = StageProbe(self.timeline, device, self.p)
        self.stage.probe = self.probe
        self.links = _Links(None if group is None else self.stage_ranks, group)
        self._p2p_ready = False  # True once a collective has run (see step)
        self._torch_schedules: dict[tuple[str, int], Any] = {}
        self.model_cfg = model.cfg
        self.d_model, self.vocab_size = model.cfg.d_model, model.cfg.vocab_size

    # -- one training step ----------------------------------------------------------------

    def step(self, schedule: str, x: torch.Tensor, y: torch.Tensor, n_microbatches: int) -> float:
        """Forward and backward of batch ``x``, ``y`` (B, T) under ``schedule``.

        Leaves the gradients in ``self.stage``'s parameters (zeroed first) for the caller's
        optimiser; returns the mean loss over the batch, the same value on every rank.
        Every rank passes the same x, y (only stage 0 uses x, only the last stage y).
        """
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}: use one of {SCHEDULES}")
        if x.shape[0] % n_microbatches or (schedule == "naive" and n_microbatches != 1):
            validate_pipeline(self.model_cfg, self.p, x.shape[0], n_microbatches, schedule)
        self.stage.zero_grad(set_to_none=True)
        self.probe.reset()
        self.timeline.clear()
        if not self._p2p_ready and self.p > 1:
            # batch_isend_irecv's first call in a group must include every rank of it (its
            # docstring); a 1F1B step's first batch joins only stages 0 and 1. A collective
            # first, once, makes any later subset legal (pp_train's common_t0 is one, but
            # other callers, e.g. the exercises, step without one).
            tdist.barrier(group=self.group)
            self._p2p_ready = True
        if schedule.startswith("torch_"):
            loss_sum = self._run_torch(schedule, x, y, n_microbatches)
        else:
            loss_sum = self._run_order(schedule, x, y, n_microbatches)
        self.links.wait()
        self.sync_tied_grads()
        # The loss exists on the last stage only; every rank reports it.
        loss = torch.tensor([loss_sum], dtype=torch.float32, device=self.device)
        tdist.broadcast(loss, src=self.stage_ranks[-1], group=self.group)
        return float(loss.item())

    def _run_order(self, schedule: str, x: torch.Tensor, y: torch.Tensor, m: int) -> float:
        """Execute our own action list (``labkit.parallel.schedules``) for this stage.

        The transfers follow ``p2p_plan``: before each action the batch holding its receive
        (and a send held back from the action before), after it the batch with its send.
        """
        stage, links, r, p = self.stage, self.links, self.rank, self.p
        xs, ys = x.to(self.device).chunk(m), y.to(self.device).chunk(m)  # m × (b, T)
        b, T = xs[0].shape
        act_shape = (b, T, self.d_model)  # what flows between stages: (b, T, C)
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        loss_sum = 0.0
        order = schedule_order(schedule, p, m, r)
        for (kind, j), (before, after) in zip(order, p2p_plan(order, r, p), strict=True):
            received = links.post(before, act_shape, self.device)
            if kind == "F":
                inp = xs[j] if stage.is_first else received["act", j].requires_grad_()
                out = stage(inp)
                if stage.is_last:
                    out = loss_fn(out, ys[j]) / m  # 1/m: gradient of the batch's mean loss
                    loss_sum += float(out.detach())
                else:
                    links.put("act", j, out)
                inputs[j], outputs[j] = inp, out
            else:
                inp, out = inputs.pop(j), outputs.pop(j)  # popping frees the graph after B
                if stage.is_last:
                    out.backward()
                else:
                    torch.autograd.backward(out, received[("grad", j)])
                if not stage.is_first:
                    links.put("grad", j, inp.grad)
            links.post(after, act_shape, self.device)
        return loss_sum

    def _run_torch(self, schedule: str, x: torch.Tensor, y: torch.Tensor, m: int) -> float:
        """The same stage run by ``torch.distributed.pipelining``'s schedule."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        key = (schedule, m)
        if key not in self._torch_schedules:
            pstage = PipelineStage(self.stage, self.rank, self.p, self.device, group=self.group)
            cls = ScheduleGPipe if schedule == "torch_gpipe" else Schedule1F1B
            # scale_grads=True (default) divides the gradients by m: the mean loss's gradient.
            self._torch_schedules[key] = cls(pstage, n_microbatches=m, loss_fn=loss_fn)
        sched = self._torch_schedules[key]
        losses: list[torch.Tensor] = []
        if self.stage.is_first:
            sched.step(x.to(self.device))
        elif self.stage.is_last:
            sched.step(target=y.to(self.device), losses=losses)
        else:
            sched.step()
        return float(sum(float(v.detach()) for v in losses) / m) if losses else 0.0

    def sync_tied_grads(self) -> None:
        """Sum the gradients of the two copies of a tied embedding (first and last stage).

        Only those two ranks hold a copy; with p = 2 they are the whole pipeline. For p > 2
        the sum still runs over the pipeline's group, the middle stages adding zeros: one
        collective every stage joins, no extra process group to create.
        """
        if not self.stage.tied or self.p == 1:
            return
        if self.stage.is_first:
            w: torch.Tensor | None = self.stage.wte.weight
        elif self.stage.is_last:
            w = self.stage.lm_head.weight
        else:
            w = None
        if w is not None and w.grad is None:
            w.grad = torch.zeros_like(w)
        buf = (
            w.grad
            if w is not None
            else torch.zeros(self.vocab_size, self.d_model, device=self.device)
        )
        tdist.all_reduce(buf, group=self.group)  # in place: both copies now hold the sum

    def activation_summary(self, schedule: str, m: int) -> dict[str, Any]:
        """Activation memory of this stage in the last step, measured and predicted."""
        return self.probe.summary(schedule, m)

