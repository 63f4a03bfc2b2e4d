"""How the course names its notebooks, and the exercises and quiz questions that belong to them.

A notebook's id is the prefix of its file name before the first underscore: two digits, and a
letter for a notebook inserted after its number (``03_model_parallelism`` is "03",
``03b_composing_parallelism`` is "03b"). Exercise ids and quiz ids start with it
("03b.mesh_groups"), and so do the exercise workspaces and quiz banks ("03b.json"). Sorted by
file name, "03b" comes after "03" and before "04".
"""

from __future__ import annotations

import re
from pathlib import Path

NOTEBOOK_ID = r"\d\d[a-z]?"
"""A notebook id as a regular expression: "03", "03b"."""
NOTEBOOK_GLOB = "[0-9][0-9]*_*.ipynb"
"""The notebooks' file names, for ``Path.glob`` (check each stem with :func:`notebook_id`)."""


def notebook_id(path: str | Path) -> str:
    """The id of the notebook at ``path`` ("solutions/03b_composing_parallelism.ipynb" -> "03b")."""
    stem = Path(path).stem
    head = stem.split("_", 1)[0]
    if "_" not in stem or not re.fullmatch(NOTEBOOK_ID, head):
        raise ValueError(
            f"{Path(path).name!r} is not a course notebook's name: it must start with an id "
            "(two digits, optionally a letter) and an underscore, e.g. 03b_composing_parallelism"
        )
    return head


def of(item_id: str) -> str:
    """The notebook an exercise or quiz id belongs to ("03b.mesh_groups" -> "03b")."""
    return item_id.split(".", 1)[0]
