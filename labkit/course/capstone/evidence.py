"""What an engineer has of a slow job: its measurements, raw, and the tools to read them.

    e = job.evidence()                 # a CapstoneRun's Evidence
    print(e.report())                  # every section below, as tables
    e.phase_ms("forward")              # [rank][step] milliseconds, measured
    e.ops_by_phase(rank=1)             # the profiler trace's operators, counted per phase
    trace = e.trace(0)                 # the trace itself (labkit.profiling.trace), for nb06's tools

Nothing here is named after a fault or says what value a healthy job has: the evidence is what
the job measured and what its code, environment and data say about themselves. Deciding which
number is wrong is the learner's part (notebook 07), with the method of notebooks 01–06: an
expectation from a formula or a healthy baseline, then the measurement.

Each field, its unit and where it comes from (the worker, :mod:`labkit.workers.capstone_train`):

    steps_ms       {phase: [rank][step]} ms per optimizer step: "step" (wall, synchronised),
                   "data", "forward", "backward", "optimizer" (the labelled phases, timed
                   with perf_counter on a CPU and CUDA events on a GPU), and "other" (the step
                   minus its phases). The first step warms up; medians leave it out.
    allreduce      [rank][step][micro-batch] all-reduce calls and bytes that micro-batch's
                   backward issued (DDP's buckets, counted by a communication hook)
    losses         mean training loss per step over the ranks; ``val_losses`` (step, loss)
    grad_norm      [rank][step] the gradient's L2 norm before the optimizer step
    memory_mb      [rank][step] peak CUDA memory allocated (GPU), or the process's resident
                   memory (CPU: ``/proc/self/statm``; what ``top``'s RES shows), MiB
    host_syncs     [rank][step] host-device syncs, in forward and in backward (CUDA's sync
                   debug mode; 0 on a CPU)
    facts          per rank: threads, cores, environment (thread and NCCL variables), runtime
                   flags, the loader, the optimizer, the model, the checkpoints it wrote
                   (rank 0 writes one every few steps: a slow step of a healthy job)
    samples        [rank][epoch] the dataset indices each rank's sampler handed out
    traces         [rank] a profiler trace (Chrome JSON) of the steps after the timed ones
"""

from __future__ import annotations

import functools
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PHASES = ("data", "forward", "backward", "optimizer")
OUTSIDE = "(outside the phases)"
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")


def median(xs: Sequence[float]) -> float:
    """The median of a per-step series, the first (warm-up) step left out."""
    return statistics.median(xs[1:] or xs)


