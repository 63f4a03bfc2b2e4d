"""All-reduce one tensor across ranks: report its values, time it, and time the link under it.

    allreduce.run(allreduce.AllReduceConfig(numel=2**20), nproc=2)

Config (:class:`AllReduceConfig`, every field optional):
    numel    elements in the float32 tensor each rank contributes (default 2**20 = 4 MiB)
    repeats  timed all-reduces after warm-up (default 10)
    warmup   untimed all-reduces first: connection setup and caches (default 3)
    op       the reduction: "sum" (default) or "max"
    expect   the value every element is checked against (default: what ``op`` gives, n(n+1)/2
             for a sum, n for a max); a caller that predicted a value passes it, so that the
             count of elements that differ is a count against its own prediction
    wire     count the loopback interface's bytes around the timed all-reduces, and around a
             baseline of the same ranks doing only a barrier for as long (default True; gloo
             ranks on one Linux host only, see below)
    probe    time the link under the collective first: each rank sends a message to the next
             rank and receives one from the previous, as in one step of a ring, once with 4
             bytes and once with numel/n elements, at least 1 MiB (default True; see below)
    fail_rank  this rank fails before the all-reduce, to show what a failing rank looks like
    fail_how   how it fails: "raise" (default: a Python exception) or "kill" (it sends itself
               SIGKILL, the signal Linux's out-of-memory killer sends: no code runs after it)

Each rank fills its tensor with ``rank + 1``; after a sum all-reduce every element should equal
1 + 2 + ... + n = n(n+1)/2 on every rank. The worker does not judge that: it reports what it
holds against ``expect`` (``expected``: the value it compared with; ``value``: the element
farthest from it, so ``value == expected`` says every element is right; ``wrong_elements``:
how many differ from it; also the first, smallest and largest element) and the caller
checks it, so a wrong result reaches the notebook as a failed check rather than as
a crashed rank. The timing follows NCCL-tests (doc/PERFORMANCE.md):

    algbw = message bytes / time                  (what the caller sees)
    busbw = algbw * 2(n-1)/n                      (NCCL-tests' correction factor: makes the
                                                   figure comparable across n with a link's speed)

The probe's two timings are what ``formulas.alpha_beta_fit`` turns into a latency α and a
bandwidth β, from which ``formulas.ring_allreduce_time`` predicts the all-reduce's time. Every
byte the probe and the all-reduces send is counted in the result (``sent_payload_bytes``), so
a caller counting the network interface's bytes can hold them against it.

Notebook 00's sizes are :func:`preset`; what the notebook makes of the result (the value
check, the bytes and the time reconciled, its summary) is :mod:`labkit.workers.allreduce_report`,
which runs in the notebook's kernel, not in the ranks.

Bytes on the wire (``labkit.metrics.net``): gloo ranks on one host talk TCP over loopback, so
the ``lo`` counters read between two barriers around the timed loop (``wire_loop_bytes`` in
``wire_loop_s``) hold the warm-up and timed all-reduces of every rank, plus whatever else used
``lo`` meanwhile. The baseline that follows (``wire_idle_bytes`` in ``wire_idle_s``: the ranks
wait, then meet in a barrier, for as long as the loop took, at most ``WIRE_IDLE_MAX_S``) measures
that background, to be subtracted at its rate. Where the bytes cannot be counted (NCCL moves
them over NVLink or PCIe; not Linux) the entries are None and ``wire_unavailable`` says why.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import statistics
import time
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as tdist

from labkit import formulas, validate
from labkit.jobs import runtime
from labkit.jobs.spec import WorkerConfig
from labkit.metrics import net

if TYPE_CHECKING:
    from labkit.jobs import launch

OPS = {"sum": tdist.ReduceOp.SUM, "max": tdist.ReduceOp.MAX}
FAIL_HOWS = ("raise", "kill")
PROBE_TIMES = 20  # exchanges per probe size (median): a few ms over loopback
PROBE_MIN_BIG = 2**18  # elements (1 MiB): the big message must take clearly longer than 4 bytes
WIRE_IDLE_MAX_S = 3.0  # the longest baseline window; its bytes are scaled to the loop's time


@dataclasses.dataclass(frozen=True, kw_only=True)
class AllReduceConfig(WorkerConfig):
    """One all-reduce job (the module docstring says what each part measures)."""

    WORKER: ClassVar[str] = "labkit.workers.allreduce"
    numel: int = 2**20
    """Elements in the float32 tensor each rank contributes (2**20: 4 MiB)."""
    repeats: int = 10
    """Timed all-reduces after warm-up."""
    warmup: int = 3
    """Untimed all-reduces first: connection setup and caches."""
    op: str = "sum"
    """The reduction: "sum" or "max"."""
    expect: float | None = None
    """The value every element is checked against (None: what ``op`` gives)."""
    wire: bool = True
    """Count the loopback interface's bytes around the timed all-reduces."""
    probe: bool = True
    """Time the link under the collective first (α and β)."""
    fail_rank: int | None = None
    """This rank fails before the all-reduce (None: none does)."""
    fail_how: str = "raise"
    """How ``fail_rank`` fails: "raise" (an exception) or "kill" (SIGKILL)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        validate.whole("numel", self.numel, low=1)
        validate.whole("repeats", self.repeats, low=1)
        validate.whole("warmup", self.warmup, low=0)
        validate.one_of("op", self.op, tuple(OPS))
        if self.expect is not None:
            validate.number("expect", self.expect)
        validate.flag("wire", self.wire)
        validate.flag("probe", self.probe)
        if self.fail_rank is not None:
            validate.whole("fail_rank", self.fail_rank, low=0)
        validate.one_of("fail_how", self.fail_how, FAIL_HOWS)


# Notebook 00's job per size: a GPU-sized message only when the ranks have GPUs (over loopback
# it would take minutes), and enough timed repeats that the median is steady.
PRESET_NUMEL = {"smoke": 2**16, "lab": 2**20, "gpu": 2**26}
PRESET_REPEATS = {"smoke": 300, "lab": 300, "gpu": 500}
PRESET_WARMUP = 3


def preset(size: str, device: str, **fields: Any) -> AllReduceConfig:
    """Notebook 00's all-reduce at ``size`` ("smoke", "lab" or "gpu") for ranks on ``device``
    ("cpu" or "cuda"): the "gpu" size on CPU ranks runs the lab's message. ``fields`` set the
    rest (``op``, ``expect``...)."""
    validate.one_of("size", size, tuple(PRESET_NUMEL))
    scale = "lab" if size == "gpu" and device == "cpu" else size
    return AllReduceConfig(numel=PRESET_NUMEL[scale], warmup=PRESET_WARMUP,
                           repeats=PRESET_REPEATS[scale], **fields)  # fmt: skip


def run(config: AllReduceConfig, *, nproc: int = 2, **launch_options: Any) -> launch.JobResult:
    """Launch ``config`` on ``nproc`` ranks; ``launch_options`` go to ``launch.run``."""
    from labkit.jobs import launch  # the caller's side: a rank never imports the launcher
    return launch.run(config, nproc=nproc, **launch_options)


def _sync(device: torch.device) -> None:
    # CUDA collectives are asynchronous: without this we would time the launch, not the work.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@runtime.entrypoint
def main(ctx: runtime.Context) -> dict:
    cfg = AllReduceConfig.from_dict(ctx.config)
    numel, repeats, warmup, op = cfg.numel, cfg.repeats, cfg.warmup, cfg.op
    n = ctx.world_size
    expected = float(cfg.expect if cfg.expect is not None else n * (n + 1) / 2 if op == "sum" else n)
    wire_why = _wire_unavailable(ctx) if cfg.wire else "not asked (wire=False)"

    fail_rank, fail_how = cfg.fail_rank, cfg.fail_how
    if fail_rank == ctx.rank and fail_how == "kill":
        time.sleep(0.5)  # let the other ranks reach the all-reduce, where they wait for us
        os.kill(os.getpid(), signal.SIGKILL)
    if fail_rank == ctx.rank:
        raise RuntimeError(f"rank {ctx.rank} fails on purpose (config fail_rank={fail_rank})")

    # 0. The link under the collective, timed before it (α and β of the α–β model): a tiny
    # message (its time is the per-message cost α) and a ring step's chunk, numel/n elements
    # (at least 1 MiB, so that its time stands clear of α even on a busy machine).
    sent = 0.0  # payload bytes this rank sends, probe and all-reduces
    probe_result: dict = {}
    if cfg.probe and n > 1:
        small, small_sent = _probe(ctx, 1, PROBE_TIMES)
        big, big_sent = _probe(ctx, max(numel // n, PROBE_MIN_BIG), PROBE_TIMES)
        sent += small_sent + big_sent
        probe_result = {"probe_small_bytes": small["bytes"], "probe_small_s": small["s"],
                        "probe_big_bytes": big["bytes"], "probe_big_s": big["s"]}  # fmt: skip

    # 1. The values. The caller checks them (notebook 00 prints the check); a worker that
    # raised here would turn a wrong sum into a crashed rank, and the check could never fail.
    x = torch.full((numel,), float(ctx.rank + 1), dtype=torch.float32, device=ctx.device)
    with ctx.phase("all_reduce"):
        tdist.all_reduce(x, op=OPS[op])
    sent += formulas.ring_allreduce_bytes_per_rank(numel * x.element_size(), n)
    farthest = x[(x - expected).abs().argmax()].item()
    wrong = int((x != expected).sum().item())
    value = x[0].item()
    if wrong:
        ctx.print0(f"all-reduce of {n} ranks ({op}): {wrong} of {numel} elements differ from "
                   f"the expected {expected:g} on rank 0 (element 0 = {value:g})")  # fmt: skip
    else:
        ctx.print0(f"all-reduce of {n} ranks: every element = {value:g} (expected {expected:g}, "
                   f"{op})")  # fmt: skip

    # 2. Timing, with loopback's bytes counted around the loop: the barriers put every rank's
    # all-reduces inside the window and nothing of the setup before it.
    buf = torch.zeros(numel, dtype=torch.float32, device=ctx.device)
    times_s = []
    # read before the barrier: a rank let go first may send before this rank reads again
    loop_start, wire_start = time.perf_counter(), _wire_now(wire_why)
    tdist.barrier()
    for i in range(warmup + repeats):
        _sync(ctx.device)
        t0 = time.perf_counter()
        with ctx.phase("all_reduce"):
            tdist.all_reduce(buf)
        _sync(ctx.device)
        if i >= warmup:
            times_s.append(time.perf_counter() - t0)
        sent += formulas.ring_allreduce_bytes_per_rank(numel * buf.element_size(), n)
        ctx.heartbeat(step=i + 1, total=warmup + repeats)
    tdist.barrier()
    wire = _wire_delta(wire_start, _wire_now(wire_why), time.perf_counter() - loop_start, "loop")
    if wire_why is None:
        # The baseline: the same ranks, no all-reduce, as long (what else used lo meanwhile).
        idle_s = min(wire["wire_loop_s"], WIRE_IDLE_MAX_S)
        idle_start, t_idle = _wire_now(wire_why), time.perf_counter()
        time.sleep(idle_s)
        tdist.barrier()
        wire |= _wire_delta(idle_start, _wire_now(wire_why), time.perf_counter() - t_idle, "idle")
    else:
        wire |= {"wire_idle_bytes": None, "wire_idle_s": None}
    wire["wire_unavailable"] = wire_why

    msg_bytes = numel * x.element_size()
    median_s = statistics.median(times_s)
    algbw = formulas.algbw(msg_bytes, median_s)  # bytes/s
    busbw = algbw * formulas.bus_bandwidth_factor("all_reduce", n)
    ctx.print0(
        f"{msg_bytes / 2**20:.3g} MiB all-reduce: median {median_s * 1e3:.3g} ms, "
        f"busbw {busbw / 1e9:.3g} GB/s ({ctx.backend}, {ctx.device.type})"
    )
    return {
        "rank": ctx.rank,
        "world_size": n,
        "backend": ctx.backend,
        "device": str(ctx.device),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "op": op,
        "value": farthest,  # == expected exactly when every element is right
        "first": value,
        "value_min": x.min().item(),
        "value_max": x.max().item(),
        "farthest": farthest,
        "wrong_elements": wrong,
        "expected": expected,
        "bytes_per_element": x.element_size(),
        "message_bytes": msg_bytes,
        "allreduces": 1 + warmup + repeats,
        "loop_allreduces": warmup + repeats,
        "sent_payload_bytes": sent,
        **probe_result,
        **wire,
        "repeats": len(times_s),
        "median_s": median_s,
        "min_s": min(times_s),
        "algbw_GBps": algbw / 1e9,
        "busbw_GBps": busbw / 1e9,
    }


def _wire_unavailable(ctx: runtime.Context) -> str | None:
    """Why this job's traffic cannot be counted on loopback, or None."""
    if ctx.backend != "gloo":
        # Not counted on the GPU tier. NVLink has byte counters of its own: NVML field values
        # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX
        # (https://docs.nvidia.com/deploy/nvml-api/group__nvmlFieldValueEnums.html),
        # `nvidia-smi nvlink -gt d`, DCGM's DCGM_FI_PROF_NVLINK_TX_BYTES
        # (https://docs.nvidia.com/datacenter/dcgm/latest/dcgm-api/dcgm-api-field-ids.html).
        # This worker does not read them: no GPU run of this course has checked what they count
        # under NCCL, which on NVSwitch machines may reduce inside the switch (NVLink SHARP,
        # NCCL_NVLS_ENABLE) instead of running the ring the prediction counts, and PCIe has no
        # byte counter to read around a loop (NVML's PCIe figure is a rate over 20 ms).
        return (f"{ctx.backend} moves the bytes over NVLink or PCIe, not through a network "
                "interface, and this course does not read NVLink's own counters (NVML, "
                "`nvidia-smi nvlink -gt d`, DCGM): on the GPU tier notebook 00 checks the "
                "values and the time, not the bytes")
    if ctx.world_size != int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size)):
        return "the ranks span several hosts: their traffic is not all on this host's loopback"
    return net.unavailable("lo")


