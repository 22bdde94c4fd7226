"""The one frame loop: each due robot's newest inputs -> observation -> act -> emit -> language.

One robot or many, the same loop over one FleetEngine (one robot is a fleet of one): the node
runs `FrameLoop.tick` on its control thread; the bag and dataset replays and the policy
server run the same `tick` at their own times. What differs is where outputs go (each robot's
OutputSink: ROS publishers, an output bag, a websocket reply) and which clock `now_s` comes
from, so a replay reproduces what the node would have done with the same inputs.

Timing. Every robot has its own grid of tick times (its period, from a shared origin); a
robot is due when its next grid time has come (or comes within gather_s: nearly coinciding
robots share one prefill and one denoise, a robot served early by at most gather_s). The node
wakes the loop at the robots' own ticks (`next_wake_s`), so robots at 9 and 10 Hz wake it at
most 19 times a second, not at a 90 Hz common grid. A tick serves the due robots only:

    1. build       each due robot's observation from its newest inputs (or the reasons not);
                   its action prompt: the active subtask of a task that drives the actions
                   (runtime/subtask.py, never waited for), else the instruction
    2. act         engine.act(observations): one prefill + one denoise over the due robots
                   (real-time chunking: each continues its committed chunk, runtime/rtc.py)
    3. emit        each robot's action on its own sink, at once: nothing below delays it
    4. language    engine.advance_language(due robots, deadline): the due robots' live
                   requests (also without a new frame, so no request stalls while a camera
                   hiccups), k tokens per robot tick, against ONE deadline: the next tick
                   of any robot (a 10 Hz robot's language stops before a 15 Hz robot is due);
                   before its admissions and between its steps, questions asked meanwhile go
                   to the scheduler (on this tick's frame) and those whose request just ended
                   are answered (runtime/questions.py)
    5. emit        tokens and narrations on each robot's sink; a subtask that completed
                   becomes the action prompt from the robot's next frame on

A wake-up where no robot is due does nothing (no language round). A tick that raises is still
recorded in every due robot's statistics and advances their grids.

Reporting: an observation the engine rejects (ObservationError) is an input problem of that
robot ('observation rejected: ...'); any other failure of its action path is an error event,
reported as what it is.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from typing import Callable, Protocol

from oxygen_ros.engine import FinishReason
from oxygen_ros.engine.types import (ActionOutput, FinishedRequest, FrameResult, Observation,
                                     TokenDelta)
from oxygen_ros.runtime.inputs import InputSet, ObservationResult
from oxygen_ros.runtime.questions import desk_for, QuestionDesk
from oxygen_ros.runtime.rtc import RtcPlanner
from oxygen_ros.runtime.status import ERROR, LoopStats, ProblemLog, WARN
from oxygen_ros.runtime.subtask import Subtask, SubtaskLoop

logger = logging.getLogger(__name__)

# Why: grid times are origin + n · period; a tick at a grid time read back from another clock
# or rounded through nanoseconds must still find the robot due.
DUE_TOLERANCE_S = 1e-6
GATHER_SHARE = 0.05   # the node's gather window: this share of the shortest robot period


class OutputSink(Protocol):
    """Where a robot's outputs go; stamps are integer nanoseconds of the observation."""

    def action(self, action: ActionOutput, stamp_ns: int) -> None:
        """Emit the action chunk of this tick."""

    def tokens(self, delta: TokenDelta, stamp_ns: int) -> None:
        """Emit the new tokens of one language request (of any task: delta.task)."""

    def narration(self, request: FinishedRequest, stamp_ns: int) -> None:
        """Emit the full text of a request that completed (eos or length; of any task)."""

    def subtask(self, subtask: Subtask | None, stamp_ns: int) -> None:
        """Emit the subtask that drives the actions from this tick on (None: the instruction).

        Called only for a robot with a task that drives the actions, when it changes.
        """


