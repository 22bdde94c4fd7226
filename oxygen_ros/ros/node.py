"""`oxygen_node`: a thin lifecycle adapter over the runtime's frame loop.

Cameras, joint states and an instruction in; an action chunk every tick, and language tokens
on their own topic, out. The work of a tick is oxygen_ros.runtime.frame_loop.FrameLoop, the
same code the bag replay runs; this module only wires it to rclpy.

Several robots (parameter `robots`, e.g. [arm_left, arm_right]): one model in memory serves
them all through a FleetEngine, ticked by oxygen_ros.runtime.fleet_loop.FleetLoop. Each robot
has its own topics in its namespace (`arm_left/actions`, `arm_left/instruction`, ...), its own
per-robot parameters (`arm_left.robot`, `arm_left.cameras.image.topic`, ...), control rate,
decode budget, KV quota and diagnostics (`oxygen_node/arm_left: ...`). The wiring of one
robot (subscriptions, inputs, outputs) is ros/robot_io.py, the same for one robot or many.

Two threads:
  executor        a SingleThreadedExecutor serving I/O only (main()): the instruction
                  subscriptions, lifecycle and parameter services, 1 Hz /diagnostics, and the
                  control timer, whose callback only wakes the control thread. Cameras and
                  joint states never reach it: the control thread takes their newest message
                  at the start of each tick (ros/polling.py). No callback runs for long, so
                  the executor sleeps in rcl_wait instead of spinning against the model for
                  the GIL (a MultiThreadedExecutor next to a long callback does: measured 2.2x
                  slower inference).
  control thread  'oxy_control' (runtime.control.ControlThread): one FrameLoop.tick (or
                  FleetLoop.tick) per wake-up: observation -> act -> publish ActionChunk ->
                  language -> publish LanguageChunks / narration. The engine is touched by
                  this thread only. A fleet's timer wakes it at the largest period dividing
                  every robot's period (fleet_loop.wake_period_s); each tick serves the robots
                  due then.

Lifecycle: configure loads the model and wires publishers and subscriptions; activate starts
the control thread and the timer; deactivate stops the timer, closes the outputs (no message
is published once it returns, even by a tick still running) and joins the thread; cleanup
releases everything. Publishers are plain (not lifecycle) publishers gated by that switch;
/diagnostics keeps publishing in every state (a failed configure shows).

Time: the control timer, stamps and input staleness use the node clock, so with use_sim_time
the node follows /clock (`ros2 bag play --clock`) and pauses when it pauses. Diagnostics and
autostart run on a steady clock, so they work before /clock starts or while it is paused.
ActionChunk.header.stamp is the observation's (first camera's) header stamp; LanguageChunk
carries the stamp of the tick that produced it (equal to that tick's ActionChunk stamp), or
the node clock when a tick had no new frame.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import os
import sys
import threading
import time
import traceback

import rclpy
from rclpy.clock import Clock, ClockType
from rclpy.executors import SingleThreadedExecutor
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.parameter import Parameter
from rcl_interfaces.msg import (FloatingPointRange, IntegerRange, ParameterDescriptor,
                                SetParametersResult)

from diagnostic_msgs.msg import DiagnosticArray

from oxygen_ros.engine import AdaptiveBudget, FixedBudget
from oxygen_ros.ros import qos
from oxygen_ros.ros.diagnostics import to_diagnostic_array
from oxygen_ros.ros.robot_io import RobotIO, RosOutputs
from oxygen_ros.runtime.capacity import resolve_rate
from oxygen_ros.runtime.control import ControlThread, CpuSplit
from oxygen_ros.runtime.fleet_loop import FleetLoop, RobotLoop, wake_period_s
from oxygen_ros.runtime.frame_loop import FrameLoop
from oxygen_ros.runtime.params import (camera_param_name, camera_param_specs, check_value,
                                       deprecation_warning, FleetSettings, NODE_NAME,
                                       param_spec, PARAMS,
                                       PARAMS_BY_NAME, parse_decode_budget, parse_rtc_mode,
                                       robot_defaults, robot_param_defaults, robot_param_name,
                                       RobotSpecError,
                                       robot_param_specs, ROBOT_PARAMS, SAFETY_LIMITS, Settings,
                                       split_param_name)
from oxygen_ros.runtime.rtc import planner_for
from oxygen_ros.runtime.status import build_statuses, ERROR, LoopStats, OK, ProblemLog, WARN

try:
    from rclpy.executors import ExternalShutdownException
except ImportError:   # pragma: no cover - older rclpy raise KeyboardInterrupt only
    ExternalShutdownException = KeyboardInterrupt

STOP_TIMEOUT_S = 5.0   # deactivate waits this long for a running tick before giving up on it


def _descriptor(spec) -> ParameterDescriptor:
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


class EngineLogBridge(logging.Handler):
    """Forwards the engine's Python log records to the node's throttled problem log."""

    LEVELS = {logging.WARNING: WARN, logging.ERROR: ERROR, logging.CRITICAL: ERROR}

    def __init__(self, problems: ProblemLog, info: callable):
        super().__init__(logging.INFO)
        self.problems = problems
        self.info = info

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = f'{record.name}: {record.getMessage()}'
            if record.levelno < logging.WARNING:
                self.info(text)
            else:
                # Key on the format string: the same warning with other numbers is one problem.
                self.problems.event(f'{record.name}:{record.msg}',
                                    self.LEVELS.get(record.levelno, ERROR), text)
        except Exception:   # noqa: BLE001 - logging must never break the caller
            self.handleError(record)


class _BridgeAttachment:
    """Attach bridges to the 'oxygen_ros' logger; stop propagation while any is attached."""

    lock = threading.Lock()
    attached: list = []
    propagate = True

    @classmethod
    def attach(cls, bridge: logging.Handler) -> None:
        logger = logging.getLogger('oxygen_ros')
        with cls.lock:
            if not cls.attached:
                # The bridges print records through the ROS logger; without this they would
                # print twice (Python's last-resort handler writes warnings to stderr too).
                cls.propagate = logger.propagate
                logger.propagate = False
                if logger.level == logging.NOTSET or logger.level > logging.INFO:
                    logger.setLevel(logging.INFO)
            cls.attached.append(bridge)
            logger.addHandler(bridge)

    @classmethod
    def detach(cls, bridge: logging.Handler) -> None:
        logger = logging.getLogger('oxygen_ros')
        with cls.lock:
            if bridge in cls.attached:
                cls.attached.remove(bridge)
                logger.removeHandler(bridge)
                if not cls.attached:
                    logger.propagate = cls.propagate


class OxygenNode(LifecycleNode):
    """Lifecycle node running the π0.5 engine at a fixed control rate, for one robot or many."""

    def __init__(self, node_name: str = NODE_NAME, *, engine_builder=None, **kwargs):
        super().__init__(node_name, **kwargs)
        # engine_builder(settings) -> runtime engine, Settings for one robot, FleetSettings for
        # several; None: engine_setup's build_engine / build_fleet. The soak injects faults.
        self._engine_builder = engine_builder
        self._lifecycle = 'unconfigured'
        self._config_error = ''
        self._declaring = False
        self._param_errors: dict[str, str] = {}   # startup overrides that were rejected
        self._problems = ProblemLog(self._log)
        self._stats = LoopStats()
        self._engine = None
        self._settings: Settings | None = None    # one robot; a fleet's: the shared values
        self._fleet_settings: FleetSettings | None = None
        self._ios: dict[str, RobotIO] = {}        # robot name ('' for one robot) -> its topics
        self._inputs = None                       # one robot: its InputSet
        self._outputs: RosOutputs | None = None   # one robot: its output sink
        self._loop: FrameLoop | None = None       # one robot
        self._fleet_loop: FleetLoop | None = None   # several robots
        self._control: ControlThread | None = None
        self._wake_timer = None
        self._pending: dict = {}                    # engine changes for the next tick
        self._pending_lock = threading.Lock()
        self._cpu = CpuSplit()
        self._cpu_pct: tuple[float, float] | None = None   # (control, other) % of one core

        self.add_on_set_parameters_callback(self._on_set_parameters)
        self._declare_parameters()
        self._period_s = _period_of(self._value('control_rate_hz'))
        self._stale_timeout_s = self._value('stale_frame_timeout_s')
        self._max_instruction_chars = self._value('max_instruction_chars')

        self._bridge = EngineLogBridge(self._problems, self.get_logger().info)
        _BridgeAttachment.attach(self._bridge)
        self._diagnostics_pub = self.create_publisher(DiagnosticArray, '/diagnostics',
                                                      qos.DIAGNOSTICS)
        self._diagnostics_timer = None
        self._start_diagnostics_timer(self._value('diagnostics_period_s'))
        steady = Clock(clock_type=ClockType.STEADY_TIME)
        self._autostart_timer = None
        if self._value('autostart'):
            # A timer, not a call: configure runs inside the executor once it spins.
            self._autostart_timer = self.create_timer(0.01, self._autostart, clock=steady)

    # ---- parameters -----------------------------------------------------------------------

    def _declare_parameters(self) -> None:
        """Declare every parameter; a rejected override is recorded, not raised."""
        self._declaring = True
        robot = self._declare(PARAMS_BY_NAME['robot'])
        # Camera and joint defaults follow the robot given at startup (a shipped robot or a
        # robot YAML); one that cannot be read keeps libero's, and configure says why.
        try:
            defaults = robot_defaults(robot if check_value('robot', robot) is None else 'libero')
        except RobotSpecError:
            defaults = robot_defaults('libero')
        for spec in PARAMS:
            if spec.name != 'robot':
                self._declare(spec, defaults.get(spec.name, spec.default))
        cameras = self._value('camera_names')
        self._declare_camera_params(cameras, legacy=self._legacy_camera_topics(cameras))
        self._declare_robot_params(self._value('robots'))
        self._declaring = False

    def _legacy_camera_topics(self, cameras) -> dict:
        """Read the removed camera_topics / camera_compressed arrays into cameras.<name>.*.

        An old YAML or launch file would otherwise run with the default topics and show the
        cameras as never received; its values become the per-camera defaults, with a warning
        that names the parameters to set instead. Returns {parameter name: value}.
        """
        overrides = getattr(self, '_parameter_overrides', {})   # rclpy keeps them by name
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
        self._problems.note(WARN, (
            f'{" and ".join(old)} are no longer parameters (parallel arrays): read as '
            + ', '.join(f'{name}: {value!r}' for name, value in values.items())
            + '; set those instead (cameras.<name>.topic is an image_transport base topic)'))
        return values

    def _declare_robot_params(self, robots) -> None:
        """Declare <robot>.* (cameras included) for every robot not declared yet.

        A robot's parameters default to the node's own values (set once for every robot at
        the top level); its cameras and joints default to its robot type's.
        """
        declaring, self._declaring = self._declaring, True
        try:
            for robot in robots if check_value('robots', list(robots)) is None else ():
                if not self.has_parameter(robot_param_name(robot, 'robot')):
                    node_values = {name: self._value(name) for name in ROBOT_PARAMS}
                    (kind_spec,) = [s for s in robot_param_specs(robot, node_values)
                                    if s.name.endswith('.robot')]
                    kind = self._declare(kind_spec)
                    defaults = robot_param_defaults(node_values, kind)
                    for spec in robot_param_specs(robot, defaults):
                        if not self.has_parameter(spec.name):
                            self._declare(spec)
                self._declare_camera_params(
                    self._value(robot_param_name(robot, 'camera_names')), robot)
        finally:
            self._declaring = declaring

    def _declare_camera_params(self, cameras, robot: str = '', legacy: dict | None = None
                               ) -> None:
        """Declare [<robot>.]cameras.<name>.* for every camera not declared yet.

        legacy: defaults read from the removed camera arrays (_legacy_camera_topics).
        """
        declaring, self._declaring = self._declaring, True
        try:
            for camera in cameras:
                for spec in camera_param_specs(camera):
                    if robot:
                        spec = dataclasses.replace(spec, name=robot_param_name(robot, spec.name))
                    if not self.has_parameter(spec.name):
                        self._declare(spec, (legacy or {}).get(spec.name))
        finally:
            self._declaring = declaring

    def _declare(self, spec, default=None):
        default = spec.default if default is None else default
        try:
            value = self.declare_parameter(spec.name, default, _descriptor(spec)).value
        except Exception as err:   # noqa: BLE001 - rclpy raises several exception types
            reason = str(err).strip() or type(err).__name__
        else:
            warning = deprecation_warning(spec.name, value)
            if warning:
                self._problems.note(WARN, warning)
            return value
        # Keep the node alive and visible: declare the default, and configure refuses with the
        # reason until the parameter is set to a valid value.
        value = self.declare_parameter(spec.name, default, _descriptor(spec),
                                       ignore_override=True).value
        self._param_errors[spec.name] = reason
        self._problems.note(ERROR, f'parameter {spec.name}: startup value rejected: {reason}')
        return value

    def _value(self, name: str):
        return self.get_parameter(name).value

    def _on_set_parameters(self, params: list[Parameter]) -> SetParametersResult:
        reasons = []
        active = self._lifecycle == 'active'
        fleet = self._fleet_loop is not None
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
                  and self._lifecycle not in ('unconfigured', 'finalized')):
                reasons.append(f'{param.name}: can only change while unconfigured (node is '
                               f'{self._lifecycle}): deactivate, cleanup, set it, configure')
            elif (fleet and not robot and base in ROBOT_PARAMS and not self._declaring):
                robots = self._fleet_settings.robots
                reasons.append(f'{param.name}: this node serves robots {list(robots)}, each '
                               f'with its own {base}: set e.g. '
                               f'{robot_param_name(next(iter(robots)), base)}')
            elif (active and base in SAFETY_LIMITS and not self._declaring
                  and not self._value('allow_unsafe_changes')
                  and param.value > self._value(param.name)):
                reasons.append(f'{param.name}: raising it while active loosens a safety limit '
                               f'({self._value(param.name):g} -> {param.value:g}); deactivate '
                               'first, or start the node with allow_unsafe_changes:=true')
        changes = {p.name: p.value for p in params
                   if (spec := param_spec(p.name)) is not None and not spec.configure_time}
        if not reasons and self._engine is not None:
            why = self._check_fits(changes)
            if why:
                reasons.append(why)
        if reasons:
            reason = '; '.join(reasons)
            if not self._declaring:   # startup values are reported by _declare
                self.get_logger().warning(f'parameter change rejected: {reason}')
            return SetParametersResult(successful=False, reason=reason)
        if not self._declaring:
            for param in params:
                warning = deprecation_warning(param.name, param.value)
                if warning:
                    self._problems.note(WARN, warning)
        for param in params:
            self._param_errors.pop(param.name, None)
        if changes and not self._declaring:
            self._apply_runtime(changes)
        return SetParametersResult(successful=True)

    def _robot_settings(self) -> dict[str, Settings]:
        """Return each served robot's settings by name ('' for a plain node's one robot)."""
        if self._fleet_settings is not None:
            return self._fleet_settings.robots
        return {'': self._settings} if self._settings is not None else {}

    def _scheduler(self, robot: str):
        """Return one robot's engine scheduler (its budget, policy and KV share)."""
        system = self._engine.system
        return system.scheduler(robot) if robot else system

    def _check_fits(self, changes: dict) -> str:
        """Reject a budget / request-rate change the KV pool cannot hold (reason or '')."""
        from oxygen_ros.runtime.engine_setup import slots_needed

        for robot, s in self._robot_settings().items():
            names = {base: full for full in changes
                     for owner, base in [split_param_name(full)] if owner == robot}
            if not {'decode_budget', 'request_every_n_frames'} & names.keys():
                continue
            every = changes.get(names.get('request_every_n_frames'), s.request_every_n_frames)
            k = parse_decode_budget(changes.get(names.get('decode_budget'),
                                                s.decode_budget or 0))
            need = slots_needed(every, s.tokens_per_request, k)
            before = slots_needed(s.request_every_n_frames, s.tokens_per_request,
                                  s.decode_budget)
            slots = self._scheduler(robot).pool.num_slots
            if need > slots and need > before:
                quota = f'{robot}.kv_capacity' if robot else 'kv_capacity'
                return (f'{robot + ": " if robot else ""}decode_budget={k or "adaptive"} with '
                        f'request_every_n_frames={every} needs {need} KV slots (ceil(N/k) + 1) '
                        f'but the pool has {slots}: raise {quota} and reconfigure, or choose '
                        'a larger k')
        return ''

    def _apply_runtime(self, changes: dict) -> None:
        """Apply accepted runtime changes: here what the executor owns, the rest next tick."""
        robots = self._robot_settings()
        for name, value in changes.items():
            robot, base = split_param_name(name)
            if base == 'max_instruction_chars':
                self._max_instruction_chars = value
            elif base == 'diagnostics_period_s':
                self._start_diagnostics_timer(value)
            elif base == 'stale_frame_timeout_s' and robot in robots:
                if not robot:
                    self._stale_timeout_s = value
                if robot in self._ios:
                    self._ios[robot].inputs.stale_timeout_s = value
            elif base == 'control_rate_hz' and not robot and self._settings is None:
                self._period_s = _period_of(value)   # not configured: what configure starts
            # A fleet's node-level settings hold its shared values; a robot's, its own.
            if robot in robots or (not robot and self._settings is not None):
                self._replace_settings(robot, base, value)
        if self._settings is not None and any(
                split_param_name(n)[1] == 'control_rate_hz' for n in changes):
            self._period_s = self._wake_period_s()
            if self._wake_timer is not None:   # active: the new period starts now
                self._start_wake_timer()
        with self._pending_lock:   # the engine is touched only by the control thread
            self._pending.update(changes)
        self.get_logger().info('parameters changed: ' + ', '.join(
            f'{k}={v}' for k, v in changes.items()))

    def _replace_settings(self, robot: str, base: str, value) -> None:
        value = (parse_decode_budget(value) if base == 'decode_budget'
                 else parse_rtc_mode(value) if base == 'rtc_mode' else value)
        if base == 'control_rate_hz':
            capacity = self._engine.capacity if self._engine is not None else None
            value = resolve_rate(value, capacity)   # 0: auto, from the configure-time timing
            if capacity is not None:
                self._rate_note(capacity, value)
        if robot and self._fleet_settings is not None:
            fleet = self._fleet_settings
            robots = dict(fleet.robots)
            robots[robot] = dataclasses.replace(robots[robot], **{base: value})
            self._fleet_settings = dataclasses.replace(fleet, robots=robots)
        else:
            self._settings = dataclasses.replace(self._settings, **{base: value})

    def _rate_note(self, capacity, asked_hz: float) -> None:
        """Log what rate this machine holds next to the one asked (a warning if above it)."""
        message = f'this machine {capacity.describe(asked_hz)}'
        if asked_hz > capacity.rate_hz:
            self._problems.note(WARN, f'{message}: ticks will overrun (language still takes '
                                      'its minimum); set control_rate_hz 0 (auto) or at most '
                                      f'{capacity.auto_rate_hz():.3g}')
        else:
            self.get_logger().info(message)

    def _wake_period_s(self) -> float:
        """Return the control timer's period: the robot's, or one meeting every robot's ticks."""
        if self._fleet_settings is None:
            return self._settings.period_s
        return wake_period_s([s.period_s for s in self._fleet_settings.robots.values()])

    def _apply_pending(self) -> None:
        """Apply runtime parameter changes to the engine (control thread, between ticks)."""
        with self._pending_lock:
            changes, self._pending = self._pending, {}
        if not changes or self._engine is None:
            return
        for robot, settings in self._robot_settings().items():
            bases = {split_param_name(n)[1] for n in changes if split_param_name(n)[0] == robot}
            if not bases:
                continue
            system, scheduler = self._engine.system, self._scheduler(robot)
            args = (robot,) if robot else ()   # a FleetEngine's controls name the robot
            if 'request_every_n_frames' in bases:
                system.set_policy(*args, dataclasses.replace(
                    scheduler.policy, every_n_frames=settings.request_every_n_frames))
            if 'decode_budget' in bases:
                k = settings.decode_budget
                system.set_budget(*args, FixedBudget(k) if k else AdaptiveBudget(
                    settings.period_s, k_max=scheduler.policy.max_request_len))
            elif 'control_rate_hz' in bases and isinstance(scheduler.budget, AdaptiveBudget):
                scheduler.budget.frame_period_s = settings.period_s
            if robot and 'control_rate_hz' in bases:
                self._fleet_loop.robots[robot].period_s = settings.period_s
            if any(base.startswith('rtc_') for base in bases):
                loop = self._fleet_loop.robots[robot] if robot else self._loop
                loop.rtc.settings = settings.rtc
        if self._fleet_loop is not None:
            self._fleet_loop.gather_s = 0.5 * self._period_s

    # ---- lifecycle --------------------------------------------------------------------------

    def _autostart(self) -> None:
        self.destroy_timer(self._autostart_timer)
        self._autostart_timer = None
        if self.trigger_configure() == TransitionCallbackReturn.SUCCESS:
            self.trigger_activate()

    def _values(self, cameras, robot: str = '') -> dict:
        """Return the values of one robot's parameters and cameras (robot '': the node's cameras).

        Camera names set since startup are declared first.
        """
        self._declare_camera_params(cameras, robot)   # names set since startup
        names = [spec.name for camera in cameras for spec in camera_param_specs(camera)]
        if robot:
            names = [robot_param_name(robot, n) for n in names + list(ROBOT_PARAMS)]
        return {name: self._value(name) for name in names}

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._lifecycle = 'configuring'
        self.get_logger().info('configuring: loading the model')
        self._publish_diagnostics()   # the executor is busy while the model loads: say so
        started = time.monotonic()
        try:
            if self._param_errors:
                raise ValueError('parameters rejected at startup: ' + '; '.join(
                    f'{k}: {v}' for k, v in self._param_errors.items()))
            values = {spec.name: self._value(spec.name) for spec in PARAMS}
            values.update(self._values(values['camera_names']))
            if values['robots']:
                engine = self._configure_fleet(values)
            else:
                engine = self._configure_robot(values)
        except Exception as err:   # noqa: BLE001 - any failure is a FAILURE transition
            self._config_error = f'configure failed: {err}'
            self._problems.note(ERROR, self._config_error)
            self.get_logger().debug(traceback.format_exc())
            self._release()
            self._lifecycle = 'unconfigured'
            return TransitionCallbackReturn.FAILURE
        self._engine, self._config_error = engine, ''
        self._period_s = self._wake_period_s()
        self._stale_timeout_s = self._settings.stale_frame_timeout_s
        self._max_instruction_chars = self._settings.max_instruction_chars
        with self._pending_lock:
            self._pending = {}   # the engine was just built from the current values
        for warning in engine.warnings:
            self.get_logger().warning(warning)
        pool = engine.system.pool
        if self._fleet_settings is not None:
            served = ', '.join(f'{name} ({s.robot}, {s.control_rate_hz:g} Hz, '
                               f'{self._scheduler(name).pool.num_slots} KV slots)'
                               for name, s in self._fleet_settings.robots.items())
        else:
            s = self._settings
            served = (f'robot {s.robot}, {len(s.cameras)} cameras, {s.control_rate_hz:g} Hz, '
                      f'decode budget {s.decode_budget or "adaptive"}')
        self.get_logger().info(
            f'configured in {time.monotonic() - started:.1f} s: '
            f'{engine.description["source"]}, {served}, KV pool {pool.num_slots} slots '
            f'({pool.total_bytes / (1 << 20):.1f} MiB), '
            f'{engine.description.get("torch_threads", "?")} torch threads')
        if engine.capacity is not None:
            self._rate_note(engine.capacity, max(
                s.control_rate_hz for s in self._robot_settings().values()))
        self._lifecycle = 'inactive'
        return TransitionCallbackReturn.SUCCESS

    def _configure_robot(self, values: dict):
        """One robot: its engine, its topics in the node's namespace, a FrameLoop."""
        from oxygen_ros.runtime.engine_setup import build_engine   # torch: load lazily

        engine = (self._engine_builder or build_engine)(Settings.from_values(values))
        self._settings = settings = engine.settings   # the control rate resolved
        io = self._ios[''] = RobotIO(self, settings, self._problems,
                                     lambda: self._max_instruction_chars)
        self._inputs, self._outputs = io.inputs, io.outputs
        self._stats = LoopStats()
        self._loop = FrameLoop(engine.system, io.inputs, problems=self._problems,
                               stats=self._stats, rtc=planner_for(settings))
        return engine

    def _configure_fleet(self, values: dict):
        """Several robots: one FleetEngine, each robot's topics in its namespace, a FleetLoop."""
        robots = list(values['robots'])
        self._declare_robot_params(robots)   # robots named since startup
        for robot in robots:
            values.update(self._values(self._value(robot_param_name(robot, 'camera_names')),
                                       robot))
        fleet_settings = FleetSettings.from_values(values)
        from oxygen_ros.runtime.engine_setup import build_fleet   # torch: load lazily

        engine = (self._engine_builder or build_fleet)(fleet_settings)
        fleet_settings = engine.settings   # the robots' control rates resolved
        self._settings, self._fleet_settings = fleet_settings.node, fleet_settings
        loops = []
        for name, settings in fleet_settings.robots.items():
            problems = ProblemLog(
                lambda level, message, name=name: self._problems.note(level, f'{name}: {message}'))
            io = self._ios[name] = RobotIO(self, settings, problems,
                                           lambda: self._max_instruction_chars, namespace=name)
            loops.append(RobotLoop(name, io.inputs, io.outputs, settings.period_s, problems,
                                   rtc=planner_for(settings)))
        period = wake_period_s([s.period_s for s in fleet_settings.robots.values()])
        # Half a wake-up of slack: a robot due at a wake-up the timer fires a little early or
        # late for is served at that wake-up, not one later.
        self._fleet_loop = FleetLoop(engine.system, loops, gather_s=0.5 * period)
        return engine

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        # The model's objects live as long as the engine: move them out of the collector's
        # reach, so a full collection during a tick walks only what the loop itself makes.
        gc.collect()
        gc.freeze()
        self._stats.reset()
        now_s = self._now_s()
        for io in self._ios.values():
            io.inputs.started_s = now_s
            io.outputs.open()
        if self._fleet_loop is not None:
            for robot in self._fleet_loop.robots.values():
                robot.stats.reset()
                robot.next_due_s = None   # a fresh grid from the first tick on
                robot.skipped_ticks = 0
        self._control = ControlThread(self._control_tick, nice=self._settings.control_nice,
                                      realtime_priority=self._settings.control_priority)
        self._control.start()
        self._start_wake_timer()
        self._lifecycle = 'active'
        self.get_logger().info(f'active: control loop at {1.0 / self._period_s:g} Hz')
        return super().on_activate(state)

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop_control()
        self._lifecycle = 'inactive'
        self.get_logger().info('inactive: control loop stopped')
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._release()
        gc.unfreeze()   # the released engine's objects become collectable again
        self._lifecycle = 'unconfigured'
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._release()
        self._lifecycle = 'finalized'
        return TransitionCallbackReturn.SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.get_logger().error(f'error in state {state.label}: releasing the engine')
        self._release()
        self._lifecycle = 'unconfigured'
        return TransitionCallbackReturn.SUCCESS

    def _start_diagnostics_timer(self, period_s: float) -> None:
        """(Re)start the /diagnostics timer (steady clock: works before /clock starts)."""
        if self._diagnostics_timer is not None:
            self.destroy_timer(self._diagnostics_timer)
        self._diagnostics_timer = self.create_timer(
            period_s, self._publish_diagnostics, clock=Clock(clock_type=ClockType.STEADY_TIME))

    def _start_wake_timer(self) -> None:
        """(Re)start the timer that wakes the control thread once per period (node clock)."""
        if self._wake_timer is not None:
            self.destroy_timer(self._wake_timer)
        self._wake_timer = self.create_timer(self._period_s, self._control.trigger)

    def _stop_control(self) -> None:
        """Stop waking the loop, close the outputs, then let a running tick finish."""
        if self._wake_timer is not None:
            self.destroy_timer(self._wake_timer)
            self._wake_timer = None
        for io in self._ios.values():
            io.outputs.close()   # from here on nothing is published, whatever still runs
        if self._control is not None:
            if not self._control.stop(STOP_TIMEOUT_S):
                self._problems.note(ERROR, f'a control tick did not finish within '
                                           f'{STOP_TIMEOUT_S:g} s of deactivate')
            self._control = None

    def _release(self) -> None:
        """Drop timer, thread, subscriptions, publishers and the engine (frees model and KV)."""
        self._stop_control()
        for io in self._ios.values():
            io.destroy()
        self._ios = {}
        self._outputs = self._inputs = self._loop = self._fleet_loop = None
        self._engine = self._settings = self._fleet_settings = None

    def destroy_node(self):
        """Detach the engine log bridge and release everything, then destroy the node."""
        _BridgeAttachment.detach(self._bridge)
        self._release()
        return super().destroy_node()

    # ---- the control tick (control thread) ----------------------------------------------------

    def _control_tick(self) -> None:
        """One control period. Never raises: problems are logged, counted and diagnosed."""
        loop, fleet_loop, control = self._loop, self._fleet_loop, self._control
        if loop is None and fleet_loop is None:
            return   # released while this wake-up was pending
        if control is not None and control.priority_note:
            self._problems.note(WARN, control.priority_note)   # once per activation
            control.priority_note = ''

        try:
            self._apply_pending()
            if fleet_loop is not None:
                fleet_loop.tick(self._now_s())
            else:
                loop.tick(self._now_s(), self._period_s, self._outputs)
        except Exception as err:   # noqa: BLE001 - the control loop must keep its rate
            if not self.context.ok():
                return   # shutting down (Ctrl-C)
            stats = ([r.stats for r in fleet_loop.robots.values()] if fleet_loop is not None
                     else [self._stats])
            for robot_stats in stats:
                robot_stats.record_error(repr(err))
            self._problems.event('tick', ERROR, f'control tick failed: {err!r}')
            self.get_logger().debug(traceback.format_exc())

    # ---- diagnostics --------------------------------------------------------------------------

    def _publish_diagnostics(self) -> None:
        self._cpu_pct = self._cpu.sample() or self._cpu_pct
        try:
            # hardware_id names the device the model runs on (as a driver names its device).
            self._diagnostics_pub.publish(to_diagnostic_array(
                self.diagnostic_statuses(), self.get_clock().now().to_msg(),
                self.hardware_id))
        except Exception as err:   # noqa: BLE001 - diagnostics must not take the node down
            self._problems.event('diagnostics', ERROR, f'diagnostics failed: {err!r}')

    def _loop_snapshot(self, stats: LoopStats) -> dict | None:
        """Return a robot's loop statistics with the control thread's (None unless active)."""
        if self._lifecycle != 'active':
            return None
        snapshot = stats.snapshot()
        control = self._control
        snapshot['wakeups_late'] = control.late if control is not None else 0
        snapshot['wakeups_dropped'] = control.dropped if control is not None else 0
        if self._cpu_pct is not None:
            snapshot['cpu_control_thread_pct'], snapshot['cpu_other_threads_pct'] = (
                self._cpu_pct)
        return snapshot

    def diagnostic_statuses(self):
        """Build the current diagnostic statuses (also what tests inspect).

        One robot: '<node>: model', 'control loop', 'language', 'kv cache', 'inputs'. A fleet:
        '<node>: model' (the shared model and pool), then those five per robot, named
        '<node>/<robot>: <part>'.
        """
        model = dict(self._engine.description) if self._engine is not None else {}
        for key, why in self._param_errors.items():
            model[f'rejected {key}'] = why
        fleet_loop = self._fleet_loop
        if fleet_loop is None:
            loop = self._loop
            inputs = loop.last_inputs if loop is not None else None
            return build_statuses(
                self.diagnostic_name, self._lifecycle, model, self._loop_snapshot(self._stats),
                1.0 / self._period_s, loop.engine_summary() if loop is not None else None,
                inputs.inputs if inputs is not None else [],
                dict(inputs.problems) if inputs is not None else {},
                self._inputs.instruction if self._inputs is not None else None,
                self._config_error)
        statuses = build_statuses(self.diagnostic_name, self._lifecycle, model, None, 0.0,
                                  None, [], {}, None, self._config_error)
        for name, robot in list(fleet_loop.robots.items()):
            io = self._ios.get(name)
            inputs = robot.last_inputs
            spec = io.settings.spec if io else None
            about = {'robot': spec.name if spec else '',
                     'robot_spec': (spec.source or 'inferred') if spec else '',
                     'namespace': io.resolved_namespace if io else '',
                     'kv_quota': self._scheduler(name).pool.num_slots}
            statuses += build_statuses(
                f'{self.diagnostic_name}/{name}', self._lifecycle, about,
                self._loop_snapshot(robot.stats), 1.0 / robot.period_s,
                fleet_loop.engine_summary(name), inputs.inputs if inputs is not None else [],
                dict(inputs.problems) if inputs is not None else {},
                io.inputs.instruction if io is not None else None)
        return statuses

    # ---- helpers ------------------------------------------------------------------------------

    @property
    def diagnostic_name(self) -> str:
        """Prefix of the node's diagnostic names: its full name, so unique per namespace."""
        return self.get_fully_qualified_name().lstrip('/')

    @property
    def hardware_id(self) -> str:
        """The /diagnostics hardware_id: the torch device the model runs on."""
        return self._value('device')

    @property
    def lifecycle_state(self) -> str:
        """'unconfigured', 'configuring', 'inactive', 'active' or 'finalized'."""
        return self._lifecycle

    @property
    def engine(self):
        """Engine instance, None unless configured; used only from the control thread."""
        return self._engine

    @property
    def robots(self) -> dict[str, RobotIO]:
        """The configured robots' topics by name ('' for the one robot of a plain node)."""
        return dict(self._ios)

    @property
    def fleet_loop(self) -> FleetLoop | None:
        """The loop over several robots (None for one robot or unless configured)."""
        return self._fleet_loop

    @property
    def _subscriptions_made(self) -> list:
        """Every subscription of every robot (tests read their topic names)."""
        return [sub for io in self._ios.values() for sub in io.subscriptions]

    @property
    def control_thread(self) -> ControlThread | None:
        """The running control thread (None unless active)."""
        return self._control

    @property
    def problem_history(self):
        """(level, message) of everything the problem log wrote (newest last)."""
        return list(self._problems.history)

    def _now_s(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    def _log(self, level: int, message: str) -> None:
        # One call site per severity: rclpy refuses a call site whose severity changes.
        if level == OK:
            self.get_logger().info(message)
        elif level == WARN:
            self.get_logger().warning(message)
        else:
            self.get_logger().error(message)


def _period_of(rate_hz: float) -> float:
    """Return the period of a rate (0, auto: unknown until configure has timed it)."""
    return 1.0 / rate_hz if rate_hz else math.inf


def make_executor(context=None) -> SingleThreadedExecutor:
    """Return the executor oxygen_node runs in: single-threaded, I/O only (module docstring)."""
    return SingleThreadedExecutor(context=context)


DISCOVERY_VARIABLES = ('ROS_AUTOMATIC_DISCOVERY_RANGE', 'ROS_LOCALHOST_ONLY', 'ROS_STATIC_PEERS')


def default_discovery_to_localhost(environ=os.environ) -> str:
    """Keep DDS discovery on this machine unless the environment chose otherwise.

    ROS's own default is the whole subnet (domain 0): any peer there could replace the task,
    feed cameras or reconfigure the node. A robot that must be reached from other machines
    says so with ROS_AUTOMATIC_DISCOVERY_RANGE=SUBNET (README, "DDS and security"). Returns
    what was decided, for the startup log. Must run before rclpy.init().
    """
    chosen = {k: environ[k] for k in DISCOVERY_VARIABLES if environ.get(k)}
    if chosen:
        return ', '.join(f'{k}={v}' for k, v in chosen.items()) + ' (from the environment)'
    if environ.get('ROS_DISTRO') == 'humble':   # predates ROS_AUTOMATIC_DISCOVERY_RANGE
        environ['ROS_LOCALHOST_ONLY'] = '1'
        return 'ROS_LOCALHOST_ONLY=1 (oxygen_node default)'
    environ['ROS_AUTOMATIC_DISCOVERY_RANGE'] = 'LOCALHOST'
    return 'ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST (oxygen_node default)'


def main(args=None, *, fast_exit: bool = True, engine_builder=None) -> int:
    """Run oxygen_node until Ctrl-C (console script and `ros2 run oxygen_ros oxygen_node`).

    fast_exit: once the node and the ROS context are released, end the process at once. The
    interpreter's own teardown of torch takes over a second (measured 1.2 s here) and has
    nothing left to release; without it Ctrl-C ends the node well within a second.
    engine_builder: passed to OxygenNode (the soak's fault injection).
    """
    discovery = default_discovery_to_localhost()
    rclpy.init(args=args)
    node = None
    code = 0
    executor = make_executor()
    try:
        node = OxygenNode(engine_builder=engine_builder)
        node.get_logger().info(f'DDS discovery: {discovery}, ROS_DOMAIN_ID='
                               f'{os.environ.get("ROS_DOMAIN_ID", "0 (default)")}')
        executor.add_node(node)
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    except Exception:   # noqa: BLE001 - decided below
        if rclpy.ok():
            code = 1
            traceback.print_exc()
        # else: Ctrl-C shut the context down under the executor while it took a message
        # (rclpy raises from take_message then); that is a normal shutdown.
    finally:
        try:
            if node is not None:
                node.destroy_node()
            executor.shutdown()
            if rclpy.ok():
                rclpy.shutdown()
            context = rclpy.get_default_context()
            if hasattr(context, 'destroy'):   # leave the DDS graph now (rclpy 4+)
                context.destroy()
        except KeyboardInterrupt:
            pass   # a second Ctrl-C: the user wants out now
    if fast_exit:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == '__main__':
    raise SystemExit(main())
