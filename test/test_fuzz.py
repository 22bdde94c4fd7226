"""Fuzz suite (issue 11): every generated input ends in a result or a clear error, never a crash.

Inputs a robot (or any DDS peer) can send: image and compressed-image messages, joint states,
instructions, parameter values; bags on disk (mutated MCAP / sqlite3); and random sequences of
engine operations (act with good or bad observations, language steps, budget and policy changes,
failing decode steps) over a fake model: the pool balances, every act() gets its slot, no
exception escapes. CI runs the short profile; `OXYGEN_ROS_FUZZ=long make test` (or pytest)
runs 20x more examples per target.
"""

import io
import math
import os
import random

from hypothesis import HealthCheck, given, settings, strategies as st
import numpy as np
from PIL import Image
import pytest

from oxygen_ros.bag import BagError, InputBag, load_params
from oxygen_ros.bag.synthetic import write_demo_bag
from oxygen_ros.runtime.conversions import (compressed_to_rgb, image_to_rgb, InputError,
                                            joint_state_to_vector)
from oxygen_ros.runtime.inputs import sanitize_instruction
from oxygen_ros.runtime.params import check_value, PARAMS, Settings

LONG = os.environ.get('OXYGEN_ROS_FUZZ') == 'long'
EXAMPLES = 2000 if LONG else 100
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not LONG,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

ENCODINGS = ['rgb8', 'bgr8', 'rgba8', 'bgra8', 'mono8', '8UC3', 'mono16', 'yuv422', '', 'RGB8 ']


@FUZZ
@given(encoding=st.one_of(st.sampled_from(ENCODINGS), st.text(max_size=50)),
       height=st.integers(-2, 70), width=st.integers(-2, 70), step=st.integers(-4, 300),
       data=st.binary(max_size=20_000), bigendian=st.integers(0, 1))
def test_image_fields(encoding, height, width, step, data, bigendian):
    try:
        rgb = image_to_rgb(encoding, height, width, step, data, bigendian)
    except InputError as err:
        assert str(err)
        return
    assert rgb.dtype == np.uint8 and rgb.shape == (height, width, 3)


def _encoded(kind: str, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, (int(rng.integers(1, 48)), int(rng.integers(1, 48)), 3),
                         dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, kind)
    return buf.getvalue()


@FUZZ
@given(kind=st.sampled_from(['PNG', 'JPEG']), seed=st.integers(0, 2**16),
       flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=8),
       cut=st.one_of(st.none(), st.integers(0, 10**6)), fmt=st.text(max_size=20))
def test_compressed_images_mutated(kind, seed, flips, cut, fmt):
    data = bytearray(_encoded(kind, seed))
    for offset, value in flips:
        data[offset % len(data)] = value
    if cut is not None:
        data = data[:cut % (len(data) + 1)]
    try:
        rgb = compressed_to_rgb(fmt, bytes(data))
    except InputError as err:
        assert str(err)
        return
    assert rgb.dtype == np.uint8 and rgb.ndim == 3 and rgb.shape[2] == 3


@FUZZ
@given(names=st.lists(st.text(max_size=8), max_size=12),
       positions=st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=12),
       wanted=st.lists(st.text(max_size=8), min_size=1, max_size=8))
def test_joint_states(names, positions, wanted):
    try:
        state = joint_state_to_vector(names, positions, wanted)
    except InputError as err:
        assert str(err)
        return
    assert state.shape == (len(wanted),) and all(math.isfinite(v) for v in state)


@FUZZ
@given(raw=st.text(max_size=3000), max_chars=st.integers(1, 600))
def test_instructions(raw, max_chars):
    instruction = sanitize_instruction(raw, max_chars)
    text = instruction.text
    assert len(text) <= max_chars and text == text.strip()
    assert '\ufffd' not in text and not any('\ud800' <= c <= '\udfff' for c in text)
    assert not any(c in text for c in '\x00\n\r\t\x1b')
    assert instruction.received_chars == len(raw)


ANY_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                      st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=300),
                      st.lists(st.text(max_size=20), max_size=5),
                      st.lists(st.booleans(), max_size=5))


@FUZZ
@given(name=st.sampled_from([p.name for p in PARAMS]), value=ANY_VALUE)
def test_parameter_values(name, value):
    # The node's on-set callback turns TypeError into "wrong type"; nothing else may escape.
    try:
        why = check_value(name, value)
    except TypeError:
        return
    assert why is None or (isinstance(why, str) and why)


