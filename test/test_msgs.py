"""The custom messages: field layout, serialisation round trip, pub/sub across two processes.

Run as a script (`python test_msgs.py --publish ACTION_TOPIC LANGUAGE_TOPIC`) this file is the
publisher process of the pub/sub test.
"""

import math
import os
import subprocess
import sys
import time

from hypothesis import given, settings
from hypothesis import strategies as st
from oxygen_ros.msg import ActionChunk, LanguageChunk
import pytest

# The contract (CONTRACTS.md "Messages"): field name -> ROS type, in declaration order.
ACTION_CHUNK_FIELDS = {
    'header': 'std_msgs/Header',
    'frame_index': 'uint64',
    'action_space': 'uint8',
    'names': 'sequence<string>',
    'step_period': 'builtin_interfaces/Duration',
    'horizon': 'uint32',
    'action_dim': 'uint32',
    'actions': 'sequence<float>',
    'inference_time': 'float',
    'start_row': 'uint32',
}
LANGUAGE_CHUNK_FIELDS = {
    'header': 'std_msgs/Header',
    'request_id': 'uint64',
    'origin_frame': 'uint64',
    'token_ids': 'sequence<int32>',
    'text_delta': 'string',
    'tokens_so_far': 'uint32',
    'done': 'boolean',
    'finish_reason': 'string',
}

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1


def sample_action_chunk():
    """Return an ActionChunk with every field away from its default (edge values included)."""
    msg = ActionChunk()
    msg.header.stamp.sec = 1_700_000_123
    msg.header.stamp.nanosec = 999_999_999
    msg.header.frame_id = 'base_link'
    msg.frame_index = UINT64_MAX
    msg.action_space = ActionChunk.END_EFFECTOR_DELTA
    msg.names = ['joint_a', 'gripper ✓']
    msg.step_period.sec = 1
    msg.step_period.nanosec = 999_999_999
    msg.horizon = 3
    msg.action_dim = 2
    # float32-exact values, so equality after the float32 wire format is exact
    msg.actions = [0.5, -1.25, 3.0, 0.125, -0.0625, 65504.0]
    msg.inference_time = 0.046875
    msg.start_row = 2
    return msg


def test_action_space_constants_match_the_runtime_table():
    from oxygen_ros.runtime.actions import ACTION_SPACE_IDS

    assert ACTION_SPACE_IDS == {'joint_position': ActionChunk.JOINT_POSITION,
                                'joint_velocity': ActionChunk.JOINT_VELOCITY,
                                'end_effector_delta': ActionChunk.END_EFFECTOR_DELTA}


def sample_language_chunk():
    """Return a LanguageChunk with every field away from its default (edge values included)."""
    msg = LanguageChunk()
    msg.header.stamp.sec = 42
    msg.header.stamp.nanosec = 7
    msg.header.frame_id = 'camera_base'
    msg.request_id = UINT64_MAX - 1
    msg.origin_frame = 123_456_789_012
    msg.token_ids = [0, 1, INT32_MAX, INT32_MIN, 257151]
    msg.text_delta = 'pick up the bowl → ✓'
    msg.tokens_so_far = UINT32_MAX
    msg.done = True
    msg.finish_reason = 'eos'
    return msg


def assert_header_equal(got, want):
    """Assert two std_msgs/Header are equal field by field."""
    assert got.stamp.sec == want.stamp.sec
    assert got.stamp.nanosec == want.stamp.nanosec
    assert got.frame_id == want.frame_id


def assert_action_chunk_equal(got, want):
    """Assert every field of two ActionChunks is equal."""
    assert_header_equal(got.header, want.header)
    assert got.frame_index == want.frame_index
    assert got.action_space == want.action_space and list(got.names) == list(want.names)
    assert (got.step_period.sec, got.step_period.nanosec) == (want.step_period.sec,
                                                              want.step_period.nanosec)
    assert got.horizon == want.horizon
    assert got.action_dim == want.action_dim
    assert list(got.actions) == list(want.actions)
    assert got.inference_time == want.inference_time
    assert got.start_row == want.start_row
    assert got == want


