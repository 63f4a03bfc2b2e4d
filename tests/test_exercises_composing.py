"""Notebooks 03b's and 03c's exercise checks: they pass on the solutions and fail helpfully
otherwise.

The solutions are the ``%%writefile`` cells of ``solutions/03b_composing_parallelism.ipynb``
(``labkit.exercises.composing``) and ``solutions/03c_long_sequences_and_experts.ipynb``
(``labkit.exercises.sequences_experts``), the stubs what ``labkit.nbgen`` makes of them. The
kernel side runs in process with the launch replaced by a recorder; one real 4-rank launch of
``labkit.exercises.mp_worker`` runs the rank-side checks of both notebooks on the three
solutions and on two wrong dispatches together.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from labkit import exercises as ex
from labkit import ids, launch, nbgen
from labkit.exercises import composing, sequences_experts
from labkit.exercises import model_parallel as exmp

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = {"03b": ROOT / "solutions" / "03b_composing_parallelism.ipynb",
             "03c": ROOT / "solutions" / "03c_long_sequences_and_experts.ipynb"}  # fmt: skip
CHECKS = {"03b": composing, "03c": sequences_experts}
"""Notebook -> the module that registers its exercises (``labkit.exercises.MODULES``)."""
FILES = {"03b.mesh_groups": "cp_mesh", "03c.ring_merge": "cp_merge",
         "03c.moe_dispatch": "cp_dispatch"}  # fmt: skip
WRITEFILE = re.compile(r"^%%writefile \{ex_dir\}/(?P<name>\w+)\.py\n")


def _writefile_cells(nb) -> dict[str, str]:
    out = {}
    for cell in nb.cells:
        match = WRITEFILE.match(cell.source) if cell.cell_type == "code" else None
        if match:
            out[match["name"]] = cell.source[match.end() :] + "\n"
    return out


SOLUTION_NBS = {nb: nbformat.read(path, as_version=4) for nb, path in NOTEBOOKS.items()}
BY_NOTEBOOK = {nb: _writefile_cells(n) for nb, n in SOLUTION_NBS.items()}
SOLUTIONS = {name: text for files in BY_NOTEBOOK.values() for name, text in files.items()}
STUBS = {name: text for n in SOLUTION_NBS.values()
         for name, text in _writefile_cells(nbgen.generate(n)).items()}  # fmt: skip

# Wrong answers a learner plausibly writes, each with the diagnosis it must get.
WRONG_GROUPS = {
    "column-major": (
        "def groups_of(shape, rank):\n"
        "    sizes, out, stride = list(shape.values()), {}, 1\n"
        "    for i, dim in enumerate(shape):  # the first dimension varying fastest\n"
        "        coord = (rank // stride) % sizes[i]\n"
        "        out[dim] = [rank + (c - coord) * stride for c in range(sizes[i])]\n"
        "        stride *= sizes[i]\n"
        "    return out\n"
    ),
    "the other's group": (
        "from labkit.parallel import mesh\n"
        "def groups_of(shape, rank):\n"
        "    a, b = list(shape)\n"
        "    return {a: mesh.group_ranks(shape, b, rank), b: mesh.group_ranks(shape, a, rank)}\n"
    ),
}
WRONG_MERGES = {
    "you averaged": "def merge(out_a, lse_a, out_b, lse_b):\n    return (out_a + out_b) / 2, lse_a\n",
    "the larger of the two": (
        "import torch\n"
        "def merge(out_a, lse_a, out_b, lse_b):\n"
        "    lse = torch.maximum(lse_a, lse_b)\n"
        "    return torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b, lse\n"
    ),
    "NaN": (
        "import torch\n"
        "def merge(out_a, lse_a, out_b, lse_b):\n"
        "    lse = torch.logaddexp(lse_a, lse_b)\n"
        "    return torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b, lse\n"
    ),
}
UNSORTED_DISPATCH = SOLUTIONS["cp_dispatch"].replace("x[order]", "x")
GATHER_DISPATCH = (
    "import torch\nimport torch.distributed as dist\n"
    "def dispatch(x, dest, group=None):\n"
    "    n, r = dist.get_world_size(group), dist.get_rank(group)\n"
    "    xs, ds = [torch.empty_like(x) for _ in range(n)], [torch.empty_like(dest) for _ in range(n)]\n"
    "    dist.all_gather(xs, x, group=group)\n"
    "    dist.all_gather(ds, dest, group=group)\n"
    "    rows = [xi[di == r] for xi, di in zip(xs, ds)]\n"
    "    return torch.cat(rows), torch.tensor([len(t) for t in rows])\n"
)


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / f"{name}.py"
    path.write_text(text)
    return path


@pytest.fixture
def launches(monkeypatch):
    """Replace the launch: record what the ranks would have been asked to check."""
    calls: list[tuple[dict, int]] = []

    def fake(exercise_id, objs, nproc=2):
        calls.append((exmp.answer_spec(exercise_id, objs), nproc))
        return "(ranks not launched in this test)"

    monkeypatch.setattr(exmp, "run_in_workers", fake)
    return calls


def test_each_notebook_has_one_file_per_exercise_and_the_stubs_are_stubs():
    assert set(SOLUTIONS) == set(STUBS) == set(FILES.values())
    for name in FILES.values():
        assert "BEGIN SOLUTION" not in STUBS[name] and "NotImplementedError" in STUBS[name]
    for nb, files in BY_NOTEBOOK.items():
        mine = sorted(e for e in FILES if ids.of(e) == nb)
        assert sorted(FILES[e] for e in mine) == sorted(files), nb
        assert [e.id for e in ex.catalogue(nb)] == mine
        assert sorted(CHECKS[nb].EXERCISES) == mine  # one module per notebook, no copies
    assert ex.MODULES["03b"] == composing.__name__
    assert ex.MODULES["03c"] == sequences_experts.__name__


@pytest.mark.parametrize("exercise_id", sorted(FILES))
def test_check_passes_on_the_solution_and_sends_the_file_to_its_ranks(
    exercise_id, tmp_path, launches, capsys
):
    path = write(tmp_path, FILES[exercise_id], SOLUTIONS[FILES[exercise_id]])
    ex.check_in_workers(exercise_id, path)
    out = capsys.readouterr().out
    assert out.startswith(f"✓ {exercise_id}: ") and out.count("\n") == 1
    checks = CHECKS[ids.of(exercise_id)]
    spec = {"exercise": exercise_id, "module": FILES[exercise_id], "path": str(path),
            "names": list(checks.EXERCISES[exercise_id])}  # fmt: skip
    assert launches == [(spec, checks.NPROC[exercise_id])]


@pytest.mark.parametrize("exercise_id", sorted(FILES))
def test_check_on_the_stub_says_not_done_without_launching(exercise_id, tmp_path, launches, capsys):
    path = write(tmp_path, FILES[exercise_id], STUBS[FILES[exercise_id]])
    ex.check_in_workers(exercise_id, path)
    out = capsys.readouterr().out
    assert out.startswith(f"○ {exercise_id} (") and ex.get(exercise_id).hints[0] in out
    assert launches == []


@pytest.mark.parametrize("mistake", sorted(WRONG_GROUPS))
def test_a_wrong_mesh_layout_is_named_in_the_kernel(mistake, tmp_path, launches):
    path = write(tmp_path, "cp_mesh_wrong", WRONG_GROUPS[mistake])
    with pytest.raises(ex.ExerciseFailed, match=mistake):
        composing.verify_file("03b.mesh_groups", path)
    assert launches == []


@pytest.mark.parametrize("mistake", sorted(WRONG_MERGES))
def test_a_wrong_merge_is_named_in_the_kernel(mistake, tmp_path, launches):
    path = write(tmp_path, "cp_merge_wrong", WRONG_MERGES[mistake])
    with pytest.raises(ex.ExerciseFailed, match=mistake):
        sequences_experts.verify_file("03c.ring_merge", path)
    assert launches == []


@pytest.mark.slow
def test_the_rank_checks_pass_the_solutions_and_catch_an_unsorted_or_gathering_dispatch(tmp_path):
    cases = [{"exercise": eid, "module": FILES[eid],
              "names": list(CHECKS[ids.of(eid)].EXERCISES[eid]),
              "path": str(write(tmp_path, FILES[eid], SOLUTIONS[FILES[eid]]))}
             for eid in sorted(FILES)]  # fmt: skip
    for name, text in [("cp_unsorted", UNSORTED_DISPATCH), ("cp_gather", GATHER_DISPATCH)]:
        cases.append({"exercise": "03c.moe_dispatch", "module": name, "names": ["dispatch"],
                      "path": str(write(tmp_path, name, text))})  # fmt: skip
    job = launch.run(exmp.WORKER, nproc=4, device="cpu", config={"cases": cases},
                     timeout_s=180, stream=False)  # fmt: skip
    for rank, res in enumerate(job.ranks):
        ok, gather = res["cases"][:3], res["cases"][4]
        assert [c["status"] for c in ok] == ["ok"] * 3, (rank, ok)
        assert gather["status"] == "failed" and "all_to_all_single" in gather["message"]
    # an unsorted send hands some rank another rank's tokens (which, depends on the draw)
    unsorted = [res["cases"][3] for res in job.ranks if res["cases"][3]["status"] != "ok"]
    assert unsorted and all("not sorted by destination" in c["message"] for c in unsorted)
    mesh, dispatch, merge = job.ranks[0]["cases"][:3]  # sorted(FILES)
    assert "real 2 × 2 DeviceMesh" in mesh["message"]
    assert "4-rank ring" in merge["message"]
    assert "every token reached its rank" in dispatch["message"]
