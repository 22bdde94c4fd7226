"""The one frame loop: newest inputs -> observation -> act -> emit action -> language -> emit.

The node (oxygen_ros.ros) runs `FrameLoop.tick` on its control thread at the control rate; the
bag replay (oxygen_ros.bag) runs the same `tick` at the bag's tick times. What differs is only
where outputs go (an OutputSink: ROS publishers, or an output bag) and which clock `now_s`
comes from, so a replay reproduces what the node would have done with the same inputs.

One tick, in the order the work happens:

    1. build       the observation from the newest inputs (or the reasons there is none)
    2. act         prefill + denoise -> ActionOutput               (only with an observation;
                   with real-time chunking it continues the committed chunk, runtime/rtc.py)
    3. emit        sink.action(...) at once: nothing below can delay an action
    4. language    system.advance_language(): k tokens per live request, one batched decode
                   step per token step (also without a new frame, so no request stalls
                   while a camera hiccups)
    5. emit        sink.tokens(...) per delta, sink.narration(...) per completed request
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from typing import Callable, Protocol

from oxygen_ros.engine import FinishReason
from oxygen_ros.engine.types import ActionOutput, FinishedRequest, FrameResult, TokenDelta
from oxygen_ros.runtime.inputs import InputSet, ObservationResult
from oxygen_ros.runtime.rtc import RtcPlanner
from oxygen_ros.runtime.status import LoopStats, ProblemLog, WARN

logger = logging.getLogger(__name__)


class OutputSink(Protocol):
    """Where a tick's outputs go; stamps are integer nanoseconds of the observation."""

    def action(self, action: ActionOutput, stamp_ns: int) -> None:
        """Emit the action chunk of this tick."""

    def tokens(self, delta: TokenDelta, stamp_ns: int) -> None:
        """Emit the new tokens of one language request."""

    def narration(self, request: FinishedRequest, stamp_ns: int) -> None:
        """Emit the full text of a request that completed (eos or length)."""


@dataclasses.dataclass
class TickOutcome:
    """What one tick did (for the adapters' own bookkeeping and for tests)."""

    inputs: ObservationResult           # the observation, or why there was none
    problems: dict[str, str]            # input problems + 'observation' when act() rejected it
    stamp_ns: int                       # stamp of this tick's outputs (observation or now)
    action: ActionOutput | None = None  # the chunk emitted (None: no action this tick)
    result: FrameResult | None = None   # the engine's frame result (None: no engine call)
    tokens: int = 0                     # tokens emitted
    ended: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    #                                     language requests that ended, by finish reason
    duration_s: float = 0.0             # wall time of the whole tick
    latency_s: float | None = None      # tick start -> action emitted
    act_cpu_share: float | None = None  # act()'s CPU time on this thread / its wall time

    @property
    def rejected(self) -> str:
        """Why the engine rejected the observation ('' when it did not)."""
        return self.problems.get('observation', '')


