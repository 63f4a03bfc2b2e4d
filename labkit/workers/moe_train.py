"""Expert parallelism: a mixture-of-experts layer split over the ranks, checked and counted.

    moe_train.run(moe_train.MoETrainConfig(n_experts=8, top_k=2), nproc=4)

Every rank holds the router and ``n_experts / world_size`` experts, routes its own batch of
real text, dispatches the token copies to the ranks holding their experts by all-to-all, runs
its experts, and combines the outputs back by the reverse all-to-all; then backward runs
through the same all-to-alls in reverse. The layer's input is what a MoE in place of the
course GPT's first MLP would see: ``ln_2(x + attn(ln_1(x)))`` with ``x`` the token and position
embeddings of the initialised GPT (``moe_inputs``).

Each rank also runs the single-process ``MoE`` (same weights) on the same tokens and reports
the largest differences of the output, the input gradient, its experts' gradients (summed over
every rank's tokens, as the single process sums them) and the router's gradient after an
all-reduce over ranks (the router is replicated, so its gradient is synchronised as data
parallelism would).

Config: :class:`MoETrainConfig`, every field optional (model: seq_len 32, 1 layer, 4 heads,
d_model 64).

Result per rank: the bytes each all-to-all sent, counted, beside the prediction for an even
router and the prediction from this rank's routing; token copies per expert (this rank's
routing) and received per local expert; the parity errors; the forward+backward wall time.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as torch_dist

from labkit import data, timing, validate
from labkit.config import ModelConfig
from labkit.jobs import runtime
from labkit.model import GPT
from labkit.parallel import expert
from labkit.workers.job_config import GPTJobConfig

if TYPE_CHECKING:
    from labkit.jobs import launch

DEFAULT_MODEL = {"seq_len": 32, "n_layer": 1, "n_head": 4, "d_model": 64}
IMPLS = ("ours", "torch")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoETrainConfig(GPTJobConfig):
    """A mixture-of-experts layer split over the ranks, checked against one process."""

    WORKER: ClassVar[str] = "labkit.workers.moe_train"
    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(**DEFAULT_MODEL))
    ON_CORPUS: ClassVar[bool] = False  # a layer's shape: the vocabulary is the model's own
    batch_size: int = 2
    """Sequences per rank."""
    n_experts: int = 8
    """Experts in the layer, split evenly over the ranks."""
    top_k: int = 2
    """Experts each token is routed to."""
    impl: str = "ours"
    """Which autograd all-to-all: "ours" or "torch"."""
    check_dispatch: bool = False
    """Also run ``expert.dispatch`` on tagged tokens (``dispatch_case``) and return what arrived
    and the gradients."""
    compare_torch: bool = False
    """Also run the step through torch's autograd all-to-all and report the differences."""
    save: bool = True
    """Write moe_rank{r}.pt with this rank's output and gradients."""

    def __post_init__(self) -> None:
        super().__post_init__()
        expert.validate_moe(self.n_experts, self.top_k)  # its messages name the fix
        validate.one_of("impl", self.impl, IMPLS)
        for name in ("check_dispatch", "compare_torch", "save"):
            validate.flag(name, getattr(self, name))


def run(config: MoETrainConfig, *, nproc: int = 2, **launch_options: Any) -> launch.JobResult:
    """Launch ``config`` on ``nproc`` ranks (refused first if they cannot split its experts);
    ``launch_options`` go to ``launch.run``."""
    from labkit.jobs import launch  # the caller's side: a rank never imports the launcher
    expert.validate_moe(config.n_experts, config.top_k, nproc)
    return launch.run(config, nproc=nproc, **launch_options)


