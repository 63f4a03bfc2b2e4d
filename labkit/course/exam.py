"""A mock exam drawn from every notebook's quiz bank, scored by certification sub-topic.

    from labkit.course import exam
    exam.show(n=30)                      # in a notebook: widgets, no feedback until Finish

    python -m labkit exam -n 30                   # the same in a terminal (60 minutes)
    python -m labkit exam -n 30 --minutes 0       # untimed
    python -m labkit exam --history               # earlier attempts, score per sub-topic

How an exam is drawn (:func:`draw`): every question of every bank (``labkit/course/quizbank/NN.json``)
is tagged with one sub-topic of :data:`labkit.course.quiz.DOMAINS`; questions tagged ``course`` check
the course's own machinery and are left out (they stay in the notebooks' quizzes). The ``n`` questions are shared
out among the sub-topics in proportion to their *weights* (largest remainder, never more than a
sub-topic holds; what one cannot take goes to the others), then drawn at random inside each
sub-topic and shuffled. The default weight of a sub-topic is the number of questions the banks
hold for it: NVIDIA publishes the exams' areas, and third-party guides disagree on how much
each weighs, so the course assumes no weights of its own. An instructor who trusts a set of
weights passes them (``weights={sub-topic: weight}``).

While it runs (:class:`Attempt`) nothing says whether an answer is right, and no question
shows its sub-topic (a certification exam does not); answers are refused once the time limit
has passed, and questions left unanswered count as wrong. The time limit defaults to
:data:`MINUTES_PER_QUESTION` per question. The
:class:`Result` gives the score per sub-topic and, for each notebook with a missed question,
the notebook to revisit, the sections of it that teach the missed questions (each with how many
were missed there) and the questions' sub-topics and explanations. Each result is appended to a JSON
file under labkit's cache folder (:func:`results_path`), so a learner sees progress over
attempts; a results file that cannot be read is set aside under a new name (never silently
overwritten), and one that cannot be written is named with the fix.
"""

from __future__ import annotations

import datetime as _dt
import html
import json
import math
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from labkit import ids
from labkit.course import quiz
from labkit.course.quiz import DOMAINS, LETTERS, Question
from labkit.errors import LabkitError
from labkit.jobs import procs
from labkit.validate import whole

RESULTS_VERSION = 1


FEW = 5
"""Below this many questions a sub-topic's score is shown as a count, not a percentage: one
question more or less right moves it by 20 points or more."""

MINUTES_PER_QUESTION = 2.0
"""The default pace, near the real exam's. Third-party descriptions of NCP-GENL, which are
unofficial, give 60-70 questions in 120 minutes, about 1.7-2 minutes a question (e.g.
https://preporato.com/certifications/nvidia/generative-ai-llm-professional/articles/ncp-genl-exam-domains-complete-breakdown-2026,
unofficial); the course takes the upper end."""


MAX_MINUTES = 24 * 60.0
"""The longest time limit an exam takes: a day. A longer one is a typo (``--minutes 1e9``), and
an infinite one has no clock to show (``--minutes inf``); untimed is ``minutes=None`` (``--minutes
0``). At :data:`MINUTES_PER_QUESTION` it paces exams of up to 720 questions."""


def _allowed_minutes(minutes: object) -> bool:
    """A time limit :func:`draw` takes: a number of minutes in (0, :data:`MAX_MINUTES`]."""
    return (isinstance(minutes, (int, float)) and not isinstance(minutes, bool)
            and math.isfinite(minutes) and 0 < minutes <= MAX_MINUTES)  # fmt: skip


def default_minutes(n: int) -> float:
    """The time limit of an ``n``-question exam at :data:`MINUTES_PER_QUESTION` (at most
    :data:`MAX_MINUTES`)."""
    return min(MINUTES_PER_QUESTION * n, MAX_MINUTES)

class ExamError(ValueError, LabkitError):
    """An exam that cannot be drawn, answered or saved as asked; the message says why and what
    to do instead."""


class TimeUp(ExamError):
    """An answer given after the exam's time limit."""


# --------------------------------------------------------------------------- the draw


