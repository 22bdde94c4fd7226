"""The node as ROS 2 users expect it, in-process over real DDS: QoS overrides, diagnostics per
namespace, camera_info checks, partial joint-state publishers, a JointTrajectory output.
"""

import threading

import pytest

rclpy = pytest.importorskip('rclpy')

from rclpy.qos import ReliabilityPolicy  # noqa: E402
from sensor_msgs.msg import CameraInfo, JointState  # noqa: E402

from oxygen_ros.ros import qos  # noqa: E402
from oxygen_ros.runtime.actions import action_layout  # noqa: E402
from oxygen_ros.runtime.status import ERROR, OK  # noqa: E402
from ros_helpers import harnesses, TINY_NODE, wait_for  # noqa: E402


@pytest.fixture
def harness(rclpy_context):
    with harnesses(rclpy_context, TINY_NODE, namespaced=True) as make:
        yield make


def _subscription(node, topic):
    (sub,) = [s for s in node.robot_subscriptions if s.topic_name == topic]
    return sub


def test_subscription_qos_can_be_overridden_with_parameters(harness):
    h = harness(**{'qos_overrides./h0/camera/image/image_raw.subscription.depth': 5,
                   'qos_overrides./h0/instruction.subscription_volatile.reliability':
                   'best_effort'})
    h.start()
    assert _subscription(h.node, '/h0/camera/image/image_raw').qos_profile.depth == 5
    assert _subscription(h.node, '/h0/camera/wrist_image/image_raw').qos_profile.depth == 1
    instruction = [s for s in h.node.robot_subscriptions if s.topic_name == '/h0/instruction']
    assert sorted(s.qos_profile.reliability for s in instruction) == sorted(
        [ReliabilityPolicy.RELIABLE, ReliabilityPolicy.BEST_EFFORT])
    assert qos.SENSOR.depth == 1, 'the shared profile is not modified'
    assert wait_for(lambda: len(h.collector.actions) >= 2, 20), h.node.problem_history[-3:]


def test_diagnostics_are_named_per_namespace_with_the_device_and_period(harness):
    a = harness(diagnostics_period_s=0.2)
    b = harness()
    assert a.node.diagnostic_name == 'h0/oxygen_node' and b.node.diagnostic_name == (
        'h1/oxygen_node')
    assert {s.name for s in a.node.diagnostic_statuses()}.isdisjoint(
        s.name for s in b.node.diagnostic_statuses())
    a.collector.clear()
    assert wait_for(lambda: len(a.collector.diagnostics) >= 6, 5), 'about 5 per second'
    statuses = [s for array in a.collector.diagnostics for s in array.status
                if s.name.startswith('h0/oxygen_node: ')]
    assert statuses and {s.hardware_id for s in statuses} == {'cpu'}
    assert a.node.diagnostics_period_s == pytest.approx(0.2)


def test_camera_info_size_check(harness):
    h = harness(**{'cameras.image.check_camera_info': True})
    info_pub = h.feeder.create_publisher(CameraInfo, 'camera/image/camera_info', qos.SENSOR)
    h.start()
    label = "camera 'image' (/h0/camera/image/image_raw)"
    assert wait_for(lambda: f'{label}: no camera_info received yet' in
                    h.statuses()['inputs'].message, 10), h.statuses()['inputs'].message
    size = {'width': 64, 'height': 64}
    timer = h.feeder.create_timer(0.05, lambda: info_pub.publish(CameraInfo(**size)))
    try:
        assert wait_for(lambda: 'frame is 32x32 but camera_info says 64x64' in
                        h.statuses()['inputs'].message, 10), h.statuses()['inputs'].message
        assert h.statuses()['inputs'].level == ERROR
        size.update(width=32, height=32)
        assert wait_for(lambda: h.statuses()['inputs'].level == OK, 10)
        count = len(h.collector.actions)
        assert wait_for(lambda: len(h.collector.actions) >= count + 3, 10)
    finally:
        h.feeder.destroy_timer(timer)


def test_arm_and_gripper_on_separate_joint_state_publishers(harness):
    h = harness()
    names = list(h.values['joint_names'])
    arm, gripper = names[:6], names[6:]
    # Two publishers' messages, alternating, each with only its own joints.
    h.feeder.joint_factory = lambda i: JointState(
        name=arm if i % 2 else gripper, position=[0.1] * (6 if i % 2 else 2))
    h.start()
    assert wait_for(lambda: len(h.collector.actions) >= 10, 20), h.statuses()['inputs'].message
    assert h.statuses()['inputs'].level == OK


