"""π0.5: PaliGemma backbone + action expert (Mixture-of-Transformers) with an explicit KV cache.

Letters used in shapes (one per dimension; gemma.py and siglip.py use the same):
  B batch rows, C camera slots, R image side (pixels), Ti tokens per image, Lt prompt tokens,
  P = C*Ti + Lt static prefix length, H action horizon, A action dim, L layers,
  S cache slots, T cache positions per slot (P + generated), J generated positions a decode
  step attends, Q query tokens of a pass, N query heads, G kv heads, D head dim,
  W width (We of the expert), V vocab.

Inference is the passes the engine schedules separately. All run the same layer
body (`GemmaLayer.forward`) and differ only in what they pass: positions, the conditioning,
and `attend` (where this layer's K/V go and which keys, under which mask, the queries see).
  prefill        images + prompt -> per-layer K (after RoPE) / V of the prefix, written into
                 caller-owned storage `KVTensors` rows `slots`; bidirectional over the prefix.
  sample_actions expert-only flow matching; the H action tokens attend to the slot's prefix
                 K/V read in place (two score blocks, one softmax: prefix keys + their own),
                 so nothing of size P is copied per frame. The prefix never attends to the
                 suffix, so this equals openpi's joint forward.
  decode_step    one text token per row; row b writes its K/V at entry gen_len[b] of its
                 generation block (or at P + gen_len[b] of its own slot) and RoPE position
                 n_valid[b] + gen_len[b], and attends to its valid prefix plus J generated
                 entries under a mask, one softmax over both. Rows are independent, so
                 requests of different frames, and several of one frame sharing its prefix
                 slot (language tasks), batch by slot and block id.
  extend_step    up to Q tokens per row in one pass (a request's prompt template: a chunked
                 prefill of its generation block), causal among themselves; the last one's
                 logits give the first generated token, as decode steps one by one would.

Static shapes: with `attend_len` and ids on the model's device a decode step reads no tensor
value on the host, and its shapes depend only on (B, attend_len), so `compile_decode` compiles
it (CUDA graphs via mode='reduce-overhead' on a GPU); `compile_actions` compiles the whole
denoise loop, every step, as one graph. Both are off until called (runtime/engine_setup.py
decides, at configure); RoPE tables are built once per device. `fuse` runs q/k/v and
gate/up as one matmul each. Real-time chunking (`sample_actions(inpaint=...)`) runs its
steps eager on the same inputs (see there).
Parameter names follow openpi's `model.safetensors` (see checkpoint.py for the one rename).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F

from . import packed_native, rtc
from .compiled import CompiledFunction
from .config import Pi05Config
from .gemma import attention, attention_two_blocks, GemmaModel, key_bias, rope_table, take_rows
from .packed import linear, PACKED, plain_linear
from .pages import release_unused_pages
from .siglip import MultiModalProjector, SiglipVisionTower

# Parameters that stay float32 when the model runs in bfloat16 (openpi's float32 islands).
FLOAT32_PARAMS = (
    'vision_model.embeddings.patch_embedding', 'vision_model.embeddings.position_embedding',
    'input_layernorm', 'post_attention_layernorm', 'model.norm',
    'action_in_proj', 'action_out_proj', 'time_mlp_in', 'time_mlp_out',
)


# How a compiled denoise loop holds its steps (compile_actions).
DENOISE_GRAPHS = ('loop', 'regions')

# Random initialisation draws float32 noise in blocks of at most this many values.
INIT_BLOCK = 1 << 24


def param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """Return the dtype of parameter `name` in a model run in `dtype` (islands: float32)."""
    if dtype != torch.float32 and any(key in name for key in FLOAT32_PARAMS):
        return torch.float32
    return dtype


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


def pick_rows(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Row b's entries order[b] along dim 1: x [B, T, ...], order [B, n] -> [B, n, ...].

    One index_select per row, which copies whole entries: ~20x a gather's speed, whose index
    names every element (a LIBERO prefix's embeddings: 9 vs 215 us).
    """
    rows = [x[b].index_select(0, order[b]) for b in range(x.shape[0])]
    return rows[0][None] if len(rows) == 1 else torch.stack(rows)


def write_packed(storage: torch.Tensor, slots: list[int], length: int, positions: torch.Tensor,
                 counts: list[int], layers: list[torch.Tensor]) -> None:
    """Scatter prefill's packed K (or V) of every layer into the pool (prefill's write).

    storage [L, S, T, ...]: slot slots[b] of layer i gets layers[i][b, :counts[b]] (of
    [B, n, ...]) at its positions[b, :counts[b]], zeros at its other positions below `length`
    (a slot's content does not depend on what it was batched with), cleared once for all
    layers. A narrower store (bf16 K/V) rounds here.
    """
    for b, slot in enumerate(slots):
        if counts[b] < length:
            storage[:, slot, :length].zero_()
        where = positions[b, :counts[b]]
        for i, packed in enumerate(layers):
            storage[i, slot].index_copy_(0, where, packed[b, :counts[b]].to(storage.dtype))


def attend_bucket(needed: int, limit: int) -> int:
    """Pick decode's static attend length: a power of two >= needed (>= 8), capped at limit.

    needed = max(gen_len) + 1 over the real rows; limit = T - P. A caller that knows gen_len as
    ints picks the bucket, so a step's shapes take a few values only (one graph each).
    """
    return min(limit, max(8, 1 << (needed - 1).bit_length()))