def pool(notebooks: Sequence[str] | None = None) -> dict[str, list[Question]]:
    """Every question of the banks of ``notebooks`` (default: all), by sub-topic (all of
    :data:`DOMAINS`, in that order; a sub-topic no bank covers has an empty list). Questions
    tagged ``course`` (checks on the course's own machinery) are left out."""
    chosen = quiz.available() if notebooks is None else [str(nb) for nb in notebooks]
    unknown = sorted(set(chosen) - set(quiz.available()))
    if unknown:
        raise ExamError(f"notebooks={unknown} have no quiz bank; available: {quiz.available()}")
    by_topic: dict[str, list[Question]] = {d: [] for d in DOMAINS}
    for nb in chosen:
        for q in quiz.load(nb).questions:
            if not q.course:
                by_topic[q.domain].append(q)
    return by_topic


def allocate(n: int, available: Mapping[str, int], weights: Mapping[str, float]) -> dict[str, int]:
    """How many of ``n`` questions each sub-topic gets: in proportion to ``weights`` by the
    largest-remainder method, capped at what each sub-topic has (``available``); a cap's
    leftover is shared among the others the same way. Ties go to the earlier sub-topic."""
    total_available = sum(available.values())
    if n > total_available:
        raise ExamError(f"n={n} questions asked, but the chosen banks hold {total_available}: "
                        f"ask for at most {total_available}")  # fmt: skip
    counts = {t: 0 for t in available}
    left = n
    open_topics = [t for t in available if available[t] > 0 and weights.get(t, 0) > 0]
    while left > 0:
        if not open_topics:
            raise ExamError(f"the weighted sub-topics hold too few questions for n={n}: give a "
                            "weight to more sub-topics, or ask for fewer questions")  # fmt: skip
        w_total = sum(weights[t] for t in open_topics)
        shares = {t: left * weights[t] / w_total for t in open_topics}
        give = {t: math.floor(s) for t, s in shares.items()}
        order = sorted(open_topics, key=lambda t: (-(shares[t] - give[t]), open_topics.index(t)))
        for t in order[: left - sum(give.values())]:
            give[t] += 1
        for t in open_topics:
            take = min(give[t], available[t] - counts[t])
            counts[t] += take
            left -= take
        open_topics = [t for t in open_topics if counts[t] < available[t]]
    return counts


@dataclass(frozen=True)
class Exam:
    """The questions of one exam, in the order asked, and its rules."""

    questions: tuple[Question, ...]
    seed: int
    time_limit_s: float | None
    """None: untimed."""
    per_topic: dict[str, int]
    """Sub-topic -> how many of the questions it got."""


def draw(
    n: int = 30,
    *,
    seed: int | None = None,
    minutes: float | None = None,
    weights: Mapping[str, float] | None = None,
    notebooks: Sequence[str] | None = None,
) -> Exam:
    """Draw ``n`` questions (see the module docstring). ``seed`` makes the draw repeatable (an
    instructor can hand everyone the same exam); ``minutes`` is the time limit (None: none)."""
    n = whole("n", n, low=1, why="a number of questions", error=ExamError)
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    else:
        seed = whole("seed", seed, low=0, why="or None for a fresh one", error=ExamError)
    if minutes is not None and not _allowed_minutes(minutes):
        raise ExamError(f"minutes={minutes!r} is not allowed: a positive number of minutes up "
                        f"to {MAX_MINUTES:g} (a day), or None for no time limit")  # fmt: skip
    by_topic = pool(notebooks)
    available = {t: len(qs) for t, qs in by_topic.items()}
    if weights is None:
        weights = {t: float(k) for t, k in available.items()}
    else:
        unknown = sorted(set(weights) - set(DOMAINS))
        bad = {t: w for t, w in weights.items() if not (isinstance(w, (int, float)) and w >= 0)}
        if unknown or bad:
            raise ExamError(f"weights: unknown sub-topics {unknown}, negative or non-numeric "
                            f"weights {bad}; the sub-topics are {list(DOMAINS)}")  # fmt: skip
    counts = allocate(n, available, weights)
    rng = random.Random(seed)
    questions = [q for t in DOMAINS for q in rng.sample(by_topic[t], counts.get(t, 0))]
    rng.shuffle(questions)
    return Exam(tuple(questions), seed, None if minutes is None else 60.0 * minutes,
                {t: k for t, k in counts.items() if k})


