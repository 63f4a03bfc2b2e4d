"""The old flat module names still import the moved modules, and nothing in the course uses them.

A learner's older notebook may say ``from labkit import launch``; that must keep working, as
the very module now at ``labkit.jobs.launch`` (not a copy: a second copy would hold its own job
registry and its own classes). The course itself must read as the new tree, so its files name
only the new paths.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from labkit import _moved

ROOT = Path(__file__).resolve().parents[1]
OLD = re.compile(
    r"\blabkit\.(" + "|".join(re.escape(o.removeprefix("labkit.")) for o in _moved.MOVED) + r")(?![\w])"
)
OLD_FROM = re.compile(
    r"^\s*from labkit import ([^\n#]*)", re.M
)
OLD_TOP = {o.removeprefix("labkit.") for o in _moved.MOVED if o.count(".") == 1}


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_name_is_the_moved_module(old):
    assert importlib.import_module(old) is importlib.import_module(_moved.MOVED[old])


def test_a_moved_folders_submodule_is_not_loaded_twice():
    old = importlib.import_module("labkit.exercises.first_job")
    assert old is importlib.import_module("labkit.course.exercises.first_job")
    from labkit.exercises.first_job import reference_ring_bytes_sent as old_fn

    from labkit.course.exercises import first_job

    assert old_fn is first_job.reference_ring_bytes_sent


def test_old_names_work_in_a_fresh_interpreter():
    """The finder is installed by importing labkit, before anything else is loaded."""
    code = ("from labkit import launch, dist\nimport labkit.jobs.launch, labkit.jobs.runtime\n"
            "assert launch is labkit.jobs.launch and dist is labkit.jobs.runtime\n"
            "import labkit.capstone.faults as f\nimport labkit.course.capstone.faults as g\n"
            "assert f is g\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "ok", out.stderr


def test_new_name_maps_prefixes_only_at_a_dot():
    assert _moved.new_name("labkit.exercises.dp_worker") == "labkit.course.exercises.data_parallel.worker"
    assert _moved.new_name("labkit.recordings") is None  # not labkit.record
    assert _moved.new_name("labkit.timing") is None  # not labkit.timings
    assert _moved.new_name("labkit.distx") is None


def _course_texts():
    paths = [ROOT / "README.md", ROOT / ".ci" / "run", ROOT / "course"]
    for folder in ("labkit", "tests", "benchmarks", "scripts", "docs", "solutions", "notebooks"):
        paths += sorted((ROOT / folder).rglob("*.py")) + sorted((ROOT / folder).rglob("*.md"))
        paths += sorted((ROOT / folder).glob("*.ipynb"))
    for path in paths:
        # bench_commits.py runs an older commit's own code, under its old names, on purpose
        if not path.is_file() or path.name in {"_moved.py", "test_moved.py", "bench_commits.py"}:
            continue
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".ipynb":
            text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"])
        yield str(path.relative_to(ROOT)), text


def test_the_course_names_only_the_new_paths():
    stale = []
    for where, text in _course_texts():
        stale += [f"{where}: labkit.{m}" for m in OLD.findall(text)]
        for names in OLD_FROM.findall(text):
            used = {n.strip().split(" as ")[0] for n in names.split(",")}
            stale += [f"{where}: from labkit import {n}" for n in sorted(used & OLD_TOP)]
    assert not stale, "old module paths (see labkit/_moved.py for the new ones):\n" + "\n".join(stale[:40])
