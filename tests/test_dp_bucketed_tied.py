"""BucketedDP with tied weights and one parameter per bucket (issue 31).

The user's case: a 0.0001 MB cap (every parameter in a bucket of its own), a model whose
embedding and output head share one weight, 2 gloo ranks under ``torch.multiprocessing.spawn``.
Training was right, but in some runs a rank died at exit with SIGABRT ("terminate called
without an active exception"). A core dump showed where: gloo's worker thread
(``ProcessGroupGloo::runLoop``) destroying an ``AsyncAllreduceWork`` whose saved thread state
held a Python object, taking the GIL while the interpreter was finalizing. The Work had been
started inside backward, and BucketedDP had dropped its handle right after ``wait()``, so
gloo's worker often held the last reference (see the comment in ``after_backward``).
``scripts/stress_bucketed_dp.py`` repeats the user's run; these tests are the fast part.

A 1-rank gloo group in this process is enough: the race is between two threads of one rank.
"""

from __future__ import annotations

import contextvars
import threading
import weakref

import pytest
import torch
import torch.distributed as tdist
from torch import nn
from torch.nn import functional as F

from labkit.parallel import comm
from labkit.parallel.dp_bucketed import BucketedDP

ONE_PER_BUCKET_MB = 0.0001  # 104 bytes: smaller than any parameter below


class Tied(nn.Module):
    """An embedding and an output head sharing one weight, an MLP between them."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.emb.weight  # tied: one Parameter, two uses

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # the loss
        h = self.emb(x)
        h = h + self.mlp(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 12, (4, 5), generator=g), torch.randint(0, 12, (4, 5), generator=g)


@pytest.fixture
def group():
    """A 1-rank gloo process group in this process (HashStore: no port, no process)."""
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    yield
    tdist.destroy_process_group()


def _wrapped() -> tuple[Tied, BucketedDP]:
    torch.manual_seed(0)
    model = Tied()
    strategy = BucketedDP(1, bucket_cap_mb=ONE_PER_BUCKET_MB)
    strategy.wrap(model)
    assert all(len(b.params) == 1 for b in strategy.buckets)  # the user's one-per-bucket case
    return model, strategy


def test_the_thread_that_trains_releases_each_all_reduce_last(group, monkeypatch):
    """gloo's worker thread may let go of an all-reduce after ``wait()`` has returned; the
    strategy must still hold it then, so the worker never frees what the Work captured.

    Stand-in for the worker: a thread that holds a reference to every Work and drops it after
    backward has returned (the order seen in the core dump). What a Work captured is observed
    through a ``ContextVar`` value: torch 2.13 copies the context into the thread state at
    backward (``_engine_run_backward``), and each Work keeps that state. Before the fix the
    value was freed on the stand-in thread in every step ("freed on: ['worker', 'worker',
    'worker']").
    """
    model, _strategy = _wrapped()  # holds this step's handles, as the training loop's does
    works: list[object] = []
    all_reduce = comm.all_reduce

    def keep(t, counter, **kw):
        work = all_reduce(t, counter, **kw)
        works.append(work)  # the worker's reference, in our hands
        return work

    monkeypatch.setattr(comm, "all_reduce", keep)
    seen = contextvars.ContextVar("seen")
    freed_on: list[str] = []
    trainer = threading.get_ident()

    class Marker:  # freed when the last copy of the backward's context goes
        pass

    def backward(loss: torch.Tensor) -> None:  # runs in a context of its own
        marker = Marker()
        weakref.finalize(
            marker,
            lambda: freed_on.append("trainer" if threading.get_ident() == trainer else "worker"),
        )
        seen.set(marker)
        del marker
        loss.backward()

    steps = 3
    for step in range(steps):
        loss = model(*batch(step))
        contextvars.Context().run(backward, loss)
        del loss
        worker = threading.Thread(target=works.clear)  # the worker lets go, late
        worker.start()
        worker.join()
    # Each step's context is freed when the next step replaces its handles; the last one's
    # lives as long as the strategy (which the model's hooks keep alive).
    assert freed_on == ["trainer"] * (steps - 1), f"freed on: {freed_on}"


def test_tied_weight_is_reduced_once_per_step_and_matches_one_process(group, monkeypatch):
    """The other suspects, ruled out: a tied weight's post-accumulate-grad hook fires once per
    backward (both uses are summed before its AccumulateGrad node runs: "called after all
    gradients for a tensor have been accumulated", torch/_tensor.py), so each one-parameter
    bucket is all-reduced exactly once per step, and training equals one process's."""
    model, strategy = _wrapped()
    sent: list[int] = []
    all_reduce = comm.all_reduce

    def count(t, counter, **kw):
        sent.append(t.data_ptr())
        return all_reduce(t, counter, **kw)

    monkeypatch.setattr(comm, "all_reduce", count)
    torch.manual_seed(0)
    reference = Tied()
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.2) for m in (model, reference))
    for step in range(3):
        sent.clear()
        for m, o in ((model, opt), (reference, opt_ref)):
            m(*batch(step)).backward()
            o.step()
            o.zero_grad(set_to_none=True)
        assert sorted(sent) == sorted(b.buffer.data_ptr() for b in strategy.buckets)
    assert model.head.weight is model.emb.weight
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)
