"""Robot specs as data: the YAML schema, its checks, the shipped robots, and fit-to-model checks.

A robot spec says how one robot's observations map onto π0.5's inputs and how the model's
actions map back (docs/robots.md has the schema with the three built-ins and an SO-101):

    name: so101
    cameras:                                   # each fills one of the model's three slots
      - {name: front, slot: base_0_rgb, resolution: [480, 640]}
      - {name: wrist, slot: left_wrist_0_rgb}
    masked_slots: [right_wrist_0_rgb]          # optional; checked: the slots no camera fills
    ignored_cameras: []                        # accepted in observations, never fed
    state:   {dim: 6, names: [...], affine: {scale: [...], offset: [...]}}
    actions: {dim: 6, names: [...], space: joint_position, rate_hz: 30, open_loop_rows: 15,
              delta_mask: [...], affine: {...}}
    transform: aloha_adapt_to_pi               # optional named transform (robot_transforms)
    norm_stats: so101                          # assets/<key>/norm_stats.json of a checkpoint

Torch-free (numpy and pyyaml), so the node's parameter checks read specs without loading the
model. Why here and not in runtime/: the spec is the model's I/O contract, and the engine's
frontend and workloads (which may import model/ only) resolve robots by name.
Every schema error is one line naming the file, the field and what was expected.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from pathlib import Path
import re
import sys
import textwrap
from typing import Any, Callable, Mapping

import numpy as np
import yaml

from .robot_transforms import Affine, TRANSFORMS

# The model's three image slots, in order.
SLOT_NAMES = ('base_0_rgb', 'left_wrist_0_rgb', 'right_wrist_0_rgb')

# What one row of a robot's action chunk means (ActionChunk.action_space has one constant each).
JOINT_POSITION = 'joint_position'            # absolute joint positions
JOINT_VELOCITY = 'joint_velocity'            # joint velocities (rad/s)
END_EFFECTOR_DELTA = 'end_effector_delta'    # end-effector delta pose + gripper
ACTION_SPACES = (JOINT_POSITION, JOINT_VELOCITY, END_EFFECTOR_DELTA)

# The robots of openpi's examples and the OxyGen paper's workloads (config/robots/<name>.yaml).
BUILTIN_ROBOTS = ('libero', 'droid', 'aloha')
ROBOTS_DIR = Path('config') / 'robots'       # under the repository or share/oxygen_ros
ROBOT_FILE_SUFFIXES = ('.yaml', '.yml')
# Camera names become parameter names and topics (cameras.<name>.topic, camera/<name>/...).
NAME_TOKEN = re.compile(r'^[A-Za-z][A-Za-z0-9_]*$')


class RobotSpecError(ValueError):
    """A robot spec is missing, malformed or does not fit the model; one line says what."""


@dataclasses.dataclass(frozen=True)
class RobotSpec:
    """How one robot's observation maps onto the model and back."""

    name: str
    cameras: tuple[tuple[str, str], ...]   # (observation camera name, model slot); all required
    state_dim: int
    action_dim: int
    asset_id: str                          # norm stats key: assets/<asset_id>/norm_stats.json
    # The robot's usual JointState names, one per state entry, in state order.
    joint_names: tuple[str, ...] = ()
    ignored_cameras: tuple[str, ...] = ()  # accepted in observations but not fed to the model
    # Action columns that are deltas w.r.t. the current state (openpi AbsoluteActions).
    delta_action_mask: tuple[bool, ...] | None = None
    transform: str | None = None           # a named transform (robot_transforms.TRANSFORMS)
    state_affine: Affine | None = None     # robot state = scale * model state + offset
    action_affine: Affine | None = None    # robot action = scale * model action + offset
    # What the robot's controller does with a row (openpi's clients and the training data):
    action_space: str = JOINT_POSITION     # one of ACTION_SPACES
    action_names: tuple[str, ...] = ()     # one per action column
    step_period_s: float = 0.1             # time between rows (the data's control period)
    open_loop_rows: int = 5                # rows openpi's client plays before it replans
    # camera name -> (height, width) the camera delivers (informational: any size is resized)
    resolutions: tuple[tuple[str, tuple[int, int]], ...] = ()
    source: str = dataclasses.field(default='', compare=False)   # file or what it came from

    @property
    def camera_names(self) -> tuple[str, ...]:
        """Observation camera names the model uses, in slot order."""
        return tuple(cam for cam, _ in self.cameras)

    @property
    def masked_slots(self) -> tuple[str, ...]:
        """The model's image slots no camera fills (fed as masked black images)."""
        used = {slot for _, slot in self.cameras}
        return tuple(slot for slot in SLOT_NAMES if slot not in used)

    @property
    def where(self) -> str:
        """How errors name this spec: its file, or the robot's name."""
        return self.source or f'robot {self.name!r}'

    @property
    def state_to_model(self) -> Callable[[np.ndarray], np.ndarray] | None:
        """Robot state [S] -> model joint space (affine, then the named transform); None: same."""
        named = TRANSFORMS[self.transform] if self.transform else None
        return _chain(self.state_affine and self.state_affine.to_model,
                      named and named.state_to_model)

    @property
    def actions_from_model(self) -> Callable[[np.ndarray], np.ndarray] | None:
        """Model actions [H, A] -> robot units (the named transform, then affine); None: same."""
        named = TRANSFORMS[self.transform] if self.transform else None
        return _chain(named and named.actions_from_model,
                      self.action_affine and self.action_affine.to_robot)

    @property
    def actions_to_model(self) -> Callable[[np.ndarray], np.ndarray] | None:
        """Robot actions [n, A] -> model joint space (actions_from_model inverted); None: same."""
        named = TRANSFORMS[self.transform] if self.transform else None
        return _chain(self.action_affine and self.action_affine.to_model,
                      named and named.actions_to_model)


