"""Record the node's input topics to a rosbag2 over real DDS, without `ros2 bag`.

BagRecorder subscribes with raw=True: the CDR bytes DDS delivers are written to the bag
untouched (as rosbag2 does), with the message definitions from oxygen_ros.bag's typestore.
`record_demo` runs it next to the demo's stand-in robot (oxygen_ros.ros.sim_inputs: sample
photos with slight motion, joint states, a latched instruction) for a fixed time and closes
the bag properly, also on Ctrl-C. Works with rclpy 3.3+ (Humble): no `with rclpy.init()`.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
import signal
import threading
import time

import rclpy
from rclpy.context import Context
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import String

from oxygen_ros.bag.config import ReplayParams
from oxygen_ros.bag.typestore import (COMPRESSED_IMAGE, IMAGE, JOINT_STATE, make_typestore,
                                      STRING)
from oxygen_ros.bag.writer import OutputBag, qos_profile
from oxygen_ros.ros.qos import INSTRUCTION

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)   # all close the bag cleanly

logger = logging.getLogger(__name__)

ROS_TYPES = {IMAGE: Image, COMPRESSED_IMAGE: CompressedImage, JOINT_STATE: JointState,
             STRING: String}


def sensor_qos(depth: int = 10) -> QoSProfile:
    """Best effort (as the node's SENSOR profile) but deeper: a recorder keeps every frame."""
    return QoSProfile(depth=depth, reliability=ReliabilityPolicy.BEST_EFFORT)


def input_topics(params: ReplayParams, compressed: bool = False) -> dict[str, tuple[str, bool]]:
    """Return the node's input topics: absolute topic -> (message type, latched)."""
    topics = {topic: (COMPRESSED_IMAGE if jpeg else IMAGE, False)
              for _, topic, jpeg in params.cameras(compressed or None)}
    topics[params.resolve(params.joint_states_topic)] = (JOINT_STATE, False)
    topics[params.resolve(params.instruction_topic)] = (STRING, True)
    return topics


class BagRecorder:
    """Subscriptions on `node` writing raw CDR of each topic into an open OutputBag."""

    def __init__(self, node: Node, out: OutputBag, topics: dict[str, tuple[str, bool]]):
        self.node = node
        self.out = out
        self.counts = dict.fromkeys(topics, 0)
        self._lock = threading.Lock()
        self._subscriptions = []
        for topic, (msgtype, latched) in topics.items():
            qos = INSTRUCTION if latched else sensor_qos()
            bag_qos = [qos_profile(True, True, 1)] if latched else [qos_profile(False)]
            self._subscriptions.append(node.create_subscription(
                ROS_TYPES[msgtype], topic, self._writer(topic, msgtype, bag_qos), qos,
                raw=True))

    def _writer(self, topic: str, msgtype: str, bag_qos):
        def write(data: bytes) -> None:
            stamp = self.node.get_clock().now().nanoseconds   # receive time, as rosbag2
            with self._lock:
                if self.out.is_open:
                    self.out.write_raw(topic, msgtype, stamp, bytes(data), qos=bag_qos)
                    self.counts[topic] += 1
        return write


def demo_input_nodes(params: ReplayParams, context: Context, instruction: str,
                     camera_hz: float, state_hz: float, image_size: int,
                     compressed: bool) -> list[Node]:
    """Create the node demo's publishers (sim_inputs) on the topics `params` configures."""
    from oxygen_ros.ros.sim_inputs import (CameraPublisher, InstructionPublisher,
                                           JointStatePublisher, PHOTOS, SimCamera)

    cameras = [SimCamera(name, topic, PHOTOS[i % len(PHOTOS)], jpeg)
               for i, (name, topic, jpeg) in enumerate(params.cameras(compressed or None))]
    remap = ['--ros-args', '-r', f'joint_states:={params.resolve(params.joint_states_topic)}',
             '-r', f'instruction:={params.resolve(params.instruction_topic)}']
    common = dict(context=context, cli_args=remap, use_global_arguments=False)
    return [CameraPublisher(cameras, camera_hz, image_size, **common),
            JointStatePublisher(list(params.settings.joint_names), state_hz, **common),
            InstructionPublisher([instruction], **common)]


def record_demo(out_path: str | Path, params: ReplayParams, duration_s: float, *,
                instruction: str = 'pick up the red block', publish: bool = True,
                image_size: int = 224, compressed: bool = False, camera_hz: float = 15.0,
                state_hz: float = 50.0, overwrite: bool = False,
                storage: str = 'mcap') -> dict[str, int]:
    """Record the node's input topics for duration_s; return messages per topic.

    publish: also run the demo's input publishers in this process (False: record what others
    publish, e.g. a robot or the node's demo). compressed: CompressedImage on every camera
    topic (default: as cameras.<name>.compressed configures each camera). The bag is closed
    properly on Ctrl-C or errors.
    """
    context = Context()
    stop = threading.Event()
    # Ctrl-C sets `stop` (checked between spins) instead of raising KeyboardInterrupt inside
    # rclpy's C code, which can make CPython 3.11 exit by SIGINT after the bag was closed.
    rclpy.init(context=context, **_no_rclpy_signal_handlers())
    out = OutputBag(out_path, make_typestore(), storage, overwrite)
    executor = SingleThreadedExecutor(context=context)
    nodes = []
    with contextlib.ExitStack() as cleanup:
        cleanup.enter_context(_sigint_sets(stop))
        cleanup.callback(_shutdown, context, executor, nodes)
        cleanup.callback(out.close)      # runs first: whatever happened, keep the recording
        out.open()
        out.set_custom_data('oxygen_ros.record_demo.instruction', instruction)
        recorder_node = Node('oxygen_bag_recorder', context=context)
        nodes.append(recorder_node)
        recorder = BagRecorder(recorder_node, out, input_topics(params, compressed))
        if publish:
            nodes += demo_input_nodes(params, context, instruction, camera_hz, state_hz,
                                      image_size, compressed)
        for node in nodes:
            executor.add_node(node)
        end = time.monotonic() + duration_s
        while context.ok() and time.monotonic() < end and not stop.is_set():
            executor.spin_once(timeout_sec=min(0.05, max(end - time.monotonic(), 0.0)))
        if stop.is_set():
            out.set_custom_data('oxygen_ros.record_demo.status', 'interrupted')
            raise KeyboardInterrupt
        out.set_custom_data('oxygen_ros.record_demo.status', 'complete')
        return dict(recorder.counts)


def _shutdown(context: Context, executor, nodes: list[Node]) -> None:
    executor.shutdown()
    for node in nodes:
        node.destroy_node()
    if context.ok():
        rclpy.shutdown(context=context)


def _no_rclpy_signal_handlers() -> dict:
    """rclpy.init kwargs that leave SIGINT to us (rclpy 3.3+, Humble and later)."""
    try:
        from rclpy.signals import SignalHandlerOptions
    except ImportError:   # pragma: no cover - older rclpy: its default handlers
        return {}
    return {'signal_handler_options': SignalHandlerOptions.NO}


@contextlib.contextmanager
def _sigint_sets(stop: threading.Event):
    """While inside, SIGINT, SIGTERM and SIGHUP set `stop`: the bag is closed as on Ctrl-C.

    Main thread only (elsewhere signals cannot be set).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set())
                for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            # None: the previous handler was not installed from Python (e.g. rclpy's own).
            signal.signal(sig, handler if handler is not None else (
                signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL))


def record_demo_main(args) -> int:
    """Run `oxygen-ros record-demo` (arguments from oxygen_ros.bag.cli); return exit code."""
    import os
    import sys

    from oxygen_ros.bag.cli import error, EXIT_INTERRUPTED, params_from_args
    from oxygen_ros.bag.errors import BagError

    if args.publish:
        # Self-contained demo: keep discovery on this machine unless told otherwise.
        os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    try:
        params = params_from_args(args, engine=False)
        counts = record_demo(args.out, params, args.duration, instruction=args.instruction,
                             publish=args.publish, image_size=args.image_size,
                             camera_hz=args.camera_hz,
                             state_hz=args.state_hz, overwrite=args.overwrite,
                             storage=args.storage)
    except BagError as err:
        return error('record-demo', err)
    except KeyboardInterrupt:
        print(f'oxygen-ros record-demo: interrupted; {args.out} is closed with what was '
              'recorded', file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f'recorded {sum(counts.values())} messages in {args.duration:g} s to {args.out}')
    for topic, count in counts.items():
        print(f'  {topic}: {count}')
    missing = [t for t, n in counts.items() if n == 0]
    if missing:
        print(f'  nothing received on {", ".join(missing)} (is a publisher running on this '
              f'ROS_DOMAIN_ID={os.environ.get("ROS_DOMAIN_ID", "0")}?)')
    return 0
