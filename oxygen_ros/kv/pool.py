"""KVPool: slot ids, holders and accounting of the unified KV cache (no tensors).

A slot holds one observation's prefix K/V followed by the K/V of the tokens a language request
generates from it. The action expert reads the prefix of a slot; a language request started at
that frame adopts the same slot and appends to it, so a frame is prefilled once and its cache
is never copied. The tensors behind the slots live in `KVStore`, owned by the model runner;
what crosses this class's boundary is a slot id (int) or a count.

Allocation takes the lowest free id. With one request per frame the live requests then sit on
the lowest ids and a finished request's slot is refilled first, so the slots a decode step
reads form a run (the model reads a run of slots as a view, anything else as a gather).

Several robots served by one engine share one pool through `partition`: each robot's
scheduler gets a QuotaPool, a share of a fixed number of slots with the same interface. The
quotas add up to at most the pool, so no robot's requests can take another robot's slots.
"""

from __future__ import annotations

import heapq
import threading


class SlotError(RuntimeError):
    """A slot was retained or released by a party that may not (a caller's bug)."""


class _SlotBytes:
    """Byte accounting derived from slot counts (KVPool and its QuotaPool shares)."""

    bytes_per_slot: int
    num_slots: int
    num_in_use: int
    peak_slots_in_use: int

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_slot * self.num_slots

    @property
    def bytes_in_use(self) -> int:
        return self.num_in_use * self.bytes_per_slot

    @property
    def peak_bytes(self) -> int:
        return self.peak_slots_in_use * self.bytes_per_slot


class KVPool(_SlotBytes):
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
        self.shares: dict[str, QuotaPool] = {}   # set once by partition()
        # A fleet's robots may finish requests on their row threads at once (fleet.py).
        self._lock = threading.Lock()

    # ---- sizes -----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return self.num_slots - len(self._free)

    # ---- allocation --------------------------------------------------------------------

    def allocate(self, holder: str) -> int | None:
        """Take the lowest free slot for `holder`; None (and no change at all) when full."""
        with self._lock:
            return self._allocate(holder)

    def _allocate(self, holder: str) -> int | None:
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
        with self._lock:
            self._retain(slot, holder)

    def _retain(self, slot: int, holder: str) -> None:
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
        with self._lock:
            return self._release(slot, holder)

    def _release(self, slot: int, holder: str) -> bool:
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

    def partition(self, quotas: dict[str, int]) -> dict[str, QuotaPool]:
        """Split the pool into named shares of at most `quotas[owner]` slots each (once).

        The quotas must fit in the pool, so an owner below its quota always finds a free slot
        whatever the others hold: one robot's language can never take another's action slot.
        """
        if self.shares:
            raise ValueError(f'pool already partitioned among {sorted(self.shares)}')
        if not quotas:
            raise ValueError('partition needs at least one owner')
        bad = {owner: q for owner, q in quotas.items() if not owner or '/' in owner or q < 1}
        if bad:
            raise ValueError(f'owners need a name without "/" and a quota >= 1, got {bad}')
        if sum(quotas.values()) > self.num_slots:
            raise ValueError(f'quotas {quotas} need {sum(quotas.values())} slots, the pool has '
                             f'{self.num_slots}')
        if self.num_in_use:
            raise ValueError(f'partition of a pool with {self.num_in_use} slots in use')
        self.shares = {owner: QuotaPool(self, owner, q) for owner, q in quotas.items()}
        return dict(self.shares)

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


class QuotaPool(_SlotBytes):
    """One owner's share of a partitioned KVPool: at most `quota` slots (KVPool's interface).

    Made by KVPool.partition. A robot's scheduler sees its share as a pool of `quota` slots;
    slot ids are the shared pool's, so the decode rows of several robots index one KV store.
    Holders are named '<owner>/<holder>' in the shared pool; this view shows them without the
    prefix and only ever touches its own slots.
    """

    def __init__(self, pool: KVPool, owner: str, quota: int):
        self.pool = pool
        self.owner = owner
        self.quota = quota
        self._prefix = f'{owner}/'
        self._held: set[int] = set()    # slots this owner holds (by one holder or more)
        self.peak_slots_in_use = 0
        self.num_allocations = 0        # successful allocate() calls
        self.num_refusals = 0           # allocate() calls at the quota

    # ---- sizes (of the share) -------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self.quota

    @property
    def bytes_per_slot(self) -> int:
        return self.pool.bytes_per_slot

    @property
    def num_in_use(self) -> int:
        return len(self._held)

    @property
    def num_free(self) -> int:
        return self.quota - len(self._held)

    # ---- allocation ----------------------------------------------------------------------

    def allocate(self, holder: str) -> int | None:
        """Take the shared pool's lowest free slot; None (nothing changed) at the quota."""
        if len(self._held) >= self.quota:
            self.num_refusals += 1
            return None
        slot = self.pool.allocate(self._prefix + holder)
        if slot is None:   # only if a party outside the partition took slots
            self.num_refusals += 1
            return None
        self._held.add(slot)
        self.num_allocations += 1
        self.peak_slots_in_use = max(self.peak_slots_in_use, len(self._held))
        return slot

    def retain(self, slot: int, holder: str) -> None:
        """Add `holder` to one of this owner's slots."""
        if slot not in self._held:
            raise SlotError(f'{self.owner}: retain of slot {slot} it does not hold by '
                            f'{holder!r}')
        self.pool.retain(slot, self._prefix + holder)

    def release(self, slot: int, holder: str) -> bool:
        """Drop `holder` from `slot`; return True when the slot left this share."""
        self.pool.release(slot, self._prefix + holder)
        if self.holders(slot):
            return False
        self._held.discard(slot)
        return True

    def holders(self, slot: int) -> tuple[str, ...]:
        """Return this owner's holders of `slot`, without the prefix."""
        n = len(self._prefix)
        return tuple(h[n:] for h in self.pool.holders(slot) if h.startswith(self._prefix))

    def refcount(self, slot: int) -> int:
        return len(self.holders(slot))

    def slots_in_use(self) -> list[int]:
        return sorted(self._held)

    # ---- accounting and invariants --------------------------------------------------------

    def usage(self) -> dict:
        """Return counts of the share, like KVPool.usage, plus the shared pool's slots."""
        return {
            'slots_in_use': self.num_in_use,
            'slots_total': self.quota,
            'bytes_in_use': self.bytes_in_use,
            'bytes_total': self.total_bytes,
            'peak_slots_in_use': self.peak_slots_in_use,
            'peak_bytes': self.peak_bytes,
            'bytes_per_slot': self.bytes_per_slot,
            'holders': {s: list(self.holders(s)) for s in sorted(self._held)},
            'pool_slots_in_use': self.pool.num_in_use,
            'pool_slots_total': self.pool.num_slots,
        }

    def check(self) -> None:
        """Assert the shared pool's invariants and that this share matches its holders."""
        self.pool.check()
        mine = {s for s in range(self.pool.num_slots) if self.holders(s)}
        assert mine == self._held, f'{self.owner}: holds {sorted(mine)}, thinks {self._held}'
        assert len(self._held) <= self.quota, (
            f'{self.owner}: {len(self._held)} slots over its quota {self.quota}')

    def __str__(self) -> str:
        lines = [f'KV share {self.owner!r}: {self.num_in_use}/{self.quota} slots '
                 f'(peak {self.peak_slots_in_use}) of a pool at '
                 f'{self.pool.num_in_use}/{self.pool.num_slots}']
        for slot in sorted(self._held):
            lines.append(f'  slot {slot}: ' + ', '.join(self.holders(slot)))
        return '\n'.join(lines)
