"""FleetEngine: the one frame path, for R robots served by one model and one KV store.

One robot is a fleet of one (engine.Engine is a thin view of a one-member FleetEngine), so
the frame steps below are the only ones in the package.

Each robot keeps what is its own: a scheduler (its requests, decode budget, pool deadlines,
frame numbering), a frontend (robot spec, tokenizer, norm stats), an output processor and a
noise seed. What the robots share is the model, the KV store and the model calls. One tick, as
the runtime drives it:

    1. act({robot: obs})    robots whose frame is due send an observation (the others none);
                            per robot: prepare it (a bad one rejects that robot only) and
                            take a frame slot from its own KV quota; then ONE prefill over
                            every robot's row (or prefills of max_prefill_rows rows each)
                            and ONE denoise over every row
    2. advance_language()   per robot: admit (a request adopts its frame's slot, or, isolated,
                            is prefilled into a slot of its own), choose k with its own budget
                            against the tick's one deadline; then rounds: every robot's
                            scheduler plans its next step, and the rows of all robots run as
                            ONE first-token call and ONE batched decode step

So a robot's tokens and actions are those it would get alone (greedy tokens identical;
actions equal up to the float rounding of a larger batch), and a robot that sends no frame
costs the others nothing but its live requests' decode rows.

A single row (one robot, or max_prefill_rows=1) runs through the runner's one-row calls,
which read the store by slice; several rows through its batched calls. max_prefill_rows trades
a prefill's peak activations (~25 MB per pi05-cpu row on the CPU, next to 54 MB of weights)
against batching: a compute-bound CPU gains nothing from rows of one prefill (measured:
P(4) > 4 P(1) there), a GPU reads the weights once for all of them (None: all in one call).

Row threads (row_threads > 1, a CPU option): the rows of the action path run side by side,
each robot's prefill and denoise on its own Python thread (torch's ops release the GIL), the
process's torch threads divided among them. On a CPU that is what R separate processes get
from their cores, without their R copies of the weights; one batched call with all torch
threads on one row loses to it (measured on 2 cores, 2 robots: 1.6 rows/s side by side with
one torch thread each, 1.5 rows/s from 2 processes, 0.3-1.0 rows/s from one call with 2
threads while other work ran). The token steps follow the rows: each robot's steps (its own
requests batched across its frames) on its row thread, side by side, so no core idles while
one thread decodes every robot's rows.

KV quotas: the store's slots are partitioned (KVPool.partition); a robot's scheduler sees a
QuotaPool of its quota and admits only what its quota holds to the end (scheduler.py), and the
quotas add up to the store, so no robot's language can take another robot's action slot.

What fails where: an observation the frontend rejects (ObservationError) or any other failure
of one robot's own steps (its committed chunk, its action conversion) costs that robot its
actions this tick, reported by kind in FleetActions; a failing shared model call releases
every frame and raises.

Shapes: B rows of a batched call (one per robot with a frame), H action rows, A action width.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
import contextlib
import dataclasses
import logging
import threading
import time
from typing import Callable, Collection, Mapping, Sequence

import numpy as np
import torch

from oxygen_ros.engine.budget import Budget, sizing_k, UnlimitedBudget
from oxygen_ros.engine.frontend import Frontend, held_rows, PreparedObservation
from oxygen_ros.engine.output import OutputProcessor
from oxygen_ros.engine.runner import ModelRunner, Runner
from oxygen_ros.engine.scheduler import extend_tokens, Scheduler, StepPlan
from oxygen_ros.engine.types import (ActionOutput, Continuation, FinishedRequest, FrameResult,
                                     Observation, ObservationError, Timings)
from oxygen_ros.engine.workload import (as_tasks, frame_noise, LanguagePolicy, LanguageTask,
                                        tasks_num_blocks, tasks_num_slots)
from oxygen_ros.kv import KVPool, QuotaPool
from oxygen_ros.kv.store import block_bytes, slot_bytes
from oxygen_ros.model.config import Pi05Config
from oxygen_ros.model.pi05 import Pi05Model
from oxygen_ros.model.rtc import RowPlan

logger = logging.getLogger(__name__)

DEFAULT_MAX_FORCED_TOKENS = 32   # storage reserved per slot for a prompt template's tokens
ON_DEMAND_FORCED_TOKENS = 48     # with an on-demand task: its template and the question
ONE_ROBOT = ''                   # the member name of a one-robot engine (and a plain node)


# ---- slot sizing ------------------------------------------------------------------------------

Tasks = LanguagePolicy | Sequence[LanguageTask]   # a bare policy: the one narration task
# advance_language's hook between steps: robot -> its on-demand requests that just ended
Poll = Callable[[Mapping[str, list[FinishedRequest]]], None]


def forced_token_room(tasks: Tasks, max_forced_tokens: int | None = None) -> int:
    """Entries a block reserves for a prompt template's forced tokens (None: the default)."""
    if max_forced_tokens is not None:
        return max_forced_tokens
    # several robots' tasks may repeat a name: no as_tasks() check here
    tasks = as_tasks(tasks) if isinstance(tasks, LanguagePolicy) else tuple(tasks)
    if any(t.on_demand for t in tasks):
        return ON_DEMAND_FORCED_TOKENS
    templated = any(t.policy.prompt_template for t in tasks)
    return DEFAULT_MAX_FORCED_TOKENS if templated else 0


