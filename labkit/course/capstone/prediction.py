"""Notebook 07's expectation: one rank's step, timed in this process, and the job's measurements
held against it.

    prediction = capstone.predict(nproc, device)    # section 2: one rank's step, measured here
    print(prediction.describe())                    # the step, and the tokens/s it predicts
    print(prediction.against(job).describe())       # section 3: the job's speed against it
    control = capstone.rerun(job, dataclasses.asdict(capstone.Settings()))
    print(capstone.Reconcile(fixed, control, prediction).describe())   # section 6

In a data-parallel job every rank computes its share at the same time, so a healthy job's step
takes about one rank's step, plus the gradient all-reduce: predicted tokens/s = tokens per
optimizer step ÷ one rank's median step. Every verdict here compares two measured samples
(:func:`labkit.verdict.compare_times`), so a busy machine says "too noisy to tell" rather than
inventing a gap. Nothing here knows the job's faults: it reads measurements only.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from labkit import verdict
from labkit.course.capstone.job import CapstoneRun
from labkit.course.capstone.settings import Settings


def _steps(run: CapstoneRun) -> list[float]:
    """One rank's step seconds after the first (every rank waits for the slowest)."""
    return run.ranks[0]["step_s"][1:]


@dataclass(frozen=True)
class Prediction:
    """One rank's step of the job's own model and batch, timed in this process with nothing else
    going on, and the tokens/s it predicts for a healthy job."""

    steps_s: tuple[float, ...]
    """The step seconds measured, warm-up left out."""
    nproc: int
    micro_batches: int
    """Micro-batches in one rank's share of the global batch."""
    micro_batch: int
    seq_len: int
    global_batch: int
    dtype: str
    device: str
    """Where the step ran: "cpu" or "cuda"."""

    @property
    def step_s(self) -> float:
        """One rank's step: the median of :attr:`steps_s`, seconds."""
        return statistics.median(self.steps_s)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def tokens_per_s(self) -> float:
        """Predicted: tokens per optimizer step ÷ one rank's step (all-reduce not counted)."""
        return self.tokens_per_step / self.step_s

    def describe(self) -> str:
        return (f"measured here: one rank's step ({self.micro_batches} micro-batches of "
                f"{self.micro_batch} × {self.seq_len} tokens, forward, backward, AdamW, "
                f"{self.dtype} on {self.device}) takes {self.step_s * 1e3:.1f} ms (median of "
                f"{len(self.steps_s)})\n"
                f"predicted: a healthy job on {self.nproc} ranks runs about "
                f"{self.tokens_per_s:,.0f} tokens/s ({self.tokens_per_step:,} tokens per step), "
                "all-reduce not counted")  # fmt: skip

    def against(self, run: CapstoneRun) -> JobAgainstPrediction:
        """``run``'s measured speed held against this prediction."""
        return JobAgainstPrediction(run, self)


def predict(nproc: int, device: str, *, repeats: int = 12, warmup: int = 2) -> Prediction:
    """Time one rank's step of the capstone job at its right settings (:class:`Settings`: used
    only to predict) in this process: the job's model (the smoke preset's, capstone_train's
    default, with the job's vocabulary), one rank's share of the global batch in micro-batches,
    AdamW, the job's default dtype on ``device``. ``repeats`` steps, the first ``warmup`` left
    out; :func:`labkit.train.train_step` waits for the device before reading the clock."""
    import dataclasses

    import torch

    from labkit import config, data, train
    from labkit.model import GPT

    if not 0 <= warmup < repeats:
        raise ValueError(f"warmup={warmup!r} is not allowed: from 0 to repeats - 1 ({repeats - 1})")
    right = Settings()  # the job's knobs at their right values: used only to predict
    cfg = config.preset("smoke")  # the job's model (capstone_train's default), with its vocabulary
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=right.vocab_size))
    k = right.global_batch // nproc // right.micro_batch
    on = torch.device("cuda" if device == "cuda" else "cpu")  # where one rank computes
    dtype = "bfloat16" if on.type == "cuda" else "float32"  # the job's default on each device
    torch.manual_seed(0)
    model = GPT(cfg.model).to(on)
    opt = train.make_optimizer(model, cfg.train)
    splits = data.load_splits()
    gen = torch.Generator().manual_seed(0)
    batches = [data.get_batch(splits.train, right.micro_batch, cfg.model.seq_len, gen, on)
               for _ in range(k)]  # fmt: skip
    step_s = [train.train_step(model, opt, batches, device=on, dtype=dtype).seconds
              for _ in range(repeats)]  # fmt: skip
    return Prediction(tuple(step_s[warmup:]), nproc, k, right.micro_batch, cfg.model.seq_len,
                      right.global_batch, dtype, on.type)  # fmt: skip


