"""`oxygen-ros serve`: openpi's websocket policy protocol over the engine's frame loop.

The wire format is checked against openpi's own client (openpi-client, unmodified) running in
.venv-openpi-client (it pins numpy<2, so it cannot share the project's venv; the Makefile and,
when missing, this module build it with scripts/setup_openpi_client_venv.sh). Our msgpack
codec is checked on its own too, and the server's queueing, errors and health endpoint with a
plain websocket client.
"""

import contextlib
import json
import os
from pathlib import Path
import re
import struct
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
import websockets.sync.client

from oxygen_ros.engine import random_observation
from oxygen_ros.runtime.engine_setup import build_engine
from oxygen_ros.runtime.params import robot_defaults, RtcSettings, Settings
from oxygen_ros.serve import PolicyServer, RequestError, ServerConfig, to_observation
from oxygen_ros.serve.observations import LARGEST_IMAGE, max_request_bytes, OBSERVATION_KEYS
from oxygen_ros.serve.queue import FairQueue
from oxygen_ros.serve.server import token_matches
from oxygen_ros.serve.wire import packb, unpackb, WireError

REPO = Path(__file__).resolve().parents[1]
CLIENT_VENV = REPO / '.venv-openpi-client'
PROBE = Path(__file__).with_name('openpi_client_probe.py')
ENGINE = {'preset': 'tiny', 'tokens_per_request': 4, 'decode_budget': '2', 'seed': 3}
ROBOT_DIMS = {'libero': 7, 'droid': 8, 'aloha': 14}


# Tiny models on a shared CPU: more threads only add contention (conftest.py).
pytestmark = pytest.mark.usefixtures('one_torch_thread')


def make_engine(robot):
    settings = Settings.from_values({**robot_defaults(robot), **ENGINE})
    return build_engine(settings, warmup=False)


def serve(robot, **config):
    engine = make_engine(robot)
    server = PolicyServer(engine.system, ServerConfig(robot=robot, host='127.0.0.1', port=0,
                                                      **config), engine.description)
    server.start()
    return server


@pytest.fixture(scope='module')
def libero_server():
    server = serve('libero')
    yield server
    server.stop()


@pytest.fixture(scope='module')
def client_python():
    """The second venv's python with openpi-client installed (built when missing)."""
    subprocess.run(['bash', str(REPO / 'scripts' / 'setup_openpi_client_venv.sh')], check=True,
                   timeout=900)
    return CLIENT_VENV / 'bin' / 'python'


@contextlib.contextmanager
def connect(server, headers=None):
    """A plain websocket client of `server` (or of a port), past its metadata message."""
    port = server if isinstance(server, int) else server.port
    with websockets.sync.client.connect(f'ws://127.0.0.1:{port}', compression=None,
                                        max_size=None, open_timeout=10,
                                        additional_headers=headers) as ws:
        assert unpackb(ws.recv(timeout=10))['server'] == 'oxygen_ros'
        yield ws


def libero_request(i=0, **changes):
    obs = random_observation('libero', i, image_size=224)
    request = {'observation/image': obs.images['image'],
               'observation/wrist_image': obs.images['wrist_image'],
               'observation/state': obs.state, 'prompt': 'pick up the bowl'}
    request.update(changes)
    return request


