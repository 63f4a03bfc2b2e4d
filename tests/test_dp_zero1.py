"""ZeRO-1's sharded optimizer behaves as torch's optimizer, and keeps one gradient buffer.

In this process on a 1-rank gloo group (HashStore: no port, no process): with one rank the
shard is the whole buffer, so torch's AdamW on the same model is the exact reference. The
2-rank behaviour (frozen weights, different seeds, tied weights) is in test_dp_toy_parity.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist
from torch import nn

from labkit.memory import optimizer_state_tensors
from labkit.parallel.zero1 import ZeRO1


@pytest.fixture(scope="module")
def group():
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    yield
    tdist.destroy_process_group()


class Toy(nn.Module):
    """``unused`` is trainable but never in the graph: its grad stays None."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.b = nn.Linear(8, 2)
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.frozen(torch.relu(self.a(x))))).square().mean()


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.5)  # frozen included


def test_parameters_without_a_gradient_are_skipped_like_torch(group):
    """Frozen (requires_grad=False) and unused (grad None) parameters: untouched, no state,
    the others equal torch's AdamW. Before: both were stepped on a zero gradient, and the
    weight decay (0.5 here) shrank them by lr x 0.5 per step."""
    torch.manual_seed(0)
    ref, mine = Toy(), Toy()
    mine.load_state_dict(ref.state_dict())
    start = ref.a.weight.detach().clone()
    opt_ref, opt = adamw(ref), ZeRO1(1, rank=0).optimizer(mine, adamw)
    for step in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        for model, o in ((ref, opt_ref), (mine, opt)):
            model(x).backward()
            o.step()
            o.zero_grad(set_to_none=True)
    for (name, a), (_, b) in zip(ref.named_parameters(), mine.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0, msg=name)
    assert torch.equal(mine.unused, torch.ones(3))
    assert not torch.equal(mine.a.weight, start)  # it did train
    # Optimizer state exists only for what torch's optimizer keeps state for.
    numel = [sum(t.numel() for t in optimizer_state_tensors(o)) for o in (opt, opt_ref)]
    assert numel[0] == numel[1] == 2 * (mine.a.weight.numel() + 8 + 8 * 2 + 2)  # m and v


def test_gradients_live_in_one_persistent_buffer(group):
    """After backward each .grad is a view of the group's flat gradient buffer, the same
    buffer every step, and micro-batches accumulate into it in place: the full-size gradient
    exists once. Before: .grad were separate tensors and step() allocated a second flat copy
    of all of them every step."""
    torch.manual_seed(0)
    model = Toy()
    opt = ZeRO1(1, rank=0).optimizer(model, adamw)
    x = torch.randn(5, 4)
    seen = set()
    for _ in range(2):  # two steps
        for _ in range(2):  # two micro-batches each: the second adds into the view
            model(x).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        storages = {g.untyped_storage().data_ptr() for g in grads}
        assert len(storages) == len(opt.param_groups)  # AdamW's one group: one buffer
        seen |= storages
        for g in opt.groups:
            storage = g.grads.untyped_storage().data_ptr()
            for p in g.params:
                if p.grad is not None:
                    assert p.grad.untyped_storage().data_ptr() == storage
        expected = 2 * torch.autograd.grad(model(x), model.a.weight)[0]
        torch.testing.assert_close(model.a.weight.grad, expected)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert len(seen) == len(opt.param_groups)  # the same buffer in both steps
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(g.grads.numel() for g in opt.groups) == trainable  # frozen: no slot