def generated_entries(tasks: Tasks, max_forced_tokens: int | None = None) -> int:
    """Entries a request writes to its block: forced + N - 1 (its last token is not fed)."""
    longest = max(t.policy.max_request_len for t in as_tasks(tasks))
    return forced_token_room(tasks, max_forced_tokens) + longest - 1


def pool_slot_bytes(config: Pi05Config, kv_dtype: torch.dtype) -> int:
    """Bytes of one prefix slot as make_engine allocates it (before building)."""
    b = config.backbone
    return slot_bytes(b.depth, config.prefix_len, b.num_kv_heads, b.head_dim, b.width, kv_dtype)


def pool_block_bytes(config: Pi05Config, tasks: Tasks, kv_dtype: torch.dtype) -> int:
    """Bytes of one generation block as make_engine allocates it for `tasks` (before building)."""
    b = config.backbone
    return block_bytes(b.depth, generated_entries(tasks), b.num_kv_heads, b.head_dim, kv_dtype)


def num_blocks_for(tasks: Tasks, k: int | None, num_slots: int) -> int:
    """Return the generation blocks for `tasks` next to `num_slots` prefix slots.

    One task: one block per slot (a narration-only robot admits exactly what it did with
    one slot per request); several: workload.tasks_num_blocks, and at least one per slot.
    """
    tasks = as_tasks(tasks)
    return num_slots if len(tasks) == 1 else max(tasks_num_blocks(tasks, k), num_slots)


def kv_usage(pool: KVPool | QuotaPool, blocks: KVPool | QuotaPool) -> dict:
    """Return the KV cache's accounting: the prefix slots' usage() plus the blocks'."""
    usage = pool.usage()
    usage.update(blocks_in_use=blocks.num_in_use, blocks_total=blocks.num_slots,
                 bytes_per_block=blocks.bytes_per_slot, block_bytes_in_use=blocks.bytes_in_use,
                 block_bytes_total=blocks.total_bytes, block_peak_bytes=blocks.peak_bytes,
                 block_holders=blocks.usage()['holders'])
    return usage


# ---- the robots ------------------------------------------------------------------------------

@dataclasses.dataclass
class FleetRobot:
    """One robot of a fleet, as configured: name, adapter, language tasks, budget, quota."""

    name: str                    # e.g. 'arm_left'; unique in the fleet
    frontend: Frontend           # robot spec, tokenizer and norm stats of this robot
    policy: Tasks                # its language tasks (a policy: narration alone)
    budget: Budget               # its decode budget k (fixed or adaptive)
    kv_quota: int | None = None  # prefix slots it may hold (None: sized from its tasks)
    seed: int = 0                # flow-matching noise seed (as make_engine's)

    @property
    def tasks(self) -> tuple[LanguageTask, ...]:
        return as_tasks(self.policy)

    def quota(self) -> int:
        return self.kv_quota or tasks_num_slots(self.tasks, sizing_k(self.budget))

    def block_quota(self) -> int:
        """Return the generation blocks it may hold (see num_blocks_for)."""
        return num_blocks_for(self.tasks, sizing_k(self.budget), self.quota())


