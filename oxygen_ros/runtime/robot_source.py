"""Robot specs read from what a user has: a LeRobot π0.5 checkpoint or a LeRobot dataset folder.

What `oxygen-ros robot-spec --from PATH` prints and what `oxygen-ros replay DATASET` runs with
when no robot is given. Only the small JSON files are read (config.json, meta/info.json); the
mapping of LeRobot features onto a spec is oxygen_ros.model.lerobot_spec.
"""

from __future__ import annotations

import json
from pathlib import Path

from oxygen_ros.model.lerobot_spec import (InferredSpec, spec_from_lerobot_checkpoint,
                                           spec_from_lerobot_dataset)
from oxygen_ros.model.robot_spec import RobotSpecError, spec_to_yaml

DATASET_INFO = Path('meta') / 'info.json'
CHECKPOINT_CONFIG = 'config.json'


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RobotSpecError(f'{file}: cannot read: {err}') from None
    if not isinstance(data, dict):
        raise RobotSpecError(f'{file}: expected a JSON object')
    return data


def dataset_robot(info: dict, root: str | Path) -> InferredSpec:
    """Read the robot of a LeRobot dataset from its info.json (raises RobotSpecError)."""
    root = Path(root)
    return spec_from_lerobot_dataset(info, str(root / DATASET_INFO), root.resolve().name)


def infer_robot(path: str | Path) -> InferredSpec:
    """Read the robot of a LeRobot dataset folder or LeRobot π0.5 checkpoint folder.

    Raises RobotSpecError saying what the folder is missing.
    """
    path = Path(path).expanduser()
    if (path / DATASET_INFO).is_file():
        return dataset_robot(_read_json(path / DATASET_INFO), path)
    config = path / CHECKPOINT_CONFIG
    if not config.is_file():
        raise RobotSpecError(f'{path}: neither a LeRobot dataset ({DATASET_INFO}) nor a '
                             f'checkpoint ({CHECKPOINT_CONFIG}); expected one of them')
    data = _read_json(config)
    if 'input_features' not in data:
        raise RobotSpecError(f'{config}: no input_features (an openpi checkpoint does not '
                             'describe its robot); expected a LeRobot π0.5 checkpoint, or '
                             'write the robot YAML (docs/robots.md)')
    return spec_from_lerobot_checkpoint(data, str(config), path.resolve().name)


def inferred_yaml(inferred: InferredSpec) -> str:
    """Write an inferred spec as YAML to review, what was assumed in its comments."""
    comments = [f'Robot spec read from {inferred.spec.source} (oxygen-ros robot-spec).',
                'Review it, keep it, and pass its path as the node parameter `robot`.',
                'Cameras fill the model\'s image slots in the order the file lists them:']
    comments += [f'  {camera} <- {feature}' for camera, feature in inferred.features.items()]
    if inferred.assumed:
        comments.append('Assumed (the file does not say):')
        comments += [f'  {line}' for line in inferred.assumed]
    return spec_to_yaml(inferred.spec, tuple(comments))
