"""KV pool, request state and batch/unbatch with plain tensors (no model)."""

from hypothesis import given, settings, strategies as st
import pytest
import torch

from oxygen_ros.kv import build_decode_batch, KVPool, RequestState, unbatch

L, P, G, KVH, D = 2, 6, 4, 1, 8    # layers, prefix len, generated capacity, kv heads, head dim


def make_pool(num_slots=3):
    return KVPool(L, num_slots, P, G, KVH, D)


def test_pool_shapes_and_bytes():
    pool = make_pool(3)
    assert pool.k.shape == (L, 3, P + G, KVH, D) == pool.v.shape
    assert pool.prefix_valid.shape == (3, P) and pool.prefix_valid.dtype == torch.bool
    per_slot = 2 * L * (P + G) * KVH * D * 4 + P
    assert pool.bytes_per_slot == per_slot
    assert pool.total_bytes == 3 * per_slot
    assert pool.bytes_in_use == 0 and pool.num_free == 3


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
    pool.set_prefix_valid(slot, torch.tensor([True] * 4 + [False] * 2))
    pool.retain(slot, 'request 0')                 # the request adopts the frame's slot
    assert pool.refcount(slot) == 2
    assert pool.release(slot, 'frame 0') is False  # still held by the request
    assert pool.num_in_use == 1
    assert pool.prefix_valid[slot].sum() == 4      # the request still needs the mask
    assert pool.release(slot, 'request 0') is True
    assert pool.num_in_use == 0 and pool.bytes_in_use == 0
    assert not pool.prefix_valid[slot].any()       # reset on free
    assert pool.peak_slots_in_use == 1
    pool.check()


def test_misuse_is_caught():
    pool = make_pool(2)
    slot = pool.allocate('frame 0')
    with pytest.raises(AssertionError):
        pool.release(slot, 'request 9')            # not a holder
    with pytest.raises(AssertionError):
        pool.retain(slot, 'frame 0')               # already a holder
    pool.release(slot, 'frame 0')
    with pytest.raises(AssertionError):
        pool.release(slot, 'frame 0')              # double release
    with pytest.raises(AssertionError):
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
    req = RequestState(0, slot=1, origin_frame=3, n_valid=5, prefix_len=P, max_new_tokens=3,
                       eos_id=1)
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
    req = RequestState(1, slot=0, origin_frame=0, n_valid=5, prefix_len=P, max_new_tokens=5,
                       eos_id=1, forced=[40, 41])
    assert not req.needs_prefix_token              # the template is fed first
    assert req.kv_entries_needed == 2 + 4
    assert req.next_input_token() == 40
    req.accept_decode_step(99)                     # logits after a non-final forced token
    assert req.token_ids == [] and req.next_input_token() == 41
    req.accept_decode_step(12)                     # logits after the last forced token
    assert req.token_ids == [12] and req.next_input_token() == 12
    req.accept_decode_step(1)
    assert req.finished and req.finish_reason == 'eos' and req.token_ids == [12, 1]
    with pytest.raises(AssertionError):
        req.finish('tired')


def _live_request(rid, slot, n_valid, gen_len, last):
    req = RequestState(rid, slot=slot, origin_frame=rid, n_valid=n_valid, prefix_len=P,
                       max_new_tokens=G + 1, eos_id=None)
    req.accept_prefix_token(last)
    for _ in range(gen_len):
        req.accept_decode_step(last)
    return req


def test_batch_is_indices_not_copies():
    pool = make_pool(4)
    slots = [pool.allocate(f'request {i}') for i in range(3)]
    for slot, n in zip(slots, (2, 6, 4)):
        pool.set_prefix_valid(slot, torch.arange(P) < n)
    reqs = [_live_request(0, slots[2], 4, 0, 11), _live_request(1, slots[0], 2, 3, 12),
            _live_request(2, slots[1], 6, 1, 13)]
    k_ptr = pool.k.data_ptr()
    batch = build_decode_batch(pool, reqs)
    assert batch.request_ids == [0, 1, 2]
    assert batch.slots.tolist() == [slots[2], slots[0], slots[1]]
    assert batch.n_valid.tolist() == [4, 2, 6] and batch.gen_len.tolist() == [0, 3, 1]
    assert batch.tokens.tolist() == [11, 12, 13]
    assert batch.prefix_valid.sum(-1).tolist() == [4, 2, 6]
    assert all(t.dtype == torch.long for t in (batch.slots, batch.n_valid, batch.gen_len))
    assert pool.k.data_ptr() == k_ptr              # nothing moved in the pool
    unbatch(batch, reqs, [21, 22, 23])
    assert [r.token_ids[-1] for r in reqs] == [21, 22, 23]
    assert [r.gen_len for r in reqs] == [1, 4, 2]
    with pytest.raises(AssertionError):
        unbatch(batch, reqs[::-1], [1, 2, 3])      # row order must match


def test_batch_refuses_overflowing_request():
    pool = make_pool(1)
    slot = pool.allocate('request 0')
    req = _live_request(0, slot, 3, G, 5)          # G entries written: storage is full
    with pytest.raises(AssertionError):
        build_decode_batch(pool, [req])


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
