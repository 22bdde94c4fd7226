"""Regression tests for the robustness review (issue 11): each test names the finding it pins.

ROS-free: conversions, instruction cleaning, staleness, the problem log and parameter checks.
Node- and replay-level findings are tested in test_node_robustness.py and test_bag.py.
"""

import io
import struct
import types
import unicodedata

import numpy as np
from PIL import Image
import pytest

from oxygen_ros.runtime import inputs as inputs_module
from oxygen_ros.runtime.conversions import (compressed_to_rgb, image_to_rgb, InputError,
                                            MAX_IMAGE_PIXELS)
from oxygen_ros.runtime.inputs import (build_observation, InputSource, LatestBuffer,
                                       sanitize_instruction)
from oxygen_ros.runtime.status import MAX_MESSAGE_CHARS, ProblemLog, WARN


def _png(image: np.ndarray) -> bytearray:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, 'PNG')
    return bytearray(buf.getvalue())


def _chunks(png: bytes):
    """(offset, type, length) of every PNG chunk."""
    out, i = [], 8
    while i < len(png):
        length = struct.unpack('>I', png[i:i + 4])[0]
        out.append((i, bytes(png[i + 4:i + 8]), length))
        i += 12 + length
    return out


def _with_size(png: bytearray, width: int, height: int) -> bytes:
    """The same PNG with an IHDR that declares width x height (CRC fixed)."""
    import zlib

    offset, kind, length = _chunks(png)[0]
    assert kind == b'IHDR'
    png[offset + 8:offset + 16] = struct.pack('>II', width, height)
    crc = zlib.crc32(bytes(png[offset + 4:offset + 8 + length]))
    png[offset + 8 + length:offset + 12 + length] = struct.pack('>I', crc)
    return bytes(png)


def test_decompression_bomb_png_is_rejected_from_its_header(monkeypatch):
    # Finding: a 65 KB PNG decoding to 8192x8192 stalled the tick for 0.6-1.7 s, 736 MB.
    bomb = _with_size(_png(np.zeros((8, 8, 3), np.uint8)), 8192, 8192)
    decoded = []
    monkeypatch.setattr(Image.Image, 'convert', lambda *a, **k: decoded.append(1))
    with pytest.raises(InputError, match='67.1 MP; at most 4 MP per frame'):
        compressed_to_rgb('png', bomb)
    assert decoded == [], 'nothing may be decoded before the size check'


def test_huge_raw_frame_is_rejected_before_its_data_is_touched():
    # Finding: raw 8192x8192 RGBA frames (256 MB) were accepted.
    with pytest.raises(InputError, match='MP per frame'):
        image_to_rgb('rgba8', 8192, 8192, 8192 * 4, b'')
    side = int(MAX_IMAGE_PIXELS ** 0.5)
    frame = np.zeros((side, side, 3), np.uint8)     # just under the cap: accepted
    assert image_to_rgb('rgb8', side, side, side * 3, frame.tobytes()).shape == (side, side, 3)


def test_png_with_a_corrupt_later_chunk_is_an_input_error():
    # Finding: PIL raised SyntaxError (73 of 4,500 fuzzed PNGs), which escaped the converter.
    rng = np.random.default_rng(0)
    png = _png(rng.integers(0, 256, (200, 200, 3), dtype=np.uint8))
    offset, kind, _ = _chunks(png)[2]
    assert kind == b'IDAT'
    png[offset + 4:offset + 8] = b'\x00\x01\x02\x03'
    with pytest.raises(InputError, match='SyntaxError'):
        compressed_to_rgb('png', bytes(png))


def test_unbounded_message_strings_stay_out_of_errors():
    # Finding: a 1 MB `encoding` made a 1 MB log line.
    with pytest.raises(InputError) as err:
        image_to_rgb('x' * 1_000_000, 2, 2, 6, bytes(12))
    assert len(str(err.value)) < 300 and '1000000 chars' in str(err.value)
    with pytest.raises(InputError) as err:
        compressed_to_rgb('f' * 1_000_000, b'not an image')
    assert len(str(err.value)) < 300


def test_huge_instruction_is_sliced_before_any_per_character_work(monkeypatch):
    # Finding: cleaning ran over the whole string before truncating (100 MB took 26 s).
    seen = []
    normalize = unicodedata.normalize
    monkeypatch.setattr(inputs_module.unicodedata, 'normalize',
                        lambda form, text: seen.append(len(text)) or normalize(form, text))
    raw = 'pick up the block ' * 1_000_000                       # 18 M characters
    instruction = sanitize_instruction(raw, 500)
    assert max(seen) <= 4 * 500 + 16
    assert instruction.truncated and instruction.received_chars == len(raw)
    assert len(instruction.text) <= 500 and instruction.text.startswith('pick up the block')


def _entry_buffer(received_s: float):
    buffer = LatestBuffer()
    stamp = types.SimpleNamespace(sec=0, nanosec=0)
    buffer.put('camera:image', types.SimpleNamespace(header=types.SimpleNamespace(stamp=stamp)),
               received_s)
    buffer.put('joint_states', object(), received_s)
    return buffer


def test_clock_jumping_back_makes_inputs_stale_not_fresh():
    # Finding: a backwards clock jump made stale frames fresh (negative age was never stale).
    cameras = [('image', InputSource('camera:image', 'camera', lambda m: np.zeros((2, 2, 3))))]
    joints = InputSource('joint_states', 'joints', lambda m: np.zeros(8))
    task = sanitize_instruction('go', 10)
    buffer = _entry_buffer(received_s=100.0)
    fresh = build_observation(buffer, cameras, joints, task, 100.2, 0.5, 0.0)
    assert fresh.observation is not None
    jumped = build_observation(buffer, cameras, joints, task, 40.0, 0.5, 0.0)  # looped bag
    assert jumped.observation is None
    assert 'clock jumped back' in jumped.problems['camera:image']


def test_problem_log_is_bounded_by_key_not_by_distinct_text():
    # Finding: each distinct string defeated the throttle; long strings reached the log whole.
    lines, clock = [], types.SimpleNamespace(t=0.0)
    log = ProblemLog(lambda level, msg: lines.append(msg), clock=lambda: clock.t)
    for i in range(100):          # one second of a sender cycling through bad encodings
        clock.t = i * 0.01
        log.update('inputs', {'cam': f'unsupported encoding {"x" * (i % 7)}{i}z'})
    assert len(lines) == 1
    clock.t = 1.5
    log.update('inputs', {'cam': 'unsupported encoding ' + 'y' * 1_000_000})
    assert len(lines) == 2 and len(lines[-1]) <= MAX_MESSAGE_CHARS
    log.event('decode', WARN, 'z' * 10_000)
    assert len(lines[-1]) <= MAX_MESSAGE_CHARS


def test_a_new_problem_right_after_another_is_still_logged_within_a_second():
    lines, clock = [], types.SimpleNamespace(t=0.0)
    log = ProblemLog(lambda level, msg: lines.append(msg), clock=lambda: clock.t)
    log.update('inputs', {'cam': 'cam: never received'})
    clock.t = 0.2
    log.update('inputs', {'cam': 'cam: cannot decode compressed image'})   # throttled for now
    assert lines == ['cam: never received']
    clock.t = 1.1
    log.update('inputs', {'cam': 'cam: cannot decode compressed image'})
    assert lines[-1] == 'cam: cannot decode compressed image'
