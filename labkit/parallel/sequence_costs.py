"""What sequence parallelism costs, checked, predicted and measured: the check a config passes
before launch (heads and tokens split evenly over the ranks), the activation bytes of Korthikanti
et al. 2022's Table 2 (arXiv 2205.05198) and this course's version of them, which predicts to
the byte what autograd saves on each rank, the collectives of one step and the bytes each rank
sends for them, and the measurement the predictions are held against.

Separate from :mod:`labkit.parallel.sequence` (the implementation): a check, formulas and a
measurement, no autograd functions; re-exported there under the old names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from labkit import memory
from labkit.config import ModelConfig
from labkit.parallel import comm, tensor
from labkit.validate import whole

# --- checks before anything is launched ------------------------------------------------------


def validate_sequence_parallel(
    model_cfg: ModelConfig, tp: int, *, seq_len: int | None = None
) -> None:
    """Raise ValueError, naming the constraint and the fix, if ``tp`` ranks cannot split the
    model (heads, as for tensor parallelism) and the sequence (every rank the same number of
    tokens: ``seq_len`` of the batches, the model's by default)."""
    tensor.validate_tensor_parallel(model_cfg, tp)
    s = whole("seq_len", model_cfg.seq_len if seq_len is None else seq_len, low=1)
    if s % tp:
        raise ValueError(
            f"tp={tp} does not divide seq_len={s}: sequence parallelism gives each rank"
            f" seq_len/tp tokens; use a sequence length that is a multiple of {tp}"
            f" (e.g. {s + (-s) % tp}) or tp in"
            f" {[d for d in range(1, s + 1) if s % d == 0 and model_cfg.n_head % d == 0]}"
        )


# --- the paper's formulas (Table 2) and this course's version --------------------------------


def paper_activation_bytes_per_layer(
    s: int, b: int, h: int, a: int, t: int = 1, *, sequence_parallel: bool = False
) -> float:
    """Activation bytes per transformer layer per rank, Korthikanti et al. 2022, Table 2.

    16-bit activations, 1-byte dropout masks, the attention matrix stored, no recomputation:

        tensor parallel (baseline)   s·b·h·(10 + 24/t + 5·a·s/(h·t))      (their equation 2)
        tensor + sequence parallel   s·b·h·(34/t + 5·a·s/(h·t))            (their equation 4)

    With t = 1 both are equation 1, s·b·h·(34 + 5·a·s/h). The 10 are the replicated
    LayerNorm inputs (4), the inputs of the q/k/v and first MLP matmuls (2 + 2) and the two
    dropout masks (1 + 1); sequence parallelism divides them by t.
    """
    for name, v in (("s", s), ("b", b), ("h", h), ("a", a), ("t", t)):
        whole(name, v, low=1)
    attention = 5 * a * s / (h * t)
    inside = 34 / t if sequence_parallel else 10 + 24 / t
    return s * b * h * (inside + attention)


def layer_activation_bytes(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    *,
    sequence_parallel: bool = False,
    regather: bool = True,
    bytes_per_element: int = 2,
    dropout: bool = True,
    dropout_mask_bytes: int = 1,
    attention: str = "materialized",
    norm_statistics: bool = False,
) -> float:
    """Table 2 generalised: bytes one rank saves per layer, with e = ``bytes_per_element``
    and k = ``dropout_mask_bytes`` (0 without dropout); the defaults give the paper's rows.

        replicated under TP    (4e + 2k)·sbh    LayerNorm inputs 2e, q/k/v input e, MLP input e,
                                                the two dropout masks 2k
        split by TP            12e·sbh / t      Q, K, V 3e, attention output e, GELU in/out 8e
        attention              a·s²·b·(2e + k) / t   materialized (softmax, its mask and output)
                               4·a·s·b / t           "flash": a float32 log-sum-exp per row

    Sequence parallelism divides the replicated part by t too; with ``regather=False`` the
    q/k/v and MLP inputs (2e) stay whole, since the all-gathered tensor is what the matmuls
    save. ``norm_statistics`` adds PyTorch's float32 LayerNorm mean and rstd, 2·2·4·s·b per
    layer (the paper leaves them out), split by t under sequence parallelism.
    """
    for name, v in (("s", s), ("b", b), ("h", h), ("a", a), ("t", t)):
        whole(name, v, low=1)
    if attention not in ("materialized", "flash"):
        raise ValueError(f"attention={attention!r}: use 'materialized' or 'flash'")
    e, k = bytes_per_element, (dropout_mask_bytes if dropout else 0)
    sbh = s * b * h
    norms_and_masks = (2 * e + 2 * k) * sbh
    matmul_inputs = 2 * e * sbh  # the q/k/v input and the MLP input
    split = 12 * e * sbh / t
    quad = a * s * s * b * (2 * e + k) if attention == "materialized" else 4 * a * s * b
    stats = 2 * 2 * 4 * s * b if norm_statistics else 0
    if sequence_parallel:
        kept = norms_and_masks / t + (matmul_inputs / t if regather else matmul_inputs)
        stats /= t
    else:
        kept = norms_and_masks + matmul_inputs
    return kept + split + quad / t + stats


MODES = ("tp", "sp", "sp_keep_gathered")


def predicted_activations_per_rank(
    cfg: ModelConfig,
    micro_batch: int,
    tp: int,
    *,
    mode: str = "sp",
    bytes_per_element: int = 4,
    device_type: str = "cpu",
) -> dict[str, int]:
    """Bytes ``labkit.model.GPT`` saves for backward per rank, term by term, in float32
    (no autocast), dropout off, with a fused SDPA kernel (flash on CPU and CUDA).

    Not in :mod:`labkit.formulas`: the layers are counted as this package's TP and SP plans
    shard them (:func:`layer_activation_bytes`), so it lives beside those plans.

    ``mode``: "tp" (``tensor.apply_tensor_parallel``), "sp" (:func:`apply_sequence_parallel`),
    "sp_keep_gathered" (``regather=False``; DTensor's plan saves the same tensors). The layers
    come from :func:`layer_activation_bytes` with e = 4 and no masks; outside them, as
    ``memory.predicted_activations`` counts for one process: the final LayerNorm's input and
    statistics (on 1/t of the tokens under SP), the head's input (the gathered whole
    sequence in every mode: the head is replicated), the float32 log-softmax, the ids, the
    loss's scalar. With tp = 1 every mode is ``memory.predicted_activations``.

    ``device_type="cuda"`` adds 16 bytes per layer: in float32 CUDA's SDPA runs the
    memory-efficient kernel, which also saves its random-number seed and offset, two int64
    scalars (measured: torch 2.11, one H200, one process, exact with this term).
    """
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type={device_type!r}: use 'cpu' or 'cuda'")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: use one of {MODES}")
    if cfg.dropout > 0:
        raise ValueError(
            f"cfg.dropout={cfg.dropout!r}: the prediction is for dropout off;"
            " use a config with dropout=0.0 (every preset has it)"
        )
    validate_sequence_parallel(cfg, tp)
    s, b, h, a, V, L = (
        cfg.seq_len,
        micro_batch,
        cfg.d_model,
        cfg.n_head,
        cfg.vocab_size,
        cfg.n_layer,
    )
    e = bytes_per_element
    sp = mode != "tp"
    layer = layer_activation_bytes(
        s, b, h, a, tp, sequence_parallel=sp, regather=mode == "sp", bytes_per_element=e,
        dropout=False, attention="flash", norm_statistics=False)  # fmt: skip
    div = tp if sp else 1
    terms = {
        "transformer layers": L * layer,
        "LayerNorm statistics (blocks)": L * 2 * 2 * 4 * s * b / div,
        "final LayerNorm input": e * s * b * h / div,
        "final LayerNorm statistics": 2 * 4 * s * b / div,
        "output head input (whole sequence)": e * s * b * h,
        "log-softmax output": 4 * s * b * V,
        "token and position ids": 2 * 8 * s * b + 8 * s,
        "loss total_weight": 4,
    }
    if device_type == "cuda":
        terms["attention RNG seed and offset (CUDA)"] = 16 * L
    return {k: int(v) for k, v in terms.items()}


