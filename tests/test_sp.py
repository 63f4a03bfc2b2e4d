"""Sequence parallelism: the paper's formulas, and 2 gloo ranks against one process.

Unit tests: Table 2 of Korthikanti et al. 2022 (arXiv 2205.05198) and its generalisation,
the per-rank prediction for labkit's GPT, validation. One 2-rank launch (slow) covers plain
TP, ours (with and without re-gathering) and DTensor's ``SequenceParallel``: losses, first-step
gradients and parameters after 3 AdamW steps against one process (tolerances as in
tests/test_tp_parity.py, for the same reasons), the bytes autograd saved on each rank against
the prediction to the byte, and the collectives counted against the formula.
"""

from __future__ import annotations

import copy

import pytest
import torch
from one_process import train_one_process

from labkit import data, formulas, memory
from labkit.config import ModelConfig
from labkit.jobs import launch
from labkit.model import GPT
from labkit.parallel import comm, sequence
from labkit.workers import sp_train

N = 2
B, STEPS, SEED = 4, 3, 0
CFG = ModelConfig(**sp_train.DEFAULT_MODEL)


# --- formulas -----------------------------------------------------------------------------------


def test_table_2_rows_for_gpt3_sizes():
    # GPT-3 175B in the paper's section 5: a = 96, s = 2048, h = 12288 (5as/h = 80), t = 8.
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    assert sequence.paper_activation_bytes_per_layer(s, b, h, a, t) == pytest.approx(
        sbh * (10 + 24 / 8 + 80 / 8)
    )
    assert sequence.paper_activation_bytes_per_layer(
        s, b, h, a, t, sequence_parallel=True
    ) == pytest.approx(sbh * (34 / 8 + 80 / 8))
    # t = 1: both rows are equation 1, s·b·h·(34 + 5as/h).
    for sp in (False, True):
        assert sequence.paper_activation_bytes_per_layer(
            s, b, h, a, 1, sequence_parallel=sp
        ) == pytest.approx(sbh * (34 + 80))


@pytest.mark.parametrize(
    "s,b,h,a,t", [(2048, 1, 12288, 96, 8), (128, 4, 128, 4, 2), (512, 8, 512, 8, 4)]
)
def test_generalised_formula_reduces_to_table_2_and_saves_10_sbh(s, b, h, a, t):
    for sp in (False, True):
        assert sequence.layer_activation_bytes(
            s, b, h, a, t, sequence_parallel=sp
        ) == pytest.approx(
            sequence.paper_activation_bytes_per_layer(s, b, h, a, t, sequence_parallel=sp)
        )
    saving = sequence.paper_activation_bytes_per_layer(
        s, b, h, a, t
    ) - sequence.paper_activation_bytes_per_layer(s, b, h, a, t, sequence_parallel=True)
    assert saving == pytest.approx(10 * s * b * h * (1 - 1 / t))
    # Keeping the gathered input (regather=False) keeps 2·e = 4 of those 10 whole.
    keep = sequence.layer_activation_bytes(s, b, h, a, t, sequence_parallel=True, regather=False)
    assert keep - sequence.layer_activation_bytes(
        s, b, h, a, t, sequence_parallel=True
    ) == pytest.approx(4 * s * b * h * (1 - 1 / t))


def test_generalised_formula_at_t1_is_the_course_per_layer_formula():
    kw = dict(bytes_per_element=4, dropout=False, attention="flash")
    assert sequence.layer_activation_bytes(
        32, 4, 64, 4, 1, **kw
    ) == formulas.activation_bytes_per_layer(32, 4, 64, 4, **kw)
    assert sequence.layer_activation_bytes(32, 4, 64, 4, 1) == formulas.activation_bytes_per_layer(
        32, 4, 64, 4
    )  # the paper's 16-bit defaults


@pytest.mark.parametrize("mode", sequence.MODES)
def test_prediction_for_one_rank_is_the_single_process_prediction(mode):
    assert sum(sequence.predicted_activations_per_rank(CFG, B, 1, mode=mode).values()) == sum(
        memory.predicted_activations(CFG, B).values()
    )


