"""oxygen_node's /diagnostics: the runtime's status model, rendered as diagnostic_msgs.

One robot: '<node>: model', 'control loop', 'language', 'kv cache', 'inputs'. A fleet:
'<node>: model' (the shared model and pool), then those five per robot, named
'<node>/<robot>: <part>'. Published on a steady-clock timer, in every lifecycle state (a failed
configure shows; it works before /clock starts or while it is paused).
"""

from __future__ import annotations

from rclpy.clock import Clock, ClockType
from rclpy.lifecycle import LifecycleNode

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

from oxygen_ros.ros import qos
from oxygen_ros.runtime.control import CpuSplit
from oxygen_ros.runtime.status import build_statuses, ERROR, LoopStats, ProblemLog, Status


def to_diagnostic_array(statuses: list[Status], stamp, hardware_id: str):
    """Statuses -> diagnostic_msgs/DiagnosticArray."""
    array = DiagnosticArray()
    array.header.stamp = stamp
    for status in statuses:
        msg = DiagnosticStatus()
        msg.level = bytes([status.level])
        msg.name = status.name
        msg.message = status.message[:1000]
        msg.hardware_id = hardware_id
        msg.values = [KeyValue(key=k, value=v) for k, v in status.values]
        array.status.append(msg)
    return array


def configured_summary(engine, settings) -> str:
    """Say what a configure built: source, robots, rates, budgets, KV pool, threads."""
    pool = engine.system.pool
    if settings.is_one:
        s = settings.robots['']
        served = (f'robot {s.robot}, {len(s.cameras)} cameras, {s.control_rate_hz:g} Hz, '
                  f'decode budget {s.decode_budget or "adaptive"}')
    else:
        served = ', '.join(f'{name} ({s.robot}, {s.control_rate_hz:g} Hz, '
                           f'{engine.system.scheduler(name).pool.num_slots} KV slots)'
                           for name, s in settings.robots.items())
    return (f'{engine.description["source"]}, {served}, KV pool {pool.num_slots} slots '
            f'({pool.total_bytes / (1 << 20):.1f} MiB), '
            f'{engine.description.get("torch_threads", "?")} torch threads')


class NodeDiagnostics:
    """The node's diagnostics publisher, its timer and its statuses (read from the node).

    node: an OxygenNode (its public state: lifecycle_state, engine, loop, robots,
    control_thread, parameter_errors, config_error, diagnostic_name, hardware_id).
    """

    def __init__(self, node: LifecycleNode, problems: ProblemLog, period_s: float):
        self.node = node
        self.problems = problems
        self._publisher = node.create_publisher(DiagnosticArray, '/diagnostics',
                                                qos.DIAGNOSTICS)
        self._timer = None
        self._cpu = CpuSplit()
        self._cpu_pct: tuple[float, float] | None = None   # (control, other) % of one core
        self.start(period_s)

    @property
    def period_s(self) -> float:
        return self._timer.timer_period_ns * 1e-9

    def start(self, period_s: float) -> None:
        """(Re)start the timer (steady clock: works before /clock starts)."""
        if self._timer is not None:
            self.node.destroy_timer(self._timer)
        self._timer = self.node.create_timer(period_s, self.publish,
                                             clock=Clock(clock_type=ClockType.STEADY_TIME))

    def publish(self) -> None:
        self._cpu_pct = self._cpu.sample() or self._cpu_pct
        node = self.node
        try:
            # hardware_id names the device the model runs on (as a driver names its device).
            self._publisher.publish(to_diagnostic_array(
                self.statuses(), node.get_clock().now().to_msg(), node.hardware_id))
        except Exception as err:   # noqa: BLE001 - diagnostics must not take the node down
            self.problems.event('diagnostics', ERROR, f'diagnostics failed: {err!r}')

    def _loop_snapshot(self, stats: LoopStats) -> dict | None:
        """Return a robot's loop statistics with the control thread's (None unless active)."""
        if self.node.lifecycle_state != 'active':
            return None
        snapshot = stats.snapshot()
        control = self.node.control_thread
        snapshot['wakeups_late'] = control.late if control is not None else 0
        snapshot['wakeups_dropped'] = control.dropped if control is not None else 0
        if self._cpu_pct is not None:
            snapshot['cpu_control_thread_pct'], snapshot['cpu_other_threads_pct'] = (
                self._cpu_pct)
        return snapshot

    def statuses(self) -> list[Status]:
        """Build the current statuses, one robot's or a fleet's (module docstring)."""
        node = self.node
        engine, loop = node.engine, node.loop
        model = dict(engine.description) if engine is not None else {}
        for key, why in node.parameter_errors.items():
            model[f'rejected {key}'] = why
        lifecycle, name = node.lifecycle_state, node.diagnostic_name
        robots = loop.robots if loop is not None else {}
        if list(robots) in ([], ['']):   # one robot: its parts under the node's name
            robot = robots.get('')
            io = node.robots.get('')
            inputs = robot.last_inputs if robot is not None else None
            return build_statuses(
                name, lifecycle, model, self._loop_snapshot(robot.stats) if robot else None,
                1.0 / robot.period_s if robot else 0.0,
                loop.engine_summary('') if robot else None,
                inputs.inputs if inputs is not None else [],
                dict(inputs.problems) if inputs is not None else {},
                io.inputs.instruction if io is not None else None, node.config_error)
        statuses = build_statuses(name, lifecycle, model, None, 0.0, None, [], {}, None,
                                  node.config_error)
        for robot_name, robot in list(robots.items()):
            io = node.robots.get(robot_name)
            inputs = robot.last_inputs
            spec = io.settings.spec if io else None
            about = {'robot': spec.name if spec else '',
                     'robot_spec': (spec.source or 'inferred') if spec else '',
                     'namespace': io.resolved_namespace if io else '',
                     'kv_quota': engine.system.scheduler(robot_name).pool.num_slots}
            statuses += build_statuses(
                f'{name}/{robot_name}', lifecycle, about, self._loop_snapshot(robot.stats),
                1.0 / robot.period_s, loop.engine_summary(robot_name),
                inputs.inputs if inputs is not None else [],
                dict(inputs.problems) if inputs is not None else {},
                io.inputs.instruction if io is not None else None)
        return statuses
