"""labkit.formulas against published worked examples. Each test names where its numbers come from."""

from __future__ import annotations

import math
import types

import pytest

from labkit import formulas as f

# GPT-2 small as nanoGPT loads it (model.py GPT.from_pretrained: vocab_size=50257,
# block_size=1024, bias=True; n_layer=12, n_head=12, n_embd=768).
V, S, L, H, A = 50257, 1024, 12, 768, 12


# ---------------------------------------------------------------------------------------------
# Parameter counts


def test_gpt2_params_match_nanogpt_with_bias():
    # nanoGPT `python sample.py --init_from=gpt2` prints "number of parameters: 123.65M", which is
    # get_num_params() = all parameters minus the 1024×768 position embedding. configure_optimizers
    # prints "num decayed parameter tensors: 50, with 124,318,464 parameters" and
    # "num non-decayed parameter tensors: 98, with 121,344 parameters": 124,439,808 in total.
    total = f.gpt_params(V, H, L, seq_len=S)
    assert total == 124_318_464 + 121_344 == 124_439_808
    non_embedding = total - S * H
    assert non_embedding == 123_653_376
    assert round(non_embedding / 1e6, 2) == 123.65


def test_gpt2_params_match_transformer_sizing_notebook_without_bias():
    # nanoGPT transformer_sizing.ipynb (bias=False): "we see: 124337664, expected: 124337664".
    assert f.gpt_params(V, H, L, seq_len=S, bias=False) == 124_337_664


def test_gpt_params_playbook_formula_and_variants():
    # Playbook: h·V + L·(12h² + 13h) + 2h, tied, no position embedding.
    h, v, n = 64, 256, 3
    assert f.gpt_params(v, h, n) == h * v + n * (12 * h * h + 13 * h) + 2 * h
    assert f.gpt_params(v, h, n, seq_len=32) == f.gpt_params(v, h, n) + 32 * h
    assert f.gpt_params(v, h, n, tied=False) == f.gpt_params(v, h, n) + v * h


def test_gpt_params_equals_a_real_module_count():
    # The docstring's per-layer breakdown, checked against torch's own count of a GPT-2 block
    # with separate q/k/v projections (the layout labkit.model uses).
    torch = pytest.importorskip("torch")
    nn = torch.nn
    h, v, n, s = 32, 50, 2, 16
    attention = [
        nn.LayerNorm(h),
        nn.Linear(h, h),
        nn.Linear(h, h),
        nn.Linear(h, h),
        nn.Linear(h, h),
    ]
    mlp = [nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)]
    block = nn.ModuleList([*attention, *mlp])
    per_block = sum(p.numel() for p in block.parameters())
    embeddings = v * h + s * h  # tied lm_head adds nothing
    final_norm = 2 * h
    assert f.gpt_params(v, h, n, seq_len=s) == embeddings + n * per_block + final_norm


@pytest.mark.parametrize("tie_weights", [True, False])
def test_gpt_parameter_counts_are_labkit_gpts_tensors(tie_weights):
    # One entry per tensor of the real model, in its order, for two shapes (tied and untied).
    pytest.importorskip("torch")
    from labkit.config import ModelConfig
    from labkit.model import GPT

    for cfg in (ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, vocab_size=50,
                            tie_weights=tie_weights),
                ModelConfig(n_layer=3, n_head=4, d_model=48, seq_len=24, vocab_size=96,
                            tie_weights=tie_weights)):  # fmt: skip
        counts = f.gpt_parameter_counts(cfg)
        assert counts == [p.numel() for p in GPT(cfg).parameters()]
        assert sum(counts) == f.gpt_params(cfg.vocab_size, cfg.d_model, cfg.n_layer,
                                           seq_len=cfg.seq_len, tied=tie_weights)


# ---------------------------------------------------------------------------------------------
# FLOPs and MFU


