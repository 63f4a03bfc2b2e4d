"""The rendered course's parts that need no Sphinx run: each page's run header, the pages made
from executed notebooks, the front page and its order, the quiz as static HTML, and the
``./course book`` command. The built site itself is checked in a browser by
``tests/book/test_pages.py``, after CI builds it."""

from __future__ import annotations

import html
import re
import subprocess
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from labkit.course import book, quiz

ROOT = Path(__file__).resolve().parents[1]
RUN = book.RunInfo(date="2026-12-06T16:17:49.604298+00:00", machine="AMD EPYC, 2 usable cores, "
                   "24 GiB RAM", os="Debian GNU/Linux 12 (bookworm), Linux 6.1.0", tier="cpu",
                   size="lab")  # fmt: skip
README = """# LLM GPU Lab

A hands-on course.

## Start

./course lab

## Curriculum

| # | notebook | what it teaches |
| --- | --- | --- |
| 00 | `00_setup` | the machine |
| 03 | `03_model` | pipelines; `03_model` again |
| 03b | `03b_compose` | meshes |

**The three tiers**: CPU only.

## Exercises and solutions

Not on the front page.
"""


def executed(**metadata) -> nbformat.NotebookNode:
    """A small notebook as papermill leaves it: title, parameters, injected parameters, code."""
    nb = new_notebook(cells=[
        new_markdown_cell("# 01 · A title\n\nThe introduction."),
        new_code_cell('size = "lab"', metadata={"tags": ["parameters"]}),
        new_code_cell('size = "smoke"', metadata={"tags": ["injected-parameters"]}),
        new_code_cell("print(size)"),
    ])  # fmt: skip
    nb.metadata.update(metadata)
    return nb


# --- the run header -------------------------------------------------------------------------


def test_header_states_date_machine_tier_and_size():
    text = book.header(RUN)
    assert text.startswith("```{admonition}") and text.endswith("```")
    assert "- **Date:** 2026-12-06 16:17 UTC" in text
    assert "- **Machine:** AMD EPYC, 2 usable cores, 24 GiB RAM; Debian GNU/Linux 12" in text
    assert "- **Tier:** CPU tier: ranks as processes over gloo" in text
    assert "- **Size:** lab (the learner's default)" in text
    smoke = book.header(book.RunInfo(**{**RUN.__dict__, "size": "smoke", "tier": "multi-gpu"}))
    assert "- **Size:** smoke\n" in smoke and "one process per GPU over NCCL" in smoke


def test_a_stamped_run_reads_back_and_an_unstamped_one_falls_back_to_papermill():
    nb = executed()
    book.stamp(nb, RUN)
    assert book.RunInfo.of(nb) == RUN
    bare = executed(papermill={"end_time": "2026-12-07T09:00:00+00:00",
                               "parameters": {"size": "smoke"}})  # fmt: skip
    run = book.RunInfo.of(bare)
    assert (run.date, run.size, run.machine, run.tier) == (
        "2026-12-07T09:00:00+00:00", "smoke", book.NOT_RECORDED, book.NOT_RECORDED)
    assert "not recorded" in book.header(book.RunInfo.of(executed()))


def test_this_run_takes_papermills_size_and_end_time_and_this_machine():
    nb = executed(papermill={"end_time": "2026-12-07T09:00:00+00:00",
                             "parameters": {"size": "smoke"}})  # fmt: skip
    run = book.this_run(nb)
    assert run.size == "smoke" and run.date == "2026-12-07T09:00:00+00:00"
    assert run.tier in book.TIER_RUNS and "usable cores" in run.machine and run.os
    assert book.this_run(nb, size="lab").size == "lab"


def test_keep_saves_a_stamped_copy(tmp_path):
    nb = executed(papermill={"parameters": {"size": "smoke"}})
    dest = book.keep(nb, tmp_path / "out" / "01_a.ipynb")
    saved = nbformat.read(dest, as_version=4)
    assert book.RunInfo.of(saved).size == "smoke" and book.RUN_KEY in saved.metadata


# --- the pages --------------------------------------------------------------------------------


def test_page_puts_the_header_under_the_title_and_drops_injected_parameters_and_widgets():
    nb = executed(widgets={"application/vnd.jupyter.widget-state+json": {"state": {}}})
    book.stamp(nb, RUN)
    shown = book.page(nb)
    sources = [c.source for c in shown.cells]
    assert sources[0] == "# 01 · A title"
    assert sources[1] == book.header(RUN)
    assert sources[2] == "The introduction."
    assert 'size = "smoke"' not in sources and "print(size)" in sources
    assert "widgets" not in shown.metadata
    assert len(nb.cells) == 4 and "widgets" in nb.metadata  # the executed notebook is untouched
    nbformat.validate(shown)


def test_page_without_a_title_cell_starts_with_the_header():
    nb = new_notebook(cells=[new_code_cell("1")])
    assert book.page(nb).cells[0].source.startswith("```{admonition}")


def test_executed_notebooks_come_in_course_order(tmp_path):
    for name in ("04_d", "03b_c", "00_a", "03_b", "notes", "conftest.py"):
        (tmp_path / f"{name}.ipynb").write_text("{}")
    assert [p.stem for p in book.executed_notebooks(tmp_path)] == ["00_a", "03_b", "03b_c", "04_d"]


