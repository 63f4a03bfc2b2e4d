"""The rendered course (``build/book/``, made by ``./course book``) as a reader sees it, in Chromium.

CI runs this after ``./course book --executed build/executed`` (``.ci/run``). The main test run
leaves it out (``--ignore=tests/book`` in pyproject.toml): it runs before the book exists. The
pages are opened as files, as a static host serves them, with no server. Without a built book,
Chromium or Playwright it skips, except in CI (``CI=true``), where it fails.

- The front page: the README's curriculum links every learner's notebook, in course order, and
  each link opens that notebook's page; the sidebar lists them in the same order.
- Every notebook page: the run header (date, machine, tier, size), code cells, no cell showing
  an error (an error output, or a traceback on stderr), every figure loaded.
- Notebook 01's page, as a learner would read it: figures that decoded, no traceback anywhere,
  and the quiz readable with every answer folded until its "Answer" is clicked.
- Notebooks 01, 04 and 06: the GPU figures recorded on real hardware show, labelled with the
  hardware and date, beside this machine's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_browser
from test_browser import _unavailable, artifacts_dir

from labkit import ids
from labkit.course import quiz

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]
browser = test_browser.browser  # the system Chromium, started once: test_browser.py's fixture

ROOT = Path(__file__).resolve().parents[2]
BOOK = ROOT / "build" / "book"
STEMS = [p.stem for p in sorted((ROOT / "notebooks").glob(ids.NOTEBOOK_GLOB))]
DETAILED = "01_single_gpu_training"
RECORDED = ("01_single_gpu_training", "04_mixed_precision", "06_profiling")
"""Pages that print GPU figures recorded on real hardware (labkit.recordings) beside this run's."""

# What one page holds, read in the browser: myst-nb renders each cell as div.cell, its source
# in .cell_input, its outputs in .cell_output (an error output as .output.traceback, stderr
# as .output.stderr).
READ_PAGE = """() => {
  const texts = sel => [...document.querySelectorAll(sel)].map(e => e.textContent);
  return {
    title: document.querySelector('article h1')?.textContent ?? '',
    header: document.querySelector('.labkit-run')?.innerText ?? '',
    code: document.querySelectorAll('div.cell div.cell_input pre').length,
    errors: texts('.cell_output .output.traceback'),
    stderr: texts('.cell_output .output.stderr'),
    outputs: texts('.cell_output').join('\\n'),
    images: [...document.querySelectorAll('.cell_output img')].map(
      i => ({src: i.getAttribute('src'), loaded: i.complete && i.naturalWidth > 0})),
  };
}"""


@pytest.fixture(scope="module")
def book() -> Path:
    if not (BOOK / "index.html").is_file():
        _unavailable(f"no book at {BOOK}: build it with `./course book` (CI: `./course book "
                     "--executed build/executed` after `./course test`)")  # fmt: skip
    return BOOK


@pytest.fixture
def page(book: Path, browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1300, "height": 1000})
    try:
        yield context.new_page()
    finally:
        context.close()


def url(stem: str | None = None) -> str:
    return (BOOK / "index.html" if stem is None else BOOK / "notebooks" / f"{stem}.html").as_uri()


def read(page: Any, target: str) -> dict[str, Any]:
    page.goto(target)  # waits for the load event: every image has loaded or failed by then
    return page.evaluate(READ_PAGE)


def test_front_page_links_every_notebook_in_course_order(page):
    page.goto(url())
    page.screenshot(path=str(artifacts_dir() / "book-front.png"))
    assert page.locator("article h1").first.text_content().strip().startswith("LLM GPU Lab")
    links = page.eval_on_selector_all(
        "article table a[href*='notebooks/']",
        "els => els.map(e => [e.textContent.trim(), e.href])",
    )
    linked = list(dict.fromkeys(text for text, _ in links))
    assert linked == STEMS, "the curriculum table must link every notebook, in course order"
    sidebar = page.eval_on_selector_all(
        "nav.bd-docs-nav a[href*='notebooks/']", "els => els.map(e => e.href)"
    )
    assert [h.rsplit("/", 1)[1].removesuffix(".html") for h in sidebar] == STEMS
    for stem, href in dict(reversed(links)).items():  # each link opens its notebook's page
        page.goto(href)
        title = page.locator("article h1").first.text_content()
        assert title.startswith(f"{ids.notebook_id(stem)} ·"), (stem, href, title)


@pytest.mark.parametrize("stem", STEMS)
def test_every_page_states_its_run_and_shows_no_error(page, stem):
    shown = read(page, url(stem))
    assert shown["title"].startswith(f"{ids.notebook_id(stem)} ·")
    for field in ("Date:", "Machine:", "Tier:", "Size:"):
        assert field in shown["header"], f"{stem}: the run header lacks {field!r}"
    assert "tier" in shown["header"] and "not recorded" not in shown["header"], shown["header"]
    assert shown["code"] > 0, f"{stem}: no code cell rendered"
    assert shown["errors"] == [], f"{stem}: a cell shows an error: {shown['errors'][0][:500]}"
    raised = [t for t in shown["stderr"] if "Traceback (most recent call last)" in t]
    assert raised == [], f"{stem}: a traceback on stderr: {raised[0][:500]}"
    broken = [i["src"] for i in shown["images"] if not i["loaded"]]
    assert broken == [], f"{stem}: figures that did not load: {broken}"


def test_notebook_01_reads_as_a_learner_sees_it(page):
    shown = read(page, url(DETAILED))
    page.screenshot(path=str(artifacts_dir() / f"book-{DETAILED}.png"), full_page=False)
    assert sum(i["loaded"] for i in shown["images"]) >= 3, shown["images"]  # loss, steps, memory
    assert "Traceback" not in shown["outputs"]
    assert "CPU tier: ranks as processes over gloo" in shown["header"] or "GPU" in shown["header"]
    # The quiz: every question and its choices readable, every answer folded.
    bank = quiz.load(ids.notebook_id(DETAILED))
    box = page.locator(".labkit-quiz-static")
    assert box.count() == 1, "the quiz did not render as HTML"
    folds = box.locator("details")
    assert folds.count() == len(bank.questions)
    assert box.locator("ol[type=a] > li").count() == sum(len(q.choices) for q in bank.questions)
    first = folds.nth(0)
    answer = first.locator("div").first
    assert not answer.is_visible(), "an answer shows before it is unfolded"
    first.locator("summary").click()
    assert answer.is_visible()
    assert answer.inner_text().startswith(f"Answer: {quiz.LETTERS[bank.questions[0].answer]})")


@pytest.mark.parametrize("stem", RECORDED)
def test_gpu_figures_recorded_on_real_hardware_show_beside_this_run(page, stem):
    outputs = read(page, url(stem))["outputs"]
    assert re.search(r"recorded on \d+× NVIDIA [^,]+, \d{4}-\d\d-\d\d", outputs), (
        f"{stem}: no figure recorded on a GPU (labkit.recordings) on the page")
