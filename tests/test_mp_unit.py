"""Model parallelism without processes: checks, partitions, schedules, bubbles, slicing.

Everything here runs in the test process: the input checks that must fail before a job
starts, the partition's balance, the schedules as action lists and their ideal timelines,
the bubble measured from events, and tensor-parallel slicing (in one process f and g do not
communicate, so summing the ranks' partial results by hand must give the whole layer).
"""

from __future__ import annotations

import itertools

import matplotlib
import pytest
import torch

from labkit import formulas
from labkit.config import ModelConfig
from labkit.model import GPT
from labkit.parallel import pipeline, schedules, tensor, timeline

matplotlib.use("Agg")

CFG = ModelConfig(vocab_size=256, seq_len=16, n_layer=4, n_head=4, d_model=32)


# --- bad input fails before a job starts -------------------------------------------------------


def test_more_stages_than_layers_is_rejected_with_the_fix():
    with pytest.raises(ValueError, match=r"p=5 .*n_layer=4.*use p <= 4"):
        pipeline.validate_pipeline(CFG, p=5, batch_size=8, n_microbatches=4)


def test_microbatches_that_do_not_divide_the_batch_are_rejected():
    with pytest.raises(
        ValueError, match=r"n_microbatches=3 does not divide batch_size=8.*\[1, 2, 4, 8\]"
    ):
        pipeline.validate_pipeline(CFG, p=2, batch_size=8, n_microbatches=3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"p": 0}, r"p=0 is not allowed: a positive integer"),
        ({"schedule": "zb"}, r"schedule='zb'"),
        ({"schedule": "naive"}, r"n_microbatches=1"),
        ({"schedule": "torch_1f1b", "n_microbatches": 1}, r"n_microbatches >= p"),
    ],
)
def test_other_bad_pipeline_settings(kwargs, match):
    args = {"p": 2, "batch_size": 8, "n_microbatches": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        pipeline.validate_pipeline(CFG, **args)


def test_valid_pipeline_settings_pass():
    pipeline.validate_pipeline(CFG, p=4, batch_size=8, n_microbatches=8, schedule="1f1b")
    pipeline.validate_pipeline(CFG, p=2, batch_size=8, n_microbatches=1, schedule="naive")


def test_tensor_parallel_degree_must_divide_heads():
    with pytest.raises(ValueError, match=r"tp=3 does not divide n_head=4.*\[1, 2, 4\]"):
        tensor.validate_tensor_parallel(CFG, 3)
    with pytest.raises(ValueError, match=r"tp=0"):
        tensor.validate_tensor_parallel(CFG, 0)
    with pytest.raises(ValueError, match=r"n_head"):
        tensor.apply_tensor_parallel(GPT(CFG), world_size=3, rank=0)
    tensor.validate_tensor_parallel(CFG, 4)


def test_tensor_parallel_message_covers_the_hidden_size_split():
    # d_model = n_head x head_dim, so the head check is also the hidden-size check.
    cfg = ModelConfig(vocab_size=16, seq_len=4, n_layer=1, n_head=4, d_model=12)
    tensor.validate_tensor_parallel(cfg, 2)
    with pytest.raises(ValueError, match=r"tp=8 does not divide n_head=4.*d_model=12"):
        tensor.validate_tensor_parallel(cfg, 8)


# --- partition --------------------------------------------------------------------------------


def test_partition_by_params_is_contiguous_covering_and_balanced():
    cfg = ModelConfig(vocab_size=256, seq_len=64, n_layer=8, n_head=4, d_model=64)
    for p in range(1, 9):
        bounds = pipeline.partition(cfg, p)
        assert len(bounds) == p and bounds[0][0] == 0 and bounds[-1][1] == 8
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds)), "stages must be contiguous"
        assert all(end > start for start, end in bounds), "every stage needs a block"
        # Optimal: no other split has a smaller largest stage (brute force over all cuts).
        best = min(
            max(pipeline.stage_costs(cfg, _bounds(cuts, 8)))
            for cuts in itertools.combinations(range(1, 8), p - 1)
        )
        assert max(pipeline.stage_costs(cfg, bounds)) == best