@dataclasses.dataclass
class FleetMember:
    """A robot inside the engine: its scheduler (over its KV share), frontend, numbering."""

    name: str
    scheduler: Scheduler         # its requests, budget, policy; its pool is its KV share
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
    """What act() returned: the chunk of every robot with a frame, and why the others got none."""

    actions: dict[str, ActionOutput]   # robot -> its action chunk, ready to publish
    rejected: dict[str, ObservationError]   # robot -> its observation was bad (input)
    failed: dict[str, Exception]       # robot -> any other failure of its own steps
    prefill_rows: int                  # frames prefilled and denoised this tick
    act_s: float                       # wall time of act(): every chunk's latency


@dataclasses.dataclass
class FleetResult:
    """Everything one tick produced: one FrameResult per robot with work, and the shared side."""

    robots: dict[str, FrameResult]     # robots whose language ran this tick
    rejected: dict[str, ObservationError]   # robot -> its observation was bad (input)
    failed: dict[str, Exception]       # robot -> any other failure of its action path
    prefill_rows: int                  # frames prefilled and denoised (0: no frame)
    batch_sizes: list[int]             # rows of every decode step, all robots together
    timings: Timings                   # the tick's wall time (each robot's frame is the tick)
    kv_usage: dict                     # the shared pool's usage

    @property
    def decode_batch_size(self) -> int:
        """Largest decode batch of the tick (0 when no decode step ran)."""
        return max(self.batch_sizes, default=0)


# ---- the engine ------------------------------------------------------------------------------

