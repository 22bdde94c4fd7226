"""The scheduler: decides what the language path does, in slot ids and counters.

It owns the request states σ, the slot pool's ids and the decode budget, and nothing with a
tensor in it: the engine asks it for a plan, has the model runner execute the plan, and hands
the resulting token ids back (vLLM v1's schedule() / update_from_output(), smaller).

One frame, as the engine drives it:

    act            allocate_frame_slot(t) -> s_t   (admission keeps one free; else the newest
                                                    request is preempted)
                   ... runner prefills s_t, computes actions ...
                   after_actions()                 (isolated: the action task lets s_t go)
    advance        begin_language()
                   admit(t, forced, elapsed)       each language task's request starting at t
                     -> [Admission]                adopts s_t (zero copy; all of them read the
                                                   one prefix) and takes a generation block of
                                                   its own, or, isolated, gets a slot of its
                                                   own to prefill; below the top priority only
                                                   if its first step fits the tick (below)
                   choose_k(elapsed) -> k          k token steps per live request, and at least
                                                   each one's minimum (its pool deadline)
                   schedule() -> StepPlan | None   a waiting request whose first step now fits
                   update(plan, token_ids)         starts (below); first tokens (LM head on the
                   fail(plan, error)               prefix), one extend pass over the new
                   take_answered()                 requests' templates, then ONE batched decode
                                                   step per token step over every live
                                                   request, whatever frame it started at
                   end_language() -> touched, ended    the frame's hold on s_t ends

Progress under any overload (how vLLM keeps FCFS progress: admitted requests run to the end,
new ones wait or are turned away, the newest is preempted first). Every frame's action path
needs a slot, so at the end of every frame at most S - 1 requests may hold slots (S = the
pool's slots). Each request therefore gets a deadline when admitted, a frame count:

    deadline = now + ceil(steps / k_min) - 1      k_min: the budget's fewest steps per frame

and is admitted only if the requests still live after this frame (deadline > now), itself
included, number at most S - 1; otherwise it is refused (the newest gives way, nothing is
evicted). Every tick (with a frame or without) each live request then takes at least

    minimum = ceil(steps_left / (deadline - now + 1))      (earliest deadline first, spread)

token steps (below the highest priority live, only what its deadline forces: steps_left -
(deadline - now) * k_min, so one ahead of its spread yields to a question), whatever the
budget's k (an adaptive budget gives k = 0 when the action path alone fills the frame), and
the budget's deadline check never stops a frame below it. So every admitted request
finishes by its deadline, the next frame always finds a slot, and requests
complete at a steady rate under overload: with the pool sized ceil(N / k_min) + 1, one request
per frame and k_min = 1, one decode step per frame over the live requests. Frames are counted
here (every act(), and every language-only frame of the parallel baseline), not taken from the
caller's numbering. Should a frame still find the pool full (a slot held outside this plan),
the newest request is preempted (ended 'evicted'), never the oldest.

A later budget or policy change keeps the deadlines already given (admission then plans with
the new k_min).

Several language tasks (workload.LanguageTask): a frame starts at most one request per task,
all on the frame's one prefix slot, each with a generation block of its own (a frame's slot
then lives until its last request ends, so the room above counts distinct prefix slots). The
task priority orders three things: admission (higher first, and a lower priority never takes
a block a higher one's live requests will need: `_reserved_blocks`, so when the pool is short
the lower priority is refused), the budget's token steps (a lower priority's k is chosen with
the higher priorities' rows counted and after their steps' time, and when the tick's time
runs out the lower priority stops first, down to its minimum), and preemption (the lowest
priority's newest request first).

On-demand tasks (questions, `LanguageTask.on_demand`): a caller asks with `ask(task, forced,
ticket)`, the request's own forced tokens (its template with the question); it starts on the
newest frame's prefix like any task's request (one a frame per task): at that frame's
admission, or, asked while the frame's steps run, at the next step whose time still holds its
extend pass (the frame keeps its slot until end_language()). Its FinishedRequest carries the
ticket, and `take_answered()` hands it out at the step it ended, not at the round's end. At
most policy.max_queue are waiting or live at once; their blocks are kept free for them from
lower priorities like any higher task's share. A live one takes the tick first: its k is
chosen before the lower levels', a lower request's first step must fit beside all of its
steps left, and while time is left after every quota it takes one more step at a time.

Admission by time (a budget bound by time, AdaptiveBudget; a fixed k admits as before). A
request below the highest priority live or starting starts only if the tick's committed
work with it still ends by the tick's deadline (`_committed_s`: the extend pass and first
tokens of the new requests, every live request's minimum steps, and all the steps left of an
on-demand request above it); else it is deferred: it waits for a later step of the round
(started once it fits) or the next frame, where a periodic task's deferred request gives way
to the newest frame's (counted in `deferred`, never refused). The highest priority is never
deferred, so under overload its requests still start and finish (progress above). So a
lower priority's first step never pushes a tick past its period: a tick's committed work is
what its live requests' deadlines force, plus what fits.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math

from typing import Mapping, Sequence

from oxygen_ros.engine.budget import Budget
from oxygen_ros.engine.workload import as_tasks, LanguagePolicy, LanguageTask, NARRATION
from oxygen_ros.kv import FinishReason, KVPool, QuotaPool, RequestState
from oxygen_ros.model.pi05 import extend_bucket

logger = logging.getLogger(__name__)


def extend_tokens(prompts: Sequence[Sequence[int]]) -> int:
    """Query tokens of one extend pass over `prompts` as the runner pads it (rows x bucket)."""
    return len(prompts) * extend_bucket(max(map(len, prompts), default=0))


@dataclasses.dataclass
class StepPlan:
    """One token step over some live requests, for the runner to execute (plain ints)."""

    first_token: bool        # True: each row's token comes from its prefix (LM head only)
    request_ids: list[int]   # row b belongs to request request_ids[b]
    slots: list[int]         # prefix slot of each row (rows of one frame share it)
    gen_lens: list[int]      # K/V entries already written to the row's block (decode rows)
    tokens: list[int]        # token fed at this step (decode rows)
    blocks: list[int] = dataclasses.field(default_factory=list)   # generation block of each
    #                          decode row, ascending (distinct: a block is one request's)
    prompts: list[list[int]] = dataclasses.field(default_factory=list)   # an extend pass:
    #                          the template tokens each row feeds (empty: not an extend)

    @property
    def size(self) -> int:
        return len(self.request_ids)

    @property
    def extend(self) -> bool:
        """True: one extend pass feeds each row's pending template (runner.extend)."""
        return bool(self.prompts)

    @property
    def extend_tokens(self) -> int:
        """Query tokens of an extend pass as the runner pads it (rows x the bucketed prompt)."""
        return extend_tokens(self.prompts)


