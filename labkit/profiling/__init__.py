"""Profiling a training step: what the PyTorch profiler, NVTX and Nsight show, and why.

One short module each:

    phases           phase(name): a record_function range and an NVTX range with one name
    memory_timeline  memory over time: the profiler's categories (CPU), the allocator's
                     history snapshot (CUDA), drawn with the phases shaded

Importing this package profiles nothing, touches no GPU and imports no plotting library.
"""

from __future__ import annotations

from labkit.profiling.memory_timeline import (
    MemoryTimeline,
    forward_rise,
    plot_memory_timeline,
    record_memory_timeline,
    timeline_from_snapshot,
    timeline_from_trace_events,
)
from labkit.profiling.phases import COMMUNICATION, PHASES, nvtx_backend, phase

__all__ = [
    "COMMUNICATION",
    "PHASES",
    "MemoryTimeline",
    "forward_rise",
    "nvtx_backend",
    "phase",
    "plot_memory_timeline",
    "record_memory_timeline",
    "timeline_from_snapshot",
    "timeline_from_trace_events",
]
