"""Test-session set-up shared by every test file.

* Notebooks and jobs run at smoke size unless the caller chose another.
* The launcher's job registry lives in a throw-away folder, so tests never touch a
  learner's real registry.
* At the end, any torchrun agent or worker started during the session and still alive is a
  failure: a launched job must never outlive its test (the promise the course makes for
  notebook cells).
"""

from __future__ import annotations

import os
import tempfile
import time

import psutil
import pytest

os.environ.setdefault("LABKIT_SIZE", "smoke")
os.environ.setdefault("LABKIT_HOME", tempfile.mkdtemp(prefix="labkit-test-home-"))

_JOB_MARKERS = ("torch.distributed.run", "labkit._spawn", "labkit.workers.")


def _job_processes(since: float) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "create_time"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        started = proc.info["create_time"] or 0.0
        if started >= since and any(marker in cmd for marker in _JOB_MARKERS):
            found.append(proc)
    return found


@pytest.fixture(scope="session", autouse=True)
def no_stray_jobs():
    since = time.time() - 1.0
    yield
    deadline = time.monotonic() + 5.0  # a job that just ended may take a moment to exit
    while (strays := _job_processes(since)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for proc in strays:
        proc.kill()
    assert not strays, f"tests left job processes running: {[p.pid for p in strays]}"
