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
* :mod:`labkit.batching.lamb`  the layer-wise trust ratio of LARS and LAMB (You et al. 2017,
  2019) and LAMB as a ``torch.optim.Optimizer``; ``train_with`` trains as ``train.train`` does
  with the optimizer given.

Importing this package imports neither submodule's dependencies beyond torch: each is loaded
where it is used (``from labkit.batching import noise``).
"""
