"""Notebook 02's data-parallel lab: the plan of its jobs, and what they measured, told.

The notebook launches the jobs (``labkit.workers.dp_train``, ``labkit.workers.collectives``) and
calls the formulas; this module holds what it prints about them, so that a cell is the few
calls its section is about (beside :mod:`.bench`, which times the learner's classes, and
:mod:`.strategy`, the decision exercise). Each result is a frozen dataclass built from a
job's per-rank results, with ``describe() -> str`` (the sentences and text table the cell
prints) and, where a figure belongs with it, a ``plot_<thing>(result, ax=None)`` beside it
(matplotlib imported inside). Every sentence that compares two measured samples is chosen by
:mod:`labkit.verdict`; every check a reconcile step makes is an ``assert`` in the function that
builds the result, so it can still fail in the notebook.

The lab is split by concern; this module holds the plan, the decision and the summary, and
re-exports the rest, so the notebook uses every name as ``dp_lab.<name>``:

    lab             the plan of the jobs; the runner-up; the summary of the notebook's figures
    lab_ladder      sections 2-4: the ladder's strategies compared: losses, bytes, memory
    lab_comm        sections 5-8: collectives, buckets, scaling, overlap, compression

- :func:`plan`: the ranks, device, dtype and batch the notebook's jobs run at;
- :func:`ladder`: section 2's table: loss, step time, messages and bytes per strategy;
- :func:`bytes_per_step`: bytes per rank per step: predicted, counted, on the wire (loopback);
- :func:`memory_per_rank`: model states per rank, measured against ZeRO's formula;
- :func:`reshard_probe`: FSDP2 with and without resharding after forward, one micro-batch;
- :func:`collective_sweep`: latency α and busbw of the collectives, and NCCL's own words;
- :func:`bucket_payoff`: whether buckets paid off in the ladder's steps, against α's prediction;
- :class:`Scaling`: strong and weak scaling efficiency of DDP;
- :func:`overlap`: when communication hides behind backward: predicted, then measured;
- :func:`node_overlap`: the same formula fed with an H100 node's published numbers (modelled);
- :func:`compression`: DDP's communication hooks against fp32 DDP;
- :func:`runner_up`: the chosen strategy's step against the next one that fits;
- :class:`Summary`: the notebook's figures in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from labkit import config, formulas, hardware, verdict
from labkit.course.exercises.data_parallel.lab_comm import H100 as H100
from labkit.course.exercises.data_parallel.lab_comm import NVLINK_BYTES_PER_S as NVLINK_BYTES_PER_S
from labkit.course.exercises.data_parallel.lab_comm import BucketPayoff as BucketPayoff
from labkit.course.exercises.data_parallel.lab_comm import CollectiveSweep as CollectiveSweep
from labkit.course.exercises.data_parallel.lab_comm import Compression as Compression
from labkit.course.exercises.data_parallel.lab_comm import Overlap as Overlap
from labkit.course.exercises.data_parallel.lab_comm import Scaling as Scaling
from labkit.course.exercises.data_parallel.lab_comm import bucket_payoff as bucket_payoff
from labkit.course.exercises.data_parallel.lab_comm import collective_sweep as collective_sweep
from labkit.course.exercises.data_parallel.lab_comm import compression as compression
from labkit.course.exercises.data_parallel.lab_comm import node_overlap as node_overlap
from labkit.course.exercises.data_parallel.lab_comm import overlap as overlap
from labkit.course.exercises.data_parallel.lab_comm import plot_collectives as plot_collectives
from labkit.course.exercises.data_parallel.lab_comm import plot_compression as plot_compression
from labkit.course.exercises.data_parallel.lab_comm import plot_scaling as plot_scaling
from labkit.course.exercises.data_parallel.lab_comm import world_sizes as world_sizes
from labkit.course.exercises.data_parallel.lab_ladder import LADDER as LADDER
from labkit.course.exercises.data_parallel.lab_ladder import MIB as MIB
from labkit.course.exercises.data_parallel.lab_ladder import BytesPerStep as BytesPerStep
from labkit.course.exercises.data_parallel.lab_ladder import Ladder as Ladder
from labkit.course.exercises.data_parallel.lab_ladder import MemoryPerRank as MemoryPerRank
from labkit.course.exercises.data_parallel.lab_ladder import bytes_per_step as bytes_per_step
from labkit.course.exercises.data_parallel.lab_ladder import ladder as ladder
from labkit.course.exercises.data_parallel.lab_ladder import memory_per_rank as memory_per_rank
from labkit.course.exercises.data_parallel.lab_ladder import plot_bytes as plot_bytes
from labkit.course.exercises.data_parallel.lab_ladder import plot_memory as plot_memory
from labkit.course.exercises.data_parallel.lab_ladder import reshard_probe as reshard_probe
from labkit.course.exercises.data_parallel.lab_ladder import step_times_s as step_times_s
from labkit.jobs import launch

# --------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Plan:
    """What notebook 02's jobs run at: ranks, device, precision, batch and steps."""

    size: str  # the size the jobs run at
    nproc: int
    gpus: int
    device: str
    dtype: str
    preset: Any  # config.RunConfig
    micro_batch: int
    grad_accum: int
    steps: int
    n_params: int
    bucket_cap_mb: float
    env: dict[str, str] | None
    timeout_s: float
    notes: tuple[str, ...] = ()  # printed after the tier: why the plan differs from the ask
    ranks_note: str = ""

    @property
    def model(self) -> Any:
        return self.preset.model

    @property
    def lr(self) -> float:
        return self.preset.train.lr

    @property
    def uneven(self) -> list[int]:
        """The model's first dimensions that nproc does not divide (FSDP2 pads them)."""
        m = self.model
        return [d for d in (m.vocab_size, m.seq_len, m.d_model) if d % self.nproc]

    def monitor(self) -> Any:
        """The live monitor for the ladder's job. On the CPU tier the ranks are CPU processes:
        watch them, not an idle GPU NVML may see."""
        from labkit.monitor import Monitor  # its plotting pulls in matplotlib: only when used

        cpu = self.device == "cpu"
        return Monitor(period_s=0.5 if cpu else 1.0, backend="cpu" if cpu else None)

    @staticmethod
    def progress(label: str) -> Any:
        """An observer that prints a line every 3 s, for a job launched with stream=False."""
        return launch.ProgressLines(label)

    def describe(self, tier: bool = True) -> str:
        m = self.model
        lines = [str(hardware.describe_tier())] if tier else []
        lines += list(self.notes)
        lines.append(f"\nsize={self.size!r}: {self.nproc} ranks on {self.device} "
                     f"({'NCCL' if self.device == 'cuda' else 'gloo over loopback'}), "
                     f"{self.dtype}{self.ranks_note}")
        if self.uneven:
            lines.append(f"note: {self.nproc} ranks do not divide {self.uneven}: FSDP2 (and "
                         "ZeRO-1's flat buffer) pad shards to equal sizes, so their counted "
                         "bytes and memory exceed the formulas by the padding")
        lines.append(f"model: {self.n_params:,} parameters, {m}")
        lines.append(f"per rank: {self.grad_accum} micro-batches of {self.micro_batch} x "
                     f"{m.seq_len} tokens; global batch "
                     f"{self.micro_batch * self.grad_accum * self.nproc} sequences; "
                     f"{self.steps} steps per strategy")
        return "\n".join(lines)


