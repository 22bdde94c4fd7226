"""Real-time chunking through ROS: the node's rtc_* parameters, ActionChunk.start_row, the
chunk player and the JointTrajectory output starting at that row."""

import numpy as np
import pytest

from oxygen_ros.engine import ActionOutput
from oxygen_ros.runtime.actions import action_layout, Chunk, ChunkPlayback
from oxygen_ros.runtime.rtc import CommittedChunk

rclpy = pytest.importorskip('rclpy')

from rclpy.parameter import Parameter  # noqa: E402

from oxygen_ros.msg import ActionChunk  # noqa: E402
from ros_helpers import harnesses, TINY_NODE, wait_for  # noqa: E402


def _set(node, name, value):
    (result,) = node.set_parameters([Parameter(name, value=value)])
    return result


def test_rtc_parameters_refused_with_a_reason_and_applied_while_active(rclpy_context):
    with harnesses(rclpy_context, TINY_NODE) as make:
        h = make(rtc_mode='guided', rtc_delay=1)
        node, col = h.node, h.collector
        h.start()
        assert wait_for(lambda: len(col.actions) >= 4, 30), node.problem_history[-5:]
        # nothing to continue yet (frame 0 may go out before the collector is matched)
        assert all(m.start_row == 0 for m, _, _ in col.actions if m.frame_index == 0)
        # a chunk continues the one published before it (start at row d = 1) while that one
        # still has rows for it (a loaded machine may tick later than the 4 rows of tiny)
        pairs = consecutive([m for m, _, _ in col.actions])
        assert pairs
        for old, new in pairs:
            assert new.start_row == (1 if covers(old, new) else 0), (old.header, new.header)

        for name, value, reason in [
                ('rtc_mode', 'sometimes', 'must be one of off, guided, prefix'),
                ('rtc_schedule', 'cosine', 'must be one of linear, exp'),
                ('rtc_delay', -5, ''),                   # rclpy's own range check
                ('rtc_max_guidance_weight', 0.0, ''),
                ('rtc_execution_horizon', 'all', '')]:   # wrong type
            result = _set(node, name, value)
            assert not result.successful, name
            assert result.reason and reason in result.reason, result.reason
        assert node.get_parameter('rtc_mode').value == 'guided'   # the old values are kept
        assert node.get_parameter('rtc_max_guidance_weight').value == 10.0
        assert node._loop.rtc.settings.mode == 'guided'

        # a valid change applies from the next tick: prefix holds row 0 at the committed path
        assert _set(node, 'rtc_mode', 'prefix').successful
        assert wait_for(lambda: node._loop.rtc.settings.mode == 'prefix', 5)
        switched = after_switch(col)
        assert wait_for(lambda: len(switched()) >= 6, 30)
        held = 0
        for old, new in consecutive(switched()):
            if not covers(old, new):
                continue   # nothing was left to continue
            committed = CommittedChunk()
            committed.record(_rows(old), _seconds(old.header.stamp), PERIOD)
            rows = committed.rows_at(_seconds(new.header.stamp))
            # stamps travel as ns and are read back as float seconds near 1.8e9 (0.2 us
            # apart): the interpolation weight here differs by ~1e-5 from the node's
            np.testing.assert_allclose(_rows(new)[0], rows[0], atol=1e-4)
            n = len(rows)   # past row d - 1 = 0 the rows are the model's own
            assert n < 2 or not np.allclose(_rows(new)[1:n], rows[1:n], atol=1e-4)
            held += 1
        assert held, 'no consecutive chunks to compare'

        # `ros2 param set /oxygen_node rtc_mode off` sends false (YAML): read as 'off'
        assert not _set(node, 'rtc_mode', True).successful
        assert _set(node, 'rtc_mode', False).successful
        assert wait_for(lambda: node._loop.rtc.settings.mode == 'off', 5)
        assert any("rtc_mode false is read as 'off'" in m for _, m in node.problem_history)
        switched = after_switch(col)
        assert wait_for(lambda: len(switched()) >= 6, 30)
        assert {new.start_row for _, new in consecutive(switched())} == {0}


