"""Engine: one robot's System, a thin view of a one-member FleetEngine (the one frame path).

One frame, in the order the work happens (the runtime publishes the actions between 1 and 2):

    1. act(obs)            frontend.prepare(obs); scheduler gives the frame slot s_t;
                           runner prefills s_t and samples actions    returned at once
    2. advance_language()  scheduler admits (a request starting at t adopts s_t), picks k,
                           then plans step after step; the runner executes each plan; the
                           output processor turns the requests' new ids into deltas and text

The steps themselves are FleetEngine's (engine/fleet.py); this view gives them the System
protocol's one-robot shape (an observation in, an ActionOutput and a FrameResult out) and
raises what the fleet reports per robot. The engine holds no tensor (the runner does) and
makes no decision (the scheduler does).
"""

from __future__ import annotations

import time
from typing import Callable

from oxygen_ros.engine.budget import Budget, sizing_k
from oxygen_ros.engine.fleet import (DEFAULT_MAX_FORCED_TOKENS, FleetActions, FleetEngine,
                                     FleetMember, FleetResult, forced_token_room,
                                     generated_entries, kv_usage, num_blocks_for, ONE_ROBOT,
                                     pool_block_bytes, pool_slot_bytes, Tasks)
from oxygen_ros.engine.frontend import Frontend
from oxygen_ros.engine.output import OutputProcessor
from oxygen_ros.engine.runner import ModelRunner, Runner
from oxygen_ros.engine.scheduler import Scheduler
from oxygen_ros.engine.types import ActionOutput, Continuation, FrameResult, Observation
from oxygen_ros.engine.workload import as_tasks, LanguagePolicy, tasks_num_slots
from oxygen_ros.kv import KVPool
from oxygen_ros.model.pi05 import Pi05Model

__all__ = ['DEFAULT_MAX_FORCED_TOKENS', 'Engine', 'forced_token_room', 'generated_entries',
           'make_engine', 'pool_block_bytes', 'pool_slot_bytes']