def assert_language_chunk_equal(got, want):
    """Assert every field of two LanguageChunks is equal."""
    assert_header_equal(got.header, want.header)
    assert got.request_id == want.request_id
    assert got.origin_frame == want.origin_frame
    assert list(got.token_ids) == list(want.token_ids)
    assert got.text_delta == want.text_delta
    assert got.tokens_so_far == want.tokens_so_far
    assert got.done == want.done
    assert got.finish_reason == want.finish_reason
    assert got == want


def reliable_qos():
    """Return reliable, volatile, keep-last-10 QoS (same on both sides of the test)."""
    from rclpy.qos import QoSProfile, ReliabilityPolicy

    return QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)


def roundtrip(msg):
    """Serialise `msg` to CDR bytes and back."""
    from rclpy.serialization import deserialize_message, serialize_message

    return deserialize_message(serialize_message(msg), type(msg))


# ---------------------------------------------------------------------------------------------
# layout

def test_action_chunk_fields_match_contract():
    assert ActionChunk.get_fields_and_field_types() == ACTION_CHUNK_FIELDS


def test_language_chunk_fields_match_contract():
    assert LanguageChunk.get_fields_and_field_types() == LANGUAGE_CHUNK_FIELDS


def test_defaults_are_empty():
    action, language = ActionChunk(), LanguageChunk()
    assert (action.frame_index, action.horizon, action.action_dim) == (0, 0, 0)
    assert len(action.actions) == 0 and action.inference_time == 0.0
    assert (language.request_id, language.origin_frame, language.tokens_so_far) == (0, 0, 0)
    assert len(language.token_ids) == 0
    assert (language.text_delta, language.done, language.finish_reason) == ('', False, '')


# ---------------------------------------------------------------------------------------------
# serialisation round trip

def test_action_chunk_roundtrip_every_field():
    want = sample_action_chunk()
    assert_action_chunk_equal(roundtrip(want), want)


def test_language_chunk_roundtrip_every_field():
    want = sample_language_chunk()
    assert_language_chunk_equal(roundtrip(want), want)


float32s = st.floats(width=32, allow_nan=False)
# ROS strings are NUL-terminated UTF-8 on the C side: no NUL (it would end them early) and
# no lone surrogates (they cannot be encoded at all)
ros_text = st.text(st.characters(exclude_characters='\x00', codec='utf-8'), max_size=60)
header_parts = st.tuples(st.integers(INT32_MIN, INT32_MAX), st.integers(0, UINT32_MAX),
                         ros_text)


@settings(max_examples=60, deadline=None)
@given(header=header_parts,
       frame_index=st.integers(0, UINT64_MAX),
       shape=st.tuples(st.integers(0, 6), st.integers(0, 8)),
       data=st.data(),
       inference_time=float32s)
def test_action_chunk_roundtrip_property(header, frame_index, shape, data, inference_time):
    horizon, action_dim = shape
    actions = data.draw(st.lists(float32s, min_size=horizon * action_dim,
                                 max_size=horizon * action_dim))
    want = ActionChunk(frame_index=frame_index, horizon=horizon, action_dim=action_dim,
                       actions=actions, inference_time=inference_time)
    want.header.stamp.sec, want.header.stamp.nanosec, want.header.frame_id = header
    got = roundtrip(want)
    assert_action_chunk_equal(got, want)
    assert len(got.actions) == got.horizon * got.action_dim


@settings(max_examples=60, deadline=None)
@given(header=header_parts,
       ids=st.tuples(st.integers(0, UINT64_MAX), st.integers(0, UINT64_MAX)),
       token_ids=st.lists(st.integers(INT32_MIN, INT32_MAX), max_size=40),
       text_delta=ros_text,
       tokens_so_far=st.integers(0, UINT32_MAX),
       done=st.booleans(),
       finish_reason=st.sampled_from(['', 'eos', 'length', 'evicted', 'error', 'refused']))
def test_language_chunk_roundtrip_property(header, ids, token_ids, text_delta, tokens_so_far,
                                           done, finish_reason):
    want = LanguageChunk(request_id=ids[0], origin_frame=ids[1], token_ids=token_ids,
                         text_delta=text_delta, tokens_so_far=tokens_so_far, done=done,
                         finish_reason=finish_reason)
    want.header.stamp.sec, want.header.stamp.nanosec, want.header.frame_id = header
    assert_language_chunk_equal(roundtrip(want), want)


