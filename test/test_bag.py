"""Rosbag replay: bag in -> engine -> bag out, read back with rosbags; errors and partial bags.

Bags are written here with rosbags (cameras, instruction, joint states) and replayed with the
tiny random preset; the output is decoded with the definitions embedded in it, as any other
tool would, and compared field by field with the engine's FrameResults.
"""

import os
from pathlib import Path
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from oxygen_ros.bag import BagError, InputBag, load_params, OutputBag, Replay
from oxygen_ros.bag.synthetic import (demo_image, demo_joint_positions, image_msg,
                                      joint_state_msg, string_msg, write_demo_bag)
from oxygen_ros.bag.replay import build_engine
from oxygen_ros.bag.typestore import (ACTION_CHUNK, IMAGE, JOINT_STATE, LANGUAGE_CHUNK,
                                      make_typestore, STRING)
from oxygen_ros.bag.writer import qos_profile
from bag_helpers import read_bag
from oxygen_ros.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
START_NS = 1_700_000_000 * 10**9
DURATION_S = 1.0
RATE_HZ = 10.0
TICKS = int(DURATION_S * RATE_HZ) + 1            # ticks at 0, 0.1, ..., 1.0 s
ENGINE = {'preset': 'tiny', 'tokens_per_request': 4, 'decode_budget': 2, 'seed': 3}
IMAGE_HW = (32, 32)


# Tiny models on a shared CPU: more threads only add contention (conftest.py).
pytestmark = pytest.mark.usefixtures('one_torch_thread')


@pytest.fixture(scope='module')
def params():
    return load_params(None, ENGINE)


@pytest.fixture(scope='module')
def demo_bag(tmp_path_factory, params):
    path = tmp_path_factory.mktemp('bags') / 'demo'
    return write_demo_bag(path, params, DURATION_S, image_hw=IMAGE_HW, start_ns=START_NS)


def replay(bag, out, params, **kwargs):
    """Replay with a collector of every (observation, FrameResult)."""
    frames = []
    kwargs.setdefault('on_frame', lambda obs, result: frames.append((obs, result)))
    summary = Replay(bag, out, params, rate='max', **kwargs).run()
    return summary, frames


def custom_data(path):
    import yaml
    meta = yaml.safe_load((Path(path) / 'metadata.yaml').read_text())
    return meta['rosbag2_bagfile_information']['custom_data'] or {}


def write_bag(path, params, duration_s=DURATION_S, storage='mcap', camera_hz=15.0,
              image=None, extra=(), skip_topics=(), joint_type=JOINT_STATE, store=None):
    """Input bag; image(camera index, time s) -> message or None; extra: (t, topic, type, msg)."""
    store = store or make_typestore()
    events = [(START_NS, params.resolve('instruction'), STRING,
               string_msg(store, 'pick up the red block'))]
    names = list(params.settings.joint_names)
    for k in range(int(duration_s * 50) + 1):
        t = START_NS + k * 20_000_000
        msg = joint_state_msg(store, names, demo_joint_positions(k * 0.02, len(names)), t)
        if joint_type == STRING:
            msg = string_msg(store, 'not a joint state')
        events.append((t, params.resolve('joint_states'), joint_type, msg))
    for i, (camera, topic, _) in enumerate(params.cameras()):
        for k in range(int(duration_s * camera_hz) + 1):
            t = START_NS + round(k * 1e9 / camera_hz)
            msg = image(i, (t - START_NS) * 1e-9, t) if image else None
            if msg is None:
                msg = image_msg(store, demo_image(i, (t - START_NS) * 1e-9, *IMAGE_HW), t, camera)
            events.append((t, topic, IMAGE, msg))
    events = [e for e in events if e[1] not in skip_topics] + list(extra)
    events.sort(key=lambda e: e[0])
    with OutputBag(path, store, storage) as out:
        for t, topic, msgtype, msg in events:
            if isinstance(msg, bytes):
                out.write_raw(topic, msgtype, t, msg)
            else:
                latched = topic.endswith('instruction')
                out.write(topic, msgtype, t, msg, [qos_profile(True, latched)])
    return path


