"""Composed pipelines without processes: the checks, the formulas, the ideal-clock replay.

Data × pipeline: the data-parallel sync of one stage per step (one all-reduce, not one per
micro-batch; ZeRO-1's reduce-scatter + all-gather; ZeRO-3's m-fold traffic), and the layout
check. torch's multi-stage schedules: the micro-batch rules torch enforces, the stage
placement (loop and V), the interleaved and zero-bubble formulas, and ``simulate_actions``
replaying action lists with several stages per rank and a split backward.
"""

from __future__ import annotations

import matplotlib
import pytest

from labkit import formulas, planner
from labkit.config import ModelConfig
from labkit.parallel import pipeline, schedules, timeline

matplotlib.use("Agg")

CFG = ModelConfig(vocab_size=256, seq_len=16, n_layer=4, n_head=4, d_model=32)


# --- data × pipeline -------------------------------------------------------------------------


def test_dp_sync_is_one_all_reduce_per_step_whatever_m():
    for m in (1, 4, 8):
        got = pipeline.dp_sync_per_step(1000, dp=2, m=m)
        assert got == {"calls": 1, "message_bytes": 4000, "sent_per_rank": 4000.0}
    wrong = pipeline.dp_sync_per_step(1000, dp=4, m=8, sync="per_microbatch")
    assert wrong["calls"] == 8 and wrong["sent_per_rank"] == 8 * 2 * 3 / 4 * 4000


