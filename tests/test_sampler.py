"""Sampler lifecycle: the thread always stops and leaves nothing behind; the synchronous mode."""

from __future__ import annotations

import os
import threading
import warnings

import pytest
from fake_nvml import FakeGpu, FakeNvml
from pynvml import NVML_ERROR_LIBRARY_NOT_FOUND

from labkit.metrics import (
    MIN_PERIOD_S,
    Backend,
    CpuBackend,
    NvmlBackend,
    Sample,
    Sampler,
    auto_backend,
)
from labkit.metrics.sampler import THREAD_NAME


class CountingBackend(Backend):
    """Returns one sample per call; can be told to raise on the n-th call."""

    kind = "cpu"

    def __init__(self, fail_at: int | None = None, clock=None) -> None:
        super().__init__() if clock is None else super().__init__(clock)
        self.fail_at = fail_at
        self.opens = self.closes = self.calls = 0
        self.is_open = False
        self.sampled = threading.Event()

    def open(self) -> None:
        if not self.is_open:
            self.opens += 1
            self.is_open = True

    def close(self) -> None:
        if self.is_open:
            self.closes += 1
            self.is_open = False

    def describe(self) -> str:
        return "counting backend (test)"

    def sample(self, now=None):
        assert self.is_open, "sampled while closed"
        self.calls += 1
        self.sampled.set()
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise ZeroDivisionError("backend bug")
        return [Sample(self._now(now), "host", {"host_cpu_pct": float(self.calls)}, kind="cpu")]


def sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_default_period_and_clamping():
    assert Sampler(CountingBackend()).period_s == 1.0
    with pytest.warns(UserWarning, match="below the 0.1 s minimum"):
        s = Sampler(CountingBackend(), period_s=0.01)
    assert s.period_s == MIN_PERIOD_S
    with pytest.warns(UserWarning):
        assert Sampler(CountingBackend(), period_s=0).period_s == MIN_PERIOD_S
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Sampler(CountingBackend(), period_s=0.1).period_s == 0.1  # no warning
    for bad in (-1, "1", None, True):
        with pytest.raises(ValueError, match="period_s"):
            Sampler(CountingBackend(), period_s=bad)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_period_that_is_not_a_finite_number_is_refused(bad):
    # nan compares False with everything, so it passed the range checks and the thread's
    # wait(nan) returned at once: a busy loop. inf would never sample.
    with pytest.raises(ValueError, match=rf"^period_s={bad!r} is not allowed: a finite number >= 0 \(seconds"):
        Sampler(CountingBackend(), period_s=bad)


@pytest.mark.parametrize("make", [
    lambda: CpuBackend(lambda: {0: os.getpid()}),
    lambda: NvmlBackend(nvml=FakeNvml([FakeGpu(), FakeGpu(uuid="GPU-2")])),
], ids=["cpu", "nvml-fake"])  # fmt: skip
def test_start_stop_100_times_leaves_no_threads_or_fds(make):
    backend = make()
    threads_before, fds_before = set(threading.enumerate()), open_fds()
    sampler = Sampler(backend, period_s=MIN_PERIOD_S)
    for _ in range(100):
        sampler.start()
        sampler.start()  # idempotent while running
        sampler.stop()
        sampler.stop()  # idempotent
    assert sampler_threads() == []
    assert set(threading.enumerate()) == threads_before
    assert open_fds() == fds_before
    assert len(sampler.samples) >= 100  # one tick right at each start
    assert sampler.state == "stopped"
    if isinstance(backend, NvmlBackend):
        nv = backend._nv
        assert nv.inits == nv.shutdowns == 100 and nv.live_gpm_buffers == 0


def test_stop_does_not_wait_out_the_period():
    backend = CountingBackend()
    sampler = Sampler(backend, period_s=3600).start()  # pytest-timeout ends a hang here
    assert backend.sampled.wait(10)
    sampler.stop()
    assert sampler_threads() == [] and backend.closes == 1


@pytest.mark.parametrize("exc", [RuntimeError("job failed"), KeyboardInterrupt()])
def test_stops_on_exception_inside_with(exc):
    backend = CountingBackend()
    with pytest.raises(type(exc)), Sampler(backend, period_s=3600) as sampler:
        assert backend.sampled.wait(10)
        raise exc
    assert sampler_threads() == []
    assert sampler.state == "stopped" and backend.opens == backend.closes == 1


def test_backend_exception_stops_sampling_not_the_job():
    backend = CountingBackend(fail_at=3)
    sampler = Sampler(backend, period_s=MIN_PERIOD_S).start()
    thread = sampler._thread
    thread.join(30)  # the thread ends by itself once the backend fails
    assert not thread.is_alive()
    assert sampler.state == "failed" and isinstance(sampler.error, ZeroDivisionError)
    assert len(sampler.samples) == 2 and "sampling stopped" in sampler.describe()
    assert "failed" in backend.status["backend"]
    sampler.stop()  # still closes the backend, raises nothing
    assert backend.closes == 1 and sampler.state == "failed"
    assert sampler.poll_once() == []


