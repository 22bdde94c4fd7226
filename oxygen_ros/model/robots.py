"""Per-robot input/output adapter: a RobotSpec (model/robot_spec.py) applied to observations.

Input: a plain observation (camera name -> uint8 HxWx3 image, state vector, prompt text).
Output of `RobotAdapter.prepare`: what `Pi05Model.prefill` takes for one row. The output side
turns the model's normalised [H, action_dim] actions back into robot units. The built-in
specs (config/robots/libero.yaml, droid.yaml, aloha.yaml) follow openpi's policies/*_policy.py.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np
from PIL import Image
import torch

from .normalize import normalize, NormStats, unnormalize
from .robot_spec import (ACTION_SPACES, BUILTIN_ROBOTS, check_fits_model, END_EFFECTOR_DELTA,
                         get_robot, JOINT_POSITION, JOINT_VELOCITY, RobotSpec, SLOT_NAMES)
from .robot_transforms import (absolute_actions, aloha_actions_from_pi, aloha_state_to_pi,
                               delta_actions)
from .tokenizer import PaligemmaTokenizer

__all__ = ['ACTION_SPACES', 'aloha_actions_from_pi', 'aloha_state_to_pi', 'collate',
           'END_EFFECTOR_DELTA', 'get_robot', 'image_to_model', 'JOINT_POSITION',
           'JOINT_VELOCITY', 'ModelInputs', 'resize_with_pad', 'RobotAdapter', 'ROBOTS',
           'RobotSpec', 'SLOT_NAMES']

# The built-in robots (config/robots/<name>.yaml), read once.
ROBOTS: dict[str, RobotSpec] = {name: get_robot(name) for name in BUILTIN_ROBOTS}


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
        check_fits_model(spec, action_dim, num_slots)
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
        """Return the state deltas are relative to (float64 [action_dim]; None: no deltas).

        openpi's delta base is the padded state in the model's joint space, unnormalised.
        """
        if self.spec.delta_action_mask is None:
            return None
        if inputs is None:
            raise ValueError(f'{self.spec.name}: delta actions need the ModelInputs of the row')
        state = np.zeros(self.action_dim)
        state[:self.spec.state_dim] = inputs.model_state
        return state

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
        base = self._delta_base(inputs)                                   # [action_dim]|None
        if base is not None:
            out = absolute_actions(out, base, spec.delta_action_mask)
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
        base = self._delta_base(inputs)                                   # [action_dim]|None
        if base is not None:
            actions = delta_actions(actions, base, spec.delta_action_mask)
        out = np.zeros((actions.shape[0], self.action_dim), np.float32)
        out[:, :spec.action_dim] = normalize(actions, self.action_stats, self.use_quantiles,
                                             what=f'{spec.name} committed actions')
        return out