def test_zero1_sends_what_the_all_reduce_sends_and_zero3_three_halves_m_times_more():
    ar = pipeline.dp_sync_per_step(1000, dp=4, m=6)
    z1 = pipeline.dp_sync_per_step(1000, dp=4, m=6, sync="zero1", buffers=2)
    z3 = pipeline.dp_sync_per_step(1000, dp=4, m=6, sync="zero3")
    assert z1["sent_per_rank"] == ar["sent_per_rank"] and z1["calls"] == 4
    assert z3["calls"] == 18
    assert z3["sent_per_rank"] == pytest.approx(ar["sent_per_rank"] * 3 * 6 / 2)
    # the ring formulas labkit already has
    assert ar["sent_per_rank"] == pytest.approx(formulas.ring_allreduce_bytes_per_rank(4000, 4))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"sync": "zero2"}, "sync='zero2'"),
        ({"m": 0}, "m=0"),
        ({"buffers": True}, "buffers=True"),
    ],
)
def test_dp_sync_rejects_bad_input(kwargs, match):
    args = {"stage_params": 10, "dp": 2, "m": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        pipeline.dp_sync_per_step(**args)


def test_dp_pp_layout_checked_before_launch():
    pipeline.validate_dp_pp(CFG, 4, pp=2, dp=2, batch_size=8, m=4)
    with pytest.raises(ValueError, match="nproc=4"):
        pipeline.validate_dp_pp(CFG, 2, pp=2, dp=2, batch_size=8, m=4)
    with pytest.raises(ValueError, match="multiple of 2"):
        pipeline.validate_dp_pp(CFG, 4, pp=2, dp=2, batch_size=7, m=1)
    with pytest.raises(ValueError, match="n_microbatches=3"):  # 4 per replica, m = 3
        pipeline.validate_dp_pp(CFG, 4, pp=2, dp=2, batch_size=8, m=3)
    with pytest.raises(ValueError, match="n_layer=4"):
        pipeline.validate_dp_pp(CFG, 8, pp=8, dp=1, batch_size=8, m=8)


def test_pipeline_group_must_match_the_stages():
    class Mesh:  # the part of DeviceMesh that pp_group reads
        mesh_dim_names = ("dp", "tp")

        def get_group(self, name):
            raise AssertionError("not reached")

    with pytest.raises(ValueError, match="'pp'"):
        pipeline.pp_group(Mesh())
    assert pipeline.pp_group(None) is None


# --- torch's schedules: the rules on m, checked before any process ----------------------------


def test_interleaved_needs_m_a_multiple_of_its_rounds():
    assert schedules.validate_torch_schedule("interleaved_1f1b", 2, 4, 8, 4) == 2
    schedules.validate_torch_schedule("interleaved_zb", 2, 6, 12, 4)
    schedules.validate_torch_schedule("interleaved_1f1b", 2, 3, 6, 4)  # one round of 3
    rounds = r"in max\(1, m // p\) = 2 rounds, and m=5 is not a multiple of the number of rounds"
    with pytest.raises(ValueError, match=rounds):
        schedules.validate_torch_schedule("interleaved_1f1b", 2, 5, 10, 4)
    with pytest.raises(ValueError, match="m=7"):
        schedules.validate_torch_schedule("interleaved_zb", 2, 7, 14, 4)


def test_other_schedule_rules():
    with pytest.raises(ValueError, match="m >= 2"):
        schedules.validate_torch_schedule("1f1b", 2, 1, 8, 4)
    with pytest.raises(ValueError, match="8 stages"):
        schedules.validate_torch_schedule("zbv", 4, 8, 8, 4)
    with pytest.raises(ValueError, match="divide batch_size=8"):
        schedules.validate_torch_schedule("zbv", 2, 3, 8, 4)
    with pytest.raises(ValueError, match="schedule='looped'"):
        schedules.validate_torch_schedule("looped", 2, 4, 8, 4)
    assert schedules.validate_torch_schedule("gpipe", 2, 1, 8, 4) == 1


def test_stage_placement_loop_and_v():
    assert schedules.stage_placement("1f1b", 2) == [[0], [1]]
    assert schedules.stage_placement("interleaved_1f1b", 2) == [[0, 2], [1, 3]]
    assert schedules.stage_placement("interleaved_zb", 4) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert schedules.stage_placement("zbv", 2) == [[0, 3], [1, 2]]


# --- the formulas ------------------------------------------------------------------------------


def test_interleaved_overhead_is_1f1b_over_v():
    assert schedules.interleaved_overhead(2, 2, 4) == pytest.approx(1 / 8)
    assert schedules.interleaved_overhead(4, 1, 8) == formulas.bubble_overhead(4, 8)
    assert schedules.interleaved_overhead(4, 2, 8) == formulas.bubble_overhead(4, 8, v=2)
    with pytest.raises(ValueError, match="v=0"):
        schedules.interleaved_overhead(2, 0, 4)


def test_zero_bubble_h1_is_a_third_of_1f1b_at_equal_times():
    one = schedules.zero_bubble_time("1f1b", 4, 1.0, 1.0, 1.0)
    h1 = schedules.zero_bubble_time("zb-h1", 4, 1.0, 1.0, 1.0)
    assert one == 9.0 and h1 == pytest.approx(one / 3)
    assert schedules.zero_bubble_time("zb-h1", 4, 1.0, 1.0, 3.0) == 0.0  # W fills it all
    with pytest.raises(ValueError, match="'zbv'"):
        schedules.zero_bubble_time("zbv", 2, 1, 1, 1)


# --- the ideal-clock replay ----------------------------------------------------------------------


def test_simulate_actions_matches_the_single_stage_simulator():
    for name in ("gpipe", "1f1b"):
        orders = [[(k, s, j) for k, j in schedules.schedule_order(name, 3, 4, s)] for s in range(3)]
        ours = schedules.simulate_actions(orders, t_f=1.0, t_b=2.0)
        old = schedules.simulate(name, 3, 4, t_f=1.0, t_b=2.0)
        assert [(e["rank"], e["mb"], e["kind"], e["start_s"]) for e in ours] == [
            (e["rank"], e["mb"], e["kind"], e["start_s"]) for e in old
        ]


def _interleaved_order(p: int, v: int, m: int) -> dict[int, list]:
    """Megatron's interleaved 1F1B for m = p (one round), depth first: a reference order."""
    orders = {}
    for r in range(p):
        fwd = [("F", r + c * p, j) for c in range(v) for j in range(m)]
        bwd = [("B", r + c * p, j) for c in reversed(range(v)) for j in range(m)]
        warm = min((v - 1) * m + 2 * (p - 1 - r), len(fwd))
        order = fwd[:warm]
        for f, b in zip(fwd[warm:], bwd, strict=False):
            order += [f, b]
        order += bwd[len(fwd) - warm :]
        orders[r] = order
    return orders


def test_simulated_interleaving_shrinks_the_bubble_by_v():
    p, m, tf, tb = 2, 2, 1.0, 2.0
    flat = schedules.simulate_actions(
        [[(k, s, j) for k, j in schedules.schedule_order("1f1b", p, m, s)] for s in range(p)],
        t_f=tf, t_b=tb,
    )  # fmt: skip
    inter = schedules.simulate_actions(_interleaved_order(p, 2, m), t_f=tf / 2, t_b=tb / 2)
    idle = [timeline.bubble_from_events(ev)[0]["idle_s"] for ev in (flat, inter)]
    busy = [timeline.bubble_from_events(ev)[0]["busy_s"] for ev in (flat, inter)]
    assert idle[0] / busy[0] == pytest.approx(formulas.bubble_overhead(p, m))
    assert idle[1] / busy[1] == pytest.approx(schedules.interleaved_overhead(p, 2, m))


def test_split_backward_fills_the_cool_down():
    # p = 2, one stage each, m = 2: rank 0 fills the wait for rank 1's second I with W0,
    # and the step is 2 × 3 units of work plus ZB-H1's bubble (p−1)(t_f + t_b − t_w) = 1.
    zb = {
        0: [("F", 0, 0), ("F", 0, 1), ("I", 0, 0), ("W", 0, 0), ("I", 0, 1), ("W", 0, 1)],
        1: [("F", 1, 0), ("I", 1, 0), ("F", 1, 1), ("I", 1, 1), ("W", 1, 0), ("W", 1, 1)],
    }
    ev = schedules.simulate_actions(zb, t_f=1.0, t_b=1.0, t_w=1.0)
    per = timeline.bubble_from_events(ev)
    step = per[0]["step_s"]
    assert step == pytest.approx(2 * 3 + schedules.zero_bubble_time("zb-h1", 2, 1.0, 1.0, 1.0))
    whole = schedules.simulate_actions(  # the same without the split: 1F1B's bubble
        {r: [("B" if k == "I" else k, s, j) for k, s, j in acts if k != "W"] for r, acts in zb.items()},
        t_f=1.0, t_b=2.0,
    )  # fmt: skip
    assert timeline.bubble_from_events(whole)[0]["step_s"] == pytest.approx(
        2 * 3 + schedules.zero_bubble_time("1f1b", 2, 1.0, 1.0, 1.0)
    )
    with pytest.raises(ValueError, match="pass t_w"):
        schedules.simulate_actions(zb)
    with pytest.raises(RuntimeError, match="deadlock"):
        schedules.simulate_actions({0: [("B", 0, 0)], 1: [("F", 1, 0), ("B", 1, 1)]})


def test_order_from_torch_reads_actions():
    class A:
        def __init__(self, k, s, j):
            class T:
                value = k

            self.computation_type, self.stage_index, self.microbatch_index = T, s, j

    got = schedules.order_from_torch({0: [A("F", 0, 0), None, A("W", 2, 1)]})
    assert got == {0: [("F", 0, 0), ("W", 2, 1)]}


def test_plot_timeline_draws_split_backwards():
    ev = schedules.simulate_actions({0: [("F", 0, 0), ("I", 0, 0), ("W", 0, 0)]}, t_w=1.0)
    ax = timeline.plot_timeline(ev, unit="forward")
    assert len(ax.patches) == 3


# --- the order a rank ran, read from its events, and its replay ---------------------------------


def one_f_one_b(p: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    return {s: [(k, s, j) for k, j in schedules.schedule_order("1f1b", p, m, s)] for s in range(p)}


def test_order_from_events_sorts_each_rank_by_start_time():
    events = [  # as gathered: rank 1's before rank 0's, one of rank 0's out of place
        {"rank": 1, "stage": 1, "mb": 0, "kind": "F", "start_s": 1.0, "end_s": 2.0},
        {"rank": 0, "stage": 0, "mb": 1, "kind": "F", "start_s": 1.0, "end_s": 2.0},
        {"rank": 0, "stage": 0, "mb": 0, "kind": "F", "start_s": 0.0, "end_s": 1.0},
        {"rank": 1, "stage": 1, "mb": 0, "kind": "B", "start_s": 2.0, "end_s": 4.0},
    ]
    got = schedules.order_from_events(events)
    assert got == {0: [("F", 0, 0), ("F", 0, 1)], 1: [("F", 1, 0), ("B", 1, 0)]}
    with pytest.raises(ValueError, match="empty"):
        schedules.order_from_events([])
    with pytest.raises(ValueError, match="'X'"):
        schedules.order_from_events([{**events[0], "kind": "X"}])


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (3, 3)])
def test_replayed_1f1b_order_lands_on_the_formula_at_any_op_times(p, m):
    for op_s in ({"F": 1.0, "B": 2.0}, {"F": 6.8e-3, "B": 18.9e-3}, {"F": 1.0, "B": 1.0}):
        _, overhead = schedules.replay_overhead(one_f_one_b(p, m), op_s)
        assert overhead == pytest.approx((p - 1) / m)


