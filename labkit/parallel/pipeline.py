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

Scope: dropout should be 0 for exact parity, and each rank builds the whole model before
keeping its stage (fine at lab sizes; real systems build only their stage, e.g. on the meta
device).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from labkit.config import ModelConfig
from labkit.parallel.schedules import peak_in_flight, schedule_order
from labkit.parallel.timeline import Timeline
from labkit.timing import synchronize

SCHEDULES = ("naive", "gpipe", "1f1b", "torch_gpipe", "torch_1f1b")
PARTITION_BY = ("params", "time")

Bounds = list[tuple[int, int]]  # per stage: (first block, one past the last block)


# --- checks before anything is launched ------------------------------------------------------


def validate_pipeline(
    model_cfg: ModelConfig,
    p: int,
    batch_size: int,
    n_microbatches: int,
    schedule: str = "gpipe",
) -> None:
    """Raise ValueError, naming the argument and the fix, for a pipeline that cannot run.

    Call it before ``launch.run``: a bad shape then fails in the notebook cell at once, not as
    a traceback from every rank a few seconds later.
    """
    for name, value in (("p", p), ("batch_size", batch_size), ("n_microbatches", n_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: need a positive integer")
    if p > model_cfg.n_layer:
        raise ValueError(
            f"p={p} pipeline stages but the model has n_layer={model_cfg.n_layer} blocks: each"
            f" stage needs at least one block; use p <= {model_cfg.n_layer} or a deeper model"
        )
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: use one of {SCHEDULES}")
    if batch_size % n_microbatches:
        divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        raise ValueError(
            f"n_microbatches={n_microbatches} does not divide batch_size={batch_size}: "
            f"micro-batches must be equal for the gradient to match the whole batch's; "
            f"use one of {divisors}"
        )
    if schedule == "naive" and n_microbatches != 1:
        raise ValueError(
            f"schedule='naive' runs the whole batch as one piece, but n_microbatches="
            f"{n_microbatches}: pass n_microbatches=1, or use 'gpipe' or '1f1b'"
        )
    if schedule == "torch_1f1b" and n_microbatches < p:
        raise ValueError(
            f"schedule='torch_1f1b' needs n_microbatches >= p (torch's Schedule1F1B requires"
            f" it), got n_microbatches={n_microbatches}, p={p}: use more micro-batches"
        )


# --- composed with data parallelism: what each stage's dp group sends per step ------------------

DP_SYNCS = ("all_reduce", "per_microbatch", "zero1", "zero3")


def dp_sync_per_step(
    stage_params: int,
    dp: int,
    m: int,
    sync: str = "all_reduce",
    param_bytes: int = 4,
    buffers: int = 1,
) -> dict[str, float]:
    """Predicted data-parallel collectives of one pipeline stage in one optimizer step.

    A stage's d = ``dp`` replicas (same stage, other pipelines) must agree on its gradient.
    S = ``stage_params`` × ``param_bytes`` (the gradient's bytes); ring costs per rank:
    all-reduce 2(d−1)/d·S, all-gather and reduce-scatter (d−1)/d·S each.

    * "all_reduce": one all-reduce after the stage's last backward of the step (the
      gradients of the m micro-batches have accumulated locally): 1 call;
    * "per_microbatch": the mistake, syncing after every micro-batch's backward: m calls,
      m times the bytes, for the same result;
    * "zero1": optimizer state sharded over the dp group (ZeRO-1): one reduce-scatter of the
      gradients and one all-gather of the updated weights: 2 calls, the all-reduce's bytes;
    * "zero3": parameters sharded too, naively per micro-batch: each micro-batch
      all-gathers them for its forward and again for its backward, and reduce-scatters its
      gradient (3 calls per micro-batch): 3m calls, 3m/2 times the all-reduce's bytes. This
      is the bound without deferral. torch 2.13's ``PipelineStage`` turns off FSDP's
      gradient sync and resharding after each micro-batch's backward and reduce-scatters
      once, after the last (its ``perform_reduce_grad``); torchtitan also keeps the
      parameters gathered after the forward (``reshard_after_forward=False``). Both pay in
      memory: the gathered parameters stay, which is what ZeRO-3 saved.

    ``buffers``: how many flat buffers each collective is split into (``zero1.ZeRO1`` keeps
    one per optimizer group: 2, with and without weight decay): calls × buffers, same bytes.

    Returns {"calls", "message_bytes" (S), "sent_per_rank"}.
    """
    for name, value in (("stage_params", stage_params), ("dp", dp), ("m", m),
                        ("param_bytes", param_bytes), ("buffers", buffers)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: need a positive integer")
    S = stage_params * param_bytes
    share = (dp - 1) / dp * S  # one all-gather or reduce-scatter, per rank
    calls, sent = {
        "all_reduce": (1, 2 * share),
        "per_microbatch": (m, 2 * share * m),
        "zero1": (2, 2 * share),
        "zero3": (3 * m, 3 * share * m),
    }.get(sync, (None, None))
    if calls is None:
        raise ValueError(f"sync={sync!r}: use one of {DP_SYNCS}")
    return {"calls": calls * buffers, "message_bytes": S, "sent_per_rank": sent}


def validate_dp_pp(
    model_cfg: ModelConfig, world_size: int, pp: int, dp: int, batch_size: int, m: int
) -> None:
    """Raise ValueError for a data × pipeline layout that cannot run, before any launch."""
    for name, value in (("pp", pp), ("dp", dp), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: need a positive integer")
    if pp * dp != world_size:
        raise ValueError(
            f"a mesh of pp={pp} × dp={dp} = {pp * dp} ranks but the job has {world_size}:"
            f" the mesh must cover every rank (launch nproc={pp * dp})"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size % dp:
        raise ValueError(
            f"batch_size={batch_size!r} does not split into dp={dp} equal replica batches:"
            f" use a multiple of {dp}"
        )
    validate_pipeline(model_cfg, pp, batch_size // dp, m, "1f1b")


# --- partition -------------------------------------------------------------------------------


def unit_param_counts(cfg: ModelConfig) -> list[int]:
    """Parameters of each pipeline unit: [embeddings, block 0, ..., block L−1, head].

    embeddings = V·h + s·h (``wte``, ``wpe``); block = 12h² + 13h; head = 2h + V·h (``ln_f``
    and ``lm_head``; with tied weights the last stage holds its own copy of the V·h matrix).
    """
    h, V, s = cfg.d_model, cfg.vocab_size, cfg.seq_len
    return [V * h + s * h, *([12 * h * h + 13 * h] * cfg.n_layer), 2 * h + V * h]


def partition(
    model_cfg: ModelConfig,
    p: int,
    by: str = "params",
    times: Sequence[float] | None = None,
) -> Bounds:
    """Split the blocks into ``p`` contiguous stages, minimising the largest stage's cost.

    Args:
        model_cfg: the model's shape.
        p: number of stages, 1 <= p <= n_layer.
        by: "params" balances parameter counts (memory; ``unit_param_counts``), "time"
            balances measured seconds (speed; what sets the pipeline's pace).
        times: for by="time", seconds per unit: either L+2 values [embeddings, block 0..L−1,
            head] (as from ``measure_unit_times``) or L values (blocks only).

    Returns:
        [(start, end), ...], one per stage: stage i runs ``blocks[start:end]``. Stage 0 also
        runs the embeddings and the last stage ``ln_f``, ``lm_head`` (their cost counts).
    """
    L = model_cfg.n_layer
    if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= L:
        raise ValueError(f"p={p!r}: need an integer with 1 <= p <= n_layer={L}")
    if by == "params":
        if times is not None:
            raise ValueError("times is only used with by='time'")
        costs = [float(c) for c in unit_param_counts(model_cfg)]
    elif by == "time":
        if times is None:
            raise ValueError("by='time' needs times (seconds per unit; see measure_unit_times)")
        times = [float(t) for t in times]
        if len(times) == L:
            times = [0.0, *times, 0.0]
        if len(times) != L + 2 or any(t < 0 for t in times):
            raise ValueError(
                f"times has {len(times)} values: need L+2={L + 2} (embeddings, each block, head)"
                f" or L={L} (blocks only), all >= 0"
            )
        costs = times
    else:
        raise ValueError(f"by={by!r}: use one of {PARTITION_BY}")
    embed, blocks, head = costs[0], costs[1:-1], costs[-1]
    prefix = [0.0]
    for c in blocks:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, i: int, j: int) -> float:  # stage runs blocks i..j-1
        extra = (embed if stage == 0 else 0.0) + (head if stage == p - 1 else 0.0)
        return prefix[j] - prefix[i] + extra

    # Dynamic programming over (stages used, blocks covered): best[k][j] is the smallest
    # possible maximum stage cost when stages 0..k cover blocks 0..j-1.
    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(p)]
    cut = [[0] * (L + 1) for _ in range(p)]
    for j in range(1, L + 1):
        best[0][j] = cost(0, 0, j)
    for k in range(1, p):
        for j in range(k + 1, L + 1):
            for i in range(k, j):  # stage k runs blocks i..j-1, stages before it cover 0..i-1
                c = max(best[k - 1][i], cost(k, i, j))
                if c < best[k][j]:
                    best[k][j], cut[k][j] = c, i
    bounds: Bounds = []
    j = L
    for k in range(p - 1, 0, -1):
        i = cut[k][j]
        bounds.append((i, j))
        j = i
    bounds.append((0, j))
    return bounds[::-1]


def stage_costs(
    model_cfg: ModelConfig, bounds: Bounds, times: Sequence[float] | None = None
) -> list[float]:
    """Cost of each stage of ``bounds``: parameters, or seconds if ``times`` (L+2 values)."""
    units = [float(t) for t in times] if times is not None else unit_param_counts(model_cfg)
    p = len(bounds)
    return [
        sum(units[1 + i : 1 + j]) + (units[0] if k == 0 else 0) + (units[-1] if k == p - 1 else 0)
        for k, (i, j) in enumerate(bounds)
    ]


@torch.no_grad()
def measure_unit_times(model: nn.Module, idx: torch.Tensor, repeats: int = 5) -> list[float]:
    """Median forward seconds of each unit [embeddings, block 0..L−1, head] on ``idx`` (B, T).

    Forward only: a unit's backward costs about twice its forward, so the proportions, which
    are all ``partition(by="time")`` needs, hold for the whole step.
    """
    device = idx.device
    samples: list[list[float]] = []
    for _ in range(repeats):
        row = []
        t = time.perf_counter()
        x = model.drop(model.wte(idx) + model.wpe(torch.arange(idx.shape[1], device=device)))
        synchronize(device)
        row.append(time.perf_counter() - t)
        for block in model.blocks:
            t = time.perf_counter()
            x = block(x)
            synchronize(device)
            row.append(time.perf_counter() - t)
        t = time.perf_counter()
        model.lm_head(model.ln_f(x))
        synchronize(device)
        row.append(time.perf_counter() - t)
        samples.append(row)
    return [statistics.median(col) for col in zip(*samples, strict=True)]


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


# --- the point-to-point plan: which transfers each rank posts, and in which groups ------------

# One transfer, as a rank sees it: ("send" or "recv", peer rank, "act" or "grad", micro-batch).
P2P = tuple[str, int, str, int]
Batch = list[P2P]  # posted together with one ``batch_isend_irecv``


def _transfers(kind: str, mb: int, stage: int, p: int) -> tuple[P2P | None, P2P | None]:
    """The receive action (``kind``, ``mb``) needs before it computes, the send it makes after.

    F(mb) receives the activation from stage − 1 and sends its output to stage + 1; B(mb)
    receives the output's gradient from stage + 1 and sends the input's to stage − 1. The
    first stage has no one before it, the last no one after it.
    """
    if kind == "F":
        recv = ("recv", stage - 1, "act", mb) if stage > 0 else None
        send = ("send", stage + 1, "act", mb) if stage < p - 1 else None
    else:
        recv = ("recv", stage + 1, "grad", mb) if stage < p - 1 else None
        send = ("send", stage - 1, "grad", mb) if stage > 0 else None
    return recv, send


def p2p_plan(order: Sequence[tuple[str, int]], stage: int, p: int) -> list[tuple[Batch, Batch]]:
    """For each action of ``order``: the batch this stage posts before computing it, and after.

    Why batches. NCCL runs all point-to-point traffic between two ranks in issue order on one
    stream, and a send of more than NCCL's small internal buffer does not finish until the peer
    has posted the matching receive (NVIDIA/nccl#783; #479 for grouping a send with a receive).
    Posted one at a time, 1F1B's steady state deadlocks for every m >= 2: with p = 2, m = 2,
    stage 0 posts send a0, send a1, recv g0, recv g1 and stage 1 recv a0, send g0, recv a1,
    send g1. Send a1 waits for recv a1, queued behind send g0, which waits for recv g0, queued
    behind send a1: a cycle. gloo buffers sends, so CPU runs never show it.

    The cure is torch's own (``torch.distributed.pipelining.Schedule1F1B`` posts the forward's
    send and the backward's receive as one ``batch_isend_irecv``, "for deadlock avoidance"): a
    send whose very next transfer on this rank is a receive from the *same* peer is held back
    and posted together with that receive, so each side offers both halves at once. That only
    happens when the next action starts with that receive (F then B on the link to stage + 1,
    B then F on the link to stage − 1), so nothing is computed in between: holding the send
    back delays no one. Every other send goes alone right after its action.

    Returns one (before, after) pair per action: ``before`` holds the action's receive, with a
    held-back send of the previous action first; ``after`` holds its send unless it was held
    back. Either may be empty. ``Pipeline._run_order`` executes exactly this plan, and
    ``p2p_deadlock`` checks a plan of every rank without running anything.
    """
    steps = [_transfers(kind, mb, stage, p) for kind, mb in order]
    plan: list[tuple[Batch, Batch]] = []
    held: P2P | None = None  # the previous action's send, waiting for this action's receive
    for i, (recv, send) in enumerate(steps):
        before = ([held] if held else []) + ([recv] if recv else [])
        held = None
        after: Batch = []
        if send is not None:
            next_recv = steps[i + 1][0] if i + 1 < len(steps) else None
            if next_recv is not None and next_recv[1] == send[1]:
                held = send
            else:
                after = [send]
        plan.append((before, after))
    return plan


def p2p_batches(schedule: str, p: int, m: int, stage: int) -> list[Batch]:
    """The batches one stage posts during a step of ``schedule``, in order (empty ones left out)."""
    plan = p2p_plan(schedule_order(schedule, p, m, stage), stage, p)
    return [batch for pair in plan for batch in pair if batch]


def p2p_deadlock(batches: Sequence[Sequence[Batch]]) -> str | None:
    """Play every rank's batches (``batches[rank]``) with rendezvous semantics; None if all end.

    The strictest model of NCCL: a rank posts its batches one after the other and a batch is
    done only when each of its transfers has met its partner (a send finishes when the peer
    has posted the receive, however small the tensor); between two ranks, the k-th send one
    way meets the k-th receive (FIFO, tags are not looked at, as in NCCL). A plan that ends
    here ends on any real transport, which can only buffer more. Returns a description of the
    first problem: a deadlock (every unfinished rank waits), or a send met by a receive of a
    different tensor (NCCL would deliver the wrong data silently).
    """
    n = len(batches)
    pos = [0] * n  # index of the batch each rank is posting
    open_ops = [list(b[0]) if b else [] for b in batches]  # its transfers still unmatched
    while True:
        progressed = False
        for a in range(n):
            for b in range(n):
                # FIFO: a's first unmatched send to b meets b's first unmatched receive from
                # a; earlier batches are done, so these are the first ones of the whole step.
                send = next((o for o in open_ops[a] if o[0] == "send" and o[1] == b), None)
                recv = next((o for o in open_ops[b] if o[0] == "recv" and o[1] == a), None)
                if send is None or recv is None:
                    continue
                if send[2:] != recv[2:]:
                    return (f"rank {a} sends {send[2]} {send[3]} to rank {b}, which receives "
                            f"{recv[2]} {recv[3]} from it in that place")  # fmt: skip
                open_ops[a].remove(send)
                open_ops[b].remove(recv)
                progressed = True
        for r in range(n):  # a rank whose batch is done posts its next one
            while not open_ops[r] and pos[r] < len(batches[r]):
                pos[r] += 1
                progressed = True
                if pos[r] < len(batches[r]):
                    open_ops[r] = list(batches[r][pos[r]])
        if all(pos[r] >= len(batches[r]) for r in range(n)):
            return None
        if not progressed:
            waiting = "; ".join(
                f"rank {r} at batch {pos[r]} waits on {open_ops[r]}"
                for r in range(n)
                if pos[r] < len(batches[r])
            )
            return f"deadlock: {waiting}"


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
