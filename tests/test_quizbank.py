"""How well the quiz items are written, over every bank in ``labkit/course/quizbank``.

``labkit.course.quiz`` validates a bank's *format* when it loads. These checks are about the *items*,
the flaws an exam writer would send back (a multiple-choice item-writing guide such as
Haladyna, Downing and Rodriguez 2002, "A review of multiple-choice item-writing guidelines"):

- the key is not conspicuously the longest option: per item, not more than
  ``MAX_KEY_TO_DISTRACTOR`` times the longest distractor; over all items, not the longest
  far more often than chance (a one-sided exact binomial test, chance being 1/len(choices)
  per item, at ``ALPHA``);
- the key does not sit in one position in most items;
- every wrong choice says why it is wrong (``why_wrong``);
- explanations and feedback cite sources a learner can open, never the course's internal
  notes (``INTERNAL_SOURCES``), and every explanation names at least one public source;
- every tag is one of the certification sub-topics, ``quiz.DOMAINS``.

The checker reads the raw JSON, not a loaded bank, so that it judges even a bank the loader
would refuse; each rule is shown to fail on a small bad bank below.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections import Counter
from pathlib import Path

import pytest

from labkit.course import quiz

BANKS = [quiz.BANK_DIR / f"{nb}.json" for nb in quiz.available()]

MAX_KEY_TO_DISTRACTOR = 1.5
ALPHA = 0.05
INTERNAL_SOURCES = (
    "facts table",
    "facts.md",
    "course design",
    "course-design",
    "course notes",
    "pitfalls",
    "shared/",
    "style.md",
)
# What a public citation looks like: an arXiv id, a URL, an issue or pull-request number, a
# file in a repository, or a named documentation page, datasheet, manual page or paper.
PUBLIC_SOURCE = re.compile(
    r"arXiv \d{4}\.\d{4,5}|https?://|#\d+|\b[\w/.-]+\.(?:py|md|rst|h|c|cc|cu)\b"
    r"|\bdocs\b|documentation|datasheet|API reference|\bman \d|\bpaper\b|\brecipe\b",
    re.IGNORECASE,
)


def shown_length(text: str) -> int:
    """Characters a learner sees: backticks render as code and take no space."""
    return len(text.replace("`", ""))


def key_and_longest_distractor(q: dict) -> tuple[int, int]:
    lengths = [shown_length(c) for c in q["choices"]]
    key = lengths.pop(q["answer"])
    return key, max(lengths)


def key_is_longest(q: dict) -> bool:
    """Strictly longer than every distractor (a tie does not count)."""
    key, longest_distractor = key_and_longest_distractor(q)
    return key > longest_distractor


def tail_probability(chances: list[float], observed: int) -> float:
    """P(X ≥ observed) for X the number of successes in independent trials with ``chances``.

    The exact Poisson-binomial distribution, by dynamic programming over the trials (items
    may have different numbers of choices, so their chances differ).
    """
    dist = [1.0]  # dist[k] = P(k successes so far)
    for p in chances:
        dist = [
            (dist[k] if k < len(dist) else 0.0) * (1 - p) + (dist[k - 1] * p if k else 0.0)
            for k in range(len(dist) + 1)
        ]
    return math.fsum(dist[observed:])


def item_problems(where: str, q: dict) -> list[str]:
    """Everything wrong with one raw question (a dict from a bank's JSON)."""
    problems = []
    qid = f"{where}: question {q.get('id')!r}"
    choices, answer = q["choices"], q["answer"]
    key, longest_distractor = key_and_longest_distractor(q)
    if key > MAX_KEY_TO_DISTRACTOR * longest_distractor:
        problems.append(
            f"{qid}: the key ({key} characters) is {key / longest_distractor:.1f}× the longest "
            f"distractor ({longest_distractor}); at most {MAX_KEY_TO_DISTRACTOR}× is allowed"
        )
    if q.get("domain") not in quiz.DOMAINS:
        problems.append(f"{qid}: domain={q.get('domain')!r} is not one of quiz.DOMAINS")
    why_wrong = q.get("why_wrong")
    if not isinstance(why_wrong, list):
        why_wrong = []
    if len(why_wrong) != len(choices):
        problems.append(f"{qid}: why_wrong needs one entry per choice ({len(choices)})")
    else:
        for i, why in enumerate(why_wrong):
            if i != answer and not (isinstance(why, str) and why.strip()):
                problems.append(f"{qid}: why_wrong[{i}] is empty: say why choice {i} is wrong")
    texts = {"explanation": q.get("explanation") or ""}
    texts.update({f"why_wrong[{i}]": w for i, w in enumerate(why_wrong) if isinstance(w, str)})
    for field, text in texts.items():
        for phrase in INTERNAL_SOURCES:
            if phrase in text.lower():
                problems.append(
                    f"{qid}: {field} cites {phrase!r}, which learners cannot open: cite a "
                    "paper, a documentation page or a public source file"
                )
    if not PUBLIC_SOURCE.search(texts["explanation"]):
        problems.append(f"{qid}: the explanation names no public source")
    return problems


def bank_problems(banks: dict[str, dict]) -> list[str]:
    """Every item's problems, then the checks over all items of all ``banks`` together."""
    problems: list[str] = []
    items = []
    for where, bank in banks.items():
        for q in bank["questions"]:
            problems += item_problems(where, q)
            items.append(q)
    longest = [q["id"] for q in items if key_is_longest(q)]
    p = tail_probability([1 / len(q["choices"]) for q in items], len(longest))
    if p < ALPHA:
        problems.append(
            f"the key is the longest option in {len(longest)} of {len(items)} items "
            f"({', '.join(longest)}): P = {p:.2g} under chance, below {ALPHA}; "
            "'pick the longest' must not pay"
        )
    position, count = Counter(q["answer"] for q in items).most_common(1)[0]
    if len(items) >= 4 and count > len(items) / 2:
        problems.append(
            f"the key is choice {quiz.LETTERS[position]}) in {count} of {len(items)} items: "
            "vary its position"
        )
    return problems


def load_raw(paths: list[Path]) -> dict[str, dict]:
    return {str(p): json.loads(p.read_text(encoding="utf-8")) for p in paths}


# --- the shipped banks ----------------------------------------------------------------------


def test_the_checker_sees_every_bank():
    assert [p.stem for p in BANKS] == quiz.available() and len(BANKS) >= 4


@pytest.mark.parametrize("path", BANKS, ids=lambda p: p.name)
def test_every_item_of_every_bank_is_well_written(path):
    raw = load_raw([path])
    assert [msg for q in raw[str(path)]["questions"] for msg in item_problems(str(path), q)] == []


def test_over_all_banks_the_longest_option_is_no_better_than_a_guess():
    banks = load_raw(BANKS)
    items = [q for bank in banks.values() for q in bank["questions"]]
    chance = sum(1 / len(q["choices"]) for q in items)
    longest = sum(key_is_longest(q) for q in items)
    print(f"the key is the longest option in {longest} of {len(items)} items; chance {chance:.1f}")
    assert bank_problems(banks) == []


# --- the checker fails where it should --------------------------------------------------------


def _item(n: int, **changes) -> dict:
    q = {
        "id": f"05.item{n}",
        "question": "Which is right?",
        "choices": ["first option", "second option", "third choice", "fourth choice"],
        "answer": n % 4,
        "why_wrong": ["why a", "why b", "why c", "why d"],
        "explanation": "Because (PyTorch docs, `torch.distributed`).",
        "domain": quiz.DOMAINS[n % len(quiz.DOMAINS)],
    }
    q["why_wrong"][q["answer"]] = None
    q.update(changes)
    return q


def _bank(*questions: dict) -> dict[str, dict]:
    return {"05.json": {"notebook": "05", "title": "Demo", "questions": list(questions)}}


GOOD = _bank(*(_item(n) for n in range(8)))


def test_a_good_small_bank_passes():
    assert bank_problems(GOOD) == []


def _with(n: int, **changes) -> dict[str, dict]:
    """GOOD with item ``n`` changed."""
    bank = copy.deepcopy(GOOD)
    bank["05.json"]["questions"][n].update(changes)
    return bank


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        (
            _with(0, choices=["the right option, told at great length", "b", "c", "d"]),
            r"question '05\.item0': the key \(38 characters\) is 38\.0× the longest distractor",
        ),
        (
            _with(1, domain="NCP-GENL: cooking"),
            r"question '05\.item1': domain='NCP-GENL: cooking' is not one of quiz\.DOMAINS",
        ),
        (
            _with(2, why_wrong=["why a", "why b", None, None]),
            r"question '05\.item2': why_wrong\[3\] is empty: say why choice 3 is wrong",
        ),
        (
            _with(2, why_wrong=["why a", "why b", None]),
            r"question '05\.item2': why_wrong needs one entry per choice \(4\)",
        ),
        (
            _with(3, explanation="As the facts table says (PyTorch docs)."),
            r"question '05\.item3': explanation cites 'facts table'",
        ),
        (
            _with(3, why_wrong=["a course pitfall (see pitfalls.md)", "b", "c", None]),
            r"question '05\.item3': why_wrong\[0\] cites 'pitfalls'",
        ),
        (
            _with(4, explanation="So (course design, \"The three tiers\"; PyTorch docs)."),
            r"explanation cites 'course design'",
        ),
        (
            _with(5, explanation="So (see shared/notes and arXiv 1909.08053)."),
            r"explanation cites 'shared/'",
        ),
        (
            _with(6, explanation="Because it is so."),
            r"question '05\.item6': the explanation names no public source",
        ),
    ],
    ids=[
        "long-key", "tag", "no-feedback", "feedback-count", "facts-table", "pitfalls",
        "course-design", "shared", "no-citation",
    ],
)
def test_each_item_rule_fails_on_a_bad_item(bad, problem):
    problems = bank_problems(bad)
    assert len(problems) == 1 and re.search(problem, problems[0]), problems