# --------------------------------------------------------------------------- taking it


@dataclass
class Result:
    """A finished exam: what was asked and answered, and the score per sub-topic."""

    seed: int
    questions: tuple[Question, ...]
    answers: tuple[int | None, ...]
    elapsed_s: float
    time_limit_s: float | None
    timed_out: bool
    finished_at: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc)
                             .isoformat(timespec="seconds"))  # fmt: skip

    @property
    def right(self) -> tuple[bool, ...]:
        return tuple(a == q.answer for q, a in zip(self.questions, self.answers, strict=True))

    @property
    def score(self) -> tuple[int, int]:
        """(right, asked)."""
        return sum(self.right), len(self.questions)

    def by_topic(self) -> dict[str, tuple[int, int]]:
        """Sub-topic -> (right, asked), for the sub-topics this exam asked about."""
        out: dict[str, list[int]] = {}
        for q, ok in zip(self.questions, self.right, strict=True):
            tally = out.setdefault(q.domain, [0, 0])
            tally[0] += ok
            tally[1] += 1
        return {t: (out[t][0], out[t][1]) for t in DOMAINS if t in out}

    def revisit(self) -> dict[str, list[Question]]:
        """Notebook -> the questions missed from its bank (unanswered ones included)."""
        out: dict[str, list[Question]] = {}
        for q, ok in zip(self.questions, self.right, strict=True):
            if not ok:
                out.setdefault(ids.of(q.id), []).append(q)
        return dict(sorted(out.items()))

    def as_text(self) -> str:
        right, asked = self.score
        lines = [f"Score: {right}/{asked} ({right / asked:.0%}) in {_clock(self.elapsed_s)}"
                 + (" (time ran out: unanswered questions count as wrong)" if self.timed_out
                    else ""),
                 "", "By sub-topic (indicative: each rests on a handful of questions):"]  # fmt: skip
        for topic, (r, k) in self.by_topic().items():
            share = f"{r / k:>5.0%}" if k >= FEW else " " * 5  # 1 of 2 is not "50%"
            lines.append(f"  {r:>3}/{k:<3} {share}  {topic}"
                         + (f" ({k} question{'s' * (k > 1)}: too few for a percentage)"
                            if k < FEW else ""))  # fmt: skip
        missed = self.revisit()
        if missed:
            lines += ["", "To revisit:"]
            for nb, qs in missed.items():
                lines.append(f"  notebook {nb} ({quiz.load(nb).title}):")
                for section, k in Counter(q.section for q in qs).most_common():
                    lines.append(f'    section "{section}": {k} question{"s" * (k > 1)} missed')
                for q in qs:
                    a = self.answers[self.questions.index(q)]
                    given = "no answer" if a is None else f"you chose {LETTERS[a]})"
                    lines.append(f"    - {q.id} [{q.domain}]: {given}; the answer is "
                                 f"{LETTERS[q.answer]}) {q.choices[q.answer]}. "
                                 f"{q.explanation}")  # fmt: skip
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        right, asked = self.score
        return {
            "finished_at": self.finished_at, "seed": self.seed, "right": right, "asked": asked,
            "elapsed_s": round(self.elapsed_s, 1), "time_limit_s": self.time_limit_s,
            "timed_out": self.timed_out,
            "by_topic": {t: list(v) for t, v in self.by_topic().items()},
            "questions": [q.id for q in self.questions], "answers": list(self.answers),
        }  # fmt: skip


