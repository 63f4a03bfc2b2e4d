"""What notebook 02's data-parallel checks compare a learner's class against: the check model,
each rank's batches, and the reference answers.

The references are the library's own strategies (``labkit.parallel.dp_naive``,
``labkit.parallel.dp_bucketed``, ``labkit.parallel.zero1``), each behind a short adapter that
gives it the interface the notebook's exercise cells ask for: ``Cls(model, world_size, ...)``,
then ``finish_gradient_sync()`` after backward, where the library synchronises at the end of
backward by itself. ZeRO-1's exercise has an interface of its own (one shard parameter handed
to ``make_optimizer``), so its reference is the exercise's class, built from the library's
shard bounds and collectives (see :class:`ZeRO1Optimizer`). Separate from the checks so that
the benchmark (``labkit.course.exercises.data_parallel.bench``) can time the references without them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from labkit.parallel import comm, zero1
from labkit.parallel.dp_bucketed import BucketedDP
from labkit.parallel.dp_naive import NaiveDP

# fp32 gradients averaged by two different all-reduce schedules differ by rounding only
# (with 2 ranks not even that: a + b is exact to compare, and /2 is exact); a missing average
# is off by a factor of world_size.
RTOL, ATOL = 1e-5, 1e-7
STEPS = 2  # two steps: a list of handles that is never cleared shows in the second
ROWS_PER_RANK = 2  # sequences in each rank's slice of the global batch
BUCKET_CAP_MB = 0.02  # ~20 kB: several buckets in CheckLM, and a small last one
LR, WEIGHT_DECAY = 1e-2, 0.1  # SGD in the DDP checks, torch's AdamW in ZeRO-1's (and its reference)


# --------------------------------------------------------------------------- the check model


class CheckLM(nn.Module):
    """A language model small enough to run in milliseconds, with a real model's traps.

    * a frozen parameter (``wpe.weight``: ``requires_grad=False``, no ``.grad`` at all);
    * a tied one (``head.weight`` is ``wte.weight``: one tensor, listed once by
      ``parameters()``, whose gradient arrives from two places);
    * a buffer (``shift``), random like the weights, which DDP broadcasts too;
    * a tiny first parameter (``scale``, one element) used at the input: backward finishes it
      last, so it lands in the last bucket, which stays smaller than any cap; and it makes the
      number of trainable elements odd, so ZeRO-1's shards need padding on 2 ranks.
    """

    def __init__(self, vocab: int = 64, d: int = 32, n_layer: int = 2, seq_len: int = 8):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq_len, d)
        self.wpe.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
            for _ in range(n_layer)
        )
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied (Press & Wolf 2017), as in GPT-2
        self.register_buffer("shift", 0.02 * torch.randn(d))
        self.vocab, self.seq_len = vocab, seq_len

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) * self.scale + self.wpe(pos) + self.shift
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


FROZEN = "wpe.weight"


def check_model(seed: int, device: torch.device) -> CheckLM:
    with torch.random.fork_rng(devices=[]):  # leave the caller's random state alone
        torch.manual_seed(seed)
        return CheckLM().to(device)


def rank_batches(rank: int, world_size: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """This rank's (x, y) for each of STEPS steps: rows r·b … (r+1)·b − 1 of a global batch
    that every rank draws alike."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 64, (world_size * ROWS_PER_RANK, 9), generator=g)
        rows = tokens[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK].to(device)
        out.append((rows[:, :-1], rows[:, 1:]))
    return out


def trainable_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


# --------------------------------------------------------------------------- reference answers
# The notebook's solutions, as classes the checks can be tested with and the benchmark
# (benchmarks/bench_dp_overlap.py) can time: naive, overlapped and bucketed DDP share one
# interface, ``Cls(model, world_size, ...)`` then ``finish_gradient_sync()`` after backward.
# Each is a strategy of labkit.parallel made with sync_in_backward=False: the strategy then
# queues nothing on the autograd engine, and finish_gradient_sync() runs its after_backward.


class NaiveDDP:
    """After backward, one blocking all-reduce per gradient: nothing overlaps (the baseline;
    ``labkit.parallel.dp_naive.NaiveDP``). Like every reference here, it first broadcasts rank
    0's parameters and buffers, as torch DDP does when it wraps a model
    (https://pytorch.org/docs/stable/notes/ddp.html, "Construction")."""

    def __init__(self, model: nn.Module, world_size: int) -> None:
        self.strategy: NaiveDP = NaiveDP(world_size, sync_in_backward=False)
        self.strategy.wrap(model)

    def finish_gradient_sync(self) -> None:
        self.strategy.after_backward()


class OverlapDDP(NaiveDDP):
    """One asynchronous all-reduce per gradient, started by its post-accumulate hook while
    backward computes the earlier layers; waited on before the optimizer step (CS336
    assignment 2's ``DDPIndividualParameters``): ``labkit.parallel.dp_bucketed.BucketedDP``
    with buckets of one parameter each (a cap of 0 bytes)."""

    def __init__(self, model: nn.Module, world_size: int) -> None:
        self.strategy = BucketedDP(world_size, bucket_cap_mb=0.0, sync_in_backward=False)
        self.strategy.wrap(model)


