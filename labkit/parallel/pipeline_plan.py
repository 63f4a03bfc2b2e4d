"""Pipeline parallelism, planned before any rank runs: the checks a pipeline config passes, the
bytes a data-parallel group of stages sends per step, and the cut of the GPT into stages (by
parameters, or by measured time per block).

Separate from :mod:`labkit.parallel.pipeline` (the stage runner): nothing here needs a
process group, and the notebooks call it to plan and to predict.
"""


import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

from labkit.config import ModelConfig
from labkit.timing import synchronize
from labkit.validate import whole

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
        whole(name, value, low=1)
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
        whole(name, value, low=1)
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
        whole(name, value, low=1)
    if pp * dp != world_size:
        raise ValueError(
            f"a mesh of pp={pp} × dp={dp} = {pp * dp} ranks but the job has {world_size}:"
            f" the mesh must cover every rank (launch nproc={pp * dp})"
        )
    if whole("batch_size", batch_size, low=1) % dp:
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
    p = whole("p", p, low=1, high=L, why="stages, at most one layer each")
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
