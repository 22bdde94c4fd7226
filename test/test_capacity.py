"""The rate this machine holds: timed at configure, auto rate = 90% of it.

The estimate is checked against ticks of the node's engine at its least language work, both
read on a clock that moves by fixed model-call costs (CostClock): what is compared is the
estimate's method, not two timing windows of a shared machine.
"""

import dataclasses
import statistics

import pytest
import torch

from oxygen_ros.engine import AdaptiveBudget, FixedBudget, make_engine, random_observation
from oxygen_ros.runtime.capacity import (ASK_WINDOWS, AUTO_SHARE, Capacity, capacity_from,
                                         fit_line, question_reserve, RateSettler,
                                         resolve_rate, SETTLE_SKIP, SETTLE_TICKS,
                                         steady_batch, steady_frame, STEADY_FRAMES, time_ticks)
from oxygen_ros.runtime.engine_setup import (build_engine, load_model, tasks_for, robot_spec,
                                             time_capacity)
from oxygen_ros.runtime.params import check_value, Settings


def test_fit_line_ignores_one_slow_frame():
    points = [(1, 0.011), (2, 0.012), (3, 0.013), (4, 0.090), (5, 0.015)]   # frame 4: a burst
    a, b = fit_line(points)
    assert a == pytest.approx(0.010, abs=1e-9) and b == pytest.approx(0.001, abs=1e-9)
    assert fit_line([(2, 0.02), (2, 0.03), (2, 0.04)]) == (0.03, 0.0)        # one batch size
    assert fit_line([(1, 0.03), (2, 0.02)])[1] == 0.0                         # never negative


def test_steady_batch_and_capacity_figures():
    assert steady_batch(10, 1, 1) == 10 and steady_batch(10, 5, 1) == 2
    assert steady_batch(10, 1, 3) == 4 and steady_batch(10, 1, 0) == 0
    assert steady_batch(10, 1, 1, max_live=3) == 3                  # a small kv_capacity
    timed = [(0.100, 0.111, 1), (0.102, 0.114, 2), (0.098, 0.111, 3)]   # language 11-13 ms
    capacity = capacity_from(timed, 10, 'preset p')     # no steady frame: extrapolated
    assert capacity.act_s == 0.100 and capacity.language_s == pytest.approx(0.020)
    assert capacity.rate_hz == pytest.approx(1 / capacity.tick_s)
    assert capacity.auto_rate_hz() == pytest.approx(AUTO_SHARE * capacity.rate_hz)
    assert resolve_rate(0.0, capacity) == capacity.auto_rate_hz()
    assert resolve_rate(7.5, capacity) == 7.5
    with pytest.raises(ValueError, match='auto'):
        resolve_rate(0.0, None)
    text = capacity.describe(10.0)
    assert text.startswith(f'holds about {capacity.rate_hz:.3g} Hz at preset p, asked 10 Hz')
    assert Capacity(1e4, 0.0, 0, 2, 'x').auto_rate_hz() == 0.1     # within the parameter range
    assert 'question' not in text and 'capacity_ask_ms' not in capacity.values()


def test_the_question_reserve_is_part_of_the_tick():
    """A question's extend pass and N - 1 one-row steps, spread over ASK_WINDOWS ticks."""
    assert question_reserve(0.012, 0.004, 10) == pytest.approx((0.012 + 9 * 0.004) / ASK_WINDOWS)
    assert question_reserve(0.012, 0.004, 10, windows=2) == pytest.approx(0.024)
    assert question_reserve(0.012, 0.004, 0) == 0.0                 # no questions, no reserve
    timed = [(0.080, 0.091, 10)] * 4
    plain = capacity_from(timed, 10, 'preset p', steady_from=1)
    kept = capacity_from(timed, 10, 'preset p', steady_from=1, ask_s=0.016)
    assert kept.tick_s == pytest.approx(plain.tick_s + 0.016) == pytest.approx(0.107)
    assert kept.auto_rate_hz() == pytest.approx(AUTO_SHARE / 0.107)
    assert '+ 16 ms kept for a question' in kept.describe(8.0)
    assert kept.values()['capacity_ask_ms'] == pytest.approx(16.0)


