"""Real-time chunking: the inpainting math, the committed chunk, the delay, the engine's act().

The math is checked on fake action experts whose velocity field is known, so what guidance
and prefix inpainting must give can be computed by hand; then on the tiny π0.5 (cache
untouched, no second prefill, language tokens unchanged).
"""

import math

import numpy as np
import pytest
import torch

from oxygen_ros.engine import (ActionOutput, Continuation, LanguagePolicy, make_engine,
                               random_observation, random_setup, UnlimitedBudget)
from oxygen_ros.model import get_preset, rtc
from oxygen_ros.model.robot_spec import get_robot
from oxygen_ros.model.robots import RobotAdapter
from oxygen_ros.model.normalize import NormStats
from oxygen_ros.runtime.params import AUTO_DELAY, RtcSettings
from oxygen_ros.runtime.rtc import (CommittedChunk, delay_rows, PlayedChunk, played_path,
                                    RtcPlanner)

H, A = 10, 6
STEPS = 10
BETA = 5.0


def constant_expert(velocity):
    """A fake action expert whose velocity does not depend on x: v(x, t) = velocity."""
    calls = []

    def expert(x_t, t):
        calls.append(t.clone())
        return velocity.expand_as(x_t)
    expert.calls = calls
    return expert


def contraction(steps, beta):
    """Π_k (1 - g(t_k) / n): how guidance shrinks the error of an x-independent expert."""
    return math.prod(1 - rtc.guidance_weight(1 - k / steps, beta) / steps for k in range(steps))


def noise_and_target(seed=0):
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(1, H, A, generator=gen)
    target = np.random.default_rng(seed).uniform(-1, 1, (H, A)).astype(np.float32)
    return noise, target


def random_velocity(seed):
    """A constant expert's velocity [1, H, A], seeded (not the process's torch RNG)."""
    return torch.randn(1, H, A, generator=torch.Generator().manual_seed(100 + seed))


# ---- the weights -------------------------------------------------------------------------------
@pytest.mark.parametrize('schedule', ['linear', 'exp'])
def test_weights_are_one_on_the_delay_decay_over_the_overlap_and_zero_beyond(schedule):
    d, end = 3, 8
    w = rtc.overlap_weights(H, d, end, schedule)
    assert w.shape == (H,)
    np.testing.assert_array_equal(w[:d], 1.0)                 # frozen rows
    overlap = w[d:end]
    assert np.all((overlap > 0) & (overlap < 1))
    assert np.all(np.diff(overlap) < 0)                       # strictly decaying
    np.testing.assert_array_equal(w[end:], 0.0)               # zero beyond the overlap
    # the paper's eq. 5: c_i = (end - i) / (end - d + 1), exp: c_i (e^c_i - 1) / (e - 1)
    c = (end - np.arange(d, end)) / (end - d + 1)
    expected = c if schedule == 'linear' else c * np.expm1(c) / (math.e - 1)
    np.testing.assert_allclose(overlap, expected, rtol=1e-6)


def test_exp_weights_decay_faster_than_linear_and_overlap_edges():
    lin, exp = rtc.overlap_weights(H, 2, 9, 'linear'), rtc.overlap_weights(H, 2, 9, 'exp')
    assert np.all(exp[2:9] < lin[2:9])
    np.testing.assert_array_equal(rtc.overlap_weights(H, 0, 0), 0.0)        # no overlap
    np.testing.assert_array_equal(rtc.overlap_weights(H, 4, 2), [1] * 4 + [0] * 6)  # end < d
    with pytest.raises(ValueError, match='schedule'):
        rtc.overlap_weights(H, 1, 5, 'cosine')


def test_guidance_weight_is_capped_and_smallest_midway():
    assert rtc.guidance_weight(1.0, BETA) == BETA and rtc.guidance_weight(0.0, BETA) == BETA
    assert rtc.guidance_weight(0.5, BETA) == pytest.approx(2.0)          # (¼ + ¼) / ¼
    assert rtc.guidance_weight(0.9, BETA) == BETA                        # 9.1 capped at 5
    assert rtc.guidance_weight(0.3, 100.0) == pytest.approx(rtc.guidance_weight(0.7, 100.0))


