"""The GPU tier: run by scripts/gpu_check.sh on a machine with an NVIDIA GPU, skipped elsewhere.

No speed is asserted (speed lives in benchmarks/); these check that the GPU paths *work*:
CUDA timing, bf16 training, the allocator-based memory measurement, NCCL through the launcher.
"""

from __future__ import annotations

import pytest
import torch

from labkit import config, data, hardware, launch, memory, timing, train
from labkit.model import GPT

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
    result = launch.run("labkit.workers.allreduce", nproc=n, config={"numel": 2**20},
                        timeout_s=120, stream=False)
    assert result.backend == "nccl"
    assert all(r["value"] == n * (n + 1) / 2 for r in result.ranks)
