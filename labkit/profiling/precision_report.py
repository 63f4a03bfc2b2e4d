"""A training step per precision, read out: its speed, where its time goes, which case this
machine is (what notebook 04's section 7 prints, as describe()).

Three findings, each a result that describes itself: the step timed per precision against fp32
(and tf32) with :mod:`labkit.verdict`'s spread and sentence (:class:`StepTimes`); where the
step's time goes under the profiler, Amdahl's bound and which part grew (:class:`StepProfiles`);
and which case this machine is, from the matmul sweep and the timed step (:func:`describe_case`).

Apart from :mod:`labkit.precision.speed`, which measures, because these sentences compare
measured samples with :mod:`labkit.verdict` (a module on the same layer as ``precision``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from labkit import precision, verdict
from labkit.profiling.capture import quiet_kineto
from labkit.roofline import MatmulSweep


@dataclass(frozen=True)
class StepTimes:
    """Seconds of the training step per precision (``precision.step_times``' samples), each
    against fp32's (and tf32's where timed)."""

    times: Mapping[str, Sequence[float]]
    tokens: int
    """Tokens per step."""
    label: str
    """Whose ratios these are (the sweep's ``ratio_label``)."""
    device_type: str = "cpu"
    size: str = "lab"
    """The notebook's size, and the preset the model was built from (``model``)."""
    model: str = "lab"

    @property
    def medians(self) -> dict[str, float]:
        """Median seconds per step, per precision."""
        return {d: verdict.summarize(s).median for d, s in self.times.items()}

    @property
    def fp32_median(self) -> float:
        return self.medians["float32"]

    def describe(self) -> str:
        times, medians, fp32 = self.times, self.medians, self.fp32_median
        lines = [f"training step, {self.tokens} tokens, measured in alternated rounds "
                 f"({self.label}):"]
        for dtype, seconds in times.items():
            lines.append(f"  {dtype:<9}{self.tokens / medians[dtype]:>12,.0f} tokens/s  = "
                         f"{fp32 / medians[dtype]:.3g} × fp32")
            if dtype != "float32":
                lines.append(str(verdict.compare_times(seconds, times["float32"],
                                                       names=(dtype, "float32"))))
            if dtype not in ("float32", "tf32") and "tf32" in times:
                lines.append(str(verdict.compare_times(seconds, times["tf32"],
                                                       names=(dtype, "tf32"))))
        if self.device_type == "cuda" and self.size != "gpu":
            lines.append(f"\nsize={self.size!r} times the {self.model!r} model on this GPU: too "
                         "small to keep a GPU busy (each kernel is short and the step waits on "
                         "the host launching the next), so expect about 1× for every precision "
                         "here. Rerun with size='gpu' to see the tensor-core gain.")
        return "\n".join(lines)


PARTS = ("matmuls", "attention", "casts", "everything else")
"""The parts of a profiled step: what 16-bit arithmetic can speed up, what it costs, the rest."""


@dataclass(frozen=True)
class StepProfiles:
    """The least disturbed profile of one step per precision, against the timed step."""

    profiles: Mapping[str, precision.StepProfile]
    steps: StepTimes
    """The timed steps (alternated rounds), which decide the speed ratios."""

    def parts(self, dtype: str) -> dict[str, float]:
        """Seconds of one step per part (:data:`PARTS`)."""
        prof = self.profiles[dtype]
        found = {"matmuls": prof.matmul_s, "attention": prof.attention_s, "casts": prof.cast_s}
        found["everything else"] = prof.step_s - sum(found.values())
        return found

    def describe(self) -> str:
        lines = ["one step per precision under torch.profiler, mean of 3 steps, the least "
                 "disturbed of 3 profiles (measured; the profiler adds time of its own, so "
                 "compare shares):"]
        for dtype, prof in self.profiles.items():
            engaged = ", ".join(f"{r.calls} {r.name} in {r.input_dtype}" for r in prof.matmuls)
            lines.append(f"  {dtype:<9} {prof.step_s * 1e3:7.2f} ms: " + ", ".join(
                f"{part} {prof.share(s):.0%}" for part, s in self.parts(dtype).items())
                + f"\n{'':12}{engaged}")
            for kernel in prof.kernels[:3]:
                lines.append(f"{'':12}GPU kernel {kernel.name[:80]}: {kernel.calls}×, "
                             f"{kernel.self_s * 1e3:.2f} ms")
        fp32_parts = self.parts("float32")
        f = (fp32_parts["matmuls"] + fp32_parts["attention"]) / self.profiles["float32"].step_s
        lines.append(f"\nAmdahl: matmuls and attention are {f:.0%} of the fp32 step, so 16-bit "
                     f"arithmetic can make this step at most {1 / (1 - f):.2g}× faster "
                     "(predicted from the measured shares)")
        medians = self.steps.medians
        for dtype in list(self.profiles)[1:]:
            in_fp32 = [r for r in self.profiles[dtype].matmuls if r.input_dtype == "float32"]
            mine = self.parts(dtype)
            change = {part: mine[part] - fp32_parts[part] for part in fp32_parts}
            worst = max(change, key=change.get)
            ratio = medians["float32"] / medians[dtype]
            said = (f"{sum(r.calls for r in in_fp32)} matmuls still ran in float32 under "
                    "autocast: look for an explicit dtype or a cast in the model. " if in_fp32
                    else "autocast engaged every matmul. ")
            if change[worst] > 0:
                said += (f"Against fp32 the {worst} grew most ({change[worst] * 1e3:.2f} ms more "
                         "a step)")
            else:
                said += "Against fp32 no part of the step grew"
            if worst != "matmuls" or change[worst] <= 0:
                delta = change["matmuls"] * 1e3
                said += f", the matmuls took {abs(delta):.2f} ms {'less' if delta < 0 else 'more'}"
            if ratio < 1:
                said += (f"; the timed step ran at {ratio:.2g}× fp32's speed: slower, so what "
                         "grew decides.")
            elif ratio <= 1 / (1 - f):
                said += (f"; the timed step ran at {ratio:.2g}× fp32's speed, within the Amdahl "
                         f"bound of {1 / (1 - f):.2g}×.")
            else:
                said += (f"; the timed step ran at {ratio:.2g}× fp32's speed, above the Amdahl "
                         f"bound of {1 / (1 - f):.2g}×: the profiled shares and the timed steps "
                         "disagree (a busy machine); rerun both cells.")
            lines.append(f"{dtype}: {said}")
        return "\n".join(lines)


def profile_precisions(model: nn.Module, train_cfg: Any, batch: tuple[torch.Tensor, torch.Tensor],
                  steps: StepTimes, dtypes: Sequence[str], *, device: torch.device,
                  rounds: int = 3) -> StepProfiles:
    """``rounds`` profiles per dtype of ``dtypes`` (``precision.profile_step``; float32 first),
    taking turns; keeps each one's least disturbed (shortest) profile. Quiets kineto's log
    lines first."""
    quiet_kineto()  # no kineto log line at every profiler start and stop
    profiles: dict[str, precision.StepProfile] = {}
    for _ in range(rounds):
        for dtype in dtypes:
            prof = precision.profile_step(model, train_cfg, batch, device=device, dtype=dtype)
            if dtype not in profiles or prof.step_s < profiles[dtype].step_s:
                profiles[dtype] = prof
    return StepProfiles(profiles, steps)


def describe_case(sweep: MatmulSweep, steps: StepTimes, width: int) -> str:
    """Which case this machine is, per 16-bit precision timed: no fast matmul; fast matmuls but
    a slower step (small matmuls, ops and casts around them); or a faster step. ``width``: the
    model's d_model, matched to the sweep's nearest size."""
    sizes = sorted({r.n for r in sweep.rows})
    swept = dict.fromkeys(r.precision for r in sweep.rows)  # in the sweep's order
    at = min(sizes, key=lambda n: abs(n - width))
    lines = []
    # the 16-bit dtypes timed under autocast (tf32 is a mode of float32, not one of them)
    for p in (p for p in swept if p in steps.times and p not in ("float32", "tf32")):
        fastest = max(sizes, key=lambda n: sweep.speed_ratio(p, n))
        best, at_width = sweep.speed_ratio(p, fastest), sweep.speed_ratio(p, at)
        step = steps.fp32_median / steps.medians[p]
        where = f"n={at}" + ("" if at == width else
                             f", the sweep's size nearest this model's width {width}")
        if best <= 1:
            lines.append(f"{p}: no matmul size ran faster than fp32 here (best {best:.2g}× at "
                         f"n={fastest}): no fast {p} matmul on this hardware, and the step "
                         f"({step:.2g}× fp32) pays for it.")
        elif step < 1:
            lines.append(f"{p}: matmuls ran {best:.2g}× fp32 at n={fastest}, but {at_width:.2g}× "
                         f"at {where}; the step ran at {step:.2g}× fp32: its matmuls are small, "
                         "and the ops and casts around them do not get faster (the profile above "
                         "says which grew).")
        else:
            lines.append(f"{p}: the step ran {step:.2g}× fp32, with matmuls up to {best:.2g}× "
                         f"(n={fastest}) and {at_width:.2g}× at {where}.")
    return "\n".join(lines)
