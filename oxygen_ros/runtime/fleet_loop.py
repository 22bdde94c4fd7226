"""The frame loop of several robots: R robots' inputs -> one FleetEngine tick -> R sinks.

What FrameLoop is for one robot, FleetLoop is for a fleet served by one engine (the multi-robot
node runs it on its control thread; a replay could run it at bag times). Each robot keeps its
own inputs, output sink, control period and loop statistics.

Gathering: every robot has its own grid of tick times (its period). A tick at `now_s` serves
every robot due by now + gather_s, so robots whose ticks nearly coincide share one prefill and
one denoise; a robot is served early by at most gather_s and never late because of another
robot (the earliest due robot sets the tick). A robot whose inputs are missing or stale sends
no observation: the others' frames go ahead without it, and its live requests still advance.

One tick, in the order the work happens:

    1. build       each due robot's observation from its newest inputs (or the reasons not)
    2. act         fleet.act(observations): one prefill + one denoise over the due robots
    3. emit        each robot's action on its own sink, at once
    4. language    fleet.advance_language(): every robot's live requests in shared steps
    5. emit        tokens and narrations on each robot's sink
"""

from __future__ import annotations

import collections
import dataclasses
import fractions
import functools
import logging
import math
import time
from typing import Callable

from oxygen_ros.engine import FleetEngine
from oxygen_ros.runtime.frame_loop import (act_with_cpu_share, emit_language, engine_summary,
                                           OutputSink, report_inputs, TickOutcome)
from oxygen_ros.runtime.inputs import InputSet, ObservationResult
from oxygen_ros.runtime.rtc import RtcPlanner
from oxygen_ros.runtime.status import LoopStats, ProblemLog

logger = logging.getLogger(__name__)

# Why: a grid built by adding periods drifts by float rounding (0.4 + 0.2 > 0.6), which would
# make a tick at exactly 0.6 miss the robot due then.
DUE_TOLERANCE_S = 1e-6


@dataclasses.dataclass
class RobotLoop:
    """One robot of a FleetLoop: its inputs, where its outputs go, its period, its statistics."""

    name: str                          # the robot's name in the FleetEngine
    inputs: InputSet
    sink: OutputSink
    period_s: float                    # its control period
    problems: ProblemLog | None = None  # where its input problems and failed requests go
    #                                     (messages do not name the robot: this log does)
    stats: LoopStats = dataclasses.field(default_factory=LoopStats)
    next_due_s: float | None = None    # its next tick time (None: due at the first tick)
    skipped_ticks: int = 0             # grid ticks that passed while the fleet was busy
    finished: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    last_inputs: ObservationResult | None = None   # its inputs at its last tick (diagnostics)
    rtc: RtcPlanner | None = None      # real-time chunking: what its chunks continue

    def __post_init__(self):
        if not self.period_s > 0:
            raise ValueError(f'{self.name}: period_s must be > 0, got {self.period_s}')

    def due(self, now_s: float, gather_s: float) -> bool:
        return self.next_due_s is None or self.next_due_s <= now_s + gather_s + DUE_TOLERANCE_S

    def advance(self, now_s: float) -> None:
        """Move to the next tick of its own grid after now (counting grid ticks skipped)."""
        due = now_s if self.next_due_s is None else self.next_due_s
        due += self.period_s
        while due <= now_s + DUE_TOLERANCE_S:
            due += self.period_s
            self.skipped_ticks += 1
        self.next_due_s = due


def wake_period_s(periods: list[float], finest_s: float = 1e-3) -> float:
    """Return the period to wake a fleet's loop at, so every robot's tick falls on a wake-up.

    The largest period that divides every robot's period (10 Hz and 15 Hz: 30 Hz; equal
    rates: that rate), read from rates rounded to 1/1000 Hz; when that is finer than finest_s
    (rates with no useful common divisor), the shortest robot period: a robot is then served
    up to half of it early or late (the loop's gather window).
    """
    rates = [fractions.Fraction(1 / p).limit_denominator(1000) for p in periods]
    # gcd of periods 1/r_i = 1 / lcm(r_i); lcm of fractions a/b: lcm(a)/gcd(b).
    numerators, denominators = [r.numerator for r in rates], [r.denominator for r in rates]
    lcm = fractions.Fraction(math.lcm(*numerators), math.gcd(*denominators))
    period = float(1 / lcm)
    return period if period >= finest_s else min(periods)


