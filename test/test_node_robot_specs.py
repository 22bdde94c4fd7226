"""Robots described in YAML through oxygen_node over real DDS (in-process node, tiny model).

A one-camera, 19-joint robot and the shipped SO-101 publish action chunks whose names, sizes and
step period come from their specs, and the diagnostics name the robot and its spec file. A spec
that is wrong, or does not fit the checkpoint, fails configure with one line naming the file,
the field and the expected value, and the node stays unconfigured until it is fixed.
"""

from pathlib import Path

import pytest
import yaml

rclpy = pytest.importorskip('rclpy')

from rclpy.lifecycle import TransitionCallbackReturn  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402

from oxygen_ros.model.robot_spec import get_robot  # noqa: E402
from oxygen_ros.runtime.status import ERROR  # noqa: E402
from ros_helpers import harnesses, TINY_NODE, wait_for  # noqa: E402

JOINTS = [f'{side}_{joint}' for side in ('r', 'l') for joint in (
    'shoulder_pitch', 'shoulder_roll', 'elbow_yaw', 'elbow_pitch', 'wrist_roll', 'wrist_pitch',
    'wrist_yaw', 'gripper')] + ['neck_yaw', 'neck_pitch', 'neck_roll']
ONE_CAMERA = {
    'name': 'reachy2',
    'cameras': [{'name': 'head', 'slot': 'base_0_rgb', 'resolution': [240, 320]}],
    'state': {'dim': 19, 'names': JOINTS},
    'actions': {'dim': 19, 'names': JOINTS, 'space': 'joint_position', 'rate_hz': 30,
                'open_loop_rows': 15},
    'norm_stats': 'reachy2',
}


@pytest.fixture
def harness(rclpy_context):
    with harnesses(rclpy_context, TINY_NODE) as make:
        yield make


def write_spec(tmp_path, data, name='robot.yaml') -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def model_values(status) -> dict:
    return {kv.key: kv.value for kv in status.values}


def test_one_camera_19_joint_robot_runs_in_the_node(harness, tmp_path):
    path = write_spec(tmp_path, ONE_CAMERA)
    h = harness(robot=str(path))
    assert h.values['camera_names'] == ['head'] and h.values['joint_names'] == JOINTS
    h.start()
    col = h.collector
    assert wait_for(lambda: len(col.actions) >= 3, 30), h.node.problem_history[-5:]
    chunk = col.actions[0][0]
    assert (chunk.horizon, chunk.action_dim) == (4, 19)      # tiny preset, the spec's dim
    assert list(chunk.names) == JOINTS
    assert chunk.action_space == 0 and chunk.step_period.nanosec == round(1e9 / 30)
    # Diagnostics over DDS name the robot, its spec file and its camera.
    assert wait_for(lambda: col.latest_status('inputs') is not None, 10)
    model = model_values(col.latest_status('model'))
    assert (model['robot'], model['robot_spec']) == ('reachy2', str(path))
    assert model['cameras'] == 'head (base_0_rgb)' and model['state_dim'] == '19'
    assert model['actions'] == '19 joint_position at 30 Hz'
    inputs = model_values(col.latest_status('inputs'))
    assert any("camera 'head'" in key for key in inputs), inputs


def test_so101_example_runs_in_the_node(harness):
    spec = get_robot('so101')
    h = harness(robot='so101')
    h.start()
    col = h.collector
    assert wait_for(lambda: len(col.actions) >= 3, 30), h.node.problem_history[-5:]
    chunk = col.actions[-1][0]
    assert chunk.action_dim == 6 and tuple(chunk.names) == spec.action_names
    assert h.statuses()['model'].message == 'active'
    assert dict(h.statuses()['model'].values)['robot_spec'] == spec.source


