"""Demo inputs without a robot: sample photos with slight motion, joint states, an instruction.

Used by the record-demo publisher, by tests, and to write a demo bag directly (no DDS).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Sequence

import numpy as np
from rosbags.typesys.store import Typestore

from oxygen_ros.bag.config import ReplayParams
from oxygen_ros.bag.messages import header
from oxygen_ros.bag.typestore import (COMPRESSED_IMAGE, IMAGE, JOINT_STATE, make_typestore,
                                      STRING)
from oxygen_ros.bag.writer import OutputBag, qos_profile

# scikit-image sample photos, one per camera in turn.
SAMPLE_PHOTOS = ('astronaut', 'coffee', 'chelsea', 'rocket')


@functools.lru_cache(maxsize=8)
def _photo(index: int) -> np.ndarray:
    """Return a sample photo uint8 [H, W, 3] (a gradient when scikit-image is missing)."""
    try:
        from skimage import data
        image = getattr(data, SAMPLE_PHOTOS[index % len(SAMPLE_PHOTOS)])()
    except (ImportError, AttributeError, OSError):
        y, x = np.mgrid[0:256, 0:256]
        image = np.stack([x, y, (x + y + 64 * index) % 256], -1)
    image = np.asarray(image)
    if image.ndim == 2:
        image = np.repeat(image[:, :, None], 3, axis=2)
    return np.ascontiguousarray(image[:, :, :3].astype(np.uint8))


def demo_image(camera_index: int, time_s: float, height: int, width: int) -> np.ndarray:
    """uint8 [height, width, 3]: a crop of a sample photo drifting slowly (slight motion)."""
    photo = _photo(camera_index)
    ph, pw = photo.shape[:2]
    crop = min(ph, pw) * 3 // 4
    dy = int((ph - crop) / 2 * (1 + math.sin(0.7 * time_s + camera_index)))
    dx = int((pw - crop) / 2 * (1 + math.cos(0.5 * time_s + camera_index)))
    window = photo[dy:dy + crop, dx:dx + crop]
    # Nearest-neighbour resize keeps this dependency-free and deterministic.
    rows = np.arange(height) * crop // height
    cols = np.arange(width) * crop // width
    return np.ascontiguousarray(window[rows][:, cols])


def demo_joint_positions(time_s: float, dim: int) -> np.ndarray:
    """float64 [dim]: slow sine motion in [-1, 1]."""
    return np.sin(0.5 * time_s + np.arange(dim) * 0.4) * 0.8


def image_msg(store: Typestore, image: np.ndarray, stamp_ns: int, frame_id: str = 'camera'):
    """sensor_msgs/Image rgb8 of uint8 [H, W, 3]."""
    height, width = image.shape[:2]
    return store.types[IMAGE](
        header=header(store, stamp_ns, frame_id), height=height, width=width, encoding='rgb8',
        is_bigendian=0, step=width * 3, data=np.ascontiguousarray(image).reshape(-1))


def compressed_msg(store: Typestore, image: np.ndarray, stamp_ns: int,
                   frame_id: str = 'camera', fmt: str = 'jpeg'):
    """sensor_msgs/CompressedImage (jpeg or png) of uint8 [H, W, 3]."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format='JPEG' if fmt == 'jpeg' else 'PNG', quality=90)
    return store.types[COMPRESSED_IMAGE](
        header=header(store, stamp_ns, frame_id), format=fmt,
        data=np.frombuffer(buffer.getvalue(), dtype=np.uint8))


def joint_state_msg(store: Typestore, names: Sequence[str], positions: np.ndarray,
                    stamp_ns: int):
    """sensor_msgs/JointState with positions only."""
    positions = np.asarray(positions, dtype=np.float64)
    names = list(names) or [f'joint_{i}' for i in range(positions.size)]
    return store.types[JOINT_STATE](
        header=header(store, stamp_ns), name=names, position=positions,
        velocity=np.zeros(0), effort=np.zeros(0))


def string_msg(store: Typestore, text: str):
    return store.types[STRING](data=text)


def write_demo_bag(path: str | Path, params: ReplayParams, duration_s: float = 2.0, *,
                   camera_hz: float = 15.0, state_hz: float = 50.0,
                   image_hw: tuple[int, int] = (96, 128), compressed: bool | None = None,
                   instruction: str = 'pick up the red block', storage: str = 'mcap',
                   start_ns: int = 1_700_000_000 * 10**9) -> Path:
    """Write a bag of the node's input topics (cameras, joint states, instruction) directly.

    compressed: CompressedImage (jpeg) for every camera; None: as each camera is configured.
    """
    store = make_typestore()
    names = list(params.settings.joint_names)
    instruction_topic = params.resolve(params.instruction_topic)
    events = []   # (time ns, order, topic, msgtype, message)
    events.append((start_ns, 0, instruction_topic, STRING, string_msg(store, instruction)))
    for k in range(int(duration_s * state_hz) + 1):
        t = start_ns + round(k * 1e9 / state_hz)
        pos = demo_joint_positions((t - start_ns) * 1e-9, len(names))
        events.append((t, 1, params.resolve(params.joint_states_topic), JOINT_STATE,
                       joint_state_msg(store, names, pos, t)))
    for i, (camera, topic, jpeg) in enumerate(params.cameras(compressed)):
        for k in range(int(duration_s * camera_hz) + 1):
            t = start_ns + round(k * 1e9 / camera_hz)
            image = demo_image(i, (t - start_ns) * 1e-9, *image_hw)
            msg = (compressed_msg(store, image, t, camera) if jpeg
                   else image_msg(store, image, t, camera))
            events.append((t, 2 + i, topic, COMPRESSED_IMAGE if jpeg else IMAGE, msg))
    events.sort(key=lambda e: (e[0], e[1]))
    # As the node subscribes: instruction latched (reliable, transient local), sensors
    # best effort; `ros2 bag play` republishes with these.
    latched, sensor = [qos_profile(True, True, 1)], [qos_profile(False, False, 10)]
    with OutputBag(path, store, storage) as out:
        for t, _, topic, msgtype, msg in events:
            out.write(topic, msgtype, t, msg, latched if topic == instruction_topic else sensor)
    return Path(path)
