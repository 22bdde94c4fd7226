"""π0.5: PaliGemma backbone + action expert (Mixture-of-Transformers) with an explicit KV cache.

Letters used in shapes:
  B batch rows, C camera slots, Ti tokens per image, Lt prompt tokens,
  P = C*Ti + Lt static prefix length, H action horizon, A action dim,
  L layers, S cache slots, T cache length per slot, G kv heads, D head dim, W width.

Inference is the three passes the engine schedules separately:
  prefill        images + prompt -> per-layer K (after RoPE) / V of the prefix, written into
                 caller-owned storage `KVTensors` rows `slots`.
  sample_actions expert-only flow matching; the H action tokens attend to the cached prefix
                 read-only (the prefix never attends to the suffix, so this equals openpi's
                 joint forward).
  decode_step    one text token per row; row b writes its K/V at storage index P + gen_len[b]
                 and RoPE position n_valid[b] + gen_len[b]. Rows are independent, so requests
                 from different frames batch together by slot id.
Parameter names follow openpi's `model.safetensors` (see checkpoint.py for the one rename).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn
import torch.nn.functional as F

from .config import Pi05Config
from .gemma import attention, gated_residual, GemmaModel, rope
from .siglip import MultiModalProjector, SiglipVisionTower

# Parameters that stay float32 when the model runs in bfloat16 (openpi's float32 islands).
FLOAT32_PARAMS = (
    'vision_model.embeddings.patch_embedding', 'vision_model.embeddings.position_embedding',
    'input_layernorm', 'post_attention_layernorm', 'model.norm',
    'action_in_proj', 'action_out_proj', 'time_mlp_in', 'time_mlp_out',
)


@dataclasses.dataclass
class KVTensors:
    """KV storage: plain tensors, owned by whoever allocated them (normally the engine's pool)."""

    k: torch.Tensor  # [L, S, T, G, D], keys after RoPE
    v: torch.Tensor  # [L, S, T, G, D]

    @classmethod
    def allocate(cls, cfg: Pi05Config, num_slots: int, max_len: int,
                 dtype=torch.float32, device=None) -> KVTensors:
        b = cfg.backbone
        shape = (b.depth, num_slots, max_len, b.num_kv_heads, b.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


@dataclasses.dataclass
class PrefixCache:
    """Result of `prefill`: where the prefix K/V live and which positions are real."""

    kv: KVTensors              # storage the prefix was written into
    slots: torch.Tensor        # long [B], storage rows holding this batch
    valid: torch.Tensor        # bool [B, P], real (unmasked, unpadded) prefix positions
    n_valid: torch.Tensor      # long [B], valid.sum(-1): first free RoPE position
    last_hidden: torch.Tensor  # [B, W], final-normed hidden at the last valid position
    prefix_len: int            # P

    def row(self, i: int) -> PrefixCache:
        """One row as its own PrefixCache (views, no copy)."""
        return PrefixCache(self.kv, self.slots[i:i + 1], self.valid[i:i + 1],
                           self.n_valid[i:i + 1], self.last_hidden[i:i + 1], self.prefix_len)


def rows(storage: torch.Tensor, slots: list[int], stop: int) -> torch.Tensor:
    """Select rows: storage [S, T, ...] -> [B, stop, ...] for the given slots.

    A run of consecutive slots is a view; anything else is one gather (index_select).
    """
    if _is_run(slots):
        return storage[slots[0]:slots[0] + len(slots), :stop]
    index = torch.tensor(slots, device=storage.device)
    return storage[:, :stop].index_select(0, index)


def write_rows(storage: torch.Tensor, slots: list[int], values: torch.Tensor) -> None:
    """Write rows: storage [S, T, ...][slots, :n] = values [B, n, ...] (prefill's write)."""
    n = values.shape[1]
    if _is_run(slots):
        storage[slots[0]:slots[0] + len(slots), :n] = values
    else:
        storage[torch.tensor(slots, device=storage.device), :n] = values


def _is_run(slots: list[int]) -> bool:
    return slots == list(range(slots[0], slots[0] + len(slots)))


def time_embedding(t: torch.Tensor, width: int) -> torch.Tensor:
    """Sine-cosine embedding of flow time t [B] -> [B, width], periods 4e-3 .. 4."""
    fraction = torch.linspace(0.0, 1.0, width // 2, dtype=torch.float64, device=t.device)
    period = 4e-3 * (4.0 / 4e-3) ** fraction
    angle = (2 * math.pi / period)[None, :] * t.double()[:, None]          # [B, W/2]
    return torch.cat([angle.sin(), angle.cos()], dim=-1).float()


class Pi05Model(nn.Module):
    """π0.5 weights and the prefill / sample_actions / decode_step passes."""

    def __init__(self, cfg: Pi05Config):
        super().__init__()
        self.config = cfg
        b, e = cfg.backbone, cfg.expert
        # Module nesting mirrors openpi's checkpoint keys:
        #   paligemma_with_expert.paligemma.model.{vision_tower, multi_modal_projector,
        #   language_model}, paligemma_with_expert.gemma_expert.model.
        pwe = nn.Module()
        pwe.paligemma = nn.Module()
        pwe.paligemma.model = nn.Module()
        pwe.paligemma.model.vision_tower = SiglipVisionTower(cfg.vision)
        pwe.paligemma.model.multi_modal_projector = MultiModalProjector(cfg.vision.hidden,
                                                                        b.width)
        pwe.paligemma.model.language_model = GemmaModel(b)
        pwe.gemma_expert = nn.Module()
        pwe.gemma_expert.model = GemmaModel(e, cond_dim=e.width, embed=False)
        self.paligemma_with_expert = pwe
        self.action_in_proj = nn.Linear(cfg.action_dim, e.width)
        self.action_out_proj = nn.Linear(e.width, cfg.action_dim)
        self.time_mlp_in = nn.Linear(e.width, e.width)
        self.time_mlp_out = nn.Linear(e.width, e.width)

    # Short names for the towers (properties, so no parameter is registered twice).
    @property
    def vision(self) -> SiglipVisionTower:
        return self.paligemma_with_expert.paligemma.model.vision_tower

    @property
    def projector(self) -> MultiModalProjector:
        return self.paligemma_with_expert.paligemma.model.multi_modal_projector

    @property
    def backbone(self) -> GemmaModel:
        return self.paligemma_with_expert.paligemma.model.language_model

    @property
    def expert(self) -> GemmaModel:
        return self.paligemma_with_expert.gemma_expert.model

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.backbone.layers[0].self_attn.q_proj.weight.dtype

    def to_precision(self, dtype: torch.dtype) -> Pi05Model:
        """Cast to `dtype`, keeping openpi's float32 islands (norms, embeddings, projections)."""
        for name, param in self.named_parameters():
            # Cast each parameter once to its final dtype, so islands are never rounded.
            keep = dtype != torch.float32 and any(key in name for key in FLOAT32_PARAMS)
            param.data = param.data.to(torch.float32 if keep else dtype)
        return self

    def init_random(self, seed: int = 0, text_ids: list[int] | None = None) -> Pi05Model:
        """Random weights for demos and tests (deterministic for a seed).

        text_ids: ids that decode to text with the tokenizer in use; every other embedding row
        is zeroed so the tied LM head (logit exactly 0 there) never emits an id that would
        decode as unknown, a lone byte or a control token.

        Matrices get std 1/sqrt(fan_in) so every residual branch matters; the embedding gets
        std 1/sqrt(width) so the tied LM head does not simply echo the input token; norm and
        adaRMS parameters are non-zero so the (1 + w) and modulation paths are exercised.
        """
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
                if name.endswith('embed_tokens.weight'):
                    scale = 0.2 * param.shape[1] ** -0.5
                elif name.endswith('bias') or 'norm' in name or param.dim() == 1:
                    scale = 0.1
                else:
                    scale = math.prod(param.shape[1:]) ** -0.5
                    if 'dense' in name:
                        scale *= 0.3  # keep adaRMS scale/shift/gate modest
                param.copy_(noise * scale)
            if text_ids is not None:
                embed = self.backbone.embed_tokens.weight
                keep = torch.zeros(embed.shape[0], dtype=torch.bool)
                keep[torch.tensor(text_ids, dtype=torch.long)] = True
                embed[~keep] = 0.0
        return self

    # ------------------------------------------------------------------ prefix
    def embed_prefix(self, images, image_masks, tokens, token_masks):
        """Embed cameras and prompt -> (x [B, P, W], valid bool [B, P])."""
        B, C = images.shape[:2]
        dtype = self.compute_dtype
        feats = self.projector(self.vision.vision_model(images.flatten(0, 1)))  # [B*C, Ti, W]
        Ti = feats.shape[1]
        img = feats.view(B, C * Ti, -1).to(dtype)
        img_valid = image_masks[:, :, None].expand(B, C, Ti).reshape(B, C * Ti)
        width = self.config.backbone.width
        # Text embeddings are scaled by sqrt(width); image features are not.
        txt = self.backbone.embed_tokens(tokens).to(dtype) * math.sqrt(width)
        return torch.cat([img, txt], dim=1), torch.cat([img_valid, token_masks.bool()], dim=1)

    @torch.no_grad()
    def prefill(self, images: torch.Tensor, image_masks: torch.Tensor, tokens: torch.Tensor,
                token_masks: torch.Tensor, kv: KVTensors | None = None,
                slots: torch.Tensor | None = None, extra_len: int = 0) -> PrefixCache:
        """Encode one observation per row and write its prefix K/V into `kv` rows `slots`.

        images [B, C, 3, S, S] in [-1, 1]; image_masks bool [B, C]; tokens long [B, Lt];
        token_masks bool [B, Lt]. Without `kv`, private storage of P + extra_len is allocated.
        """
        cfg = self.config
        B, C = images.shape[:2]
        if C != cfg.num_cameras or tokens.shape[1] != cfg.max_token_len:
            raise ValueError(f'prefill expects {cfg.num_cameras} cameras and '
                             f'{cfg.max_token_len} tokens, got {C} and {tokens.shape[1]}')
        x, valid = self.embed_prefix(images, image_masks, tokens, token_masks)   # [B, P, W]
        P = x.shape[1]
        if kv is None:
            kv = KVTensors.allocate(cfg, B, P + extra_len, self.compute_dtype, x.device)
            slots = torch.arange(B)
        slot_list = [int(s) for s in slots]
        if len(slot_list) != B or kv.max_len < P:
            raise ValueError(f'need {B} slots of length >= {P}, got {len(slot_list)} of '
                             f'{kv.max_len}')
        # Positions skip masked cameras and padding; the prefix is fully bidirectional.
        positions = valid.long().cumsum(-1) - 1                                  # [B, P]
        key_mask = valid[:, None, :]                                            # [B, 1, P]
        for i, layer in enumerate(self.backbone.layers):
            h, _ = layer.input_layernorm(x)
            q, k, v = layer.self_attn.qkv(h)
            q, k = rope(q, positions), rope(k, positions)
            write_rows(kv.k[i], slot_list, k)
            write_rows(kv.v[i], slot_list, v)
            x = x + layer.self_attn.o_proj(attention(q, k, v, key_mask))
            h, _ = layer.post_attention_layernorm(x)
            x = x + layer.mlp(h)
        # The first generated token reads the hidden state at the last valid position.
        last = P - 1 - valid.flip(-1).long().argmax(-1)                         # [B]
        last_hidden, _ = self.backbone.norm(x[torch.arange(B, device=x.device), last][:, None])
        return PrefixCache(kv, torch.tensor(slot_list), valid, valid.sum(-1), last_hidden[:, 0],
                           P)

    # ----------------------------------------------------------------- actions
    @torch.no_grad()
    def sample_actions(self, prefix: PrefixCache, noise: torch.Tensor,
                       num_steps: int | None = None) -> torch.Tensor:
        """Flow matching: Euler from t=1 (noise) to t=0. noise [B, H, A] -> actions [B, H, A]."""
        steps = num_steps or self.config.num_steps
        B, Hn, _ = noise.shape
        P, slot_list = prefix.prefix_len, [int(s) for s in prefix.slots]
        L = self.config.backbone.depth
        # One buffer per call: the prefix K/V are gathered (or viewed) once, then each step
        # writes only the H suffix entries behind them. The pool is never written.
        k_buf = torch.empty((L, B, P + Hn) + prefix.kv.k.shape[3:], dtype=prefix.kv.k.dtype,
                            device=noise.device)
        v_buf = torch.empty_like(k_buf)
        for i in range(L):
            k_buf[i, :, :P] = rows(prefix.kv.k[i], slot_list, P)
            v_buf[i, :, :P] = rows(prefix.kv.v[i], slot_list, P)
        device = noise.device
        suffix_pos = prefix.n_valid.to(device)[:, None] + torch.arange(Hn, device=device)
        key_mask = torch.cat([prefix.valid, prefix.valid.new_ones(B, Hn)], dim=1)[:, None]
        x_t = noise.float()
        dt = -1.0 / steps
        for step in range(steps):
            t = torch.full((B,), 1.0 - step / steps, device=noise.device)
            v_t = self.denoise_velocity(k_buf, v_buf, key_mask, suffix_pos, x_t, t)
            x_t = x_t + dt * v_t
        return x_t

    def denoise_velocity(self, k_buf, v_buf, key_mask, suffix_pos, x_t, t) -> torch.Tensor:
        """One expert pass: velocity v(x_t, t) [B, H, A], suffix K/V written at k_buf[:, :, P:]."""
        P = k_buf.shape[2] - x_t.shape[1]
        width = self.config.expert.width
        cond = F.silu(self.time_mlp_in(time_embedding(t, width).to(self.time_mlp_in.weight.dtype)))
        cond = F.silu(self.time_mlp_out(cond))                                   # [B, We]
        x = self.action_in_proj(x_t.to(self.action_in_proj.weight.dtype)).to(self.compute_dtype)
        for i, layer in enumerate(self.expert.layers):
            h, gate = layer.input_layernorm(x, cond)
            q, k, v = layer.self_attn.qkv(h.to(layer.self_attn.q_proj.weight.dtype))
            q, k = rope(q, suffix_pos), rope(k, suffix_pos)
            k_buf[i, :, P:], v_buf[i, :, P:] = k, v
            x = gated_residual(x, layer.self_attn.o_proj(attention(q, k_buf[i], v_buf[i],
                                                                   key_mask)), gate)
            h, gate = layer.post_attention_layernorm(x, cond)
            x = gated_residual(x, layer.mlp(h), gate)
        x, _ = self.expert.norm(x, cond)
        return self.action_out_proj(x.to(self.action_out_proj.weight.dtype)).float()

    # -------------------------------------------------------------------- text
    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied LM head: [B, W] final-normed hidden -> float32 logits [B, vocab]."""
        embed = self.backbone.embed_tokens.weight
        return F.linear(hidden.to(embed.dtype), embed).float()

    @torch.no_grad()
    def decode_step(self, kv: KVTensors, slots: torch.Tensor, prefix_valid: torch.Tensor,
                    n_valid: torch.Tensor, gen_len: torch.Tensor,
                    tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row, append its K/V, return next-token logits [B, vocab].

        slots long [B]; prefix_valid bool [B, P]; n_valid, gen_len, tokens long [B].
        Row b writes storage index P + gen_len[b] and attends to its valid prefix plus
        storage [P, P + gen_len[b]]. The caller advances gen_len.
        """
        B, P = prefix_valid.shape
        device = prefix_valid.device
        slot_list, gen_list = [int(s) for s in slots], [int(g) for g in gen_len]
        stop = P + max(gen_list) + 1
        if stop > kv.max_len:
            raise ValueError(f'decode needs cache length {stop}, storage has {kv.max_len}')
        gen_len, n_valid = gen_len.to(device), n_valid.to(device)
        width = self.config.backbone.width
        x = self.backbone.embed_tokens(tokens.to(device))[:, None].to(self.compute_dtype)
        x = x * math.sqrt(width)                                                # [B, 1, W]
        positions = (n_valid + gen_len)[:, None]                                # [B, 1]
        generated = torch.arange(stop - P, device=device)[None] <= gen_len[:, None]
        key_mask = torch.cat([prefix_valid, generated], dim=1)[:, None]         # [B, 1, stop]
        slot_index = torch.tensor(slot_list, device=kv.k.device)
        write_index = (P + gen_len).to(kv.k.device)
        for i, layer in enumerate(self.backbone.layers):
            h, _ = layer.input_layernorm(x)
            q, k, v = layer.self_attn.qkv(h)
            q, k = rope(q, positions), rope(k, positions)
            kv.k[i, slot_index, write_index] = k[:, 0]
            kv.v[i, slot_index, write_index] = v[:, 0]
            keys, values = rows(kv.k[i], slot_list, stop), rows(kv.v[i], slot_list, stop)
            x = x + layer.self_attn.o_proj(attention(q, keys, values, key_mask))
            h, _ = layer.post_attention_layernorm(x)
            x = x + layer.mlp(h)
        h, _ = self.backbone.norm(x)
        return self.lm_logits(h[:, 0])

    @torch.no_grad()
    def generate(self, prefix: PrefixCache, max_new_tokens: int, eos_id: int | None = 1,
                 greedy: bool = True, generator: torch.Generator | None = None,
                 temperature: float = 1.0) -> list[list[int]]:
        """Decode up to `max_new_tokens` per row; a row stops after emitting `eos_id`.

        Token 0 comes from `last_hidden`; each later token costs one decode_step on the rows
        still running, so ragged rows batch together. Storage needs P + max_new_tokens - 1.
        """
        def pick(logits):
            if greedy:
                return logits.argmax(-1)
            probs = torch.softmax(logits / temperature, dim=-1)
            return torch.multinomial(probs.cpu(), 1, generator=generator)[:, 0].to(logits.device)

        B = prefix.valid.shape[0]
        out: list[list[int]] = [[] for _ in range(B)]
        if max_new_tokens <= 0:
            return out
        nxt = pick(self.lm_logits(prefix.last_hidden))
        running = list(range(B))
        for j in range(max_new_tokens):
            for b, tok in zip(running, nxt.tolist()):
                out[b].append(tok)
            running = [b for b in running if out[b][-1] != eos_id]
            if not running or j == max_new_tokens - 1:
                break
            idx = torch.tensor(running)
            nxt = pick(self.decode_step(
                prefix.kv, prefix.slots[idx], prefix.valid[idx.to(prefix.valid.device)],
                prefix.n_valid[idx.to(prefix.n_valid.device)],
                torch.full((len(running),), j, dtype=torch.long),
                torch.tensor([out[b][-1] for b in running])))
        return out
