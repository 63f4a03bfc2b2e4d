"""Tensor-parallel GPT: parallel linear layers checked, then k training steps, ours and DTensor's.

    tp_train.run(tp_train.TPTrainConfig(steps=3), nproc=2)

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

Config: :class:`TPTrainConfig`, every field optional (model: seq_len 32, 2 layers, 4 heads,
d_model 64).

Result per rank: losses per step, all-reduce calls and bytes per step counted next to the
formula, the collectives CommDebugMode counted in the first step, parameter bytes on this
rank measured next to the formula, and the mean step time (steps after the first, which
warms up and runs under CommDebugMode; the first alone if there is one step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from labkit import data, timing
from labkit.config import ModelConfig, TrainConfig
from labkit.jobs import runtime
from labkit.model import GPT
from labkit.parallel import tensor
from labkit.train import make_optimizer
from labkit.workers.job_config import GPTTrainingConfig, some_of

if TYPE_CHECKING:
    from labkit.jobs import launch

DEFAULT_MODEL = {"seq_len": 32, "n_layer": 2, "n_head": 4, "d_model": 64}
PARTS = ("linear", "gpt", "dtensor")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TPTrainConfig(GPTTrainingConfig):
    """Tensor-parallel layers and GPT (the module docstring says what each part does)."""

    WORKER: ClassVar[str] = "labkit.workers.tp_train"
    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(**DEFAULT_MODEL))
    parts: tuple[str, ...] = PARTS
    """Which of PARTS to run."""

    def __post_init__(self) -> None:
        super().__post_init__()
        some_of("parts", self.parts, PARTS)


def run(config: TPTrainConfig, *, nproc: int = 2, **launch_options: Any) -> launch.JobResult:
    """Launch ``config`` on ``nproc`` ranks; ``launch_options`` go to ``launch.run``."""
    from labkit.jobs import launch  # the caller's side: a rank never imports the launcher
    return launch.run(config, nproc=nproc, **launch_options)
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
    job = TPTrainConfig.from_dict(ctx.config)
    cfg = job.model
    tensor.validate_tensor_parallel(cfg, ctx.world_size)
    B, steps, seed = job.batch_size, job.steps, job.seed
    tcfg = job.train_config()
    parts = job.parts
    save = job.save and ctx.job_dir is not None
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


# --- what notebook 03 shows of a finished job -------------------------------------------------
#
# Read in the notebook's kernel, never on a rank: each result holds what the job returned and
# the figures the notebook prints (``describe()``).


def _collective_line(counts: dict[str, dict[str, int]]) -> str:
    """'all_reduce 4 forward + 4 backward; ...', one entry per collective CommDebugMode counted."""
    ops = sorted(set(counts["forward"]) | set(counts["backward"]))
    return "; ".join(f"{op} {counts['forward'].get(op, 0)} forward + "
                     f"{counts['backward'].get(op, 0)} backward" for op in ops)


@dataclasses.dataclass(frozen=True)
class TPRun:
    """Our tensor-parallel GPT and DTensor's, from one ``parts=("gpt", "dtensor")`` job: losses,
    parameter bytes and all-reduces measured against the prediction (``tensor.predict_tp``),
    the collectives CommDebugMode counted for both, and their step times."""

    ours: dict[str, Any]
    dtensor: dict[str, Any]
    predicted: tensor.TPPrediction
    device: str = "cpu"
    backend: str = "gloo"

    @classmethod
    def from_job(cls, job: Any, predicted: tensor.TPPrediction) -> TPRun:
        result = job.rank(0)
        return cls(result["gpt"], result["dtensor"], predicted, job.device, job.backend)

    @property
    def comm(self) -> dict[str, int]:
        """The all-reduces f and g counted in our last step: calls and bytes, by pass."""
        return self.ours["comm_per_step"][-1]

    @property
    def collectives(self) -> dict[str, dict[str, dict[str, int]]]:
        """{"ours", "DTensor"}: the collectives CommDebugMode counted in the first step."""
        return {"ours": self.ours["collectives"], "DTensor": self.dtensor["collectives"]}

    @property
    def loss_gap(self) -> float:
        """The largest difference between our losses and DTensor's, step by step."""
        return max(abs(a - b) for a, b in
                   zip(self.ours["losses"], self.dtensor["losses"], strict=True))

    def check(self) -> None:
        """Raise AssertionError unless the counts equal the prediction, the collectives match
        call for call and the losses agree (to rounding: 1e-5 on CPU, 1e-3 on a GPU)."""
        comm, predicted = self.comm, self.predicted
        assert self.ours["param_bytes"] == 4 * predicted.params_per_rank, (
            "parameters per rank = the formula")
        assert comm["forward_calls"] + comm["backward_calls"] == predicted.calls
        assert comm["forward_bytes"] + comm["backward_bytes"] == predicted.message_bytes
        assert self.collectives["ours"] == self.collectives["DTensor"], (
            "compare the plan with section 5's table")
        assert self.loss_gap < (1e-5 if self.device == "cpu" else 1e-3), "same split, same sums"

    def describe(self) -> str:
        ours, dtensor, comm, predicted = self.ours, self.dtensor, self.comm, self.predicted
        return "\n".join([
            f"losses, ours:    {[round(v, 4) for v in ours['losses']]}",
            f"losses, DTensor: {[round(v, 4) for v in dtensor['losses']]}",
            f"measured: {ours['param_bytes'] / 2**20:.2f} MiB of parameters per rank (ours), "
            f"{dtensor['param_bytes'] / 2**20:.2f} MiB (DTensor), "
            f"{ours['param_bytes_single_process'] / 2**20:.2f} MiB on one device; "
            f"predicted {4 * predicted.params_per_rank / 2**20:.2f} MiB",
            f"counted:  {comm['forward_calls']} all-reduces forward + {comm['backward_calls']} "
            f"backward, {(comm['forward_bytes'] + comm['backward_bytes']) / 2**20:.2f} MiB per "
            f"step; predicted {predicted.calls} and {predicted.message_bytes / 2**20:.2f} MiB",
            *(f"CommDebugMode, first step ({who}): {_collective_line(c)}"
              for who, c in self.collectives.items()),
            "-> the same collectives, call for call"
            + (" (checked)" if self.collectives["ours"] == self.collectives["DTensor"]
               else ": NOT the same"),
            f"measured: ours and DTensor's losses differ by at most {self.loss_gap:.1e}",
            f"measured: {ours['step_s'] * 1e3:.1f} ms per step (ours), "
            f"{dtensor['step_s'] * 1e3:.1f} ms (DTensor), on {self.backend}/{self.device}",
        ])


