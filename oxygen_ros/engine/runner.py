"""ModelRunner: owns every tensor of the engine and executes the scheduler's plans.

It holds the KVStore (prefix slots with their state: valid mask, n_valid, last hidden; and the
generation blocks of the language requests) and is the one place where slot and block ids
become tensor indices and the model is called. Every model call is timed here (with a device
sync on CUDA, so the clock sees the work), which is how the engine tells model time from its
own overhead.

Decode batches keep the cache readable as a view and the shapes static where asked:
  * holes: rows on blocks 3, 4, 6 run as 3, 4, 5, 6 with a padding row on 5, so the model reads
    one run of blocks (a view) instead of gathering them; a padding row writes only the
    block's scratch entry (see kv/store.py) and its logits are dropped. The rows' prefix slots
    are a view too when they form a run (one task: slots follow blocks), else one gather.
  * buckets (optional, for CUDA graphs / torch.compile): the batch is padded to the next
    bucket size with padding rows, so a step has one of a few static shapes.
Slot and block ids, lengths and tokens enter the device as one [4, B] copy into a persistent
buffer; per-slot prefix state is read on the device by index, so nothing inside a step waits on the
host. The step's one sync is reading back the next token ids, which the scheduler needs.

Shapes: B rows of a decode batch (padding rows included), P prefix positions, W backbone
width, H action rows, A action width (storage letters as in kv/store.py).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from oxygen_ros.kv import KVStore
from oxygen_ros.model import rtc
from oxygen_ros.model.pi05 import (attend_bucket, extend_bucket, KVTensors, Pi05Model,
                                   PrefixCache)

MODEL_CALLS = ('prefill', 'action', 'decode')


class Runner(Protocol):
    """What the engine needs of a model runner (ModelRunner, or a fake one in tests)."""

    seconds: dict[str, float]     # model time per call kind (MODEL_CALLS) since reset_times()
    last_call_s: float            # duration of the latest call
    action_shape: tuple[int, int]  # (H, A) of the action chunk

    def reset_times(self) -> None:
        """Start a new frame's model-time accounting."""

    def prefill(self, tensors: dict, slot: int) -> None:
        """Write an observation's prefix K/V and prefix state into `slot`."""

    def sample_actions(self, slot: int, noise: np.ndarray,
                       plan: rtc.RowPlan | None = None) -> np.ndarray:
        """Return normalised actions [H, A] from the prefix in `slot` (plan: RTC inpainting)."""

    def prefill_rows(self, rows: list[dict], slots: list[int]) -> None:
        """Write several observations' prefixes (row b into slots[b]) in one model call."""

    def sample_actions_rows(self, slots: list[int], noise: np.ndarray,
                            plans: Sequence[rtc.RowPlan | None] | None = None) -> np.ndarray:
        """Return normalised actions [B, H, A] from the prefixes in `slots` (noise [B, H, A])."""

    def first_tokens(self, slots: list[int]) -> list[int]:
        """Return each slot's first generated token (from its prefix)."""

    def decode(self, slots: list[int], blocks: list[int], gen_lens: list[int],
               tokens: list[int]) -> list[int]:
        """Run one batched decode step (row b: prefix slot slots[b], its block blocks[b])."""

    def extend(self, slots: list[int], blocks: list[int], gen_lens: list[int],
               prompts: list[list[int]]) -> list[int]:
        """Feed each row's prompts[b] in one pass; return the token after each row's last."""


