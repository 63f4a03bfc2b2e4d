"""labkit.profiling.nsight with the real tools on a real GPU: nsys on a tiny CUDA matmul
program (capture by torch.cuda.profiler.start/stop, by an NVTX range, and one report per rank
under torchrun), then ncu on one elementwise kernel, placed on this GPU's measured roofline.

Skipped without CUDA, and each test also without its tool on the PATH. No speed is asserted:
the checks are on what was captured (which launches, how many) and on measured byte counts.
The CPU-side logic (commands, fake tools, CSV readers) is in tests/test_profiling_nsight.py.
"""

from __future__ import annotations

import shutil
import sys
import textwrap

import matplotlib
import pytest
import torch

from labkit import roofline
from labkit.profiling import nsight

matplotlib.use("Agg")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
needs_nsys = pytest.mark.skipif(shutil.which("nsys") is None,
                                reason="needs Nsight Systems: nsys is not on the PATH")  # fmt: skip
needs_ncu = pytest.mark.skipif(shutil.which("ncu") is None,
                               reason="needs Nsight Compute: ncu is not on the PATH")  # fmt: skip

STEPS = 5
WARMUP = 3

# Three warm-up matmuls outside the capture, then STEPS inside it, each in an NVTX range
# "step", all inside an NVTX range "profiled". A capture that works sees STEPS launches of the
# matmul's kernel(s), never STEPS + WARMUP.
MATMUL = textwrap.dedent(f"""\
    import torch
    from labkit.profiling.nsight import cuda_profiler_capture

    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    for _ in range({WARMUP}):
        c = a @ b
    torch.cuda.synchronize()
    with cuda_profiler_capture() as active:
        assert active
        torch.cuda.nvtx.range_push("profiled")
        for _ in range({STEPS}):
            torch.cuda.nvtx.range_push("step")
            c = a @ b
            torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    print("done", float(c.float().sum()))
""")


def check_one_rank(summaries: nsight.NsysSummaries) -> None:
    kernels = summaries.kernels
    assert len(kernels) >= 1, str(summaries)
    # cuBLAS may run one or two kernels per matmul; each ran once per captured step.
    assert max(r.count for r in kernels) == STEPS, str(kernels)
    assert all(r.total_ns > 0 for r in kernels)
    assert summaries.nvtx.get("step").count == STEPS
    assert summaries.nvtx.get("profiled").count == 1


@needs_nsys
@pytest.mark.parametrize("capture", ["cudaProfilerApi", "nvtx"])
def test_nsys_records_only_the_captured_steps_and_reads_the_tables(tmp_path, capture):
    script = tmp_path / "matmul.py"
    script.write_text(MATMUL)
    cmd = nsight.NsysCommand(target=[sys.executable, str(script)], output=tmp_path / "step",
                             capture=capture,
                             nvtx_capture="profiled" if capture == "nvtx" else None)  # fmt: skip
    res = nsight.profile_nsys(cmd, timeout_s=300)
    assert isinstance(res, nsight.NsysResult), str(res)
    (rank,) = res.ranks
    if capture == "nvtx":
        # The capture starts at the push of "profiled", so the range itself may be cut.
        assert max(r.count for r in rank.kernels) == STEPS, str(rank.kernels)
    else:
        check_one_rank(rank)
    import matplotlib.pyplot as plt

    ax = nsight.plot_kernel_summary(rank.kernels)
    assert len(ax.patches) == len(rank.kernels.top(10))
    plt.close(ax.figure)


@needs_nsys
def test_nsys_under_torchrun_writes_one_report_per_rank(tmp_path):
    (tmp_path / "nsight_gpu_worker.py").write_text(MATMUL)
    cmd = nsight.NsysTorchrunCommand(module="nsight_gpu_worker", nproc=1,
                                     output=tmp_path / "ddp")  # fmt: skip
    res = nsight.profile_nsys(cmd, timeout_s=300, env={"PYTHONPATH": str(tmp_path),
                                                       "TMPDIR": str(tmp_path)})  # fmt: skip
    assert isinstance(res, nsight.NsysResult), str(res)
    assert [s.report.name for s in res.ranks] == ["ddp_rank0.nsys-rep"]
    check_one_rank(res.ranks[0])


ADD = textwrap.dedent("""\
    import torch
    x = torch.randn(2**24, device="cuda")
    y = torch.randn(2**24, device="cuda")
    for _ in range(4):
        z = x + y
    torch.cuda.synchronize()
    print("done", float(z[0]))
""")


@needs_ncu
def test_ncu_profiles_one_launch_and_it_lands_on_the_measured_roofline(tmp_path):
    script = tmp_path / "add.py"
    script.write_text(ADD)
    cmd = nsight.NcuCommand(target=[sys.executable, str(script)],
                            kernel_name="vectorized_elementwise_kernel", launch_skip=2,
                            launch_count=1, log_file=tmp_path / "add.csv")  # fmt: skip
    res = nsight.run_ncu(cmd, timeout_s=300)
    assert isinstance(res, nsight.NcuResult), str(res)
    (k,) = res.kernels
    assert "elementwise" in k.name
    assert k.duration_s > 0
    for pct in (k.compute_throughput_pct, k.memory_throughput_pct, k.dram_throughput_pct):
        assert 0 < pct <= 100
    # Two float32 inputs read, one output written: 3 × 4 bytes × 2^24 elements from DRAM
    # (64 MiB tensors are larger than the L2, and ncu flushes caches before each replay).
    modelled = 3 * 4 * 2**24
    assert 0.8 * modelled <= k.dram_bytes <= 1.25 * modelled, k.dram_bytes

    roof = roofline.measure_roofline("cuda", ("float32",))
    placed = nsight.place_on_roofline(roof, k, flops=2**24)  # one add per element, modelled
    assert placed.bytes_source == "measured"
    assert placed.point.bound == "memory"  # 1 FLOP per 12 bytes is far left of any ridge
    assert "measured by ncu" in str(placed)
