"""FLOPs and what they achieve: parameter counts, training FLOPs, MFU, the roofline, GEMM tiles.

The compute side of a prediction: how many FLOPs a model needs per token, the share of a
device's peak a measured throughput reaches (MFU), the roofline's bound for a kernel of a
given arithmetic intensity, and how a GEMM's output quantizes onto tiles and waves.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from labkit.formulas.activations import GPTShape
from labkit.validate import number, one_of, positive, whole


def gpt_params(
    vocab_size: int,
    d_model: int,
    n_layer: int,
    seq_len: int | None = None,
    *,
    tied: bool = True,
    bias: bool = True,
) -> int:
    """Exact parameter count of a GPT-2-style decoder (MLP width 4h, no GLU).

    Per layer (bias=True): LayerNorm 2h, q/k/v 3h² + 3h (fused or separate: same count),
    output projection h² + h, MLP 4h² + 4h and 4h² + h, LayerNorm 2h: 12h² + 13h. Hence the
    Playbook's formula (memory section) for a tied model without position embeddings::

        h·V + L·(12h² + 13h) + 2h              (2h: the final LayerNorm)

    plus ``s·h`` for learned position embeddings (pass ``seq_len``) and plus ``V·h`` for an
    untied lm_head (no bias). With ``bias=False`` (nanoGPT's default) the Linear biases and
    LayerNorm biases disappear: 12h² + 2h per layer and h for the final LayerNorm.

    labkit.model (biases on, learned positions, tied head) has exactly
    ``V·h + s·h + L·(12h² + 13h) + 2h`` parameters: ``gpt_params(V, h, L, seq_len=s)``.
    """
    V = whole("vocab_size", vocab_size, low=1)
    h = whole("d_model", d_model, low=1)
    L = whole("n_layer", n_layer, low=1)
    per_layer = 12 * h * h + (13 * h if bias else 2 * h)
    final_norm = 2 * h if bias else h
    total = V * h + L * per_layer + final_norm
    if seq_len is not None:
        total += whole("seq_len", seq_len, low=1) * h
    if not tied:
        total += V * h
    return total


def gpt_parameter_counts(cfg: GPTShape) -> list[int]:
    """Elements of each parameter tensor of ``labkit.model.GPT(cfg)``, in ``GPT.parameters()``
    order, a tied head's weight once.

    Read from the modules :mod:`labkit.model` builds: the token and position embeddings (V·h,
    s·h); per block ``ln_1`` (h, h), ``attn``'s q, k, v and output projection (h² + h each),
    ``ln_2`` (h, h), the MLP's ``fc`` (4h², 4h) and ``proj`` (4h², h); the final LayerNorm
    ``ln_f`` (h, h); and an untied ``lm_head`` (V·h, no bias). One entry per tensor, not a
    total (:func:`gpt_params` is the total), because a prediction of memory rounds each
    tensor's bytes on its own (the CUDA allocator's blocks).
    """
    h = whole("d_model", cfg.d_model, low=1)
    V = whole("vocab_size", cfg.vocab_size, low=1)
    block = [h, h,  # ln_1
             h * h, h, h * h, h, h * h, h, h * h, h,  # q, k, v, attention proj
             h, h,  # ln_2
             4 * h * h, 4 * h, 4 * h * h, h]  # MLP fc, proj  # fmt: skip
    head = [] if cfg.tie_weights else [V * h]
    return [V * h, cfg.seq_len * h] + block * cfg.n_layer + [h, h] + head


FLOP_ATTENTION_CONVENTIONS = ("full", "causal", "none")


def flops_per_token(
    n_params: float,
    n_layer: int,
    d_model: int,
    seq_len: int,
    attention: str = "full",
) -> float:
    """Training FLOPs (forward + backward) per token.

    Each parameter costs 2 FLOPs per token forward (one multiply-add) and 4 backward (gradients
    with respect to inputs and to weights): 6N. Attention's QKᵀ and softmax·V add FLOPs that no
    parameter accounts for; the conventions differ on how to count them::

        "full"    6N + 12·L·h·s   nanoGPT estimate_mfu (12·L·H·Q·T with H·Q = h); PaLM App. B
        "causal"  6N +  6·L·h·s   a causal mask needs only half of the s×s scores (the
                                  term llm.c's train_gpt2.cu adds, without naming why)
        "none"    6N              the attention term ignored (Kaplan et al. 2020's C ≈ 6N)

    Which N? nanoGPT passes ``get_num_params()``, which subtracts the position embeddings (a
    lookup, no FLOPs) but keeps the token embedding, because with tied weights it is also the
    lm_head matmul. State which N you use when you print an MFU.
    """
    N = positive("n_params", n_params)
    L = whole("n_layer", n_layer, low=1)
    h = whole("d_model", d_model, low=1)
    s = whole("seq_len", seq_len, low=1)
    one_of("attention", attention, FLOP_ATTENTION_CONVENTIONS)
    attention_flops = {"full": 12 * L * h * s, "causal": 6 * L * h * s, "none": 0}[attention]
    return 6 * N + attention_flops


def training_flops(n_params: float, tokens: float) -> float:
    """Total training compute C ≈ 6·N·D FLOPs for D tokens (Kaplan et al. 2020, section 2.1).

    Ignores the attention term of ``flops_per_token``; fine when h ≫ s.
    """
    return 6 * positive("n_params", n_params) * positive("tokens", tokens)


def layer_training_flops(b: int, s: int, h: int, attention: str = "full") -> float:
    """FLOPs of one transformer layer's forward and backward for b sequences of s tokens.

    Forward, per layer (Narayanan et al. 2021, arXiv 2104.04473, section 5.1): the q/k/v,
    output-projection and 4h MLP matmuls, 24·b·s·h², plus attention's scores QKᵀ and their
    product with V, 4·b·s²·h. Backward costs twice the forward, so::

        "full"    72·b·s·h² + 12·b·s²·h   = 72·b·s·h²·(1 + s/6h), the paper's eq. (3) per
                                            layer without its recomputation and vocabulary terms
        "causal"  72·b·s·h² +  6·b·s²·h   a kernel that skips the masked half of the scores
        "none"    72·b·s·h²               the matmuls with weights only (6N per token)

    Per token, "full" is :func:`flops_per_token`'s per-layer share (6·12h² + 12·h·s). At
    s = h the attention term adds 1/6 (17 %) to the weight matmuls.
    """
    b = whole("b", b, low=1)
    s = whole("s", s, low=1)
    h = whole("h", h, low=1)
    one_of("attention", attention, FLOP_ATTENTION_CONVENTIONS)
    scores = {"full": 12, "causal": 6, "none": 0}[attention] * b * s**2 * h
    return 72 * b * s * h**2 + scores


def mfu(
    tokens_per_s: float,
    flops_per_token: float,
    peak_flops_per_s: float | None,
    n_devices: int = 1,
) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s ÷ (n_devices × peak FLOP/s).

    ``tokens_per_s`` is the throughput of the whole job (all devices, after gradient
    accumulation), so its model FLOP/s are shared by ``n_devices`` devices. Miscounting
    accumulation steps or world size, or dividing by the wrong peak, are the MFU bugs learners
    hit (nanoGPT #182, #464, #619; nanochat #147).

    MFU counts only the FLOPs the model needs (PaLM App. B); hardware FLOPs utilisation (HFU)
    also counts recomputed work, so with activation checkpointing HFU > MFU. Use the peak of
    the dtype the matmuls really run in (bf16, or tf32 when enabled, else fp32).

    Raises:
        ValueError: if ``peak_flops_per_s`` is None or not positive. An unknown device has no
            peak, and then there is no MFU: report tokens/s instead of guessing.
    """
    if peak_flops_per_s is None:
        raise ValueError(
            "peak_flops_per_s is None: no published peak is known for this device and dtype, "
            "so MFU cannot be computed; report tokens/s (or pass a sourced peak)"
        )
    positive("peak_flops_per_s", peak_flops_per_s)
    number("tokens_per_s", tokens_per_s, low=0)
    positive("flops_per_token", flops_per_token)
    n = whole("n_devices", n_devices, low=1)
    return tokens_per_s * flops_per_token / (n * peak_flops_per_s)


# ----------------------------------------------------------------------------------------------
# Roofline (scaling-book roofline.md).


def critical_intensity(peak_flops_per_s: float, bandwidth_bytes_per_s: float) -> float:
    """Arithmetic intensity (FLOPs per byte moved) where a kernel stops being memory-bound: C/BW.

    H100 SXM: 989e12 / 3.35e12 ≈ 295 FLOPs/byte; H200: 989e12 / 4.8e12 ≈ 206.
    """
    return positive("peak_flops_per_s", peak_flops_per_s) / positive(
        "bandwidth_bytes_per_s", bandwidth_bytes_per_s
    )


def roofline_attainable_flops(
    intensity: float, peak_flops_per_s: float, bandwidth_bytes_per_s: float
) -> float:
    """Roofline bound in FLOP/s for a kernel of arithmetic intensity I: min(C, I·BW)."""
    i = number("intensity", intensity, low=0)
    C = positive("peak_flops_per_s", peak_flops_per_s)
    BW = positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    return min(C, i * BW)


class GemmQuantization(NamedTuple):
    """How a GEMM's output C (m × n) maps onto tiles and waves of a GPU (modelled)."""

    tiles: int  # ceil(m / tile_m) × ceil(n / tile_n) output tiles, one thread block each
    waves: int  # ceil(tiles / concurrent), rounds of tiles the GPU runs one after another
    tile_efficiency: float  # useful outputs ÷ outputs the tiles compute (padding wasted)
    wave_efficiency: float  # tiles ÷ (waves × concurrent): the last wave's idle share
    efficiency: float  # their product: the share of the launched work that is useful


def gemm_quantization(m: int, n: int, *, tile_m: int = 256, tile_n: int = 128,
                      concurrent: int = 108) -> GemmQuantization:  # fmt: skip
    """Tile and wave quantization of an m × n GEMM output (NVIDIA, "Matrix Multiplication
    Background User's Guide", §3.1 Tile Quantization and §3.2 Wave Quantization).

    A GPU computes C in tiles of tile_m × tile_n, one thread block each; a dimension that is
    not a multiple of the tile pads the last tile with work that is thrown away (**tile
    quantization**). The tiles run in waves of ``concurrent`` at a time (the guide's A100
    example: 108 SMs, one 256 × 128 tile per SM, so a wave of 108 tiles); a tile count just
    above a multiple of the wave adds a nearly empty last wave that takes as long as a full
    one (**wave quantization**). Time is modelled as proportional to waves, so throughput
    follows ``efficiency``: a saw-tooth against m or n. Which tile cuBLAS picks depends on
    the shape and the library version; the defaults are the guide's example, not a rule.

    >>> q = gemm_quantization(256 * 9, 128 * 12)  # 108 tiles: exactly one full wave
    >>> q.tiles, q.waves, q.efficiency
    (108, 1, 1.0)
    >>> round(gemm_quantization(256 * 9 + 1, 128 * 12).efficiency, 3)  # 120 tiles: 2 waves
    0.5
    """
    m, n = whole("m", m, low=1), whole("n", n, low=1)
    tile_m, tile_n = whole("tile_m", tile_m, low=1), whole("tile_n", tile_n, low=1)
    concurrent = whole("concurrent", concurrent, low=1)
    rows, cols = math.ceil(m / tile_m), math.ceil(n / tile_n)
    tiles = rows * cols
    waves = math.ceil(tiles / concurrent)
    tile_eff = (m * n) / (rows * tile_m * cols * tile_n)
    wave_eff = tiles / (waves * concurrent)
    return GemmQuantization(tiles, waves, tile_eff, wave_eff, tile_eff * wave_eff)