# --- replay -------------------------------------------------------------------------------------
def test_replay_writes_every_output_with_fields_intact(tmp_path, demo_bag, params):
    summary, frames = replay(demo_bag, tmp_path / 'out', params)
    assert summary.status == 'complete'
    assert summary.ticks == TICKS and summary.frames == TICKS and summary.actions == TICKS
    # k = 2 of N = 4: a request ends one frame after it starts; the last frame's ends on a
    # tick without a frame after the bag (nothing lost), the only tick without one.
    assert summary.drain_ticks == 1
    assert all(obs is not None for obs, _ in frames[:-1]) and frames[-1][0] is None
    finished = [f for _, r in frames for f in r.finished if f.finish_reason in ('eos', 'length')]
    deltas = [d for _, r in frames for d in r.deltas]
    assert summary.narrations == len(finished) == TICKS
    assert summary.token_messages == len(deltas)

    messages, connections = read_bag(tmp_path / 'out')
    assert connections['/actions'].msgtype == ACTION_CHUNK
    assert 'float32[] actions' in connections['/actions'].msgdef.data
    assert connections['/actions'].digest == make_typestore().hash_rihs01(ACTION_CHUNK)
    assert connections['/language/tokens'].msgtype == LANGUAGE_CHUNK

    actions = messages['/actions']
    assert len(actions) == TICKS
    camera_stamps = {t: m.header.stamp for t, m in messages['/camera/image/image_raw']}
    for (stamp, msg), (obs, result) in zip(actions, frames):
        act = result.action
        assert msg.frame_index == act.frame_index == result.frame_index
        assert (msg.horizon, msg.action_dim) == act.actions.shape == (4, 7)
        np.testing.assert_array_equal(msg.actions.reshape(4, 7), act.actions)
        assert msg.inference_time == np.float32(act.inference_time_s)
        assert msg.header.frame_id == 'base_link'
        # Header: the first camera's stamp; log time: the tick.
        assert (stamp - START_NS) % 100_000_000 == 0
        latest = max(t for t in camera_stamps if t <= stamp)
        assert msg.header.stamp == camera_stamps[latest]
        assert abs(obs.stamp - (msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9)) < 1e-6

    tokens = [m for _, m in messages['/language/tokens']]
    assert len(tokens) == len(deltas)
    for msg, delta in zip(tokens, deltas):
        assert msg.request_id == delta.request_id and msg.origin_frame == delta.origin_frame
        assert msg.token_ids.tolist() == delta.token_ids
        assert msg.text_delta == delta.text and msg.tokens_so_far == delta.tokens_so_far
        assert msg.done == delta.done and msg.finish_reason == delta.finish_reason
    narrations = [m.data for _, m in messages['/language/narration']]
    assert narrations == [f.text for f in finished]

    # Inputs copied untouched, diagnostics once per second of bag time.
    with InputBag(demo_bag) as source:
        for topic in ('/camera/image/image_raw', '/joint_states', '/instruction'):
            assert len(messages[topic]) == source.message_count(topic)
    assert len(messages['/diagnostics']) == summary.diagnostics == 1
    names = [s.name for s in messages['/diagnostics'][0][1].status]
    assert 'oxygen_node: control loop' in names and 'oxygen_node: kv cache' in names
    assert custom_data(tmp_path / 'out')['oxygen_ros.replay.status'] == 'complete'


def test_replay_matches_engine_on_the_same_observations(tmp_path, demo_bag, params):
    _, frames = replay(demo_bag, tmp_path / 'out', params)
    live = build_engine(params.settings)[0]      # the node's engine, fed the same frames
    for obs, result in frames:
        if obs is None:   # the drain after the bag: live requests only
            again = live.advance_language()
            assert result.action is None
        else:
            again = live.step(obs)
            np.testing.assert_array_equal(again.action.actions, result.action.actions)
        assert [(d.request_id, d.token_ids, d.text, d.done) for d in again.deltas] == [
            (d.request_id, d.token_ids, d.text, d.done) for d in result.deltas]


def test_replay_is_deterministic(tmp_path, demo_bag, params):
    outputs = []
    for name in ('a', 'b'):
        replay(demo_bag, tmp_path / name, params)
        messages, _ = read_bag(tmp_path / name)
        outputs.append((
            [m.actions.tolist() for _, m in messages['/actions']],
            [(t, m.request_id, m.token_ids.tolist(), m.text_delta, m.finish_reason)
             for t, m in messages['/language/tokens']],
            [m.data for _, m in messages['/language/narration']]))
    assert outputs[0] == outputs[1]
    assert outputs[0][1], 'no tokens were generated'