class FrameLoop:
    """One robot's control tick over an engine System; owns the loop statistics.

    system: an engine System (act / advance_language / num_live_requests). problems: where
    input problems and failed requests are reported (None: not reported). stats: the loop
    statistics the diagnostics show (its clock is the adapter's: steady time in the node, bag
    time in a replay).
    """

    def __init__(self, system, inputs: InputSet, *, problems: ProblemLog | None = None,
                 stats: LoopStats | None = None, clock: Callable[[], float] = time.monotonic,
                 rtc: RtcPlanner | None = None):
        self.system = system
        self.inputs = inputs
        self.rtc = rtc      # real-time chunking: what each chunk continues (None: nothing)
        self.problems = problems
        self.stats = stats if stats is not None else LoopStats()
        self.clock = clock
        self.finished: collections.Counter = collections.Counter()   # finish reason -> count
        self.last_inputs: ObservationResult | None = None
        self.last_result: FrameResult | None = None

    def tick(self, now_s: float, period_s: float, sink: OutputSink, *,
             check_inputs: Callable[[ObservationResult], None] | None = None,
             language: Callable[[], bool] = lambda: True) -> TickOutcome:
        """Run one tick at `now_s` (the adapter's clock, seconds); return what it did.

        check_inputs(result) may raise to abort the tick before the engine runs (a replay
        that must stop on bad input); language() is asked before the language half (False:
        skip it, e.g. the node is being deactivated). Exceptions propagate after the tick is
        recorded in the loop statistics.
        """
        start = self.clock()
        stats_start = self.stats.clock()
        outcome = None
        try:
            outcome = self._tick(now_s, start, sink, check_inputs, language)
            return outcome
        finally:
            duration = self.clock() - start
            if outcome is not None:
                outcome.duration_s = duration
            action = outcome.action if outcome is not None else None
            missed = self.stats.record(
                stats_start, duration, period_s, outcome.latency_s if outcome else None,
                action.inference_time_s if action is not None else None,
                outcome.tokens if outcome else 0,
                outcome.act_cpu_share if outcome else None,
                outcome.ended if outcome else None)
            if missed:
                logger.debug('tick over deadline: %.1f ms > %.1f ms', duration * 1e3,
                             period_s * 1e3)

    def _tick(self, now_s, start, sink, check_inputs, language) -> TickOutcome:
        built = self.inputs.build(now_s)
        self.last_inputs = built
        if check_inputs is not None:
            check_inputs(built)
        problems = dict(built.problems)
        obs = built.observation
        now_ns = round(now_s * 1e9)
        outcome = TickOutcome(built, problems, built.stamp_ns if obs is not None else now_ns)
        system = self.system
        # 2-3. the action path, emitted before any language work
        if obs is not None:
            try:
                action, outcome.act_cpu_share = act_with_cpu_share(
                    continuing(system.act, self.rtc, obs), obs)
            except ValueError as err:   # the robot adapter rejected the observation
                problems['observation'] = f'observation rejected: {err}'
                obs = None
                outcome.stamp_ns = now_ns
            else:
                sink.action(action, outcome.stamp_ns)
                outcome.action = action
                outcome.latency_s = self.clock() - start
                if self.rtc is not None:   # the chunk the robot now executes
                    self.rtc.record(action, now_s + outcome.latency_s)
        if self.problems is not None:
            report_inputs(self.problems, problems, built)
        # 4-5. language: this frame's request joins the live ones, k tokens each
        if obs is None and not system.num_live_requests:
            return outcome
        if not language():
            return outcome
        result = system.advance_language()
        self.last_result = outcome.result = result
        emit_language(result, sink, outcome, self.finished, self.problems)
        if outcome.action is not None:
            logger.debug('frame %d: act %.1f ms, k=%d, %d tokens, %d active',
                         result.frame_index, result.timings.act_s * 1e3, result.k,
                         outcome.tokens, result.active_requests)
        return outcome

    def engine_summary(self) -> dict | None:
        """Return the engine part of the diagnostics (None before the first language step)."""
        return engine_summary(self.last_result, self.finished, self.system.budget)


def continuing(act: Callable, rtc: RtcPlanner | None, obs) -> Callable:
    """Return `act` with the continuation of the committed chunk bound (when RTC has one)."""
    continuation = rtc.continuation(obs) if rtc is not None else None
    return act if continuation is None else functools.partial(act, continuation=continuation)


def act_with_cpu_share(act: Callable, observation) -> tuple:
    """Return (act(observation), the share of its wall time this thread spent on a CPU).

    Thread CPU time next to wall time tells a late tick that waited for a core (or the GIL)
    from one whose model was simply slow (status.late_tick_hint words the difference).
    """
    cpu_start, wall_start = time.thread_time(), time.perf_counter()
    result = act(observation)
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
    refused, error) is reported to `problems` instead of narrated. Shared by FrameLoop and
    the fleet loop.
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
