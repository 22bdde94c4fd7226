"""π0.5 in plain PyTorch: config, model with explicit KV cache, and its I/O helpers."""

from .checkpoint import CheckpointError, load_pi05, LoadedPolicy, save_pi05
from .config import GemmaConfig, get_preset, Pi05Config, PRESETS, SiglipConfig
from .normalize import load_norm_stats, NormStats, save_norm_stats
from .pi05 import KVTensors, Pi05Model, PrefixCache
from .robots import collate, get_robot, ModelInputs, RobotAdapter, ROBOTS, RobotSpec
from .tokenizer import PaligemmaTokenizer, train_tiny_tokenizer

__all__ = [
    'CheckpointError', 'collate', 'GemmaConfig', 'get_preset', 'get_robot', 'KVTensors',
    'load_norm_stats', 'load_pi05', 'LoadedPolicy', 'ModelInputs', 'NormStats',
    'PaligemmaTokenizer', 'Pi05Config', 'Pi05Model', 'PrefixCache', 'PRESETS', 'RobotAdapter',
    'ROBOTS', 'RobotSpec', 'save_norm_stats', 'save_pi05', 'SiglipConfig',
    'train_tiny_tokenizer',
]
