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


def test_release_shared_memory_removes_only_the_segment_this_process_locks(tmp_path):
    """Only the segment whose `_el` file this process holds a lock on goes: not another
    process's segment it maps, nor the port segments the domain's participants share."""
    import fcntl

    from oxygen_ros.ros.dds import release_shared_memory

    names = ('fastdds_0123abcd', 'fastdds_4567ef01', 'fastdds_port7400')
    for name in names:
        (tmp_path / name).write_bytes(b'\0' * 64)
        (tmp_path / f'{name}_el').write_bytes(b'')
    held = [open(tmp_path / f'{name}_el', 'rb') for name in (names[0], names[2])]
    try:
        for handle in held:
            fcntl.flock(handle, fcntl.LOCK_EX)
        removed = release_shared_memory(shm_dir=tmp_path)
    finally:
        for handle in held:
            handle.close()
    assert sorted(removed) == ['fastdds_0123abcd', 'fastdds_0123abcd_el']
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        'fastdds_4567ef01', 'fastdds_4567ef01_el', 'fastdds_port7400', 'fastdds_port7400_el']
    assert release_shared_memory(pid=1, shm_dir=tmp_path) == []   # locks of another pid


def test_ctrl_c_with_the_fast_exit_leaves_no_dds_segment_behind():
    """The node's fast exit (os._exit) skipped Fast DDS's C++ teardown, which unlinks the
    participant's /dev/shm segment: every restart of oxygen_node left ~0.5 MB behind."""
    import signal
    import subprocess
    import sys
    import threading

    from oxygen_ros.ros.dds import owned_segments

    node = subprocess.Popen(
        [sys.executable, '-c', 'from oxygen_ros.ros.node import main; main()', '--ros-args',
         '-p', 'preset:=tiny'], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(120, node.kill)   # a node that never gets ready fails, not hangs
    watchdog.start()
    try:
        for line in node.stdout:
            if 'engine ready' in line:
                break
        assert node.poll() is None, 'the node ended before its engine was ready'
        created = owned_segments(node.pid)   # the node's own: no other process's files count
        if not created:
            pytest.skip('this RMW keeps no Fast DDS segment in /dev/shm')
        node.send_signal(signal.SIGINT)
        said = node.stdout.read()
        assert node.wait(timeout=20) == 0, f'Ctrl-C did not end the node cleanly:\n{said[-3000:]}'
    finally:
        watchdog.cancel()
        if node.poll() is None:
            node.kill()
    assert not [path.name for path in created if path.exists()]


def test_an_error_in_spin_or_on_the_way_out_exits_1_and_still_tears_everything_down(capfd):
    """A real error ends run_node with 1 and its traceback; a step of the teardown that fails
    no longer skips the steps after it (the context stayed up and the fast exit's segment
    release ran on a live participant). Ctrl-C's own errors are told apart by the context
    going down, which a real error is not followed by."""
    from rclpy.node import Node

    from oxygen_ros.ros.dds import run_node

    made = []

    class Faulty(Node):
        def __init__(self, fail_in):
            super().__init__('faulty_node')
            self.fail_in = fail_in
            self.create_timer(0.01, self.tick)
            made.append(self)

        def tick(self):
            if self.fail_in == 'spin':
                raise RuntimeError('a callback failed')
            raise KeyboardInterrupt   # what Ctrl-C raises in the spinning thread

        def destroy_node(self):
            super().destroy_node()
            if self.fail_in == 'destroy':
                raise RuntimeError('destroy failed')

    assert run_node(lambda: Faulty('spin'), [], fast_exit=False) == 1
    assert 'stopped by an error' in capfd.readouterr().err
    assert not rclpy.ok(), 'the context was shut down after the error'
    assert run_node(lambda: Faulty('destroy'), [], fast_exit=False) == 1
    err = capfd.readouterr().err
    assert 'failed to destroy the node on the way out' in err and 'destroy failed' in err
    assert not rclpy.ok(), 'the steps after the failing one still ran'
    assert len(made) == 2