class FleetLoop:
    """R robots' control ticks over one FleetEngine (see the module docstring)."""

    def __init__(self, fleet: FleetEngine, robots: list[RobotLoop], *, gather_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        unknown = [r.name for r in robots if r.name not in fleet.robots]
        if unknown:
            raise ValueError(f'robots {unknown} are not in the fleet ({fleet.robot_names})')
        if gather_s < 0:
            raise ValueError(f'gather_s must be >= 0, got {gather_s}')
        self.fleet = fleet
        self.robots = {r.name: r for r in robots}
        self.gather_s = gather_s
        self.clock = clock
        self.last_result = None

    def next_tick_s(self) -> float | None:
        """When the next robot is due (None: some robot has not ticked yet, so now)."""
        dues = [r.next_due_s for r in self.robots.values()]
        return None if None in dues else min(dues)

    def tick(self, now_s: float) -> dict[str, TickOutcome]:
        """Serve every robot due by now_s + gather_s; return each served robot's outcome.

        Robots not due but with live requests get their tokens too (stamped now); their
        outcome is included when they got any.
        """
        start = self.clock()
        now_ns = round(now_s * 1e9)
        due = [r for r in self.robots.values() if r.due(now_s, self.gather_s)]
        outcomes, observations = {}, {}
        for robot in due:   # 1. build
            built = robot.last_inputs = robot.inputs.build(now_s)
            outcomes[robot.name] = TickOutcome(built, dict(built.problems),
                                               built.stamp_ns if built.observation else now_ns)
            if built.observation is not None:
                observations[robot.name] = built.observation
        continuations = {name: c for name, obs in observations.items()
                         if (rtc := self.robots[name].rtc) is not None
                         and (c := rtc.continuation(obs)) is not None}
        fleet_act = (functools.partial(self.fleet.act, continuations=continuations)
                     if continuations else self.fleet.act)
        act, cpu_share = (act_with_cpu_share(fleet_act, observations) if observations
                          else (None, None))                                  # 2. act
        for name, action in (act.actions.items() if act else ()):   # 3. emit at once
            outcome = outcomes[name]
            robot = self.robots[name]
            robot.sink.action(action, outcome.stamp_ns)
            outcome.action = action
            outcome.latency_s = self.clock() - start
            outcome.act_cpu_share = cpu_share
            if robot.rtc is not None:   # the chunk the robot now executes
                robot.rtc.record(action, now_s + outcome.latency_s)
        for name, why in (act.rejected.items() if act else ()):
            outcomes[name].problems['observation'] = f'observation rejected: {why}'
            outcomes[name].stamp_ns = now_ns
        for robot in due:
            if robot.problems is not None:
                report_inputs(robot.problems, outcomes[robot.name].problems, robot.last_inputs)
        if act is not None or self.fleet.num_live_requests:   # 4. language
            self.last_result = self.fleet.advance_language()
            for name, result in self.last_result.robots.items():   # 5. emit
                outcome = outcomes.get(name) or TickOutcome(None, {}, now_ns)
                robot = self.robots[name]
                emit_language(result, robot.sink, outcome, robot.finished, robot.problems)
                if name in outcomes or outcome.tokens:
                    outcomes[name] = outcome
        duration = self.clock() - start
        due_names = {robot.name for robot in due}
        for name, outcome in outcomes.items():
            if name not in due_names:   # language only: its requests still count in its window
                self.robots[name].stats.record_ended(start, outcome.ended)
        for robot in due:
            outcome = outcomes[robot.name]
            outcome.duration_s = duration
            action = outcome.action
            robot.stats.record(start, duration, robot.period_s, outcome.latency_s,
                               action.inference_time_s if action is not None else None,
                               outcome.tokens, outcome.act_cpu_share, outcome.ended)
            robot.advance(now_s)
        return outcomes

    def engine_summary(self, name: str) -> dict | None:
        """Return the engine part of a robot's diagnostics (None before its first language)."""
        result = self.last_result.robots.get(name) if self.last_result is not None else None
        return engine_summary(result, self.robots[name].finished,
                              self.fleet.scheduler(name).budget)