def test_max_duration_stops_a_forgotten_sampler():
    sampler = Sampler(CountingBackend(), period_s=MIN_PERIOD_S, max_duration_s=0.2).start()
    sampler._thread.join(30)
    assert not sampler._thread.is_alive() and sampler.state == "stopped"
    sampler.stop()


def test_each_sample_carries_the_injected_clock():
    ticks = iter(range(1000, 2000))
    backend = CountingBackend()
    with Sampler(backend, period_s=MIN_PERIOD_S, clock=lambda: float(next(ticks))) as sampler:
        assert backend.sampled.wait(10)
    times = [s.time_s for s in sampler.samples]
    assert times and times == sorted(set(times)) and times[0] == 1000.0


def test_synchronous_mode_with_fake_clock():
    now = [0.0]
    backend = CountingBackend()
    sampler = Sampler(backend, period_s=1.0, clock=lambda: now[0])
    assert [s.time_s for s in sampler.poll_due()] == [0.0]  # first call samples at once
    now[0] = 0.5
    assert sampler.poll_due() == []  # not due yet
    now[0] = 1.0
    assert [s.time_s for s in sampler.poll_due()] == [1.0]
    assert [s.time_s for s in sampler.poll_once(now=1.2)] == [1.2]  # whenever asked
    assert sampler_threads() == [] and backend.opens == 1
    assert sampler.series("host", "host_cpu_pct") == ([0.0, 1.0, 1.2], [1.0, 2.0, 3.0])
    assert sampler.latest["host"].time_s == 1.2
    sampler.stop()
    assert backend.closes == 1


def test_poll_once_refused_while_thread_runs():
    backend = CountingBackend()
    with Sampler(backend, period_s=3600) as sampler, pytest.raises(RuntimeError, match="one mode"):
        sampler.poll_once()


def test_on_sample_gets_each_tick_and_a_broken_one_is_dropped():
    got: list[list[Sample]] = []
    sampler = Sampler(CountingBackend(), on_sample=got.append)
    sampler.poll_once(now=1.0)
    sampler.poll_once(now=2.0)
    assert [[s.time_s for s in tick] for tick in got] == [[1.0], [2.0]]

    def broken(samples):
        raise ValueError("plot bug")

    sampler.on_sample = broken
    with pytest.warns(UserWarning, match="plot bug"):
        sampler.poll_once(now=3.0)
    assert sampler.on_sample is None
    assert len(sampler.poll_once(now=4.0)) == 1  # sampling goes on
    sampler.stop()


def test_max_samples_bounds_memory():
    sampler = Sampler(CountingBackend(), max_samples=3)
    for t in range(5):
        sampler.poll_once(now=float(t))
    assert [s.time_s for s in sampler.samples] == [2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match="max_samples"):
        Sampler(CountingBackend(), max_samples=0)


def test_auto_backend_picks_nvml_when_it_works():
    fake = FakeNvml()
    backend = auto_backend(nvml=fake)
    assert isinstance(backend, NvmlBackend) and backend.describe().startswith("NVML: 1 GPU")
    with Sampler(backend, period_s=3600) as sampler:
        pass
    assert sampler.samples[0].source == "gpu0" and fake.inits == fake.shutdowns == 1


def test_auto_backend_falls_back_to_cpu_when_the_nvml_bindings_are_too_old():
    class OldBindings(FakeNvml):  # bindings from before NVML's field-value calls
        def __getattribute__(self, name):
            if name == "nvmlDeviceGetFieldValues":
                raise AttributeError(f"module 'pynvml' has no attribute {name!r}")
            return super().__getattribute__(name)

    old = OldBindings()
    backend = auto_backend(nvml=old)
    assert isinstance(backend, CpuBackend)
    assert "NVML failed at open" in backend.describe() and "nvidia-ml-py" in backend.describe()
    assert "no NVIDIA GPU found" not in backend.describe()  # there is one; the bindings broke
    assert old.inits == old.shutdowns == 1  # NVML was shut down again
    backend.close()


def test_auto_backend_falls_back_to_cpu_with_reason():
    backend = auto_backend(nvml=FakeNvml(init_error=NVML_ERROR_LIBRARY_NOT_FOUND))
    assert isinstance(backend, CpuBackend)
    assert "no NVIDIA GPU found" in backend.describe() and "library not found" in backend.describe()
    backend.close()
    real = auto_backend()  # this machine, whatever it has
    try:
        assert real.kind in ("nvml", "cpu")
        if real.kind == "cpu":
            assert "no NVIDIA GPU found" in real.describe()
    finally:
        real.close()
