"""Notebooks in a real JupyterLab, driven through a real browser.

nbval and papermill execute notebooks without a front end: they cannot tell whether a widget
renders, whether a figure shows, or whether clicking a quiz answer does anything. These tests
start one JupyterLab on a free localhost port, open notebooks in the system Chromium through
Playwright, run every cell from the "Run" menu as a learner would, and check what the learner
sees.

Notebook 00 (the solution; it has no exercise):

- every code cell ran, without an error;
- the live-metrics figure rendered (an image that actually decoded, not a broken icon);
- the quiz renders as a learner should see it: code in choices as code, not backticks; a
  choice that wraps keeps its round button beside its first line; a wrong click says why that
  choice is wrong and does not show the explanation; a right click and "Show answer" do;
- JupyterLab's news notification stayed off (it would cover the page, and it fetches from
  the internet).

The learner's copy of notebook 01 (`notebooks/`, exercises unfinished), at smoke size: Run All
reaches the last code cell and no cell shows an error.

They leave screenshots in test-artifacts/ (or $LABKIT_ARTIFACTS). The browser is the
distribution's Chromium (scripts/install_browser.sh); nothing is downloaded at test time.
Without Chromium or Playwright the tests skip, except in CI (CI=true), where they fail.
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
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from labkit.course import quiz

pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = "00_setup_and_first_job.ipynb"  # from solutions/
LEARNER_NOTEBOOK = "01_single_gpu_training.ipynb"  # from notebooks/, the learner's copy
SERVER_START_S = 60  # JupyterLab answers /api/status within a few seconds here
RUN_ALL_S = 180  # notebook 00 launches two ~5 s jobs; generous for a loaded 2-core CI machine
LEARNER_RUN_ALL_S = 240  # notebook 01 at smoke size: a short training run and its figures
NARROW_VIEWPORT = {"width": 900, "height": 1000}  # a laptop window beside the slides
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

    def api(self, path: str, method: str = "GET") -> dict | list | None:
        req = urllib.request.Request(
            f"{self.url}{path}", method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        """End every kernel, so the next notebook does not share the CPUs with an idle one."""
        for kernel in self.api("/api/kernels") or []:
            with contextlib.suppress(OSError):
                self.api(f"/api/kernels/{kernel['id']}", method="DELETE")


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


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """One JupyterLab for every test here (starting one costs seconds), on a free port, with
    its own settings, serving copies of notebook 00 and of the learner's notebook 01."""
    tmp_path = tmp_path_factory.mktemp("jupyterlab")
    root = tmp_path / "notebooks"
    root.mkdir()
    # solutions/ is the source of truth; notebook 00 has no exercise, so it runs as is.
    shutil.copy(ROOT / "solutions" / NOTEBOOK, root / NOTEBOOK)
    # The learner's copy, exercises unfinished, exactly as a learner opens it.
    shutil.copy(ROOT / "notebooks" / LEARNER_NOTEBOOK, root / LEARNER_NOTEBOOK)
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