@dataclasses.dataclass
class Admission:
    """The request a frame started, and whether its slot still needs a prefill."""

    request_id: int          # the new request
    slot: int                # prefix slot it holds
    needs_prefill: bool      # False: it adopted the frame's slot, whose prefix is there
    task: str = ''           # the language task it belongs to


class Scheduler:
    """Admission, budget, pool deadlines and the rows of every step; no tensors.

    tasks: the robot's language tasks (a LanguagePolicy: the one narration task).
    pool: prefix slots; blocks: generation blocks (None: one per prefix slot, enough for one
    task). share_prefix: True (oxygen, shared) a request adopts its frame's slot; False
    (isolated) the action task releases the frame slot and each request is prefilled into a
    slot of its own. max_gen_len: generated K/V entries a block holds (forced + N - 1).
    """

    def __init__(self, tasks: LanguagePolicy | Sequence[LanguageTask], budget: Budget,
                 pool: KVPool | QuotaPool, max_gen_len: int, *, share_prefix: bool = True,
                 max_forced_tokens: int = 0, blocks: KVPool | QuotaPool | None = None):
        self.tasks = as_tasks(tasks)
        self.budget = budget
        self.pool = pool
        self.blocks = blocks if blocks is not None else KVPool(pool.num_slots)
        self.max_gen_len = max_gen_len
        self.share_prefix = share_prefix
        self.max_forced_tokens = max_forced_tokens
        self.active: list[RequestState] = []       # live requests, oldest first
        self.queued: dict[str, int] = {t.name: 0 for t in self.tasks}   # arrived, waiting
        self.asked: dict[str, collections.deque[tuple[int, list[int]]]] = {
            t.name: collections.deque() for t in self.tasks if t.on_demand}   # (ticket, forced)
        self.num_requests = 0                      # request ids handed out (refused included)
        self.now = -1                              # frames begun so far - 1 (deadlines' clock)
        self.batch_sizes: list[int] = []           # rows of each decode step this frame
        self._frame: tuple[int, int] | None = None  # (frame index, slot) the frame holds
        self._frame_counted = False                # `now` already counts the frame to admit
        self._quota: dict[int, int] = {}           # request id -> token steps left this frame
        self._must: dict[int, int] = {}            # request id -> steps it must still take
        self._touched: dict[int, RequestState] = {}  # requests this frame reports on
        self._ended: list[RequestState] = []       # ended since the last end_language()
        self._answered = 0                         # of them, handed out by take_answered()
        self._started: set[str] = set()            # tasks that started a request this round
        self._deferred_forced: dict[str, list[int]] = {}   # deferred this round: template ids
        self.deferred: collections.Counter[str] = collections.Counter()   # task -> requests
        #                                            whose first step did not fit a tick

    @property
    def policy(self) -> LanguagePolicy:
        """Return the narration task's LanguagePolicy; the first task's without one."""
        return self.tasks[self._main_task].policy

    @policy.setter
    def policy(self, policy: LanguagePolicy) -> None:
        tasks = list(self.tasks)
        tasks[self._main_task] = dataclasses.replace(tasks[self._main_task], policy=policy)
        self.tasks = tuple(tasks)

    @property
    def _main_task(self) -> int:
        names = [t.name for t in self.tasks]
        return names.index(NARRATION) if NARRATION in names else 0

    def set_tasks(self, tasks: LanguagePolicy | Sequence[LanguageTask]) -> None:
        """Use `tasks` for requests that arrive from the next frame on (live ones go on)."""
        self.tasks = as_tasks(tasks)
        self.queued = {t.name: self.queued.get(t.name, 0) for t in self.tasks}
        self.asked = {t.name: self.asked.get(t.name, collections.deque())
                      for t in self.tasks if t.on_demand}

    @property
    def num_queued(self) -> int:
        """Arrived requests of every task still waiting for a frame (asked ones included)."""
        return sum(self.queued.values()) + sum(len(q) for q in self.asked.values())

    def ask(self, task: str, forced: Sequence[int], ticket: int) -> str:
        """Queue a request of on-demand `task` for the next frame; '' or why it is refused.

        forced: its prompt token ids (the template with the question); ticket: the caller's
        id, carried by the request's FinishedRequest (refused at admission included).
        """
        spec = next((t for t in self.tasks if t.name == task), None)
        if spec is None or not spec.on_demand:
            return f'no on-demand language task {task!r}'
        if len(forced) > self.max_forced_tokens:
            return (f'{len(forced)} prompt tokens; at most {self.max_forced_tokens} fit a '
                    'generation block')
        waiting = len(self.asked[task]) + sum(r.task == task for r in self.active)
        if waiting >= spec.policy.max_queue:
            return (f'{waiting} {task} requests are waiting or running; at most '
                    f'{spec.policy.max_queue} at once')
        self.asked[task].append((ticket, list(forced)))
        return ''

    def withdraw(self, ticket: int) -> bool:
        """Drop an asked request still waiting for a frame; False when none waits (started)."""
        for queue in self.asked.values():
            for item in queue:
                if item[0] == ticket:
                    queue.remove(item)
                    return True
        return False

    def _by_priority(self) -> list[LanguageTask]:
        """Tasks, higher priority first (declaration order among equals)."""
        return sorted(self.tasks, key=lambda t: -t.priority)

    # ---- the action path -----------------------------------------------------------------

    def allocate_frame_slot(self, frame_index: int) -> int:
        """Take a slot for the frame's prefix (a new frame begins).

        Admission keeps one free (module doc); should none be, the newest requests are
        preempted for it. Raises RuntimeError (nothing changed) when no slot is free and no
        request holds one.
        """
        assert self._frame is None, f'frame {self._frame[0]} still holds a slot'
        holder = f'frame {frame_index}'
        slot = self.pool.allocate(holder)
        while slot is None and self.active:
            victim = self._preemption_victim()
            logger.warning('KV pool full: preempting the newest request %d (frame %d, %d '
                           'tokens) for %s',
                           victim.request_id, victim.origin_frame, len(victim.token_ids), holder)
            self._end(victim, FinishReason.EVICTED)
            slot = self.pool.allocate(holder)
        if slot is None:
            raise RuntimeError(f'KV pool has no slot for {holder} and no request to preempt:\n'
                               f'{self.pool}')
        self.now += 1
        self._frame_counted = True
        self._frame = (frame_index, slot)
        return slot

    def _preemption_victim(self) -> RequestState:
        """Return who gives its slot up first: the lowest priority's newest request.

        The oldest is nearest done; a frame's slot is free once all its requests are gone.
        """
        lowest = min(r.priority for r in self.active)
        return [r for r in self.active if r.priority == lowest][-1]

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
        self._quota, self._must = {}, {}
        self._started = set()
        self._deferred_forced = {}

    def admit(self, frame_index: int,
              forced: Mapping[str, Sequence[int]] | Sequence[int] = (),
              elapsed_s: float | None = None, deadline_s: float | None = None,
              other_rows: int = 0) -> list[Admission]:
        """Queue this frame's arrivals and start at most one request per task on its slot.

        forced: each task's prompt template token ids (task name -> ids; a plain list is the
        first task's); a task absent gets none. Tasks are admitted higher priority first.
        elapsed_s: the tick's time so far (None: admission is not by time); deadline_s and
        other_rows as in choose_k. Below the highest priority live or starting, a request
        whose first step no longer fits the tick is deferred (module doc). The frame keeps
        its slot until end_language(): a question asked during the round may still start
        on it (schedule()).
        """
        if not isinstance(forced, Mapping):
            forced = {self.tasks[0].name: forced}
        admissions = []
        try:
            if not self._frame_counted:
                self.now += 1   # a frame that took no action slot (the parallel baseline's)
            tasks = self._by_priority()
            for task in tasks:
                arrivals = task.policy.arrivals(frame_index)
                if task.policy.arrival_rate is None:
                    # One request a period: a deferred one gives way to the newest frame's.
                    self.queued[task.name] = min(self.queued[task.name] + arrivals, 1)
                    continue
                accepted = min(arrivals, task.policy.max_queue - self.queued[task.name])
                self.queued[task.name] += accepted
                for _ in range(arrivals - accepted):
                    self._refuse(frame_index, task, 'request queue full')
            starting = [t.priority for t in tasks
                        if (self.asked[t.name] if t.on_demand else self.queued[t.name])]
            top = max([r.priority for r in self.active] + starting, default=0)
            for task in tasks:
                ticket = None
                if task.on_demand:
                    if not self.asked[task.name]:
                        continue
                    ticket, ids = self.asked[task.name][0]
                elif self.queued[task.name]:
                    ids = list(forced.get(task.name, ()))
                else:
                    continue
                req = self._new_request(frame_index, task, ids, ticket)
                if (task.priority < top and elapsed_s is not None
                        and not self._fits(req, elapsed_s, deadline_s, other_rows)):
                    self._deferred_forced[task.name] = ids   # a later step may start it
                    self.deferred[task.name] += 1
                    logger.debug('frame %d: %s request deferred: its first step does not fit '
                                 'the tick', frame_index, task.name)
                    continue
                if task.on_demand:
                    self.asked[task.name].popleft()
                else:
                    self.queued[task.name] -= 1
                admission = self._start_request(req, task)
                if admission is not None:
                    admissions.append(admission)
        except BaseException:
            self.drop_frame()   # whatever failed above, the frame's slot is not leaked
            raise
        finally:
            self._frame_counted = False
        return admissions

    def _new_request(self, frame_index: int, task: LanguageTask, forced: list[int],
                     ticket: int | None = None, warn: bool = True) -> RequestState:
        """Return the request `task` would start at this frame (no id, slot or block yet).

        warn: log what had to be cut to fit a block (False: a retry, logged before).
        """
        policy = task.policy
        if len(forced) > self.max_forced_tokens:
            if warn:
                logger.warning('%s: prompt template has %d tokens, keeping the first %d',
                               task.name, len(forced), self.max_forced_tokens)
            forced = forced[:self.max_forced_tokens]
        n_tokens = policy.request_len(frame_index)
        # Storage bound (a policy set later may ask more than the blocks were sized for).
        fits = self.max_gen_len - len(forced) + 1
        if n_tokens > fits:
            if warn:
                logger.warning('%s: request of %d tokens shortened to %d (generation block '
                               'length)', task.name, n_tokens, fits)
            n_tokens = fits
        req = RequestState(request_id=-1, slot=None, origin_frame=frame_index,
                           max_new_tokens=n_tokens, eos_id=policy.eos_id,
                           forced=list(forced), task=task.name, priority=task.priority,
                           ticket=ticket)
        req.deadline = self.now + math.ceil(req.steps_left / max(self.budget.k_min, 1)) - 1
        return req

    def _start_request(self, req: RequestState, task: LanguageTask) -> Admission | None:
        """Admit `req` on the frame's slot (a slot of its own, isolated), or refuse it."""
        frame_index, ticket = req.origin_frame, req.ticket
        why = self._no_room(req)
        if why:
            self._refuse(frame_index, task, why, ticket=ticket)
            return None
        req.request_id = self._take_request_id()
        holder = f'request {req.request_id}'
        if self.share_prefix:
            assert self._frame is not None and self._frame[0] == frame_index, (
                f'no slot of frame {frame_index} to adopt')
            slot, needs_prefill = self._frame[1], False
            self.pool.retain(slot, holder)
        else:
            slot, needs_prefill = self.pool.allocate(holder), True
            if slot is None:
                self._refuse(frame_index, task, f'KV pool full ({self.pool.num_slots} slots)',
                             req.request_id, ticket)
                return None
        req.block = self.blocks.allocate(holder)   # _no_room saw a free one
        req.slot = slot
        self.active.append(req)
        self._touched[req.request_id] = req
        self._started.add(task.name)
        return Admission(req.request_id, slot, needs_prefill, task.name)

    def _fits(self, new: RequestState, elapsed_s: float, deadline_s: float | None,
              other_rows: int) -> bool:
        """Whether the tick's committed work with `new` started too ends by its deadline."""
        left = self.budget.time_left(elapsed_s, deadline_s)
        return left == math.inf or self._committed_s(new, other_rows) <= left

    def _committed_s(self, new: RequestState, other_rows: int = 0) -> float:
        """Seconds of the language work this tick is committed to once `new` starts too.

        Committed: the extend pass over every template still to feed, every live request's
        minimum steps (shared decode steps), and all the steps left of each on-demand
        request above `new` (a question gets the tick first). Priced by the budget's cost
        models (a request without template: its first-token call).
        """
        requests = [*self.active, new]
        top = max(r.priority for r in requests)
        budget = self.budget
        seconds = self._first_steps_s(requests)
        on_demand = {t.name for t in self.tasks if t.on_demand}
        must_rows, extra = [], 0   # decode steps each request must take; the questions' rest
        for req in requests:
            known = req is not new and req.request_id in self._must
            must = self._must[req.request_id] if known else self._minimum(req, top)
            first = int(bool(req.pending_prompt or req.needs_prefix_token))   # not a decode row
            must_rows.append(max(must - first, 0))
            if req.priority > new.priority and req.task in on_demand:
                extra = max(extra, req.steps_left - first - must_rows[-1])
        for step in range(max(must_rows)):
            seconds += budget.step_estimate(sum(m > step for m in must_rows) + other_rows)
        if extra > 0:
            above = sum(r.priority > new.priority and r.task in on_demand for r in requests)
            seconds += extra * budget.step_estimate(above + other_rows)
        return seconds

    def _minimum(self, req: RequestState, top: int) -> int:
        """Token steps `req` must take this tick (module doc); top: the highest live priority.

        At the top priority its spread, ceil(steps left / frames to its deadline); below it
        only what its deadline forces (steps left beyond k_min a frame after this one).
        """
        frames_left = req.deadline - self.now + 1
        if frames_left < 1:
            return req.steps_left
        if req.priority < top:
            # Below the top priority, only what its deadline forces now: a request ahead of
            # its spread (earlier ticks' slack) yields its step to the higher ones (a
            # question's answer); one on schedule still takes its k_min.
            return max(req.steps_left - (frames_left - 1) * max(self.budget.k_min, 1), 0)
        return -(-req.steps_left // frames_left)

    def _no_room(self, req: RequestState) -> str:
        """Why `req` cannot be admitted without a later frame lacking a slot ('' if it can).

        After this frame at most S - 1 prefix slots may be held by requests, so that the next
        frame's action path finds one; requests due now finish in this frame (module doc).
        The frame's slot counts once however many of its tasks' requests stay. A request
        also needs a free generation block now (the action path never needs one).
        """
        if not self.blocks.num_free:
            return (f'no free generation block: {self.blocks.num_slots} blocks hold '
                    f'{len(self.active)} live requests')
        reserved = self._reserved_blocks(req.priority)
        if self.blocks.num_free - 1 < reserved:
            return (f'no free generation block: {self.blocks.num_free} free, {reserved} kept '
                    'for the requests of higher priority tasks')
        staying = {r.slot for r in self.active if r.deadline > self.now}
        if req.deadline > self.now:
            frame_slot = self._frame[1] if self.share_prefix and self._frame else -1
            staying.add(frame_slot)
        room = self.pool.num_slots - 1
        if len(staying) <= room:
            return ''
        return (f'KV pool full: requests of {len(staying) - 1} frames run past this frame and '
                f'the pool keeps {room} of its {self.pool.num_slots} slots for them; a request '
                f'of {req.steps_left} steps at k_min={self.budget.k_min} would hold a slot '
                f'{req.deadline - self.now + 1} frames')

    def _reserved_blocks(self, priority: int) -> int:
        """Blocks kept free for tasks of a higher priority than `priority`.

        Each such task keeps its share, the requests it has live at once at k_min steps per
        frame (ceil(ceil(N / k_min) / n)), less those it holds: so a lower priority takes
        only blocks a higher one will not need, and never delays its admission.
        """
        reserved = 0
        for task in self.tasks:
            if task.priority <= priority:
                continue
            live = sum(r.task == task.name for r in self.active)
            if task.on_demand:   # its max_queue, asked or not
                reserved += max(task.policy.max_queue - live, 0)
                continue
            if not task.policy.requests_per_frame():
                continue
            policy = task.policy
            life = math.ceil(policy.max_request_len / max(self.budget.k_min, 1))
            every = 1 if policy.arrival_rate is not None else policy.every_n_frames
            reserved += max(math.ceil(life / every) - live, 0)
        return reserved

    def _refuse(self, frame_index: int, task: LanguageTask, why: str,
                request_id: int | None = None, ticket: int | None = None) -> None:
        req = RequestState(
            request_id=self._take_request_id() if request_id is None else request_id,
            slot=None, origin_frame=frame_index, max_new_tokens=0, eos_id=task.policy.eos_id,
            task=task.name, priority=task.priority, ticket=ticket)
        logger.warning('frame %d: %s request %d refused: %s', frame_index, task.name,
                       req.request_id, why)
        req.finish(FinishReason.REFUSED, why)
        self._ended.append(req)

    def _take_request_id(self) -> int:
        self.num_requests += 1
        return self.num_requests - 1

    # ---- token steps -----------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        """Whether a language call has anything to do or report (live or ended requests)."""
        return bool(self.active or self._ended)

    def choose_k(self, elapsed_s: float, deadline_s: float | None = None,
                 other_rows: int = 0) -> int:
        """Set each live request's steps for this frame; return the largest (N when unlimited).

        A request's steps: the budget's k, and at least its minimum (module doc). A tick
        without a frame (a camera hiccup, draining) takes the minimum too, so requests finish
        when frames stop, however slow a step is against the period. deadline_s: when the
        tick's language must end (None: the budget's own period); other_rows: rows other
        robots add to each decode step (a fleet's), so the budget prices the whole step.
        """
        # The templates still to feed run first this tick (their requests' first step is
        # their minimum): the budget prices them before it gives decode steps.
        elapsed_s += self._first_steps_s(self.active)
        ks = self._priority_ks(elapsed_s, deadline_s, other_rows)
        top = max((r.priority for r in self.active), default=0)
        self._must = {r.request_id: self._minimum(r, top) for r in self.active}
        self._quota = {r.request_id: max(ks[r.priority], self._must[r.request_id])
                       for r in self.active}
        if self.budget.unlimited:
            return max(t.policy.max_request_len for t in self.tasks)
        return max([*ks.values(), *self._must.values()])

    def _priority_ks(self, elapsed_s: float, deadline_s: float | None,
                     other_rows: int) -> dict[int, int]:
        """Return the budget's k of each priority level of the live requests.

        The highest level's k is chosen at its own rows, each lower level's with the rows of
        every level above it counted too (the steps a lower priority adds run beside theirs)
        and after the time the levels above will spend on their own steps (the budget's
        step_estimate): so it gets what is left (the same k for all with a single level or a
        fixed budget). The highest level is asked last, so the budget reports its k.
        """
        levels = sorted({r.priority for r in self.active}, reverse=True) or [0]
        rows = {level: sum(r.priority >= level for r in self.active) for level in levels}
        ks, spent_s = {}, 0.0
        for level in levels:
            ks[level] = self.budget.choose(elapsed_s + spent_s, rows[level] + other_rows,
                                           deadline_s)
            if level != levels[-1]:
                steps = max(r.steps_left for r in self.active if r.priority == level)
                step_s = self.budget.step_estimate(rows[level] + other_rows)
                spent_s += min(ks[level], steps) * step_s
        if len(levels) > 1:
            self.budget.choose(elapsed_s, rows[levels[0]] + other_rows, deadline_s)
        return ks

    def schedule(self, elapsed_s: float, deadline_s: float | None = None,
                 other_rows: int = 0) -> StepPlan | None:
        """Next step of this frame: first steps, then decode steps; None when done.

        A request's first token comes from its prefix (LM head only) or from the extend pass
        over its template, and counts as one of its steps; every other token is one row of a
        batched decode step. Before every decode step but the first, the budget may stop the
        frame (an adaptive deadline; deadline_s and other_rows as in choose_k): then only
        rows still short of their minimum go on. Order: the highest priority with steps left
        starts its new requests first; a lower priority's new requests take their first step
        once the levels above have no decode step left this tick (a question's tokens come
        before a narration's first token), the time that first step needs kept for it.
        """
        self._start_waiting(elapsed_s, deadline_s, other_rows)
        quota = self._quota
        # One pass over the live requests with steps left: new ones (their first step next)
        # and started ones (a decode row each). Runs a few times a tick, right after model
        # calls, when every object it reads is out of the caches.
        new, rows = [], []
        for r in self.active:
            if quota[r.request_id]:
                (rows if r.started else new).append(r)
        plan = self._first_steps(new, max((r.priority for r in new + rows), default=0))
        if plan is not None:
            return plan
        reserve = self._first_steps_s(new)   # their first steps: after the decode steps
        if rows and self.batch_sizes and not self.budget.allow_more(
                elapsed_s + reserve, len(rows) + other_rows, deadline_s):
            rows = self._yield_by_priority(rows, elapsed_s + reserve, deadline_s, other_rows)
        if not rows:
            plan = self._first_steps(new, None)
            if plan is not None:
                return plan
            rows = self._more_for_asked(elapsed_s, deadline_s, other_rows)
        if not rows:
            return None
        # Block order: a run of blocks (and, with one task, of prefix slots) is read as a view.
        rows.sort(key=lambda r: r.block)
        for req in rows:
            # The entry written now sits at gen_len of its block; it must fit there.
            assert req.gen_len < self.max_gen_len, (
                f'request {req.request_id}: gen_len {req.gen_len} >= {self.max_gen_len}')
        return StepPlan(False, [r.request_id for r in rows], [r.slot for r in rows],
                        [r.gen_len for r in rows], [r.next_input_token() for r in rows],
                        [r.block for r in rows])

    def _first_steps(self, new: list[RequestState], lead: int | None) -> StepPlan | None:
        """Return the next first-step plan of `new` requests at priority >= lead (None: any).

        new: live requests with steps left whose first step has not run. First tokens (one LM
        head call over their prefixes) before the extend pass.
        """
        if lead is not None:
            new = [r for r in new if r.priority >= lead]
        first = [r for r in new if r.needs_prefix_token]
        if first:
            return StepPlan(True, [r.request_id for r in first], [r.slot for r in first], [], [])
        return self._extend_plan([r for r in new if r.pending_prompt])

    def _first_steps_s(self, requests: list[RequestState]) -> float:
        """Seconds the first steps of these new requests are expected to take."""
        prompts = [r.pending_prompt for r in requests if r.pending_prompt]
        seconds = self.budget.extend_estimate(extend_tokens(prompts)) if prompts else 0.0
        return seconds + self.budget.first_estimate(sum(r.needs_prefix_token for r in requests))

    def _start_waiting(self, elapsed_s: float, deadline_s: float | None,
                       other_rows: int) -> None:
        """Start waiting requests on the round's frame once their first step fits the tick.

        Waiting: asked since the round began (a question asked while the tick's steps run
        starts now, not a tick later), or deferred at admission (a lower priority, once the
        higher ones' work leaves it time). Needs the frame's slot, which the frame holds until
        end_language(); at most one request per task a frame. A request that starts here at
        the top priority gets the steps the budget gives it now (at least its first), the
        lower ones' quotas drop to their minimum (they yield); below the top, its minimum.
        """
        if self._frame is None:
            return
        frame_index = self._frame[0]
        for task in self._by_priority():
            if task.name in self._started:
                continue
            if task.on_demand:
                if not self.asked[task.name]:
                    continue
                ticket, ids = self.asked[task.name][0]
            elif self.queued[task.name] and task.name in self._deferred_forced:
                ticket, ids = None, self._deferred_forced[task.name]
            else:
                continue
            req = self._new_request(frame_index, task, ids, ticket,
                                    warn=task.name not in self._deferred_forced)
            if not self._fits(req, elapsed_s, deadline_s, other_rows):
                continue   # a later step or the next frame starts it
            if task.on_demand:
                self.asked[task.name].popleft()
            else:
                self.queued[task.name] -= 1
            if self._start_request(req, task) is None:
                continue
            top = max(r.priority for r in self.active)
            for live in self.active:
                must = self._minimum(live, top)
                if live is not req:
                    must = min(self._must[live.request_id], must)
                self._must[live.request_id] = must
                if live.priority < task.priority:
                    self._quota[live.request_id] = min(self._quota[live.request_id], must)
            quota = self._must[req.request_id]
            if task.priority == top:
                elapsed_s += self._first_steps_s([req])
                rows = sum(r.priority >= task.priority for r in self.active) + other_rows
                quota = max(self.budget.choose(elapsed_s, rows, deadline_s), quota)
            self._quota[req.request_id] = quota
            logger.debug('frame %d: %s request %d started during the round', frame_index,
                         task.name, req.request_id)

    def _more_for_asked(self, elapsed_s: float, deadline_s: float | None,
                        other_rows: int) -> list[RequestState]:
        """Give live on-demand requests one more step each while one still fits the tick.

        A question takes the time its k (chosen before the tick's steps, on estimates) left
        over; a budget not bound by time (fixed k) gives none.
        """
        on_demand = {t.name for t in self.tasks if t.on_demand}
        rows = [r for r in self.active if r.task in on_demand]
        if not rows or math.isinf(self.budget.time_left(elapsed_s, deadline_s)):
            return []
        if not self.budget.allow_more(elapsed_s, len(rows) + other_rows, deadline_s):
            return []
        for req in rows:
            self._quota[req.request_id] += 1
        return rows

    def _extend_plan(self, requests: list[RequestState]) -> StepPlan | None:
        """Return one extend pass over these requests' pending templates (None: none)."""
        rows = sorted(requests, key=lambda r: r.block)
        if not rows:
            return None
        for req in rows:
            assert len(req.forced) <= self.max_gen_len, (
                f'request {req.request_id}: {len(req.forced)} template tokens > '
                f'{self.max_gen_len} block entries')
        return StepPlan(False, [r.request_id for r in rows], [r.slot for r in rows],
                        [r.gen_len for r in rows], [], [r.block for r in rows],
                        [r.pending_prompt for r in rows])

    def _yield_by_priority(self, rows: list[RequestState], elapsed_s: float,
                           deadline_s: float | None, other_rows: int) -> list[RequestState]:
        """Return the rows that go on once the tick's time is short: lower priorities yield first.

        Whole priority levels are kept from the highest down while a step of their rows still
        fits; every other row goes on only while short of its minimum (admitted requests
        finish by their deadline whatever the budget).
        """
        kept: list[RequestState] = []
        for level in sorted({r.priority for r in rows}, reverse=True):
            level_rows = [r for r in rows if r.priority == level]
            if not self.budget.allow_more(elapsed_s, len(kept) + len(level_rows) + other_rows,
                                          deadline_s):
                break
            kept += level_rows
        return kept + [r for r in rows if r not in kept and self._must[r.request_id]]

    def update(self, plan: StepPlan, token_ids: list[int], seconds: float,
               call_rows: int | None = None) -> None:
        """Give each row its next token (argmax of its logits); end finished requests.

        call_rows: rows of the model call that ran the plan (a fleet's step holds other
        robots' rows too; None: the plan's own), what the budget learns the step's cost at;
        for an extend pass, the call's padded query tokens (None: the plan's extend_tokens).
        """
        assert len(token_ids) == plan.size, f'{len(token_ids)} tokens for {plan.size} rows'
        live = {r.request_id: r for r in self.active}
        for request_id, token in zip(plan.request_ids, token_ids):
            req = live[request_id]
            if plan.first_token:
                req.accept_prefix_token(token)
            elif plan.extend:
                req.accept_extend(token)
            else:
                req.accept_decode_step(token)
            self._quota[request_id] -= 1
            self._must[request_id] = max(self._must[request_id] - 1, 0)
            if req.finished:
                self._end(req, req.finish_reason)
        if plan.extend:
            self.budget.observe_extend(call_rows or plan.extend_tokens, seconds)
        elif plan.first_token:
            self.budget.observe_first(call_rows or plan.size, seconds)
        else:
            self.budget.observe_decode(call_rows or plan.size, seconds)
            self.batch_sizes.append(plan.size)

    def fail(self, request_ids: list[int], error: BaseException) -> None:
        """End these requests (and only them) with 'error': a model call on them failed."""
        logger.error('language step failed for requests %s: %r', request_ids, error)
        live = {r.request_id: r for r in self.active}
        for request_id in request_ids:
            if request_id in live:
                self._end(live[request_id], FinishReason.ERROR, repr(error))

    def _end(self, req: RequestState, reason: FinishReason, error: str = '') -> None:
        """Finish `req` (if not yet) and give its block and its hold on the prefix slot back."""
        req.finish(reason, error)
        holder = f'request {req.request_id}'
        if req.block is not None:
            self.blocks.release(req.block, holder)
            req.block = None
        if req.slot is not None:
            self.pool.release(req.slot, holder)
            req.slot = None
        self.active.remove(req)
        self._quota.pop(req.request_id, None)
        self._must.pop(req.request_id, None)
        self._ended.append(req)

    def take_answered(self) -> list[RequestState]:
        """Return the on-demand requests that ended since the last call (this round's).

        Their callers need not wait for the round's end (end_language reports them too).
        """
        on_demand = {t.name for t in self.tasks if t.on_demand}
        new = [r for r in self._ended[self._answered:] if r.task in on_demand]
        self._answered = len(self._ended)
        return new

    def end_language(self) -> tuple[list[RequestState], list[RequestState]]:
        """Close the frame's language work: (requests touched, requests ended), by id.

        The frame's hold on its slot ends here (its requests keep theirs).
        """
        self.drop_frame()
        self._answered = 0
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
        self.blocks.check()
        for req in self.active:
            holder = f'request {req.request_id}'
            assert not req.finished, f'finished request {req.request_id} still active'
            assert req.slot is not None and req.block is not None
            assert holder in self.pool.holders(req.slot), (
                f'request {req.request_id}: slot {req.slot} held by {self.pool.holders(req.slot)}')
            assert self.blocks.holders(req.block) == (holder,), (
                f'request {req.request_id}: block {req.block} held by '
                f'{self.blocks.holders(req.block)}')
            assert req.gen_len <= self.max_gen_len
            # Admitted requests finish by their deadline (checked after a frame's language).
            assert req.deadline > self.now, (
                f'request {req.request_id} outlived its deadline {req.deadline} '
                f'(frame {self.now})')
        blocks = [r.block for r in self.active]
        assert len(set(blocks)) == len(blocks), f'two requests share a block: {blocks}'
        assert self.blocks.num_in_use == len(self.active), (
            f'leak: {self.blocks.num_in_use} blocks in use, {len(self.active)} requests\n'
            f'{self.blocks}')
        if self._frame is None:
            # Between frames only live requests hold prefix slots.
            slots = {r.slot for r in self.active}
            assert self.pool.num_in_use == len(slots), (
                f'leak: {self.pool.num_in_use} slots in use, {len(slots)} held by requests\n'
                f'{self.pool}')

    def __str__(self) -> str:
        return (f'{len(self.active)} live requests (deadlines '
                f'{[r.deadline for r in self.active]} at frame {self.now}), budget '
                f'{self.budget}, {self.num_queued} queued\n{self.pool}\n{self.blocks}')
