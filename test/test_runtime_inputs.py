"""The node's pure parts: instruction cleaning, latest-frame buffer and observation assembly,
problem log, loop statistics, diagnostic statuses, parameter checks and the robot configs.
"""

import math
from pathlib import Path
import time
import types

import numpy as np
import pytest

from oxygen_ros.runtime.conversions import InputError, joint_state_to_vector
from oxygen_ros.runtime.inputs import (build_observation, InputSet, InputSource, InputStatus,
                                       LatestBuffer, sanitize_instruction, TransportLoss)
from oxygen_ros.runtime.params import (camera_param_specs, check_value, deprecation_warning,
                                       load_node_params, PARAMS, parse_decode_budget,
                                       robot_defaults, ROBOT_IO, Settings)
from oxygen_ros.runtime.status import build_statuses, ERROR, LoopStats, OK, ProblemLog, WARN

CONFIG_DIR = Path(__file__).resolve().parents[1] / 'config'


# --- instruction -----------------------------------------------------------------------------
def test_plain_instruction_is_unchanged():
    got = sanitize_instruction('pick up the red block', 500)
    assert got.text == 'pick up the red block' and got.notes == []


def test_huge_instruction_is_truncated_and_reported():
    raw = 'stack the blocks ' * 1000
    got = sanitize_instruction(raw, 100)
    assert len(got.text) <= 100 and got.truncated and got.received_chars == len(raw)
    assert raw.startswith(got.text)
    assert got.notes == [f'truncated from {len(raw)} to {len(got.text)} characters']


def test_unsafe_characters_are_removed_and_counted():
    # U+FFFD is what rclpy makes of bytes that are not UTF-8; \ud800 a lone surrogate.
    got = sanitize_instruction('pick\x00up\x1b[31m the\ufffd\ufffd cup\u200b\ud800\n', 500)
    assert got.text == 'pick up [31m the cup'
    assert got.invalid_chars == 3 and got.control_chars == 3
    assert any('invalid' in n for n in got.notes) and any('control' in n for n in got.notes)


@pytest.mark.parametrize('raw', ['', '   ', '\n\t', '\ufffd\x00'])
def test_empty_or_blank_instruction_means_no_task(raw):
    assert sanitize_instruction(raw, 500).text == ''


def test_instruction_is_nfc_normalised():
    assert sanitize_instruction('cafe\u0301', 50).text == 'caf\u00e9'


# --- observation assembly --------------------------------------------------------------------
def _image_msg(value, stamp_s=0.0):
    stamp = types.SimpleNamespace(sec=int(stamp_s), nanosec=int(stamp_s % 1 * 1e9))
    return types.SimpleNamespace(value=value, header=types.SimpleNamespace(stamp=stamp))


def _camera_convert(msg):
    if msg.value is None:
        raise InputError('unsupported encoding')
    return np.full((4, 4, 3), msg.value, np.uint8)


def _joints_convert(msg):
    if any(math.isnan(v) for v in msg):
        raise InputError('NaN or inf position')
    return np.asarray(msg, dtype=np.float64)


CAMERAS = [('image', InputSource('camera:image', "camera 'image'", _camera_convert)),
           ('wrist', InputSource('camera:wrist', "camera 'wrist'", _camera_convert))]
JOINTS = InputSource('joint_states', 'joint_states', _joints_convert)
TASK = sanitize_instruction('stack the cups', 500)


def _filled(now=10.0):
    buffer = LatestBuffer()
    buffer.put('camera:image', _image_msg(1, stamp_s=9.5), now - 0.05)
    buffer.put('camera:wrist', _image_msg(2), now - 0.05)
    buffer.put('joint_states', [0.1, 0.2], now - 0.01)
    return buffer


def test_fresh_inputs_make_an_observation():
    result = build_observation(_filled(), CAMERAS, JOINTS, TASK, 10.0, 0.5, 0.0)
    obs = result.observation
    assert result.problems == {}
    assert sorted(obs.images) == ['image', 'wrist'] and obs.images['wrist'][0, 0, 0] == 2
    np.testing.assert_array_equal(obs.state, [0.1, 0.2])
    assert obs.instruction == 'stack the cups'
    assert obs.stamp == pytest.approx(9.5)   # the first camera's header stamp
    assert [s.state for s in result.inputs] == ['ok', 'ok', 'ok']


