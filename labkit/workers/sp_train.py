"""Sequence-parallel GPT (tensor × sequence parallelism on one group): ours and DTensor's,
against plain tensor parallelism.

    sp_train.run(sp_train.SPTrainConfig(steps=3), nproc=2)

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

Config: :class:`SPTrainConfig`, every field optional (model: seq_len 32, 2 layers, 4 heads,
d_model 64).

Result per rank: rank, world_size, device ("cpu" or "cuda"), and per part ("tp", "ours",
"ours_keep_gathered", "dtensor"): saved_bytes (measured), collectives (CommDebugMode, by
pass), counted (our counters' calls and message bytes), losses (trained parts), part_s (the
part's wall time on this rank).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from labkit import data, validate
from labkit.config import ModelConfig, TrainConfig
from labkit.jobs import runtime
from labkit.model import GPT
from labkit.parallel import comm, sequence, tensor
from labkit.train import make_optimizer
from labkit.workers.job_config import GPTTrainingConfig, some_of

if TYPE_CHECKING:
    from labkit.jobs import launch

DEFAULT_MODEL = {"seq_len": 32, "n_layer": 2, "n_head": 4, "d_model": 64}
PARTS = ("tp", "ours", "dtensor")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SPTrainConfig(GPTTrainingConfig):
    """Sequence-parallel GPT against plain tensor parallelism (parts: the module docstring)."""

    WORKER: ClassVar[str] = "labkit.workers.sp_train"
    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(**DEFAULT_MODEL))
    parts: tuple[str, ...] = PARTS
    """Which of PARTS to run."""
    train: bool = True
    """False: measure only, no AdamW steps and no parameter files (what notebook 03c's plan
    runs)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        some_of("parts", self.parts, PARTS)
        validate.flag("train", self.train)


def run(config: SPTrainConfig, *, nproc: int = 2, **launch_options: Any) -> launch.JobResult:
    """Launch ``config`` on ``nproc`` ranks; ``launch_options`` go to ``launch.run``."""
    from labkit.jobs import launch  # the caller's side: a rank never imports the launcher
    return launch.run(config, nproc=nproc, **launch_options)


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
    job = SPTrainConfig.from_dict(ctx.config)
    cfg = job.model
    sequence.validate_sequence_parallel(cfg, ctx.world_size)  # before any collective
    B, steps, seed = job.batch_size, job.steps, job.seed
    tcfg = job.train_config()
    parts, train = job.parts, job.train
    save = job.save and train and ctx.job_dir is not None
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


# --- what notebook 03c prints from a finished job ------------------------------------------------

# The parts a job measured, by the label the tables print, with the layout each was predicted as
# (DTensor's plan keeps the gathered input, as ours with regather=False does).
SHOWN = {"TP": ("tp", "tp"), "TP+SP, gathered kept": ("ours_keep_gathered", "sp_keep_gathered"),
         "TP+SP (ours)": ("ours", "sp"), "TP+SP (DTensor)": ("dtensor", "sp_keep_gathered")}
_MiB = 2**20


@dataclass(frozen=True)
class SavedActivations:
    """Bytes autograd saved per rank in one forward, measured on every rank, beside the
    prediction (``sequence.predicted_activations_per_rank``): :func:`saved_activations`."""

    device: str
    micro_batch: int
    seq_len: int
    predicted: dict[str, int]  # label -> bytes
    measured: dict[str, list[int]]  # label -> bytes on each rank

    def describe(self) -> str:
        """The table, then whether TP+SP (ours) saved less than TP, by how much, and how far the
        saving lies from the predicted one (rank 0's figures)."""
        t = len(next(iter(self.measured.values())))
        lines = [f"bytes autograd saved per rank in one forward (ranks on {self.device}):",
                 f"{'':22}{'predicted':>14}" + "".join(f"{f'measured rank {r}':>18}" for r in range(t))
                 + f"{'measured - predicted':>22}"]  # fmt: skip
        for label, predicted in self.predicted.items():
            measured = self.measured[label]
            gap = max(measured, key=lambda m: abs(m - predicted)) - predicted
            lines.append(f"{label:22}{predicted:>14,}" + "".join(f"{m:>18,}" for m in measured)
                         + f"{gap:>+22,}")
        tp_pred, tp_meas = self.predicted["TP"], self.measured["TP"][0]
        sp_pred, sp_meas = self.predicted["TP+SP (ours)"], self.measured["TP+SP (ours)"][0]
        saving_pred, saving_meas = tp_pred - sp_pred, tp_meas - sp_meas
        which = "smaller" if sp_meas < tp_meas else "not smaller"
        agree = ("equal to the prediction to the byte" if saving_meas == saving_pred else
                 f"{saving_meas - saving_pred:+,} B off the prediction "
                 f"({abs(saving_meas - saving_pred) / saving_pred:.2%})")
        lines += ["", f"measured: TP+SP's saved activations are {which} than TP's: {sp_meas:,} B "
                  f"against {tp_meas:,} B per rank, {saving_meas:,} B ({saving_meas / tp_meas:.0%}) "
                  f"saved, {agree} ({saving_pred:,} B)"]
        return "\n".join(lines)


