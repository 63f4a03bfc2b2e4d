"""Composed pipelines on gloo ranks equal one process: data × pipeline, and torch's schedules.

Two launches. 4 ranks on a ("pp", "dp") = (2, 2) mesh: each pipeline runs half the batch with
1F1B, each stage syncs its gradient with its replica once per step (one all-reduce, counted),
or shards the optimizer state with ZeRO-1 over the "dp" group; loss, gradients and the
weights after one AdamW step match one process, and ZeRO-1 holds half the optimizer state.
2 ranks: torch.distributed.pipelining's GPipe, 1F1B, interleaved 1F1B, interleaved zero
bubble and ZB-V (two stages per rank) on one batch: same loss and gradients as one process,
every rank ran its stages' F/B (or F/I/W) for every micro-batch, and torch's own interleaved
order, replayed on an ideal clock, has the bubble of Narayanan et al.'s formula. The order each
rank really ran (read from the timed wrappers' events) is 1F1B's for Schedule1F1B and GPipe's
for ScheduleGPipe, torch's plan for the multi-stage schedules, and replayed it lands on the
formula where a permutation of it does not.
Then 4 ranks time the planner's data × pipeline layouts (DP4, DP2×PP2, PP4) in one job: each
trains the same model, so the losses agree step by step with each other and with one process.

Tolerances: fp32; loss 1e-5, gradients 1e-6 (measured ~1e-7), weights after AdamW 3e-5 = lr/100
(measured ~3e-6: Adam's first step is about lr · sign(g), so tiny gradients move their
weight by up to lr whatever their rounding).
"""

from __future__ import annotations

import pytest

from labkit.jobs import launch
from labkit.parallel import schedules
from labkit.parallel.timeline import bubble_from_events
from labkit.workers import pp_compose

B, M = 8, 4

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dp_pp():
    return launch.run(
        pp_compose.PPComposeConfig(part="dp_pp", batch_size=B, microbatches=M),
        nproc=4,
        timeout_s=240,
        stream=False,
    )


@pytest.fixture(scope="module")
def scheds():
    return launch.run(
        pp_compose.PPComposeConfig(part="schedules", batch_size=B, microbatches=M, warmup=0,
                                   repeats=1),
        nproc=2,
        timeout_s=240,
        stream=False,
    )


def test_mesh_groups(dp_pp):
    got = {r["rank"]: (r["pp_group"], r["dp_group"], r["stage"]) for r in dp_pp.ranks}
    assert got == {
        0: ([0, 2], [0, 1], 0),
        1: ([1, 3], [0, 1], 0),
        2: ([0, 2], [2, 3], 1),
        3: ([1, 3], [2, 3], 1),
    }


@pytest.mark.parametrize("sync", ["all_reduce", "zero1"])
def test_dp_pp_matches_one_process(dp_pp, sync):
    for r in dp_pp.ranks:
        run = r["runs"][sync]
        assert run["loss_error"] < 1e-5, (r["rank"], run["loss"], r["reference_loss"])
        assert run["weight_error"] < 3e-5, (r["rank"], run["weight_error"])
        if sync == "all_reduce":
            assert run["grad_error"] < 1e-6, (r["rank"], run["grad_error"])


def test_dp_sync_counted_as_predicted(dp_pp):
    for r in dp_pp.ranks:
        ar, z1 = r["runs"]["all_reduce"], r["runs"]["zero1"]
        # one all-reduce per step after the stage's last backward, not one per micro-batch
        assert ar["counted"]["last_step"] == {
            "all_reduce": {"calls": 1, "message_bytes": ar["predicted"]["message_bytes"]}
        }
        assert ar["predicted"]["calls"] == 1 < M
        assert ar["sync_start_s"] >= ar["last_backward_end_s"]
        kinds = z1["counted"]["last_step"]
        assert set(kinds) == {"reduce_scatter", "all_gather"}
        assert sum(k["calls"] for k in kinds.values()) == z1["predicted"]["calls"]
        S = z1["predicted"]["message_bytes"]
        for k in kinds.values():  # the flat buffers are padded to a multiple of dp
            assert S <= k["message_bytes"] <= S + 2 * 4 * 2


def test_zero1_halves_the_optimizer_state(dp_pp):
    for r in dp_pp.ranks:
        full = r["runs"]["all_reduce"]["optimizer_state_bytes"]
        sharded = r["runs"]["zero1"]["optimizer_state_bytes"]
        P = r["runs"]["all_reduce"]["stage_params"]
        assert full == 8 * P  # AdamW: m and v in fp32
        assert 8 * P / 2 <= sharded <= 8 * P / 2 + 8 * 2


@pytest.mark.parametrize("name", list(schedules.TORCH_SCHEDULES))
def test_schedule_matches_one_process(scheds, name):
    run = scheds.rank(0)["runs"][name]
    assert run["loss_error"] < 1e-5, (name, run["loss"])
    assert run["grad_error"] < 1e-6, (name, run["grad_error"])


