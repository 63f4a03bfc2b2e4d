"""labkit.profiling.summary: a multi-rank job's traces read into tables and verdicts.

The traces are SYNTHETIC GPU traces (``tests/gpu_traces.py``) built with a known shape: a
rank with slow kernels and a rank that waits in a long all-reduce, or ranks alike. The real
job notebook 06 reads (two of the 128 ranks of an NCCL job) is checked in
``test_gpu_traces_real.py`` where its traces are present.
"""

from __future__ import annotations

import pytest
from gpu_traces import build

from labkit.profiling import load_traces, nsys_reports
from labkit.profiling.summary import WAITING, short_kernel_name, summarize_job
from labkit.profiling.trace import TraceError


def _job(tmp_path, ranks, world_size=None, steps=4):
    """``ranks``: per rank, (kernel µs, all-reduce µs)."""
    for r, (kernel_us, all_reduce_us) in enumerate(ranks):
        build(rank=r, world_size=world_size or len(ranks), steps=steps, kernels=8,
              kernel_us=kernel_us, all_reduce_us=all_reduce_us).write(tmp_path / f"rank{r}.json")
    return summarize_job(load_traces(tmp_path))


def test_a_rank_with_slow_kernels_that_the_others_wait_for_is_named(tmp_path):
    job = _job(tmp_path, [(40, 700), (150, 100)])
    assert job.straggler is not None and job.straggler.rank == 1
    assert job.straggler.steps_slower == 4  # slow in every step, not on average only
    assert job.straggler_verdict().startswith("rank 1 is the straggler")


def test_ranks_alike_that_all_wait_with_missing_ranks_point_at_the_missing_ones(tmp_path):
    job = _job(tmp_path, [(40, 700), (40, 700)], world_size=16)
    assert job.straggler is None
    shares = [t.exposed_s / t.step_s for t in job.times]
    assert min(shares) > WAITING  # the shape the builder made: a long all-reduce, exposed
    verdict = job.straggler_verdict()
    assert "No rank here is a straggler" in verdict
    assert "2 of the job's 16 ranks" in verdict and "other 14" in verdict


def test_ranks_alike_that_all_wait_with_every_rank_present_blame_the_collective(tmp_path):
    verdict = _job(tmp_path, [(40, 700), (40, 700)]).straggler_verdict()
    assert "all the job's ranks are here" in verdict and "other" not in verdict.split(".")[-2]


def test_ranks_that_hardly_wait_say_so(tmp_path):
    verdict = _job(tmp_path, [(150, 20), (150, 20)]).straggler_verdict()
    assert "little waiting to explain" in verdict


def test_where_time_goes_names_the_larger_loss(tmp_path):
    (tmp_path / "a").mkdir()
    waiting = _job(tmp_path / "a", [(40, 700), (40, 700)])
    assert "The larger loss is communication" in waiting.where_time_goes()
    # kernels far apart (short kernels, a long step): the GPU mostly waits for its CPU
    (tmp_path / "b").mkdir()
    for r in range(2):
        build(rank=r, world_size=2, steps=4, step_us=5000, kernels=4, kernel_us=50,
              all_reduce_us=50).write(tmp_path / "b" / f"rank{r}.json")
    idle = summarize_job(load_traces(tmp_path / "b"))
    assert "The larger loss is idle time" in idle.where_time_goes()


def test_the_communication_table_counts_collectives_and_their_kernels_per_step(tmp_path):
    job = _job(tmp_path, [(40, 300), (40, 300)], steps=3)
    table = job.comm_table()
    assert table.count("nccl:all_reduce ×1") == 2  # one per step on each rank, as built
    assert "1.0 kernels" in table and "ncclDevKernel_AllReduce_Sum_f32_RING_LL" in table
    assert "0.3 ms a step" in table  # 300 µs per all-reduce kernel
    assert [len(k) for k in job.comm_kernels] == [1, 1]


def test_the_rank_table_has_a_row_per_rank(tmp_path):
    rows = _job(tmp_path, [(40, 700), (150, 100)]).rank_table().splitlines()
    assert len(rows) == 3 and rows[1].split()[0] == "0" and rows[2].split()[0] == "1"


def test_one_rank_cannot_answer_the_straggler_question(tmp_path):
    build(rank=0, world_size=8).write(tmp_path / "rank0.json")
    verdict = summarize_job(load_traces(tmp_path)).straggler_verdict()
    assert verdict.startswith("One rank's trace") and "two or more" in verdict


def test_no_traces_is_refused():
    with pytest.raises(TraceError, match="no traces"):
        summarize_job([])


@pytest.mark.parametrize("name,short", [
    # NCCL's kernels as the recordings hold them (labkit/recordings/*.json, tests' traces): the
    # two functions labkit had gave these the same short name, the one kept gives it still
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
     "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*)", "ncclDevKernel_AllReduce_Sum_f32_RING_LL"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n"),
    # where they differed, the summary's dropped the template without a mark, and cut
    # "(anonymous namespace)" at its bracket: nsys_reports' keeps both, so it is the one kept
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >(int)",
     "at::native::vectorized_elementwise_kernel<…>"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<(int)4, float>(T4 *, int)",
     "at::native::(anonymous namespace)::cunn_SoftMaxForward<…>"),
])  # fmt: skip
def test_short_kernel_names_drop_templates_and_arguments(name, short):
    assert short_kernel_name(name) == short
    assert short_kernel_name is nsys_reports.short_kernel_name  # one function, both readers