def padded_rows(slots: Sequence[int], num_slots: int, max_holes: int,
                bucket_sizes: Sequence[int] = ()) -> tuple[list[int], list[int]]:
    """Lay out a decode batch: (slot of every padded row, padded row index of each real row).

    slots: ascending, distinct. Holes inside the run of slots become padding rows when at most
    `max_holes` of them; then the batch grows to the smallest bucket that holds it (if any),
    with padding rows on slots next to the run where the pool has them, so it stays a run.
    """
    rows = list(slots)
    real = list(range(len(slots)))
    span = slots[-1] - slots[0] + 1
    if 0 < span - len(slots) <= max_holes:
        rows = list(range(slots[0], slots[-1] + 1))
        real = [s - slots[0] for s in slots]
    target = min((b for b in bucket_sizes if b >= len(rows)), default=len(rows))
    need = target - len(rows)
    if need and rows == list(range(rows[0], rows[0] + len(rows))):
        after = list(range(rows[-1] + 1, min(num_slots, rows[-1] + 1 + need)))
        num_before = min(need - len(after), rows[0])
        before = list(range(rows[0] - num_before, rows[0]))
        real = [i + num_before for i in real]
        rows = before + rows + after
        need -= len(before) + len(after)
    rows += [rows[0]] * need    # past the pool's size: a repeat, any slot will do
    return rows, real