@pytest.mark.parametrize("name", list(schedules.TORCH_SCHEDULES))
def test_every_stage_ran_every_microbatch(scheds, name):
    run = scheds.rank(0)["runs"][name]
    split = name in ("interleaved_zb", "zbv")
    kinds = ("F", "I", "W") if split else ("F", "B")
    for rank, stages in enumerate(run["stages"]):
        for s in stages:
            for k in kinds:
                mbs = sorted(e["mb"] for e in run["events"]
                             if e["rank"] == rank and e["stage"] == s and e["kind"] == k)  # fmt: skip
                assert mbs == list(range(M)), (name, rank, s, k, mbs)
    assert set(bubble_from_events(run["events"])) == {0, 1}


def test_torch_interleaved_order_has_the_formula_bubble(scheds):
    orders = scheds.rank(0)["orders"]
    order = {int(r): [tuple(a) for a in acts] for r, acts in orders["interleaved_1f1b"].items()}
    ev = schedules.simulate_actions(order, t_f=1.0, t_b=2.0)
    per = bubble_from_events(ev)
    overhead = sum(r["idle_s"] / r["busy_s"] for r in per.values()) / len(per)
    assert overhead == pytest.approx(schedules.interleaved_overhead(2, 2, M))


# --- the order each rank ran, recorded (notebook 03d, section 2) ---------------------------------


def recorded(scheds, name):
    rec = scheds.rank(0)["recorded"][name]
    return {int(r): [tuple(a) for a in acts] for r, acts in rec["order"].items()}


@pytest.mark.parametrize("name", list(schedules.TORCH_SCHEDULES))
def test_recorded_order_is_what_the_wrappers_saw(scheds, name):
    run, order = scheds.rank(0)["runs"][name], recorded(scheds, name)
    assert scheds.rank(0)["recorded"][name]["same_every_step"] is True
    for rank in (0, 1):
        seen = sorted((e for e in run["events"] if e["rank"] == rank), key=lambda e: e["start_s"])
        assert order[rank] == [(e["kind"], e["stage"], e["mb"]) for e in seen], (name, rank)
        assert len(set(order[rank])) == len(order[rank])  # each action once


def test_recorded_single_stage_orders_are_torchs_1f1b_and_gpipe(scheds):
    # Labkit's own action lists, held against what torch's Schedule1F1B and ScheduleGPipe ran:
    # one stage per rank, stage = rank. The two differ, so neither record can be a copy of the other.
    for name in ("1f1b", "gpipe"):
        want = {s: [(k, s, j) for k, j in schedules.schedule_order(name, 2, M, s)] for s in (0, 1)}
        assert recorded(scheds, name) == want, name
    assert recorded(scheds, "1f1b") != recorded(scheds, "gpipe")


@pytest.mark.parametrize("name", ["interleaved_1f1b", "interleaved_zb", "zbv"])
def test_recorded_multi_stage_order_is_torchs_plan(scheds, name):
    plan = scheds.rank(0)["orders"][name]
    assert recorded(scheds, name) == {int(r): [tuple(a) for a in acts] for r, acts in plan.items()}


def test_replayed_recorded_1f1b_lands_on_the_formula_and_a_permuted_one_does_not(scheds):
    run, order = scheds.rank(0)["runs"]["1f1b"], recorded(scheds, "1f1b")
    _, got = schedules.replay_overhead(order, run["op_s"])
    assert got == pytest.approx((2 - 1) / M)
    fwd = [a for a in order[0] if a[0] == "F"]
    bwd = [a for a in order[0] if a[0] == "B"]
    _, permuted = schedules.replay_overhead({0: fwd + bwd[::-1], 1: order[1]}, run["op_s"])
    assert abs(permuted - got) > 0.05


# --- the planner's data × pipeline layouts, timed (notebook 03d, section 4) ----------------------

LAYOUTS = [[1, 4], [2, 2], [4, 1]]


@pytest.fixture(scope="module")
def layouts():
    return launch.run(
        pp_compose.PPComposeConfig(part="layouts", batch_size=B, layouts=LAYOUTS, warmup=1,
                                   repeats=2),
        nproc=4,
        timeout_s=240,
        stream=False,
    )


def test_every_layout_trains_the_same_model(layouts):
    r0 = layouts.rank(0)
    runs = r0["layouts"]
    assert list(runs) == ["DP4", "DP2×PP2", "PP4"]
    for name, run in runs.items():
        assert run["microbatches"] == B // run["dp"], name  # micro-batches of one row
        assert run["losses"][0] == pytest.approx(r0["reference_loss"], abs=1e-5), name
        assert run["losses"][-1] < run["losses"][0]  # AdamW stepped
    for step in zip(*(run["losses"] for run in runs.values()), strict=True):
        assert max(step) - min(step) < 1e-5, step
    for r in layouts.ranks:  # every rank agrees on the loss
        assert r["layouts"]["DP4"]["losses"] == pytest.approx(runs["DP4"]["losses"], abs=1e-6)


def test_every_layout_is_timed_every_repeat(layouts):
    for run in layouts.rank(0)["layouts"].values():
        assert len(run["step_s_samples"]) == 2 and all(t > 0 for t in run["step_s_samples"])
        assert min(run["step_s_samples"]) <= run["step_s"] <= max(run["step_s_samples"])
