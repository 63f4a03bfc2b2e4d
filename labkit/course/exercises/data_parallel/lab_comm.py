"""Notebook 02's lab, sections 5 to 8: what communication costs, and when it hides.

The collectives timed over message sizes (latency α, busbw, and what NCCL chose), whether
buckets paid off against α's prediction, DDP's strong and weak scaling, the overlap of the
all-reduce with backward (predicted from this machine's C and W, then measured; and modelled
for an H100 node), and DDP's gradient-compression hooks. Separate from :mod:`.lab_ladder`
because these read the collective, scaling and compression jobs and price communication,
where that module compares the ladder's strategies. :mod:`.lab` re-exports every name here.

- :func:`collective_sweep`: latency α and busbw of the collectives, and NCCL's own words;
- :func:`bucket_payoff`: whether buckets paid off in the ladder's steps, against α's prediction;
- :class:`Scaling`: strong and weak scaling efficiency of DDP;
- :func:`overlap`: when communication hides behind backward: predicted, then measured;
- :func:`node_overlap`: the same formula fed with an H100 node's published numbers (modelled);
- :func:`compression`: DDP's communication hooks against fp32 DDP.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from labkit import collective_debug, formulas, hardware, verdict
from labkit.course.exercises.data_parallel.lab_ladder import MIB, step_times_s

# ---------------------------------------------------------- section 5: collectives


_NCCL_KEYS = ("NCCL version", "Channel", "Trees", "Ring", " via ", "NVLS", "comm ", "Connected")


@dataclass(frozen=True)
class CollectiveSweep:
    """The collectives timed over message sizes: latency α (the smallest all-reduce) and the
    all-reduce's busbw in its bandwidth regime."""

    rows: tuple[Mapping[str, Any], ...]
    link: str
    nproc: int
    device: str = "cpu"
    log: str = ""  # rank 0's output, where NCCL_DEBUG=INFO wrote what NCCL chose (GPUs)
    topology: str = ""  # nvidia-smi topo -m (GPUs)

    @property
    def _all_reduce(self) -> list[Mapping[str, Any]]:
        return [r for r in self.rows if r["collective"] == "all_reduce"]

    @property
    def latency_s(self) -> float:
        """The smallest all-reduce's median seconds: the latency α."""
        return self._all_reduce[0]["median_s"]

    @property
    def busbw(self) -> float:
        """The all-reduce's highest bus bandwidth, bytes/s (the bandwidth regime)."""
        return max(r["busbw_GBps"] for r in self._all_reduce) * 1e9

    def describe(self) -> str:
        ar = self._all_reduce
        lines = [f"measured: smallest all-reduce ({ar[0]['size_bytes']} B) takes "
                 f"{self.latency_s * 1e6:.0f} µs: the latency α",
                 f"measured: all-reduce busbw reaches {self.busbw / 1e9:.2f} GB/s at "
                 f"{max(ar, key=lambda r: r['busbw_GBps'])['size_bytes'] / MIB:.2f} MiB "
                 f"({self.link})"]
        if self.device == "cuda":
            said = [s.split("NCCL INFO", 1)[1].strip()
                    for s in self.log.splitlines() if "NCCL INFO" in s]
            keep = [s for s in said if any(k in s for k in _NCCL_KEYS)]
            lines.append(f"\nNCCL_DEBUG=INFO on rank 0: {len(said)} lines, {min(16, len(keep))} "
                         "of those about the version, rings, trees, channels and transports:")
            lines += [f"  {s}" for s in keep[:16]]
            lines.append(self.topology)
        return "\n".join(lines)


def collective_sweep(job: Any, nproc: int, device: str) -> CollectiveSweep:
    """A ``labkit.workers.collectives`` job read back: rank 0's rows and link and, on GPUs,
    what NCCL_DEBUG=INFO made NCCL say on rank 0 and how the GPUs are linked."""
    rank0 = job.rank(0)
    log = topology = ""
    if device == "cuda":
        log = job.log(0) + job.log(0, "stderr")
        topology = collective_debug.nvidia_topology()
    return CollectiveSweep(tuple(rank0["rows"]), rank0["link"], nproc, device, log, topology)