def collectives_per_step(
    cfg: ModelConfig, micro_batch: int, tp: int, *, mode: str = "sp", bytes_per_element: int = 4
) -> dict[str, dict[str, Any]]:
    """Collectives one training step issues, by kind: calls, message bytes S (NCCL-tests:
    the gathered output of an all-gather, the full input of a reduce-scatter) and the bytes
    each rank sends in a ring, for "tp" (4L all-reduces of S = b·s·h·e) or "sp" /
    "sp_keep_gathered" (this module).

    SP per layer: 2 all-gathers + 2 reduce-scatters forward, the same backward (each one's
    conjugate), and with "sp" 2 more all-gathers backward (the re-gathered inputs). Per step:
    1 all-gather forward before the head, 1 backward after the embeddings (the gradient of
    the split), 1 all-reduce of the (6L + 2)·h shard-trained parameters' gradients.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: use one of {MODES}")
    L, h, n = cfg.n_layer, cfg.d_model, tp
    S = micro_batch * cfg.seq_len * h * bytes_per_element

    def row(calls: int, message: int, kind: str) -> dict[str, Any]:
        return {
            "calls": calls,
            "message_bytes": calls * message,
            "sent_per_rank": calls * comm.sent_per_rank(kind, message, n),
        }

    if mode == "tp":
        return {"all_reduce": row(4 * L, S, "all_reduce")}
    gathers = 4 * L + 2 + (2 * L if mode == "sp" else 0)
    return {
        "all_gather": row(gathers, S, "all_gather"),
        "reduce_scatter": row(4 * L, S, "reduce_scatter"),
        "all_reduce": row(1, (6 * L + 2) * h * 4, "all_reduce"),
    }

# --- measuring what autograd saves -------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def saved_activation_bytes(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                           device: torch.device | None = None) -> int:  # fmt: skip
    """Bytes autograd saves for backward in one forward pass on this rank: the method of
    ``memory.saved_activation_bytes`` (``saved_tensors_hooks``, each storage once, parameters
    left out), with DTensors counted by their local shard (a DTensor is a wrapper whose
    bytes live in ``to_local()``). Collective for parallel models: every rank calls it."""
    params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = _local(t)
        if local.untyped_storage().data_ptr() not in params:
            saved.append(local)
        return t

    x, y = (t.to(device) if device is not None else t for t in batch)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, y)
    return memory.storage_bytes(saved)


def ring_sent_per_rank(counts: dict[str, int], world_size: int) -> float:
    """Bytes one rank sends for the collectives in ``counts`` ({"all_gather forward": S, ...},
    message bytes), by the ring formulas (``comm.sent_per_rank``)."""
    return sum(comm.sent_per_rank(key.split()[0], v, world_size) for key, v in counts.items())


def relative(a: float, b: float) -> float:
    """|a − b| / b (0 when both are 0)."""
    return 0.0 if a == b == 0 else abs(a - b) / abs(b) if b else math.inf


# --- what notebook 03c prints: the predictions above, as its tables ---------------------------

LAYOUTS = {"TP": "tp", "TP+SP, gathered kept": "sp_keep_gathered", "TP+SP": "sp"}
"""The three layouts notebook 03c compares, by the label its tables print."""

_KiB, _MiB = 2**10, 2**20


@dataclass(frozen=True)
class Table2AtScale:
    """Table 2's two rows for one layer of a published model at several tensor-parallel
    degrees ``ts`` (:func:`table2_at_scale`)."""

    name: str
    s: int
    b: int
    h: int
    a: int
    ts: tuple[int, ...]
    tp_bytes: tuple[float, ...]  # per layer per GPU, tensor parallel
    sp_bytes: tuple[float, ...]  # tensor + sequence parallel

    def describe(self) -> str:
        """One line per t: both rows in MiB and the share saved; where the s×s attention term
        holds most of TP's bytes (5·a·s/(h·t) > 10 + 24/t), the line says it dominates."""
        attention = 5 * self.a * self.s / self.h
        lines = []
        for i, (t, tp, sp) in enumerate(zip(self.ts, self.tp_bytes, self.sp_bytes, strict=True)):
            where = (f"{self.name}, t = {t}, b = {self.b}, per GPU" if i == 0
                     else f"the same layer at t = {t}")  # fmt: skip
            why = (f": the s×s attention term, 5·a·s/h = {attention:.0f}, dominates"
                   if attention / t > 10 + 24 / t else "")  # fmt: skip
            lines.append(f"predicted (Table 2), {where}: TP {tp / _MiB:,.0f} MiB, TP+SP "
                         f"{sp / _MiB:,.0f} MiB ({1 - sp / tp:.0%} less{why})")
        return "\n".join(lines)


