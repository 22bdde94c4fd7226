"""`oxygen_node`: a thin lifecycle adapter over the runtime's frame loop.

Cameras, joint states and an instruction in; an action chunk every tick, and language tokens on
their own topic, out. The work of a tick is oxygen_ros.runtime.frame_loop.FrameLoop, the same code
the bag replay runs. One robot or several (parameter `robots`), one path: a plain node serves a
fleet of one (the robot '', its topics in the node's namespace); a fleet's robots each have their
topics in their namespace (`arm_left/actions`), their own parameters (`arm_left.decode_budget`),
rate, budget, KV quota and diagnostics, one model serving all. Jobs: ros/parameters.py (declare,
validate on set, apply after set), ros/robot_io.py (one robot's topics), ros/ask_service.py
(questions), ros/auto_rate.py (an auto rate re-timed on the first ticks), ros/wake_timer.py,
ros/diagnostics.py, ros/log_bridge.py, ros/dds.py (discovery, executor, spin); this file holds
the lifecycle and the tick.

Two threads:
  executor        a SingleThreadedExecutor serving I/O only: the instruction subscriptions,
                  lifecycle and parameter services, /diagnostics, `ask` (a coroutine that
                  awaits its answer without running), and the wake timer, whose callback only
                  wakes the control thread. Cameras and joint states are polled by the control
                  thread (ros/polling.py). No callback runs for long, so the executor sleeps
                  in rcl_wait instead of spinning against the model for the GIL (a
                  MultiThreadedExecutor next to a long callback: 2.2x slower inference).
  control thread  'oxy_control' (runtime.control.ControlThread): one FrameLoop.tick per
                  wake-up; the engine is touched by this thread only. The timer wakes it at
                  the robots' own ticks (FrameLoop.next_wake_s: 10 and 15 Hz robots, 25 a
                  second; never a finer common grid).

Lifecycle: configure loads the model and wires topics; activate starts the thread and the timer;
deactivate stops the timer, closes the outputs (nothing is published once it returns, even by a
tick still running) and joins the thread. A thread still in a tick STOP_TIMEOUT_S later is kept,
and activate is refused with the reason until it has ended (never two threads on one engine).
Cleanup releases everything.

Time: the wake timer, stamps and staleness use the node clock (use_sim_time follows /clock),
diagnostics and autostart a steady clock. An ActionChunk is stamped with its observation's (first
camera's) stamp, a LanguageChunk with its tick's (the node clock without a frame).
"""

from __future__ import annotations

import gc
import threading
import time
import traceback
from typing import Callable

from rclpy.clock import Clock, ClockType
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn

from oxygen_ros.ros.dds import (default_discovery_to_localhost, make_executor,  # noqa: F401
                                run_node)
from oxygen_ros.ros.ask_service import AskService
from oxygen_ros.ros.auto_rate import AutoRate
from oxygen_ros.ros.diagnostics import configured_summary, NodeDiagnostics
from oxygen_ros.ros.log_bridge import BridgeAttachment, EngineLogBridge, log_at
from oxygen_ros.ros.parameters import NodeParameters, Served
from oxygen_ros.ros.robot_io import RobotIO
from oxygen_ros.ros.wake_timer import WakeTimer
from oxygen_ros.runtime.changes import apply_to_engine, gather_s, with_change
from oxygen_ros.runtime.control import ControlThread
from oxygen_ros.runtime.frame_loop import FrameLoop, RobotLoop
from oxygen_ros.runtime.params import FleetSettings, NODE_NAME, Settings, split_param_name
from oxygen_ros.runtime.rtc import planner_for
from oxygen_ros.runtime.status import ERROR, ProblemLog, WARN

STOP_TIMEOUT_S = 5.0   # deactivate waits this long for a running tick before giving up on it