def test_zero_header_stamp_falls_back_to_receipt_time():
    buffer = _filled()
    buffer.put('camera:image', _image_msg(1, stamp_s=0.0), 9.9)
    assert build_observation(buffer, CAMERAS, JOINTS, TASK, 10.0, 0.5, 0).observation.stamp \
        == pytest.approx(9.9)


def test_never_received_camera_is_named():
    buffer = _filled()
    buffer.clear()
    buffer.put('camera:image', _image_msg(1), 9.9)
    buffer.put('joint_states', [0.0, 0.0], 9.9)
    result = build_observation(buffer, CAMERAS, JOINTS, TASK, 10.0, 0.5, started_s=4.0)
    assert result.observation is None
    assert result.problems == {'camera:wrist': "camera 'wrist': never received (waiting 6.0 s)"}


def test_stale_camera_is_reported_with_its_age():
    buffer = _filled()
    buffer.put('camera:wrist', _image_msg(2), 8.0)
    result = build_observation(buffer, CAMERAS, JOINTS, TASK, 10.0, 0.5, 0.0)
    assert result.observation is None
    assert 'stale, last message 2.00 s ago' in result.problems['camera:wrist']
    assert result.inputs[1].state == 'stale' and result.inputs[1].count == 2


def test_bad_message_is_converted_once_and_reported():
    buffer = _filled()
    calls = []

    def convert(msg):
        calls.append(msg)
        return _camera_convert(msg)
    cams = [('image', InputSource('camera:image', "camera 'image'", convert)), CAMERAS[1]]
    buffer.put('camera:image', _image_msg(None), 9.99)
    for _ in range(3):
        result = build_observation(buffer, cams, JOINTS, TASK, 10.0, 0.5, 0.0)
        assert result.problems == {'camera:image': "camera 'image': unsupported encoding"}
    assert len(calls) == 1


@pytest.mark.parametrize('instruction, reason', [
    (None, 'none received yet'), (sanitize_instruction('  ', 500), 'empty'),
])
def test_missing_or_empty_instruction_gives_no_observation(instruction, reason):
    result = build_observation(_filled(), CAMERAS, JOINTS, instruction, 10.0, 0.5, 0.0)
    assert result.observation is None and reason in result.problems['instruction']


def test_nan_joints_give_no_observation():
    buffer = _filled()
    buffer.put('joint_states', [0.1, float('nan')], 9.99)
    result = build_observation(buffer, CAMERAS, JOINTS, TASK, 10.0, 0.5, 0.0)
    assert result.problems == {'joint_states': 'joint_states: NaN or inf position'}


# --- joint states merged per joint name ------------------------------------------------------
ARM_AND_GRIPPER = ['j1', 'j2', 'finger']


def _merging_inputs(stale_s=0.5):
    joints = InputSource('joint_states', 'joint_states',
                         lambda m: joint_state_to_vector(m.name, m.position, ARM_AND_GRIPPER))
    inputs = InputSet(CAMERAS, joints, stale_s, joint_names=ARM_AND_GRIPPER)
    inputs.set_instruction(TASK)
    for key, value in (('camera:image', 1), ('camera:wrist', 2)):
        inputs.put(key, _image_msg(value), 9.9)
    return inputs


def _joint_msg(names, positions):
    return types.SimpleNamespace(name=names, position=positions)


