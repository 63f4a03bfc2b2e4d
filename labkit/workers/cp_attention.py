"""Ring attention on n ranks: parity with full attention, bytes counted, memory and time.

    cp_attention.run(cp_attention.CPAttentionConfig(seq_len=256), nproc=4)

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

Config: :class:`CPAttentionConfig`, every field optional.

Result per rank: the figures above, each with how it was obtained (counted / measured).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist_c
import torch.nn.functional as F

from labkit import memory
from labkit import validate as checks  # `validate` is this module's own, older name
from labkit.batching.trials import LiveTensorBytes
from labkit.jobs import runtime
from labkit.jobs.spec import WorkerConfig
from labkit.parallel import context
from labkit.workers.job_config import some_of

if TYPE_CHECKING:
    from labkit.jobs import launch

PARTS = ("parity", "grad", "memory", "time", "torch")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CPAttentionConfig(WorkerConfig):
    """Ring attention's inputs (B, H, T, D) and which parts to run."""

    WORKER: ClassVar[str] = "labkit.workers.cp_attention"
    batch: int = 2
    """B, sequences."""
    heads: int = 4
    """H, attention heads."""
    seq_len: int = 256
    """T, the whole sequence; every rank keeps T/n positions."""
    head_dim: int = 32
    """D, features per head."""
    causal: bool = True
    """Causal attention (each position sees only earlier ones)."""
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    """The forward's dtypes in the parity part, from DTYPES."""
    repeats: int = 5
    """Timed ring forwards in the time part."""
    seed: int = 0
    """Seeds q, k and v."""
    parts: tuple[str, ...] = PARTS
    """Which of PARTS to run."""
    cpu_peak: bool = False
    """Measure the memory part's peaks on CPU ranks too."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("batch", "heads", "seq_len", "head_dim", "repeats"):
            checks.whole(key, getattr(self, key), low=1)
        checks.whole("seed", self.seed, low=0)
        checks.flag("causal", self.causal)
        checks.flag("cpu_peak", self.cpu_peak)
        some_of("dtypes", self.dtypes, tuple(DTYPES))
        some_of("parts", self.parts, PARTS)


def validate(conf: dict[str, Any] | CPAttentionConfig, world_size: int) -> dict[str, Any]:
    """The config as the dict the parts read, checked against ``world_size`` ranks too; an
    error names the field and the constraint."""
    cfg = conf if isinstance(conf, CPAttentionConfig) else CPAttentionConfig.from_dict(conf)
    context.validate_context_parallel(cfg.seq_len, world_size)
    return cfg.to_dict()


def run(config: CPAttentionConfig, *, nproc: int = 2, **launch_options: Any) -> launch.JobResult:
    """Launch ``config`` on ``nproc`` ranks (refused first unless they split its sequence);
    ``launch_options`` go to ``launch.run``."""
    from labkit.jobs import launch  # the caller's side: a rank never imports the launcher
    validate(config, nproc)
    return launch.run(config, nproc=nproc, **launch_options)


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


# --- what notebook 03c prints from a finished job ------------------------------------------------


def _tier(r0: dict[str, Any]) -> str:
    return "GPU ranks over NCCL" if r0["device"].startswith("cuda") else "CPU ranks over gloo"


@dataclass(frozen=True)
class RingParity:
    """The ring's errors against float64 beside one device's SDPA, and the bytes each rank
    sent, predicted and counted: :func:`parity_report`."""

    ranks: tuple[dict[str, Any], ...]  # every rank's result ("parity" and "grad" parts)
    ratio_limit: float = 2.0  # within 2x of SDPA: the same rounding, reordered (our threshold)

    @property
    def ratios(self) -> dict[str, float]:
        """dtype -> the ring's forward error over one device's SDPA error."""
        return {dt: p["ring_max_abs_err"] / max(p["sdpa_one_device_max_abs_err"], 1e-300)
                for dt, p in self.ranks[0]["parity"].items()}

    def describe(self) -> str:
        r0, n = self.ranks[0], len(self.ranks)
        lines = [f"{n} ranks, {_tier(r0)}",
                 f"{'max |error| vs float64 (measured)':<38}{'ring attention':>16}"
                 f"{'one device SDPA':>17}"]  # fmt: skip
        lines += [f"{'forward, ' + dt:<38}{p['ring_max_abs_err']:>16.1e}"
                  f"{p['sdpa_one_device_max_abs_err']:>17.1e}" for dt, p in r0["parity"].items()]
        lines += [f"{'backward, float32, ' + name:<38}{e:>16.1e}{'':>17}"
                  for name, e in r0["grad"]["max_abs_err"].items()]
        worst = max(r0["parity"]["float32"]["ring_max_abs_err"], *r0["grad"]["max_abs_err"].values())
        # float32 rounds at ~1e-7 relative; sums over thousands of keys grow that to ~1e-6..1e-5
        lines.append(f"float32 ring within 1e-4 of float64, forward and backward: {worst < 1e-4}")
        for dt, ratio in self.ratios.items():
            lim = f"{self.ratio_limit:g}"
            lines.append(f"forward, {dt}: ring error / one-device SDPA error = {ratio:.2f}: the ring "
                         "is " + (f"within {lim}× of one device's SDPA (no extra {dt} error at that "
                                  "resolution)" if ratio <= self.ratio_limit else
                                  f"FURTHER from float64 than one device's SDPA (extra {dt} error)"))
        lines += ["", f"{'bytes each rank sent':<38}{'predicted':>14}{'counted':>14}   (every rank)"]
        for dt, p in r0["parity"].items():
            counted = {r["parity"][dt]["sent"]["bytes"]["forward"] for r in self.ranks}
            lines.append(f"{'forward, ' + dt:<38}{p['sent_predicted']:>14,}"
                         f"{'/'.join(f'{c:,}' for c in counted):>14}")
        gs = r0["grad"]["sent"]
        lines += [f"{'float32, batch 1, ' + pas:<38}{r0['grad']['sent_predicted'][pas]:>14,}"
                  f"{gs['bytes'][pas]:>14,}   ({gs['calls'][pas]} sends)"
                  for pas in ("forward", "backward")]
        return "\n".join(lines)


def parity_report(job: Any) -> RingParity:
    """Read the "parity" and "grad" parts of ``job`` (a :func:`run` result)."""
    return RingParity(tuple(job.ranks))


@dataclass(frozen=True)
class RingMemory:
    """What the ring sends against what it holds and saves, per rank, one attention call:
    :func:`memory_report`."""

    r0: dict[str, Any]  # rank 0's result ("parity", "grad" and "memory" parts)
    world_size: int

    @property
    def rows(self) -> list[tuple[str, int | None, int | None, str]]:
        """(what, predicted, counted or measured, how) per row of the table."""
        r0, mem = self.r0, self.r0["memory"]
        sent = r0["grad"]["sent"]["bytes"]
        rows = [("costs: K/V sent per forward, float32", r0["parity"]["float32"]["sent_predicted"],
                 r0["parity"]["float32"]["sent"]["bytes"]["forward"], "counted"),
                ("costs: sent per forward+backward, batch 1", sum(r0["grad"]["sent_predicted"].values()),
                 sent["forward"] + sent["backward"], "counted"),
                ("holds: score matrix, one device (T x T)", mem["full_scores_predicted"], None, ""),
                ("holds: score block, ring ((T/n)^2)", mem["ring_block_scores_predicted"], None, ""),
                ("saves for backward: naive, one device", None, mem["one_device_naive_saved_bytes"],
                 "measured"),
                ("saves for backward: ring, each rank", mem["ring_saved_predicted"],
                 mem["ring_saved_bytes"], "measured")]  # fmt: skip
        if mem.get("peak_method"):  # a GPU rank measures the allocator's peak
            rows += [("peak during the call: naive, one device", None,
                      mem["one_device_naive_peak_bytes"], "measured"),
                     ("peak during the call: ring, rank 0", None, mem["ring_peak_bytes"], "measured")]
        return rows

    def describe(self) -> str:
        mem = self.r0["memory"]
        lines = [f"{'per rank, one attention call, float32':<44}{'predicted':>13}"
                 f"{'counted/measured':>18}"]
        lines += [f"{name:<44}{(f'{pred:,}' if pred is not None else '-'):>13}"
                  f"{(f'{got:,} ' + how if got is not None else '-'):>27}"
                  for name, pred, got, how in self.rows]
        if mem.get("peak_method"):
            lines.append(f"peak / predicted score block, ring (measured / predicted): "
                         f"{mem['ring_peak_bytes'] / mem['ring_block_scores_predicted']:.2f}: the "
                         "scores, their masked copy and their exponentials are alive at once; a fused "
                         "kernel keeps none of them")
        ratio = mem["one_device_naive_saved_bytes"] / mem["ring_saved_bytes"]
        lines += ["", f"saved for backward, naive one device / ring per rank (measured): {ratio:.1f}x"]
        if not mem.get("peak_method"):
            lines.append("peak bytes during a call are not measured at this size on a CPU (measuring "
                         "them costs ~2 s per process); a GPU rank measures them with the CUDA "
                         "allocator")
        return "\n".join(lines)


def memory_report(job: Any) -> RingMemory:
    """Read the "memory" part of ``job`` (with "parity" and "grad"), rank 0's figures."""
    return RingMemory(job.rank(0), len(job.ranks))


