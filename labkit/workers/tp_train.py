"""Tensor-parallel GPT: parallel linear layers checked, then k training steps, ours and DTensor's.

    labkit.jobs.launch.run("labkit.workers.tp_train", nproc=2, config={"steps": 3})

Three parts, each optional (``parts``):

    linear   a ColumnParallelLinear and a RowParallelLinear sliced from one nn.Linear: each
             rank saves its output and gradients (job dir, tp_linear_rank{r}.pt) for the
             test to compare with the whole layer
    gpt      the GPT made tensor-parallel by ``apply_tensor_parallel`` trains ``steps`` AdamW
             steps; the all-reduces of f and g are counted each step; the first step's
             gradients and the final parameters, gathered whole, go to tp_gpt_params.pt
             (rank 0)
    dtensor  the same through DTensor's parallelize_module; tp_dtensor_params.pt (rank 0)

In both ``gpt`` and ``dtensor`` the first step's forward and backward run under PyTorch's
CommDebugMode (``tensor.count_collectives``), which counts the collectives each
implementation issues by pass: the same counter for ours and DTensor's, so the two can be
compared call for call ("collectives" in the result).

Config (all optional): model (ModelConfig fields; default seq_len 32, 2 layers, 4 heads,
d_model 64), batch_size (4), steps (3), seed (0), lr (3e-3), weight_decay (0.1),
grad_clip (1.0; null for none), parts (all three), save (true: write the files above).

Result per rank: losses per step, all-reduce calls and bytes per step counted next to the
formula, the collectives CommDebugMode counted in the first step, parameter bytes on this
rank measured next to the formula, and the mean step time (steps after the first, which
warms up and runs under CommDebugMode; the first alone if there is one step).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from labkit import data, timing
from labkit.config import ModelConfig, RunConfig, TrainConfig
from labkit.jobs import runtime
from labkit.model import GPT
from labkit.parallel import tensor
from labkit.train import make_optimizer

DEFAULT_MODEL = {"seq_len": 32, "n_layer": 2, "n_head": 4, "d_model": 64}
LINEAR_SHAPE = (16, 24)  # in_features, out_features of the layer the linear part splits
LINEAR_INPUT = (3, 5, 16)  # (B, T, in_features)


def linear_case(seed: int) -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    """The whole layer, its input (B, T, in) and an upstream gradient (B, T, out)."""
    torch.manual_seed(seed)
    lin = torch.nn.Linear(*LINEAR_SHAPE)
    x = torch.randn(*LINEAR_INPUT)
    grad_out = torch.randn(*LINEAR_INPUT[:2], LINEAR_SHAPE[1])
    return lin, x, grad_out


def _linear_part(ctx: runtime.Context, seed: int) -> dict[str, torch.Tensor]:
    """This rank's outputs and gradients, on ``ctx.device``: f and g all-reduce there."""
    n, r, device = ctx.world_size, ctx.rank, ctx.device
    lin, x, grad_out = linear_case(seed)  # on the CPU, as the test's reference
    x, grad_out = x.to(device), grad_out.to(device)
    out_cols = slice(r * LINEAR_SHAPE[1] // n, (r + 1) * LINEAR_SHAPE[1] // n)
    in_cols = slice(r * LINEAR_SHAPE[0] // n, (r + 1) * LINEAR_SHAPE[0] // n)

    # Sliced from the CPU layer, then moved: the shards hold the whole layer's values.
    col = tensor.ColumnParallelLinear.from_linear(lin, world_size=n, rank=r).to(device)
    x_col = x.clone().requires_grad_()
    y_col = col(x_col)  # (B, T, out/n): this rank's output columns
    y_col.backward(grad_out[..., out_cols])  # f all-reduces: x_col.grad is the full gradient

    row = tensor.RowParallelLinear.from_linear(lin, world_size=n, rank=r).to(device)
    x_row = x[..., in_cols].clone().requires_grad_()  # a column-parallel layer's output shard
    y_row = row(x_row)  # (B, T, out): complete after g
    y_row.backward(grad_out)
    return {
        "col_out": y_col.detach(),
        "col_weight_grad": col.weight.grad,
        "col_bias_grad": col.bias.grad,
        "col_input_grad": x_col.grad,
        "row_out": y_row.detach(),
        "row_weight_grad": row.weight.grad,
        "row_bias_grad": row.bias.grad,
        "row_input_grad": x_row.grad,
    }


def _train(
    model: torch.nn.Module,
    batches: list,
    tcfg: TrainConfig,
    ctx: runtime.Context,
    counter: tensor.CommCounter | None,
    *,
    foreach: bool | None = None,
) -> dict[str, Any]:
    """k AdamW steps with the global-norm clip computed across shards.

    The first step's forward and backward are counted by CommDebugMode
    (``tensor.count_collectives``); that step is left out of the mean step time.
    """
    opt = make_optimizer(model, tcfg)
    if foreach is not None:  # DTensor and plain tensors cannot share one foreach kernel
        for group in opt.param_groups:
            group["foreach"] = foreach
    losses, comm, times = [], [], []
    first_grads: dict[str, torch.Tensor] = {}
    collectives: dict[str, dict[str, int]] = {}

    def now() -> float:
        # CUDA runs asynchronously: without the synchronise the clock would time the kernel
        # launches, not the step.
        timing.synchronize(ctx.device)
        return time.perf_counter()

    for i, (x, y) in enumerate(batches):
        if counter is not None:
            counter.reset()
        t = now()
        with ctx.phase("tensor-parallel step"), contextlib.ExitStack() as stack:
            # f and g are collectives; in the first step a dispatch mode counts them.
            if i == 0:
                collectives = stack.enter_context(tensor.count_collectives())
            _, loss = model(x.to(ctx.device), y.to(ctx.device))
            loss.backward()
        if i == 0:  # the test compares these; the gather's time is left out of the step
            t_gather = now()
            first_grads = tensor.full_state(model, grads=True)
            t += now() - t_gather
        with ctx.phase("tensor-parallel clip"):
            if tcfg.grad_clip is not None:
                tensor.clip_grad_norm_(model, tcfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(now() - t)
        losses.append(float(loss.detach()))
        if counter is not None:
            comm.append(counter.as_dict())
        ctx.heartbeat(step=i + 1, total=len(batches))
    timed = times[1:] or times  # the first step warms up and runs under CommDebugMode
    return {
        "losses": losses,
        "comm_per_step": comm,
        "collectives": collectives,
        "step_s": sum(timed) / len(timed),
        "first_grads": first_grads,
    }


def _fmt_counts(counts: dict[str, dict[str, int]]) -> str:
    """'all_reduce 4 forward + 4 backward', one entry per collective counted."""
    ops = sorted(set(counts.get("forward", {})) | set(counts.get("backward", {})))
    return (
        ", ".join(
            f"{op} {counts['forward'].get(op, 0)} forward + {counts['backward'].get(op, 0)} backward"
            for op in ops
        )
        or "no collectives"
    )


@runtime.entrypoint
def main(ctx: runtime.Context) -> dict[str, Any]:
    conf = ctx.config
    cfg = RunConfig(model=ModelConfig(**{**DEFAULT_MODEL, **conf.get("model", {})})).model
    tensor.validate_tensor_parallel(cfg, ctx.world_size)
    B, steps, seed = (
        int(conf.get("batch_size", 4)),
        int(conf.get("steps", 3)),
        int(conf.get("seed", 0)),
    )
    tcfg = TrainConfig(
        micro_batch=B,
        steps=steps,
        lr=float(conf.get("lr", 3e-3)),
        weight_decay=float(conf.get("weight_decay", 0.1)),
        grad_clip=conf.get("grad_clip", 1.0),
        seed=seed,
    )
    parts = list(conf.get("parts", ["linear", "gpt", "dtensor"]))
    save = bool(conf.get("save", True)) and ctx.job_dir is not None
    batches = data.fixed_batches(cfg.seq_len, B, steps, seed)
    result: dict[str, Any] = {"rank": ctx.rank, "tp": ctx.world_size}

    if "linear" in parts:
        out = _linear_part(ctx, seed)
        if save:  # on the CPU: the test compares them with a CPU reference
            out = {k: v.cpu() for k, v in out.items()}
            torch.save(out, ctx.job_dir / f"tp_linear_rank{ctx.rank}.pt")

    if "gpt" in parts:
        torch.manual_seed(seed)
        model = GPT(cfg).to(ctx.device)
        full_bytes = tensor.param_bytes_per_rank(model)
        counter = tensor.CommCounter()
        tensor.apply_tensor_parallel(
            model, world_size=ctx.world_size, rank=ctx.rank, counter=counter
        )
        run = _train(model, batches, tcfg, ctx, counter)
        first_grads = run.pop("first_grads")
        formula = tensor.tp_allreduce_bytes_per_step(cfg, B)
        result["gpt"] = {
            **run,
            "allreduce_formula": formula,
            "param_bytes": tensor.param_bytes_per_rank(model),
            "param_bytes_formula": 4 * tensor.tp_params_per_rank(cfg, ctx.world_size),
            "param_bytes_single_process": full_bytes,
        }
        state = tensor.full_state(model)
        if save and ctx.rank == 0:
            torch.save(
                {"params": state, "first_grads": first_grads}, ctx.job_dir / "tp_gpt_params.pt"
            )
        c = run["comm_per_step"][-1]
        ctx.print0(
            f"ours: losses {[round(v, 4) for v in run['losses']]}; all-reduces/step "
            f"{c['forward_calls']}+{c['backward_calls']} (formula {formula['calls']}); "
            f"CommDebugMode {_fmt_counts(run['collectives'])}"
        )

    if "dtensor" in parts:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        torch.manual_seed(seed)
        model = tensor.apply_dtensor_parallel(GPT(cfg).to(ctx.device), mesh)
        run = _train(model, batches, tcfg, ctx, None, foreach=False)
        first_grads = run.pop("first_grads")
        result["dtensor"] = {**run, "param_bytes": tensor.param_bytes_per_rank(model)}
        state = tensor.full_state(model)
        if save and ctx.rank == 0:
            torch.save(
                {"params": state, "first_grads": first_grads}, ctx.job_dir / "tp_dtensor_params.pt"
            )
        ctx.print0(
            f"DTensor: losses {[round(v, 4) for v in run['losses']]}; "
            f"CommDebugMode {_fmt_counts(run['collectives'])}"
        )
    return result


if __name__ == "__main__":
    main()
