"""A tiny wrapper that ties a child's life, and its whole process tree's, to its parent's.

    python -m labkit.jobs.spawn SIGNAL PARENT_PID [--supervise=GRACE_S] -- COMMAND [ARGS...]

arms the Linux parent-death signal (``prctl(PR_SET_PDEATHSIG)``) and checks that PARENT_PID is
still its parent. Then, by default, it replaces itself with COMMAND (``os.execv``: same PID, no
extra process). The profilers (labkit.profiling.nsight) are started this way so that a notebook
kernel killed with SIGKILL still takes them down: the kernel cannot run any cleanup code, but
its death makes Linux signal the child.

With ``--supervise``, used for torchrun (``labkit.jobs.launch``), it stays as COMMAND's parent and
guarantees that nothing COMMAND started outlives the job, however those processes treat
SIGTERM. The parent-death signal alone does not: it reaches only the agent, torchrun's own
shutdown then ends the ranks, but

- a rank's child process is orphaned to PID 1 when the rank dies, and one that ignores SIGTERM
  (``SIG_IGN`` is inherited across fork and exec) runs on forever;
- the agent's orderly shutdown is torchrun's code, and it is not bounded: seen, 1 kernel restart
  in 4 left the agent (re-parented to PID 1, SIGTERM caught) and both ranks running 35 s on.

So the supervisor makes itself a *child subreaper* (``PR_SET_CHILD_SUBREAPER``): every orphan
in its tree is re-parented to it instead of PID 1, so the whole job stays its descendants. When
the parent dies (SIGNAL arrives) or it gets SIGTERM/SIGINT/SIGHUP, it passes SIGTERM to COMMAND,
gives it GRACE_S seconds; then, and whenever COMMAND has ended, every descendant left (a rank's
forgotten child) gets SIGTERM, and SIGKILL a second later. It exits with COMMAND's status
(killed by a signal: the same signal), so callers see no difference.
Process groups or sessions would not do: torchrun starts every rank in a session of its own,
and a rank's child may start another. A cgroup would, but needs privileges a course machine
rarely grants.

Why a wrapper and not ``Popen(preexec_fn=...)``: ``preexec_fn`` runs Python between fork and
exec, which is unsafe in a threaded parent such as ipykernel (see the note in the ``subprocess``
docs). The supervisor is single-threaded, so its own fork is safe. Two caveats from prctl(2):
- the signal fires when the *thread* that forked the child exits, not the whole process: the
  launcher must start the child from a thread that outlives it (``launch.run`` blocks, so the
  calling thread always does);
- the setting survives ``execve`` (except for set-user-ID binaries), which is what we rely on.

This module imports only the standard library: it starts before torch is imported.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys
import time
from collections.abc import Iterable

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
PR_GET_PDEATHSIG = 2
PR_SET_CHILD_SUBREAPER = 36

# Workers read this to check that their parent, the torchrun agent, is still the one they
# were started by (the same parent-died race as below, one level down).
AGENT_PID_ENV = "LABKIT_AGENT_PID"

SUPERVISE_FLAG = "--supervise="
LEFTOVER_GRACE_S = 1.0  # SIGTERM to SIGKILL for processes left after COMMAND ended
KILL_WAIT_S = 5.0  # how long SIGKILLed processes get to disappear before we give up on them
POLL_S = 0.05


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}, {arg}) failed: {os.strerror(err)}")


def set_parent_death_signal(sig: int) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent thread exits.

    Returns True when armed, False where the platform has no such call (macOS, Windows): there
    the launcher's own cleanup and job registry remain the only safety net.
    """
    if not sys.platform.startswith("linux"):
        return False
    _prctl(PR_SET_PDEATHSIG, int(sig))
    return True


def get_parent_death_signal() -> int:
    """The armed parent-death signal number, 0 if none (Linux only; 0 elsewhere)."""
    if not sys.platform.startswith("linux"):
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    value = ctypes.c_int(0)
    libc.prctl(PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0)
    return value.value


# --- the supervisor ------------------------------------------------------------------------


