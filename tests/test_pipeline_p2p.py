"""The pipeline's point-to-point plan cannot deadlock, even where sends do not buffer (NCCL).

gloo buffers sends, so a plan that deadlocks on NCCL still passes every CPU run. These tests
check the plan itself: ``pipeline.p2p_deadlock`` plays every rank's batches with rendezvous
semantics (a send ends only when the peer has posted the receive; FIFO per pair of ranks), the
worst case any transport can show. The checker is first shown able to fail, on the old
one-transfer-at-a-time plan whose 1F1B deadlocks for m >= 2; then the executor is shown to
post exactly ``p2p_plan``'s batches (a fake ``torch.distributed`` records them), so the plan
checked here is the one that runs. A 3-rank gloo job runs the batched transfers for real,
with a middle stage, against the single-process model.
"""

from __future__ import annotations

import types

import pytest
import torch

from labkit.config import ModelConfig
from labkit.jobs import launch
from labkit.parallel import pipeline
from labkit.parallel.schedules import schedule_order
from labkit.workers import pp_train

GRID = [
    (name, p, m)
    for name in ("naive", "gpipe", "1f1b")
    for p in (2, 3, 4)
    for m in (1, 2, 4, 8)
    if name != "naive" or m == 1
]


def one_at_a_time(name: str, p: int, m: int, stage: int) -> list[list[tuple]]:
    """The plan of the executor before the fix: every transfer posted alone, in action order
    (receive before computing, send after), written out here independently of ``p2p_plan``."""
    batches: list[list[tuple]] = []
    for kind, j in schedule_order(name, p, m, stage):
        if kind == "F":
            if stage > 0:
                batches.append([("recv", stage - 1, "act", j)])
            if stage < p - 1:
                batches.append([("send", stage + 1, "act", j)])
        else:
            if stage < p - 1:
                batches.append([("recv", stage + 1, "grad", j)])
            if stage > 0:
                batches.append([("send", stage - 1, "grad", j)])
    return batches


# --- the checker can fail --------------------------------------------------------------------


def test_checker_finds_the_old_1f1b_deadlock():
    verdict = pipeline.p2p_deadlock([one_at_a_time("1f1b", 2, 2, r) for r in range(2)])
    assert verdict is not None and verdict.startswith("deadlock")
    # The cycle of the review: stage 0 stuck sending a1, stage 1 stuck sending g0.
    assert "('send', 1, 'act', 1)" in verdict and "('send', 0, 'grad', 0)" in verdict


@pytest.mark.parametrize("p,m", [(2, 4), (3, 2), (4, 8)])
def test_checker_finds_the_old_1f1b_deadlock_for_other_sizes(p, m):
    assert pipeline.p2p_deadlock([one_at_a_time("1f1b", p, m, r) for r in range(p)])


def test_old_plan_was_fine_where_it_never_hung():
    # GPipe, naive and 1F1B with one micro-batch never pair a send with a receive the other
    # way: the checker must not cry wolf there.
    for name, p, m in [("gpipe", 2, 4), ("naive", 3, 1), ("1f1b", 4, 1)]:
        assert pipeline.p2p_deadlock([one_at_a_time(name, p, m, r) for r in range(p)]) is None


def test_checker_reports_a_send_met_by_the_wrong_receive():
    plans = [[[("send", 1, "act", 0)], [("send", 1, "act", 1)]],
             [[("recv", 0, "act", 1)], [("recv", 0, "act", 0)]]]  # fmt: skip
    assert "receives act 1" in pipeline.p2p_deadlock(plans)


def test_checker_reports_a_receive_nobody_answers():
    assert "deadlock" in pipeline.p2p_deadlock([[[("recv", 1, "act", 0)]], []])


def test_a_send_and_receive_posted_together_meet():
    both = [[[("send", 1, "act", 0), ("recv", 1, "grad", 0)]],
            [[("send", 0, "grad", 0), ("recv", 0, "act", 0)]]]  # fmt: skip
    assert pipeline.p2p_deadlock(both) is None


# --- the plan the executor uses does not deadlock --------------------------------------------


@pytest.mark.parametrize("name,p,m", GRID)
def test_batched_plan_never_deadlocks(name, p, m):
    plans = [pipeline.p2p_batches(name, p, m, r) for r in range(p)]
    assert pipeline.p2p_deadlock(plans) is None


@pytest.mark.parametrize("name,p,m", GRID)
def test_batched_plan_moves_every_tensor_once(name, p, m):
    """Same transfers as before, in the same order per direction: only the grouping changed."""
    for r in range(p):
        batches = pipeline.p2p_batches(name, p, m, r)
        flat = [op for batch in batches for op in batch]
        old = [b[0] for b in one_at_a_time(name, p, m, r)]
        assert sorted(flat) == sorted(old)
        for verb in ("send", "recv"):
            for peer in (r - 1, r + 1):
                assert [o for o in flat if o[:2] == (verb, peer)] == [
                    o for o in old if o[:2] == (verb, peer)
                ]
        # a batch joins at most one send and one receive, both with the same neighbour
        for batch in batches:
            assert len(batch) in (1, 2)
            if len(batch) == 2:
                assert [o[0] for o in batch] == ["send", "recv"] and batch[0][1] == batch[1][1]


