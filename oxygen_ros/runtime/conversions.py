"""Robot message fields -> numpy, done once at the edge: images, joint states, stamps.

ROS-free (fields, not message classes), so the node and the bag replay decode inputs with the
same code. Images become uint8 [H, W, 3] RGB and joint states a float64 state vector in the
configured joint order. Every malformed input raises InputError with a reason that names the
field and what was expected; nothing here logs.
"""

from __future__ import annotations

import io
import math
from typing import Sequence

import numpy as np


class InputError(ValueError):
    """A robot message that cannot be used; str(err) says why."""


# Encodings of sensor_msgs/Image we accept: name -> (channels, channel order to get RGB).
# 16-bit and float encodings (mono16, 32FC1, ...) are depth-like and not camera colour.
_ENCODINGS = {
    'rgb8': (3, (0, 1, 2)),
    'bgr8': (3, (2, 1, 0)),
    'rgba8': (4, (0, 1, 2)),
    'bgra8': (4, (2, 1, 0)),
    'mono8': (1, (0, 0, 0)),
    '8uc3': (3, (0, 1, 2)),   # OpenCV type name; cv_bridge publishes BGR data under it
}
MAX_IMAGE_SIDE = 8192           # larger frames are rejected, not resized (memory bound)
# Decoded pixels per frame, checked from the header before any decoding: a 65 KB PNG can
# declare 8192x8192 (a 0.6-1.7 s, 736 MB decode inside the tick). 4 MP covers 2560x1600.
MAX_IMAGE_PIXELS = 4_000_000
MAX_COMPRESSED_BYTES = 64 << 20
MAX_FIELD_CHARS = 40            # of a message's own strings quoted back in an error


def shorten(text, limit: int = MAX_FIELD_CHARS) -> str:
    """repr() of a message string, cut to `limit` characters (errors and logs stay bounded)."""
    text = str(text)
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f'... ({len(text)} chars)'


def _check_size(width: int, height: int) -> None:
    if not (0 < height <= MAX_IMAGE_SIDE and 0 < width <= MAX_IMAGE_SIDE):
        raise InputError(f'bad size {width}x{height}; expected 1..{MAX_IMAGE_SIDE} pixels a side')
    if width * height > MAX_IMAGE_PIXELS:
        raise InputError(f'{width}x{height} is {width * height / 1e6:.1f} MP; at most '
                         f'{MAX_IMAGE_PIXELS / 1e6:g} MP per frame are decoded (publish a '
                         'smaller image, e.g. with image_proc/resize)')


# Packed 4:2:2 YUV (two pixels share one U and one V): encoding -> byte offsets of Y0, U, Y1, V
# in each 4-byte pair. sensor_msgs names UYVY `yuv422` (and `uyvy`), YUYV `yuv422_yuy2`
# (and `yuyv`); USB (UVC) cameras' image_raw is usually YUYV.
_YUV422 = {'yuv422': (1, 0, 3, 2), 'uyvy': (1, 0, 3, 2),
           'yuv422_yuy2': (0, 1, 2, 3), 'yuyv': (0, 1, 2, 3)}


def _bayer_error(encoding: str) -> InputError:
    return InputError(f'raw Bayer image ({shorten(encoding)}): not demosaiced here; subscribe '
                      'the colour image instead: run image_proc (debayer) and remap this '
                      "camera's topic to its image_color (or image_rect_color)")