def test_partial_joint_state_publishers_are_merged_per_joint():
    inputs = _merging_inputs()
    inputs.put('joint_states', _joint_msg(['j1', 'j2', 'other'], [0.1, 0.2, 9.0]), 9.8)
    # Only the arm so far: the gripper is named as missing, not a generic failure.
    assert 'missing joints' in inputs.build(10.0).problems['joint_states']
    inputs.put('joint_states', _joint_msg(['finger'], [0.04]), 9.9)
    # Arm and gripper alternate (separate publishers): every tick has the whole state.
    for t, msg in ((9.95, _joint_msg(['j1', 'j2'], [0.3, 0.4])),
                   (9.97, _joint_msg(['finger'], [0.05]))):
        inputs.put('joint_states', msg, t)
        result = inputs.build(10.0)
        assert result.problems == {}
    np.testing.assert_array_equal(result.observation.state, [0.3, 0.4, 0.05])


def test_one_stale_joint_stops_the_state_and_is_named():
    inputs = _merging_inputs(stale_s=0.5)
    inputs.put('joint_states', _joint_msg(['finger'], [0.04]), 9.0)          # gripper stopped
    inputs.put('joint_states', _joint_msg(['j1', 'j2'], [0.1, 0.2]), 9.95)   # arm is fresh
    result = inputs.build(10.0)
    assert result.observation is None
    assert "stale joints ['finger'], oldest received 1.00 s ago" in (
        result.problems['joint_states'])
    inputs.put('joint_states', _joint_msg(['finger'], [0.04]), 9.99)
    assert inputs.build(10.0).problems == {}


def test_a_malformed_joint_state_is_reported_then_repaired():
    inputs = _merging_inputs()
    inputs.put('joint_states', _joint_msg(ARM_AND_GRIPPER, [0.1, 0.2, 0.3]), 9.9)
    inputs.put('joint_states', _joint_msg(['j1', 'j2'], [0.1]), 9.95)
    assert '2 names but 1 positions' in inputs.build(10.0).problems['joint_states']
    inputs.put('joint_states', _joint_msg(['j1'], [0.5]), 9.97)
    result = inputs.build(10.0)
    np.testing.assert_array_equal(result.observation.state, [0.5, 0.2, 0.3])


# --- problem log and statistics --------------------------------------------------------------
class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_transport_loss_counts_the_middlewares_losses_not_overwritten_messages():
    """A depth-1 subscription read at 5 Hz from a 15 Hz publisher takes every third message:
    the gaps in sequence numbers are messages it did not need, not losses."""
    loss = TransportLoss(window_s=10.0)
    lost_total = 0
    for tick in range(50):                       # 10 s of ticks at 5 Hz
        now = 0.2 * tick
        seq = 3 * tick + 1                       # the newest of the 3 sent since the last tick
        if 20 <= tick < 30:                      # the middleware lost 2 of them each tick
            lost_total += 2
        loss.taken('camera:a', now, 0.01, seq, b'pub', sent_s=now - 0.01)
        loss.lost_total('camera:a', now, lost_total)
    assert loss.window('camera:a', 9.8) == (148, 20)     # sent by sequence numbers; lost
    assert loss.window('camera:a', 30.0) == (0, 0)       # the window moved past them
    assert loss.window('camera:b', 1.0) == (None, None)  # never taken: not measured


def test_without_a_lost_count_late_newest_messages_estimate_the_loss():
    loss = TransportLoss(window_s=10.0)
    period = 1 / 15
    for tick in range(50):
        now = 0.2 * tick
        seq = 3 * tick + 1
        # every other tick the two newest messages never came: the newest is 3 periods old
        age = 0.01 + (2 * period if tick % 2 else 0.0)
        loss.taken('camera:a', now, age, seq, b'pub', sent_s=now - age)
        loss.lost_total('camera:a', now, None)           # the middleware does not count
    sent, lost = loss.window('camera:a', 9.8)
    assert sent == 148 and 20 <= lost <= 50, (sent, lost)
    quiet = TransportLoss()
    for tick in range(50):
        quiet.taken('camera:a', 0.2 * tick, 0.02, 3 * tick + 1, b'pub', 0.2 * tick)
    assert quiet.window('camera:a', 9.8) == (148, 0)
    no_sequence = TransportLoss()
    no_sequence.taken('camera:a', 1.0, 0.5)
    assert no_sequence.window('camera:a', 1.0) == (None, None)


