"""Choosing a parallel layout: enumerate DP × TP × PP (× CP, × EP) and rank them, all modelled.

    model = planner.ModelSpec(n_layer=126, d_model=16384, n_head=128, vocab_size=128_000,
                              seq_len=8192, n_kv_head=8, ffn_hidden=53248, glu=True)
    cluster = planner.Cluster.from_tables("NVIDIA H100 80GB HBM3", n_gpus=8192, gpus_per_node=8,
                                          intra_node="NVLink 4",
                                          inter_node="InfiniBand NDR 400 Gb/s")
    plan = planner.plan(model, cluster, planner.Workload(global_batch=2048, mfu=0.5))
    print(plan.table(8))                      # layouts that fit, fastest first, then the rest

Every number this package returns is **modelled**: closed-form formulas (labkit.formulas and the
ones below) applied to published hardware figures (labkit.hardware's PEAK_TABLE, MEMORY_TABLE
and LINK_TABLE, each row with its source) and to assumptions the caller passes and the output
names (the MFU compute runs at, whether data-parallel communication overlaps the last
backward). A device the tables do not know gets no guessed peak: ``Device.from_table`` refuses
it. A measured figure (this machine's matmul ceiling, its loopback bandwidth) may be passed in
explicitly, and is then labelled as measured.

The model of one training step on one GPU (the slowest pipeline stage), with m micro-batches
per step and v model chunks per pipeline rank (interleaved 1F1B when v > 1):

    step = (m + (p−1)/v) · (compute_mb + tp_mb + cp_mb + ep_mb)      pipeline incl. bubble
           + 2·v·m · (α + act_bytes/β_pp)                            stage-boundary sends
           + max(0, dp_sync − overlap)                               gradient sync, ZeRO

* compute_mb: the micro-batch's training FLOPs on this GPU (6N + 12·L·h·s per token, the
  attention convention of nanoGPT and PaLM, plus what recomputation redoes), at an **assumed**
  fraction of the published dense peak (``Workload.mfu``);
* tp_mb: Megatron TP's 4 all-reduces per layer (2 forward, 2 backward; 6 with full
  recomputation) of a (b, s/cp, h) activation, ring over the intra-node link (Shoeybi et al.
  2019, arXiv 1909.08053). Sequence parallelism replaces each by a reduce-scatter and an
  all-gather of the same volume (Korthikanti et al. 2022, arXiv 2205.05198);
* cp_mb: context parallelism as Llama 3 runs it: K and V all-gathered in the forward, their
  gradients reduce-scattered in the backward (Llama Team 2024, arXiv 2407.21783, section 3.3.2);
* ep_mb: expert parallelism's four all-to-alls per MoE layer (dispatch and combine, forward and
  backward) of the routed tokens;
* the bubble: (p−1)/v extra micro-batch slots (Narayanan et al. 2021, arXiv 2104.04473,
  section 2.2);
* dp_sync: ZeRO 0 all-reduces the gradients; 1 and 2 reduce-scatter them and all-gather the
  updated parameters (same volume); 3 reduce-scatters them and all-gathers the parameters for
  the forward and again for the backward of every micro-batch (Rajbhandari et al. 2019, arXiv 1910.02054; the
  Playbook's "1.5×" is m = 1), prefetched behind that micro-batch's compute. With
  ``overlap_dp`` the final sync hides behind the last micro-batch's backward as far as it can.

Memory per GPU (the first pipeline stage, which holds the most activations): parameters,
gradients and optimizer state from ``formulas.zero_memory_per_rank`` over the data-parallel
group; activations per layer from ``formulas.activation_bytes_per_layer`` (Korthikanti et al.
2022, section 4), sharded by TP (all of it with sequence parallelism, all but the
LayerNorm and dropout regions without) and by CP, times the micro-batches a 1F1B first stage
holds: min(p, m), × (1 + (p−1)/(p·v)) when interleaved (Korthikanti et al. 2022, section 4.2,
equation 5 and its correction for the interleaved schedule).

What the model leaves out, on purpose (say so when comparing with a real run): GEMM efficiency
falling at small micro-batches or thin TP shards (one MFU for every layout); communication
overlapped with compute other than the data-parallel sync; latency beyond each link's α
(default 0); the embedding and loss stages' extra compute and the logits' memory; the
allocator's fragmentation, CUDA context and NCCL buffers; stragglers and failures; GQA's and
SwiGLU's activation shapes (the activation count is a GPT block's, Korthikanti's).

By concern, one module each (what notebooks and tests use is re-exported here: ``planner.<name>``)::

    specs       the inputs (model, link, device, cluster, workload, search, layout) and the checks
    prediction  memory, time and bytes per step of one layout, modelled
    search      every admissible layout, predicted and ranked; the ranking's sensitivity
    published   published configurations to hold it against; this machine as a cluster
    report      what notebook 03d prints and draws about plans, and this machine's link checks
"""

from __future__ import annotations

from labkit.planner.prediction import (
    Prediction,
    predict,
)
from labkit.planner.published import (
    published_cases,
    this_machine,
)
from labkit.planner.report import (
    DPSyncCheck,
    check_dp_sync,
    describe_bytes,
    describe_choices,
    describe_published,
    describe_sensitivity,
    fit_link,
    plot_layouts,
)
from labkit.planner.search import (
    plan,
    sensitivity,
    sensitivity_summary,
)
from labkit.planner.specs import (
    Cluster,
    Device,
    Layout,
    Link,
    ModelSpec,
    Search,
    Workload,
    check_layout,
)

__all__ = [
    "Cluster",
    "DPSyncCheck",
    "Device",
    "Layout",
    "Link",
    "ModelSpec",
    "Prediction",
    "Search",
    "Workload",
    "check_dp_sync",
    "check_layout",
    "describe_bytes",
    "describe_choices",
    "describe_published",
    "describe_sensitivity",
    "fit_link",
    "plan",
    "plot_layouts",
    "predict",
    "published_cases",
    "sensitivity",
    "sensitivity_summary",
    "this_machine",
]
