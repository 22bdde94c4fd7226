"""FrameLoop: each robot's inputs through one FleetEngine, at its own period; its timing.

Fake engine (test_engine_fleet's fake runner on a fake clock): every tick's work takes a known
time, so the timing asserts are exact: robots tick on their own grids, a mixed-rate fleet's
language stops before the next robot is due, wake-ups are the robots' own ticks, a failing
tick is recorded, and only a bad observation is reported as a rejected one.
"""

import numpy as np
import pytest

from oxygen_ros.engine import (AdaptiveBudget, Engine, FixedBudget, LanguagePolicy,
                               Observation, ObservationError)
from oxygen_ros.runtime.frame_loop import FrameLoop, RobotLoop
from oxygen_ros.runtime.inputs import InputSet, InputSource, sanitize_instruction
from oxygen_ros.runtime.status import ERROR, ProblemLog, WARN
from test_engine_fleet import fake_fleet, key, TaggedFrontend
from test_engine_scheduler import FakeClock, FakeFrontend, FakeRunner, make, reference

STALE_S = 0.15


class StateFrontend(TaggedFrontend):
    """The robot's 'frame' is the first state entry its inputs carry (inputs set no index)."""

    def prepare(self, obs):
        prepared = FakeFrontend.prepare(self, obs)
        prepared.tensors['frame'] = key(int(obs.state[0]), self.tag)
        return prepared


class RecordingSink:
    def __init__(self):
        self.actions, self.deltas, self.narrations = [], [], []

    def action(self, action, stamp_ns):
        self.actions.append(action)

    def tokens(self, delta, stamp_ns):
        self.deltas.append(delta)

    def narration(self, request, stamp_ns):
        self.narrations.append(request)


def robot_inputs():
    inputs = InputSet([('image', InputSource('camera:image', 'camera', lambda m: m))],
                      InputSource('joint_states', 'joints', lambda m: m), STALE_S)
    inputs.set_instruction(sanitize_instruction('go', 100))
    return inputs


def feed(inputs, frame, now_s):
    inputs.put('camera:image', np.zeros((2, 2, 3), np.uint8), now_s)
    inputs.put('joint_states', np.array([float(frame)]), now_s)


def make_loop(periods, gather_s=0.0, prefill_s=0.0, budgets=None, step_s=lambda rows: 0.0,
              n_tokens=4, problems=None):
    policy = LanguagePolicy(max_new_tokens=n_tokens, eos_id=None)
    budgets = budgets or {}
    fleet = fake_fleet({name: (tag, policy, budgets.get(name, FixedBudget(2)), n_tokens + 1)
                        for tag, name in enumerate(periods, 1)},
                       prefill_s=prefill_s, step_s=step_s, frontend=StateFrontend)
    robots = [RobotLoop(name, robot_inputs(), RecordingSink(), period,
                        (problems or {}).get(name))
              for name, period in periods.items()]
    return FrameLoop(fleet, robots, gather_s=gather_s, clock=fleet.clock), fleet


def test_robots_tick_at_their_own_rates_and_share_coinciding_ticks():
    loop, fleet = make_loop({'fast': 0.1, 'slow': 0.2})
    served = []
    for tick in range(8):
        now = round(0.1 * tick, 6)
        for robot in loop.robots.values():
            feed(robot.inputs, tick, now)
        served.append(sorted(name for name, out in loop.tick(now).items() if out.action))
        if tick % 2 == 0:
            assert loop.last_result.prefill_rows == 2   # coinciding ticks: one act()
    assert [s.count('slow') for s in served] == [1, 0] * 4      # every other tick
    fast, slow = loop.robots['fast'].sink, loop.robots['slow'].sink
    assert len(fast.actions) == 8 and len(slow.actions) == 4
    assert loop.next_tick_s() == pytest.approx(0.8)
    now = loop.next_wake_s(0.7 + STALE_S)
    while fleet.num_live_requests:   # inputs stop: each robot's ticks still drain its requests
        outcomes = loop.tick(now)
        assert outcomes and all(o.action is None for o in outcomes.values())
        now = loop.next_wake_s(now)
    for name, sink in (('fast', fast), ('slow', slow)):
        tag = 1 if name == 'fast' else 2
        frames = [a.frame_index for a in sink.actions]
        texts = {r.origin_frame: r.token_ids for r in sink.narrations}
        assert sorted(texts) == frames
        for frame, action in zip(frames, sink.actions):
            state_frame = int(action.normalized[0, 0]) // 10
            assert texts[frame] == reference(key(state_frame, tag), 4)


