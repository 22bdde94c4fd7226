"""Robot specs as data: the YAML schema and its errors, the built-ins against the old table,
LeRobot checkpoint / dataset features -> spec, openpi's delta actions, affine maps, and the
checks against a checkpoint at configure (one line naming the file, the field, the expected).
"""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from oxygen_ros.model.lerobot_spec import (image_hw, spec_from_lerobot_checkpoint,
                                           spec_from_lerobot_dataset)
from oxygen_ros.model.normalize import NormStats, normalize, unnormalize
from oxygen_ros.model.robot_spec import (check_fits_model, check_norm_stats, get_robot,
                                         load_robot_file, RobotSpec, RobotSpecError,
                                         shipped_robots, SLOT_NAMES, spec_from_dict,
                                         spec_from_yaml, spec_to_yaml)
from oxygen_ros.model.robot_transforms import (absolute_actions, Affine, aloha_actions_from_pi,
                                               aloha_state_to_pi, delta_actions)
from oxygen_ros.model.robots import RobotAdapter, ROBOTS
from oxygen_ros.model.tokenizer import PaligemmaTokenizer, train_tiny_tokenizer
from lerobot_dataset import unknown_robot_info

SIZE = 28

# model/robots.py's table before the specs became YAML files (commit 08fd64c), field by field.
_ALOHA_JOINTS = tuple(f'{side}_{joint}' for side in ('left', 'right')
                      for joint in ('waist', 'shoulder', 'elbow', 'forearm_roll', 'wrist_angle',
                                    'wrist_rotate', 'gripper'))
OLD_TABLE = {
    'libero': dict(
        name='libero', cameras=(('image', 'base_0_rgb'), ('wrist_image', 'left_wrist_0_rgb')),
        state_dim=8, action_dim=7, asset_id='physical-intelligence/libero',
        joint_names=('eef_x', 'eef_y', 'eef_z', 'eef_rx', 'eef_ry', 'eef_rz',
                     'gripper_left_finger', 'gripper_right_finger'),
        ignored_cameras=(), delta_action_mask=None, state_to_model=None,
        actions_from_model=None, action_space='end_effector_delta',
        action_names=('eef_dx', 'eef_dy', 'eef_dz', 'eef_drx', 'eef_dry', 'eef_drz', 'gripper'),
        step_period_s=0.05, open_loop_rows=5),
    'droid': dict(
        name='droid', cameras=(('exterior_image_1_left', 'base_0_rgb'),
                               ('wrist_image_left', 'left_wrist_0_rgb')),
        state_dim=8, action_dim=8, asset_id='droid',
        joint_names=tuple(f'panda_joint{i}' for i in range(1, 8)) + ('panda_finger_joint1',),
        ignored_cameras=(), delta_action_mask=None, state_to_model=None,
        actions_from_model=None, action_space='joint_velocity',
        action_names=tuple(f'panda_joint{i}' for i in range(1, 8)) + ('panda_finger_joint1',),
        step_period_s=1.0 / 15.0, open_loop_rows=8),
    'aloha': dict(
        name='aloha', cameras=(('cam_high', 'base_0_rgb'), ('cam_left_wrist', 'left_wrist_0_rgb'),
                               ('cam_right_wrist', 'right_wrist_0_rgb')),
        state_dim=14, action_dim=14, asset_id='trossen', joint_names=_ALOHA_JOINTS,
        ignored_cameras=('cam_low',),
        delta_action_mask=(True,) * 6 + (False,) + (True,) * 6 + (False,),
        state_to_model=aloha_state_to_pi, actions_from_model=aloha_actions_from_pi,
        action_space='joint_position', action_names=_ALOHA_JOINTS, step_period_s=0.02,
        open_loop_rows=25),
}


@pytest.fixture(scope='module')
def tokenizer(tmp_path_factory):
    return PaligemmaTokenizer(train_tiny_tokenizer(tmp_path_factory.mktemp('sp'), 512),
                              max_len=96)


