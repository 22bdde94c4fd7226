"""Per-robot input/output adapters (libero, droid, aloha) as a small table of RobotSpecs.

Input: a plain observation (camera name -> uint8 HxWx3 image, state vector, prompt text).
Output of `RobotAdapter.prepare`: what `Pi05Model.prefill` takes for one row. The output side
turns the model's normalised [H, action_dim] actions back into robot units.
Camera names, slot masks, dims and the aloha conversions follow openpi's policies/*_policy.py.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import numpy as np
from PIL import Image
import torch

from .normalize import normalize, NormStats, unnormalize
from .tokenizer import PaligemmaTokenizer

# The model's three image slots, in order.
SLOT_NAMES = ('base_0_rgb', 'left_wrist_0_rgb', 'right_wrist_0_rgb')


# --- aloha <-> pi joint space (openpi AlohaInputs/AlohaOutputs with adapt_to_pi=True) ----------
_ALOHA_JOINT_FLIP = np.array([1, -1, -1, 1, 1, 1, 1, 1, -1, -1, 1, 1, 1, 1], dtype=np.float64)
_ALOHA_GRIPPERS = [6, 13]  # state/action layout: [left arm 6, left grip, right arm 6, right grip]


def _aloha_gripper_to_pi(lin: np.ndarray) -> np.ndarray:
    """Aloha's linear gripper position (normalised) -> pi's normalised angular position."""
    # Puppet gripper open/closed positions (metres) undo Aloha's normalisation.
    pos = lin * (0.05800 - 0.01844) + 0.01844
    # Interbotix linear -> angle (arm length 0.036 m, horn radius 0.022 m).
    arm, horn = 0.036, 0.022
    angle = np.arcsin(np.clip((horn ** 2 + pos ** 2 - arm ** 2) / (2 * horn * pos), -1.0, 1.0))
    # pi's gripper is normalised between these angles (encoder counts 2405..3110).
    return (angle - 0.5476) / (1.6296 - 0.5476)


def _aloha_gripper_from_pi(value: np.ndarray) -> np.ndarray:
    """Pi's gripper output -> Aloha's normalised puppet gripper joint position."""
    return (value + 0.5476 - (-0.6213)) / (1.4910 - (-0.6213))


def _aloha_gripper_to_pi_output(value: np.ndarray) -> np.ndarray:
    """Inverse of _aloha_gripper_from_pi: Aloha's gripper command -> pi's gripper output."""
    return value * (1.4910 - (-0.6213)) - 0.5476 + (-0.6213)


def aloha_state_to_pi(state: np.ndarray) -> np.ndarray:
    """Aloha state [14] -> the joint space the π models were trained in."""
    state = _ALOHA_JOINT_FLIP * state
    state[_ALOHA_GRIPPERS] = _aloha_gripper_to_pi(state[_ALOHA_GRIPPERS])
    return state


def aloha_actions_from_pi(actions: np.ndarray) -> np.ndarray:
    """Model-space actions [H, 14] -> Aloha joint commands [H, 14]."""
    actions = _ALOHA_JOINT_FLIP * actions
    actions[:, _ALOHA_GRIPPERS] = _aloha_gripper_from_pi(actions[:, _ALOHA_GRIPPERS])
    return actions


def aloha_actions_to_pi(actions: np.ndarray) -> np.ndarray:
    """Aloha joint commands [H, 14] -> model-space actions [H, 14] (aloha_actions_from_pi⁻¹)."""
    actions = _ALOHA_JOINT_FLIP * actions
    actions[:, _ALOHA_GRIPPERS] = _aloha_gripper_to_pi_output(actions[:, _ALOHA_GRIPPERS])
    return actions


# --- the table -----------------------------------------------------------------------------------
# What one row of a robot's action chunk means (ActionChunk.action_space has one constant each).
JOINT_POSITION = 'joint_position'            # absolute joint positions
JOINT_VELOCITY = 'joint_velocity'            # joint velocities (rad/s)
END_EFFECTOR_DELTA = 'end_effector_delta'    # end-effector delta pose + gripper
ACTION_SPACES = (JOINT_POSITION, JOINT_VELOCITY, END_EFFECTOR_DELTA)


@dataclasses.dataclass(frozen=True)
class RobotSpec:
    """How one robot's observation maps onto the model and back."""

    name: str
    cameras: tuple[tuple[str, str], ...]  # (observation camera name, model slot); all required
    state_dim: int
    action_dim: int
    asset_id: str                          # default norm stats under assets/<asset_id>/
    horizon: int = 10                      # action rows per chunk in the paper's workloads
    # The robot's usual JointState names, one per state entry, in state order.
    joint_names: tuple[str, ...] = ()
    ignored_cameras: tuple[str, ...] = ()  # accepted in observations but not fed to the model
    # Joints whose actions are deltas w.r.t. the current state (openpi AbsoluteActions).
    delta_action_mask: tuple[bool, ...] | None = None
    # Robot <-> model joint-space conversions on unnormalised values (None: identity).
    state_to_model: Callable[[np.ndarray], np.ndarray] | None = None
    actions_from_model: Callable[[np.ndarray], np.ndarray] | None = None
    actions_to_model: Callable[[np.ndarray], np.ndarray] | None = None   # its inverse
    # What the robot's controller does with a row (openpi's clients and the training data):
    action_space: str = JOINT_POSITION     # one of ACTION_SPACES
    action_names: tuple[str, ...] = ()     # one per action column
    step_period_s: float = 0.1             # time between rows (the data's control period)
    open_loop_rows: int = 5                # rows openpi's client plays before it replans

    @property
    def camera_names(self) -> tuple[str, ...]:
        """Observation camera names the model uses, in slot order."""
        return tuple(cam for cam, _ in self.cameras)


