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
names become the robot's observation camera names (oxygen_ros.model.robots), which are
openpi's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from oxygen_ros.engine.types import Observation
from oxygen_ros.model.robots import get_robot


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
        raise RequestError(f'{robot} observation: missing {", ".join(map(repr, missing))} '
                           f'(request keys: {have}); expected the keys of openpi\'s {robot} '
                           'client')


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


def to_observation(request: Any, robot: str, default_prompt: str = '') -> Observation:
    """Build the engine's Observation from one openpi request dict (raises RequestError)."""
    if not isinstance(request, Mapping):
        raise RequestError(f'request: expected a map of observation keys, got '
                           f'{type(request).__name__}')
    keys = OBSERVATION_KEYS[robot]
    _check_keys(request, keys, robot)
    images = {camera: to_image(_get(request, path), _name(path))
              for camera, path in keys.cameras.items()}
    parts = [_vector(_get(request, path), _name(path)) for path in keys.state]
    bad = [_name(path) for path, p in zip(keys.state, parts) if p.ndim != 1]
    if bad:
        raise RequestError(f'{robot} observation: {bad[0]} must be a vector')
    state = np.concatenate(parts)
    spec = get_robot(robot)
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


def committed_rows(request: Mapping, robot: str) -> CommittedRows | None:
    """Read the optional real-time chunking fields of a request (None when absent)."""
    value = request.get(PREV_ACTIONS_KEY)
    delay = request.get(INFERENCE_DELAY_KEY)
    if value is None:
        if delay is not None:
            raise RequestError(f'{INFERENCE_DELAY_KEY} without {PREV_ACTIONS_KEY}: send the '
                               'rows of the chunk being executed too')
        return None
    dim = get_robot(robot).action_dim
    rows = _vector(value, PREV_ACTIONS_KEY)
    if rows.ndim != 2 or rows.shape[1] != dim:
        raise RequestError(f'{PREV_ACTIONS_KEY}: shape {list(rows.shape)}; expected [n, {dim}] '
                           f'({robot} actions not yet started, in robot units)')
    if not np.all(np.isfinite(rows)):
        raise RequestError(f'{PREV_ACTIONS_KEY}: holds NaN or inf')
    if delay is not None and (isinstance(delay, bool) or not isinstance(delay, (int, np.integer))
                              or delay < 0):
        raise RequestError(f'{INFERENCE_DELAY_KEY}: {delay!r}; expected an integer >= 0 (rows)')
    return CommittedRows(rows, None if delay is None else int(delay))
