"""Closed-form estimates the course predicts before it measures.

Every number a notebook prints as "predicted" or "modelled" comes from a function in this package,
so each one states its formula, its units, the convention it follows and where the formula comes
from. Where the literature uses more than one convention (bytes per parameter, pipeline bubble),
each convention gets its own name and none is "the" answer.

Pure Python: no torch, no I/O, no state. Units are in the names or the docstrings: bytes, FLOPs
(floating-point operations, a count), FLOP/s (a rate), seconds.

The formulas by concern, one module each (the names notebooks, tests and labkit
use as ``formulas.<name>`` are re-exported here, whatever module holds them)::

    state_bytes    a dtype's bytes; parameters, gradients, optimizer state; ZeRO
    activations    what the backward keeps, per layer and outside; labkit's GPT term by term
    recompute      what checkpointed blocks and each recompute mode keep, and the FLOPs re-run
    max_batch      the largest micro-batch a memory budget holds (model states + activations)
    flops          parameter counts, training FLOPs, MFU, the roofline, GEMM tiles
    communication  collectives' bytes and bandwidths, α–β times, DDP buckets and overlap
    pipeline       pipeline bubbles, under both conventions; a pipeline step's time; 1F1B
    link_costs     one layer's compute against TP, PP and DP communication over named links
    multinode      an all-reduce across nodes, flat and two-level, over node counts
    checkpoints    a checkpoint's bytes; how often to write one (Young, Daly); steps lost
    step_time      step times from measured parts (gradient accumulation)
    boosting       boosted trees across workers: histogram all-reduce bytes per round, matrices

Notation (Korthikanti et al. 2022, arXiv 2205.05198; the Ultra-Scale Playbook):
      N  parameters           L  layers              h  hidden size (d_model)
      a  attention heads      s  sequence length     b  micro-batch size (sequences)
      V  vocabulary size      p  pipeline stages     m  micro-batches per step
      v  interleaved chunks   n  ranks               C  peak FLOP/s     W  link bandwidth (bytes/s)

Sources the modules cite:
    [nanoGPT]      karpathy/nanoGPT, model.py (GPT.get_num_params, GPT.estimate_mfu) and
                   transformer_sizing.ipynb.
    [PaLM]         Chowdhery et al. 2022, "PaLM", arXiv 2204.02311, Appendix B (model FLOPs, MFU).
    [llm.c]        karpathy/llm.c, train_gpt2.cu (adds 6·L·h·s per token, "the attention
                   matmul", to 6N with N including the position table).
    [Kaplan]       Kaplan et al. 2020, "Scaling Laws for Neural Language Models", arXiv 2001.08361.
    [Playbook]     Hugging Face, "The Ultra-Scale Playbook" (memory section; appendix A3).
    [ZeRO]         Rajbhandari et al. 2019, arXiv 1910.02054 (section 3, Figure 1).
    [ml-eng]       stas00/ml-engineering, training/performance/README.md
                   ("Anatomy of Model's Memory Usage").
    [scaling-book] jax-ml/scaling-book, training.md (section 5) and gpus.md, roofline.md.
    [Chen]         Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost",
                   arXiv 1604.06174 (checkpointed segments).
    [Korthikanti]  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
                   Models", arXiv 2205.05198, section 4.1.
    [NCCL-tests]   NVIDIA/nccl-tests, doc/PERFORMANCE.md.
    [GPipe]        Huang et al. 2019, arXiv 1811.06965, section 2.3.
    [Narayanan]    Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
                   Clusters Using Megatron-LM", arXiv 2104.04473, section 2.2.
"""

from __future__ import annotations

