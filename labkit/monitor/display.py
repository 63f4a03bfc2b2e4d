"""Live or headless, and how the monitor shows things under the cell.

Apart from the Monitor (:mod:`labkit.monitor.watch`) because it is about the notebook, not
the metrics: whether anyone is watching (:func:`live_default`: ``LABKIT_LIVE_PLOTS``, else a
Jupyter kernel that no headless executor started), the one function that displays a MIME
bundle (:func:`show_bundle`), and the watch on ``clear_output()`` that takes a live figure away
(:class:`ClearWatch`). The Monitor imports these by name, so tests replace them where it
looks them up: ``labkit.monitor.watch.show_bundle``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

LIVE_ENV = "LABKIT_LIVE_PLOTS"  # "1": live plots, "0": headless, "auto" (default): guess
# Processes that run notebooks with nobody watching; the kernel's parent tells (see
# labkit.monitor's docstring).
HEADLESS_EXECUTORS = ("papermill", "pytest", "nbval", "nbconvert", "nbclient", "jupyter-execute")

Bundle = dict[str, Any]  # a MIME bundle: {"image/png": bytes, "text/plain": str, ...}


def _in_kernel() -> bool:
    """True inside a Jupyter kernel (not a terminal IPython, not plain Python)."""
    if "IPython" not in sys.modules:  # never imported: certainly not in IPython
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _headless_executor() -> str | None:
    """The headless notebook runner that started this kernel, if one did.

    Only the direct parent counts (and its parent when that is a shell wrapper): a JupyterLab
    server started *from* a test still serves a live browser, and must get live plots.
    """
    import psutil

    try:
        proc = psutil.Process().parent()
        for _ in range(2):
            if proc is None:
                return None
            # The program: the executable, its script or `-m` module (later arguments may
            # be paths such as /tmp/pytest-of-.../ that say nothing about the runner).
            program = [os.path.basename(a) for a in proc.cmdline()[:3]]
            for name in HEADLESS_EXECUTORS:
                if any(name in word for word in program):
                    return name
            # A pytest-xdist worker is `python -c <execnet bootstrap>`; it sets
            # PYTEST_XDIST_WORKER after it starts, so only its children's environment has it.
            if (proc.name().startswith("python") and "-c" in proc.cmdline()[1:3]
                    and "PYTEST_XDIST_WORKER" in os.environ):  # fmt: skip
                return "pytest-xdist"
            if proc.name() not in ("sh", "bash", "dash", "zsh"):
                return None
            proc = proc.parent()
    except psutil.Error:
        return None
    return None


def live_default() -> tuple[bool, str]:
    """(live?, why): whether a Monitor redraws under the cell while it runs.

    ``LABKIT_LIVE_PLOTS=1`` or ``0`` decides; unset or ``auto``: live in a Jupyter kernel that
    no headless executor started (see ``HEADLESS_EXECUTORS``), headless everywhere else.
    """
    value = os.environ.get(LIVE_ENV, "auto").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True, f"{LIVE_ENV}={value}"
    if value in ("0", "false", "no", "off"):
        return False, f"{LIVE_ENV}={value}"
    if value not in ("", "auto"):
        raise ValueError(f"{LIVE_ENV}={value!r}: use 1 (live plots), 0 (headless) or auto")
    if not _in_kernel():
        return False, "not in a Jupyter kernel"
    runner = _headless_executor()
    if runner:
        return False, f"kernel started by {runner} (headless)"
    return True, "Jupyter kernel"


def show_bundle(bundle: Bundle, *, display_id: bool = False) -> Any:
    """Show a MIME bundle under the cell; returns a display handle if ``display_id``.

    Outside IPython it prints the bundle's text (a script sees the table and the title).
    Tests replace it where the Monitor looks it up (``labkit.monitor.watch.show_bundle``) to
    count what is shown.
    """
    if "IPython" in sys.modules:
        from IPython import get_ipython
        from IPython.display import display

        if get_ipython() is not None:
            return display(bundle, raw=True, display_id=True if display_id else None)
    print(bundle.get("text/plain", ""))
    return None


def display_publisher() -> Any | None:
    """The kernel's display publisher when it takes message hooks (ipykernel's
    ``ZMQDisplayPublisher.register_hook``), else None. Tests replace it in
    ``labkit.monitor.watch``."""
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython

    publisher = getattr(get_ipython(), "display_pub", None)
    return publisher if hasattr(publisher, "register_hook") else None


class ClearWatch:
    """Counts ``IPython.display.clear_output()`` calls while a live figure is shown.

    A clear removes every output of the cell, the live figure with them, and the frontend
    forgets their display ids: JupyterLab's ``OutputArea._clear`` empties its display-id map
    (jupyterlab, packages/outputarea/src/widget.ts), nbclient's ``clear_display_id_mapping``
    does the same. Updates of the live handle then change nothing shown, and the final
    figure, sent as one more update, would never appear. ipykernel passes every message a
    thread publishes, ``clear_output`` included, through the hooks that thread registered
    (ipykernel/zmqshell.py), so the cell's thread (where ``launch.run`` and a ``with`` block
    run) sees its clears here. A clear from another thread is not seen.
    """

    def __init__(self, publisher: Any) -> None:
        self.clears = 0
        self._publisher = publisher
        publisher.register_hook(self)

    def __call__(self, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("header", {}).get("msg_type") == "clear_output":
            self.clears += 1
        return msg  # every message is sent on, unchanged

    def close(self) -> None:
        """Unregister (once; from the thread that registered, as the hooks are per thread)."""
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            publisher.unregister_hook(self)

