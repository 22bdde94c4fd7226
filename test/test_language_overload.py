"""Language under overload, and the scheduler's rules behind it (fake runner, fake clock).

The action path alone takes 2x or 10x the control period, so the adaptive budget gives k = 0
every frame. Before issue 20 the requests then outlived the pool and the oldest was evicted
each frame: nothing ever finished. Now every admitted request finishes by its pool deadline,
completions keep coming, and the action is still emitted before any language work.
"""

import pytest

from oxygen_ros.engine import AdaptiveBudget, FixedBudget, LanguagePolicy
from oxygen_ros.runtime.frame_loop import FrameLoop, RobotLoop
from oxygen_ros.runtime.status import LoopStats
from test_engine_fleet import fake_fleet, key, TaggedFrontend
from test_engine_scheduler import FakeFrontend, FakeRunner, make, obs, reference
from test_frame_loop import feed, RecordingSink, robot_inputs

PERIOD_S = 0.100
N = 10


def step_s(rows):
    """Fake seconds of one decode step of `rows` rows."""
    return 0.002 + 0.001 * rows


class StateFrontend(FakeFrontend):
    """The frame is the first state entry the inputs carry (a FrameLoop sets no index)."""

    def prepare(self, observation):
        prepared = super().prepare(observation)
        prepared.tensors['frame'] = int(observation.state[0])
        return prepared


class SlowActRunner(FakeRunner):
    """A FakeRunner whose action path costs `act_s` on the fake clock."""

    act_s = 0.0

    def sample_actions(self, slot, noise, plan=None):
        self.clock.now += self.act_s
        return super().sample_actions(slot, noise, plan)


class StingyBudget:
    """What an overloaded budget gives: `k` steps, and never one more (allow_more False)."""

    unlimited = False

    def __init__(self, k=0, k_min=1):
        self.k, self.k_min, self.k_max = k, k_min, max(k, k_min)

    def choose(self, elapsed_s, batch_size, deadline_s=None):
        return self.k

    def allow_more(self, elapsed_s, batch_size, deadline_s=None):
        return False

    def time_left(self, elapsed_s, deadline_s=None):
        return 0.0

    def observe_action(self, seconds):
        pass

    def observe_tail(self, seconds):
        pass

    def observe_decode(self, batch_size, seconds):
        pass

    def observe_extend(self, tokens, seconds):
        pass

    def extend_estimate(self, tokens):
        return 0.0

    def observe_first(self, rows, seconds):
        pass

    def first_estimate(self, rows):
        return 0.0

    def step_estimate(self, batch_size):
        return 0.0


def overloaded_engine(overload):
    """The node's default language (N = 10, one request a frame, adaptive k) on a slow act."""
    policy = LanguagePolicy(max_new_tokens=N, eos_id=None)
    engine = make(policy, AdaptiveBudget(PERIOD_S, k_max=N), sizing_k=1, step_s=step_s)
    runner = SlowActRunner(engine.pool.num_slots, N - 1, engine.clock, step_s)
    runner.act_s = overload * PERIOD_S
    engine.runner = runner
    engine.frontend = engine.output.frontend = StateFrontend()
    return engine


@pytest.mark.parametrize('overload', [2, 10])
def test_every_admitted_request_finishes_under_overload(overload):
    engine = overloaded_engine(overload)
    clock, runner = engine.clock, engine.runner
    inputs, sink = robot_inputs(), RecordingSink()
    stats = LoopStats(window_s=60.0, clock=clock)
    loop = FrameLoop.one(engine, inputs, sink, PERIOD_S, stats=stats, clock=clock)
    frames = 150
    for frame in range(frames):
        feed(inputs, frame, clock.now)
        decode_calls = len(runner.decode_calls)
        (outcome,) = loop.tick(clock.now).values()
        # Actions never wait: the chunk is emitted after the action path alone, before any
        # language work of the tick.
        assert outcome.action is not None and outcome.latency_s == pytest.approx(runner.act_s)
        assert sink.actions[-1] is outcome.action
        result = outcome.result
        if frame >= 2:   # after the cost model's first probes, the budget gives nothing
            assert result.k == 1 and engine.budget.last_k == 0
        # The language work the overload costs: one decode step over the live requests.
        assert len(runner.decode_calls) - decode_calls <= 1
        assert outcome.duration_s <= runner.act_s + step_s(N) + 1e-9
    ended = loop.only.finished
    assert set(ended) == {'length'}                          # no eviction, no refusal
    assert ended['length'] >= frames - N
    for request in sink.narrations:
        assert request.token_ids == reference(request.origin_frame, N)
    completions_per_min = ended['length'] / (clock.now / 60.0)
    assert completions_per_min > 0
    snapshot = stats.snapshot()
    assert snapshot['requests_completed_window'] > 0
    assert snapshot['requests_evicted_window'] == snapshot['requests_refused_window'] == 0
    assert snapshot['completed_per_min'] > 0