def extend_bucket(tokens: int) -> int:
    """Pad an extend pass's prompt length to the next multiple of 8 (its query tokens).

    A few lengths cover every prompt (few shapes for a compiled pass and its cost model) for
    at most 7 padding tokens, which write only their block's scratch entry.
    """
    return -(-tokens // 8) * 8


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of float32 logits [B, V] -> long [B] (torch.argmax's answer).

    On a CPU with AVX-512 the C++ kernel's (packed_linear.cpp row_argmax): inside a compiled
    decode step inductor's argmax took ~11 us a row of 16384.
    """
    if (logits.device.type == 'cpu' and logits.dtype == torch.float32
            and packed_native.ready('row_argmax')):
        return torch.ops.oxygen_packed_native.row_argmax(logits)
    return logits.argmax(-1)


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
        self._decode_fn: CompiledFunction | None = None    # _decode_layers, compile_decode()
        self._extend_fn: CompiledFunction | None = None    # _extend_layers, compile_extend()
        self._denoise_fn: CompiledFunction | None = None   # denoise_loop, compile_actions()
        # denoise_modulations: (steps, device) -> (the weights' stamp, 2L + 1 of [S, 3We])
        self._modulations: dict[tuple, tuple[tuple, list[torch.Tensor]]] = {}
        self._vision_fn: CompiledFunction | None = None    # encode_images, compile_prefill()
        self._prefill_fn: CompiledFunction | None = None   # prefill_layers, compile_prefill()
        self._lm_head_packed = False                       # pack_linears()
        self._packed_in_place = False                      # pack_linears(in_place=True)
        self._packed_bytes = 0

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

    @classmethod
    def build(cls, cfg: Pi05Config, dtype: torch.dtype = torch.float32,
              device: torch.device | str | None = None) -> Pi05Model:
        """Allocate a model with uninitialised weights, each parameter in its final dtype.

        Parameters are created one by one from the meta device, so a bfloat16 model is never
        held in float32 first (for pi05 that copy alone was 13 GB). Fill with init_random or
        load_state_dict.
        """
        with torch.device('meta'):
            model = cls(cfg)
        for module_name, module in model.named_modules():
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                full_name = f'{module_name}.{name}' if module_name else name
                module._parameters[name] = nn.Parameter(
                    torch.empty(param.shape, dtype=param_dtype(full_name, dtype), device=device),
                    requires_grad=param.requires_grad)
        return model

    @property
    def fused(self) -> bool:
        """True once `fuse` ran (q/k/v and gate/up as one matmul each)."""
        return self.backbone.layers[0].self_attn.qkv_weight is not None

    def fuse(self) -> Pi05Model:
        """Run q/k/v and gate/up (SigLIP: q/k/v) as one matmul each (gemma.fuse_linears).

        The separate weights become views of the fused ones: no extra memory, the same
        parameter names. Call it once the weights, dtype and device are final (prepare).
        A model packed in place stays as it is (its fused weights are the packed ones).
        """
        if self._packed_in_place:
            return self
        for layer in [*self.backbone.layers, *self.expert.layers]:
            layer.fuse()
        for layer in self.vision.vision_model.encoder.layers:
            layer.self_attn.fuse()
        return self

    def unfuse(self) -> Pi05Model:
        """Drop the fused weights: every projection runs on its own weight again."""
        self.unpack()
        for module in self.modules():
            for name in ('qkv_weight', 'qkv_bias', 'gate_up_weight'):
                if getattr(module, name, None) is not None:
                    setattr(module, name, None)
        return self

    @property
    def packed(self) -> bool:
        """True once `pack_linears` ran (and no unpack since)."""
        return self.backbone.layers[0].mlp.packed

    def pack_linears(self, in_place: bool = False, expert: bool | None = None) -> int:
        """Run linears on oneDNN-prepacked weights (packed.py); return the bytes packed.

        Call after `fuse`, once the weights are final (prepare, bf16 on the CPU), and compile
        after it. in_place False (a model whose passes compile): the vision tower's and the
        backbone's layers and the tied LM head get a packed copy beside the plain weights (the
        graphs' inputs, the fallback), and the expert's layers where `expert` (prepare asks
        for it where the compiled graphs call the op's C++ kernel: through the Python one, the
        ten-row matmuls' dispatch cost what the reorder saved). in_place True (an eager model
        too big to keep two copies, pi05): the vision tower's, the backbone's and the expert's
        layers, the packed copy replacing the plain weight (moved to the meta device); the LM
        head stays plain, its weight is also the embedding. A model packed in place cannot
        change its weights any more (build it again).
        """
        if not self.fused:
            raise RuntimeError('packing needs the fused projections: call fuse() first')
        if self._packed_in_place:   # prepared before (a second engine on the same model)
            return self._packed_bytes
        expert = in_place if expert is None else expert
        layers = [*self.vision.vision_model.encoder.layers, *self.backbone.layers,
                  *(self.expert.layers if expert else [])]
        packed = 0
        for layer in layers:
            packed += layer.self_attn.pack(in_place) + layer.mlp.pack(in_place)
            if in_place:   # a checkpoint's pages the layer no longer uses: now, not at the end
                release_unused_pages(self)
        embed = self.backbone.embed_tokens.weight
        if not in_place and embed.dtype == torch.bfloat16:   # a float32 island stays plain
            packed += PACKED.pack(embed)
            self._lm_head_packed = True
        self._packed_in_place, self._packed_bytes = in_place, packed
        return packed

    def unpack(self) -> Pi05Model:
        """Run every linear on its plain weight again (before the weights are replaced)."""
        if self._packed_in_place:
            raise RuntimeError('the weights were packed in place at configure (their plain '
                               'copies are gone): build the model again to change them')
        for layer in [*self.vision.vision_model.encoder.layers, *self.backbone.layers,
                      *self.expert.layers]:
            layer.self_attn.packed = layer.mlp.packed = False
        self._lm_head_packed = False
        return self

    def to_precision(self, dtype: torch.dtype) -> Pi05Model:
        """Cast to `dtype`, keeping openpi's float32 islands (norms, embeddings, projections)."""
        fused = self.fused
        self.unfuse()   # the casts replace the weights the fused ones are views of
        for name, param in self.named_parameters():
            # Cast each parameter once to its final dtype, so islands are never rounded.
            param.data = param.data.to(param_dtype(name, dtype))
        return self.fuse() if fused else self

    def init_random(self, seed: int = 0, text_ids: list[int] | None = None) -> Pi05Model:
        """Random weights for demos and tests (deterministic for a seed), in place.

        text_ids: ids that decode to text with the tokenizer in use; every other embedding row
        is zeroed so the tied LM head (logit exactly 0 there) never emits an id that would
        decode as unknown, a lone byte or a control token.

        Matrices get std 1/sqrt(fan_in) so every residual branch matters; the embedding gets
        std 1/sqrt(width) so the tied LM head does not simply echo the input token; norm and
        adaRMS parameters are non-zero so the (1 + w) and modulation paths are exercised.
        Noise is drawn in float32 a block of rows at a time (INIT_BLOCK values), so a large
        parameter never needs a float32 copy of itself; the weights do not depend on the
        parameters' dtype or device beyond rounding.
        """
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith('embed_tokens.weight'):
                    scale = 0.2 * param.shape[1] ** -0.5
                elif name.endswith('bias') or 'norm' in name or param.dim() == 1:
                    scale = 0.1
                else:
                    scale = math.prod(param.shape[1:]) ** -0.5
                    if 'dense' in name:
                        scale *= 0.3  # keep adaRMS scale/shift/gate modest
                rows = max(1, INIT_BLOCK // max(1, math.prod(param.shape[1:])))
                for start in range(0, param.shape[0], rows):
                    block = param[start:start + rows]
                    block.copy_(torch.randn(block.shape, generator=gen) * scale)
            if text_ids is not None:
                embed = self.backbone.embed_tokens.weight
                keep = torch.zeros(embed.shape[0], dtype=torch.bool)
                keep[torch.tensor(text_ids, dtype=torch.long)] = True
                embed[~keep.to(embed.device)] = 0.0
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
        shown = image_masks.reshape(B * C).nonzero().flatten().tolist()        # host ids
        img = torch.zeros(B * C, Ti, width, dtype=dtype, device=images.device)
        if shown:
            n = len(shown)
            if shown == list(range(n)):   # the first n cameras (libero's two of three): a view
                img[:n] = self.vision_features(images.flatten(0, 1)[:n]).to(dtype)
            else:   # a boolean mask's index copied the images through a nonzero (0.6 ms)
                ids = torch.tensor(shown, device=images.device)
                img[ids] = self.vision_features(images.flatten(0, 1)[ids]).to(dtype)
        img = img.view(B, C * Ti, width)                                        # [B, C*Ti, W]
        img_valid = image_masks[:, :, None].expand(B, C, Ti).reshape(B, C * Ti)
        # Text embeddings are scaled by sqrt(width); image features are not.
        txt = self.backbone.embed_tokens(tokens).to(dtype) * math.sqrt(width)  # [B, Lt, W]
        return torch.cat([img, txt], dim=1), torch.cat([img_valid, token_masks.bool()], dim=1)

    def vision_features(self, images: torch.Tensor) -> torch.Tensor:
        """Encode shown camera images [n, 3, R, R] -> projected features [n, Ti, W].

        Compiled once compile_prefill was called: one graph for n = 1, one for every n > 1.
        """
        if self._vision_fn is None:
            return self.encode_images(images)
        if images.shape[0] > 1:
            torch._dynamo.mark_dynamic(images, 0)
        return self._vision_fn(images)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Run the vision tower and the projector: images [n, 3, R, R] -> [n, Ti, W]."""
        return self.projector(self.vision.vision_model(images))

    def prefill_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       key_mask: torch.Tensor | None = None, rows: list | None = None):
        """Run the backbone over packed prefix tokens x [B, n, W] -> (x, keys, values).

        keys, values: per layer [B, n, G, D] (K after RoPE), for the caller to store; cos, sin
        [B, n, D]; key_mask [B, 1, n] (ragged rows) or None; rows: attend row by row (slices of
        B) instead of in one call. Pure (writes nothing), so it compiles with n dynamic.
        """
        keys, values = [], []
        for layer in self.backbone.layers:
            def attend(q, k, v):   # keep the prefix K/V, attend among the prefix
                keys.append(k)
                values.append(v)
                if rows is None:
                    return attention(q, k, v, key_mask)
                return torch.cat([attention(q[r], k[r], v[r], key_mask[r]) for r in rows])
            x = layer(x, cos, sin, attend)
        return x, keys, values

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
        P = x_full.shape[1]
        if kv is None:
            kv = KVTensors.allocate(cfg, B, P + extra_len, self.compute_dtype, x_full.device)
            slots = torch.arange(B)
        slot_list = [int(s) for s in slots]
        if len(slot_list) != B or kv.max_len < P:
            raise ValueError(f'need {B} slots of length >= {P}, got {len(slot_list)} of '
                             f'{kv.max_len}')
        counts = valid.sum(-1)                                                  # [B]
        row_counts = counts.tolist()
        n = max(max(row_counts), 1)
        # Valid positions first, in order (a stable sort of ~valid), then padding ones.
        order = torch.sort((~valid).to(torch.uint8), dim=-1, stable=True).indices[:, :n]
        x = pick_rows(x_full, order)                                            # [B, n, W]
        packed_valid = torch.arange(n, device=x.device)[None] < counts[:, None]  # [B, n]
        cos, sin = self.rope_tables(n, x.device)
        cos, sin = cos[:n].expand(B, n, -1), sin[:n].expand(B, n, -1)           # [B, n, D]
        # Rows of equal length (one robot's frames) need no mask; then SDPA materializes no
        # scores and all rows go in one call. Ragged rows (robots with different cameras or
        # prompts) attend under a mask, one row at a time on the CPU: with a mask its SDPA
        # materializes N·n·n floats per row.
        ragged = any(count != n for count in row_counts)
        key_mask = packed_valid[:, None, :] if ragged else None                 # [B, 1, n]
        rows = ([slice(b, b + 1) for b in range(B)] if ragged and x.device.type == 'cpu'
                else [slice(None)])

        if len(rows) == 1 and self._prefill_fn is not None:
            for tensor in (x, cos, sin):   # one graph for every number of valid positions
                torch._dynamo.mark_dynamic(tensor, 1)
                if B > 1:
                    torch._dynamo.mark_dynamic(tensor, 0)
            x, keys, values = self._prefill_fn(x, cos, sin, key_mask)
        else:
            x, keys, values = self.prefill_layers(x, cos, sin, key_mask,
                                                  None if len(rows) == 1 else rows)
        write_packed(kv.k, slot_list, P, order, row_counts, keys)   # into the slots' rows
        write_packed(kv.v, slot_list, P, order, row_counts, values)
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
        Runs `denoise_loop`, compiled when compile_actions was called.
        inpaint: real-time chunking (model/rtc.py): the same steps over the same prefix K/V
        (the same `action_context`), continuing a committed chunk (guided, or its frozen rows
        held clean). Those steps run eager, one `denoise_velocity` each: guided takes a
        vector-Jacobian product through every step and prefix a flow time per token, and the
        compiled loop has neither (its modulations are the fixed times' [S]).
        """
        steps = num_steps or self.config.num_steps
        context = self.action_context(prefix, noise.shape[1], noise.device)
        if inpaint is not None:
            return rtc.sample(lambda x, t: self.denoise_velocity(*context, x, t), noise, steps,
                              inpaint)
        x = noise.float()
        mods = self.denoise_modulations(steps, x.device)
        if self._denoise_fn is None:
            return self.denoise_loop(*context, x, steps, mods)
        prefix_kv, prefix_bias, cos, sin = context
        keys = [t for pair in prefix_kv for t in pair] + [prefix_bias]
        if prefix_bias.shape[1] > 1:   # one graph for every number of packed positions
            for tensor in keys:
                torch._dynamo.mark_dynamic(tensor, 1)
        if x.shape[0] > 1:   # and one for every batch of several rows
            for tensor in keys + [cos, sin, x]:
                torch._dynamo.mark_dynamic(tensor, 0)
        return self._denoise_fn(*context, x, steps, mods)

    def action_context(self, prefix: PrefixCache, horizon: int, device
                       ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor,
                                  torch.Tensor, torch.Tensor]:
        """Return what every denoise step of `prefix`'s rows reads: (prefix_kv, bias, cos, sin).

        The first four arguments of denoise_velocity and denoise_loop: the plain loop, RTC and
        the smooth-policy trainer all read these. prefix_kv: per layer (K, V) [B, n, G, D] of
        the prefix in the compute dtype; prefix_bias [B, n] (key_bias of their valid mask);
        cos, sin [B, H, D] at the action tokens' positions n_valid .. n_valid + H - 1.
        On the CPU, where n_valid is on the host, the valid positions are packed once per frame
        (n = the most valid positions of a row; a LIBERO frame: 555 of 968), as prefill
        packs them: every step then attends 43% fewer keys, and a single row needs no mask
        value other than 0. On an accelerator (no host read) n = P: views of the pool where
        it has the compute dtype (a narrower store, bf16 K/V under a float32 model, is
        widened here, once per frame).
        """
        P, kv = prefix.prefix_len, prefix.kv
        dtype = self.compute_dtype
        valid = prefix.valid.to(device)                                          # [B, P]
        if prefix.n_valid.device.type == 'cpu':
            n = max(int(prefix.n_valid.max()), 1)
            # valid positions first, in order (a stable sort of ~valid), as prefill packs
            order = torch.sort((~valid).to(torch.uint8), dim=-1, stable=True).indices[:, :n]
            valid = valid.gather(1, order)                                     # [B, n]

            def rows(storage):
                return pick_rows(take_rows(storage[:, :P], prefix.slots), order).to(dtype)
        else:
            def rows(storage):
                return take_rows(storage[:, :P], prefix.slots).to(dtype)
        prefix_kv = [(rows(kv.k[i]), rows(kv.v[i]))                        # 2 x [B, n, G, D]
                     for i in range(self.config.backbone.depth)]
        prefix_bias = key_bias(valid, dtype)                                    # [B, n]
        positions = prefix.n_valid.to(device)[:, None] + torch.arange(horizon, device=device)
        cos, sin = self.rope_tables(P + horizon, device)
        return prefix_kv, prefix_bias, cos[positions], sin[positions]        # [B, H, D]

    def denoise_loop(self, prefix_kv: list[tuple[torch.Tensor, torch.Tensor]],
                     prefix_bias: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     noise: torch.Tensor, steps: int, mods: list[torch.Tensor],
                     step_fn: Callable | None = None) -> torch.Tensor:
        """All Euler steps from noise [B, H, A] (float32) -> actions [B, H, A] (float32).

        Static shapes and no host reads, so the whole loop compiles as one graph (one CUDA
        graph on a GPU). mods: the expert's adaRMS modulations of every step, 2L + 1 of
        [S, 3We] (`denoise_modulations`, kept across frames, or `expert_modulations` of
        `flow_times`); separate tensors, not one stacked: a step region's inputs may not alias
        each other.
        step_fn: what runs each step (default `denoise_step`; `denoise_step_region` in a loop
        of step regions, compile_actions).
        """
        B = noise.shape[0]
        x_t = noise
        for step in range(steps):
            step_mods = [mod[step].expand(B, -1) for mod in mods]                  # [B, 3We]
            x_t = (step_fn or self.denoise_step)(prefix_kv, prefix_bias, cos, sin, x_t,
                                                 step_mods, -1.0 / steps)
        return x_t

    def denoise_step(self, prefix_kv: list[tuple[torch.Tensor, torch.Tensor]],
                     prefix_bias: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     x_t: torch.Tensor, mods: list[torch.Tensor], dt: float) -> torch.Tensor:
        """One Euler step of `denoise_loop`: x_t + dt v [B, H, A] under modulations `mods`."""
        return x_t + dt * self.expert_velocity(prefix_kv, prefix_bias, cos, sin, x_t, mods)

    # denoise_step as a nested compile region (compile_actions 'regions'); eager, a plain call
    denoise_step_region = torch.compiler.nested_compile_region(denoise_step)

    @staticmethod
    def flow_times(steps: int, device=None) -> torch.Tensor:
        """Return the Euler steps' flow times [S]: 1, 1 - 1/S, ..., 1/S."""
        return torch.tensor([1.0 - step / steps for step in range(steps)], device=device)

    @torch.no_grad()
    def denoise_modulations(self, steps: int, device) -> list[torch.Tensor]:
        """Return the denoise loop's adaRMS modulations, 2L + 1 of [S, 3We] (float32), cached.

        The flow times are the same every frame, so these are a constant of the weights;
        computed per frame they took 2L + 3 float32 matmuls whose weights (a [We, 3We] dense
        per norm; pi05's 37 are 465 MB) were read for nothing: pi05's denoise 666 -> 573 ms
        kept, pi05-cpu's 9.4-9.9 -> 8.3-8.5 ms. Computed again when a weight they come from
        was written or replaced (its version or storage changed) or for another device.
        """
        stamp = tuple((p.data_ptr(), None if p.is_inference() else p._version)
                      for p in self._modulation_params())   # inference tensors: no version
        key = (steps, torch.device(device))
        hit = self._modulations.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        mods = self.expert_modulations(self.flow_times(steps, device))
        self._modulations[key] = (stamp, mods)
        return mods

    def _modulation_params(self) -> list[torch.Tensor]:
        """Return the parameters the adaRMS modulations are computed from."""
        modules = [self.time_mlp_in, self.time_mlp_out, self.expert.norm.dense]
        modules += [norm.dense for layer in self.expert.layers
                    for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
        return [p for module in modules for p in module.parameters()]

    def expert_modulations(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Compute the expert's adaRMS modulations at flow times t [R] -> 2L + 1 of [R, 3We].

        t may be per token ([B, H] -> [B, H, 3We] each, RTC's clean rows). In layer order
        (input norm, post-attention norm), then the final norm.
        cond = silu(time_mlp_out(silu(time_mlp_in(sincos(t))))).
        """
        width = self.config.expert.width
        cond = F.silu(self.time_mlp_in(time_embedding(t, width).to(self.time_mlp_in.weight.dtype)))
        cond = F.silu(self.time_mlp_out(cond))                          # [R, We] or [B, H, We]
        norms = [norm for layer in self.expert.layers
                 for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
        return [norm.modulation(cond) for norm in norms + [self.expert.norm]]

    def denoise_velocity(self, prefix_kv: list[tuple[torch.Tensor, torch.Tensor]],
                         prefix_bias: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """One denoise step: velocity v(x_t, t) [B, H, A] of the expert at flow time t [B].

        prefix_kv, prefix_bias, cos, sin: from `action_context`; x_t [B, H, A]; t [B], or
        [B, H] for a flow time per action token (RTC's clean rows).
        The H action tokens attend to the valid prefix and to each other (bidirectionally).
        Called step by step by RTC (model/rtc.py) and the smooth-policy trainer, with
        gradients; `denoise_loop` computes the same per step, with its modulations precomputed.
        """
        return self.expert_velocity(prefix_kv, prefix_bias, cos, sin, x_t,
                                    self.expert_modulations(t))

    def expert_velocity(self, prefix_kv: list[tuple[torch.Tensor, torch.Tensor]],
                        prefix_bias: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        x_t: torch.Tensor, mods: list[torch.Tensor]) -> torch.Tensor:
        """Run one step's expert pass under precomputed modulations (of expert_modulations).

        mods: 2L + 1 of [B, 3We], or per token [B, H, 3We].
        """
        x = self.action_in_proj(x_t.to(self.action_in_proj.weight.dtype)).to(self.compute_dtype)
        for i, (layer, (k_prefix, v_prefix)) in enumerate(zip(self.expert.layers, prefix_kv)):
            def attend(q, k, v, k_prefix=k_prefix, v_prefix=v_prefix):
                return attention_two_blocks(q, k_prefix, v_prefix, prefix_bias, k, v)
            x = layer(x, cos, sin, attend, (mods[2 * i], mods[2 * i + 1]))
        x, _ = self.expert.norm.modulate(x, mods[-1])
        return self.action_out_proj(x.to(self.action_out_proj.weight.dtype)).float()

    # -------------------------------------------------------------------- text
    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied LM head: [B, W] final-normed hidden -> float32 logits [B, V].

        Packed beside the embedding where the passes compile; plain otherwise (pi05 packed in
        place: a copy would be 1 GB), read in place by plain_linear's kernel.
        """
        embed = self.backbone.embed_tokens.weight
        x = hidden.to(embed.dtype)
        if self._lm_head_packed:
            return linear(x, embed, True).float()
        return plain_linear(x, embed).float()

    @torch.no_grad()
    def decode_step(self, kv: KVTensors, slots: torch.Tensor, prefix_valid: torch.Tensor,
                    n_valid: torch.Tensor, gen_len: torch.Tensor, tokens: torch.Tensor,
                    attend_len: int | None = None, *, gen: KVTensors | None = None,
                    blocks: torch.Tensor | None = None, greedy: bool = False) -> torch.Tensor:
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

        greedy: return each row's argmax token id, long [B], instead of the logits: the step's
        graph computes it (pi05-cpu, 8 rows: ~90 us there, ~250 us for ATen's after the step).
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
        logits, best = decode(kv.k, kv.v, gen.k, gen.v, cos, sin, slots, blocks,
                              prefix_valid.to(device), n_valid.to(device), gen_len.to(device),
                              tokens.to(device), attend_len, gen_offset)
        return best if greedy else logits

    def _decode_layers(self, k_store: torch.Tensor, v_store: torch.Tensor, k_gen: torch.Tensor,
                       v_gen: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       slots: torch.Tensor, blocks: torch.Tensor, prefix_valid: torch.Tensor,
                       n_valid: torch.Tensor, gen_len: torch.Tensor, tokens: torch.Tensor,
                       J: int, gen_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tensor work of decode_step (what compile_decode compiles) -> (logits, argmax ids).

        k_store, v_store [L, S, T, G, D] prefix storage; k_gen, v_gen [L, S', T', G, D]
        generated storage (the prefix storage itself when gen_offset = P); cos, sin [>= P + J,
        D] RoPE tables; slots, blocks [B] (host or device); prefix_valid bool [B, P], n_valid,
        gen_len, tokens long [B] on the device. Row b reads prefix slot slots[b] and generated
        entries [gen_offset, gen_offset + J) of blocks[b], and writes gen_offset + gen_len[b].
        """
        B, P = prefix_valid.shape
        device = k_store.device
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
                # Indexed on the whole storage, not on the layer's view k_gen[i]: a compiled
                # step then writes the B entries in place; through the view, functionalization
                # copied the whole layer of the pool every step.
                where = (torch.full_like(block_index, i), block_index, write_index)
                k_gen.index_put_(where, k[:, 0].to(k_gen.dtype))
                v_gen.index_put_(where, v[:, 0].to(v_gen.dtype))
                # row b's prefix slot and generation block are read where they lie in the
                # pool (attention_two_blocks: by the kernel in place, or gathered for SDPA)
                return attention_two_blocks(
                    q, k_store[i, :, :P], v_store[i, :, :P], prefix_bias,
                    k_gen[i, :, gen_offset:gen_end], v_gen[i, :, gen_offset:gen_end],
                    generated_bias, rows1=slots, rows2=blocks)              # [B, 1, N*D]
            x = layer(x, cos, sin, attend)
        h, _ = self.backbone.norm(x)
        logits = self.lm_logits(h[:, 0])
        return logits, greedy_ids(logits)                                       # [B, V], [B]

    @torch.no_grad()
    def extend_step(self, kv: KVTensors, slots: torch.Tensor, prefix_valid: torch.Tensor,
                    n_valid: torch.Tensor, gen_len: torch.Tensor, tokens: torch.Tensor,
                    n_tokens: torch.Tensor, *, gen: KVTensors, blocks: torch.Tensor,
                    attend_len: int | None = None) -> torch.Tensor:
        """Feed up to Q tokens per row in one pass (a chunked prefill of the block) -> [B, V].

        tokens long [B, Q], right-padded; row b feeds tokens[b, :n_tokens[b]] (1 <= n <= Q).
        Its token j writes its K/V at entry gen_len[b] + j of generation block blocks[b] of
        `gen` and sits at RoPE position n_valid[b] + gen_len[b] + j; it attends to the valid
        prefix of slots[b] and to the block's entries [0, gen_len[b] + j] (the ones before it
        and itself: causal). Returns the logits of each row's last fed token, which equal a
        decode_step's after feeding the same tokens one by one. Padding tokens (j >= n_tokens)
        write the block's scratch entry (its last, never read by a real row) and are dropped.

        attend_len (J): generated entries read, >= max(gen_len + n_tokens) and at most the
        block's max_len - 1 (None: exactly that max, from host ints). Other inputs as
        decode_step's. Compiled (compile_extend) with dynamic shapes: one graph for B = 1 and
        one for every B > 1, whatever Q and J (extend_bucket pads Q to a few lengths).
        """
        P = prefix_valid.shape[1]
        room = gen.max_len - 1   # the last entry is the scratch
        if attend_len is None:
            attend_len = int((gen_len + n_tokens).max())
        if not 0 < attend_len <= room:
            raise ValueError(f'extend needs {attend_len} generated entries, a block has {room}')
        device = kv.k.device
        cos, sin = self.rope_tables(P + gen.max_len, device)
        extend = self._extend_fn or self._extend_layers
        return extend(kv.k, kv.v, gen.k, gen.v, cos, sin, slots, blocks,
                      prefix_valid.to(device), n_valid.to(device), gen_len.to(device),
                      tokens.to(device), n_tokens.to(device), attend_len)

    def _extend_layers(self, k_store: torch.Tensor, v_store: torch.Tensor,
                       k_gen: torch.Tensor, v_gen: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, slots: torch.Tensor, blocks: torch.Tensor,
                       prefix_valid: torch.Tensor, n_valid: torch.Tensor, gen_len: torch.Tensor,
                       tokens: torch.Tensor, n_tokens: torch.Tensor, J: int) -> torch.Tensor:
        """Tensor work of extend_step; the storage as _decode_layers' (gen_offset 0)."""
        B, Q = tokens.shape
        P = prefix_valid.shape[1]
        device = k_store.device
        block_index = blocks.to(device)[:, None].expand(B, Q)                   # [B, Q]
        x = self.backbone.embed_tokens(tokens).to(self.compute_dtype)
        x = x * math.sqrt(self.config.backbone.width)                           # [B, Q, W]
        offset = torch.arange(Q, device=device)[None]                           # [1, Q]
        fed = offset < n_tokens[:, None]                                        # [B, Q]
        entry = gen_len[:, None] + offset                                       # [B, Q]
        # Padding tokens: the row's first position (inside the RoPE table), scratch entry.
        positions = n_valid[:, None] + torch.where(fed, entry, gen_len[:, None])
        cos, sin = cos[positions], sin[positions]                               # [B, Q, D]
        write_index = torch.where(fed, entry, k_gen.shape[2] - 1)               # [B, Q]
        layer_index = torch.zeros_like(write_index)
        visible = torch.arange(J, device=device)[None, None] <= entry[:, :, None]  # [B, Q, J]
        dtype = self.compute_dtype
        prefix_bias = key_bias(prefix_valid, dtype)                             # [B, P]
        generated_bias = key_bias(visible, dtype)                               # [B, Q, J]
        for i, layer in enumerate(self.backbone.layers):
            def attend(q, k, v, i=i):   # write the Q tokens' K/V, attend prefix + block
                where = (layer_index + i, block_index, write_index)
                k_gen.index_put_(where, k.to(k_gen.dtype))                      # k [B, Q, G, D]
                v_gen.index_put_(where, v.to(v_gen.dtype))
                return attention_two_blocks(
                    q, k_store[i, :, :P], v_store[i, :, :P], prefix_bias,
                    k_gen[i, :, :J], v_gen[i, :, :J], generated_bias,
                    rows1=slots, rows2=blocks)                                  # [B, Q, N*D]
            x = layer(x, cos, sin, attend)
        last = x[torch.arange(B, device=device), n_tokens - 1]                 # [B, W]
        h, _ = self.backbone.norm(last[:, None])
        return self.lm_logits(h[:, 0])

    def compile_decode(self, mode: str | None = 'default', kv: KVTensors | None = None,
                       config: dict | None = None, gen: KVTensors | None = None,
                       **options) -> Pi05Model:
        """Run decode steps through torch.compile (call once, then warm up, then seal).

        Call decode_step with `attend_len` (from `attend_bucket`) and ids on the device: then a
        step reads no tensor value on the host and compiles to one graph. Shapes are dynamic
        by default: one graph for B = 1 and one for every other (B, J), so a warm-up with two
        batch sizes covers them all. mode 'reduce-overhead' (a GPU) replays CUDA graphs, one
        recorded per (B, J); pass the pool's `kv` (and its generation blocks `gen`) there so
        their storage and the RoPE tables are marked static (the storage is written in place
        every step). `config`: inductor settings while compiling (see CompiledFunction);
        `options` go to torch.compile (e.g. backend, fullgraph). mode=None with no options
        turns it off.
        """
        if mode is None and not options:
            self._decode_fn = None
            return self
        if kv is not None and kv.k.device.type == 'cuda':
            static = (kv.k, kv.v) + self.rope_tables(kv.max_len + (gen.max_len if gen else 0),
                                                     kv.k.device)
            static += (gen.k, gen.v) if gen is not None else ()
            for tensor in static:
                torch._dynamo.mark_static_address(tensor)
        options.setdefault('dynamic', True)
        self._decode_fn = CompiledFunction(self._decode_layers, 'decode step', config,
                                           mode=mode, **options)
        return self

    def compile_extend(self, mode: str | None = 'default', config: dict | None = None,
                       **options) -> Pi05Model:
        """Run extend passes through torch.compile (call once, then warm up, then seal).

        Dynamic shapes: one graph for B = 1 and one for every other B, whatever the prompt
        length Q and attend length J, so a warm-up with one and two rows covers them all (the
        runner pads Q to a few lengths, extend_bucket). Not CUDA graphs: those would record one
        graph per shape (use mode 'default' on a GPU, as for the prefill). Other arguments as
        compile_decode; mode=None with no options turns it off.
        """
        if mode is None and not options:
            self._extend_fn = None
            return self
        options.setdefault('dynamic', True)
        self._extend_fn = CompiledFunction(self._extend_layers, 'extend pass', config,
                                           mode=mode, **options)
        return self

    def compile_actions(self, mode: str | None = 'default', config: dict | None = None,
                        graph: str = 'loop', **options) -> Pi05Model:
        """Run the whole denoise loop through torch.compile as one graph.

        One graph per batch size B = 1 and one for every B > 1 (the batch dimension is marked
        dynamic there). `graph` says how the steps are in it:
        'loop': every step traced, unrolled. On a GPU, mode 'reduce-overhead' replays it as
        one CUDA graph: the prefix K/V views are copied into its static inputs once per frame,
        which costs far less than launching every kernel of every step. On the CPU (inductor's
        cpp_wrapper in `config`) its C++ wrapper, ten steps of calls, is built apart from the
        kernels at -O1 (cpp_wrapper_build_separate): pi05-cpu's first compile 194 -> 134 s,
        the same run time.
        'regions': the step is a nested compile region, traced and compiled once and called
        once per step: a tenth of the tracing and compiling, but its graph runs from Python
        (inductor writes no C++ wrapper for a region's call), ~2 ms more per pi05-cpu denoise.
        `config`: inductor settings while compiling (see CompiledFunction); `options` go to
        torch.compile. mode=None with no options turns compilation off again.
        """
        if mode is None and not options:
            self._denoise_fn = None
            return self
        if graph not in DENOISE_GRAPHS:
            raise ValueError(f'denoise graph {graph!r}: expected one of {DENOISE_GRAPHS}')
        config = dict(config or {})
        if graph == 'loop':
            fn, name = self.denoise_loop, 'denoise loop'
            if config.get('cpp_wrapper'):
                config['cpp_wrapper_build_separate'] = True
        else:
            fn = functools.partial(self.denoise_loop, step_fn=self.denoise_step_region)
            name = 'denoise loop of step regions'
            config['cpp_wrapper'] = False
        self._denoise_fn = CompiledFunction(fn, name, config, mode=mode, **options)
        return self

    def compile_prefill(self, mode: str | None = 'default', config: dict | None = None,
                        vision: bool = True, **options) -> Pi05Model:
        """Run the vision tower and the backbone's prefill layers through torch.compile.

        Prefill packs the valid positions, so their number n changes with the prompt: the
        layers compile once with n dynamic (and the batch, when several rows). The K/V are
        returned and stored by the eager caller. vision False: the tower stays eager.
        Other arguments as compile_actions.
        """
        if mode is None and not options:
            self._vision_fn = self._prefill_fn = None
            return self
        self._vision_fn = (CompiledFunction(self.encode_images, 'vision tower', config,
                                            mode=mode, **options) if vision else None)
        self._prefill_fn = CompiledFunction(self.prefill_layers, 'prefill layers', config,
                                            mode=mode, **options)
        return self

    @property
    def compiled_functions(self) -> list[CompiledFunction]:
        """The compiled passes in use (empty when every pass runs eager)."""
        return [fn for fn in (self._vision_fn, self._prefill_fn, self._denoise_fn,
                              self._decode_fn, self._extend_fn) if fn is not None]

    def seal_compiled(self, sealed: bool = True) -> None:
        """Compile nothing more (see CompiledFunction.seal): the warm-up is over.

        sealed False: compile again where a graph is missing.
        """
        for fn in self.compiled_functions:
            fn.seal(sealed)

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
