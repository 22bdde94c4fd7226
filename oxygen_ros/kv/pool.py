"""KVPool: slot ids, holders and accounting of the unified KV cache (no tensors).

A slot holds one observation's prefix K/V followed by the K/V of the tokens a language request
generates from it. The action expert reads the prefix of a slot; a language request started at
that frame adopts the same slot and appends to it, so a frame is prefilled once and its cache
is never copied. The tensors behind the slots live in `KVStore`, owned by the model runner;
what crosses this class's boundary is a slot id (int) or a count.

Allocation takes the lowest free id. With one request per frame the live requests then sit on
the lowest ids and a finished request's slot is refilled first, so the slots a decode step
reads form a run (the model reads a run of slots as a view, anything else as a gather).
"""

from __future__ import annotations

import heapq


class SlotError(RuntimeError):
    """A slot was retained or released by a party that may not (a caller's bug)."""


class KVPool:
    """`num_slots` slots with a free list and named holders.

    A slot is free when nobody holds it. Holders are names (e.g. 'frame 12', 'request 3');
    the refcount of a slot is its number of holders. Naming holders turns a double release
    or a release by the wrong party into an immediate error instead of a silent leak.
    """

    def __init__(self, num_slots: int, bytes_per_slot: int = 0):
        if num_slots < 1:
            raise ValueError(f'num_slots must be >= 1, got {num_slots}')
        self.num_slots = num_slots
        self.bytes_per_slot = bytes_per_slot    # K/V + prefix state of one slot (accounting)
        self._free: list[int] = list(range(num_slots))   # a min-heap of free ids
        self._holders: list[list[str]] = [[] for _ in range(num_slots)]
        self.peak_slots_in_use = 0
        self.num_allocations = 0     # successful allocate() calls, for accounting
        self.num_refusals = 0        # allocate() calls that found the pool full

    # ---- sizes -----------------------------------------------------------------------------

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
        """Take the lowest free slot for `holder`; None (and no change at all) when full."""
        if not self._free:
            self.num_refusals += 1
            return None
        slot = heapq.heappop(self._free)
        self._holders[slot].append(holder)
        self.num_allocations += 1
        self.peak_slots_in_use = max(self.peak_slots_in_use, self.num_in_use)
        return slot

    def retain(self, slot: int, holder: str) -> None:
        """Add `holder` to a slot that is already in use (e.g. a request adopting a frame)."""
        holders = self._holders_of(slot)
        # Raised, not asserted: a wrong retain or release must stop the caller under -O too,
        # before the accounting drifts (a double release would hand one slot out twice).
        if not holders:
            raise SlotError(f'retain of free slot {slot} by {holder!r}')
        if holder in holders:
            raise SlotError(f'{holder!r} already holds slot {slot}')
        holders.append(holder)

    def release(self, slot: int, holder: str) -> bool:
        """Drop `holder` from `slot`; return True when that freed the slot."""
        holders = self._holders_of(slot)
        if holder not in holders:
            raise SlotError(f'{holder!r} does not hold slot {slot} (holders {holders})')
        holders.remove(holder)
        if holders:
            return False
        # K/V and prefix state are left as they are: the next prefill of the slot rewrites
        # every entry a reader can see before anyone reads it.
        heapq.heappush(self._free, slot)
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
        free_set = set(free)
        for slot, holders in enumerate(self._holders):
            in_free = slot in free_set
            assert in_free == (not holders), (
                f'slot {slot}: in free list={in_free} but holders={holders}')
            assert len(set(holders)) == len(holders), f'slot {slot}: duplicate holders {holders}'
        assert 0 <= self.num_in_use <= self.num_slots
        assert self.peak_slots_in_use <= self.num_slots

    def __str__(self) -> str:
        mib = 1 / 2**20
        lines = [f'KVPool {self.num_in_use}/{self.num_slots} slots, '
                 f'{self.bytes_in_use * mib:.2f}/{self.total_bytes * mib:.2f} MiB in use '
                 f'(peak {self.peak_slots_in_use} slots)']
        for slot, holders in enumerate(self._holders):
            if holders:
                lines.append(f'  slot {slot}: ' + ', '.join(holders))
        return '\n'.join(lines)
