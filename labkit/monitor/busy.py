"""Busy is not useful: workloads run one after another under a monitor, each one's measured
FLOP/s beside the utilisation the monitor read while it ran.

NVML's ``utilization.gpu`` is the share of a sample period in which at least one kernel ran,
however little of the GPU it used; a CPU's ``cpu_pct`` likewise counts a core that was busy.
So a workload that keeps the device occupied with almost no arithmetic (:func:`idle_workload`)
reads as busy as a big matmul. Notebook 01 section 4 shows it; the readings come from the
monitor's own samples, and a metric the device did not report is N/A, never 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from labkit import timing

Workload = tuple[Callable[[], object], int]
"""A call and the floating-point operations one call does."""


def idle_workload(device: torch.device) -> tuple[str, Workload]:
    """A workload that keeps ``device`` busy while doing almost no floating-point work.

    On a GPU: ``torch.cuda._sleep(cycles)``, PyTorch's own test helper (private API): one kernel
    in which a single thread spins for ``cycles`` SM clock cycles. It keeps a kernel resident
    while doing almost nothing, which a loop of tiny public ops cannot: each launch outlasts
    its kernel. Calibrated to about 5 ms per call at this SM clock, one call in flight at a
    time, so a phase ends on time. On a CPU: tiny element-wise ops.
    """
    if device.type == "cuda":
        calibration = timing.benchmark(lambda: torch.cuda._sleep(10**7), device=device,
                                       warmup=1, repeats=3)  # 10⁷ cycles: a few ms
        cycles = int(10**7 * 0.005 / calibration.median_s)

        def spin() -> None:
            torch.cuda._sleep(cycles)
            timing.synchronize(device)

        return "one-thread spin kernel", (spin, 0)  # no floating-point work at all
    tiny = torch.ones(8, device=device)
    return "tiny element-wise ops", (lambda: tiny.mul_(1.0), tiny.numel())


@dataclass(frozen=True)
class BusyVsUseful:
    """Each workload's (start, end, measured FLOP/s), and the monitor that sampled meanwhile
    (read when described, so samples taken as the monitor closed count too)."""

    phases: dict[str, tuple[float, float, float]]
    monitor: Any
    device_type: str
    n_sm: int | None = None
    """On a GPU: its streaming multiprocessors (one busy SM is 1/n_sm of sm_active_pct)."""

    def mean_reading(self, metric: str, source: str, start: float, end: float,
                     digits: int = 0) -> str:
        """The mean of ``metric`` from ``source`` between ``start`` and ``end``, or N/A."""
        readings = [s.values.get(metric) for s in self.monitor.samples
                    if s.source == source and start <= s.time_s <= end]
        readings = [r for r in readings if r is not None]
        return f"{sum(readings) / len(readings):.{digits}f}%" if readings else "N/A"

    def describe(self) -> str:
        cuda = self.device_type == "cuda"
        source, metric = ("gpu0", "gpu_util_pct") if cuda else ("rank0", "cpu_pct")
        gpm = ("sm_active_pct", "tensor_active_pct") if cuda else ()  # N/A before Hopper
        head = f"busy reading ({metric} of {source}, measured)"
        lines = [f"{'workload':<24}{'measured FLOP/s':>18}   {head}"
                 + "".join(f"{g:>19}" for g in gpm)]
        for name, (start, end, flops_per_s) in self.phases.items():
            busy = self.mean_reading(metric, source, start, end)
            more = "".join(f"{self.mean_reading(g, source, start, end, 1):>19}" for g in gpm)
            lines.append(f"{name:<24}{flops_per_s:>18,.0f}   {busy:<{len(head)}}{more}".rstrip())
        if self.n_sm is not None:
            lines.append(f"predicted sm_active_pct while spinning: 1 busy SM of {self.n_sm} = "
                         f"{100 / self.n_sm:.1f}%")
        idle_name, busy_name = list(self.phases)
        idle_flops, busy_flops = self.phases[idle_name][2], self.phases[busy_name][2]
        if idle_flops > 0:
            lines.append(f"measured: the {busy_name} did {busy_flops / idle_flops:,.0f}x the "
                         f"FLOP/s of the {idle_name}")
        else:
            lines.append(f"measured: the {idle_name} did no floating-point work at all; the "
                         f"{busy_name} {busy_flops:,.0f} FLOP/s")
        return "\n".join(lines)


def busy_vs_useful(monitor: Any, workloads: Mapping[str, Workload], *, device: torch.device,
                   phase_s: float) -> BusyVsUseful:
    """Run each workload for ``phase_s`` seconds under ``monitor`` (a running
    :class:`labkit.monitor.Monitor`), marking where each begins, and time its FLOP/s."""
    phases = {}
    for name, (work, flops) in workloads.items():
        monitor.part(name)  # a dotted line where this workload begins, named on the plot
        timing.synchronize(device)
        start = time.monotonic()
        calls = 0
        while time.monotonic() - start < phase_s:
            work()
            calls += 1
        timing.synchronize(device)
        end = time.monotonic()
        phases[name] = (start, end, calls * flops / (end - start))
    n_sm = (torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda" else None)
    return BusyVsUseful(phases=phases, monitor=monitor, device_type=device.type,
                        n_sm=n_sm)
