"""Gemma decoder pieces shared by the PaliGemma backbone and the action expert.

Letters (the same in pi05.py): B batch rows, Q query tokens of a pass, K keys attended,
N query heads, G key/value heads, D head dim, W width, Wc conditioning width.

`GemmaLayer.forward` is the one layer body (norm -> qkv -> rope -> attention -> residual ->
norm -> MLP -> residual). What differs between prefill, denoise and decode is passed in: the
RoPE rows of the tokens' positions, and `attend`, which stores this layer's K/V where the pass
keeps them and attends with the pass's mask. The cache itself stays explicit in pi05.py.

Fusion (`fuse_linears`): projections that read the same input (q/k/v, gate/up) can run as one
matmul over one concatenated weight, each projection's weight a view of it (no extra memory,
checkpoint names unchanged). Per-op cost, not arithmetic, dominates the expert and decode passes
of small models: 3 + 2 matmuls per layer become 1 + 1.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F

from .config import GemmaConfig
from . import packed_native
from .packed import gated_in_one_pass, linear, pack_fused

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
    """π0.5 adaptive RMSNorm: dense(cond) -> (scale, shift, gate); y = x̂(1+scale)+shift.

    The modulation depends on the conditioning only (the flow time in π0.5), so a caller that
    knows every step's time computes it for all steps at once (`modulation`) and applies it per
    step (`modulate`); `forward` does both.
    """

    def __init__(self, dim: int, cond_dim: int):
        super().__init__()
        self.dense = nn.Linear(cond_dim, 3 * dim)

    def modulation(self, cond: torch.Tensor) -> torch.Tensor:
        """Return (scale, shift, gate) of cond [..., Wc] as one float32 [..., 3W]."""
        return self.dense(cond.to(self.dense.weight.dtype)).float()

    def modulate(self, x: torch.Tensor, mod: torch.Tensor):
        """Normalize x [B, Q, W] under mod [B, 3W] (or per token [B, Q, 3W]) -> y, gate.

        y [B, Q, W]; gate [B, 1, W] (or [B, Q, W]).
        """
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + RMS_EPS)
        if mod.dim() == 2:
            mod = mod[:, None, :]                                               # [B, 1, 3W]
        scale, shift, gate = mod.chunk(3, dim=-1)
        return (normed * (1.0 + scale) + shift).to(x.dtype), gate.to(x.dtype)

    def forward(self, x: torch.Tensor, cond: torch.Tensor):
        """Normalize x [B, Q, W] under cond [B, Wc] (or per token [B, Q, Wc]) -> y, gate."""
        return self.modulate(x, self.modulation(cond))


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
        self.packed = False   # q/k/v and o run on prepacked weights (pack())
        self.register_buffer('qkv_weight', None, persistent=False)   # [(N+2G)·D, W], fuse()

    def fuse(self) -> None:
        """Run q/k/v as one matmul (their weights become views of one matrix)."""
        self.qkv_weight, _ = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def pack(self, in_place: bool = False) -> int:
        """Run the fused q/k/v and o on prepacked weights (packed.pack_fused); return bytes."""
        self.packed = True
        return pack_fused(self, 'qkv_weight', self.o_proj, (self.q_proj, self.k_proj,
                                                            self.v_proj), in_place)

    def out(self, attended: torch.Tensor) -> torch.Tensor:
        """Output projection of the attended heads [B, Q, N*D] -> [B, Q, W]."""
        return linear(attended, self.o_proj.weight, self.packed)

    def qkv(self, x: torch.Tensor):
        """Project x [B, Q, W] -> q [B, Q, N, D], k, v [B, Q, G, D] (before RoPE)."""
        B, Q, _ = x.shape
        N, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        x = x.to(self.q_proj.weight.dtype)
        if self.qkv_weight is not None:
            qkv = linear(x, self.qkv_weight, self.packed)
            q, k, v = qkv.split([N * D, G * D, G * D], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return q.view(B, Q, N, D), k.view(B, Q, G, D), v.view(B, Q, G, D)


# Rows per MLP call where its gated activation is large. oneDNN (torch 2.13, AMX Xeon, 2
# threads) runs pi05's gate/up product, [M, 2048] x [2048, 32768], at 2.0-2.1 TFLOP/s up to
# 288 rows and at 1.3-1.6 from 289 on: a prefill's 555 rows as two calls of 278 take pi05's
# prefill from 2175 to 1979 ms (side by side). Rows are independent, so the result is the
# same up to bf16 rounding (oneDNN's kernels for other row counts sum in another order).
MLP_ROW_BLOCK = 288
MLP_SPLIT_VALUES = 2**24   # gate/up outputs (rows x 2 x mlp_dim) from which calls are split


class GemmaMLP(nn.Module):
    """Gated GELU (tanh approximation): down(gelu(gate(x)) * up(x))."""

    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.width, cfg.mlp_dim, bias=False)
        self.up_proj = nn.Linear(cfg.width, cfg.mlp_dim, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_dim, cfg.width, bias=False)
        self.register_buffer('gate_up_weight', None, persistent=False)  # [2·mlp, W], fuse()
        self.packed = False   # gate/up and down run on prepacked weights (pack())

    def fuse(self) -> None:
        """Run gate and up as one matmul (their weights become views of one matrix)."""
        self.gate_up_weight, _ = fuse_linears([self.gate_proj, self.up_proj])

    def pack(self, in_place: bool = False) -> int:
        """Run the fused gate/up and down on prepacked weights (packed.pack_fused); bytes."""
        self.packed = True
        return pack_fused(self, 'gate_up_weight', self.down_proj, (self.gate_proj, self.up_proj),
                          in_place)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.up_proj.weight.dtype)
        rows = x.shape[:-1].numel()
        if (not torch.compiler.is_compiling() and rows > MLP_ROW_BLOCK
                and rows * 2 * self.up_proj.out_features >= MLP_SPLIT_VALUES):
            blocks = x.reshape(1, rows, x.shape[-1]).chunk(-(-rows // MLP_ROW_BLOCK), dim=1)
            return torch.cat([self._gated(block) for block in blocks], dim=1).view(
                *x.shape[:-1], -1)
        return self._gated(x)

    def _gated(self, x: torch.Tensor) -> torch.Tensor:
        if (self.gate_up_weight is not None
                and x.shape[1:-1].numel() * self.up_proj.out_features
                >= GELU_KERNEL_MIN_ROW_VALUES   # where gelu_tanh takes its kernel
                and gated_in_one_pass(x, self.gate_up_weight, self.packed)):
            hidden = torch.ops.oxygen_packed_native.gated_gelu(x, self.gate_up_weight)
            return linear(hidden, self.down_proj.weight, self.packed)
        if self.gate_up_weight is not None:
            gate, up = linear(x, self.gate_up_weight, self.packed).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return linear(gelu_tanh(gate, up), self.down_proj.weight, self.packed)


class GemmaLayer(nn.Module):
    """One decoder layer; adaptive norms when `cond_dim` is given (the expert)."""

    def __init__(self, cfg: GemmaConfig, cond_dim: int | None = None):
        super().__init__()

        def norm():
            return AdaRMSNorm(cfg.width, cond_dim) if cond_dim else RMSNorm(cfg.width)

        self.input_layernorm = norm()
        self.self_attn = GemmaAttention(cfg)
        self.post_attention_layernorm = norm()
        self.mlp = GemmaMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                mods: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Run the layer on x [B, Q, W] -> [B, Q, W].

        cos, sin [B, Q, D]: RoPE rows at the tokens' positions (rows of a `rope_table`).
        attend(q [B, Q, N, D], k, v [B, Q, G, D]) -> [B, Q, N*D]: keeps k, v (K after RoPE)
        where the pass caches them and attends with the pass's keys and mask.
        mods: the expert's adaRMS modulations [B, 3W] (per token: [B, Q, 3W]) of its two norms
        conditioning); None in the backbone.
        """
        mod_in, mod_post = mods if mods is not None else (None, None)
        h, gate = norm(self.input_layernorm, x, mod_in)
        q, k, v = self.self_attn.qkv(h)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        x = gated_residual(x, self.self_attn.out(attend(q, k, v)), gate)
        h, gate = norm(self.post_attention_layernorm, x, mod_post)
        return gated_residual(x, self.mlp(h), gate)

    def fuse(self) -> None:
        """Fuse the layer's q/k/v and gate/up projections (see fuse_linears)."""
        self.self_attn.fuse()
        self.mlp.fuse()


