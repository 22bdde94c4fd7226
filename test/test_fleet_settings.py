"""A node's fleet parameters without ROS: per-robot names, defaults, checks and the wake period."""

from pathlib import Path

import pytest

from oxygen_ros.runtime.fleet_loop import wake_period_s
from oxygen_ros.runtime.params import (check_value, FleetSettings, load_node_params,
                                       param_spec, ROBOT_IO, split_param_name)

REPO = Path(__file__).resolve().parents[1]


def test_robot_parameters_are_named_and_checked_under_the_robot():
    assert split_param_name('arm_left.cameras.image.topic') == ('arm_left',
                                                                'cameras.image.topic')
    assert split_param_name('cameras.image.topic') == ('', 'cameras.image.topic')
    assert split_param_name('arm_left.preset') == ('', 'arm_left.preset')   # shared: not ours
    assert split_param_name('qos_overrides./a.subscription.depth')[0] == ''
    spec = param_spec('arm_left.decode_budget')
    assert spec.name == 'arm_left.decode_budget' and not spec.configure_time
    assert param_spec('arm_left.preset') is None
    assert check_value('arm_left.control_rate_hz', 0.05) == ('must be 0 (auto) or in [0.1, '
                                                             '1000], got 0.05')
    assert check_value('arm_left.control_rate_hz', 0.0) is None   # auto
    assert check_value('robots', ['a', 'a']) == "duplicate names in ['a', 'a']"
    assert 'parameter names' in check_value('robots', ['preset'])
    assert 'ROS name tokens' in check_value('robots', ['arm/1'])


def test_robots_default_to_the_node_values_and_their_type():
    fleet = FleetSettings.from_values({
        'robots': ['a', 'b'], 'tokens_per_request': 7, 'decode_budget': 3,
        'b.robot': 'aloha', 'b.decode_budget': 0, 'b.control_rate_hz': 15.0})
    a, b = fleet.robots['a'], fleet.robots['b']
    assert (a.robot, a.tokens_per_request, a.decode_budget) == ('libero', 7, 3)
    assert (b.robot, b.tokens_per_request, b.decode_budget) == ('aloha', 7, None)
    assert [c.name for c in b.cameras] == list(ROBOT_IO['aloha'][0])
    assert b.joint_names == ROBOT_IO['aloha'][1] and b.period_s == pytest.approx(1 / 15)
    assert fleet.node.robot == 'libero'


def test_fleet_robots_take_a_robot_yaml_each(tmp_path):
    import yaml

    from oxygen_ros.model.robot_spec import get_robot

    data = yaml.safe_load(Path(get_robot('so101').source).read_text())
    data.update(name='left_so101', cameras=[{'name': 'top', 'slot': 'base_0_rgb'}],
                masked_slots=['left_wrist_0_rgb', 'right_wrist_0_rgb'])
    arm = tmp_path / 'left.yaml'
    arm.write_text(yaml.safe_dump(data))
    fleet = FleetSettings.from_values({'robots': ['a', 'b'], 'a.robot': str(arm),
                                       'b.robot': 'so101'})
    a, b = fleet.robots['a'], fleet.robots['b']
    assert (a.spec.name, [c.name for c in a.cameras]) == ('left_so101', ['top'])
    assert (b.spec.name, [c.name for c in b.cameras]) == ('so101', ['front', 'wrist'])
    assert a.joint_names == b.joint_names == get_robot('so101').joint_names
    data['state']['dim'] = 7
    arm.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=rf'a.robot: {arm}: state.names: 6 names; expected 7'):
        FleetSettings.from_values({'robots': ['a'], 'a.robot': str(arm)})


def test_every_problem_names_its_robot_and_parameter():
    with pytest.raises(ValueError) as err:
        FleetSettings.from_values({
            'robots': ['left', 'right'], 'left.decode_budget': -1, 'right.robot': 'droid',
            'right.camera_names': ['exterior_image_1_left'],
            'right.cameras.exterior_image_1_left.compressed': 'yes'})
    text = str(err.value)
    assert 'left.decode_budget: must be in [0, 512], got -1' in text
    assert "right.camera_names lacks ['wrist_image_left']: robot 'droid'" in text
    assert 'right.joint_names has 8 names' not in text   # droid's 8 joints by default
    assert 'right.cameras.exterior_image_1_left.compressed: expected a bool' in text
    with pytest.raises(ValueError, match='robots: empty'):
        FleetSettings.from_values({'robots': []})


@pytest.mark.parametrize('config, robots', [
    ('two_arms', {'arm_left': 'libero', 'arm_right': 'libero'}),
    ('aloha_droid', {'aloha': 'aloha', 'droid': 'droid'})])
def test_shipped_fleet_configs_are_valid(config, robots):
    fleet = FleetSettings.from_values(load_node_params(REPO / 'config' / f'{config}.yaml'))
    assert {name: s.robot for name, s in fleet.robots.items()} == robots


def test_wake_period_meets_every_robot_tick():
    assert wake_period_s([0.1, 0.1]) == pytest.approx(0.1)
    assert wake_period_s([0.1, 0.2]) == pytest.approx(0.1)
    assert wake_period_s([0.1, 1 / 15]) == pytest.approx(1 / 30)     # 10 Hz and 15 Hz
    assert wake_period_s([1 / 7, 1 / 3]) == pytest.approx(1 / 21)
    # No useful common divisor (10 Hz and 10.3 Hz): the shortest period.
    assert wake_period_s([0.1, 1 / 10.3]) == pytest.approx(1 / 10.3)