# ---- inpainting with a fake action expert -------------------------------------------------------
def test_prefix_inpainting_reproduces_the_frozen_rows_exactly():
    noise, target = noise_and_target()
    expert = constant_expert(random_velocity(0))
    plan = rtc.row_plan('prefix', target, H, delay=4, overlap_end=H)
    out = rtc.sample(expert, noise, STEPS, rtc.Inpainting.from_rows([plan], H, A))
    assert torch.equal(out[0, :4], torch.from_numpy(target[:4]))          # exactly
    # the free rows follow the expert as without inpainting: x_0 = noise - v
    free = noise - expert(noise, torch.ones(1))
    torch.testing.assert_close(out[0, 4:], free[0, 4:])
    # the frozen tokens are clean: flow time 0 on them, the step's time on the others
    for k, t in enumerate(expert.calls[:STEPS]):
        assert t.shape == (1, H)
        assert torch.all(t[0, :4] == 0) and torch.allclose(t[0, 4:], torch.tensor(1 - k / STEPS))


def test_guided_inpainting_contracts_the_error_by_the_guidance_schedule():
    """An x-independent expert: J = I, so each step multiplies W·(Y - Â) by (1 - g(t)/n).

    Tolerance: after n = 10 steps with β = 5 the frozen rows are within Π(1 - g/n) = 1.06 % of
    their starting distance |Y - (noise - v)|; the test asserts that bound (and the product
    itself, so a sign error or a wrong g would fail).
    """
    noise, target = noise_and_target(1)
    velocity = random_velocity(1)
    plan = rtc.RowPlan(target, np.ones(H, np.float32), delay=H,           # every row weight 1
                       max_guidance_weight=BETA)
    out = rtc.sample(constant_expert(velocity), noise, STEPS,
                     rtc.Inpainting.from_rows([plan], H, A))
    start_error = torch.from_numpy(target) - (noise - velocity)           # Y - Â at t = 1
    factor = contraction(STEPS, BETA)
    assert factor == pytest.approx(0.0106, abs=1e-4)
    # the residual itself, not residual / start_error: an element whose start is near its
    # target would divide float32 rounding by a small number
    torch.testing.assert_close(torch.from_numpy(target) - out, factor * start_error,
                               rtol=1e-3, atol=1e-5)
    assert torch.all((torch.from_numpy(target) - out).abs() <= factor * start_error.abs() + 1e-5)


def test_default_beta_lands_an_x_independent_expert_on_the_target_at_the_first_step():
    """The default β = 10 = n caps only t = 1, where g·|dt| = 1: Â moves all the way to Y.

    (β = 5, the paper's for its 5 steps, would also cap t = 0.9 and 0.1 at 10 steps.)
    """
    assert rtc.DEFAULT_MAX_GUIDANCE_WEIGHT == STEPS
    assert contraction(STEPS, rtc.DEFAULT_MAX_GUIDANCE_WEIGHT) == 0.0
    noise, target = noise_and_target(2)
    velocity = random_velocity(2)
    plan = rtc.row_plan('guided', target, H, delay=H - 1, overlap_end=H)
    assert plan.max_guidance_weight == rtc.DEFAULT_MAX_GUIDANCE_WEIGHT
    out = rtc.sample(constant_expert(velocity), noise, STEPS,
                     rtc.Inpainting.from_rows([plan], H, A))
    torch.testing.assert_close(out[0, :H - 1], torch.from_numpy(target[:H - 1]),
                               rtol=0, atol=1e-5)


def gaussian_expert(mean, std):
    """The exact velocity of flow matching to data ~ N(mean, std²) (per element).

    x_t = t ε + (1 - t) a; v = E[ε - a | x_t]; the clean estimate Â = x - t v = E[a | x_t]
    moves with x by J = (1 - t) std² / (t² + (1 - t)² std²): a known, x-dependent field.
    """
    def expert(x_t, t):
        t = t.reshape(-1, *[1] * (x_t.dim() - 1)) if t.dim() == 1 else t[..., None]
        var = t ** 2 + (1 - t) ** 2 * std ** 2
        mean_a = mean + (1 - t) * std ** 2 / var * (x_t - (1 - t) * mean)
        mean_eps = t / var * (x_t - (1 - t) * mean)
        return mean_eps - mean_a
    return expert