def test_sqlite3_bag_with_compressed_images(tmp_path):
    # image_transport naming: compressed frames of base topic T are on T/compressed.
    params = load_params(None, {**ENGINE, 'control_rate_hz': 10.0,
                                'cameras.image.compressed': True,
                                'cameras.wrist_image.compressed': True})
    assert [t for _, t, _ in params.cameras()] == ['/camera/image/image_raw/compressed',
                                                   '/camera/wrist_image/image_raw/compressed']
    bag = write_demo_bag(tmp_path / 'in', params, 0.5, storage='sqlite3',
                         image_hw=IMAGE_HW, start_ns=START_NS)
    assert any(p.suffix == '.db3' for p in bag.iterdir())
    summary, frames = replay(bag, tmp_path / 'out', params)
    assert summary.frames == 6 and frames[0][0].images['image'].shape == IMAGE_HW + (3,)


def test_ticks_wait_for_inputs_and_skip_stale_cameras(tmp_path, params):
    store = make_typestore()
    late = [(START_NS + 350_000_000, '/camera/wrist_image/image_raw', IMAGE,
             image_msg(store, demo_image(1, 0, *IMAGE_HW), START_NS))]
    bag = write_bag(tmp_path / 'in', params, skip_topics={'/camera/wrist_image/image_raw'},
                    extra=late)
    summary, _ = replay(bag, tmp_path / 'out', params)
    # Ticks 0-3 wait for the wrist camera, 4-8 use its one frame, 9-10 find it stale (0.5 s).
    assert summary.frames == 5 and summary.skipped_ticks == 6
    assert summary.skipped == {
        "camera 'wrist_image' (/camera/wrist_image/image_raw): never received": 4,
        "camera 'wrist_image' (/camera/wrist_image/image_raw): stale": 2}
    # As the node: without a frame, live requests still advance (the one of the frame at
    # 0.8 s ends at 0.9 s); its tokens carry the tick's time as stamp.
    messages, _ = read_bag(tmp_path / 'out')
    late = [(t, m) for t, m in messages['/language/tokens'] if t == START_NS + 900_000_000]
    assert late and late[-1][1].done and late[-1][1].header.stamp.nanosec == 900_000_000
    assert messages['/language/narration'][-1][0] == START_NS + 900_000_000


def test_config_file_namespace_and_instruction_override(tmp_path, params):
    config = tmp_path / 'robot.yaml'
    config.write_text(
        '/**/oxygen_node:\n  ros__parameters:\n    preset: tiny\n    tokens_per_request: 4\n'
        "    decode_budget: '2'\n    cameras:\n      image: {topic: front/rgb}\n"
        '      wrist_image: {topic: wrist/rgb}\n    control_rate_hz: 5.0\n')
    ns_params = load_params(config, namespace='robot1', instruction_override='wave hello')
    assert [t for _, t, _ in ns_params.cameras()] == ['/robot1/front/rgb', '/robot1/wrist/rgb']
    bag = write_bag(tmp_path / 'in', ns_params)
    summary, frames = replay(bag, tmp_path / 'out', ns_params)
    assert summary.frames == 6                                 # 5 Hz over 1 s
    assert {obs.instruction for obs, _ in frames if obs is not None} == {'wave hello'}
    messages, _ = read_bag(tmp_path / 'out')
    assert len(messages['/robot1/actions']) == 6 and '/robot1/language/tokens' in messages

    config.write_text('oxygen_node:\n  ros__parameters:\n    control_rate_hz: -1.0\n'
                      '    decode_budget: lots\n')
    with pytest.raises(BagError, match=r'control_rate_hz(.|\n)*decode_budget'):
        load_params(config)


# --- errors -------------------------------------------------------------------------------------
def test_missing_topic_names_it(tmp_path, params):
    bag = write_bag(tmp_path / 'in', params, skip_topics={'/joint_states'})
    with pytest.raises(BagError, match=r'topic /joint_states \(joint states\) missing; expected '
                                       r'sensor_msgs/msg/JointState') as err:
        Replay(bag, tmp_path / 'out', params).run()
    assert err.value.topic == '/joint_states'
    assert not (tmp_path / 'out').exists()


