"""Three training bottlenecks, each planted, measured, fixed and measured again.

Notebook 06 profiles them; this package builds and measures them, so the notebook only
orchestrates and a DataLoader worker process can import the dataset (a class defined in a
notebook cannot be unpickled in a worker: pytorch #20375). One module per bottleneck, and what
they share in one place; every name below imports from ``labkit.profiling.bottlenecks``:

    common           Measured, BeforeAfter; phased_step and annotated_step (the step every
                     bottleneck times); fresh copies of one initialised model
    data_loading     1. TokenizingDataset, loader variants, BatchStream, measure_data_loading;
                     time_batch_loading (a batch loaded in this process)
    launch_overhead  2. torch.compile against eager: measure_compile, inductor's cache
    host_sync        3. loss.item() every step against every K steps: measure_sync

1. **Data loading.** :class:`TokenizingDataset` tokenises raw text in Python inside
   ``__getitem__``, as a real pipeline does on the fly. With ``num_workers=0`` the training
   process does that work between steps, and the trace shows a ``data`` range as long as the
   compute; worker processes, prefetching and persistent workers move it off the critical
   path (:func:`loader_variants`, :func:`make_loader`, :func:`measure_data_loading`).
2. **Python overhead and many small kernels.** A small model is launch-bound: each operator
   costs microseconds of Python and dispatch whatever its size. ``torch.compile`` fuses
   operators into fewer, larger kernels and, with ``mode="reduce-overhead"`` on CUDA, replays
   the step as a CUDA graph with one launch (:func:`measure_compile`).
3. **Host-device synchronisation.** ``loss.item()`` every step makes the CPU wait for the GPU
   to drain its queue, so the CPU cannot run ahead and launch the next step's kernels. A CPU
   has no such queue, and :func:`measure_sync` says so instead of showing an effect it
   cannot have.

Typical use (what notebook 06 does at smoke size)::

    cfg = config.preset("smoke")
    hardware.limit_cpu_threads(1)
    passes = calibrate_passes(0.015, batch_size=cfg.train.micro_batch)  # ~ one smoke step
    ds = TokenizingDataset(seq_len=cfg.model.seq_len, passes=passes, n_items=64)
    data = measure_data_loading(cfg, ds)  # BeforeAfter: num_workers=0 ... workers, persistent
    comp = measure_compile(cfg)           # CompileResult: compile time, eager vs compiled
    sync = measure_sync(cfg)              # SyncResult: .item() every step vs every K steps
    print(data, comp, sync, sep="\n\n")

Every step is :func:`phased_step`, in the run's precision (``cfg.train.dtype``, autocast as
``labkit.train`` applies it), so a bf16 run is measured in bf16. Every result keeps its
samples (seconds per step), the device, and how they were measured;
``tokens_per_s`` is derived from the median step. Nothing here asserts or assumes a speed-up:
on a 2-core machine worker processes compete with the training process for the cores, so
the numbers decide.

Sources: in the docstring of each module.
"""

from __future__ import annotations

from labkit.profiling.bottlenecks.common import (
    BeforeAfter,
    Measured,
    annotated_step,
    phased_step,
)
from labkit.profiling.bottlenecks.data_loading import (
    BatchStream,
    DatasetItemError,
    LoaderError,
    LoaderVariant,
    TokenizingDataset,
    calibrate_passes,
    default_workers,
    loader_variants,
    make_loader,
    measure_data_loading,
    measure_loader,
    time_batch_loading,
    tokenize,
)
from labkit.profiling.bottlenecks.host_sync import (
    measure_sync,
)
from labkit.profiling.bottlenecks.launch_overhead import (
    INDUCTOR_CACHE_ENV,
    CompileResult,
    CompileUnavailable,
    check_compiler,
    compile_loss_rtol,
    measure_compile,
    use_inductor_cache,
)

__all__ = [
    "INDUCTOR_CACHE_ENV",
    "BatchStream",
    "BeforeAfter",
    "CompileResult",
    "CompileUnavailable",
    "DatasetItemError",
    "LoaderError",
    "LoaderVariant",
    "Measured",
    "TokenizingDataset",
    "annotated_step",
    "calibrate_passes",
    "check_compiler",
    "compile_loss_rtol",
    "default_workers",
    "loader_variants",
    "make_loader",
    "measure_compile",
    "measure_data_loading",
    "measure_loader",
    "measure_sync",
    "phased_step",
    "time_batch_loading",
    "tokenize",
    "use_inductor_cache",
]
