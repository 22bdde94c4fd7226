"""Per-robot adapters: camera slots, masks, resize-with-pad, state/prompt, actions, bad inputs."""

import numpy as np
import pytest
import torch

from oxygen_ros.model.normalize import normalize, NormStats, unnormalize
from oxygen_ros.model.robots import (aloha_actions_from_pi, aloha_state_to_pi, collate,
                                     get_robot, resize_with_pad, RobotAdapter, ROBOTS, SLOT_NAMES)
from oxygen_ros.model.tokenizer import PaligemmaTokenizer, train_tiny_tokenizer

SIZE = 28  # small model images keep the tests fast; the logic is size independent


@pytest.fixture(scope='module')
def tokenizer(tmp_path_factory):
    return PaligemmaTokenizer(train_tiny_tokenizer(tmp_path_factory.mktemp('sp'), 512),
                              max_len=96)


def stats_for(spec, seed=0):
    rng = np.random.default_rng(seed)

    def one(dim):
        q01 = rng.uniform(-1, 0, dim)
        return NormStats(mean=rng.normal(size=dim), std=rng.uniform(0.5, 1, dim), q01=q01,
                         q99=q01 + rng.uniform(1, 2, dim))
    return {'state': one(spec.state_dim), 'actions': one(spec.action_dim)}


def adapter_for(name, tokenizer, **kw):
    spec = get_robot(name)
    return RobotAdapter(spec, stats_for(spec), tokenizer, image_size=SIZE, **kw)


def observation(spec, h=SIZE, w=SIZE, seed=0):
    rng = np.random.default_rng(seed)
    cams = spec.camera_names + spec.ignored_cameras
    images = {c: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for c in cams}
    return images, rng.uniform(-0.5, 0.5, spec.state_dim), 'pick up the red block'


def test_table_matches_openpi():
    assert sorted(ROBOTS) == ['aloha', 'droid', 'libero']
    dims = {n: (s.state_dim, s.action_dim, len(s.cameras)) for n, s in ROBOTS.items()}
    assert dims == {'libero': (8, 7, 2), 'droid': (8, 8, 2), 'aloha': (14, 14, 3)}
    assert dict(ROBOTS['aloha'].cameras) == {'cam_high': 'base_0_rgb',
                                             'cam_left_wrist': 'left_wrist_0_rgb',
                                             'cam_right_wrist': 'right_wrist_0_rgb'}
    assert ROBOTS['aloha'].ignored_cameras == ('cam_low',)
    with pytest.raises(ValueError, match='unknown robot'):
        get_robot('ur5')


@pytest.mark.parametrize('name', sorted(ROBOTS))
def test_shapes_and_masks(name, tokenizer):
    adapter = adapter_for(name, tokenizer)
    spec = adapter.spec
    images, state, prompt = observation(spec)
    inputs = adapter.prepare(images, state, prompt)
    assert inputs.images.shape == (3, 3, SIZE, SIZE) and inputs.images.dtype == np.float32
    assert inputs.images.min() >= -1 and inputs.images.max() <= 1
    used = [SLOT_NAMES.index(slot) for _, slot in spec.cameras]
    assert inputs.image_masks.tolist() == [i in used for i in range(3)]
    for cam, slot in spec.cameras:
        i = SLOT_NAMES.index(slot)
        expect = images[cam].astype(np.float32).transpose(2, 0, 1) / 255 * 2 - 1
        np.testing.assert_allclose(inputs.images[i], expect, atol=1e-6)
    for i in set(range(3)) - set(used):  # openpi's zero uint8 image becomes -1
        assert (inputs.images[i] == -1).all()
    # State: normalised in model joint space, zero padded to 32.
    model_state = state if spec.state_to_model is None else spec.state_to_model(state.copy())
    norm = normalize(model_state, adapter.state_stats, dtype=np.float64)
    assert inputs.state.shape == (32,) and inputs.state.dtype == np.float32
    np.testing.assert_array_equal(inputs.state[:spec.state_dim], norm.astype(np.float32))
    assert (inputs.state[spec.state_dim:] == 0).all()
    # Prompt carries the discretised state of the unpadded vector.
    tokens, mask = tokenizer.encode_prompt(prompt, norm)
    np.testing.assert_array_equal(inputs.tokens, tokens)
    np.testing.assert_array_equal(inputs.token_masks, mask)
    assert f'State: {" ".join(["0"] * spec.state_dim)}' not in tokenizer.decode(tokens[mask])


