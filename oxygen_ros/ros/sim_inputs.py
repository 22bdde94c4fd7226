"""Stand-in robot inputs: cameras (real photos, slight motion), joint states, instruction.

Used by the demo and the tests; runnable on its own:

    python -m oxygen_ros.ros.sim_inputs --robot libero --rate 10 \
        --instruction "pick up the black bowl"
    python -m oxygen_ros.ros.sim_inputs --width 640 --height 480 --rate 15   # VGA cameras
    python -m oxygen_ros.ros.sim_inputs --namespace arm_right --robot droid  # one of a fleet
    python -m oxygen_ros.ros.sim_inputs --compressed                        # jpeg, not rgb8

--namespace puts every topic under it: one such process per robot of a node serving several
(`robots: [arm_left, arm_right]`) stands in for a robot team.

Cameras send raw rgb8 sensor_msgs/Image, as a camera driver does, and the process uses the Fast
DDS profile for large frames (config/fastdds_large_frames.xml, docs/cameras.md) unless its
environment names a profile already; `--dds-profile none` sends with Fast DDS's defaults.

The photos are scikit-image's sample images (shipped with the package, no download). Each
camera pans a crop window slowly over its photo, so consecutive frames differ a little, as a
real camera's would. Frame i of a camera is a pure function of (photo, size, i).
"""

from __future__ import annotations

import argparse
import array
import dataclasses
import functools
import io
import math
import os

import numpy as np
from PIL import Image as PILImage
import rclpy
from rclpy.node import Node
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import String

from oxygen_ros.ros import qos
from oxygen_ros.runtime.dds_profile import profile_environment
from oxygen_ros.runtime.params import (default_camera_topic, robot_defaults, RobotSpecError,
                                       transport_topic)

PHOTOS = ('astronaut', 'coffee', 'chelsea', 'rocket', 'immunohistochemistry')


@functools.lru_cache(maxsize=16)
def _photo(name: str, height: int, width: int) -> np.ndarray:
    """Load a sample photo scaled to cover 1.25 x (height, width): uint8 [h, w, 3]."""
    import skimage.data

    image = getattr(skimage.data, name)()
    if image.ndim == 2:
        image = np.stack([image] * 3, axis=-1)
    image = image[..., :3]
    scale = 1.25 * max(height / image.shape[0], width / image.shape[1])
    h = max(height, round(image.shape[0] * scale))
    w = max(width, round(image.shape[1] * scale))
    return np.asarray(PILImage.fromarray(image).resize((w, h), PILImage.BILINEAR))


def camera_frame(photo: str, size: int, index: int, width: int | None = None) -> np.ndarray:
    """Frame `index` of a camera looking at `photo`: uint8 [size, width or size, 3] RGB.

    The crop window follows a slow Lissajous path (periods 40 and 57 frames), a few pixels
    per frame: slight, continuous motion.
    """
    height, width = size, width or size
    image = _photo(photo, height, width)
    slack_y, slack_x = image.shape[0] - height, image.shape[1] - width
    y = round(slack_y * (0.5 + 0.5 * math.sin(2 * math.pi * index / 57)))
    x = round(slack_x * (0.5 + 0.5 * math.sin(2 * math.pi * index / 40)))
    return np.ascontiguousarray(image[y:y + height, x:x + width])


def image_msg(rgb: np.ndarray, stamp, frame_id: str = 'camera', encoding: str = 'rgb8'):
    """uint8 [H, W, 3] RGB -> sensor_msgs/Image in rgb8 or bgr8."""
    msg = Image()
    msg.header.stamp = stamp
    msg.header.frame_id = frame_id
    msg.height, msg.width = rgb.shape[:2]
    msg.encoding = encoding
    msg.step = rgb.shape[1] * 3
    pixels = rgb if encoding == 'rgb8' else rgb[:, :, ::-1]
    msg.data = array.array('B', np.ascontiguousarray(pixels).tobytes())
    return msg


