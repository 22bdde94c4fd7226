"""Test scaffolding: write a LeRobot π0.5 checkpoint folder from a Pi05Model, in LeRobot's layout.

What LeRobot's `save_pretrained` writes for `type: pi05` (see oxygen_ros.model.lerobot):
config.json with "type", model.safetensors with every openpi name under `model.`, and the
pre/post-processor pipelines whose normalizer steps keep their statistics in safetensors files
keyed '<feature>.<stat>'. The tokenizer is only named (PaliGemma's hub id).
"""

import json
from pathlib import Path

import numpy as np
import safetensors.numpy
import safetensors.torch

from oxygen_ros.model.checkpoint import to_file_key

TOKENIZER_NAME = 'google/paligemma-3b-pt-224'
PRE_STATS = 'policy_preprocessor_step_2_normalizer_processor.safetensors'
POST_STATS = 'policy_postprocessor_step_0_unnormalizer_processor.safetensors'


def _lerobot_config(config, cameras) -> dict:
    features = {f'observation.images.{cam}': {'type': 'VISUAL', 'shape': [3, 224, 224]}
                for cam in cameras}
    features['observation.state'] = {'type': 'STATE', 'shape': [config.action_dim]}
    return {
        'type': 'pi05',
        'n_obs_steps': 1,
        'input_features': features,
        'output_features': {'action': {'type': 'ACTION', 'shape': [config.action_dim]}},
        'paligemma_variant': 'gemma_2b',       # LeRobot's default; oxygen_ros_config decides
        'action_expert_variant': 'gemma_300m',
        'dtype': 'float32',
        'chunk_size': config.action_horizon,
        'n_action_steps': config.action_horizon,
        'max_state_dim': config.action_dim,
        'max_action_dim': config.action_dim,
        'num_inference_steps': config.num_steps,
        'tokenizer_max_length': config.max_token_len,
        'image_resolution': [224, 224],
        'normalization_mapping': {'VISUAL': 'IDENTITY', 'STATE': 'QUANTILES',
                                  'ACTION': 'QUANTILES'},
        # tiny test models have no named variant: their dims, as in our openpi files
        'oxygen_ros_config': config.to_dict(),
    }


def _stats_tensors(feature: str, stats) -> dict:
    out = {}
    for name in ('mean', 'std', 'q01', 'q99'):
        out[f'{feature}.{name}'] = np.asarray(getattr(stats, name), dtype=np.float32)
    # LeRobot keeps more statistics than π0.5 uses
    out[f'{feature}.min'] = out[f'{feature}.q01'] - 0.1
    out[f'{feature}.max'] = out[f'{feature}.q99'] + 0.1
    out[f'{feature}.q50'] = (out[f'{feature}.q01'] + out[f'{feature}.q99']) / 2
    return out


def save_lerobot_pi05(model, path, norm_stats, cameras=('image', 'wrist_image'),
                      tokenizer_name=TOKENIZER_NAME, embed_name=False) -> Path:
    """Write `model` and {'state', 'actions'} statistics as a LeRobot π0.5 folder.

    embed_name: store the tied embedding under embed_tokens instead of lm_head.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    tensors = {}
    for name, tensor in model.state_dict().items():
        key = name if embed_name else to_file_key(name)
        tensors['model.' + key] = tensor.detach().cpu().contiguous()
    safetensors.torch.save_file(tensors, str(path / 'model.safetensors'))
    (path / 'config.json').write_text(json.dumps(_lerobot_config(config, cameras), indent=2))

    image_stats = {f'observation.images.{cam}.mean': np.full((3, 1, 1), 0.5, np.float32)
                   for cam in cameras}
    safetensors.numpy.save_file(
        {**_stats_tensors('observation.state', norm_stats['state']),
         **_stats_tensors('action', norm_stats['actions']), **image_stats},
        str(path / PRE_STATS))
    safetensors.numpy.save_file(_stats_tensors('action', norm_stats['actions']),
                                str(path / POST_STATS))
    normalizer = {'eps': 1e-8, 'norm_map': {'VISUAL': 'IDENTITY', 'STATE': 'QUANTILES',
                                            'ACTION': 'QUANTILES'}}
    pre = {'name': 'policy_preprocessor', 'steps': [
        {'registry_name': 'rename_observations_processor', 'config': {'rename_map': {}}},
        {'registry_name': 'to_batch_processor', 'config': {}},
        {'registry_name': 'normalizer_processor', 'config': normalizer, 'state_file': PRE_STATS},
        {'registry_name': 'pi05_prepare_state_tokenizer_processor_step',
         'config': {'max_state_dim': config.action_dim, 'task_key': 'task'}},
        {'registry_name': 'tokenizer_processor',
         'config': {'tokenizer_name': tokenizer_name, 'max_length': config.max_token_len,
                    'padding_side': 'right', 'padding': 'max_length'}},
        {'registry_name': 'device_processor', 'config': {'device': 'cpu'}},
    ]}
    post = {'name': 'policy_postprocessor', 'steps': [
        {'registry_name': 'unnormalizer_processor', 'config': normalizer,
         'state_file': POST_STATS},
        {'registry_name': 'device_processor', 'config': {'device': 'cpu'}},
    ]}
    (path / 'policy_preprocessor.json').write_text(json.dumps(pre, indent=2))
    (path / 'policy_postprocessor.json').write_text(json.dumps(post, indent=2))
    return path


def put_in_hub_cache(hf_home, tokenizer_file, name=TOKENIZER_NAME) -> Path:
    """Place a SentencePiece file where the hub cache keeps `name`'s tokenizer.model."""
    snapshot = Path(hf_home) / 'hub' / ('models--' + name.replace('/', '--')) / 'snapshots' / 'abc'
    snapshot.mkdir(parents=True, exist_ok=True)
    target = snapshot / 'tokenizer.model'
    target.write_bytes(Path(tokenizer_file).read_bytes())
    return target
