"""Engine results -> message objects of a rosbags typestore (the node's outputs, ROS-free).

Field by field the same messages the node publishes: ActionChunk on `actions`, LanguageChunk
on `language/tokens`, std_msgs/String on `language/narration`, DiagnosticArray on
`/diagnostics`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from rosbags.typesys.store import Typestore

from oxygen_ros.bag.typestore import ACTION_CHUNK, DIAGNOSTIC_ARRAY, LANGUAGE_CHUNK, STRING

if TYPE_CHECKING:   # the engine (and torch) load only when a replay runs
    from oxygen_ros.engine.types import ActionOutput, FinishedRequest, TokenDelta
    from oxygen_ros.runtime.actions import ActionLayout


def stamp_to_ns(stamp) -> int:
    """builtin_interfaces/Time -> integer nanoseconds."""
    return int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec)


def header(store: Typestore, stamp_ns: int, frame_id: str = ''):
    sec, nanosec = divmod(int(stamp_ns), 1_000_000_000)
    types = store.types
    return types['std_msgs/msg/Header'](
        stamp=types['builtin_interfaces/msg/Time'](sec=sec, nanosec=nanosec), frame_id=frame_id)


def action_chunk(store: Typestore, action: ActionOutput, stamp_ns: int, frame_id: str,
                 layout: ActionLayout):
    """Build an ActionChunk: header (observation stamp, robot frame), layout, row-major actions."""
    actions = np.asarray(action.actions, dtype=np.float32)       # [H, robot action dim]
    step_ns = max(round(layout.step_period_s * 1e9), 0)
    return store.types[ACTION_CHUNK](
        header=header(store, stamp_ns, frame_id), frame_index=int(action.frame_index),
        action_space=layout.action_space_id, names=list(layout.names),
        step_period=store.types['builtin_interfaces/msg/Duration'](
            sec=step_ns // 1_000_000_000, nanosec=step_ns % 1_000_000_000),
        horizon=int(actions.shape[0]), action_dim=int(actions.shape[1]),
        actions=np.ascontiguousarray(actions).reshape(-1),
        inference_time=float(action.inference_time_s), start_row=int(action.start_row))


def language_chunk(store: Typestore, delta: TokenDelta, stamp_ns: int, frame_id: str = ''):
    """Build the LanguageChunk of one request's new tokens in one frame."""
    return store.types[LANGUAGE_CHUNK](
        header=header(store, stamp_ns, frame_id), request_id=int(delta.request_id),
        origin_frame=int(delta.origin_frame),
        token_ids=np.asarray(delta.token_ids, dtype=np.int32), text_delta=delta.text,
        tokens_so_far=int(delta.tokens_so_far), done=bool(delta.done),
        finish_reason=delta.finish_reason)


def narration(store: Typestore, finished: FinishedRequest):
    """std_msgs/String with a finished request's full text."""
    return text(store, finished.text)


def text(store: Typestore, data: str):
    """std_msgs/String with `data`."""
    return store.types[STRING](data=data)


def diagnostic_array(store: Typestore, stamp_ns: int, statuses, hardware_id: str):
    """Convert the node's statuses (runtime.status.Status) to a DiagnosticArray."""
    types = store.types
    return types[DIAGNOSTIC_ARRAY](header=header(store, stamp_ns), status=[
        types['diagnostic_msgs/msg/DiagnosticStatus'](
            level=int(status.level), name=status.name, message=status.message[:1000],
            hardware_id=hardware_id,
            values=[types['diagnostic_msgs/msg/KeyValue'](key=str(k), value=str(v))
                    for k, v in status.values])
        for status in statuses])
