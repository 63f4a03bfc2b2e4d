"""Notebook 01's NVML trace of a training run on a GPU: what to look for, and its replay.

A trace recorded on a real GPU (``python -m labkit record-trace``, shipped under
``labkit/metrics/traces/``) replays through the same live monitor a run on this machine uses,
so a learner on any tier sees a GPU's utilisation, memory and power over a run. Where none
ships, the text says so and what can be seen instead (``show.no_trace_note``). Apart from
``show`` because this replays (it opens a monitor); ``show``'s functions only format.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from labkit.metrics import ReplayBackend, shipped_traces
from labkit.monitor import Monitor
from labkit.recordings import load_shipped, show

LOOK_FOR = (
    "* gpu_util_pct near 100% throughout, while sm_active_pct and tensor_active_pct (GPM\n"
    "  counters, Hopper and newer) stay lower: 'a kernel was running' is not 'the SMs were\n"
    "  busy' (section 4 comes back to this);\n"
    "* dips at each evaluation, where the loop stops stepping;\n"
    "* mem_used_gib jumps at the first step, then stays flat: PyTorch's caching allocator\n"
    "  keeps what it took, and NVML counts all of it;\n"
    "* power_w follows the work: NVML's board power, averaged over one second on Ampere\n"
    "  and newer GPUs except the A100 (GA100); on the A100 and older GPUs an instantaneous\n"
    "  reading (NVML,\n"
    "  nvmlDeviceGetPowerUsage:\n"
    "  https://docs.nvidia.com/deploy/nvml-api/group__nvmlDeviceQueries.html)."
)


@dataclass(frozen=True)
class TrainingTrace:
    """The shipped NVML traces (none, or the files), read on a device of ``device_type``."""

    device_type: str
    traces: tuple[Path, ...]

    def describe(self) -> str:
        """What to look for in an NVML trace of a training run; where none ships, what a
        learner can see instead and how a trace is made."""
        if self.device_type == "cuda":
            intro = ("What to look for in section 2's monitor, which read this GPU through NVML"
                     + (", and in the recording replayed below:" if self.traces else ":"))
        else:
            intro = ("What to look for in an NVML trace of a training run on a GPU "
                     + ("(the recording replayed below):" if self.traces
                        else "(expected on a GPU, not measured here):"))
        text = intro + "\n" + LOOK_FOR
        if not self.traces:
            text += "\n\n" + show.no_trace_note(load_shipped())
        return text

    def replay(self, *, title: str) -> None:
        """Replay the first trace through the live monitor (at once, not in real time);
        nothing when none ships."""
        if self.traces:
            with Monitor(backend=ReplayBackend(self.traces[0], realtime=False), title=title):
                pass  # nothing runs here: the recording is the content


def training_trace(device_type: str) -> TrainingTrace:
    """The traces that ship with labkit (``labkit/metrics/traces/*.jsonl``)."""
    return TrainingTrace(device_type=device_type, traces=tuple(shipped_traces()))
