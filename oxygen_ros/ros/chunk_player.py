"""`chunk_player`: a reference controller client that plays ActionChunks as openpi's do.

    python -m oxygen_ros.ros.chunk_player --ros-args -p open_loop_rows:=8 \
        -r commands:=/forward_velocity_controller/commands

Subscribes `actions` (oxygen_ros/ActionChunk), plays `open_loop_rows` rows of each chunk from
its `start_row` (0, or the first row past real-time chunking's delay), one per the chunk's
step period, then switches to the newest chunk (replanning; the
logic is oxygen_ros.runtime.actions.ChunkPlayback), and publishes each row on `commands` as
std_msgs/Float64MultiArray, the message ros2_control's forward_command_controller
(forward_position_controller, forward_velocity_controller) takes, one value per joint in the
chunk's `names` order. With nothing to play it holds: position commands stop coming (the
controller keeps the last one); velocity commands go to zero.

Joint-position robots can skip this node: oxygen_node's `publish_trajectory` sends each chunk
as a JointTrajectory that joint_trajectory_controller plays itself.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import rclpy
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.node import Node
from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor
from std_msgs.msg import Float64MultiArray

from oxygen_ros.msg import ActionChunk
from oxygen_ros.ros import qos
from oxygen_ros.ros.conversions import actions_from_msg, duration_to_seconds
from oxygen_ros.runtime.actions import ACTION_SPACE_IDS, Chunk, ChunkPlayback, hold_command
from oxygen_ros.runtime.conversions import stamp_to_seconds

SPACE_NAMES = {v: k for k, v in ACTION_SPACE_IDS.items()}


class ChunkPlayer(Node):
    """Plays the newest action chunk row by row on `commands` (see the module docstring)."""

    def __init__(self, node_name: str = 'chunk_player', **kwargs):
        super().__init__(node_name, **kwargs)
        rows = self.declare_parameter('open_loop_rows', 5, ParameterDescriptor(
            description='Rows of a chunk played before switching to the newest one (openpi: '
                        'DROID 8, LIBERO 5, ALOHA 25).', read_only=True,
            integer_range=[IntegerRange(from_value=1, to_value=1000, step=1)])).value
        max_age = self.declare_parameter('max_chunk_age_s', 1.0, ParameterDescriptor(
            description='A chunk whose observation is older than this is not played.',
            read_only=True,
            floating_point_range=[FloatingPointRange(from_value=0.01, to_value=60.0,
                                                     step=0.0)])).value
        self.playback = ChunkPlayback(rows, max_age)
        self.commands_sent = 0
        self._layout = None          # (action space, names) of the newest chunk
        self._last_row = None
        self._period_s = 0.0
        self._timer = None
        # A group each: in a multi-threaded executor a step timer that is always ready (a loaded
        # machine) would otherwise starve the chunk subscription of its shared default group.
        self._timer_group = MutuallyExclusiveCallbackGroup()
        self._lock = threading.Lock()   # the playback, between the two groups
        self._pub = self.create_publisher(Float64MultiArray, 'commands', qos.COMMANDS)
        self.create_subscription(ActionChunk, 'actions', self._on_chunk, qos.ACTIONS,
                                 callback_group=MutuallyExclusiveCallbackGroup())

    def _now_s(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    def _on_chunk(self, msg: ActionChunk) -> None:
        period = duration_to_seconds(msg.step_period)
        if period <= 0 or msg.horizon == 0 or len(msg.actions) != msg.horizon * msg.action_dim:
            self.get_logger().warning(f'chunk {msg.frame_index} ignored: step period '
                                      f'{period:g} s, {msg.horizon} x {msg.action_dim} rows')
            return
        self._layout = (SPACE_NAMES.get(msg.action_space, ''), list(msg.names))
        chunk = Chunk(stamp_to_seconds(msg.header.stamp), actions_from_msg(msg), period,
                      int(msg.frame_index), int(msg.start_row))
        with self._lock:
            self.playback.offer(chunk)
        if abs(period - self._period_s) > 1e-9:   # the first chunk, or a new step period
            self._period_s = period
            if self._timer is not None:
                self.destroy_timer(self._timer)
            self._timer = self.create_timer(period, self._step,
                                            callback_group=self._timer_group)

    def _step(self) -> None:
        with self._lock:
            row = self.playback.step(self._now_s())
        if row is None:
            space, names = self._layout or ('', [])
            row = hold_command(space, names, self._last_row)
            self._last_row = None   # hold once, then stay quiet
            if row is None:
                return
        else:
            self._last_row = row
        self._pub.publish(Float64MultiArray(data=np.asarray(row, np.float64).tolist()))
        self.commands_sent += 1


def main(args=None) -> int:
    """Run the chunk player until Ctrl-C."""
    from oxygen_ros.ros.node import default_discovery_to_localhost

    default_discovery_to_localhost()   # as oxygen_node: DDS stays on this machine by default
    rclpy.init(args=args)
    node = ChunkPlayer()
    try:
        rclpy.spin(node)
    except KeyboardInterrupt:
        pass
    finally:
        node.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()
    return 0


if __name__ == '__main__':
    sys.exit(main())
