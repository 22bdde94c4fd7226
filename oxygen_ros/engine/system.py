"""System: the one interface every compared system implements, and the runtime calls.

isolated / shared / oxygen / oxygen-adaptive are `Engine`s that differ in budget and prefix
sharing; parallel is `ParallelSystem` (two processes). Callers hold a System and never probe
for attributes.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from oxygen_ros.engine.budget import Budget
from oxygen_ros.engine.types import ActionOutput, FrameResult, Observation
from oxygen_ros.engine.workload import LanguagePolicy


@runtime_checkable
class System(Protocol):
    """One frame = act(obs), publish the actions, then advance_language()."""

    system: str                 # its name in SYSTEMS
    policy: LanguagePolicy      # when requests start and how long they run (read-only here)
    budget: Budget              # decode budget in use (read-only here; set_budget changes it)

    def act(self, obs: Observation) -> ActionOutput:
        """Compute the frame's actions; no language work before they return.

        An Engine also takes `continuation` (engine.types.Continuation): real-time chunking.
        """

    def advance_language(self) -> FrameResult:
        """Language work of the frame act() began (or of live requests alone, without one)."""

    def step(self, obs: Observation) -> FrameResult:
        """act() then advance_language()."""

    @property
    def num_live_requests(self) -> int:
        """Requests still running (they advance on a tick without a frame too)."""

    def set_budget(self, budget: Budget) -> None:
        """Use `budget` from the next frame on."""

    def set_policy(self, policy: LanguagePolicy) -> None:
        """Use `policy` for requests that arrive from the next frame on."""

    def close(self) -> None:
        """Release processes or devices held (idempotent)."""
