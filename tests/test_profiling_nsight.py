"""labkit.profiling.nsight on a CPU machine: the exact nsys/ncu commands, the runners with the
tool absent, failing, silent or hanging (fake tools on a temporary PATH), the CSV readers on
output in NVIDIA's documented layout, the kernel figure and the roofline placement.

The real tools on a real GPU are in tests/test_gpu_profiling_nsight.py (marked ``gpu``).
"""

from __future__ import annotations

import os
import shlex
import sys
import textwrap
import time
from pathlib import Path

import matplotlib
import psutil
import pytest
import torch

from labkit import roofline
from labkit.profiling import nsight

matplotlib.use("Agg")

PY = sys.executable
TRACE = "--trace=cuda,nvtx,osrt,cudnn,cublas"

# --- sample output ------------------------------------------------------------------------------
#
# nsys stats CSV. The column layout is NVIDIA's: the Nsight Systems Post-Collection Analysis
# Guide, https://docs.nvidia.com/nsight-systems/AnalysisGuide/index.html, section "Statistical
# Reports Shipped With Nsight Systems", documents each report's output. For cuda_gpu_kern_sum
# it reads (the usage text of NVIDIA's report script, Target-*/reports/cuda_gpu_kern_sum.py):
#     Output: All time values default to nanoseconds
#         Time : Percentage of "Total Time"   Total Time   Instances   Avg   Med   Min   Max
#         StdDev   Name
# and the script's SQL names them "Time:ratio_%", "Total Time:dur_ns", "Instances",
# "Avg:dur_ns", ..., which nsys prints as "Time (%)", "Total Time (ns)", "Avg (ns)", ...
# nvtx_sum has the same time columns, then "Style" and "Range"; cuda_gpu_mem_time_sum has
# "Count" for "Instances" and "Operation" for "Name"; cuda_gpu_mem_size_sum has "Total (MB)",
# "Count", "Avg (MB)", "Med (MB)", "Min (MB)", "Max (MB)", "StdDev (MB)", "Operation" (the same
# layouts in the User Guide's "Example Output from --stats Option",
# https://docs.nvidia.com/nsight-systems/UserGuide/index.html). The two lines before the CSV
# are the preamble nsys stats prints. The numbers are made up.

KERNELS_CSV = """\
Generating SQLite file /tmp/step.sqlite from /tmp/step.nsys-rep
Processing [/tmp/step.sqlite] with [/opt/nvidia/nsight-systems/2024.4.2/host-linux-x64/reports/cuda_gpu_kern_sum.py]...
Time (%),Total Time (ns),Instances,Avg (ns),Med (ns),Min (ns),Max (ns),StdDev (ns),Name
71.5,2860000,30,95333.3,95104.0,94880,97312,610.2,"void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(T1::Params)"
20.0,800000,60,13333.3,13280.0,13120,13952,180.4,"void at::native::vectorized_elementwise_kernel<(int)4, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char *, (unsigned long)3>>(int, T2, T3)"
8.5,340000,10,34000.0,33920.0,33600,34720,300.9,"void at::native::(anonymous namespace)::cunn_SoftMaxForward<(int)4, float, float, float, at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(T4 *, const T2 *, int)"
"""

NVTX_CSV = """\
Processing [/tmp/step.sqlite] with [/opt/nvidia/nsight-systems/2024.4.2/host-linux-x64/reports/nvtx_sum.py]...
Time (%),Total Time (ns),Instances,Avg (ns),Med (ns),Min (ns),Max (ns),StdDev (ns),Style,Range
55.0,5500000,10,550000.0,548000.0,540000,571000,9000.0,PushPop,:backward
30.0,3000000,10,300000.0,299000.0,295000,310000,4300.0,PushPop,:forward
15.0,1500000,10,150000.0,150000.0,149000,152000,900.0,PushPop,:optimizer
"""

MEM_TIME_CSV = """\
Time (%),Total Time (ns),Count,Avg (ns),Med (ns),Min (ns),Max (ns),StdDev (ns),Operation
69.1,756390,2,378195.0,378195.0,374915,381475,4638.6,[CUDA memcpy Host-to-Device]
30.9,338818,1,338818.0,338818.0,338818,338818,0.0,[CUDA memcpy Device-to-Host]
"""

MEM_SIZE_CSV = """\
Total (MB),Count,Avg (MB),Med (MB),Min (MB),Max (MB),StdDev (MB),Operation
8.389,2,4.194,4.194,4.194,4.194,0.000,[CUDA memcpy Host-to-Device]
4.194,1,4.194,4.194,4.194,4.194,0.000,[CUDA memcpy Device-to-Host]
"""

# ncu --csv --page details --print-units base. The options are Nsight Compute CLI's
# (https://docs.nvidia.com/nsight-compute/NsightComputeCli/index.html, "Command Line Options":
# --csv, --page details, --print-units base); the SpeedOfLight metrics and their display names
# are the Profiling Guide's (https://docs.nvidia.com/nsight-compute/ProfilingGuide/index.html,
# "Sections": GPU Speed Of Light Throughput). The header row and the row shape (metric rows
# end in a comma; rule rows have no metric name) are as ncu 2025 prints them; "==PROF==" lines
# are ncu's own. Two launches of one kernel, made-up numbers.
NCU_HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
              '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
              '"Metric Value","Rule Name","Rule Type","Rule Description",'
              '"Estimated Speedup Type","Estimated Speedup"')  # fmt: skip