class OxygenNode(LifecycleNode):
    """Lifecycle node running the π0.5 engine at its robots' control rates.

    engine_builder(FleetSettings) -> runtime.engine_setup.Engine builds the engine at
    configure (None: engine_setup.build_fleet; the soak passes one that injects faults).
    """

    def __init__(self, node_name: str = NODE_NAME, *,
                 engine_builder: Callable[[FleetSettings], object] | None = None, **kwargs):
        super().__init__(node_name, **kwargs)
        self._engine_builder = engine_builder
        self._lifecycle = 'unconfigured'
        self._config_error = ''
        self._problems = ProblemLog(lambda level, text: log_at(self.get_logger(), level, text))
        self._engine = None
        self._settings: FleetSettings | None = None   # the robots served, rates resolved
        self._ios: dict[str, RobotIO] = {}            # robot name ('' for one) -> its topics
        self._loop: FrameLoop | None = None
        self._control: ControlThread | None = None
        self._stuck: ControlThread | None = None      # a thread that outlived deactivate
        self._wake = WakeTimer(self, self._now_s)
        self._auto_rate = AutoRate(self.get_logger())  # re-times an auto rate (first ticks)
        self._pending: dict = {}                      # engine changes for the next tick
        self._pending_lock = threading.Lock()
        self._params = NodeParameters(self, self._problems, self._served, self._apply_changes)
        self._params.declare_all()
        self._max_instruction_chars = self._params.value('max_instruction_chars')
        self._bridge = EngineLogBridge(self._problems, self.get_logger().info)
        BridgeAttachment.attach(self._bridge)
        self._diagnostics = NodeDiagnostics(self, self._problems,
                                            self._params.value('diagnostics_period_s'))
        self._ask = AskService(self, lambda: self._loop, lambda: self._lifecycle)
        self._autostart_timer = None
        if self._params.value('autostart'):
            # A timer, not a call: configure runs inside the executor once it spins.
            self._autostart_timer = self.create_timer(
                0.01, self._autostart, clock=Clock(clock_type=ClockType.STEADY_TIME))

    def _served(self) -> Served:
        engine = self._engine
        slots = ({name: engine.system.scheduler(name).pool.num_slots for name in self._ios}
                 if engine is not None else None)
        return Served(self._lifecycle, self._settings, slots)

    def _apply_changes(self, changes: dict) -> None:
        """Apply accepted runtime changes (post-set): the executor's here, the engine's later.

        The engine's changes wait for the control thread, before its next tick.
        """
        capacity = self._engine.capacity if self._engine is not None else None
        # The engine is touched only by the control thread, which re-times an auto rate too.
        with self._pending_lock:
            for name, value in changes.items():
                robot, base = split_param_name(name)
                if base == 'max_instruction_chars':
                    self._max_instruction_chars = value
                    self._ask.set_max_chars(value)
                elif base == 'diagnostics_period_s':
                    self._diagnostics.start(value)
                elif base == 'stale_frame_timeout_s' and robot in self._ios:
                    self._ios[robot].inputs.stale_timeout_s = value
                elif base == 'control_rate_hz':
                    self._auto_rate.cancel()   # a rate set by hand (or auto again) is kept
                settings = self._settings
                if settings is not None and (not robot or robot in settings.robots):
                    self._settings = with_change(settings, name, value, capacity)
                    if base == 'control_rate_hz' and capacity is not None and robot in self._ios:
                        self._problems.note(*capacity.note(
                            self._settings.robots[robot].control_rate_hz))
            self._pending.update(changes)
        self.get_logger().info('parameters changed: ' + ', '.join(
            f'{k}={v}' for k, v in changes.items()))

    # ---- lifecycle --------------------------------------------------------------------------

    def _autostart(self) -> None:
        self.destroy_timer(self._autostart_timer)
        self._autostart_timer = None
        if self.trigger_configure() == TransitionCallbackReturn.SUCCESS:
            self.trigger_activate()

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._lifecycle = 'configuring'
        self.get_logger().info('configuring: loading the model')
        self._diagnostics.publish()   # the executor is busy while the model loads: say so
        started = time.monotonic()
        try:
            if self._params.errors:
                raise ValueError('parameters rejected at startup: ' + '; '.join(
                    f'{k}: {v}' for k, v in self._params.errors.items()))
            engine = self._configure(self._params.configure_values())
        except Exception as err:   # noqa: BLE001 - any failure is a FAILURE transition
            self._config_error = f'configure failed: {err}'
            self._problems.note(ERROR, self._config_error)
            self.get_logger().debug(traceback.format_exc())
            self._release()
            self._lifecycle = 'unconfigured'
            return TransitionCallbackReturn.FAILURE
        self._engine, self._config_error = engine, ''
        settings = self._settings
        self._max_instruction_chars = settings.node.max_instruction_chars
        with self._pending_lock:
            self._pending = {}   # the engine was just built from the current values
        for warning in engine.warnings:
            self.get_logger().warning(warning)
        self.get_logger().info(f'configured in {time.monotonic() - started:.1f} s: '
                               f'{configured_summary(engine, settings)}')
        if engine.capacity is not None:
            self._problems.note(*engine.capacity.note(max(
                s.control_rate_hz for s in settings.robots.values())))
        self._auto_rate.start(engine, settings)
        self._lifecycle = 'inactive'
        return TransitionCallbackReturn.SUCCESS

    def _configure(self, values: dict):
        """Build the engine, each robot's topics (in its namespace) and the frame loop."""
        fleet = (FleetSettings.from_values(values) if values['robots']
                 else FleetSettings.one(Settings.from_values(values)))
        builder = self._engine_builder
        if builder is None:
            from oxygen_ros.runtime.engine_setup import build_fleet   # torch: load lazily
            builder = build_fleet
        engine = builder(fleet)
        self._settings = settings = engine.settings   # the control rates resolved
        loops = []
        for name, robot in settings.robots.items():
            problems = self._problems if not name else ProblemLog(
                lambda level, message, name=name: self._problems.note(level, f'{name}: {message}'))
            io = self._ios[name] = RobotIO(self, robot, problems,
                                           lambda: self._max_instruction_chars, namespace=name)
            loops.append(RobotLoop(name, io.inputs, io.outputs, robot.period_s, problems,
                                   rtc=planner_for(robot)))
        self._loop = FrameLoop(engine.system, loops, gather_s=gather_s(settings))
        return engine

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        stuck = self._stuck
        if stuck is not None and stuck.alive:
            # A second thread would run the engine beside the first one.
            self._problems.note(ERROR, (
                f'activate refused: the control thread of the last activation is still in a '
                f'tick (it did not finish within {STOP_TIMEOUT_S:g} s of deactivate); '
                'activate again once it has ended'))
            return TransitionCallbackReturn.FAILURE
        self._stuck = None
        # The model's objects live as long as the engine: move them out of the collector's
        # reach, so a full collection during a tick walks only what the loop itself makes.
        gc.collect()
        gc.freeze()
        now_s = self._now_s()
        for io in self._ios.values():
            io.inputs.started_s = now_s
            io.outputs.open()
        loop = self._loop
        for robot in loop.robots.values():
            robot.stats.reset()
        first_s = min(robot.period_s for robot in loop.robots.values())
        loop.restart(now_s + first_s)   # a fresh grid: every robot's tick 0 at the first wake
        self._ask.open(self._max_instruction_chars)
        node = self._settings.node
        self._control = ControlThread(self._control_tick, nice=node.control_nice,
                                      realtime_priority=node.control_priority)
        self._control.start()
        self._wake.start(first_s, self._on_wake)
        self._lifecycle = 'active'
        self.get_logger().info('active: control loop at ' + ', '.join(
            f'{name} {1.0 / robot.period_s:g} Hz'.strip() for name, robot in loop.robots.items()))
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

    def _stop_control(self) -> None:
        """Stop waking the loop, close the outputs, then let a running tick finish."""
        self._wake.stop()
        for io in self._ios.values():
            io.outputs.close()   # from here on nothing is published, whatever still runs
        # open questions get their reason, not a hang
        self._ask.close('the node was deactivated before the answer was ready')
        control, self._control = self._control, None
        if control is not None and not control.stop(STOP_TIMEOUT_S):
            self._stuck = control   # activate refuses while it lives
            self._problems.note(ERROR, f'a control tick did not finish {STOP_TIMEOUT_S:g} s '
                                       'after deactivate; activate is refused until it ends')

    def _release(self) -> None:
        """Drop timer, thread, subscriptions, publishers and the engine (frees model and KV)."""
        self._stop_control()
        for io in self._ios.values():
            io.destroy()
        if self._engine is not None:
            self._engine.system.close()   # its row threads, if any
        self._ios, self._loop, self._engine, self._settings = {}, None, None, None

    def destroy_node(self):
        """Detach the engine log bridge and release everything, then destroy the node."""
        BridgeAttachment.detach(self._bridge)
        self._release()
        return super().destroy_node()

    # ---- the control tick (wake timer: executor; tick: control thread) -----------------------

    def _on_wake(self) -> None:
        """Wake the control thread; re-arm the timer for the next robot's tick."""
        control, loop = self._control, self._loop
        if control is None or loop is None or not self._wake.running:
            return
        control.trigger()
        self._wake.rearm(loop)

    def _control_tick(self) -> None:
        """One wake-up. Never raises: problems are logged, counted and diagnosed."""
        loop, control, engine = self._loop, self._control, self._engine
        if loop is None:
            return   # released while this wake-up was pending
        if control is not None and control.priority_note:
            self._problems.note(WARN, control.priority_note)   # once per activation
            control.priority_note = ''
        try:
            with self._pending_lock:
                changes, self._pending = self._pending, {}
            if changes and self._engine is not None and self._settings is not None:
                apply_to_engine(self._engine.system, loop, self._settings, changes)
            outcomes = loop.tick(self._now_s())   # records a failing tick in its statistics
            with self._pending_lock:   # the executor changes the settings too
                self._settings = self._auto_rate.settle(engine, loop, outcomes, self._settings)
        except Exception as err:   # noqa: BLE001 - the control loop must keep its rate
            if not self.context.ok():
                return   # shutting down (Ctrl-C)
            self._problems.event('tick', ERROR, f'control tick failed: {err!r}')
            self.get_logger().debug(traceback.format_exc())

    # ---- public state (diagnostics, tests) ----------------------------------------------------

    def diagnostic_statuses(self):
        """Build the current diagnostic statuses (what /diagnostics publishes)."""
        return self._diagnostics.statuses()

    @property
    def diagnostic_name(self) -> str:
        """Prefix of the node's diagnostic names: its full name, so unique per namespace."""
        return self.get_fully_qualified_name().lstrip('/')

    @property
    def diagnostics_period_s(self) -> float:
        return self._diagnostics.period_s

    @property
    def hardware_id(self) -> str:
        """The /diagnostics hardware_id: the torch device the model runs on."""
        return self._params.value('device')

    @property
    def lifecycle_state(self) -> str:
        """'unconfigured', 'configuring', 'inactive', 'active' or 'finalized'."""
        return self._lifecycle

    @property
    def config_error(self) -> str:
        """Why the last configure failed ('' after a successful one)."""
        return self._config_error

    @property
    def parameter_errors(self) -> dict[str, str]:
        """Startup parameter values that were rejected, with the reason."""
        return dict(self._params.errors)

    @property
    def engine(self):
        """Return the runtime.engine_setup.Engine built at configure (None unless configured)."""
        return self._engine

    @property
    def loop(self) -> FrameLoop | None:
        """The frame loop over every robot (None unless configured)."""
        return self._loop

    @property
    def robots(self) -> dict[str, RobotIO]:
        """The configured robots' topics by name ('' for the one robot of a plain node)."""
        return dict(self._ios)

    @property
    def robot_subscriptions(self) -> list:
        """Every subscription of every robot (not rclpy's own `subscriptions`: the /clock one)."""
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


def main(args=None, *, fast_exit: bool = True,
         engine_builder: Callable[[FleetSettings], object] | None = None) -> int:
    """Run oxygen_node until Ctrl-C (console script and `ros2 run oxygen_ros oxygen_node`).

    fast_exit: see dds.run_node. engine_builder: as OxygenNode's (the soak's fault injection).
    """
    return run_node(lambda: OxygenNode(engine_builder=engine_builder), args,
                    fast_exit=fast_exit)


if __name__ == '__main__':
    raise SystemExit(main())
