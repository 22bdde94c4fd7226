"""LeRobot dataset replay: dataset in -> the bag replay's frame loop -> MCAP with action error.

Datasets are written here (test/lerobot_dataset.py: v2.1 with PNG image features, v3.0 with
lossless videos holding every episode); the replay runs the tiny random preset; the output is
read back with rosbags and the error topic is recomputed from the written action chunks and
the recorded actions.
"""

import json

import numpy as np
import pytest

from lerobot_dataset import (CAMERAS, episode_arrays, TASKS, write_unknown_robot_v21,
                             write_v21, write_v30)
from bag_helpers import read_bag
from oxygen_ros.cli import main as cli_main
from oxygen_ros.dataset import chunk_error, LeRobotDataset

ENGINE = ['--preset', 'tiny', '--k', '2', '--tokens', '4', '--seed', '3', '--robot', 'libero']
LENGTHS = (6, 5)


# Tiny models on a shared CPU: more threads only add contention (conftest.py).
pytestmark = pytest.mark.usefixtures('one_torch_thread')


@pytest.fixture(scope='module', params=['v2.1', 'v3.0'])
def dataset(request, tmp_path_factory):
    write = write_v21 if request.param == 'v2.1' else write_v30
    return write(tmp_path_factory.mktemp('datasets') / request.param, LENGTHS)


def replay(dataset, out, *extra):
    return cli_main(['replay', str(dataset), '--out', str(out), '--quiet', *ENGINE, *extra])


def test_reader_yields_the_written_frames(dataset):
    ds = LeRobotDataset(dataset)
    assert [(e.index, e.length) for e in ds.episodes] == list(enumerate(LENGTHS))
    assert ds.cameras == list(CAMERAS)
    for episode, length in enumerate(LENGTHS):
        images, state, action = episode_arrays(episode, length, 16)
        frames = list(ds.frames(episode, list(CAMERAS), 'observation.state', 'action'))
        assert [f.index for f in frames] == list(range(length))
        for f in frames:
            for cam in CAMERAS:
                np.testing.assert_array_equal(f.images[cam], images[cam][f.index])
            np.testing.assert_array_equal(f.state, state[f.index])
            assert f.task == TASKS[episode % len(TASKS)]
        np.testing.assert_array_equal(ds.actions(episode, 'action'), action)


def test_replay_writes_actions_language_and_action_error(tmp_path, dataset, capsys):
    out = tmp_path / 'out'
    assert replay(dataset, out) == 0
    printed = capsys.readouterr().out
    messages, _ = read_bag(out)
    chunks = [m for _, m in messages['/actions']]
    assert len(chunks) == sum(LENGTHS)
    assert messages['/language/tokens']
    errors = [m for _, m in messages['/evaluation/action_error']]
    assert len(errors) == len(chunks)
    # recompute every frame's error from the written chunk and the recorded actions
    index = 0
    per_episode = {}
    for episode, length in enumerate(LENGTHS):
        _, _, recorded = episode_arrays(episode, length, 16)
        for t in range(length):
            chunk = chunks[index].actions.reshape(chunks[index].horizon, chunks[index].action_dim)
            l1, mse, _ = chunk_error(chunk, recorded.astype(np.float64), t)
            np.testing.assert_allclose(errors[index].data, np.concatenate([l1, mse]),
                                       rtol=1e-6)
            per_episode.setdefault(episode, []).append(l1)
            index += 1
    report = json.loads((out / 'action_error.json').read_text())
    assert [e['episode'] for e in report['episodes']] == [0, 1]
    for e in report['episodes']:
        np.testing.assert_allclose(e['l1'], np.mean(per_episode[e['episode']], axis=0))
        assert len(e['mse']) == 7 and e['frames'] == LENGTHS[e['episode']]
        assert f'episode {e["episode"]}: {e["frames"]} frames, action L1' in printed
    assert (out / 'action_error.png').stat().st_size > 1000


def test_replay_is_deterministic_for_a_fixed_k(tmp_path, dataset):
    outputs = []
    for name in ('a', 'b'):
        assert replay(dataset, tmp_path / name) == 0
        messages, _ = read_bag(tmp_path / name)
        outputs.append((
            [m.actions.tolist() for _, m in messages['/actions']],
            [(m.request_id, m.token_ids.tolist()) for _, m in messages['/language/tokens']],
            (tmp_path / name / 'action_error.json').read_text().replace(str(tmp_path / name),
                                                                        '')))
    assert outputs[0] == outputs[1]


def test_episode_choice_and_camera_mapping(tmp_path, dataset):
    out = tmp_path / 'one'
    assert replay(dataset, out, '--episodes', '1', '--camera',
                  'image=observation.images.wrist_image') == 0
    assert len(read_bag(out)[0]['/actions']) == LENGTHS[1]


