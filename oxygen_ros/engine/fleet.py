"""FleetEngine: R robots served by one model and one KV store, in batched model calls.

Each robot keeps everything the single-robot Engine has per robot: a scheduler (its requests,
decode budget, pool deadlines, frame numbering), a frontend (robot spec, tokenizer, norm stats), an
output processor and a noise seed. What the robots share is the model, the KV store and the
model calls. One tick, as the runtime drives it:

    1. act({robot: obs})    robots whose frame is due send an observation (the others none);
                            per robot: prepare it (a bad one rejects that robot only) and
                            take a frame slot from its own KV quota; then ONE prefill over
                            every robot's row (or prefills of max_prefill_rows rows each)
                            and ONE denoise over every row
    2. advance_language()   per robot: admit (a request adopts its frame's slot), choose k
                            with its own budget; then rounds: every robot's scheduler plans
                            its next step, and the rows of all robots run as ONE first-token
                            call and ONE batched decode step; tokens go back to each robot

So a robot's tokens and actions are those of a single-robot Engine over the same frames
(greedy tokens identical; actions equal up to the float rounding of a larger batch), and a
robot that sends no frame costs the others nothing but its live requests' decode rows.

max_prefill_rows trades a prefill's peak activations (~25 MB per pi05-cpu row on the CPU,
next to 54 MB of weights) against batching: a compute-bound CPU gains nothing from rows of
one prefill (measured: P(4) > 4 P(1) there), a GPU reads the weights once for all of them
(None: every row in one call).

KV quotas: the store's slots are partitioned (KVPool.partition); a robot's scheduler sees a
QuotaPool of its quota and admits only what its quota holds to the end (scheduler.py), and the
quotas add up to the store, so no robot's language can take another robot's action slot.

Shapes: B rows of a batched call (one per robot with a frame), H action rows, A action width.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Mapping

import numpy as np

from oxygen_ros.engine.budget import Budget, sizing_k, UnlimitedBudget
from oxygen_ros.engine.engine import DEFAULT_MAX_FORCED_TOKENS, FrontendClock
from oxygen_ros.engine.frontend import Frontend, held_rows, PreparedObservation
from oxygen_ros.engine.output import OutputProcessor
from oxygen_ros.engine.runner import ModelRunner, Runner
from oxygen_ros.engine.scheduler import Scheduler, StepPlan
from oxygen_ros.engine.types import (ActionOutput, Continuation, FrameResult, Observation,
                                     Timings)
from oxygen_ros.engine.workload import default_num_slots, frame_noise, LanguagePolicy
from oxygen_ros.kv import KVPool
from oxygen_ros.model.pi05 import Pi05Model
from oxygen_ros.model.rtc import RowPlan

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class FleetRobot:
    """One robot of a fleet, as configured: name, adapter, language policy, budget, quota."""

    name: str                    # e.g. 'arm_left'; unique in the fleet
    frontend: Frontend           # robot spec, tokenizer and norm stats of this robot
    policy: LanguagePolicy       # when its requests start and how long they run
    budget: Budget               # its decode budget k (fixed or adaptive)
    kv_quota: int | None = None  # KV slots it may hold (None: default_num_slots of its policy)
    seed: int = 0                # flow-matching noise seed (as make_engine's)

    def quota(self) -> int:
        return self.kv_quota or default_num_slots(self.policy, sizing_k(self.budget))


@dataclasses.dataclass
class FleetMember:
    """A robot inside the engine: its scheduler (over its KV share), frontend, numbering."""

    name: str
    scheduler: Scheduler         # its requests, budget, policy; its pool is a QuotaPool
    frontend: Frontend
    seed: int = 0                # flow-matching noise seed
    output: OutputProcessor = dataclasses.field(init=False)
    next_frame_index: int = 0
    last_frame_index: int = -1
    frame: _Frame | None = None          # the frame act() began, until advance_language()

    def __post_init__(self):
        self.output = OutputProcessor(self.frontend)


@dataclasses.dataclass
class _Frame:
    """One robot's frame between act() and advance_language()."""

    robot: FleetMember
    index: int
    obs: Observation
    prepared: PreparedObservation
    plan: RowPlan | None = None   # real-time chunking of this robot's row (None: free)
    held: np.ndarray | None = None   # the committed rows it holds, robot units (prefix mode)
    slot: int = -1
    action: ActionOutput | None = None