def random_stats(dim, seed):
    rng = np.random.default_rng(seed)
    q01 = rng.uniform(-1, 0, dim)
    return NormStats(mean=rng.normal(size=dim), std=rng.uniform(0.5, 1, dim), q01=q01,
                     q99=q01 + rng.uniform(1, 2, dim))


def stats_for(spec, seed=0):
    return {'state': random_stats(spec.state_dim, seed),
            'actions': random_stats(spec.action_dim, seed + 1)}


def observation(spec, seed=0):
    rng = np.random.default_rng(seed)
    images = {c: rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
              for c in spec.camera_names}
    return images, rng.uniform(-0.5, 0.5, spec.state_dim), 'pick up the red block'


# --- the built-ins ------------------------------------------------------------------------------
@pytest.mark.parametrize('name', sorted(OLD_TABLE))
def test_builtin_yaml_equals_the_old_table_field_by_field(name):
    spec = get_robot(name)
    assert spec is ROBOTS[name] or spec == ROBOTS[name]
    assert spec.source.endswith(f'config/robots/{name}.yaml')
    for field, old in OLD_TABLE[name].items():
        assert getattr(spec, field) == old, field
    from oxygen_ros.engine import get_workload
    assert get_workload(name).horizon == 10          # the paper's H, now the workload's


@pytest.mark.parametrize('name', sorted(OLD_TABLE))
def test_builtin_yaml_gives_the_old_model_inputs_and_actions(name, tokenizer):
    """The adapter built from the YAML against the old code's formulas, exactly."""
    old = OLD_TABLE[name]
    spec = get_robot(name)
    stats = stats_for(spec, seed=4)
    adapter = RobotAdapter(spec, stats, tokenizer, image_size=SIZE)
    images, state, prompt = observation(spec, seed=5)
    images.update({cam: images[spec.camera_names[0]] for cam in old['ignored_cameras']})
    inputs = adapter.prepare(images, state, prompt)
    # old prepare: convert, normalise in float64, tokenise the unpadded state, pad to 32
    model_state = state.copy()
    if old['state_to_model'] is not None:
        model_state = old['state_to_model'](model_state)
    norm = normalize(model_state, stats['state'], dtype=np.float64)
    np.testing.assert_array_equal(inputs.model_state, model_state)
    np.testing.assert_array_equal(inputs.state[:old['state_dim']], norm.astype(np.float32))
    np.testing.assert_array_equal(inputs.tokens, tokenizer.encode_prompt(prompt, norm)[0])
    masks = [slot in dict((s, c) for c, s in old['cameras']) for slot in SLOT_NAMES]
    assert inputs.image_masks.tolist() == masks
    # old postprocess: unnormalise the full width, add the state on the delta columns, slice,
    # convert
    model_actions = np.random.default_rng(6).uniform(-1, 1, (10, 32)).astype(np.float32)
    out = unnormalize(model_actions, stats['actions'], dtype=np.float64)
    if old['delta_action_mask'] is not None:
        mask = np.asarray(old['delta_action_mask'])
        out[:, :mask.size] += np.where(mask, inputs.model_state[:mask.size], 0.0)
    out = out[:, :old['action_dim']]
    if old['actions_from_model'] is not None:
        out = old['actions_from_model'](out)
    np.testing.assert_array_equal(adapter.postprocess(model_actions, inputs),
                                  out.astype(np.float32))


def test_shipped_robots_round_trip_through_yaml():
    assert {'libero', 'droid', 'aloha', 'so101'} <= set(shipped_robots())
    for name in shipped_robots():
        spec = get_robot(name)
        again = spec_from_yaml(spec_to_yaml(spec, ('a comment',)), 'again')
        assert again == spec, name
        assert len(spec.cameras) + len(spec.masked_slots) == len(SLOT_NAMES)
    so101 = get_robot('so101')
    assert (so101.state_dim, so101.action_dim, so101.camera_names) == (6, 6, ('front', 'wrist'))
    assert so101.action_space == 'joint_position' and so101.step_period_s == 1 / 30


# --- schema errors: one line, naming the file, the field and what was expected --------------
def so101_data():
    """The shipped SO-101 spec as parsed YAML (a fresh copy to break)."""
    return yaml.safe_load(Path(get_robot('so101').source).read_text())


