"""The GPU evidence notebook 06 sets beside what this machine profiled, labelled as recorded.

Two pieces, each read with the learner's own tools (``labkit.profiling``) and each saying where
it comes from: the course's training step profiled on a real GPU (a shipped profile
recording, else the step times a GPU recorded, beside this machine's), and a public trace of a
real multi-GPU job. Separate from ``profiles``, ``public`` and ``show``, which load, fetch and
phrase them: this module only puts them together as a notebook cell shows them, so the cell is
one call and one ``print(x.describe())``. Nothing here runs at import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from labkit.profiling import PHASES, Trace, hta_report, hta_side_by_side, load_traces, summarize_job
from labkit.profiling import plot_trace as _plot_trace
from labkit.recordings import load_shipped, profiles, public, show


@dataclass(frozen=True)
class StepEvidence:
    """The training step as a GPU recorded it: a shipped profile (``recording``), else its
    recorded step times beside this machine's (``text`` says which)."""

    recording: profiles.ProfileRecording | None
    text: str

    def describe(self) -> str:
        return self.text

    def plot(self, ax: Any = None) -> Any:
        """One step of the shipped profile's first rank (nothing to draw without one)."""
        if self.recording is None:
            raise ValueError("no GPU profile ships with this labkit: nothing to draw")
        return _plot_trace(self.recording.traces[0], steps=slice(0, 1), ax=ax,
                           title=f"One step of the gpu preset, {self.recording.label()}")


def step_evidence(here: Trace, *, preset: str, dtype: str, device: str,
                  tokens_per_step: int) -> StepEvidence:
    """The shipped GPU profile of the step, summarised; else, what a GPU recorded of the step
    (its time) beside ``here``'s steps (the profiled trace of this machine, labelled)."""
    shipped = profiles.shipped_profiles()  # labkit/recordings/profiles/*/
    if shipped:
        rec = profiles.load_profile(shipped[0])
        return StepEvidence(rec, profiles.summarize(rec, phases=PHASES))
    # what a GPU did record: the step time, beside the steps profiled here (labelled)
    profiled = show.measured_here([s.dur_us / 1e6 for s in here.steps], preset=preset,
                                  dtype=dtype, device=device, tokens_per_step=tokens_per_step,
                                  what="seconds per step under the profiler (section 1's trace)")
    return StepEvidence(None, profiles.NONE_SHIPPED + "\n"
                        + show.throughput_beside(load_shipped(), profiled))


@dataclass(frozen=True)
class PublicJob:
    """A public multi-rank trace read with ``labkit.profiling`` (per rank, the collectives,
    where the time goes, the straggler, HTA beside labkit); or why it is not here."""

    found: str
    """Where the traces were found, or why they were not (how to get them)."""
    label: str = ""
    traces: Sequence[Trace] = ()
    text: str = ""

    def describe(self) -> str:
        return self.text if self.traces else self.found

    def plot(self, ax: Any = None) -> Any:
        """One step of rank 0's trace."""
        if not self.traces:
            raise ValueError(f"no public traces to draw: {self.found}")
        return _plot_trace(self.traces[0], steps=slice(0, 1), ax=ax,
                           title="Rank 0 of a 128-GPU job, one step (public trace, not measured "
                                 "here)")  # fmt: skip


def public_job(key: str = public.MULTI_RANK, *, allow_fetch: bool = True) -> PublicJob:
    """Find (or, when allowed and not offline, fetch) public job ``key`` and read it."""
    folder, found = public.find_or_fetch(key, allow_fetch=allow_fetch)
    if folder is None:
        return PublicJob(found)
    label = public.JOBS[key].label()
    traces = load_traces(folder)
    job = summarize_job(traces)  # the same rank_times and gpu_split as on this machine's job
    text = "\n".join([f"{label} ({found})", "", job.rank_table(), "", job.comm_table(), "",
                      job.where_time_goes(), job.straggler_verdict(), "",
                      hta_side_by_side(hta_report(folder), traces)])
    return PublicJob(found, label, traces, text)