def test_a_permuted_order_of_the_same_actions_gives_another_bubble():
    # What makes the notebook's check able to fail: stage 0 running its backwards newest first
    # waits for the last stage's last backward, and the replay shows it.
    good = one_f_one_b(2, 4)
    forwards = [a for a in good[0] if a[0] == "F"]
    backwards = [a for a in good[0] if a[0] == "B"]
    bad = {0: forwards + backwards[::-1], 1: good[1]}
    assert sorted(bad[0]) == sorted(good[0])  # the same actions
    op_s = {"F": 6.8e-3, "B": 18.9e-3}
    _, ok = schedules.replay_overhead(good, op_s)
    _, off = schedules.replay_overhead(bad, op_s)
    assert ok == pytest.approx(0.25) and off > ok + 0.2


def test_replay_overhead_needs_forward_and_backward_times():
    with pytest.raises(ValueError, match="need the time of F"):
        schedules.replay_overhead(one_f_one_b(2, 2), {"F": 1.0})
    split = {0: [("F", 0, 0), ("I", 0, 0), ("W", 0, 0)]}
    _, overhead = schedules.replay_overhead(split, {"F": 1.0, "I": 1.0, "W": 1.0})
    assert overhead == 0.0  # one rank, nothing to wait for


# --- the planner's data × pipeline layouts, checked before launch -------------------------------