def table2_at_scale(name: str, *, s: int, b: int, h: int, a: int,
                    ts: tuple[int, ...]) -> Table2AtScale:  # fmt: skip
    """:func:`paper_activation_bytes_per_layer` for one layer (``name``, as the lines print it)
    at each tensor-parallel degree in ``ts``, without and with sequence parallelism."""
    tp = tuple(paper_activation_bytes_per_layer(s, b, h, a, t) for t in ts)
    sp = tuple(paper_activation_bytes_per_layer(s, b, h, a, t, sequence_parallel=True) for t in ts)
    return Table2AtScale(name, s, b, h, a, tuple(ts), tp, sp)


@dataclass(frozen=True)
class LayerPrediction:
    """One layer of a course GPT per rank, TP and TP+SP, counted the paper's way and this GPT's
    (float32, no dropout, fused attention): :func:`layer_prediction`."""

    s: int
    b: int
    h: int
    a: int
    t: int
    paper: dict[str, float]  # "TP", "TP+SP" -> bytes, Table 2
    this_gpt: dict[str, float]  # the same, :func:`layer_activation_bytes` for this GPT

    @property
    def saving(self) -> float:
        """The share of this GPT's layer that sequence parallelism saves per rank."""
        return 1 - self.this_gpt["TP+SP"] / self.this_gpt["TP"]

    def describe(self) -> str:
        lines = [f"predicted, one layer of this GPT (s={self.s}, b={self.b}, h={self.h}, "
                 f"a={self.a}), t = {self.t}, per rank:",
                 f"{'':8}{'paper (16-bit, masks, s×s matrix)':>36}"
                 f"{'this GPT (fp32, no dropout, fused)':>38}"]  # fmt: skip
        lines += [f"{label:8}{paper / _KiB:>32,.0f} KiB{self.this_gpt[label] / _KiB:>34,.0f} KiB"
                  for label, paper in self.paper.items()]
        lines.append(f"predicted: sequence parallelism saves {self.saving:.0%} of a layer of "
                     "this GPT per rank")
        return "\n".join(lines)


