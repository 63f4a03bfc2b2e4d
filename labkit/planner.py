"""Choosing a parallel layout: enumerate DP × TP × PP (× CP, × EP) and rank them, all modelled.

    model = planner.ModelSpec(n_layer=126, d_model=16384, n_head=128, vocab_size=128_000,
                              seq_len=8192, n_kv_head=8, ffn_hidden=53248, glu=True)
    cluster = planner.Cluster.from_tables("NVIDIA H100 80GB HBM3", n_gpus=8192, gpus_per_node=8,
                                          intra_node="NVLink 4",
                                          inter_node="InfiniBand NDR 400 Gb/s")
    plan = planner.plan(model, cluster, planner.Workload(global_batch=2048, mfu=0.5))
    print(plan.table(8))                      # layouts that fit, fastest first, then the rest

Every number this module returns is **modelled**: closed-form formulas (labkit.formulas and the
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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from labkit import formulas, hardware
from labkit.validate import one_of

RECOMPUTE = ("none", "selective", "full")
MODELLED = "modelled"


def _int(name: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} is not allowed: a whole number >= {low}")
    return value


def _num(name: str, value: Any, *, low: float = 0.0, high: float = math.inf,
         open_low: bool = True) -> float:  # fmt: skip
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if open_low else value >= low) and value <= high
    if not ok:
        rng = f"{'>' if open_low else '>='} {low:g}" + (
            f" and <= {high:g}" if high < math.inf else ""
        )
        raise ValueError(f"{name}={value!r} is not allowed: a finite number {rng}")
    return float(value)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ----------------------------------------------------------------------------------------------
# What is trained, on what, how.


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer's shape (a GPT by default; GQA, SwiGLU and MoE optional)."""

    n_layer: int
    """Transformer blocks L."""
    d_model: int
    """Hidden size h."""
    n_head: int
    """Attention (query) heads a; tensor parallelism splits them, so TP must divide it."""
    vocab_size: int
    """Vocabulary V (the embedding and the output head are V × h each)."""
    seq_len: int
    """Tokens per sequence s."""
    n_kv_head: int | None = None
    """Key/value heads (grouped-query attention); None means n_head (multi-head attention)."""
    ffn_hidden: int | None = None
    """MLP width; None means 4·h (GPT)."""
    glu: bool = False
    """A gated MLP (SwiGLU: three h × ffn matrices instead of two)."""
    bias: bool = False
    """Linear and LayerNorm biases (GPT-2 has them: 12h² + 13h per layer)."""
    tied_embeddings: bool = False
    """One V × h matrix for the embedding and the output head (a pipeline keeps a copy on the
    last stage, as Megatron does)."""
    learned_positions: bool = False
    """A learned s × h position table (GPT-2), on the first stage."""
    moe_experts: int = 0
    """Experts per MoE layer (every layer's MLP becomes that many experts); 0 for a dense model."""
    moe_top_k: int = 1
    """Experts each token is routed to."""
    name: str = "model"

    def __post_init__(self) -> None:
        for f in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len", "moe_top_k"):
            _int(f, getattr(self, f))
        _int("moe_experts", self.moe_experts, low=0)
        if self.d_model % self.n_head:
            raise ValueError(f"n_head={self.n_head} does not divide d_model={self.d_model}: "
                             "each head gets d_model/n_head channels; pick a divisor")  # fmt: skip
        if self.n_kv_head is not None:
            _int("n_kv_head", self.n_kv_head)
            if self.n_head % self.n_kv_head:
                raise ValueError(f"n_kv_head={self.n_kv_head} does not divide n_head="
                                 f"{self.n_head}: query heads share key/value heads in equal "
                                 "groups; pick a divisor")  # fmt: skip
        if self.ffn_hidden is not None:
            _int("ffn_hidden", self.ffn_hidden)
        if self.moe_experts and self.moe_top_k > self.moe_experts:
            raise ValueError(f"moe_top_k={self.moe_top_k} exceeds moe_experts="
                             f"{self.moe_experts}: route each token to at most that many")  # fmt: skip

    @classmethod
    def from_model_config(cls, cfg: Any, name: str = "labkit GPT") -> ModelSpec:
        """The shape of ``labkit.model.GPT`` for ``cfg`` (a ``config.ModelConfig``): biases,
        learned positions, tied embeddings, 4h MLP; ``params`` equals ``formulas.gpt_params``."""
        return cls(n_layer=cfg.n_layer, d_model=cfg.d_model, n_head=cfg.n_head,
                   vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, bias=True,
                   tied_embeddings=cfg.tie_weights, learned_positions=True, name=name)  # fmt: skip

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.d_model // self.n_head)

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.d_model

    @property
    def is_moe(self) -> bool:
        return self.moe_experts > 0

    @property
    def attention_params(self) -> int:
        """Per layer: q and o (h × h each), k and v (h × kv_dim each), two norms, biases."""
        h, kv = self.d_model, self.kv_dim
        n = 2 * h * h + 2 * h * kv + 2 * h  # the norms' weights
        if self.bias:
            n += 2 * h + 2 * kv + 2 * h  # q, o, k, v biases; the norms' biases
        return n

    @property
    def mlp_params(self) -> int:
        """One MLP (one expert): 2 or 3 matrices h × ffn, plus biases."""
        h, f = self.d_model, self.ffn
        return (3 if self.glu else 2) * h * f + ((f + h) if self.bias else 0)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.d_model

    @property
    def params(self) -> int:
        """All parameters (every expert)."""
        experts = max(self.moe_experts, 1)
        per_layer = self.attention_params + experts * self.mlp_params
        final_norm = (2 if self.bias else 1) * self.d_model
        pos = self.seq_len * self.d_model if self.learned_positions else 0
        head = 0 if self.tied_embeddings else self.embedding_params
        return self.embedding_params + pos + self.n_layer * per_layer + final_norm + head

    @property
    def active_params(self) -> int:
        """Parameters one token's forward uses: top-k experts of each MoE layer."""
        if not self.is_moe:
            return self.params
        return self.params - self.n_layer * (self.moe_experts - self.moe_top_k) * self.mlp_params


