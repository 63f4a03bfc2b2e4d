"""Notebooks 03b's and 03c's exercise checks: they pass on the solutions and fail helpfully
otherwise.

The solutions are the ``%%writefile`` cells of ``solutions/03b_composing_parallelism.ipynb``
(``labkit.course.exercises.composing``) and ``solutions/03c_long_sequences_and_experts.ipynb``
(``labkit.course.exercises.sequences_experts``), the stubs what ``labkit.course.nbgen`` makes of them. The
kernel side runs in process with the launch replaced by a recorder; one real 4-rank launch of
``labkit.course.exercises.model_parallel.worker`` runs the rank-side checks of both notebooks on the three
solutions and on two wrong dispatches together.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from exercise_cells import assert_check_passes, assert_stub_is_not_done

from labkit import ids
from labkit.course import exercises as ex
from labkit.course import nbgen
from labkit.course.exercises import composing, rank_checks, sequences_experts
from labkit.course.exercises import model_parallel as exmp
from labkit.course.exercises.sequences_experts import sequence_plan as se_sequence_plan
from labkit.jobs import launch

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = {"03b": ROOT / "solutions" / "03b_composing_parallelism.ipynb",
             "03c": ROOT / "solutions" / "03c_long_sequences_and_experts.ipynb"}  # fmt: skip
CHECKS = {"03b": composing, "03c": sequences_experts}
"""Notebook -> the module that registers its exercises (``labkit.course.exercises.MODULES``)."""
FILES = {"03b.mesh_groups": "mesh_groups", "03c.ring_loop": "ring_loop",
         "03c.moe_dispatch": "moe_dispatch"}  # fmt: skip
WRITEFILE = re.compile(r"^%%writefile \{ex_dir\}/(?P<name>\w+)\.py\n")
IN_KERNEL = {"03b.choose_mesh": "choose_mesh", "03c.sequence_plan": "plan_sequence"}
"""The decision exercises, checked in the kernel with ex.check: id -> the function's name."""


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


def _kernel_cell(exercise_id: str) -> str:
    """The notebook's solution cell of a decision exercise, its ex.check line replaced by
    ``answer = <function>`` (exercise_cells' convention)."""
    name = IN_KERNEL[exercise_id]
    nb = SOLUTION_NBS[ids.of(exercise_id)]
    (source,) = [c.source for c in nb.cells if c.cell_type == "code"
                 and f'ex.check("{exercise_id}", {name})' in c.source]  # fmt: skip
    return source.replace(f'{name} = ex.check("{exercise_id}", {name})', f"answer = {name}")


KERNEL_SOLUTIONS = {eid: _kernel_cell(eid) for eid in IN_KERNEL}

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
UNSORTED_DISPATCH = SOLUTIONS["moe_dispatch"].replace("x[order]", "x")
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

    monkeypatch.setattr(rank_checks, "run_in_workers", fake)
    return calls


def test_each_notebook_has_one_file_per_exercise_and_the_stubs_are_stubs():
    assert set(SOLUTIONS) == set(STUBS) == set(FILES.values())
    for name in FILES.values():
        assert "BEGIN SOLUTION" not in STUBS[name] and "NotImplementedError" in STUBS[name]
    for nb, files in BY_NOTEBOOK.items():
        mine = sorted(e for e in FILES if ids.of(e) == nb)
        assert sorted(FILES[e] for e in mine) == sorted(files), nb
        kernel = sorted(e for e in IN_KERNEL if ids.of(e) == nb)
        assert [e.id for e in ex.catalogue(nb)] == sorted(mine + kernel)
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
    path = write(tmp_path, "mesh_groups_wrong", WRONG_GROUPS[mistake])
    with pytest.raises(ex.ExerciseFailed, match=mistake):
        composing.verify_file("03b.mesh_groups", path)
    assert launches == []


# Wrong ring loops and what their diagnoses say: tests/test_exercises_sequences.py.