@pytest.fixture(scope="module")
def browser():
    """The system Chromium, started once for every test here."""
    executable = find_chromium()
    if executable is None:
        _unavailable("no Chromium found (/usr/bin/chromium, chromium-browser, $LABKIT_CHROMIUM)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("Playwright is not installed")
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def browser_page(browser, lab: Lab):
    """A fresh Chromium page (1400×1000); afterwards it closes and every kernel is ended."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        yield page
    finally:
        page.close()
        lab.shutdown_kernels()


# --- what the learner sees ---------------------------------------------------------------------

# True once the run is over: the kernel is idle and no cell waits ([*]:). Every cell then shows
# an execution count ([3]:), or, after an error (Run All stops there), the cells after it show
# none ([ ]:). The page cannot tell which cell failed: JupyterLab 4 renders an error like a
# stderr stream (both application/vnd.jupyter.stderr), so `saved_run` reads the saved notebook.
_RUN_FINISHED_JS = """() => {
  const prompts = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]
    .map(p => p.textContent.trim());
  const idle = document.querySelector('.jp-Notebook-ExecutionIndicator[data-status="idle"]');
  return prompts.length > 0 && !!idle && !prompts.some(p => p.includes('*'));
}"""
SAVE_S = 30  # saving a notebook of a few MB of figures to the local server
RESAVE_S = 10  # then save again from the menu, once


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


def open_notebook(page, lab: Lab, name: str) -> None:
    """Open ``name`` alone. ``reset`` starts from an empty workspace: JupyterLab would otherwise
    reopen the notebooks of the previous page, start their kernels, and keep their cells in the
    DOM beside this one's."""
    page.goto(f"{lab.url}/lab/tree/{name}?reset&token={lab.token}")
    page.locator(".jp-Notebook .jp-CodeCell").first.wait_for(timeout=60_000)
    wait_for_kernel(page)
    titles = page.locator(".jp-NotebookPanel").evaluate_all(
        "panels => panels.map(p => p.querySelector('.jp-Notebook') ? p.id : null)"
    )
    assert len(titles) == 1, f"{len(titles)} notebooks open, expected only {name}"


def run_all_cells(page, timeout_s: float = RUN_ALL_S) -> None:
    """Run > Run All Cells, from the menu bar (matched exactly: the same menu also holds
    'Restart Kernel and Run All Cells...'), then wait until every cell has run, or one failed."""
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
    page.wait_for_function(_RUN_FINISHED_JS, timeout=timeout_s * 1000, polling=500)


def save_from_menu(page) -> None:
    """File > Save Notebook (the menu item Ctrl+S stands for)."""
    page.locator("#jp-MainMenu .lm-MenuBar-item", has_text=re.compile(r"^File$")).click()
    page.locator(
        ".lm-Menu-item .lm-Menu-itemLabel", has_text=re.compile(r"^Save( Notebook)?$")
    ).first.click()


def saved_run(page, lab: Lab, name: str) -> tuple[list[int | None], list[str]]:
    """Save the notebook (Ctrl+S) and read it back from the server: each code cell's execution
    count, and 'code cell N: Error: message' for every error output."""
    shown = [
        int(m.group(1)) if (m := re.fullmatch(r"\[(\d+)\]:", p)) else None
        for p in _cell_prompts(page)
    ]
    page.keyboard.press("Control+s")
    deadline = time.monotonic() + SAVE_S
    resave = time.monotonic() + RESAVE_S
    while True:  # until the file holds what the page shows
        try:
            content = lab.api(f"/api/contents/{name}?content=1")
        except urllib.error.HTTPError as err:
            # A read while the server's atomic save renames its temporary file answers 500
            # (FileNotFoundError on '.~name', seen in a CI run) or 404: the save is in flight.
            if err.code not in (404, 500) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
            continue
        cells = [c for c in content["content"]["cells"] if c["cell_type"] == "code"]
        counts = [c["execution_count"] for c in cells]
        if counts == shown:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"the saved {name} never matched the page: {counts} against {shown}")
        if time.monotonic() > resave:
            # On a loaded machine one CI run saved the notebook with no execution count at all
            # while the page showed 1..15 and never saved again: save once more, from the
            # menu, which needs no keyboard focus on the notebook.
            save_from_menu(page)
            resave = deadline
        time.sleep(0.5)
    errors = [
        f"code cell {i}: {out['ename']}: {out['evalue']}"
        for i, cell in enumerate(cells)
        for out in cell["outputs"]
        if out["output_type"] == "error"
    ]
    return counts, errors


def assert_every_cell_ran(page, lab: Lab, name: str) -> None:
    counts, errors = saved_run(page, lab, name)
    assert not errors, "Run All stopped at an error:\n" + "\n".join(errors)
    not_run = [i for i, count in enumerate(counts) if count is None]
    assert counts and not not_run, f"code cells not run: {not_run} (counts {counts})"


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


