"""Test scaffolding for oxygen_node over real DDS: spin nodes, feed inputs, collect outputs."""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Callable

from diagnostic_msgs.msg import DiagnosticArray
import rclpy.subscription
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import String

from oxygen_ros.msg import ActionChunk, LanguageChunk
from oxygen_ros.ros import qos

# Subscription callbacks taking (msg, info) get DDS timestamps since rclpy 4 (Iron).
HAS_MESSAGE_INFO = hasattr(rclpy.subscription, 'MessageInfo')


def sent_ns(item: tuple) -> int:
    """When a Collector item was sent (system clock ns): its DDS source timestamp, or on
    Humble (no message info) its receipt time, the closest there is."""
    _, source_ns, received = item
    return source_ns or time.time_ns() - round((time.monotonic() - received) * 1e9)


def assert_nothing_published_after(collectors, t_ns: int, settle_s: float = 0.5,
                                   allowed: int = 0) -> None:
    """Assert that the action and token messages the collectors got that were sent after
    `t_ns` (time.time_ns()) come from at most `allowed` ticks.

    Why send times: a message published before `t_ns` may reach a busy test process later;
    only what the node published after it matters. settle_s gives one sent after it the time
    to arrive (a longer delay weakens the check, it never fails it). A tick is its header
    stamp: its action chunk and its token messages carry the same one.
    """
    time.sleep(settle_s)
    late = []
    for collector in (collectors if isinstance(collectors, (list, tuple)) else [collectors]):
        with collector.lock:
            late += [(kind, sent_ns(item), (item[0].header.stamp.sec,
                                            item[0].header.stamp.nanosec))
                     for kind, items in (('action', collector.actions),
                                         ('tokens', collector.tokens))
                     for item in items if sent_ns(item) > t_ns]
    assert len({stamp for _, _, stamp in late}) <= allowed, late


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    """Poll `predicate` until it is true or `timeout` seconds pass; return its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


class Spinner:
    """An executor (default: a SingleThreadedExecutor) spinning `nodes` in a background thread.

    Never a MultiThreadedExecutor next to a node under test: while one of its callbacks waits
    for the GIL, its spin thread finds that callback's group busy and loops in Python, so every
    other thread of the process (the node's control thread, a receiver) gets the GIL back only
    at the 5 ms switch interval, once per op that released it: ticks of 1-4 s were measured.
    """

    def __init__(self, context, nodes=(), executor=None):
        self.executor = executor or SingleThreadedExecutor(context=context)
        for node in nodes:
            self.executor.add_node(node)
        self.thread = threading.Thread(target=self._spin, daemon=True)
        self.thread.start()

    def _spin(self) -> None:
        try:
            self.executor.spin()
        except Exception:   # noqa: BLE001 - context shut down under the executor at teardown
            pass

    def add(self, node) -> None:
        self.executor.add_node(node)

    def remove(self, node) -> None:
        self.executor.remove_node(node)

    def stop(self) -> None:
        """Stop spinning: nodes leave first, so no callback is in flight at shutdown."""
        # Why: rclpy's executor can run a task after shutdown destroyed its guard condition
        # (an 'InvalidHandle ... never retrieved' message); with no nodes left there is none.
        for node in list(self.executor.get_nodes()):
            self.executor.remove_node(node)
        time.sleep(0.1)
        self.executor.shutdown(timeout_sec=5.0)
        self.thread.join(timeout=5.0)


class Collector(Node):
    """Records the node's outputs with their DDS source timestamps (ns) and receipt times."""

    def __init__(self, namespace: str = '', diagnostic_name: str = '', **kwargs):
        super().__init__('oxygen_test_collector', namespace=namespace, **kwargs)
        self.diagnostic_name = diagnostic_name   # keep only this node's /diagnostics ('' = all)
        self.lock = threading.Lock()
        self.actions: list[tuple] = []      # (msg, source ns, monotonic receipt)
        self.tokens: list[tuple] = []
        self.narrations: list[str] = []
        self.diagnostics: list = []         # DiagnosticArray messages
        self.create_subscription(ActionChunk, 'actions', self._on(self.actions),
                                 qos.ACTIONS_RECORDER)
        self.create_subscription(LanguageChunk, 'language/tokens', self._on(self.tokens),
                                 qos.TOKENS)
        self.create_subscription(String, 'language/narration',
                                 lambda m: self._append(self.narrations, m.data), qos.NARRATION)
        self.create_subscription(DiagnosticArray, '/diagnostics', self._on_diagnostics,
                                 qos.DIAGNOSTICS)

    def _on_diagnostics(self, msg) -> None:
        prefix = self.diagnostic_name + ': '
        if not self.diagnostic_name or any(s.name.startswith(prefix) for s in msg.status):
            self._append(self.diagnostics, msg)

    def _append(self, target: list, item) -> None:
        with self.lock:
            target.append(item)

    def _on(self, target: list):
        if not HAS_MESSAGE_INFO:   # Humble: no message info, source timestamps unknown (0)
            return lambda msg: self._append(target, (msg, 0, time.monotonic()))

        def callback(msg, info):   # two parameters: rclpy then passes the message info
            self._append(target, (msg, info['source_timestamp'], time.monotonic()))
        return callback

    def latest_status(self, part: str):
        """Newest DiagnosticStatus named '<diagnostic_name>: <part>' (None if none yet).

        Without a diagnostic_name, any status whose name ends with ': <part>'.
        """
        with self.lock:
            arrays = list(self.diagnostics)
        for array in reversed(arrays):
            for status in array.status:
                if (status.name == f'{self.diagnostic_name}: {part}' if self.diagnostic_name
                        else status.name.endswith(': ' + part)):
                    return status
        return None

    def clear(self) -> None:
        with self.lock:
            self.actions.clear()
            self.tokens.clear()
            self.narrations.clear()
            self.diagnostics.clear()


class Feeder(Node):
    """Publishes camera images, joint states (and an instruction) from replaceable factories.

    image_factory[camera] and joint_factory take the frame counter and return a message, or
    None to publish nothing (a camera that stopped).
    """

    def __init__(self, camera_topics: dict[str, str], rate_hz: float = 20.0,
                 compressed: tuple[str, ...] = (), namespace: str = '', **kwargs):
        super().__init__('oxygen_test_feeder', namespace=namespace, **kwargs)
        self.index = 0
        self.image_factory: dict[str, Callable[[int], object]] = {}
        self.joint_factory: Callable[[int], object] | None = None
        self._camera_pubs = {
            name: self.create_publisher(CompressedImage if name in compressed else Image, topic,
                                        qos.SENSOR)
            for name, topic in camera_topics.items()}
        self._joint_pub = self.create_publisher(JointState, 'joint_states', qos.SENSOR)
        self._instruction_pub = self.create_publisher(String, 'instruction', qos.INSTRUCTION)
        self.sent = collections.Counter()
        self.stamps: dict[int, int] = {}   # first camera's stamp (ns) -> frame (good_feeder)
        self.timer = self.create_timer(1.0 / rate_hz, self._publish)

    def instruct(self, text) -> None:
        """Publish an instruction: str, or bytes for a raw (already serialised) message."""
        self._instruction_pub.publish(text if isinstance(text, bytes) else String(data=text))

    def _publish(self) -> None:
        i, self.index = self.index, self.index + 1
        for name, pub in self._camera_pubs.items():
            factory = self.image_factory.get(name)
            msg = factory(i) if factory else None
            if msg is not None:
                pub.publish(msg)
                self.sent[name] += 1
        msg = self.joint_factory(i) if self.joint_factory else None
        if msg is not None:
            self._joint_pub.publish(msg)
            self.sent['joint_states'] += 1


def good_feeder(context, values: dict, rate_hz: float, namespace: str = '',
                task: str | None = None, static_after_first: bool = False) -> Feeder:
    """A Feeder of good inputs for a robot with parameter `values` (its own names, unprefixed):
    moving photos (32 px) on every camera topic, constant joint states, the instruction `task`.

    static_after_first: every camera but the first shows frame 0 forever, so an observation
    is a function of its first camera's frame (`feeder.stamps` maps that camera's header stamp
    in ns to the frame index it carried).
    """
    from oxygen_ros.runtime.params import default_camera_topic, transport_topic
    from oxygen_ros.ros.sim_inputs import camera_frame, image_msg, PHOTOS

    cameras = values['camera_names']
    compressed = tuple(c for c in cameras if values.get(f'cameras.{c}.compressed'))
    # The feeder publishes where image_transport would: the base topic or <base>/compressed.
    topics = {c: transport_topic(values.get(f'cameras.{c}.topic') or default_camera_topic(c),
                                 c in compressed) for c in cameras}
    feeder = Feeder(topics, rate_hz, compressed, namespace, context=context)
    clock = feeder.get_clock()

    def first_camera(n, photo):
        stamp = clock.now()
        feeder.stamps[stamp.nanoseconds] = n
        return image_msg(camera_frame(photo, 32, n), stamp.to_msg())

    for i, cam in enumerate(cameras):
        photo = PHOTOS[i % len(PHOTOS)]
        if static_after_first and i == 0:
            feeder.image_factory[cam] = lambda n, photo=photo: first_camera(n, photo)
        else:
            still = static_after_first
            feeder.image_factory[cam] = (
                lambda n, photo=photo, still=still: image_msg(
                    camera_frame(photo, 32, 0 if still else n), clock.now().to_msg()))
    joints = list(values['joint_names'])
    feeder.joint_factory = lambda n: JointState(
        name=joints, position=[0.1 * j for j in range(len(joints))])
    if task is not None:
        feeder.instruct(task)
    return feeder


class NodeHarness:
    """An OxygenNode (autostart off) in its own executor, as main() runs it, plus a Feeder of
    good inputs and a Collector in a second executor.

    params override the node's parameters; the feeder publishes moving photos on every
    camera topic (32 px), constant joint states and the instruction `task`. All three live in
    `namespace` (so harnesses of one process do not see each other's topics).
    engine_builder: the node's (None: the real engine).
    """

    def __init__(self, context, params: dict, task: str = 'pick up the red block',
                 rate_hz: float = 20.0, namespace: str = '', engine_builder=None):
        from rclpy.parameter import Parameter

        from oxygen_ros.ros.node import make_executor, OxygenNode
        from oxygen_ros.runtime.params import robot_defaults

        values = dict(robot_defaults(params.get('robot', 'libero')), autostart=False)
        values.update(params)
        self.context = context
        self.values = values
        self.node = OxygenNode(context=context, namespace=namespace,
                               engine_builder=engine_builder,
                               parameter_overrides=[Parameter(k, value=v)
                                                    for k, v in values.items()])
        self.collector = Collector(namespace, self.node.diagnostic_name, context=context)
        self.feeder = good_feeder(context, values, rate_hz, namespace, task)
        self.node_spinner = Spinner(context, [self.node], executor=make_executor(context))
        self.spinner = Spinner(context, [self.collector, self.feeder])
        self.good_joints = self.feeder.joint_factory
        self.good_images = dict(self.feeder.image_factory)

    def start(self) -> None:
        """Configure and activate the node (asserting both succeed)."""
        from rclpy.lifecycle import TransitionCallbackReturn

        assert self.node.trigger_configure() == TransitionCallbackReturn.SUCCESS, (
            self.node.problem_history[-3:])
        assert self.node.trigger_activate() == TransitionCallbackReturn.SUCCESS

    def restore_inputs(self) -> None:
        """Publish good images and joint states again on every topic."""
        self.feeder.image_factory.update(self.good_images)
        self.feeder.joint_factory = self.good_joints

    def statuses(self) -> dict:
        """Map each part ('model', 'control loop', 'inputs', ...) to its diagnostic status."""
        return {s.name.split(': ', 1)[1]: s for s in self.node.diagnostic_statuses()}

    def trace_publishes(self) -> list:
        """Record (kind 'action' | 'tokens', stamp ns, monotonic time) of every publish call.

        Call after configure: wraps the node's output sink (oxygen_ros.ros.robot_io.RosOutputs).
        """
        trace = []
        outputs = self.node.robots[''].outputs
        for kind in ('action', 'tokens'):
            original = getattr(outputs, kind)

            def traced(item, stamp_ns, original=original, kind=kind):
                original(item, stamp_ns)
                trace.append((kind, stamp_ns, time.monotonic()))
            setattr(outputs, kind, traced)
        return trace

    def close(self) -> None:
        self.node_spinner.stop()
        self.spinner.stop()
        for node in (self.node, self.collector, self.feeder):
            node.destroy_node()


class FleetHarness:
    """An OxygenNode serving several robots (autostart off) in its own executor, as main() runs
    it, plus one Feeder of good inputs and one Collector per robot, in the robot's namespace.

    robots: robot name -> its own parameters (unprefixed: robot, control_rate_hz, ...; cameras
    and joints default to its robot type's); params: the node's. Each robot's feeder shows
    moving photos on its first camera and still ones on the others (`feeder.stamps`), and
    publishes the instruction `tasks[robot]` (default: 'task of <robot>').
    """

    def __init__(self, context, params: dict, robots: dict[str, dict],
                 tasks: dict[str, str] | None = None, rate_hz: float = 20.0):
        from rclpy.parameter import Parameter

        from oxygen_ros.ros.node import make_executor, OxygenNode
        from oxygen_ros.runtime.params import robot_defaults

        values = {'autostart': False, **params, 'robots': list(robots)}
        self.robot_values = {}
        for name, own in robots.items():
            mine = {**robot_defaults(own.get('robot', 'libero')), **own}
            self.robot_values[name] = mine
            values.update({f'{name}.{key}': value for key, value in mine.items()})
        self.values = values
        self.node = OxygenNode(context=context, parameter_overrides=[
            Parameter(k, value=v) for k, v in values.items()])
        tasks = tasks or {}
        self.collectors = {name: Collector(name, f'{self.node.diagnostic_name}/{name}',
                                           context=context) for name in robots}
        self.feeders = {name: good_feeder(context, self.robot_values[name], rate_hz, name,
                                          tasks.get(name, f'task of {name}'),
                                          static_after_first=True) for name in robots}
        self.node_spinner = Spinner(context, [self.node], executor=make_executor(context))
        self.spinner = Spinner(context, [*self.collectors.values(), *self.feeders.values()])
        self.good_images = {name: dict(f.image_factory) for name, f in self.feeders.items()}

    def start(self) -> None:
        """Configure and activate the node (asserting both succeed)."""
        from rclpy.lifecycle import TransitionCallbackReturn

        assert self.node.trigger_configure() == TransitionCallbackReturn.SUCCESS, (
            self.node.problem_history[-3:])
        assert self.node.trigger_activate() == TransitionCallbackReturn.SUCCESS

    def statuses(self, robot: str = '') -> dict:
        """Map each part of the node's (or one robot's) diagnostics to its status."""
        prefix = self.node.diagnostic_name + (f'/{robot}' if robot else '') + ': '
        return {s.name[len(prefix):]: s for s in self.node.diagnostic_statuses()
                if s.name.startswith(prefix)}

    def close(self) -> None:
        self.node_spinner.stop()
        self.spinner.stop()
        for node in (self.node, *self.collectors.values(), *self.feeders.values()):
            node.destroy_node()


# Node parameters of the in-process node tests: the tiny model, fast ticks, lenient staleness.
TINY_NODE = dict(preset='tiny', decode_budget=2, tokens_per_request=4, control_rate_hz=20.0,
                 stale_frame_timeout_s=2.0)


@contextlib.contextmanager
def harnesses(context, defaults: dict, namespaced: bool = False, **harness_kwargs):
    """Yield make(**params) -> a NodeHarness of `defaults` + params; all closed at exit.

    namespaced: each harness in its own namespace (h0, h1, ...), so several in one test do not
    see each other's topics.
    """
    made = []

    def make(**params):
        namespace = f'h{len(made)}' if namespaced else ''
        made.append(NodeHarness(context, {**defaults, **params}, namespace=namespace,
                                **harness_kwargs))
        return made[-1]
    try:
        yield make
    finally:
        for h in made:
            h.close()