def _chain(*steps: Callable | None) -> Callable | None:
    """Compose the given steps in order (None: no step; one step: that function itself)."""
    steps = [step for step in steps if step is not None]
    if len(steps) <= 1:
        return steps[0] if steps else None

    def run(value):
        for step in steps:
            value = step(value)
        return value
    return run


# --- reading the schema --------------------------------------------------------------------------
_TOP_FIELDS = ('name', 'cameras', 'masked_slots', 'ignored_cameras', 'state', 'actions',
               'transform', 'norm_stats')
_STATE_FIELDS = ('dim', 'names', 'affine')
_ACTION_FIELDS = ('dim', 'names', 'space', 'step_period_s', 'rate_hz', 'open_loop_rows',
                  'delta_mask', 'affine')
_CAMERA_FIELDS = ('name', 'slot', 'resolution')


class _Reader:
    """Reads one spec mapping; every error names the source, the field and what was expected."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, field: str, message: str) -> RobotSpecError:
        return RobotSpecError(f'{self.source}: {field}: {message}')

    def mapping(self, value, field: str, fields: tuple[str, ...]) -> Mapping:
        if not isinstance(value, Mapping):
            raise self.fail(field, f'expected a mapping with {", ".join(fields)}; got '
                                   f'{_kind(value)}')
        unknown = [k for k in value if k not in fields]
        if unknown:
            raise self.fail(f'{field}.{unknown[0]}' if field else str(unknown[0]),
                            f'unknown field; expected one of {", ".join(fields)}')
        return value

    def integer(self, value, field: str, low: int = 1) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(field, f'expected an integer >= {low}; got {_kind(value)}')
        if value < low:
            raise self.fail(field, f'{value}; expected an integer >= {low}')
        return value

    def number(self, value, field: str, positive: bool = False) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(field, f'expected a number; got {_kind(value)}')
        if not math.isfinite(value) or (positive and value <= 0):
            raise self.fail(field, f'{value}; expected a finite number'
                                   + (' > 0' if positive else ''))
        return float(value)

    def names(self, value, field: str, dim: int | None, token: bool = False
              ) -> tuple[str, ...]:
        if not isinstance(value, (list, tuple)) or not all(isinstance(n, str) for n in value):
            raise self.fail(field, f'expected a list of names; got {_kind(value)}')
        if dim is not None and len(value) != dim:
            raise self.fail(field, f'{len(value)} names; expected {dim} (one per dimension)')
        empty = [i for i, n in enumerate(value) if not n.strip()]
        if empty:
            raise self.fail(f'{field}[{empty[0]}]', 'empty name; expected a non-empty name')
        seen = set()
        for name in value:
            if name in seen:
                raise self.fail(field, f'duplicate name {name!r}; expected unique names')
            seen.add(name)
            if token and not NAME_TOKEN.match(name):
                raise self.fail(field, f'{name!r}: expected a letter, then letters, digits or _ '
                                       '(it becomes a parameter and topic name)')
        return tuple(value)

    def affine(self, value, field: str, dim: int) -> Affine | None:
        if value is None:
            return None
        value = self.mapping(value, field, ('scale', 'offset'))
        parts = {}
        for key, default in (('scale', 1.0), ('offset', 0.0)):
            raw = value.get(key, [default] * dim)
            if not isinstance(raw, (list, tuple)) or len(raw) != dim:
                got = f'{len(raw)} values' if isinstance(raw, (list, tuple)) else _kind(raw)
                raise self.fail(f'{field}.{key}', f'{got}; expected {dim} numbers (one per '
                                                  'dimension)')
            parts[key] = tuple(self.number(v, f'{field}.{key}[{i}]') for i, v in enumerate(raw))
        zero = [i for i, s in enumerate(parts['scale']) if s == 0]
        if zero:
            raise self.fail(f'{field}.scale[{zero[0]}]', '0; expected a non-zero scale '
                                                         '(robot = scale * model + offset)')
        return Affine(parts['scale'], parts['offset'])


def _kind(value) -> str:
    if value is None:
        return 'nothing'
    if isinstance(value, bool):
        return f'{value} (a bool)'
    if isinstance(value, (int, float, str)):
        return f'{value!r} (a {type(value).__name__})'
    return f'a {type(value).__name__}'


def spec_from_dict(data: Any, source: str, default_name: str = '') -> RobotSpec:
    """Check one robot spec mapping (parsed YAML) and build the RobotSpec; raises RobotSpecError.

    source names the file (or what the spec came from) in every error; default_name is the
    name when the mapping has none (a file's stem).
    """
    r = _Reader(source)
    data = r.mapping(data, '', _TOP_FIELDS)
    name = data.get('name', default_name)
    if not isinstance(name, str) or not name.strip() or any(c.isspace() for c in name):
        raise r.fail('name', f'{_kind(name)}; expected a robot name without spaces')

    raw_cameras = data.get('cameras')
    if not isinstance(raw_cameras, (list, tuple)) or not raw_cameras:
        raise r.fail('cameras', f'{_kind(raw_cameras)}; expected a list of 1 to '
                                f'{len(SLOT_NAMES)} cameras, each {{name, slot}}')
    if len(raw_cameras) > len(SLOT_NAMES):
        raise r.fail('cameras', f'{len(raw_cameras)} cameras; expected at most '
                                f'{len(SLOT_NAMES)} (the model has the image slots '
                                f'{", ".join(SLOT_NAMES)})')
    cameras, resolutions, slots = [], [], {}
    for i, raw in enumerate(raw_cameras):
        where = f'cameras[{i}]'
        raw = r.mapping(raw, where, _CAMERA_FIELDS)
        (camera,) = r.names([raw.get('name')], f'{where}.name', None, token=True)
        if camera in dict(cameras):
            raise r.fail(f'{where}.name', f'duplicate camera {camera!r}; expected each camera '
                                          'once')
        slot = raw.get('slot')
        if slot not in SLOT_NAMES:
            raise r.fail(f'{where}.slot', f'unknown slot {slot!r}; expected one of '
                                          f'{", ".join(SLOT_NAMES)}')
        if slot in slots:
            raise r.fail(f'{where}.slot', f'{slot} is already filled by camera '
                                          f'{slots[slot]!r}; expected each slot once')
        slots[slot] = camera
        cameras.append((camera, slot))
        if raw.get('resolution') is not None:
            size = raw['resolution']
            if not isinstance(size, (list, tuple)) or len(size) != 2:
                raise r.fail(f'{where}.resolution', f'{_kind(size)}; expected [height, width]')
            resolutions.append((camera, tuple(r.integer(v, f'{where}.resolution')
                                              for v in size)))
    masked = tuple(s for s in SLOT_NAMES if s not in slots)
    if data.get('masked_slots') is not None:
        given = data['masked_slots']
        unknown = [s for s in given if s not in SLOT_NAMES] if isinstance(given, list) else []
        if unknown:
            raise r.fail('masked_slots', f'unknown slot {unknown[0]!r}; expected one of '
                                         f'{", ".join(SLOT_NAMES)}')
        if not isinstance(given, list) or sorted(given, key=SLOT_NAMES.index) != list(masked):
            raise r.fail('masked_slots', f'{given}; expected {list(masked)} (the slots no '
                                         'camera fills)')
    ignored = r.names(data.get('ignored_cameras') or [], 'ignored_cameras', None, token=True)
    both = [c for c in ignored if c in slots.values()]
    if both:
        raise r.fail('ignored_cameras', f'{both[0]!r} is also a camera the model uses; expected '
                                        'only cameras it does not use')

    state = r.mapping(data.get('state'), 'state', _STATE_FIELDS)
    state_dim = r.integer(state.get('dim'), 'state.dim')
    joint_names = r.names(state.get('names'), 'state.names', state_dim)
    state_affine = r.affine(state.get('affine'), 'state.affine', state_dim)

    actions = r.mapping(data.get('actions'), 'actions', _ACTION_FIELDS)
    action_dim = r.integer(actions.get('dim'), 'actions.dim')
    action_names = r.names(actions.get('names'), 'actions.names', action_dim)
    space = actions.get('space')
    if space not in ACTION_SPACES:
        raise r.fail('actions.space', f'{_kind(space)}; expected one of '
                                      f'{", ".join(ACTION_SPACES)}')
    if ('step_period_s' in actions) == ('rate_hz' in actions):
        raise r.fail('actions', 'expected exactly one of step_period_s (seconds between rows) '
                                'and rate_hz (rows per second)')
    if 'rate_hz' in actions:
        step_period_s = 1.0 / r.number(actions['rate_hz'], 'actions.rate_hz', positive=True)
    else:
        step_period_s = r.number(actions['step_period_s'], 'actions.step_period_s',
                                 positive=True)
    open_loop_rows = r.integer(actions.get('open_loop_rows'), 'actions.open_loop_rows')
    delta_mask = actions.get('delta_mask')
    if delta_mask is not None:
        if (not isinstance(delta_mask, (list, tuple))
                or not all(isinstance(v, bool) for v in delta_mask)):
            raise r.fail('actions.delta_mask', f'{_kind(delta_mask)}; expected a list of '
                                               f'{action_dim} true/false')
        if len(delta_mask) != action_dim:
            raise r.fail('actions.delta_mask', f'{len(delta_mask)} entries; expected '
                                               f'{action_dim} (one per action dimension)')
        beyond = [i for i, v in enumerate(delta_mask) if v and i >= state_dim]
        if beyond:
            raise r.fail(f'actions.delta_mask[{beyond[0]}]',
                         f'true, but the state has {state_dim} values; expected false past '
                         f'index {state_dim - 1} (a delta is relative to the same state index)')
        delta_mask = tuple(delta_mask)
    action_affine = r.affine(actions.get('affine'), 'actions.affine', action_dim)

    transform = data.get('transform')
    if transform is not None:
        if transform not in TRANSFORMS:
            raise r.fail('transform', f'unknown transform {transform!r}; expected one of '
                                      f'{", ".join(sorted(TRANSFORMS))}')
        named = TRANSFORMS[transform]
        if (state_dim, action_dim) != (named.state_dim, named.action_dim):
            raise r.fail('transform', f'{transform} is written for state {named.state_dim} / '
                                      f'actions {named.action_dim}; expected state.dim and '
                                      f'actions.dim to match (got {state_dim} / {action_dim})')
    norm_stats = data.get('norm_stats')
    if not isinstance(norm_stats, str) or not norm_stats.strip():
        raise r.fail('norm_stats', f'{_kind(norm_stats)}; expected the norm stats key '
                                   '(a checkpoint\'s assets/<key>/norm_stats.json)')
    return RobotSpec(
        name=name, cameras=tuple(cameras), state_dim=state_dim, action_dim=action_dim,
        asset_id=norm_stats, joint_names=joint_names, ignored_cameras=ignored,
        delta_action_mask=delta_mask, transform=transform, state_affine=state_affine,
        action_affine=action_affine, action_space=space, action_names=action_names,
        step_period_s=step_period_s, open_loop_rows=open_loop_rows,
        resolutions=tuple(resolutions), source=source)


def spec_from_yaml(text: str, source: str, default_name: str = '') -> RobotSpec:
    """Parse YAML text as a robot spec (raises RobotSpecError naming `source`)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise RobotSpecError(f'{source}: not valid YAML: {" ".join(str(err).split())}'
                             ) from None
    return spec_from_dict(data, source, default_name)


def load_robot_file(path: str | os.PathLike) -> RobotSpec:
    """Read a robot YAML file (raises RobotSpecError naming the file)."""
    path = Path(path).expanduser()
    try:
        stat = path.stat()
    except OSError as err:
        raise RobotSpecError(f'{path}: cannot read the robot spec: {err.strerror or err}'
                             ) from None
    return _load_cached(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _load_cached(path: str, mtime_ns: int, size: int) -> RobotSpec:
    # Keyed by modification time and size: an edited file is read again.
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise RobotSpecError(f'{path}: cannot read the robot spec: {err}') from None
    return spec_from_yaml(text, path, Path(path).stem)


# --- where the shipped robots live ---------------------------------------------------------------
def robot_dirs() -> list[Path]:
    """Folders holding the shipped robot YAMLs, first match wins.

    The source tree's config/robots (a checkout or a symlink install), then
    share/oxygen_ros/config/robots of every ament prefix and of this Python's prefix (colcon
    and pip installs).
    """
    candidates = [Path(__file__).resolve().parents[2] / ROBOTS_DIR]
    prefixes = [p for p in os.environ.get('AMENT_PREFIX_PATH', '').split(os.pathsep) if p]
    candidates += [Path(p) / 'share' / 'oxygen_ros' / ROBOTS_DIR
                   for p in [*prefixes, sys.prefix]]
    seen, dirs = set(), []
    for folder in candidates:
        if folder.is_dir() and folder.resolve() not in seen:
            seen.add(folder.resolve())
            dirs.append(folder)
    return dirs


def shipped_robots() -> dict[str, Path]:
    """Name -> YAML file of every robot under the robot folders (first folder wins)."""
    found: dict[str, Path] = {}
    for folder in robot_dirs():
        for file in sorted(folder.iterdir()):
            if file.suffix in ROBOT_FILE_SUFFIXES and file.stem not in found:
                found[file.stem] = file
    return found


def is_robot_path(value: str) -> bool:
    """Whether a `robot` value names a file (a path or *.yaml) rather than a shipped robot."""
    return '/' in value or os.sep in value or value.endswith(ROBOT_FILE_SUFFIXES)


def get_robot(robot: str | RobotSpec) -> RobotSpec:
    """Resolve a robot: a RobotSpec, a shipped robot's name, or the path of a robot YAML."""
    if isinstance(robot, RobotSpec):
        return robot
    if not isinstance(robot, str) or not robot:
        raise RobotSpecError(f'robot {robot!r}: expected a robot name or the path of a robot '
                             'YAML file')
    if is_robot_path(robot):
        return load_robot_file(robot)
    shipped = shipped_robots()
    if robot not in shipped:
        where = ', '.join(str(d) for d in robot_dirs()) or f'no {ROBOTS_DIR} folder found'
        raise RobotSpecError(f'unknown robot {robot!r}; expected one of '
                             f'{", ".join(sorted(shipped))} (in {where}) or the path of a '
                             'robot YAML file')
    return load_robot_file(shipped[robot])


# --- writing -------------------------------------------------------------------------------------
def spec_to_dict(spec: RobotSpec) -> dict:
    """Return the YAML mapping of a spec; spec_from_dict reads it back to an equal spec."""
    resolutions = dict(spec.resolutions)
    cameras = []
    for camera, slot in spec.cameras:
        entry = {'name': camera, 'slot': slot}
        if camera in resolutions:
            entry['resolution'] = list(resolutions[camera])
        cameras.append(entry)
    state = {'dim': spec.state_dim, 'names': list(spec.joint_names)}
    if spec.state_affine is not None:
        state['affine'] = _affine_dict(spec.state_affine)
    actions = {'dim': spec.action_dim, 'names': list(spec.action_names),
               'space': spec.action_space}
    rate = round(1.0 / spec.step_period_s, 6)
    if 1.0 / rate == spec.step_period_s:
        actions['rate_hz'] = int(rate) if rate == int(rate) else rate
    else:
        actions['step_period_s'] = spec.step_period_s
    actions['open_loop_rows'] = spec.open_loop_rows
    if spec.delta_action_mask is not None:
        actions['delta_mask'] = list(spec.delta_action_mask)
    if spec.action_affine is not None:
        actions['affine'] = _affine_dict(spec.action_affine)
    data = {'name': spec.name, 'cameras': cameras, 'masked_slots': list(spec.masked_slots)}
    if spec.ignored_cameras:
        data['ignored_cameras'] = list(spec.ignored_cameras)
    data.update({'state': state, 'actions': actions})
    if spec.transform:
        data['transform'] = spec.transform
    data['norm_stats'] = spec.asset_id
    return data


def _affine_dict(affine: Affine) -> dict:
    return {'scale': list(affine.scale), 'offset': list(affine.offset)}


def _flow(value, indent: int, width: int = 99) -> str:
    """One value in YAML flow style; long lists wrap under their opening bracket."""
    if isinstance(value, dict):
        return '{' + ', '.join(f'{k}: {_flow(v, indent)}' for k, v in value.items()) + '}'
    if not isinstance(value, list):
        text = yaml.safe_dump(value, default_flow_style=True, width=1 << 16)
        return text.removesuffix('\n').removesuffix('\n...').strip()
    items = [_flow(v, indent) for v in value]
    lines, line = [], '['
    for i, item in enumerate(items):
        piece = item + (', ' if i < len(items) - 1 else ']')
        used = len(line) + (indent if not lines else 0)   # later lines hold their indent
        if used + len(piece.rstrip()) > width and line.strip('[ '):
            lines.append(line.rstrip())
            line = ' ' * (indent + 1)
        line += piece
    if not items:
        line += ']'
    lines.append(line)
    return '\n'.join(lines)


def spec_to_yaml(spec: RobotSpec, comments: tuple[str, ...] = ()) -> str:
    """Write the spec as a readable YAML text (block mappings, flow lists), comments on top."""
    out = []
    for line in comments:
        lead = ' ' * (len(line) - len(line.lstrip()))
        out += [f'# {part}' for part in textwrap.wrap(
            line.lstrip(), 97, initial_indent=lead, subsequent_indent=lead + '  ')] or ['#']
    data = spec_to_dict(spec)
    for key, value in data.items():
        if key == 'cameras':
            out.append('cameras:')
            out += [f'  - {_flow(camera, 4)}' for camera in value]
        elif isinstance(value, dict):
            out.append(f'{key}:')
            for field, item in value.items():
                prefix = f'  {field}: '
                out.append(prefix + _flow(item, len(prefix)))
        else:
            prefix = f'{key}: '
            out.append(prefix + _flow(value, len(prefix)))
    return '\n'.join(out) + '\n'


# --- fit to a model ------------------------------------------------------------------------------
def check_fits_model(spec: RobotSpec, action_dim: int, num_slots: int) -> None:
    """Raise RobotSpecError when the spec cannot run on a model of these sizes.

    openpi zero-pads state and actions to the model's action_dim, so neither may exceed it.
    """
    for field, dim in (('state.dim', spec.state_dim), ('actions.dim', spec.action_dim)):
        if dim > action_dim:
            raise RobotSpecError(f'{spec.where}: {field}: {dim}; expected <= {action_dim} (the '
                                 "model's action_dim; openpi zero-pads state and actions to it)")
    if num_slots != len(SLOT_NAMES):
        raise RobotSpecError(f'{spec.where}: cameras: the model has {num_slots} image slots; '
                             f'expected {len(SLOT_NAMES)} ({", ".join(SLOT_NAMES)})')


def check_norm_stats(spec: RobotSpec, stats: Mapping, model_action_dim: int,
                     where: str = '') -> None:
    """Raise RobotSpecError unless `stats` ({'state', 'actions'} NormStats) fit the spec.

    Each set covers the robot's dims, or the model's padded width (openpi cuts longer state
    statistics and leaves padded action columns as they are).
    """
    origin = f' ({where})' if where else ''
    for key, field, dim in (('state', 'state.dim', spec.state_dim),
                            ('actions', 'actions.dim', spec.action_dim)):
        if key not in stats:
            raise RobotSpecError(f'{spec.where}: norm_stats: {spec.asset_id!r}{origin} has no '
                                 f'{key!r} statistics; expected state and actions')
        found = stats[key].dim
        if found not in (dim, model_action_dim):
            raise RobotSpecError(f'{spec.where}: {field}: {dim}, but norm stats '
                                 f'{spec.asset_id!r}{origin} have {found} {key} values; '
                                 f'expected {dim} (or the padded {model_action_dim})')
