"""Batch-size tuning (notebook 05): how large a batch fits, how fast it runs, how large it
should be.

* :mod:`labkit.batching.noise`   the gradient noise scale and the critical batch size
  (McCandlish et al. 2018), learning-rate scaling rules, global-batch arithmetic;
* :mod:`labkit.batching.finder`  the largest micro-batch that fits: predicted from the memory
  model, then found by real trial steps, recovering from each out-of-memory failure;
* :mod:`labkit.batching.trials`  where a trial step runs and how its memory is measured and
  limited (live tensor bytes against a CPU budget, or a real CUDA OOM); ``measure_step_peak``;
* :mod:`labkit.batching.sweep`   tokens/s, FLOP/s, MFU (where a peak is published) and peak
  memory of a training step over micro-batch sizes, beside the predictions;
* :mod:`labkit.batching.accumulation`  k accumulated micro-batches against one batch k times
  larger: gradient parity, with and without dividing each loss by k;
* :mod:`labkit.batching.recomputation`  ``apply_checkpointing``: activation checkpointing of
  the GPT's blocks (all, or every n-th), the model code untouched; the peak of a checkpointed
  step predicted tensor by tensor (``checkpointed_step_moments``);
* :mod:`labkit.batching.recompute_lab`  notebook 03d's recompute modes predicted, measured and
  timed side by side, each a result with ``describe()``;
* :mod:`labkit.batching.lamb`  the layer-wise trust ratio of LARS and LAMB (You et al. 2017,
  2019) and LAMB as a ``torch.optim.Optimizer``; ``train_with`` trains as ``train.train`` does
  with the optimizer given.

* :mod:`labkit.batching.lab`  notebook 05's setup: the device, the tier and what it shows;
* :mod:`labkit.batching.ranks`  the global batch over data-parallel ranks: a DDP job's config
  and what it measured;
* :mod:`labkit.batching.sweep_report`, :mod:`labkit.batching.recomputation_report`  notebook
  05's readings of the sweep and of recomputation, each a result with ``describe()``.

Importing this package imports neither submodule's dependencies beyond torch: each is loaded
where it is used (``from labkit.batching import noise``, or ``batching.noise`` after ``from
labkit import batching``: the package loads a submodule the first time it is named).
"""

import importlib

SUBMODULES = ("accumulation", "finder", "lab", "lamb", "noise", "ranks", "recompute_lab", "recomputation",
              "recomputation_report", "sweep", "sweep_report", "trials")  # fmt: skip


def __getattr__(name: str):
    """``batching.sweep`` and the other submodules, imported when first named."""
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