def test_a_robot_whose_cameras_stop_never_delays_the_others():
    loop, fleet = make_loop({'a': 0.1, 'b': 0.1}, prefill_s=0.05)
    for tick in range(8):
        now = round(0.1 * tick, 6)
        feed(loop.robots['a'].inputs, tick, now)
        if tick < 3:
            feed(loop.robots['b'].inputs, tick, now)   # b's cameras stop after tick 2
        outcomes = loop.tick(now)
        a = outcomes['a']
        assert a.action is not None
        # a's actions wait for b's row only while b has a frame (0.05 s per prefill row);
        # b's last inputs (tick 2) are fresh at tick 3 and stale (> 0.15 s) from tick 4.
        assert a.latency_s == pytest.approx(0.05 * (2 if tick < 4 else 1))
        assert a.act_cpu_share is not None and a.act_cpu_share >= 0   # measured, as alone
        if tick >= 4:   # b stale: no action, the reason reported; nobody waited for it
            assert outcomes['b'].action is None
            assert 'stale' in outcomes['b'].problems['camera:image']
    b = loop.robots['b']
    # b's requests of its four frames still finished, on b's sink, without new frames.
    assert sorted(r.origin_frame for r in b.sink.narrations) == [0, 1, 2, 3]
    assert len(loop.robots['a'].sink.actions) == 8 and fleet.live_requests('b') == 0


def test_gathering_serves_nearly_coinciding_robots_early_never_late():
    loop, fleet = make_loop({'a': 0.1, 'b': 0.1}, gather_s=0.02)
    for robot in loop.robots.values():
        feed(robot.inputs, 0, 0.0)
    loop.robots['b'].next_due_s = 0.015    # b's grid is 15 ms behind a's
    assert sorted(loop.tick(0.0)) == ['a', 'b'] and loop.last_result.prefill_rows == 2
    assert loop.robots['b'].next_due_s == pytest.approx(0.115)   # its own grid, not a's
    loop.robots['b'].next_due_s = 0.13                            # beyond the window
    for robot in loop.robots.values():
        feed(robot.inputs, 1, 0.1)
    assert sorted(o for o, out in loop.tick(0.1).items() if out.action) == ['a']
    with pytest.raises(ValueError, match='not in the engine'):
        FrameLoop(fleet, [RobotLoop('c', robot_inputs(), RecordingSink(), 0.1)])
    with pytest.raises(ValueError, match='period_s'):
        RobotLoop('a', robot_inputs(), RecordingSink(), 0.0)


# ---- fleet timing -------------------------------------------------------------------------------

def run_timed(loop, fleet, seconds):
    """Drive `loop` as the node does: wake at loop.next_wake_s, a tick starting late when the
    one before ran past the wake-up. Return (wake-ups, [(robot, its grid tick, tick start)])."""
    clock = fleet.clock
    loop.restart(0.0)
    wake, wakes, served = 0.0, [], []
    frame = 0
    while wake < seconds:
        clock.now = max(clock.now, wake)         # idle until the wake-up, or late
        start = clock.now
        wakes.append(wake)
        dues = {name: robot.next_due_s for name, robot in loop.robots.items()}
        for robot in loop.robots.values():
            feed(robot.inputs, frame, start)
        frame += 1
        for name in loop.tick(start):
            served.append((name, dues[name], start))
        wake = loop.next_wake_s(wake)
    return wakes, served