def test_a_camera_losing_messages_warns_and_names_the_remedy():
    inputs = InputSet([('image', InputSource('camera:image', "camera 'image'", lambda m: m))],
                      InputSource('joint_states', 'joint_states', lambda m: m), 1.0)
    inputs.loss_remedy = 'use the profile config/fastdds_large_frames.xml'
    for tick, lost_total in enumerate((0, 10, 20)):
        inputs.loss.taken('camera:image', tick, 0.01, 1 + 15 * tick, b'p', tick)
        inputs.loss.lost_total('camera:image', tick, lost_total)
    camera = inputs.build(2.0).inputs[0]
    assert (camera.sent, camera.lost) == (31, 20)
    assert 'lost in transport' in camera.warning and 'fastdds_large_frames' in camera.warning
    status = _statuses(inputs=[camera])['inputs']
    assert status.level == WARN and 'fastdds_large_frames' in status.message
    assert dict(status.values)['lost_in_transport'] == "camera 'image': 20"
    few = InputStatus("camera 'image'", 'ok', 0.1, 100, sent=100, lost=2)
    assert _statuses(inputs=[few])['inputs'].level == OK     # 2 lost: not a pattern yet


def test_problem_log_logs_once_reminds_and_resolves():
    clock, lines = FakeClock(), []
    log = ProblemLog(lambda level, msg: lines.append((level, msg)), repeat_s=10, clock=clock)
    for i in range(50):   # 5 s of a 10 Hz tick seeing the same stale camera
        clock.t = i * 0.1
        log.update('inputs', {'cam': f'cam stale, {0.6 + i * 0.1:.1f} s ago'})
    assert lines == [(WARN, 'cam stale, 0.6 s ago')]
    clock.t = 12.0
    log.update('inputs', {'cam': 'cam stale, 12.6 s ago'})
    assert lines[-1][0] == WARN and 'still; 50 times' in lines[-1][1]
    log.update('inputs', {'cam': 'cam: unsupported encoding'})   # another problem: at once
    assert lines[-1] == (WARN, 'cam: unsupported encoding')
    log.update('inputs', {})
    assert lines[-1] == (OK, 'resolved: cam: unsupported encoding')
    assert log.active('inputs') == {}


def test_problem_log_events_are_throttled_per_key():
    clock, lines = FakeClock(), []
    log = ProblemLog(lambda level, msg: lines.append(msg), repeat_s=5, clock=clock)
    for i in range(10):
        clock.t = i * 0.1
        log.event('tick', ERROR, 'tick failed')
        log.event('other', ERROR, 'other failed')
    clock.t = 6.0
    log.event('tick', ERROR, 'tick failed')
    assert lines == ['tick failed', 'other failed', 'tick failed (9 more since)']


def test_loop_stats_rates_percentiles_and_misses():
    clock = FakeClock()
    stats = LoopStats(window_s=5.0, clock=clock)
    for i in range(50):                                      # 10 Hz for 5 s
        clock.t = i * 0.1
        late = i % 10 == 0
        stats.record(clock.t, 0.15 if late else 0.02, 0.1, None if i == 3 else 0.01 + i * 1e-4,
                     0.008, tokens=2)
    clock.t = 4.95
    snap = stats.snapshot()
    assert snap['tick_rate_hz'] == pytest.approx(10.1, rel=0.05)
    assert snap['action_rate_hz'] == pytest.approx(9.9, rel=0.05)
    assert snap['tokens_per_s'] == pytest.approx(20.2, rel=0.05)
    assert snap['deadline_misses_total'] == 5 and snap['skipped_total'] == 1
    assert 10 < snap['latency_p50_ms'] < 14 and snap['latency_p99_ms'] <= 15


