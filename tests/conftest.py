"""Test-session set-up shared by every test file.

* Notebooks and jobs run at smoke size unless the caller chose another.
* The launcher's job registry lives in a throw-away folder, so tests never touch a
  learner's real registry.
* At the end, any torchrun agent this session left behind is a failure: a launched job
  must never outlive its test (the same promise the course makes for notebook cells).
"""

from __future__ import annotations

import os
import tempfile

import psutil
import pytest

os.environ.setdefault("LABKIT_SIZE", "smoke")
os.environ.setdefault("LABKIT_HOME", tempfile.mkdtemp(prefix="labkit-test-home-"))


def _stray_agents() -> list[psutil.Process]:
    me = psutil.Process()
    strays = []
    for proc in psutil.process_iter(["cmdline", "environ"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            env = proc.info["environ"] or {}
        except (psutil.Error, OSError):
            continue
        if "torch.distributed.run" in cmd and env.get("LABKIT_HOME") == os.environ["LABKIT_HOME"]:
            if proc.pid != me.pid:
                strays.append(proc)
    return strays


@pytest.fixture(scope="session", autouse=True)
def no_stray_jobs():
    yield
    strays = _stray_agents()
    for proc in strays:
        proc.kill()
    assert not strays, f"tests left torchrun agents running: {[p.pid for p in strays]}"
