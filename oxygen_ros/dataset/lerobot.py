"""Read LeRobot datasets (v2.x and v3.0 layouts) from a local folder: frames in episode order.

Layouts (meta/info.json "codebase_version" tells which):

    v2.x  meta/info.json, meta/episodes.jsonl, meta/tasks.jsonl
          data/chunk-XXX/episode_XXXXXX.parquet          one episode per file
          videos/chunk-XXX/<camera key>/episode_XXXXXX.mp4
    v3.0  meta/info.json, meta/episodes/chunk-XXX/file-XXX.parquet, meta/tasks.parquet
          data/chunk-XXX/file-XXX.parquet                many episodes per file
          videos/<camera key>/chunk-XXX/file-XXX.mp4     episodes back to back; the episode
                                                         table gives each one's start time
The paths come from info.json's data_path / video_path templates. A camera feature has dtype
'video' (decoded with PyAV) or 'image' (PNG/JPEG bytes in the parquet column). Rows carry
timestamp, frame_index, episode_index and task_index besides the features.
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Iterator

import numpy as np

INFO_FILE = 'meta/info.json'
CAMERA_DTYPES = ('video', 'image')


class DatasetError(ValueError):
    """The folder is not a readable LeRobot dataset; the message names the file and the fix."""


@dataclasses.dataclass(frozen=True)
class Episode:
    """One episode's row of the episode table."""

    index: int
    length: int                           # frames
    meta: dict                            # the rest of its row (v3: file and video offsets)


@dataclasses.dataclass
class Frame:
    """One dataset frame: what the robot saw and what it did."""

    episode: int
    index: int                            # frame_index within the episode
    timestamp: float                      # seconds from the episode start
    images: dict[str, np.ndarray]         # camera feature -> uint8 [H, W, 3]
    state: np.ndarray                     # float64 [S]
    action: np.ndarray                    # float64 [A], recorded
    task: str


def is_dataset(path: str | Path) -> bool:
    """Whether `path` looks like a LeRobot dataset folder (it has meta/info.json)."""
    return (Path(path) / INFO_FILE).is_file()


def _read_json(file: Path) -> dict:
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise DatasetError(f'{file} is missing') from None
    except (OSError, json.JSONDecodeError) as err:
        raise DatasetError(f'{file}: cannot read: {err}') from None