def write(tmp_path, data, name='arm.yaml'):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def broken(change):
    data = so101_data()
    change(data)
    return data


@pytest.mark.parametrize('change, field, expected', [
    (lambda d: d['state'].update(dim=7), 'state.names',
     '6 names; expected 7 (one per dimension)'),
    (lambda d: d['actions'].update(dim=0), 'actions.dim', '0; expected an integer >= 1'),
    (lambda d: d['actions'].update(dim='six'), 'actions.dim', 'expected an integer >= 1'),
    (lambda d: d['cameras'][1].update(slot='right_wrist'), 'cameras[1].slot',
     "unknown slot 'right_wrist'; expected one of base_0_rgb, left_wrist_0_rgb, "
     'right_wrist_0_rgb'),
    (lambda d: d['cameras'][1].update(name='front'), 'cameras[1].name',
     "duplicate camera 'front'; expected each camera once"),
    (lambda d: d['cameras'][1].update(slot='base_0_rgb'), 'cameras[1].slot',
     "base_0_rgb is already filled by camera 'front'; expected each slot once"),
    (lambda d: d['cameras'].extend([{'name': 'c', 'slot': 'right_wrist_0_rgb'},
                                    {'name': 'd', 'slot': 'base_0_rgb'}]), 'cameras',
     '4 cameras; expected at most 3'),
    (lambda d: d.update(masked_slots=[]), 'masked_slots',
     "[]; expected ['right_wrist_0_rgb'] (the slots no camera fills)"),
    (lambda d: d['actions'].update(delta_mask=[True] * 5), 'actions.delta_mask',
     '5 entries; expected 6 (one per action dimension)'),
    (lambda d: d.pop('norm_stats'), 'norm_stats',
     "nothing; expected the norm stats key (a checkpoint's assets/<key>/norm_stats.json)"),
    (lambda d: d['actions'].update(space='cartesian'), 'actions.space',
     "'cartesian' (a str); expected one of joint_position, joint_velocity, end_effector_delta"),
    (lambda d: d.update(transform='aloha_adapt_to_pi'), 'transform',
     'aloha_adapt_to_pi is written for state 14 / actions 14'),
    (lambda d: d['state'].update(affine={'scale': [1, 1, 0, 1, 1, 1]}), 'state.affine.scale[2]',
     '0; expected a non-zero scale'),
    (lambda d: d['actions'].update(rate_hz=0), 'actions.rate_hz', '0; expected a finite '
                                                                  'number > 0'),
    (lambda d: d['actions'].update(step_period_s=0.1), 'actions',
     'expected exactly one of step_period_s'),
    (lambda d: d.update(grippers=1), 'grippers', 'unknown field; expected one of name, cameras'),
])
def test_schema_errors_name_the_file_the_field_and_the_expected(tmp_path, change, field, expected):
    path = write(tmp_path, broken(change))
    with pytest.raises(RobotSpecError) as err:
        load_robot_file(path)
    message = str(err.value)
    assert '\n' not in message
    assert message.startswith(f'{path}: {field}: '), message
    assert expected in message, message


def test_unreadable_and_unknown_robots(tmp_path):
    with pytest.raises(RobotSpecError, match=r"unknown robot 'ur5'; expected one of aloha, "
                                             r'droid, libero, so101'):
        get_robot('ur5')
    with pytest.raises(RobotSpecError, match='cannot read the robot spec'):
        get_robot(str(tmp_path / 'missing.yaml'))
    bad = tmp_path / 'bad.yaml'
    bad.write_text('name: [unclosed\n')
    with pytest.raises(RobotSpecError, match=f'{bad}: not valid YAML'):
        get_robot(str(bad))


def test_an_edited_file_is_read_again(tmp_path):
    data = so101_data()
    path = write(tmp_path, data)
    assert get_robot(str(path)).name == 'so101'
    data['name'] = 'so101_left'
    data['actions']['open_loop_rows'] = 7
    path.write_text(yaml.safe_dump(data) + '# longer\n')
    assert (get_robot(str(path)).name, get_robot(str(path)).open_loop_rows) == ('so101_left', 7)


