"""labkit.monitor: live plots driven by the launcher's loop or a thread; one final figure.

Displays are captured by replacing ``show_bundle`` (the one function the monitor shows things
with) where the Monitor looks it up, ``labkit.monitor.watch``, so each test can count figures
and tables exactly.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import nbformat
import papermill as pm
import pytest
import torch
from fake_nvml import FakeGpu, FakeNvml

from labkit import config, monitor, train
from labkit.jobs import launch
from labkit.metrics import Backend, BackendUnavailable, NvmlBackend, ReplayBackend, Sample
from labkit.model import GPT
from labkit.monitor import Monitor, display, watch
from labkit.workers._faults import FaultsConfig
from labkit.workers.allreduce import AllReduceConfig

ROOT = Path(__file__).resolve().parents[1]


# --- doubles -------------------------------------------------------------------------------


class FakeHandle:
    """Stands in for IPython's DisplayHandle: counts updates, keeps the last bundle."""

    def __init__(self, bundle: dict) -> None:
        self.bundles = [bundle]

    def update(self, bundle: dict, **kw) -> None:
        assert kw.get("raw") is True
        self.bundles.append(bundle)


class Shown:
    """Everything the monitor displayed, and the cell's output area as Jupyter keeps it.

    Also the kernel's display publisher (``watch.display_publisher``): like ipykernel's
    ``ZMQDisplayPublisher``, ``clear_output`` passes its message through the registered hooks
    before it is sent. Like JupyterLab's output area and nbclient, a clear removes every
    output of the cell and forgets their display ids, so a removed handle's updates change
    nothing shown; ``wait=True`` defers the clear to the next output.
    """

    def __init__(self) -> None:
        self.plain: list[dict] = []
        self.handles: list[FakeHandle] = []
        self.outputs: list[dict | FakeHandle] = []  # what the cell shows, in order
        self.hooks: list = []
        self._clear_next = False

    def __call__(self, bundle: dict, *, display_id: bool = False):
        if self._clear_next:
            self.outputs, self._clear_next = [], False
        if display_id:
            self.handles.append(FakeHandle(bundle))
            self.outputs.append(self.handles[-1])
            return self.handles[-1]
        self.plain.append(bundle)
        self.outputs.append(bundle)
        return None

    def register_hook(self, hook) -> None:
        self.hooks.append(hook)

    def unregister_hook(self, hook) -> bool:
        self.hooks.remove(hook)
        return True

    def clear_output(self, wait: bool = False) -> None:
        msg = {"header": {"msg_type": "clear_output"}, "content": {"wait": wait}}
        for hook in list(self.hooks):
            msg = hook(msg)
            if msg is None:
                return
        if wait:
            self._clear_next = True
        else:
            self.outputs = []

    def final_bundles(self) -> list[dict]:
        """What the cell's output holds at the end: each shown handle's last bundle, and
        each plain display, in the order they were displayed."""
        return [o.bundles[-1] if isinstance(o, FakeHandle) else o for o in self.outputs]

    def figures(self) -> list[dict]:
        return [b for b in self.final_bundles() if "image/png" in b]

    def tables(self) -> list[dict]:
        return [b for b in self.final_bundles() if "text/html" in b]


@pytest.fixture(autouse=True)
def auto_live(monkeypatch):
    """``live`` as a learner gets it (``auto``), whatever the caller's environment says."""
    monkeypatch.setenv(monitor.LIVE_ENV, "auto")


@pytest.fixture
def shown(monkeypatch) -> Shown:
    rec = Shown()
    monkeypatch.setattr(watch, "show_bundle", rec)
    monkeypatch.setattr(watch, "display_publisher", lambda: rec)
    return rec


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeCpu(Backend):
    """A backend whose readings are set by the test (test data, never shown to a learner)."""

    kind = "cpu"

    def __init__(self, clock, values=None) -> None:
        super().__init__(clock)
        self.values = values or {"cpu_pct": 50.0, "rss_gib": 1.0}
        self.opened = self.closed = 0

    def open(self) -> None:
        self.opened += 1

    def close(self) -> None:
        self.closed += 1

    def describe(self) -> str:
        return "CPU only (test double); no NVIDIA GPU found: none in this test"

    def sample(self, now=None):
        return [Sample(self._now(now), "rank0", dict(self.values), kind="cpu")]


def fake_job(**beats) -> SimpleNamespace:
    """What the launcher hands observers, without launching anything."""
    job = SimpleNamespace(module="labkit.workers.fake", heartbeats={}, nproc=1)
    job.progress = lambda: (None, None)
    job.rank_pids = lambda: {r: b["pid"] for r, b in job.heartbeats.items() if "pid" in b}
    job.heartbeats.update(beats)
    return job


def png_ok(bundle: dict) -> bool:
    return bundle["image/png"][:8] == b"\x89PNG\r\n\x1a\n"