def _checkpoint(tmp_path, asset_id, stats_dims=(8, 7)):
    from oxygen_ros.model import get_preset, NormStats, Pi05Model
    from oxygen_ros.model.checkpoint import save_pi05
    from oxygen_ros.model.tokenizer import train_tiny_tokenizer
    import numpy as np

    def stats(dim):
        return NormStats(mean=np.zeros(dim), std=np.ones(dim), q01=-np.ones(dim),
                         q99=np.ones(dim))
    model = Pi05Model(get_preset('tiny')).init_random(3)
    tokenizer = train_tiny_tokenizer(tmp_path / 'tok', 512)
    return save_pi05(model, tmp_path / 'ckpt', norm_stats={
        'state': stats(stats_dims[0]), 'actions': stats(stats_dims[1])}, asset_id=asset_id,
        tokenizer_path=tokenizer)


def test_bad_specs_leave_the_node_unconfigured_with_one_line_each(harness, tmp_path):
    h = harness(robot='so101')
    node = h.node
    so101 = yaml.safe_load(Path(get_robot('so101').source).read_text())

    def broken(change):
        data = yaml.safe_load(yaml.safe_dump(so101))
        change(data)
        return data

    cases = {
        'dims': (broken(lambda d: d['state'].update(dim=5)),
                 'state.names: 6 names; expected 5 (one per dimension)'),
        'slot': (broken(lambda d: d['cameras'][0].update(slot='top_0_rgb')),
                 "cameras[0].slot: unknown slot 'top_0_rgb'; expected one of base_0_rgb"),
        'camera': (broken(lambda d: d['cameras'][1].update(name='front')),
                   "cameras[1].name: duplicate camera 'front'; expected each camera once"),
        'delta': (broken(lambda d: d['actions'].update(delta_mask=[True, False])),
                  'actions.delta_mask: 2 entries; expected 6 (one per action dimension)'),
        'norm_stats': (broken(lambda d: d.pop('norm_stats')),
                       'norm_stats: nothing; expected the norm stats key'),
        'too_wide': (broken(lambda d: d['actions'].update(
            dim=33, names=[f'a{i}' for i in range(33)])),
            "actions.dim: 33; expected <= 32 (the model's action_dim"),
    }
    for case, (data, expected) in cases.items():
        path = write_spec(tmp_path, data, f'{case}.yaml')
        assert node.set_parameters([Parameter('robot', value=str(path))])[0].successful
        assert node.trigger_configure() == TransitionCallbackReturn.FAILURE, case
        assert node.lifecycle_state == 'unconfigured' and node.engine is None
        model = h.statuses()['model']
        assert model.level == ERROR
        lines = [line for line in model.message.split('\n') if str(path) in line]
        assert len(lines) == 1 and f'{path}: {expected}' in lines[0], (case, model.message)
    assert h.collector.actions == []

    # Checked against the checkpoint: the spec's norm stats key, then its dims.
    checkpoint = _checkpoint(tmp_path, 'physical-intelligence/libero')
    spec_path = write_spec(tmp_path, so101, 'so101.yaml')
    assert node.set_parameters([
        Parameter('checkpoint', value=str(checkpoint)),
        Parameter('robot', value=str(spec_path))])[0].successful
    for key, expected in (
            ('so101', "norm_stats: 'so101' is not in checkpoint"),
            ('physical-intelligence/libero', "state.dim: 6, but norm stats "
                                             "'physical-intelligence/libero' (assets/physical-"
                                             'intelligence/libero) have 8 state values; '
                                             'expected 6 (or the padded 32)')):
        spec_path.write_text(yaml.safe_dump({**so101, 'norm_stats': key}, sort_keys=False))
        assert node.trigger_configure() == TransitionCallbackReturn.FAILURE
        assert node.lifecycle_state == 'unconfigured'
        message = h.statuses()['model'].message
        assert f'{spec_path}: {expected}' in message, message

    # Fixed: the same node configures and acts.
    assert node.set_parameters([Parameter('checkpoint', value='')])[0].successful
    h.start()
    assert wait_for(lambda: len(h.collector.actions) >= 2, 30)
    assert h.collector.actions[0][0].action_dim == 6
