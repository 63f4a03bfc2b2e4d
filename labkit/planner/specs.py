"""What the planner is asked about: the model (:class:`ModelSpec`), the hardware (:class:`Link`,
:class:`Device`, :class:`Cluster`, from labkit.hardware's sourced tables or measured), the
workload's assumptions (:class:`Workload`), what to search (:class:`Search`), one candidate
(:class:`Layout`), and the constraints a layout must meet, each with its fix
(:func:`check_layout`).

Typed, validated inputs apart from the model that predicts from them (:mod:`.prediction`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from labkit import formulas, hardware
from labkit.validate import number, one_of, positive, whole

RECOMPUTE = ("none", "selective", "full")
MODELLED = "modelled"


def divisors(n: int) -> list[int]:
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
            whole(f, getattr(self, f), low=1)
        whole("moe_experts", self.moe_experts, low=0)
        if self.d_model % self.n_head:
            raise ValueError(f"n_head={self.n_head} does not divide d_model={self.d_model}: "
                             "each head gets d_model/n_head channels; pick a divisor")  # fmt: skip
        if self.n_kv_head is not None:
            whole("n_kv_head", self.n_kv_head, low=1)
            if self.n_head % self.n_kv_head:
                raise ValueError(f"n_kv_head={self.n_kv_head} does not divide n_head="
                                 f"{self.n_head}: query heads share key/value heads in equal "
                                 "groups; pick a divisor")  # fmt: skip
        if self.ffn_hidden is not None:
            whole("ffn_hidden", self.ffn_hidden, low=1)
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
        positive("bytes_per_s", self.bytes_per_s)
        number("latency_s", self.latency_s, low=0)

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
        positive("peak_flops_per_s", self.peak_flops_per_s)
        if self.memory_bytes is not None:
            positive("memory_bytes", self.memory_bytes)

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
        whole("n_gpus", self.n_gpus, low=1)
        whole("gpus_per_node", self.gpus_per_node, low=1)
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
        whole("global_batch", self.global_batch, low=1)
        number("mfu", positive("mfu", self.mfu), high=1.0)
        for f in ("param_bytes", "grad_bytes", "activation_bytes"):
            positive(f, getattr(self, f))
        number("optimizer_bytes", self.optimizer_bytes, low=0)
        number("usable_memory", positive("usable_memory", self.usable_memory), high=1.0)
        one_of("attention", self.attention, formulas.ATTENTION_KINDS)

    @classmethod
    def from_tokens(cls, tokens: int, seq_len: int, **kwargs: Any) -> Workload:
        """A global batch given in tokens: it must be a whole number of sequences."""
        whole("tokens", tokens, low=1)
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
            whole("micro_batches entry", b, low=1)
        for v in self.interleave:
            whole("interleave entry", v, low=1)
        for z in self.zero_stages:
            one_of("zero_stages entry", z, formulas.ZERO_STAGES, why="ZeRO stages")
        for r in self.recompute:
            one_of("recompute entry", r, RECOMPUTE)
        whole("max_cp", self.max_cp, low=1)


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
            whole(f, getattr(self, f), low=1)
        one_of("zero", self.zero, formulas.ZERO_STAGES, why="ZeRO stages")
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
        whole(f, getattr(lay, f), low=1)
    one_of("zero", lay.zero, formulas.ZERO_STAGES, why="ZeRO stages")
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
