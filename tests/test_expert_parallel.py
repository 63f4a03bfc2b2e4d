"""Mixture of experts and expert parallelism (labkit.parallel.expert, labkit.workers.moe_train).

Unit tests: the router's top-k, the single-process layer against a per-token loop, Switch's
load-balancing loss, the validation messages, the byte formulas on a worked case. One launch
(2 gloo ranks, 4 experts, top-2) checks the expert-parallel layer against the single-process
layer (outputs, input, expert and router gradients), ``dispatch`` against the tokens every rank
sent, and the counted all-to-all bytes against the formula from the routing.
"""

from __future__ import annotations

import pytest
import torch

from labkit.config import ModelConfig
from labkit.jobs import launch
from labkit.parallel import expert
from labkit.workers import moe_train

CFG = ModelConfig(d_model=16, n_head=2, seq_len=8)


def test_router_picks_the_top_k_and_renormalises():
    torch.manual_seed(0)
    router = expert.Router(16, n_experts=6, top_k=2)
    x = torch.randn(10, 16)
    r = router(x)
    assert r.weights.shape == r.experts.shape == (10, 2)
    top = r.probs.topk(2, dim=-1)
    assert torch.equal(r.experts, top.indices)
    torch.testing.assert_close(r.weights, top.values / top.values.sum(-1, keepdim=True))
    torch.testing.assert_close(r.weights.sum(-1), torch.ones(10))
    assert (r.experts[:, 0] != r.experts[:, 1]).all()  # distinct experts
    r1 = expert.Router(16, n_experts=6, top_k=1)(x)
    torch.testing.assert_close(r1.weights[:, 0], r1.probs.max(-1).values)  # Switch keeps p


def test_moe_equals_a_loop_over_tokens():
    torch.manual_seed(0)
    moe = expert.MoE(CFG, n_experts=4, top_k=2)
    x = torch.randn(2, 5, 16)
    y, r = moe(x)
    flat = x.reshape(-1, 16)
    for t in range(flat.shape[0]):
        want = sum(
            r.weights[t, j] * moe.experts[int(r.experts[t, j])](flat[t : t + 1])[0]
            for j in range(2)
        )
        torch.testing.assert_close(y.reshape(-1, 16)[t], want, atol=1e-6, rtol=1e-5)


def test_identical_experts_with_all_of_them_chosen_give_the_expert():
    torch.manual_seed(0)
    moe = expert.MoE(CFG, n_experts=3, top_k=3)
    for e in moe.experts[1:]:
        e.load_state_dict(moe.experts[0].state_dict())
    x = torch.randn(7, 16)
    y, _ = moe(x)
    torch.testing.assert_close(y, moe.experts[0](x), atol=1e-6, rtol=1e-5)  # gates sum to 1


def test_gradients_reach_router_and_chosen_experts_only():
    torch.manual_seed(0)
    moe = expert.MoE(CFG, n_experts=4, top_k=1)
    x = torch.randn(6, 16, requires_grad=True)
    y, r = moe(x)
    y.sum().backward()
    assert moe.router.gate.weight.grad.abs().sum() > 0
    used = set(r.experts.reshape(-1).tolist())
    for e, mlp in enumerate(moe.experts):
        has = mlp.fc.weight.grad is not None and mlp.fc.weight.grad.abs().sum() > 0
        assert has == (e in used), e


def test_load_balancing_loss_is_one_when_uniform_and_grows_with_skew():
    E = 4
    uniform = expert.Routing(
        weights=torch.ones(8, 1), experts=torch.arange(8).remainder(E)[:, None],
        probs=torch.full((8, E), 1 / E),
    )  # fmt: skip
    assert float(expert.load_balancing_loss(uniform)) == pytest.approx(1.0)
    probs = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).repeat(8, 1)
    skewed = expert.Routing(torch.ones(8, 1), torch.zeros(8, 1, dtype=torch.long), probs)
    assert float(expert.load_balancing_loss(skewed)) == pytest.approx(4 * 0.7)
    p = probs.clone().requires_grad_()
    expert.load_balancing_loss(expert.Routing(torch.ones(8, 1), skewed.experts, p)).backward()
    assert p.grad[:, 0].abs().sum() > 0  # through P_i, not through the counts


def test_tokens_per_expert_and_imbalance():
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    counts = expert.tokens_per_expert(experts, 4)
    assert counts.tolist() == [4, 2, 1, 1]
    assert expert.imbalance(counts) == pytest.approx(4 / 2)
    assert expert.imbalance([3, 3, 3]) == 1.0
    assert expert.copies_per_rank(experts, 4, 2) == [6, 2]