def ncu_rows(kid: int, duration_ns: str, sm: str, mem: str, dram: str, read: str, write: str,
             name: str = "vectorized_elementwise_kernel") -> str:  # fmt: skip
    lead = (f'"{kid}","4242","python","127.0.0.1","{name}","1","7","(128, 1, 1)",'
            f'"(65536, 1, 1)","0","9.0",')  # fmt: skip
    sol = '"GPU Speed Of Light Throughput"'
    cmd = '"Command line profiler metrics"'
    return "\n".join([
        f'{lead}{sol},"DRAM Frequency","hz","2,619,000,000.00",',
        f'{lead}{sol},"Duration","ns","{duration_ns}",',
        f'{lead}{sol},"Compute (SM) Throughput","%","{sm}",',
        f'{lead}{sol},"Memory Throughput","%","{mem}",',
        f'{lead}{sol},"DRAM Throughput","%","{dram}",',
        f'{lead}"SpeedOfLight","","","","SOLBottleneck","OPT","Memory is more heavily utilized '
        'than Compute: Look at the Memory Workload Analysis section.","",""',
        f'{lead}{cmd},"dram__bytes_read.sum","byte","{read}",',
        f'{lead}{cmd},"dram__bytes_write.sum","byte","{write}",',
    ])  # fmt: skip


NCU_CSV = "\n".join([
    "==PROF== Connected to process 4242 (/usr/bin/python3.11)",
    '==PROF== Profiling "vectorized_elementwise_kernel" - 0: 0%....50%....100% - 9 passes',
    NCU_HEADER,
    ncu_rows(0, "42080", "18.31", "91.62", "91.62", "134,217,728", "67108864"),
    ncu_rows(1, "41952", "18.40", "91.80", "91.80", "134217728", "67,108,864"),
    "==PROF== Disconnected from process 4242",
]) + "\n"  # fmt: skip


# --- fake tools -------------------------------------------------------------------------------

FAKE_NSYS = """\
#!{python}
import os, re, subprocess, sys, time
args = sys.argv[1:]
mode = os.environ.get("FAKE_MODE", "ok")
if args[0] == "stats":
    report = next(a.split("=", 1)[1] for a in args if a.startswith("--report="))
    if mode == "stats-fail":
        print("ERROR: Report '" + report + "' could not be found.", file=sys.stderr)
        sys.exit(1)
    print(open(os.path.join(os.environ["FAKE_CSV_DIR"], report + ".csv")).read())
    sys.exit(0)
if mode == "fail":
    print("Collecting data...")
    print("nsys: the target application failed to start", file=sys.stderr)
    print("ERROR: exit code 3 from the launcher", file=sys.stderr)
    sys.exit(3)
if mode == "hang":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(os.environ["FAKE_PIDS"], "w") as f:
        f.write(f"{{os.getpid()}} {{child.pid}}")
    time.sleep(60)
out = next(a.split("=", 1)[1] for a in args if a.startswith("--output="))
out = re.sub(r"%q\\{{(\\w+)\\}}", lambda m: os.environ[m.group(1)], out)
if mode == "noreport" or os.environ.get("RANK") == os.environ.get("FAKE_SKIP_RANK", "-"):
    print("No reports were generated")
    sys.exit(0)
with open(out + ".nsys-rep", "wb") as f:
    f.write(b"fake report")
"""

FAKE_NCU = """\
#!{python}
import os, sys
args = sys.argv[1:]
mode = os.environ.get("FAKE_MODE", "ok")
log = args[args.index("--log-file") + 1]
if mode == "perm":
    print("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU "
          "Performance Counters on the target device 0.")
    sys.exit(1)
if mode == "fail":
    print("==ERROR== The application returned an error code (1).", file=sys.stderr)
    sys.exit(1)
text = open(os.environ["FAKE_NCU_CSV"]).read()
if mode == "none":
    text = "==WARNING== No kernels were profiled.\\n"
with open(log, "w") as f:
    f.write(text)
"""


def install(bin_dir: Path, name: str, source: str) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / name
    path.write_text(source.format(python=PY))
    path.chmod(0o755)
    return path


@pytest.fixture
def fake_nsys(tmp_path, monkeypatch):
    """A fake ``nsys`` first on the PATH, a GPU that seems present, and the CSV it prints."""
    install(tmp_path / "bin", "nsys", FAKE_NSYS)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(nsight, "_cuda_available", lambda: True)
    csv_dir = tmp_path / "csv"
    csv_dir.mkdir()
    for name, text in [(nsight.KERNEL_REPORT, KERNELS_CSV), (nsight.NVTX_REPORT, NVTX_CSV),
                       (nsight.MEM_TIME_REPORT, MEM_TIME_CSV),
                       (nsight.MEM_SIZE_REPORT, MEM_SIZE_CSV)]:  # fmt: skip
        (csv_dir / f"{name}.csv").write_text(text)
    monkeypatch.setenv("FAKE_CSV_DIR", str(csv_dir))
    return tmp_path


@pytest.fixture
def fake_ncu(tmp_path, monkeypatch):
    install(tmp_path / "bin", "ncu", FAKE_NCU)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(nsight, "_cuda_available", lambda: True)
    (tmp_path / "ncu.csv.in").write_text(NCU_CSV)
    monkeypatch.setenv("FAKE_NCU_CSV", str(tmp_path / "ncu.csv.in"))
    return tmp_path


