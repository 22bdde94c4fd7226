"""Test scaffolding: write tiny LeRobot datasets (v2.1 with image features, v3.0 with videos).

Layouts as LeRobot writes them (see oxygen_ros.dataset.lerobot): meta/info.json with the path
templates, the episode and task tables, parquet data with list columns for vectors, PNG bytes
in {'bytes', 'path'} structs for 'image' features, mp4 files for 'video' features (v3.0: all
episodes in one file, each episode's start time in the episode table).
"""

import io
import json
from pathlib import Path

import av
import numpy as np
from PIL import Image
import pyarrow as pa
import pyarrow.parquet as pq

CAMERAS = ('observation.images.image', 'observation.images.wrist_image')
TASKS = ('pick up the bowl', 'open the drawer')
FPS = 10


def episode_arrays(episode, length, size):
    """Images, states and actions of one episode, a pure function of its index."""
    rng = np.random.default_rng(episode)
    images = {cam: rng.integers(0, 256, (length, size, size, 3), dtype=np.uint8)
              for cam in CAMERAS}
    state = rng.uniform(-1, 1, (length, 8)).astype(np.float32)
    action = rng.uniform(-1, 1, (length, 7)).astype(np.float32)
    return images, state, action


def _features(dtype, size):
    features = {cam: {'dtype': dtype, 'shape': [size, size, 3],
                      'names': ['height', 'width', 'channels']} for cam in CAMERAS}
    features['observation.state'] = {'dtype': 'float32', 'shape': [8], 'names': None}
    features['action'] = {'dtype': 'float32', 'shape': [7], 'names': None}
    for name in ('timestamp',):
        features[name] = {'dtype': 'float32', 'shape': [1], 'names': None}
    for name in ('frame_index', 'episode_index', 'index', 'task_index'):
        features[name] = {'dtype': 'int64', 'shape': [1], 'names': None}
    return features


def _png(image):
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format='PNG')
    return buf.getvalue()


def _rows(episode, length, start_index, size, images=None):
    _, state, action = episode_arrays(episode, length, size)
    rows = {'observation.state': state.tolist(), 'action': action.tolist(),
            'timestamp': [i / FPS for i in range(length)], 'frame_index': list(range(length)),
            'episode_index': [episode] * length,
            'index': list(range(start_index, start_index + length)),
            'task_index': [episode % len(TASKS)] * length}
    if images is not None:
        for cam in CAMERAS:
            rows[cam] = [{'bytes': _png(img), 'path': None} for img in images[cam]]
    return rows


def write_v21(root, lengths=(6, 5), size=16) -> Path:
    """A v2.1 dataset whose cameras are 'image' features (PNG bytes in the parquet)."""
    root = Path(root)
    (root / 'meta').mkdir(parents=True)
    info = {'codebase_version': 'v2.1', 'robot_type': 'panda', 'fps': FPS,
            'total_episodes': len(lengths), 'total_frames': sum(lengths), 'chunks_size': 1000,
            'data_path': 'data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet',
            'video_path': None, 'features': _features('image', size)}
    (root / 'meta/info.json').write_text(json.dumps(info, indent=2))
    (root / 'meta/tasks.jsonl').write_text(''.join(
        json.dumps({'task_index': i, 'task': t}) + '\n' for i, t in enumerate(TASKS)))
    (root / 'meta/episodes.jsonl').write_text(''.join(
        json.dumps({'episode_index': e, 'tasks': [TASKS[e % len(TASKS)]], 'length': n}) + '\n'
        for e, n in enumerate(lengths)))
    start = 0
    for episode, length in enumerate(lengths):
        images, _, _ = episode_arrays(episode, length, size)
        file = root / f'data/chunk-000/episode_{episode:06d}.parquet'
        file.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table(_rows(episode, length, start, size, images)), file)
        start += length
    return root