# --- pure parts --------------------------------------------------------------------------


def test_na_is_a_gap_not_a_zero():
    samples = [
        Sample(10.0, "gpu0", {"power_w": None}),
        Sample(11.0, "gpu0", {"power_w": 300.0}),
        Sample(12.0, "gpu0", {}),  # not read at this tick: left out, not N/A
        Sample(12.0, "gpu1", {"power_w": 250.0}),
    ]
    xs, ys = monitor.series(samples, "gpu0", "power_w", t0=10.0)
    assert xs == [0.0, 1.0]
    assert math.isnan(ys[0]) and ys[1] == 300.0

    fig = monitor.build_figure(samples, [], ["power_w"], title="t")
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in fig.axes[0].lines}
    assert math.isnan(lines["gpu0"][0]) and 0.0 not in lines["gpu0"]

    row = monitor.summarize(samples, ["power_w"], describe="d", status="ok").row("gpu0", "power_w")
    assert (row.mean, row.max, row.n, row.n_na) == (300.0, 300.0, 1, 1)


def test_sources_sort_gpus_then_processes_then_ranks_then_host():
    names = ["host", "rank10", "rank2", "gpu0/rank1", "gpu1", "gpu0"]
    samples = [Sample(0.0, s, {"m": 1.0}) for s in names]
    assert monitor.sources_of(samples, "m") == ["gpu0", "gpu1", "gpu0/rank1", "rank2", "rank10",
                                                "host"]  # fmt: skip


def test_importing_starts_nothing_and_loads_no_matplotlib():
    code = ("import sys, threading, labkit.monitor; "
            "assert 'matplotlib' not in sys.modules, 'matplotlib imported at import time'; "
            "assert 'pynvml' not in sys.modules; "
            "assert threading.active_count() == 1, threading.enumerate()")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_live_default_reads_the_environment(monkeypatch):
    monkeypatch.setenv(monitor.LIVE_ENV, "1")
    assert monitor.live_default()[0] is True
    monkeypatch.setenv(monitor.LIVE_ENV, "0")
    assert monitor.live_default()[0] is False
    monkeypatch.setenv(monitor.LIVE_ENV, "auto")
    assert monitor.live_default() == (False, "not in a Jupyter kernel")  # pytest is no kernel
    monkeypatch.setenv(monitor.LIVE_ENV, "sometimes")
    with pytest.raises(ValueError, match="LABKIT_LIVE_PLOTS='sometimes'"):
        monitor.live_default()


class FakeProc:
    def __init__(self, cmdline: list[str], parent: FakeProc | None = None) -> None:
        self._cmdline, self._parent = cmdline, parent

    def cmdline(self) -> list[str]:
        return self._cmdline

    def name(self) -> str:
        return Path(self._cmdline[0]).name

    def parent(self) -> FakeProc | None:
        return self._parent


@pytest.mark.parametrize(
    ("parent", "runner"),
    [
        (FakeProc(["/venv/bin/python", "-m", "pytest", "tests/"]), "pytest"),
        (FakeProc(["/venv/bin/python", "/venv/bin/papermill", "a.ipynb", "b.ipynb"]), "papermill"),
        (FakeProc(["/bin/sh", "-c", "run"], FakeProc(["jupyter-nbconvert", "--execute"])),
         "nbconvert"),
        # A JupyterLab server serves a live browser, even when a test started it in a temp dir.
        (FakeProc(["/venv/bin/python", "-m", "jupyterlab", "--root-dir=/tmp/pytest-of-x/p0"]),
         None),
        # a pytest-xdist worker (`./course test`), told by the variable it gives its children
        (FakeProc(["/venv/bin/python", "-u", "-c", "import sys;exec(eval(sys.stdin.readline()))"]),
         "pytest-xdist"),
        (FakeProc(["/venv/bin/python", "-c", "import sys;exec(eval(sys.stdin.readline()))"]),
         None),
    ],
)  # fmt: skip
def test_the_kernels_parent_tells_a_headless_runner(monkeypatch, parent, runner):
    import psutil

    if runner == "pytest-xdist":
        monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    else:
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setattr(psutil, "Process", lambda: FakeProc(["python", "-m", "ipykernel"], parent))
    assert display._headless_executor() == runner


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="backend='gpu'"):
        Monitor(backend="gpu", live=False)
    with pytest.raises(ValueError, match="unknown: \\['gpu_utl'\\]"):
        Monitor(metrics=["gpu_utl"], live=False)


# --- driven by the launcher's loop (observer protocol, no launch) --------------------------


