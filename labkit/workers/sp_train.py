"""Sequence-parallel GPT (tensor × sequence parallelism on one group): ours and DTensor's,
against plain tensor parallelism.

    labkit.jobs.launch.run("labkit.workers.sp_train", nproc=2, config={"steps": 3})

Parts, each optional (``parts``):

    tp       the GPT under plain tensor parallelism (``tensor.apply_tensor_parallel``): bytes
             autograd saves on this rank in one forward, and the collectives one step issues
    ours     ``sequence.apply_sequence_parallel`` (the re-gathering layout): the same
             measurements, then ``steps`` AdamW steps (losses; first-step gradients and final
             parameters gathered whole into sp_ours_params.pt, rank 0); the same model with
             ``regather=False`` measured too ("ours_keep_gathered")
    dtensor  ``sequence.apply_dtensor_sequence_parallel``: the same as ``ours``
             (sp_dtensor_params.pt)

Collectives are counted two ways in one forward and backward: PyTorch's CommDebugMode
(``tensor.count_collectives``: calls per kind and pass, ours and DTensor's alike) and, for
ours, the module's own counter (message bytes per kind, re-gathers and boundary gathers apart).

Config (all optional): model (ModelConfig fields; default seq_len 32, 2 layers, 4 heads,
d_model 64), batch_size (4), steps (3), seed (0), lr (3e-3), weight_decay (0.1), grad_clip
(1.0; null for none), parts (all three), save (true: write the files above), train (true;
false: measure only, no AdamW steps and no parameter files: what notebook 03c's plan runs).

Result per rank: rank, world_size, device ("cpu" or "cuda"), and per part ("tp", "ours",
"ours_keep_gathered", "dtensor"): saved_bytes (measured), collectives (CommDebugMode, by
pass), counted (our counters' calls and message bytes), losses (trained parts), part_s (the
part's wall time on this rank).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from labkit import data
from labkit.config import ModelConfig, RunConfig, TrainConfig
from labkit.jobs import runtime
from labkit.model import GPT
from labkit.parallel import sequence, tensor
from labkit.train import make_optimizer

DEFAULT_MODEL = {"seq_len": 32, "n_layer": 2, "n_head": 4, "d_model": 64}


def _step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, sync: Any) -> torch.Tensor:
    _, loss = model(x, y)
    loss.backward()
    if sync is not None:
        sync()
    return loss


def _measure(model: torch.nn.Module, batch: tuple, ctx: runtime.Context, sync: Any,
             counter: Any = None) -> dict[str, Any]:  # fmt: skip
    """Saved bytes in one forward; the collectives of one forward and backward (gradients
    cleared afterwards: the model is left as it was)."""
    x, y = (t.to(ctx.device) for t in batch)
    with ctx.phase("saved activations"):
        saved = sequence.saved_activation_bytes(model, (x, y))
    if counter is not None:
        counter.reset()
    with ctx.phase("counted step"), tensor.count_collectives() as counts:
        _step(model, x, y, sync)
    model.zero_grad(set_to_none=True)
    out = {"saved_bytes": saved, "collectives": counts}
    if counter is not None:
        out["counted"] = counter.as_dict()
    return out


def _train(model: torch.nn.Module, batches: list, tcfg: TrainConfig, ctx: runtime.Context,
           sync: Any, *, foreach: bool | None = None) -> dict[str, Any]:  # fmt: skip
    opt = make_optimizer(model, tcfg)
    if foreach is not None:  # DTensor and plain tensors cannot share one foreach kernel
        for group in opt.param_groups:
            group["foreach"] = foreach
    losses, first_grads = [], {}
    for i, (x, y) in enumerate(batches):
        with ctx.phase("sequence-parallel step"):
            loss = _step(model, x.to(ctx.device), y.to(ctx.device), sync)
        if i == 0:
            first_grads = tensor.full_state(model, grads=True)
        if tcfg.grad_clip is not None:
            tensor.clip_grad_norm_(model, tcfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        ctx.heartbeat(step=i + 1, total=len(batches))
    return {"losses": losses, "first_grads": first_grads}


def _line(label: str, out: dict[str, Any]) -> str:
    """One line per part for the live output: saved bytes, collectives, losses."""
    counts = out["collectives"]
    kinds = sorted({k for p in counts.values() for k in p})
    coll = ", ".join(f"{k} {sum(p.get(k, 0) for p in counts.values())}" for k in kinds)
    losses = f"; losses {[round(v, 4) for v in out['losses']]}" if "losses" in out else ""
    return (f"{label}: autograd saved {out['saved_bytes']:,} B on rank 0 in one forward; "
            f"collectives in one step: {coll}{losses}")  # fmt: skip


@runtime.entrypoint
def main(ctx: runtime.Context) -> dict[str, Any]:
    conf = ctx.config
    cfg = RunConfig(model=ModelConfig(**{**DEFAULT_MODEL, **conf.get("model", {})})).model
    sequence.validate_sequence_parallel(cfg, ctx.world_size)  # before any collective
    B, steps, seed = (
        int(conf.get("batch_size", 4)),
        int(conf.get("steps", 3)),
        int(conf.get("seed", 0)),
    )
    tcfg = TrainConfig(micro_batch=B, steps=steps, lr=float(conf.get("lr", 3e-3)),
                       weight_decay=float(conf.get("weight_decay", 0.1)),
                       grad_clip=conf.get("grad_clip", 1.0), seed=seed)  # fmt: skip
    parts = list(conf.get("parts", ["tp", "ours", "dtensor"]))
    train = bool(conf.get("train", True))
    save = bool(conf.get("save", True)) and train and ctx.job_dir is not None
    batches = data.fixed_batches(cfg.seq_len, B, steps, seed)
    n, r = ctx.world_size, ctx.rank
    result: dict[str, Any] = {"rank": r, "world_size": n, "device": ctx.device.type}
    torch.manual_seed(seed)
    base = GPT(cfg).to(ctx.device)  # every part starts from these weights

    t0 = time.perf_counter()
    if "tp" in parts:
        counter = tensor.CommCounter()
        model = tensor.apply_tensor_parallel(copy.deepcopy(base), world_size=n, rank=r,
                                             counter=counter)  # fmt: skip
        out = _measure(model, batches[0], ctx, None, counter)  # counter: f and g's all-reduces
        result["tp"] = out
        result["tp"]["part_s"], t0 = time.perf_counter() - t0, time.perf_counter()
        ctx.print0(_line("TP", out))

    if "ours" in parts:
        for name, regather in (("ours_keep_gathered", False), ("ours", True)):
            counter = sequence.SeqCommCounter()
            model = sequence.apply_sequence_parallel(copy.deepcopy(base), world_size=n, rank=r,
                                                     counter=counter, regather=regather)  # fmt: skip

            def sync(model: torch.nn.Module = model, counter: Any = counter) -> None:
                sequence.sync_sequence_parallel_grads(model, counter=counter)

            out = _measure(model, batches[0], ctx, sync, counter)
            if regather and train:
                run = _train(model, batches, tcfg, ctx, sync)
                out["losses"] = run["losses"]
                state = tensor.full_state(model)
                if save and r == 0:
                    torch.save({"params": state, "first_grads": run["first_grads"]},
                               ctx.job_dir / "sp_ours_params.pt")  # fmt: skip
            result[name] = out
            out["part_s"], t0 = time.perf_counter() - t0, time.perf_counter()
            label = "TP+SP ours" + ("" if regather else ", gathered input kept")
            ctx.print0(_line(label, out))

    if "dtensor" in parts:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(ctx.device.type, (n,))
        model = sequence.apply_dtensor_sequence_parallel(copy.deepcopy(base), mesh)

        def sync_dtensor(model: torch.nn.Module = model) -> None:
            sequence.replicate_partial_grads(model)

        out = _measure(model, batches[0], ctx, sync_dtensor)
        if train:
            run = _train(model, batches, tcfg, ctx, sync_dtensor, foreach=False)
            out["losses"] = run["losses"]
            state = tensor.full_state(model)
            if save and r == 0:
                torch.save({"params": state, "first_grads": run["first_grads"]},
                           ctx.job_dir / "sp_dtensor_params.pt")  # fmt: skip
        result["dtensor"] = out
        out["part_s"] = time.perf_counter() - t0
        ctx.print0(_line("TP+SP DTensor", out))
    return result


if __name__ == "__main__":
    main()