def test_flops_per_token_nanogpt_estimate_mfu():
    # nanoGPT model.py estimate_mfu: N = get_num_params(); flops_per_token = 6*N + 12*L*H*Q*T.
    N = 123_653_376
    expected = 6 * N + 12 * L * A * (H // A) * S
    assert f.flops_per_token(N, L, H, S) == expected == 855_166_464


def test_flops_per_sequence_matches_transformer_sizing_palm_flops():
    # transformer_sizing.ipynb prints "palm_flops: 879894724608" for one 1024-token sequence,
    # with N = params()['total'] = 124,337,664 (bias=False, position embeddings included).
    assert f.flops_per_token(124_337_664, L, H, S) * S == 879_894_724_608


def test_flops_conventions_causal_and_none():
    N = 1e6
    full = f.flops_per_token(N, L, H, S, "full")
    causal = f.flops_per_token(N, L, H, S, "causal")
    assert f.flops_per_token(N, L, H, S, "none") == 6 * N
    assert full - 6 * N == 2 * (causal - 6 * N) == 12 * L * H * S


def test_layer_training_flops_is_narayanan_eq_3_without_recompute_and_vocabulary():
    # arXiv 2104.04473 eq. (3), with activation recomputation (a second forward: 4/3 of
    # forward + backward) and the logit layer: 96·B·s·l·h²·(1 + s/6h + V/(16·l·h)).
    b, s, h, n_l, v = 3, 2048, 12288, 96, 51200
    eq3 = 96 * b * s * n_l * h**2 * (1 + s / (6 * h) + v / (16 * n_l * h))
    ours = 4 / 3 * n_l * f.layer_training_flops(b, s, h) + 6 * b * s * h * v
    assert ours == pytest.approx(eq3, rel=1e-12)
    # at s = h the scores add a sixth to the weight matmuls (N03-1: the omitted 17 %)
    assert f.layer_training_flops(1, 4096, 4096) / f.layer_training_flops(1, 4096, 4096, "none") == 7 / 6
    full, causal, none = (f.layer_training_flops(2, 64, 32, a) for a in ("full", "causal", "none"))
    assert full - none == 2 * (causal - none) == 12 * 2 * 64**2 * 32


def test_layer_training_flops_per_token_is_flops_per_token_per_layer():
    b, s, h, n_layer = 2, 1024, 768, 12
    n = 12 * h**2 * n_layer  # the layers' weight matrices only
    assert f.layer_training_flops(b, s, h) * n_layer / (b * s) == f.flops_per_token(n, n_layer, h, s)


def test_layer_training_flops_equal_torchs_flop_count_of_a_block():
    # torch's FlopCounterMode counts every matmul of forward and backward; the math SDPA kernel
    # runs attention as matmuls, so the scores are counted too (the CPU flash kernel is not).
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from labkit.config import ModelConfig
    from labkit.model import Block

    b, s, h = 2, 64, 32
    block = Block(ModelConfig(seq_len=s, n_layer=1, n_head=4, d_model=h))
    x = torch.randn(b, s, h, requires_grad=True)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        block(x).sum().backward()
    assert counter.get_total_flops() == f.layer_training_flops(b, s, h, "full")


def test_mfu_reproduces_nanogpt_37_percent():
    # transformer_sizing.ipynb: forward+backward 874,944,921,600 FLOPs per 1024-token sequence,
    # 100 sequences per iteration in 0.755 s on one A100 at 312 TFLOP/s: "fraction of A100 used:
    # 37.14%".
    tokens_per_s = 100 * S / 0.755
    value = f.mfu(tokens_per_s, 874_944_921_600 / S, 312e12)
    assert round(value * 100, 2) == 37.14


def test_mfu_divides_by_every_device():
    one = f.mfu(1000.0, 6e9, 1e15)
    assert f.mfu(8000.0, 6e9, 1e15, n_devices=8) == pytest.approx(one)
    assert f.mfu(8000.0, 6e9, 1e15, n_devices=1) == pytest.approx(8 * one)


def test_training_flops_6nd_reproduces_nanogpt_3_46_days():
    # transformer_sizing.ipynb: 6·N·D with N = 124,337,664 and D = 300e9 tokens, on 8 A100s at
    # 312 TFLOP/s and an assumed 30% MFU: "time needed to train the model: 3.46 days".
    flops = f.training_flops(124_337_664, 300e9)
    assert flops == 6 * 124_337_664 * 300e9
    days = flops / (312e12 * 8 * 0.3) / 3600 / 24
    assert round(days, 2) == 3.46


# ---------------------------------------------------------------------------------------------
# Memory


def test_bytes_per_param_conventions():
    # facts.md "Memory" and the sources in BYTES_PER_PARAM_CONVENTIONS.
    assert f.bytes_per_param("fp32_adam") == 16
    assert f.bytes_per_param("mixed_adam_zero") == 16
    assert f.bytes_per_param("mixed_adam_fp32_grad_accum") == 20
    assert f.bytes_per_param("ml_engineering") == 18
    assert f.bytes_per_param("scaling_book") == 10
    for convention in f.BYTES_PER_PARAM_CONVENTIONS.values():
        assert sum(b for _, b in convention.parts) == convention.bytes_per_param
        assert convention.source
    assert f.model_state_bytes(1e9, "fp32_adam") == 16e9


def test_memory_breakdown_fp32_adamw_is_4_4_8():
    # Playbook: fp32 training with Adam keeps 4 + 4 + 8 bytes per parameter.
    m = f.memory_breakdown(1000)
    assert (m.parameters, m.gradients, m.optimizer_state, m.master_weights) == (4000, 4000, 8000, 0)
    assert m.total == 16_000 and m.bytes_per_param == 16


def test_memory_breakdown_mixed_precision_equals_zero_convention():
    m = f.memory_breakdown(
        1000, param_dtype="bf16", master_weights_dtype="float32", optimizer_state_dtype="fp32"
    )
    assert m.bytes_per_param == f.bytes_per_param("mixed_adam_zero")


def test_memory_breakdown_optimizers():
    assert f.memory_breakdown(10, optimizer="sgd").optimizer_state == 0
    assert f.memory_breakdown(10, optimizer="sgd_momentum").optimizer_state == 40
    assert f.memory_breakdown(10, param_dtype="bfloat16").total == 10 * (2 + 2 + 4)


def test_memory_breakdown_measured_against_torch_adamw():
    # PyTorch allocates AdamW's two moments at the first step(), in the parameter's dtype.
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    state = sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for k, t in s.items()
        if k in ("exp_avg", "exp_avg_sq")
    )
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    predicted = f.memory_breakdown(n)
    assert state == predicted.optimizer_state
    assert grads == predicted.gradients


