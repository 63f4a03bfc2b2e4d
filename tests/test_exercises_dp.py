"""The data-parallel exercises of notebook 02: checks pass on the solution, fail helpfully.

The solutions are read from ``solutions/02_data_parallelism.ipynb`` itself (its ``%%writefile``
cells), and the stubs are generated from them with ``labkit.course.nbgen``, as the learner's notebook
is: so the notebook's own solution code is what passes here. Most checks run in this process
on a 1-rank gloo group (HashStore: no port, no process): the timing mistakes (a blocking
all-reduce, a wait inside backward, all-reduces started after backward) and the ZeRO-1 order
show there. Mistakes that only show with several ranks (a sum not averaged, ranks that start
from different weights, a bucket never sent) are caught in real 2-rank launches of the worker.
"""

from __future__ import annotations

import dataclasses
import re
import textwrap
from pathlib import Path

import nbformat
import pytest
import torch.distributed as tdist
from exercise_cells import assert_check_passes, assert_stub_is_not_done, stub_of

from labkit.course import exercises as ex
from labkit.course.exercises import data_parallel as exdp
from labkit.course.exercises import registry as exercise_registry
from labkit.course.exercises.data_parallel import check_ddp as dp_check_ddp
from labkit.course.exercises.data_parallel import reference as dp_reference
from labkit.course.exercises.data_parallel import strategy as dp_strategy
from labkit.jobs import launch

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "solutions" / "02_data_parallelism.ipynb"
FILES = {  # the file each exercise's %%writefile cell writes -> the exercise it checks
    "dp_overlap": "02.allreduce_grads",
    "dp_buckets": "02.bucketed_ddp",
    "dp_zero1": "02.zero1_step",
}


def writefile_cells() -> dict[str, str]:
    """Module name -> the source of the notebook cell that writes it (magic line included)."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    cells = {}
    for cell in nb.cells:
        first = cell.source.split("\n", 1)[0]
        if cell.cell_type == "code" and first.startswith("%%writefile"):
            cells[Path(first.split()[-1]).stem] = cell.source
    return cells


def body(cell_source: str) -> str:
    """What %%writefile writes: the cell without its magic line."""
    return cell_source.split("\n", 1)[1] + "\n"


def as_answer_cell(module: str) -> str:
    """The cell's code as a plain cell that ends with ``answer = <the class>`` (the form
    tests/exercise_cells.py runs), magic line removed."""
    return body(writefile_cells()[module]) + f"answer = {exdp.EXERCISES[FILES[module]]}\n"


def write(folder: Path, module: str, source: str) -> Path:
    path = folder / f"{module}.py"
    path.write_text(textwrap.dedent(source))
    return path


@pytest.fixture(scope="module")
def group():
    """A 1-rank gloo process group in this process."""
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    yield
    tdist.destroy_process_group()


def run_one(tmp_path: Path, exercise_id: str, name: str, source: str) -> dict:
    write(tmp_path, name, source)
    [res] = exdp.run_checks([exercise_id], name, tmp_path)
    return res


# --------------------------------------------------------------------------- the notebook's cells


def test_the_notebook_writes_one_file_per_exercise_and_checks_it_in_workers():
    cells = writefile_cells()
    assert set(cells) == set(FILES)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    for module, exercise_id in FILES.items():
        assert f'ex.check_in_workers("{exercise_id}", ex_dir / "{module}.py")' in text
        assert f"class {exdp.EXERCISES[exercise_id]}" in cells[module]


@pytest.mark.parametrize("module", sorted(FILES))
def test_solution_passes_in_process_and_so_does_the_reference(group, module, capsys):
    assert_check_passes(FILES[module], as_answer_cell(module), capsys)


@pytest.mark.parametrize("module", sorted(FILES))
def test_stub_is_not_done(group, module, capsys):
    secrets = {"dp_overlap": ["async_op=True"], "dp_buckets": ["reversed(params)"],
               "dp_zero1": ["reduce_scatter_single(", "-(-numel"]}[module]  # fmt: skip
    assert_stub_is_not_done(FILES[module], as_answer_cell(module), capsys, secrets=secrets)
    stub = stub_of(writefile_cells()[module])
    assert stub.split("\n", 1)[0] == writefile_cells()[module].split("\n", 1)[0]  # magic kept


def test_solutions_pass_and_stubs_say_not_done_from_their_files(group, tmp_path):
    cells = writefile_cells()
    for module, exercise_id in FILES.items():
        good = run_one(tmp_path, exercise_id, f"good_{module}", body(cells[module]))
        assert good["status"] == "ok", good["message"]
        stub = run_one(tmp_path, exercise_id, f"stub_{module}", body(stub_of(cells[module])))
        assert stub == {
            "id": exercise_id,
            "status": "incomplete",
            "message": f"Exercise {exercise_id} is not done yet: {ex.get(exercise_id).hints[0]}",
        }


def test_checks_are_registered_with_hints_in_steps_and_need_a_process_group(monkeypatch):
    assert [e.id for e in ex.catalogue("02")] == sorted([*exdp.EXERCISES, "02.choose_strategy"])
    for e in ex.catalogue("02"):
        assert len(e.hints) >= 3 and e.hints[-1].startswith("recipe:")
    monkeypatch.setattr(tdist, "is_initialized", lambda: False)  # as in a notebook kernel
    with pytest.raises(RuntimeError, match="check_in_workers"):
        ex.verify("02.allreduce_grads", exdp.OverlapDDP)


# --------------------------------------------------------------------------- overlap: timing

OVERLAP = """
import torch.distributed as dist

class OverlapDDP:
    def __init__(self, model, world_size):
        self.world_size = world_size
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.handles = []
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, p):
        {hook}

    def finish_gradient_sync(self):
        {finish}
