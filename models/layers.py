"""Llama-style building blocks for the drafters, written out so that they export cleanly to ONNX and run in
float64 for exact tests. Shapes carry a batch dim: x (B, n, hidden); caches (B, h_kv, T, d) like Hugging Face.
Masks are float additive (0 visible, -inf hidden)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class LayerConfig:
    """One decoder layer's sizes."""

    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


class Rotary(nn.Module):
    """Default (unscaled) RoPE as in Llama: cos/sin for explicit positions."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, n) -> cos, sin (B, 1, n, d), to broadcast over heads."""
        freqs = positions.to(self.inv_freq.dtype).unsqueeze(-1) * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q (B, h, n, d), k/v (B, h_kv, m, d), mask (B or 1, 1, n, m) additive -> (B, n, h*d).

    PyTorch's fused attention (grouped heads without copying K/V) everywhere but in the ONNX export, which keeps
    the plain formula: it maps to ONNX ops every runtime has."""
    if torch.onnx.is_in_onnx_export():
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
        if mask is not None:
            scores = scores + mask
        out = torch.softmax(scores, dim=-1) @ v
    else:
        if mask is not None:
            mask = mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    b, h, n, d = out.shape
    return out.transpose(1, 2).reshape(b, n, h * d)


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, n, h*d) -> (B, h, n, d)."""
    b, n, _ = x.shape
    return x.view(b, n, n_heads, -1).transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, c: LayerConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.n_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.n_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.n_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.hidden_size, bias=False)


class DecoderLayer(nn.Module):
    """A Llama decoder layer with its own KV cache: pre-norm self-attention + MLP, RoPE at explicit positions."""

    def __init__(self, c: LayerConfig):
        super().__init__()
        self.c = c
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)
        self.rotary = Rotary(c.head_dim, c.rope_theta)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        past_k: torch.Tensor | None = None,
        past_v: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, n, hidden); mask (B|1, 1, n, T+n) over past + new. Returns out, keys and values over T+n."""
        a = self.self_attn
        h = self.input_layernorm(x)
        cos, sin = self.rotary(positions, x.dtype)
        q = apply_rope(split_heads(a.q_proj(h), self.c.n_heads), cos, sin)
        k = apply_rope(split_heads(a.k_proj(h), self.c.n_kv_heads), cos, sin)
        v = split_heads(a.v_proj(h), self.c.n_kv_heads)
        if past_k is not None:
            k = torch.cat([past_k, k], dim=2)
            v = torch.cat([past_v, v], dim=2)
        x = x + a.o_proj(attend(q, k, v, mask))
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class CrossAttentionLayer(DecoderLayer):
    """MoA's CA layer: a decoder layer's weights, but queries from the stream and keys/values from memory rows
    (made by `memory` from m_t) instead of from the stream."""

    @property
    def row_width(self) -> int:
        return 2 * self.c.n_kv_heads * self.c.head_dim

    def memory(self, m: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """m (B, n, hidden) -> memory rows (B, n, 2*h_kv*d): [RoPE(k_proj(norm m)) ; v_proj(norm m)]."""
        a = self.self_attn
        h = self.input_layernorm(m)
        cos, sin = self.rotary(positions, m.dtype)
        k = apply_rope(split_heads(a.k_proj(h), self.c.n_kv_heads), cos, sin)
        b, hk, n, d = k.shape
        return torch.cat([k.transpose(1, 2).reshape(b, n, hk * d), a.v_proj(h)], dim=-1)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """x (B, n, hidden); memory (B, M, row_width); mask (B|1, 1, n, M) or None (all rows visible)."""
        a = self.self_attn
        h = self.input_layernorm(x)
        cos, sin = self.rotary(positions, x.dtype)
        q = apply_rope(split_heads(a.q_proj(h), self.c.n_heads), cos, sin)
        kv = self.c.n_kv_heads * self.c.head_dim
        k = split_heads(memory[..., :kv], self.c.n_kv_heads)
        v = split_heads(memory[..., kv:], self.c.n_kv_heads)
        x = x + a.o_proj(attend(q, k, v, mask))
        return x + self.mlp(self.post_attention_layernorm(x))