class GemmaModel(nn.Module):
    """A Gemma tower: optional token embedding, layers, final norm."""

    def __init__(self, cfg: GemmaConfig, cond_dim: int | None = None, embed: bool = True):
        super().__init__()
        self.config = cfg
        if embed:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.width)
        self.layers = nn.ModuleList(GemmaLayer(cfg, cond_dim) for _ in range(cfg.depth))
        self.norm = AdaRMSNorm(cfg.width, cond_dim) if cond_dim else RMSNorm(cfg.width)


def norm(module: nn.Module, x: torch.Tensor, mod: torch.Tensor | None):
    """Apply a layer norm: plain (mod None) or adaptive under a precomputed modulation."""
    return module(x) if mod is None else module.modulate(x, mod)


def fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of linears that read one input -> (weight, bias).

    Each linear's weight (bias) becomes a view of the result, so nothing is held twice and a
    later in-place load (load_state_dict) updates both. Call it once the weights are final:
    replacing a parameter afterwards (a cast, assign=True) leaves the fused copy stale.
    """
    bias = None if linears[0].bias is None else _concat_params(linears, 'bias')
    return _concat_params(linears, 'weight'), bias


def _concat_params(modules: list[nn.Module], name: str) -> torch.Tensor:
    """Concatenate parameter `name` of `modules` along dim 0; rebind each as a view of it."""
    params = [getattr(module, name) for module in modules]
    out = torch.cat([p.detach() for p in params])
    start = 0
    for module, param in zip(modules, params):
        view = out[start:start + param.shape[0]]
        setattr(module, name, nn.Parameter(view, requires_grad=param.requires_grad))
        start += param.shape[0]
    return out


# Values per row (all dims but the first) from which the C++ GELU kernel pays off.
GELU_KERNEL_MIN_ROW_VALUES = 2**14


def gelu_tanh(x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """GELU, tanh approximation (Gemma's and SigLIP's activation), times `up` when given.

    bf16 on a CPU with AVX512-BF16 (the C++ kernels loaded: packed_native.ready), 16k
    values or more per row of the first dim (a prefill's or the vision tower's; a decode or
    denoise step's few tokens stay in inductor's fused kernels): activation_kernel.cpp, one
    pass with a polynomial exp (a pi05-cpu prefill layer's [555, 1024] gated activation 0.24
    ms vs 0.44 compiled). Not the whole size: the first dim is a compiled pass's dynamic batch
    (decode rows, robots), and a choice on it would tie the graph to a range of batch sizes (a
    decode graph warmed up at 2 rows guarded B < 16 and ran eager from 16 rows on).
    Elsewhere, compiled: x * sigmoid(2u) with u = sqrt(2/pi) (x + 0.044715 x^3), the same
    function (0.5 (1 + tanh u) = sigmoid(2u)), as inductor's CPU kernels take tanh from Sleef
    at ~2x the cost of the exp a sigmoid needs; eager: torch's fused kernel. The C++ kernel has
    no gradient: a pass that takes one keeps torch's.
    """
    if (x.dtype == torch.bfloat16 and x.device.type == 'cpu'
            and x.shape[1:].numel() >= GELU_KERNEL_MIN_ROW_VALUES
            and packed_native.ready('oxygen_activation')
            and not (torch.is_grad_enabled() and (x.requires_grad or (
                up is not None and up.requires_grad)))):
        return torch.ops.oxygen_activation.gelu_tanh(x, up)
    if not torch.compiler.is_compiling():
        y = F.gelu(x, approximate='tanh')
    else:
        x32 = x.float()
        u = 0.7978845608028654 * (x32 + 0.044715 * x32 * x32 * x32)
        y = (x32 * torch.sigmoid(2.0 * u)).to(x.dtype)
    return y if up is None else y * up


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """Add a residual branch: x + y, or x + gate·y in the adaptive (expert) layers."""
    return x + y if gate is None else x + gate * y


def rope_table(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE rows for integer positions [...] -> cos, sin, each float32 [..., D]."""
    D = head_dim
    inv_freq = ROPE_THETA ** (-torch.arange(0, D, 2, device=positions.device,
                                            dtype=torch.float32) / D)
    angles = positions.float()[..., None] * inv_freq                           # [..., D/2]
    angles = torch.cat([angles, angles], dim=-1)                                # [..., D]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, Q, heads, D] by table rows cos, sin [B, Q, D] (float32) -> x's dtype."""
    D = x.shape[-1]
    x32 = x.float()
    rotated = torch.cat([-x32[..., D // 2:], x32[..., : D // 2]], dim=-1)
    return (x32 * cos[:, :, None] + rotated * sin[:, :, None]).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [B, Q, heads, D] at integer positions [B, Q] (no table kept)."""
    return apply_rope(x, *rope_table(positions, x.shape[-1]))


def fold_heads(q: torch.Tensor, G: int) -> torch.Tensor:
    """Fold q [B, Q, N, D] -> [B, G, r*Q, D]: the r = N/G heads sharing a K/V head as rows."""
    B, Q, N, D = q.shape
    return q.view(B, Q, G, N // G, D).permute(0, 2, 3, 1, 4).reshape(B, G, N // G * Q, D)


def unfold_heads(out: torch.Tensor, Q: int) -> torch.Tensor:
    """Undo fold_heads on the attention output: [B, G, r*Q, D] -> [B, Q, N*D]."""
    B, G, rQ, D = out.shape
    return out.view(B, G, rQ // Q, Q, D).permute(0, 3, 1, 2, 4).reshape(B, Q, G * rQ // Q * D)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              key_mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention with grouped KV heads.

    q [B, Q, N, D]; k, v [B, K, G, D]; key_mask bool [B, Q, K] or [B, 1, K]
    (True = may attend), or None when every query sees every key (no mask is materialized).
    Returns [B, Q, N*D]. Scale is D^-0.5 as in Gemma.
    With one mask row for all queries (prefill, decode) the heads of a group are folded into
    rows of one K/V head (fold_heads) instead of repeating K/V per head, and attend through
    the C++ kernel where it applies (cpu_attention_applies), SDPA elsewhere.
    """
    B, Q, N, D = q.shape
    G = k.shape[2]
    if key_mask is None or key_mask.shape[1] == 1:
        folded, keys, values = fold_heads(q, G), k.transpose(1, 2), v.transpose(1, 2)
        if cpu_attention_applies(folded):
            out = torch.ops.oxygen_attention.attention(
                folded, keys, values, None if key_mask is None else key_mask[:, 0])
        else:
            out = F.scaled_dot_product_attention(
                folded, keys, values,
                attn_mask=None if key_mask is None else key_mask[:, None])      # [B, G, rQ, D]
        return unfold_heads(out, Q)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=key_mask[:, None], enable_gqa=G != N)                         # [B, N, Q, D]
    return out.transpose(1, 2).reshape(B, Q, N * D)


def cpu_attention_applies(folded: torch.Tensor) -> bool:
    """Whether the rows of queries [B, G, rows, D] attend through the C++ kernel, not SDPA.

    It takes bf16 at a head dim of 32, 48 or 64 on a CPU with AVX512-BF16, on AMX tiles
    where it has them (packed_native.ready; attention_kernel.cpp says why), with as many rows
    a group (heads sharing a K/V head folded into rows, or one head's) as it needs to beat
    SDPA (packed_native.attention_min_rows: 32 on tiles, a decode step's 8 running faster in
    SDPA there). It has no gradient: a pass that takes one (guided real-time chunking) keeps
    SDPA.
    """
    return (folded.shape[-1] in (32, 48, 64)
            and folded.shape[2] >= packed_native.attention_min_rows()
            and folded.dtype == torch.bfloat16
            and folded.device.type == 'cpu' and packed_native.ready('oxygen_attention')
            and not (folded.requires_grad and torch.is_grad_enabled()))


def key_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Turn a key mask bool [B, K] into an additive bias [B, K]: 0 where True, -inf where not."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill(~mask, float('-inf'))


def host_run(ids: torch.Tensor) -> int | None:
    """First id when `ids` are host ids forming a run (s, s+1, ...), else None.

    Host ids cost nothing to read. Ids on an accelerator are never read (that would sync),
    nor while torch.compile traces (shapes and paths must not depend on values).
    """
    if ids.device.type != 'cpu' or torch.compiler.is_compiling():
        return None
    values = ids.tolist()
    return values[0] if values == list(range(values[0], values[0] + len(values))) else None


def take_rows(storage: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Entries `ids` [B] of storage [S, ...] (a pool's slots or blocks) -> [B, ...].

    A run of host ids (host_run) is a view; otherwise one gather (index_select) on the
    storage's device.
    """
    run = host_run(ids)
    if run is not None:
        return storage[run:run + ids.shape[0]]
    return storage.index_select(0, ids.to(storage.device))


def attention_two_blocks(q: torch.Tensor, k1: torch.Tensor, v1: torch.Tensor,
                         bias1: torch.Tensor, k2: torch.Tensor, v2: torch.Tensor,
                         bias2: torch.Tensor | None = None, *, rows1: torch.Tensor | None = None,
                         rows2: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over the keys of two blocks with one softmax.

    q [B, Q, N, D]; k1, v1 [B, K1, G, D] with bias1 [B, K1] (key_bias of its mask), e.g. a
    slot's prefix read in place from the pool; k2, v2 [B, K2, G, D] with bias2 [B, K2], or
    None when all are visible (the denoise step: the queries' own block; a decode step: its
    request's generation block, masked to the entries written). Every query sees the same
    keys, except with bias2 [B, Q, K2]: a mask per query over the second block (an extend
    pass: causal over its own tokens). Equals
    `attention(q, cat(k1, k2), cat(v1, v2), cat(mask1, mask2)[:, None])`. The heads sharing a
    K/V head fold into rows (fold_heads) and one fused kernel runs: the C++ attention where
    cpu_attention_applies, which reads both blocks where they lie (a decode step's slot and
    block stay in the pool); else SDPA over the concatenation. Why not two SDPAs: with a head
    dim of 32 (pi05-cpu), four separate matmuls and a softmax over the two blocks cost ~3x
    the concatenation plus one SDPA in bfloat16 (1.4x in float32). Returns [B, Q, N*D].

    rows1 (long [B]): k1, v1 are [S, K1, G, D] (a pool's slots, in the storage's dtype) and
    row b reads entry rows1[b]: the kernel reads it in place, SDPA after take_rows (a view
    for a host run of ids) and a cast to q's dtype. rows2 the same for k2, v2. This is the
    one place that decides between the two.
    """
    B, Q, N, D = q.shape
    G, K2 = k1.shape[2], k2.shape[1]
    folded = fold_heads(q, G)
    if ((bias2 is None or bias2.dim() == 2) and cpu_attention_applies(folded)
            and k1.dtype == k2.dtype == q.dtype):
        out = torch.ops.oxygen_attention.attention(
            folded, k1.transpose(1, 2), v1.transpose(1, 2), bias1, k2.transpose(1, 2),
            v2.transpose(1, 2), bias2, rows1, rows2)                          # [B, G, rQ, D]
        return unfold_heads(out, Q)
    if rows1 is not None:
        k1, v1 = take_rows(k1, rows1).to(q.dtype), take_rows(v1, rows1).to(q.dtype)
    if rows2 is not None:
        k2, v2 = take_rows(k2, rows2).to(q.dtype), take_rows(v2, rows2).to(q.dtype)
    keys = torch.cat([k1, k2], dim=1).transpose(1, 2)                        # [B, G, K, D]
    values = torch.cat([v1, v2], dim=1).transpose(1, 2)
    bias2 = bias1.new_zeros(B, K2, dtype=q.dtype) if bias2 is None else bias2.to(q.dtype)
    if bias2.dim() == 3:   # per query: [B, Q, K1+K2], repeated for the r folded heads
        K = k1.shape[1] + K2
        bias = torch.cat([bias1.to(q.dtype)[:, None].expand(B, Q, -1), bias2], dim=2)
        mask = bias[:, None, None].expand(B, 1, N // G, Q, K).reshape(B, 1, N // G * Q, K)
    else:
        bias = torch.cat([bias1.to(q.dtype), bias2], dim=1)                   # [B, K1+K2]
        mask = bias[:, None, None, :]                                         # [B, 1, 1, K]
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask)  # [B, G, rQ, D]
    return unfold_heads(out, Q)                                               # [B, Q, N*D]