PERIOD = action_layout('libero').step_period_s


def consecutive(msgs):
    """Pairs (old, new) of received chunks of consecutive frames."""
    return [(a, b) for a, b in zip(msgs, msgs[1:]) if b.frame_index == a.frame_index + 1]


def after_switch(col, margin=3):
    """Return a function listing the chunks sure to be computed after a mode switch seen now.

    The switch applies at the start of the node's next tick; chunks of earlier ticks may
    still be on their way (DDS delivery on a busy machine): frames up to `margin` past the
    newest one received now are left out.
    """
    newest = max(m.frame_index for m, _, _ in col.actions)
    return lambda: [m for m, _, _ in col.actions if m.frame_index >= newest + margin]


def covers(old, new):
    """Whether `old` still has a row at the time of `new`'s row 0 (RTC has rows to continue)."""
    offset = (_seconds(new.header.stamp) - _seconds(old.header.stamp)) / PERIOD
    return 0 <= offset <= old.horizon - 1 + 1e-6


def _rows(msg):
    return np.asarray(msg.actions, np.float64).reshape(msg.horizon, msg.action_dim)


def _seconds(stamp):
    return stamp.sec + stamp.nanosec * 1e-9


def test_playback_starts_at_the_row_the_chunk_names():
    playback = ChunkPlayback(open_loop_rows=2)
    rows = np.arange(6, dtype=float)[:, None]
    playback.offer(Chunk(0.0, rows, 0.05, start_row=3))
    # rows 3 and 4 are the open-loop ones, then it goes on along the chunk (no newer one)
    assert [playback.step(0.1)[0] for _ in range(3)] == [3.0, 4.0, 5.0]
    playback.offer(Chunk(0.2, rows + 10, 0.05, start_row=1))
    assert playback.step(0.25)[0] == 11.0
    playback.offer(Chunk(0.3, rows + 20, 0.05, start_row=9))      # past the end: nothing
    assert playback.step(0.35) is not None                         # plan: row 12 first
    assert playback.step(0.35) is None and playback.stats.starved_steps == 1


def test_chunk_player_node_starts_at_start_row(rclpy_context):
    from oxygen_ros.ros.chunk_player import ChunkPlayer
    from oxygen_ros.ros.conversions import seconds_to_duration

    player = ChunkPlayer(context=rclpy_context)
    try:
        now = player.get_clock().now()
        msg = ActionChunk(action_space=ActionChunk.JOINT_POSITION, names=['a', 'b'],
                          step_period=seconds_to_duration(0.02), horizon=4, action_dim=2,
                          actions=[float(v) for v in range(8)], start_row=2)
        msg.header.stamp = now.to_msg()
        player._on_chunk(msg)
        assert player.playback.step(now.nanoseconds * 1e-9).tolist() == [4.0, 5.0]   # row 2
    finally:
        player.destroy_node()


def test_joint_trajectory_holds_the_rows_from_start_row():
    from oxygen_ros.ros.conversions import action_chunk_msg, joint_trajectory_msg

    layout = action_layout('aloha')
    actions = np.arange(10 * 14, dtype=np.float32).reshape(10, 14)
    action = ActionOutput(3, actions, np.zeros((10, 32)), 0.1, 1.0, start_row=2)
    msg = joint_trajectory_msg(action, 'base', layout)
    assert len(msg.points) == 8
    assert msg.points[0].positions.tolist() == actions[2].tolist()
    first = msg.points[0].time_from_start
    assert first.sec + first.nanosec * 1e-9 == pytest.approx(layout.step_period_s)
    from builtin_interfaces.msg import Time
    assert action_chunk_msg(action, Time(), 'base', layout).start_row == 2