def test_zero_figure_1():
    # ZeRO paper (arXiv 1910.02054) Figure 1: Ψ = 7.5B, N_d = 64, K = 12:
    # baseline 120 GB, P_os 31.4 GB, P_os+g 16.6 GB, P_os+g+p 1.9 GB.
    gb = [f.zero_memory_per_rank(7.5e9, stage, 64) / 1e9 for stage in (0, 1, 2, 3)]
    assert [round(x, 1) for x in gb] == [120.0, 31.4, 16.6, 1.9]


def test_zero_single_rank_is_plain_data_parallel():
    assert {f.zero_memory_per_rank(1e6, stage, 1) for stage in (0, 1, 2, 3)} == {16e6}


def test_korthikanti_gpt3_example():
    # Korthikanti et al. 2022: per layer s·b·h·(34 + 5·a·s/h); for GPT-3 175B (a = 96, s = 2048,
    # h = 12288) the quadratic coefficient 5·a·s/h is 80, so 114·s·b·h bytes per layer.
    s, b, h, a = 2048, 1, 12288, 96
    per_layer = f.activation_bytes_per_layer(s, b, h, a)
    assert per_layer == s * b * h * (34 + 5 * a * s / h) == 114 * s * b * h
    assert f.activation_bytes(96, s, b, h, a) == 96 * per_layer


def test_activation_variants():
    s, b, h, a = 128, 2, 64, 4
    sbh = s * b * h
    # selective recomputation / flash: the 34·sbh part stays, the s² part becomes O(s)
    flash = f.activation_bytes_per_layer(s, b, h, a, attention="flash")
    assert flash == 34 * sbh + 4 * a * s * b
    # fp32 without dropout (what a CPU run with dropout=0 stores): 16·4 bytes linear, 4·as²b
    fp32 = f.activation_bytes_per_layer(s, b, h, a, bytes_per_element=4, dropout=False)
    assert fp32 == 64 * sbh + 4 * a * s * s * b
    # doubling s doubles the linear part and quadruples the quadratic part
    s2 = f.activation_bytes_per_layer(2 * s, b, h, a)
    assert s2 == 2 * 34 * sbh + 4 * 5 * a * s * s * b


