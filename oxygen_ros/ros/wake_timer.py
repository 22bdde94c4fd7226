"""The node's wake timer: fires at the robots' own ticks and wakes the control thread.

A ROS timer (node clock: use_sim_time follows /clock) re-armed after every wake-up for the
next robot grid time (FrameLoop.next_wake_s), so 10 and 15 Hz robots wake it 25 times a
second, never on a finer common grid. Its callback runs on the executor and only triggers.
"""

from __future__ import annotations

from typing import Callable

WAKE_TOLERANCE_S = 1e-3   # the timer is re-armed when it would fire further off a tick


class WakeTimer:
    """One timer of `node` while the control loop runs (start .. stop)."""

    def __init__(self, node, now_s: Callable[[], float]):
        self._node, self._now_s = node, now_s
        self._timer = None

    def start(self, first_s: float, on_wake: Callable[[], None]) -> None:
        """Fire on_wake in first_s, then as rearm() sets it."""
        self._timer = self._node.create_timer(first_s, on_wake)

    def rearm(self, loop) -> None:
        """Fire next at `loop`'s next robot tick (nothing when the timer already does)."""
        timer = self._timer
        if timer is None:
            return
        now_s = self._now_s()
        wait_s = loop.next_wake_s(now_s) - now_s
        until_ns = timer.time_until_next_call()
        if until_ns is None or abs(until_ns * 1e-9 - wait_s) > WAKE_TOLERANCE_S:
            timer.timer_period_ns = max(int(wait_s * 1e9), 1)
            timer.reset()

    @property
    def running(self) -> bool:
        return self._timer is not None

    def stop(self) -> None:
        """Destroy the timer: no more wake-ups."""
        if self._timer is not None:
            self._node.destroy_timer(self._timer)
            self._timer = None
