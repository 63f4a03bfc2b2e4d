"""Self-check quizzes: one validated question bank per notebook, shown as widgets or text.

Each notebook ends with::

    from labkit.course import quiz
    quiz.show("01")

In JupyterLab every question lists its choices, each with a round selector beside its text and
nothing selected. A wrong choice says why *that* choice is wrong and leaves the learner to try
again; the full explanation appears only with the right answer, or when the learner presses
"Show answer". Where widgets cannot render (a terminal, a headless run under papermill or nbval)
the quiz prints as plain text, questions first and an "Answers" section after them; a displayed
widget also carries that text as its ``text/plain`` fallback, and for a static page (the
rendered course, ``./course book``) the quiz as HTML, each answer folded (:func:`as_html`).

A bank is ``labkit/course/quizbank/NN.json``::

    {"notebook": "01", "title": "Single-GPU training",
     "questions": [{"id": "01.async_timing",
                    "question": "...", "choices": ["...", "...", "..."], "answer": 1,
                    "why_wrong": ["why the first choice is wrong", null, "why the third is"],
                    "explanation": "... (source: ...)",
                    "domain": "NCP-GENL: performance profiling and troubleshooting",
                    "section": "3. Asynchronous execution: how to time a GPU",
                    "concept": ["synchronize"]}]}

``answer`` is the 0-based index of the right choice. ``why_wrong`` runs parallel to
``choices``: ``null`` (or ``""``) at the answer, and at every other index what is wrong with that
choice, written so that it does not give the answer away. ``explanation`` says why the answer is
right and cites sources a learner can open (papers with a section, documentation pages, source
files in public repositories). ``section`` is the heading, without its ``## ``, of the section
of ``solutions/NN_*.ipynb`` that teaches the question: the mock exam (:mod:`labkit.course.exam`) points
a learner there for each question missed (``tests/test_quiz.py`` checks every one against the
notebook's headings). ``concept`` lists one or more terms that carry the key's idea: each must
appear in the answer or the explanation, and ``tests/test_quizbank_rules.py`` checks that each
appears in that section's markdown or code, so a question points to a section that teaches
its answer, not merely to a heading. An optional ``tags`` list marks an item: ``"course"`` is a
check on the course's own machinery (how its launcher or its measurements work), asked in the
notebook's quiz but left out of the mock exam (:func:`labkit.course.exam.draw`), which imitates a
certification. Text may use `backticks` for code. Banks are validated when
loaded (:class:`Question` and :func:`load_file`): a mistake raises a :class:`QuizBankError`
naming the file, the question and the field. How well the items are *written* (no option
conspicuously longer than the rest, public citations) is checked by ``tests/test_quizbank.py``.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labkit.errors import LabkitError
from labkit.ids import NOTEBOOK_ID

BANK_DIR = Path(__file__).with_name("quizbank")

DOMAINS: tuple[str, ...] = (
    "NCP-GENL: multi-GPU and distributed setups",
    "NCP-GENL: parallelism techniques",
    "NCP-GENL: memory and batch optimisation",
    "NCP-GENL: performance profiling and troubleshooting",
    "NCP-ADS: single- and multi-GPU training",
)
"""The certification sub-topics a question may be tagged with.

