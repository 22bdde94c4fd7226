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
receive timestamp, so staleness is judged by arrival time, not by when the tick ran, and its
publication sequence number. `LostMessages` reads the subscription's "message lost" count the
same way, at tick time (no executor wake-up, one call per tick).
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from rclpy.callback_groups import CallbackGroup
from rclpy.impl.implementation_singleton import rclpy_implementation as _rclpy

try:   # Iron+ names the event module event_handler; Humble only has qos_event.
    from rclpy.event_handler import QoSSubscriptionEventType, UnsupportedEventTypeError
except ImportError:   # pragma: no cover - Humble
    from rclpy.qos_event import QoSSubscriptionEventType, UnsupportedEventTypeError

# The rcl event handle: EventHandle since Iron, QoSEvent on Humble.
_EVENT_HANDLE = getattr(_rclpy, 'EventHandle', None) or getattr(_rclpy, 'QoSEvent', None)


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


class Taken(NamedTuple):
    """A message taken from a polled subscription, with what the middleware says about it."""

    msg: Any
    age_s: float                    # since the middleware received it (0: it does not say)
    sequence: int | None = None     # its publisher's publication sequence number (Iron+)
    publisher: bytes = b''          # the publisher's gid (sequence numbers are per publisher)
    sent_s: float | None = None     # source timestamp, system clock seconds


def take_all(sub, limit: int = 64) -> list[Taken]:
    """Take every message waiting on `sub` (oldest first).

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
            info = info if isinstance(info, dict) else {}
            received_ns = info.get('received_timestamp', 0)
            age_s = max(0.0, (time.time_ns() - received_ns) * 1e-9) if received_ns else 0.0
            sequence = info.get('publication_sequence_number')
            sent_ns = info.get('source_timestamp', 0)
            taken.append(Taken(msg, age_s, sequence if isinstance(sequence, int) else None,
                               (info.get('publisher_gid') or {}).get('data', b''),
                               sent_ns * 1e-9 if sent_ns else None))
    return taken


class LostMessages:
    """The middleware's running count of messages `sub` lost, read at tick time.

    rmw_fastrtps counts a sample as lost when it never arrived whole (for raw frames: its
    fragments overran the sender's shared-memory segment); a message a depth-1 history
    replaced before it was taken is not lost. `total()` is None where the middleware or rclpy
    does not count (then the node estimates, runtime.inputs.TransportLoss).
    """

    def __init__(self, sub):
        self._event = None
        if _EVENT_HANDLE is None:
            return
        try:
            with sub.handle:
                self._event = _EVENT_HANDLE(
                    sub.handle, QoSSubscriptionEventType.RCL_SUBSCRIPTION_MESSAGE_LOST)
        except (UnsupportedEventTypeError, TypeError):
            self._event = None

    def total(self) -> int | None:
        """Return the messages lost since the subscription was made (None: not counted)."""
        if self._event is None:
            return None
        with self._event:
            status = self._event.take_event()
        return None if status is None else int(status.total_count)

    def destroy(self) -> None:
        if self._event is not None:
            self._event.destroy_when_not_in_use()
            self._event = None