def plot_collectives(result: CollectiveSweep, axes: Any = None) -> None:
    """algbw and busbw against message size, one line per collective, log-log."""
    import matplotlib.pyplot as plt

    show = axes is None  # figure of its own: shown here; on the caller's axes: drawn only
    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharex=True)
    else:
        fig = axes[0].figure
    for kind, style in (("all_reduce", "o-"), ("all_gather", "s-"), ("reduce_scatter", "^--")):
        rs = [r for r in result.rows if r["collective"] == kind]
        label = kind + (" (emulated by all-reduce on gloo)" if rs[0]["emulated"] else "")
        for ax, key in zip(axes, ("algbw_GBps", "busbw_GBps"), strict=True):
            ax.loglog([r["size_bytes"] for r in rs], [r[key] for r in rs], style, label=label,
                      ms=4)
    for ax, title in zip(axes, ("algbw = S / t", "busbw = algbw × factor"), strict=True):
        ax.set(xlabel="message size S (bytes)", ylabel="GB/s", title=title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"measured: {result.nproc} ranks, {result.link}", fontsize=10)
    if show:
        plt.tight_layout()
        plt.show()


@dataclass(frozen=True)
class BucketPayoff:
    """Does bucketing pay off here? The saving predicted from α, then section 2's steps."""

    calls: Mapping[str, int]  # messages per step: naive, bucketed
    extra_s: float  # predicted: naive's extra messages times α
    comparison: verdict.Comparison
    device: str = "cpu"  # where the ranks ran: the explanation of a slower bucketed step is the tier's

    def describe(self) -> str:
        c, extra_s, buckets = self.calls, self.extra_s, self.comparison
        lines = [f"\npredicted: naive sends {c['naive']} messages per step, bucketed "
                 f"{c['bucketed']}, for the same bytes: naive pays α "
                 f"{c['naive'] - c['bucketed']} more times, about {extra_s * 1e3:.1f} ms more "
                 "per step if nothing overlaps them",
                 f"measured in section 2 ({buckets.a.n} steps each):", str(buckets)]
        if buckets.outcome == "faster" and buckets.faster.name == "bucketed step":
            lines.append(f"Buckets paid off here: {buckets.difference * 1e3:.1f} ms per step, "
                         f"against {extra_s * 1e3:.1f} ms predicted from α alone (bucketed also "
                         "overlaps its all-reduces with the backward pass).")
        elif buckets.outcome == "faster" and self.device == "cpu":
            lines.append("Naive was faster here. On the CPU tier bucketed copies every gradient "
                         "into its buckets, and its all-reduces\nrun on gloo threads that "
                         "compete with the backward pass for the same cores: that can cost "
                         "more than the\nlatency it saves.")
        elif buckets.outcome == "faster":
            lines.append("Naive was faster here, which this run does not explain: the bucket "
                         "copies and NCCL kernels competing with the\nbackward pass's are the "
                         "candidates; notebook 06's profiler shows which.")
        elif buckets.outcome == "agree":
            lines.append(f"No difference beyond {100 * buckets.tolerance:g}% of a step: the "
                         f"{extra_s * 1e3:.1f} ms of latency saved is small next to a step of "
                         f"{buckets.slower.median * 1e3:.0f} ms on this machine.")
        else:
            lines.append(f"The {extra_s * 1e3:.1f} ms predicted are lost in how much the steps "
                         "varied while they ran.")
        return "\n".join(lines)