def _bounds(cuts, L):
    edges = [0, *cuts, L]
    return list(itertools.pairwise(edges))


def test_partition_counts_embeddings_and_head():
    # With a huge vocabulary the embedding and head outweigh blocks: end stages get fewer.
    cfg = ModelConfig(vocab_size=4096, seq_len=16, n_layer=6, n_head=2, d_model=32)
    bounds = pipeline.partition(cfg, 3)
    sizes = [end - start for start, end in bounds]
    assert sizes[1] > sizes[0] and sizes[1] > sizes[2]
    assert (
        sum(pipeline.unit_param_counts(cfg))
        == GPT(
            ModelConfig(
                vocab_size=4096, seq_len=16, n_layer=6, n_head=2, d_model=32, tie_weights=False
            )
        ).num_params()
    )


def test_partition_by_time_follows_the_measured_times():
    slow_first = [0.0, 10.0, 1.0, 1.0, 1.0, 0.0]  # embeddings, 4 blocks, head
    assert pipeline.partition(CFG, 2, by="time", times=slow_first) == [(0, 1), (1, 4)]
    assert pipeline.partition(CFG, 2, by="time", times=[1.0, 1.0, 1.0, 10.0]) == [(0, 3), (3, 4)]
    with pytest.raises(ValueError, match=r"needs times"):
        pipeline.partition(CFG, 2, by="time")
    with pytest.raises(ValueError, match=r"L\+2=6"):
        pipeline.partition(CFG, 2, by="time", times=[1.0, 2.0])
    with pytest.raises(ValueError, match=r"by='flops'"):
        pipeline.partition(CFG, 2, by="flops")


def test_measure_unit_times_gives_one_time_per_unit():
    model = GPT(CFG)
    times = pipeline.measure_unit_times(model, torch.zeros(2, 16, dtype=torch.long), repeats=2)
    assert len(times) == CFG.n_layer + 2 and all(t > 0 for t in times)
    assert len(pipeline.partition(CFG, 2, by="time", times=times)) == 2


# --- stages compose into the whole model ---------------------------------------------------


@pytest.mark.parametrize("tie", [True, False])
def test_stages_chained_in_one_process_equal_the_model(tie):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, seq_len=8, n_layer=4, n_head=2, d_model=16, tie_weights=tie)
    model = GPT(cfg)
    bounds = pipeline.partition(cfg, 3)
    stages = [pipeline.StageModule(model, bounds, s) for s in range(3)]
    x = torch.randint(0, 64, (2, 8))
    h = x
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(h, model(x)[0])
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert len(names) == len(set(names))  # each block on exactly one stage
    # Tied: the last stage holds its own copy of the embedding (Megatron), equal in value.
    last, first = stages[-1], stages[0]
    assert last.lm_head.weight is not first.wte.weight
    torch.testing.assert_close(
        last.lm_head.weight, first.wte.weight if tie else model.lm_head.weight
    )


def test_single_stage_keeps_the_tie():
    model = GPT(CFG)
    stage = pipeline.StageModule(model, [(0, CFG.n_layer)], 0)
    assert stage.lm_head.weight is stage.wte.weight


# --- schedules ---------------------------------------------------------------------------------


def _seq(text: str) -> list[tuple[str, int]]:
    """'F0 B0' -> [("F", 0), ("B", 0)]: schedules as the papers draw them."""
    return [(a[0], int(a[1:])) for a in text.split()]