def _write_video(file, frames, codec='ffv1', pix_fmt='bgr0', fps=FPS):
    """Encode frames uint8 [T, H, W, 3]; ffv1 is lossless (frames compare exactly)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(file), 'w') as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = pix_fmt
        for image in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format='rgb24')):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def write_v30(root, lengths=(6, 5), size=16) -> Path:
    """A v3.0 dataset: one data file and one video per camera holding every episode."""
    root = Path(root)
    (root / 'meta/episodes/chunk-000').mkdir(parents=True)
    info = {'codebase_version': 'v3.0', 'robot_type': 'panda', 'fps': FPS,
            'total_episodes': len(lengths), 'total_frames': sum(lengths), 'chunks_size': 1000,
            'data_path': 'data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet',
            'video_path': 'videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4',
            'features': _features('video', size)}
    (root / 'meta/info.json').write_text(json.dumps(info, indent=2))
    pq.write_table(pa.table({'task_index': list(range(len(TASKS))), 'task': list(TASKS)}),
                   root / 'meta/tasks.parquet')
    data = {}
    episodes = {'episode_index': [], 'length': [], 'tasks': [], 'data/chunk_index': [],
                'data/file_index': [], 'dataset_from_index': [], 'dataset_to_index': []}
    video_frames = {cam: [] for cam in CAMERAS}
    start = 0
    for episode, length in enumerate(lengths):
        images, _, _ = episode_arrays(episode, length, size)
        for key, values in _rows(episode, length, start, size).items():
            data.setdefault(key, []).extend(values)
        for key, value in (('episode_index', episode), ('length', length),
                           ('tasks', [TASKS[episode % len(TASKS)]]), ('data/chunk_index', 0),
                           ('data/file_index', 0), ('dataset_from_index', start),
                           ('dataset_to_index', start + length)):
            episodes[key].append(value)
        for cam in CAMERAS:
            from_s = len(video_frames[cam]) / FPS
            episodes.setdefault(f'videos/{cam}/chunk_index', []).append(0)
            episodes.setdefault(f'videos/{cam}/file_index', []).append(0)
            episodes.setdefault(f'videos/{cam}/from_timestamp', []).append(from_s)
            episodes.setdefault(f'videos/{cam}/to_timestamp', []).append(from_s + length / FPS)
            video_frames[cam].extend(images[cam])
        start += length
    file = root / 'data/chunk-000/file-000.parquet'
    file.parent.mkdir(parents=True)
    pq.write_table(pa.table(data), file)
    pq.write_table(pa.table(episodes), root / 'meta/episodes/chunk-000/file-000.parquet')
    for cam in CAMERAS:
        _write_video(root / f'videos/{cam}/chunk-000/file-000.mp4', np.stack(video_frames[cam]))
    return root


# --- a dataset of an unknown robot: reachy2's "apple_storage" layout --------------------------
def unknown_robot_info(fps=30, cameras=(('observation.image', 240, 320),), state_dim=19,
                       action_dim=19, channel_first=True, names=None, codec='h264'):
    """meta/info.json features as LeRobot v2.1 writes them for reachy2 "apple_storage".

    One 'video' camera `observation.image` [3, 240, 320] (channel, height, width; h264),
    19-dim state and action without names, 30 fps. names: per-dim names of state and action.
    """
    features = {
        'observation.state': {'dtype': 'float32', 'shape': [state_dim], 'names': names},
        'action': {'dtype': 'float32', 'shape': [action_dim], 'names': names},
    }
    for key, height, width in cameras:
        shape, axes = (([3, height, width], ['channel', 'height', 'width']) if channel_first
                       else ([height, width, 3], ['height', 'width', 'channel']))
        features[key] = {'dtype': 'video', 'shape': shape, 'names': axes,
                         'info': {'video.fps': float(fps), 'video.height': height,
                                  'video.width': width, 'video.channels': 3,
                                  'video.codec': codec, 'video.pix_fmt': 'yuv420p',
                                  'video.is_depth_map': False, 'has_audio': False}}
    for name in ('timestamp',):
        features[name] = {'dtype': 'float32', 'shape': [1], 'names': None}
    for name in ('frame_index', 'episode_index', 'index', 'task_index'):
        features[name] = {'dtype': 'int64', 'shape': [1], 'names': None}
    return features


def write_unknown_robot_v21(root, lengths=(5, 3), fps=30, **feature_options) -> Path:
    """A v2.1 dataset of an unknown robot, videos encoded with h264 (libx264, yuv420p)."""
    root = Path(root)
    (root / 'meta').mkdir(parents=True)
    features = unknown_robot_info(fps=fps, **feature_options)
    cameras = [k for k, f in features.items() if f['dtype'] == 'video']
    state_dim = features['observation.state']['shape'][0]
    action_dim = features['action']['shape'][0]
    info = {'codebase_version': 'v2.1', 'robot_type': 'reachy2', 'fps': fps,
            'total_episodes': len(lengths), 'total_frames': sum(lengths), 'total_tasks': 1,
            'chunks_size': 1000,
            'data_path': 'data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet',
            'video_path': 'videos/chunk-{episode_chunk:03d}/{video_key}/'
                          'episode_{episode_index:06d}.mp4',
            'features': features}
    (root / 'meta/info.json').write_text(json.dumps(info, indent=2))
    task = 'store the apple'
    (root / 'meta/tasks.jsonl').write_text(json.dumps({'task_index': 0, 'task': task}) + '\n')
    (root / 'meta/episodes.jsonl').write_text(''.join(
        json.dumps({'episode_index': e, 'tasks': [task], 'length': n}) + '\n'
        for e, n in enumerate(lengths)))
    start = 0
    for episode, length in enumerate(lengths):
        rng = np.random.default_rng(100 + episode)
        rows = {'observation.state': rng.uniform(-1, 1, (length, state_dim)).tolist(),
                'action': rng.uniform(-1, 1, (length, action_dim)).tolist(),
                'timestamp': [i / fps for i in range(length)],
                'frame_index': list(range(length)), 'episode_index': [episode] * length,
                'index': list(range(start, start + length)), 'task_index': [0] * length}
        file = root / f'data/chunk-000/episode_{episode:06d}.parquet'
        file.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table(rows), file)
        for key in cameras:
            height, width = features[key]['info']['video.height'], features[key]['info'][
                'video.width']
            frames = rng.integers(0, 256, (length, height, width, 3), dtype=np.uint8)
            _write_video(root / f'videos/chunk-000/{key}/episode_{episode:06d}.mp4', frames,
                         'libx264', 'yuv420p', fps)
        start += length
    return root
