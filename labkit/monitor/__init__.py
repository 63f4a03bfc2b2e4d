"""Live plots of a job's hardware metrics under the notebook cell, and one static figure after.

    from labkit.jobs import launch
    from labkit.monitor import Monitor
    from labkit.workers.allreduce import AllReduceConfig

    mon = Monitor(period_s=1.0)
    res = launch.run(AllReduceConfig(), nproc=2, observers=[mon])
    mon.summary()                  # mean / max of each metric per GPU (or per rank on CPU)

    with Monitor(period_s=0.5) as mon:                 # single-process code in the kernel
        history = train(model, cfg, data, on_step=mon.on_step)

    with Monitor(backend=ReplayBackend("h200.jsonl", realtime=False)):
        pass                                           # a recording made on a real GPU

    with Monitor(backend="nvml", record_to="h200.jsonl") as mon:   # make such a recording
        history = train(model, cfg, data, on_step=mon.on_step)

What it shows: one panel per metric with one line per source (``gpu0``, ``gpu1``... on the GPU
tiers; ``rank0``, ``rank1``... and ``host`` on the CPU tier), each rank's step events as short
tick marks in its colour along the top of every panel, and a bottom panel of step against time
per rank (a rank that falls behind shows as a lagging line). The title carries the backend's
own description: the GPUs read through NVML, "CPU only ...; no NVIDIA GPU found: <reason>", or
"recording of <hardware> on <date>" for a replayed trace, and the step of the slowest rank out
of the job's total; a worker that runs several things one after another (notebook 02's
strategies) names the one running (``ctx.heartbeat(part=...)``), and each part's start is a
dotted line across the panels. Nothing is ever invented: a value the device did not report
(N/A) is a gap in the line, never a zero (``labkit.metrics.base``), and a panel whose ranks
have not started yet says "waiting for ranks", not N/A.

Who drives the sampling, and why:

- **As a launcher observer** (``launch.run(..., observers=[mon])``) the notebook cell blocks in
  ``run`` until the job ends, which starves anything scheduled on the kernel's event loop
  (ipykernel runs a cell on the thread that serves that loop, so callbacks wait for the cell
  to return). So no thread and no asyncio task: the launcher's own
  supervision loop calls ``on_tick`` every ~0.25 s, and that samples (``Sampler.poll_due``),
  reads each rank's step from its heartbeat, and redraws.
- **As a context manager** nothing else loops, so the sampler's own thread samples the kernel
  process ("rank0") or the GPUs, and redraws from there. ``mon.on_step`` (the signature of
  ``labkit.train.train``'s ``on_step``) records step events.

Either way the sampler is stopped when the job ends or the block exits, on success, error,
timeout or interrupt.

Live or headless. Live (a person watching JupyterLab): the figure under the cell is redrawn
through a display handle with each new sample, as long as drawing takes at most
``RENDER_SHARE`` of one core (the ranks being measured need the rest), and its final update is
the final figure; if the cell's output was cleared meanwhile (``clear_output()``, which takes
the live figure with it), the final figure is displayed afresh instead. A live frame redraws
only the lines over a saved picture of the axes, whose limits grow in steps (see ``MonitorPlot``):
a few hundredths of a second of CPU per frame.
Headless (papermill, nbval, a script): no updates at all, then exactly one static figure. nbval
ignores display updates and papermill has no person watching, so redrawing there only costs
time. Either way the cell ends with one figure and one summary table. ``live`` defaults to
``live_default()``: the environment variable ``LABKIT_LIVE_PLOTS`` (``1``, ``0`` or ``auto``)
decides if set; under ``auto`` a Jupyter kernel is live unless the process that started it is
a headless executor (papermill, pytest/nbval, nbconvert, nbclient). A wrong guess is harmless
for the saved notebook: nbclient applies display updates in place, so a live monitor under
papermill also leaves exactly one figure.

Figures are drawn with matplotlib's object API on the Agg canvas and shown as PNG bytes, never
through ``pyplot`` (:mod:`labkit.monitor.figure` says why); matplotlib is imported only when a
figure is drawn.

One module per concern; what notebooks and tests use imports from ``labkit.monitor``:

    records    step and part events, series per source, the summary table (pure, no drawing)
    figure     the figure: panels, lines, step ticks; live frames redraw only what moved
    display    live or headless (live_default), showing a bundle, noticing clear_output()
    watch      the Monitor: sampling driven by the launcher or a thread, redraws, the end
    busy       busy is not useful: workloads under a monitor, FLOP/s beside utilisation
"""

from __future__ import annotations

from labkit._moved import submodules_on_demand
from labkit.monitor.display import (
    LIVE_ENV,
    live_default,
)
from labkit.monitor.figure import build_figure
from labkit.monitor.records import (
    series,
    sources_of,
    summarize,
)
from labkit.monitor.watch import Monitor

__all__ = [
    "LIVE_ENV",
    "Monitor",
    "build_figure",
    "live_default",
    "series",
    "sources_of",
    "summarize",
]

# monitor.busy (it imports torch): imported when first named, so importing the monitor stays light
__getattr__ = submodules_on_demand(__name__)