def compressed_msg(rgb: np.ndarray, stamp, frame_id: str = 'camera', fmt: str = 'jpeg'):
    """uint8 [H, W, 3] RGB -> sensor_msgs/CompressedImage (jpeg or png)."""
    buf = io.BytesIO()
    PILImage.fromarray(rgb).save(buf, format='JPEG' if fmt == 'jpeg' else 'PNG', quality=90)
    msg = CompressedImage()
    msg.header.stamp = stamp
    msg.header.frame_id = frame_id
    msg.format = fmt
    msg.data = array.array('B', buf.getvalue())
    return msg


@dataclasses.dataclass(frozen=True)
class SimCamera:
    """One simulated camera."""

    name: str
    topic: str
    photo: str
    compressed: bool = False
    static: bool = False     # True: always frame 0 (a camera that sees no motion)


def robot_cameras(robot: str, compressed: bool = False) -> list[SimCamera]:
    """List the robot's cameras on the node's default topics, each showing another photo.

    robot: a shipped robot's name or the path of a robot YAML.
    """
    return [SimCamera(name, transport_topic(default_camera_topic(name), compressed),
                      PHOTOS[i % len(PHOTOS)], compressed)
            for i, name in enumerate(robot_defaults(robot)['camera_names'])]


class CameraPublisher(Node):
    """Publishes every camera at `rate_hz`, all with the same stamp per frame.

    Images are `size` x `size` pixels, or `size` rows x `width` columns when `width` is given
    (e.g. size=480, width=640 for VGA cameras). `sent` maps each published stamp (nanoseconds)
    to the frame index it carried, so a test can rebuild exactly the images behind an action
    chunk from its header stamp.
    """

    def __init__(self, cameras: list[SimCamera], rate_hz: float = 10.0, size: int = 224,
                 static: bool = False, node_name: str = 'sim_cameras',
                 width: int | None = None, **kwargs):
        super().__init__(node_name, **kwargs)
        self.cameras = cameras
        self.size = size
        self.width = width or size
        self.static = static            # True: frame 0 forever (stamps still advance)
        self.index = 0
        self.sent: dict[int, int] = {}
        self._pubs = [self.create_publisher(CompressedImage if c.compressed else Image,
                                            c.topic, qos.SENSOR) for c in cameras]
        self.timer = self.create_timer(1.0 / rate_hz, self.publish_frame)

    def frame(self, camera: SimCamera, index: int) -> np.ndarray:
        """Image `index` of `camera`: uint8 [size, width, 3]."""
        still = self.static or camera.static
        return camera_frame(camera.photo, self.size, 0 if still else index, self.width)

    def publish_frame(self) -> None:
        now = self.get_clock().now()
        stamp = now.to_msg()
        for camera, pub in zip(self.cameras, self._pubs):
            rgb = self.frame(camera, self.index)
            pub.publish(compressed_msg(rgb, stamp, camera.name) if camera.compressed
                        else image_msg(rgb, stamp, camera.name))
        self.sent[now.nanoseconds] = self.index
        if len(self.sent) > 10_000:
            self.sent.pop(next(iter(self.sent)))
        self.index += 1


class JointStatePublisher(Node):
    """Publishes sensor_msgs/JointState for `names`: `base` plus a slow sine of `amplitude`."""

    def __init__(self, names: list[str], rate_hz: float = 50.0, amplitude: float = 0.05,
                 base: list[float] | None = None, node_name: str = 'sim_joint_states',
                 **kwargs):
        super().__init__(node_name, **kwargs)
        self.names = list(names)
        self.amplitude = amplitude
        self.base = np.asarray(base if base is not None else np.linspace(-0.3, 0.3, len(names)))
        self.index = 0
        self._pub = self.create_publisher(JointState, 'joint_states', qos.SENSOR)
        self.timer = self.create_timer(1.0 / rate_hz, self.publish_state)

    def state(self, index: int) -> np.ndarray:
        phase = 2 * math.pi * index / 200 + np.arange(len(self.names))
        return self.base + self.amplitude * np.sin(phase)

    def publish_state(self) -> None:
        msg = JointState()
        msg.header.stamp = self.get_clock().now().to_msg()
        msg.name = self.names
        msg.position = [float(v) for v in self.state(self.index)]
        self._pub.publish(msg)
        self.index += 1