def descendants(root: int) -> list[int]:
    """Live (not zombie) descendants of ``root``, from /proc; parents before children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after
        # the last ")".
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        if state not in ("Z", "X"):
            children.setdefault(int(ppid), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


class _Supervisor:
    """Runs COMMAND as a child and ends everything under it; see the module docstring."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.stop_asked: float | None = None  # time.monotonic() of the first stop request
        self.child = 0
        self.status: int | None = None  # COMMAND's wait status once it ended

    def on_signal(self, signum: int, frame: object) -> None:
        # Only note it: the loop in run() acts (a handler may run before the fork).
        if self.stop_asked is None:
            self.stop_asked = time.monotonic()

    def reap(self) -> bool:
        """Collect every exited child (orphans adopted by us included); False once we have no
        child left at all."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return False
            if pid == 0:
                return True
            if pid == self.child:
                self.status = status

    def run(self, command: list[str], death_sig: int) -> int:
        """Run COMMAND to its end (or to a stop request plus the grace), then end whatever is
        left under us; return COMMAND's wait status (-1: it never ended by itself)."""
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self.on_signal)
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        self.child = _start(command, death_sig)
        forwarded = False
        while self.status is None:
            if self.stop_asked is not None:
                if not forwarded:  # torchrun stops its ranks in order on SIGTERM
                    _signal_all([self.child], signal.SIGTERM)
                    forwarded = True
                if time.monotonic() - self.stop_asked > self.grace_s:
                    break
            self.reap()
            time.sleep(POLL_S)
        self.end_leftovers()
        return self.status if self.status is not None else -1

    def end_leftovers(self) -> None:
        """End every descendant still alive: SIGTERM, then SIGKILL after ``LEFTOVER_GRACE_S``,
        until no child of ours is left. Orphans land on us meanwhile, so the tree is read
        again each time."""
        me = os.getpid()
        if left := descendants(me):
            _signal_all(left, signal.SIGTERM)
            deadline = time.monotonic() + LEFTOVER_GRACE_S
            while time.monotonic() < deadline and descendants(me):
                self.reap()
                time.sleep(POLL_S)
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline:
            _signal_all(descendants(me), signal.SIGKILL)
            if not self.reap():
                return
            time.sleep(POLL_S)


def _start(command: list[str], death_sig: int) -> int:
    """Fork and exec COMMAND with its own parent-death signal (it dies with us, should we be
    SIGKILLed); return its PID."""
    me = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    try:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        set_parent_death_signal(death_sig)
        if os.getppid() == me:
            os.environ[AGENT_PID_ENV] = str(os.getpid())  # the agent, for its workers' check
            os.execv(command[0], command)
    except OSError as e:
        print(f"labkit.jobs.spawn: cannot run {command[0]}: {e}", file=sys.stderr)
    finally:
        os._exit(127)
    raise AssertionError("unreachable")


def _exit_like(status: int) -> None:
    """Exit as COMMAND did: with its exit code, or killed by the same signal."""
    if status == -1:  # never collected: we were told to stop and ended it
        os._exit(128 + signal.SIGTERM)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP cannot be handled
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal whose default is not to end the process
    os._exit(os.waitstatus_to_exitcode(status))


def main(argv: list[str]) -> None:
    usage = ("usage: python -m labkit.jobs.spawn SIGNAL PARENT_PID [--supervise=GRACE_S] -- "
             "COMMAND [ARGS...]")  # fmt: skip
    grace_s = None
    if len(argv) > 2 and argv[2].startswith(SUPERVISE_FLAG):
        grace_s = float(argv[2][len(SUPERVISE_FLAG) :])
        argv = argv[:2] + argv[3:]
    if len(argv) < 4 or argv[2] != "--":
        sys.exit(usage)
    sig = signal.Signals[argv[0]] if not argv[0].isdigit() else signal.Signals(int(argv[0]))
    parent_pid, command = int(argv[1]), argv[3:]
    set_parent_death_signal(sig)
    # Race: if the parent died before prctl above, no signal will ever come, and we have
    # already been re-parented (to PID 1 or a subreaper). Checking after arming closes it.
    if os.getppid() != parent_pid:
        sys.exit(f"labkit.jobs.spawn: parent {parent_pid} exited before the job started")
    if grace_s is None or not sys.platform.startswith("linux"):
        os.environ[AGENT_PID_ENV] = str(os.getpid())  # exec keeps our PID: this *is* the agent
        os.execv(command[0], command)
    _exit_like(_Supervisor(grace_s).run(command, sig))


if __name__ == "__main__":
    main(sys.argv[1:])
