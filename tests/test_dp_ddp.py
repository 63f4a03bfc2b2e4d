"""The course's DDP path as torch 2.13 builds it: the small first bucket, and 4Ψ of gradients.

In this process on a 1-rank gloo group (HashStore: no port, no process): DDP's reducer, its
buckets and its communication hook run the same with one rank. Measured by storage (which
tensors share memory), not by timing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist
from torch import nn

from labkit.parallel.ddp import TorchDDP

N_LAYERS = 10  # ten 256x256 linears: 2.6 MB of fp32 gradients, more than the 1 MiB first cap


@pytest.fixture(scope="module")
def group():
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    yield
    tdist.destroy_process_group()


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(N_LAYERS)])


def bucket_bytes_per_step(strategy: TorchDDP, steps: int = 2) -> list[list[int]]:
    """Bytes of each bucket DDP reduced, step by step (from the counting hook's storages)."""
    ddp = strategy.wrap(model())
    out = []
    for _ in range(steps):
        ddp(torch.randn(4, 256)).sum().backward()
        out.append([nbytes for _, nbytes in strategy.bucket_storages.values()])
        ddp.zero_grad(set_to_none=True)
    return out


def test_the_small_first_bucket_exists_only_when_bucket_cap_mb_is_none(group):
    """torch 2.13 (_BucketCapacityConfig): the first bucket is capped at
    dist._DEFAULT_FIRST_BUCKET_BYTES (1 MiB) only when bucket_cap_mb is None; any number caps
    every bucket alike. The first iteration uses one bucket, the rebuilt ones apply the caps.
    Caught before: TorchDDP passed bucket_cap_mb=25 by default, so the course never had it."""
    total = 4 * sum(p.numel() for p in model().parameters())
    first_cap = tdist._DEFAULT_FIRST_BUCKET_BYTES
    default = bucket_bytes_per_step(TorchDDP(1))  # bucket_cap_mb=None
    assert default[0] == [total]  # step 1: every gradient in one bucket
    first, *rest = default[1]  # step 2: rebuilt, the last layers' bucket first
    assert first_cap <= first < first_cap + 4 * 256 * 257  # closes at the layer crossing 1 MiB
    assert rest and first + sum(rest) == total
    numbered = bucket_bytes_per_step(TorchDDP(1, bucket_cap_mb=25.0))
    assert numbered == [[total], [total]]  # 25 MiB for the first bucket too


@pytest.mark.parametrize("as_view", [True, False])
def test_gradient_as_bucket_view_holds_the_gradients_once(group, as_view):
    """With gradient_as_bucket_view every .grad is a view into a DDP bucket: the gradients
    take 4 bytes per parameter. Without it the reducer's buckets are a second copy: 8."""
    strategy = TorchDDP(1, gradient_as_bucket_view=as_view)
    ddp = strategy.wrap(model())
    params = list(ddp.parameters())
    psi = sum(p.numel() for p in params)
    opt = torch.optim.SGD(params, lr=0.1)
    for _ in range(2):  # the views are set up during the first backward
        ddp(torch.randn(4, 256)).sum().backward()
        opt.step()
    grads = {p.grad.untyped_storage().data_ptr() for p in params}
    buckets = {ptr for ptr, _ in strategy.bucket_storages.values()}
    mem = strategy.memory(ddp, opt)
    assert mem["gradients"] == 4 * psi  # the storages .grad lives in
    if as_view:
        assert grads <= buckets  # every gradient lives inside a bucket
        assert mem["gradients"] + mem["gradient_buckets"] == 4 * psi
    else:
        assert not grads & buckets  # separate tensors, copied into the buckets
        assert mem["gradients"] + mem["gradient_buckets"] == 8 * psi


def test_set_to_none_then_no_sync_holds_the_gradients_twice_while_accumulating(group):
    """The views do not survive zero_grad(set_to_none=True) (what labkit.train.train_step
    calls): the next no_sync backward makes fresh .grad tensors while DDP's buckets stay,
    8 bytes per parameter until the synchronised backward turns .grad into views again.

    Measured from step 3: DDP rebuilds its buckets once, in the forward of the second
    synchronised step (in the order gradients arrived in the first), so until the hook has
    seen the new buckets its record of the old ones can be stale (2 of 30 runs counted 4Ψ
    while accumulating in step 2; none in 80 from step 3 on)."""
    strategy = TorchDDP(1)
    ddp = strategy.wrap(model())
    psi = sum(p.numel() for p in ddp.parameters())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    seen = []
    for _ in range(4):
        with ddp.no_sync():
            ddp(torch.randn(4, 256)).sum().backward()
        accumulating = strategy.memory(ddp, opt)
        ddp(torch.randn(4, 256)).sum().backward()
        synced = strategy.memory(ddp, opt)
        seen.append([sum(m[k] for k in ("gradients", "gradient_buckets")) // (4 * psi)
                     for m in (accumulating, synced)])  # fmt: skip
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert seen[0][0] == 1  # step 1: no bucket seen yet by the hook
    assert seen[2:] == [[2, 1], [2, 1]]