def _statuses(**overrides):
    loop = LoopStats().snapshot()
    loop.update(action_rate_hz=10.0, tokens_per_s=30.0, latency_p50_ms=20.0,
                since_last_action_s=0.05, ticks_window=50)
    kwargs = dict(node='oxygen_node', lifecycle='active', model={'robot': 'libero'},
                  loop=loop, target_rate_hz=10.0,
                  engine={'k': 2, 'active_requests': 3, 'budget': 'FixedBudget(k=2)',
                          'finished': {'length': 4},
                          'kv_usage': {'slots_in_use': 3, 'slots_total': 6, 'bytes_in_use': 3,
                                       'bytes_total': 6, 'peak_slots_in_use': 4}},
                  inputs=[], input_problems={}, instruction=TASK)
    kwargs.update(overrides)
    return {s.name.split(': ')[1]: s for s in build_statuses(**kwargs)}


def test_statuses_report_every_required_quantity():
    statuses = _statuses()
    assert {s.level for s in statuses.values()} == {OK}
    keys = {k for s in statuses.values() for k, _ in s.values}
    for key in ('target_rate_hz', 'action_rate_hz', 'deadline_misses_total', 'latency_p50_ms',
                'latency_p99_ms', 'tokens_per_s', 'active_requests', 'slots_used',
                'slots_total', 'bytes_used', 'bytes_total', 'current_k', 'stale_or_missing',
                'last_error'):
        assert key in keys, key


def test_statuses_escalate_input_problems_and_lost_requests():
    engine = {'k': 1, 'active_requests': 0, 'budget': 'b', 'finished': {'evicted': 2},
              'kv_usage': {'slots_in_use': 6, 'slots_total': 6, 'bytes_in_use': 6,
                           'bytes_total': 6, 'peak_slots_in_use': 6}}
    loop = LoopStats().snapshot()
    loop.update(action_rate_hz=10.0, tokens_per_s=3.0, latency_p50_ms=20.0,
                since_last_action_s=0.05, ticks_window=50, requests_completed_window=7,
                requests_evicted_window=2, requests_refused_window=1)
    statuses = _statuses(input_problems={'cam': "camera 'wrist': stale"}, engine=engine,
                         loop=loop)
    assert statuses['control loop'].level == ERROR
    assert "camera 'wrist': stale" in statuses['inputs'].message
    language = statuses['language']
    assert language.level == WARN
    assert '7 requests completed, 2 evicted, 1 refused in the last 5 s' in language.message
    assert ('requests_refused_window', '1') in language.values
    assert statuses['kv cache'].level == WARN
    # Requests lost long ago (outside the window) no longer warn; the totals stay.
    loop.update(requests_evicted_window=0, requests_refused_window=0)
    language = _statuses(engine=engine, loop=loop)['language']
    assert language.level == OK and ('finished_evicted', '2') in language.values


def test_loop_stats_count_ended_requests_per_window():
    clock = FakeClock()
    stats = LoopStats(window_s=5.0, clock=clock)
    for i in range(100):                                     # 10 Hz for 10 s
        clock.t = i * 0.1
        stats.record(clock.t, 0.02, 0.1, 0.01, 0.008, tokens=1,
                     ended={'length': 1} if i % 2 else {'refused': 1})
    stats.record_ended(clock.t, {'evicted': 1})              # a tick of another robot
    clock.t = 9.95                                           # the window: ticks 50..99
    snap = stats.snapshot()
    assert snap['requests_completed_window'] == 25 and snap['requests_refused_window'] == 25
    assert snap['requests_evicted_window'] == 1 and snap['requests_error_window'] == 0
    assert snap['completed_per_min'] == pytest.approx(60 * 25 / 5.0, rel=0.05)


def test_failed_configure_is_an_error_status():
    statuses = build_statuses('oxygen_node', 'unconfigured', {}, None, 10.0, None, [], {}, None,
                              config_error='configure failed: shape mismatch')
    assert [(s.level, s.message) for s in statuses] == [
        (ERROR, 'unconfigured: configure failed: shape mismatch')]