def test_activation_bytes_under_autocast():
    # bf16 autocast over fp32 parameters: the two LayerNorm inputs stay fp32 (+2·2·sbh), q, k and
    # v each save their own bf16 copy of the LayerNorm output (+2·2·sbh), and the bf16 copies of
    # the 12h² weight-matrix elements are saved (+24h²).
    s, b, h, a = 128, 2, 64, 4
    sbh = s * b * h
    kw = {"bytes_per_element": 2, "dropout": False, "attention": "flash"}
    assert f.activation_bytes_per_layer(s, b, h, a, **kw) == 32 * sbh + 4 * a * s * b
    mixed = f.activation_bytes_per_layer(s, b, h, a, autocast=True, **kw)
    assert mixed == 40 * sbh + 24 * h * h + 4 * a * s * b
    assert f.activation_bytes(3, s, b, h, a, autocast=True, **kw) == 3 * mixed
    with pytest.raises(ValueError, match="autocast"):
        f.activation_bytes_per_layer(s, b, h, a, bytes_per_element=4, autocast=True)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_activation_bytes_match_what_autograd_saves_in_a_block(autocast):
    # One labkit.model Block on the CPU, fp32 parameters and an fp32 input (the residual stream),
    # flash SDPA, no dropout: autograd saves the formula's bytes plus LayerNorm's mean and rstd
    # (2 LayerNorms × 2 statistics × 4·s·b bytes), to the byte.
    torch = pytest.importorskip("torch")
    from labkit.config import ModelConfig
    from labkit.model import Block

    s, b, h, a = 32, 4, 64, 4
    torch.manual_seed(0)
    block = Block(ModelConfig(seq_len=s, n_layer=1, n_head=a, d_model=h))
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(b, s, h, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast(
        "cpu", dtype=torch.bfloat16, enabled=autocast
    ):
        block(x)
    predicted = f.activation_bytes_per_layer(
        s, b, h, a, bytes_per_element=2 if autocast else 4, dropout=False, attention="flash",
        autocast=autocast,
    )
    assert sum(saved.values()) == predicted + 2 * 2 * 4 * s * b


# ---------------------------------------------------------------------------------------------
# Communication


def test_bus_bandwidth_factors_nccl_tests():
    # NCCL-tests doc/PERFORMANCE.md "Summary": all_reduce 2(n−1)/n; reduce_scatter, all_gather,
    # all_to_all (n−1)/n; broadcast, reduce 1.
    assert f.bus_bandwidth_factor("all_reduce", 8) == 1.75
    for c in ("all_gather", "reduce_scatter", "all_to_all"):
        assert f.bus_bandwidth_factor(c, 8) == 0.875
    assert f.bus_bandwidth_factor("broadcast", 8) == f.bus_bandwidth_factor("reduce", 8) == 1.0
    assert f.bus_bandwidth_factor("all_reduce", 1) == 0.0


def test_algbw_and_busbw():
    # 1 GB all-reduced in 0.1 s on 8 ranks: algbw 10 GB/s, busbw 17.5 GB/s
    assert f.algbw(1e9, 0.1) == pytest.approx(10e9)
    assert f.busbw(1e9, 0.1, "all_reduce", 8) == pytest.approx(17.5e9)


def test_ring_volumes():
    assert f.ring_allreduce_bytes_per_rank(1000, 4) == 1500
    assert f.ring_allreduce_bytes_per_rank(1000, 1) == 0
    # all-reduce = reduce-scatter + all-gather
    assert f.ring_allreduce_bytes_per_rank(1000, 4) == f.reduce_scatter_bytes_per_rank(
        1000, 4
    ) + f.allgather_bytes_per_rank(1000, 4)


def test_dp_overlap_matches_scaling_book_2200_tokens():
    # scaling-book gpus.md, "Data Parallelism": within an H100 node the per-GPU token batch must
    # exceed 990e12 / 450e9 = 2200 (many ranks, bf16 gradients).
    assert f.dp_min_tokens_per_rank(10**9, 990e12, 450e9) == pytest.approx(2200, rel=1e-6)
    assert f.dp_overlap_ratio(2200, 10**9, 990e12, 450e9) == pytest.approx(1.0, rel=1e-6)
    # twice the tokens, half the ratio; two ranks halve the (n−1)/n factor's 1 to 1/2
    assert f.dp_overlap_ratio(4400, 10**9, 990e12, 450e9) == pytest.approx(0.5, rel=1e-6)
    assert f.dp_min_tokens_per_rank(2, 990e12, 450e9) == pytest.approx(1100)
    assert f.dp_min_tokens_per_rank(1, 990e12, 450e9) == 0


def test_dp_exposed_comm_accumulation_amortises_but_does_not_hide():
    # H100 node (many ranks, bf16): 2200 tokens per micro-batch hide the all-reduce exactly.
    C, W, n = 990e12, 450e9, 10**9
    assert f.dp_exposed_comm_fraction(2200, 1, n, C, W) == pytest.approx(0.0, abs=1e-9)
    assert f.dp_exposed_comm_fraction(4400, 8, n, C, W) == 0.0
    # 1100 tokens: r = 2, one backward's worth exposed; the step computes 1.5·A backwards.
    assert f.dp_exposed_comm_fraction(1100, 1, n, C, W) == pytest.approx(1 / 2.5)
    assert f.dp_exposed_comm_fraction(1100, 4, n, C, W) == pytest.approx(1 / 7)
    # the same 4400 tokens per step: one micro-batch hides everything, four of 1100 do not
    assert f.dp_exposed_comm_fraction(4400, 1, n, C, W) == 0.0
    assert f.dp_exposed_comm_fraction(1100, 4, n, C, W) > 0.1
    # more accumulation: smaller share, never zero
    shares = [f.dp_exposed_comm_fraction(550, a, n, C, W) for a in (1, 2, 8, 64)]
    assert shares == sorted(shares, reverse=True) and shares[-1] > 0
    with pytest.raises(ValueError, match="grad_accum"):
        f.dp_exposed_comm_fraction(1100, 0, n, C, W)


# ---------------------------------------------------------------------------------------------
# Pipeline bubble


def test_bubble_conventions():
    # GPipe: idle share of the step (p−1)/(m+p−1); Narayanan et al. 2021: (p−1)/m, and
    # (p−1)/(v·m) with v interleaved chunks.
    assert f.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert f.bubble_overhead(4, 8) == pytest.approx(3 / 8)
    assert f.bubble_overhead(4, 8, v=2) == pytest.approx(3 / 16)
    assert f.bubble_fraction(4, 8, v=2) == pytest.approx(3 / 19)
    assert f.bubble_fraction(1, 8) == 0 == f.bubble_overhead(1, 8)


def test_bubble_conventions_describe_the_same_schedule():
    # fraction = overhead / (1 + overhead): bubble / (ideal + bubble)
    for p, m, v in [(2, 1, 1), (4, 8, 1), (8, 32, 4)]:
        o = f.bubble_overhead(p, m, v)
        assert f.bubble_fraction(p, m, v) == pytest.approx(o / (1 + o))


# ---------------------------------------------------------------------------------------------
# Roofline


def test_roofline_critical_intensities():
    # facts.md / scaling-book roofline.md: H100 ≈ 295 FLOPs/byte; H200 ≈ 206.
    assert round(f.critical_intensity(989e12, 3.35e12)) == 295
    assert round(f.critical_intensity(989e12, 4.8e12)) == 206


def test_roofline_attainable():
    C, BW = 100.0, 10.0
    assert f.roofline_attainable_flops(2, C, BW) == 20  # memory-bound
    assert f.roofline_attainable_flops(50, C, BW) == C  # compute-bound
    assert f.roofline_attainable_flops(f.critical_intensity(C, BW), C, BW) == C


# ---------------------------------------------------------------------------------------------
# Invalid input: a ValueError that names the argument


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda: f.gpt_params(0, 64, 2), "vocab_size"),
        (lambda: f.gpt_params(256, 64.0, 2), "d_model"),
        (lambda: f.gpt_params(256, 64, True), "n_layer"),
        (lambda: f.flops_per_token(-1, 2, 64, 32), "n_params"),
        (lambda: f.flops_per_token(1e6, 2, 64, 32, attention="sparse"), "attention"),
        (lambda: f.training_flops(1e6, math.inf), "tokens"),
        (lambda: f.layer_training_flops(1, 0, 64), "^s=0 is not allowed"),
        (lambda: f.layer_training_flops(1, 64, 64, attention="flash"), "attention"),
        (lambda: f.mfu(1000, 6e9, None), "peak_flops_per_s"),
        (lambda: f.mfu(1000, 6e9, 0), "peak_flops_per_s"),
        (lambda: f.mfu(1000, 6e9, 1e12, n_devices=0), "n_devices"),
        (lambda: f.bytes_per_param("fp8_adam"), "convention"),
        (lambda: f.memory_breakdown(10, optimizer="lion"), "optimizer"),
        (lambda: f.memory_breakdown(10, param_dtype="tf32"), "dtype"),
        (lambda: f.activation_bytes_per_layer(0, 1, 64, 4), "seq_len"),
        (lambda: f.activation_bytes_per_layer(8, 1, 64, 4, attention="sdpa"), "attention"),
        (lambda: f.bus_bandwidth_factor("allreduce", 8), "collective"),
        (lambda: f.bus_bandwidth_factor("all_reduce", 0), "n_ranks"),
        (lambda: f.algbw(1e6, 0), "seconds"),
        (lambda: f.bubble_fraction(0, 8), "p"),
        (lambda: f.bubble_overhead(4, 0), "m"),
        (lambda: f.bubble_overhead(4, 8, v=0), "v"),
        (lambda: f.zero_memory_per_rank(1e9, 4, 8), "stage"),
        (lambda: f.zero_memory_per_rank(1e9, 1, 0), "n_ranks"),
        (lambda: f.dp_overlap_ratio(0, 8, 1e15, 1e11), "tokens_per_rank"),
        (lambda: f.critical_intensity(1e15, 0), "bandwidth_bytes_per_s"),
    ],
)
def test_invalid_input_names_the_argument(call, argument):
    with pytest.raises(ValueError, match=argument):
        call()