def test_live_mode_redraws_at_most_once_per_redraw_s(shown, monkeypatch):
    clock = Clock()
    backend = FakeCpu(clock)
    mon = Monitor(period_s=0.5, backend=backend, live=True, redraw_s=1.0, clock=clock)
    monkeypatch.setattr(Monitor, "_figure_bundle", lambda self: {"image/png": b"x"})
    job = fake_job()
    mon.on_start(job)
    for i in range(41):  # the launcher ticks every 0.25 s: 10 s
        clock.t = 0.25 * i
        job.heartbeats[0] = {"pid": 1, "step": i // 4, "time": 0.0}
        mon.on_tick(job)
    assert mon.redraws == 11  # t = 0, 1, ..., 10: not one per tick (41)
    assert len(mon.samples) == 21  # one per period_s = 0.5 s
    mon.on_end(job, SimpleNamespace(status="ok"))
    (handle,) = shown.handles
    assert len(handle.bundles) == 1 + 11 + 1  # placeholder, redraws, final figure
    assert len(shown.figures()) == 1 and len(shown.tables()) == 1
    assert [e.step for e in mon.steps] == list(range(11))  # each new step once
    assert backend.closed >= 1 and mon.sampler.state == "stopped"


def run_live_job(shown, *, between) -> tuple[FakeHandle, int]:
    """A live monitor watching a fake job: 10 s of launcher ticks, ``between()`` halfway.
    Returns the live handle, and the frames it got after ``between()``."""
    clock = Clock()
    mon = Monitor(period_s=0.5, backend=FakeCpu(clock), live=True, redraw_s=1.0, clock=clock)
    job = fake_job()
    mon.on_start(job)
    (handle,) = shown.handles
    for i in range(41):
        clock.t = 0.25 * i
        job.heartbeats[0] = {"pid": 1, "step": i // 4, "time": 0.0}
        mon.on_tick(job)
        if i == 20:
            assert shown.figures() == [handle.bundles[-1]]  # the live figure, step 5
            frames = len(handle.bundles)
            between()
    after = len(handle.bundles) - frames
    mon.on_end(job, SimpleNamespace(status="ok"))
    return handle, after


@pytest.mark.parametrize("wait", [False, True])
def test_clear_output_during_a_live_run_still_ends_with_the_final_figure(shown, wait):
    """A learner's clear_output (or another observer's) removes the live figure; updating
    its handle would show nothing, so the final figure is displayed afresh."""

    def learner_clears():
        shown.clear_output(wait=wait)
        shown({"text/plain": "the learner's own line"})

    _, frames_after = run_live_job(shown, between=learner_clears)
    (figure,) = shown.figures()
    assert png_ok(figure) and "step 10 — ok" in figure["text/plain"]
    assert len(shown.tables()) == 1 and "ok; " in shown.tables()[0]["text/plain"]
    assert shown.final_bundles()[0]["text/plain"] == "the learner's own line"
    assert frames_after == 0  # no live frame drawn for an output Jupyter removed
    assert len(shown.handles) == 1 and not shown.hooks  # the clear watch is unregistered


def test_a_clear_that_leaves_the_live_figure_still_ends_with_one_figure(shown):
    """A clear the monitor sees but that never reaches this cell's outputs (a later hook
    takes it, as an output widget may): the live figure is blanked, not left beside the
    final one."""

    def clear_elsewhere():
        shown.register_hook(lambda msg: None)  # takes every later message: nothing is cleared
        shown.clear_output()
        shown.hooks.pop()

    handle, _ = run_live_job(shown, between=clear_elsewhere)
    (figure,) = shown.figures()
    assert "step 10 — ok" in figure["text/plain"] and figure is not handle.bundles[-1]
    assert shown.final_bundles()[0] is handle.bundles[-1] and "image/png" not in handle.bundles[-1]
    assert len(shown.tables()) == 1


def test_headless_mode_shows_nothing_until_one_figure_and_one_table(shown):
    clock = Clock()
    mon = Monitor(period_s=0.5, backend=FakeCpu(clock), live=False, clock=clock)
    job = fake_job()
    mon.on_start(job)
    for i in range(20):
        clock.t = 0.25 * i
        mon.on_tick(job)
    assert shown.plain == [] and shown.handles == []
    mon.on_end(job, SimpleNamespace(status="ok"))
    assert len(shown.plain) == 2
    fig, table = shown.plain
    assert png_ok(fig) and "labkit.workers.fake" in fig["text/plain"]
    assert "no NVIDIA GPU found" in table["text/plain"] and "<table>" in table["text/html"]


def test_a_failing_tick_stops_the_sampler_before_the_launcher_drops_it(shown, monkeypatch):
    clock = Clock()
    backend = FakeCpu(clock)
    mon = Monitor(period_s=0.5, backend=backend, live=False, clock=clock)
    job = fake_job()
    mon.on_start(job)
    monkeypatch.setattr(mon.sampler, "poll_due", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        mon.on_tick(job)
    assert backend.closed >= 1 and mon.sampler.state == "stopped"


def test_gpu_tier_plots_per_gpu_and_drops_panels_the_gpu_cannot_report(shown):
    clock = Clock()
    gpus = [FakeGpu(uuid="GPU-aaaa-0", gpm=None), FakeGpu(uuid="GPU-bbbb-1", gpm=None)]
    mon = Monitor(period_s=1.0, backend=NvmlBackend(nvml=FakeNvml(gpus)), live=False, clock=clock)
    job = fake_job()
    mon.on_start(job)
    for i in range(4):
        clock.t = float(i)
        mon.on_tick(job)
    mon.on_end(job, SimpleNamespace(status="ok"))
    # Pre-Hopper (no GPM): no SM-activity panels, rather than empty ones.
    assert mon.shown_metrics() == ["gpu_util_pct", "mem_used_gib", "power_w"]
    summary = mon.summary()
    assert summary.sources == ["gpu0", "gpu1"]
    assert summary.row("gpu1", "power_w").mean == pytest.approx(612.5)
    assert summary.describe.startswith("NVML: 2 GPUs")
    assert len(shown.figures()) == 1


def test_a_job_on_cpu_ranks_is_shown_per_rank_even_where_a_gpu_is(shown, monkeypatch):
    """Two ranks on a one-GPU machine run on the CPU: the idle GPU would hide them."""
    gpu_backend = NvmlBackend(nvml=FakeNvml([FakeGpu()]))

    def auto_backend(*args, **kwargs):  # what auto_backend returns where NVML sees a GPU
        gpu_backend.open()
        return gpu_backend

    monkeypatch.setattr(watch, "auto_backend", auto_backend)
    job = fake_job()
    job.device = "cpu"
    mon = Monitor(live=False)
    mon.on_start(job)
    mon.on_end(job, SimpleNamespace(status="ok"))
    assert mon.kind == "cpu"
    assert "ranks run on the CPU over gloo, not on the 1× NVIDIA H200" in mon.describe()
    assert "no NVIDIA GPU found" not in mon.describe()
    assert not gpu_backend._open  # the NVML handle it did not use is closed again
    job.device = "cuda"  # ranks on the GPU: the GPU's own readings
    mon.on_start(job)
    mon.on_end(job, SimpleNamespace(status="ok"))
    assert mon.kind == "nvml"


# --- a replayed recording ------------------------------------------------------------------


def write_trace(path: Path) -> Path:
    """A tiny trace in the Recorder's format. Test data, not a measurement."""
    meta = {"hardware": "1× NVIDIA H200", "driver": "570.86.15", "date": "2026-01-31",
            "notes": "test data written by tests/test_monitor.py, not a measurement"}  # fmt: skip
    rows = [{"t": float(t), "source": "gpu0",
             "values": {"gpu_util_pct": 90.0, "power_w": None if t == 1 else 500.0}}
            for t in range(4)]  # fmt: skip
    header = {"format": "labkit-metrics-trace", "version": 1, "metadata": meta}
    path.write_text("\n".join(json.dumps(o) for o in [header, *rows]) + "\n")
    return path


def test_a_replay_is_labelled_a_recording_and_played_in_full(shown, tmp_path):
    trace = write_trace(tmp_path / "trace.jsonl")
    with Monitor(backend=ReplayBackend(trace, realtime=False), live=False) as mon:
        pass  # nothing runs: the recording is the content
    assert mon.kind == "replay"
    assert [s.time_s for s in mon.samples] == [0.0, 1.0, 2.0, 3.0]
    assert "recording of 1× NVIDIA H200 on 2026-01-31" in mon.figure()._suptitle.get_text()
    (fig,) = shown.figures()
    assert "recording of 1× NVIDIA H200" in fig["text/plain"]
    row = mon.summary().row("gpu0", "power_w")
    assert (row.n, row.n_na) == (3, 1)
    assert "recording of" in shown.tables()[0]["text/plain"]


# --- the `with` form ------------------------------------------------------------------------


def sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "labkit-metrics-sampler"]


def test_with_block_records_train_steps_and_samples_the_kernel(shown):
    cfg = config.smoke().replace(steps=4, seq_len=16, micro_batch=2)
    torch.manual_seed(0)
    data = torch.randint(0, 256, (2_000,))
    seen = []
    with Monitor(period_s=0.1, live=False) as mon:
        train.train(GPT(cfg.model), cfg, data, device=torch.device("cpu"),
                    on_step=mon.chain(lambda step, stats: seen.append(stats.loss)))  # fmt: skip
    assert [(e.rank, e.step) for e in mon.steps] == [(0, 1), (0, 2), (0, 3), (0, 4)]
    assert len(seen) == 4  # the chained callback ran too
    assert {"rank0", "host"} <= {s.source for s in mon.samples}
    assert mon.summary().last_step == {0: 4}
    assert "step 4" in shown.figures()[0]["text/plain"]
    assert mon.sampler.state == "stopped" and not sampler_threads()


def test_a_backend_that_cannot_run_fails_at_the_start_and_leaves_nothing(shown):
    from pynvml import NVML_ERROR_LIBRARY_NOT_FOUND

    nvml = NvmlBackend(nvml=FakeNvml(init_error=NVML_ERROR_LIBRARY_NOT_FOUND))
    with pytest.raises(BackendUnavailable, match="library not found"), Monitor(backend=nvml):
        pytest.fail("the block must not run")
    assert not sampler_threads() and shown.final_bundles() == []


@pytest.mark.parametrize(
    ("exc", "status"), [(ZeroDivisionError, "error: ZeroDivisionError"),
                        (KeyboardInterrupt, "interrupted")]
)  # fmt: skip
def test_with_block_stops_the_thread_when_the_code_raises(shown, exc, status):
    with pytest.raises(exc), Monitor(period_s=0.1, live=False) as mon:
        assert sampler_threads()
        raise exc
    assert not sampler_threads() and mon.sampler.state == "stopped"
    assert mon.status == status
    assert len(shown.figures()) == 1 and status in shown.tables()[0]["text/plain"]


def test_with_block_live_redraws_from_the_sampler_thread(shown):
    import time

    with Monitor(period_s=0.1, live=True, redraw_s=0.1) as mon:
        deadline = time.monotonic() + 30.0  # ~1.5 s unless the machine is very busy
        while mon.redraws < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    (handle,) = shown.handles
    assert mon.redraws >= 2 and len(handle.bundles) == 1 + mon.redraws + 1
    assert png_ok(handle.bundles[-1]) and shown.plain == shown.tables()  # figure not repeated


# --- real jobs -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_two_rank_job_is_sampled_per_rank_with_step_events(shown):
    mon = Monitor(period_s=0.2, live=False)
    # ~1-2 s of all-reduces on 2 cores: long enough for several samples of each rank.
    res = launch.run(AllReduceConfig(numel=2**22, repeats=120), nproc=2, observers=[mon],
                     stream=False)  # fmt: skip
    assert res.status == "ok" and mon.status == "ok"
    summary = mon.summary()
    assert {"rank0", "rank1", "host"} <= set(summary.sources)
    for r in ("rank0", "rank1"):
        assert summary.row(r, "rss_gib").n >= 1 and summary.row(r, "rss_gib").mean > 0
    assert {e.rank for e in mon.steps} == {0, 1}
    assert summary.last_step == {0: 123, 1: 123}  # 3 warm-up + 120 timed, from heartbeats
    assert "step 123/123 — ok" in shown.figures()[0]["text/plain"]
    assert "no NVIDIA GPU found" in summary.describe or summary.describe.startswith("NVML")
    assert len(shown.figures()) == 1 and len(shown.tables()) == 1 and not shown.handles
    assert mon.sampler.state == "stopped"


@pytest.mark.slow
def test_a_failed_job_still_stops_sampling_and_shows_the_figure(shown):
    mon = Monitor(period_s=0.2, live=False)
    with pytest.raises(launch.JobFailed):
        launch.run(FaultsConfig(mode="raise"), nproc=2,
                   observers=[mon], stream=False)  # fmt: skip
    assert mon.status == "failed" and mon.sampler.state == "stopped"
    assert len(shown.figures()) == 1 and "failed" in shown.tables()[0]["text/plain"]


NOTEBOOK_CELLS = [
    f"import sys, time\nsys.path.insert(0, {str(ROOT)!r})\nfrom labkit.monitor import Monitor",
    # default `live`: the kernel's parent is pytest (this test), a headless executor
    "with Monitor(period_s=0.1) as mon:\n"
    "    for i in range(4):\n"
    "        time.sleep(0.1)\n"
    "        mon.step(i + 1, total=4)",
    # forced live: nbclient applies the display updates in place: still one figure
    "with Monitor(period_s=0.1, live=True, redraw_s=0.1) as live:\n"
    "    deadline = time.monotonic() + 30\n"
    "    while live.redraws < 2 and time.monotonic() < deadline:\n"
    "        time.sleep(0.05)",
    "print(mon.live, live.live, live.redraws >= 2)",
]


def run_cells(tmp_path, cells: list[str]):
    """The executed notebook of ``cells``, run in a fresh kernel by papermill (as nbval and the
    course's tests run notebooks)."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    path = tmp_path / "in.ipynb"
    nbformat.write(nb, path)
    return pm.execute_notebook(str(path), str(tmp_path / "out.ipynb"), kernel_name="python3",
                               cwd=str(tmp_path), execution_timeout=120, progress_bar=False)  # fmt: skip


@pytest.mark.slow
def test_papermill_run_leaves_exactly_one_figure_and_one_table(tmp_path):
    out = run_cells(tmp_path, NOTEBOOK_CELLS)
    for cell in out.cells[1:3]:
        data = [o.get("data", {}) for o in cell.outputs]
        assert sum("image/png" in d for d in data) == 1, cell.source
        assert sum("text/html" in d for d in data) == 1, cell.source
    assert out.cells[3].outputs[0]["text"].split() == ["False", "True", "True"]


CLEARING_CELLS = [
    f"import sys, time\nsys.path.insert(0, {str(ROOT)!r})\n"
    "from IPython.display import clear_output\nfrom labkit.monitor import Monitor",
    # A learner's loop that clears the cell as it goes, under a live monitor: Jupyter removes
    # the live figure with the rest, and a display handle's later updates find nothing.
    "with Monitor(period_s=0.1, live=True, redraw_s=0.1) as mon:\n"
    "    deadline = time.monotonic() + 30\n"
    "    while mon.redraws < 1 and time.monotonic() < deadline:\n"
    "        time.sleep(0.05)\n"
    "    for i in range(3):\n"
    "        clear_output(wait=i > 0)\n"
    "        print(f'step {i}')\n"
    "        mon.step(i + 1, total=3)\n"
    "        time.sleep(0.2)",
    "print(mon.redraws >= 1)",
]


@pytest.mark.slow
def test_clear_output_under_a_live_monitor_keeps_the_final_figure(tmp_path):
    """In a real kernel, run by nbclient (which drops a cleared display_id's updates, as
    JupyterLab's output area does): after the learner's clear_output the final figure and
    the table are still under the cell, once each, below what the learner printed last."""
    out = run_cells(tmp_path, CLEARING_CELLS)
    assert out.cells[2].outputs[0]["text"].split() == ["True"]  # a live frame was shown
    outputs = out.cells[1].outputs
    data = [o.get("data", {}) for o in outputs]
    assert sum("image/png" in d for d in data) == 1, outputs
    assert sum("text/html" in d for d in data) == 1, outputs
    figure = next(d for d in data if "image/png" in d)
    assert "step 3/3" in figure["text/plain"] and "— ok" in figure["text/plain"]
    assert [o.get("text") for o in outputs if o["output_type"] == "stream"] == ["step 2\n"]


# --- what a learner sees first, and last ---------------------------------------------------


def panel_notes(fig) -> dict[str, list[str]]:
    """{metric: the grey notes written across its panel} (the y label's first line names it)."""
    return {ax.get_ylabel().split("\n")[0]: [t.get_text() for t in ax.texts if t.get_text()]
            for ax in fig.axes}  # fmt: skip


def test_panels_wait_for_ranks_until_a_rank_is_sampled(shown):
    """Ranks spend seconds importing torch: their panels are not "N/A" then, only not yet."""
    import os

    clock = Clock()
    mon = Monitor(period_s=0.5, backend="cpu", metrics=["cpu_pct", "rss_gib", "power_w"],
                  live=False, clock=clock)  # fmt: skip
    job = fake_job()  # no heartbeat yet: no rank PIDs
    mon.on_start(job)
    mon.on_tick(job)
    notes = panel_notes(mon.figure())
    assert notes["cpu_pct"] == ["waiting for ranks"] and notes["rss_gib"] == ["waiting for ranks"]
    # power_w is not a CPU metric: that one is N/A for good, not waiting.
    assert notes["power_w"] == ["N/A: not reported by this device"]
    job.heartbeats[0] = {"pid": os.getpid(), "step": 0, "time": 0.0}
    clock.t = 1.0
    mon.on_tick(job)
    notes = panel_notes(mon.figure())
    assert notes["rss_gib"] == [] and notes["power_w"] == ["N/A: not reported by this device"]
    mon.on_end(job, SimpleNamespace(status="ok"))


def test_a_figure_before_any_sample_says_it_waits():
    notes = panel_notes(monitor.build_figure([], [], ["cpu_pct"], title="t"))
    assert notes["cpu_pct"] == ["waiting for the first sample"]


def test_an_exited_process_ends_its_line_and_never_reads_as_zero_memory():
    """A rank that has exited stays a zombie until torchrun reaps it, and psutil reads a
    zombie's memory as 0 B: the rank's memory line fell to 0 at the end of every job."""
    import time

    import psutil

    from labkit.metrics import CpuBackend

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 60  # exits in well under a second
        while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.05)
        backend = CpuBackend(lambda: {1: proc.pid})
        backend.open()
        (rank1,) = [s for s in backend.sample() if s.source == "rank1"]
        assert rank1.status == "exited" and "rss_gib" not in rank1.values
    finally:
        proc.wait()


def test_a_job_of_several_parts_counts_steps_over_the_job_and_names_the_part(shown):
    clock = Clock()
    mon = Monitor(period_s=0.5, backend=FakeCpu(clock), live=False, clock=clock)
    job = fake_job()
    job.nproc = 2
    job.progress = lambda: (min(b["step"] for b in job.heartbeats.values()), 96)
    mon.on_start(job)
    for t, step, part in [(1.0, 12, "naive (1/8)"), (2.0, 13, "bucketed (2/8)"),
                          (3.0, 14, "bucketed (2/8)")]:  # fmt: skip
        clock.t = t
        for rank in (0, 1):
            job.heartbeats[rank] = {"pid": 1, "step": step - rank, "total": 96, "part": part,
                                    "time": 0.0}  # fmt: skip
        mon.on_tick(job)
    title = mon.figure()._suptitle.get_text()
    assert "step 13/96 — bucketed (2/8)" in title  # the slowest rank's step and part
    assert [p.part for p in mon.parts] == ["naive (1/8)", "bucketed (2/8)"]
    steps_panel = mon.figure().axes[-1]
    assert {"naive (1/8)", "bucketed (2/8)"} <= {t.get_text() for t in steps_panel.texts}
    # A part that began and ended between two ticks: the heartbeat's list of parts has it.
    clock.t = 4.0
    wall = mon._wall_offset  # time.time() at the monitor's clock's zero
    begun = [["naive (1/8)", wall + 0.5], ["bucketed (2/8)", wall + 1.5],
             ["ddp (3/8)", wall + 3.2], ["zero1 (4/8)", wall + 3.9]]  # fmt: skip
    job.heartbeats[0] = {"pid": 1, "step": 40, "total": 96, "part": "zero1 (4/8)",
                         "parts": begun, "time": wall + 4.0}  # fmt: skip
    mon.on_tick(job)
    assert [(p.part, p.time_s) for p in mon.parts][2:] == [("ddp (3/8)", pytest.approx(3.2)),
                                                          ("zero1 (4/8)", pytest.approx(3.9))]
    mon.on_end(job, SimpleNamespace(status="ok"))


def test_the_with_form_names_its_parts_where_they_begin(shown):
    clock = Clock()
    with Monitor(period_s=0.5, backend=FakeCpu(clock), live=False, clock=clock) as mon:
        clock.t = 1.0
        mon.part("tiny element-wise ops")
        clock.t = 2.5
        mon.part("large matmuls")
        clock.t = 4.0
    assert [(p.part, p.time_s) for p in mon.parts] == [("tiny element-wise ops", 1.0),
                                                      ("large matmuls", 2.5)]
    steps_panel = mon.figure().axes[-1]
    assert {"tiny element-wise ops", "large matmuls"} <= {t.get_text() for t in steps_panel.texts}
    with pytest.raises(ValueError, match="non-empty name"):
        mon.part("")


class FakeTime:
    """Stands in for the ``time`` module inside labkit.monitor: a machine so busy that a
    redraw takes ``wall`` seconds of wall-clock time for ``cpu`` seconds of our CPU time."""

    def __init__(self, clock: Clock, wall: float, cpu: float) -> None:
        self.clock, self.wall, self.cpu = clock, wall, cpu
        self.cpu_used = self.wall_used = 0.0

    def perf_counter(self) -> float:
        return self.wall_used

    def thread_time(self) -> float:
        return self.cpu_used

    def monotonic(self) -> float:
        return self.clock.t

    def time(self) -> float:
        return 1e9 + self.clock.t

    def render(self) -> dict:
        self.wall_used += self.wall
        self.cpu_used += self.cpu
        return {"image/png": b"x"}


# CPU seconds per frame in binary fractions, so sums of them compare exactly.
@pytest.mark.parametrize(("cpu", "redraws"), [(0.0625, 21), (0.375, 6)])
def test_live_redraws_follow_the_samples_within_a_cpu_budget(shown, monkeypatch, cpu, redraws):
    """Redraw with each new sample, but spend at most RENDER_SHARE of one core on drawing,
    counted in CPU time: on a busy machine a draw's wall time is mostly other processes'
    turns, and budgeting wall time left the figure ~9 s behind the text in notebook 02."""
    clock = Clock()
    fake = FakeTime(clock, wall=2.0, cpu=cpu)
    monkeypatch.setattr(watch, "time", fake)
    monkeypatch.setattr(Monitor, "_figure_bundle", lambda self: fake.render())
    mon = Monitor(period_s=0.5, backend=FakeCpu(clock), live=True, clock=clock)
    job = fake_job()
    mon.on_start(job)
    for i in range(41):  # the launcher ticks every 0.25 s: 10 s, a sample every 0.5 s
        clock.t = 0.25 * i
        mon.on_tick(job)
    # 1/16 s of CPU a frame: a frame per sample (every 0.5 s > 0.0625 / RENDER_SHARE);
    # 0.375 s: one frame per 2 s (>= 0.375 / RENDER_SHARE = 1.875 s, on the next sample).
    # The 2 s of wall time per draw does not count.
    assert watch.RENDER_SHARE == 0.2 and mon.redraws == redraws
    mon.on_end(job, SimpleNamespace(status="ok"))


def test_a_live_frame_moves_the_lines_of_one_figure_and_matches_a_fresh_one(shown, monkeypatch):
    """Building and laying out a figure cost ~3x drawing one, and drawing it ~3x redrawing
    only what moved: live frames reuse one figure, whose axes grow in steps, and show what
    a figure drawn afresh shows."""
    monkeypatch.setattr(watch, "RENDER_SHARE", 1e9)  # no CPU budget: a frame per sample
    clock = Clock()
    backend = FakeCpu(clock)
    mon = Monitor(period_s=0.5, backend=backend, live=True, redraw_s=0.0, clock=clock)
    job = fake_job()
    mon.on_start(job)
    figures = []
    for i in range(6):
        clock.t = 0.5 * i
        backend.values = {"cpu_pct": 10.0 * i, "rss_gib": 0.1 * i}
        job.heartbeats[0] = {"pid": 1, "step": i, "total": 5, "time": 1e9}
        mon.on_tick(job)
        figures.append(mon._plot.fig)
    assert mon.redraws == 6
    assert len({id(f) for f in figures}) == 1  # one figure, its lines moved
    fresh = mon.figure()
    for live_ax, fresh_ax in zip(mon._plot.fig.axes, fresh.axes, strict=True):
        assert [list(ln.get_xdata()) for ln in live_ax.lines] == [
            list(ln.get_xdata()) for ln in fresh_ax.lines]  # fmt: skip
        assert [list(ln.get_ydata()) for ln in live_ax.lines] == [
            list(ln.get_ydata()) for ln in fresh_ax.lines]  # fmt: skip
        # The live axes hold everything the fitted ones do (and room to grow).
        (lo, hi), (live_lo, live_hi) = fresh_ax.get_xlim(), live_ax.get_xlim()
        assert live_lo <= lo and hi <= live_hi
        assert fresh_ax.get_ylim()[1] <= live_ax.get_ylim()[1]
    assert mon._plot.fig._suptitle.get_text() == fresh._suptitle.get_text()
    assert "step 5" in fresh._suptitle.get_text()
    # Most frames redrew only what moved, and such a frame is the frame a full draw makes.
    plot = mon._plot
    assert plot.full_draws < mon.redraws
    moved_only = plot.png()
    plot._background_key = None  # forget the saved background: draw everything again
    assert plot.png() == moved_only and plot.full_draws >= 2
    mon.on_end(job, SimpleNamespace(status="ok"))
    assert png_ok(shown.handles[0].bundles[-1])


@pytest.mark.slow
def test_the_data_parallel_ladder_reports_steps_over_the_whole_job(shown):
    """dp_train runs its strategies one after another in one job: the monitor's step count
    runs over all of them, and each strategy is a named part."""
    from labkit.workers import dp_train

    mon = Monitor(period_s=0.2, live=False)
    cfg = {"strategies": ["naive", "ddp"], "mesh": [2], "global_batch": 4,
           "model": {"seq_len": 16, "n_layer": 1, "n_head": 2, "d_model": 32},
           "train": {"steps": 2}}  # fmt: skip
    res = dp_train.run(dp_train.DPTrainConfig(**cfg), nproc=2, device="cpu", observers=[mon], stream=False)
    assert res.status == "ok"
    for rank in (0, 1):
        assert [e.step for e in mon.steps if e.rank == rank][-1] == 4
    assert mon.summary().last_step == {0: 4, 1: 4}
    assert [p.part for p in mon.parts] == ["naive (1/2)", "ddp (2/2)"]
    assert "step 4/4" in shown.figures()[0]["text/plain"]


def test_late_launcher_ticks_still_get_a_sample_per_period(shown):
    """The launcher ticks every 0.25 s or a little later on a busy machine. Samples fall due
    on a grid, so a tick that comes late does not push every later sample back."""
    clock = Clock()
    mon = Monitor(period_s=0.5, backend=FakeCpu(clock), live=False, clock=clock)
    job = fake_job()
    mon.on_start(job)
    for i in range(33):  # a tick every 0.375 s (binary fractions: exact sums), for 12 s
        clock.t = 0.375 * i
        mon.on_tick(job)
    # 12 s / 0.5 s + the first: 25. From the last sample, a sample every 0.75 s: 17.
    assert len(mon.samples) == 25
    mon.on_end(job, SimpleNamespace(status="ok"))