def test_prompt_without_discrete_state(tokenizer):
    adapter = adapter_for('libero', tokenizer, discrete_state=False)  # pi05_libero's setting
    images, state, prompt = observation(adapter.spec)
    inputs = adapter.prepare(images, state, prompt)
    assert tokenizer.decode(inputs.tokens[inputs.token_masks]) == prompt + '\n'


def test_resize_with_pad():
    # Wide image: scaled to width, black bars top and bottom (odd remainder at the bottom).
    img = np.full((10, 40, 3), 200, np.uint8)
    out = resize_with_pad(img, 28, 28)
    assert out.shape == (28, 28, 3) and out.dtype == np.uint8
    rows = np.flatnonzero(out[:, :, 0].any(axis=1))
    assert (rows[0], rows[-1]) == (10, 16)  # int(10 / (40/28)) = 7 rows, pad (10, 11)
    assert (out[10:17] == 200).all() and (out[:10] == 0).all() and (out[17:] == 0).all()
    # Tall image: bars left and right.
    tall = resize_with_pad(np.full((56, 14, 3), 9, np.uint8), 28, 28)
    cols = np.flatnonzero(tall[:, :, 0].any(axis=0))
    assert (cols[0], cols[-1]) == (10, 16)
    # Same size: unchanged object; exact 2x: plain resize, no padding.
    same = np.zeros((28, 28, 3), np.uint8)
    assert resize_with_pad(same, 28, 28) is same
    assert resize_with_pad(np.full((56, 56, 3), 7, np.uint8), 28, 28).min() == 7


def test_non_square_camera_goes_through_resize(tokenizer):
    adapter = adapter_for('droid', tokenizer)
    images, state, prompt = observation(adapter.spec, h=18, w=32)
    inputs = adapter.prepare(images, state, prompt)
    base = resize_with_pad(images['exterior_image_1_left'], SIZE, SIZE)
    np.testing.assert_allclose(inputs.images[0],
                               base.astype(np.float32).transpose(2, 0, 1) / 255 * 2 - 1)
    assert (inputs.images[0][:, 0] == -1).all()  # top pad row is black


@pytest.mark.parametrize('name', sorted(ROBOTS))
def test_actions_out(name, tokenizer):
    adapter = adapter_for(name, tokenizer)
    spec = adapter.spec
    images, state, prompt = observation(spec)
    inputs = adapter.prepare(images, state, prompt)
    model_actions = np.random.default_rng(3).uniform(-1, 1, (10, 32)).astype(np.float32)
    out = adapter.postprocess(torch.from_numpy(model_actions), inputs)
    assert out.shape == (10, spec.action_dim) and out.dtype == np.float32
    expect = unnormalize(model_actions[:, :spec.action_dim], adapter.action_stats,
                         dtype=np.float64)
    if spec.delta_action_mask is not None:
        mask = np.array(spec.delta_action_mask)
        expect += np.where(mask, inputs.model_state, 0)
    if spec.actions_from_model is not None:
        expect = spec.actions_from_model(expect)
    np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-6)


def test_aloha_joint_space_conversions():
    state = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.5] * 2)
    pi = aloha_state_to_pi(state.copy())
    np.testing.assert_allclose(pi[[1, 2, 8, 9]], -state[[1, 2, 8, 9]])
    np.testing.assert_allclose(pi[[0, 3, 4, 5]], state[[0, 3, 4, 5]])
    assert not np.allclose(pi[[6, 13]], state[[6, 13]])
    acts = aloha_actions_from_pi(np.tile(pi, (2, 1)))
    np.testing.assert_allclose(acts[:, :6], np.tile(state[:6], (2, 1)))  # flip is an involution
    # Gripper output map: pi 0 -> (0.5476 + 0.6213) / (1.4910 + 0.6213).
    out = aloha_actions_from_pi(np.zeros((1, 14)))
    np.testing.assert_allclose(out[0, 6], (0.5476 + 0.6213) / (1.4910 + 0.6213))


def test_collate(tokenizer):
    adapter = adapter_for('aloha', tokenizer)
    rows = [adapter.prepare(*observation(adapter.spec, seed=s)) for s in range(2)]
    batch = collate(rows)
    assert batch['images'].shape == (2, 3, 3, SIZE, SIZE)
    assert batch['image_masks'].dtype == torch.bool and batch['image_masks'].all()
    assert batch['tokens'].dtype == torch.int64 and batch['tokens'].shape == (2, 96)
    assert batch['token_masks'].dtype == torch.bool


