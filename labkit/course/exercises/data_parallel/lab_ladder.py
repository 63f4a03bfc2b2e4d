"""Notebook 02's lab, sections 2 to 4: the strategies of the ladder side by side.

What each strategy of the ladder (naive, bucketed, DDP, ZeRO-1, FSDP2) did in the same job:
its losses and step times, the bytes it sent per rank per step, and the model states it held
per rank, each against its formula. Separate from :mod:`.lab_comm` because these tables read
one job (the ladder's ``runs``) and compare strategies with each other, while that module reads
the collective, scaling and compression jobs. :mod:`.lab` re-exports every name here.

- :func:`ladder`: section 2's table: loss, step time, messages and bytes per strategy;
- :func:`bytes_per_step`: bytes per rank per step: predicted, counted, on the wire (loopback);
- :func:`memory_per_rank`: model states per rank, measured against ZeRO's formula;
- :func:`reshard_probe`: FSDP2 with and without resharding after forward, one micro-batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from labkit import formulas, verdict

LADDER = ("naive", "bucketed", "ddp", "zero1", "fsdp2")
"""Section 2's strategies, in the order the table shows them."""

MIB = 2**20


def step_times_s(run: Mapping[str, Any]) -> list[float]:
    """Step times, the first left out (warm-up; DDP rebuilds its buckets there)."""
    return run["step_s"][1:] or run["step_s"]



# ------------------------------------------------------------------- section 2: the ladder


@dataclass(frozen=True)
class Ladder:
    """Section 2's table: each strategy's losses, step times, messages and bytes."""

    runs: Mapping[str, Any]
    names: tuple[str, ...]
    dtype: str
    device: str

    @property
    def spread(self) -> float:
        """The largest gap between a strategy's loss and DDP's, at any step."""
        return max(abs(a - b) for n in self.names
                   for a, b in zip(self.runs[n]["loss"], self.runs["ddp"]["loss"], strict=True))

    @property
    def tolerance(self) -> float | None:
        """How close the exact strategies' losses must stay (None: not checked). On CUDA the
        strategies sum in different orders (DDP divides before its all-reduce, FSDP2 reduces
        with ReduceOp.AVG, NCCL picks ring or tree by message size) and fp32 attention backward
        is not deterministic, so rounding differences (~1e-7 relative) grow over the steps;
        AdamW even turns the rounding noise of a zero gradient (the attention key biases) into
        full-size steps. bf16-compressed gradients round 2^16 times more coarsely, and
        tests/test_dp_parity.py holds their loss within 1e-2 of fp32 DDP's; a strategy on the
        wrong data or with unaveraged gradients drifts further."""
        if self.dtype != "float32":
            return None
        return 1e-4 if self.device == "cpu" else 1e-2

    def describe(self) -> str:
        runs = self.runs
        lines = [f"{'strategy':<13}{'loss first -> last':>20}"
                 f"{'step ms: median (middle half)':>31}{'calls':>7}"
                 f"{'sent/rank/step (counted)':>27}{'(predicted)':>13}"]
        for name in self.names:
            run = runs[name]
            calls = sum(v["calls"] for v in run["bytes"]["last_step"].values())
            pred = run["bytes_predicted_sent_per_rank"]
            s = verdict.summarize(step_times_s(run))
            step_ms = f"{s.median * 1e3:.1f} ({s.q1 * 1e3:.0f}–{s.q3 * 1e3:.0f})"
            lines.append(f"{name:<13}{run['loss'][0]:>9.4f} -> {run['loss'][-1]:<7.4f}"
                         f"{step_ms:>30}{'*' if run['timed_with_spy'] else ' '}"
                         f"{calls:>7}"
                         f"{run['bytes']['sent_per_rank_last_step'] / MIB:>22.3f} MiB"
                         + (f"{pred / MIB:>9.3f} MiB" if pred is not None
                            else f"{'no formula':>13}"))
        lines.append(f"(step times over {len(step_times_s(runs['ddp']))} steps per strategy, "
                     "the first left out; the middle half of them lies in the brackets)")
        if any(runs[name]["timed_with_spy"] for name in self.names):
            lines.append("* timed with the interceptor that counts FSDP2's collectives "
                         "(CollectiveSpy) running: it slows every operator, so this step time "
                         "overstates FSDP2's own")
        lines.append(f"\nmeasured: the five exact strategies' losses differ by at most "
                     f"{self.spread:.1e} at any step")
        if self.dtype == "float32" and self.device != "cpu":
            lines.append("on GPUs the orders of summation differ and fp32 attention backward "
                         "is not deterministic: checked against 1e-2, not the CPU's 1e-4")
        return "\n".join(lines)