def saved_activations(job: Any, cfg: ModelConfig, micro_batch: int) -> SavedActivations:
    """Read ``job`` (an :func:`run` result with every part) against the prediction for
    ``cfg`` at ``micro_batch`` on the job's ranks and device."""
    t, device = len(job.ranks), job.rank(0)["device"]
    predicted, measured = {}, {}
    for label, (part, mode) in SHOWN.items():
        predicted[label] = sum(sequence.predicted_activations_per_rank(
            cfg, micro_batch, t, mode=mode, device_type=device).values())
        measured[label] = [job.rank(r)[part]["saved_bytes"] for r in range(t)]
    return SavedActivations(device, micro_batch, cfg.seq_len, predicted, measured)


def plot_saved_activations(result: SavedActivations, ax: Any = None) -> Any:
    """Predicted beside measured (rank 0) saved activations per layout, in MiB. Returns the axes."""
    import matplotlib.pyplot as plt  # here, so that importing labkit stays light

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.4))
    labels = list(result.predicted)
    xs = range(len(labels))
    predicted = [result.predicted[k] / _MiB for k in labels]
    measured = [result.measured[k][0] / _MiB for k in labels]
    ax.bar([x - 0.2 for x in xs], predicted, 0.4, label="predicted")
    ax.bar([x + 0.2 for x in xs], measured, 0.4, label="measured (rank 0)")
    ax.set_xticks(list(xs), labels)
    ax.set_xlabel(f"layout ({len(result.measured['TP'])} ranks)")
    ax.set_ylabel("saved activations per rank (MiB)")
    ax.set_ylim(0, 1.3 * max(predicted + measured))
    ax.set_title(f"Activation memory per rank, t = {len(result.measured['TP'])}, "
                 f"b = {result.micro_batch}, s = {result.seq_len}")
    ax.legend(ncol=2, loc="upper right")
    return ax


@dataclass(frozen=True)
class CollectiveCounts:
    """One training step's collectives on rank 0 as our counters and CommDebugMode saw them:
    :func:`collective_counts`."""

    t: int
    device: str
    tp: dict[str, Any]  # rank 0's "tp" counted: forward/backward calls and bytes
    ours: dict[str, Any]  # rank 0's "ours" counted: calls and bytes by kind, the extras
    seen: dict[str, dict[str, int]]  # label -> CommDebugMode's calls by kind, both passes

    @property
    def tp_sent(self) -> float:
        """Bytes a rank sends for TP's all-reduces (ring)."""
        return comm.sent_per_rank("all_reduce", self.tp["forward_bytes"] + self.tp["backward_bytes"],
                                  self.t)  # fmt: skip

    @property
    def replacing_sent(self) -> float:
        """Bytes a rank sends for the all-gathers and reduce-scatters that stand where TP's
        all-reduces stood: everything but the re-gathers, the 2 gathers at the embedding and the
        head, and the parameter all-reduce."""
        extra = self.ours["extra_bytes"]
        replacing = {k: v for k, v in self.ours["bytes"].items() if not k.startswith("all_reduce")}
        replacing["all_gather forward"] -= extra["boundary"] // 2
        replacing["all_gather backward"] -= extra["regather"] + extra["boundary"] // 2
        return sequence.ring_sent_per_rank(replacing, self.t)

    @property
    def all_sent(self) -> float:
        """Bytes a rank sends for every collective of TP+SP, extras included."""
        return sequence.ring_sent_per_rank(self.ours["bytes"], self.t)

    def describe(self) -> str:
        tp, ours, t = self.tp, self.ours, self.t
        tp_message = tp["forward_bytes"] + tp["backward_bytes"]
        lines = ["counted on rank 0, one training step (S: message bytes; sent: bytes a rank "
                 "sends, ring):",
                 f"  TP   all_reduce      {tp['forward_calls'] + tp['backward_calls']:3} calls   "
                 f"S {tp_message / _MiB:7.3f} MiB   sent {self.tp_sent / _MiB:7.3f} MiB"]  # fmt: skip
        for key, calls in ours["calls"].items():
            b = ours["bytes"][key]
            sent = comm.sent_per_rank(key.split()[0], b, t)
            lines.append(f"  SP   {key:24}{calls:3} calls   S {b / _MiB:7.3f} MiB   sent "
                         f"{sent / _MiB:7.3f} MiB")
        lines.append("  of which beyond TP's: " + ", ".join(
            f"{name} {ours['extra_calls'][name]} calls, S {v / _MiB:.3f} MiB"
            for name, v in ours["extra_bytes"].items()))
        same = "the same as" if self.replacing_sent == self.tp_sent else "not the same as"
        lines += ["", f"counted: the reduce-scatters and all-gathers that replace TP's all-reduces "
                  f"send {self.replacing_sent / _MiB:.3f} MiB per rank, {same} TP's all-reduces "
                  f"({self.tp_sent / _MiB:.3f} MiB)",
                  f"counted: with the extras, TP+SP sends {self.all_sent / _MiB:.3f} MiB per rank "
                  f"per step, {self.all_sent / self.tp_sent:.2f}x TP's",
                  "", "CommDebugMode, one forward and backward on rank 0 (calls by kind, both "
                  "passes):"]
        lines += [f"  {label:22}" + ", ".join(f"{k} {v}" for k, v in kinds.items())
                  for label, kinds in self.seen.items()]
        if self.device == "cpu":
            lines += ["", "on this tier gloo carries the collectives: "
                      f"{comm.GLOO_EMULATED['reduce_scatter']}"]
        return "\n".join(lines)