class Attempt:
    """One learner taking an :class:`Exam`: answers are recorded without feedback, refused
    after the time limit, and scored by :meth:`finish`. ``clock`` (seconds, monotonic) is
    there for tests."""

    def __init__(self, exam: Exam, clock: Callable[[], float] = time.monotonic) -> None:
        self.exam = exam
        self._clock = clock
        self._start = clock()
        self.answers: list[int | None] = [None] * len(exam.questions)
        self.result: Result | None = None

    def time_left_s(self) -> float | None:
        if self.exam.time_limit_s is None:
            return None
        return max(0.0, self.exam.time_limit_s - (self._clock() - self._start))

    def answer(self, index: int, choice: int | None) -> None:
        """Record ``choice`` (0-based index, or None to clear) for question ``index``."""
        n = len(self.exam.questions)
        whole("index", index, low=0, high=n - 1, why="a question's number", error=ExamError)
        if self.result is not None:
            raise ExamError("this exam is finished: draw a new one to try again")
        if self.time_left_s() == 0.0:
            raise TimeUp(f"time is up ({_clock(self.exam.time_limit_s or 0)}): this answer is "
                         "not counted; finish the exam to see the score")  # fmt: skip
        if choice is not None:
            k = len(self.exam.questions[index].choices)
            whole("choice", choice, low=0, high=k - 1, error=ExamError,
                  why=f"question {index + 1}'s a to {LETTERS[k - 1]}, or None to leave it "
                  "unanswered")  # fmt: skip
        self.answers[index] = choice

    def finish(self) -> Result:
        """Score the exam (once; later calls return the same result)."""
        if self.result is None:
            elapsed = self._clock() - self._start
            limit = self.exam.time_limit_s
            self.result = Result(self.exam.seed, self.exam.questions, tuple(self.answers),
                                 elapsed, limit, limit is not None and elapsed >= limit)
        return self.result


def _clock(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s"


# --------------------------------------------------------------------------- results on disk


def results_path() -> Path:
    """Where results are kept: ``exam/results.json`` under labkit's cache folder
    (``$LABKIT_HOME``, else ``~/.cache/labkit``)."""
    return procs.labkit_home() / "exam" / "results.json"


def load_history(path: Path | None = None) -> tuple[list[dict[str, Any]], str | None]:
    """Earlier results, oldest first, and a note when the file could not be read: it is then
    moved aside to ``results.json.corrupt-<time>`` (kept for the learner, never overwritten)
    and the history starts afresh."""
    path = results_path() if path is None else Path(path)
    if not path.exists():
        return [], None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        attempts = raw["attempts"]
        if raw.get("version") != RESULTS_VERSION or not isinstance(attempts, list) or not all(
            isinstance(a, dict) and isinstance(a.get("right"), int) for a in attempts
        ):
            raise ValueError("not a labkit exam results file")
        return attempts, None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        aside = path.with_name(f"{path.name}.corrupt-{stamp}")
        n = 1
        while aside.exists():  # never over an earlier one set aside in the same second
            n += 1
            aside = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
        try:
            os.replace(path, aside)
        except OSError as move_err:
            raise ExamError(f"{path} cannot be read ({err}) nor moved aside ({move_err}): move "
                            "or delete it, or set LABKIT_HOME to another folder") from None
        return [], (f"{path} could not be read ({type(err).__name__}: {err}); it was moved to "
                    f"{aside.name} and the history starts afresh")  # fmt: skip


def save_result(result: Result, path: Path | None = None) -> tuple[Path, str | None]:
    """Append ``result`` to the history file; returns the path and :func:`load_history`'s
    note, if any. Written to a temporary file and renamed, so an interrupted save leaves the
    old history whole."""
    path = results_path() if path is None else Path(path)
    attempts, note = load_history(path)
    attempts.append(result.to_json())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"version": RESULTS_VERSION, "attempts": attempts}, indent=1)
                       + "\n", encoding="utf-8")  # fmt: skip
        os.replace(tmp, path)
    except OSError as err:
        raise ExamError(f"cannot save the result to {path}: {err.strerror or err}; set "
                        "LABKIT_HOME to a folder you can write to (the score above stands)"
                        ) from None  # fmt: skip
    return path, note


def progress_text(attempts: Sequence[Mapping[str, Any]]) -> str:
    """One line per attempt, oldest first: date, score, and each sub-topic's share right."""
    if not attempts:
        return "No earlier attempts.\n"
    short = {t: t.split(": ", 1)[-1] for t in DOMAINS}
    lines = [f"{len(attempts)} attempt(s):"]
    for i, a in enumerate(attempts, start=1):
        parts = [f"{short.get(t, t)} {r}/{k}" for t, (r, k) in a.get("by_topic", {}).items()]
        lines.append(f"  {i:>2}. {a.get('finished_at', '?')[:16]}  {a['right']}/{a['asked']}  "
                     + "; ".join(parts))  # fmt: skip
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the terminal


