"""Section 8's bottlenecks, read out: what each fix was predicted to do and what the measurement
says it did (data loading, torch.compile), in notebook 06's sentences.

Separate from ``bottlenecks`` (which plants and measures): this module only reads a
``BeforeAfter`` and chooses the sentence from its samples (``labkit.verdict``), so a notebook
cell is the measurement and one ``print(x.describe())``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from labkit import verdict
from labkit.profiling.bottlenecks import BeforeAfter, CompileResult, time_batch_loading


@dataclass(frozen=True)
class LoadingPrediction:
    """A batch's loading time and a step's compute time (measured), and what they predict: with
    ``num_workers=0`` a step pays both; with one worker keeping up, the larger."""

    load_s: float
    compute_s: float
    passes: int

    @property
    def before_s(self) -> float:
        return self.load_s + self.compute_s

    @property
    def after_s(self) -> float:
        return max(self.load_s, self.compute_s)

    def describe(self) -> str:
        return (f"measured: loading a batch ({self.passes} tokeniser passes per item) takes "
                f"{self.load_s * 1e3:.1f} ms; a training step computes in "
                f"{self.compute_s * 1e3:.1f} ms (section 2, profiler off)\n"
                f"predicted: num_workers=0 → {self.before_s * 1e3:.1f} ms per step; one worker "
                f"keeping up → {self.after_s * 1e3:.1f} ms")  # fmt: skip

    def against(self, loading: BeforeAfter) -> LoadingFix:
        """This prediction beside the fix as measured (``measure_data_loading``)."""
        return LoadingFix(loading, self)


def predict_loading(dataset: Any, *, batch_size: int, compute_s: float,
                    batches: int = 3) -> LoadingPrediction:
    """The prediction from ``bottlenecks.time_batch_loading`` (``batches`` batches of
    ``dataset`` loaded in this process, the median) beside a step's ``compute_s``: the
    measuring is there, this only reads its result."""
    loading = time_batch_loading(dataset, batch_size=batch_size, batches=batches)
    return LoadingPrediction(loading.median_s, compute_s, dataset.passes)


@dataclass(frozen=True)
class LoadingFix:
    """The data-loading fix measured (``measure_data_loading``) against its two predictions:
    the timing above, and max(load, compute) from the ``num_workers=0`` steps' own rounds."""

    loading: BeforeAfter
    predicted: LoadingPrediction

    def floor(self) -> verdict.Comparison:
        """The fixed loader's steps against max(load, compute) of each num_workers=0 step."""
        before = self.loading.before
        in_round = [max(d, c) for d, c in zip(before.data_s, before.compute_s, strict=True)]
        return verdict.compare_times(in_round, self.loading.after.step_s,
                                     names=("predicted: max(load, compute)",
                                            f"measured: {self.loading.after.name}"))  # fmt: skip

    def describe(self) -> str:
        ld, p = self.loading, self.predicted
        before, after = ld.before, ld.after
        lines = [str(ld), "",
                 f"predicted (from the timing above) {p.before_s * 1e3:.1f} → "
                 f"{p.after_s * 1e3:.1f} ms per step; measured {before.median_s * 1e3:.1f} → "
                 f"{after.median_s * 1e3:.1f} ms; data wait {before.data_share:.0%} → "
                 f"{after.data_share:.0%} of the step"]  # fmt: skip
        outcome = ld.comparison()
        if outcome.outcome == "faster" and outcome.faster.name == after.name:
            lines.append(f"The fix made the steps {ld.speedup:.2f}× faster: the worker loads the "
                         "next batches while a step computes."
                         + (" Some wait remains: the worker does not fully keep ahead on this "
                            "machine." if after.data_share > 0.1 else ""))  # fmt: skip
        elif after.data_share < before.data_share / 2:
            lines.append("The wait for data fell, but the steps did not get measurably faster, "
                         "most likely because the worker's tokenising competes with the training "
                         "process for the cores (a busy or 2-core machine).")  # fmt: skip
        else:
            lines.append("This run does not show the fix working: the worker did not keep ahead "
                         "of the steps on this machine right now.")  # fmt: skip
        # The prediction again, from the loads and computes of the num_workers=0 steps
        # themselves (the same rounds as the fix, so the same machine load): one worker keeping
        # up makes each step max(load, compute).
        floor = self.floor()
        lines += ["", f"measured in the same rounds with num_workers=0: loading "
                  f"{statistics.median(before.data_s) * 1e3:.1f} ms, compute "
                  f"{statistics.median(before.compute_s) * 1e3:.1f} ms per step (medians)",
                  str(floor), _floor_sentence(floor)]
        return "\n".join(lines)


def _floor_sentence(floor: verdict.Comparison) -> str:
    if floor.outcome == "agree":
        return "The fixed loader reached the predicted floor: one worker kept up."
    if floor.outcome == "faster" and floor.faster.name.startswith("predicted"):
        return ("The fixed loader stayed above the predicted floor: the worker did not fully keep "
                "ahead, or it slowed the training process by taking a core from it.")
    if floor.outcome == "faster":
        return ("The fixed loader came out below the predicted floor, which one worker cannot "
                "beat if a batch costs in the worker what it costs in the training process: here "
                "it cost less there (or the machine was quieter during its blocks).")
    return "This run cannot hold the fix against the predicted floor: rerun on a quieter machine."


@dataclass(frozen=True)
class CompileBound:
    """The most compiling can speed a step up: 1 / the share of matmuls and attention, the work
    it leaves to library kernels. ``compiled`` is the measurement, or None when not run."""

    core_share: float
    compiled: CompileResult | None = None
    skipped: str = ""
    """Why it was not measured, when it was not."""

    def prediction(self) -> str:
        return (f"predicted: at most {1 / self.core_share:.1f}× faster (1 / {self.core_share:.0%},"
                " the share of matmuls and attention, section 1)")

    def describe(self) -> str:
        c = self.compiled
        if c is None:
            return self.skipped
        outcome = c.comparison()
        if outcome.outcome == "faster" and outcome.faster.name == c.after.name:
            said = (f"Compiling paid here: {c.speedup:.2f}× per step (bound "
                    f"{1 / self.core_share:.1f}×); the {c.compile_s:.1f} s compile is repaid "
                    f"after about {c.break_even_steps:,.0f} steps.")
        elif outcome.outcome == "agree":
            said = ("Compiling did not pay on this machine: eager and compiled agree within the "
                    "tolerance, so the compile time is not repaid.")
        else:
            said = "This run cannot tell whether compiling paid: rerun on a quieter machine."
        return f"{c}\n{said}"


def judge_compile(core_share: float, compiled: CompileResult | None, *,
                  size: str) -> CompileBound:
    """``compiled`` (``measure_compile``) against the bound; None: not measured at ``size``."""
    return CompileBound(core_share, compiled,
                        f"skipped at size={size!r}: a cold torch.compile takes about a minute on "
                        "a 2-core machine. Run with run_compile=True (or at lab size) to measure "
                        "it.")  # fmt: skip
