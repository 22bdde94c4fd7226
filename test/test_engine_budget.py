"""Decode budgets and language policies, with fake costs (no model, no clocks)."""

import math

import numpy as np
import pytest

from oxygen_ros.engine.budget import AdaptiveBudget, FixedBudget, StepCostModel
from oxygen_ros.engine.workload import (default_num_slots, frame_noise, get_workload,
                                        LanguagePolicy, NOISE_BLOCK_FRAMES)


def test_fixed_budget():
    budget = FixedBudget(3)
    assert budget.choose(10.0, 7) == 3 and budget.allow_more(10.0, 7)
    with pytest.raises(ValueError):
        FixedBudget(0)


def test_step_cost_model_interpolates_and_extrapolates():
    cost = StepCostModel(ema=0.5)
    assert cost.estimate(3) is None
    cost.observe(2, 0.010)
    assert cost.estimate(2) == pytest.approx(0.010)
    assert cost.estimate(1) == pytest.approx(0.010)        # fewer rows: never assumed cheaper
    assert cost.estimate(4) == pytest.approx(0.020)        # one point: linear in rows
    cost.observe(4, 0.014)
    assert cost.estimate(3) == pytest.approx(0.012)        # interpolation
    assert cost.estimate(6) == pytest.approx(0.018)        # extrapolation, last slope
    cost.observe(2, 0.020)                                 # slower: believed at once
    assert cost.estimate(2) == pytest.approx(0.020)
    cost.observe(2, 0.010)                                 # faster: EMA drifts down
    assert cost.estimate(2) == pytest.approx(0.0125)


def simulate(budget, frames, action_s, step_cost, batch_size=3, minimum=0):
    """Run `frames` frames against a fake cost model; return [(k, steps run, frame time)].

    minimum: steps every frame takes whatever the budget says (the scheduler's floor).
    """
    out = []
    for _ in range(frames):
        elapsed = action_s
        budget.observe_action(action_s)
        k = budget.choose(elapsed, batch_size)
        steps = 0
        while steps < max(k, minimum) and (steps == 0 or steps < minimum
                                           or budget.allow_more(elapsed, batch_size)):
            cost = step_cost(batch_size)
            elapsed += cost
            budget.observe_decode(batch_size, cost)
            steps += 1
        out.append((k, steps, elapsed))
    return out


def test_adaptive_fits_deadline_and_uses_slack():
    period = 0.100
    budget = AdaptiveBudget(period, k_max=50, margin=0.05)
    runs = simulate(budget, 10, action_s=0.040, step_cost=lambda b: 0.004 + 0.002 * b)
    assert runs[0][0] == 1                                 # probe: nothing measured yet
    for k, steps, elapsed in runs[1:]:
        assert elapsed <= period * 0.95 + 1e-12
        # Slack is 55 ms, a step 10 ms: it must use the slack, not just one token.
        assert k == math.floor((0.095 - 0.040) / 0.010) == 5 and steps == k


def test_adaptive_reacts_when_decode_gets_slower():
    budget = AdaptiveBudget(0.100, k_max=50, margin=0.0)
    cost = {'per_step': 0.010}
    simulate(budget, 5, 0.040, lambda b: cost['per_step'])
    assert budget.last_k == 6
    cost['per_step'] = 0.020                               # e.g. the GPU got shared
    runs = simulate(budget, 8, 0.040, lambda b: cost['per_step'])
    assert runs[-1][0] == 3                                # (100 - 40) / 20
    # allow_more() stops the first slow frame early; later frames fit outright.
    assert all(elapsed <= 0.100 + 1e-9 for _, _, elapsed in runs[1:])
    assert runs[0][1] < runs[0][0] or runs[0][2] <= 0.100 + 1e-9


def test_adaptive_recovers_from_one_slow_step():
    """One hiccup (e.g. a GC pause) must not keep k at 0 for the rest of the run."""
    budget = AdaptiveBudget(0.100, k_max=50, margin=0.0)
    simulate(budget, 5, 0.040, lambda b: 0.010, batch_size=2)
    assert budget.last_k == 6
    budget.observe_decode(2, 0.250)                        # one step 25x slower
    assert budget.choose(0.040, 2) == 0
    # Normal steps at a neighbouring batch size correct the stale estimate at once...
    budget.observe_decode(3, 0.012)
    assert budget.cost.estimate(2) <= 0.012
    assert budget.choose(0.040, 2) >= 4
    # ...and the scheduler's minimum steps at the same size bring k back within a few frames.
    budget = AdaptiveBudget(0.100, k_max=50, margin=0.0)
    simulate(budget, 5, 0.040, lambda b: 0.010, batch_size=2)
    budget.observe_decode(2, 0.250)
    runs = simulate(budget, 30, 0.040, lambda b: 0.010, batch_size=2, minimum=1)
    assert runs[0][0] == 0 and runs[-1][0] == 6


def test_adaptive_gives_nothing_without_slack():
    """No slack, k = 0: the budget adds no steps; the scheduler's minimum is the floor."""
    budget = AdaptiveBudget(0.100, k_max=8)
    assert budget.k_min == 1
    budget.observe_decode(1, 0.010)
    # The action path alone overruns the period: no slack at all.
    assert [budget.choose(0.150, 1) for _ in range(12)] == [0] * 12
    # Slack of exactly one step gives one token.
    assert budget.choose(0.095 - 0.010, 1) == 1