def plot_memory_report(result: RingMemory, ax: Any = None) -> Any:
    """Predicted beside counted or measured: K/V sent, the score matrices, the bytes saved for
    backward, in MiB per rank. Returns the axes."""
    import matplotlib.pyplot as plt  # here, so that importing labkit stays light
    import numpy as np

    if ax is None:
        _, ax = plt.subplots(figsize=(7.2, 3.0))
    mem, rows = result.r0["memory"], result.rows
    labels = ["K/V sent\n(forward)", "score matrix\none device", "score block\nring",
              "saved: naive\none device", "saved: ring\nper rank"]
    pred = [rows[0][1], mem["full_scores_predicted"], mem["ring_block_scores_predicted"], np.nan,
            mem["ring_saved_predicted"]]
    meas = [rows[0][2], np.nan, np.nan, mem["one_device_naive_saved_bytes"], mem["ring_saved_bytes"]]
    xs = np.arange(len(labels))
    ax.bar(xs - 0.2, np.array(pred) / 2**20, 0.4, label="predicted")
    ax.bar(xs + 0.2, np.array(meas) / 2**20, 0.4, label="counted / measured")
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_ylabel("MiB per rank")
    ax.set_title(f"Ring attention, n = {result.world_size}, T = {result.r0['config']['seq_len']}, "
                 "float32: what it sends and what it holds")
    ax.legend()
    plt.tight_layout()
    return ax