ROBOTS: dict[str, RobotSpec] = {
    spec.name: spec for spec in (
        RobotSpec('libero', cameras=(('image', 'base_0_rgb'),
                                     ('wrist_image', 'left_wrist_0_rgb')),
                  state_dim=8, action_dim=7, asset_id='physical-intelligence/libero',
                  joint_names=('eef_x', 'eef_y', 'eef_z', 'eef_rx', 'eef_ry', 'eef_rz',
                               'gripper_left_finger', 'gripper_right_finger'),
                  # LIBERO's OSC controller: delta position, delta axis-angle, gripper (-1
                  # open, +1 closed); the simulator steps at 20 Hz, openpi replans every 5.
                  action_space=END_EFFECTOR_DELTA,
                  action_names=('eef_dx', 'eef_dy', 'eef_dz', 'eef_drx', 'eef_dry', 'eef_drz',
                                'gripper'),
                  step_period_s=0.05, open_loop_rows=5),
        RobotSpec('droid', cameras=(('exterior_image_1_left', 'base_0_rgb'),
                                    ('wrist_image_left', 'left_wrist_0_rgb')),
                  state_dim=8, action_dim=8, asset_id='droid',   # joints 7 + gripper 1
                  joint_names=tuple(f'panda_joint{i}' for i in range(1, 8))
                  + ('panda_finger_joint1',),
                  # DROID's joint-velocity action space at 15 Hz; the gripper column is a
                  # position in [0, 1]. openpi's DROID client plays 8 rows open loop.
                  action_space=JOINT_VELOCITY,
                  action_names=tuple(f'panda_joint{i}' for i in range(1, 8))
                  + ('panda_finger_joint1',),
                  step_period_s=1.0 / 15.0, open_loop_rows=8),
        RobotSpec('aloha', cameras=(('cam_high', 'base_0_rgb'),
                                    ('cam_left_wrist', 'left_wrist_0_rgb'),
                                    ('cam_right_wrist', 'right_wrist_0_rgb')),
                  ignored_cameras=('cam_low',), state_dim=14, action_dim=14, asset_id='trossen',
                  joint_names=tuple(f'{side}_{joint}' for side in ('left', 'right')
                                    for joint in ('waist', 'shoulder', 'elbow', 'forearm_roll',
                                                  'wrist_angle', 'wrist_rotate', 'gripper')),
                  delta_action_mask=(True,) * 6 + (False,) + (True,) * 6 + (False,),
                  state_to_model=aloha_state_to_pi, actions_from_model=aloha_actions_from_pi,
                  actions_to_model=aloha_actions_to_pi,
                  # Absolute joint positions (the deltas are added back above) at ALOHA's
                  # 50 Hz; openpi's ALOHA runtime plays 25 rows per chunk.
                  action_space=JOINT_POSITION,
                  action_names=tuple(f'{side}_{joint}' for side in ('left', 'right')
                                     for joint in ('waist', 'shoulder', 'elbow', 'forearm_roll',
                                                   'wrist_angle', 'wrist_rotate', 'gripper')),
                  step_period_s=0.02, open_loop_rows=25),
    )
}


