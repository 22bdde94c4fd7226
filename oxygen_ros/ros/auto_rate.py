"""The node's auto rate, re-timed once on its first ticks (runtime/capacity.py RateSettler).

Configure times act() on a throwaway engine; the node's ticks also build inputs, publish and
share the machine with the robot's processes. After the node's first ticks the auto robots'
rate becomes what those ticks hold. A rate set by hand (or auto again) before then is kept.
"""

from __future__ import annotations

from oxygen_ros.runtime.capacity import RateSettler
from oxygen_ros.runtime.changes import observe_tick, settle


class AutoRate:
    """One configured engine's re-timing (start at configure; settle after every tick)."""

    def __init__(self, log):
        self._log = log                   # info(text): the node's logger
        self._settler: RateSettler | None = None

    def start(self, engine, settings) -> None:
        """Re-time `engine`'s auto robots (none: nothing to do) from their resolved rate."""
        self._settler = (RateSettler(engine.capacity,
                                     settings.robots[engine.auto[0]].control_rate_hz)
                         if engine.auto and engine.capacity is not None else None)

    def cancel(self) -> None:
        """Keep the rate as it is (a rate was set by hand)."""
        self._settler = None

    def settle(self, engine, loop, outcomes: dict, settings):
        """Count a tick (control thread); return the settings, re-timed once the ticks are in."""
        settler = self._settler
        if settler is None or engine is None:
            return settings
        if not observe_tick(settler, engine, loop, outcomes):
            return settings
        self._settler = None
        self._log.info(settler.describe())
        return settle(engine, loop, settings, settler)
