"""Gemma decoder pieces shared by the PaliGemma backbone and the action expert.

Shapes: B batch, T tokens, H query heads, G key/value heads, D head dim, W width.
The layer classes only hold weights; the forward passes that route tokens through
them (prefill, denoise, decode) live in pi05.py, so the KV cache stays explicit there.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from .config import GemmaConfig

RMS_EPS = 1e-6
ROPE_THETA = 10_000.0


class RMSNorm(nn.Module):
    """Gemma RMSNorm: x · rsqrt(mean(x²) + eps) · (1 + w), statistics in float32."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None):
        """Return (normed x, gate); the gate is None for the plain norm."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + RMS_EPS)
        return (normed * (1.0 + self.weight.float())).to(x.dtype), None


class AdaRMSNorm(nn.Module):
    """π0.5 adaptive RMSNorm: dense(cond) -> (scale, shift, gate); y = x̂(1+scale)+shift."""

    def __init__(self, dim: int, cond_dim: int):
        super().__init__()
        self.dense = nn.Linear(cond_dim, 3 * dim)

    def forward(self, x: torch.Tensor, cond: torch.Tensor):
        """Normalize x [B, T, W] under cond [B, Wc] -> (y [B, T, W], gate [B, 1, W])."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + RMS_EPS)
        mod = self.dense(cond.to(self.dense.weight.dtype)).float()[:, None, :]  # [B, 1, 3W]
        scale, shift, gate = mod.chunk(3, dim=-1)
        return (normed * (1.0 + scale) + shift).to(x.dtype), gate.to(x.dtype)


class GemmaAttention(nn.Module):
    """Q/K/V/O projections; sized heads×head_dim, not width."""

    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        hd = cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.q_proj = nn.Linear(cfg.width, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.width, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(cfg.width, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, cfg.width, bias=False)

    def qkv(self, x: torch.Tensor):
        """Project x [B, T, W] -> q [B, T, H, D], k, v [B, T, G, D] (before RoPE)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        return q, k, v


class GemmaMLP(nn.Module):
    """Gated GELU (tanh approximation): down(gelu(gate(x)) * up(x))."""

    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.width, cfg.mlp_dim, bias=False)
        self.up_proj = nn.Linear(cfg.width, cfg.mlp_dim, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_dim, cfg.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.up_proj.weight.dtype)
        return self.down_proj(F.gelu(self.gate_proj(x), approximate='tanh') * self.up_proj(x))


class GemmaLayer(nn.Module):
    """One decoder layer's weights; adaptive norms when `cond_dim` is given (the expert)."""

    def __init__(self, cfg: GemmaConfig, cond_dim: int | None = None):
        super().__init__()

        def norm():
            return AdaRMSNorm(cfg.width, cond_dim) if cond_dim else RMSNorm(cfg.width)

        self.input_layernorm = norm()
        self.self_attn = GemmaAttention(cfg)
        self.post_attention_layernorm = norm()
        self.mlp = GemmaMLP(cfg)


class GemmaModel(nn.Module):
    """A Gemma tower: optional token embedding, layers, final norm."""

    def __init__(self, cfg: GemmaConfig, cond_dim: int | None = None, embed: bool = True):
        super().__init__()
        self.config = cfg
        if embed:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.width)
        self.layers = nn.ModuleList(GemmaLayer(cfg, cond_dim) for _ in range(cfg.depth))
        self.norm = AdaRMSNorm(cfg.width, cond_dim) if cond_dim else RMSNorm(cfg.width)


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """Add a residual branch: x + y, or x + gate·y in the adaptive (expert) layers."""
    return x + y if gate is None else x + gate * y


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x [B, T, heads, D], positions [B, T] (int) -> same shape as x."""
    D = x.shape[-1]
    inv_freq = ROPE_THETA ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    angles = positions.float()[..., None] * inv_freq              # [B, T, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, :, None]  # [B, T, 1, D]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, :, None]
    x32 = x.float()
    x1, x2 = x32[..., : D // 2], x32[..., D // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              key_mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention with grouped KV heads.

    q [B, Tq, H, D]; k, v [B, Tk, G, D]; key_mask bool [B, Tq, Tk] or [B, 1, Tk]
    (True = may attend). Returns [B, Tq, H*D]. Scale is D^-0.5 as in Gemma.
    """
    B, Tq, H, D = q.shape
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=key_mask[:, None], enable_gqa=k.shape[2] != H)  # [B, H, Tq, D]
    return out.transpose(1, 2).reshape(B, Tq, H * D)