def test_cuda_prediction_adds_the_attention_rng_state_per_layer():
    # Measured on an H200 (torch 2.11, float32, one process): the memory-efficient SDPA kernel
    # saves two int64 scalars (seed, offset) per call; the flash path on the CPU saves none.
    for mode in sequence.MODES:
        cpu = sequence.predicted_activations_per_rank(CFG, B, N, mode=mode)
        cuda = sequence.predicted_activations_per_rank(CFG, B, N, mode=mode, device_type="cuda")
        assert sum(cuda.values()) - sum(cpu.values()) == 16 * CFG.n_layer


def test_prediction_orders_the_modes_and_the_saving_is_the_replicated_part():
    tp, sp, keep = (
        sum(sequence.predicted_activations_per_rank(CFG, B, N, mode=m).values())
        for m in ("tp", "sp", "sp_keep_gathered")
    )
    s, b, h, L = CFG.seq_len, B, CFG.d_model, CFG.n_layer
    # fp32, no dropout: per layer 4e·sbh replicated (LayerNorm inputs 2e, q/k/v and MLP
    # inputs 2e) and 2·2·4·sb of LayerNorm statistics; outside, ln_f's input and statistics.
    per_layer = 16 * s * b * h + 16 * s * b
    assert tp - sp == (L * per_layer + 4 * s * b * h + 8 * s * b) * (N - 1) // N
    assert keep - sp == L * 8 * s * b * h * (N - 1) // N
    assert sp < keep < tp


def test_replacing_collectives_send_what_the_allreduces_sent():
    tp = sequence.collectives_per_step(CFG, B, N, mode="tp")["all_reduce"]
    sp = sequence.collectives_per_step(CFG, B, N, mode="sp")
    S = B * CFG.seq_len * CFG.d_model * 4
    replaced = 4 * CFG.n_layer  # all-gathers and reduce-scatters standing for the all-reduces
    assert sp["reduce_scatter"]["calls"] == replaced == tp["calls"]
    assert 2 * replaced * comm.sent_per_rank("all_gather", S, N) == tp["sent_per_rank"]
    # and the extra gathers: 2 per layer re-gathered, 2 at the embedding and the head
    assert sp["all_gather"]["calls"] == replaced + 2 * CFG.n_layer + 2


def test_bad_input_raises_before_launch():
    with pytest.raises(ValueError, match="n_head"):
        sequence.validate_sequence_parallel(CFG, 3)
    with pytest.raises(ValueError, match="seq_len=30"):
        sequence.validate_sequence_parallel(CFG, 4, seq_len=30)
    with pytest.raises(ValueError, match="mode"):
        sequence.predicted_activations_per_rank(CFG, B, N, mode="ring")
    with pytest.raises(ValueError, match="device_type"):
        sequence.predicted_activations_per_rank(CFG, B, N, device_type="tpu")
    with pytest.raises(ValueError, match="t=0"):
        sequence.paper_activation_bytes_per_layer(128, 1, 64, 4, 0)


def test_one_rank_equals_the_model_and_saves_what_is_predicted():
    """Without a process group (one rank) the hooks, g/ḡ and the fused re-gather are wired
    to give the model's own loss and gradients."""
    torch.manual_seed(SEED)
    ref = GPT(CFG)
    model = sequence.apply_sequence_parallel(copy.deepcopy(ref), world_size=1, rank=0)
    x, y = data.fixed_batches(CFG.seq_len, B, 1, SEED)[0]
    _, l_ref = ref(x, y)
    _, loss = model(x, y)
    l_ref.backward()
    loss.backward()
    sequence.sync_sequence_parallel_grads(model)
    assert loss.item() == pytest.approx(l_ref.item(), abs=1e-6)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-6, rtol=1e-5, msg=name)
    assert sequence.saved_activation_bytes(model, (x, y)) == sum(
        sequence.predicted_activations_per_rank(CFG, B, 1).values()
    )


# --- 2 ranks against one process ------------------------------------------------------------------


@pytest.fixture(scope="module")
def job():
    return launch.run(sp_train.SPTrainConfig(batch_size=B, steps=STEPS, seed=SEED, grad_clip=1.0),
                      nproc=N, timeout_s=240, stream=False)  # fmt: skip