@torch.no_grad()
def moe_inputs(
    cfg: ModelConfig, batch_size: int, world_size: int, seed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per rank: the MoE layer's input (B, T, C) from real text, and an upstream gradient.

    The input is ``ln_2(x + attn(ln_1(x)))`` of the initialised GPT's first block: what a MoE
    in place of that block's MLP receives. The single-process reference uses the same.
    """
    g = torch.Generator().manual_seed(seed)
    train = data.load_splits().train
    torch.manual_seed(seed)
    gpt = GPT(cfg).eval()
    block = gpt.blocks[0]
    xs, grads = [], []
    for _ in range(world_size):
        idx, _ = data.get_batch(train, batch_size, cfg.seq_len, g)
        x = gpt.wte(idx) + gpt.wpe(torch.arange(cfg.seq_len))
        x = x + block.attn(block.ln_1(x))
        xs.append(block.ln_2(x))
        grads.append(torch.randn(xs[-1].shape, generator=g))
    return xs, grads


def dispatch_case(rank: int, world_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens (5, 3), each row tagged with its rank and index, and their
    destinations: what the ``dispatch`` check sends (the test rebuilds it)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(5, 3, generator=g)
    x[:, 0] = 100 * rank + torch.arange(5)  # rank and index, readable in what arrives
    return x, torch.randint(0, world_size, (5,), generator=g)


def expected_dispatch(rank: int, world_size: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    """What ``rank`` must receive: every rank's tokens bound for it, by source rank, in order."""
    rows, counts = [], []
    for src in range(world_size):
        x, dest = dispatch_case(src, world_size, seed)
        rows.append(x[dest == rank])
        counts.append(int((dest == rank).sum()))
    return torch.cat(rows), counts


def _dispatch_check(ctx: runtime.Context, seed: int) -> dict[str, Any]:
    """``expert.dispatch`` on tagged tokens: what arrived, and the gradient that came back."""
    x, dest = dispatch_case(ctx.rank, ctx.world_size, seed)
    x = x.to(ctx.device).requires_grad_()
    with ctx.phase("dispatch check (all-to-all)"):
        received, recv_counts = expert.dispatch(x, dest.to(ctx.device))
        # Weight row i by i+1: each token's gradient says where it arrived.
        w = torch.arange(1, received.shape[0] + 1, device=ctx.device, dtype=x.dtype)
        (received.sum(dim=1) * w).sum().backward()
    return {
        "received": received.detach().cpu().tolist(),
        "recv_counts": recv_counts.cpu().tolist(),
        "grad": x.grad.cpu().tolist(),
    }


def reference_moe(cfg: ModelConfig, n_experts: int, top_k: int, seed: int) -> expert.MoE:
    """The single-process layer every rank copies its weights from."""
    torch.manual_seed(seed + 1)
    return expert.MoE(cfg, n_experts, top_k)


@runtime.entrypoint
def main(ctx: runtime.Context) -> dict[str, Any]:
    job = MoETrainConfig.from_dict(ctx.config)
    cfg = job.model
    E, k = job.n_experts, job.top_k
    expert.validate_moe(E, k, ctx.world_size)  # again here: the kernel checked before launch
    B, seed, impl = job.batch_size, job.seed, job.impl
    n, rank, dev = ctx.world_size, ctx.rank, ctx.device
    result: dict[str, Any] = {}
    if job.check_dispatch:
        result["dispatch"] = _dispatch_check(ctx, seed)
    xs, grads = moe_inputs(cfg, B, n, seed)
    ref = reference_moe(cfg, E, k, seed)
    counter = expert.AllToAllCounter()
    ep = expert.ExpertParallelMoE.from_moe(ref, cfg, counter=counter, impl=impl).to(dev)

    x = xs[rank].detach().clone().to(dev).requires_grad_()
    ctx.heartbeat(part="expert-parallel forward/backward")
    timing.synchronize(dev)
    t = time.perf_counter()
    with ctx.phase("dispatch and combine (all-to-all)"):
        y, routing = ep(x)
        (y * grads[rank].to(dev)).sum().backward()
        router_grad = ep.router.gate.weight.grad.clone()
        torch_dist.all_reduce(router_grad)  # the replicated router: summed as DP would
    timing.synchronize(dev)
    step_s = time.perf_counter() - t

    # The single-process layer on every rank's tokens (each batch on its own, as each rank
    # routed it), gradients summed over all of them.
    ref_out, ref_xgrad = None, None
    for r in range(n):
        xr = xs[r].detach().clone().requires_grad_()
        yr, _ = ref(xr)
        (yr * grads[r]).sum().backward()
        if r == rank:
            ref_out, ref_xgrad = yr.detach(), xr.grad
    first = rank * ep.local
    err = {
        "output": float((y.detach().cpu() - ref_out).abs().max()),
        "input_grad": float((x.grad.cpu() - ref_xgrad).abs().max()),
        "expert_grads": max(
            float((p.grad.cpu() - q.grad).abs().max())
            for j, e in enumerate(ep.experts)
            for p, q in zip(e.parameters(), ref.experts[first + j].parameters(), strict=True)
        ),
        "router_grad": float((router_grad.cpu() - ref.router.gate.weight.grad).abs().max()),
    }

    if job.compare_torch:  # the same step through torch's all-to-all
        torch_ep = expert.ExpertParallelMoE.from_moe(ref, cfg, impl="torch").to(dev)
        xt = xs[rank].detach().clone().to(dev).requires_grad_()
        with ctx.phase("dispatch and combine (torch's all-to-all)"):
            yt, _ = torch_ep(xt)
            (yt * grads[rank].to(dev)).sum().backward()
        result["torch_impl_max_abs"] = {
            "output": float((yt - y).abs().max()),
            "input_grad": float((xt.grad - x.grad).abs().max()),
            "expert_grads": max(
                float((p.grad - q.grad).abs().max())
                for a, b in zip(torch_ep.experts, ep.experts, strict=True)
                for p, q in zip(a.parameters(), b.parameters(), strict=True)
            ),
        }

    copies = expert.copies_per_rank(routing.experts, E, n)
    received = ep.last["received_rows"]
    counted = counter.by_label()
    result |= {
        "rank": rank,
        "world_size": n,
        "n_experts": E,
        "top_k": k,
        "tokens": x.shape[0] * x.shape[1],
        "d_model": cfg.d_model,
        "impl": impl,
        "tokens_per_expert": ep.last["tokens_per_expert"],
        "copies_per_rank": copies,
        "received_per_rank": received,
        "received_per_local_expert": ep.last["received_per_local_expert"],
        "predicted_uniform_sent": expert.alltoall_sent_bytes_uniform(
            sum(copies), cfg.d_model, n, x.element_size()
        ),
        "predicted_routed_sent": {
            "dispatch": expert.alltoall_sent_bytes(copies, rank, cfg.d_model, x.element_size()),
            "combine": expert.alltoall_sent_bytes(received, rank, cfg.d_model, x.element_size()),
        },
        "counted": counted,
        "parity_max_abs": err,
        "step_s": step_s,
    }
    if job.save and ctx.job_dir is not None:
        torch.save(
            {
                "output": y.detach().cpu(),
                "input_grad": x.grad.cpu(),
                "router_grad": router_grad.cpu(),
                "expert_grads": {
                    f"{first + j}.{name}": p.grad.cpu()
                    for j, e in enumerate(ep.experts)
                    for name, p in e.named_parameters()
                },
            },
            ctx.job_dir / f"moe_rank{rank}.pt",
        )
    d = counted.get("dispatch", {})
    print(
        f"rank {rank}: experts {first}..{first + ep.local - 1}; token copies to ranks {copies}, "
        f"received {received}; dispatch sent {d.get('sent_bytes', 0):,} B (counted); "
        f"max |out - single process| {err['output']:.1e}",
        flush=True,
    )
    return result


# --- what notebook 03c prints from a finished job ------------------------------------------------


@dataclass(frozen=True)
class MoEParity:
    """The largest |expert-parallel − single process| over the ranks, per quantity, against a
    tolerance: :func:`parity_report`."""

    max_abs: dict[str, float]  # quantity (output, input_grad, ...) -> the largest over the ranks
    tolerance: float

    @property
    def ok(self) -> bool:
        return all(v <= self.tolerance for v in self.max_abs.values())

    def describe(self) -> str:
        return (
            "largest |expert-parallel − single process| over the ranks (measured): "
            + ", ".join(f"{k} {v:.1e}" for k, v in self.max_abs.items())
            + f"\n→ the expert-parallel layer {'equals' if self.ok else 'DIFFERS from'} the "
            f"single-process layer (every difference {'≤' if self.ok else 'not all ≤'} "
            f"{self.tolerance:g})")


def parity_report(ranks: list[dict[str, Any]], tolerance: float = 1e-4) -> MoEParity:
    """Read every rank's ``parity_max_abs``; ``tolerance`` (fp32: the experts see their rows in
    another batch, the router sum in another order) decides whether the layers are equal."""
    keys = ranks[0]["parity_max_abs"]
    return MoEParity({k: max(r["parity_max_abs"][k] for r in ranks) for k in keys}, tolerance)


def section_summary(parity: MoEParity, report: expert.DispatchReport,
                    load: expert.ExpertLoad) -> str:  # fmt: skip
    """One sentence: what notebook 03c's expert-parallel section measured and whether each
    check held."""
    return ("measured in this section: the expert-parallel layer "
            + ("equals" if parity.ok else "DIFFERS from") + " the single-process one; the bytes "
            "each dispatch sent " + ("equal" if report.matches_routing else "DIFFER from")
            + " the routing's prediction on every rank"
            + ("" if None in report.extra else " (socket bytes against gloo's headers: above)")
            + f"; the untrained router's imbalance over experts, {load.imbalance:.2f} (E/k = "
            f"{expert.worst_imbalance(len(load.counts), load.top_k):.0f} at worst)")


if __name__ == "__main__":
    main()
