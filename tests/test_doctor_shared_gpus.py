"""A shared workshop GPU server: CUDA_VISIBLE_DEVICES mapped to NVML once (hardware.visible_gpus)
and honoured by gpu_info, the NVML sampler and doctor; doctor names the processes that already
hold the GPUs a learner would use. NVML is a test double here (tests/fake_nvml.py); the process
holding a GPU is a real one, so its user and command line come from psutil as on a real server.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import psutil
import pynvml
import pytest
from fake_nvml import FakeGpu, FakeNvml

from labkit import hardware
from labkit.hardware import doctor
from labkit.metrics import BackendUnavailable, NvmlBackend

GIB = 2**30


class SharedNvml(FakeNvml):
    """FakeNvml plus UUID lookup, MIG instances and the graphics process list."""

    def __init__(self, gpus, migs=None, graphics=None, **kw):
        super().__init__(gpus, **kw)
        self.migs = migs or {}  # MIG UUID -> index of its GPU
        self.graphics = graphics or {}  # GPU index -> [(pid, bytes)]

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self._check_init()
        if uuid in self.migs:
            return SimpleNamespace(mig=uuid)
        for g in self.gpus:
            if g.uuid == uuid:
                return g
        raise self.error(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, mig):
        return self.gpus[self.migs[mig.mig]]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        g = self._dev("nvmlDeviceGetGraphicsRunningProcesses", h)
        return [SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in self.graphics.get(g.index, [])]


def three_gpus(**kw) -> SharedNvml:
    gpus = [FakeGpu(uuid=f"GPU-{c * 8}-1111-2222-3333-444444444444") for c in "abc"]
    return SharedNvml(gpus, **kw)


def visible(nv, spec):
    nv.nvmlInit()
    try:
        found, notes = hardware.visible_gpus(nv, spec)
    finally:
        nv.nvmlShutdown()
    return [(g.index, g.mig) for g in found], notes


# -- the one mapping ---------------------------------------------------------------------------


def test_visible_gpus_maps_every_form_of_cuda_visible_devices():
    nv = three_gpus(migs={"MIG-1234-5678": 2})
    assert visible(nv, None) == ([(0, None), (1, None), (2, None)], [])  # unset: all
    assert visible(nv, "") == ([], [])  # empty: no GPU, as in CUDA
    assert visible(nv, "1") == ([(1, None)], [])
    assert visible(nv, "GPU-cccccccc,0") == ([(2, None), (0, None)], [])  # CUDA's order
    assert visible(nv, "bbbbbbbb") == ([(1, None)], [])  # a UUID without "GPU-"
    found, notes = visible(nv, "MIG-1234-5678")
    assert found == [(2, "MIG-1234-5678")] and "whole GPU" in notes[0]
    found, notes = visible(nv, "0,5,1")  # CUDA stops at the first entry naming no GPU
    assert found == [(0, None)] and "no such GPU" in notes[0]
    assert nv.inits == nv.shutdowns


def test_visible_gpus_reads_the_environment(monkeypatch):
    nv = three_gpus()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    nv.nvmlInit()
    assert [g.index for g in hardware.visible_gpus(nv)[0]] == [2]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert [g.index for g in hardware.visible_gpus(nv)[0]] == [0, 1, 2]


def test_a_mig_instance_nvml_cannot_place_is_not_guessed():
    nv = FakeNvml([FakeGpu()])  # no nvmlDeviceGetHandleByUUID: an old driver's bindings
    nv.nvmlInit()
    found, notes = hardware.visible_gpus(nv, "MIG-9999")
    assert found == [] and "MIG" in notes[0] and "not used" in notes[0]


def test_gpu_info_through_nvml_lists_only_the_visible_gpus(monkeypatch):
    no_cuda = SimpleNamespace(is_available=lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert [g.index for g in hardware.gpu_info(cuda=no_cuda, nvml=three_gpus())] == [2, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert hardware.gpu_info(cuda=no_cuda, nvml=three_gpus()) == []


def test_the_sampler_uses_the_same_mapping(monkeypatch):
    nv = three_gpus(migs={"MIG-aa": 1})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-aa")
    with NvmlBackend(nvml=nv) as backend:
        assert [g["nvml_index"] for g in backend.info["gpus"]] == [1]
        assert "whole GPU" in backend.status["devices"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(BackendUnavailable, match="no GPU selected"):
        NvmlBackend(nvml=nv).open()
    assert nv.inits == nv.shutdowns


# -- doctor names who holds the GPUs -----------------------------------------------------------


@pytest.fixture
def other_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "train.py"])
    yield proc
    proc.kill()
    proc.wait()


def probe_for(nv):
    return doctor.Probe(cuda=SimpleNamespace(is_available=lambda: False), nvml=nv)


def test_doctor_warns_naming_the_process_on_a_gpu_it_would_use(monkeypatch, other_process):
    nv = three_gpus(graphics={0: [(os.getpid(), GIB)]})  # this process itself does not count
    nv.gpus[1].processes = [(other_process.pid, int(30.2 * GIB))]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    check = doctor.check_gpu_sharing(probe_for(nv))
    assert check.verdict == "warning", check
    user = psutil.Process(other_process.pid).username()
    python = os.path.basename(sys.executable)
    assert (f"GPU 1 (NVIDIA H200): pid {other_process.pid} ({user}, {python} -c import time; "
            "time.sleep(60) train.py) holds 30.2 GiB") in check.detail  # fmt: skip
    assert str(os.getpid()) not in check.detail
    assert "CUDA_VISIBLE_DEVICES" in check.fix and "free now: 0, 2" in check.fix
    assert check.data["gpus"][0]["processes"][0]["user"] == user
    assert nv.inits == nv.shutdowns


def test_doctor_is_quiet_when_its_gpu_is_free(monkeypatch, other_process):
    nv = three_gpus()
    nv.gpus[1].processes = [(other_process.pid, 4 * GIB)]  # someone else's GPU, not ours
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    check = doctor.check_gpu_sharing(probe_for(nv))
    assert check.verdict == "ok" and "no other process holds GPU 2" in check.detail


def test_a_process_psutil_cannot_see_is_said_so_not_named(monkeypatch):
    nv = three_gpus()
    nv.gpus[0].processes = [(2**22 + 7, None)]  # a host PID seen from a container
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    check = doctor.check_gpu_sharing(probe_for(nv))
    assert check.verdict == "warning"
    assert "not visible from here" in check.detail and "GPU memory N/A" in check.detail


def test_every_gpu_busy_and_none_selected(monkeypatch, other_process):
    nv = three_gpus()
    for g in nv.gpus:
        g.processes = [(other_process.pid, GIB)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    busy = doctor.check_gpu_sharing(probe_for(nv))
    assert busy.verdict == "warning" and "every GPU" in busy.fix
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    none = doctor.check_gpu_sharing(probe_for(nv))
    assert none.verdict == "info" and "selects no GPU" in none.detail


def test_without_nvml_doctor_claims_nothing(monkeypatch):
    nv = FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    check = doctor.check_gpu_sharing(probe_for(nv))
    assert check.verdict == "info" and check.detail.startswith("N/A")
    assert "GPU 0" not in check.detail and "holds" not in check.detail
    assert "GPU sharing" in doctor.ITEMS