class FleetEngine:
    """One model, one KV store, R >= 1 robots: the frame path (see module doc)."""

    system = 'fleet'

    def __init__(self, members: list[FleetMember], runner: Runner, pool: KVPool, *,
                 blocks: KVPool | None = None, max_prefill_rows: int | None = None,
                 row_threads: int = 1, debug: bool = False,
                 clock: Callable[[], float] = time.perf_counter):
        if max_prefill_rows is not None and max_prefill_rows < 1:
            raise ValueError(f'max_prefill_rows must be >= 1 or None, got {max_prefill_rows}')
        if row_threads < 1:
            raise ValueError(f'row_threads must be >= 1, got {row_threads}')
        self.robots = {m.name: m for m in members}
        self.max_prefill_rows = max_prefill_rows   # rows per prefill call (None: all)
        # Rows of the action path side by side (module doc); started by the first tick.
        self._rows = (ThreadPoolExecutor(row_threads, thread_name_prefix='oxy_rows')
                      if row_threads > 1 and len(members) > 1 else None)
        self.runner = runner
        self.pool = pool            # prefix slots
        # generation blocks (None: the one member's own, as Engine builds it)
        self.blocks = blocks if blocks is not None else members[0].scheduler.blocks
        self.debug = debug
        self.clock = clock
        self.last_result: FleetResult | None = None
        self._act: FleetActions | None = None     # the tick's act(), until advance_language()
        self._tick_start: float | None = None
        self._frontend_s = 0.0                    # frontend time since the tick began
        self._frontend_lock = threading.Lock()
        self._after_steps_s = 0.0                 # last advance_language after its last step

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
        """Let the row threads (if any) end once idle; nothing else is held outside."""
        if self._rows is not None:
            self._rows.shutdown(wait=False)   # a tick still running finishes its rows

    def _robot(self, name: str) -> FleetMember:
        try:
            return self.robots[name]
        except KeyError:
            raise ValueError(f'unknown robot {name!r}; the fleet has {self.robot_names}') from None

    @contextlib.contextmanager
    def _frontend_clock(self):
        """Count the enclosed time as frontend work (conversion), not manager overhead."""
        start = self.clock()
        try:
            yield
        finally:
            with self._frontend_lock:   # row threads convert their robots' frames at once
                self._frontend_s += self.clock() - start

    # ---- 1. the action path of every robot with a frame ------------------------------------

    def act(self, observations: Mapping[str, Observation],
            continuations: Mapping[str, Continuation] | None = None) -> FleetActions:
        """Prefill every robot's observation, denoise them all; no language work.

        observations: robot name -> this tick's observation (robots without a frame absent).
        continuations: robot name -> the chunk it is executing, which its new chunk continues
        (real-time chunking on the same prefill; robots absent: plain flow matching).
        A robot whose observation the frontend rejects (`rejected`) or whose own steps fail
        (`failed`) gets no actions and holds nothing; the others are not affected. Raises
        ValueError for an unknown robot name (nothing done), and re-raises a failing model
        call after releasing every frame.
        """
        for name in observations:
            self._robot(name)
        start = self._begin_tick()
        frames, rejected, failed = [], {}, {}
        continuations = continuations or {}

        def begin(name: str) -> _Frame | Exception:
            try:
                return self._begin_frame(self.robots[name], observations[name],
                                         continuations.get(name))
            except Exception as err:   # noqa: BLE001 - sorted below: this robot only
                return err
        # Each robot's frontend (image conversion, tokens) on its row thread, side by side.
        begun = (self._rows.map(begin, observations) if self._rows is not None
                 and len(observations) > 1 else map(begin, observations))
        for name, frame in zip(list(observations), list(begun)):
            if isinstance(frame, ObservationError):   # its input only: nothing is held yet
                rejected[name] = frame
            elif isinstance(frame, Exception):   # e.g. a bad committed chunk
                failed[name] = frame
            else:
                frames.append(frame)
        if frames:
            self._run_action_path(frames, failed)
        act_s = self.clock() - start
        actions = {}
        for frame in frames:
            if frame.robot.name in failed:
                continue
            scheduler = frame.robot.scheduler
            scheduler.after_actions()
            scheduler.budget.observe_action(act_s)
            frame.action.inference_time_s = act_s
            frame.robot.frame = frame
            actions[frame.robot.name] = frame.action
        self._act = FleetActions(actions, rejected, failed, len(frames), act_s)
        return self._act

    def _begin_tick(self) -> float:
        start = self._tick_start = self.clock()
        self.runner.reset_times()
        self._frontend_s = 0.0
        return start

    def _begin_frame(self, robot: FleetMember, obs: Observation,
                     continuation: Continuation | None) -> _Frame:
        if robot.frame is not None:
            # act() twice without advance_language(): the earlier frame gets no language.
            logger.warning('%sframe %d: act() called again before advance_language(); it '
                           'starts no request', _who(robot), robot.frame.index)
            robot.scheduler.drop_frame()
            robot.frame = None
        index = robot.next_frame_index if obs.frame_index is None else int(obs.frame_index)
        with self._frontend_clock():
            prepared = robot.frontend.prepare(obs)   # may raise: nothing is held yet
            plan = (robot.frontend.row_plan(continuation, prepared, self.runner.action_shape[0])
                    if continuation is not None else None)
        robot.next_frame_index = index + 1
        robot.last_frame_index = index
        return _Frame(robot, index, obs, prepared, plan, held_rows(continuation, plan))

    def _run_action_path(self, frames: list[_Frame], failed: dict[str, Exception]) -> None:
        """Slots from each robot's quota, then the prefills and one denoise over all rows."""
        runner = self.runner
        H, A = runner.action_shape
        try:
            for frame in frames:
                frame.slot = frame.robot.scheduler.allocate_frame_slot(frame.index)
            if len(frames) == 1:   # one row: the runner's one-row calls read slot slices
                normalized = self._row(frames[0])[None]
            elif self._rows is not None:   # rows side by side, one thread each
                normalized = list(self._rows.map(self._row, frames))
            else:
                frames.sort(key=lambda f: f.slot)   # a run of slots is read as a view
                step = self.max_prefill_rows or len(frames)
                for first in range(0, len(frames), step):
                    chunk = frames[first:first + step]
                    if len(chunk) == 1:
                        runner.prefill(chunk[0].prepared.tensors, chunk[0].slot)
                    else:
                        runner.prefill_rows([f.prepared.tensors for f in chunk],
                                            [f.slot for f in chunk])
                noise = np.stack([frame_noise(f.robot.seed, f.index, H, A) for f in frames])
                plans = [f.plan for f in frames]
                normalized = runner.sample_actions_rows(
                    [f.slot for f in frames], noise, plans if any(plans) else None)  # [B, H, A]
        except BaseException:
            for frame in frames:
                frame.robot.scheduler.drop_frame()
            raise
        for frame, rows in zip(frames, normalized):
            try:
                with self._frontend_clock():
                    actions = frame.robot.frontend.robot_actions(rows, frame.prepared,
                                                                 frame.held)
            except Exception as err:   # noqa: BLE001 - e.g. non-finite actions: this robot only
                failed[frame.robot.name] = err
                frame.robot.scheduler.drop_frame()
                continue
            frame.action = ActionOutput(frame.index, actions, rows, 0.0, frame.obs.stamp,
                                        frame.plan.delay if frame.plan is not None else 0)

    def _row(self, frame: _Frame) -> np.ndarray:
        """One frame's prefill and denoise through the one-row calls -> actions [H, A]."""
        runner = self.runner
        runner.prefill(frame.prepared.tensors, frame.slot)
        noise = frame_noise(frame.robot.seed, frame.index, *runner.action_shape)
        return runner.sample_actions(frame.slot, noise, frame.plan)

    def language_task(self, observations: Mapping[str, Observation]) -> FleetResult:
        """Only the language half of a tick, each frame prefilled for its request alone.

        The parallel baseline's language process: no action path, no frame slot; each
        robot's request is admitted into a slot of its own (isolated schedulers only).
        """
        for name in observations:
            assert not self._robot(name).scheduler.share_prefix, (
                'a language-only frame needs its own prefill')
        start = self._begin_tick()
        rejected, failed = {}, {}
        for name, obs in observations.items():
            robot = self.robots[name]
            try:
                robot.frame = self._begin_frame(robot, obs, None)
            except ObservationError as err:
                rejected[name] = err
            except Exception as err:   # noqa: BLE001 - this robot only
                failed[name] = err
        self._act = FleetActions({}, rejected, failed, 0, self.clock() - start)
        return self.advance_language()

    # ---- 2. the language path of every robot, in shared decode steps -------------------------

    def advance_language(self, robots: Collection[str] | None = None,
                         deadline_s: float | None = None,
                         poll: Poll | None = None) -> FleetResult:
        """Admit each framed robot's request, run the tick's token steps for all robots at once.

        robots: whose live requests advance this tick (None: every robot's); a robot with a
        frame from act() always takes part. deadline_s: when this tick's language must end,
        seconds after act() began (the next robot's tick; None: each robot's budget counts
        against its own period). poll(answered): called on this thread before the
        admissions and before every step with the on-demand requests that ended since its
        last call (robot -> FinishedRequests: the frame loop answers its questions at once,
        not at the round's end; the FleetResult has them too), and hands over requests asked
        meanwhile (Scheduler.ask); one asked during the steps starts on the tick's frame when
        its first step fits. Without a preceding act() only live requests advance (no
        new request). Returns the tick's FleetResult (also kept in `self.last_result`).
        """
        start = self.clock()
        act, self._act = self._act, None
        tick_start = self._tick_start if act is not None else start
        self._tick_start = None
        if act is None:
            self.runner.reset_times()
            self._frontend_s = 0.0
        if poll is not None:
            poll({})
        frames, working = {}, []
        for robot in self.robots.values():
            frame, robot.frame = robot.frame, None
            if frame is None and (not robot.scheduler.has_work
                                  or (robots is not None and robot.name not in robots)):
                continue
            robot.scheduler.begin_language()
            if frame is not None:
                frames[robot.name] = frame
            working.append(robot)
        # A robot's budget prices a decode step by all its rows: the others' live requests too
        # (with row threads each robot's steps hold only its own).

        def others() -> int:
            return (sum(len(r.scheduler.active) for r in working)
                    if len(working) > 1 and self._rows is None else 0)
        live = others()
        for robot in working:
            if robot.name in frames:
                self._admit(frames[robot.name], self.clock() - tick_start, deadline_s,
                            max(live - len(robot.scheduler.active), 0))
        live = others()
        ks = {r.name: r.scheduler.choose_k(self.clock() - tick_start, deadline_s,
                                           max(live - len(r.scheduler.active), 0))
              for r in working}
        try:
            batch_sizes = self._token_steps(working, tick_start, deadline_s, poll)
        except BaseException:
            for robot in working:   # the frames' holds end with the round, whatever failed
                robot.scheduler.drop_frame()
            raise
        steps_end = self.clock()
        reports = {}
        for robot in working:
            touched, ended = robot.scheduler.end_language()
            with self._frontend_clock():
                reports[robot.name] = robot.output.report(touched, ended,
                                                          robot.last_frame_index)
        act_s = act.act_s if act is not None else 0.0
        timings = self._timings(act_s, act_s + self.clock() - start)
        results = {}
        usage = kv_usage(self.pool, self.blocks)
        for robot in working:
            deltas, finished = reports[robot.name]
            frame = frames.get(robot.name)
            scheduler = robot.scheduler
            results[robot.name] = FrameResult(
                frame_index=frame.index if frame else -1, action=frame.action if frame else None,
                deltas=deltas, finished=finished, k=ks[robot.name],
                decode_steps=len(scheduler.batch_sizes),
                batch_sizes=list(scheduler.batch_sizes), active_requests=len(scheduler.active),
                timings=timings, kv_usage=(usage if scheduler.pool is self.pool
                                           else kv_usage(scheduler.pool, scheduler.blocks)))
        self.last_result = FleetResult(results, dict(act.rejected) if act else {},
                                       dict(act.failed) if act else {},
                                       act.prefill_rows if act else 0, batch_sizes, timings,
                                       usage)
        if self.debug:
            self.check()
        self._after_steps_s = self.clock() - steps_end
        return self.last_result

    def observe_tail(self, robots: Collection[str], seconds: float) -> None:
        """Tell these robots' budgets how long their tick ran after advance_language returned.

        Added to the time advance_language itself took after its last step (its report), it
        is the tick's tail, what the adaptive budget keeps free after the language steps.
        """
        for name in robots:
            self._robot(name).scheduler.budget.observe_tail(self._after_steps_s + seconds)

    def _admit(self, frame: _Frame, elapsed_s: float, deadline_s: float | None,
               other_rows: int) -> None:
        """Start the frame's requests (by time: Scheduler.admit); prefill isolated ones."""
        robot = frame.robot
        scheduler = robot.scheduler
        try:
            forced = {}
            for task in scheduler.tasks:
                if task.policy.prompt_template and not task.on_demand:   # asked: their own
                    with self._frontend_clock():
                        forced[task.name] = robot.frontend.encode_text(
                            task.policy.prompt_text(frame.obs.instruction))
            admissions = scheduler.admit(frame.index, forced, elapsed_s, deadline_s,
                                         other_rows)
        except Exception as err:   # noqa: BLE001 - a language failure must not leak a slot
            logger.error('%sframe %d: no language request started: %r', _who(robot),
                         frame.index, err)
            scheduler.drop_frame()
            return
        for admission in admissions:
            if admission.needs_prefill:   # isolated: a slot of its own
                try:
                    self.runner.prefill(frame.prepared.tensors, admission.slot)
                except Exception as err:   # a language failure must not reach the action path
                    scheduler.fail([admission.request_id], err)

    def _token_steps(self, working: list[FleetMember], tick_start: float,
                     deadline_s: float | None, poll: Poll | None) -> list[int]:
        """Run rounds of every robot's next step together; return rows of each decode step.

        poll (if any) runs on this thread before every round of plans (advance_language);
        with row threads, before and after the robots' steps.
        """
        def between_steps():
            if poll is not None:
                poll(self._answered(working))
        if len(working) == 1:   # one robot: its plans one after another, nothing to merge
            return self._robot_steps(working[0], tick_start, deadline_s, between_steps)
        if self._rows is not None:
            # Row threads: each robot's steps on its own thread, side by side, as its rows
            # of the action path (one core idles while the other decodes every robot's rows).
            between_steps()
            per_robot = list(self._rows.map(
                lambda robot: self._robot_steps(robot, tick_start, deadline_s), working))
            between_steps()
            return [rows for sizes in per_robot for rows in sizes]
        batch_sizes, open_robots = [], list(working)
        # A robot's budget judges a step by all its rows: the other robots' rows of the round
        # before are added to its own.
        rows, own = 0, {}
        while open_robots:
            between_steps()
            plans: list[tuple[FleetMember, StepPlan]] = []
            for robot in list(open_robots):
                plan = robot.scheduler.schedule(self.clock() - tick_start, deadline_s,
                                                rows - own.get(robot.name, 0))
                if plan is None:
                    open_robots.remove(robot)   # done for this tick (quota or deadline)
                else:
                    plans.append((robot, plan))
            first = [(r, p) for r, p in plans if p.first_token]
            if first:
                self._run_plans(first, first_token=True)
            extend = [(r, p) for r, p in plans if p.extend]
            if extend:
                self._run_extend(extend)
            decode = [(r, p) for r, p in plans if not p.first_token and not p.extend]
            if decode:
                rows = self._run_plans(decode, first_token=False)
                own = {r.name: p.size for r, p in decode}
                batch_sizes.append(rows)
        return batch_sizes

    def _robot_steps(self, robot: FleetMember, tick_start: float, deadline_s: float | None,
                     between_steps: Callable[[], None] | None = None) -> list[int]:
        """Run one robot's plans one after another; return the rows of its decode steps."""
        scheduler, runner = robot.scheduler, self.runner
        while True:
            if between_steps is not None:
                between_steps()
            plan = scheduler.schedule(self.clock() - tick_start, deadline_s)
            if plan is None:
                break
            try:
                if plan.first_token:
                    token_ids = runner.first_tokens(plan.slots)
                elif plan.extend:
                    token_ids = runner.extend(plan.slots, plan.blocks, plan.gen_lens,
                                              plan.prompts)
                else:
                    token_ids = runner.decode(plan.slots, plan.blocks, plan.gen_lens,
                                              plan.tokens)
            except Exception as err:   # a language failure must not reach the action path
                scheduler.fail(plan.request_ids, err)
                continue
            scheduler.update(plan, token_ids, runner.last_call_s)
        return list(scheduler.batch_sizes)

    def _answered(self, working: list[FleetMember]) -> dict[str, list[FinishedRequest]]:
        """Robot -> its on-demand requests that ended since the last call (Scheduler)."""
        answered = {}
        for robot in working:
            ended = robot.scheduler.take_answered()
            if ended:
                with self._frontend_clock():
                    answered[robot.name] = [robot.output.finished(r, robot.last_frame_index)
                                            for r in ended]
        return answered

    def _run_plans(self, plans: list[tuple[FleetMember, StepPlan]], first_token: bool) -> int:
        """Run the rows of several robots' plans as one model call; return the row count."""
        if len(plans) == 1:   # one robot: its plan's blocks are ascending already
            plan = plans[0][1]
            slots, blocks, gen_lens, tokens = plan.slots, plan.blocks, plan.gen_lens, plan.tokens
        elif first_token:   # rows in plan order, matched back by position
            slots = [slot for _, plan in plans for slot in plan.slots]
        else:
            # Blocks are distinct across robots (a partitioned pool): a block names its row.
            rows = sorted((block, slot, gen_len, token) for _, plan in plans
                          for slot, block, gen_len, token
                          in zip(plan.slots, plan.blocks, plan.gen_lens, plan.tokens))
            blocks = [b for b, _, _, _ in rows]
            slots = [s for _, s, _, _ in rows]
            gen_lens, tokens = [g for _, _, g, _ in rows], [t for _, _, _, t in rows]
        try:
            if first_token:
                token_ids = self.runner.first_tokens(slots)
            else:
                token_ids = self.runner.decode(slots, blocks, gen_lens, tokens)
        except Exception as err:   # a language failure must not reach the action path
            for robot, plan in plans:
                robot.scheduler.fail(plan.request_ids, err)
            return len(slots)
        seconds = self.runner.last_call_s
        if len(plans) == 1:
            plans[0][0].scheduler.update(plans[0][1], token_ids, seconds)
            return len(slots)
        if first_token:   # rows in plan order
            start = 0
            for robot, plan in plans:
                robot.scheduler.update(plan, token_ids[start:start + plan.size], seconds,
                                       call_rows=len(slots))
                start += plan.size
            return len(slots)
        by_block = dict(zip(blocks, token_ids))
        for robot, plan in plans:
            robot.scheduler.update(plan, [by_block[b] for b in plan.blocks], seconds,
                                   call_rows=len(slots))
        return len(slots)

    def _run_extend(self, plans: list[tuple[FleetMember, StepPlan]]) -> None:
        """Run the rows of several robots' extend passes as one model call (rows by block)."""
        rows = sorted((block, slot, gen_len, prompt) for _, plan in plans
                      for slot, block, gen_len, prompt
                      in zip(plan.slots, plan.blocks, plan.gen_lens, plan.prompts))
        blocks = [row[0] for row in rows]
        try:
            token_ids = self.runner.extend([row[1] for row in rows], blocks,
                                           [row[2] for row in rows], [row[3] for row in rows])
        except Exception as err:   # a language failure must not reach the action path
            for robot, plan in plans:
                robot.scheduler.fail(plan.request_ids, err)
            return
        by_block = dict(zip(blocks, token_ids))
        padded = extend_tokens([row[3] for row in rows])
        for robot, plan in plans:
            robot.scheduler.update(plan, [by_block[b] for b in plan.blocks],
                                   self.runner.last_call_s, call_rows=padded)

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


