"""Ring attention on n ranks: parity with full attention, bytes counted, memory and time.

    labkit.jobs.launch.run("labkit.workers.cp_attention", nproc=4, config={"seq_len": 256})

Every rank builds the same q, k, v (B, H, T, D) from ``seed`` and keeps its contiguous shard
of the sequence (rank r: positions [r·T/n, (r+1)·T/n)). Parts, each optional (``parts``):

    parity   ring attention's forward in each of ``dtypes``, its max |error| against a float64
             reference over the whole sequence, next to one device's SDPA in the same dtype
             against the same reference; the bytes each rank sent, counted
    grad     the ring backward in float32 (batch 1): max |error| of dq, dk, dv against float64
             autograd through the whole sequence; backward bytes counted
    memory   peak bytes of live tensors during one ring forward (this rank) and, on rank 0,
             during the same attention on one device (naive: the T x T scores; and SDPA); bytes
             saved for backward by the ring and by naive attention on one device
    time     ``repeats`` ring forwards (float32): seconds per call, and per rank the seconds
             spent computing and waiting for the next block
    torch    torch's experimental ``context_parallel`` on the same inputs, with its default K/V
             exchange (torch 2.13: one all-gather of K and V, then the same per-block SDPA and
             log-sum-exp merge; ``set_rotate_method("alltoall")`` would make it a pass-KV ring):
             its max |error| and the exchange it used, or the exact error it raised

Config (all optional): batch (2), heads (4), seq_len (256), head_dim (32), causal (true),
dtypes (["float32", "bfloat16"]), repeats (5), seed (0), parts (all five).

Result per rank: the figures above, each with how it was obtained (counted / measured).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist_c
import torch.nn.functional as F

from labkit import memory
from labkit.batching.trials import LiveTensorBytes
from labkit.jobs import runtime
from labkit.parallel import context

PARTS = ("parity", "grad", "memory", "time", "torch")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def validate(conf: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The config with defaults filled in; ValueError naming the constraint if it is bad."""
    c = {
        "batch": 2, "heads": 4, "seq_len": 256, "head_dim": 32, "causal": True,
        "dtypes": ["float32", "bfloat16"], "repeats": 5, "seed": 0, "parts": list(PARTS),
        "cpu_peak": False,
        **conf,
    }  # fmt: skip
    for key in ("batch", "heads", "head_dim", "repeats"):
        if isinstance(c[key], bool) or not isinstance(c[key], int) or c[key] < 1:
            raise ValueError(f"{key}={c[key]!r}: give a positive integer")
    context.validate_context_parallel(c["seq_len"], world_size)
    bad = [d for d in c["dtypes"] if d not in DTYPES]
    if bad:
        raise ValueError(f"dtypes {bad} unknown: use some of {sorted(DTYPES)}")
    bad = [p for p in c["parts"] if p not in PARTS]
    if bad:
        raise ValueError(f"parts {bad} unknown: use some of {list(PARTS)}")
    return c


def make_qkv(c: dict[str, Any], dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    """The whole sequence's q, k, v (B, H, T, D), the same on every rank and in the test."""
    g = torch.Generator().manual_seed(c["seed"])
    shape = (c["batch"], c["heads"], c["seq_len"], c["head_dim"])
    return tuple(torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))


def reference(q, k, v, causal: bool) -> torch.Tensor:
    """Softmax attention in float64 over the whole sequence (no float32 step anywhere).

    Computed on the inputs' device (a GPU rank checks long sequences quickly), returned there.
    """
    T = q.shape[-2]
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(
            ~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf")
        )
    return torch.softmax(s, dim=-1) @ v


def _shard(t: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    return t.chunk(n, dim=2)[rank].contiguous()


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=runtime.collective_device())
    dist_c.all_reduce(t, op=dist_c.ReduceOp.MAX)
    return float(t.item())


def _parity(ctx: runtime.Context, c: dict[str, Any], qkv64, truth) -> dict[str, Any]:
    n, r, dev = ctx.world_size, ctx.rank, ctx.device
    out: dict[str, Any] = {}
    for name in c["dtypes"]:
        dt = DTYPES[name]
        q, k, v = (_shard(t, r, n).to(dev, dt) for t in qkv64)
        counter = context.P2PCounter()
        with ctx.phase(f"ring attention {name}"), torch.no_grad():
            o = context.ring_attention(q, k, v, causal=c["causal"], counter=counter)
        err = (o.double().cpu() - _shard(truth, r, n)).abs().max().item()
        one = None
        if r == 0:  # one device, the whole sequence, the same dtype: the error to expect
            qf, kf, vf = (t.to(dev, dt) for t in qkv64)
            with torch.no_grad():
                s = F.scaled_dot_product_attention(qf, kf, vf, is_causal=c["causal"])
            one = (s.double().cpu() - truth).abs().max().item()
        out[name] = {
            "ring_max_abs_err": _max_over_ranks(err),
            "rank_max_abs_err": err,
            "sdpa_one_device_max_abs_err": one,
            "sent": counter.as_dict(),
            "sent_predicted": context.ring_kv_bytes_per_rank(
                c["batch"], c["heads"], c["seq_len"], c["head_dim"], n, q.element_size()
            ),
        }
    return out