def _shown(text: str) -> str:
    """What a learner reads of bank text: code spans render without their backticks."""
    return text.replace("`", "")


def _question_boxes(page):
    """One locator per quiz question: its text, choice rows, feedback and "Show answer"."""
    return page.locator(".labkit-quiz .labkit-quiz-question")


def assert_quiz_renders(page, bank: quiz.Bank) -> None:
    boxes = _question_boxes(page)
    boxes.first.wait_for(state="visible", timeout=30_000)
    assert boxes.count() == len(bank.questions), (
        f"{boxes.count()} quiz questions rendered, the bank has {len(bank.questions)}"
    )
    for n, q in enumerate(bank.questions):
        box = boxes.nth(n)
        rows = box.locator(".labkit-quiz-choice")
        assert rows.count() == len(q.choices)
        assert box.locator(".labkit-quiz-feedback").inner_text().strip() == ""
        assert box.locator('input[type="checkbox"]:checked').count() == 0
        for i, choice in enumerate(q.choices):
            label = rows.nth(i)
            shown = label.inner_text()
            assert "`" not in shown, f"question {q.id}, choice {i} shows raw backticks: {shown!r}"
            assert _shown(choice)[:40] in shown, (q.id, i, shown)
            if "`" in choice:
                assert label.locator("code").count() >= 1, f"{q.id}, choice {i}: no <code>"


def assert_long_choice_keeps_its_button_beside_it(page, bank: quiz.Bank) -> None:
    """The longest choice wraps in a narrow window; its button sits left of its text, on the
    first line, not on a line of its own (as ipywidgets' RadioButtons put it)."""
    page.set_viewport_size(NARROW_VIEWPORT)
    n, i = max(
        ((n, i) for n, q in enumerate(bank.questions) for i in range(len(q.choices))),
        key=lambda ni: len(_shown(bank.questions[ni[0]].choices[ni[1]])),
    )
    row = _question_boxes(page).nth(n).locator(".labkit-quiz-choice").nth(i)
    row.scroll_into_view_if_needed()
    button = row.locator('input[type="checkbox"]').bounding_box()
    text = row.locator("label.widget-label-basic > span").bounding_box()
    line = row.locator("label.widget-label-basic > span").evaluate(
        "e => parseFloat(getComputedStyle(e).lineHeight)"
    )
    assert button and text and line > 0
    assert text["height"] >= 1.8 * line, (
        f"the longest choice did not wrap at {NARROW_VIEWPORT['width']} px, so this check "
        f"proves nothing: text {text}, line height {line}"
    )
    assert button["x"] + button["width"] <= text["x"] + 1, f"button {button} not left of {text}"
    centre = button["y"] + button["height"] / 2
    assert text["y"] <= centre <= text["y"] + line, (
        f"button {button} is not on the first line of its text {text} (line height {line})"
    )


def assert_quiz_feedback(page, bank: quiz.Bank) -> None:
    """A wrong click: that choice's feedback, no explanation; a right click: the explanation.
    "Show answer" on another question: the explanation, without a click."""
    first, second = bank.questions[0], bank.questions[1]
    box = _question_boxes(page).nth(0)
    box.scroll_into_view_if_needed()
    feedback = box.locator(".labkit-quiz-feedback")
    explanation = _shown(first.explanation)[:50]
    wrong = next(i for i in range(len(first.choices)) if i != first.answer)
    box.locator(".labkit-quiz-choice").nth(wrong).click()
    feedback.get_by_text("Not quite.", exact=False).wait_for(timeout=10_000)
    said = feedback.inner_text()
    assert _shown(first.why_wrong[wrong] or "")[:50] in said, said
    assert explanation not in said, f"a wrong click gave the explanation away: {said!r}"
    assert box.locator('input[type="checkbox"]:checked').count() == 1
    box.screenshot(path=str(artifacts_dir() / "browser-00-quiz-wrong.png"))
    box.locator(".labkit-quiz-choice").nth(first.answer).click()
    feedback.get_by_text("Correct.", exact=False).wait_for(timeout=10_000)
    said = feedback.inner_text()
    assert explanation in said and "Not quite." not in said, said
    assert box.locator('input[type="checkbox"]:checked').count() == 1  # one choice at a time
    # The next question still shows nothing; "Show answer" reveals its key and explanation.
    other = _question_boxes(page).nth(1)
    assert other.locator(".labkit-quiz-feedback").inner_text().strip() == ""
    other.locator(".labkit-quiz-reveal").click()
    other.get_by_text("Answer:", exact=False).wait_for(timeout=10_000)
    said = other.locator(".labkit-quiz-feedback").inner_text()
    assert _shown(second.explanation)[:50] in said, said


