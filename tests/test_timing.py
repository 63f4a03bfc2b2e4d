import pytest
import torch

from labkit import timing


class FakeClock:
    """An injected clock: each call advances by the next step, no sleeping."""

    def __init__(self, steps):
        self.t = 0.0
        self.steps = list(steps)

    def __call__(self):
        now = self.t
        if self.steps:
            self.t += self.steps.pop(0)
        return now


def test_benchmark_skips_warmup_and_reports_median_and_spread():
    calls = []
    # warm-up calls never read the clock; each timed call reads it twice: (start, end).
    clock = FakeClock([0.3, 0.0, 0.1, 0.0, 0.2, 0.0])
    result = timing.benchmark(lambda: calls.append(1), warmup=2, repeats=3, clock=clock,
                              name="noop")
    assert len(calls) == 5
    assert result.samples_s == pytest.approx((0.3, 0.1, 0.2))
    assert result.median_s == pytest.approx(0.2)
    assert result.spread == pytest.approx((0.3 - 0.1) / 0.2)
    assert result.device == "cpu" and "synchronize" in result.method
    assert result.versions["torch"] == torch.__version__


def test_timer_synchronises_before_each_clock_read(monkeypatch):
    events = []
    monkeypatch.setattr(timing, "synchronize", lambda device: events.append("sync"))
    clock = FakeClock([1.0])

    def tick():
        events.append("clock")
        return clock()

    with timing.Timer("cpu", clock=tick) as t:
        events.append("work")
    assert events == ["sync", "clock", "work", "sync", "clock"]
    assert t.elapsed_s == 1.0


def test_results_render_as_text_and_html_tables():
    r = timing.TimingResult("matmul", (0.002, 0.001, 0.003), "cpu", "perf_counter", 1)
    text = str(timing.table([r]))
    assert "matmul" in text and "2.000 ms" in text
    html = r._repr_html_()
    assert html.startswith("<table>") and "<td>matmul</td>" in html
    assert r.to_dict()["median_s"] == pytest.approx(0.002)


@pytest.mark.parametrize(("kwargs", "field"), [({"warmup": -1}, "warmup"), ({"repeats": 0}, "repeats")])
def test_bad_arguments(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}="):
        timing.benchmark(lambda: None, **kwargs)


def test_real_benchmark_measures_real_work():
    a = torch.randn(128, 128)
    small = timing.benchmark(lambda: a @ a, repeats=3)
    assert all(s > 0 for s in small.samples_s)


def test_quartiles_bound_the_middle_half_and_ignore_one_slow_repeat():
    quiet = timing.TimingResult("step", (1.0, 2.0, 3.0, 4.0, 5.0), "cpu", "perf_counter", 0)
    assert quiet.quartiles_s == pytest.approx((2.0, 4.0))  # inclusive (numpy's linear) method
    assert quiet.iqr_s == pytest.approx(2.0)
    # Another process takes the core for one repeat: the range explodes, the middle half not.
    disturbed = timing.TimingResult("step", (1.0, 2.0, 3.0, 4.0, 500.0), "cpu", "perf_counter", 0)
    assert disturbed.spread > 100 * quiet.spread
    assert disturbed.quartiles_s == quiet.quartiles_s
    single = timing.TimingResult("step", (7.0,), "cpu", "perf_counter", 0)
    assert single.quartiles_s == (7.0, 7.0) and single.iqr_s == 0.0


def test_pooled_keeps_every_repeat_of_alternating_rounds():
    rounds = [timing.TimingResult("mm", (1.0, 2.0), "cpu", "m", 1),
              timing.TimingResult("mm", (3.0,), "cpu", "m", 1)]
    pooled = timing.pooled(rounds, name="matmul")
    assert pooled.samples_s == (1.0, 2.0, 3.0)
    assert (pooled.name, pooled.device, pooled.method) == ("matmul", "cpu", "m")
    assert timing.pooled(rounds).name == "mm"


def test_pooled_refuses_results_timed_differently():
    synced = timing.TimingResult("mm", (1.0,), "cpu", "perf_counter after synchronize", 1)
    unsynced = timing.TimingResult("mm (no sync)", (1.0,), "cpu", "no synchronize", 0)
    with pytest.raises(ValueError, match="like with like"):
        timing.pooled([synced, unsynced])
    with pytest.raises(ValueError, match="empty"):
        timing.pooled([])
