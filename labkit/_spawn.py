"""A tiny exec wrapper that ties a child's life to its parent's.

    python -m labkit._spawn SIGNAL PARENT_PID -- COMMAND [ARGS...]

arms the Linux parent-death signal (``prctl(PR_SET_PDEATHSIG)``), checks that PARENT_PID is
still its parent, then replaces itself with COMMAND (``os.execv``: same PID, no extra process).
The launcher starts torchrun this way so that a notebook kernel killed with SIGKILL (Jupyter's
"Restart kernel", papermill's dead kernel) still takes its job down: the kernel cannot run any
cleanup code, but the kernel's death makes Linux signal the torchrun agent.

Why a wrapper and not ``Popen(preexec_fn=...)``: ``preexec_fn`` runs Python between fork and
exec, which is unsafe in a threaded parent such as ipykernel (see the note in the ``subprocess``
docs). Two caveats from prctl(2):
- the signal fires when the *thread* that forked the child exits, not the whole process: the
  launcher must start the child from a thread that outlives it (``launch.run`` blocks, so the
  calling thread always does);
- the setting survives ``execve`` (except for set-user-ID binaries), which is what we rely on.

This module imports only the standard library: it starts before torch is imported.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
PR_GET_PDEATHSIG = 2

# Workers read this to check that their parent, the torchrun agent, is still the one they
# were started by (the same parent-died race as below, one level down).
AGENT_PID_ENV = "LABKIT_AGENT_PID"


def set_parent_death_signal(sig: int) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent thread exits.

    Returns True when armed, False where the platform has no such call (macOS, Windows): there
    the launcher's own cleanup and job registry remain the only safety net.
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG, {int(sig)}) failed: {os.strerror(err)}")
    return True


def get_parent_death_signal() -> int:
    """The armed parent-death signal number, 0 if none (Linux only; 0 elsewhere)."""
    if not sys.platform.startswith("linux"):
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    value = ctypes.c_int(0)
    libc.prctl(PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0)
    return value.value


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[2] != "--":
        sys.exit("usage: python -m labkit._spawn SIGNAL PARENT_PID -- COMMAND [ARGS...]")
    sig = signal.Signals[argv[0]] if not argv[0].isdigit() else signal.Signals(int(argv[0]))
    parent_pid, command = int(argv[1]), argv[3:]
    set_parent_death_signal(sig)
    # Race: if the parent died before prctl above, no signal will ever come, and we have
    # already been re-parented (to PID 1 or a subreaper). Checking after arming closes it.
    if os.getppid() != parent_pid:
        sys.exit(f"labkit._spawn: parent {parent_pid} exited before the job started")
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # exec keeps our PID: this *is* the agent
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
