import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from labkit import formulas
from labkit.config import ModelConfig
from labkit.model import GPT

CONFIGS = [
    ModelConfig(seq_len=32, n_layer=2, n_head=2, d_model=32),
    ModelConfig(seq_len=64, n_layer=3, n_head=4, d_model=64),
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_parameter_count_matches_the_formula(cfg):
    model = GPT(cfg)
    counted = sum(p.numel() for p in model.parameters())
    assert model.num_params() == counted
    assert counted == formulas.gpt_params(
        vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_layer=cfg.n_layer, seq_len=cfg.seq_len
    )
    assert model.num_params(exclude_position_embedding=True) == counted - cfg.seq_len * cfg.d_model


def test_output_head_is_tied_to_the_token_embedding():
    model = GPT(CONFIGS[0])
    assert model.lm_head.weight is model.wte.weight


@pytest.mark.parametrize("cfg", CONFIGS)
def test_flops_per_token_matches_a_real_forward_and_backward(cfg):
    """FlopCounterMode counts 2 FLOPs per multiply-add of every matmul it sees.

    With the math SDPA backend the attention matmuls are visible to it (the fused CPU
    kernel is not), and it counts the full s x s score matrix although half is masked:
    that is nanoGPT's/PaLM's "full" convention, 6N + 12·L·h·s, with N the matmul weights.
    """
    model = GPT(cfg)
    B, T = 2, cfg.seq_len
    idx = torch.randint(0, cfg.vocab_size, (B, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        _, loss = model(idx, idx)
        loss.backward()
    per_token = counter.get_total_flops() / (B * T)
    h, L, V = cfg.d_model, cfg.n_layer, cfg.vocab_size
    matmul_weights = L * 12 * h * h + V * h  # q,k,v,proj (4h²) + MLP (8h²) per layer, lm_head
    assert per_token == formulas.flops_per_token(
        n_params=matmul_weights, n_layer=L, d_model=h, seq_len=T, attention="full"
    )
    # nanoGPT's estimate uses all non-position parameters (biases and LayerNorms too):
    # within a few per cent of the exact matmul count for this model.
    estimate = formulas.flops_per_token(
        n_params=model.num_params(exclude_position_embedding=True), n_layer=L, d_model=h,
        seq_len=T, attention="full",
    )
    assert estimate == pytest.approx(per_token, rel=0.05)


def test_forward_shapes_and_initial_loss_near_uniform():
    cfg = CONFIGS[1]
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, 17))
    targets = torch.randint(0, cfg.vocab_size, (3, 17))  # not idx: tied weights favour a copy
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 17, cfg.vocab_size)
    # With small init every token is about equally likely: loss ≈ ln V.
    assert loss.item() == pytest.approx(torch.log(torch.tensor(256.0)).item(), rel=0.05)


def test_attention_is_causal():
    cfg = CONFIGS[0]
    model = GPT(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % cfg.vocab_size
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_too_long_input_names_the_fix():
    model = GPT(CONFIGS[0])
    with pytest.raises(ValueError, match="exceeds the model's seq_len=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_generate_extends_the_sequence():
    model = GPT(CONFIGS[0])
    out = model.generate(torch.zeros(1, 4, dtype=torch.long), 5,
                         generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 9)


def test_token_ids_outside_the_vocabulary_are_named_not_an_index_error():
    """A model built alone (not through RunConfig, which refuses it up front) with fewer
    tokens than the byte corpus meets its first byte >= vocab_size at the embedding."""
    from labkit import data

    model = GPT(ModelConfig(vocab_size=100, seq_len=32, n_layer=1, n_head=2, d_model=16))
    idx = data.encode("a byte is 0..255")[None]  # 'a' is 97, 'b' 98, 'y' 121
    with pytest.raises(ValueError, match=(
        r"^token ids run from 32 to 121, but vocab_size=100 takes only 0\.\.99: build the model "
        r"with vocab_size >= 122 \(labkit's corpus is raw bytes, 0\.\.255: vocab_size=256\)")):
        model(idx)
    model(idx.clamp(max=99))  # in range: no error