@dataclasses.dataclass
class FleetActions:
    """What act() returned: the chunk of every robot with a frame, and the rejected ones."""

    actions: dict[str, ActionOutput]   # robot -> its action chunk, ready to publish
    rejected: dict[str, str]           # robot -> why its observation gave no actions
    prefill_rows: int                  # frames prefilled and denoised this tick
    act_s: float                       # wall time of act(): every chunk's latency


@dataclasses.dataclass
class FleetResult:
    """Everything one tick produced: one FrameResult per robot with work, and the shared side."""

    robots: dict[str, FrameResult]     # robots with a frame or live requests this tick
    rejected: dict[str, str]           # robot -> why its observation gave no actions
    prefill_rows: int                  # frames prefilled and denoised (0: no frame)
    batch_sizes: list[int]             # rows of every decode step, all robots together
    timings: Timings                   # the tick's wall time (each robot's frame is the tick)
    kv_usage: dict                     # the shared pool's usage

    @property
    def decode_batch_size(self) -> int:
        """Largest decode batch of the tick (0 when no decode step ran)."""
        return max(self.batch_sizes, default=0)


class FleetEngine(FrontendClock):
    """One model, one KV store, R robots: batched prefill, denoise and decode (see module doc)."""

    system = 'fleet'

    def __init__(self, members: list[FleetMember], runner: Runner, pool: KVPool, *,
                 max_prefill_rows: int | None = None, debug: bool = False,
                 clock: Callable[[], float] = time.perf_counter):
        if max_prefill_rows is not None and max_prefill_rows < 1:
            raise ValueError(f'max_prefill_rows must be >= 1 or None, got {max_prefill_rows}')
        self.robots = {m.name: m for m in members}
        self.max_prefill_rows = max_prefill_rows   # rows per prefill call (None: all)
        self.runner = runner
        self.pool = pool
        self.debug = debug
        self.clock = clock
        self.last_result: FleetResult | None = None
        self._act: FleetActions | None = None     # the tick's act(), until advance_language()
        self._tick_start: float | None = None
        self._frontend_s = 0.0

    # ---- state and controls ------------------------------------------------------------------

    @property
    def robot_names(self) -> list[str]:
        return list(self.robots)

    @property
    def num_live_requests(self) -> int:
        return sum(len(r.scheduler.active) for r in self.robots.values())

    def live_requests(self, robot: str) -> int:
        return len(self._robot(robot).scheduler.active)

    def scheduler(self, robot: str) -> Scheduler:
        """Return the scheduler of one robot (its requests, budget, policy and KV share)."""
        return self._robot(robot).scheduler

    def set_budget(self, robot: str, budget: Budget | None) -> None:
        """Use `budget` for `robot` from the next tick on (None: unlimited)."""
        self._robot(robot).scheduler.budget = UnlimitedBudget() if budget is None else budget

    def set_policy(self, robot: str, policy: LanguagePolicy) -> None:
        """Use `policy` for requests of `robot` that arrive from the next tick on."""
        self._robot(robot).scheduler.policy = policy

    def close(self) -> None:
        """Nothing is held outside this process."""

    def _robot(self, name: str) -> FleetMember:
        try:
            return self.robots[name]
        except KeyError:
            raise ValueError(f'unknown robot {name!r}; the fleet has {self.robot_names}') from None

    # ---- 1. the action path of every robot with a frame ------------------------------------

    def act(self, observations: Mapping[str, Observation],
            continuations: Mapping[str, Continuation] | None = None) -> FleetActions:
        """Prefill every robot's observation in one call, denoise them in one call.

        observations: robot name -> this tick's observation (robots without a frame absent).
        continuations: robot name -> the chunk it is executing, which its new chunk continues
        (real-time chunking, rows of one denoise call; robots absent: plain flow matching).
        A robot whose observation (or committed chunk) the frontend rejects gets no actions
        (reason in `rejected`) and holds nothing; the others are not affected. Raises
        ValueError for an unknown robot name (nothing done), and re-raises a failing model
        call after releasing every frame.
        """
        for name in observations:
            self._robot(name)
        start = self._tick_start = self.clock()
        self.runner.reset_times()
        self._frontend_s = 0.0
        frames, rejected = [], {}
        continuations = continuations or {}
        for name, obs in observations.items():
            frame = self._begin_frame(self.robots[name], obs, continuations.get(name),
                                      rejected)
            if frame is not None:
                frames.append(frame)
        if frames:
            self._run_action_path(frames, rejected)
        act_s = self.clock() - start
        actions = {}
        for frame in frames:
            if frame.robot.name in rejected:
                continue
            sched = frame.robot.scheduler
            sched.after_actions()
            sched.budget.observe_action(act_s)
            frame.action.inference_time_s = act_s
            frame.robot.frame = frame
            actions[frame.robot.name] = frame.action
        self._act = FleetActions(actions, rejected, len(frames), act_s)
        return self._act

    def _begin_frame(self, robot: FleetMember, obs: Observation,
                     continuation: Continuation | None,
                     rejected: dict[str, str]) -> _Frame | None:
        if robot.frame is not None:
            # act() twice without advance_language(): the earlier frame gets no language.
            logger.warning('%s: frame %d got no advance_language(); it starts no request',
                           robot.name, robot.frame.index)
            robot.scheduler.drop_frame()
            robot.frame = None
        index = robot.next_frame_index if obs.frame_index is None else int(obs.frame_index)
        try:
            with self._frontend_clock():
                prepared = robot.frontend.prepare(obs)
                plan = (robot.frontend.row_plan(continuation, prepared,
                                                self.runner.action_shape[0])
                        if continuation is not None else None)
        except ValueError as err:   # this robot's observation only: nothing is held yet
            rejected[robot.name] = str(err)
            return None
        robot.next_frame_index = index + 1
        robot.last_frame_index = index
        return _Frame(robot, index, obs, prepared, plan, held_rows(continuation, plan))

    def _run_action_path(self, frames: list[_Frame], rejected: dict[str, str]) -> None:
        """Slots from each robot's quota, then one prefill and one denoise over all rows."""
        try:
            for frame in frames:
                frame.slot = frame.robot.scheduler.allocate_frame_slot(frame.index)
            frames.sort(key=lambda f: f.slot)   # a run of slots is read as a view
            slots = [f.slot for f in frames]
            step = self.max_prefill_rows or len(frames)
            for first in range(0, len(frames), step):
                chunk = frames[first:first + step]
                self.runner.prefill_rows([f.prepared.tensors for f in chunk],
                                         slots[first:first + step])
            H, A = self.runner.action_shape
            noise = np.stack([frame_noise(f.robot.seed, f.index, H, A) for f in frames])
            plans = [f.plan for f in frames]
            normalized = self.runner.sample_actions_rows(
                slots, noise, plans if any(plans) else None)                  # [B, H, A]
        except BaseException:
            for frame in frames:
                frame.robot.scheduler.drop_frame()
            raise
        for frame, rows in zip(frames, normalized):
            try:
                with self._frontend_clock():
                    actions = frame.robot.frontend.robot_actions(rows, frame.prepared,
                                                                 frame.held)
            except ValueError as err:   # e.g. non-finite actions: this robot only
                rejected[frame.robot.name] = f'actions: {err}'
                frame.robot.scheduler.drop_frame()
                continue
            frame.action = ActionOutput(frame.index, actions, rows, 0.0, frame.obs.stamp,
                                        frame.plan.delay if frame.plan is not None else 0)

    # ---- 2. the language path of every robot, in shared decode steps -------------------------

    def advance_language(self) -> FleetResult:
        """Admit each framed robot's request, run the tick's token steps for all robots at once.

        Without a preceding act() it advances the live requests of every robot (no new
        request). Returns the tick's FleetResult (also kept in `self.last_result`).
        """
        start = self.clock()
        act, self._act = self._act, None
        tick_start = self._tick_start if act is not None else start
        self._tick_start = None
        if act is None:
            self.runner.reset_times()
            self._frontend_s = 0.0
        frames = {}
        working = []
        for robot in self.robots.values():
            frame, robot.frame = robot.frame, None
            if frame is None and not robot.scheduler.active:
                continue
            robot.scheduler.begin_language()
            if frame is not None:
                frames[robot.name] = frame
                self._admit(frame)
            working.append(robot)
        ks = {r.name: r.scheduler.choose_k(self.clock() - tick_start) for r in working}
        batch_sizes = self._token_steps(working, tick_start)
        act_s = act.act_s if act is not None else 0.0
        total_s = act_s + self.clock() - start
        timings = self._timings(act_s, total_s)
        results = {}
        for robot in working:
            touched, ended = robot.scheduler.end_language()
            with self._frontend_clock():
                deltas, finished = robot.output.report(touched, ended, robot.last_frame_index)
            frame = frames.get(robot.name)
            results[robot.name] = FrameResult(
                frame_index=frame.index if frame else -1, action=frame.action if frame else None,
                deltas=deltas, finished=finished, k=ks[robot.name],
                decode_steps=len(robot.scheduler.batch_sizes),
                batch_sizes=list(robot.scheduler.batch_sizes),
                active_requests=len(robot.scheduler.active), timings=timings,
                kv_usage=robot.scheduler.pool.usage())
        timings.frontend_s = self._frontend_s   # detokenizing counted too
        self.last_result = FleetResult(results, dict(act.rejected) if act else {},
                                       act.prefill_rows if act else 0, batch_sizes, timings,
                                       self.pool.usage())
        if self.debug:
            self.check()
        return self.last_result

    def _admit(self, frame: _Frame) -> None:
        robot = frame.robot
        try:
            forced = []
            policy = robot.scheduler.policy
            if policy.prompt_template:
                with self._frontend_clock():
                    forced = robot.frontend.encode_text(policy.prompt_text(frame.obs.instruction))
            admission = robot.scheduler.admit(frame.index, forced)
            # Fleet schedulers share prefixes: a request adopts its frame's slot, no prefill.
            assert admission is None or not admission.needs_prefill
        except Exception as err:   # noqa: BLE001 - a language failure must not leak a slot
            logger.error('%s frame %d: no language request started: %r', robot.name,
                         frame.index, err)
            robot.scheduler.drop_frame()

    def _token_steps(self, working: list[FleetMember], tick_start: float) -> list[int]:
        """Run rounds of every robot's next step together; return rows of each decode step."""
        batch_sizes = []
        open_robots = list(working)
        while open_robots:
            plans: list[tuple[FleetMember, StepPlan]] = []
            for robot in list(open_robots):
                plan = robot.scheduler.schedule(self.clock() - tick_start)
                if plan is None:
                    open_robots.remove(robot)   # done for this tick (quota or deadline)
                else:
                    plans.append((robot, plan))
            first = [(r, p) for r, p in plans if p.first_token]
            if first:
                self._run_plans(first, first_token=True)
            decode = [(r, p) for r, p in plans if not p.first_token]
            if decode:
                batch_sizes.append(self._run_plans(decode, first_token=False))
        return batch_sizes

    def _run_plans(self, plans: list[tuple[FleetMember, StepPlan]], first_token: bool) -> int:
        """Run the rows of several robots' plans as one model call; return the row count."""
        # Slots are distinct across robots (a partitioned pool), so a slot names its row.
        rows = sorted((slot, gen_len, token) for _, plan in plans for slot, gen_len, token in
                      zip(plan.slots, plan.gen_lens or [0] * plan.size,
                          plan.tokens or [0] * plan.size))
        slots = [slot for slot, _, _ in rows]
        try:
            if first_token:
                token_ids = self.runner.first_tokens(slots)
            else:
                token_ids = self.runner.decode(slots, [g for _, g, _ in rows],
                                               [t for _, _, t in rows])
        except Exception as err:   # a language failure must not reach the action path
            for robot, plan in plans:
                robot.scheduler.fail(plan.request_ids, err)
            return len(rows)
        by_slot = dict(zip(slots, token_ids))
        for robot, plan in plans:
            robot.scheduler.update(plan, [by_slot[s] for s in plan.slots],
                                   self.runner.last_call_s)
        return len(rows)

    # ---- results -------------------------------------------------------------------------

    def step(self, observations: Mapping[str, Observation]) -> FleetResult:
        """act() then advance_language(): one whole tick."""
        self.act(observations)
        return self.advance_language()

    def _timings(self, act_s: float, total_s: float) -> Timings:
        seconds = self.runner.seconds
        timings = Timings(prefill_s=seconds['prefill'], action_s=seconds['action'],
                          decode_s=seconds['decode'], total_s=total_s, act_s=act_s,
                          frontend_s=self._frontend_s)
        timings.overhead_s = max(total_s - timings.model_s, 0.0)
        return timings

    def check(self) -> None:
        """Assert every robot's scheduler invariants (and so the shared pool's)."""
        for robot in self.robots.values():
            robot.scheduler.check()

    def __str__(self) -> str:
        lines = [f'fleet of {len(self.robots)} robots, {self.pool}']
        lines += [f'{name}: {robot.scheduler}' for name, robot in self.robots.items()]
        return '\n'.join(lines)