def single(tmp_path: Path, **kw) -> nsight.NsysCommand:
    return nsight.NsysCommand(target=[PY, "-m", "mytrain", "--steps", "5"],
                              output=tmp_path / "out" / "step", **kw)  # fmt: skip


# --- nsys commands ------------------------------------------------------------------------------


def test_nsys_single_rank_command_with_cuda_profiler_api_capture():
    cmd = nsight.NsysCommand(target=[PY, "-m", "mytrain"], output="runs/step")
    assert cmd.argv() == [
        "nsys", "profile", TRACE, "--sample=none", "--cpuctxsw=none",
        "--capture-range=cudaProfilerApi", "--capture-range-end=stop",
        "--stats=false", "--force-overwrite=true", "--output=runs/step", PY, "-m", "mytrain",
    ]  # fmt: skip
    assert cmd.reports == (Path("runs/step.nsys-rep"),)
    assert cmd.shell() == shlex.join(cmd.argv()) == str(cmd)
    assert shlex.split(cmd.shell()) == cmd.argv()


def test_nsys_nvtx_capture_names_the_range_and_matches_unregistered_strings():
    cmd = nsight.NsysCommand(target=["python", "train.py"], output="r/x.nsys-rep",
                             capture="nvtx", nvtx_capture="profiled steps",
                             capture_end="stop-shutdown", stats=True)  # fmt: skip
    assert cmd.argv() == [
        "nsys", "profile", TRACE, "--sample=none", "--cpuctxsw=none",
        "--capture-range=nvtx", "--capture-range-end=stop-shutdown",
        "--nvtx-capture=profiled steps", "--env-var=NSYS_NVTX_PROFILER_REGISTER_ONLY=0",
        "--stats=true", "--force-overwrite=true", "--output=r/x", "python", "train.py",
    ]  # fmt: skip
    assert cmd.reports == (Path("r/x.nsys-rep"),)  # the extension given is not doubled
    assert "'--nvtx-capture=profiled steps'" in cmd.shell()  # quoted for a terminal


def test_nsys_without_capture_range_records_the_whole_run():
    cmd = nsight.NsysCommand(target=["./a.out"], output="whole", capture=None,
                             trace=("cuda", "osrt"), sample="process-tree",
                             force_overwrite=False, extra=("--cuda-memory-usage=true",))  # fmt: skip
    assert cmd.argv() == [
        "nsys", "profile", "--trace=cuda,osrt", "--sample=process-tree", "--cpuctxsw=none",
        "--stats=false", "--force-overwrite=false", "--cuda-memory-usage=true",
        "--output=whole", "./a.out",
    ]  # fmt: skip


def test_nsys_multi_rank_runs_nsys_per_rank_under_torchrun_one_report_each():
    cmd = nsight.NsysTorchrunCommand(module="labkit.workers.ddp", nproc=2, output="runs/ddp",
                                     module_args=["--steps", "3"], python="/py")  # fmt: skip
    assert cmd.argv() == [
        "/py", "-m", "torch.distributed.run", "--rdzv-backend=c10d",
        "--rdzv-endpoint=localhost:0", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=0",
        "--no-python",
        "nsys", "profile", TRACE, "--sample=none", "--cpuctxsw=none",
        "--capture-range=cudaProfilerApi", "--capture-range-end=stop", "--stats=false",
        "--force-overwrite=true", "--output=runs/ddp_rank%q{RANK}",
        "/py", "-u", "-m", "labkit.workers.ddp", "--steps", "3",
    ]  # fmt: skip
    assert cmd.reports == (Path("runs/ddp_rank0.nsys-rep"), Path("runs/ddp_rank1.nsys-rep"))


def test_nsys_multi_rank_with_nvtx_capture_and_extra_torchrun_flags():
    cmd = nsight.NsysTorchrunCommand(module="w", nproc=4, output="o", python="py",
                                     capture="nvtx", nvtx_capture="step",
                                     torchrun_args=["--log-dir=/tmp/l"])  # fmt: skip
    argv = cmd.argv()
    assert argv[: argv.index("--no-python") + 1][-2:] == ["--log-dir=/tmp/l", "--no-python"]
    assert "--nvtx-capture=step" in argv and "--output=o_rank%q{RANK}" in argv
    assert argv[-4:] == ["py", "-u", "-m", "w"]
    assert len(cmd.reports) == 4


@pytest.mark.parametrize(("kw", "message"), [
    ({"target": []}, "non-empty list"),
    ({"target": "python train.py"}, "non-empty list"),
    ({"output": ""}, "a path for the report"),
    ({"output": "r_%p"}, "substitution character"),
    ({"capture": "hotkey"}, "'cudaProfilerApi'"),
    ({"capture": "nvtx"}, "needs nvtx_capture"),
    ({"nvtx_capture": "step"}, "only used with capture='nvtx'"),
    ({"capture": "nvtx", "nvtx_capture": "s", "trace": ("cuda",)}, "needs 'nvtx' in trace"),
    ({"trace": ("nvtx", "osrt")}, "needs 'cuda' in trace"),
    ({"trace": ()}, "distinct API names"),
    ({"trace": ("cuda", "cuda")}, "distinct API names"),
    ({"trace": ("cuda,nvtx",)}, "distinct API names"),
    ({"capture_end": "repeat"}, "several reports per process"),
    ({"sample": "cpu"}, "sample='cpu' is not allowed"),
    ({"stats": "yes"}, "True or False"),
])  # fmt: skip
def test_nsys_command_refuses_bad_input_naming_the_fix(kw, message):
    args = {"target": [PY, "t.py"], "output": "o", **kw}
    with pytest.raises(ValueError, match=message):
        nsight.NsysCommand(**args)