"""

OVERLAP_MISTAKES = {
    "waits_in_the_hook": (
        "self.handles.append((p, dist.all_reduce(p.grad, async_op=True))); self.handles[-1][1].wait()",
        "for p, h in self.handles: p.grad /= self.world_size\n        self.handles.clear()",
        "waited on inside backward",
    ),
    "blocking_all_reduce": (
        "dist.all_reduce(p.grad); self.handles.append(p)",
        "for p in self.handles: p.grad /= self.world_size\n        self.handles.clear()",
        "async_op=False inside backward",
    ),
    "all_reduce_after_backward": (
        "pass",
        "for p in self.params:\n            dist.all_reduce(p.grad)\n"
        "            p.grad /= self.world_size",
        "after backward had ended, so none of them ran while backward was computing",
    ),
    "never_waits": (
        "self.handles.append((p, dist.all_reduce(p.grad, async_op=True)))",
        "for p, h in self.handles: p.grad /= self.world_size\n        self.handles.clear()",
        "never waited on before finish_gradient_sync() returned",
    ),
    # review N02-10: the list of handles is never emptied, so step 2 averages step 1's again
    "handles_never_emptied": (
        "self.handles.append((p, dist.all_reduce(p.grad, async_op=True)))",
        "for p, h in self.handles:\n            h.wait()\n            p.grad /= self.world_size",
        "finish_gradient_sync() waited on 16 handles that step 1 started: they were still in "
        "the list",
    ),
}

# What a failure message must not hand over: the code of the fix (review N02-8). The graded
# hints (ex.hint) carry it; a message says what went wrong and why.
GIVEAWAYS = ("async_op=True", "reduce_scatter_single", "all_gather_single", "self.inner.step()",
             "register_post_accumulate_grad_hook", "dist.broadcast(", "view_as", ".copy_(")


def assert_diagnoses_without_code(message: str) -> None:
    given = [g for g in GIVEAWAYS if g in message]
    assert not given, f"the message hands over {given}: {message}"


@pytest.mark.parametrize("mistake", sorted(OVERLAP_MISTAKES))
def test_overlap_timing_mistakes_are_named(group, mistake, tmp_path):
    hook, finish, expected = OVERLAP_MISTAKES[mistake]
    source = textwrap.dedent(OVERLAP).replace("{hook}", hook).replace("{finish}", finish)
    res = run_one(tmp_path, "02.allreduce_grads", f"overlap_{mistake}", source)
    assert res["status"] == "failed"
    assert expected in res["message"], res["message"]
    assert_diagnoses_without_code(res["message"])


def test_a_hook_on_the_frozen_parameter_is_reported_with_the_error(group, tmp_path):
    source = textwrap.dedent(OVERLAP).replace("if p.requires_grad]", "]").replace(
        "{hook}", "self.handles.append((p, dist.all_reduce(p.grad, async_op=True)))"
    ).replace("{finish}", "pass")
    res = run_one(tmp_path, "02.allreduce_grads", "overlap_frozen", source)
    assert res["status"] == "failed"
    assert "OverlapDDP(" in res["message"] and "raised RuntimeError" in res["message"]


# --------------------------------------------------------------------------- buckets



def bucketed_source(**replace: str) -> str:
    """The notebook's solution with pieces of it replaced."""
    source = body(writefile_cells()["dp_buckets"])
    for old, new in replace.items():
        assert old in source, old
        source = source.replace(old, new)
    return source


BUCKET_MISTAKES = {
    # the classic: close a bucket when it reaches the cap, forget the open one after the loop
    "last_bucket_never_sent": (
        {"        for group in groups:  # the last group too, however small\n":
         "        for group in groups[:-1]:  # (forgets the last, small, group)\n",
         "        for p in params:\n            p.register_post_accumulate_grad_hook":
         "        for p in [q for b in self.buckets for q in b['params']]:\n"
         "            p.register_post_accumulate_grad_hook"},
        "never reaches the cap, and that bucket was never sent",
    ),
    # review N02-9: the same mistake with a hook on every parameter: the learner's lookup of
    # the parameter the forgotten bucket would hold raises KeyError inside backward
    "last_bucket_forgotten_with_hooks_on_every_parameter": (
        {"        for group in groups:  # the last group too, however small\n":
         "        for group in groups[:-1]:  # (forgets the last, small, group)\n"},
        "is in no bucket, so its hook found nowhere to put it",
    ),
    # review N02-5: buckets grouped in forward parameter order, each still sent as it fills
    "forward_order": (
        {"for p in reversed(params):": "for p in params:"},
        "are the parameters grouped in the order model.parameters() lists them",
    ),
    "one_message_per_gradient": (
        {"if groups[-1] and size + nbytes > cap_bytes:": "if groups[-1]:"},
        "one message per gradient is not bucketing",
    ),
    "waits_in_the_hook": (
        {'bucket["handle"] = dist.all_reduce(bucket["buffer"], async_op=True)':
         'bucket["handle"] = dist.all_reduce(bucket["buffer"], async_op=True)\n'
         '            bucket["handle"].wait()'},
        "waited on inside backward",
    ),
    "one_bucket_for_everything": (
        {"cap_bytes = bucket_cap_mb * 2**20": "cap_bytes = float('inf')"},
        "a bucket holds up to the cap",
    ),
}


@pytest.mark.parametrize("mistake", sorted(BUCKET_MISTAKES))
def test_bucketed_mistakes_are_named(group, mistake, tmp_path):
    replace, expected = BUCKET_MISTAKES[mistake]
    res = run_one(tmp_path, "02.bucketed_ddp", f"bucket_{mistake}", bucketed_source(**replace))
    assert res["status"] == "failed"
    assert expected in res["message"], res["message"]
    assert_diagnoses_without_code(res["message"])
    assert "KeyError: " not in res["message"]  # named, not a bare key


