"""Composed pipelines on gloo ranks equal one process: data × pipeline, and torch's schedules.

Two launches. 4 ranks on a ("pp", "dp") = (2, 2) mesh: each pipeline runs half the batch with
1F1B, each stage syncs its gradient with its replica once per step (one all-reduce, counted),
or shards the optimizer state with ZeRO-1 over the "dp" group; loss, gradients and the
weights after one AdamW step match one process, and ZeRO-1 holds half the optimizer state.
2 ranks: torch.distributed.pipelining's GPipe, 1F1B, interleaved 1F1B, interleaved zero
bubble and ZB-V (two stages per rank) on one batch: same loss and gradients as one process,
every rank ran its stages' F/B (or F/I/W) for every micro-batch, and torch's own interleaved
order, replayed on an ideal clock, has the bubble of Narayanan et al.'s formula.

Tolerances: fp32; loss 1e-5, gradients 1e-6 (measured ~1e-7), weights after AdamW 3e-5 = lr/100
(measured ~3e-6: Adam's first step is about lr · sign(g), so tiny gradients move their
weight by up to lr whatever their rounding).
"""

from __future__ import annotations

import pytest

from labkit import launch
from labkit.parallel import schedules
from labkit.parallel.timeline import bubble_from_events

B, M = 8, 4

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dp_pp():
    return launch.run(
        "labkit.workers.pp_compose",
        nproc=4,
        config={"part": "dp_pp", "batch_size": B, "microbatches": M},
        timeout_s=240,
        stream=False,
    )


@pytest.fixture(scope="module")
def scheds():
    return launch.run(
        "labkit.workers.pp_compose",
        nproc=2,
        config={"part": "schedules", "batch_size": B, "microbatches": M, "warmup": 0, "repeats": 1},
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