def test_adaptive_prices_an_extend_pass_by_its_own_cost():
    """A pass over a template costs what was timed (configure's prior, then measured), not a
    decode step; before anything is known it is priced as one one-row step."""
    budget = AdaptiveBudget(0.100, k_max=16, margin=0.0)
    assert budget.extend_estimate(40) == 0.0
    budget.observe_decode(1, 0.002)
    assert budget.extend_estimate(40) == 0.002
    primed = AdaptiveBudget(0.100, k_max=16, margin=0.0, prior_extend=(48, 0.012))
    assert primed.extend_estimate(48) == pytest.approx(0.012)
    assert primed.extend_estimate(96) == pytest.approx(0.024)   # rows x tokens: pessimistic
    primed.observe_extend(48, 0.020)   # slower than configure's: believed at once
    assert primed.extend_estimate(48) == pytest.approx(0.020)
    assert FixedBudget(2).extend_estimate(48) == 0.0


def test_adaptive_keeps_the_measured_tail_free_not_a_flat_margin():
    """Until a tick's tail (its time after the last language step) is measured, the margin
    (5%) is kept free; then the tail plus 2% of the period, never more than the margin; a
    fleet's earlier deadline is reserved the same way. A first-token call is priced by its
    own model; a fixed budget is not bound by time."""
    budget = AdaptiveBudget(0.100, k_max=16)
    assert budget.deadline_s == pytest.approx(0.095)
    budget.observe_tail(0.001)
    assert budget.deadline_s == pytest.approx(0.097)           # 1 ms tail + 2 ms guard
    assert budget.time_left(0.090) == pytest.approx(0.007)
    assert budget.time_left(0.030, deadline_s=0.050) == pytest.approx(0.050 - 0.002 - 0.030)
    budget.observe_tail(0.020)                                 # a slow tick: at most 5%
    assert budget.deadline_s == pytest.approx(0.095)
    assert budget.first_estimate(2) == 0.0                     # nothing timed yet
    budget.observe_first(1, 0.0015)
    assert budget.first_estimate(1) == pytest.approx(0.0015)
    assert budget.first_estimate(0) == 0.0
    assert FixedBudget(2).time_left(0.5) == math.inf


def test_adaptive_rejects_bad_settings():
    with pytest.raises(ValueError):
        AdaptiveBudget(0.0)
    with pytest.raises(ValueError):
        AdaptiveBudget(0.1, k_max=0)
    with pytest.raises(ValueError):
        AdaptiveBudget(0.1, k_max=4, k_min=5)


def test_policy_arrivals_are_pure_and_seeded():
    every3 = LanguagePolicy(every_n_frames=3)
    assert [every3.arrivals(f) for f in range(7)] == [1, 0, 0, 1, 0, 0, 1]
    assert LanguagePolicy(every_n_frames=0).arrivals(0) == 0
    poisson = LanguagePolicy(arrival_rate=0.5, seed=4)
    counts = [poisson.arrivals(f) for f in range(2000)]
    assert counts[:50] == [poisson.arrivals(f) for f in range(50)]     # order-independent
    assert 0.4 < sum(counts) / len(counts) < 0.6
    assert counts != [LanguagePolicy(arrival_rate=0.5, seed=5).arrivals(f) for f in range(2000)]


def test_policy_lengths_template_and_sizing():
    mixed = LanguagePolicy(length_choices=(5, 10, 30), seed=1)
    lengths = {mixed.request_len(f) for f in range(100)}
    assert lengths == {5, 10, 30} and mixed.max_request_len == 30
    assert LanguagePolicy(prompt_template='Say: {instruction}').prompt_text('go') == 'Say: go'
    assert LanguagePolicy().prompt_text('go') == ''
    # ceil(N/k) slots (the frame's own adopted by its request) + 1 spare
    assert default_num_slots(LanguagePolicy(max_new_tokens=30), 5) == 6 + 1
    assert default_num_slots(LanguagePolicy(max_new_tokens=10), 3) == 4 + 1
    with pytest.raises(ValueError):
        LanguagePolicy(max_new_tokens=0)


def test_noise_depends_on_seed_and_frame_only():
    a = frame_noise(0, 5, 4, 32)
    assert a.shape == (4, 32) and a.dtype.name == 'float32'
    assert (a == frame_noise(0, 5, 4, 32)).all()
    assert not (a == frame_noise(0, 6, 4, 32)).all() and not (a == frame_noise(1, 5, 4, 32)).all()
    # Drawn a block of frames at a time: a caller's array is its own (the model may write
    # into it), frames on either side of a block's edge differ, the whole is N(0, 1).
    drawn = a.copy()
    a += 1.0
    assert (frame_noise(0, 5, 4, 32) == drawn).all()
    frames = np.stack([frame_noise(3, f, 10, 32) for f in range(3 * NOISE_BLOCK_FRAMES)])
    edge = NOISE_BLOCK_FRAMES
    assert not np.isclose(frames[edge - 1], frames[edge]).any()
    assert len({row.tobytes() for row in frames}) == len(frames)
    assert abs(frames.mean()) < 0.05 and abs(frames.std() - 1.0) < 0.05


def test_reference_workloads():
    assert get_workload('libero').action_dim == 7 and get_workload('aloha').state_dim == 14
    with pytest.raises(ValueError):
        get_workload('mars')
