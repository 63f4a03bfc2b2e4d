"""Sampling a backend on a schedule: in a thread, or driven by the caller's own loop.

    from labkit.metrics import Sampler, auto_backend
    with Sampler(auto_backend(), period_s=1.0) as s:   # a daemon thread samples every second
        launch.run(...)
    s.samples                                           # every Sample, each with its own time

Two modes, because a notebook cell that blocks starves anything scheduled on the kernel's
event loop (ipykernel runs a cell on the thread that serves that loop, so its callbacks wait
until the cell returns):

- **thread**: ``start()`` / ``stop()`` or ``with``. The thread sleeps on an ``Event``, so
  ``stop()`` wakes it at once instead of waiting out the period.
- **synchronous**: ``poll_once()`` samples now; ``poll_due()`` samples only when a period has
  passed on the sampler's clock. The launcher's supervision loop calls it from
  ``on_tick`` (every ~0.25 s), so no thread is needed at all.

The sampler never lets a backend break the job: an exception from ``backend.sample()`` is
recorded in ``error``, the sampler's state becomes "failed" and the thread ends cleanly. The
thread always ends: on ``stop()`` (which ``with`` calls on normal exit, error, interrupt
and the launcher's timeouts), on a backend failure, or after ``max_duration_s``.

Periods: default 1 s, as nvidia-smi dmon and nvitop use; NVML's utilisation counters
themselves cover 1/6 s to 1 s, so sampling much faster re-reads the same window and makes the
driver lock busy. A period under ``MIN_PERIOD_S`` (0.1 s, gpustat's floor) is clamped, with a
warning.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

from labkit.metrics.base import Backend, BackendUnavailable, Clock, Sample
from labkit.metrics.cpu import CpuBackend
from labkit.metrics.nvml import NvmlBackend, PidsFn
from labkit.validate import number, whole

DEFAULT_PERIOD_S = 1.0
MIN_PERIOD_S = 0.1
JOIN_TIMEOUT_S = 5.0  # stop() waits this long for a sample in progress (an NVML call) to end
THREAD_NAME = "labkit-metrics-sampler"

OnSample = Callable[[list[Sample]], Any]


def clamp_period(period_s: float) -> float:
    """``period_s`` checked and raised to ``MIN_PERIOD_S`` (with a warning) if below it."""
    # nan passes every comparison's negation (and made the thread's wait return at once, a
    # busy loop); inf would never sample. Both are refused, with the rest that is not seconds.
    number("period_s", period_s, low=0,
           why=f"seconds, at least {MIN_PERIOD_S}; e.g. period_s={DEFAULT_PERIOD_S}")
    if period_s < MIN_PERIOD_S:
        warnings.warn(f"period_s={period_s} is below the {MIN_PERIOD_S} s minimum (faster "
                      f"sampling re-reads NVML's own window and holds the driver lock); "
                      f"using {MIN_PERIOD_S} s", stacklevel=3)  # fmt: skip
        return MIN_PERIOD_S
    return float(period_s)


class Sampler:
    """Calls ``backend.sample()`` every ``period_s`` and keeps the samples.

    Args:
        backend: any ``Backend``. The sampler owns its lifetime: ``start()`` (or the first
            ``poll_once``) opens it, ``stop()`` closes it.
        period_s: seconds between samples; below 0.1 s it is clamped with a warning.
        clock: seconds; stamps every sample and times ``poll_due``. Inject a fake in tests.
        on_sample: called with each tick's list of samples (e.g. ``Recorder.write``, or a
            plot's update). One that raises is dropped with a warning; sampling goes on.
        max_samples: keep at most this many samples (the oldest are dropped): a sampler
            left running in a notebook does not grow without bound.
        max_duration_s: the thread stops by itself after this many seconds (None: never).
    """

    def __init__(self, backend: Backend, period_s: float = DEFAULT_PERIOD_S, *,
                 clock: Clock = time.monotonic, on_sample: OnSample | None = None,
                 max_samples: int = 100_000, max_duration_s: float | None = None) -> None:  # fmt: skip
        max_samples = whole("max_samples", max_samples, low=1)
        if max_duration_s is not None and not (
            isinstance(max_duration_s, (int, float)) and max_duration_s > 0
        ):
            raise ValueError(f"max_duration_s={max_duration_s!r}: need seconds > 0, or None")
        self.backend = backend
        self.period_s = clamp_period(period_s)
        self.clock, self.on_sample = clock, on_sample
        self.max_duration_s = max_duration_s
        self.state = "idle"  # "idle", "running", "stopped" or "failed"
        self.error: BaseException | None = None  # what made the backend fail, if it did
        self._samples: deque[Sample] = deque(maxlen=max_samples)
        self._latest: dict[str, Sample] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_due: float | None = None  # poll_due's next sample time

    # -- results ----------------------------------------------------------------------------

    @property
    def samples(self) -> list[Sample]:
        """Every sample kept so far, oldest first (a copy: safe while the thread runs)."""
        with self._lock:
            return list(self._samples)

    @property
    def latest(self) -> dict[str, Sample]:
        """The newest sample of each source ("gpu0", "rank1", "host", ...)."""
        with self._lock:
            return dict(self._latest)

    def series(self, source: str, metric: str) -> tuple[list[float], list[float | None]]:
        """(times, values) of one metric of one source, for a plot; None where N/A."""
        rows = [(s.time_s, s.values[metric]) for s in self.samples
                if s.source == source and metric in s.values]  # fmt: skip
        return [t for t, _ in rows], [v for _, v in rows]

    def describe(self) -> str:
        text = self.backend.describe()
        if self.state == "failed":
            text += f" [sampling stopped: {self.error!r}]"
        return text

    # -- synchronous mode -------------------------------------------------------------------

    def poll_once(self, now: float | None = None) -> list[Sample]:
        """Sample now, in the calling thread; returns this tick's samples ([] once failed)."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("poll_once() while the sampler thread runs: use one mode, "
                               "stop() the thread first")  # fmt: skip
        if self.state == "failed":
            return []
        if self.state != "running":
            self.backend.open()
            self.state = "running"
        now = self.clock() if now is None else now
        if self._next_due is None:  # the first sample starts poll_due's grid
            self._next_due = now + self.period_s
        return self._tick(now)

    def poll_due(self, now: float | None = None) -> list[Sample]:
        """``poll_once()`` if a sample is due, else [].

        Samples fall due on a grid of ``period_s`` from the first one, so a caller that
        polls now and then (the launcher's loop, every ~0.25 s or a little more) still gets
        one sample per period on average. Counting the period from the last sample instead
        lost the remainder at every sample: a poll every 0.26 s got a sample every 0.78 s
        for a period of 0.5 s. A caller late by more than a period restarts the grid (no
        burst of catch-up samples).
        """
        now = self.clock() if now is None else now
        due = self._next_due
        if due is not None and now < due:
            return []
        late = due is None or now >= due + self.period_s
        self._next_due = now + self.period_s if late else due + self.period_s
        return self.poll_once(now)

    # -- thread mode ------------------------------------------------------------------------

    def start(self) -> Sampler:
        """Open the backend and start the sampling thread (no-op if it runs already)."""
        if self._thread is not None and self._thread.is_alive():
            return self
        self.backend.open()  # in the caller's thread: BackendUnavailable reaches the caller
        self.state, self.error = "running", None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(self._stop,), name=THREAD_NAME,
                                        daemon=True)  # fmt: skip
        self._thread.start()
        return self

    def stop(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Stop the thread (if any), wait for it, close the backend. Idempotent, never raises
        for a backend problem: it runs in ``finally`` blocks and ``__exit__``."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():  # stuck in a driver call; it is a daemon and exits later
                warnings.warn(f"metrics sampler thread still busy after {timeout_s} s "
                              "(a driver call is hanging); left to finish on its own",
                              stacklevel=2)  # fmt: skip
        with contextlib.suppress(Exception):
            self.backend.close()
        if self.state == "running":
            self.state = "stopped"

    def _run(self, stop: threading.Event) -> None:
        started = time.monotonic()
        while True:  # the first tick always happens: a start() always yields one sample
            tick_start = time.monotonic()
            self._tick(self.clock())
            if self.state == "failed":
                return
            if self.max_duration_s is not None and tick_start - started >= self.max_duration_s:
                self.state = "stopped"
                return
            # Sleep what is left of the period, on real time (the clock may be a test fake).
            if stop.wait(max(0.0, self.period_s - (time.monotonic() - tick_start))):
                return

    def _tick(self, now: float) -> list[Sample]:
        try:
            samples = self.backend.sample(now)
        except Exception as e:  # never into the job: record, mark failed, stop sampling
            self.error, self.state = e, "failed"
            with contextlib.suppress(Exception):
                self.backend.status["backend"] = f"failed: {e!r}"
            return []
        with self._lock:
            self._samples.extend(samples)
            self._latest.update({s.source: s for s in samples})
        if self.on_sample is not None and samples:
            try:
                self.on_sample(samples)
            except Exception as e:
                warnings.warn(f"metrics on_sample callback raised {e!r}; dropped", stacklevel=2)
                self.on_sample = None
        return samples

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (f"<Sampler {self.state}, every {self.period_s} s, {len(self._samples)} samples: "
                f"{self.describe()}>")  # fmt: skip


def auto_backend(
    pids_fn: PidsFn | None = None,
    *,
    devices: Any = None,
    clock: Clock = time.monotonic,
    nvml: Any = None,
) -> Backend:
    """The NVML backend when NVML works and sees a GPU, else the CPU backend; returned open.

    The CPU backend's ``describe()`` carries the reason NVML could not be used ("NVML
    library not found: no NVIDIA driver on this machine"), which the display shows.
    ``pids_fn`` returns {rank: pid} of the job's processes; ``devices`` is the job's
    ``CUDA_VISIBLE_DEVICES`` if it differs from this process's; ``nvml`` a test double.
    """
    gpu = NvmlBackend(pids_fn, devices=devices, clock=clock, nvml=nvml)
    reason = note = None
    try:
        gpu.open()
        return gpu
    except BackendUnavailable as e:
        reason = gpu.reason or str(e)
    except Exception as e:  # bindings that lack a call we make (AttributeError, ...): a
        # monitor must never stop a notebook, so it shows the CPU and says what broke
        note = f"GPU metrics unavailable: NVML failed at open with {e!r} (update nvidia-ml-py)"
    cpu = CpuBackend(pids_fn, reason=reason, note=note, clock=clock)
    cpu.open()
    return cpu