def test_front_page_is_the_readmes_curriculum_with_the_built_pages_linked_in_order():
    text = book.front_page(README, ["00_setup", "03_model"], [RUN])
    assert text.startswith("# LLM GPU Lab\n\nA hands-on course.\n")
    assert "## Start" not in text and "Not on the front page" not in text
    assert "**The three tiers**" in text
    assert "| 00 | [`00_setup`](notebooks/00_setup.ipynb) |" in text
    assert "pipelines; [`03_model`](notebooks/03_model.ipynb) again" in text
    assert "| 03b | `03b_compose` |" in text  # not built: named, not linked
    toc = text.split("```{toctree}")[1].split("```")[0]
    assert re.findall(r"^notebooks/(\S+)$", toc, re.M) == ["00_setup", "03_model"]
    assert ":hidden:" in toc
    assert "2026-12-06 16:17 UTC" in text and "CPU tier: ranks as processes over gloo" in text


def test_front_page_of_the_real_readme_names_every_notebook():
    stems = [p.stem for p in book.executed_notebooks(ROOT / "notebooks")]
    text = book.front_page((ROOT / "README.md").read_text(encoding="utf-8"), stems)
    links = re.findall(r"\[`([^`]+)`\]\(notebooks/\1\.ipynb\)", text)
    assert list(dict.fromkeys(links)) == stems and len(stems) >= 12


def test_a_readme_without_a_curriculum_is_refused():
    with pytest.raises(ValueError, match="no '## Curriculum' section"):
        book.front_page("# Title\n\nText.\n", ["00_a"])


def test_prepare_writes_the_front_page_and_one_page_per_notebook(tmp_path):
    (tmp_path / "executed").mkdir()
    nb = executed()
    book.stamp(nb, RUN)
    nbformat.write(nb, tmp_path / "executed" / "00_setup.ipynb")
    (tmp_path / "README.md").write_text(README)
    src = tmp_path / "src"
    (src / "stale.md").parent.mkdir()
    (src / "stale.md").write_text("from an earlier build")
    assert book.prepare(tmp_path / "executed", src, readme=tmp_path / "README.md") == ["00_setup"]
    assert sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file()) == [
        "index.md", "notebooks/00_setup.ipynb"]
    page = nbformat.read(src / "notebooks" / "00_setup.ipynb", as_version=4)
    assert page.cells[1].source == book.header(RUN)
    with pytest.raises(FileNotFoundError, match="no executed notebooks"):
        book.prepare(tmp_path / "src", tmp_path / "src2", readme=tmp_path / "README.md")


# --- the quiz on a static page ------------------------------------------------------------------


def _outside_details(markup: str) -> str:
    return re.sub(r"<details>.*?</details>", "", markup, flags=re.S)


@pytest.mark.parametrize("notebook", quiz.available())
def test_quiz_html_folds_every_answer(notebook):
    bank = quiz.load(notebook)
    markup = quiz.as_html(bank)
    assert markup.count("<details><summary>Answer</summary>") == len(bank.questions)
    assert "<details open" not in markup
    outside = html.unescape(_outside_details(markup))
    for q in bank.questions:
        assert html.unescape(quiz._html(q.question)) in outside  # the questions show
        assert html.unescape(quiz._html(q.explanation)) not in outside  # their answers do not
        for why in filter(None, q.why_wrong):
            assert html.unescape(quiz._html(why)) not in outside
    assert "Answer:" not in outside
    folded = re.findall(r"<details>.*?</details>", markup, flags=re.S)
    first = bank.questions[0]
    assert quiz._html(first.explanation) in folded[0]
    assert f"<b>Answer: {quiz.LETTERS[first.answer]})</b>" in folded[0]


def test_displayed_quiz_carries_its_folded_html():
    bundle = quiz.QuizView(quiz.load("01"))._repr_mimebundle_()
    assert bundle["text/html"] == quiz.as_html("01")
    assert "application/vnd.jupyter.widget-view+json" in bundle  # JupyterLab still gets widgets


# --- the command --------------------------------------------------------------------------------


def test_course_help_names_the_book_command():
    usage = subprocess.run(["bash", str(ROOT / "course"), "help"], capture_output=True,
                           text=True, check=True).stdout  # fmt: skip
    assert re.search(r"^  \./course book +set up .*requirements-book\.txt", usage, re.M)
    assert "--executed DIR" in usage
    script = (ROOT / "course").read_text()
    assert 'exec "$VENV/bin/python" -m labkit.course.book "$@"' in script
    assert "pip install -q -r requirements-book.txt -c requirements.lock" in script


def test_book_requirements_are_exact_pins_kept_out_of_the_learners_install():
    pins = [ln for ln in (ROOT / "requirements-book.txt").read_text().splitlines()
            if ln and not ln.startswith("#")]  # fmt: skip
    assert all(re.fullmatch(r"[a-z0-9-]+==[0-9][0-9A-Za-z.]*", p) for p in pins), pins
    names = {p.split("==")[0] for p in pins}
    assert {"sphinx", "myst-nb", "sphinx-book-theme"} <= names
    assert not names & {ln.split("==")[0] for ln in (ROOT / "requirements.txt").read_text()
                        .splitlines() if "==" in ln}  # fmt: skip


def test_only_is_refused_with_executed(capsys):
    with pytest.raises(SystemExit):
        book.main(["--executed", "build/executed", "--only", "01"])
    assert "--only chooses notebooks to execute" in capsys.readouterr().err


def test_ci_builds_the_book_from_the_tests_runs_and_checks_it():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "export LABKIT_EXECUTED_DIR=" in ci
    test, build = ci.index("\n./course test\n"), ci.index("./course book --executed")
    assert test < build < ci.index("./course test tests/book")  # tests, book, its pages