def collective_counts(job: Any) -> CollectiveCounts:
    """Rank 0's counted collectives of ``job`` (an :func:`run` result with every part)."""
    r0 = job.rank(0)
    seen = {}
    for label, (part, _) in SHOWN.items():
        by_pass = r0[part]["collectives"]
        kinds = sorted({k for p in by_pass.values() for k in p})
        seen[label] = {k: sum(p.get(k, 0) for p in by_pass.values()) for k in kinds}
    return CollectiveCounts(len(job.ranks), r0["device"], r0["tp"]["counted"],
                            r0["ours"]["counted"], seen)  # fmt: skip


@dataclass(frozen=True)
class Parity:
    """How far the job's trained parts lie from one process trained the same way:
    :func:`parity_with_one_process`."""

    steps: int
    max_abs: dict[str, tuple[float, float, float]]  # label -> losses, first grads, final params

    def describe(self) -> str:
        return "\n".join(
            f"measured, TP+SP {label} against one process over {self.steps} steps: max |loss diff| "
            f"{d_loss:.1e}, first-step gradients {d_grad:.1e}, final parameters {d_param:.1e}"
            for label, (d_loss, d_grad, d_param) in self.max_abs.items())


def parity_with_one_process(job: Any, cfg: ModelConfig, micro_batch: int, steps: int, *,
                            seed: int = 0, lr: float = 3e-3,
                            weight_decay: float = 0.1) -> Parity:  # fmt: skip
    """Train ``cfg``'s GPT in this process on the job's batches (the same seed, clip 1.0 and
    AdamW) and compare losses, first-step gradients and final parameters with what the job's
    "ours" and "dtensor" parts saved (their .pt files in the job's folder)."""
    torch.manual_seed(seed)
    ref = GPT(cfg)
    opt = make_optimizer(ref, TrainConfig(micro_batch=micro_batch, lr=lr, weight_decay=weight_decay))
    losses, grads = [], {}
    for x, y in data.fixed_batches(cfg.seq_len, micro_batch, steps, seed):
        _, loss = ref(x, y)
        loss.backward()
        if not grads:
            grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params = dict(ref.named_parameters())
    out = {}
    for label, part in (("ours", "ours"), ("DTensor", "dtensor")):
        saved = torch.load(job.log_dir / f"sp_{part}_params.pt")
        d_loss = max(abs(a - b) for a, b in zip(job.rank(0)[part]["losses"], losses, strict=True))
        d_grad = max((saved["first_grads"][n] - g).abs().max().item() for n, g in grads.items())
        d_param = max((saved["params"][n] - p.detach()).abs().max().item()
                      for n, p in params.items())
        out[label] = (d_loss, d_grad, d_param)
    return Parity(steps, out)


# The layouts notebook 03c's plan chooses among, by mode, and the part of a job that measured each.
PLAN_PARTS = {"tp": "tp", "sp_keep_gathered": "ours_keep_gathered", "sp": "ours"}