def ladder(runs: Mapping[str, Any], dtype: str, device: str,
           names: Sequence[str] = LADDER) -> Ladder:
    """Section 2's table of the ladder's ``runs`` (rank 0's ``runs`` of a dp_train job),
    checked: every exact strategy must train like the others (:attr:`Ladder.tolerance`)."""
    result = Ladder(runs, tuple(names), dtype, device)
    if result.tolerance is not None:
        assert result.spread < result.tolerance, "every exact strategy must train like the others"
    return result


# ------------------------------------------------------------ bytes per rank per step


def _wire_per_rank(run: Mapping[str, Any], nproc: int) -> float:
    # The quietest step after the first (other traffic only adds), less the quietest empty
    # window (the barriers), shared by the ranks.
    w = run["wire"]
    quiet = min(w["bytes_per_step"][1:] or w["bytes_per_step"])
    return (quiet - min(w["baseline_per_step"])) / nproc


@dataclass(frozen=True)
class BytesPerStep:
    """Bytes per rank per optimizer step, per strategy: the ring formula's, those counted
    in the messages handed to the backend, gloo's own prediction (its reduce-scatter is a full
    all-reduce) and, where loopback counters exist, what the wire carried."""

    names: tuple[str, ...]
    predicted: tuple[float, ...]
    counted: tuple[float, ...]
    gloo: tuple[float, ...]
    wire: tuple[float, ...] | None
    fsdp_ratio: float  # FSDP2's counted bytes over DDP's
    fsdp_upper: float  # at most this, if the root were gathered twice too
    gather_bytes: int
    grad_accum: int
    nproc: int
    device: str
    ddp_message_bytes: float  # DDP's all-reduced message bytes in the last step
    all_grad_bytes: float  # every trainable gradient once, fp32
    naive_calls: int
    notes: tuple[str, ...]

    def _i(self, name: str) -> int:
        return self.names.index(name)

    def describe(self) -> str:
        lines = [f"counted: FSDP2 sent {self.fsdp_ratio:.2f}x DDP's bytes per step "
                 f"({self.grad_accum} micro-batches, {self.gather_bytes}-byte gathers; at most "
                 f"{self.fsdp_upper:.2f}x if the root were gathered twice too)"]
        wire, gloo, pred = self.wire, self.gloo, self.predicted
        lines.append(f"{'strategy':<10}{'predicted':>11}{'counted':>11}"
                     + (f"{'gloo pred.':>12}{'wire':>11}{'wire/pred':>11}{'wire/gloo':>11}"
                        if wire else "")
                     + "   (KiB per rank per step)")
        for i, name in enumerate(self.names):
            row = f"{name:<10}{pred[i] / 2**10:>11.1f}{self.counted[i] / 2**10:>11.1f}"
            if wire:
                row += (f"{gloo[i] / 2**10:>12.1f}{wire[i] / 2**10:>11.1f}"
                        f"{wire[i] / pred[i]:>11.3f}{wire[i] / gloo[i]:>11.3f}")
            lines.append(row)
        lines.append(f"counted: DDP all-reduced {self.ddp_message_bytes / MIB:.3f} MiB of "
                     f"messages per step ({self.grad_accum} micro-batches each); all gradients "
                     f"once = {self.all_grad_bytes / MIB:.3f} MiB")
        if wire:
            ratio = {n: wb / gb for n, wb, gb in zip(self.names, wire, gloo, strict=True)}
            lines.append(f"measured: the wire carried {ratio['ddp']:.3f}x DDP's message and "
                         f"{ratio['naive']:.3f}x naive's ({self.naive_calls} messages per step)")
            z = self._i("zero1")
            z_gloo, z_ring = wire[z] / gloo[z], wire[z] / pred[z]
            if abs(z_gloo - 1) < abs(z_ring - 1):
                lines.append(f"measured: ZeRO-1's wire is {z_ring:.2f}x the ring formula and "
                             f"{z_gloo:.3f}x the gloo prediction: its reduce-scatter went out "
                             "as a full all-reduce")
            else:
                lines.append(f"measured: ZeRO-1's wire is {z_ring:.3f}x the ring formula: this "
                             "gloo sent a real reduce-scatter")
            for name in self.names:
                # naive's many small messages carry more protocol per byte; the others: headers
                if name != "naive" and ratio[name] > 1.1:  # else something used lo every window
                    lines.append(f"note: {name}'s quietest step carried {ratio[name] - 1:.0%} "
                                 "more than predicted for gloo: other traffic on lo during its "
                                 "steps (this kernel's output, other programs) adds bytes, and "
                                 "the counters cannot tell it apart")
        elif self.device == "cuda":
            lines.append(
                "On GPUs NCCL moves these bytes over NVLink or PCIe, which no network interface "
                "counts, so here the bytes are counted, not measured. NVML has counters that "
                "could: NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX (cumulative NVLink data, read "
                "with nvmlDeviceGetFieldValues: "
                "https://docs.nvidia.com/deploy/nvml-api/group__nvmlFieldValueEnums.html) and "
                "nvmlDeviceGetPcieThroughput (PCIe bytes over a 20 ms sample: "
                "https://docs.nvidia.com/deploy/nvml-api/group__nvmlDeviceQueries.html). Both "
                "count everything on the link, not one job's messages.")
        else:
            lines.append("no loopback counters here, so the bytes are counted, not measured")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def got(self, name: str) -> str:
        """What the summary says a strategy sent: on the wire where measured, else counted."""
        i = self._i(name)
        return (f"measured on the wire {self.wire[i] / MIB:.3f} MiB" if self.wire
                else f"counted {self.counted[i] / MIB:.3f} MiB")