@dataclass(frozen=True, kw_only=True)
class Link:
    """A link's bandwidth each way per GPU (β, bytes/s) and per-message latency (α, s)."""

    name: str
    bytes_per_s: float
    latency_s: float = 0.0
    source: str = ""
    """Where the figure comes from: a LINK_TABLE row's source, or "measured: ..."."""

    def __post_init__(self) -> None:
        _num("bytes_per_s", self.bytes_per_s)
        _num("latency_s", self.latency_s, open_low=False)

    @classmethod
    def from_table(cls, name: str) -> Link:
        row = hardware.link_bandwidth(name)
        return cls(name=row.name, bytes_per_s=row.bytes_per_s, source=row.source)


@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator: a peak FLOP/s and a memory size, each with where it comes from."""

    name: str
    peak_flops_per_s: float
    memory_bytes: float | None
    """None: memory is not checked (a CPU rank's share of host memory has no fixed size)."""
    source: str

    def __post_init__(self) -> None:
        _num("peak_flops_per_s", self.peak_flops_per_s)
        if self.memory_bytes is not None:
            _num("memory_bytes", self.memory_bytes)

    @classmethod
    def from_table(cls, device_name: str, dtype: str = "bf16") -> Device:
        """The published dense peak and memory of ``device_name``; refuses what the tables
        do not know (no guessed peak, no guessed memory)."""
        peak = hardware.peak_flops(device_name, dtype)
        if not peak.known:
            raise ValueError(f"no published {peak.dtype} peak for {device_name!r}: {peak.reason}. "
                             "The planner guesses no peak: name a GPU in labkit.hardware."
                             "PEAK_TABLE (as the driver reports it, e.g. 'NVIDIA H100 80GB "
                             "HBM3'), or pass a Device with a measured peak and say so")  # fmt: skip
        mem = hardware.memory_spec(device_name)
        if mem is None:
            raise ValueError(f"no published memory size for {device_name!r}: its board (form "
                             "factor and size) is not identified in labkit.hardware.MEMORY_TABLE;"
                             " name the board, e.g. 'NVIDIA A100-SXM4-80GB'")  # fmt: skip
        return cls(name=mem.device, peak_flops_per_s=peak.flops_per_s,
                   memory_bytes=mem.memory_gb * 1e9,
                   source=f"{peak}; memory {mem.memory_gb:g} GB ({mem.source})")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """n_gpus devices, gpus_per_node to a node; one link inside a node, one between nodes."""

    device: Device
    n_gpus: int
    gpus_per_node: int
    intra_node: Link
    inter_node: Link

    def __post_init__(self) -> None:
        _int("n_gpus", self.n_gpus)
        _int("gpus_per_node", self.gpus_per_node)
        if self.n_gpus > self.gpus_per_node and self.n_gpus % self.gpus_per_node:
            raise ValueError(f"n_gpus={self.n_gpus} is not a whole number of nodes of "
                             f"gpus_per_node={self.gpus_per_node}: use a multiple of it")  # fmt: skip

    @classmethod
    def from_tables(cls, device_name: str, *, n_gpus: int, gpus_per_node: int, intra_node: str,
                    inter_node: str, dtype: str = "bf16") -> Cluster:  # fmt: skip
        return cls(device=Device.from_table(device_name, dtype), n_gpus=n_gpus,
                   gpus_per_node=gpus_per_node, intra_node=Link.from_table(intra_node),
                   inter_node=Link.from_table(inter_node))  # fmt: skip

    def link_for(self, span: int) -> Link:
        """The link a group of consecutive ranks ``span`` wide crosses (nodes hold gpus_per_node
        consecutive ranks): inside a node when it fits in one."""
        return self.intra_node if span <= self.gpus_per_node else self.inter_node


@dataclass(frozen=True, kw_only=True)
class Workload:
    """The global batch and the assumptions of the step model."""

    global_batch: int
    """Sequences per optimizer step (all data-parallel replicas together)."""
    mfu: float = 0.5
    """Assumed: the fraction of the peak the compute runs at (model and recomputed FLOPs)."""
    param_bytes: float = 2
    grad_bytes: float = 2
    optimizer_bytes: float = 12
    """K of the ZeRO paper: fp32 master weights, Adam m and v for mixed precision."""
    activation_bytes: int = 2
    dropout: bool = False
    attention: str = "flash"
    """"flash" (fused kernel, no s × s matrix kept) or "materialized" (Korthikanti's count)."""
    overlap_dp: bool = True
    """Assumed: the final gradient sync overlaps the last micro-batch's backward as far as it
    can (and ZeRO-3's all-gathers their micro-batch's compute)."""
    usable_memory: float = 0.9
    """Assumed: the share of the device's published memory the layout may fill. The rest is a
    reserve for what no formula here counts: the CUDA context, NCCL's communication buffers and
    the caching allocator's fragmentation (PyTorch's CUDA memory-management notes,
    https://docs.pytorch.org/docs/stable/notes/cuda.html#memory-management). 1.0 trusts the
    formulas to the byte; ``sensitivity`` shows what each choice does to the ranking."""

    def __post_init__(self) -> None:
        _int("global_batch", self.global_batch)
        _num("mfu", self.mfu, high=1.0)
        for f in ("param_bytes", "grad_bytes", "activation_bytes"):
            _num(f, getattr(self, f))
        _num("optimizer_bytes", self.optimizer_bytes, open_low=False)
        _num("usable_memory", self.usable_memory, high=1.0)
        one_of("attention", self.attention, formulas.ATTENTION_KINDS)

    @classmethod
    def from_tokens(cls, tokens: int, seq_len: int, **kwargs: Any) -> Workload:
        """A global batch given in tokens: it must be a whole number of sequences."""
        _int("tokens", tokens)
        if tokens % seq_len:
            raise ValueError(f"tokens={tokens} is not a whole number of sequences of seq_len="
                             f"{seq_len}: use a multiple of seq_len")  # fmt: skip
        return cls(global_batch=tokens // seq_len, **kwargs)


@dataclass(frozen=True, kw_only=True)
class Search:
    """Which variants to enumerate besides the DP × TP × PP (× CP × EP) shape."""

    micro_batches: tuple[int, ...] = (1,)
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = ("none",)
    interleave: tuple[int, ...] = (1, 2, 4, 8)
    """v: model chunks per pipeline rank (1 = plain 1F1B)."""
    max_cp: int = 1
    """Largest context-parallel degree tried (powers of two); 1 leaves CP out."""
    sequence_parallel: bool = True
    vocab_parallel: bool = True
    """Split the embedding and the output head over the TP ranks by vocabulary (Megatron-LM);
    False replicates them (as ``labkit.parallel.tensor.apply_tensor_parallel`` does)."""
    uneven_stages: bool = False
    """Allow pipeline stages of ceil(L/p) and fewer layers when p does not divide L (Llama 3
    takes one layer off the first and the last stage, arXiv 2407.21783, section 3.3.2)."""

    def __post_init__(self) -> None:
        for name in ("micro_batches", "zero_stages", "recompute", "interleave"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
            if not getattr(self, name):
                raise ValueError(f"{name}=() is not allowed: give at least one value")
        for b in self.micro_batches:
            _int("micro_batches entry", b)
        for v in self.interleave:
            _int("interleave entry", v)
        for z in self.zero_stages:
            if isinstance(z, bool) or z not in formulas.ZERO_STAGES:
                raise ValueError(f"zero_stages entry {z!r}: ZeRO stages are 0, 1, 2, 3")
        for r in self.recompute:
            one_of("recompute entry", r, RECOMPUTE)
        _int("max_cp", self.max_cp)


@dataclass(frozen=True)
class Layout:
    """One way to place the job: the four degrees (and EP inside DP), plus its variant."""

    dp: int
    tp: int
    pp: int
    cp: int = 1
    ep: int = 1
    v: int = 1
    micro_batch: int = 1
    zero: int = 1
    recompute: str = "none"

    def __post_init__(self) -> None:
        for f in ("dp", "tp", "pp", "cp", "ep", "v", "micro_batch"):
            _int(f, getattr(self, f))
        if isinstance(self.zero, bool) or self.zero not in formulas.ZERO_STAGES:
            raise ValueError(f"zero={self.zero!r}: ZeRO stages are 0, 1, 2, 3")
        one_of("recompute", self.recompute, RECOMPUTE)

    @property
    def n_gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """(dp, tp, pp, cp, ep): the layout without its variant."""
        return self.dp, self.tp, self.pp, self.cp, self.ep

    @property
    def name(self) -> str:
        degrees = (("DP", self.dp), ("TP", self.tp), ("PP", self.pp), ("CP", self.cp),
                   ("EP", self.ep))  # fmt: skip
        parts = [f"{k}{d}" for k, d in degrees if d > 1]
        return "×".join(parts) if parts else "one rank"

    @property
    def variant(self) -> str:
        v = f", v={self.v}" if self.v > 1 else ""
        rc = f", recompute {self.recompute}" if self.recompute != "none" else ""
        return f"b={self.micro_batch}{v}, ZeRO-{self.zero}{rc}"


# ----------------------------------------------------------------------------------------------
# Constraints, each with its fix.


def check_layout(model: ModelSpec, cluster: Cluster, workload: Workload, layout: Layout,
                 search: Search | None = None) -> None:  # fmt: skip
    """Raise ValueError naming the violated constraint and the fix; None when the layout can run."""
    search = search or Search()
    lay = layout
    for f in ("dp", "tp", "pp", "cp", "ep", "v", "micro_batch"):
        _int(f, getattr(lay, f))
    if lay.zero not in formulas.ZERO_STAGES or isinstance(lay.zero, bool):
        raise ValueError(f"zero={lay.zero!r}: ZeRO stages are 0, 1, 2, 3")
    one_of("recompute", lay.recompute, RECOMPUTE)
    if lay.n_gpus != cluster.n_gpus:
        raise ValueError(f"DP × TP × PP × CP = {lay.dp} × {lay.tp} × {lay.pp} × {lay.cp} = "
                         f"{lay.n_gpus} but the cluster has n_gpus={cluster.n_gpus}: the "
                         "degrees must multiply to the GPU count; change one of them")  # fmt: skip
    if lay.tp > cluster.gpus_per_node or cluster.gpus_per_node % lay.tp:
        raise ValueError(f"tp={lay.tp} does not fit in a node of {cluster.gpus_per_node} GPUs: "
                         "tensor parallelism all-reduces every layer and belongs on the "
                         "intra-node link; use a TP degree that divides gpus_per_node")  # fmt: skip
    if model.n_head % lay.tp or model.kv_heads % lay.tp:
        raise ValueError(f"tp={lay.tp} does not divide the heads (n_head={model.n_head}, "
                         f"key/value heads {model.kv_heads}): each TP rank computes whole "
                         "heads; use a TP degree that divides both")  # fmt: skip
    if search.uneven_stages:
        if lay.pp > model.n_layer:
            raise ValueError(f"pp={lay.pp} exceeds n_layer={model.n_layer}: every stage needs a"
                             " layer; use fewer stages")  # fmt: skip
    elif model.n_layer % lay.pp:
        raise ValueError(f"pp={lay.pp} does not divide n_layer={model.n_layer}: stages get "
                         f"equal layers; use a divisor of {model.n_layer} "
                         "(or Search(uneven_stages=True))")  # fmt: skip
    if lay.cp > 1 and model.seq_len % (2 * lay.cp):
        raise ValueError(f"cp={lay.cp}: seq_len={model.seq_len} is not divisible by 2·cp: "
                         "each CP rank takes two chunks (one early, one late) to balance causal "
                         "attention; use a CP degree with 2·cp dividing seq_len")  # fmt: skip
    per_replica, rest = divmod(workload.global_batch, lay.dp * lay.micro_batch)
    if rest:
        raise ValueError(f"DP × micro-batch = {lay.dp} × {lay.micro_batch} does not divide "
                         f"global_batch={workload.global_batch}: every replica needs a whole "
                         "number of equal micro-batches; change the DP degree, the micro-batch "
                         "or the global batch")  # fmt: skip
    m = per_replica
    if lay.pp > 1 and m < lay.pp:
        raise ValueError(f"{m} micro-batches per step for pp={lay.pp} stages: 1F1B needs at "
                         "least as many micro-batches as stages to fill the pipeline; use a "
                         "smaller micro-batch, fewer stages or a bigger global batch")  # fmt: skip
    if lay.v > 1:
        layers = math.ceil(model.n_layer / lay.pp)
        if lay.pp == 1:
            raise ValueError(f"v={lay.v} model chunks need a pipeline: use v=1 with pp=1")
        if layers % lay.v:
            raise ValueError(f"v={lay.v} does not divide the {layers} layers of a stage: each "
                             "chunk gets equal layers; use a divisor")  # fmt: skip
        if m % lay.pp:
            raise ValueError(f"interleaved 1F1B (v={lay.v}) needs the micro-batches ({m}) to be "
                             f"a multiple of pp={lay.pp} (Megatron-LM's schedule); change the "
                             "micro-batch or use v=1")  # fmt: skip
    if lay.ep > 1:
        if not model.is_moe:
            raise ValueError(f"ep={lay.ep} but the model has no experts: use ep=1")
        if model.moe_experts % lay.ep:
            raise ValueError(f"ep={lay.ep} does not divide moe_experts={model.moe_experts}: "
                             "each EP rank holds an equal share of the experts; use a divisor")  # fmt: skip
        if lay.dp % lay.ep:
            raise ValueError(f"ep={lay.ep} does not divide dp={lay.dp}: expert-parallel groups "
                             "are carved out of the data-parallel ranks; use a divisor of dp")  # fmt: skip


# ----------------------------------------------------------------------------------------------
# The prediction.


def _dense_layer_per_rank(model: ModelSpec, tp: int) -> float:
    """Parameters of one layer on one TP rank: the column- and row-parallel weights and the
    column-parallel biases are split; the norms and the row-parallel output biases are
    replicated (Shoeybi et al. 2019; ``labkit.parallel.tensor.tp_params_per_rank`` likewise).
    The MLP is left out for an MoE model (its experts are counted apart)."""
    h = model.d_model
    norms = (4 if model.bias else 2) * h
    row_bias = h if model.bias else 0  # each of the attention output and the MLP down projection
    attn = model.attention_params - norms - row_bias
    out = attn / tp + norms + row_bias
    if not model.is_moe:
        out += (model.mlp_params - row_bias) / tp + row_bias
    return out


@dataclass(frozen=True)
class Prediction:
    """Modelled memory per GPU, time and bytes per step of one layout."""

    layout: Layout
    micro_batches: int
    memory: dict[str, float]
    """Bytes per GPU: parameters, gradients, optimizer_state (ZeRO), activations, total."""
    capacity_bytes: float | None
    time_s: dict[str, float]
    """Seconds per step: compute, bubble, tp, cp, ep, pp, dp (exposed), total."""
    bytes_per_rank: dict[str, float]
    """Bytes one rank sends per step in each dimension's collectives: tp, cp, ep, pp, dp."""
    model_flops: float
    """Model FLOPs of one step (all GPUs; recomputation not counted)."""
    hardware_flops: float
    """FLOPs the GPUs execute in one step: model FLOPs plus what recomputation redoes."""
    predicted_mfu: float
    label: str = MODELLED

    @property
    def fits(self) -> bool | None:
        """True/False against the device's memory; None when memory is not checked."""
        if self.capacity_bytes is None:
            return None
        return self.memory["total"] <= self.capacity_bytes

    @property
    def step_s(self) -> float:
        return self.time_s["total"]

    def flops_per_gpu_s(self, n_gpus: int) -> float:
        """Executed FLOP/s per GPU (recomputation included, as Megatron-LM reports it)."""
        return self.hardware_flops / (n_gpus * self.step_s)

    def line(self, *, compact: bool = False) -> str:
        """One row of ``Plan.table``. ``compact`` leaves out the fit and the label, for a table
        of fitting layouts under a header that already says "modelled"."""
        gb = self.memory["total"] / 1e9
        if compact:
            return (f"{self.layout.name:<16} {self.layout.variant:<32} {gb:6.1f} GB "
                    f"{self.step_s:8.3g} s {self.predicted_mfu:6.1%}")  # fmt: skip
        fit = {True: "fits", False: "does not fit", None: "memory not checked"}[self.fits]
        return (
            f"{self.layout.name:<22} {self.layout.variant:<30} {gb:8.1f} GB ({fit:<12}) "
            f"step {self.step_s:9.3g} s  MFU {self.predicted_mfu:5.1%}  [{self.label}]"
        )


def predict(model: ModelSpec, cluster: Cluster, workload: Workload, layout: Layout,
            search: Search | None = None) -> Prediction:  # fmt: skip
    """Memory per GPU, time and bytes per step of ``layout``, modelled (see the module doc)."""
    search = search or Search()
    check_layout(model, cluster, workload, layout, search)
    lay, w, dev = layout, workload, cluster.device
    dp, tp, pp, cp, ep, v, b = lay.dp, lay.tp, lay.pp, lay.cp, lay.ep, lay.v, lay.micro_batch
    m = w.global_batch // (dp * b)
    L, h, s = model.n_layer, model.d_model, model.seq_len
    s_local = s // cp
    layers = math.ceil(L / pp)  # the largest stage
    e = w.activation_bytes
    sp = search.sequence_parallel and tp > 1

    # --- memory: model states of the larger of the first stage (embeddings) and the last (head)
    dense_layer = _dense_layer_per_rank(model, tp)
    emb = model.embedding_params / (tp if search.vocab_parallel else 1)
    pos = s * h if model.learned_positions else 0
    final_norm = (2 if model.bias else 1) * h
    head = emb if (pp > 1 or not model.tied_embeddings) else 0  # a pipeline copies a tied head
    if pp == 1:
        dense = layers * dense_layer + emb + pos + final_norm + head
    else:
        dense = layers * dense_layer + max(emb + pos, final_norm + head)
    experts = layers * (model.moe_experts // ep) * model.mlp_params / tp if model.is_moe else 0.0
    n_dense, n_expert = dp * cp, max(dp * cp // ep, 1)
    states = formulas.zero_memory_per_rank(dense, lay.zero, n_dense, k=w.optimizer_bytes,
                                           param_bytes=w.param_bytes, grad_bytes=w.grad_bytes)  # fmt: skip
    if experts:
        states += formulas.zero_memory_per_rank(experts, lay.zero, n_expert,
                                                k=w.optimizer_bytes, param_bytes=w.param_bytes,
                                                grad_bytes=w.grad_bytes)  # fmt: skip
    p_all, p_shard = dense + experts, dense / n_dense + experts / n_expert
    params_b = w.param_bytes * (p_all if lay.zero < 3 else p_shard)
    grads_b = w.grad_bytes * (p_all if lay.zero < 2 else p_shard)
    optim_b = states - params_b - grads_b
    if lay.zero == 3:  # the layer being computed is gathered whole
        params_b += w.param_bytes * (
            dense_layer + model.mlp_params * (model.moe_experts // ep) / tp
        )

    # --- memory: activations of one layer and micro-batch, sharded by TP (and SP) and CP
    act = formulas.activation_bytes_per_layer(s_local, b, h, model.n_head, bytes_per_element=e,
                                              dropout=w.dropout, attention=w.attention)  # fmt: skip
    k = 1 if w.dropout else 0
    if tp > 1 and not sp:  # the LayerNorm and dropout regions: replicated (10·sbh at e=2, k=1)
        replicated = s_local * b * h * (4 * e + 2 * k)
        act = replicated + (act - replicated) / tp
    else:
        act = act / tp
    if lay.recompute == "full":  # keep each layer's input; one layer's worth while recomputing
        kept = e * s_local * b * h / (tp if sp else 1)
        act_stage = kept * layers
        in_flight_layers = 0
    else:
        if lay.recompute == "selective":  # the attention core is recomputed, not stored
            act -= (formulas.activation_bytes_per_layer(s_local, b, h, model.n_head,
                                                        bytes_per_element=e, dropout=w.dropout,
                                                        attention=w.attention)
                    - formulas.activation_bytes_per_layer(s_local, b, h, model.n_head,
                                                          bytes_per_element=e,
                                                          dropout=w.dropout,
                                                          attention="flash")) / tp  # fmt: skip
            act = max(act, 0.0)
        act_stage = act * layers
        in_flight_layers = 1
    in_flight = min(pp, m) if pp > 1 else 1
    if v > 1:
        in_flight *= 1 + (pp - 1) / (pp * v)
    activations = act_stage * in_flight + (act if not in_flight_layers else 0.0)
    memory = {"parameters": params_b, "gradients": grads_b, "optimizer_state": optim_b,
              "activations": activations}  # fmt: skip
    memory["total"] = sum(memory.values())
    capacity = None if dev.memory_bytes is None else dev.memory_bytes * w.usable_memory

    # --- compute
    tokens_mb = b * s
    fpt = formulas.flops_per_token(model.active_params, L, h, s, attention="full")
    extra = {"none": 0.0, "selective": 4 * L * h * s,
             "full": 2 * (model.active_params - model.embedding_params) + 4 * L * h * s}[lay.recompute]  # fmt: skip
    stage_share = layers / (L / pp)  # the largest stage does this much more than the average
    compute_mb = (
        (fpt + extra) * tokens_mb / (tp * cp * pp) * stage_share / (dev.peak_flops_per_s * w.mfu)
    )
    model_flops = fpt * w.global_batch * s
    hardware_flops = (fpt + extra) * w.global_batch * s

    # --- TP: 4 all-reduces per layer (6 with full recompute) of a (b, s/cp, h) activation
    link_tp = cluster.link_for(tp)
    calls = (6 if lay.recompute == "full" else 4) * layers
    msg = b * s_local * h * e
    tp_mb = calls * formulas.ring_allreduce_time(msg, tp, link_tp.latency_s, link_tp.bytes_per_s)
    tp_bytes = m * calls * formulas.ring_allreduce_bytes_per_rank(msg, tp)

    # --- CP: all-gather K and V forward (again when recomputing), reduce-scatter their grads
    link_cp = cluster.link_for(tp * cp)
    cp_calls = (3 if lay.recompute == "full" else 2) * layers
    kv = 2 * b * s * model.kv_dim * e
    cp_sent = (cp - 1) / cp * kv
    cp_mb = cp_calls * formulas.alpha_beta_time(cp_sent, link_cp.latency_s, link_cp.bytes_per_s,
                                                messages=max(cp - 1, 1)) if cp > 1 else 0.0  # fmt: skip
    cp_bytes = m * cp_calls * cp_sent if cp > 1 else 0.0

    # --- EP: dispatch and combine, forward and backward, of the routed tokens
    link_ep = cluster.link_for(tp * cp * pp * ep)
    ep_sent = (ep - 1) / ep * b * s_local * model.moe_top_k * h * e / tp
    ep_mb = 4 * layers * formulas.alpha_beta_time(ep_sent, link_ep.latency_s, link_ep.bytes_per_s,
                                                  messages=ep - 1) if ep > 1 else 0.0  # fmt: skip
    ep_bytes = m * 4 * layers * ep_sent if ep > 1 else 0.0

    stage_mb = compute_mb + tp_mb + cp_mb + ep_mb
    bubble = (pp - 1) / v * stage_mb

    # --- PP: each chunk boundary sends an activation forward and its gradient back
    link_pp = cluster.link_for(tp * cp * pp)
    act_msg = b * s_local * h * e / (tp if sp else 1)
    # a middle stage sends both ways; with two stages and v = 1 each rank sends one way only
    sends = 0 if pp == 1 else (m if pp == 2 and v == 1 else 2 * v * m)
    pp_s = formulas.alpha_beta_time(sends * act_msg, link_pp.latency_s, link_pp.bytes_per_s,
                                    messages=sends) if sends else 0.0  # fmt: skip
    pp_bytes = sends * act_msg

    # --- DP: gradient sync over the dp·cp ranks holding the same weights (ZeRO decides how)
    def sync(n_params: float, n: int, link: Link | None = None,
             in_layers: float | None = None) -> tuple[float, float, float]:  # fmt: skip
        """(seconds of the final sync, bytes, seconds of ZeRO-3's all-gathers per micro-batch)."""
        if n == 1 or n_params == 0:
            return 0.0, 0.0, 0.0
        lk = cluster.link_for(cluster.n_gpus) if link is None else link
        if lay.zero == 0:
            byts = formulas.ring_allreduce_bytes_per_rank(w.grad_bytes * n_params, n)
        elif lay.zero < 3:  # reduce-scatter the gradients, all-gather the updated parameters
            byts = (n - 1) / n * (w.grad_bytes + w.param_bytes) * n_params
        else:  # reduce-scatter only: the parameters stay sharded until the next forward
            byts = (n - 1) / n * w.grad_bytes * n_params
        messages = (n - 1) if lay.zero == 3 else 2 * (n - 1)
        t = formulas.alpha_beta_time(byts, lk.latency_s, lk.bytes_per_s, messages=messages)
        ag = 0.0
        if lay.zero == 3:  # gather the parameters for the forward and for the backward
            # each layer is gathered for its forward and again for its backward; the rest
            # (embeddings, head, final norm) once, kept through the backward as FSDP2 keeps
            # its root module's parameters
            twice = n_params if in_layers is None else in_layers
            ag_bytes = (n - 1) / n * w.param_bytes * (n_params + twice)
            ag = formulas.alpha_beta_time(ag_bytes, lk.latency_s, lk.bytes_per_s,
                                          messages=2 * (n - 1))  # fmt: skip
            byts += m * ag_bytes
        return t, byts, ag

    t_d, b_d, ag_d = sync(dense, n_dense, in_layers=layers * dense_layer)
    t_e, b_e, ag_e = sync(experts, n_expert, cluster.link_for(cluster.n_gpus // ep))
    dp_sync = t_d + t_e
    hide = (2 / 3) * compute_mb if w.overlap_dp else 0.0
    dp_exposed = max(0.0, dp_sync - hide)
    ag_mb = ag_d + ag_e
    if ag_mb:
        dp_exposed += m * (max(0.0, ag_mb - compute_mb) if w.overlap_dp else ag_mb)

    pipeline = m * stage_mb + bubble
    total = pipeline + pp_s + dp_exposed
    time_s = {"compute": m * compute_mb, "bubble": bubble, "tp": m * tp_mb, "cp": m * cp_mb,
              "ep": m * ep_mb, "pp": pp_s, "dp": dp_exposed, "total": total}  # fmt: skip
    bytes_per_rank = {"tp": tp_bytes, "cp": cp_bytes, "ep": ep_bytes, "pp": pp_bytes,
                      "dp": b_d + b_e}  # fmt: skip
    mfu = model_flops / (cluster.n_gpus * dev.peak_flops_per_s * total)
    return Prediction(layout=lay, micro_batches=m, memory=memory, capacity_bytes=capacity,
                      time_s=time_s, bytes_per_rank=bytes_per_rank, model_flops=model_flops,
                      hardware_flops=hardware_flops, predicted_mfu=mfu)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Enumeration and ranking.


def _powers_of_two(limit: int) -> list[int]:
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return out


def enumerate_layouts(model: ModelSpec, cluster: Cluster, workload: Workload,
                      search: Search | None = None) -> list[Layout]:  # fmt: skip
    """Every layout (with each variant of ``search``) that passes ``check_layout``."""
    search = search or Search()
    n = cluster.n_gpus
    out = []
    for tp in _divisors(min(cluster.gpus_per_node, n)):
        for cp in _powers_of_two(search.max_cp):
            if n % (tp * cp):
                continue
            for pp in _divisors(n // (tp * cp)):
                dp = n // (tp * cp * pp)
                eps = (
                    [d for d in _divisors(dp) if model.moe_experts % d == 0]
                    if model.is_moe
                    else [1]
                )
                for ep in eps:
                    for b in search.micro_batches:
                        for v in search.interleave:
                            for zero in search.zero_stages:
                                for rc in search.recompute:
                                    lay = Layout(dp, tp, pp, cp, ep, v, b, zero, rc)
                                    try:
                                        check_layout(model, cluster, workload, lay, search)
                                    except ValueError:
                                        continue
                                    out.append(lay)
    return out


@dataclass(frozen=True)
class Plan:
    """Every candidate's prediction, ranked: those that fit, fastest first, then the rest."""

    model: ModelSpec
    cluster: Cluster
    workload: Workload
    search: Search
    predictions: tuple[Prediction, ...] = field(default=())

    def ranked(self, *, fitting_only: bool = False) -> list[Prediction]:
        fit = [p for p in self.predictions if p.fits is not False]
        fit.sort(key=lambda p: p.step_s)
        if fitting_only:
            return fit
        rest = sorted((p for p in self.predictions if p.fits is False), key=lambda p: p.step_s)
        return fit + rest

    def best_per_shape(self) -> list[Prediction]:
        """The fastest fitting variant of each (dp, tp, pp, cp, ep), fastest shape first."""
        seen: dict[tuple, Prediction] = {}
        for p in self.ranked(fitting_only=True):
            seen.setdefault(p.layout.shape, p)
        return list(seen.values())

    def rank_of(self, *, dp: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> int | None:
        """1-based rank of that shape among ``best_per_shape()``; None if no variant fits."""
        for i, p in enumerate(self.best_per_shape(), 1):
            if p.layout.shape == (dp, tp, pp, cp, ep):
                return i
        return None

    def table(self, top: int = 8, *, compact: bool = False) -> str:
        """The ``top`` layouts of ``best_per_shape()``, one row each. ``compact``: narrower rows
        without the fit (every row fits) and the per-row label (say "modelled" around it)."""
        rows = self.best_per_shape()[:top]
        if compact:
            lines = [f"{'rank':>4}  {'layout':<16} {'best variant':<32} {'memory':>9} "
                     f"{'step':>10} {'MFU':>6}"]  # fmt: skip
        else:
            lines = [f"{'rank':>4}  {'layout':<22} {'best variant':<30} {'memory per GPU':<26}"
                     f"{'time per step':>15}  {'MFU':>9}"]  # fmt: skip
        lines += [f"{i:>4}  {p.line(compact=compact)}" for i, p in enumerate(rows, 1)]
        return "\n".join(lines)

    def bytes_table(self, *, fsdp: bool = True) -> str:
        """Bytes one rank sends per step in each dimension (MiB; counts, modelled, not timed), and
        the modelled step, for the fastest variant of each layout. ``fsdp`` adds the data-parallel
        bytes of the same layout under ZeRO-3 with one micro-batch per step (no accumulation),
        for layouts with DP and no PP ("-" otherwise)."""
        dims = ("dp", "tp", "pp", "cp")
        lines = [f"{'layout':<10}" + "".join(f"{k.upper() + ' MiB':>9}" for k in dims)
                 + (f"{'DP MiB FSDP':>13}" if fsdp else "") + f"{'step':>12}"]  # fmt: skip
        for p in self.best_per_shape():
            lay = p.layout
            row = f"{lay.name:<10}" + "".join(f"{p.bytes_per_rank[k] / 2**20:>9.2f}" for k in dims)
            if fsdp:
                cell = "-"
                if lay.dp > 1 and lay.pp == 1:
                    f3 = predict(self.model, self.cluster, self.workload,
                                 Layout(lay.dp, lay.tp, 1, lay.cp, zero=3,
                                        micro_batch=self.workload.global_batch // lay.dp),
                                 self.search)  # fmt: skip
                    cell = f"{f3.bytes_per_rank['dp'] / 2**20:.2f}"
                row += f"{cell:>13}"
            lines.append(row + f"{p.step_s * 1e3:>9.1f} ms")
        return "\n".join(lines)


def plan(model: ModelSpec, cluster: Cluster, workload: Workload,
         search: Search | None = None) -> Plan:  # fmt: skip
    """Enumerate, predict and rank (all modelled). Raises ValueError when nothing is valid."""
    search = search or Search()
    layouts = enumerate_layouts(model, cluster, workload, search)
    if not layouts:
        raise ValueError(f"no layout of {cluster.n_gpus} GPUs satisfies the constraints for "
                         f"{model.name} with global_batch={workload.global_batch}: check a "
                         "candidate with check_layout() to see which constraint fails")  # fmt: skip
    preds = tuple(predict(model, cluster, workload, lay, search) for lay in layouts)
    return Plan(model, cluster, workload, search, preds)


def sensitivity(model: ModelSpec, cluster: Cluster, workload: Workload, search: Search,
                shape: dict[str, int], *, usable: Sequence[float] = (1.0, 0.95, 0.9),
                overlap: Sequence[bool] = (True, False)) -> list[dict[str, Any]]:  # fmt: skip
    """Re-plan under each (usable_memory, overlap_dp) and say where ``shape`` lands (modelled).

    One row per setting: the planner's first choice (its layout, variant, step and memory),
    the rank of ``shape`` among the fitting layouts (None: no variant of it fits) with its
    step, and how many layouts fit. The two assumptions are the ones a ranking rests on most:
    how much of the memory the formulas may fill, and whether ZeRO's gathers and the gradient
    sync hide behind compute (False charges every byte of them).
    """
    import dataclasses

    rows = []
    for u in usable:
        for ov in overlap:
            w = dataclasses.replace(workload, usable_memory=u, overlap_dp=ov)
            pl = plan(model, cluster, w, search)
            best = pl.best_per_shape()
            rank = pl.rank_of(**shape)
            pub = best[rank - 1] if rank else None
            first = best[0] if best else None
            rows.append({
                "usable_memory": u, "overlap_dp": ov, "fitting": len(best),
                "first": None if first is None else first.layout.name,
                "first_variant": None if first is None else first.layout.variant,
                "first_step_s": None if first is None else first.step_s,
                "first_memory_bytes": None if first is None else first.memory["total"],
                "published_rank": rank,
                "published_step_s": None if pub is None else pub.step_s,
                "published_variant": None if pub is None else pub.layout.variant,
            })  # fmt: skip
    return rows


def sensitivity_summary(rows: Sequence[dict[str, Any]]) -> str:
    """One sentence on ``sensitivity()``'s rows: whether the first choice moves with the
    assumptions, and in how many settings the published layout ranks first or does not fit."""
    firsts = {r["first"] for r in rows}
    ranks = [r["published_rank"] for r in rows]
    text = ("the first choice stays the same in every setting" if len(firsts) == 1 else
            f"the first choice changes with the assumptions ({len(firsts)} different layouts)")  # fmt: skip
    text += "; the published layout ranks " + (
        f"first in {ranks.count(1)} of {len(rows)} settings" if 1 in ranks else "first in none")
    if None in ranks:
        text += f" and does not fit in {ranks.count(None)}"
    return text


# ----------------------------------------------------------------------------------------------
# Published configurations to hold the planner against.


@dataclass(frozen=True)
class Published:
    """A configuration a paper reports, with the case to plan it in."""

    name: str
    citation: str
    model: ModelSpec
    cluster: Cluster
    workload: Workload
    search: Search
    shape: dict[str, int]
    reported: str
    """What the paper measured on it (published, not modelled here)."""

    @property
    def shape_name(self) -> str:
        """The published layout as the planner names it (``DP64×TP8×PP16``)."""
        return "×".join(f"{k.upper()}{v}" for k, v in self.shape.items() if v > 1)

    def report(self, plan: Plan, top: int = 3) -> str:
        """What ``plan`` (this case planned) says, for a notebook: the case, the ``top`` layouts
        (compact), and where the published layout ranks with its executed TFLOP/s and MFU
        (modelled) beside what the paper measured. The full citation is ``self.citation``."""
        c, w = self.cluster, self.workload
        lines = [f"{self.name}: {self.model.params / 1e9:.1f}B parameters, {c.gpus_per_node} GPUs "
                 f"per node ({c.intra_node.name} inside, {c.inter_node.name} between), global "
                 f"batch {w.global_batch:,} × {self.model.seq_len:,} tokens; "
                 f"{len(plan.predictions)} valid layouts and variants, "
                 f"{len(plan.ranked(fitting_only=True))} fit (modelled):"]  # fmt: skip
        lines += ["  " + line for line in plan.table(top, compact=True).splitlines()]
        rank = plan.rank_of(**self.shape)
        source = self.citation.split(', "')[0]
        lines.append(f"  published {self.shape_name} ({source}): {self.reported}")
        if rank is None:
            lines.append("  the planner finds no variant of the published layout that fits")
        else:
            pub = plan.best_per_shape()[rank - 1]
            lines.append(f"  planner: rank {rank} of {len(plan.best_per_shape())}, "
                         f"{pub.flops_per_gpu_s(c.n_gpus) / 1e12:.0f} TFLOP/s executed per GPU, "
                         f"MFU {pub.predicted_mfu:.0%} (modelled at the assumed {w.mfu:.0%})")  # fmt: skip
        return "\n".join(lines)


def published_cases(mfu: float = 0.5) -> list[Published]:
    """Llama 3 405B (Table 4, first row) and Megatron-LM's 145.6B and 1T GPTs (Table 1)."""
    llama = ModelSpec(n_layer=126, d_model=16384, n_head=128, n_kv_head=8, ffn_hidden=53248,
                      glu=True, vocab_size=128_000, seq_len=8192, name="Llama 3 405B")  # fmt: skip
    megatron_145 = ModelSpec(n_layer=80, d_model=12288, n_head=96, vocab_size=51_200,
                             seq_len=2048, bias=True, tied_embeddings=True,
                             learned_positions=True, name="GPT 145.6B")  # fmt: skip
    megatron_1t = ModelSpec(n_layer=128, d_model=25600, n_head=160, vocab_size=51_200,
                            seq_len=2048, bias=True, tied_embeddings=True,
                            learned_positions=True, name="GPT 1T")  # fmt: skip
    h100 = dict(gpus_per_node=8, intra_node="NVLink 4", inter_node="InfiniBand NDR 400 Gb/s")
    a100 = dict(gpus_per_node=8, intra_node="NVLink 3", inter_node="InfiniBand HDR 200 Gb/s")
    llama_cite = ("Llama Team, AI @ Meta 2024, \"The Llama 3 Herd of Models\", arXiv 2407.21783 "
                  "(v3), section 3.3.2, Table 4, first row")  # fmt: skip
    meg_cite = ("Narayanan et al. 2021, \"Efficient Large-Scale Language Model Training on GPU "
                "Clusters Using Megatron-LM\", arXiv 2104.04473, Table 1")  # fmt: skip
    # Megatron 2021 ran full activation recomputation (its FLOP count, eq. 3, includes the
    # recomputed forward) and predates sequence parallelism and its distributed optimizer.
    meg_search = Search(recompute=("full",), sequence_parallel=False, zero_stages=(0,),
                        interleave=(1, 2, 4))  # fmt: skip
    return [
        Published(
            "Llama 3 405B, 8,192 H100",
            llama_cite,
            llama,
            # 405B ran on RoCE, not InfiniBand (section 3.3.1): the same 400 Gb/s per GPU
            Cluster.from_tables("NVIDIA H100 80GB HBM3", n_gpus=8192,
                                **{**h100, "inter_node": "RoCE 400 Gb/s"}),
            Workload.from_tokens(2048 * 8192, 8192, mfu=mfu),
            Search(uneven_stages=True, zero_stages=(1, 2, 3)),
            {"dp": 64, "tp": 8, "pp": 16, "cp": 1},
            "430 TFLOP/s per GPU, BF16 MFU 43% (measured by Meta); 16M tokens per batch",
        ),
        Published(
            "GPT 145.6B, 1,536 A100",
            meg_cite,
            megatron_145,
            Cluster.from_tables("NVIDIA A100-SXM4-80GB", n_gpus=1536, **a100),
            Workload(global_batch=2304, mfu=mfu),
            meg_search,
            {"dp": 24, "tp": 8, "pp": 8, "cp": 1},
            "148 TFLOP/s per GPU, 47% of peak (measured by NVIDIA); batch 2304",
        ),
        Published(
            "GPT 1T, 3,072 A100",
            meg_cite,
            megatron_1t,
            Cluster.from_tables("NVIDIA A100-SXM4-80GB", n_gpus=3072, **a100),
            Workload(global_batch=3072, mfu=mfu),
            meg_search,
            {"dp": 6, "tp": 8, "pp": 64, "cp": 1},
            "163 TFLOP/s per GPU, 52% of peak (measured by NVIDIA); batch 3072",
        ),
    ]


def this_machine(model_cfg: Any, *, global_batch: int, matmul_flops_per_s: float,
                 link_bytes_per_s: float, link_latency_s: float = 0.0, nproc: int = 4,
                 mfu: float = 0.5, link_name: str = "gloo over loopback",
                 device_name: str = "this CPU (one rank)",
                 ) -> tuple[ModelSpec, Cluster, Workload, Search]:  # fmt: skip
    """The case of this machine's 2 × 2 runs: ``nproc`` CPU ranks over gloo on one host, fp32
    (4-byte parameters, gradients and activations, AdamW's m and v: K = 8), a measured matmul
    ceiling for the compute and a measured loopback link for every collective. Memory is not
    checked (host memory is shared by the ranks)."""
    model = ModelSpec.from_model_config(model_cfg)
    link = Link(name=link_name, bytes_per_s=link_bytes_per_s,
                latency_s=link_latency_s, source="measured: link probe of labkit.workers.allreduce")  # fmt: skip
    device = Device(name=device_name, peak_flops_per_s=matmul_flops_per_s,
                    memory_bytes=None, source="measured: torch.matmul ceiling on this machine")  # fmt: skip
    cluster = Cluster(device=device, n_gpus=nproc, gpus_per_node=nproc, intra_node=link,
                      inter_node=link)  # fmt: skip
    workload = Workload(global_batch=global_batch, mfu=mfu, param_bytes=4, grad_bytes=4,
                        optimizer_bytes=8, activation_bytes=4, attention="flash")  # fmt: skip
    search = Search(
        zero_stages=(0,),
        interleave=(1,),
        max_cp=nproc,
        sequence_parallel=False,
        vocab_parallel=False,
    )
    return model, cluster, workload, search


__all__: Sequence[str] = (
    "MODELLED",
    "RECOMPUTE",
    "Cluster",
    "Device",
    "Layout",
    "Link",
    "ModelSpec",
    "Plan",
    "Prediction",
    "Published",
    "Search",
    "Workload",
    "check_layout",
    "enumerate_layouts",
    "plan",
    "predict",
    "published_cases",
    "sensitivity",
    "sensitivity_summary",
    "this_machine",
)  # fmt: skip
