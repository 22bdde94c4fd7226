"""π0.5: PaliGemma backbone + action expert (Mixture-of-Transformers) with an explicit KV cache.

Letters used in shapes (one per dimension; gemma.py and siglip.py use the same):
  B batch rows, C camera slots, R image side (pixels), Ti tokens per image, Lt prompt tokens,
  P = C*Ti + Lt static prefix length, H action horizon, A action dim, L layers,
  S cache slots, T cache positions per slot (P + generated), J generated positions a decode
  step attends, Q query tokens of a pass, N query heads, G kv heads, D head dim,
  W width (We of the expert), V vocab.

Inference is the three passes the engine schedules separately. All three run the same layer
body (`GemmaLayer.forward`) and differ only in what they pass: positions, the conditioning,
and `attend` (where this layer's K/V go and which keys, under which mask, the queries see).
  prefill        images + prompt -> per-layer K (after RoPE) / V of the prefix, written into
                 caller-owned storage `KVTensors` rows `slots`; bidirectional over the prefix.
  sample_actions expert-only flow matching; the H action tokens attend to the slot's prefix
                 K/V read in place (two score blocks, one softmax: prefix keys + their own),
                 so nothing of size P is copied per frame. The prefix never attends to the
                 suffix, so this equals openpi's joint forward.
  decode_step    one text token per row; row b writes its K/V at storage index P + gen_len[b]
                 and RoPE position n_valid[b] + gen_len[b], and attends to its valid prefix
                 plus J generated positions under a mask. Rows are independent, so requests
                 from different frames (and padding rows on a null slot) batch by slot id.

Static shapes: with `attend_len` and ids on the model's device a decode step reads no tensor
value on the host, and its shapes depend only on (B, attend_len), so `compile_decode` can
capture it (CUDA graphs via torch.compile mode='reduce-overhead'); `compile_actions` compiles
the expert pass. Both are off by default (CPU); RoPE tables are built once per device.
Parameter names follow openpi's `model.safetensors` (see checkpoint.py for the one rename).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn
import torch.nn.functional as F

from .config import Pi05Config
from . import rtc
from .gemma import attention, attention_two_blocks, GemmaModel, key_bias, rope_table
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


def host_run(slots: torch.Tensor) -> int | None:
    """First id when `slots` are host ids forming a run (s, s+1, ...), else None.

    Host ids cost nothing to read. Ids on an accelerator are never read (that would sync),
    nor while torch.compile traces (shapes and paths must not depend on values).
    """
    if slots.device.type != 'cpu' or torch.compiler.is_compiling():
        return None
    ids = slots.tolist()
    return ids[0] if ids == list(range(ids[0], ids[0] + len(ids))) else None


def slot_rows(storage: torch.Tensor, slots: torch.Tensor, run: int | None,
              start: int, stop: int) -> torch.Tensor:
    """Read storage [S, T, ...] rows `slots`, positions [start, stop) -> [B, stop-start, ...].

    A run of ids (`run` = its first id, see host_run) is a view; otherwise one gather
    (index_select) by `slots` on the storage's device.
    """
    if run is not None:
        return storage[run:run + slots.shape[0], start:stop]
    return storage[:, start:stop].index_select(0, slots.to(storage.device))


def write_rows(storage: torch.Tensor, slots: list[int], values: torch.Tensor) -> None:
    """Write rows: storage [S, T, ...][slots, :n] = values [B, n, ...] (prefill's write)."""
    n = values.shape[1]
    values = values.to(storage.dtype)   # a narrower store (bf16 K/V) rounds here
    if slots == list(range(slots[0], slots[0] + len(slots))):
        storage[slots[0]:slots[0] + len(slots), :n] = values
    else:
        storage[torch.tensor(slots, device=storage.device), :n] = values


def attend_bucket(needed: int, limit: int) -> int:
    """Pick decode's static attend length: a power of two >= needed (>= 8), capped at limit.

    needed = max(gen_len) + 1 over the real rows; limit = T - P. A caller that knows gen_len as
    ints picks the bucket, so a step's shapes take a few values only (one graph each).
    """
    return min(limit, max(8, 1 << (needed - 1).bit_length()))


def attend_prefix_and_generated(q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor,
                                prefix_bias: torch.Tensor, k_gen: torch.Tensor,
                                v_gen: torch.Tensor, gen_bias: torch.Tensor) -> torch.Tensor:
    """Attend a decode step's q [B, 1, N, D] over its prefix and its generated tokens.

    k_prefix, v_prefix [B, P, G, D] with prefix_bias [B, P] (the slot's valid positions);
    k_gen, v_gen [B, J, G, D] with gen_bias [B, J] (the entries generated so far, this
    step's included). The two parts are read where they live (a prefix slot and a
    generation block) and attended with one softmax, never concatenated (measured on
    pi05-cpu, 8 rows: 8.0 ms a step vs 8.5 ms concatenating; 8.6 vs 10.0 ms with two rows per
    prefix slot, where the prefix is gathered). -> [B, 1, N*D].
    """
    return attention_two_blocks(q, k_prefix, v_prefix, prefix_bias, k_gen, v_gen, gen_bias)


def time_embedding(t: torch.Tensor, width: int) -> torch.Tensor:
    """Sine-cosine embedding of flow time t [B] (or per token [B, H]) -> [..., width].

    Periods 4e-3 .. 4.
    """
    fraction = torch.linspace(0.0, 1.0, width // 2, dtype=torch.float64, device=t.device)
    period = 4e-3 * (4.0 / 4e-3) ** fraction
    angle = (2 * math.pi / period) * t.double()[..., None]                 # [..., W/2]
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
        # RoPE tables (not parameters: no checkpoint key), built once per device and grown
        # only when a longer cache shows up; see rope_tables().
        self._rope_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._decode_fn = None   # torch.compile'd _decode_layers, set by compile_decode()
        self._velocity_fn = None  # torch.compile'd denoise_velocity, set by compile_actions()

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

    def rope_tables(self, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the RoPE tables cos, sin float32 [>= length, D] on `device` (built once)."""
        device = torch.device(device)
        table = self._rope_tables.get(device)
        if table is None or table[0].shape[0] < length:
            # Room for the prefix, the action suffix and a generous generation by default.
            size = max(length, self.config.prefix_len + self.config.action_horizon + 512)
            table = rope_table(torch.arange(size, device=device), self.config.backbone.head_dim)
            self._rope_tables[device] = table
        return table

    # ------------------------------------------------------------------ prefix
    def embed_prefix(self, images, image_masks, tokens, token_masks):
        """Embed cameras and prompt -> (x [B, P, W], valid bool [B, P]).

        Only unmasked cameras go through the vision tower; a masked camera's Ti rows are zeros
        (no query ever attends them, so their content is irrelevant).
        """
        B, C = images.shape[:2]
        dtype = self.compute_dtype
        width = self.config.backbone.width
        Ti = self.config.tokens_per_image
        cams = image_masks.reshape(B * C)                                       # [B*C]
        img = torch.zeros(B * C, Ti, width, dtype=dtype, device=images.device)
        if bool(cams.any()):
            shown = images.flatten(0, 1)[cams]                                  # [n, 3, R, R]
            img[cams] = self.projector(self.vision.vision_model(shown)).to(dtype)
        img = img.view(B, C * Ti, width)                                        # [B, C*Ti, W]
        img_valid = image_masks[:, :, None].expand(B, C, Ti).reshape(B, C * Ti)
        # Text embeddings are scaled by sqrt(width); image features are not.
        txt = self.backbone.embed_tokens(tokens).to(dtype) * math.sqrt(width)  # [B, Lt, W]
        return torch.cat([img, txt], dim=1), torch.cat([img_valid, token_masks.bool()], dim=1)

    @torch.no_grad()
    def prefill(self, images: torch.Tensor, image_masks: torch.Tensor, tokens: torch.Tensor,
                token_masks: torch.Tensor, kv: KVTensors | None = None,
                slots: torch.Tensor | None = None, extra_len: int = 0) -> PrefixCache:
        """Encode one observation per row and write its prefix K/V into `kv` rows `slots`.

        images [B, C, 3, R, R] in [-1, 1]; image_masks bool [B, C]; tokens long [B, Lt];
        token_masks bool [B, Lt]. Without `kv`, private storage of P + extra_len is allocated.

        The layers run on the valid positions only (a masked camera and prompt padding are
        40% of a LIBERO prefix and are never attended): each row's valid tokens are packed to
        the front, [B, n, W] with n = the most valid tokens of a row, and their K/V are
        scattered back to their places in the slot's P positions; the other positions hold
        zeros (so a slot's content does not depend on what it was batched with). Positions
        (cumsum(valid) - 1) of a packed row are simply 0..n-1.
        """
        cfg = self.config
        B, C = images.shape[:2]
        if C != cfg.num_cameras or tokens.shape[1] != cfg.max_token_len:
            raise ValueError(f'prefill expects {cfg.num_cameras} cameras and '
                             f'{cfg.max_token_len} tokens, got {C} and {tokens.shape[1]}')
        x_full, valid = self.embed_prefix(images, image_masks, tokens, token_masks)  # [B, P, W]
        P, W = x_full.shape[1], x_full.shape[2]
        if kv is None:
            kv = KVTensors.allocate(cfg, B, P + extra_len, self.compute_dtype, x_full.device)
            slots = torch.arange(B)
        slot_list = [int(s) for s in slots]
        if len(slot_list) != B or kv.max_len < P:
            raise ValueError(f'need {B} slots of length >= {P}, got {len(slot_list)} of '
                             f'{kv.max_len}')
        counts = valid.sum(-1)                                                  # [B]
        n = max(int(counts.max()), 1)
        # Valid positions first, in order (a stable sort of ~valid), then padding ones.
        order = torch.sort((~valid).to(torch.uint8), dim=-1, stable=True).indices[:, :n]
        x = x_full.gather(1, order[..., None].expand(B, n, W))                  # [B, n, W]
        packed_valid = torch.arange(n, device=x.device)[None] < counts[:, None]  # [B, n]
        cos, sin = self.rope_tables(n, x.device)
        cos, sin = cos[:n].expand(B, n, -1), sin[:n].expand(B, n, -1)           # [B, n, D]
        # Rows of equal length (one robot's frames) need no mask; then SDPA materializes no
        # scores and all rows go in one call. Ragged rows (robots with different cameras or
        # prompts) attend under a mask, one row at a time on the CPU: with a mask its SDPA
        # materializes N·n·n floats per row.
        ragged = bool((counts != n).any())
        key_mask = packed_valid[:, None, :] if ragged else None                 # [B, 1, n]
        rows = ([slice(b, b + 1) for b in range(B)] if ragged and x.device.type == 'cpu'
                else [slice(None)])
        scatter = order[..., None, None]                                        # [B, n, 1, 1]
        keep = packed_valid[..., None, None] if ragged else None                # [B, n, 1, 1]

        def place(packed: torch.Tensor) -> torch.Tensor:   # [B, n, G, D] -> [B, P, G, D]
            if keep is not None:   # a ragged row's tail is padding: store zeros, as alone
                packed = packed * keep
            full = packed.new_zeros(B, P, *packed.shape[2:])
            return full.scatter_(1, scatter.expand_as(packed), packed)

        for i, layer in enumerate(self.backbone.layers):
            def attend(q, k, v, i=i):   # write the prefix K/V, attend among the prefix
                write_rows(kv.k[i], slot_list, place(k))
                write_rows(kv.v[i], slot_list, place(v))
                if len(rows) == 1:
                    return attention(q, k, v, key_mask)
                return torch.cat([attention(q[r], k[r], v[r], key_mask[r]) for r in rows])
            x = layer(x, cos, sin, attend)
        # The first generated token reads the hidden state at the last valid position.
        last = (counts - 1).clamp(min=0)                                        # [B]
        last_hidden, _ = self.backbone.norm(x[torch.arange(B, device=x.device), last][:, None])
        return PrefixCache(kv, torch.tensor(slot_list), valid, counts, last_hidden[:, 0], P)

    # ----------------------------------------------------------------- actions
    @torch.no_grad()
    def sample_actions(self, prefix: PrefixCache, noise: torch.Tensor,
                       num_steps: int | None = None,
                       inpaint: rtc.Inpainting | None = None) -> torch.Tensor:
        """Flow matching: Euler from t=1 (noise) to t=0. noise [B, H, A] -> actions [B, H, A].

        The prefix K/V are read where prefill wrote them: views for host slot ids that form a
        run (one frame: B = 1), else one gather per layer per call. The pool is never written.
        inpaint: real-time chunking (model/rtc.py): the same steps over the same prefix K/V,
        continuing a committed chunk (guided, or its frozen rows held clean).
        """
        steps = num_steps or self.config.num_steps
        B, H, _ = noise.shape
        context = self.action_context(prefix, H, noise.device)
        velocity = self._velocity_fn or self.denoise_velocity
        if inpaint is not None:
            return rtc.sample(lambda x, t: velocity(*context, x, t), noise, steps, inpaint)
        x_t = noise.float()
        dt = -1.0 / steps
        for step in range(steps):
            t = torch.full((B,), 1.0 - step / steps, device=noise.device)
            x_t = x_t + dt * velocity(*context, x_t, t)
        return x_t

    def action_context(self, prefix: PrefixCache, horizon: int, device
                       ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor,
                                  torch.Tensor, torch.Tensor]:
        """Return what every denoise step of `prefix`'s rows reads: denoise_velocity's first four.

        (prefix_kv: per layer (K, V) [B, P, G, D], prefix_bias [B, P], cos, sin [B, H, D] at
        the action tokens' positions). The K/V are views of the store for host slot ids that
        form a run, else one gather per layer.
        """
        P, kv = prefix.prefix_len, prefix.kv
        run = host_run(prefix.slots)
        # In place when the store has the compute dtype; a narrower store (bf16 K/V under a
        # float32 model) is widened here, once per frame.
        dtype = self.compute_dtype
        prefix_kv = [(slot_rows(kv.k[i], prefix.slots, run, 0, P).to(dtype),
                      slot_rows(kv.v[i], prefix.slots, run, 0, P).to(dtype))  # 2 x [B, P, G, D]
                     for i in range(self.config.backbone.depth)]
        prefix_bias = key_bias(prefix.valid.to(device), dtype)                # [B, P]
        positions = prefix.n_valid.to(device)[:, None] + torch.arange(horizon, device=device)
        cos, sin = self.rope_tables(P + horizon, device)
        return prefix_kv, prefix_bias, cos[positions], sin[positions]        # cos, sin [B, H, D]

    def denoise_velocity(self, prefix_kv: list[tuple[torch.Tensor, torch.Tensor]],
                         prefix_bias: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """One expert pass: velocity v(x_t, t) [B, H, A].

        prefix_kv: per layer (K, V) [B, P, G, D] of the prefix (read only); prefix_bias [B, P]
        (key_bias of the valid mask); cos, sin [B, H, D] at the action tokens' positions;
        x_t [B, H, A]; t [B], or [B, H] for a flow time per action token (RTC's clean rows).
        The H action tokens attend to the valid prefix and to each other (bidirectionally).
        """
        width = self.config.expert.width
        cond = F.silu(self.time_mlp_in(time_embedding(t, width).to(self.time_mlp_in.weight.dtype)))
        cond = F.silu(self.time_mlp_out(cond))                          # [B, We] or [B, H, We]
        x = self.action_in_proj(x_t.to(self.action_in_proj.weight.dtype)).to(self.compute_dtype)
        for layer, (k_prefix, v_prefix) in zip(self.expert.layers, prefix_kv):
            def attend(q, k, v, k_prefix=k_prefix, v_prefix=v_prefix):
                return attention_two_blocks(q, k_prefix, v_prefix, prefix_bias, k, v)
            x = layer(x, cos, sin, attend, cond)
        x, _ = self.expert.norm(x, cond)
        return self.action_out_proj(x.to(self.action_out_proj.weight.dtype)).float()

    # -------------------------------------------------------------------- text
    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied LM head: [B, W] final-normed hidden -> float32 logits [B, V]."""
        embed = self.backbone.embed_tokens.weight
        return F.linear(hidden.to(embed.dtype), embed).float()

    @torch.no_grad()
    def decode_step(self, kv: KVTensors, slots: torch.Tensor, prefix_valid: torch.Tensor,
                    n_valid: torch.Tensor, gen_len: torch.Tensor, tokens: torch.Tensor,
                    attend_len: int | None = None, *, gen: KVTensors | None = None,
                    blocks: torch.Tensor | None = None) -> torch.Tensor:
        """Feed one token per row, append its K/V, return next-token logits [B, V].

        slots long [B]: the prefix slot of each row in `kv`; prefix_valid bool [B, P]; n_valid,
        gen_len, tokens long [B]; on the host or on the model's device. Where a row's generated
        tokens live:
          gen None      after its prefix, in the same slot: storage [P, P + gen_len[b]];
          gen, blocks   in generation block blocks[b] of `gen` ([S', T', G, D] per layer),
                        entries [0, gen_len[b]]: several rows (requests) may share one prefix
                        slot, each with a block of its own (kv/store.py).
        Row b writes its generated entry gen_len[b] at RoPE position n_valid[b] + gen_len[b]
        and attends to its valid prefix plus its generated entries. The caller advances gen_len.

        attend_len (J): how many generated entries the step reads, masked per row to
        gen_len[b] + 1; needs J > gen_len[b] for every real row and J <= the entries a row's
        generated storage holds (not checked: that would read gen_len). Pick it with
        `attend_bucket` so shapes depend on (B, J) only; with ids on the model's device the
        step then reads nothing on the host. Without it, J = max(gen_len) + 1 from host
        gen_len, or all entries when gen_len is on an accelerator.

        Padding rows (to fill a bucket or a hole in a run of blocks) change nothing in the other
        rows as long as they write an entry no real row attends: a reserved null block, or any
        block's last entry (outside every real row's mask). Their gen_len need not be below J;
        their logits are to be dropped.
        """
        P, T = prefix_valid.shape[1], kv.max_len
        gen_offset, room = (P, T - P) if gen is None else (0, gen.max_len)
        if attend_len is None:
            attend_len = int(gen_len.max()) + 1 if gen_len.device.type == 'cpu' else room
        if not 0 < attend_len <= room:
            raise ValueError(f'decode needs {attend_len} generated entries, storage has {room}')
        gen = gen or kv
        blocks = slots if blocks is None else blocks
        device = kv.k.device
        cos, sin = self.rope_tables(P + room, device)
        decode = self._decode_fn or self._decode_layers
        return decode(kv.k, kv.v, gen.k, gen.v, cos, sin, slots, blocks,
                      prefix_valid.to(device), n_valid.to(device), gen_len.to(device),
                      tokens.to(device), attend_len, gen_offset)

    def _decode_layers(self, k_store: torch.Tensor, v_store: torch.Tensor, k_gen: torch.Tensor,
                       v_gen: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       slots: torch.Tensor, blocks: torch.Tensor, prefix_valid: torch.Tensor,
                       n_valid: torch.Tensor, gen_len: torch.Tensor, tokens: torch.Tensor,
                       J: int, gen_offset: int) -> torch.Tensor:
        """Tensor work of decode_step (what compile_decode compiles); see decode_step.

        k_store, v_store [L, S, T, G, D] prefix storage; k_gen, v_gen [L, S', T', G, D]
        generated storage (the prefix storage itself when gen_offset = P); cos, sin [>= P + J,
        D] RoPE tables; slots, blocks [B] (host or device); prefix_valid bool [B, P], n_valid,
        gen_len, tokens long [B] on the device. Row b reads prefix slot slots[b] and generated
        entries [gen_offset, gen_offset + J) of blocks[b], and writes gen_offset + gen_len[b].
        """
        B, P = prefix_valid.shape
        device = k_store.device
        run, block_run = host_run(slots), host_run(blocks)
        block_index = blocks.to(device)
        x = self.backbone.embed_tokens(tokens)[:, None].to(self.compute_dtype)
        x = x * math.sqrt(self.config.backbone.width)                           # [B, 1, W]
        positions = (n_valid + gen_len)[:, None]                                # [B, 1]
        cos, sin = cos[positions], sin[positions]                               # [B, 1, D]
        write_index = gen_offset + gen_len                                      # [B]
        generated = torch.arange(J, device=device)[None] <= gen_len[:, None]    # [B, J]
        dtype = self.compute_dtype
        prefix_bias = key_bias(prefix_valid, dtype)                             # [B, P]
        generated_bias = key_bias(generated, dtype)                             # [B, J]
        gen_end = gen_offset + J
        for i, layer in enumerate(self.backbone.layers):
            def attend(q, k, v, i=i):   # append the token's K/V, attend prefix + generated
                k_gen[i, block_index, write_index] = k[:, 0].to(k_gen.dtype)
                v_gen[i, block_index, write_index] = v[:, 0].to(v_gen.dtype)
                return attend_prefix_and_generated(
                    q, slot_rows(k_store[i], slots, run, 0, P).to(q.dtype),         # [B, P, G, D]
                    slot_rows(v_store[i], slots, run, 0, P).to(q.dtype), prefix_bias,
                    slot_rows(k_gen[i], blocks, block_run, gen_offset, gen_end).to(q.dtype),
                    slot_rows(v_gen[i], blocks, block_run, gen_offset, gen_end).to(q.dtype),
                    generated_bias)                                             # [B, 1, N*D]
            x = layer(x, cos, sin, attend)
        h, _ = self.backbone.norm(x)
        return self.lm_logits(h[:, 0])

    def compile_decode(self, mode: str | None = 'reduce-overhead', kv: KVTensors | None = None,
                       gen: KVTensors | None = None, **options) -> Pi05Model:
        """Run decode steps through torch.compile (off by default; call once, then warm up).

        Meant for an accelerator: call decode_step with `attend_len` from `attend_bucket` and
        ids on the device, so each (B, J) bucket is one static graph ('reduce-overhead'
        captures it as a CUDA graph); torch._dynamo.config.recompile_limit (8 by default)
        must cover the number of (B, J) pairs used. Pass the pool's `kv` (and its generation
        blocks `gen`) so its storage and the RoPE tables are marked static (the storage is
        written in place every step).
        `options` go to torch.compile (e.g. backend, fullgraph). mode=None with no options
        turns compilation off again.
        """
        if mode is None and not options:
            self._decode_fn = None
            return self
        if kv is not None:
            static = (kv.k, kv.v) + self.rope_tables(kv.max_len + (gen.max_len if gen else 0),
                                                     kv.k.device)
            static += (gen.k, gen.v) if gen is not None else ()
            for tensor in static:
                torch._dynamo.mark_static_address(tensor)
        options.setdefault('dynamic', False)
        self._decode_fn = torch.compile(self._decode_layers, mode=mode, **options)
        return self

    def compile_actions(self, mode: str | None = 'default', **options) -> Pi05Model:
        """Run the expert's denoise steps through torch.compile (off by default).

        The prefix K/V enter as views of the pool, whose addresses change with the slot; so
        'default' (fused kernels, no CUDA graph) fits, while 'reduce-overhead' would copy those
        views into the graph's static inputs on every replay. `options` go to torch.compile.
        mode=None with no options turns compilation off again.
        """
        if mode is None and not options:
            self._velocity_fn = None
            return self
        options.setdefault('dynamic', False)
        self._velocity_fn = torch.compile(self.denoise_velocity, mode=mode, **options)
        return self

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