def test_mfu_without_peak_says_why():
    with pytest.raises(ValueError, match="no published peak"):
        f.mfu(1000, 6e9, None)


def test_dtype_names():
    torch = pytest.importorskip("torch")
    assert f.dtype_bytes(torch.bfloat16) == f.dtype_bytes("bf16") == 2
    assert f.dtype_bytes(torch.float32) == f.dtype_bytes("fp32") == 4
    with pytest.raises(ValueError, match="float32"):
        f.dtype_bytes("tf32")


def test_bucket_count_is_greedy_and_never_splits_a_tensor():
    assert f.bucket_count([], 10) == 0
    assert f.bucket_count([4, 4, 4], 10) == 1  # 12 bytes, closed at the end
    assert f.bucket_count([4, 6, 4], 10) == 2  # 4+6 reaches the cap and closes
    assert f.bucket_count([25, 1], 10) == 2  # a tensor over the cap fills one alone
    assert f.bucket_count([3] * 10, 10) == 3  # 12, 12, 6: ceil(30/10) is 3 as well
    assert f.bucket_count([9, 2, 9, 2], 10) == 2  # not ceil(22/10) = 3: order matters
    with pytest.raises(ValueError, match="cap_bytes"):
        f.bucket_count([1], 0)


def test_dp_exposed_comm_is_u_shaped_in_the_bucket_size():
    # Worked by hand: n = 2 (a ring all-reduce costs 2α + S/β), α = 1 ms, β = 1 GB/s,
    # 100 MB of gradients, backward 0.2 s.
    alpha, beta, S, bwd = 1e-3, 1e9, 100e6, 0.2
    one = f.dp_exposed_comm_s([S], bwd, 2, alpha, beta)
    assert one == pytest.approx(2e-3 + 0.1)  # everything after backward
    # 4 buckets of 25 MB, full at 0.05, 0.10, 0.15, 0.20 s, each 27 ms: ends at 0.227 s
    four = f.dp_exposed_comm_s([S / 4] * 4, bwd, 2, alpha, beta)
    assert four == pytest.approx(0.027)  # only the last bucket is exposed
    # 1000 buckets of 0.1 MB, each 2.1 ms > the 0.2 ms between them: latency-bound, the
    # all-reduces queue up from the first (full at 0.2 ms) and end at 0.0002 + 1000 · 0.0021
    many = f.dp_exposed_comm_s([S / 1000] * 1000, bwd, 2, alpha, beta)
    assert many == pytest.approx(0.0002 + 2.1 - 0.2)
    assert four < one < many