def describe_torch_cp(job: Any, size: str) -> str:
    """What the "torch" part of ``job`` found: torch's context_parallel ran (its error), did not
    run (its error, verbatim, and why), or was not tried at notebook size ``size``."""
    r0 = job.rank(0)
    tc, n = r0.get("torch"), len(job.ranks)
    if tc is None:  # the worker was not asked to try it at this size
        return (f"not tried at size={size!r}: importing DTensor costs each rank ~2 s, more than "
                "this size's budget; the 'lab' size runs it, and labkit's tests check what it "
                "does here")
    if tc["ran"]:
        return (f"torch context_parallel ran on {n} ranks ({tc['dtype']}, K/V exchange "
                f"{tc['rotate_method']}): max |error| vs float64 (measured) {tc['max_abs_err']:.1e}")
    return (f"torch context_parallel (K/V exchange {tc['rotate_method']}) did NOT run on this tier "
            f"({n} {_tier(r0)}). Its error, verbatim:\n"
            f"  {tc.get('error')}\n"
            "Its ring handlers cover the CUDA SDPA kernels only; on a CPU, SDPA calls the CPU flash "
            "kernel, which has no sharding rule. It needs a GPU per rank: run this section at "
            "size='gpu' on a machine with 4 GPUs (or at 'lab' with 2) to see it run.")


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
