"""The from-scratch data parallelism behaves as torch's own, on toy models (CS336 style).

stanford-cs336/assignment2-systems (tests/test_ddp.py) proves each distributed implementation
equal to a single-process reference with 2 gloo ranks on the CPU, on a model with a frozen
parameter and on one with tied parameters. Here the same, plus what torch's DDP and
optimizers guarantee and a from-scratch version can miss:

* **ranks seeded differently**: every rank builds its replica from its own seed (100 + rank);
  the reference is built from rank 0's seed. Torch's DDP broadcasts rank 0's parameters and
  buffers when it wraps a model (``_sync_module_states`` in torch/nn/parallel/distributed.py),
  so ours must too, buffers included (``Frozen.scale`` is a random buffer).
* **a frozen parameter inside the optimizer**: the optimizer is built from every parameter,
  frozen ones included, with AdamW's weight decay. Torch's optimizers skip a parameter whose
  ``grad is None`` (torch/optim/adamw.py), so a frozen weight must come out bit-identical.
* **tied parameters**: an embedding and an output head sharing one weight; the weight's
  gradient is the sum of both uses, and it must stay one tensor.
* **any nn.Module under FSDP2**: the toy models have no ``.blocks``; the caller names the
  modules to shard (a list, or a policy callable).

One launch of 2 ranks (``torch.multiprocessing`` spawn, FileStore rendezvous: no port) runs
every case; the assertions share it. Each assertion was checked to fail on the code before
this test (see each test's docstring for what it caught).

Tolerances (torch 2.13, 2 CPU cores): SGD 1e-6 (its update is proportional to the gradient,
so a summed gradient or unsynchronised start is ~1e-2 off); AdamW atol 1e-5, rtol 1e-4.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

WORLD = 2
STEPS = 3
GLOBAL_BATCH = 8
SEED = 100  # rank r builds its replica from SEED + r; the reference from SEED (rank 0's)
STRATEGIES = ["ddp", "naive", "bucketed", "zero1", "fsdp2", "fsdp2_policy", "fsdp2_keep"]
BF16 = "fsdp2_bf16"  # bf16 parameters: close to the reference, not equal
MODELS = ["frozen", "tied"]
OPTIMIZERS = ["sgd", "adamw"]


# --- toy models ------------------------------------------------------------------------------


class Frozen(nn.Module):
    """Two trainable layers around a frozen one, and a random (non-persistent) buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.fc2 = nn.Linear(16, 4)
        self.register_buffer("scale", torch.rand(16) + 0.5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # the loss
        h = F.relu(self.frozen(F.relu(self.fc1(x)))) * self.scale
        return F.mse_loss(self.fc2(h), y)

    def shard_units(self) -> list[nn.Module]:
        return [self.fc1, self.fc2]

    @staticmethod
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


class Tied(nn.Module):
    """Embedding and output head share one weight; a frozen position table."""

    V, D, T = 12, 8, 5

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(self.V, self.D)
        self.pos = nn.Parameter(torch.randn(self.T, self.D), requires_grad=False)
        self.mlp = nn.Sequential(nn.Linear(self.D, 16), nn.GELU(), nn.Linear(16, self.D))
        self.head = nn.Linear(self.D, self.V, bias=False)
        self.head.weight = self.emb.weight  # tied: one Parameter, two uses

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # the loss
        h = self.emb(x) + self.pos
        h = h + self.mlp(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())

    def shard_units(self) -> list[nn.Module]:
        return [self.mlp]  # emb and head stay in the root's unit: a tied weight is one unit's

    @classmethod
    def batch(cls, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, cls.V, (GLOBAL_BATCH, cls.T), generator=g)
        return x, torch.randint(0, cls.V, (GLOBAL_BATCH, cls.T), generator=g)


TOYS = {"frozen": Frozen, "tied": Tied}


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    """Every parameter, frozen ones included: torch's optimizers skip ``grad is None``."""
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.2)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def build(model_name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return TOYS[model_name]()


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (whole: DTensors gathered) and buffers, by name, on CPU."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = full.detach().cpu().clone()
    return out


def reference(model_name: str, opt_name: str) -> dict[str, torch.Tensor]:
    """One process, rank 0's initial weights, the whole global batch per step."""
    model = build(model_name, SEED)
    opt = make_optimizer(opt_name, model)
    for step in range(STEPS):
        model(*model.batch(step)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return state(model)


# --- the 2-rank job ---------------------------------------------------------------------------


def _strategy(name: str, model: nn.Module, rank: int):
    from labkit.parallel.ddp import TorchDDP
    from labkit.parallel.dp_bucketed import BucketedDP
    from labkit.parallel.dp_naive import NaiveDP
    from labkit.parallel.fsdp import FSDP2
    from labkit.parallel.zero1 import ZeRO1

    if name == "ddp":
        return TorchDDP(WORLD, "gloo")
    if name == "naive":
        return NaiveDP(WORLD)
    if name == "bucketed":
        return BucketedDP(WORLD, bucket_cap_mb=300 / 2**20)  # ~300-byte buckets: several
    if name == "zero1":
        return ZeRO1(WORLD, rank=rank)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    if name == "fsdp2":  # the caller's list of modules to shard
        return FSDP2(WORLD, mesh=mesh, modules=model.shard_units())
    if name == "fsdp2_keep":  # ZeRO-2-like: units stay unsharded from forward to backward
        return FSDP2(WORLD, mesh=mesh, modules=model.shard_units(), reshard_after_forward=False)
    if name == BF16:
        return FSDP2(WORLD, mesh=mesh, modules=model.shard_units(), mixed_precision="bf16")
    units = set(model.shard_units())  # the same, as a policy
    return FSDP2(WORLD, mesh=mesh, modules=lambda m: m in units)


def _worker(rank: int, folder: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = tdist.FileStore(str(Path(folder) / "store"), WORLD)
    tdist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    results: dict[str, dict] = {}
    try:
        for model_name in MODELS:
            for opt_name in OPTIMIZERS:
                for strat_name in [*STRATEGIES, BF16]:
                    base = build(model_name, SEED + rank)  # a different replica on every rank
                    strategy = _strategy(strat_name, base, rank)
                    wrapped = strategy.wrap(base)
                    opt = strategy.optimizer(wrapped, functools.partial(make_optimizer, opt_name))
                    for step in range(STEPS):
                        x, y = base.batch(step)
                        per = GLOBAL_BATCH // WORLD
                        xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
                        # Through the wrapper's forward: DDP and FSDP2 hook it.
                        loss = wrapped(xs, ys)
                        loss.backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                    tied = None
                    if model_name == "tied":
                        tied = base.head.weight is base.emb.weight
                    results[f"{model_name}/{opt_name}/{strat_name}"] = {
                        "state": state(base),
                        "tied": tied,
                    }
        torch.save(results, Path(folder) / f"rank{rank}.pt")
    finally:
        tdist.destroy_process_group()


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("dp_toy")
    mp.start_processes(_worker, args=(str(folder),), nprocs=WORLD, start_method="spawn")
    return [torch.load(folder / f"rank{r}.pt") for r in range(WORLD)]


# --- the assertions ---------------------------------------------------------------------------


def _close(got: torch.Tensor, want: torch.Tensor, opt_name: str, msg: str) -> None:
    if opt_name == "sgd":
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0, msg=msg)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=msg)


@pytest.mark.slow
@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("opt_name", OPTIMIZERS)
def test_every_strategy_equals_one_process_from_rank0s_weights(job, model_name, opt_name):
    """Replicas built from different seeds, trained on 2 ranks = one process from rank 0's.

    Caught before this test: NaiveDP, BucketedDP and ZeRO1 trained from each rank's own
    weights (no broadcast: ~0.1 off under SGD); FSDP2 refused any model without ``.blocks``;
    ZeRO1 decayed the frozen weights under AdamW.
    """
    want = reference(model_name, opt_name)
    for strat_name in STRATEGIES:
        for rank in range(WORLD):
            got = job[rank][f"{model_name}/{opt_name}/{strat_name}"]["state"]
            assert set(got) == set(want), strat_name  # a tied weight is listed once
            for name, t in want.items():
                _close(got[name], t, opt_name, f"{strat_name} rank {rank} {name}")


@pytest.mark.slow
@pytest.mark.parametrize("model_name", MODELS)
def test_frozen_parameters_and_buffers_are_rank0s_and_untouched(job, model_name):
    """AdamW with weight decay over every parameter: frozen ones (grad None) stay bit-exact,
    as torch's optimizers leave them. Caught before: ZeRO1 zero-filled the missing gradient
    and AdamW's decay shrank the frozen weights; and without the broadcast, rank 1 kept its
    own frozen weights and buffer."""
    init = state(build(model_name, SEED))
    frozen = [n for n, p in build(model_name, SEED).named_parameters() if not p.requires_grad]
    frozen += [n for n, _ in build(model_name, SEED).named_buffers()]
    assert frozen
    for strat_name in STRATEGIES:
        for rank in range(WORLD):
            got = job[rank][f"{model_name}/adamw/{strat_name}"]["state"]
            for name in frozen:
                assert torch.equal(got[name], init[name]), (strat_name, rank, name)


@pytest.mark.slow
def test_tied_weights_stay_one_parameter(job):
    for strat_name in STRATEGIES:
        for rank in range(WORLD):
            assert job[rank][f"tied/adamw/{strat_name}"]["tied"], (strat_name, rank)


@pytest.mark.slow
def test_replicas_agree_bit_for_bit(job):
    """Both ranks hold the same weights after training (the averaged gradient is one)."""
    for key, out in job[0].items():
        for name, t in out["state"].items():
            assert torch.equal(t, job[1][key]["state"][name]), (key, name)


@pytest.mark.slow
def test_fsdp2_bf16_mixed_precision_is_close_but_not_exact(job):
    """MixedPrecisionPolicy(bf16 parameters, fp32 reduction): compute really is bf16 (the
    result differs from fp32 training), and training still follows the fp32 reference."""
    for model_name in MODELS:
        want = reference(model_name, "sgd")
        got = job[0][f"{model_name}/sgd/{BF16}"]["state"]
        diff = max((got[k] - want[k]).abs().max().item() for k in want)
        assert 1e-5 < diff < 0.05, (model_name, diff)