@dataclass(frozen=True)
class JobAgainstPrediction:
    """A run's speed against the prediction: the ratio of the medians, and a verdict on both
    step samples."""

    run: CapstoneRun
    prediction: Prediction

    @property
    def comparison(self) -> verdict.Comparison:
        return verdict.compare_times(_steps(self.run), self.prediction.steps_s,
                                     names=("your job's step", "predicted step"))  # fmt: skip

    def describe(self) -> str:
        measured, predicted = self.run.tokens_per_s, self.prediction.tokens_per_s
        ratio = predicted / measured
        how = (f"{ratio:.1f}× slower than expected" if ratio >= 1
               else f"{1 / ratio:.1f}× faster than expected")  # fmt: skip
        return (f"measured: {measured:,.0f} tokens/s against {predicted:,.0f} predicted (median "
                f"steps; {how}). Spread:\n{self.comparison}")  # fmt: skip


@dataclass(frozen=True)
class Reconcile:
    """Section 6: the fixed job against the healthy one (the right settings, run now on this
    machine), and the healthy one against the prediction. Two questions the prediction alone
    mixes up get a measurement each: is a fault left, and what does the prediction leave out."""

    fixed: CapstoneRun
    control: CapstoneRun
    """The same job with the right settings (``capstone.Settings()``'s defaults), run now."""
    prediction: Prediction

    @property
    def left(self) -> verdict.Comparison:
        """Fixed job's steps against the healthy job's, within 10%."""
        return verdict.compare_times(_steps(self.fixed), _steps(self.control), tolerance=0.1,
                                     names=("fixed job's step", "healthy job's step"))  # fmt: skip

    @property
    def gap(self) -> verdict.Comparison:
        """The healthy job's steps against the predicted step, within 20%."""
        return verdict.compare_times(_steps(self.control), self.prediction.steps_s, tolerance=0.2,
                                     names=("healthy job's step", "predicted step"))  # fmt: skip

    def describe(self) -> str:
        left, gap, predicted = self.left, self.gap, self.prediction.tokens_per_s
        lines = [f"measured: the fixed job {self.fixed.tokens_per_s:,.0f} tokens/s; the healthy "
                 f"job (the right settings, run just now) {self.control.tokens_per_s:,.0f}; "
                 f"predicted {predicted:,.0f}", str(left)]  # fmt: skip
        if left.outcome == "faster" and left.faster.name == "healthy job's step":
            lines.append("A fault is still there, or a change costs time: the same job with the "
                         "right settings runs faster on this machine, now. Read the fixed job's "
                         "evidence again (current.evidence()) for what still differs from "
                         "control.evidence().")  # fmt: skip
        elif left.outcome == "noisy":
            lines.append("Too noisy to tell the fixed job from the healthy one on this machine "
                         "right now: rerun this cell when it is quieter.")  # fmt: skip
        else:
            lines.append("No fault is left that speed shows: the fixed job runs as fast as the "
                         "healthy one (or faster, within this machine's noise).")  # fmt: skip
        lines.append(str(gap))
        if gap.outcome == "faster" and gap.faster.name == "predicted step":
            lines.append(f"The healthy job itself is {predicted / self.control.tokens_per_s:.1f}× "
                         "slower than predicted: that gap is the prediction's, not a fault's. It "
                         "left out the data, the gradient all-reduce (gloo runs it on the ranks' "
                         "own cores) and the machine's other work; control.evidence().report() "
                         "shows which phases grew against section 2's step.")  # fmt: skip
        elif gap.outcome == "faster":
            lines.append("The healthy job runs faster than predicted: section 2's step was timed "
                         "while something else ran; rerun it to see the prediction move.")  # fmt: skip
        elif gap.outcome == "agree":
            lines.append("The healthy job runs as predicted (within 20%): one rank's step is what "
                         "a healthy job costs here; the all-reduce and the data add little.")  # fmt: skip
        else:
            lines.append("Too noisy to hold the healthy job against the prediction on this "
                         "machine right now.")  # fmt: skip
        return "\n".join(lines)


def describe_summary(fixes, prediction: Prediction, *, solved: bool = True) -> str:
    """What the run measured, in one place (the figures a closing report asks for): the
    prediction, the baseline, each fix tried (:class:`labkit.course.capstone.FixSequence`'s
    trials) and the fixed job; ``solved`` False while the learner's diagnose has not passed."""
    job = fixes.job
    lines = [f"job {job.code}, {job.tier} tier, size {job.size!r}, {len(job.ranks)} ranks",
             f"  predicted healthy job (one rank's step, measured in this kernel): "
             f"{prediction.tokens_per_s:,.0f} tokens/s",
             f"  baseline (measured): {job.tokens_per_s:,.0f} tokens/s"]  # fmt: skip
    for t in fixes.trials:
        lines.append(f"  {t.fault}: {t.before.tokens_per_s:,.0f} → {t.after.tokens_per_s:,.0f} "
                     f"tokens/s, kept: {'yes' if t.kept else 'no'} ({t.why})")  # fmt: skip
    if not solved:
        lines.append("  fixed: waits for your diagnose (07.diagnose)")
    else:
        now = fixes.current
        lines.append(f"  fixed (measured): {now.tokens_per_s:,.0f} tokens/s, "
                     f"{now.tokens_per_s / job.tokens_per_s:.2f}× the baseline")  # fmt: skip
    return "\n".join(lines)
