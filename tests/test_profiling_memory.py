"""Memory over time: real profiler runs on a tiny, activation-heavy MLP (CPU), parsers fed
malformed input, and the CUDA snapshot path (GPU tests, skipped without CUDA).

The model is chosen so that activations (256 × 64 floats per hidden layer) outweigh the
parameters (about 33 KB): then the total must fall in the backward, not only the activations.
"""

from __future__ import annotations

import json
import pickle

import matplotlib
import pytest
import torch
from torch import nn

from labkit.memory import optimizer_state_tensors, storage_bytes
from labkit.profiling.memory_timeline import (
    DEVICE_KIND,
    HOST_KIND,
    MemoryTimeline,
    PhaseSpan,
    forward_rise,
    phases_from_trace_events,
    plot_memory_timeline,
    record_memory_timeline,
    timeline_from_snapshot,
    timeline_from_trace_events,
)
from labkit.profiling.phases import phase

matplotlib.use("Agg")


class Job:
    """A model, its AdamW and one batch; ``step`` is one training step with marked phases."""

    def __init__(self, device: str = "cpu") -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                                   nn.Linear(64, 32)).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters())
        self.x = torch.randn(256, 32, device=device)
        self.saved_bytes: list[int] = []

    def step(self) -> None:
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in params:
                saved.append(t)
            return t

        with phase("data"):
            xb = self.x * 1
        with phase("forward"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = self.model(xb).square().mean()
        # counted: what autograd keeps for backward, less the batch (allocated before forward)
        self.saved_bytes.append(storage_bytes(t for t in saved if t is not xb))
        saved.clear()
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    @property
    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def state_bytes(self, *, with_scalars: bool) -> int:
        if not with_scalars:
            return storage_bytes(optimizer_state_tensors(self.opt))
        return sum(v.untyped_storage().nbytes() for s in self.opt.state.values()
                   for v in s.values() if isinstance(v, torch.Tensor))


@pytest.fixture(scope="module")
def recorded() -> tuple[Job, MemoryTimeline]:
    torch.set_num_threads(1)
    job = Job()
    tl = record_memory_timeline(job.step, steps=2, warmup=1, device="cpu", model=job.model,
                                optimizer=job.opt)
    return job, tl


@pytest.fixture(scope="module")
def trace_events() -> list[dict]:
    """A real Chrome trace of two steps, as json.load gives it."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    job = Job()
    job.step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        job.step()
        job.step()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/t.json")
        with open(f"{tmp}/t.json") as f:
            return json.load(f)["traceEvents"]


# --- the recorded CPU timeline ------------------------------------------------------------


def test_memory_rises_in_the_forward_and_falls_in_the_backward(recorded):
    _, tl = recorded
    for i in (0, 1):
        fwd, bwd = tl.phase("forward", i), tl.phase("backward", i)
        assert tl.at(fwd.end_s) > tl.at(fwd.start_s)
        assert tl.at(bwd.end_s) < tl.at(fwd.end_s)
    assert tl.phase("forward").start_s < tl.peak_time_s < tl.phase("optimizer").start_s


def test_the_forward_rise_is_the_saved_activations(recorded):
    job, tl = recorded
    rise = forward_rise(tl, expected_bytes=job.saved_bytes[1],
                        expected_label="counted: saved_tensors_hooks")
    # the forward also keeps the loss and may hold a temporary: a little above, never below
    assert 1.0 <= rise.ratio < 1.15, rise
    assert rise.activation_bytes is not None and rise.activation_bytes > 0


def test_phases_come_in_step_order_on_the_memory_clock(recorded):
    _, tl = recorded
    names = [s.name for s in tl.phases]
    assert names == ["data", "forward", "backward", "optimizer"] * 2
    starts = [s.start_s for s in tl.phases]
    assert starts == sorted(starts) and all(s.end_s > s.start_s for s in tl.phases)
    assert [s.index for s in tl.phases] == [0] * 4 + [1] * 4
    assert tl.times_s[0] == 0.0 and tl.times_s[-1] >= tl.phases[-1].start_s


def test_host_memory_is_labelled_and_the_baseline_is_counted(recorded):
    job, tl = recorded
    assert tl.kind == HOST_KIND and tl.is_host and tl.device == "cpu"
    assert "Total Allocated" in tl.method
    assert tl.baseline_method.startswith("counted")
    # parameters and Adam's two moments, alive before the profiler started (no grads: set to None)
    assert tl.baseline_bytes == job.param_bytes + job.state_bytes(with_scalars=False)
    assert tl.total_bytes[0] == tl.baseline_bytes
    assert tl.peak_bytes == max(tl.total_bytes) > tl.baseline_bytes


def test_categories_hold_parameters_and_gradients_byte_for_byte(recorded):
    job, tl = recorded
    cats = tl.categories
    assert cats is not None, tl.categories_note
    assert {"parameter", "gradient", "optimizer_state", "activation"} <= set(cats.bytes)
    fwd, bwd = tl.phase("forward"), tl.phase("backward")
    pb = job.param_bytes
    for t in (fwd.start_s, fwd.end_s, bwd.end_s):
        assert cats.at("parameter", t) == pb
        assert cats.at("optimizer_state", t) == job.state_bytes(with_scalars=True)
    assert cats.at("gradient", fwd.end_s) == 0  # zero_grad(set_to_none=True) in the step before
    assert cats.at("gradient", bwd.end_s) == pb
    assert cats.at("activation", fwd.end_s) > cats.at("activation", bwd.end_s)
    assert cats.at("activation", fwd.start_s) == 0
    with pytest.raises(KeyError, match="not recorded"):
        cats.at("kv_cache", 0.0)


def test_summary_names_the_memory_and_the_method(recorded):
    _, tl = recorded
    text = tl.summary()
    assert "host memory" in text and "counted" in text and "forward" in text
    assert "<pre>" in tl._repr_html_()


def test_an_unknown_phase_says_how_to_mark_it(recorded):
    _, tl = recorded
    with pytest.raises(KeyError, match="record_function"):
        tl.phase("communication")


def test_forward_rise_wants_a_label_for_what_it_is_compared_with(recorded):
    _, tl = recorded
    with pytest.raises(ValueError, match="modelled"):
        forward_rise(tl, expected_bytes=1000)


# --- the uncategorised fallback: [memory] events of a Chrome trace --------------------------


def test_trace_events_give_the_same_shape_without_categories(trace_events):
    tl = timeline_from_trace_events(trace_events)
    assert tl.categories is None and "not categorised" in tl.categories_note
    assert tl.baseline_method.startswith("none")
    for i in (0, 1):
        fwd, bwd = tl.phase("forward", i), tl.phase("backward", i)
        assert tl.at(fwd.end_s) > tl.at(fwd.start_s) and tl.at(bwd.end_s) < tl.at(fwd.end_s)
    # the CPU counter starts at 0 when the profiler starts: a baseline shifts the whole series
    shifted = timeline_from_trace_events({"traceEvents": trace_events}, baseline_bytes=1000,
                                         baseline_method="counted: test")
    assert [b - 1000 for b in shifted.total_bytes] == list(tl.total_bytes)


def test_phases_alone_can_be_read_from_a_trace(trace_events):
    spans = phases_from_trace_events(trace_events, names=("forward",))
    assert [(s.name, s.index) for s in spans] == [("forward", 0), ("forward", 1)]
    assert spans[0].start_s == 0.0


@pytest.mark.parametrize(
    ("events", "error", "match"),
    [
        ([], ValueError, "empty"),
        ("trace.json", TypeError, "list of dicts"),
        ([1, 2], TypeError, "not a dict"),
        ({"events": []}, ValueError, "traceEvents"),
        ([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 2.0}], ValueError,
         "profile_memory=True"),
        ([{"ph": "i", "name": "[memory]", "ts": 1.0, "args": {"Bytes": 8, "Device Type": 0}}],
         ValueError, "Total Allocated"),
        ([{"ph": "i", "name": "[memory]", "ts": 1.0}], ValueError, "no args"),
        ([{"ph": "X", "cat": "user_annotation", "name": "forward", "ts": 1.0}], ValueError,
         "ts/dur"),
    ],
)
def test_malformed_traces_say_what_is_wrong(events, error, match):
    with pytest.raises(error, match=match):
        timeline_from_trace_events(events)


def test_asking_for_a_device_the_trace_does_not_hold(trace_events):
    with pytest.raises(ValueError, match=r"no \[memory\] events for cuda:0.*\(0, -1\)"):
        timeline_from_trace_events(trace_events, device="cuda:0")
    with pytest.raises(ValueError, match="knows 'cpu' and 'cuda'"):
        timeline_from_trace_events(trace_events, device="meta")


def test_a_baseline_needs_its_method(trace_events):
    with pytest.raises(ValueError, match="baseline_method"):
        timeline_from_trace_events(trace_events, baseline_bytes=10)


# --- the CUDA snapshot format, parsed on any machine ----------------------------------------


def _snapshot() -> dict:
    """The shape of torch.cuda.memory._snapshot(): blocks live now, and the recorded actions."""
    trace = [
        {"action": "alloc", "addr": 100, "size": 512, "time_us": 1_000, "frames": []},
        {"action": "alloc", "addr": 200, "size": 1024, "time_us": 1_010, "frames": []},
        {"action": "free_requested", "addr": 100, "size": 512, "time_us": 1_020, "frames": []},
        {"action": "free_completed", "addr": 100, "size": 512, "time_us": 1_021, "frames": []},
        {"action": "segment_alloc", "addr": 0, "size": 2 << 20, "time_us": 1_022, "frames": []},
    ]
    blocks = [
        {"size": 4096, "requested_size": 4000, "state": "active_allocated", "frames": []},  # before
        {"size": 1024, "requested_size": 1024, "state": "active_allocated", "frames": []},
        {"size": 8192, "state": "inactive", "frames": []},
    ]
    return {"segments": [{"device": 0, "address": 0, "total_size": 2 << 20, "blocks": blocks}],
            "device_traces": [trace]}


def test_a_snapshot_becomes_a_timeline_with_the_level_before_it_worked_back():
    spans = (PhaseSpan("forward", 0.0, 15e-6, 0),)
    tl = timeline_from_snapshot(_snapshot(), phases=spans, t0_us=1_000)
    assert tl.kind == DEVICE_KIND and not tl.is_host and tl.device == "cuda:0"
    # 4000 B were live before the history began; +512, +1024, then the 512 freed
    assert tl.total_bytes == (4000, 4512, 5536, 5024)
    assert tl.times_s == pytest.approx((0.0, 0.0, 10e-6, 21e-6))  # time_us is µs
    assert tl.peak_bytes == 5536 and tl.rise("forward") == 5536 - 4512
    assert tl.baseline_bytes == 4000 and tl.baseline_method.startswith("measured")
    assert not tl.notes


@pytest.mark.parametrize(
    ("snapshot", "kwargs", "match"),
    [
        ({"segments": []}, {}, "device_traces"),
        ([], {}, "device_traces"),
        ({"segments": [], "device_traces": [[]]}, {}, "_record_memory_history"),
        ({"segments": [], "device_traces": [[]]}, {"device_index": 3}, "1 device"),
        ({"segments": [], "device_traces": [[{"action": "alloc", "addr": 1}]]}, {}, "time_us"),
    ],
)
def test_malformed_snapshots_say_what_is_wrong(snapshot, kwargs, match):
    with pytest.raises(ValueError, match=match):
        timeline_from_snapshot(snapshot, **kwargs)


# --- plotting and the entry point's guards -------------------------------------------------


def test_the_plot_stacks_categories_shades_phases_and_says_host_memory(recorded):
    _, tl = recorded
    ax = plot_memory_timeline(tl)
    try:
        assert len(ax.collections) == len(tl.categories.bytes)  # one area per category
        total = [line for line in ax.lines if line.get_label().startswith("total")]
        assert len(total) == 1
        assert len(ax.patches) == len(tl.phases)  # one shaded span per phase
        assert {t.get_text() for t in ax.texts} == {"data", "forward", "backward", "optimizer"}
        assert "Host memory" in ax.get_title() and "MiB" in ax.get_ylabel()
        assert "2 training steps" in ax.get_title()
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "parameter" in legend and any(t.startswith("peak") for t in legend)
        # the training text ("input") was allocated before recording: outside the total, so it
        # is drawn apart from the stack (hatched) and says so, never as a band of the stack
        assert "input" in tl.categories.bytes, "the recording has no input band to check"
        assert "input" not in legend
        assert [t for t in legend if t.startswith("input")] == [
            "input (not in the total: allocated before recording)"]
    finally:
        import matplotlib.pyplot as plt

        plt.close(ax.figure)


def test_the_plot_without_categories_draws_the_total_alone(trace_events):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    try:
        assert plot_memory_timeline(timeline_from_trace_events(trace_events), ax) is ax
        assert not ax.collections and len(ax.patches) == 8
    finally:
        plt.close(fig)


def test_record_refuses_nonsense():
    with pytest.raises(ValueError, match="at least one step"):
        record_memory_timeline(lambda: None, steps=0)
    with pytest.raises(TypeError, match="callable"):
        record_memory_timeline(None)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CPU-only torch")
def test_record_on_cuda_without_a_gpu_says_to_use_the_cpu():
    with pytest.raises(RuntimeError, match="device='cpu'"):
        record_memory_timeline(lambda: None, device="cuda")


# --- GPU: the allocator's history and snapshot ----------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_snapshot_timeline_rises_in_forward_and_is_saved_for_memory_viz(tmp_path):
    job = Job("cuda")
    path = tmp_path / "snapshot.pickle"
    tl = record_memory_timeline(job.step, steps=2, device="cuda", snapshot_path=path)
    assert tl.kind == DEVICE_KIND and tl.device == "cuda:0"
    assert "_record_memory_history" in tl.method, tl.notes
    for i in (0, 1):
        fwd, bwd = tl.phase("forward", i), tl.phase("backward", i)
        assert tl.at(fwd.end_s) > tl.at(fwd.start_s)
        assert tl.at(bwd.end_s) < tl.at(fwd.end_s)
    # phases and snapshot on one clock: the forward's rise is the saved activations
    assert 1.0 <= forward_rise(tl, expected_bytes=job.saved_bytes[1],
                               expected_label="counted").ratio < 1.15
    # the level before the first step holds at least the parameters and Adam's state
    assert tl.total_bytes[0] >= job.param_bytes + job.state_bytes(with_scalars=False)
    with open(path, "rb") as f:
        assert "device_traces" in pickle.load(f)
    assert tl.snapshot_path == str(path)
    if tl.categories is not None:
        assert tl.categories.at("parameter", tl.phase("forward").start_s) == job.param_bytes
    ax = plot_memory_timeline(tl)
    assert "Device memory" in ax.get_title()


def test_the_recordings_memory_columns_give_each_phases_net_bytes(recorded):
    """key_averages' CPU Mem column (profile_memory=True) per phase: the batch the data phase
    allocates and the gradients the optimizer phase frees, to the byte."""
    from labkit.profiling import PHASES, net_bytes

    job, tl = recorded
    assert tl.recorded_steps == 2 and tl.averages is not None
    net = net_bytes(tl.averages, PHASES, steps=tl.recorded_steps)
    assert net["data"] == job.x.numel() * job.x.element_size()  # xb = x * 1
    assert net["optimizer"] == -job.param_bytes  # zero_grad(set_to_none=True) frees the grads
    assert net["forward"] > 0 > net["backward"]
    assert net_bytes(tl.averages, ["no such range"], steps=2) == {}
    with pytest.raises(ValueError, match="steps=0"):
        net_bytes(tl.averages, PHASES, steps=0)