class BucketedDDP(NaiveDDP):
    """Gradients copied into flat buckets of at most ``bucket_cap_mb`` (reverse parameter
    order); a bucket's asynchronous all-reduce starts when its last gradient arrives (PyTorch
    DDP paper, Li et al. VLDB 2020, section 3.2): ``labkit.parallel.dp_bucketed.BucketedDP``."""

    def __init__(self, model: nn.Module, world_size: int, bucket_cap_mb: float = 25.0) -> None:
        self.strategy = BucketedDP(world_size, bucket_cap_mb=bucket_cap_mb, sync_in_backward=False)
        self.strategy.wrap(model)


class ZeRO1Optimizer:
    """ZeRO stage 1 (Rajbhandari et al. 2019, section 5.1): the flat parameters in equal,
    zero-padded shards; ``make_optimizer([shard])`` keeps state for this rank's shard only;
    ``step`` = reduce-scatter the gradients, update the shard, all-gather the weights.

    Not ``labkit.parallel.zero1.ShardedOptimizer`` behind an adapter, because the check of
    02.zero1_step judges what that class does differently on purpose: it builds its inner
    optimizer as ``type(make(model))(groups)`` (``make_optimizer`` is never handed the shard,
    and the optimizer it returns never steps), over one view per parameter slice without the
    padding (so on a padded rank AdamW holds fewer than ``stop - start`` elements), and it
    skips parameters without a gradient. The shard bounds and the two collectives are the
    library's (``zero1.shard_bounds``, ``comm.reduce_scatter``, ``comm.all_gather``).
    """

    def __init__(self, params: Any, make_optimizer: Callable[[list[nn.Parameter]], Any],
                 rank: int, world_size: int) -> None:  # fmt: skip
        self.params = [p for p in params if p.requires_grad]
        self.rank, self.world_size = rank, world_size
        numel = sum(p.numel() for p in self.params)
        self.start, self.stop = self.shard_bounds(numel, rank, world_size)
        self.flat = torch.zeros(world_size * (self.stop - self.start),
                                dtype=self.params[0].dtype, device=self.params[0].device)  # fmt: skip
        self.flat[:numel] = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.shard = nn.Parameter(self.flat[self.start : self.stop].clone())
        self.inner = make_optimizer([self.shard])

    shard_bounds = staticmethod(zero1.shard_bounds)

    @torch.no_grad()
    def step(self) -> None:
        grads = torch.zeros_like(self.flat)
        offset = 0
        for p in self.params:
            if p.grad is not None:
                grads[offset : offset + p.numel()] = p.grad.reshape(-1)
            offset += p.numel()
        shard_grad = torch.empty_like(self.shard)
        comm.reduce_scatter(shard_grad, grads, None)
        self.shard.grad = shard_grad / self.world_size
        self.inner.step()
        comm.all_gather(self.flat, self.shard.detach(), None)
        offset = 0
        for p in self.params:
            p.copy_(self.flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def reference_ddp(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, ...]],
    bucket_cap_mb: float | None = None,
    *,
    use_torch_ddp: bool = False,
) -> tuple[list[dict[str, torch.Tensor]], nn.Module]:
    """What DDP computes on a copy of ``model``: the averaged gradients of each step (copies,
    by name) and the model after STEPS SGD steps (:func:`sgd_step`).

    By hand by default: rank 0's parameters and buffers broadcast, then each step the mean over
    ranks of every gradient, which is torch's ``DistributedDataParallel`` semantics
    (https://pytorch.org/docs/stable/notes/ddp.html). ``use_torch_ddp=True`` runs torch's own
    (the tests compare the two): its first use imports torch._dynamo, seconds that every check
    job in a notebook would pay again.
    """
    replica = copy.deepcopy(model)
    n = tdist.get_world_size()
    if use_torch_ddp:
        from torch.nn.parallel import DistributedDataParallel

        kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
        forward: Callable[..., torch.Tensor] = DistributedDataParallel(replica, **kwargs)
    else:
        naive = NaiveDDP(replica, n)  # rank 0's weights; the mean of the gradients after backward
        forward = replica
    grads = []
    for x, y in batches:
        replica.zero_grad(set_to_none=True)
        forward(x, y).backward()
        if not use_torch_ddp:
            naive.finish_gradient_sync()
        grads.append({name: p.grad.detach().clone() for name, p in trainable_params(replica)})
        sgd_step(replica)
    return grads, replica


@torch.no_grad()
def sgd_step(model: nn.Module) -> None:
    """p -= LR · p.grad. Not a torch optimizer: creating one imports torch._dynamo (seconds,
    in every check job); the DDP checks need the weights to move between steps, nothing more."""
    for _, p in trainable_params(model):
        p.add_(p.grad, alpha=-LR)