# --- parameters ------------------------------------------------------------------------------
@pytest.mark.parametrize('name, value, reason', [
    ('control_rate_hz', 0.05, 'must be 0 (auto) or in'),
    ('control_rate_hz', float('nan'), 'must be in'),
    ('tokens_per_request', 0, 'must be in'),
    ('decode_budget', 'fast', 'expected an integer k >= 0 (0 = adaptive)'),
    ('decode_budget', -1, 'must be in [0, 512]'),
    ('decode_budget', '-2', 'k must be >= 0'),
    ('decode_budget', 2.5, 'expected an integer'),
    ('cameras.image.compressed', 'yes', 'expected a bool'),
    ('cameras.image.topic', 3, 'expected a string'),
    ('robot', 'pr2', 'unknown robot; expected one of aloha, droid, libero, so101'),
    ('preset', 'huge', 'unknown preset'),
    ('dtype', 'int8', 'must be one of'),
    ('device', 'gpu0', "expected 'cpu'"),
    ('checkpoint', '/does/not/exist', 'is not a readable checkpoint folder'),
    # Regression (#11): these raised inside the parameter callback and killed the node.
    ('checkpoint', '~nosuchuser/x', 'is not a readable checkpoint folder'),
    ('checkpoint', '/tmp/' + 'x' * 300, 'is not a readable checkpoint folder'),
    ('checkpoint', 'a\x00b', 'is not a readable checkpoint folder'),
    ('tokenizer', '~nosuchuser/tok.model', 'is not a readable SentencePiece model file'),
    # An existing file outside a checkpoint's layout gets the same answer as a missing one.
    ('checkpoint', '/etc/passwd', 'is not a readable checkpoint folder'),
    ('tokenizer', '/etc/passwd', 'is not a readable SentencePiece model file'),
    ('camera_names', ['image', 'image'], 'duplicate'),
    ('joint_names', ['a', ''], 'must not be empty'),
    ('language_prompt', 'say {task}', 'unknown placeholder {task}'),
])
def test_bad_parameter_values_have_reasons(name, value, reason):
    assert reason in check_value(name, value)


@pytest.mark.parametrize('name, value', [
    ('control_rate_hz', 30.0), ('decode_budget', 0), ('decode_budget', 4),
    # the deprecated string forms are still accepted
    ('decode_budget', 'adaptive'), ('decode_budget', ' 4 '),
    ('cameras.image.compressed', True), ('diagnostics_period_s', 0.5),
    ('checkpoint', ''), ('language_prompt', 'Describe: {instruction}'), ('preset', 'tiny'),
])
def test_good_parameter_values_pass(name, value):
    assert check_value(name, value) is None


def test_decode_budget_parsing_and_the_deprecated_string_form():
    assert parse_decode_budget(0) is None and parse_decode_budget(3) == 3
    assert parse_decode_budget('adaptive') is None and parse_decode_budget('3') == 3
    assert deprecation_warning('decode_budget', 4) == ''
    assert 'use the integer 0 (0 = adaptive)' in deprecation_warning('decode_budget', 'adaptive')
    assert '-p decode_budget:=4' in deprecation_warning('decode_budget', "4")
    assert Settings.from_values({'decode_budget': 'adaptive'}).decode_budget is None
    assert Settings.from_values({'decode_budget': '5'}).decode_budget == 5


def test_cameras_are_names_with_sub_parameters_in_image_transport_naming():
    settings = Settings.from_values({
        'cameras.image.topic': '/zed/left', 'cameras.image.compressed': True,
        'cameras.wrist_image.check_camera_info': True})
    image, wrist = settings.cameras
    assert (image.topic, image.image_topic, image.info_topic) == (
        '/zed/left', '/zed/left/compressed', '/zed/camera_info')
    assert (wrist.image_topic, wrist.info_topic, wrist.check_camera_info) == (
        'camera/wrist_image/image_raw', 'camera/wrist_image/camera_info', True)
    with pytest.raises(ValueError, match='two cameras subscribe the same topic'):
        Settings.from_values({'cameras.image.topic': 'cam', 'cameras.wrist_image.topic': 'cam'})
    with pytest.raises(ValueError, match=r"unknown camera parameters \['cameras.image.tpoic'\]"):
        Settings.from_values({'cameras.image.tpoic': 'x'})


