"""Self-check quizzes: one validated question bank per notebook, shown as widgets or text.

Each notebook ends with::

    from labkit import quiz
    quiz.show("01")

In JupyterLab every question is a set of radio buttons with nothing selected; choosing one
shows "Correct." or "Not quite." and the explanation, and the learner may try again. Where
widgets cannot render (a terminal, a headless run under papermill or nbval) the quiz prints as
plain text, questions first and an "Answers" section after them; a displayed widget also
carries that text as its ``text/plain`` fallback.

A bank is ``labkit/quizbank/NN.json``::

    {"notebook": "01", "title": "Single-GPU training",
     "questions": [{"id": "01.async_timing",
                    "question": "...", "choices": ["...", "..."], "answer": 1,
                    "explanation": "... (source: ...)",
                    "domain": "NCP-GENL: performance profiling and troubleshooting"}]}

``answer`` is the 0-based index of the right choice. Text may use `backticks` for code. Banks
are validated when loaded (:class:`Question` and :func:`load_file`): a mistake raises a
:class:`QuizBankError` naming the file, the question and the field.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BANK_DIR = Path(__file__).with_name("quizbank")

DOMAINS: tuple[str, ...] = (
    "NCP-GENL: multi-GPU and distributed setups",
    "NCP-GENL: parallelism techniques",
    "NCP-GENL: memory and batch optimisation",
    "NCP-GENL: performance profiling and troubleshooting",
    "NCP-ADS: single- and multi-GPU training",
)
"""The certification sub-topics a question may be tagged with.

The four NCP-GENL entries are the sub-topics of that exam's "GPU Acceleration and Optimization"
area; the NCP-ADS entry is the Accelerated Data Science exam's "single- and multi-GPU
training" (course notes, facts.md, "Certification context"). Sources disagree on how much
each area weighs in the exam, so the course prints no weights.
"""

LETTERS = "abcdef"
MIN_CHOICES, MAX_CHOICES = 2, len(LETTERS)
_ID = re.compile(r"^\d\d\.[a-z][a-z0-9_]*$")
_FIELDS = ("id", "question", "choices", "answer", "explanation", "domain")


class QuizBankError(ValueError):
    """A question bank that does not validate; the message names file, question and field."""


@dataclass(frozen=True)
class Question:
    """One multiple-choice question; validated on construction."""

    id: str
    """``"NN.name"``: the notebook and a short name, unique in its bank."""
    question: str
    choices: tuple[str, ...]
    """2 to 6 distinct answers, shown lettered a), b), ..."""
    answer: int
    """Index into ``choices`` of the right answer (0-based)."""
    explanation: str
    """Why the answer is right (and the others wrong), citing the source of any number."""
    domain: str
    """One of :data:`DOMAINS`."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(self.choices))
        if not (isinstance(self.id, str) and _ID.match(self.id)):
            raise QuizBankError(
                f"id={self.id!r} is not allowed: use 'NN.name' "
                "(lower case, digits, underscores), e.g. '01.async_timing'"
            )
        for name in ("question", "explanation"):
            value = getattr(self, name)
            if not (isinstance(value, str) and value.strip()):
                raise QuizBankError(f"{name}={value!r} is not allowed: a non-empty string")
        n = len(self.choices)
        if not MIN_CHOICES <= n <= MAX_CHOICES:
            raise QuizBankError(f"choices has {n} entries: {MIN_CHOICES} to {MAX_CHOICES} allowed")
        if not all(isinstance(c, str) and c.strip() for c in self.choices):
            raise QuizBankError(f"choices={list(self.choices)!r}: each must be a non-empty string")
        if len({c.strip().lower() for c in self.choices}) != n:
            raise QuizBankError(
                f"choices={list(self.choices)!r} repeat an entry: make them distinct"
            )
        if (
            isinstance(self.answer, bool)
            or not isinstance(self.answer, int)
            or not 0 <= self.answer < n
        ):
            raise QuizBankError(
                f"answer={self.answer!r} is not allowed: an index from 0 to {n - 1} into choices"
            )
        if self.domain not in DOMAINS:
            raise QuizBankError(f"domain={self.domain!r} is not allowed: one of {list(DOMAINS)}")


@dataclass(frozen=True)
class Bank:
    """The questions of one notebook."""

    notebook: str
    title: str
    questions: tuple[Question, ...]


# --------------------------------------------------------------------------- loading


