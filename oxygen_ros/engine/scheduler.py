"""The OxyGen frame scheduler: one prefill per frame, shared by actions and language.

One frame, in the order the work happens (the ROS node publishes between 1 and 2):

    1. act(obs)            prefill(obs) -> slot s_t of the pool       (frame holds s_t)
                           sample_actions(s_t) -> actions             returned at once
    2. advance_language()  admission: a request starting at t adopts s_t (zero copy),
                           otherwise s_t is released
                           budget: k token steps per live request (fixed or adaptive)
                           ONE batched decode_step per token step over all live requests,
                           whatever frame they started at (ragged n_valid / gen_len)
                           finished requests (eos / length) release their slots

The scheduler thinks in ids and counters; tensors appear only inside the ModelRunner. Under
pressure language gives way, never the action path: the frame's slot is taken by evicting the
oldest request if it must be, and a failing decode step ends only the requests in that step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Callable

from oxygen_ros.engine.budget import AdaptiveBudget, FixedBudget
from oxygen_ros.engine.frontend import Frontend, PreparedObservation
from oxygen_ros.engine.runner import ModelRunner
from oxygen_ros.engine.types import (ActionOutput, FinishedRequest, FrameResult, Observation,
                                     TokenDelta, Timings)
from oxygen_ros.engine.workload import default_num_slots, frame_noise, LanguagePolicy
from oxygen_ros.kv import build_decode_batch, KVPool, RequestState, unbatch
from oxygen_ros.model.pi05 import Pi05Model, PrefixCache

logger = logging.getLogger(__name__)

PRESSURE_POLICIES = ('evict_oldest', 'refuse_new')
DEFAULT_MAX_FORCED_TOKENS = 32   # storage reserved per slot for a prompt template's tokens


@dataclasses.dataclass
class _Frame:
    """Bookkeeping of the frame between act() and advance_language()."""

    index: int
    instruction: str
    prepared: PreparedObservation
    started: float                      # clock() when act() began (the frame's deadline origin)
    act_s: float = 0.0                  # wall time of act()
    slot: int | None = None             # frame slot, held as 'frame {index}' until admission
    prefix: PrefixCache | None = None   # views of the frame slot + last hidden state
    action: ActionOutput | None = None  # what act() returned


class Scheduler:
    """System 'oxygen': cross-task KV sharing + cross-frame continuous batching.

    budget: FixedBudget(k) (the paper), AdaptiveBudget(period) (deadline-driven), or None
    (every request decodes to completion in its first frame: the 'shared' baseline).
    """

    system = 'oxygen'

    def __init__(self, model: Pi05Model, frontend: Frontend, policy: LanguagePolicy,
                 budget: FixedBudget | AdaptiveBudget | None = None, *,
                 num_slots: int | None = None, pressure: str = 'evict_oldest', seed: int = 0,
                 max_forced_tokens: int | None = None, debug: bool = False,
                 clock: Callable[[], float] = time.perf_counter):
        if pressure not in PRESSURE_POLICIES:
            raise ValueError(f'pressure must be one of {PRESSURE_POLICIES}, got {pressure!r}')
        cfg = model.config
        self.model = model
        self.frontend = frontend
        self.policy = policy
        self.budget = budget
        self.pressure = pressure
        self.seed = seed
        self.debug = debug
        self.clock = clock
        if max_forced_tokens is None:
            max_forced_tokens = DEFAULT_MAX_FORCED_TOKENS if policy.prompt_template else 0
        self.max_forced_tokens = max_forced_tokens
        # A request writes forced + N - 1 entries after the prefix (its last token is not fed).
        max_gen_len = max_forced_tokens + policy.max_request_len - 1
        param = next(model.parameters())
        self.pool = KVPool(cfg.backbone.depth, num_slots or self.default_num_slots(),
                           cfg.prefix_len, max_gen_len, cfg.backbone.num_kv_heads,
                           cfg.backbone.head_dim, dtype=model.compute_dtype,
                           device=param.device)
        self.runner = ModelRunner(model, self.pool, clock)
        self.active: list[RequestState] = []     # live requests, oldest first
        self._first_hidden = {}                  # request id -> [1, W] prefix last hidden state
        self._ended: list[RequestState] = []     # ended since the last advance_language()
        self._frame: _Frame | None = None
        self._queued = 0                         # arrived requests waiting for a frame
        self._next_frame_index = 0
        self._next_request_id = 0
        self._last_frame_index = -1
        self._frontend_s = 0.0                   # frontend time since the frame began
        self.last_result: FrameResult | None = None

    # ---- sizing --------------------------------------------------------------------------

    def default_num_slots(self) -> int:
        """ceil(N/k) + 1 requests + 1 frame slot + 1 spare (k = 1 for an adaptive budget)."""
        if self.budget is None:
            return 2
        return default_num_slots(self.policy, self.budget.k if isinstance(
            self.budget, FixedBudget) else 1)

    def _unlimited_k(self) -> int:
        """Token steps that finish any request in one frame (forced tokens included)."""
        return self.pool.max_gen_len + 1

    # ---- 1. the action path ------------------------------------------------------------------

    def act(self, obs: Observation) -> ActionOutput:
        """Prefill the observation into a pool slot and compute its actions; no language work.

        Raises ValueError for a malformed observation (nothing allocated); the action path
        always gets a slot, evicting the oldest language request if the pool is full.
        """
        frame = self._begin_frame(obs)
        normalized, actions = self._action_task(frame)
        frame.act_s = self.clock() - frame.started
        self._frame = frame
        if self.budget is not None:
            self.budget.observe_action(frame.act_s)
        frame.action = ActionOutput(frame.index, actions, normalized, frame.act_s, obs.stamp)
        return frame.action

    def _begin_frame(self, obs: Observation) -> _Frame:
        started = self.clock()
        if self._frame is not None:
            # act() twice without advance_language(): the earlier frame gets no language.
            logger.warning('frame %d: act() called again before advance_language(); frame %d '
                           'starts no request', self._frame.index, self._frame.index)
            self._drop_frame(self._frame)
            self._frame = None
        self.runner.reset_times()
        self._frontend_s = 0.0
        index = self._next_frame_index if obs.frame_index is None else int(obs.frame_index)
        with self._frontend_clock():
            prepared = self.frontend.prepare(obs)    # may raise: nothing is held yet
        self._next_frame_index = index + 1
        self._last_frame_index = index
        return _Frame(index, obs.instruction, prepared, started)

    def _action_task(self, frame: _Frame):
        """Prefill into a fresh slot, denoise; the frame keeps holding the slot."""
        holder = f'frame {frame.index}'
        frame.slot = self._allocate(holder)
        try:
            frame.prefix = self.runner.prefill(frame.prepared.tensors, frame.slot)
            cfg = self.model.config
            noise = frame_noise(self.seed, frame.index, cfg.action_horizon, cfg.action_dim)
            normalized = self.runner.sample_actions(frame.prefix, noise)   # [H, A]
            with self._frontend_clock():
                actions = self.frontend.robot_actions(normalized, frame.prepared)
        except BaseException:
            self.pool.release(frame.slot, holder)
            frame.slot = frame.prefix = None
            raise
        return normalized, actions

    def _allocate(self, holder: str) -> int:
        """Take a slot for `holder`, evicting the oldest language requests if the pool is full."""
        slot = self.pool.allocate(holder)
        while slot is None and self.active:
            victim = self.active[0]
            logger.warning('KV pool full: evicting request %d (frame %d, %d tokens) for %s',
                           victim.request_id, victim.origin_frame, len(victim.token_ids), holder)
            self._end(victim, 'evicted')
            slot = self.pool.allocate(holder)
        if slot is None:
            raise RuntimeError(f'KV pool has no slot for {holder} and no request to evict:\n'
                               f'{self.pool}')
        return slot

    def _drop_frame(self, frame: _Frame) -> None:
        if frame.slot is not None:
            self.pool.release(frame.slot, f'frame {frame.index}')
            frame.slot = frame.prefix = None

    # ---- 2. the language path -----------------------------------------------------------------

    def advance_language(self) -> FrameResult:
        """Admit this frame's request, run the frame's batched decode steps, release finished.

        Returns the frame's FrameResult (also kept in `self.last_result`). Without a preceding
        act() it just advances the live requests (no new request).
        """
        start = self.clock()
        frame, self._frame = self._frame, None
        if frame is None:
            self.runner.reset_times()
            self._frontend_s = 0.0
        else:
            self._admit(frame)
        live_before = list(self.active)
        if self.budget is None:
            k, reported_k = self._unlimited_k(), self.policy.max_request_len
        else:
            elapsed = self.clock() - (frame.started if frame else start)
            k = reported_k = self.budget.choose(elapsed, len(self.active))
        batch_sizes = self._token_steps(k, frame.started if frame else start)
        for req in [r for r in self.active if r.finished]:
            self._end(req, req.finish_reason)
        deltas, finished = self._report(live_before)
        total_s = (frame.act_s if frame else 0.0) + self.clock() - start
        self._record(frame, reported_k, batch_sizes, deltas, finished, total_s)
        if self.debug:
            self.check()
        return self.last_result

    def step(self, obs: Observation) -> FrameResult:
        """act() then advance_language(): one whole frame."""
        self.act(obs)
        return self.advance_language()

    # ---- the System protocol's controls ---------------------------------------------------------

    @property
    def num_live_requests(self) -> int:
        """Language requests still running (they advance even on a tick without a frame)."""
        return len(self.active)

    def set_budget(self, budget: FixedBudget | AdaptiveBudget | None) -> None:
        """Use `budget` from the next frame on (the pool keeps its size)."""
        self.budget = budget

    def set_policy(self, policy: LanguagePolicy) -> None:
        """Use `policy` for requests that arrive from the next frame on."""
        self.policy = policy

    def close(self) -> None:
        """Release nothing held outside this process (present for the System protocol)."""

    def _admit(self, frame: _Frame) -> None:
        """Queue this frame's arrivals; start at most one request, on this frame's cache."""
        arrivals = self.policy.arrivals(frame.index)
        accepted = min(arrivals, self.policy.max_queue - self._queued)
        self._queued += accepted
        for _ in range(arrivals - accepted):
            self._refuse(frame, 'request queue full')
        if self._queued:
            self._queued -= 1
            self._start_request(frame)
        self._drop_frame(frame)

    def _start_request(self, frame: _Frame) -> None:
        """Start a request on the frame's slot (adopted: its prefix is already there)."""
        if self.pressure == 'refuse_new' and self.pool.num_free < 1:
            # Adopting would leave no slot for the next frame's action path.
            self._refuse(frame, f'KV pool full ({self.pool.num_in_use}/{self.pool.num_slots})')
            return
        req = self._new_request(frame, frame.slot, frame.prefix)
        self.pool.retain(frame.slot, f'request {req.request_id}')

    def _new_request(self, frame: _Frame, slot: int | None, prefix: PrefixCache | None,
                     request_id: int | None = None) -> RequestState:
        """Create the request σ of this frame; it is live (in self.active) iff it has a prefix."""
        with self._frontend_clock():
            forced = self.frontend.encode_text(self.policy.prompt_text(frame.instruction))
        if len(forced) > self.max_forced_tokens:
            logger.warning('prompt template has %d tokens, keeping the first %d',
                           len(forced), self.max_forced_tokens)
            forced = forced[:self.max_forced_tokens]
        req = RequestState(
            request_id=self._take_request_id() if request_id is None else request_id,
            slot=slot, origin_frame=frame.index,
            n_valid=int(prefix.n_valid[0]) if prefix is not None else 0,
            prefix_len=self.pool.prefix_len,
            max_new_tokens=self.policy.request_len(frame.index), eos_id=self.policy.eos_id,
            forced=forced)
        if prefix is not None:
            self._first_hidden[req.request_id] = prefix.last_hidden    # [1, W]
            self.active.append(req)
        return req

    def _refuse(self, frame: _Frame, why: str) -> None:
        req = self._new_request(frame, None, None)
        logger.warning('request %d (frame %d) refused: %s', req.request_id, frame.index, why)
        req.finish('refused', why)
        self._ended.append(req)

    def _take_request_id(self) -> int:
        rid = self._next_request_id
        self._next_request_id += 1
        return rid

    def _token_steps(self, k: int, frame_start: float) -> list[int]:
        """Advance every live request by up to k tokens; return the decode batch sizes.

        A request's first token comes from its prefix (LM head only) and counts as one of its
        k; every other token is one row of a batched decode_step.
        """
        quota = {r.request_id: k for r in self.active}
        for req in list(self.active):
            if req.needs_prefix_token and quota[req.request_id] > 0:
                try:
                    token = self.runner.first_token(self._first_hidden[req.request_id])
                except Exception as err:   # a language failure must not reach the action path
                    self._fail([req], err)
                    continue
                req.accept_prefix_token(token)
                quota[req.request_id] -= 1
                del self._first_hidden[req.request_id]
        batch_sizes = []
        while True:
            rows = [r for r in self.active if not r.finished and quota[r.request_id] > 0
                    and not r.needs_prefix_token]
            if not rows:
                return batch_sizes
            if batch_sizes and not self._budget_allows(frame_start, len(rows)):
                return batch_sizes
            # Slot order: consecutive slots let the model read the cache as a view.
            rows.sort(key=lambda r: r.slot)
            batch = build_decode_batch(self.pool, rows)
            try:
                next_tokens = self.runner.decode(batch)
            except Exception as err:   # a language failure must not reach the action path
                self._fail(rows, err)
                continue
            if self.budget is not None:
                self.budget.observe_decode(batch.size, self.runner.last_call_s)
            unbatch(batch, rows, next_tokens)
            for req in rows:
                quota[req.request_id] -= 1
            batch_sizes.append(batch.size)

    def _budget_allows(self, frame_start: float, batch_size: int) -> bool:
        if self.budget is None:
            return True
        return self.budget.allow_more(self.clock() - frame_start, batch_size)

    def _fail(self, requests: list[RequestState], err: Exception) -> None:
        ids = [r.request_id for r in requests]
        logger.error('language step failed for requests %s: %r', ids, err)
        for req in requests:
            self._end(req, 'error', repr(err))

    def _end(self, req: RequestState, reason: str, error: str = '') -> None:
        """Finish `req` (if not yet) and give its slot back."""
        req.finish(reason, error)
        if req.slot is not None:
            self.pool.release(req.slot, f'request {req.request_id}')
            req.slot = None
        if req in self.active:
            self.active.remove(req)
        self._first_hidden.pop(req.request_id, None)
        self._ended.append(req)

    # ---- 3. results -----------------------------------------------------------------------

    @contextlib.contextmanager
    def _frontend_clock(self):
        """Count the enclosed time as frontend work (conversion, not scheduling)."""
        start = self.clock()
        try:
            yield
        finally:
            self._frontend_s += self.clock() - start

    def _report(self, live_before: list[RequestState]):
        """Deltas of every request touched this frame, and the requests that ended."""
        with self._frontend_clock():
            return self._report_inner(live_before)

    def _report_inner(self, live_before: list[RequestState]):
        ended, self._ended = self._ended, []
        touched = {r.request_id: r for r in live_before}
        touched.update((r.request_id, r) for r in self.active)
        touched.update((r.request_id, r) for r in ended)
        deltas, finished = [], []
        for rid in sorted(touched):
            req = touched[rid]
            n_old = req.num_reported
            new = req.take_new_tokens()
            if not new and not req.finished:
                continue
            text = self.frontend.decode_delta(req.token_ids, n_old, final=req.finished)
            deltas.append(TokenDelta(rid, req.origin_frame, new, text, len(req.token_ids),
                                     req.finished, req.finish_reason))
        for req in sorted(ended, key=lambda r: r.request_id):
            finished.append(FinishedRequest(
                req.request_id, req.origin_frame, list(req.token_ids),
                self.frontend.decode(req.token_ids), req.finish_reason,
                self._last_frame_index - req.origin_frame + 1, req.error))
        return deltas, finished

    def _record(self, frame, k, batch_sizes, deltas, finished, total_s) -> None:
        seconds = self.runner.seconds
        timings = Timings(prefill_s=seconds['prefill'], action_s=seconds['action'],
                          decode_s=seconds['decode'], total_s=total_s,
                          act_s=frame.act_s if frame else 0.0, frontend_s=self._frontend_s)
        timings.overhead_s = max(total_s - timings.model_s, 0.0)
        self.last_result = FrameResult(
            frame_index=frame.index if frame else -1, action=frame.action if frame else None,
            deltas=deltas, finished=finished, k=k,
            decode_steps=len(batch_sizes), batch_sizes=batch_sizes,
            active_requests=len(self.active), timings=timings, kv_usage=self.pool.usage())

    # ---- invariants -------------------------------------------------------------------------

    def check(self) -> None:
        """Assert pool and request invariants (run after every frame in debug mode)."""
        self.pool.check()
        for req in self.active:
            assert not req.finished, f'finished request {req.request_id} still active'
            assert req.slot is not None
            assert self.pool.holders(req.slot) == (f'request {req.request_id}',), (
                f'request {req.request_id}: slot {req.slot} held by {self.pool.holders(req.slot)}')
            assert req.gen_len <= self.pool.max_gen_len
        slots = [r.slot for r in self.active]
        assert len(set(slots)) == len(slots), f'two requests share a slot: {slots}'
        if self._frame is None:
            # Between frames only live requests hold slots.
            assert self.pool.num_in_use == len(self.active), (
                f'leak: {self.pool.num_in_use} slots in use, {len(self.active)} requests\n'
                f'{self.pool}')
        assert self.pool.num_in_use <= self.pool.num_slots
        assert set(self._first_hidden) <= {r.request_id for r in self.active}

    def __str__(self) -> str:
        return (f'{self.system}: {len(self.active)} live requests, budget {self.budget}, '
                f'{self._queued} queued\n{self.pool}')
