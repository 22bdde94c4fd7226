"""Real-time chunking in the runtime: the committed chunk, the delay d, and what a robot plays.

The model's side (the inpainting math) is oxygen_ros.model.rtc; this module decides, before
each act(), what the new chunk must continue (ROS-free; the node, the replays and the policy
server use it). Timing, as ActionChunk.msg defines it: row i of a chunk observed at stamp s
plays at s + (i + 1) * step_period (docs/rtc.md has the diagram).

    committed chunk (stamp s0)   r0  r1  r2  r3 | r4  r5  r6  r7  r8  r9
    new chunk (stamp s1 = s0+4P)                | n0  n1  n2  n3  n4  n5 ...
                                                  ^^^^^^ rows that play before the new chunk
                                                  is out (latency L): d = ceil(L / P) - 1

  CommittedChunk  the newest chunk sent and when each row plays; rows_at(s1) are its rows at
                  the new chunk's row times (interpolated when the stamps are not whole steps
                  apart; exact when they are).
  LatencyWindow   observation stamp -> chunk out, over recent chunks: delay 'auto' reads its
                  p95.
  RtcPlanner      one robot: settings + the two above -> the Continuation for act(), and what
                  was published (record) for the next one.
  played_path     what a robot that switches to each chunk at its start_row plays: the
                  boundary jumps and total variation the benchmark reports.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

from oxygen_ros.engine.types import ActionOutput, Continuation, Observation
from oxygen_ros.model.robot_spec import get_robot
from oxygen_ros.runtime.params import AUTO_DELAY, GUIDED, OFF, PREFIX, RtcSettings, Settings

LATENCY_WINDOW = 50              # chunks whose latency the auto delay looks at
MAX_LATENCY_S = 5.0              # a longer stamp-to-chunk latency means another clock


def delay_rows(latency_s: float, step_period_s: float) -> int:
    """Rows of a chunk that play before it is out, `latency_s` after its observation.

    Row i plays at stamp + (i + 1) * step_period, so the first row still ahead at
    stamp + latency is ceil(latency / step_period) - 1.
    """
    # A latency of exactly k steps (up to float noise) leaves row k - 1 playable.
    return max(0, math.ceil(latency_s / step_period_s - 1e-9) - 1)


class LatencyWindow:
    """Recent latencies (observation stamp -> chunk out), for delay 'auto'."""

    def __init__(self, size: int = LATENCY_WINDOW):
        self._latencies: collections.deque[float] = collections.deque(maxlen=size)

    def __len__(self) -> int:
        return len(self._latencies)

    def observe(self, latency_s: float) -> None:
        if math.isfinite(latency_s) and latency_s >= 0:
            self._latencies.append(latency_s)

    def p95(self) -> float | None:
        """95th percentile of the window (None before the first latency)."""
        if not self._latencies:
            return None
        return float(np.percentile(np.fromiter(self._latencies, float), 95))


class CommittedChunk:
    """The newest chunk sent to the robot and the time each of its rows plays."""

    def __init__(self):
        self.actions: np.ndarray | None = None   # float [H, A] robot units (as published)
        self.stamp_s = 0.0                       # its observation stamp
        self.step_period_s = 0.0

    def record(self, actions: np.ndarray, stamp_s: float, step_period_s: float) -> None:
        """Remember `actions` [H, A] (observed at stamp_s) as the chunk the robot executes."""
        self.actions = np.asarray(actions)   # its own dtype: rows read back round to it
        self.stamp_s = float(stamp_s)
        self.step_period_s = float(step_period_s)

    def clear(self) -> None:
        self.actions = None

    def rows_at(self, stamp_s: float) -> np.ndarray | None:
        """Return the committed rows at the times of a new chunk's rows 0, 1, ... ([n, A]).

        A new chunk observed at stamp_s plays row j at stamp_s + (j + 1) P; the committed
        path is read there, linearly between its rows (exactly a row when the stamps are a
        whole number of steps apart), up to its last row. None when nothing is committed, the
        new observation is older than the committed one (a clock jumped back), or the
        committed chunk has no row left.
        """
        if self.actions is None or stamp_s < self.stamp_s:
            return None
        offset = (stamp_s - self.stamp_s) / self.step_period_s   # in committed rows
        whole = round(offset)
        if abs(offset - whole) < 1e-6:   # stamps a whole number of steps apart: rows as is
            return self.actions[whole:] if whole < len(self.actions) else None
        times = offset + np.arange(len(self.actions))
        times = times[times <= len(self.actions) - 1]
        if not times.size:
            return None
        below = np.floor(times).astype(int)
        above = np.minimum(below + 1, len(self.actions) - 1)
        frac = (times - below)[:, None]
        rows = self.actions[below] * (1 - frac) + self.actions[above] * frac   # float64
        return rows.astype(self.actions.dtype, copy=False)


class RtcPlanner:
    """One robot's real-time chunking between act() calls (see the module docstring).

    trace: keep every recorded chunk (PlayedChunk) for played_path (replays, bench).
    The engine caps d below the chunk's horizon (a chunk always has a row to play).
    """

    def __init__(self, settings: RtcSettings, step_period_s: float, *, trace: bool = False):
        problems = settings.problems()
        if problems:
            raise ValueError('; '.join(problems))
        if not step_period_s > 0:
            raise ValueError(f'step_period_s must be > 0, got {step_period_s}')
        self.settings = settings
        self.step_period_s = step_period_s
        self.committed = CommittedChunk()
        self.latency = LatencyWindow()
        self.trace: list[PlayedChunk] | None = [] if trace else None

    def delay(self) -> int:
        """Return d in rows: the setting, or from the latency p95 (auto; 0 before any)."""
        d = self.settings.delay
        if d == AUTO_DELAY:
            p95 = self.latency.p95()
            d = 0 if p95 is None else delay_rows(p95, self.step_period_s)
        return d

    def continuation(self, obs: Observation) -> Continuation | None:
        """Return what the chunk of `obs` continues (None: RTC off or nothing committed)."""
        return self.continue_rows(self.committed.rows_at(obs.stamp))

    def continue_rows(self, rows: np.ndarray | None, delay: int | None = None
                      ) -> Continuation | None:
        """Return the Continuation of committed `rows` [n, A] (None: RTC off or no rows).

        delay: d in rows (None: the planner's, see delay()).
        """
        s = self.settings
        if not s.enabled or rows is None or not len(rows):
            return None
        return Continuation(rows, self.delay() if delay is None else delay, s.mode,
                            s.execution_horizon, s.schedule, s.max_guidance_weight)

    def record(self, action: ActionOutput, out_s: float) -> None:
        """Record a chunk sent to the robot at out_s (the stamps' clock): now committed."""
        latency = out_s - action.stamp
        if not 0.0 <= latency <= MAX_LATENCY_S:
            # Camera stamps on another clock than the node's: the engine's own time is the
            # part of the latency that is known.
            latency = action.inference_time_s
        self.latency.observe(latency)
        self.committed.record(action.actions, action.stamp, self.step_period_s)
        if self.trace is not None:
            self.trace.append(PlayedChunk(action.stamp, np.array(action.actions),
                                          action.start_row, action.inference_time_s))


def planner_for(settings: Settings, **options) -> RtcPlanner:
    """Return the RtcPlanner of one robot's settings (its robot's step period)."""
    spec = settings.spec if settings.spec is not None else get_robot(settings.robot)
    return RtcPlanner(settings.rtc, spec.step_period_s, **options)


@dataclasses.dataclass
class PlayedChunk:
    """A chunk as the robot receives it (for played_path)."""

    stamp_s: float                   # observation stamp: row i plays at stamp + (i + 1) P
    actions: np.ndarray              # float [H, A] robot units
    start_row: int = 0               # first row the robot plays
    act_s: float = 0.0               # the engine's act() time for it


@dataclasses.dataclass
class PlayedPath:
    """What a robot plays from a sequence of chunks, and how smooth it is."""

    times_s: np.ndarray              # float [T] when each played row plays
    rows: np.ndarray                 # float [T, A] the played rows
    chunk_of_row: np.ndarray         # int [T] index (in the chunk list) of each row's chunk
    jumps: np.ndarray                # float [K] boundary jumps: ||first new - last old||
    boundary_times_s: np.ndarray     # float [K] when each new chunk's first row plays
    gaps: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    #                                  float [K] ||first new - what the old chunk had for then||

    @property
    def total_variation(self) -> float:
        """Sum of ||row[t+1] - row[t]|| along the played path."""
        if len(self.rows) < 2:
            return 0.0
        return float(np.linalg.norm(np.diff(self.rows, axis=0), axis=1).sum())


def played_path(chunks: list[PlayedChunk], step_period_s: float) -> PlayedPath:
    """Simulate a robot that switches to each chunk at its start_row, one row per step.

    Chunk k plays from row start_row at stamp + (start_row + 1) P until the next chunk's
    first row is due (or holds its last row when it runs out). A chunk superseded before its
    first row is due is never played. The boundary jump is the distance (L2 over the action
    columns) between the last row played of the old chunk and the first row of the new one;
    the gap is the distance between that first new row and the old chunk's row for the same
    time (it leaves out the path's own step between two rows; NaN when the old chunk has no
    row then).
    """
    P = step_period_s
    times, rows, owners, jumps, boundaries, gaps = [], [], [], [], [], []
    starts = [c.stamp_s + (c.start_row + 1) * P for c in chunks]
    last_row = None
    committed = CommittedChunk()
    for k, chunk in enumerate(chunks):
        # Played until the first later chunk that starts after this one does.
        end = next((starts[j] for j in range(k + 1, len(chunks)) if starts[j] > starts[k]),
                   math.inf)
        if any(starts[j] <= starts[k] for j in range(k + 1, len(chunks))):
            continue   # a newer chunk starts no later: this one is never played
        first = True
        for i in range(chunk.start_row, len(chunk.actions)):
            t = chunk.stamp_s + (i + 1) * P
            if t >= end - 1e-9:
                break
            row = chunk.actions[i]
            if first and last_row is not None:
                jumps.append(float(np.linalg.norm(row - last_row)))
                boundaries.append(t)
                then = committed.rows_at(chunk.stamp_s)   # old rows at this chunk's row times
                gaps.append(float(np.linalg.norm(row - then[i])) if then is not None
                            and i < len(then) else math.nan)
            if first:
                committed.record(chunk.actions, chunk.stamp_s, P)
            first = False
            times.append(t)
            rows.append(row)
            owners.append(k)
            last_row = row
    width = chunks[0].actions.shape[1] if chunks else 0
    return PlayedPath(np.array(times), np.array(rows).reshape(-1, width), np.array(owners, int),
                      np.array(jumps), np.array(boundaries), np.array(gaps))


def compare_runs(traces: dict[str, list[PlayedChunk]], step_period_s: float,
                 delay: int) -> tuple[list[dict], dict[str, PlayedPath]]:
    """Compare runs of the same frames with RTC off and on: one row per mode, and the paths.

    Every run is played from the same row of each chunk, the first past the delay, so the
    boundary jumps compare what the chunks hold, not when they start. Per mode: the jumps
    (mean, p95, max), the path's total variation, act() time, and how far the rows the delay
    freezes lie from the committed ones (0 for prefix); ratios are over mode 'off'.
    """
    paths = {mode: played_path([dataclasses.replace(c, start_row=delay) for c in chunks],
                               step_period_s) for mode, chunks in traces.items()}
    rows = []
    for mode, chunks in traces.items():
        path = paths[mode]
        # the path's own steps (between two rows of one chunk): the floor of any jump
        within = [float(np.linalg.norm(b - a)) for a, b, same in zip(
            path.rows, path.rows[1:], np.diff(path.chunk_of_row) == 0) if same]
        frozen = []
        committed = CommittedChunk()
        for chunk in chunks:
            rows_then = committed.rows_at(chunk.stamp_s)
            if rows_then is not None and delay:
                n = min(delay, len(rows_then))
                frozen.append(float(np.abs(chunk.actions[:n] - rows_then[:n]).max()))
            committed.record(chunk.actions, chunk.stamp_s, step_period_s)
        act = np.array([c.act_s for c in chunks])
        rows.append({'mode': mode, 'chunks': len(chunks), 'delay_rows': delay,
                     'boundaries': len(path.jumps),
                     'jump_mean': float(path.jumps.mean()) if len(path.jumps) else math.nan,
                     'jump_p95': (float(np.percentile(path.jumps, 95)) if len(path.jumps)
                                  else math.nan),
                     'jump_max': float(path.jumps.max()) if len(path.jumps) else math.nan,
                     'gap_mean': float(np.nanmean(path.gaps)) if np.isfinite(
                         path.gaps).any() else math.nan,
                     'row_step_mean': float(np.mean(within)) if within else math.nan,
                     'total_variation': path.total_variation,
                     'act_ms_p50': 1e3 * float(np.median(act)) if act.size else math.nan,
                     'frozen_rows_max_diff': max(frozen, default=math.nan)})
    off = next((r for r in rows if r['mode'] == OFF), None)
    for row in rows:
        for key in ('jump_mean', 'gap_mean', 'total_variation', 'act_ms_p50'):
            row[f'{key}_vs_off'] = row[key] / off[key] if off and off[key] else math.nan
    return rows, paths


def plot_paths(paths: dict[str, PlayedPath], column: int, name: str, title: str,
               boundaries: int = 6):
    """Plot one action column across a few chunk boundaries, one line per mode (a Figure).

    The window starts a third into the run (past the first chunks) and spans `boundaries`
    switches of the first path; dashed lines mark where a new chunk takes over.
    """
    import matplotlib
    matplotlib.use('Agg')   # files only
    import matplotlib.pyplot as plt

    first = next(iter(paths.values()))
    times = first.boundary_times_s
    if not len(times):
        return None
    start = len(times) // 3
    lo = times[max(start - 1, 0)]
    hi = times[min(start + boundaries, len(times) - 1)]
    origin = first.times_s[0]        # stamps may be wall-clock seconds: plot from the start
    fig, ax = plt.subplots(figsize=(8, 3.6))
    styles = {OFF: ('tab:red', 'o'), GUIDED: ('tab:blue', 's'), PREFIX: ('tab:green', '^')}
    for mode, path in paths.items():
        keep = (path.times_s >= lo) & (path.times_s <= hi)
        colour, marker = styles.get(mode, ('black', '.'))
        ax.plot(path.times_s[keep] - origin, path.rows[keep, column], marker=marker,
                markersize=3, color=colour, label=f'{mode}: mean jump {path.jumps.mean():.3f}'
                if len(path.jumps) else mode)
    for t in times[(times >= lo) & (times <= hi)]:
        ax.axvline(t - origin, color='grey', linestyle='--', linewidth=0.7)
    ax.set_xlabel('time (s) since the first row: each row when it plays; dashed: a new chunk '
                  'takes over')
    ax.set_ylabel(name)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