def test_nested_yaml_camera_sections_read_as_dotted_parameters(tmp_path):
    path = tmp_path / 'p.yaml'
    path.write_text('/**/oxygen_node:\n  ros__parameters:\n    cameras:\n      image:\n'
                    '        topic: /front\n        compressed: true\n')
    assert load_node_params(path) == {'cameras.image.topic': '/front',
                                      'cameras.image.compressed': True}


def test_publish_trajectory_only_for_joint_position_robots():
    assert Settings.from_values(dict(robot_defaults('aloha'), publish_trajectory=True))
    with pytest.raises(ValueError, match="robot 'droid' acts in joint_velocity"):
        Settings.from_values(dict(robot_defaults('droid'), publish_trajectory=True))


def test_settings_cross_checks_name_every_problem():
    values = dict(robot_defaults('droid'), joint_names=['j'] * 3)
    values['camera_names'] = ['exterior_image_1_left', 'image']
    with pytest.raises(ValueError) as err:
        Settings.from_values(values)
    text = str(err.value)
    assert "lacks ['wrist_image_left']" in text and "has ['image']" in text
    assert 'joint_names has 3 names' in text


def test_diagnostic_aggregator_config_groups_the_node_statuses():
    import yaml

    config = yaml.safe_load((CONFIG_DIR / 'diagnostic_aggregator.yaml').read_text())
    analyzer = config['analyzers']['ros__parameters']['oxygen']
    assert analyzer['type'] == 'diagnostic_aggregator/GenericAnalyzer'
    names = [s.name for node in ('arm1/oxygen_node', 'oxygen_node/arm_left')
             for s in build_statuses(node, 'unconfigured', {}, None, 10.0, None, [], {}, None)]
    assert names and all(any(c in n for c in analyzer['contains']) for n in names)


@pytest.mark.parametrize('robot', sorted(ROBOT_IO))
def test_robot_configs_are_valid_and_complete(robot):
    values = load_node_params(CONFIG_DIR / f'{robot}.yaml')
    cameras = {s.name for c in ROBOT_IO[robot][0] for s in camera_param_specs(c)}
    # robots: one robot, its default; rcl cannot read an empty list from a parameter file.
    assert set(values) == {s.name for s in PARAMS} - {'autostart', 'robots'} | cameras, (
        'config lists every param')
    settings = Settings.from_values(values)
    assert settings.robot == robot and settings.checkpoint == ''
    assert [c.name for c in settings.cameras] == list(ROBOT_IO[robot][0])


def test_param_file_keys_rcl_accepts(tmp_path):
    path = tmp_path / 'p.yaml'
    path.write_text('/**:\n  ros__parameters: {seed: 1, preset: tiny}\n'
                    '/**/oxygen_node:\n  ros__parameters: {seed: 2}\n')
    assert load_node_params(path) == {'seed': 2, 'preset': 'tiny'}
    path.write_text('other_node:\n  ros__parameters: {seed: 1}\n')
    with pytest.raises(ValueError, match='no "oxygen_node: ros__parameters:" section'):
        load_node_params(path)


def test_mps_is_refused_with_the_reason():
    """The model computes its flow-time embedding in float64 on its device; MPS has no float64,
    so 'mps' is refused when set, not at the first act()."""
    from oxygen_ros.runtime.params import check_value

    why = check_value('device', 'mps')
    assert why and 'float64' in why and "'cpu'" in why
    assert check_value('device', 'cuda:1') is None and check_value('device', 'cpu') is None
    assert 'expected' in check_value('device', 'tpu')


def test_robot_io_table_and_the_models_robots_agree_with_the_specs():
    """params.ROBOT_IO (the node's camera and joint defaults, torch-free) and model.ROBOTS
    (the adapters' specs) both come from config/robots/: every shipped robot is in
    ROBOT_IO, every robot of model.ROBOTS too, with the same cameras and joints."""
    from oxygen_ros.model.robot_spec import get_robot, shipped_robots
    from oxygen_ros.model.robots import ROBOTS

    assert set(ROBOT_IO) == set(shipped_robots()) >= set(ROBOTS)
    for robot, (cameras, joints) in ROBOT_IO.items():
        spec = get_robot(robot)
        assert tuple(cameras) == tuple(spec.camera_names), robot
        assert tuple(joints) == tuple(spec.joint_names), robot
        if robot in ROBOTS:
            assert ROBOTS[robot].camera_names == spec.camera_names, robot
            assert ROBOTS[robot].joint_names == spec.joint_names, robot
            assert ROBOTS[robot].state_dim == len(joints), robot


