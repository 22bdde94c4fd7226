"""A policy server speaking openpi's websocket protocol over the one frame loop (ROS-free)."""

from oxygen_ros.serve.observations import OBSERVATION_KEYS, RequestError, to_observation
from oxygen_ros.serve.server import PolicyServer, ServerConfig

__all__ = ['OBSERVATION_KEYS', 'PolicyServer', 'RequestError', 'ServerConfig',
           'to_observation']