@pytest.mark.parametrize(("kw", "message"), [
    ({"module": "not a module"}, "dotted module name"),
    ({"nproc": 0}, "nproc=0"),
    ({"nproc": True}, "nproc=True"),
    ({"module_args": "--steps 3"}, "list of strings"),
])  # fmt: skip
def test_nsys_torchrun_command_refuses_bad_input(kw, message):
    args = {"module": "w", "nproc": 2, "output": "o", **kw}
    with pytest.raises(ValueError, match=message):
        nsight.NsysTorchrunCommand(**args)


def test_nsys_stats_command_asks_for_one_report_as_csv_on_stdout():
    assert nsight.nsys_stats_command("r/step.nsys-rep", "cuda_gpu_kern_sum") == [
        "nsys", "stats", "--report=cuda_gpu_kern_sum", "--format=csv", "--output=-",
        "--force-export=true", "r/step.nsys-rep",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="report_name"):
        nsight.nsys_stats_command("r", "kern sum; rm -rf")


# --- ncu commands -------------------------------------------------------------------------------


def test_ncu_command_profiles_one_kernel_speed_of_light_as_csv():
    cmd = nsight.NcuCommand(target=[PY, "-m", "mytrain"], kernel_name="gemm|cutlass",
                            launch_skip=5, launch_count=1, log_file="runs/k.csv")  # fmt: skip
    assert cmd.argv() == [
        "ncu", "--kernel-name", "regex:gemm|cutlass", "--launch-skip", "5",
        "--launch-count", "1", "--section", "SpeedOfLight",
        "--metrics", "dram__bytes_read.sum,dram__bytes_write.sum",
        "--target-processes", "all", "--csv", "--page", "details", "--print-units", "base",
        "--log-file", "runs/k.csv", PY, "-m", "mytrain",
    ]  # fmt: skip
    assert cmd.reports == (Path("runs/k.csv"),)
    assert shlex.split(cmd.shell()) == cmd.argv()


def test_ncu_command_exact_name_no_extra_metrics():
    cmd = nsight.NcuCommand(target=["./a.out"], kernel_name="add_kernel", regex=False,
                            metrics=(), sections=("SpeedOfLight", "Occupancy"), log_file="k",
                            target_processes="application-only")  # fmt: skip
    assert cmd.argv() == [
        "ncu", "--kernel-name", "add_kernel", "--launch-skip", "0", "--launch-count", "1",
        "--section", "SpeedOfLight", "--section", "Occupancy",
        "--target-processes", "application-only", "--csv", "--page", "details",
        "--print-units", "base", "--log-file", "k", "./a.out",
    ]  # fmt: skip


@pytest.mark.parametrize(("kw", "message"), [
    ({"kernel_name": ""}, "the kernel's name"),
    ({"kernel_name": "gemm("}, "not a valid regular expression"),
    ({"launch_skip": -1}, "launch_skip=-1"),
    ({"launch_count": 0}, "launch_count=0"),
    ({"sections": (), "metrics": ()}, "would collect nothing"),
    ({"target_processes": "some"}, "'all' or 'application-only'"),
    ({"log_file": ""}, "a path for the CSV"),
    ({"target": []}, "non-empty list"),
])  # fmt: skip
def test_ncu_command_refuses_bad_input(kw, message):
    args = {"target": ["./a.out"], "kernel_name": "k", "log_file": "k.csv", **kw}
    with pytest.raises(ValueError, match=message):
        nsight.NcuCommand(**args)


class _Gemms:
    """Every matmul dispatched inside it, as (op, ((shape, stride, dtype) per tensor input)):
    what decides which cuBLAS kernel runs. Below autocast, so it sees the cast inputs."""

    def __enter__(self) -> set[tuple]:
        from torch.utils._python_dispatch import TorchDispatchMode

        calls: set[tuple] = set()
        ops = (torch.ops.aten.addmm, torch.ops.aten.mm)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.overloadpacket in ops:
                    calls.add((str(func.overloadpacket), tuple(
                        (tuple(a.shape), a.stride(), a.dtype) for a in args
                        if isinstance(a, torch.Tensor))))
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._mode.__enter__()
        return calls

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_ncu_snippet_makes_the_matmul_the_steps_mlp_makes(dtype):
    """Notebook 06's ncu target: the same op, shapes, layout and dtype as the up-projection of
    the GPT's MLP in a step autocast to dtype (so the same cuBLAS kernel on a GPU)."""
    from labkit.config import ModelConfig
    from labkit.model import GPT
    from labkit.train import autocast

    cfg = ModelConfig(vocab_size=256, seq_len=8, n_layer=1, n_head=2, d_model=16)
    b = 2
    m, k, n = b * cfg.seq_len, cfg.d_model, 4 * cfg.d_model
    with _Gemms() as snippet:
        exec(nsight.linear_snippet(m, k, n, dtype, device="cpu", repeats=1), {})
    model = GPT(cfg)
    x = torch.randint(0, 256, (b, cfg.seq_len))
    with _Gemms() as step, autocast(torch.device("cpu"), dtype):
        model(x, x)
    assert len(snippet) == 1 and snippet <= step, (snippet, step)


