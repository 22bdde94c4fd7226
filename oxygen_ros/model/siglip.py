"""SigLIP vision tower (So400m/14 in π0.5) and PaliGemma's linear projector.

Letters (as in pi05.py): B images (rows × cameras), R image side, p patch,
Ti = (R/p)² tokens per image, Wv vision width, N heads.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from .config import SiglipConfig
from .gemma import cpu_attention_applies, fuse_linears, gelu_tanh
from .packed import linear, pack_fused

LN_EPS = 1e-6


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, cfg.hidden, cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.tokens_per_image, cfg.hidden)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Embed images [B, 3, R, R] -> [B, Ti, Wv] in the patch weights' dtype (float32)."""
        conv = self.patch_embedding
        images = images.to(conv.weight.dtype)
        if torch.compiler.is_compiling():
            # The same product as patches [B, Ti, 3p²] @ W: inductor runs the convolution
            # through a channels-last copy (pi05-cpu, two cameras: 1.06 ms against 0.78).
            B, C, R = images.shape[:3]
            p = conv.kernel_size[0]
            n = R // p
            patches = images[:, :, :n * p, :n * p].reshape(B, C, n, p, n, p)
            patches = patches.permute(0, 2, 4, 1, 3, 5).reshape(B, n * n, C * p * p)
            x = F.linear(patches, conv.weight.view(conv.weight.shape[0], -1), conv.bias)
        else:
            x = conv(images).flatten(2).transpose(1, 2)                         # [B, Ti, Wv]
        return x + self.position_embedding.weight[None]


class SiglipAttention(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.q_proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.k_proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.v_proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.out_proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.register_buffer('qkv_weight', None, persistent=False)   # [3Wv, Wv], fuse()
        self.register_buffer('qkv_bias', None, persistent=False)     # [3Wv]
        self.packed = False   # q/k/v and out run on prepacked weights (pack())

    def fuse(self) -> None:
        """Run q/k/v as one matmul (their weights and biases become views of one each)."""
        self.qkv_weight, self.qkv_bias = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def pack(self, in_place: bool = False) -> int:
        """Run the fused q/k/v and out on prepacked weights (packed.pack_fused); bytes.

        Only a frame's many rows (cameras x patches) multiply them: no few-row copy.
        """
        self.packed = True
        return pack_fused(self, 'qkv_weight', self.out_proj,
                          (self.q_proj, self.k_proj, self.v_proj), in_place, few_rows=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, Ti, Wv = x.shape
        N = self.num_heads

        def heads(t):  # [B, Ti, Wv] -> [B, N, Ti, Wv/N]
            return t.view(B, Ti, N, Wv // N).transpose(1, 2)

        if self.qkv_weight is not None:
            q, k, v = linear(x, self.qkv_weight, self.packed, self.qkv_bias).chunk(3, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = heads(q), heads(k), heads(v)
        if cpu_attention_applies(q):   # pi05-cpu's head dim 48 (So400m's 72 is not taken)
            out = torch.ops.oxygen_attention.attention(q, k, v, None)
        else:
            out = F.scaled_dot_product_attention(q, k, v)
        return linear(out.transpose(1, 2).reshape(B, Ti, Wv), self.out_proj.weight, self.packed,
                      self.out_proj.bias)


class SiglipMLP(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.mlp_dim)
        self.fc2 = nn.Linear(cfg.mlp_dim, cfg.hidden)
        self.packed = False   # fc1 and fc2 run on prepacked weights (pack())

    def pack(self, in_place: bool = False) -> int:
        """Run fc1 and fc2 on prepacked weights (packed.pack_fused); return the bytes."""
        self.packed = True
        return pack_fused(self.fc1, 'weight', self.fc2, (), in_place, few_rows=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = gelu_tanh(linear(x, self.fc1.weight, self.packed, self.fc1.bias))
        return linear(hidden, self.fc2.weight, self.packed, self.fc2.bias)


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden, eps=LN_EPS)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden, eps=LN_EPS)
        self.mlp = SiglipMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(_layer_norm(self.layer_norm1, x))
        return x + self.mlp(_layer_norm(self.layer_norm2, x))


class SiglipEncoder(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg) for _ in range(cfg.depth))


class SiglipVisionModel(nn.Module):
    """Patch + position embeddings, pre-norm encoder, post layer norm; no pooling head."""

    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden, eps=LN_EPS)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Encode images [B, 3, R, R] in [-1, 1] -> features [B, Ti, Wv]."""
        x = self.embeddings(images)
        x = x.to(self.encoder.layers[0].mlp.fc1.weight.dtype) if len(self.encoder.layers) else x
        for layer in self.encoder.layers:
            x = layer(x)
        return _layer_norm(self.post_layernorm, x)


class SiglipVisionTower(nn.Module):
    """Holds `vision_model` so parameter names match PaliGemma's checkpoint layout."""

    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.vision_model = SiglipVisionModel(cfg)


class MultiModalProjector(nn.Module):
    """Linear map from vision width to the backbone width (not scaled afterwards in π0.5)."""

    def __init__(self, vision_width: int, width: int):
        super().__init__()
        self.linear = nn.Linear(vision_width, width)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear(features.to(self.linear.weight.dtype))


def _layer_norm(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """Apply a LayerNorm in float32 (statistics stay accurate under a bf16 model)."""
    return F.layer_norm(x.float(), norm.normalized_shape, norm.weight.float(),
                        norm.bias.float(), norm.eps).to(x.dtype)