# ---- openpi's own client ------------------------------------------------------------------------
def run_probe(client_python, port, robot, requests, api_key='', *question):
    return subprocess.run([str(client_python), str(PROBE), str(port), robot, str(requests),
                           api_key, *question], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize('robot', ['libero', 'droid', 'aloha'])
def test_unmodified_openpi_client_gets_actions(robot, client_python):
    requests = 4
    with serve(robot) as server:
        run = run_probe(client_python, server.port, robot, requests)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out['metadata']['robot'] == robot
    assert out['metadata']['server'] == 'oxygen_ros'
    horizon = out['metadata']['engine']['horizon']
    for response in out['responses']:
        assert response['shape'] == [horizon, ROBOT_DIMS[robot]]
        assert response['dtype'] == 'float32' and response['finite']
        assert {'actions', 'server_timing', 'policy_timing', 'language'} <= set(response['keys'])
        assert 'infer_ms' in response['server_timing']
    assert [r['frame_index'] for r in out['responses']] == list(range(requests))
    # narration of earlier frames rides on later responses
    texts = [d for r in out['responses'] for d in r['language']['deltas']]
    assert texts and all(d['frame_index'] < requests for d in texts)
    assert out['error'] is not None and 'prompt' in out['error']
    assert out['after_error_shape'] == [horizon, ROBOT_DIMS[robot]]


def test_unmodified_openpi_client_asks_a_question(client_python):
    engine = build_engine(Settings.from_values({
        **robot_defaults('libero'), **ENGINE, 'decode_budget': 4, 'ask_tokens': 3}),
        warmup=False)
    with PolicyServer(engine.system, ServerConfig(robot='libero', host='127.0.0.1', port=0),
                      engine.description) as server:
        run = run_probe(client_python, server.port, 'libero', 14, '', 'is the bowl red?')
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    first, *later = out['responses']
    assert first['question'] == {'id': 1, 'ok': True, 'reason': ''}
    assert all(r['question'] is None for r in later)
    # Its answer rides on a later response, decoded from the first frame's prefix.
    answers = [a for r in later for a in r['answers']]
    assert len(answers) == 1, [r['keys'] for r in later]
    (answer,) = answers
    assert answer['id'] == 1 and answer['ok'] and answer['answer'], answer
    assert answer['question'] == 'is the bowl red?'
    assert answer['frame_index'] == first['frame_index'] and answer['stamp'] > 0
    assert answer['finish_reason'] in ('eos', 'length') and 1 <= answer['tokens'] <= 3
    # Responses without an answer to carry have openpi's keys and language only.
    assert all('answers' not in r['keys'] for r in later if not r['answers'])


def test_bad_questions_get_a_reason_and_the_actions_come(libero_server):
    with connect(libero_server) as ws:
        ws.send(packb(libero_request(question='  ')))
        reply = unpackb(ws.recv(timeout=60))
        assert reply['actions'].shape[1] == 7
        assert not reply['question']['ok'] and 'empty' in reply['question']['reason']
        ws.send(packb(libero_request(question=12)))
        assert ws.recv(timeout=60) == 'bad request: question: expected a string, got int'
        ws.send(packb(libero_request(question='x' * 1000)))
        reply = unpackb(ws.recv(timeout=60))
        assert 'characters' in reply['question']['reason']
        ws.send(packb(libero_request()))
        assert 'question' not in unpackb(ws.recv(timeout=60))


def test_unmodified_openpi_client_works_with_rtc_on(client_python):
    """openpi's client sends no prev_actions: RTC on changes nothing it relies on."""
    with serve('libero', rtc=RtcSettings('guided', delay=1)) as server:
        run = subprocess.run([str(client_python), str(PROBE), str(server.port), 'libero', '3'],
                             capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out['metadata']['rtc']['mode'] == 'guided'
    horizon = out['metadata']['engine']['horizon']
    for response in out['responses']:
        assert response['shape'] == [horizon, 7] and response['finite']
        assert {'actions', 'start_row', 'language'} <= set(response['keys'])
    assert out['error'] is not None and 'prompt' in out['error']


def test_rtc_continues_the_clients_chunk():
    """prev_actions (and inference_delay) from the request: prefix mode holds those rows."""
    with serve('libero', rtc=RtcSettings('prefix')) as server, connect(server) as ws:
        ws.send(packb(libero_request(0)))
        first = unpackb(ws.recv(timeout=60))
        assert first['start_row'] == 0                       # nothing to continue
        left = first['actions'][1:]                          # one row played since
        ws.send(packb(libero_request(1, prev_actions=left, inference_delay=2)))
        second = unpackb(ws.recv(timeout=60))
        assert second['start_row'] == 2
        np.testing.assert_array_equal(second['actions'][:2], left[:2])
        assert not np.allclose(second['actions'][2:3], left[2:3])
        for bad, reason in [({'prev_actions': np.zeros((2, 5))}, 'expected [n, 7]'),
                            ({'prev_actions': left, 'inference_delay': -1}, 'integer >= 0'),
                            ({'inference_delay': 2}, 'without prev_actions')]:
            ws.send(packb(libero_request(2, **bad)))
            reply = ws.recv(timeout=60)
            assert isinstance(reply, str) and reason in reply, (reason, reply)


def test_unmodified_openpi_client_sends_the_token_as_its_api_key(client_python):
    with serve('libero', token='s3cret') as server:
        good = run_probe(client_python, server.port, 'libero', 1, api_key='s3cret')
        wrong = run_probe(client_python, server.port, 'libero', 1, api_key='guess')
        none = run_probe(client_python, server.port, 'libero', 1)
    assert good.returncode == 0, good.stderr[-3000:]
    assert json.loads(good.stdout)['responses'][0]['shape'] == [4, 7]
    for refused in (wrong, none):
        assert refused.returncode != 0 and 'HTTP 401' in refused.stderr, refused.stderr[-2000:]


# ---- the server with a plain websocket client -------------------------------------------------
def test_actions_equal_the_engines_on_the_same_observation(libero_server):
    with connect(libero_server) as ws:
        ws.send(packb(libero_request(0)))
        served = unpackb(ws.recv(timeout=60))
    # actions depend on the observation, the seed and the frame index (the noise), nothing else
    obs = to_observation(libero_request(0), 'libero')
    obs.frame_index = served['frame_index']
    expected = make_engine('libero').system.act(obs).actions
    np.testing.assert_array_equal(served['actions'], expected)


def test_bad_requests_get_a_reason_and_the_connection_stays(libero_server):
    with connect(libero_server) as ws:
        cases = [
            ('text', 'expected a binary msgpack message'),
            (b'\xc1\xc1', 'not a msgpack message'),
            (packb({'observation/image': 1}), "missing 'observation/wrist_image', "
                                              "'observation/state' (request keys: "
                                              "observation/image)"),
            (packb(libero_request(**{'observation/image': 1})), 'expected a numpy image'),
            (packb(libero_request(**{'observation/state': np.zeros(5)})),
             'has 5 values; expected 8'),
            (packb(libero_request(**{'observation/image': np.zeros((4, 4), np.uint8)})),
             'expected [H, W, 3] or [3, H, W]'),
            (packb(libero_request(prompt='')), "send 'prompt'"),
            (packb(libero_request(**{'observation/state': np.full(8, np.nan)})), 'NaN'),
        ]
        for message, reason in cases:
            ws.send(message)
            reply = ws.recv(timeout=60)
            assert isinstance(reply, str) and reason in reply, (reason, reply)
        ws.send(packb(libero_request(1)))
        assert unpackb(ws.recv(timeout=60))['actions'].shape[1] == 7


def test_health_endpoint(libero_server):
    with urllib.request.urlopen(f'http://127.0.0.1:{libero_server.port}/healthz',
                                timeout=10) as reply:
        assert reply.status == 200 and reply.read() == b'OK\n'


def test_clients_at_once_share_one_engine_frame_by_frame(libero_server):
    results = {}

    def run(name, n=5):
        with connect(libero_server) as ws:
            got = []
            for i in range(n):
                ws.send(packb(libero_request(i)))
                got.append(unpackb(ws.recv(timeout=120)))
            results[name] = got

    threads = [threading.Thread(target=run, args=(name,)) for name in ('a', 'b', 'c')]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(results) == ['a', 'b', 'c']
    frames = {name: [r['frame_index'] for r in got] for name, got in results.items()}
    every = sorted(f for fs in frames.values() for f in fs)
    assert every == list(range(every[0], every[0] + 15))        # one frame per request
    for name, got in results.items():
        mine = set(frames[name])
        language = [d['frame_index'] for r in got for d in r['language']['deltas']]
        assert set(language) <= mine                     # narration goes to its own client
        assert all(r['actions'].shape == (4, 7) for r in got)


def test_a_token_server_refuses_handshakes_without_it():
    with serve('libero', token='s3cret') as server:
        for headers in (None, {'Authorization': 'Api-Key nope'}, {'Authorization': 's3cret'}):
            with pytest.raises(websockets.exceptions.InvalidStatus, match='401'):
                with connect(server, headers):
                    pass
        for scheme in ('Api-Key', 'Bearer'):
            with connect(server, {'Authorization': f'{scheme} s3cret'}) as ws:
                ws.send(packb(libero_request(0)))
                assert unpackb(ws.recv(timeout=60))['actions'].shape == (4, 7)
        with urllib.request.urlopen(f'http://127.0.0.1:{server.port}/healthz',
                                    timeout=10) as reply:    # health checks need no token
            assert reply.status == 200
    assert token_matches('api-key  s3cret ', 's3cret') and not token_matches('Api-Key', '')


def _oversized_frame_header(length):
    """A masked binary frame header announcing `length` payload bytes (mask key 0: the
    payload goes as it is)."""
    return bytes([0x82, 0x80 | 127]) + struct.pack('!Q', length) + bytes(4)


def _peak_rss_bytes(pid):
    status = Path(f'/proc/{pid}/status').read_text()
    return 1024 * int(re.search(r'VmHWM:\s+(\d+) kB', status).group(1))


@pytest.mark.skipif(not Path('/proc/self/status').exists(), reason='reads /proc (Linux)')
def test_a_message_over_the_bound_is_refused_before_it_is_read():
    """`oxygen-ros serve` as a robot team runs it: a 1 GB message announced, 256 MB of it
    sent; the server closes the connection from the frame header, says why, its peak
    memory does not grow by the message, and the next client is answered."""
    bound_mb, announced, sent_mb = 4, 1 << 30, 256
    cmd = [sys.executable, '-m', 'oxygen_ros.cli', 'serve', '--host', '127.0.0.1', '--port',
           '0', '--max-message-mb', str(bound_mb), '--threads', '1',
           *[f'--{k}={v}' for k, v in (('preset', 'tiny'), ('tokens', 4), ('k', 2))]]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, 'PYTHONUNBUFFERED': '1'})
    try:
        lines = []
        for line in server.stdout:
            lines.append(line)
            if (found := re.search(r'ws://127\.0\.0\.1:(\d+)', line)):
                port = int(found.group(1))
                break
        else:
            pytest.fail('server did not start: ' + ''.join(lines)[-3000:])
        assert f'requests up to {bound_mb:.1f} MB' in line
        threading.Thread(target=lambda: [None for _ in server.stdout], daemon=True).start()
        with connect(port) as ws:                          # the server is warm: one frame
            ws.send(packb(libero_request(0)))
            assert unpackb(ws.recv(timeout=120))['actions'].shape == (4, 7)
        peak_before = _peak_rss_bytes(server.pid)
        with connect(port) as ws:
            ws.socket.sendall(_oversized_frame_header(announced))
            chunk = bytes(1 << 20)
            with contextlib.suppress(OSError):             # the server may close first
                for _ in range(sent_mb):
                    ws.socket.sendall(chunk)
            with pytest.raises(websockets.exceptions.ConnectionClosedError) as closed:
                ws.recv(timeout=60)
        assert closed.value.rcvd.code == 1009, closed.value
        assert f'over {bound_mb:.1f} MB' in closed.value.rcvd.reason
        assert '--max-message-mb' in closed.value.rcvd.reason
        growth = _peak_rss_bytes(server.pid) - peak_before
        assert growth < (sent_mb << 20) // 8, f'peak RSS grew {growth / 1e6:.0f} MB'
        with connect(port) as ws:                          # the next good request
            ws.send(packb(libero_request(1)))
            assert unpackb(ws.recv(timeout=120))['actions'].shape == (4, 7)
    finally:
        server.terminate()
        server.wait(30)


