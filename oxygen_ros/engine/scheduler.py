"""The scheduler: decides what the language path does, in slot ids and counters.

It owns the request states σ, the slot pool's ids and the decode budget, and nothing with a
tensor in it: the engine asks it for a plan, has the model runner execute the plan, and hands
the resulting token ids back (vLLM v1's schedule() / update_from_output(), smaller).

One frame, as the engine drives it:

    act            allocate_frame_slot(t) -> s_t   (evicts the oldest request if it must)
                   ... runner prefills s_t, computes actions ...
                   after_actions()                 (isolated: the action task lets s_t go)
    advance        begin_language()
                   admit(t, forced) -> Admission   a request starting at t adopts s_t (zero
                                                   copy) or, isolated, gets a slot of its own
                                                   to prefill; the frame's hold on s_t ends
                   choose_k(elapsed) -> k          k token steps per live request
                   schedule() -> StepPlan | None   first tokens (LM head on the prefix), then
                   update(plan, token_ids)         ONE batched decode step per token step
                   fail(plan, error)               over every live request, whatever frame
                   end_language() -> touched, ended    it started at

Under pressure language gives way, never the action path: the frame's slot is taken by
evicting the oldest request if it must be, and a failing step ends only its own rows.
"""

from __future__ import annotations

import dataclasses
import logging

from oxygen_ros.engine.budget import Budget
from oxygen_ros.engine.workload import LanguagePolicy
from oxygen_ros.kv import FinishReason, KVPool, RequestState

logger = logging.getLogger(__name__)

PRESSURE_POLICIES = ('evict_oldest', 'refuse_new')


@dataclasses.dataclass
class StepPlan:
    """One token step over some live requests, for the runner to execute (plain ints)."""

    first_token: bool        # True: each row's token comes from its prefix (LM head only)
    request_ids: list[int]   # row b belongs to request request_ids[b]
    slots: list[int]         # pool slot of each row, ascending
    gen_lens: list[int]      # K/V entries already written after the prefix (decode rows)
    tokens: list[int]        # token fed at this step (decode rows)

    @property
    def size(self) -> int:
        return len(self.request_ids)


@dataclasses.dataclass
class Admission:
    """The request a frame started, and whether its slot still needs a prefill."""

    request_id: int          # the new request
    slot: int                # pool slot it holds
    needs_prefill: bool      # False: it adopted the frame's slot, whose prefix is there


