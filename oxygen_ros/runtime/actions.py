"""What an action chunk means, and how a controller plays chunks (ROS-free).

ActionLayout is the part of a robot spec a controller needs: what a row means (action space),
the column names and the time between rows. ChunkPlayback is the openpi client's loop for a
robot whose policy runs continuously: play the first `open_loop_rows` rows of a chunk, one
per step period, then switch to the newest chunk that arrived meanwhile (replan). The ROS
reference player (oxygen_ros.ros.chunk_player) is a timer around it.

    chunk k    [r0 r1 r2 r3 r4 | r5 ... rH-1]     played: r0..r4 (open_loop_rows = 5)
    chunk k+3                   [r0 r1 r2 ...]    newest when r4 was done: played next
"""

from __future__ import annotations

import dataclasses

import numpy as np

from oxygen_ros.model.robot_spec import (END_EFFECTOR_DELTA, get_robot, JOINT_POSITION,
                                         JOINT_VELOCITY, RobotSpec)

# ActionChunk.action_space values (msg/ActionChunk.msg constants; a test checks they agree).
ACTION_SPACE_IDS = {JOINT_POSITION: 0, JOINT_VELOCITY: 1, END_EFFECTOR_DELTA: 2}


@dataclasses.dataclass(frozen=True)
class ActionLayout:
    """How a controller reads one robot's action chunks."""

    action_space: str              # robot_spec.JOINT_POSITION / JOINT_VELOCITY / ...
    names: tuple[str, ...]         # one per action column
    step_period_s: float           # seconds between rows
    open_loop_rows: int            # rows openpi's client plays before it replans

    @property
    def action_space_id(self) -> int:
        """ActionChunk.action_space constant of this layout."""
        return ACTION_SPACE_IDS[self.action_space]


def action_layout(robot: str | RobotSpec) -> ActionLayout:
    """Return the action layout of a robot (a spec, a shipped robot's name or a YAML path)."""
    spec = get_robot(robot)
    return ActionLayout(spec.action_space, spec.action_names, spec.step_period_s,
                        spec.open_loop_rows)


def hold_command(action_space: str, names, last_row: np.ndarray | None) -> np.ndarray | None:
    """Return the command to send when there is nothing to play, or None to send nothing.

    Position and end-effector commands: nothing (forward controllers hold the last one).
    Joint velocities: zero, so the arm stops instead of moving on at the last speed; a
    gripper column (a position even in DROID's velocity space) keeps its last value.
    """
    if action_space != JOINT_VELOCITY or last_row is None:
        return None
    hold = np.zeros_like(last_row)
    for i, name in enumerate(names):
        if 'gripper' in name or 'finger' in name:
            hold[i] = last_row[i]
    return hold


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One received action chunk, as plain values."""

    stamp_s: float                 # observation time (node clock)
    actions: np.ndarray            # float [H, A]
    step_period_s: float           # seconds between rows
    frame_index: int = 0
    start_row: int = 0             # first row to play (ActionChunk.start_row)


@dataclasses.dataclass
class PlaybackStats:
    """Counters of a ChunkPlayback (for logs and tests)."""

    rows_played: int = 0
    chunks_started: int = 0        # chunks switched to (each one a replan)
    chunks_skipped: int = 0        # chunks replaced by a newer one before they were started
    chunks_stale: int = 0          # chunks dropped for age
    starved_steps: int = 0         # steps with nothing to play (held the last command)


class ChunkPlayback:
    """Plays `open_loop_rows` rows of each chunk from its start_row, then replans.

    offer(chunk) stores the newest chunk; step(now_s) returns the row to command at this step.
    When the open-loop rows are done and no newer chunk has arrived, playback goes on along
    the current chunk; it returns None (the controller holds) when there is no chunk yet, the
    chunk has no rows left, or it is older than `max_age_s` (a robot must not act on an old
    observation; a pending chunk that old is dropped).
    """

    def __init__(self, open_loop_rows: int, max_age_s: float = 1.0):
        if open_loop_rows < 1:
            raise ValueError(f'open_loop_rows must be >= 1, got {open_loop_rows}')
        self.open_loop_rows = open_loop_rows
        self.max_age_s = max_age_s
        self.stats = PlaybackStats()
        self._pending: Chunk | None = None    # newest chunk not yet started
        self._current: Chunk | None = None
        self._next_row = 0
        self._first_row = 0                   # the current chunk's start_row

    @property
    def current(self) -> Chunk | None:
        """The chunk being played (None before the first one)."""
        return self._current

    def offer(self, chunk: Chunk) -> None:
        """Store `chunk` if it is newer than everything seen; older ones are ignored."""
        newest = self._pending or self._current
        if newest is not None and chunk.stamp_s <= newest.stamp_s:
            return
        if self._pending is not None:
            self.stats.chunks_skipped += 1
        self._pending = chunk

    def _plan_done(self) -> bool:
        return (self._current is None
                or self._next_row - self._first_row >= self.open_loop_rows)

    def step(self, now_s: float) -> np.ndarray | None:
        """Return the row to command now (float [A]), or None to hold."""
        if self._plan_done() and self._pending is not None:
            pending, self._pending = self._pending, None
            if now_s - pending.stamp_s > self.max_age_s:
                self.stats.chunks_stale += 1
            else:
                # Rows before start_row play while the chunk is computed (real-time chunking).
                self._first_row = self._next_row = min(max(pending.start_row, 0),
                                                       len(pending.actions))
                self._current = pending
                self.stats.chunks_started += 1
        current = self._current
        # No newer chunk when the plan is done: go on along the current one (still a plan,
        # only less fresh) while it has rows and is not too old; then hold.
        if (current is None or self._next_row >= len(current.actions)
                or (self._plan_done() and now_s - current.stamp_s > self.max_age_s)):
            self.stats.starved_steps += 1
            return None
        row = current.actions[self._next_row]
        self._next_row += 1
        self.stats.rows_played += 1
        return row
