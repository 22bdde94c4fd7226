"""oxygen_node regression tests for the robustness review (issue 11), in-process over real DDS.

Each test names the finding it pins; the ROS-free findings are in test_robustness.py.
"""

import pytest

rclpy = pytest.importorskip('rclpy')

from rclpy.lifecycle import TransitionCallbackReturn  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402

from oxygen_ros.runtime import engine_setup  # noqa: E402
from oxygen_ros.runtime.status import ERROR  # noqa: E402
from ros_helpers import harnesses, TINY_NODE, wait_for  # noqa: E402


@pytest.fixture
def harness(rclpy_context):
    with harnesses(rclpy_context, TINY_NODE) as make:
        yield make


def _set(node, name, value):
    (result,) = node.set_parameters([Parameter(name, value=value)])
    return result


def _still_acting(h, more=3):
    n = len(h.collector.actions)
    return wait_for(lambda: len(h.collector.actions) >= n + more, 20)


def test_a_path_parameter_that_raises_does_not_kill_the_node(harness):
    # Finding: `ros2 param set /oxygen_node tokenizer "~nosuchuser/x"` (or a path over 255
    # characters) raised inside the parameter callback and the node process exited.
    h = harness()
    h.start()
    assert _still_acting(h)
    for value in ('~nosuchuser/x', '/' + 'x' * 300 + '.model', '/etc/passwd'):
        result = _set(h.node, 'tokenizer', value)
        assert not result.successful and 'not a readable SentencePiece model' in result.reason
    assert _still_acting(h)


def test_invalid_topic_name_fails_configure_with_the_reason(harness):
    # Finding: publishers/subscriptions were made outside configure's try; an invalid topic
    # name failed with no log and no diagnostic.
    h = harness()
    node = h.node
    assert _set(node, 'cameras.wrist_image.topic', 'bad topic!').successful
    assert node.trigger_configure() == TransitionCallbackReturn.FAILURE
    model = {s.name.split(': ')[1]: s for s in node.diagnostic_statuses()}['model']
    assert model.level == ERROR and 'bad topic!' in model.message
    assert node.robot_subscriptions == [] and node.robots == {}, 'nothing left half-made'
    assert any('bad topic!' in line for _, line in node.problem_history)
    assert _set(node, 'cameras.wrist_image.topic', 'camera/wrist_image/image_raw').successful
    h.start()
    assert _still_acting(h)


def test_staleness_is_not_loosened_while_active(harness):
    # Finding: any DDS peer could disable the staleness guard of a running robot.
    h = harness()
    h.start()
    result = _set(h.node, 'stale_frame_timeout_s', 4.0)
    assert not result.successful and 'loosens a safety limit' in result.reason
    assert not _set(h.node, 'stale_frame_timeout_s', 3600.0).successful   # out of range too
    assert _set(h.node, 'stale_frame_timeout_s', 1.0).successful            # tightening is fine
    assert not _set(h.node, 'use_sim_time', True).successful                # clocks: not now
    assert h.node.trigger_deactivate() == TransitionCallbackReturn.SUCCESS
    assert _set(h.node, 'stale_frame_timeout_s', 4.0).successful
    assert h.node.trigger_activate() == TransitionCallbackReturn.SUCCESS
    assert _still_acting(h)


def test_unsafe_changes_are_allowed_when_asked_at_startup(harness):
    h = harness(allow_unsafe_changes=True)
    h.start()
    assert _set(h.node, 'stale_frame_timeout_s', 4.0).successful
    assert not _set(h.node, 'allow_unsafe_changes', False).successful   # read-only


def test_kv_capacity_that_does_not_fit_in_memory_fails_configure(harness, monkeypatch):
    # Finding: kv_capacity=4096 set over DDS could take the robot computer out of memory.
    monkeypatch.setattr(engine_setup, 'available_memory_bytes', lambda device: 1 << 20)
    h = harness(kv_capacity=512)
    assert h.node.trigger_configure() == TransitionCallbackReturn.FAILURE
    model = {s.name.split(': ')[1]: s for s in h.node.diagnostic_statuses()}['model']
    assert 'more than half the free memory' in model.message
    assert not _set(h.node, 'kv_capacity', 4096).successful   # beyond the range


def test_discovery_defaults_to_this_machine():
    # Finding: installed entry points used ROS defaults (subnet discovery).
    from oxygen_ros.ros.node import default_discovery_to_localhost

    env = {}
    assert 'LOCALHOST' in default_discovery_to_localhost(env)
    assert env == {'ROS_AUTOMATIC_DISCOVERY_RANGE': 'LOCALHOST'}
    env = {'ROS_DISTRO': 'humble'}
    default_discovery_to_localhost(env)
    assert env['ROS_LOCALHOST_ONLY'] == '1'
    env = {'ROS_AUTOMATIC_DISCOVERY_RANGE': 'SUBNET'}
    assert 'from the environment' in default_discovery_to_localhost(env)
    assert env == {'ROS_AUTOMATIC_DISCOVERY_RANGE': 'SUBNET'}
