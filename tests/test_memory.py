import torch

from labkit import memory, train
from labkit.config import ModelConfig, TrainConfig
from labkit.model import GPT

CPU = torch.device("cpu")
CFG = ModelConfig(seq_len=32, n_layer=2, n_head=2, d_model=32)


def batch(b, seed=0):
    x = torch.randint(0, CFG.vocab_size, (b, CFG.seq_len), generator=torch.Generator().manual_seed(seed))
    return x, torch.roll(x, -1, 1)


def measure(b):
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = train.make_optimizer(model, TrainConfig())
    return model, memory.measure_training_memory(model, opt, batch(b), device=CPU)


def test_fp32_adamw_states_are_4_4_8_bytes_per_parameter():
    model, m = measure(2)
    n = model.num_params()
    assert (m.parameters, m.gradients, m.optimizer_state) == (4 * n, 4 * n, 8 * n)
    # AdamW allocates its moments lazily, at the first step() (so OOM can first hit at step 2).
    assert m.optimizer_state_before_first_step == 0
    assert m.cuda_peak is None and "tensor accounting" in m.method


def test_activations_grow_linearly_with_the_batch():
    # a·b + c: c is what does not depend on the batch (the position ids, a scalar or two).
    a1, a2, a4 = (measure(b)[1].activations for b in (1, 2, 4))
    assert a1 > 0
    assert a4 - a2 == 2 * (a2 - a1)
    assert 0 <= 2 * a1 - a2 < 0.01 * a1


def test_views_share_one_storage():
    t = torch.zeros(10)
    assert memory.storage_bytes([t, t[:5], t.view(2, 5)]) == 40
