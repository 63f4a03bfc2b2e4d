"""The data-parallel exercises of notebook 02: checks pass on the solution, fail helpfully.

The solutions are read from ``solutions/02_data_parallelism.ipynb`` itself (its ``%%writefile``
cells), and the stubs are generated from them with ``labkit.nbgen``, as the learner's notebook
is: so the notebook's own solution code is what passes here. Most checks run in this process
on a 1-rank gloo group (HashStore: no port, no process); mistakes that only show with several
ranks (a sum not averaged) are caught in one real 2-rank launch of the worker.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import textwrap
from pathlib import Path

import nbformat
import pytest
import torch.distributed as tdist
from nbformat.v4 import new_code_cell, new_notebook

from labkit import exercises as ex
from labkit import launch, nbgen
from labkit.exercises import data_parallel as exdp

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "solutions" / "02_data_parallelism.ipynb"
FILES = {  # the file each exercise's %%writefile cell writes -> the exercise it checks
    "dp_allreduce": "02.allreduce_grads",
    "dp_buckets": "02.bucket_hook",
    "dp_zero1": "02.zero1_shard",
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


def stub_of(cell_source: str) -> str:
    nb = nbgen.generate(new_notebook(cells=[new_code_cell(cell_source, id="c")]))
    return nb.cells[0].source


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


# --------------------------------------------------------------------------- the notebook's cells


def test_the_notebook_writes_one_file_per_exercise_and_checks_it_in_workers():
    cells = writefile_cells()
    assert set(cells) == set(FILES)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    for module, exercise_id in FILES.items():
        assert f'ex.check_in_workers("{exercise_id}", ex_dir / "{module}.py")' in text
        assert exdp.EXERCISES[exercise_id] in cells[module]  # defines the checked function


@pytest.mark.parametrize("module", sorted(FILES))
def test_generated_stub_is_a_valid_file_without_the_solution(module):
    cell = writefile_cells()[module]
    stub = stub_of(cell)
    assert stub.split("\n", 1)[0] == cell.split("\n", 1)[0]  # the magic line is kept
    source = body(stub)
    ast.parse(source)  # %%writefile writes it verbatim: it must still be valid Python
    assert "raise NotImplementedError(" in source
    assert "BEGIN SOLUTION" not in source and "END SOLUTION" not in source


# --------------------------------------------------------------------------- in process, 1 rank


def test_solutions_pass_and_stubs_say_not_done_with_the_hint(group, tmp_path):
    cells = writefile_cells()
    for module, exercise_id in FILES.items():
        write(tmp_path, f"good_{module}", body(cells[module]))
        write(tmp_path, f"stub_{module}", body(stub_of(cells[module])))
        [good] = exdp.run_checks([exercise_id], f"good_{module}", tmp_path)
        assert good["status"] == "ok", good["message"]
        assert good["message"]
        [stub] = exdp.run_checks([exercise_id], f"stub_{module}", tmp_path)
        assert stub == {
            "id": exercise_id,
            "status": "incomplete",
            "message": f"Exercise {exercise_id} is not done yet: {ex.get(exercise_id).hints[0]}",
        }


def test_checks_are_registered_and_need_a_process_group(monkeypatch):
    assert [e.id for e in ex.catalogue("02")] == sorted(exdp.EXERCISES)
    monkeypatch.setattr(tdist, "is_initialized", lambda: False)  # as in a notebook kernel
    with pytest.raises(RuntimeError, match="check_in_workers"):
        ex.verify("02.allreduce_grads", lambda model, world_size: None)


ZERO1_MISTAKES = {
    "floor": (
        "def shard_bounds(numel, rank, world_size):\n"
        "    s = numel // world_size\n"
        "    return rank * s, (rank + 1) * s\n",
        "belong(s) to no rank",
    ),
    "remainder_to_last": (
        "def shard_bounds(numel, rank, world_size):\n"
        "    s = numel // world_size\n"
        "    return rank * s, numel if rank == world_size - 1 else (rank + 1) * s\n",
        "pad the buffer with zeros",
    ),
    "too_much_padding": (
        "def shard_bounds(numel, rank, world_size):\n"
        "    s = numel // world_size + 1\n"
        "    return rank * s, (rank + 1) * s\n",
        "fewer than world_size",
    ),
    "not_a_pair": (
        "def shard_bounds(numel, rank, world_size):\n    return slice(0, numel)\n",
        "return a tuple of two ints",
    ),
    "gap": (
        "def shard_bounds(numel, rank, world_size):\n"
        "    s = -(-numel // world_size)\n"
        "    return rank * s + rank, (rank + 1) * s + rank\n",
        "tile the buffer from 0",
    ),
}


@pytest.mark.parametrize("mistake", sorted(ZERO1_MISTAKES))
def test_zero1_shard_mistakes_are_named_before_any_collective(mistake, tmp_path, monkeypatch):
    """The rules are checked for every rank of every case before the check needs a process
    group (here there is none): every rank reaches the same verdict, so none is left waiting
    in a collective."""
    monkeypatch.setattr(tdist, "is_initialized", lambda: False)
    source, expected = ZERO1_MISTAKES[mistake]
    write(tmp_path, f"zero1_{mistake}", source)
    [res] = exdp.run_checks(["02.zero1_shard"], f"zero1_{mistake}", tmp_path)
    assert res["status"] == "failed"
    assert res["message"].startswith("Exercise 02.zero1_shard (")
    assert expected in res["message"]


BUCKET_MISTAKES = {
    "synchronous": (
        """
        import torch.distributed as dist
        def on_grad_ready(bucket, p, offset):
            bucket.buffer[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
            bucket.ready.add(id(p))
            if len(bucket.ready) == len(bucket.params):
                dist.all_reduce(bucket.buffer)
        """,
        "bucket.work was still None when backward ended",
    ),
    "too_early": (
        """
        import torch.distributed as dist
        def on_grad_ready(bucket, p, offset):
            bucket.buffer[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
            bucket.ready.add(id(p))
            if bucket.work is None:
                bucket.work = dist.all_reduce(bucket.buffer, async_op=True)
        """,
        "started when 1 of its",
    ),
    "unflattened": (
        """
        import torch.distributed as dist
        def on_grad_ready(bucket, p, offset):
            bucket.buffer[offset : offset + p.numel()] = p.grad
        """,
        "on_grad_ready(bucket, p, offset) raised RuntimeError",
    ),
    "wrong_slot": (
        """
        import torch.distributed as dist
        def on_grad_ready(bucket, p, offset):
            bucket.buffer[: p.numel()].copy_(p.grad.reshape(-1))
            bucket.ready.add(id(p))
            if len(bucket.ready) == len(bucket.params):
                bucket.work = dist.all_reduce(bucket.buffer, async_op=True)
        """,
        "its own slot of the bucket",
    ),
}


@pytest.mark.parametrize("mistake", sorted(BUCKET_MISTAKES))
def test_bucket_hook_mistakes_are_named(group, mistake, tmp_path):
    source, expected = BUCKET_MISTAKES[mistake]
    write(tmp_path, f"bucket_{mistake}", source)
    [res] = exdp.run_checks(["02.bucket_hook"], f"bucket_{mistake}", tmp_path)
    assert res["status"] == "failed"
    assert expected in res["message"], res["message"]


def test_allreduce_that_trips_on_the_frozen_parameter_is_named(group, tmp_path):
    write(tmp_path, "allreduce_frozen", """
        import torch.distributed as dist
        def allreduce_gradients(model, world_size):
            for p in model.parameters():
                dist.all_reduce(p.grad)
        """)  # fmt: skip
    [res] = exdp.run_checks(["02.allreduce_grads"], "allreduce_frozen", tmp_path)
    assert res["status"] == "failed"
    assert "allreduce_gradients(" in res["message"] and "raised" in res["message"]


def test_broken_or_missing_files_fail_with_the_fix(tmp_path):
    [res] = exdp.run_checks(["02.allreduce_grads"], "nowhere", tmp_path)
    assert res["status"] == "failed" and "run the %%writefile cell" in res["message"]
    write(tmp_path, "broken", "def allreduce_gradients(model, world_size)\n    pass\n")
    [res] = exdp.run_checks(["02.allreduce_grads"], "broken", tmp_path)
    assert res["status"] == "failed" and "is not valid Python" in res["message"]
    write(tmp_path, "other", "def something_else():\n    pass\n")
    [res] = exdp.run_checks(["02.allreduce_grads"], "other", tmp_path)
    assert res["status"] == "failed" and "defines no allreduce_gradients()" in res["message"]


def test_a_rewritten_file_is_read_again(group, tmp_path):
    """The learner edits the cell and runs it again: the check must see the new code."""
    cells = writefile_cells()
    write(tmp_path, "dp_zero1", body(stub_of(cells["dp_zero1"])))
    assert exdp.run_checks(["02.zero1_shard"], "dp_zero1", tmp_path)[0]["status"] == "incomplete"
    write(tmp_path, "dp_zero1", body(cells["dp_zero1"]))
    assert exdp.run_checks(["02.zero1_shard"], "dp_zero1", tmp_path)[0]["status"] == "ok"


# --------------------------------------------------------------------------- summarising ranks


def _ranks(*statuses: str) -> list[dict]:
    return [
        {"results": [{"id": "02.zero1_shard", "status": s, "message": f"{s} on rank {r}"}]}
        for r, s in enumerate(statuses)
    ]


def test_summary_is_rank_0s_sentence_when_every_rank_passes():
    assert exdp.summarize("02.zero1_shard", _ranks("ok", "ok")) == "ok on rank 0"


def test_summary_raises_the_first_failure_before_a_stub():
    with pytest.raises(ex.ExerciseFailed, match="failed on rank 1") as info:
        exdp.summarize("02.zero1_shard", _ranks("incomplete", "failed"))
    assert info.value.exercise_id == "02.zero1_shard"
    with pytest.raises(ex.ExerciseIncomplete, match="incomplete on rank 0"):
        exdp.summarize("02.zero1_shard", _ranks("incomplete", "ok"))
    with pytest.raises(ex.ExerciseFailed, match=r"rank 1 of 2 reported nothing: it ended before "
                       r"its check was done \(a sys.exit or os._exit in your code\?\)"):  # fmt: skip
        exdp.summarize("02.zero1_shard", [_ranks("ok")[0], {}])


def test_bad_arguments_fail_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match=r"exercise_id=.02\.nope."):
        exdp.verify_file("02.nope", tmp_path / "x.py")
    with pytest.raises(ValueError, match=r"must end in \.py"):
        exdp.verify_file("02.zero1_shard", tmp_path / "x.txt")


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
    ex.check_in_workers("02.zero1_shard", tmp_path / "dp_zero1.py")
    out = capsys.readouterr().out
    assert out.startswith("✗ 02.zero1_shard (") and "run the %%writefile cell" in out


def test_workspace_lives_under_labkit_home(monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    assert ex.workspace("02") == tmp_path / "exercises" / "02"
    assert ex.workspace("02").is_dir()


# --------------------------------------------------------------------------- real ranks


@pytest.mark.slow
def test_in_two_worker_processes_a_missing_average_is_caught(tmp_path):
    """One 2-rank job, three exercises: the notebook's bucket and shard solutions pass on
    both ranks, and an all-reduce without the division, which one rank cannot tell from the
    right answer, fails with the factor and the fix."""
    cells = writefile_cells()
    source = "\n".join([
        "import torch.distributed as dist",
        "def allreduce_gradients(model, world_size):",
        "    for p in model.parameters():",
        "        if p.grad is not None:",
        "            dist.all_reduce(p.grad)",
        body(cells["dp_buckets"]),
        body(cells["dp_zero1"]),
    ])  # fmt: skip
    write(tmp_path, "dp_mixed", source)
    res = launch.run(
        exdp.WORKER,
        nproc=2,
        device="cpu",
        stream=False,
        timeout_s=120,
        config={"exercises": sorted(exdp.EXERCISES), "module": "dp_mixed",
                "module_dir": str(tmp_path)},
    )  # fmt: skip
    assert [r["world_size"] for r in res.ranks] == [2, 2]
    with pytest.raises(ex.ExerciseFailed) as info:
        exdp.summarize("02.allreduce_grads", res.ranks)
    assert "it is 2x the average" in str(info.value)
    assert "divide by world_size" in str(info.value)
    for exercise_id in ("02.bucket_hook", "02.zero1_shard"):
        assert exdp.summarize(exercise_id, res.ranks)  # what every rank verified
    assert "rank 1 of 2" in res.rank(1)["results"][2]["message"]  # each rank checked itself


@pytest.mark.slow
def test_a_rank_that_dies_is_reported_as_a_failed_exercise(tmp_path, capsys):
    path = write(tmp_path, "dp_dies", """
        import os
        import torch.distributed as dist
        def allreduce_gradients(model, world_size):
            if dist.get_rank() == 1:
                os._exit(3)  # a crash, not an exception the check could catch
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
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
    """Rank 1 loops in the learner's code; rank 0 waits for it in an all-reduce until its
    process group times out, and its check reports that timeout. The loop is the cause."""
    path = write(tmp_path, "dp_loops", """
        import torch.distributed as dist
        def allreduce_gradients(model, world_size):
            done = dist.get_rank() == 0
            while not done:
                pass
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
        """)  # fmt: skip
    with pytest.raises(ex.ExerciseFailed) as info:
        exdp.verify_file("02.allreduce_grads", path, timeout_s=20)
    message = str(info.value)
    assert "the check did not finish (timed out after" in message, message
    # Rank 0 is still waiting in its all-reduce (its process group would time out at 30 s).
    assert "rank 0 waited in a torch call (a collective?) that rank 1 never reached" in message
    # The dump catches the loop on either of its two lines.
    assert re.search(r"rank 1 was at dp_loops\.py, line [56], in allreduce_gradients: "
                     r"`(while not done:|pass)`", message), message  # fmt: skip
    assert "Timed out waiting" not in message and "ranks []" not in message
    assert "?." not in message


@pytest.mark.slow
def test_an_allreduce_on_rank_0_only_shows_rank_1s_diagnosis_not_a_model_dump(tmp_path):
    path = write(tmp_path, "dp_rank0", """
        import torch.distributed as dist
        def allreduce_gradients(model, world_size):
            if dist.get_rank() != 0:
                return
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world_size
        """)  # fmt: skip
    with pytest.raises(ex.ExerciseFailed) as info:
        exdp.verify_file("02.allreduce_grads", path, timeout_s=60)
    message = str(info.value)
    body = message.removeprefix("Exercise 02.allreduce_grads failed: ")
    assert body.startswith(".grad does not equal", body.index(".grad")), message
    assert "on rank 1 of 2: it is still this rank's own gradient: it was never all-reduced" in body
    # Rank 0's check saw its all-reduce fail when rank 1 left: a consequence, told second.
    assert "Rank 0 then failed in a collective that rank 1 never called" in message
    assert "GPT(" not in message and "Linear(" not in message, "never dump the model"
    assert len(message.splitlines()) <= 2, message


def test_a_file_whose_top_level_never_finishes_is_stopped_by_the_time_limit(
    tmp_path, monkeypatch, capsys
):
    """The kernel imports the learner's file (to spot a stub) before any job starts: a loop at
    its top level must not hang the cell."""
    monkeypatch.setitem(ex._REGISTRY, "02.allreduce_grads",
                        dataclasses.replace(ex.get("02.allreduce_grads"), time_limit_s=1.0))  # fmt: skip
    path = write(tmp_path, "dp_toplevel", """
        while True:
            pass
        def allreduce_gradients(model, world_size):
            pass
        """)  # fmt: skip
    ex.check_in_workers("02.allreduce_grads", path)
    out = capsys.readouterr().out
    assert "✗ 02.allreduce_grads" in out and "did not finish within 1 s" in out, out
    assert "dp_toplevel.py, line 2" in out
