"""oxygen_node as its own process (`python -m oxygen_ros.ros.node --ros-args --params-file`),
fed by camera / joint-state / instruction publishers in this process over real DDS.

Shows: action chunks at the control rate (reported, not asserted tightly); token deltas that
concatenate to the narration and to what the same engine produces offline for the same
observations; every tick's tokens published after its action chunk (DDS source timestamps);
a bad camera frame logged and diagnosed while the node keeps going; a bad checkpoint gives a
clear failed lifecycle state; Ctrl-C ends the process cleanly.
"""

import json
import os
from pathlib import Path
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import yaml

rclpy = pytest.importorskip('rclpy')

from lifecycle_msgs.srv import GetState  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402

from oxygen_ros.engine.types import Observation  # noqa: E402
from oxygen_ros.msg import ActionChunk  # noqa: E402
from oxygen_ros.ros import qos  # noqa: E402
from oxygen_ros.ros.conversions import actions_from_msg  # noqa: E402
from oxygen_ros.runtime.actions import action_layout  # noqa: E402
from oxygen_ros.runtime.params import robot_defaults, ROBOT_IO, Settings  # noqa: E402
from oxygen_ros.ros.sim_inputs import camera_frame, CameraPublisher  # noqa: E402
from oxygen_ros.ros.sim_inputs import InstructionPublisher, JointStatePublisher  # noqa: E402
from oxygen_ros.ros.sim_inputs import SimCamera  # noqa: E402
from ros_helpers import Collector, Spinner, wait_for  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RATE_HZ = 10.0
SIZE = 32
TASK = 'pick up the red block'
CAMERAS = [SimCamera('image', 'camera/image/image_raw', 'astronaut'),
           SimCamera('wrist_image', 'camera/wrist_image/image_raw', 'coffee', static=True)]
JOINTS = list(ROBOT_IO['libero'][1])
STATE = np.linspace(-0.5, 0.5, len(JOINTS))
PARAMS = dict(preset='tiny', robot='libero', decode_budget=2, tokens_per_request=6,
              request_every_n_frames=1, control_rate_hz=RATE_HZ, stale_frame_timeout_s=2.0,
              seed=0)


class NodeProcess:
    """The node in a child process; collects its output lines."""

    def __init__(self, tmp_path: Path, params: dict):
        config = tmp_path / 'params.yaml'
        config.write_text(yaml.safe_dump({'oxygen_node': {'ros__parameters': params}}))
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, '-m', 'oxygen_ros.ros.node', '--ros-args', '--params-file',
             str(config)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, errors='replace', env=dict(os.environ, PYTHONUNBUFFERED='1'))
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip('\n'))

    def output(self) -> str:
        return '\n'.join(self.lines)

    def has(self, *parts) -> bool:
        return any(all(p in line for p in parts) for line in list(self.lines))

    def interrupt(self, timeout: float = 20.0) -> int:
        """Ctrl-C; return the exit status (kill and fail if it does not exit)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                pytest.fail('oxygen_node did not exit within %.0f s of SIGINT' % timeout)
        self.reader.join(5)
        return self.proc.returncode


@pytest.fixture
def node_process(tmp_path):
    made = []

    def start(params):
        made.append(NodeProcess(tmp_path, params))
        return made[-1]
    yield start
    for proc in made:
        if proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait(5)


def _stamp_ns(msg):
    return msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec


def _offline_replay(actions):
    """The node's engine built offline, fed the observations behind each action chunk."""
    from oxygen_ros.runtime.engine_setup import build_engine

    settings = Settings.from_values({**robot_defaults('libero'), **PARAMS})
    engine = build_engine(settings, warmup=False).system
    out_actions, deltas, finished = [], [], []
    for frame_index, image_index in actions:
        obs = Observation(
            images={'image': camera_frame('astronaut', SIZE, image_index),
                    'wrist_image': camera_frame('coffee', SIZE, 0)},
            state=STATE, instruction=TASK, frame_index=frame_index)
        out_actions.append(engine.act(obs).actions)
        result = engine.advance_language()
        deltas += result.deltas
        finished += result.finished
    return out_actions, deltas, finished