def test_the_ncu_snippet_refuses_a_dtype_no_run_trains_in():
    with pytest.raises(ValueError, match="dtype='tf32' is not allowed"):
        nsight.linear_snippet(8, 8, 8, "tf32")


# --- running nsys -----------------------------------------------------------------------------


def test_without_nsys_nothing_runs_and_the_command_is_printed(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no nsys
    cmd = single(tmp_path)
    res = nsight.run_nsys(cmd)
    assert isinstance(res, nsight.NotRun) and res.ran is False
    text = str(res)
    assert text.startswith("not run: nsys is not on the PATH")
    assert nsight.NSYS_INSTALL in text and cmd.shell() in text
    assert nsight.profile_nsys(cmd) == res
    assert not (tmp_path / "out").exists()  # nothing was created either


def test_without_a_gpu_a_cuda_capture_is_not_started(fake_nsys, monkeypatch):
    monkeypatch.setattr(nsight, "_cuda_available", lambda: False)
    res = nsight.run_nsys(single(fake_nsys))
    assert isinstance(res, nsight.NotRun) and "no CUDA GPU is visible" in res.reason


def test_a_failing_nsys_raises_with_its_exit_code_and_stderr(fake_nsys, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "fail")
    with pytest.raises(nsight.ToolFailed, match="exit code 3") as info:
        nsight.run_nsys(single(fake_nsys))
    assert info.value.returncode == 3
    assert "the target application failed to start" in str(info.value)
    assert "ERROR: exit code 3 from the launcher" in info.value.stderr_tail


def test_nsys_exiting_0_without_a_report_is_an_error_not_an_empty_table(fake_nsys, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "noreport")
    cmd = single(fake_nsys)
    cmd.reports[0].parent.mkdir(parents=True)
    cmd.reports[0].write_bytes(b"a report from an earlier run")  # must not pass for this one
    with pytest.raises(nsight.ReportMissing, match=r"torch\.cuda\.profiler\.start\(\)"):
        nsight.profile_nsys(cmd)
    assert not cmd.reports[0].exists()


def test_a_report_is_not_overwritten_when_told_not_to(fake_nsys):
    cmd = single(fake_nsys, force_overwrite=False)
    cmd.reports[0].parent.mkdir(parents=True)
    cmd.reports[0].write_bytes(b"keep me")
    with pytest.raises(FileExistsError, match="force_overwrite=True"):
        nsight.run_nsys(cmd)
    assert cmd.reports[0].read_bytes() == b"keep me"


def test_nsys_run_and_read_gives_the_four_tables(fake_nsys):
    cmd = single(fake_nsys)
    res = nsight.profile_nsys(cmd, timeout_s=60)
    assert isinstance(res, nsight.NsysResult) and res.run.reports == cmd.reports
    (rank,) = res.ranks
    assert [r.count for r in rank.kernels] == [30, 60, 10]
    assert rank.nvtx.get("forward").total_ns == 3_000_000
    assert rank.memops_time[0].name == "[CUDA memcpy Host-to-Device]"
    assert rank.memops_size[1].total_bytes == pytest.approx(4.194e6)
    assert "CUDA GPU kernel summary" in str(res) and "cutlass::Kernel2<…>" in str(res)


def test_a_failing_nsys_stats_raises_and_names_the_old_report_names(fake_nsys, monkeypatch):
    cmd = single(fake_nsys)
    assert isinstance(nsight.run_nsys(cmd), nsight.ToolRun)
    monkeypatch.setenv("FAKE_MODE", "stats-fail")
    with pytest.raises(nsight.ToolFailed, match="gpukernsum") as info:
        nsight.read_nsys_report(cmd.reports[0])
    assert "could not be found" in info.value.stderr_tail


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_hanging_nsys_is_ended_with_everything_it_started(fake_nsys, monkeypatch):
    pids = fake_nsys / "pids"
    monkeypatch.setenv("FAKE_MODE", "hang")
    monkeypatch.setenv("FAKE_PIDS", str(pids))
    start = time.monotonic()
    with pytest.raises(nsight.ToolTimeout, match="timeout_s=3"):
        nsight.run_nsys(single(fake_nsys), timeout_s=3)
    assert time.monotonic() - start < 30  # not the fake's 60 s
    tool, child = (int(p) for p in pids.read_text().split())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not (gone(tool) and gone(child)):
        time.sleep(0.05)
    assert gone(tool) and gone(child)


@pytest.mark.slow
def test_multi_rank_torchrun_starts_nsys_per_rank_and_every_report_must_exist(fake_nsys):
    """Real torchrun, fake nsys: torchrun accepts the flags, gives each nsys its RANK, and
    nsys's %q{RANK} names one report per rank; a rank without a report fails the run."""
    cmd = nsight.NsysTorchrunCommand(module="mytrain", nproc=2, output=fake_nsys / "r" / "ddp")
    env = {"TMPDIR": str(fake_nsys), "FAKE_SKIP_RANK": "1"}
    with pytest.raises(nsight.ReportMissing, match=r"ddp_rank1\.nsys-rep \(1 of 2 expected\)"):
        nsight.run_nsys(cmd, timeout_s=120, env=env)
    res = nsight.profile_nsys(cmd, timeout_s=120, env={"TMPDIR": str(fake_nsys)})
    assert isinstance(res, nsight.NsysResult)
    assert [s.report.name for s in res.ranks] == ["ddp_rank0.nsys-rep", "ddp_rank1.nsys-rep"]
    assert all(len(s.kernels) == 3 for s in res.ranks)
    assert "--- rank 1 ---" in str(res)


def test_bad_timeout_is_refused(fake_nsys):
    with pytest.raises(ValueError, match="timeout_s"):
        nsight.run_nsys(single(fake_nsys), timeout_s=0)


# --- reading nsys stats CSV ---------------------------------------------------------------------


def test_kernel_summary_reads_the_documented_columns_after_the_preamble():
    table = nsight.parse_kernel_summary(KERNELS_CSV)
    assert len(table) == 3
    gemm = table[0]
    assert gemm.name.startswith("void cutlass::Kernel2<cutlass_80_tensorop_bf16")
    assert (gemm.total_ns, gemm.count, gemm.time_pct) == (2860000, 30, 71.5)
    assert (gemm.avg_ns, gemm.med_ns, gemm.min_ns, gemm.max_ns, gemm.stddev_ns) == (
        95333.3, 95104.0, 94880, 97312, 610.2)  # fmt: skip
    assert "std::array<char *, (unsigned long)3>" in table[1].name  # commas inside quotes
    assert [r.name for r in table.top(2)] == [table[0].name, table[1].name]


def test_kernel_summary_tolerates_reordered_and_extra_columns_and_other_time_units():
    text = ("Name,Instances,GridXYZ,Total Time (us),Time (%)\n"
            '"k1",2,"  896    1    1",1500.5,60.0\n'
            '"k2",1,"  1  1  1",1000.0,40.0\n')  # fmt: skip
    table = nsight.parse_kernel_summary(text)
    assert [(r.name, r.count, r.total_ns) for r in table] == [("k1", 2, 1_500_500.0),
                                                              ("k2", 1, 1_000_000.0)]  # fmt: skip
    assert table[0].avg_ns is None  # a column the report did not have


def test_an_empty_report_is_an_empty_table_saying_why():
    text = ("Processing [/tmp/r.sqlite] with [/opt/nvidia/nsight-systems/2025.3.2/host-linux-x64/"
            "reports/cuda_gpu_kern_sum.py]...\n"
            "SKIPPED: /tmp/r.sqlite does not contain CUDA kernel data.\n")  # fmt: skip
    table = nsight.parse_kernel_summary(text)
    assert len(table) == 0 and "does not contain CUDA kernel data" in table.note
    assert "no rows" in str(table)


@pytest.mark.parametrize("text", [
    "",
    "hello, world\n1,2,3\n",
    "Time (%),Total Time (ns),Avg (ns),Name\n50,100,50,k\n",  # no Instances column
    NVTX_CSV.replace("Range", "Label"),
])  # fmt: skip
def test_text_that_is_not_the_report_gets_an_error_naming_the_expected_columns(text):
    parse = nsight.parse_nvtx_summary if "Style" in text else nsight.parse_kernel_summary
    with pytest.raises(nsight.CsvFormatError, match="'Total Time \\(ns\\)'") as info:
        parse(text)
    assert "Instances" in str(info.value)


def test_a_cell_that_is_not_a_number_is_an_error_naming_the_row():
    bad = KERNELS_CSV.replace("2860000", "2.8e6 ns")
    with pytest.raises(nsight.CsvFormatError, match="row 1, total"):
        nsight.parse_kernel_summary(bad)


def test_nvtx_summary_reads_style_and_range_and_strips_the_default_domain():
    table = nsight.parse_nvtx_summary(NVTX_CSV)
    assert [r.name for r in table] == [":backward", ":forward", ":optimizer"]
    assert [r.range_name for r in table] == ["backward", "forward", "optimizer"]
    assert table[0].style == "PushPop" and table.get(":backward") is table[0]
    with pytest.raises(KeyError, match="'data' is not in the NVTX range summary"):
        table.get("data")


def test_memory_operation_summaries_by_time_and_by_size():
    by_time = nsight.parse_memop_time_summary(MEM_TIME_CSV)
    assert [(r.name, r.count, r.total_ns) for r in by_time] == [
        ("[CUDA memcpy Host-to-Device]", 2, 756390), ("[CUDA memcpy Device-to-Host]", 1, 338818),
    ]  # fmt: skip
    by_size = nsight.parse_memop_size_summary(MEM_SIZE_CSV)
    assert by_size[0].total_bytes == pytest.approx(8.389e6)  # nsys's MB are 10^6 bytes
    assert by_size[0].avg_bytes == pytest.approx(4.194e6) and by_size[0].count == 2
    assert "total MB" in str(by_size) and "<table>" in by_size._repr_html_()
    with pytest.raises(nsight.CsvFormatError, match="'Total \\(MB\\)'"):
        nsight.parse_memop_size_summary(MEM_TIME_CSV)


def test_tables_print_short_kernel_names_and_render_html():
    table = nsight.parse_kernel_summary(KERNELS_CSV)
    text = str(table)
    assert text.splitlines()[1].split() == ["name", "total", "ms", "count", "avg", "µs", "med",
                                            "µs", "share", "%"]  # fmt: skip
    gemm = text.splitlines()[2].split()
    assert gemm == ["cutlass::Kernel2<…>", "2.860", "30", "95.3", "95.1", "71.5"]
    assert text.splitlines()[4].split()[0] == "at::native::(anonymous"  # namespace kept
    assert "<td>30</td>" in table._repr_html_()


@pytest.mark.parametrize(("name", "short"), [
    ("void at::native::vectorized_elementwise_kernel<(int)4, at::native::CUDAFunctor_add<float>,"
     " std::array<char *, (unsigned long)3>>(int, T2, T3)",
     "at::native::vectorized_elementwise_kernel<…>"),
    ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x3_tn",
     "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x3_tn"),
    ("add_kernel(float *, const float *, int)", "add_kernel"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<(int)4, float>(T4 *, int)",
     "at::native::(anonymous namespace)::cunn_SoftMaxForward<…>"),
])  # fmt: skip
def test_short_kernel_name(name, short):
    assert nsight.short_kernel_name(name) == short
    assert len(nsight.short_kernel_name(name * 3, width=20)) == 20