def test_joint_position_robot_publishes_a_joint_trajectory(harness):
    from trajectory_msgs.msg import JointTrajectory

    h = harness(robot='aloha', publish_trajectory=True)
    got, lock = [], threading.Lock()

    def on_trajectory(msg):
        with lock:
            got.append(msg)
    h.collector.create_subscription(JointTrajectory, 'joint_trajectory', on_trajectory,
                                    qos.TRAJECTORY)
    h.start()
    assert wait_for(lambda: len(got) >= 2, 20), h.node.problem_history[-3:]
    layout = action_layout('aloha')
    msg = got[-1]
    horizon = h.collector.actions[-1][0].horizon   # rows per chunk of this preset
    assert list(msg.joint_names) == list(layout.names) and len(msg.points) == horizon > 1
    assert (msg.header.stamp.sec, msg.header.stamp.nanosec) == (0, 0)   # start on receipt
    assert [p.time_from_start.nanosec for p in msg.points[:2]] == [20_000_000, 40_000_000]
    assert all(len(p.positions) == 14 for p in msg.points)


def test_the_subtask_driving_the_actions_is_latched_and_in_the_diagnostics(harness):
    """π0.5's subtask loop on the node: language/subtask (reliable, transient-local: a late
    subscriber gets the active subtask) and the diagnostics' subtask, its frame and age."""
    from rclpy.qos import DurabilityPolicy
    from std_msgs.msg import String

    h = harness(decode_budget=8, language_tasks=['narration', 'subtask'],
                **{'tasks.subtask.prompt': 'Subtask of {instruction}:',
                   'tasks.subtask.tokens': 3, 'tasks.subtask.every_n_frames': 40,
                   'tasks.subtask.drives_actions': True, 'subtask_max_age_s': 3600.0})
    h.start()

    def active():
        status = h.statuses().get('subtask')
        return status is not None and dict(status.values)['source'] == 'subtask'
    assert wait_for(active, 30), h.node.problem_history[-3:]
    values = dict(h.statuses()['subtask'].values)
    assert values['frame'] == '0' and float(values['age_s']) > 0 and values['text']
    (info,) = h.collector.get_publishers_info_by_topic('/h0/language/subtask')
    assert info.qos_profile.durability == DurabilityPolicy.TRANSIENT_LOCAL
    assert info.qos_profile.reliability == ReliabilityPolicy.RELIABLE
    got, lock = [], threading.Lock()   # subscribed after it was published: latched

    def on_subtask(msg):
        with lock:
            got.append(msg.data)
    h.collector.create_subscription(String, 'language/subtask', on_subtask, qos.SUBTASK)
    assert wait_for(lambda: got, 10)
    assert got == [values['text']]   # one subtask (every 40 frames), never stale


def test_bf16_kv_store_and_real_time_control_thread_from_parameters(harness):
    """kv_dtype and control_priority reach the engine and the control thread."""
    import os

    import torch

    h = harness(kv_dtype='bfloat16', control_priority=5)
    h.start()
    assert wait_for(lambda: len(h.collector.actions) >= 2, 20), h.node.problem_history[-3:]
    assert h.node.engine.system.runner.store.k.dtype == torch.bfloat16
    assert dict(h.statuses()['model'].values)['kv_dtype'] == 'bfloat16'
    control = h.node.control_thread
    native = control._thread.native_id
    if control.priority_note == '' and not any('SCHED_FIFO' in m for _, m in
                                               h.node.problem_history):
        assert os.sched_getscheduler(native) == os.SCHED_FIFO
        assert os.sched_getparam(native).sched_priority == 5
    else:   # not permitted here: the node says why and keeps running
        assert any('SCHED_FIFO 5' in m for _, m in h.node.problem_history)


def test_removed_camera_arrays_are_read_into_the_per_camera_parameters(harness):
    """An old YAML's camera_topics / camera_compressed are not silently ignored."""
    from oxygen_ros.runtime.status import WARN

    h = harness(camera_topics=['cam/front/image_raw/compressed', 'cam/wrist/image_raw'],
                camera_compressed=[True, False])
    node = h.node
    assert node.get_parameter('cameras.image.topic').value == 'cam/front/image_raw'
    assert node.get_parameter('cameras.image.compressed').value is True
    assert node.get_parameter('cameras.wrist_image.topic').value == 'cam/wrist/image_raw'
    assert node.get_parameter('cameras.wrist_image.compressed').value is False
    warnings = [m for level, m in node.problem_history if level == WARN]
    assert any('camera_topics and camera_compressed are no longer parameters' in m
               and "cameras.image.topic: 'cam/front/image_raw'" in m for m in warnings), warnings


def test_new_camera_parameters_win_over_the_removed_arrays(harness):
    h = harness(camera_topics=['old/image', 'old/wrist'],
                **{'cameras.image.topic': 'new/image'})
    assert h.node.get_parameter('cameras.image.topic').value == 'new/image'
    assert h.node.get_parameter('cameras.wrist_image.topic').value == 'old/wrist'