def test_layouts_are_checked_before_launch():
    from labkit.workers import pp_compose

    assert pp_compose.validate_layouts(CFG, 4, [[1, 4], [2, 2], [4, 1]], 8, 1) == [
        (1, 4), (2, 2), (4, 1)]  # fmt: skip
    assert [pp_compose.layout_name(pp, dp) for pp, dp in ((1, 4), (2, 2), (4, 1), (1, 1))] == [
        "DP4", "DP2×PP2", "PP4", "one rank"]  # fmt: skip
    for pp, dp in ((1, 4), (2, 2), (4, 1)):  # the names notebook 03d looks the planner's rows up by
        assert pp_compose.layout_name(pp, dp) == planner.Layout(dp=dp, tp=1, pp=pp).name
    with pytest.raises(ValueError, match="mesh must cover every rank"):
        pp_compose.validate_layouts(CFG, 4, [[2, 1]], 8, 1)
    with pytest.raises(ValueError, match="multiple of 8"):
        pp_compose.validate_layouts(CFG, 4, [[1, 4]], 6, 2)
    with pytest.raises(ValueError, match="twice"):
        pp_compose.validate_layouts(CFG, 4, [[1, 4], [1, 4]], 8, 1)
    with pytest.raises(ValueError, match="micro_batch=0"):
        pp_compose.validate_layouts(CFG, 4, [[1, 4]], 8, 0)
