"""Each phase's floor: the least time its arithmetic and memory traffic allow on this machine.

Work is counted for what the passes compute, not for the static shapes:
  vision    the shown cameras only (a masked camera never enters the tower);
  prefill   the vision tower plus the backbone over the valid prefix positions (prefill packs
            them: a LIBERO frame computes 555 of 968), attention n x n among them; the K/V of
            all P positions are written to the pool;
  denoise   S steps of the expert over H action tokens, attending to the prefix keys it
            computes (on the CPU the valid ones, packed once per frame; on an accelerator all
            P, masked) and to the H action keys; every step reads the expert's weights and
            those prefix K/V once; the adaRMS modulations are constants of the weights
            (the flow times never change), computed once and kept (Pi05Model.
            denoise_modulations): no work of a frame;
  decode B  one token for each of B rows: the backbone and the tied LM head read once, each
            row's K/V over P + J positions.
FLOPs are 2 x multiply-adds of the matmuls (norms, softmax and element-wise work are left out:
they are memory traffic at most). Bytes are weights at their stored dtype (float32 islands
included) plus K/V reads and writes; activations are left out.

The floor of a phase is max(FLOPs / matmul peak of the model's dtype, bytes / copy bandwidth),
both measured on this machine in the same run (engine/hardware.py); 'x floor' = time / floor.
"""

from __future__ import annotations

import dataclasses

import torch

from ..model import Pi05Model


@dataclasses.dataclass(frozen=True)
class Work:
    """Arithmetic and memory traffic of one phase."""

    flops: float
    bytes: float


def _param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _layer_macs(width: int, heads: int, kv_heads: int, head_dim: int, mlp: int) -> int:
    """Multiply-adds per token of a Gemma layer's projections (q/k/v/o) and gated MLP."""
    return width * (2 * heads + 2 * kv_heads) * head_dim + 3 * width * mlp


def phase_work(model: Pi05Model, shown_images: int, valid_positions: int,
               batches: tuple[int, ...], attend_len: int,
               kv_dtype: torch.dtype | None = None,
               denoise_keys: int | None = None) -> dict[str, Work]:
    """Work of 'vision', 'prefill', 'denoise' and 'decode B' (each B of `batches`).

    shown_images: camera images through the vision tower in one prefill; valid_positions:
    prefix positions the backbone computes (image tokens of shown cameras + prompt tokens);
    attend_len: generated positions J a decode step attends (besides the P prefix ones);
    denoise_keys: prefix keys a denoise step attends (default P; Pi05Model.action_context).
    """
    cfg = model.config
    b, e, v = cfg.backbone, cfg.expert, cfg.vision
    kv_size = (kv_dtype or model.compute_dtype).itemsize
    P, H, S, Ti = cfg.prefix_len, cfg.action_horizon, cfg.num_steps, cfg.tokens_per_image
    kv_entry = b.depth * b.num_kv_heads * b.head_dim * 2 * kv_size   # K + V of one position
    # vision: patch embedding, encoder layers (attention within each image), projector
    v_layer = 4 * v.hidden ** 2 + 2 * v.hidden * v.mlp_dim
    vision_macs = shown_images * Ti * (3 * v.patch_size ** 2 * v.hidden + v.depth * v_layer
                                       + v.hidden * b.width)
    vision_macs += shown_images * v.depth * 2 * Ti * Ti * v.hidden
    vision_bytes = _param_bytes(model.vision) + _param_bytes(model.projector)
    vision = Work(2 * vision_macs, vision_bytes)
    # prefill: vision + backbone layers over the n valid positions
    n = valid_positions
    b_layer = _layer_macs(b.width, b.num_heads, b.num_kv_heads, b.head_dim, b.mlp_dim)
    backbone_macs = b.depth * (n * b_layer + 2 * n * n * b.num_heads * b.head_dim)
    layers_bytes = _param_bytes(model.backbone.layers)
    prefill = Work(vision.flops + 2 * backbone_macs,
                   vision.bytes + layers_bytes + P * kv_entry)
    # denoise: S expert passes over H tokens attending P + H keys (modulations: kept)
    e_layer = _layer_macs(e.width, e.num_heads, e.num_kv_heads, e.head_dim, e.mlp_dim)
    keys = P if denoise_keys is None else denoise_keys
    step_macs = e.depth * (H * e_layer + 2 * H * (keys + H) * e.num_heads * e.head_dim)
    step_macs += 2 * H * cfg.action_dim * e.width
    step_bytes = (sum(_param_bytes(layer.self_attn) + _param_bytes(layer.mlp)
                      for layer in model.expert.layers)
                  + _param_bytes(model.action_in_proj) + _param_bytes(model.action_out_proj)
                  + keys * kv_entry)
    denoise = Work(2 * S * step_macs, S * step_bytes)
    work = {'vision': vision, 'prefill': prefill, 'denoise': denoise}
    # decode: one token per row; weights once per step, K/V per row
    head_bytes = model.backbone.embed_tokens.weight.numel() * \
        model.backbone.embed_tokens.weight.element_size()
    row_macs = (b.depth * (b_layer + 2 * (P + attend_len) * b.num_heads * b.head_dim)
                + b.vocab_size * b.width)
    for batch in batches:
        work[f'decode {batch}'] = Work(2 * batch * row_macs, layers_bytes + head_bytes
                                       + batch * (P + attend_len + 1) * kv_entry)
    return work
