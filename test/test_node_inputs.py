"""Bad robot input, in-process over real DDS: every case gives a clear log line and a
diagnostic status, the control timer keeps its rate, nothing crashes, no request is lost.

One node runs through the cases of the module (each case breaks one input, checks, repairs);
cases that need another configuration (a camera that never starts, a compressed camera) get
their own node.
"""

import array
import struct
import time

import pytest

rclpy = pytest.importorskip('rclpy')

from rclpy.context import Context  # noqa: E402
from rclpy.qos import (QoSProfile, qos_profile_system_default,  # noqa: E402
                       ReliabilityPolicy)
from rclpy.serialization import serialize_message  # noqa: E402
from sensor_msgs.msg import CompressedImage, Image, JointState  # noqa: E402
from std_msgs.msg import String  # noqa: E402

from oxygen_ros.runtime.status import ERROR, OK, WARN  # noqa: E402
from oxygen_ros.runtime.params import ROBOT_IO  # noqa: E402
from ros_helpers import harnesses, NodeHarness, wait_for  # noqa: E402

RATE_HZ = 20.0
PARAMS = dict(preset='tiny', decode_budget=1, tokens_per_request=5, control_rate_hz=RATE_HZ,
              stale_frame_timeout_s=1.0, max_instruction_chars=200)
JOINTS = list(ROBOT_IO['libero'][1])
IMAGE_TOPIC = "camera 'image' (/camera/image/image_raw)"


def image(encoding='rgb8', height=32, width=32, step=96, nbytes=32 * 96):
    return lambda i: Image(encoding=encoding, height=height, width=width, step=step,
                           data=array.array('B', bytes(nbytes)))


def joints(names, positions):
    return lambda i: JointState(name=names, position=positions)


def raw_string(payload: bytes) -> bytes:
    """A serialised std_msgs/String whose bytes are `payload` (need not be UTF-8)."""
    header = serialize_message(String(data=''))[:4]   # CDR encapsulation header
    return header + struct.pack('<I', len(payload) + 1) + payload + b'\x00'


@pytest.fixture(scope='module')
def running():
    context = Context()
    rclpy.init(context=context)
    h = NodeHarness(context, PARAMS, rate_hz=RATE_HZ)
    try:
        h.start()
        assert wait_for(lambda: len(h.collector.actions) >= 5, 30), h.node.problem_history
        yield h
    finally:
        h.close()
        rclpy.shutdown(context=context)


def _ticks_per_s(h, seconds=1.0):
    """Control ticks per second, and the feeder's timer rate over the same second.

    The feeder's 20 Hz timer runs in the same process: when a shared machine stalls the
    process, both slow down, so comparing the two tests the node, not the machine.
    """
    t0, n0, f0 = time.monotonic(), h.node.loop.only.stats.ticks_total, h.feeder.index
    time.sleep(seconds)
    elapsed = time.monotonic() - t0
    return ((h.node.loop.only.stats.ticks_total - n0) / elapsed,
            (h.feeder.index - f0) / elapsed)


def _keeps_rate(h):
    # This VM sometimes stalls the whole process for a second (the plain timer drops too):
    # the node keeps its rate if any of three one-second windows shows it ticking normally.
    for _ in range(3):
        rate, reference = _ticks_per_s(h)
        print(f'timer at {rate:.1f} Hz of {RATE_HZ:g} (a plain 20 Hz timer: {reference:.1f} Hz)')
        if rate > 0.25 * reference and rate > 0:
            return True
    return False


def _logged(h, level, text):
    return any(lvl == level and text in line for lvl, line in h.node.problem_history)


# (case, how to break the input, reason in log and diagnostics, whether actions stop)
CASES = [
    ('wrong encoding', ('image', image(encoding='16UC1')),
     f"{IMAGE_TOPIC}: unsupported encoding '16UC1'", True),
    ('step too small', ('image', image(step=40)),
     f'{IMAGE_TOPIC}: step 40 < width * channels = 96', True),
    ('truncated data', ('image', image(nbytes=1000)),
     f'{IMAGE_TOPIC}: truncated data: 1000 bytes, expected step * height = 96 * 32 = 3072',
     True),
    ('zero size', ('image', image(height=0, nbytes=0)), f'{IMAGE_TOPIC}: bad size 32x0', True),
    ('stale camera', ('wrist_image', None),
     "camera 'wrist_image' (/camera/wrist_image/image_raw): stale, last message", True),
    ('NaN joint', ('joints', joints(JOINTS, [0.0, float('nan')] + [0.0] * 6)),
     "joint_states (/joint_states): NaN or inf position for joints ['eef_y']", True),
    # Joints are merged per name: a publisher that stops sending one joint leaves that joint
    # to go stale on its own.
    ('missing joint', ('joints', joints(JOINTS[:-1], [0.0] * 7)),
     "joint_states (/joint_states): stale joints ['gripper_right_finger']", True),
    ('stale joints', ('joints', None), 'joint_states (/joint_states): stale', True),
    ('empty instruction', ('instruction', ''),
     'instruction: empty, so there is no task (no actions)', True),
]