def bucket_payoff(runs: Mapping[str, Any], latency_s: float, device: str = "cpu") -> BucketPayoff:
    """Naive's extra messages priced at α, against the ladder's measured naive and bucketed
    steps (``verdict.compare_times``), run on ``device`` ("cpu" or "cuda")."""
    calls = {n: runs[n]["bytes"]["last_step"]["all_reduce"]["calls"]
             for n in ("naive", "bucketed")}
    extra_s = (calls["naive"] - calls["bucketed"]) * latency_s
    cmp = verdict.compare_times(step_times_s(runs["bucketed"]), step_times_s(runs["naive"]),
                                names=("bucketed step", "naive step"))
    return BucketPayoff(calls, extra_s, cmp, device)


# ---------------------------------------------------------------- section 6: scaling


def _scaling_key_name(key: Any) -> str:
    return "1 rank" if key == 1 else f"{key[0]}, {key[1]} ranks"


@dataclass(frozen=True)
class Scaling:
    """Strong and weak scaling efficiency of DDP, from median step times.

    ``samples`` is keyed ``1`` (the 1-rank job) and ``("strong", n)`` / ``("weak", n)``."""

    samples: Mapping[Any, Sequence[float]]
    world_sizes: tuple[int, ...]
    device: str

    def step_s(self, key: Any) -> float:
        return statistics.median(self.samples[key])

    @property
    def efficiency(self) -> dict[str, dict[int, float]]:
        """E(n) strong = T_1 / (n·T_n) at the same global batch; weak = T_1 / T_n at n times
        the batch."""
        t1 = self.step_s(1)
        eff = {"strong": {1: 1.0}, "weak": {1: 1.0}}
        for n in self.world_sizes[1:]:
            eff["strong"][n] = t1 / (n * self.step_s(("strong", n)))
            eff["weak"][n] = t1 / self.step_s(("weak", n))
        return eff

    def describe(self) -> str:
        eff, t1 = self.efficiency, self.step_s(1)
        lines = [f"\n{'n':>3}{'strong T (ms)':>15}{'E strong':>10}{'weak T (ms)':>13}"
                 f"{'E weak':>8}   (T: median step; E from medians)",
                 f"{1:>3}{t1 * 1e3:>15.1f}{1.0:>10.2f}{t1 * 1e3:>13.1f}{1.0:>8.2f}"]
        for n in self.world_sizes[1:]:
            lines.append(f"{n:>3}{self.step_s(('strong', n)) * 1e3:>15.1f}"
                         f"{eff['strong'][n]:>10.2f}"
                         f"{self.step_s(('weak', n)) * 1e3:>13.1f}{eff['weak'][n]:>8.2f}")
        lines.append("\nHow much the steps varied (E is only as sure as these):")
        lines += [verdict.summarize(s, _scaling_key_name(k)).line(width=16)
                  for k, s in self.samples.items()]
        return "\n".join(lines)

    def describe_host(self, cpu: Any = None) -> str:
        """This host's usable cores against the most ranks (``cpu``: a ``hardware.CpuInfo``;
        None reads this machine's): what E(n) means on the CPU tier."""
        cpu = cpu or hardware.cpu_info()
        top = max(self.world_sizes)
        lines = [f"this host: {cpu.usable_cores} usable cores for {top} ranks + this kernel"]
        if cpu.usable_cores is not None and top > cpu.usable_cores:
            lines.append("more ranks than cores: ranks take turns on a core, so E(n) mostly "
                         "measures that")
        return "\n".join(lines)


def world_sizes(nproc: int) -> tuple[int, ...]:
    """The rank counts a scaling study of ``nproc`` ranks runs: powers of two dividing it,
    and nproc."""
    return tuple(sorted({n for n in (1, 2, 4, 8, 16, 32, 64) if n <= nproc and nproc % n == 0}
                        | {nproc}))