from labkit.formulas import boosting as boosting
from labkit.formulas.activations import (
    ATTENTION_KINDS,
    activation_bytes,
    activation_bytes_omitted,
    activation_bytes_per_layer,
    predicted_stage_activations,
)
from labkit.formulas.checkpoints import (
    checkpoint_bytes,
    checkpoint_bytes_per_param,
    checkpoint_waste_fraction,
    daly_checkpoint_interval,
    predicted_lost_steps,
    young_checkpoint_interval,
)
from labkit.formulas.communication import (
    algbw,
    allgather_bytes_per_rank,
    alpha_beta_fit,
    alpha_beta_time,
    bucket_count,
    bus_bandwidth_factor,
    busbw,
    dp_exposed_comm_fraction,
    dp_exposed_comm_s,
    dp_min_tokens_per_rank,
    dp_overlap_ratio,
    multinode_allreduce_time,
    reduce_scatter_bytes_per_rank,
    ring_allreduce_bytes_per_rank,
    ring_allreduce_time,
)
from labkit.formulas.flops import (
    critical_intensity,
    flops_per_token,
    gemm_quantization,
    gpt_parameter_counts,
    gpt_params,
    layer_training_flops,
    mfu,
    roofline_attainable_flops,
    training_flops,
)
from labkit.formulas.link_costs import link_costs
from labkit.formulas.max_batch import (
    OMISSIONS,
    predict_max_batch,
)
from labkit.formulas.multinode import (
    multinode_allreduce_sweep,
    plot_multinode_allreduce,
)
from labkit.formulas.pipeline import (
    bubble_fraction,
    bubble_overhead,
    one_f_one_b_in_flight,
)
from labkit.formulas.recompute import (
    ELEMENTWISE_FLOPS_PER_TOKEN_PER_LAYER,
    paper_bytes_per_layer,
    predict_checkpointing,
    predict_recompute,
    segment_checkpoint_bytes,
)
from labkit.formulas.state_bytes import (
    BYTES_PER_PARAM_CONVENTIONS,
    DTYPE_BYTES,
    OPTIMIZER_STATES,
    ZERO_STAGES,
    MemoryBreakdown,
    bytes_per_param,
    dtype_bytes,
    dtype_name,
    memory_breakdown,
    model_state_bytes,
    predicted_breakdown,
    predicted_bytes_per_param,
    zero_memory_per_rank,
)

__all__ = [
    "ATTENTION_KINDS",
    "BYTES_PER_PARAM_CONVENTIONS",
    "DTYPE_BYTES",
    "ELEMENTWISE_FLOPS_PER_TOKEN_PER_LAYER",
    "OMISSIONS",
    "OPTIMIZER_STATES",
    "ZERO_STAGES",
    "MemoryBreakdown",
    "activation_bytes",
    "activation_bytes_omitted",
    "activation_bytes_per_layer",
    "algbw",
    "allgather_bytes_per_rank",
    "alpha_beta_fit",
    "alpha_beta_time",
    "bubble_fraction",
    "bubble_overhead",
    "bucket_count",
    "bus_bandwidth_factor",
    "busbw",
    "bytes_per_param",
    "checkpoint_bytes",
    "checkpoint_bytes_per_param",
    "checkpoint_waste_fraction",
    "critical_intensity",
    "daly_checkpoint_interval",
    "dp_exposed_comm_fraction",
    "dp_exposed_comm_s",
    "dp_min_tokens_per_rank",
    "dp_overlap_ratio",
    "dtype_bytes",
    "dtype_name",
    "flops_per_token",
    "gemm_quantization",
    "gpt_parameter_counts",
    "gpt_params",
    "layer_training_flops",
    "link_costs",
    "memory_breakdown",
    "mfu",
    "model_state_bytes",
    "multinode_allreduce_sweep",
    "multinode_allreduce_time",
    "one_f_one_b_in_flight",
    "paper_bytes_per_layer",
    "plot_multinode_allreduce",
    "predict_checkpointing",
    "predict_max_batch",
    "predict_recompute",
    "predicted_breakdown",
    "predicted_bytes_per_param",
    "predicted_lost_steps",
    "predicted_stage_activations",
    "reduce_scatter_bytes_per_rank",
    "ring_allreduce_bytes_per_rank",
    "ring_allreduce_time",
    "roofline_attainable_flops",
    "segment_checkpoint_bytes",
    "training_flops",
    "young_checkpoint_interval",
    "zero_memory_per_rank",
]
