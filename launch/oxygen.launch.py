"""Launch oxygen_node as a lifecycle node with a robot configuration (needs launch_ros).

    ros2 launch oxygen_ros oxygen.launch.py robot:=droid checkpoint:=~/ckpt/pi05_droid \\
        namespace:=arm1 camera_remaps:=camera/exterior_image_1_left/image_raw:=/zed/left/image

    ros2 launch oxygen_ros oxygen.launch.py config:=two_arms          # two arms, one node
    ros2 launch oxygen_ros oxygen.launch.py robots:=arm_left,arm_right robot:=droid

Arguments:
  config         libero | droid | aloha | so101 | two_arms | aloha_droid | a path to a
                 parameter YAML; default: the robot's
  robot          a shipped robot (libero | droid | aloha | so101) or the path of a robot YAML
                 (docs/robots.md; then give a config whose cameras and joints are its);
                 default: the config's (libero if neither is given); with several robots, the
                 type of those whose section does not set one
  robots         comma-separated robot names: one node serves them all, each in its own
                 namespace (<robot>/actions, ...); default: the config's (one robot)
  checkpoint     openpi checkpoint directory; default: the config's ('' = random weights)
  namespace      namespace of the node and its relative topics
  camera_remaps  comma-separated FROM:=TO topic remappings (camera topics or any other)
  use_sim_time   true to follow /clock (e.g. `ros2 bag play --clock`)
  autostart      true: this launch file configures, then activates the node; false: leave it
                 unconfigured for `ros2 lifecycle set` or a lifecycle manager
  log_level      debug | info | warn | error
  dds_profile    Fast DDS profile of the processes started here: '' = the shipped
                 config/fastdds_large_frames.xml (raw camera frames; docs/cameras.md) unless
                 the environment names one; a path; 'none' = Fast DDS's defaults

The node's own self-activation is switched off (autostart:=false as a node parameter): the
launch file requests configure, and activate once the node reports "inactive", through
launch_ros's lifecycle events, so no transition is requested twice and a lifecycle manager can
take over instead. The parameter file is passed as a file (its key /**/oxygen_node matches any
namespace) with the launch arguments as a second, overriding set.
"""

import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import (DeclareLaunchArgument, EmitEvent, LogInfo, OpaqueFunction,
                            RegisterEventHandler, SetEnvironmentVariable)
from launch.events import matches_action
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode
from launch_ros.event_handlers import OnStateTransition
from launch_ros.events.lifecycle import ChangeState
from lifecycle_msgs.msg import Transition

PACKAGE = 'oxygen_ros'
NODE_NAME = 'oxygen_node'
ARGUMENTS = (
    ('config', '', 'libero, droid, aloha, two_arms, aloha_droid, or a parameter YAML path '
                   '(default: the robot)'),
    ('robot', '', "a shipped robot (libero, droid, aloha, so101) or a robot YAML's path "
                  "(default: the config's robot)"),
    ('robots', '', "comma-separated robot names served by one node (default: the config's)"),
    ('checkpoint', '', "openpi checkpoint directory (default: the config's)"),
    ('namespace', '', 'namespace of the node and its relative topics'),
    ('camera_remaps', '', 'comma-separated FROM:=TO topic remappings'),
    ('use_sim_time', 'false', 'follow /clock (bag replay)'),
    ('autostart', 'true', 'configure and activate the lifecycle node from this launch file'),
    ('log_level', 'info', 'debug, info, warn or error'),
    ('dds_profile', '', "Fast DDS profile: '' = the shipped one for raw camera frames (unless "
                        "the environment names one), a path, or 'none'"),
)
PROFILE_NAME = 'fastdds_large_frames.xml'


def _config_path(config: str, robot: str) -> str:
    if config.endswith(('.yaml', '.yml')) or os.sep in config:
        return os.path.expanduser(config)
    if not config and (robot.endswith(('.yaml', '.yml')) or os.sep in robot):
        raise RuntimeError(f'robot:={robot} is a robot YAML: give config:=<a parameter file> '
                           'with its camera_names and joint_names too (copy config/so101.yaml)')
    name = config or robot or 'libero'
    return os.path.join(get_package_share_directory(PACKAGE), 'config', name + '.yaml')