def test_guided_inpainting_matches_a_hand_written_vjp_of_a_known_field():
    """Autograd's VJP through the expert equals the closed-form J of a Gaussian field."""
    noise, target = noise_and_target(2)
    mean, std = 0.2, 0.8
    expert = gaussian_expert(mean, std)
    plan = rtc.row_plan('guided', target, H, delay=3, overlap_end=8, schedule='exp',
                        max_guidance_weight=BETA)
    out = rtc.sample(expert, noise, STEPS, rtc.Inpainting.from_rows([plan], H, A))
    # the same loop by hand: v' = v - g(t) J W (Y - Â), J = (1 - t) std² / var
    w = torch.from_numpy(plan.weights)[:, None]
    x = noise.clone()
    for k in range(STEPS):
        t = 1 - k / STEPS
        v = expert(x, torch.tensor([t]))
        jac = (1 - t) * std ** 2 / (t ** 2 + (1 - t) ** 2 * std ** 2)
        corr = jac * w * (torch.from_numpy(target) - (x - t * v))
        x = x - (v - rtc.guidance_weight(t, BETA) * corr) / STEPS
    torch.testing.assert_close(out, x, rtol=1e-5, atol=1e-5)
    # guided rows end closer to the target than the free flow; rows past the overlap do not move
    free = noise.clone()
    for k in range(STEPS):
        free = free - expert(free, torch.tensor([1 - k / STEPS])) / STEPS
    torch.testing.assert_close(out[0, 8:], free[0, 8:], rtol=0, atol=1e-6)
    gap = (out[0, :3] - torch.from_numpy(target[:3])).abs().mean()
    assert gap < 0.5 * (free[0, :3] - torch.from_numpy(target[:3])).abs().mean()
    # only the robot's columns are guided (the padding's error would steer the rest)
    narrow = rtc.sample(expert, noise, STEPS, rtc.Inpainting.from_rows(
        [rtc.row_plan('guided', target, H, 3, 8, columns=2, max_guidance_weight=BETA)], H, A))
    torch.testing.assert_close(narrow[..., :2], out[..., :2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(narrow[..., 2:], free[..., 2:], rtol=0, atol=1e-6)


def test_free_rows_and_mode_off_change_nothing():
    noise, target = noise_and_target(3)
    expert = constant_expert(random_velocity(3))
    assert rtc.row_plan('off', target, H, 2, H) is None
    assert rtc.row_plan('guided', target[:0], H, 2, H) is None          # nothing committed
    assert rtc.Inpainting.from_rows([None, None], H, A) is None
    # a batch: row 0 continues a chunk, row 1 is free and equals the plain flow
    plan = rtc.row_plan('guided', target, H, 2, H)
    noise2 = torch.cat([noise, noise])
    out = rtc.sample(expert, noise2, STEPS, rtc.Inpainting.from_rows([plan, None], H, A))
    torch.testing.assert_close(out[1], (noise - expert(noise, torch.ones(1)))[0])
    with pytest.raises(ValueError, match='mode'):
        rtc.row_plan('soft', target, H, 2, H)


def test_short_committed_chunk_caps_the_delay_and_weights():
    _, target = noise_and_target(4)
    plan = rtc.row_plan('guided', target[:3], H, delay=5, overlap_end=H)
    assert plan.delay == 3 and np.all(plan.weights[3:] == 0)
    held = rtc.row_plan('prefix', target[:3], H, delay=5, overlap_end=H)
    inpaint = rtc.Inpainting.from_rows([held], H, A)
    assert inpaint.frozen[0, :, 0].tolist() == [True] * 3 + [False] * 7


# ---- on the tiny π0.5 -------------------------------------------------------------------------
@pytest.fixture(scope='module')
def tiny():
    torch.manual_seed(0)
    model, frontend = random_setup(get_preset('tiny'), 'libero', seed=3)
    return model, frontend


@torch.no_grad()
def test_model_inpainting_reads_the_prefix_in_place(tiny):
    model, frontend = tiny
    cfg = model.config
    prefix = model.prefill(**frontend.prepare(random_observation('libero', 0, image_size=32))
                           .tensors, extra_len=2)
    k, v = prefix.kv.k.clone(), prefix.kv.v.clone()
    h, a = cfg.action_horizon, cfg.action_dim
    noise = torch.randn(1, h, a, generator=torch.Generator().manual_seed(5))
    target = np.random.default_rng(5).uniform(-1, 1, (h, a)).astype(np.float32)
    free = model.sample_actions(prefix, noise)
    held = model.sample_actions(prefix, noise, inpaint=rtc.Inpainting.from_rows(
        [rtc.row_plan('prefix', target, h, 2, h)], h, a))
    guided = model.sample_actions(prefix, noise, inpaint=rtc.Inpainting.from_rows(
        [rtc.row_plan('guided', target, h, 2, h)], h, a))
    assert torch.equal(held[0, :2], torch.from_numpy(target[:2]))
    y = torch.from_numpy(target[:2])
    assert (guided[0, :2] - y).abs().mean() < 0.3 * (free[0, :2] - y).abs().mean()
    assert torch.equal(prefix.kv.k, k) and torch.equal(prefix.kv.v, v)   # the cache is read only
    # no inpainting (all rows free) is the plain loop, bit for bit
    torch.testing.assert_close(model.sample_actions(prefix, noise), free, rtol=0, atol=0)


# ---- the frontend: robot units -> the model's normalised space ---------------------------------
# A robot of one's own (YAML): affine maps on state and actions, deltas on some columns; the
# second also through the named aloha transform (its affine comes after it on the way out).
YAML_ARM = """
name: arm5
cameras:
  - {name: front, slot: base_0_rgb}
state:
  dim: 5
  names: [j0, j1, j2, j3, grip]
  affine: {scale: [57.3, -2.0, 0.5, 1.0, 0.04], offset: [10.0, 0.0, -0.3, 0.0, 0.01]}
actions:
  dim: 4
  names: [j0, j1, j2, grip]
  space: joint_position
  rate_hz: 30
  open_loop_rows: 10
  delta_mask: [true, false, true, false]
  affine: {scale: [57.3, -2.0, 0.5, 0.04], offset: [10.0, 1.0, -0.3, 0.01]}
norm_stats: arm5
"""
YAML_ALOHA_SCALED = """
name: aloha_scaled
cameras:
  - {name: cam_high, slot: base_0_rgb}
  - {name: cam_left_wrist, slot: left_wrist_0_rgb}
state:
  dim: 14
  names: [%(names)s]
actions:
  dim: 14
  names: [%(names)s]
  space: joint_position
  rate_hz: 50
  open_loop_rows: 25
  delta_mask: [%(mask)s]
  affine: {scale: [%(scale)s], offset: [%(offset)s]}
transform: aloha_adapt_to_pi
norm_stats: trossen
""" % {'names': ', '.join(f'q{i}' for i in range(14)),
       'mask': ', '.join(['true'] * 6 + ['false'] + ['true'] * 6 + ['false']),
       'scale': ', '.join(str(0.5 + 0.1 * i) for i in range(14)),
       'offset': ', '.join(str(0.05 * i - 0.3) for i in range(14))}


@pytest.fixture(params=['libero', 'droid', 'aloha', 'yaml_arm', 'yaml_aloha_scaled'])
def any_robot(request, tmp_path):
    """A shipped robot's name, or the path of a robot YAML written here."""
    texts = {'yaml_arm': YAML_ARM, 'yaml_aloha_scaled': YAML_ALOHA_SCALED}
    if request.param not in texts:
        return request.param
    path = tmp_path / f'{request.param}.yaml'
    path.write_text(texts[request.param])
    return str(path)


def test_committed_rows_go_back_through_the_robots_transforms(any_robot, tiny):
    spec = get_robot(any_robot)
    rng = np.random.default_rng(7)
    lo = rng.uniform(-2, -1, 32)
    stats = {'state': NormStats(np.zeros(32), np.ones(32), lo, lo + 3),
             'actions': NormStats(np.zeros(32), np.ones(32), lo, lo + 3)}
    adapter = RobotAdapter(spec, stats, tiny[1].tokenizer)
    images = {cam: rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)
              for cam in spec.camera_names}
    inputs = adapter.prepare(images, rng.uniform(-0.5, 0.5, spec.state_dim), 'task')
    normalized = np.zeros((4, 32), np.float32)
    normalized[:, :spec.action_dim] = rng.uniform(-0.9, 0.9, (4, spec.action_dim))
    robot_rows = adapter.postprocess(normalized, inputs)
    back = adapter.model_actions(robot_rows, inputs)
    np.testing.assert_allclose(back, normalized, atol=2e-5)              # padding columns 0
    if spec.delta_action_mask is not None:
        # the delta base is this observation's state: another state gives other model rows
        other = adapter.prepare(images, rng.uniform(-0.5, 0.5, spec.state_dim), 'task')
        moved = np.abs(adapter.model_actions(robot_rows, other) - back).max(axis=0)
        mask = np.asarray(spec.delta_action_mask)
        assert np.all(moved[:mask.size][mask] > 1e-3) and np.all(moved[:mask.size][~mask] == 0)
    with pytest.raises(ValueError, match='committed actions'):
        adapter.model_actions(robot_rows[:, :-1], inputs)


# ---- the committed chunk and the delay ------------------------------------------------------
def test_delay_counts_the_rows_that_play_before_the_chunk_is_out():
    # row i plays at stamp + (i + 1) P: with P = 50 ms, a chunk out after 140 ms has missed
    # rows 0 (50 ms) and 1 (100 ms); row 2 (150 ms) is the first it can still play
    assert delay_rows(0.140, 0.05) == 2
    assert delay_rows(0.150, 0.05) == 2      # row 2 plays exactly when the chunk is out
    assert delay_rows(0.151, 0.05) == 3
    assert delay_rows(0.01, 0.05) == 0


def test_auto_delay_follows_a_latency_change():
    planner = RtcPlanner(RtcSettings('guided', delay=AUTO_DELAY), 0.05)
    assert planner.delay() == 0                               # nothing measured yet

    def publish(stamp, latency):
        planner.record(ActionOutput(0, np.zeros((H, 2), np.float32), np.zeros((H, 32)),
                                    latency, stamp), stamp + latency)
    for i in range(50):
        publish(0.1 * i, 0.06)
    assert planner.delay() == 1
    for i in range(50, 100):                                  # the engine slows down
        publish(0.1 * i, 0.22)
    assert planner.delay() == 4                               # ceil(0.22 / 0.05) - 1
    for i in range(100, 150):   # stamps on another clock (1000 s behind): act() time only
        planner.record(ActionOutput(0, np.zeros((H, 2), np.float32), np.zeros((H, 32)),
                                    0.11, 0.1 * i - 1000.0), 0.1 * i + 0.12)
    assert planner.delay() == 2                               # ceil(0.11 / 0.05) - 1
    planner.settings = RtcSettings('guided', delay=2)         # a fixed delay wins
    assert planner.delay() == 2
    # a delay past the chunk is capped by the engine: the chunk keeps a row to play
    plan = rtc.row_plan('guided', np.zeros((H, A), np.float32), H, delay=50, overlap_end=H)
    assert plan.delay == H - 1


def test_committed_rows_line_up_with_the_new_chunks_rows():
    chunk = CommittedChunk()
    assert chunk.rows_at(1.0) is None
    actions = np.arange(H * 2, dtype=float).reshape(H, 2)
    chunk.record(actions, 1.0, 0.05)
    np.testing.assert_array_equal(chunk.rows_at(1.0 + 3 * 0.05), actions[3:])    # exact rows
    half = chunk.rows_at(1.0 + 2.5 * 0.05)                   # between rows: interpolated
    np.testing.assert_allclose(half, (actions[2:-1] + actions[3:]) / 2)
    assert chunk.rows_at(0.9) is None                        # older observation
    assert chunk.rows_at(1.0 + H * 0.05) is None             # the chunk has run out


def test_planner_continues_the_newest_published_chunk():
    planner = RtcPlanner(RtcSettings('prefix', delay=2, execution_horizon=6), 0.05)
    assert planner.continuation(random_observation('libero', 0)) is None   # nothing yet
    actions = np.random.default_rng(0).normal(size=(H, 7)).astype(np.float32)
    planner.record(ActionOutput(0, actions, np.zeros((H, 32)), 0.03, 1.0), 1.03)
    obs = random_observation('libero', 1)
    obs.stamp = 1.1                                          # two rows later
    c = planner.continuation(obs)
    assert (c.mode, c.delay, c.overlap_end) == ('prefix', 2, 6)
    np.testing.assert_array_equal(c.rows, actions[2:])
    planner.settings = RtcSettings('off')
    assert planner.continuation(obs) is None
    with pytest.raises(ValueError, match='rtc_mode'):
        RtcPlanner(RtcSettings('sometimes'), 0.05)


def test_played_path_switches_at_start_rows_and_measures_jumps():
    P = 0.05
    old = np.zeros((H, 1))
    new = np.full((H, 1), 2.0)
    path = played_path([PlayedChunk(0.0, old, 0), PlayedChunk(0.1, new, 1)], P)
    # old plays rows 0.. from 0.05 s; new's row 1 is due at 0.2 s: old played rows 0..2
    np.testing.assert_allclose(path.times_s[:4], [0.05, 0.1, 0.15, 0.2])
    assert path.chunk_of_row.tolist()[:4] == [0, 0, 0, 1]
    np.testing.assert_allclose(path.jumps, [2.0])
    assert path.total_variation == pytest.approx(2.0)


# ---- the engine -------------------------------------------------------------------------------
def run_frames(model, frontend, settings, frames=5, n_tokens=4):
    """act() + advance_language() over the same frames with a planner; chunks and tokens."""
    policy = LanguagePolicy(max_new_tokens=n_tokens, eos_id=None)
    engine = make_engine('oxygen', model, frontend, policy, UnlimitedBudget(), seed=1)
    planner = RtcPlanner(settings, 0.05)
    chunks, tokens = [], {}
    for i in range(frames):
        obs = random_observation('libero', i, image_size=32)
        obs.stamp = 0.1 * i
        action = engine.act(obs, planner.continuation(obs))
        planner.record(action, obs.stamp + 0.06)
        chunks.append(action)
        for delta in engine.advance_language().deltas:
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
    return chunks, tokens


@pytest.mark.parametrize('mode', ['guided', 'prefix'])
def test_engine_rtc_leaves_language_tokens_identical(tiny, mode):
    model, frontend = tiny
    prefills = []
    original = model.prefill
    model.prefill = lambda *a, **k: prefills.append(1) or original(*a, **k)
    try:
        off_chunks, off_tokens = run_frames(model, frontend, RtcSettings('off'))
        off_prefills = len(prefills)
        on_chunks, on_tokens = run_frames(model, frontend, RtcSettings(mode, delay=1))
    finally:
        del model.prefill
    assert on_tokens == off_tokens and off_tokens                 # greedy tokens identical
    assert len(prefills) == 2 * off_prefills                      # no second prefill
    assert [c.start_row for c in on_chunks] == [0] + [1] * 4      # the first row past d
    assert [c.start_row for c in off_chunks] == [0] * 5
    assert not np.allclose(on_chunks[-1].actions, off_chunks[-1].actions)
    if mode == 'prefix':   # the frozen row is the committed one, exactly
        for before, after in zip(on_chunks, on_chunks[1:]):
            np.testing.assert_array_equal(after.actions[0], before.actions[2])


def test_engine_rejects_a_bad_committed_chunk(tiny):
    model, frontend = tiny
    engine = make_engine('oxygen', model, frontend, LanguagePolicy(max_new_tokens=2),
                         UnlimitedBudget())
    obs = random_observation('libero', 0, image_size=32)
    bad = Continuation(np.full((4, 7), np.nan), delay=1)
    with pytest.raises(ValueError, match='NaN'):
        engine.act(obs, bad)
    assert engine.pool.usage()['slots_in_use'] == 0               # nothing allocated
    assert engine.act(obs).start_row == 0                         # the engine goes on


def test_fleet_continues_each_robots_chunk_in_one_denoise(tiny):
    """Robots of one FleetEngine: a row with a committed chunk, a row without, one call."""
    from oxygen_ros.engine import FixedBudget, FleetRobot, make_fleet

    model, frontend = tiny
    policy = LanguagePolicy(max_new_tokens=2)
    fleet = make_fleet(model, [FleetRobot(name, frontend, policy, FixedBudget(1))
                               for name in ('a', 'b')])
    alone = make_fleet(model, [FleetRobot(name, frontend, policy, FixedBudget(1))
                               for name in ('a', 'b')])
    obs = {name: random_observation('libero', i, image_size=32)
           for i, name in enumerate(('a', 'b'))}
    rows = np.random.default_rng(1).uniform(-1, 1, (3, 7)).astype(np.float32)
    acted = fleet.act(obs, {'a': Continuation(rows, delay=2, mode='prefix')})
    plain = alone.act(obs)
    assert acted.actions['a'].start_row == 2 and acted.actions['b'].start_row == 0
    np.testing.assert_array_equal(acted.actions['a'].actions[:2], rows[:2])
    np.testing.assert_allclose(acted.actions['b'].actions, plain.actions['b'].actions,
                               atol=1e-5)
    fleet.advance_language()
    bad = fleet.act(obs, {'b': Continuation(np.zeros((3, 5)), delay=1)})
    # A bad committed chunk is no bad observation: it fails that robot's act, as what it is.
    assert not bad.rejected and 'committed actions' in str(bad.failed['b'])
    assert 'a' in bad.actions                                   # the other robot goes on


def test_frame_loop_continues_what_each_robot_was_sent(tiny):
    from oxygen_ros.engine import FixedBudget, FleetRobot, make_fleet
    from oxygen_ros.runtime.frame_loop import FrameLoop, RobotLoop
    from oxygen_ros.runtime.inputs import InputSet, InputSource, sanitize_instruction

    model, frontend = tiny
    names = ('a', 'b')
    fleet = make_fleet(model, [FleetRobot(n, frontend, LanguagePolicy(max_new_tokens=2),
                                          FixedBudget(1)) for n in names])

    class Sink:
        def __init__(self):
            self.actions = []

        def action(self, action, stamp_ns):
            self.actions.append(action)

        def tokens(self, delta, stamp_ns):
            pass

        def narration(self, request, stamp_ns):
            pass

    robots = []
    for i, name in enumerate(names):
        cameras = [(cam, InputSource(f'camera:{cam}', cam, lambda m: m))
                   for cam in ('image', 'wrist_image')]
        inputs = InputSet(cameras, InputSource('joint_states', 'joints', lambda m: m), 1.0)
        inputs.set_instruction(sanitize_instruction('go', 100))
        mode = 'prefix' if name == 'a' else 'off'
        robots.append(RobotLoop(name, inputs, Sink(), 0.1,
                                rtc=RtcPlanner(RtcSettings(mode, delay=1), 0.05)))
    loop = FrameLoop(fleet, robots)
    for tick in range(3):
        now = 0.1 * tick
        for i, robot in enumerate(loop.robots.values()):
            obs = random_observation('libero', 10 * i + tick, image_size=32)
            for cam, image in obs.images.items():
                robot.inputs.put(f'camera:{cam}', image, now)
            robot.inputs.put('joint_states', obs.state, now)
        loop.tick(now)
    a, b = (loop.robots[n].sink.actions for n in names)
    assert [x.start_row for x in a] == [0, 1, 1] and [x.start_row for x in b] == [0, 0, 0]
    for before, after in zip(a, a[1:]):   # stamps 0.1 s = two rows apart
        np.testing.assert_array_equal(after.actions[0], before.actions[2])
