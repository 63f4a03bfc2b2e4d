"""Restart a Jupyter kernel while it runs a job, many times, and count what survives.

    .venv/bin/python scripts/stress_kernel_restart.py --trials 20 --after 10

Each trial starts a real kernel (``jupyter_client.KernelManager``, the machinery JupyterLab
uses), runs ``launch.run(...)`` of a ~60 s two-rank job in it, restarts the kernel while the
job runs, waits ``--after`` seconds, and counts the job's processes still alive. Rank 0 of the
job starts a child process that inherited ``SIG_IGN`` for SIGTERM (the hardest case: SIGTERM
alone never ends it); ``--ranks-ignore-sigterm`` makes the ranks ignore SIGTERM too.

Survivors are looked for until ``--after`` seconds have passed, or until none is left (then
none can appear any more). Restarts alternate between "now" (``restart_kernel(now=True)``: SIGKILL to the kernel's process
group, what Jupyter does to a busy kernel) and "graceful" (``restart_kernel(now=False)``: a
shutdown request, which a kernel busy in a cell cannot act on, then SIGTERM, then SIGKILL).

A process belongs to a trial's job when its environment carries that trial's
``LABKIT_JOB_DIR`` (every process of a job inherits it, orphans included). Survivors are
killed after they are counted, so one trial never disturbs the next. Prints one line per trial
and a summary ``N of M trials left a process alive after K s``; exits 1 if any did.

tests/test_launch_faults.py imports ``trial`` from this file for a short run in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from labkit.jobs.spec import JOB_DIR_ENV  # torch-free: the kernel is the one to import torch

REPO = Path(__file__).resolve().parents[1]

# The job the kernel runs: ~60 s of heartbeats on each rank; rank 0 first starts a child with
# SIGTERM ignored (set before the fork, restored after: the child inherits SIG_IGN).
WORKER = '''
import os, signal, subprocess, sys, time
from labkit.jobs import runtime

@runtime.entrypoint
def main(ctx):
    child = None
    if ctx.rank == 0:
        before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        signal.signal(signal.SIGTERM, before)
    if os.environ.get("RANKS_IGNORE_SIGTERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx.write_result({"pid": os.getpid(), "child_pid": child.pid if child else None})
    for step in range(600):
        ctx.heartbeat(step=step + 1, total=600)
        time.sleep(0.1)

if __name__ == "__main__":
    main()
'''

CELL = """
import sys
sys.path.insert(0, {folder!r})
from labkit.jobs import launch
launch.run("restart_victim", nproc=2, env={{"RANKS_IGNORE_SIGTERM": "{ignore:d}"}}, timeout_s=90,
           stream=False)
"""


@dataclass
class Trial:
    """What one trial saw: the restart mode and the job's processes alive afterwards."""

    mode: str
    survivors: list[str] = field(default_factory=list)  # "pid name cmdline" of each
    started: bool = True  # False: the job never got going before the restart (not counted)
    gone_after_s: float | None = None  # seconds from the restart to the last process's end

    @property
    def clean(self) -> bool:
        return not self.survivors


def job_processes(home: Path) -> list[psutil.Process]:
    """Live processes of this user carrying a job folder under ``home`` in their environment."""
    prefix = str(home) + os.sep
    found = []
    for p in psutil.process_iter(["environ", "status"]):
        try:
            env = p.info["environ"] or {}
            if env.get(JOB_DIR_ENV, "").startswith(prefix) and p.info["status"] != "zombie":
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def _describe(p: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return f"{p.pid} ppid={p.ppid()} {' '.join(p.cmdline())[:120]}"
    return f"{p.pid} (gone)"


def _wait_for_job(home: Path, timeout_s: float) -> bool:
    """Until both ranks beat and rank 0's SIGTERM-ignoring child exists; False on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for job_dir in (home / "runs").glob("*"):
            beats = list((job_dir / "heartbeat").glob("rank*.json"))
            try:
                child = json.loads((job_dir / "rank0.json").read_text()).get("child_pid")
            except (OSError, ValueError):
                child = None
            if len(beats) == 2 and child:
                return True
        time.sleep(0.2)
    return False


def trial(mode: str, after_s: float, *, ranks_ignore_sigterm: bool = False,
          workdir: Path | None = None) -> Trial:  # fmt: skip
    """Run one kernel-restart trial (``mode``: "now" or "graceful"); kill what survived."""
    from jupyter_client import KernelManager

    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        home = Path(tmp) / "home"
        folder = Path(tmp) / "worker"
        folder.mkdir()
        (folder / "restart_victim.py").write_text(WORKER)
        env = {**os.environ, "LABKIT_HOME": str(home),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}  # fmt: skip
        km = KernelManager(kernel_name="python3")
        km.start_kernel(env=env, cwd=str(REPO))
        kc = km.client()
        result = Trial(mode)
        try:
            kc.start_channels()
            kc.wait_for_ready(timeout=120)
            kc.execute(CELL.format(folder=str(folder), ignore=ranks_ignore_sigterm))
            result.started = _wait_for_job(home, timeout_s=120)
            km.restart_kernel(now=(mode == "now"))
            restarted = time.monotonic()
            # Once the job has no process left, none can appear again: stop looking early.
            while (survivors := job_processes(home)) and time.monotonic() - restarted < after_s:
                time.sleep(0.25)
            result.gone_after_s = None if survivors else time.monotonic() - restarted
            result.survivors = [_describe(p) for p in survivors]
        finally:
            for p in job_processes(home):  # never let one trial's leftovers into the next
                with contextlib.suppress(psutil.Error):
                    p.send_signal(signal.SIGKILL)
            kc.stop_channels()
            km.shutdown_kernel(now=True)
        return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20, help="how many restarts (default 20)")
    p.add_argument("--after", type=float, default=10.0,
                   help="seconds after the restart at which survivors are counted (default 10)")
    p.add_argument("--mode", choices=("both", "now", "graceful"), default="both",
                   help="restart kind; 'both' alternates now/graceful (default)")
    p.add_argument("--ranks-ignore-sigterm", action="store_true",
                   help="the ranks ignore SIGTERM too, not only rank 0's child")
    args = p.parse_args(argv)
    modes = ["now", "graceful"] if args.mode == "both" else [args.mode]
    dirty = counted = 0
    for i in range(args.trials):
        mode = modes[i % len(modes)]
        t0 = time.monotonic()
        res = trial(mode, args.after, ranks_ignore_sigterm=args.ranks_ignore_sigterm)
        verdict = ("job never started (not counted)" if not res.started
                   else f"clean, every process gone {res.gone_after_s:.1f} s after the restart"
                   if res.clean else f"{len(res.survivors)} alive")  # fmt: skip
        print(f"trial {i + 1:2d} ({mode:8s}, {time.monotonic() - t0:4.1f} s): {verdict}", flush=True)
        for line in res.survivors:
            print(f"    {line}", flush=True)
        if res.started:
            counted += 1
            dirty += not res.clean
    print(f"{dirty} of {counted} trials left a process alive {args.after:g} s after the restart")
    return 1 if dirty else 0


if __name__ == "__main__":
    sys.exit(main())
