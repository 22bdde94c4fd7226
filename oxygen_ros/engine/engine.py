"""Engine: wires a scheduler, a model runner and an output processor into a System.

One frame, in the order the work happens (the runtime publishes the actions between 1 and 2):

    1. act(obs)            frontend.prepare(obs); scheduler gives the frame slot s_t;
                           runner prefills s_t and samples actions    returned at once
    2. advance_language()  scheduler admits (a request starting at t adopts s_t), picks k,
                           then plans step after step; the runner executes each plan; the
                           output processor turns the requests' new ids into deltas and text

The engine holds no tensor (the runner does) and makes no decision (the scheduler does); it
moves ids and token lists between them and keeps the frame's clock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Callable

import torch

from oxygen_ros.engine.budget import Budget, sizing_k, UnlimitedBudget
from oxygen_ros.engine.frontend import Frontend, held_rows, PreparedObservation
from oxygen_ros.engine.output import OutputProcessor
from oxygen_ros.engine.runner import ModelRunner, Runner
from oxygen_ros.engine.scheduler import Scheduler
from oxygen_ros.engine.types import (ActionOutput, Continuation, FrameResult, Observation,
                                     Timings)
from oxygen_ros.engine.workload import default_num_slots, frame_noise, LanguagePolicy
from oxygen_ros.kv import KVPool
from oxygen_ros.kv.store import slot_bytes
from oxygen_ros.model.config import Pi05Config
from oxygen_ros.model.pi05 import Pi05Model

logger = logging.getLogger(__name__)

DEFAULT_MAX_FORCED_TOKENS = 32   # storage reserved per slot for a prompt template's tokens


@dataclasses.dataclass
class _Frame:
    """Bookkeeping of the frame between act() and advance_language()."""

    index: int
    instruction: str
    prepared: PreparedObservation
    started: float                      # clock() when act() began (the frame's deadline origin)
    act_s: float = 0.0                  # wall time of act()
    action: ActionOutput | None = None  # what act() returned


class FrontendClock:
    """Counts frontend work (conversion, not scheduling) apart from the manager's overhead.

    For Engine and FleetEngine: needs `clock` and a `_frontend_s` the frame resets.
    """

    clock: Callable[[], float]
    _frontend_s: float

    @contextlib.contextmanager
    def _frontend_clock(self):
        """Count the enclosed time as frontend work."""
        start = self.clock()
        try:
            yield
        finally:
            self._frontend_s += self.clock() - start


class Engine(FrontendClock):
    """A System over one model: oxygen, oxygen-adaptive, shared or isolated (see make_engine)."""

    def __init__(self, name: str, scheduler: Scheduler, runner: Runner, frontend: Frontend,
                 *, seed: int = 0, debug: bool = False,
                 clock: Callable[[], float] = time.perf_counter):
        self.system = name
        self.scheduler = scheduler
        self.runner = runner
        self.frontend = frontend
        self.output = OutputProcessor(frontend)
        self.seed = seed
        self.debug = debug
        self.clock = clock
        self.last_result: FrameResult | None = None
        self._frame: _Frame | None = None
        self._next_frame_index = 0
        self._last_frame_index = -1
        self._frontend_s = 0.0                   # frontend time since the frame began

    # ---- the System protocol's state and controls ----------------------------------------

    @property
    def policy(self) -> LanguagePolicy:
        return self.scheduler.policy

    @property
    def budget(self) -> Budget:
        return self.scheduler.budget

    @property
    def pool(self) -> KVPool:
        """Slot ids and byte accounting of the KV cache (num_slots, total_bytes, usage())."""
        return self.scheduler.pool

    @property
    def num_live_requests(self) -> int:
        return len(self.scheduler.active)

    def set_budget(self, budget: Budget | None) -> None:
        """Use `budget` from the next frame on (None: unlimited); the pool keeps its size."""
        self.scheduler.budget = UnlimitedBudget() if budget is None else budget

    def set_policy(self, policy: LanguagePolicy) -> None:
        """Use `policy` for requests that arrive from the next frame on."""
        self.scheduler.policy = policy

    def close(self) -> None:
        """Nothing is held outside this process."""

    # ---- 1. the action path ------------------------------------------------------------------

    def act(self, obs: Observation, continuation: Continuation | None = None) -> ActionOutput:
        """Prefill the observation into a pool slot and compute its actions; no language work.

        continuation: the chunk the robot is executing, which this one continues (real-time
        chunking, on the same prefill); the output's start_row is then its delay.
        Raises ValueError for a malformed observation or committed chunk (nothing allocated);
        the action path always gets a slot (the scheduler's admission keeps one free for it).
        """
        frame = self._begin_frame(obs)
        plan = None
        if continuation is not None:
            with self._frontend_clock():   # may raise: nothing is held yet
                plan = self.frontend.row_plan(continuation, frame.prepared,
                                              self.runner.action_shape[0])
        slot = self.scheduler.allocate_frame_slot(frame.index)
        try:
            self.runner.prefill(frame.prepared.tensors, slot)
            noise = frame_noise(self.seed, frame.index, *self.runner.action_shape)
            normalized = self.runner.sample_actions(slot, noise, plan)      # [H, A]
            with self._frontend_clock():
                actions = self.frontend.robot_actions(normalized, frame.prepared,
                                                      held_rows(continuation, plan))
        except BaseException:
            self.scheduler.drop_frame()
            raise
        self.scheduler.after_actions()
        frame.act_s = self.clock() - frame.started
        self.budget.observe_action(frame.act_s)
        frame.action = ActionOutput(frame.index, actions, normalized, frame.act_s, obs.stamp,
                                    plan.delay if plan is not None else 0)
        self._frame = frame
        return frame.action

    def language_task(self, obs: Observation) -> FrameResult:
        """Only the language half of a frame, with its own prefill (the parallel baseline)."""
        assert not self.scheduler.share_prefix, 'a language-only frame needs its own prefill'
        frame = self._begin_frame(obs)
        frame.act_s = self.clock() - frame.started
        self._frame = frame
        return self.advance_language()

    def _begin_frame(self, obs: Observation) -> _Frame:
        started = self.clock()
        if self._frame is not None:
            # act() twice without advance_language(): the earlier frame gets no language.
            logger.warning('frame %d: act() called again before advance_language(); frame %d '
                           'starts no request', self._frame.index, self._frame.index)
            self.scheduler.drop_frame()
            self._frame = None
        self.runner.reset_times()
        self._frontend_s = 0.0
        index = self._next_frame_index if obs.frame_index is None else int(obs.frame_index)
        with self._frontend_clock():
            prepared = self.frontend.prepare(obs)    # may raise: nothing is held yet
        self._next_frame_index = index + 1
        self._last_frame_index = index
        return _Frame(index, obs.instruction, prepared, started)

    # ---- 2. the language path -----------------------------------------------------------------

    def advance_language(self) -> FrameResult:
        """Admit this frame's request, run the frame's token steps, report deltas and endings.

        Returns the frame's FrameResult (also kept in `self.last_result`). Without a preceding
        act() it just advances the live requests (no new request).
        """
        start = self.clock()
        frame, self._frame = self._frame, None
        if frame is None:
            self.runner.reset_times()
            self._frontend_s = 0.0
        frame_start = frame.started if frame else start
        scheduler = self.scheduler
        scheduler.begin_language()
        if frame is not None:
            try:
                self._admit(frame)
            except Exception as err:   # noqa: BLE001 - a language failure must not leak a slot
                logger.error('frame %d: no language request started: %r', frame.index, err)
                scheduler.drop_frame()
        k = scheduler.choose_k(self.clock() - frame_start)
        while (plan := scheduler.schedule(self.clock() - frame_start)) is not None:
            try:
                if plan.first_token:
                    token_ids = self.runner.first_tokens(plan.slots)
                else:
                    token_ids = self.runner.decode(plan.slots, plan.gen_lens, plan.tokens)
            except Exception as err:   # a language failure must not reach the action path
                scheduler.fail(plan.request_ids, err)
                continue
            scheduler.update(plan, token_ids, self.runner.last_call_s)
        touched, ended = scheduler.end_language()
        with self._frontend_clock():
            deltas, finished = self.output.report(touched, ended, self._last_frame_index)
        total_s = (frame.act_s if frame else 0.0) + self.clock() - start
        self._record(frame, k, deltas, finished, total_s)
        if self.debug:
            self.check()
        return self.last_result

    def _admit(self, frame: _Frame) -> None:
        forced = []
        if self.policy.prompt_template:
            with self._frontend_clock():
                forced = self.frontend.encode_text(self.policy.prompt_text(frame.instruction))
        admission = self.scheduler.admit(frame.index, forced)
        if admission is not None and admission.needs_prefill:
            try:
                self.runner.prefill(frame.prepared.tensors, admission.slot)
            except Exception as err:   # a language failure must not reach the action path
                self.scheduler.fail([admission.request_id], err)

    def step(self, obs: Observation) -> FrameResult:
        """act() then advance_language(): one whole frame."""
        self.act(obs)
        return self.advance_language()

    # ---- 3. results -----------------------------------------------------------------------

    def _record(self, frame, k, deltas, finished, total_s) -> None:
        seconds = self.runner.seconds
        timings = Timings(prefill_s=seconds['prefill'], action_s=seconds['action'],
                          decode_s=seconds['decode'], total_s=total_s,
                          act_s=frame.act_s if frame else 0.0, frontend_s=self._frontend_s)
        timings.overhead_s = max(total_s - timings.model_s, 0.0)
        batch_sizes = list(self.scheduler.batch_sizes)
        self.last_result = FrameResult(
            frame_index=frame.index if frame else -1, action=frame.action if frame else None,
            deltas=deltas, finished=finished, k=k,
            decode_steps=len(batch_sizes), batch_sizes=batch_sizes,
            active_requests=self.num_live_requests, timings=timings,
            kv_usage=self.pool.usage())

    def check(self) -> None:
        """Assert the scheduler's and the pool's invariants."""
        self.scheduler.check()

    def __str__(self) -> str:
        return f'{self.system}: {self.scheduler}'


def forced_token_room(policy: LanguagePolicy, max_forced_tokens: int | None = None) -> int:
    """Entries a slot reserves for a prompt template's forced tokens (None: the default)."""
    if max_forced_tokens is not None:
        return max_forced_tokens
    return DEFAULT_MAX_FORCED_TOKENS if policy.prompt_template else 0


def generated_entries(policy: LanguagePolicy, max_forced_tokens: int | None = None) -> int:
    """Entries a request writes after the prefix: forced + N - 1 (its last token is not fed)."""
    return forced_token_room(policy, max_forced_tokens) + policy.max_request_len - 1


def pool_slot_bytes(config: Pi05Config, policy: LanguagePolicy,
                    kv_dtype: torch.dtype) -> int:
    """Bytes of one KV slot as make_engine allocates it for `policy` (before building)."""
    b = config.backbone
    return slot_bytes(b.depth, config.prefix_len, generated_entries(policy), b.num_kv_heads,
                      b.head_dim, b.width, kv_dtype)


def make_engine(name: str, model: Pi05Model, frontend: Frontend, policy: LanguagePolicy,
                budget: Budget, *, share_prefix: bool = True, num_slots: int | None = None,
                seed: int = 0, max_forced_tokens: int | None = None, debug: bool = False,
                clock: Callable[[], float] = time.perf_counter, **runner_options) -> Engine:
    """Build an Engine: pool sized by default_num_slots for the budget unless num_slots.

    runner_options: ModelRunner's max_holes_per_row / bucket_sizes / kv_dtype.
    """
    max_forced_tokens = forced_token_room(policy, max_forced_tokens)
    max_gen_len = generated_entries(policy, max_forced_tokens)
    num_slots = num_slots or default_num_slots(policy, sizing_k(budget))
    runner = ModelRunner(model, num_slots, max_gen_len, clock=clock, **runner_options)
    pool = KVPool(num_slots, runner.store.bytes_per_slot)
    scheduler = Scheduler(policy, budget, pool, max_gen_len, share_prefix=share_prefix,
                          max_forced_tokens=max_forced_tokens)
    return Engine(name, scheduler, runner, frontend, seed=seed, debug=debug, clock=clock)
