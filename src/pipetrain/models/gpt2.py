"""GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners") as a chunk.

Learned token and position embeddings, pre-LayerNorm blocks (causal self-attention, then a
tanh-GELU MLP, each added to the residual stream), a final LayerNorm and an LM head tied to the
token embedding. Parameter names follow nanoGPT / HF ``GPT2LMHeadModel`` (whose ``Conv1D`` weights
are the transpose of our ``nn.Linear`` ones).

Shape legend:
    B   batch size (sequences in a microbatch)
    T   sequence length, at most block_size
    C   model width, n_embd
    nh  attention heads, n_head
    hs  head size, C // nh
    V   vocabulary size, vocab_size
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.config import GPT2Config
from pipetrain.models.chunk import TransformerChunk


class GPT2Embedding(nn.Module):
    """Token + learned position embedding, then dropout: ids (B, T) -> hidden (B, T, C)."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.block_size = config.block_size
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        if T > self.block_size:
            raise ValueError(
                f"sequence length {T} exceeds model.block_size={self.block_size} (the learned positions); "
                f"set data.seq_len <= model.block_size"
            )
        pos = torch.arange(T, device=idx.device)  # (T,)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused q/k/v projection."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)  # each (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads: (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: C -> 4C -> GELU (tanh approximation, as GPT-2 trained) -> C."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: hidden (B, T, C) -> hidden (B, T, C)."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, ctx: None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT2Head(nn.Module):
    """Final LayerNorm + LM head (no bias): hidden (B, T, C) -> logits (B, T, V)."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPT2Chunk(TransformerChunk):
    """A GPT-2 chunk; see :class:`~pipetrain.models.chunk.TransformerChunk` for the contract."""

    # The LM head reuses the token embedding matrix (GPT-2 ties them, Press & Wolf 2017).
    tied_weights = (("embed.wte.weight", "head.lm_head.weight"),)
    residual_projections = ("attn.c_proj", "mlp.c_proj")

    @classmethod
    def validate_config(cls, config: GPT2Config) -> None:
        if config.n_embd % config.n_head != 0:
            raise ValueError(
                f"model.n_embd={config.n_embd} is not divisible by model.n_head={config.n_head}; "
                "pick n_head dividing n_embd"
            )

    def make_embedding(self) -> nn.Module:
        return GPT2Embedding(self.config)

    def make_block(self, layer_idx: int) -> nn.Module:
        return Block(self.config)

    def make_head(self) -> nn.Module:
        return GPT2Head(self.config)
