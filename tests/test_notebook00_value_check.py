"""Notebook 00's value check, as the notebook runs it: the worker counts the elements that differ
from the value the notebook predicted, so the "try max" demo prints a count that agrees with the
values it shows (the cells are read from solutions/, not copied)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest

from labkit import verdict
from labkit.jobs import launch
from labkit.workers import allreduce as worker
from labkit.workers import allreduce_report as report

NOTEBOOK = Path(__file__).resolve().parents[1] / "solutions" / "00_setup_and_first_job.ipynb"


def cell(cell_id: str) -> str:
    return next(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.id == cell_id)


@pytest.mark.slow
def test_the_max_demo_fails_the_check_with_a_count_that_agrees_with_the_values(capsys):
    numel, nproc = 1024, 2
    expected_value = nproc * (nproc + 1) / 2  # the notebook's prediction: the sum, 3
    result = launch.run(worker.AllReduceConfig(numel=numel, repeats=2, warmup=1, op="max",
                                        expect=expected_value, probe=False, wire=False),
                        nproc=nproc, timeout_s=120, stream=False)  # fmt: skip
    # the worker compared with the notebook's value, and its own log says the same as the cell
    assert [r["expected"] for r in result.ranks] == [3.0, 3.0]
    assert [r["wrong_elements"] for r in result.ranks] == [numel, numel]
    assert "1024 of 1024 elements differ from the expected 3" in result.log(0)
    ns = {"result": result, "expected_value": expected_value, "numel": numel, "nproc": nproc,
          "reduce_op": "max", "worker": worker, "report": report}
    exec(cell("nb00-13"), ns)  # the value check
    out = capsys.readouterr().out
    assert "{0: (2.0, 2.0), 1: (2.0, 2.0)}" in out  # a max of 1 and 2 holds 2 everywhere
    assert ("✗ value check: elements differ from the predicted 3 on rank 0 (1,024 of 1,024), "
            "rank 1 (1,024 of 1,024)") in out
    assert "(0 of" not in out and "✓" not in out
    assert verdict.contradictions(out) == []

    # the summary at the end says the same, not "every element as predicted"
    exec(cell("nb00-16c"), ns | {"tier": SimpleNamespace(tier="cpu"),
                                 "wire_bytes": report.reconcile_wire(result, None,
                                                                     predicted_per_rank=4 * numel,
                                                                     whose="the reference"),
                                 "timing": report.reconcile_time(result)})  # fmt: skip
    summary = capsys.readouterr().out
    assert "values: elements differ from the predicted 3 on rank(s) 0, 1 ('max' all-reduce)" in summary
    assert "every element as predicted" not in summary

    # with the default op the same mismatch is a broken all-reduce: the notebook stops there
    with pytest.raises(AssertionError, match="did not give the predicted 3"):
        exec(cell("nb00-13"), ns | {"reduce_op": "sum"})


@pytest.mark.slow
def test_the_worker_checks_its_ops_own_result_when_no_value_is_expected():
    result = launch.run(worker.AllReduceConfig(numel=64, repeats=1, warmup=0, op="max", probe=False,
                                        wire=False), nproc=2, timeout_s=120, stream=False)  # fmt: skip
    assert [(r["expected"], r["value"], r["wrong_elements"]) for r in result.ranks] == [
        (2.0, 2.0, 0), (2.0, 2.0, 0)]
