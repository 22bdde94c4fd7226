"""Engine outputs -> ActionChunk / LanguageChunk messages, and stamps.

Inputs come in through oxygen_ros.runtime.conversions (message fields -> numpy, shared with the
bag replay).
"""

from __future__ import annotations

import array

import numpy as np


def seconds_to_stamp(seconds: float):
    """Float seconds -> builtin_interfaces/Time (rounded to the nanosecond)."""
    from builtin_interfaces.msg import Time

    total_ns = max(int(round(seconds * 1e9)), 0)
    return Time(sec=total_ns // 1_000_000_000, nanosec=total_ns % 1_000_000_000)


def seconds_to_duration(seconds: float):
    """Float seconds (>= 0) -> builtin_interfaces/Duration (rounded to the nanosecond)."""
    from builtin_interfaces.msg import Duration

    total_ns = max(int(round(seconds * 1e9)), 0)
    return Duration(sec=total_ns // 1_000_000_000, nanosec=total_ns % 1_000_000_000)


# --- engine outputs -> messages ------------------------------------------------------------------
def action_chunk_msg(action, stamp, frame_id: str, layout):
    """Convert an engine ActionOutput to oxygen_ros/ActionChunk (stamp: a Time message).

    layout: the robot's runtime.actions.ActionLayout (action space, column names, step).
    """
    from oxygen_ros.msg import ActionChunk

    actions = np.asarray(action.actions, dtype=np.float32)   # [H, robot action dim]
    msg = ActionChunk()
    msg.header.stamp = stamp
    msg.header.frame_id = frame_id
    msg.frame_index = int(action.frame_index)
    msg.action_space = layout.action_space_id
    msg.names = list(layout.names)
    msg.step_period = seconds_to_duration(layout.step_period_s)
    msg.horizon, msg.action_dim = (int(d) for d in actions.shape)
    msg.actions = array.array('f', actions.tobytes())   # row-major [H * A]
    msg.inference_time = float(action.inference_time_s)
    msg.start_row = int(action.start_row)
    return msg


def joint_trajectory_msg(action, frame_id: str, layout):
    """Convert an engine ActionOutput of a joint-position robot to trajectory_msgs/JointTrajectory.

    The rows from action.start_row on (the first past the inference delay; 0 without
    real-time chunking) become points, the j-th at (j + 1) * step period. The header stamp is
    left at zero, which joint_trajectory_controller reads as "start on receipt": the
    observation stamp lies in the past, and a trajectory starting then would have its first
    points skipped.
    """
    from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

    actions = np.asarray(action.actions, dtype=np.float64)[action.start_row:]   # [n, joints]
    msg = JointTrajectory()
    msg.header.frame_id = frame_id
    msg.joint_names = list(layout.names)
    msg.points = [JointTrajectoryPoint(positions=row.tolist(),
                                       time_from_start=seconds_to_duration(
                                           (i + 1) * layout.step_period_s))
                  for i, row in enumerate(actions)]
    return msg


def language_chunk_msg(delta, stamp, frame_id: str):
    """Convert an engine TokenDelta to oxygen_ros/LanguageChunk."""
    from oxygen_ros.msg import LanguageChunk

    msg = LanguageChunk()
    msg.header.stamp = stamp
    msg.header.frame_id = frame_id
    msg.request_id = int(delta.request_id)
    msg.origin_frame = int(delta.origin_frame)
    msg.token_ids = array.array('i', [int(t) for t in delta.token_ids])
    msg.text_delta = delta.text
    msg.tokens_so_far = int(delta.tokens_so_far)
    msg.done = bool(delta.done)
    msg.finish_reason = delta.finish_reason
    return msg


def actions_from_msg(msg) -> np.ndarray:
    """Unpack an ActionChunk to float32 [horizon, action_dim] (subscribers, tests)."""
    return np.asarray(msg.actions, dtype=np.float32).reshape(msg.horizon, msg.action_dim)


def duration_to_seconds(duration) -> float:
    """builtin_interfaces/Duration -> float seconds."""
    return duration.sec + duration.nanosec * 1e-9
