"""Message conversions at the node's edge: images, joint states, stamps, output messages."""

import array
import io
import math

import numpy as np
from PIL import Image as PILImage
import pytest

from oxygen_ros.engine.types import ActionOutput, TokenDelta
from oxygen_ros.msg import ActionChunk
from oxygen_ros.ros.conversions import (action_chunk_msg, actions_from_msg, language_chunk_msg,
                                        seconds_to_stamp)
from oxygen_ros.runtime.actions import ActionLayout
from oxygen_ros.runtime.conversions import (compressed_to_rgb, image_to_rgb, InputError,
                                            joint_state_to_vector, stamp_to_seconds)

RNG = np.random.default_rng(0)
RGB = RNG.integers(0, 256, (5, 7, 3), dtype=np.uint8)   # [H, W, 3]


def raw(pixels, pad=0):
    """Rows of `pixels` with `pad` bytes of padding each: (step, bytes)."""
    h = pixels.shape[0]
    rows = pixels.reshape(h, -1)
    padded = np.concatenate([rows, np.full((h, pad), 77, np.uint8)], axis=1)
    return padded.shape[1], array.array('B', padded.tobytes())


@pytest.mark.parametrize('encoding, pixels', [
    ('rgb8', RGB),
    ('bgr8', RGB[:, :, ::-1]),
    ('rgba8', np.concatenate([RGB, np.full((5, 7, 1), 255, np.uint8)], axis=2)),
    ('bgra8', np.concatenate([RGB[:, :, ::-1], np.zeros((5, 7, 1), np.uint8)], axis=2)),
    ('8UC3', RGB[:, :, ::-1]),
])
@pytest.mark.parametrize('pad', [0, 3])
def test_colour_encodings_give_rgb(encoding, pixels, pad):
    step, data = raw(np.ascontiguousarray(pixels), pad)
    out = image_to_rgb(encoding, 5, 7, step, data)
    assert out.dtype == np.uint8 and out.shape == (5, 7, 3)
    np.testing.assert_array_equal(out, RGB)


def test_mono8_is_replicated_to_three_channels():
    gray = RGB[:, :, 0].copy()
    out = image_to_rgb('mono8', 5, 7, 7, gray.tobytes())
    np.testing.assert_array_equal(out, np.stack([gray] * 3, axis=-1))


def test_result_does_not_alias_the_message_buffer():
    step, data = raw(RGB)
    out = image_to_rgb('rgb8', 5, 7, step, data)
    data[0] = (data[0] + 1) % 256
    assert out[0, 0, 0] == RGB[0, 0, 0]


def test_last_row_padding_may_be_missing():
    step, data = raw(RGB, pad=4)
    out = image_to_rgb('rgb8', 5, 7, step, data[:-4])
    np.testing.assert_array_equal(out, RGB)


def _yuv422(rgb: np.ndarray, order: str) -> bytes:
    """Pack uint8 [H, W, 3] RGB as 4:2:2 YUV (BT.601 video range), 'yuyv' or 'uyvy'."""
    r, g, b = (rgb[..., i].astype(np.float64) for i in range(3))
    y = 16 + 0.257 * r + 0.504 * g + 0.098 * b
    u = 128 - 0.148 * r - 0.291 * g + 0.439 * b
    v = 128 + 0.439 * r - 0.368 * g - 0.071 * b
    # One U and V per pixel pair: the pair's mean.
    u2, v2 = (c.reshape(c.shape[0], -1, 2).mean(axis=2) for c in (u, v))
    y0, y1 = y[:, 0::2], y[:, 1::2]
    parts = (y0, u2, y1, v2) if order == 'yuyv' else (u2, y0, v2, y1)
    return np.clip(np.round(np.stack(parts, axis=-1)), 0, 255).astype(np.uint8).tobytes()


@pytest.mark.parametrize('encoding, order', [('yuv422_yuy2', 'yuyv'), ('yuyv', 'yuyv'),
                                             ('yuv422', 'uyvy'), ('uyvy', 'uyvy')])
def test_yuv422_cameras_convert_to_rgb(encoding, order):
    # Pixel pairs of one colour each, so the shared chroma is exact: grey, red, green, blue.
    colours = np.array([[128, 128, 128], [200, 30, 30], [30, 200, 30], [30, 30, 200]], np.uint8)
    rgb = np.repeat(np.repeat(colours[None], 2, axis=1), 3, axis=0)   # [3, 8, 3]
    out = image_to_rgb(encoding, 3, 8, 16, _yuv422(rgb, order))
    assert out.shape == (3, 8, 3) and out.dtype == np.uint8
    assert np.abs(out.astype(int) - rgb).max() <= 3   # 8-bit YUV round trip