@pytest.mark.parametrize(
    "n_experts, top_k, world, match",
    [
        (6, 2, 4, r"n_experts=6 is not divisible by world_size=4.*use 4 or 8 experts"),
        (2, 1, 4, r"n_experts=2 < world_size=4.*2 rank\(s\) would hold none"),
        (4, 5, 1, r"top_k=5 > n_experts=4.*use top_k <= 4"),
        (4, 0, 1, r"top_k=0 is not allowed: a positive integer"),
        (4, True, 1, r"top_k=True is not allowed: a positive integer"),
    ],
)
def test_validation_names_the_constraint_and_the_fix(n_experts, top_k, world, match):
    with pytest.raises(ValueError, match=match):
        expert.validate_moe(n_experts, top_k, world)


def test_layout_that_fits_passes():
    expert.validate_moe(8, 2, 4)
    expert.validate_moe(4, 4, 4)


def test_all_to_all_bytes_worked_case():
    # 4 ranks, 128 tokens x top-2 = 256 copies of 64 fp32 elements: S = 65,536 B.
    assert expert.alltoall_sent_bytes_uniform(256, 64, 4) == 65_536 * 3 / 4
    # 128 copies routed 17/41/33/37 to ranks 0..3: rank 0 keeps its 17 and sends the rest.
    assert expert.alltoall_sent_bytes([17, 41, 33, 37], 0, 64) == (128 - 17) * 64 * 4
    assert expert.alltoall_sent_bytes([17, 41, 33, 37], 3, 64) == (128 - 37) * 64 * 4
    assert expert.alltoall_sent_bytes_uniform(256, 64, 1) == 0  # one rank keeps everything
    with pytest.raises(ValueError, match="rank=4"):
        expert.alltoall_sent_bytes([1, 2, 3, 4], 4, 64)


def test_balance_run_reports_every_step_and_restores_threads():
    threads = torch.get_num_threads()
    out = expert.balance_run(0.1, 2, d_model=16, n_experts=4, top_k=2, batch_size=2, seq_len=8)
    assert torch.get_num_threads() == threads
    assert {k: len(v) for k, v in out.items()} == {"imbalance": 2, "aux": 2, "loss": 2}
    assert all(1.0 <= v <= 4.0 for v in out["imbalance"])
    with pytest.raises(ValueError, match="alpha=-1"):
        expert.balance_run(-1, 2)


# --- one launch: 2 gloo ranks -----------------------------------------------------------------

N, E, K, B, SEED = 2, 4, 2, 2, 0
MODEL = {"seq_len": 16, "n_layer": 1, "n_head": 2, "d_model": 32}


@pytest.fixture(scope="module")
def job():
    return launch.run(
        moe_train.MoETrainConfig(model=MODEL, n_experts=E, top_k=K, batch_size=B, seed=SEED,
                                 check_dispatch=True, compare_torch=True),
        nproc=N,
        timeout_s=180,
        stream=False,
    )  # fmt: skip


@pytest.mark.slow
def test_expert_parallel_equals_single_process(job):
    cfg = ModelConfig(**MODEL)
    xs, grads = moe_train.moe_inputs(cfg, B, N, SEED)
    ref = moe_train.reference_moe(cfg, E, K, SEED)
    outs, xgrads = [], []
    for x, g in zip(xs, grads, strict=True):
        x = x.detach().clone().requires_grad_()
        y, _ = ref(x)
        (y * g).sum().backward()
        outs.append(y.detach())
        xgrads.append(x.grad)
    ref_params = dict(ref.named_parameters())
    close = dict(atol=1e-5, rtol=1e-4)
    for r in range(N):
        got = torch.load(job.log_dir / f"moe_rank{r}.pt")
        torch.testing.assert_close(got["output"], outs[r], **close)
        torch.testing.assert_close(got["input_grad"], xgrads[r], **close)
        torch.testing.assert_close(got["router_grad"], ref.router.gate.weight.grad, **close)
        assert len(got["expert_grads"]) == 4 * E // N  # fc/proj weight and bias per expert
        for name, grad in got["expert_grads"].items():
            torch.testing.assert_close(grad, ref_params[f"experts.{name}"].grad, **close)


@pytest.mark.slow
def test_torchs_autograd_all_to_all_gives_the_same_step(job):
    for res in job.ranks:
        assert max(res["torch_impl_max_abs"].values()) <= 1e-6, res["torch_impl_max_abs"]