def _read_jsonl(file: Path) -> list[dict]:
    if not file.is_file():
        raise DatasetError(f'{file} is missing')
    try:
        return [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as err:
        raise DatasetError(f'{file}: not JSON lines: {err}') from None


def _read_parquet(file: Path, filters=None) -> dict[str, list]:
    import pyarrow.parquet as pq

    if not file.is_file():
        raise DatasetError(f'{file} is missing')
    try:
        return pq.read_table(file, filters=filters).to_pydict()
    except Exception as err:   # noqa: BLE001 - pyarrow raises many kinds; say which file
        raise DatasetError(f'{file}: cannot read parquet: {err}') from None


def _rows(table: dict[str, list]) -> list[dict]:
    keys = list(table)
    return [dict(zip(keys, values)) for values in zip(*table.values())]


class LeRobotDataset:
    """A local LeRobot dataset: metadata, episodes, and their frames in order."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        if not is_dataset(self.root):
            raise DatasetError(f'{self.root}: no {INFO_FILE}; expected a LeRobot dataset '
                               'folder (v2.x or v3.0 layout)')
        self.info = _read_json(self.root / INFO_FILE)
        self.version = str(self.info.get('codebase_version', ''))
        if not self.version.startswith(('v2', 'v3')):
            raise DatasetError(f'{self.root / INFO_FILE}: codebase_version '
                               f'{self.version!r}; expected v2.x or v3.0')
        missing = [k for k in ('fps', 'features', 'data_path') if k not in self.info]
        if missing:
            raise DatasetError(f'{self.root / INFO_FILE}: missing {missing}')
        self.fps = float(self.info['fps'])
        self.features: dict[str, dict] = self.info['features']
        self.tasks = self._read_tasks()
        self.episodes = self._read_episodes()

    @property
    def v3(self) -> bool:
        return self.version.startswith('v3')

    @property
    def cameras(self) -> list[str]:
        """Camera feature names (dtype video or image), in info.json order."""
        return [k for k, f in self.features.items() if f.get('dtype') in CAMERA_DTYPES]

    def _read_tasks(self) -> dict[int, str]:
        if not self.v3:
            rows = _read_jsonl(self.root / 'meta/tasks.jsonl')
            return {int(r['task_index']): str(r['task']) for r in rows}
        table = _read_parquet(self.root / 'meta/tasks.parquet')
        # pandas writes the task text as the index ('task' or '__index_level_0__')
        text_key = 'task' if 'task' in table else '__index_level_0__'
        if text_key not in table or 'task_index' not in table:
            raise DatasetError(f'{self.root}/meta/tasks.parquet: expected columns task_index '
                               f'and task; found {sorted(table)}')
        return {int(i): str(t) for i, t in zip(table['task_index'], table[text_key])}

    def _read_episodes(self) -> list[Episode]:
        if self.v3:
            files = sorted((self.root / 'meta/episodes').glob('chunk-*/file-*.parquet'))
            if not files:
                raise DatasetError(f'{self.root}/meta/episodes/chunk-*/file-*.parquet: none '
                                   'found (the v3.0 episode table)')
            rows = [row for f in files for row in _rows(_read_parquet(f))]
        else:
            rows = _read_jsonl(self.root / 'meta/episodes.jsonl')
        episodes = [Episode(int(r['episode_index']), int(r['length']), r) for r in rows]
        return sorted(episodes, key=lambda e: e.index)

    def episode(self, index: int) -> Episode:
        for episode in self.episodes:
            if episode.index == index:
                return episode
        raise DatasetError(f'{self.root}: no episode {index} (episodes '
                           f'{[e.index for e in self.episodes][:20]})')

    # ---- frames -----------------------------------------------------------------------------
    def _data_file(self, episode: Episode) -> Path:
        template = self.info['data_path']
        if self.v3:
            name = template.format(chunk_index=int(episode.meta['data/chunk_index']),
                                   file_index=int(episode.meta['data/file_index']))
        else:
            chunk = episode.index // int(self.info.get('chunks_size', 1000))
            name = template.format(episode_chunk=chunk, episode_index=episode.index)
        return self.root / name

    def _video(self, episode: Episode, key: str) -> tuple[Path, float]:
        """Return the video file of camera `key` for the episode and the episode's start in it."""
        template = self.info.get('video_path')
        if not template:
            raise DatasetError(f'{self.root / INFO_FILE}: feature {key!r} is a video but '
                               'there is no video_path')
        if self.v3:
            prefix = f'videos/{key}/'
            name = template.format(video_key=key,
                                   chunk_index=int(episode.meta[prefix + 'chunk_index']),
                                   file_index=int(episode.meta[prefix + 'file_index']))
            return self.root / name, float(episode.meta.get(prefix + 'from_timestamp', 0.0))
        chunk = episode.index // int(self.info.get('chunks_size', 1000))
        name = template.format(episode_chunk=chunk, video_key=key, episode_index=episode.index)
        return self.root / name, 0.0

    def frames(self, index: int, cameras: list[str], state_key: str, action_key: str
               ) -> Iterator[Frame]:
        """Yield the frames of episode `index` in order with these features."""
        for key in [*cameras, state_key, action_key]:
            if key not in self.features:
                raise DatasetError(f'{self.root}: no feature {key!r}; features: '
                                   f'{sorted(self.features)}')
        episode = self.episode(index)
        table = _read_parquet(self._data_file(episode),
                              [('episode_index', '=', index)] if self.v3 else None)
        rows = sorted(_rows(table), key=lambda r: int(r['frame_index']))
        if not rows:
            raise DatasetError(f'{self._data_file(episode)}: no rows of episode {index}')
        videos = {key: VideoFrames(*self._video(episode, key)) for key in cameras
                  if self.features[key]['dtype'] == 'video'}
        try:
            for row in rows:
                timestamp = float(row['timestamp'])
                images = {key: (videos[key].at(timestamp) if key in videos
                                else decode_image(row[key], key)) for key in cameras}
                yield Frame(index, int(row['frame_index']), timestamp, images,
                            np.asarray(row[state_key], dtype=np.float64).reshape(-1),
                            np.asarray(row[action_key], dtype=np.float64).reshape(-1),
                            self.tasks.get(int(row.get('task_index', -1)), ''))
        finally:
            for video in videos.values():
                video.close()

    def actions(self, index: int, action_key: str) -> np.ndarray:
        """Return the recorded actions of episode `index`, float64 [T, A] in frame order."""
        episode = self.episode(index)
        table = _read_parquet(self._data_file(episode),
                              [('episode_index', '=', index)] if self.v3 else None)
        order = np.argsort(np.asarray(table['frame_index']))
        return np.asarray(table[action_key], dtype=np.float64)[order]


def decode_image(value, key: str) -> np.ndarray:
    """Decode an 'image' feature cell (PNG/JPEG bytes or {'bytes', 'path'}) to uint8 HWC."""
    from PIL import Image

    data = value.get('bytes') if isinstance(value, dict) else value
    if not isinstance(data, (bytes, bytearray)):
        raise DatasetError(f'image feature {key!r}: expected encoded bytes, got '
                           f'{type(data).__name__}')
    try:
        with Image.open(io.BytesIO(data)) as image:
            return np.asarray(image.convert('RGB'))
    except OSError as err:
        raise DatasetError(f'image feature {key!r}: cannot decode: {err}') from None


class VideoFrames:
    """Frames of one video in time order, from `start_s` on; at(t) = the frame shown at t."""

    def __init__(self, path: Path, start_s: float = 0.0):
        import av

        if not path.is_file():
            raise DatasetError(f'{path} is missing (a camera video)')
        try:
            self.container = av.open(str(path))
        except av.FFmpegError as err:
            raise DatasetError(f'{path}: cannot open video: {err}') from None
        self.path = path
        self.start_s = start_s
        stream = self.container.streams.video[0]
        rate = float(stream.average_rate or 30)
        self.tolerance_s = 0.5 / rate          # half a frame: timestamps are rounded
        if start_s > 0:
            self.container.seek(int(start_s / stream.time_base), stream=stream, backward=True)
        self._decoded = self.container.decode(stream)
        self._shown: np.ndarray | None = None
        self._next = self._read()

    def _read(self):
        try:
            frame = next(self._decoded)
        except StopIteration:
            return None
        return frame.time, frame

    def at(self, timestamp_s: float) -> np.ndarray:
        """Return uint8 [H, W, 3] of the frame at `timestamp_s` from the episode start."""
        target = self.start_s + timestamp_s + self.tolerance_s
        shown = None
        while self._next is not None and self._next[0] <= target:
            shown = self._next[1]                 # converted only if it is the one shown
            self._next = self._read()
        if shown is not None:
            self._shown = shown.to_ndarray(format='rgb24')
        if self._shown is None:
            raise DatasetError(f'{self.path}: no frame at {self.start_s + timestamp_s:.3f} s')
        return self._shown

    def close(self) -> None:
        self.container.close()