def make_fleet(model: Pi05Model, robots: list[FleetRobot], *,
               max_forced_tokens: int | None = None, max_prefill_rows: int | None = None,
               debug: bool = False, clock: Callable[[], float] = time.perf_counter,
               **runner_options) -> FleetEngine:
    """Build a FleetEngine: one ModelRunner whose store has the sum of the robots' quotas.

    max_prefill_rows: rows per prefill call (None: every framed robot in one call).

    runner_options: ModelRunner's max_holes_per_row / bucket_sizes / kv_dtype.
    Raises ValueError for an empty fleet, repeated names or a frontend made for another model.
    """
    if not robots:
        raise ValueError('a fleet needs at least one robot')
    names = [r.name for r in robots]
    if len(set(names)) != len(names):
        raise ValueError(f'robot names must be unique, got {names}')
    cfg = model.config
    for robot in robots:
        adapter = robot.frontend.adapter
        if (adapter.action_dim, adapter.image_size) != (cfg.action_dim, cfg.vision.image_size):
            raise ValueError(f'{robot.name}: frontend made for action_dim {adapter.action_dim}'
                             f', images {adapter.image_size}; the model has {cfg.action_dim}, '
                             f'{cfg.vision.image_size}')
    if max_forced_tokens is None:
        templated = any(r.policy.prompt_template for r in robots)
        max_forced_tokens = DEFAULT_MAX_FORCED_TOKENS if templated else 0
    # One slot length for every robot: the longest request any of them may write.
    max_gen_len = max_forced_tokens + max(r.policy.max_request_len for r in robots) - 1
    quotas = {r.name: r.quota() for r in robots}
    runner = ModelRunner(model, sum(quotas.values()), max_gen_len, clock=clock,
                         **runner_options)
    pool = KVPool(sum(quotas.values()), runner.store.bytes_per_slot)
    shares = pool.partition(quotas)
    members = [FleetMember(r.name, Scheduler(r.policy, r.budget, shares[r.name], max_gen_len,
                                             share_prefix=True,
                                             max_forced_tokens=max_forced_tokens),
                           r.frontend, r.seed) for r in robots]
    return FleetEngine(members, runner, pool, max_prefill_rows=max_prefill_rows, debug=debug,
                       clock=clock)