def test_the_bucket_order_check_tells_forward_from_reverse_on_the_check_model():
    """The forward-order message needs the two groupings to differ on CheckLM at the check's
    cap; the notebook's solution (reverse) must give the reverse grouping."""
    import torch

    params = [p for _, p in dp_reference.trainable_params(dp_reference.check_model(0, torch.device("cpu")))]
    cap = int(exdp.BUCKET_CAP_MB * 2**20)
    reverse = dp_check_ddp._greedy_bucket_bytes(reversed(params), cap)
    forward = dp_check_ddp._greedy_bucket_bytes(params, cap)
    assert sorted(reverse) != sorted(forward)
    assert sum(reverse) == sum(forward) == sum(p.numel() * 4 for p in params)
    assert all(b <= cap for b in reverse) and reverse[-1] < cap / 2  # the small last bucket


# --------------------------------------------------------------------------- ZeRO-1


def zero1_source(**replace: str) -> str:
    source = body(writefile_cells()["dp_zero1"])
    for old, new in replace.items():
        assert old in source, old
        source = source.replace(old, new)
    return source


CEIL = "shard = -(-numel // world_size)  # ceil without floats"
SHARD_MISTAKES = {
    "floor_loses_the_remainder": ({CEIL: "shard = numel // world_size"}, "belong(s) to no rank"),
    "remainder_to_the_last_rank": (
        {"return rank * shard, (rank + 1) * shard":
         "return rank * (numel // world_size), numel if rank == world_size - 1 else "
         "(rank + 1) * (numel // world_size)"},
        "pad the buffer with zeros",
    ),
    "too_much_padding": ({CEIL: "shard = numel // world_size + 1"}, "fewer than world_size"),
    "not_a_pair": ({"return rank * shard, (rank + 1) * shard": "return slice(0, numel)"},
                   "return a tuple of two ints"),
    "gap": ({"return rank * shard, (rank + 1) * shard":
             "return rank * shard + rank, (rank + 1) * shard + rank"}, "tile the buffer from 0"),
}


@pytest.mark.parametrize("mistake", sorted(SHARD_MISTAKES))
def test_shard_bound_mistakes_are_named_before_any_collective(mistake, tmp_path, monkeypatch):
    """The rules are checked for every rank of every case before the check needs a process
    group (here there is none): every rank reaches the same verdict, so none is left waiting
    in a collective."""
    monkeypatch.setattr(tdist, "is_initialized", lambda: False)
    replace, expected = SHARD_MISTAKES[mistake]
    res = run_one(tmp_path, "02.zero1_step", f"zero1_{mistake}", zero1_source(**replace))
    assert res["status"] == "failed"
    assert res["message"].startswith("Exercise 02.zero1_step (")
    assert expected in res["message"], res["message"]


GATHER = "        dist.all_gather_single(self.flat, self.shard.detach())  # everyone's updated shards\n"
UPDATE = "        self.inner.step()  # AdamW on my shard only\n"
STEP_MISTAKES = {
    "all_gather_before_the_update": ({UPDATE + GATHER: GATHER + UPDATE},
                                     "the all-gather ran before the update"),
    "all_reduce_instead_of_reduce_scatter": (
        {"dist.reduce_scatter_single(shard_grad, grads)  # the sum over ranks of my shard":
         "dist.all_reduce(grads); shard_grad.copy_(grads[self.start:self.stop])"},
        "the gradients were all-reduced, so every rank received the sum of all of them",
    ),
    "no_copy_back": (
        {"            p.copy_(self.flat[offset : offset + p.numel()].view_as(p))\n": ""},
        "the gathered weights never reached the parameters",
    ),
    "whole_model_to_the_optimizer": (
        {"self.inner = make_optimizer([self.shard])":
         "self.inner = make_optimizer([self.shard]); make_optimizer(self.params)"},
        "called make_optimizer 2 times",
    ),
}


@pytest.mark.parametrize("mistake", sorted(STEP_MISTAKES))
def test_zero1_step_mistakes_are_named(group, mistake, tmp_path):
    replace, expected = STEP_MISTAKES[mistake]
    res = run_one(tmp_path, "02.zero1_step", f"step_{mistake}", zero1_source(**replace))
    assert res["status"] == "failed"
    assert expected in res["message"], res["message"]
    assert_diagnoses_without_code(res["message"])


# --------------------------------------------------------------------------- files and reports


def test_broken_or_missing_files_fail_with_the_fix(tmp_path):
    [res] = exdp.run_checks(["02.allreduce_grads"], "nowhere", tmp_path)
    assert res["status"] == "failed" and "run the %%writefile cell" in res["message"]
    write(tmp_path, "broken", "class OverlapDDP\n    pass\n")
    [res] = exdp.run_checks(["02.allreduce_grads"], "broken", tmp_path)
    assert res["status"] == "failed" and "is not valid Python" in res["message"]
    write(tmp_path, "other", "def something_else():\n    pass\n")
    [res] = exdp.run_checks(["02.allreduce_grads"], "other", tmp_path)
    assert res["status"] == "failed" and "defines no OverlapDDP()" in res["message"]


def test_a_rewritten_file_is_read_again(group, tmp_path):
    """The learner edits the cell and runs it again: the check must see the new code."""
    cells = writefile_cells()
    write(tmp_path, "dp_zero1", body(stub_of(cells["dp_zero1"])))
    assert exdp.run_checks(["02.zero1_step"], "dp_zero1", tmp_path)[0]["status"] == "incomplete"
    write(tmp_path, "dp_zero1", body(cells["dp_zero1"]))
    assert exdp.run_checks(["02.zero1_step"], "dp_zero1", tmp_path)[0]["status"] == "ok"


def _ranks(*statuses: str) -> list[dict]:
    return [
        {"results": [{"id": "02.zero1_step", "status": s, "message": f"{s} on rank {r}"}]}
        for r, s in enumerate(statuses)
    ]


