"""LeRobot π0.5 checkpoints: the folder LeRobot's `save_pretrained` writes for `type: pi05`.

A LeRobot π0.5 folder:
  config.json                       {"type": "pi05", paligemma_variant, action_expert_variant,
                                     chunk_size, max_action_dim, num_inference_steps,
                                     tokenizer_max_length, ...}
  model.safetensors                 openpi's parameter names under LeRobot's module prefix
                                    `model.` (the policy wraps the PyTorch π0.5 as `.model`)
  policy_preprocessor.json          processor pipeline; its normalizer step names a state file
  policy_preprocessor_step_<i>_normalizer_processor.safetensors
                                    flat statistics: 'observation.state.q01', ...
  policy_postprocessor.json         its unnormalizer step names the action statistics file
  policy_postprocessor_step_<i>_unnormalizer_processor.safetensors   'action.q01', ...
The tokenizer is named, not shipped (the preprocessor's tokenizer step: tokenizer_name
'google/paligemma-3b-pt-224'): its SentencePiece `tokenizer.model` is looked up in the folder,
then in the Hugging Face hub cache. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

from safetensors import safe_open

from .normalize import NormStats, NormStatsError

CONFIG_TYPE = 'pi05'
KEY_PREFIX = 'model.'                       # LeRobot's PI05Policy holds the model as `.model`
PREPROCESSOR_FILE = 'policy_preprocessor.json'
POSTPROCESSOR_FILE = 'policy_postprocessor.json'
NORMALIZER_STEP = 'normalizer_processor'
UNNORMALIZER_STEP = 'unnormalizer_processor'
TOKENIZER_STEP = 'tokenizer_processor'
STATE_KEY = 'observation.state'             # LeRobot feature names -> our norm stats keys
ACTION_KEY = 'action'
ASSET_ID = 'lerobot'                        # norm stats key in LoadedPolicy.norm_stats
DEFAULT_TOKENIZER_NAME = 'google/paligemma-3b-pt-224'

# config.json field -> Pi05Config field (the rest of LeRobot's fields do not change the model)
CONFIG_FIELDS = {'chunk_size': 'action_horizon', 'max_action_dim': 'action_dim',
                 'tokenizer_max_length': 'max_token_len', 'num_inference_steps': 'num_steps'}


class LeRobotCheckpointError(ValueError):
    """A LeRobot π0.5 folder lacks a file or a field; the message names it and its role."""


def is_lerobot_config(data: Mapping) -> bool:
    """Whether a config.json's contents are a LeRobot policy config (it has "type")."""
    return isinstance(data, Mapping) and 'type' in data


def check_type(data: Mapping, where: str) -> None:
    """Raise unless the LeRobot config is a π0.5 one."""
    if data.get('type') != CONFIG_TYPE:
        raise LeRobotCheckpointError(
            f'{where}: LeRobot policy type {data.get("type")!r}; only "pi05" is supported '
            '(pi0 has a state projection and no adaRMSNorm)')


def config_fields(data: Mapping) -> dict:
    """Return the openpi-style config.json fields of a LeRobot π0.5 config.

    The result goes through the same config_from_json as an openpi folder: variants plus the
    sizes LeRobot names differently (chunk_size is openpi's action_horizon, ...).
    """
    fields = {k: data[k] for k in ('paligemma_variant', 'action_expert_variant',
                                   'oxygen_ros_config') if k in data}
    fields.update({ours: data[theirs] for theirs, ours in CONFIG_FIELDS.items()
                   if theirs in data})
    fields['discrete_state_input'] = True      # π0.5 always puts the state in the prompt
    return fields


# --- processor files ---------------------------------------------------------------------------
def _read_pipeline(path: Path, name: str, needed_for: str) -> dict:
    file = path / name
    if not file.is_file():
        raise LeRobotCheckpointError(f'LeRobot π0.5 checkpoint {path}: missing {name} '
                                     f'(needed for {needed_for})')
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise LeRobotCheckpointError(f'{file}: not valid JSON: {err}') from None
    if not isinstance(data, dict) or not isinstance(data.get('steps'), list):
        raise LeRobotCheckpointError(f'{file}: expected {{"steps": [...]}} at the top level')
    return data


