"""The Monitor: who drives the sampling, when the live figure is redrawn, and the final one.

Apart from what it uses (:mod:`.records`, :mod:`.figure`, :mod:`.display`) because this is
the one stateful piece: it runs a ``labkit.metrics`` Sampler as a launcher observer (the
launcher's loop calls ``on_tick``) or from its own thread (``with Monitor() as mon:``), turns
heartbeats into step and part events, redraws within a CPU budget, and always stops the
sampler and shows one final figure and table, however the run ends. The package docstring
(:mod:`labkit.monitor`) explains each choice.
"""

from __future__ import annotations

import os
import textwrap
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from labkit.metrics import (
    METRICS,
    Backend,
    CpuBackend,
    NvmlBackend,
    Recorder,
    ReplayBackend,
    Sample,
    Sampler,
    auto_backend,
    clamp_period,
)
from labkit.metrics.base import Clock
from labkit.monitor.display import (
    Bundle,
    ClearWatch,
    display_publisher,
    live_default,
    show_bundle,
)
from labkit.monitor.figure import (
    WAITING_RANKS,
    WAITING_SAMPLE,
    MonitorPlot,
    build_figure,
    figure_shape,
)
from labkit.monitor.records import (
    PartEvent,
    StepEvent,
    Summary,
    metrics_to_show,
    summarize,
)
from labkit.validate import number

# Live frames: one per new sample, but at most RENDER_SHARE of one core's time spent drawing
# them, counted in CPU time (a frame costs ~0.2 s of CPU here). On a busy machine a frame's
# wall time is mostly other processes' turns on the cores; budgeting wall time kept frames
# ~9 s apart on two loaded cores, behind the text printed under the same cell.
RENDER_SHARE = 0.2