def test_the_language_is_timed_at_the_steady_batch_not_extrapolated():
    """Frames run until the first request has ended, then STEADY_FRAMES at the steady batch:
    its median is the language, whatever a line through the growing batches would say."""
    assert steady_frame(10, 1, 1) == 10 and steady_frame(10, 5, 3) == 2
    assert steady_frame(10, 1, 0) == 0
    frames = []

    def tick(index):
        frames.append(index)
        batch = min(index, 9)
        # A step of 9 rows costs 3x what the line through 1-5 rows gives (cache traffic).
        language = 0.010 + 0.001 * batch if batch < 6 else 0.045
        return 0.1, 0.1 + language, batch
    timed = time_ticks(tick, frames=5, steady_from=10)
    assert frames == list(range(10 + STEADY_FRAMES)) and len(timed) == 9 + STEADY_FRAMES
    capacity = capacity_from(timed, 10, 'preset p', steady_from=10)
    assert capacity.language_s == pytest.approx(0.045) and capacity.frames == 12
    # Without the steady frames (a slow model stopped early) the line's extrapolation.
    early = capacity_from(timed[:5], 10, 'preset p', steady_from=10)
    assert early.language_s == pytest.approx(0.020)


def test_time_ticks_stops_a_slow_model_early():
    clock = {'now': 0.0}

    def tick(index):
        clock['now'] += 4.0                                            # 4 s a frame
        return 4.0, 4.0, index
    timed = time_ticks(tick, frames=5, steady_from=10, max_s=5.0, clock=lambda: clock['now'])
    assert [n for _, _, n in timed] == [1, 2]                          # untimed frame 0 first


def test_the_node_re_times_an_auto_rate_once_on_its_first_ticks():
    capacity = Capacity(0.080, 0.011, 10, 12, 'preset p', ask_s=0.020)   # 8.1 Hz auto
    settler = RateSettler(capacity, capacity.auto_rate_hz())
    rates = [settler.observe(0.500, 0.400) for _ in range(SETTLE_SKIP)]   # left out
    # The node's ticks: 95-97 ms outside their language round (build, act, tail).
    rates += [settler.observe(0.095 + 0.002 * (i % 2) + 0.020, 0.020)
              for i in range(SETTLE_TICKS)]
    assert rates[:-1] == [None] * (SETTLE_SKIP + SETTLE_TICKS - 1) and settler.done
    assert settler.retimed.act_s == pytest.approx(0.096)
    assert rates[-1] == pytest.approx(AUTO_SHARE / (0.096 + 0.011 + 0.020))
    assert settler.observe(0.2, 0.0) is None                          # once
    assert '7.09 Hz (configure: 8.11 Hz)' in settler.describe()
    # Ticks that hold the rate in use (within SETTLE_CHANGE): kept, nothing to apply.
    close = RateSettler(capacity, capacity.auto_rate_hz())
    out = [close.observe(0.0815 + 0.020, 0.020) for _ in range(SETTLE_SKIP + SETTLE_TICKS)]
    assert close.done and out == [None] * len(out)


def test_the_re_timing_prices_the_reserve_at_the_nodes_own_steps():
    """A question's one-row steps cost more in the node than in configure's loop: the reserve
    is priced again with the node's budget (median over the ticks), never below configure's."""
    from types import SimpleNamespace

    from oxygen_ros.engine import AdaptiveBudget, LanguagePolicy, LanguageTask
    from oxygen_ros.runtime.changes import node_reserve

    capacity = Capacity(0.080, 0.011, 10, 12, 'preset p', extend=(48, 0.010),
                        ask_s=question_reserve(0.010, 0.0035, 10))
    budget = AdaptiveBudget(0.125, k_max=10, prior_extend=(48, 0.010))
    ask = LanguageTask('ask', LanguagePolicy(max_new_tokens=10, every_n_frames=0),
                       priority=10, on_demand=True)
    scheduler = SimpleNamespace(tasks=(ask,), budget=budget)
    engine = SimpleNamespace(auto=('',), system=SimpleNamespace(scheduler=lambda name: scheduler))
    assert node_reserve(engine, capacity) == pytest.approx((0.010 + 9 * 0.0) / ASK_WINDOWS)
    for _ in range(5):
        budget.observe_decode(1, 0.005)   # the node's one-row steps: 5 ms
    node = node_reserve(engine, capacity)
    assert node == pytest.approx((0.010 + 9 * 0.005) / ASK_WINDOWS)
    settler = RateSettler(capacity, capacity.auto_rate_hz())
    for _ in range(SETTLE_SKIP + SETTLE_TICKS):
        rate = settler.observe(0.100, 0.010, node)
    assert settler.retimed.ask_s == pytest.approx(node)
    assert rate == pytest.approx(AUTO_SHARE / (0.090 + 0.011 + node))
    assert 'kept for a question at its steps there' in settler.describe()
    cheaper = RateSettler(capacity, capacity.auto_rate_hz())   # the node's steps cheaper
    for _ in range(SETTLE_SKIP + SETTLE_TICKS):
        cheaper.observe(0.100, 0.010, 0.001)
    assert cheaper.retimed.ask_s == capacity.ask_s