@pytest.mark.parametrize('robot', sorted(OBSERVATION_KEYS))
def test_the_default_bound_fits_the_largest_valid_observation(robot):
    """Every camera (the optional ones too) at 1920x1080 float32 fits; at twice the pixels
    it does not."""
    from oxygen_ros.model.robots import get_robot

    def message(height):
        keys = OBSERVATION_KEYS[robot]
        request = {'prompt': 'x' * 500}
        for path in list(keys.cameras.values()) + [('images', c) for c in keys.optional_cameras]:
            target = request
            for part in path[:-1]:
                target = target.setdefault(part, {})
            target[path[-1]] = np.zeros((height, *LARGEST_IMAGE[1:]), np.float32)
        for path in keys.state:                            # an upper estimate of the state
            request[path[0]] = np.zeros(get_robot(robot).state_dim)
        return len(packb(request))

    bound = max_request_bytes(OBSERVATION_KEYS[robot], get_robot(robot).state_dim)
    assert message(LARGEST_IMAGE[0]) <= bound < message(2 * LARGEST_IMAGE[0])


def test_port_in_use_is_an_error(libero_server):
    engine = make_engine('libero')
    server = PolicyServer(engine.system, ServerConfig(robot='libero', host='127.0.0.1',
                                                      port=libero_server.port))
    with pytest.raises(OSError):
        server.start()