def test_delta_mask_beyond_the_state_is_refused():
    data = so101_data()
    data['actions'].update(dim=8, names=[f'a{i}' for i in range(8)],
                           delta_mask=[True] * 6 + [False, True])
    with pytest.raises(RobotSpecError, match=r'actions.delta_mask\[7\]: true, but the state '
                                             r'has 6 values; expected false past index 5'):
        spec_from_dict(data, 'arm.yaml')


def test_fit_to_the_model_and_norm_stats():
    spec = spec_from_dict({**so101_data(), 'state': {'dim': 40, 'names': [
        f'j{i}' for i in range(40)]}}, 'arm.yaml')
    with pytest.raises(RobotSpecError, match=r"^arm.yaml: state.dim: 40; expected <= 32 \(the "
                                             r"model's action_dim"):
        check_fits_model(spec, 32, 3)
    so101 = get_robot('so101')
    check_fits_model(so101, 32, 3)
    with pytest.raises(RobotSpecError, match='cameras: the model has 2 image slots; expected 3'):
        check_fits_model(so101, 32, 2)
    stats = {'state': random_stats(6, 0), 'actions': random_stats(5, 1)}
    with pytest.raises(RobotSpecError, match=r"so101.yaml: actions.dim: 6, but norm stats "
                                             r"'so101' \(assets/so101\) have 5 actions values; "
                                             r'expected 6 \(or the padded 32\)'):
        check_norm_stats(so101, stats, 32, 'assets/so101')
    check_norm_stats(so101, {'state': random_stats(32, 0), 'actions': random_stats(6, 1)}, 32)
    with pytest.raises(RobotSpecError, match="has no 'actions' statistics"):
        check_norm_stats(so101, {'state': random_stats(6, 0)}, 32)


# --- transforms ----------------------------------------------------------------------------------
def openpi_delta(data, mask):
    """openpi transforms.DeltaActions.__call__, as written there."""
    state, actions = data['state'], data['actions']
    mask = np.asarray(mask)
    dims = mask.shape[-1]
    actions[..., :dims] -= np.expand_dims(np.where(mask, state[..., :dims], 0), axis=-2)
    data['actions'] = actions
    return data


def openpi_absolute(data, mask):
    """openpi transforms.AbsoluteActions.__call__, as written there."""
    state, actions = data['state'], data['actions']
    mask = np.asarray(mask)
    dims = mask.shape[-1]
    actions[..., :dims] += np.expand_dims(np.where(mask, state[..., :dims], 0), axis=-2)
    data['actions'] = actions
    return data


@pytest.mark.parametrize('mask_len', [14, 9, 32])
def test_delta_and_absolute_actions_equal_openpis_formula(mask_len):
    rng = np.random.default_rng(mask_len)
    for batch in ((), (3,)):
        state = rng.normal(size=(*batch, 32))
        actions = rng.normal(size=(*batch, 10, 32))
        mask = rng.random(mask_len) < 0.6
        expect = openpi_delta({'state': state, 'actions': actions.copy()}, mask)['actions']
        np.testing.assert_array_equal(delta_actions(actions, state, mask), expect)
        expect = openpi_absolute({'state': state, 'actions': actions.copy()}, mask)['actions']
        np.testing.assert_array_equal(absolute_actions(actions, state, mask), expect)
        np.testing.assert_allclose(
            absolute_actions(delta_actions(actions, state, mask), state, mask), actions,
            atol=1e-12)