def quartiles(xs: Sequence[float]) -> tuple[float, float]:
    """The first and third quartile of a per-step series, warm-up left out."""
    s = sorted(xs[1:] or xs)
    return s[len(s) // 4], s[(3 * len(s)) // 4]


@dataclass(frozen=True)
class Evidence:
    """One run's measurements and facts (module docstring: each field's unit and source)."""

    tier: str
    ranks: list[dict[str, Any]]

    # ---------------------------------------------------------------- the numbers, by name
    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def cores(self) -> int:
        return self.ranks[0]["cores"]

    @property
    def tokens_per_s(self) -> float:
        """The job's tokens per second: the global batch's tokens over the slowest rank's median
        step (every rank waits for the slowest at the all-reduce)."""
        return min(r["tokens_per_s"] for r in self.ranks)

    @property
    def steps_ms(self) -> dict[str, list[list[float]]]:
        out = {p: [[v * 1e3 for v in r[f"{p}_s"]] for r in self.ranks] for p in ("step", *PHASES)}
        out["other"] = [[s - sum(out[p][i][j] for p in PHASES) for j, s in enumerate(row)]
                        for i, row in enumerate(out["step"])]  # fmt: skip
        return out

    def phase_ms(self, phase: str) -> list[list[float]]:
        """[rank][step] milliseconds in ``phase`` ("step", "other" or one of :data:`PHASES`)."""
        table = self.steps_ms
        if phase not in table:
            raise ValueError(f"phase={phase!r}: one of {list(table)}")
        return table[phase]

    @property
    def allreduce_calls(self) -> list[list[list[int]]]:
        return [r["allreduce_calls"] for r in self.ranks]

    @property
    def allreduce_bytes(self) -> list[list[list[int]]]:
        return [r["allreduce_bytes"] for r in self.ranks]

    @property
    def losses(self) -> list[float]:
        return self.ranks[0]["losses"]

    @property
    def val_losses(self) -> list[tuple[int, float]]:
        return [tuple(v) for v in self.ranks[0]["val_losses"]]

    @property
    def grad_norm(self) -> list[list[float]]:
        return [r["grad_norm"] for r in self.ranks]

    @property
    def memory_mb(self) -> list[list[float]]:
        return [r["memory_mb"] for r in self.ranks]

    @property
    def host_syncs(self) -> list[list[int]]:
        """[rank][step] host-device syncs in the step's forward and backward together."""
        return [[sum(s.values()) for s in r["host_syncs"]] for r in self.ranks]

    def host_syncs_in(self, phase: str) -> list[list[int]]:
        """[rank][step] host-device syncs in ``phase`` ("forward" or "backward")."""
        return [[s[phase] for s in r["host_syncs"]] for r in self.ranks]

    @property
    def samples(self) -> list[list[list[int]]]:
        return [r["indices"] for r in self.ranks]

    def facts(self, rank: int = 0) -> dict[str, Any]:
        """What rank ``rank``'s process says about itself: threads, cores, environment, runtime
        flags, loader, optimizer, model, micro-batch and accumulation."""
        r = self.ranks[rank]
        return {"threads": r["threads"], "cores": r["cores"], "world_size": r["world_size"],
                "device": r["device"], "backend": r["backend"], "env": r["env"],
                "runtime": r["runtime"], "loader": r["loader"], "optimizer": r["optimizer"],
                "model": r["model"], "global_batch": r["global_batch"],
                "micro_batch": r["micro_batch"], "grad_accum": r["grad_accum"],
                "checkpoint": r.get("checkpoint", {})}  # fmt: skip

    # ---------------------------------------------------------------- the traces
    @property
    def traces(self) -> list[Path | None]:
        return [Path(r["trace"]) if r.get("trace") else None for r in self.ranks]

    def trace(self, rank: int = 0):
        """Rank ``rank``'s profiler trace, loaded (:class:`labkit.profiling.trace.Trace`)."""
        return _load(str(self._trace_path(rank)))

    def _trace_path(self, rank: int) -> Path:
        path = self.traces[rank]
        if path is None or not path.exists():
            raise FileNotFoundError(
                f"rank {rank} has no profiler trace{f' at {path}' if path else ''}: the job "
                "directory was pruned (LABKIT_KEEP_RUNS) or the run had profile_steps=0; re-run "
                "the job")  # fmt: skip
        return path

    def ops_by_phase(self, rank: int = 0) -> dict[str, Counter[str]]:
        """The operators of rank ``rank``'s traced steps, counted in each labelled phase (an op
        belongs to the phase whose range, on any thread, holds its start), and those that ran
        in a step outside every phase (:data:`OUTSIDE`): per traced step."""
        t = self.trace(rank)
        steps = t.steps
        ranges = sorted((s.start_us, s.end_us, s.name)
                        for s in t.spans(cat="user_annotation") if s.name in PHASES)  # fmt: skip
        out: dict[str, Counter[str]] = {p: Counter() for p in (*PHASES, OUTSIDE)}
        for op in t.spans(cat="cpu_op"):
            if not any(st.start_us <= op.start_us < st.end_us for st in steps):
                continue
            where = next((name for lo, hi, name in ranges if lo <= op.start_us < hi), OUTSIDE)
            out[where][op.name] += 1
        n = max(1, len(steps))
        return {p: Counter({k: v / n for k, v in c.items()}) for p, c in out.items()}

    def matmul_dtypes(self, rank: int = 0) -> Counter[str]:
        """The input dtypes of the forward phase's matrix multiplications in rank ``rank``'s
        trace (recorded with shapes on a GPU; empty where the trace has no types)."""
        t = self.trace(rank)
        fwd = [(s.start_us, s.end_us) for s in t.spans(cat="user_annotation", name="forward")]
        found: Counter[str] = Counter()
        for op in t.spans(cat="cpu_op"):
            if op.name in MATMULS and any(lo <= op.start_us < hi for lo, hi in fwd):
                types = op.args.get("Input type") or []
                if types and types[0]:
                    found[str(types[0])] += 1
        return found

    def gpu_copies(self, rank: int = 0) -> Counter[str]:
        """The host↔device copies in rank ``rank``'s trace, by kind (empty on a CPU)."""
        t = self.trace(rank)
        return Counter(s.name for s in t.spans(cat="gpu_memcpy"))

    # ---------------------------------------------------------------- the picture
    def plot(self, title: str = ""):
        """Where each rank's step goes (median ms per phase, stacked) and every step's time
        per rank: a slow rank, a phase that grows, or steps that wander show at a glance.
        Returns the matplotlib figure."""
        import matplotlib.pyplot as plt

        table = self.steps_ms
        parts = (*PHASES, "other")
        fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2), width_ratios=(1, 2))
        for r in range(self.world_size):
            bottom = 0.0
            for i, p in enumerate(parts):
                v = max(0.0, median(table[p][r]))
                left.bar(r, v, bottom=bottom, color=f"C{i}", label=p if r == 0 else None)
                bottom += v
            right.plot(range(1, len(table["step"][r]) + 1), table["step"][r], marker="o", ms=3,
                       label=f"rank {r}")  # fmt: skip
        left.set(xticks=range(self.world_size), xlabel="rank", ylabel="ms per step (median)",
                 title="where a step goes (measured)")  # fmt: skip
        left.legend(fontsize=7)
        right.set(xlabel="step (the first warms up)", ylabel="step, ms (measured)",
                  title=title or "every step, per rank")  # fmt: skip
        right.legend(fontsize=7)
        fig.tight_layout()
        return fig

    # ---------------------------------------------------------------- the report
    def report(self) -> str:
        """Every measurement and fact, as the tables an engineer would print."""
        return "\n\n".join([self.steps_table(), self.collectives_table(), self.series_table(),
                            self.facts_table(), self.samples_table()])  # fmt: skip

    def steps_table(self) -> str:
        table = self.steps_ms
        cols = ("step", *PHASES, "other")
        lines = [f"measured: {self.tokens_per_s:,.0f} tokens/s (global batch "
                 f"{self.ranks[0]['global_batch']} sequences, the slowest rank's median step)",
                 "ms per optimizer step, median [first quartile–third quartile] over the "
                 "steps after the first:",
                 f"{'rank':>4}" + "".join(f"{c:>19}" for c in cols)]  # fmt: skip
        for r in range(self.world_size):
            cells = []
            for c in cols:
                lo, hi = quartiles(table[c][r])
                cells.append(f"{median(table[c][r]):>7.1f} [{lo:.1f}–{hi:.1f}]".rjust(19))
            lines.append(f"{r:>4}" + "".join(cells))
        return "\n".join(lines)

    def collectives_table(self) -> str:
        calls, sent = self.allreduce_calls[0], self.allreduce_bytes[0]
        k = len(calls[0]) if calls else 0
        per_mb = [median([s[j] for s in calls]) for j in range(k)]
        bytes_mb = [median([s[j] for s in sent]) for j in range(k)]
        m = self.ranks[0]["model"]
        return "\n".join([
            f"all-reduce calls issued by each micro-batch's backward (rank 0, median per step; "
            f"{k} micro-batch(es) of {self.ranks[0]['micro_batch']} sequences):",
            "  calls: " + ", ".join(f"{c:g}" for c in per_mb),
            "  bytes: " + ", ".join(f"{b:,.0f}" for b in bytes_mb),
            f"gradient: {m['gradient_bytes']:,} bytes in {m['tensors']} tensors "
            f"({m['parameters']:,} parameters)",
        ])  # fmt: skip

    def series_table(self) -> str:
        def row(xs: Sequence[float], fmt: str) -> str:
            return ", ".join(format(x, fmt) for x in xs)

        return "\n".join([
            "per step (rank 0 unless said):",
            f"  loss (mean over ranks): {row(self.losses, '.3f')}",
            f"  gradient norm:          {row(self.grad_norm[0], '.3f')}",
            f"  memory, MiB ({'peak allocated' if self.tier != 'cpu' else 'resident'}): "
            f"{row(self.memory_mb[0], '.0f')}",
            f"  host syncs (forward):   {row(self.host_syncs_in('forward')[0], 'g')}",
            f"  host syncs (backward):  {row(self.host_syncs_in('backward')[0], 'g')}"
            + ("  (a CPU has no device to wait for)" if self.tier == "cpu" else ""),
            "  validation loss (after step): "
            + ", ".join(f"{s}: {v:.3f}" for s, v in self.val_losses),
        ])  # fmt: skip

    def facts_table(self) -> str:
        lines = ["facts, per rank:"]
        for r in range(self.world_size):
            f = self.facts(r)
            lines.append(f"  rank {r}: {f['threads']} PyTorch threads on {f['cores']} cores "
                         f"({f['world_size']} ranks, {f['device']}, {f['backend']}); "
                         f"env {f['env'] or '{}'}")  # fmt: skip
        f = self.facts(0)
        lines += [f"  runtime: {f['runtime']}", f"  loader: {_rounded(f['loader'])}",
                  f"  optimizer: {f['optimizer']}", f"  model: {f['model']}",
                  f"  checkpoint: {f['checkpoint'] or 'none'}",
                  f"  batch: global {f['global_batch']} sequences; micro-batch "
                  f"{f['micro_batch']} × {f['grad_accum']} accumulation steps per rank"]  # fmt: skip
        return "\n".join(lines)

    def ops_table(self, rank: int = 0, top: int = 6) -> str:
        """The profiler trace's busiest operators in each phase of rank ``rank``'s traced
        steps, with calls per step: notebook 06's table, split by phase."""
        lines = [f"operators per traced step, rank {rank} ({self.traces[rank]}):"]
        for where, ops in self.ops_by_phase(rank).items():
            shown = ", ".join(f"{name} ×{n:g}" for name, n in ops.most_common(top))
            lines.append(f"  {where:<22} {sum(ops.values()):>6g} calls: {shown or '—'}")
        return "\n".join(lines)

    def samples_table(self) -> str:
        lines = ["sample indices handed out (first 8 of each epoch):"]
        for r, epochs in enumerate(self.samples):
            for i, idx in enumerate(epochs[:3]):
                lines.append(f"  rank {r}, epoch {i}: {idx[:8]} … ({len(idx)} in all)")
        return "\n".join(lines)


def _rounded(d: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()}


@functools.lru_cache(maxsize=8)
def _load(path: str):
    from labkit.profiling.trace import load_trace

    return load_trace(path)
