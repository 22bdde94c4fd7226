"""Subscriptions the control thread reads at tick time instead of an executor callback each.

Why: cameras and joint states arrive at 15-100 Hz each while the node acts at a few Hz. With a
callback per message, the executor thread wakes, takes, deserializes and runs Python for every
message (~80 per second in the benchmark), which cost 7-9% of a core and competed with the
model for the GIL. The frame loop only ever uses the newest message, so the node takes it when
a tick needs it: DDS keeps the newest sample in the subscription's history (depth 1 for
cameras), the control thread takes it at the start of the tick, and the executor never sees
these subscriptions at all. This is rclcpp's `Subscription::take` pattern, spelled in rclpy.

How: the subscriptions live in a `PolledGroup`, a callback group that no executor may run
(`can_execute` is False, so executors leave its entities out of their wait sets). `take_all`
drains one subscription and returns each message with its age, read from the middleware's
receive timestamp, so staleness is judged by arrival time, not by when the tick ran.
"""

from __future__ import annotations

import time
from typing import Any

from rclpy.callback_groups import CallbackGroup


class PolledGroup(CallbackGroup):
    """A callback group no executor runs: its subscriptions are read with `take_all`."""

    def can_execute(self, entity) -> bool:
        return False

    def beginning_execution(self, entity) -> bool:
        return False

    def ending_execution(self, entity) -> None:
        pass


def never_called(msg) -> None:
    """Stand in as the callback of a polled subscription (executors never run it)."""
    raise RuntimeError('a polled subscription was run by an executor')


def take_all(sub, limit: int = 64) -> list[tuple[Any, float]]:
    """Take every message waiting on `sub` (oldest first) as (message, age in seconds).

    The age comes from the middleware's receive timestamp (system clock); a middleware that
    leaves it at zero gives age 0 (received now). At most `limit` messages are taken per call,
    so a flooding publisher cannot hold the control thread.
    """
    taken = []
    with sub.handle:
        for _ in range(limit):
            msg_info = sub.handle.take_message(sub.msg_type, sub.raw)
            if msg_info is None:
                break
            msg, info = msg_info
            received_ns = info.get('received_timestamp', 0) if isinstance(info, dict) else 0
            age_s = max(0.0, (time.time_ns() - received_ns) * 1e-9) if received_ns else 0.0
            taken.append((msg, age_s))
    return taken