def run_in_terminal(exam: Exam, ask: Callable[[str], str] | None = None,
                    out: Callable[[str], None] = print,
                    clock: Callable[[], float] = time.monotonic) -> Result:  # fmt: skip
    """Ask every question in turn (a letter, or Enter to skip), then print the score.

    Input that is not one of the question's letters is asked again, saying what is allowed;
    an answer typed after the time limit is not counted and ends the exam."""
    ask = input if ask is None else ask  # looked up now, so a test can replace input
    attempt = Attempt(exam, clock)
    limit = exam.time_limit_s
    out(f"Mock exam: {len(exam.questions)} questions, seed {exam.seed}, "
        + (f"{_clock(limit)}." if limit else "no time limit.")
        + " No feedback until the end; Enter skips a question.\n")  # fmt: skip
    for i, q in enumerate(exam.questions):
        out(f"{i + 1}. {q.question}")  # no sub-topic while it runs: the result names it
        for j, c in enumerate(q.choices):
            out(f"   {LETTERS[j]}) {c}")
        allowed = LETTERS[: len(q.choices)]
        while True:
            left = attempt.time_left_s()
            prompt = f"answer ({'/'.join(allowed)}, Enter to skip)"
            reply = ask(prompt + (f" [{_clock(left)} left]: " if left is not None else ": "))
            reply = reply.strip().lower().rstrip(")")
            if reply == "" or (len(reply) == 1 and reply in allowed):
                break
            out(f"   '{reply}' is not one of {', '.join(allowed)}: type a letter, or press "
                "Enter to skip")  # fmt: skip
        try:
            attempt.answer(i, None if reply == "" else allowed.index(reply))
        except TimeUp as err:
            out(f"\n{err}")
            break
        out("")
    result = attempt.finish()
    out(result.as_text())
    return result