def test_end_to_end_across_processes(rclpy_context, node_process):
    node = node_process(PARAMS)
    cams = CameraPublisher(CAMERAS, rate_hz=20.0, size=SIZE, context=rclpy_context)
    cams.timer.cancel()   # start the cameras once the node's outputs are discovered
    joints = JointStatePublisher(JOINTS, amplitude=0.0, base=STATE, context=rclpy_context)
    task = InstructionPublisher([TASK], context=rclpy_context)
    col = Collector(context=rclpy_context)
    spinner = Spinner(rclpy_context, [cams, joints, task, col])
    try:
        assert wait_for(lambda: col.count_publishers('/language/tokens') > 0
                        and col.count_publishers('/actions') > 0, 60), node.output()
        cams.timer.reset()
        assert wait_for(lambda: len(col.actions) >= 25 and len(col.narrations) >= 6, 90), (
            f'{len(col.actions)} actions, {len(col.narrations)} narrations\n{node.output()}')
        with col.lock:
            actions, tokens = list(col.actions), list(col.tokens)
            narrations = list(col.narrations)

        # 1. Rate: reported with its spread, not asserted (shared CI machines stall processes;
        #    the timer's behaviour under bad input is asserted in test_node_inputs).
        times = np.array([t for _, _, t in actions])
        gaps = np.diff(times) * 1e3
        rate = (len(times) - 1) / (times[-1] - times[0])
        print(f'\naction chunks: {rate:.2f} Hz achieved for {RATE_HZ:g} Hz target; '
              f'inter-arrival median {np.median(gaps):.0f} ms, mean {gaps.mean():.0f} ± '
              f'{gaps.std():.0f} ms, max {gaps.max():.0f} ms ({len(actions)} chunks)')

        # 2. Every frame arrived, in order, and language only ran in ticks with a frame.
        frames = [m.frame_index for m, _, _ in actions]
        assert frames == list(range(len(frames))), frames[:10]
        action_stamps = {_stamp_ns(m) for m, _, _ in actions}
        assert all(_stamp_ns(m) in action_stamps for m, _, _ in tokens if m.origin_frame
                   < frames[-1] - 3), 'a language-only tick happened (input gap)'

        # 3. Same observations offline -> same actions, same tokens, same narration.
        image_index = [cams.sent[_stamp_ns(m)] for m, _, _ in actions]
        assert len(set(image_index)) > 5, 'the camera moved between frames'
        offline_actions, offline_deltas, offline_finished = _offline_replay(
            list(zip(frames, image_index)))
        for (msg, _, _), expected in zip(actions, offline_actions):
            np.testing.assert_allclose(actions_from_msg(msg), expected, rtol=0, atol=1e-5)
        node_text, node_ids, done = {}, {}, {}
        for msg, _, _ in tokens:
            node_text[msg.request_id] = node_text.get(msg.request_id, '') + msg.text_delta
            node_ids.setdefault(msg.request_id, []).extend(msg.token_ids)
            if msg.done:
                done[msg.request_id] = msg.finish_reason
        off_text, off_ids = {}, {}
        for d in offline_deltas:
            off_text[d.request_id] = off_text.get(d.request_id, '') + d.text
            off_ids.setdefault(d.request_id, []).extend(d.token_ids)
        assert len(done) >= 6
        for rid in done:
            assert node_text[rid] == off_text[rid] and node_ids[rid] == off_ids[rid], rid
        complete = [f.text for f in offline_finished if f.finish_reason in ('eos', 'length')]
        assert narrations == complete[:len(narrations)]
        assert {f.request_id: f.text for f in offline_finished if f.request_id in done} == {
            rid: node_text[rid] for rid in done}
        print(f'{len(done)} requests compared with the offline engine; e.g. {narrations[0]!r}')

        # 4. Actions before tokens: the j-th delta of a request started at frame f belongs to
        #    the tick of frame f + j; DDS source timestamps show it left after that tick's
        #    action chunk and before the next tick's.
        action_ts = {m.frame_index: ts for m, ts, _ in actions}
        ordinal, lead = {}, []
        for msg, ts, _ in tokens:
            j = ordinal[msg.request_id] = ordinal.get(msg.request_id, -1) + 1
            tick = msg.origin_frame + j
            if tick in action_ts and tick + 1 in action_ts:
                assert action_ts[tick] < ts < action_ts[tick + 1], (msg.request_id, tick)
                lead.append((ts - action_ts[tick]) * 1e-6)
        assert len(lead) > 20
        print(f'tokens left {np.median(lead):.2f} ms (median) after their tick\'s action chunk')

        # 5. Diagnostics over DDS carry the quantities the issue lists.
        assert wait_for(lambda: col.latest_status('kv cache') is not None, 5)
        keys = {kv.key for part in ('control loop', 'language', 'kv cache', 'inputs')
                for kv in col.latest_status(part).values}
        for key in ('action_rate_hz', 'deadline_misses_total', 'latency_p50_ms',
                    'latency_p99_ms', 'tokens_per_s', 'active_requests', 'slots_used',
                    'slots_total', 'bytes_used', 'current_k', 'stale_or_missing'):
            assert key in keys, key

        # The chunk says how to play it: LIBERO's end-effector deltas at 20 Hz.
        chunk = actions[0][0]
        assert chunk.action_space == ActionChunk.END_EFFECTOR_DELTA
        assert list(chunk.names) == list(action_layout('libero').names)
        assert (chunk.step_period.sec, chunk.step_period.nanosec) == (0, 50_000_000)

        # 6. A bad camera frame: a log line in the node's output and a diagnostic status;
        #    the node keeps running and recovers.
        cams.timer.cancel()
        bad = col.create_publisher(Image, 'camera/image/image_raw', qos.SENSOR)
        for _ in range(30):
            bad.publish(Image(encoding='bayer_rggb8', height=SIZE, width=SIZE, step=SIZE,
                              data=bytes(SIZE * SIZE)))
            time.sleep(0.05)
        reason = "camera 'image' (/camera/image/image_raw): raw Bayer image ('bayer_rggb8')"
        assert wait_for(lambda: node.has('[WARN]', reason), 10), node.output()[-2000:]
        assert wait_for(lambda: reason in getattr(col.latest_status('inputs'), 'message', ''),
                        5)
        count = len(col.actions)
        cams.timer.reset()
        assert wait_for(lambda: len(col.actions) > count + 3, 20), 'actions resume'
        assert wait_for(lambda: node.has('[INFO]', 'resolved: ' + reason), 10)
    finally:
        spinner.stop()
        for n in (cams, joints, task, col):
            n.destroy_node()
    assert node.interrupt() == 0
    assert 'Traceback' not in node.output(), node.output()[-3000:]