def _grad(ctx: runtime.Context, c: dict[str, Any], qkv64) -> dict[str, Any]:
    n, r, dev = ctx.world_size, ctx.rank, ctx.device
    q64, k64, v64 = (
        t[:1].to(dev, copy=True).requires_grad_() for t in qkv64
    )  # batch 1 keeps it cheap
    g = torch.Generator().manual_seed(c["seed"] + 1)
    w = torch.randn(q64.shape, generator=g, dtype=torch.float64).to(dev)  # loss = sum(out * w)
    (reference(q64, k64, v64, c["causal"]) * w).sum().backward()
    q, k, v = (_shard(t.detach(), r, n).float().to(dev).requires_grad_() for t in (q64, k64, v64))
    counter = context.P2PCounter()
    with ctx.phase("ring attention backward"):
        o = context.ring_attention(q, k, v, causal=c["causal"], counter=counter)
        (o * _shard(w, r, n).float()).sum().backward()
    errs = {
        name: _max_over_ranks((mine.grad.double() - _shard(ref.grad, r, n)).abs().max().item())
        for name, mine, ref in (("dq", q, q64), ("dk", k, k64), ("dv", v, v64))
    }
    return {
        "max_abs_err": errs,
        "sent": counter.as_dict(),
        "sent_predicted": {
            "forward": context.ring_kv_bytes_per_rank(
                1, c["heads"], c["seq_len"], c["head_dim"], n, 4
            ),
            "backward": context.ring_backward_bytes_per_rank(
                1, c["heads"], c["seq_len"], c["head_dim"], n, 4
            ),
        },
    }


def _saved_bytes(fn) -> int:
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return memory.storage_bytes(saved)