def test_1f1b_steady_state_pairs_forward_send_with_backward_receive():
    assert pipeline.p2p_batches("1f1b", 2, 2, 0) == [
        [("send", 1, "act", 0)],
        [("send", 1, "act", 1), ("recv", 1, "grad", 0)],
        [("recv", 1, "grad", 1)],
    ]
    assert pipeline.p2p_batches("1f1b", 2, 2, 1) == [
        [("recv", 0, "act", 0)],
        [("send", 0, "grad", 0), ("recv", 0, "act", 1)],
        [("send", 0, "grad", 1)],
    ]


def test_a_send_is_held_back_only_until_the_very_next_action():
    """Holding a send must not delay the neighbour: it joins the next action's receive only,
    posted before anything else is computed."""
    for name, p, m in GRID:
        for r in range(p):
            plan = pipeline.p2p_plan(schedule_order(name, p, m, r), r, p)
            for i, (before, _) in enumerate(plan):
                if any(o[0] == "send" for o in before):
                    assert i > 0 and not plan[i - 1][1] and len(before) == 2


# --- the executor posts exactly that plan ----------------------------------------------------


def _isend(*args, **kwargs):  # identities only: the fake tells sends from receives by them
    raise AssertionError("isend must go through batch_isend_irecv")


def _irecv(*args, **kwargs):
    raise AssertionError("irecv must go through batch_isend_irecv")


class FakeDist:
    """Just enough of ``torch.distributed`` for one rank's ``Pipeline.step``, recording calls.

    Received tensors are zeros: the test is about what is posted when, not about values.
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self.isend, self.irecv = _isend, _irecv
        self.log: list[tuple] = []

    def is_initialized(self) -> bool:
        return True

    def get_world_size(self) -> int:
        return self.world

    def P2POp(self, op, tensor, peer):  # torch's name
        return types.SimpleNamespace(op=op, tensor=tensor, peer=peer)

    def batch_isend_irecv(self, ops):
        batch = []
        for op in ops:
            assert op.op in (_isend, _irecv)
            if op.op is _irecv:
                op.tensor.zero_()
            batch.append(("send" if op.op is _isend else "recv", op.peer, tuple(op.tensor.shape)))
        n = len(self.log)
        self.log.append(("batch", batch))
        work = types.SimpleNamespace(wait=lambda: self.log.append(("wait", n)))
        return [work]

    def barrier(self, *args, **kwargs):
        self.log.append(("barrier",))

    def broadcast(self, tensor, src, *args, **kwargs):
        self.log.append(("broadcast",))

    def all_reduce(self, tensor, *args, **kwargs):
        self.log.append(("all_reduce",))


CFG = ModelConfig(seq_len=8, n_layer=4, n_head=2, d_model=16)
B = 8


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("name,m", [("naive", 1), ("gpipe", 4), ("1f1b", 4), ("1f1b", 2)])
def test_executor_posts_the_plan(monkeypatch, name, m, p):
    x, y = pp_train.make_batch(CFG, B, seed=0)
    act_shape = (B // m, CFG.seq_len, CFG.d_model)
    for r in range(p):
        fake = FakeDist(p)
        monkeypatch.setattr(pipeline, "tdist", fake)
        pipe = pipeline.Pipeline(pp_train.build_model(CFG, 0), pipeline.partition(CFG, p),
                                 rank=r, device=torch.device("cpu"))  # fmt: skip
        for step in range(2):
            fake.log.clear()
            pipe.step(name, x, y, m)
            log = fake.log
            # a collective precedes the first batch_isend_irecv, once per pipeline
            assert (log[0] == ("barrier",)) == (step == 0)
            posted = [entry[1] for entry in log if entry[0] == "batch"]
            expected = pipeline.p2p_batches(name, p, m, r)
            assert [[(v, peer) for v, peer, _ in b] for b in posted] == [
                [(v, peer) for v, peer, *_ in b] for b in expected
            ]
            assert all(shape == act_shape for b in posted for *_, shape in b)
            for i, entry in enumerate(log):
                if entry[0] != "batch":
                    continue
                waits = [k for k, e in enumerate(log) if e == ("wait", i)]
                assert len(waits) == 1
                if any(v == "recv" for v, *_ in entry[1]):
                    assert waits[0] == i + 1, "a receive is waited for before anything else"
                else:
                    assert waits[0] < log.index(("broadcast",)), "sends end within the step"
            assert not pipe.links.outbox and not pipe.links.pending


# --- and it runs: three gloo ranks, batched transfers, a middle stage -------------------------

P3_M = 4


@pytest.fixture(scope="module")
def three_stage_job():
    return launch.run(
        pp_train.PPTrainConfig(batch_size=B, microbatches=P3_M, schedules=("gpipe", "1f1b"),
                               warmup=0, repeats=2, save_grads=True, seed=0),
        nproc=3,
        timeout_s=180,
        stream=False,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_three_gloo_stages_equal_the_sequential_model(three_stage_job, schedule):
    cfg = ModelConfig(**pp_train.DEFAULT_MODEL)
    model = pp_train.build_model(cfg, seed=0)
    x, y = pp_train.make_batch(cfg, B, seed=0)
    _, loss = model(x, y)
    loss.backward()
    grads = {}
    for r in range(3):
        saved = torch.load(three_stage_job.log_dir / f"pp_{schedule}_m{P3_M}_rank{r}.pt")
        assert saved["loss"] == pytest.approx(float(loss.detach()), abs=1e-5)
        grads.update(saved["grads"])
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, atol=1e-6, rtol=1e-4, msg=name)