@pytest.mark.parametrize('overload', [2, 10])
def test_every_admitted_request_of_a_fleet_finishes_under_overload(overload):
    policy = LanguagePolicy(max_new_tokens=N, eos_id=None)
    names = ('arm_left', 'arm_right')
    # Each robot's quota is its default N + 1 slots; the fleet's act costs overload periods.
    fleet = fake_fleet({name: (tag, policy, AdaptiveBudget(PERIOD_S, k_max=N), N + 1)
                        for tag, name in enumerate(names, 1)},
                       step_s=step_s, prefill_s=overload * PERIOD_S / 2,
                       frontend=FleetStateFrontend)
    robots = [RobotLoop(name, robot_inputs(), RecordingSink(), PERIOD_S) for name in names]
    loop = FrameLoop(fleet, robots, clock=fleet.clock)
    clock = fleet.clock
    for frame in range(100):
        for robot in robots:
            feed(robot.inputs, frame, clock.now)
        outcomes = loop.tick(clock.now)
        for name in names:
            assert outcomes[name].latency_s == pytest.approx(overload * PERIOD_S)
    for robot, tag in zip(robots, (1, 2)):
        assert set(robot.finished) == {'length'} and robot.finished['length'] >= 100 - N
        for request in robot.sink.narrations:
            assert request.token_ids == reference(key(request.origin_frame, tag), N)


class FleetStateFrontend(TaggedFrontend):
    """Robot `tag`'s frame is the first state entry its inputs carry."""

    def prepare(self, observation):
        prepared = FakeFrontend.prepare(self, observation)
        prepared.tensors['frame'] = key(int(observation.state[0]), self.tag)
        return prepared


# ---- the rules ---------------------------------------------------------------------------

def tokens_of(result, origin_frame=None):
    """Tokens a frame result carries (of the request started at origin_frame, if given)."""
    return sum(len(d.token_ids) for d in result.deltas
               if origin_frame is None or d.origin_frame == origin_frame)


def test_the_minimum_spreads_a_request_over_its_pool_deadline():
    """k = 0 from the budget: a request takes ceil(steps left / frames left) steps a frame."""
    policy = LanguagePolicy(max_new_tokens=N, eos_id=None, every_n_frames=100)
    engine = make(policy, StingyBudget(k=0, k_min=3), num_slots=5)
    tokens = [tokens_of(engine.step(obs(frame)), 0) for frame in range(5)]
    # Deadline: ceil(10 / 3) = 4 frames; 10 steps as 3, 3, 2, 2 (earliest deadline, spread).
    assert tokens == [3, 3, 2, 2, 0]
    assert engine.num_live_requests == 0


def test_the_deadline_check_never_stops_below_the_minimum():
    """allow_more says no after the first decode step; rows short of their minimum go on."""
    policy = LanguagePolicy(max_new_tokens=6, eos_id=None, every_n_frames=100)
    engine = make(policy, StingyBudget(k=5, k_min=3), num_slots=4)   # deadline: 2 frames
    result = engine.step(obs(0))
    # The first token from the prefix, one decode step, and one more to reach the minimum
    # of 3; the budget's k = 5 is cut short by its own deadline check.
    assert tokens_of(result) == 3 and result.decode_steps == 2
    results = [engine.step(obs(frame)) for frame in range(1, 4)]
    assert [tokens_of(r) for r in results] == [3, 0, 0]
    assert results[0].finished[0].finish_reason == 'length'


def test_requests_finish_when_frames_stop():
    """Ticks without a frame (stale cameras) take each request's minimum too."""
    policy = LanguagePolicy(max_new_tokens=N, eos_id=None, every_n_frames=100)
    engine = make(policy, StingyBudget(k=0, k_min=1), num_slots=N + 1)
    assert tokens_of(engine.step(obs(0))) == 1
    for _ in range(N - 1):
        assert tokens_of(engine.advance_language()) == 1
    assert engine.last_result.finished[0].finish_reason == 'length'
    assert engine.num_live_requests == 0


def test_admission_refuses_the_newest_when_the_pool_cannot_hold_it():
    """A request is admitted only if the next frame still finds a slot; none is evicted."""
    policy = LanguagePolicy(max_new_tokens=6, eos_id=None)
    engine = make(policy, StingyBudget(k=0, k_min=2), num_slots=2)   # deadlines of 3 frames
    reasons = {}
    for frame in range(9):
        result = engine.step(obs(frame))
        reasons.update((f.origin_frame, f.finish_reason) for f in result.finished)
        assert engine.num_live_requests <= 1                  # S - 1 after every frame
    # 0 holds the one slot a request may keep until it is done in frame 2, where 2 takes
    # its place: every other request is refused, and every admitted one finishes.
    assert [reasons[f] for f in range(8)] == ['length', 'refused'] * 4


def test_a_budget_change_keeps_the_deadlines_already_given():
    policy = LanguagePolicy(max_new_tokens=8, eos_id=None)
    engine = make(policy, FixedBudget(4), sizing_k=4)       # 3 slots, deadlines of 2 frames
    engine.step(obs(0))
    engine.set_budget(StingyBudget(k=0, k_min=1))          # deadlines of 8 frames from now on
    results = [engine.step(obs(frame)) for frame in range(1, 4)]
    # Frame 0's request keeps its deadline: its last 4 tokens in frame 1, whatever k is.
    first = results[0].finished[0]
    assert (first.origin_frame, first.finish_reason) == (0, 'length')
    assert first.token_ids == reference(0, 8)
    # Requests of 8 frames now: two fit next to the frame slot, the third is refused.
    assert [(f.origin_frame, f.finish_reason) for f in results[2].finished] == [(3, 'refused')]
    assert engine.num_live_requests == 2