def test_affine_maps_apply_per_dimension(tokenizer):
    data = so101_data()
    scale, offset = [0.5, 2, -1, 1, 4, 1], [0.1, 0, 0.3, -2, 0, 1]
    data['state']['affine'] = {'scale': scale, 'offset': offset}
    data['actions']['affine'] = {'scale': scale[::-1]}
    data['actions']['delta_mask'] = [True, True, False, False, False, False]
    spec = spec_from_dict(data, 'arm.yaml')
    assert spec.action_affine == Affine(tuple(map(float, scale[::-1])), (0.0,) * 6)
    stats = stats_for(spec, seed=8)
    adapter = RobotAdapter(spec, stats, tokenizer, image_size=SIZE)
    images, state, prompt = observation(spec, seed=9)
    inputs = adapter.prepare(images, state, prompt)
    model_state = (state - np.array(offset)) / np.array(scale)     # robot = scale*model + off
    np.testing.assert_allclose(inputs.model_state, model_state)
    np.testing.assert_allclose(inputs.state[:6], normalize(model_state, stats['state']),
                               rtol=1e-6)
    model_actions = np.random.default_rng(2).uniform(-1, 1, (4, 32)).astype(np.float32)
    expect = unnormalize(model_actions, stats['actions'], dtype=np.float64)[:, :6]
    expect[:, :2] += model_state[:2]                       # deltas in model units
    expect = np.array(scale[::-1]) * expect                # then robot units
    np.testing.assert_allclose(adapter.postprocess(model_actions, inputs), expect, rtol=1e-6)


# --- LeRobot features -> spec ------------------------------------------------------------------
def lerobot_config(cameras, state=6, action=6, empty=0):
    features = {f'observation.images.{c}': {'type': 'VISUAL', 'shape': [3, 480, 640]}
                for c in cameras}
    empty_camera = {'type': 'VISUAL', 'shape': [3, 224, 224]}
    features.update({f'observation.images.empty_camera_{i}': empty_camera for i in range(empty)})
    features['observation.state'] = {'type': 'STATE', 'shape': [state]}
    return {'type': 'pi05', 'input_features': features, 'empty_cameras': empty,
            'output_features': {'action': {'type': 'ACTION', 'shape': [action]}},
            'chunk_size': 50, 'n_action_steps': 10}


@pytest.mark.parametrize('cameras', [['top'], ['wrist', 'top'], ['left', 'top', 'right']])
def test_lerobot_checkpoint_features_give_cameras_in_order(cameras):
    inferred = spec_from_lerobot_checkpoint(lerobot_config(cameras, empty=3 - len(cameras)),
                                            'ckpt/config.json', 'my arm')
    spec = inferred.spec
    # LeRobot's π0.5 feeds the VISUAL features in order, padding (empty_camera_*) after them
    assert spec.cameras == tuple(zip(cameras, SLOT_NAMES))
    assert spec.masked_slots == SLOT_NAMES[len(cameras):]
    assert inferred.features == {c: f'observation.images.{c}' for c in cameras}
    assert (spec.state_dim, spec.action_dim, spec.open_loop_rows) == (6, 6, 10)
    assert spec.name == 'my_arm' and spec.asset_id == 'lerobot'
    assert dict(spec.resolutions) == {c: (480, 640) for c in cameras}
    assert any('step period' in line for line in inferred.assumed)
    assert spec_from_yaml(spec_to_yaml(spec), 'again') == spec


def test_lerobot_checkpoint_with_four_cameras_is_refused():
    with pytest.raises(RobotSpecError, match=r'4 camera features .*; expected at most 3'):
        spec_from_lerobot_checkpoint(lerobot_config(['a', 'b', 'c', 'd']), 'c.json', 'x')
    with pytest.raises(RobotSpecError, match='observation.state: missing; expected the state'):
        config = lerobot_config(['a'])
        del config['input_features']['observation.state']
        spec_from_lerobot_checkpoint(config, 'c.json', 'x')


@pytest.mark.parametrize('channel_first', [True, False])
def test_dataset_info_gives_the_spec_with_either_channel_order(channel_first):
    info = {'fps': 30, 'robot_type': 'reachy2',
            'features': unknown_robot_info(channel_first=channel_first)}
    inferred = spec_from_lerobot_dataset(info, 'ds/meta/info.json')
    spec = inferred.spec
    assert spec.cameras == (('image', 'base_0_rgb'),)
    assert inferred.features == {'image': 'observation.image'}
    assert dict(spec.resolutions) == {'image': (240, 320)}
    assert (spec.name, spec.state_dim, spec.action_dim) == ('reachy2', 19, 19)
    assert spec.joint_names == tuple(f'joint_{i}' for i in range(19)) == spec.action_names
    assert spec.step_period_s == 1 / 30 and spec.action_space == 'joint_position'
    assert spec.open_loop_rows == 15
    assumed = '\n'.join(inferred.assumed)
    for what in ('state names', 'action space: joint_position', 'step period: 1/30 s',
                 'norm_stats: lerobot'):
        assert what in assumed