def _remappings(text: str) -> list:
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(','))):
        source, sep, target = item.partition(':=')
        if not sep or not source or not target:
            raise RuntimeError(f'camera_remaps: expected FROM:=TO, got {item!r}')
        pairs.append((source, target))
    return pairs


def _robot_names(text: str) -> list:
    names = [part.strip() for part in text.split(',') if part.strip()]
    if len(set(names)) != len(names):
        raise RuntimeError(f'robots: names must be unique, got {names}')
    return names


def _dds_profile(choice: str) -> list:
    """Set the Fast DDS profile for the processes this file starts (ros2 launch's own env)."""
    from oxygen_ros.runtime.dds_profile import (FASTDDS_VARIABLE, FASTRTPS_VARIABLE,
                                                profile_environment)

    if choice == 'none':
        return []
    path = os.path.expanduser(choice) if choice else os.path.join(
        get_package_share_directory(PACKAGE), 'config', PROFILE_NAME)
    if not os.path.isfile(path):
        raise RuntimeError(f'dds_profile: no file {path}')
    # A profile the environment names is kept unless one is given here.
    variables = profile_environment(path, keep_existing=not choice)
    if not variables:
        named = [f'{k}={os.environ[k]}' for k in (FASTDDS_VARIABLE, FASTRTPS_VARIABLE)
                 if os.environ.get(k)]
        return [LogInfo(msg=f'Fast DDS profile from the environment: {", ".join(named)} '
                            f'(raw camera frames need a large shared-memory segment, as in '
                            f'{path})')]
    return [action for name, value in variables.items() for action in (
        SetEnvironmentVariable(name, value),
        LogInfo(msg=f'{name}={value} (Fast DDS profile for raw camera frames)'))]


def _change_state(node, transition_id: int) -> EmitEvent:
    return EmitEvent(event=ChangeState(lifecycle_node_matcher=matches_action(node),
                                       transition_id=transition_id))


def _launch_node(context):
    def arg(name):
        return LaunchConfiguration(name).perform(context).strip()

    path = _config_path(arg('config'), arg('robot'))
    if not os.path.isfile(path):
        raise RuntimeError(f'config: no parameter file {path}')
    # Launch arguments override the file; the node's self-activation is off, this file (or a
    # lifecycle manager) drives the transitions.
    overrides = {'autostart': False, 'use_sim_time': arg('use_sim_time').lower() == 'true'}
    if arg('robot'):
        overrides['robot'] = arg('robot')
    if arg('robots'):
        overrides['robots'] = _robot_names(arg('robots'))
    if arg('checkpoint'):
        overrides['checkpoint'] = os.path.expanduser(arg('checkpoint'))
    node = LifecycleNode(
        package=PACKAGE, executable=NODE_NAME, name=NODE_NAME, namespace=arg('namespace'),
        parameters=[path, overrides], remappings=_remappings(arg('camera_remaps')),
        arguments=['--ros-args', '--log-level', arg('log_level')],
        output='screen', emulate_tty=True)
    actions = _dds_profile(arg('dds_profile')) + [
        node,
        RegisterEventHandler(OnStateTransition(
            target_lifecycle_node=node, goal_state='active',
            entities=[LogInfo(msg=f'{NODE_NAME} is active: actions are being published')])),
        RegisterEventHandler(OnStateTransition(
            target_lifecycle_node=node, start_state='configuring', goal_state='unconfigured',
            entities=[LogInfo(msg=f'{NODE_NAME}: configure failed; the reason is in its log '
                                  'and on /diagnostics')])),
    ]
    if arg('autostart').lower() == 'true':
        actions += [
            RegisterEventHandler(OnStateTransition(
                target_lifecycle_node=node, start_state='configuring', goal_state='inactive',
                entities=[_change_state(node, Transition.TRANSITION_ACTIVATE)])),
            _change_state(node, Transition.TRANSITION_CONFIGURE),
        ]
    return actions


def generate_launch_description():
    """Declare the arguments; the node is built once they are known."""
    return LaunchDescription(
        [DeclareLaunchArgument(name, default_value=default, description=description)
         for name, default, description in ARGUMENTS]
        + [OpaqueFunction(function=_launch_node)])
