"""Expert parallelism: a mixture-of-experts layer split over the ranks, checked and counted.

    labkit.jobs.launch.run("labkit.workers.moe_train", nproc=4, config={"n_experts": 8, "top_k": 2})

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

Config (all optional): model (ModelConfig fields; default seq_len 32, 1 layer, 4 heads, d_model
64), batch_size (2 sequences per rank), n_experts (8), top_k (2), seed (0), impl ("ours" or
"torch": which autograd all-to-all), check_dispatch (false: also run ``expert.dispatch`` on
tagged tokens, ``dispatch_case``, and return what arrived and the gradients), compare_torch
(false: also run the step through torch's autograd all-to-all and report the differences),
save (true: write moe_rank{r}.pt with this rank's output
and gradients).

Result per rank: the bytes each all-to-all sent, counted, beside the prediction for an even
router and the prediction from this rank's routing; token copies per expert (this rank's
routing) and received per local expert; the parity errors; the forward+backward wall time.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as torch_dist

from labkit import data, timing
from labkit.config import ModelConfig
from labkit.jobs import runtime
from labkit.model import GPT
from labkit.parallel import expert

DEFAULT_MODEL = {"seq_len": 32, "n_layer": 1, "n_head": 4, "d_model": 64}


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
    conf = ctx.config
    cfg = ModelConfig(**{**DEFAULT_MODEL, **conf.get("model", {})})
    E, k = int(conf.get("n_experts", 8)), int(conf.get("top_k", 2))
    expert.validate_moe(E, k, ctx.world_size)  # again here: the kernel checked before launch
    B, seed = int(conf.get("batch_size", 2)), int(conf.get("seed", 0))
    impl = conf.get("impl", "ours")
    n, rank, dev = ctx.world_size, ctx.rank, ctx.device
    result: dict[str, Any] = {}
    if bool(conf.get("check_dispatch", False)):
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

    if bool(conf.get("compare_torch", False)):  # the same step through torch's all-to-all
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
    if bool(conf.get("save", True)) and ctx.job_dir is not None:
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


if __name__ == "__main__":
    main()
