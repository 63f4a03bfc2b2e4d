import copy
import json
import os
import re
from pathlib import Path

import pytest

from labkit import quiz

BANKS = sorted(quiz.BANK_DIR.glob("*.json"))


def good_question(**changes) -> dict:
    q = {
        "id": "05.demo",
        "question": "Which is `right`?",
        "choices": ["this one", "that one", "neither"],
        "answer": 0,
        "explanation": "Because <it> is.",
        "domain": quiz.DOMAINS[0],
    }
    q.update(changes)
    return q


def write_bank(tmp_path: Path, questions: list, **top) -> Path:
    bank = {"notebook": "05", "title": "Demo", "questions": questions, **top}
    path = tmp_path / "05.json"
    path.write_text(json.dumps(bank), encoding="utf-8")
    return path


def test_the_shipped_banks_cover_the_first_notebooks():
    assert {"00", "01"} <= set(quiz.available())
    assert [p.stem for p in BANKS] == quiz.available()  # no stray files


@pytest.mark.parametrize("path", BANKS, ids=lambda p: p.name)
def test_every_shipped_bank_validates_and_is_not_guessable(path):
    bank = quiz.load(path.stem)
    assert bank.notebook == path.stem and 4 <= len(bank.questions) <= 8
    # Not every right answer in the same position: "always b)" would score full marks.
    assert len({q.answer for q in bank.questions}) > 1
    assert all(q.domain in quiz.DOMAINS for q in bank.questions)


def test_domains_are_the_certification_sub_topics():
    assert len(quiz.DOMAINS) == len(set(quiz.DOMAINS)) == 5
    assert all(re.match(r"^NCP-(GENL|ADS): \S", d) for d in quiz.DOMAINS)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"answer": 3}, r"answer=3 is not allowed: an index from 0 to 2"),
        ({"answer": True}, r"answer=True is not allowed"),
        ({"domain": "NCP-GENL: cooking"}, r"domain='NCP-GENL: cooking' is not allowed: one of"),
        ({"explanation": "  "}, r"explanation='  ' is not allowed: a non-empty string"),
        ({"choices": ["a", "A "]}, r"repeat an entry"),
        ({"choices": ["only"]}, r"choices has 1 entries: 2 to 6 allowed"),
        ({"id": "demo"}, r"id='demo' is not allowed"),
        ({"id": "04.demo"}, r"must start with the bank's notebook '05.'"),
    ],
)
def test_invalid_questions_name_file_question_and_problem(tmp_path, change, problem):
    path = write_bank(tmp_path, [good_question(**change)])
    qid = change.get("id", "05.demo")
    with pytest.raises(quiz.QuizBankError, match=re.escape(f"{path}: question {qid!r}: ")) as e:
        quiz.load_file(path)
    assert re.search(problem, str(e.value))


def test_missing_and_misspelt_fields_are_named(tmp_path):
    q = good_question()
    q["explaination"] = q.pop("explanation")
    with pytest.raises(
        quiz.QuizBankError,
        match=r"missing fields \['explanation'\], unknown fields \['explaination'\]",
    ):
        quiz.load_file(write_bank(tmp_path, [q]))


def test_duplicate_ids_are_rejected(tmp_path):
    path = write_bank(tmp_path, [good_question(), good_question(question="Again?")])
    with pytest.raises(
        quiz.QuizBankError, match=r"question '05\.demo': the id is used twice in this bank"
    ):
        quiz.load_file(path)


@pytest.mark.parametrize(
    ("top", "problem"),
    [
        ({"notebook": "5"}, "notebook='5' is not allowed"),
        ({"title": ""}, "title='' is not"),
        ({"questions": []}, "the questions list is empty"),
    ],
)
def test_bad_bank_headers(tmp_path, top, problem):
    with pytest.raises(quiz.QuizBankError, match=re.escape(problem)):
        top = dict(top)
        quiz.load_file(write_bank(tmp_path, top.pop("questions", [good_question()]), **top))


def test_unknown_notebook_lists_the_available_ones():
    with pytest.raises(ValueError, match=r"notebook='42' has no quiz bank; available: \['00'"):
        quiz.load("42")
    assert quiz.load(1).notebook == "01"


def test_feedback_for_right_and_wrong_answers():
    q = quiz.Question(**good_question())
    right, html = quiz.feedback(q, 0)
    assert right and "Correct." in html and "Because &lt;it&gt; is." in html
    wrong, html = quiz.feedback(q, 2)
    assert not wrong and "Not quite." in html and "Because &lt;it&gt; is." in html
    with pytest.raises(ValueError, match="choice=3 is not allowed"):
        quiz.feedback(q, 3)


def test_text_has_every_question_then_every_answer():
    bank = quiz.load("01")
    text = quiz.as_text("01")
    questions, answers = text.split("\nAnswers\n")
    for n, q in enumerate(bank.questions, start=1):
        assert f"{n}. {q.question}" in questions
        assert all(f") {c}" in questions for c in q.choices)
        right = f"{n}. {quiz.LETTERS[q.answer]}) {q.choices[q.answer]} — {q.explanation}"
        assert right in answers
        assert q.explanation not in questions


def test_show_prints_text_outside_a_kernel(capsys):
    quiz.show("00")
    assert capsys.readouterr().out == quiz.as_text("00")


def test_widget_starts_blank_and_a_selection_shows_feedback():
    bank = quiz.load("01")
    box = quiz.widget(bank)
    heading, *questions = box.children
    assert "Single-GPU training" in heading.value and len(questions) == len(bank.questions)
    q, (text, buttons, result) = bank.questions[0], questions[0].children
    assert "<code>" in text.value  # backticks became code
    assert buttons.value is None and buttons.index is None and result.value == ""
    wrong = (q.answer + 1) % len(q.choices)
    buttons.value = wrong  # what a click does
    assert "Not quite." in result.value
    buttons.value = q.answer
    assert result.value == quiz.feedback(q, q.answer)[1] and "Correct." in result.value


def test_displayed_quiz_carries_a_text_fallback():
    view = quiz.QuizView(quiz.load("00"))
    bundle = view._repr_mimebundle_()
    assert bundle["text/plain"] == quiz.as_text("00")
    assert "application/vnd.jupyter.widget-view+json" in bundle


def test_question_is_immutable_and_choices_become_a_tuple():
    q = quiz.Question(**good_question())
    assert q.choices == ("this one", "that one", "neither")
    with pytest.raises(AttributeError):
        q.answer = 1  # type: ignore[misc]
    assert copy.deepcopy(q) == q


@pytest.mark.slow
def test_show_in_a_headless_kernel_displays_widget_and_text(monkeypatch):
    nbclient = pytest.importorskip("nbclient")
    from nbformat.v4 import new_code_cell, new_notebook

    repo = str(Path(__file__).resolve().parents[1])
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
    )
    nb = new_notebook(cells=[new_code_cell("from labkit import quiz\nquiz.show('01')")])
    nbclient.NotebookClient(nb, timeout=60, kernel_name="python3").execute()
    (output,) = nb.cells[0].outputs
    assert output.output_type == "display_data"
    assert "application/vnd.jupyter.widget-view+json" in output.data
    assert output.data["text/plain"] == quiz.as_text("01")