class ModelRunner:
    """Runs prefill / sample_actions / first tokens / decode steps against its KVStore.

    max_holes_per_row: holes filled per real row of a decode batch (see padded_rows); 0 turns
    hole filling off. bucket_sizes: pad decode batches to these sizes (GPU capture); () = off.
    num_blocks: generation blocks (None: one per prefix slot).
    Compiled passes (engine/prepare.py) are the model's; `warm_up_compiled` runs every shape
    this runner will use before the first tick.
    kv_dtype: dtype of the KV store (None: the model's compute dtype). bfloat16 on a float32
    model halves the pool; K/V are rounded when written and widened when read (the action
    path widens a frame's prefix once per frame, a decode step the rows it reads).
    """

    def __init__(self, model: Pi05Model, num_slots: int, max_gen_len: int, *,
                 clock: Callable[[], float] = time.perf_counter,
                 max_holes_per_row: float = 0.25, bucket_sizes: Sequence[int] = (),
                 kv_dtype: torch.dtype | None = None, num_blocks: int | None = None):
        cfg = model.config
        backbone = cfg.backbone
        device = next(model.parameters()).device
        # Inference only: RTC's guided steps differentiate w.r.t. the actions, never the
        # weights; frozen weights keep autograd from recording them (measured: the guided
        # denoise 2.3x -> 2.0x the plain one, pi05-cpu, one thread).
        model.requires_grad_(False)
        self.model = model
        self.store = KVStore(backbone.depth, num_slots, cfg.prefix_len, max_gen_len,
                             backbone.num_kv_heads, backbone.head_dim, backbone.width,
                             dtype=kv_dtype or model.compute_dtype, device=device,
                             num_blocks=num_blocks)
        self.kv = KVTensors(self.store.k, self.store.v)   # views of the store, no copy
        self.gen = KVTensors(self.store.gen_k, self.store.gen_v)
        self.clock = clock
        self.device = device
        self.max_holes_per_row = max_holes_per_row
        self.bucket_sizes = tuple(sorted(bucket_sizes))
        # Persistent device inputs (slots, gen_len, tokens) of a decode step: fixed addresses
        # for graph capture; on the CPU the host tensor is used as it is.
        max_rows = max((self.store.num_blocks,) + self.bucket_sizes)
        self._step_inputs = torch.zeros(4, max_rows, dtype=torch.long, device=device)
        self.seconds = dict.fromkeys(MODEL_CALLS, 0.0)   # model time since reset_times()
        # A fleet's row threads call the runner at once: each reads its own latest call.
        self._calls = threading.local()
        self._seconds_lock = threading.Lock()

    @property
    def action_shape(self) -> tuple[int, int]:
        """(H, A): rows and width of the model's action chunk (the noise's shape)."""
        cfg = self.model.config
        return cfg.action_horizon, cfg.action_dim

    def reset_times(self) -> None:
        self.seconds = dict.fromkeys(MODEL_CALLS, 0.0)

    @property
    def model_seconds(self) -> float:
        return sum(self.seconds.values())

    @property
    def last_call_s(self) -> float:
        """Duration of this thread's latest model call."""
        return getattr(self._calls, 'seconds', 0.0)

    def _add(self, call: str, start: float) -> None:
        seconds = self._calls.seconds = self.clock() - start
        with self._seconds_lock:
            self.seconds[call] += seconds

    def _sync(self) -> None:
        if self.device.type == 'cuda':
            torch.cuda.synchronize(self.device)

    def _prefix(self, slot: int) -> PrefixCache:
        """Return the prefix of one slot as the model's PrefixCache (views of the store)."""
        s = self.store
        one = slice(slot, slot + 1)
        return PrefixCache(self.kv, s.slot_ids[one], s.prefix_valid[one], s.n_valid[one],
                           s.last_hidden[one], s.prefix_len)

    # ---- the action path ---------------------------------------------------------------------

    def prefill(self, tensors: dict[str, torch.Tensor], slot: int) -> None:
        """Write one observation's prefix K/V and prefix state into `slot`."""
        start = self.clock()
        prefix = self.model.prefill(**tensors, kv=self.kv,
                                    slots=self.store.slot_ids[slot:slot + 1])
        self.store.record_prefix(slot, prefix.valid[0], prefix.n_valid[0],
                                 prefix.last_hidden[0])
        self._sync()
        self._add('prefill', start)

    def _inpainting(self, plans: Sequence[rtc.RowPlan | None] | None) -> rtc.Inpainting | None:
        """One RTC plan per row -> the model's Inpainting (None: plain flow matching)."""
        if not plans:
            return None
        return rtc.Inpainting.from_rows(plans, *self.action_shape, device=self.device)

    def sample_actions(self, slot: int, noise: np.ndarray,
                       plan: rtc.RowPlan | None = None) -> np.ndarray:
        """Flow matching from `noise` [H, A] over the prefix in `slot` -> float32 [H, A].

        plan: real-time chunking of this row (model/rtc.py), on the same prefix K/V.
        """
        start = self.clock()
        noise_t = torch.from_numpy(noise)[None].to(self.device)           # [1, H, A]
        actions = self.model.sample_actions(self._prefix(slot), noise_t,
                                            inpaint=self._inpainting([plan]))[0]
        out = actions.to('cpu', torch.float32).numpy()                      # syncs
        self._add('action', start)
        return out

    # ---- the action path of several robots (FleetEngine) -------------------------------------

    def _slot_index(self, slots: list[int]) -> torch.Tensor:
        """Slot ids as a device tensor: a view of store.slot_ids for a run, else one copy."""
        if slots == list(range(slots[0], slots[0] + len(slots))):
            return self.store.slot_ids[slots[0]:slots[0] + len(slots)]
        return torch.tensor(slots, dtype=torch.long).to(self.device)

    def prefill_rows(self, rows: list[dict[str, torch.Tensor]], slots: list[int]) -> None:
        """One prefill over B observations: rows[b] (prepared tensors, 1 row each) -> slots[b]."""
        assert len(rows) == len(slots) and len(set(slots)) == len(slots), (len(rows), slots)
        start = self.clock()
        tensors = {key: torch.cat([row[key] for row in rows]) for key in rows[0]}   # [B, ...]
        prefix = self.model.prefill(**tensors, kv=self.kv, slots=self._slot_index(slots))
        for b, slot in enumerate(slots):
            self.store.record_prefix(slot, prefix.valid[b], prefix.n_valid[b],
                                     prefix.last_hidden[b])
        self._sync()
        self._add('prefill', start)

    def sample_actions_rows(self, slots: list[int], noise: np.ndarray,
                            plans: Sequence[rtc.RowPlan | None] | None = None) -> np.ndarray:
        """One flow matching over B prefixes: noise [B, H, A] -> float32 actions [B, H, A].

        plans: real-time chunking per row (None entries: free rows), in `slots` order.
        """
        assert noise.shape[0] == len(slots), (noise.shape, slots)
        start = self.clock()
        s = self.store
        index = self._slot_index(slots)
        prefix = PrefixCache(self.kv, index, s.prefix_valid.index_select(0, index),
                             s.n_valid.index_select(0, index),
                             s.last_hidden.index_select(0, index), s.prefix_len)
        noise_t = torch.from_numpy(noise).to(self.device)                  # [B, H, A]
        actions = self.model.sample_actions(prefix, noise_t, inpaint=self._inpainting(plans))
        out = actions.to('cpu', torch.float32).numpy()                      # syncs
        self._add('action', start)
        return out

    # ---- the language path -------------------------------------------------------------------

    @torch.no_grad()
    def first_tokens(self, slots: list[int]) -> list[int]:
        """Greedy first generated token of each slot, from its prefix's last hidden state."""
        start = self.clock()
        index = torch.tensor(slots, dtype=torch.long).to(self.device)
        hidden = self.store.last_hidden.index_select(0, index)              # [B, W]
        tokens = self.model.lm_logits(hidden).argmax(-1).tolist()           # syncs
        self._add('decode', start)
        return tokens

    @torch.no_grad()
    def decode(self, slots: list[int], blocks: list[int], gen_lens: list[int],
               tokens: list[int]) -> list[int]:
        """One batched decode step (blocks ascending); greedy next token of every row.

        Row b reads the prefix in slots[b] (rows of one frame share it) and its own
        generation block blocks[b].
        """
        start = self.clock()
        s = self.store
        max_holes = int(self.max_holes_per_row * len(blocks))
        rows, real = padded_rows(blocks, s.num_blocks, max_holes, self.bucket_sizes)
        fill = {i: (slot, g, t) for i, slot, g, t in zip(real, slots, gen_lens, tokens)}
        # Padding rows read some prefix (the slot of their block's number where there is one,
        # so a run of slots stays a run), write their block's scratch entry, feed token 0;
        # their logits are dropped.
        pad = [fill.get(i, (b if b < s.num_slots else slots[0], s.scratch_gen_len, 0))
               for i, b in enumerate(rows)]
        # A static attend length from the host's ints (a few buckets: few graphs, no sync);
        # at most max_gen_len, so no real row ever reads the scratch entry padding writes.
        attend_len = attend_bucket(max(gen_lens) + 1, s.max_gen_len)
        best = self._step([p[0] for p in pad], rows, [p[1] for p in pad],
                          [p[2] for p in pad], attend_len)
        every = best.tolist()                                                # syncs
        self._add('decode', start)
        return [every[i] for i in real]

    @torch.no_grad()
    def extend(self, slots: list[int], blocks: list[int], gen_lens: list[int],
               prompts: list[list[int]]) -> list[int]:
        """One extend pass (blocks ascending): row b feeds prompts[b] into block blocks[b].

        Rows are right-padded to the longest prompt rounded up to extend_bucket (the padding
        writes the block's scratch entry), so a compiled pass sees a few prompt lengths;
        returns the greedy token after each row's last prompt token. Timed as language
        ('decode').
        """
        start = self.clock()
        s = self.store
        Q = extend_bucket(max(map(len, prompts)))
        tokens = torch.tensor([p + [0] * (Q - len(p)) for p in prompts], dtype=torch.long)
        n_tokens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        gen_len = torch.tensor(gen_lens, dtype=torch.long)
        attend_len = attend_bucket(int((gen_len + n_tokens).max()), s.max_gen_len)
        slot_index = torch.tensor(slots, dtype=torch.long).to(self.device)
        block_index = torch.tensor(blocks, dtype=torch.long)
        logits = self.model.extend_step(
            self.kv, slot_index, s.prefix_valid.index_select(0, slot_index),
            s.n_valid.index_select(0, slot_index), gen_len, tokens, n_tokens, gen=self.gen,
            blocks=block_index, attend_len=attend_len)                       # [B, vocab]
        out = logits.argmax(-1).tolist()                                     # syncs
        self._add('decode', start)
        return out

    def _step(self, slots: list[int], blocks: list[int], gen_lens: list[int],
              tokens: list[int], attend_len: int) -> torch.Tensor:
        """Run the model's decode step on padded rows -> greedy token ids [B] (no sync).

        Row b: prefix slot slots[b], generation block blocks[b].
        """
        s = self.store
        if self.device.type == 'cpu':
            # Four tensors, not rows of one: a compiled step would guard on the rows'
            # storage offsets (2B coinciding with a pool size once made every B recompile).
            slot_index, block_index, gen_len, fed = (
                torch.tensor(values, dtype=torch.long)
                for values in (slots, blocks, gen_lens, tokens))
        else:
            host = torch.tensor([slots, blocks, gen_lens, tokens], dtype=torch.long)  # [4, B]
            inputs = self._step_inputs[:, :len(blocks)]
            inputs.copy_(host, non_blocking=True)
            slot_index, block_index, gen_len, fed = inputs
        prefix_valid = s.prefix_valid.index_select(0, slot_index)           # [B, P]
        n_valid = s.n_valid.index_select(0, slot_index)                     # [B]
        decode_step = self.model.decode_step   # looked up per call: tests may wrap it
        return decode_step(self.kv, slot_index, prefix_valid, n_valid, gen_len, fed,
                           attend_len=attend_len, gen=self.gen, blocks=block_index,
                           greedy=True)                                      # [B]

    @torch.no_grad()
    def warm_up_compiled(self, action_rows: Sequence[int] = (1,),
                         frames: Sequence[dict] = (), prompt_len: int = 0,
                         prompt_rows: Sequence[int] = (1, 2)) -> None:
        """Run each compiled pass once per shape this runner will use (at configure).

        Prefill: each of `frames` (prepared tensors of the robots' frames: their camera count
        and prompt; the number of valid positions is dynamic) into slot 0, a slot no request
        holds yet. Decode: batches of 1 and 2 rows (2: the one graph every B > 1 shares) at
        the smallest and largest attend length, every row on its generation block's scratch
        entry (nothing real is written). Extend: passes of `prompt_rows` rows (2: the graph
        every B > 1 shares) at the shortest prompt and at `prompt_len` (the longest a request
        feeds; 0: no task has a template, no pass), into blocks no request holds yet (a
        request writes its entries before it reads them). Actions: `action_rows` prefixes (1
        for one robot; a fleet adds 2). A GPU pool is marked static first, so its CUDA graphs
        read it in place.
        """
        model, s = self.model, self.store
        if self.device.type == 'cuda':
            for tensor in (s.k, s.v, s.gen_k, s.gen_v):
                torch._dynamo.mark_static_address(tensor)
        if model._prefill_fn is not None:
            for tensors in frames:
                self.prefill(tensors, 0)
        if model._decode_fn is not None:
            lengths = sorted({attend_bucket(1, s.max_gen_len),
                              attend_bucket(s.max_gen_len, s.max_gen_len)})
            sizes = sorted({min(size, s.num_blocks) for size in (1, 2)} | set(self.bucket_sizes))
            for B in sizes:   # a bucket larger than the pool repeats blocks, as decode pads
                blocks = [row % s.num_blocks for row in range(B)]
                slots = [row % s.num_slots for row in range(B)]
                for attend_len in lengths:
                    self._step(slots, blocks, [s.scratch_gen_len] * B, [0] * B, attend_len)
        prompt_len = min(prompt_len, s.max_gen_len)
        if model._extend_fn is not None and prompt_len >= 2:
            for B in sorted({min(rows, s.num_blocks) for rows in prompt_rows}):
                # Longest first: a first trace at 8 tokens where the pool has 8 slots would tie
                # the two sizes (dynamo's duck sizing) and cost a second trace.
                for n in sorted({2, prompt_len}, reverse=True):
                    self.extend([row % s.num_slots for row in range(B)], list(range(B)),
                                [0] * B, [[0] * n] * B)
        if model._denoise_fn is not None:
            H, A = self.action_shape
            for rows in sorted({min(r, s.num_slots) for r in action_rows}):
                noise = np.zeros((rows, H, A), np.float32)
                if rows == 1:   # the one-robot engine's own path
                    self.sample_actions(0, noise[0])
                else:
                    self.sample_actions_rows(list(range(rows)), noise)
        self._sync()
        self.reset_times()
