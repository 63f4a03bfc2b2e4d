"""A small GPT, the one model every lab trains.

GPT-2 in shape (Radford et al. 2019): pre-norm blocks, learned position embeddings, a 4x MLP
with GELU, biases on, and the output projection tied to the token embedding (Press & Wolf
2017). It follows nanoGPT's ``model.py`` in spirit and differs on purpose in two places:

* q, k and v are three ``nn.Linear`` layers instead of one fused ``c_attn``. The parameter
  count is the same (3h^2 + 3h), and tensor parallelism (notebook 03) can split each of them
  by heads without the head-aware bookkeeping a fused projection needs.
* attention runs through ``F.scaled_dot_product_attention(is_causal=True)``, which picks a
  fused kernel where one exists (flash or memory-efficient on CUDA, a flash-style kernel on
  CPU) and never needs a GPU-only package.

The model knows nothing about devices, precision or parallelism: labs wrap it from outside
(``labkit.train`` for precision and accumulation, strategy modules for parallelism).

Shapes in comments use B = batch, T = sequence length, C = d_model (h), nh = heads,
hs = head size (C // nh), V = vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from labkit.config import CORPUS_VOCAB_SIZE, ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.d_model
        self.head_dim = cfg.head_dim
        self.q = nn.Linear(h, h)
        self.k = nn.Linear(h, h)
        self.v = nn.Linear(h, h)
        self.proj = nn.Linear(h, h)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        hs = self.head_dim
        # (B, T, C) -> (B, nh, T, hs): every head attends over the whole sequence independently.
        # The head count is read from q's width (-1), so a tensor-parallel rank holding a
        # slice of the heads runs this same code.
        q = self.q(x).view(B, T, -1, hs).transpose(1, 2)
        k = self.k(x).view(B, T, -1, hs).transpose(1, 2)
        v = self.v(x).view(B, T, -1, hs).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, nh·hs)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2 uses the tanh approximation of GELU; keep it for fidelity.
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Pre-norm residual blocks (GPT-2 moved LayerNorm to each sub-block's input).
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            # Weight tying (Press & Wolf 2017): the output projection reuses the input
            # embedding matrix, saving V·h parameters.
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2: scale the init of projections that write into the residual stream by
        # 1/sqrt(2L), since each block adds two such contributions.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, V) for token ids ``idx`` (B, T); mean cross-entropy if ``targets``."""
        _, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(
                f"sequence length {T} exceeds the model's seq_len={self.cfg.seq_len}: "
                "crop the input or build the model with a larger seq_len"
            )
        pos = torch.arange(T, device=idx.device)
        try:
            tok = self.wte(idx)  # (B, T, C)
        except IndexError:
            # An id outside 0..V-1 raises here on a CPU (on a GPU it is a device-side assert,
            # which cannot be caught: RunConfig refuses a vocabulary smaller than the corpus's
            # before anything runs). Catching costs nothing; checking every batch would cost a
            # device-to-host sync per step.
            raise self._vocab_error(idx) from None
        x = self.drop(tok + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss

    def _vocab_error(self, idx: torch.Tensor) -> ValueError:
        low, high, V = int(idx.min()), int(idx.max()), self.cfg.vocab_size
        return ValueError(
            f"token ids run from {low} to {high}, but vocab_size={V} takes only 0..{V - 1}: "
            f"build the model with vocab_size >= {high + 1} (labkit's corpus is raw bytes, "
            f"0..{CORPUS_VOCAB_SIZE - 1}: vocab_size={CORPUS_VOCAB_SIZE})"
        )

    def num_params(self, *, exclude_position_embedding: bool = False) -> int:
        """Parameters, each tied tensor counted once.

        ``exclude_position_embedding=True`` gives the count nanoGPT's MFU estimate uses
        (``get_num_params(non_embedding=True)``): the position table is a lookup, not a
        matmul, while the token table is also the output projection and so does cost FLOPs.
        """
        n = sum(p.numel() for p in self.parameters())  # parameters() yields tied ones once
        return n - self.wpe.weight.numel() if exclude_position_embedding else n

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after ``idx`` (B, T); returns (B, T + new)."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.cfg.seq_len:])
            probs = F.softmax(logits[:, -1, :].float() / temperature, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx
