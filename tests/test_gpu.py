"""The GPU tier: run by scripts/gpu_check.sh on a machine with an NVIDIA GPU, skipped elsewhere.

No speed is asserted (speed lives in benchmarks/); these check that the GPU paths *work*:
CUDA timing, bf16 training, the allocator-based memory measurement, NCCL through the launcher.
"""

from __future__ import annotations

import math

import pytest
import torch

from labkit import config, data, hardware, memory, timing, train
from labkit.jobs import launch
from labkit.model import GPT
from labkit.workers.allreduce import AllReduceConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda", 0)


def test_timer_uses_cuda_events_and_measures_real_work():
    a = torch.randn(2048, 2048, device=CUDA, dtype=torch.bfloat16)
    result = timing.benchmark(lambda: a @ a, device=CUDA, warmup=3, repeats=5)
    assert result.method == "CUDA events"
    assert all(s > 0 for s in result.samples_s)


def test_bf16_training_on_the_gpu_lowers_the_loss():
    cfg = config.preset("smoke").replace(dtype="bfloat16", steps=40, device="cuda")
    torch.manual_seed(0)
    model = GPT(cfg.model)
    history = train.train(model, cfg, data.load_splits().train, device=CUDA)
    assert history.loss[-1] < history.loss[0] - 0.5
    assert all(s > 0 for s in history.seconds)


def test_allocator_sees_the_model_states_the_tensors_add_up_to():
    cfg = config.preset("lab")
    torch.manual_seed(0)
    model = GPT(cfg.model).to(CUDA)
    opt = train.make_optimizer(model, cfg.train)
    batch = data.get_batch(data.load_splits().train, 8, cfg.model.seq_len,
                           torch.Generator().manual_seed(0))
    m = memory.measure_training_memory(model, opt, batch, device=CUDA)
    n = model.num_params()
    assert (m.parameters, m.gradients, m.optimizer_state) == (4 * n, 4 * n, 8 * n)
    assert m.cuda_peak >= m.parameters + m.gradients + m.optimizer_state
    assert m.cuda_activations > 0


def test_the_device_is_named_and_has_a_sourced_peak_or_a_reason():
    name = torch.cuda.get_device_name(0)
    peak = hardware.peak_flops(name, torch.bfloat16)
    assert (peak.known and peak.source) or peak.reason
    assert hardware.nvml_status().ok


def test_nccl_allreduce_through_the_launcher():
    n = min(torch.cuda.device_count(), 2)
    result = launch.run(AllReduceConfig(numel=2**20), nproc=n, timeout_s=120, stream=False)
    assert result.backend == "nccl"
    assert all(r["value"] == n * (n + 1) / 2 for r in result.ranks)


# --- two GPUs: every parallel worker over NCCL --------------------------------------------------
# gloo (CPU, CI) buffers sends and reduces CPU tensors; NCCL does neither the same way, so a
# schedule that passes every CPU test can still hang or fail here. Short timeouts: a hang
# (a rank no longer beating, a collective past the process-group timeout) fails in about a
# minute instead of blocking the whole tier.

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
HANG = {"timeout_s": 240, "heartbeat_timeout_s": 90, "pg_timeout_s": 60, "stream": False}

# Activations of (b, T, d_model) fp32 = 16·256·512·4 B = 8 MiB per message: far above NCCL's
# internal buffers, so a send only completes once its receive is posted; a p2p plan that can
# deadlock (the old one-transfer-at-a-time 1F1B did, for every m >= 2) hangs for certain.
PP_MODEL = {"seq_len": 256, "n_layer": 4, "n_head": 8, "d_model": 512}
PP_BATCH, PP_M = 64, 4