class Engine:
    """A System over one model: oxygen, oxygen-adaptive, shared or isolated (see make_engine).

    `fleet` is the one-member FleetEngine doing the work; `robot` its member's name.
    """

    def __init__(self, name: str, scheduler: Scheduler, runner: Runner, frontend: Frontend,
                 *, seed: int = 0, debug: bool = False,
                 clock: Callable[[], float] = time.perf_counter, robot: str = ONE_ROBOT):
        self.system = name
        self.robot = robot
        self.fleet = FleetEngine([FleetMember(robot, scheduler, frontend, seed)], runner,
                                 scheduler.pool, blocks=scheduler.blocks, debug=debug,
                                 clock=clock)
        self.last_result: FrameResult | None = None

    @classmethod
    def view(cls, fleet: FleetEngine, robot: str, name: str = 'oxygen') -> Engine:
        """Return the System view of a one-member fleet (its robot `robot`)."""
        assert list(fleet.robots) == [robot], f'a view needs a one-robot fleet, not {fleet}'
        engine = cls.__new__(cls)
        engine.system, engine.robot, engine.fleet, engine.last_result = name, robot, fleet, None
        return engine

    # ---- the System protocol's state and controls ----------------------------------------

    @property
    def _member(self) -> FleetMember:
        return self.fleet.robots[self.robot]

    @property
    def scheduler(self) -> Scheduler:
        return self._member.scheduler

    @property
    def runner(self) -> Runner:
        return self.fleet.runner

    @runner.setter
    def runner(self, runner: Runner) -> None:
        self.fleet.runner = runner

    @property
    def frontend(self) -> Frontend:
        return self._member.frontend

    @frontend.setter
    def frontend(self, frontend: Frontend) -> None:
        self._member.frontend = frontend

    @property
    def output(self) -> OutputProcessor:
        return self._member.output

    @property
    def clock(self) -> Callable[[], float]:
        return self.fleet.clock

    @property
    def seed(self) -> int:
        return self._member.seed

    @property
    def policy(self) -> LanguagePolicy:
        return self.scheduler.policy

    @property
    def budget(self) -> Budget:
        return self.scheduler.budget

    @property
    def pool(self) -> KVPool:
        """Prefix slot ids and their byte accounting (num_slots, total_bytes, usage())."""
        return self.scheduler.pool

    @property
    def blocks(self) -> KVPool:
        """Generation block ids and their byte accounting (one per live request)."""
        return self.scheduler.blocks

    @property
    def num_live_requests(self) -> int:
        return len(self.scheduler.active)

    def set_budget(self, budget: Budget | None) -> None:
        """Use `budget` from the next frame on (None: unlimited); the pool keeps its size."""
        self.fleet.set_budget(self.robot, budget)

    def set_policy(self, policy: LanguagePolicy) -> None:
        """Use `policy` for requests that arrive from the next frame on."""
        self.fleet.set_policy(self.robot, policy)

    def close(self) -> None:
        """Nothing is held outside this process."""

    # ---- the frame ---------------------------------------------------------------------------

    def act(self, obs: Observation, continuation: Continuation | None = None) -> ActionOutput:
        """Prefill the observation into a pool slot and compute its actions; no language work.

        continuation: the chunk the robot is executing, which this one continues (real-time
        chunking, on the same prefill); the output's start_row is then its delay.
        Raises ObservationError (a ValueError) for a malformed observation, and what else
        failed (a bad committed chunk, a model call) as it is; nothing stays allocated.
        """
        continuations = {self.robot: continuation} if continuation is not None else None
        return self._one(self.fleet.act({self.robot: obs}, continuations))

    def language_task(self, obs: Observation) -> FrameResult:
        """Only the language half of a frame, with its own prefill (the parallel baseline)."""
        result = self.fleet.language_task({self.robot: obs})
        self._one(result)
        return self._result(result)

    def advance_language(self, deadline_s: float | None = None) -> FrameResult:
        """Admit this frame's request, run the frame's token steps, report deltas and endings.

        deadline_s: when the frame's language must end, seconds after act() began (None: the
        budget's period). Returns the frame's FrameResult (also kept in `self.last_result`).
        Without a preceding act() it just advances the live requests (no new request).
        """
        return self._result(self.fleet.advance_language(deadline_s=deadline_s))

    def step(self, obs: Observation) -> FrameResult:
        """act() then advance_language(): one whole frame."""
        self.act(obs)
        return self.advance_language()

    def _one(self, outcome: FleetActions | FleetResult) -> ActionOutput | None:
        """Return this robot's chunk of a fleet call, or raise why it has none."""
        why = outcome.rejected.get(self.robot) or outcome.failed.get(self.robot)
        if why is not None:
            raise why
        return outcome.actions[self.robot] if isinstance(outcome, FleetActions) else None

    def _result(self, result: FleetResult) -> FrameResult:
        """Return this robot's FrameResult of a tick (an empty one when it had nothing to do)."""
        mine = result.robots.get(self.robot)
        if mine is None:
            mine = FrameResult(frame_index=-1, action=None, deltas=[], finished=[], k=0,
                               decode_steps=0, batch_sizes=[], active_requests=0,
                               timings=result.timings,
                               kv_usage=kv_usage(self.pool, self.blocks))
        self.last_result = mine
        return mine

    def check(self) -> None:
        """Assert the scheduler's and the pool's invariants."""
        self.fleet.check()

    def __str__(self) -> str:
        return f'{self.system}: {self.scheduler}'


def make_engine(name: str, model: Pi05Model, frontend: Frontend, policy: Tasks,
                budget: Budget, *, share_prefix: bool = True, num_slots: int | None = None,
                num_blocks: int | None = None, seed: int = 0,
                max_forced_tokens: int | None = None, debug: bool = False,
                clock: Callable[[], float] = time.perf_counter, **runner_options) -> Engine:
    """Build an Engine: slots and blocks sized for the tasks and the budget unless given.

    num_slots / num_blocks: prefix slots / generation blocks (None: sized from the tasks).

    policy: the language tasks (a LanguagePolicy: narration alone).
    runner_options: ModelRunner's max_holes_per_row / bucket_sizes / kv_dtype.
    """
    tasks = as_tasks(policy)
    max_forced_tokens = forced_token_room(tasks, max_forced_tokens)
    max_gen_len = generated_entries(tasks, max_forced_tokens)
    k = sizing_k(budget)
    num_slots = num_slots or tasks_num_slots(tasks, k)
    num_blocks = num_blocks or num_blocks_for(tasks, k, num_slots)
    runner = ModelRunner(model, num_slots, max_gen_len, clock=clock, num_blocks=num_blocks,
                         **runner_options)
    pool = KVPool(num_slots, runner.store.bytes_per_slot)
    blocks = KVPool(num_blocks, runner.store.bytes_per_block)
    scheduler = Scheduler(tasks, budget, pool, max_gen_len, share_prefix=share_prefix,
                          max_forced_tokens=max_forced_tokens, blocks=blocks)
    return Engine(name, scheduler, runner, frontend, seed=seed, debug=debug, clock=clock)
