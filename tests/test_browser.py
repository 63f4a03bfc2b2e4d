"""Notebook 00 in a real JupyterLab, driven through a real browser.

nbval and papermill execute notebooks without a front end: they cannot tell whether a widget
renders, whether a figure shows, or whether clicking a quiz answer does anything. This test
starts JupyterLab on a free localhost port, opens notebook 00 in the system Chromium through
Playwright, runs every cell from the "Run" menu as a learner would, and checks what the
learner sees:

- every code cell ran, without an error;
- the live-metrics figure rendered (an image that actually decoded, not a broken icon);
- the quiz rendered as radio buttons, and clicking an answer shows its feedback;
- JupyterLab's news notification stayed off (it would cover the page, and it fetches from
  the internet).

It leaves screenshots in test-artifacts/ (or $LABKIT_ARTIFACTS). The browser is the
distribution's Chromium (scripts/install_browser.sh); nothing is downloaded at test time.
Without Chromium or Playwright the test skips, except in CI (CI=true), where it fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from labkit import quiz

pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = "00_setup_and_first_job.ipynb"
SERVER_START_S = 60  # JupyterLab answers /api/status within a few seconds here
RUN_ALL_S = 180  # notebook 00 launches two ~5 s jobs; generous for a loaded 2-core CI machine
# What the probe of this machine kind ran Chromium with (env/machines/python.md): no sandbox
# (we are root in CI), and none of Chromium's own network traffic, which a closed network
# refuses, many connections at a time.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
# User settings for this JupyterLab only (JUPYTERLAB_SETTINGS_DIR): no news toast (it covers the
# page and needs the network), and every cell kept in the DOM so the test can read all outputs
# (JupyterLab may otherwise drop cells scrolled far out of view).
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
}
INSTALL_HINT = (
    "install the browser with `sudo scripts/install_browser.sh` (Debian's chromium package) or "
    "set LABKIT_CHROMIUM=/path/to/chromium, and Playwright with `pip install -r "
    "requirements.txt`; never `playwright install` (no browser download)"
)


def _unavailable(reason: str) -> None:
    """Skip on a developer's machine; in CI a missing browser is a broken setup, so fail."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason}: {INSTALL_HINT}")
    pytest.skip(f"{reason} ({INSTALL_HINT})")


