"""Replay a LeRobot dataset through the engine: the bag replay's frame loop, an MCAP out.

Each dataset frame is one tick of the node's frame loop (runtime.frame_loop.FrameLoop, the one
the node and the bag replay run): its camera images and state go into the same latest-input
buffer, its task is the instruction, and the tick acts, emits, then advances language. The
output bag has the node's topics (actions, language/tokens, language/narration) at the frame's
time, plus the chunk's error against the recorded actions:

    /evaluation/action_error   std_msgs/Float32MultiArray [2, A]: row 0 L1, row 1 MSE per
                               action dimension, over the chunk's rows (oxygen_ros.dataset)

and next to the bag's files action_error.json (per episode, per dimension) and
action_error.png. Episodes are laid one after the other on the bag's time axis, a second
apart. Deterministic for a fixed k: noise depends on (seed, frame index), decoding is greedy.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from oxygen_ros.bag.config import ReplayParams
from oxygen_ros.bag.errors import BagError
from oxygen_ros.bag.replay import (_BagOutputs, _progress_bar, build_engine, check_new_output,
                                   MAX_DRAIN_TICKS, recorded_run, ReplaySummary, StopOnRequest)
from oxygen_ros.bag.typestore import make_typestore
from oxygen_ros.bag.writer import OutputBag
from oxygen_ros.dataset import ActionErrors, chunk_error, DatasetError, LeRobotDataset
from oxygen_ros.runtime import inputs
from oxygen_ros.runtime.frame_loop import FrameLoop
from oxygen_ros.runtime.rtc import planner_for

ERROR_TOPIC = '/evaluation/action_error'
FLOAT_ARRAY = 'std_msgs/msg/Float32MultiArray'
EPISODE_GAP_S = 1.0
ERRORS_FILE = 'action_error.json'
PLOT_FILE = 'action_error.png'


@dataclasses.dataclass
class DatasetReplaySummary(ReplaySummary):
    """A replay summary plus the action error of every episode."""

    episodes: list[dict] = dataclasses.field(default_factory=list)

    def format(self) -> str:
        lines = [super().format()]
        for e in self.episodes:
            lines.append(f'  episode {e["episode"]}: {e["frames"]} frames, action L1 '
                         f'{e["l1_mean"]:.4f}, MSE {e["mse_mean"]:.4f} (per dimension in '
                         f'{ERRORS_FILE})')
        return '\n'.join(lines)


def default_camera_map(dataset: LeRobotDataset, cameras: list[str]) -> dict[str, str]:
    """Map robot cameras to the dataset features named after them.

    Tried in order: observation.images.<camera>, observation.<camera>, <camera>.
    """
    mapping = {}
    for camera in cameras:
        for feature in (f'observation.images.{camera}', f'observation.{camera}', camera):
            if feature in dataset.cameras:
                mapping[camera] = feature
                break
    return mapping


class DatasetReplay(StopOnRequest):
    """One replay of a LeRobot dataset into `out`; run() returns a DatasetReplaySummary.

    camera_map: robot camera name -> dataset feature (over default_camera_map's); episodes:
    indices to replay (default: all); system: an engine System (default: built from params).
    """

    def __init__(self, dataset: str | Path, out: str | Path, params: ReplayParams, *,
                 camera_map: dict[str, str] | None = None, state_key: str = 'observation.state',
                 action_key: str = 'action', episodes: list[int] | None = None, system=None,
                 storage: str = 'mcap', overwrite: bool = False, progress: bool = False,
                 rtc_trace: bool = False):
        self.dataset_path = Path(dataset)
        self.out_path = Path(out)
        check_new_output(out, overwrite)
        self.params = params
        self.camera_map = camera_map
        self.state_key = state_key
        self.action_key = action_key
        self.episode_ids = episodes
        self.system = system
        self.storage = storage
        self.overwrite = overwrite
        self.progress = progress
        self.store = make_typestore()
        self.summary = DatasetReplaySummary(str(dataset), str(out))
        # Real-time chunking on the dataset's clock (rtc_trace: keep the chunks sent).
        self.rtc = planner_for(params.settings, trace=rtc_trace)
        self.errors = ActionErrors()

    def _open(self) -> tuple[LeRobotDataset, dict[str, str], list[int]]:
        """Read the dataset's metadata and check it fits the robot before any model loads."""
        try:
            dataset = LeRobotDataset(self.dataset_path)
        except DatasetError as err:
            raise BagError(str(err)) from None
        settings = self.params.settings
        robot, cameras = settings.robot, [c.name for c in settings.cameras]
        mapping = {**default_camera_map(dataset, cameras), **(self.camera_map or {})}
        missing = [c for c in cameras if c not in mapping]
        unknown = [f for f in mapping.values() if f not in dataset.cameras]
        if missing or unknown:
            raise BagError(
                f'{self.dataset_path}: cameras of robot {robot!r} {cameras} need dataset '
                'features; ' + (f'no match for {missing}; ' if missing else '')
                + (f'not camera features: {unknown}; ' if unknown else '')
                + f'camera features: {dataset.cameras} (map them with --camera NAME=FEATURE)')
        for key, dim, what in ((self.state_key, len(settings.joint_names), 'state'),
                               (self.action_key, None, 'action')):
            feature = dataset.features.get(key)
            if feature is None:
                raise BagError(f'{self.dataset_path}: no feature {key!r} for the {what} '
                               f'(features: {sorted(dataset.features)})')
            shape = list(feature.get('shape', []))
            if len(shape) != 1 or (dim is not None and shape != [dim]):
                raise BagError(f'{self.dataset_path}: feature {key!r} has shape {shape}; '
                               f'robot {robot!r} needs {what} [{dim or "A"}]')
        episodes = (self.episode_ids if self.episode_ids is not None
                    else [e.index for e in dataset.episodes])
        for index in episodes:
            dataset.episode(index)                    # raises for an unknown episode
        return dataset, mapping, episodes

    def run(self) -> DatasetReplaySummary:
        try:
            dataset, mapping, episodes = self._open()
        except DatasetError as err:
            raise BagError(str(err)) from None
        if self.system is None:
            self.system = build_engine(self.params.settings)[0]   # paced by the dataset
        out = OutputBag(self.out_path, self.store, self.storage, self.overwrite)
        total = sum(dataset.episode(i).length for i in episodes)
        progress = _progress_bar(total, self.progress)
        try:
            with recorded_run(out, self.summary, str(self.dataset_path), self.params.settings):
                try:
                    self._replay(dataset, mapping, episodes, out, progress)
                except DatasetError as err:
                    raise BagError(str(err)) from None
        finally:
            self.summary.episodes = self.errors.summary()
            progress.close()
            self._write_errors()
        return self.summary

    def _replay(self, dataset, mapping, episodes, out, progress) -> None:
        settings, summary = self.params.settings, self.summary
        cameras = [(cam, inputs.InputSource(f'camera:{cam}', f'camera {cam!r} ({feature})',
                                            lambda image: image))
                   for cam, feature in mapping.items()]
        joints = inputs.InputSource('joint_states', f'state ({self.state_key})',
                                    lambda state: state)
        # Every input is fresh at its own tick: the stale timeout never applies.
        buffer = inputs.InputSet(cameras, joints, stale_timeout_s=float('inf'))
        sink = _BagOutputs(self, out)
        loop = FrameLoop.one(self.system, buffer, sink, 1.0 / dataset.fps, rtc=self.rtc)
        override = self.params.instruction_override
        start_s = 0.0
        for index in episodes:
            self.rtc.committed.clear()    # an episode does not continue the one before
            recorded = dataset.actions(index, self.action_key)             # [T, A]
            features = list(mapping.values())
            for frame in dataset.frames(index, features, self.state_key, self.action_key):
                self._check_stop()
                now_s = start_s + frame.timestamp
                for cam, feature in mapping.items():
                    buffer.put(f'camera:{cam}', frame.images[feature], now_s)
                buffer.put('joint_states', frame.state, now_s)
                buffer.set_instruction(inputs.sanitize_instruction(
                    override or frame.task, settings.max_instruction_chars))
                tick_ns = round(now_s * 1e9)
                sink.tick_ns = tick_ns
                (outcome,) = loop.tick(now_s, serve_all=True).values()
                summary.ticks += 1
                summary.bag_time_s = now_s
                if outcome.action is None:
                    why = ('; '.join(outcome.problems.values()) or outcome.error
                           or 'no action')
                    raise BagError(f'episode {index} frame {frame.index}: {why}')
                predicted = outcome.action.actions                        # [H, A]
                if predicted.shape[1] != recorded.shape[1]:
                    raise BagError(f'{self.action_key!r} has {recorded.shape[1]} dimensions; '
                                   f'robot {settings.robot!r} acts in {predicted.shape[1]}')
                l1, mse, _ = chunk_error(predicted, recorded, frame.index)
                self.errors.add(index, frame.index, l1, mse)
                out.write(ERROR_TOPIC, FLOAT_ARRAY, tick_ns, self._error_msg(l1, mse))
                progress.update(1)
            start_s += recorded.shape[0] / dataset.fps + EPISODE_GAP_S
        # The last frames' language requests run to their end, every task's (nothing lost),
        # on ticks without a frame after the last episode.
        while self.system.num_live_requests:
            if summary.drain_ticks >= MAX_DRAIN_TICKS:
                raise BagError(f'language requests still running {MAX_DRAIN_TICKS} ticks '
                               'after the last frame')
            now_s = start_s + summary.drain_ticks / dataset.fps
            sink.tick_ns = round(now_s * 1e9)
            loop.tick(now_s, serve_all=True, frames=False)
            summary.drain_ticks += 1

    def _error_msg(self, l1: np.ndarray, mse: np.ndarray):
        types = self.store.types
        dim = types['std_msgs/msg/MultiArrayDimension']
        n = l1.shape[0]
        layout = types['std_msgs/msg/MultiArrayLayout'](
            dim=[dim(label='metric (l1, mse)', size=2, stride=2 * n),
                 dim(label='action_dim', size=n, stride=n)], data_offset=0)
        return types[FLOAT_ARRAY](layout=layout,
                                  data=np.concatenate([l1, mse]).astype(np.float32))

    def _write_errors(self) -> None:
        if not self.out_path.is_dir() or not self.errors.episodes:
            return
        report = {'dataset': str(self.dataset_path), 'action_key': self.action_key,
                  'episodes': self.summary.episodes}
        (self.out_path / ERRORS_FILE).write_text(json.dumps(report, indent=2))
        self.errors.plot(self.out_path / PLOT_FILE)