# --- the figure ---------------------------------------------------------------------------------


def test_kernel_figure_draws_the_top_kernels_largest_first():
    import matplotlib.pyplot as plt

    table = nsight.parse_kernel_summary(KERNELS_CSV)
    ax = nsight.plot_kernel_summary(table, top=2)
    bars = ax.patches
    assert len(bars) == 2 and bars[0].get_width() == pytest.approx(2.86)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[0].startswith("cutlass::Kernel2")
    captions = " ".join(t.get_text() for t in ax.texts)
    assert "1 more kernels: 0.34 ms" in captions and "not of wall time" in captions
    plt.close(ax.figure)
    with pytest.raises(ValueError, match="recorded no kernel"):
        nsight.plot_kernel_summary(nsight.parse_kernel_summary("SKIPPED: no kernel data\n"))
    with pytest.raises(ValueError, match="kernel summary"):
        nsight.plot_kernel_summary(nsight.parse_memop_size_summary(MEM_SIZE_CSV))


# --- ncu ------------------------------------------------------------------------------------------


def test_ncu_csv_is_read_into_kernels_with_speed_of_light_metrics():
    k0, k1 = nsight.parse_ncu_csv(NCU_CSV)
    assert (k0.id, k1.id, k0.name) == (0, 1, "vectorized_elementwise_kernel")
    assert (k0.process_id, k0.cc, k0.block_size, k0.grid_size) == ("4242", "9.0", "(128, 1, 1)",
                                                                   "(65536, 1, 1)")  # fmt: skip
    assert k0.duration_s == pytest.approx(42.08e-6)
    assert (k0.compute_throughput_pct, k0.memory_throughput_pct, k0.dram_throughput_pct) == (
        18.31, 91.62, 91.62)  # fmt: skip
    assert k0.dram_bytes == 134217728 + 67108864  # "134,217,728": thousands separators
    assert k1.dram_bytes == k0.dram_bytes
    assert k0.metrics["DRAM Frequency"].value == 2.619e9
    assert k0.metrics["Duration"].section == "GPU Speed Of Light Throughput"
    assert "SM 18.3%" in str(k0) and "42.1 µs" in str(k0)