def plot_scaling(result: Scaling, ax: Any = None) -> None:
    """E(n) against n, strong and weak, with the ideal 1.0."""
    import matplotlib.pyplot as plt

    show = ax is None  # a figure of its own: shown here; on the caller's axes: drawn only
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    eff = result.efficiency
    for kind, style in (("strong", "o-"), ("weak", "s-")):
        ax.plot(list(eff[kind]), list(eff[kind].values()), style, label=f"{kind} (measured)")
    ax.axhline(1.0, ls=":", c="grey", label="ideal")
    ax.set(xlabel="ranks n", ylabel="E(n)", ylim=(0, 1.2), xticks=list(result.world_sizes),
           title=f"scaling efficiency of DDP, {result.device}"
           + (" (one core per rank)" if result.device == "cpu" else ""))
    ax.legend()
    if show:
        plt.tight_layout()
        plt.show()


# ------------------------------------------------------ section 7: communication hidden?


@dataclass(frozen=True)
class Overlap:
    """When communication hides behind backward: the α–β overlap formula fed with this
    machine's measured C (1-rank FLOP/s) and W (busbw), then the measured overhead."""

    achieved: float  # C, FLOP/s of the 1-rank job
    busbw: float  # W, bytes/s
    tokens_per_micro: int
    grad_accum: int
    ratio: float  # r = t_comm / t_bwd
    need_tokens: float
    exposed_share: float
    comm_s: float
    bwd_last_s: float
    overhead: verdict.Comparison
    nproc: int

    @property
    def exposed_s(self) -> float:
        return max(0.0, self.comm_s - self.bwd_last_s)

    def describe(self) -> str:
        ov, n = self.overhead, self.nproc
        lines = [f"measured: C = {self.achieved / 1e9:.2f} GFLOP/s (1 rank), W = "
                 f"{self.busbw / 1e9:.2f} GB/s (busbw), C/W = {self.achieved / self.busbw:.2f} "
                 "FLOP/byte",
                 f"predicted: r = t_comm / t_bwd = {self.ratio:.3f} at {self.tokens_per_micro} "
                 f"tokens per micro-batch -> {'can hide' if self.ratio <= 1 else 'cannot hide'} "
                 f"(needs >= {self.need_tokens:.0f} tokens per micro-batch); exposed share of a "
                 f"step with A = {self.grad_accum}: {self.exposed_share:.1%}",
                 f"predicted: the all-reduce takes {self.comm_s * 1e3:.1f} ms per step; the last "
                 f"micro-batch's backward lasts {self.bwd_last_s * 1e3:.1f} ms, so "
                 f"{self.exposed_s * 1e3:.1f} ms stay exposed if the overlap is perfect",
                 f"measured: the {n}-rank step against a perfect split of the 1-rank step",
                 str(ov)]
        if ov.outcome == "faster" and ov.faster is ov.a:
            lines.append(f"So {n} ranks lost {ov.difference * 1e3:.1f} ms per step to sharing "
                         f"the work, against {self.exposed_s * 1e3:.1f} ms predicted exposed "
                         f"({self.comm_s * 1e3:.1f} ms for the all-reduce alone).")
        elif ov.outcome == "faster":
            lines.append(f"The {n}-rank step came out shorter than a perfect split, which no "
                         "overhead explains: the 1-rank job ran while this machine was busier.")
        elif ov.outcome == "agree":
            lines.append(f"No overhead beyond {100 * ov.tolerance:g}% of a step: here the split "
                         f"was as good as perfect, against {self.exposed_s * 1e3:.1f} ms "
                         f"predicted exposed ({self.comm_s * 1e3:.1f} ms for the all-reduce "
                         "alone).")
        return "\n".join(lines)