def test_float32_fields_round_like_float32():
    # the wire type is float32: a float64 value comes back rounded, never garbled
    got = roundtrip(ActionChunk(actions=[0.1], inference_time=1 / 3))
    assert got.actions[0] == pytest.approx(0.1, rel=1e-7)
    assert got.inference_time == pytest.approx(1 / 3, rel=1e-7)
    assert not math.isnan(got.inference_time)


# ---------------------------------------------------------------------------------------------
# pub/sub across two processes over real DDS

PUBSUB_TIMEOUT_S = 60.0


def publish_samples(action_topic, language_topic, timeout_s=PUBSUB_TIMEOUT_S):
    """Publish one sample of each message once a subscriber is matched (publisher process)."""
    import rclpy
    from rclpy.context import Context
    from rclpy.duration import Duration

    context = Context()
    rclpy.init(context=context)
    node = rclpy.create_node('oxygen_ros_test_publisher', context=context)
    try:
        publishers = [node.create_publisher(ActionChunk, action_topic, reliable_qos()),
                      node.create_publisher(LanguageChunk, language_topic, reliable_qos())]
        deadline = time.monotonic() + timeout_s
        while any(p.get_subscription_count() < 1 for p in publishers):
            if time.monotonic() > deadline:
                print('publisher: no subscriber matched', file=sys.stderr)
                return 1
            time.sleep(0.02)
        publishers[0].publish(sample_action_chunk())
        publishers[1].publish(sample_language_chunk())
        # reliable QoS: stay alive until the subscriber has acknowledged both samples
        for publisher in publishers:
            if not publisher.wait_for_all_acked(Duration(seconds=timeout_s)):
                print('publisher: samples not acknowledged', file=sys.stderr)
                return 1
        return 0
    finally:
        node.destroy_node()
        rclpy.shutdown(context=context)


def test_pubsub_across_processes(rclpy_context):
    import rclpy
    from rclpy.executors import SingleThreadedExecutor

    # topic names unique per run, on top of the per-run domain id
    suffix = '%d_%d' % (os.getpid(), time.monotonic_ns() % 1_000_000)
    action_topic = 'oxygen_test/actions_' + suffix
    language_topic = 'oxygen_test/language_' + suffix
    received = {}
    node = rclpy.create_node('oxygen_ros_test_subscriber', context=rclpy_context)
    executor = SingleThreadedExecutor(context=rclpy_context)
    publisher_process = None
    try:
        node.create_subscription(ActionChunk, action_topic,
                                 lambda msg: received.setdefault('action', msg), reliable_qos())
        node.create_subscription(LanguageChunk, language_topic,
                                 lambda msg: received.setdefault('language', msg),
                                 reliable_qos())
        executor.add_node(node)
        # same interpreter, same environment: same ROS_DOMAIN_ID, localhost-only discovery
        publisher_process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), '--publish', action_topic,
             language_topic],
            env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + PUBSUB_TIMEOUT_S
        while len(received) < 2 and time.monotonic() < deadline:
            executor.spin_once(timeout_sec=0.1)
            if publisher_process.poll() not in (None, 0):
                break
        output, _ = publisher_process.communicate(timeout=PUBSUB_TIMEOUT_S)
        assert publisher_process.returncode == 0, output
        assert set(received) == {'action', 'language'}, (received, output)
        assert_action_chunk_equal(received['action'], sample_action_chunk())
        assert_language_chunk_equal(received['language'], sample_language_chunk())
    finally:
        if publisher_process is not None and publisher_process.poll() is None:
            publisher_process.kill()
            publisher_process.wait()
        executor.shutdown()
        node.destroy_node()


if __name__ == '__main__':
    if len(sys.argv) == 4 and sys.argv[1] == '--publish':
        sys.exit(publish_samples(sys.argv[2], sys.argv[3]))
    sys.exit('usage: %s --publish ACTION_TOPIC LANGUAGE_TOPIC' % sys.argv[0])