def test_schedule_orders():
    assert schedules.gpipe_order(2, 3, 1) == _seq("F0 F1 F2 B0 B1 B2")
    assert schedules.one_f_one_b_order(3, 4, 0) == _seq("F0 F1 F2 B0 F3 B1 B2 B3")
    assert schedules.one_f_one_b_order(3, 4, 2) == _seq("F0 B0 F1 B1 F2 B2 F3 B3")
    assert schedules.naive_order(2, 0) == [("F", 0), ("B", 0)]
    for p, m in itertools.product(range(1, 5), range(1, 9)):
        for s in range(p):
            for name in ("gpipe", "1f1b"):
                order = schedules.schedule_order(name, p, m, s)
                assert sorted(order) == sorted(
                    [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
                )
    with pytest.raises(ValueError, match="schedule='zb'"):
        schedules.schedule_order("zb", 2, 2, 0)


@pytest.mark.parametrize(("p", "m"), [(2, 1), (2, 4), (4, 4), (4, 8), (3, 5)])
def test_activations_in_flight_gpipe_m_and_1f1b_at_most_p(p, m):
    for s in range(p):
        assert schedules.peak_in_flight(schedules.gpipe_order(p, m, s)) == m
        assert schedules.peak_in_flight(schedules.one_f_one_b_order(p, m, s)) == min(p - s, m)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(2, 1), (2, 2), (2, 4), (2, 8), (4, 8), (3, 5)])
def test_simulated_bubble_equals_the_formula(name, p, m):
    events = schedules.simulate(name, p, m, t_f=1.0, t_b=2.0)
    per_rank = timeline.bubble_from_events(events)
    for r in range(p):
        assert per_rank[r]["bubble"] == pytest.approx(formulas.bubble_fraction(p, m))
        overhead = per_rank[r]["idle_s"] / per_rank[r]["busy_s"]
        assert overhead == pytest.approx(formulas.bubble_overhead(p, m))
    assert timeline.mean_bubble(events) == pytest.approx(formulas.bubble_fraction(p, m))


def test_simulated_communication_adds_to_the_bubble():
    ideal = timeline.mean_bubble(schedules.simulate("gpipe", 2, 4))
    slow = timeline.mean_bubble(schedules.simulate("gpipe", 2, 4, t_comm=0.5))
    assert slow > ideal


def test_naive_split_bubble_is_gpipe_with_one_microbatch():
    events = schedules.simulate("naive", 4, 1)
    assert timeline.mean_bubble(events) == pytest.approx(formulas.bubble_fraction(4, 1))


# --- bubble from recorded events ------------------------------------------------------------


def test_bubble_from_synthetic_events():
    # Two ranks; the step spans 0..10 s. Rank 0 works 0-2 and 6-10 (6 s), rank 1 2-6 (4 s).
    events = [
        {"rank": 0, "mb": 0, "kind": "F", "start_s": 0.0, "end_s": 2.0},
        {"rank": 1, "mb": 0, "kind": "F", "start_s": 2.0, "end_s": 3.0},
        {"rank": 1, "mb": 0, "kind": "B", "start_s": 3.0, "end_s": 6.0},
        {"rank": 0, "mb": 0, "kind": "B", "start_s": 6.0, "end_s": 10.0},
    ]
    got = timeline.bubble_from_events(events)
    assert got[0] == {"busy_s": 6.0, "idle_s": 4.0, "step_s": 10.0, "bubble": 0.4}
    assert got[1]["bubble"] == pytest.approx(0.6)
    assert timeline.mean_bubble(events) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="empty"):
        timeline.bubble_from_events([])


def test_timeline_records_spans_with_an_injected_clock():
    ticks = iter([100.0, 100.5, 101.0, 103.0])
    tl = timeline.Timeline(rank=1, t0=100.0, clock=lambda: next(ticks))
    with tl.span("F", 0):
        pass
    with tl.span("B", 0):
        pass
    assert tl.events == [
        {"rank": 1, "mb": 0, "kind": "F", "start_s": 0.0, "end_s": 0.5},
        {"rank": 1, "mb": 0, "kind": "B", "start_s": 1.0, "end_s": 3.0},
    ]
    with pytest.raises(ValueError, match="kind='X'"):
        tl.add("X", 0, 0.0, 1.0)