# ---- parts ------------------------------------------------------------------------------------
def test_fair_queue_serves_clients_in_turn_and_bounds_each():
    q = FairQueue(max_per_client=3)
    assert all(q.put('a', f'a{i}') for i in range(3))
    assert not q.put('a', 'a3')                          # a's queue is full
    assert q.put('b', 'b0')
    assert [q.get(0) for _ in range(4)] == ['a0', 'b0', 'a1', 'a2']
    assert q.get(0) is None
    q.put('a', 'x')
    q.put('b', 'y')
    assert q.drop('a') == ['x'] and len(q) == 1
    q.close()
    assert q.get() is None and not q.put('a', 'z')


def test_wire_round_trip_and_openpi_encoding():
    message = {'a': np.arange(6, dtype=np.float32).reshape(2, 3), 'b': np.float64(2.5),
               'c': {'d': np.array([True, False]), 'e': 'text'}, 'f': [1, 2.0, None]}
    back = unpackb(packb(message))
    np.testing.assert_array_equal(back['a'], message['a'])
    assert back['a'].dtype == np.float32 and back['b'] == 2.5 and back['c']['e'] == 'text'
    np.testing.assert_array_equal(back['c']['d'], [True, False])
    import msgpack
    raw = msgpack.unpackb(packb({'x': np.zeros(2, np.uint8)}))
    assert raw['x'] == {b'__ndarray__': True, b'data': b'\0\0', b'dtype': '|u1',
                        b'shape': [2]}