@two_gpus
def test_pipeline_schedules_over_nccl_with_large_messages():
    from labkit.workers import pp_train

    b = PP_BATCH // PP_M
    assert b * PP_MODEL["seq_len"] * PP_MODEL["d_model"] * 4 > 4 * 2**20
    result = launch.run(
        pp_train.PPTrainConfig(model=PP_MODEL, batch_size=PP_BATCH, microbatches=PP_M,
                               schedules=("1f1b", "gpipe"), warmup=1, repeats=1,
                               save_grads=True, seed=0),
        nproc=2,
        device="cuda",
        **HANG,
    )  # fmt: skip
    assert result.backend == "nccl"
    for r in range(2):
        runs = {run["schedule"]: run for run in result.ranks[r]["runs"]}
        assert set(runs) == {"1f1b", "gpipe"}
        assert runs["1f1b"]["loss"] == pytest.approx(runs["gpipe"]["loss"], abs=1e-4)
        # 1F1B and GPipe compute the same micro-batches: the same gradients (CUDA kernels may
        # reorder sums, hence a tolerance), so no tensor went to the wrong place.
        one_f, gpipe = (torch.load(result.log_dir / f"pp_{s}_m{PP_M}_rank{r}.pt")["grads"]
                        for s in ("1f1b", "gpipe"))  # fmt: skip
        assert set(one_f) == set(gpipe) and one_f
        for name, g in gpipe.items():
            torch.testing.assert_close(one_f[name], g, atol=1e-5, rtol=1e-3, msg=name)
    model = pp_train.build_model(config.ModelConfig(**PP_MODEL), seed=0)
    x, y = pp_train.make_batch(model.cfg, PP_BATCH, seed=0)
    with torch.no_grad():
        _, ref = model(x, y)
    assert result.ranks[0]["runs"][0]["loss"] == pytest.approx(float(ref), abs=1e-3)


DP_STRATEGIES = ["naive", "bucketed", "ddp", "zero1", "fsdp2", "ddp_powersgd"]


@two_gpus
def test_every_data_parallel_strategy_trains_over_nccl():
    from labkit.workers import dp_train

    cfg = {"strategies": DP_STRATEGIES, "mesh": [2], "global_batch": 8,
           "model": {"seq_len": 64, "n_layer": 2, "n_head": 2, "d_model": 64},
           "train": {"steps": 4}, "bucket_cap_mb": 0.05}  # fmt: skip
    result = dp_train.run(dp_train.DPTrainConfig(**cfg), nproc=2, device="cuda", **HANG)
    assert result.backend == "nccl"
    for r in range(2):
        assert result.ranks[r]["backend"] == "nccl"
        assert result.ranks[r]["device"] == f"cuda:{r}"
        runs = result.ranks[r]["runs"]
        assert list(runs) == DP_STRATEGIES
        first = runs["naive"]["loss"][0]
        for name, run in runs.items():
            losses = run["loss"]
            assert len(losses) == 4 and all(math.isfinite(v) for v in losses), name
            # same seed, same batches: the first loss comes before any update
            assert losses[0] == pytest.approx(first, abs=1e-4), name
            assert losses[-1] < losses[0], name
            assert run["bytes"]["sent_per_rank_last_step"] > 0, name


@two_gpus
def test_tensor_parallel_ours_and_dtensor_over_nccl():
    from labkit.workers import tp_train

    result = launch.run(
        tp_train.TPTrainConfig(batch_size=4, steps=3, seed=0, parts=("linear", "gpt", "dtensor")),
        nproc=2,
        device="cuda",
        **HANG,
    )
    assert result.backend == "nccl"
    n_layer = tp_train.DEFAULT_MODEL["n_layer"]
    for r in range(2):
        ours, dt = result.ranks[r]["gpt"], result.ranks[r]["dtensor"]
        assert len(ours["losses"]) == len(dt["losses"]) == 3
        assert all(math.isfinite(v) for v in ours["losses"] + dt["losses"])
        assert ours["losses"] == pytest.approx(dt["losses"], abs=1e-4)
        for step in ours["comm_per_step"]:  # f and g: 2 all-reduces per layer each way
            assert step["forward_calls"] == step["backward_calls"] == 2 * n_layer
        assert ours["param_bytes"] == ours["param_bytes_formula"]
    params = {impl: torch.load(result.log_dir / f"tp_{impl}_params.pt")["params"]
              for impl in ("gpt", "dtensor")}  # fmt: skip
    assert set(params["gpt"]) == set(params["dtensor"])
    for name, p in params["gpt"].items():
        torch.testing.assert_close(p.cpu(), params["dtensor"][name].cpu(), atol=1e-4, rtol=0,
                                   msg=name)  # fmt: skip