@pytest.fixture(scope="module")
def reference():
    return train_one_process(CFG, data.fixed_batches(CFG.seq_len, B, STEPS, SEED), seed=SEED,
                             micro_batch=B)  # fmt: skip


@pytest.mark.slow
def test_sequence_parallel_gpt_matches_one_process(job, reference):
    ref_losses, ref_grads, ref_params = reference
    for impl in ("ours", "dtensor"):
        for r in range(N):
            assert job.ranks[r][impl]["losses"] == pytest.approx(ref_losses, abs=1e-5), impl
        saved = torch.load(job.log_dir / f"sp_{impl}_params.pt")
        assert set(saved["params"]) == set(saved["first_grads"]) == set(ref_params)
        for name, ref in ref_grads.items():
            torch.testing.assert_close(saved["first_grads"][name], ref, atol=1e-6, rtol=1e-4,
                                       msg=f"{impl} {name}")  # fmt: skip
        for name, ref in ref_params.items():
            torch.testing.assert_close(saved["params"][name], ref, atol=1e-4, rtol=0,
                                       msg=f"{impl} {name}")  # fmt: skip
    torch.manual_seed(SEED)
    init = dict(GPT(CFG).named_parameters())  # the parameters moved
    assert not torch.allclose(saved["params"]["blocks.0.ln_1.weight"], init["blocks.0.ln_1.weight"])


@pytest.mark.slow
def test_saved_activations_per_rank_are_the_prediction_to_the_byte(job):
    modes = {
        "tp": "tp",
        "ours": "sp",
        "ours_keep_gathered": "sp_keep_gathered",
        "dtensor": "sp_keep_gathered",
    }  # DTensor's plan keeps the gathered input
    for r in range(N):
        got = {part: job.ranks[r][part]["saved_bytes"] for part in modes}
        for part, mode in modes.items():
            assert got[part] == sum(sequence.predicted_activations_per_rank(
                CFG, B, N, mode=mode).values()), part  # fmt: skip
        assert got["ours"] < got["ours_keep_gathered"] < got["tp"]


@pytest.mark.slow
def test_gathers_and_reduce_scatters_send_what_tp_allreduces_sent(job):
    L = CFG.n_layer
    for r in range(N):
        tp = job.ranks[r]["tp"]["counted"]
        ours = job.ranks[r]["ours"]["counted"]
        tp_sent = comm.sent_per_rank("all_reduce", tp["forward_bytes"] + tp["backward_bytes"], N)
        extra = ours["extra_bytes"]
        replacing = {k: v for k, v in ours["bytes"].items() if not k.startswith("all_reduce")}
        replacing["all_gather forward"] -= extra["boundary"] // 2
        replacing["all_gather backward"] -= extra["regather"] + extra["boundary"] // 2
        assert sequence.ring_sent_per_rank(replacing, N) == tp_sent > 0
        # the rest, as the formula counts it
        formula = sequence.collectives_per_step(CFG, B, N, mode="sp")
        for kind, row in formula.items():
            calls = sum(v for k, v in ours["calls"].items() if k.startswith(kind))
            sent = sequence.ring_sent_per_rank(
                {k: v for k, v in ours["bytes"].items() if k.startswith(kind)}, N
            )
            assert (calls, sent) == (row["calls"], row["sent_per_rank"]), kind
        # CommDebugMode saw the same calls as our counter
        seen = job.ranks[r]["ours"]["collectives"]
        for kind, row in formula.items():
            assert sum(seen[p].get(kind, 0) for p in seen) == row["calls"], kind
        # DTensor: the same all-gathers and reduce-scatters as ours without re-gathering, and
        # one all-reduce per LayerNorm weight and bias (Partial gradients replicated)
        dt = job.ranks[r]["dtensor"]["collectives"]
        keep = sequence.collectives_per_step(CFG, B, N, mode="sp_keep_gathered")
        for kind in ("all_gather", "reduce_scatter"):
            assert sum(dt[p].get(kind, 0) for p in dt) == keep[kind]["calls"], kind
        assert sum(dt[p].get("all_reduce", 0) for p in dt) == 4 * L + 2
