"""Where a training step's time goes, measured: the profiler's self time by kind of operator.

    from labkit.profiling import attribute_step
    a = attribute_step(step, device=device)   # step(): one whole training step
    print(a.table())
    a.seconds["matmul"]                        # per step, measured

The roofline of notebook 01 predicts a step from its FLOPs at the measured matmul ceiling and
finds that the FLOPs fill only part of the step; this says where the rest went. It runs the
step under ``torch.profiler`` (``warmup`` steps recorded and dropped, then ``steps`` kept) and
sums each operator's *self* time (its own time, without the operators it called) into a few
kinds (matched on the operator's name by ``labkit.op_kinds.kind_of``, the one classifier, which
this module re-exports); every operator run inside ``optimizer.step()`` counts as "optimizer",
whatever its name.

Which clock: on a CPU, self CPU time, on the thread that ran the step; what the step's wall
time holds beyond the operators ("outside any operator": Python between operators, the
autograd engine's own work around each backward function, the profiler's own cost) is the
difference. The profiler's step range (``ProfilerStep*`` in its events) and the autograd
engine's ``evaluate_function`` wrappers are not operators, so their self time is left to that
difference. On a GPU, each kernel's device time, charged to the CPU operator that launched it
(a CPU event's ``self_device_time_total``; the kernel events themselves are skipped, or every
kernel would count twice); the step's time beyond the kernels is time the GPU sat idle waiting
for the CPU (launch overhead) or for a sync.
The profiler slows the step it watches (notebook 06 measures by how much), so the shares are
of the profiled step, whose time is printed beside them.

Source: PyTorch profiler docs, ``key_averages``, self vs total time,
https://docs.pytorch.org/tutorials/recipes/recipes/profiler_recipe.html.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import profile, schedule

from labkit.op_kinds import KINDS, OTHER, kind_of
from labkit.profiling.capture import activities
from labkit.timing import synchronize
from labkit.validate import whole

NOT_OPERATORS = ("ProfilerStep", "autograd::engine::evaluate_function")
"""Ranges whose self time is not an operator's: the profiler's step range (Python between
operators) and the autograd engine's wrapper around each backward function."""
OPTIMIZER = "optimizer"
OUTSIDE = "outside any operator"
ORDER = (*(k for k, _ in KINDS), OPTIMIZER, OTHER, OUTSIDE)


def _in_optimizer(event) -> bool:
    while event is not None:
        if event.name.startswith("Optimizer.step"):
            return True
        event = event.cpu_parent
    return False


@dataclass(frozen=True)
class Attribution:
    """Seconds per step by kind (:data:`ORDER`), measured, and the profiled step's mean time."""

    seconds: dict[str, float]
    step_s: float
    clock: str
    """"CPU self time" or "GPU kernel time"."""
    steps: int

    def share(self, kind: str) -> float:
        return self.seconds[kind] / self.step_s

    def table(self) -> str:
        lines = [f"measured ({self.clock} per step, profiler on, mean step "
                 f"{self.step_s * 1e3:.2f} ms over {self.steps} steps):"]  # fmt: skip
        for kind in ORDER:
            s = self.seconds[kind]
            lines.append(f"  {kind:<26}{s * 1e3:>9.2f} ms {s / self.step_s:>7.1%}")
        return "\n".join(lines)


def attribute_step(step: Callable[[], object], *, device: torch.device | str = "cpu",
                   steps: int = 3, warmup: int = 1) -> Attribution:  # fmt: skip
    """Profile ``steps`` calls of ``step()`` after ``warmup`` and attribute their time."""
    steps = whole("steps", steps, low=1)
    device = torch.device(device)
    gpu = device.type == "cuda"
    walls: list[float] = []
    events: list = []  # the active window's, handed over when it closes (then cleared)
    with warnings.catch_warnings(), profile(
        activities=activities(device), schedule=schedule(wait=0, warmup=warmup, active=steps),
        on_trace_ready=lambda p: events.extend(p.events()),
    ) as prof:
        # "clears events at the end of each cycle": the callback above has taken them
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        for i in range(warmup + steps):
            synchronize(device)
            t0 = time.perf_counter()
            step()
            synchronize(device)
            if i >= warmup:
                walls.append(time.perf_counter() - t0)
            prof.step()
    totals = dict.fromkeys(ORDER, 0.0)
    for event in events:
        if event.device_type != DeviceType.CPU or event.name.startswith(NOT_OPERATORS):
            continue  # a kernel (counted under its CPU operator), or not an operator at all
        us = event.self_device_time_total if gpu else event.self_cpu_time_total
        if us:
            totals[OPTIMIZER if _in_optimizer(event) else kind_of(event.name)] += us * 1e-6
    seconds = {k: v / steps for k, v in totals.items()}
    step_s = statistics.fmean(walls)  # a mean, as the per-step self times are
    seconds[OUTSIDE] = max(0.0, step_s - sum(seconds.values()))
    return Attribution(seconds, step_s, "GPU kernel time" if gpu else "CPU self time", steps)
