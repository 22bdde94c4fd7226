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


# --- engine outputs -> messages ------------------------------------------------------------------
def action_chunk_msg(action, stamp, frame_id: str):
    """Convert an engine ActionOutput to oxygen_ros/ActionChunk (stamp: a Time message)."""
    from oxygen_ros.msg import ActionChunk

    actions = np.asarray(action.actions, dtype=np.float32)   # [H, robot action dim]
    msg = ActionChunk()
    msg.header.stamp = stamp
    msg.header.frame_id = frame_id
    msg.frame_index = int(action.frame_index)
    msg.horizon, msg.action_dim = (int(d) for d in actions.shape)
    msg.actions = array.array('f', actions.tobytes())   # row-major [H * A]
    msg.inference_time = float(action.inference_time_s)
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
