"""Test-session set-up shared by every test file.

* Notebooks and jobs run at smoke size unless the caller chose another.
* Nothing reaches the network (``LABKIT_OFFLINE=1``).
* The launcher's job registry lives in a throw-away folder, so tests never touch a
  learner's real registry.
* At the end, any torchrun agent or worker started by this session and still alive is a
  failure: a launched job must never outlive its test (the promise the course makes for
  notebook cells).
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid

import psutil
import pytest

os.environ.setdefault("LABKIT_SIZE", "smoke")
# No test reaches the network: notebook 06 would otherwise try to download public GPU traces
# (labkit.recordings.public); a copy named by LABKIT_GPU_TRACES is still read.
os.environ.setdefault("LABKIT_OFFLINE", "1")
if "LABKIT_CAPSTONE_JOB" not in os.environ:  # notebook 07: the same job every run, this tier's
    from labkit.course import capstone  # (a loader, a straggler and a sampler fault)

    os.environ["LABKIT_CAPSTONE_JOB"] = capstone.example_code()
os.environ.setdefault("LABKIT_HOME", tempfile.mkdtemp(prefix="labkit-test-home-"))
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Each pytest-xdist worker gets its own home (they inherit the controller's): a notebook's
    # solution and its learner copy may run at once in two workers, and both write the
    # exercise files a worker-run check imports (the stub once overwrote the solution there).
    os.environ["LABKIT_HOME"] = os.path.join(os.environ["LABKIT_HOME"],
                                             os.environ["PYTEST_XDIST_WORKER"])  # fmt: skip
    os.makedirs(os.environ["LABKIT_HOME"], exist_ok=True)
# Inherited by every process a test starts: tells our jobs from other sessions' on this host.
os.environ["LABKIT_TEST_SESSION"] = SESSION = uuid.uuid4().hex

_JOB_MARKERS = ("torch.distributed.run", "labkit.jobs.spawn", "labkit.workers.")


def _job_processes() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "environ"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        env = proc.info["environ"] or {}
        if env.get("LABKIT_TEST_SESSION") == SESSION and any(m in cmd for m in _JOB_MARKERS):
            found.append(proc)
    return found


@pytest.fixture(scope="session", autouse=True)
def no_stray_jobs():
    yield
    deadline = time.monotonic() + 5.0  # a job that just ended may take a moment to exit
    while (strays := _job_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for proc in strays:
        proc.kill()
    assert not strays, f"tests left job processes running: {[p.pid for p in strays]}"



@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Tests here, learners' copies included, run without ``LABKIT_EXPECT_SOLVED``, whatever
    ran before them (``solutions/conftest.py`` sets it for the complete notebooks)."""
    from labkit.course.exercises import EXPECT_SOLVED

    os.environ.pop(EXPECT_SOLVED, None)