def _minutes_option(text: str | None) -> float | None:
    """``--minutes`` as :func:`draw` takes it: None for 0 (untimed) or when absent; a value
    outside 0..MAX_MINUTES, or not a number, is refused naming the option as typed."""
    if text is None:
        return None
    try:
        minutes = float(text)
    except ValueError:
        minutes = math.nan
    if minutes == 0:
        return None  # --minutes 0: untimed
    if not _allowed_minutes(minutes):
        raise ExamError(f"--minutes {text} is not allowed: give a time limit in minutes from "
                        f"more than 0 up to {MAX_MINUTES:g} (a day), or 0 for no time "
                        "limit")  # fmt: skip
    return minutes


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m labkit exam``: take a mock exam in the terminal, or show the history."""
    import argparse

    parser = argparse.ArgumentParser(prog="labkit exam", description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=30, help="number of questions (default 30)")
    parser.add_argument("--minutes", default=None,  # read by _minutes_option, named as typed
                        help=f"time limit in minutes, up to {MAX_MINUTES:g} (default "
                             f"{MINUTES_PER_QUESTION:g} per question, near the real exam's "
                             "pace; 0 for none)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=None, help="repeat a draw (default: fresh)")
    parser.add_argument("--history", action="store_true", help="show earlier attempts and stop")
    args = parser.parse_args(argv)
    try:
        if args.history:
            attempts, note = load_history()
            if note:
                print(note)
            print(progress_text(attempts), end="")
            return 0
        minutes = _minutes_option(args.minutes)
        if args.minutes is None and isinstance(args.n, int) and args.n >= 1:
            minutes = default_minutes(args.n)
        exam = draw(args.n, seed=args.seed, minutes=minutes)
        try:
            result = run_in_terminal(exam)
        except (EOFError, KeyboardInterrupt):
            print("\nexam abandoned: nothing saved")
            return 1
        path, note = save_result(result)
        if note:
            print(note)
        print(f"saved to {path}")
        print(progress_text(load_history(path)[0]), end="")
        return 0
    except ExamError as err:
        print(f"labkit exam: {err}")
        return 2


# --------------------------------------------------------------------------- the notebook


class ExamWidget:
    """The exam as widgets: each question's choices (one selectable, no feedback), the time
    left at the last answer, and a Finish button that scores, saves and shows the result."""

    def __init__(self, exam: Exam, save: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        import ipywidgets as w

        self.attempt = Attempt(exam, clock)
        self.save = save
        self._setting = False  # True while the widget itself sets boxes
        self.rows: list[list[Any]] = []
        items: list[Any] = []
        for i, q in enumerate(exam.questions):
            items.append(quiz.question_heading(q, i + 1, tag=False))  # the result names it
            row = quiz.choice_rows(q)
            for j, box in enumerate(row):
                box.observe(lambda ch, i=i, j=j: self._on_pick(i, j, ch["new"]), names="value")
            self.rows.append(row)
            items += row
        limit = exam.time_limit_s
        self.status = w.HTML(f"<p>{len(exam.questions)} questions, "
                             + (f"{_clock(limit)}" if limit else "no time limit")
                             + ". No feedback until you press Finish.</p>")  # fmt: skip
        self.finish_button = w.Button(description="Finish", button_style="primary")
        self.finish_button.on_click(lambda _b: self.finish())
        self.result = w.HTML("")
        self.box = w.VBox([w.HTML(quiz._CSS), self.status, *items, self.finish_button,
                           self.result])  # fmt: skip
        self.box.add_class("labkit-quiz")

    def pick(self, index: int, choice: int) -> None:
        """Select ``choice`` for question ``index`` as a click does."""
        self.rows[index][choice].value = True

    def unpick(self, index: int, choice: int) -> None:
        """Clear ``choice`` for question ``index`` as a second click does."""
        self.rows[index][choice].value = False

    def _show(self, i: int, choice: int | None) -> None:
        """Tick exactly ``choice`` in row ``i`` (none for None), without counting as clicks."""
        self._setting = True
        try:
            for k, box in enumerate(self.rows[i]):
                box.value = k == choice
        finally:
            self._setting = False

    def _on_pick(self, i: int, j: int, checked: bool) -> None:
        """A click on choice j of question i: what the boxes show is what counts."""
        if self.attempt.result is not None or self._setting:
            return
        recorded = self.attempt.answers[i]
        choice = j if checked else (None if recorded == j else recorded)
        try:
            self.attempt.answer(i, choice)
        except TimeUp as err:
            self._show(i, recorded)  # the late click does not count: show the answer that does
            self.status.value = f"<p><b>{html.escape(str(err))}</b></p>"
            return
        self._show(i, choice)
        left = self.attempt.time_left_s()
        if left is not None:
            self.status.value = f"<p>{_clock(left)} left.</p>"

    def finish(self) -> Result:
        result = self.attempt.finish()
        for row in self.rows:
            for box in row:
                box.disabled = True
        self.finish_button.disabled = True
        text = result.as_text()
        if self.save:
            try:
                path, note = save_result(result)
                text += (f"\n{note}" if note else "") + f"\nsaved to {path}\n"
                text += progress_text(load_history(path)[0])
            except ExamError as err:
                text += f"\n{err}\n"
        self.result.value = f"<pre style='white-space:pre-wrap'>{html.escape(text)}</pre>"
        return result


def show(n: int = 30, *, minutes: float | Literal["pace"] | None = "pace", seed: int | None = None,
         weights: Mapping[str, float] | None = None, save: bool = True) -> ExamWidget | Result:
    """Draw an exam and show it: widgets in a Jupyter kernel (returned, so a cell can read
    ``.attempt``), else the terminal exam (returns its result). ``minutes``: the time limit;
    ``"pace"`` (default) gives :data:`MINUTES_PER_QUESTION` per question, None none."""  # fmt: skip
    if minutes == "pace":
        minutes = default_minutes(n) if isinstance(n, int) and not isinstance(n, bool) else None
    exam = draw(n, seed=seed, minutes=minutes, weights=weights)
    if quiz._in_kernel():
        from IPython.display import display

        view = ExamWidget(exam, save=save)
        display(view.box)
        return view
    result = run_in_terminal(exam)
    if save:
        save_result(result)
    return result