def test_a_key_that_is_always_a_little_longest_fails_the_binomial_test():
    # Every key 1.2× the longest distractor: each item passes the per-item rule, but 8 of 8
    # keys being the longest has probability 0.25**8 ≈ 1.5e-5 under chance.
    items = [
        _item(n, choices=["option"] * 4, why_wrong=["w"] * 4) for n in range(8)
    ]
    for q in items:
        q["choices"] = [f"{c} {i}" for i, c in enumerate(q["choices"])]  # distinct, 8 chars
        q["choices"][q["answer"]] += " ab"  # 11 characters: 1.4× the longest distractor
        q["why_wrong"][q["answer"]] = None
    problems = bank_problems(_bank(*items))
    assert len(problems) == 1, problems
    assert re.match(r"the key is the longest option in 8 of 8 items .* P = 1\.5e-05", problems[0])


def test_a_key_always_in_one_position_fails():
    items = [_item(n) for n in range(8)]
    for q in items:
        q["why_wrong"] = ["why a", "why b", "why c", None]
        q["answer"] = 3
    problems = bank_problems(_bank(*items))
    assert problems == ["the key is choice d) in 8 of 8 items: vary its position"]


def test_the_tail_probability_is_exact():
    assert tail_probability([0.5, 0.5], 2) == pytest.approx(0.25)
    assert tail_probability([0.5, 0.5], 1) == pytest.approx(0.75)
    assert tail_probability([0.25] * 4, 0) == pytest.approx(1.0)
    # Mixed chances: P(both) = 0.5 × 0.25.
    assert tail_probability([0.5, 0.25], 2) == pytest.approx(0.125)
    # 24 four-choice items: "the longest" in 11 or more would be surprising (P < 0.05); 10 not.
    assert tail_probability([0.25] * 24, 11) < ALPHA < tail_probability([0.25] * 24, 10)
