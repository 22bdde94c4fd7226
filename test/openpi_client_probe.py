"""Drive a server with openpi's own client (openpi-client, unmodified); print what came back.

Runs in .venv-openpi-client (numpy<2, openpi-client pinned), not in the project's venv:
    python openpi_client_probe.py PORT ROBOT REQUESTS [API_KEY [QUESTION]]
Observations are built as openpi's example clients build them for each robot; with QUESTION,
the first one carries it under 'question'. Prints one JSON object: the metadata, every
response's keys, action shapes/dtypes, language, question and answers, and the text of the
error a malformed observation raises.
"""

import json
import sys

import numpy as np
from openpi_client import websocket_client_policy


def observation(robot, i):
    rng = np.random.default_rng(i)

    def hwc():
        return rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)

    if robot == 'libero':
        return {'observation/image': hwc(), 'observation/wrist_image': hwc(),
                'observation/state': rng.uniform(-1, 1, 8), 'prompt': 'pick up the bowl'}
    if robot == 'droid':
        return {'observation/exterior_image_1_left': hwc(),
                'observation/wrist_image_left': hwc(),
                'observation/joint_position': rng.uniform(-1, 1, 7),
                'observation/gripper_position': rng.uniform(0, 1, 1),
                'prompt': 'put the marker in the cup'}
    # aloha: channels-first images, four cameras (cam_low unused by π0.5)
    images = {cam: rng.integers(0, 256, (3, 224, 224), dtype=np.uint8)
              for cam in ('cam_high', 'cam_low', 'cam_left_wrist', 'cam_right_wrist')}
    return {'images': images, 'state': rng.uniform(-0.5, 0.5, 14).astype(np.float32),
            'prompt': 'fold the towel'}


def main():
    port, robot, requests = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    api_key = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] else None
    question = sys.argv[5] if len(sys.argv) > 5 else None
    client = websocket_client_policy.WebsocketClientPolicy(host='127.0.0.1', port=port,
                                                           api_key=api_key)
    out = {'metadata': client.get_server_metadata(), 'responses': []}
    for i in range(requests):
        obs = observation(robot, i)
        if question is not None and i == 0:
            obs['question'] = question
        result = client.infer(obs)
        actions = result['actions']
        out['responses'].append({
            'keys': sorted(result), 'shape': list(actions.shape), 'dtype': str(actions.dtype),
            'finite': bool(np.all(np.isfinite(actions))),
            'frame_index': int(result['frame_index']),
            'server_timing': sorted(result['server_timing']),
            'language': result['language'], 'question': result.get('question'),
            'answers': result.get('answers', [])})
    bad = observation(robot, 0)
    bad.pop('prompt')
    try:
        client.infer(bad)
        out['error'] = None
    except RuntimeError as err:
        out['error'] = str(err)
    out['after_error_shape'] = list(client.infer(observation(robot, 1))['actions'].shape)
    print(json.dumps(out, default=str))


if __name__ == '__main__':
    main()
