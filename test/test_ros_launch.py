"""launch/oxygen.launch.py against a stand-in for `launch` and `launch_ros` (not on PyPI).

The stand-in classes take exactly the arguments the real ones take (read from ros2/launch and
ros2/launch_ros: keyword-only names, required ones, what a Node passes on to ExecuteProcess),
check what the real ones check (a ChangeState's transition id, an OnStateTransition's target,
an EmitEvent's event), and record the rest. A launch_ros-like command line is then built from
the recorded LifecycleNode (`-r __node:=`, `-r __ns:=`, one `--params-file` per parameter
entry, a dict written to a temporary YAML under the node's full name, `-r FROM:=TO`), and the
real node is started in-process with it and driven through the transitions the recorded
event handlers request. What only a real `ros2 launch` shows: the process handling, the
lifecycle event plumbing itself (transition_event topic, change_state service) and output.
"""

import importlib.util
import inspect
from pathlib import Path
import sys
import types

from lifecycle_msgs.msg import Transition
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
LAUNCH_FILE = REPO / 'launch' / 'oxygen.launch.py'

# launch.actions.ExecuteProcess / ExecuteLocal keyword arguments a Node passes on (**kwargs).
EXECUTE_PROCESS_KWARGS = {
    'prefix', 'cwd', 'env', 'additional_env', 'shell', 'sigterm_timeout', 'sigkill_timeout',
    'emulate_tty', 'output', 'output_format', 'cached_output', 'log_cmd', 'on_exit', 'respawn',
    'respawn_delay', 'respawn_max_retries', 'condition'}


class Action:
    """launch.Action: takes `condition` only."""

    def __init__(self, *, condition=None):
        self.condition = condition


class Event:
    """launch.Event."""


class LaunchDescription:
    def __init__(self, initial_entities=None, *, deprecated_reason=None):
        self.entities = list(initial_entities or [])


class DeclareLaunchArgument(Action):
    def __init__(self, name, *, default_value=None, description=None, choices=None, **kwargs):
        super().__init__(**kwargs)
        self.name, self.default_value, self.description = name, default_value, description


class OpaqueFunction(Action):
    def __init__(self, *, function, args=None, kwargs=None, **left_over_kwargs):
        super().__init__(**left_over_kwargs)
        assert callable(function)
        self.function = function