@pytest.mark.slow
def test_the_rank_checks_pass_the_solutions_and_catch_an_unsorted_or_gathering_dispatch(tmp_path):
    cases = [{"exercise": eid, "module": FILES[eid],
              "names": list(CHECKS[ids.of(eid)].EXERCISES[eid]),
              "path": str(write(tmp_path, FILES[eid], SOLUTIONS[FILES[eid]]))}
             for eid in sorted(FILES)]  # fmt: skip
    for name, text in [("cp_unsorted", UNSORTED_DISPATCH), ("cp_gather", GATHER_DISPATCH)]:
        cases.append({"exercise": "03c.moe_dispatch", "module": name, "names": ["dispatch"],
                      "path": str(write(tmp_path, name, text))})  # fmt: skip
    job = launch.run(exmp.CasesConfig(cases=cases), nproc=4, device="cpu", timeout_s=180,
                     stream=False)  # fmt: skip
    for rank, res in enumerate(job.ranks):
        ok, gather = res["cases"][:3], res["cases"][4]
        assert [c["status"] for c in ok] == ["ok"] * 3, (rank, ok)
        assert gather["status"] == "failed" and "all_to_all_single" in gather["message"]
    # an unsorted send hands some rank another rank's tokens (which, depends on the draw)
    unsorted = [res["cases"][3] for res in job.ranks if res["cases"][3]["status"] != "ok"]
    assert unsorted and all("not sorted by destination" in c["message"] for c in unsorted)
    mesh, dispatch, ring = job.ranks[0]["cases"][:3]  # sorted(FILES)
    assert "real 2 × 2 DeviceMesh" in mesh["message"]
    assert "real 4-rank ring" in ring["message"]
    assert "every token reached its rank" in dispatch["message"]


# --------------------------------------------------------------------------- the decisions


@pytest.mark.parametrize("exercise_id", sorted(IN_KERNEL))
def test_a_decision_passes_on_the_solution_and_its_stub_is_not_done(exercise_id, capsys):
    assert_check_passes(exercise_id, KERNEL_SOLUTIONS[exercise_id], capsys)
    secrets = {"03b.choose_mesh": ("sum(m[\"memory\"]", "max(sent"),
               "03c.sequence_plan": ("seq_len / m", "sent_bytes\"])")}[exercise_id]  # fmt: skip
    assert_stub_is_not_done(exercise_id, KERNEL_SOLUTIONS[exercise_id], capsys, secrets=secrets)


def _rule(keep: str, inner: str, by: str) -> str:
    """A choose_mesh built from a rule: which state to compare with the budget, which dimension
    goes inside, and what to minimise among those kept."""
    return (
        "def choose_mesh(measured, budget_bytes):\n"
        "    best = None\n"
        "    for m in measured.values():\n"
        "        mem, sent = m['memory'], m['sent']\n"
        f"        if {keep} > budget_bytes:\n"
        "            continue\n"
        f"        inner = {inner}\n"
        "        outer = next(d for d in m['mesh'] if d != inner)\n"
        f"        key = {by}\n"
        "        if best is None or key < best[0]:\n"
        "            best = (key, {outer: m['mesh'][outer], inner: m['mesh'][inner]})\n"
        "    return None if best is None else best[1]\n"
    )


STATE, TP_IN = "sum(mem.values())", "'tp' if 'tp' in sent else max(sent, key=sent.get)"
WRONG_MESHES = {  # the mistake -> words its diagnosis must contain
    "least memory": (_rule(STATE, TP_IN, "sum(mem.values())"), "the least memory"),
    "budget ignored": (_rule("0", TP_IN, "sent[outer]"), "does not fit"),
    "parameters only": (_rule("mem['parameters']", TP_IN, "sent[outer]"),
                        "its parameters alone"),
    "busier dimension inside, TP too": (_rule(STATE, "max(sent, key=sent.get)", "sent[outer]"),
                                        "tensor parallelism is on the outer dimension"),
    "quieter dimension inside": (_rule(STATE, "min(sent, key=sent.get)", "sent[inner]"),
                                 "The last dimension is the inner one"),
    "bytes over both dimensions": (_rule(STATE, TP_IN, "sum(sent.values())"),
                                   "over both dimensions together"),
    "a layout when none fits": (_rule(STATE, TP_IN, "sent[outer]").replace(
        "return None if best is None", "return {'dp': 2, 'tp': 2} if best is None"),
        "return None"),
    "the composition's name": ("def choose_mesh(measured, budget_bytes):\n    return 'hsdp'\n",
                               "return the mesh to build"),
}


