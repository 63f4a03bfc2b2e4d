"""The prediction for one layout: memory per GPU, time and bytes per step (:func:`predict`),
modelled as :mod:`labkit.planner`'s docstring derives, from :mod:`labkit.formulas`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from labkit import formulas
from labkit.planner.specs import (
    MODELLED,
    Cluster,
    Layout,
    Link,
    ModelSpec,
    Search,
    Workload,
    check_layout,
)

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
    """Memory per GPU, time and bytes per step of ``layout``, modelled (see the package doc).

    Not in :mod:`labkit.formulas`: it models a whole cluster running a layout, over the
    planner's own types and a device's table row, composed from those formulas."""
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