@dataclasses.dataclass(frozen=True)
class TPCommCost:
    """The all-reduces of a tensor-parallel step, timed here: one all-reduce of a (b, s, h)
    activation measured (``labkit.workers.allreduce``) times the calls counted, held against a
    measured step (``verdict.share``)."""

    allreduce_s: float
    """Median time of one all-reduce."""
    busbw_GBps: float
    backend: str
    bytes_per_call: int
    calls: int
    step_s: float
    """A measured tensor-parallel step of ours."""

    @classmethod
    def from_job(cls, job: Any, run: TPRun) -> TPCommCost:
        """From a finished ``allreduce`` job of one call's message and the TP run it prices."""
        r0 = job.rank(0)
        return cls(r0["median_s"], r0["busbw_GBps"], job.backend,
                   run.predicted.bytes_per_call, run.predicted.calls, run.ours["step_s"])

    @property
    def comm_s(self) -> float:
        """The all-reduces of one step: measured all-reduce time × counted calls."""
        return self.calls * self.allreduce_s

    def describe(self) -> str:
        from labkit import verdict

        # Measured in two separate jobs, at two moments of a shared machine: a share above
        # 100% says that, not that communication outlasted the step that contains it.
        share = verdict.share(self.comm_s, self.step_s,
                              part_name="the tensor-parallel all-reduces' time",
                              whole_name="a measured step of ours",
                              fmt=lambda s: f"{s * 1e3:.1f} ms",
                              if_over="the all-reduce was timed at a busier moment than the steps")
        return "\n".join([
            f"measured here: one all-reduce of {self.bytes_per_call / 2**10:.0f} KiB takes "
            f"{self.allreduce_s * 1e3:.2f} ms over {self.backend} (busbw "
            f"{self.busbw_GBps:.2f} GB/s)",
            f"so the {self.calls} all-reduces of a tensor-parallel step cost about "
            f"{self.comm_s * 1e3:.1f} ms (measured all-reduce time × counted calls)",
            str(share),
        ])


def describe_closing(run: TPRun) -> str:
    """Notebook 03's closing note for tensor parallelism: the collectives CommDebugMode counted,
    and the all-reduces and bytes per step counted against the formula."""
    comm, predicted = run.comm, run.predicted
    lines = [f"CommDebugMode ({who}): {c['forward']} forward, {c['backward']} backward"
             for who, c in run.collectives.items()]
    lines.append(f"tensor parallel: {comm['forward_calls'] + comm['backward_calls']} all-reduces "
                 f"and {(comm['forward_bytes'] + comm['backward_bytes']):,} bytes per step "
                 f"counted; formula {predicted.calls} and {predicted.message_bytes:,}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