The four NCP-GENL entries are the sub-topics of the "GPU Acceleration and Optimization" area of
NVIDIA-Certified Professional: Generative AI LLMs; the NCP-ADS entry is "single- and multi-GPU
training" in NVIDIA-Certified Professional: Accelerated Data Science. Both exams' pages are
linked from https://www.nvidia.com/en-us/learn/certification/. Third-party study guides disagree
on how much each area weighs, so the course prints no weights.
"""

TAGS: tuple[str, ...] = ("course",)
"""Tags an item may carry. ``course``: the item checks the course's own machinery (how labkit
launches workers, what a loopback counter counts), not certification material: the notebook's
quiz asks it, the mock exam does not."""

LETTERS = "abcdef"
MIN_CHOICES, MAX_CHOICES = 2, len(LETTERS)
_ID = re.compile(rf"^{NOTEBOOK_ID}\.[a-z][a-z0-9_]*$")
_FIELDS = ("id", "question", "choices", "answer", "why_wrong", "explanation", "domain", "section",
           "concept")
_OPTIONAL = ("tags",)


class QuizBankError(ValueError, LabkitError):
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
    why_wrong: tuple[str | None, ...]
    """Parallel to ``choices``: ``None`` at the answer, else why that choice is wrong."""
    explanation: str
    """Why the answer is right, citing public sources for any fact or number."""
    domain: str
    """One of :data:`DOMAINS`."""
    section: str
    """The heading (without ``## ``) of the notebook section that teaches this question."""
    concept: tuple[str, ...]
    """Terms that carry the key's idea, each found in the answer or the explanation (and, as
    ``tests/test_quizbank_rules.py`` checks, in the text of :attr:`section`)."""
    tags: tuple[str, ...] = ()
    """Any of :data:`TAGS`; ``"course"`` keeps the item out of the mock exam."""

    @property
    def course(self) -> bool:
        """True for a check on the course's own machinery, left out of the mock exam."""
        return "course" in self.tags

    @property
    def label(self) -> str:
        """The tag shown beside the question: its exam sub-topic, or ``course`` for a check on
        the course's own machinery, which no exam asks."""
        return "course" if self.course else self.domain

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(self.choices))
        if not (isinstance(self.id, str) and _ID.match(self.id)):
            raise QuizBankError(
                f"id={self.id!r} is not allowed: use 'NN.name' "
                "(lower case, digits, underscores), e.g. '01.async_timing'"
            )
        for name in ("question", "explanation", "section"):
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
        object.__setattr__(self, "why_wrong", self._checked_why_wrong())
        if self.domain not in DOMAINS:
            raise QuizBankError(f"domain={self.domain!r} is not allowed: one of {list(DOMAINS)}")
        object.__setattr__(self, "concept", self._checked_concept())
        tags = self.tags
        if not (isinstance(tags, (list, tuple)) and all(t in TAGS for t in tags)
                and len(set(tags)) == len(tags)):  # fmt: skip
            raise QuizBankError(f"tags={tags!r} is not allowed: a list of distinct tags from "
                                f"{list(TAGS)} (or leave it out)")  # fmt: skip
        object.__setattr__(self, "tags", tuple(tags))

    def _checked_concept(self) -> tuple[str, ...]:
        """``concept`` as a tuple, or the first problem with it."""
        terms = self.concept
        if not (isinstance(terms, (list, tuple)) and terms
                and all(isinstance(t, str) and t.strip() for t in terms)):  # fmt: skip
            raise QuizBankError(f"concept={terms!r} is not allowed: a non-empty list of terms "
                                "that carry the key's idea")  # fmt: skip
        own = plain(" ".join((self.choices[self.answer], self.explanation)))
        missing = [t for t in terms if plain(t) not in own]
        if missing:
            raise QuizBankError(f"concept terms {missing} appear in neither the answer nor the "
                                "explanation: a concept term must come from the item's key")  # fmt: skip
        return tuple(terms)

    def _checked_why_wrong(self) -> tuple[str | None, ...]:
        """``why_wrong`` as a tuple with ``None`` at the answer, or the first problem with it."""
        entries = self.why_wrong
        if not isinstance(entries, (list, tuple)) or len(entries) != len(self.choices):
            count = len(entries) if isinstance(entries, (list, tuple)) else "no"
            raise QuizBankError(
                f"why_wrong has {count} entries for {len(self.choices)} choices: give one per "
                "choice, in the same order (null at the answer)"
            )
        for i, entry in enumerate(entries):
            where = f"why_wrong[{i}] (choice {LETTERS[i]})"
            if i == self.answer:
                if entry not in (None, ""):
                    raise QuizBankError(
                        f"{where} is the answer's entry: leave it null (the explanation says "
                        "why the answer is right)"
                    )
            elif not (isinstance(entry, str) and entry.strip()):
                raise QuizBankError(
                    f"{where}={entry!r} is not allowed: say why that choice is wrong"
                )
        return tuple(None if i == self.answer else e for i, e in enumerate(entries))