@pytest.mark.parametrize('encoding, height, width, step, nbytes, reason', [
    ('16UC1', 5, 7, 14, 70, 'unsupported encoding'),
    ('yuv422', 5, 7, 14, 70, 'needs an even width'),
    ('yuv422_yuy2', 4, 6, 12, 40, 'truncated data'),
    ('bayer_rggb8', 4, 6, 6, 24, 'remap this camera\'s topic to its image_color'),
    ('rgb8', 5, 7, 20, 105, 'step 20 < width * channels = 21'),
    ('rgb8', 5, 7, 21, 100, 'truncated data: 100 bytes'),
    ('rgb8', 0, 7, 21, 0, 'bad size'),
    ('rgb8', 5, 9000, 27000, 135000, 'bad size'),
    ('mono8', 5, 7, 7, 0, 'truncated data'),
])
def test_malformed_images_are_rejected_with_a_reason(encoding, height, width, step, nbytes,
                                                     reason):
    with pytest.raises(InputError, match=reason.replace('*', r'\*')):
        image_to_rgb(encoding, height, width, step, bytes(nbytes))


@pytest.mark.parametrize('fmt', ['jpeg', 'png'])
def test_compressed_images_decode_in_rgb_order(fmt):
    # A smooth picture (JPEG keeps it well): red ramp, constant green, no blue.
    smooth = np.zeros((16, 24, 3), np.uint8)
    smooth[..., 0] = np.linspace(0, 255, 24, dtype=np.uint8)[None, :]
    smooth[..., 1] = 128
    buf = io.BytesIO()
    PILImage.fromarray(smooth).save(buf, format='JPEG' if fmt == 'jpeg' else 'PNG', quality=95)
    out = compressed_to_rgb(fmt, array.array('B', buf.getvalue()))
    assert out.shape == (16, 24, 3) and out.dtype == np.uint8
    assert np.abs(out.astype(int) - smooth).max() <= (0 if fmt == 'png' else 12)


@pytest.mark.parametrize('data, reason', [
    (b'', 'empty compressed image'),
    (b'\xff\xd8\xff\xe0 not really a jpeg', 'cannot decode'),
    (b'GIF89a' + bytes(20), 'cannot decode|expected jpeg or png'),
])
def test_corrupt_compressed_images_are_rejected(data, reason):
    with pytest.raises(InputError, match=reason):
        compressed_to_rgb('jpeg', data)


def test_truncated_jpeg_is_rejected():
    buf = io.BytesIO()
    PILImage.fromarray(np.zeros((64, 64, 3), np.uint8)).save(buf, format='JPEG')
    with pytest.raises(InputError, match='cannot decode'):
        compressed_to_rgb('jpeg', buf.getvalue()[:100])


def test_joint_state_follows_configured_order_and_ignores_extras():
    state = joint_state_to_vector(['b', 'x', 'a'], [2.0, 9.0, 1.0], ['a', 'b'])
    np.testing.assert_array_equal(state, [1.0, 2.0])
    assert state.dtype == np.float64


@pytest.mark.parametrize('names, positions, reason', [
    (['a'], [1.0], r"missing joints \['b'\]"),
    (['a', 'b'], [1.0], '2 names but 1 positions'),
    (['a', 'b'], [1.0, math.nan], r"NaN or inf position for joints \['b'\]"),
    (['a', 'b'], [math.inf, 0.0], r"joints \['a'\]"),
])
def test_bad_joint_states_are_rejected(names, positions, reason):
    with pytest.raises(InputError, match=reason):
        joint_state_to_vector(names, positions, ['a', 'b'])


def test_stamps_round_trip_to_the_nanosecond():
    stamp = seconds_to_stamp(1234.000000789)
    assert (stamp.sec, stamp.nanosec) == (1234, 789)
    assert stamp_to_seconds(stamp) == pytest.approx(1234.000000789, abs=1e-9)
    assert (seconds_to_stamp(-1.0).sec, seconds_to_stamp(-1.0).nanosec) == (0, 0)


def test_action_chunk_message_is_row_major_robot_units():
    actions = np.arange(12, dtype=np.float32).reshape(4, 3)   # [H, A]
    out = ActionOutput(frame_index=7, actions=actions, normalized=np.zeros((4, 32)),
                       inference_time_s=0.25, stamp=3.5)
    layout = ActionLayout('joint_velocity', ('a', 'b', 'c'), 1 / 15, 8)
    msg = action_chunk_msg(out, seconds_to_stamp(3.5), 'base_link', layout)
    assert (msg.frame_index, msg.horizon, msg.action_dim) == (7, 4, 3)
    assert msg.action_space == ActionChunk.JOINT_VELOCITY and list(msg.names) == ['a', 'b', 'c']
    assert (msg.step_period.sec, msg.step_period.nanosec) == (0, 66_666_667)
    assert msg.header.frame_id == 'base_link' and msg.header.stamp.sec == 3
    assert msg.inference_time == pytest.approx(0.25)
    np.testing.assert_array_equal(actions_from_msg(msg), actions)


def test_language_chunk_message_carries_every_field():
    delta = TokenDelta(request_id=3, origin_frame=9, token_ids=[5, 6], text=' hi', done=True,
                       tokens_so_far=8, finish_reason='eos')
    msg = language_chunk_msg(delta, seconds_to_stamp(1.0), 'base_link')
    assert (msg.request_id, msg.origin_frame, list(msg.token_ids)) == (3, 9, [5, 6])
    assert (msg.text_delta, msg.tokens_so_far, msg.done, msg.finish_reason) == (
        ' hi', 8, True, 'eos')