class Monitor:
    """Samples hardware metrics while a job or a block of code runs, and plots them.

    Args:
        period_s: seconds between samples (>= 0.1; 1 s matches nvidia-smi dmon and NVML's
            own averaging windows).
        backend: None or "auto" (NVML if it sees a GPU, else the CPU with the reason shown),
            "cpu", "nvml", or a ``labkit.metrics`` Backend instance (e.g. a ``ReplayBackend``
            to show a recording). An instance is used as given: a CPU backend built without
            ``pids_fn`` sees only the host.
        metrics: metric names to draw (see ``labkit.metrics.metric_table()``); default: a
            set per backend kind (``DEFAULT_METRICS``).
        live: redraw under the cell while running; None: ``live_default()``.
        title: first line of the figure's title; default: the job's module (or "this
            kernel's process", or "replay").
        redraw_s: at least this many seconds between live redraws; None: a redraw with each
            new sample, as long as drawing takes at most ``RENDER_SHARE`` of one core.
        total_steps: for the ``with`` form, the step count shown as "step k/n".
        record_to: also write every sample and step event to this trace file
            (``labkit.metrics.replay`` format), so the run can be replayed, labelled, where
            there is no GPU. Only NVML readings are recorded: on any other backend the run
            fails to start with a ValueError.
        record_notes: what ran, stored in the recording's metadata.
        clock: seconds, monotonic; stamps samples and step events. A fake in tests.
    """

    def __init__(
        self,
        period_s: float = 1.0,
        *,
        backend: str | Backend | None = None,
        metrics: Sequence[str] | None = None,
        live: bool | None = None,
        title: str | None = None,
        redraw_s: float | None = None,
        total_steps: int | None = None,
        record_to: str | Path | None = None,
        record_notes: str = "",
        clock: Clock = time.monotonic,
    ) -> None:
        named = isinstance(backend, str) and backend in ("auto", "cpu", "nvml")
        if not (backend is None or named or isinstance(backend, Backend)):
            raise ValueError(f"backend={backend!r}: use None, 'auto', 'cpu', 'nvml' or a "
                             "labkit.metrics Backend instance")  # fmt: skip
        if metrics is not None:
            unknown = [m for m in metrics if m not in METRICS]
            if isinstance(metrics, str) or unknown:
                raise ValueError(f"metrics={metrics!r}: pass a list of names from "
                                 f"labkit.metrics.METRICS; unknown: {unknown}")  # fmt: skip
        if redraw_s is not None:
            number("redraw_s", redraw_s, low=0, why="seconds between frames, or None")
        self.period_s = clamp_period(period_s)  # a bad value fails here, not at the launch
        self.backend_spec, self.metrics = backend, metrics
        self.live = live_default()[0] if live is None else bool(live)
        self.title, self.total_steps = title, total_steps
        self.redraw_s = 0.0 if redraw_s is None else float(redraw_s)
        self.record_to = None if record_to is None else Path(record_to)
        self.record_notes = record_notes
        self.recorder: Recorder | None = None
        self.clock = clock
        self.sampler: Sampler | None = None
        # "idle", "running", then "ok", "failed", "timeout", "interrupted" or "error: <type>"
        self.status = "idle"
        self._steps: list[StepEvent] = []
        self._last_step: dict[int, int] = {}
        self._parts: list[PartEvent] = []
        self._last_part: dict[int, str] = {}  # rank -> the part its last heartbeat named
        self._lock = threading.Lock()  # guards _steps (the sampler thread reads them to draw)
        self._render_lock = threading.Lock()
        self._handle: Any = None
        self._clear_watch: ClearWatch | None = None  # live runs in a kernel (see the class)
        self._t0 = 0.0
        self._wall_offset = 0.0  # time.time() - clock(): turns heartbeat stamps into our clock
        self._last_draw: float | None = None
        self._drawn: tuple[int, int, int] | None = None  # (samples, steps, parts) drawn last
        self._render_cpu_s = 0.0  # CPU seconds the last live frame took
        self._plot: MonitorPlot | None = None  # the live figure, updated in place
        self._module: str | None = None
        self._progress: Callable[[], tuple[int | None, int | None]] | None = None
        self._in_with = False
        self._described: str | None = None  # describe() kept when the backend is closed
        self.redraws = 0  # live redraws so far (the final figure not counted)

    # -- results ------------------------------------------------------------------------------

    @property
    def samples(self) -> list[Sample]:
        """Every sample of the last run, oldest first."""
        return self.sampler.samples if self.sampler is not None else []

    @property
    def steps(self) -> list[StepEvent]:
        """Every step event seen, in order."""
        with self._lock:
            return list(self._steps)

    @property
    def parts(self) -> list[PartEvent]:
        """Where each named part of the job began (see ``PartEvent``), in order."""
        with self._lock:
            return list(self._parts)

    @property
    def kind(self) -> str:
        """The backend kind: "nvml", "cpu" or "replay" ("" before the first run)."""
        return self.sampler.backend.kind if self.sampler is not None else ""

    def describe(self) -> str:
        """The backend's one-line description (hardware, or why no GPU, or the recording)."""
        if self._described is not None:  # the run is over: as it read while the backend was open
            return self._described
        return self.sampler.describe() if self.sampler is not None else "not started"

    def shown_metrics(self) -> list[str]:
        return metrics_to_show(self.samples, self.kind, self.metrics)

    def summary(self) -> Summary:
        """Mean / max per metric and source, the run's status and each rank's last step."""
        return summarize(self.samples, self.shown_metrics(), describe=self.describe(),
                         status=self.status, last_step=self._last_step)  # fmt: skip

    def figure(self) -> Any:
        """The current figure as a new matplotlib ``Figure`` (``.savefig(path)`` to keep it)."""
        self._sync_replay_steps()
        return build_figure(self.samples, self.steps, self.shown_metrics(), **self._drawing())

    # -- launcher observer (labkit.jobs.launch.run(..., observers=[mon])) --------------------------

    def on_start(self, job: Any) -> None:
        """The launcher started ``job``: sample its ranks' processes (``job.rank_pids()``)."""
        if self._in_with:
            raise RuntimeError("Monitor is already watching a `with` block; use a second "
                               "Monitor for the launched job")  # fmt: skip
        self._module, self._progress = job.module, job.progress
        try:
            self._begin(job.rank_pids, thread=False, job_device=getattr(job, "device", None))
        except BaseException:
            self._stop_sampler()  # the launcher drops us without on_end: leave nothing open
            raise

    def on_tick(self, job: Any) -> None:
        """Every ~0.25 s from the launcher's loop: sample if due, note steps, maybe redraw."""
        try:
            self._note_heartbeats(job.heartbeats)
            if self.sampler is not None:
                self.sampler.poll_due()
            self._maybe_redraw()
        except BaseException:
            # The launcher drops an observer that raises and never calls its on_end: stop now.
            self._stop_sampler()
            raise

    def on_end(self, job: Any, result: Any) -> None:
        """The job is over (any outcome): stop sampling, show the final figure and table."""
        try:
            # The launcher may stop ticking before it read the ranks' last heartbeats (the job
            # exited between two ticks): read them from the job directory once more.
            beats = job.heartbeats
            if getattr(job, "job_dir", None) is not None:
                from labkit.jobs import spec  # the job folder's layout, torch-free

                beats = spec.read_heartbeats(job.job_dir, job.nproc) or beats
            self._note_heartbeats(beats)
        finally:
            self._finish(getattr(result, "status", "ok"))

    # -- single-process code in the kernel (`with Monitor() as mon:`) ---------------------------

    def __enter__(self) -> Monitor:
        self._module, self._progress = None, None
        self._in_with = True
        try:
            self._begin(lambda: {0: os.getpid()}, thread=True)
        except BaseException:  # __exit__ will not run: stop the thread here
            self._in_with = False
            self._stop_sampler()
            raise
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self._in_with = False
        if exc_type is None:
            status = "ok"
        elif issubclass(exc_type, KeyboardInterrupt):
            status = "interrupted"
        else:
            status = f"error: {exc_type.__name__}"
        self._finish(status)  # the exception, if any, propagates after this

    def step(self, step: int, *, rank: int = 0, total: int | None = None) -> None:
        """Record that ``rank`` reached ``step`` now (the ``with`` form's step events)."""
        if total is not None:
            self.total_steps = total
        self._add_step(rank, int(step), self.clock())

    def part(self, name: str) -> None:
        """Mark that a named part of the work begins now (the ``with`` form's part marks):
        a dotted line across the panels, named on the step panel, as a job's parts are."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"name={name!r}: give the part a non-empty name")
        with self._lock:
            self._parts.append(PartEvent(name, self.clock()))

    def on_step(self, step: int, stats: Any = None) -> None:
        """``labkit.train.train(..., on_step=mon.on_step)``: one step event per step."""
        self.step(step)

    def chain(self, *callbacks: Callable[[int, Any], Any]) -> Callable[[int, Any], None]:
        """One ``on_step`` callback that records the step here, then calls ``callbacks``:
        ``train(..., on_step=mon.chain(train.Progress(steps)))``."""

        def on_step(step: int, stats: Any = None) -> None:
            self.on_step(step, stats)
            for fn in callbacks:
                fn(step, stats)

        return on_step

    # -- internals ----------------------------------------------------------------------------

    def _make_backend(
        self, pids_fn: Callable[[], dict[int, int]], job_device: str | None = None
    ) -> Backend:
        spec = self.backend_spec
        if isinstance(spec, Backend):
            return spec
        if spec == "cpu":
            return CpuBackend(pids_fn, clock=self.clock)
        if spec == "nvml":
            return NvmlBackend(pids_fn, clock=self.clock)  # opened by the sampler: errors rise
        backend = auto_backend(pids_fn, clock=self.clock)
        if job_device == "cpu" and backend.kind == "nvml":
            # A GPU is here but the job's ranks run on the CPU (more ranks than GPUs): an idle
            # GPU's readings would hide what the ranks do, so show the ranks, and say why.
            note = f"this job's ranks run on the CPU over gloo, not on the {backend.hardware}"
            backend.close()
            return CpuBackend(pids_fn, note=note, clock=self.clock)
        return backend

    def _begin(
        self, pids_fn: Callable[[], dict[int, int]], *, thread: bool, job_device: str | None = None
    ) -> None:
        self._stop_sampler()  # a Monitor reused for a second run starts afresh
        with self._lock:
            self._steps, self._last_step, self._parts, self._last_part = [], {}, [], {}
        self.status, self._handle, self._last_draw, self.redraws = "running", None, None, 0
        self._plot, self._drawn, self._clear_watch = None, None, None
        self._described = None
        backend = self._make_backend(pids_fn, job_device)
        self.sampler = Sampler(backend, self.period_s, clock=self.clock,
                               on_sample=self._on_sample if thread or self.record_to else None)  # fmt: skip
        offline = self._offline_replay()
        self._t0 = 0.0 if offline else self.clock()  # an offline replay keeps recorded times
        self._wall_offset = time.time() - self.clock()
        self.recorder = self._make_recorder(backend)
        # Open first, so a backend that cannot run fails here, before anything is displayed.
        if offline:
            backend.open()  # reads the trace; it is played in full at the end
        elif thread:
            self.sampler.start()
        else:
            self.sampler.poll_once()
        if self.live:  # the sampler thread skips redraws until the handle exists
            publisher = display_publisher()
            self._clear_watch = ClearWatch(publisher) if publisher is not None else None
            self._handle = show_bundle(self._text_bundle(f"{self._waiting()}…"), display_id=True)

    def _make_recorder(self, backend: Backend) -> Recorder | None:
        """The Recorder for ``record_to``, opened (so a machine without a GPU fails here)."""
        if self.record_to is None:
            return None
        if backend.kind != "nvml":
            reason = getattr(backend, "reason", "") or backend.describe()
            raise ValueError(f"record_to={str(self.record_to)!r}: a recording holds real GPU "
                             f"readings from NVML, but this monitor reads the {backend.kind!r} "
                             f"backend ({reason}); record on a machine with an NVIDIA GPU, "
                             "or drop record_to")  # fmt: skip
        recorder = Recorder(self.record_to, backend, notes=self.record_notes,
                            period_s=self.period_s, t0=self._t0)  # fmt: skip
        recorder.open()  # opens the backend: no driver raises BackendUnavailable here
        return recorder

    def _on_sample(self, samples: list[Sample]) -> None:
        """Each sampler tick: record it (``record_to``), then maybe redraw (``with`` form)."""
        self._record(lambda recorder: recorder.write(samples))
        if self._in_with:
            self._maybe_redraw()

    def _record(self, write: Callable[[Recorder], None]) -> None:
        """``write(recorder)`` if recording; a failure ends the recording, never the run."""
        recorder = self.recorder
        if recorder is None:
            return
        try:
            write(recorder)
        except (OSError, ValueError, RuntimeError) as e:  # disk full, recorder closed, ...
            warnings.warn(f"labkit monitor: recording to {self.record_to} stopped: {e}",
                          stacklevel=3)  # fmt: skip
            self._close_recorder()

    def _sync_replay_steps(self) -> None:
        """A replay's step events are part of the recording: show those played so far."""
        backend = self.sampler.backend if self.sampler is not None else None
        if not isinstance(backend, ReplayBackend) or backend.trace is None:
            return
        events = [StepEvent(e.rank, e.step, e.time_s) for e in backend.steps()]
        with self._lock:
            self._steps = events
            self._last_step = {e.rank: e.step for e in events}

    def _offline_replay(self) -> bool:
        b = self.sampler.backend if self.sampler is not None else self.backend_spec
        return isinstance(b, ReplayBackend) and not b.realtime

    def _note_heartbeats(self, beats: Mapping[int, Mapping[str, Any]]) -> None:
        for rank, beat in dict(beats).items():
            stamp = beat.get("time")
            t = stamp - self._wall_offset if isinstance(stamp, (int, float)) else self.clock()
            self._note_parts(int(rank), beat, t)
            step = beat.get("step")
            if isinstance(step, int) and self._last_step.get(rank) != step:
                self._add_step(int(rank), step, t)

    def _note_parts(self, rank: int, beat: Mapping[str, Any], t: float) -> None:
        """The part ``rank`` is in, and each part's start (as the first rank read reports it).

        A heartbeat lists every part begun, with its time (``labkit.jobs.runtime``): a part shorter
        than a supervision tick is still marked, where it began. Without that list, the
        part's start is taken as the time of the first heartbeat naming it.
        """
        part = beat.get("part")
        if not isinstance(part, str):
            return
        begun = [(p[0], p[1]) for p in beat.get("parts") or []
                 if isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                 and isinstance(p[1], (int, float))]  # fmt: skip
        with self._lock:
            self._last_part[rank] = part
            known = {p.part for p in self._parts}
            for name, stamp in begun or [(part, t + self._wall_offset)]:
                if name not in known:
                    known.add(name)
                    self._parts.append(PartEvent(name, stamp - self._wall_offset))

    def _add_step(self, rank: int, step: int, t: float) -> None:
        with self._lock:
            self._steps.append(StepEvent(rank, step, t))
            self._last_step[rank] = step
        self._record(lambda recorder: recorder.step(step, t, rank=rank))

    def _stop_sampler(self) -> None:
        try:
            if self.sampler is not None:
                self.sampler.stop()
        finally:
            self._close_recorder()
            if self._clear_watch is not None:  # its count stays readable for _finish
                self._clear_watch.close()

    def _cleared(self) -> bool:
        """True once ``clear_output()`` was called in the cell since the live figure was shown."""
        return self._clear_watch is not None and self._clear_watch.clears > 0

    def _close_recorder(self) -> None:
        recorder, self.recorder = self.recorder, None
        if recorder is not None:
            recorder.close()

    def _finish(self, status: str) -> None:
        """Stop sampling (always), then the final figure and the summary table."""
        try:
            if self.sampler is not None and self._offline_replay():
                self._play_rest()
            self._sync_replay_steps()
            # Closing a backend forgets its hardware (NVML handles, the trace): describe first.
            self._described = self.describe()
        finally:
            self._stop_sampler()
        self.status = status
        with self._render_lock:  # a redraw in the sampler thread may still be finishing
            final = self._figure_bundle()
        if self._handle is not None and not self._cleared():
            self._handle.update(final, raw=True)  # the live figure becomes the final one
        else:
            if self._handle is not None:
                # Cleared: the live figure is gone, and an update of its handle would show
                # nothing (see ClearWatch), so the final figure is displayed afresh. The
                # handle is blanked first, in case the clear did not reach it (a clear inside
                # an output widget): one figure either way.
                self._handle.update({"text/plain": ""}, raw=True)
            show_bundle(final)
        summary = self.summary()
        show_bundle({"text/plain": str(summary), "text/html": summary._repr_html_()})

    def _play_rest(self) -> None:
        """A replay played tick by tick (``realtime=False``): read every remaining tick."""
        assert self.sampler is not None
        backend = self.sampler.backend
        assert isinstance(backend, ReplayBackend)
        for _ in range(1_000_000):  # bounded: a trace far longer than this is not a lab trace
            self.sampler.poll_once()
            if backend.finished or self.sampler.state == "failed":
                break

    def _maybe_redraw(self) -> None:
        """Redraw the live figure when there is something new to show, at most once per
        ``redraw_s``, and so that drawing takes at most ``RENDER_SHARE`` of one core."""
        if not self.live or self._handle is None or self._cleared():
            return  # after a clear the live figure is gone: drawing it is wasted (ClearWatch)
        now = self.clock()
        shown = (len(self.samples), len(self.steps), len(self.parts))
        if self._last_draw is not None:
            wait = max(self.redraw_s, self._render_cpu_s / RENDER_SHARE)
            if shown == self._drawn or now - self._last_draw < wait:
                return
        if not self._render_lock.acquire(blocking=False):
            return  # the other thread is drawing: skip this turn
        try:
            # CPU time of this thread, not wall time: on a busy machine a frame's wall time
            # is mostly waiting for a core, and it is our share of the cores that is budgeted.
            started = time.thread_time()
            bundle = self._figure_bundle()
            self._handle.update(bundle, raw=True)
            self._render_cpu_s = time.thread_time() - started
            self._last_draw, self._drawn = now, shown
            self.redraws += 1
        finally:
            self._render_lock.release()

    def _title(self) -> str:
        default = "replay" if self.kind == "replay" else "this kernel's process"
        head = self.title or self._module or default
        step, rank = None, None
        if self._last_step:  # a launched job moves at its slowest rank's pace
            pick = min if self._progress else max
            rank = pick(sorted(self._last_step), key=self._last_step.__getitem__)
            step = self._last_step[rank]
        total = self._progress()[1] if self._progress else self.total_steps
        if step is not None:
            head += f" — step {step}" + (f"/{total}" if total else "")
        # The part the slowest rank is in (before any step: the first rank to name one).
        part = self._last_part.get(rank) if rank is not None else None
        if part is None and self._last_part:
            part = self._last_part[min(self._last_part)]
        if part and self.status == "running":
            head += f" — {part}"
        if self.status != "running":
            head += f" — {self.status}"
        body = textwrap.fill(self.describe(), width=110, break_on_hyphens=False)
        return f"{head}\n{body}"

    def _waiting(self) -> str:
        """What panels say before their sources are sampled: a launched job's ranks take
        seconds to start (importing torch), and "N/A" would say they are never reported."""
        return WAITING_RANKS if self._progress is not None else WAITING_SAMPLE

    def _drawing(self) -> dict[str, Any]:
        """Everything but the data that a figure of this run is drawn with."""
        return {"title": self._title(), "t0": self._t0, "recording": self.kind == "replay",
                "parts": self.parts, "kind": self.kind,
                "waiting": self._waiting() if self.status == "running" else None}  # fmt: skip

    def _figure_bundle(self) -> Bundle:
        """The figure as shown under the cell: the live figure, moved to the latest data (a
        new one only when panels, lines or ranks changed)."""
        self._sync_replay_steps()
        samples, steps, metrics = self.samples, self.steps, self.shown_metrics()
        drawing = self._drawing()
        shape = figure_shape(samples, steps, metrics, drawing["title"], drawing["recording"])
        live = self.status == "running"  # the final figure is drawn in full, fitted
        if self._plot is None or self._plot.shape != shape or self._plot.live != live:
            self._plot = MonitorPlot(shape, live=live)
        del drawing["recording"]
        self._plot.update(samples, steps, **drawing)
        png = self._plot.png()
        return {"image/png": png, "text/plain": f"<labkit monitor figure: {drawing['title']}>"}

    def _text_bundle(self, text: str) -> Bundle:
        return {"text/plain": f"labkit monitor: {self.describe()}; {text}"}

    def __repr__(self) -> str:
        return (f"<Monitor {self.status}, every {self.period_s} s, {len(self.samples)} samples, "
                f"{'live' if self.live else 'headless'}: {self.describe()}>")  # fmt: skip
