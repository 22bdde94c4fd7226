"""Decode batches as indices into the pool: slot ids and per-row lengths, never cache copies.

A decode step over B requests needs, per row b: the slot to read and append to, which prefix
positions of that slot are real, the RoPE offset (n_valid), how many K/V entries were already
written after the prefix (gen_len) and the token to feed. Rows may come from different frames,
have different n_valid and different gen_len (ragged); the model handles each row on its own.
"""

from __future__ import annotations

import dataclasses

import torch

from oxygen_ros.kv.pool import KVPool
from oxygen_ros.kv.request import RequestState


@dataclasses.dataclass
class DecodeBatch:
    """Inputs of one batched decode step (B rows), plus the request ids in row order."""

    request_ids: list[int]       # row b belongs to request request_ids[b]
    slots: torch.Tensor          # long [B] (host)  pool slot of each row
    prefix_valid: torch.Tensor   # bool [B, P] (pool device)  pool.prefix_valid rows by slot
    n_valid: torch.Tensor        # long [B] (host)  real prefix positions of each row
    gen_len: torch.Tensor        # long [B] (host)  K/V entries already written after prefix
    tokens: torch.Tensor         # long [B] (host)  token fed at this step

    @property
    def size(self) -> int:
        return len(self.request_ids)


def build_decode_batch(pool: KVPool, requests: list[RequestState]) -> DecodeBatch:
    """Batch `requests` (all unfinished, each holding a slot) for one decode step."""
    assert requests, 'empty decode batch'
    slots, n_valid, gen_len, tokens = [], [], [], []
    for req in requests:
        assert req.slot is not None and not req.finished, f'request {req.request_id} not live'
        # Storage bound: the entry written now sits at P + gen_len and must fit in T.
        assert req.gen_len < pool.max_gen_len, (
            f'request {req.request_id}: gen_len {req.gen_len} >= pool max_gen_len '
            f'{pool.max_gen_len}')
        slots.append(req.slot)
        n_valid.append(req.n_valid)
        gen_len.append(req.gen_len)
        tokens.append(req.next_input_token())
    # Ids and lengths stay on the host: the model turns them into Python ints to index the
    # pool, and host tensors spare a device sync per step. The mask lives with the pool.
    slot_ids = torch.tensor(slots, dtype=torch.long)
    mask_index = slot_ids.to(pool.prefix_valid.device)
    return DecodeBatch(
        request_ids=[r.request_id for r in requests],
        slots=slot_ids,
        prefix_valid=pool.prefix_valid.index_select(0, mask_index),   # [B, P], bytes per row
        n_valid=torch.tensor(n_valid, dtype=torch.long),
        gen_len=torch.tensor(gen_len, dtype=torch.long),
        tokens=torch.tensor(tokens, dtype=torch.long),
    )


def unbatch(batch: DecodeBatch, requests: list[RequestState], next_tokens: list[int]) -> None:
    """Give row b's next token (argmax of its logits) back to its request."""
    assert len(next_tokens) == batch.size == len(requests)
    for rid, req, token in zip(batch.request_ids, requests, next_tokens):
        assert req.request_id == rid, f'row order changed: {req.request_id} != {rid}'
        req.accept_decode_step(token)
