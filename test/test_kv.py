"""KV pool, request state and batch/unbatch with plain tensors (no model)."""

from hypothesis import given, settings, strategies as st
import pytest
import torch

from oxygen_ros.engine.runner import padded_rows
from oxygen_ros.kv import FinishReason, KVPool, KVStore, RequestState, SlotError

L, P, G, KVH, D, W = 2, 6, 4, 1, 8, 5   # layers, prefix, generated capacity, kv heads, dim, width
SLOT_BYTES = 100


def make_pool(num_slots=3):
    return KVPool(num_slots, SLOT_BYTES)


def test_store_shapes_bytes_and_prefix_state():
    store = KVStore(L, 3, P, G, KVH, D, W, num_blocks=7)
    # Prefix slots hold the prefix only; each generation block one scratch entry after its
    # generated capacity, for padding rows.
    assert store.k.shape == (L, 3, P, KVH, D) == store.v.shape
    assert store.gen_k.shape == (L, 7, G + 1, KVH, D) == store.gen_v.shape
    assert store.scratch_gen_len == G and store.block_len == G + 1
    assert store.prefix_valid.shape == (3, P) and store.prefix_valid.dtype == torch.bool
    assert store.n_valid.shape == (3,) and store.last_hidden.shape == (3, W)
    per_slot = 2 * L * P * KVH * D * 4 + P + 8 + W * 4
    per_block = 2 * L * (G + 1) * KVH * D * 4
    assert store.bytes_per_slot == per_slot and store.bytes_per_block == per_block
    assert store.total_bytes == 3 * per_slot + 7 * per_block
    # The bytes are those of the tensors (the accounting is not a separate guess).
    tensors = (store.k, store.v, store.gen_k, store.gen_v)
    kv_bytes = sum(t.numel() * t.element_size() for t in tensors)
    assert kv_bytes == 3 * (per_slot - P - 8 - W * 4) + 7 * per_block
    assert KVStore(L, 3, P, G, KVH, D, W).num_blocks == 3   # default: one per slot
    store.record_prefix(1, torch.arange(P) < 4, torch.tensor(4), torch.ones(W))
    assert store.prefix_valid.sum(-1).tolist() == [0, 4, 0]
    assert store.n_valid.tolist() == [0, 4, 0] and store.last_hidden[1].sum() == W
    assert store.slot_ids[1:2].tolist() == [1]


def test_pool_is_ids_and_counts():
    pool = make_pool(3)
    assert pool.total_bytes == 3 * SLOT_BYTES
    assert pool.bytes_in_use == 0 and pool.num_free == 3


def test_lowest_free_slot_first_keeps_live_slots_a_run():
    pool = make_pool(4)
    assert [pool.allocate(f'r {i}') for i in range(3)] == [0, 1, 2]
    pool.release(1, 'r 1')
    assert pool.allocate('r 3') == 1               # the hole is refilled before slot 3
    pool.release(0, 'r 0')
    pool.release(2, 'r 2')
    assert pool.allocate('r 4') == 0


def test_allocate_until_full_then_refuse_without_change():
    pool = make_pool(2)
    a, b = pool.allocate('frame 0'), pool.allocate('frame 1')
    assert {a, b} == {0, 1}
    before = (pool.num_free, pool.usage(), pool.num_allocations)
    assert pool.allocate('frame 2') is None
    assert (pool.num_free, pool.usage(), pool.num_allocations) == before
    assert pool.num_refusals == 1
    assert pool.bytes_in_use == 2 * pool.bytes_per_slot == pool.peak_bytes
    pool.check()


def test_refcount_adopt_and_release():
    pool = make_pool(2)
    slot = pool.allocate('frame 0')
    pool.retain(slot, 'request 0')                 # the request adopts the frame's slot
    assert pool.refcount(slot) == 2
    assert pool.release(slot, 'frame 0') is False  # still held by the request
    assert pool.num_in_use == 1
    assert pool.release(slot, 'request 0') is True
    assert pool.num_in_use == 0 and pool.bytes_in_use == 0
    assert pool.peak_slots_in_use == 1
    pool.check()


def test_misuse_is_caught():
    pool = make_pool(2)
    slot = pool.allocate('frame 0')
    # Errors, not asserts: they hold under `python -O` too (regression, issue 11).
    with pytest.raises(SlotError):
        pool.release(slot, 'request 9')            # not a holder
    with pytest.raises(SlotError):
        pool.retain(slot, 'frame 0')               # already a holder
    pool.release(slot, 'frame 0')
    with pytest.raises(SlotError):
        pool.release(slot, 'frame 0')              # double release
    with pytest.raises(SlotError):
        pool.retain(slot, 'request 0')             # retain of a free slot
    with pytest.raises(IndexError):
        pool.refcount(5)


def test_check_detects_corruption():
    pool = make_pool(3)
    pool.allocate('frame 0')
    pool.check()
    pool._free.append(pool._free[0])               # duplicate id in the free list
    with pytest.raises(AssertionError):
        pool.check()
    pool = make_pool(3)
    slot = pool.allocate('frame 0')
    pool._holders[slot].clear()                    # held-by-nobody but not free: a leak
    with pytest.raises(AssertionError):
        pool.check()