def test_summary_is_rank_0s_sentence_when_every_rank_passes():
    assert exdp.summarize("02.zero1_step", _ranks("ok", "ok")) == "ok on rank 0"


def test_summary_raises_the_first_failure_before_a_stub():
    with pytest.raises(ex.ExerciseFailed, match="failed on rank 1") as info:
        exdp.summarize("02.zero1_step", _ranks("incomplete", "failed"))
    assert info.value.exercise_id == "02.zero1_step"
    with pytest.raises(ex.ExerciseIncomplete, match="incomplete on rank 0"):
        exdp.summarize("02.zero1_step", _ranks("incomplete", "ok"))
    with pytest.raises(ex.ExerciseFailed, match=r"rank 1 of 2 reported nothing: it ended before "
                       r"its check was done \(a sys.exit or os._exit in your code\?\)"):  # fmt: skip
        exdp.summarize("02.zero1_step", [_ranks("ok")[0], {}])


def test_bad_arguments_fail_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match=r"exercise_id=.02\.nope."):
        exdp.verify_file("02.nope", tmp_path / "x.py")
    with pytest.raises(ValueError, match=r"must end in \.py"):
        exdp.verify_file("02.zero1_step", tmp_path / "x.txt")


def test_a_stub_file_is_reported_not_done_in_one_line_without_launching(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(launch, "run", lambda *a, **k: pytest.fail("a stub needs no job"))
    cells = writefile_cells()
    for module, exercise_id in FILES.items():
        path = write(tmp_path, module, body(stub_of(cells[module])))
        assert ex.check_in_workers(exercise_id, path) is None  # no exception: Run All goes on
        out = capsys.readouterr().out
        assert out.startswith(f"○ {exercise_id} (") and out.count("\n") == 1
        assert ex.get(exercise_id).hints[0] in out


def test_a_missing_file_is_a_failure_that_says_which_cell_to_run(tmp_path, capsys):
    ex.check_in_workers("02.zero1_step", tmp_path / "dp_zero1.py")
    out = capsys.readouterr().out
    assert out.startswith("✗ 02.zero1_step (") and "run the %%writefile cell" in out


def test_workspace_lives_under_labkit_home(monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    assert ex.workspace("02") == tmp_path / "exercises" / "02"
    assert ex.workspace("02").is_dir()


def test_the_check_model_has_the_traps_the_messages_promise():
    model = exdp.CheckLM()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names[0] == "scale" and model.scale.numel() == 1  # finished last, tiny
    assert "wpe.weight" not in names and model.head.weight is model.wte.weight
    assert sum(p.numel() for n, p in model.named_parameters() if p.requires_grad) % 2 == 1
    assert [n for n, _ in model.named_buffers()] == ["shift"]


def test_the_reference_gradients_are_torch_ddps(group):
    """The checks compare with DDP's semantics computed by hand (torch DDP's first use imports
    torch._dynamo: seconds every check job would pay); here, torch DDP itself agrees."""
    import torch

    model = dp_reference.check_model(3, torch.device("cpu"))
    batches = dp_reference.rank_batches(0, 1, torch.device("cpu"))
    mine, mine_model = dp_reference.reference_ddp(model, batches)
    torchs, torch_model = dp_reference.reference_ddp(model, batches, exdp.BUCKET_CAP_MB, use_torch_ddp=True)
    assert len(mine) == len(torchs) == exdp.STEPS
    for a, b in zip(mine, torchs, strict=True):
        assert a.keys() == b.keys() and "wpe.weight" not in a
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(p, q) for p, q in zip(mine_model.parameters(), torch_model.parameters(),
                                                 strict=True))  # fmt: skip


# --------------------------------------------------------------------------- real ranks


@pytest.mark.slow
def test_in_two_worker_processes_the_multi_rank_mistakes_are_caught(tmp_path):
    """One 2-rank job, three exercises, three mistakes one rank cannot see: an all-reduce
    without the division (DDP), a last bucket never sent (buckets), a reduce-scatter without
    the division (ZeRO-1). Each fails with the factor or the parameters, and the fix."""
    overlap = textwrap.dedent(OVERLAP).replace(
        "{hook}", "self.handles.append((p, dist.all_reduce(p.grad, async_op=True)))"
    ).replace("{finish}", "for p, h in self.handles: h.wait()\n        self.handles.clear()")
    buckets = bucketed_source(**BUCKET_MISTAKES["last_bucket_never_sent"][0])
    zero1 = zero1_source(**{"self.shard.grad = shard_grad / self.world_size":
                            "self.shard.grad = shard_grad"})  # fmt: skip
    source = "\n".join(
        [overlap, buckets.replace("import torch\nimport torch.distributed as dist\n", ""),
         zero1.replace("import torch\nimport torch.distributed as dist\n", "")]
    )  # fmt: skip
    write(tmp_path, "dp_mixed", "import torch\n" + source)
    res = launch.run(
        exdp.DPChecksConfig(exercises=sorted(exdp.EXERCISES), module="dp_mixed",
                            module_dir=str(tmp_path)),
        nproc=2,
        device="cpu",
        stream=False,
        timeout_s=120,
    )  # fmt: skip
    assert [r["world_size"] for r in res.ranks] == [2, 2]
    messages = {}
    for exercise_id in exdp.EXERCISES:
        with pytest.raises(ex.ExerciseFailed) as info:
            exdp.summarize(exercise_id, res.ranks)
        messages[exercise_id] = str(info.value)
    assert "it is 2x the average" in messages["02.allreduce_grads"]
    assert "divide by world_size" in messages["02.allreduce_grads"]
    assert re.search(r"the gradients of (scale, wte.weight|wte.weight, scale) were never "
                     r"all-reduced", messages["02.bucketed_ddp"]), messages["02.bucketed_ddp"]  # fmt: skip
    assert "was the last, still open bucket ever closed?" in messages["02.bucketed_ddp"]
    assert "it is 2x the average: reduce-scatter sums" in messages["02.zero1_step"]


@pytest.mark.slow
def test_ranks_that_start_from_different_weights_are_caught(tmp_path):
    """Without the broadcast each rank keeps its own initialisation (the check seeds them
    differently, as separate processes would be): one rank alone cannot see it."""
    path = write(tmp_path, "dp_nobroadcast", exdp_source_without_broadcast())
    with pytest.raises(ex.ExerciseFailed) as info:
        exdp.verify_file("02.allreduce_grads", path, timeout_s=90)
    message = str(info.value)
    assert "the ranks hold different values of wte.weight" in message, message
    assert "starts every rank from rank 0's parameters and buffers" in message
    assert_diagnoses_without_code(message)


@pytest.mark.slow
def test_averaged_buckets_that_never_reach_the_gradients_are_named(tmp_path):
    """Review N02-9: every bucket all-reduced and averaged, nothing copied back into p.grad.
    Each gradient then equals this rank's own, which only a second rank can tell from the
    average; the check must not call that "never all-reduced"."""
    source = bucketed_source(**{
        "                p.grad.copy_(bucket[\"buffer\"][offset : offset + p.numel()].view_as(p))\n":
        "                pass\n"})  # fmt: skip
    path = write(tmp_path, "dp_buckets_no_copy", source)
    with pytest.raises(ex.ExerciseFailed) as info:
        exdp.verify_file("02.bucketed_ddp", path, timeout_s=90)
    message = str(info.value)
    assert "every gradient still holds this rank's own gradient" in message, message
    assert "the averaged buckets never reached p.grad" in message
    assert "never all-reduced" not in message


def exdp_source_without_broadcast() -> str:
    source = body(writefile_cells()["dp_overlap"])
    line = "            dist.broadcast(t.data, src=0)  # every rank starts from rank 0's weights\n"
    assert line in source
    return source.replace(line, "            pass\n")


@pytest.mark.slow
def test_a_rank_that_dies_is_reported_as_a_failed_exercise(tmp_path, capsys):
    path = write(tmp_path, "dp_dies", """
        import os
        import torch.distributed as dist
        class OverlapDDP:
            def __init__(self, model, world_size):
                if dist.get_rank() == 1:
                    os._exit(3)  # a crash, not an exception the check could catch
                for t in model.parameters():
                    dist.broadcast(t.data, src=0)
            def finish_gradient_sync(self):
                pass
        """)  # fmt: skip
    with pytest.raises(ex.ExerciseFailed) as info:
        exdp.verify_file("02.allreduce_grads", path, timeout_s=60)
    message = str(info.value)
    assert message.startswith("Exercise 02.allreduce_grads failed: the check job failed on rank 1")
    assert "exited with code 3" in message and "Logs: " in message
    assert info.value.exercise_id == "02.allreduce_grads"
    assert "✓" not in capsys.readouterr().out


@pytest.mark.slow
def test_a_learner_loop_that_never_ends_is_found_in_the_learners_line(tmp_path):
    """Rank 1 loops in the learner's code; rank 0 waits for it in a broadcast until its
    process group times out (data_parallel.PG_TIMEOUT_S, well before the job's 60 s), and
    asks rank 1 where it is first. The loop is the cause."""
    path = write(tmp_path, "dp_loops", """
        import torch.distributed as dist
        class OverlapDDP:
            def __init__(self, model, world_size):
                done = dist.get_rank() == 0
                while not done:
                    pass
                for t in model.parameters():
                    dist.broadcast(t.data, src=0)
            def finish_gradient_sync(self):
                pass
        """)  # fmt: skip
    with pytest.raises(ex.ExerciseFailed) as info:
        exdp.verify_file("02.allreduce_grads", path, timeout_s=60)
    message = str(info.value)
    assert "the check did not finish: rank 0 waited in dist.broadcast at dp_loops.py" in message, message
    assert "which rank 1 never reached" in message
    assert re.search(r"rank 1 was at dp_loops\.py, line [67], in __init__: "
                     r"`(while not done:|pass)`", message), message  # fmt: skip
    assert "Timed out waiting" not in message and "ranks []" not in message


def test_a_file_whose_top_level_never_finishes_is_stopped_by_the_time_limit(
    tmp_path, monkeypatch, capsys
):
    """The kernel imports the learner's file (to spot a stub) before any job starts: a loop at
    its top level must not hang the cell."""
    monkeypatch.setitem(exercise_registry._REGISTRY, "02.allreduce_grads",
                        dataclasses.replace(ex.get("02.allreduce_grads"), time_limit_s=1.0))  # fmt: skip
    path = write(tmp_path, "dp_toplevel", """
        while True:
            pass
        class OverlapDDP:
            pass
        """)  # fmt: skip
    ex.check_in_workers("02.allreduce_grads", path)
    out = capsys.readouterr().out
    assert "✗ 02.allreduce_grads" in out and "did not finish within 1 s" in out, out
    assert "dp_toplevel.py, line 2" in out


@pytest.mark.slow
def test_the_overlap_benchmark_times_every_variant_and_models_each(tmp_path):
    """benchmarks/bench_dp_overlap.py runs the reference classes above in one 2-rank job; its
    record holds every variant's samples, ratios to naive and the α–β prediction beside them.
    Nothing about speed is asserted (benchmarks/README.md)."""
    import json
    import sys

    if str(ROOT) not in sys.path:  # `benchmarks` is a folder of the checkout, not of labkit
        sys.path.insert(0, str(ROOT))
    from benchmarks import _common, bench_dp_overlap

    out = tmp_path / "record.json"
    assert bench_dp_overlap.main(["--size", "smoke", "--rounds", "1", "--warmup", "0",
                                  "--out", str(out)]) == 0  # fmt: skip
    record = json.loads(out.read_text())
    _common.check_record(record)
    variants = ["naive", "overlap"] + [f"bucketed_{f:g}" for f in bench_dp_overlap.CAP_FRACTIONS]
    assert sorted(record["samples_s"]) == sorted(variants)
    assert sorted(record["ratios"]) == sorted(f"{v}/naive" for v in variants if v != "naive")
    rows = {row["variant"]: row for row in record["sweep"]}
    assert rows["bucketed_1"]["buckets"] == 1  # the whole gradient in one bucket
    assert rows["overlap"]["buckets"] == record["model"]["n_params"]  # one message each
    assert all(row["predicted_s"] > 0 and row["measured_s"] > 0 for row in rows.values())


@pytest.mark.slow
def test_the_benchmark_times_the_learners_class_and_counts_the_messages_it_sends(tmp_path):
    """Notebook 02 times the learner's own classes: a file whose OverlapDDP sends all the
    gradients in one message must show up as one message (counted from the all_reduce
    calls in the ranks, not read from the class), and the reference stays for the other."""
    from labkit.course.exercises.data_parallel import bench as dp_bench

    path = tmp_path / "one_message.py"
    path.write_text(
        "from labkit.course.exercises.data_parallel import BucketedDDP\n\n\n"
        "class OverlapDDP(BucketedDDP):\n"
        "    def __init__(self, model, world_size):\n"
        "        super().__init__(model, world_size, bucket_cap_mb=1e6)\n",
        encoding="utf-8",
    )
    res = dp_bench.run(size="smoke", rounds=1, warmup=0, files={"OverlapDDP": path})
    rows = {r["variant"]: r for r in res["sweep"]}
    assert rows["overlap"]["buckets"] == 1 and rows["naive"]["buckets"] == res["n_params"]
    assert res["classes"] == {"OverlapDDP": str(path), "BucketedDDP": "reference"}
    assert sum(res["messages_bytes"]["overlap"]) == res["grad_bytes"]
    with pytest.raises(ValueError, match="the classes are"):
        dp_bench.run(files={"NaiveDDP": path})


def test_a_busy_moment_that_defeats_the_alpha_beta_fit_is_named_not_raised(monkeypatch):
    """CI once timed the large all-reduce faster than the small one: no line fits. The job must
    carry on with a labelled fallback, not stop the notebook cell."""
    import torch

    from labkit.course.exercises.data_parallel import bench as dp_bench

    times = iter([0.004, 0.003] * 3)  # small slower than large, three times over
    monkeypatch.setattr(dp_bench, "_time_allreduce", lambda numel, device, repeats: next(times))
    a, slope, t_small, t_large, note = dp_bench._alpha_beta(torch.device("cpu"), 256, 2**20)
    # review N02-2: the slope is bytes per second, as formulas.alpha_beta_fit's
    assert (a, t_small, t_large) == (0.004, 0.004, 0.003) and slope == 4 * 2**20 / 0.003
    assert "no α–β line fitted" in note
    # the large message's modelled time is then the two timings added, not 1e15 seconds
    from labkit import formulas

    modelled = formulas.ring_allreduce_time(4 * 2**20, 2, a / 2, slope)
    assert modelled == pytest.approx(0.004 + 0.003)
    times = iter([0.001, 0.010])
    assert dp_bench._alpha_beta(torch.device("cpu"), 256, 2**20)[4] == ""


# --------------------------------------------------------------------------- the sweep's verdict


def _sweep(predicted_ms: dict[int, float], measured_ms: dict[int, list[float]]) -> dict:
    """A dp_bench.run result with only what sweep_verdict reads: buckets -> predicted step and
    the measured samples of each cap."""
    rows = [{"variant": f"bucketed_{k}", "buckets": k, "predicted_s": p / 1e3,
             "measured_s": sorted(measured_ms[k])[len(measured_ms[k]) // 2] / 1e3}
            for k, p in predicted_ms.items()]  # fmt: skip
    return {"sweep": rows, "grad_bytes": 3 * 2**20, "alpha_s": 100e-6, "beta_bytes_per_s": 1e9,
            "backward_s": 0.25,
            "samples_s": {f"bucketed_{k}": [t / 1e3 for t in v] for k, v in measured_ms.items()}}


STEADY = [100.0, 100.5, 99.5, 100.2, 99.8, 100.1, 99.9]


def test_a_flat_prediction_is_said_to_predict_no_difference():
    """Review N02-3: predictions that tie must not crown a "predicted best"."""
    from labkit.course.exercises.data_parallel import bench as dp_bench

    res = _sweep({51: 379.6, 22: 379.6, 5: 379.6, 1: 382.2},
                 {k: [t + d for t in STEADY] for k, d in ((51, 0), (22, 0.3), (5, 0.1), (1, 0.2))})
    text = dp_bench.sweep_verdict(res)
    assert "the model predicts no difference between the caps at this size" in text, text
    assert "predicted best" not in text and " is best" not in text
    assert "agree within 10%" in text
    assert text.endswith("Prediction and measurement agree: no cap stands out at this size.")


def test_a_shaped_prediction_names_its_best_and_meets_the_measurement():
    from labkit.course.exercises.data_parallel import bench as dp_bench

    res = _sweep({51: 160.0, 22: 120.0, 5: 100.0, 1: 140.0},
                 {51: [t * 1.6 for t in STEADY], 22: [t * 1.2 for t in STEADY],
                  5: STEADY, 1: [t * 1.4 for t in STEADY]})  # fmt: skip
    text = dp_bench.sweep_verdict(res)
    assert "predicted (α–β): 5 buckets is best, 60.0 ms faster than 51 buckets" in text, text
    assert "verdict: fastest cap, 5 buckets is faster than slowest cap, 51 buckets" in text
    assert text.endswith("Prediction and measurement agree: 5 buckets is best.")
    swapped = _sweep({51: 160.0, 22: 120.0, 5: 100.0, 1: 140.0},
                     {51: [t * 1.6 for t in STEADY], 22: STEADY,
                      5: [t * 1.2 for t in STEADY], 1: [t * 1.4 for t in STEADY]})  # fmt: skip
    assert dp_bench.sweep_verdict(swapped).endswith(
        "They disagree: the model predicted 5 buckets best, the measurement found 22 buckets.")


# --------------------------------------------------------------------------- 02.choose_strategy
# A decision checked in the kernel: which strategy to run in a per-rank memory budget.


def choice_cell() -> str:
    """The notebook's choose_strategy cell."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    [cell] = [c.source for c in nb.cells
              if c.cell_type == "code" and "def choose_strategy(" in c.source]  # fmt: skip
    return cell


def choice_answer_cell(source: str) -> str:
    """The cell's function, ending in ``answer = choose_strategy`` (without its check)."""
    return source.split("\n\nwith exdp.checking_on(", 1)[0] + "\nanswer = choose_strategy\n"


def test_the_notebook_checks_its_choice_on_its_own_measurements_first():
    cell = choice_cell()
    assert ("with exdp.checking_on(measured, budget_bytes):" in cell
            and 'choose_strategy = ex.check("02.choose_strategy", choose_strategy)' in cell)  # fmt: skip


def test_choice_solution_passes_and_so_does_the_reference(capsys):
    assert_check_passes("02.choose_strategy", choice_answer_cell(choice_cell()), capsys)


def test_choice_stub_is_not_done(capsys):
    assert_stub_is_not_done("02.choose_strategy", choice_answer_cell(choice_cell()), capsys,
                            secrets=["accumulating_bytes", "budget_bytes]", "step_s"])  # fmt: skip


CHOOSE = """
def peak(record):
    during = record["accumulating_bytes"]
    return record["after_step_bytes"] if during is None else max(record["after_step_bytes"], during)

def choose_strategy(measured, budget_bytes):
    fits = [name for name, r in measured.items() if {keep}]
    {answer}
"""
FASTEST = "return min(fits, key=lambda n: measured[n]['step_s']) if fits else None"

CHOICE_MISTAKES = {  # mistake -> (which strategies it keeps, what it returns, the words named)
    "ignores_memory": ("True", FASTEST, "whatever its memory"),
    "smallest_memory": ("True", "return min(fits, key=lambda n: peak(measured[n]))",
                        "the strategy with the least memory"),
    "predicted": ("r['predicted_bytes'] <= budget_bytes", FASTEST, "predicted_bytes, ZeRO's formula"),
    "after_step": ("r['after_step_bytes'] <= budget_bytes", FASTEST, "the bytes after a step only"),
    "times_ranks": ("peak(r) * r['ranks'] <= budget_bytes", FASTEST,
                    "multiplied the bytes by the number of ranks"),
    "budget_times_ranks": ("peak(r) <= budget_bytes * r['ranks']", FASTEST,
                           "multiplied the budget by the number of ranks"),
    "inverted": ("peak(r) > budget_bytes", FASTEST, "points the wrong way"),
    "strict": ("peak(r) < budget_bytes", FASTEST, "not strictly less"),
    "slowest": ("peak(r) <= budget_bytes",
                "return max(fits, key=lambda n: measured[n]['step_s']) if fits else None",
                "the slowest of the strategies that fit"),
    "least_bad_small": ("peak(r) <= budget_bytes",
                        f"{FASTEST[:-len(' else None')]} else min(measured, "
                        "key=lambda n: peak(measured[n]))",
                        "misses the budget by the least"),
    "least_bad_fast": ("peak(r) <= budget_bytes",
                       "return min(fits or list(measured), key=lambda n: measured[n]['step_s'])",
                       "the fastest of the strategies that do not fit"),
    "returns_the_time": ("peak(r) <= budget_bytes",
                         "return min(measured[n]['step_s'] for n in fits) if fits else None",
                         "returned the number"),
    "returns_the_record": ("peak(r) <= budget_bytes",
                           "return min((measured[n] for n in fits), key=lambda r: r['step_s'])",
                           "return its name, the key it has in measured"),
    "an_unknown_name": ("peak(r) <= budget_bytes", "return 'ZeRO-1'",
                        "'ZeRO-1', which is not a strategy measured here"),
    "hard_coded": ("True", "return 'zero1'", "of the 6 cases are wrong"),
}


def choice_from(source: str):
    namespace: dict = {}
    exec(compile(textwrap.dedent(source), "<cell>", "exec"), namespace)
    return namespace["choose_strategy"]


@pytest.mark.parametrize("mistake", sorted(CHOICE_MISTAKES))
def test_choice_mistakes_are_named(mistake):
    keep, answer, expected = CHOICE_MISTAKES[mistake]
    fn = choice_from(CHOOSE.replace("{keep}", keep).replace("{answer}", answer))
    with pytest.raises(ex.ExerciseFailed) as info:
        ex.verify("02.choose_strategy", fn)
    message = str(info.value)
    assert expected in message, message
    assert_diagnoses_without_code(message)
    assert not [c for c in ("min(", "max(", "<=", " < ", "measured[") if c in message], message


def test_every_usual_wrong_decision_gives_answers_of_its_own_on_the_cases():
    """The check names a mistake when it gives all of the learner's answers: that needs each
    mistake to answer differently from the right decision and from every other mistake."""
    cases = exdp.strategy_cases()
    right = tuple(exdp.reference_choose_strategy(m, b) for m, b, _ in cases)
    answers = {name: tuple(fn(m, b) for m, b, _ in cases) for name, fn, _ in exdp.STRATEGY_MISTAKES}
    assert right not in answers.values()
    assert len(set(answers.values())) == len(answers), answers
    assert None in right and len(set(right)) == 4  # nothing fits once; each strategy wins
    # the cases hold what their descriptions promise
    assert any(exdp.peak_bytes(m[right[i]]) == b for i, (m, b, _) in enumerate(cases) if right[i])


@pytest.mark.parametrize("name", [m[0] for m in exdp.STRATEGY_MISTAKES])
def test_each_wrong_decision_of_the_table_is_named_by_the_check(name):
    [(_, fn, why)] = [m for m in exdp.STRATEGY_MISTAKES if m[0] == name]
    with pytest.raises(ex.ExerciseFailed,
                       match="All its answers are what one usual mistake gives") as info:
        ex.verify("02.choose_strategy", lambda measured, budget_bytes: fn(measured, budget_bytes))
    assert why in str(info.value)


def _ladder_ranks() -> list[dict]:
    """What two ranks of dp_train report, in the fields strategy_measurements reads."""
    def run(step_s, params, grads, opt, acc, predicted):
        return {"step_s": step_s, "memory_predicted": {"model_states": predicted},
                "memory": {"parameters": params, "gradients": grads, "optimizer_state": opt,
                           "gradients_accumulating": acc}}  # fmt: skip

    return [
        {"runs": {"ddp": run([9.0, 0.2, 0.1, 0.3], 40, 40, 80, 80, 160),
                  "zero1": run([9.0, 0.5, 0.4, 0.6], 40, 40, 40, None, 120)}},
        {"runs": {"ddp": run([9.0, 0.2, 0.1, 0.3], 40, 40, 80, 80, 160),
                  "zero1": run([9.0, 0.5, 0.4, 0.6], 40, 44, 40, None, 120)}},  # a padded shard
    ]  # fmt: skip


def test_the_measurements_table_takes_the_peak_inputs_from_every_rank():
    table = exdp.strategy_measurements(_ladder_ranks(), ("ddp", "zero1"))
    assert table["ddp"] == {"step_s": 0.2, "after_step_bytes": 160, "accumulating_bytes": 200,
                            "predicted_bytes": 160, "ranks": 2}  # fmt: skip
    # the first step is warm-up; the largest rank counts; no no_sync: None, not a guess
    assert table["zero1"] == {"step_s": 0.5, "after_step_bytes": 124, "accumulating_bytes": None,
                              "predicted_bytes": 120, "ranks": 2}  # fmt: skip
    assert exdp.peak_bytes(table["ddp"]) == 200 and exdp.peak_bytes(table["zero1"]) == 124
    formula = exdp.as_predicted(table)
    assert formula["ddp"]["after_step_bytes"] == 160 and formula["ddp"]["accumulating_bytes"] is None
    assert table["ddp"]["after_step_bytes"] == 160 and table["ddp"]["accumulating_bytes"] == 200
    # the formula alone lets DDP run in 160 bytes; its measured peak does not
    assert exdp.reference_choose_strategy(formula, 160) == "ddp"
    assert exdp.reference_choose_strategy(table, 160) == "zero1"


def test_the_fit_sentence_is_chosen_by_the_numbers():
    table = exdp.strategy_measurements(_ladder_ranks(), ("ddp", "zero1"))
    above = exdp.fit_sentence("ddp", table["ddp"], table["ddp"], 160, "sized for")
    assert above.startswith("measured: ddp (sized for) peaks at") and " above the budget" in above
    assert "between micro-batches" in above and "the ladder measured the same bytes" in above
    within = exdp.fit_sentence("zero1", table["zero1"], {**table["zero1"], "after_step_bytes": 120},
                               200)  # fmt: skip
    assert " within the budget" in within and "the ladder measured 0.000 MiB" in within
    assert "same bytes" not in within
    assert "between micro-batches" not in within


def test_the_notebooks_case_is_tried_first_and_only_inside_the_block():
    cases = exdp.strategy_cases()
    mine, budget = cases[0][0], cases[0][1]
    wrong_only_here = {**mine, "zero1": {**mine["zero1"], "step_s": 1.0}}  # a different job

    def hard_coded(measured, budget_bytes):  # right on every case but this one
        if measured["zero1"]["step_s"] == 1.0:
            return "zero1"
        return exdp.reference_choose_strategy(measured, budget_bytes)

    assert "other jobs" in ex.verify("02.choose_strategy", hard_coded)
    with exdp.checking_on(wrong_only_here, budget), pytest.raises(
            ex.ExerciseFailed, match=r"^Exercise 02\.choose_strategy .*on this notebook's measurements"):
        ex.verify("02.choose_strategy", hard_coded)
    with exdp.checking_on(mine, budget):
        assert ex.verify("02.choose_strategy", exdp.reference_choose_strategy).startswith(
            "reference_choose_strategy chose the fastest strategy whose measured peak fits each "
            "per-rank budget, or None when none does, on this notebook's measurements and 6 other")
    assert dp_strategy._NOTEBOOK_CASE == []  # nothing left behind
    with pytest.raises(RuntimeError), exdp.checking_on(mine, budget):
        raise RuntimeError("a cell that fails")
    assert dp_strategy._NOTEBOOK_CASE == []


def test_the_learners_function_cannot_change_the_cases():
    def greedy(measured, budget_bytes):
        for r in measured.values():
            r["after_step_bytes"] = 0  # a learner who edits the records in place
        return exdp.reference_choose_strategy(measured, budget_bytes)

    with pytest.raises(ex.ExerciseFailed):
        ex.verify("02.choose_strategy", greedy)
    assert exdp.strategy_cases()[0][0]["ddp"]["after_step_bytes"] == 16 * exdp.PSI