def bad(adapter, match, images=None, state=None, prompt=None):
    good_images, good_state, good_prompt = observation(adapter.spec)
    with pytest.raises(ValueError, match=match):
        adapter.prepare(good_images if images is None else images,
                        good_state if state is None else state,
                        good_prompt if prompt is None else prompt)


def test_bad_inputs_name_the_field(tokenizer):
    libero = adapter_for('libero', tokenizer)
    images, _, _ = observation(libero.spec)
    bad(libero, r"libero: missing camera 'wrist_image' \(expected image, wrist_image; got image\)",
        images={'image': images['image']})
    bad(libero, r"libero: unknown camera 'cam_low'", images={**images, 'cam_low': images['image']})
    bad(libero, r"camera 'image': expected dtype uint8, got float32",
        images={**images, 'image': images['image'].astype(np.float32)})
    bad(libero, r"camera 'wrist_image': expected shape HxWx3 .*got \(3, 28, 28\)",
        images={**images, 'wrist_image': images['wrist_image'].transpose(2, 0, 1).copy()})
    bad(libero, r"camera 'image': expected shape HxWx3 .*got \(28, 28, 4\)",
        images={**images, 'image': np.zeros((28, 28, 4), np.uint8)})
    bad(libero, r"camera 'image': expected a uint8 HxWx3 numpy array, got list",
        images={**images, 'image': [[0]]})
    bad(libero, r'libero: state: expected 8 values, got shape \(7,\)', state=np.zeros(7))
    bad(libero, r'libero: state: NaN or inf at index \[2\]',
        state=np.array([0, 0, np.nan, 0, 0, 0, 0, 0.0]))
    bad(libero, r'libero: state: expected 8 numbers, got str', state='abc')
    bad(libero, r'libero: prompt: expected str, got int', prompt=3)


def test_aloha_ignores_cam_low_but_needs_wrists(tokenizer):
    aloha = adapter_for('aloha', tokenizer)
    images, state, prompt = observation(aloha.spec)
    del images['cam_low']
    aloha.prepare(images, state, prompt)
    del images['cam_right_wrist']
    bad(aloha, "aloha: missing camera 'cam_right_wrist'", images=images)


def test_bad_actions_and_setup(tokenizer):
    aloha = adapter_for('aloha', tokenizer)
    inputs = aloha.prepare(*observation(aloha.spec))
    with pytest.raises(ValueError, match=r'aloha: actions: expected \[H, 32\], got \(10, 14\)'):
        aloha.postprocess(np.zeros((10, 14)), inputs)
    with pytest.raises(ValueError, match='NaN'):
        aloha.postprocess(np.full((10, 32), np.nan), inputs)
    with pytest.raises(ValueError, match='delta actions need'):
        aloha.postprocess(np.zeros((10, 32)))
    spec = get_robot('droid')
    with pytest.raises(ValueError, match="norm stats lack 'actions'"):
        RobotAdapter(spec, {'state': stats_for(spec)['state']}, tokenizer)


def test_end_to_end_with_tiny_model(tmp_path):
    from oxygen_ros.model import get_preset, Pi05Model
    cfg = get_preset('tiny')
    tok = PaligemmaTokenizer(train_tiny_tokenizer(tmp_path, cfg.backbone.vocab_size),
                             max_len=cfg.max_token_len)
    spec = get_robot('libero')
    adapter = RobotAdapter.from_config(spec, cfg, stats_for(spec), tok)
    assert adapter.image_size == cfg.vision.image_size
    rows = [adapter.prepare(*observation(spec, h=48, w=64, seed=s)) for s in range(2)]
    model = Pi05Model(cfg).init_random(seed=0).eval()
    prefix = model.prefill(**collate(rows))
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(2, cfg.action_horizon, cfg.action_dim, generator=gen)
    actions = model.sample_actions(prefix, noise)
    out = adapter.postprocess(actions[1], rows[1])
    assert out.shape == (cfg.action_horizon, 7) and np.isfinite(out).all()
    with pytest.raises(ValueError, match='max_len'):
        RobotAdapter.from_config(spec, cfg.replace(max_token_len=30), stats_for(spec), tok)


def test_robot_facts_live_in_the_spec():
    from oxygen_ros.engine import get_workload

    for name, spec in ROBOTS.items():
        assert len(spec.joint_names) == spec.state_dim == len(set(spec.joint_names))
        workload = get_workload(name)
        assert (workload.num_cameras, workload.state_dim, workload.action_dim) == (
            len(spec.cameras), spec.state_dim, spec.action_dim)