@dataclasses.dataclass
class TickOutcome:
    """What one tick did for one robot (for the adapters' own bookkeeping and for tests)."""

    inputs: ObservationResult | None    # the observation, or why there was none
    problems: dict[str, str]            # input problems + 'observation' when act() rejected it
    stamp_ns: int                       # stamp of this tick's outputs (observation or now)
    action: ActionOutput | None = None  # the chunk emitted (None: no action this tick)
    result: FrameResult | None = None   # the engine's frame result (None: no language call)
    error: str = ''                     # why act() failed for this robot (not its input)
    tokens: int = 0                     # tokens emitted
    ended: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    #                                     language requests that ended, by finish reason
    duration_s: float = 0.0             # wall time of the whole tick
    latency_s: float | None = None      # tick start -> action emitted
    act_cpu_share: float | None = None  # act()'s CPU time on this thread / its wall time
    action_prompt: str | None = None    # the observation's prompt (a subtask or the instruction)
    subtask_changed: bool = False       # the subtask driving the actions changed this tick

    @property
    def rejected(self) -> str:
        """Why the engine rejected the observation ('' when it did not)."""
        return self.problems.get('observation', '')


@dataclasses.dataclass
class RobotLoop:
    """One robot of the loop: its inputs, where its outputs go, its tick grid, its statistics."""

    name: str                          # the robot's name in the engine
    inputs: InputSet
    sink: OutputSink
    period_s: float                    # its control period
    problems: ProblemLog | None = None  # where its input problems and failed requests go
    stats: LoopStats = dataclasses.field(default_factory=LoopStats)
    rtc: RtcPlanner | None = None      # real-time chunking: what its chunks continue
    origin_s: float | None = None      # time of its grid's tick 0 (None: its first tick)
    index: int = 0                     # its next tick on the grid: origin + index · period
    skipped_ticks: int = 0             # grid ticks that passed while the loop was busy
    finished: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    last_inputs: ObservationResult | None = None   # its inputs at its last tick (diagnostics)
    last_result: FrameResult | None = None         # its last language result (diagnostics)
    subtask: SubtaskLoop | None = None  # its task that drives the actions (set by FrameLoop)
    questions: QuestionDesk | None = None   # its questions (set by FrameLoop; None: no ASK task)

    def __post_init__(self):
        if not self.period_s > 0:
            raise ValueError(f'{self.name}: period_s must be > 0, got {self.period_s}')

    @property
    def next_due_s(self) -> float | None:
        """Its next tick time (None: due at the first tick)."""
        return None if self.origin_s is None else self.origin_s + self.index * self.period_s

    @next_due_s.setter
    def next_due_s(self, when_s: float | None) -> None:
        self.origin_s, self.index = when_s, 0

    def due(self, now_s: float, gather_s: float = 0.0) -> bool:
        due_s = self.next_due_s
        return due_s is None or due_s <= now_s + gather_s + DUE_TOLERANCE_S

    def next_after(self, now_s: float) -> float:
        """Its first grid time after now_s (one period on, before its grid starts)."""
        if self.origin_s is None:
            return now_s + self.period_s
        n = max(self.index, math.floor((now_s - self.origin_s) / self.period_s) + 1)
        while self.origin_s + n * self.period_s <= now_s + DUE_TOLERANCE_S:
            n += 1
        return self.origin_s + n * self.period_s

    def advance(self, now_s: float) -> None:
        """Move past the tick just served (early, when gathered) and now; count skipped ones."""
        if self.origin_s is None:   # its first tick starts its grid
            self.origin_s, self.index = now_s, 0
        after = self.next_after(max(now_s, self.next_due_s))
        n = round((after - self.origin_s) / self.period_s)
        self.skipped_ticks += max(n - self.index - 1, 0)
        self.index = n

    def set_period(self, period_s: float) -> None:
        """Tick at `period_s` from its next tick on (the grid re-anchored there)."""
        if not period_s > 0:
            raise ValueError(f'{self.name}: period_s must be > 0, got {period_s}')
        self.origin_s, self.index, self.period_s = self.next_due_s, 0, period_s

    def lateness_s(self, now_s: float) -> float:
        """How far behind its grid tick a tick at now_s starts (0 before its grid starts)."""
        due_s = self.next_due_s
        return 0.0 if due_s is None else max(now_s - due_s, 0.0)


