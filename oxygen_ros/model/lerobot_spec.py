"""Robot specs read from what a LeRobot user has: a π0.5 checkpoint's config.json, a dataset.

Both describe the robot with LeRobot features (plain dicts; nothing is loaded):

    checkpoint config.json   input_features {key: {type: VISUAL | STATE, shape}},
                             output_features {action: {type: ACTION, shape}}, n_action_steps
    dataset meta/info.json   features {key: {dtype: video | image | float32, shape, names}}, fps

Cameras keep the order the file lists them in and fill the model's slots in that order, as
LeRobot's π0.5 does: PI05Policy._preprocess_images takes config.image_features (the VISUAL
input features, in order) and puts missing or `empty_cameras` images after them, masked. A
policy's features come from its dataset's, so a dataset and the checkpoint trained on it give
the same slots. What the files do not say (action space, a checkpoint's step period, names)
gets a default, and every default is listed in `assumed` for the user to review.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping

from .robot_spec import JOINT_POSITION, JOINT_VELOCITY, RobotSpec, RobotSpecError, SLOT_NAMES

STATE_FEATURE = 'observation.state'
ACTION_FEATURE = 'action'
CAMERA_PREFIXES = ('observation.images.', 'observation.')
EMPTY_CAMERA = re.compile(r'^observation\.images\.empty_camera_\d+$')   # LeRobot's padding
CAMERA_DTYPES = ('video', 'image')
LEROBOT_NORM_STATS = 'lerobot'       # the loader's key of a LeRobot checkpoint's statistics
DEFAULT_FPS = 30.0                   # LeRobot's usual recording rate (a checkpoint has none)
OPEN_LOOP_S = 0.5                    # open-loop time of openpi's clients (LIBERO .25, DROID .53,
#                                      ALOHA .5 s): the default rows before a replan


@dataclasses.dataclass(frozen=True)
class InferredSpec:
    """A spec read from LeRobot features, where each camera came from, and what was assumed."""

    spec: RobotSpec
    features: dict[str, str]          # camera name -> LeRobot feature key
    assumed: tuple[str, ...]          # one line per default the files did not decide


def _token(text: str, prefix: str) -> str:
    """Make a ROS name token of a feature name: other characters -> '_', a letter first."""
    token = re.sub(r'[^A-Za-z0-9_]', '_', text).strip('_') or prefix
    return token if token[0].isalpha() else f'{prefix}_{token}'


def camera_name(feature: str) -> str:
    """Camera name of a feature: observation.images.front -> front, observation.image -> image."""
    for prefix in CAMERA_PREFIXES:
        if feature.startswith(prefix):
            return _token(feature[len(prefix):], 'camera')
    return _token(feature, 'camera')


def image_hw(shape, names=None) -> tuple[int, int] | None:
    """(height, width) of a camera feature's shape, channels first or last (None: unknown).

    LeRobot writes [3, H, W] (names channel, height, width; older and policy features) or
    [H, W, 3] (names height, width, channel(s)); names decide, else the axis holding 3.
    """
    if not isinstance(shape, (list, tuple)) or len(shape) != 3:
        return None
    dims = [int(d) for d in shape]
    if isinstance(names, (list, tuple)) and len(names) == 3:
        axes = [str(n).lower() for n in names]
        if 'height' in axes and 'width' in axes:
            return dims[axes.index('height')], dims[axes.index('width')]
    if dims[0] in (1, 3, 4) and dims[2] not in (1, 3, 4):
        return dims[1], dims[2]           # channels first
    return dims[0], dims[1]               # channels last


def vector_names(feature: Mapping) -> list[str] | None:
    """Per-dimension names of a vector feature: a list, or LeRobot's {'motors': [...]} form."""
    names = feature.get('names')
    if isinstance(names, Mapping) and len(names) == 1:
        names = next(iter(names.values()))
    if isinstance(names, (list, tuple)) and all(isinstance(n, str) and n for n in names):
        return list(names)
    return None


def _vector_dim(features: Mapping, key: str, source: str, what: str) -> int:
    feature = features.get(key)
    if not isinstance(feature, Mapping):
        raise RobotSpecError(f'{source}: {key}: missing; expected the {what} feature '
                             f'(features: {", ".join(sorted(features))})')
    shape = feature.get('shape')
    if (not isinstance(shape, (list, tuple)) or len(shape) != 1
            or isinstance(shape[0], bool) or not float(shape[0]).is_integer() or shape[0] < 1):
        raise RobotSpecError(f'{source}: {key}.shape: {shape}; expected [{what} dim]')
    return int(shape[0])


