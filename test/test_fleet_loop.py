"""FleetLoop: R robots' inputs through one FleetEngine, each robot at its own period."""

import numpy as np
import pytest

from oxygen_ros.engine import FixedBudget, LanguagePolicy
from oxygen_ros.runtime.fleet_loop import FleetLoop, RobotLoop
from oxygen_ros.runtime.inputs import InputSet, InputSource, sanitize_instruction
from test_engine_fleet import fake_fleet, key, TaggedFrontend
from test_engine_scheduler import FakeFrontend, reference

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


def make_loop(periods, gather_s=0.0, prefill_s=0.0):
    policy = LanguagePolicy(max_new_tokens=4, eos_id=None)
    fleet = fake_fleet({name: (tag, policy, FixedBudget(2), 4)
                        for tag, name in enumerate(periods, 1)},
                       prefill_s=prefill_s, frontend=StateFrontend)
    robots = [RobotLoop(name, robot_inputs(), RecordingSink(), period)
              for name, period in periods.items()]
    return FleetLoop(fleet, robots, gather_s=gather_s, clock=fleet.clock), fleet


def test_robots_tick_at_their_own_rates_and_share_coinciding_ticks():
    loop, fleet = make_loop({'fast': 0.1, 'slow': 0.2})
    served = []
    for tick in range(8):
        now = round(0.1 * tick, 6)
        for robot in loop.robots.values():
            feed(robot.inputs, tick, now)
        served.append(sorted(name for name, out in loop.tick(now).items() if out.action))
        if tick % 2 == 0:
            assert loop.last_result.prefill_rows == 2   # coinciding ticks: one prefill
    assert [s.count('slow') for s in served] == [1, 0] * 4      # every other tick
    fast, slow = loop.robots['fast'].sink, loop.robots['slow'].sink
    assert len(fast.actions) == 8 and len(slow.actions) == 4
    assert loop.next_tick_s() == pytest.approx(0.8)
    for robot in loop.robots.values():
        robot.next_due_s = 99.0
    while fleet.num_live_requests:   # nobody due: live requests still advance
        outcomes = loop.tick(1.0)
        assert all(o.action is None for o in outcomes.values())
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
    with pytest.raises(ValueError, match='not in the fleet'):
        FleetLoop(fleet, [RobotLoop('c', robot_inputs(), RecordingSink(), 0.1)])
    with pytest.raises(ValueError, match='period_s'):
        RobotLoop('a', robot_inputs(), RecordingSink(), 0.0)