@pytest.mark.parametrize("mistake", sorted(WRONG_MESHES))
def test_a_wrong_layout_choice_is_named(mistake):
    source, says = WRONG_MESHES[mistake]
    namespace: dict = {}
    exec(source, namespace)
    with pytest.raises(ex.ExerciseFailed, match=re.escape(says)) as info:
        ex.verify("03b.choose_mesh", namespace["choose_mesh"])
    # the message never gives the mesh to choose
    assert "recipe" not in str(info.value)


def _plan(keep: str, by: str, none: str = "'cp'") -> str:
    return (
        "def plan_sequence(seq_len, budget_bytes, measured):\n"
        f"    fits = [k for k, m in measured.items() if {keep} <= budget_bytes]\n"
        f"    return min(fits, key=lambda k: measured[k][{by!r}]) if fits else {none}\n"
    )


LINEAR = "m['saved_bytes'] * seq_len / m['seq_len']"
WRONG_PLANS = {
    "not grown with the length": (_plan("m['saved_bytes']", "sent_bytes"), "measured at 128 tokens"),
    "grown with its square": (_plan(f"{LINEAR} * seq_len / m['seq_len']", "sent_bytes"),
                              "square of the length"),
    "least memory": (_plan(LINEAR, "saved_bytes"), "saves less memory"),
    "budget ignored": (_plan("0", "sent_bytes"), "does not fit"),
    "no context parallelism": (_plan(LINEAR, "sent_bytes", none="'tp'"), "more ranks"),
    "context parallelism always": ("def plan_sequence(seq_len, budget_bytes, measured):\n"
                                   "    return 'cp'\n", "adds ranks only when"),
    "None when nothing fits": (_plan(LINEAR, "sent_bytes", none="None"), "return one of"),
}


@pytest.mark.parametrize("mistake", sorted(WRONG_PLANS))
def test_a_wrong_sequence_plan_is_named(mistake):
    source, says = WRONG_PLANS[mistake]
    namespace: dict = {}
    exec(source, namespace)
    with pytest.raises(ex.ExerciseFailed, match=re.escape(says)):
        ex.verify("03c.sequence_plan", namespace["plan_sequence"])


def test_the_decisions_cases_give_every_answer_and_the_notebooks_own_case_is_among_them():
    answers = {composing.reference_choose_mesh(m, b) is None for m, b, _ in composing._mesh_cases()}
    meshes = {tuple(composing.reference_choose_mesh(m, b) or ()) for m, b, _ in composing._mesh_cases()}
    assert answers == {True, False} and {("replicate", "shard"), ("dp", "tp")} <= meshes
    plans = [sequences_experts.reference_plan_sequence(s, b, m)
             for m, s, b, _ in se_sequence_plan._sequence_cases()]  # fmt: skip
    assert set(plans) == set(sequences_experts.SEQ_ANSWERS)
    # notebook 03c's lab scenario (256 tokens, 42 MiB) is a case, and its answer is neither the
    # least-memory layout nor the one the unscaled measurement would give
    lab = [c for c in se_sequence_plan._sequence_cases() if c[1] == 256 and c[2] == 42 * 2**20]
    assert [sequences_experts.reference_plan_sequence(s, b, m) for m, s, b, _ in lab] == ["sp_keep_gathered"]