# --- why a tick was late: act()'s CPU share -----------------------------------------------------
class _OneObservation:
    """Inputs that always have an observation (what FrameLoop.tick needs of an InputSet)."""

    instruction = None

    def build(self, now_s):
        from oxygen_ros.engine.types import Observation
        from oxygen_ros.runtime.inputs import ObservationResult
        obs = Observation(images={}, state=np.zeros(8, np.float32), instruction=TASK.text,
                          stamp=now_s)
        return ObservationResult(obs, {}, [], round(now_s * 1e9))


class _TimedAct:
    """A one-robot engine whose act() sleeps `seconds` (off the CPU) or spins for `seconds` of
    this thread's CPU time (on the CPU; its wall time grows when the machine is loaded)."""

    robots = {'': None}
    num_live_requests = 0

    def __init__(self, how: str, seconds: float = 0.06):
        self.how, self.seconds = how, seconds

    def live_requests(self, robot):
        return 0

    def scheduler(self, robot):
        from types import SimpleNamespace
        return SimpleNamespace(tasks=())

    def act(self, observations, continuations=None):
        from oxygen_ros.engine import FleetActions
        from oxygen_ros.engine.types import ActionOutput
        start, cpu_start = time.perf_counter(), time.thread_time()
        if self.how == 'sleep':
            time.sleep(self.seconds)
        else:
            while time.thread_time() - cpu_start < self.seconds:
                pass
        seconds = time.perf_counter() - start
        actions = {name: ActionOutput(0, np.zeros((2, 7), np.float32),
                                      np.zeros((2, 32), np.float32), seconds, obs.stamp)
                   for name, obs in observations.items()}
        return FleetActions(actions, {}, {}, len(actions), seconds)


class _Sink:
    def action(self, action, stamp_ns):
        pass


def test_a_late_tick_says_whether_act_waited_or_ran():
    """The CPU share of act() is measured (its CPU time over its wall time), and the late
    tick's hint follows the share: a loaded machine may hand a spinning act() a core only
    part of the time, and then the hint rightly says it waited, so the test asserts the
    CPU seconds and the hint for the share measured, not a share a quiet machine gives."""
    from oxygen_ros.runtime.frame_loop import FrameLoop, RobotLoop
    from oxygen_ros.runtime.status import WAITED_SHARE

    for how in ('sleep', 'spin'):
        loop = FrameLoop(_TimedAct(how), [RobotLoop('', _OneObservation(), _Sink(), 0.01)])
        outcomes = [loop.tick(0.1 * i, serve_all=True, language=lambda: False)['']
                    for i in range(3)]
        cpu_s = [o.act_cpu_share * o.action.inference_time_s for o in outcomes]
        if how == 'sleep':
            assert max(cpu_s) < 0.01, cpu_s                 # off the CPU while it slept
        else:
            assert min(cpu_s) > 0.05, cpu_s                 # its 60 ms of CPU, about
        snap = loop.only.stats.snapshot()
        assert snap['deadline_misses_total'] == 3      # 60 ms acts in a 10 ms period
        loop_status = _statuses(loop={**snap, 'action_rate_hz': 1.0, 'ticks_window': 3,
                                      'since_last_action_s': 0.05})['control loop']
        assert loop_status.level == WARN
        hint = loop_status.message.split('; ', 1)[1]
        waited = snap['late_act_cpu_share_p50'] < WAITED_SHARE
        assert ('waited for a core' in hint) == waited, loop_status.message
        assert ('too slow for this rate' in hint) == (not waited), loop_status.message
        if how == 'sleep':
            assert waited, snap