def _wire_now(why: str | None) -> net.WireBytes | None:
    return None if why else net.interface_bytes("lo")


def _wire_delta(start: net.WireBytes | None, end: net.WireBytes | None, seconds: float,
                name: str) -> dict:  # fmt: skip
    """{"wire_<name>_bytes": bytes lo carried between the two readings, "wire_<name>_s": ...}."""
    if start is None or end is None:
        return {f"wire_{name}_bytes": None, f"wire_{name}_s": None}
    return {f"wire_{name}_bytes": end.sent - start.sent, f"wire_{name}_s": seconds}


def _probe(ctx: runtime.Context, numel: int, times: int) -> tuple[dict, float]:
    """Time one ring step: send ``numel`` float32 to the next rank while receiving as many from
    the previous one, ``times`` times (median). Returns the result entries and the bytes sent."""
    n = ctx.world_size
    send = torch.zeros(numel, dtype=torch.float32, device=ctx.device)
    recv = torch.empty_like(send)
    ops = [tdist.P2POp(tdist.isend, send, (ctx.rank + 1) % n),
           tdist.P2POp(tdist.irecv, recv, (ctx.rank - 1) % n)]  # fmt: skip
    samples = []
    for i in range(times + 1):  # the first exchange sets the pair's connection up: untimed
        _sync(ctx.device)
        t0 = time.perf_counter()
        for work in tdist.batch_isend_irecv(ops):
            work.wait()
        _sync(ctx.device)
        if i:
            samples.append(time.perf_counter() - t0)
    return {"s": statistics.median(samples), "bytes": numel * send.element_size()}, \
        (times + 1) * numel * send.element_size()


if __name__ == "__main__":
    main()
