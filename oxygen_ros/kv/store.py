"""KVStore: the tensors behind the pool's slots, preallocated once.

Shapes (letters used throughout kv/ and engine/):
    L layers, S slots, P prefix positions, T = P + max_gen_len + 1 storage entries per slot,
    G kv heads, D head dim, W backbone width.

Per slot s:
    k[:, s], v[:, s]    [L, T, G, D]  K (after RoPE) and V of the prefix, then generated tokens
    prefix_valid[s]     [P] bool      which prefix positions are real (masked cameras, padding)
    n_valid[s]          long          real prefix positions = RoPE offset of generated tokens
    last_hidden[s]      [W] float32   final-normed hidden at the last real prefix position
                                      (the first generated token's logits come from it)

Storage entries of one slot:

    [0 ........ P)[P ................ P + max_gen_len)[P + max_gen_len]
     prefix          generated tokens (a request writes    scratch: written by padding rows,
                     at most forced + N - 1 of them)        never read unmasked

The scratch entry is what makes padding free of side effects: a padding row of a decode batch
may name any slot (a hole in a run of slots, or a repeat to fill a bucket) and writes only
there, so the batch keeps a static shape without a whole null slot of memory.
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


def slot_bytes(num_layers: int, prefix_len: int, max_gen_len: int, num_kv_heads: int,
               head_dim: int, width: int, dtype: torch.dtype) -> int:
    """Bytes one slot of a KVStore occupies: K and V of T entries plus its prefix state."""
    slot_len = prefix_len + max_gen_len + 1
    kv = 2 * num_layers * slot_len * num_kv_heads * head_dim * dtype.itemsize
    state = prefix_len * torch.bool.itemsize + torch.long.itemsize + width * 4   # float32
    return kv + state


class KVStore:
    """Preallocated K/V and per-slot prefix state; only the model runner touches it."""

    def __init__(self, num_layers: int, num_slots: int, prefix_len: int, max_gen_len: int,
                 num_kv_heads: int, head_dim: int, width: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = 'cpu'):
        if prefix_len < 1 or max_gen_len < 0:
            raise ValueError(f'bad lengths: prefix_len={prefix_len}, max_gen_len={max_gen_len}')
        self.num_slots = num_slots
        self.prefix_len = prefix_len                    # P
        self.max_gen_len = max_gen_len                  # generated entries a request may write
        self.slot_len = prefix_len + max_gen_len + 1    # T, the scratch entry included
        shape = (num_layers, num_slots, self.slot_len, num_kv_heads, head_dim)
        # Zeroed, not empty: masked-out positions still enter attention matmuls with weight 0,
        # and 0 * NaN from uninitialised memory would poison the row.
        self.k = zeros(shape, dtype, device)                                  # [L, S, T, G, D]
        self.v = zeros(shape, dtype, device)                                  # [L, S, T, G, D]
        self.prefix_valid = torch.zeros(num_slots, prefix_len, dtype=torch.bool,
                                        device=device)                        # [S, P]
        self.n_valid = torch.zeros(num_slots, dtype=torch.long, device=device)  # [S]
        self.last_hidden = torch.zeros(num_slots, width, dtype=torch.float32,
                                       device=device)                         # [S, W]
        # slot_ids[s:s + 1] is a device tensor naming slot s: no host-to-device copy per call.
        self.slot_ids = torch.arange(num_slots, device=device)               # [S]

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def scratch_gen_len(self) -> int:
        """The gen_len of a padding row: it writes the scratch entry P + max_gen_len."""
        return self.max_gen_len

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one slot occupies: K and V rows plus its prefix state."""
        L, _, _, G, D = self.k.shape
        return slot_bytes(L, self.prefix_len, self.max_gen_len, G, D,
                          self.last_hidden.shape[1], self.k.dtype)

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_slot * self.num_slots

    def record_prefix(self, slot: int, valid: torch.Tensor, n_valid: torch.Tensor,
                      last_hidden: torch.Tensor) -> None:
        """Store a prefill's per-slot facts: valid bool [P], n_valid long [], last_hidden [W]."""
        assert valid.shape == (self.prefix_len,), (
            f'valid {tuple(valid.shape)} != ({self.prefix_len},)')
        self.prefix_valid[slot].copy_(valid)
        self.n_valid[slot].copy_(n_valid)
        self.last_hidden[slot].copy_(last_hidden)