def test_a_mixed_rate_fleet_serves_no_robot_late():
    """10 Hz and 15 Hz robots with adaptive budgets: each tick's language stops before the
    next robot is due (not at the end of its own robot's period), so no robot is served late,
    and every wake-up has a robot due (no language round without a robot's tick)."""
    periods = {'aloha': 0.1, 'droid': 1 / 15}
    budgets = {name: AdaptiveBudget(period, k_max=16) for name, period in periods.items()}
    step_s = 0.004                                 # every decode step: 4 ms on the fake clock
    loop, fleet = make_loop(periods, prefill_s=0.01, budgets=budgets, n_tokens=16,
                            step_s=lambda rows: step_s)
    rounds = []
    advance = fleet.advance_language

    def counted(robots=None, deadline_s=None, poll=None):
        rounds.append((sorted(robots), deadline_s))
        return advance(robots, deadline_s, poll)
    fleet.advance_language = counted
    wakes, served = run_timed(loop, fleet, 3.0)
    # The wake-ups are the robots' own ticks: 10 + 15 a second, 5 of which coincide.
    assert len(wakes) == pytest.approx(3.0 * 20, abs=2)
    assert len(rounds) == len(wakes)               # one language round per robot tick
    late = [(name, due, start) for name, due, start in served if start > due + 1e-9]
    assert not late, late[:5]
    for name in periods:
        stats = loop.robots[name].stats.snapshot()
        assert stats['deadline_misses_total'] == 0 and stats['ticks_total'] >= 29
        assert loop.robots[name].sink.narrations, f'{name}: its language made progress'
    # The 10 Hz robot's language ends by the 15 Hz robot's next tick, a third of its period.
    aloha_alone = [deadline for robots, deadline in rounds if robots == ['aloha']]
    assert aloha_alone and max(aloha_alone) < 0.034
    # An empty wake-up (nobody due) does nothing: no act(), no language round.
    before = len(rounds)
    now = fleet.clock.now
    assert loop.tick(loop.next_wake_s(now) - 0.02) == {}
    assert len(rounds) == before


def test_without_the_shared_deadline_the_slow_robot_would_be_late():
    """The same fleet, each budget against its own period (the bug this loop fixes)."""
    periods = {'aloha': 0.1, 'droid': 1 / 15}
    budgets = {name: AdaptiveBudget(period, k_max=16) for name, period in periods.items()}
    loop, fleet = make_loop(periods, prefill_s=0.01, budgets=budgets, n_tokens=16,
                            step_s=lambda rows: 0.004)
    advance = fleet.advance_language
    fleet.advance_language = lambda robots=None, deadline_s=None, poll=None: advance(robots)
    _, served = run_timed(loop, fleet, 3.0)
    assert [s for s in served if s[0] == 'droid' and s[2] > s[1] + 1e-9]


def test_a_fixed_budget_is_k_per_robot_tick():
    """decode_budget k: each robot's requests advance k tokens at its own ticks only."""
    periods = {'fast': 0.05, 'slow': 0.2}
    loop, fleet = make_loop(periods, budgets={'fast': FixedBudget(1), 'slow': FixedBudget(1)},
                            n_tokens=8)
    run_timed(loop, fleet, 1.0)
    slow = loop.robots['slow']
    # One token per tick of the slow robot, whatever the fast one's 4x more wake-ups.
    deltas = [d for d in slow.sink.deltas if d.request_id == 0]
    assert [len(d.token_ids) for d in deltas] == [1] * len(deltas)
    assert len(deltas) <= slow.stats.ticks_total


def test_wake_ups_are_the_robots_own_ticks():
    loop, _ = make_loop({'a': 1 / 9, 'b': 1 / 10})
    loop.restart(0.0)
    wake, wakes = 0.0, []
    while wake < 1.0 - 1e-9:
        wakes.append(wake)
        wake = loop.next_wake_s(wake)
    # 9 + 10 ticks a second, tick 0 shared: 18 wake-ups, not a 90 Hz common grid.
    assert len(wakes) == 18
    expected = sorted({round(i / 9, 9) for i in range(9)} | {round(i / 10, 9) for i in range(10)})
    assert [round(w, 9) for w in wakes] == expected