def bytes_per_step(runs: Mapping[str, Any], *, nproc: int, n_trainable: int, dtype: str,
                   grad_accum: int, device: str, uneven: Sequence[int] = (),
                   names: Sequence[str] = LADDER) -> BytesPerStep:
    """Bytes per rank per step of the ladder's ``runs``, checked: on the CPU tier with an
    even split each strategy asks for exactly the formula's messages, and FSDP2's gathers
    repeat per micro-batch, the root's once."""
    names = tuple(names)
    predicted = tuple(runs[n]["bytes_predicted_sent_per_rank"] for n in names)
    counted = tuple(runs[n]["bytes"]["sent_per_rank_last_step"] for n in names)
    if device == "cpu" and not uneven:
        assert counted == predicted, "each strategy asks for the formula's messages"
    gather_bytes = 2 if dtype == "bfloat16" else 4  # FSDP2's bf16 policy follows the dtype
    fsdp_ratio = counted[names.index("fsdp2")] / counted[names.index("ddp")]
    upper = (2 * grad_accum * gather_bytes + 4) / 8  # every parameter gathered twice per micro
    if not uneven:
        assert 0.9 * upper < fsdp_ratio <= upper, "the gathers repeat per micro-batch, the root's once"
    # gloo runs a reduce-scatter as a full all-reduce (pytorch #118911): ZeRO-1's and FSDP2's
    # reduce-scatter of the gradients then sends twice its formula.
    rs_bytes = formulas.reduce_scatter_bytes_per_rank(4 * n_trainable, nproc)
    gloo = tuple(p + (rs_bytes if n in ("zero1", "fsdp2") else 0)
                 for n, p in zip(names, predicted, strict=True))
    wire = (tuple(_wire_per_rank(runs[n], nproc) for n in names)
            if runs["ddp"]["wire"] else None)
    if wire:
        assert wire[names.index("ddp")] >= predicted[names.index("ddp")], \
            "headers and ACKs only add to the message"
    notes = sorted({n for s in ("zero1", "fsdp2") for n in runs[s]["bytes"]["notes"]})
    return BytesPerStep(
        names=names, predicted=predicted, counted=counted, gloo=gloo, wire=wire,
        fsdp_ratio=fsdp_ratio, fsdp_upper=upper, gather_bytes=gather_bytes,
        grad_accum=grad_accum, nproc=nproc, device=device,
        ddp_message_bytes=runs["ddp"]["bytes"]["message_bytes_per_step"][-1],
        all_grad_bytes=4 * n_trainable,
        naive_calls=runs["naive"]["bytes"]["last_step"]["all_reduce"]["calls"],
        notes=tuple(notes))


