"""LLaMA-3 (Grattafiori et al. 2024, "The Llama 3 Herd of Models") as a chunk.

Token embedding, pre-RMSNorm blocks (grouped-query causal self-attention with rotary position
embeddings, then a SwiGLU feed-forward, each added to the residual stream), a final RMSNorm and an
untied output projection. Parameter names follow Meta's reference code; the RoPE layout is HF's
"rotate_half" one (the two halves of a head are the rotation pairs), so HF ``LlamaForCausalLM``
weights load without permuting wq/wk and give the same logits.

Shape legend:
    B    batch size (sequences in a microbatch)
    T    sequence length, at most block_size
    C    model width, n_embd
    nh   query heads, n_head
    nkv  key/value heads, n_kv_head (each serves nh // nkv query heads)
    hd   head dim, C // nh
    F    SwiGLU hidden size, llama3_ffn_hidden_dim(...)
    V    vocabulary size, vocab_size
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.config import Llama3Config, RopeScalingConfig
from pipetrain.models.chunk import TransformerChunk


def llama3_ffn_hidden_dim(n_embd: int, ffn_dim_multiplier: float | None, multiple_of: int) -> int:
    """SwiGLU hidden size F, as in Meta's reference code.

    Two thirds of the usual 4 * n_embd (SwiGLU has three matrices instead of two, so this keeps the
    parameter count), optionally scaled, rounded up to a multiple of ``multiple_of``.
    Llama-3-8B: ``llama3_ffn_hidden_dim(4096, 1.3, 1024) == 14336``.
    """
    hidden = int(2 * 4 * n_embd / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


# --------------------------------------------------------------------------------------------
# rotary position embedding (Su et al. 2021)
# --------------------------------------------------------------------------------------------


def rope_inv_freq(
    head_dim: int, *, theta: float, scaling: RopeScalingConfig | None, device: torch.device | None = None
) -> torch.Tensor:
    """Rotation frequencies (hd // 2,) fp32: ``theta ** (-2i / hd)``, with optional Llama-3.1 scaling.

    Llama-3.1 scaling (HF ``rope_type="llama3"``) leaves wavelengths shorter than
    ``original_max_position_embeddings / high_freq_factor`` alone, divides the frequencies of those
    longer than ``original_max_position_embeddings / low_freq_factor`` by ``factor``, and blends
    smoothly in between, so a model trained at the original context extrapolates to longer ones.
    """
    exponent = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if scaling is None:
        return inv_freq
    old_context = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    # smooth: 1 keeps a frequency, 0 divides it by factor; linear in old_context / wavelen between.
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_context / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    is_medium = (wavelen >= old_context / scaling.high_freq_factor) & (wavelen <= old_context / scaling.low_freq_factor)
    return torch.where(is_medium, blended, scaled)


def rope_cos_sin(
    seq_len: int, head_dim: int, *, theta: float, scaling: RopeScalingConfig | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (T, hd) fp32, for positions 0..T-1 (each frequency repeated per half)."""
    inv_freq = rope_inv_freq(head_dim, theta=theta, scaling=scaling, device=device)  # (hd/2,)
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)  # (T,)
    angles = torch.outer(pos, inv_freq)  # (T, hd/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, hd)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dim's two halves: multiplication by i for each pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, n, T, hd) by position: cos, sin (T, hd) fp32, cast to x's dtype."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


# --------------------------------------------------------------------------------------------
# modules
# --------------------------------------------------------------------------------------------


class Llama3Embedding(nn.Module):
    """Token embedding (no positions: RoPE encodes them in attention): ids (B, T) -> (B, T, C)."""

    def __init__(self, config: Llama3Config) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(idx)  # (B, T, C)


class Attention(nn.Module):
    """Grouped-query causal self-attention with RoPE on queries and keys; no biases."""

    def __init__(self, config: Llama3Config) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.wq = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_head * self.head_dim, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        B, T, C = x.size()
        cos, sin = rope  # each (T, hd)
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # enable_gqa: each group of nh // nkv query heads attends with one shared key/value head.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, nh, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * self.head_dim)  # (B, T, C)
        return self.wo(y)


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(w1 x) * w3 x), C -> F -> C; no biases."""

    def __init__(self, config: Llama3Config) -> None:
        super().__init__()
        hidden = llama3_ffn_hidden_dim(config.n_embd, config.ffn_dim_multiplier, config.multiple_of)
        self.w1 = nn.Linear(config.n_embd, hidden, bias=False)  # gate
        self.w3 = nn.Linear(config.n_embd, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, config.n_embd, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, F) inside, (B, T, C) out


class TransformerBlock(nn.Module):
    """One pre-RMSNorm block: hidden (B, T, C) -> hidden (B, T, C)."""

    def __init__(self, config: Llama3Config) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        x = x + self.feed_forward(self.ffn_norm(x))
        return x


class Llama3Head(nn.Module):
    """Final RMSNorm + output projection (untied, no bias): hidden (B, T, C) -> logits (B, T, V)."""

    def __init__(self, config: Llama3Config) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.output = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x))


class Llama3Chunk(TransformerChunk):
    """A LLaMA-3 chunk; see :class:`~pipetrain.models.chunk.TransformerChunk` for the contract."""

    tied_weights = ()
    residual_projections = ("attention.wo", "feed_forward.w2")

    @classmethod
    def validate_config(cls, config: Llama3Config) -> None:
        if config.n_embd % config.n_head != 0:
            raise ValueError(
                f"model.n_embd={config.n_embd} is not divisible by model.n_head={config.n_head}; "
                "pick n_head dividing n_embd"
            )
        if config.n_head % config.n_kv_head != 0:
            raise ValueError(
                f"model.n_head={config.n_head} is not a multiple of model.n_kv_head={config.n_kv_head}; "
                "pick n_kv_head dividing n_head (n_kv_head = n_head disables grouping)"
            )
        if (config.n_embd // config.n_head) % 2 != 0:
            raise ValueError(
                f"head dim model.n_embd / model.n_head = {config.n_embd // config.n_head} is odd; "
                "RoPE rotates pairs of dims, so pick n_head giving an even head dim"
            )

    def make_embedding(self) -> nn.Module:
        return Llama3Embedding(self.config)

    def make_block(self, layer_idx: int) -> nn.Module:
        return TransformerBlock(self.config)

    def make_head(self) -> nn.Module:
        return Llama3Head(self.config)

    def block_context(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE cos/sin tables (T, hd) fp32 for h's sequence length, shared by every block."""
        T = h.size(1)
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds model.block_size={self.config.block_size}; "
                "set data.seq_len <= model.block_size"
            )
        return rope_cos_sin(
            T,
            self.config.n_embd // self.config.n_head,
            theta=self.config.rope_theta,
            scaling=self.config.rope_scaling,
            device=h.device,
        )
