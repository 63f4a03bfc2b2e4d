"""What the quiz banks promise about the course, checked against the notebooks (issue 30, item 4).

- Every question's ``section`` teaches its answer: each of its ``concept`` terms (which the loader
  has already found in the answer or the explanation) appears in that section's markdown or code
  in ``solutions/NN_*.ipynb``, the text from its ``## `` heading to the next one. A heading that
  merely exists is not enough (review EXAM-2: half of bank 00 pointed at sections that never
  mention what the question asks).
- Items about the course's own machinery are tagged ``course`` and the mock exam leaves them out
  (review EXAM-3).
- In no bank is the key the shortest option, or the longest, more often than chance allows
  (a one-sided exact binomial test at ``ALPHA``; review N05-12: bank 05's key was the shortest
  in 11 of 21 items). ``tests/test_quizbank.py`` tests the longest over all banks together; this
  tests each bank, both ways.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_quizbank import ALPHA, shown_length, tail_probability

from labkit.course import exam, quiz

BANKS = quiz.available()
SOLUTIONS = Path(__file__).resolve().parents[1] / "solutions"


def section_texts(cells: list[dict]) -> dict[str, str]:
    """Heading (without ``## ``) -> the markdown and code from that heading to the next ``## ``
    heading, as :func:`labkit.course.quiz.plain` compares it. Text before the first heading belongs to
    no section."""
    out: dict[str, list[str]] = {}
    current = None
    for cell in cells:
        source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        for line in source.splitlines():
            if cell["cell_type"] == "markdown" and line.startswith("## "):
                current = line[3:].strip()
                out[current] = []
            elif current is not None and cell["cell_type"] in ("markdown", "code"):
                out[current].append(line)
    return {heading: quiz.plain("\n".join(lines)) for heading, lines in out.items()}


def notebook_sections(notebook: str) -> dict[str, str]:
    (path,) = SOLUTIONS.glob(f"{notebook}_*.ipynb")
    return section_texts(json.loads(path.read_text(encoding="utf-8"))["cells"])


def untaught(bank: quiz.Bank, sections: dict[str, str]) -> dict[str, str]:
    """Question id -> what is wrong, for every question whose section does not teach its
    concept: a missing section, or the concept terms the section never mentions."""
    problems = {}
    for q in bank.questions:
        if q.section not in sections:
            problems[q.id] = f"no section {q.section!r}"
            continue
        missing = [t for t in q.concept if quiz.plain(t) not in sections[q.section]]
        if missing:
            problems[q.id] = f"section {q.section!r} never mentions {missing}"
    return problems


@pytest.mark.parametrize("notebook", BANKS)
def test_every_question_points_to_a_section_that_teaches_its_answer(notebook):
    problems = untaught(quiz.load(notebook), notebook_sections(notebook))
    assert not problems, (
        f"bank {notebook}: {problems}. Point the question to the section that teaches it, move "
        "it to the bank whose notebook does, or rewrite it to what the notebook teaches."
    )


def _q(**changes) -> quiz.Question:
    q = dict(id="05.demo", question="Which?", choices=["the ring all-reduce", "a tree", "a star"],
             answer=0, why_wrong=[None, "no", "no"], explanation="A ring all-reduce (NCCL docs).",
             domain=quiz.DOMAINS[0], section="1. Rings", concept=["ring all-reduce"])  # fmt: skip
    q.update(changes)
    return quiz.Question(**q)


def test_the_concept_rule_reads_the_section_not_the_heading():
    cells = [
        {"cell_type": "markdown", "source": "# Title: a ring all-reduce\n\n## 1. Rings\n\nA ring."},
        {"cell_type": "code", "source": ["x = 1  # nothing\n"]},
        {"cell_type": "markdown", "source": "## 2. Trees\n\nEvery **ring\nall-reduce** is..."},
    ]
    sections = section_texts(cells)
    assert set(sections) == {"1. Rings", "2. Trees"}  # the title's text belongs to no section
    bank = quiz.Bank("05", "Demo", (_q(),))
    # The term is in the notebook (the title, section 2) but not in section 1: not taught there.
    assert untaught(bank, sections) == {
        "05.demo": "section '1. Rings' never mentions ['ring all-reduce']"
    }
    # Markdown emphasis aside, a term broken over two lines of the section still counts.
    moved = quiz.Bank("05", "Demo", (_q(section="2. Trees"),))
    assert untaught(moved, sections) == {}
    gone = quiz.Bank("05", "Demo", (_q(section="3. Stars"),))
    assert untaught(gone, sections) == {"05.demo": "no section '3. Stars'"}


def test_a_concept_must_come_from_the_key_or_the_explanation():
    with pytest.raises(quiz.QuizBankError, match=r"concept terms \['star'\] appear in neither"):
        _q(concept=["star"])  # a distractor's word is not the key's concept
    with pytest.raises(quiz.QuizBankError, match=r"concept=\[\] is not allowed"):
        _q(concept=[])


# --- course items and the exam ----------------------------------------------------------------

COURSE = {"00.importable_workers", "00.orphan_workers", "00.ring_wire_bytes"}


def test_course_plumbing_is_tagged_and_left_out_of_the_exam():
    tagged = {q.id for nb in BANKS for q in quiz.load(nb).questions if q.course}
    assert COURSE <= tagged, "review EXAM-3's items are tagged course"
    in_pool = {q.id for qs in exam.pool().values() for q in qs}
    assert not tagged & in_pool
    everything = sum(len(qs) for qs in exam.pool().values())
    drawn = {q.id for q in exam.draw(everything, seed=3).questions}
    assert not tagged & drawn and len(drawn) == everything
    with pytest.raises(exam.ExamError, match=f"at most {everything}"):
        exam.draw(everything + 1)


def test_a_bad_tag_is_refused():
    with pytest.raises(quiz.QuizBankError, match=r"tags=\['certified'\] is not allowed"):
        _q(tags=["certified"])
    assert _q(tags=["course"]).course and not _q().course


# --- the key's length, bank by bank --------------------------------------------------------------


def key_extremes(questions: list[dict]) -> tuple[list[str], list[str]]:
    """(ids whose key is strictly the shortest option, ids whose key is strictly the longest)."""
    shortest, longest = [], []
    for q in questions:
        lengths = [shown_length(c) for c in q["choices"]]
        key = lengths.pop(q["answer"])
        shortest += [q["id"]] * (key < min(lengths))
        longest += [q["id"]] * (key > max(lengths))
    return shortest, longest


def length_problems(name: str, questions: list[dict]) -> list[str]:
    chances = [1 / len(q["choices"]) for q in questions]
    problems = []
    for which, ids in zip(("shortest", "longest"), key_extremes(questions), strict=True):
        p = tail_probability(chances, len(ids))
        if p < ALPHA:
            problems.append(f"bank {name}: the key is the {which} option in {len(ids)} of "
                            f"{len(questions)} items ({', '.join(ids)}): P = {p:.2g} under "
                            f"chance, below {ALPHA}")  # fmt: skip
    return problems


@pytest.mark.parametrize("notebook", BANKS)
def test_no_bank_rewards_picking_the_shortest_or_the_longest_option(notebook):
    raw = json.loads((quiz.BANK_DIR / f"{notebook}.json").read_text(encoding="utf-8"))
    assert length_problems(notebook, raw["questions"]) == []


def _items(n: int, short_keys: int) -> list[dict]:
    items = []
    for i in range(n):
        choices = ["option one", "option two", "option six", "option ten"]
        if i < short_keys:
            choices[0] = "one"  # the key, the shortest
        items.append({"id": f"05.i{i}", "choices": choices, "answer": 0})
    return items


def test_the_length_rule_fails_on_bank_05_as_it_was():
    # Review N05-12: the key was the shortest option in 11 of 21 items.
    problems = length_problems("05", _items(21, 11))
    assert len(problems) == 1 and "shortest option in 11 of 21 items" in problems[0], problems
    assert length_problems("05", _items(21, 6)) == []  # about chance (21/4 = 5.25)