@pytest.mark.parametrize('case, breakage, reason, stops', CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_reported_and_survived(running, case, breakage, reason, stops):
    h = running
    target, bad = breakage
    assert wait_for(lambda: h.statuses()['inputs'].level == OK, 10), h.statuses()['inputs']
    seen_requests = {m.request_id for m, _, _ in h.collector.tokens}

    if target == 'joints':
        h.feeder.joint_factory = bad
    elif target == 'instruction':
        h.feeder.instruct(bad)
    else:
        h.feeder.image_factory[target] = bad
    try:
        assert wait_for(lambda: reason in h.statuses()['inputs'].message, 10), (
            h.statuses()['inputs'].message)
        inputs = h.statuses()['inputs']
        assert inputs.level == ERROR
        assert h.statuses()['control loop'].level == ERROR
        assert wait_for(lambda: _logged(h, WARN, reason) or (
            case == 'empty instruction' and _logged(h, WARN, 'instruction is empty')), 5), (
            h.node.problem_history[-5:])
        # the same status over DDS
        assert wait_for(lambda: (s := h.collector.latest_status('inputs')) is not None
                        and reason in s.message, 5)

        actions_before = len(h.collector.actions)
        print(f'\n{case}: ', end='')
        assert _keeps_rate(h), 'the control timer must keep its rate'
        if stops:
            assert len(h.collector.actions) <= actions_before + 1, 'no actions from bad input'
        # Requests started before the fault still finish (language-only ticks advance them).
        done = {m.request_id for m, _, _ in h.collector.tokens if m.done}
        assert wait_for(lambda: seen_requests <= {m.request_id for m, _, _ in
                                                  h.collector.tokens if m.done}, 5), (
            seen_requests - done)
    finally:
        h.restore_inputs()
        h.feeder.instruct('pick up the red block')
    count = len(h.collector.actions)
    assert wait_for(lambda: len(h.collector.actions) >= count + 3, 30), 'actions resume'
    label = reason.split(':')[0]
    assert wait_for(lambda: [line for _, line in h.node.problem_history if label in line][
        -1].startswith('resolved: '), 5), 'the log says when the problem ended'


def test_huge_instruction_is_truncated_and_reported(running):
    h = running
    h.feeder.instruct('move the cup to the left ' * 4000)   # 100k characters
    assert wait_for(lambda: 'instruction truncated from 100000 to' in
                    h.statuses()['inputs'].message, 10)
    assert h.statuses()['inputs'].level == WARN
    assert wait_for(lambda: _logged(h, WARN, 'instruction truncated from 100000 to'), 5)
    count = len(h.collector.actions)
    assert wait_for(lambda: len(h.collector.actions) >= count + 5, 30), 'a long task still acts'
    h.feeder.instruct('pick up the red block')
    assert wait_for(lambda: h.statuses()['inputs'].level == OK, 10)


def test_non_utf8_instruction_is_cleaned_and_reported(running):
    h = running
    h.feeder.instruct(raw_string(b'open the \xff\xfe drawer\x1b'))
    assert wait_for(lambda: _logged(h, OK, 'instruction: "open the drawer"'), 10), (
        h.node.problem_history[-4:])
    assert wait_for(lambda: _logged(h, WARN, 'invalid (non-UTF-8) characters removed'), 5)
    assert 'control characters replaced' in h.statuses()['inputs'].message
    count = len(h.collector.actions)
    assert wait_for(lambda: len(h.collector.actions) >= count + 3, 30)
    history = len(h.node.problem_history)
    h.feeder.instruct('pick up the red block')
    assert wait_for(lambda: len(h.node.problem_history) > history, 10)   # logged in the test


@pytest.fixture
def harness(rclpy_context):
    with harnesses(rclpy_context, PARAMS, namespaced=True, rate_hz=RATE_HZ) as make:
        yield make


def test_camera_that_never_starts(harness):
    h = harness(**{'cameras.wrist_image.topic': 'camera/nobody/image_raw'})
    h.feeder.image_factory['wrist_image'] = None   # nobody publishes there
    h.start()
    reason = "camera 'wrist_image' (/h0/camera/nobody/image_raw): never received (waiting"
    assert wait_for(lambda: reason in h.statuses()['inputs'].message, 10)
    assert wait_for(lambda: _logged(h, WARN, reason), 5)
    # The other inputs are missing too until the feeder's publishers are discovered (seen in
    # CI under load): then only the camera that never starts.
    only = "camera 'wrist_image' (/h0/camera/nobody/image_raw)"

    def stale():
        return dict(h.statuses()['inputs'].values)['stale_or_missing']
    assert wait_for(lambda: stale() == only, 10), stale()
    assert _keeps_rate(h) and h.collector.actions == []


def test_corrupt_compressed_camera(harness):
    # image_transport naming: base topic camera/image/image_raw, frames on .../compressed.
    h = harness(**{'cameras.image.compressed': True})
    h.feeder.image_factory['image'] = lambda i: CompressedImage(
        format='jpeg', data=array.array('B', b'\xff\xd8\xff\xe0garbage'))
    h.start()
    reason = "camera 'image' (/h0/camera/image/image_raw/compressed): cannot decode compressed"
    assert wait_for(lambda: reason in h.statuses()['inputs'].message, 10), (
        h.statuses()['inputs'].message)
    assert wait_for(lambda: _logged(h, WARN, reason), 5)
    assert _keeps_rate(h) and h.collector.actions == []

    from oxygen_ros.ros.sim_inputs import camera_frame, compressed_msg
    clock = h.feeder.get_clock()
    h.feeder.image_factory['image'] = lambda i: compressed_msg(
        camera_frame('astronaut', 32, i), clock.now().to_msg())
    assert wait_for(lambda: len(h.collector.actions) >= 3, 10), 'good jpeg frames act'


def test_instruction_from_the_cli_default_qos_reaches_the_node_and_newest_wins(running):
    """`ros2 topic pub /instruction std_msgs/msg/String "data: ..."` works as typed.

    The CLI's default profile is system_default (reliable + volatile here), which a
    transient-local subscription alone refuses; the node also subscribes volatile.
    """
    h = running
    cli = h.feeder.create_publisher(String, 'instruction', qos_profile_system_default)

    def instruction():
        return h.node.robots[''].inputs.instruction.text

    def publish_until_seen(pub, text):
        # As `ros2 topic pub -t 3` does: publish a few times, once discovery has matched.
        return wait_for(lambda: pub.publish(String(data=text)) or instruction() == text, 10,
                        interval=0.3)
    assert publish_until_seen(cli, 'wipe the table'), h.node.problem_history[-3:]
    h.feeder.instruct('stack the cups')                 # the latched publisher again: newest
    assert wait_for(lambda: instruction() == 'stack the cups', 10)
    assert publish_until_seen(cli, 'open the drawer')   # and the CLI again
    assert not _logged(h, WARN, 'incompatible QoS'), 'both kinds of publisher are expected'
    count = len(h.collector.actions)
    assert wait_for(lambda: len(h.collector.actions) >= count + 3, 10), 'a task: it acts'
    h.feeder.instruct('pick up the red block')


def test_instruction_publisher_with_incompatible_qos_is_named(running):
    h = running
    # Best effort: neither reliable subscription takes it. It lives until the feeder goes
    # (destroying it while the executor waits on its QoS event would race the executor).
    h.feeder.create_publisher(String, 'instruction', QoSProfile(
        depth=1, reliability=ReliabilityPolicy.BEST_EFFORT))
    assert wait_for(lambda: _logged(h, WARN, 'incompatible QoS'), 10), (
        h.node.problem_history[-3:])


def test_cameras_and_joint_states_are_taken_by_the_control_thread(harness):
    """Camera and joint-state messages never run an executor callback (ros/polling.py).

    The executor would otherwise wake, take and run Python for each of 60 messages a second
    here; the node takes the newest one at the start of a tick, on its control thread.
    """
    h = harness()
    executor = h.node_spinner.executor
    taken, original = [], executor._take_subscription

    def counting_take(sub):
        taken.append(sub.topic_name)
        return original(sub)
    executor._take_subscription = counting_take
    h.start()
    assert wait_for(lambda: len(h.collector.actions) >= 10, 30), h.node.problem_history[-3:]
    sent = sum(h.feeder.sent.values())
    h.feeder.instruct('put the bowl on the plate')
    assert wait_for(lambda: '/h0/instruction' in taken, 10), taken
    assert sent > 10 and set(taken) == {'/h0/instruction'}, (sent, set(taken))
    statuses = h.statuses()
    assert statuses['inputs'].level == OK, statuses['inputs'].message


def test_polled_input_age_is_its_receipt_time_not_the_tick_time(harness):
    """A frame taken at activation, seconds after it arrived, counts as stale."""
    from rclpy.lifecycle import TransitionCallbackReturn
    h = harness()
    assert h.node.trigger_configure() == TransitionCallbackReturn.SUCCESS
    # Frames count only once discovery has matched the feeder with the new subscription.
    assert wait_for(lambda: h.node.count_publishers('/h0/camera/image/image_raw') >= 1, 10)
    sent = h.feeder.sent['image']
    assert wait_for(lambda: h.feeder.sent['image'] >= sent + 3, 10)
    h.feeder.image_factory['image'] = None          # the main camera stops while inactive
    time.sleep(PARAMS['stale_frame_timeout_s'] + 0.5)
    assert h.node.trigger_activate() == TransitionCallbackReturn.SUCCESS
    assert wait_for(lambda: h.node.loop.only.stats.ticks_total >= 2, 10)
    states = {s.label: s for s in h.node.loop.only.last_inputs.inputs}
    camera = states[IMAGE_TOPIC.replace('/camera', '/h0/camera', 1)]
    assert camera.state == 'stale' and camera.age_s > PARAMS['stale_frame_timeout_s'], camera
    assert h.collector.actions == []