def test_ncu_older_names_and_other_units_are_understood():
    text = NCU_CSV.replace('"Compute (SM) Throughput"', '"Compute (SM) [%]"').replace(
        '"Memory Throughput"', '"Memory [%]"').replace('"Duration","ns","42080"',
        '"Duration","usecond","42.08"')  # fmt: skip
    k0 = nsight.parse_ncu_csv(text)[0]
    assert k0.compute_throughput_pct == 18.31 and k0.memory_throughput_pct == 91.62
    assert k0.duration_s == pytest.approx(42.08e-6)


def test_ncu_without_kernels_is_empty_and_other_text_is_an_error():
    assert nsight.parse_ncu_csv("==WARNING== No kernels were profiled.\n") == []
    with pytest.raises(nsight.CsvFormatError, match="'Metric Name', 'Metric Unit'"):
        nsight.parse_ncu_csv(KERNELS_CSV)
    with pytest.raises(nsight.CsvFormatError, match="is not a launch number"):
        nsight.parse_ncu_csv(NCU_HEADER + '\n"x","1","p","h","k"' + ',"a"' * 10 + "\n")


def test_a_kernel_without_speed_of_light_says_how_to_collect_it():
    text = "\n".join(ln for ln in NCU_CSV.splitlines() if "Speed Of Light" not in ln)
    k0 = nsight.parse_ncu_csv(text)[0]
    with pytest.raises(nsight.ProfilerError, match="--section SpeedOfLight"):
        _ = k0.duration_s
    assert k0.dram_bytes == 201326592  # the other metrics are still there