def get_robot(name: str) -> RobotSpec:
    """Return the RobotSpec called `name` (see ROBOTS)."""
    try:
        return ROBOTS[name]
    except KeyError:
        raise ValueError(f'unknown robot {name!r}; expected one of {sorted(ROBOTS)}') from None


# --- images --------------------------------------------------------------------------------------
def resize_with_pad(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Resize uint8 [h, w, 3] to [height, width, 3] keeping aspect ratio, padding with black.

    Same as openpi's client-side resize (PIL bilinear, image centred, extra pixel of odd
    padding at the bottom/right); an image already of the target size is returned unchanged.
    """
    cur_h, cur_w = image.shape[:2]
    if (cur_h, cur_w) == (height, width):
        return image
    ratio = max(cur_w / width, cur_h / height)
    new_h, new_w = int(cur_h / ratio), int(cur_w / ratio)
    resized = np.asarray(Image.fromarray(image).resize((new_w, new_h),
                                                       resample=Image.BILINEAR))
    out = np.zeros((height, width, image.shape[2]), dtype=np.uint8)
    top, left = (height - new_h) // 2, (width - new_w) // 2
    out[top:top + new_h, left:left + new_w] = resized
    return out


def image_to_model(image: np.ndarray) -> np.ndarray:
    """uint8 [H, W, 3] -> float32 [3, H, W] in [-1, 1]."""
    return (image.astype(np.float32) / 255.0 * 2.0 - 1.0).transpose(2, 0, 1)


# --- adapter -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelInputs:
    """One observation prepared for the model (one row of a prefill batch)."""

    images: np.ndarray       # float32 [N, 3, S, S] in [-1, 1]; masked slots are -1 (black)
    image_masks: np.ndarray  # bool [N]
    tokens: np.ndarray       # int32 [L] right padded with 0
    token_masks: np.ndarray  # bool [L]
    state: np.ndarray        # float32 [action_dim] normalised, zero padded
    model_state: np.ndarray  # float64 [state_dim] unnormalised, model joint space (delta base)


def collate(rows: Sequence[ModelInputs], device: torch.device | str | None = None
            ) -> dict[str, torch.Tensor]:
    """Stack rows into prefill's keyword arguments: images, image_masks, tokens, token_masks."""
    if not rows:
        raise ValueError('collate needs at least one row')
    return {
        'images': torch.from_numpy(np.stack([r.images for r in rows])).to(device),
        'image_masks': torch.from_numpy(np.stack([r.image_masks for r in rows])).to(device),
        'tokens': torch.from_numpy(np.stack([r.tokens for r in rows]).astype(np.int64)).to(device),
        'token_masks': torch.from_numpy(np.stack([r.token_masks for r in rows])).to(device),
    }