def overlap(scaling_result: Scaling, *, sent_per_rank: float, busbw: float, model: Any,
            n_params: int, micro_batch: int, grad_accum: int, nproc: int,
            global_batch: int) -> Overlap:
    """Section 7's prediction and measurement: C from the 1-rank job of ``scaling_result``
    (``global_batch`` sequences a step), W = ``busbw``, ``sent_per_rank``: DDP's bytes per
    rank per step; the overhead of ``nproc`` ranks against a perfect split (T_1 / n)."""
    tokens_per_micro = micro_batch * model.seq_len  # what the all-reduce overlaps
    flops_tok = formulas.flops_per_token(n_params - model.seq_len * model.d_model,
                                         model.n_layer, model.d_model, model.seq_len)
    t1 = scaling_result.step_s(1)
    achieved = global_batch * model.seq_len * flops_tok / t1  # the 1-rank job's FLOP/s
    ov = verdict.compare_times([t / nproc for t in scaling_result.samples[1]],
                               scaling_result.samples["strong", nproc],
                               names=(f"T_1 / {nproc}", f"T_{nproc}"))
    return Overlap(
        achieved=achieved, busbw=busbw, tokens_per_micro=tokens_per_micro,
        grad_accum=grad_accum,
        ratio=formulas.dp_overlap_ratio(tokens_per_micro, nproc, achieved, busbw, grad_bytes=4),
        need_tokens=formulas.dp_min_tokens_per_rank(nproc, achieved, busbw, grad_bytes=4),
        exposed_share=formulas.dp_exposed_comm_fraction(tokens_per_micro, grad_accum, nproc,
                                                        achieved, busbw, grad_bytes=4),
        comm_s=sent_per_rank / busbw,  # sent bytes / busbw
        # The last micro-batch's backward: 2/3 of one micro-batch's share of the 1-rank step.
        bwd_last_s=(2 / 3) * t1 * micro_batch / global_batch,
        overhead=ov, nproc=nproc)


H100 = "NVIDIA H100 80GB HBM3"
NVLINK_BYTES_PER_S = hardware.link_bandwidth("NVLink 4").bytes_per_s
"""NVLink 4's bandwidth per direction per H100 SXM GPU, from the sourced link table."""


def node_overlap(tokens: Sequence[int] = (512, 1024, 2048, 4096),
                 accums: Sequence[int] = (1, 4, 16), n: int = 8,
                 link_bytes_per_s: float = NVLINK_BYTES_PER_S) -> str:
    """The overlap formula fed with published numbers (modelled): an H100 SXM's dense bf16
    peak, ``link_bytes_per_s`` per direction per GPU, bf16 gradients, ``n`` GPUs; the exposed
    share of a step per micro-batch size (``tokens``) and accumulation (``accums``)."""
    peak = hardware.peak_flops(H100, "bf16")
    lines = [str(peak),
             f"{'modelled exposed share of a step':<38}"
             + "".join(f"{f'A = {a}':>9}" for a in accums)]
    for t in tokens:
        r = formulas.dp_overlap_ratio(t, n, peak.flops_per_s, link_bytes_per_s, grad_bytes=2)
        shares = [formulas.dp_exposed_comm_fraction(t, a, n, peak.flops_per_s, link_bytes_per_s,
                                                    grad_bytes=2) for a in accums]
        lines.append(f"{t:>5} tokens per micro-batch: r = {r:4.2f}"
                     + "".join(f"{s:>9.1%}" for s in shares))
    need = formulas.dp_min_tokens_per_rank(n, peak.flops_per_s, link_bytes_per_s, grad_bytes=2)
    lines.append(f"modelled: an {n}-GPU H100 node hides the all-reduce from {need:,.0f} tokens "
                 "per micro-batch per GPU (scaling-book: ~2,200 as n grows)")
    return "\n".join(lines)


# ------------------------------------------------------ section 8: gradient compression