def assert_no_news_toast(page, lab: Lab) -> None:
    settings = lab.api("/lab/api/settings/@jupyterlab/apputils-extension:notification")
    assert settings["settings"]["fetchNews"] == "false", settings["settings"]
    toasts = page.locator(".Toastify__toast")
    texts = [toasts.nth(i).inner_text() for i in range(toasts.count())]
    assert not texts, f"notifications cover the page: {texts}"


# --- the test ----------------------------------------------------------------------------------


def _fresh_shots(prefix: str) -> Path:
    shots = artifacts_dir()
    for old in shots.glob(f"{prefix}*.png"):
        old.unlink()  # the artefacts describe this run only
    return shots


def test_notebook_00_runs_in_jupyterlab_and_its_widgets_work(lab: Lab, browser_page):
    page = browser_page
    shots = _fresh_shots("browser-00")
    bank = quiz.load("00")
    try:
        open_notebook(page, lab, NOTEBOOK)
        run_all_cells(page)
        assert_every_cell_ran(page, lab, NOTEBOOK)
        assert_live_metrics_figure(page)
        page.screenshot(path=str(shots / "browser-00-figure.png"))
        assert_quiz_renders(page, bank)
        assert_quiz_feedback(page, bank)
        assert_no_news_toast(page, lab)
        page.screenshot(path=str(shots / "browser-00.png"))
        assert_long_choice_keeps_its_button_beside_it(page, bank)
        page.screenshot(path=str(shots / "browser-00-quiz-narrow.png"))
    except BaseException:
        page.screenshot(path=str(shots / "browser-00-failure.png"))
        print(f"JupyterLab log (tail):\n{lab.log_tail()}")
        raise


def test_learner_copy_of_notebook_01_runs_all_to_the_end(lab: Lab, browser_page):
    """Run All on the learner's copy, exercises unfinished, at smoke size: a learner who has
    not done the exercises yet still sees the whole lab, with no cell in red."""
    page = browser_page
    shots = _fresh_shots("browser-learner-01")
    try:
        open_notebook(page, lab, LEARNER_NOTEBOOK)
        # Opened, kernel idle, nothing run: the tab must not say "modified" (a notebook whose
        # language_info differs from the kernel's is rewritten as it opens; labkit.course.nbgen).
        page.wait_for_timeout(1_000)  # JupyterLab applies the kernel's info just after idle
        assert page.locator(".lm-TabBar-tab.jp-mod-dirty").count() == 0, (
            "the notebook shows as modified before anything ran"
        )
        run_all_cells(page, timeout_s=LEARNER_RUN_ALL_S)
        counts, errors = saved_run(page, lab, LEARNER_NOTEBOOK)
        assert not errors, "Run All stopped at an error:\n" + "\n".join(errors)
        assert counts and counts[-1] is not None, f"the last code cell did not run: {counts}"
        assert None not in counts, f"code cells not run: {counts}"
        page.screenshot(path=str(shots / "browser-learner-01.png"))
    except BaseException:
        page.screenshot(path=str(shots / "browser-learner-01-failure.png"))
        print(f"JupyterLab log (tail):\n{lab.log_tail()}")
        raise