def plot_bytes(result: BytesPerStep, ax: Any = None) -> None:
    """Bars of MiB sent per rank per step: predicted, and counted or measured on the wire."""
    import matplotlib.pyplot as plt

    show = ax is None  # a figure of its own: shown here; on the caller's axes: drawn only
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3))
    x = range(len(result.names))
    bars = [("predicted (ring formula)", result.predicted, "#9ecae1")]
    bars += ([("predicted for gloo", result.gloo, "#6baed6"),
              ("measured (loopback)", result.wire, "#08519c")]
             if result.wire else [("counted (messages)", result.counted, "#3182bd")])
    w = 0.8 / len(bars)
    for j, (label, values, color) in enumerate(bars):
        ax.bar([i + (j - (len(bars) - 1) / 2) * w for i in x], [b / MIB for b in values], w,
               label=label, color=color)
    ax.set_xticks(list(x), result.names)
    ax.set(ylabel="MiB sent per rank per step",
           title=f"bytes per optimizer step, {result.nproc} ranks")
    ax.legend(fontsize=8)
    if show:
        plt.tight_layout()
        plt.show()


# ------------------------------------------------------------ section 4: memory per rank


@dataclass(frozen=True)
class MemoryPerRank:
    """Model states per rank after a step and between micro-batches (measured), against
    ZeRO's formula (predicted), for DDP, ZeRO-1 and FSDP2."""

    memory: Mapping[str, Mapping[str, Any]]  # each strategy's run["memory"]
    predicted: Mapping[str, float]  # model states per rank, ZeRO's formula
    n_trainable: int
    nproc: int

    def measured(self, name: str) -> float:
        m = self.memory[name]
        return m["parameters"] + m["gradients"] + m["optimizer_state"]

    @property
    def fsdp_accumulating(self) -> float:
        """FSDP2's gradients between micro-batches (under no_sync), measured."""
        return self.memory["fsdp2"]["gradients_accumulating"]

    @property
    def fsdp_peak(self) -> float:
        """FSDP2's model states while accumulating, measured."""
        m = self.memory["fsdp2"]
        return m["parameters"] + self.fsdp_accumulating + m["optimizer_state"]

    def describe(self) -> str:
        lines = [f"{'strategy':<10}{'weights':>10}{'grads':>10}{'optimizer':>11}{'measured':>11}"
                 f"{'predicted':>11}{'grads, accum.':>15}   (MiB per rank)"]
        for name in self.memory:
            m = self.memory[name]
            acc = m["gradients_accumulating"]
            lines.append(f"{name:<10}{m['parameters'] / MIB:>10.3f}{m['gradients'] / MIB:>10.3f}"
                         f"{m['optimizer_state'] / MIB:>11.3f}{self.measured(name) / MIB:>11.3f}"
                         f"{self.predicted[name] / MIB:>11.3f}"
                         + (f"{acc / MIB:>15.3f}" if acc is not None else f"{'(no no_sync)':>15}"))
        acc, grads4 = self.fsdp_accumulating, 4 * self.n_trainable
        lines.append(f"\nmeasured: FSDP2 between micro-batches holds {acc / MIB:.3f} MiB of "
                     f"gradients, {acc / grads4:.0%} of all gradients (predicted 100%: "
                     f"unsharded), against {self.memory['fsdp2']['gradients'] / MIB:.3f} MiB "
                     "after the step")
        lines.append(f"measured: FSDP2 model states {self.fsdp_peak / MIB:.3f} MiB while "
                     f"accumulating, {self.measured('fsdp2') / MIB:.3f} MiB after the step "
                     f"(DDP: {self.measured('ddp') / MIB:.3f} MiB)")
        ddp_acc = self.memory["ddp"]["gradients_accumulating"]
        lines.append(f"measured: DDP between micro-batches holds {ddp_acc / MIB:.3f} MiB of "
                     f"gradients and buckets, {ddp_acc / grads4:.2f} x 4Ψ (fresh .grad beside "
                     "the buckets)")
        return "\n".join(lines)