@pytest.mark.parametrize('bad, reason', [
    ({b'__ndarray__': True, b'data': b'\0' * 3, b'dtype': '<f4', b'shape': [1]}, 'needs 4'),
    ({b'__ndarray__': True, b'data': b'', b'dtype': '|O', b'shape': [0]}, 'refused'),
    ({b'__ndarray__': True, b'data': b'', b'dtype': 'nonsense', b'shape': [0]}, 'not a numpy'),
    ({b'__ndarray__': True, b'data': b'', b'dtype': '<f4', b'shape': [-1]}, 'sizes >= 0'),
])
def test_wire_refuses_malformed_arrays(bad, reason):
    import msgpack
    with pytest.raises(WireError, match=reason):
        unpackb(msgpack.packb({'x': bad}))
    with pytest.raises(WireError, match='refused'):
        packb({'x': np.array([object()])})


def test_observation_conversion_follows_openpi():
    chw = np.random.default_rng(0).integers(0, 256, (3, 8, 6), dtype=np.uint8)
    request = {'images': {'cam_high': chw, 'cam_left_wrist': chw, 'cam_right_wrist': chw,
                          'cam_low': chw},
               'state': np.zeros(14), 'prompt': 'fold'}
    obs = to_observation(request, 'aloha')
    assert obs.images['cam_high'].shape == (8, 6, 3)
    np.testing.assert_array_equal(obs.images['cam_high'], chw.transpose(1, 2, 0))
    floats = {'observation/exterior_image_1_left': np.full((4, 4, 3), 0.5, np.float32),
              'observation/wrist_image_left': np.ones((4, 4, 3)),
              'observation/joint_position': np.arange(7.0),
              'observation/gripper_position': np.array([0.25])}
    obs = to_observation(floats, 'droid', default_prompt='default task')
    assert obs.images['exterior_image_1_left'].dtype == np.uint8
    assert obs.images['exterior_image_1_left'][0, 0, 0] == 127          # int(255 * 0.5)
    np.testing.assert_array_equal(obs.state, list(range(7)) + [0.25])
    assert obs.instruction == 'default task'
    with pytest.raises(RequestError, match='gripper_position'):
        to_observation({k: v for k, v in floats.items() if 'gripper' not in k}, 'droid', 'x')