def measured_layouts(job: Any, seq_len: int) -> dict[str, dict[str, Any]]:
    """What ``job`` measured per layout, in the form notebook 03c's plan receives it: mode ->
    seq_len (``seq_len``, the job's), sent_bytes (bytes a rank sent per step, counted on rank 0,
    ring formulas), saved_bytes (autograd's saved bytes, the larger rank)."""
    t, out = len(job.ranks), {}
    for mode, part in PLAN_PARTS.items():
        counted = job.rank(0)[part]["counted"]
        sent = (comm.sent_per_rank("all_reduce", counted["forward_bytes"] + counted["backward_bytes"], t)
                if mode == "tp" else sequence.ring_sent_per_rank(counted["bytes"], t))
        out[mode] = {"seq_len": seq_len, "sent_bytes": sent,
                     "saved_bytes": max(job.rank(r)[part]["saved_bytes"] for r in range(t))}
    return out


def describe_measured_layouts(measured: dict[str, dict[str, Any]], *, seq_len: int,
                              budget_bytes: float, micro_batch: int, t: int) -> str:  # fmt: skip
    """The question (``seq_len`` tokens in ``budget_bytes`` per rank) and what
    :func:`measured_layouts` holds, in MiB."""
    at = next(iter(measured.values()))["seq_len"]
    lines = [f"asked: {seq_len} tokens × {micro_batch} sequences on {t} ranks, "
             f"{budget_bytes / _MiB:g} MiB of saved activations per rank; measured at {at} tokens:"]
    lines += [f"  {mode:18} saved {m['saved_bytes'] / _MiB:7.2f} MiB per rank, sent "
              f"{m['sent_bytes'] / _MiB:6.2f} MiB per rank per step" for mode, m in measured.items()]
    return "\n".join(lines)


@dataclass(frozen=True)
class PlanCheck:
    """A plan's choice held against a job run at the planned length: :func:`check_plan`."""

    plan: str
    seq_len: int  # the planned length, the job's
    measured_at: int  # the length the plan's measurements were taken at
    budget_bytes: float
    saved: dict[str, int]  # mode -> saved bytes at seq_len (measured, the larger rank)
    grown: dict[str, float]  # mode -> the plan's measurement grown linearly to seq_len
    sent: dict[str, float]  # mode -> bytes a rank sent per step (from the plan's measurements)

    @property
    def fits(self) -> dict[str, bool]:
        return {mode: got <= self.budget_bytes for mode, got in self.saved.items()}

    def describe(self) -> str:
        lines = [f"saved activations per rank at {self.seq_len} tokens (measured, larger rank) "
                 "against the budget:"]
        lines += [f"  {mode:18} {got / _MiB:7.2f} MiB ({got - self.grown[mode]:+,.0f} B from the "
                  f"measurement at {self.measured_at} tokens grown linearly): "
                  f"{'fits' if self.fits[mode] else 'does not fit'}" for mode, got in self.saved.items()]
        fitting = [m for m, ok in self.fits.items() if ok]
        if self.plan == "cp":
            lines.append("measured: " + ("no layout of the 2 ranks fits, as planned: the sequence "
                                         "must be split over more ranks" if not fitting else
                                         f"'cp' was NOT needed: {fitting} fit"))
        else:
            cheaper = [m for m in fitting if self.sent[m] < self.sent[self.plan]]
            lines.append(f"measured: {self.plan!r} "
                         + ("fits" if self.fits[self.plan] else "does NOT fit") + "; "
                         + (f"{cheaper} fit too and send fewer bytes" if cheaper else
                            "no layout that sends fewer bytes fits"))
        return "\n".join(lines)


def check_plan(plan: str, job: Any, measured: dict[str, dict[str, Any]],
               budget_bytes: float) -> PlanCheck:  # fmt: skip
    """Hold ``plan`` (a mode, or "cp") against ``job``, a measure-only :func:`run` at the planned
    length (parts "tp" and "ours"), and ``measured`` (:func:`measured_layouts` at the old one)."""
    model = (job.config or {}).get("model") or {}
    if "seq_len" not in model:
        raise ValueError("job.config names no model seq_len: pass a job that sp_train.run started")
    t, seq_len = len(job.ranks), model["seq_len"]
    at = next(iter(measured.values()))["seq_len"]
    saved = {mode: max(job.rank(r)[part]["saved_bytes"] for r in range(t))
             for mode, part in PLAN_PARTS.items()}
    grown = {mode: measured[mode]["saved_bytes"] * seq_len / at for mode in PLAN_PARTS}
    return PlanCheck(plan, seq_len, at, budget_bytes, saved, grown,
                     {mode: m["sent_bytes"] for mode, m in measured.items()})


if __name__ == "__main__":
    main()
