"""π0.5 dimensions as plain dataclasses, with presets and JSON load/save.

Each field names its shape letter, the one pi05.py, gemma.py and siglip.py use.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    """One Gemma tower (the PaliGemma backbone or the action expert)."""

    width: int            # W, hidden size
    depth: int            # L, number of decoder layers
    mlp_dim: int          # gated-GELU inner size
    num_heads: int        # N, query heads
    num_kv_heads: int     # G, key/value heads (multi-query when 1)
    head_dim: int         # D, per-head size; attention is N*D wide, not `width`
    vocab_size: int = 257152  # V


@dataclasses.dataclass(frozen=True)
class SiglipConfig:
    """SigLIP vision tower plus the linear projector into the backbone width."""

    hidden: int            # Wv, vision width
    depth: int
    num_heads: int         # N
    mlp_dim: int
    patch_size: int = 14   # p
    image_size: int = 224  # R, image side in pixels

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2


# Real-time chunking (model/rtc.py), guided mode: β, the cap of the guidance weight g(t). g is
# singular only at t = 1 (pure noise): the cap is meant for that step. The paper's β = 5 goes
# with its 5 denoising steps, where g(t) <= 4.25 at every other step; at π0.5's 10 steps
# g(0.9) = g(0.1) = 9.1, and β = 5 would cut those steps too: the last one would close only
# g·|dt| = 50% of the remaining error instead of 91% (measured on a policy with smooth chunks,
# bench --parts rtc: boundary jump 0.36x -> 0.25x of 'off' at d = 0). 10 caps only t = 1 at
# 10 steps, as the paper's 5 does at 5; LeRobot's default is 10 too.
DEFAULT_MAX_GUIDANCE_WEIGHT = 10.0


@dataclasses.dataclass(frozen=True)
class Pi05Config:
    """Everything that fixes the shapes of a π0.5 model."""

    backbone: GemmaConfig
    expert: GemmaConfig
    vision: SiglipConfig
    num_cameras: int = 3          # C, image slots: base, left wrist, right wrist
    action_horizon: int = 10      # H
    action_dim: int = 32          # A, model action width (robot actions are zero padded to it)
    max_token_len: int = 200      # Lt, prompt tokens, right padded
    num_steps: int = 10           # flow-matching Euler steps
    discrete_state_input: bool = True

    def __post_init__(self):
        b, e = self.backbone, self.expert
        # Joint attention concatenates Q/K/V of both towers per layer, so these must agree.
        same = ('depth', 'num_heads', 'num_kv_heads', 'head_dim')
        for name in same:
            if getattr(b, name) != getattr(e, name):
                raise ValueError(
                    f'backbone.{name}={getattr(b, name)} != expert.{name}={getattr(e, name)}; '
                    'joint attention needs the same layer count and head layout in both towers')
        if b.num_heads % b.num_kv_heads:
            raise ValueError(f'num_heads={b.num_heads} not a multiple of '
                             f'num_kv_heads={b.num_kv_heads}')
        if self.vision.image_size % self.vision.patch_size:
            raise ValueError('image_size must be a multiple of patch_size')

    @property
    def tokens_per_image(self) -> int:
        return self.vision.tokens_per_image

    @property
    def prefix_len(self) -> int:
        """Static prefix length P = C × Ti + Lt (cameras × image tokens + prompt tokens)."""
        return self.num_cameras * self.tokens_per_image + self.max_token_len

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Pi05Config:
        d = dict(d)
        try:
            d['backbone'] = GemmaConfig(**d['backbone'])
            d['expert'] = GemmaConfig(**d['expert'])
            d['vision'] = SiglipConfig(**d['vision'])
            return cls(**d)
        except (KeyError, TypeError) as err:
            raise ValueError(f'invalid Pi05Config dict: {err}') from err

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + '\n')

    @classmethod
    def from_json(cls, path: str | Path) -> Pi05Config:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def replace(self, **changes) -> Pi05Config:
        return dataclasses.replace(self, **changes)


# openpi's Gemma variants (gemma.get_config), by the names its config.json uses.
GEMMA_VARIANTS = {
    'gemma_2b': GemmaConfig(width=2048, depth=18, mlp_dim=16384, num_heads=8,
                            num_kv_heads=1, head_dim=256),
    'gemma_300m': GemmaConfig(width=1024, depth=18, mlp_dim=4096, num_heads=8,
                              num_kv_heads=1, head_dim=256),
    'dummy': GemmaConfig(width=64, depth=4, mlp_dim=128, num_heads=8, num_kv_heads=1,
                         head_dim=16),
}

SIGLIP_SO400M = SiglipConfig(hidden=1152, depth=27, num_heads=16, mlp_dim=4304)


def _small(width, expert_width, depth, heads, head_dim, vocab, v_hidden, v_depth, v_heads,
           image_size, patch, max_tokens, **kw) -> Pi05Config:
    return Pi05Config(
        backbone=GemmaConfig(width, depth, 4 * width, heads, 1, head_dim, vocab),
        expert=GemmaConfig(expert_width, depth, 4 * expert_width, heads, 1, head_dim, vocab),
        vision=SiglipConfig(v_hidden, v_depth, v_heads, 4 * v_hidden, patch, image_size),
        max_token_len=max_tokens, **kw)


PRESETS: dict[str, Pi05Config] = {
    # The real model: PaliGemma 3B (SigLIP So400m/14 + Gemma 2B) with a Gemma 300M expert.
    'pi05': Pi05Config(backbone=GEMMA_VARIANTS['gemma_2b'],
                       expert=GEMMA_VARIANTS['gemma_300m'], vision=SIGLIP_SO400M),
    # CPU benchmark preset: real image size and tokens per image (3 × 256 + 200 = 968 prefix
    # positions), 10 denoise steps, multi-query heads, an LM head over a real-sized share of
    # the decode cost. Sized so one prefill is ~0.1 s on 2 cores (see README for FLOPs).
    'pi05-cpu': _small(width=256, expert_width=128, depth=6, heads=8, head_dim=32, vocab=16384,
                       v_hidden=192, v_depth=4, v_heads=4, image_size=224, patch=14,
                       max_tokens=200),
    # Unit-test presets: tiny images, few layers; same structure.
    'tiny': _small(width=64, expert_width=32, depth=2, heads=4, head_dim=16, vocab=512,
                   v_hidden=32, v_depth=2, v_heads=2, image_size=28, patch=7, max_tokens=24,
                   action_horizon=4, num_steps=3),
    'small': _small(width=96, expert_width=64, depth=3, heads=4, head_dim=24, vocab=1024,
                    v_hidden=48, v_depth=2, v_heads=4, image_size=56, patch=14, max_tokens=48,
                    action_horizon=10),
}


def get_preset(name: str) -> Pi05Config:
    """Return the preset called `name` (see PRESETS)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f'unknown preset {name!r}; expected one of {sorted(PRESETS)}') from None