def test_wrong_message_type_names_topic_and_expected_type(tmp_path, params):
    bag = write_bag(tmp_path / 'in', params, joint_type=STRING)
    with pytest.raises(BagError, match=r'/joint_states \(joint states\): message type '
                                       r'std_msgs/msg/String; expected sensor_msgs/msg/JointSt'):
        Replay(bag, tmp_path / 'out', params).run()


def test_unknown_message_type(tmp_path, params):
    from rosbags.typesys import get_types_from_msg, get_typestore, Stores
    store_custom = get_typestore(Stores.EMPTY)
    store_custom.register(make_typestore().fielddefs)
    store_custom.register(get_types_from_msg('uint32 width\nuint8[] pixels', 'acme/msg/Frame'))
    path = tmp_path / 'in'
    write_bag(path, params, skip_topics={'/camera/image/image_raw'})
    # Add a camera topic of a vendor type to a copy of the bag.
    merged = tmp_path / 'merged'
    with OutputBag(merged, store_custom) as out, InputBag(path) as source:
        for conn, t, raw in source.messages(source.reader.connections):
            out.write_raw(conn.topic, conn.msgtype, t, raw, *source.definition(conn))
        frame = store_custom.types['acme/msg/Frame'](width=2, pixels=np.zeros(4, np.uint8))
        out.write('/camera/image/image_raw', 'acme/msg/Frame', START_NS, frame)
    with pytest.raises(BagError, match=r'/camera/image/image_raw \(camera .image.\): message type '
                                       r'acme/msg/Frame; expected sensor_msgs/msg/Image or '
                                       r'sensor_msgs/msg/CompressedImage'):
        Replay(merged, tmp_path / 'out', params).run()


def test_bag_without_definitions_uses_standard_types(tmp_path, params):
    """Bags recorded before Iron (sqlite3) store no message definitions."""
    import sqlite3

    store = make_typestore()
    from rosbags.typesys import get_types_from_msg
    store.register(get_types_from_msg('uint32 width', 'acme/msg/Frame'))
    vendor = [(START_NS, '/vendor/frame', 'acme/msg/Frame',
               store.types['acme/msg/Frame'](width=3))]
    bag = write_bag(tmp_path / 'in', params, storage='sqlite3', extra=vendor, store=store)
    db = sqlite3.connect(next(bag.glob('*.db3')))
    db.execute('DELETE FROM message_definitions')
    db.commit()
    db.close()
    summary, _ = replay(bag, tmp_path / 'out', params)
    assert summary.frames == TICKS
    messages, connections = read_bag(tmp_path / 'out')   # definitions are in the output
    assert 'uint32 height' in connections['/camera/image/image_raw'].msgdef.data
    with pytest.raises(BagError, match=r'/vendor/frame: message type acme/msg/Frame has no '
                                       r'definition in the bag'):
        replay(bag, tmp_path / 'out2', params, copy='all')