def plan(size: str, nproc: int | None = None, steps: int | None = None, *,
         gpus: int | None = None) -> Plan:
    """The plan of notebook 02's jobs at ``size`` (checked first), on ``nproc`` ranks (None: 2,
    or with 2+ GPUs the largest power of two up to their number), ``steps`` optimizer steps per
    strategy (None: the size's default). ``gpus`` overrides the visible GPUs (tests)."""
    preset = config.preset(size)  # checks `size` before anything runs
    gpus = launch.visible_gpu_count() if gpus is None else gpus
    device = "cuda" if gpus >= 2 else "cpu"  # data parallelism needs one GPU per rank
    ranks_note = ""
    if nproc is None:
        # FSDP2 pads each parameter's first dimension to a multiple of n, and the padding is
        # counted. In every preset this GPT's first dimensions (vocabulary 256, seq_len,
        # d_model, 4·d_model) are multiples of 64, so a power of two up to 64 pads nothing and
        # bytes and memory can match the formulas exactly; 3, 5, 6 or 7 ranks would not.
        nproc = 2 ** (gpus.bit_length() - 1) if device == "cuda" else 2
        if nproc != gpus and device == "cuda":
            ranks_note = (f"; {nproc} of {gpus} GPUs, the largest power of two, so that "
                          "FSDP2's shards need no padding (set nproc to choose)")
    if nproc < 2:
        raise ValueError(f"nproc={nproc} is not allowed: data parallelism needs 2 or more ranks")
    run_size, notes = size, []
    if gpus == 1:
        notes.append("One GPU: data parallelism needs one GPU per rank, so these jobs run on "
                     "CPU ranks (gloo)")
    if device == "cpu" and size == "gpu":
        notes.append("size='gpu' needs 2+ GPUs for these jobs; running size 'lab' on CPU ranks "
                     "instead")
        run_size = "lab"
        preset = config.preset(run_size)
    m = preset.model
    # Sequences per rank per micro-batch, and optimizer steps per strategy. Nothing below needs
    # more at lab size on a CPU: 4 x 128 tokens keep a rank's step near a tenth of a second on
    # one core, and 8 steps leave 7 timed ones (a verdict needs 5) and 6 of PowerSGD (section 8).
    micro_batch = {"smoke": 4, "lab": 4, "gpu": max(1, preset.train.micro_batch // 2)}[run_size]
    steps = steps or {"smoke": 6, "lab": 8, "gpu": 30}[run_size]
    # bf16 needs compute capability 8.0 (Ampere); a V100 or T4 trains in fp16 with a GradScaler
    dtype = (hardware.default_autocast_dtype("cuda", preset.train.dtype).dtype
             if device == "cuda" else "float32")
    n_params = formulas.gpt_params(m.vocab_size, m.d_model, m.n_layer, seq_len=m.seq_len)
    # DDP's default bucket is 25 MiB (PyTorch DDP paper). A small model would fit one bucket
    # and nothing could overlap, so buckets here are at most a quarter of the gradients.
    grad_mib = 4 * n_params / MIB  # fp32 gradients
    # One core per rank on the CPU tier, like one GPU per rank (torchrun does this for
    # nproc > 1; the 1-rank scaling job gets the same, so the comparison is fair).
    env = {"OMP_NUM_THREADS": "1"} if device == "cpu" else None
    return Plan(size=run_size, nproc=nproc, gpus=gpus, device=device, dtype=dtype,
                preset=preset, micro_batch=micro_batch,
                grad_accum=2,  # micro-batches per optimizer step: shows no_sync at work
                steps=steps, n_params=n_params, bucket_cap_mb=min(25.0, grad_mib / 4), env=env,
                timeout_s={"smoke": 240, "lab": 900, "gpu": 900}[run_size],
                notes=tuple(notes), ranks_note=ranks_note)


# ----------------------------------------------------------- the decision, and the summary


def runner_up(runs: Mapping[str, Any], choice: str | None, second: str | None) -> str:
    """The chosen strategy's ladder steps against the next one that fits (verdict)."""
    if choice is None:
        return ""
    if second is None:
        return f"{choice} is the only strategy that fits: there is no speed to compare"
    lines = [str(verdict.compare_times(step_times_s(runs[choice]), step_times_s(runs[second]),
                                       names=(f"{choice} step", f"{second} step")))]
    if runs[choice]["timed_with_spy"] or runs[second]["timed_with_spy"]:
        lines.append("(FSDP2's steps were timed with its collective counter running, which "
                     "slows them: see section 2)")
    return "\n".join(lines)


@dataclass(frozen=True)
class Summary:
    """The notebook's figures in one place: bytes and memory per strategy, the overlap
    ratio, the scaling efficiency."""

    plan: Plan
    bytes: BytesPerStep
    memory: MemoryPerRank
    overlap: Overlap
    scaling: Scaling
    names: tuple[str, ...] = field(default=("ddp", "zero1", "fsdp2"))

    def describe(self) -> str:
        p, b, m = self.plan, self.bytes, self.memory
        lines = [f"{p.nproc} ranks, {p.device}, {p.n_params:,} parameters, {p.dtype}"]
        for name in self.names:
            i = b.names.index(name)
            bp = b.predicted[i]
            lines.append(f"{name:<6} bytes/rank/step: {b.got(name)}, predicted {bp / MIB:.3f} MiB"
                         + (f" (gloo {b.gloo[i] / MIB:.3f})" if b.wire and b.gloo[i] != bp
                            else "")
                         + f";  memory/rank: measured {m.measured(name) / MIB:.3f} MiB, "
                         f"predicted {m.predicted[name] / MIB:.3f} MiB")
        acc = m.fsdp_accumulating
        lines.append(f"FSDP2 while accumulating: gradients {acc / MIB:.3f} MiB per rank "
                     f"({acc / (4 * m.n_trainable):.0%} of all, measured), model states "
                     f"{m.fsdp_peak / MIB:.3f} MiB")
        lines.append(f"overlap: r = {self.overlap.ratio:.3f} at {self.overlap.tokens_per_micro} "
                     "tokens per micro-batch (predicted)")
        eff = self.scaling.efficiency
        lines += [f"scaling at n = {n}: E strong {eff['strong'][n]:.2f}, E weak "
                  f"{eff['weak'][n]:.2f} (measured; ideal 1.00)"
                  for n in self.scaling.world_sizes[1:]]
        return "\n".join(lines)
