"""labkit.parallel without launching jobs: config checks, byte counting, buckets, samplers.

Collectives run in a 1-rank gloo group inside the test process (no processes started): enough
to check that the counters count what the wrappers send and what the dispatcher sees.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist
from torch.utils.data import DistributedSampler

from labkit import formulas
from labkit.parallel import comm
from labkit.parallel.dp_bucketed import BucketedDP, make_buckets
from labkit.parallel.dp_config import DPSettings, optimizer_factory
from labkit.parallel.dp_naive import NaiveDP
from labkit.parallel.zero1 import ZeRO1
from labkit.workers import dp_train

TINY = {"seq_len": 16, "n_layer": 1, "n_head": 2, "d_model": 16}


def base(**extra):
    return {"strategies": ["naive"], "model": TINY, **extra}


def settings(**extra) -> DPSettings:
    """The checked settings of ``base(**extra)``: what holds on any world is refused here."""
    return DPSettings(**base(**extra))


# --- bad input: ValueError before anything starts ---------------------------------------------


def test_global_batch_must_divide_by_world_size_times_accumulation():
    with pytest.raises(ValueError, match=r"global_batch=10 does not divide by world_size=4"):
        settings(global_batch=10).resolve(world_size=4, gpu_count=0)
    with pytest.raises(ValueError, match=r"grad_accum=2 = 8"):
        settings(global_batch=12, train={"grad_accum": 2}).resolve(4)
    job = settings(global_batch=16, train={"grad_accum": 2}).resolve(4)
    assert job.train.micro_batch == 2 and job.global_batch == 16


def test_more_ranks_than_gpus_on_cuda_is_refused():
    with pytest.raises(ValueError, match=r"world_size=4 is larger than the 2 visible GPU"):
        settings().resolve(world_size=4, gpu_count=2, device="cuda")
    settings().resolve(world_size=4, gpu_count=2, device="cpu")  # gloo: fine


def test_fsdp_needs_an_explicit_mesh():
    # Refused when built: no world size makes a missing or 2-D unnamed mesh right.
    with pytest.raises(ValueError, match=r"mesh=None is not allowed: a mesh with strategy 'fsdp2'.*mesh=\[2\]"):
        settings(strategies=["fsdp2"])
    with pytest.raises(ValueError, match=r"mesh=\[1, 2\]"):
        settings(strategies=["fsdp2"], mesh=[1, 2])
    with pytest.raises(ValueError, match=r"mesh=\[4\] is not allowed: \[2\]"):
        settings(strategies=["fsdp2"], mesh=[4]).resolve(2)  # the launch's world
    from labkit.config import ModelConfig
    from labkit.model import GPT
    from labkit.parallel.fsdp import apply_fsdp2

    with pytest.raises(ValueError, match="init_device_mesh"):
        apply_fsdp2(GPT(ModelConfig(**TINY)), mesh=None)


def test_compression_hooks_on_gloo():
    # fp16 and PowerSGD run on gloo; bf16 too (gloo all-reduces bf16 CPU tensors; only DDP's
    # name check on torch's own hook refuses it on builds without CUDA+NCCL: see parallel/ddp).
    for name in ("ddp_fp16", "ddp_bf16", "ddp_powersgd"):
        assert settings(strategies=[name]).resolve(2).backend == "gloo"
    with pytest.raises(ValueError, match=r"powersgd_start_iter=1.*>= 2"):
        settings(strategies=["ddp_powersgd"], powersgd_start_iter=1)
    with pytest.raises(ValueError, match="ddp_int8"):
        settings(strategies=["ddp_int8"])
    from labkit.parallel.ddp import TorchDDP

    with pytest.raises(ValueError, match="compression='int8'"):
        TorchDDP(2, compression="int8")


def test_other_bad_configs_name_the_field():
    with pytest.raises(ValueError, match=r"train.grad_clip=1.0 .*zero1"):
        settings(strategies=["zero1"], train={"grad_clip": 1.0})
    with pytest.raises(ValueError, match=r"DPSettings has no field\(s\) \['steps'\]"):
        DPSettings.from_dict(base(steps=3))
    with pytest.raises(ValueError, match=r"freeze='nope' is not allowed: one of 'wte.weight'"):
        settings(freeze=["nope"])
    with pytest.raises(ValueError, match="optimizer='lamb'"):
        settings(optimizer="lamb")
    with pytest.raises(ValueError, match=r"strategies=\(\) is not allowed: a non-empty list"):
        settings(strategies=[])
    with pytest.raises(ValueError, match=r"train.micro_batch=3 is not allowed: .* = 2 or left out"):
        settings(global_batch=4, train={"micro_batch": 3}).resolve(2)
    with pytest.raises(ValueError, match=r"train.device='cuda' is not allowed: 'auto' or 'cpu'"):
        settings(train={"device": "cuda"}).resolve(2)


def test_run_validates_before_launching(monkeypatch):
    from labkit.jobs import launch

    def must_not_launch(*a, **k):
        raise AssertionError("launch.run was called")

    monkeypatch.setattr(launch, "run", must_not_launch)
    # 3 samples cannot split over 2 ranks: only the launch knows the world size
    with pytest.raises(ValueError, match="global_batch=3"):
        dp_train.run(dp_train.DPTrainConfig(**base(global_batch=3)), nproc=2, device="cpu")
    # A vocabulary smaller than the byte corpus would fail only at the ranks' first forward.
    with pytest.raises(ValueError, match=r"vocab_size=100 is too small for the corpus"):
        dp_train.run(dp_train.DPTrainConfig(**base(model={"vocab_size": 100})), nproc=2,
                     device="cpu")


# --- counting ---------------------------------------------------------------------------------


def test_byte_counter_applies_the_ring_formulas():
    c = comm.ByteCounter(4, "gloo")
    c.add("all_reduce", 1000)
    c.add("all_reduce", 1000)
    c.end_step()
    c.add("reduce_scatter", 800)
    c.add("all_gather", 800)
    c.end_step()
    s = c.summary()
    assert s["message_bytes_per_step"] == [2000, 1600]
    assert s["sent_per_rank_per_step"][0] == pytest.approx(
        formulas.ring_allreduce_bytes_per_rank(2000, 4)
    )  # 2(n-1)/n·S = 3000
    assert s["sent_per_rank_per_step"][0] == pytest.approx(3000)
    # reduce-scatter + all-gather = one all-reduce's volume (ZeRO paper, section 7)
    assert s["sent_per_rank_last_step"] == pytest.approx(
        formulas.ring_allreduce_bytes_per_rank(800, 4)
    )
    assert s["last_step"]["all_gather"] == {"calls": 1, "message_bytes": 800}
    assert any("emulated" in note or "all-reduce" in note for note in s["notes"])
    with pytest.raises(ValueError, match="kind='all_to_all'"):
        c.add("all_to_all", 1)


@pytest.fixture(scope="module")
def group():
    """A 1-rank gloo process group in this process (HashStore: no port, no process)."""
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    yield
    tdist.destroy_process_group()


def test_spy_sees_what_the_wrappers_send(group):
    mine, seen = comm.ByteCounter(1), comm.ByteCounter(1)
    with comm.CollectiveSpy(seen):
        comm.all_reduce(torch.ones(10), mine)
        comm.all_gather(torch.empty(6), torch.ones(6), mine)
        comm.reduce_scatter(torch.empty(3), torch.ones(3), mine)
    mine.end_step()
    seen.end_step()
    assert (
        mine.summary()["last_step"]
        == seen.summary()["last_step"]
        == {
            "all_reduce": {"calls": 1, "message_bytes": 40},
            "all_gather": {"calls": 1, "message_bytes": 24},
            "reduce_scatter": {"calls": 1, "message_bytes": 12},
        }
    )


def _tiny_model():
    from labkit.config import ModelConfig
    from labkit.model import GPT

    torch.manual_seed(0)
    model = GPT(ModelConfig(**TINY))
    model.wpe.weight.requires_grad_(False)
    return model


@pytest.mark.parametrize("cls", [NaiveDP, BucketedDP])
def test_hooks_reduce_once_per_backward_and_skip_under_no_sync(group, cls):
    model = _tiny_model()
    strategy = cls(1) if cls is NaiveDP else cls(1, bucket_cap_mb=0.004)
    strategy.wrap(model)
    x = torch.randint(0, 256, (2, 16))
    with strategy.no_sync():
        model(x, x)[1].backward()
    strategy.bytes_counter.end_step()
    model(x, x)[1].backward()
    strategy.bytes_counter.end_step()
    per_step = strategy.bytes_counter.summary()["message_bytes_per_step"]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert per_step == [0, 4 * trainable]  # nothing under no_sync, every gradient once after
    calls = strategy.bytes_counter.summary()["last_step"]["all_reduce"]["calls"]
    n_tensors = sum(1 for p in model.parameters() if p.requires_grad)
    assert calls == n_tensors if cls is NaiveDP else 1 < calls < n_tensors


def test_buckets_respect_the_cap_and_keep_order():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 10, 30, 5)]
    buckets = make_buckets(params, cap_bytes=4 * 20)
    assert [[p.numel() for p in b.params] for b in buckets] == [[10, 10], [30], [5]]
    assert buckets[0].offsets == [0, 10] and buckets[0].buffer.numel() == 20


def test_zero1_optimizer_matches_adamw_in_one_rank(group):
    from labkit.config import TrainConfig

    make = optimizer_factory("adamw", TrainConfig(lr=1e-2))
    ref, sharded = _tiny_model(), _tiny_model()
    opt_ref = make(ref)
    opt = ZeRO1(1, rank=0).optimizer(sharded, make)
    x = torch.randint(0, 256, (2, 16))
    for _ in range(2):
        for model, o in ((ref, opt_ref), (sharded, opt)):
            model(x, x)[1].backward()
            o.step()
            o.zero_grad(set_to_none=True)
    for (name, a), (_, b) in zip(ref.named_parameters(), sharded.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0, msg=name)
    assert not torch.equal(ref.wte.weight, _tiny_model().wte.weight)  # it did train


# --- DistributedSampler: why set_epoch matters ------------------------------------------------


def test_distributed_sampler_repeats_its_order_without_set_epoch():
    data = range(16)
    samplers = [
        DistributedSampler(data, num_replicas=2, rank=r, shuffle=True, seed=0) for r in range(2)
    ]
    first = [list(s) for s in samplers]
    again = [list(s) for s in samplers]
    assert first == again  # epoch 2 without set_epoch: the very same order on every rank
    assert sorted(first[0] + first[1]) == list(range(16))  # disjoint, and all of the data
    for s in samplers:
        s.set_epoch(1)
    epoch1 = [list(s) for s in samplers]
    assert epoch1 != first  # seeded with seed + epoch: a new shuffle
    assert sorted(epoch1[0] + epoch1[1]) == list(range(16))
