"""KVStore: the tensors behind the pool's prefix slots and generation blocks, allocated once.

Shapes (letters used throughout kv/ and engine/):
    L layers, S prefix slots, P prefix positions, M generation blocks, E = max_gen_len + 1
    entries per block, G kv heads, D head dim, W backbone width.

A frame's prefix is written once into a prefix slot; every language request started at that
frame (one per language task) reads it in place and writes the tokens it generates into a
generation block of its own (vLLM v1's shared prefix blocks, one level deep):

    prefix slot s        k[:, s], v[:, s]          [L, P, G, D]  K (after RoPE) and V
                         prefix_valid[s]           [P] bool      real positions (masked cameras,
                                                                 padding)
                         n_valid[s]                long          real prefix positions = RoPE
                                                                 offset of generated tokens
                         last_hidden[s]            [W] float32   final-normed hidden at the last
                                                                 real prefix position (the first
                                                                 generated token's logits)
    generation block b   gen_k[:, b], gen_v[:, b]  [L, E, G, D]  K/V of one request's tokens

Entries of one generation block:

    [0 ................. max_gen_len)[max_gen_len]
     generated tokens (a request       scratch: written by padding rows, never read unmasked
     writes at most forced + N - 1)

The scratch entry is what makes padding free of side effects: a padding row of a decode batch
may name any block (a hole in a run of blocks, or a repeat to fill a bucket) and writes only
there, so the batch keeps a static shape without a whole null block of memory. A prefix is
only ever read by decode steps, so several requests share it without a copy.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """Zeroed storage; on the CPU its pages become resident only when first written.

    Why: torch.zeros writes every byte at once, so a slot that is never used (the pool's
    spare, the unused tail of every slot) would still count in the resident memory. numpy's
    zeros takes zero pages from the kernel (calloc), which cost nothing until touched.
    """
    if torch.device(device).type != 'cpu':
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def slot_bytes(num_layers: int, prefix_len: int, num_kv_heads: int, head_dim: int, width: int,
               dtype: torch.dtype) -> int:
    """Bytes one prefix slot of a KVStore occupies: K and V of P entries plus its prefix state."""
    kv = 2 * num_layers * prefix_len * num_kv_heads * head_dim * dtype.itemsize
    state = prefix_len * torch.bool.itemsize + torch.long.itemsize + width * 4   # float32
    return kv + state


def block_bytes(num_layers: int, max_gen_len: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> int:
    """Bytes one generation block occupies: K and V of max_gen_len + 1 entries (scratch)."""
    return 2 * num_layers * (max_gen_len + 1) * num_kv_heads * head_dim * dtype.itemsize


class KVStore:
    """Preallocated prefix slots, generation blocks and prefix state; only the runner touches it.

    num_blocks: generation blocks (None: one per prefix slot, one language task's need).
    """

    def __init__(self, num_layers: int, num_slots: int, prefix_len: int, max_gen_len: int,
                 num_kv_heads: int, head_dim: int, width: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = 'cpu',
                 num_blocks: int | None = None):
        if prefix_len < 1 or max_gen_len < 0:
            raise ValueError(f'bad lengths: prefix_len={prefix_len}, max_gen_len={max_gen_len}')
        num_blocks = num_slots if num_blocks is None else num_blocks
        if num_slots < 1 or num_blocks < 1:
            raise ValueError(f'need a slot and a block, got {num_slots} slots, {num_blocks} '
                             'blocks')
        self.num_slots = num_slots                      # S
        self.num_blocks = num_blocks                    # M
        self.prefix_len = prefix_len                    # P
        self.max_gen_len = max_gen_len                  # generated entries a request may write
        self.block_len = max_gen_len + 1                # E, the scratch entry included
        shape = (num_layers, num_slots, prefix_len, num_kv_heads, head_dim)
        gen_shape = (num_layers, num_blocks, self.block_len, num_kv_heads, head_dim)
        # Zeroed, not empty: masked-out positions still enter attention matmuls with weight 0,
        # and 0 * NaN from uninitialised memory would poison the row.
        self.k = zeros(shape, dtype, device)                                  # [L, S, P, G, D]
        self.v = zeros(shape, dtype, device)                                  # [L, S, P, G, D]
        self.gen_k = zeros(gen_shape, dtype, device)                          # [L, M, E, G, D]
        self.gen_v = zeros(gen_shape, dtype, device)                          # [L, M, E, G, D]
        self.prefix_valid = torch.zeros(num_slots, prefix_len, dtype=torch.bool,
                                        device=device)                        # [S, P]
        self.n_valid = torch.zeros(num_slots, dtype=torch.long, device=device)  # [S]
        self.last_hidden = torch.zeros(num_slots, width, dtype=torch.float32,
                                       device=device)                         # [S, W]
        # slot_ids[s:s + 1] is a device tensor naming slot s: no host-to-device copy per call.
        self.slot_ids = torch.arange(max(num_slots, num_blocks), device=device)  # [max(S, M)]

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def scratch_gen_len(self) -> int:
        """The gen_len of a padding row: it writes the scratch entry max_gen_len of a block."""
        return self.max_gen_len

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one prefix slot occupies: K and V rows plus its prefix state."""
        L, _, _, G, D = self.k.shape
        return slot_bytes(L, self.prefix_len, G, D, self.last_hidden.shape[1], self.k.dtype)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one generation block occupies."""
        L, _, _, G, D = self.k.shape
        return block_bytes(L, self.max_gen_len, G, D, self.k.dtype)

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_slot * self.num_slots + self.bytes_per_block * self.num_blocks

    def record_prefix(self, slot: int, valid: torch.Tensor, n_valid: torch.Tensor,
                      last_hidden: torch.Tensor) -> None:
        """Store a prefill's per-slot facts: valid bool [P], n_valid long [], last_hidden [W]."""
        assert valid.shape == (self.prefix_len,), (
            f'valid {tuple(valid.shape)} != ({self.prefix_len},)')
        self.prefix_valid[slot].copy_(valid)
        self.n_valid[slot].copy_(n_valid)
        self.last_hidden[slot].copy_(last_hidden)