def load_file(path: str | Path) -> Bank:
    """Read and validate the bank at ``path``."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise QuizBankError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("questions"), list):
        raise QuizBankError(
            f"{path}: expected an object with 'notebook', 'title' and a 'questions' list"
        )
    notebook, title = raw.get("notebook"), raw.get("title")
    if not (isinstance(notebook, str) and re.fullmatch(r"\d\d", notebook)):
        raise QuizBankError(f"{path}: notebook={notebook!r} is not allowed: two digits, e.g. '01'")
    if not (isinstance(title, str) and title.strip()):
        raise QuizBankError(f"{path}: title={title!r} is not allowed: a non-empty string")
    if not raw["questions"]:
        raise QuizBankError(f"{path}: the questions list is empty")
    questions: list[Question] = []
    for index, item in enumerate(raw["questions"]):
        qid = item.get("id", f"#{index}") if isinstance(item, dict) else f"#{index}"
        where = f"{path}: question {qid!r}"
        if not isinstance(item, dict):
            raise QuizBankError(f"{where}: expected an object with fields {list(_FIELDS)}")
        missing = [f for f in _FIELDS if f not in item]
        unknown = sorted(set(item) - set(_FIELDS))
        if missing or unknown:
            raise QuizBankError(
                f"{where}: missing fields {missing}, unknown fields {unknown}; "
                f"a question has exactly {list(_FIELDS)}"
            )
        try:
            question = Question(**item)
        except QuizBankError as err:
            raise QuizBankError(f"{where}: {err}") from None
        if not question.id.startswith(f"{notebook}."):
            raise QuizBankError(
                f"{where}: the id must start with the bank's notebook '{notebook}.'"
            )
        if any(q.id == question.id for q in questions):
            raise QuizBankError(f"{where}: the id is used twice in this bank; ids must be unique")
        questions.append(question)
    return Bank(notebook=notebook, title=title, questions=tuple(questions))


def available() -> list[str]:
    """Notebooks that have a bank, e.g. ``["00", "01"]``."""
    return sorted(p.stem for p in BANK_DIR.glob("[0-9][0-9].json"))


def load(notebook: str) -> Bank:
    """The validated bank of ``notebook`` (``"01"``; an int 1 is accepted too)."""
    key = f"{notebook:02d}" if isinstance(notebook, int) else str(notebook)
    path = BANK_DIR / f"{key}.json"
    if not path.is_file():
        raise ValueError(f"notebook={notebook!r} has no quiz bank; available: {available()}")
    bank = load_file(path)
    if bank.notebook != key:
        raise QuizBankError(f"{path}: notebook={bank.notebook!r} does not match the file name")
    return bank


def _bank(bank: Bank | str | int) -> Bank:
    return bank if isinstance(bank, Bank) else load(bank)


# --------------------------------------------------------------------------- rendering


def _html(text: str) -> str:
    """Escape ``text`` for HTML, turning `code` spans into <code> elements."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def feedback(question: Question, choice: int) -> tuple[bool, str]:
    """Whether choice index ``choice`` is right, and the HTML the widget shows for it."""
    if not 0 <= choice < len(question.choices):
        raise ValueError(f"choice={choice!r} is not allowed: 0 to {len(question.choices) - 1}")
    correct = choice == question.answer
    verdict = (
        '<b style="color:#1a7f37">Correct.</b>'
        if correct
        else '<b style="color:#cf222e">Not quite.</b> Try another answer, or read on.'
    )
    return correct, f"<div>{verdict} {_html(question.explanation)}</div>"


def as_text(bank: Bank | str | int) -> str:
    """The quiz as plain text: numbered questions, lettered choices, then the answers."""
    bank = _bank(bank)
    lines = [f"Quiz {bank.notebook}: {bank.title}", ""]
    for n, q in enumerate(bank.questions, start=1):
        lines.append(f"{n}. {q.question}  [{q.domain}]")
        lines += [f"   {LETTERS[i]}) {c}" for i, c in enumerate(q.choices)]
        lines.append("")
    lines += ["Answers", "-------"]
    for n, q in enumerate(bank.questions, start=1):
        lines.append(f"{n}. {LETTERS[q.answer]}) {q.choices[q.answer]} — {q.explanation}")
    return "\n".join(lines) + "\n"


def question_widget(question: Question, number: int) -> Any:
    """A VBox: the question, radio buttons with nothing selected, and a feedback area.

    Selecting a choice (a click, or setting ``.value`` to its index) fills the feedback.
    """
    import ipywidgets as w

    text = w.HTML(
        f"<p><b>{number}.</b> {_html(question.question)} "
        f'<small style="color:#57606a">[{html.escape(question.domain)}]</small></p>'
    )
    buttons = w.RadioButtons(
        options=[(f"{LETTERS[i]}) {c}", i) for i, c in enumerate(question.choices)],
        value=None,
        layout=w.Layout(width="auto"),
    )
    result = w.HTML("")

    def on_change(change: dict) -> None:
        if change["new"] is not None:
            result.value = feedback(question, change["new"])[1]

    buttons.observe(on_change, names="value")
    return w.VBox([text, buttons, result], layout=w.Layout(margin="0 0 1em 0"))


# Radio labels are one fixed-height line by default; answers here are sentences, so let them
# wrap (scoped to the quiz by its CSS class).
_CSS = (
    "<style>.labkit-quiz .widget-radio-box label {height: auto; white-space: normal; "
    "line-height: 1.4; margin-bottom: 0.3em;}</style>"
)


def widget(bank: Bank | str | int) -> Any:
    """The whole quiz as an ipywidgets VBox: a heading, then one :func:`question_widget` each."""
    import ipywidgets as w

    bank = _bank(bank)
    heading = w.HTML(f"{_CSS}<h3>Quiz {bank.notebook}: {html.escape(bank.title)}</h3>")
    box = w.VBox([heading, *(question_widget(q, n) for n, q in enumerate(bank.questions, start=1))])
    box.add_class("labkit-quiz")
    return box


class QuizView:
    """What :func:`show` displays: the widget, with the text quiz as its plain-text fallback.

    Front ends that render widgets pick the widget; everything else (nbval, a notebook viewed
    where no kernel runs) falls back to ``text/plain``.
    """

    def __init__(self, bank: Bank) -> None:
        self.bank = bank
        self.widget = widget(bank)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict:
        data = dict(self.widget._repr_mimebundle_(include=include, exclude=exclude) or {})
        data["text/plain"] = as_text(self.bank)
        return data

    def __repr__(self) -> str:
        return as_text(self.bank)


def _in_kernel() -> bool:
    """True inside a Jupyter kernel (where widgets can render), False in a terminal."""
    try:
        import ipywidgets  # noqa: F401
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def show(notebook: Bank | str | int) -> None:
    """Display the quiz of ``notebook``: widgets in a Jupyter kernel, else printed text."""
    bank = _bank(notebook)
    if _in_kernel():
        from IPython.display import display

        display(QuizView(bank))
    else:
        print(as_text(bank), end="")
