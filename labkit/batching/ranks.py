"""The global batch over data-parallel ranks (notebook 05, section 7): a DDP job's config, its
prediction, and what the job measured.

The job itself runs from the notebook (``labkit.workers.dp_train.run``, a layer above this
package): :func:`ddp_plan` builds its config and says what to expect, :func:`read_ddp_job` reads
the per-rank results back: the sequences each rank consumed per step (counted in its training
loop), tokens/s, the collectives of the last step, and the loss against one process trained on
the whole global batch, where that reference ran.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from labkit import config, verdict
from labkit.batching.noise import global_batch


@dataclass(frozen=True)
class DdpPlan:
    """A 2-or-more-rank DDP job with gradient accumulation: where it runs and its config."""

    nproc: int
    device: str
    """"cuda" where there are GPUs for every rank, else "cpu" (gloo)."""
    micro_batch: int
    grad_accum: int
    model: config.ModelConfig
    config: dict[str, Any]
    """The dp_train worker's config."""

    @property
    def global_batch(self) -> int:
        return self.config["global_batch"]

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.model.seq_len

    def observers(self) -> list[Any]:
        """One progress line per phase of the job (``launch.ProgressLines``)."""
        from labkit.jobs import launch  # layer 3

        return [launch.ProgressLines(f"DDP on {self.nproc} {self.device} ranks")]

    def describe(self) -> str:
        return (f"predicted: global batch = {self.micro_batch} × {self.grad_accum} × {self.nproc} "
                f"ranks = {self.global_batch} sequences per step; 1 all-reduce of every gradient "
                "per step")  # fmt: skip


def ddp_plan(nproc: int, cfg: config.RunConfig, *, model_preset: str, steps: int,
             dtype: str = "float32", grad_accum: int = 2) -> DdpPlan:  # fmt: skip
    """The job on GPUs where there are ``nproc`` of them (``model_preset``'s model, ``cfg``'s
    micro-batch, ``dtype``), else on CPU ranks (the smoke model, micro-batch 4, float32)."""
    from labkit.jobs import launch  # layer 3

    device = "cuda" if launch.visible_gpu_count() >= nproc else "cpu"
    micro = 4 if device == "cpu" else cfg.train.micro_batch
    model = config.preset("smoke" if device == "cpu" else model_preset).model
    job_cfg = {
        "strategies": ["ddp"],
        "model": {k: getattr(model, k) for k in ("seq_len", "n_layer", "n_head", "d_model")},
        "train": {"steps": steps, "grad_accum": grad_accum, "lr": cfg.train.lr,
                  "dtype": dtype if device == "cuda" else "float32"},
        "global_batch": global_batch(micro, grad_accum, nproc),
        "mesh": [nproc],
    }  # fmt: skip
    return DdpPlan(nproc=nproc, device=device, micro_batch=micro, grad_accum=grad_accum,
                   model=model, config=job_cfg)  # fmt: skip


@dataclass(frozen=True)
class DdpReading:
    """What a DDP job of :func:`ddp_plan` measured, per rank and together."""

    plan: DdpPlan
    world_size: int
    backend: str
    per_rank: dict[int, list[float]]
    """Sequences each rank's forward passes took per step."""
    consumed: list[int]
    """Sequences per step, all ranks together."""
    step_s: list[float]
    """Step seconds after the first (which builds DDP's buckets)."""
    calls: int
    """Collective calls in the last step."""
    sent_per_rank: float
    predicted_sent_per_rank: float
    reference_gap: float | None
    """Largest |loss difference| against one process on the whole global batch; None where the
    reference did not run."""
    steps: int

    @property
    def tokens_per_s(self) -> float:
        return self.plan.tokens_per_step / statistics.median(self.step_s)

    def describe(self) -> str:
        gb, nproc = self.plan.global_batch, self.plan.nproc
        same = all(c == gb for c in self.consumed)
        lines = [f"measured: {self.world_size} ranks ({self.backend}) consumed "
                 + ", ".join(f"rank {r} {statistics.median(v):g}" for r, v in self.per_rank.items())
                 + f" sequences per step, {min(self.consumed)} to {max(self.consumed)} together: "
                 + (f"the predicted global batch in all {len(self.consumed)} steps" if same else
                    f"NOT the predicted {gb}: the data split is wrong"),
                 f"measured: {self.tokens_per_s:,.0f} tokens/s over the job, "
                 f"{self.tokens_per_s / nproc:,.0f} per rank",
                 verdict.summarize(self.step_s, "DDP steps").line(),
                 f"measured: {self.calls} collective call(s) in the last step, "
                 f"{self.sent_per_rank / 2**20:.3f} MiB sent per rank "
                 f"(predicted {self.predicted_sent_per_rank / 2**20:.3f} MiB: one ring all-reduce)"]  # fmt: skip
        if self.reference_gap is not None:
            lines.append(f"measured: losses of {nproc} ranks vs one process on the whole global batch "
                         f"differ by at most {self.reference_gap:.1e} over {self.steps} steps")  # fmt: skip
        else:
            lines.append("(the single-process reference would train the GPU-sized model on this CPU: "
                         "skipped here; notebook 02 checks DDP's parity with it)")  # fmt: skip
        return "\n".join(lines)


def read_ddp_job(job: Any, plan: DdpPlan, *,
                 reference_loss: Sequence[float] | None = None) -> DdpReading:  # fmt: skip
    """Read a finished dp_train job (``job.rank(r)``'s result dicts) against ``plan``;
    ``reference_loss``: the single-process reference's losses, step by step, where it ran."""
    ddp = job.rank(0)["runs"]["ddp"]
    gap = None
    if reference_loss is not None:
        gap = max(abs(a - b) for a, b in zip(ddp["loss"], reference_loss, strict=True))
    return DdpReading(
        plan=plan, world_size=job.rank(0)["world_size"], backend=job.rank(0)["backend"],
        per_rank={r: job.rank(r)["runs"]["ddp"]["sequences_per_rank_step"] for r in range(plan.nproc)},
        consumed=list(ddp["sequences_per_step"]), step_s=list(ddp["step_s"][1:]),
        calls=sum(v["calls"] for v in ddp["bytes"]["last_step"].values()),
        sent_per_rank=ddp["bytes"]["sent_per_rank_last_step"],
        predicted_sent_per_rank=ddp["bytes_predicted_sent_per_rank"],
        reference_gap=gap, steps=len(reference_loss) if reference_loss is not None else len(ddp["loss"]),
    )  # fmt: skip