def test_control_rate_zero_is_auto_and_values_between_are_refused():
    assert check_value('control_rate_hz', 0.0) is None
    assert 'auto' in check_value('control_rate_hz', 0.05)
    assert check_value('control_rate_hz', -1.0) is not None
    settings = Settings.from_values({'control_rate_hz': 0.0})
    with pytest.raises(ValueError, match='auto'):
        settings.period_s


def test_build_engine_resolves_auto_to_ninety_percent_of_capacity():
    settings = Settings.from_values({'preset': 'tiny', 'control_rate_hz': 0.0,
                                     'tokens_per_request': 4, 'torch_threads': 1})
    engine = build_engine(settings, warmup=False)       # auto times the machine regardless
    capacity = engine.capacity
    assert capacity is not None and capacity.frames >= 2 and capacity.steady_batch == 4
    assert engine.settings.control_rate_hz == pytest.approx(capacity.auto_rate_hz())
    assert isinstance(engine.system.budget, AdaptiveBudget)
    assert engine.system.budget.frame_period_s == pytest.approx(engine.settings.period_s)
    assert engine.description['control_rate'] == 'auto: 90% of capacity'
    assert 'holds about' in engine.description['capacity']
    assert engine.system.scheduler.now == -1                          # the node's numbering
    given = build_engine(dataclasses.replace(settings, control_rate_hz=5.0), warmup=False)
    assert given.capacity is None and given.settings.control_rate_hz == 5.0
    # Questions on (ask_tokens 10, the default): the tick keeps more than its share of their
    # extend pass (their steps, timed, too); without questions nothing is kept.
    assert settings.ask_tokens == 10 and capacity.extend is not None
    assert capacity.ask_s > capacity.extend[1] / ASK_WINDOWS
    assert 'kept for a question' in engine.description['capacity']
    silent = build_engine(dataclasses.replace(settings, ask_tokens=0), warmup=False)
    assert silent.capacity.ask_s == 0.0


class CostClock:
    """A clock that moves only by fixed costs of the model's calls (seconds per call/row).

    The estimate and the ticks then read the same costs wherever they run: what is compared
    is the estimate's method (which terms, at which batch), not two timing windows of a
    shared machine (CI once read act() 1.33x apart in two windows seconds apart, the other
    vCPU busy in one; the speed itself is the node benchmark's).
    """

    PREFILL, DENOISE, EXTEND = 0.040, 0.011, 0.006
    FIRST_ROW, STEP, STEP_ROW = 0.0007, 0.003, 0.0004

    def __init__(self, model, monkeypatch):
        self.now = 0.0
        costs = {'prefill': lambda kw, a: self.PREFILL,
                 'sample_actions': lambda kw, a: self.DENOISE,
                 'lm_logits': lambda kw, a: self.FIRST_ROW * a[0].shape[0],
                 'decode_step': lambda kw, a: self.STEP + self.STEP_ROW * a[1].shape[0],
                 'extend_step': lambda kw, a: self.EXTEND}
        for name, cost in costs.items():
            monkeypatch.setattr(model, name, self._charged(getattr(model, name), cost))

    def _charged(self, call, cost):
        def charged(*args, **kwargs):
            out = call(*args, **kwargs)
            self.now += cost(kwargs, args)
            return out
        return charged

    def __call__(self) -> float:
        return self.now