def _who(robot: FleetMember) -> str:
    """Log prefix naming a fleet's robot ('' for the one robot of a plain engine)."""
    return f'{robot.name} ' if robot.name else ''


def make_fleet(model: Pi05Model, robots: list[FleetRobot], *,
               max_forced_tokens: int | None = None, max_prefill_rows: int | None = None,
               row_threads: int = 1, debug: bool = False,
               clock: Callable[[], float] = time.perf_counter,
               **runner_options) -> FleetEngine:
    """Build a FleetEngine: one ModelRunner whose store has the sum of the robots' quotas.

    max_prefill_rows: rows per prefill call (None: every framed robot in one call).
    row_threads: threads running the action path's rows side by side (1: none; a CPU option,
    with the process's torch threads divided among them, see the module doc).

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
        max_forced_tokens = forced_token_room([t for r in robots for t in r.tasks])
    # One block length for every robot: the longest request any of its tasks may write.
    max_gen_len = max(generated_entries(r.policy, max_forced_tokens) for r in robots)
    quotas = {r.name: r.quota() for r in robots}
    block_quotas = {r.name: r.block_quota() for r in robots}
    runner = ModelRunner(model, sum(quotas.values()), max_gen_len, clock=clock,
                         num_blocks=sum(block_quotas.values()), **runner_options)
    pool = KVPool(sum(quotas.values()), runner.store.bytes_per_slot)
    blocks = KVPool(sum(block_quotas.values()), runner.store.bytes_per_block)
    # One robot owns the whole pool; several share it by quota.
    if len(robots) > 1:
        shares, block_shares = pool.partition(quotas), blocks.partition(block_quotas)
    else:
        shares, block_shares = {robots[0].name: pool}, {robots[0].name: blocks}
    members = [FleetMember(r.name, Scheduler(r.policy, r.budget, shares[r.name], max_gen_len,
                                             share_prefix=True,
                                             max_forced_tokens=max_forced_tokens,
                                             blocks=block_shares[r.name]),
                           r.frontend, r.seed) for r in robots]
    return FleetEngine(members, runner, pool, blocks=blocks, max_prefill_rows=max_prefill_rows,
                       row_threads=row_threads, debug=debug, clock=clock)
