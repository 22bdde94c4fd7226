"""`oxygen_node`: a thin lifecycle adapter over the runtime's frame loop.

Cameras, joint states and an instruction in; an action chunk every tick, and language tokens
on their own topic, out. The work of a tick is oxygen_ros.runtime.frame_loop.FrameLoop, the
same code the bag replay runs; this module only wires it to rclpy.

Two threads:
  executor        a SingleThreadedExecutor serving I/O only (main()): the instruction
                  subscription, lifecycle and parameter services, 1 Hz /diagnostics, and the
                  control timer, whose callback only wakes the control thread. Cameras and
                  joint states never reach it: the control thread takes their newest message
                  at the start of each tick (ros/polling.py). No callback runs for long, so
                  the executor sleeps in rcl_wait instead of spinning against the model for
                  the GIL (a MultiThreadedExecutor next to a long callback does: measured 2.2x
                  slower inference).
  control thread  'oxy_control' (runtime.control.ControlThread): one FrameLoop.tick per
                  wake-up: observation -> act -> publish ActionChunk -> language -> publish
                  LanguageChunks / narration. The engine is touched by this thread only.

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

import copy
import dataclasses
import gc
import logging
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
from rclpy.qos_overriding_options import QoSOverridingOptions
from rcl_interfaces.msg import (FloatingPointRange, IntegerRange, ParameterDescriptor,
                                SetParametersResult)

from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray
from sensor_msgs.msg import CameraInfo, CompressedImage, Image, JointState
from std_msgs.msg import String

from oxygen_ros.engine import AdaptiveBudget, FixedBudget
from oxygen_ros.msg import ActionChunk, LanguageChunk
from oxygen_ros.ros import qos
from oxygen_ros.ros.conversions import (action_chunk_msg, joint_trajectory_msg,
                                        language_chunk_msg)
from oxygen_ros.ros.diagnostics import to_diagnostic_array
from oxygen_ros.ros.polling import never_called, PolledGroup, take_all
from oxygen_ros.runtime.actions import action_layout, ActionLayout
from oxygen_ros.runtime.control import ControlThread, CpuSplit
from oxygen_ros.runtime.conversions import (check_frame_size, compressed_to_rgb, image_to_rgb,
                                            InputError, joint_state_to_vector)
from oxygen_ros.runtime.frame_loop import FrameLoop
from oxygen_ros.runtime.inputs import InputSet, InputSource, sanitize_instruction
from oxygen_ros.runtime.params import (camera_param_specs, check_value, deprecation_warning,
                                       NODE_NAME, param_spec, PARAMS, PARAMS_BY_NAME,
                                       parse_decode_budget, ROBOT_IO, robot_defaults,
                                       RUNTIME_PARAMS, SAFETY_LIMITS, Settings)
from oxygen_ros.runtime.status import build_statuses, ERROR, LoopStats, OK, ProblemLog, WARN

try:   # Jazzy+ names the event classes event_handler; Humble only has qos_event.
    from rclpy.event_handler import SubscriptionEventCallbacks
except ImportError:   # pragma: no cover - Humble
    from rclpy.qos_event import SubscriptionEventCallbacks
try:
    from rclpy.executors import ExternalShutdownException
except ImportError:   # pragma: no cover - older rclpy raise KeyboardInterrupt only
    ExternalShutdownException = KeyboardInterrupt

JOINT_STATES_KEY = 'joint_states'
STOP_TIMEOUT_S = 5.0   # deactivate waits this long for a running tick before giving up on it


def _descriptor(spec) -> ParameterDescriptor:
    # A parameter with a legacy form (decode_budget's old string) takes either type.
    desc = ParameterDescriptor(description=spec.description, read_only=spec.read_only,
                               dynamic_typing=spec.legacy is not None)
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


def _overridable(profile):
    """Copy a shared QoS profile: QoS overriding options write into the profile given."""
    return copy.copy(profile)


def ns_to_stamp(stamp_ns: int) -> Time:
    """Integer nanoseconds -> builtin_interfaces/Time, exact."""
    stamp_ns = max(int(stamp_ns), 0)
    return Time(sec=stamp_ns // 1_000_000_000, nanosec=stamp_ns % 1_000_000_000)


class RosOutputs:
    """The frame loop's OutputSink over the node's publishers, behind an open/closed switch.

    close() returns only after a publish in flight has finished, and nothing is published
    after it: that is what makes "no ActionChunk after deactivate returned" hold even for a
    tick that is still running.
    """

    def __init__(self, node: LifecycleNode, frame_id: str, layout: ActionLayout,
                 trajectory: bool = False):
        self.frame_id = frame_id
        self.layout = layout
        self._lock = threading.Lock()
        self._open = False
        self._node = node
        self._actions = node.create_publisher(ActionChunk, 'actions', qos.ACTIONS)
        self._tokens = node.create_publisher(LanguageChunk, 'language/tokens', qos.TOKENS)
        self._narration = node.create_publisher(String, 'language/narration', qos.NARRATION)
        self._trajectory = None
        if trajectory:
            from trajectory_msgs.msg import JointTrajectory

            self._trajectory = node.create_publisher(JointTrajectory, 'joint_trajectory',
                                                     qos.TRAJECTORY)

    def open(self) -> None:
        with self._lock:
            self._open = True

    def close(self) -> None:
        with self._lock:
            self._open = False

    def destroy(self) -> None:
        self.close()
        for pub in (self._actions, self._tokens, self._narration, self._trajectory):
            if pub is not None:
                self._node.destroy_publisher(pub)

    def _publish(self, publisher, msg) -> None:
        with self._lock:
            if self._open:
                publisher.publish(msg)

    def action(self, action, stamp_ns: int) -> None:
        self._publish(self._actions, action_chunk_msg(action, ns_to_stamp(stamp_ns),
                                                      self.frame_id, self.layout))
        if self._trajectory is not None:
            self._publish(self._trajectory,
                          joint_trajectory_msg(action, self.frame_id, self.layout))

    def tokens(self, delta, stamp_ns: int) -> None:
        self._publish(self._tokens, language_chunk_msg(delta, ns_to_stamp(stamp_ns),
                                                       self.frame_id))

    def narration(self, request, stamp_ns: int) -> None:
        self._publish(self._narration, String(data=request.text))


class OxygenNode(LifecycleNode):
    """Lifecycle node running the π0.5 engine at a fixed control rate."""

    def __init__(self, node_name: str = NODE_NAME, **kwargs):
        super().__init__(node_name, **kwargs)
        self._lifecycle = 'unconfigured'
        self._config_error = ''
        self._declaring = False
        self._param_errors: dict[str, str] = {}   # startup overrides that were rejected
        self._problems = ProblemLog(self._log)
        self._stats = LoopStats()
        self._engine = None
        self._settings: Settings | None = None
        self._inputs: InputSet | None = None
        self._loop: FrameLoop | None = None
        self._outputs: RosOutputs | None = None
        self._control: ControlThread | None = None
        self._wake_timer = None
        self._pending: dict = {}                    # engine changes for the next tick
        self._pending_lock = threading.Lock()
        self._subscriptions_made: list = []
        self._cpu = CpuSplit()
        self._cpu_pct: tuple[float, float] | None = None   # (control, other) % of one core

        self.add_on_set_parameters_callback(self._on_set_parameters)
        self._declare_parameters()
        self._period_s = 1.0 / self._value('control_rate_hz')
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
        # Camera and joint defaults follow the robot given at startup.
        defaults = robot_defaults(robot if robot in ROBOT_IO else 'libero')
        for spec in PARAMS:
            if spec.name != 'robot':
                self._declare(spec, defaults.get(spec.name, spec.default))
        self._declare_camera_params(self._value('camera_names'))
        self._declaring = False

    def _declare_camera_params(self, cameras) -> None:
        """Declare cameras.<name>.* for every camera not declared yet (new names included)."""
        declaring, self._declaring = self._declaring, True
        try:
            for camera in cameras:
                for spec in camera_param_specs(camera):
                    if not self.has_parameter(spec.name):
                        self._declare(spec)
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
        for param in params:
            spec = param_spec(param.name)
            if param.name == 'use_sim_time' and active and not self._declaring:
                # Switching clocks mid-run makes every input look stale or fresh at random.
                reasons.append('use_sim_time: can only change while not active (deactivate '
                               'first)')
                continue
            if spec is None:
                continue
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
            elif (active and param.name in SAFETY_LIMITS and not self._declaring
                  and not self._value('allow_unsafe_changes')
                  and param.value > self._value(param.name)):
                reasons.append(f'{param.name}: raising it while active loosens a safety limit '
                               f'({self._value(param.name):g} -> {param.value:g}); deactivate '
                               'first, or start the node with allow_unsafe_changes:=true')
        changes = {p.name: p.value for p in params if p.name in RUNTIME_PARAMS}
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

    def _check_fits(self, changes: dict) -> str:
        """Reject a budget / request-rate change the KV pool cannot hold (reason or '')."""
        if not {'decode_budget', 'request_every_n_frames'} & changes.keys():
            return ''
        from oxygen_ros.runtime.engine_setup import slots_needed

        s = self._settings
        every = changes.get('request_every_n_frames', self._value('request_every_n_frames'))
        k = parse_decode_budget(changes.get('decode_budget', self._value('decode_budget')))
        old_k = parse_decode_budget(self._value('decode_budget'))
        need = slots_needed(every, s.tokens_per_request, k)
        before = slots_needed(self._value('request_every_n_frames'), s.tokens_per_request, old_k)
        slots = self._engine.system.pool.num_slots
        if need > slots and need > before:
            return (f'decode_budget={k or "adaptive"} with request_every_n_frames={every} needs '
                    f'{need} KV slots (ceil(N/k) + 1) but the pool has {slots}: raise '
                    'kv_capacity and reconfigure, or choose a larger k')
        return ''

    def _apply_runtime(self, changes: dict) -> None:
        if 'control_rate_hz' in changes:
            self._period_s = 1.0 / changes['control_rate_hz']
            if self._wake_timer is not None:   # active: the new period starts now
                self._start_wake_timer()
        if 'stale_frame_timeout_s' in changes:
            self._stale_timeout_s = changes['stale_frame_timeout_s']
            if self._inputs is not None:
                self._inputs.stale_timeout_s = self._stale_timeout_s
        if 'max_instruction_chars' in changes:
            self._max_instruction_chars = changes['max_instruction_chars']
        if 'diagnostics_period_s' in changes:
            self._start_diagnostics_timer(changes['diagnostics_period_s'])
        if self._settings is not None:
            fields = {k: v for k, v in changes.items() if k != 'decode_budget'}
            if 'decode_budget' in changes:
                fields['decode_budget'] = parse_decode_budget(changes['decode_budget'])
            self._settings = dataclasses.replace(self._settings, **fields)
        with self._pending_lock:   # the engine is touched only by the control thread
            self._pending.update(changes)
        self.get_logger().info('parameters changed: ' + ', '.join(
            f'{k}={v}' for k, v in changes.items()))

    def _apply_pending(self) -> None:
        """Apply runtime parameter changes to the engine (control thread, between ticks)."""
        with self._pending_lock:
            changes, self._pending = self._pending, {}
        if not changes or self._engine is None:
            return
        system = self._engine.system
        if 'request_every_n_frames' in changes:
            system.set_policy(dataclasses.replace(
                system.policy, every_n_frames=changes['request_every_n_frames']))
        if 'decode_budget' in changes:
            k = parse_decode_budget(changes['decode_budget'])
            system.set_budget(FixedBudget(k) if k else AdaptiveBudget(
                self._period_s, k_max=system.policy.max_request_len))
        elif 'control_rate_hz' in changes and isinstance(system.budget, AdaptiveBudget):
            system.budget.frame_period_s = self._period_s

    # ---- lifecycle --------------------------------------------------------------------------

    def _autostart(self) -> None:
        self.destroy_timer(self._autostart_timer)
        self._autostart_timer = None
        if self.trigger_configure() == TransitionCallbackReturn.SUCCESS:
            self.trigger_activate()

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._lifecycle = 'configuring'
        self.get_logger().info('configuring: loading the model')
        self._publish_diagnostics()   # the executor is busy while the model loads: say so
        started = time.monotonic()
        try:
            if self._param_errors:
                raise ValueError('parameters rejected at startup: ' + '; '.join(
                    f'{k}: {v}' for k, v in self._param_errors.items()))
            self._declare_camera_params(self._value('camera_names'))   # names set since
            values = {spec.name: self._value(spec.name) for spec in PARAMS}
            for camera in values['camera_names']:
                values.update({spec.name: self._value(spec.name)
                               for spec in camera_param_specs(camera)})
            settings = Settings.from_values(values)
            from oxygen_ros.runtime.engine_setup import build_engine   # torch: load lazily

            engine = build_engine(settings)
            self._period_s = settings.period_s
            self._stale_timeout_s = settings.stale_frame_timeout_s
            self._max_instruction_chars = settings.max_instruction_chars
            self._outputs = RosOutputs(self, settings.frame_id, action_layout(settings.robot),
                                       settings.publish_trajectory)
            self._inputs = self._make_subscriptions(settings)
        except Exception as err:   # noqa: BLE001 - any failure is a FAILURE transition
            self._config_error = f'configure failed: {err}'
            self._problems.note(ERROR, self._config_error)
            self.get_logger().debug(traceback.format_exc())
            self._release()
            self._lifecycle = 'unconfigured'
            return TransitionCallbackReturn.FAILURE
        self._settings, self._engine, self._config_error = settings, engine, ''
        self._stats = LoopStats()
        self._loop = FrameLoop(engine.system, self._inputs, problems=self._problems,
                               stats=self._stats)
        with self._pending_lock:
            self._pending = {}   # the engine was just built from the current values
        for warning in engine.warnings:
            self.get_logger().warning(warning)
        pool = engine.system.pool
        self.get_logger().info(
            f'configured in {time.monotonic() - started:.1f} s: '
            f'{engine.description["source"]}, robot {settings.robot}, '
            f'{len(settings.cameras)} cameras, KV pool {pool.num_slots} slots '
            f'({pool.total_bytes / (1 << 20):.1f} MiB), {settings.control_rate_hz:g} Hz, '
            f'decode budget {settings.decode_budget or "adaptive"}, '
            f'{engine.description.get("torch_threads", "?")} torch threads')
        self._lifecycle = 'inactive'
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        # The model's objects live as long as the engine: move them out of the collector's
        # reach, so a full collection during a tick walks only what the loop itself makes.
        gc.collect()
        gc.freeze()
        self._stats.reset()
        self._inputs.started_s = self._now_s()
        self._outputs.open()
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
        if self._outputs is not None:
            self._outputs.close()   # from here on nothing is published, whatever still runs
        if self._control is not None:
            if not self._control.stop(STOP_TIMEOUT_S):
                self._problems.note(ERROR, f'a control tick did not finish within '
                                           f'{STOP_TIMEOUT_S:g} s of deactivate')
            self._control = None

    def _release(self) -> None:
        """Drop timer, thread, subscriptions, publishers and the engine (frees model and KV)."""
        self._stop_control()
        for sub in self._subscriptions_made:
            self.destroy_subscription(sub)
        self._subscriptions_made = []
        if self._outputs is not None:
            self._outputs.destroy()
        self._outputs = self._inputs = self._loop = None
        self._engine = self._settings = None

    def destroy_node(self):
        """Detach the engine log bridge and release everything, then destroy the node."""
        _BridgeAttachment.detach(self._bridge)
        self._release()
        return super().destroy_node()

    # ---- wiring -------------------------------------------------------------------------------

    def _make_subscriptions(self, settings: Settings) -> InputSet:
        # Cameras and joint states are polled: the control thread takes their messages at the
        # start of a tick (ros/polling.py says why); only the instruction is a callback.
        # Each subscription's QoS can be overridden with parameters (qos_overrides.<topic>.
        # subscription[_<id>].<policy>, read-only, given at startup), as rclcpp nodes allow.
        polled_group = PolledGroup()
        polled = []   # (buffer key, subscription)
        cameras = []
        infos = {}    # camera name -> buffer key of its camera_info
        for cam in settings.cameras:
            key = f'camera:{cam.name}'
            sub = self.create_subscription(
                CompressedImage if cam.compressed else Image, cam.image_topic, never_called,
                _overridable(qos.SENSOR), callback_group=polled_group,
                qos_overriding_options=QoSOverridingOptions.with_default_policies())
            polled.append((key, sub))
            if cam.check_camera_info:
                infos[cam.name] = f'camera_info:{cam.name}'
                info_sub = self.create_subscription(
                    CameraInfo, cam.info_topic, never_called, qos.SENSOR,
                    callback_group=polled_group)
                polled.append((infos[cam.name], info_sub))
            cameras.append((cam.name, InputSource(
                key, f'camera {cam.name!r} ({sub.topic_name})',
                self._image_converter(cam.compressed, infos.get(cam.name)))))
        joints = settings.joint_names
        # Deeper than the cameras': every JointState since the last tick is merged per joint
        # name (arm and gripper often publish separately), so none may be overwritten.
        sub = self.create_subscription(
            JointState, 'joint_states', never_called, _overridable(qos.JOINT_STATES),
            callback_group=polled_group,
            qos_overriding_options=QoSOverridingOptions.with_default_policies())
        polled.append((JOINT_STATES_KEY, sub))
        joint_source = InputSource(JOINT_STATES_KEY, f'joint_states ({sub.topic_name})',
                                   lambda m: joint_state_to_vector(m.name, m.position, joints))
        self._subscriptions_made.extend(sub for _, sub in polled)
        inputs = InputSet(cameras, joint_source, settings.stale_frame_timeout_s,
                          joint_names=joints)
        # The instruction, twice: a latched publisher (transient local, the task as state) and
        # a plain one (`ros2 topic pub`: reliable + volatile) each match one of these; the
        # newest message of either wins. A transient-local publisher reaches both, so the same
        # text may arrive twice: it changes nothing the second time.
        # A volatile publisher is incompatible with the latched subscription by design: that
        # event is ignored (rclpy would log it); the volatile one reports real mismatches.
        ignore = SubscriptionEventCallbacks(incompatible_qos=lambda event: None)
        events = SubscriptionEventCallbacks(incompatible_qos=self._on_instruction_qos)
        for entity_id, profile, event_callbacks in (
                ('latched', qos.INSTRUCTION, ignore),
                ('volatile', qos.INSTRUCTION_VOLATILE, events)):
            # Bound to `inputs`: a latched message can arrive before configure returns.
            sub = self.create_subscription(
                String, 'instruction', lambda msg: self._on_instruction(msg, inputs),
                _overridable(profile),
                event_callbacks=event_callbacks,
                qos_overriding_options=QoSOverridingOptions.with_default_policies(
                    entity_id=entity_id))
            self._subscriptions_made.append(sub)
            inputs.instruction_topic = sub.topic_name   # as remapped

        def take_polled(now_s: float) -> None:
            for key, polled_sub in polled:
                for msg, age_s in take_all(polled_sub):
                    inputs.put(key, msg, now_s - age_s)

        inputs.pull = take_polled
        return inputs

    def _image_converter(self, compressed: bool, info_key: str | None):
        """Message -> RGB for one camera; with info_key, also check the size from camera_info."""
        def convert(msg):
            if compressed:
                rgb = compressed_to_rgb(msg.format, msg.data)
            else:
                rgb = image_to_rgb(msg.encoding, msg.height, msg.width, msg.step, msg.data,
                                   msg.is_bigendian)
            if info_key is not None:
                entry = self._inputs.buffer.get(info_key) if self._inputs is not None else None
                if entry is None:
                    raise InputError('no camera_info received yet (check_camera_info is on)')
                check_frame_size(rgb, entry.msg.width, entry.msg.height)
            return rgb
        return convert

    def _on_instruction(self, msg: String, inputs: InputSet) -> None:
        instruction = sanitize_instruction(msg.data, self._max_instruction_chars)
        if inputs.instruction == instruction:
            return   # the same task again (both subscriptions get a latched publisher's)
        inputs.set_instruction(instruction)
        if not instruction.text:
            self._problems.note(WARN, 'instruction is empty: no task, so no actions until a '
                                      'non-empty instruction arrives (running language '
                                      'requests continue)')
        else:
            shown = instruction.text if len(instruction.text) <= 120 else (
                instruction.text[:117] + '...')
            self._problems.note(OK, f'instruction: "{shown}"')
        if instruction.notes:
            self._problems.note(WARN, 'instruction ' + ', '.join(instruction.notes))

    def _on_instruction_qos(self, event) -> None:
        self._problems.event('instruction_qos', WARN, (
            'an instruction publisher has incompatible QoS: the node takes reliable '
            'publishers, volatile or transient local; publish reliable (the `ros2 topic pub` '
            'default)'))

    # ---- the control tick (control thread) ----------------------------------------------------

    def _control_tick(self) -> None:
        """One control period. Never raises: problems are logged, counted and diagnosed."""
        loop, outputs, control = self._loop, self._outputs, self._control
        if loop is None or outputs is None:
            return   # released while this wake-up was pending
        if control is not None and control.priority_note:
            self._problems.note(WARN, control.priority_note)   # once per activation
            control.priority_note = ''

        try:
            self._apply_pending()
            loop.tick(self._now_s(), self._period_s, outputs)
        except Exception as err:   # noqa: BLE001 - the control loop must keep its rate
            if not self.context.ok():
                return   # shutting down (Ctrl-C)
            self._stats.record_error(repr(err))
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

    def diagnostic_statuses(self):
        """Build the current diagnostic statuses (also what tests inspect)."""
        model = dict(self._engine.description) if self._engine is not None else {}
        for key, why in self._param_errors.items():
            model[f'rejected {key}'] = why
        active = self._lifecycle == 'active'
        loop = self._loop
        inputs = loop.last_inputs if loop is not None else None
        instruction = self._inputs.instruction if self._inputs is not None else None
        snapshot = None
        if active:
            snapshot = self._stats.snapshot()
            control = self._control
            snapshot['wakeups_late'] = control.late if control is not None else 0
            snapshot['wakeups_dropped'] = control.dropped if control is not None else 0
        if self._cpu_pct is not None and snapshot is not None:
            snapshot['cpu_control_thread_pct'], snapshot['cpu_other_threads_pct'] = (
                self._cpu_pct)
        return build_statuses(
            self.diagnostic_name, self._lifecycle, model, snapshot, 1.0 / self._period_s,
            loop.engine_summary() if loop is not None else None,
            inputs.inputs if inputs is not None else [],
            dict(inputs.problems) if inputs is not None else {}, instruction,
            self._config_error)

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


def main(args=None, *, fast_exit: bool = True) -> int:
    """Run oxygen_node until Ctrl-C (console script and `ros2 run oxygen_ros oxygen_node`).

    fast_exit: once the node and the ROS context are released, end the process at once. The
    interpreter's own teardown of torch takes over a second (measured 1.2 s here) and has
    nothing left to release; without it Ctrl-C ends the node well within a second.
    """
    discovery = default_discovery_to_localhost()
    rclpy.init(args=args)
    node = None
    code = 0
    executor = make_executor()
    try:
        node = OxygenNode()
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