def memory_per_rank(runs: Mapping[str, Any], *, n_trainable: int, nproc: int, device: str,
                    uneven: Sequence[int] = (),
                    names: Sequence[str] = ("ddp", "zero1", "fsdp2")) -> MemoryPerRank:
    """Section 4's table from the ladder's ``runs``, checked on the CPU tier with an even
    split: the model states equal ZeRO's formulas, and under no_sync FSDP2 keeps every
    gradient whole."""
    result = MemoryPerRank({n: runs[n]["memory"] for n in names},
                           {n: runs[n]["memory_predicted"]["model_states"] for n in names},
                           n_trainable, nproc)
    if device == "cpu" and not uneven:
        assert all(result.measured(n) == result.predicted[n] for n in names), "ZeRO's formulas"
        assert result.fsdp_accumulating == 4 * n_trainable, \
            "under no_sync FSDP2 keeps every gradient whole"
    return result


def plot_memory(result: MemoryPerRank, ax: Any = None) -> None:
    """Horizontal bars of model states per rank, predicted beside measured, and FSDP2's
    extra while accumulating."""
    import matplotlib.pyplot as plt

    show = ax is None  # a figure of its own: shown here; on the caller's axes: drawn only
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 2.8))
    names = list(result.memory)
    for i, name in enumerate(names):
        ax.barh(i + 0.2, result.predicted[name] / MIB, 0.4, color="#9ecae1",
                label="predicted (ZeRO formula)" if i == 0 else None)
        ax.barh(i - 0.2, result.measured(name) / MIB, 0.4, color="#3182bd",
                label="measured (local tensors)" if i == 0 else None)
    after = result.measured("fsdp2")
    ax.barh(names.index("fsdp2") - 0.2, (result.fsdp_peak - after) / MIB, 0.4, left=after / MIB,
            color="#fdae6b", label="FSDP2 extra while accumulating (measured)")
    ax.set_yticks(range(len(names)), names)
    ax.set(xlabel="MiB per rank (model states)", title=f"memory per rank, n = {result.nproc}")
    ax.invert_yaxis()  # DDP on top
    ax.legend(loc="lower right", fontsize=8)
    if show:
        plt.tight_layout()
        plt.show()


def reshard_probe(runs: Mapping[str, Any], model: Any, *, n_params: int, nproc: int,
                  device: str, uneven: Sequence[int] = ()) -> str:
    """FSDP2 between forward and backward, one micro-batch on a fresh model each way
    (measured), against what ZeRO-3 and a ZeRO-2-like FSDP2 predict; checked on the CPU tier
    with an even split."""
    probe = runs["fsdp2"].get("reshard_probe")
    if probe is None:
        return "this labkit's FSDP2 has no reshard_after_forward option: no ZeRO-2 row"
    d = model.d_model
    root = model.vocab_size * d + model.seq_len * d + 2 * d  # wte (tied), wpe, ln_f
    rows = {"reshard_after_forward=True": (
                "ZeRO-3 (the default)", 4 * root,
                formulas.allgather_bytes_per_rank(4 * (2 * n_params - root), nproc)
                + formulas.reduce_scatter_bytes_per_rank(4 * n_params, nproc)),
            "reshard_after_forward=False": (
                "ZeRO-2-like", 4 * n_params,
                formulas.ring_allreduce_bytes_per_rank(4 * n_params, nproc))}
    lines = [f"{'FSDP2, one micro-batch':<50}{'weights held fwd->bwd':>24}{'sent per rank':>24}",
             f"{'':<50}{'measured (predicted)':>24}{'measured (predicted)':>24}   MiB"]
    for key, (label, held_pred, sent_pred) in rows.items():
        got = probe[key]
        lines.append(f"{key + ', ' + label:<50}"
                     f"{got['held_after_forward'] / MIB:>12.3f} ({held_pred / MIB:.3f})"
                     f"{got['sent_per_rank'] / MIB:>12.3f} ({sent_pred / MIB:.3f})")
        if device == "cpu" and not uneven:
            assert got["held_after_forward"] == held_pred and got["sent_per_rank"] == sent_pred
    zero2 = formulas.zero_memory_per_rank(n_params, 2, nproc, k=8, param_bytes=4, grad_bytes=4)
    fsdp_after = runs["fsdp2"]["memory_predicted"]["model_states"]
    lines.append(f"predicted: ZeRO stage 2 keeps whole weights throughout: {zero2 / MIB:.3f} MiB "
                 f"of model states per rank, against FSDP2's {fsdp_after / MIB:.3f} MiB after a "
                 "step")
    return "\n".join(lines)

