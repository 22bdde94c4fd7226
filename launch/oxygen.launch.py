"""Launch oxygen_node with a robot configuration (needs a ROS 2 install with launch_ros).

    ros2 launch oxygen_ros oxygen.launch.py robot:=droid checkpoint:=~/ckpt/pi05_droid \\
        namespace:=arm1 camera_remaps:=camera/exterior_image_1_left/image_raw:=/zed/left/image

Arguments:
  config         libero | droid | aloha | a path to a parameter YAML; default: the robot's
  robot          libero | droid | aloha; default: the config's (libero if neither is given)
  checkpoint     openpi checkpoint directory; default: the config's ('' = random weights)
  namespace      namespace of the node and its relative topics
  camera_remaps  comma-separated FROM:=TO topic remappings (camera topics or any other)
  use_sim_time   true to follow /clock (e.g. `ros2 bag play --clock`)
  autostart      false to leave the lifecycle node unconfigured
  log_level      debug | info | warn | error
"""

import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node
import yaml

PACKAGE = 'oxygen_ros'
NODE_NAME = 'oxygen_node'
ARGUMENTS = (
    ('config', '', 'libero, droid, aloha, or a path to a parameter YAML (default: the robot)'),
    ('robot', '', "libero, droid or aloha (default: the config's robot)"),
    ('checkpoint', '', "openpi checkpoint directory (default: the config's)"),
    ('namespace', '', 'namespace of the node and its relative topics'),
    ('camera_remaps', '', 'comma-separated FROM:=TO topic remappings'),
    ('use_sim_time', 'false', 'follow /clock (bag replay)'),
    ('autostart', 'true', 'configure and activate the lifecycle node on startup'),
    ('log_level', 'info', 'debug, info, warn or error'),
)


def _config_path(config: str, robot: str) -> str:
    if config.endswith(('.yaml', '.yml')) or os.sep in config:
        return os.path.expanduser(config)
    name = config or robot or 'libero'
    return os.path.join(get_package_share_directory(PACKAGE), 'config', name + '.yaml')


def _node_params(path: str) -> dict:
    """ros__parameters of oxygen_node in `path`, whichever node key the file uses."""
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    params = {}
    for key in ('/**', '/**/' + NODE_NAME, '/' + NODE_NAME, NODE_NAME):
        section = data.get(key) or {}
        params.update(section.get('ros__parameters') or {})
    if not params:
        raise RuntimeError(f'{path}: no "{NODE_NAME}: ros__parameters:" section')
    return params


def _remappings(text: str) -> list:
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(','))):
        source, sep, target = item.partition(':=')
        if not sep or not source or not target:
            raise RuntimeError(f'camera_remaps: expected FROM:=TO, got {item!r}')
        pairs.append((source, target))
    return pairs


def _launch_node(context):
    def arg(name):
        return LaunchConfiguration(name).perform(context).strip()

    path = _config_path(arg('config'), arg('robot'))
    # Values are passed as a dict rather than as the file: launch_ros writes them under
    # /**, so they apply whatever the namespace (the file's key only matches the root one).
    params = _node_params(path)
    if arg('robot'):
        params['robot'] = arg('robot')
    if arg('checkpoint'):
        params['checkpoint'] = os.path.expanduser(arg('checkpoint'))
    params['use_sim_time'] = arg('use_sim_time').lower() == 'true'
    params['autostart'] = arg('autostart').lower() == 'true'
    # An empty list has no parameter type; the node's default (the robot's) applies instead.
    params = {k: v for k, v in params.items() if v != []}
    return [Node(
        package=PACKAGE, executable=NODE_NAME, name=NODE_NAME, namespace=arg('namespace'),
        parameters=[params], remappings=_remappings(arg('camera_remaps')),
        arguments=['--ros-args', '--log-level', arg('log_level')],
        output='screen', emulate_tty=True)]


def generate_launch_description():
    """Declare the arguments; the node is built once they are known."""
    return LaunchDescription(
        [DeclareLaunchArgument(name, default_value=default, description=description)
         for name, default, description in ARGUMENTS]
        + [OpaqueFunction(function=_launch_node)])
