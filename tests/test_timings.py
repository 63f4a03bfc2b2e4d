"""``labkit timings``: a synthetic notebook run for real in a fresh kernel, its sections found and
timed from the cells' timestamps, and the peak memory of the kernel's process tree sampled.

No timed assertion: the sleeps only fix the sections' order (a 1.2 s sleep takes longer than a
0.3 s one however loaded the machine is), and the child's 100 MB are touched, so they are
resident while it sleeps for a second, five sampling intervals.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from labkit.__main__ import main as labkit_main
from labkit.course import timings

ROOT = Path(__file__).resolve().parents[1]
ALLOC_BYTES = 100 * 2**20
CHILD = (
    f"import time; b = bytearray({ALLOC_BYTES}); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.0)"
)


def synthetic(folder: Path, name: str = "00_synthetic.ipynb") -> Path:
    params = new_code_cell("size = 'lab'")
    params.metadata["tags"] = ["parameters"]
    nb = new_notebook(cells=[
        new_markdown_cell("# A synthetic notebook"), params,
        new_markdown_cell("## Short sleep\n\nA little text."),
        new_code_cell("import time\ntime.sleep(0.3)"),
        new_markdown_cell("### a subsection stays in its section"),
        new_code_cell("print('size is', size)\nimport os\nprint('env', os.environ['LABKIT_SIZE'])"),
        new_markdown_cell("## Long sleep, then a child allocates"),
        new_code_cell("time.sleep(1.2)"),
        new_code_cell(f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {CHILD!r}], "
                      "check=True)"),
    ])  # fmt: skip
    path = folder / name
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def timed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("timings")
    path = synthetic(folder)
    lines: list[str] = []
    results = timings.run_many([path], ["smoke"], out_dir=folder / "out", progress=lines.append)
    return folder, results[0], lines


def test_sections_are_the_level_two_headings_in_order(timed):
    _, t, _ = timed
    assert t.notebook == "00_synthetic" and t.size == "smoke"
    titles = [s.title for s in t.sections]
    assert titles == [timings.BEFORE_FIRST_SECTION, "Short sleep",
                      "Long sleep, then a child allocates"]  # fmt: skip
    by = {s.title: s for s in t.sections}
    assert by["Short sleep"].cells == 2  # the ### cell's code belongs to its ## section
    assert by["Long sleep, then a child allocates"].cells == 2


def test_section_times_follow_the_sleeps_and_fit_in_the_total(timed):
    _, t, _ = timed
    short, long_ = t.sections[1], t.sections[2]
    assert short.seconds >= 0.3 and long_.seconds >= 1.2 + 1.0
    assert long_.seconds > short.seconds
    assert sum(s.seconds for s in t.sections) <= t.total_s


def test_peak_memory_covers_the_child_process(timed):
    _, t, _ = timed
    assert t.peak_rss_bytes is not None and t.peak_rss_bytes > ALLOC_BYTES
    long_ = t.sections[2]
    assert long_.peak_rss_bytes > ALLOC_BYTES  # sampled while the child held its 100 MB
    assert t.sections[1].peak_rss_bytes < ALLOC_BYTES  # before it: the kernel alone


def test_size_is_injected_and_the_executed_copy_is_saved(timed):
    folder, _, lines = timed
    out = nbformat.read(folder / "out" / "smoke-00_synthetic.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in out.cells if c.cell_type == "code"
                   for o in c.get("outputs", []))  # fmt: skip
    assert "size is smoke" in text and "env smoke" in text
    assert lines[0].startswith("[1/1] smoke 00_synthetic")
    assert "peak memory" in lines[-1] and "3 sections" in lines[-1]


def test_record_fields_and_markdown_say_what_was_sampled(timed, tmp_path):
    _, t, _ = timed
    fields = timings.to_record_fields([t])
    k = "smoke/00_synthetic"
    assert fields["samples_s"][k] == [t.total_s]
    assert fields["summary"][k]["median_s"] == t.total_s
    assert fields["peak_rss_bytes"][k] == [t.peak_rss_bytes]
    assert [s["title"] for s in fields["sections"][k][0]][1:] == ["Short sleep",
                                                                   "Long sleep, then a child allocates"]  # fmt: skip
    md = timings.markdown([t])
    assert "sampled every 0.2 s" in md and "every process it started" in md
    assert "| Short sleep | 2 |" in md
    assert "N/A" not in md  # every section here ran long enough to be sampled
    unsampled = copy.deepcopy(t)
    unsampled.sections[1].peak_rss_bytes = None
    assert "| no sample taken |" in timings.markdown([unsampled])
    js, mdfile = timings.write([t], tmp_path, ["smoke"])
    assert json.loads(js.read_text())["notebooks"][0]["notebook"] == "00_synthetic"
    assert mdfile.read_text().startswith("# Notebook timings")


def test_cli_only_and_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        labkit_main(["timings", "--solutions", str(tmp_path / "missing")])
    assert "does not exist" in capsys.readouterr().err
    synthetic(tmp_path)
    with pytest.raises(SystemExit):
        labkit_main(["timings", "--solutions", str(tmp_path), "--only", "42"])
    assert "no such notebook" in capsys.readouterr().err


def test_cell_seconds_reads_the_kernel_timestamps():
    cell = nbformat.from_dict({"cell_type": "code", "metadata": {"execution": {
        "iopub.execute_input": "2026-01-01T00:00:01.000000Z",
        "shell.execute_reply": "2026-01-01T00:00:03.500000Z"}}, "source": "", "outputs": []})  # fmt: skip
    assert timings.cell_seconds(cell) == pytest.approx(2.5)
    cell.metadata.execution = {}
    assert timings.cell_seconds(cell) is None


def test_run_time_cell_is_the_recorded_medians_rounded_to_5_s():
    record = {"summary": {"smoke/x": {"median_s": 17.6}, "lab/x": {"median_s": 61.0}}}
    assert timings.run_time_cell(record, "x") == "~20 s / ~60 s"


def test_tree_rss_counts_this_process_and_none_for_a_missing_one():
    assert timings.tree_rss(os.getpid()) > 10 * 2**20  # this interpreter with torch loaded
    assert timings.tree_rss(2**22 + 12345) is None  # above Linux's largest pid