def test_plot_timeline_draws_one_bar_per_event():
    import matplotlib.pyplot as plt

    events = schedules.simulate("1f1b", 2, 4)
    ax = timeline.plot_timeline(events, title="1F1B")
    assert len(ax.patches) == len(events) == 16
    assert ax.get_title() == "1F1B"
    plt.close(ax.figure)


def test_plot_timeline_labels_a_modelled_clock_in_forwards_not_seconds():
    import matplotlib.pyplot as plt

    events = schedules.simulate("gpipe", 2, 2, t_f=1.0, t_b=2.0)
    ax = timeline.plot_timeline(events, unit="forward")
    assert ax.get_xlabel() == "time (units of one forward)"
    # GPipe takes (m + p − 1)(t_f + t_b) = 3 · 3 forwards, and the axis counts them unscaled
    assert max(p.get_x() + p.get_width() for p in ax.patches) == 9.0
    plt.close(ax.figure)
    ax = timeline.plot_timeline(events, unit="ms")
    assert ax.get_xlabel() == "time (ms)"
    plt.close(ax.figure)
    with pytest.raises(ValueError, match="'forward'"):
        timeline.plot_timeline(events, unit="hours")


# --- tensor parallelism, sliced by hand in one process -------------------------------------------


def test_column_then_row_parallel_slices_sum_to_the_whole_mlp():
    torch.manual_seed(0)
    fc, proj = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)
    x = torch.randn(2, 3, 8)
    want = proj(torch.nn.functional.gelu(fc(x), approximate="tanh"))
    n = 4
    partial = torch.zeros_like(want)
    for r in range(n):  # without a process group, g is the identity: add the ranks by hand
        col = tensor.ColumnParallelLinear.from_linear(fc, world_size=n, rank=r)
        row = tensor.RowParallelLinear.from_linear(proj, world_size=n, rank=r)
        assert col.weight.shape == (8, 8) and row.weight.shape == (8, 8)
        partial += row(torch.nn.functional.gelu(col(x), approximate="tanh")) - proj.bias
    torch.testing.assert_close(partial + proj.bias, want)


def test_apply_tensor_parallel_with_one_rank_is_the_same_model_and_counts_allreduces():
    torch.manual_seed(0)
    ref = GPT(CFG)
    torch.manual_seed(0)
    counter = tensor.CommCounter()
    tp = tensor.apply_tensor_parallel(GPT(CFG), world_size=1, rank=0, counter=counter)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    ref_logits, _ = ref(x, x)
    logits, loss = tp(x, x)
    torch.testing.assert_close(logits, ref_logits)
    loss.backward()
    formula = tensor.tp_allreduce_bytes_per_step(CFG, 2)
    assert counter.calls == {"forward": 2 * CFG.n_layer, "backward": 2 * CFG.n_layer}
    assert counter.total_bytes == formula["message_bytes"]
    assert [n for n, _ in tp.named_parameters()] == [n for n, _ in ref.named_parameters()]


def test_tensor_parallel_parameter_formula():
    model = GPT(CFG)
    assert tensor.tp_params_per_rank(CFG, 1) == model.num_params()
    # Two ranks: the split part halves, the replicated part stays.
    torch.manual_seed(0)
    shard = tensor.apply_tensor_parallel(GPT(CFG), world_size=2, rank=1)
    assert sum(p.numel() for p in shard.parameters()) == tensor.tp_params_per_rank(CFG, 2)
    assert tensor.param_bytes_per_rank(shard) == 4 * tensor.tp_params_per_rank(CFG, 2)
    with pytest.raises(ValueError, match="micro_batch=0"):
        tensor.tp_allreduce_bytes_per_step(CFG, 0)


def test_clip_grad_norm_matches_torch_in_one_process():
    torch.manual_seed(0)
    a, b = GPT(CFG), GPT(CFG)
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    for m in (a, b):
        m(x, x)[1].backward()
    want = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.1)
    got = tensor.clip_grad_norm_(b, 0.1)
    assert got == pytest.approx(float(want), rel=1e-5)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad)
