"""Profiling a training step: what the PyTorch profiler, NVTX and Nsight show, and why.

One short module each, measurement apart from display:

    phases             phase(name): a record_function range and an NVTX range with one name
    capture            profile_steps (a schedule, tables, one trace per active window),
                       counted_flops and net_bytes (the tables' FLOP and memory columns),
                       profiler_overhead (the cost of looking, measured) and time_cpu_step (a
                       CPU rank's step, profiler off)
    attribution        attribute_step: a step's time by kind of operator (matmul, attention,
                       optimizer, ...), from the profiler's self times
    trace              load_trace / load_traces: exported Chrome traces, refused when truncated,
                       missing or not a trace
    overlap            compute vs communication per rank (hidden, exposed), find_straggler, diagnose
                       (a rank's longest phase and what took its time); on a GPU, kernels counted in
                       the step that launched them (gpu_work) and the GPU's time split by kind of
                       kernel (gpu_split)
    summary            summarize_job: a multi-rank job's traces in tables (per rank, the collectives
                       and their kernels) and the straggler question, answered
    plot               plot_trace: a per-thread (per-stream) timeline drawn from the trace files
    memory_timeline    memory over time: the profiler's categories (CPU), the allocator's history
                       snapshot (CUDA), drawn with the phases shaded
    hta                holistic Trace Analysis on a job's traces, and what it could not do; its
                       TraceDiff (before/after) and CUDA kernel launch statistics
    nsight             nsys / ncu commands, runs and CSV readers; a kernel on the roofline
    bottlenecks        planted slow-downs (data loading, launch overhead, host syncs), measured
    step_report        a profiled step read out against its predictions: phases, FLOPs, the
                       profiler's cost, memory (what notebook 06 prints, as describe())
    dp_report          a data-parallel job's traces read out: per rank, the overlap bound, the
                       straggler, naive against DDP, HTA's counts beside labkit's
    fix_report         section 8's fixes against their predictions (data loading, compile)
    ncu_reports        nsight Compute's results read back: ncu --csv --page details as kernel
                       records, and a profiled kernel placed on notebook 04's roofline
    nsight_commands    the exact nsys and ncu command lines, built and validated before anything
                       runs
    nsight_runs        what running an Nsight tool ends as: a ToolRun, a NotRun, or an error
    nsys_reports       nsight Systems' statistics read back: the CSV of nsys stats as tables, and a
                       figure
    precision_report   a training step per precision, read out: its speed, where its time goes,
                       which case this machine is (what notebook 04's section 7 prints, as
                       describe())
    precision_report a step per precision: timed against fp32, where its time goes (Amdahl),
                     which case this machine is (what notebook 04 prints, as describe())

Importing this package profiles nothing, touches no GPU and imports no plotting library.
"""

from __future__ import annotations

from labkit._moved import submodules_on_demand
from labkit.profiling.attribution import Attribution, attribute_step
from labkit.profiling.capture import (
    MODES,
    Overhead,
    counted_flops,
    judge_prediction,
    net_bytes,
    profile_steps,
    profiler_overhead,
    quiet_kineto,
    time_cpu_step,
)
from labkit.profiling.dp_report import (
    DpPrediction,
    describe_diff_counts,
    dp_runs,
)
from labkit.profiling.fix_report import CompileBound, judge_compile, predict_loading
from labkit.profiling.hta import HtaReport, hta_report
from labkit.profiling.hta import launch_stats as hta_launch_stats
from labkit.profiling.hta import side_by_side as hta_side_by_side
from labkit.profiling.hta import trace_diff as hta_trace_diff
from labkit.profiling.memory_timeline import (
    forward_rise,
    plot_memory_timeline,
    record_memory_timeline,
)
from labkit.profiling.nsight import (
    NcuCommand,
    linear_snippet,
    place_on_roofline,
    plot_kernel_summary,
    profile_nsys,
    run_ncu,
    step_snippet,
)
from labkit.profiling.overlap import (
    RankTimes,
    compute_and_comm,
    find_straggler,
    hidden_fraction,
    rank_steps,
    rank_times,
)
from labkit.profiling.phases import PHASES, nvtx_backend, phase
from labkit.profiling.plot import plot_trace
from labkit.profiling.step_report import (
    flop_check,
    judge_overhead,
    net_bytes_check,
    phase_split,
    predict_memory,
    run_folder,
    tier_note,
)
from labkit.profiling.summary import summarize_job
from labkit.profiling.trace import Trace, TraceError, load_trace, load_traces

__all__ = [
    "MODES",
    "PHASES",
    "Attribution",
    "CompileBound",
    "DpPrediction",
    "HtaReport",
    "NcuCommand",
    "Overhead",
    "RankTimes",
    "Trace",
    "TraceError",
    "attribute_step",
    "compute_and_comm",
    "counted_flops",
    "describe_diff_counts",
    "dp_runs",
    "find_straggler",
    "flop_check",
    "forward_rise",
    "hidden_fraction",
    "hta_launch_stats",
    "hta_report",
    "hta_side_by_side",
    "hta_trace_diff",
    "judge_compile",
    "judge_overhead",
    "judge_prediction",
    "linear_snippet",
    "load_trace",
    "load_traces",
    "net_bytes",
    "net_bytes_check",
    "nvtx_backend",
    "phase",
    "phase_split",
    "place_on_roofline",
    "plot_kernel_summary",
    "plot_memory_timeline",
    "plot_trace",
    "predict_loading",
    "predict_memory",
    "profile_nsys",
    "profile_steps",
    "profiler_overhead",
    "quiet_kineto",
    "rank_steps",
    "rank_times",
    "record_memory_timeline",
    "run_folder",
    "run_ncu",
    "step_snippet",
    "summarize_job",
    "tier_note",
    "time_cpu_step",
]

__getattr__ = submodules_on_demand(__name__)  # profiling.bottlenecks: imported when first named
