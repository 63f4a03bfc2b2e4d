"""Notebook ids: two digits, and a letter for a notebook inserted after its number."""

from __future__ import annotations

from pathlib import Path

import pytest

from labkit import ids
from labkit.course import quiz

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("name", "expected"),
    [("00_setup_and_first_job.ipynb", "00"), ("solutions/03b_composing_parallelism.ipynb", "03b"),
     ("07_capstone", "07")],
)  # fmt: skip
def test_a_notebook_id_is_the_file_name_before_the_first_underscore(name, expected):
    assert ids.notebook_id(name) == expected


@pytest.mark.parametrize("name", ["3_short.ipynb", "03B_upper.ipynb", "003_long.ipynb",
                                  "03bb_two.ipynb", "03.ipynb", "notes.ipynb"])  # fmt: skip
def test_a_name_that_is_not_a_notebook_id_is_refused_with_the_rule(name):
    with pytest.raises(ValueError, match="two digits, optionally a letter"):
        ids.notebook_id(name)


def test_an_inserted_notebook_sorts_after_its_number_and_before_the_next():
    names = ["04_mixed_precision.ipynb", "03b_composing_parallelism.ipynb",
             "03_model_parallelism.ipynb"]  # fmt: skip
    assert [ids.notebook_id(n) for n in sorted(names)] == ["03", "03b", "04"]


def test_every_notebook_glob_match_has_an_id_and_a_quiz_bank():
    solutions = sorted((ROOT / "solutions").glob(ids.NOTEBOOK_GLOB))
    assert solutions and all(ids.notebook_id(p) for p in solutions)
    assert [ids.notebook_id(p) for p in solutions if ids.notebook_id(p) != "07"] == [
        b for b in quiz.available()
    ]


def test_ids_of_exercises_and_questions_name_their_notebook():
    assert ids.of("03b.mesh_groups") == "03b" and ids.of("01.param_count") == "01"