class RobotAdapter:
    """Turns one robot's observations into model inputs and model actions into robot actions."""

    def __init__(self, spec: RobotSpec, norm_stats: Mapping[str, NormStats],
                 tokenizer: PaligemmaTokenizer, *, action_dim: int = 32, image_size: int = 224,
                 num_slots: int = 3, discrete_state: bool = True, use_quantiles: bool = True):
        for key in ('state', 'actions'):
            if key not in norm_stats:
                raise ValueError(f'{spec.name}: norm stats lack {key!r} '
                                 f'(have {sorted(norm_stats)})')
        if num_slots != len(SLOT_NAMES):
            raise ValueError(f'{spec.name}: the model has {num_slots} image slots, '
                             f'adapters fill {len(SLOT_NAMES)} ({", ".join(SLOT_NAMES)})')
        if max(spec.state_dim, spec.action_dim) > action_dim:
            raise ValueError(f'{spec.name}: state {spec.state_dim} / action {spec.action_dim} '
                             f'dims exceed the model action_dim {action_dim}')
        self.spec = spec
        self.state_stats = norm_stats['state']
        self.action_stats = norm_stats['actions']
        self.tokenizer = tokenizer
        self.action_dim = action_dim
        self.image_size = image_size
        self.discrete_state = discrete_state
        self.use_quantiles = use_quantiles

    @classmethod
    def from_config(cls, spec: RobotSpec, config, norm_stats: Mapping[str, NormStats],
                    tokenizer: PaligemmaTokenizer, use_quantiles: bool = True) -> RobotAdapter:
        """Build an adapter whose sizes come from a Pi05Config."""
        if tokenizer.max_len != config.max_token_len:
            raise ValueError(f'tokenizer max_len {tokenizer.max_len} != config max_token_len '
                             f'{config.max_token_len}')
        if tokenizer.vocab_size > config.backbone.vocab_size:
            raise ValueError(f'tokenizer vocab {tokenizer.vocab_size} > model vocab '
                             f'{config.backbone.vocab_size}')
        return cls(spec, norm_stats, tokenizer, action_dim=config.action_dim,
                   image_size=config.vision.image_size, num_slots=config.num_cameras,
                   discrete_state=config.discrete_state_input, use_quantiles=use_quantiles)

    # -- input side --
    def _check_image(self, camera: str, image) -> np.ndarray:
        where = f'{self.spec.name}: camera {camera!r}'
        if not isinstance(image, np.ndarray):
            raise ValueError(f'{where}: expected a uint8 HxWx3 numpy array, '
                             f'got {type(image).__name__}')
        if image.dtype != np.uint8:
            raise ValueError(f'{where}: expected dtype uint8, got {image.dtype}')
        if image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f'{where}: expected shape HxWx3 (channels last, RGB), '
                             f'got {image.shape}')
        if image.shape[0] == 0 or image.shape[1] == 0:
            raise ValueError(f'{where}: empty image {image.shape}')
        return image

    def _check_cameras(self, images: Mapping[str, np.ndarray]) -> None:
        spec = self.spec
        expected = ', '.join(spec.camera_names)
        got = ', '.join(images) or 'none'
        for camera in spec.camera_names:
            if camera not in images:
                raise ValueError(f'{spec.name}: missing camera {camera!r} '
                                 f'(expected {expected}; got {got})')
        for camera in images:
            if camera not in spec.camera_names and camera not in spec.ignored_cameras:
                raise ValueError(f'{spec.name}: unknown camera {camera!r} '
                                 f'(expected {expected}; got {got})')

    def _check_state(self, state) -> np.ndarray:
        where = f'{self.spec.name}: state'
        try:
            arr = np.asarray(state, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(f'{where}: expected {self.spec.state_dim} numbers, '
                             f'got {type(state).__name__}') from None
        if arr.ndim != 1 or arr.shape[0] != self.spec.state_dim:
            raise ValueError(f'{where}: expected {self.spec.state_dim} values, '
                             f'got shape {arr.shape}')
        bad = np.flatnonzero(~np.isfinite(arr))
        if bad.size:
            raise ValueError(f'{where}: NaN or inf at index {bad.tolist()}')
        return arr

    def prepare(self, images: Mapping[str, np.ndarray], state, prompt: str) -> ModelInputs:
        """Validate one observation and build the model inputs for it."""
        spec, size = self.spec, self.image_size
        if not isinstance(images, Mapping):
            raise ValueError(f'{spec.name}: images must be a mapping camera name -> image, '
                             f'got {type(images).__name__}')
        self._check_cameras(images)
        if not isinstance(prompt, str):
            raise ValueError(f'{spec.name}: prompt: expected str, got {type(prompt).__name__}')
        raw_state = self._check_state(state)

        slot_images = np.full((len(SLOT_NAMES), 3, size, size), -1.0, np.float32)  # [N,3,S,S]
        slot_masks = np.zeros(len(SLOT_NAMES), dtype=bool)  # [N]
        for camera, slot in spec.cameras:
            image = self._check_image(camera, images[camera])
            i = SLOT_NAMES.index(slot)
            slot_images[i] = image_to_model(resize_with_pad(image, size, size))
            slot_masks[i] = True

        model_state = raw_state.copy()
        if spec.state_to_model is not None:
            with np.errstate(all='ignore'):
                model_state = spec.state_to_model(model_state)
            if not np.all(np.isfinite(model_state)):
                raise ValueError(f'{spec.name}: state {raw_state.tolist()} is outside the range '
                                 'the joint-space conversion accepts')
        norm_state = normalize(model_state, self.state_stats, self.use_quantiles,
                               what=f'{spec.name} state', dtype=np.float64)  # [state_dim]
        # openpi tokenises the unpadded float64 normalised state (bins are exact at the
        # edges), then pads it to the model width.
        tokens, token_masks = self.tokenizer.encode_prompt(
            prompt, norm_state if self.discrete_state else None)
        padded = np.zeros(self.action_dim, dtype=np.float32)
        padded[:spec.state_dim] = norm_state
        return ModelInputs(images=slot_images, image_masks=slot_masks, tokens=tokens,
                           token_masks=token_masks, state=padded, model_state=model_state)

    # -- output side --
    def _matrix(self, actions, width: int, what: str, rows: str) -> np.ndarray:
        """Return `actions` as float64 [rows, width]; ValueError naming what is wrong."""
        actions = np.asarray(actions, dtype=np.float64)
        if actions.ndim != 2 or actions.shape[1] != width:
            raise ValueError(f'{self.spec.name}: {what}: expected [{rows}, {width}], '
                             f'got {tuple(actions.shape)}')
        if not np.all(np.isfinite(actions)):
            raise ValueError(f'{self.spec.name}: {what} contain NaN or inf')
        return actions

    def _delta_base(self, inputs: ModelInputs | None) -> np.ndarray | None:
        """Return the state the delta columns are relative to ([k]; None: no delta actions)."""
        mask = self.spec.delta_action_mask
        if mask is None:
            return None
        if inputs is None:
            raise ValueError(f'{self.spec.name}: delta actions need the ModelInputs of the row')
        mask = np.asarray(mask)
        return np.where(mask, inputs.model_state[:mask.size], 0.0)

    def postprocess(self, actions, inputs: ModelInputs | None = None) -> np.ndarray:
        """Model actions [H, action_dim] (normalised) -> robot actions float32 [H, robot dim].

        inputs (the row's ModelInputs) is needed by robots with delta actions (aloha).
        """
        spec = self.spec
        if isinstance(actions, torch.Tensor):
            actions = actions.detach().to('cpu', torch.float32).numpy()
        actions = self._matrix(actions, self.action_dim, 'actions', 'H')
        # openpi order: unnormalise the full width, make deltas absolute, slice, convert.
        out = unnormalize(actions, self.action_stats, self.use_quantiles,
                          what=f'{spec.name} actions', dtype=np.float64)  # [H, action_dim]
        base = self._delta_base(inputs)                                   # [k] or None
        if base is not None:
            out[:, :base.size] += base
        out = out[:, :spec.action_dim]
        if spec.actions_from_model is not None:
            out = spec.actions_from_model(out)
        return out.astype(np.float32)

    def model_actions(self, actions, inputs: ModelInputs | None = None) -> np.ndarray:
        """Robot actions [n, robot dim] -> normalised model actions float32 [n, action_dim].

        The inverse of postprocess (a chunk the robot executes, as the model would have
        written it for the observation `inputs`): joint-space conversion undone, deltas taken
        w.r.t. this observation's state, normalised; the padding columns are 0, as in
        training (openpi pads normalised actions with zeros).
        """
        spec = self.spec
        actions = self._matrix(actions, spec.action_dim, 'committed actions', 'n').copy()
        if spec.actions_to_model is not None:
            actions = spec.actions_to_model(actions)
        base = self._delta_base(inputs)                                   # [k] or None
        if base is not None:
            actions[:, :base.size] -= base
        out = np.zeros((actions.shape[0], self.action_dim), np.float32)
        out[:, :spec.action_dim] = normalize(actions, self.action_stats, self.use_quantiles,
                                             what=f'{spec.name} committed actions')
        return out