def test_a_failing_tick_is_recorded_and_advanced():
    loop, fleet = make_loop({'a': 0.1, 'b': 0.2})
    runner = fleet.runner
    prefill = runner.prefill_rows

    def broken(rows, slots):
        raise RuntimeError('injected prefill failure')
    runner.prefill_rows = broken
    for robot in loop.robots.values():
        feed(robot.inputs, 0, 0.0)
    with pytest.raises(RuntimeError, match='injected'):
        loop.tick(0.0)
    for robot in loop.robots.values():
        snap = robot.stats.snapshot()
        assert snap['ticks_total'] == 1 and snap['errors_total'] == 1
        assert 'injected prefill failure' in snap['last_error']
        assert robot.next_due_s == pytest.approx(robot.period_s)   # its grid moved on
    assert fleet.pool.num_in_use == 0                              # nothing held
    runner.prefill_rows = prefill
    for robot in loop.robots.values():
        feed(robot.inputs, 1, 0.1)
    assert loop.tick(0.1)['a'].action is not None                  # the next tick works


class BrokenActions(StateFrontend):
    """A robot whose action conversion fails: a model/config problem, not its input's."""

    def robot_actions(self, normalized, prepared, held=None):
        raise ValueError('actions: expected 7 columns, the model gives 3')


class BadInput(StateFrontend):
    def prepare(self, obs):
        raise ObservationError('camera image: expected uint8 HxWx3')


def test_only_a_bad_observation_is_reported_as_rejected():
    logs = {name: [] for name in ('bad_input', 'bad_config', 'good')}
    problems = {name: ProblemLog(lambda level, msg, lines=lines: lines.append((level, msg)))
                for name, lines in logs.items()}
    loop, fleet = make_loop({name: 0.1 for name in logs}, problems=problems)
    fleet.robots['bad_input'].frontend = BadInput(1)
    fleet.robots['bad_config'].frontend = BrokenActions(2)
    for robot in loop.robots.values():
        feed(robot.inputs, 0, 0.0)
    outcomes = loop.tick(0.0)
    bad_input, bad_config = outcomes['bad_input'], outcomes['bad_config']
    assert bad_input.action is None and bad_config.action is None
    assert outcomes['good'].action is not None
    # The input warning: only the bad observation.
    assert bad_input.rejected == 'observation rejected: camera image: expected uint8 HxWx3'
    assert not bad_input.error
    assert logs['bad_input'] == [(WARN, bad_input.rejected)]
    # The configuration error: reported as what it is, never as a rejected observation.
    assert not bad_config.rejected and 'observation' not in bad_config.problems
    assert bad_config.error == 'ValueError: actions: expected 7 columns, the model gives 3'
    assert logs['bad_config'] == [(ERROR, f'act() failed: {bad_config.error}')]
    assert loop.robots['bad_config'].stats.snapshot()['errors_total'] == 1
    assert fleet.pool.num_in_use == 1   # the good robot's request; the others hold nothing


def test_one_robots_engine_raises_what_failed():
    """The one-robot Engine view: a bad observation raises ObservationError, a configuration
    error its own ValueError (not an ObservationError)."""
    engine = make(LanguagePolicy(max_new_tokens=2, eos_id=None), FixedBudget(1))
    engine.frontend = BadInput(1)
    obs = Observation(images={}, state=np.zeros(1), instruction='go')
    with pytest.raises(ObservationError, match='uint8'):
        engine.act(obs)
    engine.frontend = BrokenActions(1)
    with pytest.raises(ValueError, match='7 columns') as raised:
        engine.act(obs)
    assert not isinstance(raised.value, ObservationError)
    assert engine.pool.num_in_use == 0
    assert isinstance(engine, Engine) and isinstance(engine.runner, FakeRunner)
    assert isinstance(engine.clock, FakeClock)