def _yuv422_to_rgb(offsets, height: int, width: int, step: int, buffer) -> np.ndarray:
    """Packed 4:2:2 YUV (BT.601, video range, as camera drivers send) -> uint8 [H, W, 3]."""
    if width % 2:
        raise InputError(f'4:2:2 YUV needs an even width, got {width}')
    row_bytes = width * 2
    if step < row_bytes:
        raise InputError(f'step {step} < width * 2 = {row_bytes} (yuv422)')
    needed = step * (height - 1) + row_bytes
    if len(buffer) < needed:
        raise InputError(f'truncated data: {len(buffer)} bytes, expected step * height = '
                         f'{step} * {height} = {step * height}')
    flat = np.frombuffer(buffer, dtype=np.uint8, count=needed)
    rows = np.lib.stride_tricks.as_strided(flat, shape=(height, row_bytes), strides=(step, 1))
    pairs = rows.reshape(height, width // 2, 4).astype(np.float32)   # [H, W/2, 4]
    y0, u, y1, v = (pairs[:, :, i] for i in offsets)
    y = np.stack([y0, y1], axis=-1).reshape(height, width) - 16.0   # [H, W]
    u = np.repeat(u, 2, axis=1) - 128.0
    v = np.repeat(v, 2, axis=1) - 128.0
    r = 1.164 * y + 1.596 * v
    g = 1.164 * y - 0.392 * u - 0.813 * v
    b = 1.164 * y + 2.017 * u
    return np.clip(np.stack([r, g, b], axis=-1) + 0.5, 0, 255).astype(np.uint8)


def image_to_rgb(encoding: str, height: int, width: int, step: int, data,
                 is_bigendian: int = 0) -> np.ndarray:
    """sensor_msgs/Image fields -> uint8 [height, width, 3] RGB (a copy, safe to keep)."""
    enc = encoding[:MAX_FIELD_CHARS].strip().lower()
    if enc.startswith('bayer_'):
        raise _bayer_error(encoding)
    if enc in _YUV422:
        _check_size(width, height)
        buffer = memoryview(data).cast('B') if not isinstance(data, np.ndarray) else data
        return _yuv422_to_rgb(_YUV422[enc], height, width, step, buffer)
    if enc not in _ENCODINGS:
        raise InputError(f"unsupported encoding {shorten(encoding)}; expected one of "
                         f"{', '.join(sorted(set(_ENCODINGS) | set(_YUV422)))}")
    channels, order = _ENCODINGS[enc]
    if enc == '8uc3':
        order = (2, 1, 0)
    _check_size(width, height)
    row_bytes = width * channels
    if step < row_bytes:
        raise InputError(f'step {step} < width * channels = {row_bytes} ({encoding})')
    buffer = memoryview(data).cast('B') if not isinstance(data, np.ndarray) else data
    needed = step * (height - 1) + row_bytes   # the last row may omit its padding
    if len(buffer) < needed:
        raise InputError(f'truncated data: {len(buffer)} bytes, expected step * height = '
                         f'{step} * {height} = {step * height}')
    flat = np.frombuffer(buffer, dtype=np.uint8, count=needed)
    # Rows may carry padding beyond width * channels: view them with the message's stride.
    rows = np.lib.stride_tricks.as_strided(flat, shape=(height, row_bytes), strides=(step, 1))
    pixels = rows.reshape(height, width, channels)   # [H, W, C]
    if order == (0, 1, 2) and channels == 3:   # rgb8: rows copied out whole
        return pixels.copy()
    # Channel by channel: a strided copy each, ~0.25 ms for VGA where indexing the channel
    # axis with a list took ~1.8 ms (a tenth of pi05-cpu's prefill, per camera).
    rgb = np.empty((height, width, 3), dtype=np.uint8)
    for out, channel in enumerate(order):
        rgb[:, :, out] = pixels[:, :, channel]
    return rgb


def compressed_to_rgb(fmt: str, data) -> np.ndarray:
    """sensor_msgs/CompressedImage (jpeg or png) -> uint8 [H, W, 3] RGB."""
    from PIL import Image, UnidentifiedImageError

    raw = bytes(data)
    fmt = shorten(fmt)
    if not raw:
        raise InputError(f'empty compressed image (format {fmt})')
    if len(raw) > MAX_COMPRESSED_BYTES:
        raise InputError(f'compressed image of {len(raw)} bytes exceeds {MAX_COMPRESSED_BYTES}')
    try:
        with Image.open(io.BytesIO(raw)) as img:
            if img.format not in ('JPEG', 'PNG'):
                raise InputError(f'compressed format {img.format} (message says {fmt}); '
                                 'expected jpeg or png')
            _check_size(*img.size)   # from the header: nothing is decoded yet
            rgb = np.asarray(img.convert('RGB'))
    except InputError:
        raise
    except UnidentifiedImageError:
        raise InputError(f'cannot decode compressed image (format {fmt}): not a jpeg or png '
                         'stream') from None
    except Exception as err:   # noqa: BLE001 - decoders raise SyntaxError, struct.error, ...
        reason = shorten(f'{type(err).__name__}: {err}', 200)
        raise InputError(f'cannot decode compressed image (format {fmt}): {reason}') from None
    return np.ascontiguousarray(rgb, dtype=np.uint8)


def check_frame_size(rgb: np.ndarray, info_width: int, info_height: int) -> None:
    """Raise InputError when a frame's size differs from its camera_info (0 x 0: unknown)."""
    height, width = rgb.shape[:2]
    if info_width and info_height and (width, height) != (info_width, info_height):
        raise InputError(f'frame is {width}x{height} but camera_info says '
                         f'{info_width}x{info_height} (a resized or cropped stream on this '
                         'topic?)')


def joint_state_to_vector(names: Sequence[str], positions: Sequence[float],
                          wanted: Sequence[str]) -> np.ndarray:
    """Map JointState names/positions to float64 [len(wanted)] in `wanted` order.

    Extra joints in the message are ignored; missing or non-finite wanted joints raise.
    """
    names = list(names)
    positions = np.asarray(positions, dtype=np.float64)
    if positions.ndim != 1 or len(positions) != len(names):
        raise InputError(f'JointState has {len(names)} names but {positions.size} positions')
    index = {}
    for i, name in enumerate(names):
        index.setdefault(name, i)   # a duplicated name: the first entry wins
    missing = [n for n in wanted if n not in index]
    if missing:
        raise InputError(f'missing joints {missing} (message has {names[:20]}'
                         f'{"..." if len(names) > 20 else ""})')
    state = positions[[index[n] for n in wanted]]
    bad = [n for n, v in zip(wanted, state) if not math.isfinite(v)]
    if bad:
        raise InputError(f'NaN or inf position for joints {bad}')
    return state


def stamp_to_seconds(stamp) -> float:
    """builtin_interfaces/Time -> float seconds."""
    return stamp.sec + stamp.nanosec * 1e-9