def layer_prediction(cfg: ModelConfig, micro_batch: int, tp: int) -> LayerPrediction:
    """One layer of ``cfg``'s GPT at ``micro_batch`` sequences on ``tp`` ranks, both ways."""
    dims = {"s": cfg.seq_len, "b": micro_batch, "h": cfg.d_model, "a": cfg.n_head, "t": tp}
    this_gpt = {"bytes_per_element": 4, "dropout": False, "attention": "flash"}
    paper, ours = {}, {}
    for label, kw in (("TP", {}), ("TP+SP", {"sequence_parallel": True})):
        paper[label] = paper_activation_bytes_per_layer(**dims, **kw)
        ours[label] = layer_activation_bytes(**dims, **kw, **this_gpt)
    return LayerPrediction(**dims, paper=paper, this_gpt=ours)


@dataclass(frozen=True)
class LayoutPrediction:
    """What each layout of :data:`LAYOUTS` is predicted to save and send per rank:
    :func:`predict_layouts`."""

    micro_batch: int
    tp: int
    device_type: str
    activations: dict[str, dict[str, int]]  # label -> term -> bytes autograd saves, one forward
    collectives: dict[str, dict[str, dict[str, Any]]]  # label -> kind -> calls, bytes

    def describe(self) -> str:
        acts = self.activations
        lines = [f"predicted bytes autograd saves per rank in one forward (b={self.micro_batch}, "
                 f"t={self.tp}, ranks on {self.device_type}):",
                 f"{'term':40}" + "".join(f"{label:>22}" for label in acts)]  # fmt: skip
        lines += [f"{term:40}" + "".join(f"{p[term]:>22,}" for p in acts.values())
                  for term in next(iter(acts.values()))]
        lines.append(f"{'total':40}" + "".join(f"{sum(p.values()):>22,}" for p in acts.values()))
        lines += ["", "predicted collectives per training step (S: message bytes as NCCL-tests "
                  "counts them; sent: bytes one rank sends, ring formulas):"]
        for label, kinds in self.collectives.items():
            lines += [f"  {label:22}{kind:16}{row['calls']:3} calls   S "
                      f"{row['message_bytes'] / _MiB:7.3f} MiB   sent "
                      f"{row['sent_per_rank'] / _MiB:7.3f} MiB" for kind, row in kinds.items()]
        return "\n".join(lines)


def predict_layouts(cfg: ModelConfig, micro_batch: int, tp: int, *,
                    device_type: str = "cpu") -> LayoutPrediction:  # fmt: skip
    """:func:`predicted_activations_per_rank` and :func:`collectives_per_step` for each layout
    of :data:`LAYOUTS`, with ranks on ``device_type``."""
    acts = {label: predicted_activations_per_rank(cfg, micro_batch, tp, mode=mode,
                                                  device_type=device_type)
            for label, mode in LAYOUTS.items()}  # fmt: skip
    colls = {label: collectives_per_step(cfg, micro_batch, tp, mode=mode)
             for label, mode in LAYOUTS.items()}
    return LayoutPrediction(micro_batch, tp, device_type, acts, colls)
