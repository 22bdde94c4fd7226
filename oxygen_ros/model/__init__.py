"""π0.5 in plain PyTorch: config, model with explicit KV cache, and its I/O helpers.

The names below load on first use (PEP 562): importing a torch-free submodule such as
oxygen_ros.model.robot_spec (what the node's parameter checks read) does not import torch.
"""

import importlib

_EXPORTS = {
    'checkpoint': ('CheckpointError', 'load_pi05', 'LoadedPolicy', 'save_pi05'),
    'config': ('GemmaConfig', 'get_preset', 'Pi05Config', 'PRESETS', 'SiglipConfig'),
    'normalize': ('load_norm_stats', 'NormStats', 'save_norm_stats'),
    'pi05': ('KVTensors', 'Pi05Model', 'PrefixCache'),
    'robot_spec': ('get_robot', 'RobotSpec', 'RobotSpecError'),
    'robots': ('collate', 'ModelInputs', 'RobotAdapter', 'ROBOTS'),
    'tokenizer': ('PaligemmaTokenizer', 'train_tiny_tokenizer'),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF, key=str.lower)


def __getattr__(name):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    value = getattr(importlib.import_module(f'{__name__}.{module}'), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