@pytest.mark.parametrize('storage', ['mcap', 'sqlite3'])
@pytest.mark.parametrize('damage', ['truncated', 'garbage'])
def test_corrupt_or_truncated_bag(tmp_path, params, storage, damage):
    bag = write_bag(tmp_path / 'in', params, storage=storage)
    data_file = next(p for p in bag.iterdir() if p.suffix in ('.mcap', '.db3'))
    data = data_file.read_bytes()
    data_file.write_bytes(data[:len(data) // 2] if damage == 'truncated' else b'\0junk' * 99)
    with pytest.raises(BagError, match=r'bag .*in: cannot open \(.+\); expected a complete '
                                       r'rosbag2'):
        Replay(bag, tmp_path / 'out', params).run()
    assert not (tmp_path / 'out').exists()


def test_mcap_without_metadata_yaml(tmp_path, demo_bag, params):
    import shutil
    bag = tmp_path / 'copied'
    shutil.copytree(demo_bag, bag)
    (bag / 'metadata.yaml').unlink()            # e.g. only the .mcap file was copied over
    summary, _ = replay(bag, tmp_path / 'out', params)
    assert summary.frames == TICKS
    summary, _ = replay(next(bag.glob('*.mcap')), tmp_path / 'out2', params)
    assert summary.frames == TICKS


def test_not_a_bag(tmp_path, params):
    with pytest.raises(BagError, match='no such file or directory; expected a rosbag2'):
        Replay(tmp_path / 'nothing', tmp_path / 'out', params).run()
    (tmp_path / 'empty').mkdir()
    with pytest.raises(BagError, match='no metadata.yaml'):
        Replay(tmp_path / 'empty', tmp_path / 'out', params).run()


def _partial_output_ok(out, frames_before, status):
    """The output bag is readable and holds exactly the frames written before the stop."""
    messages, _ = read_bag(out)
    assert [m.frame_index for _, m in messages['/actions']] == list(range(frames_before))
    assert messages['/camera/image/image_raw'], 'copied inputs lost'
    assert custom_data(out)['oxygen_ros.replay.status'] == status
    return messages


def test_image_size_change_mid_bag_stops_with_partial_output(tmp_path, params):
    store = make_typestore()

    def image(i, t, stamp):
        if i == 0 and t > 0.55:     # the base camera switches resolution at 0.6 s
            return image_msg(store, demo_image(0, t, 48, 40), stamp, 'image')
        return None
    bag = write_bag(tmp_path / 'in', params, image=image)
    with pytest.raises(BagError, match=r"camera 'image' \(/camera/image/image_raw\): image size "
                                       r'40x48 \(WxH\); expected 32x32 like the first frame'
                                       r'.*at bag time 1700000000.600 s') as err:
        Replay(bag, tmp_path / 'out', params, rate='max').run()
    assert err.value.topic == '/camera/image/image_raw'
    _partial_output_ok(tmp_path / 'out', 6, 'error')
    assert 'image size 40x48' in custom_data(tmp_path / 'out')['oxygen_ros.replay.error']


def test_truncated_image_and_undecodable_message(tmp_path, params):
    store = make_typestore()

    def short(i, t, stamp):
        if i == 1 and 0.25 < t < 0.3:
            msg = image_msg(store, demo_image(1, t, *IMAGE_HW), stamp, 'wrist_image')
            msg.data = msg.data[:100]
            return msg
        return None
    bag = write_bag(tmp_path / 'in', params, image=short)
    with pytest.raises(BagError, match=r"camera 'wrist_image' .*truncated data: 100 bytes"):
        Replay(bag, tmp_path / 'out', params).run()
    _partial_output_ok(tmp_path / 'out', 3, 'error')

    garbage = [(START_NS + 420_000_000, '/joint_states', JOINT_STATE, b'\0\1\0\0\xff\xff')]
    bag = write_bag(tmp_path / 'in2', params, extra=garbage)
    with pytest.raises(BagError, match=r'/joint_states: cannot decode a sensor_msgs/msg/'
                                       r'JointState message') as err:
        Replay(bag, tmp_path / 'out2', params).run()
    assert err.value.topic == '/joint_states'
    _partial_output_ok(tmp_path / 'out2', 5, 'error')

    # As the node does: skip what cannot be used and carry on.
    skip = load_params(None, ENGINE, on_bad_input='skip')
    summary, _ = replay(bag, tmp_path / 'out3', skip)
    assert summary.status == 'complete' and summary.bad_messages == 1
    assert summary.frames == TICKS


def test_interrupted_replay_keeps_what_was_written(tmp_path, demo_bag, params):
    def stop_after_four(obs, result):
        if result.frame_index == 3:
            raise KeyboardInterrupt
    replayer = Replay(demo_bag, tmp_path / 'out', params, on_frame=stop_after_four)
    with pytest.raises(KeyboardInterrupt):
        replayer.run()
    assert replayer.summary.status == 'interrupted' and replayer.summary.frames == 4
    _partial_output_ok(tmp_path / 'out', 4, 'interrupted')


def test_overwrite_never_deletes_the_input_or_a_foreign_bag(tmp_path, params):
    # Regression (#11): `replay d/recording.mcap --out d --overwrite` deleted the input and a
    # sibling recording.
    folder = write_demo_bag(tmp_path / 'd', params, 0.3, image_hw=IMAGE_HW, start_ns=START_NS)
    recording = next(folder.glob('*.mcap'))
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(BagError, match='holds or is inside the input bag'):
        Replay(recording, folder, params, overwrite=True).run()
    with pytest.raises(BagError, match='holds or is inside the input bag'):
        Replay(folder, folder / 'out', params, overwrite=True).run()
    other = write_demo_bag(tmp_path / 'other', params, 0.3, image_hw=IMAGE_HW,
                           start_ns=START_NS)   # a bag, but not one a replay wrote
    with pytest.raises(BagError, match='not a bag oxygen-ros wrote'):
        Replay(folder, other, params, overwrite=True).run()
    assert sorted(p.name for p in folder.iterdir()) == before and any(other.iterdir())
    # A replay's own output is overwritten as asked.
    Replay(folder, tmp_path / 'out', params).run()
    assert Replay(folder, tmp_path / 'out', params, overwrite=True).run().status == 'complete'


def test_idle_gap_is_jumped_and_ticks_are_capped(tmp_path, params):
    # Regression (#11): a first message at log time 0 meant 17 billion ticks (92k ticks and
    # 16 MB of /diagnostics in 4 s, never ending).
    store = make_typestore()
    stray = (0, params.resolve('instruction'), STRING, string_msg(store, 'pick up the red block'))
    bag = write_bag(tmp_path / 'gap', params, store=store, extra=[stray])
    summary, frames = replay(bag, tmp_path / 'out', params)
    assert summary.status == 'complete' and summary.idle_ticks > 10**10
    assert summary.ticks < 100 and summary.frames >= TICKS - 2
    with pytest.raises(BagError, match=r'after 3 ticks \(the cap\)'):
        replay(bag, tmp_path / 'capped', params, max_ticks=3)


def test_output_exists_and_bad_rate(tmp_path, demo_bag, params):
    (tmp_path / 'out').mkdir()
    (tmp_path / 'out' / 'notes.txt').write_text('keep me')
    with pytest.raises(BagError, match='exists; expected a new path'):
        Replay(demo_bag, tmp_path / 'out', params)
    with pytest.raises(BagError, match='not a bag oxygen-ros wrote'):
        Replay(demo_bag, tmp_path / 'out', params, overwrite=True).run()
    assert (tmp_path / 'out' / 'notes.txt').exists()
    with pytest.raises(BagError, match="rate 'fast'; expected 'recorded', 'max' or a speed"):
        Replay(demo_bag, tmp_path / 'o2', params, rate='fast')


# --- command line -------------------------------------------------------------------------------
CLI_ENGINE = ['--preset', 'tiny', '--tokens', '4', '--k', '2', '--seed', '3', '--rate', 'max',
              '--quiet', '--threads', '1']


def test_cli_replay_summary(tmp_path, demo_bag, capsys):
    rc = cli_main(['replay', str(demo_bag), '--out', str(tmp_path / 'out')] + CLI_ENGINE)
    out = capsys.readouterr().out
    assert rc == 0
    assert f'frames {TICKS} of {TICKS} ticks' in out and 'x real time' in out
    assert f'action chunks {TICKS}' in out and 'narrations' in out


def test_cli_error_is_one_line_and_nonzero(tmp_path, demo_bag, capsys):
    rc = cli_main(['replay', str(demo_bag), '--out', str(tmp_path / 'out'),
                   '--camera-topics', 'cam/a', 'cam/b'] + CLI_ENGINE)
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith('oxygen-ros replay: error: bag ') and 'topic /cam/a' in err
    assert 'Traceback' not in err


@pytest.mark.parametrize('sig', [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
                         ids=['SIGINT', 'SIGTERM', 'SIGHUP'])
def test_cli_ctrl_c_closes_output(tmp_path, params, sig):
    # Regression (#11): SIGTERM left an unreadable MCAP; only SIGINT was handled.
    bag = write_demo_bag(tmp_path / 'in', params, 20.0, image_hw=IMAGE_HW, camera_hz=5,
                         state_hz=10, start_ns=START_NS)
    out = tmp_path / 'out'
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, '-m', 'oxygen_ros.cli', 'replay', str(bag), '--out', str(out),
         '--preset', 'tiny', '--tokens', '4', '--k', '2', '--rate', 'recorded', '--quiet',
         '--threads', '1'], cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not out.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    time.sleep(1.0)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, (stdout, stderr)
    assert 'stopping after this tick' in stderr and 'Traceback' not in stderr
    assert 'replay interrupted' in stdout and 'is closed and readable' in stdout
    messages, _ = read_bag(out)
    assert 3 <= len(messages['/actions']) < 200
    assert custom_data(out)['oxygen_ros.replay.status'] == 'interrupted'


# --- recording over DDS -------------------------------------------------------------------------
def test_record_demo_then_replay(tmp_path, params):
    pytest.importorskip('rclpy')
    from oxygen_ros.tools.record_demo import record_demo

    counts = record_demo(tmp_path / 'rec', params, 1.5, image_size=IMAGE_HW[0], camera_hz=10,
                         state_hz=20)
    assert all(n > 0 for n in counts.values()), counts
    messages, connections = read_bag(tmp_path / 'rec')
    assert connections['/camera/image/image_raw'].msgtype == IMAGE
    assert messages['/instruction'][0][1].data == 'pick up the red block'
    assert messages['/camera/image/image_raw'][0][1].width == IMAGE_HW[1]
    summary, _ = replay(tmp_path / 'rec', tmp_path / 'out', params)
    assert summary.frames >= 5


# --- layering -----------------------------------------------------------------------------------
def test_bag_layer_loads_no_ros():
    code = ('import sys, oxygen_ros.bag.replay, oxygen_ros.bag.cli, oxygen_ros.cli; '
            'oxygen_ros.cli.build_parser(); '
            "print([m for m in sys.modules if m.split('.')[0] in "
            "('rclpy', 'rosidl_runtime_py', 'std_msgs', 'sensor_msgs')])")
    out = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True,
                         text=True, check=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.stdout.strip() == '[]'


def test_bag_of_a_robot_described_in_yaml(tmp_path):
    """A bag of an SO-101 (two cameras, 6 joints): the replay reads the robot's YAML."""
    import yaml

    from oxygen_ros.model.robot_spec import get_robot

    spec = yaml.safe_load(Path(get_robot('so101').source).read_text())
    spec['name'] = 'my_arm'
    robot = tmp_path / 'my_arm.yaml'
    robot.write_text(yaml.safe_dump(spec))
    arm = load_params(None, {**ENGINE, 'robot': str(robot)})
    assert [c[0] for c in arm.cameras()] == ['front', 'wrist']
    bag = write_bag(tmp_path / 'in', arm)
    out = tmp_path / 'out'
    assert cli_main(['replay', str(bag), '--out', str(out), '--robot', str(robot)]
                    + CLI_ENGINE) == 0
    chunks = [m for _, m in read_bag(out)[0]['/actions']]
    assert len(chunks) == TICKS
    assert {(c.action_dim, tuple(c.names)) for c in chunks} == {(6, tuple(spec['actions'][
        'names']))}


def test_replay_records_the_subtask_that_drives_the_actions(tmp_path, demo_bag):
    """π0.5's subtask loop in the replay: from the frame after a subtask finishes, the action
    prompt is its text, recorded on language/subtask and in the diagnostics."""
    params = load_params(None, {**ENGINE, 'decode_budget': 8,
                                'language_tasks': ['narration', 'subtask'],
                                'tasks.subtask.prompt': 'Subtask of {instruction}:',
                                'tasks.subtask.tokens': 3, 'tasks.subtask.every_n_frames': 4,
                                'tasks.subtask.drives_actions': True,
                                'subtask_max_age_s': 100.0})
    summary, frames = replay(demo_bag, tmp_path / 'out', params)
    assert summary.status == 'complete' and summary.frames == TICKS
    done = [(i, f) for i, (_, r) in enumerate(frames) for f in r.finished
            if f.task == 'subtask' and f.text.strip()]
    assert done, 'no subtask finished in the replay'
    first_tick, first = done[0]
    prompts = [obs.action_prompt for obs, _ in frames]
    instruction = frames[0][0].instruction
    assert prompts[:first_tick + 1] == [instruction] * (first_tick + 1)
    assert prompts[first_tick + 1] == first.text.strip()
    messages, _ = read_bag(tmp_path / 'out')
    recorded = [m.data for _, m in messages['/language/subtask']]
    assert recorded[0] == first.text.strip() and len(recorded) == summary.subtasks
    assert all(prompt in recorded for prompt in prompts[first_tick + 1:])
    names = [s.name for s in messages['/diagnostics'][-1][1].status]
    assert 'oxygen_node: subtask' in names
