"""Bench part 'serve': what `oxygen-ros serve` adds to a request over the engine's act().

One client on localhost sends openpi-style observations (224x224 images, the robot's state,
a prompt) one after the other, as openpi's robot loop does, and times each round trip. The
server reports the frame's act() time and how long the request waited for the engine (the
previous frame's language work, which runs after its reply). The overhead of a request is

    round trip - act() - wait      (decode, msgpack, websocket, queue hand-offs, encode)

reported as p50 over the requests and as a fraction of act()'s p50.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

TARGET_OVERHEAD_FRACTION = 0.05        # server overhead p50 ≤ 5% of act() p50 (CPU preset)


@dataclasses.dataclass(frozen=True)
class ServeBenchOptions:
    """The serve part's settings."""

    robot: str = 'libero'
    requests: int = 30
    warmup: int = 3
    tokens: int = 10                   # N of the language requests running meanwhile
    k: int = 5


def openpi_request(robot: str, index: int, seed: int) -> dict:
    """Build an observation as openpi's client for `robot` sends it (random content)."""
    from oxygen_ros.engine import random_observation
    from oxygen_ros.serve.observations import keys_for

    obs = random_observation(robot, index, seed, image_size=224)
    keys = keys_for(robot)
    request: dict = {'prompt': 'pick up the red block'}
    for camera, path in keys.cameras.items():
        image = obs.images[camera]
        if path[0] == 'images':                      # aloha's client sends channels first
            request.setdefault('images', {})[path[1]] = image.transpose(2, 0, 1).copy()
        else:
            request[path[0]] = image
    # droid splits its state into joints [7] and gripper [1]; the others send it whole
    sizes = [obs.state.size - 1, 1] if len(keys.state) == 2 else [obs.state.size]
    start = 0
    for path, size in zip(keys.state, sizes):
        request[path[0]] = obs.state[start:start + size]
        start += size
    return request


def run_serve_part(options: ServeBenchOptions, preset: str, device: str, dtype: str,
                   threads: int, seed: int) -> dict:
    """Serve the engine on localhost, drive it with one client; return one result row."""
    import websockets.sync.client

    from oxygen_ros.runtime.engine_setup import build_engine
    from oxygen_ros.runtime.params import robot_defaults, Settings
    from oxygen_ros.serve.server import PolicyServer, ServerConfig
    from oxygen_ros.serve.wire import packb, unpackb

    settings = Settings.from_values({
        **robot_defaults(options.robot), 'preset': preset, 'device': device, 'dtype': dtype,
        'seed': seed, 'torch_threads': threads, 'tokens_per_request': options.tokens,
        'decode_budget': str(options.k)})
    engine = build_engine(settings)
    server = PolicyServer(engine.system, ServerConfig(robot=options.robot, host='127.0.0.1',
                                                      port=0), engine.description)
    rtt, act, wait = [], [], []
    with server, websockets.sync.client.connect(
            f'ws://127.0.0.1:{server.port}', compression=None, max_size=None) as ws:
        unpackb(ws.recv())                                   # metadata
        requests = [packb(openpi_request(options.robot, i, seed))
                    for i in range(options.warmup + options.requests)]
        for i, message in enumerate(requests):
            start = time.perf_counter()
            ws.send(message)
            reply = unpackb(ws.recv())
            elapsed_ms = (time.perf_counter() - start) * 1e3
            if i < options.warmup:
                continue
            rtt.append(elapsed_ms)
            act.append(reply['policy_timing']['infer_ms'])
            wait.append(reply['server_timing']['queue_ms'])
    rtt, act, wait = np.array(rtt), np.array(act), np.array(wait)
    overhead = rtt - act - wait
    act_p50 = float(np.median(act))
    return {
        'robot': options.robot, 'preset': preset, 'device': device, 'dtype': dtype,
        'threads': threads, 'requests': options.requests, 'tokens': options.tokens,
        'k': options.k, 'request_kb': round(len(requests[0]) / 1024, 1),
        'act_ms_p50': act_p50, 'rtt_ms_p50': float(np.median(rtt)),
        'wait_ms_p50': float(np.median(wait)),
        'overhead_ms_p50': float(np.median(overhead)),
        'overhead_ms_p90': float(np.percentile(overhead, 90)),
        'overhead_fraction_p50': float(np.median(overhead)) / act_p50,
    }


def serve_targets(rows: list[dict]) -> list[dict]:
    """Return the serve part's target: per-request overhead ≤ 5% of act()."""
    if not rows:
        return []
    r = rows[0]
    return [{
        'target': f'server per-request overhead ≤ {TARGET_OVERHEAD_FRACTION:.0%} of act() '
                  f'({r["preset"]})',
        'measured': f'{r["overhead_fraction_p50"]:.1%} ({r["overhead_ms_p50"]:.2f} ms p50, '
                    f'{r["overhead_ms_p90"]:.2f} ms p90, over act() {r["act_ms_p50"]:.1f} ms; '
                    f'{r["request_kb"]:.0f} kB requests)',
        'met': r['overhead_fraction_p50'] <= TARGET_OVERHEAD_FRACTION}]