def test_dataset_names_and_shapes():
    names = ['shoulder_pan.pos', 'shoulder_lift.pos', 'elbow_flex.pos']
    features = unknown_robot_info(state_dim=3, action_dim=3, cameras=(
        ('observation.images.front', 480, 640), ('observation.images.wrist', 240, 320)))
    features['observation.state']['names'] = {'motors': names}     # LeRobot's older form
    features['action']['names'] = names
    spec = spec_from_lerobot_dataset({'fps': 15, 'features': features}, 'i.json', 'folder').spec
    assert spec.joint_names == tuple(names) == spec.action_names
    assert spec.cameras == (('front', 'base_0_rgb'), ('wrist', 'left_wrist_0_rgb'))
    assert dict(spec.resolutions) == {'front': (480, 640), 'wrist': (240, 320)}
    assert spec.name == 'folder' and spec.open_loop_rows == 8
    # Shapes without axis names: the axis holding 3 channels decides.
    assert image_hw([3, 96, 128]) == (96, 128) and image_hw([96, 128, 3]) == (96, 128)
    assert image_hw([128, 3, 96], ['height', 'channel', 'width']) == (128, 96)


def test_robot_spec_cli_prints_a_yaml_that_loads_back(tmp_path, capsys):
    from oxygen_ros.cli import main as cli_main

    folder = tmp_path / 'ckpt'
    folder.mkdir()
    (folder / 'config.json').write_text(json.dumps(lerobot_config(['front', 'wrist'])))
    assert cli_main(['robot-spec', '--from', str(folder)]) == 0
    out, err = capsys.readouterr()
    assert 'assumed step period' in err
    spec = spec_from_yaml(out, 'printed')
    assert spec.camera_names == ('front', 'wrist') and spec.state_dim == 6
    assert '#   front <- observation.images.front' in out
    kept = tmp_path / 'arm.yaml'
    assert cli_main(['robot-spec', '--from', str(folder), '--out', str(kept)]) == 0
    assert get_robot(str(kept)) == spec
    assert cli_main(['robot-spec', str(kept)]) == 0
    capsys.readouterr()
    (tmp_path / 'bad.yaml').write_text(kept.read_text().replace('dim: 6', 'dim: 5', 1))
    assert cli_main(['robot-spec', str(tmp_path / 'bad.yaml')]) == 2
    assert 'state.names: 6 names; expected 5' in capsys.readouterr().err
    assert cli_main(['robot-spec', '--from', str(tmp_path)]) == 2
    assert 'neither a LeRobot dataset' in capsys.readouterr().err


def test_a_spec_is_also_accepted_where_robot_names_were():
    from oxygen_ros.engine import identity_norm_stats, random_observation
    from oxygen_ros.runtime.actions import action_layout

    spec = get_robot('so101')
    assert isinstance(spec, RobotSpec) and get_robot(spec) is spec
    obs = random_observation(spec, 0, image_size=SIZE)
    assert sorted(obs.images) == ['front', 'wrist'] and obs.state.shape == (6,)
    assert identity_norm_stats(str(spec.source))['actions'].dim == 6
    layout = action_layout(spec.source)
    assert layout.names == spec.action_names and layout.step_period_s == 1 / 30


def test_reading_specs_and_parameters_imports_no_torch():
    import subprocess
    import sys

    code = ('import sys; import oxygen_ros.runtime.params as p; '
            'p.Settings.from_values({"robot": "so101", **p.robot_defaults("so101")}); '
            'print("torch" in sys.modules)')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == 'False', out.stderr[-2000:]
