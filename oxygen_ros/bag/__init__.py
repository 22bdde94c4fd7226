"""Rosbag2 replay and recording without a ROS install (rosbags + the engine; no rclpy here).

Names are imported on first use, so `oxygen-ros` sub-commands that never touch a bag load
neither rosbags nor the engine through this package.
"""

import importlib

_EXPORTS = {
    'BagError': 'errors',
    'load_params': 'config', 'read_node_parameters': 'config', 'ReplayParams': 'config',
    'InputBag': 'reader', 'TopicSpec': 'reader',
    'make_typestore': 'typestore',
    'OutputBag': 'writer',
    'ObservationBuilder': 'replay', 'Replay': 'replay', 'ReplaySummary': 'replay',
    'run_replay': 'replay',
    'write_demo_bag': 'synthetic',
    'build_engine': 'replay',
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f'{__name__}.{_EXPORTS[name]}'), name)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