def test_bad_checkpoint_process_reports_failed_configure(rclpy_context, node_process, tmp_path):
    from oxygen_ros.model import get_preset, Pi05Model
    from oxygen_ros.model.checkpoint import save_pi05

    path = save_pi05(Pi05Model(get_preset('tiny')).init_random(0), tmp_path / 'ckpt')
    config = json.loads((path / 'config.json').read_text())
    config['oxygen_ros_config']['backbone']['width'] = 80   # weights stay 64 wide
    (path / 'config.json').write_text(json.dumps(config))
    node = node_process({**PARAMS, 'checkpoint': str(path)})
    col = Collector(context=rclpy_context)
    spinner = Spinner(rclpy_context, [col])
    try:
        assert wait_for(lambda: node.has('[ERROR]', 'configure failed'), 60), node.output()
        # The log line names the file; the lines under it list each offending tensor.
        text = node.output()
        failure = text[text.index('configure failed'):]
        assert 'model.safetensors does not match the model config' in failure.splitlines()[0]
        assert 'shape mismatch: paligemma_with_expert' in failure, failure[:2000]
        assert wait_for(lambda: getattr(col.latest_status('model'), 'level', None) == b'\x02',
                        10)   # ERROR (the 'configuring' status before it is OK)
        assert 'shape mismatch' in col.latest_status('model').message
        client = col.create_client(GetState, '/oxygen_node/get_state')
        assert client.wait_for_service(10)
        future = client.call_async(GetState.Request())
        assert wait_for(future.done, 10)
        assert future.result().current_state.label == 'unconfigured'
        time.sleep(0.5)
        assert node.proc.poll() is None and col.actions == []
    finally:
        spinner.stop()
        col.destroy_node()
    assert node.interrupt() == 0