@pytest.mark.slow
def test_dispatch_delivers_every_token_by_source_rank_and_returns_gradients(job):
    for r, res in enumerate(job.ranks):
        want, counts = moe_train.expected_dispatch(r, N, SEED)
        assert res["dispatch"]["recv_counts"] == counts
        torch.testing.assert_close(torch.tensor(res["dispatch"]["received"]), want)
    # Each token's gradient is the 1-based position at which it arrived on its destination.
    for src, res in enumerate(job.ranks):
        _, dest = moe_train.dispatch_case(src, N, SEED)
        for i, d in enumerate(dest.tolist()):
            arrived = torch.tensor(job.ranks[d]["dispatch"]["received"])
            pos = int((arrived[:, 0] == 100 * src + i).nonzero()) + 1
            assert res["dispatch"]["grad"][i] == [pytest.approx(float(pos))] * 3


@pytest.mark.slow
def test_counted_all_to_all_bytes_match_the_routing(job):
    sent = [[0] * N for _ in range(N)]  # sent[i][j]: copies rank i sent to rank j
    for res in job.ranks:
        sent[res["rank"]] = res["copies_per_rank"]
    row = MODEL["d_model"] * 4
    for r, res in enumerate(job.ranks):
        c = res["counted"]
        assert res["received_per_rank"] == [sent[i][r] for i in range(N)]
        assert c["dispatch"]["sent_bytes"] == res["predicted_routed_sent"]["dispatch"]
        assert c["dispatch"]["sent_bytes"] == (sum(sent[r]) - sent[r][r]) * row
        assert c["combine"]["sent_bytes"] == c["dispatch"]["received_bytes"]
        assert c["dispatch (backward)"]["sent_bytes"] == c["combine"]["sent_bytes"]
        assert c["combine (backward)"]["sent_bytes"] == c["dispatch"]["sent_bytes"]
        assert c["counts"]["message_bytes"] == E * 8
        # Measured: what the process wrote to its sockets (gloo) is the payload plus gloo's
        # header per peer (144 B with torch 2.13); never less than the payload.
        for label in ("dispatch", "combine", "dispatch (backward)", "combine (backward)"):
            extra = c[label]["written_bytes"] - c[label]["sent_bytes"]
            assert 0 <= extra <= 1024 * (N - 1), (label, extra)
        assert sum(res["tokens_per_expert"]) == B * MODEL["seq_len"] * K
    total_sent = sum(res["counted"]["dispatch"]["sent_bytes"] for res in job.ranks)
    assert total_sent == sum(res["counted"]["dispatch"]["received_bytes"] for res in job.ranks)


def test_worst_imbalance_is_e_over_k_because_a_token_picks_distinct_experts():
    router = expert.Router(d_model=8, n_experts=8, top_k=2)
    routing = router(torch.randn(64, 8))
    counts = expert.tokens_per_expert(routing.experts, 8)
    assert counts.max() <= 64  # at most one copy of each token per expert
    assert expert.imbalance(counts) <= expert.worst_imbalance(8, 2) == 4.0
    # every token on the same two experts reaches the bound exactly
    piled = expert.tokens_per_expert(torch.tensor([[0, 1]] * 64), 8)
    assert expert.imbalance(piled) == expert.worst_imbalance(8, 2)


def _moe_rank(rank, copies, received, counted, routed, written):
    four = {k: {"sent_bytes": counted} for k in ("combine", "dispatch (backward)", "combine (backward)")}
    return {"rank": rank, "copies_per_rank": copies, "received_per_rank": received,
            "predicted_uniform_sent": 100.0, "predicted_routed_sent": {"dispatch": routed},
            "counted": {"dispatch": {"sent_bytes": counted, "written_bytes": written},
                        "counts": {"message_bytes": 64}, **four}}


def test_dispatch_report_chooses_its_verdicts_from_the_numbers():
    ok = [_moe_rank(0, [3, 1], [3, 2], 128, 128, 128 + 40),
          _moe_rank(1, [2, 5], [1, 5], 256, 256, 256 + 40)]
    r = expert.dispatch_report(ok, 100.0, 8)
    assert r.consistent and r.matches_routing and r.sent == [128, 256] and r.extra == [40, 40]
    assert "equals the routing's prediction" in r.text and "gloo's message header" in r.text
    assert r.mean_over_even == (128 + 256) / 2 / 100.0 and "1.92× on average" in r.text
    bad = [_moe_rank(0, [3, 1], [3, 9], 128, 120, 128 + 5000),
           _moe_rank(1, [2, 5], [1, 5], 256, 256, None)]
    r = expert.dispatch_report(bad, 100.0, 8)
    assert not r.consistent and not r.matches_routing
    assert "DIFFERS from the routing's prediction" in r.text and "measured: N/A" in r.text
    bad[1]["counted"]["dispatch"]["written_bytes"] = 256
    assert "MORE than a header" in expert.dispatch_report(bad, 100.0, 8).text