@dataclass(frozen=True)
class Bank:
    """The questions of one notebook."""

    notebook: str
    title: str
    questions: tuple[Question, ...]


def plain(text: str) -> str:
    """``text`` as compared for concept terms: lower case, code backticks and runs of
    whitespace removed (a term may span a line break of the notebook's markdown)."""
    return " ".join(text.replace("`", "").lower().split())


# --------------------------------------------------------------------------- loading


def load_file(path: str | Path) -> Bank:
    """Read and validate the bank at ``path``."""
    path = Path(path)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise QuizBankError(
            f"{path}: not UTF-8: byte {err.start} (0x{data[err.start]:02x}, line {line}) is not "
            "part of a UTF-8 character; quiz files must be UTF-8: save the file as UTF-8 in your "
            "editor (or convert it, e.g. iconv -f latin1 -t utf-8)"
        ) from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise QuizBankError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("questions"), list):
        raise QuizBankError(
            f"{path}: expected an object with 'notebook', 'title' and a 'questions' list"
        )
    notebook, title = raw.get("notebook"), raw.get("title")
    if not (isinstance(notebook, str) and re.fullmatch(NOTEBOOK_ID, notebook)):
        raise QuizBankError(f"{path}: notebook={notebook!r} is not allowed: two digits and an optional letter, e.g. '01' or '03b'")
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
        unknown = sorted(set(item) - set(_FIELDS) - set(_OPTIONAL))
        if missing or unknown:
            raise QuizBankError(
                f"{where}: missing fields {missing}, unknown fields {unknown}; "
                f"a question has exactly {list(_FIELDS)}, and optionally {list(_OPTIONAL)}"
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
    banks = BANK_DIR.glob("[0-9][0-9]*.json")
    return sorted(p.stem for p in banks if re.fullmatch(NOTEBOOK_ID, p.stem))


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


_RIGHT = '<b style="color:#1a7f37">Correct.</b>'
_WRONG = '<b style="color:#cf222e">Not quite.</b>'


def _check_choice(question: Question, choice: object) -> None:
    """Refuse anything but the 0-based index of one of ``question``'s choices. bool is refused
    although Python makes it an int, and so is 1.0: neither is an index a learner means."""
    n = len(question.choices)
    if isinstance(choice, bool) or not isinstance(choice, int) or not 0 <= choice < n:
        letters = ", ".join(f"{i} for {LETTERS[i]}" for i in range(n))
        raise ValueError(f"choice={choice!r} is not allowed: give the index of a choice, an int "
                         f"from 0 to {n - 1} ({letters})")  # fmt: skip


def feedback(question: Question, choice: int) -> tuple[bool, str]:
    """Whether choice index ``choice`` is right, and the HTML the widget shows for it.

    The right choice gets the explanation. A wrong one gets only why *it* is wrong: the
    explanation would give the answer away before the learner has found it.
    """
    _check_choice(question, choice)
    if choice == question.answer:
        return True, f"<div>{_RIGHT} {_html(question.explanation)}</div>"
    why = question.why_wrong[choice] or ""
    return False, (
        f"<div>{_WRONG} {_html(why)} <i>Try another answer, or press Show answer.</i></div>"
    )


def reveal(question: Question) -> str:
    """The HTML that "Show answer" shows: the right choice and the explanation."""
    letter, text = LETTERS[question.answer], question.choices[question.answer]
    return f"<div><b>Answer: {letter})</b> {_html(text)}. {_html(question.explanation)}</div>"


def as_text(bank: Bank | str | int) -> str:
    """The quiz as plain text: numbered questions, lettered choices, then the answers.

    Each answer gives the explanation, then why each other choice is wrong.
    """
    bank = _bank(bank)
    lines = [f"Quiz {bank.notebook}: {bank.title}", ""]
    for n, q in enumerate(bank.questions, start=1):
        lines.append(f"{n}. {q.question}  [{q.label}]")
        lines += [f"   {LETTERS[i]}) {c}" for i, c in enumerate(q.choices)]
        lines.append("")
    lines += ["Answers", "-------"]
    for n, q in enumerate(bank.questions, start=1):
        lines.append(f"{n}. {LETTERS[q.answer]}) {q.choices[q.answer]} — {q.explanation}")
        lines += [
            f"   Not {LETTERS[i]}): {why}" for i, why in enumerate(q.why_wrong) if why is not None
        ]
    return "\n".join(lines) + "\n"


def as_html(bank: Bank | str | int) -> str:
    """The quiz as static HTML, for a page where no kernel runs (the rendered course): numbered
    questions and lettered choices, each answer folded under its question in a
    ``<details>`` element, so a reader tries before unfolding it. Unfolded, it says what the
    text quiz's "Answers" section says: the right choice, the explanation, why each other
    choice is wrong."""
    bank = _bank(bank)
    parts = [f'<div class="labkit-quiz-static"><h3>Quiz {bank.notebook}: '
             f"{html.escape(bank.title)}</h3><ol>"]  # fmt: skip
    for q in bank.questions:
        choices = "".join(f"<li>{_html(c)}</li>" for c in q.choices)
        wrong = "".join(f"<li>Not {LETTERS[i]}): {_html(why)}</li>"
                        for i, why in enumerate(q.why_wrong) if why is not None)  # fmt: skip
        parts.append(
            f'<li><p>{_html(q.question)} <small>[{html.escape(q.label)}]</small></p>'
            f'<ol type="a">{choices}</ol>'
            f"<details><summary>Answer</summary>{reveal(q)}<ul>{wrong}</ul></details></li>"
        )
    return "".join(parts) + "</ol></div>"


def question_heading(question: Question, number: int, *, tag: bool = True) -> Any:
    """The question's text as an HTML widget: its number, the question and, with ``tag``, its
    sub-topic (the mock exam hides it while it runs, as a certification exam does)."""
    import ipywidgets as w

    topic = (f' <small style="color:#57606a">[{html.escape(question.label)}]</small>'
             if tag else "")  # fmt: skip
    return w.HTML(f"<p><b>{number}.</b> {_html(question.question)}{topic}</p>")


def choice_rows(question: Question) -> list[Any]:
    """One Checkbox per choice, its label HTML beside a round selector (the quiz's CSS)."""
    import ipywidgets as w

    rows = []
    for i, c in enumerate(question.choices):
        row = w.Checkbox(value=False, description=f"<b>{LETTERS[i]})</b> {_html(c)}",
                         description_allow_html=True, indent=False,
                         layout=w.Layout(width="100%", height="auto"))  # fmt: skip
        row.add_class("labkit-quiz-choice")
        rows.append(row)
    return rows


class QuestionWidget:
    """One question as widgets: its text, one row per choice, a feedback area, "Show answer".

    Each choice is a Checkbox whose label renders HTML (so `code` shows as code) and wraps
    beside its selector; the quiz's CSS draws the selector round, and :meth:`_on_pick` keeps
    at most one row selected, as radio buttons would. (ipywidgets' RadioButtons set their
    labels as plain text and place the input after it, so code shows with its backticks and
    a long label pushes its button to the next line.) Selecting a choice (a click, or
    :meth:`pick`) fills the feedback area with :func:`feedback`.
    """

    def __init__(self, question: Question, number: int) -> None:
        import ipywidgets as w

        self.question = question
        self.selected: int | None = None
        self.text = question_heading(question, number)
        self.choices = choice_rows(question)
        for i, row in enumerate(self.choices):
            row.observe(lambda change, i=i: self._on_pick(i, change["new"]), names="value")
        self.result = w.HTML("")
        self.result.add_class("labkit-quiz-feedback")
        self.show_answer = w.Button(
            description="Show answer", layout=w.Layout(width="auto", align_self="flex-start")
        )
        self.show_answer.add_class("labkit-quiz-reveal")
        self.show_answer.on_click(lambda _button: self._reveal())
        self.box = w.VBox(
            [self.text, *self.choices, self.result, self.show_answer],
            layout=w.Layout(margin="0 0 1em 0"),
        )
        self.box.add_class("labkit-quiz-question")

    def pick(self, choice: int) -> None:
        """Select ``choice`` as a click on its row does."""
        _check_choice(self.question, choice)
        self.choices[choice].value = True

    def _on_pick(self, choice: int, checked: bool) -> None:
        if not checked:
            if choice == self.selected:  # a click on the selected row: keep it, as a radio does
                self.choices[choice].value = True
            return
        self.selected = choice
        for i, row in enumerate(self.choices):
            if i != choice:
                row.value = False
        right, self.result.value = feedback(self.question, choice)
        self._offer_answer(not right)

    def _reveal(self) -> None:
        self.result.value = reveal(self.question)
        self._offer_answer(False)

    def _offer_answer(self, offer: bool) -> None:
        # Hidden, not removed, once the explanation shows: the layout does not jump.
        self.show_answer.layout.visibility = "visible" if offer else "hidden"


def question_widget(question: Question, number: int) -> Any:
    """The VBox of a :class:`QuestionWidget` (its widgets stay reachable as ``.children``)."""
    return QuestionWidget(question, number).box


# Scoped to the quiz by its CSS class. Each choice row is a Checkbox: let its label wrap beside
# the selector (flex; the selector neither shrinks nor centres itself on a long label), and
# draw the selector as a radio button, since only one choice can be selected. ipywidgets sets
# the label's `title` to the raw description, HTML tags and all: with pointer events off on
# the text, hovering shows no such tooltip, and a click lands on the <label>, which toggles
# its input as before.
_CSS = """<style>
.labkit-quiz .widget-html-content {line-height: 1.45;}
.labkit-quiz .labkit-quiz-choice {height: auto; width: 100%; margin: 0 0 0.35em 0;}
.labkit-quiz .labkit-quiz-choice label.widget-label-basic {
  display: flex; align-items: flex-start; gap: 0.5em; height: auto; width: 100%;
  white-space: normal; overflow: visible; line-height: 1.45; cursor: pointer;}
.labkit-quiz .labkit-quiz-choice label.widget-label-basic > span {pointer-events: none;}
.labkit-quiz .labkit-quiz-choice input[type="checkbox"] {
  appearance: none; -webkit-appearance: none; flex: none; align-self: flex-start; font: inherit;
  box-sizing: border-box; width: 1em; height: 1em; margin: 0.22em 0 0 0;
  border: 1px solid #767676; border-radius: 50%; background: #fff; cursor: pointer;}
.labkit-quiz .labkit-quiz-choice input[type="checkbox"]:checked {
  border: 0.3em solid var(--jp-brand-color1, #1976d2);}
.labkit-quiz .labkit-quiz-feedback {margin: 0.2em 0 0.4em 0;}
</style>"""


def widget(bank: Bank | str | int) -> Any:
    """The whole quiz as an ipywidgets VBox: a heading, then one :func:`question_widget` each."""
    import ipywidgets as w

    bank = _bank(bank)
    heading = w.HTML(f"{_CSS}<h3>Quiz {bank.notebook}: {html.escape(bank.title)}</h3>")
    box = w.VBox([heading, *(question_widget(q, n) for n, q in enumerate(bank.questions, start=1))])
    box.add_class("labkit-quiz")
    return box


class QuizView:
    """What :func:`show` displays: the widget, with :func:`as_html` and :func:`as_text` as its
    fallbacks.

    Front ends that render widgets pick the widget; a static page of the executed notebook (the
    rendered course, a notebook viewer) shows ``text/html``, answers folded; nbval and a
    terminal read ``text/plain``.
    """

    def __init__(self, bank: Bank) -> None:
        self.bank = bank
        self.widget = widget(bank)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict:
        data = dict(self.widget._repr_mimebundle_(include=include, exclude=exclude) or {})
        data["text/plain"] = as_text(self.bank)
        # Where widgets cannot render but HTML can (a static page of the executed notebook),
        # the quiz stays readable with its answers folded; a live front end picks the widget.
        data["text/html"] = as_html(self.bank)
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