class EmitEvent(Action):
    def __init__(self, *, event, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(event, Event):
            raise RuntimeError(f"EmitEvent() expected an event instance, got '{event}'.")
        self.event = event


class LogInfo(Action):
    def __init__(self, *, msg, **kwargs):
        super().__init__(**kwargs)
        self.msg = msg


class SetEnvironmentVariable(Action):
    def __init__(self, name, value, **kwargs):
        super().__init__(**kwargs)
        self.name, self.value = name, value


class RegisterEventHandler(Action):
    def __init__(self, event_handler, **kwargs):
        super().__init__(**kwargs)
        self.event_handler = event_handler


def matches_action(target_action):
    return lambda action: action == target_action


class Node(Action):
    """launch_ros.actions.Node: its own arguments, the rest goes to ExecuteProcess."""

    def __init__(self, *, executable, package=None, name=None, namespace=None, exec_name=None,
                 parameters=None, remappings=None, ros_arguments=None, arguments=None,
                 **kwargs):
        unknown = set(kwargs) - EXECUTE_PROCESS_KWARGS
        if unknown:
            raise TypeError(f'Node() got unexpected keyword arguments {sorted(unknown)}')
        super().__init__(condition=kwargs.get('condition'))
        self.kwargs = dict(executable=executable, package=package, name=name,
                           namespace=namespace, parameters=parameters, remappings=remappings,
                           ros_arguments=ros_arguments, arguments=arguments, **kwargs)

    def ros_command_line(self, tmp_path: Path) -> list:
        """The node's command-line arguments, as launch_ros builds them."""
        kw = self.kwargs
        namespace = kw['namespace'] or ''
        namespace = namespace if namespace.startswith('/') or not namespace else '/' + namespace
        full_name = f'{namespace}/{kw["name"]}'
        args = list(kw['arguments'] or [])
        if '--ros-args' not in args:
            args.append('--ros-args')
        args += ['-r', f'__node:={kw["name"]}']
        if namespace:
            args += ['-r', f'__ns:={namespace}']
        for i, entry in enumerate(kw['parameters'] or []):
            if isinstance(entry, dict):   # written under the node's full name
                path = tmp_path / f'launch_params_{i}.yaml'
                path.write_text(yaml.safe_dump({full_name: {'ros__parameters': entry}}))
                entry = str(path)
            args += ['--params-file', str(entry)]
        for source, target in kw['remappings'] or []:
            args += ['-r', f'{source}:={target}']
        return args


class LifecycleNode(Node):
    """launch_ros.actions.LifecycleNode: name and namespace are required."""

    def __init__(self, *, name, namespace, **kwargs):
        super().__init__(name=name, namespace=namespace, **kwargs)


class ChangeState(Event):
    valid_transitions = {Transition.TRANSITION_CREATE, Transition.TRANSITION_CONFIGURE,
                         Transition.TRANSITION_CLEANUP, Transition.TRANSITION_ACTIVATE,
                         Transition.TRANSITION_DEACTIVATE,
                         Transition.TRANSITION_UNCONFIGURED_SHUTDOWN,
                         Transition.TRANSITION_INACTIVE_SHUTDOWN,
                         Transition.TRANSITION_ACTIVE_SHUTDOWN, Transition.TRANSITION_DESTROY}

    def __init__(self, *, lifecycle_node_matcher, transition_id):
        if transition_id not in self.valid_transitions:
            raise ValueError(f"given transition_id of '{transition_id}'")
        self.lifecycle_node_matcher, self.transition_id = lifecycle_node_matcher, transition_id


class OnStateTransition:
    def __init__(self, *, entities, target_lifecycle_node=None, transition=None,
                 start_state=None, goal_state=None, matcher=None, **kwargs):
        if not isinstance(target_lifecycle_node, (LifecycleNode, type(None))):
            raise RuntimeError("OnStateTransition requires a 'LifecycleNode' action as the "
                               'target')
        self.entities, self.target = list(entities), target_lifecycle_node
        self.start_state, self.goal_state = start_state, goal_state

    def matches(self, node, start_state, goal_state) -> bool:
        return (self.target in (None, node) and self.start_state in (None, start_state)
                and self.goal_state in (None, goal_state))


class LaunchConfiguration:
    def __init__(self, name):
        self.name = name

    def perform(self, context):
        return context[self.name]


def test_stand_in_signatures_are_the_real_ones():
    """The stand-ins' parameters, as read from the launch and launch_ros sources."""
    def params(cls):
        return [(p.name, p.kind.name, p.default is inspect.Parameter.empty)
                for p in inspect.signature(cls.__init__).parameters.values()][1:]
    assert params(LifecycleNode) == [('name', 'KEYWORD_ONLY', True),
                                     ('namespace', 'KEYWORD_ONLY', True),
                                     ('kwargs', 'VAR_KEYWORD', True)]
    assert [p[0] for p in params(Node)] == [
        'executable', 'package', 'name', 'namespace', 'exec_name', 'parameters', 'remappings',
        'ros_arguments', 'arguments', 'kwargs']
    assert [p[0] for p in params(OnStateTransition)] == [
        'entities', 'target_lifecycle_node', 'transition', 'start_state', 'goal_state',
        'matcher', 'kwargs']
    assert [p[0] for p in params(ChangeState)] == ['lifecycle_node_matcher', 'transition_id']
    assert params(SetEnvironmentVariable) == [('name', 'POSITIONAL_OR_KEYWORD', True),
                                              ('value', 'POSITIONAL_OR_KEYWORD', True),
                                              ('kwargs', 'VAR_KEYWORD', True)]


@pytest.fixture
def launch_module(monkeypatch):
    modules = {
        'launch': dict(LaunchDescription=LaunchDescription),
        'launch.actions': dict(DeclareLaunchArgument=DeclareLaunchArgument,
                               EmitEvent=EmitEvent, LogInfo=LogInfo,
                               OpaqueFunction=OpaqueFunction,
                               RegisterEventHandler=RegisterEventHandler,
                               SetEnvironmentVariable=SetEnvironmentVariable),
        'launch.events': dict(matches_action=matches_action),
        'launch.substitutions': dict(LaunchConfiguration=LaunchConfiguration),
        'launch_ros': {},
        'launch_ros.actions': dict(LifecycleNode=LifecycleNode, Node=Node),
        'launch_ros.event_handlers': dict(OnStateTransition=OnStateTransition),
        'launch_ros.events': {},
        'launch_ros.events.lifecycle': dict(ChangeState=ChangeState),
    }
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    spec = importlib.util.spec_from_file_location('oxygen_launch', LAUNCH_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, 'get_package_share_directory', lambda package: str(REPO))
    return module


def _context(**values):
    defaults = {'config': '', 'robot': '', 'robots': '', 'checkpoint': '', 'namespace': '',
                'camera_remaps': '', 'use_sim_time': 'false', 'autostart': 'true',
                'log_level': 'info', 'dds_profile': ''}
    defaults.update(values)
    return defaults


def _split(actions):
    (node,) = [a for a in actions if isinstance(a, LifecycleNode)]
    handlers = [a.event_handler for a in actions if isinstance(a, RegisterEventHandler)]
    emitted = [a.event for a in actions if isinstance(a, EmitEvent)]
    return node, handlers, emitted


def test_launch_file_declares_its_arguments(launch_module):
    entities = launch_module.generate_launch_description().entities
    declared = [e.name for e in entities if isinstance(e, DeclareLaunchArgument)]
    assert declared == ['config', 'robot', 'robots', 'checkpoint', 'namespace', 'camera_remaps',
                        'use_sim_time', 'autostart', 'log_level', 'dds_profile']
    assert isinstance(entities[-1], OpaqueFunction)


def test_default_launch_is_a_lifecycle_node_the_launch_file_configures(launch_module):
    node, handlers, emitted = _split(launch_module._launch_node(_context()))
    kw = node.kwargs
    assert (kw['package'], kw['executable'], kw['name'], kw['namespace']) == (
        'oxygen_ros', 'oxygen_node', 'oxygen_node', '')
    path, overrides = kw['parameters']
    assert path == str(REPO / 'config' / 'libero.yaml')   # passed as a file, not merged here
    assert overrides == {'autostart': False, 'use_sim_time': False}
    (configure,) = emitted
    assert configure.transition_id == Transition.TRANSITION_CONFIGURE
    assert configure.lifecycle_node_matcher(node) and not configure.lifecycle_node_matcher(None)
    (activate_on_inactive,) = [h for h in handlers if h.goal_state == 'inactive']
    assert activate_on_inactive.start_state == 'configuring'
    (activate,) = [e.event for e in activate_on_inactive.entities]
    assert activate.transition_id == Transition.TRANSITION_ACTIVATE
    assert any(h.goal_state == 'active' and isinstance(h.entities[0], LogInfo)
               for h in handlers), 'the launch file reacts to "active"'


def _profile_settings(actions):
    return {a.name: a.value for a in actions if isinstance(a, SetEnvironmentVariable)}


def test_the_processes_it_starts_get_the_large_frames_profile(launch_module, monkeypatch,
                                                              tmp_path):
    from oxygen_ros.runtime.dds_profile import (FASTDDS_VARIABLE, FASTRTPS_VARIABLE,
                                                profile_variable)

    for name in (FASTDDS_VARIABLE, FASTRTPS_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    shipped = str(REPO / 'config' / 'fastdds_large_frames.xml')
    actions = launch_module._launch_node(_context())
    assert _profile_settings(actions) == {profile_variable(): shipped}
    first_node = next(i for i, a in enumerate(actions) if isinstance(a, LifecycleNode))
    assert all(isinstance(a, (SetEnvironmentVariable, LogInfo)) for a in actions[:first_node])
    # a team's own profile in the environment is kept; one given here wins; 'none' sets none
    monkeypatch.setenv(FASTDDS_VARIABLE, '/etc/team_profile.xml')
    kept = launch_module._launch_node(_context())
    assert _profile_settings(kept) == {}
    assert any(isinstance(a, LogInfo) and '/etc/team_profile.xml' in a.msg for a in kept)
    own = tmp_path / 'profile.xml'
    own.write_text('<profiles/>')
    assert _profile_settings(launch_module._launch_node(_context(dds_profile=str(own)))) == {
        profile_variable(): str(own)}
    assert _profile_settings(launch_module._launch_node(_context(dds_profile='none'))) == {}
    with pytest.raises(RuntimeError, match='dds_profile: no file'):
        launch_module._launch_node(_context(dds_profile=str(tmp_path / 'missing.xml')))


def test_autostart_false_leaves_the_transitions_to_others(launch_module):
    node, handlers, emitted = _split(launch_module._launch_node(_context(autostart='false')))
    assert emitted == [] and not any(h.goal_state == 'inactive' for h in handlers)
    assert node.kwargs['parameters'][1]['autostart'] is False


def test_bad_remap_and_missing_config_are_named(launch_module, tmp_path):
    with pytest.raises(RuntimeError, match='expected FROM:=TO'):
        launch_module._launch_node(_context(camera_remaps='camera/image'))
    with pytest.raises(RuntimeError, match='no parameter file'):
        launch_module._launch_node(_context(config=str(tmp_path / 'none.yaml')))
    # A robot YAML needs a parameter file of its own (its cameras and joints), not libero's.
    with pytest.raises(RuntimeError, match=r'is a robot YAML: give config:='):
        launch_module._launch_node(_context(robot=str(tmp_path / 'arm.yaml')))
    node, _, _ = _split(launch_module._launch_node(_context(robot='so101')))
    assert node.kwargs['parameters'][0] == str(REPO / 'config' / 'so101.yaml')


def test_launched_node_in_a_namespace_gets_file_overrides_and_remaps(
        launch_module, tmp_path):
    """The real node, started with the command line launch_ros would give it, driven through
    configure and activate by the launch file's own events."""
    import rclpy
    from rclpy.context import Context
    from rclpy.lifecycle import TransitionCallbackReturn

    from oxygen_ros.ros.node import OxygenNode

    config = tmp_path / 'droid_tiny.yaml'
    text = (REPO / 'config' / 'droid.yaml').read_text()
    config.write_text(text.replace('preset: pi05-cpu', 'preset: tiny').replace(
        'seed: 0', 'seed: 7'))
    node_action, handlers, emitted = _split(launch_module._launch_node(_context(
        config=str(config), robot='droid', namespace='arm1',
        camera_remaps='camera/wrist_image_left/image_raw:=/zed/wrist')))
    context = Context()
    rclpy.init(context=context, args=['oxygen_node'] + node_action.ros_command_line(tmp_path))
    node = OxygenNode(context=context)
    try:
        assert node.get_fully_qualified_name() == '/arm1/oxygen_node'
        # The file's /**/oxygen_node key applies in the namespace; the overrides win.
        values = {n: node.get_parameter(n).value
                  for n in ('robot', 'preset', 'seed', 'autostart', 'control_rate_hz')}
        assert values == {'robot': 'droid', 'preset': 'tiny', 'seed': 7, 'autostart': False,
                          'control_rate_hz': 0.0}   # auto: resolved at configure
        assert node.lifecycle_state == 'unconfigured', 'no self-activation when launched'

        state = {TransitionCallbackReturn.SUCCESS: 'inactive'}
        for event in emitted:   # the launch file's configure request, then what it triggers
            assert event.lifecycle_node_matcher(node_action)
            assert event.transition_id == Transition.TRANSITION_CONFIGURE
            assert state[node.trigger_configure()] == 'inactive', node.problem_history[-3:]
            for handler in handlers:
                if handler.matches(node_action, 'configuring', 'inactive'):
                    for action in handler.entities:
                        assert action.event.transition_id == Transition.TRANSITION_ACTIVATE
                        assert node.trigger_activate() == TransitionCallbackReturn.SUCCESS
        assert node.lifecycle_state == 'active'
        # The shipped rate is auto: the node timed this machine at configure and runs at 90%.
        model = dict(node.diagnostic_statuses()[0].values)
        assert float(model['control_rate_hz']) > 0 and 'holds about' in model['capacity']
        topics = {sub.topic_name for sub in node._subscriptions_made}
        assert {'/zed/wrist', '/arm1/camera/exterior_image_1_left/image_raw',
                '/arm1/joint_states', '/arm1/instruction'} <= topics
    finally:
        node.destroy_node()
        rclpy.shutdown(context=context)


def test_robot_list_and_fleet_configs_reach_the_node(launch_module):
    node, _, _ = _split(launch_module._launch_node(_context(config='two_arms')))
    assert node.kwargs['parameters'][0] == str(REPO / 'config' / 'two_arms.yaml')
    node, _, _ = _split(launch_module._launch_node(_context(robots=' arm_a, arm_b ,')))
    assert node.kwargs['parameters'][1]['robots'] == ['arm_a', 'arm_b']
    with pytest.raises(RuntimeError, match='names must be unique'):
        launch_module._launch_node(_context(robots='arm,arm'))


@pytest.mark.parametrize('config, robots', [
    ('two_arms', {'arm_left': 'libero', 'arm_right': 'libero'}),
    ('aloha_droid', {'aloha': 'aloha', 'droid': 'droid'})])
def test_launched_fleet_serves_each_robot_in_its_namespace(launch_module, tmp_path, config,
                                                           robots):
    """The shipped fleet configs, launched in a namespace: one node, each robot's topics
    under <namespace>/<robot>, its own type and cameras, configured and activated."""
    import rclpy
    from rclpy.context import Context
    from rclpy.lifecycle import TransitionCallbackReturn

    from oxygen_ros.ros.node import OxygenNode

    path = tmp_path / f'{config}_tiny.yaml'
    path.write_text((REPO / 'config' / f'{config}.yaml').read_text().replace(
        'preset: pi05-cpu', 'preset: tiny'))
    first = next(iter(robots))
    node_action, _, _ = _split(launch_module._launch_node(_context(
        config=str(path), namespace='cell',
        camera_remaps=f'{first}/joint_states:=/{first}_driver/joint_states')))
    context = Context()
    rclpy.init(context=context, args=['oxygen_node'] + node_action.ros_command_line(tmp_path))
    node = OxygenNode(context=context)
    try:
        assert node.get_parameter('robots').value == list(robots)
        assert node.trigger_configure() == TransitionCallbackReturn.SUCCESS, (
            node.problem_history[-3:])
        assert node.trigger_activate() == TransitionCallbackReturn.SUCCESS
        assert {name: io.settings.robot for name, io in node.robots.items()} == robots
        topics = {sub.topic_name for sub in node._subscriptions_made}
        for name, io in node.robots.items():
            cameras = [c.name for c in io.settings.cameras]
            assert {f'/cell/{name}/camera/{c}/image_raw' for c in cameras} <= topics
            assert f'/cell/{name}/instruction' in topics
        assert f'/{first}_driver/joint_states' in topics   # remapped
        assert len(topics) == sum(len(io.settings.cameras) + 2 for io in node.robots.values())
    finally:
        node.destroy_node()
        rclpy.shutdown(context=context)
