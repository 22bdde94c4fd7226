"""oxygen_node's parameters: declared with descriptors, checked on set, applied after set.

The table and the per-value checks are ROS-free (runtime/params.py); this module turns them
into declared parameters and runs the two callbacks ros2/demos and nav2 use:

  on-set    validate only: each value's check, configure-time parameters while configured,
            a fleet's per-robot parameters set at node level, safety limits loosened while
            active, a decode budget the KV pool cannot hold. Nothing changes here.
  post-set  once the values are stored: deprecation notes, then the node applies the
            runtime changes (`apply`). rclpy has add_post_set_parameters_callback from Iron
            on; on Humble the changes are applied at the end of the on-set callback instead.

A startup override that fails its check is recorded (errors; configure refuses with the
reason) and the default declared, so the node stays up and says why.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from rclpy.lifecycle import LifecycleNode
from rclpy.parameter import Parameter
from rcl_interfaces.msg import (FloatingPointRange, IntegerRange, ParameterDescriptor,
                                SetParametersResult)

from oxygen_ros.runtime.changes import check_fits
from oxygen_ros.runtime.params import (camera_param_name, camera_param_specs, check_value,
                                       deprecation_warning, FleetSettings, NARRATION,
                                       NARRATION_LEGACY, param_spec, PARAMS, PARAMS_BY_NAME,
                                       robot_defaults, robot_param_defaults, robot_param_name,
                                       robot_param_specs, ROBOT_PARAMS, RobotSpecError,
                                       SAFETY_LIMITS, split_param_name, task_param_specs)
from oxygen_ros.runtime.status import ERROR, ProblemLog, WARN


def descriptor(spec) -> ParameterDescriptor:
    """Return the ParameterDescriptor of a ParamSpec: description, range, read-only."""
    # A parameter with a legacy form (decode_budget's old string) takes either type.
    # An empty list default (`robots`) has no element type for rclpy to infer.
    desc = ParameterDescriptor(description=spec.description, read_only=spec.read_only,
                               dynamic_typing=spec.legacy is not None or spec.default == [])
    if spec.int_range is not None:
        desc.integer_range = [IntegerRange(from_value=spec.int_range[0],
                                           to_value=spec.int_range[1], step=1)]
    if spec.float_range is not None:
        desc.floating_point_range = [FloatingPointRange(from_value=spec.float_range[0],
                                                        to_value=spec.float_range[1],
                                                        step=0.0)]
    if spec.configure_time and not spec.read_only:
        desc.additional_constraints = 'changes only while unconfigured (cleanup first)'
    return desc


@dataclasses.dataclass
class Served:
    """What the node serves now, as parameter checks need it."""

    lifecycle: str                          # 'unconfigured', 'inactive', 'active', ...
    settings: FleetSettings | None = None   # the configured robots' values (None: none)
    kv_slots: dict[str, int] | None = None  # each robot's KV slots (None: no engine)


class NodeParameters:
    """Declares the node's parameters and runs its on-set and post-set callbacks.

    served() says what the node serves now; apply(changes) applies accepted runtime changes
    ({full name: value}), called after the values are stored.
    """

    def __init__(self, node: LifecycleNode, problems: ProblemLog,
                 served: Callable[[], Served], apply: Callable[[dict], None]):
        self.node = node
        self.problems = problems
        self.served = served
        self.apply = apply
        self.errors: dict[str, str] = {}   # startup overrides that were rejected, with why
        self._declaring = False
        node.add_on_set_parameters_callback(self._on_set)
        self.post_set = hasattr(node, 'add_post_set_parameters_callback')   # Iron+
        if self.post_set:
            node.add_post_set_parameters_callback(self._after_set)

    def value(self, name: str):
        return self.node.get_parameter(name).value

    # ---- declaring ----------------------------------------------------------------------------

    def declare_all(self) -> None:
        """Declare every parameter; a rejected override is recorded, not raised."""
        self._declaring = True
        try:
            robot = self._declare(PARAMS_BY_NAME['robot'])
            # Camera and joint defaults follow the robot given at startup (a shipped robot or
            # a robot YAML); one that cannot be read keeps libero's, and configure says why.
            try:
                defaults = robot_defaults(robot if check_value('robot', robot) is None
                                          else 'libero')
            except RobotSpecError:
                defaults = robot_defaults('libero')
            for spec in PARAMS:
                if spec.name != 'robot':
                    self._declare(spec, defaults.get(spec.name, spec.default))
            cameras = self.value('camera_names')
            self.declare_cameras(cameras, legacy=self._legacy_camera_topics(cameras))
            self.declare_tasks(self.value('language_tasks'))
            self.declare_robots(self.value('robots'))
        finally:
            self._declaring = False

    def _legacy_camera_topics(self, cameras) -> dict:
        """Read the removed camera_topics / camera_compressed arrays into cameras.<name>.*.

        An old YAML or launch file would otherwise run with the default topics and show the
        cameras as never received; its values become the per-camera defaults, with a warning
        that names the parameters to set instead. Returns {parameter name: value}.
        """
        overrides = getattr(self.node, '_parameter_overrides', {})   # rclpy keeps them by name
        old = {name: list(overrides[name].value) for name in ('camera_topics',
                                                              'camera_compressed')
               if name in overrides and isinstance(overrides[name].value, (list, tuple))}
        if not old:
            return {}
        topics, flags = old.get('camera_topics', []), old.get('camera_compressed', [])
        values = {}
        for i, camera in enumerate(cameras):
            compressed = bool(flags[i]) if i < len(flags) else False
            if i < len(flags):
                values[camera_param_name(camera, 'compressed')] = compressed
            if i < len(topics):
                topic = str(topics[i])
                if compressed and topic.endswith('/compressed'):   # now the base topic
                    topic = topic[:-len('/compressed')]
                values[camera_param_name(camera, 'topic')] = topic
        self.problems.note(WARN, (
            f'{" and ".join(old)} are no longer parameters (parallel arrays): read as '
            + ', '.join(f'{name}: {value!r}' for name, value in values.items())
            + '; set those instead (cameras.<name>.topic is an image_transport base topic)'))
        return values

    def declare_robots(self, robots) -> None:
        """Declare <robot>.* (cameras included) for every robot not declared yet.

        A robot's parameters default to the node's own values (set once for every robot at
        the top level); its cameras and joints default to its robot type's.
        """
        declaring, self._declaring = self._declaring, True
        try:
            for robot in robots if check_value('robots', list(robots)) is None else ():
                if not self.node.has_parameter(robot_param_name(robot, 'robot')):
                    node_values = {name: self.value(name) for name in ROBOT_PARAMS}
                    (kind_spec,) = [s for s in robot_param_specs(robot, node_values)
                                    if s.name.endswith('.robot')]
                    kind = self._declare(kind_spec)
                    defaults = robot_param_defaults(node_values, kind)
                    for spec in robot_param_specs(robot, defaults):
                        if not self.node.has_parameter(spec.name):
                            self._declare(spec)
                self.declare_cameras(self.value(robot_param_name(robot, 'camera_names')),
                                     robot)
                self.declare_tasks(self.value(robot_param_name(robot, 'language_tasks')), robot)
        finally:
            self._declaring = declaring

    def declare_tasks(self, tasks, robot: str = '') -> None:
        """Declare [<robot>.]tasks.<name>.* for every language task not declared yet.

        narration's prompt, tokens and every_n_frames are not declared: they are
        language_prompt, tokens_per_request and request_every_n_frames, which stay the
        parameters to set (a startup value of tasks.narration.* is read all the same).
        """
        if check_value('language_tasks', list(tasks)) is not None:
            return   # configure reports why
        declaring, self._declaring = self._declaring, True
        try:
            for task in tasks:
                for spec in task_param_specs(task):
                    field = spec.name.rsplit('.', 1)[1]
                    if task == NARRATION and field in NARRATION_LEGACY:
                        continue
                    if robot:
                        spec = dataclasses.replace(spec, name=robot_param_name(robot, spec.name))
                    if not self.node.has_parameter(spec.name):
                        self._declare(spec)
        finally:
            self._declaring = declaring

    def declare_cameras(self, cameras, robot: str = '', legacy: dict | None = None) -> None:
        """Declare [<robot>.]cameras.<name>.* for every camera not declared yet.

        legacy: defaults read from the removed camera arrays (_legacy_camera_topics).
        """
        declaring, self._declaring = self._declaring, True
        try:
            for camera in cameras:
                for spec in camera_param_specs(camera):
                    if robot:
                        spec = dataclasses.replace(spec, name=robot_param_name(robot, spec.name))
                    if not self.node.has_parameter(spec.name):
                        self._declare(spec, (legacy or {}).get(spec.name))
        finally:
            self._declaring = declaring

    def _declare(self, spec, default=None):
        default = spec.default if default is None else default
        try:
            value = self.node.declare_parameter(spec.name, default, descriptor(spec)).value
        except Exception as err:   # noqa: BLE001 - rclpy raises several exception types
            reason = str(err).strip() or type(err).__name__
        else:
            warning = deprecation_warning(spec.name, value)
            if warning:
                self.problems.note(WARN, warning)
            return value
        # Keep the node alive and visible: declare the default, and configure refuses with the
        # reason until the parameter is set to a valid value.
        value = self.node.declare_parameter(spec.name, default, descriptor(spec),
                                            ignore_override=True).value
        self.errors[spec.name] = reason
        self.problems.note(ERROR, f'parameter {spec.name}: startup value rejected: {reason}')
        return value

    def configure_values(self) -> dict:
        """Return every value configure reads: the node's, its cameras', each robot's.

        Camera and robot names set since startup are declared first.
        """
        values = {spec.name: self.value(spec.name) for spec in PARAMS}
        values.update(self._camera_values(values['camera_names']))
        values.update(self._task_values(values['language_tasks']))
        robots = list(values['robots'])
        self.declare_robots(robots)   # robots named since startup
        for robot in robots:
            values.update(self._camera_values(
                self.value(robot_param_name(robot, 'camera_names')), robot))
            values.update(self._task_values(
                self.value(robot_param_name(robot, 'language_tasks')), robot))
        return values

    def _task_values(self, tasks, robot: str = '') -> dict:
        """Return one robot's task values: declared ones, and every tasks.* startup value.

        Startup values of no declared parameter (a typo, a task not in language_tasks,
        narration's legacy fields) are passed on too, so configure names what is wrong.
        """
        self.declare_tasks(tasks, robot)   # task names set since startup
        prefix = robot_param_name(robot, 'tasks.') if robot else 'tasks.'
        overrides = getattr(self.node, '_parameter_overrides', {})   # rclpy keeps them by name
        names = {n for n in overrides if n.startswith(prefix)}
        names |= {prefix + n for n in self.node.get_parameters_by_prefix(prefix[:-1])}
        return {n: (self.value(n) if self.node.has_parameter(n) else overrides[n].value)
                for n in sorted(names)}

    def _camera_values(self, cameras, robot: str = '') -> dict:
        """Return one robot's camera values (robot '': the node's), and a robot's own values."""
        self.declare_cameras(cameras, robot)   # camera names set since startup
        names = [spec.name for camera in cameras for spec in camera_param_specs(camera)]
        if robot:
            names = [robot_param_name(robot, n) for n in names + list(ROBOT_PARAMS)]
        return {name: self.value(name) for name in names}

    # ---- on set: validate -------------------------------------------------------------------

    def _on_set(self, params: list[Parameter]) -> SetParametersResult:
        reasons = self._reasons(params)
        if reasons:
            reason = '; '.join(reasons)
            if not self._declaring:   # startup values are reported by _declare
                self.node.get_logger().warning(f'parameter change rejected: {reason}')
            return SetParametersResult(successful=False, reason=reason)
        if not self.post_set:   # Humble: no post-set callback, apply now
            self._after_set(params)
        return SetParametersResult(successful=True)

    def _reasons(self, params: list[Parameter]) -> list[str]:
        """Why each of these values may not be set now ([] when all may)."""
        served = self.served()
        active = served.lifecycle == 'active'
        fleet = served.settings is not None and not served.settings.is_one
        reasons = []
        for param in params:
            spec = param_spec(param.name)
            if param.name == 'use_sim_time' and active and not self._declaring:
                # Switching clocks mid-run makes every input look stale or fresh at random.
                reasons.append('use_sim_time: can only change while not active (deactivate '
                               'first)')
                continue
            if spec is None:
                continue
            robot, base = split_param_name(param.name)
            try:
                why = check_value(param.name, param.value)
            except TypeError:
                why = f'wrong type {type(param.value).__name__}'
            except Exception as err:   # noqa: BLE001 - a raising check must not kill the node
                why = f'cannot be checked ({type(err).__name__})'
            if why:
                reasons.append(f'{param.name}: {why}')
            elif (spec.configure_time and not self._declaring
                  and served.lifecycle not in ('unconfigured', 'finalized')):
                reasons.append(f'{param.name}: can only change while unconfigured (node is '
                               f'{served.lifecycle}): deactivate, cleanup, set it, configure')
            elif fleet and not robot and base in ROBOT_PARAMS and not self._declaring:
                robots = served.settings.robots
                reasons.append(f'{param.name}: this node serves robots {list(robots)}, each '
                               f'with its own {base}: set e.g. '
                               f'{robot_param_name(next(iter(robots)), base)}')
            elif (active and base in SAFETY_LIMITS and not self._declaring
                  and not self.value('allow_unsafe_changes')
                  and param.value > self.value(param.name)):
                reasons.append(f'{param.name}: raising it while active loosens a safety limit '
                               f'({self.value(param.name):g} -> {param.value:g}); deactivate '
                               'first, or start the node with allow_unsafe_changes:=true')
        if not reasons and served.kv_slots is not None and not self._declaring:
            why = check_fits(served.settings, served.kv_slots, runtime_changes(params))
            if why:
                reasons.append(why)
        return reasons

    # ---- post set: apply --------------------------------------------------------------------

    def _after_set(self, params: list[Parameter]) -> None:
        """Note deprecated forms, clear startup errors, apply the changes (values stored)."""
        if self._declaring:
            return
        for param in params:
            warning = deprecation_warning(param.name, param.value)
            if warning:
                self.problems.note(WARN, warning)
            self.errors.pop(param.name, None)
        changes = runtime_changes(params)
        if changes:
            self.apply(changes)


def runtime_changes(params: list[Parameter]) -> dict:
    """{name: value} of the runtime parameters (changeable while active) among `params`."""
    return {p.name: p.value for p in params
            if (spec := param_spec(p.name)) is not None and not spec.configure_time}
