"""Notebook 03c's read-outs (labkit.parallel.sequence_costs, context, expert and the workers
sp_train, cp_attention, moe_train): what each describe() prints for given measurements, and which
sentence the numbers choose. Pure inputs: nothing here launches a job (fake jobs hold the
per-rank dicts the workers return); one test trains a tiny GPT in-process for the parity read-out.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from types import SimpleNamespace

import matplotlib
import pytest
import torch

from labkit import config, data
from labkit.model import GPT
from labkit.parallel import context as cp
from labkit.parallel import expert, sequence
from labkit.train import make_optimizer
from labkit.workers import cp_attention, moe_train, sp_train

matplotlib.use("Agg")

MiB = 2**20
SMOKE = config.ModelConfig(seq_len=32, n_layer=4, n_head=4, d_model=64)
S = 4 * 32 * 64 * 4  # one (b, s, h) fp32 activation of the smoke model at b = 4


def _job(ranks, log_dir=Path("."), cfg=None):
    return SimpleNamespace(ranks=ranks, rank=lambda r: ranks[r], log_dir=log_dir, config=cfg or {})


# --- sequence_costs: the predictions ------------------------------------------------------------


def test_table2_at_scale_says_dominates_only_where_the_attention_term_holds_most():
    text = sequence.table2_at_scale("one GPT-3 175B layer", s=2048, b=1, h=12288, a=96,
                                    ts=(8, 2)).describe()  # fmt: skip
    assert text.splitlines() == [
        "predicted (Table 2), one GPT-3 175B layer, t = 8, b = 1, per GPU: TP 552 MiB, TP+SP "
        "342 MiB (38% less)",
        "predicted (Table 2), the same layer at t = 2: TP 1,488 MiB, TP+SP 1,368 MiB (8% less: "
        "the s×s attention term, 5·a·s/h = 80, dominates)"]


def test_layer_prediction_prints_both_countings_and_the_saving():
    lines = sequence.layer_prediction(SMOKE, 4, 2).describe().splitlines()
    assert lines[0] == "predicted, one layer of this GPT (s=32, b=4, h=64, a=4), t = 2, per rank:"
    assert lines[2] == "TP      " + f"{'216':>32} KiB" + f"{'321':>34} KiB"
    assert lines[3] == "TP+SP   " + f"{'176':>32} KiB" + f"{'257':>34} KiB"
    assert lines[4] == "predicted: sequence parallelism saves 20% of a layer of this GPT per rank"


def test_predict_layouts_tables_activations_and_collectives():
    lines = sequence.predict_layouts(SMOKE, 4, 2).describe().splitlines()
    assert lines[0] == "predicted bytes autograd saves per rank in one forward (b=4, t=2, ranks on cpu):"
    assert lines[10] == f"{'total':40}{'1,522,948':>22}{'1,370,884':>22}{'1,239,812':>22}"
    assert lines[13] == "  TP                    all_reduce       16 calls   S   0.500 MiB   sent   0.500 MiB"
    assert lines[-1] == "  TP+SP                 all_reduce        1 calls   S   0.006 MiB   sent   0.006 MiB"
    cuda = sequence.predict_layouts(SMOKE, 4, 2, device_type="cuda")
    assert "attention RNG seed and offset (CUDA)" in cuda.describe()


# --- sp_train: the job's read-outs --------------------------------------------------------------

PREDICTED = {"tp": 1_522_948, "ours_keep_gathered": 1_370_884, "ours": 1_239_812,
             "dtensor": 1_370_884}


def _tp_counted():
    return {"forward_calls": 8, "backward_calls": 8, "forward_bytes": 8 * S, "backward_bytes": 8 * S}


def _sp_counted(regather):
    bwd_gathers = 17 if regather else 9
    calls = {"all_gather forward": 9, "reduce_scatter forward": 8,
             "all_gather backward": bwd_gathers, "reduce_scatter backward": 8,
             "all_reduce backward": 1}
    extra = {"boundary": 2 * S, "regather": (8 if regather else 0) * S, "parameter gradients": 6656}
    return {"calls": calls,
            "bytes": {k: (6656 if k.startswith("all_reduce") else c * S) for k, c in calls.items()},
            "extra_bytes": extra,
            "extra_calls": {"boundary": 2, "regather": 8 if regather else 0, "parameter gradients": 1}}


def _sp_rank(r, saved=PREDICTED, device="cpu"):
    both = {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 8}}
    sp = {"forward": {"all_gather": 9, "reduce_scatter": 8},
          "backward": {"all_gather": 17, "reduce_scatter": 8, "all_reduce": 1}}
    out = {"rank": r, "world_size": 2, "device": device}
    for part in PREDICTED:
        out[part] = {"saved_bytes": saved[part], "collectives": both if part == "tp" else sp}
    out["tp"]["counted"] = _tp_counted()
    out["ours"]["counted"] = _sp_counted(True)
    out["ours_keep_gathered"]["counted"] = _sp_counted(False)
    return out


def test_saved_activations_table_and_the_sentence_the_bytes_choose():
    res = sp_train.saved_activations(_job([_sp_rank(0), _sp_rank(1)]), SMOKE, 4)
    lines = res.describe().splitlines()
    assert lines[0] == "bytes autograd saved per rank in one forward (ranks on cpu):"
    assert lines[2] == (f"{'TP':22}{'1,522,948':>14}{'1,522,948':>18}{'1,522,948':>18}{'+0':>22}")
    assert lines[-1] == ("measured: TP+SP's saved activations are smaller than TP's: 1,239,812 B "
                         "against 1,522,948 B per rank, 283,136 B (19%) saved, equal to the "
                         "prediction to the byte (283,136 B)")
    off = dict(PREDICTED, ours=1_239_812 + 1000)
    res = sp_train.saved_activations(_job([_sp_rank(0, off), _sp_rank(1)]), SMOKE, 4)
    assert "TP+SP (ours)" in res.describe().splitlines()[4]
    assert res.describe().splitlines()[4].endswith("+1,000")
    assert "-1,000 B off the prediction (0.35%) (283,136 B)" in res.describe()
    ax = sp_train.plot_saved_activations(res)
    assert len(ax.patches) == 8 and ax.get_title() == "Activation memory per rank, t = 2, b = 4, s = 32"


def test_collective_counts_reads_the_replacing_collectives_and_the_extras():
    counts = sp_train.collective_counts(_job([_sp_rank(0), _sp_rank(1)]))
    assert counts.replacing_sent == counts.tp_sent == 16 * S
    lines = counts.describe().splitlines()
    assert lines[1] == "  TP   all_reduce       16 calls   S   0.500 MiB   sent   0.500 MiB"
    assert lines[4] == "  SP   all_gather backward      17 calls   S   0.531 MiB   sent   0.266 MiB"
    assert lines[7] == ("  of which beyond TP's: boundary 2 calls, S 0.062 MiB, regather 8 calls, S "
                        "0.250 MiB, parameter gradients 1 calls, S 0.006 MiB")
    assert lines[9].endswith("send 0.500 MiB per rank, the same as TP's all-reduces (0.500 MiB)")
    assert lines[10] == "counted: with the extras, TP+SP sends 0.663 MiB per rank per step, 1.33x TP's"
    assert lines[13] == "  TP                    all_reduce 16"
    assert lines[15] == "  TP+SP (ours)          all_gather 26, all_reduce 1, reduce_scatter 16"
    assert "gloo runs reduce_scatter" in lines[-1]
    gpu = sp_train.collective_counts(_job([_sp_rank(0, device="cuda"), _sp_rank(1)]))
    assert "gloo" not in gpu.describe()


def _reference(cfg, b, steps):
    """What parity_with_one_process trains, done here independently: the job's saved files."""
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = make_optimizer(model, config.TrainConfig(micro_batch=b, lr=3e-3, weight_decay=0.1))
    losses, first = [], {}
    for x, y in data.fixed_batches(cfg.seq_len, b, steps, 0):
        _, loss = model(x, y)
        loss.backward()
        first = first or {n: p.grad.clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, first, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_parity_with_one_process_reads_zero_for_the_same_training_and_the_gap_otherwise(tmp_path):
    cfg = config.ModelConfig(seq_len=8, n_layer=1, n_head=2, d_model=16)
    losses, first, params = _reference(cfg, 2, 2)
    torch.save({"params": params, "first_grads": first}, tmp_path / "sp_ours_params.pt")
    moved = copy.deepcopy(params)
    name = next(iter(moved))
    moved[name] = moved[name] + 0.5
    torch.save({"params": moved, "first_grads": first}, tmp_path / "sp_dtensor_params.pt")
    job = _job([{"ours": {"losses": losses}, "dtensor": {"losses": [v + 0.25 for v in losses]}}],
               tmp_path)
    assert sp_train.parity_with_one_process(job, cfg, 2, 2).describe().splitlines() == [
        "measured, TP+SP ours against one process over 2 steps: max |loss diff| 0.0e+00, "
        "first-step gradients 0.0e+00, final parameters 0.0e+00",
        "measured, TP+SP DTensor against one process over 2 steps: max |loss diff| 2.5e-01, "
        "first-step gradients 0.0e+00, final parameters 5.0e-01"]


def test_measured_layouts_and_the_plan_check_choose_their_sentences():
    job = _job([_sp_rank(0), _sp_rank(1)])
    measured = sp_train.measured_layouts(job, seq_len=32)
    assert {m: v["sent_bytes"] for m, v in measured.items()} == {
        "tp": 16 * S, "sp_keep_gathered": 17 * S + 6656, "sp": 21 * S + 6656}
    budget = 2.75 * MiB
    assert sp_train.describe_measured_layouts(measured, seq_len=64, budget_bytes=budget,
                                              micro_batch=4, t=2).splitlines() == [
        "asked: 64 tokens × 4 sequences on 2 ranks, 2.75 MiB of saved activations per rank; "
        "measured at 32 tokens:",
        "  tp                 saved    1.45 MiB per rank, sent   0.50 MiB per rank per step",
        "  sp_keep_gathered   saved    1.31 MiB per rank, sent   0.54 MiB per rank per step",
        "  sp                 saved    1.18 MiB per rank, sent   0.66 MiB per rank per step"]
    at64 = {"tp": 3_045_892, "ours_keep_gathered": 2_741_764, "ours": 2_479_620}
    plan_job = _job([{p: {"saved_bytes": v} for p, v in at64.items()}] * 2,
                    cfg={"model": {"seq_len": 64}})
    lines = sp_train.check_plan("sp_keep_gathered", plan_job, measured, budget).describe().splitlines()
    assert lines[1] == ("  tp                    2.90 MiB (-4 B from the measurement at 32 tokens "
                        "grown linearly): does not fit")
    assert lines[-1] == "measured: 'sp_keep_gathered' fits; no layout that sends fewer bytes fits"

    def verdict(plan):
        return sp_train.check_plan(plan, plan_job, measured, budget).describe().splitlines()[-1]

    assert verdict("tp") == "measured: 'tp' does NOT fit; no layout that sends fewer bytes fits"
    assert verdict("sp") == "measured: 'sp' fits; ['sp_keep_gathered'] fit too and send fewer bytes"
    assert verdict("cp") == "measured: 'cp' was NOT needed: ['sp_keep_gathered', 'sp'] fit"
    tight = sp_train.check_plan("cp", plan_job, measured, 1 * MiB).describe().splitlines()[-1]
    assert tight == ("measured: no layout of the 2 ranks fits, as planned: the sequence must be "
                     "split over more ranks")
    with pytest.raises(ValueError, match="names no model seq_len"):
        sp_train.check_plan("sp", _job(plan_job.ranks), measured, budget)


# --- context and cp_attention --------------------------------------------------------------------


def test_ring_prediction_and_causal_blocks_print_their_tables():
    assert cp.ring_prediction(1, 4, 256, 16, 2).describe().splitlines() == [
        "attention: B=1, H=4, T=256, D=16; context-parallel degree n=2 (T/n = 128 positions per rank)",
        "  predicted bytes each rank sends per forward call,  float32:     65,536",
        "  predicted bytes each rank sends per forward call, bfloat16:     32,768",
        "  predicted score matrix, one device holding T  (B·H·T²·4 bytes):    1,048,576",
        "  predicted score block, one ring step (B·H·(T/n)²·4 bytes):          262,144"]
    lines = cp.causal_blocks(4, also=2).describe().splitlines()
    assert lines[2] == "rank 0     diagonal       skip       skip       skip   1"
    assert lines[5] == "rank 3         full       full       full   diagonal   4"
    assert lines[6] == ("busiest rank's work / mean work (half-blocks, predicted): 1.75 at n = 4, "
                        "1.50 at n = 2")
    assert cp.causal_blocks(3).describe().splitlines()[-1].endswith("1.67 at n = 3")


def _cp_rank(r, ring_err=3.2e-7, sdpa_err=4.0e-7, device="cpu", torch_part=None):
    sent = {"bytes": {"forward": 65536}}
    out = {"rank": r, "device": device, "config": {"seq_len": 256},
           "parity": {"float32": {"ring_max_abs_err": ring_err, "sdpa_one_device_max_abs_err": sdpa_err,
                                  "sent_predicted": 65536, "sent": sent}},
           "grad": {"max_abs_err": {"dq": 4.5e-7}, "sent_predicted": {"forward": 65536, "backward": 196608},
                    "sent": {"bytes": {"forward": 65536, "backward": 196608},
                             "calls": {"forward": 1, "backward": 3}}},
           "memory": {"ring_saved_predicted": 133120, "ring_block_scores_predicted": 262144,
                      "full_scores_predicted": 1048576, "peak_method": None,
                      "ring_saved_bytes": 133120, "one_device_naive_saved_bytes": 1310720}}
    if torch_part is not None:
        out["torch"] = torch_part
    return out


def test_ring_parity_chooses_the_ratio_sentence():
    lines = cp_attention.parity_report(_job([_cp_rank(0), _cp_rank(1)])).describe().splitlines()
    assert lines[0] == "2 ranks, CPU ranks over gloo"
    assert lines[2] == f"{'forward, float32':<38}{'3.2e-07':>16}{'4.0e-07':>17}"
    assert lines[4] == "float32 ring within 1e-4 of float64, forward and backward: True"
    assert lines[5] == ("forward, float32: ring error / one-device SDPA error = 0.80: the ring is "
                        "within 2× of one device's SDPA (no extra float32 error at that resolution)")
    assert lines[-1] == f"{'float32, batch 1, backward':<38}{'196,608':>14}{'196,608':>14}   (3 sends)"
    worse = cp_attention.parity_report(_job([_cp_rank(0, ring_err=2e-4, device="cuda:0")]))
    text = worse.describe()
    assert text.startswith("1 ranks, GPU ranks over NCCL")
    assert "forward and backward: False" in text
    assert "FURTHER from float64 than one device's SDPA (extra float32 error)" in text


def test_ring_memory_table_ratio_and_plot():
    res = cp_attention.memory_report(_job([_cp_rank(0), _cp_rank(1)]))
    lines = res.describe().splitlines()
    assert lines[1] == f"{'costs: K/V sent per forward, float32':<44}{'65,536':>13}{'65,536 counted':>27}"
    assert lines[3] == f"{'holds: score matrix, one device (T x T)':<44}{'1,048,576':>13}{'-':>27}"
    assert lines[8] == "saved for backward, naive one device / ring per rank (measured): 9.8x"
    assert lines[9].startswith("peak bytes during a call are not measured")
    gpu = _cp_rank(0)
    gpu["memory"].update(peak_method="cuda", one_device_naive_peak_bytes=5_000_000,
                         ring_peak_bytes=786432)
    text = cp_attention.memory_report(_job([gpu, gpu])).describe()
    assert "peak / predicted score block, ring (measured / predicted): 3.00" in text
    assert "not measured" not in text
    ax = cp_attention.plot_memory_report(res)
    assert ax.get_title() == "Ring attention, n = 2, T = 256, float32: what it sends and what it holds"


def test_describe_torch_cp_says_not_tried_ran_or_failed():
    assert cp_attention.describe_torch_cp(_job([_cp_rank(0)]), "smoke").startswith(
        "not tried at size='smoke': importing DTensor")
    ran = {"ran": True, "dtype": "bfloat16", "rotate_method": "allgather", "max_abs_err": 3e-3}
    assert cp_attention.describe_torch_cp(_job([_cp_rank(0, torch_part=ran)] * 2), "lab") == (
        "torch context_parallel ran on 2 ranks (bfloat16, K/V exchange allgather): max |error| "
        "vs float64 (measured) 3.0e-03")
    failed = {"ran": False, "rotate_method": "allgather", "error": "NotImplementedError: boom"}
    text = cp_attention.describe_torch_cp(_job([_cp_rank(0, torch_part=failed)] * 2), "lab")
    assert text.splitlines()[:2] == [
        "torch context_parallel (K/V exchange allgather) did NOT run on this tier (2 CPU ranks "
        "over gloo). Its error, verbatim:", "  NotImplementedError: boom"]


# --- expert and moe_train ---------------------------------------------------------------------------


def test_predict_alltoall_prints_s_and_the_even_router_bytes():
    pred = expert.predict_alltoall(64, 2, 64, 4)
    assert pred.sent == 24576
    assert pred.describe().splitlines() == [
        "per rank: 64 tokens × top-2 = 128 copies of h = 64 fp32 numbers: S = 32,768 B into each "
        "dispatch",
        "predicted (even router): 0.75 × S = 24,576 B sent per rank per all-to-all; × 4 "
        "all-to-alls = 98,304 B per rank per step for this one layer"]


def _moe_rank(rank, copies, received, counted, routed, tokens_per_expert, parity):
    four = {k: {"sent_bytes": counted} for k in ("combine", "dispatch (backward)", "combine (backward)")}
    return {"rank": rank, "copies_per_rank": copies, "received_per_rank": received,
            "predicted_uniform_sent": 100.0, "predicted_routed_sent": {"dispatch": routed},
            "counted": {"dispatch": {"sent_bytes": counted, "written_bytes": counted + 40},
                        "counts": {"message_bytes": 64}, **four},
            "tokens_per_expert": tokens_per_expert, "parity_max_abs": parity}


MOE = [_moe_rank(0, [3, 1], [3, 2], 96, 96, [3, 1, 0, 1], {"output": 0.0, "router_grad": 2e-5}),
       _moe_rank(1, [2, 5], [1, 5], 104, 104, [1, 1, 4, 1], {"output": 1e-6, "router_grad": 0.0})]


def test_dispatch_report_describe_adds_the_even_router_verdict_and_plots():
    report = expert.dispatch_report(MOE, 100.0, 4)
    assert report.describe().startswith(report.text + "\n")
    assert report.describe().splitlines()[-1] == (
        "the even-router prediction is right on average (mean over ranks 1.00×) and right per rank "
        "(0.96× to 1.04×); right means within 5 %")
    far = expert.dispatch_report([MOE[0], {**MOE[1], "counted": {
        **MOE[1]["counted"], "dispatch": {"sent_bytes": 150, "written_bytes": 190}}}], 100.0, 4)
    assert far.describe().splitlines()[-1] == (
        "the even-router prediction is OFF on average (mean over ranks 1.23×) and wrong per rank "
        "(0.96× to 1.50×); right means within 5 %")
    ax = expert.plot_dispatch(report)
    assert len(ax.patches) == 4 * 2  # four bars per rank: even, routed, counted, written
    assert ax.get_ylabel() == "KiB sent in one dispatch"


def test_expert_load_describe_and_plot():
    load = expert.expert_load(MOE, 4, 2)
    assert load.counts == [4, 2, 4, 2] and load.rank_load == [5, 6]
    assert load.describe().splitlines() == [
        "token copies per expert, all ranks (counted): [4, 2, 4, 2]",
        "load imbalance max/mean over experts (measured from the router): 1.33 (1.00 is even; 2 = "
        "E/k would be every token on the same 2 experts)",
        "copies each rank's experts processed: [5, 6]: the busiest rank did 1.09× the mean"]
    ax = expert.plot_expert_load(load)
    assert len(ax.patches) == 4 and ax.get_title() == "load per expert: max/mean 1.33"


def test_balance_comparison_lets_the_intervals_decide():
    def runs(*imbalances):
        return {a: {"imbalance": list(v), "loss": [3.0, 2.5]} for a, v in zip((0.0, 0.1), imbalances,
                                                                                strict=True)}

    even = expert.BalanceComparison(10, runs([2.0] * 5 + [1.9, 2.0, 2.1, 2.0, 1.95],
                                             [2.0] * 5 + [1.4, 1.5, 1.45, 1.5, 1.42]))
    lines = even.describe().splitlines()
    assert lines[0] == ("alpha = 0   : imbalance max/mean (measured) median 2.00, middle half 1.95 "
                        "to 2.00, over the last 5 of 10 steps; LM loss at the end 2.500")
    assert lines[2] == ("→ with the auxiliary loss the router is more even: median imbalance 1.45 "
                        "against 2.00 (the medians' intervals do not overlap)")
    worse = expert.BalanceComparison(10, runs([1.0] * 10, [2.0] * 10))
    assert "made the router LESS even" in worse.describe().splitlines()[-1]
    noisy = expert.BalanceComparison(10, runs([1.0, 3.0] * 5, [1.1, 2.9] * 5))
    assert noisy.describe().splitlines()[-1].startswith("→ too noisy to tell")
    real = expert.compare_balance(0.1, 2, n_experts=4, top_k=2, seed=0, batch_size=2, seq_len=8)
    assert list(real.runs) == [0.0, 0.1] and len(real.runs[0.1]["imbalance"]) == 2


def test_moe_parity_and_the_section_summary():
    parity = moe_train.parity_report(MOE)
    assert parity.max_abs == {"output": 1e-6, "router_grad": 2e-5} and parity.ok
    assert parity.describe().splitlines() == [
        "largest |expert-parallel − single process| over the ranks (measured): output 1.0e-06, "
        "router_grad 2.0e-05",
        "→ the expert-parallel layer equals the single-process layer (every difference ≤ 0.0001)"]
    strict = moe_train.parity_report(MOE, tolerance=1e-5)
    assert not strict.ok and strict.describe().endswith(
        "DIFFERS from the single-process layer (every difference not all ≤ 1e-05)")
    report, load = expert.dispatch_report(MOE, 100.0, 4), expert.expert_load(MOE, 4, 2)
    assert moe_train.section_summary(parity, report, load) == (
        "measured in this section: the expert-parallel layer equals the single-process one; the "
        "bytes each dispatch sent equal the routing's prediction on every rank (socket bytes "
        "against gloo's headers: above); the untrained router's imbalance over experts, 1.33 "
        "(E/k = 2 at worst)")
    assert "DIFFERS from the single-process one" in moe_train.section_summary(strict, report, load)
    assert math.isclose(report.even_sent, 100.0) and report.routed == (96, 104)