def test_the_estimate_predicts_the_ticks_and_their_language(monkeypatch):
    """The node's engine (N = 10, adaptive) at its least language work."""
    threads = torch.get_num_threads()
    settings = Settings.from_values({'preset': 'tiny', 'torch_threads': 1,
                                     'control_rate_hz': 10.0})
    try:
        model, make_frontend, _, _ = load_model(settings)     # sets 1 torch thread
        frontend = make_frontend(robot_spec(settings))
        clock = CostClock(model, monkeypatch)
        capacity = time_capacity(model, frontend, settings, clock=clock)
        # The node's language at its minimum: every live request one step a frame (k_min).
        system = make_engine('oxygen', model, frontend, tasks_for(settings, frontend.eos_id),
                             FixedBudget(1), seed=settings.seed, clock=clock)
        ticks, language = [], []
        for frame in range(settings.tokens_per_request + 8):
            result = system.step(random_observation(settings.robot, frame, settings.seed,
                                                    image_size=model.config.vision.image_size))
            if frame > settings.tokens_per_request:                   # the steady batch
                ticks.append(result.timings.total_s)
                language.append(result.timings.total_s - result.timings.act_s)
    finally:
        torch.set_num_threads(threads)
    assert isinstance(system.budget, FixedBudget) and result.decode_batch_size >= 9
    c = CostClock
    measured = statistics.median(ticks)
    # The measured ticks had no question: the tick without its reserve, term by term. Costs
    # are exact here, so any missing, doubled or mis-batched term shows.
    assert capacity.act_s == pytest.approx(c.PREFILL + c.DENOISE, abs=1e-9), capacity
    assert capacity.language_s == pytest.approx(statistics.median(language), abs=1e-9), (
        capacity, language)
    assert capacity.act_s + capacity.language_s == pytest.approx(measured, abs=1e-9)
    # At least one decode step over the steady batch's other rows is in it.
    assert capacity.language_s >= c.STEP + c.STEP_ROW * (capacity.steady_batch - 1)


def test_a_fleet_times_every_robot_ticking_together():
    from oxygen_ros.runtime.engine_setup import build_fleet
    from oxygen_ros.runtime.params import FleetSettings

    fleet = FleetSettings.from_values({
        'preset': 'tiny', 'torch_threads': 1, 'tokens_per_request': 4,
        'robots': ['arm_a', 'arm_b'], 'arm_a.control_rate_hz': 0.0,
        'arm_b.control_rate_hz': 5.0, 'arm_b.robot': 'droid'})
    engine = build_fleet(fleet, warmup=False)           # an auto robot: timed regardless
    capacity = engine.capacity
    assert 'with 2 robots ticking together' in capacity.label
    assert capacity.steady_batch == 8                   # 4 live requests per robot
    rates = {name: s.control_rate_hz for name, s in engine.settings.robots.items()}
    assert rates == {'arm_a': pytest.approx(capacity.auto_rate_hz()), 'arm_b': 5.0}
    budget = engine.system.scheduler('arm_a').budget
    assert budget.frame_period_s == pytest.approx(1.0 / rates['arm_a'])
    assert engine.description['robot_rates_hz'].startswith('arm_a ')


@pytest.mark.parametrize('mode', ['off', 'guided', 'prefix'])
def test_with_rtc_on_the_timed_frames_continue_the_last_chunk(monkeypatch, mode):
    """An auto rate holds with the RTC mode the node runs: its frames are what gets timed."""
    from oxygen_ros.engine.fleet import FleetEngine
    from oxygen_ros.runtime.capacity import TIMED_FRAMES

    seen = []
    act = FleetEngine.act

    def spy(self, observations, continuations=None):
        seen.append(dict(continuations or {}))
        return act(self, observations, continuations)
    monkeypatch.setattr(FleetEngine, 'act', spy)
    settings = Settings.from_values({'preset': 'tiny', 'control_rate_hz': 0.0,
                                     'tokens_per_request': 4, 'torch_threads': 1,
                                     'rtc_mode': mode})
    model, make_frontend, _, _ = load_model(settings)
    time_capacity(model, make_frontend(robot_spec(settings)), settings)
    assert len(seen) >= 3 and seen[0] == {}             # the untimed first frame: no chunk yet
    if mode == 'off':
        assert all(c == {} for c in seen)
        return
    for continuations in seen[1:]:
        (cont,) = continuations.values()
        assert cont.mode == mode and cont.delay == 1
        assert cont.rows.shape == (model.config.action_horizon - 1,
                                   len(make_frontend(robot_spec(settings)).adapter.spec
                                       .action_names))
    assert len(seen) == 1 + max(TIMED_FRAMES, 4 - 1 + STEADY_FRAMES)   # N = 4: steady from 4
