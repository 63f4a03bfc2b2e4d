"""Pipeline parallelism on 2 gloo ranks equals the sequential GPT, for every schedule.

One launch runs all five schedules (naive, GPipe, 1F1B, and torch.distributed.pipelining's
GPipe and 1F1B) on one batch; the single-process reference is computed here. Also checked on
the same launch: each rank ran its schedule's actions in order, no stage started a micro-batch
before its neighbour handed it over, and the activations held match the schedule's
prediction (GPipe m micro-batches, 1F1B p − stage).

Tolerance: fp32, loss within 1e-5 and gradients within atol 1e-6 + rtol 1e-4 of the
reference (micro-batching only reorders the sums; measured max |diff| 1.5e-7).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from labkit.config import ModelConfig
from labkit.jobs import launch
from labkit.parallel import pipeline
from labkit.parallel.schedules import schedule_order
from labkit.workers import pp_train

M = 4
B = 8
P = 2
CFG = ModelConfig(**pp_train.DEFAULT_MODEL)  # 4 layers, tied embeddings: the hard case


@pytest.fixture(scope="module")
def job():
    return launch.run(
        pp_train.PPTrainConfig(batch_size=B, microbatches=M, warmup=1, repeats=1, save_grads=True,
                               seed=0),
        nproc=P,
        timeout_s=180,
        stream=False,
    )


@pytest.fixture(scope="module")
def reference():
    model = pp_train.build_model(CFG, seed=0)
    x, y = pp_train.make_batch(CFG, B, seed=0)
    _, loss = model(x, y)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def _m(schedule: str) -> int:
    return 1 if schedule == "naive" else M


@pytest.mark.slow
@pytest.mark.parametrize("schedule", pipeline.SCHEDULES)
def test_loss_and_gradients_equal_the_sequential_model(job, reference, schedule):
    ref_loss, ref_grads = reference
    grads: dict[str, torch.Tensor] = {}
    for r in range(P):
        saved = torch.load(job.log_dir / f"pp_{schedule}_m{_m(schedule)}_rank{r}.pt")
        assert saved["loss"] == pytest.approx(ref_loss, abs=1e-5)
        grads.update({f"rank{r}:{n}": g for n, g in saved["grads"].items()})
    by_name = {k.split(":", 1)[1]: g for k, g in grads.items()}
    # Every parameter of the model has a gradient on exactly one stage, except the tied
    # embedding: stage 0's wte and the last stage's lm_head copy both hold the summed one.
    assert set(by_name) == set(ref_grads) | {"lm_head.weight"}
    assert len(grads) == len(by_name)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(by_name[name], ref, atol=1e-6, rtol=1e-4, msg=name)
    torch.testing.assert_close(
        by_name["lm_head.weight"], ref_grads["wte.weight"], atol=1e-6, rtol=1e-4
    )


@pytest.mark.slow
@pytest.mark.parametrize("schedule", pipeline.SCHEDULES)
def test_events_follow_the_schedule_and_data_dependencies(job, schedule):
    m = _m(schedule)
    events = job.ranks[0]["events"][f"{schedule}/{m}"]
    done = {(e["rank"], e["kind"], e["mb"]): e for e in events}
    assert len(events) == len(done) == 2 * m * P, "one F and one B per micro-batch per rank"
    for r in range(P):
        mine = sorted((e for e in events if e["rank"] == r), key=lambda e: e["start_s"])
        got = [(e["kind"], e["mb"]) for e in mine]
        # Our executor runs the action list; torch's schedules must run the same orders.
        assert got == schedule_order(schedule.removeprefix("torch_"), P, m, r)
        assert all(a["end_s"] <= b["start_s"] for a, b in itertools.pairwise(mine)), "overlap"
    for j in range(m):  # a stage cannot start before its neighbour handed the tensor over
        assert done[(1, "F", j)]["start_s"] >= done[(0, "F", j)]["end_s"]
        assert done[(0, "B", j)]["start_s"] >= done[(1, "B", j)]["end_s"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", pipeline.SCHEDULES)
def test_activation_memory_matches_the_schedule(job, schedule):
    m = _m(schedule)
    for r in range(P):
        run = next(x for x in job.ranks[r]["runs"] if x["schedule"] == schedule)
        act = run["activations"]
        expected = {"naive": 1, "gpipe": m, "1f1b": min(P - r, m)}[schedule.removeprefix("torch_")]
        assert act["peak_in_flight"] == act["predicted_in_flight"] == expected
        assert act["bytes_per_microbatch"] > 0
        assert act["peak_bytes"] == pytest.approx(act["in_flight_x_measured_mb_bytes"], rel=0.02)
        assert 0.0 <= run["bubble"] < 1.0 and run["bubble_formula"] == (P - 1) / (m + P - 1)
    assert job.ranks[0]["bounds"] == [[0, 2], [2, 4]]  # JSON turns tuples into lists


def test_a_micro_batch_is_charged_its_own_token_ids_not_the_whole_batchs():
    """Stage 0's input is a chunk (a view) of the batch's ids: the probe counts that slice, so
    a micro-batch's bytes do not depend on how large a batch it was cut from."""
    from labkit.model import GPT
    from labkit.parallel.timeline import Timeline

    torch.manual_seed(0)
    model = GPT(CFG)
    half = CFG.n_layer // 2
    stage = pipeline.StageModule(model, [(0, half), (half, CFG.n_layer)], stage=0)
    charged = []
    for batch in (2, 8):
        stage.probe = pipeline.StageProbe(Timeline(rank=0), torch.device("cpu"), num_stages=P)
        ids = torch.randint(0, CFG.vocab_size, (batch, CFG.seq_len))
        stage(ids.chunk(batch // 2)[0])  # a 2-sequence micro-batch, a view into `ids`
        charged.append(stage.probe.bytes_per_mb[0])
    assert charged[0] == charged[1], charged


@pytest.mark.parametrize("stage", [0, 1])
def test_a_stages_saved_bytes_equal_the_prediction_to_the_byte(stage):
    """memory.predicted_stage_activations: the blocks' formula plus what a stage keeps outside
    them (ids on the first, the final LayerNorm's input, output and statistics on the last)."""
    from labkit import memory
    from labkit.model import GPT
    from labkit.parallel.timeline import Timeline

    torch.manual_seed(0)
    half, b = CFG.n_layer // 2, 2
    module = pipeline.StageModule(GPT(CFG), [(0, half), (half, CFG.n_layer)], stage=stage)
    module.probe = pipeline.StageProbe(Timeline(rank=0), torch.device("cpu"), num_stages=P)
    if stage == 0:
        x = torch.randint(0, CFG.vocab_size, (b, CFG.seq_len))
    else:
        x = torch.randn(b, CFG.seq_len, CFG.d_model, requires_grad=True)
    module(x)
    predicted = memory.predicted_stage_activations(CFG, b, blocks=half, first=stage == 0,
                                                   last=stage == P - 1)  # fmt: skip
    assert module.probe.bytes_per_mb[0] == sum(predicted.values()), predicted
