"""The capstone's slow job: data-parallel training of the course GPT with planted faults.

    labkit.launch.run("labkit.workers.capstone_train", nproc=2,
                      config={"faults": ["slow_loader", "straggler"], "steps": 8})

Usually started by :func:`labkit.capstone.run_job`. Every rank trains the same GPT under torch
DDP on its share of each global batch, with the faults of ``faults`` planted (the catalogue and
what each one means: :mod:`labkit.capstone.faults`), and reports what the tools of notebooks
00–06 would show: per-step phase times, the all-reduces issued, its threads, the sample indices
it trained on, and the losses.

Config (all optional; :func:`labkit.capstone.run_job` passes the settings below as one
``sealed`` text, :func:`labkit.capstone.keys.seal`, so the job spec names no fault):
    model          GPT fields (seq_len, n_layer, n_head, d_model); default the smoke model
    faults         fault ids planted in this run (default none)
    global_batch   sequences per optimizer step over all ranks (default 32)
    micro_batch    sequences per micro-batch without ``tiny_micro_batch`` (default half a
                   rank's share: 2 micro-batches per step, so accumulation happens)
    steps          optimizer steps (default 8)
    epoch_steps    optimizer steps per epoch with a correct sampler (default 4): the dataset
                   holds global_batch × epoch_steps windows, so a run sees several epochs
    loader_passes  tokeniser passes per item: the dataset's preprocessing (default 200)
    straggler_s    seconds the last rank loses per step under ``straggler`` (default 0.1)
    threads        PyTorch threads per rank (default: the cores shared out among the ranks,
                   or every core under ``oversubscribed_threads``)
    dtype          the autocast dtype on a GPU without ``fp32_on_gpu`` (default bfloat16)
    seed, lr       (default 0, 1e-3)

What each fault switches (and its fix, the same switch off):
    slow_loader             the preprocessing runs in ``__getitem__`` every epoch, in the
                            training process; fixed, it runs once, before training (timed
                            apart as ``prepare_s``)
    tiny_micro_batch        micro-batches of 1 sequence (the same global batch: more of them)
    sync_every_micro_batch  no ``no_sync``: DDP all-reduces after every micro-batch
    straggler               the last rank sleeps ``straggler_s`` in each step's forward
    oversubscribed_threads  every rank runs as many PyTorch threads as the machine has cores
    no_sampler              a plain RandomSampler with one seed: every rank the same samples
    no_set_epoch            DistributedSampler without set_epoch: every epoch the same order
    fp32_on_gpu             fp32 instead of autocast to ``dtype`` (a GPU only)
    host_sync               ``loss.item()`` after every micro-batch's forward
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
import warnings
from typing import Any

import torch
import torch.distributed as tdist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, RandomSampler, Sampler
from torch.utils.data.distributed import DistributedSampler

from labkit import dist
from labkit.capstone.faults import BY_ID
from labkit.capstone.keys import unseal
from labkit.config import ModelConfig, TrainConfig
from labkit.model import GPT
from labkit.parallel import comm
from labkit.profiling.bottlenecks import TokenizingDataset
from labkit.timing import synchronize
from labkit.train import autocast, make_optimizer

FAULTS = tuple(BY_ID)  # the catalogue's ids: this job plants every one of them
SMOKE_MODEL = {"seq_len": 64, "n_layer": 2, "n_head": 2, "d_model": 64}


class PhaseClock:
    """Marks in time without waiting for the device: ``time.perf_counter`` on a CPU, CUDA events
    on a GPU (read once the step has synchronised), so timing the phases adds no sync of its
    own: one would hide the ``host_sync`` fault and blunt ``fp32_on_gpu``. On a GPU a phase is
    the time between two events on the stream; an event recorded on an idle stream completes
    at once, so a delay on the host between it and the next kernels (the straggler's sleep)
    falls inside the phase, as it does on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


class SyncCounter:
    """Counts the host-device synchronisations inside a ``with`` block on a GPU, through
    CUDA's sync debug mode (``torch.cuda.set_sync_debug_mode("warn")`` warns at every op that
    makes the CPU wait for the GPU: ``.item()``, printing a CUDA tensor, ``.cpu()``). Counts 0
    on a CPU, which has nothing to wait for."""

    def __init__(self, device: torch.device) -> None:
        self.cuda, self.count = device.type == "cuda", 0

    def __enter__(self) -> SyncCounter:
        if self.cuda:
            self._mode = torch.cuda.get_sync_debug_mode()
            self._caught = warnings.catch_warnings(record=True)
            self._records = self._caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode(self._mode)
            self._caught.__exit__(*exc)
            self.count = sum("synchroniz" in str(w.message) for w in self._records)


class Prepared(torch.utils.data.Dataset):
    """Every item of ``dataset`` computed once, up front: the fix for ``slow_loader``."""

    def __init__(self, dataset: torch.utils.data.Dataset) -> None:
        self.items = [dataset[i] for i in range(len(dataset))]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


class Recording(Sampler[int]):
    """``inner``'s indices, each epoch's appended to ``epochs`` as they are handed out."""

    def __init__(self, inner: Sampler[int], epochs: list[list[int]]) -> None:
        self.inner, self.epochs = inner, epochs

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self):
        self.epochs.append([])
        for i in self.inner:
            self.epochs[-1].append(int(i))
            yield i


