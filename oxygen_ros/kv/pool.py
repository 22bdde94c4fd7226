"""KVPool: the one owner of all KV-cache memory, handed out as slots.

A slot holds one observation's prefix K/V (positions [0, P)) followed by the K/V of the tokens
a language request generates from it (positions [P, T)). The action expert reads the prefix of
a slot; a language request started at that frame adopts the same slot and appends to it, so a
frame is prefilled once and its cache is never copied.

Everything that crosses the pool's boundary is a slot id (int) or a count. Only the model
runner turns ids into tensor indices.
"""

from __future__ import annotations

import torch


class KVPool:
    """Preallocated K/V storage for `num_slots` slots, with a free list and refcounts.

    Shapes (letters used throughout kv/ and engine/):
        L layers, S slots, T = P + max_gen_len positions per slot, KVH kv heads, D head dim.
        k, v:          [L, S, T, KVH, D]  (model dtype)
        prefix_valid:  [S, P] bool        (which prefix positions of each slot are real)

    A slot is free when nobody holds it. Holders are names (e.g. 'frame 12', 'request 3');
    the refcount of a slot is its number of holders. Naming holders turns a double release
    or a release by the wrong party into an immediate error instead of a silent leak.
    """

    def __init__(self, num_layers: int, num_slots: int, prefix_len: int, max_gen_len: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = 'cpu'):
        if num_slots < 1:
            raise ValueError(f'num_slots must be >= 1, got {num_slots}')
        if prefix_len < 1 or max_gen_len < 0:
            raise ValueError(f'bad lengths: prefix_len={prefix_len}, max_gen_len={max_gen_len}')
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.prefix_len = prefix_len            # P
        self.max_gen_len = max_gen_len          # generated K/V entries a slot can hold
        self.slot_len = prefix_len + max_gen_len  # T
        shape = (num_layers, num_slots, self.slot_len, num_kv_heads, head_dim)
        # Zeroed, not empty: masked-out positions still enter attention matmuls with weight 0,
        # and 0 * NaN from uninitialised memory would poison the row.
        self.k = torch.zeros(shape, dtype=dtype, device=device)   # [L, S, T, KVH, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)   # [L, S, T, KVH, D]
        self.prefix_valid = torch.zeros(num_slots, prefix_len, dtype=torch.bool,
                                        device=device)            # [S, P]
        # Lowest id first, so a quiet system keeps reusing the same (cache-warm) slots.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._holders: list[list[str]] = [[] for _ in range(num_slots)]
        self.peak_slots_in_use = 0
        self.num_allocations = 0     # successful allocate() calls, for accounting
        self.num_refusals = 0        # allocate() calls that found the pool full

    # ---- sizes -----------------------------------------------------------------------------

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one slot occupies: its K and V rows plus its prefix_valid row."""
        kv = 2 * self.k[:, 0].numel() * self.k.element_size()
        return kv + self.prefix_len * self.prefix_valid.element_size()

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_slot * self.num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def bytes_in_use(self) -> int:
        return self.num_in_use * self.bytes_per_slot

    @property
    def peak_bytes(self) -> int:
        return self.peak_slots_in_use * self.bytes_per_slot

    # ---- allocation --------------------------------------------------------------------

    def allocate(self, holder: str) -> int | None:
        """Take a free slot for `holder`; None (and no change at all) when the pool is full."""
        if not self._free:
            self.num_refusals += 1
            return None
        slot = self._free.pop()
        self._holders[slot].append(holder)
        self.num_allocations += 1
        self.peak_slots_in_use = max(self.peak_slots_in_use, self.num_in_use)
        return slot

    def retain(self, slot: int, holder: str) -> None:
        """Add `holder` to a slot that is already in use (e.g. a request adopting a frame)."""
        holders = self._holders_of(slot)
        assert holders, f'retain of free slot {slot} by {holder!r}'
        assert holder not in holders, f'{holder!r} already holds slot {slot}'
        holders.append(holder)

    def release(self, slot: int, holder: str) -> bool:
        """Drop `holder` from `slot`; return True when that freed the slot."""
        holders = self._holders_of(slot)
        assert holder in holders, f'{holder!r} does not hold slot {slot} (holders {holders})'
        holders.remove(holder)
        if holders:
            return False
        # Reset the mask so a stale row can never be mistaken for a live prefix; K/V are left
        # as they are (every position read is rewritten before it is read again).
        self.prefix_valid[slot].zero_()
        self._free.append(slot)
        return True

    def refcount(self, slot: int) -> int:
        return len(self._holders_of(slot))

    def holders(self, slot: int) -> tuple[str, ...]:
        return tuple(self._holders_of(slot))

    def slots_in_use(self) -> list[int]:
        return [s for s in range(self.num_slots) if self._holders[s]]

    def _holders_of(self, slot: int) -> list[str]:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f'slot {slot} out of range [0, {self.num_slots})')
        return self._holders[slot]

    # ---- data access (views, never copies) ----------------------------------------------------

    def slot_view(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one slot as views, each [L, T, KVH, D]."""
        assert self._holders_of(slot), f'slot {slot} is free'
        return self.k[:, slot], self.v[:, slot]

    def set_prefix_valid(self, slot: int, valid: torch.Tensor) -> None:
        """Record which prefix positions of `slot` are real; valid: bool [P]."""
        assert self._holders_of(slot), f'slot {slot} is free'
        assert valid.shape == (self.prefix_len,), (
            f'valid {tuple(valid.shape)} != ({self.prefix_len},)')
        self.prefix_valid[slot].copy_(valid)

    # ---- accounting and invariants ------------------------------------------------------

    def usage(self) -> dict:
        """Return counts for logs, diagnostics and FrameResult (plain ints and strings)."""
        return {
            'slots_in_use': self.num_in_use,
            'slots_total': self.num_slots,
            'bytes_in_use': self.bytes_in_use,
            'bytes_total': self.total_bytes,
            'peak_slots_in_use': self.peak_slots_in_use,
            'peak_bytes': self.peak_bytes,
            'bytes_per_slot': self.bytes_per_slot,
            'holders': {s: list(h) for s, h in enumerate(self._holders) if h},
        }

    def check(self) -> None:
        """Assert the pool's invariants; cheap enough to run after every scheduler step."""
        free = self._free
        assert len(set(free)) == len(free), f'duplicate ids in free list {free}'
        assert all(0 <= s < self.num_slots for s in free), f'bad id in free list {free}'
        for slot, holders in enumerate(self._holders):
            in_free = slot in free
            assert in_free == (not holders), (
                f'slot {slot}: in free list={in_free} but holders={holders}')
            assert len(set(holders)) == len(holders), f'slot {slot}: duplicate holders {holders}'
        assert 0 <= self.num_in_use <= self.num_slots
        assert self.peak_slots_in_use <= self.num_slots
        if free:
            # Free slots carry no prefix mask (reset on release).
            idx = torch.tensor(free, device=self.prefix_valid.device)
            assert not bool(self.prefix_valid.index_select(0, idx).any()), (
                'a free slot still has prefix_valid set')

    def __str__(self) -> str:
        mib = 1 / 2**20
        lines = [f'KVPool {self.num_in_use}/{self.num_slots} slots, '
                 f'{self.bytes_in_use * mib:.2f}/{self.total_bytes * mib:.2f} MiB in use '
                 f'(peak {self.peak_slots_in_use} slots), '
                 f'T={self.slot_len} (P={self.prefix_len} + {self.max_gen_len}), '
                 f'{self.k.dtype}, {self.k.device}']
        for slot, holders in enumerate(self._holders):
            if holders:
                lines.append(f'  slot {slot}: ' + ', '.join(holders))
        return '\n'.join(lines)
