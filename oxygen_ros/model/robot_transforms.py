"""Numeric robot <-> model conversions a robot spec names: delta actions, affine maps, named ones.

All work on unnormalised float64 numpy values (no torch), in the order openpi applies them:

    state    robot units --affine--> --named transform--> model units --normalise--> model
    actions  model --unnormalise--> --absolute (deltas + state)--> [:action dim]
             --named transform--> --affine--> robot units

Delta actions follow openpi's DeltaActions / AbsoluteActions (transforms.py): the masked action
columns are trained as offsets from the current state, in the model's joint space.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np


# --- openpi's delta / absolute action transforms -------------------------------------------------
def delta_actions(actions: np.ndarray, state: np.ndarray, mask: Sequence[bool]) -> np.ndarray:
    """Absolute actions [..., H, A] -> deltas from the state [..., S] on the masked columns."""
    mask = np.asarray(mask, dtype=bool)
    n = mask.shape[-1]
    out = np.array(actions, dtype=np.float64)
    out[..., :n] -= np.expand_dims(np.where(mask, np.asarray(state)[..., :n], 0.0), axis=-2)
    return out


def absolute_actions(actions: np.ndarray, state: np.ndarray, mask: Sequence[bool]) -> np.ndarray:
    """Deltas [..., H, A] -> absolute actions: the state [..., S] added on the masked columns."""
    mask = np.asarray(mask, dtype=bool)
    n = mask.shape[-1]
    out = np.array(actions, dtype=np.float64)
    out[..., :n] += np.expand_dims(np.where(mask, np.asarray(state)[..., :n], 0.0), axis=-2)
    return out


# --- per-dimension affine maps -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Affine:
    """Per-dimension map between robot and model units: robot = scale * model + offset."""

    scale: tuple[float, ...]
    offset: tuple[float, ...]

    @property
    def dim(self) -> int:
        return len(self.scale)

    def to_model(self, robot: np.ndarray) -> np.ndarray:
        """Robot values [..., D] -> model units."""
        return (np.asarray(robot, dtype=np.float64) - np.asarray(self.offset)) / np.asarray(
            self.scale)

    def to_robot(self, model: np.ndarray) -> np.ndarray:
        """Model values [..., D] -> robot units."""
        return np.asarray(self.scale) * np.asarray(model, dtype=np.float64) + np.asarray(
            self.offset)


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


# --- named transforms (what a robot YAML's `transform:` refers to) -----------------------------
@dataclasses.dataclass(frozen=True)
class NamedTransform:
    """A nonlinear robot <-> model conversion a spec references by name."""

    name: str
    state_to_model: Callable[[np.ndarray], np.ndarray]     # robot state [S] -> model [S]
    actions_from_model: Callable[[np.ndarray], np.ndarray]  # model [H, A] -> robot [H, A]
    actions_to_model: Callable[[np.ndarray], np.ndarray]    # its inverse (real-time chunking)
    state_dim: int                                         # the dims it is written for
    action_dim: int
    about: str


TRANSFORMS: dict[str, NamedTransform] = {t.name: t for t in (
    NamedTransform('aloha_adapt_to_pi', aloha_state_to_pi, aloha_actions_from_pi,
                   aloha_actions_to_pi, 14, 14,
                   "openpi's ALOHA adapt_to_pi: joint flips and the gripper's linear <-> "
                   'angular conversion (AlohaInputs / AlohaOutputs)'),
)}