class Scheduler:
    """Admission, budget, eviction and the rows of every step; no tensors.

    share_prefix: True (oxygen, shared) a request adopts its frame's slot; False (isolated)
    the action task releases the frame slot and the request is prefilled into a slot of its
    own. max_gen_len: generated K/V entries a slot can hold (forced + N - 1 per request).
    """

    def __init__(self, policy: LanguagePolicy, budget: Budget, pool: KVPool, max_gen_len: int,
                 *, pressure: str = 'evict_oldest', share_prefix: bool = True,
                 max_forced_tokens: int = 0):
        if pressure not in PRESSURE_POLICIES:
            raise ValueError(f'pressure must be one of {PRESSURE_POLICIES}, got {pressure!r}')
        self.policy = policy
        self.budget = budget
        self.pool = pool
        self.max_gen_len = max_gen_len
        self.pressure = pressure
        self.share_prefix = share_prefix
        self.max_forced_tokens = max_forced_tokens
        self.active: list[RequestState] = []       # live requests, oldest first
        self.num_queued = 0                        # arrived requests waiting for a frame
        self.num_requests = 0                      # request ids handed out (refused included)
        self.batch_sizes: list[int] = []           # rows of each decode step this frame
        self._frame: tuple[int, int] | None = None  # (frame index, slot) the frame holds
        self._quota: dict[int, int] = {}           # request id -> token steps left this frame
        self._touched: dict[int, RequestState] = {}  # requests this frame reports on
        self._ended: list[RequestState] = []       # ended since the last end_language()

    # ---- the action path -----------------------------------------------------------------

    def allocate_frame_slot(self, frame_index: int) -> int:
        """Take a slot for the frame's prefix, evicting the oldest requests if the pool is full.

        Raises RuntimeError (nothing changed) when no slot is free and no request holds one.
        """
        assert self._frame is None, f'frame {self._frame[0]} still holds a slot'
        holder = f'frame {frame_index}'
        slot = self.pool.allocate(holder)
        while slot is None and self.active:
            victim = self.active[0]
            logger.warning('KV pool full: evicting request %d (frame %d, %d tokens) for %s',
                           victim.request_id, victim.origin_frame, len(victim.token_ids), holder)
            self._end(victim, FinishReason.EVICTED)
            slot = self.pool.allocate(holder)
        if slot is None:
            raise RuntimeError(f'KV pool has no slot for {holder} and no request to evict:\n'
                               f'{self.pool}')
        self._frame = (frame_index, slot)
        return slot

    def after_actions(self) -> None:
        """End the action task; without prefix sharing its slot is released at once."""
        if not self.share_prefix:
            self.drop_frame()

    def drop_frame(self) -> None:
        """Release the frame's slot (if it still holds one); no request starts on it."""
        if self._frame is not None:
            index, slot = self._frame
            self.pool.release(slot, f'frame {index}')
            self._frame = None

    # ---- admission -------------------------------------------------------------------------

    def begin_language(self) -> None:
        """Start a frame's language work: every live request is reported on at its end."""
        self._touched = {r.request_id: r for r in self.active}
        self.batch_sizes = []
        self._quota = {}

    def admit(self, frame_index: int, forced: list[int]) -> Admission | None:
        """Queue this frame's arrivals and start at most one request; end the frame's hold.

        forced: the prompt template's token ids for a request starting now (may be []).
        """
        try:
            arrivals = self.policy.arrivals(frame_index)
            accepted = min(arrivals, self.policy.max_queue - self.num_queued)
            self.num_queued += accepted
            for _ in range(arrivals - accepted):
                self._refuse(frame_index, 'request queue full')
            admission = None
            if self.num_queued:
                self.num_queued -= 1
                admission = self._start_request(frame_index, forced)
        finally:
            self.drop_frame()   # whatever failed above, the frame's slot is not leaked
        return admission

    def _start_request(self, frame_index: int, forced: list[int]) -> Admission | None:
        if len(forced) > self.max_forced_tokens:
            logger.warning('prompt template has %d tokens, keeping the first %d',
                           len(forced), self.max_forced_tokens)
            forced = forced[:self.max_forced_tokens]
        n_tokens = self.policy.request_len(frame_index)
        # Storage bound (a policy set later may ask more than the slots were sized for).
        fits = self.max_gen_len - len(forced) + 1
        if n_tokens > fits:
            logger.warning('request of %d tokens shortened to %d (KV slot length)', n_tokens,
                           fits)
            n_tokens = fits
        if self.share_prefix:
            assert self._frame is not None and self._frame[0] == frame_index, (
                f'no slot of frame {frame_index} to adopt')
            if self.pressure == 'refuse_new' and self.pool.num_free < 1:
                # Adopting would leave no slot for the next frame's action path.
                self._refuse(frame_index, f'KV pool full ({self.pool.num_in_use}/'
                                          f'{self.pool.num_slots})')
                return None
            slot, needs_prefill = self._frame[1], False
            request_id = self._take_request_id()
            self.pool.retain(slot, f'request {request_id}')
        else:
            request_id = self._take_request_id()
            slot, needs_prefill = self.pool.allocate(f'request {request_id}'), True
            if slot is None:
                self._refuse(frame_index, f'KV pool full ({self.pool.num_slots} slots)',
                             request_id)
                return None
        req = RequestState(request_id=request_id, slot=slot, origin_frame=frame_index,
                           max_new_tokens=n_tokens, eos_id=self.policy.eos_id,
                           forced=list(forced))
        self.active.append(req)
        self._touched[request_id] = req
        return Admission(request_id, slot, needs_prefill)

    def _refuse(self, frame_index: int, why: str, request_id: int | None = None) -> None:
        req = RequestState(
            request_id=self._take_request_id() if request_id is None else request_id,
            slot=None, origin_frame=frame_index, max_new_tokens=0, eos_id=self.policy.eos_id)
        logger.warning('frame %d: language request %d refused: %s', frame_index,
                       req.request_id, why)
        req.finish(FinishReason.REFUSED, why)
        self._ended.append(req)

    def _take_request_id(self) -> int:
        self.num_requests += 1
        return self.num_requests - 1

    # ---- token steps -----------------------------------------------------------------------

    def choose_k(self, elapsed_s: float) -> int:
        """Ask the budget for this frame's k; return the k to report (N when unlimited)."""
        k = self.budget.choose(elapsed_s, len(self.active))
        self._quota = {r.request_id: k for r in self.active}
        return self.policy.max_request_len if self.budget.unlimited else k

    def schedule(self, elapsed_s: float) -> StepPlan | None:
        """Next step of this frame: first tokens, then decode steps; None when done.

        A request's first token comes from its prefix (LM head only) and counts as one of its
        k; every other token is one row of a batched decode step. Before every decode step
        but the first, the budget may stop the frame (an adaptive deadline).
        """
        first = [r for r in self.active if r.needs_prefix_token and self._quota[r.request_id]]
        if first:
            return StepPlan(True, [r.request_id for r in first], [r.slot for r in first], [], [])
        rows = [r for r in self.active if self._quota[r.request_id]]
        if not rows:
            return None
        if self.batch_sizes and not self.budget.allow_more(elapsed_s, len(rows)):
            return None
        # Slot order: a run of slots is read as a view of the cache.
        rows.sort(key=lambda r: r.slot)
        for req in rows:
            # The entry written now sits at P + gen_len; it must fit in the slot.
            assert req.gen_len < self.max_gen_len, (
                f'request {req.request_id}: gen_len {req.gen_len} >= {self.max_gen_len}')
        return StepPlan(False, [r.request_id for r in rows], [r.slot for r in rows],
                        [r.gen_len for r in rows], [r.next_input_token() for r in rows])

    def update(self, plan: StepPlan, token_ids: list[int], seconds: float) -> None:
        """Give each row its next token (argmax of its logits); end finished requests."""
        assert len(token_ids) == plan.size, f'{len(token_ids)} tokens for {plan.size} rows'
        live = {r.request_id: r for r in self.active}
        for request_id, token in zip(plan.request_ids, token_ids):
            req = live[request_id]
            if plan.first_token:
                req.accept_prefix_token(token)
            else:
                req.accept_decode_step(token)
            self._quota[request_id] -= 1
            if req.finished:
                self._end(req, req.finish_reason)
        if not plan.first_token:
            self.budget.observe_decode(plan.size, seconds)
            self.batch_sizes.append(plan.size)

    def fail(self, request_ids: list[int], error: BaseException) -> None:
        """End these requests (and only them) with 'error': a model call on them failed."""
        logger.error('language step failed for requests %s: %r', request_ids, error)
        live = {r.request_id: r for r in self.active}
        for request_id in request_ids:
            if request_id in live:
                self._end(live[request_id], FinishReason.ERROR, repr(error))

    def _end(self, req: RequestState, reason: FinishReason, error: str = '') -> None:
        """Finish `req` (if not yet) and give its slot back."""
        req.finish(reason, error)
        if req.slot is not None:
            self.pool.release(req.slot, f'request {req.request_id}')
            req.slot = None
        self.active.remove(req)
        self._quota.pop(req.request_id, None)
        self._ended.append(req)

    def end_language(self) -> tuple[list[RequestState], list[RequestState]]:
        """Close the frame's language work: (requests touched, requests ended), by id."""
        ended, self._ended = self._ended, []
        touched = dict(self._touched)
        touched.update((r.request_id, r) for r in ended)
        self._touched = {}
        return ([touched[i] for i in sorted(touched)],
                sorted(ended, key=lambda r: r.request_id))

    # ---- invariants -------------------------------------------------------------------------

    def check(self) -> None:
        """Assert pool and request invariants (the engine runs it after every frame in debug)."""
        self.pool.check()
        for req in self.active:
            assert not req.finished, f'finished request {req.request_id} still active'
            assert req.slot is not None
            assert self.pool.holders(req.slot) == (f'request {req.request_id}',), (
                f'request {req.request_id}: slot {req.slot} held by {self.pool.holders(req.slot)}')
            assert req.gen_len <= self.max_gen_len
        slots = [r.slot for r in self.active]
        assert len(set(slots)) == len(slots), f'two requests share a slot: {slots}'
        if self._frame is None:
            # Between frames only live requests hold slots.
            assert self.pool.num_in_use == len(self.active), (
                f'leak: {self.pool.num_in_use} slots in use, {len(self.active)} requests\n'
                f'{self.pool}')

    def __str__(self) -> str:
        return (f'{len(self.active)} live requests, budget {self.budget}, '
                f'{self.num_queued} queued\n{self.pool}')