def test_without_ncu_nothing_runs_and_the_command_is_printed(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    cmd = nsight.NcuCommand(target=[PY, "t.py"], kernel_name="k", log_file=tmp_path / "k.csv")
    res = nsight.run_ncu(cmd)
    assert isinstance(res, nsight.NotRun)
    assert str(res).startswith("not run: ncu is not on the PATH") and cmd.shell() in str(res)


def ncu_cmd(tmp_path: Path, **kw) -> nsight.NcuCommand:
    return nsight.NcuCommand(target=[PY, "t.py"], kernel_name="elementwise",
                             log_file=tmp_path / "out" / "k.csv", **kw)  # fmt: skip


def test_ncu_run_reads_the_csv_it_wrote(fake_ncu):
    res = nsight.run_ncu(ncu_cmd(fake_ncu, launch_count=2), timeout_s=60)
    assert isinstance(res, nsight.NcuResult)
    assert [k.id for k in res.kernels] == [0, 1]
    assert res.run.reports == (fake_ncu / "out" / "k.csv",)
    assert "SM 18.3%" in str(res)


def test_ncu_profiling_fewer_launches_than_asked_is_an_error(fake_ncu, monkeypatch):
    with pytest.raises(nsight.NothingProfiled, match="only 2 launch") as info:
        nsight.run_ncu(ncu_cmd(fake_ncu, launch_count=3))
    assert len(info.value.kernels) == 2  # kept on the error, never returned as the result
    monkeypatch.setenv("FAKE_MODE", "none")
    with pytest.raises(nsight.NothingProfiled, match="no launch of kernels matching"):
        nsight.run_ncu(ncu_cmd(fake_ncu))


def test_ncu_failures_name_the_exit_code_or_the_counter_permission(fake_ncu, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "fail")
    with pytest.raises(nsight.ToolFailed, match="exit code 1") as info:
        nsight.run_ncu(ncu_cmd(fake_ncu))
    assert "returned an error code" in info.value.stderr_tail
    monkeypatch.setenv("FAKE_MODE", "perm")
    with pytest.raises(nsight.ToolFailed, match=r"ERR_NVGPUCTRPERM.*developer\.nvidia\.com"):
        nsight.run_ncu(ncu_cmd(fake_ncu))


# --- on the roofline ----------------------------------------------------------------------------


def toy_roofline() -> roofline.Roofline:
    """Stand-in ceilings for the arithmetic (not a real device): ridge at 1e12/1e11 = 10."""
    def measured(value, unit, precision=None):
        return roofline.Ceiling(value=value, unit=unit, precision=precision,
                                device_name="test GPU", kind="measured", method="by hand",
                                device="cuda:0", when="2026-01-01T00:00:00+00:00")  # fmt: skip

    return roofline.Roofline(compute=(measured(1e12, roofline.FLOPS, "float32"),),
                             bandwidth=measured(1e11, roofline.BYTES))  # fmt: skip


def test_a_profiled_kernel_goes_on_the_roofline_with_measured_time_and_bytes():
    k0 = nsight.parse_ncu_csv(NCU_CSV)[0]
    flops = 2**24  # one add per element, modelled
    placed = nsight.place_on_roofline(toy_roofline(), k0, flops=flops)
    p = placed.point
    assert (p.flops, p.bytes, p.seconds) == (flops, 201326592, pytest.approx(42.08e-6))
    assert p.intensity == pytest.approx(flops / 201326592)
    assert p.achieved_flops_per_s == pytest.approx(flops / 42.08e-6)
    assert p.bound == "memory" and placed.bytes_source == "measured"
    assert placed.achieved_bytes_per_s == pytest.approx(201326592 / 42.08e-6)
    text = str(placed)
    assert "measured by ncu: duration 42.08 µs" in text and "compute (SM) 18.3%" in text
    assert "not of the roofline's measured ceilings" in text
    assert "measured by ncu: DRAM bytes" in text and "FLOPs: 1.678e+07 (modelled" in text


def test_modelled_bytes_are_labelled_and_missing_bytes_say_how_to_get_them():
    k0 = nsight.parse_ncu_csv(NCU_CSV)[0]
    placed = nsight.place_on_roofline(toy_roofline(), k0, flops=100.0, bytes_moved=3 * 4 * 2**24,
                                      name="add")  # fmt: skip
    assert placed.bytes_source == "modelled" and placed.point.name == "add"
    assert "modelled from shapes" in str(placed)
    no_dram = nsight.parse_ncu_csv("\n".join(ln for ln in NCU_CSV.splitlines()
                                             if "dram__bytes" not in ln))[0]  # fmt: skip
    with pytest.raises(nsight.ProfilerError, match="pass bytes_moved="):
        nsight.place_on_roofline(toy_roofline(), no_dram, flops=100.0)
    with pytest.raises(ValueError, match="must be an NcuKernel"):
        nsight.place_on_roofline(toy_roofline(), "k", flops=1.0)  # type: ignore[arg-type]


def test_the_placed_point_draws_on_notebook_04s_roofline():
    import matplotlib.pyplot as plt

    k0 = nsight.parse_ncu_csv(NCU_CSV)[0]
    placed = nsight.place_on_roofline(toy_roofline(), k0, flops=2**24)
    ax = roofline.plot_roofline(toy_roofline(), [placed.point])
    assert any(t.get_text() == placed.point.name for t in ax.texts)
    plt.close(ax.figure)


# --- the program's side -------------------------------------------------------------------------


def test_the_capture_range_is_a_no_op_without_cuda(monkeypatch):
    monkeypatch.setattr(nsight, "_cuda_available", lambda: False)
    with nsight.cuda_profiler_capture() as active:
        x = sum(range(10))
    assert active is False and x == 45


def test_not_run_prints_for_a_notebook():
    res = nsight.NotRun("nsys", "nsys profile x", "nsys is not on the PATH")
    assert repr(res) == str(res) == textwrap.dedent("""\
        not run: nsys is not on the PATH; the command would be:
          nsys profile x""")