def test_dp_exposed_comm_uses_the_ring_time_and_edge_cases():
    # n = 4: one bucket after backward costs 2(n−1)·α + 2(n−1)/n · S/β (ring_allreduce_time)
    assert f.dp_exposed_comm_s([8e6], 1.0, 4, 1e-4, 1e9) == pytest.approx(
        f.ring_allreduce_time(8e6, 4, 1e-4, 1e9)) == pytest.approx(6e-4 + 1.5 * 8e-3)
    assert f.dp_exposed_comm_s([8e6, 8e6], 1.0, 1, 1e-4, 1e9) == 0.0  # one rank: no traffic
    assert f.dp_exposed_comm_s([], 1.0, 2, 1e-4, 1e9) == 0.0
    # no backward time at all: nothing to hide behind, every bucket is exposed in turn
    assert f.dp_exposed_comm_s([1e6, 1e6], 0.0, 2, 1e-4, 1e9) == pytest.approx(2 * (2e-4 + 1e-3))
    with pytest.raises(ValueError, match="bucket_bytes"):
        f.dp_exposed_comm_s([-1.0], 1.0, 2, 1e-4, 1e9)
    with pytest.raises(ValueError, match="backward_s"):
        f.dp_exposed_comm_s([1.0], -1.0, 2, 1e-4, 1e9)


# ---------------------------------------------------------------------------------------------
# What a whole model saves beyond the per-layer formula


def test_activation_bytes_omitted_terms():
    L, s, b, h, V = 2, 64, 8, 64, 256
    sb, sbh = s * b, s * b * h
    fp32 = f.activation_bytes_omitted(L, s, b, h, V)
    assert fp32.as_dict() == {
        "final LayerNorm input": 4 * sbh,
        "output head input (final LayerNorm output)": 4 * sbh,
        "output head 16-bit weight copy": 0,
        "log-softmax output": 4 * sb * V,
        "LayerNorm statistics": 5 * 2 * 4 * sb,
        "token and position ids": 2 * 8 * sb + 8 * s,
        "loss total_weight": 4,
    }
    assert fp32.total == 815_620  # the gap notebook 01 measured at the smoke size, float32
    mixed = f.activation_bytes_omitted(L, s, b, h, V, bytes_per_element=2, autocast=True)
    # the residual stream stays float32; the head's input and weight copy are bf16
    assert (mixed.final_norm_input, mixed.head_input, mixed.head_weight_copy) == (
        4 * sbh, 2 * sbh, 2 * V * h)
    assert mixed.total == 782_852
    no_pos = f.activation_bytes_omitted(L, s, b, h, V, learned_positions=False)
    assert fp32.total - no_pos.total == 8 * s
    with pytest.raises(ValueError, match="autocast"):
        f.activation_bytes_omitted(L, s, b, h, V, bytes_per_element=4, autocast=True)
    with pytest.raises(ValueError, match="vocab_size"):
        f.activation_bytes_omitted(L, s, b, h, 0)


