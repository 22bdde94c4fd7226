"""openpi's observation dicts (LIBERO, DROID, ALOHA as openpi's clients send them) -> Observation.

The keys are those of openpi's example clients and policy transforms:

    libero  observation/image, observation/wrist_image     uint8 [H, W, 3]
            observation/state                              [8] eef pose + gripper
    droid   observation/exterior_image_1_left,
            observation/wrist_image_left                   uint8 [H, W, 3]
            observation/joint_position [7] + observation/gripper_position [1]
    aloha   images: {cam_high, cam_left_wrist, cam_right_wrist, (cam_low)}
                                                           uint8 [3, H, W] (channels first)
            state                                          [14]
    all     prompt                                         the task text

Images may be channels first or last, uint8 or float in [0, 1] (openpi accepts both); camera
names become the robot's observation camera names (its spec, config/robots/), which are
openpi's. Any other robot's client sends observation/<camera> for each camera and
observation/state, unless a key map says otherwise (`serve --observation-keys FILE`):

    cameras:                       # every camera of the robot's spec
      front: observation/front     # a key of the request,
      wrist: [images, wrist]       # or a path into nested maps
    state: [observation/joint_position, observation/gripper_position]   # joined in order
    optional_cameras: [cam_low]    # accepted, not used

The server reads no message larger than `max_request_bytes(keys, state_dim)`: the robot's
largest valid observation (every camera, optional ones too, at 1920 x 1080 as float32,
openpi's float images; 4x the uint8 frames openpi's clients send) with a 25% margin.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import yaml

from oxygen_ros.engine.types import Observation
from oxygen_ros.model.robot_spec import get_robot, RobotSpec


class RequestError(ValueError):
    """An observation the server cannot use; the message says what was wrong and expected."""


@dataclasses.dataclass(frozen=True)
class ObservationKeys:
    """Where one robot's openpi client puts cameras and state."""

    cameras: dict[str, tuple[str, ...]]     # camera name -> key path in the request
    state: tuple[tuple[str, ...], ...]      # key paths whose vectors are concatenated
    optional_cameras: tuple[str, ...] = ()  # accepted, not used (aloha's cam_low)


OBSERVATION_KEYS: dict[str, ObservationKeys] = {
    'libero': ObservationKeys(
        cameras={'image': ('observation/image',),
                 'wrist_image': ('observation/wrist_image',)},
        state=(('observation/state',),)),
    'droid': ObservationKeys(
        cameras={'exterior_image_1_left': ('observation/exterior_image_1_left',),
                 'wrist_image_left': ('observation/wrist_image_left',)},
        state=(('observation/joint_position',), ('observation/gripper_position',))),
    'aloha': ObservationKeys(
        cameras={'cam_high': ('images', 'cam_high'),
                 'cam_left_wrist': ('images', 'cam_left_wrist'),
                 'cam_right_wrist': ('images', 'cam_right_wrist')},
        state=(('state',),), optional_cameras=('cam_low',)),
}
PROMPT_KEY = 'prompt'
LARGEST_IMAGE = (1080, 1920, 3)    # [H, W, C] the request bound is sized for (1080p cameras)
LARGEST_IMAGE_ITEMSIZE = 4         # float32: openpi's float images; uint8 ones are 4x smaller
REQUEST_MARGIN = 1.25              # the bound over the largest valid observation
ARRAY_OVERHEAD_BYTES = 128         # msgpack map of one array (keys, dtype, shape)


def default_keys(spec: RobotSpec) -> ObservationKeys:
    """Return the keys of a robot without an openpi client: observation/<camera>, .../state."""
    return ObservationKeys(cameras={cam: (f'observation/{cam}',) for cam in spec.camera_names},
                           state=(('observation/state',),),
                           optional_cameras=spec.ignored_cameras)


def keys_for(robot: str | RobotSpec) -> ObservationKeys:
    """Return the keys a robot's client sends: openpi's for its three robots, else defaults."""
    spec = get_robot(robot)
    if spec.name in OBSERVATION_KEYS and set(OBSERVATION_KEYS[spec.name].cameras) == set(
            spec.camera_names):
        return OBSERVATION_KEYS[spec.name]
    return default_keys(spec)


def _key_path(value, where: str) -> tuple[str, ...]:
    if isinstance(value, str) and value:
        return (value,)
    if (isinstance(value, list) and value
            and all(isinstance(part, str) and part for part in value)):
        return tuple(value)
    raise ValueError(f'{where}: {value!r}; expected a key, or a list of keys (a path into '
                     'nested maps)')