def _check(cfg: dict[str, Any], n: int) -> dict[str, Any]:
    if "sealed" in cfg:  # labkit.capstone.run_job seals the settings out of the job spec's sight
        cfg = {**{k: v for k, v in cfg.items() if k != "sealed"}, **unseal(cfg["sealed"])}
    faults = list(cfg.get("faults", []))
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise ValueError(f"faults={unknown} are not planted by this job; it knows {list(FAULTS)}")
    g = int(cfg.get("global_batch", 32))
    if g % n:
        raise ValueError(f"global_batch={g} does not split over {n} ranks")
    share = g // n
    micro = 1 if "tiny_micro_batch" in faults else int(cfg.get("micro_batch", max(1, share // 2)))
    if share % micro:
        raise ValueError(f"micro_batch={micro} does not divide a rank's {share} sequences")
    return {**cfg, "faults": faults, "global_batch": g, "share": share, "micro": micro,
            "steps": int(cfg.get("steps", 8)), "epoch_steps": int(cfg.get("epoch_steps", 4)),
            "passes": int(cfg.get("loader_passes", 200)),
            "straggler_s": float(cfg.get("straggler_s", 0.1)),
            "seed": int(cfg.get("seed", 0)), "lr": float(cfg.get("lr", 1e-3)),
            "model": {**SMOKE_MODEL, **cfg.get("model", {})}}  # fmt: skip


@dist.entrypoint
def main(ctx: dist.Context) -> dict[str, Any]:
    n, rank, device = ctx.world_size, ctx.rank, ctx.device
    cfg = _check(ctx.config, n)
    faults = set(cfg["faults"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    threads = cfg.get("threads") or (cores if "oversubscribed_threads" in faults else max(1, cores // n))
    torch.set_num_threads(int(threads))

    # The data: windows of the course corpus, preprocessed in __getitem__ (slow_loader) or once.
    seq_len = cfg["model"]["seq_len"]
    raw = TokenizingDataset(seq_len=seq_len, passes=cfg["passes"],
                            n_items=cfg["global_batch"] * cfg["epoch_steps"])  # fmt: skip
    t0 = time.perf_counter()
    dataset = raw if "slow_loader" in faults else Prepared(raw)
    prepare_s = time.perf_counter() - t0
    if "no_sampler" in faults:  # the same seed on every rank: the same samples everywhere
        inner: Sampler[int] = RandomSampler(dataset, generator=torch.Generator().manual_seed(cfg["seed"]))
    else:
        inner = DistributedSampler(dataset, num_replicas=n, rank=rank, shuffle=True,
                                   seed=cfg["seed"], drop_last=True)  # fmt: skip
    epochs: list[list[int]] = []
    loader = DataLoader(dataset, batch_size=cfg["share"], sampler=Recording(inner, epochs),
                        drop_last=True)  # fmt: skip

    torch.manual_seed(cfg["seed"])  # the same initial weights on every rank (DDP broadcasts)
    model = GPT(ModelConfig(**cfg["model"])).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    counter = comm.ByteCounter(n, ctx.backend, "counted by a DDP communication hook")
    ddp.register_comm_hook(None, comm.counting_hook(counter, default_hooks.allreduce_hook))
    opt = make_optimizer(ddp, TrainConfig(lr=cfg["lr"]))
    dtype = "float32"
    if device.type == "cuda" and "fp32_on_gpu" not in faults:
        dtype = cfg.get("dtype", "bfloat16")
    k = cfg["share"] // cfg["micro"]
    last = rank == n - 1

    clock = PhaseClock(device)
    rec: dict[str, list[float]] = {p: [] for p in ("step_s", "data_s", "forward_s",
                                                   "backward_s", "optimizer_s")}  # fmt: skip
    losses, calls_per_step, early_calls, syncs_per_step, epoch = [], [], [], [], 0
    batches = iter(())
    if isinstance(inner, DistributedSampler) and "no_set_epoch" not in faults:
        inner.set_epoch(epoch)
    for step in range(cfg["steps"]):
        synchronize(device)
        t_start = time.perf_counter()
        batch = next(batches, None)
        if batch is None:  # the epoch ended: a new pass over the data
            if epochs:
                epoch += 1
                if isinstance(inner, DistributedSampler) and "no_set_epoch" not in faults:
                    inner.set_epoch(epoch)
            batches = iter(loader)
            batch = next(batches)
        x, y = (t.to(device) for t in batch)
        t_data = time.perf_counter()
        total = torch.zeros((), device=device)
        spans = []  # (forward start, backward start, backward end) marks per micro-batch
        host_syncs = SyncCounter(device)
        with host_syncs:
            for j in range(k):
                sl = slice(j * cfg["micro"], (j + 1) * cfg["micro"])
                sync = (j == k - 1) or "sync_every_micro_batch" in faults
                with contextlib.nullcontext() if sync else ddp.no_sync():
                    a = clock.mark()
                    if last and j == 0 and "straggler" in faults:
                        time.sleep(cfg["straggler_s"])  # a slow node: its compute takes longer
                    with autocast(device, dtype):
                        _, loss = ddp(x[sl], y[sl])
                    loss = loss / k
                    if "host_sync" in faults:
                        loss.item()  # the CPU waits for the GPU to drain its queue
                    b = clock.mark()
                    loss.backward()
                    spans.append((a, b, clock.mark()))
                if j == k - 2:  # DDP's hook has run for every bucket this backward made ready
                    early_calls.append(counter.calls_so_far())
                total += loss.detach()
        c = clock.mark()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end = clock.mark()
        synchronize(device)  # once per step: no other wait the faults could hide behind
        t_end = time.perf_counter()
        fwd = sum(clock.seconds(a, b) for a, b, _ in spans)
        bwd = sum(clock.seconds(b, e) for _, b, e in spans)
        counter.end_step()
        calls_per_step.append(sum(v["calls"] for v in counter.steps[-1].values()))
        syncs_per_step.append(host_syncs.count)
        tdist.all_reduce(total)  # the mean loss over ranks (reporting, not counted)
        losses.append(float(total) / n)
        for key, v in (("step_s", t_end - t_start), ("data_s", t_data - t_start),
                       ("forward_s", fwd), ("backward_s", bwd),
                       ("optimizer_s", clock.seconds(c, end))):
            rec[key].append(v)
        ctx.heartbeat(step=step + 1, total=cfg["steps"])
    with torch.no_grad():
        checksum = float(sum(p.double().sum() for p in model.parameters()))
    tokens = cfg["global_batch"] * seq_len
    steady = rec["step_s"][1:] or rec["step_s"]
    return {
        "rank": rank, **rec, "prepare_s": prepare_s,
        "tokens_per_s": tokens / statistics.median(steady),
        "allreduce_calls": calls_per_step, "host_syncs": syncs_per_step,
        "allreduce_calls_before_last_micro_batch": early_calls or [0] * len(calls_per_step), "micro_batch": cfg["micro"], "grad_accum": k,
        "threads": torch.get_num_threads(), "cores": cores, "world_size": n,
        "indices": epochs, "losses": losses, "checksum": checksum, "dtype": dtype,
        "device": str(device),
    }  # fmt: skip


if __name__ == "__main__":
    main()