@FUZZ
@given(values=st.dictionaries(st.sampled_from([p.name for p in PARAMS]), ANY_VALUE,
                              max_size=6))
def test_settings_from_any_values(values):
    try:
        settings_ = Settings.from_values(values)
    except (ValueError, TypeError) as err:
        assert str(err)
        return
    assert settings_.control_rate_hz == 0 or settings_.control_rate_hz >= 0.1   # 0: auto


@pytest.fixture(scope='module')
def small_bags(tmp_path_factory):
    params = load_params(None, {'preset': 'tiny'})
    root = tmp_path_factory.mktemp('fuzzbags')
    return {storage: write_demo_bag(root / storage, params, 0.3, image_hw=(8, 8),
                                    storage=storage, start_ns=10**18)
            for storage in ('mcap', 'sqlite3')}


@settings(max_examples=EXAMPLES // 4, deadline=None, derandomize=not LONG,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(storage=st.sampled_from(['mcap', 'sqlite3']), seed=st.integers(0, 2**32 - 1),
       flips=st.integers(1, 64), cut=st.booleans())
def test_mutated_bags_read_or_fail_clearly(small_bags, tmp_path_factory, storage, seed, flips,
                                           cut):
    import shutil

    source = small_bags[storage]
    bag = tmp_path_factory.mktemp('mutated') / 'bag'
    shutil.copytree(source, bag)
    data_file = next(p for p in bag.iterdir() if p.suffix in ('.mcap', '.db3'))
    data = bytearray(data_file.read_bytes())
    rng = random.Random(seed)
    for _ in range(flips):
        data[rng.randrange(len(data))] = rng.randrange(256)
    if cut:
        data = data[:rng.randrange(len(data))]
    data_file.write_bytes(bytes(data))
    try:
        with InputBag(bag) as reader:
            connections = list(reader.reader.connections)
            for conn, _, raw in reader.messages(connections):
                try:
                    reader.deserialize(raw, conn)
                except BagError:
                    pass      # one undecodable message: replay skips or stops on it
    except BagError as err:
        assert str(err)


# --- scheduler operations (fake model: no torch work, milliseconds per case) ---------------
OPS = st.lists(st.one_of(
    st.tuples(st.just('act'), st.booleans()),              # (op, observation is good)
    st.tuples(st.just('advance'), st.none()),
    st.tuples(st.just('budget'), st.integers(0, 6)),        # 0 = adaptive
    st.tuples(st.just('every'), st.integers(0, 3)),
    st.tuples(st.just('fail_next_decode'), st.none())), max_size=60)


@FUZZ
@given(ops=OPS, slots=st.integers(1, 6), n_tokens=st.integers(1, 8),
       eos=st.booleans())
def test_scheduler_operations_keep_the_pool_balanced(ops, slots, n_tokens, eos):
    import dataclasses

    from oxygen_ros.engine import AdaptiveBudget, FixedBudget, LanguagePolicy
    from test_engine_scheduler import make, obs, reference

    policy = LanguagePolicy(max_new_tokens=n_tokens, length_choices=(1, n_tokens),
                            arrival_rate=0.9, eos_id=reference(0, 8)[2] if eos else None)
    engine = make(policy, FixedBudget(2), num_slots=slots)   # check()s
    frame = 0
    for op, arg in ops:
        if op == 'act':
            observation = obs(frame)
            if not arg:
                observation = dataclasses.replace(observation, state=None)   # rejected
                with pytest.raises(ValueError):
                    engine.act(observation)
                continue
            action = engine.act(observation)      # the action path always gets its slot
            assert action.frame_index == frame
            frame += 1
        elif op == 'advance':
            engine.advance_language()
        elif op == 'budget':
            engine.set_budget(FixedBudget(arg) if arg else AdaptiveBudget(0.01, k_max=8))
        elif op == 'every':
            engine.set_policy(dataclasses.replace(engine.policy, every_n_frames=arg,
                                                  arrival_rate=None if arg else 0.9))
        else:
            engine.runner.fail_calls.add(len(engine.runner.decode_calls) + 1)
        assert engine.pool.num_in_use <= slots
    engine.advance_language()             # ends a frame left without its language half
    for _ in range(10 * (n_tokens + 2)):
        if not engine.num_live_requests:
            break
        engine.advance_language()
    assert engine.num_live_requests == 0 and engine.pool.num_in_use == 0