def load_observation_keys(path: str | Path, robot: str | RobotSpec) -> ObservationKeys:
    """Read a key map file (module docstring) for `robot`; ValueError names the problem."""
    spec = get_robot(robot)
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f'{path}: cannot read the observation key map: {err}') from None
    if not isinstance(data, Mapping) or not isinstance(data.get('cameras'), Mapping):
        raise ValueError(f'{path}: expected a mapping with cameras (camera -> key) and state')
    unknown = [k for k in data if k not in ('cameras', 'state', 'optional_cameras')]
    if unknown:
        raise ValueError(f'{path}: {unknown[0]}: unknown field; expected cameras, state, '
                         'optional_cameras')
    cameras = {str(cam): _key_path(key, f'{path}: cameras.{cam}')
               for cam, key in data['cameras'].items()}
    expected = list(spec.camera_names)
    if sorted(cameras) != sorted(expected):
        raise ValueError(f'{path}: cameras: {sorted(cameras)}; expected the cameras of robot '
                         f'{spec.name!r}: {expected}')
    state = data.get('state', ['observation/state'])
    if not isinstance(state, list) or not state:
        raise ValueError(f'{path}: state: {state!r}; expected a list of keys, joined in order')
    optional = data.get('optional_cameras') or []
    if not isinstance(optional, list) or not all(isinstance(c, str) for c in optional):
        raise ValueError(f'{path}: optional_cameras: expected a list of camera names')
    return ObservationKeys(cameras=cameras,
                           state=tuple(_key_path(k, f'{path}: state[{i}]')
                                       for i, k in enumerate(state)),
                           optional_cameras=tuple(optional))


def _name(path: tuple[str, ...]) -> str:
    return '.'.join(path)


_MISSING = object()


def _get(request: Mapping, path: tuple[str, ...]) -> Any:
    value: Any = request
    for part in path:
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _check_keys(request: Mapping, keys: ObservationKeys, robot: str) -> None:
    paths = list(keys.cameras.values()) + list(keys.state)
    missing = [_name(path) for path in paths if _get(request, path) is _MISSING]
    if missing:
        have = ', '.join(sorted(map(str, request))) or 'none'
        whose = (f"openpi's {robot} client" if keys in OBSERVATION_KEYS.values()
                 else f"the {robot} client (the server's observation key map)")
        raise RequestError(f'{robot} observation: missing {", ".join(map(repr, missing))} '
                           f'(request keys: {have}); expected the keys of {whose}')


def largest_observation_bytes(keys: ObservationKeys, state_dim: int,
                              max_instruction_chars: int = 500) -> int:
    """Return the msgpack size of a robot's largest valid observation (module docstring).

    keys: where its client puts cameras and state; state_dim: its state's length.
    """
    cameras = len(keys.cameras) + len(keys.optional_cameras)
    image = int(np.prod(LARGEST_IMAGE)) * LARGEST_IMAGE_ITEMSIZE + ARRAY_OVERHEAD_BYTES
    state = 8 * state_dim + ARRAY_OVERHEAD_BYTES * len(keys.state)
    prompt = 4 * max_instruction_chars + 64          # UTF-8: at most 4 bytes a character
    return cameras * image + state + 2 * prompt      # the prompt, and a question as long


def max_request_bytes(keys: ObservationKeys, state_dim: int,
                      max_instruction_chars: int = 500) -> int:
    """Return the default bound on one request message: the largest valid observation + 25%."""
    return int(REQUEST_MARGIN * largest_observation_bytes(keys, state_dim,
                                                          max_instruction_chars))


def to_image(value: Any, where: str) -> np.ndarray:
    """Convert an openpi image (HWC or CHW; uint8, or float in [0, 1]) to uint8 [H, W, 3]."""
    if not isinstance(value, np.ndarray):
        raise RequestError(f'{where}: expected a numpy image array, got {type(value).__name__}')
    image = value
    if image.ndim == 3 and image.shape[0] == 3 and image.shape[-1] != 3:
        image = image.transpose(1, 2, 0)                     # [3, H, W] -> [H, W, 3]
    if image.ndim != 3 or image.shape[-1] != 3 or 0 in image.shape:
        raise RequestError(f'{where}: shape {list(value.shape)}; expected [H, W, 3] or '
                           '[3, H, W] (RGB)')
    if np.issubdtype(image.dtype, np.floating):
        if not np.all(np.isfinite(image)):
            raise RequestError(f'{where}: float image holds NaN or inf')
        # openpi's rule for float images: values in [0, 1], scaled to 0..255 and truncated
        image = (255 * np.clip(image, 0.0, 1.0)).astype(np.uint8)
    elif image.dtype != np.uint8:
        raise RequestError(f'{where}: dtype {image.dtype}; expected uint8 or float in [0, 1]')
    return np.ascontiguousarray(image)