@dataclass(frozen=True)
class Compression:
    """DDP's communication hooks against fp32 DDP: bytes saved and how far the loss strays."""

    runs: Mapping[str, Any]  # "ddp" and each hook's run
    hooks: tuple[str, ...]
    optimizer: str
    steps: int
    track: float = 0.05  # nats: a hook 'tracks' fp32 DDP when its loss stays this close

    def gap(self, name: str) -> tuple[float, int]:
        """The largest |loss - fp32 DDP's loss| and the (1-based) step where it was."""
        diffs = [abs(a - b) for a, b in zip(self.runs[name]["loss"], self.runs["ddp"]["loss"],
                                            strict=True)]
        return max(diffs), diffs.index(max(diffs)) + 1

    def sent(self, name: str) -> float:
        return self.runs[name]["bytes"]["sent_per_rank_last_step"]

    def describe(self) -> str:
        base = self.runs["ddp"]
        lines = [f"{self.optimizer}, {self.steps} steps",
                 f"{'hook':<14}{'MiB sent/rank, last step':>26}{'saved':>8}{'final loss':>12}"
                 f"{'max |loss - fp32|':>19}{'at step':>9}"]
        for name in ("ddp", *self.hooks):
            gap, at = self.gap(name)
            lines.append(f"{name:<14}{self.sent(name) / MIB:>26.3f}"
                         f"{1 - self.sent(name) / self.sent('ddp'):>8.0%}"
                         f"{self.runs[name]['loss'][-1]:>12.4f}{gap:>19.4f}{at:>9}")
        psgd = self.runs.get("ddp_powersgd")
        if psgd is not None:
            lines.append(f"\nmeasured: PowerSGD message bytes per step "
                         f"{psgd['bytes']['message_bytes_per_step']}")
        # Does each hook keep training on fp32's track? "Tracks": within a gap far below the
        # loss's own fall over these steps (printed), and far above what rounding to 16 bits adds.
        fell = base["loss"][0] - min(base["loss"])
        lines.append(f"measured: fp32 DDP's loss fell by {fell:.3f} over {self.steps} steps; a "
                     f"hook 'tracks' it when its loss stays within {self.track} at every step")
        for name in self.hooks:
            gap, at = self.gap(name)
            if gap <= self.track:
                lines.append(f"{name} tracks fp32 DDP: at most {gap:.4f} apart (step {at})")
            else:
                lines.append(f"{name} left fp32 DDP's track: {gap:.3f} apart at step {at} (loss "
                             f"{self.runs[name]['loss'][at - 1]:.3f} against "
                             f"{base['loss'][at - 1]:.3f})")
        return "\n".join(lines)


def compression(runs: Mapping[str, Any], *, optimizer: str, steps: int, device: str,
                hooks: Sequence[str] = ("ddp_fp16", "ddp_bf16", "ddp_powersgd")) -> Compression:
    """The compression job's ``runs`` read back, checked: 16-bit hooks halve the bytes
    exactly; PowerSGD's low-rank factors send less still once it starts; on the CPU tier with
    SGD + momentum every hook tracks fp32 DDP."""
    result = Compression(runs, tuple(hooks), optimizer, steps)
    sent = {n: result.sent(n) for n in ("ddp", *hooks)}
    if "ddp_fp16" in sent and "ddp_bf16" in sent:
        assert sent["ddp_fp16"] == sent["ddp_bf16"] == sent["ddp"] / 2, "16-bit halves"
    if steps > 2 and "ddp_powersgd" in sent:  # PowerSGD starts after 2 plain all-reduces
        assert sent["ddp_powersgd"] < sent["ddp_fp16"], "low-rank factors send less"
    if device == "cpu" and optimizer == "sgd_momentum":
        assert all(result.gap(n)[0] <= result.track for n in hooks), \
            "with SGD + momentum every hook tracks fp32"
    return result


def plot_compression(result: Compression, ax: Any = None) -> None:
    """Training loss per step, fp32 DDP and each hook."""
    import matplotlib.pyplot as plt

    show = ax is None  # a figure of its own: shown here; on the caller's axes: drawn only
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 3.2))
    for name in ("ddp", *result.hooks):
        ax.plot(range(1, result.steps + 1), result.runs[name]["loss"],
                label=name.replace("ddp_", "DDP + ") if name != "ddp" else "DDP, fp32 all-reduce")
    ax.set(xlabel="optimizer step", ylabel="training loss (measured)",
           title=f"gradient compression: same data, same seed, {result.optimizer}")
    ax.legend(fontsize=8)
    if show:
        plt.tight_layout()
        plt.show()