@pytest.mark.parametrize(
    ("dtype", "sdpa"),
    [("float32", "flash"), ("bfloat16", "flash"), ("float32", "materialized")],
    ids=["fp32-flash", "bf16-autocast-flash", "fp32-math"],
)
def test_whole_gpt_activations_close_to_the_byte(dtype, sdpa):
    # labkit.model.GPT on the CPU, dropout off: activation_bytes (the blocks) plus
    # activation_bytes_omitted (the rest) is exactly what autograd saves for backward.
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from labkit.config import ModelConfig
    from labkit.model import GPT

    s, b, h, a, layers = 32, 3, 64, 4, 2
    cfg = ModelConfig(seq_len=s, n_layer=layers, n_head=a, d_model=h)
    torch.manual_seed(0)
    model = GPT(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    backend = SDPBackend.FLASH_ATTENTION if sdpa == "flash" else SDPBackend.MATH
    mixed = dtype != "float32"
    with sdpa_kernel(backend), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
        model(x, torch.roll(x, -1, 1))
    e = 2 if mixed else 4
    layers_bytes = f.activation_bytes(layers, s, b, h, a, bytes_per_element=e, dropout=False,
                                      attention=sdpa, autocast=mixed)
    rest = f.activation_bytes_omitted(layers, s, b, h, cfg.vocab_size, bytes_per_element=e,
                                      autocast=mixed)
    assert sum(saved.values()) == layers_bytes + rest.total


# ---------------------------------------------------------------------------------------------
# The α–β model


def test_alpha_beta_time_and_its_ring_all_reduce():
    assert f.alpha_beta_time(1e6, 1e-5, 1e9) == pytest.approx(1e-5 + 1e-3)
    assert f.alpha_beta_time(1e6, 1e-5, 1e9, messages=4) == pytest.approx(4e-5 + 1e-3)
    # 4 ranks: 6 steps of S/4 each, S = 8 MB at 1 GB/s and 10 µs per message
    assert f.ring_allreduce_time(8e6, 4, 1e-5, 1e9) == pytest.approx(6e-5 + 1.5 * 8e6 / 1e9)
    assert f.ring_allreduce_time(8e6, 2, 0.0, 1e9) == pytest.approx(8e-3)  # 2 ranks send S
    assert f.ring_allreduce_time(8e6, 1, 1e-5, 1e9) == 0.0
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s"):
        f.alpha_beta_time(1, 0, 0)
    with pytest.raises(ValueError, match="messages"):
        f.alpha_beta_time(1, 0, 1, messages=0)


def test_alpha_beta_fit_recovers_the_line_it_was_given():
    alpha, beta = 2e-5, 3e9
    small, big = 4, 2**22
    a, b = f.alpha_beta_fit(small, f.alpha_beta_time(small, alpha, beta), big,
                            f.alpha_beta_time(big, alpha, beta))  # fmt: skip
    assert a == pytest.approx(alpha) and b == pytest.approx(beta)
    # a small message measured faster than the line: α is clamped at 0, never negative
    assert f.alpha_beta_fit(1000, 0.0, 2000, 1.0)[0] == 0.0
    with pytest.raises(ValueError, match="must be larger and take longer"):
        f.alpha_beta_fit(4, 1e-3, 2**20, 1e-4)  # the big message came out faster


def test_a_flat_ring_across_nodes_runs_at_the_network_and_a_hierarchy_sends_1_over_g_of_it():
    S, nvlink, nic = 14e9, 450e9, 50e9  # 7B parameters of bf16 gradients; H100 NVLink; NDR
    one_node = f.multinode_allreduce_time(S, 1, 8, intra_bytes_per_s=nvlink, inter_bytes_per_s=nic)
    assert one_node == pytest.approx(2 * 7 / 8 * S / nvlink)  # no network in the ring
    flat = f.multinode_allreduce_time(S, 2, 8, intra_bytes_per_s=nvlink, inter_bytes_per_s=nic)
    assert flat == pytest.approx(2 * 15 / 16 * S / nic)  # every step waits for the NIC hop
    tiered = f.multinode_allreduce_time(S, 2, 8, intra_bytes_per_s=nvlink, inter_bytes_per_s=nic,
                                        hierarchical=True)  # fmt: skip
    assert tiered == pytest.approx(2 * 7 / 8 * S / nvlink + 2 * 1 / 2 * (S / 8) / nic)
    assert one_node < tiered < flat
    # one GPU per node: both are the same ring over the network
    assert f.multinode_allreduce_time(S, 4, 1, intra_bytes_per_s=nvlink, inter_bytes_per_s=nic,
                                      hierarchical=True) == pytest.approx(
        f.multinode_allreduce_time(S, 4, 1, intra_bytes_per_s=nvlink, inter_bytes_per_s=nic))
    with pytest.raises(ValueError, match="nodes"):
        f.multinode_allreduce_time(S, 0, 8, intra_bytes_per_s=nvlink, inter_bytes_per_s=nic)


def test_youngs_interval_balances_saving_against_losing_work():
    # Llama 3 405B: 419 unexpected interruptions in 54 days (arXiv 2407.21783, section 3.3.4)
    mtbf = 54 * 86400 / 419
    tau = f.young_checkpoint_interval(60.0, mtbf)
    assert tau == pytest.approx(math.sqrt(2 * 60 * mtbf))
    best = f.checkpoint_waste_fraction(tau, 60.0, mtbf)
    assert best == pytest.approx(2 * 60 / tau)  # at the optimum both terms are equal
    for other in (tau / 3, tau * 3):  # any other interval wastes more
        assert f.checkpoint_waste_fraction(other, 60.0, mtbf) > best
    assert f.checkpoint_waste_fraction(tau, 60.0, mtbf, restart_s=600) == pytest.approx(
        best + 600 / mtbf)
    with pytest.raises(ValueError, match="mtbf_s"):
        f.young_checkpoint_interval(60.0, 0)


# ---------------------------------------------------------------------------------------------
# Recomputation and the largest micro-batch (formulas.recompute, formulas.max_batch), from
# plain sizes: no ModelConfig, as a layer-0 formula takes them.

TINY = types.SimpleNamespace(n_layer=4, n_head=2, d_model=8, seq_len=16, vocab_size=256,
                             dropout=0.0, tie_weights=True)  # fmt: skip


def test_the_moved_predictions_are_the_ones_their_old_modules_export():
    from labkit.batching import finder, recomputation
    from labkit.formulas import max_batch, pipeline, recompute

    for name in ("AC_MODES", "ELEMENTWISE_FLOPS_PER_TOKEN_PER_LAYER", "CheckpointPrediction",
                 "RecomputePrediction", "predict_checkpointing", "predict_recompute",
                 "paper_bytes_per_layer", "segment_checkpoint_bytes"):
        assert getattr(recomputation, name) is getattr(recompute, name)
    assert recomputation.one_f_one_b_in_flight is pipeline.one_f_one_b_in_flight
    for name in ("OMISSIONS", "BatchPrediction", "predict_max_batch"):
        assert getattr(finder, name) is getattr(max_batch, name)


def test_a_formula_refuses_a_dtype_no_run_trains_in():
    from labkit import config, dtypes
    from labkit.formulas.activations import training_dtype

    assert config.DTYPES is dtypes.TRAINING  # one table: config and the formulas read it
    assert training_dtype("bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match=r"dtype='fp8' is not allowed: give one of \('float32'"):
        training_dtype("fp8")


def test_checkpointing_every_other_block_keeps_two_inputs_instead_of_two_layers():
    # Chen et al. 2016: a checkpointed block keeps only its input, the float32 residual s·b·h·4.
    p = f.predict_checkpointing(TINY, 2, 2)
    per_layer = f.activation_bytes_per_layer(16, 2, 8, 2, bytes_per_element=4, dropout=False,
                                             attention="flash")  # fmt: skip
    assert (p.checkpointed, p.input_bytes, p.per_layer_bytes) == (2, 16 * 2 * 8 * 4, per_layer)
    assert p.saved_bytes == 2 * per_layer + 2 * 1024
    assert p.saving_bytes == 2 * (per_layer - 1024)
    assert p.recompute_fraction == 0.5
    assert f.predict_checkpointing(TINY, 2, None).saving_bytes == 0
    with pytest.raises(ValueError, match="the model's context is 16 tokens"):
        f.predict_checkpointing(TINY, 2, 1, seq_len=17)
    with pytest.raises(ValueError, match="dtype='fp16' is not allowed"):
        f.predict_checkpointing(TINY, 2, 1, dtype="fp16")


def test_full_recompute_keeps_the_block_input_and_reruns_all_but_the_last_matmul():
    s, b, h, layers = 16, 2, 8, 4
    p = f.predict_recompute(TINY, b, "full")
    assert p.per_layer_bytes == 4 * s * b * h
    assert p.recompute_flops_per_token == layers * (16 * h * h + 4 * h * s)
    step = f.flops_per_token(f.gpt_params(256, h, layers, tied=True), layers, h, s,
                             attention="full")  # fmt: skip
    assert p.flops_factor == 1 + p.recompute_flops_per_token / step
    sel = f.predict_recompute(TINY, b, "selective")
    assert sel.recompute_flops_per_token == layers * f.ELEMENTWISE_FLOPS_PER_TOKEN_PER_LAYER * h
    assert f.predict_recompute(TINY, b, "none").saving_bytes == 0
    with pytest.raises(ValueError, match="mode='partial' is not allowed"):
        f.predict_recompute(TINY, b, "partial")


def test_korthikanti_bytes_per_layer_under_each_mode():
    # arXiv 2205.05198, section 4: s·b·h·(34 + 5·a·s/h), 34·s·b·h selective, 2·s·b·h full.
    s, b, h, a = 16, 2, 8, 2
    assert f.paper_bytes_per_layer(s, b, h, a, "none") == s * b * h * (34 + 5 * a * s / h)
    assert f.paper_bytes_per_layer(s, b, h, a, "selective") == 34 * s * b * h
    assert f.paper_bytes_per_layer(s, b, h, a, "full") == 2 * s * b * h


def test_segments_of_sqrt_n_layers_hold_k_inputs_and_one_segment():
    # Chen et al. 2016, section 4: k·input + ⌈n/k⌉·layer; 9 layers in 3 segments.
    assert f.segment_checkpoint_bytes(9, 10, 1, 3) == 3 * 1 + 3 * 10
    assert f.segment_checkpoint_bytes(9, 10, 1, None) == 90
    assert f.segment_checkpoint_bytes(9, 10, 1, 4) == 4 * 1 + 3 * 10


def test_one_f_one_b_stages_hold_p_minus_i_micro_batches():
    # Narayanan et al. 2021, section 2.2: stage i runs p - i forwards before its first backward.
    assert f.one_f_one_b_in_flight(4, 8) == [4, 3, 2, 1]
    assert f.one_f_one_b_in_flight(4, 2) == [2, 2, 2, 1]


def test_the_predicted_max_batch_is_the_last_that_fits_its_affine_peak():
    budget = 2**22
    p = f.predict_max_batch(TINY, budget)
    states = f.memory_breakdown(f.gpt_params(256, 8, 4, seq_len=16, tied=True),
                                param_dtype="float32", optimizer="adamw").total  # fmt: skip
    assert p.model_state_bytes == states
    assert p.logits_bytes_per_sequence == 16 * 256 * 4
    assert p.batch >= 1 and p.peak_bytes(p.batch) <= budget < p.peak_bytes(p.batch + 1)
    assert p.omissions == f.OMISSIONS
    with pytest.raises(ValueError, match="is below one micro-batch"):
        f.predict_max_batch(TINY, states)
    with pytest.raises(ValueError, match="the model's context is seq_len=16 tokens"):
        f.predict_max_batch(TINY, budget, seq_len=17)