def test_printable_accounting():
    pool = make_pool(3)
    slot = pool.allocate('frame 7')
    pool.retain(slot, 'request 2')
    text = str(pool)
    assert '1/3 slots' in text and 'frame 7, request 2' in text
    usage = pool.usage()
    assert usage['slots_in_use'] == 1 and usage['holders'] == {slot: ['frame 7', 'request 2']}


def test_request_state_counters():
    req = RequestState(0, slot=1, origin_frame=3, max_new_tokens=3, eos_id=1)
    assert req.needs_prefix_token and req.tokens_left == 3 and req.age(5) == 2
    req.accept_prefix_token(7)
    assert req.next_input_token() == 7 and req.gen_len == 0
    req.accept_decode_step(8)
    assert req.gen_len == 1 and req.token_ids == [7, 8] and not req.finished
    assert req.take_new_tokens() == [7, 8] and req.take_new_tokens() == []
    req.accept_decode_step(9)
    assert req.finished and req.finish_reason == 'length' and req.token_ids == [7, 8, 9]
    assert req.tokens_left == 0


def test_request_state_eos_and_forced_tokens():
    req = RequestState(1, slot=0, origin_frame=0, max_new_tokens=5, eos_id=1, forced=[40, 41])
    assert not req.needs_prefix_token              # the template is fed first
    assert req.kv_entries_needed == 2 + 4
    assert req.next_input_token() == 40
    req.accept_decode_step(99)                     # logits after a non-final forced token
    assert req.token_ids == [] and req.next_input_token() == 41
    req.accept_decode_step(12)                     # logits after the last forced token
    assert req.token_ids == [12] and req.next_input_token() == 12
    req.accept_decode_step(1)
    assert req.finished and req.finish_reason == 'eos' and req.token_ids == [12, 1]
    assert req.finish_reason is FinishReason.EOS and req.finish_reason.completed
    with pytest.raises(ValueError):
        req.finish('tired')


def test_finish_reasons_are_strings_with_completed():
    assert [r.completed for r in FinishReason] == [True, True, False, False, False]
    assert FinishReason.LENGTH == 'length' and f'{FinishReason.EVICTED}' == 'evicted'
    assert {FinishReason.ERROR: 1}['error'] == 1   # same hash as its value


def test_padded_rows_fill_holes_and_buckets():
    # A run stays as it is.
    assert padded_rows([2, 3, 4], 8, max_holes=1) == ([2, 3, 4], [0, 1, 2])
    # One hole becomes a padding row: a run of slots, the real rows at their positions.
    assert padded_rows([0, 1, 3], 8, max_holes=1) == ([0, 1, 2, 3], [0, 1, 3])
    # Too many holes: a gather instead.
    assert padded_rows([0, 3, 6], 8, max_holes=1) == ([0, 3, 6], [0, 1, 2])
    # Buckets: pad with the slots after the run, then before it, then repeats.
    assert padded_rows([1, 2], 8, 0, (4, 8)) == ([1, 2, 3, 4], [0, 1])
    assert padded_rows([5, 6], 7, 0, (4,)) == ([3, 4, 5, 6], [2, 3])
    assert padded_rows([0, 1], 2, 0, (4,)) == ([0, 1, 0, 0], [0, 1])
    assert padded_rows([0, 4], 8, 0, (4,)) == ([0, 4, 0, 0], [0, 1])
    assert padded_rows(list(range(5)), 8, 0, (4,)) == (list(range(5)), list(range(5)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(['alloc', 'adopt', 'release']),
                          st.integers(0, 7)), max_size=60),
       st.integers(1, 5))
def test_pool_random_operations_keep_invariants(ops, num_slots):
    """Random allocate/adopt/release against a dict model of who holds what."""
    pool = make_pool(num_slots)
    held: dict[int, list[str]] = {}
    counter = 0
    for op, pick in ops:
        counter += 1
        if op == 'alloc':
            before = pool.num_free
            slot = pool.allocate(f'frame {counter}')
            if before == 0:
                assert slot is None and pool.num_free == 0
            else:
                assert slot is not None and slot not in held
                held[slot] = [f'frame {counter}']
        elif held:
            slot = sorted(held)[pick % len(held)]
            if op == 'adopt':
                pool.retain(slot, f'request {counter}')
                held[slot].append(f'request {counter}')
            else:
                holder = held[slot].pop(pick % len(held[slot]))
                freed = pool.release(slot, holder)
                assert freed == (not held[slot])
                if freed:
                    del held[slot]
        pool.check()
        assert pool.num_in_use == len(held) <= num_slots
        assert pool.bytes_in_use == len(held) * pool.bytes_per_slot
        assert {s: list(h) for s, h in held.items()} == pool.usage()['holders']
    for slot, holders in list(held.items()):
        for holder in holders:
            pool.release(slot, holder)
    assert pool.num_in_use == 0 and pool.bytes_in_use == 0
    pool.check()
