"""ModelRunner: the one place where slot ids become tensor indices and the model is called.

Every model call is timed here (with a device sync on CUDA, so the clock sees the work), which
is how the scheduler tells model time from its own overhead.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from oxygen_ros.kv import DecodeBatch, KVPool
from oxygen_ros.model.pi05 import KVTensors, Pi05Model, PrefixCache

MODEL_CALLS = ('prefill', 'action', 'decode')


class ModelRunner:
    """Runs prefill / sample_actions / first token / decode_step against the pool's storage."""

    def __init__(self, model: Pi05Model, pool: KVPool,
                 clock: Callable[[], float] = time.perf_counter):
        cfg = model.config
        b = cfg.backbone
        expected = (b.depth, pool.num_slots, pool.slot_len, b.num_kv_heads, b.head_dim)
        assert tuple(pool.k.shape) == expected, f'pool {tuple(pool.k.shape)} != {expected}'
        assert pool.prefix_len == cfg.prefix_len, f'pool P {pool.prefix_len} != {cfg.prefix_len}'
        self.model = model
        self.pool = pool
        self.kv = KVTensors(pool.k, pool.v)   # views of the pool's storage, no copy
        self.clock = clock
        self.device = pool.k.device
        self.seconds = dict.fromkeys(MODEL_CALLS, 0.0)   # model time since reset_times()
        self.last_call_s = 0.0                            # duration of the latest call

    def reset_times(self) -> None:
        self.seconds = dict.fromkeys(MODEL_CALLS, 0.0)

    @property
    def model_seconds(self) -> float:
        return sum(self.seconds.values())

    def _add(self, call: str, start: float) -> None:
        self.last_call_s = self.clock() - start
        self.seconds[call] += self.last_call_s

    def _sync(self) -> None:
        if self.device.type == 'cuda':
            torch.cuda.synchronize(self.device)

    def prefill(self, tensors: dict[str, torch.Tensor], slot: int) -> PrefixCache:
        """Write one observation's prefix K/V into `slot`; record its valid mask in the pool."""
        start = self.clock()
        prefix = self.model.prefill(**tensors, kv=self.kv,
                                    slots=torch.tensor([slot], dtype=torch.long))
        self.pool.set_prefix_valid(slot, prefix.valid[0])
        self._sync()
        self._add('prefill', start)
        return prefix

    def sample_actions(self, prefix: PrefixCache, noise: np.ndarray) -> np.ndarray:
        """Flow matching from `noise` [H, A] over the cached prefix -> float32 numpy [H, A]."""
        start = self.clock()
        noise_t = torch.from_numpy(noise)[None].to(self.device)           # [1, H, A]
        actions = self.model.sample_actions(prefix, noise_t)[0]
        out = actions.to('cpu', torch.float32).numpy()                      # syncs
        self._add('action', start)
        return out

    def first_token(self, last_hidden: torch.Tensor) -> int:
        """Greedy first generated token from the prefix's last hidden state [1, W]."""
        start = self.clock()
        with torch.no_grad():
            token = int(self.model.lm_logits(last_hidden).argmax(-1)[0])   # syncs
        self._add('decode', start)
        return token

    def decode(self, batch: DecodeBatch) -> list[int]:
        """One batched decode step; greedy next token per row (row order of the batch)."""
        start = self.clock()
        logits = self.model.decode_step(self.kv, batch.slots, batch.prefix_valid, batch.n_valid,
                                        batch.gen_len, batch.tokens)        # [B, vocab]
        tokens = logits.argmax(-1).tolist()                                  # syncs
        self._add('decode', start)
        return tokens
