"""Notebook 03's exercise checks: they pass on the solutions and fail helpfully otherwise.

The solutions are the ``%%writefile`` cells of ``solutions/03_model_parallelism.ipynb``, and
the stubs are what ``labkit.course.nbgen`` makes of those cells, so the tests follow the notebook.
Everything the kernel checks runs in process, with the launch replaced by a recorder; one
real 2-rank launch of ``labkit.course.exercises.model_parallel.worker`` runs the rank-side checks on solutions,
a stub and wrong answers together.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
import torch
from test_exercises import code_like  # the rule the last hints obey: words, not code

from labkit.course import exercises as ex
from labkit.course import nbgen
from labkit.course.exercises import model_parallel as exmp
from labkit.course.exercises import rank_checks
from labkit.course.exercises.model_parallel import column_parallel as mp_column_parallel
from labkit.course.exercises.model_parallel import f_and_g as mp_f_and_g
from labkit.course.exercises.model_parallel import pipeline_order as mp_pipeline_order
from labkit.jobs import launch

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "solutions" / "03_model_parallelism.ipynb"
FILES = {"03.one_f_one_b": "mp_order", "03.f_and_g": "mp_fg", "03.column_parallel": "mp_column"}
WRITEFILE = re.compile(r"^%%writefile \{ex_dir\}/(?P<name>\w+)\.py\n")


def _writefile_cells(nb) -> dict[str, str]:
    """{file stem: the file's text} for each %%writefile cell of ``nb``."""
    out = {}
    for cell in nb.cells:
        match = WRITEFILE.match(cell.source) if cell.cell_type == "code" else None
        if match:
            out[match["name"]] = cell.source[match.end() :] + "\n"
    return out


SOLUTION_NB = nbformat.read(NOTEBOOK, as_version=4)
SOLUTIONS = _writefile_cells(SOLUTION_NB)
STUBS = _writefile_cells(nbgen.generate(SOLUTION_NB))


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / f"{name}.py"
    path.write_text(text)
    return path


@pytest.fixture
def launches(monkeypatch):
    """Replace the launch: record what the ranks would have been asked to check."""
    calls: list[dict] = []

    def fake(exercise_id, objs):
        calls.append(exmp.answer_spec(exercise_id, objs))
        return "(ranks not launched in this test)"

    monkeypatch.setattr(rank_checks, "run_in_workers", fake)
    return calls


def test_the_notebook_has_one_file_per_exercise_and_the_stubs_are_stubs():
    assert set(SOLUTIONS) == set(STUBS) == set(FILES.values())
    for name in FILES.values():
        assert "BEGIN SOLUTION" not in STUBS[name] and "NotImplementedError" in STUBS[name]
    # 03.choose_m is checked in the kernel, not from a file (tests/test_exercises_choose_m.py)
    assert [e.id for e in ex.catalogue("03")] == sorted([*FILES, "03.choose_m"])


@pytest.mark.parametrize("exercise_id", sorted(FILES))
def test_check_passes_on_the_solution_and_sends_the_file_to_the_ranks(
    exercise_id, tmp_path, launches, capsys
):
    path = write(tmp_path, FILES[exercise_id], SOLUTIONS[FILES[exercise_id]])
    ex.check_in_workers(exercise_id, path)
    out = capsys.readouterr().out
    assert out.startswith(f"✓ {exercise_id}: ") and out.count("\n") == 1
    assert launches == [{"exercise": exercise_id, "module": FILES[exercise_id], "path": str(path),
                         "names": list(exmp.EXERCISES[exercise_id])}]  # fmt: skip


@pytest.mark.parametrize("exercise_id", sorted(FILES))
def test_check_on_the_stub_says_not_done_with_the_hint_without_launching(
    exercise_id, tmp_path, launches, capsys
):
    path = write(tmp_path, FILES[exercise_id], STUBS[FILES[exercise_id]])
    with pytest.raises(ex.ExerciseIncomplete) as info:
        exmp.verify_file(exercise_id, path)
    assert (
        str(info.value) == f"Exercise {exercise_id} is not done yet: {ex.get(exercise_id).hints[0]}"
    )
    ex.check_in_workers(exercise_id, path)  # prints, does not raise: Run All goes on
    out = capsys.readouterr().out
    assert out.startswith(f"○ {exercise_id} (") and out.count("\n") == 1
    assert launches == []  # a stub is reported by the kernel at once


def test_a_missing_file_or_name_is_named(tmp_path, launches):
    with pytest.raises(ex.ExerciseFailed, match="run the %%writefile cell"):
        exmp.verify_file("03.one_f_one_b", tmp_path / "nope.py")
    path = write(tmp_path, "mp_renamed", "def one_f_one_b_v2(p, m, stage):\n    return []\n")
    with pytest.raises(ex.ExerciseFailed, match=r"03\.one_f_one_b .* defines no one_f_one_b"):
        exmp.verify_file("03.one_f_one_b", path)
    with pytest.raises(ValueError, match=r"exercise_id='03\.nope'"):
        exmp.verify_file("03.nope", path)


def test_code_defined_in_the_notebook_cannot_go_to_workers():
    namespace = {"__name__": "__main__"}
    exec("def one_f_one_b(p, m, stage):\n    return []\n", namespace)
    with pytest.raises(ex.ExerciseFailed, match="worker processes cannot import it"):
        exmp.answer_spec("03.one_f_one_b", [namespace["one_f_one_b"]])


def test_a_rewritten_file_is_loaded_afresh(tmp_path):
    path = write(tmp_path, "mp_again", "VALUE = 1\n")
    assert exmp.load_file(path).VALUE == 1
    path.write_text("VALUE = 22\n")  # same second, different size: no stale bytecode either
    assert exmp.load_file(path).VALUE == 22
    assert not (tmp_path / "__pycache__").exists()


# --------------------------------------------------------------------------- 03.one_f_one_b


def _warmup(p, m, stage, w):
    return mp_pipeline_order._warmup_order(p, m, w)


WRONG_ORDERS = [
    (lambda p, m, s: [("F", j) for j in range(m)] + [("B", j) for j in range(m)], "GPipe's order"),
    (lambda p, m, s: _warmup(p, m, s, p - s), "one warm-up forward too many"),
    (lambda p, m, s: _warmup(p, m, s, p - 2 - s), "one warm-up forward too few"),
    (lambda p, m, s: _warmup(p, m, s, s), "the warm-up is reversed"),
    (lambda p, m, s: [("F", j) for j in range(p - 1 - s)]
     + [a for j in range(m - (p - 1 - s)) for a in (("F", p - 1 - s + j), ("B", j))]
     + [("B", j) for j in range(max(0, m - (p - 1 - s)), m)], "min(p−1−stage, m)"),
    (lambda p, m, s: mp_pipeline_order._reference_order(p, m, s)[::-1], "before ('F'"),
    (lambda p, m, s: [("F", j) for j in range(m)] + [("B", j) for j in reversed(range(m))],
     "oldest first"),
    (lambda p, m, s: [(k, j) for k, j in mp_pipeline_order._reference_order(p, m, s) if j > 0], "exactly one"),
    (lambda p, m, s: "F0 F1 B0", "return a list of"),
    (lambda p, m, s: [["F", 0.0]], "each entry is a pair"),
]  # fmt: skip


@pytest.mark.parametrize(("wrong", "diagnosis"), WRONG_ORDERS)
def test_wrong_orders_are_diagnosed(wrong, diagnosis, launches):
    with pytest.raises(ex.ExerciseFailed, match=r"^Exercise 03\.one_f_one_b \(") as info:
        ex.verify("03.one_f_one_b", wrong)
    assert diagnosis in str(info.value)
    assert "expected" in str(info.value) or "returned" in str(info.value)
    assert "expected [(" not in str(info.value)  # where it goes wrong, never the whole answer
    assert launches == []


def test_backwards_newest_first_are_diagnosed():
    got = [("F", 0), ("F", 1), ("B", 1), ("B", 0)]  # p = 2, m = 2, stage 0: 1F1B is F0 F1 B0 B1
    assert "oldest first" in exmp.order_diagnosis(2, 2, 0, got)


# --------------------------------------------------------------------------- 03.column_parallel


def _column_solution(x, linear, rank, world_size):
    k = linear.out_features // world_size
    rows = slice(rank * k, (rank + 1) * k)
    bias = linear.bias[rows] if linear.bias is not None else 0
    return x @ linear.weight[rows].T + bias


WRONG_COLUMNS = [
    (lambda x, lin, r, n: lin(x), "the output has all"),
    (lambda x, lin, r, n: _column_solution(x, lin, (r + 1) % n, n), "that is rank"),
    (lambda x, lin, r, n: _column_solution(x, lin, r, n)
     - (lin.bias[r * lin.out_features // n:(r + 1) * lin.out_features // n] if lin.bias is not None else 0),
     "the bias is missing"),
    (lambda x, lin, r, n: _column_solution(x, lin, r, n).detach(), "cut off from autograd"),
    (lambda x, lin, r, n: x @ lin.weight.detach()[r * lin.out_features // n:(r + 1) * lin.out_features // n].T
     + lin.bias[r * lin.out_features // n:(r + 1) * lin.out_features // n],
     "no gradient reached linear.weight"),
    (lambda x, lin, r, n: x @ lin.weight[r * lin.in_features // n:(r + 1) * lin.in_features // n].T,
     "its share of the output features, 12 here (out_features divided by world_size)"),
    (lambda x, lin, r, n: x @ lin.weight[:, r * lin.out_features // n:(r + 1) * lin.out_features // n].T,
     "raised RuntimeError"),
    (lambda x, lin, r, n: x @ lin.weight[:, r * lin.out_features // n:(r + 1) * lin.out_features // n].T,
     "check which of its two dimensions holds the output features"),
    (lambda x, lin, r, n: [1, 2], "not a tensor"),
]  # fmt: skip


@pytest.mark.parametrize(("wrong", "diagnosis"), WRONG_COLUMNS)
def test_wrong_column_parallel_answers_are_diagnosed(wrong, diagnosis, launches):
    with pytest.raises(ex.ExerciseFailed, match=r"^Exercise 03\.column_parallel \(") as info:
        ex.verify("03.column_parallel", wrong)
    assert diagnosis in str(info.value) and "Likely: " in str(info.value)
    assert launches == []
    said = str(info.value).rsplit("Likely: ", 1)[-1]
    assert code_like(said) == [], said  # what is wrong, in words


def test_a_slice_of_the_wrong_dimension_of_a_square_layer_is_named():
    lin, x = mp_column_parallel._column_case(12, 12, True)
    cols = slice(0, 6)
    sliced_columns = x @ lin.weight[:, cols] + lin.bias[cols]  # right shape, wrong values
    assert "you sliced the input dimension of linear.weight" in exmp.column_diagnosis(
        sliced_columns, x, lin, 0, 2
    )
    assert exmp.column_diagnosis(x @ lin.weight[cols].T + lin.bias[cols], x, lin, 0, 2) is None


# --------------------------------------------------------------------------- 03.f_and_g


def test_f_and_g_must_be_autograd_functions_and_a_module(tmp_path, launches):
    path = write(tmp_path, "mp_fg_types", SOLUTIONS["mp_fg"])
    enter, leave, tp_mlp = exmp.answer_from_file("03.f_and_g", path)
    with pytest.raises(ex.ExerciseFailed, match=r"subclass of torch\.autograd\.Function"):
        ex.verify("03.f_and_g", (lambda x: x, leave, tp_mlp))
    with pytest.raises(ex.ExerciseFailed, match=r"a subclass of torch\.nn\.Module"):
        ex.verify("03.f_and_g", (enter, leave, lambda mlp, rank, world_size: mlp))
    with pytest.raises(ex.ExerciseFailed, match=r"\(Enter, Leave, TensorParallelMLP\), three"):
        ex.verify("03.f_and_g", (enter, leave))
    assert launches == []


def test_results_from_the_ranks_become_the_notebooks_errors():
    ok = {"exercise": "03.f_and_g", "status": "ok", "message": "fine"}
    assert exmp.raise_for_results("03.f_and_g", [ok, ok]) == "fine"
    stub = {**ok, "status": "incomplete", "message": "Exercise 03.f_and_g is not done yet: h"}
    with pytest.raises(ex.ExerciseIncomplete, match="not done yet"):
        exmp.raise_for_results("03.f_and_g", [stub, stub])
    bad = {**ok, "status": "failed", "message": "Likely: g's forward must all-reduce"}
    with pytest.raises(ex.ExerciseFailed, match=r"^on rank 1 of 2: Likely: g's forward"):
        exmp.raise_for_results("03.f_and_g", [ok, bad])


def _variant(old: str, new: str) -> str:
    """The solution file with the line(s) ``old`` replaced by ``new`` (a planted mistake)."""
    sol = SOLUTIONS["mp_fg"]
    assert sol.count(old) == 1, old
    return sol.replace(old, new)


FC_COPY = "            self.fc.weight.copy_(mlp.fc.weight[units])"
FC_BIAS = "            self.fc.bias.copy_(mlp.fc.bias[units])"
PROJ_COPY = "            self.proj.weight.copy_(mlp.proj.weight[:, units])"
PROJ_BIAS = "            self.proj.bias.copy_(mlp.proj.bias)"
UNITS = "        units = slice(rank * k, (rank + 1) * k)\n"
LAYERS = "        self.proj = nn.Linear(k, h)\n"
OUTPUT = "        return Leave.apply(partial) + self.proj.bias"
ENTER = "        x = Enter.apply(x)"
QUARTER = "h // world_size * rank : h // world_size * (rank + 1)"  # of the 12 input features

# Mistakes the kernel catches before any launch: (planted file, what the message must say).
WRONG_SHARDS = [
    (_variant(FC_COPY, FC_COPY.replace("[units]", "[:, units]")),
     "Likely: a slice does not fit its layer: the slice copied into fc does not have the shape "
     "of fc's weight: was it cut along fc's input features, which every rank keeps whole, "
     "instead of its output features, the hidden units?"),
    (_variant(LAYERS, LAYERS + f"        self.fc.weight = nn.Parameter(mlp.fc.weight[:, {QUARTER}].detach().clone())\n")
     .replace(FC_COPY, "            pass"),
     "fc.weight has shape (48, 6), expected (24, 12), (4h/n, h) for 2 ranks: column-parallel fc "
     "holds the wrong features: its first dimension holds 48, not this rank's 24 hidden units "
     "(fc's output features); its second dimension holds 6 of fc's 12 input features, which "
     "every rank keeps whole"),
    (_variant(PROJ_COPY, PROJ_COPY.replace("[:, units]", "[units]")),
     "Likely: a slice does not fit its layer: the slice copied into proj does not have the shape "
     "of proj's weight: was it cut along proj's output features, which every rank computes in "
     "full, instead of its input features, the hidden units?"),
    (_variant(LAYERS, LAYERS + f"        self.proj.weight = nn.Parameter(mlp.proj.weight[{QUARTER}].detach().clone())\n")
     .replace(PROJ_COPY, "            pass"),
     "proj.weight has shape (6, 48), expected (12, 24), (h, 4h/n) for 2 ranks: row-parallel proj "
     "holds the wrong features: its first dimension holds 6 of proj's 12 output features, which "
     "every rank computes in full (a partial sum of each); its second dimension holds 48, not "
     "this rank's 24 hidden units (proj's input features)"),
    (_variant(FC_BIAS, "            self.fc.bias = nn.Parameter(mlp.fc.bias.clone())"),
     "fc.bias has shape (48,), expected (24,)"),
    (_variant(PROJ_BIAS, "            self.proj.bias = nn.Parameter(mlp.proj.bias[units].clone())"),
     "rank=1, world_size=2): Likely: proj.bias has shape (0,), expected (12,): proj's bias"),
    (_variant(UNITS, "        units = slice((rank + 1) % world_size * k, ((rank + 1) % world_size + 1) * k)\n"),
     "fc.weight holds rank 1's slice, not rank 0's: its hidden units start at another rank's"),
    (_variant(FC_COPY, "            pass"), "fc.weight holds other values than rank 0's slice"),
    (_variant(LAYERS, LAYERS + "        self.mlp = mlp\n"),
     "your module holds 1824 parameters, its shards 612: keep only this rank's slices"),
    (_variant(UNITS, "        units = slice(dist.get_rank() * k, (dist.get_rank() + 1) * k)\n"),
     "Likely: the rank or the world size came from the process group, not from the rank and "
     "world_size arguments"),
    (SOLUTIONS["mp_fg"].replace("self.fc", "self.w1"), "your module has no fc.weight"),
    (_variant(LAYERS, LAYERS + "        self.proj.weight.requires_grad_(False)\n"),
     "proj.weight does not require a gradient"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "message"), WRONG_SHARDS)
def test_wrong_shards_are_named_in_the_kernel_without_launching(text, message, tmp_path, launches):
    path = write(tmp_path, "mp_fg_wrong", text)
    with pytest.raises(ex.ExerciseFailed, match=r"^Exercise 03\.f_and_g \(") as info:
        exmp.verify_file("03.f_and_g", path)
    assert message in str(info.value)
    assert launches == []
    said = str(info.value).split("Likely: ", 1)[-1]  # the diagnosis, after the learner's own line
    assert code_like(said) == [], said  # what is wrong and where, never the fix's code


def test_a_shard_that_is_not_a_parameter_is_named(tmp_path):
    mlp, _, _ = exmp.tp_mlp_case()
    sol = exmp.load_file(write(tmp_path, "mp_fg_buffer", SOLUTIONS["mp_fg"]))
    module = sol.TensorParallelMLP(mlp, 0, 2)
    weight = module.fc.weight.detach()
    del module.fc.weight
    module.fc.register_buffer("weight", weight)  # right values, but no gradient would be kept
    said = exmp.shard_diagnosis(module, mlp, 0, 2)
    assert "fc.weight is not a parameter of your module" in said and code_like(said) == []


def test_a_file_with_f_and_g_done_and_the_module_a_stub_is_not_done(tmp_path, launches):
    stub_mlp = STUBS["mp_fg"][STUBS["mp_fg"].index("class TensorParallelMLP") :]
    done_fg = SOLUTIONS["mp_fg"][: SOLUTIONS["mp_fg"].index("class TensorParallelMLP")]
    path = write(tmp_path, "mp_fg_half", done_fg + stub_mlp)
    with pytest.raises(ex.ExerciseIncomplete, match="not done yet"):
        exmp.verify_file("03.f_and_g", path)
    assert launches == []


def test_the_reference_shards_are_the_slices_the_solution_takes(tmp_path):
    mlp, _, _ = exmp.tp_mlp_case()
    sol = exmp.load_file(write(tmp_path, "mp_fg_ref", SOLUTIONS["mp_fg"]))
    for n in exmp.TP_WORLD_SIZES:
        for r in range(n):
            shards = exmp.reference_shards(mlp, r, n)
            k = 48 // n  # hidden units per rank (d_model 12, 4 × 12 hidden)
            assert shards["fc.weight"].equal(mlp.fc.weight[r * k : (r + 1) * k])
            assert shards["proj.weight"].equal(mlp.proj.weight[:, r * k : (r + 1) * k])
            assert exmp.shard_diagnosis(sol.TensorParallelMLP(mlp, r, n), mlp, r, n) is None


def _rank_results(rank: int = 0, n: int = 2):
    """What a right rank reports (its output, every rank's dL/dx, its shards' gradients), the
    unsplit MLP's, and that MLP after its backward: what ``tp_mlp_diagnosis`` compares."""
    import copy

    import torch.nn.functional as F

    mlp, x, grad_out = exmp.tp_mlp_case()
    whole = copy.deepcopy(mlp)
    ref = mp_f_and_g._tp_forward_backward(whole, x, grad_out)
    k = whole.fc.out_features // n
    units = slice(rank * k, (rank + 1) * k)
    grads = {"fc.weight": whole.fc.weight.grad[units], "fc.bias": whole.fc.bias.grad[units],
             "proj.weight": whole.proj.weight.grad[:, units], "proj.bias": whole.proj.bias.grad}  # fmt: skip
    got = {"out": ref["out"], "x_grads": [ref["x_grad"]] * n, "grads": grads}
    with torch.no_grad():
        hidden = F.gelu(F.linear(x, mlp.fc.weight[units], mlp.fc.bias[units]), approximate="tanh")
        partial = F.linear(hidden, mlp.proj.weight[:, units])
        exact = F.linear(F.gelu(mlp.fc(x)), mlp.proj.weight, mlp.proj.bias)
    return got, ref, whole, x, {"partial": partial, "exact": exact, "bias": mlp.proj.bias.detach()}


def test_the_modules_forward_mistakes_are_diagnosed_without_handing_over_code():
    """Each mistake only the ranks can show, planted in a right rank's results: the message
    says what is wrong and where, in words (review N02-8: no F.linear(...), no Leave.apply)."""
    got, ref, whole, x, parts = _rank_results()
    assert exmp.tp_mlp_diagnosis(got, ref, whole, x, 0, 2) is None
    bias, partial = parts["bias"], parts["partial"]
    planted = {
        "the output is off by (world_size − 1) × proj.bias, here 1 × proj.bias: the bias is "
        "added on every rank before g sums the ranks' outputs, so the sum counts it 2 times":
            {"out": ref["out"] + bias},
        "the output is this rank's partial sum, not the whole MLP's: g is missing":
            {"out": partial + bias},
        "the output is the MLP's with exact GELU: labkit.model.MLP uses GELU's tanh approximation":
            {"out": parts["exact"]},
        "the output differs from the unsplit MLP's, and not as a bias counted on every rank":
            {"out": 2 * ref["out"]},
        "x received no gradient on some rank": {"x_grads": [ref["x_grad"], None]},
        "the input gradients differ across ranks: each holds only its own part of dL/dx, the part "
        "its slice of fc produced, so f is missing":
            {"x_grads": [ref["x_grad"], 2 * ref["x_grad"]]},
        "fc.weight received no gradient: the output was not computed from your module's own "
        "fc.weight": {"grads": {**got["grads"], "fc.weight": None}},
        "proj.bias.grad differs from the matching slice": {"grads": {**got["grads"],
                                                                     "proj.bias": 2 * bias}},
    }  # fmt: skip
    for message, change in planted.items():
        said = exmp.tp_mlp_diagnosis({**got, **change}, ref, whole, x, 0, 2)
        assert said is not None and said.startswith(message), (message, said)
        assert code_like(said) == [], said
        assert "F.linear" not in said and ".apply" not in said and "self." not in said


# --------------------------------------------------------------------------- inside real ranks

F_BACKWARD = "        grad = grad.clone()\n        dist.all_reduce(grad)\n        return grad\n"


def _fg_variants() -> dict[str, str]:
    sol = SOLUTIONS["mp_fg"]
    head, sep, tail = sol.partition("class Leave")
    assert F_BACKWARD in head and "        return grad\n" in tail
    return {
        "mp_fg_no_f_backward": head.replace(F_BACKWARD, "        return grad\n") + sep + tail,
        "mp_fg_g_backward_reduces": head + sep + tail.replace("        return grad\n", F_BACKWARD),
        "mp_fg_g_forward_identity": head + sep + tail.replace(
            "        x = x.clone()\n        dist.all_reduce(x)\n", ""),
        # the module's own mistakes, which only running it on ranks shows
        "mp_tp_bias_every_rank": _variant(OUTPUT, "        return Leave.apply(self.proj(hidden))"),
        "mp_tp_no_g": _variant(OUTPUT, "        return partial + self.proj.bias"),
        "mp_tp_no_f": _variant(ENTER, "        pass"),
        "mp_tp_exact_gelu": _variant(', approximate="tanh")', ")"),
        "mp_tp_detached": _variant("F.gelu(self.fc(x), ",
                                   "F.gelu(F.linear(x, self.fc.weight.detach(), self.fc.bias), "),
    }  # fmt: skip


TP_RANK_MISTAKES = (
    "mp_tp_bias_every_rank",
    "mp_tp_no_g",
    "mp_tp_no_f",
    "mp_tp_exact_gelu",
    "mp_tp_detached",
)


@pytest.mark.parametrize("name", TP_RANK_MISTAKES)
def test_the_modules_forward_mistakes_pass_the_kernel_and_are_left_to_the_ranks(
    name, tmp_path, launches
):
    path = write(tmp_path, name, _fg_variants()[name])
    exmp.verify_file("03.f_and_g", path)  # shards right: only running it can tell
    assert [c["module"] for c in launches] == [name]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """One launch: solutions, a stub, wrong answers and a broken file, checked on 2 ranks."""
    folder = tmp_path_factory.mktemp("mp_exercise")
    files = {f"{name}_sol": SOLUTIONS[name] for name in FILES.values()}
    files |= {"mp_fg_stub": STUBS["mp_fg"], **_fg_variants(), "mp_broken": "def (:\n"}
    files["mp_column_all"] = (
        "def column_parallel_linear(x, linear, rank, world_size):\n    return linear(x)\n"
    )
    cases = {
        "order": ("03.one_f_one_b", "mp_order_sol"),
        "fg": ("03.f_and_g", "mp_fg_sol"),
        "column": ("03.column_parallel", "mp_column_sol"),
        "fg_stub": ("03.f_and_g", "mp_fg_stub"),
        **{name: ("03.f_and_g", name) for name in _fg_variants()},
        "column_all": ("03.column_parallel", "mp_column_all"),
        "broken": ("03.f_and_g", "mp_broken"),
    }
    specs = [{"exercise": exercise_id, "module": module,
              "path": str(write(folder, module, files[module])),
              "names": list(exmp.EXERCISES[exercise_id])}
             for exercise_id, module in cases.values()]  # fmt: skip
    job = launch.run(exmp.CasesConfig(cases=specs), nproc=2, device="cpu", timeout_s=180,
                     pg_timeout_s=30, stream=False)  # fmt: skip
    return {key: [r["cases"][i] for r in job.ranks] for i, key in enumerate(cases)}


@pytest.mark.slow
def test_solutions_pass_inside_the_ranks(ranks):
    for key in ("order", "fg", "column"):
        assert [r["status"] for r in ranks[key]] == ["ok", "ok"], ranks[key]
    said = exmp.raise_for_results("03.one_f_one_b", ranks["order"])
    assert "real 2-stage pipeline" in said and "same loss" in said and "holding 2 of m=4" in said
    said = exmp.raise_for_results("03.f_and_g", ranks["fg"])
    assert "dL/dx (the same on every rank)" in said and "equal the unsplit MLP's" in said
    assert "all-gathered shards" in exmp.raise_for_results("03.column_parallel", ranks["column"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("key", "status", "message"),
    [
        ("fg_stub", "incomplete", "Exercise 03.f_and_g is not done yet: "),
        ("mp_fg_no_f_backward", "failed", "f's backward must all-reduce"),
        ("mp_fg_g_backward_reduces", "failed", "2× too large: g's backward must return the gradient"),
        ("mp_fg_g_forward_identity", "failed", "g's forward must all-reduce"),
        ("mp_tp_bias_every_rank", "failed",
         "your TensorParallelMLP: Likely: the output is off by (world_size − 1) × proj.bias, here "
         "1 × proj.bias: the bias is added on every rank before g sums the ranks' outputs"),
        ("mp_tp_no_g", "failed", "the output is this rank's partial sum, not the whole MLP's: g is missing"),
        ("mp_tp_no_f", "failed", "the input gradients differ across ranks: each holds only its own part "
         "of dL/dx, the part its slice of fc produced, so f is missing"),
        ("mp_tp_exact_gelu", "failed", "the MLP's with exact GELU"),
        ("mp_tp_detached", "failed", "fc.weight received no gradient"),
        ("column_all", "failed", "the output has all 24 features"),
        ("broken", "failed", "raised SyntaxError"),
    ],
)  # fmt: skip
def test_mistakes_are_reported_by_every_rank_without_crashing_the_job(ranks, key, status, message):
    for rank in ranks[key]:
        assert rank["status"] == status and message in rank["message"], rank
        if key.startswith(("mp_fg_", "mp_tp_")):  # a diagnosis in words, never the fix's code
            said = rank["message"].split("Likely: ", 1)[-1]
            assert code_like(said) == [] and "F.linear(" not in said, said