def _vector(value: Any, where: str) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise RequestError(f'{where}: expected numbers, got {type(value).__name__}') from None
    return arr.reshape(-1) if arr.ndim <= 1 else arr


def to_observation(request: Any, robot: str | RobotSpec, default_prompt: str = '',
                   keys: ObservationKeys | None = None) -> Observation:
    """Build the engine's Observation from one openpi request dict (raises RequestError).

    keys: where the robot's client puts cameras and state (default: keys_for(robot)).
    """
    if not isinstance(request, Mapping):
        raise RequestError(f'request: expected a map of observation keys, got '
                           f'{type(request).__name__}')
    spec = get_robot(robot)
    robot = spec.name
    keys = keys or keys_for(spec)
    _check_keys(request, keys, robot)
    images = {camera: to_image(_get(request, path), _name(path))
              for camera, path in keys.cameras.items()}
    parts = [_vector(_get(request, path), _name(path)) for path in keys.state]
    bad = [_name(path) for path, p in zip(keys.state, parts) if p.ndim != 1]
    if bad:
        raise RequestError(f'{robot} observation: {bad[0]} must be a vector')
    state = np.concatenate(parts)
    if state.shape != (spec.state_dim,):
        names = ' + '.join(_name(p) for p in keys.state)
        raise RequestError(f'{robot} observation: {names} has {state.size} values; expected '
                           f'{spec.state_dim}')
    prompt = request.get(PROMPT_KEY, default_prompt)
    if isinstance(prompt, bytes):
        prompt = prompt.decode('utf-8', errors='replace')
    if not isinstance(prompt, str):
        raise RequestError(f'prompt: expected a string, got {type(prompt).__name__}')
    if not prompt.strip():
        raise RequestError("prompt: missing or empty; send 'prompt' with the task text (or "
                           'start the server with --default-prompt)')
    return Observation(images=images, state=state, instruction=prompt)


PREV_ACTIONS_KEY = 'prev_actions'         # optional: the client's chunk to continue (RTC)
INFERENCE_DELAY_KEY = 'inference_delay'   # optional: rows that play while this one computes


@dataclasses.dataclass(frozen=True)
class CommittedRows:
    """The rows a client's next chunk continues (real-time chunking), from its request."""

    rows: np.ndarray                # float [n, robot action dim]: not started at the
    #                                 observation, in order (row 0 plays next)
    delay: int | None = None        # rows that play while the chunk is computed (None: the
    #                                 server's own estimate)


def committed_rows(request: Mapping, robot: str | RobotSpec) -> CommittedRows | None:
    """Read the optional real-time chunking fields of a request (None when absent)."""
    value = request.get(PREV_ACTIONS_KEY)
    delay = request.get(INFERENCE_DELAY_KEY)
    if value is None:
        if delay is not None:
            raise RequestError(f'{INFERENCE_DELAY_KEY} without {PREV_ACTIONS_KEY}: send the '
                               'rows of the chunk being executed too')
        return None
    spec = get_robot(robot)
    dim = spec.action_dim
    rows = _vector(value, PREV_ACTIONS_KEY)
    if rows.ndim != 2 or rows.shape[1] != dim:
        raise RequestError(f'{PREV_ACTIONS_KEY}: shape {list(rows.shape)}; expected [n, {dim}] '
                           f'({spec.name} actions not yet started, in robot units)')
    if not np.all(np.isfinite(rows)):
        raise RequestError(f'{PREV_ACTIONS_KEY}: holds NaN or inf')
    if delay is not None and (isinstance(delay, bool) or not isinstance(delay, (int, np.integer))
                              or delay < 0):
        raise RequestError(f'{INFERENCE_DELAY_KEY}: {delay!r}; expected an integer >= 0 (rows)')
    return CommittedRows(rows, None if delay is None else int(delay))