def _cameras(keys: list[str], source: str) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(camera, slot) in feature order and camera -> feature; more than three is an error."""
    if not keys:
        raise RobotSpecError(f'{source}: no camera features; expected 1 to {len(SLOT_NAMES)} '
                             '(π0.5 needs at least one image)')
    if len(keys) > len(SLOT_NAMES):
        raise RobotSpecError(f'{source}: {len(keys)} camera features ({", ".join(keys)}); '
                             f'expected at most {len(SLOT_NAMES)} (the model has the image '
                             f'slots {", ".join(SLOT_NAMES)})')
    features: dict[str, str] = {}
    for key in keys:
        name = camera_name(key)
        while name in features:
            name += '_2'
        features[name] = key
    return list(zip(features, SLOT_NAMES)), features


def _names(given: list[str] | None, dim: int, prefix: str, what: str, source: str,
           assumed: list[str]) -> tuple[str, ...]:
    if given is not None and len(given) == dim and len(set(given)) == dim:
        return tuple(given)
    assumed.append(f'{what} names: {prefix}_0 .. {prefix}_{dim - 1} ({source} has none); set '
                   'the names your robot uses')
    return tuple(f'{prefix}_{i}' for i in range(dim))


def _action_space(names: tuple[str, ...], assumed: list[str]) -> str:
    if names and all(n.endswith('.vel') for n in names):
        space = JOINT_VELOCITY
    else:
        space = JOINT_POSITION
    assumed.append(f'action space: {space} (LeRobot features do not say; set actions.space to '
                   'joint_position, joint_velocity or end_effector_delta)')
    return space


def _spec(name: str, cameras, state_names, action_names, space, fps: float, open_loop: int,
          resolutions, source: str) -> RobotSpec:
    return RobotSpec(name=name, cameras=tuple(cameras), state_dim=len(state_names),
                     action_dim=len(action_names), asset_id=LEROBOT_NORM_STATS,
                     joint_names=state_names, action_space=space, action_names=action_names,
                     step_period_s=1.0 / fps, open_loop_rows=open_loop,
                     resolutions=tuple(resolutions), source=source)


def spec_from_lerobot_checkpoint(config: Mapping, source: str, name: str) -> InferredSpec:
    """Read the robot of a LeRobot π0.5 checkpoint's config.json (raises RobotSpecError)."""
    inputs = config.get('input_features')
    outputs = config.get('output_features')
    if not isinstance(inputs, Mapping) or not isinstance(outputs, Mapping):
        raise RobotSpecError(f'{source}: input_features / output_features missing; expected a '
                             'LeRobot policy config.json')
    visual = [k for k, f in inputs.items() if isinstance(f, Mapping) and f.get('type') == 'VISUAL'
              and not EMPTY_CAMERA.match(k)]
    cameras, features = _cameras(visual, f'{source}: input_features')
    state_dim = _vector_dim(inputs, STATE_FEATURE, f'{source}: input_features', 'state')
    action_dim = _vector_dim(outputs, ACTION_FEATURE, f'{source}: output_features', 'action')
    assumed: list[str] = []
    state_names = _names(None, state_dim, 'joint', 'state', 'config.json', assumed)
    if action_dim == state_dim:
        action_names = state_names
        assumed.append('action names: the state names (the same number of columns)')
    else:
        action_names = _names(None, action_dim, 'action', 'action', 'config.json', assumed)
    space = _action_space(action_names, assumed)
    assumed.append(f'step period: 1/{DEFAULT_FPS:g} s (LeRobot\'s usual fps; config.json has '
                   'no rate): set actions.rate_hz to the rate of the training data')
    chunk = int(config.get('chunk_size') or 50)
    open_loop = max(1, min(int(config.get('n_action_steps') or chunk), chunk))
    resolutions = [(cam, hw) for cam, key in features.items()
                   if (hw := image_hw(inputs[key].get('shape'))) is not None]
    spec = _spec(_token(name, 'robot'), cameras, state_names, action_names, space, DEFAULT_FPS,
                 open_loop, resolutions, source)
    return InferredSpec(spec, features, tuple(assumed))


def spec_from_lerobot_dataset(info: Mapping, source: str, name: str = '') -> InferredSpec:
    """Read the robot of a LeRobot dataset's meta/info.json (raises RobotSpecError).

    name: the robot's name when info.json has no robot_type.
    """
    features = info.get('features')
    if not isinstance(features, Mapping):
        raise RobotSpecError(f'{source}: features: missing; expected a LeRobot info.json')
    keys = [k for k, f in features.items()
            if isinstance(f, Mapping) and f.get('dtype') in CAMERA_DTYPES]
    cameras, camera_features = _cameras(keys, f'{source}: features')
    state_dim = _vector_dim(features, STATE_FEATURE, f'{source}: features', 'state')
    action_dim = _vector_dim(features, ACTION_FEATURE, f'{source}: features', 'action')
    assumed: list[str] = []
    state_names = _names(vector_names(features[STATE_FEATURE]), state_dim, 'joint', 'state',
                         'info.json', assumed)
    given = vector_names(features[ACTION_FEATURE])
    if given is None and action_dim == state_dim:
        action_names = state_names
        assumed.append('action names: the state names (info.json names no action column)')
    else:
        action_names = _names(given, action_dim, 'action', 'action', 'info.json', assumed)
    space = _action_space(action_names, assumed)
    fps = info.get('fps')
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
        raise RobotSpecError(f'{source}: fps: {fps!r}; expected the frames per second')
    assumed.append(f'step period: 1/{fps:g} s from fps {fps:g} (one action row per frame)')
    open_loop = max(1, round(OPEN_LOOP_S * fps))
    assumed.append(f'open_loop_rows: {open_loop} ({OPEN_LOOP_S:g} s, as openpi\'s clients '
                   'replan)')
    assumed.append(f'norm_stats: {LEROBOT_NORM_STATS} (a LeRobot checkpoint\'s statistics; an '
                   'openpi checkpoint needs its assets/<key>)')
    resolutions = [(cam, hw) for cam, key in camera_features.items()
                   if (hw := image_hw(features[key].get('shape'), features[key].get('names')))
                   is not None]
    robot = info.get('robot_type') if isinstance(info.get('robot_type'), str) else ''
    spec = _spec(_token(robot or name, 'robot'), cameras, state_names, action_names, space,
                 float(fps), open_loop, resolutions, source)
    return InferredSpec(spec, camera_features, tuple(assumed))