class InstructionPublisher(Node):
    """Publishes the task (transient local: late joiners get it), cycling every `period_s`."""

    def __init__(self, instructions: list[str], period_s: float = 0.0,
                 node_name: str = 'sim_instruction', **kwargs):
        super().__init__(node_name, **kwargs)
        self.instructions = list(instructions)
        self.index = 0
        self._pub = self.create_publisher(String, 'instruction', qos.INSTRUCTION)
        self.publish_next()
        self.timer = (self.create_timer(period_s, self.publish_next)
                      if period_s > 0 and len(instructions) > 1 else None)

    def publish(self, text: str) -> None:
        self._pub.publish(String(data=text))

    def publish_next(self) -> None:
        self.publish(self.instructions[self.index % len(self.instructions)])
        self.index += 1


def main(argv: list[str] | None = None) -> int:
    """Run the simulated cameras, joint states and instruction until Ctrl-C."""
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--robot', default='libero',
                        help='a shipped robot (libero, droid, aloha, so101) or the path of a '
                             'robot YAML: its cameras and joints (default %(default)s)')
    parser.add_argument('--namespace', default='',
                        help="namespace of every topic (a fleet robot's name, e.g. arm_left)")
    parser.add_argument('--rate', type=float, default=10.0, help='camera frames per second')
    parser.add_argument('--size', type=int, default=224, help='image side in pixels (square)')
    parser.add_argument('--width', type=int, default=0,
                        help='image width in pixels (default: the height)')
    parser.add_argument('--height', type=int, default=0,
                        help='image height in pixels (default: --size)')
    parser.add_argument('--joint-rate', type=float, default=50.0, help='joint states per second')
    parser.add_argument('--compressed', action='store_true',
                        help='publish jpeg (sensor_msgs/CompressedImage on <topic>/compressed) '
                             'instead of raw rgb8')
    parser.add_argument('--dds-profile', default='', metavar='PATH|none',
                        help='Fast DDS profile of this process (default: the shipped one for '
                             "large frames, unless the environment names one; 'none': Fast "
                             "DDS's defaults)")
    parser.add_argument('--instruction', action='append',
                        help='task text (repeat to cycle through several)')
    parser.add_argument('--instruction-period', type=float, default=30.0)
    args, ros_args = parser.parse_known_args(argv)
    try:
        joints = robot_defaults(args.robot)['joint_names']
    except RobotSpecError as err:
        parser.error(str(err))
    from rclpy.executors import SingleThreadedExecutor

    # Before the first participant: Fast DDS reads its profile then.
    if args.dds_profile != 'none':   # a path given here wins over one in the environment
        os.environ.update(profile_environment(args.dds_profile or None,
                                              keep_existing=not args.dds_profile))
    rclpy.init(args=ros_args)
    height = args.height or args.size
    width = args.width or height
    ns = {'namespace': args.namespace}
    nodes = [CameraPublisher(robot_cameras(args.robot, args.compressed), args.rate, height,
                             width=width, **ns),
             JointStatePublisher(list(joints), args.joint_rate, **ns),
             InstructionPublisher(args.instruction or ['pick up the black bowl'],
                                  args.instruction_period, **ns)]
    # Single-threaded: a MultiThreadedExecutor spins while a callback group is busy (here the
    # JPEG encoding of a camera frame), taking CPU from the node the robot feeds.
    executor = SingleThreadedExecutor()
    for node in nodes:
        executor.add_node(node)
    try:
        executor.spin()
    except KeyboardInterrupt:
        pass
    except Exception as err:   # ExternalShutdownException (Ctrl-C on newer rclpy)
        if type(err).__name__ != 'ExternalShutdownException':
            raise
    finally:
        for node in nodes:
            node.destroy_node()
        executor.shutdown()
        if rclpy.ok():
            rclpy.shutdown()
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