@pytest.mark.parametrize('extra, reason', [
    (['--camera', 'image=observation.images.nope'], "not camera features: "
                                                    "['observation.images.nope']"),
    (['--camera', 'image'], 'expected NAME=FEATURE'),
    (['--episodes', '7'], 'no episode 7'),
    (['--state-key', 'action'], "feature 'action' has shape [7]; robot 'libero' needs state"),
    (['--action-key', 'missing'], "no feature 'missing' for the action"),
])
def test_bad_options_are_one_line_errors(tmp_path, dataset, extra, reason, capsys):
    assert replay(dataset, tmp_path / 'bad', *extra) == 2
    err = capsys.readouterr().err
    assert reason in err, err
    assert not (tmp_path / 'bad').exists()


# --- a robot the package does not know -----------------------------------------------------------
UNKNOWN_LENGTHS = (4, 3)


@pytest.fixture(scope='module')
def unknown_robot(tmp_path_factory):
    """A v2.1 dataset shaped like reachy2 "apple_storage": one h264 camera, 19 joints, 30 fps."""
    return write_unknown_robot_v21(tmp_path_factory.mktemp('reachy') / 'apple_storage',
                                   UNKNOWN_LENGTHS)


def test_unknown_robot_replays_with_the_spec_from_its_info_json(tmp_path, unknown_robot, caplog):
    out = tmp_path / 'out'
    assert cli_main(['replay', str(unknown_robot), '--out', str(out), '--preset', 'tiny',
                     '--rate', 'max', '--quiet']) == 0
    err = caplog.text   # the warnings (on stderr outside pytest)
    assert "no --robot: read robot 'reachy2'" in err and 'image <- observation.image' in err
    for assumed in ('assumed state names: joint_0 .. joint_18', 'assumed action space: '
                    'joint_position', 'assumed step period: 1/30 s from fps 30'):
        assert assumed in err, err
    messages, _ = read_bag(out)
    chunks = [m for _, m in messages['/actions']]
    assert len(chunks) == sum(UNKNOWN_LENGTHS)                  # one chunk per frame
    assert {(m.action_dim, tuple(m.names)) for m in chunks} == {
        (19, tuple(f'joint_{i}' for i in range(19)))}
    assert {m.step_period.nanosec for m in chunks} == {round(1e9 / 30)}
    report = json.loads((out / 'action_error.json').read_text())
    assert [len(e['l1']) for e in report['episodes']] == [19, 19]


def test_unknown_robot_replays_with_a_robot_yaml(tmp_path, unknown_robot, caplog):
    spec = tmp_path / 'reachy2.yaml'
    assert cli_main(['robot-spec', '--from', str(unknown_robot), '--out', str(spec)]) == 0
    spec.write_text(spec.read_text().replace('joint_0,', 'r_shoulder_pitch,'))
    out = tmp_path / 'out'
    assert cli_main(['replay', str(unknown_robot), '--out', str(out), '--preset', 'tiny',
                     '--rate', 'max', '--quiet', '--robot', str(spec), '--episodes', '1']) == 0
    assert 'no --robot' not in caplog.text
    chunks = [m for _, m in read_bag(out)[0]['/actions']]
    assert len(chunks) == UNKNOWN_LENGTHS[1] and chunks[0].names[0] == 'r_shoulder_pitch'


def test_replay_records_every_language_task_on_its_topic(tmp_path, dataset):
    """The dataset replay runs the node's sink: each task's LanguageChunks on its own topic."""
    config = tmp_path / 'tasks.yaml'
    config.write_text('''
oxygen_node:
  ros__parameters:
    language_tasks: [narration, subtask]
    kv_capacity: 12
    tasks:
      subtask: {prompt: 'Subtask of {instruction}:', tokens: 3, every_n_frames: 2,
                priority: 1}
''')
    out = tmp_path / 'out'
    assert replay(dataset, out, '--config', str(config)) == 0
    messages, _ = read_bag(out)
    narration = [m for _, m in messages['/language/tokens']]
    subtask = [m for _, m in messages['/language/subtask/tokens']]
    assert narration and subtask
    # every subtask request (one every 2 frames) streamed to its end, and every narration
    frames = {m.origin_frame for m in subtask}
    done = {m.origin_frame for m in subtask if m.done and m.finish_reason == 'length'}
    assert frames == done == set(range(0, sum(LENGTHS), 2))
    done = {m.origin_frame for m in narration if m.done and m.finish_reason == 'length'}
    assert done == set(range(sum(LENGTHS)))