def _step(pipeline: dict, registry_name: str) -> dict | None:
    for step in pipeline['steps']:
        if isinstance(step, dict) and step.get('registry_name') == registry_name:
            return step
    return None


def _stats_file(path: Path, pipeline_file: str, step_name: str, needed_for: str) -> Path:
    pipeline = _read_pipeline(path, pipeline_file, needed_for)
    step = _step(pipeline, step_name)
    if step is None or not step.get('state_file'):
        raise LeRobotCheckpointError(
            f'{path / pipeline_file}: no {step_name!r} step with a "state_file" (needed for '
            f'{needed_for})')
    file = path / step['state_file']
    if not file.is_file():
        raise LeRobotCheckpointError(f'LeRobot π0.5 checkpoint {path}: missing '
                                     f'{step["state_file"]} (named by {pipeline_file}; '
                                     f'needed for {needed_for})')
    return file


def _read_stats(file: Path, feature: str) -> NormStats:
    prefix = feature + '.'
    with safe_open(str(file), framework='np') as f:
        values = {key[len(prefix):]: f.get_tensor(key) for key in f.keys()
                  if key.startswith(prefix) and '.' not in key[len(prefix):]}
    if not values:
        raise LeRobotCheckpointError(f'{file}: no statistics for {feature!r} (expected keys '
                                     f'{prefix}q01, {prefix}q99, {prefix}mean, {prefix}std)')
    try:
        return NormStats(mean=values.get('mean'), std=values.get('std'),
                         q01=values.get('q01'), q99=values.get('q99'))
    except NormStatsError as err:
        raise LeRobotCheckpointError(f'{file} [{feature}]: {err}') from None


def load_norm_stats(path: str | os.PathLike) -> dict[str, NormStats]:
    """Read {'state', 'actions'} statistics from the processor files of a LeRobot folder."""
    path = Path(path)
    state_file = _stats_file(path, PREPROCESSOR_FILE, NORMALIZER_STEP,
                             f'the {STATE_KEY} normalizer statistics')
    action_file = _stats_file(path, POSTPROCESSOR_FILE, UNNORMALIZER_STEP,
                              f'the {ACTION_KEY} unnormalizer statistics')
    return {'state': _read_stats(state_file, STATE_KEY),
            'actions': _read_stats(action_file, ACTION_KEY)}


# --- tokenizer ---------------------------------------------------------------------------------
def tokenizer_name(path: str | os.PathLike) -> str:
    """Return the tokenizer the preprocessor names (LeRobot's default when it names none)."""
    try:
        pipeline = _read_pipeline(Path(path), PREPROCESSOR_FILE, 'the tokenizer name')
    except LeRobotCheckpointError:
        return DEFAULT_TOKENIZER_NAME
    step = _step(pipeline, TOKENIZER_STEP) or {}
    return str((step.get('config') or {}).get('tokenizer_name') or DEFAULT_TOKENIZER_NAME)


def hub_cache_dirs() -> list[Path]:
    """Hugging Face hub cache folders, as the hub library resolves them (no import of it)."""
    if os.environ.get('HF_HUB_CACHE'):
        return [Path(os.environ['HF_HUB_CACHE'])]
    home = os.environ.get('HF_HOME') or Path.home() / '.cache' / 'huggingface'
    return [Path(home) / 'hub']


def find_cached_tokenizer(name: str) -> Path | None:
    """`tokenizer.model` of hub repo `name` in the local hub cache (None: not cached)."""
    repo_dir = 'models--' + name.replace('/', '--')
    for cache in hub_cache_dirs():
        found = sorted((cache / repo_dir / 'snapshots').glob('*/tokenizer.model'))
        if found:
            return found[-1]
    return None
