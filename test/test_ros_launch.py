"""launch/oxygen.launch.py, run against minimal stand-ins for `launch` and `launch_ros`.

Neither package installs from PyPI, so these stubs record what the launch file builds: the
arguments it declares and, for given argument values, the Node it would start.
"""

import ast
import importlib.util
from pathlib import Path
import sys
import types

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCH_FILE = REPO / 'launch' / 'oxygen.launch.py'


class _Recorder:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


class _LaunchConfiguration:
    def __init__(self, name):
        self.name = name

    def perform(self, context):
        return context[self.name]


@pytest.fixture
def launch_module(monkeypatch):
    launch = types.ModuleType('launch')
    launch.LaunchDescription = type('LaunchDescription', (_Recorder,), {})
    actions = types.ModuleType('launch.actions')
    actions.DeclareLaunchArgument = type('DeclareLaunchArgument', (_Recorder,), {})
    actions.OpaqueFunction = type('OpaqueFunction', (_Recorder,), {})
    substitutions = types.ModuleType('launch.substitutions')
    substitutions.LaunchConfiguration = _LaunchConfiguration
    launch_ros = types.ModuleType('launch_ros')
    ros_actions = types.ModuleType('launch_ros.actions')
    ros_actions.Node = type('Node', (_Recorder,), {})
    ament = types.ModuleType('ament_index_python.packages')
    ament.get_package_share_directory = lambda package: str(REPO)
    for name, module in {'launch': launch, 'launch.actions': actions,
                         'launch.substitutions': substitutions, 'launch_ros': launch_ros,
                         'launch_ros.actions': ros_actions,
                         'ament_index_python.packages': ament}.items():
        monkeypatch.setitem(sys.modules, name, module)
    spec = importlib.util.spec_from_file_location('oxygen_launch', LAUNCH_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _context(**values):
    defaults = {'config': '', 'robot': '', 'checkpoint': '', 'namespace': '',
                'camera_remaps': '', 'use_sim_time': 'false', 'autostart': 'true',
                'log_level': 'info'}
    defaults.update(values)
    return defaults


def test_launch_file_parses_and_declares_its_arguments(launch_module):
    ast.parse(LAUNCH_FILE.read_text())
    description = launch_module.generate_launch_description()
    entities = description.args[0]
    declared = [e.args[0] for e in entities if type(e).__name__ == 'DeclareLaunchArgument']
    assert declared == ['config', 'robot', 'checkpoint', 'namespace', 'camera_remaps',
                        'use_sim_time', 'autostart', 'log_level']
    assert type(entities[-1]).__name__ == 'OpaqueFunction'


def test_default_launch_runs_the_libero_config(launch_module):
    (node,) = launch_module._launch_node(_context())
    kw = node.kwargs
    assert (kw['package'], kw['executable'], kw['name'], kw['namespace']) == (
        'oxygen_ros', 'oxygen_node', 'oxygen_node', '')
    (params,) = kw['parameters']
    assert params['robot'] == 'libero' and params['camera_names'] == ['image', 'wrist_image']
    assert params['use_sim_time'] is False and params['autostart'] is True
    assert kw['remappings'] == [] and kw['arguments'][-1] == 'info'


def test_robot_checkpoint_namespace_and_remaps(launch_module, tmp_path):
    (node,) = launch_module._launch_node(_context(
        robot='droid', checkpoint=str(tmp_path), namespace='arm1', use_sim_time='true',
        camera_remaps='camera/wrist_image_left/image_raw:=/zed/left/image, '
                      'instruction:=/task'))
    kw = node.kwargs
    (params,) = kw['parameters']
    assert params['robot'] == 'droid' and params['checkpoint'] == str(tmp_path)
    assert params['joint_names'][0] == 'panda_joint1' and params['use_sim_time'] is True
    assert kw['namespace'] == 'arm1'
    assert kw['remappings'] == [('camera/wrist_image_left/image_raw', '/zed/left/image'),
                                ('instruction', '/task')]


def test_config_path_and_bad_remap(launch_module, tmp_path):
    config = tmp_path / 'mine.yaml'
    config.write_text('/**/oxygen_node:\n  ros__parameters:\n    robot: aloha\n    seed: 3\n'
                      '    joint_names: []\n')
    (node,) = launch_module._launch_node(_context(config=str(config)))
    (params,) = node.kwargs['parameters']
    assert params['robot'] == 'aloha' and params['seed'] == 3
    assert 'joint_names' not in params   # an empty list has no parameter type
    with pytest.raises(RuntimeError, match='expected FROM:=TO'):
        launch_module._launch_node(_context(camera_remaps='camera/image'))