# ---- a robot of one's own ---------------------------------------------------------------------
def test_custom_robot_with_default_and_mapped_observation_keys(tmp_path):
    from oxygen_ros.model.robot_spec import get_robot
    from oxygen_ros.serve.observations import load_observation_keys

    spec = get_robot('so101')
    obs = random_observation(spec, 0, image_size=64)
    # Default keys of a robot without an openpi client: observation/<camera>, observation/state.
    with serve('so101') as server:
        assert server.metadata['observation_keys']['cameras'] == {
            'front': 'observation/front', 'wrist': 'observation/wrist'}
        with connect(server) as ws:
            ws.send(packb({'observation/front': obs.images['front'],
                           'observation/wrist': obs.images['wrist'].transpose(2, 0, 1).copy(),
                           'observation/state': obs.state, 'prompt': 'stack the cubes'}))
            reply = unpackb(ws.recv(timeout=60))
            assert reply['actions'].shape[1] == 6
            ws.send(packb({'observation/front': obs.images['front'], 'prompt': 'x'}))
            error = ws.recv(timeout=60)
            assert "'observation/wrist'" in error and 'observation key map' in error
    # A key map file: nested keys, the state in two parts.
    keys_file = tmp_path / 'keys.yaml'
    keys_file.write_text('cameras: {front: [images, top], wrist: wrist_rgb}\n'
                         'state: [arm/joints, arm/gripper]\n')
    keys = load_observation_keys(keys_file, spec)
    with serve('so101', observation_keys=keys) as server:
        with connect(server) as ws:
            ws.send(packb({'images': {'top': obs.images['front']},
                           'wrist_rgb': obs.images['wrist'], 'arm/joints': obs.state[:5],
                           'arm/gripper': obs.state[5:], 'prompt': 'stack the cubes'}))
            assert unpackb(ws.recv(timeout=60))['actions'].shape[1] == 6
    keys_file.write_text('cameras: {front: top}\n')
    with pytest.raises(ValueError, match=r"cameras: \['front'\]; expected the cameras of robot "
                                         r"'so101': \['front', 'wrist'\]"):
        load_observation_keys(keys_file, spec)