class FrameLoop:
    """The robots' control ticks over one FleetEngine (see the module docstring).

    engine: a FleetEngine (act / advance_language / live_requests / scheduler). gather_s: a
    robot due within this much of a tick is served at it. clock: the loop's wall clock
    (latencies, durations); each robot's statistics keep their own clock (steady time in the
    node, bag time in a replay).
    """

    def __init__(self, engine, robots: list[RobotLoop], *, gather_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        unknown = [r.name for r in robots if r.name not in engine.robots]
        if unknown:
            raise ValueError(f'robots {unknown} are not in the engine ({list(engine.robots)})')
        if gather_s < 0:
            raise ValueError(f'gather_s must be >= 0, got {gather_s}')
        self.engine = engine
        self.robots = {r.name: r for r in robots}
        for robot in robots:
            if robot.subtask is None:
                robot.subtask = subtask_loop(engine.scheduler(robot.name).tasks)
            if robot.questions is None:
                robot.questions = desk_for(engine, robot.name)
        self.gather_s = gather_s
        self.clock = clock
        self.last_result = None   # the engine's last FleetResult

    @classmethod
    def one(cls, system, inputs: InputSet, sink: OutputSink, period_s: float, *,
            problems: ProblemLog | None = None, stats: LoopStats | None = None,
            rtc: RtcPlanner | None = None, clock: Callable[[], float] = time.monotonic
            ) -> FrameLoop:
        """Return the loop of one robot over an Engine (its `fleet` of one, robot `robot`)."""
        robot = RobotLoop(system.robot, inputs, sink, period_s, problems,
                          stats if stats is not None else LoopStats(), rtc)
        return cls(system.fleet, [robot], clock=clock)

    @property
    def only(self) -> RobotLoop:
        """The robot of a one-robot loop."""
        (robot,) = self.robots.values()
        return robot

    # ---- timing -----------------------------------------------------------------------------

    def restart(self, start_s: float) -> None:
        """Start every robot's grid at start_s (activation): a fresh grid, fresh counts."""
        for robot in self.robots.values():
            robot.origin_s, robot.index, robot.skipped_ticks = start_s, 0, 0

    def next_tick_s(self) -> float | None:
        """When the next robot is due (None: some robot has not ticked yet, so now)."""
        dues = [r.next_due_s for r in self.robots.values()]
        return None if None in dues else min(dues)

    def next_wake_s(self, now_s: float) -> float:
        """Return the first robot grid time after now_s: when to wake the loop next.

        Reads only each grid's origin and period, so another thread (the node's timer) may
        ask while a tick runs.
        """
        return min(robot.next_after(now_s) for robot in list(self.robots.values()))

    # ---- the tick ----------------------------------------------------------------------------

    def tick(self, now_s: float, *, serve_all: bool = False,
             check_inputs: Callable[[ObservationResult], None] | None = None,
             language: Callable[[], bool] = lambda: True,
             frames: bool = True) -> dict[str, TickOutcome]:
        """Serve every robot due at `now_s` (the adapter's clock, seconds); return their outcomes.

        serve_all: serve every robot now, whatever its grid (a replay's tick times, a server's
        requests; the language then counts against each robot's own period). check_inputs(
        result) may raise to abort the tick before the engine runs (a replay that must stop
        on bad input); language() is asked before the language half (False: skip it, e.g.
        the node is being deactivated). frames=False: no observation is built, only live
        language requests advance (a replay's end: its last frames' requests run to their
        end). Exceptions propagate after the tick is recorded in every due robot's
        statistics and their grids advanced.
        """
        robots = list(self.robots.values())
        due = robots if serve_all else [r for r in robots if r.due(now_s, self.gather_s)]
        if not due:
            return {}   # an empty wake-up: nobody's tick, no language round
        start = self.clock()
        stats_start = {r.name: r.stats.clock() for r in due}
        late = {r.name: 0.0 if serve_all else r.lateness_s(now_s) for r in due}
        outcomes: dict[str, TickOutcome] = {}
        error = None
        try:
            self._tick(now_s, start, due, serve_all, outcomes, check_inputs, language, frames)
            return outcomes
        except BaseException as err:
            error = err
            raise
        finally:
            duration = self.clock() - start
            for robot in due:
                outcome = outcomes.get(robot.name)
                if outcome is not None:
                    outcome.duration_s = duration
                action = outcome.action if outcome is not None else None
                missed = robot.stats.record(
                    stats_start[robot.name], duration, robot.period_s,
                    outcome.latency_s if outcome else None,
                    action.inference_time_s if action is not None else None,
                    outcome.tokens if outcome else 0,
                    outcome.act_cpu_share if outcome else None,
                    outcome.ended if outcome else None, late_s=late[robot.name])
                if error is not None:
                    robot.stats.record_error(repr(error))
                if missed:
                    logger.debug('%stick over deadline: %.1f ms late + %.1f ms > %.1f ms',
                                 f'{robot.name}: ' if robot.name else '',
                                 late[robot.name] * 1e3, duration * 1e3, robot.period_s * 1e3)
                robot.advance(now_s)

    def _tick(self, now_s, start, due, serve_all, outcomes, check_inputs, language,
              frames) -> None:
        engine = self.engine
        now_ns = round(now_s * 1e9)
        observations = {}
        if not frames:   # language only: no inputs read, no action
            for robot in due:
                outcomes[robot.name] = TickOutcome(None, {}, now_ns)
            building = []
        else:
            building = due
        for robot in building:   # 1. build
            built = robot.last_inputs = robot.inputs.build(now_s)
            if check_inputs is not None:
                check_inputs(built)
            obs = built.observation
            outcomes[robot.name] = TickOutcome(built, dict(built.problems),
                                               built.stamp_ns if obs is not None else now_ns)
            if obs is not None:
                observations[robot.name] = self._prompted(robot, obs, now_s, outcomes)
        act_start = self.clock()
        if observations:   # 2. act
            continuations = {name: c for name, obs in observations.items()
                             if (rtc := self.robots[name].rtc) is not None
                             and (c := rtc.continuation(obs)) is not None}
            act, cpu_share = act_with_cpu_share(engine.act, observations, continuations or None)
            for name, action in act.actions.items():   # 3. emit at once
                outcome, robot = outcomes[name], self.robots[name]
                robot.sink.action(action, outcome.stamp_ns)
                outcome.action = action
                outcome.latency_s = self.clock() - start
                outcome.act_cpu_share = cpu_share
                if robot.rtc is not None:   # the chunk the robot now executes
                    robot.rtc.record(action, now_s + outcome.latency_s)
                if robot.subtask is not None:   # dates the subtasks decoded from this frame
                    robot.subtask.record_frame(action.frame_index, now_s, outcome.stamp_ns)
                if robot.questions is not None:   # dates the answers decoded from it
                    robot.questions.record_frame(action.frame_index, outcome.stamp_ns)
            for name in observations:   # after every action: the subtask that drove them
                robot = self.robots[name]
                if robot.subtask is not None and outcomes[name].subtask_changed:
                    robot.sink.subtask(robot.subtask.driving, outcomes[name].stamp_ns)
            for name, why in act.rejected.items():
                outcomes[name].problems['observation'] = f'observation rejected: {why}'
                outcomes[name].stamp_ns = now_ns
            for name, err in act.failed.items():
                self._report_failure(self.robots[name], outcomes[name], err)
                outcomes[name].stamp_ns = now_ns
        for robot in building:
            if robot.problems is not None:
                report_inputs(robot.problems, outcomes[robot.name].problems, robot.last_inputs)
        names = [r.name for r in due]
        desks = [(r.name, r.questions) for r in due if r.questions is not None]

        def poll(answered) -> None:   # between the language steps (advance_language)
            for name, desk in desks:
                desk.finished(answered.get(name, ()))   # answered at once
                desk.hand_over(engine.scheduler(name))  # asked since: on this tick's frame
        if not (observations or any(engine.live_requests(n) for n in names)) or not language():
            poll({})   # no round: questions no frame took for too long get their reason
            return
        # 4. language: the due robots' requests, until the next robot's tick (module doc)
        if serve_all:
            deadline_s = None
        else:
            served = set(names)
            next_s = min(r.next_after(now_s) if r.name in served else r.next_due_s
                         for r in self.robots.values())
            # Seconds after the engine's clock started: act() began, or the language does.
            began = act_start if observations else self.clock()
            deadline_s = next_s - now_s - (began - start)
        self.last_result = result = engine.advance_language(names, deadline_s,
                                                            poll=poll if desks else None)
        returned = self.clock()
        for name, frame_result in result.robots.items():   # 5. emit
            robot, outcome = self.robots[name], outcomes[name]
            robot.last_result = frame_result
            emit_language(frame_result, robot.sink, outcome, robot.finished, robot.problems)
            if robot.subtask is not None:   # the action prompt from its next frame on
                robot.subtask.finished(frame_result.finished)
            if robot.questions is not None:
                robot.questions.finished(frame_result.finished)
            if outcome.action is not None:
                logger.debug('%sframe %d: act %.1f ms, k=%d, %d tokens, %d active',
                             f'{name}: ' if name else '', frame_result.frame_index,
                             frame_result.timings.act_s * 1e3, frame_result.k, outcome.tokens,
                             frame_result.active_requests)
        # The tick's tail after the language steps: what their budget keeps free of them.
        engine.observe_tail(list(result.robots), self.clock() - returned)

    @staticmethod
    def _prompted(robot: RobotLoop, obs: Observation, now_s: float,
                  outcomes: dict[str, TickOutcome]) -> Observation:
        """Return the observation with this tick's action prompt (its subtask, if fresh)."""
        outcome = outcomes[robot.name]
        if robot.subtask is None:
            outcome.action_prompt = obs.instruction
            return obs
        outcome.subtask_changed = robot.subtask.update(now_s)
        outcome.action_prompt = robot.subtask.action_prompt(obs.instruction)
        obs = dataclasses.replace(obs, action_prompt=outcome.action_prompt)
        outcome.inputs = dataclasses.replace(outcome.inputs, observation=obs)   # as acted on
        return obs

    @staticmethod
    def _report_failure(robot: RobotLoop, outcome: TickOutcome, err: Exception) -> None:
        """Report a robot's failed act() as what it is: an error, not an input problem."""
        outcome.error = f'{type(err).__name__}: {err}'
        robot.stats.record_error(repr(err))
        if robot.problems is not None:
            robot.problems.event('act', ERROR, f'act() failed: {outcome.error}')
        else:
            logger.error('%sact() failed: %s', f'{robot.name}: ' if robot.name else '',
                         outcome.error)

    def engine_summary(self, name: str) -> dict | None:
        """Return the engine part of a robot's diagnostics (None before its first language)."""
        robot = self.robots[name]
        scheduler = self.engine.scheduler(name)
        summary = engine_summary(robot.last_result, robot.finished, scheduler.budget)
        if summary is None:
            return None
        summary['deferred'] = dict(scheduler.deferred)   # task -> requests deferred (time)
        if robot.subtask is not None:
            summary['subtask'] = robot.subtask.status()
        return summary


def subtask_loop(tasks) -> SubtaskLoop | None:
    """Return the SubtaskLoop of a robot's language tasks (None: no task drives the actions)."""
    driving = [task for task in tasks if task.drives_actions]
    return SubtaskLoop(driving[0].name, driving[0].max_age_s) if driving else None


def act_with_cpu_share(act: Callable, *args) -> tuple:
    """Return (act(*args), the share of its wall time this thread spent on a CPU).

    Thread CPU time next to wall time tells a late tick that waited for a core (or the GIL)
    from one whose model was simply slow (status.late_tick_hint words the difference).
    """
    cpu_start, wall_start = time.thread_time(), time.perf_counter()
    result = act(*args)
    wall = time.perf_counter() - wall_start
    return result, ((time.thread_time() - cpu_start) / wall if wall > 0 else None)


def report_inputs(log: ProblemLog, problems: dict[str, str], built: ObservationResult) -> None:
    """Log a tick's input problems and its warnings (messages lost in transport), throttled."""
    log.update('inputs', problems)
    log.update('transport', {s.label: s.warning for s in built.inputs if s.warning})


def emit_language(result: FrameResult, sink: OutputSink, outcome: TickOutcome,
                  finished: collections.Counter, problems: ProblemLog | None) -> None:
    """Emit one robot's language output of a tick (steps 4-5): token deltas, narrations.

    Counts finish reasons into `finished`; a request that ended without completing (evicted,
    refused, error) is reported to `problems` instead of narrated.
    """
    outcome.result = result
    for delta in result.deltas:
        sink.tokens(delta, outcome.stamp_ns)
        outcome.tokens += len(delta.token_ids)
    for done in result.finished:
        finished[done.finish_reason] += 1
        outcome.ended[done.finish_reason] += 1
        if FinishReason(done.finish_reason).completed:   # narration: whole texts only
            sink.narration(done, outcome.stamp_ns)
        elif problems is not None:
            problems.event(f'request_{done.finish_reason}', WARN, (
                f'language request {done.request_id} (frame {done.origin_frame}) ended '
                f'{done.finish_reason} after {len(done.token_ids)} tokens'
                + (f': {done.error}' if done.error else '')))


def engine_summary(result: FrameResult | None, finished: collections.Counter,
                   budget) -> dict | None:
    """Return a robot's engine diagnostics from its last frame result (None before one)."""
    if result is None:
        return None
    return {'k': result.k, 'active_requests': result.active_requests,
            'kv_usage': result.kv_usage, 'finished': dict(finished), 'budget': str(budget)}