def _peak(fn, device: torch.device) -> tuple[int, str]:
    """Peak bytes of tensors allocated while ``fn`` runs, and how they were measured.

    CUDA: the caching allocator's peak above what was allocated before. CPU: live tensor
    storages seen by a dispatch mode (``LiveTensorBytes``; its first use imports TorchDynamo,
    ~2 s per process, so the lab sizes leave it off and say so).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base, "CUDA allocator peak: measured"
    mode = LiveTensorBytes()
    with mode:
        fn()
    return mode.peak, "live tensor storages (LiveTensorBytes): measured"


def _memory(ctx: runtime.Context, c: dict[str, Any], qkv64) -> dict[str, Any]:
    n, r, dev = ctx.world_size, ctx.rank, ctx.device
    B, H, T, D = c["batch"], c["heads"], c["seq_len"], c["head_dim"]
    q, k, v = (_shard(t, r, n).float().to(dev) for t in qkv64)
    peak = dev.type == "cuda" or c["cpu_peak"]
    res: dict[str, Any] = {
        "ring_saved_predicted": context.saved_bytes_per_rank(B, H, T, D, n, 4),
        "ring_block_scores_predicted": context.score_bytes(B, H, T // n, T // n),
        "full_scores_predicted": context.score_bytes(B, H, T, T),
        "peak_method": None,
    }
    if peak:
        with ctx.phase("ring attention (peak memory)"), torch.no_grad():
            res["ring_peak_bytes"], res["peak_method"] = _peak(
                lambda: context.ring_attention(q, k, v, causal=c["causal"]), dev
            )
    qs = [t.requires_grad_() for t in (q.clone(), k.clone(), v.clone())]
    with ctx.phase("ring attention (saved for backward)"):
        res["ring_saved_bytes"] = _saved_bytes(
            lambda: context.ring_attention(*qs, causal=c["causal"]).sum().backward()
        )
    if r == 0:
        qf, kf, vf = (t.float().to(dev) for t in qkv64)
        if peak:
            for name, fn in (
                ("naive", lambda: context.full_attention(qf, kf, vf, causal=c["causal"])),
                ("sdpa", lambda: F.scaled_dot_product_attention(qf, kf, vf, is_causal=c["causal"])),
            ):
                with torch.no_grad():
                    res[f"one_device_{name}_peak_bytes"], _ = _peak(fn, dev)
        qs = [t.clone().requires_grad_() for t in (qf, kf, vf)]
        res["one_device_naive_saved_bytes"] = _saved_bytes(
            lambda: reference(*qs, c["causal"]).sum()
        )
    return res


def _time(ctx: runtime.Context, c: dict[str, Any], qkv64) -> dict[str, Any]:
    n, r, dev = ctx.world_size, ctx.rank, ctx.device
    q, k, v = (_shard(t, r, n).float().to(dev) for t in qkv64)
    calls, compute, wait, post = [], [], [], []
    with torch.no_grad():
        context.ring_attention(q, k, v, causal=c["causal"])  # warm-up
        for i in range(c["repeats"]):
            dist_c.barrier()  # every rank starts the call together
            tm: dict[str, float] = {}
            t0 = context.clock(dev)
            with ctx.phase("ring attention (timed)"):
                context.ring_attention(q, k, v, causal=c["causal"], timings=tm)
            calls.append(context.clock(dev) - t0)
            compute.append(tm.get("compute_s", 0.0))
            wait.append(tm.get("wait_s", 0.0))
            post.append(tm.get("post_s", 0.0))
            ctx.heartbeat(step=i + 1, total=c["repeats"], part="time")
    return {
        "call_s": calls,
        "compute_s": compute,
        "wait_s": wait,
        "post_s": post,
        "blocks_computed": context.blocks_computed(r, n, causal=c["causal"]),
    }


def _torch_cp(ctx: runtime.Context, c: dict[str, Any], qkv64) -> dict[str, Any]:
    """torch's experimental context_parallel on the same inputs (float32 on CPU, bf16 on CUDA)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    try:  # the K/V exchange context_parallel will use: "ALL_GATHER" unless set_rotate_method ran
        from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

        rotate = _cp_options.rotate_method.name
    except (ImportError, AttributeError):
        rotate = "unknown"

    dev = ctx.device
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    mesh = init_device_mesh(dev.type, (ctx.world_size,))
    q, k, v = (t.to(dev, dt) for t in qkv64)
    truth = reference(*(t.to(dev) for t in qkv64), c["causal"]).cpu()
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=c["causal"])
        # The default head-tail load balancer reorders the sequence; unshard undoes it.
        (full,) = context_parallel_unshard(mesh, [o], [2])
        return {
            "ran": True,
            "rotate_method": rotate,
            "dtype": str(dt).removeprefix("torch."),
            "max_abs_err": (full.double().cpu() - truth).abs().max().item(),
            "error": None,  # the same keys on both paths
        }
    except Exception as e:
        return {"ran": False, "rotate_method": rotate, "error": f"{type(e).__name__}: {e}"}


@runtime.entrypoint
def main(ctx: runtime.Context) -> dict[str, Any]:
    c = validate(ctx.config, ctx.world_size)
    qkv64 = make_qkv(c)
    result: dict[str, Any] = {"rank": ctx.rank, "world_size": ctx.world_size, "device": str(ctx.device),
                              "config": {k: c[k] for k in c if k != "parts"}}  # fmt: skip
    parts = [p for p in PARTS if p in c["parts"]]
    t_start = time.perf_counter()
    result["part_s"] = {}
    for i, part in enumerate(parts):
        ctx.heartbeat(step=i, total=len(parts), part=part)
        t_part = time.perf_counter()
        if part == "parity":
            truth = reference(*(t.to(ctx.device) for t in qkv64), c["causal"]).cpu()
            result["parity"] = _parity(ctx, c, qkv64, truth)
            e = {d: f"{v['ring_max_abs_err']:.1e}" for d, v in result["parity"].items()}
            ctx.print0(f"parity: ring attention max |error| vs float64 {e}")
        elif part == "grad":
            result["grad"] = _grad(ctx, c, qkv64)
            errs = {k: f"{v:.1e}" for k, v in result["grad"]["max_abs_err"].items()}
            ctx.print0(f"grad: max |error| vs float64 autograd {errs}")
        elif part == "memory":
            result["memory"] = _memory(ctx, c, qkv64)
        elif part == "time":
            result["time"] = _time(ctx, c, qkv64)
        elif part == "torch":
            result["torch"] = _torch_cp(ctx, c, qkv64)
            t = result["torch"]
            ctx.print0(
                "torch context_parallel: "
                + (
                    f"ran, max |error| {t['max_abs_err']:.1e}"
                    if t["ran"]
                    else f"did not run: {t['error'][:200]}"
                )
            )
        result["part_s"][part] = time.perf_counter() - t_part
    result["worker_s"] = time.perf_counter() - t_start
    return result


if __name__ == "__main__":
    main()
