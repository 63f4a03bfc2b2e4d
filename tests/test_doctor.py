"""labkit.hardware.doctor: truthful verdicts on this machine, and the right fix when something is off.

One real all-reduce launch (the slow test); every other test skips the job or fakes the launcher,
the GPU or NVML. Fake numbers stay inside these tests.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest
import torch
from fake_nvml import FakeGpu, FakeNvml

from labkit import hardware
from labkit.hardware import doctor
from labkit.hardware.doctor import gpu as doctor_gpu
from labkit.hardware.doctor import host as doctor_host
from labkit.jobs import launch
from labkit.workers.allreduce import AllReduceConfig

ROOT = Path(__file__).resolve().parent.parent


def _report(**kw) -> doctor.Report:
    return doctor.run_checks(allreduce=False, **kw)


# --- the real machine ---------------------------------------------------------------------


@pytest.mark.slow
def test_cli_json_on_this_machine_is_truthful_and_passes(capsys):
    """The whole doctor, real all-reduce included, as a script would run it."""
    code = doctor.main(["--json"])
    out = capsys.readouterr().out
    report = json.loads(out)  # stdout is JSON and nothing else
    checks = {c["name"]: c for c in report["checks"]}
    assert [c["name"] for c in report["checks"]] == list(doctor.ITEMS)
    assert all(c["verdict"] in doctor.VERDICTS for c in checks.values())
    assert code == report["exit_code"] == 0 and report["ok"] is True, out

    ar = checks["all-reduce"]
    assert ar["verdict"] == "ok", ar
    assert ar["data"]["busbw_GBps"] > 0 and ar["data"]["measured"] is True
    assert ar["data"]["nproc"] == 2 and ar["data"]["message_bytes"] == 4 * 2**18
    assert re.search(r"busbw [\d.]+ GB/s measured", ar["detail"])

    if not torch.cuda.is_available():  # the CPU tier, as on CI: nothing here is a failure
        assert ar["data"]["backend"] == "gloo"
        assert checks["GPUs"]["data"]["tier"] == "cpu"
        for name in ("CUDA runtime", "cuDNN", "NCCL", "interconnect"):
            assert checks[name]["verdict"] == "info"
            assert "not applicable" in checks[name]["detail"]
        if hardware.nvml_status().ok is False and not checks["GPUs"]["data"]["gpus"]:
            assert checks["NVIDIA driver"]["verdict"] == "info"
            assert "CPU tier" in checks["NVIDIA driver"]["detail"]
            assert checks["NVML"]["verdict"] in ("info", "warning")
    assert checks["Python"]["verdict"] == "ok"
    assert checks["JupyterLab"]["verdict"] == "ok"
    assert checks["widgets extension"]["verdict"] == "ok"
    assert checks["ipywidgets"]["verdict"] == "ok"


def test_report_renders_as_text_and_html_without_the_job():
    report = _report()
    assert report.exit_code == 0 and report.ok
    assert report["all-reduce"].verdict == "info" and "skipped" in report["all-reduce"].detail
    text = str(report)
    for name in doctor.ITEMS:
        assert re.search(rf"^ [✓i!✗]  {re.escape(name)} ", text, re.M), name
    assert text.splitlines()[-1].endswith("ready for the course")
    plain = report.format(ascii_only=True)
    assert plain.isascii() and " +  Python " in plain
    page = report._repr_html_()
    assert page.count("<tr class='labkit-doctor-") == len(doctor.ITEMS)
    assert report.to_dict()["counts"]["fail"] == 0


def test_pins_in_the_code_match_pyproject():
    text = (ROOT / "pyproject.toml").read_text()
    assert f'"torch>={".".join(map(str, doctor.MIN_TORCH))}"' in text
    assert f'requires-python = ">={".".join(map(str, doctor.MIN_PYTHON))}"' in text
    assert f'"jupyterlab>={".".join(map(str, doctor.TESTED_JUPYTERLAB))}"' in text
    assert doctor.tested_pin("torch") == re.search(
        r"^torch==(\S+)", (ROOT / "requirements.txt").read_text(), re.M
    ).group(1)


# --- failures give exit code 1 and a fix ----------------------------------------------------


def test_a_check_that_raises_fails_alone_with_a_fix(monkeypatch, capsys):
    def broken(probe):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(doctor, "check_memory", broken)
    report = _report()
    mem = report["memory"]
    assert mem.verdict == "fail" and "RuntimeError: boom" in mem.detail
    assert "second line" not in mem.detail and mem.fix
    assert report.exit_code == 1
    assert [c.name for c in report.checks] == list(doctor.ITEMS)  # the others still ran
    assert report["Python"].verdict == "ok"

    assert doctor.main(["--no-allreduce"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^ ✗  memory ", out, re.M) and "fix: " in out and "not ready" in out


def test_python_too_old_fails(monkeypatch):
    monkeypatch.setattr(doctor_host, "MIN_PYTHON", (99, 0))  # where check_python reads it
    check = doctor.check_python(doctor.Probe())
    assert check.verdict == "fail" and "99.0" in check.fix


def test_torch_versions_against_the_pin(monkeypatch, tmp_path):
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("numpy==2.0\ntorch==2.13.0  # tested\n")
    probe = doctor.Probe()
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu128")
    assert doctor.check_torch(probe, requirements=reqs).verdict == "ok"
    monkeypatch.setattr(torch, "__version__", "2.12.1")
    newer = doctor.check_torch(probe, requirements=reqs)
    assert newer.verdict == "warning" and "2.13.0" in newer.detail and newer.fix
    monkeypatch.setattr(torch, "__version__", "2.1.0+cu118")
    old = doctor.check_torch(probe, requirements=reqs)
    assert old.verdict == "fail" and "torch==2.13.0" in old.fix
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    unpinned = doctor.check_torch(probe, requirements=tmp_path / "missing.txt")
    assert unpinned.verdict == "ok" and "no requirements.txt" in unpinned.detail


def _job_result(tmp_path, ranks=None):
    return launch.JobResult(
        module="labkit.workers.allreduce", job_id="allreduce-test", nproc=2, backend="gloo",
        device="cpu", ranks=ranks or [{}, {}], wall_s=1.0, log_dir=tmp_path, status="failed",
        returncode=1,
    )  # fmt: skip


def test_allreduce_failure_is_a_fail_with_the_error_and_a_fix(monkeypatch, tmp_path):
    calls = []

    def failing_run(module, **kw):
        calls.append((module, kw))
        raise launch.JobFailed(
            "labkit.workers.allreduce failed on rank 1: RuntimeError: gloo cannot connect\n"
            "  Traceback ...",
            result=_job_result(tmp_path),
            rank=1,
        )

    monkeypatch.setattr(doctor_host.launch, "run", failing_run)
    report = doctor.run_checks(allreduce=True)
    check = report["all-reduce"]
    assert check.verdict == "fail" and report.exit_code == 1
    assert "rank 1: RuntimeError: gloo cannot connect" in check.detail
    assert "Traceback" not in check.detail
    assert "labkit cleanup" in check.fix and str(tmp_path) in check.fix
    ((module, kw),) = calls
    assert kw["nproc"] == 2 and kw["stream"] is False and "config" not in kw
    assert module == AllReduceConfig(numel=2**18, repeats=doctor.ALLREDUCE_REPEATS, probe=False,
                                     wire=False)  # connect and agree: no link probe, no wire count
    if not torch.cuda.is_available():
        assert kw["device"] == "cpu"

    def hanging_run(module, **kw):
        raise launch.JobTimeout(
            "allreduce timed out; likely hung: rank 0",
            result=_job_result(tmp_path),
            ranks=[0],
            heartbeats={},
        )

    monkeypatch.setattr(doctor_host.launch, "run", hanging_run)
    check = doctor.check_allreduce(doctor.Probe(timeout_s=7))
    assert check.verdict == "fail" and "did not finish in 7 s" in check.detail
    assert "likely hung: rank 0" in check.detail and str(tmp_path) in check.fix

    def no_port(module, **kw):  # the machine, not the job: the launcher says what to change
        raise launch.LaunchError("no free local network port (Address already in use): ...")

    monkeypatch.setattr(doctor_host.launch, "run", no_port)
    check = doctor.check_allreduce(doctor.Probe())
    assert check.verdict == "fail" and "could not start: no free local network port" in check.detail
    assert "surprised" not in check.detail + check.fix


def test_allreduce_with_a_wrong_sum_fails(monkeypatch, tmp_path):
    ranks = [{"value": 3.0, "expected": 3.0}, {"value": 2.0, "expected": 3.0}]
    monkeypatch.setattr(doctor_host.launch, "run", lambda module, **kw: _job_result(tmp_path, ranks))
    check = doctor.check_allreduce(doctor.Probe())
    assert check.verdict == "fail" and "rank(s) [1]" in check.detail


def test_low_memory_disk_and_cores_warn_or_fail(monkeypatch):
    probe = doctor.Probe()
    monkeypatch.setattr(
        doctor_host.psutil, "virtual_memory", lambda: SimpleNamespace(total=8 * 2**30, available=2**30)
    )
    assert doctor.check_memory(probe).verdict == "warning"

    def disk(free):
        return lambda path: SimpleNamespace(total=100 * 2**30, used=0, free=free)

    monkeypatch.setattr(doctor_host.shutil, "disk_usage", disk(2**30))
    assert doctor.check_disk(probe).verdict == "warning"
    monkeypatch.setattr(doctor_host.shutil, "disk_usage", disk(10 * 2**20))
    full = doctor.check_disk(probe)
    assert full.verdict == "fail" and "LABKIT_HOME" in full.fix

    one = hardware.CpuInfo("test CPU", "x86_64", 1, 1, 1, ())
    monkeypatch.setattr(doctor_host.hardware, "cpu_info", lambda: one)
    cores = doctor.check_cpu(probe)
    assert cores.verdict == "warning" and "2 or more" in cores.fix


def _as_nobody(fn):
    """``fn()`` in a forked child that runs as user ``nobody``; its result, through a pipe.

    Root writes whatever the mode bits say, so a test run as root (a container) drops to an
    ordinary user to meet a folder without write permission as a learner does.
    """
    import pickle
    import pwd

    nobody = pwd.getpwnam("nobody")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read_end)
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            with os.fdopen(write_end, "wb") as out:
                pickle.dump(fn(), out)
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as inp:
        data = inp.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data, "the child as nobody failed"
    return pickle.loads(data)


def _unwritable_home(case: str, tmp_path: Path) -> tuple[Path, Path]:
    """(LABKIT_HOME, the folder doctor must name) for a home labkit cannot write in."""
    if case == "a file in the way":  # fails for root too: no one creates a file in a file
        blocker = tmp_path / "cache"
        blocker.write_text("a regular file where a folder should be\n")
        return blocker / "labkit", blocker
    if case == "a file where the runs folder goes":  # the home itself is fine
        home = tmp_path / "labkit"
        home.mkdir()
        (home / "runs").write_text("not a folder\n")
        return home, home / "runs"
    if case == "a folder without write permission":
        # Traversable by anyone (pytest's tmp_path is not), writable by no one but root.
        top = Path(tempfile.mkdtemp(prefix="labkit-doctor-"))
        top.chmod(0o755)
        home = top / "labkit"
        home.mkdir(mode=0o555)
        return home, home
    # Not yet created, under a folder where the kernel refuses new files even to root
    # (sysfs: EACCES; EROFS where a container mounts it read-only).
    if not Path("/sys/kernel").is_dir():
        pytest.skip("no sysfs on this system")
    return Path("/sys/labkit-doctor-test"), Path("/sys")


def _check_disk_as_a_learner() -> doctor.Check:
    """check_disk as this user, or, for root, as the ordinary user ``nobody``."""
    if os.geteuid() != 0:
        return doctor.check_disk(doctor.Probe())
    return _as_nobody(lambda: doctor.check_disk(doctor.Probe()))


@pytest.mark.parametrize(
    "case",
    ["a file in the way", "a file where the runs folder goes", "a folder without write permission",
     "a read-only filesystem"],
)  # fmt: skip
def test_disk_fails_when_the_labkit_home_cannot_be_written(monkeypatch, tmp_path, case):
    home, named = _unwritable_home(case, tmp_path)
    monkeypatch.setenv("LABKIT_HOME", str(home))
    if case == "a folder without write permission":
        try:
            named.chmod(0o777)  # the control: the same folder, writable, passes
            assert _check_disk_as_a_learner().data["unwritable"] == []
            named.chmod(0o555)
            check = _check_disk_as_a_learner()
        finally:
            shutil.rmtree(named.parent)
    else:
        check = doctor.check_disk(doctor.Probe())
        assert doctor.run_checks(allreduce=False).exit_code == 1
    assert check.verdict == "fail", check
    assert f"cannot create a file in {named}" in check.detail and str(home) in check.detail
    remedy = f"move the file {named}" if "a file" in case else f"make {named} writable"
    assert remedy in check.fix and "set LABKIT_HOME to" in check.fix
    assert check.data["unwritable"][0]["path"] == str(named)


def test_disk_writes_and_removes_a_file_in_the_labkit_home(monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path / "not-yet" / "labkit"))
    check = doctor.check_disk(doctor.Probe())
    assert check.data["unwritable"] == [] and "cannot create" not in check.detail
    assert list(tmp_path.iterdir()) == []  # probed in the nearest existing parent, then removed
    home = tmp_path / "labkit"
    home.mkdir()
    monkeypatch.setenv("LABKIT_HOME", str(home))
    assert doctor.check_disk(doctor.Probe()).data["unwritable"] == []
    assert list(home.iterdir()) == []


def test_widgets_missing_or_mismatched_fail(monkeypatch, tmp_path):
    probe = doctor.Probe()
    monkeypatch.setattr(doctor_host, "_labextension_dirs", lambda: [tmp_path])
    missing = doctor.check_widgets_extension(probe)
    assert missing.verdict == "fail" and "jupyterlab-manager" in missing.detail

    ext = tmp_path / "@jupyter-widgets" / "jupyterlab-manager"
    ext.mkdir(parents=True)
    (ext / "package.json").write_text('{"version": "5.0.99"}')
    assert "5.0.99" in doctor.check_widgets_extension(probe).detail

    versions = {"ipywidgets": "8.1.0", "jupyterlab_widgets": "1.1.0"}
    monkeypatch.setattr(doctor_host, "dist_version", versions.get)
    assert doctor.check_ipywidgets(probe).verdict == "fail"
    monkeypatch.setattr(doctor_host, "dist_version", {}.get)
    assert doctor.check_jupyterlab(probe).verdict == "fail"


def test_check_rejects_unknown_verdicts_and_fixless_failures():
    with pytest.raises(ValueError, match="verdict='bad'"):
        doctor.Check("x", "bad", "detail")
    with pytest.raises(ValueError, match="needs a fix"):
        doctor.Check("x", "fail", "detail")
    with pytest.raises(ValueError, match="nproc=1"):
        doctor.run_checks(nproc=1)
    with pytest.raises(SystemExit):
        doctor.main(["--nproc", "1"])


# --- GPU machines, faked ----------------------------------------------------------------------


class P2PNvml(FakeNvml):
    """FakeNvml plus the topology calls the interconnect check makes."""

    def __init__(self, gpus, *, p2p=0, nvlinks=18, remote=None, **kw):
        super().__init__(gpus, **kw)
        self.p2p, self.nvlinks = p2p, nvlinks
        self.remote = pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH if remote is None else remote

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self._check_init()
        return next(g for g in self.gpus if g.uuid == uuid)

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=f"00000000:{0x18 + h.index:02X}:00.0")

    def nvmlDeviceGetNvLinkState(self, h, link):
        if self.nvlinks == 0:
            raise self.error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.NVML_FEATURE_ENABLED if link < self.nvlinks else 0

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        return self.remote

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        other = self.gpus[1 - h.index]  # direct links join GPU 0 and GPU 1
        bus = self.nvmlDeviceGetPciInfo(other).busId if self.remote == 0 else "0000:ff:00.0"
        return SimpleNamespace(busId=bus)

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        # The C call takes an int (ctypes rejects the tuple nvidia-ml-py's constant is).
        assert type(index) is int and index == 0
        return self.p2p

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return pynvml.NVML_TOPOLOGY_SYSTEM


def _fake_cuda(gpus, *, available=True, arch=("sm_80", "sm_90")):
    def props(i):
        g = gpus[i]
        return SimpleNamespace(name=g.name, total_memory=g.mem_total, major=9, minor=0,
                               uuid=g.uuid.removeprefix("GPU-"))  # fmt: skip

    return SimpleNamespace(
        is_available=lambda: available,
        device_count=lambda: len(gpus) if available else 0,
        get_device_properties=props,
        get_arch_list=lambda: list(arch),
        can_device_access_peer=lambda i, j: True,
    )


def _two_gpus():
    return [FakeGpu(uuid=f"GPU-0000000{i}-1111-2222-3333-444444444444") for i in range(2)]


def test_two_gpus_with_nvswitch_and_direct_nvlink():
    gpus = _two_gpus()
    probe = doctor.Probe(cuda=_fake_cuda(gpus), nvml=P2PNvml(gpus))
    listed = doctor.check_gpus(probe)
    assert listed.verdict == "ok" and listed.data["tier"] == "multi-gpu"
    assert listed.detail.count("NVIDIA H200") == 2
    link = doctor.check_interconnect(probe)
    assert link.verdict == "ok", link
    assert "GPU 0 ↔ GPU 1: P2P ok, NVLink via NVSwitch (18 and 18 links)" in link.detail
    assert "SYS" in link.detail and link.data["pairs"][0]["p2p_read"] is True

    direct = doctor.Probe(cuda=_fake_cuda(gpus), nvml=P2PNvml(gpus, nvlinks=4, remote=0))
    assert "NVLink ×4 (direct)" in doctor.check_interconnect(direct).detail

    nvml = P2PNvml(gpus, p2p=pynvml.NVML_P2P_STATUS_DISABLED_BY_REGKEY, nvlinks=0)
    blocked = doctor.check_interconnect(doctor.Probe(cuda=_fake_cuda(gpus), nvml=nvml))
    assert blocked.verdict == "warning" and "no P2P, no NVLink seen" in blocked.detail
    assert "nvidia-smi topo -m" in blocked.fix
    assert nvml.inits == nvml.shutdowns  # every NVML session was closed


def test_p2p_falls_back_to_torch_when_nvml_cannot_say():
    gpus = _two_gpus()

    class NoP2PStatus(P2PNvml):
        def nvmlDeviceGetP2PStatus(self, a, b, index):
            raise self.error(pynvml.NVML_ERROR_NOT_SUPPORTED)

    cuda = _fake_cuda(gpus)
    cuda.can_device_access_peer = lambda i, j: False
    check = doctor.check_interconnect(doctor.Probe(cuda=cuda, nvml=NoP2PStatus(gpus)))
    assert check.verdict == "warning" and "GPU 0 ↔ GPU 1: no P2P" in check.detail
    assert check.data["pairs"][0]["peer_access"] is False


def test_driver_versions_against_torch_cuda(monkeypatch):
    gpus = _two_gpus()
    probe = doctor.Probe(cuda=_fake_cuda(gpus), nvml=P2PNvml(gpus, cuda=12080))
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    ok = doctor.check_driver(probe)
    assert ok.verdict == "ok" and "570.86.15" in ok.detail and "up to 12.8" in ok.detail
    assert "minor-version compatibility" in ok.detail
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    too_old = doctor.check_driver(probe)
    assert too_old.verdict == "fail" and "CUDA 13.0" in too_old.fix


def test_gpu_that_torch_has_no_kernels_for_fails():
    gpus = _two_gpus()
    probe = doctor.Probe(cuda=_fake_cuda(gpus, arch=("sm_80", "sm_86")), nvml=P2PNvml(gpus))
    check = doctor.check_gpus(probe)
    assert check.verdict == "fail" and "no kernels" in check.detail
    assert "get_arch_list" in check.fix


@pytest.mark.parametrize(
    ("cc", "arch", "ok"),
    [
        ((9, 0), ["sm_80", "sm_90"], True),
        ((8, 6), ["sm_80"], True),  # same major, newer minor: the sm_80 cubin runs
        ((9, 0), ["sm_80"], False),  # a cubin never runs on a newer major version
        ((9, 0), ["sm_80", "compute_80"], True),  # PTX is compiled by the driver
        ((12, 0), ["sm_90a", "sm_100", "sm_120"], True),
        ((10, 0), ["sm_90a", "sm_120"], False),
    ],
)
def test_arch_support_rules(cc, arch, ok):
    assert doctor_gpu._arch_supported(cc, arch) is ok


def test_nvml_errors_on_a_cpu_machine(monkeypatch):
    no_cuda = _fake_cuda([], available=False)
    absent = doctor.Probe(cuda=no_cuda, nvml=FakeNvml(
        init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))  # fmt: skip
    assert doctor.check_driver(absent).verdict == "info"
    assert doctor.check_nvml(absent).verdict == "info"
    assert doctor.check_gpus(absent).verdict == "info"

    unloaded = doctor.Probe(cuda=no_cuda, nvml=FakeNvml(
        init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED))  # fmt: skip
    driver = doctor.check_driver(unloaded)
    assert driver.verdict == "warning" and "modprobe" in driver.fix

    # A CPU-only torch on a machine with GPUs: the CPU tier, with the way out.
    monkeypatch.setattr(torch.version, "cuda", None)
    seen = doctor.Probe(cuda=no_cuda, nvml=FakeNvml([FakeGpu()]))
    build = doctor.check_torch_build(seen)
    assert build.verdict == "warning" and "TORCH_INDEX_URL" in build.fix
    assert doctor.check_gpus(seen).verdict == "warning"