def find_chromium() -> str | None:
    """$LABKIT_CHROMIUM, else the distribution's chromium or chromium-browser on PATH."""
    candidates = [os.environ.get("LABKIT_CHROMIUM"), shutil.which("chromium"),
                  shutil.which("chromium-browser"), "/usr/bin/chromium"]  # fmt: skip
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def _free_port() -> int:
    # Port 0: the OS picks a free port. Closed again before JupyterLab binds it, so another
    # process could take it in between; JupyterLab would then fail to start and say so.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def artifacts_dir() -> Path:
    path = Path(os.environ.get("LABKIT_ARTIFACTS") or ROOT / "test-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


# --- JupyterLab -------------------------------------------------------------------------------


@dataclass
class Lab:
    url: str  # http://127.0.0.1:<port>
    token: str
    log: Path

    def log_tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def api(self, path: str) -> dict:
        req = urllib.request.Request(
            f"{self.url}{path}", headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())


def _write_settings(folder: Path) -> None:
    for plugin, values in LAB_SETTINGS.items():
        path = folder / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


def _stop(proc: subprocess.Popen) -> None:
    """End JupyterLab and everything it started (kernels, and any job a kernel launched)."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    proc.terminate()  # JupyterLab shuts its kernels down on SIGTERM
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
    _, alive = psutil.wait_procs(tree, timeout=5)
    for p in alive:  # only processes this server started
        with contextlib.suppress(psutil.Error):
            p.kill()


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    """JupyterLab serving a copy of notebook 00, on a free port, with its own settings."""
    root = tmp_path / "notebooks"
    root.mkdir()
    # solutions/ is the source of truth; notebook 00 has no exercise, so it runs as is.
    shutil.copy(ROOT / "solutions" / NOTEBOOK, root / NOTEBOOK)
    _write_settings(tmp_path / "lab-settings")
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ)
    env.update(
        {
            "LABKIT_SIZE": "smoke",
            "LABKIT_LIVE_PLOTS": "1",  # a person is watching: the monitor redraws live
            # Everything JupyterLab would write under ~ goes to this test's folder instead.
            "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "lab-settings"),
            "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "lab-workspaces"),
            "JUPYTER_CONFIG_DIR": str(tmp_path / "jupyter-config"),
            "JUPYTER_RUNTIME_DIR": str(tmp_path / "jupyter-runtime"),
            # The kernel imports this checkout's labkit, installed or not.
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        }
    )
    cmd = [
        sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1",
        f"--port={port}", "--port-retries=0", f"--ServerApp.token={token}",
        f"--ServerApp.root_dir={root}",
    ]  # fmt: skip
    if os.geteuid() == 0:
        cmd.append("--allow-root")  # JupyterLab refuses to run as root without it
    log = tmp_path / "jupyterlab.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, cwd=root)  # fmt: skip
    server = Lab(f"http://127.0.0.1:{port}", token, log)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"JupyterLab exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                server.api("/api/status")
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not answer in {SERVER_START_S} s:\n"
                                f"{server.log_tail()}")  # fmt: skip
                time.sleep(0.25)
        yield server
    finally:
        _stop(proc)


@pytest.fixture
def browser_page():
    """A Chromium page (1400×1000) from the system browser; closed after the test."""
    executable = find_chromium()
    if executable is None:
        _unavailable("no Chromium found (/usr/bin/chromium, chromium-browser, $LABKIT_CHROMIUM)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("Playwright is not installed")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            yield page
        finally:
            browser.close()


# --- what the learner sees ---------------------------------------------------------------------

# True once every code cell shows an execution count ([3]:) and none waits ([*]:) or was
# skipped ([ ]:) and the kernel is idle; also returns early if an error output appeared, since
# "Run All Cells" stops at an error and the remaining cells would never run.
_RUN_FINISHED_JS = """() => {
  const prompts = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]
    .map(p => p.textContent.trim());
  const idle = document.querySelector('.jp-Notebook-ExecutionIndicator[data-status="idle"]');
  const error = document.querySelector('.jp-Notebook [data-mime-type="application/vnd.jupyter.error"]');
  const busy = prompts.some(p => p.includes('*'));
  if (error && !busy && idle) return true;
  return prompts.length > 0 && !busy && !!idle && prompts.every(p => /^\\[\\d+\\]:$/.test(p));
}"""


def _cell_prompts(page) -> list[str]:
    return page.eval_on_selector_all(
        ".jp-Notebook .jp-CodeCell .jp-InputPrompt", "els => els.map(e => e.textContent.trim())"
    )


def wait_for_kernel(page) -> None:
    """Until the status bar says "<kernel name> | Idle". The toolbar's execution indicator
    reads "idle" already while the page still says "No Kernel | Initializing", and a "Run All"
    clicked then is lost."""
    page.locator(".jp-StatusBar-TextItem").filter(
        has_text=re.compile(r"^(?!No Kernel).+ \| Idle$")
    ).first.wait_for(timeout=60_000)


def run_all_cells(page) -> None:
    """Run > Run All Cells, from the menu bar (matched exactly: the same menu also holds
    'Restart Kernel and Run All Cells...'), then wait until every cell has run."""
    page.locator("#jp-MainMenu .lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
    page.locator(
        ".lm-Menu-item .lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")
    ).click()
    # JupyterLab marks queued cells [*] at once; wait for that so "idle" below is not the
    # kernel's state from before the click.
    page.wait_for_function(
        "() => [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]"
        ".some(p => /\\[(\\*|\\d+)\\]/.test(p.textContent))",
        timeout=30_000,
    )
    page.wait_for_function(_RUN_FINISHED_JS, timeout=RUN_ALL_S * 1000, polling=500)


def assert_every_cell_ran(page) -> None:
    errors = page.locator('.jp-Notebook [data-mime-type="application/vnd.jupyter.error"]')
    assert errors.count() == 0, f"a cell raised:\n{errors.first.inner_text()[:2000]}"
    prompts = _cell_prompts(page)
    not_run = [i for i, p in enumerate(prompts) if not re.fullmatch(r"\[\d+\]:", p)]
    assert prompts and not not_run, f"code cells not run: {not_run} (prompts {prompts})"


def assert_live_metrics_figure(page) -> None:
    """The live-metrics figure rendered: a PNG output image that decoded (naturalWidth > 0).

    labkit.monitor's summary table (class ``labkit-monitor-summary``) is an output of the same
    cell as the figure, which finds *that* cell's image rather than any image.
    """
    images = page.locator(".jp-Cell:has(.labkit-monitor-summary) .jp-OutputArea-output img")
    assert images.count() >= 1, "no live-metrics figure in the monitored cell's output"
    first = images.first
    first.scroll_into_view_if_needed()
    width = first.evaluate("img => img.complete ? img.naturalWidth : 0")
    assert width > 0, "the figure's <img> did not decode (a broken image)"


def _question_boxes(page):
    """One locator per quiz question: the VBox holding its text, radio buttons and feedback."""
    return page.locator(".labkit-quiz .widget-vbox:has(> .widget-radio)")


def assert_quiz_answers_give_feedback(page) -> None:
    bank = quiz.load("00")
    boxes = _question_boxes(page)
    boxes.first.wait_for(state="visible", timeout=30_000)
    assert boxes.count() == len(bank.questions), (
        f"{boxes.count()} quiz questions rendered, the bank has {len(bank.questions)}"
    )
    first, second = bank.questions[0], bank.questions[1]
    box = boxes.nth(0)
    box.scroll_into_view_if_needed()
    assert "Correct." not in box.inner_text() and "Not quite." not in box.inner_text()
    # A wrong answer, then the right one: each click must change the feedback.
    wrong = next(i for i in range(len(first.choices)) if i != first.answer)
    box.locator(".widget-radio-box label").nth(wrong).click()
    box.get_by_text("Not quite.", exact=False).wait_for(timeout=10_000)
    box.locator(".widget-radio-box label").nth(first.answer).click()
    box.get_by_text("Correct.", exact=False).wait_for(timeout=10_000)
    assert "Not quite." not in box.inner_text()
    # The explanation comes with it (first words, as rendered: code spans lose their backticks).
    assert first.explanation.split(".")[0].replace("`", "")[:40] in box.inner_text()
    # Questions are independent: the second shows nothing yet.
    assert "Correct." not in boxes.nth(1).inner_text()
    assert second.question[:20].replace("`", "") in boxes.nth(1).inner_text()


def assert_no_news_toast(page, lab: Lab) -> None:
    settings = lab.api("/lab/api/settings/@jupyterlab/apputils-extension:notification")
    assert settings["settings"]["fetchNews"] == "false", settings["settings"]
    toasts = page.locator(".Toastify__toast")
    texts = [toasts.nth(i).inner_text() for i in range(toasts.count())]
    assert not texts, f"notifications cover the page: {texts}"


# --- the test ----------------------------------------------------------------------------------


def test_notebook_00_runs_in_jupyterlab_and_its_widgets_work(lab: Lab, browser_page):
    page = browser_page
    shots = artifacts_dir()
    for old in shots.glob("browser-00*.png"):
        old.unlink()  # the artefacts describe this run only
    try:
        page.goto(f"{lab.url}/lab/tree/{NOTEBOOK}?token={lab.token}")
        page.locator(".jp-Notebook .jp-CodeCell").first.wait_for(timeout=60_000)
        wait_for_kernel(page)
        run_all_cells(page)
        assert_every_cell_ran(page)
        assert_live_metrics_figure(page)
        page.screenshot(path=str(shots / "browser-00-figure.png"))
        assert_quiz_answers_give_feedback(page)
        assert_no_news_toast(page, lab)
        page.screenshot(path=str(shots / "browser-00.png"))
    except BaseException:
        page.screenshot(path=str(shots / "browser-00-failure.png"))
        print(f"JupyterLab log (tail):\n{lab.log_tail()}")
        raise
